"""The command line of experiments.py: runs the registered experiments into an output folder.

    python3 experiments.py [names...] [--quick] [--seed S] [--out DIR] [--overwrite] [--list]

It calls each experiment (experiments.EXPERIMENTS) with its own random stream, prefixes each row's
id with the experiment's name, and writes through icl_files (the project's one writer): one CSV per
experiment (and per extra table), the figures its plot function draws (with matplotlib; a PNG and a PDF
beside it), the
run's record config.json (options, versions, the commit and whether the tree was dirty, status,
each file with its SHA-256) and summary.md. It prints a heartbeat while an experiment runs, holds
SIGINT and SIGTERM while an experiment's files are written, and ends with a tally and an exit
status (EXIT_STATUSES; README's table). Nothing of the experiments' mathematics is here.
"""
import argparse
import contextlib
import csv
import io
import json
import os
import platform
import re
import signal
import sys
import textwrap
import threading
import time
import traceback
import zlib

import numpy as np
import scipy
import threadpoolctl

import experiments as ex
import experiments_beyond  # noqa: F401  (registers the experiments beyond the paper, after the paper's)
import icl_files

def cell(value):
    """A field's value in a CSV cell: numbers as Python writes them (repr, full precision), vectors as
    JSON lists, None as an empty cell."""
    if value is None:
        return ""
    if isinstance(value, (list, tuple, np.ndarray)):
        return json.dumps(np.asarray(value, dtype=object).tolist(), default=lambda x: x.item())
    if isinstance(value, np.generic):
        return value.item()
    return value


def with_ids(prefix, rows):
    """rows with `prefix` + "/" before each id (the experiment's name, or name_TABLE for an extra
    table), the id first; a row without an id, an id not of ex.ID_PATTERN or given twice is a bug of
    the experiment (ValueError: the run crashes, exit 70)."""
    out = [dict(id=f"{prefix}/{r.get('id')}", **{k: v for k, v in r.items() if k != "id"}) for r in rows]
    ids = [r["id"] for r in out]
    bad = [i for i in ids if not re.fullmatch(ex.ID_PATTERN, i)] + [i for i in set(ids) if ids.count(i) > 1]
    if bad:
        raise ValueError(f"{prefix}: row ids missing, malformed or repeated: {sorted(set(bad))}")
    return out


def csv_bytes(rows):
    """rows (dicts) as the bytes of a CSV file (UTF-8): one column per field, ex.FIELDS first (id
    first of all). Made in memory, so that the record holds its SHA-256 before it is written."""
    keys = list(dict.fromkeys([k for k in ex.FIELDS if any(k in r for r in rows)] + [k for r in rows for k in r]))
    f = io.StringIO(newline="")
    w = csv.DictWriter(f, fieldnames=keys)
    w.writeheader()
    w.writerows({k: cell(r.get(k)) for k in keys} for r in rows)
    return f.getvalue().encode("utf-8")


def render(r):
    """A row's cells as the printed table and summary.md show them, from its fields only."""
    measured = ex.fmt(r["measured"])
    if r["se"] is not None and np.any(np.asarray(r["se"]) != 0):      # se 0: an exact quantity
        measured += f" ± {ex.fmt(r['se'], 2)}"
    check = ""
    if r["check"]:
        check = r["check"]
        word, _, reason = (r.get("kind") or "").partition(" (")
        if r["tolerance"] is not None:      # "statistical, tolerance 0.01 (4 SE)", "exact, tolerance 1e-12 (rounding: ...)"
            check += f"; {word + ', ' if word else ''}tolerance {ex.fmt(r['tolerance'], 2)}" + (f" ({reason}" if reason else "")
        elif word:                          # a property decided without a tolerance
            check += f"; {word}" + (f" ({reason}" if reason else "")
    verdict = r["verdict"] + (f": {r['why']}" if r["why"] else "")
    details = "; ".join(f"{k} {ex.fmt(v)}" for k, v in r.items() if k not in ex.FIELDS and v is not None)
    return [r["claim"], ex.fmt(r["theory"]), measured, check, verdict, details]


