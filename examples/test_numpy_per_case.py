"""Copy this file into your project to check a model against icl_ref one reference case per test.

The model is a short NumPy version of [A] eq. (4) in the paper's layout (tokens as columns, Z of
shape (B, d+1, n+1), P, Q of shape (L, H, d+1, d+1)) that implements the linear layer only and
returns no gradients. It shows the two ways a suite runs the reference cases:
- one test per case the model implements (the test ids are the case names);
- one call for the whole set, naming the outputs checked (`outputs=`) and the cases the model
  declines with NotImplementedError (`skip=`): reported as skipped, never as passed.
Nothing is marked as an expected failure: every case of the layout can be written in it, and what
this model has yet to implement is said once, in ACTIVATIONS.
Run: python -m pytest examples/
"""
import numpy as np
import pytest

import icl_check as ic

ACTIVATIONS = ("linear",)                                           # what my_model implements


def my_model(case):
    """The paper's layer, Z <- Z + (1/n) sum_h P_h Z M Z^T Q_h Z, for every layer; y_hat = -Z_L[d, n]."""
    if case["activation"] not in ACTIVATIONS:
        raise NotImplementedError(f"{case['activation']} attention")
    Z, y, P, Q = case["Z"], case["y"], case["P"], case["Q"]
    n = Z.shape[2] - 1
    M = np.diag(np.r_[np.ones(n), 0.0]).astype(Z.dtype)           # the query is not a key or value
    for P_l, Q_l in zip(P, Q):
        Zt = np.swapaxes(Z, 1, 2)
        Z = Z + sum(P_h @ Z @ M @ Zt @ Q_h @ Z for P_h, Q_h in zip(P_l, Q_l)) / n
    y_hat = -Z[:, -1, -1]
    return dict(Z_L=Z, y_hat=y_hat, loss=np.mean((y_hat - y) ** 2))


OUTPUTS = ("Z_L", "y_hat", "loss")                                  # no gradients in this model
CASES = [c for c in ic.reference_cases() if "paper" in c["layouts"]]
MINE = [c["name"] for c in CASES if c["activation"] in ACTIVATIONS]
DECLINED = [c["name"] for c in CASES if c["activation"] not in ACTIVATIONS]


@pytest.mark.parametrize("case", MINE)                              # test ids are the case names
def test_one_case(case):
    ic.check_implementation(my_model, cases=case, outputs=OUTPUTS)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_every_case_in_one_call(dtype):
    report = ic.check_implementation(my_model, dtype=dtype, outputs=OUTPUTS, skip=DECLINED)
    assert [name for name, c in report["cases"].items() if c["status"] == "skipped"] == DECLINED
