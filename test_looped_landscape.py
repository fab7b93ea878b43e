"""Tests for looped_landscape: the tied sparse model's population loss beyond the scalar family (MATH.md §14).

Each quantity is checked against a computation that shares no code with it:
    the exact polynomial f(W)       against §10's family loss at W = a I (exact rationals), the L = 1 closed
                                    form, and an exact Gauss-Hermite rule over all of G at small n, d
    per_sample_loss                 against the transformer itself on prompts that share one context
    the three Hessian eigenvalues   against the Hessian of the exact polynomial (complex step) and a
                                    Monte Carlo over S of exact per-sample second derivatives
    the located minima              by their exact gradient and reduced Hessian, and (slow) by Monte Carlo

Tolerances, each with its reason:
    EXACT  = 1e-12  relative: one exact quantity computed twice in float64 (rounding only; the
                    polynomial's terms reach ~1e2 times the loss at L = 4, n = 20, so ~1e-14 here)
    FD_VEC = 1e-8   relative, a gradient against five-point differences at h = 1e-4 (truncation
                    ~h^4 f^(5) ~ 1e-14, rounding ~1e-16 |f| / h ~ 1e-12 |f|)
    Z_MC   = 4      sampling: an estimate within 4 of its standard errors (computed from the samples)
"""
import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

import icl_ref as ir
import looped_landscape as ll

EXACT = 1e-12
FD_VEC = 1e-8
Z_MC = 4.0
N, D = 20, 5                           # the paper's size ([A] §4.3)
# the tests take a*_L from one L-BFGS-B start: the tied sparse family loss is strictly convex (MATH.md §14)


def gauss_hermite_loss(W, L, n, d):
    """f(W) = E ||(I - W^T S)^L||_F^2 by the product Gauss-Hermite rule over all n d entries of X
    (S = X^T X / n): per_sample_loss is a polynomial of degree <= 4L in each entry, so 2L + 1 nodes
    per entry integrate it exactly. (2L + 1)^(n d) nodes: small n d only."""
    k = 2 * L + 1
    x, w = np.polynomial.hermite_e.hermegauss(k)
    grid = np.array(list(itertools.product(range(k), repeat=n * d)))
    X = x[grid].reshape(-1, n, d)
    S = np.einsum("bni,bnj->bij", X, X) / n
    return float(np.prod(w[grid] / math.sqrt(2 * math.pi), axis=1) @ ll.per_sample_loss(W, S, L))


def five_point(f, x, h=1e-4):
    g = np.empty_like(x)
    for i in range(x.size):
        e = np.zeros_like(x)
        e[i] = h
        g[i] = (8 * (f(x + e) - f(x - e)) - (f(x + 2 * e) - f(x - 2 * e))) / (12 * h)
    return g


# ---------------------------------------------------------------------------------------------
# The exact polynomial f(W)
# ---------------------------------------------------------------------------------------------

def test_word_expectation_is_isserlis_with_the_transposes_in_place():
    # E[S C S] = C + (C^T + tr(C) I) / n (MATH.md §8 for Sigma = I): with C = W and C = W^T the two
    # 1/n terms trade places, so a transpose slipped in the recursion's Y Z^T s term shows here
    n = 7
    assert ll.word_expectation(["asas"], n, 3) == {("aa",): 1, ("ab",): Fraction(1, n), ("a", "a"): Fraction(1, n)}
    assert ll.word_expectation(["asbs"], n, 3) == {("ab",): 1, ("aa",): Fraction(1, n), ("a", "a"): Fraction(1, n)}
    # words of S alone are the Wishart moments of MATH.md §9, products of traces included
    m = ir.wishart_trace_moments(n, 3, 5)
    for k in range(1, 6):
        assert ll.word_expectation(["s" * k], n, 3) == {(): m[k]}
    assert ll.word_expectation(["ss", "s"], n, 3) == {(): Fraction(ir._wishart_T(n, 3, (1, 2), {}), n ** 3)}


@pytest.mark.parametrize("L", [1, 2, 3, 4])
def test_loss_polynomial_is_the_family_loss_on_multiples_of_identity(L):
    # the other side: §10's family loss, p(t) = (1 - a t)^L and exact trace moments; both exact rationals
    a = ir.optimal_tied_family(L, N, D, starts=1)[0]
    exact = ll.tied_population_loss(a * np.eye(D), L, N, D, exact=True)
    assert float(exact) == ir.family_population_loss(np.full(L, a), N, D)
    assert abs(ll.tied_population_loss(a * np.eye(D), L, N, D) - float(exact)) <= EXACT * float(exact)


