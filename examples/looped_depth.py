"""Looped (weight-tied) linear transformers and the gradient flow of one layer (MATH.md §14).

    python3 examples/looped_depth.py [--out DIR] [--seed S] [--overwrite]

Three parts, each printing a table and PASS/FAIL lines decided from the numbers printed:

1. The exact optima of the tied and untied families per depth L (family_population_loss at
   n = 20, d = 5): the tied loss is never below the untied one, and how much of depth's gain
   (the drop of the loss from L = 1) survives tying.
2. Tied sparse models trained at the paper's size (B = 20000, n = 20, d = 5, [A] §4.3's Sigma and
   w* ~ N(0, Sigma^-1)) for L = 1..4 against the exact tied optimum: the fitted scalar a of
   A ~ a Sigma^-1 within 5% of a*_L, Dist(A, Sigma^-1) <= 0.05 (the distance of [A] §4.3,
   distance_to_multiple) for A and for its whitened symmetric part, and the trained model's loss on
   fresh prompts against the family's optimum (paired). Then (2b) the curvature of the tied loss
   at the family point along an antisymmetric and a symmetric direction, by Monte Carlo.
3. Gradient flow of one layer from Zhang, Frei and Bartlett's initialisation (one start inside
   their initial-scale bound, one outside), and gradient descent with step eta on R independent
   batches of B = 50000 prompts with icl_ref's gradient of the full (P, Q), against the flow at 5
   times: within 4 standard errors of the batches' mean.

Writes DIR/looped_depth.csv (parts 1-2), DIR/one_layer_flow.csv (part 3), with matplotlib
DIR/looped_depth.png, and DIR/looped_depth.json: the run's provenance (tools/records.py), the SHA-256
of those files, the rows, the flow's numbers and the verdicts. It never replaces a file it did not
write (it refuses before computing; --overwrite replaces an earlier run's files that its
looped_depth.json lists unchanged). About 60 s of CPU, most of it training at the paper's size.
"""
import argparse
import csv
import io
import math
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))
import icl_ref as ir  # noqa: E402
import records  # noqa: E402  (the --out folder and the record)

N, D = 20, 5
Z_MC = 4.0          # a sampled quantity within 4 standard errors (false alarm 6e-5 for a Gaussian)
verdicts = []           # [outcome, claim] of every check, for the record


def verdict(ok, claim):
    verdicts.append(["PASS" if ok else "FAIL", claim])
    print(f"{verdicts[-1][0]}  {claim}")


def exact_families(L_max=4):
    """Part 1: rows of the exact tied and untied optima (sparse for L <= L_max, blocks for L <= 3)."""
    rows = []
    for blocks, Ls in ((False, range(1, L_max + 1)), (True, range(1, 4))):
        for L in Ls:
            a_t, b_t, f_t = ir.optimal_tied_family(L, N, D, blocks=blocks)
            a_u, b_u, f_u = ir.optimal_family_scalars(L, N, D, blocks=blocks, starts=4)
            rows.append(dict(family="blocks" if blocks else "sparse", L=L, a_tied=a_t,
                             b_tied=math.nan if b_t is None else b_t, loss_tied=f_t, loss_untied=f_u,
                             a_untied=" ".join(f"{v:.4f}" for v in a_u)))
    print("\nExact optima of the families (n = 20, d = 5): tied a (b), untied a_l, losses")
    print(f"{'family':7s} {'L':>2s} {'a tied':>8s} {'b tied':>8s} {'loss tied':>11s} {'loss untied':>11s}"
          f" {'gain kept':>9s}  untied a_l")
    for r in rows:
        first = next(s for s in rows if s["family"] == r["family"] and s["L"] == 1)["loss_untied"]
        gain = first - r["loss_untied"]
        r["gain_kept"] = (first - r["loss_tied"]) / gain if gain > 0 else math.nan
        print(f"{r['family']:7s} {r['L']:2d} {r['a_tied']:8.4f} {r['b_tied']:8.4f} {r['loss_tied']:11.6f} "
              f"{r['loss_untied']:11.6f} {r['gain_kept']:9.3f}  {r['a_untied']}")
    verdict(all(r["loss_tied"] >= r["loss_untied"] * (1 - 1e-12) for r in rows),
            "the tied optimum's loss is never below the untied one's (a restriction of the family)")
    verdict(all(abs(r["loss_tied"] - r["loss_untied"]) <= 1e-12 * r["loss_untied"] for r in rows if r["L"] == 1),
            "at L = 1 tying changes nothing")
    sparse = [r for r in rows if r["family"] == "sparse"]
    verdict(all(s["a_tied"] > t["a_tied"] for s, t in zip(sparse, sparse[1:])),
            "the tied sparse step a*_L decreases with L (MATH.md §14: it must tend to 0)")
    return rows


