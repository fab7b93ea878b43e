"""Copy this file into your project to check a PyTorch linear transformer against icl_ref.

The model below is written in the authors' layout (github.com/chengxiang/LinearTransformer):
tokens as rows, Z of shape (B, N+1, d+1), trainable d x d blocks allparam (L, H, 2, d, d), and
attention (Z Q_full Z^T) M (Z P_full^T) / N, linear or with their softmax over all N+1 keys.
icl_ref's adapters map it to the paper's layout (tokens as columns, Q = Q_full^T); the tests check
the forward pass, the loss and the autograd gradients. Skipped when torch is not installed (CI's
frameworks leg installs it). Run: python -m pytest examples/

float32 tolerances: README "Tolerances for float32 callers" (reproduce with
python examples/float32_tolerances.py).
"""
import numpy as np
import pytest

import icl_check as ic
import icl_ref as ir

torch = pytest.importorskip("torch")

# float64: both sides are exact computations in the same precision (rounding only).
# float32: 5x the worst relative errors that examples/float32_tolerances.py measured over d <= 20,
# n <= 200, L <= 4 (docs/float32_tolerances.json), rounded up to a power of ten.
TOLERANCES = {torch.float64: dict(forward=1e-12, loss=1e-12, grad=1e-10),
              torch.float32: dict(forward=1e-5, loss=1e-4, grad=1e-4)}


ACTIVATIONS = ("linear", "softmax_all")          # the authors' two modes: linear, and softmax over all N+1 keys


def attention(P, Q, Z, activation="linear"):
    """One head of the authors' attention, tokens as rows: scores[b, t, s] = z_t^T Q_full z_s for the
    output row t and key row s; their softmax normalises each row t over all N+1 keys, then M drops
    the query's value."""
    if activation not in ACTIVATIONS:              # a new activation fails the check until it is written here
        raise NotImplementedError(f"{activation} attention (this model has {', '.join(ACTIVATIONS)})")
    N, d = Z.shape[1] - 1, Z.shape[2] - 1
    P_full = torch.zeros(d + 1, d + 1, dtype=Z.dtype)
    P_full[:d, :d], P_full[d, d] = P, 1.0
    Q_full = torch.zeros(d + 1, d + 1, dtype=Z.dtype)
    Q_full[:d, :d] = Q
    M = torch.eye(N + 1, dtype=Z.dtype)
    M[N, N] = 0.0
    scores = torch.einsum("BNi,ij,BMj->BNM", Z, Q_full, Z)
    if activation == "softmax_all":
        scores = torch.softmax(scores, dim=-1)
    values = torch.einsum("ij,BNj->BNi", P_full, Z)
    return torch.einsum("BNM,ML,BLi->BNi", scores, M, values) / N


def model(allparam, Z, activation="linear"):
    for layer in allparam:
        Z = Z + sum(attention(head[0], head[1], Z, activation) for head in layer)
    return Z


def max_rel(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_torch_model_matches_icl_ref(dtype):
    rng = np.random.default_rng(0)
    Sigma, _ = ir.rotated_covariance(rng)
    Z, y = ir.sample_prompts(rng, 256, 20, Sigma, np.linalg.inv(Sigma))     # icl_ref layout
    allparam = 0.2 * rng.standard_normal((3, 2, 2, 5, 5))

    Z_t = torch.tensor(ic.tokens_as_rows(Z), dtype=dtype)                   # authors' layout
    ap = torch.tensor(allparam, dtype=dtype, requires_grad=True)
    out = model(ap, Z_t)
    loss = torch.mean((out[:, -1, -1] + torch.tensor(y, dtype=dtype)) ** 2)
    loss.backward()

    P, Q = ic.params_from_authors(allparam)
    ref_out = ic.tokens_as_rows(ir.forward(P, Q, Z))
    ref_loss, dP, dQ = ir.loss_and_grad(P, Q, Z, y)
    tol = TOLERANCES[dtype]
    assert max_rel(out.detach().double().numpy(), ref_out) < tol["forward"]
    assert abs(loss.item() - ref_loss) / ref_loss < tol["loss"]
    assert max_rel(ap.grad.double().numpy(), ic.grads_to_authors(dP, dQ)) < tol["grad"]


def authors_layout_fn(case):
    """One reference case in the authors' layout (icl_check.check_implementation): the model above on
    case["Z_rows"], case["allparam"] with case["activation"], in the dtype they come in; forward, loss
    and autograd gradient."""
    Z = torch.tensor(case["Z_rows"])
    ap = torch.tensor(case["allparam"], requires_grad=True)
    out = model(ap, Z, case["activation"])
    loss = torch.mean((out[:, -1, -1] + torch.tensor(case["y"])) ** 2)
    loss.backward()
    return dict(Z_L_rows=out.detach().numpy(), y_hat=-out[:, -1, -1].detach().numpy(), loss=loss.item(),
                grad_allparam=ap.grad.numpy())


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_one_line_check_against_icl_ref(dtype):
    # every reference case that has the authors' layout (each activation of theirs, a case added to the
    # kit too), at the tolerances for the dtype; a mismatch raises AssertionError with the diagnosis
    ic.check_implementation(authors_layout_fn, layout="authors", dtype=dtype)
