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
    S        Gram matrix Z M Z^T, (B, D, D)
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
diagnose). A short section before them runs the batch in chunks on the machine's cores.
Command line: python3 -m icl_ref vectors --out DIR.
"""
import argparse
import contextlib
import io
import itertools
import json
import math
import os
import sys
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from functools import lru_cache

import numpy as np
import scipy
import scipy.linalg
import scipy.optimize
from threadpoolctl import ThreadpoolController

STRUCTURES = ("sparse", "blocks", "full")
PAPER_EIGENVALUES = (1.0, 1.0, 0.25, 0.0625, 1.0)   # spectrum of Sigma in [A] §4.3 (MATH.md §1)


# ---------------------------------------------------------------------------------------------
# Input checks: every public function validates before it computes.
# ---------------------------------------------------------------------------------------------

def _array(name, a, ndim, allow_nan=False, finite=True):
    """a as a float64 array with `ndim` dimensions (an int or a tuple of allowed ones) and, unless
    finite=False (the caller checks them itself, _finite_entries), finite entries (NaN allowed where
    allow_nan), or a TypeError/ValueError naming `name`."""
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
    if finite:
        _finite_entries(name, arr, allow_nan)
    return arr


def _finite_entries(name, arr, allow_nan=False):
    """A ValueError naming `name` if the float64 array arr holds an Inf, or a NaN (unless
    allow_nan). One pass, a sum, when it is clean: NaN and Inf poison the sum."""
    with np.errstate(over="ignore", invalid="ignore"):       # a sum near the float64 limit
        total = np.sum(arr)
    if not np.isfinite(total):
        bad = np.isinf(arr) if allow_nan else ~np.isfinite(arr)
        if np.any(bad):
            raise ValueError(f"{name} must be finite, found {'Inf' if allow_nan else 'NaN or Inf'}")


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


def _finite_result(what, value, **sizes):
    """value, or a ValueError saying that float64 overflowed, and at what size of the inputs."""
    if not np.all(np.isfinite(value)):
        size = ", ".join(f"max |{k}| = {np.max(np.abs(v)):.3g}" for k, v in sizes.items())
        raise ValueError(f"{what} is not finite: float64 overflowed ({size}); the output grows like "
                         "(|P| |Q| |Z|^2)^(2^L) |Z|, so use smaller parameters or rescale Z")
    return value


def _prompts(Z, D=None, name="Z", finite=True):
    """Z as a float64 (B, D, n+1) array with B >= 1, n >= 1 (and D matching the parameters); with
    finite=False the caller checks the entries itself (_finite_entries)."""
    Z = _array(name, Z, 3, finite=finite)
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


def _check_structure(structure):
    if structure not in STRUCTURES:
        raise ValueError(f"structure must be one of {STRUCTURES}, got {structure!r}")


# ---------------------------------------------------------------------------------------------
# Workers: the batch in chunks of prompts on the machine's cores, one BLAS thread each (MATH.md §3, §6)
# ---------------------------------------------------------------------------------------------

@lru_cache(maxsize=1)
def _threadpools():
    """threadpoolctl's view of the BLAS libraries loaded with NumPy and SciPy (made once)."""
    return ThreadpoolController()


@contextlib.contextmanager
def one_blas_thread():
    """Context manager: BLAS limited to one thread inside, the caller's setting restored after.

    Why: icl_ref's hot path is many small GEMMs; a multi-threaded BLAS pool wakes for each and
    its spinning workers take the cores from the chunk workers (and from SciPy's optimisers'
    bookkeeping between evaluations): ~3x slower training on 2 cores, measured (MATH.md §6).
    """
    with _threadpools().limit(limits=1, user_api="blas"):
        yield


# With the prompts on the first axis, each prompt's D x D products (T S, T S T^T, their adjoints)
# are one OpenBLAS call per prompt, and OpenBLAS takes a process-wide mutex to hand out its work
# buffer in every call: for small products two workers spend much of their time on that lock (20000
# products of 6 x 6 matrices: 1.4 ms on one thread, 3.0 ms on two). Where that is most of the work,
# two workers are no faster, so one works and the other core stays free: the kernel formulation's
# loss_and_grad_gram (B = 20000, L = 3) at d = 2 takes 22 ms on one worker and 24-33 ms on two, at
# d = 5 30-32 ms and 29-39 ms; from d = 6 up two win (45 -> 35 ms; d = 10 130 -> 82 ms). The
# Jacobian adds GEMMs and copies that do scale: at d = 5 two workers win (blocks: 62 -> 55 ms), at
# d = 2 one does (33 vs 48 ms). Measured on 2 cores, numpy 1.25 and 2.4 with their OpenBLAS;
# MATH.md §3. (The loss's default for D <= 12 is the lanes formulation, whose products are numpy's
# own loops and run on every core, MATH.md §3.2.) The largest D = d + 1 at which one worker is the
# default for the Gram product, the batch-first loss and the Jacobian:
_SERIAL_MAX_D = 6
_SERIAL_MAX_D_JACOBIAN = 5


def _thread_count(threads, serial=False):
    """Worker threads for one evaluation: `threads` (an integer >= 1) or, by default, the cores this
    process may use, or one where the caller's work is `serial` (small per-prompt products, above).
    Never more than the cores (each worker runs one BLAS thread)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if threads is None:
        return 1 if serial else cores
    return min(_int("threads", threads, 1), cores)


def _chunk(chunk, D):
    """Prompts per chunk: `chunk`, or 2^17 / D^2 so that (chunk, D, D) arrays stay about 1 MB."""
    return max(1, 2 ** 17 // D ** 2) if chunk is None else _int("chunk", chunk, 1)


def _map_chunks(fn, B, chunk, threads, serial=False):
    """[fn(start, stop) for each chunk of the batch], in chunk order, on `threads` workers that
    each run one BLAS thread (never more threads than cores; the default as _thread_count). The
    results come back in chunk order, so sums over them are the same to the last bit whatever the
    thread count. MATH.md §3.

    Each worker claims the next chunk from a shared counter until none is left: one task per
    worker rather than one per chunk, so the caller waits once, not once per chunk, and a worker
    that another thread slows takes fewer chunks (0.6 ms of ~14 at the paper's size, measured).
    An error or a Ctrl-C stops the claiming: the chunks already running finish, no new one starts.
    """
    bounds = [(c, min(c + chunk, B)) for c in range(0, B, chunk)]
    workers = min(_thread_count(threads, serial), len(bounds))
    err = np.geterr()                       # the caller's errstate: worker threads do not inherit it
    with one_blas_thread():
        if workers == 1:
            return [fn(*b) for b in bounds]
        results, claim, stop = [None] * len(bounds), itertools.count(), threading.Event()

        def work(_):
            with np.errstate(**err):
                for i in claim:                        # next() on a count is atomic under the GIL
                    if i >= len(bounds) or stop.is_set():
                        return
                    try:
                        results[i] = fn(*bounds[i])
                    except BaseException:
                        stop.set()
                        raise
        try:
            list(_pool(workers).map(work, range(workers)))
        except BaseException:
            stop.set()
            raise
        return results


_POOLS, _POOLS_LOCK = {}, threading.Lock()


def _pool(workers):
    """The process's pool of `workers` threads, started on first use and kept: starting new
    threads for every evaluation made loss_and_grad 1.1-1.7 ms slower at d = 5 (of ~17 ms). Idle
    threads wait without using a core. On Ctrl-C the caller stops waiting and the chunks already
    running finish in the background (_map_chunks starts no new one). A process that forks after
    such an evaluation has live threads (Python 3.12+ warns at the fork); the child starts its own
    (_forget_pools).

    When the pool has one thread per core this process may use (the default), thread k is bound to
    the k-th of those cores (Linux; os.sched_setaffinity). Why: woken together after the machine
    has idled for 0.1 s or more, two unbound workers were often placed on one core and an
    evaluation took 23-25 ms instead of 14 at d = 5 (2-core VM, measured; with another process
    busy on a core, bound 17.5-18 ms, unbound 18.5-21.7). With fewer workers than cores they stay
    unbound, free to move to an idle core."""
    with _POOLS_LOCK:
        if workers not in _POOLS:
            cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
            bind = None
            if len(cores) == workers and hasattr(os, "sched_setaffinity"):
                next_core = iter(cores).__next__

                def bind():                              # run by each new thread: the next core
                    try:
                        os.sched_setaffinity(0, {next_core()})
                    except OSError:                      # a core this process may no longer use
                        pass                             # binding only helps placement: go unbound
            _POOLS[workers] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="icl_ref",
                                                 initializer=bind)
        return _POOLS[workers]


def _forget_pools():
    """In a forked child: the parent's pools have no threads here, and the lock may have been held
    by another of the parent's threads at the fork, so both start anew."""
    global _POOLS_LOCK
    _POOLS.clear()
    _POOLS_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)


# ---------------------------------------------------------------------------------------------
# 1. Data ([A] §2; MATH.md §1)
# ---------------------------------------------------------------------------------------------

def sample_prompts(rng, batch, n, Sigma, Sigma_w=None, noise_std=0.0, return_w_star=False):
    """Draw B prompts of linear regression, [A] §2 with the data model of [A] Table 1.

    x_i ~ N(0, Sigma) iid for i = 0..n (the last is the query), w_star ~ N(0, Sigma_w) per prompt
    (identity by default), y_i = <w_star, x_i> + noise_std * N(0, 1). Gaussians are drawn through
    the Cholesky factor F of Sigma (x = F g), never `multivariate_normal`.

    Parameters: rng (numpy.random.Generator), batch = B >= 1, n >= 1, Sigma (d, d) SPD,
    Sigma_w (d, d) SPD or None, noise_std >= 0.
    Returns Z (B, d+1, n+1) with the query label slot Z[:, d, n] = 0, and y (B,) the query's label
    (noise included when noise_std > 0); with return_w_star also w_star (B, d).
    MATH.md §1.
    """
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    batch, n = _int("batch", batch, 1), _int("n", n, 1)
    Sigma, F = _spd("Sigma", Sigma)
    d = Sigma.shape[0]
    F_w = np.eye(d) if Sigma_w is None else _spd("Sigma_w", Sigma_w, d)[1]
    noise_std = _nonneg("noise_std", noise_std)
    X = rng.standard_normal((batch, n + 1, d)) @ F.T                 # rows x_i ~ N(0, F F^T)
    w_star = rng.standard_normal((batch, d)) @ F_w.T
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


def rotated_covariance(rng, eigenvalues=PAPER_EIGENVALUES):
    """Sigma = U diag(eigenvalues) U^T with U Haar-random orthogonal ([A] §4.3, MATH.md §1).

    U is the Q factor of a Gaussian matrix with the signs of diag(R) folded in, which makes it
    exactly Haar (the authors' code uses SVD of a uniform matrix, not Haar: MATH.md §1).
    Returns Sigma (d, d) and U (d, d).
    """
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
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
# query column q. The forward pass needs a prompt only through (S_0, q_0): O(B L H D^3), not n.
# The map S -> (1/n) sum_h P_h S Q_h is one (D^2, D^2) matrix K shared by the batch
# (kernel_forward), so the layers' pair below works on S and q alone and K has a pair of its own.
# ---------------------------------------------------------------------------------------------

def mask(n):
    """M = diag(1, ..., 1, 0) of shape (n+1, n+1) ([A] §2): the query is not a key or value.
    MATH.md §2."""
    n = _int("n", n, 1)
    return np.diag(np.r_[np.ones(n), 0.0])


def forward_literal(P, Q, Z):
    """The paper's column form of eq. (4), token by token; the twin that tests the fast path.

        z_j <- z_j + (1/n) sum_h P_h sum_{i<n} z_i (z_i^T Q_h z_j)   for every j <= n (query too)

    P, Q: (L, H, D, D); Z: (B, D, n+1). Returns Z_L (B, D, n+1). Cost O(B L H n^2 D^2).
    MATH.md §2.
    """
    P, Q = _params(P, Q)
    Z = _prompts(Z, P.shape[2]).copy()
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


def gram(Z, threads=None):
    """S_0 = Z M Z^T, (B, D, D): the Gram matrix of the n context tokens (MATH.md §2), formed in
    chunks of prompts on `threads` workers (default as _thread_count: every core, one for D <= 6)."""
    Z = _prompts(Z)
    Zc = Z[:, :, :-1]                                          # Z M drops the query column
    S = np.empty((Z.shape[0], Z.shape[1], Z.shape[1]))

    def one_chunk(start, stop):
        np.matmul(Zc[start:stop], Zc[start:stop].transpose(0, 2, 1), out=S[start:stop])
    _map_chunks(one_chunk, Z.shape[0], _chunk(None, Z.shape[1]), threads, Z.shape[1] <= _SERIAL_MAX_D)
    return S


def kernel_forward(P_l, Q_l, n):
    """The layer's action on S as one matrix: vec(sum_h P_h S Q_h) / n = K vec(S) (row-major vec),

        K = (1/n) sum_h P_h kron Q_h^T,   (D^2, D^2), shared by the whole batch, whatever H is.

    P_l, Q_l: (H, D, D). Returns K.
    MATH.md §2.
    """
    return sum(np.kron(P_h, Q_h.T) for P_h, Q_h in zip(P_l, Q_l)) / n


