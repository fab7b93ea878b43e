"""icl_looped: looped (weight-tied) models and one layer's gradient flow, beyond the paper (MATH.md §14).

Built on icl_ref's public names (and the few private ones its PRIVATE_API lists). A looped model
applies one layer's coordinates L times: icl_ref's trainers, structure functions and Jacobian take
`tied=True` for it; this module holds what is specific to the looped question.

The scalar family (MATH.md §10 tied):
    optimal_tied_family(L, n, d, blocks=False)     the best looped member of Theorems 3-4's families
    tied_family_step(L, n, d)                      its noiseless sparse step a*_L in exact rationals
The whole tied sparse structure, in whitened coordinates W = Sigma^{1/2} A Sigma^{1/2}, where the
population loss is f(W) = E ||(I - W^T S)^L||_F^2 with S the whitened sample covariance:
    whiten, unwhiten                               A <-> W
    tied_family_hessian_eigenvalues(L, n, d)       the three Hessian eigenvalues at a I, exactly;
    antisymmetric_curvature_parts(L, n, d)         the antisymmetric one's two parts (>= 0 and <= 0)
    family_point_character(Ls, ns, d)              where the family point stops being a minimum
    word_expectation, tied_loss_polynomial         f as an exact polynomial in W (Wishart moments)
    tied_population_loss, tied_loss_and_grad,      f, its gradient and Hessian in float64
    tied_hessian
    rotation_orbit_tangent, orbit_complement,      f(O W O^T) = f(W): the orbit, the Hessian modulo
    reduced_hessian, rotation_normal_form          it, a representative up to rotation
    tied_local_minimum, tied_descent_from_family,  located minima, certified; rotation blocks; the
    tied_minima_from_family,
    block_direction, block_profile,                loss along them and the saddle between two minima
    tied_block_saddle
    sample_whitened_covariances, per_sample_*,     an independent Monte Carlo over S: common random
    mc_loss, subspace_bases,                       numbers, the family point's exact loss as control
    mc_family_hessian_eigenvalues, mc_certificate  variate
One layer under gradient flow (Zhang, Frei and Bartlett):
    one_layer_population_grad(u, U, Sigma, n)      one layer's exact loss and gradient in their (u, U)
    one_layer_gradient_flow(Sigma, n, sigma, t)    the exact gradient flow of that loss from their start

Sections follow MATH.md §14. float64 throughout (the polynomial's coefficients exact rationals); numpy
and scipy only.
"""
import functools
import math
from collections import defaultdict
from fractions import Fraction

import numpy as np
import scipy.integrate
import scipy.linalg
import scipy.optimize

import icl_ref as ir
from icl_ref import _array, _family_search, _flag, _int, _nonneg, _numpy_rules, _single_layer_loss, \
    _single_layer_moments, _spd, _task_moment, _wishart_T

__version__ = ir.__version__


# ---------------------------------------------------------------------------------------------
# §14 The looped family optimum
# ---------------------------------------------------------------------------------------------

@_numpy_rules
def optimal_tied_family(L, n, d, blocks=False, noise_var=0.0, starts=8, rng=None):
    """Best looped member of the families of Theorems 3 and 4: A_l = a Sigma^-1 for every l (and
    B_l = b I with blocks), one (a, b) applied L times, by multi-start L-BFGS-B on the exact
    Gauss rule (as icl_ref.optimal_family_scalars) with the layers' gradient summed (MATH.md §14).
    Noiseless sparse: the loss is strictly convex in a, so its minimiser is unique. Starts
    a ~ U(0, 2), b ~ U(0, 1.5) from rng (default seed 0). Returns (a, b or None, loss): floats,
    b NaN when L = 1 (B_0 never enters), loss = icl_ref.family_population_loss at (a 1_L, b 1_L).
    """
    best, (L, n, d, noise_var) = _family_search(L, n, d, blocks, noise_var, starts, rng, tied=True)
    a = float(best[0])
    b = (float(best[1]) if L > 1 else math.nan) if blocks else None
    loss = ir.family_population_loss(np.full(L, a), n, d, None if b is None else np.full(L, b), noise_var=noise_var)
    return a, b, loss


# The exact polynomial of tied_loss_polynomial: its recursion visits ~2.7e3 states at L = 4 (0.3 s),
# ~1.9e4 at L = 5 (4 s), ~1.2e5 at L = 6 (70 s); beyond that it is refused.
MAX_LOOPS = 6
# Orbit directions [K, W] whose singular value is below ORBIT_RTOL ||W||_F count as zero:
# they vanish exactly for the rotations commuting with W; at the points polished here (|grad| ~ 1e-13)
# the others are >= 1e-2, so any threshold between 1e-10 and 1e-3 gives the same dimension.
ORBIT_RTOL = 1e-8
# tied_local_minimum certifies a point only when its Newton decrement g^T H^-1 g / 2 on the orbit's normal
# space (the second-order estimate of f(W) - f at the nearby critical point) is at most DECREMENT_RTOL f(W):
# relative to the loss it minimises, so neither a huge W (f ~ 1e78, |grad| ~ 1e59) nor a small loss
# (f ~ 1e-2 where the minimum is 1e-31, |grad| ~ 0.1) passes on the Hessian's sign alone.
DECREMENT_RTOL = 1e-6
# tied_local_minimum's Newton steps: each converges quadratically from L-BFGS-B's end, so a handful does
MAX_NEWTON_STEPS = 100
# The complex step of tied_hessian and per_sample_hessian_products: the imaginary part of a
# holomorphic g(W + i h E) is h g'(W)E + O(h^3), with no cancellation, so any tiny h is exact.
COMPLEX_STEP = 1e-30


# ---------------------------------------------------------------------------------------------
# §14 Checks and whitened coordinates
# ---------------------------------------------------------------------------------------------

def _sizes(L, n, d, max_loops=None):
    L, n, d = _int("L", L, 1), _int("n", n, 1), _int("d", d, 1)
    if max_loops is not None and L > max_loops:
        raise ValueError(f"L must be <= {max_loops} for the exact polynomial (its recursion grows ~7x per loop; "
                         f"L = 6 takes about a minute), got {L}")
    return L, n, d


def _square(name, W, d=None, complex_ok=False):
    W = np.asarray(W)
    if not (np.issubdtype(W.dtype, np.floating) or np.issubdtype(W.dtype, np.integer)
            or (complex_ok and np.issubdtype(W.dtype, np.complexfloating))) or W.dtype == bool:
        raise TypeError(f"{name} must be a real array, got dtype {W.dtype}")
    if W.ndim != 2 or W.shape[0] != W.shape[1] or (d is not None and W.shape[0] != d):
        raise ValueError(f"{name} must have shape ({d or 'd'}, {d or 'd'}), got {W.shape}")
    if not np.all(np.isfinite(W)):
        raise ValueError(f"{name} must be finite")
    return W if np.iscomplexobj(W) else W.astype(np.float64)


def _rtol(rtol):
    """rtol as a float in (0, 1], else a TypeError/ValueError naming it (NaN would count nothing as zero)."""
    if isinstance(rtol, bool) or not isinstance(rtol, (int, float, np.integer, np.floating)):
        raise TypeError(f"rtol must be a real number, got {type(rtol).__name__}")
    if not 0 < rtol <= 1:
        raise ValueError(f"rtol must be finite, > 0 and <= 1, got {rtol}")
    return float(rtol)


def _spd_root(Sigma):
    Sigma = _square("Sigma", Sigma)
    lam, V = np.linalg.eigh((Sigma + Sigma.T) / 2)
    if np.max(np.abs(Sigma - Sigma.T)) > 1e-12 * np.max(np.abs(Sigma)):
        raise ValueError("Sigma must be symmetric")
    if lam[0] <= 0:
        _spd("Sigma", Sigma)             # not positive definite: said so by name; else float64 lost it:
        raise ValueError(f"Sigma's condition number is beyond float64: its smallest eigenvalue is lost "
                         f"below eps times its largest ({lam[-1]:.3g}), so Sigma^(-1/2) is not defined at "
                         "float64 precision")
    return (V * np.sqrt(lam)) @ V.T, (V / np.sqrt(lam)) @ V.T


@_numpy_rules
def whiten(A, Sigma):
    """W = Sigma^{1/2} A Sigma^{1/2}: the whitened block of a tied sparse model with block A
    (Q_l = -[[A, 0], [0, 0]]) on x ~ N(0, Sigma), w* ~ N(0, Sigma^-1); the population loss at A is
    f(W) (MATH.md §14). A, Sigma: (d, d), Sigma SPD. Returns W (d, d); the family point a Sigma^-1 maps to a I."""
    root, _ = _spd_root(Sigma)
    A = _square("A", A, root.shape[0])
    return root @ A @ root


@_numpy_rules
def unwhiten(W, Sigma):
    """A = Sigma^{-1/2} W Sigma^{-1/2}, the inverse of whiten (MATH.md §14). Returns A (d, d)."""
    _, inv_root = _spd_root(Sigma)
    W = _square("W", W, inv_root.shape[0])
    return inv_root @ W @ inv_root


# ---------------------------------------------------------------------------------------------
# §14 The three Hessian eigenvalues at the family point a I, from exact Wishart moments
# ---------------------------------------------------------------------------------------------

def _bivariate(terms):
    """A polynomial in (x, y) as {(i, j): Fraction}, zeros dropped."""
    return {k: c for k, c in terms.items() if c}


def _bmul(P, Q):
    out = defaultdict(Fraction)
    for (i, j), c in P.items():
        for (k, m), e in Q.items():
            out[i + k, j + m] += c * e
    return _bivariate(out)


