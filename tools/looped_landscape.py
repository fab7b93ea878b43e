"""The looped (weight-tied) sparse model's landscape at the family point and beyond it, certified (MATH.md §14).

    python3 tools/looped_landscape.py [--n 20] [--d 5] [--samples 200000] [--seed 0] [--out docs/looped_landscape.json]

In whitened coordinates the tied sparse model's noiseless population loss is f(W) = E ||(I - W^T S)^L||_F^2
(S the whitened sample covariance of n points in d dimensions). At the family point a*_L I (L steps of
preconditioned GD with one step size) its Hessian has three eigenvalues (identity, symmetric traceless,
antisymmetric). This tool records, for L = 1..4:

- each eigenvalue by three paths that share no formula: the closed form from exact Wishart moments
  (icl_looped.tied_family_hessian_eigenvalues), the Rayleigh quotients of the exact polynomial's Hessian
  (tied_hessian: complex steps of the gradient of tied_loss_polynomial), and a Monte Carlo over `samples`
  draws of S of the exact per-sample second derivatives (mc_family_hessian_eigenvalues), with its SE; and
  the antisymmetric one's two parts, stretch >= 0 and twist <= 0 (antisymmetric_curvature_parts, exact);
- where the family point is a saddle (antisymmetric eigenvalue < 0) at L = 1..6, n = 10, 20, 40, 80;
- the points a descent of the exact f reaches from a*_L I + eps G / |G|_F (tied_descent_from_family: G a
  random Gaussian matrix from the seed, eps = 0.05, off every fixed-point set of a rotation subgroup) and
  from the rotation-block starts of tied_minima_from_family, each certified (the exact gradient's norm, the orbit's dimension, the
  Hessian's eigenvalues modulo the rotation orbit) and, off the family point, checked by a Monte Carlo over
  fresh samples of S (mc_certificate: the loss with the family point's exact loss as control variate, the
  reduced Hessian's smallest eigenvalue) and by the paired difference of per-sample losses against the
  family point on the same samples (mean and SE: no control coefficient, nothing estimated but a mean);
- at L = 3 the saddle between the family point and the second minimum (tied_block_saddle);
- at L = 4 and n = SCAN_NS (d as given), the point the same tilted descent reaches, certified by its exact
  gradient and reduced Hessian (no Monte Carlo): how the lower minimum and its distance from the family's multiple of the identity change as n grows (the regime in
  which results on looped models, Gatmiry et al.'s among them, are stated).

Writes the record (docs/looped_landscape.json, provenance of tools/records.py) that docs/FINDINGS.md
finding 17 quotes (`python3 tools/records.py render`; test_records.py checks it under the current code).
About two minutes on 2 cores at 200000 samples. Exit status: 0 written, 2 bad arguments or the record
refused (a symbolic link).
"""
import argparse
import math
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

import icl_looped as lp  # noqa: E402
import records  # noqa: E402  (tools/records.py: the provenance)

SOURCES = ["icl_ref.py", "icl_looped.py", "tools/looped_landscape.py"]     # the code the record comes from
RECORD = os.path.join("docs", "looped_landscape.json")
SUBSPACES = ("identity", "symmetric", "antisymmetric")
EPS = 0.05            # the tilt off the family point: small, so the descent starts inside the saddle's neighbourhood
SCAN_L, SCAN_NS = 4, (20, 40, 80, 160, 320, 640)   # doublings from the paper's n, while f stays far above its rounding


def hessian_rows(n, d, S):
    """The three eigenvalues at a*_L I, L = 1..4, by the closed form, the polynomial's Hessian and Monte Carlo."""
    out = []
    for L in (1, 2, 3, 4):
        a = lp.tied_family_step(L, n, d)
        closed = lp.tied_family_hessian_eigenvalues(L, n, d, a)
        H = lp.tied_hessian(float(a) * np.eye(d), L, n, d)
        poly = [float(np.trace(U.T @ H @ U) / U.shape[1]) for U in lp.subspace_bases(d)]
        mc = lp.mc_family_hessian_eigenvalues(L, S, float(a))
        stretch, twist = lp.antisymmetric_curvature_parts(L, n, d, a)
        r = dict(L=L, a=float(a), B=int(S.shape[0]), stretch=stretch, twist=twist)
        for s, c, p, (m, se) in zip(SUBSPACES, closed, poly, mc):
            r.update({s: c, f"poly_{s}": p, f"mc_{s}": m, f"mc_{s}_se": se})
        out.append(r)
        print(f"L = {L}: a* = {float(a):.6f}; antisymmetric {closed[2]:+.6f} (polynomial {poly[2]:+.6f}, "
              f"Monte Carlo {mc[2][0]:+.6f} +- {mc[2][1]:.6f}; stretch {stretch:.6f}, twist {twist:+.6f}); symmetric {closed[1]:.5f}, identity {closed[0]:.5f}")
    return out


