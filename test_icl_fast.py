"""Tests for icl_fast, the engine: the same numbers as icl_ref through the public functions, for any
thread count and from concurrent callers, and the lanes formulation against the reference's layers.

Tolerances (as in test_icl_ref.py):
    EXACT = 1e-12  relative to the largest entry: two float64 computations of one exact quantity in
                   another order (rounding only)
"""
import math
import os
import sys
import threading
import time
import types
import warnings
from unittest import mock

import numpy as np
import pytest
from numpy.testing import assert_allclose
from threadpoolctl import threadpool_info, threadpool_limits

import icl_fast as fast
import icl_ref as ir

EXACT = 1e-12


def problem(seed, B, d, n=6, L=2, H=1, scale=None):
    rng = np.random.default_rng(seed)
    Z, y = ir.sample_prompts(rng, B, n, np.eye(d), noise_std=0.3)
    P, Q = (0.5 / math.sqrt(d) if scale is None else scale) * rng.standard_normal((2, L, H, d + 1, d + 1))
    return P, Q, Z, y


def assert_close(a, b):
    """Within EXACT of the largest entry of b (the reference)."""
    assert_allclose(a, b, rtol=0, atol=EXACT * np.max(np.abs(b)))


def blas_threads():
    return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]


# ---------------------------------------------------------------------------------------------
# The same functions, the same numbers (MATH.md §3.2)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("H", [1, 2])
@pytest.mark.parametrize("d", [1, 2, 5, 9, 12, 20])
def test_engine_equals_the_reference(d, H):
    # lanes below the thresholds (d <= 16 for the loss, d <= 6 for the Jacobian), the reference's
    # chunks on the workers above; B = 700 makes several chunks in either (lanes 4, reference >= 4)
    P, Q, Z, y = problem(100 + d + H, 700, d, H=H)
    n = Z.shape[2] - 1
    S0, q0 = ir.gram(Z), np.ascontiguousarray(Z[:, :, n])
    for mine, ref in ((fast.loss_and_grad(P, Q, Z, y), ir.loss_and_grad(P, Q, Z, y)),
                      (fast.loss_and_grad_gram(P, Q, S0, q0, y, n), ir.loss_and_grad_gram(P, Q, S0, q0, y, n))):
        for a, b in zip(mine, ref):
            assert_close(a, b)
    k = 60 if d == 20 else 700                   # the Jacobian at d = 20 has 3528 columns per row
    for mine, ref in ((fast.residuals_and_jacobian(P, Q, Z[:k], y[:k]), ir.residuals_and_jacobian(P, Q, Z[:k], y[:k])),
                      (fast.residuals_and_jacobian_gram(P, Q, S0[:k], q0[:k], y[:k], n),
                       ir.residuals_and_jacobian_gram(P, Q, S0[:k], q0[:k], y[:k], n))):
        for a, b in zip(mine, ref):
            assert_close(a, b)


@pytest.mark.parametrize("structure", ["sparse", "blocks"])
def test_engine_jacobian_in_structure_coordinates_and_with_an_activation(structure):
    rng = np.random.default_rng(7)
    Z, y = ir.sample_prompts(rng, 300, 5, np.eye(3))
    P, Q = ir.block_params(*(0.4 * rng.standard_normal((2, 2, 3, 3))))
    if structure == "sparse":
        P, Q = ir.sparse_params(-Q[:, 0, :3, :3])
    for a, b in zip(fast.residuals_and_jacobian(P, Q, Z, y, structure=structure),
                    ir.residuals_and_jacobian(P, Q, Z, y, structure=structure)):
        assert_close(a, b)
    for a, b in zip(fast.residuals_and_jacobian(P, Q, Z, y, structure=structure, activation="softmax"),
                    ir.residuals_and_jacobian(P, Q, Z, y, structure=structure, activation="softmax")):
        assert_close(a, b)
    for a, b in zip(fast.loss_and_grad_activation(P, Q, Z, y, "relu"), ir.loss_and_grad_activation(P, Q, Z, y, "relu")):
        assert_close(a, b)
    # a batch of several explicit-attention chunks (910 prompts each at n = 5): each chunk's share
    # is divided by the whole batch
    Z2, y2 = ir.sample_prompts(rng, 2000, 5, np.eye(3))
    for a, b in zip(fast.loss_and_grad_activation(P, Q, Z2, y2, "softmax"), ir.loss_and_grad_activation(P, Q, Z2, y2, "softmax")):
        assert_close(a, b)