def test_loss_polynomial_at_one_loop_is_the_quadratic():
    # L = 1: E ||I - W^T S||^2 = d - 2 tr W + (n + d + 1)/n ||W||_F^2 (E S^2 = (n + d + 1)/n I)
    rng = np.random.default_rng(0)
    W = rng.standard_normal((D, D))
    expected = D - 2 * np.trace(W) + (N + D + 1) / N * np.sum(W * W)
    assert abs(ll.tied_population_loss(W, 1, N, D) - expected) <= EXACT * expected


@pytest.mark.parametrize("n, d, L", [(2, 3, 3), (2, 2, 4), (1, 3, 4), (3, 2, 3)])
def test_loss_polynomial_equals_an_exact_gauss_hermite_rule(n, d, L):
    # for a non-normal W, against the rule over every entry of X: no Wishart moment, no word. At
    # (2, 3, 3) this W has f(W^T) 1e-3 above f(W), so a transpose slipped into the words is refused
    # (f(W) = f(W^T) for d = 2, where a reflection maps W to W^T, and seemingly at L = 2)
    rng = np.random.default_rng(20 if (n, d, L) == (2, 3, 3) else n + 10 * d + 100 * L)
    W = 0.5 * np.eye(d) + 0.5 * rng.standard_normal((d, d))
    rule = gauss_hermite_loss(W, L, n, d)
    assert abs(ll.tied_population_loss(W, L, n, d) - rule) <= EXACT * rule
    if (n, d, L) == (2, 3, 3):
        assert abs(ll.tied_population_loss(W.T, L, n, d) - rule) > 1e-6 * rule


def test_per_sample_loss_is_the_transformer_given_the_context():
    # prompts that share one context X (so one S) and differ in w* ~ N(0, I) and the query: the
    # transformer's mean squared error is ||(I - W^T S)^L||_F^2 (Lemma 1 with the transpose, MATH.md
    # §7); with W in place of W^T it is off by many standard errors for this (non-normal) W
    rng = np.random.default_rng(1)
    n, d, L, B = 6, 3, 3, 40000
    W = 0.5 * np.eye(d) + np.diag([0.6, 0.6], 1)
    X = rng.standard_normal((n, d))
    w_star, xq = rng.standard_normal((B, d)), rng.standard_normal((B, d))
    Z = np.zeros((B, d + 1, n + 1))
    Z[:, :d, :n] = X.T
    Z[:, :d, n] = xq
    Z[:, d, :n] = w_star @ X.T
    P, Q = ir.structure_to_PQ("sparse", {"A": W[None]}, L=L)
    err = (ir.predict(P, Q, Z) - np.sum(w_star * xq, axis=1)) ** 2
    S = (X.T @ X / n)[None]
    m, se = err.mean(), err.std(ddof=1) / math.sqrt(B)
    assert abs(m - ll.per_sample_loss(W, S, L)[0]) <= Z_MC * se
    assert abs(m - ll.per_sample_loss(W.T, S, L)[0]) > Z_MC * se


@pytest.mark.parametrize("L", [2, 4])
def test_loss_polynomial_against_monte_carlo_at_the_papers_size(L):
    # a non-normal W at n = 20, d = 5, on 20000 samples of S with the family point's exact loss as a
    # control variate (common random numbers): within Z_MC standard errors
    rng = np.random.default_rng(2)
    a, _, f0 = ir.optimal_tied_family(L, N, D)
    W = a * np.eye(D) + 0.15 * rng.standard_normal((D, D))
    S = ll.sample_whitened_covariances(rng, 20000, N, D)
    m, se, c = ll.mc_loss(W, S, L, control=(a * np.eye(D), f0))
    assert c > 0.5 and abs(m - ll.tied_population_loss(W, L, N, D)) <= Z_MC * se


