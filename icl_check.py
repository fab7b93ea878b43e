"""icl_check: the conformance kit for implementations of the linear transformer of Ahn et al. (2023).

Checks another implementation (PyTorch, JAX, NumPy, or any language through the vectors' files)
against icl_ref, in the paper's layout or in the authors' or von Oswald et al.'s, and names the
convention slip behind a mismatch or says where it sits (MATH.md §13); the adapters between
those layouts and the paper's (MATH.md §12) come first. Built on icl_ref's public names (and the
input checks its PRIVATE_API lists); icl_ref itself checks nothing of anyone else's. Writes files
only through icl_files.

    tokens_as_rows, tokens_as_columns          prompts with tokens as rows (their code) and back
    params_from_authors, params_to_authors,    the authors' allparam blocks, and their gradient
    grads_to_authors
    params_from_von_oswald, grads_to_von_oswald, VON_OSWALD_LOSS_SCALE
                                               von Oswald et al.'s W_q, W_k, W_v, W_o, and their loss

    reference_cases()                          the inputs: small deterministic cases, every structure
                                               and activation, with the layouts that express each
    check_implementation(fn, layout, dtype)    one call is the whole test, in any test runner; a
                                               mismatch raises Mismatch, its message the likely cause
                                               and where each difference sits (at most
                                               MAX_REPORT_LINES lines), .report the full table
    diagnose(outputs, layout=...)              the same comparison for arrays computed elsewhere
    write_reference_vectors(out)               one .npz per case and manifest.json (the same bytes on
                                               every run), for code that cannot import Python;
                                               python3 -m icl_check vectors --out DIR
    LAYOUTS, DIAGNOSIS_VARIANTS                 what each layout's inputs and outputs mean; the slips
    CHECK_TOLERANCES, VECTOR_TOLERANCES         the default tolerances, with their reasons

Sections follow MATH.md §12-§13.
"""
import argparse
import functools
import io
import json
import math
import os
import sys
import textwrap
import zipfile

import numpy as np

import icl_files
import icl_ref as ir
from icl_ref import _array, _flag, _int, _nonneg, _numpy_rules, _params, _prompts

__version__ = ir.__version__

# ---------------------------------------------------------------------------------------------
# §12 Other code's layouts: the authors' code and von Oswald et al.
# ---------------------------------------------------------------------------------------------

def tokens_as_columns(Z_rows):
    """Prompts with tokens as rows, (B, n+1, d+1) (the authors' code, von Oswald et al.), as icl_ref's
    (B, d+1, n+1). The inverse is tokens_as_rows. MATH.md §12."""
    Z_rows = _array("Z_rows", Z_rows, 3)
    return _prompts(Z_rows.transpose(0, 2, 1), name="Z_rows (transposed)").copy()


def tokens_as_rows(Z):
    """icl_ref's prompts (B, d+1, n+1) with tokens as rows, (B, n+1, d+1). MATH.md §12."""
    return _prompts(Z).transpose(0, 2, 1).copy()


def params_from_authors(allparam):
    """The authors' `allparam` (L, H, 2, d, d) (P block at [..., 0, :, :], Q block at [..., 1, :, :])
    as icl_ref's (P, Q), each (L, H, d+1, d+1).

    Their layer is Z_rows + (Z_rows Q_full Z_rows^T) M (Z_rows P_full^T) / N with
    P_full = [[P_blk, 0], [0, 1]] and Q_full = [[Q_blk, 0], [0, 0]]; in columns that is
    P_full Z M Z^T Q_full^T Z / N, so P = P_full and Q = Q_full^T (MATH.md §12).
    """
    allparam = _array("allparam", allparam, 5)
    L, H, two, d, d2 = allparam.shape
    if two != 2 or d != d2 or L < 1 or H < 1 or d < 1:
        raise ValueError(f"allparam must have shape (L, H, 2, d, d), got {allparam.shape}")
    P, Q = np.zeros((2, L, H, d + 1, d + 1))
    P[:, :, :d, :d] = allparam[:, :, 0]
    P[:, :, d, d] = 1.0
    Q[:, :, :d, :d] = allparam[:, :, 1].transpose(0, 1, 3, 2)
    return P, Q


def params_to_authors(P, Q):
    """Inverse of params_from_authors: (P, Q) -> allparam (L, H, 2, d, d). Only (P, Q) of the
    authors' form can be mapped: P's last row and column e_{d+1}, Q's last row and column 0.
    MATH.md §12."""
    P, Q = _params(P, Q)
    d = P.shape[-1] - 1
    e = np.zeros(d + 1)
    e[d] = 1.0
    if (np.any(P[..., d, :] != e) or np.any(P[..., :, d] != e) or np.any(Q[..., d, :])
            or np.any(Q[..., :, d])):
        raise ValueError("P, Q must have the authors' form: P's last row and column e_{d+1}, "
                         "Q's last row and column zero")
    return np.stack([P[..., :d, :d], Q[..., :d, :d].swapaxes(-1, -2)], axis=2)


def grads_to_authors(dP, dQ):
    """The gradient with respect to the authors' allparam, from icl_ref's (dP, dQ):
    chain rule through params_from_authors (the Q block enters transposed). MATH.md §12."""
    dP, dQ = _params(dP, dQ, ("dP", "dQ"))
    d = dP.shape[-1] - 1
    return np.stack([dP[..., :d, :d], dQ[..., :d, :d].swapaxes(-1, -2)], axis=2)


VON_OSWALD_LOSS_SCALE = 0.5
"""von Oswald et al. (2023) report 0.5 * mean squared error: multiply icl_ref's loss and gradient by it."""


def _von_oswald_heads(W_q, W_k, W_v, W_o, heads, activation, layers=None):
    """The four projections split into heads, (L, H, D, k), (L, H, D, k), (L, H, D, v), (L, H, v, D),
    2-d (tied) weights repeated `layers` times, and the score scale s: 1, or 1 / sqrt(key size) for
    their softmax. Heads are column blocks of W_q, W_k, W_v and row blocks of W_o."""
    heads = _int("heads", heads, 1)
    W = [_array(name, w, (2, 3)) for name, w in (("W_q", W_q), ("W_k", W_k), ("W_v", W_v), ("W_o", W_o))]
    if len({w.ndim for w in W}) != 1:
        raise ValueError("W_q, W_k, W_v, W_o must all be per layer (3-d) or all shared (2-d)")
    W = [w if w.ndim == 3 else w[None] for w in W]
    (L, D, Hk), (_, _, Hv) = W[0].shape, W[2].shape
    expected = [(L, D, Hk), (L, D, Hk), (L, D, Hv), (L, Hv, D)]
    for name, w, e in zip(("W_q", "W_k", "W_v", "W_o"), W, expected):
        if w.shape != e:
            raise ValueError(f"{name} must have shape {e[1:] if np.ndim(W_q) == 2 else e} to match W_q and W_v, "
                             f"got {w.shape}")
    if Hk % heads or Hv % heads or D < 2:
        raise ValueError(f"the key and value widths ({Hk}, {Hv}) must be multiples of heads = {heads}, and d+1 >= 2")
    if np.ndim(W_q) == 2:
        W = [np.repeat(w, _int("layers", layers, 1), axis=0) for w in W]
    elif layers is not None and _int("layers", layers, 1) != L:
        raise ValueError(f"layers = {layers} but the weights have {L} layers")
    Wq, Wk, Wv, Wo = (np.stack(np.split(w, heads, axis=2 if i < 3 else 1), axis=1) for i, w in enumerate(W))
    return Wq, Wk, Wv, Wo, 1.0 if activation == "linear" else 1.0 / math.sqrt(Wq.shape[-1])


@_numpy_rules
def params_from_von_oswald(W_q, W_k, W_v, W_o, n, heads=1, layers=None, activation="linear"):
    """von Oswald et al.'s projections as icl_ref's (P, Q), each (L, H, d+1, d+1) (MATH.md §12).

    Their layer, tokens as rows e (n+1, D): per head h, q = e W_q,h, k = e W_k,h, v = e W_v,h,
    out = concat_h(A_h v) W_o with A_h = q k^T over the context keys only (no 1/n; for "softmax"
    A_h = softmax(q k^T / sqrt(key size)) over the context keys), e <- e + out. Heads are column
    blocks of W_q, W_k, W_v and row blocks of W_o. In columns this is icl_ref's layer with

        P_h = n W_o,h^T W_v,h^T,   Q_h = W_k,h W_q,h^T  (/ sqrt(key size) for softmax).

    W_q, W_k: (L, D, H k) or (D, H k); W_v: (L, D, H v) or (D, H v); W_o: (L, H v, D) or (H v, D).
    2-d weights are tied (the same in every layer, their default): give `layers`. n: context size.
    activation "linear" or "softmax" (their softmax normalises over the context keys: icl_ref's
    "softmax"). Returns P, Q.
    """
    n = _int("n", n, 1)
    if activation not in ("linear", "softmax"):
        raise ValueError(f"activation must be 'linear' or 'softmax' for von Oswald et al.'s model, got {activation!r}")
    Wq, Wk, Wv, Wo, s = _von_oswald_heads(W_q, W_k, W_v, W_o, heads, activation, layers)
    P = n * np.swapaxes(Wv @ Wo, -1, -2)                        # n (W_v,h W_o,h)^T = n W_o,h^T W_v,h^T
    Q = s * Wk @ np.swapaxes(Wq, -1, -2)                        # W_k,h W_q,h^T
    return P, Q


