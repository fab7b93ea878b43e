"""Tests for icl_estimators: estimators, task pools and shift (MATH.md §15).

Every check compares two sides computed independently: the estimators against per-prompt normal
equations, the dual (kernel) form of the posterior or a posterior summed task by task, written here
with no helper of icl_ref; the exact risks against Monte Carlo through sample_prompts and the
transformer itself.

Tolerances, each with its reason:
    SOLVE = 1e-10  relative to the largest |y_hat| of the batch: two float64 solutions of one
                   well-conditioned system (condition numbers below 1e3 here) by different
                   factorisations differ by cond * eps ~ 1e-13; 1e-10 leaves margin and still sees
                   any wrong term, which is O(1)
    Z_MC   = 4     Monte Carlo: |estimate - exact| <= 4 standard errors computed from the samples
                   (false alarm 6e-5 for a Gaussian mean)
"""
import numpy as np
import pytest

import icl_estimators as est
import icl_ref as ir
from test_icl_ref import assert_strict_caller_gets_the_same

SOLVE = 1e-10
Z_MC = 4.0


def context(Z):
    """X (B, n, d), y (B, n), x_q (B, d) read off the layout [A] §2 column by column."""
    B, D, N = Z.shape
    X = np.array([[Z[b, :D - 1, i] for i in range(N - 1)] for b in range(B)])
    return X, Z[:, D - 1, :N - 1], Z[:, :D - 1, N - 1]


def assert_close(mine, reference, rel=SOLVE):
    scale = np.max(np.abs(reference))
    assert np.max(np.abs(mine - reference)) <= rel * scale, np.max(np.abs(mine - reference)) / scale


def spd(rng, d, lo=0.5, hi=2.0):
    U, _ = np.linalg.qr(rng.standard_normal((d, d)))
    return (U * rng.uniform(lo, hi, d)) @ U.T


# ---------------------------------------------------------------------------------------------
# §15 Estimators against independent computations
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [3, 12])
@pytest.mark.parametrize("lam", [0.0, 0.3])
def test_ridge_and_ols_solve_the_normal_equations(n, lam):
    # n = 12 > d: (X^T X + lam Sigma_w^-1) w = X^T y; n = 3 < d at lam = 0: the minimum-norm
    # interpolant X^T (X X^T)^-1 y (Sigma_w = I) or Sigma_w X^T (X Sigma_w X^T)^-1 y
    rng = np.random.default_rng(n + int(10 * lam))
    d = 5
    Z, _ = ir.sample_prompts(rng, 40, n, spd(rng, d), noise_std=0.3)
    X, y, x_q = context(Z)
    for Sigma_w in (None, spd(rng, d)):
        S_w = np.eye(d) if Sigma_w is None else Sigma_w
        expected = []
        for Xb, yb, qb in zip(X, y, x_q):
            if lam == 0 and n < d:
                w = S_w @ Xb.T @ np.linalg.solve(Xb @ S_w @ Xb.T, yb)
            else:
                w = np.linalg.solve(Xb.T @ Xb + lam * np.linalg.inv(S_w), Xb.T @ yb)
            expected.append(w @ qb)
        assert_close(est.ridge_predict(Z, lam, Sigma_w), np.array(expected))


def test_bayes_predict_is_the_gaussian_posterior_mean():
    # conditioning the joint Gaussian (y, y_q) given x: E[y_q | y] = x_q^T Sigma_w X^T (X Sigma_w X^T
    # + s2 I)^-1 y, the kernel form, which no code of icl_ref computes; at s2 = 0 with n < d too
    rng = np.random.default_rng(1)
    d = 4
    Sigma_w = spd(rng, d)
    for n, s2 in ((9, 0.4), (2, 0.0)):
        Z, _ = ir.sample_prompts(rng, 30, n, spd(rng, d), Sigma_w, noise_std=np.sqrt(s2))
        X, y, x_q = context(Z)
        expected = [qb @ Sigma_w @ Xb.T @ np.linalg.solve(Xb @ Sigma_w @ Xb.T + s2 * np.eye(n), yb)
                    for Xb, yb, qb in zip(X, y, x_q)]
        assert_close(est.bayes_predict(Z, Sigma_w, s2), np.array(expected))


