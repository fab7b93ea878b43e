"""icl_estimators: what a trained layer is compared with, beyond the paper (MATH.md §15).

Estimators that read a prompt's context (X, y) and its query x_q from the paper's layout Z
(B, d+1, n+1) and predict y_hat = <w_hat, x_q>; their risks, exact where a closed form exists and
by Monte Carlo where not; and the exact loss of one trained layer away from the distribution it was
trained on (another length, covariance, task law or query law). Task pools (w_star a uniformly
drawn row of a finite pool) are drawn by icl_ref.sample_prompts(..., tasks=) and enter
icl_ref.gamma_star(..., tasks=) through their second moment.

    ridge_predict(Z, lam, Sigma_w)          ridge (lam = 0: least squares, OLS or min-norm)
    bayes_predict(Z, Sigma_w, noise_var)    the posterior mean for a Gaussian prior
    dmmse_predict(Z, tasks, noise_var)      the posterior mean over a finite pool
    ols_population_risk(n, Sigma, ...)      least squares' exact risk, where it has a closed form
    monte_carlo_risk(predict, rng, ...)     any predictor's risk with its standard error
    shifted_single_layer_loss(Gamma, ...)   one layer's exact loss under a shift

Built on icl_ref's public names (and the few private ones its PRIVATE_API lists). float64 throughout;
numpy only.
"""
import math

import numpy as np

import icl_ref as ir
from icl_ref import _array, _finite, _flag, _int, _nonneg, _numpy_rules, _pool, _prompts, _rng, _single_layer_loss, \
    _spd, _task_covariance, _task_moment

__version__ = ir.__version__


# ---------------------------------------------------------------------------------------------
# §15 Estimators
# ---------------------------------------------------------------------------------------------

def _regression(Z):
    """(X (B, n, d), y (B, n), x_q (B, d)) of prompts Z (B, d+1, n+1): the context and the query."""
    d, n = Z.shape[1] - 1, Z.shape[2] - 1
    return np.swapaxes(Z[:, :d, :n], 1, 2), Z[:, d, :n], Z[:, :d, n]


def _scales(A, axes):
    """The largest |entry| of A over `axes`, per prompt, with 1 where it is 0 (nothing to scale)."""
    s = np.max(np.abs(A), axis=axes)
    return np.where(s > 0, s, 1.0)


def _exponents(num, den=()):
    """(m, e) with prod(num) / prod(den) = m 2^e, for arrays of positive scales: formed from their
    binary mantissas and exponents, so that no product of scales under- or overflows."""
    m, e = 1.0, 0
    for a, sign in [(a, 1) for a in num] + [(a, -1) for a in den]:
        m_a, e_a = np.frexp(a)
        m, e = m * m_a ** sign, e + sign * e_a
    return m, e