def trained_tied(rng, Ls=(1, 2, 3, 4), B=20000):
    """Part 2: tied sparse models trained by L-BFGS on the paper's data, against a*_L."""
    Sigma, _ = ir.rotated_covariance(rng)
    Si = np.linalg.inv(Sigma)
    lam, V = np.linalg.eigh(Sigma)
    root, inv_root = (V * np.sqrt(lam)) @ V.T, (V / np.sqrt(lam)) @ V.T    # whitened: root A root = a I
    Z, y = ir.sample_prompts(rng, B, N, Sigma, Si)
    Z_test, y_test = ir.sample_prompts(rng, B, N, Sigma, Si)
    rows = []
    print(f"\nTied sparse models trained on B = {B} prompts (n = {N}, d = {D}) against the exact tied optimum")
    print(f"{'L':>2s} {'fitted a':>9s} {'a*_L':>8s} {'rel. err':>8s} {'Dist':>7s} {'Dist sym':>8s} {'antisym':>7s}"
          f" {'test - family':>13s} {'+- 4 SE':>8s} {'seconds':>7s}")
    for L in Ls:
        res = ir.train_lbfgs(Z, y, L, "sparse", rng=rng, tied=True, gtol=1e-7)
        A = res["coords"]["A"][0]
        W = root @ A @ root
        a_hat, dist = ir.fitted_scalar(A, Si), ir.distance_to_multiple(A, Si)
        dist_sym = ir.distance_to_multiple(inv_root @ (W + W.T) @ inv_root / 2, Si)
        antisym = float(np.linalg.norm(W - W.T) / np.linalg.norm(W + W.T))
        a_star, _, f_star = ir.optimal_tied_family(L, N, D)
        # paired on fresh prompts: the trained model against the exact optimum of the family
        P_f, Q_f = ir.structure_to_PQ("sparse", {"A": (a_star * Si)[None]}, L=L)
        gap = (ir.predict(res["P"], res["Q"], Z_test) - y_test) ** 2 - (ir.predict(P_f, Q_f, Z_test) - y_test) ** 2
        diff, se = float(np.mean(gap)), float(np.std(gap, ddof=1) / math.sqrt(B))
        rows.append(dict(L=L, a_fitted=a_hat, a_star=a_star, dist=dist, dist_sym=dist_sym, antisym=antisym,
                         test_minus_family=diff, test_minus_family_se=se, exact_loss=f_star,
                         converged=res["success"], seconds=res["wall_time"]))
        print(f"{L:2d} {a_hat:9.4f} {a_star:8.4f} {abs(a_hat / a_star - 1):8.4f} {dist:7.4f} {dist_sym:8.4f} "
              f"{antisym:7.4f} {diff:13.5f} {Z_MC * se:8.5f} {res['wall_time']:7.1f}")
        verdict(res["success"] and abs(a_hat / a_star - 1) <= 0.05,
                f"L = {L}: converged (largest gradient entry <= 1e-7), fitted a within 5% of a*_L")
        verdict(dist <= 0.05, f"L = {L}: Dist(A, Sigma^-1) <= 0.05")
        verdict(dist_sym <= 0.05, f"L = {L}: Dist(sym. part of A, Sigma^-1) <= 0.05 (whitened symmetric part)")
    return rows


