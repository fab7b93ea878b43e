"""The records under docs/ and the tools that keep the documents' numbers true (tools/records.py,
tools/docs_figures.py): each record checked by its content against the current code, the documents
rendered from the records, and each tool's promises and exit statuses (their docstrings), on good input
and on hostile input (tools never execute what a data file says)."""
import ast
import csv
import glob
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest

import experiments as ex
import experiments_beyond  # noqa: F401  (the experiments beyond the paper in ex.EXPERIMENTS)
import icl_check as ic
import icl_files
import icl_looped as lp
import icl_ref as ir

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import docs_figures  # noqa: E402  (tools/ on the path)
import records  # noqa: E402


# ---------------------------------------------------------------------------------------------
# The records, by their content under the current code
# ---------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.mutants
def test_the_looped_records_are_the_current_exact_optima():
    # docs/looped_exact.csv: the full run's tied and untied family optima (n = 20, d = 5). The tied
    # optimum (a search over one or two scalars) is the recorded one, and the recorded untied sparse loss
    # is the exact family loss at the recorded steps (no search): a slip in either moves them
    exact = records.rows("looped_exact/*")
    assert set(exact.family) == {"sparse", "blocks"}
    for r in exact:
        a, b, f = lp.optimal_tied_family(int(r.L), 20, 5, blocks=r.family == "blocks")
        # the search stops where the gradient is ~1e-12: the loss agrees to ~1e-12 relative, the location
        # (flat to second order) to ~1e-6; 1e-10 and 1e-5 leave room for another stopping point
        assert abs(f - r.loss_tied) <= 1e-10 * f and abs(a - r.a_tied) <= 1e-5 * a, r
        if r.family == "sparse":              # 17 digits of the steps: the loss to rounding
            assert abs(ir.family_population_loss(r.a_untied, 20, 5) - r.loss_untied) <= 1e-12 * r.loss_untied, r


def test_the_shift_records_best_layer_is_theorem_1s_loss():
    # docs/shift_shifts.csv: at a length shift with Sigma = Sigma_w = I the best layer for that length is
    # Theorem 1's optimum there, computed by the run with shifted_single_layer_loss (MATH.md §15), here by
    # single_layer_population_loss (MATH.md §4): both exact rational expressions, agreeing to rounding
    lengths = records.rows("shift_shifts/length-*")
    assert len(lengths) >= 5
    for r in lengths:
        n, I = int(r.n), np.eye(5)
        L_star = ir.single_layer_population_loss(ir.gamma_star(I, n, noise_var=0.25), I, n, noise_var=0.25)
        assert abs(L_star - r.best_layer) <= 1e-12 * L_star, r


def gauss_rule_family_loss(a, b, nodes, weights):
    """Theorem 4's family loss E tr p(S)^2 by the exact Gauss rule of the Wishart spectrum (MATH.md §10),
    written here from p_{l+1} = p_l (1 - a_l s_l), s_{l+1} = s_l (1 - a_l b_l s_l)^2, s_0 = t, so the
    test's loss is not the code's."""
    p, s = np.ones_like(nodes), nodes.copy()
    for a_l, b_l in zip(a, b):
        p, s = p * (1 - a_l * s), s * (1 - a_l * b_l * s) ** 2
    return float(weights @ p ** 2)


