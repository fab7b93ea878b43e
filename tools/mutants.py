"""Mutation check: does the default test suite notice plausible slips in icl_ref.py, icl_fast.py,
experiments.py, its command line, the other modules (icl_check, icl_looped, icl_estimators, icl_files)
and the records' tools (tools/records.py, tools/docs_figures.py)?

Each mutant names a function (its qualified name, "outer.inner" for a nested one; None: module level)
and a piece of its code; it is found inside that function whatever the layout (any run of spaces,
line breaks or comments between the characters matches any other), must occur there exactly once,
and is replaced by the mutated text in a copy of the project. The default suite then runs there with
`-x` (the mutated module's test file first); the mutant is "killed" when the suite fails, and the
test that failed is named. A survivor that changes a result is a hole in the tests. A mutant whose
function or text is no longer in the code "no longer applies": it is reported, and the exit status
says so, until it is updated or removed. Equivalent mutants (that cannot change any result) are
listed apart, with the reason, and not run.

    python3 tools/mutants.py                    # all mutants, 2 at a time (hours on 2 cores)
    python3 tools/mutants.py -k chunk,jac       # those whose name contains "chunk" or "jac"
    python3 tools/mutants.py --only predict-sign,mask-includes-query
    python3 tools/mutants.py --list             # each mutant, where it applies, and whether it still does

Not part of CI (too slow). Exit status 1 if a mutant survives or no longer applies.
"""
import argparse
import ast
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_files(root=ROOT):
    """The default suite's files: pyproject.toml's [tool.pytest.ini_options] testpaths, so that a test
    file added there is run here too."""
    with open(os.path.join(root, "pyproject.toml"), encoding="utf-8") as f:
        text = f.read()
    try:
        import tomllib                                # Python >= 3.11
        return list(tomllib.loads(text)["tool"]["pytest"]["ini_options"]["testpaths"])
    except ImportError:                               # Python 3.10: the one line that lists them
        found = re.search(r"^testpaths\s*=\s*\[([^\]]*)\]", text, re.M)
        return re.findall(r"[\"']([^\"']+)[\"']", found.group(1))


TEST_FILES = test_files()
# the test file a mutated file's mutants run first, where it is not test_<file>
PRIMARY = {"experiments_cli.py": "test_experiments.py", "experiments_beyond.py": "test_experiments.py",
           "tools/records.py": "test_records.py",
           "tools/docs_figures.py": "test_records.py", "icl_files.py": "test_records.py"}

