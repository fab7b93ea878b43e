"""Tests for icl_looped: the looped (weight-tied) models, the tied sparse loss beyond the scalar family,
and the gradient flow of one layer (MATH.md §14). Each quantity is checked against a computation that
shares no code with it: the exact polynomial f(W) against §10's family loss at W = a I, the L = 1
closed form and an exact Gauss-Hermite rule at small n, d; per_sample_loss against the transformer
itself; the Hessian eigenvalues against the polynomial's Hessian and a Monte Carlo over S; the located
minima by their exact gradient and reduced Hessian, and (slow) by Monte Carlo.

Tolerances, each with its reason:
    FD_VEC = 1e-8   relative, for a whole gradient vector against five-point central differences
                    at h = 1e-4: truncation (h^4/30) f^(5) ~ 3e-18 f^(5), rounding ~ 1.5 eps |f| / h
                    ~ 3e-12 |f|, and |f| / |grad| <= 100 here, so 1e-8 leaves two orders of margin
    EXACT  = 1e-12  relative: one exact quantity computed twice in float64 (rounding only)
    Z_MC   = 4      sampling: an estimate within 4 of its standard errors of the exact value
"""
import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
import scipy.optimize
from numpy.testing import assert_allclose

import icl_looped as lp
import icl_ref as ir
from test_icl_ref import assert_strict_caller_gets_the_same

FD_VEC = 1e-8
FD_H = 1e-4
EXACT = 1e-12
Z_MC = 4.0
N, D = 20, 5        # the paper's size ([A] §4.3)


def five_point(f, x, h=FD_H):
    """The gradient of f at the flat vector x by five-point central differences, entry by entry."""
    g = np.empty_like(x)
    for i in range(x.size):
        e = np.zeros_like(x)
        e[i] = h
        g[i] = (8 * (f(x + e) - f(x - e)) - (f(x + 2 * e) - f(x - 2 * e))) / (12 * h)
    return g


def problem(seed, B=40, d=3, n=6, noise_std=0.0):
    rng = np.random.default_rng(seed)
    Z, y = ir.sample_prompts(rng, B, n, ir.rotated_covariance(rng, (1.0, 0.5, 0.25)[:d])[0], noise_std=noise_std)
    return rng, Z, y


# ---------------------------------------------------------------------------------------------
# §14 Tied structures: the one layer applied L times, and the chain rule of the repetition
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("structure", ir.STRUCTURES)
def test_tied_model_is_one_layer_applied_L_times(structure):
    # the literal loop: feed the one-layer model's output back in, L times, with forward_literal
    rng, Z, y = problem(1)
    shapes = ir.structure_shapes(structure, 3, 3, 2 if structure == "full" else 1, tied=True)
    coords = {k: 0.3 * rng.standard_normal(s) for k, s in shapes.items()}
    P1, Q1 = ir.structure_to_PQ(structure, coords)
    Zl = Z
    for _ in range(3):
        Zl = ir.forward_literal(P1, Q1, Zl)
    P, Q = ir.structure_to_PQ(structure, coords, L=3)
    assert P.shape[0] == 3
    np.testing.assert_allclose(ir.forward(P, Q, Z), Zl, rtol=1e-10, atol=1e-12)   # three layers' rounding


@pytest.mark.parametrize("structure", ir.STRUCTURES)
def test_tied_gradient_matches_finite_differences(structure):
    rng, Z, y = problem(2)
    L, H = 3, (2 if structure == "full" else 1)
    shapes = ir.structure_shapes(structure, L, 3, H, tied=True)
    names, sizes = list(shapes), list(shapes.values())
    theta = 0.3 * rng.standard_normal(sum(int(np.prod(s)) for s in sizes))

    def loss(t):
        P, Q = ir.structure_to_PQ(structure, dict(zip(names, ir.unpack(t, sizes))), L=L)
        return ir.in_context_loss(P, Q, Z, y)

    P, Q = ir.structure_to_PQ(structure, dict(zip(names, ir.unpack(theta, sizes))), L=L)
    _, dP, dQ = ir.loss_and_grad(P, Q, Z, y)
    grad = ir.pack(list(ir.structure_grad(structure, dP, dQ, tied=True).values()))
    numeric = five_point(loss, theta)
    assert np.linalg.norm(grad - numeric) <= FD_VEC * np.linalg.norm(numeric)
    # the Jacobian's rows carry the same chain rule: 2 J^T r / B is that gradient
    r, J = ir.residuals_and_jacobian(P, Q, Z, y, structure=structure, tied=True)
    np.testing.assert_allclose(2 * J.T @ r / len(y), grad, rtol=1e-10, atol=1e-12)


def test_tied_inputs_are_checked():
    rng, Z, y = problem(3)
    with pytest.raises(TypeError, match="tied"):
        ir.structure_shapes("sparse", 2, 3, tied=1)
    with pytest.raises(ValueError, match="one layer"):
        ir.structure_to_PQ("sparse", {"A": np.zeros((2, 3, 3))}, L=2)
    P, Q = ir.sparse_params(rng.standard_normal((2, 3, 3)))
    with pytest.raises(ValueError, match="every layer equal"):
        ir.residuals_and_jacobian(P, Q, Z, y, structure="sparse", tied=True)


def test_tied_trainers_return_one_layer_and_agree():
    # L-BFGS and Gauss-Newton take different steps from the same start: the same tied minimum
    rng, Z, y = problem(4, B=400)
    lb = ir.train_lbfgs(Z, y, 2, "sparse", rng=np.random.default_rng(0), tied=True, gtol=1e-6)
    gn = ir.train_gauss_newton(Z, y, 2, "sparse", rng=np.random.default_rng(0), tied=True, gtol=1e-6)
    assert lb["success"] and gn["success"] and lb["tied"] and gn["fixed"] == 0
    assert lb["coords"]["A"].shape == (1, 3, 3) and lb["P"].shape == (2, 1, 4, 4)
    # each is within |grad| / lambda_min of the minimum; here |grad| <= 1e-6 and the Hessian's
    # smallest eigenvalue is 0.054 (five-point differences of the gradient): 2e-5 apart at most
    np.testing.assert_allclose(gn["coords"]["A"], lb["coords"]["A"], rtol=0, atol=4e-5)


def test_tied_blocks_on_noisy_labels_move_every_coordinate_and_both_trainers_agree():
    # the corners of the options: tied with the blocks structure, on labels with noise. Untied, B_{L-1}
    # never reaches the loss and Gauss-Newton holds it; tied, the one B acts through the first layer,
    # so nothing is held (fixed = 0), B moves from its start, and both trainers reach one minimum
    rng, Z, y = problem(5, B=400, noise_std=0.5)
    start = {"A": 0.1 * np.eye(3)[None], "B": 0.2 * np.eye(3)[None]}
    lb = ir.train_lbfgs(Z, y, 2, "blocks", init=start, tied=True, gtol=1e-6, maxcor=40)
    gn = ir.train_gauss_newton(Z, y, 2, "blocks", init=start, tied=True, gtol=1e-6)
    untied = ir.train_gauss_newton(Z, y, 2, "blocks", init={k: np.repeat(v, 2, axis=0) for k, v in start.items()})
    assert lb["success"] and gn["success"] and gn["fixed"] == 0 and untied["fixed"] == 9
    assert np.max(np.abs(gn["coords"]["B"] - start["B"])) > 1e-2
    # within |grad| / lambda_min of the minimum for each (1e-6 / ~0.01): 1e-4 apart at most
    np.testing.assert_allclose(gn["coords"]["B"], lb["coords"]["B"], rtol=0, atol=1e-4)
    np.testing.assert_allclose(gn["coords"]["A"], lb["coords"]["A"], rtol=0, atol=1e-4)
    assert gn["loss"] >= untied["loss"] - 1e-12                 # tying restricts the model