def test_blocks_landscape_minima_are_strict_minima_of_the_current_family_loss():
    # docs/blocks_landscape.json (MATH.md §10's table): each minimum is still one under the current code,
    # with the recorded loss, a vanishing gradient and the recorded Hessian spectrum
    rec = records.load("blocks_landscape")
    n, d, minima = rec.n, rec.d, rec.minima
    assert minima and [m.loss for m in minima] == sorted(m.loss for m in minima)
    # the tool's certificate: central-difference gradient below 1e-8 (rounding ~1e-12), Hessian > 0
    assert all(m.max_gradient < 1e-8 and m.hessian_eigenvalues[0] > 0 for m in minima)
    L = len(minima[0].a)
    nodes, weights = ir.wishart_quadrature(n, d, (3 ** L - 1) // 2 + 1)   # exact to degree 2 deg p + 1
    E = np.eye(2 * L - 1)
    for m in minima:
        x = np.r_[m.a, m.b]
        f = lambda v: gauss_rule_family_loss(v[:L], np.r_[v[L:], 0.0], nodes, weights)
        exact = ir.family_population_loss(m.a, n, d, b=m.b + [np.nan])    # exact rationals, rounded once
        assert abs(exact - m.loss) <= 1e-12 * m.loss, (m.loss, exact)
        assert abs(f(x) - exact) <= 1e-10 * exact          # the float64 rule to rounding (terms >= 0)
        # h = 1e-6: truncation and rounding ~1e-11; a minimum moved by dx ~ 1e-5 has a gradient ~ 3e-9
        grad = np.array([(f(x + 1e-6 * e) - f(x - 1e-6 * e)) / 2e-6 for e in E])
        assert np.max(np.abs(grad)) <= 1e-9, (m.loss, grad)
        h = 1e-4                 # the record's step: the spectra agree to ~4e-7, rounding ~1e-11
        H = np.array([[(f(x + h * (ei + ej)) - f(x + h * (ei - ej)) - f(x - h * (ei - ej)) + f(x - h * (ei + ej)))
                       / (4 * h * h) for ej in E] for ei in E])
        eig = np.linalg.eigvalsh((H + H.T) / 2)
        assert eig[0] > 0
        np.testing.assert_allclose(eig, m.hessian_eigenvalues, rtol=1e-5)


def test_blocks_basins_reached_certified_minima_and_count_as_recorded():
    # docs/blocks_basins.json (finding 9's table): the optimum is the exact family loss at its scalars,
    # every basin a converged run reached is a certified minimum, and the counts are the runs'
    rec, landscape = records.load("blocks_basins"), records.load("blocks_landscape")
    opt = rec.optimum
    assert abs(ir.family_population_loss(opt.a, rec.n, rec.d, b=opt.b + [np.nan]) - opt.loss) <= 1e-12 * opt.loss
    assert f"{opt.loss:.6e}" == rec.global_key == f"{landscape.minima[0].loss:.6e}"
    counts = {}
    for r in rec.runs:
        key = f"{r.basin_loss:.6e}" if r.converged else "not converged"
        counts.setdefault(r.optimiser, {}).setdefault(key, 0)
        counts[r.optimiser][key] += 1
        if r.converged:    # a descent to |grad| <= 1e-12: ~1e-15 relative; the minima differ by > 1e-2
            assert min(abs(r.basin_loss - m.loss) / m.loss for m in landscape.minima) <= 1e-9, r.basin_loss
            assert r.grad_norm <= ex.GRAD_TOL
    assert counts == rec.counts and sum(sum(c.values()) for c in counts.values()) == 2 * rec.starts
    # each basin's check (finding 9's figure): the basin's first converged run, trained again to its recorded
    # scalars; a batch minimum that is a stationary point of the family's batch loss and lies in the basin
    # (the exact family descent from it ends at the basin's population minimum); its distance in SE as said
    keys = sorted({f"{r.basin_loss:.6e}" for r in rec.runs if r.converged}, key=float)
    assert [c.key for c in rec.basins] == keys
    for c in rec.basins:
        first = next(r for r in rec.runs if r.converged and f"{r.basin_loss:.6e}" == c.key)
        assert (c.optimiser, c.start) == (first.optimiser, first.start)
        # a rerun of one start: 5e-6 apart at most (L-BFGS stops at |grad| ~2e-8, where the loss is flat and
        # the summation order of the engine's threads moves the end); runs in other basins are > 1e-2 away
        np.testing.assert_allclose(c.fitted, first.a + first.b, rtol=1e-4)
        assert c.batch_grad_norm <= ex.GRAD_TOL
        L = rec.L
        _, _, f_loc = ir.family_local_minimum(c.batch[:L], rec.n, rec.d, b=c.batch[L:] + [0.0])
        assert abs(f_loc - first.basin_loss) <= 1e-9 * first.basin_loss          # as the runs' descents above
        np.testing.assert_allclose(c.diff_in_se, (np.array(c.fitted) - c.batch) / np.array(c.se), rtol=1e-12)


@pytest.mark.slow
@pytest.mark.mutants
def test_looped_landscape_is_the_current_curvature_and_its_points_are_still_certified():
    # docs/looped_landscape.json (finding 17): the closed-form eigenvalues are today's, the polynomial's
    # agree with them and the recorded Monte Carlo within 4 SE; each recorded point, at its recorded W, has
    # the recorded loss, a vanishing exact gradient and the recorded index modulo rotations
    rec = records.load("looped_landscape")
    n, d = rec.n, rec.d
    for h in rec.hessian:
        today = lp.tied_family_hessian_eigenvalues(h.L, n, d)
        for s, value in zip(("identity", "symmetric", "antisymmetric"), today):
            # one exact rational rounded once, then twice (the record's float and today's): rounding only
            assert abs(h[s] - value) <= 1e-12 * abs(value), (h.L, s)
            # the polynomial's Hessian in float64: terms ~1e2 times the loss at L = 4, so ~1e-12 absolute
            assert abs(h[f"poly_{s}"] - value) <= 1e-9, (h.L, s)
            assert abs(h[f"mc_{s}"] - value) <= 4 * h[f"mc_{s}_se"], (h.L, s)      # sampling: 4 SE
        # the two parts (exact rationals rounded once each): their sum to rounding, the twist <= 0 (MATH.md §14)
        assert abs(h.stretch + h.twist - h.antisymmetric) <= 1e-12 * h.stretch and h.stretch > 0 >= h.twist, h.L
    signs = {h.L: h.mc_antisymmetric / h.mc_antisymmetric_se for h in rec.hessian}
    assert signs[2] > 4 and signs[3] > 4 and signs[4] < -4             # the sign resolved by the samples
    char = {(r.L, r.n): r for r in rec.character}
    assert [char[L, 20].minimum for L in (1, 2, 3, 4)] == [True, True, True, False]
    points = {p.name: p for p in rec.points}
    for p in rec.points:
        W = np.array(p.W)
        f, g = lp.tied_loss_and_grad(W, p.L, n, d)
        assert abs(f - p.loss) <= 1e-12 * p.loss and np.linalg.norm(g) <= 1e-10, p.name   # rounding ~1e-13
        if "mc_loss" in p:                 # off the family point: Monte Carlo within 4 SE of the exact loss
            assert abs(p.mc_loss - p.loss) <= 4 * p.mc_loss_se, p.name
            assert abs(p.paired_difference - (p.loss - p.family_loss)) <= 4 * p.paired_difference_se, p.name
    lower = points["L4-tilted"]
    assert lower.index == 0 and lower.orbit_dim == 6 and lower.relative_to_family < -0.09
    assert lower.paired_difference < -4 * lower.paired_difference_se and lower.mc_reduced_min > 4 * lower.mc_reduced_min_se
    lam, _, r = lp.reduced_hessian(np.array(lower.W), 4, n, d)
    assert r == 6 and lam[0] > 0.1 and np.allclose(lam, lower.reduced_eigenvalues, rtol=0, atol=1e-9)
    assert points["L4-one-block"].index == 3 and points["L3-saddle"].index == 1
    assert points["L2-tilted"].at_family and points["L3-tilted"].at_family
    # the scan over n at L = 4: at each recorded W the recorded loss, a vanishing gradient, a positive reduced
    # Hessian (a strict local minimum modulo rotations) and the symmetric part's recorded eigenvalues; the
    # family point a saddle there (today's closed form) and above the point
    for r in rec.scan:
        W = np.array(r.W)
        f, g = lp.tied_loss_and_grad(W, r.L, r.n, d)
        # terms ~1e2 at L = 4 round to ~1e-13 absolute; f falls to ~5e-7 at n = 640, so absolute, not relative
        assert abs(f - r.loss) <= 1e-12 and np.linalg.norm(g) <= 1e-10, r.n
        # the complex-step Hessian of a polynomial is exact to rounding (~1e-12 here), as for the point above
        lam, _, dim = lp.reduced_hessian(W, r.L, r.n, d)
        assert dim == r.orbit_dim == 6 and lam[0] > 0 and abs(lam[0] - r.reduced_min) <= 1e-9, r.n
        sym = np.linalg.eigvalsh((W + W.T) / 2)      # the same float64 W: eigvalsh's rounding, ~1e-15
        assert abs(sym[0] - r.symmetric_min) <= 1e-12 and abs(sym[-1] - r.symmetric_max) <= 1e-12, r.n
        today = lp.tied_family_hessian_eigenvalues(r.L, r.n, d)[2]     # an exact rational rounded once, twice
        assert abs(today - r.family_antisymmetric) <= 1e-12 * abs(today) and today < 0, r.n
        # the family loss at a step found to ~1e-9 relative: flat there, so only its rounding (~1e-13) shows
        assert r.loss < r.family_loss and abs(lp.optimal_tied_family(r.L, r.n, d)[2] - r.family_loss) <= 1e-12, r.n


def float32_layer_forward(P, Q, Z):
    """The paper's layer Z <- Z + (1/n) sum_h P_h Z M Z^T Q_h Z (MATH.md §2) in Z's dtype."""
    n = Z.shape[-1] - 1
    for P_l, Q_l in zip(P, Q):
        S = Z[:, :, :n] @ Z[:, :, :n].transpose(0, 2, 1)
        Z = Z + sum(P_h @ S @ Q_h @ Z for P_h, Q_h in zip(P_l, Q_l)) / Z.dtype.type(n)
    return Z


def test_float32_tolerances_bound_a_float32_evaluation_of_the_current_code():
    # docs/float32_tolerances.json (examples/float32_tolerances.py, torch): self-consistent, and its
    # suggested tolerances bound a float32 NumPy evaluation of the same layer against the current icl_ref
    # at one grid point near the sparse family optimum; an icl_ref computing another model misses by O(1)
    rec, kinds = records.load("float32_tolerances"), ("forward", "loss", "gradient")
    worst = [max(rec.worst[L][k] for L in rec.worst) for k in kinds]
    assert worst == [rec.overall[k] for k in kinds]
    rtol = [10.0 ** math.ceil(math.log10(5 * w)) for w in worst]          # 5x, rounded up to a power of 10
    assert rtol == [rec.suggested[k] for k in kinds] == [ic.CHECK_TOLERANCES["float32"][k] for k in kinds]
    with open(os.path.join(ROOT, "examples", "test_torch_linear_transformer.py"), encoding="utf-8") as f:
        assert "torch.float32: dict(forward=1e{}, loss=1e{}, grad=1e{})".format(
            *(round(math.log10(r)) for r in rtol)) in f.read()
    d, n, L = 5, 20, 3
    assert d in rec.grid.d and n in rec.grid.n and L in rec.grid.L
    rng = np.random.default_rng([0, d, n, L])
    Z, y = ir.sample_prompts(rng, 64, n, np.eye(d))
    a, _, _ = ir.optimal_family_scalars(L, n, d, starts=4)
    P, Q = (M + 0.1 / math.sqrt(d) * rng.standard_normal(M.shape) for M in ir.sparse_params(a[:, None, None] * np.eye(d)))
    Z32, P32, Q32, y32 = (v.astype(np.float32) for v in (Z, P, Q, y))
    Z_L = float32_layer_forward(P32, Q32, Z32)
    ref_Z = ir.forward(*(v.astype(np.float64) for v in (P32, Q32, Z32)))
    ref_loss = ir.in_context_loss(*(v.astype(np.float64) for v in (P32, Q32, Z32, y32)))
    # float32 rounding gives ~4e-7 (Z_L) and <= 1e-6 (loss) here, a wrong model O(1)
    assert np.max(np.abs(Z_L - ref_Z)) / np.max(np.abs(ref_Z)) <= rec.suggested.forward
    assert abs(float(np.mean((Z_L[:, d, n].astype(np.float64) + y32) ** 2)) - ref_loss) / ref_loss <= rec.suggested.loss


def test_recorded_family_optima_are_the_current_closed_forms():
    # the sparse family's optimum every seed's row of docs/three-layer-sparse.csv quotes, by multi-start
    # L-BFGS-B on the exact loss (exact to ~1e-15 at gtol 1e-12; 1e-9 allows any start order); the blocks
    # family's at n = 20 is the lowest certified minimum of docs/blocks_landscape.json's search
    f_star = records.one(records.rows("three-layer-sparse/seed*-fit"), "f_star")
    assert abs(ir.optimal_family_scalars(3, 20, 5, starts=4)[2] - f_star) <= 1e-9 * f_star
    f20, f_lowest = records.row("three-layer-blocks/f-star").f_star_n20, records.load("blocks_landscape").minima[0].loss
    assert abs(f20 - f_lowest) <= 1e-9 * f_lowest


def test_full_run_tables_add_up_and_every_row_has_its_id():
    # every start of the landscape's table ends in one of its three columns; the seeds whose Gauss-Newton
    # distance finding 9 counts each have a fitted row that passed; every row of every table quoted has
    # a unique id of experiments.ID_PATTERN naming its file
    for b in records.rows("single-layer-landscape_basins/*"):
        assert b.optimum + b.higher + b.not_converged == b.starts, b
    fitted = records.rows("three-layer-sparse/seed*-fit")
    assert len(records.rows("three-layer-sparse/seed*-gauss-newton")) == len(fitted) and set(fitted.verdict) == {"PASS"}
    for path in glob.glob(os.path.join(ROOT, "docs", "*.csv")):
        with open(path, encoding="utf-8") as f:
            ids = [r["id"] for r in csv.DictReader(f)]
        stem = os.path.basename(path)[:-4]
        assert len(set(ids)) == len(ids) and all(re.fullmatch(ex.ID_PATTERN, i) and i.startswith(stem + "/") for i in ids)


def test_the_documents_quote_what_the_records_give():
    # every number the documents quote from a record sits in a generated block, as rendered from it
    assert records.main(["render", "--check"]) == 0


# ---------------------------------------------------------------------------------------------
# tools/records.py: rendering, by the blocks' ids
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def docs(tmp_path, monkeypatch):
    """A copy of the documents and the records, which tools/records.py then reads and writes."""
    for path in [*records.DOCS, *glob.glob("docs/*.csv", root_dir=ROOT), *glob.glob("docs/*.json", root_dir=ROOT)]:
        os.makedirs(tmp_path / os.path.dirname(path), exist_ok=True)
        shutil.copy(os.path.join(ROOT, path), tmp_path / path)
    monkeypatch.setattr(records, "ROOT", str(tmp_path))
    return tmp_path


def run(capsys, *args):
    """tools/records.py's main in this process: (exit status, everything it printed)."""
    status = records.main(list(args))
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    return status, out.out + out.err


def edit_csv(path, change):
    """Rewrite a CSV, each row (a dict) through `change` (None drops the row)."""
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    rows = [r for r in map(change, rows) if r is not None]
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def test_rewording_every_claim_changes_no_block(docs, capsys):
    for path in docs.glob("docs/*.csv"):
        edit_csv(path, lambda r: dict(r, claim=f"[A] reworded: {r['id'][::-1]}") if "claim" in r else r)
    assert run(capsys, "render", "--check") == (0, "")


def test_a_missing_row_or_field_is_named_and_its_block_kept(docs, capsys):
    edit_csv(docs / "docs/dynamics.csv", lambda r: None if r["id"] == "dynamics/inside-end" else r)
    edit_csv(docs / "docs/softmax-two-head.csv", lambda r: {k: v for k, v in r.items() if k != "gap_in_se"})
    blocks = lambda: re.findall(r"<!-- begin (?:looped-flow|softmax-gap) -->.*?<!-- end", (docs / records.DOCS[2]).read_text(), re.S)
    before = blocks()
    status, out = run(capsys, "render")
    assert status == 2 and "dynamics/inside-end" in out and "gap_in_se" in out
    assert "looped-flow" in out and "softmax-gap" in out and blocks() == before


def test_rows_that_disagree_on_a_field_a_block_quotes_once_are_named(docs, capsys):
    edit_csv(docs / "docs/dynamics_descent.csv", lambda r: dict(r, eta="0.02") if r["id"].endswith("t4") else r)
    status, out = run(capsys, "render", "--check")
    assert status == 2 and "disagree on eta" in out and "looped-flow" in out


def test_a_block_twice_without_a_template_or_an_end_is_reported(docs, capsys):
    findings = docs / "docs/FINDINGS.md"
    text = findings.read_text()
    block = re.search(r"<!-- begin softmax-gap.*?<!-- end softmax-gap -->", text, re.S).group(0)
    findings.write_text(text + f"\n{block}\n<!-- begin bare -->1<!-- end bare -->\n<!-- begin open\n{{1}}\n-->1\n")
    status, out = run(capsys, "render", "--check")
    assert status == 2 and "2 blocks named softmax-gap" in out and "the block bare has no template" in out
    assert "the block open has no end marker" in out


def spoil(text, name):
    """`text` with a 9 before the text of its generated block `name`."""
    m = next(m for m in records.BLOCK.finditer(text) if m.group(1) == name)
    return text[:m.start(4)] + "9" + text[m.start(4):]


def test_a_number_unlike_the_records_is_found_then_rewritten(docs, capsys):
    math_md = docs / "MATH.md"
    text = math_md.read_text()
    math_md.write_text(spoil(text, "landscape-count"))
    status, out = run(capsys, "render", "--check")
    assert status == 1 and "MATH.md block landscape-count: differs" in out and math_md.read_text() != text
    assert run(capsys, "render")[0] == 0 and math_md.read_text() == text
    assert run(capsys, "render", "--check") == (0, "")


def test_a_template_reads_only_what_it_is_given():
    assert records.render_block("{len(x)} of {max(x):.1f}", {"x": "[1, 2]"}) == "2 of 2.0"
    for template in ("{().__class__}", "{Rows().__class__}", "{__import__('os')}", "{(lambda: 1)()}", "{open('x')}"):
        with pytest.raises(records.Problem):
            records.render_block(template, {})
    # no attribute leads out of the values a template is given: a generator's frame reaches the module's
    # globals (os) without one underscore (a shell command once ran this way), a method's format
    # string reads attributes, and Rows of anything but rows reads nothing
    frame = "[g.gi_frame.f_back.f_globals for g in [(y for y in [1])]]"
    # one's field too names no attribute with an underscore (a class's bases, a function's globals)
    for template in ("{" + frame + "}", "{[g for g in [(y for y in [1])]][0].gi_code}", "{'{0.real}'.format(1)}",
                     "{Rows([(y for y in [1])]).gi_frame}", "{one(Rows, '__bases__')}", "{one(one, '__globals__')}"):
        with pytest.raises(records.Problem):
            records.render_block(template, {})
    # what the documents' templates do read: fields, and a few methods of plain values
    assert records.render_block("{'a b'.split()} {[1, 1].count(1)} {dict.fromkeys('ab')}", {}) == "['a', 'b'] 2 {'a': None, 'b': None}"


def test_a_template_that_would_not_end_is_refused_before_it_runs():
    # 9**9**9 (370 million digits) would hold render and check for hours, and a shift as large fills
    # memory: no power or shift is evaluated (in a process of its own, so that a hang fails the test)
    code = ("import sys; sys.path.insert(0, 'tools'); import records\n"
            "for t in ('{9**9**9}', '{1 << 99999999999}'):\n"
            "    try:\n        print(records.render_block(t, {}))\n"
            "    except records.Problem as e:\n        print(e)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.stdout.split("\n")[:2] == ["a template may not use Pow ", "a template may not use LShift "], proc.stderr


def test_a_template_too_large_to_hold_is_a_message_and_status_2(docs, capsys):
    findings = docs / "docs/FINDINGS.md"
    findings.write_text(findings.read_text() + "\n<!-- begin huge\n{'x' * 99999999999999999}\n-->\n<!-- end huge -->\n")
    status, out = run(capsys, "render", "--check")
    assert status == 2 and "FINDINGS.md block huge: cannot render from the records: MemoryError" in out


@pytest.mark.slow
@pytest.mark.mutants
@pytest.mark.parametrize("plant", ["a FIFO", "a link to /dev/zero"])
@pytest.mark.parametrize("command", [["render", "--check"], ["check"]])
def test_a_record_that_is_no_regular_file_is_a_message_and_status_2(docs, plant, command):
    # a FIFO would block the read forever and /dev/zero never end: the file is seen before it is read
    # (in a process of its own, memory capped, so that a hang or an endless read fails the test)
    record = docs / "docs/benchmarks.json"
    record.unlink()
    os.mkfifo(record) if "FIFO" in plant else record.symlink_to("/dev/zero")
    code = (f"import resource, sys; resource.setrlimit(resource.RLIMIT_AS, ({2 << 30}, {2 << 30}))\n"
            "sys.path.insert(0, 'tools'); import records; records.ROOT = sys.argv[1]; sys.exit(records.main(sys.argv[2:]))")
    proc = subprocess.run([sys.executable, "-c", code, str(docs), *command], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "docs/benchmarks.json is not a regular file" in proc.stdout + proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.mutants
@pytest.mark.parametrize("path, content, said", [
    ("docs/benchmarks.json", "{not json", "benchmarks.json cannot be read"),
    ("docs/benchmarks.json", "[" * 200_000 + "]" * 200_000, "benchmarks.json cannot be read"),
    ("docs/figures.json", '{"provenance": null, "timing": null}', "cannot render from the records"),
    ("docs/blocks_landscape.json", "[1, 2]", "blocks_landscape.json is not a JSON object"),
    ("docs/shift.csv", "\x00\xff binary", "docs/shift.csv cannot be read"),
    ("docs/dynamics.csv", "claim,measured\nx,1\n", "docs/dynamics.csv is empty, has no id column or repeats an id"),
])
def test_a_corrupt_record_or_table_is_a_message_and_status_2(docs, capsys, path, content, said):
    (docs / path).write_bytes(content.encode("latin-1"))
    for command in (["render", "--check"], ["check"]):
        status, out = run(capsys, *command)
        assert status == 2 and said in out, out


def test_render_never_writes_through_a_symbolic_link(docs, capsys, tmp_path_factory):
    outside = tmp_path_factory.mktemp("outside") / "elsewhere.md"
    document = docs / "docs" / "FINDINGS.md"
    outside.write_text(spoil(document.read_text(), "beyond-checks"))
    document.unlink()
    document.symlink_to(outside)
    before = outside.read_text()
    status, out = run(capsys, "render")
    assert status == 2 and "symbolic link" in out and document.is_symlink() and outside.read_text() == before
    assert "rewritten" not in out                   # nothing was


def test_replace_file_writes_whole_and_refuses_links(tmp_path):
    (tmp_path / "real").mkdir()
    icl_files.replace_file(str(tmp_path / "real" / "a.md"), b"one")
    icl_files.replace_file(str(tmp_path / "real" / "a.md"), b"two")
    (tmp_path / "link").symlink_to(tmp_path / "real", target_is_directory=True)
    (tmp_path / "real" / "b.md").symlink_to(tmp_path / "real" / "a.md")
    for path in (tmp_path / "link" / "a.md", tmp_path / "real" / "b.md"):
        with pytest.raises(icl_files.Refused, match="symbolic link"):
            icl_files.replace_file(str(path), b"three")
    assert sorted(os.listdir(tmp_path / "real")) == ["a.md", "b.md"] and (tmp_path / "real" / "a.md").read_bytes() == b"two"


# ---------------------------------------------------------------------------------------------
# tools/records.py: staleness by git, and refresh's fixed table
# ---------------------------------------------------------------------------------------------

def git_in(path, monkeypatch):
    """git run in `path` as a repository of its own: under a caller's GIT_DIR (a hook's, `git rebase -x`'s)
    `git init` and the commits would act on the caller's repository instead."""
    for var in [v for v in os.environ if v.startswith("GIT_")]:
        monkeypatch.delenv(var)
    return lambda *a: subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *a], cwd=path, check=True,
                                     capture_output=True)


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A git repository with m.py, n.py and docs/out.png committed, as tools/records.py's ROOT."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "m.py").write_text("x = 1\n")
    (tmp_path / "n.py").write_text("y = 1\n")
    (tmp_path / "docs" / "out.png").write_bytes(b"png")
    git = git_in(tmp_path, monkeypatch)
    git("init", "-q")
    git("add", "-A")
    git("commit", "-q", "-m", "one")
    monkeypatch.setattr(records, "ROOT", str(tmp_path))
    monkeypatch.setitem(records.TOOLS, "made", ("docs/made.json", ["tools/make.py", "--seed", "0"]))
    return tmp_path, git


def make(tool=("tools/make.py", "--seed", "0"), **change):
    prov = records.provenance(list(tool), ["m.py"], 1.0, ["docs/out.png"])
    records.write("docs/made.json", dict(provenance=dict(prov, **change), value=1))


def test_a_record_is_stale_when_its_files_changed_since_its_commit(repo, monkeypatch, tmp_path_factory):
    root, git = repo
    make()
    assert records.stale("made") == []
    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))          # the files it wrote, found from the root
    assert records.stale("made") == []
    (root / "n.py").write_text("y = 2\n")                             # not a file it depends on
    git("commit", "-qam", "two")
    assert records.stale("made") == []
    (root / "m.py").write_text("x = 1   # a comment counts: the content tests decide what still holds\n")
    assert records.stale("made") == [f"changed since its commit {records.load('made').provenance.commit[:12]}: m.py"]
    git("commit", "-qam", "three")
    make()                                                            # made again, from the new commit
    (root / "docs" / "out.png").write_bytes(b"edited")
    assert records.stale("made") == ["docs/out.png is not the file it wrote (edited or copied since)"]
    (root / "docs" / "out.png").unlink()
    assert records.stale("made") == ["docs/out.png, which it wrote, is missing"]
    (root / "docs" / "out.png").write_bytes(b"png")
    make(depends=["docs/out.png"])                                    # any file of the project may be a dependency
    assert records.stale("made") == []
    (root / "m.py").write_text("x = 3\n")
    make()                                                            # made from uncommitted code
    assert records.stale("made")[-1] == "made from uncommitted changes to the files it depends on"


