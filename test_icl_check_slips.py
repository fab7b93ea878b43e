"""The conformance kit's reports on slips it knows and slips it does not (MATH.md §13): a model in the
paper's layout and one in von Oswald et al.'s, each written here from the papers, each able to make
one slip. For a slip the kit knows, the report names it in the model's layout; for one it does not,
it locates it: the simplest case that differs (linear attention first, then fewer layers, heads,
smaller d and n) with its activation, each output's largest relative error and where it sits, and
where in the model the difference starts. No report names a case that agreed, and each fits in
MAX_REPORT_LINES lines.

Each model runs in NumPy (outputs Z_L, y_hat, loss) in the default suite, and the same code in
PyTorch (the paper's layout) and JAX (von Oswald et al.'s) with autograd gradients where those are
installed (.ci/run's frameworks leg; skipped here otherwise). A slip in a hand-written backward pass
(head 1's dQ transposed) is simulated on icl_ref's own outputs.

Tolerances: the kit's defaults (CHECK_TOLERANCES, float64): every model computes the same exact
quantities as icl_ref, so a correct one agrees to rounding. The sizes a report quotes are compared
with the test's own max |yours - icl_ref's| / max |icl_ref's|, to the printed digits.
"""
import math
import re

import numpy as np
import pytest

import icl_check as ic

CASES = {c["name"]: c for c in ic.reference_cases()}


def framework(name):
    """The framework module, or a skip naming how to get it (.ci/run's frameworks leg has it)."""
    return pytest.importorskip(name, reason=f"needs {name}: .ci/run's frameworks leg installs it")


# ---------------------------------------------------------------------------------------------
# Two models, each one code for NumPy and a framework: `xp` its array module, `ops` what differs
# ---------------------------------------------------------------------------------------------

def numpy_ops():
    def softmax(a, axis):
        e = np.exp(a - a.max(axis=axis, keepdims=True))
        return e / e.sum(axis=axis, keepdims=True)
    return dict(T=lambda a: np.swapaxes(a, -1, -2), softmax=softmax, relu=lambda a: np.maximum(a, 0.0),
                keep=lambda n: np.r_[np.ones(n), 0.0])


def paper_layers(Z, P, Q, activation, slip, ops):
    """[A] eq. (4) with tokens as columns: Z <- Z + (1/n) sum_h P_h Z M sigma(Z^T Q_h Z), E[b, i, j] =
    z_i^T Q_h z_j with key i and output column j; softmax over the n context keys, softmax_all over all
    n+1 before M drops the query's value. Returns Z_L."""
    n = Z.shape[2] - 1
    L, H = P.shape[:2]
    keys = n + 1 if slip == "query-key" else n
    for l in range(L):
        update = 0
        for h in range(H):
            Q_h = ops["T"](Q[l, h]) if slip == "QT" else Q[l, h]
            E = ops["T"](Z) @ Q_h @ Z
            axis = 2 if slip == "softmax-axis" else 1          # the slip normalises over the output columns
            A = {"relu": lambda: ops["relu"](E[:, :keys]), "softmax": lambda: ops["softmax"](E[:, :keys], axis),
                 "softmax_all": lambda: ops["softmax"](E, axis)[:, :keys]}.get(activation, lambda: E[:, :keys])()
            if slip == "mask-outputs":                        # M applied to the output columns as well
                A = A * ops["keep"](n)
            P_h = ops["T"](P[l, h]) if slip == "head-1-PT" and h == 1 else P[l, h]
            update = update + P_h @ Z[:, :, :keys] @ A / (n + 1 if slip == "n+1" else n)
        Z = update if slip == "residual-2" and l == 1 else Z + update
    return Z


