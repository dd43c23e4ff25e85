"""What a method cuts and to which widths: key channels (d_k'), value channels (d_v') or both at a pct.

``{pct}`` of a key cut is the percent of key channels removed (d_k' = :func:`~statereduce.selectors.n_keep_for`
(d_k, pct)); of a value cut (d_v' = ``n_keep_for(d_v, pct)``) (``-v``), the percent of value channels removed, which
is the same percent of every head's d_v x d_k state; of a joint cut (``-kv``), the percent of the state removed,
split equally between the two sides (:func:`joint_widths`), or with a budget of policy ``split`` (``-kv@<budget>``)
among the pairs of :func:`state_split_candidates` by calibration loss (:func:`statereduce.stages.select.choose_state_split`, whose
artifact :func:`read_state_split` reads). :func:`cut_widths` gives (d_k', d_v') for any cut without a budget.

A :class:`Cut` is what a method removes, typed: per linear-attention layer, the key width and (for a value or joint
cut) the value width kept. :func:`plan_cut` builds it from a method token, a pct and the artifact that chose per-layer
widths (an allocation, a split); the selection file records it (:meth:`Cut.widths_meta`, read back by
:meth:`Cut.from_meta`), and pruning, the tables and the checkpoint's config read it from there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from statereduce.common.layout import CUTS
from statereduce.core.artifacts import ArtifactError, read_json_artifact, remedy
from statereduce.core.budgets import read_allocation
from statereduce.core.engines import pair_check
from statereduce.families import family_spec
from statereduce.selectors import parse_method
from statereduce.selectors.registry import n_keep_for, n_removed_for, no_channel_removed


@dataclass(frozen=True)
class Cut:
    """What a method removes from every linear-attention layer of a model.

    Attributes:
        kind: "keys", "values" or "joint" (:data:`~statereduce.common.layout.CUTS`).
        d_k: the heads' key width.
        key_widths: {layer: d_k' kept} (d_k in every layer of a value cut).
        d_v: the heads' value width (None where a key cut's artifacts do not record it).
        value_widths: {layer: d_v' kept}; None for a key cut (every value channel stays).
    """

    kind: str
    d_k: int
    key_widths: Mapping[int, int]
    d_v: int | None = None
    value_widths: Mapping[int, int] | None = None

    def __post_init__(self) -> None:
        if self.kind not in CUTS:
            raise ValueError(f"unknown cut {self.kind!r}; valid: {', '.join(CUTS)}")
        if (self.value_widths is None) != (self.kind == "keys"):
            raise ValueError(f"a {self.kind} cut " + ("has no value widths" if self.kind == "keys"
                                                      else "needs its value widths"))
        if self.value_widths is not None and sorted(self.value_widths) != sorted(self.key_widths):
            raise ValueError(f"value widths of layers {sorted(self.value_widths)}, key widths of layers "
                             f"{sorted(self.key_widths)}: a cut names the same layers on both sides")

    @classmethod
    def uniform(cls, kind: str, d_k: int, d_v: int | None, layers, k: int, v: int | None = None) -> Cut:
        """Every layer of ``layers`` keeps d_k' = ``k`` (and d_v' = ``v`` for a value or joint cut)."""
        layers = sorted(int(layer) for layer in layers)
        return cls(kind, d_k, {layer: int(k) for layer in layers}, d_v,
                   None if kind == "keys" else {layer: int(v) for layer in layers})

    @classmethod
    def per_layer(cls, kind: str, d_k: int, d_v: int | None, pairs: Mapping[int, tuple[int, int]]) -> Cut:
        """Each layer keeps its own (d_k', d_v') of ``pairs`` (d_v' ignored for a key cut)."""
        pairs = {int(layer): pair for layer, pair in sorted(pairs.items())}
        return cls(kind, d_k, {layer: int(k) for layer, (k, _) in pairs.items()}, d_v,
                   None if kind == "keys" else {layer: int(v) for layer, (_, v) in pairs.items()})

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any], layers) -> Cut:
        """The cut a selection file's metadata records for the model's linear-attention ``layers`` (its
        ``d_k_new``/``d_v_new``: one width for every layer or {"<layer>": width}, as :meth:`widths_meta` writes)."""
        kind = meta.get("cut", "keys")
        keys = {layer: int(w) for layer, w in layer_widths(meta["d_k_new"], layers).items()}
        values = None if kind == "keys" else {
            layer: int(w) for layer, w in layer_widths(meta["d_v_new"], layers).items()}
        return cls(kind, int(meta["d_k"]), keys, meta.get("d_v"), values)

    @property
    def layers(self) -> list[int]:
        return sorted(self.key_widths)

    @property
    def pairs(self) -> dict[int, tuple[int, int]]:
        """{layer: (d_k', d_v')} (d_v' = d_v where values are whole)."""
        return {layer: (k, self.value_width(layer)) for layer, k in sorted(self.key_widths.items())}

    def value_width(self, layer: int) -> int | None:
        return self.d_v if self.value_widths is None else self.value_widths[layer]

    @property
    def uniform_keys(self) -> bool:
        """Whether every layer keeps the same key width."""
        return len(set(self.key_widths.values())) == 1

    @property
    def state_fraction(self) -> float:
        """The share of the layers' d_v x d_k states kept (their mean)."""
        return sum(k * v for k, v in self.pairs.values()) / (len(self.key_widths) * self.d_k * self.d_v)

    def widths_meta(self) -> dict[str, Any]:
        """The selection file's spelling of the widths: ``d_k_new`` (and ``d_v_new`` for a value or joint cut), the
        width all layers keep, else {"<layer>": width}."""
        out = {"d_k_new": _one_or_each(self.key_widths)}
        if self.value_widths is not None:
            out["d_v_new"] = _one_or_each(self.value_widths)
        return out