# (name, file, function, old text, new text, why it matters)
MUTANTS = [
    ('workers-rule-dropped', 'icl_fast.py', '_Engine._gram_form', 'threads = 1 if B * L * H * D ** 3 < min_work else self.threads',
     'threads = self.threads', 'small evaluations handed to the workers after all'),
    ('workers-work-without-heads', 'icl_fast.py', '_Engine._gram_form', 'threads = 1 if B * L * H * D ** 3 < min_work else self.threads',
     'threads = 1 if B * L * D ** 3 < min_work else self.threads', "the heads left out of an evaluation's work"),
    ('workers-jacobian-at-loss-threshold', 'icl_fast.py', '_Engine.jacobian_gram', 'PARALLEL_MIN_WORK_JACOBIAN)',
     'PARALLEL_MIN_WORK)', "the Jacobian held to the loss's threshold"),
    ('mask-includes-query', 'icl_ref.py', 'mask', 'return np.diag(np.r_[np.ones(n), 0.0])',
     'return np.diag(np.r_[np.ones(n), 1.0])', 'the query becomes a key and a value'),
    ('predict-sign', 'icl_ref.py', 'predict', 'y_hat = -np.concatenate(',
     'y_hat = np.concatenate(', 'prediction sign'),
    ('literal-query-as-key', 'icl_ref.py', 'forward_literal', 'for i in range(n):                           # keys/values: context tokens only',
     'for i in range(n + 1):', 'the literal twin uses the query as a key'),
    ('gram-keeps-query', 'icl_ref.py', '_gram', 'context = Z[:, :, :-1]', 'context = Z', 'S counts the query token'),
    ('layer-1/(n+1)', 'icl_ref.py', 'layer_forward', 'for PS_h, Q_h in zip(PS, Q_l)) / n',
     'for PS_h, Q_h in zip(PS, Q_l)) / (n + 1)', '1/(n+1) normalisation'),
    ('layer-no-residual', 'icl_ref.py', 'layer_forward', 'T = np.eye(S.shape[-1]) + sum(',
     'T = 0 * np.eye(S.shape[-1]) + sum(', 'the residual connection dropped'),
    ('layer-later-heads-dropped', 'icl_ref.py', 'layer_forward', 'for PS_h, Q_h in zip(PS, Q_l)) / n',
     'for PS_h, Q_h in zip(PS[:1], Q_l)) / n', 'only the first head counted'),
    ('layer-P-transposed', 'icl_ref.py', 'layer_forward', 'PS = [P_h @ S for P_h in P_l]',
     'PS = [P_h.T @ S for P_h in P_l]', 'P_h^T S Q_h for P_h S Q_h'),
    ('layer-PS-not-transposed', 'icl_ref.py', 'layer_forward', 'PS = [P_h @ S for P_h in P_l]',
     'PS = [S @ P_h for P_h in P_l]', 'S P_h^T taken for P_h S'),
    ('layer-Q-transposed', 'icl_ref.py', 'layer_forward', '_times(PS_h, Q_h)',
     '_times(PS_h, Q_h.T)', 'P_h S Q_h^T for P_h S Q_h'),
    ('times-rows-of-transpose', 'icl_ref.py', '_times', '    return (X.reshape(-1, X.shape[-1]) @ A).reshape(X.shape)',
     '    return (X.transpose(0, 2, 1).reshape(-1, X.shape[-1]) @ A).reshape(X.shape)',
     "X_b^T A for X_b A: the stacked rows read from the transposes"),
    ('layer-S-not-conjugated', 'icl_ref.py', 'layer_forward', 'S_next = TS @ T.transpose(0, 2, 1)',
     'S_next = TS', "S' = T S instead of T S T^T"),
    ('layer-Tt-not-transposed', 'icl_ref.py', 'layer_backward', 'Tt = T.transpose(0, 2, 1)',
     'Tt = T.copy()', "T used where T^T is meant (S' = T S T and the adjoints)"),
    ('layer-q-transposed', 'icl_ref.py', 'layer_forward', 'q_next = np.einsum("bij,bj->bi", T, q)',
     'q_next = np.einsum("bji,bj->bi", T, q)', "q' = T^T q"),
    ('forward-Z-update-transposed', 'icl_ref.py', '_layers_of', 'Zs.append(T @ Zs[-1])', 'Zs.append(T.transpose(0, 2, 1) @ Zs[-1])', "forward's Z_{l+1} = T^T Z_l"),
    # §3 reverse mode (the reference)
    ('bwd-dT-from-q-transposed', 'icl_ref.py', 'layer_backward', 'dT = dq_next[:, :, None] * q[:, None, :]',
     'dT = q[:, :, None] * dq_next[:, None, :]', 'outer product transposed'),
    ('bwd-S-symmetrised-once', 'icl_ref.py', 'layer_backward', 'dT += (dS_next + dS_next.transpose(0, 2, 1)) @ TS',
     'dT += dS_next @ TS', 'T appears twice in T S T^T'),
    ('chunk-grad-normalised-per-chunk', 'icl_ref.py', '_loss_and_grad_gram', '_backpropagate(2.0 * r / B, caches)', '_backpropagate(2.0 * r / len(r), caches)', 'gradient normalised per chunk'),
    ('bwd-dq-no-transpose', 'icl_ref.py', 'layer_backward', 'dq = np.einsum("bij,bj->bi", Tt, dq_next)',
     'dq = np.einsum("bij,bj->bi", T, dq_next)', 'T q adjoint without the transpose'),
    ('bwd-middle-S-dropped', 'icl_ref.py', 'layer_backward', 'dS = Tt @ dS_next @ T if need_dS else None',
     'dS = 0 * dS_next if need_dS else None', 'the S in the middle of T S T^T'),
    ('bwd-middle-S-transposed', 'icl_ref.py', 'layer_backward', 'dS = Tt @ dS_next @ T if need_dS else None',
     'dS = T @ dS_next @ Tt if need_dS else None', 'adjoint of T S T^T transposed'),
    ('bwd-Q-not-transposed', 'icl_ref.py', 'layer_backward', 'dT_Qt = _times(dT, Q_h.T / n)',
     'dT_Qt = _times(dT, Q_h / n)', 'Q_h for Q_h^T in dP and dS'),
    ('bwd-dP-order', 'icl_ref.py', 'layer_backward', 'dP.append(over_prompts(dT_Qt, S))',
     'dP.append(over_prompts(S, dT_Qt))', 'S dT Q^T for dT Q^T S (the Jacobian rows)'),
    ('bwd-dQ-order', 'icl_ref.py', 'layer_backward', 'dQ.append(over_prompts(PS_h.transpose(0, 2, 1), dT) / n)',
     'dQ.append(over_prompts(PS_h, dT) / n)', 'P S dT for S P^T dT (the Jacobian rows)'),
    ('bwd-dQ-sum-order', 'icl_ref.py', 'layer_backward', 'dQ.append(over_prompts(PS_h.transpose(0, 2, 1), dT) / n)',
     'dQ.append(over_prompts(dT.transpose(0, 2, 1), PS_h) / n)', 'sum_b dT_b^T P S_b for sum_b S_b P^T dT_b'),
    ('bwd-dQ-no-1/n', 'icl_ref.py', 'layer_backward', 'dQ.append(over_prompts(PS_h.transpose(0, 2, 1), dT) / n)',
     'dQ.append(over_prompts(PS_h.transpose(0, 2, 1), dT))', 'dQ without 1/n'),
    ('bwd-dS-P-transposed', 'icl_ref.py', 'layer_backward', 'dS += P_h.T @ dT_Qt',
     'dS += P_h @ dT_Qt', 'dS = P dT Q^T for P^T dT Q^T'),
    ('bwd-dP-no-1/n', 'icl_ref.py', 'layer_backward', 'dT_Qt = _times(dT, Q_h.T / n)',
     'dT_Qt = _times(dT, Q_h.T)', 'dP and dS without 1/n'),
    ('sum-over-prompts-per-row', 'icl_ref.py', '_summed', 'return np.tensordot(X, Y, axes=([0, 2], [0, 1]))',
     'return np.tensordot(X, Y[::-1], axes=([0, 2], [0, 1]))', 'the sum over prompts pairs the wrong rows'),
    ('chunk-drops-last', 'icl_ref.py', '_chunks', '    size = max(1, 2 ** 18 // D ** 3)\n    return [(c, min(c + size, B)) for c in range(0, B, size)]',
     '    size = max(1, 2 ** 18 // D ** 3)\n    return [(c, c + size) for c in range(0, B - B % size, size)]', 'the last partial chunk dropped'),
    ('chunk-overlap', 'icl_ref.py', '_chunks', '    size = max(1, 2 ** 18 // D ** 3)\n    return [(c, min(c + size, B)) for c in range(0, B, size)]',
     '    size = max(1, 2 ** 18 // D ** 3)\n    return [(max(c - 1, 0), min(c + size, B)) for c in range(0, B, size)]', 'chunks overlap by one prompt'),
    ('chunk-multithreaded-gemm', 'icl_ref.py', '_chunks', '    size = max(1, 2 ** 18 // D ** 3)\n',
     '    size = max(1, 2 ** 16 // D ** 2)\n', "chunks whose GEMMs start BLAS threads at large D"),
    ('chunk-normalised-per-chunk', 'icl_ref.py', '_loss_and_grad_gram', 'loss + float(np.sum(r * r)) / B', 'loss + float(np.sum(r * r)) / len(r)', 'loss normalised per chunk'),
    ('chunk-first-only', 'icl_ref.py', '_loss_and_grad_gram', 'loss, dP, dQ = loss + float(np.sum(r * r)) / B, dP + dP_c, dQ + dQ_c', 'loss, dP, dQ = (float(np.sum(r * r)) / B, dP_c, dQ_c) if a == 0 else (loss, dP, dQ)', "the first chunk's loss and gradient only"),
    ('chunk-first-labels', 'icl_ref.py', '_loss_and_grad_gram', 'r = out + y[a:b]', 'r = out + y[:b - a]', "every chunk reads the first chunk's labels"),
    ('S0-symmetry-unchecked', 'icl_ref.py', '_gram_args', 'if np.any(S0 != S0.transpose(0, 2, 1)):',
     'if False:', 'a non-symmetric S0 gives a wrong gradient without a word'),
    # §3.1 the Jacobian
    ('jac-seed', 'icl_ref.py', '_jacobian_gram', '_backpropagate(np.ones_like(out), caches, per_prompt=True)', '_backpropagate(2.0 * np.ones_like(out), caches, per_prompt=True)', 'the Jacobian of r^2 instead of r'),
    ('jac-labels', 'icl_ref.py', '_jacobian_gram', 'parts.append((out + y[a:b],', 'parts.append((out - y[a:b],', "residual with the label's sign flipped"),
    ('jac-rows-B-from-Q', 'icl_ref.py', '_structure_grad', 'dA, dB = -dQ[..., 0, :-1, :-1], dP[..., 0, :-1, :-1]',
     'dA, dB = -dQ[..., 0, :-1, :-1], dQ[..., 0, :-1, :-1]', "the blocks' B rows read from dQ"),
    ('jac-structure-unchecked', 'icl_ref.py', '_check_structure_of', 'if not (np.array_equal(P, expected[0]) and np.array_equal(Q, expected[1])):',
     'if False:', "rows in a structure's coordinates for parameters of another form"),
    # §6 training, §11 the sandwich
    ('gn-fixed-wrong-layer', 'icl_ref.py', '_fixed_coordinates', 'masks["B"][-1] = True',
     'masks["B"][0] = True', 'B_0 held fixed instead of B_{L-1}'),
    ('gn-gradient-scale', 'icl_ref.py', 'train_gauss_newton.evaluate', 'grad=2 * cache["R"].T @ cache["f"]',
     'grad=cache["R"].T @ cache["f"]', 'converged judged on half the gradient'),
    ('gn-reduced-block-dropped', 'icl_ref.py', '_reduced_least_squares', 'for a in range(0, B, rows):',
     'for a in range(0, B - rows, rows):', "the last block of rows left out of the factor"),
    ('gn-reduced-rho', 'icl_ref.py', '_reduced_least_squares', 'return R_aug[:, p], R_aug[:, :p]',
     'return np.r_[R_aug[:p, p], 0.0], R_aug[:, :p]', "the reduced system loses the part of r outside J's range (wrong costs)"),
    ('gn-reduced-R-transposed', 'icl_ref.py', '_reduced_least_squares', 'return R_aug[:, p], R_aug[:, :p]',
     'return R_aug[:, p], np.vstack([R_aug[:p, :p].T, R_aug[p:, :p]])', 'R^T handed to the solver'),
    ('loss-half', 'icl_ref.py', 'in_context_loss', 'return float(np.mean((predict(P, Q, Z) - y) ** 2))',
     'return float(0.5 * np.mean((predict(P, Q, Z) - y) ** 2))', 'loss with a factor 1/2'),
    ('gn-fixed-full-P-columns', 'icl_ref.py', '_fixed_coordinates', 'masks["P"][-1, :, :-1, :] = True',
     'masks["P"][-1, :, :, :-1] = True', 'the x-columns of the last P held fixed instead of its x-rows'),
    ('lbfgs-success-unjudged', 'icl_ref.py', 'train_lbfgs', 'success = not outcome["interrupted"] and grad_max <= options["gtol"]',
     'success = not outcome["interrupted"]', 'success without a small gradient'),
    ('lbfgs-maxfun-default', 'icl_ref.py', 'train_lbfgs', 'maxfun=5 * maxiter if maxfun is None',
     'maxfun=maxiter if maxfun is None', 'the documented default of maxfun'),
    ('lbfgs-overflow-uncounted', 'icl_ref.py', 'train_lbfgs.fun', '            failed[0] += 1\n',
     '', 'rejected trial points go unreported'),
    # §4 attention, §5 structures, §7-§13
    ('attn-relu-grad-sign', 'icl_ref.py', 'attention_backward', 'dE = dA * (E > 0)',
     'dE = dA * (E >= 0) - dA * (E < 0)', 'relu derivative wrong'),
    ('attn-softmax-grad-sign', 'icl_ref.py', 'attention_backward', 'dE = A * (dA - np.sum(A * dA, axis=1, keepdims=True))',
     'dE = A * (dA + np.sum(A * dA, axis=1, keepdims=True))', 'sign in the softmax backward'),
    ('attn-bwd-dV-untransposed-A', 'icl_ref.py', 'attention_backward', 'dV = dout @ A.transpose(0, 2, 1) / n',
     'dV = dout @ A / n', "out = V A / n: dV = dout A^T taken as dout A"),
    ('attn-bwd-dA-no-1/n', 'icl_ref.py', 'attention_backward', 'dA = V.transpose(0, 2, 1) @ dout / n',
     'dA = V.transpose(0, 2, 1) @ dout', "the 1/n dropped from the scores' adjoint"),
    ('attn-bwd-value-mask-dropped', 'icl_ref.py', 'attention_backward', '    dV[:, :, n] = 0.0\n', '\n',
     "V = P Z M: the mask left out of the adjoint, so the query's value gets a gradient"),
    ('attn-bwd-P-untransposed', 'icl_ref.py', 'attention_backward', 'dZ = P_h.T @ dV', 'dZ = P_h @ dV',
     'V = P Z: dZ = P^T dV taken as P dV'),
    ('attn-bwd-keys-Q-untransposed', 'icl_ref.py', 'attention_backward',
     'dZ += Q_h @ Z @ dE.transpose(0, 2, 1) + Q_h.T @ Z @ dE',
     'dZ += Q_h @ Z @ dE.transpose(0, 2, 1) + Q_h @ Z @ dE', 'E = Z^T Q Z: the queries\' adjoint with Q for Q^T'),
    ('attn-softmax-keys', 'icl_ref.py', 'attention_forward', 'keys = n if activation == "softmax" else n + 1',
     'keys = n + 1', 'softmax normalised over n+1 keys'),
    ('attn-dZ-keys-only', 'icl_ref.py', 'attention_backward', 'dZ += Q_h @ Z @ dE.transpose(0, 2, 1) + Q_h.T @ Z @ dE',
     'dZ += Q_h @ Z @ dE.transpose(0, 2, 1)', 'Z used as query forgotten in the backward'),
    ('attn-value-unmasked', 'icl_ref.py', 'attention_forward', '    V[:, :, n] = 0.0                                           # V = P Z M\n',
     '\n', 'the query used as a value'),
    ('attn-jacobian-dP', 'icl_ref.py', 'attention_backward', 'return dZ, over_prompts(dV, Zt), over_prompts(Z @ dE, Zt)',
     'return dZ, over_prompts(Z, dV.transpose(0, 2, 1)), over_prompts(Z @ dE, Zt)', 'per-prompt dP transposed'),
    ('attn-jacobian-dQ', 'icl_ref.py', 'attention_backward', 'return dZ, over_prompts(dV, Zt), over_prompts(Z @ dE, Zt)',
     'return dZ, over_prompts(dV, Zt), over_prompts(Z, (Z @ dE).transpose(0, 2, 1))', 'per-prompt dQ transposed'),
    ('attn-chunk-normalisation', 'icl_ref.py', '_activation_chunk', 'dZ[:, -1, -1] = 1.0 if jacobian else 2.0 * r / B',
     'dZ[:, -1, -1] = 1.0 if jacobian else 2.0 * r / len(r)', "explicit attention's chunks normalised per chunk"),
    ('block-grad-sign', 'icl_ref.py', '_structure_grad', 'dA, dB = -dQ[..., 0, :-1, :-1], dP[..., 0, :-1, :-1]',
     'dA, dB = dQ[..., 0, :-1, :-1], dP[..., 0, :-1, :-1]', 'the sign of (8) forgotten in the chain rule'),
    ('block-P-corner', 'icl_ref.py', 'block_params', 'P[:, 0, d, d] = 1.0',
     'P[:, 0, d, d] = 0.0', "P's corner not 1"),
    ('lemma1-no-transpose', 'icl_ref.py', 'preconditioned_gd', 'W.append(W[-1] - grad_R @ A_l) ',
     'W.append(W[-1] - grad_R @ A_l.T) ', 'the printed A_l instead of A_l^T'),
    ('lemma1-1/(n+1)', 'icl_ref.py', 'preconditioned_gd', 'np.einsum("bid,bd->bi", X, W[-1]) - y) / n',
     'np.einsum("bid,bd->bi", X, W[-1]) - y) / (n + 1)', '1/(n+1) in grad R'),
    ('K-(n+1)/n', 'icl_ref.py', '_single_layer_moments', 'K = ((n + 1) / n) * Sigma @ M @ Sigma',
     'K = (n / (n + 1)) * Sigma @ M @ Sigma', 'n/(n+1) for (n+1)/n'),
    ('K-noise-dropped', 'icl_ref.py', '_single_layer_moments', '((np.trace(M @ Sigma) + noise_var) / n) * Sigma',
     '((np.trace(M @ Sigma)) / n) * Sigma', 'context noise dropped from K'),
    ('K-trace-order', 'icl_ref.py', '_single_layer_moments', '((np.trace(M @ Sigma) + noise_var) / n) * Sigma',
     '((np.trace(M) + noise_var) / n) * Sigma', 'tr(Sigma_w) for tr(Sigma_w Sigma)'),
    ('single-loss-query-noise', 'icl_ref.py', '_single_layer_loss', 'loss = c_q * w * excess + (noise_var if query_noise else 0.0)', 'loss = c_q * w * excess', 'query noise dropped'),
    ('mahankali-no-plus-one', 'icl_ref.py', 'gd_step_size', 'return 1.0 / (_int("n", n, 1) + 1 + _int("d", d, 1)',
     'return 1.0 / (_int("n", n, 1) + _int("d", d, 1)', 'the +1 of n+1+d'),
    ('wishart-n+k', 'icl_ref.py', '_wishart_T', 'total = (n + k - 1) * T(k - 1, *rest)',
     'total = (n + k) * T(k - 1, *rest)', 'n+k-1 off by one'),
    ('wishart-2m', 'icl_ref.py', '_wishart_T', 'total += sum(2 * m * T(k + m - 1,',
     'total += sum(m * T(k + m - 1,', '2m factor dropped'),
    ('wishart-split-range', 'icl_ref.py', '_wishart_T', 'total += sum(T(j, k - 1 - j, *rest) for j in range(1, k))',
     'total += sum(T(j, k - 1 - j, *rest) for j in range(1, k - 1))', 'one split term dropped'),
    ('family-r-phi', 'icl_ref.py', 'family_polynomials', 'r = _poly_add(r, _poly_mul([a_l], _poly_mul(p, _poly_mul(phi, phi))))',
     'r = _poly_add(r, _poly_mul([a_l], _poly_mul(p, phi)))', 'r built with phi instead of phi^2'),
    ('family-s-square', 'icl_ref.py', 'family_polynomials', 'phi, s = _poly_mul(phi, step), _poly_mul(s, _poly_mul(step, step))',
     'phi, s = _poly_mul(phi, step), _poly_mul(s, step)', 's_{l+1} = s_l (1 - g s_l), not squared'),
    ('family-noise-1/n', 'icl_ref.py', 'family_population_loss', 'f += s2 / n * sum(e_k * m_k for e_k, m_k in zip(e, m[1:]))',
     'f += s2 * sum(e_k * m_k for e_k, m_k in zip(e, m[1:]))', 'noise term without 1/n'),
    ('family-noise-moment-shift', 'icl_ref.py', 'family_population_loss', 'f += s2 / n * sum(e_k * m_k for e_k, m_k in zip(e, m[1:]))',
     'f += s2 / n * sum(e_k * m_k for e_k, m_k in zip(e, m))', 'E tr(r^2) for E tr(S r^2)'),
    ('family-at-nodes-noise', 'icl_ref.py', '_family_loss_at_nodes', 'f = float(weights @ p ** 2 + noise_var / n * (weights @ (nodes * r ** 2)))',
     'f = float(weights @ p ** 2)', 'noise dropped from what optimal_family_scalars minimises'),
    ('family-adjoint-noise-seed', 'icl_ref.py', '_family_loss_at_nodes', '2 * noise_var / n * weights * nodes * r, 0.0, 0.0',
     '2 * noise_var * weights * nodes * r, 0.0, 0.0', "the noise term's adjoint without 1/n"),
    ('family-adjoint-s-square', 'icl_ref.py', '_family_loss_at_nodes', 'ds, dphi = ds * u * (1 - 3 * gam[l] * s) - dphi * phi * gam[l], dphi * u',
     'ds, dphi = ds * u - dphi * phi * gam[l], dphi * u', "d(s u^2)/ds taken as u (u's own s dropped)"),
    ('family-adjoint-phi-square', 'icl_ref.py', '_family_loss_at_nodes', 'dphi = dphi + 2 * dr * a[l] * p * phi',
     'dphi = dphi + dr * a[l] * p * phi', 'd(phi^2)/dphi without its 2'),
    ('family-adjoint-gamma-chain', 'icl_ref.py', '_family_loss_at_nodes', 'return f, np.r_[da + dg * b, dg[:-1] * a[:-1]] if blocks else da',
     'return f, np.r_[da, dg[:-1] * a[:-1]] if blocks else da', 'gamma_l = a_l b_l: the a_l part of its chain rule dropped'),
    ('family-at-nodes-phi', 'icl_ref.py', '_family_loss_at_nodes', 'r = r + a_l * p * phi ** 2',
     'r = r + a_l * p * phi', 'phi for phi^2 in the optimiser'),
    ('chebyshev-beta', 'icl_ref.py', 'wishart_quadrature', 'beta.append(sigma_next[k] / sigma[k - 1])',
     'beta.append(sigma_next[k] / sigma[k])', "Chebyshev's beta with the wrong denominator"),
    ('gauss-weights', 'icl_ref.py', 'wishart_quadrature', 'return nodes, float(beta[0]) * vecs[0] ** 2',
     'return nodes, float(beta[0]) * vecs[0]', 'Golub-Welsch weights not squared'),
    ('vo-no-n', 'icl_check.py', 'params_from_von_oswald', 'P = n * np.swapaxes(Wv @ Wo, -1, -2)', 'P = np.swapaxes(Wv @ Wo, -1, -2)', "von Oswald et al.'s missing 1/n not folded into P"),
    ('vo-Q-order', 'icl_check.py', 'params_from_von_oswald', 'Q = s * Wk @ np.swapaxes(Wq, -1, -2)', 'Q = s * Wq @ np.swapaxes(Wk, -1, -2)', 'W_q W_k^T for W_k W_q^T'),
    ('vo-grad-Wq', 'icl_check.py', 'grads_to_von_oswald', 'grads = [c * s * np.swapaxes(dQ, -1, -2) @ Wk, c * s * dQ @ Wq,', 'grads = [c * s * dQ @ Wk, c * s * dQ @ Wq,', 'dW_q without dQ^T'),
    ('diag-Q-variant-grad', 'icl_check.py', '_slip_outputs', 'dQ=np.swapaxes(dQ, -1, -2) if QT else dQ)', 'dQ=dQ)', "the transposed-Q variant's gradient not transposed back"),
    ('diag-no-mask-variant', 'icl_check.py', '_slip_outputs', 'np.concatenate([Z, Z[:, :, n:]], axis=2)', 'np.concatenate([Z[:, :, :n], Z[:, :, n - 1:n], Z[:, :, n:]], axis=2)', 'the query-as-key variant computed with the mask'),
    ('distance-alpha', 'icl_ref.py', 'distance_to_multiple', 'alpha = np.sum(M * T) / np.sum(T * T)',
     'alpha = np.sum(M * T) / np.sum(M * M)', 'projection onto the wrong vector'),
    ('authors-Q-not-transposed', 'icl_check.py', 'params_from_authors', 'Q[:, :, :d, :d] = allparam[:, :, 1].transpose(0, 1, 3, 2)', 'Q[:, :, :d, :d] = allparam[:, :, 1]', "the authors' Q used without the transpose"),
    ('authors-grad-not-transposed', 'icl_check.py', 'grads_to_authors', 'return np.stack([dP[..., :d, :d], dQ[..., :d, :d].swapaxes(-1, -2)], axis=2)', 'return np.stack([dP[..., :d, :d], dQ[..., :d, :d]], axis=2)', "gradient to the authors' layout untransposed"),
    # the periphery: diagnosis, the cases' claims, options, boundaries, files
    ('diag-normalisation-grad', 'icl_check.py', '_slip_outputs', 'dP=loss * p * out["dP"]', 'dP=loss * out["dP"]', "the normalisation variants' gradients not scaled back"),
    ('diag-default-rtol', 'icl_check.py', 'diagnose', 'def diagnose(outputs, rtol=1e-6, layout="paper", full=False):', 'def diagnose(outputs, rtol=1e-4, layout="paper", full=False):', "diagnose's documented default tolerance"),
    ('diag-order', 'icl_check.py', '_summary', 'ranked = sorted(culprits.items(), key=lambda kv: -len(kv[1]))', 'ranked = sorted(culprits.items(), key=lambda kv: len(kv[1]))', 'likely causes listed least frequent first'),
    ('diag-query-key-scale', 'icl_check.py', '_slip_outputs', 'p * (n + 1) / n, "softmax" if', 'p, "softmax" if', 'the query-as-key variant loses the 1/n'),
    ('diag-malformed-shape', 'icl_check.py', '_malformed', '    if a.shape != np.shape(ref):\n        return "shape"', '    if False:\n        return "shape"', 'a wrongly shaped array reported as a numeric mismatch'),
    ('diag-empty-accepted', 'icl_check.py', 'diagnose', '    if not outputs:\n        raise ValueError("outputs is empty', '    if False:\n        raise ValueError("outputs is empty', 'diagnose({}) says everything agrees'),
    ('check-skip-as-pass', 'icl_check.py', 'check_implementation', 'dict(status="skipped" if name in skip else "failed"', 'dict(status="passed" if name in skip else "failed"', 'a case fn cannot run counted as passed'),
    ('check-float32-tolerance', 'icl_check.py', None, '"float32": dict(forward=1e-5, loss=1e-4, gradient=1e-4)', '"float32": dict(forward=1e-12, loss=1e-12, gradient=1e-10)', "float32 code judged at float64's tolerances"),
    ('check-rtol-kind', 'icl_check.py', 'check_implementation', 'kind = {q: "gradient" if q.startswith(("d", "grad_")) else "loss" if q == "loss" else "forward" for q in wanted}', 'kind = {q: "gradient" for q in wanted}', "the forward pass judged at the gradients' looser tolerance"),
    ('check-vo-loss-scale', 'icl_check.py', '_layout_outputs', 'scale = 1.0 if layout == "authors" else VON_OSWALD_LOSS_SCALE', 'scale = 1.0', "von Oswald et al.'s loss compared without their 1/2"),
    ('case-theorem1-n', 'icl_check.py', '_reference_cases', 'ir.sparse_params(ir.gamma_star(Sigma, 6)[None])', 'ir.sparse_params(ir.gamma_star(Sigma, 5)[None])', "the case named Theorem 1's optimum is another n's"),
    ('case-family-n', 'icl_check.py', '_reference_cases', 'a_star = ir.optimal_family_scalars(3, 10, 3)[0]', 'a_star = ir.optimal_family_scalars(3, 20, 3)[0]', "the case named the family optimum is another n's"),
    ('manifest-L-H', 'icl_check.py', 'write_reference_vectors', 'L=int(P.shape[0]),\n            H=int(P.shape[1])', 'L=int(P.shape[1]),\n            H=int(P.shape[0])', "the manifest's L and H swapped"),
    ('layouts-vo-no-softmax', 'icl_check.py', '_case_layouts', '    if case["activation"] in ("linear", "softmax"):\n        layouts.append("von_oswald")', '    if case["activation"] in ("linear",):\n        layouts.append("von_oswald")', 'the softmax case loses the layout README promises'),
    ('lbfgs-keep-iterates-first', 'icl_ref.py', 'train_lbfgs', 'iterates = [run.coords(run.theta0, user_units=True)] if keep_iterates else None',
     'iterates = [] if keep_iterates else None', 'keep_iterates without the initial point'),
    ('lbfgs-progress-number', 'icl_ref.py', 'train_lbfgs.callback', 'run.say("iter", len(history) - 1,',
     'run.say("iter", len(history),', 'progress lines number iterations from 1 too many'),
    ('lbfgs-ftol-wiring', 'icl_ref.py', 'train_lbfgs', 'ftol=_nonneg("ftol", ftol)',
     'ftol=_nonneg("ftol", gtol)', "ftol wired to gtol's value"),
    ('jac-activation-structure', 'icl_ref.py', 'residuals_and_jacobian', 'J = _jacobian_rows(structure, JP, JQ, tied)',
     'J = _jacobian_rows(structure if activation == "linear" else "full", JP, JQ, tied)', 'the structure ignored with an activation'),
    ('authors-form-Q-column', 'icl_check.py', 'params_to_authors', '\n            or np.any(Q[..., :, d])):', '):', 'params_to_authors accepts Q with a last column'),
    ('sandwich-chunk-scale', 'icl_ref.py', 'sandwich_covariance', 'V_U = size * np.atleast_2d(',
     'V_U = np.atleast_2d(', 'the chunk-mean covariance not scaled to one prompt'),
    ('distance-diagonal', 'icl_ref.py', 'distance_to_diagonal', 'np.linalg.norm(M - np.diag(np.diag(M)))',
     'np.linalg.norm(M - np.diag(M))', 'the diagonal broadcast as a row'),
    ('haar-sign', 'icl_ref.py', 'rotated_covariance', '    U = U * np.sign(np.diag(R))\n',
     '', 'the QR factor without the sign fix is not Haar'),
    ('moment-order-boundary', 'icl_ref.py', 'wishart_trace_moments', '    if kmax > MAX_MOMENT_ORDER:',
     '    if kmax >= MAX_MOMENT_ORDER:', 'the largest supported order refused'),
    ('bool-as-integer', 'icl_ref.py', '_int', '    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):',
     '    if not isinstance(v, (int, np.integer)):', 'True accepted as 1'),
    ('sigma-symmetry-absolute', 'icl_ref.py', '_spd', 'if np.max(np.abs(Sigma - Sigma.T)) > 1e-12 * np.max(np.abs(Sigma)):',
     'if np.max(np.abs(Sigma - Sigma.T)) > 1e-12:', 'symmetry judged on an absolute scale'),
    ('symmetry-mixing-sign', 'icl_ref.py', 'symmetry_directions', 'dP[l, h], dQ[l, g] = P[l, g], -Q[l, h]',
     'dP[l, h], dQ[l, g] = P[l, g], Q[l, h]', 'the rescaling direction with the wrong sign (not a symmetry)'),
    ('fixed-Q-last-row', 'icl_ref.py', '_fixed_coordinates', 'masks["Q"][0, :, :, -1] = True',
     'masks["Q"][0, :, -1, :] = True', "Q's last row held fixed for one layer instead of its last column"),
    ('trainable-scale-unchecked', 'icl_ref.py', '_data_scale', 'if m < np.finfo(np.float64).tiny:',
     'if False:', "data that underflow 'converge' at the start"),
    ('lbfgs-norm-overflows', 'icl_ref.py', '_norm', '    return m * float(np.linalg.norm(g / m)) if 0 < m < math.inf else m',
     '    return float(np.linalg.norm(g))', 'the gradient norm overflows for a finite gradient'),
    ('full-layer-2nd-term-1/(n+1)', 'icl_ref.py', 'full_layer_population_loss', 'np.einsum("nkhi,ij,nhkj->n", b, Sigma, b) / n',
     'np.einsum("nkhi,ij,nhkj->n", b, Sigma, b) / (n + 1)', "E[C A C]'s n Sigma A^T Sigma term misweighted"),
    ('full-layer-trace-term-dropped', 'icl_ref.py', 'full_layer_population_loss', '                     + np.einsum("nhk,nhi,nki->n", trace, Su, u) / n)',
     '                     )', "E[C A C]'s tr(A Sigma) Sigma term dropped"),
    ('full-layer-K-transposed', 'icl_ref.py', 'full_layer_population_loss', 'b = np.einsum("nkij,nhi->nkhj", K, Su)',
     'b = np.einsum("nkji,nhi->nkhj", K, Su)', 'K_k Sigma u_h for K_k^T Sigma u_h'),
    ('full-layer-heads-paired', 'icl_ref.py', 'full_layer_population_loss', 'np.einsum("nkhi,ij,nhkj->n", b, Sigma, b)',
     'np.einsum("nkhi,ij,nkhj->n", b, Sigma, b)', 'b_kh^T Sigma b_kh for b_kh^T Sigma b_hk (the A^T term)'),
    ('full-layer-trace-transposed', 'icl_ref.py', 'full_layer_population_loss', 'trace = np.einsum("nhij,nkij->nhk", K @ Sigma, Sigma @ K)',
     'trace = np.einsum("nhij,nkji->nhk", K @ Sigma, Sigma @ K)', 'tr(K_h Sigma Sigma K_k) for tr(K_h Sigma K_k^T Sigma)'),
    ('full-layer-w-not-coloured', 'icl_ref.py', 'full_layer_population_loss', '    w = xi @ F_w.T                                                # w = F_w xi ~ N(0, Sigma_w)',
     '    w = xi', 'w* drawn from N(0, I) whatever Sigma_w'),
    ('population-minimum-wrong-symmetry', 'experiments.py', 'population_minimum.derivatives', 'V = scipy.linalg.null_space(np.r_[theta[:D], -theta[D:]][None])',
     'V = scipy.linalg.null_space(np.r_[theta[:D], theta[D:]][None])', 'the direction removed is not the rescaling'),
    ('experiments-single-layer-any-start', 'experiments.py', 'single_layer', 'reached, said = starts_summary(fulls, lowest=res["loss"], rtol=1e-9)',
     'reached, said = starts_summary(fulls, rtol=1e-9)', 'a start stuck above the sparse optimum carries the PASS'),
    ('experiments-starts-any-converged', 'experiments.py', 'starts_summary', '    reached = [r for r in done if r["loss"] <= lowest * (1 + rtol)]',
     '    reached = list(done)', 'every converged start counts as having reached the lowest loss'),
    ('experiments-softmax-first-baseline', 'experiments.py', 'softmax_two_head', 'linear = reached[0] if reached else best_of(linears)',
     'linear = linears[0]', "the softmax heads compared with the linear layer's first start, not its best"),
    ('experiments-unconstrained-first-start', 'experiments.py', 'unconstrained', 'res = reached[0] if reached else best_of(runs)',
     'res = runs[0]', 'the blocks that appear read from the first start, not the best'),
    ('experiments-train-full-max-nfev-dropped', 'experiments.py', 'train_full',
     'init={"P": res["P"], "Q": res["Q"]}, max_nfev=max_nfev)', 'init={"P": res["P"], "Q": res["Q"]})',
     "train_full's Gauss-Newton stage ignores max_nfev (the default 500 evaluations)"),
    ('experiments-family-optimum-uncached', 'experiments.py', 'family_optimum', '@functools.lru_cache(maxsize=16)',
     '@functools.lru_cache(maxsize=0)', 'the family optimum searched again at every call'),
    # §16 the engine: lanes, workers, BLAS (icl_fast.py)
    ('kernel-no-transpose', 'icl_fast.py', 'kernel_forward', 'return sum(np.kron(P_h, Q_h.T) for P_h, Q_h in zip(P_l, Q_l)) / n',
     'return sum(np.kron(P_h, Q_h) for P_h, Q_h in zip(P_l, Q_l)) / n', 'column-major vec identity'),
    ('kernel-1/(n+1)', 'icl_fast.py', 'kernel_forward', 'return sum(np.kron(P_h, Q_h.T) for P_h, Q_h in zip(P_l, Q_l)) / n',
     'return sum(np.kron(P_h, Q_h.T) for P_h, Q_h in zip(P_l, Q_l)) / (n + 1)', '1/(n+1) normalisation'),
    ('kernel-bwd-dP-index', 'icl_fast.py', 'kernel_backward', 'dP_l = np.stack([np.einsum("iljk,kl->ij", dK, Q_h) for Q_h in Q_l])',
     'dP_l = np.stack([np.einsum("iljk,lk->ij", dK, Q_h) for Q_h in Q_l])', 'Q_h transposed in dP'),
    ('kernel-bwd-dQ-index', 'icl_fast.py', 'kernel_backward', 'dQ_l = np.stack([np.einsum("iljk,ij->kl", dK, P_h) for P_h in P_l])',
     'dQ_l = np.stack([np.einsum("iljk,ij->lk", dK, P_h) for P_h in P_l])', 'dQ transposed'),
    ('kernel-bwd-no-1/n', 'icl_fast.py', 'kernel_backward', 'dK = dK.reshape(D, D, D, D) / n ',
     'dK = dK.reshape(D, D, D, D) ', 'the 1/n of K forgotten in its adjoint'),
    ('lanes-normalised-per-chunk', 'icl_fast.py', 'lanes_loss_and_grad_gram.one_chunk', 'return float(r @ r) / B, dKs',
     'return float(r @ r) / len(r), dKs', 'the lanes loss normalised per chunk'),
    ('fast-map-chunks-keeps-claiming', 'icl_fast.py', '_map', 'if i >= len(bounds) or stop.is_set():',
     'if i >= len(bounds):', 'after an error or a Ctrl-C the workers go on through every chunk in the background'),
    ('fast-pool-unbound', 'icl_fast.py', '_pool', '            if len(cores) == workers and hasattr(os, "sched_setaffinity"):\n',
     '            if False:\n', 'workers woken together after an idle spell share one core (an evaluation ~1.7x slower)'),
    ('sym-E-off-diagonal-once', 'icl_fast.py', 'symmetric_coordinates', 'E[np.arange(D * D), full] = 1.0',
     'E[np.arange(D * D), full] = 1.0\n    E[i * D + j, np.arange(len(i))] = 2.0', 'the upper-triangle entries counted twice in vec(S) = E s'),
    ('fast-blas-not-limited', 'icl_fast.py', '_one_blas_thread', '            for _, put in _BLAS["libraries"]:\n                put(1)\n',
     '            for get, put in _BLAS["libraries"]:\n                put(get())\n', 'OpenBLAS left at its threads while the workers run'),
    ('fast-blas-not-restored', 'icl_fast.py', '_restore_blas', '            put(count)\n',
     '            put(1)\n', "the caller's OpenBLAS setting not restored"),
    ('symmetric-product-one-operand', 'icl_fast.py', '_symmetric_product', 'np.einsum("jb,kjb->kb", X[i], Y[i:], out=s[start:start + D - i])',
     'np.einsum("jb,kjb->kb", X[i], X[i:], out=s[start:start + D - i])', 'X X^T instead of X Y^T (right for the Gram product, wrong for T S T^T and T^T G T)'),
    ('symmetric-full-upper-only', 'icl_fast.py', '_symmetric_full', 'return s.take(symmetric_coordinates(D)[1], axis=0).reshape(D, D, s.shape[-1])',
     'S = np.zeros((D * D, s.shape[-1]))\n    S[symmetric_coordinates(D)[0]] = s\n    return S.reshape(D, D, s.shape[-1])', 'the lower triangle of Z M Z^T, T S T^T and T^T G T left empty'),
    ('lanes-last-wrong-row', 'icl_fast.py', 'lanes_forward', 't = K_s[-D:] @ s                                          # row d of T - I, (D, b)',
     't = K_s[:D] @ s', 'the last layer reads row 0 of T, not row d'),
    ('lanes-last-no-residual', 'icl_fast.py', 'lanes_forward', '    t[-1] += 1.0\n',
     '    t[-1] += 0.0\n', 'the residual dropped in the last layer'),
    ('lanes-no-residual', 'icl_fast.py', 'lanes_forward', 'T.reshape(D * D, b)[::D + 1] += 1.0',
     'T.reshape(D * D, b)[::D + 1] += 0.0', 'the residual connection dropped'),
    ('lanes-identity-stride', 'icl_fast.py', 'lanes_forward', 'T.reshape(D * D, b)[::D + 1] += 1.0',
     'T.reshape(D * D, b)[::D] += 1.0', 'I added along the wrong rows of vec(T)'),
    ('lanes-S-not-conjugated', 'icl_fast.py', 'lanes_forward', 's_next = _symmetric_product(TS, T)',
     's_next = s.copy()', "S' = S: the conjugation T S T^T dropped"),
    ('lanes-dt-last', 'icl_fast.py', 'lanes_backward', 'dt = dq_next * q                                          # row d of dT',
     'dt = dq_next * T', "the last layer's dT from t instead of q"),
    ('lanes-dq-last', 'icl_fast.py', 'lanes_backward', 'dq, ds = dq_next * T, K_s[-D:].T @ dt',
     'dq, ds = dq_next * q, K_s[-D:].T @ dt', "the last layer's dq from q instead of t"),
    ('lanes-dT-outer-transposed', 'icl_fast.py', 'lanes_backward', 'dT = dq_next[:, None, :] * q[None, :, :]',
     'dT = q[:, None, :] * dq_next[None, :, :]', "outer product dq' q^T transposed"),
    ('lanes-dT-TS-untransposed', 'icl_fast.py', 'lanes_backward', 'dT += np.einsum("ijb,kjb->ikb", G_next, np.ascontiguousarray(TS.transpose(1, 0, 2)))',
     'dT += np.einsum("ijb,kjb->ikb", G_next, TS)', "G' (T S)^T instead of G' T S"),
    ('lanes-dq-untransposed', 'icl_fast.py', 'lanes_backward', 'dq, ds = np.einsum("ijb,jb->ib", Tt, dq_next), K_s.T @ dT',
     'dq, ds = np.einsum("ijb,jb->ib", T, dq_next), K_s.T @ dT', 'T q adjoint without the transpose'),
    ('lanes-G-diagonal-once', 'icl_fast.py', 'lanes_backward', 'g = ds * np.where(symmetric_coordinates(D)[3], 2.0, 1.0)[:, None]',
     'g = ds * np.where(symmetric_coordinates(D)[3], 1.0, 1.0)[:, None]', 'G = dS + dS^T without doubling the diagonal'),
    ('lanes-middle-dropped', 'icl_fast.py', 'lanes_backward', 'g += _symmetric_product(np.einsum("ijb,kjb->ikb", Tt, G_next), Tt)',
     'g += 0.0', 'the S in the middle of T S T^T'),
    ('lanes-middle-transposed', 'icl_fast.py', 'lanes_backward', 'g += _symmetric_product(np.einsum("ijb,kjb->ikb", Tt, G_next), Tt)',
     'g += _symmetric_product(np.einsum("ijb,kjb->ikb", T, G_next), T)', "T G' T^T instead of T^T G' T"),
    ('lanes-reader-s-from-lower', 'icl_fast.py', '_lanes_chunk', 'S.reshape(D * D, -1).take(symmetric_coordinates(D)[0], axis=0)',
     'S.reshape(D * D, -1)[:len(symmetric_coordinates(D)[0])]', 'the Gram-form reader takes the first U entries of vec(S_0) for its distinct entries'),
    ('lanes-dK-not-expanded', 'icl_fast.py', 'lanes_loss_and_grad_gram', 'dK = sum(part[1][l] for part in parts) @ E.T',
     'dK = np.zeros((E.shape[0], E.shape[0]))\n        dK[:, symmetric_coordinates(P.shape[-1])[0]] = sum(part[1][l] for part in parts)', 'dK_s placed on the upper positions only, not spread by E^T'),
    ('lanes-loss-chunk-B', 'icl_fast.py', '_lanes_chunk', 'return q + y[start:stop], caches',
     'return q + y[:stop - start], caches', 'every chunk reads the first labels'),
    ('lanes-jac-seed', 'icl_fast.py', 'lanes_jacobian_gram.one_chunk', 'G, dq = None, np.ones(stop - start)',
     'G, dq = None, 2.0 * r[start:stop] / (stop - start)', "the Jacobian seeded with the loss's 2 r / B instead of dr/dq = 1"),
    ('lanes-jac-dP-Q-transposed', 'icl_fast.py', 'lanes_jacobian_gram.one_chunk', 'np.einsum("ijb,kj->ikb", dT, Q[l, h] / n), S_l)',
     'np.einsum("ijb,jk->ikb", dT, Q[l, h] / n), S_l)', 'dr/dP = dT Q S instead of dT Q^T S'),
    ('lanes-jac-dQ-order', 'icl_fast.py', 'lanes_jacobian_gram.one_chunk', 'JQ[start:stop, l, h] = np.einsum("ijb,jkb->bik"',
     'JQ[start:stop, l, h] = np.einsum("ijb,kjb->bik"', 'dr/dQ = S P^T dT^T instead of S P^T dT'),
    ('lanes-jac-no-1/n', 'icl_fast.py', 'lanes_jacobian_gram.one_chunk', 'np.einsum("ijb,kj->ikb", S_l, P[l, h] / n), dT)',
     'np.einsum("ijb,kj->ikb", S_l, P[l, h]), dT)', 'dr/dQ without the 1/n'),
    ('lanes-jac-last-row', 'icl_fast.py', 'lanes_backward', '            dmap[-1] = dt\n',
     '            dmap[0] = dt\n', "the last layer's per-prompt dT in row 0 instead of row d"),
    ('lanes-jac-S-after-layer', 'icl_fast.py', 'lanes_jacobian_gram.one_chunk', 'S_l = caches[l][1]',
     'S_l = caches[min(l + 1, L - 1)][1]', "the rows use the next layer's S"),
    ('lanes-grad-per-chunk', 'icl_fast.py', 'lanes_loss_and_grad_gram.one_chunk', 'G, dq, dKs = None, 2.0 * r / B, [None] * len(Ks)',
     'G, dq, dKs = None, 2.0 * r / len(r), [None] * len(Ks)', 'each chunk divides by its own size, not the whole B'),
    ('fast-pool-no-fork-reset', 'icl_fast.py', '_after_fork_in_child', '    global _POOLS_LOCK\n    _POOLS.clear()\n',
     '    global _POOLS_LOCK\n', "a forked child waits forever on the parent's worker threads (the test times out after 60 s)"),
    ('fast-batch-first-drops-last', 'icl_fast.py', '_bounds', 'return [(c, min(c + size, B)) for c in range(0, B, size)]',
     'return [(c, c + size) for c in range(0, B - B % size, size)]', "the workers' last partial batch-first chunk dropped"),
    ('fast-lanes-loss-first-only', 'icl_fast.py', 'lanes_loss_and_grad_gram', 'return sum(part[0] for part in parts), dP, dQ',
     'return parts[0][0], dP, dQ', 'the lanes loss of the first chunk only'),
    ('fast-batch-first-chunk-labels', 'icl_fast.py', 'batch_first_chunk', 'out + y[start:stop]',
     'out + y[:stop - start]', 'every chunk reads the first labels'),
    ('fast-batch-first-seed-per-chunk', 'icl_fast.py', 'batch_first_chunk', '2.0 * r / batch',
     '2.0 * r / len(r)', "each chunk's reverse pass seeded with its own size, not the batch's"),
    ('fast-batch-first-loss-per-chunk', 'icl_fast.py', 'batch_first_chunk', 'float(r @ r) / batch',
     'float(r @ r) / len(r)', "each chunk's loss divided by its own size, not the batch's"),
    ('fast-batch-first-jac-seed', 'icl_fast.py', 'batch_first_chunk', 'np.ones_like(r) if per_prompt',
     'r if per_prompt', "the Jacobian's reverse pass seeded with the residuals, not 1"),
    ('fast-batch-first-layers-reversed', 'icl_fast.py', 'batch_first_chunk', 'dP.insert(0, dP_l)',
     'dP.append(dP_l)', "the layers' gradients of P stacked last layer first"),
    ('fast-batch-first-readout-first-layer', 'icl_fast.py', 'batch_first_chunk', 'ir.readout_forward(P[-1], Q[-1], S, q, n)',
     'ir.readout_forward(P[0], Q[0], S, q, n)', "the readout with the first layer's parameters"),
    ('fast-batch-first-first-chunk-only', 'icl_fast.py', 'batch_first_loss_and_grad_gram',
     'return tuple(sum(part[i] for part in parts) for i in range(3))', 'return parts[0]',
     "the batch-first loss and gradient of the first chunk only"),
    ('fast-batch-first-small-chunks', 'icl_fast.py', None, 'BATCH_FIRST_CHUNK = 2 ** 17\n', 'BATCH_FIRST_CHUNK = 2 ** 15\n',
     "the batch-first chunks back to a quarter of their size, below the reference's own at large D"),
    ('fast-batch-first-chunks-unbalanced', 'icl_fast.py', '_batch_first_bounds',
     'count = 4 * -(-B // (4 * max(1, BATCH_FIRST_CHUNK // D ** 2)))', 'count = -(-B // max(1, BATCH_FIRST_CHUNK // D ** 2))',
     'a count of chunks that two or four workers cannot share equally'),
    ('fast-reference-chunk-B', 'icl_fast.py', '_mean_of_chunks', 'part[i] * ((b - a) / B)',
     'part[i] / len(parts)', 'each chunk divides by its own size'),
    ('fast-activation-chunk-B', 'icl_fast.py', '_Engine.activation_pass', '_mean_of_chunks([part[:3] for part in parts], bounds, B)',
     '_mean_of_chunks([part[:3] for part in parts], bounds, bounds[0][1])', 'each chunk divides by its own size'),
    ('fast-threads-default', 'icl_fast.py', '_thread_count', '    if threads is None:\n        return cores\n',
     '    if threads is None:\n        return 1\n', 'the default of every core lost'),
    ('fast-blas-restored-early', 'icl_fast.py', '_one_blas_thread', '            if _BLAS["users"] == 0:\n                _restore_blas()',
     '            if True:\n                _restore_blas()', 'the first of several concurrent evaluations to finish restores BLAS under the others'),
    # the periphery: verdicts, the command line and the record, the engine's threads, the trainers' edges
    ('exp-converged-ignores-interrupt', 'experiments.py', 'converged', 'return not res["interrupted"] and res["grad_norm"] <= GRAD_TOL',
     'return res["grad_norm"] <= GRAD_TOL', 'an interrupted run at a small gradient counted as converged'),
    ('exp-converged-strict', 'experiments.py', 'converged', 'res["grad_norm"] <= GRAD_TOL',
     'res["grad_norm"] < GRAD_TOL', 'a run exactly at the gradient tolerance not converged'),
    ('exp-grad-tol-loose', 'experiments.py', None, 'GRAD_TOL = 1e-6\n',
     'GRAD_TOL = 1e-5\n', 'runs ten times short of the documented 1e-6 gradient carry verdicts'),
    ('exp-unconverged-first-run-only', 'experiments.py', 'unconverged', 'bad = [r for r in runs if not converged(r)]',
     'bad = [r for r in runs[:1] if not converged(r)]', 'a claim on two models given a verdict when the second did not converge'),
    ('exp-judge-two-sided-one-side', 'experiments.py', 'judge', 'ok = np.all(np.abs(m - t) <= tol)',
     'ok = np.all(m - t <= tol)', 'a two-sided check that passes any value below the theory'),
    ('exp-judge-two-sided-any', 'experiments.py', 'judge', 'ok = np.all(np.abs(m - t) <= tol)',
     'ok = np.any(np.abs(m - t) <= tol)', 'a vector claim passes when one entry agrees'),
    ('exp-judge-at-least-no-tolerance', 'experiments.py', 'judge', 'ok = np.all(m >= t - tol)',
     'ok = np.all(m >= t)', 'a one-sided lower check without its k SE (a correct claim fails half the time)'),
    ('exp-judge-at-most-no-tolerance', 'experiments.py', 'judge', 'ok = np.all(m <= t + tol)',
     'ok = np.all(m <= t)', 'a one-sided upper check without its tolerance'),
    ('exp-judge-above-wrong-side', 'experiments.py', 'judge', 'ok = np.all(m >= t + tol)',
     'ok = np.all(m >= t - tol)', "'above' passes a difference not resolved by k SE"),
    ('exp-judge-tolerance-no-k', 'experiments.py', 'judge', 'tol = (k * np.asarray(se, dtype=float) if statistical',
     'tol = (np.asarray(se, dtype=float) if statistical', 'the tolerance is one SE, not k SE'),
    ('exp-judge-slack-dropped', 'experiments.py', 'judge', 'else np.zeros(())) + slack',
     'else np.zeros(()))', "an exact claim's slack (rounding room) ignored"),
    ('exp-judge-zero-se-statistical', 'experiments.py', 'judge', 'if not statistical:\n        se, k = None, None',
     'if False:\n        se, k = None, None', 'an exact check labelled "k SE" of a zero SE'),
    ('exp-k-se-two', 'experiments.py', None, 'K_SE = 4.0\n',
     'K_SE = 2.0\n', 'Monte Carlo checks at 2 SE: a correct two-sided claim fails 5% of the time'),
    ('exp-decide-blocked-ignored', 'experiments.py', 'decide', 'why = blocked or unconverged(runs)',
     'why = unconverged(runs)', 'a NO VERDICT reason other than convergence dropped'),
    ('exp-decide-runs-ignored', 'experiments.py', 'decide', 'why = blocked or unconverged(runs)',
     'why = blocked', 'verdicts from runs that did not converge'),
    ('exp-decide-info-before-no-verdict', 'experiments.py', 'decide', 'verdict = NO_VERDICT if why else INFO if ok is None else PASS if ok else FAIL',
     'verdict = INFO if ok is None else NO_VERDICT if why else PASS if ok else FAIL', 'a finding from unconverged runs reported as INFO'),
    ('exp-decide-converged-any', 'experiments.py', 'decide', 'converged=all(converged(r) for r in runs) if runs else None',
     'converged=any(converged(r) for r in runs) if runs else None', 'the converged field says yes when one of the runs did'),
    ('exp-best-of-highest', 'experiments.py', 'best_of', 'return min(done, key=lambda r: r["loss"]) if done else',
     'return max(done, key=lambda r: r["loss"]) if done else', 'the worst converged start read as the best'),
    ('exp-best-of-unconverged-pool', 'experiments.py', 'best_of', 'return min(done, key=lambda r: r["loss"]) if done else',
     'return min(runs, key=lambda r: r["loss"]) if done else', 'an unconverged start with a lower loss chosen over converged ones'),
    ('exp-starts-rtol-loose', 'experiments.py', 'starts_summary', 'reached = [r for r in done if r["loss"] <= lowest * (1 + rtol)]',
     'reached = [r for r in done if r["loss"] <= lowest * (1 + 100 * rtol)]', 'a start at a higher stationary point counted as having reached the lowest'),
    ('exp-starts-unconverged-counted', 'experiments.py', 'starts_summary', 'done = sorted((r for r in runs if converged(r)), key=lambda r: r["loss"])',
     'done = sorted(runs, key=lambda r: r["loss"])', 'unconverged starts counted as reaching the optimum'),
    ('exp-reached-rtol-loose', 'experiments.py', None, 'REACHED_RTOL = 1e-6\n',
     'REACHED_RTOL = 1e-3\n', 'distinct minima (> 1e-4 apart) counted as the same loss'),
    ('exp-not-reached-any-start', 'experiments.py', 'not_reached', 'if said["reached"]:',
     'if said["starts"]:', 'no NO VERDICT when no start reached the reference loss'),
    ('exp-mean-se-ddof', 'experiments.py', 'mean_se', 'np.std(values, ddof=1)',
     'np.std(values)', 'the standard error from the biased standard deviation'),
    ('exp-optimum-checks-wrong-optimum', 'experiments.py', 'optimum_checks', 'ir.sparse_params(np.asarray(a_star)[:, None, None] * Si)',
     'ir.sparse_params(np.asarray(a_star)[:, None, None] * np.eye(Si.shape[0]))', 'the batch side compared with a* I, not a* Sigma^-1'),
    ('exp-optimum-checks-batch-for-test', 'experiments.py', 'optimum_checks', 'judge("at least (one-sided)", mean, f_star, se, runs=[res])',
     'judge("at least (one-sided)", res["loss"], f_star, se, runs=[res])', 'the test-loss side reads the batch loss'),
    ('exp-optimum-checks-runs-dropped', 'experiments.py', 'optimum_checks', 'judge("at least (one-sided)", mean, f_star, se, runs=[res])',
     'judge("at least (one-sided)", mean, f_star, se)', 'the test-loss side judged for an unconverged model'),
    ('exp-blocks-batch-family-self', 'experiments.py', 'blocks_batch_rows', 'judge("two-sided", fitted, batch, se_diff',
     'judge("two-sided", fitted, fitted, se_diff', "the fitted scalars compared with themselves, not the batch family optimum"),
    ('exp-blocks-family-blocked-ignored', 'experiments.py', 'blocks_batch_rows', 'runs=runs, blocked=blocked)',
     'runs=runs)', "an unconverged batch family optimum judged"),
    ('exp-noise-std-as-variance', 'experiments.py', 'noise', 'noise_std=math.sqrt(s2)',
     'noise_std=s2', 'a noise variance given as the standard deviation'),
    ('exp-noise-theory-noiseless', 'experiments.py', 'noise', 'a_theory = n * ir.gd_step_size(n, d, s2)',
     'a_theory = n * ir.gd_step_size(n, d)', 'the theory without the noise variance'),
    ('exp-noise-precondition-swapped', 'experiments.py', 'noise', 'Sigma = ir.rotated_covariance(rng)[0] if precond else np.eye(d)',
     'Sigma = np.eye(d) if precond else ir.rotated_covariance(rng)[0]', "the rows' labels say the other covariance"),
    ('exp-threads-not-in-context', 'experiments_cli.py', 'run', 'progress=args.progress, threads=args.threads)',
     'progress=args.progress)', '--threads parsed but not passed on'),
    ('exp-context-lbfgs-threads', 'experiments.py', 'Context.train_lbfgs', 'fast.train_lbfgs(*args, threads=self.threads, **kwargs)',
     'fast.train_lbfgs(*args, **kwargs)', 'L-BFGS runs on every core whatever --threads says'),
    ('exp-context-sandwich-threads', 'experiments.py', 'Context.sandwich_covariance', 'threads=self.threads, **kwargs)',
     '**kwargs)', 'the sandwich runs on every core whatever --threads says'),
    ('exp-quick-not-in-context', 'experiments_cli.py', 'run', 'seed=args.seed,\n quick=args.quick, log=log',
     'seed=args.seed, quick=False, log=log', '--quick recorded but the experiments run at full size'),
    ('exp-sigterm-handler-not-restored', 'experiments_cli.py', 'run', 'signal.signal(signal.SIGTERM, previous_term)',
     'signal.signal(signal.SIGTERM, signal.SIG_DFL)', "the caller's SIGTERM handler lost after main()"),
    ('exp-sigint-handler-not-restored', 'experiments_cli.py', 'run', 'signal.signal(signal.SIGINT, previous_int)',
     'signal.signal(signal.SIGINT, signal.default_int_handler)', "the caller's SIGINT handler lost after main()"),
    ('exp-rng-by-position', 'experiments_cli.py', 'run', 'np.random.default_rng([args.seed, zlib.crc32(name.encode())])',
     'np.random.default_rng([args.seed, k])', "an experiment's draws depend on its place in the run"),
    ('exp-rng-seed-ignored', 'experiments_cli.py', 'run', 'np.random.default_rng([args.seed, zlib.crc32(name.encode())])',
     'np.random.default_rng([0, zlib.crc32(name.encode())])', '--seed changes nothing'),
    ('exp-output-of-prefix', 'experiments_cli.py', 'output_of', 'stem.startswith(f"{name}_")',
     'stem.startswith(name)', 'an experiment claims files that merely start with its name'),
    ('exp-tied-fit-tolerance-loose', 'experiments_beyond.py', 'tied_trained_rows', 'slack=0.05 * t["a_star"]',
     'slack=0.5 * t["a_star"]', "the L = 1 tied step's 5% tolerance made 50%"),
    ('exp-tied-fit-checked-at-L2', 'experiments_beyond.py', 'tied_trained_rows', 'if L == 1:', 'if L <= 2:',
     'the fitted step checked at L = 2, where the antisymmetric directions are flat'),
    ('exp-tied-sym-dist-bound', 'experiments_beyond.py', 'tied_trained_rows', 't["dist_sym"], 0.05,', 't["dist_sym"], 0.5,',
     "the symmetric part's distance bound made 0.5"),
    ('exp-curvature-closed-form-rtol', 'experiments_beyond.py', 'curvature_rows', 'slack=HESSIAN_RTOL',
     'slack=1e3 * HESSIAN_RTOL', "the closed-form eigenvalues checked against the polynomial's Hessian to 1e-6"),
    ('exp-curvature-L4-sign', 'experiments_beyond.py', 'curvature_rows', '-at_4["mc_antisymmetric"], 0.0',
     'at_4["mc_antisymmetric"], 0.0', "L = 4's negative antisymmetric eigenvalue checked as positive"),
    ('exp-curvature-signs', 'experiments_beyond.py', 'curvature_rows', 'anti[3] > 0 and anti[4] < 0',
     'anti[3] > 0 and anti[4] > 0', "the family point's L = 4 saddle claimed a minimum"),
    ('exp-landscape-grad-bound', 'experiments_beyond.py', 'landscape_rows', 'p["grad_norm"] <= CERTIFIED_GRAD and p["reduced_min"] > 0',
     'p["grad_norm"] <= 1e3 * CERTIFIED_GRAD and p["reduced_min"] > 0', "a certified point's gradient allowed 1e-7"),
    ('exp-landscape-barrier', 'experiments_beyond.py', 'landscape_rows', 'saddle["family_loss"] + 1e-3',
     'saddle["family_loss"] + 1e-2', "the L = 3 barrier's bound made 1e-2"),
    ('exp-trained-L2-dist', 'experiments_beyond.py', 'tied_trained_rows', 't["dist"], 0.05, runs=runs,',
     't["dist"], 0.5, runs=runs,', "L = 2's Dist bound made 0.5"),
    ('exp-character-n20', 'experiments_beyond.py', 'character_rows', '== (L <= 3) for L in Ls)',
     '== (L <= 4) for L in Ls)', "the n = 20 saddle claimed from L = 5"),
    ('exp-flow-end-tolerance', 'experiments_beyond.py', 'flow_rows', 'slack=1e-8', 'slack=1e-6',
     "the flow's end point checked to 1e-6 instead of 1e-8"),
    ('exp-pool-one-layer-tolerance', 'experiments_beyond.py', 'pool_rows', 'slack=0.01 * L1_prior', 'slack=0.1 * L1_prior',
     "the one layer's 1% made 10%"),
    ('exp-pool-small-pools', 'experiments_beyond.py', 'pool_rows', 'small = [r for r in pools if r["K"] <= 16]',
     'small = [r for r in pools if r["K"] <= 1]', "dMMSE's memorisation checked at K = 1 only"),
    ('exp-pool-raventos-threshold', 'experiments_beyond.py', 'pool_rows', 'holds="yes" if ratio <= 1.1 else "no"',
     'holds="yes" if ratio <= 1.2 else "no"', "Raventós et al.'s 'within 10%' read as 20%"),
    ('exp-shift-training-length-a-shift', 'experiments_beyond.py', 'shift_rows',
     'other = [r for r in shifts if r["kind"] == "length" and r["n"] != n_train]',
     'other = [r for r in shifts if r["kind"] == "length"]', 'the training length counted as a length shift'),
    ('exp-shift-wu-threshold', 'experiments_beyond.py', 'shift_rows', '<= 1.1 * at_train["ridge_tuned"]',
     '<= 1.5 * at_train["ridge_tuned"]', "Wu et al.'s 'nearly matches' read as within 50%"),
    ('exp-shift-bayes-one-sided-wrong-way', 'experiments_beyond.py', 'shift_rows', 'judge("at most (one-sided)", [r["bayes_minus_ridge"]',
     'judge("at least (one-sided)", [r["bayes_minus_ridge"]', 'Bayes required to be worse than ridge'),
    ('exp-task-diversity-memorisation-reversed', 'experiments_beyond.py', 'pool_rows',
     '[r["ridge_pool"] - r["dmmse_pool"] for r in small]', '[r["dmmse_pool"] - r["ridge_pool"] for r in small]',
     "dMMSE's advantage on its own pool measured the wrong way round"),
    ('exp-dynamics-gamma-sign', 'experiments_beyond.py', 'dynamics', 'G[r, k] = P[0, 0, d, d] * -Q[0, 0, :d, :d]',
     'G[r, k] = P[0, 0, d, d] * Q[0, 0, :d, :d]', "the descent's effective Gamma read with the wrong sign"),
    ('exp-dynamics-step-on-P-only', 'experiments_beyond.py', 'dynamics', 'P, Q = P - eta * dP, Q - eta * dQ',
     'P, Q = P - 2 * eta * dP, Q - eta * dQ', 'the value row stepped twice as far as the key-query block'),
    ('fast-threads-uncapped', 'icl_fast.py', '_thread_count', 'return min(int(threads), cores)',
     'return int(threads)', 'more threads than cores compete for them'),
    ('fast-threads-zero-accepted', 'icl_fast.py', '_thread_count', 'if threads < 1:',
     'if threads < 0:', 'threads=0 accepted'),
    ('fast-threads-bool-accepted', 'icl_fast.py', '_thread_count', 'if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)):',
     'if not isinstance(threads, (int, np.integer)):', 'threads=True accepted as 1'),
    ('fast-workers-default-rules', 'icl_fast.py', '_map', 'with np.errstate(**rules):',
     'with np.errstate():', "the caller's floating-point rules do not reach the workers"),
    ('fast-failing-chunk-no-stop', 'icl_fast.py', '_map', 'results[i] = fn(*bounds[i])\n                    except BaseException:\n                        stop.set()',
     'results[i] = fn(*bounds[i])\n                    except BaseException:\n                        pass', 'a failing chunk does not stop the other workers'),
    ('fast-blas-count-unlocked', 'icl_fast.py', '_one_blas_thread', '    with _BLAS["lock"]:\n        if _BLAS["users"] == 0:',
     '    if True:\n        if _BLAS["users"] == 0:', 'two calls entering together both save (one saves the 1 the other set)'),
    ('fast-restore-overrides-caller', 'icl_fast.py', '_restore_blas', 'if get() == 1:',
     'if True:', 'a limit the caller set during the call overwritten on return'),
    ('fast-restore-first-library-only', 'icl_fast.py', '_restore_blas', 'zip(_BLAS["libraries"], _BLAS["saved"])',
     'zip(_BLAS["libraries"][:1], _BLAS["saved"])', "scipy's BLAS left at one thread"),
    ('fast-fork-blas-not-restored', 'icl_fast.py', '_after_fork_in_child', '    if _BLAS["users"]:\n        _restore_blas()',
     '    if False:\n        _restore_blas()', 'a child forked during a call keeps BLAS at one thread'),
    ('fast-fork-users-kept', 'icl_fast.py', '_after_fork_in_child', '_BLAS.update(lock=threading.Lock(), users=0)',
     '_BLAS.update(lock=threading.Lock())', 'a child forked during a call never limits BLAS in its own calls'),
    ('fast-fork-lock-kept', 'icl_fast.py', '_after_fork_in_child', '_BLAS.update(lock=threading.Lock(), users=0)',
     '_BLAS.update(users=0)', 'a forked child inherits the lock held across the fork and deadlocks'),
    ('fast-engine-threads-dropped', 'icl_fast.py', '_with_engine.call', 'fast = engine(threads)',
     'fast = engine(None)', 'threads= of the public functions ignored'),
    ('fast-lanes-first-queries', 'icl_fast.py', '_lanes_chunk', 'np.ascontiguousarray(q0[start:stop].T)',
     'np.ascontiguousarray(q0[:stop - start].T)', 'every chunk reads the first queries'),
    ('lbfgs-success-strict', 'icl_ref.py', 'train_lbfgs', 'grad_max <= options["gtol"]',
     'grad_max < options["gtol"]', 'success refused at gtol equality (gtol = 0 with an exactly zero gradient)'),
    ('gn-success-strict', 'icl_ref.py', 'train_gauss_newton', 'success = not outcome["interrupted"] and grad_norm <= options["gtol"]',
     'success = not outcome["interrupted"] and grad_norm < options["gtol"]', 'success refused at gtol equality'),
    ('lbfgs-interrupted-success', 'icl_ref.py', 'train_lbfgs', 'success = not outcome["interrupted"] and grad_max <= options["gtol"]',
     'success = grad_max <= options["gtol"]', 'an interrupted run at a converged point reported a success'),
    ('gn-interrupted-success', 'icl_ref.py', 'train_gauss_newton', 'success = not outcome["interrupted"] and grad_norm <= options["gtol"]',
     'success = grad_norm <= options["gtol"]', 'an interrupted run at a converged point reported a success'),
    ('run-loss-not-mapped-back', 'icl_ref.py', '_Run.result', 'loss=self.c ** 2 * float(loss)',
     'loss=float(loss)', 'the loss reported in the units of Z / c'),
    ('run-history-not-mapped-back', 'icl_ref.py', '_Run.result', 'history=self.c ** 2 * np.array(history)',
     'history=np.array(history)', 'the history in the units of Z / c'),
    ('run-coords-not-mapped-back', 'icl_ref.py', '_Run.coords', 'return _rescaled(coords, self.c ** -2) if user_units else coords',
     'return coords', 'the trained coordinates returned in the units of Z / c'),
    ('run-init-dict-units', 'icl_ref.py', '_start', 'return _rescaled(coords, c ** 2)',
     'return coords', "an init dict read in the units of Z / c instead of the caller's"),
    ('run-progress-loss-unscaled', 'icl_ref.py', '_Run.say', 'loss {self.c ** 2 * loss:.6e}',
     'loss {loss:.6e}', 'progress lines print the loss of Z / c'),
    ('gn-fixed-query-label-assumed', 'icl_ref.py', 'train_gauss_newton', 'query_label_zero=not np.any(run.Z[:, -1, -1])',
     'query_label_zero=True', "Q's last column held fixed though the query labels are not 0"),
    ('fixed-Q-column-every-depth', 'icl_ref.py', '_fixed_coordinates', 'if query_label_zero and shapes["Q"][0] == 1:',
     'if query_label_zero:', "Q_0's last column held fixed with more layers, where it enters"),
    ('hessian-query-label-assumed', 'icl_ref.py', 'identifiable_hessian', 'query_label_zero=not np.any(Z[:, -1, -1])',
     'query_label_zero=True', 'a direction that moves the loss removed from the Hessian'),
    ('hessian-not-symmetrised', 'icl_ref.py', 'identifiable_hessian', 'H = (H + H.T) / 2',
     'H = H', 'the Hessian returned unsymmetrised'),
    ('hessian-engine-dropped', 'icl_ref.py', 'identifiable_hessian', '_gradient_at(structure, coords, _Batch(Z, y, activation, engine))', '_gradient_at(structure, coords, _Batch(Z, y, activation, None))', 'engine= not used by the Hessian'),
    ('sandwich-jacobian-engine-dropped', 'icl_ref.py', 'sandwich_covariance', '_Batch(Z, y, "linear", engine).evaluate(P_c, Q_c, jacobian=True)', '_Batch(Z, y, "linear", None).evaluate(P_c, Q_c, jacobian=True)', 'engine= not passed to the per-prompt Jacobian'),
    ('sandwich-hessian-engine-dropped', 'icl_ref.py', 'sandwich_covariance', 'activation=activation, engine=engine)',
     'activation=activation)', "engine= not passed to the sandwich's Hessian"),
    ('sandwich-h-dropped', 'icl_ref.py', 'sandwich_covariance', 'identifiable_hessian(structure, coords, Z, y, h=h,',
     'identifiable_hessian(structure, coords, Z, y,', "h= not passed to the sandwich's Hessian"),
    ('sandwich-refusal-negative-only', 'icl_ref.py', 'sandwich_covariance', 'if low <= 1e-10 * high:',
     'if low < 0:', 'a flat direction (eigenvalue ~ 0) not refused: the inverse of a singular Hessian returned'),
    ('sandwich-chunks-one', 'icl_ref.py', 'sandwich_covariance', 'chunks = _int("chunks", chunks, 2)',
     'chunks = _int("chunks", chunks, 1)', 'chunks=1 accepted (no covariance of one chunk mean)'),
    ('sandwich-activation-prompts', 'icl_ref.py', 'sandwich_covariance', 'Z.shape[0] < 2 * chunks',
     'Z.shape[0] < chunks', 'chunks of a single prompt accepted for the chunk-mean estimate'),
    ('full-layer-d-limit-off-by-one', 'icl_ref.py', 'full_layer_population_loss', 'if d > MAX_FULL_LAYER_D:',
     'if d >= MAX_FULL_LAYER_D:', 'the documented largest d refused'),
    ('numpy-rules-underflow-kept', 'icl_ref.py', '_numpy_rules.run', 'with np.errstate(**{**rules, "under": "ignore"}):',
     'with np.errstate(**rules):', "a caller's under='raise' reaches the library's arithmetic"),
    ('lbfgs-engine-dropped', 'icl_ref.py', '_Run.__init__', 'self.batch = _Batch(self.Z, self.y, activation, engine)', 'self.batch = _Batch(self.Z, self.y, activation, None)', 'engine= not used by L-BFGS'),
    ('gn-engine-reduced-ls-dropped', 'icl_ref.py', 'train_gauss_newton.evaluate', 'reduce = _reduced_least_squares if engine is None else engine.reduced_least_squares', 'reduce = _reduced_least_squares', 'engine= not used for the reduced least squares'),
    # the readout (MATH.md §2-§3): the last layer's entry and its adjoint
    ('readout-value-column', 'icl_ref.py', 'readout_forward', 'np.einsum("bij,j->bi", S, P_h[-1])',
     'np.einsum("bij,j->bi", S, P_h[:, -1])', "P_h's last column read for its value row"),
    ('readout-no-residual', 'icl_ref.py', 'readout_forward', 'out = q[:, -1] + sum(', 'out = sum(',
     "the residual q_d dropped from the prediction's entry"),
    ('readout-Q-transposed', 'icl_ref.py', 'readout_forward', 'np.einsum("ij,bj->bi", Q_h, q)',
     'np.einsum("ji,bj->bi", Q_h, q)', 'Q_h^T q for Q_h q'),
    ('readout-bwd-residual-dropped', 'icl_ref.py', 'readout_backward', 'dq[:, -1] = dout', 'dq[:, -1] = 0.0',
     "the residual's adjoint dropped"),
    ('readout-bwd-dP-wrong-row', 'icl_ref.py', 'readout_backward', 'dP[:, h, -1] = g', 'dP[:, h, 0] = g',
     "the value row's adjoint written to row 0"),
    ('readout-bwd-dQ-transposed', 'icl_ref.py', 'readout_backward', '(g * Sp_h)[:, :, None] * q[:, None, :]',
     'q[:, :, None] * (g * Sp_h)[:, None, :]', 'dQ_h = q (S p_h)^T / n, transposed'),
    ('readout-bwd-dS-dropped', 'icl_ref.py', 'readout_backward', 'dS += (g * P_h[-1])[:, :, None] * Qq_h[:, None, :]',
     'dS += 0.0', "S's adjoint from the readout dropped (earlier layers' gradients wrong)"),
    ('readout-bwd-dq-Q-untransposed', 'icl_ref.py', 'readout_backward', 'dq += g * (Sp_h @ Q_h)',
     'dq += g * (Q_h @ Sp_h.T).T', "q's adjoint through Q_h instead of Q_h^T"),
    # the checks written once
    ('family-search-tied-size', 'icl_ref.py', '_family_search', 'E, k = np.eye(2 * L - 1 if blocks else L), 1 if tied else L', 'E, k = np.eye(2 * L - 1 if blocks else L), L', 'the tied search starts from one scalar per layer'),
    ('batch-labels-unchecked', 'icl_ref.py', '_batch', 'return Z, _labels(y, Z.shape[0])', 'return Z, np.asarray(y, float)',
     "a training batch's labels taken unchecked"),
    ('data-scale-not-power-of-two', 'icl_ref.py', '_data_scale', 'return 2.0 ** math.floor(',
     'return 1.5 * 2.0 ** math.floor(', 'the data divided by a scale that is not a power of two (inexact)'),
    # the records' tools: what `render --check`, `check` and `refresh` report and return,
    # where staleness looks, which runs docs_figures copies, and the writer of the project's documents
    ('records-check-differences-pass', 'tools/records.py', 'render', 'status = status or 1',
     'status = status or 0', 'render --check finds a differing block and exits 0'),
    ('records-check-writes', 'tools/records.py', 'render', 'for doc in [] if check else [d for d in DOCS if new[d] != texts[d]]:',
     'for doc in [d for d in DOCS if new[d] != texts[d]]:', 'render --check rewrites the documents'),
    ('records-problem-status-1', 'tools/records.py', 'render', '            status = 2\n',
     '            status = max(status, 1)\n', 'a block that cannot be rendered reported as a mere difference'),
    ('records-stale-passes', 'tools/records.py', 'check', 'status = max(status, bool(reasons))',
     'status = max(status, 0)', 'check exits 0 with stale records'),
    ('records-refresh-runs-any-command', 'tools/records.py', 'refresh', 'if named is not None and named != TOOLS[name][1]:',
     'if False:', "refresh runs a record's tool whatever command its provenance names"),
    ('records-refresh-failure-ignored', 'tools/records.py', 'refresh', 'if status != 0:', 'if False:',
     'a failing tool ignored: refresh renders and exits 0'),
    ('records-outputs-from-cwd', 'tools/records.py', 'stale', 'os.path.isfile(os.path.join(ROOT, path))',
     'os.path.isfile(path)', 'staleness looks for the files a record wrote in the current folder'),
    ('records-dirty-ignored', 'tools/records.py', 'stale', 'if p["dirty"] is not False:', 'if False:',
     'a record made from uncommitted code counted current'),
    ('records-diff-every-file', 'tools/records.py', 'changed_since', 'git("diff", "--name-only", commit, "--", *files)',
     'git("diff", "--name-only", commit)', 'a record stale for a change to a file it does not depend on'),
    ('records-commit-unchecked', 'tools/records.py', 'stale', 'COMMIT.fullmatch(str(p["commit"]))', 'True',
     "a record's commit handed to git unchecked (it may be a git option)"),
    ('records-paths-unchecked', 'tools/records.py', 'stale',
     'isinstance(f, str) and PATH.fullmatch(f) for f in v', 'isinstance(f, str) for f in v',
     'a record naming files outside the project (../, /etc/passwd) trusted'),
    ('records-block-twice-accepted', 'tools/records.py', 'render_all', 'if names.count(name) != 1:', 'if False:',
     'a block that appears twice is rendered twice without a word'),
    ('records-no-end-unreported', 'tools/records.py', 'render_all',
     'results += [(doc, name, None, None, f"the block {name} has no end marker") for name in names if name not in ended]',
     'pass', 'a block without an end marker is never checked'),
    ('records-disagreeing-rows-accepted', 'tools/records.py', 'one', 'if len(set(map(repr, values))) != 1:',
     'if not values:', 'the rows a block quotes once may disagree'),
    ('records-template-dunder', 'tools/records.py', 'evaluate', 'or isinstance(n, ast.Attribute) and n.attr.startswith("_")',
     '', 'a template reaches into objects by their dunder attributes'),
    ('records-row-by-position', 'tools/records.py', 'rows', 'if fnmatch.fnmatchcase(r["id"], pattern)', '',
     'a pattern matches every row of its table (a row found by its place, not its id)'),
    ('records-corrupt-table-raises', 'tools/records.py', 'rows', 'except (OSError, ValueError, csv.Error) as e:',
     'except OSError as e:', 'a corrupt table ends the tool with a traceback'),
    ('figures-quick-run-copied', 'tools/docs_figures.py', 'why_not', 'run.get("quick") is not False', 'False',
     'a --quick run copied into docs/'),
    ('figures-dirty-run-copied', 'tools/docs_figures.py', 'why_not', 'run.get("dirty") is not False', 'run.get("dirty") is True',
     'a run whose code is not known to be committed copied'),
    ('figures-changed-code-copied', 'tools/docs_figures.py', 'why_not', 'changed != []', 'False',
     'a run of code changed since copied'),
    ('figures-files-unverified', 'tools/docs_figures.py', 'why_not',
     'icl_files.sha256(data) != run.get("files", {}).get(name)', 'False', "a file edited after the run copied as the run's"),
    ('figures-copies-everything', 'tools/docs_figures.py', 'shown', 'return sorted(f for f in files if f in named)',
     'return sorted(files)', 'files the documents do not show copied into docs/'),
    # the command line's endings (experiments_cli.py): which signal, which exit status
    ('exp-absorbed-sigterm-as-sigint', 'experiments_cli.py', 'Ending.of', 'if isinstance(e, Stopped) or term:',
     'if isinstance(e, Stopped):', 'a SIGTERM a trainer absorbed is reported as a Ctrl-C (exit 130)'),
    ('exp-sigterm-exit-status', 'experiments_cli.py', 'Ending.of', 'return cls("interrupted", EXIT_SIGTERM, "SIGTERM")',
     'return cls("interrupted", EXIT_SIGINT, "SIGTERM")', 'a SIGTERM exits 130 (the exit status of a Ctrl-C)'),
    ('exp-late-signal-ignored', 'experiments_cli.py', 'run', 'if ending is None and late:',
     'if ending is not None and late:', 'a signal during the final writes is dropped: the run exits 0 as if none came'),
    ('exp-held-sigint-not-restored', 'experiments_cli.py', 'signals_held', 'signal.signal(signal.SIGINT, outer[0])',
     'signal.signal(signal.SIGINT, outer[1])', "Ctrl-C after an experiment's record is written reported as SIGTERM"),
    ('exp-held-signal-dropped', 'experiments_cli.py', 'run', 'if held:', 'if held and len(held) > 1:',
     "a signal held while an experiment's files were written is forgotten"),
    ('exp-exit-status-fail', 'experiments_cli.py', 'run', 'EXIT_FAILED if failed_claims(results) else EXIT_OK',
     'EXIT_OK', 'a failed claim exits 0'),
    # which earlier record experiments.py trusts (experiments_cli.trusted_record)
    ('exp-record-format-unchecked', 'experiments_cli.py', 'trusted_record', 'record.get("format") == FORMAT and ',
     '', 'a record without the format marker trusted'),
    ('exp-record-version-unchecked', 'experiments_cli.py', 'trusted_record', 'and record.get("format_version") == FORMAT_VERSION',
     '', 'a record of another format version trusted'),
    ('exp-record-files-trusted', 'experiments_cli.py', 'trusted_record', 'os.path.basename(f) == f and output_of(name, f)',
     'os.path.basename(f) == f', 'a record listing files no experiment writes trusted (they become removable)'),
    ('exp-record-paths-trusted', 'experiments_cli.py', 'trusted_record', 'os.path.basename(f) == f and output_of(name, f)',
     'output_of(name, os.path.basename(f))', 'a record listing paths outside the folder trusted'),
    ('exp-overwrite-forgets-others', 'experiments_cli.py', 'kept_experiments', 'if n not in names and e.get("status") == "complete"',
     'if n in names and e.get("status") == "complete"', '--overwrite of one experiment drops the others from the record (their files become foreign)'),
    ('exp-kept-incomplete', 'experiments_cli.py', 'kept_experiments', 'if n not in names and e.get("status") == "complete"',
     'if n not in names', "an experiment a killed run left half-written is kept as if complete"),
    # the hardened writer (icl_files.Folder): whose files, which refusals, the lock
    ('files-hash-unchecked', 'icl_files.py', 'Folder._survey', 'elif (digest := self._digest(name, st)) in known:',
     'elif (digest := self._digest(name, st)) or known:', "a listed file the user replaced with their own is taken as ours (replaced)"),
    ('files-listed-link-accepted', 'icl_files.py', 'Folder._survey', 'if not stat.S_ISREG(st.st_mode):\n                why[name]',
     'if stat.S_ISDIR(st.st_mode):\n                why[name]', 'a listed file replaced by a FIFO or a symbolic link is opened'),
    ('files-keep-others-ignored', 'icl_files.py', 'Folder._refuse_theirs', 'if why and not keep_others:',
     'if why:', '--keep-others has no effect'),
    ('files-foreign-accepted-without-option', 'icl_files.py', 'Folder._refuse_theirs', 'if why and not keep_others:',
     'if why and keep_others is False:', 'a tool without --keep-others (the vectors writer) writes beside files of the user'),
    ('files-own-name-unrefused', 'icl_files.py', 'Folder._refuse_theirs', 'mine = [n for n in why if n in (self.record, self.temp) or writes(n)]',
     'mine = [n for n in why if n in (self.record, self.temp)]', "a user's file with an output's name is not refused before the run"),
    ('files-create-not-exclusive', 'icl_files.py', 'Folder._create', 'os.O_WRONLY | os.O_CREAT | os.O_EXCL',
     'os.O_WRONLY | os.O_CREAT | os.O_TRUNC', 'a file that appeared meanwhile is overwritten'),
    ('files-lock-shared', 'icl_files.py', 'Folder._flock', 'fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)',
     'fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)', 'two runs write into one folder at once'),
    ('files-survey-once', 'icl_files.py', 'Folder.open', '        self._acquire()\n        self._survey(overwrite, keep_others, writes)',
     '        self._acquire()', 'what another run wrote before this one took the lock is not looked at again'),
    ('files-clear-unchecked', 'icl_files.py', 'Folder._clear', 'if not self._ours(name, st):',
     'if st is None:', "a file that appeared during the run is removed as if it were ours"),
    ('files-replace-follows-link', 'icl_files.py', 'replace_file', 'if _is_link(st):', 'if False:',
     "a document that is a symbolic link replaced by a file (or its folder's link followed)"),
    ('looped-twist-sign', 'icl_looped.py', 'antisymmetric_curvature_parts', '_badd(h_odd, _bmul(h, h), scale=(L, -1))',
     '_badd(h_odd, _bmul(h, h), scale=(L, 1))', "the twist's bracket L h_{2L-1} - h_L^2 with a plus"),
    ('looped-parts-scale', 'icl_looped.py', 'antisymmetric_curvature_parts', 'scale = Fraction(2, d * (d - 1))',
     'scale = Fraction(4, d * (d - 1))', "the parts' normalisation doubled (the pair not summed with its reverse)"),
    ('looped-parts-odd-degree', 'icl_looped.py', 'antisymmetric_curvature_parts', '_complete(2 * L - 1, mu, nu)',
     '_complete(2 * L, mu, nu)', 'h_{2L} in place of h_{2L-1}'),
    ('looped-tilt-antisymmetric', 'icl_looped.py', 'tied_descent_from_family', 'W0 = a * np.eye(d) + eps * G / np.linalg.norm(G)',
     'W0 = a * np.eye(d) + eps * (G - G.T) / np.linalg.norm(G - G.T)', "an antisymmetric tilt, fixed by the rotations e^{tK}"),
    ('looped-tilt-dropped', 'icl_looped.py', 'tied_descent_from_family', 'W0 = a * np.eye(d) + eps * G / np.linalg.norm(G)',
     'W0 = a * np.eye(d)', 'the descent starts at the family point itself'),
    # r5-: slips written from the promises (README, docstrings, MATH.md, docs/RECORDS.md) by an auditor who
    # had not read the tests; test_slips_round5.py holds the tests written for those the rest of the suite let pass
    # r5: tools/records.py's exit statuses, refresh's default, staleness, the rows a block quotes
    ('r5-records-difference-masks-problem', 'tools/records.py', 'render', 'status = status or 1',
     'status = 1', 'render --check: a block that differs after one that cannot be rendered turns exit 2 into 1'),
    ('r5-records-check-stale-masks-problem', 'tools/records.py', 'check', 'return max(status, render(check=True))',
     'return status or render(check=True)', 'check: a stale record hides a block that cannot be rendered (exit 1, not 2)'),
    ('r5-records-refresh-all-by-default', 'tools/records.py', 'refresh', 'names += [name] if stale(name) else []',
     'names += [name]', 'refresh with no names reruns every tool, not only the stale ones'),
    ('r5-records-refresh-skips-unreadable', 'tools/records.py', 'refresh', '            except Problem:\n                names.append(name)',
     '            except Problem:\n                pass', 'refresh with no names leaves a record that cannot be read'),
    ('r5-records-refresh-renders-nothing', 'tools/records.py', 'refresh', 'return render()',
     'return render(check=True)', 'refresh runs the tools but writes no block'),
    ('r5-records-unknown-dirty-current', 'tools/records.py', 'stale', 'if p["dirty"] is not False:',
     'if p["dirty"]:', 'a record whose dirty flag is unknown (null) counted current'),
    ('r5-records-repeated-id-accepted', 'tools/records.py', 'rows', 'if not ids or None in ids or len(set(ids)) != len(ids):',
     'if not ids or None in ids:', 'a table that repeats an id is read (a block quotes whichever row comes first)'),
    ('r5-records-outputs-outside-docs', 'tools/records.py', 'stale', 'f.startswith("docs/") and isinstance(h, str)',
     'isinstance(h, str)', 'a provenance listing outputs outside docs/ accepted'),
    ('r5-records-unknown-name-runs-others', 'tools/records.py', 'refresh', '    if unknown:\n        print(',
     '    if unknown and len(unknown) == len(names):\n        print(', 'refresh NAME with a typo among good names runs the good ones'),
    ('r5-records-one-compares-two', 'tools/records.py', 'one', 'if len(set(map(repr, values))) != 1:',
     'if len(set(map(repr, values[:2]))) != 1:', 'only the first two rows a block quotes once compared'),
    ('r5-records-whitespace-ignored', 'tools/records.py', 'render', 'elif current != rendered and check:',
     'elif current.strip() != rendered.strip() and check:', 'render --check blind to a block whose text differs in its spacing or line breaks'),
    # r5: tools/docs_figures.py: a full run now, which runs it copies, its record
    ('r5-figures-failed-claim-not-copied', 'tools/docs_figures.py', 'main', 'return copy_from(tmp) if status in (0, 1) else status',
     'return copy_from(tmp) if status == 0 else status', 'a full run with a failed claim (status 1) not copied'),
    ('r5-figures-run-status-lost', 'tools/docs_figures.py', 'main', 'return copy_from(tmp) if status in (0, 1) else status',
     'return copy_from(tmp) if status in (0, 1) else 2', "a full run that did not complete exits 2, not the run's own status"),
    ('r5-figures-unknown-dirty-runs', 'tools/docs_figures.py', 'main', 'if icl_files.source_state(experiments.SOURCES, ROOT)["dirty"] is not False:',
     'if icl_files.source_state(experiments.SOURCES, ROOT)["dirty"]:', 'a full run started where the code is not known to be committed (no git)'),
    ('r5-figures-without-figures-copied', 'tools/docs_figures.py', 'why_not', '("without figures", not any(".png" in f for f in files)), ',
     '', 'a run that drew no figures copied (the documents keep figures of another run)'),
    ('r5-figures-tables-by-row-only', 'tools/docs_figures.py', 'shown', "rows?\\('([\\w-]+)/",
     "rows\\('([\\w-]+)/", 'the tables a block reads with row(...) not copied'),
    ('r5-figures-seconds-longest', 'tools/docs_figures.py', 'copy_from', 'math.fsum(t["seconds"] for t in times.values())',
     'max(t["seconds"] for t in times.values())', "the record's run time is the longest experiment's, not the run's"),
    # r5: icl_files: the record of what was written, the lock, source_state, replace_file
    ('r5-files-untracked-not-dirty', 'icl_files.py', 'source_state', 'dirty=bool(git("status", "--porcelain", "--", *files))',
     'dirty=bool(git("diff", "--name-only", "HEAD", "--", *files))', 'a file not yet committed (untracked) counted clean'),
    ('r5-files-old-files-kept', 'icl_files.py', 'write_file_set', '            folder.remove(sorted(set(folder.owned) - set(files)))\n',
     '', "the earlier set's files this set no longer has are left"),
    ('r5-files-refusal-recorded-as-crash', 'icl_files.py', '_record_ending', 'isinstance(error, (WriteFailed, Refused))',
     'isinstance(error, WriteFailed)', 'a file refused mid-run recorded as a crash'),
    ('r5-files-interrupt-recorded-as-crash', 'icl_files.py', '_record_ending', '"interrupted" if isinstance(error, KeyboardInterrupt) else "crashed"',
     '"crashed"', 'a Ctrl-C recorded as a crash'),
    ('r5-files-written-stays-writing', 'icl_files.py', 'Folder.write', 'self.owned[name] = self.writing.pop(name)',
     'self.owned[name] = self.writing[name]', 'a written file stays listed as being written'),
    ('r5-files-other-host-lock-taken', 'icl_files.py', 'Folder._take_over', 'if owner is None or owner["host"] != socket.gethostname() or _running(owner["pid"]) is not False:',
     'if owner is None or _running(owner["pid"]) is not False:', 'a lock of another host (a shared drive) taken over'),
    ('r5-files-unknown-liveness-taken', 'icl_files.py', 'Folder._take_over', 'if owner is None or owner["host"] != socket.gethostname() or _running(owner["pid"]) is not False:',
     'if owner is None or owner["host"] != socket.gethostname() or _running(owner["pid"]) is True:', 'a lock whose holder cannot be asked about taken over'),
    ('r5-files-failed-write-left', 'icl_files.py', 'Folder._create', '            self._remove_made(name, made)\n            if isinstance(e, OSError):',
     '            if isinstance(e, OSError):', 'a file whose write failed is left cut short'),
    ('r5-files-replace-mode-lost', 'icl_files.py', 'replace_file', '        mode = stat.S_IMODE(st.st_mode)\n',
     '', 'a replaced document loses its permissions (an executable script becomes 0644)'),
    ('r5-files-bad-status-accepted', 'icl_files.py', 'Folder.save', 'if status is not None and status not in STATUSES:',
     'if False:', 'a record saved with a status no reader knows'),
    # r5: icl_estimators: the estimators, least squares' risk, monte_carlo_risk's standard error
    ('r5-ridge-penalty-unscaled', 'icl_estimators.py', 'ridge_predict', 'penalty = (lam / c_w / s_x / s_x)[:, None]',
     'penalty = (lam / c_w + 0 * s_x)[:, None]', 'the ridge penalty not rescaled with the data (wrong lam away from unit scale)'),
    ('r5-ridge-metric-transposed', 'icl_estimators.py', 'ridge_predict', 'v @ F.T, x_q',
     'v @ F, x_q', "w = F v taken as F^T v: the prior's metric transposed"),
    ('r5-bayes-prior-dropped', 'icl_estimators.py', 'bayes_predict', 'return ridge_predict(Z, _nonneg("noise_var", noise_var), Sigma_w)',
     'return ridge_predict(Z, _nonneg("noise_var", noise_var))', 'the posterior mean ignores Sigma_w'),
    ('r5-dmmse-temperature', 'icl_estimators.py', 'dmmse_predict', 'log_2var = math.log(2.0) + math.log(noise_var)',
     'log_2var = math.log(noise_var)', "the pool posterior's weights exp(-r/noise_var), not r/(2 noise_var)"),
    ('r5-dmmse-scale-once', 'icl_estimators.py', 'dmmse_predict', '2 * np.log(cb)[:, None]',
     'np.log(cb)[:, None]', "the residuals' scale c put back once, not squared"),
    ('r5-ols-df', 'icl_estimators.py', 'ols_population_risk', 'noise_var * d / (n - d - 1)',
     'noise_var * d / (n - d)', "least squares' noise term with n - d for n - d - 1"),
    ('r5-ols-underdetermined-noise', 'icl_estimators.py', 'ols_population_risk', 'noise_var * n / (d - n - 1)',
     'noise_var * n / (d - n)', "the interpolant's noise term with d - n for d - n - 1"),
    ('r5-mc-se-ddof0', 'icl_estimators.py', 'monte_carlo_risk', 'np.std(errors, ddof=1)',
     'np.std(errors)', 'the Monte Carlo standard error with ddof 0'),
    ('r5-mc-se-chunk', 'icl_estimators.py', 'monte_carlo_risk', 'np.std(errors, ddof=1) / math.sqrt(batch)',
     'np.std(errors, ddof=1) / math.sqrt(min(batch, 4096))', "the standard error divided by the chunk's size, not the batch's"),
    ('r5-shifted-query-law-swapped', 'icl_estimators.py', 'shifted_single_layer_loss', '_single_layer_loss(Gamma, Sigma, moment, S_q, n,',
     '_single_layer_loss(Gamma, S_q, moment, Sigma, n,', "the context's and the query's covariances swapped"),
    ('r5-dmmse-no-shift', 'icl_estimators.py', 'dmmse_predict', '        gap -= np.min(gap, axis=1, keepdims=True)\n',
     '', "the pool's log-weights not shifted by their minimum (every weight underflows at small noise)"),
    ('r5-ols-refusal-range', 'icl_estimators.py', 'ols_population_risk', 'if noise_var > 0 and d - 1 <= n <= d + 1:',
     'if noise_var > 0 and d <= n <= d + 1:', 'n = d - 1 with noise not refused (its risk is infinite)'),
    # r5: icl_looped (slips only): the Monte Carlo standard errors, the flow's bound, the tied optimum
    ('r5-looped-mean-se-ddof0', 'icl_looped.py', '_mean_se', 'np.std(x, ddof=1)',
     'np.std(x)', 'the Monte Carlo standard errors with ddof 0'),
    ('r5-looped-control-var-ddof0', 'icl_looped.py', 'mc_loss', 'np.var(x, ddof=1)',
     'np.var(x)', "the control variate's coefficient cov (ddof 1) / var (ddof 0)"),
    ('r5-looped-grad-se-ddof0', 'icl_looped.py', 'mc_certificate', 'gse = np.sqrt(np.maximum(g_sq / B - gm * gm, 0) * B / (B - 1) / B)',
     'gse = np.sqrt(np.maximum(g_sq / B - gm * gm, 0) / B)', "the gradient's standard errors with ddof 0"),
    ('r5-looped-sigma-bound-d', 'icl_looped.py', 'one_layer_gradient_flow', 'math.sqrt(2 / (math.sqrt(d) * np.linalg.norm(gamma_inv, 2)))',
     'math.sqrt(2 / (d * np.linalg.norm(gamma_inv, 2)))', "Zhang et al.'s initial-scale bound with d for sqrt(d)"),
    ('r5-looped-tied-b-at-L1', 'icl_looped.py', 'optimal_tied_family', 'b = (float(best[1]) if L > 1 else math.nan) if blocks else None',
     'b = float(best[1]) if blocks else None', 'the tied blocks optimum at L = 1 reports a b that never enters'),
    # r5: icl_check: the inputs fn gets, malformed outputs, the command line's exit status
    ('r5-check-inputs-shared', 'icl_check.py', 'check_implementation', 'inputs = {k: np.array(v, dtype=dt) for k, v in',
     'inputs = {k: np.asarray(v, dtype=dt) for k, v in', 'fn receives the cached reference inputs, not copies'),
    ('r5-check-booleans-accepted', 'icl_check.py', '_malformed', 'if a.dtype.kind not in "fiu":',
     'if a.dtype.kind not in "fiub":', 'booleans taken as numbers'),
    ('r5-check-write-error-status', 'icl_check.py', '_main', '        print(f"{v.prog}: error: {e}", file=sys.stderr)\n        return 2',
     '        print(f"{v.prog}: error: {e}", file=sys.stderr)\n        return 1', 'a refused write exits 1, not 2'),
    ('r5-check-all-skipped-passes', 'icl_check.py', 'check_implementation', 'if not any(c["status"] == "passed" for c in report["cases"].values()):',
     'if not report["cases"]:', 'a check where fn skipped every case passes'),
    # r5: icl_ref's options at their corners: tied=, label noise beside Sigma_w, task pools, strict rules
    ('r5-tied-blocks-B-fixed', 'icl_ref.py', '_fixed_coordinates', 'if tied_layers == 1 and structure == "blocks":',
     'if structure == "blocks":', 'tied blocks: the shared B, which reaches the loss through the earlier layers, held fixed'),
    ('r5-tied-grad-first-layer', 'icl_ref.py', '_structure_grad', 'dP, dQ = dP.sum(axis=-4, keepdims=True), dQ.sum(axis=-4, keepdims=True)',
     'dP, dQ = dP[..., :1, :, :, :], dQ[..., :1, :, :, :]', "tied: the first layer's gradient for the sum over layers"),
    ('r5-tied-Q-layers-unchecked', 'icl_ref.py', '_check_structure_of', 'not (np.all(P == P[:1]) and np.all(Q == Q[:1]))',
     'not np.all(P == P[:1])', "tied=True accepts Q's layers differing"),
    ('r5-gamma-noise-unscaled-w', 'icl_ref.py', 'gamma_star', 'noise = noise_var / c / w if noise_var else 0.0',
     'noise = noise_var / c if noise_var else 0.0', 'label noise not divided by the task scale (wrong for Sigma_w != I)'),
    ('r5-loss-noise-unscaled-w', 'icl_ref.py', '_single_layer_loss', 'noise = noise_var / c / w if noise_var else 0.0',
     'noise = noise_var / c if noise_var else 0.0', "the loss's label noise not divided by the task scale"),
    ('r5-sample-query-label-noiseless', 'icl_ref.py', 'sample_prompts', 'y = labels[:, n].copy()',
     'y = np.einsum("bd,bd->b", X[:, n], w_star)', "the query's label drawn without its noise"),
    ('r5-strict-raise-kept', 'icl_ref.py', '_numpy_rules.run', 'rules = {k: "warn" if v in ("raise", "call", "log") else v for k, v in np.geterr().items()}',
     'rules = np.geterr()', "a caller's np.seterr(all='raise') reaches the library's arithmetic"),
    ('r5-strict-call-kept', 'icl_ref.py', '_numpy_rules.run', 'rules = {k: "warn" if v in ("raise", "call", "log") else v for k, v in np.geterr().items()}',
     'rules = {k: "warn" if v == "raise" else v for k, v in np.geterr().items()}', "a caller's np.seterr(all='call') handler called from inside the library"),
    ('r5-pool-last-task-never', 'icl_ref.py', 'sample_prompts', 'pool[rng.integers(pool.shape[0], size=batch)]',
     'pool[rng.integers(max(pool.shape[0] - 1, 1), size=batch)]', "the pool's last task never drawn"),
    ('r5-pool-moment-over-d', 'icl_ref.py', '_task_moment', 'W = (tasks / m).T @ (tasks / m) / tasks.shape[0]',
     'W = (tasks / m).T @ (tasks / m) / tasks.shape[1]', "the pool's second moment divided by d, not by K"),
    # r6-: slips of the fixes against hostile input, each killed by the test written for its defect
    ('r6-template-any-attribute', 'tools/records.py', 'attribute',
     'raise Problem(f"a template may not read {name} of a {type(value).__name__}")', 'return getattr(value, name)',
     "a template reads any attribute (a generator's frame reaches the module's globals: a shell command ran)"),
    ('r6-lock-entry-unchecked', 'icl_files.py', 'Folder._lock_entry',
     'if st is not None and (st.st_nlink != 1 or st.st_size > 0 and self._lock_owner(st) is None):', 'if False:',
     "a user's file under the lock's name truncated to a pid and removed"),
    ('r6-lock-hard-link', 'icl_files.py', 'Folder._lock_entry', '(st.st_nlink != 1 or st.st_size > 0', '(st.st_size > 0',
     "an empty file with another name (a hard link) under the lock's name written through"),
    ('r6-kept-replaced-complete', 'experiments_cli.py', 'kept_experiments', 'if gone else e', 'if False else e',
     "a kept experiment whose file is now the user's recorded complete"),
    ('r6-stdout-error-crash', 'experiments_cli.py', 'Console.say', 'except OSError as e:', 'except ValueError as e:',
     'stdout on a full disk a traceback and exit 1, the record left running'),
    ('r6-status-before-save', 'icl_files.py', 'Folder.save', 'status = self.status if status is None else status',
     'status = self.status = self.status if status is None else status',
     "the run's status changed before its record is written (a message then quotes what the file does not say)"),
    # records that carry their own SHA-256 (icl_files.sealed_json / unseal)
    ('seal-unchecked', 'icl_files.py', 'unseal', "sha256(data.replace(quoted, f'\"{_UNSEALED}\"'.encode())) != seal",
     'False', "a record the user edited vouches for files and is replaced by --overwrite"),
    ('seal-placeholder-kept', 'icl_files.py', 'sealed_json', "return data.replace(placeholder, f'\"{sha256(data)}\"'.encode())",
     'return data', "records written with 64 zeros for their seal: every later --overwrite refuses the run's own folder"),
    ('fitted-scalar-overflow-unchecked', 'icl_ref.py', 'fitted_scalar', 'if not math.isfinite(alpha):', 'if False:',
     'alpha = inf returned as a number (with a RuntimeWarning at most)'),
    ('looped-curvature-overflow-bare', 'icl_looped.py', '_floats', 'except OverflowError:', 'except ArithmeticError as e:\n        raise e\n    except ValueError:',
     "a bare OverflowError from Fraction to float instead of the documented ValueError naming the step"),
    # hostile input, round 7: the folders' records, the refusals' words, docs_figures' reading of a run
    ('h7-record-nesting-crashes', 'icl_files.py', 'unseal', 'except (ValueError, UnicodeDecodeError, RecursionError):',
     'except (ValueError, UnicodeDecodeError):', "a record nested too deep to read a RecursionError traceback (exit 1), not a refusal"),
    ('h7-lock-nesting-crashes', 'icl_files.py', 'Folder._lock_owner', 'except (OSError, ValueError, RecursionError, Refused):',
     'except (OSError, ValueError, Refused):', "a lock file nested too deep to read a RecursionError, not a refusal"),
    ('h7-first-temp-record-unnamed', 'icl_files.py', 'Folder._survey', 'if self.temp in entries:', 'if False:',
     "the hidden temporary record a run killed at its first record left, never named for the user to remove"),
    ('h7-refusal-or-without-choice', 'icl_files.py', 'Folder._refuse_theirs', '"not touching them;"', '"not touching them; or"',
     'a refusal reading "not touching them; or name a new directory"'),
    ('h7-any-name-an-output', 'experiments_cli.py', 'output_of',
     'dot == "." and ext in ("csv", *FIGURE_FORMATS) and (stem == name or stem.startswith(f"{name}_"))',
     'filename in (f"{name}.csv", f"{name}.png", f"{name}.pdf") or filename.startswith(f"{name}_")',
     "--keep-others refuses a note named after an experiment (name_notes.txt), which the run never writes"),
    ('h7-figures-record-shape-unchecked', 'tools/docs_figures.py', 'copy_from', 'if malformed(run):', 'if False:',
     'a config.json with {"files": 5} a TypeError traceback'),
    ('h7-figures-nesting-crashes', 'tools/docs_figures.py', 'copy_from', 'except (OSError, ValueError, RecursionError) as e:',
     'except (OSError, ValueError) as e:', "a config.json nested too deep a RecursionError traceback"),
    ('h7-figures-fifo-opened', 'tools/docs_figures.py', 'regular_bytes', 'if not stat.S_ISREG(st.st_mode):', 'if False:',
     "a FIFO or a link under a file's name opened, not refused as what it is"),
    ('h7-records-fifo-read', 'tools/records.py', 'read', 'if not stat.S_ISREG(st.st_mode) or st.st_size > icl_files.MAX_RECORD_BYTES:',
     'if False:', "a FIFO as docs/benchmarks.json holds check forever; a link to /dev/zero reads until memory runs out"),
    ('h7-records-nesting-crashes', 'tools/records.py', 'load', 'except (OSError, ValueError, RecursionError) as e:',
     'except (OSError, ValueError) as e:', "a record nested too deep a RecursionError traceback, not status 2"),
    ('h7-template-power-evaluated', 'tools/records.py', 'evaluate', 'or isinstance(n, (ast.Pow, ast.LShift))', '',
     "a template {9**9**9} holds render and check for hours"),
    ('h7-template-memory-crashes', 'tools/records.py', 'render_all',
     'except (ArithmeticError, AttributeError, LookupError, MemoryError, TypeError, ValueError) as e:',
     'except (ArithmeticError, AttributeError, LookupError, TypeError, ValueError) as e:',
     "a template too large to hold a MemoryError traceback, not status 2"),
    ('h7-template-dunder-field', 'tools/records.py', 'attribute', 'isinstance(value, (Fields, Rows)) and not name.startswith("_")',
     'isinstance(value, (Fields, Rows)) or name.startswith("_")', "one(x, '__globals__') reads what no template may"),
    ('h7-rewritten-before-refusal', 'tools/records.py', 'render', 'elif current != rendered and check:',
     'elif current != rendered and (check or print(f"{doc} block {name}: rewritten")):',
     'render says "rewritten" of a block it then refuses to write'),
    ('mc-risk-overflow-unchecked', 'icl_estimators.py', 'monte_carlo_risk', 'if not np.all(np.isfinite(error)):', 'if False:',
     'a risk of inf with a standard error of nan returned for a finite predictor'),
]

