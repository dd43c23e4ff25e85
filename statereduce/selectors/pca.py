"""``pca`` and ``pca-adv``: a semi-orthogonal transform per head from the calibration activations (paper App. B.3-B.5,
C.6, Table 15).

Not an axis-aligned selection: the head's keys and queries become ``T k`` and ``T q`` with ``T`` [d_k', d_k] the
principal directions of the calibration activations, which Proposition 3.1 allows for the recurrence (the same
orthogonal map on keys and queries leaves ``q^T S`` unchanged) but the per-channel short convolutions do not. Pruning
absorbs ``T`` into the q/k projection rows and mixes the conv filters (:func:`statereduce.slicing.mix_filters`, App.
B.4), or carries them over exactly where they are shared across the head's channels (App. B.5).

``pca`` keeps the d_k' directions of largest second moment ("PCA (prop.)"), ``pca-adv`` those of smallest
("PCA (adv.)", the adversarial baseline that keeps the noise). Directions come from the uncentered second moment
``C = K^T K + Q^T Q`` of the activations as they enter the recurrence (``K^T K`` or ``Q^T Q`` alone for the -k / -q
variants, App. C.7): the state accumulates keys without centering, and for the -k variant the kept keys' rank
utilization does not fall, ``u(K T^T) >= u(K)`` (App. F.2).
"""

from __future__ import annotations

import numpy as np

from statereduce.selectors.registry import HeadData, HeadSelection, register_selector, require


def principal_directions(data: HeadData, variant: str, selector: str) -> tuple[np.ndarray, np.ndarray]:
    """Eigenvalues (descending) and eigenvectors (rows, same order) of the head's second-moment matrix.

    Each eigenvector's sign is fixed so that its largest-magnitude entry is positive (deterministic output)."""
    acts = require(data, selector, variant, {"k": "K", "q": "Q"})
    d_k = data.d_k
    c = np.zeros((d_k, d_k))
    for side, a in acts.items():
        if a.ndim != 2 or a.shape[1] != d_k:
            raise ValueError(f"{side.upper()} must be [N, d_k={d_k}], got shape {a.shape}")
        if not np.isfinite(a).all():
            raise ValueError(f"non-finite calibration {side.upper()} activations")
        c += a.T @ a
    vals, vecs = np.linalg.eigh(c)  # ascending
    order = np.argsort(-vals, kind="stable")
    vals, rows = vals[order], vecs[:, order].T
    pivot = np.abs(rows).argmax(axis=1)
    rows *= np.sign(rows[np.arange(d_k), pivot])[:, None]
    return vals, rows


@register_selector("pca", needs={"activations"}, kind="transform")
def pca(data: HeadData, n_keep: int, *, variant: str = "kq", rng: np.random.Generator) -> HeadSelection:
    """Keep the d_k' principal directions of largest second moment ("PCA (prop.)", paper Table 15).

    Args:
        data: needs ``K`` and/or ``Q`` ([N, d_k]) depending on the variant.
        n_keep: d_k', directions kept.
        variant: "kq" (``K^T K + Q^T Q``), "k" or "q".
        rng: unused (deterministic).

    Returns:
        A transform selection: ``T`` = the top d_k' eigenvectors as rows; scores: their eigenvalues.
    """
    vals, rows = principal_directions(data, variant, "pca")
    return HeadSelection(keep=None, scores=vals[:n_keep], transform=rows[:n_keep])


@register_selector("pca-adv", needs={"activations"}, kind="transform")
def pca_adv(data: HeadData, n_keep: int, *, variant: str = "kq", rng: np.random.Generator) -> HeadSelection:
    """Keep the d_k' principal directions of smallest second moment ("PCA (adv.)", the adversarial baseline of
    paper Table 15: it removes the highest-variance components and keeps the noise).

    Args, returns: as :func:`pca`, with the bottom d_k' eigenvectors (smallest first).
    """
    vals, rows = principal_directions(data, variant, "pca-adv")
    return HeadSelection(keep=None, scores=vals[::-1][:n_keep], transform=rows[::-1][:n_keep])
