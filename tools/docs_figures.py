"""Regenerate the figures the README shows (docs/*.png) and the tables its findings quote (docs/*.csv)
from the full-size experiments, and record which code made them (docs/figures.json).

    python3 tools/docs_figures.py             # a full run of every experiment (about 8 min; matplotlib)
    python3 tools/docs_figures.py --from DIR  # copies them from a full run of the current code in DIR, made here

Runs every experiment (seed 0, full size) with experiments.py into a temporary directory, or takes
a complete full run, seed 0, whose record carries the current code's digest (README quotes the full
run's time from the record's timing, so it is always a whole run's). Copies the PNGs and the quoted
CSVs into docs/ and writes docs/figures.json: the provenance of
tools/records.py (the code of icl_ref.py, icl_fast.py and experiments.py that computed and drew
them) and the SHA-256 of each file. `python3 tools/records.py check` reports them stale when that
code has changed since; `python3 tools/records.py render` writes the numbers README quotes from the
tables.
"""
import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

import benchmarks  # noqa: E402  (tools/benchmarks.py: the machine's description)
import records  # noqa: E402  (tools/records.py: the provenance)

FIGURES = ["three-layer-sparse_heatmaps.png", "three-layer-blocks_heatmaps.png", "depth.png", "single-layer-landscape.png",
           "looped.png", "dynamics.png", "task-diversity.png", "shift.png"]
# the tables docs/FINDINGS.md quotes (test_docs.py checks the quotes against them)
TABLES = ["single-layer-landscape.csv", "single-layer-landscape_basins.csv", "three-layer-sparse.csv",
          "three-layer-blocks.csv", "two-layer-isotropic.csv", "softmax-two-head.csv", "unconstrained.csv",
          "optimizers.csv", "looped.csv", "looped_exact.csv", "looped_trained.csv", "looped_curvature.csv", "dynamics.csv",
          "dynamics_descent.csv", "task-diversity.csv", "task-diversity_pools.csv", "shift.csv", "shift_shifts.csv"]
RECORD = os.path.join("docs", "figures.json")


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def copy_from(out, digest, names):
    """Copy the figures of the run in `out` into docs/ after checking that its record is a complete
    full run, seed 0, of the experiments `names` in the code with `digest`; returns the record."""
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    problems = [what for what, bad in (("not complete", config.get("status") != "complete"),
                                       ("a --quick run", config.get("quick")), ("not seed 0", config.get("seed") != 0),
                                       ("of other code", config.get("sources_sha256") != digest),
                                       ("missing an experiment", not set(names) <= set(config.get("completed", []))))
                if bad]
    if problems:
        raise SystemExit(f"{out}: the run is {', '.join(problems)}: not copying its figures")
    os.makedirs(os.path.join(ROOT, "docs"), exist_ok=True)
    for name in FIGURES + TABLES:
        shutil.copy(os.path.join(out, name), os.path.join(ROOT, "docs", name))
        print(f"docs/{name}")
    return config


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--from", dest="source", help="a complete full run (seed 0) of the current code to copy from")
    args = ap.parse_args(argv)
    import experiments
    digest, names = experiments.sources_digest(), list(experiments.EXPERIMENTS)
    if args.source:
        config = copy_from(args.source, digest, names)
    else:
        try:
            import matplotlib  # noqa: F401  (only checked here; experiments.py draws)
        except ImportError:
            print("needs matplotlib: python3 -m pip install matplotlib", file=sys.stderr)
            return 2
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "results")
            proc = subprocess.run([sys.executable, os.path.join(ROOT, "experiments.py"), "--out", out])
            if proc.returncode not in (0, 1):
                return proc.returncode
            config = copy_from(out, digest, names)
    # how long each experiment of the run took (docs/benchmarks.md's last table), on this machine
    # (--from takes a run made here)
    timing = dict(machine=benchmarks.machine()[0],
                  experiments={name: dict(seconds=config["experiments"][name]["seconds"],
                                          cpu_seconds=config["experiments"][name]["cpu_seconds"])
                               for name in config["completed"]})
    record = dict(provenance=records.provenance("tools/docs_figures.py", [], list(experiments.SOURCES)),
                  experiments=names, seed=0, timing=timing,
                  figures={name: sha256(os.path.join(ROOT, "docs", name)) for name in FIGURES + TABLES})
    with open(os.path.join(ROOT, RECORD), "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    print(RECORD)
    return 0


if __name__ == "__main__":
    sys.exit(main())
