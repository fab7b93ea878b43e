"""Copy this file into your project to check a JAX linear transformer in von Oswald et al.'s layout
against icl_ref.

The model below follows "Transformers learn in-context by gradient descent" (von Oswald et al.,
2023; google-research/self-organising-systems, transformers_learn_icl_by_gd): tokens as rows
(B, n+1, d+1); per layer projections W_q, W_k (d+1, H k), W_v (d+1, H v) with heads as column
blocks, an output projection W_o (H v, d+1); scores over the n context keys only, no 1/n; linear
or softmax (scores / sqrt(k)); the same weights in every layer (tied, their default) or per layer;
prediction -out[n, d]; loss 0.5 * mean. icl_ref's params_from_von_oswald and grads_to_von_oswald
map it to the paper's layout. Skipped when JAX is not installed (CI's frameworks leg installs it).
Run: python -m pytest examples/
"""
import numpy as np
import pytest

import icl_check as ic
import icl_ref as ir

jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", True)
jnp = jax.numpy

# float64 on both sides: exact computations in the same precision (rounding only)
FORWARD_RTOL, LOSS_RTOL, GRAD_RTOL = 1e-12, 1e-12, 1e-10


ACTIVATIONS = ("linear", "softmax")


def model(W, E, heads, layers, activation):
    """Their layer stack; W = (W_q, W_k, W_v, W_o), each 2-d (tied) or 3-d (per layer)."""
    if activation not in ACTIVATIONS:              # a new activation fails the check until it is written here
        raise NotImplementedError(f"{activation} attention (this model has {', '.join(ACTIVATIONS)})")
    B, N, D = E.shape
    n = N - 1
    for l in range(layers):
        Wq, Wk, Wv, Wo = (w if w.ndim == 2 else w[l] for w in W)
        q, k, v = (jnp.reshape(E @ w, (B, N, heads, -1)) for w in (Wq, Wk, Wv))
        logits = jnp.einsum("bthk,bshk->bhts", q, k[:, :n])
        A = jax.nn.softmax(logits / jnp.sqrt(q.shape[-1]), axis=-1) if activation == "softmax" else logits
        E = E + jnp.einsum("bhts,bshv->bthv", A, v[:, :n]).reshape(B, N, -1) @ Wo
    return E


def loss_fn(W, E, y, heads, layers, activation):
    return 0.5 * jnp.mean((-model(W, E, heads, layers, activation)[:, -1, -1] - y) ** 2)


def max_rel(a, b):
    return float(np.max(np.abs(np.asarray(a) - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("activation", ["linear", "softmax"])
def test_jax_von_oswald_model_matches_icl_ref(tied, activation):
    rng = np.random.default_rng(0)
    d, n, L, H, k = 4, 10, 2, 2, 3
    D = d + 1
    Z, y = ir.sample_prompts(rng, 64, n, np.eye(d))                       # icl_ref layout
    lead = () if tied else (L,)
    W = [0.2 * rng.standard_normal(lead + s) for s in ((D, H * k), (D, H * k), (D, H * k), (H * k, D))]

    P, Q = ic.params_from_von_oswald(*W, n, heads=H, layers=L, activation=activation)
    if activation == "linear":
        ours_Z, (loss, dP, dQ) = ir.forward(P, Q, Z), ir.loss_and_grad(P, Q, Z, y)
    else:
        ours_Z = ir.forward_activation(P, Q, Z, "softmax")                # their softmax: n context keys
        loss, dP, dQ = ir.loss_and_grad_activation(P, Q, Z, y, "softmax")

    E = jnp.asarray(ic.tokens_as_rows(Z))
    W_j = [jnp.asarray(w) for w in W]
    assert max_rel(model(W_j, E, H, L, activation), ic.tokens_as_rows(ours_Z)) < FORWARD_RTOL
    theirs, grads = jax.value_and_grad(loss_fn)(W_j, E, jnp.asarray(y), H, L, activation)
    assert float(theirs) == pytest.approx(ic.VON_OSWALD_LOSS_SCALE * loss, rel=LOSS_RTOL)
    for g_jax, g_ours in zip(grads, ic.grads_to_von_oswald(dP, dQ, *W, n, heads=H, activation=activation)):
        assert max_rel(g_jax, g_ours) < GRAD_RTOL


# compiled once per shape (heads, layers and the activation are Python values: static)
model_jit = jax.jit(model, static_argnums=(2, 3, 4))
loss_and_grad_jit = jax.jit(jax.value_and_grad(loss_fn), static_argnums=(3, 4, 5))


def von_oswald_layout_fn(case):
    """One reference case in von Oswald et al.'s layout (icl_check.check_implementation): per-layer
    weights W_q, W_k, W_v, W_o (heads as column blocks), prompts as rows, their loss (0.5 * mean)."""
    W = [jnp.asarray(case[k]) for k in ("W_q", "W_k", "W_v", "W_o")]
    E, y = jnp.asarray(case["Z_rows"]), jnp.asarray(case["y"])
    out = model_jit(W, E, case["H"], case["L"], case["activation"])
    loss, grads = loss_and_grad_jit(W, E, y, case["H"], case["L"], case["activation"])
    return dict(Z_L_rows=np.asarray(out), y_hat=-np.asarray(out[:, -1, -1]), loss=float(loss),
                **{f"grad_{k}": np.asarray(g) for k, g in zip(("W_q", "W_k", "W_v", "W_o"), grads)})


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_one_line_check_against_icl_ref(dtype):
    # the linear and softmax reference cases in von Oswald et al.'s layout, at the dtype's tolerances
    ic.check_implementation(von_oswald_layout_fn, layout="von_oswald", dtype=dtype)
