"""Copy the figures and tables the documents show and quote from a full run of experiments.py into docs/.

    python3 tools/docs_figures.py             # a full run now, in a temporary folder (8-15 min; matplotlib)
    python3 tools/docs_figures.py --from DIR  # a full run made earlier here (DIR: its --out)

A run is copied only when its record (config.json) says it is complete, full size, seed 0, of every
experiment, of the experiments' code (experiments.SOURCES) committed and unchanged since, each file with the
SHA-256 the record lists. What the documents show (`shown`) is copied, never through a symbolic link, and
docs/figures.json records the provenance (docs/RECORDS.md) and each experiment's wall-clock and CPU seconds.

Exit statuses: 0 copied; 2 bad arguments, a run that may not be copied (the message says why; nothing is
written) or docs/ refused; else a full run's own status when it did not complete (one with a failed claim,
status 1, is copied: the documents quote its verdicts).
"""
import argparse
import json
import math
import os
import re
import stat
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tools"), ROOT]

import benchmarks  # noqa: E402  (tools/benchmarks.py: the machine's description)
import experiments  # noqa: E402
import experiments_beyond  # noqa: E402,F401  (the experiments beyond the paper in EXPERIMENTS)
import icl_files  # noqa: E402
import records  # noqa: E402  (tools/records.py: the provenance)


def shown(files):
    """The run's files (names) the documents show: figures they link to, each PNG with its PDF, and tables a block reads."""
    text = "".join(records.read(doc) for doc in records.DOCS)
    pngs = set(re.findall(r"([\w-]+\.png)\)", text))
    named = pngs | {p[:-len("png")] + "pdf" for p in pngs} | {f"{t}.csv" for t in re.findall(r"rows?\('([\w-]+)/", text)}
    return sorted(f for f in files if f in named)


def why_not(run, files):
    """Why the run with the record `run` and the files `files` ({name: bytes}) may not be copied ([]: it may)."""
    changed = records.changed_since(run.get("commit"), experiments.SOURCES)
    return [what for what, bad in (
        ("not complete", run.get("status") != "complete"), ("a --quick run", run.get("quick") is not False),
        ("not seed 0", run.get("seed") != 0), ("missing an experiment", set(experiments.EXPERIMENTS) - set(run.get("completed", []))),
        ("made from uncommitted changes to the experiments' code", run.get("dirty") is not False),
        (f"of code changed since: {changed}", changed != []), ("without figures", not any(".png" in f for f in files)),
        ("missing files or files not as its record lists them", not files or any(
            icl_files.sha256(data) != run.get("files", {}).get(name) for name, data in files.items()))) if bad]


def regular_bytes(path):
    """The bytes of the regular file `path`, seen (lstat) before it is opened (a FIFO would block); else OSError."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise OSError(f"{path} is {icl_files._kind(st)}, not a regular file")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        if not icl_files._same(st, os.fstat(fd)):
            raise OSError(f"{path} was replaced while being opened")
        return f.read()


def copy_from(out):
    """Copy the run in the folder `out` into docs/ and write docs/figures.json; the exit status."""
    try:
        run = json.loads(regular_bytes(os.path.join(out, "config.json")))
        try:                           # the fields read here, of their types, or it is no record of experiments.py
            times = {n: {k: float(run["experiments"][n][k]) for k in ("seconds", "cpu_seconds")} for n in run["completed"]}
            files = {name: regular_bytes(os.path.join(out, name)) for name in shown(run["files"])}
            problems = why_not(run, files)
        except (LookupError, TypeError, AttributeError) as e:
            raise ValueError(f"config.json is not a record of experiments.py ({e!r})") from None
    except (OSError, ValueError, RecursionError) as e:        # RecursionError: JSON nested too deep to read
        problems = [f"not a full run's folder: {e}"]
    if problems:
        print(f"{out}: the run is {'; '.join(problems)}: not copying it", file=sys.stderr)
        return 2
    try:
        for name, data in files.items():
            records.write(f"docs/{name}", data)
        records.write(records.TOOLS["figures"][0], dict(
            provenance=records.provenance(records.TOOLS["figures"][1], list(experiments.SOURCES),
                                          math.fsum(t["seconds"] for t in times.values()), [f"docs/{n}" for n in files],
                                          state=dict(commit=run["commit"], dirty=False)),
            timing=dict(machine=benchmarks.machine()[0], experiments=times)))     # --from takes a run made here
    except (icl_files.Refused, icl_files.WriteFailed) as e:
        print(f"docs/ refused: {e}", file=sys.stderr)
        return 2
    print(f"copied {', '.join(files)}; wrote {records.TOOLS['figures'][0]}")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__[__doc__.index("Exit statuses"):])
    ap.add_argument("--from", dest="source", help="a full run's folder (its --out) to copy from")
    args = ap.parse_args(argv)
    if args.source:
        return copy_from(args.source)
    if icl_files.source_state(experiments.SOURCES, ROOT)["dirty"] is not False:
        print("the experiments' code has uncommitted changes (or is no git checkout): commit first", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        status = subprocess.run([sys.executable, os.path.join(ROOT, "experiments.py"), "--out", tmp]).returncode
        return copy_from(tmp) if status in (0, 1) else status


if __name__ == "__main__":
    sys.exit(main())
