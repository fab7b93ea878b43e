"""Tests written from the promises (the tools' docstrings and
--help, docs/RECORDS.md, README.md, the modules' docstrings, MATH.md) for the single-line slips of
tools/mutants.py's `r5-` block that the rest of the default suite let pass. Each test names the promise
it holds the code to; none reads the line it guards. Every tolerance says why it is what it is.

    python3 tools/mutants.py -k r5-          # these slips, each against the whole default suite
"""
import csv
import json
import math
import os
import socket
import subprocess
import sys
import warnings

import numpy as np
import pytest

import icl_check as ic
import icl_estimators as est
import icl_files
import icl_looped as lp
import icl_ref as ir

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import docs_figures  # noqa: E402  (tools/ on the path)
import records  # noqa: E402
from test_records import docs, edit_csv, full_run, git_in, make, repo, run, spoil  # noqa: E402,F401  (the fixtures and helpers)


# ---------------------------------------------------------------------------------------------
# tools/records.py: its exit statuses in every outcome (its docstring), where staleness looks
# (docs/RECORDS.md), what refresh runs by default and that it writes the blocks
# ---------------------------------------------------------------------------------------------

def csv_rows(path):
    with open(path, encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f))


def every_block_spoiled(root):
    """Put a 9 before the text of every generated block of every document under `root`."""
    for doc in records.DOCS:
        path = root / doc
        text = path.read_text()
        for name in [m.group(1) for m in records.BLOCK.finditer(text)]:
            text = spoil(text, name)
        path.write_text(text)


@pytest.mark.parametrize("broken", ["docs/dynamics.csv", "docs/benchmarks.json"])
def test_a_block_that_cannot_be_rendered_is_status_2_whatever_else_differs(docs, capsys, broken):
    # "2: a block cannot be rendered"; "1: a block differs": a document with both is the worse, 2, in
    # whichever order the documents put them (a FINDINGS.md block reads dynamics.csv, README.md's and
    # docs/benchmarks.md's read benchmarks.json; every other block differs)
    every_block_spoiled(docs)
    if broken.endswith(".csv"):
        edit_csv(docs / broken, lambda r: None if r["id"] == "dynamics/inside-end" else r)
    else:
        (docs / broken).write_text("{not json")
    for command in (["render", "--check"], ["check"]):
        status, out = run(capsys, *command)
        assert status == 2 and "differs from the records" in out, (command, out[-2000:])


def test_a_table_that_repeats_an_id_is_refused_by_name(docs, capsys):
    # RECORDS.md: a row is found by its id, and "a row id ... missing, rows that disagree" are each named
    # (exit 2); rows.py's own words: Problem when "the table has no unique ids". A table with one id
    # twice cannot say which row a block quotes
    edit_csv(docs / "docs/dynamics.csv", lambda r: dict(r, id="dynamics/inside-end") if r["id"] == "dynamics/outside-end"
             else r)
    status, out = run(capsys, "render", "--check")
    assert status == 2 and "repeats an id" in out


@pytest.mark.parametrize("which", [0, 2, -1])
def test_rows_that_disagree_anywhere_in_a_quoted_set_are_named(docs, capsys, which):
    # RECORDS.md: `one(rows, field)` is "the one value the rows agree on", and "rows that disagree" are
    # named (exit 2): whichever row of the set differs (looped-flow quotes one eta of dynamics_descent/*)
    ids = [r["id"] for r in csv_rows(docs / "docs/dynamics_descent.csv")]
    assert len(ids) >= 4
    edit_csv(docs / "docs/dynamics_descent.csv", lambda r: dict(r, eta="0.02") if r["id"] == ids[which] else r)
    status, out = run(capsys, "render", "--check")
    assert status == 2 and "disagree on eta" in out and "looped-flow" in out


def test_a_block_differing_only_in_its_spacing_is_found_and_rewritten(docs, capsys):
    # "1: check: ... a block differs; render --check: a block differs": the text between the markers is
    # the rendered text, spaces included (here two spaces before it: a line that Markdown would then
    # read as continuing a list or, with more, as code)
    math_md = docs / "MATH.md"
    text = math_md.read_text()
    m = next(m for m in records.BLOCK.finditer(text) if m.group(1) == "landscape-count")
    math_md.write_text(text[:m.start(4)] + "  " + text[m.start(4):])
    status, out = run(capsys, "render", "--check")
    assert status == 1 and "MATH.md block landscape-count: differs" in out
    assert run(capsys, "render")[0] == 0 and math_md.read_text() == text


