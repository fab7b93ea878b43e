"""icl_looped: looped (weight-tied) models and one layer's gradient flow, beyond the paper (MATH.md §14).

Built on icl_ref's public names (and the few private ones its PRIVATE_API lists). A looped model
applies one layer's coordinates L times: icl_ref's trainers, structure functions and Jacobian take
`tied=True` for it; this module holds what is specific to the looped question:

    optimal_tied_family(L, n, d, blocks=False)     the best looped member of Theorems 3-4's families
    one_layer_population_grad(u, U, Sigma, n)      one layer's exact loss and gradient in Zhang, Frei
                                                   and Bartlett's coordinates (u, U)
    one_layer_gradient_flow(Sigma, n, sigma, t)    the exact gradient flow of that loss from their
                                                   initialisation

Sections follow MATH.md §14. float64 throughout; numpy and scipy only.
"""
import math

import numpy as np
import scipy.integrate

import icl_ref as ir
from icl_ref import _array, _family_search, _int, _nonneg, _numpy_rules, _single_layer_moments, _spd, \
    _task_covariance

__version__ = ir.__version__


# ---------------------------------------------------------------------------------------------
# §14 The looped family optimum
# ---------------------------------------------------------------------------------------------

@_numpy_rules
def optimal_tied_family(L, n, d, blocks=False, noise_var=0.0, starts=8, rng=None):
    """Best looped member of the families of Theorems 3 and 4: A_l = a Sigma^-1 for every l (and
    B_l = b I with blocks), one (a, b) applied L times, by multi-start L-BFGS-B on the exact
    Gauss rule (as icl_ref.optimal_family_scalars) with the layers' gradient summed (MATH.md §14).
    Noiseless sparse: the loss is strictly convex in a, so its minimiser is unique. Starts
    a ~ U(0, 2), b ~ U(0, 1.5) from rng (default seed 0). Returns (a, b or None, loss): floats,
    b NaN when L = 1 (B_0 never enters), loss = icl_ref.family_population_loss at (a 1_L, b 1_L).
    """
    best, (L, n, d, noise_var) = _family_search(L, n, d, blocks, noise_var, starts, rng, tied=True)
    a = float(best[0])
    b = (float(best[1]) if L > 1 else math.nan) if blocks else None
    loss = ir.family_population_loss(np.full(L, a), n, d, None if b is None else np.full(L, b), noise_var=noise_var)
    return a, b, loss


# ---------------------------------------------------------------------------------------------
# §14 One layer's gradient flow from Zhang, Frei and Bartlett's initialisation
# ---------------------------------------------------------------------------------------------

def _one_layer_field(u, U, Sigma, K, E_hw):
    """(L - L(0), dL/du, dL/dU) of the layer P = u e_d e_d^T, Q = -[[U, 0], [0, 0]] through
    Gamma = u U: grad_Gamma = 2 (K Gamma Sigma - E[h w^T] Sigma) (MATH.md §8, §14)."""
    Gamma = u * U
    G = 2 * (K @ Gamma @ Sigma - E_hw @ Sigma)
    excess = np.trace(Sigma @ Gamma.T @ K @ Gamma) - 2 * np.trace(Sigma @ Gamma.T @ E_hw)
    return excess, float(np.sum(G * U)), u * G


def _one_layer_hessian(u, U, Sigma, K, E_hw):
    """The Hessian of the loss in y = (u, vec U) (row-major vec), (1 + d^2, 1 + d^2), differentiating
    _one_layer_field once more (MATH.md §14): with G = grad_Gamma and dG = 2 K dGamma Sigma,
    d2L/du2 = <2 K U Sigma, U>, d2L/du dU = G + 2 u K U Sigma, d2L/dU2 = 2 u^2 (K kron Sigma)."""
    G = 2 * (K @ (u * U) @ Sigma - E_hw @ Sigma)
    KUS = 2 * K @ U @ Sigma
    cross = (G + u * KUS).ravel()
    return np.block([[np.array([[np.sum(KUS * U)]]), cross[None, :]],
                     [cross[:, None], 2 * u ** 2 * np.kron(K, Sigma)]])


def _noiseless_moments(Sigma, n, Sigma_w):
    """(Sigma, Sigma_w, K, E[h w^T]) of MATH.md §8, checked, for noiseless labels."""
    n = _int("n", n, 1)
    Sigma = _spd("Sigma", Sigma)[0]
    Sigma_w = _task_covariance(Sigma_w, Sigma.shape[0])[0]
    return (Sigma, Sigma_w, *_single_layer_moments(Sigma, n, Sigma_w, 0.0))


@_numpy_rules
def one_layer_population_grad(u, U, Sigma, n, Sigma_w=None):
    """Exact population loss of one layer P = u e_d e_d^T, Q = -[[U, 0], [0, 0]] (noiseless
    labels; Zhang, Frei and Bartlett's value scalar and key-query block) and its gradient in (u, U),
    the chain rule of icl_ref.single_layer_population_loss through Gamma = u U (MATH.md §14).
    u: float; U: (d, d); Sigma, Sigma_w: (d, d) SPD. Returns (loss, du (float), dU (d, d)); the
    gradient of icl_ref.full_layer_population_loss in every other entry of (P, Q) is 0 there.
    """
    u = float(_array("u", u, 0))
    Sigma, Sigma_w, K, E_hw = _noiseless_moments(Sigma, n, Sigma_w)
    U = _array("U", U, 2)
    if U.shape != Sigma.shape:
        raise ValueError(f"U must have shape {Sigma.shape} to match Sigma, got {U.shape}")
    excess, du, dU = _one_layer_field(u, U, Sigma, K, E_hw)
    return float(excess + np.trace(Sigma @ Sigma_w)), du, dU


