"""Per-layer key budgets: how many key channels d_k'(layer) each layer keeps under a fixed total.

The uniform cut keeps ``n_keep_for(d_k, pct)`` channels in every head of every layer. A per-layer budget gives
each layer its own kept width ``w_i`` (the same for all heads of that layer) such that

* the heads-weighted total ``sum_i heads[i] * w_i`` equals the uniform cut's total at the same pct
  (:func:`uniform_total`), so the pruned model has the same state size;
* every width is allowed: at least a floor, a multiple of ``multiple`` (8 or 16 suit the GPU kernels) or the
  full ``d_k``, and at most ``d_k`` (:func:`candidate_widths`).

A *policy* scores every allowed width of every layer (higher is better): captured spectral energy
(:func:`spectrum_values`), the selector's own greedy gains (:func:`greedy_values`) or the measured loss increase
of cutting one layer alone (:func:`sensitivity_values`). :func:`allocate` then picks one width per layer that
meets the total exactly and maximizes the summed value, a multiple-choice knapsack solved exactly by dynamic
programming over the total. :class:`Allocation` records the result (with its policy and values) for a JSON
artifact.

:func:`check_budget` checks a configured budget (``statereduce.common.settings.BudgetSettings``) against a selector and
a model before any job runs, and :func:`read_allocation` reads the allocation artifact that rule ``allocate``
(:mod:`statereduce.stages.allocate`) writes.

NumPy only: no torch, no snakemake (selection jobs use it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from statereduce.common.settings import BudgetSettings
from statereduce.core.artifacts import ArtifactError, read_json_artifact, remedy
from statereduce.selectors.registry import get_selector, n_keep_for

#: Allocations whose summed value is within this relative tolerance of the optimum count as tied (the
#: tolerance is relative to ``sum_i max_w |values[i][w]|``); ties are broken toward the most uniform allocation.
TIE_RTOL = 1e-9
#: Spectrum policy modes (see :func:`spectrum_values`).
SPECTRUM_MODES = ("energy", "effective_rank")
#: Negative eigenvalues down to this fraction of the largest magnitude are rounding noise and count as zero.
EIG_NEG_RTOL = 1e-8


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_pos_int(x: Any, name: str) -> int:
    if not _is_int(x) or x < 1:
        raise ValueError(f"{name}={x!r} must be a positive integer")
    return int(x)


# ----------------------------------------------------------------------------------------------------
# Allowed widths and the uniform total


def candidate_widths(d_k: int, floor: int, multiple: int) -> list[int]:
    """The widths a layer may keep: multiples of ``multiple`` in ``[floor, d_k]``, plus ``d_k`` itself.

    Args:
        d_k: channels per head before pruning (>= 1).
        floor: the smallest width allowed, in ``[1, d_k]`` (need not be a multiple itself: the smallest
            candidate is then the first multiple above it).
        multiple: kept widths are multiples of this (>= 1; 8 or 16 suit the GPU kernels); ``d_k`` is always
            allowed even when it is not a multiple.

    Returns:
        The allowed widths, ascending, without duplicates; never empty (``d_k`` is always in it).
    """
    d_k = _check_pos_int(d_k, "d_k")
    multiple = _check_pos_int(multiple, "multiple")
    if not _is_int(floor) or not 1 <= floor <= d_k:
        raise ValueError(f"floor={floor!r} must be an integer in [1, d_k={d_k}]")
    first = -(-int(floor) // multiple) * multiple  # smallest multiple >= floor
    return sorted(set(range(first, d_k + 1, multiple)) | {d_k})


def uniform_total(d_k: int, n_layers: int, pct: float, heads: Sequence[int] | None = None) -> int:
    """The heads-weighted total of kept channels of the uniform cut at ``pct``.

    ``n_keep_for(d_k, pct) * sum(heads)``, with ``heads`` all 1 by default (then ``n_keep * n_layers``).

    Args:
        d_k: channels per head before pruning.
        n_layers: number of pruned layers (>= 1).
        pct: percent of channels removed, in (0, 100) (see :func:`statereduce.selectors.n_keep_for`).
        heads: heads per layer (``n_layers`` positive integers), or None for one per layer.
    """
    n_layers = _check_pos_int(n_layers, "n_layers")
    h = _check_heads(heads, n_layers)
    return n_keep_for(d_k, pct) * int(sum(h))


def _check_heads(heads: Sequence[int] | None, n_layers: int) -> list[int]:
    if heads is None:
        return [1] * n_layers
    try:
        h = list(heads)
    except TypeError:
        raise ValueError(f"heads={heads!r} must be a sequence of {n_layers} positive integers") from None
    if len(h) != n_layers:
        raise ValueError(f"heads has {len(h)} entries for {n_layers} layers; give one positive integer per layer")
    bad = [(i, x) for i, x in enumerate(h) if not _is_int(x) or x < 1]
    if bad:
        raise ValueError(f"heads[{bad[0][0]}]={bad[0][1]!r} must be a positive integer (heads of that layer)")
    return [int(x) for x in h]


# ----------------------------------------------------------------------------------------------------
# The allocator


def _check_values(values: Sequence[Mapping[int, float]]) -> list[tuple[list[int], list[float]]]:
    """Per layer (ascending widths, their values) as Python ints and floats; raises one-line ValueErrors."""
    if isinstance(values, (str, Mapping)) or not isinstance(values, Sequence) or len(values) == 0:
        kind = type(values).__name__
        raise ValueError(f"values must be a non-empty sequence of {{width: value}} mappings per layer, got {kind}")
    out = []
    for i, layer in enumerate(values):
        if not isinstance(layer, Mapping) or len(layer) == 0:
            raise ValueError(f"values[{i}] must be a non-empty {{width: value}} mapping, got {type(layer).__name__}")
        for w in layer:
            if not _is_int(w) or w < 1:
                raise ValueError(f"values[{i}] has width {w!r}; widths must be positive integers")
        widths = sorted(int(w) for w in layer)
        try:
            vals = [float(layer[w]) for w in widths]
        except (TypeError, ValueError):
            raise ValueError(f"values[{i}] has a non-numeric value; values must be finite numbers") from None
        bad = [w for w, v in zip(widths, vals) if not math.isfinite(v)]
        if bad:
            raise ValueError(f"values[{i}][{bad[0]}]={vals[widths.index(bad[0])]} is not finite; leave that width out")
        out.append((widths, vals))
    return out


def _bits(mask: np.ndarray) -> int:
    """A boolean array as a Python integer bitset (bit s set iff mask[s])."""
    return int.from_bytes(np.packbits(mask, bitorder="little").tobytes(), "little")


def _unreachable(total: int, reach: int, g: int, lo: int, hi: int) -> ValueError:
    near = []
    if total >= lo:
        below = reach & ((1 << (min(total, hi) // g + 1)) - 1)
        near.append(below.bit_length() - 1)
    if total <= hi:
        start = -(-max(total, lo) // g)
        above = reach >> start
        near.append(start + (above & -above).bit_length() - 1)
    nearest = ", ".join(str(t * g) for t in sorted(set(near)))
    grid = f"multiples of {g}, " if g > 1 else ""
    return ValueError(
        f"total={total!r} is not reachable: heads-weighted sums of the allowed widths lie in [{lo}, {hi}] "
        f"({grid}not every value between is reachable); nearest reachable total(s): {nearest}"
    )


def allocate(values: Sequence[Mapping[int, float]], total: int, *, heads: Sequence[int] | None = None) -> list[int]:
    """One width per layer meeting the heads-weighted total exactly, with the largest summed value.

    Solves ``max sum_i values[i][w_i]`` subject to ``sum_i heads[i] * w_i == total`` and ``w_i in values[i]``
    (a multiple-choice knapsack with an equality constraint) exactly by dynamic programming over the total.
    The objective is the plain sum of the layers' values: weight them by heads in ``values`` if that is wanted.

    Algorithm: all steps ``heads[i] * w`` and the total are first divided by their common divisor ``g`` (8 for
    widths that are multiples of 8), giving ``T = total / g`` states. A forward pass computes the best value of
    every partial total after each layer and a backward pass the best value of completing it; an edge (layer i
    takes width w from partial total s) lies on an optimal allocation iff forward + value + backward equals the
    optimum (within :data:`TIE_RTOL`), and every path made of such edges is optimal. Time ``O(L * C * T)`` and
    memory ``O(L * T)`` floats for L layers with C candidates each; the tie-break below runs on bitsets of
    those edges in ``O(U * L * C * T / 64)`` word operations (U distinct widths), negligible next to the DP.
    64 layers x 20 candidates x a total of 64 * 128 take a few tens of milliseconds.

    Ties (allocations within :data:`TIE_RTOL` of the optimum) are broken deterministically toward the most
    uniform allocation: the smallest spread ``max_i w_i - min_i w_i`` first, then the lexicographically smallest
    width list (earlier layers narrower).

    Args:
        values: per layer a ``{width: value}`` mapping of the widths the layer may keep (positive integers) and
            their finite values (higher is better, e.g. captured energy or minus a loss increase).
        total: the required heads-weighted total ``sum_i heads[i] * w_i``.
        heads: heads per layer (positive integers), or None for one per layer.

    Returns:
        The chosen width of each layer, as Python ints.

    Raises:
        ValueError: (one line) on malformed values or heads, or when no allocation meets ``total``; the message
            names the reachable range and the nearest reachable totals.
    """
    layers = _check_values(values)
    n = len(layers)
    h = _check_heads(heads, n)
    steps, T = _scaled_steps(layers, h, total)
    fwd, bwd = _dp_passes(layers, steps, T)
    return _most_uniform(_optimal_edges(layers, steps, fwd, bwd, T), T)


def _scaled_steps(layers: list[tuple[list[int], list[float]]], h: list[int], total: int) -> tuple[list[list[int]], int]:
    """:func:`allocate`'s steps ``heads[i] * w`` and ``total`` divided by their common divisor ``g``.

    Returns:
        ``(scaled steps per layer, T = total / g)``.
    Raises:
        ValueError: (one line) ``total`` is not an integer, or no allocation meets it (:func:`_unreachable`).
    """
    if not _is_int(total):
        raise ValueError(f"total={total!r} must be an integer (heads-weighted number of kept channels)")
    total = int(total)
    raw_steps = [[h[i] * w for w in widths] for i, (widths, _) in enumerate(layers)]
    g = math.gcd(*(s for steps in raw_steps for s in steps))
    steps = [[s // g for s in st] for st in raw_steps]
    lo = sum(st[0] for st in raw_steps)
    hi = sum(st[-1] for st in raw_steps)
    reach = 1  # bit t: a scaled total t is reachable by the layers so far
    for st in steps:
        reach = _shift_or(reach, st)
    if total % g or not lo <= total <= hi or not (reach >> (total // g)) & 1:
        raise _unreachable(total, reach, g, lo, hi)
    return steps, total // g


def _dp_passes(layers: list[tuple[list[int], list[float]]], steps: list[list[int]],
               T: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`allocate`'s forward and backward passes over the scaled partial totals ``0..T``: ``fwd[i, s]`` the best
    value of layers ``< i`` summing to ``s``, ``bwd[i, s]`` the best value of layers ``>= i`` completing ``s`` to
    ``T`` (``-inf`` where none does); both ``[L + 1, T + 1]``."""
    n = len(layers)
    fwd = np.full((n + 1, T + 1), -np.inf)
    bwd = np.full((n + 1, T + 1), -np.inf)
    fwd[0, 0] = 0.0
    bwd[n, T] = 0.0
    for i, (_, vals) in enumerate(layers):
        for s, v in zip(steps[i], vals):
            if s > T:
                break
            np.maximum(fwd[i + 1, s:], fwd[i, : T + 1 - s] + v, out=fwd[i + 1, s:])
    for i in range(n - 1, -1, -1):
        for s, v in zip(steps[i], layers[i][1]):
            if s > T:
                break
            np.maximum(bwd[i, : T + 1 - s], bwd[i + 1, s:] + v, out=bwd[i, : T + 1 - s])
    return fwd, bwd