def point_row(name, start, m, L, S=None):
    """A located point's certificate (tied_local_minimum's or tied_block_saddle's dict), with the Monte Carlo
    checks on S when given."""
    a, _, f0 = lp.optimal_tied_family(L, *m["sizes"])
    W = m["W"]
    T, _, normal = lp.rotation_normal_form(W)
    lam = np.asarray(m["reduced_eigenvalues"])
    r = dict(name=name, L=L, start=start, loss=m["loss"], family_loss=f0, relative_to_family=m["loss"] / f0 - 1,
             grad_norm=m["grad_norm"], orbit_dim=int(m["orbit_dim"]), index=int(np.sum(lam < 0)),
             reduced_eigenvalues=[float(x) for x in lam], normal=bool(normal),
             real_eigenvalues=[float(T[i, i]) for i in range(T.shape[0]) if (i == 0 or T[i, i - 1] == 0)
                               and (i + 1 == T.shape[0] or T[i + 1, i] == 0)],
             rotation_blocks=[[float(T[i, i]), float(T[i, i + 1])] for i in range(T.shape[0] - 1) if T[i, i + 1] > 0],
             antisymmetric_ratio=float(np.linalg.norm(W - W.T) / np.linalg.norm(W + W.T)),
             at_family=bool(m["orbit_dim"] == 0), W=[[float(x) for x in row] for row in W])
    if S is not None and not r["at_family"]:
        c = lp.mc_certificate(W, S, L, control=(a * np.eye(W.shape[0]), f0))
        diff = lp.per_sample_loss(W, S, L) - lp.per_sample_loss(a * np.eye(W.shape[0]), S, L)
        r.update(B=int(S.shape[0]), mc_loss=c["loss"], mc_loss_se=c["loss_se"], control_c=c["control_c"],
                 mc_reduced_min=c["reduced_min"], mc_reduced_min_se=c["reduced_min_se"],
                 paired_difference=float(np.mean(diff)), paired_difference_se=float(np.std(diff, ddof=1) / math.sqrt(diff.size)))
    print(f"{name} (from {start}): loss {r['loss']:.13f} ({r['relative_to_family']:+.4%} of the family's), |grad| "
          f"{r['grad_norm']:.1e}, orbit {r['orbit_dim']}, reduced Hessian from {lam[0] if lam.size else math.nan:+.6f}, "
          f"index {r['index']}" + (f"; Monte Carlo {r['mc_loss']:.6f} +- {r['mc_loss_se']:.6f}, paired difference "
                                   f"{r['paired_difference']:+.6f} +- {r['paired_difference_se']:.6f}, reduced min "
                                   f"{r['mc_reduced_min']:.4f} +- {r['mc_reduced_min_se']:.4f}" if "mc_loss" in r else ""))
    return r


def landscape_points(n, d, rng, S):
    """The points reached from the family point tilted by EPS G / |G| (G random Gaussian) at L = 2, 3, 4,
    from its rotation-block starts, the one-block saddle at L = 4 and the mountain pass at L = 3."""
    out = []
    for L in (2, 3, 4):
        m = lp.tied_descent_from_family(L, n, d, rng, EPS)
        out.append(point_row(f"L{L}-tilted", f"a*_{L} I + {EPS} G / |G|", dict(m, sizes=(n, d)), L, S))
        for f in lp.tied_minima_from_family(L, n, d, betas=(0.1, 0.35)):
            if f["orbit_dim"] > 0:
                out.append(point_row(f"L{L}-minimum-{len(f['starts'])}", "a*_L I + " + ", ".join(
                    f"{b} J_{k}" for b, k in f["starts"]), dict(f, sizes=(n, d)), L, S))
    a = lp.optimal_tied_family(4, n, d)[0]
    one = lp.tied_local_minimum(a * np.eye(d) + 0.35 * lp.block_direction(d, 1), 4, n, d)
    out.append(point_row("L4-one-block", "a*_4 I + 0.35 J_1 (stays on its fixed-point set)", dict(one, sizes=(n, d)), 4))
    second = [r for r in out if r["L"] == 3 and not r["at_family"]]
    if second:
        s = lp.tied_block_saddle(3, n, d, 1, second[0]["rotation_blocks"][0][1], points=41)
        out.append(point_row("L3-saddle", "the block profile's peak", dict(s, sizes=(n, d)), 3))
    return out


