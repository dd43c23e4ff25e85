"""``drrqr``: strong rank-revealing QR column selection on calibration activations (paper Sec. 3.4, App. B.2).

M = [K_cal; Q_cal] (2N x d_k, keys and queries as they enter the recurrence); the kept channels are the
first d_k' pivots of a strong RRQR (Gu & Eisenstat 1996) of M, started from column-pivoted QR. The
selected columns keep every singular value of M up to the factor ``sqrt(1 + f^2 k (n - k))``
(see :mod:`statereduce.selectors.rrqr`). Variant "k" ("q") factors K_cal (Q_cal) alone (paper Table 16).
"""

from __future__ import annotations

import numpy as np

from statereduce.selectors.rrqr import DEFAULT_F, strong_rrqr
from statereduce.selectors.registry import HeadData, HeadSelection, register_objective, register_selector, require


@register_selector("drrqr", needs={"activations"})
def drrqr(
    data: HeadData,
    n_keep: int,
    *,
    variant: str = "kq",
    rng: np.random.Generator,
    f: float = DEFAULT_F,
    reduction: str = "auto",
    rtol: float | None = None,
) -> HeadSelection:
    """Keep the first ``n_keep`` strong-RRQR pivots of ``[K; Q]`` (or K / Q alone).

    Scores: for each kept channel, ``omega_i = 1 / ||row i of A_k^{-1}||``, its distance to the span of
    the other kept channels on the calibration data (how irreplaceable it is within the kept set).

    Args:
        data: needs ``K`` and/or ``Q`` ([N, d_k]) depending on the variant.
        n_keep: channels to keep.
        variant: "kq" (M = [K; Q]), "k" (M = K) or "q" (M = Q).
        rng: unused (deterministic).
        f: Gu-Eisenstat swap tolerance (> 1); see :data:`statereduce.selectors.rrqr.DEFAULT_F`.
        reduction: "auto", "gram" or "qr"; see :func:`statereduce.selectors.rrqr.strong_rrqr`.
        rtol: numerical-rank tolerance; see :func:`statereduce.selectors.rrqr.strong_rrqr`.
    """
    mats = _blocks(data, variant)
    res = strong_rrqr(mats, n_keep, f, reduction=reduction, rtol=rtol)  # row blocks: M = [K; Q] without a copy
    order = np.argsort(res.selected, kind="stable")
    return HeadSelection(keep=res.selected[order].astype(np.int64), scores=res.omega[order])


@register_objective("drrqr")
def captured_energy(data: HeadData, widths: list[int], *, variant: str = "kq", rng: np.random.Generator,
                    f: float = DEFAULT_F, reduction: str = "auto", rtol: float | None = None) -> dict[int, float]:
    """DRRQR's objective at each width: the share of ``||M||_F^2`` that the span of its kept columns captures,
    ``trace(G[:, S] G[S, S]^+ G[S, :]) / trace(G)`` with ``G = M^T M`` and S the strong-RRQR selection of that width
    (the greedy per-layer budget, :mod:`statereduce.budgets`). 1.0 at full width; 0 for an all-zero M."""
    mats = _blocks(data, variant)
    G = sum(np.asarray(m, dtype=np.float64).T @ np.asarray(m, dtype=np.float64) for m in mats)
    total = float(np.trace(G))
    out = {}
    for w in widths:
        if w >= G.shape[0] or total <= 0.0:
            out[int(w)] = 1.0 if w >= G.shape[0] else 0.0
            continue
        S = np.sort(strong_rrqr(mats, int(w), f, reduction=reduction, rtol=rtol).selected)
        GS = G[:, S]
        out[int(w)] = min(1.0, float(np.trace(GS @ np.linalg.pinv(G[np.ix_(S, S)], hermitian=True) @ GS.T)) / total)
    return out


def _blocks(data: HeadData, variant: str) -> list[np.ndarray]:
    """The row blocks of M: [K, Q], [K] or [Q] ([N, d_k] each), checked."""
    sides = "kq" if variant == "kq" else variant
    fields = {"k": "K", "q": "Q"}
    mats = []
    d_k = data.d_k
    for side in sides:
        value = getattr(data, fields[side])
        if value is None:
            require(data, "drrqr", variant, fields)  # raises the one-line error
        arr = np.asarray(value)
        if arr.ndim != 2 or arr.shape[1] != d_k or arr.shape[0] == 0:
            raise ValueError(f"{fields[side]} must be [N, d_k={d_k}] with N >= 1, got shape {arr.shape}")
        mats.append(arr)
    return mats