def von_oswald_layers(E, W, H, activation, slip, xp, softmax):
    """von Oswald et al.'s model, tokens as rows E (B, n+1, D), per layer W_q, W_k, W_v (D, H k) with
    heads as column blocks and W_o (H v, D): q = E W_q,h, k = E W_k,h, v = E W_v,h; A = q k^T over the
    n context rows (softmax: softmax(q k^T / sqrt(k)) over them), no 1/n; E <- E + concat_h(A v) W_o.
    Returns E_L."""
    B, N, D = E.shape
    n = N - 1
    for l in range(W[0].shape[0]):
        Wq, Wk, Wv, Wo = (w[l] for w in W)
        if slip == "swap":
            Wq, Wk = Wk, Wq
        if slip == "head-1-Wv-T" and H > 1:                   # head 1's value projection transposed (v = D here)
            v = Wv.shape[1] // H
            Wv = xp.concatenate([Wv[:, :v], Wv[:, v:2 * v].T, Wv[:, 2 * v:]], axis=1)
        q, k, v = (xp.reshape(E @ w, (B, N, H, -1)) for w in (Wq, Wk, Wv))
        s = xp.einsum("bthk,bshk->bhts", q, k[:, :n])          # query row t, key row s < n
        A = softmax(s / math.sqrt(q.shape[-1]), 2 if slip == "softmax-axis" else 3) if activation == "softmax" else s
        if slip == "mask-outputs":                            # the query row gets no update
            A = A * (xp.arange(N) < n)[:, None]
        update = xp.einsum("bhts,bshv->bthv", A, v[:, :n]).reshape(B, N, -1) @ Wo / (n if slip == "1/n" else 1)
        E = update if slip == "residual-2" and l == 1 else E + update
    return E


def numpy_model(layout, slip):
    """fn for check_implementation: a model in `layout` with `slip`, outputs without gradients."""
    def fn(case):
        if layout == "paper":
            Z_L = paper_layers(case["Z"], case["P"], case["Q"], case["activation"], slip, numpy_ops())
            y_hat, scale, name = -Z_L[:, -1, -1], 0.5 if slip == "half" else 1.0, "Z_L"
        else:
            W = [case[k] for k in ("W_q", "W_k", "W_v", "W_o")]
            Z_L = von_oswald_layers(case["Z_rows"], W, case["H"], case["activation"], slip, np, numpy_ops()["softmax"])
            y_hat, scale, name = -Z_L[:, -1, -1], 1.0 if slip == "no-half" else 0.5, "Z_L_rows"
        return {name: Z_L, "y_hat": y_hat, "loss": scale * np.mean((y_hat - case["y"]) ** 2)}
    return fn


def torch_model(slip):
    """fn for check_implementation: the paper-layout model in PyTorch, its gradients by autograd."""
    torch = framework("torch")
    ops = dict(T=lambda a: a.transpose(-1, -2), softmax=lambda a, axis: torch.softmax(a, dim=axis),
               relu=lambda a: a.clamp(min=0.0), keep=lambda n: torch.cat([torch.ones(n), torch.zeros(1)]).double())

    def fn(case):
        P, Q = (torch.tensor(case[k], requires_grad=True) for k in ("P", "Q"))
        Z_L = paper_layers(torch.tensor(case["Z"]), P, Q, case["activation"], slip, ops)
        y_hat = -Z_L[:, -1, -1]
        loss = ((y_hat - torch.tensor(case["y"])) ** 2).mean() * (0.5 if slip == "half" else 1.0)
        loss.backward()
        return dict(Z_L=Z_L.detach().numpy(), y_hat=y_hat.detach().numpy(), loss=loss.item(), dP=P.grad.numpy(),
                    dQ=Q.grad.numpy())
    return fn


def jax_model(slip):
    """fn for check_implementation: the von Oswald-layout model in JAX, their loss's gradients by autograd."""
    jax = framework("jax")
    jax.config.update("jax_enable_x64", True)
    names = ("W_q", "W_k", "W_v", "W_o")

    def loss_and_out(W, case):
        E = von_oswald_layers(jax.numpy.asarray(case["Z_rows"]), W, case["H"], case["activation"], slip, jax.numpy,
                              lambda a, axis: jax.nn.softmax(a, axis=axis))
        y_hat = -E[:, -1, -1]
        return (1.0 if slip == "no-half" else 0.5) * jax.numpy.mean((y_hat - case["y"]) ** 2), E

    def fn(case):
        W = [jax.numpy.asarray(case[k]) for k in names]
        (loss, E), grads = jax.value_and_grad(loss_and_out, has_aux=True)(W, case)
        return dict(Z_L_rows=np.asarray(E), y_hat=-np.asarray(E[:, -1, -1]), loss=float(loss),
                    **{f"grad_{k}": np.asarray(g) for k, g in zip(names, grads)})
    return fn