@pytest.mark.parametrize("engine", [fast.engine(), ir.REFERENCE], ids=["icl_fast", "icl_ref"])
def test_reduced_least_squares_keeps_the_normal_equations_and_the_residual_norm(engine):
    # the contract Gauss-Newton relies on (MATH.md §6): R^T R = J^T J, R^T f = J^T r, |f| = |r|;
    # 4500 rows make icl_fast's tall-skinny QR stack three blocks (relative 1e-12: QR is backward stable)
    rng = np.random.default_rng(11)
    J, r = rng.standard_normal((4500, 7)), rng.standard_normal(4500)
    f, R = engine.reduced_least_squares(r, J)
    assert f.shape == (8,) and R.shape == (8, 7)
    assert_allclose(R.T @ R, J.T @ J, rtol=0, atol=1e-12 * np.max(np.abs(J.T @ J)))
    assert_allclose(R.T @ f, J.T @ r, rtol=0, atol=1e-12 * np.max(np.abs(J.T @ J)))
    assert f @ f == pytest.approx(r @ r, rel=1e-12)


def test_engine_uses_icl_refs_input_checks():
    P, Q, Z, y = problem(8, 20, 3)
    S0, q0 = ir.gram(Z), np.ascontiguousarray(Z[:, :, -1])
    for call, error, match in (
            (lambda: fast.loss_and_grad(P[0], Q, Z, y), ValueError, "P must have 4"),
            (lambda: fast.loss_and_grad(P, Q, Z, y[:3]), ValueError, "y must have shape"),
            (lambda: fast.loss_and_grad_gram(P, Q, S0 + np.triu(np.ones(4), 1), q0, y, 6), ValueError,
             "S0 must be symmetric"),
            (lambda: fast.residuals_and_jacobian(P, Q, Z, y, structure="sparse"), ValueError, "form of structure"),
            (lambda: fast.loss_and_grad(P, Q, Z, y, threads=0), ValueError, "threads"),
            (lambda: fast.loss_and_grad(P, Q, Z, y, threads=1.5), TypeError, "threads"),
            (lambda: fast.loss_and_grad(P * 1e80, Q * 1e80, Z, y), ValueError, "overflow"),
            (lambda: fast.train_lbfgs(Z, y, 1, rng=np.random.default_rng(0), threads=0), ValueError, "threads")):
        with pytest.raises(error, match=match):
            call()


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


# ---------------------------------------------------------------------------------------------
# Threads: bit-identical for any count, concurrent callers, BLAS limits, fork, shutdown
# ---------------------------------------------------------------------------------------------

def test_thread_count_does_not_change_results():
    # chunks depend on B and D only and are summed in chunk order: bit-identical results; the sizes
    # reach PARALLEL_MIN_WORK and PARALLEL_MIN_WORK_JACOBIAN, so that the workers share the chunks
    for d, B, k in ((3, 9000, 2100), (16, 900, 300)):         # lanes; the reference's chunks
        P, Q, Z, y = problem(114 + d, B, d, H=2)
        runs = [fast.loss_and_grad(P, Q, Z, y, threads=t) for t in (1, 2, 3)]
        jac = [fast.residuals_and_jacobian(P, Q, Z[:k], y[:k], threads=t) for t in (1, 2)]
        for other in runs[1:]:
            assert other[0] == runs[0][0]
            assert np.array_equal(other[1], runs[0][1]) and np.array_equal(other[2], runs[0][2])
        assert all(np.array_equal(a, b) for a, b in zip(*jac))


def test_concurrent_calls_equal_serial_and_leave_blas_limits_as_found():
    # four Python threads evaluate at once while a fifth polls the BLAS setting; every result equals
    # the serial one bit for bit and the limit found (2 threads) is back afterwards; B L H D^3 above
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
        assert res[0] == serial[0] and np.array_equal(res[1], serial[1]) and np.array_equal(res[2], serial[2])


