"""Every fenced python block of README.md runs as written (README's promise to a reader who copies
one), and its example failure report is the kit's.

Blocks whose first line says how long they take ("this block: about 1 min") run as written with
`-m slow`; the default suite runs them with fewer prompts (20000 -> 200), L-BFGS stopped at 50
iterations and the family optimum from 2 starts: every line still runs, on the same code paths. A
block that imports torch is skipped with the reason where torch is missing (.ci/run's frameworks
leg installs it and fails on a skip).
"""
import functools
import os
import re
import time
from unittest import mock

import numpy as np
import pytest

import icl_check as ic
import icl_ref as ir

ROOT = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    README = f.read()
# (the heading above it, its text) for every ```python block, in README's order
BLOCKS = [(re.findall(r"^#+ (.+)$", README[:m.start()], flags=re.M)[-1], m.group(1))
          for m in re.finditer(r"```python\n(.*?)```", README, flags=re.S)]
SLOW = r"# this block: about (\d+) (s|min)\b"
BLOCK_IDS = [re.split(r"[:(]", heading)[0].strip() for heading, _ in BLOCKS]
TORCH = re.compile(r"^import .*\btorch\b", flags=re.M)


def test_every_python_block_is_run_here():
    # the blocks are found by their fence: every fence opens a python, bash or text block (a "py" or
    # "Python" fence would hide a block from the tests below), and each python block is one of BLOCKS
    fences = re.findall(r"^```(\S*)", README, flags=re.M)[::2]          # the opening fences
    assert set(fences) <= {"python", "bash", "text"} and fences.count("python") == len(BLOCKS) >= 5


def run(block, shorten):
    """exec the block in a namespace of its own (nothing given to it), shortened if asked."""
    namespace = {}
    if TORCH.search(block):
        pytest.importorskip("torch", reason="README's block needs torch: .ci/run's frameworks leg installs it")
    if not shorten:
        exec(compile(block, "README.md", "exec"), namespace)
        return namespace
    with mock.patch.object(ir, "train_lbfgs", functools.partial(ir.train_lbfgs, maxiter=50)), \
            mock.patch.object(ir, "optimal_family_scalars", functools.partial(ir.optimal_family_scalars, starts=2)):
        exec(compile(block.replace("20000", "200"), "README.md", "exec"), namespace)
    return namespace


@pytest.mark.parametrize("heading, block", BLOCKS, ids=BLOCK_IDS)
def test_readme_block_runs(heading, block):
    namespace = run(block, shorten=bool(re.search(SLOW, block)))
    tests = {k: v for k, v in namespace.items() if k.startswith("test_") and callable(v)}
    for name, test in tests.items():              # a block that defines pytest tests: run each, as pytest would
        cases = test.pytestmark[0].args[1]
        assert cases == [c["name"] for c in ic.reference_cases() if "paper" in c["layouts"]]
        for case in cases:
            test(case)
    if heading.startswith("API") and "res" in namespace:          # the API block (the adapters' follows it)
        assert namespace["P"].shape == (3, 1, 6, 6) and np.isfinite(namespace["res"]["loss"])


@pytest.mark.slow
@pytest.mark.parametrize("heading, block", [b for b in BLOCKS if re.search(SLOW, b[1])],
                         ids=[i for i, b in zip(BLOCK_IDS, BLOCKS) if re.search(SLOW, b[1])])
def test_slow_readme_block_runs_as_written_in_about_the_time_it_says(heading, block):
    number, unit = re.search(SLOW, block).groups()
    said = int(number) * (60 if unit == "min" else 1)
    start = time.process_time()
    run(block, shorten=False)
    took = time.process_time() - start                # CPU time: other processes stretch the wall-clock time
    assert said / 3 <= took <= 3 * said, f"README says about {number} {unit}; it took {took:.0f} s of CPU time"


def test_the_example_failure_is_the_kits_report():
    import test_icl_check_slips as slips
    example = re.search(r"A model whose second layer has\s+no residual reads:\n\n```text\n(.*?)```", README,
                        flags=re.S).group(1)
    with pytest.raises(ic.Mismatch) as failure:
        ic.check_implementation(slips.numpy_model("paper", "residual-2"), outputs=("Z_L", "y_hat", "loss"))
    assert example == str(failure.value) + "\n"
