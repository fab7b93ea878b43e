"""Tests for icl_check, the conformance kit (MATH.md §12-§13): the adapters to other code's layouts,
check_implementation, diagnose, the reference vectors and their command line, the package's version
and licence.

Every implementation checked here is written in this file from the papers' descriptions, apart from
icl_ref's code: a token-by-token paper layer, the authors' einsums, von Oswald et al.'s model; each
can make one named convention slip. Their gradients are central differences of their own loss.

Tolerances, each with its reason:
    EXACT   = 1e-12  relative: two float64 computations of the same exact quantity (rounding only)
    FD_RTOL = 1e-7   for gradients by five-point central differences at h = FD_H = 1e-4, relative to
                     the largest entry: truncation (h^4/30) f^(5) ~ 3e-18 f^(5) is negligible, rounding
                     is ~1.5 eps |f| / h ~ 3e-12 |f| with |f| / |grad| <= 3 on these cases (measured
                     worst 1.5e-10); an error in a term of the gradient is O(1) relative
"""
import functools
import hashlib
import math
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from numpy.testing import assert_allclose

import icl_check as ic
import icl_files
import icl_ref as ir
from test_icl_ref import _same, assert_grad_close, central_diff, random_params, small_problem

ROOT = os.path.dirname(os.path.abspath(__file__))
EXACT = 1e-12
FD_RTOL = 1e-7
FD_H = 1e-4
CASES = {c["name"]: c for c in ic.reference_cases()}          # built once for the module
GRADS = {"paper": ("dP", "dQ"), "authors": ("grad_allparam",),
         "von_oswald": ("grad_W_q", "grad_W_k", "grad_W_v", "grad_W_o")}


def fd_rtol(layout):
    """FD_RTOL for the gradients of `layout` (theirs come from central differences), the defaults else."""
    return {g: FD_RTOL for g in GRADS[layout]}


def numeric_grad(f, X, h=FD_H):
    """Five-point central differences of the scalar f at every entry of X."""
    G = np.zeros_like(X)
    for i in np.ndindex(X.shape):
        vals = []
        for k in (-2, -1, 1, 2):
            Xk = X.copy()
            Xk[i] += k * h
            vals.append(f(Xk))
        G[i] = (vals[0] - 8 * vals[1] + 8 * vals[2] - vals[3]) / (12 * h)
    return G