def markdown_table(rows):
    lines = ["| claim | theory | measured | check | verdict | details |", "|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in render(r)) + " |" for r in rows]
    return "\n".join(lines)


# How every figure is drawn and saved (docs/FIGURES.md, the checklist): a PNG at FIGURE_DPI and a vector
# copy (PDF, no creation date: a rerun writes the same bytes) beside it; text at least MIN_FONT_PT at the
# saved size; the Okabe-Ito colour-blind-safe palette (C0 blue, C1 orange, C2 green, C3 vermillion, ...)
FIGURE_DPI = 150
MIN_FONT_PT = 8.0
MATH_SCRIPT_SCALE = 0.7            # mathtext's size for a sub- or superscript (its SHRINK_FACTOR)
MAX_FIGURE_WIDTH_IN = 7.0          # a journal's two-column width
FIGURE_FORMATS = ("png", "pdf")
OKABE_ITO = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000"]
# drawn at the DPI it is saved at: what is measured on a drawn figure in pixels (bars_inside_markers) is
# measured in the saved PNG's pixels (at matplotlib's default of 100 dpi a "pixel" was 1.5 of them)
FIGURE_STYLE = {"figure.dpi": FIGURE_DPI, "font.size": 9, "axes.titlesize": 9, "axes.labelsize": 9, "legend.fontsize": 8,
                "xtick.labelsize": 8, "ytick.labelsize": 8, "figure.titlesize": 10, "lines.markersize": 6,
                "errorbar.capsize": 3, "legend.framealpha": 0.9}


def script_depth(text):
    """How deep sub- and superscripts nest in the math ($...$) of `text`: 0 none, 1 for $A_l$ or
    $\\Sigma^{-1}$, 2 for $x_{a_b}$. Mathtext draws each level at MATH_SCRIPT_SCALE of the one around it."""
    deepest = 0
    for part in text.split("$")[1::2]:
        level, opened, pending, i = 0, [], False, 0
        while i < len(part):
            ch = part[i]
            if ch in "_^":
                pending = True
            elif ch == "{":
                opened.append(pending)
                level, pending = level + pending, False
            elif ch == "}":
                level -= opened.pop() if opened else 0
            elif not ch.isspace():            # an atom: a character or a command (\\Sigma), scripted if pending
                if ch == "\\":
                    while i + 1 < len(part) and part[i + 1].isalpha():
                        i += 1
                deepest, pending = max(deepest, level + pending), False
            i += 1
    return deepest


def text_size(t):
    """The smallest size (points) a text object draws at: its font size, scaled down for its math scripts."""
    return t.get_fontsize() * MATH_SCRIPT_SCALE ** script_depth(t.get_text())


def small_text(fig, least=MIN_FONT_PT):
    """The texts of `fig` (titles, labels, tick labels, legends, annotations, math scripts included) that
    draw below `least` points."""
    return [t for t in fig.findobj(lambda a: hasattr(a, "get_fontsize") and hasattr(a, "get_text"))
            if t.get_visible() and t.get_text() and text_size(t) < least - 1e-9]


def text_outside(fig, slack=1.0):
    """The visible texts of `fig` that reach beyond its edges by more than `slack` pixels (the saved image
    would cut them; a pixel: a glyph's box includes antialiasing that is not ink)."""
    renderer = fig.canvas.get_renderer()
    edge = fig.bbox
    # an axis keeps tick labels for ticks beyond its limits, which it does not draw (a tick on a limit is
    # drawn: 1e-9 of the range allows the rounding of the limit and the tick location)
    undrawn = set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                if not lo - 1e-9 * (hi - lo) <= tick.get_loc() <= hi + 1e-9 * (hi - lo):
                    undrawn.update((id(tick.label1), id(tick.label2)))
    out = []
    for t in fig.findobj(lambda a: hasattr(a, "get_fontsize") and hasattr(a, "get_text")):
        if not (t.get_visible() and t.get_text().strip()) or id(t) in undrawn:
            continue
        box = t.get_window_extent(renderer)
        if (box.x0 < edge.x0 - slack or box.y0 < edge.y0 - slack or box.x1 > edge.x1 + slack
                or box.y1 > edge.y1 + slack):
            out.append(t)
    return out


def log_tick_label(x):
    """A log axis' tick label without a superscript (0.01, 1e-5: mathtext would draw the exponent of
    10 to the -5 at 70 %, below the tick labels' 8 pt)."""
    return f"{x:g}" if 1e-3 <= abs(x) < 1e4 else f"{x:.0e}".replace("e-0", "e-").replace("e+0", "e")


def figure_bytes(fig, fmt):
    """One figure as `fmt` ("png" at FIGURE_DPI, or "pdf" without its creation date) bytes. First the
    log axes get log_tick_label's tick labels (where a plot function set none of its own) and any text
    drawn below MIN_FONT_PT (a math script counted at its own size) is raised to it (the checklist's
    floor holds whatever a plot function set); tick labels exist only once drawn, so the figure is
    drawn until none is raised. A text that reaches beyond the figure's edge (text_outside) is a
    ValueError: the image would cut it."""
    from matplotlib.ticker import LogFormatter, LogFormatterSciNotation

    class PlainLogFormatter(LogFormatter):
        def _num_to_string(self, x, vmin, vmax):
            return log_tick_label(x)
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            if axis.get_scale() != "log":
                continue
            # matplotlib's own (10 to a power) are replaced; labels a plot function chose are kept
            if type(axis.get_major_formatter()) is LogFormatterSciNotation:
                axis.set_major_formatter(PlainLogFormatter())
            if type(axis.get_minor_formatter()) is LogFormatterSciNotation:
                axis.set_minor_formatter(PlainLogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.4)))
    for _ in range(3):                        # raising a size can make new tick labels: check again
        fig.canvas.draw()
        small = small_text(fig)
        if not small:
            break
        for t in small:
            t.set_fontsize(MIN_FONT_PT / MATH_SCRIPT_SCALE ** script_depth(t.get_text()))
        for ax in fig.axes:                   # new tick labels take the axis' size, not the raised label's
            for axis, name in ((ax.xaxis, "x"), (ax.yaxis, "y")):
                labels = [t for t in axis.get_ticklabels(which="both") if t in small]
                if labels:
                    ax.tick_params(axis=name, which="both", labelsize=max(t.get_fontsize() for t in labels))
    cut = text_outside(fig)
    if cut:          # a text the saved image would cut: the plot function must make room (no image is written)
        raise ValueError("text beyond the figure's edge: " + "; ".join(repr(t.get_text()[:60]) for t in cut))
    f = io.BytesIO()
    metadata = {"CreationDate": None} if fmt == "pdf" else {"Software": None} if fmt == "png" else None
    fig.savefig(f, format=fmt, dpi=FIGURE_DPI, metadata=metadata)
    if fmt != "png":
        return f.getvalue()
    # an opaque figure's PNG without its alpha channel, deflated harder: the same pixels in about a tenth
    # fewer bytes (the blocks heat map stays under the repository's 500 kB a file)
    from PIL import Image                     # matplotlib's own dependency
    image = Image.open(f)
    if image.mode != "RGBA" or image.getextrema()[3] != (255, 255):
        return f.getvalue()
    out = io.BytesIO()
    image.convert("RGB").save(out, format="png", optimize=True, dpi=(FIGURE_DPI, FIGURE_DPI))
    return out.getvalue()