# ---------------------------------------------------------------------------------------------
# §14 The exact optimum of the tied families
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("L", [2])
def test_tied_sparse_optimum_matches_a_scalar_search_on_the_exact_loss(L):
    # the other side: Brent's method on family_population_loss (exact rationals, no Gauss rule,
    # no gradient); Brent brackets the minimiser to xtol = 1e-10, and where f is flat its rounding
    # (1e-16 f) moves the argmin by sqrt(1e-16 f / f'') ~ 1e-8: 1e-6 relative
    a, b, loss = lp.optimal_tied_family(L, 20, 5)
    res = scipy.optimize.minimize_scalar(lambda s: ir.family_population_loss(np.full(L, s), 20, 5),
                                         bracket=(0.1, 0.5, 1.5), tol=1e-10)
    assert b is None
    assert abs(a - res.x) <= 1e-6 * abs(res.x)
    assert abs(loss - res.fun) <= EXACT * res.fun


def test_tied_blocks_optimum_is_a_strict_minimum_of_the_exact_loss():
    # the other side: family_population_loss in exact rationals (no Gauss rule, no gradient code),
    # differentiated by five-point differences at h = 1e-4 in (a, b) (tied over both layers): the
    # descent stops at |grad| <= 1e-12 on the nodes; the stencil errs by rounding, ~1e-12 f / h,
    # and truncation (h^4/30) f^(5), f^(5) ~ 1e3 here (h = 1e-3 and 1e-4 agree to 2e-14): 1e-8
    a, b, loss = lp.optimal_tied_family(2, 20, 5, blocks=True)
    f = lambda v: ir.family_population_loss([v[0]] * 2, 20, 5, b=[v[1]] * 2)
    x, h = np.array([a, b]), 1e-4
    assert abs(f(x) - loss) <= EXACT * loss
    assert np.max(np.abs(five_point(f, x, h))) <= 1e-8
    E = h * np.eye(2)
    hess = [[(f(x + e + g) - f(x + e - g) - f(x - e + g) + f(x - e - g)) / (4 * h * h) for g in E] for e in E]
    assert np.all(np.linalg.eigvalsh(hess) > 0)


@pytest.mark.parametrize("blocks, Ls", [(False, [1, 2]), (True, [2])])
def test_tied_optimum_is_a_restriction_of_the_untied_family(blocks, Ls):
    # tying restricts the family, so the tied minimum can only be higher; one layer ties nothing
    for L in Ls:
        tied = lp.optimal_tied_family(L, 20, 5, blocks=blocks)[2]
        untied = ir.optimal_family_scalars(L, 20, 5, blocks=blocks, starts=4)[2]
        assert tied >= untied * (1 - EXACT)
        if L == 1:
            assert abs(tied - untied) <= EXACT * untied


def test_the_tied_optimum_at_large_n_is_found_relative_to_its_loss():
    # as n -> infinity S -> I and the best step tends to a = 1, the loss to 0 like n^-L: a stopping
    # test relative to the loss still finds it at n = 1e9 (an absolute one stopped at a = 0.93 with
    # loss 1e-17, where a = 1 gives 7e-24)
    a, _, loss = lp.optimal_tied_family(3, 10 ** 9, 5)
    assert abs(a - 1) <= 1e-6 and 0 < loss <= ir.family_population_loss([1.0, 1.0, 1.0], 10 ** 9, 5)


@pytest.mark.parametrize("blocks", [False, True])
def test_tied_optimum_with_label_noise_is_the_minimum_of_the_exact_noisy_loss(blocks):
    # with context label noise (and query noise) the tied family's loss changes; its optimum is the
    # minimum of icl_ref.family_population_loss with that noise_var at (a 1_L, b 1_L): no descent
    # from it lowers the exact loss (five-point differences of the exact rational loss, 1e-7 of the
    # loss: the optimiser's gradient tolerance plus truncation), and it differs from the noiseless one
    L, n, d, noise = 2, 10, 3, 0.5
    a, b, loss = lp.optimal_tied_family(L, n, d, blocks=blocks, noise_var=noise, starts=4)
    a0 = lp.optimal_tied_family(L, n, d, blocks=blocks, starts=4)[0]
    theta = np.array([a, b]) if blocks else np.array([a])

    def f(t):
        return ir.family_population_loss(np.full(L, t[0]), n, d, np.full(L, t[1]) if blocks else None,
                                         noise_var=noise)
    assert loss == pytest.approx(f(theta), rel=EXACT)
    assert np.max(np.abs(five_point(f, theta, h=1e-3))) <= 1e-7 * loss and abs(a - a0) > 1e-3


def test_tied_family_inputs_are_checked():
    with pytest.raises(TypeError, match="L"):
        lp.optimal_tied_family(2.0, 20, 5)
    with pytest.raises(ValueError, match="noise_var"):
        lp.optimal_tied_family(2, 20, 5, noise_var=-1.0)


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
    return float(np.prod(w[grid] / math.sqrt(2 * math.pi), axis=1) @ lp.per_sample_loss(W, S, L))


# ---------------------------------------------------------------------------------------------
# §14 The exact polynomial f(W)
# ---------------------------------------------------------------------------------------------

def test_word_expectation_is_isserlis_with_the_transposes_in_place():
    # E[S C S] = C + (C^T + tr(C) I) / n (MATH.md §8 for Sigma = I): with C = W and C = W^T the two
    # 1/n terms trade places, so a transpose slipped in the recursion's Y Z^T s term shows here
    n = 7
    assert lp.word_expectation(["asas"], n, 3) == {("aa",): 1, ("ab",): Fraction(1, n), ("a", "a"): Fraction(1, n)}
    assert lp.word_expectation(["asbs"], n, 3) == {("ab",): 1, ("aa",): Fraction(1, n), ("a", "a"): Fraction(1, n)}
    # words of S alone are the Wishart moments of MATH.md §9, products of traces included
    m = ir.wishart_trace_moments(n, 3, 5)
    for k in range(1, 6):
        assert lp.word_expectation(["s" * k], n, 3) == {(): m[k]}
    assert lp.word_expectation(["ss", "s"], n, 3) == {(): Fraction(ir._wishart_T(n, 3, (1, 2), {}), n ** 3)}


def test_word_expectation_reads_any_iterable_once_and_refuses_words_beyond_its_bound():
    n = 7
    assert lp.word_expectation(iter(["asas"]), n, 3) == lp.word_expectation(["asas"], n, 3)
    assert lp.word_expectation((w for w in ("ss", "s")), n, 3) == lp.word_expectation(["ss", "s"], n, 3)
    # at the bound, taken: the Wishart moment of MATH.md §9 (8 letters s) and a product of 24 traces of W
    assert lp.word_expectation(["s" * lp.MAX_WORD_S], n, 3) == {(): ir.wishart_trace_moments(n, 3, lp.MAX_WORD_S)[-1]}
    assert lp.word_expectation(["a"] * lp.MAX_WORD_LETTERS, n, 3) == {("a",) * lp.MAX_WORD_LETTERS: 1}
    for words in (["s" * (lp.MAX_WORD_S + 1)], ["as"] * (lp.MAX_WORD_S + 1), ["a" * (lp.MAX_WORD_LETTERS + 1)],
                  iter(["ab"] * lp.MAX_WORD_LETTERS)):
        with pytest.raises(ValueError, match="MAX_WORD_S, MAX_WORD_LETTERS"):
            lp.word_expectation(words, n, 3)
    with pytest.raises(TypeError, match="words must be a list"):
        lp.word_expectation(5, n, 3)


@pytest.mark.parametrize("L", [1, 2, 3, 4])
def test_loss_polynomial_is_the_family_loss_on_multiples_of_identity(L):
    # the other side: MATH.md §10's family loss, p(t) = (1 - a t)^L and exact trace moments; both exact rationals
    a = lp.optimal_tied_family(L, N, D, starts=1)[0]
    exact = lp.tied_population_loss(a * np.eye(D), L, N, D, exact=True)
    assert float(exact) == ir.family_population_loss(np.full(L, a), N, D)
    assert abs(lp.tied_population_loss(a * np.eye(D), L, N, D) - float(exact)) <= EXACT * float(exact)


def test_loss_polynomial_at_one_loop_is_the_quadratic():
    # L = 1: E ||I - W^T S||^2 = d - 2 tr W + (n + d + 1)/n ||W||_F^2 (E S^2 = (n + d + 1)/n I)
    rng = np.random.default_rng(0)
    W = rng.standard_normal((D, D))
    expected = D - 2 * np.trace(W) + (N + D + 1) / N * np.sum(W * W)
    assert abs(lp.tied_population_loss(W, 1, N, D) - expected) <= EXACT * expected


