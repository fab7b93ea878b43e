"""Tests for icl_ref: conventions, exact identities, gradients, training, and the paper's claims.

Tolerances, each with its reason:
    EXACT  = 1e-12  relative: two float64 computations of the same exact quantity (rounding only)
    FD_REL = 1e-6   relative, entry by entry, for central_diff's five-point stencil at h = FD_H =
                    1e-4: truncation (h^4/30) f^(5) ~ 3e-18 f^(5) is negligible, rounding is about
                    1.5 eps |f| / h ~ 3e-12 |f|; 1e-6 still catches any wrong term (O(1) relative)
    FD_ABS = 1e-8   absolute floor for entries near 0, where relative error means nothing: the
                    rounding above for losses |f| <= 3000 (the largest in these tests)
    Z_MC   = 4      Monte Carlo: |estimate - exact| <= 4 standard errors computed from the samples
Slow tests (the paper's full-size experiment) run with `pytest -m slow` (pyproject.toml's markers).
"""
import ast
import functools
import inspect
import math
import os
import subprocess
import sys
import types
import warnings
from fractions import Fraction
from unittest import mock

import numpy as np
import pytest
import scipy.optimize
from numpy.testing import assert_allclose
import icl_ref as ir
EXACT = 1e-12
FD_REL = 1e-6
FD_H = 1e-4
FD_ABS = 1e-8
FD_H2 = 1e-6       # two-point differences (directional checks): truncation h^2 f''' ~ 1e-12
Z_MC = 4.0


# the exact family optima (deterministic: seed 0) are searched once per process and shared by the
# tests that compare with them
family_optimum = functools.lru_cache(maxsize=None)(ir.optimal_family_scalars)


def random_params(rng, L, H, d, scale=0.4):
    return scale * rng.standard_normal((2, L, H, d + 1, d + 1))


def central_diff(f, X, h=FD_H):
    """Five-point central differences for every entry of X (fourth order: error (h^4/30) f^(5)),
    [8 (f(X + h e_i) - f(X - h e_i)) - (f(X + 2h e_i) - f(X - 2h e_i))] / 12h."""
    g = np.empty_like(X)
    for i in np.ndindex(X.shape):
        def at(t):
            Xt = X.copy()
            Xt[i] += t
            return f(Xt)
        g[i] = (8 * (at(h) - at(-h)) - (at(2 * h) - at(-2 * h))) / (12 * h)
    return g


def assert_grad_close(numeric, analytic):
    """Entry by entry, so an error confined to the small entries of a gradient is not hidden."""
    assert_allclose(analytic, numeric, rtol=FD_REL, atol=FD_ABS)


def reference_engine(**replaced):
    """icl_ref's own engine (what engine=None evaluates) with some of its five methods replaced."""
    methods = ("gram", "loss_and_grad_gram", "jacobian_gram", "activation_pass", "reduced_least_squares")
    return types.SimpleNamespace(**{**{m: getattr(ir.REFERENCE, m) for m in methods}, **replaced})


def small_problem(seed=0, B=6, n=5, d=3, noise_std=0.0):
    rng = np.random.default_rng(seed)
    Sigma, _ = ir.rotated_covariance(rng, np.linspace(0.5, 1.5, d))
    Z, y = ir.sample_prompts(rng, B, n, Sigma, noise_std=noise_std)
    return rng, Z, y


def adjoint_check(phi, inputs, adjoints, h, scale, symmetric=()):
    """Each input's adjoint against five-point central differences of the scalar phi(*inputs), entry
    by entry, within 20 eps scale / h: the rounding of the stencil's four values of phi (scale bounds
    sum |terms| of phi; the weights (8 + 8 + 1 + 1) / 12h, doubled for the sums inside phi). Where phi
    is a polynomial of degree <= 4 in each entry the stencil has no truncation error at all. An input
    whose index is in `symmetric` is a symmetric stack S (a Gram matrix): the adjoint owes only the
    symmetric part of the gradient (MATH.md §3), so (dS + dS^T) / 2 is compared along the symmetric
    perturbations (E_ij + E_ji) / 2."""
    for k, (X, dX) in enumerate(zip(inputs, adjoints)):
        def along(Y, k=k):
            if k in symmetric:
                Y = (Y + np.swapaxes(Y, -1, -2)) / 2
            return phi(*inputs[:k], Y, *inputs[k + 1:])
        expected = (dX + np.swapaxes(dX, -1, -2)) / 2 if k in symmetric else dX
        assert_allclose(expected, central_diff(along, X, h), rtol=0, atol=20 * np.finfo(float).eps * scale / h,
                        err_msg=f"input {k}")


def pytest_generate_tests(metafunc):
    """A test taking `bad_call` runs once per row of BAD_CALLS (the table follows the tests it drives,
    at the end of the file; pytest reads it after the module is loaded)."""
    if "bad_call" in metafunc.fixturenames:
        metafunc.parametrize("bad_call", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])


def check_full_gradient(P, Q, Z, y):
    _, dP, dQ = ir.loss_and_grad(P, Q, Z, y)
    assert_grad_close(central_diff(lambda X: ir.in_context_loss(X, Q, Z, y), P), dP)
    assert_grad_close(central_diff(lambda X: ir.in_context_loss(P, X, Z, y), Q), dQ)


# ---------------------------------------------------------------------------------------------
# §1 Data
# ---------------------------------------------------------------------------------------------

def test_sample_prompts_layout_and_reproducibility():
    Sigma = np.diag([1.0, 4.0])
    Z, y, w = ir.sample_prompts(np.random.default_rng(3), 5, 4, Sigma, noise_std=0.0,
                                return_w_star=True)
    assert Z.shape == (5, 3, 5) and y.shape == (5,) and w.shape == (5, 2)
    assert np.all(Z[:, 2, 4] == 0)
    assert_allclose(Z[:, 2, :4], np.einsum("bdi,bd->bi", Z[:, :2, :4], w), rtol=EXACT)
    assert_allclose(y, np.einsum("bd,bd->b", Z[:, :2, 4], w), rtol=EXACT)
    Z2, y2 = ir.sample_prompts(np.random.default_rng(3), 5, 4, Sigma)
    assert np.array_equal(Z, Z2) and np.array_equal(y, y2)


def test_sample_prompts_covariance_matches_sigma():
    rng = np.random.default_rng(4)
    Sigma, _ = ir.rotated_covariance(rng, [1.0, 0.25, 2.0])
    Z, _ = ir.sample_prompts(rng, 4000, 9, Sigma)
    X = Z[:, :3, :].transpose(0, 2, 1).reshape(-1, 3)
    prods = X[:, :, None] * X[:, None, :]
    se = prods.std(axis=0) / math.sqrt(len(X))            # entries are iid across all tokens
    assert np.all(np.abs(prods.mean(axis=0) - Sigma) <= Z_MC * se)


# ---------------------------------------------------------------------------------------------
# §2 The layer, the mask and the Gram form
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("L", [1, 2, 3])
@pytest.mark.parametrize("H", [1, 2])
def test_fast_forward_equals_literal_column_form(L, H):
    rng, Z, y = small_problem(seed=10 * L + H)
    P, Q = random_params(rng, L, H, 3)
    fast, literal = ir.forward(P, Q, Z), ir.forward_literal(P, Q, Z)
    assert_allclose(fast, literal, rtol=EXACT, atol=EXACT * np.max(np.abs(literal)))


def test_layer_is_the_matrix_form_with_the_mask():
    # [A] eq. (4) as matrices, Z + (1/n) sum_h P_h Z M Z^T Q_h Z with M = mask(n), batch by batch
    rng, Z, y = small_problem(seed=3, B=4, n=5)
    P, Q = random_params(rng, 2, 2, 3)
    M = ir.mask(5)
    assert_allclose(M, np.diag([1.0, 1, 1, 1, 1, 0]), rtol=0, atol=0)
    out = Z.copy()
    for P_l, Q_l in zip(P, Q):
        out = np.stack([Zb + sum(P_h @ Zb @ M @ Zb.T @ Q_h @ Zb for P_h, Q_h in zip(P_l, Q_l)) / 5
                        for Zb in out])
    assert_allclose(ir.forward(P, Q, Z), out, rtol=EXACT, atol=EXACT * np.max(np.abs(out)))


def test_layer_backward_is_the_adjoint_of_layer_forward_for_each_input():
    # phi = <G, S'> + <g, q'> with a random upstream (G, g), G not symmetric: layer_backward(G, g)
    # must be phi's gradient in P_l, Q_l, S and q, each entry (phi has degree <= 3 in any one
    # entry, so h = 1e-2 leaves rounding alone); per_prompt keeps each prompt's part of dP, dQ
    rng, Z, _ = small_problem(seed=30, B=3, n=5, d=3)
    S, q, n = ir.gram(Z), Z[:, :, -1].copy(), 5
    P, Q = random_params(rng, 1, 2, 3, scale=0.75)[:, 0]                # one layer's (H, D, D)
    G, g = rng.standard_normal(S.shape), rng.standard_normal(q.shape)

    def phi(P_l, Q_l, S_, q_):
        S1, q1, _, _ = ir.layer_forward(P_l, Q_l, S_, q_, n)
        return np.sum(G * S1) + np.sum(g * q1)
    S1, q1, _, cache = ir.layer_forward(P, Q, S, q, n)
    dS, dq, dP, dQ = ir.layer_backward(G, g, cache)
    scale = np.sum(np.abs(G * S1)) + np.sum(np.abs(g * q1))
    adjoint_check(phi, [P, Q, S, q], [dP, dQ, dS, dq], 1e-2, scale, symmetric=(2,))
    none, dq2, dP2, dQ2 = ir.layer_backward(G, g, cache, need_dS=False, per_prompt=True)
    assert none is None and np.array_equal(dq2, dq) and dP2.shape == (3,) + P.shape
    assert_allclose(dP2.sum(axis=0), dP, rtol=EXACT) and assert_allclose(dQ2.sum(axis=0), dQ, rtol=EXACT)


def test_readout_backward_is_the_adjoint_of_readout_forward_for_each_input():
    # phi = <u, (T q)_d> with a random upstream u: readout_backward(u) is phi's gradient in P_l, Q_l,
    # S (its symmetric part: here dS is not symmetric) and q; phi is linear in each entry (exact
    # stencil); dP_l lives in row d alone
    rng, Z, _ = small_problem(seed=31, B=3, n=5, d=3)
    S, q, n = ir.gram(Z), Z[:, :, -1].copy(), 5
    P, Q = random_params(rng, 1, 2, 3, scale=0.75)[:, 0]                # one layer's (H, D, D)
    u = rng.standard_normal(3)

    def phi(P_l, Q_l, S_, q_):
        return np.sum(u * ir.readout_forward(P_l, Q_l, S_, q_, n)[0])
    out, cache = ir.readout_forward(P, Q, S, q, n)
    dS, dq, dP, dQ = ir.readout_backward(u, cache)
    adjoint_check(phi, [P, Q, S, q], [dP, dQ, dS, dq], 1e-2, np.sum(np.abs(u * out)) + np.sum(np.abs(S)),
                  symmetric=(2,))
    assert not np.any(dP[:, :-1])
    per = ir.readout_backward(u, cache, per_prompt=True)
    assert_allclose(per[2].sum(axis=0), dP, rtol=EXACT) and assert_allclose(per[3].sum(axis=0), dQ, rtol=EXACT)


def test_hand_computed_layer_d1_n2():
    # tokens z1 = [1, 2], z2 = [-1, 1], query [3, 0]; P = [[1, 2], [0, 1]], Q = [[1, 0], [1, 1]].
    # z_i^T Q = [x_i + y_i, y_i]: z1 -> [3, 2], z2 -> [0, 1].
    # query:  scores (9, 0); (1/2)(9 z1 + 0 z2) = [4.5, 9]; P [4.5, 9] = [22.5, 9]; z_q' = [25.5, 9]
    # z1:     scores (7, 2); (1/2)(7 z1 + 2 z2) = [2.5, 8]; P [2.5, 8] = [18.5, 8]; z1' = [19.5, 10]
    # z2:     scores (-1, 1); (1/2)(-z1 + z2) = [-1, -0.5]; P [..] = [-2, -0.5];   z2' = [-3, 0.5]
    Z = np.array([[[1, -1, 3], [2, 1, 0]]])
    P = np.array([[[[1, 2], [0, 1]]]])
    Q = np.array([[[[1, 0], [1, 1]]]])
    expected = np.array([[[19.5, -3, 25.5], [10, 0.5, 9]]])
    assert_allclose(ir.forward(P, Q, Z), expected, rtol=EXACT)
    assert_allclose(ir.forward_literal(P, Q, Z), expected, rtol=EXACT)
    # prediction -Z_L[d, n] = -9; with y = 4 the loss is (9 + 4)^2 = 169 (mean over B = 1, no 1/2)
    assert_allclose(ir.predict(P, Q, Z), [-9.0], rtol=EXACT)
    assert ir.in_context_loss(P, Q, Z, [4]) == pytest.approx(169.0, rel=EXACT)


def test_query_token_is_never_key_or_value():
    rng, Z, y = small_problem()
    P, Q = random_params(rng, 3, 2, 3)
    Z2 = Z.copy()
    Z2[:, :, -1] += rng.standard_normal(Z2[:, :, -1].shape)
    layers, layers2 = ir.forward(P, Q, Z, all_layers=True), ir.forward(P, Q, Z2, all_layers=True)
    assert np.array_equal(layers[:, :, :, :-1], layers2[:, :, :, :-1])   # context columns, all layers
    assert not np.allclose(layers[-1, :, :, -1], layers2[-1, :, :, -1])


def test_rescaling_invariance():
    # [A] Thm 1 remark: (P, Q) -> (c P, Q / c) per layer leaves the output unchanged
    rng, Z, y = small_problem()
    P, Q = random_params(rng, 2, 1, 3)
    c = np.array([2.0, -0.5])[:, None, None, None]
    assert_allclose(ir.predict(c * P, Q / c, Z), ir.predict(P, Q, Z), rtol=EXACT)


# ---------------------------------------------------------------------------------------------
# §3 The loss and its reverse mode
# ---------------------------------------------------------------------------------------------

def test_loss_is_mean_squared_error_without_half():
    rng, Z, y = small_problem(B=7)
    P, Q = random_params(rng, 2, 1, 3)
    y_hat = -ir.forward_literal(P, Q, Z)[:, -1, -1]
    assert_allclose(ir.predict(P, Q, Z), y_hat, rtol=EXACT)
    assert ir.in_context_loss(P, Q, Z, y) == pytest.approx(np.sum((y_hat - y) ** 2) / 7, rel=EXACT)
    assert ir.loss_and_grad(P, Q, Z, y)[0] == pytest.approx(np.sum((y_hat - y) ** 2) / 7, rel=EXACT)


@pytest.mark.parametrize("L,H", [(1, 1), (2, 2), (3, 1)])
def test_gradient_matches_finite_differences_random_point(L, H):
    rng, Z, y = small_problem(seed=L + 7 * H)
    check_full_gradient(*random_params(rng, L, H, 3), Z, y)


def test_gradient_matches_finite_differences_structured_points():
    rng, Z, y = small_problem(seed=5)
    A, Bm = rng.standard_normal((2, 3, 3, 3))
    check_full_gradient(*ir.sparse_params(A), Z, y)
    check_full_gradient(*ir.block_params(A, Bm), Z, y)


def test_gradient_matches_finite_differences_after_lbfgs_steps():
    rng, Z, y = small_problem(seed=6, B=40)
    res = ir.train_lbfgs(Z, y, 2, structure="full", heads=2, rng=rng, init_scale=0.3, maxiter=5)
    assert res["nit"] == 5
    check_full_gradient(res["P"], res["Q"], Z, y)


@pytest.mark.parametrize("structure", ["sparse", "blocks"])
def test_structured_gradient_matches_finite_differences(structure):
    rng, Z, y = small_problem(seed=8)
    shapes = ir.structure_shapes(structure, 3, 3)
    coords = {k: rng.standard_normal(s) for k, s in shapes.items()}

    def f(key, X):
        return ir.in_context_loss(*ir.structure_to_PQ(structure, {**coords, key: X}), Z, y)
    _, dP, dQ = ir.loss_and_grad(*ir.structure_to_PQ(structure, coords), Z, y)
    grads = ir.structure_grad(structure, dP, dQ)
    for key in shapes:
        assert_grad_close(central_diff(lambda X: f(key, X), coords[key]), grads[key])


def test_directional_derivative_larger_case():
    rng = np.random.default_rng(9)
    Sigma, _ = ir.rotated_covariance(rng, np.linspace(0.3, 2.0, 8))
    Z, y = ir.sample_prompts(rng, 3000, 30, Sigma, noise_std=0.5)
    P, Q = random_params(rng, 4, 2, 8, scale=0.15)
    vP, vQ = rng.standard_normal((2,) + P.shape)
    _, dP, dQ = ir.loss_and_grad(P, Q, Z, y)
    f = lambda t: ir.in_context_loss(P + t * vP, Q + t * vQ, Z, y)
    numeric = (f(FD_H2) - f(-FD_H2)) / (2 * FD_H2)
    analytic = np.sum(dP * vP) + np.sum(dQ * vQ)
    assert analytic == pytest.approx(numeric, rel=FD_REL)


def test_one_layer_gradient_in_P_matches_an_exact_parabola():
    # an independent reverse-mode check: the loss is quadratic in P[0] for a 1-layer model,
    # so f(P + t V) is an exact parabola and its derivative at t = 0 is exact from 3 points
    rng, Z, y = small_problem(seed=11)
    P, Q = random_params(rng, 1, 3, 3)
    V = rng.standard_normal(P.shape)
    f = lambda t: ir.in_context_loss(P + t * V, Q, Z, y)
    exact = (f(1.0) - f(-1.0)) / 2                         # exact for a quadratic in t
    # 1e-10: rounding in f(+-1), O(1) values differenced and halved, and in the reverse-mode sums
    assert np.sum(ir.loss_and_grad(P, Q, Z, y)[1] * V) == pytest.approx(exact, rel=1e-10)


@pytest.mark.parametrize("B,chunk", [(10, 3), (10, 5), (11, 4), (7, 1), (9, 100)])
def test_chunked_loss_and_grad_equals_unchunked(B, chunk):
    # MATH.md §3: chunks divide by the whole B, read their own labels, add their parts; the last
    # chunk may be short. The token loop's loss (no chunks at all) and one chunk holding the whole
    # batch are the references; the Jacobian's rows are concatenated in chunk order.
    rng, Z, y = small_problem(seed=B + chunk, B=B)
    P, Q = random_params(rng, 3, 2, 3)
    n = Z.shape[2] - 1
    S0, q0 = ir.gram(Z), np.ascontiguousarray(Z[:, :, n])

    def with_chunks(size):
        bounds = lambda B_, D: [(c, min(c + size, B_)) for c in range(0, B_, size)]
        with mock.patch.object(ir, "_chunks", bounds):
            return ir.loss_and_grad_gram(P, Q, S0, q0, y, n), ir.residuals_and_jacobian_gram(P, Q, S0, q0, y, n)
    (loss, dP, dQ), (r, J) = with_chunks(chunk)
    (loss1, dP1, dQ1), (r1, J1) = with_chunks(B)
    assert loss == pytest.approx(loss1, rel=EXACT)
    assert loss == pytest.approx(np.mean((ir.forward_literal(P, Q, Z)[:, -1, -1] + y) ** 2), rel=EXACT)
    assert_allclose(dP, dP1, rtol=EXACT, atol=EXACT * np.max(np.abs(dP1)))
    assert_allclose(dQ, dQ1, rtol=EXACT, atol=EXACT * np.max(np.abs(dQ1)))
    assert_allclose(r, r1, rtol=0, atol=EXACT * np.max(np.abs(r1)))
    assert_allclose(J, J1, rtol=0, atol=EXACT * np.max(np.abs(J1)))


def test_directional_derivatives_along_random_directions():
    # MATH.md §3: each direction checked on its own, so an error along a few coordinates shows
    rng, Z, y = small_problem(seed=101, B=30)
    P, Q = random_params(rng, 3, 2, 3)
    _, dP, dQ = ir.loss_and_grad(P, Q, Z, y)
    for _ in range(8):
        vP, vQ = rng.standard_normal((2,) + P.shape) * (rng.random((2,) + P.shape) < 0.2)
        f = lambda t: ir.in_context_loss(P + t * vP, Q + t * vQ, Z, y)
        numeric = (f(FD_H2) - f(-FD_H2)) / (2 * FD_H2)
        assert np.sum(dP * vP) + np.sum(dQ * vQ) == pytest.approx(numeric, rel=FD_REL, abs=FD_ABS)


def test_loss_and_grad_refuses_a_non_finite_Z_and_a_non_finite_or_asymmetric_S0():
    # a NaN or Inf in the last prompt is a ValueError naming Z; the Gram-form functions name S0, q0
    # and y, and refuse an S0 that is not symmetric (the reverse pass relies on S^T = S, MATH.md §3)
    rng = np.random.default_rng(131)
    for d, B in ((5, 40), (12, 9)):
        P, Q = random_params(rng, 2, 1, d, scale=0.1)
        Z, y = rng.standard_normal((B, d + 1, 4)), rng.standard_normal(B)
        S0, q0 = ir.gram(Z), np.ascontiguousarray(Z[:, :, 3])
        ir.loss_and_grad(P, Q, Z, y)
        for bad in (np.nan, np.inf, -np.inf):
            Z_bad, S_bad, q_bad = Z.copy(), S0.copy(), q0.copy()
            Z_bad[-1, 0, 0] = S_bad[-1, 0, 0] = q_bad[-1, 0] = bad
            with pytest.raises(ValueError, match="Z must be finite"):
                ir.loss_and_grad(P, Q, Z_bad, y)
            for name, args in (("S0", (S_bad, q0)), ("q0", (S0, q_bad))):
                for f in (ir.loss_and_grad_gram, ir.residuals_and_jacobian_gram):
                    with pytest.raises(ValueError, match=f"{name} must be finite"):
                        f(P, Q, *args, y, 3)
        S_asym = S0.copy()
        S_asym[0, 0, 1] += 1e-9
        for f in (ir.loss_and_grad_gram, ir.residuals_and_jacobian_gram):
            with pytest.raises(ValueError, match="S0 must be symmetric"):
                f(P, Q, S_asym, q0, y, 3)