@_numpy_rules
def grads_to_von_oswald(dP, dQ, W_q, W_k, W_v, W_o, n, heads=1, activation="linear"):
    """The gradient of von Oswald et al.'s loss (VON_OSWALD_LOSS_SCALE times icl_ref's) with respect to
    W_q, W_k, W_v, W_o, from icl_ref's (dP, dQ): the chain rule through params_from_von_oswald
    (MATH.md §12). With P_h = n (W_v,h W_o,h)^T and Q_h = s W_k,h W_q,h^T:
    dW_v,h = n dP_h^T W_o,h^T, dW_o,h = n W_v,h^T dP_h^T, dW_k,h = s dQ_h W_q,h, dW_q,h = s dQ_h^T W_k,h;
    tied (2-d) weights get the sum over layers. Returns (dW_q, dW_k, dW_v, dW_o) shaped like the weights.
    """
    n = _int("n", n, 1)
    dP, dQ = _params(dP, dQ, ("dP", "dQ"))
    tied = np.ndim(W_q) == 2
    Wq, Wk, Wv, Wo, s = _von_oswald_heads(W_q, W_k, W_v, W_o, heads, activation, dP.shape[0] if tied else None)
    if dP.shape[:3] != Wq.shape[:3]:
        raise ValueError(f"dP, dQ must have shape (L, heads, D, D) = ({Wq.shape[0]}, {Wq.shape[1]}, {Wq.shape[2]}, "
                         f"{Wq.shape[2]}) to match the weights, got {dP.shape}")
    dPt, c = np.swapaxes(dP, -1, -2), VON_OSWALD_LOSS_SCALE
    grads = [c * s * np.swapaxes(dQ, -1, -2) @ Wk, c * s * dQ @ Wq,      # dW_q,h, dW_k,h
             c * n * dPt @ np.swapaxes(Wo, -1, -2), c * n * np.swapaxes(Wv, -1, -2) @ dPt]
    out = [np.concatenate(list(np.moveaxis(g, 1, 0)), axis=2 if i < 3 else 1) for i, g in enumerate(grads)]
    return tuple(o.sum(axis=0) if tied else o for o in out)


# ---------------------------------------------------------------------------------------------
# §13 The reference cases and their outputs in each layout
# ---------------------------------------------------------------------------------------------

VECTORS_FORMAT = 1
VECTOR_TOLERANCES = {
    "float64": "relative to the largest entry of each array: 1e-12 for Z_L, y_hat and loss (rounding of a few "
               "hundred operations); 1e-10 for gradients (rounding grows with depth: 3e-13 seen at L = 8)",
    "float32": "forward 1e-5, loss 1e-4, gradients 1e-4 (5x the worst float32 error measured over d <= 20, "
               "n <= 200, L <= 4; larger parameters or deeper models need their own measurement)",
}


@functools.lru_cache(maxsize=1)
def _reference_cases():
    """reference_cases, built once (the family optimum takes a second)."""
    cases = []

    def add(name, description, seed, d, n, L, H, make, activation="linear", structure="full", Sigma=None,
            Sigma_w=None):
        rng = np.random.default_rng([VECTORS_FORMAT, seed])
        Z, y = ir.sample_prompts(rng, 4, n, np.eye(d) if Sigma is None else Sigma, Sigma_w)
        P, Q = make(rng, d, L, H)
        cases.append(dict(name=name, description=description, activation=activation, structure=structure,
                          Z=Z, y=y, P=np.asarray(P, float), Q=np.asarray(Q, float),
                          Sigma=np.eye(d) if Sigma is None else Sigma, Sigma_w=np.eye(d) if Sigma_w is None else Sigma_w))

    def full(scale):
        return lambda rng, d, L, H: scale * rng.standard_normal((2, L, H, d + 1, d + 1))
    rng0 = np.random.default_rng([VECTORS_FORMAT, 99])
    Sigma, _ = ir.rotated_covariance(rng0, [1.0, 0.25, 2.0])
    Si = np.linalg.inv(Sigma)
    a_star = ir.optimal_family_scalars(3, 10, 3)[0]
    add("small-full", "d = 2, n = 3, one layer, random non-symmetric P and Q", 1, 2, 3, 1, 1, full(0.5))
    add("two-layers-two-heads", "d = 3, n = 5, L = 2, H = 2, random P and Q", 2, 3, 5, 2, 2, full(0.3))
    add("theorem1-optimum", "Theorem 1's optimum Gamma* (sparse, one layer) for a non-isotropic Sigma, "
        "w* ~ N(0, I)", 3, 3, 6, 1, 1, lambda rng, d, L, H: ir.sparse_params(ir.gamma_star(Sigma, 6)[None]),
        structure="sparse", Sigma=Sigma)
    add("sparse-family-optimum", "Theorem 3: A_l = a*_l Sigma^-1 with the exact sparse-family optimum a* "
        "(L = 3, n = 10), w* ~ N(0, Sigma^-1)", 4, 3, 10, 3, 1,
        lambda rng, d, L, H: ir.sparse_params(a_star[:, None, None] * Si), structure="sparse", Sigma=Sigma,
        Sigma_w=Si)
    add("blocks", "structure (11): random A_l and B_l, L = 2", 5, 3, 6, 2, 1,
        lambda rng, d, L, H: ir.block_params(*(0.4 * rng.standard_normal((2, L, d, d)))), structure="blocks")
    add("non-symmetric-sparse", "structure (8) with non-symmetric A_l: Lemma 1 needs A_l^T here", 6, 2, 4, 2, 1,
        lambda rng, d, L, H: ir.sparse_params(np.array([[[0.2, 0.9], [-0.3, 0.5]], [[0.6, -0.4], [0.1, 0.3]]])),
        structure="sparse")
    add("query-as-key", "a query far from the context: using the query as a key or value changes the answer "
        "by O(1)", 7, 2, 3, 1, 1, full(0.5))
    cases[-1]["Z"][:, :2, -1] *= 5.0
    add("large-d", "d = 12, n = 8: a larger token dimension, two layers", 8, 12, 8, 2, 1, full(0.1))
    add("relu", "[A] section 6 attention with relu, d = 2, n = 4, H = 2", 9, 2, 4, 1, 2, full(0.5), activation="relu")
    add("softmax", "softmax over the n context keys (von Oswald et al.'s), d = 2, n = 4, H = 2", 10, 2, 4, 1, 2,
        full(0.5), activation="softmax")
    add("softmax_all", "the authors' softmax: all n+1 keys, then the mask drops the query's value", 11, 2, 4, 1,
        2, full(0.5), activation="softmax_all")
    add("authors-softmax", "the authors' softmax with their block form (11): d = 2, n = 4", 12, 2, 4, 1, 1,
        lambda rng, d, L, H: ir.block_params(*(0.5 * rng.standard_normal((2, L, d, d)))), activation="softmax_all",
        structure="blocks")
    for c in cases:             # shared by every check in the process: no caller may change them
        for v in c.values():
            if isinstance(v, np.ndarray):
                v.setflags(write=False)
    return tuple(cases)


def _case_outputs(P, Q, Z, y, activation):
    """Z_L, y_hat, loss, dP, dQ of icl_ref's conventions for one case."""
    if activation == "linear":
        loss, dP, dQ = ir.loss_and_grad(P, Q, Z, y)
        Z_L = ir.forward(P, Q, Z)
    else:
        loss, dP, dQ = ir.loss_and_grad_activation(P, Q, Z, y, activation)
        Z_L = ir.forward_activation(P, Q, Z, activation)
    return dict(Z_L=Z_L, y_hat=-Z_L[:, -1, -1], loss=np.array(loss), dP=dP, dQ=dQ)


