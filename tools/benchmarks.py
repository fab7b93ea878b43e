"""Measure icl_ref and icl_fast and write the record docs/benchmarks.json, shown as docs/benchmarks.md.

    python3 tools/benchmarks.py [--out docs/benchmarks.json] [--repeats 7]

The record holds every table with its note, the machine and its provenance (tools/records.py: the
commit of the code measured, the versions); docs/benchmarks.md and README's speed figures are rendered
from it by `python3 tools/records.py render`, which this script runs when it writes the record in docs/.
Exit status: 0 written (and rendered), 2 bad arguments or the record's file refused (a symbolic link).

Run it as a user runs the library: a plain `python3` process, no environment variables, an
otherwise idle machine. It takes about 20 minutes on 2 cores. torch and jax are optional
measurement tools (`pip install torch==2.13.0 jax jaxlib`): when importable, the first table also
times a PyTorch and a JAX implementation of the same loss and gradient written here in the layer's
Gram form (MATH.md §2; autodiff), the fastest form a user of those libraries would write.

Tables:
1. loss_and_grad at n = 20, L = 3, d = 1 .. 40, B = 2000 and 20000: icl_ref, icl_fast (every core)
   and, at a few d, the peers, with the largest relative gradient difference from icl_ref.
2. icl_fast's formulation choice: lanes against icl_ref's batch-first layers on the workers, for the loss
   and the Jacobian, d = 1 .. 20 (where LANES_MAX_D and LANES_MAX_D_JACOBIAN come from).
3. icl_fast's lanes chunks: the loss and the Jacobian at B = 20000 with LANES_CHUNK at 2^16, 2^17, 2^18
   (where LANES_CHUNK comes from).
4. icl_fast's workers against the calling thread alone for small evaluations, on both sides of
   PARALLEL_MIN_WORK and PARALLEL_MIN_WORK_JACOBIAN.
5. Training at the paper's size with both modules.
6. The reference in a plain process against the same run with OPENBLAS_NUM_THREADS=1 (alternating
   runs in fresh processes): the reference starts no BLAS threads, so the two should match.
7. icl_fast on one worker and on every core at the two d where a speed against the peers is asked
   (d = 5 and 20): one worker's time over the cores is the least that splitting the same work could
   reach, set beside the times asked.
"""
import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

import icl_fast as fast  # noqa: E402  (after the path)
import icl_ref as ir  # noqa: E402
import records  # noqa: E402  (tools/records.py: the provenance and the rendering)

SOURCES = ["icl_ref.py", "icl_fast.py", "tools/benchmarks.py"]   # the code measured and the measuring code
RECORD = os.path.join("docs", "benchmarks.json")

B, N, L = 20000, 20, 3


def problem(d, seed=0, L=L, B=B):
    """The paper's data at dimension d (eigenvalues 1, 1, 1/4, 1/16, 1 repeated), w* ~ N(0, Sigma^-1),
    and P, Q ~ 0.1 N(0, 1)."""
    rng = np.random.default_rng(seed)
    Sigma, _ = ir.rotated_covariance(rng, np.resize(ir.PAPER_EIGENVALUES, d))
    Z, y = ir.sample_prompts(rng, B, N, Sigma, np.linalg.inv(Sigma))
    P, Q = 0.1 * rng.standard_normal((2, L, 1, d + 1, d + 1))
    return P, Q, Z, y


def median_seconds(f, repeats):
    f()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def torch_peer():
    """loss_and_grad by torch autograd, or None: the layer in its Gram form Z + (1/n) sum_h P_h S Q_h Z,
    S = Z M Z^T (MATH.md §2), the fastest form to write in a tensor library (no (n+1) x (n+1) scores)."""
    try:
        import torch
    except ImportError:
        return None

    def loss_and_grad(P, Q, Z, y):
        P_t = torch.tensor(P, requires_grad=True)
        Q_t = torch.tensor(Q, requires_grad=True)
        Zt, yt = torch.tensor(Z), torch.tensor(y)
        n = Z.shape[2] - 1
        for l in range(P.shape[0]):
            keys = Zt[:, :, :n]
            S = keys @ keys.transpose(1, 2)
            Zt = Zt + sum(P_t[l, h] @ S @ Q_t[l, h] for h in range(P.shape[1])) @ Zt / n
        loss = torch.mean((Zt[:, -1, -1] + yt) ** 2)
        loss.backward()
        return loss.item(), P_t.grad.numpy(), Q_t.grad.numpy()
    return f"torch {torch.__version__}, {torch.get_num_threads()} threads", loss_and_grad


