"""What a method cuts and to which widths: key channels (d_k'), value channels (d_v') or both at a pct.

``{pct}`` of a key cut is the percent of key channels removed (d_k' = :func:`~statereduce.selectors.n_keep_for`
(d_k, pct)); of a value cut (d_v' = ``n_keep_for(d_v, pct)``) (``-v``), the percent of value channels removed, which
is the same percent of every head's d_v x d_k state; of a joint cut (``-kv``), the percent of the state removed,
split equally between the two sides (:func:`joint_widths`), or with a budget of policy ``split`` (``-kv@<budget>``)
among the pairs of :func:`split_candidates` by calibration loss (:func:`statereduce.stages.select.choose_split`, whose
artifact :func:`read_split` reads). :func:`cut_widths` gives (d_k', d_v') for any cut without a budget.
"""

from __future__ import annotations

import math

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from statereduce.common.layout import CUTS
from statereduce.selectors.registry import n_keep_for, n_removed_for, no_channel_removed


#: the split artifact's format (:func:`read_split`)
SPLIT_FORMAT = 1
#: how far (a fraction of the full state) a joint cut's state may be from the pct's for a more equal split
STATE_TOLERANCE = 0.01


def joint_widths(d_k: int, d_v: int, pct: float,
                 check: Callable[[int, int], None] | None = None) -> tuple[int, int]:
    """(d_k', d_v') that remove ``pct`` percent of the d_v x d_k state with the two sides cut alike.

    Among the pairs whose state d_k' d_v' lies within :data:`STATE_TOLERANCE` of the full state from (1 - pct/100)
    d_k d_v, the one with the most equal kept fractions d_k'/d_k and d_v'/d_v, then the closest state, then the larger
    d_k' (with no pair that close: the closest state). The whole state (d_k, d_v) is no candidate: a cut removes a
    channel. ``check(d_k', d_v')`` may refuse a pair (a family whose config cannot hold it) by raising ValueError; the
    next best is taken.

    Raises:
        ValueError: one line, for a pct outside (0, 100), one that removes no channel (:func:`_state_target`) or when
            no pair passes ``check``.
    """
    full, target = _state_target(d_k, d_v, pct)
    candidates = set()
    for k in range(1, d_k + 1):
        for v in (int(target // k), int(target // k) + 1):
            if 1 <= v <= d_v and (k, v) != (d_k, d_v):
                err = abs(k * v - target) / full
                candidates.add((err > STATE_TOLERANCE, 0.0 if err > STATE_TOLERANCE else abs(k / d_k - v / d_v),
                                err, -k, k, v))
    for k, v in _passing([c[-2:] for c in sorted(candidates)], check):
        return k, v
    raise _no_pair(d_k, d_v, pct)


def _state_target(d_k: int, d_v: int, pct: float) -> tuple[int, float]:
    """(the full state d_k d_v, the state a joint cut at ``pct`` keeps); a one-line ValueError for a bad pct, or one
    that removes no channel: less than half the smallest cut, one channel of the larger side (``round(max(d_k, d_v)
    * pct / 100) = 0``, as :func:`~statereduce.selectors.n_keep_for` rounds one side)."""
    if not 0 < pct < 100:
        raise ValueError(f"pct={pct!r} is invalid for a joint cut; valid: a percent of the state in (0, 100)")
    if n_removed_for(max(d_k, d_v), pct) == 0:
        raise no_channel_removed(pct, max(d_k, d_v), f"channel of the d_k x d_v = {d_k} x {d_v} state",
                                 "pcts of a joint cut are percent of the state removed, e.g. drrqr-kv_50 removes half")
    return d_k * d_v, (1 - pct / 100) * d_k * d_v


def _passing(pairs, check: Callable[[int, int], None] | None):
    """The pairs (d_k', d_v'), in order, that ``check`` does not refuse."""
    for k, v in pairs:
        try:
            if check is not None:
                check(k, v)
        except ValueError:
            continue
        yield k, v


def _no_pair(d_k: int, d_v: int, pct: float) -> ValueError:
    return ValueError(f"no key and value widths of d_k={d_k}, d_v={d_v} remove {pct}% of the state")


def cut_widths(cut: str, d_k: int, d_v: int, pct: float,
               check: Callable[[int, int], None] | None = None) -> tuple[int, int]:
    """(d_k', d_v') of a cut (:data:`~statereduce.common.layout.CUTS`) at ``pct``."""
    if cut == "keys":
        return n_keep_for(d_k, pct), d_v
    if cut == "values":
        return d_k, n_keep_for(d_v, pct, "value")
    if cut == "joint":
        return joint_widths(d_k, d_v, pct, check)
    raise ValueError(f"unknown cut {cut!r}; valid: {', '.join(CUTS)}")


def split_candidates(d_k: int, d_v: int, pct: float, key_widths: list[int],
                     check: Callable[[int, int], None] | None = None) -> list[tuple[int, int]]:
    """The (d_k', d_v') pairs a joint cut with a ``split`` budget chooses from at ``pct`` percent of the state, by
    ascending d_k': the value-only cut (d_k, ``n_keep_for(d_v, pct)``), the key-only cut (``n_keep_for(d_k, pct)``,
    d_v) (each where the pct removes a channel of that side), the equal split (:func:`joint_widths`), and for each of
    ``key_widths`` between the two (the budget's allowed widths) the value width whose state is nearest the pct's,
    where that lies within :data:`STATE_TOLERANCE` of the full state; never the whole state. ``check`` refuses pairs
    as for :func:`joint_widths`.

    Raises:
        ValueError: one line, for a pct outside (0, 100), one that removes no channel, or when no pair passes
            ``check``.
    """
    full, target = _state_target(d_k, d_v, pct)
    pairs = set()
    if n_removed_for(d_v, pct):
        pairs.add((d_k, n_keep_for(d_v, pct, "value")))
    if n_removed_for(d_k, pct):
        pairs.add((n_keep_for(d_k, pct), d_v))
    try:
        pairs.add(joint_widths(d_k, d_v, pct, check))
    except ValueError:
        pass
    for k in key_widths:
        v = min(max(round(target / k), 1), d_v)
        if abs(k * v - target) / full <= STATE_TOLERANCE:
            pairs.add((k, v))
    pairs.discard((d_k, d_v))
    out = list(_passing(sorted(pairs), check))
    if not out:
        raise _no_pair(d_k, d_v, pct)
    return out


def split_check(family: str | None, d_k: int, d_v: int):
    """The check of a pair (d_k', d_v') the family's config must express, for :func:`joint_widths` and
    :func:`split_candidates` (None without a family)."""
    if family is None:
        return None
    from statereduce.families import family_spec

    fspec = family_spec(family)

    def check(k: int, v: int) -> None:
        fspec.check_reduction(d_k, v, k)
        fspec.check_value_reduction(d_v, v)

    return check


def read_split(path: str | Path, expect: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A split artifact (:func:`statereduce.stages.select.choose_split`), checked against the reading job (model, family, method, pct, and
    ``d_k``/``d_v`` where given) and itself (its widths are one of its candidates, the lowest loss).

    Raises:
        ArtifactError: one line naming the file and the rule that rebuilds it.
    """
    from statereduce.core.artifacts import ArtifactError, read_json_artifact, remedy

    expect = dict(expect or {})
    doc = read_json_artifact(path, "split", SPLIT_FORMAT, "candidates", expect)
    for key in ("d_k", "d_v"):
        if key in expect and doc.get(key) != expect[key]:
            raise ArtifactError(f"{path} was chosen for {key}={doc.get(key)!r}; this job has {expect[key]!r}; "
                                f"{remedy(path)}")
    pairs = {(c["d_k_new"], c["d_v_new"]): c["loss"] for c in doc["candidates"]}
    chosen = (doc.get("d_k_new"), doc.get("d_v_new"))
    if chosen not in pairs or pairs[chosen] > min(pairs.values()):
        raise ArtifactError(f"{path}: widths {chosen} are not its lowest-loss candidate; {remedy(path)}")
    per_layer = doc.get("per_layer")
    if per_layer is not None:
        widths = per_layer.get("widths") or {}
        layers = sorted(int(layer) for layer in widths)
        bad = [f"{layer}: {w}" for layer, w in widths.items() if tuple(w) not in pairs]
        if layers != sorted(doc.get("layers") or []) or bad or per_layer.get("loss", math.inf) > pairs[chosen]:
            raise ArtifactError(f"{path}: its per-layer widths ({', '.join(bad) or 'layers ' + str(layers)}) are not "
                                f"candidates of every layer at or below the uniform split's loss; {remedy(path)}")
    return doc
