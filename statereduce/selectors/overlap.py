"""Comparing channel selections: how many kept channels two selections share per head, against chance (paper
App. C.2), and the per-head keep lists both the rank analysis and the tables read."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

HeadKey = tuple[int, int]  # (layer index, head index)

KeepSpec = Sequence[Sequence[int]] | np.ndarray  # per-head kept channel indices of one layer, [H][d_k']


def as_layers(x, name: str) -> dict[int, object]:
    """A per-layer mapping as is; a single layer's value as {0: value}."""
    if isinstance(x, Mapping):
        return dict(x)
    if x is None:
        raise ValueError(f"{name} is None; expected an array or a {{layer: array}} mapping")
    return {0: x}


def head_keep(keep: KeepSpec | None, num_heads: int, d_k: int, where: str) -> list[np.ndarray]:
    """Per head, the kept channel indices [d_k'] or, for a transform selection, the transform [d_k', d_k]."""
    if keep is None:
        return [np.arange(d_k)] * num_heads
    if len(keep) != num_heads:
        raise ValueError(f"{where}: keep has {len(keep)} heads, the activations have H={num_heads}")
    if np.asarray(keep[0]).ndim == 2:  # transforms
        out = [np.asarray(t, dtype=np.float64) for t in keep]
        if any(t.shape[1] != d_k for t in out):
            raise ValueError(f"{where}: transforms of shapes {[t.shape for t in out]} for d_k={d_k}")
        return out
    out = []
    for head, idx in enumerate(keep):
        idx = np.asarray(idx, dtype=np.int64).ravel()
        if idx.size == 0 or idx.min() < 0 or idx.max() >= d_k or np.unique(idx).size != idx.size:
            raise ValueError(
                f"{where} head {head}: keep={idx.tolist()} is invalid; valid: distinct indices in [0, d_k={d_k})"
            )
        out.append(idx)
    return out


def keep_overlap(keep_a, keep_b, d_k: int) -> dict:
    """Per-head overlap of two selections against the random expectation (paper App. C.2).

    For each head, ``shared = |A ∩ B|`` and ``fraction = shared / d_k'``. Two independent uniformly random
    d_k'-subsets of d_k channels share d_k'^2 / d_k channels in expectation (hypergeometric mean), a fraction
    d_k' / d_k.

    Args:
        keep_a, keep_b: per-head kept indices [H][d_k'] of one layer, or {layer: [H][d_k']} (as
            :func:`~statereduce.selection_file.read_selection` returns); both must cover the same heads with the same
            d_k'.
        d_k: channels per head before pruning.
    Returns:
        {"per_head": {(layer, head): {"shared", "fraction"}}, "median_shared", "median_fraction",
        "random_shared", "random_fraction", "d_k", "d_k_new", "n_heads"}; a single layer is reported as layer 0.
    """
    if isinstance(d_k, bool) or not isinstance(d_k, (int, np.integer)) or d_k < 1:
        raise ValueError(f"d_k={d_k!r} is invalid; valid: a positive integer")
    a_layers, b_layers = as_layers(keep_a, "keep_a"), as_layers(keep_b, "keep_b")
    if set(a_layers) != set(b_layers):
        raise ValueError(f"keep_a and keep_b cover different layers: {sorted(a_layers)} vs {sorted(b_layers)}")
    per_head: dict[HeadKey, dict[str, float]] = {}
    sizes = set()
    for layer in sorted(a_layers):
        heads = len(a_layers[layer])
        a = head_keep(a_layers[layer], heads, d_k, f"keep_a layer {layer}")
        b = head_keep(b_layers[layer], heads, d_k, f"keep_b layer {layer}")
        for head, (ia, ib) in enumerate(zip(a, b)):
            if ia.size != ib.size:
                raise ValueError(f"layer {layer} head {head}: keep_a keeps {ia.size} channels, keep_b {ib.size}")
            sizes.add(int(ia.size))
            shared = int(np.intersect1d(ia, ib).size)
            per_head[(layer, head)] = {"shared": shared, "fraction": shared / ia.size}
    if len(sizes) > 1:
        raise ValueError(f"selections keep different numbers of channels across heads: {sorted(sizes)}")
    d_k_new = sizes.pop() if sizes else 0
    return {
        "per_head": per_head,
        "median_shared": float(np.median([v["shared"] for v in per_head.values()])) if per_head else math.nan,
        "median_fraction": float(np.median([v["fraction"] for v in per_head.values()])) if per_head else math.nan,
        "random_shared": d_k_new**2 / d_k,
        "random_fraction": d_k_new / d_k,
        "d_k": int(d_k),
        "d_k_new": d_k_new,
        "n_heads": len(per_head),
    }