# (name, file, function, old, new, why it cannot change any result)
EQUIVALENT = [
    ("gamma-star-transposed", "icl_ref.py", 'gamma_star', 'G = np.linalg.solve(K, E_hw) / c', 'G = np.linalg.solve(K, E_hw).T / c',
     "Gamma* = Sigma^-1/2 f(C) Sigma^-1/2 with f(C) a function of the symmetric C is symmetric for every Sigma, "
     "Sigma_w (MATH.md §8; test_theorem1_gamma_star_against_the_whitened_eigen_form checks it)"),
    ("bwd-middle-S-untransposed-G", "icl_ref.py", 'layer_backward', "dT += (dS_next + dS_next.transpose(0, 2, 1)) @ TS",
     "dT += (dS_next.transpose(0, 2, 1) + dS_next) @ TS", "addition commutes: the same numbers to the last bit"),
    ('bwd-dS-untransposed', 'icl_ref.py', 'layer_backward', 'dS += P_h.T @ dT_Qt',
     'dS += dT_Qt.transpose(0, 2, 1) @ P_h', "only the symmetric part of dS reaches a result (MATH.md §3), and a head's term and its transpose have the same symmetric part"),
    ("chunk-size", "icl_ref.py", '_chunks', "size = max(1, 2 ** 18 // D ** 3)\n    return", "size = max(1, 2 ** 17 // D ** 3)\n    return",
     "smaller chunks change only the order of floating-point sums (tested: chunked == unchunked) and "
     "start no BLAS threads either"),
    ("fast-lanes-threshold", "icl_fast.py", None, "LANES_MAX_D = 11\n", "LANES_MAX_D = 9\n",
     "the threshold chooses the formulation, not the result (MATH.md §16 (i): both formulations agree to "
     "rounding, tested); its place is a design constant that docs/benchmarks.md's measurement shows"),
    ("fast-jacobian-threshold", "icl_fast.py", None, "LANES_MAX_D_JACOBIAN = 7\n", "LANES_MAX_D_JACOBIAN = 5\n",
     "as fast-lanes-threshold, for the Jacobian"),
    ("lanes-chunk-size", "icl_fast.py", '_lanes_bounds', "count = 4 * -(-B // (4 * max(1, 2 ** 16 // D ** 2)))",
     "count = 4 * -(-B // (4 * max(1, 2 ** 14 // D ** 2)))",
     "the chunk size changes only the order of floating-point sums (tested against the reference)"),
    ("poly-trim", "icl_ref.py", '_poly_trim', "while len(p) > 1 and p[-1] == 0:", "while False:",
     "exact-zero leading coefficients contribute 0 to every sum (only the degree check notices; kept as a "
     "performance detail, and test_sparse_family_degree_stays_L_and_blocks_L4_is_refused does notice)"),
]


