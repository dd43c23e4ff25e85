"""Strong rank-revealing QR (Gu & Eisenstat 1996), the numerical core of the DRRQR selector.

Given ``M`` (m x n) and a target ``k``, find a column permutation ``Pi`` with

    M Pi = Q [[A_k, B_k],
              [0,   C_k]]            (A_k: k x k upper triangular)

such that no single swap of a selected and an unselected column grows ``|det A_k|`` by more than a
factor ``f > 1``, i.e. at termination, for all i <= k < j,

    rho_ij = sqrt( (A_k^{-1} B_k)_ij^2 + (gamma_j(C_k) / omega_i(A_k))^2 ) <= f,

with gamma_j the column norms of C_k and omega_i = 1 / ||row i of A_k^{-1}||. Then (Gu & Eisenstat,
Thm. 3.2; paper App. B.2) with ``c_f = sqrt(1 + f^2 k (n - k))``

    sigma_i(A_k) >= sigma_i(M) / c_f          (i <= k),
    sigma_j(C_k) <= sigma_{k+j}(M) * c_f      (j <= n - k),
    |(A_k^{-1} B_k)_ij| <= f.

Algorithm (paper Algorithm 2):

1. *Reduction.* The pivots depend on M only through its R factor (M Pi = Q R  <=>  R Pi = Q' R'),
   so M is first reduced once to an n x n upper-triangular R. ``reduction="gram"`` forms the Gram
   matrix in float64 and runs LAPACK's pivoted Cholesky (``dpstrf``), whose greedy pivots are exactly
   those of column-pivoted QR (QRCP): it costs one ``syrk`` (m n^2 flops) instead of a Householder
   QRCP (4 m n^2 flops with a BLAS-2 half). Its error on a singular value sigma is about
   ``n eps64 sigma_1^2 / sigma``, i.e. below ``sqrt(n eps64) sigma_1 ~ 2e-7 sigma_1`` for n = 128,
   which is under the rounding floor of float32 data (``eps32 ~ 1.2e-7``). It is therefore the
   default for float32 (and narrower) inputs. ``reduction="qr"`` uses Householder QR and then QRCP
   of the small R (LAPACK ``dgeqrf`` + ``dgeqp3``), accurate to ``eps64``; it is the default for
   float64 inputs.
2. *Start.* The QRCP factorisation of step 1.
3. *Swaps.* While ``max rho_ij > f``: take the maximising pair, cyclically move selected column i
   to position k and re-triangularise A (a small QR of the Hessenberg block), move unselected
   column j to position k+1 and reduce it with one Householder reflector, swap the two and restore
   the triangle with one Givens rotation. ``A^{-1}B`` and ``omega`` are updated with the rank-one
   formulas of Gu & Eisenstat (1996, Sec. 4) in O(k (n - k)) plus one (k-1)-triangular solve;
   ``gamma`` is recomputed from the explicitly held C block (same O((n-k)^2) cost, no cancellation).
   When the updated quantities say "done", they are recomputed from R from scratch and the loop only
   stops if the recomputed ``max rho <= f`` (guards against drift in the rank-one updates).

Numerically rank-deficient M (``|R_ii| <= rtol |R_00|`` in the QRCP start): the swap loop runs
on the numerical rank ``r < k`` and the remaining ``k - r`` slots are filled in column-pivoted
(largest residual first) order; the bounds then hold for the first r singular values and
``C_k`` is at noise level.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import scipy.linalg as sla
from scipy.linalg import lapack

#: Default swap tolerance. Gu & Eisenstat require f >= 1 (and f > 1 for a polynomial swap count);
#: f = 2 is the customary choice: each swap at least doubles |det A_k|, so few swaps follow QRCP,
#: while the bound factor sqrt(1 + 4 k (n - k)) stays polynomial. Pass a smaller f (e.g. 1.1) for
#: selections closer to the maximum-volume subset.
DEFAULT_F = 2.0

REDUCTIONS = ("auto", "gram", "qr")

_EPS64 = float(np.finfo(np.float64).eps)


@dataclass(frozen=True)
class StrongRRQRResult:
    """Outcome of :func:`strong_rrqr`.

    Attributes:
        perm: int64 [n], the column permutation: ``M[:, perm] = Q @ R``; ``perm[:k]`` is the selection.
        R: float64 [n, n] upper-triangular R factor of ``M[:, perm]`` (rows beyond ``rank(M)`` ~ 0).
        k: number of selected columns.
        rank: numerical rank of M used by the swap loop (``min(k, rank)`` columns are swap-optimised).
        n_swaps: number of accepted Gu-Eisenstat swaps after the QRCP start.
        max_rho: ``max rho_ij`` at termination, recomputed from R, for the first ``min(k, rank)`` columns
            (0.0 when there is nothing to swap).
        omega: float64 [k], for each selected column (in ``perm[:k]`` order) its distance to the span of
            the other selected columns, ``1 / ||row i of A_k^{-1}||`` (paper App. B.2's omega_i).
        f: the swap tolerance used.
        reduction: ``"gram"`` or ``"qr"``, the reduction actually used.
    """

    perm: np.ndarray
    R: np.ndarray
    k: int
    rank: int
    n_swaps: int
    max_rho: float
    omega: np.ndarray
    f: float
    reduction: str

    @property
    def selected(self) -> np.ndarray:
        """The k selected column indices, in factorisation order (not sorted)."""
        return self.perm[: self.k]

    @property
    def bound_factor(self) -> float:
        """``c_f = sqrt(1 + f^2 k (n - k))`` of the strong-RRQR singular-value bounds."""
        n = self.perm.shape[0]
        return math.sqrt(1.0 + self.f**2 * self.k * (n - self.k))


def strong_rrqr(
    M: np.ndarray | Sequence[np.ndarray],
    k: int,
    f: float = DEFAULT_F,
    *,
    reduction: str = "auto",
    rtol: float | None = None,
    max_swaps: int | None = None,
) -> StrongRRQRResult:
    """Strong RRQR column selection (Gu & Eisenstat 1996, Algorithm 4; paper App. B.2, Algorithm 2).

    Args:
        M: [m, n] real matrix (for DRRQR: ``[K_cal; Q_cal]``, 2N x d_k), or a list/tuple of row blocks of it
            (``[K_cal, Q_cal]``, stacked without a copy). Any float dtype; computation is float64.
        k: number of columns to select, ``1 <= k <= n``.
        f: swap tolerance, ``> 1``; at termination every ``rho_ij <= f``.
        reduction: ``"auto"`` (``"gram"`` for float32 and narrower inputs, ``"qr"`` otherwise), ``"gram"`` or
            ``"qr"``; see the module docstring.
        rtol: relative tolerance on ``|R_ii| / |R_00|`` below which M counts as numerically rank deficient;
            default ``10 max(eps(M.dtype), floor)`` with floor = ``sqrt(n eps64)`` for the Gram route and
            ``n eps64`` for QR (about 1.7e-6 for float32 input with n = 128, 3e-13 for float64).
        max_swaps: safety cap on swaps (each swap multiplies ``|det A_k|`` by more than f, so the loop
            terminates in exact arithmetic); default ``1000 + 100 n``.

    Returns:
        A :class:`StrongRRQRResult`.
    """
    blocks = [np.asarray(b) for b in M] if isinstance(M, (list, tuple)) else [np.asarray(M)]
    shapes = [b.shape for b in blocks]
    if not blocks or any(len(sh) != 2 for sh in shapes) or len({sh[1] for sh in shapes}) != 1:
        raise ValueError(f"strong_rrqr needs a 2-D matrix (or row blocks with equal columns), got shapes {shapes}")
    m, n = sum(sh[0] for sh in shapes), shapes[0][1]
    if m == 0 or n == 0:
        raise ValueError(f"strong_rrqr needs a non-empty matrix, got shape ({m}, {n})")
    dtype = np.result_type(*blocks)
    if not (np.issubdtype(dtype, np.floating) or np.issubdtype(dtype, np.integer)):
        raise ValueError(f"strong_rrqr needs a real matrix, got dtype {dtype}")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= n:
        raise ValueError(f"k={k!r} must be an integer in [1, n={n}]")
    k = int(k)
    f = float(f)
    if not (f > 1.0 and math.isfinite(f)):
        raise ValueError(f"f={f} must be a finite number > 1 (Gu & Eisenstat's swap tolerance)")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}; valid: {', '.join(REDUCTIONS)}")
    eps_data = float(np.finfo(dtype).eps) if np.issubdtype(dtype, np.floating) else _EPS64
    if reduction == "auto":
        reduction = "gram" if eps_data >= float(np.finfo(np.float32).eps) else "qr"
    if rtol is None:
        # noise floor of |R_ii| / |R_00|: the data's own rounding (about eps(dtype) sigma_1) or the
        # reduction's error (Gram: sqrt(n eps64) sigma_1; Householder: n eps64 sigma_1), with a 10x margin
        floor_red = math.sqrt(n * _EPS64) if reduction == "gram" else n * _EPS64
        rtol = 10.0 * max(eps_data, floor_red)
    elif not 0.0 <= rtol < 1.0:
        raise ValueError(f"rtol={rtol} must be in [0, 1)")
    if max_swaps is None:
        max_swaps = 1000 + 100 * n

    if reduction == "gram":
        R, perm, rank = _reduce_gram(blocks, rtol)
    else:
        R, perm, rank = _reduce_qr(blocks[0] if len(blocks) == 1 else np.concatenate(blocks), rtol)

    k_eff = min(k, rank)
    n_swaps = 0
    max_rho = 0.0
    w2 = None
    if 0 < k_eff < n:
        n_swaps, max_rho, w2 = _swap_loop(R, perm, k_eff, f * f, max_swaps)
    if k_eff < n and (n_swaps > 0 or k_eff < k):
        # Re-triangularise the trailing block (it is kept dense during the swaps) in column-pivoted
        # order, which also fills the k - rank slots of a rank-deficient M by largest residual.
        Ct, piv = sla.qr(R[k_eff:, k_eff:], mode="r", pivoting=True, check_finite=False)
        R[k_eff:, k_eff:] = Ct
        R[:k_eff, k_eff:] = R[:k_eff, k_eff:][:, piv]
        perm[k_eff:] = perm[k_eff:][piv]
    omega = _omega(R[:k, :k], w2 if k_eff == k else None, rtol * abs(R[0, 0]))
    return StrongRRQRResult(
        perm=perm.astype(np.int64),
        R=R,
        k=k,
        rank=rank,
        n_swaps=n_swaps,
        max_rho=max_rho,
        omega=omega,
        f=f,
        reduction=reduction,
    )


def _gram(blocks: list[np.ndarray]) -> np.ndarray:
    """``M^T M`` in float64 for M given as row blocks, cast in chunks of about 1 MiB (they stay in cache)."""
    n = blocks[0].shape[1]
    step = max(256, (1 << 20) // (8 * n))
    G = None
    for B in blocks:
        for i in range(0, B.shape[0], step):
            X = B[i : i + step].astype(np.float64, copy=False)
            P = X.T @ X  # numpy uses syrk for a.T @ a
            G = P if G is None else G + P
    return G


def _reduce_gram(blocks: list[np.ndarray], rtol: float) -> tuple[np.ndarray, np.ndarray, int]:
    """R factor (n x n, QRCP column order) via float64 Gram + LAPACK pivoted Cholesky (dpstrf)."""
    n = blocks[0].shape[1]
    G = _gram([B for B in blocks if B.shape[0]])
    d = np.diagonal(G)
    if not np.isfinite(d).all():
        raise ValueError("strong_rrqr: M contains NaN or Inf")
    gmax = float(d.max())
    if gmax == 0.0:
        return np.zeros((n, n)), np.arange(n), 0
    # dpstrf stops when the largest remaining Schur-complement diagonal (a squared residual norm)
    # drops below tol, i.e. when the next |R_ii| < rtol * |R_00|.
    c, piv, rank, info = lapack.dpstrf(G, tol=(rtol * rtol) * gmax, lower=0)
    if info < 0:
        raise RuntimeError(f"LAPACK dpstrf failed with info={info}")
    perm = piv.astype(np.int64) - 1
    R = np.triu(c)
    if rank < n:
        # dpstrf leaves the trailing block unfactored: rebuild it from the Schur complement S = R22^T R22
        # (PSD up to rounding) so that R stays an R factor of M[:, perm] at noise level.
        Gp = G[np.ix_(perm, perm)]
        R12 = R[:rank, rank:]
        S = Gp[rank:, rank:] - R12.T @ R12
        lam, V = np.linalg.eigh((S + S.T) / 2)
        R22 = sla.qr(np.sqrt(np.clip(lam, 0.0, None))[:, None] * V.T, mode="r", check_finite=False)[0]
        R[rank:, rank:] = R22
    return R, perm, int(rank)


def _reduce_qr(M: np.ndarray, rtol: float) -> tuple[np.ndarray, np.ndarray, int]:
    """R factor (n x n, QRCP column order) via Householder QR of M, then QRCP of the small R."""
    m, n = M.shape
    X = M.astype(np.float64, copy=False)
    if not np.isfinite(X).all():
        raise ValueError("strong_rrqr: M contains NaN or Inf")
    R1 = sla.qr(X, mode="r", check_finite=False)[0][:n] if m > n else X
    R0 = np.zeros((n, n))
    R0[: R1.shape[0]] = R1
    R, perm = sla.qr(R0, mode="r", pivoting=True, check_finite=False)
    R = np.triu(R)
    diag = np.abs(np.diagonal(R))
    if diag[0] == 0.0:
        return R, perm.astype(np.int64), 0
    small = np.flatnonzero(diag <= rtol * diag[0])
    rank = int(small[0]) if small.size else n
    return R, perm.astype(np.int64), rank


def _recompute(R: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``A^{-1} B``, ``1/omega^2`` (squared row norms of A^{-1}) and ``gamma^2`` from R, from scratch."""
    Ainv, info = lapack.dtrtri(R[:k, :k], lower=0)
    if info != 0:
        raise RuntimeError(f"singular A_k in strong RRQR (dtrtri info={info})")
    U = Ainv @ R[:k, k:]
    w2 = np.einsum("ij,ij->i", Ainv, Ainv)
    gamma2 = np.einsum("ij,ij->j", R[k:, k:], R[k:, k:])
    return U, w2, gamma2


def _swap_loop(
    R: np.ndarray, perm: np.ndarray, k: int, f2: float, max_swaps: int
) -> tuple[int, float, np.ndarray]:
    """Gu-Eisenstat swaps on R (in place) until ``max rho^2 <= f2``. Returns (swaps, max rho, 1/omega^2)."""
    nk = R.shape[1] - k
    U, w2, gamma2 = _recompute(R, k)
    fresh = True
    n_swaps = 0
    while True:
        rho2 = U * U + w2[:, None] * gamma2[None, :]
        flat = int(np.argmax(rho2))
        best = float(rho2.flat[flat])
        if not math.isfinite(best):
            raise RuntimeError("non-finite rho in strong RRQR; M is too ill-conditioned for the chosen rtol")
        if best <= f2:
            if fresh:
                return n_swaps, math.sqrt(best), w2
            U, w2, gamma2 = _recompute(R, k)
            fresh = True
            continue
        if n_swaps >= max_swaps:
            raise RuntimeError(f"strong RRQR did not converge in {max_swaps} swaps (max rho^2={best:.3g}, f^2={f2})")
        i, j = divmod(flat, nk)
        gamma2 = _swap(R, perm, U, w2, i, j, k)
        n_swaps += 1
        fresh = False


def _swap(R: np.ndarray, perm: np.ndarray, U: np.ndarray, w2: np.ndarray, i: int, j: int, k: int) -> np.ndarray:
    """Swap selected column i with unselected column j (0-based within C), updating R, perm, U, w2 in place.

    Returns the new ``gamma^2``. Formulas: Gu & Eisenstat (1996), Sec. 4, with A = [[A1, a], [0, alpha]],
    the unselected column reduced to [b; beta; gamma; 0] and b2 / c2 the rows k-1 / k of the remaining
    unselected columns.
    """
    # 1. Move selected column i to the last selected position; A becomes upper Hessenberg in rows i..k-1.
    if i != k - 1:
        order = np.r_[i + 1 : k, i]
        R[:, i:k] = R[:, order]
        perm[i:k] = perm[order]
        U[i:k] = U[order]
        w2[i:k] = w2[order]
        Qb, Tb = sla.qr(R[i:k, i:k], check_finite=False)
        R[i:k, k:] = Qb.T @ R[i:k, k:]  # left rotations leave A^{-1}B and omega unchanged
        R[i:k, i:k] = np.triu(Tb)
    # 2. Move unselected column j to the first unselected position and zero it below row k.
    if j != 0:
        order = k + np.r_[j, 0:j]
        R[:, k : k + j + 1] = R[:, order]
        perm[k : k + j + 1] = perm[order]
        U[:, : j + 1] = U[:, order - k]
    x = R[k:, k]
    if x.shape[0] > 1 and np.any(x[1:] != 0.0):
        norm = float(np.linalg.norm(x))
        alpha_h = -math.copysign(norm, x[0])
        v = x.copy()
        v[0] -= alpha_h
        C = R[k:, k:]
        C -= np.outer(v * (2.0 / float(v @ v)), v @ C)
        R[k + 1 :, k] = 0.0
        R[k, k] = alpha_h
    # 3. Swap columns k-1 and k; one Givens rotation on rows k-1, k restores the triangle.
    alpha = R[k - 1, k - 1]
    beta = R[k - 1, k]
    gamma = R[k, k]
    abar2 = beta * beta + gamma * gamma
    abar = math.sqrt(abar2)
    b2 = R[k - 1, k + 1 :].copy()
    c2 = R[k, k + 1 :].copy()
    if k > 1:
        u = sla.solve_triangular(R[: k - 1, : k - 1], R[: k - 1, k - 1], check_finite=False)  # A1^{-1} a
        u1 = U[: k - 1, 0]
        ub = u1 + u * (beta / alpha)  # A1^{-1} b
        bc = (beta * b2 + gamma * c2) / abar2
        U[: k - 1, 1:] += np.outer(u, b2 / alpha) - np.outer(ub, bc)
        w2[: k - 1] += ub * ub / abar2 - u * u / (alpha * alpha)
        U[: k - 1, 0] = u - ub * (beta * alpha / abar2)
    else:
        bc = (beta * b2 + gamma * c2) / abar2
    U[k - 1, 0] = beta * alpha / abar2
    U[k - 1, 1:] = bc
    w2[k - 1] = 1.0 / abar2
    R[:, [k - 1, k]] = R[:, [k, k - 1]]
    perm[[k - 1, k]] = perm[[k, k - 1]]
    rows = R[k - 1 : k + 1, k - 1 :]
    cs, sn = beta / abar, gamma / abar
    top = cs * rows[0] + sn * rows[1]
    bot = -sn * rows[0] + cs * rows[1]
    rows[0] = top
    rows[1] = bot
    R[k - 1, k - 1] = abar
    R[k, k - 1] = 0.0
    return np.einsum("ij,ij->j", R[k:, k:], R[k:, k:])


def _omega(A: np.ndarray, w2: np.ndarray | None, floor: float) -> np.ndarray:
    """Distances of each column of A to the span of the others: ``1 / ||row i of A^{-1}||``.

    Uses the swap loop's final ``1/omega^2`` when available; otherwise (rank-deficient selection, or
    no swap loop ran) computes it from the SVD of A with singular values floored at ``floor`` so that
    numerically dependent columns get noise-level (not infinite / NaN) values.
    """
    if w2 is not None:
        return 1.0 / np.sqrt(w2)
    k = A.shape[0]
    scale = float(np.abs(A).max(initial=0.0))
    if scale == 0.0 or floor <= 0.0:
        return np.zeros(k)  # M = 0: every column is at distance 0 from the others
    d = np.abs(np.diagonal(A))
    if d.min() > floor:
        Ainv, info = lapack.dtrtri(A, lower=0)
        if info == 0 and np.isfinite(Ainv).all():
            return 1.0 / np.sqrt(np.einsum("ij,ij->i", Ainv, Ainv))
    # scale-free SVD route: omega(A) = scale * omega(A / scale)
    _, s, Vt = np.linalg.svd(A / scale)
    s = np.maximum(s, floor / scale)
    return scale / np.linalg.norm(Vt / s[:, None], axis=0)