@_numpy_rules
def ridge_predict(Z, lam=0.0, Sigma_w=None):
    """Ridge regression on each prompt's context, evaluated at its query (MATH.md §15):

        w_hat = argmin_w |y - X w|^2 + lam w^T Sigma_w^-1 w,   y_hat = <w_hat, x_q>,

    computed as w = F v, v = V diag(s / (s^2 + lam)) U^T y from the SVD U diag(s) V^T of X F
    (F the Cholesky factor of Sigma_w, the identity by default). lam = 0 is least squares: OLS for
    n >= d, the minimum-norm interpolant (in the metric Sigma_w^-1) for n < d; singular values
    below max(n, d) eps s_max then count as zero, as in numpy's pinv. lam = noise_var is
    bayes_predict. Each prompt is solved scale-free: with X = s_x X', x_q = s_q x_q', y = s_y y',
    y_hat = (s_y s_q / s_x) <w', x_q'> for w' the ridge of (X', y') at lam / s_x^2, the scales (and a
    penalty above 1) multiplied from their binary exponents, so no square or product of scales over-
    or underflows at any scale of the data; likewise Sigma_w = c_w W is the ridge of W at lam / c_w.
    A prediction beyond float64 is a ValueError. Z: (B, d+1, n+1); lam >= 0; Sigma_w (d, d) SPD or
    None. Returns y_hat (B,).
    """
    Z = _prompts(Z)
    lam = _nonneg("lam", lam)
    d = Z.shape[1] - 1
    S_w, F = _task_covariance(Sigma_w, d)
    # Sigma_w = c_w W (max |W| = 1): the ridge at (W, lam / c_w) has the same w_hat (v' = sqrt(c_w) v),
    # and X F no longer over- or underflows with Sigma_w (1e308 I overflowed s^2 silently)
    c_w = float(np.max(np.abs(S_w)))
    F = F / math.sqrt(c_w)
    X, y, x_q = _regression(Z)
    s_x, s_q, s_y = _scales(X, (1, 2)), _scales(x_q, 1), _scales(y, 1)
    X, x_q, y = X / s_x[:, None, None], x_q / s_q[:, None], y / s_y[:, None]
    U, s, Vt = np.linalg.svd(X @ F, full_matrices=False)
    keep = s > (max(X.shape[1:]) * np.finfo(float).eps * s[:, :1] if lam == 0 else 0.0)
    m, e = _exponents([s_y, s_q], [s_x])
    if lam == 0:
        shrink = np.divide(1.0, s, out=np.zeros_like(s), where=keep)
    else:   # 1/p = c_w s_x^2 / lam; a penalty p > 1 leaves s / (s^2 + p) = (1/p) s / (s^2/p + 1), its 1/p
        m_p, e_p = _exponents([c_w, s_x, s_x], [lam])       # joining the scales however small it is
        with np.errstate(over="ignore"):                  # 1/p = inf: no penalty to speak of
            inv_p = np.ldexp(m_p, e_p)
        big = inv_p < 1
        s2 = np.where(big[:, None], s ** 2 * inv_p[:, None], s ** 2)
        shrink = np.divide(s, s2 + np.where(big, 1.0, 1 / np.maximum(inv_p, 1))[:, None], out=np.zeros_like(s),
                           where=keep)
        m, e = np.where(big, m * m_p, m), np.where(big, e + e_p, e)
    v = np.einsum("bkd,bk->bd", Vt, shrink * np.einsum("bnk,bn->bk", U, y))
    with np.errstate(over="ignore"):                # an overflow is refused below, by name
        y_hat = np.ldexp(m * np.einsum("bd,bd->b", v @ F.T, x_q), e)
    _finite({"the prediction": y_hat}, "rescale the prompts", Z=Z)
    return y_hat


@_numpy_rules
def bayes_predict(Z, Sigma_w=None, noise_var=0.0):
    """The posterior mean of y_q for w_star ~ N(0, Sigma_w) and label noise N(0, noise_var): the
    Bayes-optimal prediction under squared loss for that prior, whatever the law of the covariates.
    It is ridge_predict(Z, noise_var, Sigma_w) (MATH.md §15); noise_var = 0 interpolates.
    Z: (B, d+1, n+1). Returns y_hat (B,)."""
    return ridge_predict(Z, _nonneg("noise_var", noise_var), Sigma_w)