def softmax(s, axis=-1):
    e = np.exp(s - s.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


# ---------------------------------------------------------------------------------------------
# §12 Other code's layouts: the authors' code and von Oswald et al.
# ---------------------------------------------------------------------------------------------

ADAPTERS = {"tokens_as_rows", "tokens_as_columns", "params_from_authors", "params_to_authors", "grads_to_authors",
            "params_from_von_oswald", "grads_to_von_oswald", "VON_OSWALD_LOSS_SCALE"}



def authors_forward(allparam, Z_rows):
    """The authors' layer re-implemented from its published description (linear_transformer.py):
    tokens as rows, Attn = einsum('BNi,ij,BMj->BNM', Z, Q_full, Z), key = einsum('ij,BNj->BNi',
    P_full, Z), out = einsum('BNM,ML,BLi->BNi', Attn, A, key) / N, Z <- Z + sum over heads."""
    L, H, _, d, _ = allparam.shape
    N = Z_rows.shape[1] - 1
    A = np.eye(N + 1)
    A[N, N] = 0
    for l in range(L):
        residues = 0
        for h in range(H):
            P_full, Q_full = np.zeros((2, d + 1, d + 1))
            P_full[:d, :d], P_full[d, d] = allparam[l, h, 0], 1
            Q_full[:d, :d] = allparam[l, h, 1]
            Attn = np.einsum("BNi,ij,BMj->BNM", Z_rows, Q_full, Z_rows)
            key = np.einsum("ij,BNj->BNi", P_full, Z_rows)
            residues = residues + np.einsum("BNM,ML,BLi->BNi", Attn, A, key) / N
        Z_rows = Z_rows + residues
    return Z_rows


def von_oswald_stack(W_q, W_k, W_v, W_o, E, y, heads, layers, activation):
    """Their model with tokens as rows E (B, n+1, D): per layer (the same weights in every layer when
    2-d), q = E W_q, k = E W_k, v = E W_v split into heads, scores q_t . k_T over the n context keys
    T (softmax of scores / sqrt(key size) for "softmax", the raw scores otherwise, no 1/n), heads
    concatenated and projected by W_o, E <- E + out. Prediction -E[:, n, d]; loss 0.5 * mean."""
    B, N, D = E.shape
    n = N - 1
    for l in range(layers):
        Wq, Wk, Wv, Wo = (w if w.ndim == 2 else w[l] for w in (W_q, W_k, W_v, W_o))
        q, k, v = (np.reshape(E @ w, (B, N, heads, -1)) for w in (Wq, Wk, Wv))
        logits = np.einsum("bthk,bshk->bhts", q, k[:, :n])               # query t, context key s
        if activation == "softmax":
            logits = logits / math.sqrt(q.shape[-1])
            A = np.exp(logits - logits.max(axis=-1, keepdims=True))
            A /= A.sum(axis=-1, keepdims=True)
        else:
            A = logits
        out = np.einsum("bhts,bshv->bthv", A, v[:, :n]).reshape(B, N, -1) @ Wo
        E = E + out
    y_hat = -E[:, n, D - 1]
    return E, 0.5 * np.mean((y_hat - y) ** 2)


def test_authors_layout_adapter_agrees_and_needs_the_transpose():
    rng, Z, y = small_problem(seed=70, B=5, n=6)
    allparam = 0.5 * rng.standard_normal((3, 2, 2, 3, 3))
    Z_rows = ic.tokens_as_rows(Z)
    theirs = authors_forward(allparam, Z_rows)
    P, Q = ic.params_from_authors(allparam)
    ours = ir.forward(P, Q, ic.tokens_as_columns(Z_rows))
    assert_allclose(ic.tokens_as_rows(ours), theirs, rtol=0, atol=EXACT * np.max(np.abs(theirs)))
    wrong = ir.forward(P, Q.swapaxes(-1, -2), Z)               # Q_full taken as the paper's Q
    assert np.max(np.abs(ic.tokens_as_rows(wrong) - theirs)) > 1e-2 * np.max(np.abs(theirs))
    # their loss: mean (out[:, N, d] + y)^2, no 1/2; the gradient maps back through the adapter
    their_loss = lambda ap: np.mean((authors_forward(ap, Z_rows)[:, -1, -1] + y) ** 2)
    loss, dP, dQ = ir.loss_and_grad(P, Q, Z, y)
    assert loss == pytest.approx(their_loss(allparam), rel=EXACT)
    assert_grad_close(central_diff(their_loss, allparam), ic.grads_to_authors(dP, dQ))
    assert np.array_equal(ic.params_to_authors(P, Q), allparam)
    with pytest.raises(ValueError, match="authors' form"):
        ic.params_to_authors(*random_params(rng, 1, 1, 3))
    assert np.array_equal(ic.tokens_as_columns(ic.tokens_as_rows(Z)), Z)


def test_von_oswald_loss_is_half_of_ours():
    rng, Z, y = small_problem(seed=71)
    P, Q = random_params(rng, 2, 1, 3)
    half_mse = 0.5 * np.mean((-ir.forward_literal(P, Q, Z)[:, -1, -1] - y) ** 2)
    assert ic.VON_OSWALD_LOSS_SCALE * ir.in_context_loss(P, Q, Z, y) == pytest.approx(half_mse, rel=EXACT)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("activation", ["linear", "softmax"])
def test_von_oswald_adapter_agrees_with_an_independent_implementation(tied, activation):
    rng = np.random.default_rng(140 + tied + 2 * (activation == "softmax"))
    d, n, L, H, kq, kv = 3, 5, 2, 2, 3, 2
    D = d + 1
    Z, y = ir.sample_prompts(rng, 6, n, np.eye(d))
    lead = () if tied else (L,)
    W = [0.3 * rng.standard_normal(lead + s) for s in ((D, H * kq), (D, H * kq), (D, H * kv), (H * kv, D))]
    P, Q = ic.params_from_von_oswald(*W, n, heads=H, layers=L, activation=activation)
    E, loss = von_oswald_stack(*W, ic.tokens_as_rows(Z), y, H, L, activation)
    ours = ir.forward(P, Q, Z) if activation == "linear" else ir.forward_activation(P, Q, Z, "softmax")
    assert_allclose(ic.tokens_as_columns(E), ours, rtol=0, atol=EXACT * np.max(np.abs(ours)))
    if activation == "linear":
        l_ours, dP, dQ = ir.loss_and_grad(P, Q, Z, y)
    else:
        l_ours, dP, dQ = ir.loss_and_grad_activation(P, Q, Z, y, "softmax")
    assert loss == pytest.approx(ic.VON_OSWALD_LOSS_SCALE * l_ours, rel=EXACT)
    grads = ic.grads_to_von_oswald(dP, dQ, *W, n, heads=H, activation=activation)
    for i, (w, g) in enumerate(zip(W, grads)):
        def f(X, i=i):
            return von_oswald_stack(*[X if j == i else W[j] for j in range(4)], ic.tokens_as_rows(Z), y, H, L,
                                    activation)[1]
        assert g.shape == w.shape
        assert_grad_close(central_diff(f, w), g)
    # the mistakes the adapter prevents: no 1/n (P off by n) and W_q W_k^T for W_k W_q^T
    wrong = ir.forward(P / n, Q, Z) if activation == "linear" else ir.forward_activation(P / n, Q, Z, "softmax")
    assert np.max(np.abs(wrong - ours)) > 1e-3 * np.max(np.abs(ours))    # an O(1) change; rounding is 1e-15


def test_params_to_authors_refuses_parameters_not_of_their_form():
    P, Q = ic.params_from_authors(0.3 * np.ones((1, 1, 2, 2, 2)))
    for X, where in ((P, (0, 0, 2, 0)), (P, (0, 0, 0, 2)), (Q, (0, 0, 2, 0)), (Q, (0, 0, 0, 2))):
        bad = X.copy()
        bad[where] = 0.5
        with pytest.raises(ValueError, match="authors' form"):
            ic.params_to_authors(bad if X is P else P, bad if X is Q else Q)

def test_the_adapters_refuse_bad_input_by_name():
    with pytest.raises(ValueError, match="W_o must have shape"):          # list weights of a wrong shape
        ic.params_from_von_oswald([[1.0] * 3] * 3, [[1.0] * 3] * 3, [[1.0] * 3] * 3, [[1.0] * 2] * 3, 4, layers=1)
    with pytest.raises(ValueError, match="Z_rows"):
        ic.tokens_as_columns(np.ones((2, 3)))
    with pytest.raises(TypeError, match="Z_rows"):
        ic.tokens_as_columns([[["a"]]])
    with pytest.raises(ValueError, match="allparam"):
        ic.params_from_authors(np.ones((1, 1, 3, 2, 2)))


def test_the_adapters_work_under_a_strict_caller_and_leave_its_settings():
    # np.seterr(all="raise") in the caller changes no result: inputs of scale 1e-120 underflow inside
    rng, Z, y = small_problem(seed=190, B=30, n=6, d=2)
    tiny = 1e-120
    P, Q = random_params(rng, 2, 1, 2)
    allparam = rng.standard_normal((2, 1, 2, 2, 2))
    calls = {
        "tokens_as_columns": lambda: ic.tokens_as_columns(Z.transpose(0, 2, 1) * tiny),
        "tokens_as_rows": lambda: ic.tokens_as_rows(Z * tiny),
        "params_from_authors": lambda: ic.params_from_authors(allparam * tiny),
        "params_to_authors": lambda: ic.params_to_authors(*ic.params_from_authors(allparam * tiny)),
        "grads_to_authors": lambda: ic.grads_to_authors(P * tiny, Q),
        "params_from_von_oswald": lambda: ic.params_from_von_oswald(
            *(np.eye(3)[None] * tiny for _ in range(4)), 6),
        "grads_to_von_oswald": lambda: ic.grads_to_von_oswald(
            P[:1] * tiny, Q[:1], *(np.eye(3)[None] for _ in range(4)), 6),
    }
    assert set(calls) == ADAPTERS - {"VON_OSWALD_LOSS_SCALE"}
    with np.errstate(under="ignore"):
        expected = {name: call() for name, call in calls.items()}
    old = np.seterr(all="raise")
    try:
        for name, call in calls.items():
            assert _same(call(), expected[name]), name
            assert np.geterr() == dict(divide="raise", over="raise", under="raise", invalid="raise"), name
    finally:
        np.seterr(**old)



# ---------------------------------------------------------------------------------------------
# Three implementations, each in its own layout, each able to make one named slip
# ---------------------------------------------------------------------------------------------

def paper_model(P, Q, Z, y, activation, slip=None):
    """[A] eq. (3)-(4) with the attention matrix written out: token j gets (1/n) sum_h P_h sum_i z_i
    sigma(z_i^T Q_h z_j) over the context tokens i < n; y_hat = -Z_L[d, n], loss mean (y_hat - y)^2.
    Returns Z_L, y_hat, loss."""
    n = Z.shape[2] - 1
    if slip == "drop":
        Z, n = np.delete(Z, n - 1, axis=2), n - 1
    keys = {"query-key": list(range(n + 1)), "mask-last": list(range(n - 1))}.get(slip, list(range(n)))
    norm = {"n+1": n + 1, "none": 1}.get(slip, n)
    if slip == "softmax-keys":
        activation = {"softmax": "softmax_all", "softmax_all": "softmax"}[activation]
    pool = list(range(n + 1)) if activation == "softmax_all" else keys      # keys the weights run over
    in_keys = np.array([i in keys for i in pool])[:, None]                 # the mask on values
    for P_l, Q_l in zip(P, Q):
        new = Z.copy()
        for P_h, Q_h in zip(P_l, Q_l):
            s = np.einsum("bki,kl,blj->bij", Z[:, :, pool], Q_h.T if slip == "QT" else Q_h, Z)  # key i, token j
            w = {"relu": lambda: np.maximum(s, 0), "linear": lambda: s}.get(activation, lambda: softmax(s, 1))()
            new += P_h @ np.einsum("bki,bij->bkj", Z[:, :, pool], w * in_keys) / norm
        Z = new
    y_hat = Z[:, -1, -1] if slip == "sign" else -Z[:, -1, -1]
    return Z, y_hat, np.mean((y_hat - y) ** 2) * (0.5 if slip == "half" else 1.0)


def authors_model(allparam, Z_rows, y, slip=None, activation="linear"):
    """The authors' layer with tokens as rows (their linear_transformer.py, as published): per head
    Z_rows + sigma(Z_rows Q_full Z_rows^T) M (Z_rows P_full^T) / N, P_full = [[P_blk, 0], [0, 1]],
    Q_full = [[Q_blk, 0], [0, 0]], M dropping the query, sigma the identity or a softmax over all N+1
    keys ("softmax_all"); y_hat = -Z_L_rows[:, N, d], loss mean."""
    L, H, _, d, _ = allparam.shape
    if slip == "drop":
        Z_rows = np.delete(Z_rows, -2, axis=1)
    N = Z_rows.shape[1] - 1
    M = np.diag([1.0] * N + [1.0 if slip == "query-key" else 0.0])
    for l in range(L):
        out = 0
        for h in range(H):
            P_full, Q_full = np.zeros((2, d + 1, d + 1))
            P_full[:d, :d], P_full[d, d] = allparam[l, h, 0], 1
            Q_full[:d, :d] = allparam[l, h, 1].T if slip == "QT" else allparam[l, h, 1]
            S = Z_rows @ Q_full @ np.swapaxes(Z_rows, 1, 2)                  # query row t, key row s
            if activation == "softmax_all":
                keys = N if slip == "n-keys" else N + 1
                S = np.concatenate([softmax(S[..., :keys]), np.zeros_like(S[..., keys:])], axis=-1)
            out = out + S @ M @ (Z_rows @ P_full.T)
        Z_rows = Z_rows + out / {"n+1": N + 1}.get(slip, N)
    y_hat = -Z_rows[:, -1, -1]
    return Z_rows, y_hat, np.mean((y_hat - y) ** 2) * (0.5 if slip == "half" else 1.0)


def von_oswald_model(W, E, y, H, activation, slip=None):
    """von Oswald et al.'s model, tokens as rows E (B, n+1, D), per-layer weights W = (W_q, W_k, W_v,
    W_o): per head q = E W_q,h, k = E W_k,h, v = E W_v,h; A = q k^T over the n context rows (softmax:
    softmax(q k^T / sqrt(key size)) over them); E <- E + concat_h(A v) W_o, no 1/n. y_hat =
    -E[:, n, d]; loss 0.5 * mean (y_hat - y)^2."""
    B, N, D = E.shape
    n = N - 1
    keys = N if slip in ("query-key", "all-keys") else n
    for Wq, Wk, Wv, Wo in zip(*W):
        if slip == "swap":
            Wq, Wk = Wk, Wq
        q, k, v = (np.reshape(E @ w, (B, N, H, -1)) for w in (Wq, Wk, Wv))
        s = np.einsum("bthk,bshk->bhts", q, k[:, :keys])
        scale = {"no-sqrt": 1.0}.get(slip, 1.0 / np.sqrt(q.shape[-1])) if activation == "softmax" else \
            {"linear-sqrt": 1.0 / np.sqrt(q.shape[-1])}.get(slip, 1.0)
        A = softmax(scale * s) if activation == "softmax" else scale * s
        if slip == "all-keys":                       # normalised over n+1 keys, the query's value dropped
            A = A[..., :n]
        E = E + np.einsum("bhts,bshv->bthv", A, v[:, :A.shape[-1]]).reshape(B, N, -1) @ Wo \
            / {"1/n": n, "n+1": n + 1}.get(slip, 1)
    y_hat = E[:, n, D - 1] if slip == "sign" else -E[:, n, D - 1]
    return E, y_hat, {"no-half": 1.0, "half-twice": 0.25}.get(slip, 0.5) * np.mean((y_hat - y) ** 2)


def implementation(layout, slip=None, grads=True, raises=()):
    """fn for check_implementation: the layout's model above with `slip`, its gradients by central
    differences of its own loss (when grads), NotImplementedError for the activations in `raises`."""
    def fn(case):
        if case["activation"] in raises:
            raise NotImplementedError(f"no {case['activation']} attention")
        c = {k: np.asarray(v, dtype=float) if isinstance(v, np.ndarray) else v for k, v in case.items()}
        if layout == "paper":
            names, run = ("P", "Q"), lambda P, Q: paper_model(P, Q, c["Z"], c["y"], c["activation"], slip)
        elif layout == "authors":
            names, run = ("allparam",), lambda A: authors_model(A, c["Z_rows"], c["y"], slip, c["activation"])
        else:
            names = ("W_q", "W_k", "W_v", "W_o")
            run = lambda *W: von_oswald_model(W, c["Z_rows"], c["y"], c["H"], c["activation"], slip)
        Z_L, y_hat, loss = run(*(c[k] for k in names))
        out = {"Z_L" if layout == "paper" else "Z_L_rows": Z_L, "y_hat": y_hat, "loss": loss}
        for g, k in zip(GRADS[layout] if grads else (), names):
            out[g] = numeric_grad(lambda X, k=k: run(*(X if j == k else c[j] for j in names))[2], c[k])
        return out
    return fn


@functools.lru_cache(maxsize=None)
def correct_outputs(layout, name):
    """The correct implementation's outputs on one case, float64 (computed once: the differences are slow)."""
    inputs = dict(ic._expected(name, layout)[0], activation=CASES[name]["activation"],
                  n=CASES[name]["Z"].shape[2] - 1, L=CASES[name]["P"].shape[0], H=CASES[name]["P"].shape[1])
    return implementation(layout)(inputs)


def named_slips(message):
    """The slips a failure message names as likely causes."""
    return set(re.findall(r"^- (.+?) \(reproduces", message, flags=re.M))


# ---------------------------------------------------------------------------------------------
# check_implementation passes correct implementations and names each slip in their own layout
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["paper", "authors", "von_oswald"])
def test_check_implementation_passes_an_independent_implementation(layout):
    seen = []

    def fn(case):
        seen.append(case)
        name = next(k for k, c in CASES.items() if np.array_equal(c["y"], case["y"]))
        return correct_outputs(layout, name)
    report = ic.check_implementation(fn, layout=layout, rtol=fd_rtol(layout))
    names = {n for n, c in CASES.items() if layout in ic._case_layouts(c)}
    assert set(report["cases"]) == names and all(c["status"] == "passed" for c in report["cases"].values())
    assert {"authors": 5, "von_oswald": 9, "paper": 12}[layout] == len(names)
    assert report["outputs"] == tuple(ic.LAYOUTS[layout][1]) and report["icl_ref_version"] == ir.__version__
    for case in seen:                                  # the layout's inputs, in the dtype, and the sizes
        assert set(case) == set(ic.LAYOUTS[layout][0]) | {"activation", "n", "L", "H"}
        assert all(case[k].dtype == np.float64 for k in ic.LAYOUTS[layout][0])
    # the activations LAYOUTS documents for the layout are those of its cases
    assert set(ic.LAYOUTS[layout][2]) == {CASES[n]["activation"] for n in names}