def jax_peer():
    """The same with jax.value_and_grad under jit, float64, or None."""
    try:
        import jax
        jax.config.update("jax_enable_x64", True)
        import jax.numpy as jnp
    except ImportError:
        return None

    def loss(P, Q, Z, y):
        n = Z.shape[2] - 1
        for l in range(P.shape[0]):
            keys = Z[:, :, :n]
            S = keys @ jnp.swapaxes(keys, 1, 2)
            Z = Z + sum(P[l, h] @ S @ Q[l, h] for h in range(P.shape[1])) @ Z / n
        return jnp.mean((Z[:, -1, -1] + y) ** 2)
    value_and_grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

    def loss_and_grad(P, Q, Z, y):
        value, (dP, dQ) = value_and_grad(P, Q, Z, y)
        return float(value), np.asarray(dP), np.asarray(dQ)
    return f"jax {jax.__version__}", loss_and_grad


def interleaved_medians(runs, repeats, calls=1, budget=None):
    """Each run's median seconds per call over `repeats` rounds, the runs timed in turn within a
    round (the machine's drift falls on all of them alike), each time the mean of `calls` calls;
    one warm-up call each first. With a budget (seconds), min(3, repeats) rounds when the first
    round shows that `repeats` rounds would exceed it."""
    times = [[] for _ in runs]
    for run in runs:
        run()
    rounds = repeats
    while len(times[0]) < rounds:
        for run, t in zip(runs, times):
            start = time.perf_counter()
            for _ in range(calls):
                run()
            t.append((time.perf_counter() - start) / calls)
        if budget is not None and len(times[0]) == 1 and sum(t[0] for t in times) * calls * repeats > budget:
            rounds = min(3, repeats)
    return [statistics.median(t) for t in times]


BATCHES, DS = (2000, B), range(1, 41)     # table 1's batch sizes and dimensions
PEER_DS = (1, 2, 5, 10, 20, 30, 40)      # the dimensions at which the peers are timed too
BUDGET_S = 10.0                          # the time one (B, d) may take before its rounds drop to 3