def backward_slip(case):
    """A hand-written backward pass that transposes head 1's dQ, on icl_ref's own forward outputs."""
    out = ic._case_outputs(case["P"], case["Q"], case["Z"], case["y"], case["activation"])
    if case["H"] > 1:
        out["dQ"] = out["dQ"].copy()
        out["dQ"][:, 1] = np.swapaxes(out["dQ"][:, 1], -1, -2)
    return out


# ---------------------------------------------------------------------------------------------
# The slips, and what each report must say
# ---------------------------------------------------------------------------------------------

# known: the name DIAGNOSIS_VARIANTS gives it in the layout; unknown: words that must locate it
PAPER_SLIPS = {"QT": ("known", "Q transposed"), "n+1": ("known", "1/(n+1) normalisation"),
               "query-key": ("known", "query used as a key and value"), "half": ("known", "loss with a factor 1/2"),
               "softmax-axis": ("unknown", ""), "mask-outputs": ("unknown", "only the query's column"),
               "residual-2": ("unknown", "layer 0 run alone agrees, with layer 1 it differs"),
               "head-1-PT": ("unknown", "only head 1 differs")}
VON_OSWALD_SLIPS = {"swap": ("known", "W_q and W_k swapped"), "1/n": ("known", "an extra 1/n"),
                    "no-half": ("known", "loss without their 0.5"), "softmax-axis": ("unknown", ""),
                    "mask-outputs": ("unknown", "only the query's row"),
                    "residual-2": ("unknown", "layer 0 run alone agrees, with layer 1 it differs"),
                    "head-1-Wv-T": ("unknown", "only head 1 differs")}


def difficulty(name):
    """The order the report promises, written out here anew: linear attention first, then fewer
    layers, fewer heads, smaller d and n, then the order of reference_cases()."""
    c = CASES[name]
    return c["activation"] != "linear", *c["P"].shape[:2], c["Z"].shape[1], c["Z"].shape[2], list(CASES).index(name)


def relative_error(mine, ref):
    return float(np.max(np.abs(np.asarray(mine, dtype=float) - ref)) / np.max(np.abs(ref)))


def cases_named(message, report):
    """The cases a report's case lines name, in its order: "  name [activation, L=, H=]: ...", "  a, b
    (2 cases): ..." for cases whose lines would repeat, "  all N cases: ..."."""
    named = []
    section = message.split("\nCases that differ, simplest first", 1)[1].split("\n")[1:]
    for line in (re.match(r"  (\S.*?): ", line).group(1) for line in section if line.startswith("  ")):
        if re.fullmatch(r"all \d+ cases", line):
            named += sorted(report["cases"], key=difficulty)
        elif " [" in line:
            named.append(line.split(" [")[0])
        else:
            named += re.sub(r" \(\d+ cases\)$", "", line).split(", ")
    return named


def named_slips(message):
    """The slips a report names as likely causes, in its order."""
    return re.findall(r"^- (.+?) \(reproduces", message, flags=re.M)


def check_report(fn, layout, slip, kind, words, outputs=None):
    """Run the check on fn, which makes `slip`, and hold its report to the promises above."""
    with pytest.raises(ic.Mismatch) as failure:
        ic.check_implementation(fn, layout=layout, outputs=outputs)
    message, report = str(failure.value), failure.value.report
    lines = message.splitlines()
    assert len(lines) <= ic.MAX_REPORT_LINES == 25, message
    # the cases that differ, measured here: only they are named, one line each, simplest first
    differ = {}
    for name in report["cases"]:
        c = CASES[name]
        inputs = {k: v.copy() for k, v in ic._expected(name, layout)[0].items()}
        given = fn(dict(inputs, activation=c["activation"], n=c["Z"].shape[2] - 1, L=c["P"].shape[0], H=c["P"].shape[1]))
        errors = {q: relative_error(given[q], ic._expected(name, layout)[1][q]) for q in report["outputs"]}
        if any(e > report["rtol"][q] for q, e in errors.items()):
            differ[name] = errors
    named = cases_named(message, report)
    assert named == sorted(differ, key=difficulty), message
    assert {n for n, c in report["cases"].items() if c["status"] == "failed"} == set(differ)
    if kind == "known":
        assert named_slips(message)[0] == words and ic.DIAGNOSIS_VARIANTS[layout][words][1] in message, message
        return message
    first = named[0]
    L, H = CASES[first]["P"].shape[:2]
    start = f"Start with {first} ({CASES[first]['activation']} attention, L = {L}, H = {H}), the simplest case"
    assert "known slip reproduces" in message and start in message and not named_slips(message), message
    for q, e in differ[first].items():                         # each output's size, as measured here
        if e > report["rtol"][q]:
            assert re.search(rf"^  {q}: relative error {re.escape(f'{e:.1e}')}", message, flags=re.M), (q, e, message)
    assert words in message, message
    return message