def test_a_record_not_known_to_be_made_from_committed_code_is_stale(repo):
    # RECORDS.md: stale "when it was made with `dirty` not false"; the records made before the
    # provenance had dirty have `null` (not known)
    make(dirty=None)
    assert records.stale("made") == ["not known whether it was made from uncommitted changes"]
    make(dirty=False)
    assert records.stale("made") == []


def test_a_provenance_whose_outputs_are_not_under_docs_is_malformed(repo):
    # RECORDS.md: `outputs` are "the files it wrote besides the record (paths from the root, under docs/)";
    # a provenance whose files are not of the form provenance writes is refused as malformed
    make(outputs={"m.py": icl_files.sha256(b"x = 1\n")})
    with pytest.raises(records.Problem, match=r"field\(s\) outputs missing or malformed"):
        records.stale("made")


@pytest.fixture
def tools_noted(repo, monkeypatch):
    """The repo fixture with `made` its only record, its tool only noted (git still runs), render counted."""
    root, git = repo
    monkeypatch.setattr(records, "TOOLS", {"made": records.TOOLS["made"]})
    ran, rendered, real = [], [], subprocess.run

    def fake(command, cwd=None, **kwargs):
        if command[0] == "git":
            return real(command, cwd=cwd, **kwargs)
        ran.append(command[1:])
        return subprocess.CompletedProcess(command, 0)
    monkeypatch.setattr(subprocess, "run", fake)
    monkeypatch.setattr(records, "render", lambda check=False: rendered.append(check) or 0)
    return root, ran, rendered


def test_refresh_without_names_runs_the_stale_and_the_unreadable_records_only(tools_noted, capsys):
    # the docstring: "rerun the tools of the named records (default: the stale ones)", and refresh's:
    # "(default: the stale ones and those that cannot be read)"; then it renders
    root, ran, rendered = tools_noted
    make()
    assert run(capsys, "refresh") == (0, "") and ran == [] and rendered == [False]   # current: nothing to run
    (root / "m.py").write_text("x = 2\n")                                            # stale now
    assert run(capsys, "refresh")[0] == 0 and ran == [["tools/make.py", "--seed", "0"]]
    (root / "m.py").write_text("x = 1\n")
    (root / "docs" / "made.json").write_text("{not json")                           # cannot be read
    assert run(capsys, "refresh")[0] == 0 and ran == [["tools/make.py", "--seed", "0"]] * 2
    assert rendered == [False] * 3


def test_refresh_writes_the_blocks_after_the_tools(docs, capsys, monkeypatch):
    # "refresh: the tools ran and the blocks were written" (exit 0): with every record current nothing
    # runs, and a block that differs from the records is rewritten
    monkeypatch.setattr(records, "stale", lambda name: [])
    math_md = docs / "MATH.md"
    text = math_md.read_text()
    math_md.write_text(spoil(text, "landscape-count"))
    status, out = run(capsys, "refresh")
    assert status == 0 and math_md.read_text() == text and "wrote MATH.md" in out


def test_refresh_naming_an_unknown_record_runs_nothing(tools_noted, capsys):
    # "2 ... refresh refused (an unknown record ...: nothing is run)", also beside a record it knows
    root, ran, rendered = tools_noted
    make()
    (root / "m.py").write_text("x = 2\n")                                            # made is stale
    status, out = run(capsys, "refresh", "made", "no-such")
    assert status == 2 and "no-such" in out and ran == [] and rendered == []


# ---------------------------------------------------------------------------------------------
# tools/docs_figures.py: a full run now, which runs it copies and what it exits with (its docstring)
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def full_run_now(monkeypatch):
    """docs_figures.main without --from, the experiments' code committed: the full run it starts only
    noted (its exit status set by the test), copy_from noted."""
    started, copied, status = [], [], {}
    monkeypatch.setattr(icl_files, "source_state", lambda files, root=None: dict(commit="a" * 40, dirty=False))
    monkeypatch.setattr(docs_figures.subprocess, "run", lambda command, **kw: started.append(command) or
                        subprocess.CompletedProcess(command, status["run"]))
    monkeypatch.setattr(docs_figures, "copy_from", lambda out: copied.append(out) or 0)
    return started, copied, status