def test_gradient_is_the_derivative_of_the_loss_and_rotations_leave_the_loss():
    rng = np.random.default_rng(3)
    L = 3
    W = 0.7 * np.eye(D) + 0.2 * rng.standard_normal((D, D))
    f, g = ll.tied_loss_and_grad(W, L, N, D)
    numeric = five_point(lambda x: ll.tied_population_loss(x.reshape(D, D), L, N, D), W.ravel())
    assert np.linalg.norm(g.ravel() - numeric) <= FD_VEC * np.linalg.norm(numeric)
    O, _ = np.linalg.qr(rng.standard_normal((D, D)))
    f2, g2 = ll.tied_loss_and_grad(O @ W @ O.T, L, N, D)
    assert abs(f2 - f) <= EXACT * f and np.allclose(g2, O @ g @ O.T, rtol=0, atol=1e-12 * np.abs(g).max())
    # the per-sample gradient (a separate formula) averages to it: exact per S, so compare on the
    # same samples against five-point differences of the sample mean
    S = ll.sample_whitened_covariances(rng, 50, N, D)
    mean = lambda x: ll.per_sample_loss(x.reshape(D, D), S, L).mean()
    assert np.allclose(ll.per_sample_gradient(W, S, L).mean(axis=0).ravel(), five_point(mean, W.ravel()),
                       rtol=0, atol=FD_VEC * np.abs(five_point(mean, W.ravel())).max())


# ---------------------------------------------------------------------------------------------
# The three Hessian eigenvalues at the family point
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("L, n, d", [(2, N, D), (3, N, D), (4, N, D), (3, 7, 3), (4, 40, 4)])
def test_family_hessian_eigenvalues_equal_the_polynomials_hessian(L, n, d):
    # the other side: the Hessian of the exact polynomial (complex steps of its gradient), which is
    # one scalar on each subspace: every Rayleigh quotient and every cross term checked
    a = ir.optimal_tied_family(L, n, d, starts=1)[0]
    closed = ll.tied_family_hessian_eigenvalues(L, n, d, a)
    H = ll.tied_hessian(a * np.eye(d), L, n, d)
    scale = np.abs(H).max()
    for U, value in zip(ll.subspace_bases(d), closed):
        np.testing.assert_allclose(U.T @ H @ U, value * np.eye(U.shape[1]), rtol=0, atol=1e-10 * scale)
    ident, sym, anti = ll.subspace_bases(d)
    assert np.abs(sym.T @ H @ anti).max() <= 1e-10 * scale and np.abs(ident.T @ H @ anti).max() <= 1e-10 * scale


@pytest.mark.parametrize("L, n", [(2, N), (4, N), (4, 1000)])
def test_tied_family_step_is_the_root_of_the_exact_derivative(L, n):
    # the other side: the family loss itself (exact rationals, icl_ref's own polynomial code) is higher
    # at a* +- 1e-6 relative, and the float optimiser agrees to its own 1e-8
    a = ll.tied_family_step(L, n, D)
    f = lambda x: ir.family_population_loss(np.full(L, float(x)), n, D)
    assert f(a * (1 - Fraction(1, 10 ** 6))) > f(a) < f(a * (1 + Fraction(1, 10 ** 6)))
    assert abs(float(a) / ir.optimal_tied_family(L, n, D)[0] - 1) < 1e-8


@pytest.mark.parametrize("L", [2, 3, 4])
def test_identity_eigenvalue_is_the_family_curvature(L):
    # f_L(a) = sum_k C(2L, k) (-a)^k m_k (MATH.md §14), so f_L''(a) / d in exact rationals
    a = ir.optimal_tied_family(L, N, D, starts=1)[0]
    m, A = ir.wishart_trace_moments(N, D, 2 * L), Fraction(a)
    second = sum(math.comb(2 * L, k) * (-1) ** k * k * (k - 1) * A ** (k - 2) * m[k] for k in range(2, 2 * L + 1))
    assert ll.tied_family_hessian_eigenvalues(L, N, D, a, exact=True)[0] == second / D


@pytest.mark.parametrize("L", [2, 3, 4])
def test_antisymmetric_eigenvalue_matches_monte_carlo(L):
    # the acceptance check: the closed form against the mean over 10000 samples of S of the exact
    # per-sample second derivatives along an orthonormal basis of antisymmetric directions (SE 0.002 at
    # L = 2, 0.005 at L = 4: a factor 2 or a sign slipped in the closed form is 8 or more SE off)
    rng = np.random.default_rng(10 + L)
    a = ir.optimal_tied_family(L, N, D, starts=1)[0]
    closed = ll.tied_family_hessian_eigenvalues(L, N, D, a)
    S = ll.sample_whitened_covariances(rng, 10000, N, D)
    (mi, si), (ms, ss), (ma, sa) = ll.mc_family_hessian_eigenvalues(L, S, a)
    assert abs(ma - closed[2]) <= Z_MC * sa
    assert abs(ms - closed[1]) <= Z_MC * ss and abs(mi - closed[0]) <= Z_MC * si
    # the sign: positive at L = 2, 3 and negative at L = 4, each resolved by the samples
    assert (ma > Z_MC * sa) if L < 4 else (ma < -Z_MC * sa and closed[2] < 0)


