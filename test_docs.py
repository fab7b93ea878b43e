"""The project stands alone: citations into MATH.md resolve, MATH.md names only what exists, every
public function cites the section that derives it, README's examples run as written, and no tracked file
points outside the repository. (The records under docs/ and the numbers the documents quote from them:
test_records.py.)"""
import ast
import glob
import inspect
import os
import re
import subprocess

import numpy as np
import pytest

import icl_check as ic
import icl_estimators as est
import icl_fast
import icl_looped as lp
import icl_ref as ir
import test_experiments
import test_icl_fast
import test_icl_ref

ROOT = os.path.dirname(os.path.abspath(__file__))


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


MATH = read("MATH.md")
SECTIONS = {int(k) for k in re.findall(r"^## §(\d+) ", MATH, flags=re.M)}
SUBSECTIONS = set(re.findall(r"^### §(\d+\.\d+) ", MATH, flags=re.M))
OUTSIDE = ".." + "/shared"                  # spelled in two parts so this file does not match itself
MAX_BYTES = 500_000


def tracked_files():
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        return [f for f in out.decode().split("\0") if f]
    except (OSError, subprocess.CalledProcessError):     # an unpacked sdist has no .git
        pytest.skip("not a git checkout")


def cited_sections(text):
    """Every section k in "MATH.md §k", "MATH.md §j-§k" and "MATH.md §j, §k" (a subsection §k.j
    counts as its section k here; cited_subsections checks that it exists)."""
    out = []
    for run in re.findall(r"MATH\.md((?:[ ,\-–]*§\d+(?:\.\d+)?)+)", text):
        ks = [int(k) for k in re.findall(r"§(\d+)", run)]
        out += ks if "-" not in run else list(range(ks[0], ks[-1] + 1))
    return out


def cited_subsections(text):
    """Every "k.j" cited as §k.j after a "MATH.md" (in the same run of citations)."""
    return [k for run in re.findall(r"MATH\.md((?:[ ,\-–]*§\d+(?:\.\d+)?)+)", text)
            for k in re.findall(r"§(\d+\.\d+)", run)]


def test_subsection_citations_resolve_exactly():
    example = "see MATH" + ".md §3.1, §3.9, §4"            # spelled in two parts: not a citation here
    assert cited_subsections(example) == ["3.1", "3.9"] and cited_sections(example) == [3, 3, 4]
    missing = []
    for f in tracked_files():
        if f.endswith((".py", ".md", ".toml", ".txt")):
            missing += [(f, k) for k in cited_subsections(read(f)) if k not in SUBSECTIONS]
    assert not missing, f"citations of MATH.md subsections that do not exist: {missing}"


def test_math_md_sections_are_numbered_in_order():
    numbers = [int(k) for k in re.findall(r"^## §(\d+) ", MATH, flags=re.M)]
    assert numbers == list(range(1, len(numbers) + 1))


def test_math_md_citations_resolve():
    missing = []
    for f in tracked_files():
        if f.endswith((".py", ".md", ".toml", ".txt")) or f.startswith(".ci/"):
            missing += [(f, k) for k in cited_sections(read(f)) if k not in SECTIONS]
    assert not missing, f"citations of MATH.md sections that do not exist: {missing}"


def test_no_tracked_file_points_outside_or_is_large():
    for f in tracked_files():
        path = os.path.join(ROOT, f)
        assert os.path.getsize(path) <= MAX_BYTES, f"{f} is {os.path.getsize(path)} bytes"
        with open(path, "rb") as fh:
            assert OUTSIDE.encode() not in fh.read(), f"{f} refers to {OUTSIDE}"


# The modules in the order README.md introduces them, each built on the ones before it: MATH.md's order
MODULES = {"icl_ref": ir, "icl_check": ic, "icl_looped": lp, "icl_estimators": est, "icl_fast": icl_fast}
DEFAULT_MODULE, DEFAULT_TEST_FILE = "icl_ref", "test_icl_ref.py"     # MATH.md's lists, unless they name another