def test_the_reference_chunks_cover_the_batch_once_and_change_nothing():
    # _chunks: consecutive, disjoint, covering [0, B); the loss of a batch of several chunks (d = 5:
    # 910 prompts each, the last one short) equals the token loop's, EXACT
    for B, D in ((1, 6), (909, 6), (910, 6), (911, 6), (5000, 13), (3, 40)):
        bounds = ir._chunks(B, D)
        assert bounds[0][0] == 0 and bounds[-1][1] == B
        assert all(a < b for a, b in bounds) and all(bounds[i][1] == bounds[i + 1][0] for i in range(len(bounds) - 1))
        # the reason for chunks: a chunk's shared-factor product, b D^3 multiply-adds, stays within
        # 2^18, which OpenBLAS runs on the calling thread (MATH.md's notes on the code); one prompt is the floor
        assert all((b - a) * D ** 3 <= max(2 ** 18, D ** 3) for a, b in bounds)
    rng = np.random.default_rng(145)
    Z, y = ir.sample_prompts(rng, 2000, 3, np.eye(5))
    P, Q = random_params(rng, 2, 1, 5, scale=0.3)
    loss, dP, dQ = ir.loss_and_grad(P, Q, Z, y)
    assert loss == pytest.approx(np.mean((ir.forward_literal(P, Q, Z)[:, -1, -1] + y) ** 2), rel=EXACT)
    r, J = ir.residuals_and_jacobian(P, Q, Z, y)
    assert r.shape == (2000,) and np.mean(r ** 2) == pytest.approx(loss, rel=EXACT)
    assert_allclose(2 * J.T @ r / 2000, ir.pack([dP, dQ]), rtol=0, atol=EXACT * np.max(np.abs(dP)))


# ---------------------------------------------------------------------------------------------
# §3.1 The per-prompt Jacobian
# ---------------------------------------------------------------------------------------------

def residuals_by_forward(P, Q, Z, y):
    """r = y - y_hat through predict: an independent route to the residuals."""
    return y - ir.predict(P, Q, Z)


def test_jacobian_matches_finite_differences():
    rng, Z, y = small_problem(seed=110, B=7)
    P, Q = random_params(rng, 2, 2, 3)
    r, J = ir.residuals_and_jacobian(P, Q, Z, y)
    assert_allclose(r, residuals_by_forward(P, Q, Z, y), rtol=EXACT, atol=EXACT)
    theta = ir.pack([P, Q])
    shapes = [P.shape, Q.shape]
    numeric = np.empty_like(J)
    for k in range(theta.size):
        e = np.zeros_like(theta)
        e[k] = FD_H2
        numeric[:, k] = (residuals_by_forward(*ir.unpack(theta + e, shapes), Z, y)
                         - residuals_by_forward(*ir.unpack(theta - e, shapes), Z, y)) / (2 * FD_H2)
    assert_grad_close(numeric, J)


@pytest.mark.parametrize("structure", ["full", "sparse", "blocks"])
def test_jacobian_sums_to_the_gradient(structure):
    # 2 J^T r / B is the loss gradient, with chunks of 4 over 11 prompts (the last one short)
    rng, Z, y = small_problem(seed=111, B=11)
    shapes = ir.structure_shapes(structure, 3, 3, 2 if structure == "full" else 1)
    coords = {k: 0.5 * rng.standard_normal(s) for k, s in shapes.items()}
    P, Q = ir.structure_to_PQ(structure, coords)
    n = Z.shape[2] - 1
    with mock.patch.object(ir, "_chunks", lambda B, D: [(c, min(c + 4, B)) for c in range(0, B, 4)]):
        r, J = ir.residuals_and_jacobian_gram(P, Q, ir.gram(Z), np.ascontiguousarray(Z[:, :, n]), y, n,
                                              structure=structure)
    loss, dP, dQ = ir.loss_and_grad(P, Q, Z, y)
    grad = ir.pack(ir.structure_grad(structure, dP, dQ).values())
    assert np.mean(r ** 2) == pytest.approx(loss, rel=EXACT)
    assert_allclose(2 * J.T @ r / len(r), grad, rtol=0, atol=EXACT * np.max(np.abs(grad)))


def test_jacobian_in_structure_coordinates():
    rng, Z, y = small_problem(seed=112, B=5)
    A, Bm = rng.standard_normal((2, 2, 3, 3))
    _, J = ir.residuals_and_jacobian(*ir.block_params(A, Bm), Z, y, structure="blocks")
    theta, shapes = ir.pack([A, Bm]), [A.shape, Bm.shape]
    f = lambda t: residuals_by_forward(*ir.block_params(*ir.unpack(t, shapes)), Z, y)
    numeric = np.stack([(f(theta + FD_H2 * e) - f(theta - FD_H2 * e)) / (2 * FD_H2)
                        for e in np.eye(theta.size)], axis=1)
    assert_grad_close(numeric, J)
    assert np.all(J[:, -9:] == 0)                         # B_{L-1} never reaches the residuals


# ---------------------------------------------------------------------------------------------
# §4 Attention with an activation
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("activation", ["relu", "softmax", "softmax_all"])
def test_activation_gradients_match_finite_differences(activation):
    rng, Z, y = small_problem(seed=91)
    P, Q = random_params(rng, 2, 2, 3)
    _, dP, dQ = ir.loss_and_grad_activation(P, Q, Z, y, activation)
    # relu has kinks: the stencil must not straddle one, so the narrow FD_H2 (a kink within 2e-6 of
    # a random point is unlikely; rounding 1.5 eps |f| / h stays below FD_ABS for this |f| < 10)
    h = FD_H2 if activation == "relu" else FD_H
    assert_grad_close(central_diff(lambda X: ir.loss_and_grad_activation(X, Q, Z, y, activation)[0], P, h), dP)
    assert_grad_close(central_diff(lambda X: ir.loss_and_grad_activation(P, X, Z, y, activation)[0], Q, h), dQ)


@pytest.mark.parametrize("activation", ir.ACTIVATIONS)
def test_attention_backward_is_the_adjoint_of_attention_forward_for_each_input(activation):
    # phi = <G, out> with a random upstream G (B, D, n+1): attention_backward(G) is phi's gradient in
    # P_h, Q_h and Z (Z enters three times: keys, queries, values). h = 1e-4: linear attention is a
    # cubic in each entry (no truncation); relu is one where no score crosses 0, and none comes
    # within 1e-2 of it here, far beyond what a step of 2h moves a score; softmax's truncation
    # (h^4/30) f^(5) is below 1e-15 at this h (measured 7e-8 at h = 1e-2, falling as h^4)
    rng, Z, _ = small_problem(seed=32, B=3, n=4, d=2)
    P, Q = 0.7 * rng.standard_normal((2, 3, 3))
    G = rng.standard_normal(Z.shape)

    def phi(P_h, Q_h, Z_):
        return np.sum(G * ir.attention_forward(P_h, Q_h, Z_, activation)[0])
    out, cache = ir.attention_forward(P, Q, Z, activation)
    assert np.min(np.abs(cache[3])) > 1e-2                     # the scores E: none near relu's kink
    dZ, dP, dQ = ir.attention_backward(G, cache)
    adjoint_check(phi, [P, Q, Z], [dP, dQ, dZ], 1e-4, np.sum(np.abs(G * out)) + np.sum(np.abs(G)))
    per = ir.attention_backward(G, cache, per_prompt=True)
    assert np.array_equal(per[0], dZ)
    assert_allclose(per[1].sum(axis=0), dP, rtol=EXACT) and assert_allclose(per[2].sum(axis=0), dQ, rtol=EXACT)


def test_explicit_linear_attention_is_an_independent_twin_of_the_fast_path():
    rng, Z, y = small_problem(seed=90)
    P, Q = random_params(rng, 3, 2, 3)
    assert_allclose(ir.forward_activation(P, Q, Z, "linear"), ir.forward(P, Q, Z), rtol=0,
                    atol=EXACT * np.max(np.abs(ir.forward(P, Q, Z))))
    loss, dP, dQ = ir.loss_and_grad_activation(P, Q, Z, y, "linear")
    loss2, dP2, dQ2 = ir.loss_and_grad(P, Q, Z, y)
    assert loss == pytest.approx(loss2, rel=EXACT)
    assert_allclose(dP, dP2, rtol=0, atol=EXACT * np.max(np.abs(dP2)))
    assert_allclose(dQ, dQ2, rtol=0, atol=EXACT * np.max(np.abs(dQ2)))


def test_softmax_variants_normalise_over_their_keys():
    # one layer, P = e_d e_d^T: the label row gains (1/n) sum_i y_i w_ij, so with all y_i = 1 the
    # query's label slot holds (1/n) * (sum of its context weights): 1/n for "softmax" (weights
    # over the n context keys sum to 1), less than 1/n for "softmax_all" (the query key takes a share)
    rng = np.random.default_rng(92)
    Z, _ = ir.sample_prompts(rng, 3, 4, np.eye(2))
    Z[:, 2, :4] = 1.0
    P, Q = np.zeros((2, 1, 1, 3, 3))
    P[0, 0, 2, 2] = 1.0
    Q[0, 0] = rng.standard_normal((3, 3))
    assert_allclose(ir.forward_activation(P, Q, Z, "softmax")[:, 2, 4], 1 / 4, rtol=EXACT)
    # softmax_all: sum_{i<n} A_ij = 1 - A_nj (the query key takes its share), computed here from E as
    # the context keys' share directly (1 - A_nj cancels when the query key takes nearly all)
    E = np.einsum("bki,kl,blj->bij", Z, Q[0, 0], Z)
    context_share = np.exp(E[:, :4, 4]).sum(axis=1) / np.exp(E[:, :, 4]).sum(axis=1)
    assert np.all(context_share < 1)
    assert_allclose(ir.forward_activation(P, Q, Z, "softmax_all")[:, 2, 4], context_share / 4, rtol=EXACT)


@pytest.mark.parametrize("activation", ["relu", "softmax", "softmax_all"])
def test_jacobian_through_explicit_attention(activation):
    # MATH.md §4: per-prompt rows against central differences of the residuals (predict_activation),
    # and 2 J^T r / B against loss_and_grad_activation
    rng, Z, y = small_problem(seed=150, B=5, n=4)
    P, Q = random_params(rng, 2, 2, 3)
    r, J = ir.residuals_and_jacobian(P, Q, Z, y, activation=activation)
    res = lambda P_, Q_: y - ir.predict_activation(P_, Q_, Z, activation)
    assert_allclose(r, res(P, Q), rtol=0, atol=EXACT * np.max(np.abs(r)))
    theta, shapes = ir.pack([P, Q]), [P.shape, Q.shape]
    numeric = np.stack([(res(*ir.unpack(theta + FD_H2 * e, shapes)) - res(*ir.unpack(theta - FD_H2 * e, shapes)))
                        / (2 * FD_H2) for e in np.eye(theta.size)], axis=1)
    assert_grad_close(numeric, J)
    _, dP, dQ = ir.loss_and_grad_activation(P, Q, Z, y, activation)
    grad = ir.pack([dP, dQ])
    assert_allclose(2 * J.T @ r / len(r), grad, rtol=0, atol=EXACT * np.max(np.abs(grad)))


def test_jacobian_with_an_activation_in_structure_coordinates():
    rng, Z, y = small_problem(seed=142, B=5)
    A = 0.4 * rng.standard_normal((1, 3, 3))
    _, J = ir.residuals_and_jacobian(*ir.sparse_params(A), Z, y, structure="sparse", activation="relu")
    f = lambda a: ir.forward_activation(*ir.sparse_params(a.reshape(A.shape)), Z, "relu")[:, -1, -1] + y
    numeric = np.stack([(f(A.ravel() + FD_H2 * e) - f(A.ravel() - FD_H2 * e)) / (2 * FD_H2) for e in np.eye(9)], axis=1)
    assert J.shape == (5, 9)
    assert_grad_close(numeric, J)


# ---------------------------------------------------------------------------------------------
# §5 Parametrisations
# ---------------------------------------------------------------------------------------------

def test_structures_place_blocks_as_in_eq8_and_eq11():
    A = np.arange(8.0).reshape(2, 2, 2)
    Bm = -np.arange(8.0).reshape(2, 2, 2)
    P, Q = ir.block_params(A, Bm)
    assert P.shape == Q.shape == (2, 1, 3, 3)
    assert np.array_equal(P[:, 0, :2, :2], Bm) and np.all(P[:, 0, 2, 2] == 1)
    assert np.array_equal(Q[:, 0, :2, :2], -A) and np.all(Q[:, 0, 2, :] == 0) and np.all(Q[:, 0, :, 2] == 0)
    P8, Q8 = ir.sparse_params(A)
    assert np.all(P8[:, 0, :2, :] == 0) and np.all(P8[:, 0, 2, 2] == 1) and np.array_equal(Q8, Q)


def test_pack_unpack_round_trip():
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((2, 3, 4)), rng.standard_normal((5,)), rng.standard_normal((1, 1))]
    back = ir.unpack(ir.pack(arrays), [a.shape for a in arrays])
    assert all(np.array_equal(a, b) for a, b in zip(arrays, back))
    with pytest.raises(ValueError, match="theta"):
        ir.unpack(np.zeros(3), [(2, 2)])


# ---------------------------------------------------------------------------------------------
# §6 Training
# ---------------------------------------------------------------------------------------------

def _stub_engine(grad_entry, calls=None, interrupt_at=None):
    """icl_ref's engine whose loss is 1 and whose gradient (sparse, L = 1) has the single entry
    dA[0, 0, 0] = grad_entry; with interrupt_at, that call raises KeyboardInterrupt."""
    def loss_and_grad_gram(P, Q, S0, q0, y, n):
        if calls is not None:
            calls.append(1)
            if len(calls) == interrupt_at:
                raise KeyboardInterrupt
        dP, dQ = np.zeros_like(P), np.zeros_like(Q)
        dQ[0, 0, 0, 0] = -grad_entry                       # sparse: A enters as Q = -[[A, 0], [0, 0]]
        return 1.0, dP, dQ
    return reference_engine(loss_and_grad_gram=loss_and_grad_gram)


def test_train_lbfgs_decreases_loss_reports_status_and_is_reproducible():
    rng, Z, y = small_problem(seed=12, B=200, n=8)
    runs = [ir.train_lbfgs(Z, y, 2, structure="sparse", rng=np.random.default_rng(1), maxiter=200)
            for _ in range(2)]
    res = runs[0]
    assert res["loss"] < 0.5 * res["history"][0]
    assert res["loss"] == pytest.approx(ir.in_context_loss(res["P"], res["Q"], Z, y), rel=EXACT)
    assert np.array_equal(res["coords"]["A"], runs[1]["coords"]["A"])
    assert res["success"] and res["status"] == 0 and not res["interrupted"]
    for key in ("nit", "nfev", "message", "grad_norm", "wall_time", "scipy_version", "options"):
        assert key in res
    assert np.all(np.diff(res["history"]) <= 0)            # L-BFGS-B accepts only descent steps


def test_train_lbfgs_reports_non_convergence():
    rng, Z, y = small_problem(seed=13, B=200, n=8)
    res = ir.train_lbfgs(Z, y, 3, structure="blocks", rng=rng, maxiter=3)
    assert res["nit"] == 3 and not res["success"] and res["status"] == 1
    assert "LIMIT" in res["message"].upper()


def test_train_lbfgs_keyboard_interrupt_returns_last_iterate():
    rng, Z, y = small_problem(seed=14, B=100, n=8)
    calls = []

    def interrupted(*args):
        calls.append(1)
        if len(calls) > 8:
            raise KeyboardInterrupt
        return ir.REFERENCE.loss_and_grad_gram(*args)
    res = ir.train_lbfgs(Z, y, 2, structure="full", rng=rng, maxiter=100,
                         engine=reference_engine(loss_and_grad_gram=interrupted))
    assert res["interrupted"] and not res["success"] and "interrupted" in res["message"]
    assert res["loss"] == pytest.approx(ir.in_context_loss(res["P"], res["Q"], Z, y), rel=EXACT)
    assert res["loss"] == res["history"][-1] < res["history"][0]


def test_train_lbfgs_progress_lines(capsys):
    rng, Z, y = small_problem(seed=15, B=50, n=8)
    ir.train_lbfgs(Z, y, 1, rng=rng, maxiter=4, progress=2)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all("loss" in line and "|grad|" in line and " s" in line for line in err)


def test_train_lbfgs_accepts_init_dict():
    rng, Z, y = small_problem(seed=16, B=50, n=8)
    A0 = rng.standard_normal((2, 3, 3))
    res = ir.train_lbfgs(Z, y, 2, init={"A": A0}, maxiter=1)
    assert res["history"][0] == pytest.approx(ir.in_context_loss(*ir.sparse_params(A0), Z, y), rel=EXACT)


def test_train_gauss_newton_converges_and_matches_lbfgs():
    rng, Z, y = small_problem(seed=113, B=400, n=8)
    A0 = 0.1 * rng.standard_normal((2, 3, 3))
    gn = ir.train_gauss_newton(Z, y, 2, init={"A": A0})
    lb = ir.train_lbfgs(Z, y, 2, init={"A": A0}, maxiter=2000)
    assert gn["success"] and gn["grad_norm"] <= 1e-8 and not gn["interrupted"]
    # both stop at gradients <= 1e-8 near a minimiser; a loss gap there is O(|grad|^2 / curvature)
    assert gn["loss"] == pytest.approx(lb["loss"], rel=1e-9)
    assert gn["loss"] == pytest.approx(ir.in_context_loss(gn["P"], gn["Q"], Z, y), rel=EXACT)
    for key in ("coords", "P", "Q", "loss", "grad_norm", "nit", "nfev", "success", "message", "history",
                "interrupted", "wall_time", "fixed"):
        assert key in gn
    B0 = rng.standard_normal((2, 3, 3))
    gb = ir.train_gauss_newton(Z, y, 2, structure="blocks", init={"A": A0, "B": B0})
    assert gb["fixed"] == 9 and np.array_equal(gb["coords"]["B"][1], B0[1])   # B_{L-1} held
    assert gb["success"] == (gb["grad_norm"] <= 1e-8)      # converged means a small gradient
    _, dP, dQ = ir.loss_and_grad(gb["P"], gb["Q"], Z, y)
    # two exact routes to one gradient; at |g| ~ 1e-8 rounding of O(1) terms (1e-16) is 1e-8 relative
    assert gb["grad_norm"] == pytest.approx(
        np.linalg.norm(ir.pack(ir.structure_grad("blocks", dP, dQ).values())), rel=1e-4)
    assert f"gradient norm {gb['grad_norm']:.2e}" in gb["message"]


def test_train_lbfgs_survives_an_overflowing_trial_point_and_reports_its_own_loss():
    # blocks, L = 4, init_scale 1.5 at the paper's covariance: a line-search trial point overflows
    # float64. It is a failed trial (counted in the message), and the returned loss is the loss of
    # the returned parameters.
    rng = np.random.default_rng(0)
    Sigma, _ = ir.rotated_covariance(rng)
    Z, y = ir.sample_prompts(rng, 300, 20, Sigma, np.linalg.inv(Sigma))
    overflowed = []

    def spy(*args):
        out = ir.REFERENCE.loss_and_grad_gram(*args)
        overflowed.append(not all(np.all(np.isfinite(v)) for v in out))
        return out
    res = ir.train_lbfgs(Z, y, 4, structure="blocks", rng=rng, init_scale=1.5, maxiter=60,
                         engine=reference_engine(loss_and_grad_gram=spy))
    assert any(overflowed) and not overflowed[0]              # the situation under test did occur
    assert math.isfinite(res["loss"]) and res["nit"] >= 1
    assert f"{sum(overflowed)} trial points overflowed" in res["message"]
    assert res["loss"] == pytest.approx(ir.in_context_loss(res["P"], res["Q"], Z, y), rel=EXACT)
    assert res["loss"] <= res["history"][0]
    with pytest.raises(ValueError, match="initial point"):
        ir.train_lbfgs(Z, y, 4, structure="blocks", rng=rng, init_scale=1e80)


def test_train_lbfgs_validates_before_drawing_from_rng():
    rng = np.random.default_rng(132)
    state = rng.bit_generator.state
    for bad in (dict(maxiter=0), dict(ftol=-1.0), dict(maxls=0), dict(progress=-1), dict(maxcor=0)):
        with pytest.raises((ValueError, TypeError)):
            ir.train_lbfgs(np.ones((3, 4, 6)), np.zeros(3), 1, rng=rng, **bad)
        assert rng.bit_generator.state == state
    with pytest.raises(ValueError):
        ir.train_gauss_newton(np.ones((3, 4, 6)), np.zeros(3), 1, rng=rng, gtol=-1.0)
    assert rng.bit_generator.state == state


@pytest.mark.parametrize("trainer", ["lbfgs", "gauss_newton"])
@pytest.mark.parametrize("at_call", [1, 3])
def test_ctrl_c_raises_before_the_first_evaluation_and_returns_a_whole_result_after(trainer, at_call):
    rng, Z, y = small_problem(seed=133, B=40, n=8)
    name = "loss_and_grad_gram" if trainer == "lbfgs" else "jacobian_gram"
    calls = []

    def interrupt(*args):
        calls.append(1)
        if len(calls) == at_call:
            raise KeyboardInterrupt
        return getattr(ir.REFERENCE, name)(*args)
    train = getattr(ir, f"train_{trainer}")
    if at_call == 1:                    # nothing completed: nothing to return
        with pytest.raises(KeyboardInterrupt):
            train(Z, y, 2, rng=rng, engine=reference_engine(**{name: interrupt}))
        return
    res = train(Z, y, 2, rng=rng, engine=reference_engine(**{name: interrupt}))
    assert res["interrupted"] and not res["success"] and "interrupted" in res["message"]
    assert res["P"] is not None and math.isfinite(res["loss"])
    # the returned loss is the loss of the returned point (exact up to the data scale's rounding)
    assert res["loss"] == pytest.approx(ir.in_context_loss(res["P"], res["Q"], Z, y), rel=1e-12)