def _badd(*Ps, scale=(1,)):
    out = defaultdict(Fraction)
    for P, s in zip(Ps, scale * len(Ps) if len(scale) == 1 else scale):
        for k, c in P.items():
            out[k] += s * c
    return _bivariate(out)


def _bpow(P, k):
    out = {(0, 0): Fraction(1)}
    for _ in range(k):
        out = _bmul(out, P)
    return out


def _pair_polynomials(L, a):
    """g_-(x, y) and g_+(x, y) of MATH.md §14 for the eigenvalue pair (x, y) of S, mu = 1 - a x, nu = 1 - a y:

        g_pm = (1/2) x^2 h1(mu, nu)^2 pm x y mu^L h2(mu, nu),
        h1(u, v) = sum_{j<L} u^j v^{L-1-j},  h2(u, v) = sum_{i+j+k=L-2} u^{i+k} v^j."""
    x, y = {(1, 0): Fraction(1)}, {(0, 1): Fraction(1)}
    mu, nu = {(0, 0): Fraction(1), (1, 0): -a}, {(0, 0): Fraction(1), (0, 1): -a}
    h1 = _badd(*[_bmul(_bpow(mu, j), _bpow(nu, L - 1 - j)) for j in range(L)])
    h2 = _badd(*[_bmul(_bpow(mu, L - 2 - j), _bpow(nu, j)) for j in range(L - 1) for _ in range(L - 1 - j)])
    square = _bmul(_bmul(x, x), _bmul(h1, h1))
    cross = _bmul(_bmul(x, y), _bmul(_bpow(mu, L), h2))
    return _badd(square, cross, scale=(Fraction(1, 2), -1)), _badd(square, cross, scale=(Fraction(1, 2), 1))


@_numpy_rules
def tied_family_step(L, n, d, tol=Fraction(1, 10 ** 40)):
    """a*_L, the minimiser of the noiseless tied sparse family loss f_L(a) = E tr (I - aS)^{2L}
    = sum_k C(2L, k) (-a)^k m_k (MATH.md §14), to `tol` in exact rationals: f_L is strictly convex, so
    a*_L is the only real root of f_L'(a) = sum_k C(2L, k) (-1)^k k a^{k-1} m_k; Newton's method from
    optimal_tied_family's float, in Fractions (denominators limited to 10^60), stops when an
    interval [lo, hi] of width <= tol has f_L'(lo) < 0 < f_L'(hi). The float optimiser stops at
    |f_L'| <= 1e-12, a ~1e-9 relative error in a that moves eigenvalues of 1e-10 and below.
    Returns a Fraction."""
    L, n, d = _sizes(L, n, d)
    m = ir.wishart_trace_moments(n, d, 2 * L)
    c = [math.comb(2 * L, k) * (-1) ** k * m[k] for k in range(2 * L + 1)]

    def df(a):
        return sum(k * c[k] * a ** (k - 1) for k in range(1, 2 * L + 1))

    def d2f(a):
        return sum(k * (k - 1) * c[k] * a ** (k - 2) for k in range(2, 2 * L + 1))
    a = Fraction(optimal_tied_family(L, n, d, starts=1)[0])
    for _ in range(100):
        a = (a - df(a) / d2f(a)).limit_denominator(10 ** 60)
        lo, hi = a - tol / 2, a + tol / 2
        if df(lo) < 0 < df(hi):
            return a
    raise RuntimeError(f"Newton's method for a*_L did not bracket the root to {tol} (L = {L}, n = {n}, d = {d})")


def _complete(m, u, v):
    """h_m(u, v) = sum_{j<m} u^j v^{m-1-j} = (u^m - v^m) / (u - v) for bivariate polynomials u, v (MATH.md §14)."""
    return _badd(*[_bmul(_bpow(u, j), _bpow(v, m - 1 - j)) for j in range(m)])


def _pair_means(n, d):
    """(off_diagonal, diagonal): P -> E sum_{p != q} P(l_p, l_q) and P -> E sum_p P(l_p, l_p) over the eigenvalues l_p
    of S, exactly, for a bivariate polynomial P ({(i, j): Fraction}): sum_{p != q} l_p^i l_q^j = tr S^i tr S^j - tr S^{i+j},
    and E prod tr S^k = T / n^{sum k} (ir._wishart_T, MATH.md §9; tr S^0 = d)."""
    memo = {}

    def moment(*ks):
        return Fraction(d ** ks.count(0) * _wishart_T(n, d, tuple(sorted(k for k in ks if k)), memo), n ** sum(ks))

    def off_diagonal(P):
        return sum(c * (moment(i, j) - moment(i + j)) for (i, j), c in P.items())

    def diagonal(P):
        return sum(c * moment(i + j) for (i, j), c in P.items())
    return off_diagonal, diagonal


def _family_step_fraction(L, n, d, a):
    """The step a as an exact Fraction (default: the tied optimum a*_L, tied_family_step, to 1e-40)."""
    if a is None:
        return tied_family_step(L, n, d)
    if isinstance(a, bool) or not isinstance(a, (int, float, np.integer, np.floating, Fraction)) or not math.isfinite(a):
        raise TypeError(f"a must be a finite real number, got {a!r}")
    return Fraction(a) if isinstance(a, Fraction) else Fraction(float(a))


def _floats(values, a):
    """Exact values as floats, or a ValueError naming the step when one is beyond float64 (the
    curvatures grow like a^(2L-2))."""
    try:
        return tuple(float(x) for x in values)
    except OverflowError:
        raise ValueError(f"the curvatures at a = {float(a):.3g} overflow float64 (exact=True gives them as "
                         "Fractions)") from None