def _optimal_edges(layers: list[tuple[list[int], list[float]]], steps: list[list[int]], fwd: np.ndarray,
                   bwd: np.ndarray, T: int) -> list[list[tuple[int, int, int]]]:
    """The edges on optimal allocations (forward + value + backward within :data:`TIE_RTOL` of the optimum), per
    layer as (width, scaled step, bitset of the partial totals s they leave)."""
    best = float(fwd[len(layers), T])
    threshold = best - TIE_RTOL * sum(max(abs(v) for v in vals) for _, vals in layers)
    edges: list[list[tuple[int, int, int]]] = []
    for i, (widths, vals) in enumerate(layers):
        row = []
        for w, s, v in zip(widths, steps[i], vals):
            if s > T:
                break
            mask = fwd[i, : T + 1 - s] + v + bwd[i + 1, s:] >= threshold
            if mask.any():
                row.append((w, s, _bits(mask)))
        edges.append(row)
    return edges


def _shift_or(reach: int, steps: Sequence[int]) -> int:
    out = 0
    for s in steps:
        out |= reach << s
    return out


def _feasible(edges: list[list[tuple[int, int, int]]], T: int, lo: int, hi: int) -> bool:
    """Whether some optimal allocation uses only widths in [lo, hi]."""
    reach = 1
    for row in edges:
        nxt = 0
        for w, s, mask in row:
            if lo <= w <= hi:
                nxt |= (reach & mask) << s
        if not nxt:
            return False
        reach = nxt
    return bool((reach >> T) & 1)