@pytest.mark.parametrize("run_status, copies, exits", [(0, True, 0), (1, True, 0), (70, False, 70), (130, False, 130),
                                                        (143, False, 143)])
def test_a_full_run_now_is_copied_when_complete_even_with_a_failed_claim(full_run_now, run_status, copies, exits):
    # "Exit statuses: 0 copied; ... else a full run's own status when it did not complete (one with a
    # failed claim, status 1, is copied: the documents quote its verdicts)"
    started, copied, status = full_run_now
    status["run"] = run_status
    assert docs_figures.main([]) == exits
    assert len(started) == 1 and started[0][1].endswith("experiments.py") and bool(copied) == copies


@pytest.mark.parametrize("dirty", [True, None])
def test_no_full_run_starts_unless_the_experiments_code_is_known_to_be_committed(full_run_now, monkeypatch, capsys, dirty):
    # a run is copied only when "made from a commit with no uncommitted change to the experiments'
    # code (dirty false)": where that is not known (no git checkout: dirty None) the 8-15 min run that
    # could not be copied is not started (status 2, "a run that may not be copied")
    started, copied, _ = full_run_now
    monkeypatch.setattr(icl_files, "source_state", lambda files, root=None: dict(commit=None, dirty=dirty))
    assert docs_figures.main([]) == 2 and started == [] and copied == []
    assert "commit first" in capsys.readouterr().err


def test_a_run_that_drew_no_figures_is_not_copied(full_run, capsys):
    # README: docs_figures "copies into docs/ the figures and tables the documents show and quote, from
    # one full run": a run made without matplotlib (its record lists no figure) would leave the figures
    # of another run beside its tables; nothing is written (status 2)
    out, run_record = full_run
    files = {k: v for k, v in run_record["files"].items() if not k.endswith(".png")}
    for name in run_record["files"]:
        if name.endswith(".png"):
            (out / name).unlink()
    (out / "config.json").write_text(json.dumps(dict(run_record, files=files)))
    before = {p: p.read_bytes() for p in (out.parent / "docs").iterdir()}
    assert docs_figures.main(["--from", str(out)]) == 2
    assert "without figures" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in (out.parent / "docs").iterdir()} == before


def test_the_figures_record_says_how_long_the_run_took(full_run, capsys):
    # RECORDS.md: a provenance's `seconds` is how long the tool ran; the figures' tool is the full run,
    # whose experiments run one after another: the sum of their wall-clock seconds (timing), which are
    # exact binary fractions here, so the sum is exact
    out, run_record = full_run
    seconds = {name: 0.5 + k for k, name in enumerate(run_record["experiments"])}
    run_record["experiments"] = {name: dict(seconds=s, cpu_seconds=2 * s) for name, s in seconds.items()}
    (out / "config.json").write_text(json.dumps(run_record))
    assert docs_figures.main(["--from", str(out)]) == 0
    rec = records.load("figures")
    assert rec.provenance.seconds == round(sum(seconds.values()), 1)
    assert {n: t.seconds for n, t in rec.timing.experiments.items()} == seconds


# ---------------------------------------------------------------------------------------------
# icl_files: the hardened writer's record of what it wrote, and source_state
# ---------------------------------------------------------------------------------------------

def test_source_state_counts_a_file_not_yet_committed_as_dirty(tmp_path, monkeypatch):
    # source_state: "dirty: whether any of `files` ... differs from that commit (edited, or not committed)"
    git = git_in(tmp_path, monkeypatch)
    (tmp_path / "a.py").write_text("a = 1\n")
    git("init", "-q")
    git("add", "a.py")
    git("commit", "-q", "-m", "one")
    assert icl_files.source_state(["a.py"], str(tmp_path))["dirty"] is False
    (tmp_path / "new.py").write_text("b = 1\n")                      # never committed, not even added
    assert icl_files.source_state(["a.py", "new.py"], str(tmp_path))["dirty"] is True
    git("add", "new.py")                                              # added, not committed
    assert icl_files.source_state(["new.py"], str(tmp_path))["dirty"] is True
    git("commit", "-q", "-m", "two")
    assert icl_files.source_state(["a.py", "new.py"], str(tmp_path)) == dict(
        commit=git("rev-parse", "HEAD").stdout.decode().strip(), dirty=False)
    (tmp_path / "a.py").write_text("a = 2\n")                         # edited
    assert icl_files.source_state(["a.py"], str(tmp_path))["dirty"] is True