def kernel_backward(dK, P_l, Q_l, n):
    """Adjoint of kernel_forward: dK (D^2, D^2) -> dP_l, dQ_l (H, D, D).

    K[(i l), (j k)] = (1/n) sum_h P_h[i, j] Q_h[k, l]: product rule in P_h and in Q_h.
    MATH.md §3.
    """
    D = P_l.shape[-1]
    dK = dK.reshape(D, D, D, D) / n                              # indices [i, l, j, k]
    dP_l = np.stack([np.einsum("iljk,kl->ij", dK, Q_h) for Q_h in Q_l])
    dQ_l = np.stack([np.einsum("iljk,ij->kl", dK, P_h) for P_h in P_l])
    return dP_l, dQ_l


def direct_forward(P_l, Q_l, S, n):
    """T - I = (1/n) sum_h P_h S Q_h without the kernel, for large D (MATH.md §2).

    Per head two GEMMs (B D, D) @ (D, D) with a shared operand, using S = S^T:
    S_b P_h^T = (P_h S_b)^T for every prompt at once, then (P_h S_b) Q_h. Cost 4 H B D^3.
    P_l, Q_l: (H, D, D); S: (B, D, D) symmetric; n context size. Returns (B, D, D).
    """
    B, D, _ = S.shape
    out = np.zeros((B, D, D))
    for P_h, Q_h in zip(P_l, Q_l):
        PS = (S.reshape(B * D, D) @ P_h.T).reshape(B, D, D).transpose(0, 2, 1)   # P_h S_b
        out += (np.ascontiguousarray(PS).reshape(B * D, D) @ Q_h).reshape(B, D, D)
    out /= n
    return out


def direct_backward(dT, P_l, Q_l, S, n, need_dS=True, need_dPQ=True):
    """Adjoint of direct_forward: dT (B, D, D) -> dS (B, D, D) (None unless need_dS) and
    dPQ (2, H, D, D) = (dP_l, dQ_l) summed over the batch (None unless need_dPQ). MATH.md §3.

    T = I + (1/n) sum_h P_h S Q_h, product rule in each factor:
    dP_h = (1/n) sum_b dT_b (S_b Q_h)^T, dQ_h = (1/n) sum_b (P_h S_b)^T dT_b,
    dS_b = (1/n) sum_h P_h^T dT_b Q_h^T.
    """
    B, D, _ = S.shape
    dPQ = np.empty((2,) + P_l.shape) if need_dPQ else None
    dS = np.zeros((B, D, D)) if need_dS else None
    S_rows, dT_rows = S.reshape(B * D, D), dT.reshape(B * D, D)
    for h, (P_h, Q_h) in enumerate(zip(P_l, Q_l)):
        if need_dPQ:
            SQ = (S_rows @ Q_h).reshape(B, D, D)                             # S_b Q_h
            dPQ[0, h] = np.tensordot(dT, SQ, axes=([0, 2], [0, 2])) / n      # sum_b dT_b (S_b Q_h)^T
            SPt = (S_rows @ P_h.T).reshape(B, D, D)                          # (P_h S_b)^T
            dPQ[1, h] = np.tensordot(SPt, dT, axes=([0, 2], [0, 1])) / n     # sum_b (P_h S_b)^T dT_b
        if need_dS:
            dTQt = (dT_rows @ Q_h.T).reshape(B, D, D).transpose(0, 2, 1)     # (dT_b Q_h^T)^T
            dS += (np.ascontiguousarray(dTQt).reshape(B * D, D) @ P_h).reshape(B, D, D).transpose(0, 2, 1)
    if need_dS:
        dS /= n
    return dS, dPQ


FORMULATIONS = ("kernel", "direct")


def layer_map(P_l, Q_l, n, formulation=None):
    """The layer's map S -> T - I = (1/n) sum_h P_h S Q_h, in one of two formulations (MATH.md §2):

        "kernel"  the (D^2, D^2) matrix of kernel_forward: one GEMM per chunk, B D^4 per layer
        "direct"  the tuple (P_l, Q_l, n) for direct_forward: 2 GEMMs per head, 4 H B D^3 per layer

    formulation None takes the kernel for D <= 10 H (D = d + 1) and the direct form above, where it
    was measured faster: the crossover lies between d = 8 and d = 10 for one head and moves up with
    H (the kernel's cost does not grow with H; two heads: the kernel still wins at d = 14).
    """
    if formulation is None:
        formulation = "kernel" if P_l.shape[-1] <= 10 * P_l.shape[0] else "direct"
    if formulation not in FORMULATIONS:
        raise ValueError(f"formulation must be None or one of {FORMULATIONS}, got {formulation!r}")
    return kernel_forward(P_l, Q_l, n) if formulation == "kernel" else (P_l, Q_l, n)


def layer_forward(K, S, q, need_S=True):
    """One layer in Gram form: T = I + K(S), S' = T S T^T, q' = T q.

    K: the layer's map from layer_map (a (D^2, D^2) kernel or the direct form's (P_l, Q_l, n));
    S: (B, D, D) = Z_l M Z_l^T; q: (B, D) query column of Z_l.
    Returns S' (B, D, D) (None unless need_S), q' (B, D), T (B, D, D) and the cache (without S',
    layer_backward takes dS_next = None).
    An unchecked building block (forward, predict and loss_and_grad check their inputs); it assumes
    float64 arrays, S symmetric, and the same B in S and q (a (1, D) q would broadcast). MATH.md §2.
    """
    B, D, _ = S.shape
    if isinstance(K, tuple):                                   # the direct form (P_l, Q_l, n)
        T = direct_forward(*K[:2], S, K[2])
    else:                                                      # vec(T - I) = K vec(S)
        T = (S.reshape(B, D * D) @ K.T).reshape(B, D, D)
    T += np.eye(D)
    TS = T @ S if need_S else None             # the backward needs T S only where S' reaches the loss
    S_next = TS @ T.transpose(0, 2, 1) if need_S else None
    q_next = np.einsum("bij,bj->bi", T, q)
    return S_next, q_next, T, (K, S, q, T, TS)


def layer_backward(dS_next, dq_next, cache, need_dS=True, per_prompt=False):
    """Adjoint of layer_forward: (dS', dq') -> (dS, dq, dK).

    dS_next: (B, D, D) or None (the last layer's S' does not reach the loss); dq_next: (B, D).
    Returns dS (B, D, D) (None unless need_dS: the first layer's S_0 is data), dq (B, D), and the
    map's adjoint summed over the batch: dK (D^2, D^2) for a kernel, dPQ (2, H, D, D) = (dP_l, dQ_l)
    for the direct form; with per_prompt, dT (B, D, D) instead, each prompt's own adjoint of T, for
    the Jacobian (MATH.md §3.1).
    MATH.md §3.
    """
    K, S, q, T, TS = cache
    B, D, _ = S.shape
    # q' = T q                      (product rule: T and q)
    dT = np.einsum("bi,bj->bij", dq_next, q)
    dq = np.einsum("bji,bj->bi", T, dq_next)
    # S' = T S T^T                  (T appears twice; S is a Gram matrix, so S^T = S)
    if dS_next is not None:
        dT += (dS_next + dS_next.transpose(0, 2, 1)) @ TS
    if isinstance(K, tuple):        # T = I + (1/n) sum_h P_h S Q_h   (direct_backward)
        dS, dmap = direct_backward(dT, *K[:2], S, K[2], need_dS, need_dPQ=not per_prompt)
    else:                           # vec(T) = vec(I) + K vec(S)    (linear in S and in K)
        dT_flat = dT.reshape(B, D * D)
        dS = (dT_flat @ K).reshape(B, D, D) if need_dS else None
        dmap = None if per_prompt else dT_flat.T @ S.reshape(B, D * D)   # dK = sum_b vec(dT_b) vec(S_b)^T
    if need_dS and dS_next is not None:
        dS += T.transpose(0, 2, 1) @ dS_next @ T                 # S' = T S T^T, the S in the middle
    return dS, dq, dT if per_prompt else dmap


def _propagate(Ks, S, q):
    """Run layer_forward through the layers' kernels Ks; returns q_L (B, D) and the caches."""
    caches = []
    for l, K in enumerate(Ks):
        S, q, _, cache = layer_forward(K, S, q, need_S=l < len(Ks) - 1)
        caches.append(cache)
    return q, caches


def forward(P, Q, Z, all_layers=False, formulation=None):
    """Z_L of the L-layer linear transformer, [A] eq. (4): Z_{l+1} = Z_l + (1/n) Attn(Z_l).

    P, Q: (L, H, D, D); Z: (B, D, n+1). Returns Z_L (B, D, n+1), or with all_layers the stack
    (Z_0, ..., Z_L) of shape (L+1, B, D, n+1). Computed as Z_{l+1} = T_l Z_l (Gram form above);
    formulation as layer_map.
    MATH.md §2.
    """
    P, Q = _params(P, Q)
    Z = _prompts(Z, P.shape[2])
    n = Z.shape[2] - 1
    S, q, Zs = gram(Z), Z[:, :, n], [Z]
    with np.errstate(over="ignore", invalid="ignore"):
        for P_l, Q_l in zip(P, Q):
            S, q, T, _ = layer_forward(layer_map(P_l, Q_l, n, formulation), S, q)
            Zs.append(T @ Zs[-1])
    _finite_result("Z_L", Zs[-1], P=P, Q=Q, Z=Z)
    return np.stack(Zs) if all_layers else Zs[-1]


def predict(P, Q, Z):
    """TF_L(Z_0) = y_hat = -Z_L[d, n] per prompt ([A] §2), shape (B,). Only (S_0, q_0) are used.
    MATH.md §2."""
    P, Q = _params(P, Q)
    Z = _prompts(Z, P.shape[2])
    n = Z.shape[2] - 1
    with np.errstate(over="ignore", invalid="ignore"):
        q_L, _ = _propagate([layer_map(P_l, Q_l, n) for P_l, Q_l in zip(P, Q)], gram(Z), Z[:, :, n])
    return _finite_result("the prediction", -q_L[:, -1], P=P, Q=Q, Z=Z)


# ---------------------------------------------------------------------------------------------
# 3. Loss and gradient ([A] eq. (5) as in its App. A.1 and the authors' code; MATH.md §3)
# ---------------------------------------------------------------------------------------------

def in_context_loss(P, Q, Z, y):
    """f = mean_b (Z_L[b, d, n] + y_b)^2 = mean_b (y_hat_b - y_b)^2 (no factor 1/2).

    P, Q: (L, H, D, D); Z: (B, D, n+1); y: (B,) true query labels. Returns a float.
    MATH.md §3.
    """
    P, Q = _params(P, Q)
    Z = _prompts(Z, P.shape[2])
    y = _labels(y, Z.shape[0])
    return float(np.mean((predict(P, Q, Z) - y) ** 2))


# Prompts on the last axis (MATH.md §3.2). For small D each prompt's products T S, T S T^T and
# their adjoints are a few hundred multiply-adds; with the prompts on the first axis each is one BLAS
# call (a stack of tiny GEMMs that a second worker does not speed up, §3). With the prompts on the
# last axis, (D, D, b), every such product is D^3 vector operations across the chunk's prompts,
# which numpy runs in its own loops on every core; and the kernel acts on S's U = D(D+1)/2
# distinct entries instead of its D^2 entries.

@lru_cache(maxsize=None)
def symmetric_coordinates(D):
    """Index maps between a symmetric D x D matrix S and its U = D (D+1) / 2 distinct entries s
    (the upper triangle, row by row). MATH.md §3.2.

    Returns (upper, full, E, diagonal), read-only:
        upper     (U,) positions of s in vec(S) (row-major):   s = vec(S)[upper]
        full      (D^2,) the entry of s at each position:       vec(S) = s[full]
        E         (D^2, U) 0/1 with vec(S) = E s; a kernel K acts on s as K E
        diagonal  (U,) bool, True where the entry is on the diagonal
    """
    D = _int("D", D, 1)
    i, j = np.triu_indices(D)
    position = np.empty((D, D), dtype=np.intp)
    position[i, j] = position[j, i] = np.arange(len(i))
    full = position.reshape(-1)
    E = np.zeros((D * D, len(i)))
    E[np.arange(D * D), full] = 1.0
    maps = (i * D + j, full, E, i == j)
    for a in maps:
        a.flags.writeable = False
    return maps