def brute_force_pool_posterior(Z, tasks, s2):
    """y_hat = sum_k pi_k <w_k, x_q> with pi_k the Gaussian likelihood of each task's residuals,
    task by task; the likelihoods are shifted by their largest (which cancels in the ratio) only so
    that float64 can hold them."""
    X, y, x_q = context(Z)
    out = []
    for Xb, yb, qb in zip(X, y, x_q):
        loglik = np.array([-np.sum((yb - Xb @ w) ** 2) / (2 * s2) for w in tasks])
        lik = np.exp(loglik - loglik.max())
        out.append(sum(l * (w @ qb) for l, w in zip(lik, tasks)) / lik.sum())
    return np.array(out)


def test_dmmse_is_the_posterior_over_the_pool():
    rng = np.random.default_rng(2)
    d, n, K, s2 = 3, 6, 17, 0.5
    tasks = rng.standard_normal((K, d))
    Z, _ = ir.sample_prompts(rng, 50, n, np.eye(d), noise_std=np.sqrt(s2), tasks=tasks)
    assert_close(est.dmmse_predict(Z, tasks, s2), brute_force_pool_posterior(Z, tasks, s2))
    # fresh tasks, a larger pool and a noise so small that exp(-|r|^2 / 2 s2) underflows to 0 for
    # every task: the log-sum-exp still gives the nearest task's prediction
    Z, _ = ir.sample_prompts(rng, 50, n, np.eye(d), noise_std=0.1)
    assert_close(est.dmmse_predict(Z, tasks, 0.01), brute_force_pool_posterior(Z, tasks, 0.01))
    X, y, x_q = context(Z)
    nearest = [tasks[np.argmin([np.sum((yb - Xb @ w) ** 2) for w in tasks])] @ qb for Xb, yb, qb in zip(X, y, x_q)]
    tiny = est.dmmse_predict(Z, tasks, 1e-9)
    assert np.all(np.isfinite(tiny))
    assert_close(tiny, np.array(nearest))    # the runner-up's weight is below exp(-1e6): exactly 0


# ---------------------------------------------------------------------------------------------
# §15 Task pools
# ---------------------------------------------------------------------------------------------

def test_sample_prompts_draws_each_task_of_the_pool_uniformly():
    rng = np.random.default_rng(3)
    d, n, K, B = 3, 4, 5, 50000
    tasks = rng.standard_normal((K, d))
    Z, y, w = ir.sample_prompts(rng, B, n, np.eye(d), return_w_star=True, tasks=tasks)
    index = np.argmin(np.sum((w[:, None, :] - tasks[None]) ** 2, axis=2), axis=1)
    assert np.array_equal(w, tasks[index])                   # every task is a row of the pool
    assert np.array_equal(y, np.einsum("bd,bd->b", Z[:, :d, n], w))   # noiseless query labels
    counts = np.bincount(index, minlength=K)
    # each count is Binomial(B, 1/K): within Z_MC of its standard deviation
    assert np.all(np.abs(counts - B / K) <= Z_MC * np.sqrt(B / K * (1 - 1 / K))), counts


def test_the_layer_trained_on_a_pool_sees_only_its_second_moment():
    # a pool of K = 2 < d tasks: its second moment is singular, and the exact loss of the layer
    # gamma_star(tasks=pool), on prompts from the pool, against the transformer on sampled prompts
    rng = np.random.default_rng(4)
    d, n, s2 = 3, 5, 0.2
    tasks = rng.standard_normal((2, d))
    Sigma = spd(rng, d)
    G = ir.gamma_star(Sigma, n, noise_var=s2, tasks=tasks)
    P, Q = ir.sparse_params(G[None])
    mc, se = est.monte_carlo_risk(lambda Z: ir.predict(P, Q, Z), rng, 200000, n, Sigma, noise_var=s2, tasks=tasks)
    exact = est.shifted_single_layer_loss(G, Sigma, n, noise_var=s2, tasks=tasks)
    assert abs(mc - exact) <= Z_MC * se, (mc, exact, se)
    # and it is the minimum on the pool: any other Gamma (here the unbounded prior's) does worse
    assert exact < est.shifted_single_layer_loss(ir.gamma_star(Sigma, n, noise_var=s2), Sigma, n,
                                                noise_var=s2, tasks=tasks)