@pytest.mark.parametrize("change, said", [
    (dict(commit="--output=pwned"), "commit"), (dict(depends=["../outside.py"]), "depends"),
    (dict(outputs={"/etc/passwd": "0" * 64}), "outputs"), (dict(command="touch pwned"), "command"),
    (dict(dirty="no"), "dirty")])
def test_a_forged_provenance_is_refused_and_nothing_it_names_runs(repo, change, said):
    root, _ = repo
    make(**change)
    with pytest.raises(records.Problem, match=rf"field\(s\) {said} missing"):
        records.stale("made")
    assert not (root / "pwned").exists()


def test_refresh_runs_only_the_command_of_its_table(repo, monkeypatch, capsys):
    root, _ = repo
    ran, real = [], subprocess.run

    def fake(command, cwd=None, **kwargs):                              # git still runs; a tool is only noted
        if command[0] == "git":
            return real(command, cwd=cwd, **kwargs)
        ran.append((command, cwd))
        return subprocess.CompletedProcess(command, 3 if os.environ.get("TOOL") == "fail" else 0)
    monkeypatch.setattr(subprocess, "run", fake)
    monkeypatch.setattr(records, "render", lambda check=False: 0)
    make(tool=("tools/make.py", "--seed", "1"))                    # a record another command made
    status, out = run(capsys, "refresh", "made")
    assert status == 2 and "refused" in out and ran == []
    make(tool=("touch", str(root / "pwned")))
    assert run(capsys, "refresh", "made")[0] == 2 and ran == [] and not (root / "pwned").exists()
    make()
    assert run(capsys, "refresh", "made")[0] == 0 and ran == [([sys.executable, "tools/make.py", "--seed", "0"], str(root))]
    monkeypatch.setenv("TOOL", "fail")
    status, out = run(capsys, "refresh", "made")                      # a tool's failure is the status
    assert status == 3 and "exited 3" in out
    assert run(capsys, "refresh", "no-such")[0] == 2


