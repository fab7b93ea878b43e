"""Tests for the looped (weight-tied) models and the gradient flow of one layer (MATH.md §14).

Tolerances, each with its reason:
    FD_VEC = 1e-8   relative, for a whole gradient vector against five-point central differences
                    at h = 1e-4: truncation (h^4/30) f^(5) ~ 3e-18 f^(5), rounding ~ 1.5 eps |f| / h
                    ~ 3e-12 |f|, and |f| / |grad| <= 100 here, so 1e-8 leaves two orders of margin
    EXACT  = 1e-12  relative: one exact quantity computed twice in float64 (rounding only)
    Z_MC   = 4      sampling: an estimate within 4 of its standard errors of the exact value
"""
import numpy as np
from numpy.testing import assert_allclose
import pytest
import scipy.optimize

import icl_looped as lp
import icl_ref as ir
from test_icl_ref import assert_strict_caller_gets_the_same

FD_VEC = 1e-8
FD_H = 1e-4
EXACT = 1e-12
Z_MC = 4.0


def five_point(f, x, h=FD_H):
    """The gradient of f at the flat vector x by five-point central differences, entry by entry."""
    g = np.empty_like(x)
    for i in range(x.size):
        e = np.zeros_like(x)
        e[i] = h
        g[i] = (8 * (f(x + e) - f(x - e)) - (f(x + 2 * e) - f(x - 2 * e))) / (12 * h)
    return g


def problem(seed, B=40, d=3, n=6):
    rng = np.random.default_rng(seed)
    Z, y = ir.sample_prompts(rng, B, n, ir.rotated_covariance(rng, (1.0, 0.5, 0.25)[:d])[0])
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


def test_tied_family_inputs_are_checked():
    with pytest.raises(TypeError, match="L"):
        lp.optimal_tied_family(2.0, 20, 5)
    with pytest.raises(ValueError, match="noise_var"):
        lp.optimal_tied_family(2, 20, 5, noise_var=-1.0)


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
    # 1e-120, where products of entries underflow inside
    tiny = 1e-120
    G = ir.gamma_star(np.eye(2), 6)

    def calls():
        return {
            "optimal_tied_family": lambda: lp.optimal_tied_family(2, 6, 2, starts=1, rng=np.random.default_rng(0)),
            "one_layer_population_grad": lambda: lp.one_layer_population_grad(tiny, G * tiny, np.eye(2), 6),
            "one_layer_gradient_flow": lambda: lp.one_layer_gradient_flow(np.eye(2) * tiny, 6, 0.1, [0.0, 1.0]),
        }
    assert_strict_caller_gets_the_same(lp, calls, draws=())
