"""The project stands alone: citations into MATH.md resolve, MATH.md names only what exists, every public
function cites its section, no tracked file points outside the repository (records: test_records.py)."""
import ast
import glob
import inspect
import os
import re
import subprocess

import pytest

import icl_check as ic
import icl_estimators as est
import icl_fast
import icl_looped as lp
import icl_ref as ir

ROOT = os.path.dirname(os.path.abspath(__file__))


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


MATH = read("MATH.md")
SECTIONS = {int(k) for k in re.findall(r"^## §(\d+) ", MATH, flags=re.M)}
SUBSECTIONS = set(re.findall(r"^### §(\d+\.\d+) ", MATH, flags=re.M))
OUTSIDE = ".." + "/shared"                  # spelled in two parts so this file does not match itself
MAX_BYTES = 500_000


def citations(text):
    """(sections, subsections): every section k in "MATH.md §k", "MATH.md §j-§k" and "MATH.md §j, §k"
    (a subsection §k.j counts as its section k), and every "k.j" cited as §k.j in such a run."""
    sections, subsections = [], []
    for run in re.findall(r"MATH\.md((?:[ ,\-–]*§\d+(?:\.\d+)?)+)", text):
        ks = [int(k) for k in re.findall(r"§(\d+)", run)]
        sections += ks if "-" not in run else list(range(ks[0], ks[-1] + 1))
        subsections += re.findall(r"§(\d+\.\d+)", run)
    return sections, subsections


def test_math_md_is_in_order_and_tracked_files_cite_only_its_sections_stay_small_and_point_inside():
    numbers = [int(k) for k in re.findall(r"^## §(\d+) ", MATH, flags=re.M)]
    assert numbers == list(range(1, len(numbers) + 1))
    example = "see MATH" + ".md §3.1, §3.9, §4"            # spelled in two parts: not a citation here
    assert citations(example) == ([3, 3, 4], ["3.1", "3.9"])
    try:
        tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):     # an unpacked sdist has no .git
        pytest.skip("not a git checkout")
    missing = []
    for f in filter(None, tracked.decode().split("\0")):
        with open(os.path.join(ROOT, f), "rb") as fh:
            data = fh.read()
        assert len(data) <= MAX_BYTES and OUTSIDE.encode() not in data, f"{f} is {len(data)} bytes or refers to {OUTSIDE}"
        if f.endswith((".py", ".md", ".toml", ".txt")) or f.startswith(".ci/"):
            sections, subsections = citations(data.decode("utf-8"))
            missing += [(f, k) for k in sections if k not in SECTIONS] + [(f, k) for k in subsections if k not in SUBSECTIONS]
    assert not missing, f"citations of MATH.md sections or subsections that do not exist: {missing}"


# The modules in the order README.md introduces them, each built on the ones before it: MATH.md's order
MODULES = {"icl_ref": ir, "icl_check": ic, "icl_looped": lp, "icl_estimators": est, "icl_fast": icl_fast}


