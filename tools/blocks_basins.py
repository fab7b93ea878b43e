"""How often training at the paper's size reaches each minimum of Theorem 4's blocks family.

    python3 tools/blocks_basins.py [--starts 20] [--seed 0]      # about half an hour on 2 cores
    python3 tools/blocks_basins.py --redraw                      # the figure again from the record (seconds)

One batch at the paper's size ([A] §4.3: B = 20000, n = 20, d = 5, L = 3, Sigma = U diag(1, 1, 1/4,
1/16, 1) U^T with U Haar, w* ~ N(0, Sigma^-1)), drawn from `seed`; `starts` random starts (A_l, B_l
iid N(0, 0.1^2) entries, as experiments.py's three-layer-blocks), each trained by icl_fast's
Gauss-Newton (max_nfev 400) and L-BFGS (maxcor 300, maxiter 3000) from the same start. A run counts
when it converged (|grad| <= 1e-6, experiments.py's test); its fitted scalars a_l = fitted_scalar(A_l,
Sigma^-1), b_l = fitted_scalar(B_l, I) start one descent of the exact family loss
(family_local_minimum), whose end names the population minimum the run's basin belongs to (MATH.md
§10 lists the certified ones). For each basin reached, its first run's scalars are compared with the
family's own minimum of the batch's loss, in standard errors of their difference (basin_checks).
Writes docs/blocks_basins.json (every run, the counts, the basins' checks, and the provenance of
tools/records.py: this command, the commit of the code in SOURCES, and the figures' SHA-256) and docs/blocks_basins.png with its PDF beside it; docs/FINDINGS.md finding 9's table is rendered from it
(`python3 tools/records.py render`). Ctrl-C or SIGTERM stops after the current run and writes nothing.
Exit status: 0 written, 2 bad arguments, a file refused (a symbolic link) or a record this code does
not reproduce (basin_checks), 130 stopped.
"""
import argparse
import fractions
import io
import json
import os
import signal
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

import icl_fast as fast  # noqa: E402
import icl_files  # noqa: E402
import icl_ref as ir  # noqa: E402
import records  # noqa: E402  (tools/records.py: the provenance)

SOURCES = ["icl_ref.py", "icl_fast.py", "experiments.py", "tools/blocks_basins.py"]    # the code the record comes from
RECORD = os.path.join("docs", "blocks_basins.json")
FIGURE = os.path.join("docs", "blocks_basins.png")
FIGURE_PDF = os.path.join("docs", "blocks_basins.pdf")            # its vector copy
B, N, D, L = 20000, 20, 5, 3
GRAD_TOL = 1e-6                 # experiments.GRAD_TOL: a converged run
OPTIMISERS = ("Gauss-Newton", "L-BFGS")


def draw_batch(seed):
    """The rotation and batch of `seed` (Sigma, its inverse, Z, y) and the generator that then draws the
    starts (draw_start): the same numbers every time, so that the record's batch can be drawn again."""
    rng = np.random.default_rng(seed)
    Sigma, _ = ir.rotated_covariance(rng, ir.PAPER_EIGENVALUES)
    Si = np.linalg.inv(Sigma)
    Z, y = ir.sample_prompts(rng, B, N, Sigma, Si)
    return Sigma, Si, Z, y, rng


def draw_start(rng):
    """One random start (A_l, B_l iid N(0, 0.1^2) entries), as experiments.py's three-layer-blocks."""
    return {"A": 0.1 * rng.standard_normal((L, D, D)), "B": 0.1 * rng.standard_normal((L, D, D))}