def curvature_at_the_family_point(rng, Ls=(1, 2, 3, 4), B=400000, eps=0.3):
    """Part 2b: second differences of the tied sparse loss at a*_L I (whitened, Sigma = I) along a
    random antisymmetric and a random symmetric traceless direction of unit norm, by Monte Carlo
    with common prompts: (f(A + eps E) + f(A - eps E)) / 2 - f(A) = (eps^2 / 2) E^T H E + O(eps^4)."""
    Z, y = ir.sample_prompts(rng, B, N, np.eye(D))
    K = rng.standard_normal((D, D))
    directions = {"antisymmetric": K - K.T, "symmetric traceless": K + K.T - 2 * np.trace(K) / D * np.eye(D)}
    rows = []
    print(f"\nSecond differences of the tied sparse loss at A = a*_L Sigma^-1 (eps = {eps}, {B} prompts, whitened)")
    for L in Ls:
        a = ir.optimal_tied_family(L, N, D)[0]

        def sq(A):
            P, Q = ir.structure_to_PQ("sparse", {"A": A[None]}, L=L)
            return (ir.predict(P, Q, Z) - y) ** 2
        base = sq(a * np.eye(D))
        line = [f"L = {L}:"]
        for name, E in directions.items():
            E = E / np.linalg.norm(E)
            dd = (sq(a * np.eye(D) + eps * E) + sq(a * np.eye(D) - eps * E)) / 2 - base
            m, se = float(np.mean(dd)), float(np.std(dd, ddof=1) / math.sqrt(B))
            rows.append(dict(L=L, direction=name, second_difference=m, se=se))
            line.append(f"{name} {m:+.5f} +- {se:.5f}")
        print("  " + "   ".join(line))
    anti = {r["L"]: r for r in rows if r["direction"] == "antisymmetric"}
    sym = {r["L"]: r for r in rows if r["direction"] == "symmetric traceless"}
    verdict(all(sym[L]["second_difference"] > Z_MC * sym[L]["se"] for L in Ls),
            "along the symmetric traceless direction the family point is a minimum at every L (> 4 SE)")
    verdict(anti[1]["second_difference"] > Z_MC * anti[1]["se"] and
            all(anti[L]["second_difference"] < sym[L]["second_difference"] / 10 for L in Ls if L > 1),
            "along the antisymmetric direction: curved at L = 1, at least 10 times flatter than the "
            "symmetric one for L >= 2 (the trained A's antisymmetric part is poorly determined)")
    verdict(anti[max(Ls)]["second_difference"] < -Z_MC * anti[max(Ls)]["se"],
            f"at L = {max(Ls)} the antisymmetric second difference is negative (< -4 SE): a*_L Sigma^-1 "
            "is not the minimum of the tied sparse loss")
    return rows