@pytest.mark.parametrize("n, d, L", [(2, 3, 3), (2, 2, 4), (1, 3, 4), (3, 2, 3)])
def test_loss_polynomial_equals_an_exact_gauss_hermite_rule(n, d, L):
    # for a non-normal W, against the rule over every entry of X: no Wishart moment, no word. At
    # (2, 3, 3) this W has f(W^T) 1e-3 above f(W), so a transpose slipped into the words is refused
    # (f(W) = f(W^T) for d = 2, where a reflection maps W to W^T, and seemingly at L = 2)
    rng = np.random.default_rng(20 if (n, d, L) == (2, 3, 3) else n + 10 * d + 100 * L)
    W = 0.5 * np.eye(d) + 0.5 * rng.standard_normal((d, d))
    rule = gauss_hermite_loss(W, L, n, d)
    assert abs(lp.tied_population_loss(W, L, n, d) - rule) <= EXACT * rule
    if (n, d, L) == (2, 3, 3):
        assert abs(lp.tied_population_loss(W.T, L, n, d) - rule) > 1e-6 * rule


def test_per_sample_loss_is_the_transformer_given_the_context():
    # prompts that share one context X (so one S) and differ in w* ~ N(0, I) and the query: the
    # transformer's mean squared error is ||(I - W^T S)^L||_F^2 (Lemma 1 with the transpose, MATH.md
    # MATH.md §7); with W in place of W^T it is off by many standard errors for this (non-normal) W
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
    assert abs(m - lp.per_sample_loss(W, S, L)[0]) <= Z_MC * se
    assert abs(m - lp.per_sample_loss(W.T, S, L)[0]) > Z_MC * se


@pytest.mark.parametrize("L", [2, 4])
def test_loss_polynomial_against_monte_carlo_at_the_papers_size(L):
    # a non-normal W at n = 20, d = 5, on 20000 samples of S with the family point's exact loss as a
    # control variate (common random numbers): within Z_MC standard errors
    rng = np.random.default_rng(2)
    a, _, f0 = lp.optimal_tied_family(L, N, D)
    W = a * np.eye(D) + 0.15 * rng.standard_normal((D, D))
    S = lp.sample_whitened_covariances(rng, 20000, N, D)
    m, se, c = lp.mc_loss(W, S, L, control=(a * np.eye(D), f0))
    assert c > 0.5 and abs(m - lp.tied_population_loss(W, L, N, D)) <= Z_MC * se


def test_gradient_is_the_derivative_of_the_loss_and_rotations_leave_the_loss():
    rng = np.random.default_rng(3)
    L = 3
    W = 0.7 * np.eye(D) + 0.2 * rng.standard_normal((D, D))
    f, g = lp.tied_loss_and_grad(W, L, N, D)
    numeric = five_point(lambda x: lp.tied_population_loss(x.reshape(D, D), L, N, D), W.ravel())
    assert np.linalg.norm(g.ravel() - numeric) <= FD_VEC * np.linalg.norm(numeric)
    O, _ = np.linalg.qr(rng.standard_normal((D, D)))
    f2, g2 = lp.tied_loss_and_grad(O @ W @ O.T, L, N, D)
    assert abs(f2 - f) <= EXACT * f and np.allclose(g2, O @ g @ O.T, rtol=0, atol=1e-12 * np.abs(g).max())
    # the per-sample gradient (a separate formula) averages to it: exact per S, so compare on the
    # same samples against five-point differences of the sample mean
    S = lp.sample_whitened_covariances(rng, 50, N, D)
    mean = lambda x: lp.per_sample_loss(x.reshape(D, D), S, L).mean()
    assert np.allclose(lp.per_sample_gradient(W, S, L).mean(axis=0).ravel(), five_point(mean, W.ravel()),
                       rtol=0, atol=FD_VEC * np.abs(five_point(mean, W.ravel())).max())


# ---------------------------------------------------------------------------------------------
# §14 The three Hessian eigenvalues at the family point
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("L, n, d", [(2, N, D), (3, N, D), (4, N, D), (3, 7, 3), (4, 40, 4)])
def test_family_hessian_eigenvalues_equal_the_polynomials_hessian(L, n, d):
    # the other side: the Hessian of the exact polynomial (complex steps of its gradient), which is
    # one scalar on each subspace: every Rayleigh quotient and every cross term checked
    a = lp.optimal_tied_family(L, n, d, starts=1)[0]
    closed = lp.tied_family_hessian_eigenvalues(L, n, d, a)
    H = lp.tied_hessian(a * np.eye(d), L, n, d)
    scale = np.abs(H).max()
    for U, value in zip(lp.subspace_bases(d), closed):
        np.testing.assert_allclose(U.T @ H @ U, value * np.eye(U.shape[1]), rtol=0, atol=1e-10 * scale)
    ident, sym, anti = lp.subspace_bases(d)
    assert np.abs(sym.T @ H @ anti).max() <= 1e-10 * scale and np.abs(ident.T @ H @ anti).max() <= 1e-10 * scale


@pytest.mark.parametrize("L, n", [(2, N), (4, N), (4, 1000)])
def test_tied_family_step_is_the_root_of_the_exact_derivative(L, n):
    # the other side: the family loss itself (exact rationals, icl_ref's own polynomial code) is higher
    # at a* +- 1e-6 relative, and the float optimiser agrees to its own 1e-8
    a = lp.tied_family_step(L, n, D)
    f = lambda x: ir.family_population_loss(np.full(L, float(x)), n, D)
    assert f(a * (1 - Fraction(1, 10 ** 6))) > f(a) < f(a * (1 + Fraction(1, 10 ** 6)))
    assert abs(float(a) / lp.optimal_tied_family(L, n, D)[0] - 1) < 1e-8


@pytest.mark.parametrize("L", [2, 3, 4])
def test_identity_eigenvalue_is_the_family_curvature(L):
    # f_L(a) = sum_k C(2L, k) (-a)^k m_k (MATH.md §14), so f_L''(a) / d in exact rationals
    a = lp.optimal_tied_family(L, N, D, starts=1)[0]
    m, A = ir.wishart_trace_moments(N, D, 2 * L), Fraction(a)
    second = sum(math.comb(2 * L, k) * (-1) ** k * k * (k - 1) * A ** (k - 2) * m[k] for k in range(2, 2 * L + 1))
    assert lp.tied_family_hessian_eigenvalues(L, N, D, a, exact=True)[0] == second / D


@pytest.mark.parametrize("L", [2, 3, 4])
def test_antisymmetric_eigenvalue_matches_monte_carlo(L):
    # the acceptance check: the closed form against the mean over 10000 samples of S of the exact
    # per-sample second derivatives along an orthonormal basis of antisymmetric directions (SE 0.002 at
    # L = 2, 0.005 at L = 4: a factor 2 or a sign slipped in the closed form is 8 or more SE off)
    rng = np.random.default_rng(10 + L)
    a = lp.optimal_tied_family(L, N, D, starts=1)[0]
    closed = lp.tied_family_hessian_eigenvalues(L, N, D, a)
    S = lp.sample_whitened_covariances(rng, 10000, N, D)
    (mi, si), (ms, ss), (ma, sa) = lp.mc_family_hessian_eigenvalues(L, S, a)
    assert abs(ma - closed[2]) <= Z_MC * sa
    assert abs(ms - closed[1]) <= Z_MC * ss and abs(mi - closed[0]) <= Z_MC * si
    # the sign: positive at L = 2, 3 and negative at L = 4, each resolved by the samples
    assert (ma > Z_MC * sa) if L < 4 else (ma < -Z_MC * sa and closed[2] < 0)


