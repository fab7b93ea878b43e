"""The project stands alone: citations into MATH.md resolve, MATH.md names only what exists, every
public function cites the section that derives it, and no tracked file points outside the repository.
The records under docs/ are checked by their content against the current code, and the numbers README.md
and MATH.md quote from them by rendering (tools/records.py); whether a record was made by the current
code is `python3 tools/records.py check`'s business, not a test's."""
import ast
import glob
import inspect
import os
import re
import subprocess
import sys

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
sys.path.insert(0, os.path.join(ROOT, "tools"))
import records  # noqa: E402  (tools/ on the path)


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


# ---------------------------------------------------------------------------------------------
# The records under docs/, by their content
# ---------------------------------------------------------------------------------------------

def load(name):
    return records.RECORDS[name].load()


def test_generated_blocks_equal_what_the_records_give():
    # every number README.md and MATH.md quote from a record sits in a generated block; a block that
    # differs from what tools/records.py renders from the record is a number no run gave. A block whose
    # record lacks a field (a table from code that did not write it) cannot be compared: the next test
    # names it, and `python3 tools/records.py check` lists it until the record is refreshed
    texts = {doc: read(doc) for doc in records.DOCS}
    _, results = records.render_all(dict(texts))
    assert len(results) == len(records.BLOCKS)
    wrong = [(doc, name, current, rendered) for doc, name, current, rendered, problem in results
             if not problem and current != rendered]
    assert not wrong, f"generated blocks differ from the records (python3 tools/records.py render): {wrong}"
    unmarked = [(doc, name, problem) for doc, name, _, _, problem in results
                if problem and not problem.startswith("record lacks")]
    assert not unmarked, unmarked
    assert read(records.BENCHMARKS_MD) == records.benchmarks_markdown(), \
        "docs/benchmarks.md is not docs/benchmarks.json rendered: python3 tools/records.py render"


def test_every_generated_block_has_the_record_fields_it_quotes():
    # a record written before a field existed cannot be compared with its block: reported as a skip
    # (and by `python3 tools/records.py check`) until `python3 tools/records.py refresh` writes it
    _, results = records.render_all({doc: read(doc) for doc in records.DOCS})
    lacking = [f"{doc} {name}: {problem}" for doc, name, _, _, problem in results if problem]
    if lacking:
        pytest.skip("blocks not compared:\n" + "\n".join(lacking))


def test_render_notices_a_wrong_quoted_number():
    # the comparison above can fail: a README whose block says another count than the record differs
    texts = {doc: read(doc) for doc in records.DOCS}
    current = records.block_text(texts["MATH.md"], "landscape-count")
    texts["MATH.md"] = texts["MATH.md"].replace(current, "99" + current[len(current.split()[0]):])
    _, results = records.render_all(texts)
    assert [name for doc, name, now, new, problem in results if not problem and now != new] == ["landscape-count"]


def gauss_rule_family_loss(a, b, nodes, weights):
    """Theorem 4's family loss E tr p(S)^2 by the exact Gauss rule of the Wishart spectrum (MATH.md §10),
    written here from the recursion p_{l+1} = p_l (1 - a_l s_l), s_{l+1} = s_l (1 - a_l b_l s_l)^2,
    s_0 = t, so the test's loss is not the code's."""
    p, s = np.ones_like(nodes), nodes.copy()
    for a_l, b_l in zip(a, b):
        p, s = p * (1 - a_l * s), s * (1 - a_l * b_l * s) ** 2
    return float(weights @ p ** 2)


def test_the_looped_records_are_the_current_exact_optima():
    # docs/looped_exact.csv: the full run's tied and untied family optima (n = 20, d = 5). With the
    # current code the tied optimum (a search over one or two scalars) is the recorded one, and the
    # recorded untied sparse loss is the exact family loss at the recorded steps (no search): a slip
    # in the tied composition or in the family loss moves them
    exact = records.numbers("looped_exact")
    assert {r["family"] for r in exact} == {"sparse", "blocks"}
    for r in exact:
        a, b, f = lp.optimal_tied_family(int(r["L"]), 20, 5, blocks=r["family"] == "blocks")
        # the search stops where the gradient is ~1e-12: the loss agrees to ~1e-12 relative, the
        # location (where the loss is flat to second order) to ~1e-6; 1e-10 and 1e-5 leave room for
        # another stopping point of the same minimum
        assert abs(f - r["loss_tied"]) <= 1e-10 * f and abs(a - r["a_tied"]) <= 1e-5 * a, r
        if r["family"] == "sparse":
            # the CSV keeps the steps to 17 digits: the loss there to rounding
            untied = ir.family_population_loss(r["a_untied"], 20, 5)
            assert abs(untied - r["loss_untied"]) <= 1e-12 * untied, r


