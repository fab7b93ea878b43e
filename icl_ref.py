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

Sections follow the paper: data, model, loss and gradient (with the per-prompt Jacobian, and
attention with an activation, [A] §6), parametrisations, training (L-BFGS and Gauss-Newton), closed
forms, metrics; then adapters to other code's layouts and the conformance kit (reference vectors,
diagnose, check_implementation). One formulation of each quantity, serial, with no process-wide
state; every public function computes under numpy's default floating-point rules whatever the
caller set with np.seterr. The functions that evaluate the loss take `engine=`: another object with
the methods of REFERENCE computes the same numbers its own way (icl_fast.py, on every core).
Command line: python3 -m icl_ref vectors --out DIR.
"""
import argparse
import functools
import io
import itertools
import json
import math
import os
import sys
import time
import types
import zipfile
from fractions import Fraction

import numpy as np
import scipy
import scipy.integrate
import scipy.linalg
import scipy.optimize

STRUCTURES = ("sparse", "blocks", "full")
PAPER_EIGENVALUES = (1.0, 1.0, 0.25, 0.0625, 1.0)   # spectrum of Sigma in [A] §4.3 (MATH.md §1)


# ---------------------------------------------------------------------------------------------
# Input checks: every public function validates before it computes.
# ---------------------------------------------------------------------------------------------

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
    bad = np.isinf(arr) if allow_nan else ~np.isfinite(arr)
    if not clean and np.any(bad):
        raise ValueError(f"{name} must be finite, found {'Inf' if allow_nan else 'NaN or Inf'}")
    return arr


def _int(name, v, minimum):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {type(v).__name__}")
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
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


def _finite(results, **sizes):
    """A ValueError saying that float64 overflowed, and at what size of the inputs, unless every
    array of results {what: value} is finite."""
    for what, value in results.items():
        if not np.all(np.isfinite(value)):
            size = ", ".join(f"max |{k}| = {np.max(np.abs(v)):.3g}" for k, v in sizes.items())
            raise ValueError(f"{what} is not finite: float64 overflowed ({size}); the output of L layers "
                             "grows like (|P| |Q| |Z|^2)^((3^L - 1)/2) |Z|, so use smaller parameters or "
                             "rescale Z")


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
    """E[w_star w_star^T], (d, d): Sigma_w (SPD, the identity when None) or, for a pool (K, d), its
    second moment (1/K) sum_k w_k w_k^T, which may be singular (MATH.md §15)."""
    if tasks is None:
        return _task_covariance(Sigma_w, d)[0]
    tasks = _pool(tasks, d, Sigma_w)
    return tasks.T @ tasks / tasks.shape[0]


def _tied(tied):
    if not isinstance(tied, (bool, np.bool_)):
        raise TypeError(f"tied must be True or False, got {type(tied).__name__}")
    return bool(tied)


def _choice(name, value, choices):
    """value if it is one of the strings `choices`, else a ValueError naming `name`."""
    if not (isinstance(value, str) and value in choices):
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


# ---------------------------------------------------------------------------------------------
# 1. Data ([A] §2; MATH.md §1)
# ---------------------------------------------------------------------------------------------

@_numpy_rules
def sample_prompts(rng, batch, n, Sigma, Sigma_w=None, noise_std=0.0, return_w_star=False, tasks=None):
    """Draw B prompts of linear regression, [A] §2 with the data model of [A] Table 1.

    x_i ~ N(0, Sigma) iid for i = 0..n (the last is the query), w_star ~ N(0, Sigma_w) per prompt
    (identity by default), y_i = <w_star, x_i> + noise_std * N(0, 1). Gaussians are drawn through
    the Cholesky factor F of Sigma (x = F g), never `multivariate_normal`. With a finite pool
    `tasks` (K, d), w_star is instead a uniformly drawn row of the pool (MATH.md §15).

    Parameters: rng (numpy.random.Generator), batch = B >= 1, n >= 1, Sigma (d, d) SPD,
    Sigma_w (d, d) SPD or None, noise_std >= 0, tasks (K, d) or None (not with Sigma_w).
    Returns Z (B, d+1, n+1) with the query label slot Z[:, d, n] = 0, and y (B,) the query's label
    (noise included when noise_std > 0); with return_w_star also w_star (B, d).
    MATH.md §1.
    """
    _rng(rng)
    batch, n = _int("batch", batch, 1), _int("n", n, 1)
    Sigma, F = _spd("Sigma", Sigma)
    d = Sigma.shape[0]
    pool = None if tasks is None else _pool(tasks, d, Sigma_w)
    F_w = _task_covariance(Sigma_w, d)[1] if pool is None else None
    noise_std = _nonneg("noise_std", noise_std)
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
    Returns Sigma (d, d) and U (d, d).
    """
    _rng(rng)
    lam = _array("eigenvalues", eigenvalues, 1)
    if lam.size < 1 or np.any(lam <= 0):
        raise ValueError(f"eigenvalues must be a non-empty vector of positive numbers, got {lam}")
    U, R = np.linalg.qr(rng.standard_normal((lam.size, lam.size)))
    U = U * np.sign(np.diag(R))
    return (U * lam) @ U.T, U


# ---------------------------------------------------------------------------------------------
# 2. Model ([A] eq. (3)-(4); MATH.md §2)
#
# Since M removes the query column from the keys and values, one layer is
#     Z_{l+1} = Z_l + (1/n) sum_h P_h (Z_l M Z_l^T) Q_h Z_l = T_l Z_l,
#     T_l = I + (1/n) sum_h P_h S_l Q_h,   S_l = Z_l M Z_l^T   (D x D, never (n+1) x (n+1)).
# Every column moves by the same T_l, so S_{l+1} = T_l S_l T_l^T and q_{l+1} = T_l q_l for the
# query column q. The prediction reads only row d of the last T: (T q)_d = q_d + (1/n) sum_h
# p_h^T S Q_h q with p_h = P_h[d, :], the value row. A prompt enters only through (S_0, q_0).
#
# Stacks of the prompts' D x D matrices are multiplied with np.matmul, prompt by prompt, except
# where one factor is shared by every prompt: _times and _summed turn those into one matrix
# product of the stacked rows, as np.matmul would run the B small products one at a time. The
# batch is walked in chunks of at most 2^18 / D^3 prompts (_chunks), so that no matrix product
# exceeds 2^18 multiply-adds: OpenBLAS runs such products on the calling thread, and the
# reference never starts BLAS threads (MATH.md §3). For the same reason a sum of squares over
# prompts is np.sum(r * r), not the BLAS dot r @ r, which OpenBLAS splits over threads from 10^4
# entries on.
# ---------------------------------------------------------------------------------------------

def mask(n):
    """M = diag(1, ..., 1, 0) of shape (n+1, n+1) ([A] §2): the query is not a key or value.
    MATH.md §2."""
    n = _int("n", n, 1)
    return np.diag(np.r_[np.ones(n), 0.0])


@_numpy_rules
def forward_literal(P, Q, Z):
    """The paper's column form of eq. (4), token by token; the twin that tests the Gram form.

        z_j <- z_j + (1/n) sum_h P_h sum_{i<n} z_i (z_i^T Q_h z_j)   for every j <= n (query too)

    P, Q: (L, H, D, D); Z: (B, D, n+1). Returns Z_L (B, D, n+1). Cost O(B L H n^2 D^2).
    MATH.md §2.
    """
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


@_numpy_rules
def gram(Z):
    """S_0 = Z M Z^T, (B, D, D): the Gram matrix of the n context tokens (MATH.md §2)."""
    context = _prompts(Z)[:, :, :-1]                           # Z M drops the query column
    return context @ context.transpose(0, 2, 1)


def _chunks(B, D):
    """(start, stop) of the batch in chunks of 2^18 / D^3 prompts: every matrix product over a chunk
    (b D^3 multiply-adds) stays within the size that OpenBLAS runs on the calling thread, and the
    chunk's (b, D, D) stacks in cache. The chunks only reorder the sums over prompts (MATH.md §3)."""
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
    float64 arrays, S symmetric and the same B in S and q.
    """
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
    per_prompt each prompt's own (B, H, D, D) (the rows of the Jacobian, MATH.md §3.1).
    """
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

    so y_hat = -(T q)_d. Arguments as layer_forward. Returns (T q)_d (B,) and the cache.
    """
    Sp = [np.einsum("bij,j->bi", S, P_h[-1]) for P_h in P_l]             # S p_h = (p_h^T S)^T
    Qq = [np.einsum("ij,bj->bi", Q_h, q) for Q_h in Q_l]                # Q_h q
    out = q[:, -1] + sum(np.einsum("bi,bi->b", Sp_h, Qq_h) for Sp_h, Qq_h in zip(Sp, Qq)) / n
    return out, (P_l, Q_l, n, S, q, Sp, Qq)


@_numpy_rules
def readout_backward(dout, cache, per_prompt=False):
    """Adjoint of readout_forward (MATH.md §3): dout (B,) -> (dS, dq, dP_l, dQ_l).

    Returns dS (B, D, D), dq (B, D) and dP_l, dQ_l (H, D, D) summed over the prompts (dP_l is zero
    outside row d), or with per_prompt each prompt's own (B, H, D, D).
    """
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


@_numpy_rules
def forward(P, Q, Z, all_layers=False):
    """Z_L of the L-layer linear transformer, [A] eq. (4): Z_{l+1} = Z_l + (1/n) Attn(Z_l).

    P, Q: (L, H, D, D); Z: (B, D, n+1). Returns Z_L (B, D, n+1), or with all_layers the stack
    (Z_0, ..., Z_L) of shape (L+1, B, D, n+1). Computed as Z_{l+1} = T_l Z_l (Gram form above),
    chunk by chunk. MATH.md §2.
    """
    P, Q, Z = _model_inputs(P, Q, Z)
    n = Z.shape[2] - 1

    def layers(Zc):                                    # (Z_0, ..., Z_L) of a chunk of prompts
        S, q, Zs = gram(Zc), Zc[:, :, n], [Zc]
        for P_l, Q_l in zip(P, Q):
            S, q, T, _ = layer_forward(P_l, Q_l, S, q, n)
            Zs.append(T @ Zs[-1])
        return np.stack(Zs)
    with np.errstate(over="ignore", invalid="ignore"):
        Zs = np.concatenate([layers(Z[a:b]) for a, b in _chunks(*Z.shape[:2])], axis=1)
    _finite({"Z_L": Zs[-1]}, P=P, Q=Q, Z=Z)
    return Zs if all_layers else Zs[-1]


@_numpy_rules
def predict(P, Q, Z):
    """TF_L(Z_0) = y_hat = -Z_L[d, n] per prompt ([A] §2), shape (B,), from (S_0, q_0) through the
    last layer's readout, chunk by chunk. MATH.md §2."""
    P, Q, Z = _model_inputs(P, Q, Z)
    n = Z.shape[2] - 1
    with np.errstate(over="ignore", invalid="ignore"):
        y_hat = -np.concatenate([_propagate(P, Q, gram(Z[a:b]), Z[a:b, :, n], n)[0]
                                 for a, b in _chunks(*Z.shape[:2])])
    _finite({"the prediction": y_hat}, P=P, Q=Q, Z=Z)
    return y_hat


# ---------------------------------------------------------------------------------------------
# 3. Loss and gradient ([A] eq. (5) as in its App. A.1 and the authors' code; MATH.md §3)
# ---------------------------------------------------------------------------------------------

@_numpy_rules
def in_context_loss(P, Q, Z, y):
    """f = mean_b (Z_L[b, d, n] + y_b)^2 = mean_b (y_hat_b - y_b)^2 (no factor 1/2).

    P, Q: (L, H, D, D); Z: (B, D, n+1); y: (B,) true query labels. Returns a float.
    MATH.md §3.
    """
    P, Q, Z, y = _model_inputs(P, Q, Z, y)
    return float(np.mean((predict(P, Q, Z) - y) ** 2))


def _gram_chunk(P, Q, S0, q0, y, n, B, jacobian=False):
    """One chunk of prompts forward and back: its part of the loss, (1/B) sum_b r_b^2, and of dP,
    dQ, each divided by the whole batch size B (MATH.md §3); with jacobian, the residuals r (b,) and
    each prompt's own gradient of r_b, JP and JQ (b, L, H, D, D): the reverse pass seeded with 1 for
    every prompt and not summed (MATH.md §3.1)."""
    out, caches = _propagate(P, Q, S0, q0, n)
    r = out + y                                          # residual Z_L[d, n] + y = y - y_hat
    if jacobian:
        return (r, *_backpropagate(np.ones_like(out), caches, per_prompt=True))
    return (float(np.sum(r * r)) / B, *_backpropagate(2.0 * r / B, caches))


def _loss_and_grad_gram(P, Q, S0, q0, y, n, jacobian=False):
    """REFERENCE.loss_and_grad_gram: the chunks' parts added in chunk order (MATH.md §3); with jacobian,
    REFERENCE.jacobian_gram: the chunks' rows in order (MATH.md §3.1)."""
    B = y.shape[0]
    parts = list(zip(*[_gram_chunk(P, Q, S0[a:b], q0[a:b], y[a:b], n, B, jacobian) for a, b in _chunks(B, P.shape[-1])]))
    return tuple(np.concatenate(part) if jacobian else sum(part) for part in parts)


def _engine(engine):
    return REFERENCE if engine is None else engine