VON_OSWALD_SLIPS = {"swap": "W_q and W_k swapped", "1/n": "an extra 1/n", "n+1": "1/(n+1) normalisation",
                    "no-half": "loss without their 0.5", "no-sqrt": "softmax without 1/sqrt(key size)",
                    "half-twice": "loss with 0.5 twice", "linear-sqrt": "linear attention divided by sqrt(key size)",
                    "all-keys": "softmax over n+1 keys", "query-key": "query used as a key and value",
                    "sign": "prediction sign flipped"}


@pytest.mark.parametrize("slip", list(VON_OSWALD_SLIPS))
def test_check_implementation_names_each_von_oswald_slip_in_their_terms(slip):
    # each slip fails the check and is the only cause named, with the advice of their layout (their
    # arrays' names, never the paper's Q or the authors' adapter); the forward outputs and the loss
    # show every one of these slips, so the gradients' differences are left out (outputs=)
    with pytest.raises(AssertionError) as failure:
        ic.check_implementation(implementation("von_oswald", slip, grads=False), layout="von_oswald",
                                outputs=("Z_L_rows", "y_hat", "loss"))
    message = str(failure.value)
    expected = VON_OSWALD_SLIPS[slip]
    assert "unexplained" not in message and named_slips(message) == {expected}, message
    advice = ic.DIAGNOSIS_VARIANTS["von_oswald"][expected][1]
    assert advice in message and "params_from_authors" not in message and "the paper's" not in message


def test_von_oswald_loss_slip_is_named_on_the_gradients_too():
    # the loss without their 0.5 doubles every grad_W_*: named there as well, not "compare Z"
    fn = implementation("von_oswald", "no-half")
    with pytest.raises(AssertionError) as failure:
        ic.check_implementation(fn, layout="von_oswald", cases="small-full", rtol=fd_rtol("von_oswald"))
    found = failure.value.report["cases"]["small-full"]["quantities"]
    assert {q for q, v in found.items() if v == "loss without their 0.5"} == {"loss", "grad_W_q", "grad_W_k", "grad_W_v",
                                                                              "grad_W_o"}
    assert "loss, grad_W_q, grad_W_k, grad_W_v, grad_W_o: loss without their 0.5" in str(failure.value)
    assert "agree: Z_L_rows, y_hat" in str(failure.value)


PAPER_SLIPS = {"QT": "Q transposed", "n+1": "1/(n+1) normalisation", "none": "no normalisation",
               "query-key": "query used as a key and value", "half": "loss with a factor 1/2",
               "sign": "prediction sign flipped", "drop": "last context example dropped",
               "mask-last": "last context example masked, 1/n kept",
               "softmax-keys": ("softmax over n+1 keys", "softmax over n keys")}


@pytest.mark.parametrize("slip", list(PAPER_SLIPS))
def test_check_implementation_fails_with_the_diagnosis_of_each_slip(slip):
    # dropping an example changes Z_L's shape: compared on y_hat and the loss; the slips that do not
    # apply to a case (the authors' softmax also sees the masked key; softmax keys without softmax)
    # are declined with NotImplementedError and named in skip=
    raises = {"mask-last": ("softmax_all",), "softmax-keys": ("linear", "relu")}.get(slip, ())
    skip = [n for n, c in CASES.items() if c["activation"] in raises] or ()
    expected = PAPER_SLIPS[slip]
    expected = {expected} if isinstance(expected, str) else set(expected)
    with pytest.raises(AssertionError) as failure:
        ic.check_implementation(implementation("paper", slip, grads=False, raises=raises), skip=skip,
                                outputs=("y_hat", "loss") if slip == "drop" else ("Z_L", "y_hat", "loss"))
    message = str(failure.value)
    assert "differs from icl_ref" in message and "unexplained" not in message, message
    assert named_slips(message) and named_slips(message) <= expected, message
    assert any(ic.DIAGNOSIS_VARIANTS["paper"][v][1] in message for v in named_slips(message))


AUTHORS_SLIPS = {"QT": "Q_code used as Q (not transposed)", "n+1": "1/(N+1) normalisation",
                 "half": "loss with a factor 1/2", "query-key": "query used as a key and value",
                 "drop": "last context example dropped", "n-keys": "softmax over the N context keys"}


@pytest.mark.parametrize("slip", list(AUTHORS_SLIPS))
def test_check_implementation_names_each_authors_slip_in_their_terms(slip):
    with pytest.raises(AssertionError) as failure:                    # the softmax slip: its case only
        ic.check_implementation(implementation("authors", slip, grads=False), layout="authors",
                                cases="authors-softmax" if slip == "n-keys" else None,
                                outputs=("y_hat", "loss") if slip == "drop" else ("Z_L_rows", "y_hat", "loss"))
    message = str(failure.value)
    assert "unexplained" not in message and named_slips(message) == {AUTHORS_SLIPS[slip]}, message
    assert ic.DIAGNOSIS_VARIANTS["authors"][AUTHORS_SLIPS[slip]][1] in message