def _symmetric_product(X, Y):
    """The distinct entries s (U, b) of X Y^T, for stacks with the prompts last, X, Y (D, m, b),
    where X Y^T is known to be symmetric (Z M Z^T, T S T^T, T^T G T): its upper triangle row by
    row ("ijb,kjb->ikb" restricted to k >= i), written straight into s (symmetric_coordinates),
    U = D(D+1)/2 of the D^2 entries. MATH.md §3.2."""
    D, b = X.shape[0], X.shape[2]
    s = np.empty((D * (D + 1) // 2, b))
    start = 0
    for i in range(D):                  # row i of the upper triangle: s[start : start + D - i]
        np.einsum("jb,kjb->kb", X[i], Y[i:], out=s[start:start + D - i])
        start += D - i
    return s


def _symmetric_full(s, D):
    """The symmetric S (D, D, b) from its distinct entries s (U, b): S = s[full], one gather, so S is
    exactly symmetric. MATH.md §3.2."""
    return s.take(symmetric_coordinates(D)[1], axis=0).reshape(D, D, s.shape[-1])


def lanes_gram(Zt):
    """S = Z M Z^T with the prompts on the last axis: Zt (D, n+1, b) -> (S, s), S (D, D, b)
    symmetric, S_ij = sum_{t<n} Z_it Z_jt (the query column t = n left out), s (U, b) its
    distinct entries. MATH.md §3.2."""
    context = Zt[:, :-1]
    s = _symmetric_product(context, context)
    return _symmetric_full(s, Zt.shape[0]), s


def lanes_forward(K_s, S, s, q, last=False):
    """One layer with the prompts on the last axis: T = I + mat(K_s s), S' = T S T^T, q' = T q.

    K_s: (D^2, U) = K E, the layer's kernel on S's distinct entries (symmetric_coordinates);
    S: (D, D, b) symmetric and s (U, b) its distinct entries; q: (D, b). Returns S' (D, D, b),
    s' (U, b), q' (D, b) and the cache. The last layer (`last`) forms only the row d of T that the
    prediction reads: S' and s' are None and q' is (T q)_d, shape (b,). An unchecked building
    block of loss_and_grad_gram and the Jacobian. MATH.md §3.2.
    """
    D, b = q.shape
    if last:
        t = K_s[-D:] @ s                                          # row d of T - I, (D, b)
        t[-1] += 1.0
        return None, None, np.einsum("jb,jb->b", t, q), (K_s, S, s, q, t, None)
    T = (K_s @ s).reshape(D, D, b)
    T.reshape(D * D, b)[::D + 1] += 1.0                           # + I: the D diagonal rows
    # every product as X Y^T ("ijb,kjb->ikb"), numpy's fastest order here: T S = T S^T
    TS = np.einsum("ijb,kjb->ikb", T, S)
    s_next = _symmetric_product(TS, T)
    return (_symmetric_full(s_next, D), s_next, np.einsum("ijb,jb->ib", T, q),
            (K_s, S, s, q, T, TS))


def lanes_backward(G_next, dq_next, cache, first=False, per_prompt=False):
    """Adjoint of lanes_forward: (G', dq') -> (G, dq, dK_s).

    G is the adjoint of a symmetric S in full form, G = dS + dS^T (MATH.md §3.2): G_next (D, D, b),
    None for the last layer, whose dq_next is the adjoint of (T q)_d, shape (b,); otherwise dq_next
    is (D, b). Returns G (D, D, b) and dq (D, b), both None for the `first` layer (S_0, q_0 are
    data), and dK_s (D^2, U) = sum_b vec(dT_b) s_b^T, the adjoint of K_s summed over the prompts;
    with per_prompt, dT (D, D, b) instead, each prompt's own adjoint of T, for the Jacobian.
    """
    K_s, _, s, q, T, TS = cache
    D, b = q.shape[0], q.shape[-1]
    if G_next is None:              # (T q)_d = t . q with t the row d of T   (product rule: t and q)
        dt = dq_next * q                                          # row d of dT; the others are 0
        if per_prompt:
            dmap = np.zeros((D, D, b))
            dmap[-1] = dt
        else:
            dmap = np.zeros(K_s.shape)
            dmap[-D:] = dt @ s.T                                  # t - e_d = K_s[-D:] s
        if first:
            return None, None, dmap
        dq, ds = dq_next * T, K_s[-D:].T @ dt
    else:
        # products as X Y^T (see lanes_forward), with transposed copies of T S and of T (Tt)
        # q' = T q                  (product rule: T and q)
        dT = dq_next[:, None, :] * q[None, :, :]
        # S' = T S T^T              (T twice; S symmetric, so dS' T S^T + dS'^T T S = G' T S)
        dT += np.einsum("ijb,kjb->ikb", G_next, np.ascontiguousarray(TS.transpose(1, 0, 2)))
        dmap = dT if per_prompt else dT.reshape(D * D, b) @ s.T   # vec(T - I) = K_s s: linear in K_s
        if first:
            return None, None, dmap
        Tt = np.ascontiguousarray(T.transpose(1, 0, 2))
        dq, ds = np.einsum("ijb,jb->ib", Tt, dq_next), K_s.T @ dT.reshape(D * D, b)  # ... and in s
    # ds_p = dS_ij + dS_ji for an off-diagonal entry p = (i, j), dS_ii on the diagonal: G is ds
    # spread over both positions, doubled on the diagonal (its distinct entries g, then mirrored)
    g = ds * np.where(symmetric_coordinates(D)[3], 2.0, 1.0)[:, None]
    if G_next is not None:          # S' = T S T^T, the S in the middle: T^T G' T (G' symmetric)
        g += _symmetric_product(np.einsum("ijb,kjb->ikb", Tt, G_next), Tt)
    return _symmetric_full(g, D), dq, dmap


def _gram_args(caller, P, Q, S0, q0, y, n):
    """The cheap checks of the Gram-form building blocks: float64 arrays of matching shapes and an
    integer n >= 1. Not checked, to keep them cheap: finiteness and the symmetry of S0."""
    for name, a in (("P", P), ("Q", Q), ("S0", S0), ("q0", q0), ("y", y)):
        if not isinstance(a, np.ndarray) or a.dtype != np.float64:
            raise TypeError(f"{caller}: {name} must be a float64 numpy array (use loss_and_grad for "
                            f"converted and checked inputs), got {getattr(a, 'dtype', type(a).__name__)}")
    _int("n", n, 1)
    if y.ndim != 1 or P.ndim != 4:
        raise ValueError(f"{caller} needs P, Q (L, H, D, D) and y (B,); got {P.shape} and {y.shape}")
    B, D = y.shape[0], P.shape[-1]
    if P.shape != Q.shape or S0.shape != (B, D, D) or q0.shape != (B, D):
        raise ValueError(f"{caller} needs P, Q (L, H, D, D), S0 (B, D, D), q0 (B, D), y (B,); "
                         f"got {P.shape}, {Q.shape}, {S0.shape}, {q0.shape}, {y.shape}")


def loss_and_grad_gram(P, Q, S0, q0, y, n, chunk=None, threads=None, formulation=None):
    """f and (df/dP, df/dQ) from the Gram form (S_0, q_0); the fast path behind training.

    P, Q: (L, H, D, D) float64; S0: (B, D, D) = Z M Z^T; q0: (B, D) = Z[:, :, n]; y: (B,);
    n context size. formulation: "lanes" (the prompts on the last axis, MATH.md §3.2), "kernel" or
    "direct" (layer_map); None takes lanes for D <= 12 and layer_map's choice above. Prompts are
    independent, so the batch is walked in chunks of `chunk` prompts (default for kernel and
    direct 2^17 / D^2: a chunk's (chunk, D, D) temporaries stay about 1 MB, in cache; 2x faster at
    d = 20 than 2048 prompts; for lanes see _lanes_loss_and_grad) on `threads` workers (default:
    every core; one for kernel and direct at D <= 6, _thread_count); each chunk's loss and dK are
    divided by the whole B and added in chunk order (MATH.md §3), so the result does not depend on
    `threads`. It runs every optimiser step, so only dtypes and shapes are checked; S0 must be
    symmetric (layer_backward and lanes_backward rely on it) and finite. A non-finite result is
    returned as it is (training treats it as a failed trial). Returns (loss, dP, dQ).
    """
    _gram_args("loss_and_grad_gram", P, Q, S0, q0, y, n)
    B, D = y.shape[0], P.shape[-1]
    if _lanes(formulation, D):
        return _lanes_loss_and_grad(P, Q, _lanes_reader(S0, q0), y, n, chunk, threads)
    Ks = [layer_map(P_l, Q_l, n, formulation) for P_l, Q_l in zip(P, Q)]

    def one_chunk(start, stop):
        q_L, caches = _propagate(Ks, S0[start:stop], q0[start:stop])
        r = q_L[:, -1] + y[start:stop]                    # residual Z_L[d, n] + y = y - y_hat
        # loss = (1/B) sum_b r_b^2 with r = q_L[:, d] + y: every chunk divides by the whole B
        dq = np.zeros_like(q_L)
        dq[:, -1] = 2.0 * r / B
        dS, dKs = None, [None] * len(caches)
        for l in reversed(range(len(caches))):
            dS, dq, dKs[l] = layer_backward(dS, dq, caches[l], need_dS=l > 0)
        return float(r @ r) / B, dKs

    parts = _map_chunks(one_chunk, B, _chunk(chunk, D), threads, D <= _SERIAL_MAX_D)
    loss = sum(part[0] for part in parts)
    dP, dQ = np.empty_like(P), np.empty_like(Q)
    for l, (P_l, Q_l) in enumerate(zip(P, Q)):
        dmap = sum(part[1][l] for part in parts)         # every chunk uses the same map of layer l
        dP[l], dQ[l] = dmap if isinstance(Ks[l], tuple) else kernel_backward(dmap, P_l, Q_l, n)
    return loss, dP, dQ


# The largest D = d + 1 at which the loss (loss_and_grad_gram), and apart from it the Jacobian,
# take the lanes formulation by default: above it the D^3 vector operations per product cost more
# than the batched GEMMs of the kernel or direct form (B = 20000, n = 20, L = 3, 2 cores; loss:
# d = 10 lanes 68 ms vs direct 76, d = 11 97 vs kernel 106, d = 12 119 vs direct 99; blocks
# Jacobian: d = 8 69 vs kernel 82, d = 9 118 vs 113, d = 10 146 vs 142; MATH.md §3.2).
_LANES_MAX_D = 12
_LANES_MAX_D_JACOBIAN = 9


def _lanes(formulation, D, jacobian=False):
    """Whether the loss (or the `jacobian`) takes the lanes formulation: asked for, or by default
    for D <= 12 (the Jacobian D <= 9); any other formulation than None, "lanes" and FORMULATIONS is
    a ValueError."""
    if formulation is None:
        return D <= (_LANES_MAX_D_JACOBIAN if jacobian else _LANES_MAX_D)
    if formulation != "lanes" and formulation not in FORMULATIONS:
        raise ValueError(f"formulation must be None, 'lanes' or one of {FORMULATIONS}, got {formulation!r}")
    return formulation == "lanes"


def _lanes_reader(S0, q0):
    """(start, stop) -> the chunk's S_0 (D, D, b), its distinct entries s_0 (U, b) and q_0 (D, b)
    with the prompts last (copies)."""
    D = S0.shape[-1]
    upper = symmetric_coordinates(D)[0]

    def read_chunk(start, stop):
        S = np.ascontiguousarray(S0[start:stop].transpose(1, 2, 0))
        return S, S.reshape(D * D, -1).take(upper, axis=0), np.ascontiguousarray(q0[start:stop].T)
    return read_chunk


def _lanes_chunk(chunk, B, D):
    """Prompts per chunk for the lanes formulation: `chunk`, or by default a multiple of 4 equal
    chunks near 2^16 / D^2 prompts (each (D, D, b) array about 512 KB, in cache; equal chunks keep
    2 or 4 workers equally busy). It depends on B and D only, never on the worker count."""
    if chunk is not None:
        return _int("chunk", chunk, 1)
    count = 4 * -(-B // (4 * max(1, 2 ** 16 // D ** 2)))
    return -(-B // count)


def _lanes_kernels(P, Q, n):
    """Each layer's kernel on S's distinct entries, K_s = K E (D^2, U). MATH.md §3.2."""
    E = symmetric_coordinates(P.shape[-1])[2]
    return [kernel_forward(P_l, Q_l, n) @ E for P_l, Q_l in zip(P, Q)]


def _lanes_propagate(Ks, S, s, q):
    """Run lanes_forward through the layers' kernels K_s from S_0, s_0, q_0; returns (q_L)_d (b,)
    and the caches."""
    caches = []
    for l, K_s in enumerate(Ks):
        S, s, q, cache = lanes_forward(K_s, S, s, q, last=l == len(Ks) - 1)
        caches.append(cache)
    return q, caches


def _lanes_loss_and_grad(P, Q, read_chunk, y, n, chunk, threads):
    """loss_and_grad_gram in the lanes formulation (MATH.md §3.2). read_chunk(start, stop) gives
    the chunk's S_0 (D, D, b), its distinct entries s_0 (U, b) and q_0 (D, b) with the prompts on
    the last axis. Chunks as _lanes_chunk; workers: every core."""
    B, D = y.shape[0], P.shape[-1]
    E = symmetric_coordinates(D)[2]
    Ks = _lanes_kernels(P, Q, n)

    def one_chunk(start, stop):
        q, caches = _lanes_propagate(Ks, *read_chunk(start, stop))
        r = q + y[start:stop]                             # q = Z_L[d, n]: r = y - y_hat
        G, dq, dKs = None, 2.0 * r / B, [None] * len(Ks)  # every chunk divides by the whole B
        for l in reversed(range(len(Ks))):
            G, dq, dKs[l] = lanes_backward(G, dq, caches[l], first=l == 0)
        return float(r @ r) / B, dKs

    parts = _map_chunks(one_chunk, B, _lanes_chunk(chunk, B, D), threads)
    loss = sum(part[0] for part in parts)
    dP, dQ = np.empty_like(P), np.empty_like(Q)
    for l, (P_l, Q_l) in enumerate(zip(P, Q)):
        dK = sum(part[1][l] for part in parts) @ E.T     # K_s = K E: dK = dK_s E^T
        dP[l], dQ[l] = kernel_backward(dK, P_l, Q_l, n)
    return loss, dP, dQ


def _jacobian_rows(structure, JP, JQ):
    """Per-prompt gradients JP, JQ (B, L, H, D, D) as Jacobian rows (B, p) in the structure's
    coordinates: structure_grad applied to every row at once (its chain rules act per layer)."""
    B = JP.shape[0]
    rows = structure_grad(structure, JP.reshape((-1,) + JP.shape[2:]), JQ.reshape((-1,) + JQ.shape[2:]))
    return np.concatenate([g.reshape(B, -1) for g in rows.values()], axis=1)


def residuals_and_jacobian_gram(P, Q, S0, q0, y, n, structure="full", chunk=None, threads=None,
                                formulation=None):
    """Residuals r_b = Z_L[b, d, n] + y_b and their Jacobian from the Gram form (MATH.md §3.1).

    Arguments as loss_and_grad_gram. Each prompt's row is the reverse pass seeded with e_d for that
    prompt alone: dr_b/dP_lh = (1/n) dT_lb Q_lh^T S_lb, dr_b/dQ_lh = (1/n) S_lb P_lh^T dT_lb.
    structure: "full" gives J in (P, Q) coordinates (columns in pack order of P then Q), "sparse"
    or "blocks" maps each row through the structure's chain rule (pack order of structure_shapes).
    formulation as loss_and_grad_gram ("lanes", MATH.md §3.2, by default for D <= 9; "kernel" or
    "direct" change how T is formed, not the rows). Default workers: every core; one for kernel
    and direct at D <= 5 (_thread_count).
    Returns r (B,) and J (B, p); 2 J^T r / B is the gradient of the loss.
    """
    _check_structure(structure)
    _gram_args("residuals_and_jacobian_gram", P, Q, S0, q0, y, n)
    B, D = y.shape[0], P.shape[-1]
    L, H = P.shape[:2]
    if _lanes(formulation, D, jacobian=True):
        return _lanes_jacobian(P, Q, _lanes_reader(S0, q0), y, n, structure, chunk, threads)
    Ks = [layer_map(P_l, Q_l, n, formulation) for P_l, Q_l in zip(P, Q)]

    def one_chunk(start, stop):
        q_L, caches = _propagate(Ks, S0[start:stop], q0[start:stop])
        r = q_L[:, -1] + y[start:stop]
        dq = np.zeros_like(q_L)
        dq[:, -1] = 1.0                                   # dr_b / dq_L[b] = e_d, prompt by prompt
        JP, JQ = np.empty((2, len(r)) + P.shape)
        dS = None
        for l in reversed(range(L)):
            dS, dq, dT = layer_backward(dS, dq, caches[l], need_dS=l > 0, per_prompt=True)
            S, b = caches[l][1], len(r)
            for h in range(H):
                # vec(T) = vec(I) + K vec(S), K = (1/n) sum_h P_h kron Q_h^T  (kernel_backward per prompt);
                # the factor shared by all prompts goes in one (b D, D) GEMM, the rest per prompt
                np.matmul((dT.reshape(b * D, D) @ (Q[l, h].T / n)).reshape(b, D, D), S,
                          out=JP[:, l, h])                                       # (dT_b Q^T/n) S_b
                np.matmul((S.reshape(b * D, D) @ (P[l, h].T / n)).reshape(b, D, D), dT,
                          out=JQ[:, l, h])                                       # (S_b P^T/n) dT_b
        return r, _jacobian_rows(structure, JP, JQ)

    parts = _map_chunks(one_chunk, B, _chunk(chunk, D), threads, D <= _SERIAL_MAX_D_JACOBIAN)
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def _lanes_jacobian(P, Q, read_chunk, y, n, structure, chunk, threads):
    """residuals_and_jacobian_gram in the lanes formulation (MATH.md §3.1, §3.2): the reverse pass
    seeded with dr_b/d(q_L)_d = 1 for every prompt, each prompt's dT kept; the rows formed with
    the prompts last and written to (b, L, H, D, D). Chunks as _lanes_chunk; workers: every core."""
    B, D = y.shape[0], P.shape[-1]
    L, H = P.shape[:2]
    Ks = _lanes_kernels(P, Q, n)

    def one_chunk(start, stop):
        q, caches = _lanes_propagate(Ks, *read_chunk(start, stop))
        r = q + y[start:stop]
        JP, JQ = np.empty((2, len(r)) + P.shape)
        G, dq = None, np.ones(len(r))                     # dr_b / d(q_L)_d = 1, prompt by prompt
        for l in reversed(range(L)):
            G, dq, dT = lanes_backward(G, dq, caches[l], first=l == 0, per_prompt=True)
            S_l = caches[l][1]
            for h in range(H):      # dr_b/dP_lh = (1/n) dT_b Q^T S_b, dr_b/dQ_lh = (1/n) S_b P^T dT_b
                # formed with the prompts last, then copied into the rows' layout in one pass
                JP[:, l, h] = np.einsum("ijb,kjb->bik", np.einsum("ijb,kj->ikb", dT, Q[l, h] / n), S_l)
                JQ[:, l, h] = np.einsum("ijb,jkb->bik", np.einsum("ijb,kj->ikb", S_l, P[l, h] / n), dT)
        return r, _jacobian_rows(structure, JP, JQ)

    parts = _map_chunks(one_chunk, B, _lanes_chunk(chunk, B, D), threads)
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def loss_and_grad(P, Q, Z, y, threads=None):
    """In-context loss f (see in_context_loss) and its gradient by hand-written reverse mode.

    P, Q: (L, H, D, D); Z: (B, D, n+1); y: (B,); threads: workers over chunks of prompts (default
    as loss_and_grad_gram; the result does not depend on it). The formulation is
    loss_and_grad_gram's default; with lanes (D <= 12) each chunk's Gram product is formed in its
    worker (lanes_gram), otherwise gram() forms S_0 first. Returns (loss, dP, dQ), shaped like P, Q.
    A NaN or Inf in Z is a ValueError; with lanes each worker looks for one in its chunk of Z just
    before reading it (in the cache, on every core: 1 ms of ~15 at the paper's size when the whole
    Z was checked first, serially), so no result comes out of a Z that is not finite.
    MATH.md §3, §3.2.
    """
    P, Q = _params(P, Q)
    lanes = _lanes(None, P.shape[-1])
    Z = _prompts(Z, P.shape[2], finite=not lanes)
    y = _labels(y, Z.shape[0])
    n = Z.shape[2] - 1
    with np.errstate(over="ignore", invalid="ignore"):
        if lanes:                                       # each chunk's Gram product in its worker
            def lanes_chunk(start, stop):
                _finite_entries("Z", Z[start:stop])
                Zt = Z[start:stop].transpose(1, 2, 0)     # a view: lanes_gram reads Z in place
                return (*lanes_gram(Zt), np.ascontiguousarray(Zt[:, n]))
            loss, dP, dQ = _lanes_loss_and_grad(P, Q, lanes_chunk, y, n, None, threads)
        else:
            loss, dP, dQ = loss_and_grad_gram(P, Q, gram(Z, threads), np.ascontiguousarray(Z[:, :, n]), y,
                                              n, threads=threads)
    for what, value in (("the loss", loss), ("dP", dP), ("dQ", dQ)):
        _finite_result(what, value, P=P, Q=Q, Z=Z)
    return loss, dP, dQ


def residuals_and_jacobian(P, Q, Z, y, structure="full", threads=None, activation="linear"):
    """Per-prompt residuals r = Z_L[:, d, n] + y (B,) and Jacobian J (B, p), MATH.md §3.1.

    P, Q: (L, H, D, D); Z: (B, D, n+1); y: (B,). structure "full" gives J in (P, Q) coordinates
    (pack order P then Q); "sparse" or "blocks" (P, Q of that structure, H = 1) gives J in the
    structure's own coordinates (pack order of structure_shapes). The loss is mean(r^2) and its
    gradient 2 J^T r / B. J holds B p floats (B = 200000, p = 150: 240 MB). activation: one of
    ACTIVATIONS; other than "linear" the rows come from the explicit attention (MATH.md §4).
    """
    _check_structure(structure)
    _check_activation(activation)
    P, Q = _params(P, Q)
    if structure != "full" and P.shape[1] != 1:
        raise ValueError(f"structure {structure!r} has one head: P, Q must have H = 1, got H = {P.shape[1]}")
    Z = _prompts(Z, P.shape[2])
    y = _labels(y, Z.shape[0])
    n = Z.shape[2] - 1
    if activation != "linear":
        r, JP, JQ, _ = _activation_pass(P, Q, Z, y, activation, threads, jacobian=True)
        return r, _jacobian_rows(structure, JP, JQ)
    return residuals_and_jacobian_gram(P, Q, gram(Z), np.ascontiguousarray(Z[:, :, n]), y, n,
                                       structure=structure, threads=threads)


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


def attention_forward(P_h, Q_h, Z, activation):
    """One head: out = (1/n) P Z M sigma(Z^T Q Z). P_h, Q_h: (D, D); Z: (B, D, n+1).
    Returns out (B, D, n+1) and the cache for attention_backward. The activation is checked; the
    arrays are not (forward_activation and loss_and_grad_activation check theirs): it assumes float64
    P_h, Q_h of shape (D, D) matching Z. MATH.md §4."""
    _check_activation(activation)
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
    if per_prompt:
        dP_h = dV @ Z.transpose(0, 2, 1)                       # dV_b Z_b^T
    else:
        dP_h = np.tensordot(dV, Z, axes=([0, 2], [0, 2]))     # sum_b dV_b Z_b^T, one GEMM
    dZ = P_h.T @ dV
    # E = Z^T Q Z                   (Z appears twice: as keys and as queries)
    dZ += Q_h @ Z @ dE.transpose(0, 2, 1) + Q_h.T @ Z @ dE
    ZdE = Z @ dE
    if per_prompt:
        dQ_h = ZdE @ Z.transpose(0, 2, 1)                      # Z_b dE_b Z_b^T
    else:
        dQ_h = np.tensordot(ZdE, Z, axes=([0, 2], [0, 2]))    # sum_b Z_b dE_b Z_b^T
    return dZ, dP_h, dQ_h


def _check_activation(activation):
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def _activation_pass(P, Q, Z, y, activation, threads=None, jacobian=False):
    """Through the explicit attention layers, the batch in chunks on the workers. Returns
    (loss, dP, dQ, Z_L), each chunk's loss and gradient divided by the whole B (MATH.md §3); with
    jacobian, (r (B,), JP (B, L, H, D, D), JQ (B, L, H, D, D), Z_L), the backward seeded with
    dr_b/dZ_L[b, d, n] = 1 prompt by prompt and not summed over the batch (MATH.md §4)."""
    B, D, N = Z.shape

    def one_chunk(start, stop):
        Zc, caches = Z[start:stop], []
        for P_l, Q_l in zip(P, Q):
            heads = [attention_forward(P_h, Q_h, Zc, activation) for P_h, Q_h in zip(P_l, Q_l)]
            caches.append([c for _, c in heads])
            Zc = Zc + sum(out for out, _ in heads)             # Z_{l+1} = Z_l + sum_h Attn_h
        r = Zc[:, -1, -1] + y[start:stop]
        dZ = np.zeros_like(Zc)
        dZ[:, -1, -1] = 1.0 if jacobian else 2.0 * r / B
        shape = (len(r),) + P.shape if jacobian else P.shape
        dP, dQ = np.zeros(shape), np.zeros(shape)
        for l in reversed(range(len(caches))):
            dZ_in = dZ.copy()                                  # the residual path
            for h, cache in enumerate(caches[l]):
                dZ_h, dP_h, dQ_h = attention_backward(dZ, cache, per_prompt=jacobian)
                if jacobian:
                    dP[:, l, h], dQ[:, l, h] = dP_h, dQ_h
                else:
                    dP[l, h], dQ[l, h] = dP_h, dQ_h
                dZ_in += dZ_h
            dZ = dZ_in
        return (r if jacobian else float(r @ r) / B), dP, dQ, Zc

    # (n+1, n+1) score matrices: chunks of 2^15 / (n+1)^2 prompts keep them in cache (2x faster)
    parts = _map_chunks(one_chunk, B, max(1, 2 ** 15 // N ** 2), threads, max(D, N) <= _SERIAL_MAX_D)
    if jacobian:
        return tuple(np.concatenate([p[i] for p in parts]) for i in range(4))
    return (sum(p[0] for p in parts), sum(p[1] for p in parts), sum(p[2] for p in parts),
            np.concatenate([p[3] for p in parts]))


def forward_activation(P, Q, Z, activation="relu"):
    """Z_L of L layers Z <- Z + sum_h P_h Z M sigma(Z^T Q_h Z) / n ([A] §6). Shapes as forward.
    MATH.md §4."""
    _check_activation(activation)
    P, Q = _params(P, Q)
    Z = _prompts(Z, P.shape[2])
    return _activation_pass(P, Q, Z, np.zeros(Z.shape[0]), activation)[3]


def predict_activation(P, Q, Z, activation="relu"):
    """y_hat = -Z_L[d, n] of forward_activation, shape (B,). MATH.md §4."""
    return -forward_activation(P, Q, Z, activation)[:, -1, -1]


def loss_and_grad_activation(P, Q, Z, y, activation="relu"):
    """(loss, dP, dQ) for the attention of forward_activation, by hand-written reverse mode.
    MATH.md §4."""
    _check_activation(activation)
    P, Q = _params(P, Q)
    Z = _prompts(Z, P.shape[2])
    y = _labels(y, Z.shape[0])
    return _activation_pass(P, Q, Z, y, activation)[:3]


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
    dP, dQ = _params(dP, dQ, ("dP", "dQ"))
    if dP.shape[1] != 1:
        raise ValueError(f"dP, dQ must have one head, shape (L, 1, D, D), for the structures (8) and (11); "
                         f"got {dP.shape}")
    return -dQ[:, 0, :-1, :-1], dP[:, 0, :-1, :-1]


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


def structure_shapes(structure, L, d, H=1):
    """Names and shapes of a structure's own coordinates: sparse A; blocks A, B; full P, Q.
    MATH.md §5."""
    _check_structure(structure)
    L, d, H = _int("L", L, 1), _int("d", d, 1), _int("H", H, 1)
    if structure != "full" and H != 1:
        raise ValueError(f"heads must be 1 for structure {structure!r} (one P, Q per layer), got {H}")
    if structure == "full":
        return {"P": (L, H, d + 1, d + 1), "Q": (L, H, d + 1, d + 1)}
    if structure == "blocks":
        return {"A": (L, d, d), "B": (L, d, d)}
    return {"A": (L, d, d)}


def structure_to_PQ(structure, coords):
    """(P, Q) of a structure's coordinates (a dict as from structure_shapes). MATH.md §5."""
    _check_structure(structure)
    keys = {"sparse": {"A"}, "blocks": {"A", "B"}, "full": {"P", "Q"}}[structure]
    if not isinstance(coords, dict) or set(coords) != keys:
        raise ValueError(f"coords must be a dict with the keys {sorted(keys)} for structure {structure!r}")
    if structure == "sparse":
        return sparse_params(coords["A"])
    if structure == "blocks":
        return block_params(coords["A"], coords["B"])
    return _params(coords["P"], coords["Q"], ("coords['P']", "coords['Q']"))


def structure_grad(structure, dP, dQ):
    """The gradient in a structure's own coordinates, a dict keyed like structure_shapes. MATH.md §5."""
    _check_structure(structure)
    if structure == "sparse":
        return {"A": sparse_grad(dP, dQ)}
    if structure == "blocks":
        dA, dB = block_grad(dP, dQ)
        return {"A": dA, "B": dB}
    return dict(zip("PQ", _params(dP, dQ, ("dP", "dQ"))))


# ---------------------------------------------------------------------------------------------
# 5. Training on a fixed batch ([A] Fig. 3c and the authors' LBFGS notebook; MATH.md §6)
# ---------------------------------------------------------------------------------------------

def _evaluator(Z, y, activation, threads=None):
    """(P, Q) -> (loss, dP, dQ) on the fixed batch (Z, y); the linear layer precomputes S_0 once."""
    if activation == "linear":
        n = Z.shape[2] - 1
        S0, q0 = gram(Z), np.ascontiguousarray(Z[:, :, n])      # contiguous: 2x faster einsums
        return lambda P, Q: loss_and_grad_gram(P, Q, S0, q0, y, n, threads=threads)
    return lambda P, Q: _activation_pass(P, Q, Z, y, activation, threads)[:3]


def _interrupted_at_start(structure, coords, options, start, **extra):
    """The result of a training run stopped by Ctrl-C before its first evaluation completed: the
    start's coordinates, no loss (NaN), interrupted=True."""
    return dict(structure=structure, coords=coords, P=None, Q=None, loss=math.nan, grad_norm=math.nan,
                success=False, wall_time=time.perf_counter() - start, scipy_version=scipy.__version__,
                history=np.array([]), options=options, nit=0, nfev=0, status=None, interrupted=True,
                message="interrupted by KeyboardInterrupt before the first evaluation completed: nothing was "
                "computed", **extra)


def _start(structure, shapes, init, init_scale, rng):
    """The initial flat vector: iid N(0, init_scale^2) from rng, or the arrays of an init dict.
    Everything is checked before rng is touched."""
    if isinstance(init, str) and init == "random":
        if not isinstance(rng, np.random.Generator):
            raise TypeError("rng must be a numpy.random.Generator when init='random'")
        init_scale = _nonneg("init_scale", init_scale)
        return init_scale * rng.standard_normal(sum(math.prod(s) for s in shapes.values()))
    if isinstance(init, dict):
        if set(init) != set(shapes):
            raise ValueError(f"init must have the keys {sorted(shapes)} for structure {structure!r}, "
                             f"got {sorted(init)}")
        arrays = [_array(f"init[{k!r}]", init[k], len(s)) for k, s in shapes.items()]
        for (k, s), a in zip(shapes.items(), arrays):
            if a.shape != s:
                raise ValueError(f"init[{k!r}] must have shape {s}, got {a.shape}")
        return pack(arrays)
    raise TypeError(f"init must be 'random' or a dict of arrays keyed {sorted(shapes)}")


def train_lbfgs(Z, y, layers, structure="sparse", heads=1, init="random", init_scale=0.1,
                rng=None, maxiter=2000, maxfun=None, maxcor=20, ftol=0.0, gtol=1e-10,
                maxls=50, progress=0, keep_iterates=False, activation="linear", threads=None):
    """Minimise the in-context loss on the fixed batch (Z, y) with scipy's L-BFGS-B.

    Z: (B, d+1, n+1), y: (B,), layers = L >= 1, structure in {"sparse", "blocks", "full"},
    heads = H >= 1 (only for "full"). init: "random" (iid N(0, init_scale^2) entries drawn
    from rng, a numpy Generator) or a dict of arrays in the structure's coordinates (shapes as
    structure_shapes). The options maxiter, maxfun (default 5 * maxiter), maxcor, ftol, gtol and
    maxls go to scipy.optimize.minimize(method="L-BFGS-B") as they are; ftol = 0 (the default)
    stops only on the projected gradient (gtol) or when the loss no longer decreases at all, so a
    stop is at a small gradient, not at a slow stretch (at the paper's scale |grad| ~ 4e-9).
    maxcor = 20 pairs suffice for the sparse structure (~400 iterations at the paper's scale); the
    blocks structure wants about twice its 150 coordinates: with 300 it converges in ~1200-1700
    iterations, with 20 it still has |grad| ~1e-4 after 3000 (measured; MATH.md §6).
    progress = k > 0 prints "iteration, loss, |grad|, elapsed" to stderr every k iterations. keep_iterates stores the
    coordinates after every iteration (result["iterates"], a list of dicts, initial point first).
    activation: "linear" (the paper's layer; the Gram matrices S_0 = Z M Z^T are computed once and
    each evaluation costs O(B L H D^3)) or one of ACTIVATIONS (explicit attention, O(B L H n^2 D)).
    threads: workers per evaluation (default as loss_and_grad); BLAS runs one thread during training
    (one_blas_thread) and the caller's setting is restored after.

    Returns a dict: structure, coords (the structure's own arrays), P, Q, loss, grad_norm, nit,
    nfev, success, status, message, interrupted, wall_time, scipy_version, history (loss after
    each iteration, starting with the initial loss) and options. success is scipy's verdict;
    a Ctrl-C returns the last completed iterate with interrupted=True and success=False.
    MATH.md §6.
    """
    _check_structure(structure)
    _check_activation(activation)
    layers, heads = _int("layers", layers, 1), _int("heads", heads, 1)
    Z = _prompts(Z)
    y = _labels(y, Z.shape[0])
    d, n = Z.shape[1] - 1, Z.shape[2] - 1
    shapes = structure_shapes(structure, layers, d, heads)
    options = dict(maxiter=_int("maxiter", maxiter, 1),
                   maxfun=5 * maxiter if maxfun is None else _int("maxfun", maxfun, 1),
                   maxcor=_int("maxcor", maxcor, 1), ftol=_nonneg("ftol", ftol),
                   gtol=_nonneg("gtol", gtol), maxls=_int("maxls", maxls, 1))
    progress = _int("progress", progress, 0)
    _thread_count(threads)
    x0 = _start(structure, shapes, init, init_scale, rng)

    evaluate = _evaluator(Z, y, activation, threads)

    def coords_of(theta):
        return dict(zip(shapes, unpack(theta, list(shapes.values()))))

    def fun(theta):
        # a trial point where the model overflows is a failed trial (an infinite loss), so the
        # line search backs off instead of the run ending; `last` keeps only finite evaluations
        if not np.all(np.isfinite(theta)):
            return math.inf, np.zeros_like(theta)
        with np.errstate(over="ignore", invalid="ignore"):
            loss, dP, dQ = evaluate(*structure_to_PQ(structure, coords_of(theta)))
        if not (math.isfinite(loss) and np.all(np.isfinite(dP)) and np.all(np.isfinite(dQ))):
            return math.inf, np.zeros_like(theta)
        grad = pack(structure_grad(structure, dP, dQ).values())
        last.update(theta=theta.copy(), loss=loss, grad=grad)
        return loss, grad

    last, history = {}, []
    iterates = [coords_of(x0)] if keep_iterates else None
    start = time.perf_counter()
    try:
        with one_blas_thread():
            fun(x0)
    except KeyboardInterrupt:
        return _interrupted_at_start(structure, coords_of(x0), options, start, iterates=iterates)
    if not last:
        raise ValueError("the loss or its gradient at the initial point is not finite (float64 overflow): "
                         "use a smaller init_scale or init, or rescale Z")
    best = dict(last)                                        # the last completed iterate
    history.append(best["loss"])

    def callback(theta):
        if not np.array_equal(theta, last["theta"]):          # L-BFGS-B's last call is the iterate
            fun(theta)
        best.update(last)
        history.append(last["loss"])
        if keep_iterates:
            iterates.append(coords_of(last["theta"]))
        k = len(history) - 1
        if progress and k % progress == 0:
            print(f"iter {k:6d}  loss {last['loss']:.6e}  |grad| {np.linalg.norm(last['grad']):.3e}"
                  f"  {time.perf_counter() - start:8.2f} s", file=sys.stderr, flush=True)

    try:
        with one_blas_thread():
            res = scipy.optimize.minimize(fun, x0, jac=True, method="L-BFGS-B", callback=callback,
                                          options=options)
        outcome = dict(nit=int(res.nit), nfev=int(res.nfev), success=bool(res.success),
                       status=int(res.status), message=str(res.message), interrupted=False)
        # the returned loss is the loss of the returned parameters: scipy's res.fun can be the
        # value of a failed trial point, so take the point from the last finite evaluation
        if not np.array_equal(res.x, best["theta"]):
            with one_blas_thread():
                fun(res.x)
            if np.array_equal(last["theta"], res.x) and last["loss"] <= best["loss"]:
                best.update(last)
            else:
                outcome["message"] += "; returning the last iterate with a finite loss"
        theta, loss, grad = best["theta"], best["loss"], best["grad"]
    except KeyboardInterrupt:
        theta, loss, grad = best["theta"], best["loss"], best["grad"]
        outcome = dict(nit=len(history) - 1, nfev=None, success=False, status=None,
                       message=f"interrupted by KeyboardInterrupt after {len(history) - 1} iterations",
                       interrupted=True)
    coords = coords_of(theta)
    P, Q = structure_to_PQ(structure, coords)
    return dict(structure=structure, coords=coords, P=P, Q=Q, loss=float(loss),
                grad_norm=float(np.linalg.norm(grad)), wall_time=time.perf_counter() - start,
                scipy_version=scipy.__version__, history=np.array(history), options=options,
                iterates=iterates, **outcome)


def _fixed_coordinates(structure, shapes):
    """Boolean mask (pack order) of the coordinates that never reach the loss: blocks B_{L-1}
    ([A] footnote 4) and, for full P, Q, the x-rows of the last layer's P (MATH.md §5)."""
    masks = {k: np.zeros(s, dtype=bool) for k, s in shapes.items()}
    if structure == "blocks":
        masks["B"][-1] = True
    elif structure == "full":
        masks["P"][-1, :, :-1, :] = True
    return np.concatenate([m.ravel() for m in masks.values()])


def _reduced_least_squares(r, J, threads=None, rows=None):
    """(f, R) with R^T R = J^T J, R^T f = J^T r and |f| = |r|: the triangular factor of the QR
    factorisation of [J r] is [[R, g], [0, rho]], so f = [g; rho] (p+1,) and R stacked on a zero row
    (p+1, p). A trust-region Gauss-Newton step depends on J only through these, so the solver's SVD
    of the (B, p) Jacobian becomes one of a (p+1, p) matrix, the same steps in exact arithmetic
    (MATH.md §6). The factor is found in blocks of `rows` rows (default max(2000, 4 (p+1))) on the
    workers, then from the stacked blocks' factors (a tall-skinny QR: the same R up to row signs,
    which f shares; 2x faster than one factorisation at B = 20000, p = 125, on 2 cores)."""
    B, p = J.shape
    A = np.column_stack([J, r])

    def r_factor(start, stop):
        return scipy.linalg.qr(A[start:stop], mode="r", check_finite=False)[0][:p + 1]
    rows = max(2000, 4 * (p + 1)) if rows is None else rows
    blocks = _map_chunks(r_factor, B, rows, threads)
    top = scipy.linalg.qr(np.vstack(blocks), mode="r", check_finite=False)[0][:p + 1]
    R_aug = np.zeros((p + 1, p + 1))
    R_aug[:len(top)] = top                  # fewer than p + 1 prompts: the missing rows are zero
    return R_aug[:, p], R_aug[:, :p]


def train_gauss_newton(Z, y, layers, structure="sparse", heads=1, init="random", init_scale=0.1,
                       rng=None, max_nfev=500, gtol=1e-8, progress=0, threads=None, activation="linear"):
    """Minimise the in-context loss on (Z, y) by Gauss-Newton with a trust region (MATH.md §6).

    scipy.optimize.least_squares on the residuals r / sqrt(B) (method "dogbox" for the sparse and
    blocks structures, "trf" for full P, Q, MATH.md §6) with the hand-derived
    Jacobian of residuals_and_jacobian_gram, so its objective is half the loss; the solver sees the
    equivalent (p+1)-dimensional system of _reduced_least_squares (the same steps, a small SVD).
    Arguments as train_lbfgs; max_nfev bounds residual evaluations (each with its Jacobian). The coordinates
    that do not enter the loss (blocks: B_{L-1}; full: the x-rows of P_{L-1}) are held at their
    initial values (result["fixed"] counts them). Converged means a small gradient: success is
    grad_norm <= gtol, where grad_norm = |2 J^T r / B| over the free coordinates; scipy's own
    reason for stopping is in message. Ctrl-C returns the best point evaluated so far with
    interrupted=True. history holds the loss after each accepted decrease. activation as in
    train_lbfgs (the explicit attention's Jacobian, MATH.md §4).

    Returns the dict of train_lbfgs (structure, coords, P, Q, loss, grad_norm, nit, nfev, success,
    status, message, interrupted, wall_time, scipy_version, history, options) plus fixed.
    """
    _check_structure(structure)
    _check_activation(activation)
    layers, heads = _int("layers", layers, 1), _int("heads", heads, 1)
    Z = _prompts(Z)
    y = _labels(y, Z.shape[0])
    B, d, n = Z.shape[0], Z.shape[1] - 1, Z.shape[2] - 1
    shapes = structure_shapes(structure, layers, d, heads)
    options = dict(max_nfev=_int("max_nfev", max_nfev, 1), gtol=_nonneg("gtol", gtol))
    progress = _int("progress", progress, 0)
    _thread_count(threads)
    theta0 = _start(structure, shapes, init, init_scale, rng)
    free = ~_fixed_coordinates(structure, shapes)
    S0, q0 = gram(Z), np.ascontiguousarray(Z[:, :, n])
    root_B = math.sqrt(B)

    def coords_of(theta):
        return dict(zip(shapes, unpack(theta, list(shapes.values()))))

    def full(x):
        theta = theta0.copy()
        theta[free] = x
        return theta

    cache = {}

    def evaluate(x):
        # a trial point where the model overflows gets an infinite loss: the trust region shrinks
        if cache.get("x") is not None and np.array_equal(cache["x"], x):
            return cache
        cache.update(x=x.copy(), f=np.full(x.size + 1, np.inf), R=np.zeros((x.size + 1, x.size)))
        if not np.all(np.isfinite(x)):
            return cache
        P, Q = structure_to_PQ(structure, coords_of(full(x)))
        with np.errstate(over="ignore", invalid="ignore"):
            if activation == "linear":
                r, J = residuals_and_jacobian_gram(P, Q, S0, q0, y, n, structure=structure, threads=threads)
            else:
                r, JP, JQ, _ = _activation_pass(P, Q, Z, y, activation, threads, jacobian=True)
                J = _jacobian_rows(structure, JP, JQ)
        if not (np.all(np.isfinite(r)) and np.all(np.isfinite(J))):
            return cache
        J = J[:, free]
        cache["f"], cache["R"] = _reduced_least_squares(r / root_B, J / root_B, threads)
        loss = float(r @ r) / B
        if loss < best["loss"]:
            best.update(x=x.copy(), loss=loss, r=r, J=J)
            history.append(loss)
            if progress and (len(history) - 1) % progress == 0:
                g = np.linalg.norm(2 * J.T @ r / B)
                print(f"eval {len(history) - 1:6d}  loss {loss:.6e}  |grad| {g:.3e}"
                      f"  {time.perf_counter() - start:8.2f} s", file=sys.stderr, flush=True)
        return cache

    start = time.perf_counter()
    best, history = dict(loss=math.inf), []
    x0 = theta0[free]
    try:
        with one_blas_thread():
            evaluate(x0)
    except KeyboardInterrupt:
        return _interrupted_at_start(structure, coords_of(theta0), options, start, fixed=int(np.sum(~free)))
    if not math.isfinite(best["loss"]):
        raise ValueError("the loss or its Jacobian at the initial point is not finite (float64 overflow): "
                         "use a smaller init_scale or init, or rescale Z")
    # dogleg steps take about half the evaluations on the structured models; on full P, Q, whose
    # Jacobian is rank-deficient along (gamma P_l, Q_l / gamma), they stall where "trf" does not
    method = "trf" if structure == "full" else "dogbox"
    try:
        with one_blas_thread():
            res = scipy.optimize.least_squares(lambda x: evaluate(x)["f"], x0,
                                               jac=lambda x: evaluate(x)["R"], method=method,
                                               ftol=1e-15, xtol=1e-15, gtol=1e-15,
                                               max_nfev=options["max_nfev"])
        outcome = dict(nit=int(res.nfev), nfev=int(res.nfev), status=int(res.status),
                       message=str(res.message), interrupted=False)
    except KeyboardInterrupt:
        outcome = dict(nit=len(history), nfev=None, status=None, interrupted=True,
                       message=f"interrupted by KeyboardInterrupt after {len(history)} decreases")
    x, loss = best["x"], best["loss"]
    grad_norm = float(np.linalg.norm(2 * best["J"].T @ best["r"] / B))
    coords = coords_of(full(x))
    P, Q = structure_to_PQ(structure, coords)
    success = not outcome["interrupted"] and grad_norm <= options["gtol"]
    if not outcome["interrupted"]:
        outcome["message"] += (f"; gradient norm {grad_norm:.2e} {'<=' if success else '>'} "
                               f"gtol {options['gtol']:.1e}")
    return dict(structure=structure, coords=coords, P=P, Q=Q, loss=loss, grad_norm=grad_norm,
                success=success, wall_time=time.perf_counter() - start, scipy_version=scipy.__version__,
                history=np.array(history), options=options, fixed=int(np.sum(~free)), **outcome)


# ---------------------------------------------------------------------------------------------
# 6. Closed forms (MATH.md §7-§10)
# ---------------------------------------------------------------------------------------------

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


def _single_layer_moments(Sigma, n, Sigma_w, noise_var):
    """(Sigma, Sigma_w, K, E[h w^T]) of MATH.md §8, with h = (1/n) sum_i y_i x_i."""
    n = _int("n", n, 1)
    Sigma = _spd("Sigma", Sigma)[0]
    d = Sigma.shape[0]
    Sigma_w = np.eye(d) if Sigma_w is None else _spd("Sigma_w", Sigma_w, d)[0]
    noise_var = _nonneg("noise_var", noise_var)
    K = ((n + 1) / n) * Sigma @ Sigma_w @ Sigma + ((np.trace(Sigma_w @ Sigma) + noise_var) / n) * Sigma
    return Sigma, Sigma_w, K, Sigma @ Sigma_w


def gamma_star(Sigma, n, Sigma_w=None, noise_var=0.0):
    """Optimal single-layer preconditioner, Theorem 1 of [A] generalised (MATH.md §8):

        Gamma* = K^-1 Sigma Sigma_w,
        K = ((n+1)/n) Sigma Sigma_w Sigma + ((tr(Sigma_w Sigma) + noise_var)/n) Sigma.

    With Sigma_w = I and no noise, Gamma* = ((1 + 1/n) Sigma + (tr Sigma / n) I)^-1, eq. (6).
    Sigma, Sigma_w: (d, d) SPD; n >= 1; noise_var >= 0 (context label noise). Returns (d, d);
    the optimal layer is sparse_params(Gamma*[None]).
    """
    n = _int("n", n, 1)
    Sigma = _spd("Sigma", Sigma)[0]
    Sigma_w = np.eye(Sigma.shape[0]) if Sigma_w is None else _spd("Sigma_w", Sigma_w, Sigma.shape[0])[0]
    noise_var = _nonneg("noise_var", noise_var)
    # scale-free: with Sigma = c S and Sigma_w = w W (max entries 1), Gamma* = K'^-1 S W / c, where K'
    # is K of (S, W) with the noise noise_var / (c w); no under- or overflow at any scale of Sigma
    c, w = np.max(np.abs(Sigma)), np.max(np.abs(Sigma_w))
    _, _, K, E_hw = _single_layer_moments(Sigma / c, n, Sigma_w / w, noise_var / (c * w))
    return _finite_result("Gamma*", np.linalg.solve(K, E_hw) / c, Sigma=Sigma)


def single_layer_population_loss(Gamma, Sigma, n, Sigma_w=None, noise_var=0.0, query_noise=True):
    """Exact E (y_hat - y_q)^2 of the one-layer sparse model with A_0 = Gamma (MATH.md §8):

        L(Gamma) = tr(Sigma Gamma^T K Gamma) - 2 tr(Sigma Gamma^T Sigma Sigma_w) + tr(Sigma Sigma_w)
                   + noise_var [if query_noise],

    for x ~ N(0, Sigma), w* ~ N(0, Sigma_w), context labels with noise of variance noise_var, and a
    query label with the same noise when query_noise (as sample_prompts draws it).
    Gamma: (d, d), any (not only symmetric). Returns a float.
    """
    Sigma, Sigma_w, K, E_hw = _single_layer_moments(Sigma, n, Sigma_w, noise_var)
    Gamma = _array("Gamma", Gamma, 2)
    if Gamma.shape != Sigma.shape:
        raise ValueError(f"Gamma must have shape {Sigma.shape} to match Sigma, got {Gamma.shape}")
    with np.errstate(over="ignore", invalid="ignore"):
        loss = (np.trace(Sigma @ Gamma.T @ K @ Gamma) - 2 * np.trace(Sigma @ Gamma.T @ E_hw)
                + np.trace(Sigma @ Sigma_w) + (noise_var if query_noise else 0.0))
    return float(_finite_result("the loss", loss, Gamma=Gamma, Sigma=Sigma))


def gd_step_size(n, d, noise_var=0.0):
    """Mahankali et al. (2023): the optimal single layer is one GD step from 0 with the
    per-example step eta = 1 / (n + 1 + d + noise_var) (MATH.md §8, translated to [A]'s form):
    Gamma* = n * eta * I for Sigma = Sigma_w = I, and n * eta * Sigma^-1 for Sigma_w = Sigma^-1.
    """
    return 1.0 / (_int("n", n, 1) + 1 + _int("d", d, 1) + _nonneg("noise_var", noise_var))


MAX_MOMENT_ORDER = 40    # exact Wishart moments up to this order (MATH.md §9)


@lru_cache(maxsize=None)
def _wishart_T(n, d, parts):
    """T(k_1..k_r) = E prod_j tr(W^{k_j}), W ~ Wishart_d(n, I), by the recursion of MATH.md §9.

    parts is a sorted tuple of positive integers; an exact Python integer is returned.
    """
    if not parts:
        return 1
    k, rest = parts[-1], parts[:-1]

    def T(*ks):                        # tr W^0 = d, so every zero exponent is a factor d
        return d ** ks.count(0) * _wishart_T(n, d, tuple(sorted(x for x in ks if x)))
    total = (n + k - 1) * T(k - 1, *rest)
    total += sum(T(j, k - 1 - j, *rest) for j in range(1, k))
    total += sum(2 * m * T(k + m - 1, *(rest[:i] + rest[i + 1:])) for i, m in enumerate(rest))
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
    return [Fraction(d)] + [Fraction(_wishart_T(n, d, (k,)), n ** k) for k in range(1, kmax + 1)]


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


def _poly_scale(c, p):
    return _poly_trim([c * p_i for p_i in p])


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
        r = _poly_add(r, _poly_scale(a_l, _poly_mul(p, _poly_mul(phi, phi))))
        p = _poly_mul(p, _poly_add(one, _poly_scale(-a_l, s)))
        step = _poly_add(one, _poly_scale(-g_l, s))
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
    """family_population_loss by the Gauss rule (float64, all terms >= 0): for optimisation."""
    a = theta[:L]
    gam = a * np.r_[theta[L:], 0.0] if blocks else np.zeros(L)
    p, r, phi, s = np.ones_like(nodes), np.zeros_like(nodes), np.ones_like(nodes), nodes
    for a_l, g_l in zip(a, gam):
        r = r + a_l * p * phi ** 2
        p = p * (1 - a_l * s)
        phi, s = phi * (1 - g_l * s), s * (1 - g_l * s) ** 2
    return float(weights @ p ** 2 + noise_var / n * (weights @ (nodes * r ** 2)))


def _family_descent(L, n, d, blocks, noise_var):
    """theta0 -> scipy's L-BFGS-B result on the family loss at the exact Gauss nodes (MATH.md §10),
    theta = (a (L,), b (L-1,) with blocks). Refuses families whose exact loss needs moments beyond
    MAX_MOMENT_ORDER."""
    degree = (3 ** L - 1) // 2 if blocks else L                  # deg p, MATH.md §10
    if 2 * degree > MAX_MOMENT_ORDER:
        raise ValueError(f"L must be <= {3 if blocks else MAX_MOMENT_ORDER // 2} for the "
                         f"{'blocks' if blocks else 'sparse'} family: its exact loss needs Wishart moments "
                         f"up to order 2 deg p = {2 * degree} > {MAX_MOMENT_ORDER}, got L = {L}")
    nodes, weights = wishart_quadrature(n, d, degree + 1)       # exact to degree 2 deg p + 1
    args = (L, blocks, nodes, weights, n, noise_var)
    return lambda theta0: scipy.optimize.minimize(_family_loss_at_nodes, theta0, args=args, jac="3-point",
                                                  method="L-BFGS-B", options=dict(ftol=1e-15, gtol=1e-12))


def _family_result(theta, L, n, d, blocks, noise_var, sort=False):
    """(a, b with b[L-1] = NaN or None, exact loss) from a descent's theta."""
    a = np.sort(theta[:L]) if sort else theta[:L]
    b = np.r_[theta[L:], np.nan] if blocks else None
    return a, b, family_population_loss(a, n, d, b, noise_var=noise_var)


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
    L, n, d = _int("L", L, 1), _int("n", n, 1), _int("d", d, 1)
    noise_var = _nonneg("noise_var", noise_var)
    starts = _int("starts", starts, 1)
    if rng is not None and not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator or None, got {type(rng).__name__}")
    rng = np.random.default_rng(0) if rng is None else rng
    descend = _family_descent(L, n, d, blocks, noise_var)
    best = min((descend(np.r_[rng.uniform(0, 2, L), rng.uniform(0, 1.5, L - 1) if blocks else []])
                for _ in range(starts)), key=lambda res: res.fun)
    return _family_result(best.x, L, n, d, blocks, noise_var, sort=not blocks)


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


def distance_to_diagonal(M):
    """||offdiag(M)||_F / ||M||_F for a square M != 0: 0 exactly when M is diagonal (Theorem 2).
    MATH.md §11."""
    M = _array("M", M, 2)
    if M.shape[0] != M.shape[1] or not np.any(M):
        raise ValueError(f"M must be a nonzero square matrix, got shape {M.shape}")
    M = M / np.max(np.abs(M))                                # scale-free: no under- or overflow
    return float(np.linalg.norm(M - np.diag(np.diag(M))) / np.linalg.norm(M))


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


def sandwich_covariance(structure, coords, Z, y, chunks=200, h=1e-5, activation="linear"):
    """Sampling covariance of parameters trained on the batch (Z, y), in the structure's coordinates:

        Cov(theta_hat) ~ H^+ V H^+ / B,

    H the batch Hessian of the loss (central differences of the exact gradient; h = 1e-5 balances
    truncation h^2 against rounding eps/h), V the covariance of one prompt's gradient: exact from
    the per-prompt gradients 2 r_b J_b for the linear layer (MATH.md §3.1), else estimated from
    `chunks` chunk-mean gradients times the chunk size; H^+ the pseudo-inverse
    (B_{L-1} and rescalings leave H singular). Valid near a minimiser of the batch loss, for
    gradients that are not heavy-tailed (MATH.md §10-§11). Returns a (p, p) array in pack order.
    """
    _check_structure(structure)
    _check_activation(activation)
    Z = _prompts(Z)
    y = _labels(y, Z.shape[0])
    chunks = _int("chunks", chunks, 2)
    h = _nonneg("h", h)
    if h == 0:
        raise ValueError("h must be > 0 (the step of the central differences of the gradient)")
    P_c, Q_c = structure_to_PQ(structure, coords)
    if P_c.shape[-1] != Z.shape[1]:
        raise ValueError(f"coords have d = {P_c.shape[-1] - 1} but Z has d = {Z.shape[1] - 1}")
    if Z.shape[0] < 2 * chunks:
        raise ValueError(f"Z must hold at least 2 * chunks = {2 * chunks} prompts, got {Z.shape[0]}")
    names, shapes = list(coords), [np.shape(coords[k]) for k in coords]
    theta0 = pack([coords[k] for k in names])

    def grad(theta, evaluate):
        P, Q = structure_to_PQ(structure, dict(zip(names, unpack(theta, shapes))))
        return pack(structure_grad(structure, *evaluate(P, Q)[1:]).values())
    whole = _evaluator(Z, y, activation)
    H = np.array([(grad(theta0 + h * e, whole) - grad(theta0 - h * e, whole)) / (2 * h)
                  for e in np.eye(theta0.size)])
    H_pinv = np.linalg.pinv(np.atleast_2d((H + H.T) / 2), hermitian=True)
    if activation == "linear":
        r, J = residuals_and_jacobian(P_c, Q_c, Z, y, structure=structure)
        V = np.cov(2 * r[:, None] * J, rowvar=False)
    else:
        size = Z.shape[0] // chunks
        G = np.array([grad(theta0, _evaluator(Z[i:i + size], y[i:i + size], activation))
                      for i in range(0, size * chunks, size)])
        V = size * np.cov(G, rowvar=False)
    return H_pinv @ np.atleast_2d(V) @ H_pinv / Z.shape[0]


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


def _von_oswald_weights(W_q, W_k, W_v, W_o, heads):
    """The four projections as (L, D, H k), (L, D, H k), (L, D, H v), (L, H v, D) float64 arrays."""
    heads = _int("heads", heads, 1)
    W = [_array(name, w, (2, 3)) for name, w in (("W_q", W_q), ("W_k", W_k), ("W_v", W_v), ("W_o", W_o))]
    if len({w.ndim for w in W}) != 1:
        raise ValueError("W_q, W_k, W_v, W_o must all be per layer (3-d) or all shared (2-d)")
    W = [w if w.ndim == 3 else w[None] for w in W]
    (L, D, Hk), (_, _, Hv) = W[0].shape, W[2].shape
    expected = [(L, D, Hk), (L, D, Hk), (L, D, Hv), (L, Hv, D)]
    for name, w, e in zip(("W_q", "W_k", "W_v", "W_o"), W, expected):
        if w.shape != e:
            raise ValueError(f"{name} must have shape {e[1:] if W_q.ndim == 2 else e} to match W_q and W_v, "
                             f"got {w.shape}")
    if Hk % heads or Hv % heads or D < 2:
        raise ValueError(f"the key and value widths ({Hk}, {Hv}) must be multiples of heads = {heads}, and d+1 >= 2")
    return W, heads


def _von_oswald_heads(W, heads, activation):
    """W_q, W_k, W_v, W_o split into heads, (L, H, D, k), (L, H, D, k), (L, H, D, v), (L, H, v, D),
    and the score scale s: 1, or 1 / sqrt(key size) for their softmax."""
    Wq, Wk, Wv, Wo = (np.stack(np.split(w, heads, axis=2 if i < 3 else 1), axis=1) for i, w in enumerate(W))
    return Wq, Wk, Wv, Wo, 1.0 if activation == "linear" else 1.0 / math.sqrt(Wq.shape[-1])


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
    W, heads = _von_oswald_weights(W_q, W_k, W_v, W_o, heads)
    n = _int("n", n, 1)
    if activation not in ("linear", "softmax"):
        raise ValueError(f"activation must be 'linear' or 'softmax' for von Oswald et al.'s model, got {activation!r}")
    tied = np.ndim(W_q) == 2
    if tied:
        W = [np.repeat(w, _int("layers", layers, 1), axis=0) for w in W]
    elif layers is not None and _int("layers", layers, 1) != W[0].shape[0]:
        raise ValueError(f"layers = {layers} but the weights have {W[0].shape[0]} layers")
    Wq, Wk, Wv, Wo, s = _von_oswald_heads(W, heads, activation)
    P = n * np.swapaxes(Wv @ Wo, -1, -2)                        # n (W_v,h W_o,h)^T = n W_o,h^T W_v,h^T
    Q = s * Wk @ np.swapaxes(Wq, -1, -2)                        # W_k,h W_q,h^T
    return P, Q


def grads_to_von_oswald(dP, dQ, W_q, W_k, W_v, W_o, n, heads=1, activation="linear"):
    """The gradient of von Oswald et al.'s loss (VON_OSWALD_LOSS_SCALE times icl_ref's) with respect to
    W_q, W_k, W_v, W_o, from icl_ref's (dP, dQ): the chain rule through params_from_von_oswald
    (MATH.md §12). With P_h = n (W_v,h W_o,h)^T and Q_h = s W_k,h W_q,h^T:
    dW_v,h = n dP_h^T W_o,h^T, dW_o,h = n W_v,h^T dP_h^T, dW_k,h = s dQ_h W_q,h, dW_q,h = s dQ_h^T W_k,h;
    tied (2-d) weights get the sum over layers. Returns (dW_q, dW_k, dW_v, dW_o) shaped like the weights.
    """
    W, heads = _von_oswald_weights(W_q, W_k, W_v, W_o, heads)
    n = _int("n", n, 1)
    dP, dQ = _params(dP, dQ, ("dP", "dQ"))
    tied = np.ndim(W_q) == 2
    L = dP.shape[0]
    if tied:
        W = [np.repeat(w, L, axis=0) for w in W]
    if dP.shape[:2] != (W[0].shape[0], heads) or dP.shape[-1] != W[0].shape[1]:
        raise ValueError(f"dP, dQ must have shape (L, heads, D, D) = ({W[0].shape[0]}, {heads}, {W[0].shape[1]}, "
                         f"{W[0].shape[1]}) to match the weights, got {dP.shape}")
    Wq, Wk, Wv, Wo, s = _von_oswald_heads(W, heads, activation)
    dPt, c = np.swapaxes(dP, -1, -2), VON_OSWALD_LOSS_SCALE
    grads = [c * s * np.swapaxes(dQ, -1, -2) @ Wk, c * s * dQ @ Wq,      # dW_q,h, dW_k,h
             c * n * dPt @ np.swapaxes(Wo, -1, -2), c * n * np.swapaxes(Wv, -1, -2) @ dPt]
    out = [np.concatenate(list(np.moveaxis(g, 1, 0)), axis=2 if i < 3 else 1) for i, g in enumerate(grads)]
    return tuple(o.sum(axis=0) if tied else o for o in out)


# ---------------------------------------------------------------------------------------------
# 9. Conformance: reference vectors and a diagnosis of mismatches (MATH.md §13)
# ---------------------------------------------------------------------------------------------

VECTORS_FORMAT = 1
ARRAY_MEANINGS = {
    "Z": "prompts, paper layout (B, d+1, n+1): tokens are columns, the query last with label slot 0",
    "y": "true query labels (B,)",
    "P": "P of eq. (3) per layer and head (L, H, d+1, d+1)",
    "Q": "Q = W_k^T W_q of eq. (3) per layer and head (L, H, d+1, d+1)",
    "Z_L": "output of the L layers (B, d+1, n+1)",
    "y_hat": "prediction -Z_L[:, d, n] (B,)",
    "loss": "mean_b (y_hat_b - y_b)^2, no factor 1/2 (a 0-d array)",
    "dP": "gradient of loss with respect to P",
    "dQ": "gradient of loss with respect to Q",
    "Z_rows": "authors' layout: the prompts with tokens as rows (B, n+1, d+1)",
    "allparam": "authors' layout: free blocks (L, H, 2, d, d); [..., 0] is P's top-left, [..., 1] Q's, transposed",
    "grad_allparam": "authors' layout: gradient of the same loss with respect to allparam",
    "W_q": "von Oswald et al.'s layout: queries (L, d+1, H k), heads as column blocks (key size k = d+1)",
    "W_k": "von Oswald et al.'s layout: keys (L, d+1, H k)",
    "W_v": "von Oswald et al.'s layout: values (L, d+1, H v)",
    "W_o": "von Oswald et al.'s layout: output projection (L, H v, d+1), heads as row blocks",
    "grad_W_q": "von Oswald et al.'s layout: gradient of THEIR loss (0.5 * loss) with respect to W_q",
    "grad_W_k": "von Oswald et al.'s layout: gradient of their loss (0.5 * loss) with respect to W_k",
    "grad_W_v": "von Oswald et al.'s layout: gradient of their loss (0.5 * loss) with respect to W_v",
    "grad_W_o": "von Oswald et al.'s layout: gradient of their loss (0.5 * loss) with respect to W_o",
}
VECTOR_TOLERANCES = {
    "float64": "relative to the largest entry of each array: 1e-12 for Z_L, y_hat and loss (rounding of a few "
               "hundred operations); 1e-10 for gradients (rounding grows with depth: 3e-13 seen at L = 8)",
    "float32": "forward 1e-5, loss 1e-4, gradients 1e-4 (5x the worst float32 error measured over d <= 20, "
               "n <= 200, L <= 4; larger parameters or deeper models need their own measurement)",
}


def reference_cases():
    """The inputs of the reference vectors: a list of dicts (name, description, activation, structure,
    Z, y, P, Q), deterministic (fixed seeds); fresh copies on every call. MATH.md §13."""
    return [{k: v.copy() if isinstance(v, np.ndarray) else v for k, v in c.items()} for c in _reference_cases()]


@lru_cache(maxsize=1)
def _reference_cases():
    """reference_cases, built once (the family optimum takes a second)."""
    cases = []

    def add(name, description, seed, d, n, L, H, make, activation="linear", structure="full", Sigma=None,
            Sigma_w=None):
        rng = np.random.default_rng([VECTORS_FORMAT, seed])
        Z, y = sample_prompts(rng, 4, n, np.eye(d) if Sigma is None else Sigma, Sigma_w)
        P, Q = make(rng, d, L, H)
        cases.append(dict(name=name, description=description, activation=activation, structure=structure,
                          Z=Z, y=y, P=np.asarray(P, float), Q=np.asarray(Q, float)))

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
    add("large-d", "d = 12, n = 8: the direct formulation of the layer (D > 10 H)", 8, 12, 8, 2, 1, full(0.1))
    add("relu", "[A] section 6 attention with relu, d = 2, n = 4, H = 2", 9, 2, 4, 1, 2, full(0.5), activation="relu")
    add("softmax", "softmax over the n context keys (von Oswald et al.'s), d = 2, n = 4, H = 2", 10, 2, 4, 1, 2,
        full(0.5), activation="softmax")
    add("softmax_all", "the authors' softmax: all n+1 keys, then the mask drops the query's value", 11, 2, 4, 1,
        2, full(0.5), activation="softmax_all")
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


def _write_npz(path, arrays):
    """np.savez with fixed zip timestamps, so the same arrays give the same bytes."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for name, a in arrays.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.array(a, order="C"), allow_pickle=False)   # keeps 0-d
            zf.writestr(zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0)), buf.getvalue())


def write_reference_vectors(out):
    """Write the reference vectors into the directory `out` (created if needed): one .npz per case of
    reference_cases (the arrays of ARRAY_MEANINGS that apply: the paper's layout always, the authors'
    when P, Q have their form and the attention is linear, von Oswald et al.'s for linear and
    softmax attention) and manifest.json (format version, conventions, shapes, meanings, tolerances).
    The same bytes on every run. Returns the manifest (a dict). MATH.md §13."""
    if not isinstance(out, (str, os.PathLike)) or not str(out):
        raise TypeError(f"out must name a directory, got {out!r}")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"out {str(out)!r} exists and is not a directory")
    os.makedirs(out, exist_ok=True)
    manifest = dict(format="icl_ref reference vectors", format_version=VECTORS_FORMAT,
                    conventions="MATH.md sections 2-3 and 12: layer Z + (1/n) sum_h P_h Z M Z^T Q_h Z with M dropping "
                                "the query from keys and values; y_hat = -Z_L[d, n]; loss mean (y_hat - y)^2",
                    tolerances=VECTOR_TOLERANCES, cases=[])
    for case in reference_cases():
        P, Q, Z, y, act = case["P"], case["Q"], case["Z"], case["y"], case["activation"]
        arrays = dict(Z=Z, y=y, P=P, Q=Q, **_case_outputs(P, Q, Z, y, act))
        layouts = ["paper"]
        try:
            allparam = params_to_authors(P, Q)
            if act == "linear":
                arrays.update(Z_rows=tokens_as_rows(Z), allparam=allparam,
                              grad_allparam=grads_to_authors(arrays["dP"], arrays["dQ"]))
                layouts.append("authors")
        except ValueError:
            pass
        if act in ("linear", "softmax"):
            L, H, D, _ = P.shape
            n = Z.shape[2] - 1
            eye = np.tile(np.eye(D), (L, 1, H))                                    # W_q,h = I, key size D
            W = dict(W_q=eye, W_k=np.concatenate(list(np.moveaxis(Q, 1, 0)), axis=2)
                     * (1.0 if act == "linear" else math.sqrt(D)),
                     W_v=np.concatenate(list(np.moveaxis(np.swapaxes(P, -1, -2) / n, 1, 0)), axis=2),
                     W_o=np.swapaxes(eye, -1, -2))
            grads = grads_to_von_oswald(arrays["dP"], arrays["dQ"], *W.values(), n, heads=H, activation=act)
            arrays.update(W, **{f"grad_{k}": g for k, g in zip(W, grads)})
            layouts.append("von_oswald")
        _write_npz(os.path.join(out, f"{case['name']}.npz"), arrays)
        manifest["cases"].append(dict(
            name=case["name"], file=f"{case['name']}.npz", description=case["description"],
            activation=case["activation"], structure=case["structure"], layouts=layouts,
            B=int(Z.shape[0]), d=int(Z.shape[1] - 1), n=int(Z.shape[2] - 1), L=int(P.shape[0]), H=int(P.shape[1]),
            arrays={k: dict(shape=list(np.shape(v)), meaning=ARRAY_MEANINGS[k]) for k, v in arrays.items()}))
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")
    return manifest


def _variant_outputs(case, variant):
    """Z_L, y_hat, loss, dP, dQ that an implementation with one known convention slip computes on a
    reference case (MATH.md §13), or None where the slip does not apply. Gradients are with respect
    to the paper's P and Q as the user's code names them."""
    P, Q, Z, y, act = case["P"], case["Q"], case["Z"], case["y"], case["activation"]
    n = Z.shape[2] - 1
    if variant == "Q transposed":
        out = _case_outputs(P, np.swapaxes(Q, -1, -2), Z, y, act)
        out["dQ"] = np.swapaxes(out["dQ"], -1, -2)
    elif variant in ("1/(n+1) normalisation", "no normalisation"):
        c = n / (n + 1) if variant.startswith("1/") else n
        out = _case_outputs(c * P, Q, Z, y, act)
        out["dP"] = c * out["dP"]
    elif variant == "query used as a key and value":
        if act != "linear":
            return None
        S0, q0 = Z @ Z.transpose(0, 2, 1), np.ascontiguousarray(Z[:, :, n])   # no mask: S counts the query
        loss, dP, dQ = loss_and_grad_gram(P, Q, S0, q0, y, n)
        Zs = Z
        for P_l, Q_l in zip(P, Q):
            Zs = Zs + sum(P_h @ Zs @ Zs.transpose(0, 2, 1) @ Q_h @ Zs for P_h, Q_h in zip(P_l, Q_l)) / n
        out = dict(Z_L=Zs, y_hat=-Zs[:, -1, -1], loss=np.array(loss), dP=dP, dQ=dQ)
    elif variant == "loss with a factor 1/2":
        out = _case_outputs(P, Q, Z, y, act)
        out.update(loss=out["loss"] / 2, dP=out["dP"] / 2, dQ=out["dQ"] / 2)
    elif variant == "prediction sign flipped":
        out = _case_outputs(P, Q, Z, -y, act)                  # (Z_L[d, n] - y)^2 is icl_ref's loss at -y
        out["y_hat"] = -out["y_hat"]
    elif variant in ("softmax over n+1 keys", "softmax over n keys"):
        other = {"softmax over n+1 keys": ("softmax", "softmax_all"), "softmax over n keys": ("softmax_all", "softmax")}
        if act != other[variant][0]:
            return None
        out = _case_outputs(P, Q, Z, y, other[variant][1])
    elif variant == "last context example dropped":
        if n < 2:
            return None
        out = _case_outputs(P, Q, np.delete(Z, n - 1, axis=2), y, act)
        out.pop("Z_L")                                          # a different shape: compare the rest
    else:
        raise ValueError(f"unknown variant {variant!r}")
    return out


DIAGNOSIS_VARIANTS = {
    "Q transposed": "your Q is the transpose of the paper's (tokens as rows compute Z^T Q^T Z): transpose it, "
                    "or map the authors' layout with params_from_authors",
    "1/(n+1) normalisation": "you divide the attention by n + 1 (all tokens); the paper divides by the n context "
                             "tokens",
    "no normalisation": "you do not divide the attention by n (von Oswald et al.'s layout folds n into P: use "
                        "params_from_von_oswald)",
    "query used as a key and value": "the query token is a key and a value in your attention; the mask M must "
                                     "drop it (only the n context tokens are keys and values)",
    "loss with a factor 1/2": "your loss is 0.5 * mean (von Oswald et al.'s); icl_ref's has no 1/2: multiply "
                              "icl_ref's by VON_OSWALD_LOSS_SCALE to compare",
    "prediction sign flipped": "your prediction is +Z_L[d, n]; the paper's is -Z_L[d, n]",
    "softmax over n+1 keys": "your softmax normalises over all n+1 keys (the authors' code, icl_ref's "
                             "'softmax_all'); this case normalises over the n context keys ('softmax')",
    "softmax over n keys": "your softmax normalises over the n context keys (icl_ref's 'softmax'); this case "
                           "normalises over all n+1 keys ('softmax_all', the authors' code)",
    "last context example dropped": "you use only n - 1 context examples (the authors' GD baselines do this); "
                                    "use all n",
}


def diagnose(outputs, rtol=1e-6):
    """Compare another implementation's outputs on the reference cases with icl_ref, and name the known
    convention slip that reproduces each mismatch (MATH.md §13).

    outputs: {case name: {quantity: array}} with any of Z_L, y_hat, loss, dP, dQ in the paper's layout,
    computed by the user's code on the inputs of reference_cases() (or the reference vectors' Z, y, P,
    Q). rtol: relative to the largest entry of icl_ref's array (1e-6 suits float64 code; float32 code
    needs about 1e-4). Returns (report, found): a plain-text report a person can act on, and
    {case: {quantity: "agrees" | variant name | "unexplained"}}.
    """
    if not isinstance(outputs, dict):
        raise TypeError(f"outputs must be a dict {{case name: {{quantity: array}}}}, got {type(outputs).__name__}")
    rtol = _nonneg("rtol", rtol)
    cases = {c["name"]: c for c in reference_cases()}
    unknown = sorted(set(outputs) - set(cases))
    if unknown:
        raise ValueError(f"outputs names unknown cases {unknown}; the cases are {sorted(cases)}")

    def close(mine, ref):
        mine = np.asarray(mine, dtype=float)
        scale = max(np.max(np.abs(ref)), 1e-300)                  # relative to ref's largest entry
        return mine.shape == np.shape(ref) and bool(np.all(np.abs(mine - ref) <= rtol * scale))
    lines, found, culprits = [], {}, {}
    for name, given in outputs.items():
        if not isinstance(given, dict) or not set(given) <= {"Z_L", "y_hat", "loss", "dP", "dQ"}:
            raise ValueError(f"outputs[{name!r}] must be a dict with keys among Z_L, y_hat, loss, dP, dQ")
        ref = _case_outputs(cases[name]["P"], cases[name]["Q"], cases[name]["Z"], cases[name]["y"],
                            cases[name]["activation"])
        variants = {v: _variant_outputs(cases[name], v) for v in DIAGNOSIS_VARIANTS}
        found[name] = {}
        for q, mine in given.items():
            if close(mine, ref[q]):
                found[name][q] = "agrees"
                continue
            match = [v for v, out in variants.items() if out is not None and q in out and close(mine, out[q])]
            found[name][q] = match[0] if match else "unexplained"
            for v in match:
                culprits.setdefault(v, []).append(f"{name}:{q}")
        agree = [q for q, f in found[name].items() if f == "agrees"]
        differ = [f"{q} ({f})" for q, f in found[name].items() if f != "agrees"]
        lines.append(f"{name}: " + (f"agrees on {', '.join(agree)}" if agree else "agrees on nothing")
                     + (f"; DIFFERS on {', '.join(differ)}" if differ else ""))
    if culprits:
        lines.append("")
        lines.append("Likely causes, most frequent first:")
        for v, where in sorted(culprits.items(), key=lambda kv: -len(kv[1])):
            lines.append(f"- {v} (reproduces {len(where)} mismatches, e.g. {where[0]}): {DIAGNOSIS_VARIANTS[v]}")
    if any(f == "unexplained" for fs in found.values() for f in fs.values()):
        lines.append("Some mismatches match none of the known variants: compare Z after the first layer, "
                     "then the gradient of one layer at a time.")
    elif not culprits:
        lines.append("Everything agrees within rtol.")
    return "\n".join(lines), found


def _main(argv=None):
    """python3 -m icl_ref vectors --out DIR: write the reference vectors (MATH.md §13)."""
    ap = argparse.ArgumentParser(prog="python3 -m icl_ref", description="icl_ref command line")
    sub = ap.add_subparsers(dest="command", required=True)
    v = sub.add_parser("vectors", help="write the reference vectors (.npz per case and manifest.json)")
    v.add_argument("--out", required=True, help="directory to write into (created if needed)")
    args = ap.parse_args(argv)
    try:
        manifest = write_reference_vectors(args.out)
    except (TypeError, ValueError, OSError) as e:
        ap.error(str(e))
    print(f"wrote {len(manifest['cases'])} cases and manifest.json to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