@pytest.mark.parametrize("stale, rendered, status", [([], 0, 0), (["x"], 0, 1), ([], 1, 1), ([], 2, 2), (None, 0, 2)])
def test_check_exit_status(monkeypatch, capsys, stale, rendered, status):
    def fake_stale(name):
        if stale is None:
            raise records.Problem("unreadable")
        return stale
    monkeypatch.setattr(records, "stale", fake_stale)
    monkeypatch.setattr(records, "render", lambda check=False: rendered)
    assert run(capsys, "check")[0] == status


# ---------------------------------------------------------------------------------------------
# tools/docs_figures.py: which runs may be copied into docs/
# ---------------------------------------------------------------------------------------------

# what the documents show of a full run: figures they link to, tables their blocks read
SHOWN = ["depth.png", "depth_curve.csv", "depth_drawn.csv", "dynamics.csv", "dynamics.png", "dynamics_descent.csv",
         "dynamics_drawn.csv", "icl-curve.png", "icl-curve_curve.csv", "icl-curve_drawn.csv", "looped.csv", "looped.png",
         "looped_character.csv", "looped_drawn.csv", "looped_exact.csv", "looped_hessian.csv", "looped_points.csv", "looped_trained.csv",
         "optimizers.csv", "shift.csv", "shift.png", "shift_drawn.csv",
         "shift_shifts.csv", "single-layer-landscape.csv", "single-layer-landscape.png", "single-layer-landscape_basins.csv",
         "softmax-two-head.csv", "softmax-two-head.png", "softmax-two-head_starts.csv", "task-diversity.csv",
         "task-diversity.png", "task-diversity_drawn.csv", "task-diversity_pools.csv", "three-layer-blocks.csv", "three-layer-blocks_heatmaps.png",
         "three-layer-sparse.csv", "three-layer-sparse.png", "three-layer-sparse_heatmaps.png", "two-layer-isotropic.csv",
         "unconstrained.csv"]