def scan_rows(d, rng):
    """At L = SCAN_L, for each n in SCAN_NS: the family point's antisymmetric eigenvalue and the point the tilted
    descent reaches from it, certified, with the eigenvalue range of W's symmetric part (the preconditioner's
    quadratic form against Sigma^-1 in whitened coordinates) and its rotation blocks."""
    out = []
    for n in SCAN_NS:
        m = lp.tied_descent_from_family(SCAN_L, n, d, rng, EPS)
        W = m["W"]
        sym = np.linalg.eigvalsh((W + W.T) / 2)
        T = lp.rotation_normal_form(W)[0]
        lam = np.asarray(m["reduced_eigenvalues"])
        r = dict(L=SCAN_L, n=n, a=m["family_a"], family_antisymmetric=float(lp.tied_family_hessian_eigenvalues(SCAN_L, n, d)[2]),
                 family_loss=m["family_loss"], loss=m["loss"], relative_to_family=m["relative_to_family"],
                 grad_norm=m["grad_norm"], orbit_dim=int(m["orbit_dim"]), index=int(np.sum(lam < 0)),
                 reduced_min=float(lam[0]), is_minimum=m["is_minimum"], symmetric_min=float(sym[0]),
                 symmetric_max=float(sym[-1]), rotation_blocks=[[float(T[i, i]), float(T[i, i + 1])]
                                                                 for i in range(d - 1) if T[i, i + 1] > 0],
                 antisymmetric_ratio=float(np.linalg.norm(W - W.T) / np.linalg.norm(W + W.T)),
                 W=[[float(x) for x in row] for row in W])
        out.append(r)
        print(f"L = {SCAN_L}, n = {n}: family antisymmetric {r['family_antisymmetric']:+.3e}; descent ends "
              f"{r['relative_to_family']:+.4%} of the family's loss {r['family_loss']:.4e}, index {r['index']}, orbit "
              f"{r['orbit_dim']}, reduced Hessian from {r['reduced_min']:.3e}, |grad| {r['grad_norm']:.1e}; W's symmetric "
              f"part in [{r['symmetric_min']:.4f}, {r['symmetric_max']:.4f}], |W - W^T| / |W + W^T| {r['antisymmetric_ratio']:.3f}")
    return out


def character_rows(d):
    rows = lp.family_point_character([1, 2, 3, 4, 5, 6], [10, 20, 40, 80], d)
    for r in rows:
        r["antisymmetric"] = float(r["antisymmetric"])
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--d", type=int, default=5)
    ap.add_argument("--samples", type=int, default=200000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(ROOT, RECORD), help="the record to write (JSON)")
    args = ap.parse_args(argv)
    if args.n < 1 or args.d < 2 or args.samples < 2:
        ap.error("need n >= 1, d >= 2 (the antisymmetric directions) and samples >= 2")
    start_time, rng = time.perf_counter(), np.random.default_rng(args.seed)
    n, d = args.n, args.d
    # two independent sets of samples: one for the curvatures, one (fresh) for the located points
    hessian = hessian_rows(n, d, lp.sample_whitened_covariances(rng, args.samples, n, d))
    character = character_rows(d)
    points = landscape_points(n, d, rng, lp.sample_whitened_covariances(rng, args.samples, n, d))
    scan = scan_rows(d, rng)
    record = dict(provenance=records.provenance(
                      ["tools/looped_landscape.py", "--n", str(n), "--d", str(d), "--samples", str(args.samples),
                       "--seed", str(args.seed)], SOURCES, time.perf_counter() - start_time),
                  n=n, d=d, samples=args.samples, seed=args.seed, eps=EPS,
                  hessian=hessian, character=character, points=points, scan=scan)
    return records.save(args.out, record)


if __name__ == "__main__":
    sys.exit(main())