def _lex_smallest(edges: list[list[tuple[int, int, int]]], T: int, lo: int, hi: int) -> list[int]:
    """The lexicographically smallest optimal allocation with widths in [lo, hi] (which must be feasible)."""
    n = len(edges)
    co = [0] * (n + 1)  # co[i] bit s: layers i.. can complete partial total s to T within the window
    co[n] = 1 << T
    for i in range(n - 1, -1, -1):
        acc = 0
        for w, s, mask in edges[i]:
            if lo <= w <= hi:
                acc |= (co[i + 1] >> s) & mask
        co[i] = acc
    out, t = [], 0
    for i, row in enumerate(edges):
        for w, s, mask in row:  # ascending widths
            if lo <= w <= hi and (mask >> t) & 1 and (co[i + 1] >> (t + s)) & 1:
                out.append(w)
                t += s
                break
        else:  # pragma: no cover - the window was checked feasible
            raise AssertionError(f"no optimal width for layer {i} in window [{lo}, {hi}]")
    return out


def _most_uniform(edges: list[list[tuple[int, int, int]]], T: int) -> list[int]:
    """Among the optimal allocations (paths of ``edges``): smallest spread, then lexicographically smallest."""
    widths = sorted({w for row in edges for w, _, _ in row})
    # Two pointers: for each lower bound widths[a], the smallest upper bound widths[b] that still admits an
    # optimal allocation; that b never decreases as a grows, so at most 2 U feasibility checks.
    spread, starts, b = None, [], 0
    for a in range(len(widths)):
        b = max(b, a)
        while b < len(widths) and not _feasible(edges, T, widths[a], widths[b]):
            b += 1
        if b == len(widths):
            break
        d = widths[b] - widths[a]
        if spread is None or d < spread:
            spread, starts = d, [widths[a]]
        elif d == spread:
            starts.append(widths[a])
    assert spread is not None  # the unrestricted window is feasible
    return min(_lex_smallest(edges, T, lo, lo + spread) for lo in starts)