def test_gauss_newton_reduced_system_has_the_same_normal_equations():
    # MATH.md §6: the solver sees (f, R) with R^T R = J^T J, R^T f = J^T r, |f| = |r|, so its
    # trust-region steps are those of the full (B, p) system; also with fewer prompts than p + 1
    rng = np.random.default_rng(160)
    for B in (12000, 500, 9):                # 12000 rows: three blocks of rows, the last one partial
        J, r = rng.standard_normal((B, 12)) * np.logspace(0, 3, 12), rng.standard_normal(B)
        f, R = ir._reduced_least_squares(r, J)
        assert f.shape == (13,) and R.shape == (13, 12) and not np.any(R[12])
        assert_allclose(R.T @ R, J.T @ J, rtol=0, atol=EXACT * np.max(np.abs(J.T @ J)))
        assert_allclose(R.T @ f, J.T @ r, rtol=0, atol=EXACT * np.max(np.abs(J.T @ J)) * np.max(np.abs(r)))
        assert f @ f == pytest.approx(r @ r, rel=EXACT)


def test_gauss_newton_factor_rounds_alike_whatever_the_blas_threads():
    # MATH.md §6: the factor is built from small blocks, whose products run on the calling thread,
    # so a plain process and one with OPENBLAS_NUM_THREADS=1 get the same bits (LAPACK's QR of the
    # whole (B, p+1) matrix does not, and the solver then takes another path)
    code = ("import sys, numpy as np; sys.path.insert(0, sys.argv[1]); import icl_ref as ir; "
            "rng = np.random.default_rng(3); J, r = rng.standard_normal((20000, 75)), rng.standard_normal(20000); "
            "f, R = ir._reduced_least_squares(r, J); sys.stdout.write((f.tobytes() + R.tobytes()).hex())")
    here = os.path.dirname(os.path.abspath(__file__))
    plain = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")}
    outs = [subprocess.run([sys.executable, "-c", code, here], capture_output=True, text=True, check=True,
                           env=dict(plain, **threads)).stdout for threads in ({}, {"OPENBLAS_NUM_THREADS": "1"})]
    assert outs[0] == outs[1]


def test_trainers_call_success_only_what_converged():
    # full P, Q with large starts at L = 4: the loss is finite but huge and the gradient ~1e170;
    # trial points overflow. success is icl_ref's verdict (finite, gradient below gtol), never SciPy's
    for seed in range(3):
        Z, y = ir.sample_prompts(np.random.default_rng(seed), 300, 5, np.eye(3))
        res = ir.train_lbfgs(Z, y, 4, structure="full", init_scale=2.0, rng=np.random.default_rng(seed), maxiter=40)
        assert math.isfinite(res["loss"]) and math.isfinite(res["grad_norm"])       # no overflow in the norm
        assert not res["success"] and "> gtol" in res["message"] and "overflowed" in res["message"]
        assert res["loss"] == pytest.approx(ir.in_context_loss(res["P"], res["Q"], Z, y), rel=EXACT)
    rng, Z, y = small_problem(seed=139, B=200, n=8)
    res = ir.train_lbfgs(Z, y, 1, rng=rng, gtol=1e-6)
    # success: no entry above gtol, so the 2-norm is at most sqrt(p) gtol, p = 9
    assert res["success"] and res["grad_norm"] <= 1e-6 * 3 and "<= gtol 1.0e-06" in res["message"]
    res = ir.train_lbfgs(Z, y, 1, rng=rng, gtol=0.0, maxiter=50)      # gtol 0: SciPy may stop, icl_ref says no
    assert not res["success"]
    for trainer in (ir.train_lbfgs, ir.train_gauss_newton):
        with pytest.raises(ValueError, match="all zero or subnormal"):    # nothing at float64 precision
            trainer(Z * 1e-320, y * 1e-320, 1, rng=rng)


@pytest.mark.parametrize("trainer", ["lbfgs", "gauss_newton"])
def test_trainers_read_the_same_at_any_scale_of_the_data(trainer):
    # units are the caller's choice: data times 2^-300 (exact) give the same run bit for bit, with
    # the loss times 2^-600 and A times 2^600; data in milli-units (1e-3, not a power of two)
    # converge to the rescaled loss (only rounding differs) or say they did not
    rng, Z, y = small_problem(seed=140, B=300, n=10)
    train = getattr(ir, f"train_{trainer}")
    kw = dict(structure="sparse", init_scale=0.1)
    ref = train(Z, y, 2, rng=np.random.default_rng(1), **kw)
    assert ref["success"]
    tiny = train(Z * 2.0 ** -300, y * 2.0 ** -300, 2, rng=np.random.default_rng(1), **kw)
    assert tiny["nit"] == ref["nit"] and tiny["success"]
    assert tiny["loss"] == ref["loss"] * 2.0 ** -600
    np.testing.assert_array_equal(tiny["coords"]["A"], ref["coords"]["A"] * 2.0 ** 600)
    milli = train(Z * 1e-3, y * 1e-3, 2, rng=np.random.default_rng(1), **kw)
    assert milli["nit"] > 0
    if milli["success"]:
        # the acceptance bound: within 5% of the converged loss in the caller's units
        assert milli["loss"] == pytest.approx(ref["loss"] * 1e-6, rel=0.05)


def test_train_lbfgs_options_are_wired_as_documented(capsys):
    rng, Z, y = small_problem(seed=140, B=60, n=8)
    seen = {}
    real = scipy.optimize.minimize

    def spy(*args, **kwargs):
        seen.update(kwargs["options"])
        return real(*args, **kwargs)
    with mock.patch.object(scipy.optimize, "minimize", spy):
        res = ir.train_lbfgs(Z, y, 1, rng=rng, maxiter=7, ftol=1e-3, gtol=1e-4, maxcor=5, maxls=9)
    assert seen == dict(maxiter=7, maxfun=35, maxcor=5, ftol=1e-3, gtol=1e-4, maxls=9) == res["options"]
    A0 = 0.3 * rng.standard_normal((1, 3, 3))
    res = ir.train_lbfgs(Z, y, 1, init={"A": A0}, maxiter=5, keep_iterates=True, progress=2)
    assert np.array_equal(res["iterates"][0]["A"], A0) and len(res["iterates"]) == res["nit"] + 1
    lines = capsys.readouterr().err.splitlines()
    assert [int(line.split()[1]) for line in lines] == list(range(2, res["nit"] + 1, 2))


def test_gauss_newton_holds_the_coordinates_that_never_reach_the_loss():
    # full, L = 2: the x-rows of the last P stay; full, L = 1: also Q's last column (the query's label
    # slot is 0); each at its initial value, exactly
    rng, Z, y = small_problem(seed=141, B=80, n=6)
    for L, fixed in ((2, 3 * 4), (1, 3 * 4 + 4)):       # d = 3 x-rows of 4; and 4 entries of Q's last column
        init = {k: 0.3 * rng.standard_normal(s) for k, s in ir.structure_shapes("full", L, 3, 1).items()}
        res = ir.train_gauss_newton(Z, y, L, structure="full", init=init, max_nfev=5)
        assert res["fixed"] == fixed
        assert np.array_equal(res["P"][-1, :, :-1, :], init["P"][-1, :, :-1, :])
        if L == 1:
            assert np.array_equal(res["Q"][0, :, :, -1], init["Q"][0, :, :, -1])
        else:
            assert not np.array_equal(res["Q"][0, :, :, -1], init["Q"][0, :, :, -1])


def test_lbfgs_success_at_the_boundary_of_gtol():
    # success is "largest entry <= gtol": at equality yes, a hair below no; gtol = 0 with an exactly
    # zero gradient yes (a stationary start), and the message states the comparison
    rng, Z, y = small_problem(seed=191, B=20, n=5)
    g = 3.0e-6
    res = ir.train_lbfgs(Z, y, 1, init={"A": np.eye(3)[None]}, gtol=g, engine=_stub_engine(g))
    assert res["success"] and res["nit"] == 0 and "<= gtol" in res["message"]
    res = ir.train_lbfgs(Z, y, 1, init={"A": np.eye(3)[None]}, gtol=g * (1 - 1e-12), maxiter=3,
                         engine=_stub_engine(g))
    assert not res["success"] and "> gtol" in res["message"]
    res = ir.train_lbfgs(Z, y, 1, init={"A": np.eye(3)[None]}, gtol=0.0, engine=_stub_engine(0.0))
    assert res["success"] and res["grad_norm"] == 0.0


def test_gauss_newton_interrupted_at_a_converged_point_is_not_a_success(monkeypatch):
    # Ctrl-C lands in the evaluation whose gradient first passes gtol (while its progress line is
    # written, before the run could stop there): interrupted, no verdict, though the gradient would pass
    rng, Z, y = small_problem(seed=192, B=200, n=8)
    said = ir._Run.say

    def say(run, what, k, loss, grad):
        if np.linalg.norm(grad) <= 1e-8:
            raise KeyboardInterrupt
        said(run, what, k, loss, grad)
    monkeypatch.setattr(ir._Run, "say", say)
    res = ir.train_gauss_newton(Z, y, 1, rng=rng)
    assert res["interrupted"] and res["grad_norm"] <= 1e-8 and not res["success"] and len(res["history"]) >= 2


def test_gauss_newton_reads_the_query_label_slot_for_the_coordinates_it_holds():
    # one full layer: Q's last column meets the query only through its label slot, so it is held
    # fixed when every slot is 0 and trained when one is not (d x-rows of P held in both)
    rng, Z, y = small_problem(seed=193, B=60, n=6)
    init = {k: 0.3 * rng.standard_normal(s) for k, s in ir.structure_shapes("full", 1, 3, 1).items()}
    assert ir.train_gauss_newton(Z, y, 1, structure="full", init=init, max_nfev=3)["fixed"] == 3 * 4 + 4
    Z = Z.copy()
    Z[0, -1, -1] = 0.5
    assert ir.train_gauss_newton(Z, y, 1, structure="full", init=init, max_nfev=3)["fixed"] == 3 * 4


def test_lbfgs_interrupted_at_a_converged_point_is_not_a_success():
    # SciPy's own test stops L-BFGS-B at a converged iterate, so Ctrl-C can only land while it still
    # runs: a stand-in for the solver evaluates the start (gradient exactly 0 <= gtol), reports it as an
    # iterate and is interrupted. The last iterate is returned, interrupted, and success is False
    rng, Z, y = small_problem(seed=196, B=20, n=5)

    def interrupted(fun, x0, callback=None, **kwargs):
        fun(x0)
        callback(x0)
        raise KeyboardInterrupt
    with mock.patch.object(scipy.optimize, "minimize", interrupted):
        res = ir.train_lbfgs(Z, y, 1, init={"A": np.eye(3)[None]}, engine=_stub_engine(0.0))
    assert res["interrupted"] and res["grad_norm"] == 0.0 and not res["success"] and res["nit"] == 1


def test_gauss_newton_success_at_gtol_zero_with_an_exactly_zero_gradient():
    # every label 0 and A = 0: every residual is exactly 0, so the gradient 2 J^T r / B is exactly 0
    # and "grad_norm <= gtol" holds at gtol = 0 (equality)
    rng, Z, y = small_problem(seed=197, B=30, n=5)
    Z = Z.copy()
    Z[:, -1, :] = 0.0
    res = ir.train_gauss_newton(Z, np.zeros(30), 1, init={"A": np.zeros((1, 3, 3))}, gtol=0.0, max_nfev=3)
    assert res["grad_norm"] == 0.0 and res["success"] and "<= gtol" in res["message"]


def test_init_history_and_progress_are_in_the_callers_units(capsys):
    # data times 2^-20 (an exact power of two, c = 2^-20 here): an init dict is read in the caller's
    # units, and the history and the progress lines report the loss in them (the first entry is the
    # loss at that init; 1e-12: one evaluation in rescaled units, mapped back exactly, then rounded;
    # the printed loss has 7 significant digits: 5e-7 relative; the losses are ~1e-12 here, so no
    # absolute tolerance)
    rng, Z, y = small_problem(seed=198, B=40, n=6)
    Zs, ys = Z * 2.0 ** -20, y * 2.0 ** -20
    A0 = 0.3 * rng.standard_normal((1, 3, 3))
    start = ir.in_context_loss(*ir.sparse_params(A0), Zs, ys)
    res = ir.train_gauss_newton(Zs, ys, 1, init={"A": A0}, max_nfev=2)
    assert res["scale"] == 2.0 ** -20 and res["history"][0] == pytest.approx(start, rel=1e-12, abs=0)
    capsys.readouterr()
    res = ir.train_lbfgs(Zs, ys, 1, init={"A": A0}, maxiter=2, progress=1)
    assert res["scale"] == 2.0 ** -20 and res["history"][0] == pytest.approx(start, rel=1e-12, abs=0)
    printed = [float(line.split()[3]) for line in capsys.readouterr().err.splitlines()]
    assert printed and all(p == pytest.approx(h, rel=5e-7, abs=0) for p, h in zip(printed, res["history"][1:]))


def test_gauss_newton_stops_at_the_first_evaluation_its_own_test_passes():
    # every evaluation's loss |f|^2 and gradient 2 R^T f, seen through the engine's reduced least squares
    # (f, R: r / sqrt(B), J / sqrt(B) reduced): the run ends at the first new lowest loss whose gradient norm
    # is within gtol, and says so; gtol = 0 runs on to SciPy's own tolerances, to the same minimum
    rng, Z, y = small_problem(seed=113, B=400, n=8)
    A0 = 0.1 * rng.standard_normal((2, 3, 3))
    seen = []

    def reduced(r, J):
        f, R = ir.REFERENCE.reduced_least_squares(r, J)
        seen.append((float(f @ f), float(np.linalg.norm(2 * R.T @ f))))
        return f, R
    res = ir.train_gauss_newton(Z, y, 2, init={"A": A0}, engine=reference_engine(reduced_least_squares=reduced))
    lowest, first = math.inf, None
    for k, (loss, grad) in enumerate(seen):
        if loss < lowest:
            lowest = loss
            if grad <= 1e-8:
                first = k + 1
                break
    assert first is not None and res["nfev"] == res["nit"] == first == len(seen) and res["status"] == 1
    assert res["success"] and res["message"].startswith(f"stopped at evaluation {first}: the gradient norm is within gtol")
    full = ir.train_gauss_newton(Z, y, 2, init={"A": A0}, gtol=0.0)
    assert full["nfev"] >= res["nfev"] and not full["message"].startswith("stopped")
    # a gradient within 1e-8 near a minimiser: the loss within O(|grad|^2 / curvature) of the end's
    assert res["loss"] == pytest.approx(full["loss"], rel=1e-9)


def test_gauss_newton_solves_through_the_engine_given():
    # the reduced least squares of every evaluation is the engine's (icl_fast's tall-skinny QR)
    rng, Z, y = small_problem(seed=199, B=40, n=6)
    seen = []

    def reduced(r, J):
        seen.append(r.shape)
        return ir.REFERENCE.reduced_least_squares(r, J)
    ir.train_gauss_newton(Z, y, 1, rng=rng, max_nfev=3, engine=reference_engine(reduced_least_squares=reduced))
    assert seen and all(shape == (40,) for shape in seen)


# ---------------------------------------------------------------------------------------------
# §7 Lemma 1: the sparse transformer is preconditioned gradient descent, with a transpose
# ---------------------------------------------------------------------------------------------

def test_lemma1_forward_equals_preconditioned_gd_with_transpose():
    rng, Z, _ = small_problem(seed=20, B=4, n=7)
    A = rng.standard_normal((3, 3, 3))                     # not symmetric
    layers = ir.forward(*ir.sparse_params(A), Z, all_layers=True)
    X, y_ctx = Z[:, :3, :-1].transpose(0, 2, 1), Z[:, 3, :-1]
    W = ir.preconditioned_gd(X, y_ctx, A)
    x_all, y0 = Z[:, :3, :], Z[:, 3, :]                    # every token, query included (y0 = 0)
    for l in range(4):
        label_row = y0 - np.einsum("bd,bdj->bj", W[:, l], x_all)
        assert_allclose(layers[l, :, 3, :], label_row, rtol=0, atol=EXACT * np.max(np.abs(label_row)))
    # the paper's form without the transpose is off by O(1) for non-symmetric A
    W_paper = [np.zeros((4, 3))]
    for A_l in A:
        grad_R = np.einsum("bid,bi->bd", X, np.einsum("bid,bd->bi", X, W_paper[-1]) - y_ctx) / 7
        W_paper.append(W_paper[-1] - np.einsum("ij,bj->bi", A_l, grad_R))
    query_paper = -np.einsum("bd,bd->b", W_paper[-1], Z[:, :3, -1])
    assert np.max(np.abs(query_paper - layers[-1, :, 3, -1])) > 1e-2