def basin_checks(runs, seed):
    """For each basin reached, where a run in it ends against the batch's own family minimum (the finding 9
    check of the three-layer-blocks experiment, on this batch): the first converged run of the basin is
    trained again from its start (its batch and start drawn again from `seed`; it must end within 1e-3 of
    its recorded scalars, or this is a ValueError: the record is not this code's), the family's minimum
    of the batch's loss is found from the basin's population minimum (experiments.batch_family_optimum),
    and the standard error of their difference is the sandwich one of the joint influence (as
    experiments.blocks_batch_rows). One dict per basin: key, optimiser, start, fitted and batch (2L-1:
    a then b), batch_loss, batch_grad_norm, se (of the difference), diff_in_se; None if a Ctrl-C or
    SIGTERM stopped a run."""
    import experiments  # noqa: E402  (the family's batch minimum and the influence, as the experiment's)
    ctx = experiments.Context(rng=np.random.default_rng(0))
    _, Si, Z, y, rng = draw_batch(seed)
    starts = [draw_start(rng) for _ in range(max(r["start"] for r in runs) + 1)]
    out = []
    for key in sorted({basin_key(r["basin_loss"]) for r in runs if r["converged"]}, key=float):
        r = next(r for r in runs if r["converged"] and basin_key(r["basin_loss"]) == key)
        res = train(r["optimiser"], Z, y, starts[r["start"]])
        if res["interrupted"]:
            return None
        fitted = np.r_[[ir.fitted_scalar(A_l, Si) for A_l in res["coords"]["A"]],
                       [ir.fitted_scalar(B_l, np.eye(D)) for B_l in res["coords"]["B"][:-1]]]
        # runs from different starts in one basin agree to ~1e-4: a rerun of one start agrees far closer
        if not np.allclose(fitted, np.r_[r["a"], r["b"]], rtol=1e-3, atol=0):
            raise ValueError(f"{r['optimiser']} from start {r['start']} of seed {seed} ends at {fitted}, not at the "
                             f"recorded {np.r_[r['a'], r['b']]}: the record was not made by this code")
        family = experiments.batch_family_optimum(ctx, Z, y, Si, L, np.r_[r["basin_a"], r["basin_b"]])
        influence = experiments.blocks_influence(ctx, res, Z, y, Si, L)
        se = np.std(influence - family["influence"], axis=0, ddof=1) / np.sqrt(len(y))
        out.append(dict(key=key, optimiser=r["optimiser"], start=r["start"], fitted=list(fitted),
                        batch=list(family["theta"]), batch_loss=family["loss"], batch_grad_norm=family["grad_norm"],
                        se=list(se), diff_in_se=list((fitted - family["theta"]) / se)))
    return out


def basin_key(f):
    """Population minima are told apart by their exact loss (the certified ones differ by > 1e-6 relative)."""
    return f"{f:.6e}"


def train(optimiser, Z, y, init):
    if optimiser == "Gauss-Newton":
        return fast.train_gauss_newton(Z, y, L, "blocks", init=init, max_nfev=400)
    return fast.train_lbfgs(Z, y, L, "blocks", init=init, maxiter=3000, maxcor=300)


def counts(runs, f_star):
    """{optimiser: {basin loss or "not converged": count}} and the key of the lowest family minimum found."""
    out = {name: {} for name in OPTIMISERS}
    for r in runs:
        key = basin_key(r["basin_loss"]) if r["converged"] else "not converged"
        out[r["optimiser"]][key] = out[r["optimiser"]].get(key, 0) + 1
    return out, basin_key(f_star)


# each optimiser's runs: (name, marker, scatter area in points^2, colour, filled), the edges EDGE points
# wide: Gauss-Newton's large open circles, L-BFGS's small filled squares drawn inside them (both optimisers
# often reach the same point: neither hides the other); the error bars' caps CAPSIZE points either side
MARKERS = (("Gauss-Newton", "o", 70, "C0", False), ("L-BFGS", "s", 22, "C1", True))
EDGE, CAPSIZE = 1.5, 3