# ----------------------------------------------------------------------------------------------------
# Policy values


def _check_widths(widths: Sequence[int], limit: int, where: str) -> list[int]:
    try:
        ws = list(widths)
    except TypeError:
        raise ValueError(f"widths={widths!r} must be a sequence of positive integers") from None
    if not ws:
        raise ValueError("widths is empty; give the candidate widths (see candidate_widths)")
    for w in ws:
        if not _is_int(w) or not 1 <= w <= limit:
            raise ValueError(f"width {w!r} is invalid for {where}; valid: integers in [1, {limit}]")
    return sorted({int(w) for w in ws})


def _layer_array(x: Any, i: int, name: str) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != 1 or a.size == 0:
        raise ValueError(f"{name}[{i}] must be a non-empty 1-D array, got shape {a.shape}")
    if not np.isfinite(a).all():
        raise ValueError(f"{name}[{i}] has non-finite entries at {np.flatnonzero(~np.isfinite(a))[:5].tolist()}")
    return a


def _check_layers(x: Any, name: str) -> list:
    if isinstance(x, np.ndarray) and x.ndim == 2:
        return list(x)
    if isinstance(x, (str, Mapping)) or not isinstance(x, Sequence) or len(x) == 0:
        raise ValueError(f"{name} must be a non-empty sequence with one entry per layer, got {type(x).__name__}")
    return list(x)


def spectrum_values(
    eigenvalues: Sequence[np.ndarray], widths: Sequence[int], mode: str = "energy"
) -> list[dict[int, float]]:
    """Per-layer values from the spectrum of the layer's K/Q second moment.

    Let ``lam`` be a layer's eigenvalues (any order; tiny negative ones, down to :data:`EIG_NEG_RTOL` of the
    largest magnitude, are rounding noise and count as 0) and ``n = len(lam)`` (the layer's d_k).

    * ``mode="energy"``: the value of width w is the captured energy fraction ``sum(w largest lam) / sum(lam)``:
      non-decreasing in w, concave (the increments are the sorted eigenvalues) and exactly 1.0 at ``w = n``. It
      is what a rank-w projection (pca) keeps, an upper bound for an index selection.
    * ``mode="effective_rank"``: with ``p = lam / sum(lam)`` and the effective rank
      ``erank = exp(-sum_j p_j log p_j)`` (``0 log 0 = 0``; 1 for a rank-one spectrum, n for a flat one), the
      value of w is ``min(w, erank) / n``: every channel up to the layer's effective rank is worth the same
      ``1 / n`` in every layer, channels beyond it are worth nothing. The optimum thus never gives a layer much
      more than its effective rank while others are below theirs, and the tie-break of :func:`allocate` (most
      uniform) spreads the remaining channels evenly (water filling). Dividing by ``erank`` instead would make a
      channel of a low-rank layer worth more than one of a high-rank layer and starve the high-rank layers.

    Args:
        eigenvalues: per layer a 1-D array of the eigenvalues (e.g. summed over the layer's heads).
        widths: the candidate widths (the same for every layer), each in ``[1, n]``.
        mode: "energy" or "effective_rank".

    Returns:
        Per layer ``{width: value}`` for :func:`allocate`.
    """
    if mode not in SPECTRUM_MODES:
        raise ValueError(f"mode={mode!r} is unknown; valid: {', '.join(SPECTRUM_MODES)}")
    out = []
    for i, eigs in enumerate(_check_layers(eigenvalues, "eigenvalues")):
        lam = _layer_array(eigs, i, "eigenvalues")
        scale = float(np.abs(lam).max())
        if lam.min() < -EIG_NEG_RTOL * scale:
            raise ValueError(
                f"eigenvalues[{i}] has {lam.min():.3g} < 0; a second moment is positive semi-definite "
                f"(valid: >= -{EIG_NEG_RTOL:g} x the largest)"
            )
        lam = np.sort(np.clip(lam, 0.0, None))[::-1]
        if lam[0] <= 0.0:
            raise ValueError(f"eigenvalues[{i}] are all zero: the layer has no energy to rank widths by")
        ws = _check_widths(widths, lam.size, f"eigenvalues[{i}] of length {lam.size}")
        if mode == "energy":
            cum = np.cumsum(lam)
            out.append({w: float(cum[w - 1] / cum[-1]) for w in ws})
        else:
            out.append({w: min(float(w), effective_rank(lam)) / lam.size for w in ws})
    return out