def _tolerance(rtol):
    """rtol as a float in [1e-13, 0.1]: below, float64 cannot honour it (SciPy raises it to 100 eps
    itself); NaN, 0 or a string would stall or break the solver."""
    if isinstance(rtol, bool) or not isinstance(rtol, (int, float, np.integer, np.floating)):
        raise TypeError(f"rtol must be a real number, got {type(rtol).__name__}")
    if not 1e-13 <= rtol <= 0.1:
        raise ValueError(f"rtol must be between 1e-13 and 0.1, got {rtol}")
    return float(rtol)


@_numpy_rules
def one_layer_gradient_flow(Sigma, n, sigma, t, Theta=None, Sigma_w=None, rtol=1e-12):
    """Gradient flow d(u, U)/dt = -grad L of the exact one-layer population loss (icl_ref's loss, a
    mean without 1/2) from Zhang, Frei and Bartlett's initialisation (MATH.md §14):

        u(0) = sigma,  U(0) = sigma Theta Theta^T / |Theta Theta^T|_F,

    i.e. P(0) = sigma e_d e_d^T, Q(0) = -sigma [[Theta Theta^T, 0], [0, 0]] (their W^PV, W^KQ with
    |Theta Theta^T|_F = 1; the flow keeps every other entry of (P, Q) at 0). Integrated by
    scipy.integrate.solve_ivp's LSODA, which switches from Adams steps to implicit BDF steps when the
    flow turns stiff (its rates differ by the spread of K and Sigma), with the exact Hessian as its
    Jacobian: once the flow has converged its steps grow, so the cost stops growing with t. rtol in
    [1e-13, 0.1]; atol = rtol / 100 of the state's scale. BDF does not conserve the invariant
    exactly: it drifts by about the accumulated local error, rtol times the evaluations.
    Sigma, Sigma_w: (d, d) SPD; n >= 1; sigma > 0; t: increasing times >= 0, (T,); Theta: (d, d),
    nonzero (default I). Returns a dict: t (T,), u (T,), U (T, d, d), Gamma (T, d, d) = u U (the
    effective preconditioner: y_hat = h^T Gamma x_q), loss (T,), invariant (T,) = u^2 - |U|_F^2
    (conserved; 0 here), sigma_bound = sqrt(2 / (sqrt(d) |Gamma*^-1|_2)) with Gamma* =
    gamma_star(Sigma, n, Sigma_w) (for Sigma_w = I the initial scale below which their Theorem 4.1
    proves convergence), nfev.
    """
    Sigma, Sigma_w, K, E_hw = _noiseless_moments(Sigma, n, Sigma_w)
    d = Sigma.shape[0]
    sigma = _nonneg("sigma", sigma)
    if sigma == 0:
        raise ValueError("sigma must be > 0: (u, U) = 0 is a critical point of the loss, where the flow stays")
    t = _array("t", t, 1)
    if t.size < 1 or t[0] < 0 or np.any(np.diff(t) <= 0):
        raise ValueError(f"t must be a non-empty increasing vector of times >= 0, got {t}")
    Theta = np.eye(d) if Theta is None else _array("Theta", Theta, 2)
    if Theta.shape != (d, d) or not np.any(Theta):
        raise ValueError(f"Theta must be a nonzero ({d}, {d}) matrix, got shape {Theta.shape}")
    rtol = _tolerance(rtol)
    Theta = Theta / np.max(np.abs(Theta))               # Theta Theta^T neither over- nor underflows
    M = Theta @ Theta.T
    y0 = sigma * np.r_[1.0, (M / np.linalg.norm(M)).ravel()]
    # the state's scale from start to rest (u^2 ~ |U| ~ |Gamma*|^(1/2) at rest): an absolute tolerance
    # below 1e-2 rtol of it would ask for less than the field's own rounding there, and the implicit
    # steps would shrink without end once the flow rests
    scale = max(sigma, math.sqrt(np.max(np.abs(np.linalg.solve(K, E_hw)))))

    def field(_, y):
        _, du, dU = _one_layer_field(y[0], y[1:].reshape(d, d), Sigma, K, E_hw)
        return -np.r_[du, dU.ravel()]

    def jacobian(_, y):
        return -_one_layer_hessian(y[0], y[1:].reshape(d, d), Sigma, K, E_hw)
    ys = y0[:, None]
    if t[-1] > 0:
        with np.errstate(over="ignore", invalid="ignore"):
            sol = scipy.integrate.solve_ivp(field, (0.0, t[-1]), y0, method="LSODA", t_eval=t, rtol=rtol,
                                            atol=rtol * 1e-2 * scale, jac=jacobian)
        if not np.all(np.isfinite(sol.y)):
            raise ValueError(f"the flow overflowed float64 (sigma = {sigma:.3g}, max |Sigma| = "
                             f"{np.max(np.abs(Sigma)):.3g}): start smaller or rescale x")
        if not sol.success:
            raise ValueError(f"solve_ivp failed: {sol.message}")
        ys = sol.y
    u, U = ys[0], ys[1:].T.reshape(-1, d, d)
    Gamma = u[:, None, None] * U
    base = np.trace(Sigma @ Sigma_w)
    loss = np.array([base + _one_layer_field(1.0, G, Sigma, K, E_hw)[0] for G in Gamma])
    gamma_inv = np.linalg.solve(E_hw, K)                       # Gamma*^-1 = (Sigma Sigma_w)^-1 K
    return dict(t=t, u=u, U=U, Gamma=Gamma, loss=loss, invariant=u ** 2 - np.sum(U ** 2, axis=(1, 2)),
                sigma_bound=math.sqrt(2 / (math.sqrt(d) * np.linalg.norm(gamma_inv, 2))),
                nfev=int(sol.nfev) if t[-1] > 0 else 0)
