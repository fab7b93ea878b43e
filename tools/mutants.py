"""Mutation check: does the default test suite notice plausible slips in icl_ref.py's math?

Each mutation replaces one line's text (which must occur exactly once) in a copy of the project,
runs the default suite there with `-x`, and is "killed" when the suite fails. A survivor that
changes a result is a hole in the tests. Equivalent mutants (that cannot change any result) are
listed apart, with the reason, and not run.

    python3 tools/mutants.py            # all mutants, 2 at a time (~15 min on 2 cores)
    python3 tools/mutants.py -k chunk,jac   # those whose name contains "chunk" or "jac"
    python3 tools/mutants.py --list

Not part of CI (too slow). Exit status 1 if a mutant survives or no longer applies.
"""
import argparse
import concurrent.futures
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (name, old text, new text, why it matters)
MUTANTS = [
    # §2 the layer and the Gram form
    ("mask-includes-query", "return np.diag(np.r_[np.ones(n), 0.0])", "return np.diag(np.r_[np.ones(n), 1.0])",
     "the query becomes a key and a value"),
    ("gram-keeps-query", "Zc = Z[:, :, :-1]                                          # Z M drops the query column",
     "Zc = Z", "S counts the query token"),
    ("kernel-no-transpose", "return sum(np.kron(P_h, Q_h.T) for P_h, Q_h in zip(P_l, Q_l)) / n",
     "return sum(np.kron(P_h, Q_h) for P_h, Q_h in zip(P_l, Q_l)) / n", "column-major vec identity"),
    ("kernel-1/(n+1)", "return sum(np.kron(P_h, Q_h.T) for P_h, Q_h in zip(P_l, Q_l)) / n",
     "return sum(np.kron(P_h, Q_h.T) for P_h, Q_h in zip(P_l, Q_l)) / (n + 1)", "1/(n+1) normalisation"),
    ("layer-no-residual", "    T += np.eye(D)\n", "    T += 0 * np.eye(D)\n", "the residual connection dropped"),
    ("layer-S-not-conjugated", "S_next = TS @ T.transpose(0, 2, 1) if need_S else None",
     "S_next = TS if need_S else None", "S' = T S instead of T S T^T"),
    ("predict-sign", 'return _finite_result("the prediction", -q_L[:, -1]', 'return _finite_result("the prediction", q_L[:, -1]',
     "prediction sign"),
    ("literal-query-as-key", "for i in range(n):                           # keys/values: context tokens only",
     "for i in range(n + 1):", "the literal twin uses the query as a key"),
    # §3 reverse mode
    ("bwd-dT-from-q-transposed", 'dT = np.einsum("bi,bj->bij", dq_next, q)', 'dT = np.einsum("bi,bj->bji", dq_next, q)',
     "outer product transposed"),
    ("bwd-dq-no-transpose", 'dq = np.einsum("bji,bj->bi", T, dq_next)', 'dq = np.einsum("bij,bj->bi", T, dq_next)',
     "T q adjoint without the transpose"),
    ("bwd-S-symmetrised-once", "dT += (dS_next + dS_next.transpose(0, 2, 1)) @ TS", "dT += dS_next @ TS",
     "T appears twice in T S T^T"),
    ("bwd-middle-S-dropped", "dS += T.transpose(0, 2, 1) @ dS_next @ T", "dS += 0 * dS_next",
     "the S in the middle of T S T^T"),
    ("bwd-middle-S-transposed", "dS += T.transpose(0, 2, 1) @ dS_next @ T", "dS += T @ dS_next @ T.transpose(0, 2, 1)",
     "adjoint of T S T^T transposed"),
    ("bwd-dK-transposed", "dT_flat.T @ S.reshape(B, D * D)   # dK", "S.reshape(B, D * D).T @ dT_flat   # dK",
     "dK transposed"),
    ("bwd-dS-without-K", "dS = (dT_flat @ K).reshape(B, D, D) if need_dS else None",
     "dS = (dT_flat @ K.T).reshape(B, D, D) if need_dS else None", "K^T applied the wrong way"),
    ("kernel-bwd-dP-index", 'dP_l = np.stack([np.einsum("iljk,kl->ij", dK, Q_h) for Q_h in Q_l])',
     'dP_l = np.stack([np.einsum("iljk,lk->ij", dK, Q_h) for Q_h in Q_l])', "Q_h transposed in dP"),
    ("kernel-bwd-dQ-index", 'dQ_l = np.stack([np.einsum("iljk,ij->kl", dK, P_h) for P_h in P_l])',
     'dQ_l = np.stack([np.einsum("iljk,ij->lk", dK, P_h) for P_h in P_l])', "dQ transposed"),
    ("kernel-bwd-no-1/n", "dK = dK.reshape(D, D, D, D) / n ", "dK = dK.reshape(D, D, D, D) ",
     "the 1/n of K forgotten in its adjoint"),
    ("chunk-drops-last", "bounds = [(c, min(c + chunk, B)) for c in range(0, B, chunk)]",
     "bounds = [(c, c + chunk) for c in range(0, B - B % chunk, chunk)]", "the last partial chunk dropped"),
    ("chunk-overlap", "bounds = [(c, min(c + chunk, B)) for c in range(0, B, chunk)]",
     "bounds = [(max(c - 1, 0), min(c + chunk, B)) for c in range(0, B, chunk)]", "chunks overlap by one prompt"),
    ("chunk-normalised-per-chunk",
     "need_dS=l > 0)\n        return float(r @ r) / B, dKs", "need_dS=l > 0)\n        return float(r @ r) / len(r), dKs",
     "loss normalised per chunk"),
    ("lanes-normalised-per-chunk",
     "first=l == 0)\n        return float(r @ r) / B, dKs", "first=l == 0)\n        return float(r @ r) / len(r), dKs",
     "the lanes loss normalised per chunk"),
    ("chunk-grad-normalised-per-chunk", "dq[:, -1] = 2.0 * r / B", "dq[:, -1] = 2.0 * r / len(r)",
     "gradient normalised per chunk"),
    ("chunk-dK-last-only", "dmap = sum(part[1][l] for part in parts)", "dmap = parts[-1][1][l]",
     "dK of the last chunk only (overwritten per chunk)"),
    ("chunk-loss-first-only", "D <= _SERIAL_MAX_D)\n    loss = sum(part[0] for part in parts)",
     "D <= _SERIAL_MAX_D)\n    loss = parts[0][0]", "the loss of the first chunk only"),
    ("lanes-loss-first-only", "threads)\n    loss = sum(part[0] for part in parts)", "threads)\n    loss = parts[0][0]",
     "the lanes loss of the first chunk only"),
    ("chunk-first-labels", "r = q_L[:, -1] + y[start:stop]                    # residual",
     "r = q_L[:, -1] + y[:stop - start]                    # residual", "every chunk reads the first chunk's labels"),
    # §3.1 the Jacobian
    ("jac-dP-no-transpose", "(dT.reshape(b * D, D) @ (Q[l, h].T / n))", "(dT.reshape(b * D, D) @ (Q[l, h] / n))",
     "Q_h^T dropped in dr/dP"),
    ("jac-dQ-no-transpose", "(S.reshape(b * D, D) @ (P[l, h].T / n))", "(S.reshape(b * D, D) @ (P[l, h] / n))",
     "P_h^T dropped in dr/dQ"),
    ("jac-seed", "dq[:, -1] = 1.0                                   # dr_b", "dq[:, -1] = 2.0                                   # dr_b",
     "the Jacobian of r^2 instead of r"),
    ("jac-labels", "        r = q_L[:, -1] + y[start:stop]\n        dq = np.zeros_like(q_L)\n        dq[:, -1] = 1.0",
     "        r = q_L[:, -1] - y[start:stop]\n        dq = np.zeros_like(q_L)\n        dq[:, -1] = 1.0",
     "residual with the label's sign flipped"),
    # §6 training
    ("gn-fixed-wrong-layer", 'masks["B"][-1] = True', 'masks["B"][0] = True', "B_0 held fixed instead of B_{L-1}"),
    ("gn-gradient-scale", "grad_norm = float(np.linalg.norm(2 * best[\"J\"].T @ best[\"r\"] / B))",
     "grad_norm = float(np.linalg.norm(best[\"J\"].T @ best[\"r\"] / B))", "converged judged on half the gradient"),
    ("gn-reduced-rho", "return R_aug[:, p], R_aug[:, :p]", "return np.r_[R_aug[:p, p], 0.0], R_aug[:, :p]",
     "the reduced system loses the part of r outside J's range (wrong costs)"),
    ("gn-reduced-R-transposed", "return R_aug[:, p], R_aug[:, :p]",
     "return R_aug[:, p], np.vstack([R_aug[:p, :p].T, R_aug[p:, :p]])", "R^T handed to the solver"),
    ("gn-tsqr-block-rows", 'check_finite=False)[0][:p + 1]\n    rows', 'check_finite=False)[0][:p]\n    rows',
     "each block's factor loses its last row (the blocks' QR no longer that of [J r])"),
    ("sandwich-V-factor", "V = np.cov(2 * r[:, None] * J, rowvar=False)", "V = np.cov(r[:, None] * J, rowvar=False)",
     "per-prompt gradient without the factor 2"),
    ("loss-half", "return float(np.mean((predict(P, Q, Z) - y) ** 2))", "return float(0.5 * np.mean((predict(P, Q, Z) - y) ** 2))",
     "loss with a factor 1/2"),
    # §2-§3 the direct formulation
    ("direct-P-not-transposed", "PS = (S.reshape(B * D, D) @ P_h.T)", "PS = (S.reshape(B * D, D) @ P_h)",
     "P_h S computed as (S P_h)^T without the transpose"),
    ("direct-no-1/n", "    out /= n\n    return out", "    return out", "the direct form forgets 1/n"),
    ("direct-dP-axes", "dPQ[0, h] = np.tensordot(dT, SQ, axes=([0, 2], [0, 2])) / n",
     "dPQ[0, h] = np.tensordot(dT, SQ, axes=([0, 2], [0, 1])) / n", "dP_h contracts the wrong index"),
    ("direct-dQ-axes", "dPQ[1, h] = np.tensordot(SPt, dT, axes=([0, 2], [0, 1])) / n",
     "dPQ[1, h] = np.tensordot(SPt, dT, axes=([0, 1], [0, 1])) / n", "dQ_h contracts the wrong index"),
    ("map-chunks-keeps-claiming", "if i >= len(bounds) or stop.is_set():", "if i >= len(bounds):",
     "after an error or a Ctrl-C the workers go on through every chunk in the background"),
    ("pool-unbound", '            if len(cores) == workers and hasattr(os, "sched_setaffinity"):\n',
     "            if False:\n",
     "workers woken together after an idle spell share one core (an evaluation ~1.7x slower)"),
    ("pool-no-fork-reset", "    _POOLS.clear()\n", "    pass\n",
     "a forked child waits forever on the parent's worker threads (the test times out after 60 s)"),
    # §3.2 the lanes formulation (prompts on the last axis, S by its distinct entries)
    ("sym-E-off-diagonal-once", "E[np.arange(D * D), full] = 1.0", "E[np.arange(D * D), full] = 1.0\n    E[i * D + j, np.arange(len(i))] = 2.0",
     "the upper-triangle entries counted twice in vec(S) = E s"),
    ("lanes-gram-keeps-query", "    context = Zt[:, :-1]\n", "    context = Zt\n", "the lanes Gram product counts the query"),
    ("symmetric-product-one-operand", 'np.einsum("jb,kjb->kb", X[i], Y[i:], out=s[start:start + D - i])',
     'np.einsum("jb,kjb->kb", X[i], X[i:], out=s[start:start + D - i])',
     "X X^T instead of X Y^T (right for the Gram product, wrong for T S T^T and T^T G T)"),
    ("symmetric-full-upper-only", "return s.take(symmetric_coordinates(D)[1], axis=0).reshape(D, D, s.shape[-1])",
     "S = np.zeros((D * D, s.shape[-1]))\n    S[symmetric_coordinates(D)[0]] = s\n    return S.reshape(D, D, s.shape[-1])",
     "the lower triangle of Z M Z^T, T S T^T and T^T G T left empty"),
    ("lanes-last-wrong-row", "t = K_s[-D:] @ s                                          # row d of T - I, (D, b)",
     "t = K_s[:D] @ s", "the last layer reads row 0 of T, not row d"),
    ("lanes-last-no-residual", "    t[-1] += 1.0\n", "    t[-1] += 0.0\n", "the residual dropped in the last layer"),
    ("lanes-no-residual", "T.reshape(D * D, b)[::D + 1] += 1.0", "T.reshape(D * D, b)[::D + 1] += 0.0",
     "the residual connection dropped"),
    ("lanes-identity-stride", "T.reshape(D * D, b)[::D + 1] += 1.0", "T.reshape(D * D, b)[::D] += 1.0",
     "I added along the wrong rows of vec(T)"),
    ("lanes-S-not-conjugated", "s_next = _symmetric_product(TS, T)", "s_next = s.copy()",
     "S' = S: the conjugation T S T^T dropped"),
    ("lanes-dt-last", "dt = dq_next * q                                          # row d of dT",
     "dt = dq_next * T", "the last layer's dT from t instead of q"),
    ("lanes-dq-last", "dq, ds = dq_next * T, K_s[-D:].T @ dt", "dq, ds = dq_next * q, K_s[-D:].T @ dt",
     "the last layer's dq from q instead of t"),
    ("lanes-dT-outer-transposed", "dT = dq_next[:, None, :] * q[None, :, :]", "dT = q[:, None, :] * dq_next[None, :, :]",
     "outer product dq' q^T transposed"),
    ("lanes-dT-TS-untransposed", 'dT += np.einsum("ijb,kjb->ikb", G_next, np.ascontiguousarray(TS.transpose(1, 0, 2)))',
     'dT += np.einsum("ijb,kjb->ikb", G_next, TS)', "G' (T S)^T instead of G' T S"),
    ("lanes-dq-untransposed", 'dq, ds = np.einsum("ijb,jb->ib", Tt, dq_next), K_s.T @ dT',
     'dq, ds = np.einsum("ijb,jb->ib", T, dq_next), K_s.T @ dT', "T q adjoint without the transpose"),
    ("lanes-G-diagonal-once", "g = ds * np.where(symmetric_coordinates(D)[3], 2.0, 1.0)[:, None]",
     "g = ds * np.where(symmetric_coordinates(D)[3], 1.0, 1.0)[:, None]",
     "G = dS + dS^T without doubling the diagonal"),
    ("lanes-middle-dropped", 'g += _symmetric_product(np.einsum("ijb,kjb->ikb", Tt, G_next), Tt)',
     "g += 0.0", "the S in the middle of T S T^T"),
    ("lanes-middle-transposed", 'g += _symmetric_product(np.einsum("ijb,kjb->ikb", Tt, G_next), Tt)',
     'g += _symmetric_product(np.einsum("ijb,kjb->ikb", T, G_next), T)', "T G' T^T instead of T^T G' T"),
    ("lanes-reader-s-from-lower", "return S, S.reshape(D * D, -1).take(upper, axis=0), np.ascontiguousarray(q0[start:stop].T)",
     "return S, S.reshape(D * D, -1)[:len(upper)], np.ascontiguousarray(q0[start:stop].T)",
     "the Gram-form reader takes the first U entries of vec(S_0) for its distinct entries"),
    ("lanes-Z-check-dropped", '                _finite_entries("Z", Z[start:stop])\n', "",
     "a NaN or Inf in Z goes through loss_and_grad unnoticed when the lanes formulation runs"),
    ("lanes-dK-not-expanded", "dK = sum(part[1][l] for part in parts) @ E.T", "dK = np.zeros((D * D, D * D))\n        dK[:, symmetric_coordinates(D)[0]] = sum(part[1][l] for part in parts)",
     "dK_s placed on the upper positions only, not spread by E^T"),
    ("lanes-loss-chunk-B", "r = q + y[start:stop]                             # q = Z_L[d, n]: r = y - y_hat",
     "r = q + y[:stop - start]", "every chunk reads the first labels"),
    ("lanes-jac-seed", "G, dq = None, np.ones(len(r))", "G, dq = None, 2.0 * r / len(r)",
     "the Jacobian seeded with the loss's 2 r / B instead of dr/dq = 1"),
    ("lanes-jac-dP-Q-transposed", 'np.einsum("ijb,kj->ikb", dT, Q[l, h] / n), S_l)', 'np.einsum("ijb,jk->ikb", dT, Q[l, h] / n), S_l)',
     "dr/dP = dT Q S instead of dT Q^T S"),
    ("lanes-jac-dQ-order", 'JQ[:, l, h] = np.einsum("ijb,jkb->bik"', 'JQ[:, l, h] = np.einsum("ijb,kjb->bik"',
     "dr/dQ = S P^T dT^T instead of S P^T dT"),
    ("lanes-jac-no-1/n", 'np.einsum("ijb,kj->ikb", S_l, P[l, h] / n), dT)', 'np.einsum("ijb,kj->ikb", S_l, P[l, h]), dT)',
     "dr/dQ without the 1/n"),
    ("lanes-jac-last-row", "            dmap[-1] = dt\n", "            dmap[0] = dt\n",
     "the last layer's per-prompt dT in row 0 instead of row d"),
    ("lanes-jac-S-after-layer", "            S_l = caches[l][1]\n", "            S_l = caches[min(l + 1, L - 1)][1]\n",
     "the rows use the next layer's S"),
    ("lanes-threshold", "_LANES_MAX_D = 12\n", "_LANES_MAX_D = 9\n",
     "the measured default (the numbers are the same to rounding; only the speed changes)"),
    ("lanes-grad-per-chunk", "G, dq, dKs = None, 2.0 * r / B, [None] * len(Ks)", "G, dq, dKs = None, 2.0 * r / len(r), [None] * len(Ks)",
     "each chunk divides by its own size, not the whole B"),
    # §4 attention
    ("attn-relu-grad-sign", "dE = dA * (E > 0)", "dE = dA * (E >= 0) - dA * (E < 0)", "relu derivative wrong"),
    ("attn-softmax-grad-sign", "dE = A * (dA - np.sum(A * dA, axis=1, keepdims=True))",
     "dE = A * (dA + np.sum(A * dA, axis=1, keepdims=True))", "sign in the softmax backward"),
    ("attn-softmax-keys", 'keys = n if activation == "softmax" else n + 1', "keys = n + 1",
     "softmax normalised over n+1 keys"),
    ("attn-dZ-keys-only", "dZ += Q_h @ Z @ dE.transpose(0, 2, 1) + Q_h.T @ Z @ dE", "dZ += Q_h @ Z @ dE.transpose(0, 2, 1)",
     "Z used as query forgotten in the backward"),
    ("attn-value-unmasked", "    V[:, :, n] = 0.0                                           # V = P Z M\n", "\n",
     "the query used as a value"),
    ("attn-jacobian-dP", "dP_h = dV @ Z.transpose(0, 2, 1)                       # dV_b Z_b^T",
     "dP_h = Z @ dV.transpose(0, 2, 1)                       # dV_b Z_b^T", "per-prompt dP transposed"),
    ("attn-jacobian-dQ", "dQ_h = ZdE @ Z.transpose(0, 2, 1)                      # Z_b dE_b Z_b^T",
     "dQ_h = Z @ ZdE.transpose(0, 2, 1)                      # Z_b dE_b Z_b^T", "per-prompt dQ transposed"),
    ("attn-chunk-normalisation", "dZ[:, -1, -1] = 1.0 if jacobian else 2.0 * r / B",
     "dZ[:, -1, -1] = 1.0 if jacobian else 2.0 * r / len(r)", "explicit attention's chunks normalised per chunk"),
    # §5 structures
    ("block-grad-sign", "return -dQ[:, 0, :-1, :-1], dP[:, 0, :-1, :-1]", "return dQ[:, 0, :-1, :-1], dP[:, 0, :-1, :-1]",
     "the sign of (8) forgotten in the chain rule"),
    ("block-P-corner", "P[:, 0, d, d] = 1.0", "P[:, 0, d, d] = 0.0", "P's corner not 1"),
    # §7 Lemma 1
    ("lemma1-no-transpose", "W.append(W[-1] - grad_R @ A_l) ", "W.append(W[-1] - grad_R @ A_l.T) ",
     "the printed A_l instead of A_l^T"),
    ("lemma1-1/(n+1)", 'np.einsum("bid,bd->bi", X, W[-1]) - y) / n', 'np.einsum("bid,bd->bi", X, W[-1]) - y) / (n + 1)',
     "1/(n+1) in grad R"),
    # §8 single layer
    ("K-(n+1)/n", "K = ((n + 1) / n) * Sigma @ Sigma_w @ Sigma", "K = (n / (n + 1)) * Sigma @ Sigma_w @ Sigma",
     "n/(n+1) for (n+1)/n"),
    ("K-noise-dropped", "((np.trace(Sigma_w @ Sigma) + noise_var) / n) * Sigma", "((np.trace(Sigma_w @ Sigma)) / n) * Sigma",
     "context noise dropped from K"),
    ("K-trace-order", "((np.trace(Sigma_w @ Sigma) + noise_var) / n) * Sigma", "((np.trace(Sigma_w) + noise_var) / n) * Sigma",
     "tr(Sigma_w) for tr(Sigma_w Sigma)"),
    ("single-loss-query-noise", "+ np.trace(Sigma @ Sigma_w) + (noise_var if query_noise else 0.0))",
     "+ np.trace(Sigma @ Sigma_w))", "query noise dropped"),
    ("mahankali-no-plus-one", "return 1.0 / (_int(\"n\", n, 1) + 1 + _int(\"d\", d, 1)", "return 1.0 / (_int(\"n\", n, 1) + _int(\"d\", d, 1)",
     "the +1 of n+1+d"),
    # §9 Wishart
    ("wishart-n+k", "total = (n + k - 1) * T(k - 1, *rest)", "total = (n + k) * T(k - 1, *rest)", "n+k-1 off by one"),
    ("wishart-2m", "total += sum(2 * m * T(k + m - 1,", "total += sum(m * T(k + m - 1,", "2m factor dropped"),
    ("wishart-split-range", "total += sum(T(j, k - 1 - j, *rest) for j in range(1, k))",
     "total += sum(T(j, k - 1 - j, *rest) for j in range(1, k - 1))", "one split term dropped"),
    # §10 families
    ("family-r-phi", "r = _poly_add(r, _poly_scale(a_l, _poly_mul(p, _poly_mul(phi, phi))))",
     "r = _poly_add(r, _poly_scale(a_l, _poly_mul(p, phi)))", "r built with phi instead of phi^2"),
    ("family-s-square", "phi, s = _poly_mul(phi, step), _poly_mul(s, _poly_mul(step, step))",
     "phi, s = _poly_mul(phi, step), _poly_mul(s, step)", "s_{l+1} = s_l (1 - g s_l), not squared"),
    ("family-noise-1/n", "f += s2 / n * sum(e_k * m_k for e_k, m_k in zip(e, m[1:]))",
     "f += s2 * sum(e_k * m_k for e_k, m_k in zip(e, m[1:]))", "noise term without 1/n"),
    ("family-noise-moment-shift", "f += s2 / n * sum(e_k * m_k for e_k, m_k in zip(e, m[1:]))",
     "f += s2 / n * sum(e_k * m_k for e_k, m_k in zip(e, m))", "E tr(r^2) for E tr(S r^2)"),
    ("family-at-nodes-noise", "return float(weights @ p ** 2 + noise_var / n * (weights @ (nodes * r ** 2)))",
     "return float(weights @ p ** 2)", "noise dropped from what optimal_family_scalars minimises"),
    ("family-at-nodes-phi", "r = r + a_l * p * phi ** 2", "r = r + a_l * p * phi", "phi for phi^2 in the optimiser"),
    ("chebyshev-beta", "beta.append(sigma_next[k] / sigma[k - 1])", "beta.append(sigma_next[k] / sigma[k])",
     "Chebyshev's beta with the wrong denominator"),
    ("gauss-weights", "return nodes, float(beta[0]) * vecs[0] ** 2", "return nodes, float(beta[0]) * vecs[0]",
     "Golub-Welsch weights not squared"),
    # §12-§13 adapters and diagnosis
    ("vo-no-n", "P = n * np.swapaxes(Wv @ Wo, -1, -2)", "P = np.swapaxes(Wv @ Wo, -1, -2)",
     "von Oswald et al.'s missing 1/n not folded into P"),
    ("vo-Q-order", "Q = s * Wk @ np.swapaxes(Wq, -1, -2)", "Q = s * Wq @ np.swapaxes(Wk, -1, -2)",
     "W_q W_k^T for W_k W_q^T"),
    ("vo-grad-Wq", "grads = [c * s * np.swapaxes(dQ, -1, -2) @ Wk, c * s * dQ @ Wq,",
     "grads = [c * s * dQ @ Wk, c * s * dQ @ Wq,", "dW_q without dQ^T"),
    ("diag-Q-variant-grad", 'out["dQ"] = np.swapaxes(out["dQ"], -1, -2)', 'out["dQ"] = out["dQ"]',
     "the transposed-Q variant's gradient not transposed back"),
    ("diag-no-mask-variant", "S0, q0 = Z @ Z.transpose(0, 2, 1), np.ascontiguousarray(Z[:, :, n])",
     "S0, q0 = Z[:, :, :-1] @ Z[:, :, :-1].transpose(0, 2, 1), np.ascontiguousarray(Z[:, :, n])",
     "the query-as-key variant computed with the mask"),
    # §11 metrics
    ("distance-alpha", "alpha = np.sum(M * T) / np.sum(T * T)", "alpha = np.sum(M * T) / np.sum(M * M)",
     "projection onto the wrong vector"),
    # §12 adapters
    ("authors-Q-not-transposed", "Q[:, :, :d, :d] = allparam[:, :, 1].transpose(0, 1, 3, 2)", "Q[:, :, :d, :d] = allparam[:, :, 1]",
     "the authors' Q used without the transpose"),
    ("authors-grad-not-transposed", "return np.stack([dP[..., :d, :d], dQ[..., :d, :d].swapaxes(-1, -2)], axis=2)",
     "return np.stack([dP[..., :d, :d], dQ[..., :d, :d]], axis=2)", "gradient to the authors' layout untransposed"),
]

