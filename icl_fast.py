"""icl_fast: icl_ref's evaluations on several threads, an opt-in engine.

`engine(threads)` is an evaluator with the five methods of icl_ref.REFERENCE (gram,
loss_and_grad_gram, jacobian_gram, activation_pass, reduced_least_squares) that computes the same
numbers with the batch in chunks on worker threads (reduced_least_squares is REFERENCE's own); icl_ref's evaluating functions take it as
`engine=`. This module's loss_and_grad, loss_and_grad_gram, residuals_and_jacobian,
residuals_and_jacobian_gram, loss_and_grad_activation, identifiable_hessian, sandwich_covariance,
train_lbfgs and train_gauss_newton are icl_ref's functions called with that engine: the same
arguments, checks and results, plus `threads=` (an integer >= 1, at most the cores this process may
use; None, the default: every core). What makes them faster, and what importing this module
therefore accepts on the caller's behalf:

- the lanes formulation (MATH.md §16) for the linear layer at small D: a chunk of b prompts held
  as (D, D, b), so each prompt's small products are vector operations across the prompts, and the
  layer's kernel acts on S's D(D+1)/2 distinct entries; at larger D, icl_ref's public layers
  (layer_forward, readout_forward and their adjoints) on chunks of 2^16 / D^2 prompts, each chunk in
  one pass (icl_ref's own evaluations would cut them into its chunks of 2^18 / D^3, a few prompts
  each, and two workers would spend their time taking turns in the interpreter);
- worker threads, one per core by default, kept between calls and bound one to a core (Linux) when
  there is one per core; `shutdown()` ends them;
- BLAS limited to one thread while an icl_fast call runs (the workers' own products would otherwise
  start BLAS threads that compete with the workers for the cores). The limit found is restored when
  the last concurrent call ends, unless the caller set another one meanwhile; a process forked
  during a call starts with the limit found.

Each chunk runs under the calling thread's floating-point rules (np.errstate), as it would on the
calling thread. Results do not depend on the thread count (the chunks depend on B and D only and
are combined in chunk order) and equal icl_ref's to rounding (test_icl_fast.py). Measurements:
docs/benchmarks.md.

Sections follow MATH.md §16, which derives the lanes formulation and states the engine's rules; the
thresholds, chunk sizes, threads and BLAS limits are in MATH.md's notes on the code.
"""
import contextlib
import ctypes
import functools
import itertools
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
try:
    from threadpoolctl import ThreadpoolController
except ImportError as e:    # the optional dependency of the "fast" extra
    raise ImportError("icl_fast needs threadpoolctl: pip install icl_ref[fast]") from e

import icl_ref as ir

__version__ = "0.4.0"

# The largest D = d + 1 at which the loss, and apart from it the Jacobian, take the lanes
# formulation; above it icl_ref's batch-first layers run on the workers (batch_first_chunk), as their
# D^3 BLAS products beat D^3 vector loops there. Near the crossing either costs about the same, and
# where it lies moves a little between machines (docs/benchmarks.md records both); either choice
# gives the same numbers.
LANES_MAX_D = 11
LANES_MAX_D_JACOBIAN = 7

# The smallest evaluation, in multiply-adds of the layers' products per head (B L D^3, times H where
# each head costs its own: everywhere but the lanes loss, whose kernel carries every head at once),
# that the workers share, for the loss and apart from it the Jacobian; a smaller one runs its
# chunks, the same chunks, on the calling thread, as handing chunks to the workers and collecting
# them has a fixed cost that exceeds what they save there (docs/benchmarks.md records both sides).
PARALLEL_MIN_WORK = 2 ** 21
PARALLEL_MIN_WORK_JACOBIAN = 3 * 2 ** 18

# The batch-first layers' chunks on the workers: max(1, BATCH_FIRST_CHUNK // D^2) prompts each
# (_batch_first_bounds).
BATCH_FIRST_CHUNK = 2 ** 16