def test_every_slip_of_every_layout_is_tested():
    tested = {"paper": {v for s in PAPER_SLIPS.values() for v in ((s,) if isinstance(s, str) else s)},
              "authors": set(AUTHORS_SLIPS.values()), "von_oswald": set(VON_OSWALD_SLIPS.values())}
    untested = {"paper": {"tokens as rows (Z_L transposed)"},               # test_diagnose_uses_gradients_and_refuses_bad_input
                "authors": {"no normalisation", "prediction sign flipped", "last context example masked, 1/N kept",
                            "Z_L_rows with tokens as columns"},             # the paper layout's slips, renamed
                "von_oswald": {"last context example dropped", "Z_L_rows with tokens as columns"}}
    for layout, slips in ic.DIAGNOSIS_VARIANTS.items():
        assert set(slips) == tested[layout] | untested[layout], layout
        assert all(s in ic._SLIPS for s, _ in slips.values())


# ---------------------------------------------------------------------------------------------
# Strict outputs, arguments, cases=, rtol=, skip=
# ---------------------------------------------------------------------------------------------

def replaced(**outputs):
    """fn returning the correct paper-layout outputs of each case with some replaced (a value, or a
    function of the correct output)."""
    def fn(case):
        name = next(k for k in CASES if np.array_equal(CASES[k]["y"], case["y"]))
        out = dict(correct_outputs("paper", name))
        for k, v in outputs.items():
            if v is None:
                out.pop(k)
            else:
                out[k] = v(out[k]) if callable(v) else v
        return out
    return fn


def test_check_implementation_requires_every_output_unless_outputs_names_a_subset():
    y_hat_only = lambda case: {"y_hat": correct_outputs("paper", "small-full")["y_hat"]}
    with pytest.raises(ValueError, match="case 'small-full': missing Z_L, loss, dP, dQ \\(outputs= names"):
        ic.check_implementation(y_hat_only, cases="small-full")
    report = ic.check_implementation(y_hat_only, cases="small-full", outputs="y_hat")
    assert report["cases"]["small-full"]["quantities"] == {"y_hat": "agrees"}
    with pytest.raises(ValueError, match="unknown logits"):
        ic.check_implementation(replaced(logits=1.0), cases="small-full", rtol=fd_rtol("paper"))
    for bad in ([1.0], None, "Z_L"):
        with pytest.raises(TypeError, match="fn must return a dict"):
            ic.check_implementation(lambda case, bad=bad: bad, cases="small-full")


@pytest.mark.parametrize("output, value, error, words", [
    ("loss", lambda x: str(float(x)), TypeError, "'loss' for case 'small-full' is not a numeric array \\(str: a string"),
    ("y_hat", lambda x: x + 1e-3j, TypeError, "'y_hat' .* complex"),
    ("dP", lambda x: x.astype(object), TypeError, "'dP' .* Python objects"),
    ("y_hat", lambda x: x[:, None], ValueError, "y_hat has shape \\(4, 1\\), expected \\(4,\\)"),
    ("Z_L", lambda x: x[:, :, :-1], ValueError, "Z_L has shape \\(4, 3, 3\\), expected \\(4, 3, 4\\)"),
], ids=["numeric-string", "complex", "objects", "y_hat-shape", "Z_L-shape"])
def test_check_implementation_refuses_malformed_outputs_by_name(output, value, error, words):
    # a complex output with a tiny imaginary part, a loss as a numeric string, objects, wrong shapes:
    # errors naming the case and the output, not numbers compared after a silent conversion
    with pytest.raises(error, match=words):
        ic.check_implementation(replaced(**{output: value}), cases="small-full", rtol=fd_rtol("paper"))


def test_check_implementation_names_non_finite_outputs_as_a_failure():
    with pytest.raises(AssertionError, match="dQ malformed: holds NaN or Inf"):
        ic.check_implementation(replaced(dQ=lambda x: x * np.nan), cases="small-full", rtol=fd_rtol("paper"))


def test_check_implementation_reports_what_it_cannot_run_as_skipped_never_passed():
    def linear_only(case):
        if case["activation"] != "linear":
            raise NotImplementedError(f"no {case['activation']}")
        return replaced()(case)
    with pytest.raises(AssertionError) as failure:
        ic.check_implementation(linear_only, cases=["small-full", "relu"], rtol=fd_rtol("paper"))
    assert "relu [relu, L=1, H=2]: FAILED (fn raised NotImplementedError: no relu; skip= does not name it)" in str(failure.value)
    report = ic.check_implementation(linear_only, cases=["small-full", "relu"], skip="relu", rtol=fd_rtol("paper"))
    assert {n: c["status"] for n, c in report["cases"].items()} == {"small-full": "passed", "relu": "skipped"}
    assert "Skipped: relu (NotImplementedError: no relu)" in report["text"]
    with pytest.raises(AssertionError, match="no reference case was checked"):
        ic.check_implementation(linear_only, cases="relu", skip="relu")


BAD_ARGUMENTS = [
    (dict(layout=["paper"]), TypeError, "layout must be one of the strings 'paper'"),
    (dict(layout="rows"), ValueError, "layout must be one of"),
    (dict(dtype=None), TypeError, "dtype must be np.float64 or np.float32, got None"),
    (dict(dtype=np.int64), ValueError, "dtype"), (dict(dtype="float16"), ValueError, "dtype"),
    (dict(dtype=[1]), TypeError, "dtype"),
    (dict(cases="no-such-case"), ValueError, "cases must name one or more of small-full"),
    (dict(cases=3), TypeError, "cases must be a name or a list of names"),
    (dict(cases=[]), ValueError, "cases must name"),
    (dict(layout="authors", cases="relu"), ValueError, "cases must name one or more of"),
    (dict(outputs=("y_hat", "W_q")), ValueError, "outputs must name"),
    (dict(skip=["nope"]), ValueError, "skip must name"),
    (dict(rtol=-1.0), ValueError, "rtol must be finite and >= 0"), (dict(rtol="1e-6"), TypeError, "rtol"),
    (dict(rtol={"Z_L": "big"}), TypeError, "rtol\\['Z_L'\\]"), (dict(rtol={"grad_W_q": 1.0}), ValueError, "rtol's keys"),
]


@pytest.mark.parametrize("kwargs, error, words", BAD_ARGUMENTS,
                         ids=[", ".join(f"{k}={v!r}" for k, v in kw.items()) for kw, _, _ in BAD_ARGUMENTS])
def test_check_implementation_refuses_bad_arguments_by_name(kwargs, error, words):
    called = []
    with pytest.raises(error, match=words):
        ic.check_implementation(lambda case: called.append(case), **kwargs)
    assert not called                                 # refused before any work
    with pytest.raises(TypeError, match="fn must be callable"):
        ic.check_implementation(None)


def test_check_implementation_checks_the_named_cases_at_the_given_rtol():
    calls = []
    fn = replaced(Z_L=lambda x: x + 1e-11 * np.max(np.abs(x)))   # outside float64's forward rtol (1e-12)

    def counted(case):
        calls.append(case["n"])
        return fn(case)
    with pytest.raises(ic.Mismatch, match="No known slip reproduces 1 mismatch") as failure:
        ic.check_implementation(counted, cases="small-full", rtol=fd_rtol("paper"))
    assert failure.value.report["cases"]["small-full"]["quantities"]["Z_L"] == "unexplained"
    assert calls == [3]                                          # that case only (n = 3)
    report = ic.check_implementation(fn, cases=["small-full", "two-layers-two-heads"],
                                     rtol={"Z_L": 1e-10, **fd_rtol("paper")})
    assert list(report["cases"]) == ["small-full", "two-layers-two-heads"]
    assert report["rtol"] == {"Z_L": 1e-10, "y_hat": 1e-12, "loss": 1e-12, "dP": FD_RTOL, "dQ": FD_RTOL}
    # the documented defaults per output name, one number for all
    defaults = ic.check_implementation(fn, cases="small-full", outputs=("y_hat", "loss"))["rtol"]
    assert defaults == {"y_hat": ic.CHECK_TOLERANCES["float64"]["forward"], "loss": ic.CHECK_TOLERANCES["float64"]["loss"]}
    vo = ic.check_implementation(lambda c: dict(Z_L_rows=correct_outputs("von_oswald", "small-full")["Z_L_rows"]),
                                 layout="von_oswald", dtype=np.float32, cases="small-full", outputs="Z_L_rows")
    assert vo["rtol"] == {"Z_L_rows": ic.CHECK_TOLERANCES["float32"]["forward"]}
    assert ic.check_implementation(fn, cases="small-full", rtol=1e-6)["rtol"] == dict.fromkeys(ic.LAYOUTS["paper"][1], 1e-6)