def span(tree, function):
    """(first line, last line) of the function (or class) `function` ("outer.inner") in a syntax tree,
    its decorators included; the whole module for None; None when there is no such function."""
    if function is None:
        return 1, None
    body, node = tree.body, None
    for part in function.split("."):
        node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == part), None)
        if node is None:
            return None
        body = node.body
    return min([node.lineno] + [dec.lineno for dec in node.decorator_list]), node.end_lineno


def pattern(old):
    """A regular expression for the code `old` that allows any layout: its characters (spaces and a
    trailing comment of each line dropped) with any whitespace or comments between them."""
    code = "".join(re.sub(r"\s+#[^'\"]*$", "", line).strip() for line in old.split("\n"))
    code = re.sub(r"\s+", "", code)
    gap = r"(?:\s|#[^\n]*\n)*"
    return gap.join(re.escape(c) for c in code)


def locate(source, function, old):
    """(start, end) of the one occurrence of `old` inside `function` in `source`, or the reason it
    no longer applies."""
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        return f"the file does not parse: {e}"
    where = span(tree, function)
    if where is None:
        return f"no function {function}"
    lines = source.split("\n")
    first = sum(len(line) + 1 for line in lines[:where[0] - 1])
    last = len(source) if where[1] is None else sum(len(line) + 1 for line in lines[:where[1]])
    found = [m.span() for m in re.finditer(pattern(old), source[first:last])]
    if len(found) != 1:
        return f"the text occurs {len(found)} times in {function or 'the module'}"
    return first + found[0][0], first + found[0][1]