# ---------------------------------------------------------------------------------------------
# §15 Exact risks against Monte Carlo
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n, d, anisotropic", [(12, 4, True), (3, 8, False), (6, 6, False)])
def test_ols_population_risk_matches_monte_carlo(n, d, anisotropic):
    # n > d + 1 (any Sigma, Sigma_w), n < d - 1 (isotropic), and n = d noiseless (zero risk: the
    # noisy risk is infinite there, which ols_population_risk refuses)
    rng = np.random.default_rng(n * d)
    Sigma = spd(rng, d) if anisotropic else 1.5 * np.eye(d)
    Sigma_w = spd(rng, d) if anisotropic else 0.7 * np.eye(d)
    s2 = 0.0 if n == d else 0.3
    exact = est.ols_population_risk(n, Sigma, Sigma_w, s2)
    # the noiseless case needs few prompts: any bias shows as a positive error far above rounding
    batch = 2000 if s2 == 0 else 40000 if anisotropic else 20000
    mc, se = est.monte_carlo_risk(lambda Z: est.ridge_predict(Z), rng, batch, n, Sigma, Sigma_w, s2)
    if s2 == 0:
        assert exact == 0 and mc <= 1e-20            # the interpolant is exact up to rounding
    else:
        assert abs(mc - exact) <= Z_MC * se, (mc, exact, se)
    with pytest.raises(ValueError, match="n must be"):
        est.ols_population_risk(d, Sigma, Sigma_w, 0.1)


def shifted_prompts(rng, B, n, Sigma, Sigma_query, Sigma_w, s2):
    """Prompts with context covariates N(0, Sigma) and a query N(0, Sigma_query), built here from
    Gaussians (the context and w_star by sample_prompts, the query and its label by hand)."""
    Z, _, w = ir.sample_prompts(rng, B, n, Sigma, Sigma_w, noise_std=np.sqrt(s2), return_w_star=True)
    x_q = rng.standard_normal((B, Sigma.shape[0])) @ np.linalg.cholesky(Sigma_query).T
    Z[:, :-1, n] = x_q
    return Z, np.einsum("bd,bd->b", x_q, w) + np.sqrt(s2) * rng.standard_normal(B)


def test_shifted_single_layer_loss_matches_the_transformer_at_each_shift():
    # a layer trained at (n = 10, Sigma, Sigma_w = I, noise 0.1) and tested at another length, other
    # covariates (context and query alike), another task covariance, and a query unlike its context
    rng = np.random.default_rng(5)
    d, n, s2 = 3, 10, 0.1
    Sigma = spd(rng, d)
    G = ir.gamma_star(Sigma, n, noise_var=s2)
    P, Q = ir.sparse_params(G[None])
    other = spd(rng, d, 0.2, 3.0)
    for shift in (dict(n=30), dict(Sigma=other, Sigma_query=other), dict(Sigma_w=4 * spd(rng, d)),
                  dict(Sigma_query=2 * other)):
        at = dict(dict(n=n, Sigma=Sigma, Sigma_w=np.eye(d), Sigma_query=Sigma), **shift)
        Z, y = shifted_prompts(rng, 30000, at["n"], at["Sigma"], at["Sigma_query"], at["Sigma_w"], s2)
        err = (ir.predict(P, Q, Z) - y) ** 2
        mc, se = err.mean(), err.std(ddof=1) / np.sqrt(err.size)
        exact = est.shifted_single_layer_loss(G, at["Sigma"], at["n"], at["Sigma_w"], s2,
                                             Sigma_query=at["Sigma_query"])
        assert abs(mc - exact) <= Z_MC * se, (shift.keys(), mc, exact, se)