def _one_or_each(widths: Mapping[int, int]) -> int | dict[str, int]:
    if len(set(widths.values())) == 1:
        return next(iter(widths.values()))
    return {str(layer): int(width) for layer, width in sorted(widths.items())}


def layer_widths(widths, layers) -> dict[int, Any]:
    """{layer: width} of a selection file's ``d_k_new`` or ``d_v_new`` (:meth:`Cut.widths_meta`'s spelling: one width
    for every layer of ``layers``, or {"<layer>": width} naming its own layers); the one reader of that spelling."""
    if isinstance(widths, Mapping):
        return {int(layer): w for layer, w in sorted(widths.items(), key=lambda kv: int(kv[0]))}
    return dict.fromkeys((int(layer) for layer in sorted(layers)), widths)


#: the split artifact's format (:func:`read_state_split`)
STATE_SPLIT_FORMAT = 1
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
    raise _no_pair(d_k, d_v, pct, check)


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


def _no_pair(d_k: int, d_v: int, pct: float, check: Callable[[int, int], None] | None = None) -> ValueError:
    note = getattr(check, "note", None)
    return ValueError(f"no key and value widths of d_k={d_k}, d_v={d_v} remove {pct}% of the state"
                      + (f" and are served ({note})" if note else ""))


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


def state_split_candidates(d_k: int, d_v: int, pct: float, key_widths: list[int],
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
        raise _no_pair(d_k, d_v, pct, check)
    return out


def plan_cut(method: str, pct: float, d_k: int, d_v: int | None, layers, *, family: str | None = None,
             allocation: str | Path | None = None, widths: tuple[int, int] | Mapping[int, tuple[int, int]] | None = None,
             expect: Mapping[str, Any] | None = None) -> tuple[Cut, dict[str, Any]]:
    """The :class:`Cut` of ``method`` at ``pct`` on a model of heads d_k x d_v and linear-attention ``layers``, and
    what a selection records of the artifact that chose per-layer widths.

    A key cut keeps ``n_keep_for(d_k, pct)`` in every layer, or with ``@<budget>`` the widths of its allocation
    artifact (``allocation``, :func:`statereduce.core.budgets.read_allocation`; recorded as ``{"allocation":
    ...}``). A value or joint cut keeps :func:`cut_widths` in every layer; a joint cut with ``@<budget>`` the widths
    its split artifact chose (``allocation``, :func:`read_state_split`, per layer where it has them; recorded as
    ``{"split": the artifact}``), or ``widths`` given directly (one (d_k', d_v') or {layer: (d_k', d_v')}: the split
    stage's candidates). Pairs the family's config cannot hold are refused (:func:`state_pair_check`).

    Raises:
        ValueError: one line, for an artifact the token does not take or lacks, or widths the family cannot hold.
        ArtifactError: one line, for an artifact written for another job.
    """
    spec = parse_method(method)
    layers = sorted(int(layer) for layer in layers)
    expect = dict(expect or {})
    if spec.cut == "keys":
        if widths is not None:
            raise ValueError(f"method {method!r}: only a joint cut (-kv) takes a split of the state")
        if (spec.budget is None) != (allocation is None):
            raise ValueError(f"method {method!r} " + ("has no @<budget>: give no allocation" if spec.budget is None
                                                      else "names a budget: give its allocation (rule allocate)"))
        if allocation is None:
            return Cut.uniform("keys", d_k, d_v, layers, n_keep_for(d_k, pct)), {}

        doc = read_allocation(allocation, {**expect, "method": method, "pct": pct})
        record = {"allocation": {"budget": doc["budget"], "policy": doc["allocation"]["policy"],
                                 "key_dims": doc["key_dims"], "total": doc["allocation"]["total"],
                                 "uniform_width": doc["uniform_width"]}}
        return Cut("keys", d_k, {int(k): int(v) for k, v in doc["key_dims"].items()}, d_v), record
    if widths is not None or spec.budget is not None:
        if spec.cut != "joint":
            raise ValueError(f"method {method!r}: only a joint cut (-kv) takes a split of the state")
        if (widths is None) == (allocation is None):
            raise ValueError(f"method {method!r}: give either the split artifact (rule split) or the widths")
    elif allocation is not None:
        raise ValueError(f"method {method!r} has no @<budget>: give no allocation")
    check = state_pair_check(family, d_k, d_v)
    record = {}
    if allocation is not None:
        split = read_state_split(allocation, {**expect, "method": method, "pct": pct, "d_k": d_k, "d_v": d_v})
        widths = split["d_k_new"], split["d_v_new"]
        if "per_layer" in split:
            widths = {int(layer): tuple(pair) for layer, pair in split["per_layer"]["widths"].items()}
        record = {"split": split}
    if isinstance(widths, Mapping):
        pairs = {int(layer): (int(k), int(v)) for layer, (k, v) in widths.items()}
        if sorted(pairs) != layers:
            raise ValueError(f"per-layer widths name layers {sorted(pairs)}; the model's linear-attention layers are "
                             f"{layers}")
    elif widths is not None:
        pairs = {layer: (int(widths[0]), int(widths[1])) for layer in layers}
    else:
        pairs = {layer: cut_widths(spec.cut, d_k, d_v, pct, check) for layer in layers}
    if check is not None:
        for pair in set(pairs.values()):
            check(*pair)
    return Cut.per_layer(spec.cut, d_k, d_v, pairs), record


def state_pair_check(family: str | None, d_k: int, d_v: int, engine: str | None = None):
    """The check of a pair (d_k', d_v') the family's config must express, and with ``engine`` (a split budget's) the
    serving engine must take (:func:`statereduce.core.engines.pair_check`), for :func:`joint_widths` and
    :func:`state_split_candidates` (None without a family)."""
    if family is None:
        return None

    fspec = family_spec(family)
    served = pair_check(engine, family, d_k, d_v) if engine is not None else None

    def check(k: int, v: int) -> None:
        fspec.check_reduction(d_k, v, k)
        fspec.check_value_reduction(d_v, v)
        if served is not None:
            served(k, v)

    check.note = getattr(served, "note", None)
    return check


def read_state_split(path: str | Path, expect: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A split artifact (:func:`statereduce.stages.select.choose_state_split`), checked against the reading job (model, family, method, pct, and
    ``d_k``/``d_v`` where given) and itself (its widths are one of its candidates, the lowest loss).

    Raises:
        ArtifactError: one line naming the file and the rule that rebuilds it.
    """
    expect = dict(expect or {})
    doc = read_json_artifact(path, "split", STATE_SPLIT_FORMAT, "candidates", expect)
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
        if per_layer.get("policy") == "joint":  # each layer one of its measured pairs, at the pct's total state
            measured = per_layer.get("layer_losses") or {}
            bad = [f"{layer}: {w}" for layer, w in widths.items()
                   if not (isinstance(w, list) and len(w) == 2) or f"{w[0]}x{w[1]}" not in measured.get(layer, {})]
            lo, hi = per_layer.get("bounds") or (0, 0)
            total = 0 if bad else sum(k * v for k, v in widths.values())
            if not bad and per_layer.get("kept") != "uniform" and not lo <= total <= hi:
                raise ArtifactError(f"{path}: its per-layer widths keep a total state of {total}, outside its bounds "
                                    f"[{lo}, {hi}]; {remedy(path)}")
        else:
            bad = [f"{layer}: {w}" for layer, w in widths.items() if tuple(w) not in pairs]
        if layers != sorted(doc.get("layers") or []) or bad or per_layer.get("loss", math.inf) > pairs[chosen]:
            raise ArtifactError(f"{path}: its per-layer widths ({', '.join(bad) or 'layers ' + str(layers)}) are not "
                                f"candidates of every layer at or below the uniform split's loss; {remedy(path)}")
    return doc