def figures(name, rows, tables):
    """The figures of what an experiment reproduces, drawn by its plot function (ex.PLOTS) from its rows'
    and tables' fields, with the exact theory beside the measured values (matplotlib, optional), each
    saved as a PNG (FIGURE_DPI) and a PDF beside it (FIGURE_FORMATS) in FIGURE_STYLE.
    Titles and captions say what this run showed: its seed and start counts, which runs converged (a
    "not converged" style in the legend), and a claim only where the run's rows decided it. Returns
    ([(PNG file name, caption)], {file name: bytes} of the PNGs and PDFs, [measured rows], a note for the run
    or None): without matplotlib the note says once how to get figures. A plot function passes save(fig,
    suffix, bars={key: (series, markers, inside)}) what it measured of a figure's error bars
    (ex.bars_inside_markers; markers: their word, "circles"); each becomes a row of the table NAME_drawn
    (figure, series, markers, bars, inside: how many are smaller than their markers), so that the documents render what the run's captions
    say from numbers (docs/FINDINGS.md)."""
    if name not in ex.PLOTS:
        return [], {}, [], None
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], {}, [], "No figures: matplotlib is not installed (python3 -m pip install matplotlib, or pip install .[plot])."
    drawn, measured = {}, []

    def save(fig, suffix, bars=None):
        for fmt in FIGURE_FORMATS:
            drawn[f"{name}{suffix}.{fmt}"] = figure_bytes(fig, fmt)
        plt.close(fig)
        for key, (series, markers, inside) in (bars or {}).items():
            measured.append(dict(id=suffix.strip("_") + "-" + key if suffix else key, figure=f"{name}{suffix}.png",
                                 series=series, markers=markers, bars=len(inside), inside=sum(inside)))
        return f"{name}{suffix}.png"
    style = dict(FIGURE_STYLE, **{"axes.prop_cycle": matplotlib.cycler(color=OKABE_ITO)})
    with matplotlib.rc_context(style):
        return ex.PLOTS[name](plt, save, rows, tables), drawn, measured, None