def test_shifted_loss_without_shift_is_theorem_1s_and_bayes_beats_every_ridge():
    rng = np.random.default_rng(6)
    d, n, s2 = 4, 7, 0.3
    Sigma, Sigma_w, G = spd(rng, d), spd(rng, d), rng.standard_normal((d, d))
    loss = lambda G, S_q: est.shifted_single_layer_loss(G, Sigma, n, Sigma_w, s2, Sigma_query=S_q)
    # the same number by the two names (one formula: any difference is a dropped argument)
    assert loss(G, Sigma) == ir.single_layer_population_loss(G, Sigma, n, Sigma_w, s2)
    # the loss less the query's noise is linear in Sigma_query (x_q enters as x_q x_q^T only): EXACT
    # 1e-12, a sum of a few traces
    other = spd(rng, d)
    parts = [loss(G, S) - s2 for S in (Sigma, 3 * Sigma, other, Sigma + other)]
    assert abs(parts[1] - 3 * parts[0]) <= 1e-12 * parts[1]
    assert abs(parts[3] - parts[0] - parts[2]) <= 1e-12 * parts[3]
    # gamma_star of the context is the best layer for every query covariance: the loss is a quadratic
    # in Gamma with a positive definite curvature, so every step away raises it
    S_q = spd(rng, d, 0.1, 5.0)
    best = ir.gamma_star(Sigma, n, Sigma_w, s2)
    for E in rng.standard_normal((5, d, d)):
        assert loss(best + 1e-3 * E, S_q) > loss(best, S_q) < loss(best - 1e-3 * E, S_q)
    # the posterior mean minimises the risk among all predictors: on common prompts, ridge at a
    # tenth and ten times the noise, and without the prior's metric, each does worse on average
    Z, y = ir.sample_prompts(rng, 20000, n, Sigma, Sigma_w, noise_std=np.sqrt(s2))
    bayes = (est.bayes_predict(Z, Sigma_w, s2) - y) ** 2
    for other in (est.ridge_predict(Z, s2 / 10, Sigma_w), est.ridge_predict(Z, 10 * s2, Sigma_w),
                  est.ridge_predict(Z, s2)):
        diff = (other - y) ** 2 - bayes                      # paired: the prompts' spread cancels
        assert diff.mean() > Z_MC * diff.std(ddof=1) / np.sqrt(diff.size)


# ---------------------------------------------------------------------------------------------
# Bad input (no MATH.md section)
# ---------------------------------------------------------------------------------------------

_Z = np.zeros((2, 3, 4))
BAD = [
    (lambda: est.ridge_predict(_Z, -1.0), ValueError, "lam"),
    (lambda: est.ridge_predict(np.zeros((3, 4)), 0.1), ValueError, "Z"),
    (lambda: est.ridge_predict(_Z, 0.1, np.eye(3)), ValueError, "Sigma_w"),
    (lambda: est.bayes_predict(_Z, noise_var="0.1"), TypeError, "noise_var"),
    (lambda: est.dmmse_predict(_Z, np.zeros((4, 3)), 0.1), ValueError, "tasks"),
    (lambda: est.dmmse_predict(_Z, np.zeros((4, 2)), 0.0), ValueError, "noise_var"),
    (lambda: ir.sample_prompts(np.random.default_rng(0), 2, 3, np.eye(2), tasks=np.zeros((0, 2))), ValueError, "tasks"),
    (lambda: ir.sample_prompts(np.random.default_rng(0), 2, 3, np.eye(2), np.eye(2), tasks=np.zeros((1, 2))),
     ValueError, "tasks"),
    (lambda: ir.gamma_star(np.eye(2), 3, tasks=np.ones((2, 3))), ValueError, "tasks"),
    (lambda: est.ols_population_risk(20, np.eye(3), noise_var=-1), ValueError, "noise_var"),
    (lambda: est.ols_population_risk(2, np.diag([1.0, 2, 3, 4, 5])), ValueError, "Sigma"),
    (lambda: est.monte_carlo_risk(None, np.random.default_rng(0), 10, 3, np.eye(2)), TypeError, "predict"),
    (lambda: est.monte_carlo_risk(est.ridge_predict, np.random.default_rng(0), 1, 3, np.eye(2)), ValueError, "batch"),
    (lambda: est.monte_carlo_risk(lambda Z: Z[:, 0, :], np.random.default_rng(0), 10, 3, np.eye(2)),
     ValueError, "predict"),
    # a finite prediction whose squared error overflows: it was (inf, nan) with a RuntimeWarning
    (lambda: est.monte_carlo_risk(lambda Z: np.full(len(Z), 1e200), np.random.default_rng(0), 10, 3, np.eye(2)),
     ValueError, "overflows"),
    (lambda: est.shifted_single_layer_loss(np.eye(2), np.eye(2), 3, Sigma_query=np.eye(3)), ValueError, "Sigma_query"),
    (lambda: est.shifted_single_layer_loss(np.eye(3), np.eye(2), 3), ValueError, "Gamma"),
]