def test_family_point_is_a_minimum_at_three_loops_and_a_saddle_at_four():
    # n = 20: a minimum for L <= 3, a saddle from L = 4; at n = 40 already from L = 2 (MATH.md §14's table)
    rows = {(r["L"], r["n"]): r for r in lp.family_point_character([1, 2, 3, 4], [N, 40], D)}
    assert [rows[L, N]["minimum"] for L in (1, 2, 3, 4)] == [True, True, True, False]
    assert [rows[L, 40]["minimum"] for L in (1, 2)] == [True, False]
    assert all(r["identity"] > 0 and r["symmetric"] > 0 for r in rows.values())
    np.testing.assert_allclose([rows[L, N]["antisymmetric"] for L in (2, 3, 4)], [0.0799, 0.0491, -0.0878], atol=5e-5)


@pytest.mark.parametrize("L, n, d, a", [(1, N, D, None), (2, N, D, None), (3, N, D, None), (4, N, D, None),
                                        (3, 7, 3, None), (4, N, D, 1.5)])
def test_antisymmetric_parts_sum_to_the_eigenvalue_and_have_their_signs(L, n, d, a):
    # the other side: tied_family_hessian_eigenvalues' g_- (the pair (p, q) not summed with (q, p)), a
    # different polynomial: the two agree exactly only if u^L h2(u, v) + v^L h2(v, u) = L h_{2L-1} - h_L^2
    # (MATH.md §14). The signs: stretch > 0, twist < 0 from L = 2 (0 at L = 1), also at a = 1.5, where
    # 1 - a l < 0 over most of S's spectrum (the case the earlier text thought could turn the twist positive)
    stretch, twist = lp.antisymmetric_curvature_parts(L, n, d, a, exact=True)
    kw = {} if a is None else dict(a=a)
    assert stretch + twist == lp.tied_family_hessian_eigenvalues(L, n, d, exact=True, **kw)[2]
    assert stretch > 0 and (twist == 0 if L == 1 else twist < 0)


def test_antisymmetric_parts_at_the_papers_size_are_the_tables():
    # MATH.md §14's table at n = 20, d = 5 (six digits quoted: 5e-7)
    parts = [lp.antisymmetric_curvature_parts(L, N, D) for L in (2, 3, 4)]
    np.testing.assert_allclose(parts, [[0.775191, -0.695277], [0.550503, -0.501433], [0.322770, -0.410589]], atol=5e-7)


def complete_sum(m, u, v):
    """h_m(u, v) = sum_{j<m} u^j v^{m-1-j}, written here from its definition."""
    return sum(u ** j * v ** (m - 1 - j) for j in range(m))


@pytest.mark.parametrize("L", [2, 3, 4])
def test_twist_bracket_is_nonnegative_and_the_parts_are_the_per_sample_curvature(L):
    # MATH.md §14's identity and bound on 20000 random (u, v) in [-3, 3]^2 (where 1 - a l lies for S's
    # spectrum): u^L h2(u, v) + v^L h2(v, u) = L h_{2L-1} - h_L^2 >= L (L-1) h_{2L-1} / (2L-1) >= 0, with
    # h2(u, v) = sum_j (L-1-j) u^{L-2-j} v^j written out (relative 1e-12: float64 sums of <= 4L terms of
    # size <= 3^{2L-2}, cancelling to >= 2e-3 of it on this box)
    rng = np.random.default_rng(30 + L)
    u, v = rng.uniform(-3, 3, (2, 20000))
    h2 = lambda x, y: sum((L - 1 - j) * x ** (L - 2 - j) * y ** j for j in range(L - 1))
    lhs = u ** L * h2(u, v) + v ** L * h2(v, u)
    bracket = L * complete_sum(2 * L - 1, u, v) - complete_sum(L, u, v) ** 2
    scale = (u * u + v * v) ** (L - 1)
    assert np.max(np.abs(lhs - bracket) / scale) <= 1e-12
    assert np.all(bracket >= L * (L - 1) / (2 * L - 1) * complete_sum(2 * L - 1, u, v) - 1e-12 * scale)
    # per sample of S: the parts in S's eigenbasis (this test's sums) add up to the mean second derivative
    # over an orthonormal antisymmetric basis (icl_looped's power recursion, no eigenvalues), exactly up to
    # rounding (the trace of the per-sample Hessian on an invariant subspace is basis-free); the twist is <= 0
    # on every sample; and the sample means are within Z_MC SE of the exact parts
    a = lp.optimal_tied_family(L, N, D, starts=1)[0]
    S = lp.sample_whitened_covariances(rng, 4000, N, D)
    lam = np.linalg.eigvalsh(S)
    mu = 1 - a * lam
    p, q = np.where(~np.eye(D, dtype=bool))
    hp = complete_sum(L, mu[:, p], mu[:, q])
    c = 2 / (D * (D - 1))
    stretch = c * np.sum(lam[:, p] ** 2 * hp ** 2, axis=1)
    twist = -c * np.sum(lam[:, p] * lam[:, q] * (L * complete_sum(2 * L - 1, mu[:, p], mu[:, q]) - hp ** 2), axis=1)
    anti = lp.subspace_bases(D)[2]
    second = sum(lp.per_sample_second_derivative(a * np.eye(D), S, L, e.reshape(D, D)) for e in anti.T) / anti.shape[1]
    np.testing.assert_allclose(stretch + twist, second, rtol=0, atol=1e-9 * np.max(np.abs(stretch)))
    assert np.all(twist <= 0)
    exact = lp.antisymmetric_curvature_parts(L, N, D, a)
    for values, value in zip((stretch, twist), exact):
        assert abs(values.mean() - value) <= Z_MC * values.std(ddof=1) / math.sqrt(values.size)


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
# §14 The located minima, their certificates, and the orbit
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lower_four():
    """The L = 4 minimum below the family point, descended from a*_4 I + 0.35 J_2 (two rotation blocks)."""
    return lp.tied_local_minimum(lp.optimal_tied_family(4, N, D, starts=1)[0] * np.eye(D)
                                 + 0.35 * lp.block_direction(D, 2), 4, N, D)


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
    U = lp.rotation_orbit_tangent(m["W"])
    assert np.abs(U.T @ lp.tied_hessian(m["W"], 4, N, D) @ U).max() < 1e-10


def test_four_loops_lower_minimum_below_the_family_by_monte_carlo(lower_four):
    # independent of the polynomial: the paired (common S) Monte Carlo of f at the minimum with the
    # family point's exact loss as control variate, against the exact value
    rng = np.random.default_rng(4)
    a, _, f0 = lp.optimal_tied_family(4, N, D)
    W = lower_four["W"]
    S = lp.sample_whitened_covariances(rng, 20000, N, D)
    m, se, _ = lp.mc_loss(W, S, 4, control=(a * np.eye(D), f0))
    assert abs(m - lp.tied_population_loss(W, 4, N, D)) <= Z_MC * se and m < f0 - Z_MC * se


