"""icl_ref: a NumPy reference for the linear transformer of Ahn, Cheng, Daneshmand and Sra (2023).

"Transformers learn to implement preconditioned gradient descent for in-context learning",
NeurIPS 2023 (arXiv 2306.00297), cited below as [A]. Equation and section numbers refer to
[A]; "MATH.md §k" is section k of MATH.md beside this file, which derives every formula below.
Everything is float64 NumPy; gradients are derived by hand and checked in test_icl_ref.py.

Symbols (the paper's names; 0-based indices in code)
    B        batch size (number of prompts); the block parameter is called ``Bm`` in code
    d        covariate dimension, D = d + 1 the token dimension
    n        number of context examples; a prompt has n + 1 tokens, the last is the query
    L, H     layers, heads
    Z        prompts, (B, D, n+1); column i < n is z_i = [x_i; y_i], column n is [x_q; 0]
    M        mask diag(1, ..., 1, 0), (n+1, n+1): the query is never a key or a value
    P, Q     parameters, (L, H, D, D); P = W_v and Q = W_k^T W_q of eq. (3)
    S        Gram matrix Z M Z^T, (B, D, D); q the query column Z[:, :, n], (B, D)
    T        the layer's token map I + (1/n) sum_h P_h S Q_h, (B, D, D)
    A, Bm    free d x d blocks of the structures (8) and (11), (L, d, d)
    Sigma    covariance of x, (d, d); Sigma_w covariance of w_star, (d, d)
    Gamma    top-left block of -Q for one layer (Theorem 1), (d, d)

Conventions (MATH.md §1-§3, §5)
    layer       Z <- Z + (1/n) sum_h P_h Z M Z^T Q_h Z        [A] eq. (3)-(4), heads summed
    prediction  y_hat = -Z_L[d, n]                             [A] §2
    loss        mean_b (Z_L[b, d, n] + y_b)^2                   a mean, no factor 1/2
    sparse (8)  P_l = [[0, 0], [0, 1]],   Q_l = -[[A_l, 0], [0, 0]]
    blocks (11) P_l = [[B_l, 0], [0, 1]], Q_l = -[[A_l, 0], [0, 0]]   (the sign of (8))

Sections, as MATH.md's: §1 data, §2 model, §3 loss and gradient (§3.1 the per-prompt Jacobian),
§4 attention with an activation ([A] §6), §5 parametrisations, §6 training, §7-§10 closed forms,
§11 metrics; then the engine seam. One formulation of each quantity, serial, no file I/O, no
process-wide state; every public function computes under numpy's default
floating-point rules whatever the caller set with np.seterr. A gradient's path: loss_and_grad ->
_loss_and_grad_gram -> _propagate -> layer_forward, readout_forward; _backpropagate ->
readout_backward, layer_backward. `engine=`: None for this module's functions, or an object with
ReferenceEngine's five methods computing the same numbers its own way (icl_fast.engine()).

icl_check (the conformance kit, with the adapters to other code's layouts: §12-§13), icl_looped
(§14), icl_estimators (§15) and icl_fast (§16) build on this module; the names that moved to them in
0.4.0 are reachable here for one release."""
import functools
import itertools
import math
import sys
import time
from fractions import Fraction

import numpy as np
import scipy
import scipy.linalg
import scipy.optimize

__version__ = "0.4.0"         # pyproject.toml's, CITATION.cff's and the other modules' too
STRUCTURES = ("sparse", "blocks", "full")                # [A] (8), (11) and free (P, Q): MATH.md §5
ACTIVATIONS = ("linear", "relu", "softmax", "softmax_all")   # the attention's sigma: MATH.md §4
PAPER_EIGENVALUES = (1.0, 1.0, 0.25, 0.0625, 1.0)   # spectrum of Sigma in [A] §4.3 (MATH.md §1)


# Input checks (no mathematics): every public function validates its arguments before it computes. ---

def _numpy_rules(fn):
    """fn run under the caller's floating-point rules with underflow ignored and "raise" (or "call",
    "log") made "warn": the library's arithmetic never raises FloatingPointError, so a caller with
    np.seterr(all="raise") gets the same results; nested calls keep the rules of the outer one (a
    function that expects overflow ignores it and checks the result); the caller's settings are
    restored on return."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        rules = {k: "warn" if v in ("raise", "call", "log") else v for k, v in np.geterr().items()}
        with np.errstate(**{**rules, "under": "ignore"}):
            return fn(*args, **kwargs)
    return run


def _array(name, a, ndim, allow_nan=False):
    """a as a float64 array with `ndim` dimensions (an int or a tuple of allowed ones) and finite
    entries (NaN allowed where allow_nan), or a TypeError/ValueError naming `name`."""
    try:
        arr = np.asarray(a)
    except Exception as e:                     # ragged lists and the like
        raise TypeError(f"{name} must be a numeric array, got {type(a).__name__} ({e})") from None
    if arr.dtype == bool or not (np.issubdtype(arr.dtype, np.integer)
                                 or np.issubdtype(arr.dtype, np.floating)):
        raise TypeError(f"{name} must be a real integer or float array, got dtype {arr.dtype}")
    ndims = (ndim,) if isinstance(ndim, int) else ndim
    if ndim is not None and arr.ndim not in ndims:
        raise ValueError(f"{name} must have {' or '.join(map(str, ndims))} dimensions, got shape {arr.shape}")
    arr = arr.astype(np.float64, copy=False)
    with np.errstate(over="ignore", invalid="ignore"):       # NaN and Inf poison the sum: one pass
        clean = np.isfinite(np.sum(arr))
    if not clean and np.any(np.isinf(arr) if allow_nan else ~np.isfinite(arr)):   # a second only where it is not
        raise ValueError(f"{name} must be finite, found {'Inf' if allow_nan else 'NaN or Inf'}")
    return arr


def _int(name, v, minimum):
    """v as a Python int in [minimum, 2^53] (float64 holds every integer up to 2^53 exactly, and the
    formulas divide by n), else a TypeError/ValueError naming `name`."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {type(v).__name__}")
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    if v > 2 ** 53:
        raise ValueError(f"{name} must be <= 2^53 (float64 holds every integer up to there), got an integer of "
                         f"{len(str(v))} digits")
    return int(v)


def _nonneg(name, v):
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a real number, got {type(v).__name__}")
    if not (math.isfinite(v) and v >= 0):
        raise ValueError(f"{name} must be finite and >= 0, got {v}")
    return float(v)


def _rng(rng, optional=False):
    """rng itself, a numpy Generator (None allowed where optional), or a TypeError."""
    if not (isinstance(rng, np.random.Generator) or (optional and rng is None)):
        raise TypeError(f"rng must be a numpy.random.Generator{' or None' if optional else ''}, "
                        f"got {type(rng).__name__}")
    return rng


_ENGINE_METHODS = ("gram", "loss_and_grad_gram", "jacobian_gram", "activation_pass", "reduced_least_squares")


def _engine(engine):
    """engine: None or an evaluator with ReferenceEngine's methods, else a TypeError naming what it lacks."""
    missing = [m for m in _ENGINE_METHODS if not callable(getattr(engine, m, None))]
    if engine is not None and missing:
        raise TypeError(f"engine must be None or an evaluator with the methods of icl_ref.REFERENCE (e.g. "
                        f"icl_fast.engine()), got {type(engine).__name__} without {', '.join(missing)}")
    return engine


def _params(P, Q, names=("P", "Q")):
    """P, Q as float64 (L, H, D, D) arrays of equal shape with L, H >= 1 and D >= 2; errors name
    the caller's arguments (`names`, e.g. dP, dQ)."""
    P, Q = _array(names[0], P, 4), _array(names[1], Q, 4)
    for name, X in zip(names, (P, Q)):
        L, H, D, D2 = X.shape
        if L < 1 or H < 1 or D < 2 or D != D2:
            raise ValueError(f"{name} must have shape (L, H, d+1, d+1) with L, H >= 1 and d >= 1, "
                             f"got {X.shape}")
    if P.shape != Q.shape:
        raise ValueError(f"{names[0]} and {names[1]} must have the same shape (L, H, d+1, d+1), "
                         f"got {P.shape} and {Q.shape}")
    return P, Q


def _finite(results, law="", **sizes):
    """A ValueError saying that float64 overflowed, at what size of the inputs and what to do (`law`:
    by default the growth law of L layers, MATH.md §3), unless every array of results is finite."""
    for what, value in results.items():
        if not np.all(np.isfinite(value)):
            size = ", ".join(f"max |{k}| = {np.max(np.abs(v)):.3g}" for k, v in sizes.items())
            law = law or ("the output of L layers grows like (|P| |Q| |Z|^2)^((3^L - 1)/2) |Z|, so use smaller "
                          "parameters or rescale Z")
            raise ValueError(f"{what} is not finite: float64 overflowed ({size}); {law}")


def _prompts(Z, D=None, name="Z"):
    """Z as a float64 (B, D, n+1) array with B >= 1, n >= 1 (and D matching the parameters)."""
    Z = _array(name, Z, 3)
    B, D_Z, N = Z.shape
    if B < 1 or D_Z < 2 or N < 2:
        raise ValueError(f"{name} must have shape (B, d+1, n+1) with B >= 1, d >= 1, n >= 1, got {Z.shape}")
    if D is not None and D_Z != D:
        raise ValueError(f"{name} has token dimension d+1 = {D_Z} but P, Q have d+1 = {D}: "
                         f"{name} must have shape (B, {D}, n+1), got {Z.shape}")
    return Z


def _choice(name, value, choices):
    """value if it is one of the strings `choices`, else a ValueError naming `name`."""
    if not (isinstance(value, str) and value in choices):
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def _labels(y, B):
    y = _array("y", y, 1)
    if y.shape != (B,):
        raise ValueError(f"y must have shape (B,) = ({B},) to match Z, got {y.shape}")
    return y


def _batch(structure, activation, Z, y):
    """Z (B, D, n+1) and y (B,) checked as a training batch, with the structure and activation named."""
    _choice("structure", structure, STRUCTURES)
    _choice("activation", activation, ACTIVATIONS)
    Z = _prompts(Z)
    return Z, _labels(y, Z.shape[0])


def _model_inputs(P, Q, Z, *y):
    """P, Q (L, H, D, D), Z (B, D, n+1) and, when given, y (B,), checked as one call's inputs."""
    P, Q = _params(P, Q)
    Z = _prompts(Z, P.shape[2])
    return (P, Q, Z, *(_labels(labels, Z.shape[0]) for labels in y))


def _spd(name, Sigma, d=None):
    """Sigma as a symmetric positive definite float64 (d, d) array; returns (Sigma, lower factor)."""
    Sigma = _array(name, Sigma, 2)
    if Sigma.shape[0] != Sigma.shape[1] or Sigma.shape[0] < 1:
        raise ValueError(f"{name} must be a square (d, d) matrix, got shape {Sigma.shape}")
    if d is not None and Sigma.shape[0] != d:
        raise ValueError(f"{name} must have shape ({d}, {d}), got {Sigma.shape}")
    # Products such as U diag U^T are symmetric only to rounding: allow 1e-12 of the largest entry.
    if np.max(np.abs(Sigma - Sigma.T)) > 1e-12 * np.max(np.abs(Sigma)):
        raise ValueError(f"{name} must be symmetric")
    Sigma = Sigma / 2 + Sigma.T / 2                       # no overflow near the float64 limit
    try:
        F = np.linalg.cholesky(Sigma)
    except np.linalg.LinAlgError:
        raise ValueError(f"{name} must be positive definite") from None
    return Sigma, F


def _task_covariance(Sigma_w, d):
    """(Sigma_w, its lower factor): the identity when Sigma_w is None, else checked as _spd."""
    return (np.eye(d), np.eye(d)) if Sigma_w is None else _spd("Sigma_w", Sigma_w, d)


def _pool(tasks, d, Sigma_w=None):
    """tasks as a float64 (K, d) pool with K >= 1, refused beside a Sigma_w (one task law at a time)."""
    if Sigma_w is not None:
        raise ValueError("give Sigma_w or tasks, not both: w_star is drawn from the pool when tasks is given")
    tasks = _array("tasks", tasks, 2)
    if tasks.shape[0] < 1 or tasks.shape[1] != d:
        raise ValueError(f"tasks must have shape (K, {d}) with K >= 1, got {tasks.shape}")
    return tasks


def _task_moment(Sigma_w, tasks, d):
    """E[w_star w_star^T] = w W, (d, d), as (W, w) with max |W| = 1 (W = 0, w = 1 for a pool of zero
    tasks), so that no square under- or overflows: Sigma_w (SPD, the identity when None) or, for a
    pool (K, d), its second moment (1/K) sum_k w_k w_k^T, which may be singular (MATH.md §15)."""
    if tasks is None:
        Sigma_w = _task_covariance(Sigma_w, d)[0]
        w = np.max(np.abs(Sigma_w))
        return Sigma_w / w, w
    tasks = _pool(tasks, d, Sigma_w)
    m = np.max(np.abs(tasks)) or 1.0
    W = (tasks / m).T @ (tasks / m) / tasks.shape[0]
    w = np.max(np.abs(W)) or 1.0
    with np.errstate(over="ignore", under="ignore"):           # w out of range: said where it is used
        return W / w, w * m * m