def open_folder(out):
    """A Folder of a made-up tool in `out`, opened (new or empty), its record started."""
    folder = icl_files.Folder(out, "r5 tool", "record.json", ".r5.lock")
    folder.open(overwrite=False, keep_others=None, writes=lambda name: True)
    folder.fields = dict(format=icl_files.JOURNAL_FORMAT, tool="r5 tool")
    folder.save("running")
    return folder


def test_a_written_file_moves_from_writing_to_files_in_the_record(tmp_path):
    # the module's promise 5: "Before a file is written its name and the hash ... are recorded as
    # `writing`; once written it moves to `files`"
    with open_folder(tmp_path / "out") as folder:
        folder.write({"a.txt": b"one", "b.txt": b"two"})
        record = json.loads((tmp_path / "out" / "record.json").read_text())
    assert record["files"] == {"a.txt": icl_files.sha256(b"one"), "b.txt": icl_files.sha256(b"two")}
    assert record["writing"] == {} and record["status"] == "running"


def test_a_record_takes_only_the_documented_statuses(tmp_path):
    # STATUSES: "a record's statuses: running, complete, interrupted, broken pipe, write error, crashed"
    with open_folder(tmp_path / "out") as folder:
        with pytest.raises(ValueError, match="status must be one of"):
            folder.save("finished")
        folder.save("complete")
    assert json.loads((tmp_path / "out" / "record.json").read_text())["status"] == "complete"


@pytest.mark.parametrize("error, status", [(KeyboardInterrupt(), "interrupted"), (RuntimeError("bug"), "crashed")])
def test_a_set_stopped_while_written_says_how_in_its_record(tmp_path, monkeypatch, error, status):
    # write_file_set: "A failure or interruption is recorded there (write error, interrupted, crashed)
    # before the exception goes on"
    real = icl_files.Folder._create

    def create(self, name, data):
        if name == "b.npz":                                  # the second file: stopped as it is written
            raise error
        return real(self, name, data)
    monkeypatch.setattr(icl_files.Folder, "_create", create)
    with pytest.raises(type(error)):
        icl_files.write_file_set(tmp_path / "out", {"a.npz": b"1", "b.npz": b"2", "manifest.json": b"{}"}, tool="r5 tool",
                                 record=".r5-record.json", lock=".r5.lock", vouchers={}, overwrite=False)
    record = json.loads((tmp_path / "out" / ".r5-record.json").read_text())
    assert record["status"] == status and record["files"] == {"a.npz": icl_files.sha256(b"1")}


def test_a_lock_whose_holder_cannot_be_asked_about_is_not_taken_over(tmp_path, monkeypatch):
    # the module: the portable lock of a run killed by SIGKILL is taken over "when its pid names no
    # running process of this host" and "otherwise refuses"; where the system cannot be asked (_running
    # None: Windows' signal 0 is not a question) it is not known to name none (the pid is then never asked)
    monkeypatch.setitem(sys.modules, "fcntl", None)          # the portable lock: a file created exclusively
    monkeypatch.setattr(icl_files, "_running", lambda pid: None)
    out = tmp_path / "out"
    out.mkdir()
    (out / ".r5.lock").write_text(json.dumps(dict(pid=2 ** 22 + 12345, host=socket.gethostname())))
    with pytest.raises(icl_files.Refused, match="in use by another"):
        open_folder(out)
    assert os.listdir(out) == [".r5.lock"]


def test_replacing_a_tracked_file_keeps_its_permissions(tmp_path):
    # replace_file writes "one of the project's own tracked files" whole; git tracks a file's executable
    # bit, so a rewritten document or script must keep its mode (else `git status` shows a change)
    path = tmp_path / "tool.py"
    path.write_bytes(b"old")
    os.chmod(path, 0o750)
    icl_files.replace_file(str(path), b"new")
    assert path.read_bytes() == b"new" and (os.stat(path).st_mode & 0o777) == 0o750


