"""Tests for icl_fast, the engine: its methods and lanes kernels against icl_ref.REFERENCE's on the
same inputs, its public functions against icl_ref's, and its threads: any thread count, concurrent
callers, the caller's BLAS limit and floating-point rules, failing chunks, fork and shutdown.

Tolerances (as in test_icl_ref.py):
    EXACT = 1e-12  relative to the largest entry: two float64 computations of one exact quantity in
                   another order (sums over prompts and over chunks reordered; rounding only)
"""
import ast
import contextlib
import math
import os
import pickle
import signal
import sys
import threading
import time
import warnings
from unittest import mock

import numpy as np
import pytest
from numpy.testing import assert_allclose
from threadpoolctl import threadpool_info, threadpool_limits

import icl_fast as fast
import icl_ref as ir

EXACT = 1e-12
HERE = os.path.dirname(os.path.abspath(__file__))
TWO_CORES = pytest.mark.skipif(len(fast._cores()) < 2, reason="needs two cores for two workers")


def problem(seed, B, d, n=6, L=2, H=1, scale=None):
    rng = np.random.default_rng(seed)
    Z, y = ir.sample_prompts(rng, B, n, np.eye(d), noise_std=0.3)
    P, Q = (0.5 / math.sqrt(d) if scale is None else scale) * rng.standard_normal((2, L, H, d + 1, d + 1))
    return P, Q, Z, y


def gram_form(Z):
    return ir.gram(Z), np.ascontiguousarray(Z[:, :, -1])


def assert_close(a, b):
    """Within EXACT of the largest entry of b (the reference)."""
    assert_allclose(a, b, rtol=0, atol=EXACT * np.max(np.abs(b)))


def assert_all_close(mine, ref):
    assert len(mine) == len(ref)
    for a, b in zip(mine, ref):
        assert_close(a, b)


def assert_identical(mine, other):
    assert len(mine) == len(other) and all(np.array_equal(a, b) for a, b in zip(mine, other))


def blas_threads():
    return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]


def worker_names():
    return [t.name for t in threading.enumerate() if t.name.startswith("icl_fast")]


def threads_running(owner, name, call, delay=0.0):
    """The names of the threads on which owner.name (a function of icl_fast's or a method of
    ir.REFERENCE) runs during call(), each run taking at least `delay` seconds."""
    original, seen = getattr(owner, name), set()

    def spy(*args, **kwargs):
        seen.add(threading.current_thread().name)
        time.sleep(delay)
        return original(*args, **kwargs)
    with mock.patch.object(owner, name, spy):
        call()
    return seen


class FakeBlas:
    """One BLAS library as icl_fast sees it, a (get, set) pair of its thread limit; `slow_get`
    makes the first get() wait, so that a second thread can enter meanwhile."""

    def __init__(self, limit, slow_get=0.0):
        self.limit, self.slow_get, self.gets, self.set_one = limit, slow_get, 0, threading.Event()

    def get(self):
        self.gets += 1
        if self.gets == 1:
            time.sleep(self.slow_get)
        else:                           # a later get() reads after the first caller set its limit
            self.set_one.wait(1.0)
        return self.limit

    def put(self, count):
        self.limit = count
        if count == 1:
            self.set_one.set()

    def installed(self):
        return mock.patch.dict(fast._BLAS, libraries=[(self.get, self.put)])


# ---------------------------------------------------------------------------------------------
# The engine seam: only icl_ref's public names (no MATH.md section)
# ---------------------------------------------------------------------------------------------

def test_icl_fast_uses_only_public_names_of_icl_ref():
    with open(os.path.join(HERE, "icl_fast.py")) as f:
        tree = ast.parse(f.read())
    private = sorted({node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                      and isinstance(node.value, ast.Name) and node.value.id == "ir" and node.attr.startswith("_")})
    assert private == []
    # each of icl_fast's functions is icl_ref's namesake with the engine
    for name in ("loss_and_grad", "loss_and_grad_gram", "residuals_and_jacobian", "residuals_and_jacobian_gram",
                 "loss_and_grad_activation", "identifiable_hessian", "sandwich_covariance", "train_lbfgs",
                 "train_gauss_newton"):
        assert getattr(fast, name).__name__ == name and f"icl_ref.{name}:" in getattr(fast, name).__doc__


def test_engine_has_the_methods_of_REFERENCE():
    methods = [name for name in vars(ir.ReferenceEngine) if not name.startswith("_")]
    assert len(methods) == 5 and all(callable(getattr(fast.engine(), name)) for name in methods)


# ---------------------------------------------------------------------------------------------
# §16 The same numbers: the engine's methods and kernels against REFERENCE's
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("H", [1, 2])
@pytest.mark.parametrize("d", [1, 2, 5, 9, 10, 11, pytest.param(12, marks=pytest.mark.slow), 20, 30])
def test_engine_equals_the_reference(d, H):
    # through icl_ref's public functions: lanes below the thresholds, icl_ref's layers on the chunks
    # above (d = 10, 11 on either side of LANES_MAX_D = 11); B = 700 makes several chunks in either
    P, Q, Z, y = problem(100 + d + H, 700, d, H=H)
    n = Z.shape[2] - 1
    S0, q0 = gram_form(Z)
    assert_all_close(fast.loss_and_grad(P, Q, Z, y), ir.loss_and_grad(P, Q, Z, y))
    assert_all_close(fast.loss_and_grad_gram(P, Q, S0, q0, y, n), ir.loss_and_grad_gram(P, Q, S0, q0, y, n))
    k = 60 if d >= 20 else 700                   # the Jacobian at d = 20 has 3528 columns per row
    assert_all_close(fast.residuals_and_jacobian(P, Q, Z[:k], y[:k]), ir.residuals_and_jacobian(P, Q, Z[:k], y[:k]))
    assert_all_close(fast.residuals_and_jacobian_gram(P, Q, S0[:k], q0[:k], y[:k], n),
                     ir.residuals_and_jacobian_gram(P, Q, S0[:k], q0[:k], y[:k], n))