def experiment_files(name, rows, tables):
    """An experiment's files as bytes, {file name: bytes}: name.csv (its rows), name_TABLE.csv per
    extra table, its figures (PNG and PDF) and name_drawn.csv, what was measured on them (figures); with the
    figures' captions and a note when matplotlib is missing."""
    files = {f"{name}.csv": csv_bytes(rows)}
    files.update({f"{name}_{table}.csv": csv_bytes(with_ids(f"{name}_{table}", content))
                  for table, content in tables.items()})
    captions, drawn, measured, note = figures(name, rows, tables)
    files.update(drawn)
    if measured:
        files[f"{name}_drawn.csv"] = csv_bytes(with_ids(f"{name}_drawn", measured))
    return files, captions, note


def nonneg_int(text):
    """argparse type: an integer >= 0."""
    return bounded_int(text, 0)


def positive_int(text):
    """argparse type: an integer >= 1."""
    return bounded_int(text, 1)


def bounded_int(text, least):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {value}")
    return value


RECORD = "config.json"              # the run's record: options, versions, status, each file written with its SHA-256
SUMMARY = "summary.md"
LOCK = ".experiments.lock"          # present while a run holds the folder (icl_files: flock, or created exclusively)
FORMAT = "icl_ref experiments record"
FORMAT_VERSION = 3                  # 3: every file with its SHA-256 (icl_files); 2 listed names only
TOOL = "experiments.py"

# The exit statuses (README's table): each with the status config.json says and when it is returned.
# 70 and 74 are sysexits.h's EX_SOFTWARE and EX_IOERR; 128 + N is what a shell shows for signal N
# (a broken pipe: SIGPIPE, 13, which Python ignores to raise BrokenPipeError instead).
EXIT_OK, EXIT_FAILED, EXIT_REFUSED, EXIT_CRASHED, EXIT_WRITE_ERROR = 0, 1, 2, 70, 74
EXIT_SIGINT, EXIT_BROKEN_PIPE, EXIT_SIGTERM = 128 + signal.SIGINT, 128 + 13, 128 + signal.SIGTERM
EXIT_STATUSES = {
    EXIT_OK: ("complete", "every checked claim holds"),
    EXIT_FAILED: ("complete", "a checked claim failed (named on stderr and in summary.md)"),
    EXIT_REFUSED: ("untouched", "bad arguments, or --out refused (nothing written; the message says why)"),
    EXIT_CRASHED: ("crashed", "an experiment raised an error (a bug): its traceback on stderr"),
    EXIT_WRITE_ERROR: ("write error", "a write into --out (or to stdout) failed: disk full, file-size limit, no permission, "
                                      "or a file not the run's appeared under an output's name"),
    EXIT_SIGINT: ("interrupted", "stopped by Ctrl-C (SIGINT)"),
    EXIT_BROKEN_PIPE: ("broken pipe", "stdout was closed (`| head`, a pager quit)"),
    EXIT_SIGTERM: ("interrupted", "stopped by SIGTERM"),
}


def output_of(name, filename):
    """Whether `filename` is a name experiment `name` may write: its rows name.csv, an extra table
    name_TABLE.csv, a figure name.png or name_SUFFIX.png with its PDF; no other name is its."""
    stem, dot, ext = filename.rpartition(".")
    return dot == "." and ext in ("csv", *FIGURE_FORMATS) and (stem == name or stem.startswith(f"{name}_"))


def trusted_record(record):
    """Whether a record (a parsed config.json) is experiments.py's in this format: the marker, the
    tool, this version, and per experiment a list of its own outputs' names. icl_files then trusts
    the SHA-256 of each file it lists, and nothing else."""
    if not (record.get("format") == FORMAT and record.get("tool") == TOOL
            and record.get("format_version") == FORMAT_VERSION and isinstance(record.get("experiments"), dict)):
        return False
    for name, entry in record["experiments"].items():
        files = entry.get("files") if isinstance(entry, dict) else None
        if not (isinstance(files, list) and all(isinstance(f, str) and os.path.basename(f) == f and output_of(name, f)
                                                for f in files)):
            return False
    return True


