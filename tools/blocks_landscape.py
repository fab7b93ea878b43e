"""Map the local minima of Theorem 4's exact blocks-family loss and certify each one.

    python3 tools/blocks_landscape.py [--starts 400] [--n 20] [--d 5] [--seed 0] [--out docs/blocks_landscape.json]

The family A_l = a_l Sigma^-1, B_l = b_l I (l < L - 1; B_{L-1} never enters) with L = 3 has the five
scalars (a_0, a_1, a_2, b_0, b_1) and an exact population loss (MATH.md §10). The search: L-BFGS-B
on the exact Gauss rule (icl_ref.family_local_minimum) from `starts` points drawn uniformly in the box
a_l in [0, 15], b_l in [-1, 3] (the global optimum and every minimum found lie well inside it);
endpoints with a gradient above 1e-6 (central differences of the Gauss rule's loss) are dropped, the
rest grouped by their loss and scalars. Each
group's point is then certified with the exact rational loss (family_population_loss, no float
summation): the gradient by central differences at h = 1e-6 (truncation ~h^2, rounding of the
exact values ~1e-19 / h), the Hessian by second differences at h = 1e-4; a strict local minimum has
a gradient near 0 and a positive definite Hessian. Completeness: the count of distinct minima after
each quarter of the starts (it should stop growing). Prints a Markdown table and writes the record
(every certified minimum, the endpoints that failed, the provenance of tools/records.py) that
MATH.md §10's table and docs/FINDINGS.md finding 9 quote (`python3 tools/records.py render`; test_records.py
checks each minimum under the current code). About three minutes on 2 cores. Exit status: 0 written, 2 bad
arguments or the record refused (a symbolic link).
"""
import argparse
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

import icl_ref as ir  # noqa: E402
import records  # noqa: E402  (tools/records.py: the provenance)

SOURCES = ["icl_ref.py", "tools/blocks_landscape.py"]          # the code the record comes from
RECORD = os.path.join("docs", "blocks_landscape.json")


def exact_loss(x, n, d):
    return ir.family_population_loss(x[:3], n, d, b=[x[3], x[4], np.nan])


def gauss_rule_loss(x, nodes, weights):
    """The family loss E tr p(S)^2 by the exact Gauss rule (float64, every term >= 0, so no
    cancellation): p_{l+1} = p_l (1 - a_l s_l), s_{l+1} = s_l (1 - a_l b_l s_l)^2, s_0 = t (MATH.md §10)."""
    p, s = np.ones_like(nodes), nodes.copy()
    for a_l, b_l in zip(x[:3], [x[3], x[4], 0.0]):
        p, s = p * (1 - a_l * s), s * (1 - a_l * b_l * s) ** 2
    return float(weights @ p ** 2)


def gauss_rule_gradient(x, nodes, weights, h=1e-7):
    """Central differences of gauss_rule_loss: truncation ~h^2, rounding ~1e-16 f / h, both far below
    the 1e-6 that tells a stationary endpoint from a stopped one."""
    return np.array([(gauss_rule_loss(x + h * e, nodes, weights) - gauss_rule_loss(x - h * e, nodes, weights))
                     / (2 * h) for e in np.eye(5)])


def derivatives(x, n, d):
    """The exact loss's gradient (5,) and Hessian (5, 5) at x by central differences."""
    f = lambda v: exact_loss(v, n, d)
    E = np.eye(5)
    grad = np.array([(f(x + 1e-6 * e) - f(x - 1e-6 * e)) / 2e-6 for e in E])
    h = 1e-4
    H = np.array([[(f(x + h * (ei + ej)) - f(x + h * (ei - ej)) - f(x - h * (ei - ej)) + f(x - h * (ei + ej)))
                   / (4 * h * h) for ej in E] for ei in E])
    return grad, (H + H.T) / 2


def certify(x, n, d, steps=3):
    """x polished by Newton steps on the exact loss, its gradient and its Hessian's eigenvalues."""
    for _ in range(steps):
        grad, H = derivatives(x, n, d)
        x = x - np.linalg.solve(H, grad)
    grad, H = derivatives(x, n, d)
    return x, grad, np.linalg.eigvalsh(H)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--starts", type=int, default=400)
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--d", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(ROOT, RECORD), help="the record to write (JSON)")
    args = ap.parse_args(argv)
    start_time, rng = time.perf_counter(), np.random.default_rng(args.seed)
    nodes, weights = ir.wishart_quadrature(args.n, args.d, 14)   # exact to degree 27 >= 2 deg p = 26
    found = []
    with np.errstate(over="ignore", invalid="ignore"):          # far starts overflow the Gauss rule
        for k in range(args.starts):
            start = np.r_[rng.uniform(0, 15, 3), rng.uniform(-1, 3, 2)]
            try:
                a, b, f_end = ir.family_local_minimum(start[:3], args.n, args.d, b=np.r_[start[3:], 0.0])
            except (ValueError, OverflowError):                 # a descent that ran off to infinity
                continue
            x_end = np.r_[a, b[:2]]
            if np.isfinite(f_end) and np.max(np.abs(gauss_rule_gradient(x_end, nodes, weights))) <= 1e-6 and not any(
                    abs(f_end - f) <= 1e-9 * f and np.max(np.abs(x_end - x)) < 1e-3 for f, x, _ in found):
                found.append((f_end, x_end, k))
        certified = [(k, *certify(x, args.n, args.d)) for _, x, k in found]
    minima = sorted([c for c in certified if c[3][0] > 0 and np.max(np.abs(c[2])) < 1e-8],
                    key=lambda c: exact_loss(c[1], args.n, args.d))
    marks = [args.starts * q // 4 for q in (1, 2, 3, 4)]
    print("strict local minima found within the first k starts: "
          + ", ".join(f"{m}: {sum(k < m for k, *_ in minima)}" for m in marks)
          + f"; {len(certified) - len(minima)} other endpoints failed the certificate (not minima)")
    print("| loss (exact) | a | b | max |gradient| | Hessian eigenvalues | first found at start |")
    print("|---|---|---|---|---|---|")
    for k, x, grad, eig in minima:
        print(f"| {exact_loss(x, args.n, args.d):.6e} | ({', '.join(f'{v:.4f}' for v in x[:3])}) | "
              f"({x[3]:.4f}, {x[4]:.4f}) | {np.max(np.abs(grad)):.1e} | {', '.join(f'{v:.2e}' for v in eig)} | {k} |")
    record = dict(provenance=records.provenance(
                      ["tools/blocks_landscape.py", "--starts", str(args.starts), "--n", str(args.n), "--d", str(args.d),
                       "--seed", str(args.seed)], SOURCES, time.perf_counter() - start_time),
                  starts=args.starts, n=args.n, d=args.d, seed=args.seed,
                  failed_certificate=len(certified) - len(minima),
                  minima=[dict(loss=exact_loss(x, args.n, args.d), a=list(x[:3]), b=list(x[3:]),
                               max_gradient=float(np.max(np.abs(grad))), hessian_eigenvalues=list(eig), first_start=k)
                          for k, x, grad, eig in minima])
    return records.save(args.out, record)


if __name__ == "__main__":
    sys.exit(main())