# P 2^p, Q 2^q, Z 2^z and y 2^(t + z), with t = p + q + 2z the scale of T - I = (1/n) sum_h P_h S Q_h
# (S = Z M Z^T scales as 2^2z). With t = 0, T is unchanged in every layer; with one layer, only
# (T - I) q enters the residual (q_d = 0). Either way r = (T q)_d + y scales as 2^(t + z), the loss
# as 2^(2t + 2z), dP = (1/n) dT Q^T S as 2^(t + 4z + q), dQ as 2^(t + 4z + p), the Jacobian's rows as
# 2^(3z + q) and 2^(3z + p): powers of two, exact while all stay normal. The rows (p, q, z, L, with
# the loss): the data at about 1e-100 and 1e90 with T unchanged, where S times dT (about
# 2^4z) leaves float64's range though the results do not; then P kron Q (about 2^(p + q)) below
# float64's range, while T - I and the results are inside it (the last row's gradient of the loss
# would overflow, so it checks the Jacobian alone).
LANES_SCALES = [(332, 332, -332, 2, True), (-299, -299, 299, 2, True), (-581, -581, 332, 1, True),
                (-520, -520, 480, 1, False)]


@pytest.mark.parametrize("p,q,z,L,loss", LANES_SCALES)
def test_lanes_results_at_scales_far_from_one_equal_the_references(p, q, z, L, loss):
    # D = 3, two heads; B = 1200 makes 4 lanes chunks, the k-th prompts times 2^k so that the
    # chunks' scales differ; the public functions and the lanes functions on one and two threads
    P, Q, Z, y = problem(31, 1200, 2, L=L, H=2, scale=0.2)
    Z = Z * 2.0 ** (np.arange(1200) // 300)[:, None, None]
    t, n = p + q + 2 * z, Z.shape[2] - 1
    big = (np.ldexp(P, p), np.ldexp(Q, q), np.ldexp(Z, z), np.ldexp(y, t + z))
    gram_args = (*big[:2], *gram_form(big[2]), big[3], n)
    r, J = ir.residuals_and_jacobian(P, Q, Z, y)
    at_scale = ir.residuals_and_jacobian(*big)
    assert_all_close(at_scale, (np.ldexp(r, t + z), np.ldexp(J, 3 * z + np.r_[[q] * P.size, [p] * Q.size])))
    for threads in (1, 2):
        assert_all_close(fast.residuals_and_jacobian(*big, threads=threads), at_scale)
        r, JP, JQ = fast.lanes_jacobian_gram(*gram_args, threads=threads)
        assert_all_close((r, np.c_[JP.reshape(len(r), -1), JQ.reshape(len(r), -1)]), at_scale)
    if loss:
        f, dP, dQ = ir.loss_and_grad(P, Q, Z, y)
        at_scale = ir.loss_and_grad(*big)
        assert_all_close(at_scale, (np.ldexp(f, 2 * t + 2 * z), np.ldexp(dP, t + 4 * z + q),
                                    np.ldexp(dQ, t + 4 * z + p)))
        for threads in (1, 2):
            assert_all_close(fast.loss_and_grad(*big, threads=threads), at_scale)
            assert_all_close(fast.lanes_loss_and_grad_gram(*gram_args, threads=threads), at_scale)


@pytest.mark.parametrize("s", [1e-100, 1e-80])
def test_lanes_gradient_of_small_data_with_queries_at_the_inverse_square(s):
    # P, Q / s^2, Z s, y s: T, the residuals / s and dP / s^2 as at s = 1; dQ (about s^4) is below
    # float64's normal range, so only the loss and dP are compared
    P, Q, Z, y = problem(32, 100, 10, L=2, H=2, scale=0.1)
    for threads in (1, 2):
        loss, dP, _ = fast.loss_and_grad(P, Q / s ** 2, Z * s, y * s, threads=threads)
        ref_loss, ref_dP, _ = ir.loss_and_grad(P, Q / s ** 2, Z * s, y * s)
        assert np.max(np.abs(ref_dP)) > 0
        assert_all_close((loss, dP), (ref_loss, ref_dP))


@pytest.mark.parametrize("L,H", [(1, 1), (1, 3), (2, 2), (3, 1)])
def test_lanes_kernels_equal_REFERENCE_on_the_same_inputs(L, H):
    # the lanes loss, gradient, residuals and per-prompt gradients against REFERENCE's on one Gram
    # form, on one thread and on two (a chunk each; B = 1200 makes 4 lanes chunks at D = 4)
    P, Q, Z, y = problem(127 + L + H, 1200, 3, L=L, H=H, scale=0.4)
    args = (P, Q, *gram_form(Z), y, Z.shape[2] - 1)
    for threads in (1, 2):
        assert_all_close(fast.lanes_loss_and_grad_gram(*args, threads=threads), ir.REFERENCE.loss_and_grad_gram(*args))
        assert_all_close(fast.lanes_jacobian_gram(*args, threads=threads), ir.REFERENCE.jacobian_gram(*args))


def test_lanes_gram_equals_REFERENCE_and_the_lanes_read_it_without_changing_it():
    # D = 6 (engine.gram's lanes side, both evaluations lanes there): S_0 within EXACT of REFERENCE.gram's,
    # exactly symmetric, laid out with the prompts last; the lanes evaluations on it equal theirs on
    # REFERENCE's S_0, and leave it as it was though each chunk scales its copy of S_0 by a power of two
    # (data of scale 4: e != 0; and a batch of one prompt, whose chunk is the whole of S_0's memory)
    P, Q, Z, y = problem(31, 300, 5, scale=0.3)
    Z = 4.0 * Z
    assert fast.LANES_MAX_D_JACOBIAN >= 6 and len(fast._lanes_bounds(300, 6)) == 4
    for threads in (1, 2):
        S0 = fast.engine(threads).gram(Z)
        assert_close(S0, ir.REFERENCE.gram(Z))
        assert np.array_equal(S0, S0.transpose(0, 2, 1)) and S0.transpose(1, 2, 0).flags.c_contiguous
        kept, q0 = S0.copy(), np.ascontiguousarray(Z[:, :, -1])
        args = (P, Q, S0, q0, y, Z.shape[2] - 1)
        ref_args = (P, Q, ir.REFERENCE.gram(Z), q0, y, Z.shape[2] - 1)
        assert_all_close(fast.lanes_loss_and_grad_gram(*args, threads=threads), ir.REFERENCE.loss_and_grad_gram(*ref_args))
        assert_all_close(fast.lanes_jacobian_gram(*args, threads=threads), ir.REFERENCE.jacobian_gram(*ref_args))
        assert np.array_equal(S0, kept)
    one = fast.lanes_gram(Z[:1], threads=1)                # one prompt: its chunk's S_0 is all of S0's memory
    kept = one.copy()
    fast.lanes_loss_and_grad_gram(P, Q, one, np.ascontiguousarray(Z[:1, :, -1]), y[:1], Z.shape[2] - 1)
    assert np.array_equal(one, kept)


@TWO_CORES
def test_engine_methods_equal_REFERENCEs_on_the_same_inputs():
    # each of the five methods on two workers against REFERENCE's on the same inputs: sums over
    # chunks weighted by their shares (EXACT), concatenations
    mine, ref = fast.engine(2), ir.REFERENCE
    P, Q, Z, y = problem(3, 400, 19, n=4)                  # D = 20: icl_ref's layers on 4 chunks
    assert_close(mine.gram(Z), ref.gram(Z))
    args = (P, Q, *gram_form(Z), y, 4)
    assert_all_close(mine.loss_and_grad_gram(*args), ref.loss_and_grad_gram(*args))
    assert_all_close(mine.jacobian_gram(*args), ref.jacobian_gram(*args))
    P, Q, Z, y = problem(4, 1400, 2)                      # 1400 prompts: three explicit-attention chunks
    for activation in ("relu", "softmax"):
        for jacobian in (False, True):
            assert_all_close(mine.activation_pass(P, Q, Z, y, activation, jacobian),
                             ref.activation_pass(P, Q, Z, y, activation, jacobian))



@pytest.mark.parametrize("L,H", [(1, 1), (2, 2), (3, 1)])
@pytest.mark.parametrize("chunk,count", [(1, 150), (3000, 12), (fast.BATCH_FIRST_CHUNK, 4)])
def test_batch_first_equals_REFERENCE_on_the_same_inputs(L, H, chunk, count, monkeypatch):
    # icl_ref's layers on the engine's chunks (batch_first_chunk: the readout alone at L = 1) against
    # REFERENCE's methods on the same Gram form, on one thread and on two, at the engine's chunk
    # size (4 chunks of 38 or fewer prompts at D = 13, B = 150) and at smaller ones: one prompt per
    # chunk (150 chunks) and at most 3000 / D^2 = 17 prompts (12 chunks of 13, the last of 7). The
    # chunks only reorder the sums over prompts: the sums agree within EXACT, and the rows too
    monkeypatch.setattr(fast, "BATCH_FIRST_CHUNK", chunk)
    P, Q, Z, y = problem(140 + L + H, 150, 12, L=L, H=H, scale=0.2)
    args = (P, Q, *gram_form(Z), y, Z.shape[2] - 1)
    assert len(fast._batch_first_bounds(150, 13)) == count
    for threads in (1, 2):
        assert_all_close(fast.batch_first_loss_and_grad_gram(*args, threads=threads),
                         ir.REFERENCE.loss_and_grad_gram(*args))
        assert_all_close(fast.batch_first_jacobian_gram(*args, threads=threads), ir.REFERENCE.jacobian_gram(*args))


def test_batch_first_runs_icl_refs_layers_on_whole_chunks():
    # above LANES_MAX_D the engine hands each of its chunks to icl_ref's layers in one pass: every
    # layer_forward sees a whole chunk (at D = 21, B = 2000: 16 chunks of 125 prompts, at most
    # 2^16 / 21^2 = 148 each and a multiple of 4 of them, where the
    # reference's own chunks hold 2^18 / 21^3 = 28), not REFERENCE's re-chunked pieces
    P, Q, Z, y = problem(150, 2000, 20, L=3, scale=0.1)
    args = (P, Q, *gram_form(Z), y, Z.shape[2] - 1)
    sizes, original = [], ir.layer_forward

    def spy(P_l, Q_l, S, q, n):
        sizes.append(len(S))
        return original(P_l, Q_l, S, q, n)
    for method in ("loss_and_grad_gram", "jacobian_gram"):
        sizes.clear()
        with mock.patch.object(ir, "layer_forward", spy):
            getattr(fast.engine(2), method)(*args)
        assert sorted(sizes) == [125] * 32, (method, sizes)      # 16 chunks x 2 layers before the readout


def test_batch_first_chunks_are_equal_a_multiple_of_four_and_at_least_the_references():
    for B, D in ((20000, 21), (2000, 13), (7, 41), (1, 13), (20001, 64), (150, 13)):
        bounds = fast._batch_first_bounds(B, D)
        sizes = [b - a for a, b in bounds]
        assert bounds[0][0] == 0 and bounds[-1][1] == B
        assert all(bounds[i][1] == bounds[i + 1][0] for i in range(len(bounds) - 1))
        assert len(set(sizes[:-1])) <= 1 and sizes[-1] <= sizes[0] <= max(1, fast.BATCH_FIRST_CHUNK // D ** 2)
        assert B < 4 or len(bounds) % 4 == 0 or sizes[-1] < sizes[0]
    # wherever the batch-first layers run, a chunk holds at least the reference's own chunk of
    # 2^18 / D^3 prompts (fewer, larger products: less interpreter time per prompt)
    for D in range(fast.LANES_MAX_D + 1, 200):
        B = 40 * max(1, 2 ** 18 // D ** 3)
        assert fast._batch_first_bounds(B, D)[0][1] >= ir._chunks(B, D)[0][1], D


def test_batch_first_results_are_the_same_in_every_run():
    # the chunks' parts are added in chunk order, whichever worker finishes first: bit-identical
    # results in repeated runs on two workers and on one
    P, Q, Z, y = problem(151, 1200, 13, H=2, scale=0.2)
    args = (P, Q, *gram_form(Z), y, Z.shape[2] - 1)
    for method in ("loss_and_grad_gram", "jacobian_gram"):
        first = getattr(fast.engine(1), method)(*args)
        for _ in range(4):
            assert_identical(getattr(fast.engine(2), method)(*args), first)

@pytest.mark.parametrize("engine", [fast.engine(), ir.REFERENCE], ids=["icl_fast", "icl_ref"])
def test_reduced_least_squares_keeps_the_normal_equations_and_the_residual_norm(engine):
    # the contract Gauss-Newton relies on (MATH.md §6): R^T R = J^T J, R^T f = J^T r, |f| = |r|
    # (relative 1e-12: QR is backward stable)
    rng = np.random.default_rng(11)
    J, r = rng.standard_normal((4500, 7)), rng.standard_normal(4500)
    f, R = engine.reduced_least_squares(r, J)
    assert f.shape == (8,) and R.shape == (8, 7)
    assert_allclose(R.T @ R, J.T @ J, rtol=0, atol=1e-12 * np.max(np.abs(J.T @ J)))
    assert_allclose(R.T @ f, J.T @ r, rtol=0, atol=1e-12 * np.max(np.abs(J.T @ J)))
    assert f @ f == pytest.approx(r @ r, rel=1e-12)
    # the engine's factor is REFERENCE's itself, so Gauss-Newton takes the same path with either
    for rows in (5, 4500):
        assert_identical(engine.reduced_least_squares(r[:rows], J[:rows]),
                         ir.REFERENCE.reduced_least_squares(r[:rows], J[:rows]))


def test_lanes_thresholds():
    # on both sides of LANES_MAX_D (the loss) and LANES_MAX_D_JACOBIAN (the Jacobian), where the
    # formulation changes, the engine's numbers are REFERENCE's
    for D in (fast.LANES_MAX_D, fast.LANES_MAX_D + 1, fast.LANES_MAX_D_JACOBIAN, fast.LANES_MAX_D_JACOBIAN + 1):
        P, Q, Z, y = problem(128 + D, 40, D - 1, scale=0.1)
        args = (P, Q, *gram_form(Z), y, Z.shape[2] - 1)
        assert_all_close(fast.engine().loss_and_grad_gram(*args), ir.REFERENCE.loss_and_grad_gram(*args))
        assert_all_close(fast.engine().jacobian_gram(*args), ir.REFERENCE.jacobian_gram(*args))


@TWO_CORES
def test_small_evaluations_run_on_the_calling_thread():
    # an evaluation of B L D^3 multiply-adds (one head) below PARALLEL_MIN_WORK (the loss) or
    # PARALLEL_MIN_WORK_JACOBIAN (the Jacobian) runs on the calling thread, one at or above on the
    # workers; both sides run the same chunks, so the numbers are the same to the last bit
    P, Q, Z, y = problem(132, 6000, 5, L=2, H=1, scale=0.1)
    args = (P, Q, *gram_form(Z), y, Z.shape[2] - 1)
    per_prompt = 2 * 6 ** 3
    for method, min_work in (("loss_and_grad_gram", fast.PARALLEL_MIN_WORK),
                             ("jacobian_gram", fast.PARALLEL_MIN_WORK_JACOBIAN)):
        B = -(-min_work // per_prompt)                      # the first batch size at the threshold
        for b in (B - 1, B):
            chunk = (*args[:2], *(a[:b] for a in args[2:5]), args[5])
            seen = threads_running(fast, "lanes_forward", lambda: getattr(fast.engine(2), method)(*chunk))
            assert (seen == {threading.current_thread().name}) == (b < B), (method, b, seen)
        # on the workers or on the calling thread alone, the same chunks: the same numbers
        assert_identical(getattr(fast.engine(2), method)(*chunk), getattr(fast.engine(1), method)(*chunk))


def test_thread_count_does_not_change_results():
    # chunks depend on B and D only and are combined in chunk order: bit-identical results; the
    # sizes reach PARALLEL_MIN_WORK and PARALLEL_MIN_WORK_JACOBIAN, so that the workers share them
    for d, B, k in ((3, 18000, 3100), (16, 900, 300)):        # lanes; icl_ref's layers on chunks
        lanes = d + 1 <= fast.LANES_MAX_D                      # the lanes loss's work counts no heads
        assert B * 2 * (1 if lanes else 2) * (d + 1) ** 3 >= fast.PARALLEL_MIN_WORK
        assert k * 2 * 2 * (d + 1) ** 3 >= fast.PARALLEL_MIN_WORK_JACOBIAN
        P, Q, Z, y = problem(114 + d, B, d, H=2)
        runs = [fast.loss_and_grad(P, Q, Z, y, threads=t) for t in (1, 2, 3)]
        jac = [fast.residuals_and_jacobian(P, Q, Z[:k], y[:k], threads=t) for t in (1, 2)]
        for other in runs[1:]:
            assert_identical(other, runs[0])
        assert_identical(*jac)



@TWO_CORES
def test_the_work_that_reaches_the_workers_counts_the_heads_where_each_costs_its_own():
    # the lanes Jacobian forms each head's rows: B L H D^3, so with two heads the threshold is met at
    # half the prompts of one head; the lanes loss forms one kernel for every head, whose cost does not
    # grow with H: B L D^3, its threshold at the prompts of one head
    P, Q, Z, y = problem(133, 5000, 5, L=2, H=2, scale=0.1)
    args = (P, Q, *gram_form(Z), y, Z.shape[2] - 1)
    for method, min_work, heads in (("jacobian_gram", fast.PARALLEL_MIN_WORK_JACOBIAN, 2),
                                    ("loss_and_grad_gram", fast.PARALLEL_MIN_WORK, 1)):
        B = -(-min_work // (2 * heads * 6 ** 3))                # the first batch size at the threshold
        for b in (B - 1, B):
            chunk = (*args[:2], *(a[:b] for a in args[2:5]), args[5])
            seen = threads_running(fast, "lanes_forward", lambda: getattr(fast.engine(2), method)(*chunk))
            assert (seen == {threading.current_thread().name}) == (b < B), (method, b, seen)


@TWO_CORES
def test_the_batch_first_layers_count_every_head():
    # above LANES_MAX_D each head costs its own products in icl_ref's layers: B L H D^3
    D = fast.LANES_MAX_D + 1
    P, Q, Z, y = problem(134, 700, D - 1, n=4, L=1, H=2, scale=0.1)
    args = (P, Q, *gram_form(Z), y, Z.shape[2] - 1)
    B = -(-fast.PARALLEL_MIN_WORK // (2 * D ** 3))              # the first batch size at the threshold
    for b in (B - 1, B):
        chunk = (*args[:2], *(a[:b] for a in args[2:5]), args[5])
        seen = threads_running(fast, "batch_first_chunk", lambda: fast.engine(2).loss_and_grad_gram(*chunk))
        assert (seen == {threading.current_thread().name}) == (b < B), (b, seen)

# ---------------------------------------------------------------------------------------------
# §16 (iv) icl_ref's public functions with the engine: their checks and trainers
# ---------------------------------------------------------------------------------------------

def test_engine_uses_icl_refs_input_checks():
    P, Q, Z, y = problem(8, 20, 3)
    S0, q0 = gram_form(Z)
    Z_nan = Z.copy()
    Z_nan[-1, 0, 0] = np.nan
    for call, error, match in (
            (lambda: fast.loss_and_grad(P[0], Q, Z, y), ValueError, "P must have 4"),
            (lambda: fast.loss_and_grad(P, Q, Z, y[:3]), ValueError, "y must have shape"),
            (lambda: fast.loss_and_grad_gram(P, Q, S0 + np.triu(np.ones(4), 1), q0, y, 6), ValueError,
             "S0 must be symmetric"),
            (lambda: fast.residuals_and_jacobian(P, Q, Z, y, structure="sparse"), ValueError, "form of structure"),
            (lambda: fast.loss_and_grad(P * 1e80, Q * 1e80, Z, y), ValueError, "overflow"),
            (lambda: fast.loss_and_grad(P, Q, Z_nan, y), ValueError, "Z must be finite")):
        with pytest.raises(error, match=match):
            call()


@pytest.mark.parametrize("threads,error", [(0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError),
                                           ("2", TypeError)])
def test_threads_must_be_an_integer_of_at_least_one_or_None(threads, error):
    P, Q, Z, y = problem(8, 20, 3)
    for call in (lambda: fast.loss_and_grad(P, Q, Z, y, threads=threads),
                 lambda: fast.train_lbfgs(Z, y, 1, rng=np.random.default_rng(0), threads=threads),
                 lambda: fast.engine(threads)):
        with pytest.raises(error, match=r"threads must be an integer >= 1 or None"):
            call()
    assert fast.loss_and_grad(P, Q, Z, y, threads=np.int64(1))[0] == fast.loss_and_grad(P, Q, Z, y, threads=None)[0]


def test_engine_refuses_a_non_finite_Z_in_any_chunk():
    # a NaN or Inf in the last prompt of the last chunk, on one worker and on two: the ValueError
    # naming Z, before any evaluation
    rng = np.random.default_rng(131)
    for d, B in ((5, 6000), (17, 200)):
        P, Q = 0.1 * rng.standard_normal((2, 2, 1, d + 1, d + 1))
        Z, y = rng.standard_normal((B, d + 1, 4)), rng.standard_normal(B)
        for bad in (np.nan, np.inf, -np.inf):
            Z_bad = Z.copy()
            Z_bad[-1, 0, 0] = bad
            for threads in (1, 2):
                with pytest.raises(ValueError, match="Z must be finite"):
                    fast.loss_and_grad(P, Q, Z_bad, y, threads=threads)


def test_trainers_are_icl_refs_trainers_with_the_engines_evaluations():
    # the same L-BFGS-B and trust-region runs; the evaluations differ from the reference's only in
    # rounding (EXACT above), which 30 iterations amplify to far less than 1e-9 of the coordinates
    rng = np.random.default_rng(9)
    Z, y = ir.sample_prompts(rng, 500, 8, np.eye(3))
    A0 = 0.2 * rng.standard_normal((2, 3, 3))
    for trainer, options in (("train_lbfgs", dict(maxiter=30)), ("train_gauss_newton", dict(max_nfev=8))):
        mine = getattr(fast, trainer)(Z, y, 2, init={"A": A0}, **options)
        ref = getattr(ir, trainer)(Z, y, 2, init={"A": A0}, **options)
        assert set(mine) == set(ref) and mine["nit"] == ref["nit"] and mine["success"] == ref["success"]
        assert_allclose(mine["coords"]["A"], ref["coords"]["A"], rtol=0, atol=1e-9)
        assert mine["loss"] == pytest.approx(ref["loss"], rel=1e-9)
    # the sandwich's Hessian is a central difference of the gradient at h = 1e-5, which divides the
    # gradients' rounding difference (EXACT relative) by 2h: EXACT / 2h = 5e-8, so 1e-7 of the largest entry
    fitted = ir.train_gauss_newton(Z, y, 2, init={"A": A0})["coords"]
    cov, ref = fast.sandwich_covariance("sparse", fitted, Z, y), ir.sandwich_covariance("sparse", fitted, Z, y)
    assert_allclose(cov, ref, rtol=0, atol=1e-7 * np.max(np.abs(ref)))
    hess = fast.identifiable_hessian("sparse", fitted, Z[:200], y[:200], activation="relu")
    ref = ir.identifiable_hessian("sparse", fitted, Z[:200], y[:200], activation="relu")
    assert_allclose(hess["hessian"], ref["hessian"], rtol=0, atol=1e-7 * np.max(np.abs(ref["hessian"])))


def test_every_function_passes_its_thread_count_to_every_method():
    # threads=1 starts no worker thread in any method; threads=2 does (where there are two cores)
    fast.shutdown()
    P, Q, Z, y = problem(21, 3000, 3)
    S0, q0 = gram_form(Z)
    J, r = np.random.default_rng(21).standard_normal((4500, 7)), np.ones(4500)
    calls = [lambda e: e.gram(Z), lambda e: e.loss_and_grad_gram(P, Q, S0, q0, y, 6),
             lambda e: e.jacobian_gram(P, Q, S0, q0, y, 6), lambda e: e.activation_pass(P, Q, Z, y, "relu"),
             lambda e: e.reduced_least_squares(r, J)]
    for call in calls:
        call(fast.engine(1))
    fast.loss_and_grad(P, Q, Z, y, threads=1)
    assert worker_names() == []
    if len(fast._cores()) >= 2:
        fast.engine(2).gram(Z)
        assert worker_names()


# ---------------------------------------------------------------------------------------------
# Threads: the workers, their count, failures, floating-point rules (machinery: MATH.md's notes on the code)
# ---------------------------------------------------------------------------------------------

def test_threads_above_the_cores_are_capped():
    # 16 chunks of 20 ms each on an engine asked for 1000 threads run on no more threads than cores
    P, Q, Z, y = problem(12, 16 * 81, 19, n=5)             # D = 20: 16 chunks of 2^15 / 400 = 81 prompts

    seen = threads_running(ir.REFERENCE, "gram", lambda: fast.engine(1000).gram(Z), delay=0.02)
    assert 1 <= len(seen) <= len(fast._cores()), seen
    assert fast.engine(10 ** 6).threads == len(fast._cores())


@pytest.mark.parametrize("failing", [0, 1])
def test_a_failing_chunk_stops_the_workers_and_its_error_reaches_the_caller(failing):
    # the workers claim chunks from one counter; the results come back in chunk order; once chunk 0
    # (on the first worker) or chunk 1 (on the second) fails no worker starts another, and the
    # error is the caller's (without the stop the other worker would go on through 100 chunks)
    bounds = [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert fast._map(lambda a, b: (a, b), bounds, 2) == bounds
    started = []

    def chunk(a, b):
        started.append(a)
        if a == failing:
            time.sleep(0.01 * failing)
            raise RuntimeError(f"chunk {a} failed")
        time.sleep(0.05)
    with pytest.raises(RuntimeError, match=f"chunk {failing} failed"):
        fast._map(chunk, [(c, c + 1) for c in range(100)], 2)
    time.sleep(0.25)
    assert failing in started and len(started) <= 4, started


@TWO_CORES
def test_workers_compute_under_the_callers_floating_point_rules():
    # the engine, like REFERENCE, computes under the calling thread's rules, on any thread: a caller
    # that ignores overflow gets no warning from a worker (whose own default would warn), one that
    # warns gets the warning; under icl_ref's public functions (which ignore it and then report it)
    # no worker warns. 5000 prompts reach the workers
    P, Q, Z, y = problem(22, 5000, 5, scale=1e60)
    args = (P, Q, *gram_form(Z), y, Z.shape[2] - 1)
    for method in (fast.engine(2).loss_and_grad_gram, ir.REFERENCE.loss_and_grad_gram):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with np.errstate(over="ignore", invalid="ignore"):
                assert not np.isfinite(method(*args)[0])
            with np.errstate(over="warn", invalid="warn"):
                with pytest.raises(RuntimeWarning, match="overflow|invalid"):
                    method(*args)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="overflow"):
            fast.loss_and_grad(P, Q, Z, y, threads=2)


def test_results_do_not_depend_on_the_callers_floating_point_settings():
    # a caller that raises on every floating-point event (strict test suites) gets the results of
    # the default settings, on one thread and on two, and keeps its settings: softmax attention
    # whose exponentials underflow, and prompts of scale 1e-120 whose products underflow
    P, Q, Z, y = problem(23, 3000, 3, L=1, scale=30.0)
    tiny = problem(24, 6000, 5)
    tiny = (*tiny[:2], 1e-120 * tiny[2], 1e-120 * tiny[3])
    # (scores ~ -1e3 underflow exp; the tiny prompts' products of three entries fall below 1e-308)
    cases = [lambda t: fast.loss_and_grad_activation(P, Q, Z, y, "softmax", threads=t),
             lambda t: fast.residuals_and_jacobian(P, Q, Z[:300], y[:300], activation="softmax", threads=t),
             lambda t: fast.loss_and_grad(*tiny, threads=t)]
    default = [[case(t) for case in cases] for t in (1, 2)]
    old = np.seterr(all="raise")
    try:
        strict = [[case(t) for case in cases] for t in (1, 2)]
        assert np.geterr() == dict(divide="raise", over="raise", under="raise", invalid="raise")
    finally:
        np.seterr(**old)
    for got, want in zip(strict, default):
        for a, b in zip(got, want):
            assert_identical(a, b)
    assert default[0][2][0] > 0                                # the tiny prompts' loss did not underflow to 0


# ---------------------------------------------------------------------------------------------
# BLAS limits: held at one thread, the caller's restored, concurrent callers, fork (machinery: MATH.md's
# notes on the code)
# ---------------------------------------------------------------------------------------------

def test_concurrent_calls_equal_serial_and_leave_blas_limits_as_found():
    # four Python threads evaluate at once while a fifth polls the BLAS setting; every result equals
    # the serial one bit for bit and the limit found (2 threads) is back afterwards; B L D^3 above
    # PARALLEL_MIN_WORK, so that each call hands its chunks to the workers
    P, Q, Z, y = problem(5, 6000, 5)
    serial = fast.loss_and_grad(P, Q, Z, y)
    with threadpool_limits(limits=2, user_api="blas"):
        before, results, errors, done = blas_threads(), [], [], threading.Event()

        def call():
            try:
                for _ in range(5):
                    results.append(fast.loss_and_grad(P, Q, Z, y))
            except Exception as e:                               # pragma: no cover - reported below
                errors.append(e)

        def poll():
            while not done.is_set():
                threadpool_info()
        poller = threading.Thread(target=poll)
        poller.start()
        callers = [threading.Thread(target=call) for _ in range(4)]
        for t in callers:
            t.start()
        for t in callers:
            t.join()
        done.set()
        poller.join()
        assert not errors and len(results) == 20
        assert blas_threads() == before
    for res in results:
        assert_identical(res, serial)


def test_training_holds_blas_at_one_thread_and_restores_the_callers_setting():
    rng = np.random.default_rng(115)
    Z, y = ir.sample_prompts(rng, 50, 8, np.eye(3))
    seen, lanes = [], fast.lanes_loss_and_grad_gram

    def spy(*args, **kwargs):
        seen.append(max(blas_threads()))
        return lanes(*args, **kwargs)
    with threadpool_limits(limits=2, user_api="blas"):
        before = blas_threads()
        with mock.patch.object(fast, "lanes_loss_and_grad_gram", spy):
            fast.train_lbfgs(Z, y, 1, rng=rng, maxiter=3)
        assert blas_threads() == before
    assert seen and set(seen) == {1}


@pytest.mark.parametrize("method, spied", [("loss_and_grad_gram", ("kernel_forward", "kernel_backward")),
                                           ("jacobian_gram", ("kernel_forward",))])
def test_engine_methods_form_the_lanes_kernels_with_blas_at_one_thread(method, spied):
    # rule (iii) for the whole evaluation, also where icl_ref's functions call the engine's methods
    # (engine=) with no wrapper of icl_fast's around them: the layers' kernels (and, for the loss, the
    # kernels' adjoints summed over the chunks) are products outside the chunks (BLAS threads them from
    # D = 9), formed with BLAS at one thread and the caller's setting back afterwards
    P, Q, Z, y = problem(3, 40, 2)
    args = (P, Q, ir.gram(Z), np.ascontiguousarray(Z[:, :, -1]), y, Z.shape[2] - 1)
    seen = {name: [] for name in spied}

    def spy(name, original):
        def call(*a):
            seen[name].append(max(blas_threads()))
            return original(*a)
        return call
    with threadpool_limits(limits=2, user_api="blas"):
        before = blas_threads()
        with contextlib.ExitStack() as stack:
            for name in spied:
                stack.enter_context(mock.patch.object(fast, name, spy(name, getattr(fast, name))))
            getattr(fast.engine(1), method)(*args)
        assert blas_threads() == before
    assert all(seen[name] and set(seen[name]) == {1} for name in spied), seen


def test_overlapping_holders_count_under_the_lock():
    # a slow BLAS getter: while the first holder reads the limit, a second thread enters; it must
    # wait for the count, or it would save the first holder's 1 as the caller's limit
    blas = FakeBlas(4, slow_get=0.2)
    with blas.installed():
        first_in, release = threading.Event(), threading.Event()

        def hold():
            with fast._one_blas_thread():
                first_in.set()
                release.wait(5)
        holder = threading.Thread(target=hold)
        holder.start()
        time.sleep(0.05)                                     # the holder is inside the slow get()
        with fast._one_blas_thread():
            assert blas.limit == 1
        first_in.wait(5)
        release.set()
        holder.join()
    assert blas.limit == 4 and fast._BLAS["users"] == 0


def test_a_limit_the_caller_sets_during_a_call_is_kept():
    # icl_fast restores the limit it found only where the limit is still its own 1
    for changed in (None, 3):
        blas = FakeBlas(4)
        with blas.installed():
            with fast._one_blas_thread():
                assert blas.limit == 1
                if changed:
                    blas.put(changed)                        # the caller, from another thread
        assert blas.limit == (changed or 4)


def _fork_with_alarm(seconds):
    """os.fork() with Python 3.12+'s warning that a fork with live threads may deadlock silenced (the
    case under test); in the child an alarm ends it after `seconds` if it hangs (no report: a failure)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        signal.alarm(seconds)
    return pid


def _report_of(pid, read, write):
    """In the parent: the child's pickled report from the pipe, None if it wrote none, once it ended."""
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        report = pipe.read()
    os.waitpid(pid, 0)
    return pickle.loads(report) if report else None


@pytest.mark.skipif(not hasattr(os, "fork") or len(fast._cores()) < 2, reason="needs fork and two cores")
def test_a_fork_during_an_evaluation():
    # a thread is inside an evaluation (held in its first chunk) with BLAS at one thread when the
    # process forks: the child has the limit found before the call and evaluates on its own workers
    P, Q, Z, y = problem(25, 6000, 5)
    expected = fast.loss_and_grad(P, Q, Z, y, threads=2)[0]
    inside, release, forward = threading.Event(), threading.Event(), fast.lanes_forward

    def held(*args, **kwargs):
        if threading.current_thread() is caller:
            inside.set()
            release.wait(30)
        return forward(*args, **kwargs)
    with threadpool_limits(limits=2, user_api="blas"):
        before = blas_threads()
        with mock.patch.object(fast, "lanes_forward", held):
            caller = threading.Thread(target=lambda: fast.loss_and_grad(P, Q, Z, y, threads=1))
            caller.start()
            assert inside.wait(30)
            assert set(blas_threads()) == {1}
            read, write = os.pipe()
            pid = _fork_with_alarm(60)
            if pid == 0:                                     # the child
                try:
                    report = (blas_threads(), fast.loss_and_grad(P, Q, Z, y, threads=2)[0], blas_threads())
                    os.write(write, pickle.dumps(report))
                finally:
                    os._exit(0)
            try:
                report = _report_of(pid, read, write)
            finally:
                release.set()
                caller.join()
        assert blas_threads() == before
    assert report == (before, expected, before)


def _loss_on_two_workers(args):
    return fast.loss_and_grad(*args, threads=2)[0]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_shutdown_ends_the_workers_and_a_forked_child_starts_its_own():
    import multiprocessing
    P, Q, Z, y = problem(117, 6000, 5)                     # above PARALLEL_MIN_WORK: on the workers
    # the child receives its arguments pickled, as C-ordered arrays; NumPy's loops may sum in
    # another order over another memory layout, so the parent's Z has that layout too
    Z = np.ascontiguousarray(Z)
    here = _loss_on_two_workers((P, Q, Z, y))
    assert worker_names() or len(fast._cores()) < 2       # the pool is kept between calls
    with warnings.catch_warnings():
        # Python 3.12+ warns that a fork with live threads may deadlock: the case under test
        warnings.simplefilter("ignore", DeprecationWarning)
        with multiprocessing.get_context("fork").Pool(1) as child:
            assert child.apply_async(_loss_on_two_workers, ((P, Q, Z, y),)).get(timeout=60) == here
    fast.shutdown()
    assert not worker_names()                              # no threads of icl_fast's are left
    assert _loss_on_two_workers((P, Q, Z, y)) == here         # and the pool starts again


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs thread affinity and two cores")
def test_one_worker_per_core_binds_each_worker_to_its_own_core():
    # with one worker per core, worker k runs on the k-th core; a barrier makes every worker take
    # one chunk, and each reports the cores it may run on
    fast.shutdown()
    cores = sorted(os.sched_getaffinity(0))
    barrier = threading.Barrier(len(cores), timeout=30)

    def where(a, b):
        barrier.wait()
        return frozenset(os.sched_getaffinity(0))
    bounds = [(c, c + 1) for c in range(len(cores))]
    assert sorted(fast._map(where, bounds, None), key=min) == [frozenset({c}) for c in cores]
    assert os.sched_getaffinity(0) == set(cores)              # the caller's own affinity is untouched



@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_child_forked_inside_a_call_has_the_limit_found_and_its_own_count_and_lock():
    # forked while this thread holds BLAS at one thread: the child (which has no such call) restores
    # the limit found, starts its count at 0 and has a lock of its own, so its own calls limit BLAS
    # and restore it (a child that inherits the held lock would wait forever: the alarm ends it)
    blas = FakeBlas(4)
    with blas.installed():
        with fast._one_blas_thread():
            read, write = os.pipe()
            pid = _fork_with_alarm(20)
            if pid == 0:                                     # the child
                try:
                    report = [blas.limit, fast._BLAS["users"]]
                    with fast._one_blas_thread():
                        report.append(blas.limit)
                    report.append(blas.limit)
                    os.write(write, pickle.dumps(report))
                finally:
                    os._exit(0)
            report = _report_of(pid, read, write)
            assert blas.limit == 1                           # the parent's call still holds it
    assert report == [4, 0, 1, 4]
    assert blas.limit == 4


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_child_forked_inside_a_holder_leaves_it_uncounted():
    # a bare os.fork() inside a holder (a training callback's, say), the child then leaving it: the
    # child restored the limit and counted 0 when forked, so leaving the parent's holder changes
    # neither, and the child's own holders still set one thread and restore the limit
    blas = FakeBlas(4)
    with blas.installed():
        read, write = os.pipe()
        with fast._one_blas_thread():
            pid = _fork_with_alarm(20)                       # the child's alarm set before it leaves, too
        if pid == 0:                                         # the child, out of the parent's holder
            try:
                report = [fast._BLAS["users"], blas.limit]
                with fast._one_blas_thread():
                    report.append(blas.limit)
                report += [fast._BLAS["users"], blas.limit]
                os.write(write, pickle.dumps(report))
            finally:
                os._exit(0)
        report = _report_of(pid, read, write)
        assert blas.limit == 4 and fast._BLAS["users"] == 0  # the parent's holder counted and restored
    assert report == [0, 4, 1, 0, 4]


# ---------------------------------------------------------------------------------------------
# §16 The lanes formulation, piece by piece
# ---------------------------------------------------------------------------------------------

def test_kernel_vec_identity_is_row_major():
    # vec(A X B) = (A kron B^T) vec(X) for NumPy's row-major reshape, and K applies
    # (1/n) sum_h P_h S Q_h to S; kernel_backward is its adjoint: <dK, K(P, Q)> is bilinear
    rng = np.random.default_rng(100)
    A, X, Bm = rng.standard_normal((3, 4, 4))
    assert_allclose(np.kron(A, Bm.T) @ X.reshape(-1), (A @ X @ Bm).reshape(-1), rtol=EXACT, atol=0)
    P, Q = rng.standard_normal((2, 3, 4, 4))
    S = X + X.T
    direct = sum(P_h @ S @ Q_h for P_h, Q_h in zip(P, Q)) / 7
    assert_allclose(fast.kernel_forward(P, Q, 7) @ S.reshape(-1), direct.reshape(-1), rtol=EXACT, atol=EXACT)
    dK = rng.standard_normal((16, 16))
    dP, dQ = fast.kernel_backward(dK, P, Q, 7)
    # d/dt <dK, K(P + t E, Q)> at t = 0 is <dP, E>: K is linear in P, so the difference is exact
    E = rng.standard_normal(P.shape)
    change = np.sum(dK * (fast.kernel_forward(P + E, Q, 7) - fast.kernel_forward(P, Q, 7)))
    assert change == pytest.approx(np.sum(dP * E), rel=EXACT)
    change = np.sum(dK * (fast.kernel_forward(P, Q + E, 7) - fast.kernel_forward(P, Q, 7)))
    assert change == pytest.approx(np.sum(dQ * E), rel=EXACT)


def test_symmetric_coordinates():
    # s = vec(S)[upper], vec(S) = s[full] = E s, exactly, and the maps are read-only
    rng = np.random.default_rng(126)
    for D in (1, 2, 4):
        upper, full, E, diagonal = fast.symmetric_coordinates(D)
        X = rng.standard_normal((D, D))
        X += X.T
        s = X.reshape(-1)[upper]
        assert len(s) == D * (D + 1) // 2 and np.array_equal(s, X[np.triu_indices(D)])
        assert np.array_equal(s[full], X.reshape(-1)) and np.array_equal(E @ s, X.reshape(-1))
        assert np.array_equal(diagonal, np.triu_indices(D)[0] == np.triu_indices(D)[1])
        with pytest.raises(ValueError):
            E[0, 0] = 2.0                                    # the cached maps are read-only


@pytest.mark.parametrize("L,H", [(1, 1), (1, 3), (2, 2), (4, 2)])
def test_lanes_pair_against_the_reference_layers(L, H):
    # layer by layer, lanes_forward gives icl_ref.layer_forward's S', q' (the last layer
    # readout_forward's (T q)_d), and the lanes reverse pass from the same seed the same
    # G = dS + dS^T, dq, and through the kernel the same dP_l, dQ_l; EXACT relative (sums reordered)
    P, Q, Z, y = problem(127 + L + H, 9, 3, L=L, H=H, scale=0.4)
    n, D = Z.shape[2] - 1, 4
    upper, _, E, _ = fast.symmetric_coordinates(D)
    S, q = gram_form(Z)
    St, qt = np.ascontiguousarray(S.transpose(1, 2, 0)), np.ascontiguousarray(q.T)
    st = St.reshape(D * D, -1)[upper]
    caches, lanes = [], []
    for l in range(L):
        last = l == L - 1
        if last:
            out, cache = ir.readout_forward(P[l], Q[l], S, q, n)
        else:
            S, q, _, cache = ir.layer_forward(P[l], Q[l], S, q, n)
        St, st, qt, lcache = fast.lanes_forward(fast.kernel_forward(P[l], Q[l], n) @ E, St, st, qt, last=last)
        caches.append(cache)
        lanes.append(lcache)
        if not last:
            assert_close(St, S.transpose(1, 2, 0))
            assert_close(qt, q.T)
            assert np.array_equal(St, St.transpose(1, 0, 2))     # S' exactly symmetric
            assert np.array_equal(st, St.reshape(D * D, -1)[upper])
    assert St is None and st is None
    assert_close(qt, out)
    seed = 2 * (out + y) / len(y)
    dS, dq, dP_l, dQ_l = ir.readout_backward(seed, caches[-1])
    G, dqt, dK_s = fast.lanes_backward(None, seed, lanes[-1], first=L == 1)
    for l in reversed(range(L)):
        if l < L - 1:
            dS, dq, dP_l, dQ_l = ir.layer_backward(dS, dq, caches[l], need_dS=l > 0)
            G, dqt, dK_s = fast.lanes_backward(G, dqt, lanes[l], first=l == 0)
        dP_k, dQ_k = fast.kernel_backward(dK_s @ E.T, P[l], Q[l], n)
        assert_close(dP_k, dP_l)
        assert_close(dQ_k, dQ_l)
        if l > 0:
            assert_close(G, (dS + dS.transpose(0, 2, 1)).transpose(1, 2, 0))
            assert np.array_equal(G, G.transpose(1, 0, 2))
            assert_close(dqt, dq.T)
        else:
            assert G is None and dqt is None                 # S_0, q_0 are data


def test_lanes_chunks_are_equal_a_multiple_of_four_and_cover_the_batch():
    for B, D in ((4000, 6), (7, 6), (20001, 3), (1, 13)):
        bounds = fast._lanes_bounds(B, D)
        sizes = [b - a for a, b in bounds]
        assert bounds[0][0] == 0 and bounds[-1][1] == B
        assert all(bounds[i][1] == bounds[i + 1][0] for i in range(len(bounds) - 1))
        assert len(set(sizes[:-1])) <= 1 and sizes[-1] <= sizes[0] <= max(1, fast.LANES_CHUNK // D ** 2)
        assert B < 4 or len(bounds) % 4 == 0 or sizes[-1] < sizes[0]


def test_importing_the_engine_does_not_change_the_reference():
    # icl_ref imports nothing of the engine's: no threads, no threadpoolctl, no icl_fast
    import subprocess
    code = ("import sys, threading, icl_ref; "
            "print(threading.active_count(), 'threadpoolctl' in sys.modules, 'icl_fast' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=HERE,
                         check=True).stdout.split()
    assert out == ["1", "False", "False"]