@pytest.mark.parametrize("L", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_descent_from_a_random_tilt_of_the_family_point(L):
    # a start a*_L I + 0.05 G / |G| off every rotation subgroup's fixed points: at L = 2 (a strict minimum,
    # h_anti = +0.080) the descent returns to the family point; at L = 4 (a saddle) it reaches the certified
    # minimum of the block starts (lower_four), 9.46% lower, whose loss it matches to rounding (1e-12)
    m = lp.tied_descent_from_family(L, N, D, np.random.default_rng(40 + L))
    assert m["is_minimum"] and m["grad_norm"] < 1e-11
    # the start: 0.05 away from a*_L I, with a full orbit (no rotation fixes it; a I + eps K with K
    # antisymmetric would have 8, the rotations e^{tK} fixing it). 1e-8: the start's a and family_a come
    # from two float searches, each ~1e-9 relative in a (optimal_tied_family), times |I|_F = sqrt(5)
    tilt = m["start"] - m["family_a"] * np.eye(D)
    assert abs(np.linalg.norm(tilt) - 0.05) < 1e-8 and lp.rotation_orbit_tangent(m["start"]).shape[1] == D * (D - 1) // 2
    if L == 2:
        assert m["orbit_dim"] == 0 and abs(m["relative_to_family"]) < 1e-12
        np.testing.assert_allclose(m["W"], m["family_a"] * np.eye(D), rtol=0, atol=1e-9)
    else:
        assert m["orbit_dim"] == 6 and abs(m["loss"] - 0.1478136179208) < 1e-12
        # paired per-sample differences on common S (no control coefficient): below the family by > Z_MC SE
        S = lp.sample_whitened_covariances(np.random.default_rng(41), 20000, N, D)
        diff = lp.per_sample_loss(m["W"], S, L) - lp.per_sample_loss(m["family_a"] * np.eye(D), S, L)
        se = diff.std(ddof=1) / math.sqrt(diff.size)
        assert diff.mean() < -Z_MC * se and abs(diff.mean() - (m["loss"] - m["family_loss"])) <= Z_MC * se


def test_certificate_needs_a_critical_point_relative_to_the_loss():
    # the reduced Hessian's sign alone certified points far from critical. At
    # 1e20 I, L-BFGS-B does not move (f ~ 2.6e78, |grad| ~ 3.7e59, decrement ~ 0.7 f); at 1e100 I, f overflows
    m = lp.tied_local_minimum(1e20 * np.eye(2), 2, 5, 2)
    assert not m["is_minimum"] and m["newton_decrement"] > 1e-6 * m["loss"]
    with pytest.raises(ValueError, match=r"overflowed at \|\|W\|\|_F = 1.41e\+100"):
        lp.tied_local_minimum(1e100 * np.eye(2), 2, 5, 2)
    # n = 2^53: f's terms (O(1)) cancel to ~1e-31, float64 cannot resolve it, and the end point
    # (f ~ 0.013, |grad| ~ 0.13) was returned as certified; n = 1e9: f ~ 1.6e-15, 33x the family's
    # 4.6e-17 (rounding of the terms), certified. Now neither is; at n = 1e6 the minimum is
    # certified, its decrement (~1e-25) far below 1e-6 f (~4e-17)
    assert lp.tied_minima_from_family(2, 10 ** 9, 2) == []
    with pytest.raises(ValueError, match="n must be <= 1e\\+14 for the family descent"):    # H5: refused since
        lp.tied_minima_from_family(2, 2 ** 53, 2)
    ms = lp.tied_minima_from_family(2, 10 ** 6, 2)
    assert len(ms) == 1 and ms[0]["newton_decrement"] <= 1e-6 * ms[0]["loss"] and ms[0]["relative_to_family"] < 0
    # a genuine minimum still passes: decrement ~1e-31 against f ~ 0.49
    assert lp.tied_local_minimum(0.5 * np.eye(2), 2, 5, 2)["is_minimum"]
    for bad, err in [(-1, ValueError), (True, TypeError), (2.0, TypeError), (10 ** 6, ValueError)]:
        with pytest.raises(err, match="newton_steps"):
            lp.tied_local_minimum(np.eye(2), 2, 5, 2, newton_steps=bad)
    for bad, err in [(math.nan, ValueError), (0.0, ValueError), (-1e-8, ValueError), (math.inf, ValueError),
                     ("x", TypeError)]:
        for f in (lp.rotation_orbit_tangent, lp.orbit_complement, lp.rotation_normal_form):
            with pytest.raises(err, match="rtol"):
                f(np.eye(2), rtol=bad)


def test_tied_loss_overflow_is_refused_by_name():
    # f(1e200 I) came out NaN (inf - inf among the polynomial's terms), silently
    with pytest.raises(ValueError, match="overflowed at"):
        lp.tied_population_loss(1e200 * np.eye(2), 2, 5, 2)
    f = lp.tied_population_loss(0.5 * np.eye(2), 2, 5, 2)
    assert f == pytest.approx(float(lp.tied_population_loss(0.5 * np.eye(2), 2, 5, 2, exact=True)), rel=1e-13, abs=0)


def test_the_tied_loss_in_float64_is_right_to_its_promise_or_refused():
    # f's terms cancel to ~n^-L near the minimum: at W = I, L = 2 the float was 6.2e-15 for an exact
    # 4.6e-15 at n = 1e8 and 4.4e-16 for 5.7e-31 at n = 2^53. Where float64 resolves f it is within the
    # promised 1e-6 relative of the exact rational; where it cannot, a ValueError points to exact=True
    for L, n in ((2, 10 ** 4), (3, 100), (4, 20), (2, 10 ** 8), (2, 2 ** 53), (4, 10 ** 6)):
        exact = float(lp.tied_population_loss(np.eye(2), L, n, 2, exact=True))
        try:
            f = lp.tied_population_loss(np.eye(2), L, n, 2)
        except ValueError as e:
            assert "use exact=True" in str(e) and n > 10 ** 4, (L, n)
            continue
        assert f == pytest.approx(exact, rel=1e-6, abs=0), (L, n)
    with pytest.raises(ValueError, match="does not resolve f to 1e-6 relative"):
        lp.tied_population_loss(np.eye(2), 2, 10 ** 8, 2)
    with pytest.raises(TypeError, match="exact must be True or False"):
        lp.tied_population_loss(np.eye(2), 2, 5, 2, exact="no")      # "no" is not True


def test_orbit_and_normal_form():
    assert lp.rotation_orbit_tangent(0.7 * np.eye(D)).shape == (D * D, 0)
    rng = np.random.default_rng(5)
    # where a descent to the family point ends: a I plus rounding, still a point orbit
    assert lp.rotation_orbit_tangent(0.7 * np.eye(D) + 1e-13 * rng.standard_normal((D, D))).shape == (D * D, 0)
    W = rng.standard_normal((D, D))
    assert lp.rotation_orbit_tangent(W).shape[1] == D * (D - 1) // 2
    T, O, normal = lp.rotation_normal_form(W)
    assert not normal and np.allclose(O @ T @ O.T, W, atol=1e-12)
    # a normal W with one rotation block: the rotations of its 3-dim eigenspace and of the block commute
    R, _ = np.linalg.qr(rng.standard_normal((D, D)))
    Wn = R @ (0.7 * np.eye(D) + 0.3 * lp.block_direction(D, 1)) @ R.T
    assert lp.rotation_orbit_tangent(Wn).shape[1] == 10 - 3 - 1
    T, O, normal = lp.rotation_normal_form(Wn)
    assert normal and np.allclose(O @ T @ O.T, Wn, atol=1e-12) and np.allclose(O.T @ O, np.eye(D), atol=1e-12)
    np.testing.assert_allclose(T, 0.7 * np.eye(D) + 0.3 * np.roll(np.roll(lp.block_direction(D, 1), 3, 0), 3, 1),
                               atol=1e-12)


def test_whitening_maps_the_family_point_to_a_multiple_of_identity():
    Sigma, _ = ir.rotated_covariance(np.random.default_rng(6))
    Si = np.linalg.inv(Sigma)
    np.testing.assert_allclose(lp.whiten(0.7 * Si, Sigma), 0.7 * np.eye(D), atol=1e-12)
    A = np.random.default_rng(7).standard_normal((D, D))
    np.testing.assert_allclose(lp.unwhiten(lp.whiten(A, Sigma), Sigma), A, atol=1e-10)


def test_inputs_are_checked():
    with pytest.raises(ValueError, match="L must be <="):
        lp.tied_loss_polynomial(7, N, D)
    with pytest.raises(TypeError, match="L must be an integer"):
        lp.tied_family_hessian_eigenvalues(2.0, N, D)
    with pytest.raises(ValueError, match="shape"):
        lp.tied_population_loss(np.eye(4), 2, N, D)
    with pytest.raises(ValueError, match="finite"):
        lp.tied_loss_and_grad(np.full((D, D), np.nan), 2, N, D)
    with pytest.raises(ValueError, match="blocks"):
        lp.block_direction(D, 3)
    with pytest.raises(ValueError, match="d must be >= 2"):
        lp.antisymmetric_curvature_parts(2, N, 1)
    # at a = 1e300 the curvatures are of order a^(2L-2): exact Fractions, but no float64 (an OverflowError)
    with pytest.raises(ValueError, match="overflow float64"):
        lp.tied_family_hessian_eigenvalues(3, N, D, a=1e300)
    with pytest.raises(ValueError, match="overflow float64"):
        lp.antisymmetric_curvature_parts(3, N, D, a=1e300)
    with pytest.raises(TypeError, match="exact"):
        lp.tied_family_hessian_eigenvalues(2, N, D, exact="no")
    with pytest.raises(TypeError, match="exact"):
        lp.antisymmetric_curvature_parts(2, N, D, exact=1)
    # f grows like |W|^(2L): at 1e150 I it and its gradient were NaN and the Hessian all NaN, with warnings
    with pytest.raises(ValueError, match="not finite: float64 overflowed"):
        lp.tied_loss_and_grad(1e150 * np.eye(D), 2, N, D)
    with pytest.raises(ValueError, match="not finite: float64 overflowed"):
        lp.tied_hessian(1e150 * np.eye(D), 2, N, D)
    with pytest.raises(TypeError, match="Generator"):
        lp.tied_descent_from_family(2, N, D, 0)
    with pytest.raises(ValueError, match="eps must be > 0"):
        lp.tied_descent_from_family(2, N, D, np.random.default_rng(0), eps=0.0)
    with pytest.raises(ValueError, match="positive definite"):
        lp.whiten(np.eye(2), -np.eye(2))
    # diag(1e300, 1e-300) is positive definite, but its eigenvalues span more than float64 resolves:
    # said so, not called "not positive definite"
    with pytest.raises(ValueError, match="Sigma's condition number is beyond float64"):
        lp.whiten(np.eye(2), np.diag([1e300, 1e-300]))
    with pytest.raises(ValueError, match="must be symmetric$"):
        lp.whiten(np.eye(2), [[1.0, 0.5], [0.0, 1.0]])
    # a time at which LSODA's steps fail ("Unexpected istate in LSODA") is refused by name, before work
    with pytest.raises(ValueError, match="t must be <= 1e\\+20"):
        lp.one_layer_gradient_flow(np.eye(2), 20, 0.1, [0.0, 1e300])


# ---------------------------------------------------------------------------------------------
# §14 Slow: the full certificates
# ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_four_loops_minimum_monte_carlo_certificate():
    # 200000 samples of S: loss with control variate within Z_MC SE of the exact value and the Monte
    # Carlo reduced Hessian's smallest eigenvalue above 0 by Z_MC SE (the gradient is certified exactly:
    # its per-sample values are too heavy-tailed for their standard errors, mc_certificate)
    rng = np.random.default_rng(8)
    a, _, f0 = lp.optimal_tied_family(4, N, D)
    m = lp.tied_minima_from_family(4, N, D)[0]
    S = lp.sample_whitened_covariances(rng, 200000, N, D)
    c = lp.mc_certificate(m["W"], S, 4, control=(a * np.eye(D), f0))
    assert abs(c["loss"] - m["loss"]) <= Z_MC * c["loss_se"]
    assert m["grad_norm"] < 1e-11
    assert c["reduced_min"] > Z_MC * c["reduced_min_se"]


@pytest.mark.slow
def test_three_loops_second_minimum_and_its_saddle():
    found = lp.tied_minima_from_family(3, N, D)
    assert len(found) == 2 and found[0]["orbit_dim"] == 0                  # the family point, lowest
    second = found[1]
    assert second["orbit_dim"] == 6 and second["reduced_eigenvalues"][0] > 0.07
    assert 6.6e-4 < second["loss"] - found[0]["loss"] < 6.7e-4
    s = lp.tied_block_saddle(3, N, D, 1, 0.32)
    assert s["index"] == 1 and s["grad_norm"] < 1e-11
    assert found[0]["loss"] < second["loss"] < s["loss"] < found[0]["loss"] + 1e-3


# ---------------------------------------------------------------------------------------------
# §14 One layer's gradient flow from Zhang, Frei and Bartlett's initialisation
# ---------------------------------------------------------------------------------------------

def zfb_point(u, U):
    """P = u e_d e_d^T, Q = -[[U, 0], [0, 0]] as (1, 1, D, D) arrays, built by hand."""
    d = U.shape[0]
    P, Q = np.zeros((2, 1, 1, d + 1, d + 1))
    P[0, 0, d, d] = u
    Q[0, 0, :d, :d] = -U
    return P, Q


def test_one_layer_population_gradient_matches_finite_differences_of_the_full_layer_loss():
    # full_layer_population_loss (Gauss-Hermite over w*, any P, Q) is a quartic in (P, Q), on which
    # the five-point stencil is exact: only rounding (~1e-12 relative) separates the two sides.
    # Every other entry of P, Q has zero gradient: the flow never leaves the (u, U) slice.
    rng = np.random.default_rng(5)
    Sigma = ir.rotated_covariance(rng, (1.0, 0.4))[0]
    Sigma_w = ir.rotated_covariance(rng, (1.5, 0.7))[0]
    u, U = 0.8, rng.standard_normal((2, 2))
    loss, du, dU = lp.one_layer_population_grad(u, U, Sigma, 7, Sigma_w)
    P, Q = zfb_point(u, U)

    def full(theta):
        return ir.full_layer_population_loss(*theta.reshape(2, 1, 1, 3, 3), Sigma, 7, Sigma_w)

    numeric = five_point(full, np.r_[P.ravel(), Q.ravel()]).reshape(2, 3, 3)
    expected = np.zeros((2, 3, 3))
    expected[0, 2, 2], expected[1, :2, :2] = du, -dU
    assert np.linalg.norm(numeric - expected) <= FD_VEC * np.linalg.norm(expected)
    assert abs(loss - ir.full_layer_population_loss(P, Q, Sigma, 7, Sigma_w)) <= EXACT * loss


@pytest.mark.parametrize("inside", [True, False])
def test_gradient_flow_ends_at_gamma_star_and_keeps_its_invariant(inside):
    # one start below the initial scale of [Z] Theorem 4.1 and one at three times it: both reach
    # Gamma* (here; the theorem promises only the first). LSODA at rtol 1e-12 and t = 400, where
    # the slowest mode has decayed by e^-60: 1e-8 relative is what the integrator can hold
    rng = np.random.default_rng(6)
    Sigma = ir.rotated_covariance(rng, (1.0, 0.5))[0]
    G_star = ir.gamma_star(Sigma, 10)
    # their bound sqrt(2 / (sqrt(d) |Gamma|_2)), Gamma = (1 + 1/n) Sigma + (tr Sigma / n) I = Gamma*^-1
    bound = np.sqrt(2 / (np.sqrt(2) * np.linalg.norm(1.1 * Sigma + np.trace(Sigma) / 10 * np.eye(2), 2)))
    sigma = 0.5 * bound if inside else 3 * bound
    flow = lp.one_layer_gradient_flow(Sigma, 10, sigma, np.linspace(0, 400, 81), Theta=rng.standard_normal((2, 2)))
    assert abs(flow["sigma_bound"] - bound) <= EXACT * bound
    assert np.linalg.norm(flow["Gamma"][-1] - G_star) <= 1e-8 * np.linalg.norm(G_star)
    # BDF steps do not conserve u^2 - |U|^2: it drifts by the accumulated local error, rtol 1e-12 per
    # step over ~3e3 evaluations on a state of size ~|Gamma*|: 1e-8 |Gamma*| bounds it (measured 1e-10)
    assert np.max(np.abs(flow["invariant"])) <= 1e-8 * np.linalg.norm(G_star)
    assert np.all(np.diff(flow["loss"]) <= 1e-12)                        # a gradient flow never climbs
    assert abs(flow["loss"][-1] - ir.single_layer_population_loss(G_star, Sigma, 10)) <= EXACT


def test_gradient_flow_inputs_are_checked():
    Sigma = np.eye(2)
    with pytest.raises(ValueError, match="sigma"):
        lp.one_layer_gradient_flow(Sigma, 10, 0.0, [0.0, 1.0])
    with pytest.raises(ValueError, match="t must"):
        lp.one_layer_gradient_flow(Sigma, 10, 0.1, [1.0, 0.5])
    with pytest.raises(ValueError, match="Theta"):
        lp.one_layer_gradient_flow(Sigma, 10, 0.1, [1.0], Theta=np.zeros((2, 2)))
    with pytest.raises(ValueError, match="U must"):
        lp.one_layer_population_grad(1.0, np.eye(3), Sigma, 10)
    with pytest.raises(TypeError, match="u must"):
        lp.one_layer_population_grad("1", np.eye(2), Sigma, 10)
    for rtol, error in ((float("nan"), ValueError), (0.0, ValueError), (1e-20, ValueError), ("1e-9", TypeError),
                        (None, TypeError), (True, TypeError)):
        with pytest.raises(error, match="rtol"):                 # NaN or 0 would stall the solver
            lp.one_layer_gradient_flow(Sigma, 10, 0.1, [0.0, 1.0], rtol=rtol)


def test_the_flows_cost_stops_growing_once_it_has_converged():
    # the flow is stiff (rates from the spread of K and Sigma): an explicit method's steps stay at
    # its stability limit forever, an implicit one's grow once the state rests. Up to t = 1e12 the
    # evaluations stay below 1.5 times those to t = 1e3, and the end state is Gamma* (1e-10:
    # the converged state to the solver's rtol)
    rng = np.random.default_rng(61)
    Sigma = ir.rotated_covariance(rng)[0]
    G_star = ir.gamma_star(Sigma, 20)
    runs = {T: lp.one_layer_gradient_flow(Sigma, 20, 0.1, np.geomspace(1e-2, T, 20)) for T in (1e3, 1e6, 1e12)}
    assert max(r["nfev"] for r in runs.values()) <= 1.5 * runs[1e3]["nfev"], {T: r["nfev"] for T, r in runs.items()}
    assert np.max(np.abs(runs[1e12]["Gamma"][-1] - G_star)) <= 1e-10 * np.max(np.abs(G_star))


def test_one_layer_loss_and_flow_are_right_at_any_scale_of_sigma_or_say_they_cannot_be():
    # the loss's O(1) terms, products of entries of c S, underflowed at
    # c = 1e-170 (-1.06e-170 for +1.22e-170) and overflowed to NaN at 1e160. Now icl_ref's sum of
    # squares: L(Gamma*(c S); c S) = c L(Gamma*(S); S) in the mathematics, to 1e-12 (O(100) roundings);
    # the gradient dU ~ c^2 leaves float64's normal range beyond c ~ 1e+-154 and is refused by name
    rng = np.random.default_rng(135)
    S, _ = ir.rotated_covariance(rng, [0.5, 1.0, 2.0])
    unit, du1, dU1 = lp.one_layer_population_grad(1.0, ir.gamma_star(S, 7), S, 7)
    for c in (1e-150, 1e150):
        loss, du, dU = lp.one_layer_population_grad(1.0, ir.gamma_star(c * S, 7), c * S, 7)
        assert loss > 0 and abs(loss / c - unit) <= 1e-12 * unit, c
        U = np.diag([1.0, 2.0, 3.0]) / c                              # Gamma = U: du ~ c, dU ~ c^2 (1 at c = 1)
        _, du, dU = lp.one_layer_population_grad(1.0, U, c * S, 7)
        _, du1, dU1 = lp.one_layer_population_grad(1.0, U * c, S, 7)
        assert abs(du / c - du1) <= 1e-12 * abs(du1) and np.max(np.abs(dU / c ** 2 - dU1)) <= 1e-12 * np.max(np.abs(dU1))
    for c in (1e-170, 1e160):
        with pytest.raises(ValueError, match="underflows below its normal range: max \\|Sigma\\| = 1.53e"):
            lp.one_layer_population_grad(1.0, ir.gamma_star(c * S, 7), c * S, 7)
    # the flow is scale-free too: (u, U) sqrt(c) follows the unit flow in the time c^2 t (1e-9: the
    # solver's rtol 1e-12 over ~1.5e3 steps, as in the other flow tests); a start 1e24 times the rest
    # scale (sigma = 0.1 at c = 1e50, which ran > 40 s) is refused, not integrated
    flow = lp.one_layer_gradient_flow(S, 7, 0.1, [0.0, 1.0, 10.0])
    for c in (1e-50, 1e50):
        scaled = lp.one_layer_gradient_flow(c * S, 7, 0.1 / math.sqrt(c), np.array([0.0, 1.0, 10.0]) / c ** 2)
        assert_allclose(scaled["Gamma"] * c, flow["Gamma"], rtol=1e-9, atol=1e-12)
        assert_allclose(scaled["loss"] / c, flow["loss"], rtol=1e-9)
    with pytest.raises(ValueError, match="times the rest scale"):
        lp.one_layer_gradient_flow(1e50 * S, 7, 0.1, [0.0, 1.0])


def test_the_flow_from_a_tiny_or_huge_theta_is_the_flow_from_its_direction():
    # Theta enters only through Theta Theta^T / |Theta Theta^T|: a scale of 1e-200 or 1e200 (whose
    # square under- or overflows) gives the unit-scale flow, rounding aside
    Sigma = np.diag([1.0, 0.5])
    Theta = np.array([[1.0, 0.3], [-0.2, 0.7]])
    unit = lp.one_layer_gradient_flow(Sigma, 10, 0.2, [0.0, 1.0, 10.0], Theta=Theta)
    for c in (1e-200, 1e200):
        scaled = lp.one_layer_gradient_flow(Sigma, 10, 0.2, [0.0, 1.0, 10.0], Theta=c * Theta)
        assert_allclose(scaled["Gamma"], unit["Gamma"], rtol=1e-9, atol=1e-12)


def gd_on_batches(Sigma, n, sigma, eta, steps, R, B, seed, engine=None):
    """Gradient descent with step eta on R independent batches of B prompts, full (P, Q) with
    icl_ref's gradient, from P = sigma e_d e_d^T, Q = -sigma [[I / sqrt(d), 0], [0, 0]]; returns the
    effective Gamma = P_dd (-Q_xx) of every batch at every step, (R, steps + 1, d, d)."""
    rng = np.random.default_rng(seed)
    d = Sigma.shape[0]
    out = np.empty((R, steps + 1, d, d))
    for r in range(R):
        Z, y = ir.sample_prompts(rng, B, n, Sigma)
        S0, q0 = ir.gram(Z), Z[:, :, n].copy()
        P, Q = zfb_point(sigma, sigma * np.eye(d) / np.sqrt(d))
        for k in range(steps + 1):
            out[r, k] = P[0, 0, d, d] * -Q[0, 0, :d, :d]
            if k < steps:
                _, dP, dQ = ir.loss_and_grad_gram(P, Q, S0, q0, y, n, engine=engine)
                P, Q = P - eta * dP, Q - eta * dQ
    return out


def test_gradient_descent_on_batches_follows_the_flow():
    # R = 6 batches of 3000 prompts, step 0.02 to t = 2: the batches' mean Gamma within Z_MC of its
    # standard error (from the batches' spread, ~0.02) of the flow at 5 times. The step's own error
    # (GD on the population loss against the flow, computed below) is ~0.003, far inside.
    rng = np.random.default_rng(7)
    Sigma = ir.rotated_covariance(rng, (1.0, 0.5))[0]
    eta, steps, R = 0.02, 100, 6
    G = gd_on_batches(Sigma, 10, 0.3, eta, steps, R, 3000, seed=8)
    flow = lp.one_layer_gradient_flow(Sigma, 10, 0.3, eta * np.arange(steps + 1))["Gamma"]
    se = G.std(axis=0, ddof=1) / np.sqrt(R)
    for k in (20, 40, 60, 80, 100):
        assert np.all(np.abs(G[:, k].mean(axis=0) - flow[k]) <= Z_MC * se[k]), k
    # and the statistic sees a wrong time: the flow one fifth later is far outside
    assert np.any(np.abs(G[:, 20].mean(axis=0) - flow[24]) > Z_MC * se[20])


@pytest.mark.slow
def test_gradient_descent_on_large_batches_follows_the_flow():
    # the acceptance size: R = 8 batches of B = 50000, step 0.01 to t = 4. The step's own error
    # (population descent against the flow) is at most 0.7 SE here (the experiment `dynamics`)
    rng = np.random.default_rng(9)
    Sigma = ir.rotated_covariance(rng, (1.0, 0.5))[0]
    eta, steps, R = 0.01, 400, 8
    G = gd_on_batches(Sigma, 10, 0.3, eta, steps, R, 50000, seed=10)
    flow = lp.one_layer_gradient_flow(Sigma, 10, 0.3, eta * np.arange(steps + 1))["Gamma"]
    se = G.std(axis=0, ddof=1) / np.sqrt(R)
    for k in (80, 160, 240, 320, 400):
        assert np.all(np.abs(G[:, k].mean(axis=0) - flow[k]) <= Z_MC * se[k]), k


@pytest.mark.slow
def test_family_point_is_not_the_minimum_of_the_tied_sparse_loss_at_four_layers():
    # MATH.md §14: at L = 4 the antisymmetric second difference of the tied sparse loss at a*_L I
    # (whitened) is negative. Monte Carlo with common prompts (the predictor of icl_ref's forward
    # pass, not the family's Gauss rule): below -Z_MC standard errors, and positive at L = 1
    rng = np.random.default_rng(11)
    Z, y = ir.sample_prompts(rng, 400000, 20, np.eye(5))
    K = rng.standard_normal((5, 5))
    K = (K - K.T) / np.linalg.norm(K - K.T)
    for L, sign in ((1, 1), (4, -1)):
        a = lp.optimal_tied_family(L, 20, 5)[0]

        def sq(A):
            P, Q = ir.structure_to_PQ("sparse", {"A": A[None]}, L=L)
            return (ir.predict(P, Q, Z) - y) ** 2
        dd = (sq(a * np.eye(5) + 0.3 * K) + sq(a * np.eye(5) - 0.3 * K)) / 2 - sq(a * np.eye(5))
        assert sign * dd.mean() > Z_MC * dd.std(ddof=1) / np.sqrt(dd.size), L


def test_every_function_works_under_a_strict_caller_and_leaves_its_settings():
    # np.seterr(all="raise") in the caller changes no result and is left as it was: inputs of scale
    # 1e-120 where products of entries underflow inside, the landscape's functions at a small size
    tiny = 1e-120
    G = ir.gamma_star(np.eye(2), 6)
    W = np.array([[0.6, 0.2], [-0.1, 0.5]])
    Sigma = np.array([[1.0, 0.3], [0.3, 0.5]])
    S = lp.sample_whitened_covariances(np.random.default_rng(0), 50, 6, 2)
    E = np.array([[0.0, 1.0], [-1.0, 0.0]])

    def calls():
        return {
            "optimal_tied_family": lambda: lp.optimal_tied_family(2, 6, 2, starts=1, rng=np.random.default_rng(0)),
            "one_layer_population_grad": lambda: lp.one_layer_population_grad(tiny, G * tiny, np.eye(2), 6),
            "one_layer_gradient_flow": lambda: lp.one_layer_gradient_flow(np.eye(2) * tiny, 6, 0.1, [0.0, 1.0]),
            "whiten": lambda: lp.whiten(W * tiny, Sigma),
            "unwhiten": lambda: lp.unwhiten(W * tiny, Sigma),
            "tied_family_step": lambda: lp.tied_family_step(2, 6, 2),
            "tied_family_hessian_eigenvalues": lambda: lp.tied_family_hessian_eigenvalues(2, 6, 2),
            "antisymmetric_curvature_parts": lambda: lp.antisymmetric_curvature_parts(2, 6, 2),
            "family_point_character": lambda: lp.family_point_character([1, 2], [6], 2),
            "word_expectation": lambda: lp.word_expectation(["asas"], 6, 2),
            "tied_loss_polynomial": lambda: lp.tied_loss_polynomial(2, 6, 2),
            "tied_population_loss": lambda: lp.tied_population_loss(W * tiny, 2, 6, 2),
            "tied_loss_and_grad": lambda: lp.tied_loss_and_grad(W, 2, 6, 2),
            "tied_hessian": lambda: lp.tied_hessian(W, 2, 6, 2),
            "rotation_orbit_tangent": lambda: lp.rotation_orbit_tangent(W),
            "orbit_complement": lambda: lp.orbit_complement(W),
            "reduced_hessian": lambda: lp.reduced_hessian(W, 2, 6, 2),
            "rotation_normal_form": lambda: lp.rotation_normal_form(W),
            "tied_local_minimum": lambda: lp.tied_local_minimum(W, 2, 6, 2),
            "tied_descent_from_family": lambda: lp.tied_descent_from_family(1, 6, 2, np.random.default_rng(0)),
            "block_direction": lambda: lp.block_direction(2, 1),
            "tied_minima_from_family": lambda: lp.tied_minima_from_family(2, 6, 2),
            "block_profile": lambda: lp.block_profile(2, 6, 3, 1, [0.0, 0.1]),
            "tied_block_saddle": lambda: lp.tied_block_saddle(3, 20, 3, 1, 0.4, points=5),
            "sample_whitened_covariances": lambda: lp.sample_whitened_covariances(np.random.default_rng(1), 3, 6, 2),
            "per_sample_loss": lambda: lp.per_sample_loss(W * tiny, S, 2),
            "per_sample_gradient": lambda: lp.per_sample_gradient(W * tiny, S, 2),
            "per_sample_second_derivative": lambda: lp.per_sample_second_derivative(W * tiny, S, 2, E),
            "per_sample_hessian_products": lambda: lp.per_sample_hessian_products(W * tiny, S, 2, lp.subspace_bases(2)[2]),
            "mc_loss": lambda: lp.mc_loss(W * tiny, S, 2),
            "subspace_bases": lambda: lp.subspace_bases(2),
            "mc_family_hessian_eigenvalues": lambda: lp.mc_family_hessian_eigenvalues(2, S, 0.6),
            "mc_certificate": lambda: lp.mc_certificate(W, S, 2),
        }
    assert_strict_caller_gets_the_same(lp, calls, draws=())
    with pytest.raises(ValueError, match="blocks must be between 1 and 0 for d = 2"):
        lp.tied_block_saddle(3, 20, 2, 1, 0.4)                # one block fills d = 2: nothing outside it


def test_mc_loss_and_its_standard_error_are_scale_free():
    # at L = 1 a sample's loss is |I - W^T S|_F^2, about 1e160 at W = 1e80 I: the squared deviations of
    # such samples overflowed (a standard error of inf); at W = 1e200 I the samples themselves overflow,
    # a ValueError naming it, not (inf, nan) with warnings
    S = lp.sample_whitened_covariances(np.random.default_rng(4), 200, N, D)
    direct = np.array([np.sum((np.eye(D) - 1e80 * s) ** 2) for s in S])
    m, se, _ = lp.mc_loss(1e80 * np.eye(D), S, 1)
    # 1e-12: rounding of the scaled sums; the reference is the same samples' mean and sd taken on x / 1e160
    u = direct / 1e160
    assert m == pytest.approx(np.mean(u) * 1e160, rel=1e-12)
    assert se == pytest.approx(np.std(u, ddof=1) / np.sqrt(len(u)) * 1e160, rel=1e-12) and np.isfinite(se) and se > 0
    with pytest.raises(ValueError, match="overflow"):
        lp.mc_loss(1e200 * np.eye(D), S, 1)


def test_mc_loss_with_a_constant_control_is_the_plain_estimate_and_a_nan_sample_is_named():
    # "control = (W0, f0): the control variate per_sample_loss(W0) - f0 ... c = cov / var": at W0 = 0 every
    # sample's loss is |I|_F^2 = d, a variance of 0: the control corrects nothing (c = 0, the plain
    # estimate), not a 0/0 with a warning; a NaN in S is named as such, not as an overflow
    S = lp.sample_whitened_covariances(np.random.default_rng(5), 300, N, D)
    W = 0.1 * np.eye(D)
    assert lp.mc_loss(W, S, 2, control=(np.zeros((D, D)), float(D))) == lp.mc_loss(W, S, 2)
    bad = S.copy()
    bad[7, 0, 0] = np.nan
    for call in (lambda: lp.mc_loss(W, bad, 2), lambda: lp.per_sample_loss(W, bad, 2),
                 lambda: lp.per_sample_gradient(W, bad, 2)):
        with pytest.raises(ValueError, match="S must hold finite"):
            call()
