"""The records under docs/: which code each came from, whether that code has changed since, and the
numbers README.md, MATH.md and docs/FINDINGS.md quote from them.

    python3 tools/records.py check                 # every stale record and why; seconds, computes nothing
    python3 tools/records.py refresh [NAME ...]    # rerun the tool of the named records (default: the stale ones)
    python3 tools/records.py render [--check]      # rewrite the documents' generated blocks (DOCS)

A record is a JSON file in docs/ written by one tool; its "provenance" names the tool, its arguments,
the date, the versions and a digest of the code it ran (per file and per top-level function or
method, of the syntax only: an edit of a comment, a docstring or the layout keeps it). A record whose
code has changed since is stale: `check` names the changed functions and the command that refreshes
it. Staleness is information, not an error of the library: the default test suite checks the records
by their content (test_docs.py), and `check` tells when a refresh is due.

README.md, MATH.md and docs/FINDINGS.md quote records between `<!-- begin NAME -->` and `<!-- end NAME -->`; `render`
writes each block from the record's fields (BLOCKS below), so a quoted number is never typed by hand.
A block whose record lacks a field is left as it is and reported.

"""
import argparse
import ast
import csv
import datetime
import hashlib
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ("README.md", "MATH.md", "docs/FINDINGS.md")


# ---------------------------------------------------------------------------------------------
# Provenance: a digest of the code a record came from
# ---------------------------------------------------------------------------------------------

def code_text(node):
    """What Python runs of a syntax tree `node`, as one canonical string: the tree with every bare
    string statement (docstrings) dropped, node by node with its non-empty fields, so comments,
    docstrings and layout do not count, and the same text on every supported Python."""
    if isinstance(node, list):
        return "[" + ",".join(code_text(x) for x in node if not (
            isinstance(x, ast.Expr) and isinstance(x.value, ast.Constant) and isinstance(x.value.value, str)
        )) + "]"
    if not isinstance(node, ast.AST):
        return repr(node)
    fields = ",".join(f"{k}={code_text(v)}" for k, v in ast.iter_fields(node) if v is not None and v != [])
    return f"{type(node).__name__}({fields})"