def listed(label, text=MATH):
    """{section: [(where, name)]} from the "**Implemented by**" or "**Checked by**" paragraphs of each
    "## §k" section of MATH.md (its subsections' included; the closing "Notes on the code" is no section),
    read as its introduction says: a name is icl_ref's and a test is in test_icl_ref.py, unless a module
    ("`icl_check`'s") or a test file ("`test_icl_fast.py`") is named before it in the paragraph."""
    default, switch = (("icl_ref", r"`(icl_[a-z_]+)`'s") if label == "Implemented by"
                       else ("test_icl_ref.py", r"`(test_[a-z_0-9]+\.py)`"))
    out = {}
    for k, body in re.findall(r"^## §(\d+) .*?\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S):
        paras = re.findall(rf"\*\*{label}\*\*(.*?)(?=\n\n|\*\*Checked by\*\*|\Z)", body, flags=re.S)
        if paras:        # a section and its subsections (### §k.j) may each have one
            out[int(k)] = names = []
            for p in paras:
                where = default
                for named, name in re.findall(rf"{switch}|`([A-Za-z_][A-Za-z0-9_]*)`", p):
                    if named:
                        where = named
                    else:
                        names.append((where, name))
    return out


def test_math_md_lists_are_read_as_its_introduction_says():
    # the reading the tests below rely on: a module or a test file named in a list holds for the
    # names after it in that paragraph, and the default returns in the next paragraph
    example = ("## §1 One\n\n**Implemented by** `f`, `icl_check`'s `g`, `h`; `icl_ref`'s `k`.\n"
               "**Checked by** `test_a` (`EXACT`), and in `test_icl_fast.py` `test_b`.\n\n"
               "### §1.1 Sub\n\n**Checked by** `test_c`.\n\n## Notes on the code\n\n**Checked by** `test_d`.\n")
    assert listed("Implemented by", example) == {1: [("icl_ref", "f"), ("icl_check", "g"), ("icl_check", "h"),
                                                     ("icl_ref", "k")]}
    assert listed("Checked by", example) == {1: [("test_icl_ref.py", "test_a"), ("test_icl_ref.py", "EXACT"),
                                                 ("test_icl_fast.py", "test_b"), ("test_icl_ref.py", "test_c")]}
    assert "Implemented by** (the functions" in MATH and "unless a module is named" in MATH \
        and "unless a file is named" in MATH, "MATH.md's introduction no longer says how its lists read"


def test_math_md_names_only_what_exists_and_every_public_function_cites_its_section():
    implemented, section_of = listed("Implemented by"), {}
    assert sorted(implemented) == sorted(SECTIONS), "every MATH.md section lists what implements it"
    # a name under Implemented by is its module's own (a function or class defined there, not imported,
    # or a constant of it), and a function cites each section that lists it
    for k, names in implemented.items():
        assert names, f"MATH.md §{k} names no implementing function"
        for module, name in names:
            assert module in MODULES, f"MATH.md §{k} names the module {module}, which is none of {', '.join(MODULES)}"
            obj = vars(MODULES[module]).get(name, KeyError)
            assert obj is not KeyError and (not callable(obj) or getattr(obj, "__module__", None) == module), \
                f"MATH.md §{k} names {module}'s {name}, which {module} does not define"
            assert not callable(obj) or k in citations(inspect.getdoc(obj) or "")[0], \
                f"{module}.{name} is listed under MATH.md §{k}, which its docstring does not cite"
            section_of.setdefault((module, name), set()).add(k)
    # every public function is listed, as its own module's: icl_ref's, icl_check's, icl_looped's and
    # icl_estimators's, and icl_fast's own formulation (its other public functions are icl_ref's
    # with engine=, and the machinery of engine() and shutdown(), which README's "Speed" documents)
    public = {module.__name__: [name for name, obj in vars(module).items() if inspect.isfunction(obj)
                                and not name.startswith("_") and obj.__module__ == module.__name__]
              for module in (ir, ic, lp, est)}
    public["icl_fast"] = [name for name, obj in vars(icl_fast).items() if callable(obj) and not isinstance(obj, type)
                          and not name.startswith("_") and getattr(obj, "__module__", None) == icl_fast.__name__
                          and not hasattr(ir, name) and name not in ("engine", "shutdown")]
    for module, names in public.items():
        assert names
        for name in names:
            assert (module, name) in section_of, f"{module}.{name} is not listed under any MATH.md section"
    # a test under Checked by is a test of its file (not one of the same name elsewhere)
    tests = {os.path.basename(path): {node.name for node in ast.parse(read(path)).body
                                      if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}
             for path in glob.glob(os.path.join(ROOT, "test_*.py"))}
    for k, names in listed("Checked by").items():
        assert any(name.startswith("test_") for _, name in names), f"MATH.md §{k} names no test"
        for path, name in names:
            if name.startswith("test_"):
                assert path in tests, f"MATH.md §{k} names tests in {path}, which is not a test file"
                assert name in tests[path], f"MATH.md §{k} names {name} in {path}, which has no such test"


def test_math_md_and_the_code_follow_the_modules_in_readmes_order():
    # a section belongs to the last module, in MODULES' order, whose names it lists under Implemented by
    # (it may use the modules before its own, never one after)
    home = {k: max((m for m, _ in names), key=list(MODULES).index) for k, names in listed("Implemented by").items()}
    # MATH.md's sections come in the order a reader meets the modules: README.md's first screen names
    # each module's file in backquotes, then its sections ("(MATH.md §1-§12)", "(§13)"), which are the
    # ones that list its functions, one run after another
    readme = {}
    for module, a, b in re.findall(r"`(icl_[a-z_]+)\.py`[^§`]*?\((?:MATH\.md )?§(\d+)(?:-§(\d+))?\)",
                                   read("README.md").split("\n## ", 1)[0]):
        readme.setdefault(module, list(range(int(a), int(b or a) + 1)))
    assert list(readme) == list(MODULES), f"README.md's first screen names the modules' sections as {readme}"
    assert [k for module in readme for k in readme[module]] == sorted(SECTIONS), \
        f"README.md's module sections {readme} are not MATH.md's §1-§{max(SECTIONS)} in order"
    wrong = {k: (home.get(k), module) for module in readme for k in readme[module] if home.get(k) != module}
    assert not wrong, f"MATH.md sections whose functions are another module's than README says ({{k: (lists, README)}}): {wrong}"
    # a "# §k ..." header in a module or in its test file names one of that module's MATH.md sections
    for module in MODULES:
        for path in (f"{module}.py", f"test_{module}.py"):
            headers = [int(k) for k in re.findall(r"^# §(\d+)(?:\.\d+)? ", read(path), flags=re.M)]
            wrong = [k for k in headers if home.get(k) != module]
            assert not wrong, f"{path}'s section headers name MATH.md sections of another module: {wrong}"
