"""The records under docs/, and the numbers README.md, MATH.md, docs/FINDINGS.md, docs/benchmarks.md quote.

    python3 tools/records.py check                 # which records are stale, which blocks differ (seconds)
    python3 tools/records.py refresh [NAME ...]    # rerun the tools of the named records (default: the stale ones)
    python3 tools/records.py render [--check]      # write the documents' generated blocks (--check: write nothing)

docs/RECORDS.md says what each record holds, what its provenance names, when it is stale, and how a
block's template reads rows by id and records (one renderer, `render_block`, evaluating only the names in
NAMES). `refresh` runs only the commands of TOOLS, never one read from a record, and refuses one naming another.

Exit statuses: 0 check: every record current, every block as rendered; render: written (--check: nothing
to change); refresh: the tools ran and the blocks were written. 1 check: a record stale or a block differs;
render --check: a block differs. 2 a record, table or document unreadable, a block that cannot be rendered
(a row id or field missing, its rows disagreeing, a block twice or without a template: each named), a
document refused (a symbolic link), bad arguments, or refresh refused (an unknown record, or one whose
provenance names another command than its tool's in TOOLS: nothing is run). N refresh: the exit status of
a tool that failed (nothing rendered).
"""
import argparse
import ast
import csv
import datetime
import fnmatch
import json
import math
import os
import platform
import re
import stat
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import icl_files  # noqa: E402  (the project's writer)

DOCS = ("README.md", "MATH.md", "docs/FINDINGS.md", "docs/benchmarks.md")
# refresh's table: each record, the file it is, and the one command that makes it (run with this Python)
TOOLS = {
    "figures": ("docs/figures.json", ["tools/docs_figures.py"]),
    "blocks_landscape": ("docs/blocks_landscape.json",
                         ["tools/blocks_landscape.py", "--starts", "400", "--n", "20", "--d", "5", "--seed", "0"]),
    "blocks_basins": ("docs/blocks_basins.json", ["tools/blocks_basins.py", "--starts", "20", "--seed", "0"]),
    "looped_landscape": ("docs/looped_landscape.json",
                         ["tools/looped_landscape.py", "--n", "20", "--d", "5", "--samples", "200000", "--seed", "0"]),
    "float32_tolerances": ("docs/float32_tolerances.json", ["examples/float32_tolerances.py", "--record"]),
    "benchmarks": ("docs/benchmarks.json", ["tools/benchmarks.py", "--repeats", "7"]),
}
PATH = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)*")     # a file of the project
COMMIT = re.compile(r"[0-9a-f]{40}")


class Problem(Exception):
    """A record, table or document that cannot be read, or a block that cannot be rendered from it."""


def provenance(command, depends, seconds, outputs=(), state=None, **versions):
    """The provenance a tool stores in its record (docs/RECORDS.md): the commit and dirty flag are
    icl_files.source_state's of `depends` unless `state` gives them; `outputs` are paths from the root."""
    import numpy
    import scipy
    return dict(command=list(command), **(state or icl_files.source_state(depends, ROOT)), depends=list(depends),
                date=datetime.date.today().isoformat(), seconds=None if seconds is None else round(seconds, 1),
                versions=dict(python=platform.python_version(), numpy=numpy.__version__, scipy=scipy.__version__, **versions),
                outputs={path: sha256_file(path) for path in outputs})


def write(path, data):
    """Write a document, figure or record (a dict, as JSON) of the project, never through a symbolic link."""
    data = json.dumps(data, indent=1) + "\n" if isinstance(data, dict) else data
    icl_files.replace_file(os.path.join(ROOT, path), data.encode("utf-8") if isinstance(data, str) else data)


