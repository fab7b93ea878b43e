"""Task diversity: linear transformers trained on a finite pool of K tasks, against dMMSE and ridge.

    python examples/task_diversity.py [--quick] [--out DIR] [--overwrite]

Prompts as Raventós, Paul, Chen and Ganguli (NeurIPS 2023): d = 8, n = 16 context examples,
x ~ N(0, I), label noise of variance 0.25; the pool's K tasks are drawn from N(0, I) (the pools are
nested: pool K is the first K rows of one draw, so the curves vary smoothly in K). For
K = 1, 2, 4, ..., 4096 each model is tested on prompts from its pool and on fresh tasks w ~ N(0, I):

- one layer (Theorem 1), exactly: at infinitely many training prompts the layer trained on the pool is
  gamma_star with the pool's second moment, and its losses are exact (MATH.md §15);
- the paper's three-layer sparse model, trained by L-BFGS (100 iterations) on 8192 prompts from
  the pool (K = 1, 16, 256, 4096 only: training costs ~20 s a pool), tested by Monte Carlo;
- dMMSE (the posterior mean over the pool) and ridge with lambda = 0.25 (the posterior mean for
  w ~ N(0, I): optimal on fresh tasks), by Monte Carlo, every model on prompts from one seed per K
  and test set.

Monte Carlo uses 20000 prompts per entry, 4000 for dMMSE (it costs K d^2 per prompt); +- is one
standard error.
Prints the table and PASS/FAIL rows, each with its tolerance; writes DIR/task_diversity.csv, with
matplotlib DIR/task_diversity.png, and DIR/task_diversity.json: the run's provenance
(tools/records.py), the SHA-256 of those files, the rows, the exact optima, the verdicts and the
summary the README quotes. It never replaces a file it did not write (it refuses before computing;
--overwrite replaces an earlier run's files that its task_diversity.json lists unchanged). --quick: d = 4, n = 8, K <= 256, smaller batches (seconds).
The full run takes about 2.5 minutes on 2 cores.
"""
import argparse
import io
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))
import icl_ref as ir                                        # noqa: E402
import records                                              # noqa: E402  (the --out folder and the record)

FULL = dict(d=8, n=16, noise_var=0.25, K_max=4096, train_batch=8192, maxiter=100, test_batch=20000, dmmse_batch=4000)
QUICK = dict(d=4, n=8, noise_var=0.25, K_max=256, train_batch=1024, maxiter=30, test_batch=2000, dmmse_batch=1000)


VERDICTS = []           # [outcome, claim] of every claim printed, for the record


def say(outcome, claim):
    VERDICTS.append([outcome, claim])
    print(f"{outcome}  {claim}")


def verdict(value, bound, se, claim=None):
    """The claim value <= bound: PASS when value + 4 se <= bound, FAIL when value - 4 se > bound, else
    UNDECIDED (the Monte Carlo error straddles the bound). Printed with the claim when one is given."""
    outcome = "PASS" if value + 4 * se <= bound else "FAIL" if value - 4 * se > bound else "UNDECIDED"
    if claim:
        say(outcome, claim)
    return outcome


