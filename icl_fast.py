"""icl_fast: icl_ref's loss, gradient, Jacobian and trainers, computed faster: opt-in.

The same functions as icl_ref.py (loss_and_grad, loss_and_grad_gram, residuals_and_jacobian,
residuals_and_jacobian_gram, loss_and_grad_activation, identifiable_hessian, sandwich_covariance,
train_lbfgs, train_gauss_newton) with the same arguments and results, plus `threads=`. What makes them faster, and what importing this module
therefore accepts on the caller's behalf:

- the lanes formulation (MATH.md §3.2): a chunk of b prompts held as (D, D, b), so each prompt's
  small products are vector operations across the prompts, and the layer's kernel acts on S's
  D(D+1)/2 distinct entries;
- the batch in chunks on worker threads, one per core by default, kept between calls and bound one
  to a core (Linux) when there is one per core; `shutdown()` ends them;
- BLAS limited to one thread while an evaluation runs (the workers' own GEMMs would otherwise start
  BLAS threads that compete with the workers for the cores), restored when the last concurrent
  evaluation ends.

Results do not depend on the thread count (the chunks depend on B and D only and are added in
chunk order) and agree with icl_ref's to rounding (test_icl_fast.py). The input checks are
icl_ref's. Measurements: docs/benchmarks.md.
"""
import contextlib
import ctypes
import functools
import itertools
import os
import threading
import types
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import scipy.linalg
try:
    from threadpoolctl import ThreadpoolController
except ImportError as e:    # the optional dependency of the "fast" extra
    raise ImportError("icl_fast needs threadpoolctl: pip install icl_ref[fast]") from e

import icl_ref as ir

__version__ = "0.3.0"

# The largest D = d + 1 at which the loss, and apart from it the Jacobian, take the lanes
# formulation; above it the reference's batch-first layers (icl_ref.layer_forward) run on the
# workers, as their D^3 BLAS products beat D^3 vector loops there. Near the crossing either costs
# about the same, and where it lies moves a little between machines (docs/benchmarks.md records it;
# test_docs.py checks that neither choice is clearly the slower there).
LANES_MAX_D = 17
LANES_MAX_D_JACOBIAN = 7

# The smallest evaluation, in multiply-adds B L H D^3 of the layers' products, that the workers
# share, for the loss and apart from it the Jacobian; a smaller one runs its chunks on the calling
# thread, as handing chunks to the workers and collecting them has a fixed cost that exceeds what
# they save there (the same chunks either way; docs/benchmarks.md records both sides, test_docs.py
# checks that the choice is not clearly the slower).
PARALLEL_MIN_WORK = 2 ** 21
PARALLEL_MIN_WORK_JACOBIAN = 2 ** 19


# ---------------------------------------------------------------------------------------------
# Workers: chunks of prompts on the machine's cores, BLAS at one thread meanwhile
# ---------------------------------------------------------------------------------------------