@pytest.mark.parametrize("call, error, name", BAD)
def test_bad_input_is_refused_naming_the_argument(call, error, name):
    with pytest.raises(error, match=name):
        call()


def test_estimators_are_right_at_any_scale_of_the_data():
    # prompts of scale c = 1e160 (squares of entries overflow): ridge with lam = 1 is least squares to
    # rounding there (lam / s^2 ~ 1e-320), so it predicts c times the unit prompts' least squares (it
    # used to return zeros), and Bayes likewise; at c = 1e-150 ridge with lam c^2 is c times the unit
    # ridge with lam (the same problem in other units); dMMSE with noise_var = 1e-320 (1 / 2 noise_var
    # overflows) is the nearest task's prediction (it used to return NaN), computed here directly.
    # 1e-9: an SVD of a scaled matrix, rounding only
    rng = np.random.default_rng(11)
    Z, _ = ir.sample_prompts(rng, 30, 8, np.eye(3))
    ols = est.ridge_predict(Z)
    assert_close(est.ridge_predict(1e160 * Z, 1.0) / 1e160, ols, rel=1e-9)
    assert_close(est.bayes_predict(1e160 * Z, noise_var=1.0) / 1e160, ols, rel=1e-9)
    c = 1e-150
    assert_close(est.ridge_predict(c * Z, 0.5 * c * c) / c, est.ridge_predict(Z, 0.5), rel=1e-9)
    assert_close(est.bayes_predict(c * Z, noise_var=0.5 * c * c) / c, est.bayes_predict(Z, noise_var=0.5), rel=1e-9)
    tasks = rng.standard_normal((6, 3))
    X, y, x_q = Z[:, :3, :-1].transpose(0, 2, 1), Z[:, 3, :-1], Z[:, :3, -1]
    nearest = tasks[np.argmin(np.sum((y[:, None, :] - np.einsum("bnd,kd->bkn", X, tasks)) ** 2, axis=2), axis=1)]
    expected = np.einsum("bd,bd->b", nearest, x_q)
    for c, noise_var in ((1.0, 1e-320), (1e160, 1e-300)):
        got = est.dmmse_predict(c * Z, tasks, noise_var)
        assert np.all(np.isfinite(got)) and and_close(got / c, expected), c


def and_close(a, b):
    """a equals b to 1e-12 relative to b's largest entry (a weight of exp(-huge) is exactly 0 here)."""
    return bool(np.all(np.abs(a - b) <= 1e-12 * np.max(np.abs(b))))


def test_the_shifted_loss_is_right_at_any_scale_or_says_it_cannot_be():
    # the shifted loss is c_q times the unit one for Sigma_query = c_q T (no noise): right at 1e-170
    # (it used to come out negative there); a pool of scale 1e160 whose loss overflows is refused in
    # words about the scale, not the L-layer growth law
    S, T = np.diag([1.0, 0.5]), np.diag([0.8, 1.2])
    G = ir.gamma_star(S, 10)
    unit = est.shifted_single_layer_loss(G, S, 10, Sigma_query=T)
    for c in (1e-170, 1e150):
        loss = est.shifted_single_layer_loss(G / c, c * S, 10, Sigma_query=c * T)
        assert loss > 0 and abs(loss / c - unit) <= 1e-12 * unit, c
    with pytest.raises(ValueError, match="overflows float64") as e:
        est.shifted_single_layer_loss(G, S, 10, tasks=1e160 * np.ones((2, 2)))
    assert "L layers" not in str(e.value)
    with pytest.raises(TypeError, match="query_noise"):
        est.shifted_single_layer_loss(G, S, 10, query_noise="no")