def effective_rank(eigenvalues: np.ndarray) -> float:
    """``exp(-sum_j p_j log p_j)`` with ``p = lam / sum(lam)`` over the positive eigenvalues (1 for a rank-one
    spectrum, n for a flat one of n)."""
    lam = np.asarray(eigenvalues, dtype=np.float64)
    p = lam[lam > 0.0] / lam[lam > 0.0].sum()
    return float(np.exp(-np.sum(p * np.log(p))))


def greedy_values(
    marginal_gains: Sequence[np.ndarray], widths: Sequence[int], *, normalize: bool = True
) -> list[dict[int, float]]:
    """Per-layer values from the selector's own per-channel gains, in the order it keeps channels.

    The value of width w is the sum of the first w gains (e.g. DRRQR's squared residual norms per pivot, or
    Grad's scores sorted descending): what the selector itself would capture with w channels. Gains must add
    up meaningfully (pass squared norms for energies).

    Normalization (``normalize=True``, the default): each layer's values are divided by the sum of all its
    gains, so the value is the fraction of the layer's own total captured (exactly 1.0 at full width) and
    layers whose gains have different scales are comparable; this needs a positive total per layer. With
    ``normalize=False`` the raw cumulative sums are used (only meaningful when gains share a scale across layers).

    Args:
        marginal_gains: per layer a 1-D array of the per-channel gains in keep order (length d_k).
        widths: the candidate widths (the same for every layer), each in ``[1, len(gains)]``.
        normalize: divide each layer's cumulative gains by the layer's total gain.

    Returns:
        Per layer ``{width: value}`` for :func:`allocate`.
    """
    out = []
    for i, gains in enumerate(_check_layers(marginal_gains, "marginal_gains")):
        g = _layer_array(gains, i, "marginal_gains")
        ws = _check_widths(widths, g.size, f"marginal_gains[{i}] of length {g.size}")
        cum = np.cumsum(g)
        if normalize:
            if not cum[-1] > 0.0:
                raise ValueError(
                    f"marginal_gains[{i}] sum to {cum[-1]:.3g}; normalize=True needs a positive total "
                    "(or pass normalize=False)"
                )
            cum = cum / cum[-1]
        out.append({w: float(cum[w - 1]) for w in ws})
    return out


def sensitivity_values(losses: Sequence[Mapping[int, float]], *, d_k: int | None = None) -> list[dict[int, float]]:
    """Per-layer values from measured calibration losses when only that layer is cut.

    The value of width w is ``-(loss[w] - loss[d_k])``: minus the loss increase of cutting the layer alone to w
    (0 at full width, negative where cutting hurts; measurement noise may make it slightly positive).

    Args:
        losses: per layer ``{width: loss}`` for the measured widths; each must include the full width.
        d_k: the full width; None takes each layer's largest measured width as its full width.

    Returns:
        Per layer ``{width: value}`` for :func:`allocate` (the measured widths).
    """
    out = []
    for i, layer in enumerate(_check_layers(losses, "losses")):
        if not isinstance(layer, Mapping) or not layer:
            raise ValueError(f"losses[{i}] must be a non-empty {{width: loss}} mapping, got {type(layer).__name__}")
        for w in layer:
            if not _is_int(w) or w < 1:
                raise ValueError(f"losses[{i}] has width {w!r}; widths must be positive integers")
        full = max(layer) if d_k is None else _check_pos_int(d_k, "d_k")
        if full not in layer:
            raise ValueError(f"losses[{i}] lacks the full width d_k={full}; measured widths: {sorted(layer)}")
        vals = {int(w): float(loss) for w, loss in layer.items()}
        bad = [w for w, v in vals.items() if not math.isfinite(v)]
        if bad:
            raise ValueError(f"losses[{i}][{bad[0]}]={layer[bad[0]]!r} is not finite")
        out.append({w: vals[full] - v for w, v in sorted(vals.items())})  # -(loss[w] - loss[d_k]), +0.0 at d_k
    return out


# ----------------------------------------------------------------------------------------------------
# The recorded result