def _cores():
    """The cores this process may use."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def _thread_count(threads):
    """Worker threads for one evaluation: `threads` (an integer >= 1, at most the cores) or, by
    default (None), every core this process may use."""
    cores = len(_cores())
    return cores if threads is None else min(ir._int("threads", threads, 1), cores)


def _workers(threads, P, B, min_work):
    """The thread count for an evaluation of B prompts with parameters P (L, H, D, D): one when its
    B L H D^3 multiply-adds are below min_work, else `threads` (MATH.md §3.2)."""
    count = _thread_count(threads)
    L, H, D = P.shape[0], P.shape[1], P.shape[-1]
    return 1 if B * L * H * D ** 3 < min_work else count


_BLAS = dict(lock=threading.Lock(), users=0, saved=None, libraries=None)


def _blas_libraries():
    """(get, set) of the thread count of every OpenBLAS in this process (numpy's and scipy's may be
    two), as their C functions, and a limiter of threadpoolctl's for any other BLAS. OpenBLAS is
    called directly: from threadpoolctl 3.8 on, only one Python thread at a time may change its
    limit through threadpoolctl, and an evaluation may start in any thread."""
    controller, openblas = ThreadpoolController(), []
    for info in controller.info():
        if info["internal_api"] != "openblas":
            continue
        library = ctypes.CDLL(info["filepath"])
        for prefix, suffix in itertools.product(("", "scipy_"), ("", "64_", "_64")):
            get = getattr(library, f"{prefix}openblas_get_num_threads{suffix}", None)
            put = getattr(library, f"{prefix}openblas_set_num_threads{suffix}", None)
            if get is not None and put is not None:
                openblas.append((get, put))
                break
    others = [c for c in controller.select(user_api="blas").lib_controllers if c.internal_api != "openblas"]
    return openblas, others


@contextlib.contextmanager
def _one_blas_thread():
    """BLAS at one thread inside; the setting found is restored when the last of the concurrent
    holders leaves. Entering and leaving are counted under one lock, so overlapping calls from
    several Python threads never restore a limit that another set (the setting is process-wide)."""
    with _BLAS["lock"]:
        if _BLAS["users"] == 0:
            if _BLAS["libraries"] is None:
                _BLAS["libraries"] = _blas_libraries()
            openblas, others = _BLAS["libraries"]
            _BLAS["saved"] = ([get() for get, _ in openblas], [c.get_num_threads() for c in others])
            for _, put in openblas:
                put(1)
            for c in others:
                c.set_num_threads(1)
        _BLAS["users"] += 1
    try:
        yield
    finally:
        with _BLAS["lock"]:
            _BLAS["users"] -= 1
            if _BLAS["users"] == 0:
                openblas, others = _BLAS["libraries"]
                for (_, put), count in zip(openblas, _BLAS["saved"][0]):
                    put(count)
                for c, count in zip(others, _BLAS["saved"][1]):
                    c.set_num_threads(count)
                _BLAS["saved"] = None


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
    """End the worker threads (they start again on the next call). Call it before os.fork() in a
    program that forks, or to leave a process with no threads of icl_fast's."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        pool.shutdown(wait=True)


def _forget_pools():
    """In a forked child: the parent's pools have no threads here, and the locks may have been held
    by another of the parent's threads at the fork, so all start anew."""
    global _POOLS_LOCK
    _POOLS.clear()
    _POOLS_LOCK = threading.Lock()
    _BLAS.update(lock=threading.Lock(), users=0, saved=None)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)


def _map_chunks(fn, bounds, threads):
    """[fn(start, stop) for (start, stop) in bounds], in that order, on `threads` workers (default:
    every core) with BLAS at one thread. Each worker claims the next chunk from a shared counter;
    an error or a Ctrl-C stops the claiming (the chunks already running finish). The results come
    back in chunk order, so sums over them do not depend on the thread count."""
    workers = min(_thread_count(threads), len(bounds))
    err = np.geterr()                       # the caller's errstate: worker threads do not inherit it
    with _one_blas_thread():
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


def _sum_parts(parts, k):
    """The first k entries of the chunks' results, each added in chunk order."""
    return tuple(sum(part[i] for part in parts) for i in range(k))