def run(d, n, noise_var, K_max, train_batch, maxiter, test_batch, dmmse_batch, seed=0):
    rng = np.random.default_rng(seed)
    I = np.eye(d)
    all_tasks = rng.standard_normal((K_max, d))
    Ks = [2 ** k for k in range(int(np.log2(K_max)) + 1)]
    G_prior = ir.gamma_star(I, n, noise_var=noise_var)            # the layer at the unbounded prior
    L1_prior = ir.single_layer_population_loss(G_prior, I, n, noise_var=noise_var)
    L3_prior = ir.optimal_family_scalars(3, n, d, noise_var=noise_var, starts=8, rng=rng)[2]
    ridge = lambda Z: ir.bayes_predict(Z, noise_var=noise_var)
    rows = []
    for K in Ks:
        tasks = all_tasks[:K]
        G = ir.gamma_star(I, n, noise_var=noise_var, tasks=tasks)
        row = dict(K=K, L1_pool=ir.shifted_single_layer_loss(G, I, n, noise_var=noise_var, tasks=tasks),
                   L1_fresh=ir.shifted_single_layer_loss(G, I, n, noise_var=noise_var))
        models = dict(dmmse=lambda Z: ir.dmmse_predict(Z, tasks, noise_var), ridge=ridge)
        if np.log2(K) % 4 == 0:                               # K = 16^j: the three-layer model
            Z, y = ir.sample_prompts(rng, train_batch, n, I, noise_std=np.sqrt(noise_var), tasks=tasks)
            fit = ir.train_lbfgs(Z, y, 3, "sparse", rng=rng, maxiter=maxiter)
            models["L3"] = lambda Z, P=fit["P"], Q=fit["Q"]: ir.predict(P, Q, Z)
            row["L3_converged"] = fit["success"]              # |grad| <= gtol within maxiter iterations
        for test, pool in (("pool", tasks), ("fresh", None)):
            seed_K = (seed, K, int(test == "pool"))            # common prompts for every model
            for name, predict in models.items():
                batch = dmmse_batch if name == "dmmse" else test_batch
                risk, se = ir.monte_carlo_risk(predict, np.random.default_rng(seed_K), batch, n, I,
                                               noise_var=noise_var, tasks=pool)
                row[f"{name}_{test}"], row[f"{name}_{test}_se"] = risk, se
        rows.append(row)
        print(f"K = {K} done", file=sys.stderr)
    return rows, L1_prior, L3_prior


def report(rows, L1_prior, L3_prior, out):
    """Print the table; write the CSV and the figure into `out` (a records.OutFolder)."""
    cols = ["L1_pool", "L1_fresh", "L3_pool", "L3_fresh", "dmmse_pool", "dmmse_fresh", "ridge_pool", "ridge_fresh"]
    print(f"{'K':>5} " + " ".join(f"{c:>16}" for c in cols))
    for r in rows:
        cells = [f"{r[c]:.4f}" + (f"+-{r[c + '_se']:.3f}" if c + "_se" in r else "") if c in r else "" for c in cols]
        print(f"{r['K']:>5} " + " ".join(f"{c:>16}" for c in cells))
    print(f"unbounded prior: one layer {L1_prior:.4f} (exact), three-layer sparse family optimum {L3_prior:.4f} (exact)")
    print("three layers converged (L-BFGS to |grad| <= 1e-8): "
          + ", ".join(f"K = {r['K']}: {r['L3_converged']}" for r in rows if "L3_converged" in r))
    out.write_csv("task_diversity.csv", rows, ["K"] + [k for c in cols for k in (c, c + "_se")] + ["L3_converged"])
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, test in zip(axes, ("pool", "fresh")):
        for name, label in (("L1", "one layer (exact)"), ("L3", "three layers (trained)"), ("dmmse", "dMMSE"),
                            ("ridge", "ridge (Bayes, N(0, I))")):
            pts = [(r["K"], r[f"{name}_{test}"]) for r in rows if f"{name}_{test}" in r]
            ax.plot(*zip(*pts), "o-", label=label)
        ax.set(xscale="log", yscale="log", xlabel="K (tasks in the pool)", title=f"tested on {test} tasks")
    axes[0].set_ylabel("E (y_hat - y)^2")
    axes[1].legend()
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    out.write("task_diversity.png", png.getvalue())