# (name, old, new, why it cannot change any result)
EQUIVALENT = [
    ("gamma-star-transposed", 'np.linalg.solve(K, E_hw) / c, Sigma=Sigma)', 'np.linalg.solve(K, E_hw).T / c, Sigma=Sigma)',
     "Gamma* = Sigma^-1/2 f(C) Sigma^-1/2 with f(C) a function of the symmetric C is symmetric for every Sigma, "
     "Sigma_w (MATH.md §8; test_theorem1_gamma_star_against_the_whitened_eigen_form checks it)"),
    ("direct-dS-transposed", "@ P_h).reshape(B, D, D).transpose(0, 2, 1)", "@ P_h).reshape(B, D, D)",
     "S is symmetric in every layer, and dS reaches a result only through (dS + dS^T) T S and T^T dS T "
     "(whose transpose is T^T dS^T T): dS and dS^T give the same numbers (MATH.md §3)"),
    ("formulation-threshold", 'formulation = "kernel" if P_l.shape[-1] <= 10 * P_l.shape[0] else "direct"',
     'formulation = "direct" if P_l.shape[-1] <= 10 * P_l.shape[0] else "kernel"',
     "both formulations compute the same numbers to rounding (tested); only the speed changes"),
    ("chunk-size", "max(1, 2 ** 17 // D ** 2) if chunk is None", "max(1, 2 ** 16 // D ** 2) if chunk is None",
     "the chunk size changes only the order of floating-point sums (tested: chunked == unchunked)"),
    ("lanes-chunk-size", "count = 4 * -(-B // (4 * max(1, 2 ** 16 // D ** 2)))", "count = 4 * -(-B // (4 * max(1, 2 ** 14 // D ** 2)))",
     "the chunk size changes only the order of floating-point sums (tested: chunked == unchunked)"),

    ("poly-trim", "while len(p) > 1 and p[-1] == 0:", "while False:",
     "exact-zero leading coefficients contribute 0 to every sum (only the degree check notices; kept as a "
     "performance detail, and test_sparse_family_degree_stays_L_and_blocks_L4_is_refused does notice)"),
]