# ---------------------------------------------------------------------------------------------
# The lanes formulation: prompts on the last axis (MATH.md §3.2)
# ---------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=64)
def symmetric_coordinates(D):
    """Index maps between a symmetric D x D matrix S and its U = D (D+1) / 2 distinct entries s
    (the upper triangle, row by row). MATH.md §3.2.

    Returns (upper, full, E, diagonal), read-only:
        upper     (U,) positions of s in vec(S) (row-major):   s = vec(S)[upper]
        full      (D^2,) the entry of s at each position:       vec(S) = s[full]
        E         (D^2, U) 0/1 with vec(S) = E s; a kernel K acts on s as K E
        diagonal  (U,) bool, True where the entry is on the diagonal
    """
    D = ir._int("D", D, 1)
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
    K = (1/n) sum_h P_h kron Q_h^T, (D^2, D^2). P_l, Q_l: (H, D, D). MATH.md §3.2."""
    return sum(np.kron(P_h, Q_h.T) for P_h, Q_h in zip(P_l, Q_l)) / n


def kernel_backward(dK, P_l, Q_l, n):
    """Adjoint of kernel_forward: dK (D^2, D^2) -> dP_l, dQ_l (H, D, D).
    K[(i l), (j k)] = (1/n) sum_h P_h[i, j] Q_h[k, l]: product rule in P_h and in Q_h. MATH.md §3.2."""
    D = P_l.shape[-1]
    dK = dK.reshape(D, D, D, D) / n                              # indices [i, l, j, k]
    dP_l = np.stack([np.einsum("iljk,kl->ij", dK, Q_h) for Q_h in Q_l])
    dQ_l = np.stack([np.einsum("iljk,ij->kl", dK, P_h) for P_h in P_l])
    return dP_l, dQ_l


def _symmetric_product(X, Y):
    """The distinct entries s (U, b) of X Y^T, for stacks with the prompts last, X, Y (D, m, b),
    where X Y^T is known to be symmetric (Z M Z^T, T S T^T, T^T G T): its upper triangle row by
    row, written straight into s. MATH.md §3.2."""
    D, b = X.shape[0], X.shape[2]
    s = np.empty((D * (D + 1) // 2, b))
    start = 0
    for i in range(D):                  # row i of the upper triangle: s[start : start + D - i]
        np.einsum("jb,kjb->kb", X[i], Y[i:], out=s[start:start + D - i])
        start += D - i
    return s


def _symmetric_full(s, D):
    """The symmetric S (D, D, b) from its distinct entries s (U, b): one gather, so S is exactly
    symmetric. MATH.md §3.2."""
    return s.take(symmetric_coordinates(D)[1], axis=0).reshape(D, D, s.shape[-1])


def lanes_gram(Zt):
    """S = Z M Z^T with the prompts on the last axis: Zt (D, n+1, b) -> (S (D, D, b), s (U, b)),
    S_ij = sum_{t<n} Z_it Z_jt (the query column t = n left out). MATH.md §3.2."""
    context = Zt[:, :-1]
    s = _symmetric_product(context, context)
    return _symmetric_full(s, Zt.shape[0]), s


def lanes_forward(K_s, S, s, q, last=False):
    """One layer with the prompts on the last axis: T = I + mat(K_s s), S' = T S T^T, q' = T q.

    K_s: (D^2, U) = K E, the layer's kernel on S's distinct entries; S: (D, D, b) symmetric and
    s (U, b) its distinct entries; q: (D, b). Returns S' (D, D, b), s' (U, b), q' (D, b) and the
    cache. The last layer (`last`) forms only the row d of T that the prediction reads: S' and s'
    are None and q' is (T q)_d, shape (b,). MATH.md §3.2.
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
    """The lanes chunks: a multiple of 4 equal chunks near 2^16 / D^2 prompts each (each (D, D, b)
    array about 512 KB, in cache; equal chunks keep 2 or 4 workers equally busy). They depend on B
    and D only, never on the worker count."""
    count = 4 * -(-B // (4 * max(1, 2 ** 16 // D ** 2)))
    size = -(-B // count)
    return [(c, min(c + size, B)) for c in range(0, B, size)]


def _lanes_propagate(Ks, S, s, q):
    """lanes_forward through the layers' kernels K_s from S_0, s_0, q_0; returns (q_L)_d (b,) and
    the caches."""
    caches = []
    for l, K_s in enumerate(Ks):
        S, s, q, cache = lanes_forward(K_s, S, s, q, last=l == len(Ks) - 1)
        caches.append(cache)
    return q, caches


def _gram_reader(S0, q0):
    """(start, stop) -> the chunk's S_0 (D, D, b), s_0 (U, b) and q_0 (D, b), prompts last (copies)."""
    D = S0.shape[-1]
    upper = symmetric_coordinates(D)[0]

    def read(start, stop):
        S = np.ascontiguousarray(S0[start:stop].transpose(1, 2, 0))
        return S, S.reshape(D * D, -1).take(upper, axis=0), np.ascontiguousarray(q0[start:stop].T)
    return read


def _prompt_reader(Z):
    """(start, stop) -> the chunk's S_0, s_0, q_0 from the prompts themselves, prompts last: each
    worker checks its chunk of Z for NaN and Inf and forms its Gram product (MATH.md §3.2)."""
    n = Z.shape[2] - 1

    def read(start, stop):
        ir._finite_entries("Z", Z[start:stop])
        Zt = Z[start:stop].transpose(1, 2, 0)                    # a view: lanes_gram reads Z in place
        return (*lanes_gram(Zt), np.ascontiguousarray(Zt[:, n]))
    return read


def _lanes_loss_and_grad(P, Q, read, y, n, threads):
    """loss_and_grad_gram in the lanes formulation (MATH.md §3.2); read(start, stop) gives a chunk's
    S_0, s_0, q_0 with the prompts last."""
    B, D = y.shape[0], P.shape[-1]
    E = symmetric_coordinates(D)[2]
    Ks = [kernel_forward(P_l, Q_l, n) @ E for P_l, Q_l in zip(P, Q)]      # K_s = K E

    def one_chunk(start, stop):
        q, caches = _lanes_propagate(Ks, *read(start, stop))
        r = q + y[start:stop]                             # q = Z_L[d, n]: r = y - y_hat
        G, dq, dKs = None, 2.0 * r / B, [None] * len(Ks)  # every chunk divides by the whole B
        for l in reversed(range(len(Ks))):
            G, dq, dKs[l] = lanes_backward(G, dq, caches[l], first=l == 0)
        return float(r @ r) / B, dKs

    parts = _map_chunks(one_chunk, _lanes_bounds(B, D), threads)
    dP, dQ = np.empty_like(P), np.empty_like(Q)
    for l, (P_l, Q_l) in enumerate(zip(P, Q)):
        dK = sum(part[1][l] for part in parts) @ E.T     # K_s = K E: dK = dK_s E^T
        dP[l], dQ[l] = kernel_backward(dK, P_l, Q_l, n)
    return sum(part[0] for part in parts), dP, dQ


def _lanes_jacobian(P, Q, read, y, n, structure, threads):
    """residuals_and_jacobian_gram in the lanes formulation (MATH.md §3.1, §3.2): the reverse pass
    seeded with dr_b/d(q_L)_d = 1 for every prompt, each prompt's dT kept, the rows formed with the
    prompts last and written to (b, L, H, D, D)."""
    B, D = y.shape[0], P.shape[-1]
    L, H = P.shape[:2]
    E = symmetric_coordinates(D)[2]
    Ks = [kernel_forward(P_l, Q_l, n) @ E for P_l, Q_l in zip(P, Q)]

    def one_chunk(start, stop):
        q, caches = _lanes_propagate(Ks, *read(start, stop))
        r = q + y[start:stop]
        JP, JQ = np.empty((2, len(r)) + P.shape)
        G, dq = None, np.ones(len(r))                     # dr_b / d(q_L)_d = 1, prompt by prompt
        for l in reversed(range(L)):
            G, dq, dT = lanes_backward(G, dq, caches[l], first=l == 0, per_prompt=True)
            S_l = caches[l][1]
            for h in range(H):      # dr_b/dP_lh = (1/n) dT_b Q^T S_b, dr_b/dQ_lh = (1/n) S_b P^T dT_b
                JP[:, l, h] = np.einsum("ijb,kjb->bik", np.einsum("ijb,kj->ikb", dT, Q[l, h] / n), S_l)
                JQ[:, l, h] = np.einsum("ijb,jkb->bik", np.einsum("ijb,kj->ikb", S_l, P[l, h] / n), dT)
        return r, ir._jacobian_rows(structure, JP, JQ)

    parts = _map_chunks(one_chunk, _lanes_bounds(B, D), threads)
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


# ---------------------------------------------------------------------------------------------
# What the trainers evaluate with (icl_ref's engine protocol), unchecked
# ---------------------------------------------------------------------------------------------

def _batch_first_bounds(B, D):
    """(start, stop) of the chunks of 2^15 / D^2 prompts in which the workers run the reference's
    batch-first layers: larger than icl_ref's own (2^18 / D^3, kept small so that OpenBLAS never
    starts threads), as BLAS is held at one thread here and fewer chunks cost less Python."""
    size = max(1, 2 ** 15 // D ** 2)
    return [(c, min(c + size, B)) for c in range(0, B, size)]


def _loss_and_grad_gram(P, Q, S0, q0, y, n, threads=None):
    """icl_ref._loss_and_grad_gram on the workers (on the calling thread below PARALLEL_MIN_WORK):
    lanes for D <= LANES_MAX_D, else the reference's batch-first layers in chunks of
    _batch_first_bounds."""
    B, D = y.shape[0], P.shape[-1]
    threads = _workers(threads, P, B, PARALLEL_MIN_WORK)
    if D <= LANES_MAX_D:
        return _lanes_loss_and_grad(P, Q, _gram_reader(S0, q0), y, n, threads)
    parts = _map_chunks(lambda a, b: ir._loss_and_grad_chunk(P, Q, S0[a:b], q0[a:b], y[a:b], n, B),
                        _batch_first_bounds(B, D), threads)
    return _sum_parts(parts, 3)


def _residuals_and_jacobian_gram(P, Q, S0, q0, y, n, structure, threads=None):
    """icl_ref._residuals_and_jacobian_gram on the workers (on the calling thread below
    PARALLEL_MIN_WORK_JACOBIAN): lanes for D <= LANES_MAX_D_JACOBIAN."""
    threads = _workers(threads, P, y.shape[0], PARALLEL_MIN_WORK_JACOBIAN)
    if P.shape[-1] <= LANES_MAX_D_JACOBIAN:
        return _lanes_jacobian(P, Q, _gram_reader(S0, q0), y, n, structure, threads)
    parts = _map_chunks(lambda a, b: ir._residuals_and_jacobian_chunk(P, Q, S0[a:b], q0[a:b], y[a:b], n,
                                                                      structure),
                        _batch_first_bounds(y.shape[0], P.shape[-1]), threads)
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def _activation_pass(P, Q, Z, y, activation, jacobian=False, threads=None):
    """icl_ref._activation_pass with its chunks on the workers."""
    B = Z.shape[0]
    parts = _map_chunks(lambda a, b: ir._activation_chunk(P, Q, Z[a:b], y[a:b], B, activation, jacobian),
                        ir._activation_bounds(B, Z.shape[2]), threads)
    return ir._combine_activation_parts(parts, jacobian)


def _reduced_least_squares(r, J, threads=None):
    """icl_ref._reduced_least_squares as a tall-skinny QR: the triangular factors of blocks of
    max(2000, 4 (p+1)) rows on the workers, then the factor of their stack (the same R up to row
    signs, which f shares; MATH.md §6)."""
    B, p = J.shape
    A = np.column_stack([J, r])
    rows = max(2000, 4 * (p + 1))
    blocks = _map_chunks(lambda a, b: scipy.linalg.qr(A[a:b], mode="r", check_finite=False)[0][:p + 1],
                         [(c, min(c + rows, B)) for c in range(0, B, rows)], threads)
    with _one_blas_thread():
        top = scipy.linalg.qr(np.vstack(blocks), mode="r", check_finite=False)[0][:p + 1]
    R_aug = np.zeros((p + 1, p + 1))
    R_aug[:len(top)] = top
    return R_aug[:, p], R_aug[:, :p]


def engine(threads=None):
    """The evaluators that icl_ref's trainers take as `engine=`: icl_fast's, on `threads` workers."""
    _thread_count(threads)
    return types.SimpleNamespace(
        loss_and_grad_gram=functools.partial(_loss_and_grad_gram, threads=threads),
        residuals_and_jacobian_gram=functools.partial(_residuals_and_jacobian_gram, threads=threads),
        activation_pass=functools.partial(_activation_pass, threads=threads),
        reduced_least_squares=functools.partial(_reduced_least_squares, threads=threads))


# ---------------------------------------------------------------------------------------------
# icl_ref's public functions, checked as icl_ref checks them
# ---------------------------------------------------------------------------------------------

def loss_and_grad_gram(P, Q, S0, q0, y, n, threads=None):
    """icl_ref.loss_and_grad_gram on `threads` workers (default: every core)."""
    P, Q, S0, q0, y, n = ir._gram_args("loss_and_grad_gram", P, Q, S0, q0, y, n)
    _thread_count(threads)
    with np.errstate(over="ignore", invalid="ignore"):
        loss, dP, dQ = _loss_and_grad_gram(P, Q, S0, q0, y, n, threads)
    for what, value in (("the loss", loss), ("dP", dP), ("dQ", dQ)):
        ir._finite_result(what, value, P=P, Q=Q, S0=S0)
    return loss, dP, dQ


def loss_and_grad(P, Q, Z, y, threads=None):
    """icl_ref.loss_and_grad on `threads` workers (default: every core). With lanes each worker
    forms its chunk's Gram product and checks that chunk of Z for NaN and Inf."""
    P, Q = ir._params(P, Q)
    lanes = P.shape[-1] <= LANES_MAX_D
    Z = ir._prompts(Z, P.shape[2], finite=not lanes)
    y = ir._labels(y, Z.shape[0])
    _thread_count(threads)
    n = Z.shape[2] - 1
    with np.errstate(over="ignore", invalid="ignore"):
        if lanes:
            loss, dP, dQ = _lanes_loss_and_grad(P, Q, _prompt_reader(Z), y, n,
                                                _workers(threads, P, Z.shape[0], PARALLEL_MIN_WORK))
        else:
            loss, dP, dQ = _loss_and_grad_gram(P, Q, ir.gram(Z), np.ascontiguousarray(Z[:, :, n]), y, n, threads)
    for what, value in (("the loss", loss), ("dP", dP), ("dQ", dQ)):
        ir._finite_result(what, value, P=P, Q=Q, Z=Z)
    return loss, dP, dQ


def residuals_and_jacobian_gram(P, Q, S0, q0, y, n, structure="full", threads=None):
    """icl_ref.residuals_and_jacobian_gram on `threads` workers (default: every core)."""
    ir._check_structure(structure)
    P, Q, S0, q0, y, n = ir._gram_args("residuals_and_jacobian_gram", P, Q, S0, q0, y, n)
    ir._check_structure_of(structure, P, Q)
    _thread_count(threads)
    with np.errstate(over="ignore", invalid="ignore"):
        r, J = _residuals_and_jacobian_gram(P, Q, S0, q0, y, n, structure, threads)
    ir._finite_result("the residuals", r, P=P, Q=Q, S0=S0)
    ir._finite_result("the Jacobian", J, P=P, Q=Q, S0=S0)
    return r, J


def residuals_and_jacobian(P, Q, Z, y, structure="full", activation="linear", threads=None):
    """icl_ref.residuals_and_jacobian on `threads` workers (default: every core)."""
    ir._check_structure(structure)
    ir._check_activation(activation)
    P, Q = ir._params(P, Q)
    ir._check_structure_of(structure, P, Q)
    Z = ir._prompts(Z, P.shape[2])
    y = ir._labels(y, Z.shape[0])
    _thread_count(threads)
    n = Z.shape[2] - 1
    with np.errstate(over="ignore", invalid="ignore"):
        if activation == "linear":
            r, J = _residuals_and_jacobian_gram(P, Q, ir.gram(Z), np.ascontiguousarray(Z[:, :, n]), y, n,
                                                structure, threads)
        else:
            r, JP, JQ = _activation_pass(P, Q, Z, y, activation, jacobian=True, threads=threads)[:3]
            J = ir._jacobian_rows(structure, JP, JQ)
    ir._finite_result("the residuals", r, P=P, Q=Q, Z=Z)
    ir._finite_result("the Jacobian", J, P=P, Q=Q, Z=Z)
    return r, J


def loss_and_grad_activation(P, Q, Z, y, activation="relu", threads=None):
    """icl_ref.loss_and_grad_activation on `threads` workers (default: every core)."""
    ir._check_activation(activation)
    P, Q = ir._params(P, Q)
    Z = ir._prompts(Z, P.shape[2])
    y = ir._labels(y, Z.shape[0])
    _thread_count(threads)
    with np.errstate(over="ignore", invalid="ignore"):
        loss, dP, dQ, _ = _activation_pass(P, Q, Z, y, activation, threads=threads)
    for what, value in (("the loss", loss), ("dP", dP), ("dQ", dQ)):
        ir._finite_result(what, value, P=P, Q=Q, Z=Z)
    return loss, dP, dQ


def sandwich_covariance(*args, threads=None, **kwargs):
    """icl_ref.sandwich_covariance (same arguments and result) evaluating on `threads` workers."""
    fast = engine(threads)
    with _one_blas_thread():
        return ir.sandwich_covariance(*args, engine=fast, **kwargs)


def identifiable_hessian(*args, threads=None, **kwargs):
    """icl_ref.identifiable_hessian (same arguments and result) evaluating on `threads` workers."""
    fast = engine(threads)
    with _one_blas_thread():
        return ir.identifiable_hessian(*args, engine=fast, **kwargs)


def train_lbfgs(*args, threads=None, **kwargs):
    """icl_ref.train_lbfgs (same arguments and result) evaluating on `threads` workers (default:
    every core), with BLAS at one thread for the whole run."""
    fast = engine(threads)
    with _one_blas_thread():
        return ir.train_lbfgs(*args, engine=fast, **kwargs)


def train_gauss_newton(*args, threads=None, **kwargs):
    """icl_ref.train_gauss_newton (same arguments and result) evaluating on `threads` workers
    (default: every core), with BLAS at one thread for the whole run."""
    fast = engine(threads)
    with _one_blas_thread():
        return ir.train_gauss_newton(*args, engine=fast, **kwargs)