def mutated(source, mutant):
    """The source with the mutant applied, or the reason it no longer applies (a str starting with
    "no longer applies")."""
    name, filename, function, old, new, why = mutant
    where = locate(source, function, old)
    if isinstance(where, str):
        return f"no longer applies: {where}"
    # the mutated text replaces the code from its first to its last character: the indentation
    # before it and the line break after it stay the source's
    lead = len(old) - len(old.lstrip())
    new_code = new[lead:] if new[:lead] == old[:lead] else new.lstrip()
    new_code = new_code.rstrip("\n") if old.endswith("\n") else new_code
    return source[:where[0]] + new_code + source[where[1]:]


def snapshot(dest):
    """Copy the project's files (tracked and new, not ignored) once, so edits made while the
    mutants run do not leak into them."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        if os.path.exists(os.path.join(ROOT, f)):
            os.makedirs(os.path.join(dest, os.path.dirname(f)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, f), os.path.join(dest, f))


def read(base, filename):
    with open(os.path.join(base, filename), encoding="utf-8") as f:
        return f.read()


def run_one(mutant, base, python, timeout):
    name, filename = mutant[0], mutant[1]
    with tempfile.TemporaryDirectory(prefix=f"mutant-{name.replace('/', '_')}-") as tmp:
        shutil.copytree(base, tmp, dirs_exist_ok=True)
        path = os.path.join(tmp, filename)
        src = mutated(read(tmp, filename), mutant)
        if src.startswith("no longer applies"):
            return name, "NO LONGER APPLIES:" + src.split(":", 1)[1], 0.0
        with open(path, "w", encoding="utf-8") as f:
            f.write(src)
        start = time.perf_counter()
        # the whole default suite, the mutated module's own test file first (-x stops at the first failure)
        primary = PRIMARY.get(filename, "test_" + filename)
        order = [primary] + [f for f in TEST_FILES if f != primary] if primary in TEST_FILES else []
        try:
            proc = subprocess.run([python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *order],
                                  cwd=tmp, capture_output=True, text=True, timeout=timeout)
            # name the test that failed: a kill is only as good as the test that made it
            # (pytest's summary lines name a test file; captured output may also start with "FAILED")
            failed = [line.split()[1] for line in proc.stdout.splitlines() if re.match(r"(FAILED|ERROR) \S+\.py", line)]
            status = (f"killed by {failed[0] if failed else '(no test named)'}" if proc.returncode != 0
                      else "SURVIVED")
        except subprocess.TimeoutExpired:
            status = "killed (timeout)"
        return name, status, time.perf_counter() - start


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-k", default="", help="run only mutants whose name contains this (comma-separated: any of these)")
    ap.add_argument("--only", default="", help="run only the mutants with these names (comma-separated)")
    ap.add_argument("--jobs", type=int, default=2, help="suites run at once (default 2)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per suite")
    ap.add_argument("--list", action="store_true", help="list the mutants, where each applies, and exit")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if any(k in m[0] for k in args.k.split(","))]
    if args.only:
        names = args.only.split(",")
        unknown = [n for n in names if n not in {m[0] for m in MUTANTS}]
        if unknown:
            ap.error(f"no mutants named {', '.join(unknown)}")
        chosen = [m for m in chosen if m[0] in names]
    if args.list:
        stale = 0
        for mutant in chosen + EQUIVALENT:
            name, filename, function, _, _, why = mutant
            applies = mutated(read(ROOT, filename), mutant)
            gone = applies.startswith("no longer applies")
            stale += gone and mutant in chosen
            tag = "EQUIVALENT: " if mutant in EQUIVALENT else ""
            print(f"{name:34s} {filename}:{function or '<module>'}  {tag}{why}"
                  + (f"  [{applies.upper()}]" if gone else ""))
        print(f"{len(chosen)} mutants, {stale} no longer apply; {len(EQUIVALENT)} equivalent")
        return 1 if stale else 0
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
            print(f"{name:34s} {secs:6.1f} s  {status}", flush=True)
            bad += not status.startswith("killed")
    print(f"killed {len(chosen) - bad} / {len(chosen)}; equivalent mutants excluded: {len(EQUIVALENT)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
