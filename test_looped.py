"""Tests for the looped (weight-tied) models and the gradient flow of one layer (MATH.md §14).

Tolerances, each with its reason:
    FD_VEC = 1e-8   relative, for a whole gradient vector against five-point central differences
                    at h = 1e-4: truncation (h^4/30) f^(5) ~ 3e-18 f^(5), rounding ~ 1.5 eps |f| / h
                    ~ 3e-12 |f|, and |f| / |grad| <= 100 here, so 1e-8 leaves two orders of margin
    EXACT  = 1e-12  relative: one exact quantity computed twice in float64 (rounding only)
    Z_MC   = 4      sampling: an estimate within 4 of its standard errors of the exact value
"""
import numpy as np
import pytest

import icl_ref as ir

FD_VEC = 1e-8
FD_H = 1e-4
EXACT = 1e-12
Z_MC = 4.0


def five_point(f, x, h=FD_H):
    """The gradient of f at the flat vector x by five-point central differences, entry by entry."""
    g = np.empty_like(x)
    for i in range(x.size):
        e = np.zeros_like(x)
        e[i] = h
        g[i] = (8 * (f(x + e) - f(x - e)) - (f(x + 2 * e) - f(x - 2 * e))) / (12 * h)
    return g


def problem(seed, B=40, d=3, n=6):
    rng = np.random.default_rng(seed)
    Z, y = ir.sample_prompts(rng, B, n, ir.rotated_covariance(rng, (1.0, 0.5, 0.25)[:d])[0])
    return rng, Z, y


# ---------------------------------------------------------------------------------------------
# Tied structures: the one layer applied L times, and the chain rule of the repetition
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("structure", ir.STRUCTURES)
def test_tied_model_is_one_layer_applied_L_times(structure):
    # the literal loop: feed the one-layer model's output back in, L times, with forward_literal
    rng, Z, y = problem(1)
    shapes = ir.structure_shapes(structure, 3, 3, 2 if structure == "full" else 1, tied=True)
    coords = {k: 0.3 * rng.standard_normal(s) for k, s in shapes.items()}
    P1, Q1 = ir.structure_to_PQ(structure, coords)
    Zl = Z
    for _ in range(3):
        Zl = ir.forward_literal(P1, Q1, Zl)
    P, Q = ir.structure_to_PQ(structure, coords, L=3)
    assert P.shape[0] == 3
    np.testing.assert_allclose(ir.forward(P, Q, Z), Zl, rtol=1e-10, atol=1e-12)   # three layers' rounding


@pytest.mark.parametrize("structure", ir.STRUCTURES)
def test_tied_gradient_matches_finite_differences(structure):
    rng, Z, y = problem(2)
    L, H = 3, (2 if structure == "full" else 1)
    shapes = ir.structure_shapes(structure, L, 3, H, tied=True)
    names, sizes = list(shapes), list(shapes.values())
    theta = 0.3 * rng.standard_normal(sum(int(np.prod(s)) for s in sizes))

    def loss(t):
        P, Q = ir.structure_to_PQ(structure, dict(zip(names, ir.unpack(t, sizes))), L=L)
        return ir.in_context_loss(P, Q, Z, y)

    P, Q = ir.structure_to_PQ(structure, dict(zip(names, ir.unpack(theta, sizes))), L=L)
    _, dP, dQ = ir.loss_and_grad(P, Q, Z, y)
    grad = ir.pack(list(ir.structure_grad(structure, dP, dQ, tied=True).values()))
    numeric = five_point(loss, theta)
    assert np.linalg.norm(grad - numeric) <= FD_VEC * np.linalg.norm(numeric)
    # the Jacobian's rows carry the same chain rule: 2 J^T r / B is that gradient
    r, J = ir.residuals_and_jacobian(P, Q, Z, y, structure=structure, tied=True)
    np.testing.assert_allclose(2 * J.T @ r / len(y), grad, rtol=1e-10, atol=1e-12)


def test_tied_inputs_are_checked():
    rng, Z, y = problem(3)
    with pytest.raises(TypeError, match="tied"):
        ir.structure_shapes("sparse", 2, 3, tied=1)
    with pytest.raises(ValueError, match="one layer"):
        ir.structure_to_PQ("sparse", {"A": np.zeros((2, 3, 3))}, L=2)
    P, Q = ir.sparse_params(rng.standard_normal((2, 3, 3)))
    with pytest.raises(ValueError, match="every layer equal"):
        ir.residuals_and_jacobian(P, Q, Z, y, structure="sparse", tied=True)


def test_tied_trainers_return_one_layer_and_agree():
    # L-BFGS and Gauss-Newton take different steps from the same start: the same tied minimum
    rng, Z, y = problem(4, B=400)
    lb = ir.train_lbfgs(Z, y, 2, "sparse", rng=np.random.default_rng(0), tied=True, gtol=1e-6)
    gn = ir.train_gauss_newton(Z, y, 2, "sparse", rng=np.random.default_rng(0), tied=True, gtol=1e-6)
    assert lb["success"] and gn["success"] and lb["tied"] and gn["fixed"] == 0
    assert lb["coords"]["A"].shape == (1, 3, 3) and lb["P"].shape == (2, 1, 4, 4)
    # each is within |grad| / lambda_min of the minimum; here |grad| <= 1e-6 and the Hessian's
    # smallest eigenvalue is 0.054 (five-point differences of the gradient): 2e-5 apart at most
    np.testing.assert_allclose(gn["coords"]["A"], lb["coords"]["A"], rtol=0, atol=4e-5)