def snapshot(dest):
    """Copy the project's files (tracked and new, not ignored) once, so edits made while the
    mutants run do not leak into them."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        if os.path.exists(os.path.join(ROOT, f)):
            os.makedirs(os.path.join(dest, os.path.dirname(f)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, f), os.path.join(dest, f))


def run_one(mutant, base, python, timeout):
    name, old, new, why = mutant
    with tempfile.TemporaryDirectory(prefix=f"mutant-{name.replace('/', '_')}-") as tmp:
        shutil.copytree(base, tmp, dirs_exist_ok=True)
        path = os.path.join(tmp, "icl_ref.py")
        src = open(path).read()
        if src.count(old) != 1:
            return name, f"NOT APPLICABLE (old text found {src.count(old)} times)", 0.0
        open(path, "w").write(src.replace(old, new))
        start = time.perf_counter()
        try:
            proc = subprocess.run([python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"],
                                  cwd=tmp, capture_output=True, text=True, timeout=timeout)
            status = "killed" if proc.returncode != 0 else "SURVIVED"
        except subprocess.TimeoutExpired:
            status = "killed (timeout)"
        return name, status, time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-k", default="", help="run only mutants whose name contains this (comma-separated: any of these)")
    ap.add_argument("--jobs", type=int, default=2, help="suites run at once (default 2)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per suite")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = ap.parse_args()
    chosen = [m for m in MUTANTS if any(k in m[0] for k in args.k.split(","))]
    if args.list:
        for name, _, _, why in chosen:
            print(f"{name:34s} {why}")
        for name, _, _, why in EQUIVALENT:
            print(f"{name:34s} EQUIVALENT: {why}")
        return 0
    bad = 0
    with tempfile.TemporaryDirectory(prefix="mutants-base-") as base, \
            concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        snapshot(base)
        baseline = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"], cwd=base,
                                  capture_output=True, text=True, timeout=args.timeout)
        if baseline.returncode != 0:          # every mutant would look killed: say so and stop
            print("the unmutated suite fails in the snapshot; fix that first:\n" + baseline.stdout[-2000:])
            return 1
        print("unmutated suite passes in the snapshot", flush=True)
        for name, status, secs in pool.map(lambda m: run_one(m, base, sys.executable, args.timeout), chosen):
            print(f"{name:34s} {status:28s} {secs:6.1f} s", flush=True)
            bad += not status.startswith("killed")
    print(f"killed {len(chosen) - bad} / {len(chosen)}; equivalent mutants excluded: {len(EQUIVALENT)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