def test_lemma1_two_line_counterexample():
    # MATH.md §7: d = 2, n = 1, x_0 = e_0, y_0 = 1, query e_1, A = [[0, 1], [0, 0]]
    Z = np.array([[[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]])
    A = np.array([[[0.0, 1.0], [0.0, 0.0]]])
    assert ir.predict(*ir.sparse_params(A), Z)[0] == 1.0                  # (1/n) y_0 x_0^T A x_1
    W = ir.preconditioned_gd(Z[0, :2, :1].T, Z[0, 2, :1], A)
    assert_allclose(W[1], [0.0, 1.0], rtol=0, atol=0)                     # A^T e_0 = e_1: y_hat = 1
    assert_allclose(A[0] @ np.array([1.0, 0.0]), [0.0, 0.0])              # the printed A e_0 = 0


# ---------------------------------------------------------------------------------------------
# §8 One layer: Theorem 1 generalised, Mahankali et al., Theorem 5
# ---------------------------------------------------------------------------------------------

def mc_loss(P, Q, Z, y):
    """(mean, standard error) of the per-prompt squared error."""
    err = (ir.predict(P, Q, Z) - y) ** 2
    return err.mean(), err.std(ddof=1) / math.sqrt(len(err))


def ols_excess_bound(Phi, resid, H_pop):
    """Mean and sd of B * (excess population loss) of least squares on features Phi (B, p):
    asymptotically theta_hat - theta* ~ N(0, H^-1 V H^-1 / B) with V = E[phi phi^T resid^2], and
    the excess loss (theta_hat - theta*)^T H (theta_hat - theta*) is a weighted chi-square whose
    weights are the eigenvalues of H^-1 V (mean = their sum, variance = 2 * sum of squares)."""
    V = (Phi * resid[:, None] ** 2).T @ Phi / len(Phi)
    w = np.linalg.eigvals(np.linalg.solve(H_pop, V)).real
    return w.sum(), math.sqrt(2 * np.sum(w ** 2))


def _sqrtm_spd(M):
    lam, V = np.linalg.eigh(M)
    return (V * np.sqrt(lam)) @ V.T


def test_theorem1_gamma_star_reduces_to_eq6():
    rng = np.random.default_rng(21)
    Sigma, U = ir.rotated_covariance(rng, [1.0, 0.3, 2.5, 0.7])
    n = 9
    lam = np.array([1.0, 0.3, 2.5, 0.7])
    eq6 = (U / ((n + 1) / n * lam + lam.sum() / n)) @ U.T   # U diag(1/((n+1)/n l_i + tr/n)) U^T
    assert_allclose(ir.gamma_star(Sigma, n), eq6, rtol=EXACT, atol=EXACT)
    iso = ir.gamma_star(np.eye(4), n)
    assert_allclose(iso, n / (n + 4 + 1) * np.eye(4), rtol=EXACT, atol=EXACT)   # eq. (7)


@pytest.mark.parametrize("noise", [0.0, 0.7])
def test_theorem1_gamma_star_against_the_whitened_eigen_form(noise):
    # MATH.md §8: Gamma* = Sigma^-1/2 V diag(mu / ((n+1)/n mu + c)) V^T Sigma^-1/2 with
    # C = Sigma^1/2 Sigma_w Sigma^1/2 = V diag(mu) V^T, c = (tr C + noise)/n: no K, no solve
    rng = np.random.default_rng(102)
    n, d = 7, 4
    Sigma, _ = ir.rotated_covariance(rng, [0.3, 1.0, 2.0, 0.6])
    E = rng.standard_normal((d, d))
    Sigma_w = E @ E.T / d + 0.2 * np.eye(d)
    R = _sqrtm_spd(Sigma)
    mu, V = np.linalg.eigh(R @ Sigma_w @ R)
    c = (mu.sum() + noise) / n
    Ri = np.linalg.inv(R)
    expected = Ri @ (V * (mu / ((n + 1) / n * mu + c))) @ V.T @ Ri
    G = ir.gamma_star(Sigma, n, Sigma_w, noise_var=noise)
    assert_allclose(G, expected, rtol=0, atol=1e-12 * np.max(np.abs(expected)))   # EXACT, scale of G
    assert_allclose(G, G.T, rtol=0, atol=1e-12 * np.max(np.abs(G)))      # symmetric, though K^-1 Sigma Sigma_w
    assert np.max(np.abs(Sigma @ Sigma_w - Sigma_w @ Sigma)) > 0.1          # ... with Sigma, Sigma_w not commuting
    L_star = mu.sum() - np.sum(mu ** 2 / ((n + 1) / n * mu + c)) + noise
    # 1e-11: L(Gamma*) = tr C - sum mu^2 / (...) + noise cancels O(1) terms to L* ~ 0.3
    assert ir.single_layer_population_loss(G, Sigma, n, Sigma_w, noise) == pytest.approx(L_star, rel=1e-11)


def test_theorem1_gamma_star_is_stationary_for_the_exact_loss():
    rng = np.random.default_rng(22)
    Sigma, _ = ir.rotated_covariance(rng, [1.0, 0.5, 2.0])
    Sigma_w, _ = ir.rotated_covariance(rng, [0.4, 1.0, 3.0])
    G = ir.gamma_star(Sigma, 6, Sigma_w, noise_var=0.3)
    f = lambda X: ir.single_layer_population_loss(X, Sigma, 6, Sigma_w, noise_var=0.3)
    grad = central_diff(f, G)
    # the loss is O(1); FD rounding error is eps * f / h ~ 1e-10
    assert np.max(np.abs(grad)) < 1e-8
    E = rng.standard_normal((3, 3))                        # and it is a minimum: f(G + E) > f(G)
    assert f(G + 1e-3 * E) > f(G)


def test_theorem1_second_moment_K_matches_monte_carlo():
    # MATH.md §8: K = E[h h^T], h = (1/n) sum_i y_i x_i, sampled through sample_prompts; the closed
    # form is read off the exact loss (a quadratic in Gamma), sharing no code with the sampler
    rng = np.random.default_rng(103)
    n, d, noise = 4, 3, 0.5
    Sigma, _ = ir.rotated_covariance(rng, [0.5, 1.0, 2.0])
    Sigma_w = np.diag([1.0, 0.5, 2.0])
    Z, _ = ir.sample_prompts(rng, 400_000, n, Sigma, Sigma_w, noise_std=math.sqrt(noise))
    h = np.einsum("bdi,bi->bd", Z[:, :d, :n], Z[:, d, :n]) / n
    hh = np.einsum("bi,bj->bij", h, h)
    mean, se = hh.mean(axis=0), hh.std(axis=0, ddof=1) / math.sqrt(len(h))
    # L(Gamma) = tr(Sigma Gamma^T K Gamma) + linear + const, so for Gamma = E_ij: L(E_ij) + L(-E_ij)
    # - 2 L(0) = 2 Sigma_jj K_ii; off-diagonal K_ik from Gamma = E_ij + E_kj
    f = lambda G: ir.single_layer_population_loss(G, Sigma, n, Sigma_w, noise)
    e = np.eye(d)
    quad = lambda G: (f(G) + f(-G) - 2 * f(np.zeros((d, d)))) / 2      # tr(Sigma G^T K G)
    K = np.empty((d, d))
    for i in range(d):
        for k in range(d):
            Gi, Gk = np.outer(e[i], e[0]), np.outer(e[k], e[0])
            K[i, k] = (quad(Gi + Gk) - quad(Gi) - quad(Gk)) / (2 * Sigma[0, 0])
    assert np.all(np.abs(mean - K) <= Z_MC * se)


def test_theorem1_population_loss_matches_monte_carlo():
    rng = np.random.default_rng(23)
    Sigma, _ = ir.rotated_covariance(rng, [1.0, 0.5, 2.0])
    Sigma_w, _ = ir.rotated_covariance(rng, [0.4, 1.0, 3.0])
    Gamma = rng.standard_normal((3, 3))
    Z, y = ir.sample_prompts(rng, 100_000, 6, Sigma, Sigma_w, noise_std=0.6)
    mean, se = mc_loss(*ir.sparse_params(Gamma[None]), Z, y)
    exact = ir.single_layer_population_loss(Gamma, Sigma, 6, Sigma_w, noise_var=0.36)
    assert abs(mean - exact) <= Z_MC * se


@pytest.mark.parametrize("heads", [1, 2])
def test_full_layer_population_loss_matches_monte_carlo(heads):
    # the exact rule over w* against the transformer itself on sampled prompts (no shared algebra)
    rng = np.random.default_rng(30 + heads)
    Sigma, _ = ir.rotated_covariance(rng, [1.0, 0.5, 2.0])
    Sigma_w, _ = ir.rotated_covariance(rng, [0.4, 1.0, 3.0])
    P, Q = random_params(rng, 1, heads, 3, scale=0.3)
    Z, y = ir.sample_prompts(rng, 400_000, 6, Sigma, Sigma_w)
    mean, se = mc_loss(P, Q, Z, y)
    assert abs(mean - ir.full_layer_population_loss(P, Q, Sigma, 6, Sigma_w)) <= Z_MC * se


def test_full_layer_population_loss_is_theorem1_at_sparse_params_and_ignores_what_cannot_act():
    rng = np.random.default_rng(32)
    Sigma, _ = ir.rotated_covariance(rng, [1.0, 0.5, 2.0, 0.3])
    Sigma_w, _ = ir.rotated_covariance(rng, [0.4, 1.0, 3.0, 2.0])
    Gamma = rng.standard_normal((4, 4))
    P, Q = ir.sparse_params(Gamma[None])
    for S_w in (None, Sigma_w):
        # 1e-12: the same quadratic form summed over 256 nodes instead of in closed form
        assert_allclose(ir.full_layer_population_loss(P, Q, Sigma, 7, S_w),
                        ir.single_layer_population_loss(Gamma, Sigma, 7, S_w), rtol=EXACT)
    # P's rows above the last and Q's last column never reach the prediction (the query label is 0);
    # the rescaling (c P, Q / c) is exact
    P2, Q2 = random_params(rng, 1, 1, 4)
    moved_P, moved_Q = P2.copy(), Q2.copy()
    moved_P[0, 0, :-1] += rng.standard_normal((4, 5))
    moved_Q[0, 0, :, -1] += rng.standard_normal(5)
    f = ir.full_layer_population_loss(P2, Q2, Sigma, 7)
    assert_allclose(ir.full_layer_population_loss(moved_P, moved_Q, Sigma, 7), f, rtol=EXACT)
    assert_allclose(ir.full_layer_population_loss(2.5 * P2, Q2 / 2.5, Sigma, 7), f, rtol=EXACT)
    with pytest.raises(ValueError, match="one layer"):
        ir.full_layer_population_loss(*random_params(rng, 2, 1, 4), Sigma, 7)
    with pytest.raises(ValueError, match="d must be <= 8"):
        ir.full_layer_population_loss(*random_params(rng, 1, 1, 9), np.eye(9), 7)
    with pytest.raises(ValueError, match=r"Sigma must have shape \(4, 4\)"):
        ir.full_layer_population_loss(P2, Q2, np.eye(3), 7)


def test_full_layer_population_loss_at_its_documented_limit():
    # d = MAX_FULL_LAYER_D is computed (and equals the sparse closed form at sparse (P, Q)); one
    # more is refused before any work. EXACT: the same expectation by two exact routes
    d = ir.MAX_FULL_LAYER_D
    G = ir.gamma_star(np.eye(d), 10)
    P, Q = ir.sparse_params(G[None])
    assert ir.full_layer_population_loss(P, Q, np.eye(d), 10) == pytest.approx(
        ir.single_layer_population_loss(G, np.eye(d), 10, query_noise=False), rel=1e-10)
    P, Q = ir.sparse_params(np.eye(d + 1)[None])
    with pytest.raises(ValueError, match=f"d must be <= {d}"):
        ir.full_layer_population_loss(P, Q, np.eye(d + 1), 10)


@pytest.mark.parametrize("structure", ["sparse", "full"])
def test_theorem1_trained_single_layer_predicts_like_gamma_star(structure):
    rng = np.random.default_rng(24)
    d, n, B = 3, 10, 20_000
    Sigma, _ = ir.rotated_covariance(rng, [1.0, 0.4, 2.0])
    Z, y = ir.sample_prompts(rng, B, n, Sigma)
    G = ir.gamma_star(Sigma, n)
    # converged at gtol 1e-6: the loss is then within ~|g|^2 / curvature ~1e-10 of the batch optimum,
    # far below the bound below (at 1e-8, SciPy 1.18's line search stops at 1.6e-8 with no decrease)
    res = ir.train_lbfgs(Z, y, 1, structure=structure, rng=rng, init_scale=0.3, maxiter=3000, gtol=1e-6)
    assert res["success"], res["message"]
    # the exact loss is f(G) + E (y_hat - y_hat*)^2, so the excess is measured on fresh prompts
    Zt, _ = ir.sample_prompts(rng, 200_000, n, Sigma)
    diff2 = (ir.predict(res["P"], res["Q"], Zt) - ir.predict(*ir.sparse_params(G[None]), Zt)) ** 2
    excess, excess_se = diff2.mean(), diff2.std(ddof=1) / math.sqrt(len(diff2))
    # bound: least squares on the features the model can use near the optimum; sparse: the d^2
    # features vec(h x_q^T) (y_hat = <Gamma, h x_q^T>); full: also the 2d label-even features
    # (1/n) sum_i x_i x_i^T G x_q and (1/n) sum_i y_i^2 x_q that P's last row and Q's last row add
    X, Yc, xq = Z[:, :d, :n], Z[:, d, :n], Z[:, :d, n]
    h = np.einsum("bdi,bi->bd", X, Yc) / n
    Phi = (h[:, :, None] * xq[:, None, :]).reshape(B, -1)
    if structure == "full":
        even_x = np.einsum("bdi,bei,ef,bf->bd", X, X, G, xq) / n
        even_y = (Yc ** 2).mean(axis=1)[:, None] * xq
        Phi = np.hstack([Phi, even_x, even_y])
    resid = y - ir.predict(*ir.sparse_params(G[None]), Z)
    mean, sd = ols_excess_bound(Phi, resid, Phi.T @ Phi / B)
    bound = (mean + 5 * sd) / B
    assert excess - Z_MC * excess_se <= bound


def test_gamma_star_and_the_single_layer_loss_at_extreme_scales():
    # Gamma* scales as 1/c for Sigma = c S without noise: scale-free, at 1e-200 and 1e160 too
    rng = np.random.default_rng(134)
    S, _ = ir.rotated_covariance(rng, [0.5, 1.0, 2.0])
    G = ir.gamma_star(S, 7)
    for c in (1e-200, 1e160):
        assert_allclose(ir.gamma_star(c * S, 7) * c, G, rtol=1e-12, atol=1e-12 * np.max(np.abs(G)))
    with pytest.raises(ValueError, match="overflow"):
        ir.single_layer_population_loss(1e200 * np.eye(3), S, 7)


def test_the_single_layer_loss_is_right_at_any_scale_of_sigma_or_says_it_cannot_be():
    # L(Gamma* of c S; c S) = c L(Gamma* of S; S) exactly in the mathematics (noiseless): computed
    # scale-free it holds to rounding at c = 1e-170 (where products of entries underflow: it used to
    # come out negative) and at 1e160; a loss below float64's normal range (c w ~ 1e-320) is refused
    # by name, not returned wrong
    rng = np.random.default_rng(135)
    S, _ = ir.rotated_covariance(rng, [0.5, 1.0, 2.0])
    unit = ir.single_layer_population_loss(ir.gamma_star(S, 7), S, 7)
    for c in (1e-170, 1e-160, 1e160):
        loss = ir.single_layer_population_loss(ir.gamma_star(c * S, 7), c * S, 7)
        assert loss > 0 and abs(loss / c - unit) <= 1e-12 * unit, c        # rounding of O(10) operations
    with pytest.raises(ValueError, match="underflows below its normal range"):
        ir.single_layer_population_loss(ir.gamma_star(1e-160 * S, 7, 1e-160 * np.eye(3)), 1e-160 * S, 7,
                                        1e-160 * np.eye(3))
    with pytest.raises(TypeError, match="query_noise must be True or False"):
        ir.single_layer_population_loss(np.eye(3), S, 7, query_noise="no")       # "no" is not True


def _exact_single_layer_loss(Gamma, Sigma, n, M, Sigma_q, noise):
    """The loss of MATH.md §8 in exact rationals at the float64 inputs (each converted exactly)."""
    F = lambda A: [[Fraction(float(x)) for x in r] for r in np.atleast_2d(A)]
    mul = lambda A, B: [[sum(A[i][k] * B[k][j] for k in range(len(B))) for j in range(len(B[0]))] for i in range(len(A))]
    tr = lambda A: sum(A[i][i] for i in range(len(A)))
    T = lambda A: [list(r) for r in zip(*A)]
    G, S, M, Q, noise = F(Gamma), F(Sigma), F(M), F(Sigma_q), Fraction(float(noise))
    SMS = mul(mul(S, M), S)
    c = (tr(mul(M, S)) + noise) / n
    K = [[Fraction(n + 1, n) * SMS[i][j] + c * S[i][j] for j in range(len(S))] for i in range(len(S))]
    QGt = mul(Q, T(G))
    return tr(mul(mul(QGt, K), G)) - 2 * tr(mul(mul(QGt, S), M)) + tr(mul(Q, M)) + noise


def test_the_single_layer_losses_are_right_at_large_n():
    # the expanded loss's O(1) terms cancel to O(1/n) at Gamma*, so float64 lost
    # n eps relative (9e-5 at n = 1e12, 11% at 1e15, 0.0 for 2.2e-16 at n = 2^53). Written as a sum of
    # squares (MATH.md §8) each term is right to a few eps: 1e-13 relative bounds O(100) roundings of
    # d = 3 products (abs=0: pytest.approx's default abs 1e-12 would pass anything this small),
    # at every n up to 2^53, against the exact rational at the same float64 inputs
    import icl_estimators as est          # its shifted loss shares icl_ref's _single_layer_loss
    rng = np.random.default_rng(136)
    S, _ = ir.rotated_covariance(rng, [0.5, 1.0, 2.0])
    S_w, _ = ir.rotated_covariance(rng, [0.3, 1.0, 1.5])
    S_q, _ = ir.rotated_covariance(rng, [0.7, 1.0, 1.2])
    G1 = ir.gamma_star(np.eye(1), 2 ** 53)
    assert ir.single_layer_population_loss(G1, np.eye(1), 2 ** 53) == pytest.approx(
        float(_exact_single_layer_loss(G1, np.eye(1), 2 ** 53, np.eye(1), np.eye(1), 0.0)), rel=1e-13, abs=0)
    for n in (10 ** 12, 10 ** 15, 2 ** 53):
        G = ir.gamma_star(S, n, S_w)
        exact = float(_exact_single_layer_loss(G, S, n, S_w, S, 0.0))
        assert ir.single_layer_population_loss(G, S, n, S_w) == pytest.approx(exact, rel=1e-13, abs=0), n
        P, Q = ir.sparse_params(G[None])
        assert ir.full_layer_population_loss(P, Q, S, n, S_w) == pytest.approx(exact, rel=1e-13, abs=0), n
        G = ir.gamma_star(S, n, S_w, noise_var=0.1)
        exact = float(_exact_single_layer_loss(G, S, n, S_w, S_q, 0.1))
        assert est.shifted_single_layer_loss(G, S, n, S_w, 0.1, Sigma_query=S_q) == pytest.approx(exact, rel=1e-13, abs=0), n
        exact = float(_exact_single_layer_loss(G, S, n, S_w, S, 0.1) - Fraction(0.1))
        assert ir.single_layer_population_loss(G, S, n, S_w, 0.1, query_noise=False) == pytest.approx(exact, rel=1e-13, abs=0)


def test_the_single_layer_loss_applies_its_scales_in_any_order_of_magnitude():
    # a loss inside float64's range is returned to rounding however its scales (Sigma, Sigma_w, Gamma)
    # compare: c_q w formed first underflowed (to 0.0 for an exact 1.2e-300) before the large sum of
    # squares was applied; 1e-13 relative bounds O(100) roundings of d <= 2 products, against the exact
    # rational at the same float64 inputs (abs=0: approx's default abs would pass anything this small)
    import icl_estimators as est          # its shifted loss shares icl_ref's _single_layer_loss
    I1, I2 = np.eye(1), np.eye(2)
    cases = [(1e250 * I1, 1e-200 * I1, 10, 1e-200 * I1, 0.0), (1e170 * I1, 1e-160 * I1, 10, 1e-160 * I1, 0.0),
             (1e10 * ir.gamma_star(1e-160 * I2, 20, 1e-160 * I2), 1e-160 * I2, 20, 1e-160 * I2, 0.0),
             (I1, 1e-124 * I1, 9, 1e-274 * I1, 1e-45)]          # the noise term alone is representable
    for G, S, n, S_w, noise in cases:
        exact = float(_exact_single_layer_loss(G, S, n, S_w, S, noise))
        assert ir.single_layer_population_loss(G, S, n, S_w, noise) == pytest.approx(exact, rel=1e-13, abs=0)
        assert est.shifted_single_layer_loss(G, S, n, S_w, noise) == pytest.approx(exact, rel=1e-13, abs=0)
    # an exact loss of about 3e-472 is below float64's range: refused by name, not returned as 0.0
    S = 1e-236 * I2
    with pytest.raises(ValueError, match="underflows below its normal range"):
        ir.single_layer_population_loss(ir.gamma_star(S, 7, S), S, 7, S)


def test_gamma_star_is_right_when_the_noise_dwarfs_the_signal():
    # d = 1: Gamma* = n s / ((n + 1) c s + c s + noise_var) exactly, here 1.43e-221 (representable) while
    # noise_var / (c s) = 8.5e483 is not: it was refused as an overflow. 1e-14: a few roundings
    c, s, v = 2.3e-262, 9.2e-240, 1.8e-17
    exact = 28 * s / (29 * s * c + s * c + v)
    assert ir.gamma_star([[c]], 28, [[s]], noise_var=v)[0, 0] == pytest.approx(exact, rel=1e-14, abs=0)
    rng = np.random.default_rng(137)
    S, _ = ir.rotated_covariance(rng, [0.5, 1.0, 2.0])
    for noise in (0.3, 30.0, 1e200):          # either side of the noise scale 1 at which K' is rescaled
        K = (8 / 7) * S @ S + (np.trace(S) + noise) / 7 * S
        expected = np.linalg.solve(K / noise, S) / noise
        # conditioning ~10: 1e-12 of the largest entry (at noise 1e200 the off-diagonal entries are
        # 1e-16 of the diagonal, at rounding level on both sides)
        assert_allclose(ir.gamma_star(S, 7, noise_var=noise), expected, rtol=1e-12, atol=1e-12 * np.max(np.abs(expected)))


def test_the_family_descents_refuse_n_beyond_what_float64_resolves():
    # at n = 2^53 optimal_family_scalars returned a = (0.83, ...) with loss 1e-32
    # where a = 1 gives 7.5e-46, and family_local_minimum stopped at 4.9e-28: the loss ~n^-L is formed
    # from O(1) terms to ~n eps relative. Now refused by name beyond the bounds where they were measured right
    with pytest.raises(ValueError, match="n must be <= 1e\\+14 for the family descent"):
        ir.optimal_family_scalars(3, 2 ** 53, 2)
    with pytest.raises(ValueError, match="n must be <= 1e\\+09 for the family descent"):
        ir.family_local_minimum(np.full(3, 0.5), 10 ** 10, 2)
    # inside: the optimum at n = 1e14 is below a = 1 (exact loss), with SciPy 1.11 as with 1.17
    assert ir.optimal_family_scalars(3, 10 ** 14, 2, starts=4)[2] < ir.family_population_loss(np.ones(3), 10 ** 14, 2)
    with pytest.raises(ValueError, match="n must be <= 1e\\+14"):
        ir.optimal_family_scalars(3, 10 ** 15, 2)


def test_gamma_star_of_a_pool_of_zero_or_tiny_or_huge_tasks():
    # a pool enters through its second moment: all-zero tasks without noise leave Gamma* undefined
    # (every Gamma has loss 0), said in words; a pool of scale 1e-200 (its moment underflows) gives the
    # unit pool's Gamma* (scale-free without noise); with noise, a pool too small for the noise's
    # ratio to be a float64 is refused naming the scales, not the L-layer growth law
    S = np.diag([1.0, 0.5])
    tasks = np.array([[1.0, 0.5], [-0.3, 2.0], [0.7, -1.0]])
    with pytest.raises(ValueError, match="tasks are all zero and noise_var = 0"):
        ir.gamma_star(S, 5, tasks=np.zeros((3, 2)))
    assert_allclose(ir.gamma_star(S, 5, tasks=1e-200 * tasks), ir.gamma_star(S, 5, tasks=tasks), rtol=1e-12)
    with pytest.raises(ValueError, match="Gamma\\*'s scale .* leaves float64") as e:
        ir.gamma_star(1e-200 * S, 5, tasks=1e-200 * tasks, noise_var=1.0)
    assert "L layers" not in str(e.value)
    with pytest.raises(ValueError, match="must be <= 2\\^53") as e:
        ir.gamma_star(S, 10 ** 400)                                      # not an OverflowError


def test_mahankali_one_gd_step_isotropic_and_preconditioned():
    rng = np.random.default_rng(25)
    n, d, s2 = 12, 4, 0.7
    eta = ir.gd_step_size(n, d, s2)
    assert eta == 1 / (n + 1 + d + s2)
    assert_allclose(ir.gamma_star(np.eye(d), n, noise_var=s2), n * eta * np.eye(d), rtol=EXACT, atol=EXACT)
    Sigma, _ = ir.rotated_covariance(rng, [1.0, 0.25, 0.0625, 3.0])
    G = ir.gamma_star(Sigma, n, np.linalg.inv(Sigma), noise_var=s2)
    # 1e-10: two linear solves with Sigma (condition number 48), each exact to rounding
    assert_allclose(G, n * eta * np.linalg.inv(Sigma), rtol=1e-10, atol=0)
    # and one GD step with per-example step eta predicts eta * sum_i y_i x_i^T Sigma^-1 x_q
    Z, y = ir.sample_prompts(rng, 5, n, Sigma, np.linalg.inv(Sigma), noise_std=math.sqrt(s2))
    X, Yc = Z[:, :d, :n].transpose(0, 2, 1), Z[:, d, :n]
    W = ir.preconditioned_gd(X, Yc, (n * eta * np.linalg.inv(Sigma))[None])
    gd = eta * np.einsum("bi,bid,de,be->b", Yc, X, np.linalg.inv(Sigma), Z[:, :d, n])
    assert_allclose(np.einsum("bd,bd->b", W[:, 1], Z[:, :d, n]), gd, rtol=1e-10)   # same reason


def test_mahankali_training_reproduces_the_step_as_noise_grows():
    rng = np.random.default_rng(26)
    d, n, B = 3, 8, 40_000
    fitted = []
    for s2 in (0.0, 2.0, 8.0):
        Z, y = ir.sample_prompts(rng, B, n, np.eye(d), noise_std=math.sqrt(s2))
        res = ir.train_lbfgs(Z, y, 1, rng=rng, maxiter=500)
        a_hat = ir.fitted_scalar(res["coords"]["A"][0], np.eye(d))
        # a_hat is (1/d) tr of a least-squares fit on features vec(h x_q^T): sandwich standard error
        X, Yc, xq = Z[:, :d, :n], Z[:, d, :n], Z[:, :d, n]
        Phi = (np.einsum("bdi,bi->bd", X, Yc)[:, :, None] * xq[:, None, :]).reshape(B, -1) / n
        resid = y - Phi @ res["coords"]["A"][0].ravel()
        H_inv = np.linalg.inv(Phi.T @ Phi / B)
        cov = H_inv @ ((Phi * resid[:, None] ** 2).T @ Phi / B) @ H_inv / B
        e = np.eye(d).ravel() / d
        se = math.sqrt(e @ cov @ e)
        assert abs(a_hat - n * ir.gd_step_size(n, d, s2)) <= Z_MC * se
        fitted.append(a_hat)
    assert fitted[0] > fitted[1] > fitted[2]


def test_theorem5_relu_point_is_stationary_and_beats_nearby_points():
    rng = np.random.default_rng(93)
    d, n = 3, 10
    c = 2 * n / (n + 2 * d + 3)                                # Theorem 5
    P, Q = ir.sparse_params(c * np.eye(d)[None])
    Z, y = ir.sample_prompts(rng, 60_000, n, np.eye(d))
    grads = np.array([np.r_[g[1].ravel(), g[2].ravel()] for g in
                      (ir.loss_and_grad_activation(P, Q, Zc, yc, "relu")
                       for Zc, yc in zip(np.array_split(Z, 40), np.array_split(y, 40)))])
    mean, se = grads.mean(axis=0), grads.std(axis=0, ddof=1) / math.sqrt(40)
    # 4.5 sigma over 32 entries (P and Q): a false alarm has probability < 32 * 7e-6
    assert np.max(np.abs(mean) / np.where(se > 0, se, np.inf)) < 4.5
    base = (ir.predict_activation(P, Q, Z, "relu") - y) ** 2
    for scale in (0.8, 1.25):                                   # along the theorem's own family
        diff = (ir.predict_activation(P, scale * Q, Z, "relu") - y) ** 2 - base
        assert diff.mean() > Z_MC * diff.std(ddof=1) / math.sqrt(len(diff))
    for _ in range(3):                                          # and off it (Q's last row stays 0)
        V = 0.3 * rng.standard_normal(Q.shape)
        V[..., d, :] = 0
        diff = (ir.predict_activation(P, Q + V, Z, "relu") - y) ** 2 - base
        assert diff.mean() > Z_MC * diff.std(ddof=1) / math.sqrt(len(diff))


def test_theorem5_training_finds_the_relu_coefficient():
    rng = np.random.default_rng(94)
    d, n, B = 3, 10, 5000
    Z, y = ir.sample_prompts(rng, B, n, np.eye(d))
    res = ir.train_lbfgs(Z, y, 1, "sparse", rng=rng, init_scale=0.3, activation="relu", maxiter=500)
    # the relu batch loss is piecewise smooth: its gradient jumps across each prompt's kinks
    # (z_i^T Q z_j = 0) by O(1/B) ~ 2e-4, so L-BFGS-B stops where no step decreases the loss, with
    # |grad| of that order rather than below gtol; not a verdict of convergence
    assert res["status"] == 0 and not res["success"] and res["grad_norm"] < 1e-3, res["message"]
    # the relu loss is piecewise smooth: its gradient jumps by O(1/B) across each of the B n (n+1)
    # kinks, so at the default step h = 1e-5 single kinks dominate the differenced Hessian (it is
    # not even positive); h = 1e-3 averages the curvature over many kinks
    cov = ir.sandwich_covariance("sparse", res["coords"], Z, y, activation="relu", h=1e-3)
    e = np.eye(d).ravel() / d                                   # a = <A, I>/<I, I>
    a_hat, se = ir.fitted_scalar(res["coords"]["A"][0], np.eye(d)), math.sqrt(e @ cov @ e)
    assert abs(a_hat - 2 * n / (n + 2 * d + 3)) <= Z_MC * se


def test_theorem5_exact_relu_loss_matches_monte_carlo():
    # MATH.md §8: L(c) = d - c d + c^2 d (n + 2d + 3) / (4n) at Q = -c [[I, 0], [0, 0]]
    rng = np.random.default_rng(107)
    n, d = 6, 2
    Z, y = ir.sample_prompts(rng, 150_000, n, np.eye(d))
    for c in (0.4, 2 * n / (n + 2 * d + 3), 1.5):
        P, Q = ir.sparse_params(c * np.eye(d)[None])
        err = ir.predict_activation(P, Q, Z, "relu") - y
        mean, se = np.mean(err ** 2), np.std(err ** 2, ddof=1) / math.sqrt(err.size)
        assert abs(mean - (d - c * d + c ** 2 * d * (n + 2 * d + 3) / (4 * n))) <= Z_MC * se


# ---------------------------------------------------------------------------------------------
# §9 Exact Wishart trace moments
# ---------------------------------------------------------------------------------------------

def test_wishart_moments_match_closed_forms_and_reference_values():
    for n, d in [(3, 2), (7, 5), (20, 5)]:
        m = ir.wishart_trace_moments(n, d, 5)
        closed = [d, n * d, n * d * (n + d + 1), n * d * (n**2 + d**2 + 3*n*d + 3*n + 3*d + 4),
                  n * d * (n**3 + d**3 + 6*n**2*d + 6*n*d**2 + 6*n**2 + 6*d**2 + 17*n*d + 21*n + 21*d + 20),
                  n * d * (n**4 + d**4 + 10*n**3*d + 10*n*d**3 + 20*n**2*d**2 + 10*n**3 + 10*d**3
                           + 55*n**2*d + 55*n*d**2 + 65*n**2 + 65*d**2 + 175*n*d + 160*n + 160*d + 148)]
        assert m == [Fraction(c, n ** k) for k, c in enumerate(closed)]
    assert ir.wishart_trace_moments(3, 2, 6) == [2, 2, 4, Fraction(100, 9), Fraction(1040, 27),
                                                  Fraction(12880, 81), Fraction(61600, 81)]


def test_wishart_moments_match_monte_carlo_up_to_k6():
    rng = np.random.default_rng(27)
    n, d, N = 10, 3, 40_000
    G = rng.standard_normal((N, d, n))
    eig = np.linalg.eigvalsh(G @ G.transpose(0, 2, 1) / n)
    m = ir.wishart_trace_moments(n, d, 6)
    for k in range(1, 7):
        samples = np.sum(eig ** k, axis=1)
        assert abs(samples.mean() - float(m[k])) <= Z_MC * samples.std(ddof=1) / math.sqrt(N)


# ---------------------------------------------------------------------------------------------
# §10 The families of Theorems 3 and 4
# ---------------------------------------------------------------------------------------------

def _p_and_r_direct(a, b, t):
    """p(t) = prod (1 - a_l s_l) and r = sum_l a_l phi_l^2 prod_{k>l} (1 - a_k s_k) (MATH.md §10),
    the sum form of r, evaluated at t without polynomials."""
    gam = np.asarray(a) * np.asarray(b)
    s, phi, factors, weights = t, np.ones_like(t), [], []
    for a_l, g_l in zip(a, gam):
        factors.append(1 - a_l * s)
        weights.append(a_l * phi ** 2)
        phi, s = phi * (1 - g_l * s), s * (1 - g_l * s) ** 2
    p = np.prod(factors, axis=0)
    r = sum(w * np.prod(factors[l + 1:], axis=0) for l, w in enumerate(weights))
    return p, r


def test_quadrature_equals_exact_rational_moment_sums():
    nodes, weights = ir.wishart_quadrature(20, 5, 14)
    m = ir.wishart_trace_moments(20, 5, 27)
    assert np.all(weights > 0) and np.all(nodes > 0)
    for k in (0, 1, 5, 13, 20, 27):                        # exact up to degree 2K - 1 = 27
        # 1e-11: the exact recurrence is rounded once to float, then a 14x14 eigenproblem and
        # nodes^27 amplify that rounding by ~27; all terms are positive, so nothing cancels
        assert np.sum(weights * nodes ** k) == pytest.approx(float(m[k]), rel=1e-11)


@pytest.mark.parametrize("blocks", [False, True])
def test_family_polynomials_match_the_layer_recursion_on_scalars(blocks):
    # MATH.md §10 per prompt: with Sigma = I, A_l = a_l I, B_l = b_l I, the transformer's weight
    # vector satisfies v - omega_L = p(S) v - r(S) e exactly. d queries e_k read omega_L off.
    rng = np.random.default_rng(104 + blocks)
    n, d, L = 6, 3, 3
    a = rng.uniform(0.3, 1.2, L)
    b = rng.uniform(0.2, 0.9, L) if blocks else np.zeros(L)
    X = rng.standard_normal((d, n))
    v, eps = rng.standard_normal(d), rng.standard_normal(n)
    Z = np.zeros((d, d + 1, n + 1))
    Z[:, :d, :n], Z[:, d, :n] = X, v @ X + eps
    Z[:, :d, n] = np.eye(d)                                              # query e_k in prompt k
    P, Q = ir.block_params(a[:, None, None] * np.eye(d), b[:, None, None] * np.eye(d))
    omega = ir.predict(P, Q, Z)                                          # y_hat_k = omega^T e_k
    S, e = X @ X.T / n, X @ eps / n
    lam, U = np.linalg.eigh(S)
    pc, rc = ir.family_polynomials(a, b if blocks else None)
    poly = lambda c, t: sum(float(c_k) * t ** k for k, c_k in enumerate(c))
    p_S = (U * poly(pc, lam)) @ U.T
    r_S = (U * poly(rc, lam)) @ U.T
    # EXACT, in the scale of v: the same map computed by the transformer and by an eigen-decomposition
    assert_allclose(v - omega, p_S @ v - r_S @ e, rtol=0, atol=EXACT * (1 + np.abs(v).max()))
    p_dir, r_dir = _p_and_r_direct(a, b, lam)                            # independent of the polynomials
    assert_allclose(poly(pc, lam), p_dir, rtol=EXACT, atol=EXACT)          # rounding only
    assert_allclose(poly(rc, lam), r_dir, rtol=EXACT, atol=EXACT)


def test_family_loss_L1_closed_form_and_optimum():
    n, d = 20, 5
    for a in (0.3, 0.77, 1.4):
        assert ir.family_population_loss([a], n, d) == pytest.approx(
            d - 2 * a * d + a ** 2 * d * (n + d + 1) / n, rel=EXACT)
    a, b, loss = family_optimum(1, n, d)
    assert b is None
    assert a[0] == pytest.approx(n / (n + d + 1), rel=1e-7)       # L-BFGS-B optimum, gtol 1e-12
    assert loss == pytest.approx(d * (d + 1) / (n + d + 1), rel=1e-12)   # error in a enters squared
    # with noise, the loss of the same family equals the single-layer formula of MATH.md §8
    s2 = 0.5
    Sigma = np.diag([1.0, 0.5, 2.0, 1.0, 0.25])
    G = 0.6 * np.linalg.inv(Sigma)
    exact = ir.single_layer_population_loss(G, Sigma, n, np.linalg.inv(Sigma), noise_var=s2)
    assert ir.family_population_loss([0.6], n, d, noise_var=s2) == pytest.approx(exact, rel=1e-12)


def test_family_loss_L2_explicit_polynomial_and_permutation_symmetry():
    n, d = 20, 5
    m = [float(x) for x in ir.wishart_trace_moments(n, d, 4)]
    a0, a1 = 0.45, 1.3
    e1, e2 = a0 + a1, a0 * a1
    explicit = d - 2 * e1 * d + (e1 ** 2 + 2 * e2) * m[2] - 2 * e1 * e2 * m[3] + e2 ** 2 * m[4]
    assert ir.family_population_loss([a0, a1], n, d) == pytest.approx(explicit, rel=1e-12)
    # Lemma 4: the sparse-family loss is symmetric in the a_l, exactly (rational arithmetic)
    p1, _ = ir.family_polynomials([0.2, 0.9, 1.7])
    p2, _ = ir.family_polynomials([1.7, 0.2, 0.9])
    assert p1 == p2
    # ... but not with B: the order of a_l b_l matters
    assert ir.family_population_loss([0.3, 1.1], n, d, b=[0.8, 0.5]) != pytest.approx(
        ir.family_population_loss([1.1, 0.3], n, d, b=[0.5, 0.8]), rel=1e-6)


@pytest.mark.parametrize("L,blocks", [(2, False), (3, False), (2, True), (3, True)])
def test_family_loss_with_noise_against_the_gauss_rule_and_the_sum_form(L, blocks):
    # MATH.md §10: f = E tr p(S)^2 + (s2/n) E tr(S r(S)^2) + s2, with p and r evaluated by the
    # sum form (not family_polynomials) at the Gauss nodes (exact for this degree).
    rng = np.random.default_rng(105 + L + 10 * blocks)
    n, d, s2 = 20, 5, 0.6
    a = rng.uniform(0.2, 1.5, L)
    b = rng.uniform(0.3, 1.0, L) if blocks else np.zeros(L)
    deg = (3 ** L - 1) // 2 if blocks else L
    nodes, weights = ir.wishart_quadrature(n, d, deg + 1)
    p, r = _p_and_r_direct(a, b, nodes)
    expected = weights @ p ** 2 + s2 / n * (weights @ (nodes * r ** 2)) + s2
    got = ir.family_population_loss(a, n, d, b if blocks else None, noise_var=s2)
    # 1e-10: all terms are >= 0 (no cancellation), and the float nodes carry ~1e-15 relative error
    # amplified at most by the degree (<= 26) of the polynomials evaluated there
    assert got == pytest.approx(expected, rel=1e-10)
    assert got - ir.family_population_loss(a, n, d, b if blocks else None, noise_var=0.0) - s2 == \
        pytest.approx(s2 / n * (weights @ (nodes * r ** 2)), rel=1e-9)   # the noise term alone: a


@pytest.mark.parametrize("L,blocks,noise", [(2, False, 0.0), (3, False, 0.4), (2, True, 0.0)])
def test_family_loss_matches_monte_carlo_through_the_transformer(L, blocks, noise):
    rng = np.random.default_rng(30 + L)
    n, d = 8, 3
    Sigma, _ = ir.rotated_covariance(rng, [1.0, 0.3, 2.0])
    Si = np.linalg.inv(Sigma)
    a = rng.uniform(0.2, 1.2, L)
    b = rng.uniform(0.2, 1.0, L) if blocks else None
    A = a[:, None, None] * Si
    P, Q = ir.block_params(A, b[:, None, None] * np.eye(d)) if blocks else ir.sparse_params(A)
    Z, y = ir.sample_prompts(rng, 200_000, n, Sigma, Si, noise_std=math.sqrt(noise))
    mean, se = mc_loss(P, Q, Z, y)
    exact = ir.family_population_loss(a, n, d, b, noise_var=noise)
    assert abs(mean - exact) <= Z_MC * se


@pytest.mark.parametrize("L,blocks", [(1, False), (3, False), (2, True), (3, True)])
def test_family_optimiser_gradient_is_the_derivative_of_the_exact_loss(L, blocks):
    # MATH.md §10: the gradient the family optimiser descends with (reverse mode through the
    # recursion at the Gauss nodes) against central differences of family_population_loss, the
    # exact rational loss (another code path: polynomial coefficients times exact moments)
    rng = np.random.default_rng(140 + L + 10 * blocks)
    n, d, s2 = 20, 5, 0.6
    theta = np.r_[rng.uniform(0.2, 1.5, L), rng.uniform(0.3, 1.0, L - 1) if blocks else []]
    nodes, weights = ir.wishart_quadrature(n, d, ((3 ** L - 1) // 2 if blocks else L) + 1)
    f, grad = ir._family_loss_at_nodes(theta, L, blocks, nodes, weights, n, s2)

    def exact(x):
        return ir.family_population_loss(x[:L], n, d, np.r_[x[L:], np.nan] if blocks else None, noise_var=s2)
    assert f + s2 == pytest.approx(exact(theta), rel=1e-10)   # as the test above: no cancellation
    h = 1e-5
    differences = np.array([(exact(theta + h * e) - exact(theta - h * e)) / (2 * h) for e in np.eye(theta.size)])
    # 1e-6 of the largest entry: truncation ~h^2 |f'''| / 6 ~ 1e-8 relative here and rounding of the
    # once-rounded exact losses ~1e-16 |f| / h ~ 1e-11; a wrong product rule is off by O(1)
    assert_allclose(grad, differences, rtol=0, atol=1e-6 * np.max(np.abs(differences)))


def test_family_optimum_two_layer_reference_values():
    # Theorem 2 (MATH.md §10, the scalar family at L = 2): n = 20, d = 5 gives a = {0.5154, 1.2496}, f = 0.36124
    a, _, loss = family_optimum(2, 20, 5)
    assert_allclose(a, [0.5154, 1.2496], atol=5e-5)       # the reference prints 4 decimals
    assert loss == pytest.approx(0.36124, abs=5e-6)


def test_the_family_optimum_at_large_n_is_found_relative_to_its_loss():
    # the loss falls like n^-L while L-BFGS-B's own tests are absolute below 1: a stopping test
    # relative to the loss finds the optimum at n = 1e9 too (it used to stop at a = (0.93, ...) with
    # loss 1.4e-17, above a = (1, 1, 1)'s 7.4e-24); the optimum tends to a = 1 (S -> I)
    a, _, loss = ir.optimal_family_scalars(3, 10 ** 9, 5, starts=4)
    assert np.max(np.abs(a - 1)) <= 1e-3 and 0 < loss <= ir.family_population_loss([1.0, 1.0, 1.0], 10 ** 9, 5)
    with pytest.raises(ValueError, match="the loss overflows float64"):
        ir.family_population_loss([1e200], 20, 5)                          # not an OverflowError
    with pytest.raises(TypeError, match="blocks must be True or False"):
        ir.optimal_family_scalars(2, 20, 5, blocks="no")                   # "no" is not True


def test_optimal_family_scalars_with_noise():
    # MATH.md §10: L = 1 has the closed form a* = n/(n+d+1+s2) (§8's Mahankali step); at L = 2 the
    # returned point is stationary for the noisy loss and differs from the noiseless optimum
    n, d, s2 = 20, 5, 2.0
    a, _, loss = family_optimum(1, n, d, noise_var=s2)
    assert a[0] == pytest.approx(n / (n + d + 1 + s2), rel=1e-7)          # L-BFGS-B, gtol 1e-12
    assert loss == pytest.approx(d * (d + 1 + s2) / (n + d + 1 + s2) + s2, rel=1e-12)
    a2, _, _ = family_optimum(2, n, d, noise_var=s2)
    a0, _, _ = family_optimum(2, n, d)
    f = lambda x: ir.family_population_loss(x, n, d, noise_var=s2)
    h = 1e-6
    grad = [(f(a2 + h * e) - f(a2 - h * e)) / (2 * h) for e in np.eye(2)]
    assert np.max(np.abs(grad)) < 1e-6                                    # gtol 1e-12 + FD error
    assert np.min(np.abs(a2 - a0)) > 0.01                                 # noise moves the optimum
    # the blocks family with noise: the optimiser's objective (the Gauss rule at the nodes, its own
    # recursion for r) must be stationary for the exact rational loss
    a, b, _ = family_optimum(2, n, d, blocks=True, noise_var=s2)
    g = lambda x: ir.family_population_loss(x[:2], n, d, b=[x[2], np.nan], noise_var=s2)
    x = np.r_[a, b[0]]
    grad = [(g(x + h * e) - g(x - h * e)) / (2 * h) for e in np.eye(3)]
    assert np.max(np.abs(grad)) < 1e-6


def test_sparse_family_degree_stays_L_and_blocks_L4_is_refused():
    p, r = ir.family_polynomials([0.3, 0.5, 0.9, 1.5])
    assert len(p) == 5 and len(r) == 4                       # deg p = L, deg r = L - 1 when b = 0
    p, _ = ir.family_polynomials([0.3, 0.5, 0.9], b=[0.5, 0.7, np.nan])
    assert len(p) == 1 + (3 ** 3 - 1) // 2                    # deg p = (3^L - 1)/2 with B (MATH.md §10)
    with pytest.raises(ValueError, match="2 deg p = 80 > 40"):
        ir.family_population_loss([0.3] * 4, 20, 5, b=[0.5] * 4)


def test_family_local_minimum_leaves_a_saddle_that_a_symmetric_start_reaches():
    # the promise is a local minimum: from a = (0.7, ..., 0.7) the descent stays on the symmetric line
    # (the loss is symmetric in the a_l, Lemma 4) and stopped at a saddle (L = 2: curvature -2.39
    # across the line). The returned point's Hessian, by central second differences of the exact
    # (rational) loss with h = 1e-3, has no eigenvalue below -1e-3: the differences' error is
    # h^2 times fourth derivatives of O(100), ~1e-4, far from the saddle's O(1) negative curvature
    for L in (2, 3):
        a, _, f = ir.family_local_minimum([0.7] * L, 20, 5)
        h, E = 1e-3, np.eye(L) * 1e-3
        g = lambda v: ir.family_population_loss(v, 20, 5)
        hess = np.array([[(g(a + ei + ej) - g(a + ei - ej) - g(a - ei + ej) + g(a - ei - ej)) / (4 * h * h)
                          for ej in E] for ei in E])
        assert np.linalg.eigvalsh(hess)[0] > -1e-3, (L, a)
        assert f == ir.family_population_loss(a, 20, 5) and f < ir.family_population_loss([0.7425] * L, 20, 5), L


def test_blocks_family_has_a_second_local_minimum():
    # MATH.md §10: at n = 20, d = 5, L = 3 the exact blocks-family loss has, besides the global
    # optimum f* = 9.613e-4, a strict local minimum near a = (0.34, 2.86, 7.64), b = (0.88, 0.35),
    # the basin of 2 of 20 L-BFGS runs in tools/blocks_basins.py (docs/FINDINGS.md finding 9)
    n, d = 20, 5
    a_g, b_g, f_g = family_optimum(3, n, d, blocks=True)
    a, b, f = ir.family_local_minimum([0.39, 3.28, 8.53], n, d, b=[0.89, 0.35, np.nan])
    assert f > f_g * 1.03 and np.abs(b[1] - b_g[1]) > 0.1                # a different point, 5% worse
    x = np.r_[a, b[:2]]

    def g(v):
        return ir.family_population_loss(v[:3], n, d, b=[v[3], v[4], np.nan])
    h = 1e-4
    E = np.eye(5) * h
    grad = np.array([(g(x + e) - g(x - e)) / (2 * h) for e in E])
    hess = np.array([[(g(x + ei + ej) - g(x + ei - ej) - g(x - ei + ej) + g(x - ei - ej)) / (4 * h * h)
                      for ej in E] for ei in E])
    # stationary: |grad| within the optimiser's gtol (1e-12 on the Gauss rule) plus the
    # difference's truncation h^2 f^(3) ~ 1e-8; strict: the Hessian's smallest eigenvalue far above its
    # finite-difference error (~1e-6)
    assert np.max(np.abs(grad)) < 1e-6
    assert np.min(np.linalg.eigvalsh((hess + hess.T) / 2)) > 1e-5


def chunked_gradient(structure, coords, Z, y, chunks=50):
    """Mean and standard error of the structure gradient over independent chunks of prompts."""
    grads = []
    for Zc, yc in zip(np.array_split(Z, chunks), np.array_split(y, chunks)):
        _, dP, dQ = ir.loss_and_grad(*ir.structure_to_PQ(structure, coords), Zc, yc)
        grads.append(ir.pack(ir.structure_grad(structure, dP, dQ).values()))
    grads = np.array(grads)
    return grads.mean(axis=0), grads.std(axis=0, ddof=1) / math.sqrt(chunks)


@pytest.mark.parametrize("blocks", [False, True])
def test_theorems_3_and_4_full_gradient_vanishes_at_family_optimum(blocks):
    # n = 40: at n = 10, d = 3 the blocks-family gradient is so heavy-tailed (degree 8 in S) that
    # chunk standard errors understate the error several-fold (MATH.md §10); the loss gate below
    # would catch such a sample.
    rng = np.random.default_rng(40 + blocks)
    n, d, L = 40, 3, 2
    Sigma, _ = ir.rotated_covariance(rng, [1.0, 0.25, 2.0])
    Si = np.linalg.inv(Sigma)
    a, b, loss = family_optimum(L, n, d, blocks=blocks)
    coords = {"A": a[:, None, None] * Si}
    if blocks:
        coords["B"] = np.nan_to_num(b, nan=1.0)[:, None, None] * np.eye(d)
    structure = "blocks" if blocks else "sparse"
    Z, y = ir.sample_prompts(rng, 100_000, n, Sigma, Si)
    mean, se = mc_loss(*ir.structure_to_PQ(structure, coords), Z, y)
    assert abs(mean - loss) <= Z_MC * se                     # the sample's errors are trustworthy
    mean, se = chunked_gradient(structure, coords, Z, y)
    z = np.abs(mean) / np.where(se > 0, se, np.inf)          # B_{L-1} gets an exactly zero gradient
    # 4.5 sigma over <= 36 entries: a false alarm has probability < 36 * 7e-6
    assert np.max(z) < 4.5
    E = rng.standard_normal((d, d))
    off = {**coords, "A": coords["A"] + 0.3 * (E + E.T)[None]}
    mean, se = chunked_gradient(structure, off, Z, y)
    assert np.max(np.abs(mean) / np.where(se > 0, se, np.inf)) > 10     # far past the null's 4.5


def test_theorem2_two_layer_isotropic_training_beats_or_matches_best_scalar_family():
    # Theorem 2 proves a diagonal global minimiser exists, not a scalar one: training must reach at
    # least the best scalar-family loss on the same batch (the family lies inside the model).
    rng = np.random.default_rng(60)
    d, n, B = 3, 10, 20_000
    Z, y = ir.sample_prompts(rng, B, n, np.eye(d))
    a, _, _ = family_optimum(2, n, d)
    family_batch_loss = ir.in_context_loss(*ir.sparse_params(a[:, None, None] * np.eye(d)), Z, y)
    for seed in range(3):
        # gtol 1e-6: the loss is ~0.35, so a step that lowers it by less than eps * 0.35 ~ 1e-16 is
        # invisible to the line search, which then stops near |g| ~ sqrt(eps * loss * curvature) ~ 1e-8
        res = ir.train_lbfgs(Z, y, 2, rng=np.random.default_rng(seed), init_scale=0.5, maxiter=2000, gtol=1e-6)
        assert res["success"], res["message"]
        # at the batch optimum the loss can only be lower; 1e-9 relative is rounding's slack
        assert res["loss"] <= family_batch_loss * (1 + 1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_paper_experiment_three_layer_sparse_reaches_family_optimum(seed):
    rng = np.random.default_rng(seed)
    d, n, B, L = 5, 20, 20_000, 3
    Sigma, _ = ir.rotated_covariance(rng)                      # U diag(1, 1, 1/4, 1/16, 1) U^T
    Si = np.linalg.inv(Sigma)
    Z, y = ir.sample_prompts(rng, B, n, Sigma, Si)
    res = ir.train_lbfgs(Z, y, L, structure="sparse", rng=rng, init_scale=0.1, maxiter=3000)
    assert res["success"], res["message"]
    A = res["coords"]["A"]
    cov = ir.sandwich_covariance("sparse", res["coords"], Z, y)
    a_star, _, _ = family_optimum(L, n, d)
    a_hat, se = np.empty(L), np.empty(L)
    for l in range(L):
        e = np.zeros((L, d, d))
        e[l] = Si / np.sum(Si * Si)                            # a_l = <A_l, Si> / <Si, Si>
        a_hat[l] = ir.fitted_scalar(A[l], Si)
        se[l] = math.sqrt(e.ravel() @ cov @ e.ravel())
        block = cov[l * d * d:(l + 1) * d * d, l * d * d:(l + 1) * d * d]
        # ||A_l - a_l Si||^2 <= ||A_l - a*_l Si||^2, a weighted chi-square: mean tr C, var 2 tr C^2
        bound = math.sqrt(np.trace(block) + 5 * math.sqrt(2 * np.sum(block * block)))
        assert ir.distance_to_multiple(A[l], Si) <= bound / np.linalg.norm(A[l])
    order = np.argsort(a_hat)                                  # Lemma 4: compare as a multiset
    assert np.all(np.abs(a_hat[order] - a_star) <= Z_MC * se[order]), (a_hat[order], a_star, se[order])


# ---------------------------------------------------------------------------------------------
# §11 Metrics and the sandwich covariance
# ---------------------------------------------------------------------------------------------

def test_distance_to_multiple_against_brute_force():
    rng = np.random.default_rng(50)
    M, T = rng.standard_normal((2, 4, 4))
    assert ir.distance_to_multiple(3.7 * T, T) < EXACT
    assert ir.distance_to_multiple(2.0 * np.eye(4)) < EXACT
    # an independent numerical minimisation over alpha (Brent, xtol 1e-10) agrees to rounding
    brute = scipy.optimize.minimize_scalar(lambda al: np.linalg.norm(M - al * T), bracket=(-3, 3),
                                           tol=1e-10).fun
    assert ir.distance_to_multiple(M, T) * np.linalg.norm(M) == pytest.approx(brute, rel=1e-10)
    # the authors' distance to identity, ||M - (tr M / d) I|| / ||M||
    assert ir.distance_to_multiple(M) == pytest.approx(
        np.linalg.norm(M - np.trace(M) / 4 * np.eye(4)) / np.linalg.norm(M), rel=EXACT)
    assert ir.distance_to_diagonal(np.diag([1.0, 2.0])) == 0.0


def test_distance_to_diagonal_and_a_haar_rotation():
    M = np.array([[1.0, 2.0], [0.0, 1.0]])
    assert ir.distance_to_diagonal(M) == pytest.approx(2 / math.sqrt(6), rel=EXACT)
    assert ir.distance_to_diagonal(np.diag([3.0, -1.0])) == 0.0
    # Haar: U[0, 0] is symmetric about 0 (LAPACK's QR alone makes it one-signed); its sign over
    # 400 draws is Binomial(400, 1/2): within Z_MC standard errors (10) of 200
    rng = np.random.default_rng(144)
    positive = sum(ir.rotated_covariance(rng, [1.0, 2.0, 3.0])[1][0, 0] > 0 for _ in range(400))
    assert abs(positive - 200) <= Z_MC * 10


def test_symmetry_directions_leave_the_loss_unchanged_and_nothing_else_does():
    # every direction returned leaves the loss exactly unchanged along a finite move (rescaling
    # and head mixing are exact symmetries, held-fixed coordinates never enter); at a minimum of
    # one full layer the Hessian in the remaining coordinates is positive definite (MATH.md §11)
    rng = np.random.default_rng(138)
    Z, y = ir.sample_prompts(rng, 500, 6, np.diag([1.0, 0.5]))
    P, Q = 0.5 * rng.standard_normal((2, 2, 2, 3, 3))
    coords = {"P": P, "Q": Q}
    dirs = ir.symmetry_directions("full", coords)
    # fixed: 2 heads x 2 x-rows x 3 of the last P; head mixing: 2 layers x 4 pairs
    assert dirs.shape == (36 * 2, 12 + 8) and np.allclose(dirs.T @ dirs, np.eye(20), atol=1e-12)
    # first order: the gradient has no component along any returned direction (1e-12 of its norm:
    # rounding in the reverse pass; a direction that is not a symmetry has an O(1) component)
    f0, dP, dQ = ir.loss_and_grad(P, Q, Z, y)
    g = ir.pack([dP, dQ])
    assert np.max(np.abs(g @ dirs)) <= 1e-12 * np.linalg.norm(g)
    for l, h, g in [(0, 0, 0), (1, 0, 1), (0, 1, 0)]:              # a finite group element, not a tangent
        A = np.eye(2)
        A[h, g] += 0.3
        P2, Q2 = P.copy(), Q.copy()
        P2[l] = np.einsum("hg,gij->hij", A, P[l])
        Q2[l] = np.einsum("hg,gij->hij", np.linalg.inv(A).T, Q[l])
        assert ir.in_context_loss(P2, Q2, Z, y) == pytest.approx(f0, rel=EXACT)
    assert ir.symmetry_directions("sparse", {"A": np.eye(2)[None]}).shape == (4, 0)
    assert ir.symmetry_directions("blocks", {"A": np.ones((2, 2, 2)), "B": np.ones((2, 2, 2))}).shape == (16, 4)
    # one layer: the x-rows of P (6), Q's last column (3, it multiplies the query's zero label slot)
    # and the rescaling (1, outside the span of those 9)
    assert ir.symmetry_directions("full", {"P": P[:1, :1], "Q": Q[:1, :1]}).shape == (18, 10)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs thread affinity and two cores")
def test_sandwich_covariance_matches_the_spread_over_batches():
    # MATH.md §11: one layer, sparse, fitted on R independent batches. The trace of the empirical
    # covariance of A_hat has relative standard error <= sqrt(2 / (R - 1)) (a sample variance of R
    # replicates); the sandwich's trace is averaged over R_s of the batches, its standard error
    # computed from their spread. The two must agree within Z_MC combined standard errors.
    rng = np.random.default_rng(116)
    d, n, B, R, R_s = 2, 6, 3000, 150, 10
    Sigma = np.diag([1.0, 0.4])
    fits, traces = [], []
    for k in range(R):
        Z, y = ir.sample_prompts(rng, B, n, Sigma, noise_std=0.5)
        res = ir.train_gauss_newton(Z, y, 1, init={"A": np.zeros((1, d, d))})
        assert res["success"]
        fits.append(res["coords"]["A"].ravel())
        if k < R_s:
            traces.append(np.trace(ir.sandwich_covariance("sparse", res["coords"], Z, y)))
    empirical = np.trace(np.cov(np.array(fits), rowvar=False))
    predicted, se_predicted = np.mean(traces), np.std(traces, ddof=1) / math.sqrt(R_s)
    se = math.hypot(empirical * math.sqrt(2 / (R - 1)), se_predicted)
    assert abs(empirical - predicted) <= Z_MC * se


def test_sandwich_covariance_of_a_single_parameter():
    # sparse, L = 1, d = 1: one coordinate, a (1, 1) covariance
    rng = np.random.default_rng(135)
    Z, y = ir.sample_prompts(rng, 2000, 5, np.eye(1), noise_std=0.3)
    res = ir.train_gauss_newton(Z, y, 1, init={"A": np.zeros((1, 1, 1))})
    cov = ir.sandwich_covariance("sparse", res["coords"], Z, y)
    assert cov.shape == (1, 1) and cov[0, 0] > 0


@pytest.mark.parametrize("R, R_s", [(3, 3), pytest.param(100, 8, marks=pytest.mark.slow)])
def test_sandwich_for_full_P_Q_removes_the_symmetries_and_matches_the_spread_over_batches(R, R_s):
    # MATH.md §11: one full layer (d = 2, one head) fitted on R independent batches from the same start
    # near Theorem 1's optimum. The fitted (P, Q) wander along the exact symmetries (P -> cP, Q -> Q/c;
    # coordinates that never reach the loss), so compare what they identify, the predictor's
    # coefficients W = sym_jk(p_j Q[k, :d]) (p the last row of P; ŷ depends on P, Q only through W),
    # whose covariance the sandwich gives by the delta method, W's Jacobian being exact (W is bilinear).
    # Traces within Z_MC combined standard errors, as in the sparse test above (R = 100 batches, the
    # slow run: 50 s of CPU); by default 3 batches check the symmetries and the semi-definiteness.
    rng = np.random.default_rng(136)
    d, n, B = 2, 6, 3000
    Sigma = np.diag([1.0, 0.4])
    G = ir.gamma_star(Sigma, n, noise_var=0.25)
    P0, Q0 = ir.sparse_params(G[None])
    start = {"P": P0 + 0.01 * rng.standard_normal(P0.shape), "Q": Q0 + 0.01 * rng.standard_normal(Q0.shape)}

    def W_of(theta):
        P, Q = theta[:9].reshape(3, 3), theta[9:].reshape(3, 3)
        M = np.outer(P[-1], Q[:, :d].ravel()).reshape(3, 3, d)       # p_j Q[k, m]
        return ((M + M.transpose(1, 0, 2)) / 2).ravel()

    def jac_W(theta):                                                # exact: W is bilinear, so central
        return np.array([(W_of(theta + e) - W_of(theta - e)) / 2 for e in np.eye(theta.size)]).T  # differences at step 1 are exact
    fits, traces = [], []
    for k in range(R):
        Z, y = ir.sample_prompts(rng, B, n, Sigma, noise_std=0.5)
        res = ir.train_gauss_newton(Z, y, 1, structure="full", init=start)
        # a stationary point to far below the sampling spread (1/sqrt(B) ~ 2e-2) the fits are compared
        # with: trf's float64 floor on this rank-deficient problem is ~1e-7 in the data's own units
        assert res["grad_norm"] < 1e-6, res["message"]
        theta = ir.pack([res["coords"]["P"], res["coords"]["Q"]])
        fits.append(W_of(theta))
        if k < R_s:
            cov = ir.sandwich_covariance("full", res["coords"], Z, y)
            assert np.array_equal(cov, cov.T) and np.min(np.linalg.eigvalsh(cov)) > -1e-12 * np.max(np.abs(cov))
            for u in ir.symmetry_directions("full", res["coords"]).T:
                assert abs(u @ cov @ u) <= 1e-12 * np.max(np.abs(cov))   # nothing along a symmetry
            Jw = jac_W(theta)
            traces.append(np.trace(Jw @ cov @ Jw.T))
    if R < 10:
        return
    empirical = np.trace(np.cov(np.array(fits), rowvar=False))
    predicted, se_predicted = np.mean(traces), np.std(traces, ddof=1) / math.sqrt(R_s)
    se = math.hypot(empirical * math.sqrt(2 / (R - 1)), se_predicted)
    assert abs(empirical - predicted) <= Z_MC * se, (empirical, predicted, se)


def test_sandwich_accepts_a_small_linear_batch_and_refuses_a_point_that_is_not_a_minimum():
    # the linear layer's V is exact (per-prompt gradients, no chunks): B = 300 is fine; a random
    # point is no minimum, which the sandwich refuses instead of returning a meaningless matrix
    rng = np.random.default_rng(137)
    Z, y = ir.sample_prompts(rng, 300, 5, np.eye(2), noise_std=0.3)
    res = ir.train_gauss_newton(Z, y, 1, init={"A": np.zeros((1, 2, 2))})
    cov = ir.sandwich_covariance("sparse", res["coords"], Z, y)
    assert cov.shape == (4, 4) and np.min(np.linalg.eigvalsh(cov)) > 0
    with pytest.raises(ValueError, match="not at a strict local minimum"):
        ir.sandwich_covariance("full", {"P": 0.3 * rng.standard_normal((1, 1, 3, 3)),
                                        "Q": 0.3 * rng.standard_normal((1, 1, 3, 3))}, Z, y)
    with pytest.raises(ValueError, match="2 \\* chunks"):
        ir.sandwich_covariance("sparse", res["coords"], Z, y, activation="relu")
    with pytest.raises(ValueError, match="overflow"):
        ir.sandwich_covariance("sparse", {"A": 1e200 * np.ones((1, 2, 2))}, Z, y)     # r^2 ~ 1e400


def test_sandwich_chunk_mean_estimate_with_an_activation_matches_the_exact_one():
    # one full layer fitted with linear attention on positive data; its scores z_i^T Q z_j over the
    # context keys all have one sign, so at (P, Q) or (-P, -Q) (the same linear layer: P S Q is
    # bilinear) they are all positive and relu is the identity near the point. The relu sandwich (V from 200 chunk
    # means) then estimates the linear one (V exact). A sample covariance of 200 chunk means has
    # relative standard error sqrt(2 / 199) ~ 0.1 per variance; 0.5 is 5 of them
    rng = np.random.default_rng(143)
    B, n, d = 4000, 5, 2
    X = np.abs(rng.standard_normal((B, d, n + 1))) + 1.0
    w = np.abs(rng.standard_normal((B, d)))
    Z = np.concatenate([X, np.einsum("bd,bdi->bi", w, X)[:, None, :]], axis=1)
    y = Z[:, d, n].copy()
    Z[:, d, n] = 0.0
    P0, Q0 = ir.sparse_params(ir.gamma_star(np.eye(d), n)[None])
    res = ir.train_gauss_newton(Z, y, 1, structure="full", init={"P": P0, "Q": Q0})
    scores = np.einsum("bki,kl,blj->bij", Z[:, :, :n], res["Q"][0, 0], Z)
    sign = 1.0 if np.all(scores > 0) else -1.0
    coords = {"P": sign * res["P"], "Q": sign * res["Q"]}
    assert np.all(sign * scores > 0)                                 # relu never clips
    exact = np.trace(ir.sandwich_covariance("full", coords, Z, y))
    chunked = np.trace(ir.sandwich_covariance("full", coords, Z, y, activation="relu"))
    assert abs(chunked / exact - 1) < 0.5, (chunked, exact)


def test_the_statistics_use_the_engine_given_and_a_symmetric_hessian():
    # identifiable_hessian and sandwich_covariance evaluate through engine= (the gradient and the
    # per-prompt Jacobian both); the Hessian is exactly symmetric
    rng, Z, y = small_problem(seed=194, B=300, n=8)
    coords = ir.train_gauss_newton(Z, y, 1, rng=rng)["coords"]
    seen = []

    def spy(name):
        def method(*args):
            seen.append(name)
            return getattr(ir.REFERENCE, name)(*args)
        return method
    engine = reference_engine(loss_and_grad_gram=spy("loss_and_grad_gram"), jacobian_gram=spy("jacobian_gram"))
    curvature = ir.identifiable_hessian("sparse", coords, Z, y, engine=engine)
    assert np.array_equal(curvature["hessian"], curvature["hessian"].T) and "loss_and_grad_gram" in seen
    seen.clear()
    ir.sandwich_covariance("sparse", coords, Z, y, engine=engine)
    assert {"loss_and_grad_gram", "jacobian_gram"} <= set(seen)


def test_sandwich_refuses_a_flat_direction():
    # a covariate that is always 0: the entries of A that multiply it never reach the loss, so the
    # Hessian has exactly zero eigenvalues there and the sandwich (H^-1) is not defined
    rng, Z, y = small_problem(seed=195, B=300, n=8)
    Z = Z.copy()
    Z[:, 1, :] = 0.0
    coords = ir.train_gauss_newton(Z, y, 1, rng=rng)["coords"]
    with pytest.raises(ValueError, match="not at a strict local minimum"):
        ir.sandwich_covariance("sparse", coords, Z, y)


def test_the_hessian_reads_the_query_label_slot_and_the_sandwich_passes_h_and_checks_its_limits(monkeypatch):
    # one full layer: Q's last column is a symmetry direction only while every query's label slot is
    # 0 (3 x 4 P rows + the rescaling + 4 Q entries, else without those 4)
    rng, Z, y = small_problem(seed=200, B=40, n=6)
    coords = {k: 0.3 * rng.standard_normal(s) for k, s in ir.structure_shapes("full", 1, 3, 1).items()}
    assert ir.identifiable_hessian("full", coords, Z, y)["symmetries"] == 3 * 4 + 1 + 4
    Z1 = Z.copy()
    Z1[0, -1, -1] = 0.5
    assert ir.identifiable_hessian("full", coords, Z1, y)["symmetries"] == 3 * 4 + 1
    # h= reaches the Hessian inside the sandwich
    seen, real = [], ir.identifiable_hessian
    monkeypatch.setattr(ir, "identifiable_hessian", lambda *a, **k: seen.append(k.get("h")) or real(*a, **k))
    opt = ir.train_gauss_newton(Z, y, 1, rng=rng)["coords"]
    ir.sandwich_covariance("sparse", opt, Z, y, h=1e-4)
    assert seen == [1e-4]
    # chunks >= 2, and with an activation at least 2 * chunks prompts: at the limit and one past it
    with pytest.raises(ValueError, match="chunks must be >= 2"):
        ir.sandwich_covariance("sparse", opt, Z, y, chunks=1)
    with pytest.raises(ValueError, match="at least 2 \\* chunks = 4 prompts"):
        ir.sandwich_covariance("sparse", opt, Z[:3], y[:3], chunks=2, activation="relu")
    try:
        ir.sandwich_covariance("sparse", opt, Z[:4], y[:4], chunks=2, activation="relu")
    except ValueError as e:                  # 4 prompts pass that check (the point is no minimum of theirs)
        assert "prompts" not in str(e)


def test_sandwich_refuses_a_nearly_flat_direction_with_a_positive_eigenvalue():
    # one covariate 1000 times smaller: the entry of A that it meets twice has a curvature ~1e-13 of
    # the largest, positive but below the refusal threshold 1e-10; one layer's loss is quadratic in A,
    # so central differences of its gradient are exact at h = 1 (rounding only, ~1e-16 relative, far
    # below the eigenvalue), and the sandwich must still refuse
    rng, Z, y = small_problem(seed=195, B=300, n=8)
    Z = Z.copy()
    Z[:, 1, :] *= 1e-3
    coords = ir.train_gauss_newton(Z, y, 1, rng=rng)["coords"]
    eig = ir.identifiable_hessian("sparse", coords, Z, y, h=1.0)["eigenvalues"]
    assert 0 < eig[0] < 1e-10 * eig[-1]
    with pytest.raises(ValueError, match="not at a strict local minimum"):
        ir.sandwich_covariance("sparse", coords, Z, y, h=1.0)


# ---------------------------------------------------------------------------------------------
# The library's manners (no MATH.md section): input checks, floating-point rules, no process state
# ---------------------------------------------------------------------------------------------

def test_outputs_are_float64_from_integer_inputs():
    Z = np.array([[[1, -1, 3], [2, 1, 0]]])
    P = np.array([[[[1, 2], [0, 1]]]])
    Q = np.array([[[[1, 0], [1, 1]]]])
    loss, dP, dQ = ir.loss_and_grad(P, Q, Z, np.array([4]))
    assert ir.forward(P, Q, Z).dtype == np.float64
    assert ir.predict(P, Q, Z).dtype == np.float64
    assert dP.dtype == dQ.dtype == np.float64 and isinstance(loss, float)


def test_integer_inputs_are_accepted_not_broadcast():
    Z = np.ones((2, 3, 4), dtype=int)
    P, Q = np.ones((2, 1, 1, 3, 3), dtype=int)
    assert ir.predict(P, Q, Z).shape == (2,)
    with pytest.raises(ValueError, match="y"):
        ir.in_context_loss(P, Q, Z, np.ones(1))           # would broadcast silently otherwise


def test_random_valid_configurations_forward_and_gradient():
    rng = np.random.default_rng(80)
    for _ in range(40):
        d, n, L, B = rng.integers(1, 6), rng.integers(1, 10), rng.integers(1, 5), rng.choice([1, 2, 7, 33])
        structure = rng.choice(ir.STRUCTURES)
        H = rng.integers(1, 4) if structure == "full" else 1
        Sigma, _ = ir.rotated_covariance(rng, rng.uniform(0.3, 2.0, d))
        Z, y = ir.sample_prompts(rng, B, n, Sigma, noise_std=rng.uniform(0, 1))
        coords = {k: 0.4 * rng.standard_normal(s) for k, s in ir.structure_shapes(structure, L, d, H).items()}
        P, Q = ir.structure_to_PQ(structure, coords)
        fast, literal = ir.forward(P, Q, Z), ir.forward_literal(P, Q, Z)
        assert_allclose(fast, literal, rtol=0, atol=EXACT * np.max(np.abs(literal)))
        grads = ir.structure_grad(structure, *ir.loss_and_grad(P, Q, Z, y)[1:])
        v = {k: rng.standard_normal(np.shape(c)) for k, c in coords.items()}
        f = lambda t: ir.in_context_loss(*ir.structure_to_PQ(structure, {k: coords[k] + t * v[k] for k in coords}), Z, y)
        numeric = (f(FD_H2) - f(-FD_H2)) / (2 * FD_H2)
        analytic = sum(np.sum(grads[k] * v[k]) for k in coords)
        scale = math.sqrt(sum(np.sum(g ** 2) for g in grads.values()) * sum(np.sum(w ** 2) for w in v.values()))
        assert abs(numeric - analytic) <= FD_REL * scale, (d, n, L, H, B, structure)


def test_input_checks_at_their_boundaries():
    assert len(ir.wishart_trace_moments(3, 2, ir.MAX_MOMENT_ORDER)) == ir.MAX_MOMENT_ORDER + 1
    with pytest.raises(ValueError, match="kmax must be <= 40"):
        ir.wishart_trace_moments(3, 2, ir.MAX_MOMENT_ORDER + 1)
    for call in (lambda: ir.mask(True), lambda: ir.sample_prompts(np.random.default_rng(0), True, 3, np.eye(2)),
                 lambda: ir.structure_shapes("sparse", True, 2)):
        with pytest.raises(TypeError, match="integer"):
            call()
    # symmetry is judged relative to Sigma's scale: 1e-12 of its largest entry
    for scale in (1e-20, 1.0, 1e20):
        ir.sample_prompts(np.random.default_rng(0), 2, 3, scale * (np.eye(2) + [[0, 1e-13], [0, 0]]))
        with pytest.raises(ValueError, match="symmetric"):
            ir.sample_prompts(np.random.default_rng(0), 2, 3, scale * (np.eye(2) + [[0, 1e-11], [0, 0]]))


def test_bad_input_is_refused_with_a_message_naming_the_argument(bad_call):
    name, call, error, argument = bad_call                  # one case of BAD_CALLS, below
    with pytest.raises(error, match=argument):
        call()


_P, _Q = np.zeros((2, 2, 1, 4, 4))
_Z = np.ones((3, 4, 6))
_y = np.zeros(3)
_S = np.eye(3)
_nanZ = _Z.copy()
_nanZ[0, 0, 0] = np.nan
_rng = np.random.default_rng(0)
_Zs, _ys = ir.sample_prompts(np.random.default_rng(1), 8, 5, np.eye(3))     # d = 3, B = 8, n = 5
_S0, _q0 = ir.gram(_Zs), np.ascontiguousarray(_Zs[:, :, 5])
BAD_CALLS = [
    ("P 3-d", lambda: ir.forward(_P[0], _Q, _Z), ValueError, "P"),
    ("Q other shape", lambda: ir.forward(_P, _Q[:, :, :3, :3], _Z), ValueError, "Q"),
    ("P, Q differ in L", lambda: ir.forward(_P, _Q[:1], _Z), ValueError, "P and Q"),
    ("P not square", lambda: ir.forward(_P[:, :, :3], _Q[:, :, :3], _Z), ValueError, "P"),
    ("L = 0", lambda: ir.forward(_P[:0], _Q[:0], _Z), ValueError, "P"),
    ("H = 0", lambda: ir.forward(_P[:, :0], _Q[:, :0], _Z), ValueError, "P"),
    ("Z d mismatch", lambda: ir.forward(_P, _Q, _Z[:, :3]), ValueError, "Z"),
    ("Z 2-d", lambda: ir.forward(_P, _Q, _Z[0]), ValueError, "Z"),
    ("n = 0", lambda: ir.forward(_P, _Q, _Z[:, :, :1]), ValueError, "Z"),
    ("B = 0", lambda: ir.forward(_P, _Q, _Z[:0]), ValueError, "Z"),
    ("Z NaN", lambda: ir.predict(_P, _Q, _nanZ), ValueError, "Z"),
    ("P Inf", lambda: ir.forward(_P + np.inf, _Q, _Z), ValueError, "P"),
    ("Z complex", lambda: ir.forward(_P, _Q, _Z + 0j), TypeError, "Z"),
    ("Z strings", lambda: ir.forward(_P, _Q, np.full((3, 4, 6), "a")), TypeError, "Z"),
    ("Z bool", lambda: ir.forward(_P, _Q, _Z > 0), TypeError, "Z"),
    ("y wrong length", lambda: ir.loss_and_grad(_P, _Q, _Z, np.zeros(4)), ValueError, "y"),
    ("y 2-d", lambda: ir.in_context_loss(_P, _Q, _Z, np.zeros((3, 1))), ValueError, "y"),
    ("y scalar", lambda: ir.in_context_loss(_P, _Q, _Z, 0.0), ValueError, "y"),
    ("Sigma not symmetric", lambda: ir.sample_prompts(_rng, 2, 3, np.triu(np.ones((3, 3)))), ValueError, "Sigma"),
    ("Sigma not PD", lambda: ir.sample_prompts(_rng, 2, 3, -np.eye(3)), ValueError, "Sigma"),
    ("Sigma not square", lambda: ir.sample_prompts(_rng, 2, 3, np.ones((2, 3))), ValueError, "Sigma"),
    ("Sigma_w wrong d", lambda: ir.sample_prompts(_rng, 2, 3, _S, np.eye(2)), ValueError, "Sigma_w"),
    ("batch = 0", lambda: ir.sample_prompts(_rng, 0, 3, _S), ValueError, "batch"),
    ("n = 0 sampling", lambda: ir.sample_prompts(_rng, 2, 0, _S), ValueError, "n"),
    ("batch float", lambda: ir.sample_prompts(_rng, 2.0, 3, _S), TypeError, "batch"),
    ("noise < 0", lambda: ir.sample_prompts(_rng, 2, 3, _S, noise_std=-1), ValueError, "noise_std"),
    ("rng legacy", lambda: ir.sample_prompts(np.random.RandomState(0), 2, 3, _S), TypeError, "rng"),
    ("structure", lambda: ir.train_lbfgs(_Z, _y, 1, structure="dense", rng=_rng), ValueError, "structure"),
    ("layers = 0", lambda: ir.train_lbfgs(_Z, _y, 0, rng=_rng), ValueError, "layers"),
    ("heads = 0", lambda: ir.train_lbfgs(_Z, _y, 1, structure="full", heads=0, rng=_rng), ValueError, "heads"),
    ("heads sparse", lambda: ir.train_lbfgs(_Z, _y, 1, heads=2, rng=_rng), ValueError, "heads"),
    ("init keys", lambda: ir.train_lbfgs(_Z, _y, 1, init={"P": 0}), ValueError, "init"),
    ("init shape", lambda: ir.train_lbfgs(_Z, _y, 1, init={"A": np.zeros((1, 2, 2))}), ValueError, "init"),
    ("rng missing", lambda: ir.train_lbfgs(_Z, _y, 1), TypeError, "rng"),
    ("train y", lambda: ir.train_lbfgs(_Z, _y[:2], 1, rng=_rng), ValueError, "y"),
    ("A 2-d", lambda: ir.sparse_params(np.eye(3)), ValueError, "A"),
    ("A, Bm differ", lambda: ir.block_params(np.zeros((2, 3, 3)), np.zeros((1, 3, 3))), ValueError, "A and Bm"),
    ("gamma n", lambda: ir.gamma_star(_S, 0), ValueError, "n"),
    ("gamma Sigma_w", lambda: ir.gamma_star(_S, 3, np.eye(4)), ValueError, "Sigma_w"),
    ("Gamma shape", lambda: ir.single_layer_population_loss(np.eye(2), _S, 3), ValueError, "Gamma"),
    ("noise_var < 0", lambda: ir.gamma_star(_S, 3, noise_var=-0.1), ValueError, "noise_var"),
    ("pgd A vs X", lambda: ir.preconditioned_gd(np.zeros((4, 3)), np.zeros(4), np.zeros((1, 2, 2))), ValueError, "A"),
    ("pgd y", lambda: ir.preconditioned_gd(np.zeros((4, 3)), np.zeros(5), np.zeros((1, 3, 3))), ValueError, "y"),
    ("moments kmax", lambda: ir.wishart_trace_moments(3, 2, -1), ValueError, "kmax"),
    ("family b shape", lambda: ir.family_population_loss([1.0, 1.0], 5, 2, b=[1.0]), ValueError, "b"),
    ("distance zero", lambda: ir.distance_to_multiple(np.zeros((2, 2))), ValueError, "M"),
    ("distance shapes", lambda: ir.distance_to_multiple(np.eye(2), np.eye(3)), ValueError, "M and T"),
    ("sandwich h = 0", lambda: ir.sandwich_covariance("sparse", {"A": np.eye(3)[None]}, _Zs, _ys, chunks=2, h=0),
     ValueError, "h"),
    ("sandwich h NaN", lambda: ir.sandwich_covariance("sparse", {"A": np.eye(3)[None]}, _Zs, _ys, chunks=2, h=np.nan),
     ValueError, "h"),
    ("sandwich coords keys", lambda: ir.sandwich_covariance("sparse", {"P": 0}, _Zs, _ys, chunks=2), ValueError, "coords"),
    ("sandwich coords d", lambda: ir.sandwich_covariance("sparse", {"A": np.eye(2)[None]}, _Zs, _ys, chunks=2),
     ValueError, "coords have d = 2"),
    ("shapes L < 0", lambda: ir.structure_shapes("sparse", -1, 3), ValueError, "L"),
    ("shapes L None", lambda: ir.structure_shapes("sparse", None, 3), TypeError, "L"),
    ("shapes d = 0", lambda: ir.structure_shapes("blocks", 2, 0), ValueError, "d"),
    ("shapes H = 0", lambda: ir.structure_shapes("full", 2, 3, 0), ValueError, "H"),
    ("full coords strings", lambda: ir.structure_to_PQ("full", {"P": "a", "Q": "b"}), TypeError, "coords\\['P'\\]"),
    ("full coords None", lambda: ir.structure_to_PQ("full", {"P": _P, "Q": None}), TypeError, "coords\\['Q'\\]"),
    ("full coords NaN", lambda: ir.structure_to_PQ("full", {"P": _P * np.nan, "Q": _Q}), ValueError, "coords\\['P'\\]"),
    ("structure_grad unknown", lambda: ir.structure_grad("dense", _P, _Q), ValueError, "structure"),
    ("block_grad H = 2", lambda: ir.block_grad(np.zeros((1, 2, 4, 4)), np.zeros((1, 2, 4, 4))), ValueError, "one head"),
    ("sparse_grad H = 2", lambda: ir.sparse_grad(np.zeros((1, 2, 4, 4)), np.zeros((1, 2, 4, 4))), ValueError, "one head"),
    ("block_grad names dP", lambda: ir.block_grad(np.zeros((1, 1, 4)), np.zeros((1, 1, 4, 4))), ValueError, "dP"),
    ("block_grad names dQ", lambda: ir.block_grad(np.zeros((1, 1, 4, 4)), np.full((1, 1, 4, 4), np.inf)), ValueError, "dQ"),
    ("pack None", lambda: ir.pack([None]), TypeError, "arrays\\[0\\]"),
    ("pack complex", lambda: ir.pack([np.ones(2) + 1j]), TypeError, "arrays\\[0\\]"),
    ("pack empty", lambda: ir.pack([]), ValueError, "arrays"),
    ("pack ndarray", lambda: ir.pack(np.ones(3)), TypeError, "arrays"),
    ("unpack shapes str", lambda: ir.unpack(np.zeros(4), "22"), TypeError, "shapes"),
    ("unpack shapes negative", lambda: ir.unpack(np.zeros(4), [(-2, -2)]), ValueError, "shapes"),
    ("unpack shapes float", lambda: ir.unpack(np.zeros(4), [(2.0, 2)]), ValueError, "shapes"),
    ("blocks L = 7 loss", lambda: ir.family_population_loss([0.3] * 7, 20, 5, b=[0.5] * 7), ValueError, "deg p"),
    ("blocks L = 7 polynomials", lambda: ir.family_polynomials([0.3] * 7, b=[0.5] * 7), ValueError, "deg p"),
    ("sparse L = 21 loss", lambda: ir.family_population_loss([0.3] * 21, 20, 5), ValueError, "sparse family"),
    ("quadrature K", lambda: ir.wishart_quadrature(20, 5, 21), ValueError, "K must be"),
    ("optimal rng int", lambda: ir.optimal_family_scalars(1, 20, 5, rng=42), TypeError, "rng"),
    ("optimal blocks L = 4", lambda: ir.optimal_family_scalars(4, 20, 5, blocks=True), ValueError, "L must be <= 3"),
    # the Gauss rule needs moments to 2 deg p + 1: at L = 20 that is 41 > MAX_MOMENT_ORDER, said in terms of L
    ("optimal sparse L = 20", lambda: ir.optimal_family_scalars(20, 20, 5, starts=1), ValueError, "L must be <= 19"),
    ("fitted zero T", lambda: ir.fitted_scalar(np.eye(2), np.zeros((2, 2))), ValueError, "T"),
    # alpha = 1e600 is no float64: it was inf with a RuntimeWarning
    ("fitted overflow", lambda: ir.fitted_scalar(1e300 * np.ones((2, 2)), 1e-300 * np.eye(2)), ValueError, "overflows"),
    ("overflow loss", lambda: ir.loss_and_grad(_P + 1e30, _Q + 1e30, _Zs, _ys), ValueError, "overflow"),
    # a finite prediction whose squared error overflows: in_context_loss was inf with a RuntimeWarning
    ("overflow in-context loss", lambda: ir.in_context_loss(_P, _Q, _Zs * 1e100, _ys * 1e200), ValueError, "overflow"),
    ("overflow forward", lambda: ir.forward(_P + 1, _Q + 1, _Zs[:, :4] * 1e100), ValueError, "overflow"),
    ("overflow predict", lambda: ir.predict(_P + 1, _Q + 1, _Zs[:, :4] * 1e100), ValueError, "overflow"),
    ("overflow sampling", lambda: ir.sample_prompts(_rng, 2, 3, 1.7e308 * np.eye(3), 1.7e308 * np.eye(3)),
     ValueError, "Sigma"),
    ("attention activation", lambda: ir.attention_forward(_P[0, 0], _Q[0, 0], _Z, "gelu"), ValueError, "activation"),
    ("gram complex P", lambda: ir.loss_and_grad_gram(_P + 0j, _Q, _S0, _q0, _ys, 5), TypeError, "P"),
    ("gram S0 not symmetric", lambda: ir.loss_and_grad_gram(_P, _Q, _S0 + np.triu(np.ones(4), 1), _q0, _ys, 5),
     ValueError, "S0 must be symmetric"),
    ("gram S0 NaN", lambda: ir.loss_and_grad_gram(_P, _Q, _S0 * np.nan, _q0, _ys, 5), ValueError, "S0"),
    ("gram q0 Inf", lambda: ir.loss_and_grad_gram(_P, _Q, _S0, _q0 + np.inf, _ys, 5), ValueError, "q0"),
    ("gram n = 0", lambda: ir.loss_and_grad_gram(_P, _Q, _S0, _q0, _ys, 0), ValueError, "n"),
    ("gram n float", lambda: ir.loss_and_grad_gram(_P, _Q, _S0, _q0, _ys, 5.0), TypeError, "n"),
    ("gram q0 broadcast", lambda: ir.loss_and_grad_gram(_P, _Q, _S0, _q0[:1], _ys, 5), ValueError, "q0"),
    ("train maxiter", lambda: ir.train_lbfgs(_Z, _y, 1, rng=_rng, maxiter=0), ValueError, "maxiter"),
    ("train maxcor", lambda: ir.train_lbfgs(_Z, _y, 1, rng=_rng, maxcor=0), ValueError, "maxcor"),
    ("gn max_nfev", lambda: ir.train_gauss_newton(_Z, _y, 1, rng=_rng, max_nfev=0), ValueError, "max_nfev"),
    ("gn init shape", lambda: ir.train_gauss_newton(_Z, _y, 1, init={"A": np.zeros((1, 2, 2))}), ValueError, "init"),
    ("jacobian structure heads", lambda: ir.residuals_and_jacobian(np.zeros((1, 2, 4, 4)), np.zeros((1, 2, 4, 4)), _Zs[:, :4], _ys,
                                                                  structure="sparse"), ValueError, "H = 1"),
    ("jacobian not sparse", lambda: ir.residuals_and_jacobian(_P + 1, _Q, _Zs[:, :4], _ys, structure="sparse"),
     ValueError, "form of structure 'sparse'"),
    ("jacobian gram not blocks", lambda: ir.residuals_and_jacobian_gram(_P, _Q + 1, _S0, _q0, _ys, 5, structure="blocks"),
     ValueError, "form of structure 'blocks'"),
    ("overflow jacobian", lambda: ir.residuals_and_jacobian(_P + 1e80, _Q + 1e80, _Zs[:, :4], _ys), ValueError,
     "overflow"),
    ("overflow activation", lambda: ir.loss_and_grad_activation(_P + 1e80, _Q + 1e80, _Zs[:, :4], _ys), ValueError,
     "overflow"),
    # flags are booleans: a string such as "no" is not taken as True
    ("return_w_star string", lambda: ir.sample_prompts(_rng, 2, 3, _S, return_w_star="no"), TypeError,
     "return_w_star must be True or False"),
    ("all_layers string", lambda: ir.forward(_P, _Q, _Z, all_layers="no"), TypeError, "all_layers must be True or False"),
    ("query_label_zero string", lambda: ir.symmetry_directions("sparse", {"A": np.eye(3)[None]}, query_label_zero="False"),
     TypeError, "query_label_zero must be True or False"),
    ("keep_iterates string", lambda: ir.train_lbfgs(_Zs, _ys, 1, rng=_rng, keep_iterates="no"), TypeError,
     "keep_iterates must be True or False"),
    # a scale whose square leaves float64: the loss c^2 l and the trained Q / c^2 could not be returned
    ("data scale beyond square", lambda: ir.train_lbfgs(_Zs * 2.0 ** -1000, _ys * 2.0 ** -1000, 1, rng=_rng), ValueError,
     "Z's scale c = .* is beyond what float64 squares"),
    ("data scale beyond square, large", lambda: ir.train_gauss_newton(_Zs * 2.0 ** 600, _ys * 2.0 ** 600, 1, rng=_rng),
     ValueError, "Z's scale c = .* is beyond what float64 squares"),
    ("Sigma singular to float64", lambda: ir.gamma_star([[1, 1 - 1e-16], [1 - 1e-16, 1]], 20), ValueError,
     "Sigma is singular to float64"),
    # engine= is None or an evaluator with ReferenceEngine's methods: a name such as "fast" is refused, named
    ("engine a string", lambda: ir.loss_and_grad(_P, _Q, _Zs[:, :4], _ys, engine="fast"), TypeError,
     "engine must be None or an evaluator .* got str without gram, loss_and_grad_gram"),
    ("engine gram a string", lambda: ir.loss_and_grad_gram(_P, _Q, _S0, _q0, _ys, 5, engine="fast"), TypeError, "engine"),
    ("engine activation a string", lambda: ir.loss_and_grad_activation(_P, _Q, _Zs[:, :4], _ys, engine="fast"), TypeError,
     "engine"),
    ("engine jacobian gram a string", lambda: ir.residuals_and_jacobian_gram(_P, _Q, _S0, _q0, _ys, 5, engine="fast"),
     TypeError, "engine"),
    ("engine without a method", lambda: ir.train_lbfgs(_Zs, _ys, 1, rng=_rng, engine=types.SimpleNamespace(gram=ir._gram)),
     TypeError, "got SimpleNamespace without loss_and_grad_gram, jacobian_gram, activation_pass, reduced_least_squares"),
]


def malformed_variants(rng, a):
    """Arrays that must be refused in place of a valid array a: wrong ndim, wrong size, wrong
    dtype, NaN/Inf, ragged and non-array values."""
    nan, inf = a.copy(), a.copy()
    nan.flat[rng.integers(a.size)] = np.nan
    inf.flat[rng.integers(a.size)] = -np.inf
    return [a[0], a[None], np.concatenate([a, a[:1]]), a.astype(complex), a.astype(str), a > 0,
            nan, inf, [[1.0, 2.0], [3.0]], None, "Z", np.empty((0,) + a.shape[1:])]


def test_malformed_inputs_are_refused_before_work():
    rng = np.random.default_rng(81)
    Z, y = ir.sample_prompts(rng, 4, 5, np.eye(2))
    P, Q = random_params(rng, 2, 1, 2)
    A = rng.standard_normal((2, 2, 2))
    X, yc = Z[0, :2, :-1].T, Z[0, 2, :-1]
    calls = {
        "forward": (ir.forward, dict(P=P, Q=Q, Z=Z)),
        "predict": (ir.predict, dict(P=P, Q=Q, Z=Z)),
        "in_context_loss": (ir.in_context_loss, dict(P=P, Q=Q, Z=Z, y=y)),
        "loss_and_grad": (ir.loss_and_grad, dict(P=P, Q=Q, Z=Z, y=y)),
        "forward_literal": (ir.forward_literal, dict(P=P, Q=Q, Z=Z)),
        "sparse_params": (ir.sparse_params, dict(A=A)),
        "block_params": (ir.block_params, dict(A=A, Bm=A)),
        "preconditioned_gd": (ir.preconditioned_gd, dict(X=X, y=yc, A=A)),
        "gamma_star": (ir.gamma_star, dict(Sigma=np.eye(2), n=5)),
        "single_layer_population_loss": (ir.single_layer_population_loss, dict(Gamma=np.eye(2), Sigma=np.eye(2), n=5)),
        "distance_to_multiple": (ir.distance_to_multiple, dict(M=np.eye(2), T=np.eye(2))),
        "train_lbfgs": (lambda **kw: ir.train_lbfgs(layers=1, rng=rng, maxiter=1, **kw), dict(Z=Z, y=y)),
    }
    refused = 0
    for fname, (fn, kwargs) in calls.items():
        fn(**kwargs)                                          # the valid call works
        for arg, value in kwargs.items():
            if not isinstance(value, np.ndarray):
                continue
            for bad in malformed_variants(rng, value):
                if isinstance(bad, np.ndarray) and bad.shape == value.shape and bad.dtype == np.float64 \
                        and np.all(np.isfinite(bad)):
                    continue                                  # e.g. a[None] of a 1-long axis: still valid
                try:
                    fn(**{**kwargs, arg: bad})
                except (ValueError, TypeError) as e:
                    names = [arg, "P and Q", "A and Bm", "M and T"]
                    assert any(name in str(e) for name in names), (fname, arg, str(e))
                    refused += 1
                else:
                    # only what the function accepts by design may pass: X (B, n, d) for
                    # preconditioned_gd, which also takes a batch; T = None, the identity
                    assert (fname, arg) in {("preconditioned_gd", "X"), ("preconditioned_gd", "y")} or \
                        (fname, arg, bad) == ("distance_to_multiple", "T", None) or \
                        (isinstance(bad, np.ndarray) and bad.ndim == value.ndim and bad.dtype.kind in "fi"
                         and np.all(np.isfinite(bad))), (fname, arg, np.shape(bad))
    assert refused > 150


def test_scale_free_quantities_hold_at_extreme_scales():
    # distances and fitted scalars are scale-free: the same at 1e-200 and 1e160 as at 1
    rng = np.random.default_rng(130)
    M, T = rng.standard_normal((2, 3, 3))
    for c in (1e-200, 1e160):
        assert ir.distance_to_multiple(c * M, T) == pytest.approx(ir.distance_to_multiple(M, T), rel=EXACT)
        assert ir.distance_to_multiple(M, c * T) == pytest.approx(ir.distance_to_multiple(M, T), rel=EXACT)
        assert ir.distance_to_diagonal(c * M) == pytest.approx(ir.distance_to_diagonal(M), rel=EXACT)
        assert ir.fitted_scalar(c * M, T) == pytest.approx(c * ir.fitted_scalar(M, T), rel=EXACT)
    Z, _ = ir.sample_prompts(rng, 2, 3, 1.7e308 * np.eye(3))          # the largest Sigma float64 holds
    assert np.all(np.isfinite(Z))


def test_icl_ref_imports_only_numpy_scipy_and_the_standard_librarys_math_modules():
    # every import statement of the module, wherever it stands (numpy and scipy may load what they
    # like; icl_ref asks for nothing else, so the file can be copied into another project). No file
    # I/O, command line or threads: importlib, warnings and runpy serve only the 0.4.0 forwarding
    with open(ir.__file__, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names}
    names |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert {"numpy", "scipy"} <= names
    assert names - {"numpy", "scipy"} <= {"functools", "itertools", "math", "sys", "time", "fractions",
                                          "importlib", "warnings", "runpy"}


PROJECT = ("icl_ref", "icl_check", "icl_looped", "icl_estimators", "icl_fast", "icl_files")
PINNED_PRIVATE_API = ("_numpy_rules", "_array", "_int", "_nonneg", "_flag", "_rng", "_prompts", "_params", "_spd",
                      "_finite", "_task_covariance", "_task_moment", "_pool", "_single_layer_moments",
                      "_single_layer_loss", "_family_search", "_wishart_T")


def _top_level_imports(path):
    """The project modules a file imports at its top level (not inside functions)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names = {alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names}
    names |= {node.module for node in tree.body if isinstance(node, ast.ImportFrom) and node.module}
    return names & set(PROJECT)


def test_the_modules_import_one_way_towards_icl_ref():
    # icl_ref imports no module of the project; the others import icl_ref (and the file writer), and
    # the graph has no cycle: each module's imports come earlier in this order
    order = ("icl_files", "icl_ref", "icl_estimators", "icl_looped", "icl_check", "icl_fast")
    here = os.path.dirname(os.path.abspath(__file__))
    for k, module in enumerate(order):
        imports = _top_level_imports(os.path.join(here, module + ".py"))
        assert imports <= set(order[:k]), (module, imports)
    assert _top_level_imports(os.path.join(here, "icl_ref.py")) == set()
    assert {"icl_ref"} <= _top_level_imports(os.path.join(here, "icl_check.py"))


def test_other_modules_use_only_the_pinned_private_names_of_icl_ref():
    # the private names another part of the project may take from icl_ref are listed in
    # icl_ref.PRIVATE_API (pinned here): `from icl_ref import _x` and `ir._x` elsewhere use only them
    assert ir.PRIVATE_API == PINNED_PRIVATE_API and all(callable(getattr(ir, n)) for n in ir.PRIVATE_API)
    here = os.path.dirname(os.path.abspath(__file__))
    files = [os.path.join(here, m + ".py") for m in PROJECT if m != "icl_ref"] + [os.path.join(here, "experiments.py")]
    for folder in ("tools", "examples"):
        files += sorted(os.path.join(here, folder, f) for f in os.listdir(os.path.join(here, folder)) if f.endswith(".py"))
    used = {}
    for path in files:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        aliases = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import)
                   for a in n.names if a.name == "icl_ref"}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "icl_ref":
                used.setdefault(path, set()).update(a.name for a in node.names if a.name.startswith("_"))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                used.setdefault(path, set()).add(node.attr)
    outside = {os.path.relpath(p, here): sorted(n - set(ir.PRIVATE_API)) for p, n in used.items() if n - set(ir.PRIVATE_API)}
    assert not outside, outside


def test_the_gradients_path_to_the_layer_is_named_calls_without_lambdas():
    # from loss_and_grad, calls by name reach layer_forward and layer_backward (three hops each:
    # through _loss_and_grad_gram and _propagate or _backpropagate) and no function on the way holds
    # a lambda or a functools.partial (tools/layout.py prints the path)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "tools"))
    try:
        import layout
    finally:
        sys.path.pop(0)
    with open(ir.__file__, encoding="utf-8") as f:
        source = f.read()
    paths, indirect = layout.named_path(source, "loss_and_grad", ("layer_forward", "layer_backward"))
    assert set(paths) == {"layer_forward", "layer_backward"} and indirect == []
    assert all(len(path) - 1 <= 4 for path in paths.values()), paths
    # the tool itself sees what it looks for: a lambda on the path, a function used before it is defined
    toy = "def f(x):\n    return g(x)\n\n\ndef g(x):\n    return (lambda y: h(y))(x)\n\n\ndef h(y):\n    return y\n"
    assert layout.used_before_defined(toy) == [("f", "g"), ("g", "h")]
    assert layout.named_path(toy, "f", ("h",)) == ({"h": ["f", "g", "h"]}, ["g"])


def test_moved_names_are_reachable_from_icl_ref_with_a_warning_naming_their_home():
    # users' code keeps working for one release: icl_ref.<name> is the new home's object, with a
    # DeprecationWarning that names the module to import it from
    import importlib
    assert len(ir._MOVED) == 27
    for name, home in ir._MOVED.items():
        with pytest.warns(DeprecationWarning, match=f"icl_ref.{name} moved to {home}.{name}"):
            assert getattr(ir, name) is getattr(importlib.import_module(home), name)
        assert name not in vars(ir)                         # the only copy lives in its new home
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        ir.no_such_name


def test_no_file_of_the_project_reaches_a_moved_name_through_icl_ref():
    # the examples (run only in CI's frameworks leg) once called ir.tokens_as_rows: a DeprecationWarning,
    # an error under pytest's filterwarnings, failed that leg. Every .py and .md file of the project, examples
    # included, names the new home; the one exception is the test of the deprecation path itself.
    import glob
    import pathlib
    import re
    root = os.path.dirname(os.path.abspath(__file__))
    files = sorted(os.path.relpath(f, root) for pattern in ("*.py", "*.md", "examples/*.py", "tools/*.py", "docs/*.md")
                   for f in glob.glob(os.path.join(root, pattern)))      # no git needed (a tarball, a snapshot)
    assert "examples/test_torch_linear_transformer.py" in files
    pattern = re.compile(r"\b(?:ir|icl_ref)\.(" + "|".join(map(re.escape, ir._MOVED)) + r")\b")
    found = [f"{name}:{number}: {line.strip()}" for name in files
             for number, line in enumerate(pathlib.Path(root, name).read_text(encoding="utf-8").splitlines(), 1)
             if pattern.search(line) and "deprecation" not in line.lower()]
    allowed = {"test_icl_check.py"}          # test_icl_ref_still_forwards_the_kit_with_a_deprecation_warning...
    assert [f for f in found if f.split(":")[0] not in allowed] == []


def test_reference_leaves_no_threads_or_process_state_and_concurrent_calls_equal_serial():
    # threads, CPU affinity and BLAS thread counts are the same after the work as before it; four
    # Python threads calling loss_and_grad at once get the serial result to the last bit
    import threading
    from threadpoolctl import threadpool_info

    def state():
        return (threading.active_count(), os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None,
                [(i["internal_api"], i["num_threads"]) for i in threadpool_info()])
    before = state()
    rng, Z, y = small_problem(seed=170, B=20000, n=20, d=5)
    P, Q = random_params(rng, 3, 1, 5, scale=0.1)
    serial = ir.loss_and_grad(P, Q, Z, y)
    ir.residuals_and_jacobian(P, Q, Z[:2000], y[:2000])
    ir.train_lbfgs(Z[:2000], y[:2000], 2, rng=rng, maxiter=5)
    ir.train_gauss_newton(Z[:2000], y[:2000], 2, rng=rng, max_nfev=3)
    results = []
    callers = [threading.Thread(target=lambda: results.append(ir.loss_and_grad(P, Q, Z, y))) for _ in range(4)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert len(results) == 4
    for res in results:
        assert res[0] == serial[0] and np.array_equal(res[1], serial[1]) and np.array_equal(res[2], serial[2])
    assert state() == before


def test_every_public_function_works_under_a_strict_caller_and_leaves_its_settings():
    # a caller's np.seterr(all="raise") (strict suites set it) must not turn the library's own
    # underflows into errors, nor be changed by a call: the result equals the default-settings one
    assert_strict_caller_gets_the_same(ir, _strict_calls, draws=(
        "sample_prompts", "rotated_covariance", "train_lbfgs", "train_gauss_newton", "optimal_family_scalars",
        "sandwich_covariance"))


def test_a_strict_callers_overflow_is_the_librarys_value_error_and_a_trainers_rejected_trial():
    # under np.seterr(all="raise") a real overflow inside is not a FloatingPointError: the evaluating
    # functions say float64 overflowed (ValueError), the trainer rejects the overflowing trial point
    # and goes on, and the caller's settings are as they were after each
    rng = np.random.default_rng(0)
    Sigma, _ = ir.rotated_covariance(rng)
    Z, y = ir.sample_prompts(rng, 300, 20, Sigma, np.linalg.inv(Sigma))
    P, Q = 1e200 * np.ones((2, 1, 1, 6, 6))
    strict = dict(divide="raise", over="raise", under="raise", invalid="raise")
    old = np.seterr(**strict)
    try:
        for call in (lambda: ir.loss_and_grad(P, Q, Z, y), lambda: ir.forward(P, Q, Z), lambda: ir.predict(P, Q, Z),
                     lambda: ir.loss_and_grad_activation(P, Q, Z[:5], y[:5], "relu"),
                     lambda: ir.residuals_and_jacobian(P, Q, Z, y)):
            with pytest.raises(ValueError, match="overflow"):
                call()
            assert np.geterr() == strict
        res = ir.train_lbfgs(Z, y, 4, structure="blocks", rng=rng, init_scale=1.5, maxiter=60)   # as in §6's test
        assert "trial points overflowed float64 and were rejected" in res["message"] and np.geterr() == strict
    finally:
        np.seterr(**old)


def assert_strict_caller_gets_the_same(module, make_calls, draws):
    """Every public function of `module` has a call in make_calls() (name -> thunk), and each returns
    under np.seterr(all="raise") what it returns under the default rules (bit for bit, except those in
    `draws`, which draw from an rng), leaving the caller's settings as they were."""
    calls = make_calls()
    public = {k for k, v in vars(module).items() if not k.startswith("_") and inspect.isfunction(v)
              and v.__module__ == module.__name__}
    assert public == set(calls)                            # a new public function gets a line here
    with np.errstate(under="ignore"):                      # the default rules: what each call returns
        expected = {name: call() for name, call in make_calls().items()}
    old = np.seterr(all="raise")
    try:
        for name, call in calls.items():
            got = call()
            assert np.geterr() == dict(divide="raise", over="raise", under="raise", invalid="raise"), name
            if name not in draws:                          # those draw from an rng: they differ
                assert _same(got, expected[name]), name
    finally:
        np.seterr(**old)


def _strict_calls():
    """One call of every public function of sections 1-8 (name -> thunk), on inputs where NumPy
    underflows inside: prompts of scale 1e-120 (products of four entries fall below 1e-308) and
    softmax scores far below exp's range."""
    rng, Z, y = small_problem(seed=190, B=30, n=6, d=2)
    tiny = 1e-120
    P, Q = random_params(rng, 2, 1, 2)
    Ps, Qs = ir.sparse_params(np.stack([np.eye(2)] * 2))
    S0, q0 = ir.gram(Z), Z[:, :, -1]
    Zx = Z * 30.0                                          # softmax scores ~ -1e3: exp underflows
    coords = {"A": np.stack([np.eye(2)] * 2)}
    S, q, _, cache = ir.layer_forward(P[0], Q[0], S0, q0, 6)
    out, rcache = ir.readout_forward(P[1], Q[1], S, q, 6)
    _, acache = ir.attention_forward(P[0, 0], Q[0, 0], Zx, "softmax")
    G = ir.gamma_star(np.eye(2), 6)
    allparam = rng.standard_normal((2, 1, 2, 2, 2))
    return {
        "sample_prompts": lambda: ir.sample_prompts(rng, 4, 3, np.eye(2) * tiny),
        "rotated_covariance": lambda: ir.rotated_covariance(rng, [1.0, tiny]),
        "mask": lambda: ir.mask(3),
        "forward_literal": lambda: ir.forward_literal(P, Q, Z * tiny),
        "gram": lambda: ir.gram(Z * tiny),
        "layer_forward": lambda: ir.layer_forward(P[0], Q[0], S0 * tiny ** 2, q0 * tiny, 6),
        "layer_backward": lambda: ir.layer_backward(S * tiny, q * tiny, cache),
        "readout_forward": lambda: ir.readout_forward(P[1], Q[1], S * tiny, q * tiny, 6),
        "readout_backward": lambda: ir.readout_backward(out * tiny, rcache),
        "forward": lambda: ir.forward(P, Q, Z * tiny),
        "predict": lambda: ir.predict(P, Q, Z * tiny),
        "in_context_loss": lambda: ir.in_context_loss(P, Q, Z * tiny, y * tiny),
        "loss_and_grad_gram": lambda: ir.loss_and_grad_gram(P, Q, S0 * tiny ** 2, q0 * tiny, y * tiny, 6),
        "loss_and_grad": lambda: ir.loss_and_grad(P, Q, Z * tiny, y * tiny),
        "residuals_and_jacobian_gram": lambda: ir.residuals_and_jacobian_gram(P, Q, S0 * tiny ** 2, q0 * tiny, y, 6),
        "residuals_and_jacobian": lambda: ir.residuals_and_jacobian(P, Q, Zx, y, activation="softmax"),
        "attention_forward": lambda: ir.attention_forward(P[0, 0], Q[0, 0], Zx, "softmax"),
        "attention_backward": lambda: ir.attention_backward(Zx * tiny, acache),
        "forward_activation": lambda: ir.forward_activation(P, Q, Zx, "softmax"),
        "predict_activation": lambda: ir.predict_activation(P, Q, Zx, "softmax"),
        "loss_and_grad_activation": lambda: ir.loss_and_grad_activation(P, Q, Zx, y, "softmax"),
        "block_params": lambda: ir.block_params(coords["A"] * tiny, coords["A"] * tiny),
        "block_grad": lambda: ir.block_grad(P * tiny, Q * tiny),
        "sparse_params": lambda: ir.sparse_params(coords["A"] * tiny),
        "sparse_grad": lambda: ir.sparse_grad(P * tiny, Q * tiny),
        "pack": lambda: ir.pack([P * tiny]),
        "unpack": lambda: ir.unpack(np.full(4, tiny), [(2, 2)]),
        "structure_shapes": lambda: ir.structure_shapes("sparse", 2, 2),
        "structure_to_PQ": lambda: ir.structure_to_PQ("sparse", {"A": coords["A"] * tiny}),
        "structure_grad": lambda: ir.structure_grad("sparse", P * tiny, Q * tiny),
        "train_lbfgs": lambda: ir.train_lbfgs(Zx[:20] / 30, y[:20], 1, rng=rng, maxiter=5, activation="softmax"),
        "train_gauss_newton": lambda: ir.train_gauss_newton(Z * tiny, y * tiny, 2, rng=rng, max_nfev=5),
        "preconditioned_gd": lambda: ir.preconditioned_gd(Z[:, :2, :-1].transpose(0, 2, 1) * tiny, Z[:, 2, :-1], coords["A"]),
        "gamma_star": lambda: ir.gamma_star(np.diag([1.0, 1e-160]), 6),
        "single_layer_population_loss": lambda: ir.single_layer_population_loss(G * tiny, np.eye(2), 6),
        "full_layer_population_loss": lambda: ir.full_layer_population_loss(Ps[:1] * tiny, Qs[:1], np.eye(2), 6),
        "gd_step_size": lambda: ir.gd_step_size(6, 2),
        "wishart_trace_moments": lambda: ir.wishart_trace_moments(6, 2, 3),
        "family_polynomials": lambda: ir.family_polynomials([tiny, 1.0]),
        "family_population_loss": lambda: ir.family_population_loss([tiny, 0.5], 6, 2),
        "wishart_quadrature": lambda: ir.wishart_quadrature(6, 2, 4),
        "optimal_family_scalars": lambda: ir.optimal_family_scalars(1, 6, 2, starts=2, rng=rng),
        "family_local_minimum": lambda: ir.family_local_minimum([0.5], 6, 2),
        "distance_to_multiple": lambda: ir.distance_to_multiple(np.eye(2) * tiny),
        "distance_to_diagonal": lambda: ir.distance_to_diagonal(np.eye(2) * tiny),
        "fitted_scalar": lambda: ir.fitted_scalar(np.eye(2) * tiny, np.eye(2)),
        "symmetry_directions": lambda: ir.symmetry_directions("sparse", coords),
        "identifiable_hessian": lambda: ir.identifiable_hessian("sparse", coords, Z, y),
        "sandwich_covariance": lambda: ir.sandwich_covariance(
            "sparse", ir.train_lbfgs(Z, y, 1, rng=rng)["coords"], Z, y),
    }


def _same(a, b):
    """a and b equal bit for bit, through tuples, lists and dicts of arrays and numbers."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, np.ndarray) or isinstance(a, float):
        return np.array_equal(a, b, equal_nan=True)
    return a == b


def test_a_strict_caller_gets_the_library_s_error_where_an_iterate_overflows_and_its_handler_is_not_called():
    # _numpy_rules: a caller's np.seterr "raise" (or "call") is made "warn" inside the library, so a strict
    # caller gets what any caller gets and its handler is never called; the other strict tests provoke only
    # underflow: here preconditioned_gd's iterates overflow (X of scale 1e200: w_2 ~ 1e600), which every
    # caller is told as the ValueError naming float64's overflow, never inf and NaN
    X, y, A = 1e200 * np.ones((10, 3)), np.ones(10), np.stack([np.eye(3)] * 2)
    with pytest.raises(ValueError, match="the iterates W is not finite: float64 overflowed"):
        ir.preconditioned_gd(X, y, A)
    for rule in ("raise", "call"):
        calls = []
        old, old_call = np.seterr(all=rule), np.seterrcall(lambda kind, flag: calls.append(kind))
        try:
            with pytest.raises(ValueError, match="float64 overflowed"):
                ir.preconditioned_gd(X, y, A)
        finally:
            np.seterr(**old)
            np.seterrcall(old_call)
        assert calls == [], rule
    # one layer, w_1 = A^T X^T y / n = 1e200 (each entry), stays finite: rtol 1e-15, the rounding of a sum of
    # ten terms and a division
    np.testing.assert_allclose(ir.preconditioned_gd(X, y, A[:1])[1], np.full(3, 1e200), rtol=1e-15)