def out_folder(path):
    """--out as an icl_files.Folder: config.json its record, .experiments.lock its lock."""
    return icl_files.Folder(path, TOOL, RECORD, LOCK, trusted=trusted_record)


class Stopped(KeyboardInterrupt):
    """SIGTERM, raised where the run is, so that it stops as a Ctrl-C does (the trainers return
    their last iterate, the run writes what completed)."""


def exit_table():
    """EXIT_STATUSES as --help lists them."""
    return "\n".join(textwrap.fill(when, 100, initial_indent=f"  {code:3d}  ", subsequent_indent=" " * 7)
                     for code, (_, when) in EXIT_STATUSES.items())


HELP_EPILOG = f"""\
--out: a new or empty directory, or (with --overwrite) one an earlier run of experiments.py wrote.
--overwrite replaces only the files of the experiments named on this command line, and only those
whose bytes are what the earlier run's {RECORD} says it wrote (their SHA-256); the other
experiments' results stay, and stay in the record. A file of yours (any other file, or one you
changed) is refused, named, never replaced; nothing is written through a symbolic link; a directory
another run is writing into is refused. Files of yours beside the results are refused unless
--keep-others. After a run was killed, --overwrite takes back the files it can prove and names the
ones you must remove.
Exit status ({RECORD} says how the run ended):
{exit_table()}"""


class Console:
    """The run's printed lines (stdout). A reader that goes away (`| head`, a pager quit) must not
    crash the run between writing an experiment's files and recording them: the first broken pipe
    closes the console (later lines go nowhere; stdout is pointed at os.devnull, as Python's
    documentation advises, so that its flush at exit is quiet too), and the run stops where it is
    safe, with EXIT_BROKEN_PIPE."""

    def __init__(self, start):
        self.start, self.closed, self.failed = start, False, None

    def say(self, text):
        if not self.closed:
            try:
                print(text, flush=True)
            except BrokenPipeError:
                self.close()
            except OSError as e:                            # stdout on a full disk, /dev/full: a write error
                self.failed = icl_files.WriteFailed("stdout", e)
                self.close()

    def stop_if_closed(self):
        """Stop the run where it is safe once the console closed: a broken pipe, or stdout's write error."""
        if self.closed:
            raise self.failed or BrokenPipeError()

    def log(self, msg):
        self.say(f"[{time.perf_counter() - self.start:7.1f} s] {msg}")

    def close(self):
        self.closed = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):         # a stdout without a descriptor (a test's capture)
            pass


class Ending:
    """How a run ended other than by running every experiment to its record: the record's status,
    the exit status, what stopped it (the record's stopped_by) and the error's message."""

    def __init__(self, status, exit_status, stopped_by, error=None):
        self.status, self.exit_status, self.stopped_by, self.error = status, exit_status, stopped_by, error

    @classmethod
    def of(cls, e, term):
        """The ending an exception raised in the run means; `term`: a SIGTERM arrived."""
        if isinstance(e, KeyboardInterrupt):
            if isinstance(e, Stopped) or term:
                return cls("interrupted", EXIT_SIGTERM, "SIGTERM")
            return cls("interrupted", EXIT_SIGINT, "SIGINT (Ctrl-C)")
        if isinstance(e, BrokenPipeError):
            return cls("broken pipe", EXIT_BROKEN_PIPE, "broken pipe: stdout was closed")
        if isinstance(e, (icl_files.WriteFailed, icl_files.Refused)):
            return cls("write error", EXIT_WRITE_ERROR, "write error", str(e))
        return cls("crashed", EXIT_CRASHED, "crash", "".join(traceback.format_exception_only(type(e), e)).strip())

    def fields(self):
        return dict(stopped_by=self.stopped_by, **({} if self.error is None else dict(error=self.error)))

    def headline(self, names, done):
        """summary.md's first line: what stopped the run and what of it completed."""
        what = ("every experiment completed" if done == names else
                f"only {', '.join(done)} completed; this is not a full run" if done else
                "no experiment completed, so there are no results; this is not a full run")
        if self.status == "interrupted":
            return f"**INTERRUPTED** by {self.stopped_by}: {what}."
        return f"**STOPPED** ({self.stopped_by}{': ' + self.error if self.error else ''}): {what}."