def test_estimators_work_under_a_strict_caller_at_any_scale():
    # a caller's np.seterr(all="raise") must neither turn the library's own underflows into errors
    # nor be changed by a call: prompts of scale 1e-120 to 1e-160 (squares of entries underflow)
    # give the same numbers as under the default rules; least squares is scale-free, 1e-160 times
    # the unit-scale prediction (1e-12: the SVD of a matrix scaled by a constant, rounding only)
    rng = np.random.default_rng(7)
    Z, _ = ir.sample_prompts(rng, 20, 6, np.eye(3), noise_std=0.1)
    tasks = rng.standard_normal((5, 3))
    def calls():
        return {
            "ridge_predict": lambda: est.ridge_predict(1e-160 * Z),
            "bayes_predict": lambda: est.bayes_predict(1e-120 * Z, noise_var=1e-250),
            "dmmse_predict": lambda: est.dmmse_predict(1e-120 * Z, tasks, 1e-250),
            "ols_population_risk": lambda: est.ols_population_risk(9, np.eye(3), noise_var=1e-300),
            "monte_carlo_risk": lambda: est.monte_carlo_risk(est.ridge_predict, np.random.default_rng(0), 10, 6,
                                                            1e-120 * np.eye(3)),
            "shifted_single_layer_loss": lambda: est.shifted_single_layer_loss(np.eye(3), 1e-100 * np.eye(3), 6,
                                                                              Sigma_query=1e-150 * np.eye(3)),
        }
    assert_strict_caller_gets_the_same(est, calls, draws=())
    with np.errstate(under="ignore"):
        expected = {name: call() for name, call in calls().items()}
    assert np.all(np.isfinite(expected["ridge_predict"]))
    assert_close(expected["ridge_predict"] / 1e-160, est.ridge_predict(Z), rel=1e-12)


def test_ridge_and_bayes_are_right_at_any_scale_of_the_prior():
    # Sigma_w = 1e308 I overflowed s^2 with only a RuntimeWarning and returned a wrong
    # prediction. The ridge at (c_w W, lam) is the ridge at (W, lam / c_w) exactly in the mathematics;
    # computed so, the two sides run the same float operations up to the penalty's rounding: 1e-12
    Z, _ = ir.sample_prompts(np.random.default_rng(3), 3, 6, np.eye(3))
    with np.errstate(over="raise", invalid="raise"):      # an overflow is an error, not a warning
        for c in (1e308, 1e-300):
            expected = est.ridge_predict(Z, 1.0 / c)
            np.testing.assert_allclose(est.ridge_predict(Z, 1.0, c * np.eye(3)), expected, rtol=1e-12)
            np.testing.assert_allclose(est.bayes_predict(Z, c * np.eye(3), 1.0), expected, rtol=1e-12)


def _exact_ridge(Z, lam):
    """ridge_predict of one prompt Z (d+1, n+1) with Sigma_w = I, in exact rationals at its float64 entries."""
    from fractions import Fraction
    d, n = Z.shape[0] - 1, Z.shape[1] - 1
    X = [[Fraction(float(Z[j, i])) for j in range(d)] for i in range(n)]
    A = [[sum(r[j] * r[k] for r in X) + (Fraction(lam) if j == k else 0) for k in range(d)] for j in range(d)]
    b = [sum(r[j] * Fraction(float(Z[d, i])) for i, r in enumerate(X)) for j in range(d)]
    for j in range(d):                                # Gauss-Jordan, exact
        for k in range(d):
            if k != j:
                f = A[k][j] / A[j][j]
                A[k], b[k] = [a - f * p for a, p in zip(A[k], A[j])], b[k] - f * b[j]
    return float(sum(b[j] / A[j][j] * Fraction(float(Z[j, n])) for j in range(d)))