def table_loss_and_grad(repeats):
    """loss_and_grad over DS (d = 1 .. 40) at BATCHES (B = 2000, 20000): icl_ref, icl_fast and, at PEER_DS, the
    peers, timed in turn within each round (the machine's drift falls on all of them alike)."""
    peers = [p for p in (torch_peer(), jax_peer()) if p is not None]
    names = [name.split()[0] for name, _ in peers]
    head = ["B", "d", "icl_ref s", "icl_fast s"] + [f"{name} s" for name in names] + ["icl_fast / icl_ref"]
    head += [f"icl_ref / {name}" for name in names] + [f"icl_fast / {name}" for name in names]
    head += ["max rel grad diff"]
    rows = []
    for batch in BATCHES:
        for d in DS:
            P, Q, Z, y = problem(d, B=batch)
            ref = ir.loss_and_grad(P, Q, Z, y)
            diffs = [np.max(np.abs(g - r)) / np.max(np.abs(r)) for g, r in zip(fast.loss_and_grad(P, Q, Z, y)[1:], ref[1:])]
            t_ref, t_fast = interleaved_medians([lambda: ir.loss_and_grad(P, Q, Z, y),
                                                 lambda: fast.loss_and_grad(P, Q, Z, y)], repeats, budget=BUDGET_S)
            t_peers = [None] * len(peers)
            if d in PEER_DS:            # after icl_ref and icl_fast: the peers' threads keep spinning after a call
                t_peers = interleaved_medians([lambda f=f: f(P, Q, Z, y) for _, f in peers], repeats, budget=BUDGET_S)
                for _, f in peers:
                    diffs += [np.max(np.abs(g - r)) / np.max(np.abs(r)) for g, r in zip(f(P, Q, Z, y)[1:], ref[1:])]
            show = lambda t, digits=4: "-" if t is None else f"{t:.{digits}f}"
            rows.append([batch, d, show(t_ref), show(t_fast)] + [show(t) for t in t_peers] + [f"{t_fast / t_ref:.2f}"]
                        + [show(t and t_ref / t, 2) for t in t_peers] + [show(t and t_fast / t, 2) for t in t_peers]
                        + [f"{max(diffs):.1e}"])
            print(" ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
    note = ("n = 20, L = 3, one head, P, Q ~ 0.1 N(0, 1); icl_fast on every core; icl_ref and icl_fast timed in "
            "turn within each round, then the peers likewise, one warm-up call each, then the median of {} rounds "
            "({} once the first round shows that {} would take over {:.0f} s). Peers, at d = {}: {}. The gradient "
            "difference is the largest max|a - b| / max|b| of any implementation against icl_ref.").format(
                repeats, min(3, repeats), repeats, BUDGET_S, ", ".join(map(str, PEER_DS)),
                ", ".join(name for name, _ in peers) or "none importable")
    return "loss_and_grad", head, rows, note


def formulation(which, method, args):
    """engine(None).method(*args) with the engine's choice of formulation forced to `which` ("lanes"
    or "batch-first": icl_ref's layers on the engine's chunks) through its public thresholds."""
    saved = fast.LANES_MAX_D, fast.LANES_MAX_D_JACOBIAN
    fast.LANES_MAX_D = fast.LANES_MAX_D_JACOBIAN = 10 ** 6 if which == "lanes" else 0
    try:
        return getattr(fast.engine(None), method)(*args)
    finally:
        fast.LANES_MAX_D, fast.LANES_MAX_D_JACOBIAN = saved


def table_formulations(repeats):
    """icl_fast's lanes against icl_ref's batch-first layers on the same workers, the four
    timed in turn within each repeat (the machine's drift falls on all of them alike)."""
    head = ["d", "loss: lanes s", "loss: batch-first s", "Jacobian: lanes s", "Jacobian: batch-first s"]
    rows = []
    for d in range(1, 21):
        P, Q, Z, y = problem(d)
        n, k = N, 5000                                # the Jacobian on 5000 prompts (B p floats)
        args = (P, Q, ir.gram(Z), np.ascontiguousarray(Z[:, :, n]), y, n)
        args_k = (P, Q, args[2][:k], args[3][:k], y[:k], n)
        runs = [lambda: formulation("lanes", "loss_and_grad_gram", args),
                lambda: formulation("batch-first", "loss_and_grad_gram", args),
                lambda: formulation("lanes", "jacobian_gram", args_k),
                lambda: formulation("batch-first", "jacobian_gram", args_k)]
        rows.append([d] + [f"{t:.4f}" for t in interleaved_medians(runs, repeats)])
    note = (f"The loss at B = 20000 and the Jacobian (full P, Q) at B = 5000, n = 20, L = 3, on every core; "
            f"median of {repeats}; batch-first: icl_ref's layers on each of the engine's chunks "
            f"(batch_first_chunk). icl_fast takes lanes for the loss up to d = {fast.LANES_MAX_D - 1} and for the "
            f"Jacobian up to d = {fast.LANES_MAX_D_JACOBIAN - 1} (MATH.md §16).")
    return "icl_fast's formulations", head, rows, note


LANES_CHUNKS = (2 ** 16, 2 ** 17, 2 ** 18)     # the sizes icl_fast.LANES_CHUNK is measured at


def lanes_chunk(size, method, args):
    """engine(None).method(*args) with the lanes chunks of LANES_CHUNK = size (icl_fast's constant)."""
    saved, fast.LANES_CHUNK = fast.LANES_CHUNK, size
    try:
        return getattr(fast.engine(None), method)(*args)
    finally:
        fast.LANES_CHUNK = saved


def table_lanes_chunks(repeats):
    """icl_fast's lanes loss (d = 1 .. 10) and Jacobian (d = 1 .. 6) at B = 20000 with the lanes chunks of
    each of LANES_CHUNKS, timed in turn within each repeat."""
    head = ["d", "what"] + [f"LANES_CHUNK = 2^{size.bit_length() - 1} s" for size in LANES_CHUNKS]
    rows = []
    for what, method, top in (("loss", "loss_and_grad_gram", fast.LANES_MAX_D),
                              ("Jacobian", "jacobian_gram", fast.LANES_MAX_D_JACOBIAN)):
        for d in range(1, top):
            P, Q, Z, y = problem(d)
            S0 = fast.engine(None).gram(Z)                                 # laid out as icl_fast lays it out
            args = (P, Q, S0, np.ascontiguousarray(Z[:, :, N]), y, N)
            runs = [lambda size=size: lanes_chunk(size, method, args) for size in LANES_CHUNKS]
            rows.append([d, what] + [f"{t:.4f}" for t in interleaved_medians(runs, repeats)])
    note = (f"The lanes formulation at B = 20000, n = 20, L = 3, full P, Q, on every core (an evaluation below "
            f"PARALLEL_MIN_WORK or PARALLEL_MIN_WORK_JACOBIAN on the calling thread: MATH.md §16 (v)); median of {repeats}. "
            f"icl_fast takes LANES_CHUNK = 2^{fast.LANES_CHUNK.bit_length() - 1}: chunks of at most "
            "LANES_CHUNK / D^2 prompts, a multiple of 4 of them (MATH.md §16).")
    return "icl_fast's lanes chunks", head, rows, note


WORKER_CASES = [(3, 1, 1, 2000), (3, 1, 1, 20000), (5, 1, 2, 1000), (5, 1, 2, 2000), (5, 1, 2, 5000),
                (5, 3, 1, 250), (5, 3, 1, 500), (5, 3, 1, 1000), (5, 3, 1, 2000), (5, 3, 1, 5000)]   # d, L, H, B


def table_workers(repeats, calls=20):
    """icl_fast's lanes loss and Jacobian (full P, Q) on one thread and on every core, for the small
    evaluations of WORKER_CASES (n = 20); each time is the median over `repeats` of the mean of
    `calls` calls, the four runs of a case timed in turn."""
    head = ["d", "L", "H", "B", "loss: B L D^3", "loss: 1 thread s", "loss: every core s", "Jacobian: B L H D^3",
            "Jacobian: 1 thread s", "Jacobian: every core s"]
    rows = []
    for d, L_c, H_c, B_c in WORKER_CASES:
        rng = np.random.default_rng(d + 10 * L_c + 100 * H_c)
        Z, y = ir.sample_prompts(rng, B_c, N, np.eye(d))
        P, Q = 0.1 * rng.standard_normal((2, L_c, H_c, d + 1, d + 1))
        args = (P, Q, ir.gram(Z), np.ascontiguousarray(Z[:, :, N]), y, N)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        runs = [lambda k=k: fast.lanes_loss_and_grad_gram(*args, threads=k) for k in (1, cores)]
        runs += [lambda k=k: fast.lanes_jacobian_gram(*args, threads=k) for k in (1, cores)]
        times = [f"{t:.5f}" for t in interleaved_medians(runs, repeats, calls)]
        rows.append([d, L_c, H_c, B_c, B_c * L_c * (d + 1) ** 3, *times[:2], B_c * L_c * H_c * (d + 1) ** 3, *times[2:]])
    note = (f"The lanes formulation, n = 20; median of {repeats} means of {calls} calls. icl_fast hands an evaluation "
            f"to the workers from B L D^3 = {fast.PARALLEL_MIN_WORK} multiply-adds on for the loss (one kernel carries "
            f"every head) and B L H D^3 = {fast.PARALLEL_MIN_WORK_JACOBIAN} for the Jacobian, and runs smaller ones on the "
            "calling thread (MATH.md §16).")
    return "icl_fast's workers for small evaluations", head, rows, note


TRAINING_RUNS = [
    ("sparse, Gauss-Newton", "train_gauss_newton", dict(structure="sparse")),
    ("sparse, L-BFGS", "train_lbfgs", dict(structure="sparse")),
    ("blocks, Gauss-Newton", "train_gauss_newton", dict(structure="blocks")),
    ("blocks, L-BFGS (maxcor 300, maxiter 3000)", "train_lbfgs", dict(structure="blocks", maxcor=300, maxiter=3000)),
]


def table_training():
    Sigma_rng = np.random.default_rng(0)
    Sigma, _ = ir.rotated_covariance(Sigma_rng)
    Z, y = ir.sample_prompts(Sigma_rng, B, N, Sigma, np.linalg.inv(Sigma))
    head = ["run", "module", "time s", "evaluations", "batch loss", "|grad|", "success"]
    rows = []
    for name, trainer, options in TRAINING_RUNS:
        for module in (fast, ir):
            res = getattr(module, trainer)(Z, y, L, rng=np.random.default_rng(1), **options)
            rows.append([name, module.__name__, f"{res['wall_time']:.1f}", res["nfev"], f"{res['loss']:.6g}",
                         f"{res['grad_norm']:.1e}", res["success"]])
    note = ("The paper's problem: d = 5, n = 20, B = 20000, L = 3, Sigma as in [A] §4.3 (seed 0), "
            "w* ~ N(0, Sigma^-1), random start N(0, 0.1^2) (seed 1), default options unless stated.")
    return "Training at the paper's size", head, rows, note


REFERENCE_RUN = """
import sys, time, numpy as np
sys.path.insert(0, {root!r})
import icl_ref as ir
rng = np.random.default_rng(0)
Sigma, _ = ir.rotated_covariance(rng)
Z, y = ir.sample_prompts(rng, 20000, 20, Sigma, np.linalg.inv(Sigma))
start = time.perf_counter()
if sys.argv[1] == "lbfgs":
    ir.train_lbfgs(Z, y, 3, rng=np.random.default_rng(1), maxiter=100)
else:
    ir.train_gauss_newton(Z, y, 3, rng=np.random.default_rng(1))
print(time.perf_counter() - start)
"""


def table_blas_threads(rounds=2):
    """The reference's training in a plain process and with OPENBLAS_NUM_THREADS=1, alternating."""
    code = REFERENCE_RUN.format(root=ROOT)
    plain = {k: [] for k in ("lbfgs", "gauss-newton")}
    one = {k: [] for k in plain}
    for _ in range(rounds):
        for kind in plain:
            for env, store in ((dict(os.environ), plain), (dict(os.environ, OPENBLAS_NUM_THREADS="1"), one)):
                out = subprocess.run([sys.executable, "-c", code, kind], capture_output=True, text=True, env=env,
                                     check=True).stdout
                store[kind].append(float(out))
    head = ["run (icl_ref, sparse, paper size)", "plain python3 s", "OPENBLAS_NUM_THREADS=1 s", "ratio"]
    rows = [[kind if kind != "lbfgs" else "L-BFGS, 100 iterations",
             ", ".join(f"{t:.1f}" for t in plain[kind]), ", ".join(f"{t:.1f}" for t in one[kind]),
             f"{statistics.median(plain[kind]) / statistics.median(one[kind]):.2f}"] for kind in plain]
    note = (f"{rounds} alternating runs of each in fresh processes; the ratio is of the medians. A ratio near 1 "
            "means no BLAS threads compete with the computation.")
    return "The reference and BLAS threads", head, rows, note


ASKED = {5: (0.2, 0.1), 20: (0.3, 0.3)}     # d: the fractions of PyTorch's and JAX's times asked of icl_fast


def table_split(repeats):
    """icl_fast's loss_and_grad at B = 20000 on one worker and on every core, at the d of ASKED, with the
    peers' times: the work's time on one core over the cores (the least a perfect split of it reaches)
    against the time asked."""
    peers = [p for p in (torch_peer(), jax_peer()) if p is not None]
    names = [name.split()[0] for name, _ in peers]
    cores = fast._thread_count(None)
    head = (["d", "icl_fast, 1 worker s", f"icl_fast, {cores} workers s", "speed-up",
             f"1 worker / {cores} s"] + [f"{name} s" for name in names] + ["asked s", f"(1 worker / {cores}) / asked"])
    rows = []
    for d in ASKED:
        P, Q, Z, y = problem(d)
        runs = [lambda: fast.loss_and_grad(P, Q, Z, y, threads=1), lambda: fast.loss_and_grad(P, Q, Z, y)]
        rounds = []
        # icl_fast's two runs in turn (their order alternating), then the peers in turn, `repeats` times: each
        # group's warm-up calls come first (the peers' threads keep spinning after a call)
        for r in range(repeats):
            pair = interleaved_medians(runs[::1 if r % 2 else -1], 1)[::1 if r % 2 else -1]
            rounds.append(pair + (interleaved_medians([lambda f=f: f(P, Q, Z, y) for _, f in peers], 1) if peers else []))
        one, every, *t_peers = [statistics.median(column) for column in zip(*rounds)]
        asked = {"torch": ASKED[d][0], "jax": ASKED[d][1]}
        ask = min((asked[name] * t for name, t in zip(names, t_peers)), default=None)
        rows.append([d, f"{one:.4f}", f"{every:.4f}", f"{one / every:.2f}", f"{one / cores:.4f}"]
                    + [f"{t:.4f}" for t in t_peers]
                    + (["-", "-"] if ask is None else [f"{ask:.4f}", f"{one / cores / ask:.2f}"]))
        print(" ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
    note = ("n = 20, L = 3, B = 20000, one head, P, Q ~ 0.1 N(0, 1), as in the first table; median of {} rounds, "
            "each timing icl_fast's two runs in turn (their order alternating from round to round), then the peers "
            "in turn, each group after one warm-up call of each of its runs. One worker does the whole evaluation "
            "on one core; split perfectly over {} cores the same work would take its time over {}, so a time asked "
            "below that (a last column above 1) needs less time per prompt on one core of this machine (less work, "
            "or the same work done faster than numpy's calls do it), not a better split. Asked: {}; the column "
            "shows the smaller.").format(
                repeats, cores, cores, "; ".join(f"{a[0]} of PyTorch's time and {a[1]} of JAX's at d = {d}"
                                                 for d, a in ASKED.items()))
    return "icl_fast's work against the time asked", head, rows, note


def load():
    """The machine's 1-minute load average (None where the system does not say)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def machine(loads=(None, None)):
    """The processor, the cores, BLAS's threads, and the load averages `loads` (at the start and the
    end; none given: not shown): a load above the number of cores means other work shared the machine."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    lines = [f"machine: {cpu}, {cores} cores available to the process"]
    if None not in loads:
        lines.append("1-minute load average at the start and the end: {:.1f}, {:.1f} ({} cores: a load above "
                     "that means other work shared the machine)".format(*loads, cores))
    try:
        from threadpoolctl import threadpool_info
        for info in threadpool_info():
            lines.append(f"{info['user_api']}: {info['internal_api']} {info.get('version')} "
                         f"({info['num_threads']} threads, {os.path.basename(info['filepath'])})")
    except ImportError:
        pass
    return lines


def peer_versions():
    out = {}
    for name in ("torch", "jax"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            pass
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, RECORD), help="the record to write (JSON)")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    start, tables, load_at_start = time.perf_counter(), [], load()
    for title, head, rows, note in (table_loss_and_grad(args.repeats), table_formulations(args.repeats),
                                    table_lanes_chunks(args.repeats), table_workers(args.repeats), table_training(),
                                    table_blas_threads(), table_split(args.repeats)):
        rows = [[str(x) for x in row] for row in rows]
        tables.append(dict(title=title, note=note, head=head, rows=rows))
        print(f"## {title}\n\n{records.table(head, rows)}\n", flush=True)
    fast.shutdown()
    record = dict(provenance=records.provenance(["tools/benchmarks.py", "--repeats", str(args.repeats)], SOURCES,
                                                time.perf_counter() - start, **peer_versions()),
                  machine=machine((load_at_start, load())), tables=tables)
    status = records.save(args.out, record)
    if status == 0 and os.path.abspath(args.out) == os.path.join(ROOT, RECORD):
        return records.render()
    return status


if __name__ == "__main__":
    sys.exit(main())