def test_family_point_is_a_minimum_at_three_loops_and_a_saddle_at_four():
    # n = 20: a minimum for L <= 3, a saddle from L = 4; at n = 40 already from L = 2 (MATH.md §14's table)
    rows = {(r["L"], r["n"]): r for r in ll.family_point_character([1, 2, 3, 4], [N, 40], D)}
    assert [rows[L, N]["minimum"] for L in (1, 2, 3, 4)] == [True, True, True, False]
    assert [rows[L, 40]["minimum"] for L in (1, 2)] == [True, False]
    assert all(r["identity"] > 0 and r["symmetric"] > 0 for r in rows.values())
    np.testing.assert_allclose([rows[L, N]["antisymmetric"] for L in (2, 3, 4)], [0.0799, 0.0491, -0.0878], atol=5e-5)


@pytest.mark.parametrize("L", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_degree_of_the_tied_blocks_family_in_b(L):
    # MATH.md §14 (corrected): deg_b f = 3^L - 1 - 2L for the tied blocks family at fixed a (4 at L = 2,
    # where 3^L - 1 = 8 was written); the (deg + 1)-th finite difference in b of the exact loss vanishes
    # and the deg-th does not
    m = ir.wishart_trace_moments(N, D, 3 ** L - 1)          # 2 deg_t p, MATH.md §10

    def f(b):
        p, _ = ir.family_polynomials([0.5] * L, [b] * L)
        c = [Fraction(0)] * (2 * len(p) - 1)
        for i, j in itertools.product(range(len(p)), repeat=2):
            c[i + j] += p[i] * p[j]
        return sum(ck * mk for ck, mk in zip(c, m))
    deg = 3 ** L - 1 - 2 * L
    values = [f(b) for b in range(deg + 2)]
    diff = lambda k: sum((-1) ** (k - j) * math.comb(k, j) * values[j] for j in range(k + 1))
    assert diff(deg + 1) == 0 and diff(deg) != 0


# ---------------------------------------------------------------------------------------------
# The located minima, their certificates, and the orbit
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lower_four():
    """The L = 4 minimum below the family point, descended from a*_4 I + 0.35 J_2 (two rotation blocks)."""
    return ll.tied_local_minimum(ir.optimal_tied_family(4, N, D, starts=1)[0] * np.eye(D)
                                 + 0.35 * ll.block_direction(D, 2), 4, N, D)


def test_four_loops_lower_minimum_is_certified(lower_four):
    m = lower_four
    assert m["is_minimum"] and m["grad_norm"] < 1e-11 and m["orbit_dim"] == 6
    assert m["reduced_eigenvalues"][0] > 0.12 and m["relative_to_family"] < -0.09
    assert abs(m["loss"] - 0.1478136179208) < 1e-12
    T, O = m["T"], m["O"]
    np.testing.assert_allclose(O @ T @ O.T, m["W"], atol=1e-12)
    np.testing.assert_allclose(np.diag(T), [0.69945, 0.72092, 0.72092, 0.72092, 0.72092], atol=1e-5)
    np.testing.assert_allclose([T[1, 2], T[3, 4]], [0.35389, 0.35389], atol=1e-5)
    # the orbit directions [K, W] are exact zeros of the Hessian there (a critical orbit)
    U = ll.rotation_orbit_tangent(m["W"])
    assert np.abs(U.T @ ll.tied_hessian(m["W"], 4, N, D) @ U).max() < 1e-10


def test_four_loops_lower_minimum_below_the_family_by_monte_carlo(lower_four):
    # independent of the polynomial: the paired (common S) Monte Carlo of f at the minimum with the
    # family point's exact loss as control variate, against the exact value
    rng = np.random.default_rng(4)
    a, _, f0 = ir.optimal_tied_family(4, N, D)
    W = lower_four["W"]
    S = ll.sample_whitened_covariances(rng, 20000, N, D)
    m, se, _ = ll.mc_loss(W, S, 4, control=(a * np.eye(D), f0))
    assert abs(m - ll.tied_population_loss(W, 4, N, D)) <= Z_MC * se and m < f0 - Z_MC * se


def test_orbit_and_normal_form():
    assert ll.rotation_orbit_tangent(0.7 * np.eye(D)).shape == (D * D, 0)
    rng = np.random.default_rng(5)
    # where a descent to the family point ends: a I plus rounding, still a point orbit
    assert ll.rotation_orbit_tangent(0.7 * np.eye(D) + 1e-13 * rng.standard_normal((D, D))).shape == (D * D, 0)
    W = rng.standard_normal((D, D))
    assert ll.rotation_orbit_tangent(W).shape[1] == D * (D - 1) // 2
    T, O, normal = ll.rotation_normal_form(W)
    assert not normal and np.allclose(O @ T @ O.T, W, atol=1e-12)
    # a normal W with one rotation block: the rotations of its 3-dim eigenspace and of the block commute
    R, _ = np.linalg.qr(rng.standard_normal((D, D)))
    Wn = R @ (0.7 * np.eye(D) + 0.3 * ll.block_direction(D, 1)) @ R.T
    assert ll.rotation_orbit_tangent(Wn).shape[1] == 10 - 3 - 1
    T, O, normal = ll.rotation_normal_form(Wn)
    assert normal and np.allclose(O @ T @ O.T, Wn, atol=1e-12) and np.allclose(O.T @ O, np.eye(D), atol=1e-12)
    np.testing.assert_allclose(T, 0.7 * np.eye(D) + 0.3 * np.roll(np.roll(ll.block_direction(D, 1), 3, 0), 3, 1),
                               atol=1e-12)


def test_whitening_maps_the_family_point_to_a_multiple_of_identity():
    Sigma, _ = ir.rotated_covariance(np.random.default_rng(6))
    Si = np.linalg.inv(Sigma)
    np.testing.assert_allclose(ll.whiten(0.7 * Si, Sigma), 0.7 * np.eye(D), atol=1e-12)
    A = np.random.default_rng(7).standard_normal((D, D))
    np.testing.assert_allclose(ll.unwhiten(ll.whiten(A, Sigma), Sigma), A, atol=1e-10)


def test_inputs_are_checked():
    with pytest.raises(ValueError, match="L must be <="):
        ll.tied_loss_polynomial(7, N, D)
    with pytest.raises(TypeError, match="L must be an integer"):
        ll.tied_family_hessian_eigenvalues(2.0, N, D)
    with pytest.raises(ValueError, match="shape"):
        ll.tied_population_loss(np.eye(4), 2, N, D)
    with pytest.raises(ValueError, match="finite"):
        ll.tied_loss_and_grad(np.full((D, D), np.nan), 2, N, D)
    with pytest.raises(ValueError, match="blocks"):
        ll.block_direction(D, 3)
    with pytest.raises(ValueError, match="positive definite"):
        ll.whiten(np.eye(2), -np.eye(2))


# ---------------------------------------------------------------------------------------------
# Slow: the full certificates
# ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_four_loops_minimum_monte_carlo_certificate():
    # 200000 samples of S: loss with control variate within Z_MC SE of the exact value and the Monte
    # Carlo reduced Hessian's smallest eigenvalue above 0 by Z_MC SE (the gradient is certified exactly:
    # its per-sample values are too heavy-tailed for their standard errors, mc_certificate)
    rng = np.random.default_rng(8)
    a, _, f0 = ir.optimal_tied_family(4, N, D)
    m = ll.tied_minima_from_family(4, N, D)[0]
    S = ll.sample_whitened_covariances(rng, 200000, N, D)
    c = ll.mc_certificate(m["W"], S, 4, control=(a * np.eye(D), f0))
    assert abs(c["loss"] - m["loss"]) <= Z_MC * c["loss_se"]
    assert m["grad_norm"] < 1e-11
    assert c["reduced_min"] > Z_MC * c["reduced_min_se"]


@pytest.mark.slow
def test_three_loops_second_minimum_and_its_saddle():
    found = ll.tied_minima_from_family(3, N, D)
    assert len(found) == 2 and found[0]["orbit_dim"] == 0                  # the family point, lowest
    second = found[1]
    assert second["orbit_dim"] == 6 and second["reduced_eigenvalues"][0] > 0.07
    assert 6.6e-4 < second["loss"] - found[0]["loss"] < 6.7e-4
    s = ll.tied_block_saddle(3, N, D, 1, 0.32)
    assert s["index"] == 1 and s["grad_norm"] < 1e-11
    assert found[0]["loss"] < second["loss"] < s["loss"] < found[0]["loss"] + 1e-3