def test_ridge_is_right_when_the_context_query_labels_and_penalty_differ_in_scale():
    # the context, the query, the labels and the penalty each at its own scale, the prediction inside
    # float64's range: a penalty lam / s_x^2 beyond float64 gave exactly 0 (exact 3.7e-19), a context
    # 1e320 times smaller than the query gave NaN. 1e-10 relative: the SVD solve of a 10 x 3 problem of
    # condition ~10 is right to ~cond^2 eps = 1e-14, with room for the penalty's rounding
    Z0, _ = ir.sample_prompts(np.random.default_rng(1), 1, 10, np.eye(3))
    for x, q, y, lam in ((1e-160, 1e-160, 1e300, 1.0), (0.1, 0.1, 1e300, 1e308), (1e-120, 1e200, 1e-220, 0.0),
                         (1e-120, 1e200, 1e-220, 1e-250), (1e150, 1e-150, 1e-100, 1e-300)):
        Z = Z0.copy()
        Z[:, :3, :-1] *= x
        Z[:, :3, -1] *= q
        Z[:, 3, :] *= y
        exact = _exact_ridge(Z[0], lam)
        assert est.ridge_predict(Z, lam)[0] == pytest.approx(exact, rel=1e-10, abs=0), (x, q, y, lam)
        assert est.bayes_predict(Z, noise_var=lam)[0] == pytest.approx(exact, rel=1e-10, abs=0), (x, q, y, lam)
    # a prediction beyond float64 is refused by name, not returned as inf or NaN with a warning
    Z = Z0.copy()
    Z[:, 3, :] *= 1e300
    Z[:, :3, -1] *= 1e10
    with pytest.raises(ValueError, match="the prediction is not finite: float64 overflowed"):
        est.ridge_predict(Z)


def test_ols_risk_is_right_at_any_scale_or_says_it_cannot_be():
    # c s (d - n) overflowed to inf at 1e200 I (both) and underflowed to 0.0 at 1e-200,
    # silently; now refused by name. Inside the range it is the closed form, exact to one rounding (1e-15)
    for c in (1e200, 1e-200):
        with pytest.raises(ValueError, match="normal range"):
            est.ols_population_risk(1, c * np.eye(3), c * np.eye(3))
    assert est.ols_population_risk(1, 1e100 * np.eye(3), 1e-100 * np.eye(3)) == pytest.approx(2.0, rel=1e-15, abs=0)
    # near float64's limit the noise term noise_var d / (n - d - 1) fits (1.29e308 with the query's noise):
    # it is returned to a few roundings (1e-15), not inf; a risk beyond the limit is refused by name
    assert est.ols_population_risk(10, 1e300 * np.eye(2), noise_var=1e308) == pytest.approx(1e308 / 7 * 9, rel=1e-15)
    assert est.ols_population_risk(1, np.eye(4), noise_var=1e308) == pytest.approx(1e308 / 2 * 3, rel=1e-15)
    with pytest.raises(ValueError, match="the risk overflows float64"):
        est.ols_population_risk(4, np.eye(2), noise_var=1.7e308)


def test_monte_carlo_risk_and_its_standard_error_are_scale_free():
    # x -> c x scales every error (y_hat - y)^2 by c exactly for a zero predictor (c a power of 10 is
    # not exact: 1e-12 relative covers its rounding); the squared deviations of errors near 1e-200
    # underflowed (a standard error of 0.0) and those near 1e153 overflowed (inf)
    predict = lambda Z: np.zeros(len(Z))
    base = est.monte_carlo_risk(predict, np.random.default_rng(0), 100, 5, np.eye(2))
    for c in (1e-200, 1e-160, 1e153):
        risk, se = est.monte_carlo_risk(predict, np.random.default_rng(0), 100, 5, c * np.eye(2))
        assert risk == pytest.approx(c * base[0], rel=1e-12) and se == pytest.approx(c * base[1], rel=1e-12)