@contextlib.contextmanager
def signals_held(held):
    """`with signals_held(held):` SIGINT and SIGTERM wait (their numbers appended to `held`) while
    the block runs, so an experiment's files and its record entry are written whole; the handlers
    before it are back after it, however it ends. Only the main thread can set handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    outer = [signal.signal(s, lambda signum, frame: held.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)]
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, outer[0])
        signal.signal(signal.SIGTERM, outer[1])


def parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=HELP_EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="experiments to run (default: all; a name given twice runs once)")
    ap.add_argument("--quick", action="store_true", help="reduced sizes (about a minute and a half in all on 2 cores)")
    ap.add_argument("--seed", type=nonneg_int, default=0, help="integer >= 0 (default: 0)")
    ap.add_argument("--out", default="results", help="directory for the results (default: results)")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace the named experiments' files of an earlier run in --out (see below)")
    ap.add_argument("--keep-others", action="store_true",
                    help="with --overwrite: leave files in --out that no run wrote, instead of refusing")
    ap.add_argument("--list", action="store_true", help="list the experiments and exit")
    ap.add_argument("--progress", type=nonneg_int, default=0,
                    help="print training progress every k steps (default: 0, off)")
    ap.add_argument("--threads", type=positive_int, default=None,
                    help="icl_fast's worker threads per evaluation, an integer >= 1 (default: every core)")
    return ap


class Heartbeat:
    """While a `with Heartbeat(log, what)` block runs, a line every `every` seconds saying it still does."""

    def __init__(self, log, what, every=10.0):
        self.log, self.what, self.every = log, what, every
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.beat, daemon=True)

    def beat(self):
        start = time.perf_counter()
        while not self.stop.wait(self.every):
            self.log(f"  ... {self.what} still running ({time.perf_counter() - start:.0f} s)")

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def tally(rows):
    """{verdict: count} over rows, every verdict present (0 when absent)."""
    return {v: sum(r["verdict"] == v for r in rows) for v in (ex.PASS, ex.FAIL, ex.INFO, ex.NO_VERDICT)}


def main(argv=None):
    """The command line; returns the exit status (EXIT_STATUSES; bad arguments and a refused --out
    raise SystemExit(2) through argparse). The caller's signal handlers are as they were after it."""
    ap = parser()
    args = ap.parse_args(argv)
    if args.list:
        for name, (_, answers) in ex.EXPERIMENTS.items():
            print(f"{name:24s} {answers}")
        return EXIT_OK
    unknown = [n for n in args.names if n not in ex.EXPERIMENTS]
    if unknown:
        ap.error(f"unknown experiment(s) {unknown}; --list shows the names")
    names = list(dict.fromkeys(args.names)) or list(ex.EXPERIMENTS)
    out = out_folder(args.out)
    try:
        out.open(args.overwrite, args.keep_others,
                 writes=lambda f: f == SUMMARY or any(output_of(n, f) for n in names))
    except icl_files.Refused as e:
        out.close()
        ap.error(f"--out {e}")
    try:
        return run(args, names, out)
    finally:
        out.close()


def kept_experiments(out, names):
    """The earlier run's complete experiments this run does not redo, from its record: they stay,
    in the folder and in the record. One whose files are not all still the ones it wrote (a file
    replaced since, by the user) stays as `incomplete`, listing only the files still its own."""
    earlier = out.earlier["experiments"] if out.earlier else {}
    kept = {}
    for n, e in earlier.items():
        if n not in names and e.get("status") == "complete":
            gone = [f for f in e["files"] if f not in out.owned]
            kept[n] = dict(e, status="incomplete", files=[f for f in e["files"] if f in out.owned],
                           why=f"{', '.join(gone)} no longer the file{'s' if len(gone) > 1 else ''} it wrote") if gone else e
    return kept


def leftovers(out, kept, names):
    """The files the record proves ours that no kept experiment lists and this run does not write
    again: what a stopped run left of an experiment it did not finish."""
    listed = {f for e in kept.values() for f in e["files"]}
    return sorted(f for f in out.owned if f not in listed and f != SUMMARY and not any(output_of(n, f) for n in names))


def record_experiment(out, experiments, done, name, files, entry):
    """Write an experiment's files and its record entry: the entry first (status "writing"), the
    earlier run's files of the experiment that this one does not write again removed, the files
    written (icl_files records each one's hash before and after), then the entry "complete"."""
    experiments.pop(name, None)
    experiments[name] = dict(entry, files=list(files), status="writing")
    out.remove(sorted(f for f in out.owned if output_of(name, f) and f not in files))
    out.write(files)
    experiments[name]["status"] = "complete"
    done.append(name)
    out.save()