# The lanes chunks: at most max(1, LANES_CHUNK // D^2) prompts each (_lanes_bounds; each (D, D, b)
# array about 1 MB). Fewer, larger chunks make fewer numpy calls, and each call on a large array is
# a moment where a worker may wait for another's turn in the interpreter; larger still, a chunk's
# arrays leave the core's cache (docs/benchmarks.md, "icl_fast's lanes chunks").
LANES_CHUNK = 2 ** 17


# ---------------------------------------------------------------------------------------------
# Workers: chunks of prompts on the machine's cores, BLAS at one thread meanwhile (the machinery of
# the rules (ii)-(v) of MATH.md §16, detailed in MATH.md's notes on the code)
# ---------------------------------------------------------------------------------------------

def _cores():
    """The cores this process may use."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def _thread_count(threads):
    """Worker threads: `threads` (an integer >= 1; more than the cores this process may use would
    only compete for them, so at most that many) or, for None, every such core."""
    cores = len(_cores())
    if threads is None:
        return cores
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)):
        raise TypeError(f"threads must be an integer >= 1 or None, got {type(threads).__name__}")
    if threads < 1:
        raise ValueError(f"threads must be an integer >= 1 or None, got {threads}")
    return min(int(threads), cores)


# The process-wide BLAS limit while icl_fast calls run: how many calls hold it, the limits found
# when the first of them began, the libraries' (get, set) functions, and how many forks (each
# child's count one more than its parent's) separate this process from the one that imported
# icl_fast; all under `lock`.
_BLAS = dict(lock=threading.Lock(), users=0, saved=None, libraries=None, forks=0)


def _blas_libraries():
    """(get, set) of the thread limit of every BLAS in this process (numpy's and scipy's OpenBLAS
    may be two). OpenBLAS is called through its C functions: from threadpoolctl 3.8 on, only one
    Python thread at a time may change its limit through threadpoolctl, and a call may start in
    any thread; any other BLAS through threadpoolctl."""
    controller, found = ThreadpoolController(), []
    for info in controller.info():
        if info["internal_api"] != "openblas":
            continue
        library = ctypes.CDLL(info["filepath"])
        for prefix, suffix in itertools.product(("", "scipy_"), ("", "64_", "_64")):
            get = getattr(library, f"{prefix}openblas_get_num_threads{suffix}", None)
            put = getattr(library, f"{prefix}openblas_set_num_threads{suffix}", None)
            if get is not None and put is not None:
                found.append((get, put))
                break
    others = [c for c in controller.select(user_api="blas").lib_controllers if c.internal_api != "openblas"]
    return found + [(c.get_num_threads, c.set_num_threads) for c in others]


def _restore_blas():
    """The saved limits back, under the lock, in each library whose limit is still the 1 set here:
    a limit the caller set during the call is the caller's to keep."""
    for (get, put), count in zip(_BLAS["libraries"], _BLAS["saved"]):
        if get() == 1:
            put(count)
    _BLAS["saved"] = None


@contextlib.contextmanager
def _one_blas_thread():
    """BLAS at one thread inside. Entering and leaving are counted under one lock, so that of
    several overlapping holders in different Python threads the first saves the limits and the last
    restores them (the limit is process-wide). A holder left in a child forked inside it was counted
    in the parent only: the child, which restored the limit and began its count at 0 when it was
    forked (_after_fork_in_child), leaves it uncounted."""
    with _BLAS["lock"]:
        forks = _BLAS["forks"]
        if _BLAS["users"] == 0:
            if _BLAS["libraries"] is None:
                _BLAS["libraries"] = _blas_libraries()
            _BLAS["saved"] = [get() for get, _ in _BLAS["libraries"]]
            for _, put in _BLAS["libraries"]:
                put(1)
        _BLAS["users"] += 1
    try:
        yield
    finally:
        if _BLAS["forks"] == forks:                 # not left in a child forked inside it
            with _BLAS["lock"]:
                _BLAS["users"] -= 1
                if _BLAS["users"] == 0:
                    _restore_blas()


_POOLS, _POOLS_LOCK = {}, threading.Lock()


