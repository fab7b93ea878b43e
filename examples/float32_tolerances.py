"""Measure float32 errors of a PyTorch linear transformer against icl_ref's float64, over a grid.

    python examples/float32_tolerances.py            (needs torch: pip install torch)
    python examples/float32_tolerances.py --record   (also writes docs/float32_tolerances.json)

Model: the authors' layout (examples/test_torch_linear_transformer.py), evaluated in float32 on
float32-rounded inputs, against icl_ref in float64 on the same rounded inputs (so only the
arithmetic differs). Parameters: the exact sparse-family optimum a_l I (x ~ N(0, I), w* ~ N(0, I))
plus a random perturbation of every trainable block of size 0.1/sqrt(d), so the gradient is
generic and O(loss). Errors are max|a - b| / max|b| per array; the table gives the worst over
d in {2, 5, 10, 20} and n in {5, 20, 50, 200} for each L, and suggested tolerances. The record
carries its provenance (tools/records.py: the commit of SOURCES, the versions), so
`python3 tools/records.py check` says when the code that measured it has changed.
"""
import argparse
import itertools
import math
import os
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))
import records                                              # noqa: E402  (the record's provenance)
import icl_check as ic                                      # noqa: E402  (the adapters)
import icl_ref as ir                                        # noqa: E402
from test_torch_linear_transformer import model           # noqa: E402

RECORD = os.path.join("docs", "float32_tolerances.json")
SOURCES = ("icl_ref.py", "examples/float32_tolerances.py", "examples/test_torch_linear_transformer.py")
GRID = dict(d=(2, 5, 10, 20), n=(5, 20, 50, 200), L=(1, 2, 3, 4))
KINDS = ("forward", "loss", "gradient")                    # Z_L, the loss, the gradient


def suggested(worst):
    """5x the worst relative error, rounded up to a power of 10."""
    return 10.0 ** math.ceil(math.log10(5 * worst))


def errors(d, n, L, B=64, seed=0):
    rng = np.random.default_rng([seed, d, n, L])
    Z, y = ir.sample_prompts(rng, B, n, np.eye(d))
    a, _, _ = ir.optimal_family_scalars(L, n, d, starts=4)
    allparam = 0.1 / math.sqrt(d) * rng.standard_normal((L, 1, 2, d, d))
    allparam[:, 0, 1] -= a[:, None, None] * np.eye(d)          # authors' Q block = -A^T
    Z_rows = ic.tokens_as_rows(Z).astype(np.float32)
    y, allparam = y.astype(np.float32), allparam.astype(np.float32)
    ap = torch.tensor(allparam, requires_grad=True)
    out = model(ap, torch.tensor(Z_rows))
    loss = torch.mean((out[:, -1, -1] + torch.tensor(y)) ** 2)
    loss.backward()
    P, Q = ic.params_from_authors(allparam.astype(np.float64))
    Z64 = ic.tokens_as_columns(Z_rows.astype(np.float64))
    ref_loss, dP, dQ = ir.loss_and_grad(P, Q, Z64, y.astype(np.float64))
    ref_out = ic.tokens_as_rows(ir.forward(P, Q, Z64))
    rel = lambda a, b: float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
    return (rel(out.detach().numpy().astype(np.float64), ref_out), abs(loss.item() - ref_loss) / ref_loss,
            rel(ap.grad.numpy().astype(np.float64), ic.grads_to_authors(dP, dQ)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--record", action="store_true", help=f"also write {RECORD}")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    ds, ns, Ls = GRID["d"], GRID["n"], GRID["L"]
    worst = {L: np.zeros(3) for L in Ls}
    for d, n, L in itertools.product(ds, ns, Ls):
        worst[L] = np.maximum(worst[L], errors(d, n, L))
    print(f"torch {torch.__version__}, numpy {np.__version__}; worst over d in {ds}, n in {ns}\n")
    print("| L | forward Z_L | loss | gradient |\n|---|---|---|---|")
    for L in Ls:
        print(f"| {L} | " + " | ".join(f"{e:.1e}" for e in worst[L]) + " |")
    overall = np.max(list(worst.values()), axis=0)
    suggest = [suggested(e) for e in overall]
    print(f"\nsuggested rtol (5x the worst, rounded up to a power of 10): forward {suggest[0]:.0e}, "
          f"loss {suggest[1]:.0e}, gradient {suggest[2]:.0e}")
    if args.record:
        record = dict(provenance=records.provenance(["examples/float32_tolerances.py", "--record"], list(SOURCES),
                                                    time.perf_counter() - start, torch=torch.__version__), grid=GRID,
                      worst={str(L): dict(zip(KINDS, map(float, worst[L]))) for L in Ls},
                      overall=dict(zip(KINDS, map(float, overall))), suggested=dict(zip(KINDS, suggest)))
        records.write(RECORD, record)
        print(RECORD)


if __name__ == "__main__":
    main()