@_numpy_rules
def tied_family_hessian_eigenvalues(L, n, d, a=None, exact=False):
    """The three eigenvalues of the Hessian of f (the tied sparse population loss in whitened
    coordinates, MATH.md §14) at the family point W = a I, exactly:

        identity          (on span(I))               f_L''(a) / d = 2 L (2L-1) E tr(S^2 (I - aS)^{2L-2}) / d
        symmetric         (symmetric traceless)      2 [E sum_{p != q} g_+ + E sum_p g_+(l_p, l_p) (2 - 2/d)] / (d(d+1)/2 - 1)
        antisymmetric     (antisymmetric matrices)   4 E sum_{p != q} g_-(l_p, l_q) / (d (d - 1))

    over the eigenvalues l_p of S = G G^T / n, with g_pm of MATH.md §14; sum_{p != q} l_p^i l_q^j = tr S^i tr S^j
    - tr S^{i+j}, so each is a rational in the joint moments E tr S^i tr S^j (ir._wishart_T). The
    Hessian is that of f(W) in the Frobenius metric (a second derivative, not half of one); f is
    invariant under W -> O W O^T, so at a I it is one scalar on each of the three subspaces.

    L, n, d >= 1; a: the step (default: the tied optimum a*_L, tied_family_step, to 1e-40), a float
    converted to a Fraction exactly. Returns (identity, symmetric, antisymmetric) as floats (Fractions with exact;
    NaN for a subspace that is empty, d = 1)."""
    L, n, d = _sizes(L, n, d)
    a = _family_step_fraction(L, n, d, a)
    g_minus, g_plus = _pair_polynomials(L, a)
    off_diagonal, diagonal = _pair_means(n, d)
    identity = 4 * diagonal(g_plus) / d    # 2 g_+(l, l) = L (2L-1) l^2 mu^{2L-2}; the Hessian is twice f's eps^2 term
    if d == 1:
        out = (identity, math.nan, math.nan)
    else:
        symmetric = 2 * (off_diagonal(g_plus) + 2 * diagonal(g_plus) * (1 - Fraction(1, d))) / (d * (d + 1) // 2 - 1)
        antisymmetric = 4 * off_diagonal(g_minus) / (d * (d - 1))
        out = (identity, symmetric, antisymmetric)
    return out if _flag("exact", exact) else _floats(out, a)


@_numpy_rules
def antisymmetric_curvature_parts(L, n, d, a=None, exact=False):
    """The antisymmetric Hessian eigenvalue of f at a I as the sum of its two parts (MATH.md §14), exactly:

        stretch =  2 E sum_{p != q} l_p^2 h_L(mu_p, mu_q)^2 / (d (d-1))                      >= 0   (from ||D_1||^2)
        twist   = -2 E sum_{p != q} l_p l_q [L h_{2L-1} - h_L^2](mu_p, mu_q) / (d (d-1))      <= 0   (from 2 tr(D_2 M_0^L))

    with h_m(u, v) = sum_{j<m} u^j v^{m-1-j} and mu = 1 - a l over the eigenvalues l of S. The bracket is >= 0 for
    all real u, v (MATH.md §14: h_m(u, v) = m E X^{m-1} with X uniform between v and u, then Cauchy-Schwarz), so
    twist <= 0 for every L, n, d and a (0 at L = 1, where there is no D_2), and the sign of the eigenvalue is
    that of the competition. stretch + twist is tied_family_hessian_eigenvalues' antisymmetric eigenvalue, there
    computed from another polynomial (g_-: the pair (p, q) not summed with (q, p)).

    L, n >= 1, d >= 2; a: the step as in tied_family_hessian_eigenvalues (default a*_L). Returns (stretch, twist):
    floats, or Fractions with exact."""
    L, n, d = _sizes(L, n, d)
    if d < 2:
        raise ValueError(f"d must be >= 2 for antisymmetric directions to exist, got {d}")
    a = _family_step_fraction(L, n, d, a)
    mu, nu = {(0, 0): Fraction(1), (1, 0): -a}, {(0, 0): Fraction(1), (0, 1): -a}
    h, h_odd = _complete(L, mu, nu), _complete(2 * L - 1, mu, nu)
    off_diagonal, _ = _pair_means(n, d)
    scale = Fraction(2, d * (d - 1))
    stretch = scale * off_diagonal(_bmul({(2, 0): Fraction(1)}, _bmul(h, h)))
    twist = -scale * off_diagonal(_bmul({(1, 1): Fraction(1)}, _badd(h_odd, _bmul(h, h), scale=(L, -1))))
    return (stretch, twist) if _flag("exact", exact) else _floats((stretch, twist), a)


@_numpy_rules
def family_point_character(Ls, ns, d):
    """Where the family point a*_L I stops being a local minimum of f (MATH.md §14's table): for every L in Ls
    and n in ns, the three eigenvalues of tied_family_hessian_eigenvalues at a*_L (tied_family_step; the identity one is
    > 0: f_L is strictly convex in a), and `minimum`: all three > 0 (a strict local minimum modulo
    nothing, since the orbit of a I is a point), False when one is < 0 (a saddle). Returns a list of
    dicts (L, n, d, a, identity, symmetric, antisymmetric, minimum), L-major."""
    rows = []
    for L in Ls:
        for n in ns:
            a = tied_family_step(L, n, d)
            h = tied_family_hessian_eigenvalues(L, n, d, a)
            rows.append(dict(L=L, n=n, d=d, a=float(a), identity=h[0], symmetric=h[1], antisymmetric=h[2],
                             minimum=bool(min(h) > 0)))
    return rows


# ---------------------------------------------------------------------------------------------
# §14 The exact polynomial f(W): Gaussian integration by parts on words
#
# A word is a string over "a" (W), "b" (W^T) and "s" (the unnormalised Wishart matrix G G^T); tr of a
# word is cyclic and tr(w) = tr(w^T), w^T the reversed word with a <-> b, so a word is kept in the
# least of its rotations and those of its transpose. E prod tr(words) is expanded, one "s" at a time,
# by E[G_ab F] = E[dF/dG_ab] (MATH.md §9's recursion with matrix letters): for tr(X s) times others,
#     n tr(X)                                  (the G^T beside the chosen G)
#   + tr(Y Z^T s) + tr(Y s) tr(Z)              (each s in X = Y s Z)
#   + tr(X V s) + tr(X V^T s)                  (each s in another factor tr(V s), which it absorbs)
# ---------------------------------------------------------------------------------------------

_SWAP = str.maketrans("ab", "ba")


def _transpose(w):
    return w[::-1].translate(_SWAP)


def _canonical(w):
    return min(v[i:] + v[:i] for v in (w, _transpose(w)) for i in range(len(v))) if w else w


def _split(words, d):
    """(factor d^#empty, sorted s-free words, sorted words with an s): the constants, the monomial and
    the state still to be integrated."""
    factor, free, state = 1, [], []
    for w in words:
        if not w:
            factor *= d
        else:
            (state if "s" in w else free).append(_canonical(w))
    return factor, tuple(sorted(free)), tuple(sorted(state))


def _expectation(state, n, d, memo):
    """E prod_{w in state} tr(w) with s = G G^T, G (d, n): {monomial (sorted s-free words): integer}."""
    if not state:
        return {(): 1}
    if state in memo:
        return memo[state]
    first, rest = state[0], list(state[1:])
    i = first.index("s")
    X = first[i + 1:] + first[:i]                        # tr(first) = tr(X s)
    terms = [(n, [X] + rest)]
    for p, letter in enumerate(X):
        if letter == "s":
            Y, Z = X[:p], X[p + 1:]
            terms += [(1, [Y + _transpose(Z) + "s"] + rest), (1, [Y + "s", Z] + rest)]
    for r, V0 in enumerate(rest):
        others = rest[:r] + rest[r + 1:]
        for p, letter in enumerate(V0):
            if letter == "s":
                V = V0[p + 1:] + V0[:p]                  # tr(V0) = tr(V s)
                terms += [(1, [X + V + "s"] + others), (1, [X + _transpose(V) + "s"] + others)]
    out = defaultdict(int)
    for coefficient, words in terms:
        factor, free, sub = _split(words, d)
        for monomial, value in _expectation(sub, n, d, memo).items():
            out[tuple(sorted(free + monomial))] += coefficient * factor * value
    memo[state] = {k: v for k, v in out.items() if v}
    return memo[state]


# The largest words word_expectation takes: its recursion's cost grows combinatorially in the letters
# "s" (pairings) and in the letters in all (distinct s-free words), from ~0.5 s for tied_loss_polynomial's
# words at L = 4 (8 letters s) to ~5 s for the slowest mixes of 24 letters measured.
MAX_WORD_S = 8
MAX_WORD_LETTERS = 24


@_numpy_rules
def word_expectation(words, n, d):
    """E prod_j tr(w_j) for words over "a" (a fixed matrix W), "b" (W^T) and "s" (S = G G^T / n,
    G (d, n) iid N(0, 1)), exactly (MATH.md §14): {monomial: Fraction}, a monomial a sorted tuple of s-free
    words (canonical: least rotation of the word or its transpose) standing for the product of their
    traces (the empty monomial: 1). For example E tr(W S W S) = tr(W W) + (tr(W W^T) + tr(W)^2) / n:
    word_expectation(["asas"], n, d) == {("aa",): 1, ("ab",): 1/n, ("a", "a"): 1/n} (Isserlis, MATH.md §8).
    words: strings over "abs" (a list, or any iterable, read once), at most MAX_WORD_S letters "s" and
    MAX_WORD_LETTERS letters in all."""
    n, d = _int("n", n, 1), _int("d", d, 1)
    message = "words must be a list of strings over 'a' (W), 'b' (W^T) and 's' (S)"
    if isinstance(words, str):
        raise ValueError(message)
    try:
        words = list(words)
    except TypeError:
        raise TypeError(f"{message}, got {type(words).__name__}") from None
    if not all(isinstance(w, str) and set(w) <= set("abs") for w in words):
        raise ValueError(message)
    k, letters = sum(w.count("s") for w in words), sum(map(len, words))
    if k > MAX_WORD_S or letters > MAX_WORD_LETTERS:
        raise ValueError(f"words must hold at most {MAX_WORD_S} letters 's' and {MAX_WORD_LETTERS} letters in all "
                         f"(MAX_WORD_S, MAX_WORD_LETTERS), got {k} and {letters}")
    factor, free, state = _split(words, d)
    return {tuple(sorted(free + m)): Fraction(factor * v, n ** k)
            for m, v in _expectation(state, n, d, {}).items()}


@functools.lru_cache(maxsize=16)
def _loss_polynomial(L, n, d):
    memo, total = {}, defaultdict(Fraction)
    for j in range(L + 1):                # (I - W^T S)^L (I - S W)^L: j factors W^T S left, m factors S W right
        for m in range(L + 1):
            c = Fraction(math.comb(L, j) * math.comb(L, m) * (-1) ** (j + m), n ** (j + m))
            factor, free, state = _split(["bs" * j + "sa" * m], d)
            for monomial, value in _expectation(state, n, d, memo).items():
                total[tuple(sorted(free + monomial))] += c * factor * value
    return tuple(sorted((k, v) for k, v in total.items() if v))


@_numpy_rules
def tied_loss_polynomial(L, n, d):
    """f(W) = E ||(I - W^T S)^L||_F^2 (MATH.md §14) as an exact polynomial: {monomial: Fraction}, a monomial a
    sorted tuple of words over "a" (W) and "b" (W^T), standing for the product of their traces (the
    empty monomial: the constant). Expands (I - W^T S)^L (I - S W)^L binomially and takes each
    E tr((W^T S)^j (S W)^m) by word_expectation's recursion. L <= MAX_LOOPS (L = 4: 264 monomials in
    52 words). At W = a I it is MATH.md §10's tied sparse family loss (ir.family_population_loss)."""
    L, n, d = _sizes(L, n, d, MAX_LOOPS)
    return dict(_loss_polynomial(L, n, d))


class _Evaluator:
    """tied_loss_polynomial in float64: the traces of its words, their gradients, and the monomials."""

    def __init__(self, L, n, d):
        poly = _loss_polynomial(L, n, d)
        self.d = d
        self.words = sorted({w for monomial, _ in poly for w in monomial}, key=lambda w: (len(w), w))
        index = {w: i for i, w in enumerate(self.words)}
        self.monomials = [(float(c), [index[w] for w in monomial]) for monomial, c in poly]
        # log of |c| d^k and the total length of the words of each monomial: its magnitude at most
        # |c| d^k s^length for s the largest singular value of W (|tr w| <= d s^len(w))
        self.log_size = np.array([math.log(abs(c)) + len(monomial) * math.log(d) for monomial, c in poly])
        self.length = np.array([sum(map(len, monomial)) for monomial, _ in poly])

    def traces(self, W, grad=False):
        """tr of each word at W and, with grad, d tr(w)/dW: sum over the letters of w of (suffix
        prefix)^T for an "a" (tr(P W Q) = tr(W Q P)) and suffix prefix for a "b"."""
        eye = np.eye(self.d, dtype=W.dtype)
        traces, grads = [], []
        for w in self.words:
            prefix = [eye]
            for letter in w:
                prefix.append(prefix[-1] @ (W if letter == "a" else W.T))
            traces.append(np.trace(prefix[-1]))
            if grad:
                suffix = [eye]
                for letter in reversed(w):
                    suffix.append((W if letter == "a" else W.T) @ suffix[-1])
                suffix.reverse()
                g = np.zeros_like(eye)
                for p, letter in enumerate(w):
                    QP = suffix[p + 1] @ prefix[p]
                    g = g + (QP.T if letter == "a" else QP)
                grads.append(g)
        return traces, grads

    def loss(self, W):
        traces, _ = self.traces(W)
        return sum(c * math.prod(traces[i] for i in ids) for c, ids in self.monomials)

    def log_magnitude(self, W):
        """log of the sum of the monomials' magnitude bounds at W: float64's rounding of the loss is
        about eps times it (measured: 2 to 20 times above the error at L <= 4, n <= 1e6)."""
        with np.errstate(divide="ignore"):                   # W = 0: log 0 = -inf, its words vanish
            log_s = math.log(np.linalg.norm(W, 2)) if np.any(W) else -math.inf
        log_words = np.where(self.length > 0, np.maximum(self.length, 1) * log_s, 0.0)    # s^0 = 1
        return float(np.logaddexp.reduce(self.log_size + log_words))

    def loss_and_grad(self, W):
        traces, grads = self.traces(W, grad=True)
        f, dtrace = 0.0, [0.0] * len(self.words)
        for c, ids in self.monomials:
            values = [traces[i] for i in ids]
            f = f + c * math.prod(values)
            for k, i in enumerate(ids):
                dtrace[i] = dtrace[i] + c * math.prod(values[:k] + values[k + 1:])
        return f, sum(t * g for t, g in zip(dtrace, grads))


@functools.lru_cache(maxsize=16)
def _evaluator(L, n, d):
    return _Evaluator(L, n, d)


@_numpy_rules
def tied_population_loss(W, L, n, d, exact=False):
    """f(W) = E ||(I - W^T S)^L||_F^2, the tied sparse model's noiseless population loss at its
    whitened block W (whiten; MATH.md §14), from tied_loss_polynomial. W: (d, d), any real matrix. Returns a
    float right to 1e-6 relative: its terms cancel (to ~n^-L near the minimum at large n), and where
    float64's rounding, about eps times the sum of the terms' magnitudes, could exceed 1e-6 of f the
    float is a ValueError pointing to exact (an overflow, |W| ~ 1e77 at L = 2, is a ValueError naming
    max |W|); exact: the exact rational at W's float64 entries (each converted exactly), a Fraction
    (slow: seconds at L = 4)."""
    L, n, d = _sizes(L, n, d, MAX_LOOPS)
    W = _square("W", W, d)
    if not _flag("exact", exact):
        ev = _evaluator(L, n, d)
        with np.errstate(over="ignore", invalid="ignore"):
            f = float(ev.loss(W))
        if not math.isfinite(f):
            raise ValueError(f"f is not finite: float64 overflowed at max |W| = {np.max(np.abs(W)):.3g} (f grows like "
                             f"||W||^{2 * L}); use exact=True or a smaller W")
        if f <= 0 or math.log(np.finfo(np.float64).eps / 1e-6) + ev.log_magnitude(W) > math.log(f):
            raise ValueError(f"float64 does not resolve f to 1e-6 relative here (n = {n}, L = {L}): its terms, of "
                             f"magnitude up to e^{ev.log_magnitude(W):.1f}, cancel to f = {f:.3g}; use exact=True")
        return f
    Wf = [[Fraction(float(x)) for x in r] for r in W]
    WT = [list(r) for r in zip(*Wf)]
    cache = {}

    def trace(word):
        if word not in cache:
            M = [[Fraction(int(i == j)) for j in range(d)] for i in range(d)]
            for letter in word:
                F = Wf if letter == "a" else WT
                M = [[sum(M[i][k] * F[k][j] for k in range(d)) for j in range(d)] for i in range(d)]
            cache[word] = sum(M[i][i] for i in range(d))
        return cache[word]
    return sum(c * math.prod((trace(w) for w in monomial), start=Fraction(1))
               for monomial, c in _loss_polynomial(L, n, d))


@_numpy_rules
def tied_loss_and_grad(W, L, n, d):
    """(f(W), grad f(W)) in float64 from tied_loss_polynomial (MATH.md §14): the gradient of each word's trace
    is a sum over its letters of products of the rest. W: (d, d). Returns (float, (d, d))."""
    L, n, d = _sizes(L, n, d, MAX_LOOPS)
    with np.errstate(over="ignore", invalid="ignore"):          # an overflow is named below
        f, g = _evaluator(L, n, d).loss_and_grad(_square("W", W, d))
    if not (np.isfinite(f) and np.all(np.isfinite(g))):
        raise ValueError(f"f or its gradient is not finite: float64 overflowed at max |W| {np.max(np.abs(W)):.3g}; "
                         "use tied_population_loss(..., exact=True) or a smaller W")
    return float(f), np.asarray(g, dtype=np.float64)


@_numpy_rules
def tied_hessian(W, L, n, d):
    """The Hessian of f at W (MATH.md §14), (d^2, d^2) on vec(W) in row-major (numpy ravel) order: column k is
    the derivative of the gradient along the k-th unit matrix, by the complex step
    Im grad(W + i h E_k) / h (h = COMPLEX_STEP; exact to rounding: the gradient is a polynomial),
    symmetrised. Returns an array (d^2, d^2)."""
    L, n, d = _sizes(L, n, d, MAX_LOOPS)
    W = _square("W", W, d)
    ev = _evaluator(L, n, d)
    H = np.empty((d * d, d * d))
    for k in range(d * d):
        E = np.zeros(d * d, dtype=complex)
        E[k] = 1j * COMPLEX_STEP
        with np.errstate(over="ignore", invalid="ignore"):      # an overflow is named below
            H[:, k] = ev.loss_and_grad(W + E.reshape(d, d))[1].imag.ravel() / COMPLEX_STEP
    if not np.all(np.isfinite(H)):
        raise ValueError(f"the Hessian is not finite: float64 overflowed at max |W| {np.max(np.abs(W)):.3g}")
    return (H + H.T) / 2


# ---------------------------------------------------------------------------------------------
# §14 The rotation orbit, the reduced Hessian, a representative up to rotation
# ---------------------------------------------------------------------------------------------

@_numpy_rules
def rotation_orbit_tangent(W, rtol=ORBIT_RTOL):
    """An orthonormal basis (d^2, r) of the tangent space at W of its orbit {O W O^T}: the span of
    vec([K, W]) over antisymmetric K (MATH.md §14). r = d(d-1)/2 minus the dimension of the rotations that
    commute with W (r = 0 at a I; r = 6 for d = 5 and a normal W with one or two equal rotation blocks).
    Singular values below rtol ||W||_F count as zero (a point a I + 1e-13 noise, where a descent to the
    family point ends, has orbit dimension 0)."""
    W, rtol = _square("W", W), _rtol(rtol)
    d = W.shape[0]
    cols = []
    for i in range(d):
        for j in range(i + 1, d):
            K = np.zeros((d, d))
            K[i, j], K[j, i] = 1.0, -1.0
            cols.append((K @ W - W @ K).ravel())
    if not cols:
        return np.zeros((d * d, 0))
    U, sv, _ = np.linalg.svd(np.array(cols).T, full_matrices=False)
    return U[:, sv > rtol * np.linalg.norm(W)]        # relative to W, not to the largest [K, W]: near a I all are small


@_numpy_rules
def orbit_complement(W, rtol=ORBIT_RTOL):
    """An orthonormal basis (d^2, d^2 - r) of the complement of rotation_orbit_tangent(W) (MATH.md §14)."""
    T = rotation_orbit_tangent(W, rtol)
    d2 = T.shape[0]
    P = np.eye(d2) - T @ T.T
    lam, V = np.linalg.eigh(P)
    return V[:, lam > 0.5]


@_numpy_rules
def reduced_hessian(W, L, n, d, rtol=ORBIT_RTOL):
    """The Hessian of f at W restricted to the complement of the rotation orbit's tangent (MATH.md §14). At a
    critical point the orbit directions are exact zeros of the full Hessian, so W is a strict local
    minimum modulo rotations when these eigenvalues are all > 0. Returns (eigenvalues ascending,
    eigenvectors (d^2, d^2 - r) in vec(W) coordinates, r the orbit's dimension)."""
    C = orbit_complement(W, rtol)
    H = tied_hessian(W, L, n, d)
    lam, V = np.linalg.eigh(C.T @ H @ C)
    return lam, C @ V, d * d - C.shape[1]


@_numpy_rules
def rotation_normal_form(W, rtol=1e-8):
    """W up to rotation (MATH.md §14): (T, O, normal) with W = O T O^T, O orthogonal. For a normal W
    (||W W^T - W^T W|| <= rtol ||W||^2), T is block diagonal: its real eigenvalues ascending, then one
    2 x 2 block [[alpha, beta], [-beta, alpha]] (beta > 0) per pair alpha +- i beta, by (alpha, beta);
    otherwise T is scipy's real Schur form. Returns T (d, d), O (d, d), normal (bool)."""
    W, rtol = _square("W", W), _rtol(rtol)
    T, O = scipy.linalg.schur(W, output="real")
    d = W.shape[0]
    normal = bool(np.linalg.norm(W @ W.T - W.T @ W) <= rtol * max(np.linalg.norm(W) ** 2, 1e-300))
    if not normal:
        return T, O, False
    blocks, i = [], 0
    while i < d:
        if i + 1 < d and abs(T[i + 1, i]) > rtol * max(1.0, np.linalg.norm(T)):
            blocks.append((i, 2))
            i += 2
        else:
            blocks.append((i, 1))
            i += 1
    keyed = []
    for i, size in blocks:
        cols = O[:, i:i + size].copy()
        if size == 1:
            keyed.append(((0, T[i, i], 0.0), cols, np.array([[T[i, i]]])))
        else:
            B = T[i:i + 2, i:i + 2]
            alpha, beta = (B[0, 0] + B[1, 1]) / 2, (B[0, 1] - B[1, 0]) / 2
            if beta < 0:                              # a reflection of the pair flips the block's sign
                cols[:, 1], beta = -cols[:, 1], -beta
            keyed.append(((1, alpha, beta), cols, np.array([[alpha, beta], [-beta, alpha]])))
    keyed.sort(key=lambda k: k[0])
    O = np.concatenate([k[1] for k in keyed], axis=1)
    T = scipy.linalg.block_diag(*[k[2] for k in keyed])
    return T, O, True


# ---------------------------------------------------------------------------------------------
# §14 Located and certified minima, and the saddle between two of them
# ---------------------------------------------------------------------------------------------

@_numpy_rules
def tied_local_minimum(W0, L, n, d, newton_steps=4):
    """The local minimum of f whose basin holds W0, located and certified (MATH.md §14): SciPy's L-BFGS-B on
    tied_loss_and_grad (ftol 1e-16, gtol 1e-13), then `newton_steps` Newton steps with the exact
    Hessian restricted to the complement of the rotation orbit (the orbit directions are exact zeros
    of the Hessian at a critical point and would make it singular). The certificate, exact up to
    float64 rounding: the gradient's norm (rounding ~1e-13) and the reduced Hessian's eigenvalues
    (all > 0: a strict local minimum modulo rotations, within |grad| / min eigenvalue of W). A point is
    certified (is_minimum) only when, besides, it is critical relative to the loss: f(W) > 0 and the
    Newton decrement g_N^T H_N^-1 g_N / 2 (g_N, H_N the gradient and Hessian on the orbit's normal space;
    the second-order estimate of f(W) minus f at the nearby critical point) is <= DECREMENT_RTOL f(W)
    (1e-6). Where float64 cannot resolve f that finely (f ~ 1e-16 of its terms, as at n >~ 1e9) no point is
    certified.

    W0: (d, d), finite; newton_steps: an int in [0, MAX_NEWTON_STEPS]. A loss, gradient or Hessian
    that overflows float64 (||W|| ~ 1e38 at L = 2) raises a ValueError naming ||W||. Returns a dict: W
    (the end point), loss, grad_norm, newton_decrement, orbit_dim, reduced_eigenvalues,
    T (W up to rotation, rotation_normal_form), O, normal, eigenvalues_W (of W, complex, sorted),
    antisymmetric_singular_values (of (W - W^T)/2), family_loss (f at a*_L I), relative_to_family
    (loss / family_loss - 1), is_minimum (all reduced eigenvalues > 0 and the decrement test)."""
    L, n, d = _sizes(L, n, d, MAX_LOOPS)
    W = _square("W0", W0, d)
    newton_steps = _int("newton_steps", newton_steps, 0)
    if newton_steps > MAX_NEWTON_STEPS:
        raise ValueError(f"newton_steps must be <= {MAX_NEWTON_STEPS}, got {newton_steps}")
    ev = _evaluator(L, n, d)

    def fun(x):
        with np.errstate(over="ignore", invalid="ignore"):
            f, g = ev.loss_and_grad(x.reshape(d, d))
        f, g = float(f), np.asarray(g, dtype=np.float64).ravel()
        if not (math.isfinite(f) and np.all(np.isfinite(g))):
            raise ValueError(f"f or its gradient is not finite: float64 overflowed at ||W||_F = "
                             f"{np.linalg.norm(x):.3g} (f grows like ||W||^{2 * L}); start nearer the family point")
        return f, g
    res = scipy.optimize.minimize(fun, W.ravel(), jac=True, method="L-BFGS-B",
                                  options=dict(ftol=1e-16, gtol=1e-13, maxiter=20000, maxcor=30))
    W = res.x.reshape(d, d)
    for _ in range(newton_steps):
        C = orbit_complement(W)
        g = fun(W.ravel())[1]
        if C.shape[1] == 0:
            break
        H = tied_hessian(W, L, n, d)
        step = C @ np.linalg.solve(C.T @ H @ C, C.T @ g)
        W = W - step.reshape(d, d)
    f, g = fun(W.ravel())
    with np.errstate(over="ignore", invalid="ignore"):
        H = tied_hessian(W, L, n, d)
    if not np.all(np.isfinite(H)):
        raise ValueError(f"the Hessian is not finite: float64 overflowed at ||W||_F = {np.linalg.norm(W):.3g}")
    C = orbit_complement(W)
    lam, V = np.linalg.eigh(C.T @ H @ C)
    r = d * d - C.shape[1]
    q = (C @ V).T @ g
    decrement = float(np.sum(q ** 2 / lam) / 2) if lam.size == 0 or lam[0] > 0 else math.inf
    T, O, normal = rotation_normal_form(W)
    a, _, f_family = optimal_tied_family(L, n, d)
    return dict(W=W, loss=f, grad_norm=float(np.linalg.norm(g)), newton_decrement=decrement, orbit_dim=r,
                reduced_eigenvalues=lam,
                T=T, O=O, normal=normal, eigenvalues_W=np.sort_complex(np.linalg.eigvals(W)),
                antisymmetric_singular_values=np.linalg.svd((W - W.T) / 2, compute_uv=False),
                family_a=a, family_loss=f_family, relative_to_family=f / f_family - 1,
                is_minimum=bool((lam.size == 0 or lam[0] > 0) and f > 0 and decrement <= DECREMENT_RTOL * f))


@_numpy_rules
def tied_descent_from_family(L, n, d, rng, eps=0.05):
    """Descend f from the family point tilted in a random direction (MATH.md §14): W0 = a*_L I + eps G / ||G||_F, G a
    (d, d) standard normal matrix from rng, then tied_local_minimum(W0). A generic G commutes with no rotation but
    the identity, so W0 lies on no fixed-point set of a rotation subgroup (on which the equivariant gradient would
    hold the descent; tied_minima_from_family's block starts lie on such sets). Where a*_L I is a strict local
    minimum (antisymmetric eigenvalue > 0) a small tilt returns to it (orbit_dim 0); where it is a saddle the
    descent leaves it along the antisymmetric directions. rng: a numpy Generator; eps > 0: the tilt's Frobenius
    norm. Returns tied_local_minimum's dict with `start` (W0)."""
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    L, n, d = _sizes(L, n, d, MAX_LOOPS)
    eps = _nonneg("eps", eps)
    if eps == 0:
        raise ValueError("eps must be > 0 (at the family point itself the gradient is 0 and nothing moves)")
    G = rng.standard_normal((d, d))
    a = optimal_tied_family(L, n, d, starts=1)[0]      # one start: f_L is strictly convex in a (MATH.md §14)
    W0 = a * np.eye(d) + eps * G / np.linalg.norm(G)
    return dict(tied_local_minimum(W0, L, n, d), start=W0)


@_numpy_rules
def block_direction(d, blocks):
    """J_k: the antisymmetric (d, d) matrix with `blocks` rotation blocks [[0, 1], [-1, 0]] on the
    coordinate pairs (0, 1), (2, 3), ... (MATH.md §14); blocks <= d // 2."""
    d, blocks = _int("d", d, 1), _int("blocks", blocks, 0)
    if 2 * blocks > d:
        raise ValueError(f"blocks must be <= d // 2 = {d // 2}, got {blocks}")
    J = np.zeros((d, d))
    for k in range(blocks):
        J[2 * k, 2 * k + 1], J[2 * k + 1, 2 * k] = 1.0, -1.0
    return J


@_numpy_rules
def tied_minima_from_family(L, n, d, betas=(0.35,), rtol=1e-6):
    """The local minima of f reached from the family point a*_L I and from a*_L I + beta J_k for every
    beta in betas and k = 1 .. d // 2 rotation blocks (block_direction), each by tied_local_minimum
    (MATH.md §14). Where a*_L I is a saddle (its antisymmetric Hessian eigenvalue < 0) the family start stays
    on it (the gradient is exactly 0 there): only the tilted starts leave. Minima whose sorted
    eigenvalues (an invariant of the orbit) agree to rtol are one. Returns the certified minima (is_minimum), lowest first,
    each tied_local_minimum's dict with `starts` (the (beta, k) that reached it; (0, 0) the family)."""
    L, n, d = _sizes(L, n, d, MAX_LOOPS)
    a = optimal_tied_family(L, n, d)[0]
    found = []
    for beta, k in [(0.0, 0)] + [(b, k) for b in betas for k in range(1, d // 2 + 1)]:
        m = tied_local_minimum(a * np.eye(d) + beta * block_direction(d, k), L, n, d)
        if not m["is_minimum"]:
            continue
        key = lambda e: np.sort_complex(np.round(e, 7))      # repeated eigenvalues: ties broken alike
        same = [f for f in found if np.max(np.abs(key(f["eigenvalues_W"]) - key(m["eigenvalues_W"]))) <= rtol]
        if same:
            same[0]["starts"].append((beta, k))
        else:
            m["starts"] = [(beta, k)]
            found.append(m)
    return sorted(found, key=lambda m: m["loss"])


def _block_basis(d, blocks):
    """The matrices commuting with O(d - 2 blocks) x SO(2)^blocks: alpha0 (I - D) + alpha D + beta J.
    alpha0 needs a coordinate outside the blocks and alpha one inside: 1 <= blocks < d / 2."""
    if not 1 <= _int("blocks", blocks, 0) < d / 2:
        raise ValueError(f"blocks must be between 1 and {(d - 1) // 2} for d = {d}: the profile's three parameters need "
                         f"a coordinate inside a block and one outside, got {blocks}")
    J = block_direction(d, blocks)
    D = np.diag(np.abs(J).sum(axis=1))
    return [np.eye(d) - D, D, J]


@_numpy_rules
def block_profile(L, n, d, blocks, betas):
    """phi(beta) = min over (alpha0, alpha) of f(alpha0 (I - D) + alpha D + beta J_blocks) (MATH.md §14): the
    loss along the matrices with `blocks` equal rotation blocks of size beta (D the blocks'
    coordinates), each minimised by L-BFGS-B on the exact loss from the previous beta's minimiser
    (the first from a*_L). betas: increasing, from 0. Returns (phi (k,), params (k, 3): alpha0, alpha,
    beta)."""
    L, n, d = _sizes(L, n, d, MAX_LOOPS)
    ev, basis = _evaluator(L, n, d), _block_basis(d, blocks)

    def restricted(q, beta):
        f, g = ev.loss_and_grad(q[0] * basis[0] + q[1] * basis[1] + beta * basis[2])
        return float(f), np.array([np.sum(g * basis[0]), np.sum(g * basis[1])])
    a = optimal_tied_family(L, n, d)[0]
    q, phi, params = np.array([a, a]), [], []
    for beta in betas:
        res = scipy.optimize.minimize(restricted, q, args=(float(beta),), jac=True, method="L-BFGS-B",
                                      options=dict(ftol=1e-16, gtol=1e-13))
        q = res.x
        phi.append(float(res.fun))
        params.append([q[0], q[1], float(beta)])
    return np.array(phi), np.array(params)


@_numpy_rules
def tied_block_saddle(L, n, d, blocks, beta_max, points=21):
    """The saddle of f between the family point and a minimum with `blocks` equal rotation blocks
    (MATH.md §14). The matrices alpha0 (I - D) + alpha D + beta J (block_profile) are those fixed by the
    rotations O(d - 2 blocks) x SO(2)^blocks, which leave f invariant, so every critical point of f
    restricted to (alpha0, alpha, beta) is a critical point of f (the principle of symmetric
    criticality). The profile's maximum over `points` betas in [0, beta_max] is polished by Newton's
    method on the three-parameter gradient and certified on the full Hessian modulo the orbit:
    `index` is its number of negative eigenvalues (1: a mountain pass between the two minima).

    Returns a dict: W, loss, grad_norm (of the full gradient), params (alpha0, alpha, beta), index,
    reduced_eigenvalues, orbit_dim, profile (betas, phi)."""
    L, n, d = _sizes(L, n, d, MAX_LOOPS)
    basis = _block_basis(d, blocks)
    betas = np.linspace(0.0, beta_max, points)
    phi, params = block_profile(L, n, d, blocks, betas)
    p = params[int(np.argmax(phi))]
    Bm = np.array([b.ravel() for b in basis]).T                # (d^2, 3)
    for _ in range(8):
        W = sum(x * b for x, b in zip(p, basis))
        g = Bm.T @ tied_loss_and_grad(W, L, n, d)[1].ravel()
        p = p - np.linalg.solve(Bm.T @ tied_hessian(W, L, n, d) @ Bm, g)
    W = sum(x * b for x, b in zip(p, basis))
    f, g = tied_loss_and_grad(W, L, n, d)
    lam, _, r = reduced_hessian(W, L, n, d)
    return dict(W=W, loss=f, grad_norm=float(np.linalg.norm(g)), params=tuple(float(x) for x in p),
                index=int(np.sum(lam < 0)), reduced_eigenvalues=lam, orbit_dim=r, profile=(betas, phi))


# ---------------------------------------------------------------------------------------------
# §14 Monte Carlo over S alone: independent of the polynomial
#
# Given S, the average over w* and the query is exact: E[(y_hat - y)^2 | S] = ||(I - W^T S)^L||_F^2
# (MATH.md §7, MATH.md §10). So a Monte Carlo over S needs no labels and no transformer, and two points
# compared on the same S samples (common random numbers) have a paired error far below either's.
# ---------------------------------------------------------------------------------------------

@_numpy_rules
def sample_whitened_covariances(rng, B, n, d):
    """B whitened sample covariances S = X^T X / n, X (n, d) iid N(0, 1) (MATH.md §14). Returns (B, d, d)."""
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    B, n, d = _int("B", B, 1), _int("n", n, 1), _int("d", d, 1)
    out = np.empty((B, d, d))
    for start in range(0, B, 20000):
        X = rng.standard_normal((min(20000, B - start), n, d))
        out[start:start + X.shape[0]] = np.einsum("bni,bnj->bij", X, X) / n
    return out


def _powers(W, S, L):
    if not np.all(np.isfinite(S)):                            # else a NaN in S reads as an overflow later
        raise ValueError("S must hold finite matrices (B, d, d); it has NaN or infinite entries")
    d = W.shape[0]
    M = np.eye(d) - np.swapaxes(W, -1, -2) @ S                # I - W^T S per sample (W may be complex)
    powers = [np.broadcast_to(np.eye(d, dtype=M.dtype), M.shape)]
    for _ in range(L):
        powers.append(powers[-1] @ M)
    return powers


@_numpy_rules
def per_sample_loss(W, S, L):
    """||(I - W^T S)^L||_F^2 for each S (MATH.md §14): the loss averaged over w* and the query given S, whose
    mean over S is f(W). W: (d, d); S: (B, d, d). Returns (B,)."""
    W = _square("W", W, S.shape[-1])
    with np.errstate(over="ignore", invalid="ignore"):          # an overflow is named below
        ML = _powers(W, S, _int("L", L, 1))[-1]
        loss = np.sum(ML * ML, axis=(-2, -1))
    if not np.all(np.isfinite(loss)):
        raise ValueError(f"the per-sample loss overflows float64 at max |W| {np.max(np.abs(W)):.3g}: use a smaller W")
    return loss


@_numpy_rules
def per_sample_gradient(W, S, L):
    """The gradient in W of per_sample_loss, -2 sum_{j<L} S M^{L-1-j} (M^L)^T M^j with M = I - W^T S
    (MATH.md §14; plain transposes, so it is holomorphic in W and takes a complex step). W: (d, d), real or
    complex; S: (B, d, d). Returns (B, d, d)."""
    L = _int("L", L, 1)
    W = _square("W", W, S.shape[-1], complex_ok=True)
    P = _powers(W, S, L)
    MLT = np.swapaxes(P[L], -1, -2)
    return -2 * sum(S @ P[L - 1 - j] @ MLT @ P[j] for j in range(L))


@_numpy_rules
def per_sample_second_derivative(W, S, L, E):
    """d^2/dt^2 per_sample_loss(W + t E) at t = 0 for each S, exactly (MATH.md §14): with M(t) = M - t N,
    M = I - W^T S, N = E^T S, the powers M(t)^l = X0 + t X1 + t^2 X2 + O(t^3) follow
    X0' = X0 M, X1' = X1 M - X0 N, X2' = X2 M - X1 N, and ||M(t)^L||_F^2 has t^2 coefficient
    ||X1||^2 + 2 <X0, X2>. No eigenvalue formula, no complex step. W, E: (d, d); S: (B, d, d).
    Returns (B,)."""
    L = _int("L", L, 1)
    W, E = _square("W", W, S.shape[-1]), _square("E", E, S.shape[-1])
    d = W.shape[0]
    M, N = np.eye(d) - W.T @ S, E.T @ S
    X0, X1, X2 = np.broadcast_to(np.eye(d), S.shape), np.zeros(S.shape), np.zeros(S.shape)
    for _ in range(L):
        X0, X1, X2 = X0 @ M, X1 @ M - X0 @ N, X2 @ M - X1 @ N
    return 2 * (np.sum(X1 * X1, axis=(-2, -1)) + 2 * np.sum(X0 * X2, axis=(-2, -1)))


@_numpy_rules
def per_sample_hessian_products(W, S, L, U):
    """H_S u for every direction u (columns of U, (d^2, k), in vec(W) order) and every S: the complex
    step Im grad_S(W + i h u) / h of per_sample_gradient (MATH.md §14). Returns (B, d^2, k); its mean over S
    is the Hessian of f times U."""
    W = _square("W", W, S.shape[-1])
    U = np.asarray(U, dtype=np.float64)
    d = W.shape[0]
    out = np.empty((S.shape[0], d * d, U.shape[1]))
    for k in range(U.shape[1]):
        g = per_sample_gradient(W + 1j * COMPLEX_STEP * U[:, k].reshape(d, d), S, L)
        out[:, :, k] = g.imag.reshape(S.shape[0], d * d) / COMPLEX_STEP
    return out


def _mean_se(x):
    """(mean, standard error) of samples x, scale-free: the squared deviations of samples near 1e-200
    underflow to 0 (a standard error of 0) and those near 1e160 overflow; scaled by max |x| they do
    neither. A ValueError when the samples themselves are not finite."""
    x = np.asarray(x, dtype=np.float64)
    top = np.max(np.abs(x)) if np.all(np.isfinite(x)) else math.nan
    if not math.isfinite(top):
        raise ValueError("the Monte Carlo samples overflow float64: use a smaller W")
    u = x / top if top > 0 else x
    return float(np.mean(u)) * top if top > 0 else 0.0, float(np.std(u, ddof=1) / math.sqrt(x.shape[0])) * top


@_numpy_rules
def mc_loss(W, S, L, control=None):
    """f(W) by Monte Carlo over S (MATH.md §14), with its standard error. control = (W0, f0): the control
    variate per_sample_loss(W0) - f0 (mean exactly 0 when f0 = f(W0), e.g. the family point's exact
    loss), on the same S, with the least-variance coefficient c = cov / var estimated from the samples
    (its estimation costs O(1/B) relative in the variance, negligible here). Returns (estimate, se,
    c) (c = 0 without a control)."""
    y = per_sample_loss(W, S, L)
    if control is None:
        m, se = _mean_se(y)
        return m, se, 0.0
    W0, f0 = control
    x = per_sample_loss(W0, S, L) - f0
    var = np.var(x, ddof=1)
    # a control constant over the samples (W0 = 0: every sample's loss is d) corrects nothing: c = 0
    c = float(np.cov(y, x)[0, 1] / var) if var > 0 else 0.0
    m, se = _mean_se(y - c * x)
    return m, se, c


@_numpy_rules
def subspace_bases(d):
    """Orthonormal bases of span(I), the symmetric traceless and the antisymmetric (d, d) matrices, as
    columns in vec order: (d^2, 1), (d^2, d(d+1)/2 - 1), (d^2, d(d-1)/2) (MATH.md §14)."""
    d = _int("d", d, 1)
    sym, anti = [], []
    for i in range(d):
        for j in range(i, d):
            E = np.zeros((d, d))
            E[i, j] = E[j, i] = 1.0
            sym.append(E.ravel() / np.linalg.norm(E))
            if j > i:
                K = np.zeros((d, d))
                K[i, j], K[j, i] = 1.0, -1.0
                anti.append(K.ravel() / math.sqrt(2))
    ident = np.eye(d).ravel()[:, None] / math.sqrt(d)
    S = np.array(sym).T
    S = S - ident @ (ident.T @ S)                              # project out I, then orthonormalise
    U, sv, _ = np.linalg.svd(S, full_matrices=False)
    return ident, U[:, sv > 1e-10], (np.array(anti).T if anti else np.zeros((d * d, 0)))


@_numpy_rules
def mc_family_hessian_eigenvalues(L, S, a):
    """The three Hessian eigenvalues of f at a I by Monte Carlo over S (MATH.md §14): for each S the mean of
    per_sample_second_derivative over an orthonormal basis of each subspace (subspace_bases; the
    Hessian's trace on it over its dimension, no eigenvalue formula), then the mean and standard error
    over S. S: (B, d, d). Returns ((identity, se), (symmetric, se), (antisymmetric, se))."""
    d = S.shape[-1]
    out = []
    for U in subspace_bases(d):
        if U.shape[1] == 0:
            out.append((math.nan, math.nan))
            continue
        values = sum(per_sample_second_derivative(a * np.eye(d), S, L, u.reshape(d, d)) for u in U.T)
        out.append(_mean_se(values / U.shape[1]))
    return tuple(out)


@_numpy_rules
def mc_certificate(W, S, L, control=None, C=None, chunk=20000):
    """An independent Monte Carlo certificate of a point W of f (MATH.md §14), on the samples S: the loss
    (mc_loss, with the optional control), the gradient's mean and standard error per entry (grad_z:
    the largest |mean| / se; a diagnostic only: the per-sample gradient, a polynomial of degree 2L - 1
    in S, is so heavy-tailed that its sample standard errors understate the error, max |z| over the
    25 entries at L = 4 reaching 4.6 in 2 of 8 seeds of 40000 samples at the exact minimum), and the Hessian reduced modulo the rotation orbit (C: its complement's
    basis, default orbit_complement(W)) averaged over S, with the smallest eigenvalue lam_min and its
    standard error std(v^T H_S v) / sqrt(B) at its eigenvector v (first-order perturbation of a simple
    eigenvalue; for a repeated one the smallest of the estimates is biased low, which errs on the
    side of refusing a minimum). S is walked in chunks of `chunk` samples (two passes: the mean
    Hessian, then v^T H_S v). Returns a dict: loss, loss_se, control_c, grad_mean (d, d), grad_se
    (d, d), grad_z, reduced_min, reduced_min_se, reduced_eigenvalues, B."""
    loss, loss_se, c = mc_loss(W, S, L, control)
    d, B = W.shape[0], S.shape[0]
    C = orbit_complement(W) if C is None else C
    g_sum, g_sq, R_sum = np.zeros((d, d)), np.zeros((d, d)), np.zeros((C.shape[1], C.shape[1]))
    for start in range(0, B, chunk):
        Sc = S[start:start + chunk]
        g = per_sample_gradient(W, Sc, L)
        g_sum += g.sum(axis=0)
        g_sq += (g * g).sum(axis=0)
        R_sum += np.einsum("ik,bil->kl", C, per_sample_hessian_products(W, Sc, L, C))
    gm = g_sum / B
    gse = np.sqrt(np.maximum(g_sq / B - gm * gm, 0) * B / (B - 1) / B)
    Rm = R_sum / B
    lam, V = np.linalg.eigh((Rm + Rm.T) / 2)
    v = C @ V[:, 0]
    along = np.concatenate([np.einsum("i,bi->b", v, per_sample_hessian_products(W, S[s:s + chunk], L, v[:, None])[:, :, 0])
                            for s in range(0, B, chunk)])
    m, se = _mean_se(along)
    return dict(loss=loss, loss_se=loss_se, control_c=c, grad_mean=gm, grad_se=gse,
                grad_z=float(np.max(np.abs(gm) / gse)), reduced_min=float(lam[0]), reduced_min_along=m,
                reduced_min_se=se, reduced_eigenvalues=lam, B=B)


# ---------------------------------------------------------------------------------------------
# §14 One layer's gradient flow from Zhang, Frei and Bartlett's initialisation
# ---------------------------------------------------------------------------------------------

def _one_layer_field(u, U, Sigma, K, E_hw):
    """(dL/du, dL/dU) of the layer P = u e_d e_d^T, Q = -[[U, 0], [0, 0]] through Gamma = u U:
    grad_Gamma = 2 (K Gamma Sigma - E[h w^T] Sigma) (MATH.md §8, §14)."""
    G = 2 * (K @ (u * U) @ Sigma - E_hw @ Sigma)
    return float(np.sum(G * U)), u * G


def _one_layer_hessian(u, U, Sigma, K, E_hw):
    """The Hessian of the loss in y = (u, vec U) (row-major vec), (1 + d^2, 1 + d^2), differentiating
    _one_layer_field once more (MATH.md §14): with G = grad_Gamma and dG = 2 K dGamma Sigma,
    d2L/du2 = <2 K U Sigma, U>, d2L/du dU = G + 2 u K U Sigma, d2L/dU2 = 2 u^2 (K kron Sigma)."""
    G = 2 * (K @ (u * U) @ Sigma - E_hw @ Sigma)
    KUS = 2 * K @ U @ Sigma
    cross = (G + u * KUS).ravel()
    return np.block([[np.array([[np.sum(KUS * U)]]), cross[None, :]],
                     [cross[:, None], 2 * u ** 2 * np.kron(K, Sigma)]])


def _scaled_moments(Sigma, n, Sigma_w):
    """Checked (n, Sigma, c, S, (W, w), K, E[h w^T]) for noiseless labels: Sigma = c S and
    Sigma_w = w W with max entries 1, K and E[h w^T] those of (S, W) (MATH.md §8), so that no product
    of entries under- or overflows; the loss at (Sigma, Sigma_w) is c w times that at (S, W) with
    Gamma scaled by c (MATH.md §14)."""
    n = _int("n", n, 1)
    Sigma = _spd("Sigma", Sigma)[0]
    W, w = _task_moment(Sigma_w, None, Sigma.shape[0])
    c = float(np.max(np.abs(Sigma)))
    S = Sigma / c
    return (n, Sigma, c, S, (W, w), *_single_layer_moments(S, n, W, 0.0))


def _in_range(name, value, factors, c, w):
    """value itself unless it is not finite or its scale (the product of the nonzero factors, taken
    in logarithms) is below float64's normal range: then a ValueError naming the scales."""
    tiny = np.finfo(np.float64).tiny
    if np.all(np.isfinite(value)) and not (all(f > 0 for f in factors)
                                           and sum(math.log(f) for f in factors) < math.log(tiny)):
        return value
    raise ValueError(f"{name} overflows float64 or underflows below its normal range: max |Sigma| = {c:.3g}, "
                     f"max |Sigma_w| = {w:.3g}; rescale x or w_star")


@_numpy_rules
def one_layer_population_grad(u, U, Sigma, n, Sigma_w=None):
    """Exact population loss of one layer P = u e_d e_d^T, Q = -[[U, 0], [0, 0]] (noiseless
    labels; Zhang, Frei and Bartlett's value scalar and key-query block) and its gradient in (u, U),
    the chain rule of icl_ref.single_layer_population_loss through Gamma = u U (MATH.md §14).
    Scale-free: the loss is icl_ref's (a sum of squares, right at any scale and n); the gradient is
    computed at Sigma / max |Sigma|, Sigma_w / max |Sigma_w| and rescaled. A loss or gradient outside
    float64's normal range is a ValueError naming the scales (at Gamma = Gamma*, |dU| ~ max |Sigma|^2:
    refused below ~1e-154 and above ~1e154).
    u: float; U: (d, d); Sigma, Sigma_w: (d, d) SPD. Returns (loss, du (float), dU (d, d)); the
    gradient of icl_ref.full_layer_population_loss in every other entry of (P, Q) is 0 there.
    """
    u = float(_array("u", u, 0))
    n, Sigma, c, S, (W, w), K, E_hw = _scaled_moments(Sigma, n, Sigma_w)
    U = _array("U", U, 2)
    if U.shape != Sigma.shape:
        raise ValueError(f"U must have shape {Sigma.shape} to match Sigma, got {U.shape}")
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):      # checked below
        Gamma = u * U
        KGS, ES = K @ (c * Gamma) @ S, E_hw @ S
        g = 2 * (KGS - ES)                                      # grad_Gamma / (c^2 w)
        du = c * w * float(np.sum(g * (c * U)))
        dU = (c * w) * (c * u) * g
    if not np.all(np.isfinite(Gamma)):
        raise ValueError(f"u U overflows float64 (|u| = {abs(u):.3g}, max |U| = {np.max(np.abs(U)):.3g})")
    loss = _single_layer_loss(Gamma, Sigma, (W, w), Sigma, n, 0.0, False)
    gmax = 2 * max(float(np.max(np.abs(KGS))), float(np.max(np.abs(ES))))    # g's terms (g ~ 0 at Gamma*)
    du = _in_range("the gradient du", du, [c, c, w, gmax, float(np.max(np.abs(U)))], c, w)
    dU = _in_range("the gradient dU", dU, [c, c, w, gmax, abs(u)], c, w)
    return loss, float(du), dU


# one_layer_gradient_flow refuses a start sigma above MAX_START_RATIO times the rest scale |Gamma*|^(1/2):
# LSODA's cost grows slowly up to ~1e12 (4.5e3 evaluations) and it fails at 1e16
MAX_START_RATIO = 1e10
MAX_FLOW_TIME = 1e20     # of c^2 w t: LSODA's steps failed from ~1e25 on (the flow rests long before)


def _tolerance(rtol):
    """rtol as a float in [1e-13, 0.1]: below, float64 cannot honour it (SciPy raises it to 100 eps
    itself); NaN, 0 or a string would stall or break the solver."""
    if isinstance(rtol, bool) or not isinstance(rtol, (int, float, np.integer, np.floating)):
        raise TypeError(f"rtol must be a real number, got {type(rtol).__name__}")
    if not 1e-13 <= rtol <= 0.1:
        raise ValueError(f"rtol must be between 1e-13 and 0.1, got {rtol}")
    return float(rtol)


@_numpy_rules
def one_layer_gradient_flow(Sigma, n, sigma, t, Theta=None, Sigma_w=None, rtol=1e-12):
    """Gradient flow d(u, U)/dt = -grad L of the exact one-layer population loss (icl_ref's loss, a
    mean without 1/2) from Zhang, Frei and Bartlett's initialisation (MATH.md §14):

        u(0) = sigma,  U(0) = sigma Theta Theta^T / |Theta Theta^T|_F,

    i.e. P(0) = sigma e_d e_d^T, Q(0) = -sigma [[Theta Theta^T, 0], [0, 0]] (their W^PV, W^KQ with
    |Theta Theta^T|_F = 1; the flow keeps every other entry of (P, Q) at 0). Integrated by
    scipy.integrate.solve_ivp's LSODA, which switches from Adams steps to implicit BDF steps when the
    flow turns stiff (its rates differ by the spread of K and Sigma), with the exact Hessian as its
    Jacobian: once the flow has converged its steps grow, so the cost stops growing with t. rtol in
    [1e-13, 0.1]; atol = rtol / 100 of the state's scale. BDF does not conserve the invariant
    exactly: it drifts by about the accumulated local error, rtol times the evaluations.
    Sigma, Sigma_w: (d, d) SPD; n >= 1; sigma > 0; t: increasing times >= 0, (T,), with c^2 w t <=
    MAX_FLOW_TIME (c = max |Sigma|, w = max |Sigma_w|); Theta: (d, d), nonzero (default I). Returns a dict: t (T,), u (T,), U (T, d, d), Gamma (T, d, d) = u U (the
    effective preconditioner: y_hat = h^T Gamma x_q), loss (T,), invariant (T,) = u^2 - |U|_F^2
    (conserved; 0 here), sigma_bound = sqrt(2 / (sqrt(d) |Gamma*^-1|_2)) with Gamma* =
    gamma_star(Sigma, n, Sigma_w) (for Sigma_w = I the initial scale below which their Theorem 4.1
    proves convergence), nfev.
    """
    n, Sigma, c, S, (W, w), K, E_hw = _scaled_moments(Sigma, n, Sigma_w)
    d = Sigma.shape[0]
    sigma = _nonneg("sigma", sigma)
    if sigma == 0:
        raise ValueError("sigma must be > 0: (u, U) = 0 is a critical point of the loss, where the flow stays")
    t = _array("t", t, 1)
    if t.size < 1 or t[0] < 0 or np.any(np.diff(t) <= 0):
        raise ValueError(f"t must be a non-empty increasing vector of times >= 0, got {t}")
    Theta = np.eye(d) if Theta is None else _array("Theta", Theta, 2)
    if Theta.shape != (d, d) or not np.any(Theta):
        raise ValueError(f"Theta must be a nonzero ({d}, {d}) matrix, got shape {Theta.shape}")
    rtol = _tolerance(rtol)
    Theta = Theta / np.max(np.abs(Theta))               # Theta Theta^T neither over- nor underflows
    M = Theta @ Theta.T
    # scale-free (MATH.md §14): with Sigma = c S, Sigma_w = w W, the loss is c w l(c u U), l that of (S, W),
    # so (u~, U~) = sqrt(c) (u, U) follows the flow of l at the rate c^2 w: d(u~, U~)/dt = -c^2 w grad l
    root = math.sqrt(c)
    with np.errstate(over="ignore", under="ignore"):
        s0, rate = sigma * root, c * c * w
    rest = math.sqrt(np.max(np.abs(np.linalg.solve(K, E_hw))))     # |u~| ~ |Gamma~*|^(1/2) at rest
    if not (0 < s0 < math.inf and rate < math.inf):
        raise ValueError(f"the flow's scaled start sigma sqrt(c) = {s0:.3g} or rate c^2 w do not fit float64 "
                         f"(c = max |Sigma| = {c:.3g}, w = max |Sigma_w| = {w:.3g}): rescale x or w_star")
    if s0 > MAX_START_RATIO * rest:
        raise ValueError(f"sigma = {sigma:.3g} is {s0 / rest:.3g} times the rest scale |Gamma*|^(1/2) = {rest / root:.3g} "
                         f"(max |Sigma| = {c:.3g}): the flow's rates span the square of that and LSODA fails beyond "
                         f"~1e12; start below {MAX_START_RATIO:.0e} times it")
    if rate * t[-1] > MAX_FLOW_TIME:
        raise ValueError(f"t must be <= {MAX_FLOW_TIME / rate:.3g} (c^2 w t <= {MAX_FLOW_TIME:.0e}, c = max |Sigma|, "
                         f"w = max |Sigma_w|): LSODA's steps cannot span longer flows; got t = {t[-1]:.3g}")
    y0 = s0 * np.r_[1.0, (M / np.linalg.norm(M)).ravel()]
    # the state's scale from start to rest: an absolute tolerance below 1e-2 rtol of it would ask for
    # less than the field's own rounding there, and the implicit steps would shrink without end once the flow rests
    scale = max(s0, rest)

    def field(_, y):
        du, dU = _one_layer_field(y[0], y[1:].reshape(d, d), S, K, E_hw)
        return -rate * np.r_[du, dU.ravel()]

    def jacobian(_, y):
        return -rate * _one_layer_hessian(y[0], y[1:].reshape(d, d), S, K, E_hw)
    ys = y0[:, None]
    if t[-1] > 0:
        with np.errstate(over="ignore", invalid="ignore"):
            sol = scipy.integrate.solve_ivp(field, (0.0, t[-1]), y0, method="LSODA", t_eval=t, rtol=rtol,
                                            atol=rtol * 1e-2 * scale, jac=jacobian)
        if not np.all(np.isfinite(sol.y)):
            raise ValueError(f"the flow overflowed float64 (sigma = {sigma:.3g}, max |Sigma| = {c:.3g}): start smaller "
                             f"or rescale x")
        if not sol.success:
            raise ValueError(f"solve_ivp failed: {sol.message}")
        ys = sol.y
    u, U = ys[0] / root, ys[1:].T.reshape(-1, d, d) / root
    Gamma = ys[0][:, None, None] * ys[1:].T.reshape(-1, d, d) / c
    loss = np.array([_single_layer_loss(G, Sigma, (W, w), Sigma, n, 0.0, False) for G in Gamma])
    gamma_inv = np.linalg.solve(E_hw, K)                       # Gamma~*^-1 = (S W)^-1 K; Gamma*^-1 = c times it
    return dict(t=t, u=u, U=U, Gamma=Gamma, loss=loss,
                invariant=(ys[0] ** 2 - np.sum(ys[1:] ** 2, axis=0)) / c,
                sigma_bound=math.sqrt(2 / (math.sqrt(d) * np.linalg.norm(gamma_inv, 2))) / root,
                nfev=int(sol.nfev) if t[-1] > 0 else 0)