def _pool(workers):
    """The process's pool of `workers` threads, started on first use and kept until shutdown().
    With one thread per core this process may use, thread k is bound to the k-th core (Linux):
    woken together after an idle spell, unbound workers were often placed on one core. A binding
    the system refuses leaves the thread unbound."""
    with _POOLS_LOCK:
        if workers not in _POOLS:
            cores, bind = _cores(), None
            if len(cores) == workers and hasattr(os, "sched_setaffinity"):
                next_core = iter(cores).__next__

                def bind():                              # run by each new thread: the next core
                    try:
                        os.sched_setaffinity(0, {next_core()})
                    except OSError:
                        pass
            _POOLS[workers] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="icl_fast",
                                                 initializer=bind)
        return _POOLS[workers]


def shutdown():
    """End the worker threads (they start again on the next call), e.g. to leave a process with no
    threads of icl_fast's."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        pool.shutdown(wait=True)


def _after_fork_in_child():
    """A forked child has none of the parent's threads: no workers, and no call of the parent's
    that would restore the BLAS limit, so it is restored here. The BLAS state was read under its
    lock (taken before the fork); the locks start anew."""
    global _POOLS_LOCK
    _POOLS.clear()
    _POOLS_LOCK = threading.Lock()
    if _BLAS["users"]:
        _restore_blas()
    _BLAS.update(lock=threading.Lock(), users=0, forks=_BLAS["forks"] + 1)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=lambda: _BLAS["lock"].acquire(), after_in_parent=lambda: _BLAS["lock"].release(),
                        after_in_child=_after_fork_in_child)


def _map(fn, bounds, threads):
    """[fn(start, stop) for (start, stop) in bounds], in that order, on `threads` workers with BLAS
    at one thread. Each worker runs under the calling thread's floating-point rules (a new thread
    starts with numpy's defaults) and claims the next chunk from a shared counter; a failing chunk
    stops the claiming (the chunks already running finish) and its exception reaches the caller.
    The results come back in chunk order, so sums over them do not depend on the thread count."""
    workers = min(_thread_count(threads), len(bounds))
    with _one_blas_thread():
        if workers == 1:
            return [fn(*b) for b in bounds]
        rules = np.geterr()
        results, claim, stop = [None] * len(bounds), itertools.count(), threading.Event()

        def work(_):
            with np.errstate(**rules):
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
        except BaseException:                          # a chunk's error, or Ctrl-C while waiting
            stop.set()
            raise
        return results


def _bounds(B, size):
    """(start, stop) of the batch of B in chunks of `size` prompts."""
    return [(c, min(c + size, B)) for c in range(0, B, size)]


def _mean_of_chunks(parts, bounds, B):
    """The batch's means from the chunks' means: each weighted by its share of the B prompts and
    added in chunk order."""
    return tuple(sum(part[i] * ((b - a) / B) for part, (a, b) in zip(parts, bounds)) for i in range(len(parts[0])))


def _concatenated(parts):
    """The chunks' per-prompt arrays, each stacked in chunk order."""
    return tuple(np.concatenate(column) for column in zip(*parts))


# ---------------------------------------------------------------------------------------------
# §16 The lanes formulation: prompts on the last axis
# ---------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=64)
def symmetric_coordinates(D):
    """Index maps between a symmetric D x D matrix S and its U = D (D+1) / 2 distinct entries s
    (the upper triangle, row by row), for D >= 1. MATH.md §16.

    Returns (upper, full, E, diagonal), read-only:
        upper     (U,) positions of s in vec(S) (row-major):   s = vec(S)[upper]
        full      (D^2,) the entry of s at each position:       vec(S) = s[full]
        E         (D^2, U) 0/1 with vec(S) = E s; a kernel K acts on s as K E
        diagonal  (U,) bool, True where the entry is on the diagonal
    """
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


def kernel_forward(P_l, Q_l, n):
    """The layer's action on S as one matrix: vec(sum_h P_h S Q_h) / n = K vec(S) (row-major vec),
    K = (1/n) sum_h P_h kron Q_h^T, (D^2, D^2). P_l, Q_l: (H, D, D). MATH.md §16."""
    return sum(np.kron(P_h, Q_h.T) for P_h, Q_h in zip(P_l, Q_l)) / n