def test_the_shift_records_best_layer_is_theorem_1s_loss():
    # docs/shift_shifts.csv: at a length shift with Sigma = Sigma_w = I the best layer for that length
    # is Theorem 1's optimum there: the run computed it with shifted_single_layer_loss (MATH.md §15),
    # here single_layer_population_loss (MATH.md §4) does. A slip in either moves the record away from
    # the current code (the formulas themselves are checked against Monte Carlo in test_estimators.py)
    lengths = [r for r in records.numbers("shift_shifts") if r["kind"] == "length"]
    assert len(lengths) >= 5
    for r in lengths:
        n, I = int(r["n"]), np.eye(5)
        L_star = ir.single_layer_population_loss(ir.gamma_star(I, n, noise_var=0.25), I, n, noise_var=0.25)
        # both are exact rational expressions evaluated in float64: agreement to rounding
        assert abs(L_star - r["best_layer"]) <= 1e-12 * L_star, r


def test_blocks_landscape_minima_are_strict_minima_of_the_current_family_loss():
    # docs/blocks_landscape.json lists the certified minima MATH.md §10 tabulates. With the current
    # code each must still be one: the exact loss there is the recorded one, its gradient vanishes and
    # its Hessian is positive definite with the recorded spectrum. A slip in the Wishart moments, the
    # family polynomials or the Gauss rule moves all three
    rec = load("blocks_landscape")
    n, d, minima = rec["n"], rec["d"], rec["minima"]
    assert minima and [m["loss"] for m in minima] == sorted(m["loss"] for m in minima)
    # the tool's certificate (tools/blocks_landscape.py: a gradient of the exact loss below 1e-8 by
    # central differences, whose rounding is ~1e-12 here, and a positive definite Hessian)
    assert all(m["max_gradient"] < 1e-8 and m["hessian_eigenvalues"][0] > 0 for m in minima)
    L = len(minima[0]["a"])
    nodes, weights = ir.wishart_quadrature(n, d, (3 ** L - 1) // 2 + 1)   # exact to degree 2 deg p + 1
    E = np.eye(2 * L - 1)
    for m in minima:
        x = np.r_[m["a"], m["b"]]
        f = lambda v: gauss_rule_family_loss(v[:L], np.r_[v[L:], 0.0], nodes, weights)
        # the exact rational loss, rounded once: the recorded value to the last bits (1e-12 leaves room
        # for a different order of the exact sum's float conversion, nothing more)
        exact = ir.family_population_loss(m["a"], n, d, b=m["b"] + [np.nan])
        assert abs(exact - m["loss"]) <= 1e-12 * m["loss"], (m["loss"], exact)
        # the Gauss rule in float64 agrees with the exact loss to rounding (its terms are all >= 0)
        assert abs(f(x) - exact) <= 1e-10 * exact
        # central differences at h = 1e-6: truncation ~ h^2 |f'''| and rounding ~ 1e-16 f / h leave
        # ~1e-11 here; a minimum moved by dx has a gradient ~ H dx (H >= 3e-4): 1e-9 notices dx ~ 1e-5
        h = 1e-6
        grad = np.array([(f(x + h * e) - f(x - h * e)) / (2 * h) for e in E])
        assert np.max(np.abs(grad)) <= 1e-9, (m["loss"], grad)
        # second differences at h = 1e-4 (the record's own step, on the exact loss): the two spectra agree
        # to ~4e-7 relative; 1e-5 leaves room for the float64 rule's rounding ~ 1e-16 f / h^2 ~ 1e-11
        h = 1e-4
        H = np.array([[(f(x + h * (ei + ej)) - f(x + h * (ei - ej)) - f(x - h * (ei - ej)) + f(x - h * (ei + ej)))
                       / (4 * h * h) for ej in E] for ei in E])
        eig = np.linalg.eigvalsh((H + H.T) / 2)
        assert eig[0] > 0
        np.testing.assert_allclose(eig, m["hessian_eigenvalues"], rtol=1e-5)


def test_blocks_basins_reached_certified_minima_and_count_as_recorded():
    # docs/blocks_basins.json (docs/FINDINGS.md finding 9's table): the recorded optimum is the exact family loss
    # at its scalars, every basin a converged run reached is one of the certified minima of
    # docs/blocks_landscape.json, and the counts are those of the runs
    rec, landscape = load("blocks_basins"), load("blocks_landscape")
    opt = rec["optimum"]
    assert abs(ir.family_population_loss(opt["a"], rec["n"], rec["d"], b=opt["b"] + [np.nan]) - opt["loss"]) \
        <= 1e-12 * opt["loss"]                           # exact rationals, rounded once (as above)
    assert f"{opt['loss']:.6e}" == rec["global_key"] == f"{landscape['minima'][0]['loss']:.6e}"
    certified = [m["loss"] for m in landscape["minima"]]
    for r in rec["runs"]:
        if r["converged"]:
            # a basin's descent stops at |grad| <= 1e-12 of a smooth loss: its loss agrees with the
            # certified minimum's to ~1e-15 relative; the minima differ by > 1e-2 relative
            assert min(abs(r["basin_loss"] - c) / c for c in certified) <= 1e-9, r["basin_loss"]
            assert r["grad_norm"] <= 1e-6                 # experiments.py's convergence test
    assert records.basin_counts(rec["runs"]) == rec["counts"]
    assert sum(sum(c.values()) for c in rec["counts"].values()) == 2 * rec["starts"]


def float32_layer_forward(P, Q, Z):
    """The paper's layer Z <- Z + (1/n) sum_h P_h Z M Z^T Q_h Z (MATH.md §2) in Z's dtype."""
    n = Z.shape[-1] - 1
    for P_l, Q_l in zip(P, Q):
        ZM = Z[:, :, :n]
        S = ZM @ ZM.transpose(0, 2, 1)
        Z = Z + sum(P_h @ S @ Q_h @ Z for P_h, Q_h in zip(P_l, Q_l)) / Z.dtype.type(n)
    return Z


def test_float32_tolerances_bound_a_float32_evaluation_of_the_current_code():
    # docs/float32_tolerances.json records the worst float32 errors of a PyTorch model against icl_ref
    # (examples/float32_tolerances.py, needs torch). Here: its arithmetic is self-consistent, and the
    # suggested tolerances bound a float32 NumPy evaluation of the same layer against the current
    # icl_ref at one grid point of the record (d = 5, n = 20, L = 3, near the sparse family optimum, as
    # the example builds it); an icl_ref that computed another model would miss by O(1)
    import math
    rec = load("float32_tolerances")
    kinds = ("forward", "loss", "gradient")
    worst = [max(rec["worst"][L][k] for L in rec["worst"]) for k in kinds]
    assert worst == [rec["overall"][k] for k in kinds]
    rtol = [10.0 ** math.ceil(math.log10(5 * w)) for w in worst]          # 5x, rounded up to a power of 10
    assert rtol == [rec["suggested"][k] for k in kinds]
    assert [ic.CHECK_TOLERANCES["float32"][k] for k in kinds] == rtol
    example = read(os.path.join("examples", "test_torch_linear_transformer.py"))
    assert "torch.float32: dict(forward=1e{}, loss=1e{}, grad=1e{})".format(
        *(round(math.log10(r)) for r in rtol)) in example
    d, n, L = 5, 20, 3
    assert d in rec["grid"]["d"] and n in rec["grid"]["n"] and L in rec["grid"]["L"]
    rng = np.random.default_rng([0, d, n, L])
    Z, y = ir.sample_prompts(rng, 64, n, np.eye(d))
    a, _, _ = ir.optimal_family_scalars(L, n, d, starts=4)
    P, Q = ir.sparse_params(a[:, None, None] * np.eye(d))
    P = P + 0.1 / math.sqrt(d) * rng.standard_normal(P.shape)
    Q = Q + 0.1 / math.sqrt(d) * rng.standard_normal(Q.shape)
    Z32, P32, Q32, y32 = (v.astype(np.float32) for v in (Z, P, Q, y))
    Z_L = float32_layer_forward(P32, Q32, Z32)
    loss32 = float(np.mean((Z_L[:, d, n].astype(np.float64) + y32) ** 2))
    ref_Z = ir.forward(*(v.astype(np.float64) for v in (P32, Q32, Z32)))
    ref_loss = ir.in_context_loss(*(v.astype(np.float64) for v in (P32, Q32, Z32, y32)))
    # the suggested tolerances are 5x the worst error over the grid, rounded up to a power of 10 (1e-5,
    # 1e-4); float32 rounding gives ~4e-7 (Z_L) and <= 1e-6 (loss) at this point, a wrong model O(1)
    assert np.max(np.abs(Z_L - ref_Z)) / np.max(np.abs(ref_Z)) <= rec["suggested"]["forward"]
    assert abs(loss32 - ref_loss) / ref_loss <= rec["suggested"]["loss"]


def test_recorded_family_optima_are_the_current_closed_forms():
    # the full run's tables quote the exact family optima as theory values; the current code must give
    # them. The sparse family's optimum (docs/three-layer-sparse.csv, f_star) by multi-start L-BFGS-B on
    # the exact loss: its basin is reached from every start here, and the loss at a minimum found to
    # gtol 1e-12 is exact to ~1e-15 relative, so 1e-9 allows any start order
    f_star = records.field("three-layer-sparse", "f_star")
    _, _, f = ir.optimal_family_scalars(3, 20, 5, starts=4)
    assert abs(f - f_star) <= 1e-9 * f_star
    # the blocks family's optimum at n = 20 is the certified global minimum of docs/blocks_landscape.json
    try:
        f20 = records.field("three-layer-blocks", "f_star_n20")
    except records.Missing as e:
        pytest.skip(f"the blocks optimum not compared: {e}")
    f_global = load("blocks_landscape")["minima"][0]["loss"]
    assert abs(f20 - f_global) <= 1e-9 * f_global


def test_records_check_names_the_changed_function_and_ignores_comments(tmp_path, monkeypatch):
    # tools/records.py check reports a record as stale by the functions whose code changed since;
    # comments, docstrings and layout are not code
    monkeypatch.setattr(records, "ROOT", str(tmp_path))
    base = ('def f(x, n):\n    """Doc."""\n    return x / n   # why\n\n\ndef g(x):\n    return 2 * x\n\n\n'
            'LAYOUT = {"a": 1}\n')
    (tmp_path / "m.py").write_text(base)
    prov = records.provenance("tool.py", [], ["m.py"])
    assert records.code_changes(prov) == []
    (tmp_path / "m.py").write_text(base.replace('"""Doc."""', '"""Other words,\n    two lines."""  # a comment')
                                   .replace("return x / n", "return (x\n            / n)"))
    assert records.code_changes(prov) == []
    (tmp_path / "m.py").write_text(base.replace("x / n", "x / (n + 1)"))
    assert records.code_changes(prov) == ["m.py: f changed"]
    (tmp_path / "m.py").write_text(base.replace("def g", "def h").replace('"a"', '"b"'))
    assert records.code_changes(prov) == ["m.py: <module> changed; h added; g removed"]


def test_full_run_tables_add_up():
    # the full run's tables that README quotes (docs/*.csv) against themselves: every start of the
    # landscape's table ends in exactly one of its three columns, and the sparse seeds README counts
    # each have a fitted-scalars row that passed
    for b in records.rows("single-layer-landscape_basins"):
        assert int(b["optimum"]) + int(b["higher"]) + int(b["not_converged"]) == int(b["starts"]), b
    sparse = records.rows("three-layer-sparse")
    seeds = [r["seed"] for r in sparse if r.get("rel_dist")]
    fitted = [r for r in sparse if r["verdict"] in ("PASS", "FAIL") and r.get("f_star")]
    assert seeds and sorted(seeds) == sorted(r["seed"] for r in fitted)
    assert all(r["verdict"] == "PASS" for r in fitted)
