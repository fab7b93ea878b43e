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


MODULES = {"icl_ref": ir, "icl_check": ic, "icl_looped": lp, "icl_estimators": est, "icl_fast": icl_fast}


def listed(label):
    """{section: names} from the "**Implemented by**" or "**Checked by**" paragraphs of MATH.md."""
    out = {}
    for k, body in re.findall(r"^## §(\d+) .*?\n(.*?)(?=^## §|\Z)", MATH, flags=re.M | re.S):
        paras = re.findall(rf"\*\*{label}\*\*(.*?)(?=\n\n|\*\*Checked by\*\*|\Z)", body, flags=re.S)
        if paras:        # a section and its subsections (### §k.j) may each have one
            out[int(k)] = [name for p in paras for name in re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", p)]
    return out


def test_math_md_names_only_functions_and_tests_that_exist():
    sources = []
    for path in glob.glob(os.path.join(ROOT, "test_*.py")):
        with open(path) as f:
            sources.append(f.read())
    tests = {node.name for source in sources for node in ast.parse(source).body
             if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}
    for k, names in listed("Implemented by").items():
        assert names, f"MATH.md §{k} names no implementing function"
        for name in names:
            assert name in MODULES or any(name in vars(m) for m in MODULES.values()), \
                f"MATH.md §{k} names {name}, which is in none of {', '.join(MODULES)}"
    for k, names in listed("Checked by").items():
        assert names, f"MATH.md §{k} names no test"
        for name in names:
            if name.startswith("test_"):
                assert name in tests, f"MATH.md §{k} names {name}, which is not a test"


def test_every_public_function_is_derived_in_math_md_and_cites_its_section():
    section_of = {}
    for k, names in listed("Implemented by").items():
        for name in names:
            section_of.setdefault(name, set()).add(k)
    for module in (ir, ic, lp, est):
        public = [name for name, obj in vars(module).items() if inspect.isfunction(obj)
                  and not name.startswith("_") and obj.__module__ == module.__name__]
        assert public
        for name in public:
            assert name in section_of, f"{module.__name__}.{name} is not listed under any MATH.md section"
            doc = inspect.getdoc(getattr(module, name)) or ""
            assert section_of[name] & set(cited_sections(doc)), \
                f"{module.__name__}.{name}'s docstring does not cite MATH.md §{min(section_of[name])}"
    # the engine's own formulation (its other public functions are icl_ref's with engine=, and the
    # machinery of engine() and shutdown(), which README's "Speed" documents)
    own = [name for name, obj in vars(icl_fast).items() if callable(obj) and not isinstance(obj, type)
           and not name.startswith("_")
           and getattr(obj, "__module__", None) == icl_fast.__name__ and not hasattr(ir, name) and name not in ("engine", "shutdown")]
    assert own
    for name in own:
        assert 3 in section_of.get(name, set()), f"icl_fast.{name} is not listed under MATH.md §3.2"
        assert "§3.2" in (inspect.getdoc(getattr(icl_fast, name)) or ""), \
            f"icl_fast.{name}'s docstring does not cite MATH.md §3.2"


def python_blocks(text, after):
    """The ```python blocks of a Markdown text that follow the heading `after`, up to the next ## heading."""
    section = text.split(after, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_readme_api_examples_run_as_written():
    # every line of README's API and speed examples runs as written, each block defining its own
    # inputs, on a smaller batch (20000 -> 200 prompts)
    import numpy as np
    readme = read("README.md")
    blocks = python_blocks(readme, "## API, one example each") + python_blocks(readme, "## Speed: icl_fast")
    assert len(blocks) == 2
    # the slowest calls run shorter (their results are not what this test checks): L-BFGS to 50
    # iterations, the family optimum from 2 starts
    import functools
    from unittest import mock
    with mock.patch.object(ir, "train_lbfgs", functools.partial(ir.train_lbfgs, maxiter=50)), \
            mock.patch.object(ir, "optimal_family_scalars", functools.partial(ir.optimal_family_scalars, starts=2)):
        namespaces = [{} for _ in blocks]                # each block on its own
        for block, namespace in zip(blocks, namespaces):
            exec(compile(block.replace("20000", "200"), "README.md", "exec"), namespace)
    assert namespaces[0]["P"].shape == (3, 1, 6, 6) and np.isfinite(namespaces[0]["res"]["loss"])