def test_a_new_file_gets_the_umask_s_mode_not_its_folder_s(tmp_path):
    # a document replace_file creates is an ordinary new file (0o666 less the umask), whatever the
    # permission bits of the folder it lands in (a 0o755 folder once made new documents executable)
    folder = tmp_path / "docs"
    folder.mkdir()
    os.chmod(folder, 0o755)
    old_umask = os.umask(0o022)
    try:
        icl_files.replace_file(str(folder / "new.md"), b"text")
    finally:
        os.umask(old_umask)
    assert (folder / "new.md").read_bytes() == b"text"
    assert (os.stat(folder / "new.md").st_mode & 0o777) == 0o644


# ---------------------------------------------------------------------------------------------
# icl_estimators: least squares' risk below d, and monte_carlo_risk's standard error recomputed
# ---------------------------------------------------------------------------------------------

def test_the_interpolants_noise_term_is_the_monte_carlo_risk_on_pure_noise():
    # ols_population_risk for n < d: "c s (d - n) + noise_var n / (d - n - 1)" (+ noise_var). Labels of
    # pure noise (w_star ~ N(0, 1e-12 I): the bias term is 5e-12) leave the noise term alone, here 3/4
    # (+1, the query's): a d - n for d - n - 1 gives 3/5 (0.15 lower). 20000 prompts give a standard error
    # of ~0.022 (E tr (X X^T)^-2 is finite for d - n > 3); 4 standard errors, the project's k for Monte
    # Carlo checks, leave the slip ~7 standard errors out
    n, d, s2 = 3, 8, 1.0
    risk = est.ols_population_risk(n, np.eye(d), 1e-12 * np.eye(d), noise_var=s2)
    mc, se = est.monte_carlo_risk(lambda Z: est.ridge_predict(Z, 0.0), np.random.default_rng(5), 20000, n, np.eye(d),
                                  1e-12 * np.eye(d), noise_var=s2)
    assert se < 0.03 and abs(mc - risk) <= 4 * se, (mc, se, risk)


def test_least_squares_risk_is_refused_by_name_exactly_where_it_is_infinite():
    # ols_population_risk: with noise "n > d + 1" (n >= d) and "n < d - 1" (n < d); "Elsewhere the risk
    # is infinite (n in d-1..d+1 with noise)": a ValueError naming n, at each of the three
    d = 6
    for n in (d - 1, d, d + 1):
        with pytest.raises(ValueError, match="n must be"):
            est.ols_population_risk(n, np.eye(d), noise_var=0.5)
    for n in (d - 2, d + 2):
        assert math.isfinite(est.ols_population_risk(n, np.eye(d), noise_var=0.5))
    for n in (d - 1, d, d + 1):                              # without noise every n has a finite risk
        assert math.isfinite(est.ols_population_risk(n, np.eye(d)))


def test_monte_carlo_risks_standard_error_is_the_samples_std_over_root_batch():
    # monte_carlo_risk: "E (predict(Z) - y_q)^2 by Monte Carlo ... with its standard error
    # std / sqrt(batch)" (the sample standard deviation, ddof 1), over every prompt, "called on chunks of
    # at most 4096 prompts". One task and no noise make y_q = <w, x_q> readable from the Z predict is
    # handed, so the test recomputes each squared error itself; 6000 prompts span two chunks. The same
    # numbers summed in another order: 1e-12 relative
    w = np.array([[0.5, -1.0, 2.0]])
    seen = []

    def predict(Z):
        seen.append(Z.copy())
        return Z[:, 0, -1]                                   # some estimate: the query's first coordinate
    risk, se = est.monte_carlo_risk(predict, np.random.default_rng(3), 6000, 4, np.eye(3), tasks=w)
    Z = np.concatenate(seen)
    errors = (Z[:, 0, -1] - Z[:, :3, -1] @ w[0]) ** 2
    assert len(Z) == 6000 and max(len(z) for z in seen) <= 4096
    assert abs(risk - np.mean(errors)) <= 1e-12 * risk
    assert abs(se - np.std(errors, ddof=1) / math.sqrt(6000)) <= 1e-12 * se


# ---------------------------------------------------------------------------------------------
# icl_looped: the Monte Carlo estimates' standard errors, recomputed from the samples, and the
# documented corners of the tied optimum and the flow's bound
# ---------------------------------------------------------------------------------------------