@dataclass(frozen=True)
class Allocation:
    """A per-layer key budget and how it was chosen (written as a JSON artifact).

    Attributes:
        widths: kept width of each layer (the same for all heads of the layer).
        total: the heads-weighted total ``sum_i heads[i] * widths[i]`` the allocation meets.
        policy: the policy that scored the widths (e.g. "uniform", "energy", "effective_rank", "greedy",
            "sensitivity").
        values: per layer the policy's values at the candidate widths, ascending by width, or None.
        candidates: per layer the candidate widths ``values`` refers to (ascending), or None.
    """

    widths: tuple[int, ...]
    total: int
    policy: str
    values: tuple[tuple[float, ...], ...] | None = None
    candidates: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        widths = tuple(self.widths)
        if not widths or any(not _is_int(w) or w < 1 for w in widths):
            raise ValueError(f"widths={self.widths!r} must be a non-empty sequence of positive integers")
        object.__setattr__(self, "widths", tuple(int(w) for w in widths))
        if not _is_int(self.total) or self.total < 1:
            raise ValueError(f"total={self.total!r} must be a positive integer")
        object.__setattr__(self, "total", int(self.total))
        if not isinstance(self.policy, str) or not self.policy:
            raise ValueError(f"policy={self.policy!r} must be a non-empty string naming the policy")
        for name, cast in (("values", float), ("candidates", int)):
            rows = getattr(self, name)
            if rows is None:
                continue
            rows = tuple(tuple(cast(x) for x in row) for row in rows)
            if len(rows) != len(widths):
                raise ValueError(f"{name} has {len(rows)} layers, widths has {len(widths)}; give one row per layer")
            object.__setattr__(self, name, rows)
        if self.candidates is not None:
            if self.values is not None and any(len(c) != len(v) for c, v in zip(self.candidates, self.values)):
                raise ValueError("values and candidates disagree on the number of widths of some layer")
            bad = [i for i, (w, c) in enumerate(zip(self.widths, self.candidates)) if w not in c]
            if bad:
                raise ValueError(f"widths[{bad[0]}]={self.widths[bad[0]]} is not among candidates[{bad[0]}]")

    @classmethod
    def solve(
        cls, values: Sequence[Mapping[int, float]], total: int, policy: str, *, heads: Sequence[int] | None = None
    ) -> Allocation:
        """Run :func:`allocate` and record the result together with the values and candidate widths."""
        widths = allocate(values, total, heads=heads)
        cand = tuple(tuple(sorted(int(w) for w in layer)) for layer in values)
        vals = tuple(tuple(float(layer[w]) for w in c) for layer, c in zip(values, cand))
        return cls(widths=tuple(widths), total=int(total), policy=policy, values=vals, candidates=cand)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (lists, ints, floats, None)."""
        return {
            "widths": list(self.widths),
            "total": self.total,
            "policy": self.policy,
            "values": None if self.values is None else [list(row) for row in self.values],
            "candidates": None if self.candidates is None else [list(row) for row in self.candidates],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Allocation:
        """The inverse of :meth:`to_dict`."""
        missing = [k for k in ("widths", "total", "policy") if k not in d]
        if missing:
            raise ValueError(f"allocation dict lacks {missing}; expected widths, total, policy[, values, candidates]")
        return cls(
            widths=tuple(d["widths"]),
            total=d["total"],
            policy=d["policy"],
            values=d.get("values"),
            candidates=d.get("candidates"),
        )


# ----------------------------------------------------------------------------------------------------
# Budgets of the workflow: checks before any job, and the allocation artifact

#: Version of the allocation artifact's layout (:mod:`statereduce.stages.allocate` writes it).
ALLOCATION_FORMAT = 1


def allowed_widths(d_k: int, settings: BudgetSettings, check_width=None, *, nonempty: bool = False) -> list[int]:
    """The widths a layer may keep under ``settings`` (floor, multiple, full d_k), less those ``check_width`` refuses
    (a callable raising ValueError for a width the family's config cannot express); with ``nonempty`` a one-line
    ValueError where none is left."""
    if settings.floor > d_k:
        raise ValueError(f"budget floor={settings.floor} exceeds d_k={d_k}; valid: a floor in [1, {d_k}]")
    widths = candidate_widths(d_k, settings.floor, settings.multiple)
    if settings.powers_of_two:
        widths = [w for w in widths if w == d_k or w & (w - 1) == 0]
    ok = []
    for w in widths:
        try:
            if check_width is not None:
                check_width(w)
        except ValueError:
            continue
        ok.append(w)
    if nonempty and not ok:
        raise ValueError(f"budget floor={settings.floor}, multiple={settings.multiple} leave no width the model can "
                         f"keep at d_k={d_k}")
    return ok


def policy_needs(settings: BudgetSettings, selector: str) -> set[str]:
    """What a budget's policy reads (selector ``needs``): nothing for ``uniform``, the calibration activations for
    ``spectrum``, the selector's own inputs for ``greedy`` and ``sensitivity`` (which run the selector)."""
    if settings.policy == "spectrum":
        return {"activations"}
    if settings.policy in ("greedy", "sensitivity"):
        return set(get_selector(selector).needs)
    return set()


def check_budget_selector(settings: BudgetSettings, selector: str) -> None:
    """Raise a one-line ValueError unless ``selector`` can take the budget: an index selector (not a transform one),
    with channel scores or an objective for the greedy policy."""
    sel = get_selector(selector)
    if sel.kind != "index":
        raise ValueError(f"selector {selector!r} returns transforms; per-layer budgets apply to index selectors")
    if settings.policy == "greedy" and sel.objective is None and not sel.scores:
        raise ValueError(f"budget policy 'greedy' needs channel scores or an objective, and selector {selector!r} "
                         "has neither; valid: a spectrum, sensitivity or uniform budget")


def check_budget(settings: BudgetSettings, selector: str, *, d_k: int, n_layers: int, pct: float,
                 check_width=None) -> list[int]:
    """Check that a budget can run for a selector and model before any job; return the allowed widths.

    Raises:
        ValueError: one line: a transform selector (budgets keep a subset of channels per layer), the greedy policy
            for a selector without scores or objective, a floor above d_k, or a total the allowed widths cannot meet.
    """
    check_budget_selector(settings, selector)
    n_keep = n_keep_for(d_k, pct)
    if settings.policy == "uniform":
        return [n_keep]
    widths = allowed_widths(d_k, settings, check_width, nonempty=True)
    try:
        allocate([{w: 0.0 for w in widths}] * n_layers, n_keep * n_layers)
    except ValueError as e:
        raise ValueError(f"pct {pct}: the uniform cut keeps {n_keep} of {d_k} channels in each of {n_layers} layers; "
                         f"with widths {widths}: {e}") from None
    return widths


def read_allocation(path: str | Path, expect: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Read an allocation artifact, checked against the reading job (model, family, method, pct) and itself
    (the widths meet its total).

    Raises:
        ArtifactError: one line naming the file and the rule that rebuilds it.
    """
    doc = read_json_artifact(path, "allocation", ALLOCATION_FORMAT, "key_dims", expect)
    widths = {int(k): int(v) for k, v in doc["key_dims"].items()}
    if sum(widths.values()) != doc["uniform_width"] * len(widths):
        raise ArtifactError(f"{path}: widths {widths} do not add up to the uniform total "
                            f"{doc['uniform_width']} x {len(widths)}; {remedy(path)}")
    return doc


# ----------------------------------------------------------------------------------------------------
# Joint budgets (policy ``joint``): each layer its own (d_k', d_v') at the pct's total state

#: How far (a fraction of it) a joint budget's total state may be from the pct's total state.
JOINT_TOLERANCE = 0.01


def joint_bounds(d_k: int, d_v: int, pct: float, n_layers: int) -> tuple[float, int, int]:
    """The pct's total state of ``n_layers`` layers per head, ``n_layers (1 - pct/100) d_k d_v``, and the least and
    most total ``sum_l d_k'(l) d_v'(l)`` a joint budget may keep: within :data:`JOINT_TOLERANCE` of it.

    The pct's total is the uniform key-only (or value-only) cut's wherever ``d_k pct/100`` is whole (64 channels at
    50% or 75%); every linear-attention layer has the same heads, so the bounds hold for the heads-weighted total too.
    """
    n_layers = _check_pos_int(n_layers, "n_layers")
    if not 0 < pct < 100:
        raise ValueError(f"pct={pct!r} is invalid for a joint budget; valid: a percent of the state in (0, 100)")
    target = n_layers * (1 - pct / 100) * d_k * d_v
    lo = math.ceil(round(target * (1 - JOINT_TOLERANCE), 6))
    return target, lo, math.floor(round(target * (1 + JOINT_TOLERANCE), 6))


def joint_pairs(d_k: int, d_v: int, settings: BudgetSettings, check=None,
                extra: Sequence[tuple[int, int]] = ()) -> list[tuple[int, int]]:
    """The (d_k', d_v') pairs a layer may keep under a joint budget, ascending: every key width of
    :func:`allowed_widths` (``floor``, ``multiple``, ``powers_of_two``, the full d_k) with every value width of the same
    rule on d_v (the floor at most d_v), the whole layer (d_k, d_v) among them, and the pairs of ``extra`` (the
    uniform split candidates, :func:`statereduce.core.cuts.state_split_candidates`); less those ``check(d_k', d_v')``
    refuses by raising ValueError (a pair the family's config cannot hold)."""
    keys = allowed_widths(d_k, settings)
    values = allowed_widths(d_v, settings.replace(floor=min(settings.floor, d_v)))
    out = []
    for k, v in sorted({(k, v) for k in keys for v in values} | {(int(k), int(v)) for k, v in extra}):
        try:
            if check is not None and (k, v) != (d_k, d_v):
                check(k, v)
        except ValueError:
            continue
        out.append((k, v))
    return out


def joint_usable(pairs: Sequence[tuple[int, int]], n_layers: int, lo: int, hi: int) -> list[tuple[int, int]]:
    """The pairs of ``pairs`` (every layer's candidates) that lie on some choice of one pair per layer whose total
    state ``sum_l d_k' d_v'`` is in ``[lo, hi]``: the ones worth measuring (a pair too large for the others to make up
    for is left out)."""
    n_layers = _check_pos_int(n_layers, "n_layers")
    states = sorted({k * v for k, v in pairs})
    others = 1  # bit t: the other n_layers - 1 layers can keep a total t
    for _ in range(n_layers - 1):
        others = _shift_or(others, states)
    window = (1 << (hi - lo + 1)) - 1
    out = []
    for k, v in pairs:
        start = lo - k * v
        bits = (others >> start) & window if start >= 0 else (others & (window >> -start)) if hi >= k * v else 0
        if bits:
            out.append((k, v))
    return out


def joint_allocate(increases: Sequence[Mapping[tuple[int, int], float]], lo: int, hi: int, *, target: float,
                   d_k: int, d_v: int) -> list[tuple[int, int]]:
    """One (d_k', d_v') per layer with the least summed loss increase whose total state ``sum_l d_k' d_v'`` lies in
    ``[lo, hi]``: a multiple-choice knapsack solved exactly by dynamic programming over the total state (divided by
    the states' common divisor), in ``O(layers x pairs x hi / g)``.

    Ties (within :data:`TIE_RTOL` of the optimum, relative to the summed largest increases) go to the total nearest
    ``target``, then, layer by layer from the last, to the pair whose kept fractions ``d_k'/d_k`` and ``d_v'/d_v`` are
    closest, then the larger d_k'.

    Args:
        increases: per layer ``{(d_k', d_v'): loss increase}`` (finite; lower is better).
        lo, hi: the least and most total state (:func:`joint_bounds`).
        target: the pct's total state (the tie-break's).
        d_k, d_v: the full widths (the tie-break's fractions).

    Raises:
        ValueError: one line, for malformed increases or when no choice meets ``[lo, hi]``.
    """
    if isinstance(increases, (str, Mapping)) or not isinstance(increases, Sequence) or not increases:
        raise ValueError("increases must be a non-empty sequence of {(d_k', d_v'): loss increase} per layer")
    layers = []
    for i, layer in enumerate(increases):
        if not isinstance(layer, Mapping) or not layer:
            raise ValueError(f"increases[{i}] must be a non-empty {{(d_k', d_v'): loss increase}} mapping")
        rows = sorted((int(k), int(v), float(c)) for (k, v), c in layer.items())
        bad = [(k, v) for k, v, c in rows if k < 1 or v < 1 or not math.isfinite(c)]
        if bad:
            raise ValueError(f"increases[{i}][{bad[0]}] is not a pair of positive widths with a finite increase")
        layers.append(rows)
    g = math.gcd(*(k * v for rows in layers for k, v, _ in rows))
    T = hi // g
    fwd = np.full((len(layers) + 1, T + 1), np.inf)
    fwd[0, 0] = 0.0
    for i, rows in enumerate(layers):
        for k, v, c in rows:
            s = k * v // g
            if s <= T:
                np.minimum(fwd[i + 1, s:], fwd[i, : T + 1 - s] + c, out=fwd[i + 1, s:])
    totals = [t for t in range(-(-lo // g), T + 1) if np.isfinite(fwd[-1, t])]
    if not totals:
        lo_all = sum(min(k * v for k, v, _ in rows) for rows in layers)
        hi_all = sum(max(k * v for k, v, _ in rows) for rows in layers)
        raise ValueError(f"no choice of one (d_k', d_v') per layer keeps a total state in [{lo}, {hi}] (the layers' "
                         f"pairs keep totals in [{lo_all}, {hi_all}], multiples of {g})")
    tol = TIE_RTOL * max(sum(max(abs(c) for _, _, c in rows) for rows in layers), 1e-300)
    best = min(fwd[-1, t] for t in totals)
    t = min((t for t in totals if fwd[-1, t] <= best + tol), key=lambda t: (abs(t * g - target), t))
    out = []
    for i in range(len(layers) - 1, -1, -1):
        ok = [(k, v) for k, v, c in layers[i] if k * v // g <= t and fwd[i, t - k * v // g] + c <= fwd[i + 1, t] + tol]
        k, v = min(ok, key=lambda p: (abs(p[0] / d_k - p[1] / d_v), -p[0]))
        out.append((k, v))
        t -= k * v // g
    return out[::-1]


def check_joint_budget(d_k: int, d_v: int, pct: float, n_layers: int, settings: BudgetSettings, check=None,
                       extra: Sequence[tuple[int, int]] = ()) -> list[tuple[int, int]]:
    """Check before any job that a joint budget can meet the pct's total state: some choice of the pairs of
    :func:`joint_pairs` keeps a total within :data:`JOINT_TOLERANCE` of it; return those pairs.

    Raises:
        ValueError: one line, naming the bounds and what the pairs reach.
    """
    pairs = joint_pairs(d_k, d_v, settings, check, extra)
    target, lo, hi = joint_bounds(d_k, d_v, pct, n_layers)
    if not joint_usable(pairs, n_layers, lo, hi):  # bitsets: no knapsack over the totals at config-check time
        states = [k * v for k, v in pairs]
        raise ValueError(f"pct {pct}: {n_layers} layers of d_k x d_v = {d_k} x {d_v} keep {target:g} in all per head "
                         f"({target / n_layers:g} a layer) within {JOINT_TOLERANCE:.0%}; no choice of one (d_k', d_v') "
                         f"per layer keeps a total state in [{lo}, {hi}] (the layers' pairs keep totals in "
                         f"[{n_layers * min(states)}, {n_layers * max(states)}], multiples of {math.gcd(*states)})")
    return pairs