# ---------------------------------------------------------------------------------------------
# The reports
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["paper", "von_oswald"])
def test_the_models_without_a_slip_pass(layout):
    outputs = ("Z_L" if layout == "paper" else "Z_L_rows", "y_hat", "loss")
    ic.check_implementation(numpy_model(layout, None), layout=layout, outputs=outputs)


@pytest.mark.parametrize("slip", list(PAPER_SLIPS))
def test_paper_layout_slips_are_named_or_located(slip):
    check_report(numpy_model("paper", slip), "paper", slip, *PAPER_SLIPS[slip], outputs=("Z_L", "y_hat", "loss"))


@pytest.mark.parametrize("slip", list(VON_OSWALD_SLIPS))
def test_von_oswald_layout_slips_are_named_or_located(slip):
    check_report(numpy_model("von_oswald", slip), "von_oswald", slip, *VON_OSWALD_SLIPS[slip],
                 outputs=("Z_L_rows", "y_hat", "loss"))


def test_a_backward_slip_in_one_head_is_located_in_that_head():
    message = check_report(backward_slip, "paper", "dQ-head-1-T", "unknown", "only head 1 differs")
    assert "dQ: relative error" in message and "(layer 0, head 1); only head 1" in message, message
    assert "The forward pass and the loss agree" in message


@pytest.mark.parametrize("slip", [None, *PAPER_SLIPS])
def test_pytorch_paper_layout_slips_with_autograd_gradients(slip):
    fn = torch_model(slip)
    if slip is None:
        ic.check_implementation(fn)
    else:
        check_report(fn, "paper", slip, *PAPER_SLIPS[slip])


@pytest.mark.parametrize("slip", [None, *VON_OSWALD_SLIPS])
def test_jax_von_oswald_layout_slips_with_autograd_gradients(slip):
    fn = jax_model(slip)
    if slip is None:
        ic.check_implementation(fn, layout="von_oswald")
    else:
        check_report(fn, "von_oswald", slip, *VON_OSWALD_SLIPS[slip])


def test_the_report_fits_in_its_lines_however_much_differs():
    # every kind of line at once: five slips, each explaining the forward outputs of some cases, noise
    # in every gradient and in the simplest case's Z_L and y_hat, a NaN; the cases beyond the screen
    # are counted
    rng = np.random.default_rng(0)
    slips = ["Q transposed", "1/(n+1) normalisation", "no normalisation", "prediction sign flipped",
             "query used as a key and value"]
    outputs = {}
    for k, name in enumerate(sorted(CASES, key=difficulty)):
        slipped, ref = ic._slipped(name, "paper")[slips[k % len(slips)]], ic._expected(name, "paper")[1]
        noise = {q: ref[q] + rng.standard_normal(ref[q].shape) for q in ("Z_L", "y_hat", "dP", "dQ")}
        outputs[name] = dict(slipped, loss=np.nan if k == 5 else slipped["loss"], dP=noise["dP"], dQ=noise["dQ"],
                             **({"Z_L": noise["Z_L"], "y_hat": noise["y_hat"]} if k == 0 else {}))
    text, found = ic.diagnose(outputs)
    lines = text.splitlines()
    assert len(lines) == ic.MAX_REPORT_LINES and re.search(r"^  \.\.\. and \d+ more \(the full table\)$", text, flags=re.M)
    assert len(named_slips(text)) == 3 and "- and 2 other slips" in text and "malformed" in text, text
    assert "Start with small-full (linear attention" in text and "  Z_L: relative error" in text
    full, _ = ic.diagnose(outputs, full=True)
    table = full.split("\n\nFull table:\n")[1].splitlines()
    assert len(table) == len(CASES) * 5 and table[0].startswith("small-full [linear, L=1, H=1] Z_L: unexplained")