def _tree(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return ast.parse(f.read())


def combined_digest(files):
    """One SHA-256 over the code of `files` in order (experiments.sources_digest's form, which a record
    in the "sources" form carries as sources.sha256)."""
    h = hashlib.sha256()
    for name in files:
        h.update(name.encode() + b"\0" + code_text(_tree(name)).encode() + b"\0")
    return h.hexdigest()


def functions(path):
    """{qualified name: 16-hex digest} of every top-level function, class and method of a file, and
    "<module>" for the rest of its top-level statements (constants, imports), so a change can be
    named by the function it is in."""
    out, rest = {}, []
    for node in _tree(path).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = hashlib.sha256(code_text(node).encode()).hexdigest()[:16]
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        out[f"{node.name}.{sub.name}"] = hashlib.sha256(code_text(sub).encode()).hexdigest()[:16]
        else:
            rest.append(node)
    out["<module>"] = hashlib.sha256(code_text(rest).encode()).hexdigest()[:16]
    return out


def versions():
    out = {"python": platform.python_version()}
    for name in ("numpy", "scipy"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            pass
    return out


def provenance(tool, args, files, **extra):
    """The provenance a tool stores in its record: the tool and its arguments (the command that
    makes the record again), the date, the versions and the code of `files` (paths from the
    repository's root) file by file and function by function."""
    return dict(tool=tool, args=list(args), command=shlex.join(["python3", tool, *args]),
                date=datetime.date.today().isoformat(), versions=dict(versions(), **extra),
                code={f: dict(sha256=combined_digest([f]), functions=functions(f)) for f in files})


def code_changes(prov):
    """What changed in the code a record's provenance names: [] when nothing did."""
    changes = []
    if "code" in prov:
        for f, then in prov["code"].items():
            if not os.path.exists(os.path.join(ROOT, f)):
                changes.append(f"{f} no longer exists")
                continue
            if combined_digest([f]) == then["sha256"]:
                continue
            now = functions(f)
            old = then.get("functions", {})
            named = [f"{q} changed" for q in now if q in old and now[q] != old[q]]
            named += [f"{q} added" for q in now if q not in old] + [f"{q} removed" for q in old if q not in now]
            changes.append(f"{f}: " + ("; ".join(named) if named else "its code changed"))
    elif "sources" in prov:           # one digest over several files: the change is in one of them
        files = prov["sources"]["files"]
        missing = [f for f in files if not os.path.exists(os.path.join(ROOT, f))]
        if missing:
            changes.append(f"{', '.join(missing)} no longer exist(s)")
        elif combined_digest(files) != prov["sources"]["sha256"]:
            changes.append(f"the code of {', '.join(files)} changed (the record keeps one digest over "
                           "them, so the function is not known)")
    else:
        changes.append("the record names no code it came from")
    return changes


class Record:
    """A record in docs/: its file, the tool that writes it and its default arguments, and the files
    it writes besides (whose SHA-256 the record keeps, when it does)."""

    def __init__(self, name, path, tool, args=(), outputs_key=None):
        self.name, self.path, self.tool, self.args, self.outputs_key = name, path, tool, list(args), outputs_key

    def load(self):
        with open(os.path.join(ROOT, self.path), encoding="utf-8") as f:
            return json.load(f)

    def provenance(self, record):
        """The record's provenance: its "provenance" entry, or the "command" and "sources" at the top
        level (the form examples/float32_tolerances.py writes)."""
        return record.get("provenance") or {k: record[k] for k in ("command", "sources", "date") if k in record}

    def command(self, record):
        prov = self.provenance(record)
        if "args" in prov:
            return ["python3", self.tool, *prov["args"]]
        if "command" in prov:
            return shlex.split(prov["command"])
        return ["python3", self.tool, *self.args]


RECORDS = {r.name: r for r in [
    Record("figures", "docs/figures.json", "tools/docs_figures.py", outputs_key="figures"),
    Record("blocks_landscape", "docs/blocks_landscape.json", "tools/blocks_landscape.py"),
    Record("blocks_basins", "docs/blocks_basins.json", "tools/blocks_basins.py", ["--starts", "20", "--seed", "0"]),
    Record("benchmarks", "docs/benchmarks.json", "tools/benchmarks.py"),
    Record("float32_tolerances", "docs/float32_tolerances.json", "examples/float32_tolerances.py", ["--record"]),
]}
# the tables of the full run (experiments.py, copied by tools/docs_figures.py) come with the figures' record
CSV_RECORD = "figures"


def sha256_file(path):
    with open(os.path.join(ROOT, path), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def stale(name):
    """Why the record `name` is stale ([] when it is current)."""
    rec = RECORDS[name]
    if not os.path.exists(os.path.join(ROOT, rec.path)):
        return [f"{rec.path} does not exist"]
    try:
        record = rec.load()
    except ValueError as e:
        return [f"{rec.path} is not JSON: {e}"]
    reasons = code_changes(rec.provenance(record))
    written = record.get(rec.outputs_key, {}) if rec.outputs_key else {}
    if "figure_sha256" in record:                       # tools/blocks_basins.py's one figure
        written = {"blocks_basins.png": record["figure_sha256"]}
    for out, digest in written.items():
        path = os.path.join("docs", out)
        if not os.path.exists(os.path.join(ROOT, path)):
            reasons.append(f"{path} is missing")
        elif sha256_file(path) != digest:
            reasons.append(f"{path} is not the file the record lists (edited or copied since)")
    return reasons


# ---------------------------------------------------------------------------------------------
# Rendering: the generated blocks of README.md, MATH.md and docs/FINDINGS.md
# ---------------------------------------------------------------------------------------------

class Missing(Exception):
    """A block's record lacks a field (or a file): the block cannot be rendered until a refresh."""

    def __init__(self, record, what):
        super().__init__(f"{what}: run `python3 tools/records.py refresh {record}`")
        self.record = record


_cache = {}


def record(name):
    if name not in _cache:
        path = RECORDS[name].path
        if not os.path.exists(os.path.join(ROOT, path)):
            raise Missing(name, f"{path} does not exist")
        _cache[name] = RECORDS[name].load()
    return _cache[name]


def rows(experiment):
    """The rows of the full run's table docs/EXPERIMENT.csv."""
    key = f"csv:{experiment}"
    if key not in _cache:
        path = os.path.join(ROOT, "docs", f"{experiment}.csv")
        if not os.path.exists(path):
            raise Missing(CSV_RECORD, f"docs/{experiment}.csv does not exist")
        with open(path, encoding="utf-8") as f:
            _cache[key] = list(csv.DictReader(f))
    return _cache[key]


def column(experiment, field, kind=float):
    """The non-empty values of `field` in docs/EXPERIMENT.csv, in row order."""
    table = rows(experiment)
    values = [r[field] for r in table if r.get(field) not in (None, "")]
    if not values:
        raise Missing(CSV_RECORD, f"docs/{experiment}.csv lacks field {field}")
    return [kind(v) for v in values]


def field(experiment, name, kind=float):
    """The one value of `name` in docs/EXPERIMENT.csv (the rows that carry it must agree)."""
    values = column(experiment, name, kind)
    if len(set(values)) != 1:
        raise ValueError(f"docs/{experiment}.csv: {name} takes {len(set(values))} values {values}, one expected")
    return values[0]


def count(value):
    """A field that counts: a number, or a list of the things counted ("0.00062; 0.00062")."""
    try:
        return int(float(value))
    except ValueError:
        return len([v for v in re.split(r"[;,\s]+", value.strip("[]() ")) if v])


def truthy(value):
    return str(value).strip().lower() in ("true", "1", "yes")


def sci(x, digits):
    """x in scientific notation with `digits` decimals, as the documents write it: 9.6e-4, 9.613e-4."""
    return re.sub(r"e([-+])0*(\d)", r"e\1\2", f"{x:.{digits}e}").replace("e+", "e")


def short(x):
    """x to two significant digits: 9.6e-4, 3.9e-2."""
    return sci(x, 1)


WORDS = {0: "none", 1: "one", 2: "two", 3: "three", 4: "four", 5: "five"}


def table(head, body, indent=""):
    cell = lambda c: str(c).replace("|", "\\|")          # a | inside a cell would end it
    lines = ["| " + " | ".join(map(cell, head)) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(map(cell, r)) + " |" for r in body]
    return "\n".join(indent + line for line in lines)


def benchmark_table(title):
    for t in record("benchmarks")["tables"]:
        if t["title"] == title:
            return [dict(zip(t["head"], r)) for r in t["rows"]]
    raise Missing("benchmarks", f"docs/benchmarks.json lacks the table {title!r}")


def speed_range():
    ratios = [float(r["icl_ref s"]) / float(r["icl_fast s"]) for r in benchmark_table("loss_and_grad")]
    runs = {}
    for r in benchmark_table("Training at the paper's size"):
        runs.setdefault(r["run"], {})[r["module"]] = float(r["time s"])
    training = [t["icl_ref"] / t["icl_fast"] for t in runs.values()]
    return (f"{min(ratios):.1f}-{max(ratios):.1f} times icl_ref's speed on 2 cores for one `loss_and_grad` "
            f"(d = 1..20; training at the paper's size: {min(training):.1f}-{max(training):.1f} times)")


def speed():
    r = next((r for r in benchmark_table("loss_and_grad") if int(r["d"]) == 5), None)
    if r is None or "icl_ref / torch" not in r or "icl_ref / jax" not in r:
        raise Missing("benchmarks", "docs/benchmarks.json lacks the d = 5 row with torch and jax")
    return (f"takes {r['icl_ref / torch']} of a PyTorch implementation's time and {r['icl_ref / jax']} of JAX's "
            f"with icl_ref, {r['icl_fast / torch']} and {r['icl_fast / jax']} with icl_fast "
            f"({float(r['icl_ref s']) / float(r['icl_fast s']):.1f} times icl_ref's speed)")


KINDS = ("forward", "loss", "gradient")


def float32_exponents():
    return [round(math.log10(record("float32_tolerances")["suggested"][k])) for k in KINDS]


def float32_readme():
    rec = record("float32_tolerances")
    grid, worst = rec["grid"], [rec["overall"][k] for k in KINDS]
    return (f"(d in {{{', '.join(map(str, grid['d']))}}}, n in {{{', '.join(map(str, grid['n']))}}}, "
            f"L = {grid['L'][0]}..{grid['L'][-1]}; torch {RECORDS['float32_tolerances'].provenance(rec)['versions']['torch'].split('+')[0]}) erred at worst "
            f"by {short(worst[0])} (Z_L), {short(worst[1])} (loss) and {short(worst[2])} (gradient), relative. "
            f"Suggested `rtol` (5x, rounded up): {', '.join(f'1e{e}' for e in float32_exponents())}")


def float32_math():
    return "float32: " + ", ".join(f"$10^{{{e}}}$" for e in float32_exponents())


def blocks_optimum():
    f10, f20 = field("three-layer-blocks", "f_star_n10"), field("three-layer-blocks", "f_star_n20")
    log_loss = field("three-layer-blocks", "notebook_log_loss")
    return (f"{short(f20)} at n = 20 and {short(f10)} at n = 10; the notebook's reported final loss "
            f"exp({log_loss:.2f}) = {short(math.exp(log_loss))}")


def isotropic():
    dist = column("two-layer-isotropic", "dist_A0_I") + column("two-layer-isotropic", "dist_A1_I")
    return f"A_0, A_1 within {max(dist):.2g} of multiples of I"


def landscape_minima():
    rec = record("blocks_landscape")
    return rec["minima"], rec["starts"], max(m["first_start"] for m in rec["minima"]) + 1


def landscape_readme():
    minima, starts, first = landscape_minima()
    m, rec = minima[0], record("blocks_landscape")
    return (f"f* = {sci(m['loss'], 3)} at a = ({', '.join(f'{v:.3f}' for v in m['a'])}), b = "
            f"({', '.join(f'{v:.3f}' for v in m['b'])}) (n = {rec['n']}, d = {rec['d']}, L = {len(m['a'])}), the "
            f"exact blocks-family loss has {len(minima) - 1} more certified strict local minima, all found within "
            f"the first {first} of {starts} starts")


def landscape_table():
    minima, _, _ = landscape_minima()
    body = [[f"{m['loss']:.6e}" + (" (global)" if i == 0 else ""), f"({', '.join(f'{v:.4f}' for v in m['a'])})",
             f"({', '.join(f'{v:.4f}' for v in m['b'])})", ", ".join(f"{v:.1e}" for v in m["hessian_eigenvalues"])]
            for i, m in enumerate(minima)]
    return table(["loss", "$a$", "$b$", "Hessian eigenvalues"], body)


def landscape_count():
    minima = landscape_minima()[0]
    bound = math.ceil(math.log10(max(m["max_gradient"] for m in minima)))     # the next power of ten above
    return f"{len(minima)} strict local minima (gradient below $10^{{{bound}}}$"


def landscape_starts():
    return f"from {record('blocks_landscape')['starts']} starts"


def landscape_completeness():
    minima, starts, first = landscape_minima()
    return (f"all {len(minima)} were found within the first {first} starts and none in the remaining "
            f"{starts - first}; the other {record('blocks_landscape')['failed_certificate']} endpoints")


def basin_counts(runs):
    """{optimiser: {basin loss (6 digits) or "not converged": runs}} (tools/blocks_basins.py's keys)."""
    out = {}
    for r in runs:
        key = f"{r['basin_loss']:.6e}" if r["converged"] else "not converged"
        out.setdefault(r["optimiser"], {})
        out[r["optimiser"]][key] = out[r["optimiser"]].get(key, 0) + 1
    return out


def basins_table():
    rec = record("blocks_basins")
    counts = basin_counts(rec["runs"])
    keys = sorted({k for c in counts.values() for k in c if k != "not converged"}, key=float) + ["not converged"]
    head = ["optimiser"] + [f"f = {k}" + (" (global)" if k == rec["global_key"] else "") if k != "not converged"
                            else k for k in keys]
    return table(head, [[name] + [counts[name].get(k, 0) for k in keys] for name in counts], indent="   ")


def basins_starts():
    rec = record("blocks_basins")
    return f"(B = {rec['B']}) from {rec['starts']} random starts"


def basins_other():
    # the finding describes the one basin besides the global optimum that training reached
    rec = record("blocks_basins")
    other = {(r["basin_loss"], r["basin_b"][0]) for r in rec["runs"]
             if r["converged"] and f"{r['basin_loss']:.6e}" != rec["global_key"]}
    keys = {f"{f:.6e}" for f, _ in other}
    if len(keys) != 1:
        raise ValueError(f"docs/blocks_basins.json: the finding describes one other basin, the runs reached {len(keys)}")
    f, b0 = min(other)
    return f"The {sci(f, 4)} minimum has b_0 = {b0:.2f}"


def softmax_gap():
    gaps = column("softmax-two-head", "gap_in_se")
    return f"{min(gaps):.0f}-{max(gaps):.0f} paired SE worse"


def unconstrained():
    starts = field("unconstrained", "starts", int)
    higher = field("unconstrained", "higher", count)
    dist = max(column("unconstrained", "dist_Qxx_Sigma_inv"))
    others = WORDS.get(starts - 1, starts - 1)
    fate = f"the other {others} stopped higher" if higher == starts - 1 else f"of the other {others}, {higher} stopped higher"
    return (f"of {starts} starts; {fate}) come out near "
            f"the blocks structure, Q's x-block within {dist:.2g}")


def optimizers():
    table_ = rows("optimizers")
    column("optimizers", "method", str)                      # reports a missing field before it is used
    by = {re.sub(r"[^a-z]", "", r["method"].lower()): r for r in table_ if r.get("method")}
    lbfgs = next((r for k, r in by.items() if k.startswith("lbfgs")), None)
    gn = next((r for k, r in by.items() if k.startswith("gauss")), None)
    first = [r for k, r in by.items() if k in ("adam", "sgd")]
    if lbfgs is None or gn is None or len(first) != 2:
        raise Missing(CSV_RECORD, "docs/optimizers.csv lacks the methods L-BFGS, Gauss-Newton, adam and sgd")
    for r, name in ((lbfgs, "nit"), (gn, "nfev"), (first[0], "steps"), (lbfgs, "loss"), (gn, "loss"),
                    (lbfgs, "converged")):
        if r.get(name) in (None, ""):
            raise Missing(CSV_RECORD, f"docs/optimizers.csv lacks field {name}")
    # the finding's sentence: both reach the same stationary point (converged, the same loss to the
    # 5 digits the table shows)
    for r in (lbfgs, gn):
        if not truthy(r.get("converged", "")):
            raise ValueError(f"docs/optimizers.csv: {r['method']} did not converge (converged = {r.get('converged')!r})")
    if abs(float(lbfgs["loss"]) - float(gn["loss"])) > 1e-5 * abs(float(gn["loss"])):
        raise ValueError(f"docs/optimizers.csv: L-BFGS and Gauss-Newton end at losses {lbfgs['loss']}, {gn['loss']}")
    steps = {int(float(r["steps"])) for r in first}
    reached = [r for r in first if r.get("reached_step") not in (None, "")]
    tail = (f"stay above 1.01x it for {'/'.join(map(str, sorted(steps)))} steps" if not reached else
            "reach 1.01x it at step " + ", ".join(f"{r['method']} {int(float(r['reached_step']))}" for r in reached))
    return (f"(L-BFGS in {int(float(lbfgs['nit']))} iterations, Gauss-Newton in {int(float(gn['nfev']))} "
            f"evaluations); Adam and momentum SGD {tail}")


def sparse_seeds():
    # two converged endpoints of one stationary point differ by ~ |grad| / curvature ~ 1e-7 relative;
    # distinct ones here are ~1e-2 apart: 1e-3 separates them
    dist = column("three-layer-sparse", "rel_dist")
    return f"in {sum(x > 1e-3 for x in dist)} of {len(dist)} seeds"


def landscape_basins():
    basins = rows("single-layer-landscape_basins")
    settings = list(dict.fromkeys(b["setting"] for b in basins))
    trainers = list(dict.fromkeys(b["trainer"] for b in basins))
    cell = {(b["setting"], b["trainer"]): f"{b['optimum']}/{b['higher']}/{b['not_converged']}" for b in basins}
    return table(["setting"] + settings, [[t] + [cell[s, t] for s in settings] for t in trainers], indent="   ")


def _landscape_row(claim_start):
    row = next((r for r in rows("single-layer-landscape") if r["claim"].startswith(claim_start)), None)
    if row is None:
        raise Missing(CSV_RECORD, f"docs/single-layer-landscape.csv lacks the row {claim_start!r}")
    return row


def _number(row, name, experiment):
    if row.get(name) in (None, ""):
        raise Missing(CSV_RECORD, f"docs/{experiment}.csv lacks field {name}")
    return float(row[name])


def landscape_batch_minimum():
    row = _landscape_row("base: the lowest spurious point")
    get = lambda k: _number(row, k, "single-layer-landscape")
    return (f"batch loss {get('loss'):.4f} vs {get('loss_optimum'):.4f}) has a zero gradient and a positive "
            f"definite Hessian (smallest eigenvalue {get('hessian_min'):.2g}) once the {get('symmetries'):.0f} "
            "exact symmetry directions")


def landscape_population_minimum():
    row = _landscape_row("base: the exact population loss")
    get = lambda k: _number(row, k, "single-layer-landscape")
    f = get("population_spurious")
    return (f"{f:.4f} = {f / get('L_star'):.2f} L* (Theorem 1's L* from the optimum's side), gradient "
            f"{sci(get('population_grad_max'), 0)}, Hessian eigenvalues from {get('population_hessian_min'):.2g}")


def up(x, digits=1):
    """x rounded up to `digits` decimals: a bound the documents state ("within 2.4 standard errors")."""
    return math.ceil(x * 10 ** digits - 1e-9) / 10 ** digits


def pow10_up(x):
    """The power of ten at or above x, as the documents write it: 1e-13."""
    return f"1e{math.ceil(math.log10(x))}"


def one_digit_up(x):
    """x rounded up to one significant digit: 5e-13."""
    e = math.floor(math.log10(x))
    m = math.ceil(x / 10 ** e - 1e-9)
    return f"1e{e + 1}" if m == 10 else f"{m:.0f}e{e}"


def numbers(name):
    """The rows of the full run's table docs/NAME.csv, each cell a float where it is a number, a
    list where it is a JSON list, True/False where it says so."""
    def value(x):
        if x in ("True", "False"):
            return x == "True"
        if x.startswith("["):
            return json.loads(x)
        try:
            return float(x)
        except ValueError:
            return x
    return [{k: value(v) for k, v in r.items()} for r in rows(name)]


def claim(experiment, start):
    """The one row of docs/EXPERIMENT.csv whose claim begins with `start`."""
    found = [r for r in numbers(experiment) if r["claim"].startswith(start)]
    if len(found) != 1:
        raise Missing(CSV_RECORD, f"docs/{experiment}.csv has {len(found)} claims beginning {start!r} (one expected)")
    return found[0]


BEYOND = ("looped", "dynamics", "task-diversity", "shift")     # the experiments beyond the paper


def minutes(seconds):
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def full_run_time():
    timing = record("figures").get("timing")
    if not timing:
        raise Missing("figures", "docs/figures.json lacks the run's timing")
    runs = timing["experiments"]
    paper = [t["seconds"] for name, t in runs.items() if name not in BEYOND]
    beyond = [t["seconds"] for name, t in runs.items() if name in BEYOND]
    # math.fsum: the exact sum, as Python 3.12's compensated sum() and older sum() differ in the last
    # bit, which decides the rounding when a total falls on half a minute
    return (f"about {minutes(math.fsum(paper + beyond))} on 2 cores: the paper's {len(paper)} experiments "
            f"{minutes(math.fsum(paper))}, the {len(beyond)} beyond it {minutes(math.fsum(beyond))}; docs/benchmarks.md "
            "gives each")


def beyond_time():
    runs = record("figures").get("timing", {}).get("experiments", {})
    if not all(name in runs for name in ("task-diversity", "shift")):
        raise Missing("figures", "docs/figures.json lacks the run's timing")
    return f"full: {minutes(runs['task-diversity']['seconds'])} and {minutes(runs['shift']['seconds'])}"


def beyond_checks():
    verdicts = [r["verdict"] for name in BEYOND for r in numbers(name)]
    decided = [v for v in verdicts if v in ("PASS", "FAIL")]
    return (f"{decided.count('PASS')} of {len(decided)} checked claims PASS, "
            f"{verdicts.count('NO VERDICT')} NO VERDICT")


def looped_table():
    body = []
    for r in numbers("looped_exact"):
        if r["L"] > 1:
            a = f"{r['a_tied']:.4f}" + (f" ({r['b_tied']:.4f})" if r["family"] == "blocks" else "")
            body.append([r["family"], f"{r['L']:.0f}", a, f"{r['loss_tied']:.5f}", f"{r['loss_untied']:.5f}",
                         f"{r['gain_kept']:.2f}"])
    return table(["family", "L", "tied a* (b*)", "tied loss", "untied loss", "gain kept"], body)


def looped_gain():
    exact = numbers("looped_exact")
    kept = lambda fam: [f"{r['gain_kept']:.0%}" for r in exact if r["family"] == fam and r["L"] > 1]
    Ls = lambda fam: ", ".join(f"{r['L']:.0f}" for r in exact if r["family"] == fam and r["L"] > 1)
    steps = [f"{r['a_tied']:.4f}" for r in exact if r["family"] == "sparse"]
    return (f"{', '.join(kept('sparse'))} of the untied drop in loss from L = 1 at L = {Ls('sparse')} (sparse) and "
            f"{', '.join(kept('blocks'))} at L = {Ls('blocks')} (blocks); its one step a*_L falls with depth "
            f"({', '.join(steps)})")


def looped_trained():
    trained = numbers("looped_trained")
    err = [f"{up(100 * abs(r['a_fitted'] / r['a_star'] - 1)):.1f}%" for r in trained]
    later = ", ".join(f"{r['L']:.0f}" for r in trained[1:])
    return (f"fit a within {err[0]} of a*_1 at L = 1 and {', '.join(err[1:])} of a*_L at L = {later} (finding 17), "
            f"their whitened symmetric part within {up(max(r['dist_sym'] for r in trained), 4):.4f} of a multiple of "
            "Sigma^-1")


def looped_curvature():
    rows_ = numbers("looped_curvature")
    anti = [r for r in rows_ if r["direction"] == "antisymmetric"]
    sym = ", ".join(f"{r['second_difference']:.3f}" for r in rows_ if r["direction"] != "antisymmetric" and r["L"] > 1)
    middle = ", ".join(f"{r['second_difference']:.4f}" for r in anti[1:-1])
    later = ", ".join(f"{r['L']:.0f}" for r in anti[1:])
    return (f"is {anti[0]['second_difference']:.3f} at L = {anti[0]['L']:.0f}, then {middle} and "
            f"{anti[-1]['second_difference']:.4f} +- {anti[-1]['se']:.4f} at L = {later} (symmetric: {sym})")


def looped_antisymmetric():
    trained = [r for r in numbers("looped_trained") if r["L"] > 1]
    join = lambda key, digits: ", ".join(f"{r[key]:.{digits}f}" for r in trained)
    Ls = ", ".join(f"{r['L']:.0f}" for r in trained)
    return f"({join('antisym', 2)} of the symmetric part's norm at L = {Ls}) and Dist(A, Sigma^-1) = {join('dist', 3)}"


def looped_flow():
    ends = [r for r in numbers("dynamics") if "equals gamma_star" in r["claim"]]
    notes = [r for r in numbers("dynamics") if "plateau" in r["claim"]]
    inside, outside = (next(r for r in ends if r["start"] == k) for k in ("inside", "outside"))
    half = next(r for r in notes if r["start"] == "inside")
    descent = numbers("dynamics_descent")
    z = [r for r in numbers("dynamics") if r["claim"].startswith("t = ")]
    flat = lambda x: [v for part in x for v in (flat(part) if isinstance(part, list) else [part])]
    worst = max(abs(m - t) / e for r in z for m, t, e in zip(flat(r["measured"]), flat(r["theory"]), flat(r["se"])))
    return (f"from sigma = {outside['sigma']:.2f}, {outside['sigma'] / outside['sigma_bound']:.0f} times their bound "
            f"sqrt(2 / (sqrt(d) |Gamma|_2)) = {outside['sigma_bound']:.2f}, reaches Gamma* as from sigma = "
            f"{inside['sigma']:.2f} inside it (both to {pow10_up(max(inside['measured'], outside['measured']))}; "
            f"the balance u^2 - |U|_F^2 stays 0 to {one_digit_up(max(r['measured'] for r in notes))}); "
            f"from {inside['sigma']:.2f} the loss sits on a plateau and is half-way down at t = "
            f"{half['half_way_t']:.2f}. Gradient descent (eta = {descent[0]['eta']:g}) on {descent[0]['R']:.0f} independent "
            f"batches of {descent[0]['B']:.0f} prompts with icl_ref's gradient of the full (P, Q) follows the flow within "
            f"{up(worst):.1f} standard errors at {len(descent)} times (the step's own error, measured on the population "
            f"gradient, is below {up(max(r['step_error_in_se'] for r in descent)):.1f} of one)")


def task_diversity_one_layer():
    r = claim("task-diversity", "one layer: fresh-task loss")
    return f"K = {r['K']:.0f} (exact: {r['measured']:.3f} vs {r['theory']:.3f})"


def task_diversity_three_layers():
    r = claim("task-diversity", "three layers: fresh-task loss")
    note = claim("task-diversity", "the transition")
    L3 = next(p for p in numbers("task-diversity_pools") if p["K"] == r["K"])
    trained = [p for p in numbers("task-diversity_pools") if p.get("L3_converged") not in (None, "")]
    no = [f"{p['K']:.0f}" for p in trained if not p["L3_converged"]]
    every = ", ".join(f"{p['K']:.0f}" for p in trained)
    return (f"({L3['L3_pool']:.2f} and {L3['L3_fresh']:.2f}) and settle from K = {note['settled_from_K']:.0f} on, "
            f"near the sparse family's exact optimum {note['L3_prior']:.2f} ({note['L3_excess']:.1%} above it: "
            f"{r['verdict']} against 10% plus {r['k']:.0f} SE; "
            + (f"not converged at K = {', '.join(no)})" if no else f"converged at every K trained: {every})"))


def spread(values, digits):
    lo, hi = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return lo if lo == hi else f"{lo}-{hi}"


def task_diversity_dmmse():
    pools = numbers("task-diversity_pools")
    small = [r for r in pools if r["K"] <= 16]
    last = pools[-1]
    return (f"(pool risk {spread([r['dmmse_pool'] for r in small], 2)} against ridge's "
            f"{spread([r['ridge_pool'] for r in small], 2)}) and at K = {last['K']:.0f} is still "
            f"{last['dmmse_fresh'] / last['ridge_fresh']:.1f} x ridge's fresh-task risk")


def task_diversity_ridge():
    said = {r["model"]: r for r in numbers("task-diversity") if r["claim"].startswith(("L1:", "L3:", "dmmse:"))}
    holds = {name: r["holds"] for name, r in said.items()}
    if set(holds.values()) != {"no"}:
        raise ValueError(f"docs/task-diversity.csv: the README says the claim does not hold for any of the three, "
                         f"the run gives {holds}")
    return (f"does not hold for any of the three at this size: one and three preconditioned gradient steps stay above "
            f"ridge ({said['L1']['measured']:.2f}, {said['L3']['measured']:.2f} vs {said['L1']['theory']:.2f})")


def shift_summary():
    shifts = numbers("shift_shifts")
    agree = claim("shift", "the trained layer's exact shifted loss")
    wu = claim("shift", "Wu et al.'s claim")
    kinds = [r["kind"] for r in shifts]
    costs = claim("shift", "a length shift costs")["measured"]
    return (f"({agree['verdict']} within {agree['k']:.0f} SE at all {len(shifts)} test distributions: "
            f"{kinds.count('length')} lengths, {kinds.count('covariates')} covariate, {kinds.count('tasks')} task "
            f"covariances, {'a' if kinds.count('query') == 1 else kinds.count('query')} query covariance); every length "
            f"shift costs {100 * min(costs):.0f}-{max(costs):.0%} against the best layer for that length; Wu et al.'s "
            f"\"nearly matches tuned ridge at its training length\" {'holds' if wu['holds'] == 'yes' else 'does not hold'} "
            f"at this size ({wu['measured']:.3f} vs {wu['theory']:.3f})")


# (document, block name, renderer): every number a document quotes from a record
BLOCKS = [
    ("README.md", "speed-range", speed_range),
    ("README.md", "speed", speed),
    ("README.md", "float32-tolerances", float32_readme),
    ("docs/FINDINGS.md", "blocks-optimum", blocks_optimum),
    ("docs/FINDINGS.md", "isotropic", isotropic),
    ("docs/FINDINGS.md", "blocks-landscape", landscape_readme),
    ("docs/FINDINGS.md", "basins-starts", basins_starts),
    ("docs/FINDINGS.md", "blocks-basins", basins_table),
    ("docs/FINDINGS.md", "basins-other", basins_other),
    ("docs/FINDINGS.md", "softmax-gap", softmax_gap),
    ("docs/FINDINGS.md", "unconstrained", unconstrained),
    ("docs/FINDINGS.md", "optimizers", optimizers),
    ("docs/FINDINGS.md", "sparse-seeds", sparse_seeds),
    ("docs/FINDINGS.md", "landscape-basins", landscape_basins),
    ("docs/FINDINGS.md", "landscape-batch-minimum", landscape_batch_minimum),
    ("docs/FINDINGS.md", "landscape-population-minimum", landscape_population_minimum),
    ("docs/FINDINGS.md", "beyond-checks", beyond_checks),
    ("README.md", "full-run-time", full_run_time),
    ("docs/FINDINGS.md", "beyond-time", beyond_time),
    ("docs/FINDINGS.md", "looped-table", looped_table),
    ("docs/FINDINGS.md", "looped-gain", looped_gain),
    ("docs/FINDINGS.md", "looped-trained", looped_trained),
    ("docs/FINDINGS.md", "looped-curvature", looped_curvature),
    ("docs/FINDINGS.md", "looped-antisymmetric", looped_antisymmetric),
    ("docs/FINDINGS.md", "looped-flow", looped_flow),
    ("docs/FINDINGS.md", "task-diversity-one-layer", task_diversity_one_layer),
    ("docs/FINDINGS.md", "task-diversity-three-layers", task_diversity_three_layers),
    ("docs/FINDINGS.md", "task-diversity-dmmse", task_diversity_dmmse),
    ("docs/FINDINGS.md", "task-diversity-ridge", task_diversity_ridge),
    ("docs/FINDINGS.md", "shift-summary", shift_summary),
    ("MATH.md", "landscape-starts", landscape_starts),
    ("MATH.md", "landscape-count", landscape_count),
    ("MATH.md", "landscape-table", landscape_table),
    ("MATH.md", "landscape-completeness", landscape_completeness),
    ("MATH.md", "float32-tolerances", float32_math),
]


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def marked(name):
    return re.compile(rf"(<!-- begin {re.escape(name)} -->\n?)(.*?)(\n?[ \t]*<!-- end {re.escape(name)} -->)", re.S)


def block_text(text, name):
    """The text between a block's markers in a document, or None without markers."""
    m = marked(name).search(text)
    return None if m is None else m.group(2)


def render_all(texts):
    """Render every block into {document: text}. Returns (new texts, [(document, block, current
    text, rendered text or None, problem or None)])."""
    _cache.clear()
    results = []
    for doc, name, fn in BLOCKS:
        text = texts[doc]
        found = marked(name).findall(text)
        if len(found) != 1:
            results.append((doc, name, None, None, f"{len(found)} blocks named {name} (one expected)"))
            continue
        current = found[0][1]
        try:
            new = fn()
        except Missing as e:
            results.append((doc, name, current, None, f"record lacks data: {e}"))
            continue
        except (ValueError, KeyError, TypeError, IndexError) as e:      # a record that contradicts itself
            results.append((doc, name, current, None, f"cannot render from the record: {e!r}"))
            continue
        texts[doc] = marked(name).sub(lambda m: m.group(1) + new + m.group(3), text)
        results.append((doc, name, current, new, None))
    known = {(doc, name) for doc, name, _ in BLOCKS}
    for doc in DOCS:                                   # a block no renderer writes would never be checked
        for name in re.findall(r"(?<!`)<!-- begin (\S+) -->", texts[doc]):     # not one quoted as code
            if (doc, name) not in known:
                results.append((doc, name, None, None, f"no renderer for the block {name} (BLOCKS)"))
    return texts, results


BENCHMARKS_MD = "docs/benchmarks.md"


def benchmarks_markdown():
    """docs/benchmarks.md, every line from docs/benchmarks.json."""
    rec = record("benchmarks")
    prov = rec["provenance"]
    v = prov["versions"]
    text = ["# Benchmarks", "",
            f"Written by `python3 tools/records.py render` from [benchmarks.json](benchmarks.json), which "
            f"`{prov['command']}` measured (nothing here is typed by hand). Times are wall-clock seconds on the "
            "machine below and move by 10-30% between runs on a shared virtual machine: read ratios, not digits.",
            "", f"- date: {prov['date']}",
            f"- code measured: {', '.join(prov['code'])} (`python3 tools/records.py check` tells whether it "
            "changed since)"]
    text += [f"- {line}" for line in rec["machine"]]
    text += [f"- Python {v.get('python')}, numpy {v.get('numpy')}, scipy {v.get('scipy')}", ""]
    for t in rec["tables"]:
        text += [f"## {t['title']}", "", t["note"], "", table(t["head"], t["rows"]), ""]
    timing = record("figures").get("timing")
    if timing:
        runs = timing["experiments"]
        text += ["## The experiments", "",
                 "Each experiment of the full run (`python3 experiments.py`, seed 0) that made the figures and tables "
                 f"README quotes, from [figures.json](figures.json): {timing['machine']}; wall-clock and CPU seconds "
                 "(the CPU time counts both cores when the engine's workers run).", "",
                 table(["experiment", "seconds", "CPU seconds"],
                       [[name, f"{t['seconds']:.1f}", f"{t['cpu_seconds']:.1f}"] for name, t in runs.items()]
                       + [["all", f"{math.fsum(t['seconds'] for t in runs.values()):.0f}",
                           f"{math.fsum(t['cpu_seconds'] for t in runs.values()):.0f}"]]), ""]
    return "\n".join(text)


def render(check=False):
    texts = {doc: read(doc) for doc in DOCS}
    new, results = render_all(dict(texts))
    try:
        texts[BENCHMARKS_MD] = read(BENCHMARKS_MD) if os.path.exists(os.path.join(ROOT, BENCHMARKS_MD)) else ""
        new[BENCHMARKS_MD] = benchmarks_markdown()
        results.append((BENCHMARKS_MD, "(whole file)", texts[BENCHMARKS_MD], new[BENCHMARKS_MD], None))
    except Missing as e:
        new[BENCHMARKS_MD] = texts[BENCHMARKS_MD]
        results.append((BENCHMARKS_MD, "(whole file)", None, None, f"record lacks data: {e}"))
    status = 0
    for doc, name, current, rendered, problem in results:
        if problem:
            print(f"{doc} block {name}: {problem}")
            status = status or (2 if problem.startswith("record lacks") else 1)
        elif current != rendered:
            print(f"{doc} block {name}: {'differs from the records' if check else 'rewritten'}")
            if check and name != "(whole file)":
                print(f"  now:      {current!r}\n  rendered: {rendered!r}")
            status = 1 if check else status
    if not check:
        for doc in new:
            if new[doc] != texts[doc]:
                with open(os.path.join(ROOT, doc), "w", encoding="utf-8") as f:
                    f.write(new[doc])
                print(f"wrote {doc}")
    return status


# ---------------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------------

def check():
    start = time.perf_counter()
    findings = 0
    for name, rec in RECORDS.items():
        reasons = stale(name)
        try:
            command = shlex.join(rec.command(rec.load()))
        except (OSError, ValueError):
            command = shlex.join(["python3", rec.tool, *rec.args])
        if reasons:
            findings += 1
            print(f"STALE   {name} ({rec.path}, by {command})")
            for r in reasons:
                print(f"        - {r}")
            print(f"        refresh: python3 tools/records.py refresh {name}")
        else:
            print(f"current {name} ({rec.path}, by {command})")
    _, results = render_all({doc: read(doc) for doc in DOCS})
    for doc, name, current, rendered, problem in results:
        if problem:
            findings += 1
            print(f"STALE   {doc} block {name}: {problem}")
        elif current != rendered:
            findings += 1
            print(f"STALE   {doc} block {name} differs from the records: python3 tools/records.py render")
    print(f"{findings} finding(s) in {time.perf_counter() - start:.1f} s")
    return 1 if findings else 0


ORDER = ["figures", "blocks_landscape", "blocks_basins", "float32_tolerances", "benchmarks"]


def refresh(names):
    names = names or [n for n in ORDER if stale(n)]
    unknown = [n for n in names if n not in RECORDS]
    if unknown:
        raise SystemExit(f"unknown record(s) {unknown}; the records: {', '.join(RECORDS)}")
    for name in sorted(names, key=ORDER.index):
        rec = RECORDS[name]
        try:
            command = rec.command(rec.load())
        except (OSError, ValueError):
            command = ["python3", rec.tool, *rec.args]
        if command[0].startswith("python"):
            command[0] = sys.executable
        print(f"refresh {name}: {shlex.join(command)}", flush=True)
        start = time.perf_counter()
        proc = subprocess.run(command, cwd=ROOT)
        print(f"refresh {name}: exit {proc.returncode} after {time.perf_counter() - start:.0f} s", flush=True)
        if proc.returncode != 0:
            return proc.returncode
    return render()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="name every stale record and generated block (exit 1 if any)")
    r = sub.add_parser("refresh", help="rerun the tools of the named records (default: the stale ones), then render")
    r.add_argument("names", nargs="*", metavar="NAME", help=", ".join(RECORDS))
    r = sub.add_parser("render", help="rewrite the generated blocks of README.md, MATH.md and docs/FINDINGS.md from the records")
    r.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 if a block differs, 2 if only records lack fields")
    args = ap.parse_args(argv)
    if args.cmd == "check":
        return check()
    if args.cmd == "refresh":
        return refresh(args.names)
    return render(check=args.check)


if __name__ == "__main__":
    sys.exit(main())