def run(args, names, out):
    """Run the experiments `names` into the open folder `out`; returns the exit status. However the
    run ends (EXIT_STATUSES) it writes summary.md and the record when it can, saying how it ended."""
    start = time.perf_counter()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    console = Console(start)
    log = console.log
    this_run = dict(argv=sys.argv, names=names, quick=args.quick, seed=args.seed, threads=args.threads,
                    started_utc=started, **icl_files.source_state(ex.SOURCES), numpy=np.__version__,
                    scipy=scipy.__version__, python=platform.python_version(),
                    threadpoolctl=threadpoolctl.__version__, cores=len(os.sched_getaffinity(0))
                    if hasattr(os, "sched_getaffinity") else os.cpu_count())
    done, results, experiments = [], {}, {}
    out.fields = dict(format=FORMAT, tool=TOOL, format_version=FORMAT_VERSION, **this_run, completed=done,
                      experiments=experiments)
    ending, plot_note = None, None
    # SIGTERM stops the run as Ctrl-C does; while the results are written at the end, both wait
    main_thread = threading.current_thread() is threading.main_thread()
    term = []                   # the trainers turn the exception into a result: the run remembers the signal here

    def on_sigterm(signum, frame):
        term.append(signum)
        raise Stopped()
    previous_term = signal.signal(signal.SIGTERM, on_sigterm) if main_thread else None
    previous_int = signal.getsignal(signal.SIGINT) if main_thread else None
    late = []
    try:
        try:
            # the earlier run's experiments stay in the record until this run replaces them (an
            # experiment's old files are removed only once its new results are ready)
            experiments.update(kept_experiments(out, names))
            out.save("running")
            out.remove(leftovers(out, experiments, names))
            for k, name in enumerate(names, 1):
                console.stop_if_closed()
                fn, answers = ex.EXPERIMENTS[name]
                log(f"[{k}/{len(names)}] {name}: {answers}")
                t0, cpu0 = time.perf_counter(), time.process_time()
                # the stream depends on the experiment's name, not its position: each reproduces alone
                ctx = ex.Context(rng=np.random.default_rng([args.seed, zlib.crc32(name.encode())]), seed=args.seed,
                                 quick=args.quick, log=log, progress=args.progress, threads=args.threads)
                with Heartbeat(log, name):
                    rows, tables = fn(ctx)
                rows = [dict(r, experiment=name) for r in with_ids(name, rows)]
                seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
                files, pngs, note = experiment_files(name, rows, tables)
                plot_note = plot_note or note
                held = []
                with signals_held(held):
                    record_experiment(out, experiments, done, name, files, dict(
                        answers=answers, quick=args.quick, seed=args.seed, run_started_utc=started,
                        seconds=round(seconds, 1), cpu_seconds=round(cpu, 1),
                        commit=this_run["commit"], dirty=this_run["dirty"], tally=tally(rows)))
                results[name] = (rows, pngs, seconds)
                console.say(markdown_table(rows))
                if held:
                    term.extend(s for s in held if s == signal.SIGTERM)
                    raise Stopped() if signal.SIGTERM in held else KeyboardInterrupt()
                log(f"[{k}/{len(names)}] {name} done in {seconds:.1f} s ({cpu:.1f} s of CPU); "
                    f"{time.perf_counter() - start:.0f} s so far")
            console.stop_if_closed()                             # the last lines were not all delivered
        except Exception as e:
            ending = Ending.of(e, term)
            if ending.status == "crashed":
                traceback.print_exc()                            # the bug's traceback, on stderr
            if ending.status == "broken pipe":
                console.close()
        except KeyboardInterrupt as e:
            ending = Ending.of(e, term)
        if main_thread:
            signal.signal(signal.SIGTERM, lambda signum, frame: late.append(signum))
            signal.signal(signal.SIGINT, lambda signum, frame: late.append(signum))
        ending = finish(args, names, out, results, done, ending, plot_note, start, log)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous_term)
            signal.signal(signal.SIGINT, previous_int)
    if ending is None and late:
        # every experiment had completed, so the record says complete; the exit status says a stop came
        log(f"{signal.Signals(late[0]).name} arrived while the results were written: they are complete; stopping")
        return 128 + late[0]
    if ending is not None and ending.status == "broken pipe":
        print(f"{TOOL}: stdout was closed (broken pipe): stopped after {len(done)} of {len(names)} experiments; "
              f"{out.show(RECORD)} says so; exit status {ending.exit_status}", file=sys.stderr)
    return ending.exit_status if ending else EXIT_FAILED if failed_claims(results) else EXIT_OK