def claims(rows, L1_prior, L3_prior):
    """PASS/FAIL rows, each a claim "value <= bound" decided against the Monte Carlo error of value;
    returns the summary numbers the README quotes besides the rows."""
    first, last = rows[0], rows[-1]
    L3 = [r for r in rows if "L3_fresh" in r][-1]

    def ratio(name, ref, test="fresh"):          # r[name] / r[ref] - 1 and its standard error (delta method)
        r = L3 if name == "L3" else last
        q = r[f"{name}_{test}"] / r[ref]
        return q - 1, q * np.hypot(r.get(f"{name}_{test}_se", 0.0) / r[f"{name}_{test}"], r.get(ref + "_se", 0.0) / r[ref])

    verdict(abs(last["L1_fresh"] / L1_prior - 1), 0.01, 0.0,
            f"one layer: fresh-task loss at K = {last['K']} within 1% of its unbounded-prior optimum "
            f"({last['L1_fresh']:.4f} vs {L1_prior:.4f}; exact both: it sees the pool's second moment only)")
    excess, se = L3["L3_fresh"] / L3_prior - 1, L3["L3_fresh_se"] / L3_prior
    verdict(abs(excess), 0.1, se, f"three layers: fresh-task loss at K = {L3['K']} within 10% of the sparse family's "
            f"exact optimum for the unbounded prior ({L3['L3_fresh']:.4f} vs {L3_prior:.4f}; 10% for training on "
            "a finite batch)")
    gap = abs(L3["L3_pool"] - L3["L3_fresh"])
    say('PASS' if gap <= 4 * np.hypot(L3['L3_pool_se'], L3['L3_fresh_se']) else 'FAIL', f"three layers at "
        f"K = {L3['K']}: pool and fresh-task losses agree within 4 combined SE (no memorisation: "
        f"{L3['L3_pool']:.4f}, {L3['L3_fresh']:.4f})")
    small = [verdict(r["dmmse_pool"] - r["ridge_pool"], 0.0, np.hypot(r["ridge_pool_se"], r["dmmse_pool_se"]))
             for r in rows if r["K"] <= 16]
    say('PASS' if all(v == 'PASS' for v in small) else 'FAIL' if 'FAIL' in small else 'UNDECIDED', "dMMSE "
        "memorises small pools: its pool risk is below ridge's at every K <= 16 (4 SE)")
    for name in ("L1", "L3", "dmmse"):
        excess, se = ratio(name, "ridge_fresh")
        r = L3 if name == "L3" else last
        verdict(excess, 0.1, se, f"{name}: fresh-task loss approaches ridge's as K grows, within 10% at K = {r['K']} "
                f"({first[name + '_fresh']:.3f} at K = 1, {r[name + '_fresh']:.3f}; ridge {r['ridge_fresh']:.3f})")
    curve = [r for r in rows if "L3_fresh" in r]
    near = next(r["K"] for r in curve if r["L3_fresh"] <= 1.1 * L3["L3_fresh"])
    print(f"transition: the three-layer model's fresh-task loss is within 10% of its K = {L3['K']} value from "
          f"K = {near} on; dMMSE's fresh-task risk is {last['dmmse_fresh'] / last['ridge_fresh']:.2f} x ridge's "
          f"at K = {last['K']}")
    return dict(L3_K=L3["K"], L3_settled_from_K=near, L3_excess=L3["L3_fresh"] / L3_prior - 1,
                dmmse_over_ridge_fresh=last["dmmse_fresh"] / last["ridge_fresh"])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=".")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the files of an earlier run that its task_diversity.json lists unchanged")
    args = parser.parse_args(argv)
    out = records.OutFolder(args.out, "examples/task_diversity.py", "task_diversity.json",
                            ["task_diversity.csv", "task_diversity.png"], args.overwrite)
    start = time.time()
    settings = QUICK if args.quick else FULL
    rows, L1_prior, L3_prior = run(**settings)
    report(rows, L1_prior, L3_prior, out)
    del VERDICTS[:]
    summary = claims(rows, L1_prior, L3_prior)
    argv = sys.argv[1:] if argv is None else argv
    print(out.write_record(dict(
        provenance=records.provenance("examples/task_diversity.py", argv, ["icl_ref.py", "examples/task_diversity.py"]),
        settings=settings, L1_prior=L1_prior, L3_prior=L3_prior, summary=summary, verdicts=VERDICTS, rows=rows)))
    print(f"{time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
