"""icl_check: the conformance kit for implementations of the linear transformer of Ahn et al. (2023).

Checks another implementation (PyTorch, JAX, NumPy, or any language through the vectors' files)
against icl_ref, in the paper's layout or in the authors' or von Oswald et al.'s, and names the
convention slip behind a mismatch (MATH.md §13). Built on icl_ref's public names; icl_ref itself
checks nothing of anyone else's.

    reference_cases()                          the inputs: small deterministic cases, every structure
                                               and activation
    check_implementation(fn, layout, dtype)    one call is the whole test, in any test runner
    diagnose(outputs, layout=...)              the same comparison for arrays computed elsewhere
    write_reference_vectors(out)               one .npz per case and manifest.json (the same bytes on
                                               every run), for code that cannot import Python;
                                               python3 -m icl_check vectors --out DIR
    LAYOUTS, DIAGNOSIS_VARIANTS                 what each layout's inputs and outputs mean; the slips
    CHECK_TOLERANCES, VECTOR_TOLERANCES         the default tolerances, with their reasons

Sections follow MATH.md §13.
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
from icl_ref import _flag, _nonneg

__version__ = ir.__version__

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


def reference_cases():
    """The inputs of the reference vectors: a list of dicts (name, description, activation, structure,
    Z, y, P, Q, and the covariances Sigma, Sigma_w its prompts were drawn with), deterministic (fixed
    seeds), built once per process; fresh copies on every call. MATH.md §13."""
    return [{k: v.copy() if isinstance(v, np.ndarray) else v for k, v in c.items()} for c in _reference_cases()]


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
            ir.params_to_authors(case["P"], case["Q"])
            layouts.append("authors")
        except ValueError:
            pass
    if case["activation"] in ("linear", "softmax"):
        layouts.append("von_oswald")
    return layouts


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
    out = dict(Z_rows=ir.tokens_as_rows(case["Z"]), y=case["y"])
    if layout == "authors":
        return dict(out, allparam=ir.params_to_authors(case["P"], case["Q"]))
    return dict(out, **_case_von_oswald_weights(case))


def _layout_outputs(case, layout, out):
    """icl_ref's outputs in the paper's layout (any subset of Z_L, y_hat, loss, dP, dQ) as the
    layout's outputs (LAYOUTS)."""
    if layout == "paper":
        return dict(out)
    res = {k: v for k, v in (("Z_L_rows", out.get("Z_L")), ("y_hat", out.get("y_hat"))) if v is not None}
    if "Z_L_rows" in res:
        res["Z_L_rows"] = np.swapaxes(res["Z_L_rows"], 1, 2)
    scale = 1.0 if layout == "authors" else ir.VON_OSWALD_LOSS_SCALE
    if "loss" in out:
        res["loss"] = scale * np.asarray(out["loss"])
    if "dP" in out and "dQ" in out:
        if layout == "authors":
            res["grad_allparam"] = ir.grads_to_authors(out["dP"], out["dQ"])
        else:
            W = _case_von_oswald_weights(case)
            grads = ir.grads_to_von_oswald(out["dP"], out["dQ"], *W.values(), case["Z"].shape[2] - 1,
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
    files["manifest.json"] = (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()   # last: it vouches
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


def _judge(name, layout, given, rtol, culprits):
    """{output: "agrees" | slip name | "malformed: ..." | "unexplained"} for one case's outputs given in
    `layout`, each compared within rtol[output] of icl_ref's; adds "case:output" to culprits[slip name]
    for the slips that reproduce each mismatch. An array of another shape is malformed unless a slip
    explains it."""
    ref = _expected(name, layout)[1]
    found = {}
    for q, mine in given.items():
        bad = _malformed(mine, ref[q])
        if bad and bad[0] != "shape":
            found[q] = f"malformed: {bad[1]}"
            continue
        if not bad and _close(mine, ref[q], rtol[q]):
            found[q] = "agrees"
            continue
        match = [v for v, out in _slipped(name, layout).items() if q in out and _close(mine, out[q], rtol[q])]
        found[q] = match[0] if match else f"malformed: {bad[1]}" if bad else "unexplained"
        for v in match:
            culprits.setdefault(v, []).append(f"{name}:{q}")
    return found


def _report(found, culprits, layout, skipped=()):
    """The plain-text report of diagnose and check_implementation, its advice in the layout's terms."""
    lines = []
    for name, verdicts in found.items():
        agree = [q for q, f in verdicts.items() if f == "agrees"]
        differ = [f"{q} ({f})" for q, f in verdicts.items() if f != "agrees"]
        lines.append(f"{name}: " + (f"agrees on {', '.join(agree)}" if agree else "agrees on nothing")
                     + (f"; DIFFERS on {', '.join(differ)}" if differ else ""))
    lines += [f"{name}: SKIPPED ({why})" for name, why in skipped]
    if culprits:
        lines += ["", "Likely causes, most frequent first:"]
        for v, where in sorted(culprits.items(), key=lambda kv: -len(kv[1])):
            lines.append(f"- {v} (reproduces {len(where)} mismatches, e.g. {where[0]}): "
                         f"{DIAGNOSIS_VARIANTS[layout][v][1]}")
    verdicts = [(q, f) for fs in found.values() for q, f in fs.items()]
    if any(f.startswith("malformed") for _, f in verdicts):
        lines.append("Some arrays are malformed (see above): fix them before comparing numbers.")
    lost = {q for q, f in verdicts if f == "unexplained"}
    outputs = LAYOUTS[layout][1]
    forward = [q for q in outputs if q.startswith(("Z_L", "y_hat")) and q in lost]
    if forward:
        lines.append(f"{', '.join(forward)} differ(s) in no known way: run the one-layer case small-full and "
                     f"compare {forward[0]}, {outputs[forward[0]]}, token by token.")
    elif "loss" in lost:
        lines.append(f"The forward pass agrees but the loss differs in no known way: here it is {outputs['loss']}.")
    elif lost:
        lines.append(f"The forward pass and the loss agree; {', '.join(sorted(lost))} differ(s) in no known way: "
                     "compare with central differences of your own loss, one array at a time.")
    elif verdicts and all(f == "agrees" for _, f in verdicts):
        lines.append("Everything agrees within rtol.")
    return "\n".join(lines)


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


def diagnose(outputs, rtol=1e-6, layout="paper"):
    """Compare another implementation's outputs on the reference cases with icl_ref, and name the known
    convention slip that reproduces each mismatch (MATH.md §13).

    outputs: {case name: {output: array}} with any of the layout's outputs (LAYOUTS; paper: Z_L, y_hat,
    loss, dP, dQ), computed by the user's code on the inputs of reference_cases() (or the reference
    vectors). rtol: relative to the largest entry of icl_ref's array (1e-6 suits float64 code; float32
    code needs about 1e-4). Empty input (no case, or a case with no array) is a ValueError. An array
    that is missing (None), not real numbers, of the wrong shape or not finite is named as malformed
    before any comparison. Returns (report, found): a plain-text report a person can act on, its
    advice in the layout's terms (DIAGNOSIS_VARIANTS), and {case: {output: "agrees" | slip name |
    "malformed: ..." | "unexplained"}}.
    """
    if not isinstance(outputs, dict):
        raise TypeError(f"outputs must be a dict {{case name: {{output: array}}}}, got {type(outputs).__name__}")
    if not outputs:
        raise ValueError("outputs is empty: give at least one case, {case name: {output: array}}")
    rtol = _nonneg("rtol", rtol)
    layout = _layout_name(layout)
    _names(tuple(outputs), "outputs' cases", _cases_of(layout))
    allowed = LAYOUTS[layout][1]
    for name, given in outputs.items():
        if not isinstance(given, dict) or not set(given) <= set(allowed):
            raise ValueError(f"outputs[{name!r}] must be a dict with keys among {', '.join(allowed)}")
        if not given:
            raise ValueError(f"outputs[{name!r}] holds no arrays: give any of {', '.join(allowed)}")
    found, culprits = {}, {}
    for name, given in outputs.items():
        found[name] = _judge(name, layout, given, dict.fromkeys(given, rtol), culprits)
    return _report(found, culprits, layout), found


CHECK_TOLERANCES = {"float64": dict(forward=1e-12, loss=1e-12, gradient=1e-10),
                    "float32": dict(forward=1e-5, loss=1e-4, gradient=1e-4)}
"""check_implementation's default tolerances, relative to the largest entry of icl_ref's array: those
of VECTOR_TOLERANCES, for the forward pass (Z_L, Z_L_rows, y_hat), the loss and the gradients (dP,
dQ, grad_*)."""


def check_implementation(fn, layout="paper", dtype=np.float64, *, cases=None, outputs=None, skip=(), rtol=None):
    """Run another implementation on the reference cases and compare its outputs with icl_ref's
    (MATH.md §13). `icl_ref.check_implementation(my_fn)` is the whole test, in any test runner.

    fn(inputs) receives one case as a dict: the layout's input arrays (below) as fresh `dtype` copies,
    and activation (str), n, L, H (int). It returns {output: array} with every output of the layout,
    or only those `outputs` names; or it raises NotImplementedError, which fails the check unless
    `skip` names the case (then it is reported as skipped, never as passed).
    layout: "paper", "authors" or "von_oswald" (LAYOUTS). dtype: np.float64 or np.float32 (required).
    cases: a case name or names (default: every case of the layout), e.g. one pytest test per case:
        @pytest.mark.parametrize("case", [c["name"] for c in icl_ref.reference_cases()])
    outputs: the outputs to require and compare (default: all). skip: cases fn may decline.
    rtol: None (CHECK_TOLERANCES[dtype]: Z_L, Z_L_rows, y_hat by "forward", loss by "loss", dP, dQ,
    grad_* by "gradient"), one number for every output, or {output: rtol} overriding those named;
    relative to the largest entry of icl_ref's array.

    Raises TypeError or ValueError naming the argument, or naming the case and output when fn returns
    no dict, misses an output, returns an unknown one, or one that is not a real array (None, a
    string, complex, objects) or of the wrong shape. Raises AssertionError, its message the diagnosis
    in the layout's terms (which outputs agree, which convention slip of DIAGNOSIS_VARIANTS[layout]
    reproduces each mismatch, which arrays hold NaN or Inf), when a case fails or none was checked;
    in pytest the message is shown without icl_ref's frames. Returns the report: layout, dtype,
    icl_ref_version, outputs, rtol {output: rtol}, cases {name: {"status": "passed" | "skipped" |
    "failed", "quantities": {output: verdict}, "reason": ...}} and text. The reference outputs are
    computed once per process; fn receives copies.

    Layouts (LAYOUTS):
    """
    __tracebackhide__ = True                      # pytest: show the diagnosis, not icl_ref's frames
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
    allowed = LAYOUTS[layout][1]
    wanted = tuple(allowed) if outputs is None else _names(outputs, "outputs", tuple(allowed))
    kind = {q: "gradient" if q.startswith(("d", "grad_")) else "loss" if q == "loss" else "forward" for q in wanted}
    tol = {q: CHECK_TOLERANCES[dt.name][kind[q]] for q in wanted}
    if isinstance(rtol, dict):
        tol.update({q: _nonneg(f"rtol[{q!r}]", rtol[q]) for q in _names(tuple(rtol), "rtol's keys", wanted)})
    elif rtol is not None:
        tol = dict.fromkeys(wanted, _nonneg("rtol", rtol))
    report = dict(layout=layout, dtype=dt.name, icl_ref_version=__version__, outputs=wanted, rtol=tol, cases={})
    found, culprits, skipped = {}, {}, []
    for name in names:
        case = next(c for c in _reference_cases() if c["name"] == name)
        inputs = {k: np.array(v, dtype=dt) for k, v in _expected(name, layout)[0].items()}
        L, H = case["P"].shape[:2]
        try:
            given = fn(dict(inputs, activation=case["activation"], n=int(case["Z"].shape[2] - 1), L=int(L), H=int(H)))
        except NotImplementedError as e:
            why = f"NotImplementedError: {e}" if str(e) else "NotImplementedError"
            if name in skip:
                skipped.append((name, why))
            report["cases"][name] = dict(status="skipped" if name in skip else "failed", quantities={},
                                         reason=why if name in skip else f"fn raised {why}; skip= does not name it")
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
        found[name] = _judge(name, layout, {q: given[q] for q in wanted}, tol, culprits)
        shapes = [f"{q} has {f[len('malformed: '):]}" for q, f in found[name].items() if f.startswith("malformed: shape")]
        if shapes:
            raise ValueError(f"fn's outputs for case {name!r}: {'; '.join(shapes)} ({layout} layout, LAYOUTS)")
        ok = all(f == "agrees" for f in found[name].values())
        report["cases"][name] = dict(status="passed" if ok else "failed", quantities=found[name])
    text = _report(found, culprits, layout, skipped)
    bad = [(name, c.get("reason")) for name, c in report["cases"].items() if c["status"] == "failed"]
    report["text"] = text + "".join(f"\n{name}: FAILED ({reason})" for name, reason in bad if reason)
    if bad:
        raise AssertionError(f"the implementation differs from icl_ref ({layout} layout, {dt.name}):\n{report['text']}")
    if not any(c["status"] == "passed" for c in report["cases"].values()):
        raise AssertionError(f"no reference case was checked ({layout} layout): fn skipped every case\n{report['text']}")
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
        print(f"{v.prog}: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {len(manifest['cases'])} cases and manifest.json to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(_main())