def test_training_holds_blas_at_one_thread_and_restores_the_callers_setting():
    rng = np.random.default_rng(115)
    Z, y = ir.sample_prompts(rng, 50, 8, np.eye(3))
    seen, engine = [], fast.engine()

    def spy(*args):
        seen.append(max(blas_threads()))
        return engine.loss_and_grad_gram(*args)
    with threadpool_limits(limits=2, user_api="blas"):
        before = blas_threads()
        with mock.patch.object(fast, "engine", lambda threads=None: types.SimpleNamespace(
                **{**vars(engine), "loss_and_grad_gram": spy})):
            fast.train_lbfgs(Z, y, 1, rng=rng, maxiter=3)
        assert blas_threads() == before
    assert seen and set(seen) == {1}


def test_map_chunks_in_chunk_order_and_no_new_chunk_after_an_error():
    # the workers claim chunks from one counter; the results come back in chunk order, and once a
    # chunk fails no worker starts another (without the stop the other worker would go on through
    # all 100 chunks, 50 ms each)
    bounds = [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert fast._map_chunks(lambda a, b: (a, b), bounds, 2) == bounds
    started = []

    def chunk(a, b):
        started.append(a)
        if a == 0:
            raise RuntimeError("chunk 0 failed")
        time.sleep(0.05)
    with pytest.raises(RuntimeError, match="chunk 0 failed"):
        fast._map_chunks(chunk, [(c, c + 1) for c in range(100)], 2)
    time.sleep(0.25)
    assert 0 in started and len(started) <= 3, started


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
    assert sorted(fast._map_chunks(where, bounds, None), key=min) == [frozenset({c}) for c in cores]
    assert os.sched_getaffinity(0) == set(cores)              # the caller's own affinity is untouched


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
    names = lambda: [t.name for t in threading.enumerate() if t.name.startswith("icl_fast")]
    assert names()                                           # the pool is kept between calls
    with warnings.catch_warnings():
        # Python 3.12+ warns that a fork with live threads may deadlock: the case under test
        warnings.simplefilter("ignore", DeprecationWarning)
        with multiprocessing.get_context("fork").Pool(1) as child:
            assert child.apply_async(_loss_on_two_workers, ((P, Q, Z, y),)).get(timeout=60) == here
    fast.shutdown()
    assert not names()                                      # no threads of icl_fast's are left
    with warnings.catch_warnings():
        # Python 3.12+ counts the process's OS threads (BLAS's own pool too) when it warns at a fork
        warnings.simplefilter("ignore", DeprecationWarning)
        with multiprocessing.get_context("fork").Pool(1) as child:
            assert child.apply_async(_loss_on_two_workers, ((P, Q, Z, y),)).get(timeout=60) == here
    assert _loss_on_two_workers((P, Q, Z, y)) == here         # and the pool starts again


# ---------------------------------------------------------------------------------------------
# The lanes formulation (MATH.md §3.2)
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


def test_symmetric_coordinates_and_lanes_gram():
    # s = vec(S)[upper], vec(S) = s[full] = E s, and the Gram product with the prompts on the last
    # axis equals gram() (the same sums in another order: EXACT), exactly symmetric, with its
    # distinct entries beside it
    rng = np.random.default_rng(126)
    Z, _ = ir.sample_prompts(rng, 7, 5, np.eye(3))
    S = ir.gram(Z)
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
    St, st = fast.lanes_gram(np.ascontiguousarray(Z.transpose(1, 2, 0)))
    assert_allclose(St, S.transpose(1, 2, 0), rtol=0, atol=EXACT * np.max(np.abs(S)))
    assert np.array_equal(St, St.transpose(1, 0, 2))
    assert np.array_equal(st, St.reshape(16, -1)[fast.symmetric_coordinates(4)[0]])


@pytest.mark.parametrize("L,H", [(1, 1), (1, 3), (2, 2), (3, 1), (4, 2)])
def test_lanes_pair_against_the_reference_layers(L, H):
    # layer by layer, lanes_forward gives the same S', q' (the last layer the same (T q)_d) as
    # icl_ref.layer_forward, and the lanes reverse pass from the same seed the same G = dS + dS^T,
    # dq, and through the kernel the same dP_l, dQ_l (per prompt: (1/n) dT Q^T S, (1/n) S P^T dT);
    # EXACT relative (sums reordered)
    P, Q, Z, y = problem(127 + L + H, 9, 3, L=L, H=H, scale=0.4)
    n, D = Z.shape[2] - 1, 4
    upper, _, E, _ = fast.symmetric_coordinates(D)
    S, q = ir.gram(Z), np.ascontiguousarray(Z[:, :, n])
    St, qt = np.ascontiguousarray(S.transpose(1, 2, 0)), np.ascontiguousarray(q.T)
    st = St.reshape(D * D, -1)[upper]
    caches, lanes = [], []
    for l in range(L):
        S, q, _, cache = ir.layer_forward(P[l], Q[l], S, q, n, need_S=l < L - 1)
        St, st, qt, lcache = fast.lanes_forward(fast.kernel_forward(P[l], Q[l], n) @ E, St, st, qt,
                                                last=l == L - 1)
        caches.append(cache)
        lanes.append(lcache)
        if l < L - 1:
            assert_close(St, S.transpose(1, 2, 0))
            assert_close(qt, q.T)
            assert np.array_equal(St, St.transpose(1, 0, 2))     # S' exactly symmetric
            assert np.array_equal(st, St.reshape(D * D, -1)[upper])
        else:
            assert St is None and st is None
    assert_close(qt, q[:, -1])
    c = 2 * (q[:, -1] + y) / len(y)
    dS, dq = None, np.zeros_like(q)
    dq[:, -1] = c
    G, dqt = None, c
    for l in reversed(range(L)):
        _, _, JP, JQ = ir.layer_backward(dS, dq, caches[l], need_dS=l > 0, per_prompt=True)
        dT = fast.lanes_backward(G, dqt, lanes[l], first=l == 0, per_prompt=True)[2]
        S_l = caches[l][3]
        for h in range(H):
            assert_close(np.einsum("ijb,kj,bkl->bil", dT, Q[l, h] / n, S_l), JP[:, h])
            assert_close(np.einsum("bij,kj,klb->bil", S_l, P[l, h] / n, dT), JQ[:, h])
        dS, dq, dP_l, dQ_l = ir.layer_backward(dS, dq, caches[l], need_dS=l > 0)
        G, dqt, dK_s = fast.lanes_backward(G, dqt, lanes[l], first=l == 0)
        dP_k, dQ_k = fast.kernel_backward(dK_s @ E.T, P[l], Q[l], n)
        assert_close(dP_k, dP_l)
        assert_close(dQ_k, dQ_l)
        if l > 0:
            sym = dS + dS.transpose(0, 2, 1)
            assert_close(G, sym.transpose(1, 2, 0))
            assert np.array_equal(G, G.transpose(1, 0, 2))
            assert_close(dqt, dq.T)
        else:
            assert G is None and dqt is None                 # S_0, q_0 are data


def test_lanes_thresholds():
    # lanes for the loss up to D = 17 and for the Jacobian up to D = 7 (MATH.md §3.2, rule i)
    assert (fast.LANES_MAX_D, fast.LANES_MAX_D_JACOBIAN) == (17, 7)
    for d, loss_lanes, jacobian_lanes in ((6, True, True), (7, True, False), (16, True, False), (17, False, False)):
        P, Q, Z, y = problem(128 + d, 5, d, scale=0.1)
        n = Z.shape[2] - 1
        args = (P, Q, ir.gram(Z), np.ascontiguousarray(Z[:, :, n]), y, n)
        taken = []
        with mock.patch.object(fast, "_lanes_loss_and_grad", lambda *a: taken.append("loss") or (0.0, P, Q)), \
                mock.patch.object(fast, "_lanes_jacobian", lambda *a: taken.append("jac") or (y, np.zeros((5, 1)))):
            fast.loss_and_grad_gram(*args)
            fast.loss_and_grad(P, Q, Z, y)
            fast.residuals_and_jacobian_gram(*args)
        assert taken == ["loss"] * 2 * loss_lanes + ["jac"] * jacobian_lanes, (d, taken)


@pytest.mark.skipif(len(fast._cores()) < 2, reason="with one core every evaluation runs on one thread")
def test_small_evaluations_run_on_the_calling_thread():
    # MATH.md §3.2 rule (v): the workers share an evaluation from B L H D^3 = 2^21 multiply-adds on
    # for the loss and 2^19 for the Jacobian; one prompt fewer runs on the calling thread. D = 6 (lanes)
    # with L = 2 or H = 2 (432 per prompt), and D = 18 (the reference's chunks, 5832 per prompt)
    assert (fast.PARALLEL_MIN_WORK, fast.PARALLEL_MIN_WORK_JACOBIAN) == (2 ** 21, 2 ** 19)
    every = fast._thread_count(None)

    def thread_counts(*calls):
        """The thread count each call hands to _map_chunks (the chunks then run in place)."""
        seen = []
        with mock.patch.object(fast, "_map_chunks",
                               lambda fn, bounds, threads: seen.append(threads) or [fn(*c) for c in bounds]):
            for call in calls:
                call()
        return seen
    for d, L, H, B_loss, B_jac in ((5, 2, 1, 4855, 1214), (5, 1, 2, 4855, 1214), (17, 1, 1, 360, 90)):
        P, Q, Z, y = problem(132 + d + H, B_loss, d, L=L, H=H, scale=0.1)
        n = Z.shape[2] - 1
        S0, q0 = ir.gram(Z), np.ascontiguousarray(Z[:, :, n])
        for b, want in ((B_loss, every), (B_loss - 1, 1)):
            assert thread_counts(lambda: fast.loss_and_grad(P, Q, Z[:b], y[:b]),
                                 lambda: fast.loss_and_grad_gram(P, Q, S0[:b], q0[:b], y[:b], n)) == [want, want], \
                (d, L, H, b)
        for b, want in ((B_jac, every), (B_jac - 1, 1)):
            assert thread_counts(lambda: fast.residuals_and_jacobian_gram(P, Q, S0[:b], q0[:b], y[:b], n)) == [want], \
                (d, L, H, b)


def test_lanes_chunks_are_equal_a_multiple_of_four_and_cover_the_batch():
    for B, D in ((4000, 6), (7, 6), (20001, 3), (1, 13)):
        bounds = fast._lanes_bounds(B, D)
        sizes = [b - a for a, b in bounds]
        assert bounds[0][0] == 0 and bounds[-1][1] == B
        assert all(bounds[i][1] == bounds[i + 1][0] for i in range(len(bounds) - 1))
        assert max(sizes) - min(sizes) <= max(sizes) - 1 and len(set(sizes[:-1])) <= 1
        assert B < 4 or len(bounds) % 4 == 0 or sizes[-1] < sizes[0]
    assert fast._lanes_bounds(4000, 6) == [(0, 1000), (1000, 2000), (2000, 3000), (3000, 4000)]


def test_engine_refuses_a_non_finite_Z_in_any_chunk():
    # each worker checks its own chunk of Z before reading it: a NaN or Inf in the last prompt of
    # the last of four chunks, on one worker and on two (B L H D^3 above PARALLEL_MIN_WORK), is the
    # ValueError naming Z
    rng = np.random.default_rng(131)
    for d, B in ((5, 6000), (17, 200)):
        P, Q = 0.1 * rng.standard_normal((2, 2, 1, d + 1, d + 1))
        Z, y = rng.standard_normal((B, d + 1, 4)), rng.standard_normal(B)
        fast.loss_and_grad(P, Q, Z, y)
        for bad in (np.nan, np.inf, -np.inf):
            Z_bad = Z.copy()
            Z_bad[-1, 0, 0] = bad
            for threads in (1, 2):
                with pytest.raises(ValueError, match="Z must be finite"):
                    fast.loss_and_grad(P, Q, Z_bad, y, threads=threads)


def test_importing_the_engine_does_not_change_the_reference():
    # icl_ref imports nothing of the engine's: no threads, no threadpoolctl, no icl_fast
    import subprocess
    code = ("import sys, threading, icl_ref; "
            "print(threading.active_count(), 'threadpoolctl' in sys.modules, 'icl_fast' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.abspath(__file__)), check=True).stdout.split()
    assert out == ["1", "False", "False"]