def test_mc_loss_and_its_control_variate_are_recomputed_from_the_samples():
    # mc_loss: "f(W) by Monte Carlo over S, with its standard error"; with control (W0, f0) "the
    # least-variance coefficient c = cov / var estimated from the samples" of x = loss(W0) - f0: the
    # estimate is mean(y - c x), its standard error std(y - c x) / sqrt(B) (sample std, ddof 1; cov and
    # var both unbiased, so c = sum of products / sum of squares). The same sums in another order: 1e-10
    rng = np.random.default_rng(11)
    L, n, d, B = 2, 20, 3, 300
    S = lp.sample_whitened_covariances(rng, B, n, d)
    W, W0 = 0.6 * np.eye(d) + 0.05 * rng.standard_normal((d, d)), 0.6 * np.eye(d)
    y, x = lp.per_sample_loss(W, S, L), lp.per_sample_loss(W0, S, L) - 0.01
    m, se, c = lp.mc_loss(W, S, L)
    assert c == 0.0 and abs(m - y.mean()) <= 1e-12 * m
    assert abs(se - np.std(y, ddof=1) / math.sqrt(B)) <= 1e-10 * se
    m, se, c = lp.mc_loss(W, S, L, control=(W0, 0.01))
    c_own = np.sum((y - y.mean()) * (x - x.mean())) / np.sum((x - x.mean()) ** 2)
    v = y - c_own * x
    assert abs(c - c_own) <= 1e-10 * abs(c_own)
    assert abs(m - v.mean()) <= 1e-10 * m and abs(se - np.std(v, ddof=1) / math.sqrt(B)) <= 1e-10 * se