def _npz_bytes(arrays):
    """The bytes of np.savez(arrays) with fixed zip timestamps: the same arrays give the same bytes."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as zf:
        for name, a in arrays.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.array(a, order="C"), allow_pickle=False)   # keeps 0-d
            zf.writestr(zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0)), buf.getvalue())
    return out.getvalue()


_ROWS_INPUTS = {"Z_rows": "(B, n+1, d+1): the prompts with tokens as rows, row n the query [x_q, 0]",
                "y": "(B,): the query labels"}
LAYOUTS = {
    "paper": (
        {"Z": "(B, d+1, n+1): tokens as columns, column i < n is [x_i; y_i], column n the query [x_q; 0]",
         "y": "(B,): the query labels", "P": "(L, H, d+1, d+1): P of eq. (3) per layer and head",
         "Q": "(L, H, d+1, d+1): Q of eq. (3), scores z_i^T Q_h z_j (the paper's W_k^T W_q; von Oswald et "
              "al.'s weights give Q_h = W_k,h W_q,h^T, their queries and keys being rows)"},
        {"Z_L": "(B, d+1, n+1): after L layers Z <- Z + (1/n) sum_h P_h Z M sigma(Z^T Q_h Z) (MATH.md §2)",
         "y_hat": "(B,): -Z_L[:, d, n]", "loss": "0-d: mean (y_hat - y)^2, no factor 1/2",
         "dP": "d loss / d P, shaped as P", "dQ": "d loss / d Q, shaped as Q"},
        ("linear", "relu", "softmax", "softmax_all"),
        "scores z_i^T Q_h z_j, unscaled; softmax normalises over the n context keys, softmax_all over all "
        "n+1 (the authors' code) before M drops the query's value"),
    "authors": (
        dict(_ROWS_INPUTS, allparam="(L, H, 2, d, d): [:, :, 0] is P's top-left block, [:, :, 1] is Q_code, "
                                    "the transpose of Q's (their layer: Z_rows Q_code Z_rows^T)"),
        {"Z_L_rows": "(B, n+1, d+1): Z_L with tokens as rows", "y_hat": "(B,): -Z_L_rows[:, n, d]",
         "loss": "0-d: mean (y_hat - y)^2, no factor 1/2", "grad_allparam": "d loss / d allparam"},
        ("linear", "softmax_all"),
        "no key size: one d x d block per head and layer, scores unscaled, 1/N with N = n context examples; "
        "softmax_all normalises over all N+1 keys before M drops the query's value"),
    "von_oswald": (
        dict(_ROWS_INPUTS, W_q="(L, d+1, H k): queries, head h in columns h k..(h+1) k - 1",
             W_k="(L, d+1, H k): keys", W_v="(L, d+1, H v): values",
             W_o="(L, H v, d+1): output projection, head h in rows h v..(h+1) v - 1"),
        {"Z_L_rows": "(B, n+1, d+1): after L layers e <- e + concat_h(A_h e W_v,h) W_o, A_h over the n "
                     "context rows only, no 1/n", "y_hat": "(B,): -Z_L_rows[:, n, d]",
         "loss": "0-d: THEIR loss 0.5 * mean (y_hat - y)^2 (VON_OSWALD_LOSS_SCALE)",
         **{f"grad_{w}": f"d (their loss) / d {w}, shaped as {w}" for w in ("W_q", "W_k", "W_v", "W_o")}},
        ("linear", "softmax"),
        "key size k = value size v = d+1 per head in these cases; linear A_h = q k^T unscaled (q = e W_q,h, "
        "k = e W_k,h), softmax A_h = softmax(q k^T / sqrt(k)) over the n context keys"),
}
"""Per layout: (inputs {name: shape and meaning}, outputs {name: definition}, the activations its
reference cases use, the attention's scores and key size). check_implementation hands fn the inputs
and compares the outputs (MATH.md §12-§13)."""
ARRAY_MEANINGS = {k: f"{layout} layout: {v}" for layout, (inputs, outputs, _, _) in reversed(LAYOUTS.items())
                  for k, v in {**inputs, **outputs}.items()}
"""The meaning of each array in the reference vectors (manifest.json): its entry in LAYOUTS, the paper's
where layouts share a name (the vectors hold the paper's loss)."""


def _layouts_text():
    """LAYOUTS as the text help(check_implementation) ends with."""
    def item(indent, text):
        return textwrap.fill(text, 108, initial_indent=" " * indent, subsequent_indent=" " * (indent + 4))
    lines = []
    for layout, (inputs, outputs, activations, scores) in LAYOUTS.items():
        lines += [item(6, f"{layout!r}: activations {', '.join(activations)}; {scores}."), "        inputs:"]
        lines += [item(10, f"{k}: {v}") for k, v in inputs.items()] + ["        outputs:"]
        lines += [item(10, f"{k}: {v}") for k, v in outputs.items()]
    return "\n".join(lines)


def _case_layouts(case):
    """The layouts a reference case can be given in: the paper's always; the authors' when the
    attention is linear or theirs (softmax_all) and P, Q have their form; von Oswald et al.'s for
    linear and softmax."""
    layouts = ["paper"]
    if case["activation"] in ("linear", "softmax_all"):
        try:
            params_to_authors(case["P"], case["Q"])
            layouts.append("authors")
        except ValueError:
            pass
    if case["activation"] in ("linear", "softmax"):
        layouts.append("von_oswald")
    return layouts


def reference_cases():
    """The inputs of the reference vectors: a list of dicts (name, description, activation, structure,
    Z, y, P, Q, the covariances Sigma, Sigma_w its prompts were drawn with, and layouts: the layouts
    that can express the case, LAYOUTS' keys), deterministic (fixed seeds), built once per process;
    fresh copies on every call. MATH.md §13."""
    return [dict({k: v.copy() if isinstance(v, np.ndarray) else v for k, v in c.items()}, layouts=_case_layouts(c))
            for c in _reference_cases()]


def _case_von_oswald_weights(case):
    """von Oswald et al.'s weights for a case, key size D: W_q,h = I, W_k,h = Q_h (times sqrt(D) for
    softmax), W_v,h = P_h^T / n, W_o,h = I, which params_from_von_oswald maps back to (P, Q)."""
    P, Q, act = case["P"], case["Q"], case["activation"]
    L, H, D, _ = P.shape
    n = case["Z"].shape[2] - 1
    eye = np.tile(np.eye(D), (L, 1, H))
    return dict(W_q=eye, W_k=np.concatenate(list(np.moveaxis(Q, 1, 0)), axis=2) * (1.0 if act == "linear" else math.sqrt(D)),
                W_v=np.concatenate(list(np.moveaxis(np.swapaxes(P, -1, -2) / n, 1, 0)), axis=2),
                W_o=np.swapaxes(eye, -1, -2))


def _layout_inputs(case, layout):
    """The case's input arrays in a layout (LAYOUTS)."""
    if layout == "paper":
        return dict(Z=case["Z"], y=case["y"], P=case["P"], Q=case["Q"])
    out = dict(Z_rows=tokens_as_rows(case["Z"]), y=case["y"])
    if layout == "authors":
        return dict(out, allparam=params_to_authors(case["P"], case["Q"]))
    return dict(out, **_case_von_oswald_weights(case))


def _layout_outputs(case, layout, out):
    """icl_ref's outputs in the paper's layout (any subset of Z_L, y_hat, loss, dP, dQ) as the
    layout's outputs (LAYOUTS)."""
    if layout == "paper":
        return dict(out)
    res = {k: v for k, v in (("Z_L_rows", out.get("Z_L")), ("y_hat", out.get("y_hat"))) if v is not None}
    if "Z_L_rows" in res:
        res["Z_L_rows"] = np.swapaxes(res["Z_L_rows"], 1, 2)
    scale = 1.0 if layout == "authors" else VON_OSWALD_LOSS_SCALE
    if "loss" in out:
        res["loss"] = scale * np.asarray(out["loss"])
    if "dP" in out and "dQ" in out:
        if layout == "authors":
            res["grad_allparam"] = grads_to_authors(out["dP"], out["dQ"])
        else:
            W = _case_von_oswald_weights(case)
            grads = grads_to_von_oswald(out["dP"], out["dQ"], *W.values(), case["Z"].shape[2] - 1,
                                        heads=case["P"].shape[1], activation=case["activation"])
            res.update({f"grad_{k}": g for k, g in zip(W, grads)})
    return res


@functools.lru_cache(maxsize=None)
def _cases_of(layout):
    """The names of the reference cases a layout can be given (_case_layouts)."""
    return tuple(c["name"] for c in _reference_cases() if layout in _case_layouts(c))


@functools.lru_cache(maxsize=None)
def _expected(name, layout):
    """A case's inputs and icl_ref's outputs in a layout, computed once per process, read-only."""
    case = next(c for c in _reference_cases() if c["name"] == name)
    pair = (_layout_inputs(case, layout), _layout_outputs(case, layout, _case_outputs(
        case["P"], case["Q"], case["Z"], case["y"], case["activation"])))
    for v in (*pair[0].values(), *pair[1].values()):
        v.setflags(write=False)
    return pair


# ---------------------------------------------------------------------------------------------
# §13 The reference vectors: files for implementations that cannot import icl_ref
# ---------------------------------------------------------------------------------------------

VECTORS_TOOL, VECTORS_RECORD, VECTORS_LOCK = "icl_check vectors", ".vectors-record.json", ".vectors.lock"
"""The vectors writer's name in messages, its record while it writes (removed once the set is whole:
manifest.json then vouches for every file) and its lock file, for icl_files.write_file_set."""


def _manifest_files(manifest):
    """{file: sha256} an earlier manifest.json vouches for, or None when it is not a manifest of
    reference vectors (icl_files trusts no other)."""
    if manifest.get("format") != "icl_ref reference vectors":
        return None
    return {case["file"]: case["sha256"] for case in manifest["cases"]}


def write_reference_vectors(out, overwrite=False):
    """Write the reference vectors into the directory `out` (created if needed): one .npz per case of
    reference_cases (the arrays of ARRAY_MEANINGS that apply: the paper's layout always, the authors'
    when P, Q have their form and the attention is linear or theirs, von Oswald et al.'s for linear
    and softmax attention) and manifest.json (format, icl_ref_version, conventions, shapes, meanings,
    tolerances, each file's SHA-256), written last. The same bytes on every run.

    The folder is icl_files' (its promises, on any system): a non-empty `out` is refused (a ValueError
    naming the file and why; the command line's flag --overwrite is overwrite=True) unless overwrite
    and every file in it is provably an earlier run's: listed with its SHA-256 by manifest.json, or by
    the record a stopped run left (a run killed mid-write: what it cannot prove it names). Never
    writes through a symbolic link (`out`, `out/`, a file in it), never opens a FIFO or device, one
    writer at a time (VECTORS_LOCK). A write the system refuses (disk full, `ulimit -f`, permission)
    is an OSError (icl_files.WriteFailed) saying what to do; the file begun is removed.
    Returns the manifest (a dict). MATH.md §13."""
    if not isinstance(out, (str, os.PathLike)) or not os.fspath(out):
        raise TypeError(f"out must name a directory, got {out!r}")
    overwrite = _flag("overwrite", overwrite)
    manifest = dict(format="icl_ref reference vectors", format_version=VECTORS_FORMAT, icl_ref_version=__version__,
                    conventions="MATH.md sections 2-3 and 12: layer Z + (1/n) sum_h P_h Z M Z^T Q_h Z with M "
                                "dropping the query from keys and values; y_hat = -Z_L[d, n]; loss mean (y_hat - y)^2",
                    tolerances=VECTOR_TOLERANCES, cases=[])
    files = {}
    for case in _reference_cases():
        P, Z, layouts = case["P"], case["Z"], _case_layouts(case)
        arrays = dict(_layout_inputs(case, "paper"), **_expected(case["name"], "paper")[1])
        for layout in layouts[1:]:
            arrays.update(_expected(case["name"], layout)[0],
                          **{k: v for k, v in _expected(case["name"], layout)[1].items() if k.startswith("grad_")})
        name = f"{case['name']}.npz"
        files[name] = _npz_bytes(arrays)
        manifest["cases"].append(dict(
            name=case["name"], file=name, sha256=icl_files.sha256(files[name]),
            description=case["description"], activation=case["activation"], structure=case["structure"],
            layouts=layouts, B=int(Z.shape[0]), d=int(Z.shape[1] - 1), n=int(Z.shape[2] - 1), L=int(P.shape[0]),
            H=int(P.shape[1]), arrays={k: dict(shape=list(np.shape(v)), meaning=ARRAY_MEANINGS[k])
                                       for k, v in arrays.items()}))
    files["manifest.json"] = icl_files.sealed_json(manifest, indent=1, sort_keys=True)   # last: it vouches
    icl_files.write_file_set(out, files, tool=VECTORS_TOOL, record=VECTORS_RECORD, lock=VECTORS_LOCK,
                             vouchers={"manifest.json": _manifest_files}, overwrite=overwrite)
    return manifest


# ---------------------------------------------------------------------------------------------
# §13 The diagnosis: the known convention slips, computed, and the comparison
# ---------------------------------------------------------------------------------------------

def _slip_outputs(case, P=None, Q=None, QT=False, loss=1.0, sign=False, act=None, context=None, rows=False,
                  when=None):
    """Z_L, y_hat, loss, dP, dQ that an implementation with one convention slip computes on a case, or
    None where the slip does not apply (MATH.md §13). The gradients are with respect to P and Q as the
    user's code builds them, so _layout_outputs maps them into any layout. P(n), Q(D): factors on P and
    Q; QT: Q transposed; loss: a factor on the loss; sign: y_hat = +Z_L[d, n]; act: (the case's
    activation, the one used instead); context: "query" (the query a key and value), "drop" (the last
    context example dropped), "mask" (masked with 1/n kept); rows: Z_L with tokens as rows; when: the
    only activation the slip exists for."""
    P0, Q0, Z, y, a = case["P"], case["Q"], case["Z"], case["y"], case["activation"]
    n, D = Z.shape[2] - 1, Z.shape[1]
    if (when and a != when) or (act and a != act[0]) or (context in ("drop", "mask") and n < 2) \
            or (context == "mask" and a == "softmax_all"):    # the authors' softmax still sees the masked key
        return None
    p, q, a = P(n) if P else 1.0, Q(D) if Q else 1.0, act[1] if act else a
    if context == "query":
        # a copy of the query appended as an (n+1)-th context token is a key and a value that evolves
        # exactly as the query does (each column's update depends on itself and the keys); P scaled by
        # (n+1)/n keeps the 1/n; softmax then normalises over all n+1 distinct keys, as either softmax
        # does once the mask is gone
        Z, p, a = np.concatenate([Z, Z[:, :, n:]], axis=2), p * (n + 1) / n, "softmax" if a.startswith("softmax") else a
    elif context:                                         # 1/(n-1) times (n-1)/n is the 1/n kept
        Z, p = np.delete(Z, n - 1, axis=2), p * ((n - 1) / n if context == "mask" else 1.0)
    Qs = q * (np.swapaxes(Q0, -1, -2) if QT else Q0)
    out = _case_outputs(p * P0, Qs, Z, -y if sign else y, a)     # (Z_L[d, n] - y)^2 is the loss at -y
    dQ = loss * q * out["dQ"]
    out.update(loss=loss * out["loss"], dP=loss * p * out["dP"], dQ=np.swapaxes(dQ, -1, -2) if QT else dQ)
    out["y_hat"] = -out["y_hat"] if sign else out["y_hat"]
    if context == "query":
        out["Z_L"] = np.delete(out["Z_L"], n, axis=2)
    elif context == "drop":
        out.pop("Z_L")                                   # a different shape: compare the rest
    elif context == "mask":          # the masked example's own column moves as a query over the other n - 1 would
        own = _case_outputs(p * P0, Qs, case["Z"][:, :, :n], y, a)["Z_L"][:, :, -1:]
        out["Z_L"] = np.concatenate([out["Z_L"][:, :, :n - 1], own, out["Z_L"][:, :, n - 1:]], axis=2)
    return dict(Z_L=np.swapaxes(out["Z_L"], 1, 2)) if rows else out


_SLIPS = dict(QT=dict(QT=True), Pn=dict(P=lambda n: n), Pn1=dict(P=lambda n: n / (n + 1)),
              P_n=dict(P=lambda n: 1 / n), P_n1=dict(P=lambda n: 1 / (n + 1)),
              Qk=dict(Q=math.sqrt, when="softmax"), Q_k=dict(Q=lambda D: 1 / math.sqrt(D), when="linear"),
              half=dict(loss=0.5), double=dict(loss=2.0), sign=dict(sign=True), query=dict(context="query"),
              drop=dict(context="drop"), mask=dict(context="mask"), rows=dict(rows=True),
              all_keys=dict(act=("softmax", "softmax_all")), n_keys=dict(act=("softmax_all", "softmax")))
"""The slips of DIAGNOSIS_VARIANTS as _slip_outputs computes them."""

DIAGNOSIS_VARIANTS = {
    "paper": {
        "Q transposed": ("QT", "your Q is the transpose of the paper's (tokens as rows compute Z^T Q^T Z): transpose "
            "it, or map the authors' layout with params_from_authors"),
        "1/(n+1) normalisation": ("Pn1", "you divide the attention by n + 1 (all tokens); the paper divides by the n "
            "context tokens"),
        "no normalisation": ("Pn", "you do not divide the attention by n (von Oswald et al.'s layout folds n into P: "
            "use params_from_von_oswald)"),
        "query used as a key and value": ("query", "the query token is a key and a value in your attention; the mask "
            "M must drop it (only the n context tokens are keys and values)"),
        "loss with a factor 1/2": ("half", "your loss is 0.5 * mean (von Oswald et al.'s); icl_ref's has no 1/2: "
            "multiply icl_ref's by VON_OSWALD_LOSS_SCALE to compare"),
        "prediction sign flipped": ("sign", "your prediction is +Z_L[d, n]; the paper's is -Z_L[d, n]"),
        "softmax over n+1 keys": ("all_keys", "your softmax normalises over all n+1 keys (the authors' code, "
            "icl_ref's 'softmax_all'); this case normalises over the n context keys ('softmax')"),
        "softmax over n keys": ("n_keys", "your softmax normalises over the n context keys (icl_ref's 'softmax'); "
            "this case normalises over all n+1 keys ('softmax_all', the authors' code)"),
        "last context example dropped": ("drop", "you use only n - 1 context examples (the authors' GD baselines do "
            "this); use all n"),
        "last context example masked, 1/n kept": ("mask", "your mask drops the last context example as well as the "
            "query while you still divide by n: M = diag(1, ..., 1, 0) masks the query only"),
        "tokens as rows (Z_L transposed)": ("rows", "your Z_L has tokens as rows, (B, n+1, d+1); the paper's has "
            "them as columns: compare tokens_as_columns(your Z_L)"),
    },
    "authors": {
        "Q_code used as Q (not transposed)": ("QT", "allparam[l, h, 1] is Q_code and their layer scores Z_rows "
            "Q_code Z_rows^T, i.e. z_i^T Q_code^T z_j: with tokens as columns use Q_code^T (params_from_authors "
            "does)"),
        "1/(N+1) normalisation": ("Pn1", "you divide the attention by N + 1; their layer divides by N, the number of "
            "context examples (Z_rows has N + 1 rows)"),
        "no normalisation": ("Pn", "you do not divide the attention by N (their layer does)"),
        "query used as a key and value": ("query", "the query row N is a key and a value in your attention; their "
            "mask M zeroes its column (only the N context rows are keys)"),
        "loss with a factor 1/2": ("half", "your loss is 0.5 * mean; theirs is mean (y_hat - y)^2, as icl_ref's"),
        "prediction sign flipped": ("sign", "y_hat is -Z_L_rows[:, N, d] (their code returns -output[:, -1, -1])"),
        "last context example dropped": ("drop", "you use N - 1 context examples (as their GD baselines do): the "
            "transformer uses all N"),
        "last context example masked, 1/N kept": ("mask", "your mask drops the last context row as well as the "
            "query: M masks the query only"),
        "Z_L_rows with tokens as columns": ("rows", "return Z_L_rows with tokens as rows, (B, N+1, d+1)"),
        "softmax over the N context keys": ("n_keys", "their softmax normalises over all N+1 keys, the query's "
            "own included, before M drops the query's value"),
    },
    "von_oswald": {
        "W_q and W_k swapped": ("QT", "the scores are q k^T with q = e W_q,h from the querying token and k = e W_k,h "
            "from the keys; yours use them the other way round (Q_h^T)"),
        "an extra 1/n": ("P_n", "their layer does not divide the attention by n (params_from_von_oswald puts n into "
            "P): drop the 1/n"),
        "1/(n+1) normalisation": ("P_n1", "you divide the attention by n + 1; their layer divides by nothing"),
        "loss without their 0.5": ("double", "their loss is 0.5 * mean (y_hat - y)^2 (VON_OSWALD_LOSS_SCALE); yours "
            "is the plain mean, so loss and every grad_W_* are 2x"),
        "loss with 0.5 twice": ("half", "your loss is 0.25 * mean: their 0.5 applied twice"),
        "softmax without 1/sqrt(key size)": ("Qk", "their softmax scores are q k^T / sqrt(k), k the per-head key "
            "size (W_q.shape[-1] / H, d+1 in these cases)"),
        "linear attention divided by sqrt(key size)": ("Q_k", "their linear attention is q k^T, unscaled: the "
            "1/sqrt(k) belongs to softmax only"),
        "softmax over n+1 keys": ("all_keys", "their softmax runs over the n context rows only: mask the query row's "
            "key before normalising"),
        "query used as a key and value": ("query", "only rows 0..n-1 of Z_rows are keys and values; the query row n "
            "attends but is not attended to"),
        "prediction sign flipped": ("sign", "y_hat is -Z_L_rows[:, n, d] (the query row's label entry, negated)"),
        "last context example dropped": ("drop", "you use n - 1 context rows: use all n"),
        "Z_L_rows with tokens as columns": ("rows", "return Z_L_rows with tokens as rows, (B, n+1, d+1)"),
    },
}
"""Per layout, the known convention slips: {name: (slip, advice in the layout's own terms)}, each
computed by _slip_outputs(case, **_SLIPS[slip]) and compared in the layout (MATH.md §13)."""


@functools.lru_cache(maxsize=None)
def _slipped(name, layout):
    """{slip name: its outputs in the layout} on a case, for the slips that apply; once per process."""
    case = next(c for c in _reference_cases() if c["name"] == name)
    out = {v: _slip_outputs(case, **_SLIPS[s]) for v, (s, _) in DIAGNOSIS_VARIANTS[layout].items()}
    return {v: _layout_outputs(case, layout, o) for v, o in out.items() if o is not None}


def _malformed(mine, ref):
    """What is wrong with a given array as such, as (kind, text) with kind "type" (missing, a string,
    not real numbers), "shape" or "value" (NaN or Inf); None when it is a real array of ref's shape."""
    if mine is None:
        return "type", "missing (None)"
    if isinstance(mine, (str, bytes)):
        return "type", f"not a numeric array ({type(mine).__name__}: a string is not a number)"
    try:
        a = np.asarray(mine)
    except (TypeError, ValueError, RuntimeError) as e:      # ragged lists; tensors still needing .detach()
        return "type", f"not a numeric array ({type(mine).__name__}: {e})"
    if a.dtype.kind not in "fiu":
        what = {"c": "complex", "b": "booleans", "U": "strings", "S": "bytes", "O": "Python objects"}.get(a.dtype.kind, "")
        return "type", f"not a numeric array (dtype {a.dtype}{': ' + what if what else ''}; give real numbers)"
    if a.shape != np.shape(ref):
        return "shape", f"shape {a.shape}, expected {np.shape(ref)}"
    if not np.all(np.isfinite(a)):
        return "value", "holds NaN or Inf"
    return None


def _close(mine, ref, rtol):
    """mine within rtol of ref's largest entry, entry by entry, and of ref's shape."""
    mine = np.asarray(mine, dtype=float)
    scale = max(np.max(np.abs(ref)), 1e-300)
    return mine.shape == np.shape(ref) and bool(np.all(np.abs(mine - ref) <= rtol * scale))


def _case(name):
    """The reference case of that name (read-only arrays)."""
    return next(c for c in _reference_cases() if c["name"] == name)


def _sizes(name):
    """A case's activation, L, H, d, n."""
    c = _case(name)
    return c["activation"], *map(int, c["P"].shape[:2]), int(c["Z"].shape[1] - 1), int(c["Z"].shape[2] - 1)


def _difficulty(name):
    """The order in which to read failing cases, simplest first: linear attention before the others,
    then fewer layers, fewer heads, smaller d and n (the reference cases' order breaks ties)."""
    activation, L, H, d, n = _sizes(name)
    return activation != "linear", L, H, d, n, [c["name"] for c in _reference_cases()].index(name)


def _title(name):
    """A case as the report names it: its name, activation, layers and heads."""
    activation, L, H, _, _ = _sizes(name)
    return f"{name} [{activation}, L={L}, H={H}]"


def _parameter_axes(layout, q, shape, H):
    """For a gradient output: its layer axis, the axis whose index gives the head and the head's width
    on it, and the authors' block axis (or None)."""
    if layout == "von_oswald":
        axis = 1 if q == "grad_W_o" else 2               # W_o: heads as row blocks; W_q, W_k, W_v: column blocks
        return 0, axis, shape[axis] // H, None
    return 0, 1, 1, 2 if layout == "authors" else None


def _where(name, layout, q, mine, ref, rtol):
    """How one output differs from icl_ref's (MATH.md §13): {"error": the largest difference relative
    to icl_ref's largest entry, "at": its index, "place": that index in the layout's terms, "spread":
    which part of the array differs beyond rtol (the query's token only, context tokens only, one
    layer, one head, one prompt, a constant factor of icl_ref's), or ""}. mine has ref's shape."""
    mine, ref = np.asarray(mine, dtype=float), np.asarray(ref, dtype=float)
    scale = max(float(np.max(np.abs(ref))), 1e-300)
    diff = np.abs(mine - ref)
    at = tuple(int(i) for i in np.unravel_index(np.argmax(diff), diff.shape))
    out = dict(error=float(np.max(diff)) / scale, at=at, place="", spread="")
    if out["error"] <= rtol:
        return out
    bad = diff > rtol * scale
    _, L, H, d, n = _sizes(name)
    parts = []
    if q in ("Z_L", "Z_L_rows"):
        (tokens, token), (coords, coord) = ((2, "column"), (1, "row")) if q == "Z_L" else ((1, "row"), (2, "column"))
        t, i = at[tokens], at[coords]
        out["place"] = (f"prompt {at[0]}, {token} {t}{' (the query)' if t == n else ''}, {coord} {i}"
                        f"{' (the label)' if i == d else ''}")
        wrong = set(np.flatnonzero(bad.any(axis=(0, coords))))
        tokens_differ = (f"only the query's {token}" if wrong == {n} else
                         f"only context {token}s ({len(wrong)} of {n}), not the query's" if n not in wrong else
                         f"the query's and {len(wrong) - 1} of {n} context {token}s" if len(wrong) <= n else
                         f"every {token}")
        if set(np.flatnonzero(bad.any(axis=(0, tokens)))) == {d}:
            entry = f"{q}[:, {d}, {n}]" if q == "Z_L" else f"{q}[:, {n}, {d}]"
            tokens_differ = (f"only the query's label entry {entry}" if wrong == {n} else
                             f"only the label {coord}, in {tokens_differ.replace('only ', '')}")
        parts.append(tokens_differ)
    elif q == "y_hat":
        out["place"] = f"prompt {at[0]}"
        if bad.sum() < bad.size:
            parts.append(f"{int(bad.sum())} of {bad.size} prompts")
    elif q == "loss":
        ratio = f"{float(mine) / float(ref):.4g}" if ref else "1"
        ratio = "," if ratio == "1" else f" = {ratio} x"
        out["place"] = f"yours {float(mine):.6g}{ratio} icl_ref's {float(ref):.6g}"
    else:
        layer, head, width, block = _parameter_axes(layout, q, mine.shape, H)
        where = np.nonzero(bad)
        layers, heads = set(where[layer]), set(where[head] // width)
        blocks = set(where[block]) if block is not None else set()
        names = f"layer {at[layer]}, head {at[head] // width}" + (
            f", the {('P', 'Q_code')[at[block]]} block" if block is not None else "")
        out["place"] = f"{q}[{', '.join(map(str, at))}] ({names})"
        if L > 1 and len(layers) == 1:
            parts.append(f"only layer {layers.pop()}")
        if H > 1 and len(heads) == 1:
            parts.append(f"only head {heads.pop()}")
        if len(blocks) == 1:
            parts.append(f"only the {('P', 'Q_code')[blocks.pop()]} blocks")
        if not parts and (L > 1 or H > 1):
            parts.append("every layer and head" if len(layers) == L and len(heads) == H else
                         f"layers {sorted(map(int, layers))}, heads {sorted(map(int, heads))}")
    ref_norm = float(np.sum(ref * ref))
    if mine.size > 1 and ref_norm > 0:                # a constant factor (a scale slip) says more than a place
        c = float(np.sum(mine * ref)) / ref_norm
        if f"{c:.4g}" != "1" and np.all(np.abs(mine - c * ref) <= rtol * scale * max(1.0, abs(c))):
            parts = ["all zeros" if not np.any(mine) else f"{c:.4g} x icl_ref's everywhere"]
    out["spread"] = "; ".join(parts)
    return out


def _judge(name, layout, given, rtol, culprits):
    """({output: "agrees" | slip name | "malformed: ..." | "unexplained"}, {output: _where}) for one
    case's outputs given in `layout`, each compared within rtol[output] of icl_ref's; adds "case:output"
    to culprits[slip name] for the slips that reproduce each mismatch. An array of another shape is
    malformed unless a slip explains it."""
    ref = _expected(name, layout)[1]
    found, where = {}, {}
    for q, mine in given.items():
        bad = _malformed(mine, ref[q])
        if bad and bad[0] != "shape":
            found[q] = f"malformed: {bad[1]}"
            continue
        if not bad:
            where[q] = _where(name, layout, q, mine, ref[q], rtol[q])
            if where[q]["error"] <= rtol[q]:
                found[q] = "agrees"
                continue
        match = [v for v, out in _slipped(name, layout).items() if q in out and _close(mine, out[q], rtol[q])]
        found[q] = match[0] if match else f"malformed: {bad[1]}" if bad else "unexplained"
        for v in match:
            culprits.setdefault(v, []).append(f"{name}:{q}")
    return found, where


MAX_REPORT_LINES = 25
"""The longest failure message (a screen): the likely cause, then one line per failing case, simplest
first; cases beyond it are counted, and the full table is in the report (MATH.md §13)."""


def _table(found, where, skipped=(), failed=()):
    """The full table: one line per case and output, its verdict, relative error, place and spread."""
    lines = []
    for name in sorted(found, key=_difficulty):
        for q, verdict in found[name].items():
            w = where[name].get(q)
            size = "" if w is None else f"; relative error {w['error']:.1e}"
            place = ("" if w is None or not w["place"] or verdict == "agrees" else
                     f" ({w['place']})" if q == "loss" else f" at {w['place']}")
            spread = f"; {w['spread']}" if w and w["spread"] and verdict != "agrees" else ""
            lines.append(f"{_title(name)} {q}: {verdict}{size}{place}{spread}")
    lines += [f"{_title(name)}: SKIPPED ({why})" for name, why in skipped]
    lines += [f"{_title(name)}: FAILED ({why})" for name, why in failed]
    return "\n".join(lines)


def _case_line(name, found, where):
    """What one failing case shows, for its line: each output that differs, grouped by the slip that
    explains it, with its largest error, and where it is confined when no slip explains it; the
    outputs that agree."""
    by_slip, items = {}, []
    for q, verdict in found.items():
        if verdict == "unexplained":
            w = where[q]
            confined = "; ".join(part for part in w["spread"].split("; ") if part and not part.startswith("every"))
            items.append(f"{q} {w['error']:.1e}" + (f" ({confined})" if confined else ""))
        elif verdict.startswith("malformed: "):
            items.append(f"{q} {verdict}")
        elif verdict != "agrees":
            by_slip.setdefault(verdict, []).append(q)
    for slip, qs in by_slip.items():
        worst = max((q for q in qs if q in where), key=lambda q: where[q]["error"], default=None)
        items.append(f"{'every output' if len(qs) == len(found) else ', '.join(qs)}: {slip}"
                     + (f" (largest error {where[worst]['error']:.1e}{'' if len(qs) == 1 else f', {worst}'})"
                        if worst else ""))
    agree = [q for q, verdict in found.items() if verdict == "agrees"]
    return "; ".join(items) + (f"; agree: {', '.join(agree)}" if agree else "")


def _case_lines(failing, found, where):
    """One line per failing case, simplest first; consecutive cases whose lines would say the same
    thing share one (named and counted, or "all N cases" when every case checked does)."""
    runs = []                                                  # [text, names]
    for name in failing:
        text = _case_line(name, found[name], where[name])
        if runs and runs[-1][0] == text:
            runs[-1][1].append(name)
        else:
            runs.append([text, [name]])
    return [f"  {_title(names[0])}: {text}" if len(names) == 1 else
            f"  all {len(names)} cases: {text}" if len(names) == len(found) else
            f"  {', '.join(names)} ({len(names)} cases): {text}" for text, names in runs]


def _advice(name, found, unexplained, outputs):
    """What to do next about the outputs of case `name` no slip explains, by what differs: the forward
    pass (compare it entry by entry), the loss alone (its definition), or the gradients alone."""
    forward = [q for q in unexplained if q.startswith(("Z_L", "y_hat"))]
    if forward:
        return (f"Compare {forward[0]} entry by entry on {name} (its inputs: reference_cases()); {forward[0]} is "
                f"{outputs[forward[0]]}.")
    given = [q for q in found if q.startswith(("Z_L", "y_hat"))]
    agree = ["the forward pass"] if given and all(found[q] == "agrees" for q in given) else []
    if "loss" in unexplained:
        differs = "The forward pass agrees but the loss differs" if agree else "The loss differs"
        return f"{differs}: here it is {outputs['loss']}."
    agree += ["the loss"] if found.get("loss") == "agrees" else []
    lead = f"{' and '.join(agree).capitalize()} agree{'s' if len(agree) == 1 else ''}: compare" if agree else "Compare"
    return f"{lead} the gradients with central differences of your own loss, one array at a time."


def _summary(title, found, where, culprits, layout, skipped=(), failed=(), probe=(), table_hint="", float64=False):
    """The short report, `title` its first line, at most MAX_REPORT_LINES lines: the likely cause
    first, in the layout's terms; for mismatches no known slip reproduces, the simplest case that has
    one, each output's largest error and where it sits; then one line per failing case, simplest
    first (fn's refusals among them), what was skipped, and where the full table is. Only cases that
    differ are named. float64: the check's dtype, where differences of float32's size suggest a model
    computing in float32."""
    outputs = LAYOUTS[layout][1]
    failing = sorted([n for n, fs in found.items() if any(f != "agrees" for f in fs.values())], key=_difficulty)
    verdicts = [f for fs in found.values() for f in fs.values()]
    if not failing and not failed:
        return "Everything agrees within rtol." + "".join(f"\nSkipped: {n} ({why})" for n, why in skipped)
    head = [title]
    if culprits:
        mismatches = sum(f != "agrees" and not f.startswith("malformed") for f in verdicts)
        head.append("Likely causes, most frequent first:" if len(culprits) > 1 else "Likely cause:")
        ranked = sorted(culprits.items(), key=lambda kv: -len(kv[1]))
        for v, seen in ranked[:3]:
            head.append(f"- {v} (reproduces {len(seen)} of {mismatches} mismatches, in "
                        f"{len({s.split(':')[0] for s in seen})} cases): {DIAGNOSIS_VARIANTS[layout][v][1]}")
        if len(ranked) > 3:
            head.append(f"- and {len(ranked) - 3} other slips that reproduce fewer (the full table)")
    lost = [n for n in failing if "unexplained" in found[n].values()]
    if lost:
        first = lost[0]
        activation, L, H, _, _ = _sizes(first)
        unexplained = [q for q, f in found[first].items() if f == "unexplained"]
        count = sum(f == "unexplained" for f in verdicts)
        head.append(f"{'No' if not culprits else 'Beyond these, no'} known slip reproduces {count} "
                    f"mismatch{'es' if count > 1 else ''}. Start with {first} ({activation} attention, L = {L}, "
                    f"H = {H}), the simplest case where one appears:")
        for q in unexplained:
            w = where[first][q]
            head.append(f"  {q}: relative error {w['error']:.1e}" + (f" ({w['place']})" if q == "loss" else
                                                                      f" at {w['place']}" if w["place"] else "")
                        + (f"; {w['spread']}" if w["spread"] else ""))
        head += [f"  {line}" for line in probe]
        largest = max(where[n][q]["error"] for n in lost for q, f in found[n].items() if f == "unexplained")
        if float64 and largest < 1e-4:
            head.append(f"  The largest of these differences is {largest:.1e} relative, float32's rounding: does the "
                        "model compute in float32? (JAX does unless jax_enable_x64 is set.)")
        head.append("  " + _advice(first, found[first], unexplained, outputs))
    if any(f.startswith("malformed") for f in verdicts):
        head.append("Some arrays are malformed (named below): fix them before comparing numbers.")
    cases = _case_lines(failing, found, where)
    cases += [f"  {_title(n)}: FAILED ({why})" for n, why in sorted(failed, key=lambda f: _difficulty(f[0]))]
    tail = [f"Skipped: {', '.join(f'{n} ({why})' for n, why in skipped)}"] if skipped else []
    tail += [table_hint] if table_hint else []
    room = MAX_REPORT_LINES - len(head) - len(tail) - 1
    if len(cases) > room:
        cases = cases[:room - 1] + [f"  ... and {len(cases) - room + 1} more (the full table)"]
    return "\n".join(head + [f"Cases that differ, simplest first ({len(found) - len(failing)} of "
                             f"{len(found) + len(failed)} agree; indices 0-based):"] + cases + tail)


def _probe(fn, name, layout, dt, wanted, tol):
    """Where in the model a case starts to differ, found by running fn on parts of it (MATH.md §13):
    its first l < L layers, and each head alone (the other heads' P set to 0, so every head keeps its
    index; not in the authors' layout, whose P blocks carry a fixed 1), comparing the outputs
    `wanted`. Lines of text; none when the case has one layer and one head, or fn cannot run a part
    (it raises, or returns other shapes)."""
    case = _case(name)
    _, L, H, _, n = _sizes(name)

    def agrees(P, Q):
        part = dict(case, P=P, Q=Q)
        inputs = {k: np.array(v, dtype=dt) for k, v in _layout_inputs(part, layout).items()}
        given = fn(dict(inputs, activation=case["activation"], n=n, L=int(P.shape[0]), H=int(P.shape[1])))
        ref = _layout_outputs(part, layout, _case_outputs(P, Q, case["Z"], case["y"], case["activation"]))
        if any(_malformed(given[q], ref[q]) for q in wanted):
            raise ValueError("fn returned other shapes for a part of the case")
        return all(_close(given[q], ref[q], tol[q]) for q in wanted)
    found = []
    try:
        if L > 1:
            prefix = [agrees(case["P"][:l], case["Q"][:l]) for l in range(1, L)]
            k = prefix.index(False) if False in prefix else L - 1
            found.append("layer 0 run alone already differs" if k == 0 else
                         f"{'layer 0' if k == 1 else f'layers 0..{k - 1}'} run alone agree{'s' if k == 1 else ''}, "
                         f"with layer {k} it differs")
        if H > 1 and layout != "authors":
            alone = []
            for h in range(H):
                P = case["P"].copy()
                P[:, [g for g in range(H) if g != h]] = 0.0
                alone.append(agrees(P, case["Q"]))
            differ = [h for h, ok in enumerate(alone) if not ok]
            found.append("each head run alone (the others' P = 0) agrees: their sum differs" if not differ else
                         f"run alone (the others' P = 0), only head {differ[0]} differs" if len(differ) == 1 else
                         "every head run alone (the others' P = 0) differs" if len(differ) == H else
                         f"run alone (the others' P = 0), heads {differ} differ")
    except Exception:                  # fn cannot run a part: the report keeps what the whole case showed
        return []
    return [f"Run in parts: {'; '.join(found)}."] if found else []


def _names(arg, what, allowed):
    """A name or an iterable of names, each among `allowed`, as a non-empty tuple; else an error naming `what`."""
    try:
        names = (arg,) if isinstance(arg, str) else tuple(arg)
    except TypeError:
        raise TypeError(f"{what} must be a name or a list of names, got {type(arg).__name__}") from None
    bad = [x for x in names if not isinstance(x, str) or x not in allowed]
    if bad or not names:
        raise ValueError(f"{what} must name one or more of {', '.join(allowed)}; got {bad or 'none'}")
    return names


def _layout_name(layout):
    """layout, one of LAYOUTS' keys (a string), or an error naming the argument."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise (ValueError if isinstance(layout, str) else TypeError)(
            f"layout must be one of the strings {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    return layout


def diagnose(outputs, rtol=1e-6, layout="paper", full=False):
    """Compare another implementation's outputs on the reference cases with icl_ref, and name the known
    convention slip that reproduces each mismatch, or say where it sits (MATH.md §13).

    outputs: {case name: {output: array}} with any of the layout's outputs (LAYOUTS; paper: Z_L, y_hat,
    loss, dP, dQ), computed by the user's code on the inputs of reference_cases() (or the reference
    vectors). rtol: relative to the largest entry of icl_ref's array (1e-6 suits float64 code; float32
    code needs about 1e-4). Empty input (no case, or a case with no array) is a ValueError. An array
    that is missing (None), not real numbers, of the wrong shape or not finite is named as malformed
    before any comparison. Returns (report, found): a plain-text report a person can act on, at most
    MAX_REPORT_LINES lines (the likely cause in the layout's terms, DIAGNOSIS_VARIANTS; for a mismatch
    no slip explains, the simplest case that has it, each output's largest relative error, where it
    sits and how far it spreads; one line per case that differs), followed with full=True by the full
    table (every case and output); and {case: {output: "agrees" | slip name | "malformed: ..." |
    "unexplained"}}.
    """
    if not isinstance(outputs, dict):
        raise TypeError(f"outputs must be a dict {{case name: {{output: array}}}}, got {type(outputs).__name__}")
    if not outputs:
        raise ValueError("outputs is empty: give at least one case, {case name: {output: array}}")
    rtol = _nonneg("rtol", rtol)
    layout = _layout_name(layout)
    full = _flag("full", full)
    _names(tuple(outputs), "outputs' cases", _cases_of(layout))
    allowed = LAYOUTS[layout][1]
    for name, given in outputs.items():
        if not isinstance(given, dict) or not set(given) <= set(allowed):
            raise ValueError(f"outputs[{name!r}] must be a dict with keys among {', '.join(allowed)}")
        if not given:
            raise ValueError(f"outputs[{name!r}] holds no arrays: give any of {', '.join(allowed)}")
    found, where, culprits = {}, {}, {}
    for name, given in outputs.items():
        found[name], where[name] = _judge(name, layout, given, dict.fromkeys(given, rtol), culprits)
    failing = sum(any(f != "agrees" for f in fs.values()) for fs in found.values())
    text = _summary(f"{failing} of {len(found)} cases differ from icl_ref ({layout} layout, rtol {rtol:g}):", found,
                    where, culprits, layout, table_hint="" if full else "Full table: diagnose(..., full=True).")
    return (text + "\n\nFull table:\n" + _table(found, where) if full else text), found


CHECK_TOLERANCES = {"float64": dict(forward=1e-12, loss=1e-12, gradient=1e-10),
                    "float32": dict(forward=1e-5, loss=1e-4, gradient=1e-4)}
"""check_implementation's default tolerances, relative to the largest entry of icl_ref's array: those
of VECTOR_TOLERANCES, for the forward pass (Z_L, Z_L_rows, y_hat), the loss and the gradients (dP,
dQ, grad_*)."""


class Mismatch(AssertionError):
    """check_implementation's failure. Its message is the short report (at most MAX_REPORT_LINES
    lines; with full=True the full table follows); `report` is the whole report, the dict
    check_implementation returns when it passes, with report["table"] every case and output."""

    def __init__(self, message, report):
        super().__init__(message)
        self.report = report


def check_implementation(fn, layout="paper", dtype=np.float64, *, cases=None, outputs=None, skip=(), rtol=None,
                         full=False):
    """Run another implementation on the reference cases and compare its outputs with icl_ref's
    (MATH.md §13). `icl_check.check_implementation(my_fn)` is the whole test, in any test runner.

    fn(inputs) receives one case as a dict: the layout's input arrays (below) as fresh `dtype` copies,
    and activation (str), n, L, H (int). It returns {output: array} with every output of the layout,
    or only those `outputs` names; or it raises NotImplementedError, which fails the check unless
    `skip` names the case (then it is reported as skipped, never as passed).
    layout: "paper", "authors" or "von_oswald" (LAYOUTS). dtype: np.float64 or np.float32 (required).
    cases: a case name or names (default: every case of the layout), e.g. one pytest test per case:
        @pytest.mark.parametrize("case", [c["name"] for c in icl_check.reference_cases() if "paper" in c["layouts"]])
    outputs: the outputs to require and compare (default: all). skip: cases fn may decline.
    rtol: None (CHECK_TOLERANCES[dtype]: Z_L, Z_L_rows, y_hat by "forward", loss by "loss", dP, dQ,
    grad_* by "gradient"), one number for every output, or {output: rtol} overriding those named;
    relative to the largest entry of icl_ref's array. full: put the full table in the failure message.

    Raises TypeError or ValueError naming the argument, or naming the case and output when fn returns
    no dict, misses an output, returns an unknown one, or one that is not a real array (None, a
    string, complex, objects) or of the wrong shape. Raises Mismatch (an AssertionError) when a case
    fails or none was checked; its message, at most MAX_REPORT_LINES lines, shown in pytest without
    icl_check's frames, says first the likely cause in the layout's terms (the convention slips of
    DIAGNOSIS_VARIANTS[layout] that reproduce the mismatches); for a mismatch no slip explains, the
    simplest case that has it (linear before the other attentions, then fewer layers and heads), each
    output's largest relative error, where it sits (prompt, token, row; a parameter's layer, head and
    entry) and how far it spreads (the query's token only, one layer, one head, a constant factor),
    and where in the model it starts: fn is run on the case's first layers and on each head alone
    (the other heads' P = 0); then one line per failing case, simplest first. Returns the report:
    layout, dtype, icl_ref_version, outputs, rtol {output: rtol}, cases {name: {"status": "passed" |
    "skipped" | "failed", "quantities": {output: verdict}, "where": {output: {"error", "at", "place",
    "spread"}}, "reason": ...}}, text (the short report) and table (every case and output). The
    reference outputs are computed once per process; fn receives copies.

    Layouts (LAYOUTS):
    """
    __tracebackhide__ = True                      # pytest: show the diagnosis, not icl_check's frames
    if not callable(fn):
        raise TypeError(f"fn must be callable, fn(inputs: dict) -> dict of outputs, got {type(fn).__name__}")
    layout = _layout_name(layout)
    try:
        dt = np.dtype(dtype) if dtype is not None else None      # np.dtype(None) would be float64
    except TypeError:
        dt = None
    if dt is None or dt.name not in CHECK_TOLERANCES:
        raise (TypeError if dt is None else ValueError)(f"dtype must be np.float64 or np.float32, got {dtype!r}")
    available = _cases_of(layout)
    names = available if cases is None else _names(cases, "cases", available)
    skip = _names(skip, "skip", available) if skip else ()
    full = _flag("full", full)
    allowed = LAYOUTS[layout][1]
    wanted = tuple(allowed) if outputs is None else _names(outputs, "outputs", tuple(allowed))
    kind = {q: "gradient" if q.startswith(("d", "grad_")) else "loss" if q == "loss" else "forward" for q in wanted}
    tol = {q: CHECK_TOLERANCES[dt.name][kind[q]] for q in wanted}
    if isinstance(rtol, dict):
        tol.update({q: _nonneg(f"rtol[{q!r}]", rtol[q]) for q in _names(tuple(rtol), "rtol's keys", wanted)})
    elif rtol is not None:
        tol = dict.fromkeys(wanted, _nonneg("rtol", rtol))
    report = dict(layout=layout, dtype=dt.name, icl_ref_version=__version__, outputs=wanted, rtol=tol, cases={})
    found, where, culprits, skipped, refused = {}, {}, {}, [], []
    for name in names:
        case = _case(name)
        inputs = {k: np.array(v, dtype=dt) for k, v in _expected(name, layout)[0].items()}
        L, H = case["P"].shape[:2]
        try:
            given = fn(dict(inputs, activation=case["activation"], n=int(case["Z"].shape[2] - 1), L=int(L), H=int(H)))
        except NotImplementedError as e:
            why = f"NotImplementedError: {e}" if str(e) else "NotImplementedError"
            if name in skip:
                skipped.append((name, why))
            else:
                refused.append((name, f"fn raised {why}; skip= does not name it"))
            report["cases"][name] = dict(status="skipped" if name in skip else "failed", quantities={}, where={},
                                         reason=why if name in skip else refused[-1][1])
            continue
        if not isinstance(given, dict):
            raise TypeError(f"fn must return a dict {{output: array}}; for case {name!r} it returned {type(given).__name__}")
        missing, unknown = [q for q in wanted if q not in given], [str(q) for q in given if q not in allowed]
        if missing or unknown:
            raise ValueError(f"fn's outputs for case {name!r}: " + "; ".join(
                ([f"missing {', '.join(missing)} (outputs= names the ones to check)"] if missing else [])
                + ([f"unknown {', '.join(unknown)} (the {layout} layout's are {', '.join(allowed)})"] if unknown else [])))
        for q in wanted:
            bad = _malformed(given[q], _expected(name, layout)[1][q])
            if bad and bad[0] == "type":
                raise TypeError(f"fn's output {q!r} for case {name!r} is {bad[1]}")
        found[name], where[name] = _judge(name, layout, {q: given[q] for q in wanted}, tol, culprits)
        shapes = [f"{q} has {f[len('malformed: '):]}" for q, f in found[name].items() if f.startswith("malformed: shape")]
        if shapes:
            raise ValueError(f"fn's outputs for case {name!r}: {'; '.join(shapes)} ({layout} layout, LAYOUTS)")
        ok = all(f == "agrees" for f in found[name].values())
        report["cases"][name] = dict(status="passed" if ok else "failed", quantities=found[name], where=where[name])
    failing = [n for n, c in report["cases"].items() if c["status"] == "failed"]
    lost = sorted((n for n in found if "unexplained" in found[n].values()), key=_difficulty)
    if lost:            # where the forward pass starts to differ; the gradients' only when it agrees
        forward = [q for q in wanted if kind[q] != "gradient" and found[lost[0]][q] != "agrees"]
        probe = _probe(fn, lost[0], layout, dt, forward or wanted, tol)
    else:
        probe = []
    title = (f"the implementation differs from icl_ref on {len(failing)} of {len(report['cases'])} cases "
             f"({layout} layout, {dt.name}):")
    report["table"] = _table(found, where, skipped, refused)
    report["text"] = _summary(title, found, where, culprits, layout, skipped, refused, probe,
                              "" if full else "Full table: the exception's .report['table'], or full=True.",
                              float64=dt == np.float64)
    message = report["text"] + ("\n\nFull table:\n" + report["table"] if full else "")
    if failing:
        raise Mismatch(message, report)
    if not any(c["status"] == "passed" for c in report["cases"].values()):
        raise Mismatch(f"no reference case was checked ({layout} layout): fn skipped every case\n{message}", report)
    return report


check_implementation.__doc__ = check_implementation.__doc__.rstrip(" ") + _layouts_text() + "\n"


# ---------------------------------------------------------------------------------------------
# The command line: python3 -m icl_check vectors --out DIR
# ---------------------------------------------------------------------------------------------

def _main(argv=None):
    """python3 -m icl_check [--version] [vectors --out DIR [--overwrite]] (MATH.md §13). A refused
    --out is the subcommand's usage and the reason; a write the system refuses is its message; both
    exit with status 2."""
    ap = argparse.ArgumentParser(
        prog="python3 -m icl_check", description="icl_check: the conformance kit of icl_ref, a NumPy reference for the linear transformer of Ahn et al. "
        "(2023). Derivations: MATH.md (the repository; installed in <prefix>/share/doc/icl_ref).")
    ap.add_argument("--version", action="version", version=f"icl_ref {__version__}")
    sub = ap.add_subparsers(dest="command")
    v = sub.add_parser("vectors", help="write the reference vectors (.npz per case and manifest.json)")
    v.add_argument("--out", required=True, help="directory to write into (created if needed; must be new or empty)")
    v.add_argument("--overwrite", action="store_true",
                   help="replace an earlier set of reference vectors in --out (refused if it holds other files, "
                        "changed files or symbolic links)")
    args = ap.parse_args(argv)
    if args.command is None:
        ap.print_help()
        return 0
    try:
        manifest = write_reference_vectors(args.out, overwrite=args.overwrite)
    except (TypeError, ValueError) as e:               # icl_files.Refused: --out as it is cannot be used
        v.error(str(e))
    except OSError as e:                               # icl_files.WriteFailed: disk full, ulimit -f, permission
        try:
            print(f"{v.prog}: error: {e}", file=sys.stderr)
        except OSError:                                # stderr full as well: the status still says it
            pass
        return 2
    try:
        print(f"wrote {len(manifest['cases'])} cases and manifest.json to {args.out}", flush=True)
    except OSError:                                    # stdout closed (`| true`) or full: the vectors are written
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # so the flush at exit is quiet
        except (OSError, ValueError, AttributeError):
            pass
    return 0


if __name__ == "__main__":
    sys.exit(_main())