def test_check_implementation_in_float32_allows_float32_rounding_and_no_more():
    # the model computing in float64 on the float32 inputs: at float32's tolerances it passes, at
    # float64's it fails (the inputs' rounding, ~6e-8 relative, moves the outputs by about as much)
    fn = implementation("paper")
    cases = ["small-full", "softmax"]
    ic.check_implementation(fn, dtype=np.float32, cases=cases)
    with pytest.raises(AssertionError, match="float32's rounding: does the model compute in float32"):
        ic.check_implementation(lambda case: fn({k: v.astype(np.float32) if isinstance(v, np.ndarray) else v
                                                 for k, v in case.items()}), cases=cases, rtol=fd_rtol("paper"))
    with pytest.raises(AssertionError, match="dP 1.0e-03 \\(1.001 x icl_ref's everywhere\\)"):   # fails float32's 1e-4
        ic.check_implementation(lambda case: dict(fn(case), dP=fn(case)["dP"] * (1 + 1e-3)), dtype=np.float32,
                                cases="small-full")


def test_reference_data_are_computed_once_and_cannot_be_changed_by_fn():
    # fn may scribble over its inputs: they are copies; reference_cases() hands out copies too. A
    # second check takes only the comparison's time: under 0.2 s of this process's CPU time (~0.02 s
    # measured; CPU time, as other processes on a loaded machine stretch the wall-clock time)
    def vandal(case):
        out = replaced()(case)
        for v in case.values():
            if isinstance(v, np.ndarray):
                v[...] = 7.0
        return out
    ic.check_implementation(vandal, rtol=fd_rtol("paper"))
    ic.reference_cases()[0]["Z"][...] = 7.0
    outputs = {n: correct_outputs("paper", n) for n in CASES}
    fast = lambda case: outputs[next(k for k in CASES if np.array_equal(CASES[k]["y"], case["y"]))]
    ic.check_implementation(fast, rtol=fd_rtol("paper"))
    timings = []
    for _ in range(3):
        start = time.process_time()
        ic.check_implementation(fast, rtol=fd_rtol("paper"))
        timings.append(time.process_time() - start)
    assert min(timings) < 0.2, timings
    assert np.array_equal(ic.reference_cases()[0]["Z"], CASES["small-full"]["Z"])


PYTEST_FILE = '''
import pytest, numpy as np, icl_check as ic
import test_icl_check as tc

@pytest.mark.parametrize("case", [c["name"] for c in ic.reference_cases() if "paper" in c["layouts"]])
def test_one_case(case):
    ic.check_implementation(tc.implementation("paper", "{slip}", grads=False), cases=case,
                            outputs=("Z_L", "y_hat", "loss"))
'''


@pytest.mark.slow
@pytest.mark.mutants
def test_one_pytest_test_per_case_with_ids_and_short_failures(tmp_path, capsys, monkeypatch):
    # the use README shows: one test per case (ids the case names); a failure shows the diagnosis, at
    # most MAX_REPORT_LINES lines, not icl_check's frames. pytest runs in this process (its reference
    # data already built): once with a correct implementation, once with a slip
    monkeypatch.chdir(tmp_path)
    for slip, code in (("None", 0), ('"n+1"', 1)):
        (tmp_path / "test_user.py").write_text(PYTEST_FILE.replace('"{slip}"', slip))
        sys.modules.pop("test_user", None)
        assert pytest.main(["-q", "-p", "no:cacheprovider", "-rA", "--rootdir", str(tmp_path), "-o", "addopts=",
                            "test_user.py"]) == code
        out = capsys.readouterr().out
        if code == 0:
            assert "12 passed" in out and "PASSED test_user.py::test_one_case[softmax_all]" in out, out
    assert "FAILED test_user.py::test_one_case[small-full]" in out and "PASSED test_user.py::test_one_case[relu]" not in out
    assert "- 1/(n+1) normalisation (reproduces" in out, out
    assert "icl_check.py:" not in out and "_judge" not in out, out        # icl_check's frames hidden
    failures = re.split(r"^_+ test_one_case\[", out, flags=re.M)[1:]
    assert len(failures) == len(CASES) and all(
        len(re.findall(r"^E ", f, flags=re.M)) <= ic.MAX_REPORT_LINES for f in failures), out


def test_help_and_layouts_document_what_an_implementer_needs():
    doc = " ".join(ic.check_implementation.__doc__.split())      # the text, whatever its line breaks
    for layout, (inputs, outputs, activations, scores) in ic.LAYOUTS.items():
        assert f"'{layout}': activations {', '.join(activations)}; {scores}" in doc
        for k, v in {**inputs, **outputs}.items():
            assert f"{k}: {v}" in doc
    assert "-Z_L_rows[:, n, d]" in ic.LAYOUTS["von_oswald"][1]["y_hat"]
    assert "key size k = value size v = d+1" in ic.LAYOUTS["von_oswald"][3] and "sqrt(k)" in ic.LAYOUTS["von_oswald"][3]
    assert "0.5 * mean" in ic.LAYOUTS["von_oswald"][1]["loss"] and "no factor 1/2" in ic.LAYOUTS["paper"][1]["loss"]


# ---------------------------------------------------------------------------------------------
# diagnose: user-supplied arrays
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("slip", [None, *PAPER_SLIPS], ids=str)
def test_diagnose_names_each_known_slip_of_an_independent_implementation(slip):
    cases = [c for c in CASES.values() if not (slip == "mask-last" and c["activation"] == "softmax_all")
             and not (slip == "softmax-keys" and not c["activation"].startswith("softmax"))]
    outputs = {}
    for c in cases:
        Z_L, y_hat, loss = paper_model(c["P"], c["Q"], c["Z"], c["y"], c["activation"], slip)
        outputs[c["name"]] = dict(y_hat=y_hat, loss=loss, **({} if slip == "drop" else {"Z_L": Z_L}))
    report, found = ic.diagnose(outputs)
    verdicts = {v for fs in found.values() for v in fs.values()}
    if slip is None:
        assert verdicts == {"agrees"} and "Everything agrees" in report
        return
    expected = PAPER_SLIPS[slip]
    expected = {expected} if isinstance(expected, str) else set(expected)
    assert verdicts - {"agrees"} <= expected, report            # every mismatch is explained by the slip
    assert verdicts & expected, report                          # and the slip shows somewhere
    assert any(ic.DIAGNOSIS_VARIANTS["paper"][v][1] in report for v in expected)


def test_diagnose_counts_a_case_that_differs_in_one_output_only():
    # the headline "k of N cases differ" counts every case with any output that does not agree: here one
    # case whose gradient dQ alone is off (twice icl_ref's), one that agrees in every output
    bad, good = correct_outputs("paper", "small-full"), correct_outputs("paper", "two-layers-two-heads")
    outputs = {"small-full": dict(bad, dQ=2 * bad["dQ"]), "two-layers-two-heads": good}
    report, found = ic.diagnose(outputs)
    assert found["small-full"]["dQ"] != "agrees" and set(found["two-layers-two-heads"].values()) == {"agrees"}
    assert sum(v == "agrees" for v in found["small-full"].values()) == len(found["small-full"]) - 1
    assert report.startswith("1 of 2 cases differ from icl_ref"), report


def test_diagnose_in_the_von_oswald_layout():
    name = "two-layers-two-heads"
    inputs = ic._expected(name, "von_oswald")[0]
    W = [inputs[k] for k in ("W_q", "W_k", "W_v", "W_o")]
    E, y_hat, loss = von_oswald_model(W, inputs["Z_rows"], inputs["y"], 2, "linear", "1/n")
    report, found = ic.diagnose({name: {"Z_L_rows": E, "loss": loss}}, layout="von_oswald")
    assert found[name] == {"Z_L_rows": "an extra 1/n", "loss": "an extra 1/n"}, report
    with pytest.raises(ValueError, match="outputs\\['two-layers-two-heads'\\]"):
        ic.diagnose({name: {"Z_L": E}}, layout="von_oswald")
    with pytest.raises(TypeError, match="layout"):
        ic.diagnose({name: {"Z_L_rows": E}}, layout=("von_oswald",))


def test_diagnose_uses_gradients_and_refuses_bad_input():
    c = CASES["small-full"]                                      # 18 parameters
    P, Q, Z, y = c["P"], c["Q"], c["Z"], c["y"]
    dQ = numeric_grad(lambda X: paper_model(P, X, Z, y, "linear", "QT")[2], Q)
    report, found = ic.diagnose({"small-full": {"dQ": dQ}})
    assert found["small-full"]["dQ"] == "Q transposed", report
    dP = numeric_grad(lambda X: paper_model(X, Q, Z, y, "linear", "n+1")[2], P)
    assert ic.diagnose({"small-full": {"dP": dP}})[1]["small-full"]["dP"] == "1/(n+1) normalisation"
    ref = correct_outputs("paper", "small-full")
    report, found = ic.diagnose({"small-full": {"y_hat": ref["y_hat"][:, None], "dP": ref["dP"] * np.nan,
                                                "dQ": None, "loss": "0.5", "Z_L": ref["Z_L"] + 0j}})
    assert found["small-full"] == {"y_hat": "malformed: shape (4, 1), expected (4,)",
                                   "dP": "malformed: holds NaN or Inf", "dQ": "malformed: missing (None)",
                                   "loss": "malformed: not a numeric array (str: a string is not a number)",
                                   "Z_L": "malformed: not a numeric array (dtype complex128: complex; give real numbers)"}
    assert "fix them before comparing" in report and "Everything agrees" not in report
    # Z_L with tokens as rows is the layout slip, whether or not its shape tells it apart
    for case in ("small-full", "two-layers-two-heads"):
        c = CASES[case]
        rows = np.swapaxes(paper_model(c["P"], c["Q"], c["Z"], c["y"], "linear")[0], 1, 2)
        assert ic.diagnose({case: {"Z_L": rows}})[1][case]["Z_L"] == "tokens as rows (Z_L transposed)"
    for bad, error, words in (({"no-such-case": {"loss": 1.0}}, ValueError, "outputs' cases must name"),
                              ({}, ValueError, "outputs is empty"), ({"small-full": {}}, ValueError, "holds no arrays"),
                              ({"small-full": {"logits": 1.0}}, ValueError, "outputs\\['small-full'\\]"),
                              ([1, 2], TypeError, "outputs")):
        with pytest.raises(error, match=words):
            ic.diagnose(bad)