def _evaluator(engine, Z, y, activation, jacobian=False):
    """(P, Q) -> (loss, dP, dQ), or with jacobian (r, JP, JQ) with each prompt's own gradient of its
    residual (B, L, H, D, D), on the checked batch (Z, y) by `engine` (None: REFERENCE); for the
    linear layer S_0 = Z M Z^T is formed once."""
    engine = _engine(engine)
    if activation == "linear":
        n = Z.shape[2] - 1
        S0, q0 = engine.gram(Z), np.ascontiguousarray(Z[:, :, n])
        method = engine.jacobian_gram if jacobian else engine.loss_and_grad_gram
        return lambda P, Q: method(P, Q, S0, q0, y, n)
    return lambda P, Q: engine.activation_pass(P, Q, Z, y, activation, jacobian)[:3]


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
    ValueError saying that float64 overflowed. engine: None (REFERENCE) or another evaluator
    with its methods (icl_fast.engine()). Returns (loss, dP, dQ).
    """
    P, Q, S0, q0, y, n = _gram_args(P, Q, S0, q0, y, n)
    with np.errstate(over="ignore", invalid="ignore"):
        loss, dP, dQ = _engine(engine).loss_and_grad_gram(P, Q, S0, q0, y, n)
    _finite({"the loss": loss, "dP": dP, "dQ": dQ}, P=P, Q=Q, S0=S0)
    return loss, dP, dQ


@_numpy_rules
def loss_and_grad(P, Q, Z, y, engine=None):
    """In-context loss f (see in_context_loss) and its gradient by hand-written reverse mode.

    P, Q: (L, H, D, D); Z: (B, D, n+1); y: (B,). Returns (loss, dP, dQ), dP and dQ shaped like
    P, Q. Computed from the Gram form (S_0, q_0) as loss_and_grad_gram; engine as there. A result
    that is not finite is a ValueError saying that float64 overflowed. MATH.md §3.
    """
    P, Q, Z, y = _model_inputs(P, Q, Z, y)
    with np.errstate(over="ignore", invalid="ignore"):
        loss, dP, dQ = _evaluator(engine, Z, y, "linear")(P, Q)
    _finite({"the loss": loss, "dP": dP, "dQ": dQ}, P=P, Q=Q, Z=Z)
    return loss, dP, dQ


def _check_structure_of(structure, P, Q, tied=False):
    """A ValueError unless P, Q have the form of `structure` (one head, the fixed entries of (8) or
    (11); with tied, every layer equal): the Jacobian's columns in that structure's coordinates
    assume it."""
    if _tied(tied) and not (np.all(P == P[:1]) and np.all(Q == Q[:1])):
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
    """Per-prompt gradients JP, JQ (B, L, H, D, D) as Jacobian rows (B, p) in the structure's
    coordinates (tied: one layer's): the chain rules of structure_grad applied to every row at once
    (MATH.md §5, §14)."""
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
    coordinates (MATH.md §14). Returns r (B,) and J (B, p); 2 J^T r / B is the gradient of the loss.
    """
    _choice("structure", structure, STRUCTURES)
    P, Q, S0, q0, y, n = _gram_args(P, Q, S0, q0, y, n)
    _check_structure_of(structure, P, Q, tied)
    with np.errstate(over="ignore", invalid="ignore"):
        r, JP, JQ = _engine(engine).jacobian_gram(P, Q, S0, q0, y, n)
        J = _jacobian_rows(structure, JP, JQ, tied)
    _finite({"the residuals": r, "the Jacobian": J}, P=P, Q=Q, S0=S0)
    return r, J


@_numpy_rules
def residuals_and_jacobian(P, Q, Z, y, structure="full", activation="linear", engine=None, tied=False):
    """Per-prompt residuals r = Z_L[:, d, n] + y (B,) and Jacobian J (B, p) of the prompts Z
    (B, D, n+1): residuals_and_jacobian_gram (structure, engine, tied and the result as there) with
    S_0, q_0 formed from Z. J holds B p floats (B = 200000, p = 150: 240 MB). activation: one of
    ACTIVATIONS; other than "linear" the rows come from the explicit attention (MATH.md §3.1, §4).
    """
    _choice("structure", structure, STRUCTURES)
    _choice("activation", activation, ACTIVATIONS)
    P, Q, Z, y = _model_inputs(P, Q, Z, y)
    _check_structure_of(structure, P, Q, tied)
    with np.errstate(over="ignore", invalid="ignore"):
        r, JP, JQ = _evaluator(engine, Z, y, activation, jacobian=True)(P, Q)
        J = _jacobian_rows(structure, JP, JQ, tied)
    _finite({"the residuals": r, "the Jacobian": J}, P=P, Q=Q, Z=Z)
    return r, J

# ---------------------------------------------------------------------------------------------
# 3b. Attention with an activation ([A] §6, Theorem 5; the rebuttal's softmax heads; MATH.md §4)
#
#     Attn_sigma(Z) = P Z M sigma(Z^T Q Z),   E = Z^T Q Z (B, n+1, n+1), E[i, j] = z_i^T Q z_j,
#
# key i, output column j. These layers need the (n+1) x (n+1) matrix; the linear layer above
# stays the fast default. sigma is applied entrywise ("relu") or per output column j over keys:
#   "softmax"     normalises over the n context keys i < n (the keys that M lets through, so each
#                 column's weights sum to 1; icl_ref's choice)
#   "softmax_all" normalises over all n+1 keys, the query's own key included, and M then drops
#                 that key's value: the authors' code (torch softmax(dim=2) before the mask), so a
#                 column's weights on the context sum to less than 1
#   "linear"      sigma = identity: the explicit-attention twin of the linear layer
# ---------------------------------------------------------------------------------------------

ACTIVATIONS = ("linear", "relu", "softmax", "softmax_all")


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
    """REFERENCE.activation_pass: the batch through _activation_chunk in chunks of 2^15 / (n+1)^2
    prompts (their (b, n+1, n+1) score matrices stay in cache); (loss, dP, dQ, Z_L) summed in chunk
    order, or with jacobian (r, JP, JQ, Z_L) concatenated. Unchecked: the callers check."""
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
    with np.errstate(over="ignore", invalid="ignore"):
        loss, dP, dQ, _ = _engine(engine).activation_pass(P, Q, Z, y, activation)
    _finite({"the loss": loss, "dP": dP, "dQ": dQ}, P=P, Q=Q, Z=Z)
    return loss, dP, dQ


# ---------------------------------------------------------------------------------------------
# 4. Parametrisations ([A] eq. (8) and (11); MATH.md §5) and flat vectors for SciPy
# ---------------------------------------------------------------------------------------------

def _blocks(name, A):
    A = _array(name, A, 3)
    if A.shape[0] < 1 or A.shape[1] < 1 or A.shape[1] != A.shape[2]:
        raise ValueError(f"{name} must have shape (L, d, d) with L, d >= 1, got {A.shape}")
    return A


def block_params(A, Bm):
    """Structure (11) with the sign of (8): P_l = [[B_l, 0], [0, 1]], Q_l = -[[A_l, 0], [0, 0]].

    A, Bm: (L, d, d). Returns P, Q of shape (L, 1, d+1, d+1).
    MATH.md §5.
    """
    A, Bm = _blocks("A", A), _blocks("Bm", Bm)
    if A.shape != Bm.shape:
        raise ValueError(f"A and Bm must have the same shape (L, d, d), got {A.shape} and {Bm.shape}")
    L, d, _ = A.shape
    P, Q = np.zeros((2, L, 1, d + 1, d + 1))
    P[:, 0, :d, :d] = Bm
    P[:, 0, d, d] = 1.0
    Q[:, 0, :d, :d] = -A
    return P, Q


def block_grad(dP, dQ):
    """Chain rule for block_params: (dP, dQ) of shape (L, 1, D, D) -> (dA, dB), each (L, d, d).
    MATH.md §5."""
    grads = structure_grad("blocks", dP, dQ)
    return grads["A"], grads["B"]


def sparse_params(A):
    """Structure (8), the family of Lemma 1: P_l = [[0, 0], [0, 1]], Q_l = -[[A_l, 0], [0, 0]].

    A: (L, d, d). Returns P, Q of shape (L, 1, d+1, d+1).
    MATH.md §5.
    """
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
    L = 1 if _tied(tied) else L
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


def structure_grad(structure, dP, dQ, tied=False):
    """The gradient in a structure's own coordinates, a dict keyed like structure_shapes. tied: the
    coordinates are shared by every layer, so their gradient is the sum of the L layers' (the chain
    rule of the repetition, MATH.md §14), with a leading axis 1. MATH.md §5."""
    _choice("structure", structure, STRUCTURES)
    dP, dQ = _params(dP, dQ, ("dP", "dQ"))
    if structure != "full" and dP.shape[1] != 1:
        raise ValueError(f"dP, dQ must have one head, shape (L, 1, D, D), for the structures (8) and (11); "
                         f"got {dP.shape}")
    return _structure_grad(structure, dP, dQ, _tied(tied))


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


# ---------------------------------------------------------------------------------------------
# 5. Training on a fixed batch ([A] Fig. 3c and the authors' LBFGS notebook; MATH.md §6)
#
# Both trainers work on the batch divided by c, a power of two near its size (_data_scale): the
# token maps T_l are unchanged when S -> S / c^2 and Q -> c^2 Q, so the parameters map exactly and
# gtol means the same at any scale of the data; data drawn as in the paper have c = 1.
# ---------------------------------------------------------------------------------------------

def _data_scale(Z):
    """c = 2^floor(log2 rms(Z)): Z / c has entries of root mean square in [1, 2), and dividing by a
    power of two is exact (MATH.md §6). A Z with no normal float64 entry has no scale."""
    m = float(np.max(np.abs(Z)))
    if m < np.finfo(np.float64).tiny:
        raise ValueError(f"Z's entries are all zero or subnormal (largest {m:.1e}): there is nothing to train "
                         "on at float64 precision; rescale Z and y")
    return 2.0 ** math.floor(math.log2(m * math.sqrt(float(np.mean((Z / m) ** 2)))))


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
        self.tied, self.layers = _tied(tied), layers
        self.progress = _int("progress", progress, 0)
        self.shapes = structure_shapes(structure, layers, Z.shape[1] - 1, heads, self.tied)
        self.c = _data_scale(Z)
        self.Z, self.y = Z / self.c, y / self.c
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

    Z: (B, d+1, n+1), y: (B,), layers = L >= 1, structure in {"sparse", "blocks", "full"},
    heads = H >= 1 (only for "full"). init: "random" (iid N(0, init_scale^2) entries drawn
    from rng, a numpy Generator, in the units of Z / c below: the same start at any scale) or a dict of arrays in the structure's coordinates (shapes as
    structure_shapes). The options maxiter, maxfun (default 5 * maxiter), maxcor, ftol, gtol and
    maxls go to scipy.optimize.minimize(method="L-BFGS-B") as they are; ftol = 0 (the default)
    stops only on the projected gradient (gtol: its largest entry, L-BFGS-B's own test) or when the
    loss no longer decreases at all, so a stop is at a small gradient, not at a slow stretch.
    maxcor = 20 pairs suffice for the sparse structure; the blocks structure wants about twice its
    coordinates (MATH.md §6). progress = k > 0 prints "iteration, loss, |grad|, elapsed" to stderr
    every k iterations. keep_iterates stores the coordinates after every iteration (result
    ["iterates"], a list of dicts, initial point first). activation: "linear" (the paper's layer;
    S_0 = Z M Z^T is formed once and each evaluation costs O(B L H D^3)) or one of ACTIVATIONS
    (explicit attention, O(B L H n^2 D)). engine as loss_and_grad_gram (icl_fast's trainers pass
    theirs: the same numbers, on several cores). tied: one layer's coordinates (structure_shapes
    with tied=True) applied `layers` times, the looped model of MATH.md §14; its gradient is the
    sum of the layers'.

    Returns a dict: structure, tied, coords (the structure's own arrays), P, Q, loss, grad_norm (the
    gradient's Euclidean norm; gtol bounds its largest entry), scale (c, MATH.md §6), nit, nfev, success, status, message,
    interrupted, wall_time, scipy_version, history (the loss after each iteration, the initial loss
    first) and options. success is icl_ref's own verdict: the returned point's loss and gradient are
    finite and its gradient is within gtol, measured on the batch divided by c = 2^floor(log2 rms(Z))
    (exact; c = 1 for data of root mean square in [1, 2), as sample_prompts draws), so the test
    reads the same at any scale of the data; scipy's status and message are kept beside it. A
    trial point where the model overflows is a failed trial. Ctrl-C before the first evaluation
    completes raises KeyboardInterrupt (there is nothing to return); after it, the trainer returns
    the last completed iterate with interrupted=True and success=False.
    """
    options = dict(maxiter=_int("maxiter", maxiter, 1),
                   maxfun=5 * maxiter if maxfun is None else _int("maxfun", maxfun, 1),
                   maxcor=_int("maxcor", maxcor, 1), ftol=_nonneg("ftol", ftol),
                   gtol=_nonneg("gtol", gtol), maxls=_int("maxls", maxls, 1))
    run = _Run(Z, y, layers, structure, heads, init, init_scale, rng, activation, progress, engine, tied)
    evaluate = _evaluator(engine, run.Z, run.y, activation)
    last, history, failed = {}, [], [0]

    def fun(theta):
        # a trial point where the model overflows is a failed trial (an infinite loss), so the
        # line search backs off instead of the run ending; `last` keeps only finite evaluations
        if np.all(np.isfinite(theta)):
            with np.errstate(over="ignore", invalid="ignore"):
                loss, dP, dQ = evaluate(*run.PQ(theta))
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
    (MATH.md §6). r: (B,), J: (B, p).

    The factor is updated by blocks of rows C: LAPACK's dtpqrt makes it the factor of [factor; C]
    with reflectors 4 columns wide, so each block product, 4 x (rows) x (p+1), stays within the
    2^18 multiply-adds that OpenBLAS runs on the calling thread (§2)."""
    B, p = J.shape
    R_aug = np.zeros((p + 1, p + 1), order="F")      # fewer than p + 1 prompts: its last rows stay 0
    rows = max(1, 2 ** 16 // (p + 1))
    for a in range(0, B, rows):
        C = np.asfortranarray(np.column_stack([J[a:a + rows], r[a:a + rows]]))
        R_aug, _, _, info = scipy.linalg.lapack.dtpqrt(0, min(4, p + 1), R_aug, C, overwrite_a=True, overwrite_b=True)
        assert info == 0, info                       # only a wrong argument makes dtpqrt fail
    return R_aug[:, p], R_aug[:, :p]


@_numpy_rules
def train_gauss_newton(Z, y, layers, structure="sparse", heads=1, init="random", init_scale=0.1,
                       rng=None, max_nfev=500, gtol=1e-8, progress=0, activation="linear", engine=None,
                       tied=False):
    """Minimise the in-context loss on (Z, y) by Gauss-Newton with a trust region (MATH.md §6).

    scipy.optimize.least_squares on the residuals r / sqrt(B) (method "dogbox" for the sparse and
    blocks structures, "trf" for full P, Q, MATH.md §6) with the hand-derived Jacobian of
    residuals_and_jacobian_gram, so its objective is half the loss; the solver sees the equivalent
    (p+1)-dimensional system of _reduced_least_squares (the same steps, a small SVD). Arguments as
    train_lbfgs; max_nfev bounds residual evaluations (each with its Jacobian). The coordinates that
    do not enter the loss (blocks: B_{L-1}; full: the x-rows of P_{L-1}) are held at their initial
    values (result["fixed"] counts them). Converged means a small gradient: grad_norm =
    |2 J^T r / B| over the free coordinates <= gtol. history holds the loss after each accepted
    decrease; nit counts evaluations. tied as train_lbfgs (every tied coordinate is free for
    layers > 1). Returns train_lbfgs's dict (success, scale and Ctrl-C as there) plus fixed.
    """
    options = dict(max_nfev=_int("max_nfev", max_nfev, 1), gtol=_nonneg("gtol", gtol))
    run = _Run(Z, y, layers, structure, heads, init, init_scale, rng, activation, progress, engine, tied)
    B = run.Z.shape[0]
    jacobian = _evaluator(engine, run.Z, run.y, activation, jacobian=True)
    free = ~_fixed_coordinates(structure, run.shapes, query_label_zero=not np.any(run.Z[:, -1, -1]),
                               tied_layers=run.layers if run.tied else 1)
    root_B = math.sqrt(B)

    def full(x):
        theta = run.theta0.copy()
        theta[free] = x
        return theta

    cache, best, history = {}, dict(loss=math.inf), []

    def evaluate(x):
        # a trial point where the model overflows gets an infinite loss: the trust region shrinks
        if cache.get("x") is not None and np.array_equal(cache["x"], x):
            return cache
        cache.update(x=x.copy(), f=np.full(x.size + 1, np.inf), R=np.zeros((x.size + 1, x.size)))
        if not np.all(np.isfinite(x)):
            return cache
        with np.errstate(over="ignore", invalid="ignore"):
            r, JP, JQ = jacobian(*run.PQ(full(x)))
            J = _jacobian_rows(structure, JP, JQ, run.tied)[:, free]
        if not (np.all(np.isfinite(r)) and np.all(np.isfinite(J))):
            return cache
        cache["f"], cache["R"] = _engine(engine).reduced_least_squares(r / root_B, J / root_B)
        loss = float(np.sum(r * r)) / B
        if loss < best["loss"]:
            # 2 J^T r / B = 2 R^T f: a (p+1, p) product where J.T @ r would wake BLAS threads (MATH.md §6)
            best.update(x=x.copy(), loss=loss, grad=2 * cache["R"].T @ cache["f"])
            history.append(loss)
            run.say("eval", len(history) - 1, loss, best["grad"])
        return cache

    x0 = run.theta0[free]
    evaluate(x0)
    if not math.isfinite(best["loss"]):
        raise ValueError("the loss or its Jacobian at the initial point is not finite (float64 overflow): "
                         "use a smaller init_scale or init, or rescale Z")
    # dogleg steps take about half the evaluations on the structured models; on full P, Q, whose
    # Jacobian is rank-deficient along (gamma P_l, Q_l / gamma), they stall where "trf" does not
    method = "trf" if structure == "full" else "dogbox"
    try:
        res = scipy.optimize.least_squares(lambda x: evaluate(x)["f"], x0, jac=lambda x: evaluate(x)["R"],
                                           method=method, ftol=1e-15, xtol=1e-15, gtol=1e-15,
                                           max_nfev=options["max_nfev"])
        outcome = dict(nit=int(res.nfev), nfev=int(res.nfev), status=int(res.status),
                       message=str(res.message), interrupted=False)
    except KeyboardInterrupt:
        outcome = dict(_INTERRUPTED, nit=len(history),
                       message=f"interrupted by KeyboardInterrupt after {len(history)} decreases")
    grad_norm = _norm(best["grad"])
    success = not outcome["interrupted"] and grad_norm <= options["gtol"]
    if not outcome["interrupted"]:
        outcome["message"] += f"; gradient norm {grad_norm:.2e} {'<=' if success else '>'} gtol {options['gtol']:.1e}"
    return run.result(full(best["x"]), best["loss"], best["grad"], history, options, outcome, success,
                      fixed=int(np.sum(~free)))


REFERENCE = types.SimpleNamespace(gram=gram, loss_and_grad_gram=_loss_and_grad_gram,
                                  jacobian_gram=functools.partial(_loss_and_grad_gram, jacobian=True),
                                  activation_pass=_activation_pass, reduced_least_squares=_reduced_least_squares)
"""The evaluator that the `engine=` arguments default to: icl_ref's own computations, unchecked (the
public functions check their inputs once). Another engine (icl_fast.engine()) is any object with
these five methods, returning the same numbers:
    gram(Z)                                   S_0 = Z M Z^T (B, D, D)
    loss_and_grad_gram(P, Q, S0, q0, y, n)    (loss, dP, dQ) as loss_and_grad_gram
    jacobian_gram(P, Q, S0, q0, y, n)         (r (B,), JP, JQ (B, L, H, D, D)): each prompt's gradient of r_b
    activation_pass(P, Q, Z, y, activation, jacobian=False)
                                              (loss, dP, dQ, Z_L), or (r, JP, JQ, Z_L), explicit attention
    reduced_least_squares(r, J)               (f, R) of _reduced_least_squares
MATH.md §3, §3.1, §4 and §6 derive what each computes."""


# ---------------------------------------------------------------------------------------------
# 6. Closed forms (MATH.md §7-§10)
# ---------------------------------------------------------------------------------------------

@_numpy_rules
def preconditioned_gd(X, y, A):
    """Lemma 1 of [A]: the iterates the sparse transformer (8) implements, w_0 = 0 and

        w_{l+1} = w_l - A_l^T grad R(w_l),   grad R(w) = (1/n) X^T (X w - y).

    The paper writes A_l; the transpose makes it exact for non-symmetric A_l (MATH.md §7).
    X: (n, d) or (B, n, d) context covariates; y: (n,) or (B, n) context labels; A: (L, d, d).
    Returns W of shape (L+1, d) or (B, L+1, d); the transformer predicts <w_L, x_q>.
    """
    X, y, A = _array("X", X, (2, 3)), _array("y", y, (1, 2)), _blocks("A", A)
    if y.shape != X.shape[:-1]:
        raise ValueError(f"y must have shape {X.shape[:-1]} to match X of shape {X.shape}, got {y.shape}")
    single = X.ndim == 2
    X, y = (X[None], y[None]) if single else (X, y)
    B, n, d = X.shape
    if A.shape[1] != d:
        raise ValueError(f"A must have shape (L, {d}, {d}) to match X, got {A.shape}")
    W = [np.zeros((B, d))]
    for A_l in A:
        grad_R = np.einsum("bid,bi->bd", X, np.einsum("bid,bd->bi", X, W[-1]) - y) / n
        W.append(W[-1] - grad_R @ A_l)                       # (A_l^T g)^T = g^T A_l, row-wise
    W = np.stack(W, axis=1)
    return W[0] if single else W


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
    from that pool (MATH.md §15). Returns (d, d); the optimal layer is sparse_params(Gamma*[None]).
    """
    n = _int("n", n, 1)
    Sigma = _spd("Sigma", Sigma)[0]
    M = _task_moment(Sigma_w, tasks, Sigma.shape[0])
    noise_var = _nonneg("noise_var", noise_var)
    # scale-free: with Sigma = c S and M = w W (max entries 1), Gamma* = K'^-1 S W / c, where K'
    # is K of (S, W) with the noise noise_var / (c w); no under- or overflow at any scale of Sigma
    c, w = np.max(np.abs(Sigma)), np.max(np.abs(M)) or 1.0          # w = 0: a pool of zero tasks
    K, E_hw = _single_layer_moments(Sigma / c, n, M / w, noise_var / (c * w))
    G = np.linalg.solve(K, E_hw) / c
    _finite({"Gamma*": G}, Sigma=Sigma)
    return G


@_numpy_rules
def single_layer_population_loss(Gamma, Sigma, n, Sigma_w=None, noise_var=0.0, query_noise=True):
    """Exact E (y_hat - y_q)^2 of the one-layer sparse model with A_0 = Gamma, any (d, d), on prompts as
    sample_prompts draws them (MATH.md §8): shifted_single_layer_loss with the query drawn like the
    context, L(Gamma) = tr(Sigma Gamma^T K Gamma) - 2 tr(Sigma Gamma^T Sigma Sigma_w) + tr(Sigma Sigma_w)
    (+ noise_var if query_noise), K as in gamma_star. Arguments as there; returns a float.
    """
    return shifted_single_layer_loss(Gamma, Sigma, n, Sigma_w, noise_var, query_noise)


MAX_FULL_LAYER_D = 8     # the exact rule over w* below has 4^d nodes


@_numpy_rules
def full_layer_population_loss(P, Q, Sigma, n, Sigma_w=None):
    """Exact E (y_hat - y_q)^2 of one layer with any (P, Q), noiseless labels (MATH.md §8):

        L(P, Q) = E_w [ a^T Sigma a + (1/n) sum_hk b_kh^T Sigma b_hk
                        + (1/n) sum_hk tr(K_h Sigma K_k^T Sigma) u_h^T Sigma u_k + 2 w^T Sigma a + w^T Sigma w ],
        u_h = p_h,x + p_h,y w,  K_h = G_h,x + w g_h,y^T,  b_kh = K_k^T Sigma u_h,  a = sum_h b_hh,

    with p_h = P_h[d, :] = [p_h,x; p_h,y] (the value row), G_h = Q_h[:, :d] = [G_h,x; g_h,y^T] (the
    query label is 0), x ~ N(0, Sigma) and w = w* ~ N(0, Sigma_w). The integrand is a polynomial of
    degree 6 in w, so a product Gauss-Hermite rule of 4 nodes per coordinate (exact to degree 7 in
    each) gives E_w exactly: 4^d nodes, hence d <= MAX_FULL_LAYER_D.
    P, Q: (1, H, D, D); Sigma, Sigma_w: (d, d) SPD; n >= 1. Returns a float. At sparse (P, Q) it is
    single_layer_population_loss; P's other rows and Q's last column do not enter.
    """
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
    Sw = w @ Sigma
    with np.errstate(over="ignore", invalid="ignore"):
        integrand = (np.einsum("ni,ij,nj->n", a, Sigma, a) + np.einsum("nkhi,ij,nhkj->n", b, Sigma, b) / n
                     + np.einsum("nhk,nhi,nki->n", trace, Su, u) / n + 2 * np.sum(Sw * a, axis=1)
                     + np.sum(Sw * w, axis=1))
        loss = weight @ integrand
    _finite({"the loss": loss}, P=P, Q=Q, Sigma=Sigma)
    return float(loss)


def gd_step_size(n, d, noise_var=0.0):
    """Mahankali et al. (2023): the optimal single layer is one GD step from 0 with the
    per-example step eta = 1 / (n + 1 + d + noise_var) (MATH.md §8, translated to [A]'s form):
    Gamma* = n * eta * I for Sigma = Sigma_w = I, and n * eta * Sigma^-1 for Sigma_w = Sigma^-1.
    """
    return 1.0 / (_int("n", n, 1) + 1 + _int("d", d, 1) + _nonneg("noise_var", noise_var))


MAX_MOMENT_ORDER = 40    # exact Wishart moments up to this order (MATH.md §9)


def _wishart_T(n, d, parts, memo):
    """T(k_1..k_r) = E prod_j tr(W^{k_j}), W ~ Wishart_d(n, I), by the recursion of MATH.md §9.

    parts is a sorted tuple of positive integers; an exact Python integer is returned. memo holds
    the values found so far in this computation (a dict the caller owns).
    """
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


def wishart_trace_moments(n, d, kmax):
    """m_k = E tr(S^k), k = 0..kmax, for S = W/n, W ~ Wishart_d(n, I) (MATH.md §9), exactly.

    S is the whitened sample covariance of n context examples ([A] §4.2). Returns a list of
    fractions.Fraction; m_0 = d, m_1 = d, m_2 = d (n + d + 1)/n.
    """
    n, d, kmax = _int("n", n, 1), _int("d", d, 1), _int("kmax", kmax, 0)
    if kmax > MAX_MOMENT_ORDER:      # the recursion visits every partition of k: p(40) = 37338, p(81) = 1.8e7
        raise ValueError(f"kmax must be <= {MAX_MOMENT_ORDER} (exact moments cost every partition of k), "
                         f"got {kmax}")
    return list(_trace_moments(n, d, kmax))


@functools.lru_cache(maxsize=64)
def _trace_moments(n, d, kmax):
    """wishart_trace_moments as a tuple, kept for the 64 most recent (n, d, kmax): the exact loss
    and the quadrature ask for the same moments at every evaluation."""
    memo = {}
    return (Fraction(d),) + tuple(Fraction(_wishart_T(n, d, (k,), memo), n ** k) for k in range(1, kmax + 1))


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
    converted to Fractions exactly.
    """
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
    rounded once. a, b: (L,); b[L-1] does not enter. Returns a float.
    """
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
    f += s2 / n * sum(e_k * m_k for e_k, m_k in zip(e, m[1:])) + (s2 if query_noise else 0)
    return float(f)


@_numpy_rules
def wishart_quadrature(n, d, K):
    """K-node Gauss rule for the mean spectral measure mu of S = W/n (mu has mass d, moments m_k):

        E tr g(S) = integral g dmu = sum_j weights_j g(nodes_j)   exactly for deg g <= 2K - 1.

    The recurrence coefficients come from the exact moments by Chebyshev's algorithm in rational
    arithmetic (Gautschi, "Orthogonal polynomials", 2004, §2.1.7), so only the final symmetric
    tridiagonal eigenproblem is in floating point. Returns nodes (K,), weights (K,) (positive).
    MATH.md §10.
    """
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


def _family_descent(L, n, d, blocks, noise_var, tied=False):
    """theta0 -> scipy's L-BFGS-B result on the family loss at the exact Gauss nodes (MATH.md §10),
    theta = (a (L,), b (L-1,) with blocks), with the gradient of _family_loss_at_nodes; tied:
    theta = (a, b with blocks) shared by the layers, theta_layers = E theta with a 0/1 matrix E,
    so the gradient is E^T (the layers' gradient), their sum (MATH.md §14). Refuses families whose
    exact loss needs moments beyond MAX_MOMENT_ORDER."""
    degree = (3 ** L - 1) // 2 if blocks else L                  # deg p, MATH.md §10
    if 2 * degree + 1 > MAX_MOMENT_ORDER:
        raise ValueError(f"L must be <= {3 if blocks else (MAX_MOMENT_ORDER - 1) // 2} for the "
                         f"{'blocks' if blocks else 'sparse'} family: its Gauss rule needs Wishart moments "
                         f"up to order 2 deg p + 1 = {2 * degree + 1} > {MAX_MOMENT_ORDER}, got L = {L}")
    nodes, weights = wishart_quadrature(n, d, degree + 1)       # exact to degree 2 deg p + 1
    args = (L, blocks, nodes, weights, n, noise_var)
    E = np.eye(2 * L - 1 if blocks else L)
    if tied:                               # a column of ones per shared scalar: theta_layers = E theta
        E = scipy.linalg.block_diag(np.ones((L, 1)), *([np.ones((L - 1, 1))] if blocks else []))

    def fun(theta):
        f, g = _family_loss_at_nodes(E @ theta, *args)
        return f, E.T @ g
    return lambda theta0: scipy.optimize.minimize(fun, theta0, jac=True, method="L-BFGS-B",
                                                  options=dict(ftol=1e-15, gtol=1e-12))


def _family_result(theta, L, n, d, blocks, noise_var, sort=False):
    """(a, b with b[L-1] = NaN or None, exact loss) from a descent's theta."""
    a = np.sort(theta[:L]) if sort else theta[:L]
    b = np.r_[theta[L:], np.nan] if blocks else None
    return a, b, family_population_loss(a, n, d, b, noise_var=noise_var)


@_numpy_rules
def optimal_family_scalars(L, n, d, blocks=False, noise_var=0.0, starts=24, rng=None):
    """Best member of the family of Theorem 3 (A_l = a_l Sigma^-1) or, with blocks, of
    Theorem 4 (also B_l = b_l I), by multi-start L-BFGS-B on the exact population loss.

    The loss is evaluated with the exact Gauss rule of wishart_quadrature (float64, no
    cancellation); the reported loss is family_population_loss at the optimum (exact rationals).
    Starts: a_l ~ U(0, 2), b_l ~ U(0, 1.5) from rng (default seed 0).
    Returns (a (L,), b (L,) or None, loss); b[L-1] is NaN since B_{L-1} does not enter the loss
    ([A] footnote 4). For the sparse family a is sorted (the loss is symmetric, Lemma 4).
    MATH.md §10.
    """
    best, (L, n, d, noise_var) = _family_search(L, n, d, blocks, noise_var, starts, rng)
    return _family_result(best.x, L, n, d, blocks, noise_var, sort=not blocks)


def _family_search(L, n, d, blocks, noise_var, starts, rng, tied=False):
    """The lowest of `starts` descents of the exact family loss (_family_descent) from a ~ U(0, 2),
    b ~ U(0, 1.5) drawn from rng (default seed 0), one (a, b) per layer or, tied, one for all;
    returns it and the checked (L, n, d, noise_var)."""
    L, n, d = _int("L", L, 1), _int("n", n, 1), _int("d", d, 1)
    noise_var = _nonneg("noise_var", noise_var)
    starts = _int("starts", starts, 1)
    rng = np.random.default_rng(0) if _rng(rng, optional=True) is None else rng
    descend = _family_descent(L, n, d, blocks, noise_var, tied=tied)
    k = 1 if tied else L
    best = min((descend(np.r_[rng.uniform(0, 2, k), rng.uniform(0, 1.5, (1 if tied else L - 1) if blocks else 0)])
                for _ in range(starts)), key=lambda res: res.fun)
    return best, (L, n, d, noise_var)


@_numpy_rules
def family_local_minimum(a, n, d, b=None, noise_var=0.0):
    """The local minimum of the exact family loss (family_population_loss) whose basin holds the start
    (a, b): one L-BFGS-B descent on the exact Gauss rule, as in optimal_family_scalars (MATH.md §10).
    Tells which population minimum a trained model's fitted scalars belong to (the blocks family has
    more than one). a, b: (L,) (b[L-1] ignored; b None: the sparse family).
    Returns (a (L,), b (L,) with b[L-1] = NaN, or None, loss)."""
    a, b_full = _family_scalars(a, b)
    n, d = _int("n", n, 1), _int("d", d, 1)
    noise_var = _nonneg("noise_var", noise_var)
    L, blocks = a.size, b is not None
    res = _family_descent(L, n, d, blocks, noise_var)(np.r_[a, b_full[:-1]] if blocks else a)
    return _family_result(res.x, L, n, d, blocks, noise_var)


# ---------------------------------------------------------------------------------------------
# 7. Metrics (MATH.md §11)
# ---------------------------------------------------------------------------------------------

@_numpy_rules
def distance_to_multiple(M, T=None):
    """dist(M, T) = min_alpha ||M - alpha T||_F / ||M||_F, alpha = <M, T>_F / <T, T>_F.

    With T = I (the default) this is the authors' distance to identity, ||M - (tr M/d) I||/||M||
    ([A] §4.3, MATH.md §11). M, T: (d, d), M != 0. Returns a float in [0, 1].
    """
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
    return float(np.sum((M / m) * (T / t)) / np.sum((T / t) ** 2) * (m / t))


@_numpy_rules
def symmetry_directions(structure, coords, query_label_zero=True):
    """An orthonormal basis (p, k) of the directions in which the loss is exactly constant at
    coords, in the structure's pack order (MATH.md §11):

    - coordinates that never reach the loss: blocks B_{L-1}; for full (P, Q) the x-rows of every
      head of the last layer's P, and for one layer the last column of Q when every query's label
      slot is 0 (query_label_zero, as sample_prompts makes them; _fixed_coordinates);
    - for full (P, Q), each layer's heads enter only through K_l = sum_h P_lh kron Q_lh^T, which
      (P_lh, Q_lh) -> (sum_g A_hg P_lg, sum_g (A^-T)_hg Q_lg) leaves unchanged for any invertible
      A: the tangent directions dP_lh = P_lg, dQ_lg = -Q_lh for every pair (h, g), the rescaling
      (P_lh, -Q_lh) among them (h = g).

    The sparse structure has none (k = 0). Returns an array (p, k)."""
    _choice("structure", structure, STRUCTURES)
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


def _gradient_at(structure, coords, Z, evaluate):
    """(theta0, grad): the structure's coordinates as a flat theta0 (pack order), checked against Z's
    d, and theta -> the loss gradient in those coordinates by `evaluate` (P, Q) -> (loss, dP, dQ), a
    ValueError saying float64 overflowed if it is not finite."""
    D = structure_to_PQ(structure, coords)[0].shape[-1]
    if D != Z.shape[1]:
        raise ValueError(f"coords have d = {D - 1} but Z has d = {Z.shape[1] - 1}")
    names = list(coords)
    shapes = [np.shape(coords[k]) for k in names]

    def grad(theta):
        P, Q = structure_to_PQ(structure, dict(zip(names, unpack(theta, shapes))))
        with np.errstate(over="ignore", invalid="ignore"):
            _, dP, dQ = evaluate(P, Q)
        _finite({"the gradient": np.r_[dP.ravel(), dQ.ravel()]}, P=P, Q=Q)
        return np.concatenate([g.ravel() for g in _structure_grad(structure, dP, dQ).values()])
    return pack([coords[k] for k in names]), grad


@_numpy_rules
def identifiable_hessian(structure, coords, Z, y, h=1e-5, activation="linear", engine=None):
    """The batch loss's gradient and Hessian at coords in the identifiable coordinates: an
    orthonormal basis U of the complement of the exact symmetry directions (symmetry_directions),
    so that a strict local minimum has a zero gradient and a positive definite Hessian here, and a
    saddle a negative eigenvalue (MATH.md §11).

    The Hessian is central differences of the exact gradient along each column of U (h = 1e-5
    balances truncation h^2 against rounding eps/h), symmetrised. Arguments as sandwich_covariance.
    Returns a dict: basis U (p, m), gradient (m,) = U^T grad, hessian (m, m), eigenvalues (m,)
    ascending, symmetries k = p - m (the directions removed).
    """
    Z, y = _batch(structure, activation, Z, y)
    h = _nonneg("h", h)
    if h == 0:
        raise ValueError("h must be > 0 (the step of the central differences of the gradient)")
    theta0, grad = _gradient_at(structure, coords, Z, _evaluator(engine, Z, y, activation))
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
    V_U = U^T V U with V the covariance of one prompt's gradient: exact from the per-prompt gradients
    2 r_b J_b for the linear layer (MATH.md §3.1), else estimated as the chunk size times the
    covariance of `chunks` chunk-mean gradients. The result is symmetric and positive semi-definite,
    zero along the symmetry directions. Valid near a strict minimiser of the batch loss (a Hessian
    with an eigenvalue <= 0 there is a ValueError), for gradients that are not heavy-tailed
    (MATH.md §10-§11). Returns a (p, p) array in pack order.
    """
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
            r, JP, JQ = _evaluator(engine, Z, y, "linear", jacobian=True)(P_c, Q_c)
            J = _jacobian_rows(structure, JP, JQ)
        _finite({"the Jacobian": J}, P=P_c, Q=Q_c, Z=Z)
        V_U = np.atleast_2d(np.cov(2 * r[:, None] * (J @ U), rowvar=False))
    else:
        size = Z.shape[0] // chunks
        G = []
        for i in range(0, size * chunks, size):
            theta0, grad = _gradient_at(structure, coords, Z, _evaluator(engine, Z[i:i + size], y[i:i + size], activation))
            G.append(grad(theta0))
        V_U = size * np.atleast_2d(np.cov(np.array(G) @ U, rowvar=False))
    A = U @ np.linalg.inv(H_U)
    cov = A @ V_U @ A.T / Z.shape[0]
    return (cov + cov.T) / 2


# ---------------------------------------------------------------------------------------------
# 8. Adapters: the layouts of other code (MATH.md §12)
# ---------------------------------------------------------------------------------------------

def tokens_as_columns(Z_rows):
    """Prompts with tokens as rows, (B, n+1, d+1) (the authors' code, von Oswald et al.), as icl_ref's
    (B, d+1, n+1). The inverse is tokens_as_rows. MATH.md §12."""
    Z_rows = _array("Z_rows", Z_rows, 3)
    return _prompts(Z_rows.transpose(0, 2, 1), name="Z_rows (transposed)").copy()


def tokens_as_rows(Z):
    """icl_ref's prompts (B, d+1, n+1) with tokens as rows, (B, n+1, d+1). MATH.md §12."""
    return _prompts(Z).transpose(0, 2, 1).copy()


def params_from_authors(allparam):
    """The authors' `allparam` (L, H, 2, d, d) (P block at [..., 0, :, :], Q block at [..., 1, :, :])
    as icl_ref's (P, Q), each (L, H, d+1, d+1).

    Their layer is Z_rows + (Z_rows Q_full Z_rows^T) M (Z_rows P_full^T) / N with
    P_full = [[P_blk, 0], [0, 1]] and Q_full = [[Q_blk, 0], [0, 0]]; in columns that is
    P_full Z M Z^T Q_full^T Z / N, so P = P_full and Q = Q_full^T (MATH.md §12).
    """
    allparam = _array("allparam", allparam, 5)
    L, H, two, d, d2 = allparam.shape
    if two != 2 or d != d2 or L < 1 or H < 1 or d < 1:
        raise ValueError(f"allparam must have shape (L, H, 2, d, d), got {allparam.shape}")
    P, Q = np.zeros((2, L, H, d + 1, d + 1))
    P[:, :, :d, :d] = allparam[:, :, 0]
    P[:, :, d, d] = 1.0
    Q[:, :, :d, :d] = allparam[:, :, 1].transpose(0, 1, 3, 2)
    return P, Q


def params_to_authors(P, Q):
    """Inverse of params_from_authors: (P, Q) -> allparam (L, H, 2, d, d). Only (P, Q) of the
    authors' form can be mapped: P's last row and column e_{d+1}, Q's last row and column 0.
    MATH.md §12."""
    P, Q = _params(P, Q)
    d = P.shape[-1] - 1
    e = np.zeros(d + 1)
    e[d] = 1.0
    if (np.any(P[..., d, :] != e) or np.any(P[..., :, d] != e) or np.any(Q[..., d, :])
            or np.any(Q[..., :, d])):
        raise ValueError("P, Q must have the authors' form: P's last row and column e_{d+1}, "
                         "Q's last row and column zero")
    return np.stack([P[..., :d, :d], Q[..., :d, :d].swapaxes(-1, -2)], axis=2)


def grads_to_authors(dP, dQ):
    """The gradient with respect to the authors' allparam, from icl_ref's (dP, dQ):
    chain rule through params_from_authors (the Q block enters transposed). MATH.md §12."""
    dP, dQ = _params(dP, dQ, ("dP", "dQ"))
    d = dP.shape[-1] - 1
    return np.stack([dP[..., :d, :d], dQ[..., :d, :d].swapaxes(-1, -2)], axis=2)


VON_OSWALD_LOSS_SCALE = 0.5
"""von Oswald et al. (2023) report 0.5 * mean squared error: multiply icl_ref's loss and gradient by it."""


def _von_oswald_heads(W_q, W_k, W_v, W_o, heads, activation, layers=None):
    """The four projections split into heads, (L, H, D, k), (L, H, D, k), (L, H, D, v), (L, H, v, D),
    2-d (tied) weights repeated `layers` times, and the score scale s: 1, or 1 / sqrt(key size) for
    their softmax. Heads are column blocks of W_q, W_k, W_v and row blocks of W_o."""
    heads = _int("heads", heads, 1)
    W = [_array(name, w, (2, 3)) for name, w in (("W_q", W_q), ("W_k", W_k), ("W_v", W_v), ("W_o", W_o))]
    if len({w.ndim for w in W}) != 1:
        raise ValueError("W_q, W_k, W_v, W_o must all be per layer (3-d) or all shared (2-d)")
    W = [w if w.ndim == 3 else w[None] for w in W]
    (L, D, Hk), (_, _, Hv) = W[0].shape, W[2].shape
    expected = [(L, D, Hk), (L, D, Hk), (L, D, Hv), (L, Hv, D)]
    for name, w, e in zip(("W_q", "W_k", "W_v", "W_o"), W, expected):
        if w.shape != e:
            raise ValueError(f"{name} must have shape {e[1:] if np.ndim(W_q) == 2 else e} to match W_q and W_v, "
                             f"got {w.shape}")
    if Hk % heads or Hv % heads or D < 2:
        raise ValueError(f"the key and value widths ({Hk}, {Hv}) must be multiples of heads = {heads}, and d+1 >= 2")
    if np.ndim(W_q) == 2:
        W = [np.repeat(w, _int("layers", layers, 1), axis=0) for w in W]
    elif layers is not None and _int("layers", layers, 1) != L:
        raise ValueError(f"layers = {layers} but the weights have {L} layers")
    Wq, Wk, Wv, Wo = (np.stack(np.split(w, heads, axis=2 if i < 3 else 1), axis=1) for i, w in enumerate(W))
    return Wq, Wk, Wv, Wo, 1.0 if activation == "linear" else 1.0 / math.sqrt(Wq.shape[-1])


@_numpy_rules
def params_from_von_oswald(W_q, W_k, W_v, W_o, n, heads=1, layers=None, activation="linear"):
    """von Oswald et al.'s projections as icl_ref's (P, Q), each (L, H, d+1, d+1) (MATH.md §12).

    Their layer, tokens as rows e (n+1, D): per head h, q = e W_q,h, k = e W_k,h, v = e W_v,h,
    out = concat_h(A_h v) W_o with A_h = q k^T over the context keys only (no 1/n; for "softmax"
    A_h = softmax(q k^T / sqrt(key size)) over the context keys), e <- e + out. Heads are column
    blocks of W_q, W_k, W_v and row blocks of W_o. In columns this is icl_ref's layer with

        P_h = n W_o,h^T W_v,h^T,   Q_h = W_k,h W_q,h^T  (/ sqrt(key size) for softmax).

    W_q, W_k: (L, D, H k) or (D, H k); W_v: (L, D, H v) or (D, H v); W_o: (L, H v, D) or (H v, D).
    2-d weights are tied (the same in every layer, their default): give `layers`. n: context size.
    activation "linear" or "softmax" (their softmax normalises over the context keys: icl_ref's
    "softmax"). Returns P, Q.
    """
    n = _int("n", n, 1)
    if activation not in ("linear", "softmax"):
        raise ValueError(f"activation must be 'linear' or 'softmax' for von Oswald et al.'s model, got {activation!r}")
    Wq, Wk, Wv, Wo, s = _von_oswald_heads(W_q, W_k, W_v, W_o, heads, activation, layers)
    P = n * np.swapaxes(Wv @ Wo, -1, -2)                        # n (W_v,h W_o,h)^T = n W_o,h^T W_v,h^T
    Q = s * Wk @ np.swapaxes(Wq, -1, -2)                        # W_k,h W_q,h^T
    return P, Q


@_numpy_rules
def grads_to_von_oswald(dP, dQ, W_q, W_k, W_v, W_o, n, heads=1, activation="linear"):
    """The gradient of von Oswald et al.'s loss (VON_OSWALD_LOSS_SCALE times icl_ref's) with respect to
    W_q, W_k, W_v, W_o, from icl_ref's (dP, dQ): the chain rule through params_from_von_oswald
    (MATH.md §12). With P_h = n (W_v,h W_o,h)^T and Q_h = s W_k,h W_q,h^T:
    dW_v,h = n dP_h^T W_o,h^T, dW_o,h = n W_v,h^T dP_h^T, dW_k,h = s dQ_h W_q,h, dW_q,h = s dQ_h^T W_k,h;
    tied (2-d) weights get the sum over layers. Returns (dW_q, dW_k, dW_v, dW_o) shaped like the weights.
    """
    n = _int("n", n, 1)
    dP, dQ = _params(dP, dQ, ("dP", "dQ"))
    tied = np.ndim(W_q) == 2
    Wq, Wk, Wv, Wo, s = _von_oswald_heads(W_q, W_k, W_v, W_o, heads, activation, dP.shape[0] if tied else None)
    if dP.shape[:3] != Wq.shape[:3]:
        raise ValueError(f"dP, dQ must have shape (L, heads, D, D) = ({Wq.shape[0]}, {Wq.shape[1]}, {Wq.shape[2]}, "
                         f"{Wq.shape[2]}) to match the weights, got {dP.shape}")
    dPt, c = np.swapaxes(dP, -1, -2), VON_OSWALD_LOSS_SCALE
    grads = [c * s * np.swapaxes(dQ, -1, -2) @ Wk, c * s * dQ @ Wq,      # dW_q,h, dW_k,h
             c * n * dPt @ np.swapaxes(Wo, -1, -2), c * n * np.swapaxes(Wv, -1, -2) @ dPt]
    out = [np.concatenate(list(np.moveaxis(g, 1, 0)), axis=2 if i < 3 else 1) for i, g in enumerate(grads)]
    return tuple(o.sum(axis=0) if tied else o for o in out)


# ---------------------------------------------------------------------------------------------
# 8b. Beyond the paper: looped models and gradient flow (MATH.md §14)
# ---------------------------------------------------------------------------------------------

@_numpy_rules
def optimal_tied_family(L, n, d, blocks=False, noise_var=0.0, starts=8, rng=None):
    """Best looped member of the families of Theorems 3 and 4: A_l = a Sigma^-1 for every l (and
    B_l = b I with blocks), one (a, b) applied L times, by multi-start L-BFGS-B on the exact
    Gauss rule (as optimal_family_scalars) with the layers' gradient summed (MATH.md §14).
    Noiseless sparse: the loss is strictly convex in a, so its minimiser is unique. Starts
    a ~ U(0, 2), b ~ U(0, 1.5) from rng (default seed 0). Returns (a, b or None, loss): floats,
    b NaN when L = 1 (B_0 never enters), loss = family_population_loss at (a 1_L, b 1_L).
    """
    best, (L, n, d, noise_var) = _family_search(L, n, d, blocks, noise_var, starts, rng, tied=True)
    a = float(best.x[0])
    b = (float(best.x[1]) if L > 1 else math.nan) if blocks else None
    loss = family_population_loss(np.full(L, a), n, d, None if b is None else np.full(L, b), noise_var=noise_var)
    return a, b, loss


def _one_layer_field(u, U, Sigma, K, E_hw):
    """(L - L(0), dL/du, dL/dU) of the layer P = u e_d e_d^T, Q = -[[U, 0], [0, 0]] through
    Gamma = u U: grad_Gamma = 2 (K Gamma Sigma - E[h w^T] Sigma) (MATH.md §8, §14)."""
    Gamma = u * U
    G = 2 * (K @ Gamma @ Sigma - E_hw @ Sigma)
    excess = np.trace(Sigma @ Gamma.T @ K @ Gamma) - 2 * np.trace(Sigma @ Gamma.T @ E_hw)
    return excess, float(np.sum(G * U)), u * G


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
    the chain rule of single_layer_population_loss through Gamma = u U (MATH.md §14).
    u: float; U: (d, d); Sigma, Sigma_w: (d, d) SPD. Returns (loss, du (float), dU (d, d)); the
    gradient of full_layer_population_loss in every other entry of (P, Q) is 0 there (MATH.md §14).
    """
    u = float(_array("u", u, 0))
    Sigma, Sigma_w, K, E_hw = _noiseless_moments(Sigma, n, Sigma_w)
    U = _array("U", U, 2)
    if U.shape != Sigma.shape:
        raise ValueError(f"U must have shape {Sigma.shape} to match Sigma, got {U.shape}")
    excess, du, dU = _one_layer_field(u, U, Sigma, K, E_hw)
    return float(excess + np.trace(Sigma @ Sigma_w)), du, dU


@_numpy_rules
def one_layer_gradient_flow(Sigma, n, sigma, t, Theta=None, Sigma_w=None, rtol=1e-12):
    """Gradient flow d(u, U)/dt = -grad L of the exact one-layer population loss (icl_ref's loss, a
    mean without 1/2) from Zhang, Frei and Bartlett's initialisation (MATH.md §14):

        u(0) = sigma,  U(0) = sigma Theta Theta^T / |Theta Theta^T|_F,

    i.e. P(0) = sigma e_d e_d^T, Q(0) = -sigma [[Theta Theta^T, 0], [0, 0]] (their W^PV, W^KQ with
    |Theta Theta^T|_F = 1; the flow keeps every other entry of (P, Q) at 0). Integrated by
    scipy.integrate.solve_ivp (DOP853, rtol, atol = rtol * 1e-3 of the state's scale) on the
    gradient of one_layer_population_grad.
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
    M = Theta @ Theta.T
    y0 = sigma * np.r_[1.0, (M / np.linalg.norm(M)).ravel()]

    def field(_, y):
        _, du, dU = _one_layer_field(y[0], y[1:].reshape(d, d), Sigma, K, E_hw)
        return -np.r_[du, dU.ravel()]
    ys = y0[:, None]
    if t[-1] > 0:
        sol = scipy.integrate.solve_ivp(field, (0.0, t[-1]), y0, method="DOP853", t_eval=t, rtol=rtol,
                                        atol=rtol * 1e-3 * sigma)
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


# ---------------------------------------------------------------------------------------------
# 8c. Estimators, task pools and shift (MATH.md §15)
#
# What a trained layer is compared with: estimators that read a prompt's context (X, y) and its
# query x_q from the paper's layout Z and predict y_hat = <w_hat, x_q>; their risks, exact where a
# closed form exists and by Monte Carlo where not; the exact loss of one layer away from the
# distribution it was trained on.
# ---------------------------------------------------------------------------------------------

def _regression(Z):
    """(X (B, n, d), y (B, n), x_q (B, d)) of prompts Z (B, d+1, n+1): the context and the query."""
    d, n = Z.shape[1] - 1, Z.shape[2] - 1
    return np.swapaxes(Z[:, :d, :n], 1, 2), Z[:, d, :n], Z[:, :d, n]


@_numpy_rules
def ridge_predict(Z, lam=0.0, Sigma_w=None):
    """Ridge regression on each prompt's context, evaluated at its query (MATH.md §15):

        w_hat = argmin_w |y - X w|^2 + lam w^T Sigma_w^-1 w,   y_hat = <w_hat, x_q>,

    computed as w = F v, v = V diag(s / (s^2 + lam)) U^T y from the SVD U diag(s) V^T of X F
    (F the Cholesky factor of Sigma_w, the identity by default). lam = 0 is least squares: OLS for
    n >= d, the minimum-norm interpolant (in the metric Sigma_w^-1) for n < d; singular values
    below max(n, d) eps s_max then count as zero, as in numpy's pinv. lam = noise_var is
    bayes_predict. Z: (B, d+1, n+1); lam >= 0; Sigma_w (d, d) SPD or None. Returns y_hat (B,).
    """
    Z = _prompts(Z)
    lam = _nonneg("lam", lam)
    F = _task_covariance(Sigma_w, Z.shape[1] - 1)[1]
    X, y, x_q = _regression(Z)
    U, s, Vt = np.linalg.svd(X @ F, full_matrices=False)
    keep = s > (max(X.shape[1:]) * np.finfo(float).eps * s[:, :1] if lam == 0 else 0.0)
    # 1/s itself at lam = 0: s^2 underflows to 0 for prompts of scale below 1e-154
    shrink = np.divide(*((1.0, s) if lam == 0 else (s, s ** 2 + lam)), out=np.zeros_like(s), where=keep)
    v = np.einsum("bkd,bk->bd", Vt, shrink * np.einsum("bnk,bn->bk", U, y))
    return np.einsum("bd,bd->b", v @ F.T, x_q)


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

        y_hat = sum_k pi_k <w_k, x_q>,   pi_k proportional to exp(-|y - X w_k|^2 / (2 noise_var)),

    the log-weights (2 <X^T y, w_k> - w_k^T X^T X w_k) / (2 noise_var) (|y|^2 is common to every
    k and cancels) normalised by log-sum-exp: the largest weight is exp(0) = 1, so the sum neither
    overflows nor underflows to 0, however small noise_var (while the log-weights are finite).
    Z: (B, d+1, n+1); tasks: (K, d); noise_var > 0. Returns y_hat (B,).
    """
    Z = _prompts(Z)
    tasks = _pool(tasks, Z.shape[1] - 1)
    if _nonneg("noise_var", noise_var) == 0:
        raise ValueError("noise_var must be > 0: without noise the posterior over the pool is not a density")
    X, y, x_q = _regression(Z)
    K, d = tasks.shape
    y_hat = np.empty(Z.shape[0])
    step = max(1, 2 ** 22 // (K * d))                      # (step, K, d) temporaries of at most 32 MB
    for b in range(0, Z.shape[0], step):
        Xc, yc = X[b:b + step], y[b:b + step]
        quad = np.einsum("bkd,kd->bk", tasks @ (np.swapaxes(Xc, 1, 2) @ Xc), tasks)
        log_pi = (2 * np.einsum("bnd,bn->bd", Xc, yc) @ tasks.T - quad) / (2 * noise_var)
        pi = np.exp(log_pi - np.max(log_pi, axis=1, keepdims=True))
        y_hat[b:b + step] = np.sum(pi * (x_q[b:b + step] @ tasks.T), axis=1) / np.sum(pi, axis=1)
    return y_hat


def _isotropic(S):
    """The c of S = c I, or None when S is not a multiple of the identity (to 1e-12 of its scale)."""
    c = np.trace(S) / S.shape[0]
    return c if np.max(np.abs(S - c * np.eye(S.shape[0]))) <= 1e-12 * abs(c) else None


@_numpy_rules
def ols_population_risk(n, Sigma, Sigma_w=None, noise_var=0.0, query_noise=True):
    """Exact E (y_hat - y_q)^2 of least squares, ridge_predict(Z, 0), where it has a closed form
    (MATH.md §15), for x ~ N(0, Sigma), w_star ~ N(0, Sigma_w), label noise of variance noise_var:

        n >= d:  noise_var d / (n - d - 1)                        (n > d + 1 when noise_var > 0)
        n <  d:  c s (d - n) + noise_var n / (d - n - 1)          (Sigma = c I, Sigma_w = s I;
                                                                    n < d - 1 when noise_var > 0)

    plus noise_var when query_noise. Elsewhere the risk is infinite (n in d-1..d+1 with noise) or
    has no closed form (n < d, anisotropic): a ValueError points to monte_carlo_risk.
    Returns a float.
    """
    n = _int("n", n, 1)
    Sigma = _spd("Sigma", Sigma)[0]
    d = Sigma.shape[0]
    Sigma_w = _task_covariance(Sigma_w, d)[0]
    noise_var = _nonneg("noise_var", noise_var)
    if noise_var > 0 and d - 1 <= n <= d + 1:
        raise ValueError(f"n must be < d - 1 or > d + 1 when noise_var > 0: the risk of least squares is "
                         f"infinite at n = {n}, d = {d}")
    query = noise_var if query_noise else 0.0
    if n >= d:
        return float(noise_var * d / (n - d - 1) if noise_var > 0 else 0.0) + query
    c, s = _isotropic(Sigma), _isotropic(Sigma_w)
    if c is None or s is None:
        raise ValueError("Sigma and Sigma_w must be multiples of the identity for n < d: the risk of the "
                         "minimum-norm interpolant has no closed form otherwise; use monte_carlo_risk")
    return float(c * s * (d - n) + (noise_var * n / (d - n - 1) if noise_var > 0 else 0.0)) + query


@_numpy_rules
def monte_carlo_risk(predict, rng, batch, n, Sigma, Sigma_w=None, noise_var=0.0, tasks=None):
    """E (predict(Z) - y_q)^2 by Monte Carlo over prompts from sample_prompts (query noise included),
    with its standard error std / sqrt(batch) (MATH.md §15). predict: a function of Z (b, d+1, n+1)
    returning (b,), called on chunks of at most 4096 prompts. batch >= 2; the other arguments as
    sample_prompts (noise_var = noise_std^2). Returns (risk, standard error).
    """
    if not callable(predict):
        raise TypeError(f"predict must be a function of Z, got {type(predict).__name__}")
    _rng(rng)
    batch = _int("batch", batch, 2)
    noise_std = math.sqrt(_nonneg("noise_var", noise_var))
    errors = []
    for b in range(0, batch, 4096):
        Z, y = sample_prompts(rng, min(4096, batch - b), n, Sigma, Sigma_w, noise_std, tasks=tasks)
        y_hat = _array("predict(Z)", predict(Z), 1)
        if y_hat.shape != y.shape:
            raise ValueError(f"predict(Z) must have shape {y.shape}, got {y_hat.shape}")
        errors.append((y_hat - y) ** 2)
    errors = np.concatenate(errors)
    return float(np.mean(errors)), float(np.std(errors, ddof=1) / math.sqrt(batch))


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

    The layer divides by the prompt's own n (MATH.md §2). At Sigma_query = Sigma and a Gaussian
    w_star it is single_layer_population_loss. Returns a float.
    """
    n = _int("n", n, 1)
    Sigma = _spd("Sigma", Sigma)[0]
    d = Sigma.shape[0]
    M = _task_moment(Sigma_w, tasks, d)
    noise_var = _nonneg("noise_var", noise_var)
    S_q = Sigma if Sigma_query is None else _spd("Sigma_query", Sigma_query, d)[0]
    Gamma = _array("Gamma", Gamma, 2)
    if Gamma.shape != Sigma.shape:
        raise ValueError(f"Gamma must have shape {Sigma.shape} to match Sigma, got {Gamma.shape}")
    K, E_hw = _single_layer_moments(Sigma, n, M, noise_var)
    with np.errstate(over="ignore", invalid="ignore"):
        loss = (np.trace(S_q @ Gamma.T @ K @ Gamma) - 2 * np.trace(S_q @ Gamma.T @ E_hw)
                + np.trace(S_q @ M) + (noise_var if query_noise else 0.0))
    _finite({"the loss": loss}, Gamma=Gamma, Sigma=Sigma)
    return float(loss)


# ---------------------------------------------------------------------------------------------
# 9. Conformance: reference vectors and a diagnosis of mismatches (MATH.md §13)
# ---------------------------------------------------------------------------------------------

import hashlib
import stat
import textwrap

__version__ = "0.3.0"         # pyproject.toml's, icl_fast's and CITATION.cff's too; in the vectors' manifest
VECTORS_FORMAT = 1
VECTOR_TOLERANCES = {
    "float64": "relative to the largest entry of each array: 1e-12 for Z_L, y_hat and loss (rounding of a few "
               "hundred operations); 1e-10 for gradients (rounding grows with depth: 3e-13 seen at L = 8)",
    "float32": "forward 1e-5, loss 1e-4, gradients 1e-4 (5x the worst float32 error measured over d <= 20, "
               "n <= 200, L <= 4; larger parameters or deeper models need their own measurement)",
}


def reference_cases():
    """The inputs of the reference vectors: a list of dicts (name, description, activation, structure,
    Z, y, P, Q, and the covariances Sigma, Sigma_w its prompts were drawn with), deterministic (fixed
    seeds), built once per process; fresh copies on every call. MATH.md §13."""
    return [{k: v.copy() if isinstance(v, np.ndarray) else v for k, v in c.items()} for c in _reference_cases()]


@functools.lru_cache(maxsize=1)
def _reference_cases():
    """reference_cases, built once (the family optimum takes a second)."""
    cases = []

    def add(name, description, seed, d, n, L, H, make, activation="linear", structure="full", Sigma=None,
            Sigma_w=None):
        rng = np.random.default_rng([VECTORS_FORMAT, seed])
        Z, y = sample_prompts(rng, 4, n, np.eye(d) if Sigma is None else Sigma, Sigma_w)
        P, Q = make(rng, d, L, H)
        cases.append(dict(name=name, description=description, activation=activation, structure=structure,
                          Z=Z, y=y, P=np.asarray(P, float), Q=np.asarray(Q, float),
                          Sigma=np.eye(d) if Sigma is None else Sigma, Sigma_w=np.eye(d) if Sigma_w is None else Sigma_w))

    def full(scale):
        return lambda rng, d, L, H: scale * rng.standard_normal((2, L, H, d + 1, d + 1))
    rng0 = np.random.default_rng([VECTORS_FORMAT, 99])
    Sigma, _ = rotated_covariance(rng0, [1.0, 0.25, 2.0])
    Si = np.linalg.inv(Sigma)
    a_star = optimal_family_scalars(3, 10, 3)[0]
    add("small-full", "d = 2, n = 3, one layer, random non-symmetric P and Q", 1, 2, 3, 1, 1, full(0.5))
    add("two-layers-two-heads", "d = 3, n = 5, L = 2, H = 2, random P and Q", 2, 3, 5, 2, 2, full(0.3))
    add("theorem1-optimum", "Theorem 1's optimum Gamma* (sparse, one layer) for a non-isotropic Sigma, "
        "w* ~ N(0, I)", 3, 3, 6, 1, 1, lambda rng, d, L, H: sparse_params(gamma_star(Sigma, 6)[None]),
        structure="sparse", Sigma=Sigma)
    add("sparse-family-optimum", "Theorem 3: A_l = a*_l Sigma^-1 with the exact sparse-family optimum a* "
        "(L = 3, n = 10), w* ~ N(0, Sigma^-1)", 4, 3, 10, 3, 1,
        lambda rng, d, L, H: sparse_params(a_star[:, None, None] * Si), structure="sparse", Sigma=Sigma,
        Sigma_w=Si)
    add("blocks", "structure (11): random A_l and B_l, L = 2", 5, 3, 6, 2, 1,
        lambda rng, d, L, H: block_params(*(0.4 * rng.standard_normal((2, L, d, d)))), structure="blocks")
    add("non-symmetric-sparse", "structure (8) with non-symmetric A_l: Lemma 1 needs A_l^T here", 6, 2, 4, 2, 1,
        lambda rng, d, L, H: sparse_params(np.array([[[0.2, 0.9], [-0.3, 0.5]], [[0.6, -0.4], [0.1, 0.3]]])),
        structure="sparse")
    add("query-as-key", "a query far from the context: using the query as a key or value changes the answer "
        "by O(1)", 7, 2, 3, 1, 1, full(0.5))
    cases[-1]["Z"][:, :2, -1] *= 5.0
    add("large-d", "d = 12, n = 8: a larger token dimension, two layers", 8, 12, 8, 2, 1, full(0.1))
    add("relu", "[A] section 6 attention with relu, d = 2, n = 4, H = 2", 9, 2, 4, 1, 2, full(0.5), activation="relu")
    add("softmax", "softmax over the n context keys (von Oswald et al.'s), d = 2, n = 4, H = 2", 10, 2, 4, 1, 2,
        full(0.5), activation="softmax")
    add("softmax_all", "the authors' softmax: all n+1 keys, then the mask drops the query's value", 11, 2, 4, 1,
        2, full(0.5), activation="softmax_all")
    add("authors-softmax", "the authors' softmax with their block form (11): d = 2, n = 4", 12, 2, 4, 1, 1,
        lambda rng, d, L, H: block_params(*(0.5 * rng.standard_normal((2, L, d, d)))), activation="softmax_all",
        structure="blocks")
    for c in cases:             # shared by every check in the process: no caller may change them
        for v in c.values():
            if isinstance(v, np.ndarray):
                v.setflags(write=False)
    return tuple(cases)


def _case_outputs(P, Q, Z, y, activation):
    """Z_L, y_hat, loss, dP, dQ of icl_ref's conventions for one case."""
    if activation == "linear":
        loss, dP, dQ = loss_and_grad(P, Q, Z, y)
        Z_L = forward(P, Q, Z)
    else:
        loss, dP, dQ = loss_and_grad_activation(P, Q, Z, y, activation)
        Z_L = forward_activation(P, Q, Z, activation)
    return dict(Z_L=Z_L, y_hat=-Z_L[:, -1, -1], loss=np.array(loss), dP=dP, dQ=dQ)


def _npz_bytes(arrays):
    """The bytes of np.savez(arrays) with fixed zip timestamps: the same arrays give the same bytes."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as zf:
        for name, a in arrays.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.array(a, order="C"), allow_pickle=False)   # keeps 0-d
            zf.writestr(zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0)), buf.getvalue())
    return out.getvalue()


_ROWS_INPUTS = {"Z_rows": "(B, n+1, d+1): the prompts with tokens as rows, row n the query [x_q, 0]",
                "y": "(B,): the query labels"}
LAYOUTS = {
    "paper": (
        {"Z": "(B, d+1, n+1): tokens as columns, column i < n is [x_i; y_i], column n the query [x_q; 0]",
         "y": "(B,): the query labels", "P": "(L, H, d+1, d+1): P of eq. (3) per layer and head",
         "Q": "(L, H, d+1, d+1): Q of eq. (3), scores z_i^T Q_h z_j (the paper's W_k^T W_q; von Oswald et "
              "al.'s weights give Q_h = W_k,h W_q,h^T, their queries and keys being rows)"},
        {"Z_L": "(B, d+1, n+1): after L layers Z <- Z + (1/n) sum_h P_h Z M sigma(Z^T Q_h Z) (MATH.md §2)",
         "y_hat": "(B,): -Z_L[:, d, n]", "loss": "0-d: mean (y_hat - y)^2, no factor 1/2",
         "dP": "d loss / d P, shaped as P", "dQ": "d loss / d Q, shaped as Q"},
        ("linear", "relu", "softmax", "softmax_all"),
        "scores z_i^T Q_h z_j, unscaled; softmax normalises over the n context keys, softmax_all over all "
        "n+1 (the authors' code) before M drops the query's value"),
    "authors": (
        dict(_ROWS_INPUTS, allparam="(L, H, 2, d, d): [:, :, 0] is P's top-left block, [:, :, 1] is Q_code, "
                                    "the transpose of Q's (their layer: Z_rows Q_code Z_rows^T)"),
        {"Z_L_rows": "(B, n+1, d+1): Z_L with tokens as rows", "y_hat": "(B,): -Z_L_rows[:, n, d]",
         "loss": "0-d: mean (y_hat - y)^2, no factor 1/2", "grad_allparam": "d loss / d allparam"},
        ("linear", "softmax_all"),
        "no key size: one d x d block per head and layer, scores unscaled, 1/N with N = n context examples; "
        "softmax_all normalises over all N+1 keys before M drops the query's value"),
    "von_oswald": (
        dict(_ROWS_INPUTS, W_q="(L, d+1, H k): queries, head h in columns h k..(h+1) k - 1",
             W_k="(L, d+1, H k): keys", W_v="(L, d+1, H v): values",
             W_o="(L, H v, d+1): output projection, head h in rows h v..(h+1) v - 1"),
        {"Z_L_rows": "(B, n+1, d+1): after L layers e <- e + concat_h(A_h e W_v,h) W_o, A_h over the n "
                     "context rows only, no 1/n", "y_hat": "(B,): -Z_L_rows[:, n, d]",
         "loss": "0-d: THEIR loss 0.5 * mean (y_hat - y)^2 (VON_OSWALD_LOSS_SCALE)",
         **{f"grad_{w}": f"d (their loss) / d {w}, shaped as {w}" for w in ("W_q", "W_k", "W_v", "W_o")}},
        ("linear", "softmax"),
        "key size k = value size v = d+1 per head in these cases; linear A_h = q k^T unscaled (q = e W_q,h, "
        "k = e W_k,h), softmax A_h = softmax(q k^T / sqrt(k)) over the n context keys"),
}
"""Per layout: (inputs {name: shape and meaning}, outputs {name: definition}, the activations its
reference cases use, the attention's scores and key size). check_implementation hands fn the inputs
and compares the outputs (MATH.md §12-§13)."""
ARRAY_MEANINGS = {k: f"{layout} layout: {v}" for layout, (inputs, outputs, _, _) in reversed(LAYOUTS.items())
                  for k, v in {**inputs, **outputs}.items()}
"""The meaning of each array in the reference vectors (manifest.json): its entry in LAYOUTS, the paper's
where layouts share a name (the vectors hold the paper's loss)."""


def _layouts_text():
    """LAYOUTS as the text help(check_implementation) ends with."""
    def item(indent, text):
        return textwrap.fill(text, 108, initial_indent=" " * indent, subsequent_indent=" " * (indent + 4))
    lines = []
    for layout, (inputs, outputs, activations, scores) in LAYOUTS.items():
        lines += [item(6, f"{layout!r}: activations {', '.join(activations)}; {scores}."), "        inputs:"]
        lines += [item(10, f"{k}: {v}") for k, v in inputs.items()] + ["        outputs:"]
        lines += [item(10, f"{k}: {v}") for k, v in outputs.items()]
    return "\n".join(lines)


def _case_layouts(case):
    """The layouts a reference case can be given in: the paper's always; the authors' when the
    attention is linear or theirs (softmax_all) and P, Q have their form; von Oswald et al.'s for
    linear and softmax."""
    layouts = ["paper"]
    if case["activation"] in ("linear", "softmax_all"):
        try:
            params_to_authors(case["P"], case["Q"])
            layouts.append("authors")
        except ValueError:
            pass
    if case["activation"] in ("linear", "softmax"):
        layouts.append("von_oswald")
    return layouts


def _case_von_oswald_weights(case):
    """von Oswald et al.'s weights for a case, key size D: W_q,h = I, W_k,h = Q_h (times sqrt(D) for
    softmax), W_v,h = P_h^T / n, W_o,h = I, which params_from_von_oswald maps back to (P, Q)."""
    P, Q, act = case["P"], case["Q"], case["activation"]
    L, H, D, _ = P.shape
    n = case["Z"].shape[2] - 1
    eye = np.tile(np.eye(D), (L, 1, H))
    return dict(W_q=eye, W_k=np.concatenate(list(np.moveaxis(Q, 1, 0)), axis=2) * (1.0 if act == "linear" else math.sqrt(D)),
                W_v=np.concatenate(list(np.moveaxis(np.swapaxes(P, -1, -2) / n, 1, 0)), axis=2),
                W_o=np.swapaxes(eye, -1, -2))


def _layout_inputs(case, layout):
    """The case's input arrays in a layout (LAYOUTS)."""
    if layout == "paper":
        return dict(Z=case["Z"], y=case["y"], P=case["P"], Q=case["Q"])
    out = dict(Z_rows=tokens_as_rows(case["Z"]), y=case["y"])
    if layout == "authors":
        return dict(out, allparam=params_to_authors(case["P"], case["Q"]))
    return dict(out, **_case_von_oswald_weights(case))


def _layout_outputs(case, layout, out):
    """icl_ref's outputs in the paper's layout (any subset of Z_L, y_hat, loss, dP, dQ) as the
    layout's outputs (LAYOUTS)."""
    if layout == "paper":
        return dict(out)
    res = {k: v for k, v in (("Z_L_rows", out.get("Z_L")), ("y_hat", out.get("y_hat"))) if v is not None}
    if "Z_L_rows" in res:
        res["Z_L_rows"] = np.swapaxes(res["Z_L_rows"], 1, 2)
    scale = 1.0 if layout == "authors" else VON_OSWALD_LOSS_SCALE
    if "loss" in out:
        res["loss"] = scale * np.asarray(out["loss"])
    if "dP" in out and "dQ" in out:
        if layout == "authors":
            res["grad_allparam"] = grads_to_authors(out["dP"], out["dQ"])
        else:
            W = _case_von_oswald_weights(case)
            grads = grads_to_von_oswald(out["dP"], out["dQ"], *W.values(), case["Z"].shape[2] - 1,
                                        heads=case["P"].shape[1], activation=case["activation"])
            res.update({f"grad_{k}": g for k, g in zip(W, grads)})
    return res


@functools.lru_cache(maxsize=None)
def _cases_of(layout):
    """The names of the reference cases a layout can be given (_case_layouts)."""
    return tuple(c["name"] for c in _reference_cases() if layout in _case_layouts(c))


@functools.lru_cache(maxsize=None)
def _expected(name, layout):
    """A case's inputs and icl_ref's outputs in a layout, computed once per process, read-only."""
    case = next(c for c in _reference_cases() if c["name"] == name)
    pair = (_layout_inputs(case, layout), _layout_outputs(case, layout, _case_outputs(
        case["P"], case["Q"], case["Z"], case["y"], case["activation"])))
    for v in (*pair[0].values(), *pair[1].values()):
        v.setflags(write=False)
    return pair


def _earlier_vectors(dfd, present):
    """The files of `present` an earlier write_reference_vectors left unchanged in the directory dfd
    (manifest.json and the files it lists with their SHA-256), or none without a manifest of ours."""
    def read(name):
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dfd)
        with os.fdopen(fd, "rb") as f:
            return f.read()
    try:
        manifest = json.loads(read("manifest.json"))
        if manifest["format"] != "icl_ref reference vectors":
            return set()
        ours = {c["file"] for c in manifest["cases"]
                if c["file"] in present and hashlib.sha256(read(c["file"])).hexdigest() == c["sha256"]}
    except (OSError, ValueError, KeyError, TypeError):
        return set()
    return ours | {"manifest.json"}


def write_reference_vectors(out, overwrite=False):
    """Write the reference vectors into the directory `out` (created if needed): one .npz per case of
    reference_cases (the arrays of ARRAY_MEANINGS that apply: the paper's layout always, the authors'
    when P, Q have their form and the attention is linear or theirs, von Oswald et al.'s for linear
    and softmax attention) and manifest.json (format, icl_ref_version, conventions, shapes, meanings,
    tolerances, each file's SHA-256). The same bytes on every run. A non-empty `out` is refused,
    except with overwrite=True when it holds only files an earlier run wrote and its manifest lists
    unchanged, which are replaced. Never writes through a symbolic link (`out` or a file in it);
    holds an exclusive flock on `out` while it works (another writer is refused). POSIX only.
    Returns the manifest (a dict). MATH.md §13."""
    import fcntl                    # POSIX; imported here so that icl_ref itself imports anywhere
    if not isinstance(out, (str, os.PathLike)) or not str(out):
        raise TypeError(f"out must name a directory, got {out!r}")
    if os.path.islink(out) or (os.path.exists(out) and not os.path.isdir(out)):
        raise ValueError(f"out {str(out)!r} is a symbolic link or not a directory: name a directory itself")
    os.makedirs(out, exist_ok=True)
    dfd = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)   # a link put there since: ELOOP
    try:
        try:
            fcntl.flock(dfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"out {str(out)!r} is locked by another process writing there: try again later") from None
        present = set(os.listdir(dfd))
        links = sorted(f for f in present if stat.S_ISLNK(os.stat(f, dir_fd=dfd, follow_symlinks=False).st_mode))
        if links:
            raise ValueError(f"out {str(out)!r} holds symbolic links ({', '.join(links[:3])}): not writing through them")
        if present and not overwrite:
            raise ValueError(f"out {str(out)!r} is not empty: name a new directory (or pass overwrite=True, "
                             "--overwrite, to replace an earlier set of reference vectors there)")
        foreign = sorted(present - _earlier_vectors(dfd, present))
        if foreign:
            raise ValueError(f"out {str(out)!r} holds files this program did not write or that changed since "
                             f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}): not touching them; "
                             "name a new directory")
        manifest = dict(format="icl_ref reference vectors", format_version=VECTORS_FORMAT, icl_ref_version=__version__,
                        conventions="MATH.md sections 2-3 and 12: layer Z + (1/n) sum_h P_h Z M Z^T Q_h Z with M "
                                    "dropping the query from keys and values; y_hat = -Z_L[d, n]; loss mean (y_hat - y)^2",
                        tolerances=VECTOR_TOLERANCES, cases=[])
        files = {}
        for case in _reference_cases():
            P, Z, layouts = case["P"], case["Z"], _case_layouts(case)
            arrays = dict(_layout_inputs(case, "paper"), **_expected(case["name"], "paper")[1])
            for layout in layouts[1:]:
                arrays.update(_expected(case["name"], layout)[0],
                              **{k: v for k, v in _expected(case["name"], layout)[1].items() if k.startswith("grad_")})
            name = f"{case['name']}.npz"
            files[name] = _npz_bytes(arrays)
            manifest["cases"].append(dict(
                name=case["name"], file=name, sha256=hashlib.sha256(files[name]).hexdigest(),
                description=case["description"], activation=case["activation"], structure=case["structure"],
                layouts=layouts, B=int(Z.shape[0]), d=int(Z.shape[1] - 1), n=int(Z.shape[2] - 1), L=int(P.shape[0]),
                H=int(P.shape[1]), arrays={k: dict(shape=list(np.shape(v)), meaning=ARRAY_MEANINGS[k])
                                           for k, v in arrays.items()}))
        files["manifest.json"] = (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()
        for name, data in files.items():
            if name in present:
                os.unlink(name, dir_fd=dfd)           # ours (checked above); O_EXCL below never follows a link
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=dfd)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
    finally:
        os.close(dfd)                                # releases the lock
    return manifest


def _slip_outputs(case, P=None, Q=None, QT=False, loss=1.0, sign=False, act=None, context=None, rows=False,
                  when=None):
    """Z_L, y_hat, loss, dP, dQ that an implementation with one convention slip computes on a case, or
    None where the slip does not apply (MATH.md §13). The gradients are with respect to P and Q as the
    user's code builds them, so _layout_outputs maps them into any layout. P(n), Q(D): factors on P and
    Q; QT: Q transposed; loss: a factor on the loss; sign: y_hat = +Z_L[d, n]; act: (the case's
    activation, the one used instead); context: "query" (the query a key and value), "drop" (the last
    context example dropped), "mask" (masked with 1/n kept); rows: Z_L with tokens as rows; when: the
    only activation the slip exists for."""
    P0, Q0, Z, y, a = case["P"], case["Q"], case["Z"], case["y"], case["activation"]
    n, D = Z.shape[2] - 1, Z.shape[1]
    if (when and a != when) or (act and a != act[0]) or (context in ("drop", "mask") and n < 2) \
            or (context == "mask" and a == "softmax_all"):    # the authors' softmax still sees the masked key
        return None
    p, q, a = P(n) if P else 1.0, Q(D) if Q else 1.0, act[1] if act else a
    if context == "query":
        # a copy of the query appended as an (n+1)-th context token is a key and a value that evolves
        # exactly as the query does (each column's update depends on itself and the keys); P scaled by
        # (n+1)/n keeps the 1/n; softmax then normalises over all n+1 distinct keys, as either softmax
        # does once the mask is gone
        Z, p, a = np.concatenate([Z, Z[:, :, n:]], axis=2), p * (n + 1) / n, "softmax" if a.startswith("softmax") else a
    elif context:                                         # 1/(n-1) times (n-1)/n is the 1/n kept
        Z, p = np.delete(Z, n - 1, axis=2), p * ((n - 1) / n if context == "mask" else 1.0)
    Qs = q * (np.swapaxes(Q0, -1, -2) if QT else Q0)
    out = _case_outputs(p * P0, Qs, Z, -y if sign else y, a)     # (Z_L[d, n] - y)^2 is the loss at -y
    dQ = loss * q * out["dQ"]
    out.update(loss=loss * out["loss"], dP=loss * p * out["dP"], dQ=np.swapaxes(dQ, -1, -2) if QT else dQ)
    out["y_hat"] = -out["y_hat"] if sign else out["y_hat"]
    if context == "query":
        out["Z_L"] = np.delete(out["Z_L"], n, axis=2)
    elif context == "drop":
        out.pop("Z_L")                                   # a different shape: compare the rest
    elif context == "mask":          # the masked example's own column moves as a query over the other n - 1 would
        own = _case_outputs(p * P0, Qs, case["Z"][:, :, :n], y, a)["Z_L"][:, :, -1:]
        out["Z_L"] = np.concatenate([out["Z_L"][:, :, :n - 1], own, out["Z_L"][:, :, n - 1:]], axis=2)
    return dict(Z_L=np.swapaxes(out["Z_L"], 1, 2)) if rows else out


_SLIPS = dict(QT=dict(QT=True), Pn=dict(P=lambda n: n), Pn1=dict(P=lambda n: n / (n + 1)),
              P_n=dict(P=lambda n: 1 / n), P_n1=dict(P=lambda n: 1 / (n + 1)),
              Qk=dict(Q=math.sqrt, when="softmax"), Q_k=dict(Q=lambda D: 1 / math.sqrt(D), when="linear"),
              half=dict(loss=0.5), double=dict(loss=2.0), sign=dict(sign=True), query=dict(context="query"),
              drop=dict(context="drop"), mask=dict(context="mask"), rows=dict(rows=True),
              all_keys=dict(act=("softmax", "softmax_all")), n_keys=dict(act=("softmax_all", "softmax")))
"""The slips of DIAGNOSIS_VARIANTS as _slip_outputs computes them."""

DIAGNOSIS_VARIANTS = {
    "paper": {
        "Q transposed": ("QT", "your Q is the transpose of the paper's (tokens as rows compute Z^T Q^T Z): transpose "
            "it, or map the authors' layout with params_from_authors"),
        "1/(n+1) normalisation": ("Pn1", "you divide the attention by n + 1 (all tokens); the paper divides by the n "
            "context tokens"),
        "no normalisation": ("Pn", "you do not divide the attention by n (von Oswald et al.'s layout folds n into P: "
            "use params_from_von_oswald)"),
        "query used as a key and value": ("query", "the query token is a key and a value in your attention; the mask "
            "M must drop it (only the n context tokens are keys and values)"),
        "loss with a factor 1/2": ("half", "your loss is 0.5 * mean (von Oswald et al.'s); icl_ref's has no 1/2: "
            "multiply icl_ref's by VON_OSWALD_LOSS_SCALE to compare"),
        "prediction sign flipped": ("sign", "your prediction is +Z_L[d, n]; the paper's is -Z_L[d, n]"),
        "softmax over n+1 keys": ("all_keys", "your softmax normalises over all n+1 keys (the authors' code, "
            "icl_ref's 'softmax_all'); this case normalises over the n context keys ('softmax')"),
        "softmax over n keys": ("n_keys", "your softmax normalises over the n context keys (icl_ref's 'softmax'); "
            "this case normalises over all n+1 keys ('softmax_all', the authors' code)"),
        "last context example dropped": ("drop", "you use only n - 1 context examples (the authors' GD baselines do "
            "this); use all n"),
        "last context example masked, 1/n kept": ("mask", "your mask drops the last context example as well as the "
            "query while you still divide by n: M = diag(1, ..., 1, 0) masks the query only"),
        "tokens as rows (Z_L transposed)": ("rows", "your Z_L has tokens as rows, (B, n+1, d+1); the paper's has "
            "them as columns: compare tokens_as_columns(your Z_L)"),
    },
    "authors": {
        "Q_code used as Q (not transposed)": ("QT", "allparam[l, h, 1] is Q_code and their layer scores Z_rows "
            "Q_code Z_rows^T, i.e. z_i^T Q_code^T z_j: with tokens as columns use Q_code^T (params_from_authors "
            "does)"),
        "1/(N+1) normalisation": ("Pn1", "you divide the attention by N + 1; their layer divides by N, the number of "
            "context examples (Z_rows has N + 1 rows)"),
        "no normalisation": ("Pn", "you do not divide the attention by N (their layer does)"),
        "query used as a key and value": ("query", "the query row N is a key and a value in your attention; their "
            "mask M zeroes its column (only the N context rows are keys)"),
        "loss with a factor 1/2": ("half", "your loss is 0.5 * mean; theirs is mean (y_hat - y)^2, as icl_ref's"),
        "prediction sign flipped": ("sign", "y_hat is -Z_L_rows[:, N, d] (their code returns -output[:, -1, -1])"),
        "last context example dropped": ("drop", "you use N - 1 context examples (as their GD baselines do): the "
            "transformer uses all N"),
        "last context example masked, 1/N kept": ("mask", "your mask drops the last context row as well as the "
            "query: M masks the query only"),
        "Z_L_rows with tokens as columns": ("rows", "return Z_L_rows with tokens as rows, (B, N+1, d+1)"),
        "softmax over the N context keys": ("n_keys", "their softmax normalises over all N+1 keys, the query's "
            "own included, before M drops the query's value"),
    },
    "von_oswald": {
        "W_q and W_k swapped": ("QT", "the scores are q k^T with q = e W_q,h from the querying token and k = e W_k,h "
            "from the keys; yours use them the other way round (Q_h^T)"),
        "an extra 1/n": ("P_n", "their layer does not divide the attention by n (params_from_von_oswald puts n into "
            "P): drop the 1/n"),
        "1/(n+1) normalisation": ("P_n1", "you divide the attention by n + 1; their layer divides by nothing"),
        "loss without their 0.5": ("double", "their loss is 0.5 * mean (y_hat - y)^2 (VON_OSWALD_LOSS_SCALE); yours "
            "is the plain mean, so loss and every grad_W_* are 2x"),
        "loss with 0.5 twice": ("half", "your loss is 0.25 * mean: their 0.5 applied twice"),
        "softmax without 1/sqrt(key size)": ("Qk", "their softmax scores are q k^T / sqrt(k), k the per-head key "
            "size (W_q.shape[-1] / H, d+1 in these cases)"),
        "linear attention divided by sqrt(key size)": ("Q_k", "their linear attention is q k^T, unscaled: the "
            "1/sqrt(k) belongs to softmax only"),
        "softmax over n+1 keys": ("all_keys", "their softmax runs over the n context rows only: mask the query row's "
            "key before normalising"),
        "query used as a key and value": ("query", "only rows 0..n-1 of Z_rows are keys and values; the query row n "
            "attends but is not attended to"),
        "prediction sign flipped": ("sign", "y_hat is -Z_L_rows[:, n, d] (the query row's label entry, negated)"),
        "last context example dropped": ("drop", "you use n - 1 context rows: use all n"),
        "Z_L_rows with tokens as columns": ("rows", "return Z_L_rows with tokens as rows, (B, n+1, d+1)"),
    },
}
"""Per layout, the known convention slips: {name: (slip, advice in the layout's own terms)}, each
computed by _slip_outputs(case, **_SLIPS[slip]) and compared in the layout (MATH.md §13)."""


@functools.lru_cache(maxsize=None)
def _slipped(name, layout):
    """{slip name: its outputs in the layout} on a case, for the slips that apply; once per process."""
    case = next(c for c in _reference_cases() if c["name"] == name)
    out = {v: _slip_outputs(case, **_SLIPS[s]) for v, (s, _) in DIAGNOSIS_VARIANTS[layout].items()}
    return {v: _layout_outputs(case, layout, o) for v, o in out.items() if o is not None}


def _malformed(mine, ref):
    """What is wrong with a given array as such, as (kind, text) with kind "type" (missing, a string,
    not real numbers), "shape" or "value" (NaN or Inf); None when it is a real array of ref's shape."""
    if mine is None:
        return "type", "missing (None)"
    if isinstance(mine, (str, bytes)):
        return "type", f"not a numeric array ({type(mine).__name__}: a string is not a number)"
    try:
        a = np.asarray(mine)
    except (TypeError, ValueError, RuntimeError) as e:      # ragged lists; tensors still needing .detach()
        return "type", f"not a numeric array ({type(mine).__name__}: {e})"
    if a.dtype.kind not in "fiu":
        what = {"c": "complex", "b": "booleans", "U": "strings", "S": "bytes", "O": "Python objects"}.get(a.dtype.kind, "")
        return "type", f"not a numeric array (dtype {a.dtype}{': ' + what if what else ''}; give real numbers)"
    if a.shape != np.shape(ref):
        return "shape", f"shape {a.shape}, expected {np.shape(ref)}"
    if not np.all(np.isfinite(a)):
        return "value", "holds NaN or Inf"
    return None


def _close(mine, ref, rtol):
    """mine within rtol of ref's largest entry, entry by entry, and of ref's shape."""
    mine = np.asarray(mine, dtype=float)
    scale = max(np.max(np.abs(ref)), 1e-300)
    return mine.shape == np.shape(ref) and bool(np.all(np.abs(mine - ref) <= rtol * scale))


def _judge(name, layout, given, rtol, culprits):
    """{output: "agrees" | slip name | "malformed: ..." | "unexplained"} for one case's outputs given in
    `layout`, each compared within rtol[output] of icl_ref's; adds "case:output" to culprits[slip name]
    for the slips that reproduce each mismatch. An array of another shape is malformed unless a slip
    explains it."""
    ref = _expected(name, layout)[1]
    found = {}
    for q, mine in given.items():
        bad = _malformed(mine, ref[q])
        if bad and bad[0] != "shape":
            found[q] = f"malformed: {bad[1]}"
            continue
        if not bad and _close(mine, ref[q], rtol[q]):
            found[q] = "agrees"
            continue
        match = [v for v, out in _slipped(name, layout).items() if q in out and _close(mine, out[q], rtol[q])]
        found[q] = match[0] if match else f"malformed: {bad[1]}" if bad else "unexplained"
        for v in match:
            culprits.setdefault(v, []).append(f"{name}:{q}")
    return found


def _report(found, culprits, layout, skipped=()):
    """The plain-text report of diagnose and check_implementation, its advice in the layout's terms."""
    lines = []
    for name, verdicts in found.items():
        agree = [q for q, f in verdicts.items() if f == "agrees"]
        differ = [f"{q} ({f})" for q, f in verdicts.items() if f != "agrees"]
        lines.append(f"{name}: " + (f"agrees on {', '.join(agree)}" if agree else "agrees on nothing")
                     + (f"; DIFFERS on {', '.join(differ)}" if differ else ""))
    lines += [f"{name}: SKIPPED ({why})" for name, why in skipped]
    if culprits:
        lines += ["", "Likely causes, most frequent first:"]
        for v, where in sorted(culprits.items(), key=lambda kv: -len(kv[1])):
            lines.append(f"- {v} (reproduces {len(where)} mismatches, e.g. {where[0]}): "
                         f"{DIAGNOSIS_VARIANTS[layout][v][1]}")
    verdicts = [(q, f) for fs in found.values() for q, f in fs.items()]
    if any(f.startswith("malformed") for _, f in verdicts):
        lines.append("Some arrays are malformed (see above): fix them before comparing numbers.")
    lost = {q for q, f in verdicts if f == "unexplained"}
    outputs = LAYOUTS[layout][1]
    forward = [q for q in outputs if q.startswith(("Z_L", "y_hat")) and q in lost]
    if forward:
        lines.append(f"{', '.join(forward)} differ(s) in no known way: run the one-layer case small-full and "
                     f"compare {forward[0]}, {outputs[forward[0]]}, token by token.")
    elif "loss" in lost:
        lines.append(f"The forward pass agrees but the loss differs in no known way: here it is {outputs['loss']}.")
    elif lost:
        lines.append(f"The forward pass and the loss agree; {', '.join(sorted(lost))} differ(s) in no known way: "
                     "compare with central differences of your own loss, one array at a time.")
    elif verdicts and all(f == "agrees" for _, f in verdicts):
        lines.append("Everything agrees within rtol.")
    return "\n".join(lines)


def _names(arg, what, allowed):
    """A name or an iterable of names, each among `allowed`, as a non-empty tuple; else an error naming `what`."""
    try:
        names = (arg,) if isinstance(arg, str) else tuple(arg)
    except TypeError:
        raise TypeError(f"{what} must be a name or a list of names, got {type(arg).__name__}") from None
    bad = [x for x in names if not isinstance(x, str) or x not in allowed]
    if bad or not names:
        raise ValueError(f"{what} must name one or more of {', '.join(allowed)}; got {bad or 'none'}")
    return names


def _layout_name(layout):
    """layout, one of LAYOUTS' keys (a string), or an error naming the argument."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise (ValueError if isinstance(layout, str) else TypeError)(
            f"layout must be one of the strings {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    return layout


def diagnose(outputs, rtol=1e-6, layout="paper"):
    """Compare another implementation's outputs on the reference cases with icl_ref, and name the known
    convention slip that reproduces each mismatch (MATH.md §13).

    outputs: {case name: {output: array}} with any of the layout's outputs (LAYOUTS; paper: Z_L, y_hat,
    loss, dP, dQ), computed by the user's code on the inputs of reference_cases() (or the reference
    vectors). rtol: relative to the largest entry of icl_ref's array (1e-6 suits float64 code; float32
    code needs about 1e-4). Empty input (no case, or a case with no array) is a ValueError. An array
    that is missing (None), not real numbers, of the wrong shape or not finite is named as malformed
    before any comparison. Returns (report, found): a plain-text report a person can act on, its
    advice in the layout's terms (DIAGNOSIS_VARIANTS), and {case: {output: "agrees" | slip name |
    "malformed: ..." | "unexplained"}}.
    """
    if not isinstance(outputs, dict):
        raise TypeError(f"outputs must be a dict {{case name: {{output: array}}}}, got {type(outputs).__name__}")
    if not outputs:
        raise ValueError("outputs is empty: give at least one case, {case name: {output: array}}")
    rtol = _nonneg("rtol", rtol)
    layout = _layout_name(layout)
    _names(tuple(outputs), "outputs' cases", _cases_of(layout))
    allowed = LAYOUTS[layout][1]
    for name, given in outputs.items():
        if not isinstance(given, dict) or not set(given) <= set(allowed):
            raise ValueError(f"outputs[{name!r}] must be a dict with keys among {', '.join(allowed)}")
        if not given:
            raise ValueError(f"outputs[{name!r}] holds no arrays: give any of {', '.join(allowed)}")
    found, culprits = {}, {}
    for name, given in outputs.items():
        found[name] = _judge(name, layout, given, dict.fromkeys(given, rtol), culprits)
    return _report(found, culprits, layout), found


CHECK_TOLERANCES = {"float64": dict(forward=1e-12, loss=1e-12, gradient=1e-10),
                    "float32": dict(forward=1e-5, loss=1e-4, gradient=1e-4)}
"""check_implementation's default tolerances, relative to the largest entry of icl_ref's array: those
of VECTOR_TOLERANCES, for the forward pass (Z_L, Z_L_rows, y_hat), the loss and the gradients (dP,
dQ, grad_*)."""


def check_implementation(fn, layout="paper", dtype=np.float64, *, cases=None, outputs=None, skip=(), rtol=None):
    """Run another implementation on the reference cases and compare its outputs with icl_ref's
    (MATH.md §13). `icl_ref.check_implementation(my_fn)` is the whole test, in any test runner.

    fn(inputs) receives one case as a dict: the layout's input arrays (below) as fresh `dtype` copies,
    and activation (str), n, L, H (int). It returns {output: array} with every output of the layout,
    or only those `outputs` names; or it raises NotImplementedError, which fails the check unless
    `skip` names the case (then it is reported as skipped, never as passed).
    layout: "paper", "authors" or "von_oswald" (LAYOUTS). dtype: np.float64 or np.float32 (required).
    cases: a case name or names (default: every case of the layout), e.g. one pytest test per case:
        @pytest.mark.parametrize("case", [c["name"] for c in icl_ref.reference_cases()])
    outputs: the outputs to require and compare (default: all). skip: cases fn may decline.
    rtol: None (CHECK_TOLERANCES[dtype]: Z_L, Z_L_rows, y_hat by "forward", loss by "loss", dP, dQ,
    grad_* by "gradient"), one number for every output, or {output: rtol} overriding those named;
    relative to the largest entry of icl_ref's array.

    Raises TypeError or ValueError naming the argument, or naming the case and output when fn returns
    no dict, misses an output, returns an unknown one, or one that is not a real array (None, a
    string, complex, objects) or of the wrong shape. Raises AssertionError, its message the diagnosis
    in the layout's terms (which outputs agree, which convention slip of DIAGNOSIS_VARIANTS[layout]
    reproduces each mismatch, which arrays hold NaN or Inf), when a case fails or none was checked;
    in pytest the message is shown without icl_ref's frames. Returns the report: layout, dtype,
    icl_ref_version, outputs, rtol {output: rtol}, cases {name: {"status": "passed" | "skipped" |
    "failed", "quantities": {output: verdict}, "reason": ...}} and text. The reference outputs are
    computed once per process; fn receives copies.

    Layouts (LAYOUTS):
    """
    __tracebackhide__ = True                      # pytest: show the diagnosis, not icl_ref's frames
    if not callable(fn):
        raise TypeError(f"fn must be callable, fn(inputs: dict) -> dict of outputs, got {type(fn).__name__}")
    layout = _layout_name(layout)
    try:
        dt = np.dtype(dtype) if dtype is not None else None      # np.dtype(None) would be float64
    except TypeError:
        dt = None
    if dt is None or dt.name not in CHECK_TOLERANCES:
        raise (TypeError if dt is None else ValueError)(f"dtype must be np.float64 or np.float32, got {dtype!r}")
    available = _cases_of(layout)
    names = available if cases is None else _names(cases, "cases", available)
    skip = _names(skip, "skip", available) if skip else ()
    allowed = LAYOUTS[layout][1]
    wanted = tuple(allowed) if outputs is None else _names(outputs, "outputs", tuple(allowed))
    kind = {q: "gradient" if q.startswith(("d", "grad_")) else "loss" if q == "loss" else "forward" for q in wanted}
    tol = {q: CHECK_TOLERANCES[dt.name][kind[q]] for q in wanted}
    if isinstance(rtol, dict):
        tol.update({q: _nonneg(f"rtol[{q!r}]", rtol[q]) for q in _names(tuple(rtol), "rtol's keys", wanted)})
    elif rtol is not None:
        tol = dict.fromkeys(wanted, _nonneg("rtol", rtol))
    report = dict(layout=layout, dtype=dt.name, icl_ref_version=__version__, outputs=wanted, rtol=tol, cases={})
    found, culprits, skipped = {}, {}, []
    for name in names:
        case = next(c for c in _reference_cases() if c["name"] == name)
        inputs = {k: np.array(v, dtype=dt) for k, v in _expected(name, layout)[0].items()}
        L, H = case["P"].shape[:2]
        try:
            given = fn(dict(inputs, activation=case["activation"], n=int(case["Z"].shape[2] - 1), L=int(L), H=int(H)))
        except NotImplementedError as e:
            why = f"NotImplementedError: {e}" if str(e) else "NotImplementedError"
            if name in skip:
                skipped.append((name, why))
            report["cases"][name] = dict(status="skipped" if name in skip else "failed", quantities={},
                                         reason=why if name in skip else f"fn raised {why}; skip= does not name it")
            continue
        if not isinstance(given, dict):
            raise TypeError(f"fn must return a dict {{output: array}}; for case {name!r} it returned {type(given).__name__}")
        missing, unknown = [q for q in wanted if q not in given], [str(q) for q in given if q not in allowed]
        if missing or unknown:
            raise ValueError(f"fn's outputs for case {name!r}: " + "; ".join(
                ([f"missing {', '.join(missing)} (outputs= names the ones to check)"] if missing else [])
                + ([f"unknown {', '.join(unknown)} (the {layout} layout's are {', '.join(allowed)})"] if unknown else [])))
        for q in wanted:
            bad = _malformed(given[q], _expected(name, layout)[1][q])
            if bad and bad[0] == "type":
                raise TypeError(f"fn's output {q!r} for case {name!r} is {bad[1]}")
        found[name] = _judge(name, layout, {q: given[q] for q in wanted}, tol, culprits)
        shapes = [f"{q} has {f[len('malformed: '):]}" for q, f in found[name].items() if f.startswith("malformed: shape")]
        if shapes:
            raise ValueError(f"fn's outputs for case {name!r}: {'; '.join(shapes)} ({layout} layout, LAYOUTS)")
        ok = all(f == "agrees" for f in found[name].values())
        report["cases"][name] = dict(status="passed" if ok else "failed", quantities=found[name])
    text = _report(found, culprits, layout, skipped)
    bad = [(name, c.get("reason")) for name, c in report["cases"].items() if c["status"] == "failed"]
    report["text"] = text + "".join(f"\n{name}: FAILED ({reason})" for name, reason in bad if reason)
    if bad:
        raise AssertionError(f"the implementation differs from icl_ref ({layout} layout, {dt.name}):\n{report['text']}")
    if not any(c["status"] == "passed" for c in report["cases"].values()):
        raise AssertionError(f"no reference case was checked ({layout} layout): fn skipped every case\n{report['text']}")
    return report


check_implementation.__doc__ = check_implementation.__doc__.rstrip(" ") + _layouts_text() + "\n"


def _main(argv=None):
    """python3 -m icl_ref [--version] [vectors --out DIR [--overwrite]] (MATH.md §13)."""
    ap = argparse.ArgumentParser(
        prog="python3 -m icl_ref", description="icl_ref: a NumPy reference for the linear transformer of Ahn et al. "
        "(2023). Derivations: MATH.md (the repository; installed in <prefix>/share/doc/icl_ref).")
    ap.add_argument("--version", action="version", version=f"icl_ref {__version__}")
    sub = ap.add_subparsers(dest="command")
    v = sub.add_parser("vectors", help="write the reference vectors (.npz per case and manifest.json)")
    v.add_argument("--out", required=True, help="directory to write into (created if needed; must be new or empty)")
    v.add_argument("--overwrite", action="store_true",
                   help="replace an earlier set of reference vectors in --out (refused if it holds other files, "
                        "changed files or symbolic links)")
    args = ap.parse_args(argv)
    if args.command is None:
        ap.print_help()
        return 0
    try:
        manifest = write_reference_vectors(args.out, overwrite=args.overwrite)
    except (TypeError, ValueError, OSError) as e:
        ap.error(str(e))
    print(f"wrote {len(manifest['cases'])} cases and manifest.json to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