SHOWN = sorted(SHOWN + [f[:-len("png")] + "pdf" for f in SHOWN if f.endswith(".png")])    # each figure's vector copy


@pytest.fixture
def full_run(docs, tmp_path, monkeypatch):
    """A made-up full run's folder, its record saying what docs_figures requires, and docs/ to copy to
    (the documents' copy): every file the documents show or quote, and one they do not."""
    out = tmp_path / "run"
    out.mkdir()
    files = {name: name.encode() for name in ["noise.csv", *SHOWN]}
    for name, data in files.items():
        (out / name).write_bytes(data)
    run = dict(status="complete", quick=False, seed=0, completed=list(ex.EXPERIMENTS), commit="a" * 40, dirty=False,
               files={name: icl_files.sha256(data) for name, data in files.items()},
               experiments={name: dict(seconds=1.0, cpu_seconds=2.0) for name in ex.EXPERIMENTS})
    (out / "config.json").write_text(json.dumps(run))
    monkeypatch.setattr(records, "changed_since", lambda commit, files: [] if commit == "a" * 40 else ["icl_ref.py"])
    return out, run


@pytest.mark.parametrize("change, said", [
    (dict(status="interrupted"), "not complete"), (dict(quick=True), "--quick"), (dict(seed=1), "seed"),
    (dict(quick=None), "--quick"),          # a record that does not say it is a full run is not taken for one
    (dict(completed=["noise"]), "missing an experiment"), (dict(dirty=True), "uncommitted"),
    (dict(dirty=None), "uncommitted"), (dict(commit="b" * 40), "changed since"),
    (dict(files={}), "not as its record lists"), (dict(files=5), "not a record of experiments.py"),
    (dict(completed=5), "not a record of experiments.py"), (dict(experiments={}), "not a record of experiments.py")])