def test_diagnose_default_tolerance_and_order_of_causes():
    ref = correct_outputs("paper", "small-full")
    # the default rtol is 1e-6 of the largest entry: 1e-7 off agrees, 1e-5 off does not
    for off, verdict in ((1e-7, "agrees"), (1e-5, "unexplained")):
        bumped = ref["Z_L"] + off * np.max(np.abs(ref["Z_L"]))
        assert ic.diagnose({"small-full": {"Z_L": bumped}})[1]["small-full"]["Z_L"] == verdict
    # likely causes, most frequent first: Q transposed (3 mismatches) before the sign (1)
    c, c2 = CASES["small-full"], CASES["two-layers-two-heads"]
    QT = paper_model(c["P"], c["Q"], c["Z"], c["y"], "linear", "QT")
    sign = paper_model(c2["P"], c2["Q"], c2["Z"], c2["y"], "linear", "sign")
    report, _ = ic.diagnose({"small-full": dict(Z_L=QT[0], y_hat=QT[1], loss=QT[2]), c2["name"]: dict(y_hat=sign[1])})
    causes = [line for line in report.splitlines() if line.startswith("- ")]
    assert causes[0].startswith("- Q transposed (reproduces 3") and causes[1].startswith("- prediction sign flipped (reproduces 1")


def test_reference_cases_are_what_their_names_claim():
    c = CASES["theorem1-optimum"]                            # Theorem 1's optimum for its own Sigma and n
    n = c["Z"].shape[2] - 1
    assert_allclose(-c["Q"][0, 0, :-1, :-1], ir.gamma_star(c["Sigma"], n), rtol=EXACT, atol=0)
    c = CASES["sparse-family-optimum"]                       # Theorem 3's optimum for its own L, n, d:
    L, n, d = c["P"].shape[0], c["Z"].shape[2] - 1, c["Z"].shape[1] - 1   # one descent from its scalars
    a_case = np.array([ir.fitted_scalar(-Q_l[0, :-1, :-1], np.linalg.inv(c["Sigma"])) for Q_l in c["Q"]])
    a_star = ir.family_local_minimum(a_case, n, d)[0]        # stays put (another n's would move)
    assert_allclose(c["Sigma_w"], np.linalg.inv(c["Sigma"]), rtol=EXACT, atol=EXACT)
    A = -c["Q"][:, 0, :-1, :-1]
    # L-BFGS-B may stop on ftol = 1e-15 (a relative decrease) before gtol, which fixes a minimiser only to
    # about sqrt(2 ftol f / lambda_min) = 1.3e-7 relative here (f = 0.17, the family loss's Hessian from
    # lambda_min = 0.34, smallest a 0.33); two descents' points differ by up to that (1.7e-9 seen with
    # scipy 1.11 on an AVX2 machine, 0 elsewhere)
    assert_allclose(A, a_star[:, None, None] * np.linalg.inv(c["Sigma"]), rtol=2e-7, atol=0)
    for case in CASES.values():                              # the data were drawn with the covariances stated
        assert case["Sigma"].shape == (case["Z"].shape[1] - 1,) * 2
    # the query-as-key case: using the query as a key changes the answer by O(1)
    c = CASES["query-as-key"]
    wrong = paper_model(c["P"], c["Q"], c["Z"], c["y"], "linear", "query-key")[1]
    right = paper_model(c["P"], c["Q"], c["Z"], c["y"], "linear")[1]
    assert np.max(np.abs(wrong - right)) > 0.1 * np.max(np.abs(right))


# ---------------------------------------------------------------------------------------------
# The reference vectors and the command line
# ---------------------------------------------------------------------------------------------

def cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "icl_check", *args], capture_output=True, text=True, cwd=cwd)


def snapshot(path):
    """{name: bytes} of every file under path, links as ("link", target)."""
    out = {}
    for dirpath, dirs, files in os.walk(path):
        for f in dirs + files:
            p = os.path.join(dirpath, f)
            if os.path.islink(p):
                out[os.path.relpath(p, path)] = ("link", os.readlink(p))
            elif os.path.isfile(p):
                with open(p, "rb") as fh:
                    out[os.path.relpath(p, path)] = fh.read()
    return out