def _flag(name, value):
    """value as a bool if it is one (Python's or numpy's), else a TypeError naming `name`: a string
    such as "no" is not taken as True."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__}")
    return bool(value)


# §1 Data ([A] §2) ------------------------------------------------------------------------------

@_numpy_rules
def sample_prompts(rng, batch, n, Sigma, Sigma_w=None, noise_std=0.0, return_w_star=False, tasks=None):
    """Draw B prompts of linear regression, [A] §2 with the data model of [A] Table 1 (MATH.md §1).

    x_i ~ N(0, Sigma) iid for i = 0..n (the last is the query), w_star ~ N(0, Sigma_w) per prompt
    (identity by default), y_i = <w_star, x_i> + noise_std * N(0, 1), Gaussians drawn through the
    Cholesky factor F of Sigma (x = F g). With a pool tasks (K, d) in place of Sigma_w, w_star is a
    uniformly drawn row of the pool (MATH.md §15). rng: a numpy Generator; batch = B >= 1, n >= 1.
    Returns Z (B, d+1, n+1) with the query label slot Z[:, d, n] = 0, y (B,) the query's label (noise
    included) and, with return_w_star, w_star (B, d)."""
    _rng(rng)
    batch, n = _int("batch", batch, 1), _int("n", n, 1)
    Sigma, F = _spd("Sigma", Sigma)
    d = Sigma.shape[0]
    pool = None if tasks is None else _pool(tasks, d, Sigma_w)
    F_w = _task_covariance(Sigma_w, d)[1] if pool is None else None
    noise_std, return_w_star = _nonneg("noise_std", noise_std), _flag("return_w_star", return_w_star)
    X = rng.standard_normal((batch, n + 1, d)) @ F.T                 # rows x_i ~ N(0, F F^T)
    w_star = (rng.standard_normal((batch, d)) @ F_w.T if pool is None
              else pool[rng.integers(pool.shape[0], size=batch)])    # a uniformly drawn row per prompt
    labels = np.einsum("bid,bd->bi", X, w_star)
    if noise_std > 0:
        labels += noise_std * rng.standard_normal((batch, n + 1))
    Z = np.concatenate([X.transpose(0, 2, 1), labels[:, None, :]], axis=1)
    y = labels[:, n].copy()
    Z[:, d, n] = 0.0
    if not (np.all(np.isfinite(Z)) and np.all(np.isfinite(y))):
        raise ValueError("the drawn prompts are not finite: Sigma (or Sigma_w, noise_std) is too large "
                         f"for float64 (max |Sigma| = {np.max(np.abs(Sigma)):.3g})")
    return (Z, y, w_star) if return_w_star else (Z, y)


@_numpy_rules
def rotated_covariance(rng, eigenvalues=PAPER_EIGENVALUES):
    """Sigma = U diag(eigenvalues) U^T with U Haar-random orthogonal ([A] §4.3, MATH.md §1).

    U is the Q factor of a Gaussian matrix with the signs of diag(R) folded in, which makes it
    exactly Haar (the authors' code uses SVD of a uniform matrix, not Haar: MATH.md §1).
    Returns Sigma (d, d) and U (d, d)."""
    _rng(rng)
    lam = _array("eigenvalues", eigenvalues, 1)
    if lam.size < 1 or np.any(lam <= 0):
        raise ValueError(f"eigenvalues must be a non-empty vector of positive numbers, got {lam}")
    U, R = np.linalg.qr(rng.standard_normal((lam.size, lam.size)))
    U = U * np.sign(np.diag(R))
    return (U * lam) @ U.T, U


# §2 Model ([A] eq. (3)-(4)) --------------------------------------------------------------------
# Since M removes the query column from the keys and values, one layer is
#     Z_{l+1} = Z_l + (1/n) sum_h P_h (Z_l M Z_l^T) Q_h Z_l = T_l Z_l,
#     T_l = I + (1/n) sum_h P_h S_l Q_h,   S_l = Z_l M Z_l^T   (D x D, never (n+1) x (n+1)).
# Every column moves by the same T_l, so S_{l+1} = T_l S_l T_l^T and q_{l+1} = T_l q_l for the
# query column q. The prediction reads only row d of the last T: (T q)_d = q_d + (1/n) sum_h
# p_h^T S Q_h q with p_h = P_h[d, :], the value row. A prompt enters only through (S_0, q_0).
#
# Stacks of D x D matrices are multiplied prompt by prompt (np.matmul), a factor shared by every prompt
# as one product of the stacked rows (_times, _summed), in chunks that keep BLAS on the calling thread
# (_chunks; MATH.md's notes on the code give the sizes).

def mask(n):
    """M = diag(1, ..., 1, 0) of shape (n+1, n+1) ([A] §2): the query is not a key or value.
    MATH.md §2."""
    n = _int("n", n, 1)
    return np.diag(np.r_[np.ones(n), 0.0])


@_numpy_rules
def forward_literal(P, Q, Z):
    """The paper's column form of eq. (4), token by token; the twin that tests the Gram form.

        z_j <- z_j + (1/n) sum_h P_h sum_{i<n} z_i (z_i^T Q_h z_j)   for every j <= n (query too)

    P, Q: (L, H, D, D); Z: (B, D, n+1). Returns Z_L (B, D, n+1). Cost O(B L H n^2 D^2). MATH.md §2."""
    P, Q, Z = _model_inputs(P, Q, Z)
    Z = Z.copy()
    L, H = P.shape[:2]
    n = Z.shape[2] - 1
    for l in range(L):
        Z_next = Z.copy()
        for j in range(n + 1):
            for h in range(H):
                for i in range(n):                           # keys/values: context tokens only
                    score = np.einsum("bk,kl,bl->b", Z[:, :, i], Q[l, h], Z[:, :, j])
                    Z_next[:, :, j] += (score[:, None] * Z[:, :, i]) @ P[l, h].T / n
        Z = Z_next
    return Z


def _gram(Z):
    """S_0 = Z M Z^T (B, D, D) of prompts Z (B, D, n+1), unchecked (gram checks Z)."""
    context = Z[:, :, :-1]                                     # Z M drops the query column
    return context @ context.transpose(0, 2, 1)


@_numpy_rules
def gram(Z):
    """S_0 = Z M Z^T, (B, D, D): the Gram matrix of the n context tokens (MATH.md §2)."""
    return _gram(_prompts(Z))


def _chunks(B, D):
    """(start, stop) of B prompts in chunks of 2^18 / D^3, whose products BLAS runs on the calling thread
    and whose stacks stay in cache; chunks only reorder the sums over prompts (MATH.md §3)."""
    size = max(1, 2 ** 18 // D ** 3)
    return [(c, min(c + size, B)) for c in range(0, B, size)]


def _times(X, A):
    """X_b A for every prompt b of the stack X (b, D, D) and one shared A (D, D)."""
    return (X.reshape(-1, X.shape[-1]) @ A).reshape(X.shape)


def _summed(X, Y):
    """sum_b X_b Y_b over the prompts of two stacks (b, D, D)."""
    return np.tensordot(X, Y, axes=([0, 2], [0, 1]))


@_numpy_rules
def layer_forward(P_l, Q_l, S, q, n):
    """One layer in Gram form (MATH.md §2): T = I + (1/n) sum_h P_h S Q_h, S' = T S T^T, q' = T q.

    P_l, Q_l: (H, D, D); S: (B, D, D) = Z_l M Z_l^T (symmetric); q: (B, D) the query column of Z_l;
    n context size. Returns S' (B, D, D), q' (B, D), T (B, D, D) and the cache for layer_backward.
    An unchecked building block (forward, predict and loss_and_grad check their inputs): it assumes
    float64 arrays, S symmetric and the same B in S and q."""
    PS = [P_h @ S for P_h in P_l]                                        # P_h S
    T = np.eye(S.shape[-1]) + sum(_times(PS_h, Q_h) for PS_h, Q_h in zip(PS, Q_l)) / n
    TS = T @ S
    S_next = TS @ T.transpose(0, 2, 1)                                   # T S T^T
    q_next = np.einsum("bij,bj->bi", T, q)                               # T q
    return S_next, q_next, T, (P_l, Q_l, n, S, q, T, TS, PS)


@_numpy_rules
def layer_backward(dS_next, dq_next, cache, need_dS=True, per_prompt=False):
    """Adjoint of layer_forward (MATH.md §3): (dS', dq') -> (dS, dq, dP_l, dQ_l).

    dS_next: (B, D, D); dq_next: (B, D). Returns dS (B, D, D) (None unless need_dS: the first
    layer's S_0 is data), dq (B, D) and dP_l, dQ_l (H, D, D) summed over the prompts, or with
    per_prompt each prompt's own (B, H, D, D) (the rows of the Jacobian, MATH.md §3.1)."""
    P_l, Q_l, n, S, q, T, TS, PS = cache
    over_prompts = np.matmul if per_prompt else _summed         # X_b Y_b for each prompt, or their sum
    Tt = T.transpose(0, 2, 1)
    # q' = T q                          (product rule: T and q)
    dT = dq_next[:, :, None] * q[:, None, :]
    dq = np.einsum("bij,bj->bi", Tt, dq_next)
    # S' = T S T^T                      (T twice, S^T = S: dS' T S + dS'^T T S)
    dT += (dS_next + dS_next.transpose(0, 2, 1)) @ TS
    dS = Tt @ dS_next @ T if need_dS else None
    # T = I + (1/n) sum_h P_h S Q_h     (product rule: P_h, S and Q_h; S^T = S)
    dP, dQ = [], []
    for P_h, Q_h, PS_h in zip(P_l, Q_l, PS):
        dT_Qt = _times(dT, Q_h.T / n)                                    # (1/n) dT Q_h^T
        dP.append(over_prompts(dT_Qt, S))                                # dP_h = (1/n) dT Q_h^T S
        dQ.append(over_prompts(PS_h.transpose(0, 2, 1), dT) / n)        # dQ_h = (1/n) (P_h S)^T dT
        if need_dS:
            dS += P_h.T @ dT_Qt                                          # dS += (1/n) P_h^T dT Q_h^T
    axis = 1 if per_prompt else 0
    return dS, dq, np.stack(dP, axis), np.stack(dQ, axis)


@_numpy_rules
def readout_forward(P_l, Q_l, S, q, n):
    """The last layer's entry that the prediction reads (MATH.md §2): row d of T times q,

        (T q)_d = q_d + (1/n) sum_h p_h^T S Q_h q,   p_h = P_h[d, :] (the value row),

    so y_hat = -(T q)_d. Arguments as layer_forward. Returns (T q)_d (B,) and the cache."""
    Sp = [np.einsum("bij,j->bi", S, P_h[-1]) for P_h in P_l]             # S p_h = (p_h^T S)^T
    Qq = [np.einsum("ij,bj->bi", Q_h, q) for Q_h in Q_l]                # Q_h q
    out = q[:, -1] + sum(np.einsum("bi,bi->b", Sp_h, Qq_h) for Sp_h, Qq_h in zip(Sp, Qq)) / n
    return out, (P_l, Q_l, n, S, q, Sp, Qq)


@_numpy_rules
def readout_backward(dout, cache, per_prompt=False):
    """Adjoint of readout_forward (MATH.md §3): dout (B,) -> (dS, dq, dP_l, dQ_l).

    Returns dS (B, D, D), dq (B, D) and dP_l, dQ_l (H, D, D) summed over the prompts (dP_l is zero
    outside row d), or with per_prompt each prompt's own (B, H, D, D)."""
    P_l, Q_l, n, S, q, Sp, Qq = cache
    g = (dout / n)[:, None]
    dq, dS = np.zeros_like(q), np.zeros_like(S)
    dq[:, -1] = dout                                                     # q_d
    dP, dQ = np.zeros((2, len(q)) + P_l.shape)
    for h, (P_h, Q_h, Sp_h, Qq_h) in enumerate(zip(P_l, Q_l, Sp, Qq)):
        # (1/n) p_h^T S Q_h q              (product rule: p_h, S, Q_h and q)
        dP[:, h, -1] = g * np.einsum("bij,bj->bi", S, Qq_h)              # (1/n) S Q_h q
        dQ[:, h] = (g * Sp_h)[:, :, None] * q[:, None, :]               # (1/n) S p_h q^T
        dS += (g * P_h[-1])[:, :, None] * Qq_h[:, None, :]              # (1/n) p_h (Q_h q)^T
        dq += g * (Sp_h @ Q_h)                                           # (1/n) Q_h^T S p_h
    return (dS, dq, dP, dQ) if per_prompt else (dS, dq, dP.sum(axis=0), dQ.sum(axis=0))


def _propagate(P, Q, S, q, n):
    """From (S_0, q_0) to the prediction's entry (T_{L-1} q_{L-1})_d (B,): layer_forward through the
    first L - 1 layers, readout_forward in the last. Returns it and the caches."""
    caches = []
    for P_l, Q_l in zip(P[:-1], Q[:-1]):
        S, q, _, cache = layer_forward(P_l, Q_l, S, q, n)
        caches.append(cache)
    out, cache = readout_forward(P[-1], Q[-1], S, q, n)
    return out, caches + [cache]


def _backpropagate(dout, caches, per_prompt=False):
    """The adjoints of _propagate in reverse from the seed dout (B,); returns dP, dQ (L, H, D, D),
    or with per_prompt (B, L, H, D, D)."""
    dS, dq, dP_l, dQ_l = readout_backward(dout, caches[-1], per_prompt)
    grads = [(dP_l, dQ_l)]
    for l in reversed(range(len(caches) - 1)):
        dS, dq, dP_l, dQ_l = layer_backward(dS, dq, caches[l], need_dS=l > 0, per_prompt=per_prompt)
        grads.insert(0, (dP_l, dQ_l))
    axis = 1 if per_prompt else 0
    return tuple(np.stack(g, axis) for g in zip(*grads))


def _layers_of(P, Q, Z, n):
    """(Z_0, ..., Z_L) of a chunk of prompts Z (b, D, n+1), (L+1, b, D, n+1): Z_{l+1} = T_l Z_l."""
    S, q, Zs = _gram(Z), Z[:, :, n], [Z]
    for P_l, Q_l in zip(P, Q):
        S, q, T, _ = layer_forward(P_l, Q_l, S, q, n)
        Zs.append(T @ Zs[-1])
    return np.stack(Zs)


@_numpy_rules
def forward(P, Q, Z, all_layers=False):
    """Z_L of the L-layer linear transformer, [A] eq. (4): Z_{l+1} = Z_l + (1/n) Attn(Z_l).

    P, Q: (L, H, D, D); Z: (B, D, n+1). Returns Z_L (B, D, n+1), or with all_layers the stack
    (Z_0, ..., Z_L) of shape (L+1, B, D, n+1). Computed as Z_{l+1} = T_l Z_l (Gram form above),
    chunk by chunk. MATH.md §2."""
    (P, Q, Z), all_layers = _model_inputs(P, Q, Z), _flag("all_layers", all_layers)
    n = Z.shape[2] - 1
    with np.errstate(over="ignore", invalid="ignore"):
        Zs = np.concatenate([_layers_of(P, Q, Z[a:b], n) for a, b in _chunks(*Z.shape[:2])], axis=1)
    _finite({"Z_L": Zs[-1]}, P=P, Q=Q, Z=Z)
    return Zs if all_layers else Zs[-1]


@_numpy_rules
def predict(P, Q, Z):
    """TF_L(Z_0) = y_hat = -Z_L[d, n] per prompt ([A] §2), shape (B,), from (S_0, q_0) through the
    last layer's readout, chunk by chunk. MATH.md §2."""
    P, Q, Z = _model_inputs(P, Q, Z)
    n = Z.shape[2] - 1
    with np.errstate(over="ignore", invalid="ignore"):
        y_hat = -np.concatenate([_propagate(P, Q, _gram(Z[a:b]), Z[a:b, :, n], n)[0]
                                 for a, b in _chunks(*Z.shape[:2])])
    _finite({"the prediction": y_hat}, P=P, Q=Q, Z=Z)
    return y_hat


# §3 Loss and gradient ([A] eq. (5) as in its App. A.1 and the authors' code) -------------------

@_numpy_rules
def in_context_loss(P, Q, Z, y):
    """f = mean_b (Z_L[b, d, n] + y_b)^2 = mean_b (y_hat_b - y_b)^2 (no factor 1/2), MATH.md §3.
    P, Q: (L, H, D, D); Z: (B, D, n+1); y: (B,) true query labels. Returns a float."""
    P, Q, Z, y = _model_inputs(P, Q, Z, y)
    with np.errstate(over="ignore"):                      # the square of a finite prediction may overflow:
        loss = float(np.mean((predict(P, Q, Z) - y) ** 2))
    _finite(dict(loss=loss), P=P, Q=Q, Z=Z)             # named here
    return loss


def _loss_and_grad_gram(P, Q, S0, q0, y, n):
    """(f, dP, dQ) of the batch in Gram form, unchecked (MATH.md §3): each chunk of prompts forward
    through _propagate and back through _backpropagate seeded with df/d(T q)_d = 2 r_b / B, the
    chunks' parts of f = (1/B) sum_b r_b^2 and of its gradient added in chunk order."""
    B = y.shape[0]
    loss, dP, dQ = 0.0, 0.0, 0.0
    for a, b in _chunks(B, P.shape[-1]):
        out, caches = _propagate(P, Q, S0[a:b], q0[a:b], n)
        r = out + y[a:b]                                     # residual Z_L[d, n] + y = y - y_hat
        dP_c, dQ_c = _backpropagate(2.0 * r / B, caches)
        loss, dP, dQ = loss + float(np.sum(r * r)) / B, dP + dP_c, dQ + dQ_c
    return loss, dP, dQ


def _gram_args(P, Q, S0, q0, y, n):
    """The Gram-form functions' checks: P, Q as _params; S0 (B, D, D) finite and symmetric (the
    adjoint relies on S^T = S, MATH.md §3); q0 (B, D) and y (B,) finite; n an integer >= 1."""
    P, Q = _params(P, Q)
    S0, q0, y = _array("S0", S0, 3), _array("q0", q0, 2), _array("y", y, 1)
    B, D = y.shape[0], P.shape[-1]
    if S0.shape != (B, D, D) or q0.shape != (B, D) or B < 1:
        raise ValueError(f"S0 must have shape (B, D, D), q0 (B, D) and y (B,) with B >= 1 and D = {D} from P, Q; "
                         f"got {S0.shape}, {q0.shape}, {y.shape}")
    if np.any(S0 != S0.transpose(0, 2, 1)):
        raise ValueError("S0 must be symmetric (S0 = Z M Z^T): the reverse pass relies on S^T = S")
    return P, Q, S0, q0, y, _int("n", n, 1)


@_numpy_rules
def loss_and_grad_gram(P, Q, S0, q0, y, n, engine=None):
    """f and (df/dP, df/dQ) from the Gram form (S_0, q_0): what training evaluates (MATH.md §3).

    P, Q: (L, H, D, D); S0: (B, D, D) = Z M Z^T (symmetric); q0: (B, D) = Z[:, :, n]; y: (B,);
    n context size. The batch is walked in chunks of prompts (_chunks); each chunk's loss and
    gradient are divided by the whole B and added in chunk order. A non-finite result is a
    ValueError saying that float64 overflowed. engine: None (this module's functions) or another
    evaluator with the methods of REFERENCE (icl_fast.engine()). Returns (loss, dP, dQ)."""
    P, Q, S0, q0, y, n = _gram_args(P, Q, S0, q0, y, n)
    engine = _engine(engine)
    with np.errstate(over="ignore", invalid="ignore"):
        evaluate = _loss_and_grad_gram if engine is None else engine.loss_and_grad_gram
        loss, dP, dQ = evaluate(P, Q, S0, q0, y, n)
    _finite({"the loss": loss, "dP": dP, "dQ": dQ}, P=P, Q=Q, S0=S0)
    return loss, dP, dQ


@_numpy_rules
def loss_and_grad(P, Q, Z, y, engine=None):
    """In-context loss f (see in_context_loss) and its gradient by hand-written reverse mode.

    P, Q: (L, H, D, D); Z: (B, D, n+1); y: (B,). Returns (loss, dP, dQ), dP and dQ shaped like
    P, Q. Computed from the Gram form (S_0, q_0) as loss_and_grad_gram; engine as there. A result
    that is not finite is a ValueError saying that float64 overflowed. MATH.md §3."""
    P, Q, Z, y = _model_inputs(P, Q, Z, y)
    engine = _engine(engine)
    n = Z.shape[2] - 1
    q0 = np.ascontiguousarray(Z[:, :, n])
    with np.errstate(over="ignore", invalid="ignore"):
        if engine is None:                              # this module's functions, by name
            loss, dP, dQ = _loss_and_grad_gram(P, Q, _gram(Z), q0, y, n)
        else:
            loss, dP, dQ = engine.loss_and_grad_gram(P, Q, engine.gram(Z), q0, y, n)
    _finite({"the loss": loss, "dP": dP, "dQ": dQ}, P=P, Q=Q, Z=Z)
    return loss, dP, dQ


# §3.1 The per-prompt Jacobian ------------------------------------------------------------------

def _jacobian_gram(P, Q, S0, q0, y, n):
    """(r (B,), JP, JQ (B, L, H, D, D)) in Gram form, unchecked (MATH.md §3.1): each chunk's residuals
    and each prompt's own gradient of its residual r_b, the reverse pass seeded with 1 for every
    prompt and not summed; the chunks' rows in order."""
    parts = []
    for a, b in _chunks(y.shape[0], P.shape[-1]):
        out, caches = _propagate(P, Q, S0[a:b], q0[a:b], n)
        parts.append((out + y[a:b], *_backpropagate(np.ones_like(out), caches, per_prompt=True)))
    return tuple(np.concatenate(part) for part in zip(*parts))


# §4 Attention with an activation ([A] §6, Theorem 5; the rebuttal's softmax heads) -------------
#     Attn_sigma(Z) = P Z M sigma(E),   E = Z^T Q Z (B, n+1, n+1), E[i, j] = z_i^T Q z_j (key i, column j).
#
# sigma: "relu" entrywise; "softmax" over each column's n context keys (weights sum to 1);
# "softmax_all" over all n+1 keys, then M drops the query's value (the authors' code: weights on the
# context sum to less than 1); "linear" the identity, the explicit twin of the Gram-form layer.

@_numpy_rules
def attention_forward(P_h, Q_h, Z, activation):
    """One head: out = (1/n) P Z M sigma(Z^T Q Z). P_h, Q_h: (D, D); Z: (B, D, n+1).
    Returns out (B, D, n+1) and the cache for attention_backward. The activation is checked; the
    arrays are not (forward_activation and loss_and_grad_activation check theirs): it assumes float64
    P_h, Q_h of shape (D, D) matching Z. MATH.md §4."""
    _choice("activation", activation, ACTIVATIONS)
    n = Z.shape[2] - 1
    E = Z.transpose(0, 2, 1) @ Q_h @ Z                         # E[i, j] = z_i^T Q z_j
    if activation == "linear":
        A = E
    elif activation == "relu":
        A = np.maximum(E, 0.0)
    else:
        keys = n if activation == "softmax" else n + 1
        Ek = E[:, :keys, :]
        A = np.zeros_like(E)
        A[:, :keys, :] = np.exp(Ek - Ek.max(axis=1, keepdims=True))
        A /= A.sum(axis=1, keepdims=True)
    V = P_h @ Z
    V[:, :, n] = 0.0                                           # V = P Z M
    return V @ A / n, (P_h, Q_h, Z, E, A, V, activation, n)


@_numpy_rules
def attention_backward(dout, cache, per_prompt=False):
    """Adjoint of attention_forward: dout (B, D, n+1) -> dZ (B, D, n+1), dP_h, dQ_h (D, D) summed
    over the batch, or with per_prompt each prompt's own (B, D, D) (Jacobian rows). MATH.md §4."""
    P_h, Q_h, Z, E, A, V, activation, n = cache
    # out = V A / n                 (product rule: V and A)
    dV = dout @ A.transpose(0, 2, 1) / n
    dA = V.transpose(0, 2, 1) @ dout / n
    # A = sigma(E)
    if activation == "linear":
        dE = dA
    elif activation == "relu":
        dE = dA * (E > 0)
    else:                           # softmax per column over its keys; A = 0 on keys left out
        dE = A * (dA - np.sum(A * dA, axis=1, keepdims=True))
    # V = P Z M                     (M removes the query column)
    dV[:, :, n] = 0.0
    dZ = P_h.T @ dV
    # E = Z^T Q Z                   (Z appears twice: as keys and as queries)
    dZ += Q_h @ Z @ dE.transpose(0, 2, 1) + Q_h.T @ Z @ dE
    over_prompts, Zt = (np.matmul if per_prompt else _summed), Z.transpose(0, 2, 1)   # X_b Y_b, or their sum
    return dZ, over_prompts(dV, Zt), over_prompts(Z @ dE, Zt)   # dP_h = dV Z^T, dQ_h = Z dE Z^T


def _activation_chunk(P, Q, Zc, yc, B, activation, jacobian=False):
    """One chunk of prompts Zc (b, D, n+1) with labels yc (b,) through the explicit attention
    layers and back. Returns (loss part, dP, dQ, Z_L), the loss and gradient divided by the whole
    batch size B (MATH.md §3); with jacobian, (r (b,), JP (b, L, H, D, D), JQ, Z_L), the backward
    seeded with dr_b/dZ_L[b, d, n] = 1 prompt by prompt and not summed (MATH.md §4)."""
    caches = []
    for P_l, Q_l in zip(P, Q):
        heads = [attention_forward(P_h, Q_h, Zc, activation) for P_h, Q_h in zip(P_l, Q_l)]
        caches.append([c for _, c in heads])
        Zc = Zc + sum(out for out, _ in heads)                 # Z_{l+1} = Z_l + sum_h Attn_h
    r = Zc[:, -1, -1] + yc
    dZ = np.zeros_like(Zc)
    dZ[:, -1, -1] = 1.0 if jacobian else 2.0 * r / B
    dP, dQ = np.zeros((2, len(r)) + P.shape if jacobian else (2,) + P.shape)
    at = (slice(None),) if jacobian else ()                    # the prompts' axis, where kept
    for l in reversed(range(len(caches))):
        dZ_in = dZ.copy()                                      # the residual path
        for h, cache in enumerate(caches[l]):
            dZ_h, dP[at + (l, h)], dQ[at + (l, h)] = attention_backward(dZ, cache, per_prompt=jacobian)
            dZ_in += dZ_h
        dZ = dZ_in
    return (r if jacobian else float(np.sum(r * r)) / B), dP, dQ, Zc


def _activation_pass(P, Q, Z, y, activation, jacobian=False):
    """The batch (Z, y) through _activation_chunk in chunks of 2^15 / (n+1)^2 prompts (their
    (b, n+1, n+1) score matrices stay in cache), unchecked: (loss, dP, dQ, Z_L) summed in chunk
    order, or with jacobian (r, JP, JQ, Z_L) concatenated (MATH.md §4)."""
    B, size = Z.shape[0], max(1, 2 ** 15 // Z.shape[2] ** 2)
    parts = list(zip(*[_activation_chunk(P, Q, Z[a:a + size], y[a:a + size], B, activation, jacobian)
                       for a in range(0, B, size)]))
    if jacobian:
        return tuple(np.concatenate(part) for part in parts)
    return sum(parts[0]), sum(parts[1]), sum(parts[2]), np.concatenate(parts[3])


@_numpy_rules
def forward_activation(P, Q, Z, activation="relu"):
    """Z_L of L layers Z <- Z + sum_h P_h Z M sigma(Z^T Q_h Z) / n ([A] §6). Shapes as forward.
    MATH.md §4."""
    _choice("activation", activation, ACTIVATIONS)
    P, Q, Z = _model_inputs(P, Q, Z)
    with np.errstate(over="ignore", invalid="ignore"):
        Z_L = _activation_pass(P, Q, Z, np.zeros(Z.shape[0]), activation)[3]
    _finite({"Z_L": Z_L}, P=P, Q=Q, Z=Z)
    return Z_L


def predict_activation(P, Q, Z, activation="relu"):
    """y_hat = -Z_L[d, n] of forward_activation, shape (B,). MATH.md §4."""
    return -forward_activation(P, Q, Z, activation)[:, -1, -1]


@_numpy_rules
def loss_and_grad_activation(P, Q, Z, y, activation="relu", engine=None):
    """(loss, dP, dQ) for the attention of forward_activation, by hand-written reverse mode; engine
    as loss_and_grad_gram. MATH.md §4."""
    _choice("activation", activation, ACTIVATIONS)
    P, Q, Z, y = _model_inputs(P, Q, Z, y)
    engine = _engine(engine)
    with np.errstate(over="ignore", invalid="ignore"):
        evaluate = _activation_pass if engine is None else engine.activation_pass
        loss, dP, dQ, _ = evaluate(P, Q, Z, y, activation)
    _finite({"the loss": loss, "dP": dP, "dQ": dQ}, P=P, Q=Q, Z=Z)
    return loss, dP, dQ


# §5 Parametrisations ([A] eq. (8) and (11)) and flat vectors for SciPy -------------------------

def _blocks(name, A):
    A = _array(name, A, 3)
    if A.shape[0] < 1 or A.shape[1] < 1 or A.shape[1] != A.shape[2]:
        raise ValueError(f"{name} must have shape (L, d, d) with L, d >= 1, got {A.shape}")
    return A


def block_params(A, Bm):
    """Structure (11) with the sign of (8): P_l = [[B_l, 0], [0, 1]], Q_l = -[[A_l, 0], [0, 0]].
    A, Bm: (L, d, d). Returns P, Q of shape (L, 1, d+1, d+1). MATH.md §5."""
    A, Bm = _blocks("A", A), _blocks("Bm", Bm)
    if A.shape != Bm.shape:
        raise ValueError(f"A and Bm must have the same shape (L, d, d), got {A.shape} and {Bm.shape}")
    L, d, _ = A.shape
    P, Q = np.zeros((2, L, 1, d + 1, d + 1))
    P[:, 0, :d, :d] = Bm
    P[:, 0, d, d] = 1.0
    Q[:, 0, :d, :d] = -A
    return P, Q


def _structure_grad(structure, dP, dQ, tied=False):
    """structure_grad without the checks, for (dP, dQ) of shape (..., L, H, D, D) (a leading axis
    of prompts for the Jacobian's rows): the chain rules of block_params act on the last four axes;
    tied sums over the layer axis."""
    if tied:
        dP, dQ = dP.sum(axis=-4, keepdims=True), dQ.sum(axis=-4, keepdims=True)
    if structure == "full":
        return {"P": dP, "Q": dQ}
    # Q_l = -[[A_l, 0], [0, 0]] gives dA = -(dQ's top-left block), P_l = [[B_l, 0], [0, 1]] gives dB = dP's
    dA, dB = -dQ[..., 0, :-1, :-1], dP[..., 0, :-1, :-1]
    return {"A": dA, "B": dB} if structure == "blocks" else {"A": dA}


def structure_grad(structure, dP, dQ, tied=False):
    """The gradient in a structure's own coordinates, a dict keyed like structure_shapes. tied: the
    coordinates are shared by every layer, so their gradient is the sum of the L layers' (the chain
    rule of the repetition, MATH.md §14), with a leading axis 1. MATH.md §5."""
    _choice("structure", structure, STRUCTURES)
    dP, dQ = _params(dP, dQ, ("dP", "dQ"))
    if structure != "full" and dP.shape[1] != 1:
        raise ValueError(f"dP, dQ must have one head, shape (L, 1, D, D), for the structures (8) and (11); "
                         f"got {dP.shape}")
    return _structure_grad(structure, dP, dQ, _flag("tied", tied))


def block_grad(dP, dQ):
    """Chain rule for block_params: (dP, dQ) of shape (L, 1, D, D) -> (dA, dB), each (L, d, d).
    MATH.md §5."""
    grads = structure_grad("blocks", dP, dQ)
    return grads["A"], grads["B"]


def sparse_params(A):
    """Structure (8), the family of Lemma 1: P_l = [[0, 0], [0, 1]], Q_l = -[[A_l, 0], [0, 0]].
    A: (L, d, d). Returns P, Q of shape (L, 1, d+1, d+1). MATH.md §5."""
    A = _blocks("A", A)
    return block_params(A, np.zeros_like(A))


def sparse_grad(dP, dQ):
    """Chain rule for sparse_params: (dP, dQ) of shape (L, 1, D, D) -> dA (L, d, d). MATH.md §5."""
    return block_grad(dP, dQ)[0]


def pack(arrays):
    """Concatenate arrays into one flat float64 vector (for scipy.optimize). MATH.md §5."""
    if isinstance(arrays, np.ndarray) or not hasattr(arrays, "__iter__"):
        raise TypeError(f"arrays must be a list or tuple of arrays, got {type(arrays).__name__}")
    arrays = [_array(f"arrays[{i}]", a, None) for i, a in enumerate(arrays)]
    if not arrays:
        raise ValueError("arrays must hold at least one array")
    return np.concatenate([np.ravel(a) for a in arrays])


def unpack(theta, shapes):
    """Inverse of pack: the flat vector theta cut into arrays of the given shapes. MATH.md §5."""
    theta = _array("theta", theta, 1)
    if isinstance(shapes, (str, bytes)) or not hasattr(shapes, "__iter__"):
        raise TypeError(f"shapes must be a list of shape tuples, got {type(shapes).__name__}")
    shapes = list(shapes)
    for shape in shapes:
        if not isinstance(shape, (tuple, list)) or not all(
                isinstance(k, (int, np.integer)) and not isinstance(k, bool) and k >= 0 for k in shape):
            raise ValueError(f"shapes must be tuples of integers >= 0, got {shape!r}")
    sizes = [math.prod(shape) for shape in shapes]
    if theta.shape != (sum(sizes),):
        raise ValueError(f"theta must have shape ({sum(sizes)},) for shapes {shapes}, got {theta.shape}")
    cuts = np.cumsum(sizes)[:-1]
    return [part.reshape(s) for part, s in zip(np.split(theta, cuts), shapes)]


def structure_shapes(structure, L, d, H=1, tied=False):
    """Names and shapes of a structure's own coordinates: sparse A; blocks A, B; full P, Q.
    tied: one layer's coordinates (leading axis 1), applied L times (MATH.md §5, §14). MATH.md §5."""
    _choice("structure", structure, STRUCTURES)
    L, d, H = _int("L", L, 1), _int("d", d, 1), _int("H", H, 1)
    L = 1 if _flag("tied", tied) else L
    if structure != "full" and H != 1:
        raise ValueError(f"heads must be 1 for structure {structure!r} (one P, Q per layer), got {H}")
    if structure == "full":
        return {"P": (L, H, d + 1, d + 1), "Q": (L, H, d + 1, d + 1)}
    if structure == "blocks":
        return {"A": (L, d, d), "B": (L, d, d)}
    return {"A": (L, d, d)}


def structure_to_PQ(structure, coords, L=None):
    """(P, Q) of a structure's coordinates (a dict as from structure_shapes). L: None (coords hold
    every layer), or for a weight-tied model the number of layers: coords hold one layer (leading
    axis 1) and that (P, Q) is applied L times (MATH.md §14). MATH.md §5."""
    _choice("structure", structure, STRUCTURES)
    keys = {"sparse": {"A"}, "blocks": {"A", "B"}, "full": {"P", "Q"}}[structure]
    if not isinstance(coords, dict) or set(coords) != keys:
        raise ValueError(f"coords must be a dict with the keys {sorted(keys)} for structure {structure!r}")
    if structure == "sparse":
        P, Q = sparse_params(coords["A"])
    elif structure == "blocks":
        P, Q = block_params(coords["A"], coords["B"])
    else:
        P, Q = _params(coords["P"], coords["Q"], ("coords['P']", "coords['Q']"))
    if L is None:
        return P, Q
    L = _int("L", L, 1)
    if P.shape[0] != 1:
        raise ValueError(f"tied coords must hold one layer (leading axis 1) to repeat L = {L} times, "
                         f"got {P.shape[0]} layers")
    return np.repeat(P, L, axis=0), np.repeat(Q, L, axis=0)


# §3.1 with §4-§5: the Jacobian in a structure's coordinates; a batch by either attention (for §6, §11) ---

def _check_structure_of(structure, P, Q, tied=False):
    """A ValueError unless P, Q have the form of `structure` (one head, the fixed entries of (8) or
    (11); with tied, every layer equal), which the Jacobian's columns in its coordinates assume."""
    if _flag("tied", tied) and not (np.all(P == P[:1]) and np.all(Q == Q[:1])):
        raise ValueError("P, Q must have every layer equal for tied=True (one (P, Q) applied L times)")
    if structure == "full":
        return
    if P.shape[1] != 1:
        raise ValueError(f"structure {structure!r} has one head: P, Q must have H = 1, got H = {P.shape[1]}")
    d = P.shape[-1] - 1
    A, Bm = -Q[:, 0, :d, :d], P[:, 0, :d, :d]
    expected = (sparse_params(A) if structure == "sparse" else block_params(A, Bm))
    if not (np.array_equal(P, expected[0]) and np.array_equal(Q, expected[1])):
        raise ValueError(f"P, Q must have the form of structure {structure!r} (MATH.md §5: P_l = "
                         f"[[{'0' if structure == 'sparse' else 'B_l'}, 0], [0, 1]], Q_l = -[[A_l, 0], [0, 0]]); "
                         "use structure='full' for other parameters")


def _jacobian_rows(structure, JP, JQ, tied=False):
    """Per-prompt gradients JP, JQ (B, L, H, D, D) as Jacobian rows (B, p) in the structure's coordinates
    (tied: one layer's): structure_grad's chain rules applied to every row at once (MATH.md §5, §14)."""
    B = JP.shape[0]
    return np.concatenate([g.reshape(B, -1) for g in _structure_grad(structure, JP, JQ, tied).values()], axis=1)


@_numpy_rules
def residuals_and_jacobian_gram(P, Q, S0, q0, y, n, structure="full", engine=None, tied=False):
    """Residuals r_b = Z_L[b, d, n] + y_b and their Jacobian from the Gram form (MATH.md §3.1).

    Arguments as loss_and_grad_gram. Each prompt's row is the reverse pass seeded with 1 for that
    prompt alone, e.g. dr_b/dP_lh = (1/n) dT_lb Q_lh^T S_lb and dr_b/dQ_lh = (1/n) S_lb P_lh^T dT_lb.
    structure: "full" gives J in (P, Q) coordinates (columns in pack order of P then Q), "sparse"
    or "blocks" (P, Q of that form, H = 1) maps each row through the structure's chain rule (pack
    order of structure_shapes). tied: every layer of P, Q equal; J's columns are the one layer's
    coordinates (MATH.md §14). Returns r (B,) and J (B, p); 2 J^T r / B is the gradient of the loss."""
    _choice("structure", structure, STRUCTURES)
    P, Q, S0, q0, y, n = _gram_args(P, Q, S0, q0, y, n)
    _check_structure_of(structure, P, Q, tied)
    engine = _engine(engine)
    with np.errstate(over="ignore", invalid="ignore"):
        evaluate = _jacobian_gram if engine is None else engine.jacobian_gram
        r, JP, JQ = evaluate(P, Q, S0, q0, y, n)
        J = _jacobian_rows(structure, JP, JQ, tied)
    _finite({"the residuals": r, "the Jacobian": J}, P=P, Q=Q, S0=S0)
    return r, J


class _Batch:
    """A checked batch (Z, y) with its attention, evaluated by `engine` (None: this module's
    functions, MATH.md §3-§4); for the linear layer S_0 = Z M Z^T is formed once."""

    def __init__(self, Z, y, activation="linear", engine=None):
        self.Z, self.y, self.activation, self.n = Z, y, activation, Z.shape[2] - 1
        engine = _engine(engine)
        self.gram_form = _loss_and_grad_gram, _jacobian_gram
        self.explicit = _activation_pass
        if engine is not None:
            self.gram_form, self.explicit = (engine.loss_and_grad_gram, engine.jacobian_gram), engine.activation_pass
        if activation == "linear":
            self.S0 = _gram(Z) if engine is None else engine.gram(Z)
            self.q0 = np.ascontiguousarray(Z[:, :, self.n])

    def evaluate(self, P, Q, jacobian=False):
        """(loss, dP, dQ) at (P, Q), or with jacobian (r (B,), JP, JQ (B, L, H, D, D)): each prompt's
        residual and its gradient (MATH.md §3.1)."""
        if self.activation == "linear":
            return self.gram_form[jacobian](P, Q, self.S0, self.q0, self.y, self.n)
        return self.explicit(P, Q, self.Z, self.y, self.activation, jacobian)[:3]


@_numpy_rules
def residuals_and_jacobian(P, Q, Z, y, structure="full", activation="linear", engine=None, tied=False):
    """Per-prompt residuals r = Z_L[:, d, n] + y (B,) and Jacobian J (B, p) of the prompts Z
    (B, D, n+1): residuals_and_jacobian_gram (structure, engine, tied and the result as there) with
    S_0, q_0 formed from Z. J holds B p floats. activation: one of ACTIVATIONS; other than "linear"
    the rows come from the explicit attention (MATH.md §3.1, §4)."""
    _choice("structure", structure, STRUCTURES)
    _choice("activation", activation, ACTIVATIONS)
    P, Q, Z, y = _model_inputs(P, Q, Z, y)
    _check_structure_of(structure, P, Q, tied)
    with np.errstate(over="ignore", invalid="ignore"):
        r, JP, JQ = _Batch(Z, y, activation, engine).evaluate(P, Q, jacobian=True)
        J = _jacobian_rows(structure, JP, JQ, tied)
    _finite({"the residuals": r, "the Jacobian": J}, P=P, Q=Q, Z=Z)
    return r, J


# §6 Training on a fixed batch ([A] Fig. 3c and the authors' LBFGS notebook) --------------------
# Both trainers work on the batch divided by c, a power of two near its size (_data_scale): T_l is
# unchanged by S -> S / c^2, Q -> c^2 Q, so gtol means the same at any scale (the paper's data: c = 1).

def _data_scale(Z):
    """c = 2^floor(log2 rms(Z)): Z / c has entries of root mean square in [1, 2), and dividing by a
    power of two is exact (MATH.md §6). A Z with no normal float64 entry has no scale."""
    m = float(np.max(np.abs(Z)))
    if m < np.finfo(np.float64).tiny:
        raise ValueError(f"Z's entries are all zero or subnormal (largest {m:.1e}): there is nothing to train "
                         "on at float64 precision; rescale Z and y")
    c = 2.0 ** math.floor(math.log2(m * math.sqrt(float(np.mean((Z / m) ** 2)))))
    if not 2.0 ** -511 <= c <= 2.0 ** 511:
        raise ValueError(f"Z's scale c = {c:.3g} is beyond what float64 squares (loss c^2): rescale Z and y")
    return c


def _rescaled(coords, s):
    """coords with the arrays that enter Q (A, Q) times s: the same token maps for Gram matrices
    divided by s (MATH.md §6)."""
    return {k: v * s if k in ("A", "Q") else v for k, v in coords.items()}


def _start(structure, shapes, init, init_scale, rng, c):
    """The initial coordinates in the units of Z / c (a dict): iid N(0, init_scale^2) from rng (so a
    random start is the same at any scale of the data), or an init dict's arrays, given in the
    caller's units. Everything is checked before rng is touched."""
    if isinstance(init, str) and init == "random":
        if not isinstance(rng, np.random.Generator):
            raise TypeError("rng must be a numpy.random.Generator when init='random'")
        init_scale = _nonneg("init_scale", init_scale)
        return {k: init_scale * rng.standard_normal(s) for k, s in shapes.items()}
    if isinstance(init, dict):
        if set(init) != set(shapes):
            raise ValueError(f"init must have the keys {sorted(shapes)} for structure {structure!r}, "
                             f"got {sorted(init)}")
        coords = {k: _array(f"init[{k!r}]", init[k], len(s)) for k, s in shapes.items()}
        for k, s in shapes.items():
            if coords[k].shape != s:
                raise ValueError(f"init[{k!r}] must have shape {s}, got {coords[k].shape}")
        return _rescaled(coords, c ** 2)
    raise TypeError(f"init must be 'random' or a dict of arrays keyed {sorted(shapes)}")


def _norm(g):
    """The 2-norm of a finite vector without overflow in the squares: |g| = m |g / m|, m = max |g_i|."""
    m = float(np.max(np.abs(g))) if np.size(g) else 0.0
    return m * float(np.linalg.norm(g / m)) if 0 < m < math.inf else m


class _Run:
    """What both trainers share: the checks (before any work or draw from rng), the batch divided by
    its scale c, the start in those units, the coordinates <-> flat vector, progress lines and the
    result (MATH.md §6)."""

    def __init__(self, Z, y, layers, structure, heads, init, init_scale, rng, activation, progress, engine,
                 tied=False):
        Z, y = _batch(structure, activation, Z, y)
        layers, heads = _int("layers", layers, 1), _int("heads", heads, 1)
        self.structure, self.activation, self.engine = structure, activation, engine
        self.tied, self.layers = _flag("tied", tied), layers
        self.progress = _int("progress", progress, 0)
        self.shapes = structure_shapes(structure, layers, Z.shape[1] - 1, heads, self.tied)
        self.c = _data_scale(Z)
        self.Z, self.y = Z / self.c, y / self.c
        self.batch = _Batch(self.Z, self.y, activation, engine)
        self.theta0 = pack(_start(structure, self.shapes, init, init_scale, rng, self.c).values())
        self.start = time.perf_counter()

    def coords(self, theta, user_units=False):
        """The structure's arrays of a flat theta (normalised units; with user_units, the caller's)."""
        coords = dict(zip(self.shapes, unpack(theta, list(self.shapes.values()))))
        return _rescaled(coords, self.c ** -2) if user_units else coords

    def PQ(self, theta):
        return structure_to_PQ(self.structure, self.coords(theta), self.layers if self.tied else None)

    def grad(self, dP, dQ):
        """The flat gradient in the structure's coordinates (tied: summed over the layers)."""
        return np.concatenate([g.ravel() for g in _structure_grad(self.structure, dP, dQ, self.tied).values()])

    def say(self, what, k, loss, grad):
        if self.progress and k % self.progress == 0:
            print(f"{what} {k:6d}  loss {self.c ** 2 * loss:.6e}  |grad| {_norm(grad):.3e}"
                  f"  {time.perf_counter() - self.start:8.2f} s", file=sys.stderr, flush=True)

    def result(self, theta, loss, grad, history, options, outcome, success, **extra):
        coords = self.coords(theta, user_units=True)
        P, Q = structure_to_PQ(self.structure, coords, self.layers if self.tied else None)
        return dict(structure=self.structure, tied=self.tied, coords=coords, P=P, Q=Q, loss=self.c ** 2 * float(loss),
                    grad_norm=_norm(grad), scale=self.c, success=bool(success),
                    wall_time=time.perf_counter() - self.start, scipy_version=scipy.__version__,
                    history=self.c ** 2 * np.array(history), options=options, **outcome, **extra)


_INTERRUPTED = dict(nfev=None, status=None, interrupted=True)

@_numpy_rules
def train_lbfgs(Z, y, layers, structure="sparse", heads=1, init="random", init_scale=0.1,
                rng=None, maxiter=2000, maxfun=None, maxcor=20, ftol=0.0, gtol=1e-8,
                maxls=50, progress=0, keep_iterates=False, activation="linear", engine=None, tied=False):
    """Minimise the in-context loss on the fixed batch (Z, y) with scipy's L-BFGS-B (MATH.md §6).

    Z: (B, d+1, n+1), y: (B,), layers = L >= 1, structure in STRUCTURES, heads = H >= 1 (only for
    "full"). init: "random" (iid N(0, init_scale^2) entries from rng, a numpy Generator, in the
    units of Z / c below: the same start at any scale) or a dict of arrays in the structure's
    coordinates (structure_shapes). maxiter, maxfun (default 5 maxiter), maxcor (20: about twice the
    blocks structure's coordinates), ftol (0: stop only on the gradient, or when the loss no longer
    decreases), gtol and maxls go to L-BFGS-B as they are. progress = k > 0 prints "iteration, loss,
    |grad|, elapsed" to stderr every k iterations; keep_iterates keeps every iterate (["iterates"]). activation: "linear" (S_0 formed once, O(B L H D^3) per evaluation) or one of
    ACTIVATIONS (explicit attention, O(B L H n^2 D)); engine as loss_and_grad_gram; tied: one
    layer's coordinates applied `layers` times (the looped model of MATH.md §14).

    Returns a dict: structure, tied, coords (the structure's own arrays), P, Q, loss, grad_norm
    (Euclidean), scale (c), nit, nfev, success, status, message, interrupted, wall_time,
    scipy_version, history (the loss after each iteration, the initial loss first) and options.
    success is icl_ref's own verdict: finite loss and gradient, the gradient within gtol on the batch
    divided by c = 2^floor(log2 rms(Z)) (the same at any scale); scipy's status and message beside it.
    A trial point where the model overflows is a failed trial. Ctrl-C before the first evaluation
    raises KeyboardInterrupt; after it, the last completed iterate returns with interrupted=True."""
    options = dict(maxiter=_int("maxiter", maxiter, 1),
                   maxfun=5 * maxiter if maxfun is None else _int("maxfun", maxfun, 1),
                   maxcor=_int("maxcor", maxcor, 1), ftol=_nonneg("ftol", ftol),
                   gtol=_nonneg("gtol", gtol), maxls=_int("maxls", maxls, 1))
    keep_iterates = _flag("keep_iterates", keep_iterates)
    run = _Run(Z, y, layers, structure, heads, init, init_scale, rng, activation, progress, engine, tied)
    last, history, failed = {}, [], [0]

    def fun(theta):
        # a trial point where the model overflows is a failed trial (an infinite loss), so the
        # line search backs off instead of the run ending; `last` keeps only finite evaluations
        if np.all(np.isfinite(theta)):
            with np.errstate(over="ignore", invalid="ignore"):
                loss, dP, dQ = run.batch.evaluate(*run.PQ(theta))
            grad = run.grad(dP, dQ)
            if math.isfinite(loss) and np.all(np.isfinite(grad)):
                last.update(theta=theta.copy(), loss=loss, grad=grad)
                return loss, grad
        failed[0] += 1
        return math.inf, np.zeros_like(theta)

    fun(run.theta0)
    if not last:
        raise ValueError("the loss or its gradient at the initial point is not finite (float64 overflow): "
                         "use a smaller init_scale or init, or rescale Z")
    best = dict(last)                                        # the last completed iterate
    history.append(best["loss"])
    iterates = [run.coords(run.theta0, user_units=True)] if keep_iterates else None

    def callback(theta):
        if not np.array_equal(theta, last["theta"]):          # L-BFGS-B's last call is the iterate
            fun(theta)
        best.update(last)
        history.append(last["loss"])
        if keep_iterates:
            iterates.append(run.coords(last["theta"], user_units=True))
        run.say("iter", len(history) - 1, last["loss"], last["grad"])

    try:
        res = scipy.optimize.minimize(fun, run.theta0, jac=True, method="L-BFGS-B", callback=callback,
                                      options=options)
        outcome = dict(nit=int(res.nit), nfev=int(res.nfev), status=int(res.status),
                       message=str(res.message), interrupted=False)
        # the returned loss is the loss of the returned parameters: scipy's res.fun can be the
        # value of a failed trial point, so take the point from the last finite evaluation
        if not np.array_equal(res.x, best["theta"]):
            fun(res.x)
            if np.array_equal(last["theta"], res.x) and last["loss"] <= best["loss"]:
                best.update(last)
            else:
                outcome["message"] += "; returning the last iterate with a finite loss"
    except KeyboardInterrupt:
        outcome = dict(_INTERRUPTED, nit=len(history) - 1,
                       message=f"interrupted by KeyboardInterrupt after {len(history) - 1} iterations")
    grad_max = float(np.max(np.abs(best["grad"])))
    success = not outcome["interrupted"] and grad_max <= options["gtol"]
    if not outcome["interrupted"]:
        outcome["message"] += (f"; largest gradient entry {grad_max:.2e} {'<=' if success else '>'} "
                               f"gtol {options['gtol']:.1e}")
        if failed[0]:
            outcome["message"] += f"; {failed[0]} trial points overflowed float64 and were rejected"
    return run.result(best["theta"], best["loss"], best["grad"], history, options, outcome, success,
                      **({"iterates": iterates} if keep_iterates else {}))


def _fixed_coordinates(structure, shapes, query_label_zero=True, tied_layers=1):
    """Boolean mask (pack order) of the coordinates that never reach the loss, as symmetry_directions
    lists them (MATH.md §6). Tied coordinates serving tied_layers > 1 layers all reach it through the
    earlier layers (MATH.md §14)."""
    masks = {k: np.zeros(s, dtype=bool) for k, s in shapes.items()}
    if tied_layers == 1 and structure == "blocks":
        masks["B"][-1] = True
    elif tied_layers == 1 and structure == "full":
        masks["P"][-1, :, :-1, :] = True
        if query_label_zero and shapes["Q"][0] == 1:
            masks["Q"][0, :, :, -1] = True
    return np.concatenate([m.ravel() for m in masks.values()])


def _reduced_least_squares(r, J):
    """(f, R) with R^T R = J^T J, R^T f = J^T r and |f| = |r|: the triangular factor of the QR
    factorisation of [J r] is [[R, g], [0, rho]], so f = [g; rho] (p+1,) and R stacked on a zero row
    (p+1, p). A trust-region Gauss-Newton step depends on J only through these, so the solver's SVD
    of the (B, p) Jacobian becomes one of a (p+1, p) matrix, the same steps in exact arithmetic
    (MATH.md §6). r: (B,), J: (B, p). The factor is updated by blocks of rows (LAPACK's dtpqrt), each
    small enough to stay on the calling thread (MATH.md's notes on the code)."""
    B, p = J.shape
    R_aug = np.zeros((p + 1, p + 1), order="F")      # fewer than p + 1 prompts: its last rows stay 0
    rows = max(1, 2 ** 16 // (p + 1))
    for a in range(0, B, rows):
        C = np.asfortranarray(np.column_stack([J[a:a + rows], r[a:a + rows]]))
        R_aug, _, _, info = scipy.linalg.lapack.dtpqrt(0, min(4, p + 1), R_aug, C, overwrite_a=True, overwrite_b=True)
        assert info == 0, info                       # only a wrong argument makes dtpqrt fail
    return R_aug[:, p], R_aug[:, :p]


class _Converged(Exception):
    """Raised from inside scipy.optimize.least_squares once icl_ref's own test holds: the run ends there."""


@_numpy_rules
def train_gauss_newton(Z, y, layers, structure="sparse", heads=1, init="random", init_scale=0.1,
                       rng=None, max_nfev=500, gtol=1e-8, progress=0, activation="linear", engine=None,
                       tied=False):
    """Minimise the in-context loss on (Z, y) by Gauss-Newton with a trust region (MATH.md §6).

    scipy.optimize.least_squares ("dogbox" for sparse and blocks, "trf" for full) on r / sqrt(B), half
    the loss, with the Jacobian of residuals_and_jacobian_gram reduced to the equivalent (p+1)-dimensional
    system of _reduced_least_squares (the same steps, a small SVD). Arguments as
    train_lbfgs; max_nfev bounds residual evaluations (each with its Jacobian). The coordinates that
    do not enter the loss (blocks: B_{L-1}; full: the x-rows of P_{L-1}) stay at their initial
    values (result["fixed"] counts them). Converged: grad_norm = |2 J^T r / B| over the free
    coordinates <= gtol, where the run stops (gtol = 0: at SciPy's tolerances, 1e-15). history: the loss
    after each accepted decrease; nit counts evaluations. Returns train_lbfgs's dict plus fixed."""
    options = dict(max_nfev=_int("max_nfev", max_nfev, 1), gtol=_nonneg("gtol", gtol))
    run = _Run(Z, y, layers, structure, heads, init, init_scale, rng, activation, progress, engine, tied)
    B = run.Z.shape[0]
    free = ~_fixed_coordinates(structure, run.shapes, query_label_zero=not np.any(run.Z[:, -1, -1]),
                               tied_layers=run.layers if run.tied else 1)
    root_B = math.sqrt(B)

    def full(x):
        theta = run.theta0.copy()
        theta[free] = x
        return theta

    cache, best, history = dict(evaluations=0), dict(loss=math.inf), []

    def evaluate(x):
        # a trial point where the model overflows gets an infinite loss: the trust region shrinks
        if cache.get("x") is not None and np.array_equal(cache["x"], x):
            return cache
        cache.update(x=x.copy(), f=np.full(x.size + 1, np.inf), R=np.zeros((x.size + 1, x.size)),
                     evaluations=cache["evaluations"] + 1)
        if not np.all(np.isfinite(x)):
            return cache
        with np.errstate(over="ignore", invalid="ignore"):
            r, JP, JQ = run.batch.evaluate(*run.PQ(full(x)), jacobian=True)
            J = _jacobian_rows(structure, JP, JQ, run.tied)[:, free]
        if not (np.all(np.isfinite(r)) and np.all(np.isfinite(J))):
            return cache
        reduce = _reduced_least_squares if engine is None else engine.reduced_least_squares
        cache["f"], cache["R"] = reduce(r / root_B, J / root_B)
        loss = float(np.sum(r * r)) / B
        if loss < best["loss"]:
            # 2 J^T r / B = 2 R^T f: a (p+1, p) product where J.T @ r would wake BLAS threads (MATH.md §6)
            best.update(x=x.copy(), loss=loss, grad=2 * cache["R"].T @ cache["f"])
            history.append(loss)
            run.say("eval", len(history) - 1, loss, best["grad"])
            if _norm(best["grad"]) <= options["gtol"]:
                raise _Converged          # converged by this function's test: what follows is rounding
        return cache

    def reduced_residuals(x):          # f of _reduced_least_squares at x
        return evaluate(x)["f"]

    def reduced_jacobian(x):           # R of _reduced_least_squares at x
        return evaluate(x)["R"]

    x0 = run.theta0[free]
    try:
        evaluate(x0)
    except _Converged:                   # the start passes the test: decided below, before least_squares
        pass
    if not math.isfinite(best["loss"]):
        raise ValueError("the loss or its Jacobian at the initial point is not finite (float64 overflow): "
                         "use a smaller init_scale or init, or rescale Z")
    # dogleg steps take about half the evaluations on the structured models; on full P, Q, whose
    # Jacobian is rank-deficient along (gamma P_l, Q_l / gamma), they stall where "trf" does not
    method = "trf" if structure == "full" else "dogbox"
    try:
        if _norm(best["grad"]) <= options["gtol"]:
            raise _Converged
        res = scipy.optimize.least_squares(reduced_residuals, x0, jac=reduced_jacobian,
                                           method=method, ftol=1e-15, xtol=1e-15, gtol=1e-15,
                                           max_nfev=options["max_nfev"])
        outcome = dict(nit=int(res.nfev), nfev=int(res.nfev), status=int(res.status),
                       message=str(res.message), interrupted=False)
    except _Converged:                   # status 1: SciPy's own "gtol termination condition is satisfied"
        outcome = dict(nit=cache["evaluations"], nfev=cache["evaluations"], status=1, interrupted=False,
                       message=f"stopped at evaluation {cache['evaluations']}: the gradient norm is within gtol")
    except KeyboardInterrupt:
        outcome = dict(_INTERRUPTED, nit=len(history),
                       message=f"interrupted by KeyboardInterrupt after {len(history)} decreases")
    grad_norm = _norm(best["grad"])
    success = not outcome["interrupted"] and grad_norm <= options["gtol"]
    if not outcome["interrupted"]:
        outcome["message"] += f"; gradient norm {grad_norm:.2e} {'<=' if success else '>'} gtol {options['gtol']:.1e}"
    return run.result(full(best["x"]), best["loss"], best["grad"], history, options, outcome, success,
                      fixed=int(np.sum(~free)))


# §7 Lemma 1: the sparse transformer is preconditioned gradient descent -------------------------

@_numpy_rules
def preconditioned_gd(X, y, A):
    """Lemma 1 of [A]: the iterates the sparse transformer (8) implements, w_0 = 0 and

        w_{l+1} = w_l - A_l^T grad R(w_l),   grad R(w) = (1/n) X^T (X w - y).

    The paper writes A_l; the transpose makes it exact for non-symmetric A_l (MATH.md §7).
    X: (n, d) or (B, n, d) context covariates; y: (n,) or (B, n) context labels; A: (L, d, d). Returns W,
    (L+1, d) or (B, L+1, d), the transformer predicting <w_L, x_q>; W out of float64's range: a ValueError."""
    X, y, A = _array("X", X, (2, 3)), _array("y", y, (1, 2)), _blocks("A", A)
    if y.shape != X.shape[:-1]:
        raise ValueError(f"y must have shape {X.shape[:-1]} to match X of shape {X.shape}, got {y.shape}")
    single = X.ndim == 2
    X, y = (X[None], y[None]) if single else (X, y)
    B, n, d = X.shape
    if A.shape[1] != d:
        raise ValueError(f"A must have shape (L, {d}, {d}) to match X, got {A.shape}")
    W = [np.zeros((B, d))]
    with np.errstate(over="ignore", invalid="ignore"):        # an overflow is said below
        for A_l in A:
            grad_R = np.einsum("bid,bi->bd", X, np.einsum("bid,bd->bi", X, W[-1]) - y) / n
            W.append(W[-1] - grad_R @ A_l)                   # (A_l^T g)^T = g^T A_l, row-wise
    W = np.stack(W, axis=1)
    _finite({"the iterates W": W}, X=X, y=y, A=A, law="w_l grows like (1 + |A| |X|^2)^(l-1) |A| |X| |y|: rescale X, y")
    return W[0] if single else W


# §8 One layer: Theorem 1 generalised, Mahankali et al. -----------------------------------------

def _product(*factors, over=()):
    """prod(factors) / prod(over), positive floats, from their binary mantissas and exponents: no
    partial product under- or overflows; inf when the result overflows, 0 when it underflows."""
    parts = [math.frexp(f) for f in factors] + [(1 / m, -e) for m, e in map(math.frexp, over)]
    with np.errstate(over="ignore"):
        return float(np.ldexp(math.prod(m for m, _ in parts), sum(e for _, e in parts)))


def _single_layer_moments(Sigma, n, M, noise_var):
    """(K, E[h w^T]) of MATH.md §8, h = (1/n) sum_i y_i x_i, for checked Sigma (d, d), n, noise_var
    and M = E[w_star w_star^T] (d, d), which enters only through this second moment (MATH.md §15)."""
    K = ((n + 1) / n) * Sigma @ M @ Sigma + ((np.trace(M @ Sigma) + noise_var) / n) * Sigma
    return K, Sigma @ M


@_numpy_rules
def gamma_star(Sigma, n, Sigma_w=None, noise_var=0.0, tasks=None):
    """Optimal single-layer preconditioner, Theorem 1 of [A] generalised (MATH.md §8):

        Gamma* = K^-1 Sigma Sigma_w,
        K = ((n+1)/n) Sigma Sigma_w Sigma + ((tr(Sigma_w Sigma) + noise_var)/n) Sigma.

    With Sigma_w = I and no noise, Gamma* = ((1 + 1/n) Sigma + (tr Sigma / n) I)^-1, eq. (6).
    Sigma, Sigma_w: (d, d) SPD; n >= 1; noise_var >= 0 (context label noise). With a pool tasks
    (K, d) in place of Sigma_w, Sigma_w is the pool's second moment: the layer trained on prompts
    from that pool (MATH.md §15). Returns (d, d); the optimal layer is sparse_params(Gamma*[None])."""
    n = _int("n", n, 1)
    Sigma = _spd("Sigma", Sigma)[0]
    W, w = _task_moment(Sigma_w, tasks, Sigma.shape[0])
    noise_var = _nonneg("noise_var", noise_var)
    if not np.any(W) and noise_var == 0:
        raise ValueError("tasks are all zero and noise_var = 0: every label is 0, every Gamma has loss 0, "
                         "and Gamma* is not defined")
    # scale-free: Sigma = c S, M = w W (max entries 1), Gamma* = K'^-1 S W / c, K' that of (S, W) with noise
    # 1/v = noise_var / (c w); a noise above 1 is divided out of K' (W -> v W, noise -> 1) into v / c
    c = np.max(np.abs(Sigma))
    v = _product(c, w, over=(noise_var,)) if noise_var else math.inf
    scale = _product(w, over=(noise_var,)) if v < 1 else 1 / c
    if not np.finfo(np.float64).tiny <= scale < math.inf:
        raise ValueError(f"Gamma*'s scale min(1 / max |Sigma|, max |E w w^T| / noise_var) leaves float64 (max |Sigma| "
                         f"= {c:.3g}, max |E w w^T| = {w:.3g}, noise_var = {noise_var:.3g}): rescale x or w_star")
    K = _single_layer_moments(Sigma / c, n, W * min(v, 1.0), 1.0 if v < 1 else 1 / v)[0]
    try:
        G = np.linalg.solve(K, Sigma / c @ W) * scale
    except np.linalg.LinAlgError:
        raise ValueError(f"Sigma is singular to float64 (condition number {np.linalg.cond(Sigma):.3g})") from None
    _finite({"Gamma*": G}, "rescale x (Sigma) or w_star (Sigma_w, tasks)", Sigma=Sigma)
    return G


def _psd_root(A):
    """The PSD square root of a symmetric PSD A (negative rounding eigenvalues clipped to 0)."""
    lam, V = np.linalg.eigh((A + A.T) / 2)
    return (V * np.sqrt(np.clip(lam, 0.0, None))) @ V.T


def _single_layer_loss(Gamma, Sigma, moment, Sigma_q, n, noise_var, query_noise):
    """E (y_hat - y_q)^2 of the sparse layer A_0 = Gamma (MATH.md §8), checked arguments: context
    x ~ N(0, Sigma), query x_q ~ N(0, Sigma_q), E[w_star w_star^T] = w W as moment = (W, w), label
    noise noise_var. With Sigma = c S, Sigma_q = c_q T (largest entries 1), c Gamma = g G' (g = 1 unless
    max |c Gamma| > 1), the scales multiply sums of squares of order 1 from binary exponents (MATH.md §8):
    L = c_q w g^2 (|W^1/2 (S G' - I/g) T^1/2|^2 + |W^1/2 S G' T^1/2|^2 / n + tr(W S) |S^1/2 G' T^1/2|^2 / n)
      + c_q g^2 noise_var |S^1/2 G' T^1/2|^2 / (c n) (+ noise_var): no cancellation at any n, no under-
    or overflow of a scale; a nonzero loss outside float64's normal range is a ValueError naming them."""
    (W, w), c, c_q, a = moment, np.max(np.abs(Sigma)), np.max(np.abs(Sigma_q)), np.max(np.abs(Gamma))
    big = _product(c, a) > 1
    S, T, G, g = Sigma / c, Sigma_q / c_q, Gamma / a if big else c * Gamma, (c, a) * big
    Wh, Th = _psd_root(W), _psd_root(T)
    I = np.eye(len(S)) * _product(1.0, over=g)
    q = np.sum((_psd_root(S) @ G @ Th) ** 2)
    excess = np.sum((Wh @ (S @ G - I) @ Th) ** 2) + np.sum((Wh @ S @ G @ Th) ** 2) / n + np.trace(W @ S) / n * q
    loss = (_product(c_q, w, *g, *g, excess) + _product(c_q, noise_var, *g, *g, q, over=(c, n))
            + (noise_var if query_noise else 0.0))
    if (loss or excess or (noise_var and q)) and not np.finfo(np.float64).tiny <= loss < math.inf:
        raise ValueError(f"the loss ({loss:.3g}) overflows float64 or underflows below its normal range: "
                         f"max |Sigma| = {c:.3g}, max |E w w^T| = {w:.3g}, max |Gamma| = {a:.3g}; rescale x or w_star")
    return float(loss)


@_numpy_rules
def single_layer_population_loss(Gamma, Sigma, n, Sigma_w=None, noise_var=0.0, query_noise=True):
    """Exact E (y_hat - y_q)^2 of the one-layer sparse model with A_0 = Gamma, any (d, d), on prompts as
    sample_prompts draws them (MATH.md §8):

        L(Gamma) = tr(Sigma Gamma^T K Gamma) - 2 tr(Sigma Gamma^T Sigma Sigma_w) + tr(Sigma Sigma_w)
                   (+ noise_var if query_noise),

    K as in gamma_star; scale-free (a loss outside float64's normal range is a ValueError).
    Arguments as gamma_star; returns a float."""
    n = _int("n", n, 1)
    Sigma = _spd("Sigma", Sigma)[0]
    noise_var = _nonneg("noise_var", noise_var)
    Gamma = _array("Gamma", Gamma, 2)
    if Gamma.shape != Sigma.shape:
        raise ValueError(f"Gamma must have shape {Sigma.shape} to match Sigma, got {Gamma.shape}")
    return _single_layer_loss(Gamma, Sigma, _task_moment(Sigma_w, None, Sigma.shape[0]), Sigma, n, noise_var,
                              _flag("query_noise", query_noise))


MAX_FULL_LAYER_D = 8     # the exact rule over w* below has 4^d nodes


@_numpy_rules
def full_layer_population_loss(P, Q, Sigma, n, Sigma_w=None):
    """Exact E (y_hat - y_q)^2 of one layer with any (P, Q), noiseless labels (MATH.md §8):

        L(P, Q) = E_w [ a^T Sigma a + (1/n) sum_hk b_kh^T Sigma b_hk
                        + (1/n) sum_hk tr(K_h Sigma K_k^T Sigma) u_h^T Sigma u_k + 2 w^T Sigma a + w^T Sigma w ],
        u_h = p_h,x + p_h,y w,  K_h = G_h,x + w g_h,y^T,  b_kh = K_k^T Sigma u_h,  a = sum_h b_hh,

    with p_h = P_h[d, :] = [p_h,x; p_h,y] (the value row), G_h = Q_h[:, :d] = [G_h,x; g_h,y^T] (the
    query label is 0), x ~ N(0, Sigma) and w = w* ~ N(0, Sigma_w). The integrand is a polynomial of
    degree 4 in w, so a product Gauss-Hermite rule of 4 nodes per coordinate (exact to degree 7 in
    each) gives E_w exactly: 4^d nodes, hence d <= MAX_FULL_LAYER_D. P, Q: (1, H, D, D); Sigma,
    Sigma_w: (d, d) SPD; n >= 1. Returns a float (single_layer_population_loss at sparse (P, Q))."""
    P, Q = _params(P, Q)
    n = _int("n", n, 1)
    Sigma = _spd("Sigma", Sigma, P.shape[-1] - 1)[0]
    d = Sigma.shape[0]
    F_w = _task_covariance(Sigma_w, d)[1]
    if P.shape[0] != 1:
        raise ValueError(f"P, Q must have one layer (shape (1, H, d+1, d+1)), got {P.shape}")
    if d > MAX_FULL_LAYER_D:
        raise ValueError(f"d must be <= {MAX_FULL_LAYER_D}: the exact rule over w* has 4^d nodes, got d = {d}")
    t, c = np.polynomial.hermite_e.hermegauss(4)                  # nodes of N(0, 1), weights c / sqrt(2 pi)
    xi = np.array(list(itertools.product(t, repeat=d)))           # (4^d, d)
    weight = np.prod(np.array(list(itertools.product(c, repeat=d))), axis=1) / (2 * np.pi) ** (d / 2)
    w = xi @ F_w.T                                                # w = F_w xi ~ N(0, Sigma_w)
    p, G = P[0, :, d, :], Q[0, :, :, :d]                          # (H, D), (H, D, d)
    u = p[None, :, :d] + w[:, None, :] * p[None, :, d, None]      # (N, H, d)
    K = G[None, :, :d, :] + w[:, None, :, None] * G[None, :, d, None, :]    # (N, H, d, d)
    Su = u @ Sigma
    b = np.einsum("nkij,nhi->nkhj", K, Su)                       # b[k, h] = K_k^T Sigma u_h
    a = np.einsum("nhhj->nj", b)
    trace = np.einsum("nhij,nkij->nhk", K @ Sigma, Sigma @ K)    # tr(K_h Sigma K_k^T Sigma)
    with np.errstate(over="ignore", invalid="ignore"):
        # (a + w)^T Sigma (a + w), not its expansion, whose O(1) terms cancel near the optimum (MATH.md §8)
        r = a + w
        integrand = (np.einsum("ni,ij,nj->n", r, Sigma, r) + np.einsum("nkhi,ij,nhkj->n", b, Sigma, b) / n
                     + np.einsum("nhk,nhi,nki->n", trace, Su, u) / n)
        loss = weight @ integrand
    _finite({"the loss": loss}, P=P, Q=Q, Sigma=Sigma)
    return float(loss)


def gd_step_size(n, d, noise_var=0.0):
    """Mahankali et al. (2023), in [A]'s form (MATH.md §8): the optimal single layer is one GD step
    from 0 with the per-example step eta = 1 / (n + 1 + d + noise_var): Gamma* = n eta I for
    Sigma = Sigma_w = I, and n eta Sigma^-1 for Sigma_w = Sigma^-1."""
    return 1.0 / (_int("n", n, 1) + 1 + _int("d", d, 1) + _nonneg("noise_var", noise_var))


# §9 Exact Wishart trace moments ----------------------------------------------------------------

MAX_MOMENT_ORDER = 40    # exact Wishart moments up to this order (MATH.md §9)


def _wishart_T(n, d, parts, memo):
    """T(k_1..k_r) = E prod_j tr(W^{k_j}), W ~ Wishart_d(n, I), by the recursion of MATH.md §9.

    parts is a sorted tuple of positive integers; an exact Python integer is returned. memo holds
    the values found so far in this computation (a dict the caller owns)."""
    if not parts:
        return 1
    if parts in memo:
        return memo[parts]
    k, rest = parts[-1], parts[:-1]

    def T(*ks):                        # tr W^0 = d, so every zero exponent is a factor d
        return d ** ks.count(0) * _wishart_T(n, d, tuple(sorted(x for x in ks if x)), memo)
    total = (n + k - 1) * T(k - 1, *rest)
    total += sum(T(j, k - 1 - j, *rest) for j in range(1, k))
    total += sum(2 * m * T(k + m - 1, *(rest[:i] + rest[i + 1:])) for i, m in enumerate(rest))
    memo[parts] = total
    return total


@functools.lru_cache(maxsize=64)
def _trace_moments(n, d, kmax):
    """wishart_trace_moments as a tuple, kept for the 64 most recent (n, d, kmax): the exact loss
    and the quadrature ask for the same moments at every evaluation."""
    memo = {}
    return (Fraction(d),) + tuple(Fraction(_wishart_T(n, d, (k,), memo), n ** k) for k in range(1, kmax + 1))


def wishart_trace_moments(n, d, kmax):
    """m_k = E tr(S^k), k = 0..kmax, for S = W/n, W ~ Wishart_d(n, I) (MATH.md §9), exactly.

    S is the whitened sample covariance of n context examples ([A] §4.2). Returns a list of
    fractions.Fraction; m_0 = d, m_1 = d, m_2 = d (n + d + 1)/n."""
    n, d, kmax = _int("n", n, 1), _int("d", d, 1), _int("kmax", kmax, 0)
    if kmax > MAX_MOMENT_ORDER:      # the recursion visits every partition of k: p(40) = 37338, p(81) = 1.8e7
        raise ValueError(f"kmax must be <= {MAX_MOMENT_ORDER} (exact moments cost every partition of k), "
                         f"got {kmax}")
    return list(_trace_moments(n, d, kmax))


# §10 The families of Theorems 3 and 4 ----------------------------------------------------------

def _family_scalars(a, b):
    a = _array("a", a, 1)
    if a.size < 1:
        raise ValueError("a must have length L >= 1")
    if b is None:
        return a, np.zeros_like(a)
    b = _array("b", b, 1, allow_nan=True)
    if b.shape != a.shape:
        raise ValueError(f"b must have the same shape as a, (L,) = {a.shape}, got {b.shape}")
    if np.any(np.isnan(b[:-1])):                              # b_{L-1} never enters (NaN allowed)
        raise ValueError("b must be finite (except b[L-1], which does not enter the loss)")
    return a, np.where(np.isnan(b), 0.0, b)


def _poly_trim(p):
    """Drop exact-zero leading coefficients (b = 0 would otherwise keep degree 3^l terms of 0)."""
    while len(p) > 1 and p[-1] == 0:
        p = p[:-1]
    return p


def _poly_mul(p, q):
    out = [Fraction(0)] * (len(p) + len(q) - 1)
    for i, p_i in enumerate(p):
        for j, q_j in enumerate(q):
            out[i + j] += p_i * q_j
    return _poly_trim(out)


def _poly_add(p, q):
    m = max(len(p), len(q))
    return _poly_trim([(p[i] if i < len(p) else 0) + (q[i] if i < len(q) else 0) for i in range(m)])


def _family_degree(a, b):
    """deg p of family_polynomials, from the recursion's degrees alone (no polynomial is built):
    deg s_0 = 1, deg s_{l+1} = 3 deg s_l where a_l b_l != 0, deg p = sum over a_l != 0 of deg s_l."""
    degree, deg_s = 0, 1
    for a_l, b_l in zip(a, b):
        degree += deg_s if a_l != 0 else 0
        deg_s *= 3 if a_l * b_l != 0 else 1
    return degree


def family_polynomials(a, b=None):
    """Exact coefficients (lowest degree first, Fractions) of p(t) and r(t) = (1 - p(t))/t, MATH.md §10:

        p(t) = prod_l (1 - a_l s_l(t)),  s_0 = t,  s_{l+1} = s_l (1 - a_l b_l s_l)^2.

    Built by p_{l+1} = p_l (1 - a_l s_l), r_{l+1} = r_l + a_l p_l phi_l^2, phi_{l+1} =
    phi_l (1 - a_l b_l s_l), with s_l = t phi_l^2 (so r needs no division). Floats in a, b are
    converted to Fractions exactly."""
    a, b = _family_scalars(a, b)
    degree = _family_degree(a, b)
    if degree > MAX_MOMENT_ORDER:
        raise ValueError(f"a, b give deg p = {degree} > {MAX_MOMENT_ORDER}: exact polynomials beyond that "
                         "are not supported (the blocks family has deg p = (3^L - 1)/2: L <= 4)")
    one, t = [Fraction(1)], [Fraction(0), Fraction(1)]
    p, r, phi, s = one, [Fraction(0)], one, t
    for a_l, b_l in zip(a, b):
        a_l, g_l = Fraction(float(a_l)), Fraction(float(a_l)) * Fraction(float(b_l))
        r = _poly_add(r, _poly_mul([a_l], _poly_mul(p, _poly_mul(phi, phi))))
        p = _poly_mul(p, _poly_add(one, _poly_mul([-a_l], s)))
        step = _poly_add(one, _poly_mul([-g_l], s))
        phi, s = _poly_mul(phi, step), _poly_mul(s, _poly_mul(step, step))
    return p, r


def family_population_loss(a, n, d, b=None, noise_var=0.0, query_noise=True):
    """Exact population loss of the families of Theorems 3 and 4 ([A] §4.2, §5; MATH.md §10):

    A_l = a_l Sigma^-1, B_l = b_l I (b = None: the sparse family (8)), x ~ N(0, Sigma),
    w* ~ N(0, Sigma^-1), context label noise of variance noise_var. For any Sigma,

        f = E tr p(S)^2 + (noise_var/n) E tr(S r(S)^2) + noise_var [if query_noise]
          = sum_k c_k m_k + (noise_var/n) sum_k e_k m_{k+1} (+ noise_var),

    with p^2 = sum c_k t^k, r^2 = sum e_k t^k (family_polynomials) and m_k the exact Wishart
    trace moments. Summed in exact rationals (high-degree terms cancel to ~1e-4 in float64) and
    rounded once. a, b: (L,); b[L-1] does not enter. Returns a float."""
    n, d = _int("n", n, 1), _int("d", d, 1)
    noise_var = _nonneg("noise_var", noise_var)
    degree = _family_degree(*_family_scalars(a, b))
    if 2 * degree > MAX_MOMENT_ORDER:
        family = "blocks family (deg p = (3^L - 1)/2: L <= 3)" if b is not None else "sparse family (L <= 20)"
        raise ValueError(f"a, b give deg p = {degree}: the exact loss needs Wishart moments up to order "
                         f"2 deg p = {2 * degree} > {MAX_MOMENT_ORDER}; supported for the {family}")
    p, r = family_polynomials(a, b)
    c, e = _poly_mul(p, p), _poly_mul(r, r)
    m = wishart_trace_moments(n, d, max(len(c) - 1, len(e)))
    f = sum(c_k * m_k for c_k, m_k in zip(c, m))
    s2 = Fraction(noise_var)
    f += s2 / n * sum(e_k * m_k for e_k, m_k in zip(e, m[1:])) + (s2 if _flag("query_noise", query_noise) else 0)
    try:
        return float(f)
    except OverflowError:
        raise ValueError(f"the loss overflows float64 (about 10^{math.log10(f.numerator) - math.log10(f.denominator):.0f}) "
                         f"at max |a| = {np.max(np.abs(a)):.3g}: the family's loss grows like the scalars' powers") from None


@_numpy_rules
def wishart_quadrature(n, d, K):
    """K-node Gauss rule for the mean spectral measure mu of S = W/n (mu has mass d, moments m_k):

        E tr g(S) = integral g dmu = sum_j weights_j g(nodes_j)   exactly for deg g <= 2K - 1.

    The recurrence coefficients come from the exact moments by Chebyshev's algorithm in rational
    arithmetic (Gautschi, "Orthogonal polynomials", 2004, §2.1.7): only the final tridiagonal
    eigenproblem is in floating point. Returns nodes (K,), weights (K,) (positive). MATH.md §10."""
    K = _int("K", K, 1)
    if 2 * K - 1 > MAX_MOMENT_ORDER:
        raise ValueError(f"K must be <= {(MAX_MOMENT_ORDER + 1) // 2}: a K-node rule needs exact moments up to "
                         f"order 2K - 1 <= {MAX_MOMENT_ORDER}, got K = {K}")
    m = wishart_trace_moments(n, d, 2 * K - 1)
    alpha, beta = [m[1] / m[0]], [m[0]]
    sigma_prev, sigma = [Fraction(0)] * (2 * K), list(m)
    for k in range(1, K):
        sigma_next = [Fraction(0)] * (2 * K)
        for l in range(k, 2 * K - k):
            sigma_next[l] = sigma[l + 1] - alpha[k - 1] * sigma[l] - beta[k - 1] * sigma_prev[l]
        alpha.append(sigma_next[k + 1] / sigma_next[k] - sigma[k] / sigma[k - 1])
        beta.append(sigma_next[k] / sigma[k - 1])
        sigma_prev, sigma = sigma, sigma_next
    nodes, vecs = scipy.linalg.eigh_tridiagonal(np.array([float(x) for x in alpha]),
                                                np.sqrt([float(x) for x in beta[1:]]))
    return nodes, float(beta[0]) * vecs[0] ** 2


def _family_loss_at_nodes(theta, L, blocks, nodes, weights, n, noise_var):
    """family_population_loss by the Gauss rule (float64, all terms >= 0) and its gradient in
    theta = (a (L,), b (L-1,) with blocks) by reverse mode through the recursion of
    family_polynomials, for optimisation (MATH.md §10). Returns (f, df/dtheta)."""
    a, b = theta[:L], np.r_[theta[L:], 0.0] if blocks else np.zeros(L)
    gam = a * b
    p, r, phi, s = np.ones_like(nodes), np.zeros_like(nodes), np.ones_like(nodes), nodes
    tape = []
    for a_l, g_l in zip(a, gam):
        tape.append((p, phi, s))
        r = r + a_l * p * phi ** 2
        p = p * (1 - a_l * s)
        phi, s = phi * (1 - g_l * s), s * (1 - g_l * s) ** 2
    f = float(weights @ p ** 2 + noise_var / n * (weights @ (nodes * r ** 2)))
    # reverse mode: dp, dr, dphi, ds are the adjoints of p_l, r_l, phi_l, s_l at each node
    dp, dr, dphi, ds = 2 * weights * p, 2 * noise_var / n * weights * nodes * r, 0.0, 0.0
    da, dg = np.zeros(L), np.zeros(L)
    for l in reversed(range(L)):
        p, phi, s = tape[l]
        u = 1 - gam[l] * s
        # phi' = phi u, s' = s u^2 with u = 1 - g_l s   (product rule in phi, s and g_l)
        dg[l] = -np.sum(dphi * phi * s) - 2 * np.sum(ds * s ** 2 * u)
        ds, dphi = ds * u * (1 - 3 * gam[l] * s) - dphi * phi * gam[l], dphi * u
        # p' = p (1 - a_l s)                            (product rule in p, a_l and s)
        da[l] = -np.sum(dp * p * s)
        ds = ds - dp * p * a[l]
        # r' = r + a_l p phi^2                          (product rule in a_l, p and phi; dr passes)
        da[l] += np.sum(dr * p * phi ** 2)
        dphi = dphi + 2 * dr * a[l] * p * phi
        dp = dp * (1 - a[l] * s) + dr * a[l] * phi ** 2
    # gamma_l = a_l b_l                               (product rule in a_l and b_l)
    return f, np.r_[da + dg * b, dg[:-1] * a[:-1]] if blocks else da


def _family_rule(L, n, d, blocks):
    """The exact Gauss rule (nodes, weights) for the family loss of L layers (MATH.md §10): exact to
    degree 2 deg p + 1; refuses families whose rule needs moments beyond MAX_MOMENT_ORDER."""
    degree = (3 ** L - 1) // 2 if blocks else L                  # deg p, MATH.md §10
    if 2 * degree + 1 > MAX_MOMENT_ORDER:
        raise ValueError(f"L must be <= {3 if blocks else (MAX_MOMENT_ORDER - 1) // 2} for the "
                         f"{'blocks' if blocks else 'sparse'} family: its Gauss rule needs Wishart moments "
                         f"up to order 2 deg p + 1 = {2 * degree + 1} > {MAX_MOMENT_ORDER}, got L = {L}")
    return wishart_quadrature(n, d, degree + 1)


def _family_descent(theta0, E, L, blocks, nodes, weights, n, noise_var):
    """L-BFGS-B on the exact family loss over theta (theta_layers = E theta: a (L,), b (L-1,) with
    blocks) from theta0, with the gradient of _family_loss_at_nodes (MATH.md §10). L-BFGS-B's tests
    are absolute where f < 1 (ftol compares the decrease with max(|f|, 1)), while the loss falls like
    n^-L: a point is accepted when it is stationary relative to f, max |d log f / d theta| <= 1e-6
    (its relative excess loss, about that squared over the curvature of log f, is then ~1e-12);
    otherwise the descent continues on log f, whose tests are relative. Returns (theta, f)."""
    def fun(theta):
        f, g = _family_loss_at_nodes(E @ theta, L, blocks, nodes, weights, n, noise_var)
        return f, E.T @ g

    def log_fun(theta):
        f, g = fun(theta)
        return math.log(f), g / f
    theta = scipy.optimize.minimize(fun, theta0, jac=True, method="L-BFGS-B",
                                    options=dict(ftol=1e-15, gtol=1e-12)).x
    f, g = fun(theta)
    if 0 < f and np.max(np.abs(g)) > 1e-6 * f:
        theta = scipy.optimize.minimize(log_fun, theta, jac=True, method="L-BFGS-B",
                                        options=dict(ftol=1e-15, gtol=1e-10)).x
        f = fun(theta)[0]
    return theta, f


def _family_result(theta, L, n, d, blocks, noise_var, sort=False):
    """(a, b with b[L-1] = NaN or None, exact loss) from a descent's theta."""
    a = np.sort(theta[:L]) if sort else theta[:L]
    b = np.r_[theta[L:], np.nan] if blocks else None
    return a, b, family_population_loss(a, n, d, b, noise_var=noise_var)


# The family loss falls like n^-L from O(1) terms, formed to ~n eps relative: the descents hold to these n,
# measured (MATH.md §10 and its notes on the code), and refuse larger n
MAX_FAMILY_N, MAX_LOCAL_FAMILY_N = 10 ** 14, 10 ** 9


def _family_n(n, bound=MAX_FAMILY_N):
    n = _int("n", n, 1)
    if n > bound:
        raise ValueError(f"n must be <= {bound:.0e} for the family descent: its loss is formed to ~n eps "
                         f"relative in float64 (n eps = {n * 2.0 ** -52:.2g}), got {n}")
    return n


def _family_search(L, n, d, blocks, noise_var, starts, rng, tied=False):
    """The theta of the lowest of `starts` descents of the exact family loss (_family_descent) from
    a ~ U(0, 2), b ~ U(0, 1.5) drawn from rng (default seed 0), one (a, b) per layer or, tied, one
    for all; returns it and the checked (L, n, d, noise_var)."""
    L, n, d = _int("L", L, 1), _family_n(n), _int("d", d, 1)
    noise_var, blocks = _nonneg("noise_var", noise_var), _flag("blocks", blocks)
    starts = _int("starts", starts, 1)
    rng = np.random.default_rng(0) if _rng(rng, optional=True) is None else rng
    nodes, weights = _family_rule(L, n, d, blocks)
    E, k = np.eye(2 * L - 1 if blocks else L), 1 if tied else L
    if tied:          # a column of ones per shared scalar: theta_layers = E theta, the gradient E^T g (§14)
        E = scipy.linalg.block_diag(np.ones((L, 1)), *([np.ones((L - 1, 1))] if blocks else []))
    best_theta, best_f = None, math.inf
    for _ in range(starts):
        theta0 = np.r_[rng.uniform(0, 2, k), rng.uniform(0, 1.5, (1 if tied else L - 1) if blocks else 0)]
        theta, f = _family_descent(theta0, E, L, blocks, nodes, weights, n, noise_var)
        if f < best_f:
            best_theta, best_f = theta, f
    return best_theta, (L, n, d, noise_var)


@_numpy_rules
def optimal_family_scalars(L, n, d, blocks=False, noise_var=0.0, starts=24, rng=None):
    """Best member of the family of Theorem 3 (A_l = a_l Sigma^-1) or, with blocks, of Theorem 4
    (also B_l = b_l I), by multi-start L-BFGS-B on the exact population loss (MATH.md §10).

    The loss is the exact Gauss rule of wishart_quadrature's; the loss reported, family_population_loss at
    the optimum (exact rationals). Starts a_l ~ U(0, 2), b_l ~ U(0, 1.5) from rng (default seed 0).
    Returns (a (L,), b (L,) or None, loss); b[L-1] is NaN since B_{L-1} does not enter ([A] footnote 4);
    the sparse family's a is sorted (Lemma 4: the loss is symmetric). n <= MAX_FAMILY_N (1e14): beyond,
    float64 cannot resolve the loss the descent minimises (ValueError)."""
    best, (L, n, d, noise_var) = _family_search(L, n, d, blocks, noise_var, starts, rng)
    return _family_result(best, L, n, d, blocks, noise_var, sort=not blocks)


@_numpy_rules
def family_local_minimum(a, n, d, b=None, noise_var=0.0):
    """A local minimum of the exact family loss (family_population_loss) reached from the start (a, b):
    L-BFGS-B on the exact Gauss rule (MATH.md §10), restarted, while the Hessian (central differences of
    the exact gradient, steps 1e-4: ~1e-8 relative error) has an eigenvalue below -1e-6 of its largest (a
    saddle, where a symmetric start stays), from the lowest step +-t v (t = 0.1, 0.01, 0.001) along its
    eigenvector v. Tells which population minimum fitted scalars belong to (the blocks family has more
    than one). a, b: (L,) (b[L-1] ignored; b None: the sparse family); n <= MAX_LOCAL_FAMILY_N (1e9).
    Returns (a (L,), b (L,) with b[L-1] = NaN, or None, loss)."""
    a, b_full = _family_scalars(a, b)
    n, d = _family_n(n, MAX_LOCAL_FAMILY_N), _int("d", d, 1)
    noise_var = _nonneg("noise_var", noise_var)
    L, blocks, rule = a.size, b is not None, _family_rule(a.size, n, d, b is not None)
    theta = np.r_[a, b_full[:-1]] if blocks else a
    fun = lambda x: _family_loss_at_nodes(x, L, blocks, *rule, n, noise_var)
    for _ in range(10):
        theta = _family_descent(theta, np.eye(theta.size), L, blocks, *rule, n, noise_var)[0]
        H = np.array([(fun(theta + 1e-4 * e)[1] - fun(theta - 1e-4 * e)[1]) / 2e-4 for e in np.eye(theta.size)])
        lam, V = np.linalg.eigh((H + H.T) / 2)
        if lam[0] >= -1e-6 * np.max(np.abs(lam)):
            break
        theta = min((theta + t * V[:, 0] for t in (0.1, -0.1, 0.01, -0.01, 0.001, -0.001)), key=lambda x: fun(x)[0])
    return _family_result(theta, L, n, d, blocks, noise_var)


# §11 Metrics and the sandwich covariance -------------------------------------------------------

@_numpy_rules
def distance_to_multiple(M, T=None):
    """dist(M, T) = min_alpha ||M - alpha T||_F / ||M||_F, alpha = <M, T>_F / <T, T>_F.

    With T = I (the default) this is the authors' distance to identity, ||M - (tr M/d) I||/||M||
    ([A] §4.3, MATH.md §11). M, T: (d, d), M != 0. Returns a float in [0, 1]."""
    M = _array("M", M, 2)
    T = np.eye(M.shape[0]) if T is None else _array("T", T, 2)
    if T.shape != M.shape or M.shape[0] != M.shape[1]:
        raise ValueError(f"M and T must be square of the same shape, got {M.shape} and {T.shape}")
    if not np.any(M) or not np.any(T):
        raise ValueError("M and T must be nonzero")
    M, T = M / np.max(np.abs(M)), T / np.max(np.abs(T))     # scale-free: no under- or overflow
    alpha = np.sum(M * T) / np.sum(T * T)
    return float(np.linalg.norm(M - alpha * T) / np.linalg.norm(M))


@_numpy_rules
def distance_to_diagonal(M):
    """||offdiag(M)||_F / ||M||_F for a square M != 0: 0 exactly when M is diagonal (Theorem 2).
    MATH.md §11."""
    M = _array("M", M, 2)
    if M.shape[0] != M.shape[1] or not np.any(M):
        raise ValueError(f"M must be a nonzero square matrix, got shape {M.shape}")
    M = M / np.max(np.abs(M))                                # scale-free: no under- or overflow
    return float(np.linalg.norm(M - np.diag(np.diag(M))) / np.linalg.norm(M))


@_numpy_rules
def fitted_scalar(M, T):
    """alpha = <M, T>_F / <T, T>_F, the least-squares scalar with M ~ alpha T (a_l, b_l).
    MATH.md §11."""
    M, T = _array("M", M, 2), _array("T", T, 2)
    if M.shape != T.shape:
        raise ValueError(f"M and T must have the same shape, got {M.shape} and {T.shape}")
    if not np.any(T):
        raise ValueError("T must be nonzero (the scalar alpha of M ~ alpha T is undefined)")
    m, t = np.max(np.abs(M)) or 1.0, np.max(np.abs(T))       # scale-free up to the final product
    alpha = float(np.sum((M / m) * (T / t)) / np.sum((T / t) ** 2)) * (float(m) / float(t))
    if not math.isfinite(alpha):
        raise ValueError(f"alpha = <M, T> / <T, T> overflows float64 (max |M| {m:.3g}, max |T| {t:.3g})")
    return alpha


@_numpy_rules
def symmetry_directions(structure, coords, query_label_zero=True):
    """An orthonormal basis (p, k) of the directions in which the loss is exactly constant at
    coords, in the structure's pack order (MATH.md §11); the sparse structure has none (k = 0):
    - coordinates that never reach the loss: blocks B_{L-1}; for full (P, Q) the x-rows of every
      head of the last layer's P, and for one layer the last column of Q when every query's label
      slot is 0 (query_label_zero, as sample_prompts makes them; _fixed_coordinates);
    - for full (P, Q), each layer's heads enter only through K_l = sum_h P_lh kron Q_lh^T, which
      (P_lh, Q_lh) -> (sum_g A_hg P_lg, sum_g (A^-T)_hg Q_lg) leaves unchanged for any invertible
      A: the tangent directions dP_lh = P_lg, dQ_lg = -Q_lh for every pair (h, g)."""
    _choice("structure", structure, STRUCTURES)
    query_label_zero = _flag("query_label_zero", query_label_zero)
    P, Q = structure_to_PQ(structure, coords)
    L, H = P.shape[:2]
    shapes = structure_shapes(structure, L, P.shape[-1] - 1, H)
    fixed = _fixed_coordinates(structure, shapes, query_label_zero)
    directions = [e for e in np.eye(fixed.size)[fixed]]
    if structure == "full":
        for l, h, g in itertools.product(range(L), range(H), range(H)):
            dP, dQ = np.zeros_like(P), np.zeros_like(Q)
            dP[l, h], dQ[l, g] = P[l, g], -Q[l, h]
            directions.append(np.r_[dP.ravel(), dQ.ravel()])
    if not directions:
        return np.zeros((fixed.size, 0))
    U, sv, _ = np.linalg.svd(np.array(directions).T, full_matrices=False)
    return U[:, sv > 1e-12 * sv[0]] if sv[0] > 0 else np.zeros((fixed.size, 0))


def _gradient_at(structure, coords, batch):
    """(theta0, grad): the structure's coordinates as a flat theta0 (pack order), checked against the
    batch's d, and theta -> the gradient of the loss of `batch` (a _Batch) in those coordinates, a
    ValueError saying float64 overflowed if it is not finite."""
    Z = batch.Z
    D = structure_to_PQ(structure, coords)[0].shape[-1]
    if D != Z.shape[1]:
        raise ValueError(f"coords have d = {D - 1} but Z has d = {Z.shape[1] - 1}")
    names = list(coords)
    shapes = [np.shape(coords[k]) for k in names]

    def grad(theta):
        P, Q = structure_to_PQ(structure, dict(zip(names, unpack(theta, shapes))))
        with np.errstate(over="ignore", invalid="ignore"):
            _, dP, dQ = batch.evaluate(P, Q)
        _finite({"the gradient": np.r_[dP.ravel(), dQ.ravel()]}, P=P, Q=Q)
        return np.concatenate([g.ravel() for g in _structure_grad(structure, dP, dQ).values()])
    return pack([coords[k] for k in names]), grad


@_numpy_rules
def identifiable_hessian(structure, coords, Z, y, h=1e-5, activation="linear", engine=None):
    """The batch loss's gradient and Hessian at coords in the identifiable coordinates, an orthonormal
    basis U of the complement of the exact symmetry directions (symmetry_directions): a strict local
    minimum has a zero gradient and a positive definite Hessian here, a saddle a negative eigenvalue
    (MATH.md §11). The Hessian is central differences of the exact gradient along each column of U (h = 1e-5
    balances truncation h^2 against rounding eps/h), symmetrised. Arguments as sandwich_covariance.
    Returns a dict: basis U (p, m), gradient (m,) = U^T grad, hessian (m, m), eigenvalues (m,)
    ascending, symmetries k = p - m (the directions removed)."""
    Z, y = _batch(structure, activation, Z, y)
    h = _nonneg("h", h)
    if h == 0:
        raise ValueError("h must be > 0 (the step of the central differences of the gradient)")
    theta0, grad = _gradient_at(structure, coords, _Batch(Z, y, activation, engine))
    g0 = grad(theta0)                                    # an overflow is said here, before the differences
    gauge = symmetry_directions(structure, coords, query_label_zero=not np.any(Z[:, -1, -1]))
    # U: an orthonormal basis (p, p - k) of the complement of the k symmetry directions
    U = np.linalg.svd(gauge, full_matrices=True)[0][:, gauge.shape[1]:] if gauge.shape[1] else np.eye(len(gauge))
    H = np.array([U.T @ (grad(theta0 + h * u) - grad(theta0 - h * u)) / (2 * h) for u in U.T]).reshape(U.shape[1], -1)
    H = (H + H.T) / 2
    return dict(basis=U, gradient=U.T @ g0, hessian=H, eigenvalues=np.linalg.eigvalsh(H),
                symmetries=U.shape[0] - U.shape[1])


@_numpy_rules
def sandwich_covariance(structure, coords, Z, y, chunks=200, h=1e-5, activation="linear", engine=None):
    """Sampling covariance of parameters trained on the batch (Z, y), in the structure's coordinates:

        Cov(theta_hat) ~ U (H_U^-1 V_U H_U^-1) U^T / B,

    U the identifiable coordinates and H_U the batch Hessian there (identifiable_hessian: the
    exact symmetry directions removed by construction, so H_U is invertible at a strict minimum),
    V_U = U^T V U with V the covariance of one prompt's gradient: the sample covariance of the exact
    per-prompt gradients 2 r_b J_b for the linear layer (MATH.md §3.1), else the chunk size times
    the covariance of `chunks` chunk-mean gradients. Symmetric PSD, zero along the symmetries; valid
    near a strict minimiser (else a ValueError) for gradients not heavy-tailed (MATH.md §10-§11).
    Returns a (p, p) array in pack order."""
    Z, y = _batch(structure, activation, Z, y)
    chunks = _int("chunks", chunks, 2)
    if activation != "linear" and Z.shape[0] < 2 * chunks:
        raise ValueError(f"Z must hold at least 2 * chunks = {2 * chunks} prompts for the chunk-mean estimate "
                         f"of V with an activation, got {Z.shape[0]}")
    curvature = identifiable_hessian(structure, coords, Z, y, h=h, activation=activation, engine=engine)
    U, H_U = curvature["basis"], curvature["hessian"]
    if U.shape[1] == 0:
        return np.zeros((U.shape[0], U.shape[0]))
    low, high = curvature["eigenvalues"][0], np.max(np.abs(curvature["eigenvalues"]))
    if low <= 1e-10 * high:           # 1e-10: above the differences' error (~1e-11 relative)
        raise ValueError(f"the Hessian in the identifiable coordinates has an eigenvalue {low:.3g} (largest "
                         f"{high:.3g}): coords are not at a strict local minimum of the batch loss, where the "
                         "sandwich covariance is defined")
    if activation == "linear":
        P_c, Q_c = structure_to_PQ(structure, coords)
        with np.errstate(over="ignore", invalid="ignore"):
            r, JP, JQ = _Batch(Z, y, "linear", engine).evaluate(P_c, Q_c, jacobian=True)
            J = _jacobian_rows(structure, JP, JQ)
        _finite({"the Jacobian": J}, P=P_c, Q=Q_c, Z=Z)
        V_U = np.atleast_2d(np.cov(2 * r[:, None] * (J @ U), rowvar=False))
    else:
        size = Z.shape[0] // chunks
        G = []
        for i in range(0, size * chunks, size):
            theta0, grad = _gradient_at(structure, coords, _Batch(Z[i:i + size], y[i:i + size], activation, engine))
            G.append(grad(theta0))
        V_U = size * np.atleast_2d(np.cov(np.array(G) @ U, rowvar=False))
    A = U @ np.linalg.inv(H_U)
    cov = A @ V_U @ A.T / Z.shape[0]
    return (cov + cov.T) / 2


# The engine seam -------------------------------------------------------------------------------

class ReferenceEngine:
    """The evaluator protocol that `engine=` arguments take, with this module's own computations.

    An engine is any object with these five methods, computing the same numbers its own way
    (icl_fast.engine() runs them on chunks of prompts on every core). They are unchecked: the public
    functions check their inputs once, then call the engine's methods, or for engine=None the
    functions named here:
        gram(Z)                                   S_0 = Z M Z^T (B, D, D)                      §2
        loss_and_grad_gram(P, Q, S0, q0, y, n)    (loss, dP, dQ) as loss_and_grad_gram          §3
        jacobian_gram(P, Q, S0, q0, y, n)         (r (B,), JP, JQ (B, L, H, D, D)): each
                                                  prompt's residual and its gradient           §3.1
        activation_pass(P, Q, Z, y, activation, jacobian=False)
                                                  (loss, dP, dQ, Z_L), or (r, JP, JQ, Z_L),
                                                  through the explicit attention               §4
        reduced_least_squares(r, J)               (f, R) with R^T R = J^T J, R^T f = J^T r      §6"""
    gram = staticmethod(_gram)
    loss_and_grad_gram = staticmethod(_loss_and_grad_gram)
    jacobian_gram = staticmethod(_jacobian_gram)
    activation_pass = staticmethod(_activation_pass)
    reduced_least_squares = staticmethod(_reduced_least_squares)


REFERENCE = ReferenceEngine()
"""This module's computations as an engine (ReferenceEngine): what icl_fast falls back to."""


# For the project's other modules: the private names they may use, and the names that moved -----

# The private names the project's other modules may import (a test pins the list): the input checks (the
# same words everywhere), one layer's moments and loss (§8), the family search (§10), the Wishart moments (§9)
PRIVATE_API = ("_numpy_rules", "_array", "_int", "_nonneg", "_flag", "_rng", "_prompts", "_params", "_spd",
               "_finite", "_task_covariance", "_task_moment", "_pool", "_single_layer_moments",
               "_single_layer_loss", "_family_search", "_wishart_T")

_MOVED = {**dict.fromkeys(("reference_cases", "write_reference_vectors", "diagnose", "check_implementation",
                           "LAYOUTS", "ARRAY_MEANINGS", "DIAGNOSIS_VARIANTS", "CHECK_TOLERANCES",
                           "VECTOR_TOLERANCES", "VECTORS_FORMAT", "tokens_as_columns", "tokens_as_rows",
                           "params_from_authors", "params_to_authors", "grads_to_authors",
                           "VON_OSWALD_LOSS_SCALE", "params_from_von_oswald", "grads_to_von_oswald"), "icl_check"),
          **dict.fromkeys(("optimal_tied_family", "one_layer_population_grad", "one_layer_gradient_flow"),
                          "icl_looped"),
          **dict.fromkeys(("ridge_predict", "bayes_predict", "dmmse_predict", "ols_population_risk",
                           "monte_carlo_risk", "shifted_single_layer_loss"), "icl_estimators")}


def __getattr__(name):
    """A name that moved to another module in 0.4.0 (PEP 562), with a DeprecationWarning naming its
    new home; icl_ref keeps these for one release."""
    if name not in _MOVED:
        raise AttributeError(f"module 'icl_ref' has no attribute {name!r}")
    import importlib
    import warnings
    warnings.warn(f"icl_ref.{name} moved to {_MOVED[name]}.{name} in 0.4.0: import it from {_MOVED[name]} "
                  "(icl_ref keeps this name for one release)", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(_MOVED[name]), name)


if __name__ == "__main__":          # python3 -m icl_ref: the command line moved to icl_check in 0.4.0
    import runpy
    print("python3 -m icl_ref is deprecated: use python3 -m icl_check (the same command line)", file=sys.stderr)
    runpy.run_module("icl_check", run_name="__main__", alter_sys=True)