def figure(record):
    """The figure as {path: bytes}: a PNG (150 dpi) and a PDF beside it (no creation date), in the style of
    experiments_cli's figures (Okabe-Ito colours, text >= 8 pt; docs/FIGURES.md). Sets record["drawn"]:
    whether each basin check's b error bar is smaller than its run's marker, as drawn (for the caption)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import experiments  # noqa: E402  (K_SE: the claims' multiple of the standard error)
    import experiments_cli  # noqa: E402  (the figures' style and saving)
    runs = record["runs"]
    style = dict(experiments_cli.FIGURE_STYLE, **{"axes.prop_cycle": matplotlib.cycler(color=experiments_cli.OKABE_ITO)})
    with matplotlib.rc_context(style):
        fig, (left, right) = plt.subplots(2, 1, figsize=(7.0, 8.4), layout="constrained")   # (a) above (b): 7 in wide
        # rows of the left panel: each basin reached, lowest loss first, then the runs that did not converge
        keys = sorted({basin_key(r["basin_loss"]) for r in runs if r["converged"]}, key=float)
        # a "not converged" row only when some run did not converge
        labels = ([f"f = {records.sci(float(k), 6)}" + (" (lowest)" if k == record["global_key"] else "") for k in keys]
                  + (["not converged"] if not all(r["converged"] for r in runs) else []))
        for name, marker, size, color, filled in MARKERS:
            mine = [r for r in runs if r["optimiser"] == name]
            rows = [keys.index(basin_key(r["basin_loss"])) if r["converged"] else len(keys) for r in mine]
            kw = dict(marker=marker, s=size, edgecolors=color, facecolors=color if filled else "none", linewidths=EDGE)
            left.scatter([r["start"] for r in mine], rows, **kw,
                         label=f"{name}: {sum(r['converged'] for r in mine)} of {len(mine)} converged")
            conv = [r for r in mine if r["converged"]]
            right.scatter([r["a"][1] for r in conv], [r["b"][1] for r in conv], **kw, label=f"{name} (converged runs)")
        basins = sorted({basin_key(r["basin_loss"]): (r["basin_loss"], r["basin_a"], r["basin_b"][:2])
                         for r in runs if r["converged"]}.values())          # one per population minimum
        for i, (f, a, b) in enumerate(basins):
            right.scatter([a[1]], [b[1]], marker="x", color="k", s=70, linewidths=1.8,
                          label="the basins' population minima\n(lowest: the family's best found)" if i == 0 else None)
        # per basin, one run's scalars with ±K_SE standard errors of their distance from the batch's own
        # family minimum (basin_checks), and that minimum: the point training on this batch can reach
        k_se = experiments.K_SE
        at = record["L"] + 1                            # (a_0 .. a_{L-1}, b_0 .. b_{L-2}): layer 1's b
        checks = record.get("basins", [])
        for i, c in enumerate(checks):
            # the error bars under the runs' markers (which stay whole), the batch optima (open diamonds) above
            right.errorbar([c["fitted"][1]], [c["fitted"][at]], xerr=[k_se * c["se"][1]], yerr=[k_se * c["se"][at]],
                           fmt="none", ecolor="0.3", elinewidth=1, capsize=CAPSIZE, zorder=0.5,
                           label=f"a run's scalars, ±{k_se:g} SE of their\n"
                                 "distance from the batch optimum" if i == 0 else None)
            right.scatter([c["batch"][1]], [c["batch"][at]], marker="D", s=40, facecolors="none", edgecolors="k",
                          linewidths=1.2, zorder=5,
                          label="the basins' batch optima (family\nminima of this batch's loss)" if i == 0 else None)
        right.margins(0.25)             # room for the points' labels inside the frame
        lo, hi = right.get_xlim()
        for f, a, b in basins:          # a label on the side of its point away from the nearer frame
            inside = a[1] < (lo + hi) / 2
            # the runs of one basin fall on one point of their own: the minimum's label counts them (f as
            # panel a writes it)
            many = {name: sum(r["converged"] and basin_key(r["basin_loss"]) == basin_key(f) and r["optimiser"] == name
                              for r in runs) for name in OPTIMISERS}
            lowest = " (lowest)" if basin_key(f) == record["global_key"] else ""
            right.annotate(f"f = {records.sci(f, 6)}{lowest}\nruns in its basin: " + ", ".join(f"{name} {k}" for name, k in many.items() if k),
                           (a[1], b[1]), textcoords="offset points", xytext=(10 if inside else -10, 10),
                           ha="left" if inside else "right", fontsize=8)
        left.set_yticks(range(len(labels)), labels)
        left.set_ylim(-0.6, len(labels) - 0.4)
        left.set(xlabel="start", ylabel="population minimum of the run's basin",
                 title="(a) basin reached from each start")
        left.set_xticks(range(0, record["starts"], max(1, record["starts"] // 10)))
        left.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14))
        # no math scripts in the labels: mathtext draws them at 70 %, below 8 pt
        right.set(xlabel=r"layer 1: fitted $a$ ($A \approx a$ times the inverse of $\Sigma$)",
                  ylabel=r"layer 1: fitted $b$ ($B \approx b I$)",
                  title="(b) layer 1's fitted scalars (layers 0, 1, 2: the second layer)")
        right.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
        spectrum = "(" + ", ".join(str(fractions.Fraction(v).limit_denominator(1000)) for v in ir.PAPER_EIGENVALUES) + ")"
        # the batch size in words: B names the layers' matrices B_l in panel (b)
        fig.suptitle(f"Blocks model at the size of Ahn et al. 2023: a batch of {record['B']} prompts,\n"
                     rf"$n$ = {record['n']}, $d$ = {record['d']}, $L$ = {record['L']}, noiseless, "
                     f"$\\Sigma$ eigenvalues {spectrum} rotated;\n{record['starts']} random starts, each trained by "
                     f"Gauss-Newton and by L-BFGS on one batch\nand rotation drawn from seed {record['seed']} "
                     "(not the three-layer-blocks experiment's batches:\nits fitted scalars differ)")
        out = {FIGURE: experiments_cli.figure_bytes(fig, "png"), FIGURE_PDF: experiments_cli.figure_bytes(fig, "pdf")}
        # what the caption says of b's error bars is measured on the figure as drawn (the run's marker, its
        # size the scatter area's square root in points, and its edge)
        drawn = {name: dict(marker=marker, ms=size ** 0.5, mew=EDGE, capsize=CAPSIZE) for name, marker, size, *_ in MARKERS}
        record["drawn"] = dict(b_bars_inside=[experiments.bars_inside_markers(
            fig, right, [c["fitted"][1]], [c["fitted"][at]], [k_se * c["se"][at]], **drawn[c["optimiser"]])[0]
            for c in checks])
        plt.close(fig)
    return out


def redraw():
    """Draw the figure again from the runs docs/blocks_basins.json keeps (no training) and record the new
    figures' hashes in its provenance (which still names the commit the runs were made from). A record
    made before basin_checks were recorded gets them (a few minutes: one run per basin trained again),
    with their own provenance, `basins_provenance`."""
    record = records.load("blocks_basins")
    if "basins" not in record:
        t0 = time.time()
        try:
            record["basins"] = basin_checks(record["runs"], record["seed"])
        except ValueError as e:
            print(f"not drawn: {e}", file=sys.stderr)
            return 2
        if record["basins"] is None:
            print("stopped: nothing written", file=sys.stderr)
            return 130
        record["basins_provenance"] = records.provenance(["tools/blocks_basins.py", "--redraw"], SOURCES, time.time() - t0)
    try:
        for path, data in figure(record).items():
            records.write(path, data)
        record["provenance"]["outputs"] = {path: records.sha256_file(path) for path in (FIGURE, FIGURE_PDF)}
        records.write(RECORD, record)
    except (icl_files.Refused, icl_files.WriteFailed) as e:
        print(f"not written: {e}", file=sys.stderr)
        return 2
    print(FIGURE, FIGURE_PDF, RECORD)
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--starts", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--redraw", action="store_true",
                    help="only draw the figure again from docs/blocks_basins.json's runs (seconds; a record without "
                         "the basins' checks gets them first: one run per basin trained again, minutes)")
    args = ap.parse_args(argv)
    if args.redraw:
        return redraw()
    if args.starts < 1:
        ap.error(f"--starts must be >= 1, got {args.starts}")
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stop.append(signum))
    a_star, b_star, f_star = ir.optimal_family_scalars(L, N, D, blocks=True)
    Sigma, Si, Z, y, rng = draw_batch(args.seed)
    runs, t0 = [], time.time()
    for s in range(args.starts):
        init = draw_start(rng)
        for name in OPTIMISERS:
            res = train(name, Z, y, init)
            if stop or res["interrupted"]:
                print("stopped: nothing written", file=sys.stderr)
                return 130
            A, Bm = res["coords"]["A"], res["coords"]["B"]
            run = dict(start=s, optimiser=name, loss=res["loss"], grad_norm=res["grad_norm"],
                       converged=bool(res["grad_norm"] <= GRAD_TOL), seconds=res["wall_time"],
                       a=[ir.fitted_scalar(A[l], Si) for l in range(L)],
                       b=[ir.fitted_scalar(Bm[l], np.eye(D)) for l in range(L - 1)])
            if run["converged"]:
                a_loc, b_loc, f_loc = ir.family_local_minimum(run["a"], N, D, b=run["b"] + [0.0])
                run.update(basin_loss=f_loc, basin_a=list(a_loc), basin_b=list(b_loc[:-1]))
            runs.append(run)
            print(f"start {s:2d} {name:12s} loss {res['loss']:.4e} |grad| {res['grad_norm']:.1e} "
                  f"{res['wall_time']:6.1f} s  basin f = {run.get('basin_loss', float('nan')):.4e}  "
                  f"({time.time() - t0:.0f} s so far)", flush=True)
    table, global_key = counts(runs, f_star)
    record = dict(starts=args.starts, seed=args.seed, B=B, n=N, d=D, L=L,
                  optimum=dict(a=list(a_star), b=list(b_star[:-1]), loss=f_star), counts=table, global_key=global_key,
                  runs=runs)
    record["basins"] = basin_checks(runs, args.seed)
    if record["basins"] is None or stop:
        print("stopped: nothing written", file=sys.stderr)
        return 130
    try:
        for path, data in figure(record).items():
            records.write(path, data)
        record = dict(provenance=records.provenance(["tools/blocks_basins.py", "--starts", str(args.starts), "--seed",
                                                     str(args.seed)], SOURCES, time.time() - t0, [FIGURE, FIGURE_PDF]),
                      **record)
        records.write(RECORD, record)
    except (icl_files.Refused, icl_files.WriteFailed) as e:
        print(f"not written: {e}", file=sys.stderr)
        return 2
    for name in OPTIMISERS:
        print(name, json.dumps(table[name]))
    print(RECORD, FIGURE, FIGURE_PDF)
    return 0


if __name__ == "__main__":
    sys.exit(main())