def test_docs_figures_copies_only_a_complete_full_run_of_the_current_committed_code(full_run, capsys, change, said):
    out, run = full_run
    (out / "config.json").write_text(json.dumps(dict(run, **change)))
    before = {p: p.read_bytes() for p in (out.parent / "docs").iterdir()}
    assert docs_figures.main(["--from", str(out)]) == 2
    assert said in capsys.readouterr().err and {p: p.read_bytes() for p in (out.parent / "docs").iterdir()} == before


@pytest.mark.parametrize("plant", ["config.json nested too deep", "a FIFO named like a figure",
                                   "config.json a link to /dev/zero"])
def test_docs_figures_refuses_a_folder_it_cannot_read_without_a_traceback_or_waiting(full_run, capsys, plant):
    # its docstring: a run that may not be copied exits 2 with a message saying why, writing nothing;
    # a FIFO is seen before it is opened (opened to read, it would wait for a writer forever)
    out, run = full_run
    target = out / ("shift.png" if "FIFO" in plant else "config.json")
    target.unlink()
    if "nested" in plant:
        target.write_text("[" * 200_000 + "]" * 200_000)
    elif "FIFO" in plant:
        os.mkfifo(target)
    else:
        target.symlink_to("/dev/zero")
    before = {p: p.read_bytes() for p in (out.parent / "docs").iterdir()}
    box = {}
    worker = threading.Thread(target=lambda: box.update(status=docs_figures.main(["--from", str(out)])), daemon=True)
    worker.start()
    worker.join(60)                                 # a refusal takes well under a second; a FIFO read never returns
    if worker.is_alive():
        os.close(os.open(target, os.O_WRONLY | os.O_NONBLOCK))        # a writer's open and close releases it
        pytest.fail("blocked reading the folder")
    assert box["status"] == 2 and "not a full run's folder" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in (out.parent / "docs").iterdir()} == before