def kernel_backward(dK, P_l, Q_l, n):
    """Adjoint of kernel_forward: dK (D^2, D^2) -> dP_l, dQ_l (H, D, D).
    K[(i l), (j k)] = (1/n) sum_h P_h[i, j] Q_h[k, l]: product rule in P_h and in Q_h. MATH.md §16."""
    D = P_l.shape[-1]
    dK = dK.reshape(D, D, D, D) / n                              # indices [i, l, j, k]
    dP_l = np.stack([np.einsum("iljk,kl->ij", dK, Q_h) for Q_h in Q_l])
    dQ_l = np.stack([np.einsum("iljk,ij->kl", dK, P_h) for P_h in P_l])
    return dP_l, dQ_l


def _symmetric_product(X, Y):
    """The distinct entries s (U, b) of X Y^T, for stacks with the prompts last, X, Y (D, m, b),
    where X Y^T is known to be symmetric (T S T^T, T^T G T): its upper triangle row by row, written
    straight into s. MATH.md §16."""
    D, b = X.shape[0], X.shape[2]
    s = np.empty((D * (D + 1) // 2, b))
    start = 0
    for i in range(D):                  # row i of the upper triangle: s[start : start + D - i]
        np.einsum("jb,kjb->kb", X[i], Y[i:], out=s[start:start + D - i])
        start += D - i
    return s


def _symmetric_full(s, D):
    """The symmetric S (D, D, b) from its distinct entries s (U, b): one gather, so S is exactly
    symmetric. MATH.md §16."""
    return s.take(symmetric_coordinates(D)[1], axis=0).reshape(D, D, s.shape[-1])


def lanes_forward(K_s, S, s, q, last=False):
    """One layer with the prompts on the last axis: T = I + mat(K_s s), S' = T S T^T, q' = T q.

    K_s: (D^2, U) = K E, the layer's kernel on S's distinct entries; S: (D, D, b) symmetric and
    s (U, b) its distinct entries; q: (D, b). Returns S' (D, D, b), s' (U, b), q' (D, b) and the
    cache. The last layer (`last`) forms only the row d of T that the prediction reads: S' and s'
    are None and q' is (T q)_d, shape (b,). MATH.md §16.
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

    G is the adjoint of a symmetric S in full form, G = dS + dS^T (MATH.md §16): G_next (D, D, b),
    None for the last layer, whose dq_next is the adjoint of (T q)_d, shape (b,); otherwise dq_next
    is (D, b). Returns G (D, D, b) and dq (D, b), both None for the `first` layer (S_0, q_0 are
    data), and dK_s (D^2, U) = sum_b vec(dT_b) s_b^T; with per_prompt, dT (D, D, b) instead, each
    prompt's own adjoint of T, for the Jacobian.
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


def _lanes_bounds(B, D):
    """The lanes chunks: a multiple of 4 equal chunks of at most max(1, LANES_CHUNK / D^2) prompts
    each (each (D, D, b) array about 1 MB; equal chunks keep 2 or 4 workers equally busy). They
    depend on B and D only, never on the worker count."""
    count = 4 * -(-B // (4 * max(1, LANES_CHUNK // D ** 2)))
    return _bounds(B, -(-B // count))


def lanes_gram(Z, threads=1):
    """S_0 = Z M Z^T of prompts Z (B, D, n+1) formed with the prompts last, on `threads` workers: (B, D, D),
    a view of a (D, D, B) array, so that the lanes chunks read their S_0 as contiguous rows. Each
    chunk's context tokens are transposed to (D, n, b) and their products formed by the upper triangle
    (_symmetric_product), then mirrored: exactly symmetric. MATH.md §16."""
    B, D = Z.shape[:2]
    S = np.empty((D, D, B))

    def one_chunk(start, stop):         # writes its columns of S
        context = np.ascontiguousarray(Z[start:stop, :, :-1].transpose(1, 2, 0))
        S[:, :, start:stop] = _symmetric_full(_symmetric_product(context, context), D)

    _map(one_chunk, _lanes_bounds(B, D), threads)
    return S.transpose(2, 0, 1)


def _exponent(a):
    """The e of the power of two 2^e just above a's largest magnitude (0 for an all-zero a), kept
    within [-1022, 1023] so that 2^e and 2^-e are normal: multiplying by either is exact, and
    dividing by 2^e leaves the largest entry in [1/2, 1) unless it is below float64's normal range.
    (np.ldexp would take any exponent, at about 80 times a product's cost per entry.)"""
    top = float(max(a.max(), -a.min()))
    return min(max(math.frexp(top)[1], -1022), 1023) if top > 0 else 0


def _lanes_chunk(kernels, S0, q0, y, start, stop):
    """A chunk of the Gram form with the prompts last, through the layers' kernels (lanes_forward
    from S_0, s_0, q_0): its residuals r = (q_L)_d + y (b,), the layers' caches and the exponent e
    of the chunk's S_0. The layers carry S / 2^e and each kernel times 2^e: T - I = K_s s is the
    same, and the reverse pass forms dK_s = sum_b dT s^T at the scale of dT, not of dT S, which
    leaves float64's range at data scales where the gradient (about dT Q S, as icl_ref forms it)
    does not."""
    D = S0.shape[-1]
    S = np.array(S0[start:stop].transpose(1, 2, 0), order="C")      # a copy: scaled below, S0 stays the caller's
    e = _exponent(S)
    S *= 2.0 ** -e
    s, q = S.reshape(D * D, -1).take(symmetric_coordinates(D)[0], axis=0), np.ascontiguousarray(q0[start:stop].T)
    caches = []
    for l, (K_s, scale) in enumerate(kernels):
        S, s, q, cache = lanes_forward(np.ldexp(K_s, scale + e), S, s, q, last=l == len(kernels) - 1)
        caches.append(cache)
    return q + y[start:stop], caches, e


def _lanes_kernels(P, Q, n):
    """Each layer's kernel on S's distinct entries from P_l / 2^a and Q_l / 2^c (_exponent: the
    kernel's products neither under- nor overflow at any scale of P, Q), with a + c, so that
    K_s = K E = 2^(a + c) times it; and E."""
    E = symmetric_coordinates(P.shape[-1])[2]
    kernels = []
    for P_l, Q_l in zip(P, Q):
        a, c = _exponent(P_l), _exponent(Q_l)
        kernels.append((kernel_forward(np.ldexp(P_l, -a), np.ldexp(Q_l, -c), n) @ E, a + c))
    return kernels, E


@_one_blas_thread()      # also for the products outside the chunks (the kernels, their adjoints' sum)
def lanes_loss_and_grad_gram(P, Q, S0, q0, y, n, threads=1):
    """REFERENCE.loss_and_grad_gram in the lanes formulation on `threads` workers: (loss, dP, dQ).
    Each chunk's reverse pass is seeded with 2 r / B (the whole batch's B); the kernels' adjoints
    dK_s, each relative to its chunk's scale 2^e (_lanes_chunk), are brought to the largest chunk's
    scale and added over the chunks before kernel_backward, whose results take the scales back
    (powers of two: exact wherever the result is in float64's normal range). MATH.md §16."""
    B = y.shape[0]
    kernels, E = _lanes_kernels(P, Q, n)

    def one_chunk(start, stop):
        r, caches, e = _lanes_chunk(kernels, S0, q0, y, start, stop)
        G, dq, dKs = None, 2.0 * r / B, [None] * len(kernels)
        for l in reversed(range(len(kernels))):
            G, dq, dKs[l] = lanes_backward(G, dq, caches[l], first=l == 0)
        return float(r @ r) / B, dKs, e

    parts = _map(one_chunk, _lanes_bounds(B, P.shape[-1]), threads)
    top = max(part[2] for part in parts)
    dP, dQ = np.empty_like(P), np.empty_like(Q)
    for l, (P_l, Q_l) in enumerate(zip(P, Q)):
        dK = sum(np.ldexp(part[1][l], part[2] - top) for part in parts) @ E.T     # K_s = K E: dK = dK_s E^T
        a, c = _exponent(P_l), _exponent(Q_l)
        dP_l, dQ_l = kernel_backward(dK, np.ldexp(P_l, -a), np.ldexp(Q_l, -c), n)
        dP[l], dQ[l] = np.ldexp(dP_l, c + top), np.ldexp(dQ_l, a + top)
    return sum(part[0] for part in parts), dP, dQ


@_one_blas_thread()      # also for the products outside the chunks (the kernels)
def lanes_jacobian_gram(P, Q, S0, q0, y, n, threads=1):
    """REFERENCE.jacobian_gram in the lanes formulation on `threads` workers: r (B,), JP, JQ
    (B, L, H, D, D). The reverse pass seeded with dr_b/d(q_L)_d = 1 for every prompt, each prompt's
    dT kept: dr_b/dP_lh = (1/n) dT_b Q^T S_b, dr_b/dQ_lh = (1/n) S_b P^T dT_b, formed with the
    prompts last. MATH.md §3.1, §16."""
    kernels, _ = _lanes_kernels(P, Q, n)
    B, (L, H) = y.shape[0], P.shape[:2]
    r, JP, JQ = np.empty(B), np.empty((B,) + P.shape), np.empty((B,) + P.shape)

    def one_chunk(start, stop):         # writes its rows of r, JP and JQ
        r[start:stop], caches, e = _lanes_chunk(kernels, S0, q0, y, start, stop)
        G, dq, unit = None, np.ones(stop - start), 2.0 ** e         # the caches hold S_l / 2^e
        for l in reversed(range(L)):
            G, dq, dT = lanes_backward(G, dq, caches[l], first=l == 0, per_prompt=True)
            S_l = caches[l][1]
            for h in range(H):
                JP[start:stop, l, h] = np.einsum("ijb,kjb->bik", np.einsum("ijb,kj->ikb", dT, Q[l, h] / n), S_l) * unit
                JQ[start:stop, l, h] = np.einsum("ijb,jkb->bik", np.einsum("ijb,kj->ikb", S_l, P[l, h] / n), dT) * unit

    _map(one_chunk, _lanes_bounds(B, P.shape[-1]), threads)
    return r, JP, JQ


# ---------------------------------------------------------------------------------------------
# §16 The engine: icl_ref.REFERENCE's methods on the workers
# ---------------------------------------------------------------------------------------------

def _batch_first_bounds(B, D):
    """The chunks in which the workers run icl_ref's batch-first layers: a multiple of 4 equal
    chunks of at most max(1, 2^16 / D^2) prompts each (BATCH_FIRST_CHUNK; each chunk's (b, D, D)
    stacks about 512 KB). That is at least the reference's own 2^18 / D^3 wherever they run
    (D > LANES_MAX_D), so each of the layers' products, one Python call, covers many prompts and the
    interpreter time that the workers take in turn (the GIL) stays small beside the products; equal
    chunks keep 2 or 4 workers equally busy. They depend on B and D only, never on the worker count."""
    count = 4 * -(-B // (4 * max(1, BATCH_FIRST_CHUNK // D ** 2)))
    return _bounds(B, -(-B // count))


def batch_first_chunk(P, Q, S0, q0, y, n, start, stop, batch=None):
    """The prompts start:stop of the Gram form through icl_ref's public layers in one pass:
    layer_forward through the first L - 1 layers and readout_forward in the last, then back through
    readout_backward and layer_backward. With `batch`, the whole batch's size B: the reverse pass
    seeded with 2 r / B and summed over the chunk's prompts, returning the chunk's part
    (sum r^2 / B, dP, dQ) of (loss, dP, dQ). With batch None: each prompt's own reverse pass seeded
    with 1, returning (r (b,), JP, JQ (b, L, H, D, D)), the chunk's rows of the Jacobian.
    MATH.md §3, §3.1, §16."""
    S, q, caches = S0[start:stop], q0[start:stop], []
    for P_l, Q_l in zip(P[:-1], Q[:-1]):
        S, q, _, cache = ir.layer_forward(P_l, Q_l, S, q, n)
        caches.append(cache)
    out, cache = ir.readout_forward(P[-1], Q[-1], S, q, n)
    r, per_prompt = out + y[start:stop], batch is None              # r = Z_L[d, n] + y = y - y_hat
    dS, dq, dP_l, dQ_l = ir.readout_backward(np.ones_like(r) if per_prompt else 2.0 * r / batch, cache, per_prompt)
    dP, dQ = [dP_l], [dQ_l]
    for l in reversed(range(len(caches))):
        dS, dq, dP_l, dQ_l = ir.layer_backward(dS, dq, caches[l], need_dS=l > 0, per_prompt=per_prompt)
        dP.insert(0, dP_l)
        dQ.insert(0, dQ_l)
    axis = 1 if per_prompt else 0
    return r if per_prompt else float(r @ r) / batch, np.stack(dP, axis), np.stack(dQ, axis)


def batch_first_loss_and_grad_gram(P, Q, S0, q0, y, n, threads=1):
    """REFERENCE.loss_and_grad_gram through batch_first_chunk on `threads` workers: (loss, dP, dQ),
    each chunk's reverse pass seeded with 2 r / B (the whole batch's B) and the chunks' parts added
    in chunk order. MATH.md §3, §16."""
    B = y.shape[0]
    parts = _map(lambda a, b: batch_first_chunk(P, Q, S0, q0, y, n, a, b, batch=B),
                 _batch_first_bounds(B, P.shape[-1]), threads)
    return tuple(sum(part[i] for part in parts) for i in range(3))


def batch_first_jacobian_gram(P, Q, S0, q0, y, n, threads=1):
    """REFERENCE.jacobian_gram through batch_first_chunk on `threads` workers: r (B,), JP, JQ
    (B, L, H, D, D), the chunks' rows stacked in order. MATH.md §3.1, §16."""
    return _concatenated(_map(lambda a, b: batch_first_chunk(P, Q, S0, q0, y, n, a, b),
                              _batch_first_bounds(y.shape[0], P.shape[-1]), threads))


class _Engine:
    """The methods of icl_ref.REFERENCE, the same numbers on `threads` workers (see engine)."""

    def __init__(self, threads):
        self.threads = _thread_count(threads)

    def _gram_form(self, args, lanes, batch_first, max_D, min_work, lanes_cost_per_head):
        """An evaluation of the Gram form args = (P, Q, S0, q0, y, n) of B prompts: lanes(*args,
        threads=...) for D <= max_D, else batch_first(*args, threads=...); on the calling thread alone
        when its work is below min_work: B L H D^3 multiply-adds, or B L D^3 in lanes unless
        `lanes_cost_per_head` (the lanes loss forms one kernel of every head: its cost does not grow
        with H; the lanes Jacobian forms each head's rows)."""
        P, y = args[0], args[4]
        (L, H, D), B = P.shape[:3], y.shape[0]
        take_lanes = D <= max_D
        work = B * L * D ** 3 * (H if lanes_cost_per_head or not take_lanes else 1)
        threads = 1 if work < min_work else self.threads
        return (lanes if take_lanes else batch_first)(*args, threads=threads)

    def gram(self, Z):
        """S_0 = Z M Z^T (B, D, D): where both evaluations take lanes (D <= LANES_MAX_D_JACOBIAN),
        lanes_gram, its prompts last as the lanes chunks read them (REFERENCE.gram's many small BLAS
        products gain nothing from a second worker: 6.4 ms on two against 6.5 on one at B = 20000,
        D = 6; lanes_gram 4.1 on two); else REFERENCE.gram on chunks of 2^15 / D^2 prompts (each
        chunk's (b, D, D) in cache; one product per chunk)."""
        if Z.shape[1] <= min(LANES_MAX_D, LANES_MAX_D_JACOBIAN):
            return lanes_gram(Z, self.threads)
        bounds = _bounds(Z.shape[0], max(1, 2 ** 15 // Z.shape[1] ** 2))
        return np.concatenate(_map(lambda a, b: ir.REFERENCE.gram(Z[a:b]), bounds, self.threads))

    def loss_and_grad_gram(self, P, Q, S0, q0, y, n):
        """(loss, dP, dQ): lanes for D <= LANES_MAX_D, else icl_ref's batch-first layers on the chunks."""
        return self._gram_form((P, Q, S0, q0, y, n), lanes_loss_and_grad_gram, batch_first_loss_and_grad_gram,
                               LANES_MAX_D, PARALLEL_MIN_WORK, lanes_cost_per_head=False)

    def jacobian_gram(self, P, Q, S0, q0, y, n):
        """(r, JP, JQ): lanes for D <= LANES_MAX_D_JACOBIAN, else icl_ref's batch-first layers on the
        chunks."""
        return self._gram_form((P, Q, S0, q0, y, n), lanes_jacobian_gram, batch_first_jacobian_gram,
                               LANES_MAX_D_JACOBIAN, PARALLEL_MIN_WORK_JACOBIAN, lanes_cost_per_head=True)

    def activation_pass(self, P, Q, Z, y, activation, jacobian=False):
        """REFERENCE.activation_pass on chunks of 2^15 / (n+1)^2 prompts (their (b, n+1, n+1) score
        matrices in cache): (loss, dP, dQ) weighted by the chunks' shares and Z_L stacked, or with
        jacobian (r, JP, JQ, Z_L) stacked."""
        B = Z.shape[0]
        bounds = _bounds(B, max(1, 2 ** 15 // Z.shape[2] ** 2))
        parts = _map(lambda a, b: ir.REFERENCE.activation_pass(P, Q, Z[a:b], y[a:b], activation, jacobian),
                     bounds, self.threads)
        if jacobian:
            return _concatenated(parts)
        return (*_mean_of_chunks([part[:3] for part in parts], bounds, B), np.concatenate([part[3] for part in parts]))

    def reduced_least_squares(self, r, J):
        """REFERENCE.reduced_least_squares itself, on the calling thread: its blocks of rows keep BLAS
        on one thread, and the same factor split over the workers (a tall-skinny QR) measured slower
        (19 ms against 11 ms at 20000 x 76 on 2 cores) and rounded differently, which gave the
        trust region another path."""
        return ir.REFERENCE.reduced_least_squares(r, J)


def engine(threads=None):
    """The evaluator for icl_ref's `engine=` arguments: icl_ref.REFERENCE's five methods (gram,
    loss_and_grad_gram, jacobian_gram, activation_pass, reduced_least_squares), unchecked as
    REFERENCE's are, computing the same numbers on `threads` workers (an integer >= 1, capped at
    the cores this process may use; None: every core). MATH.md §16."""
    return _Engine(threads)


# ---------------------------------------------------------------------------------------------
# §16 icl_ref's public functions with the engine (rule (iv))
# ---------------------------------------------------------------------------------------------

def _with_engine(fn):
    """icl_ref's `fn` with `threads=` in place of `engine=`."""
    def call(*args, threads=None, **kwargs):
        fast = engine(threads)
        with _one_blas_thread():
            return fn(*args, engine=fast, **kwargs)
    call.__name__ = call.__qualname__ = fn.__name__
    call.__doc__ = (f"icl_ref.{fn.__name__}: the same arguments, checks and result, evaluated by engine(threads) "
                    "(threads: an integer >= 1, at most the cores; None: every core) with BLAS at one thread "
                    "throughout.")
    return call


(loss_and_grad, loss_and_grad_gram, residuals_and_jacobian, residuals_and_jacobian_gram, loss_and_grad_activation,
 identifiable_hessian, sandwich_covariance, train_lbfgs, train_gauss_newton) = map(_with_engine, (
    ir.loss_and_grad, ir.loss_and_grad_gram, ir.residuals_and_jacobian, ir.residuals_and_jacobian_gram,
    ir.loss_and_grad_activation, ir.identifiable_hessian, ir.sandwich_covariance, ir.train_lbfgs,
    ir.train_gauss_newton))