def save(path, record):
    """A tool's record written (write) to `path`, said on stdout; the exit status: 0, or 2 with the
    reason on stderr when it was refused or could not be written."""
    try:
        write(os.path.abspath(path), record)
    except (icl_files.Refused, icl_files.WriteFailed) as e:
        print(f"not written: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


def read(path):
    st = os.stat(os.path.join(ROOT, path))          # before opening: a FIFO would block, /dev/zero never end
    if not stat.S_ISREG(st.st_mode) or st.st_size > icl_files.MAX_RECORD_BYTES:
        raise OSError(f"{path} is not a regular file of at most {icl_files.MAX_RECORD_BYTES} bytes")
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def sha256_file(path):
    with open(os.path.join(ROOT, path), "rb") as f:
        return icl_files.sha256(f.read())


def load(name):
    """The record `name` (TOOLS) as parsed JSON; Problem when it is unknown, missing or not a JSON object."""
    if name not in TOOLS:
        raise Problem(f"no record {name}")
    path = TOOLS[name][0]
    try:
        value = json.loads(read(path), object_hook=Fields)
    except (OSError, ValueError, RecursionError) as e:
        raise Problem(f"{path} cannot be read: {e}") from None
    if not isinstance(value, dict):
        raise Problem(f"{path} is not a JSON object")
    return value


def git(*args):
    """git's output in the project, or None where git or the checkout is missing or git fails."""
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None


def changed_since(commit, files):
    """The files of `files` that differ now from `commit` (a list), or a sentence saying why it cannot tell."""
    if commit is None or not COMMIT.fullmatch(str(commit)):
        return f"no commit recorded ({commit!r}; made outside a git checkout?): cannot tell"
    if git("cat-file", "-e", f"{commit}^{{commit}}") is None:
        return f"its commit {commit[:12]} is not in this repository (or git is missing): cannot tell"
    out = git("diff", "--name-only", commit, "--", *files)
    return "git diff failed: cannot tell" if out is None else out.split()


def stale(name):
    """Why the record `name` is stale ([] when it is current); Problem when it cannot be read or its
    provenance lacks a field of the form `provenance` writes."""
    p, path = load(name).get("provenance"), TOOLS[name][0]
    if not isinstance(p, dict):
        raise Problem(f"{path} has no provenance")
    paths = lambda v: isinstance(v, list) and all(isinstance(f, str) and PATH.fullmatch(f) for f in v)
    command, outputs = p.get("command"), p.get("outputs", {})
    problems = [what for what, ok in (
        ("command", isinstance(command, list) and command and paths(command[:1]) and all(isinstance(a, str) for a in command)),
        ("commit", p.get("commit") is None or COMMIT.fullmatch(str(p["commit"]))),
        ("dirty", p.get("dirty") in (True, False, None)), ("depends", paths(p.get("depends"))),
        ("outputs", isinstance(outputs, dict) and paths(list(outputs)) and all(
            f.startswith("docs/") and isinstance(h, str) for f, h in outputs.items()))) if not ok]
    if problems:
        raise Problem(f"{path}: provenance field(s) {', '.join(problems)} missing or malformed")
    changed = changed_since(p["commit"], p["depends"])
    reasons = ([changed] if isinstance(changed, str) else
               [f"changed since its commit {p['commit'][:12]}: {', '.join(changed)}"] * bool(changed))
    if p["dirty"] is not False:
        reasons.append("made from uncommitted changes to the files it depends on" if p["dirty"] else
                       "not known whether it was made from uncommitted changes")
    for path, digest in p.get("outputs", {}).items():
        if not os.path.isfile(os.path.join(ROOT, path)):
            reasons.append(f"{path}, which it wrote, is missing")
        elif sha256_file(path) != digest:
            reasons.append(f"{path} is not the file it wrote (edited or copied since)")
    return reasons


class Fields(dict):
    """A row or a JSON object whose fields are also attributes: r.loss is r["loss"]."""

    def __getattr__(self, name):
        if name.startswith("_") or name not in self:
            raise Problem(f"{self.get('id', 'the record')} has no field {name}")
        return self[name]


class Rows(list):
    """Rows found by a pattern; rows.field is that field's values over them."""

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        if not all(isinstance(r, Fields) for r in self):   # only rows' fields: Rows([x]).name reads nothing else
            raise Problem(f"a template may read {name} only of rows")
        return [getattr(r, name) for r in self]


def cell(text):
    """A CSV cell as a value: empty None, True/False, a number, a JSON list, else the text."""
    for parse in ({"": None, "True": True, "False": False}.__getitem__, float, json.loads):
        try:
            return parse(text)
        except (KeyError, ValueError):
            pass
    return text


def rows(pattern):
    """The rows of the full run's table docs/STEM.csv whose id matches `pattern` ("STEM/..." with * ? [..]
    wildcards), in the table's order; Problem when none does or the table has no unique ids."""
    stem = pattern.split("/")[0]
    try:
        lines = read(f"docs/{stem}.csv").splitlines(keepends=True)     # read: a FIFO or /dev/zero refused
        table = [Fields((k, cell(v)) for k, v in r.items()) for r in csv.DictReader(lines)]
    except (OSError, ValueError, csv.Error) as e:
        raise Problem(f"docs/{stem}.csv cannot be read: {e}") from None
    ids = [r.get("id") for r in table]
    if not ids or None in ids or len(set(ids)) != len(ids):
        raise Problem(f"docs/{stem}.csv is empty, has no id column or repeats an id")
    found = Rows(r for r in table if fnmatch.fnmatchcase(r["id"], pattern))
    if not found:
        raise Problem(f"docs/{stem}.csv has no row {pattern}")
    return found


def row(id):
    return rows(id.replace("[", "[[]"))[0]


def one(found, field):
    """The one value `field` takes over the rows `found`; Problem when they disagree."""
    values = attribute(found, field)
    if len(set(map(repr, values))) != 1:
        raise Problem(f"the rows disagree on {field}: {values}")
    return values[0]


def expect(holds, sentence):
    """'' when the records bear out what the block's sentence says; Problem naming it when not."""
    if not holds:
        raise Problem(f"the records contradict the document: {sentence}")
    return ""


def table(head, body, indent=""):
    show = lambda c: str(c).replace("|", "\\|")          # a | inside a cell would end it
    lines = ["| " + " | ".join(map(show, head)) + " |", "|" + "---|" * len(head)]
    return "\n".join(indent + line for line in lines + ["| " + " | ".join(map(show, r)) + " |" for r in body])


def sci(x, digits):
    """x in scientific notation as the documents write it: sci(9.613e-4, 3) = 9.613e-4."""
    return re.sub(r"e([-+])0*(\d)", r"e\1\2", f"{x:.{digits}e}").replace("e+", "e")


def one_digit_up(x):
    """x rounded up to one significant digit: 5e-13."""
    e = math.floor(math.log10(x))
    m = math.ceil(x / 10 ** e - 1e-9)
    return f"1e{e + 1}" if m == 10 else f"{m:.0f}e{e}"


def flat(x):
    return [v for part in x for v in flat(part)] if isinstance(x, list) else [x]


# what a template may read and call, and nothing else (evaluate)
NAMES = dict(
    row=row, rows=rows, Rows=Rows, record=load, one=one,
    expect=expect, table=table, sci=sci, short=lambda x: sci(x, 1), one_digit_up=one_digit_up, flat=flat,
    up=lambda x, digits=1: math.ceil(x * 10 ** digits - 1e-9) / 10 ** digits,     # a bound, rounded up
    pow10_up=lambda x: f"1e{math.ceil(math.log10(x))}", tex10=lambda e: f"$10^{{{e}}}$",
    minutes=lambda s: f"{s / 60:.0f} min" if s >= 90 else f"{s:.0f} s",
    spread=lambda v, digits: "-".join(dict.fromkeys([f"{min(v):.{digits}f}", f"{max(v):.{digits}f}"])),
    join=lambda values, spec="": ", ".join(format(v, spec) for v in values),
    words=lambda k: {0: "none", 1: "one", 2: "two", 3: "three", 4: "four", 5: "five"}.get(k, str(k)),
    **{f.__name__: f for f in (min, max, len, sum, sorted, abs, round, int, float, str, any, all, set, list, dict,
                               zip, enumerate, chr, math.exp, math.log10, math.ceil, math.fsum, math.sqrt)})
NODES = (ast.Expression, ast.JoinedStr, ast.FormattedValue, ast.Constant, ast.Name, ast.Load, ast.Store, ast.Attribute,
         ast.Subscript, ast.Slice, ast.Call, ast.keyword, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.IfExp,
         ast.List, ast.Tuple, ast.Set, ast.Dict, ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.comprehension,
         ast.operator, ast.unaryop, ast.boolop, ast.cmpop, ast.expr_context)


# the methods a template may call on a plain value: none reaches an object's internals (no format, whose
# fields read attributes; a generator's or function's attributes lead to frames and globals)
METHODS = frozenset({"count", "fromkeys", "get", "index", "items", "join", "keys", "split", "startswith", "values"})


def attribute(value, name):
    """`value.name` in a template: a field of a row or record (Fields, Rows), or one of METHODS of a
    plain value; anything else is refused."""
    if isinstance(value, (Fields, Rows)) and not name.startswith("_"):
        return getattr(value, name)
    if name in METHODS and (isinstance(value, (str, list, tuple, dict, set)) or value in (dict, str)):
        return getattr(value, name)
    if not hasattr(value, name):                          # a record's null or number where a field was expected
        raise AttributeError(f"{type(value).__name__} has no field {name}")
    raise Problem(f"a template may not read {name} of a {type(value).__name__}")


class Attributes(ast.NodeTransformer):
    """Every `x.name` read becomes `__attribute(x, "name")` (after the check, so no template can name it)."""

    def visit_Attribute(self, node):
        self.generic_visit(node)
        return ast.copy_location(ast.Call(ast.Name("__attribute", ast.Load()), [node.value, ast.Constant(node.attr)], []),
                                 node)


def evaluate(expression, names):
    """A template's expression over `names`, once checked: it reads names, fields and items and calls
    what `names` holds (NAMES and METHODS of values), with no underscore, lambda or assignment."""
    tree = ast.parse(expression, mode="eval")
    bad = [n for n in ast.walk(tree) if not isinstance(n, NODES) or isinstance(n, ast.Name) and n.id.startswith("_")
           or isinstance(n, ast.Attribute) and n.attr.startswith("_") or isinstance(n, (ast.Pow, ast.LShift))]  # 9**9**9 never ends
    if bad:
        raise Problem(f"a template may not use {type(bad[0]).__name__} {getattr(bad[0], 'id', getattr(bad[0], 'attr', ''))}")
    tree = ast.fix_missing_locations(Attributes().visit(tree))
    try:
        return eval(compile(tree, "<template>", "eval"), {**names, "__attribute": attribute, "__builtins__": {}})
    except NameError as e:
        raise Problem(f"a template may not use {e}") from None


def render_block(template, bindings):
    """One block: its `bindings` ({name: expression}, in order), then its template (an f-string's text)."""
    names = dict(NAMES)
    for name, expression in bindings.items():
        names[name] = evaluate(expression, names)
    return evaluate('f"""' + template + '"""', names)


BLOCK = re.compile(r"(?<!`)<!-- begin (\S+?)(\s.*?)?-->(\n?)(.*?)(\n?[ \t]*<!-- end \1 -->)", re.S)
LET = re.compile(r"let ([A-Za-z]\w*) = (.*)")


def render_all(texts):
    """Render every block of `texts` ({document: text}). Returns (the new texts, [(document, block,
    current text, rendered text or None, problem or None)])."""
    results = []

    def rendered(doc, m):
        name, spec, current = m.group(1), textwrap.dedent(m.group(2) or "").strip("\n"), m.group(4)
        lines = spec.split("\n")
        try:
            if names.count(name) != 1:
                raise Problem(f"{names.count(name)} blocks named {name} (one expected)")
            if not spec.strip():
                raise Problem(f"the block {name} has no template")
            new = render_block("\n".join(l for l in lines if not LET.fullmatch(l)),
                               dict(LET.fullmatch(l).groups() for l in lines if LET.fullmatch(l)))
        except Problem as e:
            new, problem = None, str(e)
        except (ArithmeticError, AttributeError, LookupError, MemoryError, TypeError, ValueError) as e:   # or 'x' * 10**15
            new, problem = None, f"cannot render from the records: {e!r}"
        else:
            problem = None
        results.append((doc, name, current, new, problem))
        return m.group(0) if new is None else m.group(0)[:m.start(4) - m.start(0)] + new + m.group(5)

    for doc in DOCS:
        names = re.findall(r"(?<!`)<!-- begin (\S+?)(?:\s|-->)", texts[doc])
        texts[doc] = BLOCK.sub(lambda m: rendered(doc, m), texts[doc])
        ended = {r[1] for r in results if r[0] == doc}
        results += [(doc, name, None, None, f"the block {name} has no end marker") for name in names if name not in ended]
    return texts, results


def render(check=False):
    """Write (or with check, compare) every generated block; returns the exit status (docstring)."""
    try:
        texts = {doc: read(doc) for doc in DOCS}
    except (OSError, ValueError) as e:
        print(f"a document cannot be read: {e}", file=sys.stderr)
        return 2
    new, results = render_all(dict(texts))
    status = 0
    for doc, name, current, rendered, problem in results:
        if problem:
            print(f"{doc} block {name}: {problem}", file=sys.stderr)
            status = 2
        elif current != rendered and check:
            print(f"{doc} block {name}: differs from the records\n  now:      {current!r}\n  rendered: {rendered!r}")
            status = status or 1
    for doc in [] if check else [d for d in DOCS if new[d] != texts[d]]:
        try:
            write(doc, new[doc])
        except (icl_files.Refused, icl_files.WriteFailed) as e:
            print(f"{doc} not written: {e}", file=sys.stderr)
            return 2
        print("".join(f"{doc} block {r[1]}: rewritten\n" for r in results if r[0] == doc and r[2] != r[3] and not r[4])
              + f"wrote {doc}")
    return status


def check():
    status = 0
    for name, (path, command) in TOOLS.items():
        try:
            reasons = stale(name)
        except Problem as e:
            reasons, status = [str(e)], 2
        print(("STALE   " if reasons else "current ") + f"{name} ({path}, by python3 {' '.join(command)})"
              + "".join(f"\n        - {r}" for r in reasons) + (f"\n        refresh: python3 tools/records.py refresh {name}"
                                                                 if reasons else ""))
        status = max(status, bool(reasons))
    return max(status, render(check=True))


def refresh(names):
    """Run the TOOLS commands of the records `names` (default: the stale ones and those that cannot be
    read), then render; refused, running nothing, for an unknown name or a record naming another command."""
    unknown = [n for n in names if n not in TOOLS]
    if unknown:
        print(f"unknown record(s) {', '.join(unknown)}; the records: {', '.join(TOOLS)}", file=sys.stderr)
        return 2
    for name in [] if names else TOOLS:
        try:
            names += [name] if stale(name) else []
        except Problem:
            names.append(name)
    for name in names:
        try:
            named = load(name).get("provenance", {}).get("command")
        except (Problem, AttributeError):
            continue                                     # unreadable: nothing in it is run anyway
        if named is not None and named != TOOLS[name][1]:
            print(f"refused: {TOOLS[name][0]}'s provenance names the command {named!r}, not its tool's "
                  f"{TOOLS[name][1]!r}; records.py runs only its own table (TOOLS): nothing was run", file=sys.stderr)
            return 2
    for name in names:
        print(f"refresh {name}: python3 {' '.join(TOOLS[name][1])}", flush=True)
        status = subprocess.run([sys.executable, *TOOLS[name][1]], cwd=ROOT).returncode
        if status != 0:
            print(f"refresh {name}: its tool exited {status}; nothing rendered", file=sys.stderr)
            return status
    return render()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__[__doc__.index("Exit statuses"):],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="name every stale record and every block that differs")
    sub.add_parser("refresh", help="run the tools of the named records (default: the stale ones), then render") \
        .add_argument("names", nargs="*", metavar="NAME", help=", ".join(TOOLS))
    sub.add_parser("render", help="write the generated blocks of " + ", ".join(DOCS)) \
        .add_argument("--check", action="store_true", help="write nothing; exit 1 if a block differs")
    args = ap.parse_args(argv)
    return check() if args.cmd == "check" else refresh(list(args.names)) if args.cmd == "refresh" else render(args.check)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:                     # a reader gone (| head): no traceback; a shell's 128 + SIGPIPE
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)