def failed_claims(results):
    return [f"{r['experiment']}: {r['claim']}" for rs, _, _ in results.values() for r in rs if r["verdict"] == ex.FAIL]


def summary_text(args, names, out, results, done, ending, plot_note, start):
    """summary.md: the tally, how the run ended, each experiment's table and figures, the kept ones."""
    rows = [r for rs, _, _ in results.values() for r in rs]
    summary = [f"# icl_ref experiments ({'quick' if args.quick else 'full'}, seed {args.seed})", ""]
    if ending:
        summary += [ending.headline(names, done), ""]
    summary += [tally_line(tally(rows)), ""]
    deferred = [r for r in rows if r["why"].startswith("full run only")]
    if deferred:
        summary += ["Full run only (the --quick sizes cannot decide these; reported as INFO):", ""]
        summary += [f"- {r['experiment']}: {r['claim']}" for r in deferred] + [""]
    for name, (rs, pngs, seconds) in results.items():
        summary += [f"## {name}", f"_{ex.EXPERIMENTS[name][1]}_ ({seconds:.1f} s)", "", markdown_table(rs), ""]
        for p, caption in pngs:
            pdf = p[:-len("png")] + "pdf"
            summary += [f"![{name}]({p})", "", f"_{caption}_ (vector copy: [{pdf}]({pdf}))", ""]
    experiments = out.fields["experiments"]
    kept = [n for n in experiments if n not in results]
    if kept:
        summary += ["## Kept from earlier runs", ""] + [
            f"- {n}: {', '.join(experiments[n]['files'])} ({'quick' if experiments[n].get('quick') else 'full'}, "
            f"seed {experiments[n].get('seed')}, run started {experiments[n].get('run_started_utc')})"
            + (f"; INCOMPLETE: {experiments[n].get('why')}" if experiments[n].get("status") == "incomplete" else "")
            for n in kept] + [""]
    if plot_note:
        summary += ["", plot_note]
    summary.append(f"Total {time.perf_counter() - start:.1f} s; numpy {np.__version__}, scipy {scipy.__version__}.")
    failed = failed_claims(results)
    if failed:
        summary += ["", "## Failed claims", ""] + [f"- {f}" for f in failed]
    return "\n".join(summary) + "\n"


def warn(text):
    """text on stderr; a stderr that cannot take it (full, closed) loses the text, never the exit status."""
    try:
        print(text, file=sys.stderr, flush=True)
    except OSError:
        pass


def finish(args, names, out, results, done, ending, plot_note, start, log):
    """Write summary.md and the record's final status; returns the run's ending (None: it ran to
    the end), which becomes a write error when these writes fail."""
    if ending:
        log(f"stopped by {ending.stopped_by}: writing the experiments that completed, then stopping")
    if plot_note:
        log(plot_note)
    try:
        out.write({SUMMARY: summary_text(args, names, out, results, done, ending, plot_note, start).encode("utf-8")})
    except (icl_files.WriteFailed, icl_files.Refused) as e:
        ending = ending if ending and ending.status == "write error" else Ending.of(e, [])
    counts = tally([r for rs, _, _ in results.values() for r in rs])
    try:
        out.save(ending.status if ending else "complete", tally=counts, **(ending.fields() if ending else {}))
    except (icl_files.WriteFailed, icl_files.Refused) as e:
        warn(f"{TOOL}: error: {e}; the record {out.show(RECORD)!r} could not be updated (it says {out.status!r})")
        ending = ending if ending and ending.status == "write error" else Ending.of(e, [])
    if ending and ending.status == "write error":
        warn(f"{TOOL}: error: {ending.error}")
    failed = failed_claims(results)
    if failed:
        warn("FAILED claims:\n  " + "\n  ".join(failed))
    status = ending.exit_status if ending else EXIT_FAILED if failed else EXIT_OK
    log(f"{tally_line(counts)}; {'STOPPED, ' if ending else ''}{len(done)} of {len(names)} experiments "
        f"in {time.perf_counter() - start:.0f} s; exit status {status}; summary in {out.show(SUMMARY)}")
    return ending


def tally_line(counts):
    return "tally: " + ", ".join(f"{c} {v}" for v, c in counts.items())


if __name__ == "__main__":
    sys.exit(main())