def math_sections(text=MATH):
    """[(k, body)] of MATH.md's numbered sections "## §k", each up to the next "## " heading (a
    subsection "### §k.j" is part of its section; the closing "Notes on the code" of none)."""
    return [(int(k), body) for k, body in re.findall(r"^## §(\d+) .*?\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)]


def listed(label, text=MATH):
    """{section: [(where, name)]} from the "**Implemented by**" or "**Checked by**" paragraphs of
    MATH.md, read as its introduction says: a name under Implemented by is icl_ref's, and a test under
    Checked by is in test_icl_ref.py, unless a module ("`icl_check`'s") or a test file
    ("`test_icl_fast.py`") is named before it in the paragraph: then it is that one's, until another
    is named."""
    default, switch = ((DEFAULT_MODULE, r"`(icl_[a-z_]+)`'s") if label == "Implemented by"
                       else (DEFAULT_TEST_FILE, r"`(test_[a-z_0-9]+\.py)`"))
    out = {}
    for k, body in math_sections(text):
        paras = re.findall(rf"\*\*{label}\*\*(.*?)(?=\n\n|\*\*Checked by\*\*|\Z)", body, flags=re.S)
        if paras:        # a section and its subsections (### §k.j) may each have one
            out[k] = []
            for p in paras:
                where = default
                for named, name in re.findall(rf"{switch}|`([A-Za-z_][A-Za-z0-9_]*)`", p):
                    if named:
                        where = named
                    else:
                        out[k].append((where, name))
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


def own_name(module, name):
    """Whether `name` is the module's own: a function or class defined there (not imported), or a
    constant of it."""
    namespace = vars(MODULES[module])
    if name not in namespace:
        return False
    obj = namespace[name]
    return not callable(obj) or getattr(obj, "__module__", None) == module


def test_math_md_names_only_functions_and_tests_that_exist():
    # a function under Implemented by is its module's own; a test under Checked by is a test of its
    # file (a test of that name in another file does not count)
    tests = {}
    for path in glob.glob(os.path.join(ROOT, "test_*.py")):
        with open(path) as f:
            tests[os.path.basename(path)] = {node.name for node in ast.parse(f.read()).body
                                             if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}
    implemented = listed("Implemented by")
    assert sorted(implemented) == sorted(SECTIONS), "every MATH.md section lists what implements it"
    for k, names in implemented.items():
        assert names, f"MATH.md §{k} names no implementing function"
        for module, name in names:
            assert module in MODULES, f"MATH.md §{k} names the module {module}, which is none of {', '.join(MODULES)}"
            assert own_name(module, name), f"MATH.md §{k} names {module}'s {name}, which {module} does not define"
    for k, names in listed("Checked by").items():
        assert any(name.startswith("test_") for _, name in names), f"MATH.md §{k} names no test"
        for path, name in names:
            if name.startswith("test_"):
                assert path in tests, f"MATH.md §{k} names tests in {path}, which is not a test file"
                assert name in tests[path], f"MATH.md §{k} names {name} in {path}, which has no such test"


def test_every_public_function_is_derived_in_math_md_and_cites_its_section():
    section_of = {}
    for k, names in listed("Implemented by").items():
        for where in names:
            section_of.setdefault(where, set()).add(k)
    # every function a section lists cites that section (and each other section listing it)
    for (module, name), ks in section_of.items():
        obj = vars(MODULES[module]).get(name) if module in MODULES else None
        if callable(obj):
            missing = ks - set(cited_sections(inspect.getdoc(obj) or ""))
            assert not missing, f"{module}.{name} is listed under MATH.md §{min(missing)}, which its docstring does not cite"
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


def readme_module_sections():
    """{module: [k, ...]} from README.md's first screen, in its order: each module's file in
    backquotes, then its MATH.md sections in parentheses ("(MATH.md §1-§12)", "(§13)")."""
    first_screen = read("README.md").split("\n## ", 1)[0]
    out = {}
    for module, a, b in re.findall(r"`(icl_[a-z_]+)\.py`[^§`]*?\((?:MATH\.md )?§(\d+)(?:-§(\d+))?\)", first_screen):
        out.setdefault(module, list(range(int(a), int(b or a) + 1)))
    return out


def section_homes():
    """{k: module}: a section belongs to the last module, in MODULES' order, whose names it lists
    under Implemented by (it may use the modules before its own, never one after)."""
    order = list(MODULES)
    return {k: max((module for module, _ in names), key=order.index) for k, names in listed("Implemented by").items()}


def test_math_md_follows_the_modules_in_readmes_order():
    # MATH.md's sections come in the order a reader meets the modules (README.md's first screen):
    # README's sections of each module are the ones that list its functions, one run after another
    readme, home = readme_module_sections(), section_homes()
    assert list(readme) == list(MODULES), f"README.md's first screen names the modules' sections as {readme}"
    assert [k for module in readme for k in readme[module]] == sorted(SECTIONS), \
        f"README.md's module sections {readme} are not MATH.md's §1-§{max(SECTIONS)} in order"
    wrong = {k: (home.get(k), module) for module in readme for k in readme[module] if home.get(k) != module}
    assert not wrong, f"MATH.md sections whose functions are another module's than README says ({{k: (lists, README)}}): {wrong}"


def test_section_headers_of_modules_and_tests_use_math_md_numbering():
    # a "# §k ..." header in a module or in its test file names one of that module's MATH.md sections
    home = section_homes()
    for module in MODULES:
        for path in (f"{module}.py", f"test_{module}.py"):
            headers = [int(k) for k in re.findall(r"^# §(\d+)(?:\.\d+)? ", read(path), flags=re.M)]
            wrong = [k for k in headers if home.get(k) != module]
            assert not wrong, f"{path}'s section headers name MATH.md sections of another module: {wrong}"