def flow_and_descent(rng, B=50000, R=8, eta=0.01, steps=400, sigma=0.3):
    """Part 3: the flow from two starts, and gradient descent on R batches against it."""
    d, n = 2, 10
    Sigma, _ = ir.rotated_covariance(rng, (1.0, 0.5))
    G_star = ir.gamma_star(Sigma, n)
    t = np.r_[0.0, np.geomspace(0.01, 400, 200)]
    flows, summary = {}, dict(d=d, n=n, eta=eta, R=R, B=B, sigma_descent=sigma, starts=[], descent=[])
    bound = summary["sigma_bound"] = ir.one_layer_gradient_flow(Sigma, n, 1.0, [0.0])["sigma_bound"]
    print(f"\nOne layer (d = {d}, n = {n}): gradient flow from [Z]'s start, their bound sigma < {bound:.4f}")
    for name, s in (("inside", 0.05), ("outside", 3 * bound)):
        flows[name] = f = ir.one_layer_gradient_flow(Sigma, n, s, t)
        err = np.linalg.norm(f["Gamma"][-1] - G_star) / np.linalg.norm(G_star)
        plateau = t[np.argmax(f["loss"] < 0.5 * (f["loss"][0] + f["loss"][-1]))]
        print(f"  sigma = {s:.4f} ({name}): loss {f['loss'][0]:.4f} -> {f['loss'][-1]:.6f}, half-way at t = "
              f"{plateau:.2f}, |Gamma(400) - Gamma*| / |Gamma*| = {err:.1e}, max |u^2 - |U|^2| = "
              f"{np.max(np.abs(f['invariant'])):.1e}")
        summary["starts"].append(dict(start=name, sigma=s, loss_first=f["loss"][0], loss_last=f["loss"][-1],
                                      half_way_t=plateau, rel_err_end=err,
                                      invariant_max=np.max(np.abs(f["invariant"]))))
        verdict(err <= 1e-8, f"the flow from sigma = {s:.4f} ({name} the bound) ends at gamma_star to 1e-8")

    # descent: icl_fast's engine when it runs (the same numbers, faster), else the reference
    engine = None
    try:
        import icl_fast
        engine = icl_fast.engine()
    except Exception:                      # noqa: BLE001 -- any failure means: use the reference
        pass
    times = eta * np.arange(steps + 1)
    flow = ir.one_layer_gradient_flow(Sigma, n, sigma, times)["Gamma"]
    # the step's own error: the same descent on the exact population gradient
    u, U, euler = sigma, sigma * np.eye(d) / math.sqrt(d), []
    for k in range(steps + 1):
        euler.append(u * U)
        _, du, dU = ir.one_layer_population_grad(u, U, Sigma, n)
        u, U = u - eta * du, U - eta * dU
    G = np.empty((R, steps + 1, d, d))
    for r in range(R):
        Z, y = ir.sample_prompts(rng, B, n, Sigma)
        S0, q0 = ir.gram(Z), np.ascontiguousarray(Z[:, :, n])
        P, Q = np.zeros((2, 1, 1, d + 1, d + 1))
        P[0, 0, d, d], Q[0, 0, :d, :d] = sigma, -sigma * np.eye(d) / math.sqrt(d)
        for k in range(steps + 1):
            G[r, k] = P[0, 0, d, d] * -Q[0, 0, :d, :d]
            if k < steps:
                _, dP, dQ = ir.loss_and_grad_gram(P, Q, S0, q0, y, n, engine=engine)
                P, Q = P - eta * dP, Q - eta * dQ
    mean, se = G.mean(axis=0), G.std(axis=0, ddof=1) / math.sqrt(R)
    print(f"  gradient descent, eta = {eta}, R = {R} batches of B = {B}, sigma = {sigma}: "
          "max over entries of |mean - flow| / SE, and the step's own error / SE")
    for k in np.linspace(0, steps, 6).astype(int)[1:]:
        z = np.max(np.abs(mean[k] - flow[k]) / se[k])
        step = np.max(np.abs(euler[k] - flow[k]) / se[k])
        print(f"    t = {times[k]:5.2f}: |z| <= {z:5.2f}   step error {step:5.2f} SE   SE <= {np.max(se[k]):.1e}")
        summary["descent"].append(dict(t=times[k], max_abs_z=z, step_error_in_se=step, se_max=np.max(se[k])))
        verdict(z <= Z_MC, f"t = {times[k]:.2f}: descent on batches matches the flow within 4 standard errors")
    return flows, t, summary


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=".", help="directory for the CSV files and the figure")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the files of an earlier run that its looped_depth.json lists unchanged")
    args = parser.parse_args(argv)
    out = records.OutFolder(args.out, "examples/looped_depth.py", "looped_depth.json",
                            ["looped_depth.csv", "one_layer_flow.csv", "looped_depth.png"], args.overwrite)
    del verdicts[:]
    start = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    families = exact_families()
    trained = trained_tied(rng)
    curvature = curvature_at_the_family_point(rng)
    flows, t, flow = flow_and_descent(rng)
    keys = sorted({k for r in families + trained + curvature for k in r})
    out.write_csv("looped_depth.csv", [dict(part=part, **r) for part, rows in
                                       (("exact", families), ("trained", trained), ("curvature", curvature))
                                       for r in rows], ["part"] + keys)
    f = io.StringIO(newline="")
    w = csv.writer(f)
    w.writerow(["t"] + [f"loss_{name}" for name in flows])
    for i, ti in enumerate(t):
        w.writerow([ti] + [flows[name]["loss"][i] for name in flows])
    out.write("one_layer_flow.csv", f.getvalue())
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
        sparse = [r for r in families if r["family"] == "sparse"]
        ax1.semilogy([r["L"] for r in sparse], [r["loss_untied"] for r in sparse], "o-", label="untied optimum")
        ax1.semilogy([r["L"] for r in sparse], [r["loss_tied"] for r in sparse], "s-", label="tied optimum")
        ax1.set(xlabel="layers L", ylabel="population loss", title="sparse family, n = 20, d = 5")
        ax1.legend()
        for name, f in flows.items():
            ax2.loglog(t[1:], f["loss"][1:], label=f"sigma {name} [Z]'s bound")
        ax2.set(xlabel="t (icl_ref's loss, no 1/2)", ylabel="population loss", title="one-layer gradient flow")
        ax2.legend()
        fig.tight_layout()
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=120)
        out.write("looped_depth.png", png.getvalue())
    except ImportError:
        print("matplotlib not installed: no figure")
    passed = sum(v == "PASS" for v, _ in verdicts)
    argv = sys.argv[1:] if argv is None else argv
    print(out.write_record(dict(
        provenance=records.provenance("examples/looped_depth.py", argv, ["icl_ref.py", "examples/looped_depth.py"]),
        seed=args.seed, checks_passed=passed, checks=len(verdicts), verdicts=verdicts, exact=families,
        trained=trained, curvature=curvature, flow=flow)))
    print(f"\n{passed} of {len(verdicts)} checks passed in {time.perf_counter() - start:.0f} s")
    return 0 if passed == len(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