@_numpy_rules
def dmmse_predict(Z, tasks, noise_var):
    """The posterior mean of y_q when w_star is a uniformly drawn row of the pool tasks (K, d) and
    the labels carry noise N(0, noise_var) (MATH.md §15):

        y_hat = sum_k pi_k <w_k, x_q>,   pi_k proportional to exp(-|y - X w_k|^2 / (2 noise_var)).

    The squared residuals are formed from each prompt's data divided by c = max(|y|, |X| |tasks|),
    and the log-weights -(|y - X w_k|^2 - min_j |y - X w_j|^2) / (2 noise_var) are formed in logs,
    so the largest weight is exp(0) = 1 and neither c^2 nor 1 / noise_var overflows, at any scale
    of the data and however small noise_var. Z: (B, d+1, n+1); tasks: (K, d); noise_var > 0.
    Returns y_hat (B,).
    """
    Z = _prompts(Z)
    tasks = _pool(tasks, Z.shape[1] - 1)
    if _nonneg("noise_var", noise_var) == 0:
        raise ValueError("noise_var must be > 0: without noise the posterior over the pool is not a density")
    X, y, x_q = _regression(Z)
    K, n = tasks.shape[0], X.shape[1]
    c = np.maximum(_scales(y, 1), _scales(X, (1, 2)) * np.max(np.abs(tasks)))
    log_2var = math.log(2.0) + math.log(noise_var)
    y_hat = np.empty(Z.shape[0])
    step = max(1, 2 ** 22 // (K * max(n, tasks.shape[1])))    # (step, K, n) temporaries of at most 32 MB
    for b in range(0, Z.shape[0], step):
        cb = c[b:b + step]
        R = (y[b:b + step] / cb[:, None])[:, None, :] - np.einsum("bnd,kd->bkn", X[b:b + step] / cb[:, None, None], tasks)
        gap = np.sum(R * R, axis=2)                            # |y - X w_k|^2 / c^2
        gap -= np.min(gap, axis=1, keepdims=True)
        with np.errstate(divide="ignore", over="ignore"):       # gap 0: log 0 = -inf, weight exp(0) = 1
            pi = np.exp(-np.exp(np.log(gap) + 2 * np.log(cb)[:, None] - log_2var))
        y_hat[b:b + step] = np.sum(pi * (x_q[b:b + step] @ tasks.T), axis=1) / np.sum(pi, axis=1)
    _finite({"the prediction": y_hat}, "rescale the prompts", Z=Z, tasks=tasks)
    return y_hat


# ---------------------------------------------------------------------------------------------
# §15 Risks: exact where a closed form exists, Monte Carlo elsewhere
# ---------------------------------------------------------------------------------------------

def _isotropic(S):
    """The c of S = c I, or None when S is not a multiple of the identity (to 1e-12 of its scale)."""
    c = np.trace(S) / S.shape[0]
    return c if np.max(np.abs(S - c * np.eye(S.shape[0]))) <= 1e-12 * abs(c) else None


def _risk(excess, query):
    """The risk excess + query (Python floats, noise_var d / (n - d - 1) formed ratio first), or a
    ValueError when it overflows float64."""
    risk = excess + query
    if not math.isfinite(risk):
        raise ValueError("the risk overflows float64 (noise_var times the closed form's ratio, plus the "
                         "query's noise_var): rescale y")
    return float(risk)


@_numpy_rules
def ols_population_risk(n, Sigma, Sigma_w=None, noise_var=0.0, query_noise=True):
    """Exact E (y_hat - y_q)^2 of least squares, ridge_predict(Z, 0), where it has a closed form
    (MATH.md §15), for x ~ N(0, Sigma), w_star ~ N(0, Sigma_w), label noise of variance noise_var:

        n >= d:  noise_var d / (n - d - 1)                        (n > d + 1 when noise_var > 0)
        n <  d:  c s (d - n) + noise_var n / (d - n - 1)          (Sigma = c I, Sigma_w = s I;
                                                                    n < d - 1 when noise_var > 0)

    plus noise_var when query_noise. Elsewhere the risk is infinite (n in d-1..d+1 with noise) or
    has no closed form (n < d, anisotropic): a ValueError points to monte_carlo_risk. A bias c s (d - n)
    outside float64's normal range, or a risk beyond float64, is a ValueError naming it. Returns a float.
    """
    n = _int("n", n, 1)
    Sigma = _spd("Sigma", Sigma)[0]
    d = Sigma.shape[0]
    Sigma_w = _task_covariance(Sigma_w, d)[0]
    noise_var = _nonneg("noise_var", noise_var)
    query = noise_var if _flag("query_noise", query_noise) else 0.0
    if noise_var > 0 and d - 1 <= n <= d + 1:
        raise ValueError(f"n must be < d - 1 or > d + 1 when noise_var > 0: the risk of least squares is "
                         f"infinite at n = {n}, d = {d}")
    if n >= d:
        return _risk(noise_var * (d / (n - d - 1)) if noise_var > 0 else 0.0, query)
    c, s = _isotropic(Sigma), _isotropic(Sigma_w)
    if c is None or s is None:
        raise ValueError("Sigma and Sigma_w must be multiples of the identity for n < d: the risk of the "
                         "minimum-norm interpolant has no closed form otherwise; use monte_carlo_risk")
    with np.errstate(over="ignore", under="ignore"):
        bias = c * s * (d - n)
    if not np.finfo(np.float64).tiny <= bias < math.inf:        # c, s > 0: the bias is never 0 in the mathematics
        raise ValueError(f"the bias c s (d - n) overflows float64 or underflows below its normal range "
                         f"(Sigma = {c:.3g} I, Sigma_w = {s:.3g} I): rescale x or w_star")
    return _risk(bias + (noise_var * (n / (d - n - 1)) if noise_var > 0 else 0.0), query)


@_numpy_rules
def monte_carlo_risk(predict, rng, batch, n, Sigma, Sigma_w=None, noise_var=0.0, tasks=None):
    """E (predict(Z) - y_q)^2 by Monte Carlo over prompts from icl_ref.sample_prompts (query noise
    included), with its standard error std / sqrt(batch) (MATH.md §15). predict: a function of Z
    (b, d+1, n+1) returning (b,), called on chunks of at most 4096 prompts. batch >= 2; the other
    arguments as sample_prompts (noise_var = noise_std^2). Returns (risk, standard error).
    """
    if not callable(predict):
        raise TypeError(f"predict must be a function of Z, got {type(predict).__name__}")
    _rng(rng)
    batch = _int("batch", batch, 2)
    noise_std = math.sqrt(_nonneg("noise_var", noise_var))
    errors = []
    for b in range(0, batch, 4096):
        Z, y = ir.sample_prompts(rng, min(4096, batch - b), n, Sigma, Sigma_w, noise_std, tasks=tasks)
        y_hat = _array("predict(Z)", predict(Z), 1)
        if y_hat.shape != y.shape:
            raise ValueError(f"predict(Z) must have shape {y.shape}, got {y_hat.shape}")
        with np.errstate(over="ignore"):            # an overflow is caught below, by name
            error = (y_hat - y) ** 2
        if not np.all(np.isfinite(error)):
            raise ValueError("predict(Z)'s squared error overflows float64 (largest |predict(Z)| "
                             f"{np.max(np.abs(y_hat)):.3g}): the risk is not a float64 number")
        errors.append(error)
    errors = np.concatenate(errors)
    top = float(np.max(errors))        # scaled by it, the squared deviations neither under- nor overflow
    if top == 0:
        return 0.0, 0.0
    return float(np.mean(errors / top)) * top, float(np.std(errors / top, ddof=1) / math.sqrt(batch)) * top


@_numpy_rules
def shifted_single_layer_loss(Gamma, Sigma, n, Sigma_w=None, noise_var=0.0, query_noise=True,
                              Sigma_query=None, tasks=None):
    """Exact E (y_hat - y_q)^2 of the one-layer sparse model with A_0 = Gamma, any (d, d) (trained at
    another length, covariance or task law), on prompts of n context examples x_i ~ N(0, Sigma),
    a query x_q ~ N(0, Sigma_query) (Sigma when None), w_star with second moment
    M = E[w_star w_star^T] (Sigma_w, SPD, or the pool's (1/K) sum_k w_k w_k^T for tasks (K, d)) and
    label noise of variance noise_var (MATH.md §8, §15):

        L = tr(Sigma_q Gamma^T K Gamma) - 2 tr(Sigma_q Gamma^T Sigma M) + tr(Sigma_q M)
            + noise_var [if query_noise],
        K = ((n+1)/n) Sigma M Sigma + ((tr(M Sigma) + noise_var)/n) Sigma.

    The layer divides by the prompt's own n (MATH.md §2). icl_ref.single_layer_population_loss is
    the case Sigma_query = Sigma with a Gaussian w_star; both compute it scale-free (a loss outside
    float64's normal range is a ValueError). Returns a float.
    """
    n = _int("n", n, 1)
    Sigma = _spd("Sigma", Sigma)[0]
    d = Sigma.shape[0]
    moment = _task_moment(Sigma_w, tasks, d)
    noise_var = _nonneg("noise_var", noise_var)
    S_q = Sigma if Sigma_query is None else _spd("Sigma_query", Sigma_query, d)[0]
    Gamma = _array("Gamma", Gamma, 2)
    if Gamma.shape != Sigma.shape:
        raise ValueError(f"Gamma must have shape {Sigma.shape} to match Sigma, got {Gamma.shape}")
    return _single_layer_loss(Gamma, Sigma, moment, S_q, n, noise_var, _flag("query_noise", query_noise))