def test_mc_certificates_gradient_standard_errors_are_the_samples():
    # mc_certificate: "the gradient's mean and standard error per entry" (std over the samples, ddof 1,
    # over sqrt(B)). The certificate sums squares (E g^2 - (E g)^2), which loses ~eps (E g)^2 / var(g) of
    # the variance to cancellation: ~1e-15 here (W away from a minimum, |mean| ~ std); 1e-8 relative is
    # far from that and far below the 1 / (2B) = 1.7e-3 of a ddof 0
    rng = np.random.default_rng(12)
    L, n, d, B = 2, 20, 3, 300
    S = lp.sample_whitened_covariances(rng, B, n, d)
    W = 0.5 * np.eye(d) + 0.1 * rng.standard_normal((d, d))
    cert = lp.mc_certificate(W, S, L)
    g = lp.per_sample_gradient(W, S, L)
    np.testing.assert_allclose(cert["grad_mean"], g.mean(axis=0), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(cert["grad_se"], np.std(g, axis=0, ddof=1) / math.sqrt(B), rtol=1e-8)
    assert cert["loss_se"] == lp.mc_loss(W, S, L)[1]


def test_the_flows_initial_scale_bound_is_zhang_frei_bartletts():
    # one_layer_gradient_flow: "sigma_bound = sqrt(2 / (sqrt(d) |Gamma*^-1|_2)) with Gamma* =
    # gamma_star(Sigma, n, Sigma_w)"; one formula evaluated two ways: rounding, 1e-12
    rng = np.random.default_rng(13)
    Sigma = ir.rotated_covariance(rng)[0]
    out = lp.one_layer_gradient_flow(Sigma, 20, 0.1, [0.0])
    bound = math.sqrt(2 / (math.sqrt(5) * np.linalg.norm(np.linalg.inv(ir.gamma_star(Sigma, 20)), 2)))
    assert abs(out["sigma_bound"] - bound) <= 1e-12 * bound


def test_the_tied_blocks_optimum_of_one_layer_has_no_b():
    # optimal_tied_family: "b NaN when L = 1 (B_0 never enters)"; a, the loss as for the sparse family
    # (the same one-layer model): both searches stop where the gradient is ~1e-12, 1e-8 relative
    a, b, loss = lp.optimal_tied_family(1, 20, 5, blocks=True)
    a_sparse, b_sparse, loss_sparse = lp.optimal_tied_family(1, 20, 5)
    assert math.isnan(b) and b_sparse is None
    assert abs(a - a_sparse) <= 1e-8 * a and abs(loss - loss_sparse) <= 1e-8 * loss


# ---------------------------------------------------------------------------------------------
# icl_check: what counts as a number in another implementation's outputs
# ---------------------------------------------------------------------------------------------

def test_booleans_are_not_numbers_to_the_conformance_kit():
    # README: an output "that is not a real array (None, a string, complex, objects) ... is a
    # TypeError/ValueError naming the case and the output"; diagnose: one "not real numbers" is named as
    # malformed before any comparison (icl_ref itself refuses boolean arrays as input: "a real integer or
    # float array"). A y_hat of booleans (a comparison returned by mistake) is not compared as 0s and 1s
    case = ic.reference_cases()[0]
    flags = np.ones(case["Z"].shape[0], dtype=bool)
    with pytest.raises(TypeError, match=r"'y_hat' for case '" + case["name"] + "'.*bool"):
        ic.check_implementation(lambda inputs: {"y_hat": flags.copy()}, cases=case["name"], outputs="y_hat")
    _, found = ic.diagnose({case["name"]: {"y_hat": flags}})
    assert found[case["name"]]["y_hat"].startswith("malformed: not a numeric array")


# ---------------------------------------------------------------------------------------------
# icl_ref's options at their corners: weight tying, label noise with a task law not the identity,
# task pools, and a strict caller's floating-point rules
# ---------------------------------------------------------------------------------------------

def test_tied_parameters_must_have_every_layer_equal_in_p_and_in_q():
    # residuals_and_jacobian(..., tied=True): "every layer of P, Q equal"; a Q whose layers differ is
    # refused as a P whose layers differ is (the Jacobian's columns are one layer's)
    rng = np.random.default_rng(21)
    Z, y = ir.sample_prompts(rng, 8, 5, np.eye(2))
    P, Q = np.repeat(0.1 * rng.standard_normal((2, 1, 1, 3, 3)), 2, axis=1)
    for P_, Q_ in ((P, Q + np.r_[0.0, 0.1][:, None, None, None]), (P + np.r_[0.0, 0.1][:, None, None, None], Q)):
        with pytest.raises(ValueError, match="every layer equal"):
            ir.residuals_and_jacobian(P_, Q_, Z, y, structure="full", tied=True)
    ir.residuals_and_jacobian(P, Q, Z, y, structure="full", tied=True)


def own_K(Sigma, Sigma_w, n, noise_var):
    """gamma_star's docstring: K = ((n+1)/n) Sigma Sigma_w Sigma + ((tr(Sigma_w Sigma) + noise_var)/n) Sigma."""
    return (n + 1) / n * Sigma @ Sigma_w @ Sigma + (np.trace(Sigma_w @ Sigma) + noise_var) / n * Sigma


@pytest.mark.parametrize("w_scale", [4.0, 1e-3])
def test_label_noise_with_a_task_law_off_the_identity_is_the_documented_optimum_and_loss(w_scale):
    # gamma_star: Gamma* = K^-1 Sigma Sigma_w with the noise inside K; single_layer_population_loss:
    # tr(Sigma G^T K G) - 2 tr(Sigma G^T Sigma Sigma_w) + tr(Sigma Sigma_w) + noise_var. Sigma_w a
    # multiple of an SPD matrix with entries far from 1, so the noise's share of K depends on its scale.
    # K's condition number is ~10 here: the two evaluations agree to ~1e-14; 1e-11 relative
    rng = np.random.default_rng(22)
    n, d, s2 = 10, 3, 0.7
    Sigma = ir.rotated_covariance(rng, [1.0, 0.5, 0.2])[0]
    A = rng.standard_normal((d, d))
    Sigma_w = w_scale * (A @ A.T + d * np.eye(d)) / d
    K = own_K(Sigma, Sigma_w, n, s2)
    G = np.linalg.solve(K, Sigma @ Sigma_w)
    np.testing.assert_allclose(ir.gamma_star(Sigma, n, Sigma_w, noise_var=s2), G, rtol=1e-11, atol=1e-11 * np.max(np.abs(G)))
    Gamma = G + 0.3 * np.max(np.abs(G)) * rng.standard_normal((d, d))
    loss = (np.trace(Sigma @ Gamma.T @ K @ Gamma) - 2 * np.trace(Sigma @ Gamma.T @ Sigma @ Sigma_w)
            + np.trace(Sigma @ Sigma_w) + s2)
    assert abs(ir.single_layer_population_loss(Gamma, Sigma, n, Sigma_w, noise_var=s2) - loss) <= 1e-11 * loss


def test_a_pools_law_is_its_uniform_draw_and_its_second_moment():
    # sample_prompts: with tasks, "w_star is a uniformly drawn row of the pool"; gamma_star: "Sigma_w is
    # the pool's second moment" (1/K) sum_k w_k w_k^T, here with K = 5 tasks in d = 3 (K != d). Each of
    # the 5 rows is drawn ~400 times of 2000 (sd ~18): 5 sd is 90
    rng = np.random.default_rng(23)
    tasks = rng.standard_normal((5, 3))
    _, _, w = ir.sample_prompts(rng, 2000, 4, np.eye(3), tasks=tasks, return_w_star=True)
    counts = [int(np.sum(np.all(w == t, axis=1))) for t in tasks]
    assert sum(counts) == 2000 and all(abs(c - 400) <= 90 for c in counts), counts
    # with label noise (without it Gamma* does not depend on the moment's scale): one formula, two
    # evaluations, rounding: 1e-12
    moment = tasks.T @ tasks / 5
    np.testing.assert_allclose(ir.gamma_star(np.eye(3), 4, tasks=tasks, noise_var=0.3),
                               ir.gamma_star(np.eye(3), 4, moment, noise_var=0.3), rtol=1e-12)


def test_the_query_label_carries_the_noise_the_context_labels_do():
    # sample_prompts: y_i = <w_star, x_i> + noise_std N(0, 1) for i = 0..n (the last is the query), and y
    # is "the query's label (noise included)". The residuals' sample std over 4000 prompts is within
    # ~1.1% (1 / sqrt(2B)) of noise_std; 6% is > 5 of those, and a noiseless query label is 100% off
    rng = np.random.default_rng(24)
    Z, y, w = ir.sample_prompts(rng, 4000, 3, np.eye(2), noise_std=0.5, return_w_star=True)
    query = y - np.einsum("bd,bd->b", Z[:, :2, -1], w)
    context = Z[:, 2, :-1] - np.einsum("bdi,bd->bi", Z[:, :2, :-1], w)
    for r in (query, context.ravel()):
        assert abs(np.std(r) - 0.5) <= 0.06 * 0.5 and abs(np.mean(r)) <= 0.05


def outcome(call):
    """What a call gives: ("value", its result as text, the warnings it issued) or ("error", the
    exception's type and message): a function's whole behaviour, to compare across np.seterr rules."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            result = ("value", repr(call()))
        except Exception as e:                               # compared, never swallowed: the test asserts on it
            result = ("error", type(e).__name__, str(e))
    return result + (sorted({f"{w.category.__name__}: {w.message}" for w in seen}),)


STRICT_OVERFLOWS = {
    # a predictor whose squared errors overflow: the risk's intermediate (y_hat - y)^2 is inf
    "monte_carlo_risk": lambda: est.monte_carlo_risk(lambda Z: np.full(len(Z), 1e200), np.random.default_rng(0), 8, 3,
                                                     np.eye(2)),
    # <M, T> / <T, T> = 2e300 / 2e-600: the quotient overflows
    "fitted_scalar": lambda: ir.fitted_scalar(1e300 * np.ones((2, 2)), 1e-300 * np.eye(2)),
}


@pytest.mark.parametrize("name", sorted(STRICT_OVERFLOWS))
@pytest.mark.parametrize("mode", ["raise", "call", "log"])
def test_a_strict_callers_real_overflow_meets_the_default_rules(name, mode):
    # README: "The library computes under NumPy's default floating-point rules whatever np.seterr the
    # caller set"; icl_ref's rules: '"raise" (or "call", "log") made "warn"'. Where an intermediate really
    # overflows (not only underflows, as in test_icl_ref's strict test), a caller with all=mode gets what
    # a caller with the default rules gets, the handler it set is never called, and its rules come back
    call, calls = STRICT_OVERFLOWS[name], []
    with np.errstate(under="ignore"):                        # the default rules
        expected = outcome(call)
    assert "overflow" in str(expected), expected         # the overflow is real

    class Log:
        def write(self, message):
            calls.append(message)
    old_call = np.seterrcall((lambda kind, flag: calls.append(kind)) if mode == "call" else Log())
    old = np.seterr(all=mode)
    try:
        got = outcome(call)
        assert np.geterr() == dict.fromkeys(("divide", "over", "under", "invalid"), mode)
    finally:
        np.seterr(**old)
        np.seterrcall(old_call)
    assert got == expected and calls == []