def test_reference_vectors_are_reproducible_documented_and_right(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    ic.write_reference_vectors(a)
    proc = cli("vectors", "--out", str(b))
    assert proc.returncode == 0, proc.stderr
    assert snapshot(a) == snapshot(b)                                  # the same bytes on every run
    manifest = json.loads((a / "manifest.json").read_text())
    assert manifest["format_version"] == ic.VECTORS_FORMAT and manifest["tolerances"]
    assert manifest["icl_ref_version"] == ir.__version__ and manifest["format"] == "icl_ref reference vectors"
    assert {c["name"] for c in manifest["cases"]} == set(CASES)
    for c in manifest["cases"]:
        data = np.load(a / c["file"])
        assert set(data.files) == set(c["arrays"])
        for k, meta in c["arrays"].items():
            assert list(data[k].shape) == meta["shape"] and meta["meaning"]
        Z, y, P = data["Z"], data["y"], data["P"]
        assert (c["B"], c["d"], c["n"], c["L"], c["H"]) == (Z.shape[0], Z.shape[1] - 1, Z.shape[2] - 1, *P.shape[:2])
        assert ("von_oswald" in c["layouts"]) == (c["activation"] in ("linear", "softmax"))
        assert ("authors" in c["layouts"]) == (c["activation"] in ("linear", "softmax_all")
                                              and c["structure"] in ("sparse", "blocks"))
        # the stored outputs against the independent models in every layout
        Z_L, y_hat, loss = paper_model(P, data["Q"], Z, y, c["activation"])
        assert_allclose(data["Z_L"], Z_L, rtol=0, atol=EXACT * np.max(np.abs(Z_L)))
        assert float(data["loss"]) == pytest.approx(loss, rel=EXACT)
        if "authors" in c["layouts"]:
            assert_allclose(data["allparam"][:, :, 1], np.swapaxes(data["Q"][:, :, :-1, :-1], -1, -2), rtol=0, atol=0)
            rows = authors_model(data["allparam"], data["Z_rows"], y, activation=c["activation"])[0]
            assert_allclose(rows, np.swapaxes(Z_L, 1, 2), rtol=0, atol=EXACT * np.max(np.abs(Z_L)))
        if "von_oswald" in c["layouts"]:
            W = [data[k] for k in ("W_q", "W_k", "W_v", "W_o")]
            E, _, vo_loss = von_oswald_model(W, data["Z_rows"], y, c["H"], c["activation"])
            assert_allclose(E, np.swapaxes(Z_L, 1, 2), rtol=0, atol=EXACT * np.max(np.abs(Z_L)))
            assert vo_loss == pytest.approx(0.5 * loss, rel=EXACT)


@pytest.mark.slow
@pytest.mark.mutants
def test_reference_vectors_refuse_a_directory_with_other_files_and_replace_only_their_own(tmp_path, capsys):
    # the refusals (the command line's in its own process: exit 2, its usage and a message naming its
    # flag, no traceback), each leaving every byte under tmp_path as it was: the user's file a link
    # points to included
    out = tmp_path / "v"
    ic.write_reference_vectors(out)
    first = snapshot(out)
    assert sorted(first) == sorted([f"{n}.npz" for n in CASES] + ["manifest.json"])     # no record, no lock left
    refused = cli("vectors", "--out", str(out))                        # no silent overwrite
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.startswith("usage: python3 -m icl_check vectors") and "pass --overwrite" in refused.stderr
    assert "overwrite=True" not in refused.stderr
    ic.write_reference_vectors(out, overwrite=True)                    # an earlier set of ours: replaced
    assert snapshot(out) == first
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_bytes(b"the user's own file")
    changes = {
        "a foreign file": (lambda: (out / "notes.md").write_text("mine"), "notes.md' was not written by"),
        "a listed file changed": (lambda: (out / "small-full.npz").write_bytes(b"my own file"),
                                  "small-full.npz' is not the file icl_check vectors wrote"),
        "another program's manifest": (lambda: (out / "manifest.json").write_text(json.dumps(
            dict(json.loads((out / "manifest.json").read_text()), format="my vectors"))), "no record written by"),
        "a listed file a link": (lambda: ((out / "relu.npz").unlink(), (out / "relu.npz").symlink_to(elsewhere)),
                                 "relu.npz' is a symbolic link"),
        "the manifest a link": (lambda: ((out / "manifest.json").unlink(),
                                         (out / "manifest.json").symlink_to(elsewhere)), "manifest.json is a symbolic link"),
        "a manifest nested deeper than Python's recursion limit": (
            lambda: (out / "manifest.json").write_text("[" * 200_000 + "]" * 200_000), "no record written by"),
    }
    for what, (change, words) in changes.items():
        shutil.rmtree(out)
        ic.write_reference_vectors(out)
        change()
        before = snapshot(tmp_path)
        if what == "a foreign file":                          # the command line's own refusal
            with pytest.raises(SystemExit) as done:
                ic._main(["vectors", "--out", str(out), "--overwrite"])
            assert done.value.code == 2 and words in capsys.readouterr().err
        else:
            with pytest.raises(ValueError, match=re.escape(words)):
                ic.write_reference_vectors(out, overwrite=True)
        assert snapshot(tmp_path) == before, what


# The reference vectors' values, pinned across versions and machines. Their bytes are not: the same
# code writes different bytes under different BLAS kernels (OpenBLAS's Haswell, Sandybridge, Nehalem
# and Katmai kernels give four different sets of SHA-256s on one machine, OPENBLAS_CORETYPE), so a
# SHA-256 pins a machine, not the vectors. Each fingerprint below hashes every array of a case scaled
# by its largest entry and written with 9 decimals (4 for the family optimum, which SciPy's L-BFGS-B
# reaches to ~1e-8 relative, differently across SciPy versions and BLAS kernels: at 6 decimals an entry
# 2e-10 from a rounding edge flipped under OpenBLAS's AVX-512 kernels; at 4 the entries the search moves
# lie at least 4e-7 from an edge, 40 times its error, and the data's 2e-7); far coarser than rounding
# (~1e-16 relative), far finer than any slip in a case (a transpose, a dropped term, 1/n for 1/(n+1)). They are
# those of the vectors 0.4.0 writes, which were byte-identical to 0.3.0's on the machine where both ran
# (the test of 0.4.0's move, with 0.3.0's SHA-256s, CHANGELOG 0.4.0); the same fingerprints came out
# under the four kernels above, numpy 1.25.0 / scipy 1.11.1, numpy 2.3.5 / scipy 1.16.3 and numpy 2.4.6
# / scipy 1.17.1.
FINGERPRINT_DIGITS = {"sparse-family-optimum": 4}
VECTOR_FINGERPRINTS = {
    "authors-softmax": "3f8118a0c1a54e34",
    "blocks": "0a0238c30954f495",
    "large-d": "df4e5084fa7cbf67",
    "non-symmetric-sparse": "c399c169e76b240a",
    "query-as-key": "a97f152a37a843c2",
    "relu": "031b2bc65142e178",
    "small-full": "0a8d6442d3148284",
    "softmax": "f19a2dd4b9da77ea",
    "softmax_all": "4dc62e9a8b356152",
    "sparse-family-optimum": "374da3f05706cee0",
    "theorem1-optimum": "bc9b0536686a43eb",
    "two-layers-two-heads": "a04a9c6ba784718b",
}


def vector_fingerprint(path, digits):
    """The SHA-256 of a case's arrays in sorted order, each scaled by its largest |entry| and written
    with `digits` decimals (-0 written as 0): equal for vectors that differ only by rounding."""
    h = hashlib.sha256()
    with np.load(path, allow_pickle=False) as z:
        for key in sorted(z.files):
            x = np.asarray(z[key], dtype=np.float64)
            scale = float(np.max(np.abs(x))) if x.size else 0.0
            cells = np.char.mod(f"%.{digits}f", x / scale if scale else x).ravel()
            cells[cells == "-0." + "0" * digits] = "0." + "0" * digits
            h.update(f"{key}{x.shape}{','.join(cells)}".encode())
    return h.hexdigest()[:16]


def test_reference_vectors_are_0_3_0s_values_on_any_machine(tmp_path):
    ic.write_reference_vectors(tmp_path)
    written = {n: vector_fingerprint(tmp_path / f"{n}.npz", FINGERPRINT_DIGITS.get(n, 9)) for n in VECTOR_FINGERPRINTS}
    assert written == VECTOR_FINGERPRINTS
    # the manifest lists each case once, with the SHA-256 of the bytes written on this machine
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert {c["name"]: c["sha256"] for c in manifest["cases"]} == {
        n: hashlib.sha256((tmp_path / f"{n}.npz").read_bytes()).hexdigest() for n in VECTOR_FINGERPRINTS}


def vectors_cli(out, *flags, **kwargs):
    """python3 -m icl_check vectors --out OUT [flags], in its own process, no byte-code written."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, "-m", "icl_check", "vectors", "--out", str(out), *flags],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=120, **kwargs)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_vectors_written_whole_when_stdout_cannot_take_the_last_line(tmp_path):
    # `| true` or `> /dev/full`: the vectors are written before the line that says so; no traceback,
    # status 0 (it was a BrokenPipe/OSError traceback and status 1 after writing all 13 files)
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "icl_check", "vectors", "--out", str(tmp_path / "v")], stdout=full,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env, timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert json.loads((tmp_path / "v" / "manifest.json").read_text())["cases"]


@pytest.mark.slow
@pytest.mark.mutants
@pytest.mark.parametrize("overwrite", [False, True])
def test_vectors_a_fifo_named_manifest_json_never_blocks(tmp_path, overwrite):
    # a reader would wait forever for a writer to open the FIFO: it is seen (lstat), never opened
    out = tmp_path / "v"
    out.mkdir()
    os.mkfifo(out / "manifest.json")
    proc = vectors_cli(out, *(["--overwrite"] if overwrite else []))     # timeout=120: a hang fails the test
    assert proc.returncode == 2 and "usage: python3 -m icl_check vectors" in proc.stderr
    assert ("manifest.json is a FIFO" if overwrite else "not empty") in proc.stderr, proc.stderr
    assert sorted(os.listdir(out)) == ["manifest.json"]


@pytest.mark.slow
@pytest.mark.mutants
@pytest.mark.parametrize("spelling", ["LINK", "LINK/", "LINK/."])
def test_vectors_never_write_into_a_folder_named_by_a_link(tmp_path, spelling):
    out, link = tmp_path / "v", tmp_path / "LINK"
    ic.write_reference_vectors(out)
    link.symlink_to(out, target_is_directory=True)
    before = snapshot(tmp_path)
    proc = vectors_cli(spelling.replace("LINK", str(link)), "--overwrite")
    assert proc.returncode == 2 and "is a symbolic link: not writing through it" in proc.stderr, proc.stderr
    assert snapshot(tmp_path) == before


def test_vectors_never_write_through_a_link_planted_while_they_write(tmp_path, monkeypatch):
    # a link that appears after the folder was checked (another process racing this one) is not
    # followed: the run stops there and the linked file keeps its bytes
    out, theirs = tmp_path / "v", tmp_path / "theirs.txt"
    theirs.write_bytes(b"the user's own file")
    real = icl_files._write_fd

    def plant(fd, data):
        if data.startswith(b"PK") and not (out / "relu.npz").is_symlink():      # once the case files are written
            (out / "relu.npz").symlink_to(theirs)
        real(fd, data)
    monkeypatch.setattr(icl_files, "_write_fd", plant)
    with pytest.raises(ValueError, match="relu.npz' appeared while this run was writing"):
        ic.write_reference_vectors(out)
    assert theirs.read_bytes() == b"the user's own file" and os.path.islink(out / "relu.npz")


@pytest.mark.slow
@pytest.mark.mutants
def test_vectors_lock_their_folder(tmp_path):
    out = tmp_path / "v"
    ic.write_reference_vectors(out)
    before = snapshot(out)
    with icl_files.Folder(out, ic.VECTORS_TOOL, ic.VECTORS_RECORD, ic.VECTORS_LOCK,
                          vouchers={"manifest.json": ic._manifest_files}) as holder:
        holder.open(overwrite=True, keep_others=None, writes=lambda name: False)     # another writer holds it
        proc = vectors_cli(out, "--overwrite")
        assert proc.returncode == 2 and "in use by another icl_check vectors run" in proc.stderr, proc.stderr
    assert snapshot(out) == before
    ic.write_reference_vectors(out, overwrite=True)                 # the lock released: ours replaced
    assert snapshot(out) == before


KILLED = """
import os, signal, sys, icl_check, icl_files
real = icl_files._write_fd
def dying(fd, data):                 # SIGKILL in the middle of blocks.npz, or just after it
    real(fd, data if sys.argv[2] == "after" or len(data) != int(sys.argv[3]) else data[:len(data) // 2])
    if len(data) == int(sys.argv[3]):
        os.kill(os.getpid(), signal.SIGKILL)
icl_files._write_fd = dying
icl_check.write_reference_vectors(sys.argv[1], overwrite=True)
"""


@pytest.mark.slow
@pytest.mark.mutants
@pytest.mark.parametrize("when", ["during", "after"])
def test_vectors_after_sigkill_overwrite_takes_back_what_it_proves_and_names_the_rest(tmp_path, when):
    fresh, out = tmp_path / "fresh", tmp_path / "v"
    ic.write_reference_vectors(fresh)
    size = (fresh / "blocks.npz").stat().st_size
    ic.write_reference_vectors(out)
    proc = subprocess.run([sys.executable, "-c", KILLED, str(out), when, str(size)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    if when == "during":                     # blocks.npz cut short: named, nothing touched
        before = snapshot(tmp_path)
        proc = vectors_cli(out, "--overwrite")
        assert proc.returncode == 2 and "blocks.npz' was being written when a run of icl_check vectors stopped" \
            in proc.stderr, proc.stderr
        assert "small-full" not in proc.stderr and snapshot(tmp_path) == before
        (out / "blocks.npz").unlink()            # what the message asks
    proc = vectors_cli(out, "--overwrite")      # every other file proven by its hash: taken back
    assert proc.returncode == 0, proc.stderr
    assert snapshot(out) == snapshot(fresh)


@pytest.mark.slow
@pytest.mark.mutants
def test_vectors_killed_as_they_wrote_their_first_record_name_the_hidden_file_left(tmp_path):
    # a run killed as it wrote its first record leaves only its hidden temporary record (empty) and its
    # lock; no record proves the former the run's, so --overwrite names it (exit 2), and once it is
    # removed the folder is the writer's again
    out = tmp_path / "v"
    out.mkdir()
    temp = out / f".{ic.VECTORS_RECORD}.tmp"
    temp.write_bytes(b"")
    before = snapshot(tmp_path)
    proc = vectors_cli(out, "--overwrite")
    assert proc.returncode == 2 and f"{str(temp)!r} is the temporary record" in proc.stderr, proc.stderr
    assert snapshot(tmp_path) == before
    temp.unlink()
    assert vectors_cli(out, "--overwrite").returncode == 0


@pytest.mark.slow
@pytest.mark.mutants
def test_vectors_a_write_error_is_a_message_and_status_2_and_the_next_run_recovers(tmp_path):
    # the file-size limit (ulimit -f; Python ignores SIGXFSZ, so the write fails with EFBIG) stops the
    # run at large-d.npz (47 kB): removed, recorded; the other files stay provably the run's
    fresh, out = tmp_path / "fresh", tmp_path / "v"
    ic.write_reference_vectors(fresh)
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (32768, 32768))
    proc = vectors_cli(out, preexec_fn=limit)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "usage:" not in proc.stderr
    assert proc.stderr.startswith("python3 -m icl_check vectors: error: cannot write") and "large-d.npz" in proc.stderr
    assert "ulimit -f" in proc.stderr and not (out / "large-d.npz").exists()
    assert json.loads((out / ic.VECTORS_RECORD).read_text())["status"] == "write error"
    proc = vectors_cli(out, "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert snapshot(out) == snapshot(fresh)


# ---------------------------------------------------------------------------------------------
# The package: command line, version, licence, citation, the optional dependency
# ---------------------------------------------------------------------------------------------

def read(name):
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return f.read()


def test_command_line_help_and_version(capsys):
    # in this process: `python3 -m icl_check` runs _main (test_reference_vectors_are_reproducible_... runs it)
    assert ic._main([]) == 0                                   # no command: the help, exit 0
    out = capsys.readouterr().out
    assert "usage: python3 -m icl_check" in out and "vectors" in out
    assert "share/doc/icl_ref" in out                          # where the installed MATH.md is
    with pytest.raises(SystemExit) as done:
        ic._main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"icl_ref {ir.__version__}"
    with pytest.raises(SystemExit) as done:
        ic._main(["nonsense"])
    assert done.value.code == 2


def test_icl_ref_still_forwards_the_kit_with_a_deprecation_warning_naming_icl_check(tmp_path):
    # until 0.5.0 (README): the names that moved in 0.4.0 and the command line, each saying where to go
    moved = [name for name, module in ir._MOVED.items() if module == "icl_check"]
    assert {"check_implementation", "diagnose", "reference_cases", "write_reference_vectors"} <= set(moved)
    for name in moved:
        with pytest.warns(DeprecationWarning, match=re.escape(f"icl_ref.{name} moved to icl_check.{name}")):
            assert getattr(ir, name) is getattr(ic, name)
    with pytest.warns(DeprecationWarning, match="icl_check"):
        report = ir.check_implementation(lambda case: correct_outputs("paper", "small-full"), cases="small-full",
                                         rtol=fd_rtol("paper"))
    assert report["cases"]["small-full"]["status"] == "passed"
    old, new = tmp_path / "old", tmp_path / "new"
    proc = subprocess.run([sys.executable, "-m", "icl_ref", "vectors", "--out", str(old)], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0 and f"wrote {len(CASES)} cases" in proc.stdout, proc.stderr
    assert "python3 -m icl_ref is deprecated: use python3 -m icl_check" in proc.stderr
    ic.write_reference_vectors(new)
    assert snapshot(old) == snapshot(new)


def test_one_version_everywhere_and_a_licence_to_copy():
    version = re.search(r'^version = "([^"]+)"', read("pyproject.toml"), flags=re.M).group(1)
    assert ir.__version__ == version
    assert re.search(r'^__version__ = "([^"]+)"', read("icl_fast.py"), flags=re.M).group(1) == version
    assert re.search(r"^version: (\S+)", read("CITATION.cff"), flags=re.M).group(1) == version
    assert f"## {version}" in read("CHANGELOG.md")
    assert 'license = { text = "MIT" }' in read("pyproject.toml") and read("LICENSE").startswith("MIT License")
    assert "2306.00297" in read("CITATION.cff") and "license: MIT" in read("CITATION.cff")
    assert re.search(r'"share/doc/icl_ref" = \[.*"MATH\.md"', read("pyproject.toml"))


def test_icl_fast_without_threadpoolctl_names_the_extra(monkeypatch):
    import importlib
    monkeypatch.setitem(sys.modules, "threadpoolctl", None)     # None: not importable
    monkeypatch.delitem(sys.modules, "icl_fast", raising=False)
    with pytest.raises(ImportError, match=re.escape("icl_fast needs threadpoolctl: pip install icl_ref[fast]")):
        importlib.import_module("icl_fast")


def test_the_kit_works_under_a_strict_caller_and_leaves_its_settings(tmp_path):
    # a test suite with np.seterr(all="raise") (strict suites set it) runs the kit as any other: the
    # softmax cases' exponentials underflow inside icl_ref, which must not raise, and the caller's
    # settings are the same afterwards
    name = "small-full"
    outputs = correct_outputs("paper", name)
    old = np.seterr(all="raise")
    try:
        assert len(ic.reference_cases()) == len(CASES)
        report = ic.check_implementation(lambda case: outputs, cases=[name], rtol=fd_rtol("paper"))
        assert report["cases"][name]["status"] == "passed"
        _, found = ic.diagnose({name: {"Z_L": outputs["Z_L"], "loss": outputs["loss"]}})
        ic.write_reference_vectors(tmp_path / "vectors")
        assert np.geterr() == dict(divide="raise", over="raise", under="raise", invalid="raise")
    finally:
        np.seterr(**old)


@pytest.mark.slow
def test_the_numpy_example_runs_in_its_own_process():
    # examples/test_numpy_per_case.py: the linear cases pass one per test, and the one-call form passes
    # with the others in skip= (the frameworks' examples run in .ci/run's frameworks leg)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           os.path.join(ROOT, "examples", "test_numpy_per_case.py")],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert "10 passed" in proc.stdout and "skipped" not in proc.stdout and "xfail" not in proc.stdout


def test_vectors_a_write_error_with_stderr_full_too_is_still_status_2(tmp_path, monkeypatch, full_disk):
    # README: a write the system refuses exits with status 2; with stderr full as well (`> /dev/full 2>&1`)
    # the message is lost but not the status (it was an OSError out of the error's own print: status 1)
    import errno
    import icl_files

    def refused(out, overwrite=False):
        raise icl_files.WriteFailed(str(out), OSError(errno.EFBIG, "File too large"))
    monkeypatch.setattr(ic, "write_reference_vectors", refused)
    monkeypatch.setattr(sys, "stderr", full_disk)
    assert ic._main(["vectors", "--out", str(tmp_path / "v")]) == 2