def test_docs_figures_copies_a_good_run_and_records_what_it_wrote(full_run, capsys):
    out, run = full_run
    assert docs_figures.main(["--from", str(out)]) == 0
    rec = records.load("figures")
    assert rec.provenance.commit == "a" * 40 and rec.provenance.dirty is False
    assert rec.provenance.command == records.TOOLS["figures"][1] and rec.timing.experiments.noise.cpu_seconds == 2.0
    assert rec.provenance.outputs == {f"docs/{name}": run["files"][name] for name in SHOWN}
    (out / "shift.csv").write_bytes(b"edited after the run")
    assert docs_figures.main(["--from", str(out)]) == 2               # a file not as the run wrote it


# ---------------------------------------------------------------------------------------------
# One body for each function; the documents' numbers kept through the move to row ids
# ---------------------------------------------------------------------------------------------

def test_no_function_body_is_written_twice_in_the_experiments_the_tools_and_the_library():
    bodies = {}
    for path in ["experiments.py", "experiments_cli.py", *glob.glob("icl_*.py", root_dir=ROOT),
                 *glob.glob("tools/*.py", root_dir=ROOT)]:
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            for node in ast.walk(ast.parse(f.read())):
                if isinstance(node, ast.FunctionDef):
                    body = node.body[1:] if ast.get_docstring(node) else node.body
                    key = ast.dump(ast.Module(body, []))
                    if len(body) > 1 or len(key) > 300:                  # not a one-line wrapper
                        assert key not in bodies, f"{path}:{node.name} repeats {bodies[key]}"
                        bodies[key] = f"{path}:{node.name}"


@pytest.mark.parametrize("plant", ["fifo", "endless"])
def test_a_table_that_is_no_regular_file_is_a_message_and_status_2_not_a_wait(docs, capsys, plant):
    # a FIFO or a link to /dev/zero under a table's name: opened to read, one waits for a writer forever and
    # the other never ends; seen (stat) before it is opened, each is a table that cannot be read (status 2)
    table = docs / "docs" / "optimizers.csv"
    table.unlink()
    os.mkfifo(table) if plant == "fifo" else table.symlink_to("/dev/zero")
    box = {}
    worker = threading.Thread(target=lambda: box.update(status=records.main(["render", "--check"])), daemon=True)
    worker.start()
    worker.join(60)                                 # a refusal takes well under a second
    if worker.is_alive():
        if plant == "fifo":
            os.close(os.open(table, os.O_WRONLY | os.O_NONBLOCK))    # a writer's open and close releases it
        pytest.fail("blocked or endless reading a table")
    assert box["status"] == 2 and "optimizers.csv cannot be read" in capsys.readouterr().err
