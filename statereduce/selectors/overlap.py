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

    For each head that keeps ``k_a`` channels in A and ``k_b`` in B, ``shared = |A ∩ B|`` and ``fraction = shared /
    min(k_a, k_b)`` (the most the two can share). Two independent uniformly random subsets of d_k channels of sizes
    ``k_a`` and ``k_b`` share ``k_a k_b / d_k`` in expectation (hypergeometric mean), a fraction ``max(k_a, k_b) /
    d_k``; with one width d_k' everywhere, d_k'^2 / d_k and d_k' / d_k. Each layer may keep its own width (per-layer
    budgets), and the two selections may keep different widths in a layer (budgets from each selector's own
    values); within one selection every head of a layer keeps the same number.

    Args:
        keep_a, keep_b: per-head kept indices [H][d_k'] of one layer, or {layer: [H][d_k'(layer)]} (as
            :func:`~statereduce.core.selection_file.read_selection` returns); both must cover the same layers and heads.
        d_k: channels per head before pruning.
    Returns:
        {"per_head": {(layer, head): {"shared", "fraction", "random_shared", "random_fraction"}}, "per_layer":
        {layer: {"d_k_new", "median_shared", "median_fraction", "random_shared", "random_fraction", "n_heads"}},
        "median_shared", "median_fraction", "random_shared", "random_fraction", "d_k", "d_k_new", "n_heads"}. The
        medians are over all heads; the top-level ``random_*`` are the medians of the heads' expectations (the
        expectation itself when every head keeps one width). ``d_k_new`` is that one width (an int) where every head
        of both selections keeps it, else {"<layer>": width}, the width a ``[k_a, k_b]`` pair where the two differ.
        A single layer is reported as layer 0.
    """
    if isinstance(d_k, bool) or not isinstance(d_k, (int, np.integer)) or d_k < 1:
        raise ValueError(f"d_k={d_k!r} is invalid; valid: a positive integer")
    a_layers, b_layers = as_layers(keep_a, "keep_a"), as_layers(keep_b, "keep_b")
    if set(a_layers) != set(b_layers):
        raise ValueError(f"keep_a and keep_b cover different layers: {sorted(a_layers)} vs {sorted(b_layers)}")
    per_head: dict[HeadKey, dict[str, float]] = {}
    widths: dict[int, tuple[int, int]] = {}
    for layer in sorted(a_layers):
        heads = len(a_layers[layer])
        if len(b_layers[layer]) != heads:
            raise ValueError(f"layer {layer}: keep_a has {heads} heads, keep_b {len(b_layers[layer])}")
        a = head_keep(a_layers[layer], heads, d_k, f"keep_a layer {layer}")
        b = head_keep(b_layers[layer], heads, d_k, f"keep_b layer {layer}")
        for name, sel in (("keep_a", a), ("keep_b", b)):
            sizes = sorted({int(idx.size) for idx in sel})
            if len(sizes) > 1:
                raise ValueError(f"{name} layer {layer} keeps different numbers of channels across heads: {sizes}")
        if heads:
            widths[layer] = (int(a[0].size), int(b[0].size))
        for head, (ia, ib) in enumerate(zip(a, b)):
            shared = int(np.intersect1d(ia, ib).size)
            per_head[(layer, head)] = {"shared": shared, "fraction": shared / min(ia.size, ib.size),
                                       "random_shared": ia.size * ib.size / d_k,
                                       "random_fraction": max(ia.size, ib.size) / d_k}
    per_layer = {layer: {"d_k_new": _width(pair),
                         **_medians([v for (lay, _), v in per_head.items() if lay == layer])}
                 for layer, pair in widths.items()}
    distinct = {w for pair in widths.values() for w in pair}
    return {
        "per_head": per_head,
        "per_layer": per_layer,
        **_medians(list(per_head.values())),
        "d_k": int(d_k),
        "d_k_new": (distinct.pop() if len(distinct) == 1 else 0 if not distinct
                    else {str(layer): _width(pair) for layer, pair in widths.items()}),
    }


def _width(pair: tuple[int, int]) -> int | list[int]:
    """A layer's kept width in both selections: one int, or [k_a, k_b] where they differ."""
    return pair[0] if pair[0] == pair[1] else list(pair)


def _medians(heads: list[dict[str, float]]) -> dict[str, float | int]:
    """The medians over ``heads`` of :func:`keep_overlap`'s per-head values (NaN for no head), and the head count."""

    def median(name: str) -> float:
        return float(np.median([v[name] for v in heads])) if heads else math.nan

    return {"median_shared": median("shared"), "median_fraction": median("fraction"),
            "random_shared": median("random_shared"), "random_fraction": median("random_fraction"),
            "n_heads": len(heads)}
