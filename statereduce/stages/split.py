"""The split of a joint cut's state between keys and values, chosen by calibration loss (rule ``split``).

A joint cut without a budget (``drrqr-kv_75``) keeps d_k'/d_k and d_v'/d_v near equal (:func:`statereduce.core.cuts.
joint_widths`). With a budget of policy ``split`` (``drrqr-kv@split_75``, ``budgets.split: {policy: split}``) the
workflow tries every candidate pair of :func:`statereduce.core.cuts.split_candidates` at the pct's state, from the
key-only cut (d_k' = ``n_keep_for(d_k, pct)``, d_v) through the equal split to the value-only cut (d_k,
``n_keep_for(d_v, pct)``), the key widths between them those the budget allows (``floor``, ``multiple``,
``powers_of_two``): for each pair it selects both sides with the selector (:func:`statereduce.stages.select.select_cut`)
and measures the calibration loss of the whole model with the dropped key and value channels zeroed
(:func:`statereduce.core.slicing.masked_channels`, :func:`~statereduce.core.slicing.masked_values`), which is the loss
of the pruned checkpoint under ``norm_eps: exact``. The pair of lowest loss is every layer's d_k' x d_v'.

``results/{model}/select/{method}_{pct}.split.json`` holds the chosen widths, every candidate's widths, state share and
loss, the unpruned loss, and the settings and provenance; the selection of the same token reads it
(:func:`read_split`). Cost: one selection of both sides and one pass over the calibration blocks per candidate (4 to 7
candidates on the tiny models at the default multiple of 8, 10 to 18 at the 1.3B shapes).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from statereduce import __version__
from statereduce.common.settings import BudgetPlan
from statereduce.selectors import format_method, parse_method

log = logging.getLogger(__name__)

SPLIT_FORMAT = 1


def cut_tensors(rows) -> tuple[dict[int, Any], dict[int, Any]]:
    """({layer: int64 [H, d_k']}, {layer: int64 [units, d_v']}) kept key and value channels of a joint cut's
    selection rows (:func:`statereduce.stages.select.select_cut`: layer, head or unit, HeadSelection, side)."""
    import torch

    sides: dict[str, dict[int, dict[int, np.ndarray]]] = {"k": {}, "v": {}}
    for layer, unit, sel, side in rows:
        sides[side].setdefault(int(layer), {})[int(unit)] = np.asarray(sel.keep, np.int64)
    return tuple({layer: torch.as_tensor(np.stack([units[u] for u in sorted(units)]))
                  for layer, units in sorted(sides[s].items())} for s in ("k", "v"))


def masked_cut(model, keys: Mapping[int, Any], values: Mapping[int, Any]) -> contextlib.ExitStack:
    """A context in which ``model`` has every layer's dropped key channels (``keys``: {layer: [H, d_k']}) and value
    channels (``values``: {layer: [units, d_v']}) zeroed: the joint cut under ``norm_eps: exact``."""
    from statereduce.adapters import get_adapter
    from statereduce.core.slicing import masked_channels, masked_values

    adapter = get_adapter(model)
    mixers = dict(adapter.mixer_layers())
    stack = contextlib.ExitStack()
    with stack:
        for layer, keep in keys.items():
            stack.enter_context(masked_channels(adapter, mixers[layer], keep))
        for layer, keep_v in values.items():
            stack.enter_context(masked_values(adapter, mixers[layer], keep_v))
        return stack.pop_all()


def choose_split(weights: str | Path, method: str, pct: float, plan: BudgetPlan, *,
                 activations: str | Path | None = None, grads: str | Path | None = None,
                 base: str | Path | None = None, seed: int = 0, options: Mapping[str, Any] | None = None,
                 workers: int = 1, expect: Mapping[str, Any] | None = None, model=None, blocks=None,
                 progress: bool = True) -> dict[str, Any]:
    """Rule ``split``: the split artifact of a joint cut ``method`` (``<selector>-kv@<budget>``) at ``pct``.

    Args:
        weights, activations, grads: the artifacts the joint cut's selection reads (as for
            :func:`statereduce.stages.select.select_cut`).
        method, pct: the method token and the percent of the state removed.
        plan: the token's budget (:class:`~statereduce.common.settings.BudgetPlan`, policy ``split``), with the
            calibration and corpus of the loss.
        base: the base checkpoint folder (the model whose loss is measured).
        seed, options, workers: the selector's seed, options and threads.
        expect: the job's ``params.info`` (model, family, dtype, device).
        model, blocks: the loaded model and calibration blocks [N, T] instead of ``base`` and the plan's corpus.

    Raises:
        ValueError: one line, for a token that is not a joint cut with a budget, or a budget of another policy.
    """
    from tqdm.auto import tqdm

    from statereduce.core.budgets import allowed_widths
    from statereduce.core.cuts import split_candidates
    from statereduce.core.h5files import H5Artifact
    from statereduce.stages.allocate import calibration_loss, loss_inputs
    from statereduce.stages.select import select_cut

    spec, settings = parse_method(method), plan.settings
    if spec.cut != "joint" or spec.budget is None:
        raise ValueError(f"method {method!r}: a split is chosen for a joint cut with a budget, "
                         f"e.g. {format_method(spec.uniform.keys)}-kv@{plan.name or 'split'}")
    if settings.policy != "split":
        raise ValueError(f"budgets.{plan.name}: policy {settings.policy!r} chooses per-layer key widths; a joint cut "
                         f"(-kv@{plan.name}) takes policy 'split'")
    wattrs = H5Artifact(weights).expect(expect)
    d_k, d_v, family = int(wattrs["head_k_dim"]), int(wattrs["head_v_dim"]), wattrs.get("family")
    check = split_check(family, d_k, d_v)
    candidates = split_candidates(d_k, d_v, pct, allowed_widths(d_k, settings), check)
    if model is None:
        model, blocks, settings = loss_inputs(plan, base, expect)
    else:
        settings = settings.replace(batch_size=settings.batch_size or blocks.shape[0])
    batch = settings.batch_size
    base_loss = calibration_loss(model, blocks, batch)
    equal = split_candidates_equal(d_k, d_v, pct, check)
    rows = []
    for k, v in tqdm(candidates, desc="split", unit="pair", disable=not progress):
        sel_rows, _ = select_cut(weights, method, pct, activations=activations, grads=grads, seed=seed,
                                 options=dict(options or {}), workers=workers, expect=expect, widths=(k, v))
        keys, values = cut_tensors(sel_rows)
        with masked_cut(model, keys, values):
            loss = calibration_loss(model, blocks, batch)
        rows.append({"d_k_new": k, "d_v_new": v, "state_fraction": k * v / (d_k * d_v), "loss": loss})
        log.info("d_k'=%d x d_v'=%d (%.4f of the state): loss %.5f (+%.5f)", k, v, k * v / (d_k * d_v), loss,
                 loss - base_loss)
    best = min(rows, key=lambda r: (r["loss"], abs(r["d_k_new"] / d_k - r["d_v_new"] / d_v)))
    layers = [int(x) for x in np.asarray(wattrs["layers"]).tolist()]
    provenance = {"model": (expect or {}).get("model") or wattrs.get("model"), "family": family}
    return {
        "format": SPLIT_FORMAT,
        **{k: v for k, v in provenance.items() if v is not None},
        "method": method,
        "selector": spec.selector,
        "calibration": spec.calib,
        "budget": plan.name,
        "settings": settings.to_dict(),
        "pct": pct,
        "d_k": d_k,
        "d_v": d_v,
        "layers": layers,
        "d_k_new": best["d_k_new"],
        "d_v_new": best["d_v_new"],
        "state_fraction": best["state_fraction"],
        "equal": list(equal) if equal else None,
        "base_loss": base_loss,
        "candidates": rows,
        "n_samples": int(blocks.shape[0]),
        "seq_len": int(blocks.shape[1]),
        "seed": seed,
        "options": dict(options or {}),
        "package_version": __version__,
    }


def split_check(family: str | None, d_k: int, d_v: int):
    """The check of a pair (d_k', d_v') the family's config must express (None without a family)."""
    if family is None:
        return None
    from statereduce.families import family_spec

    fspec = family_spec(family)

    def check(k: int, v: int) -> None:
        fspec.check_reduction(d_k, v, k)
        fspec.check_value_reduction(d_v, v)

    return check


def split_candidates_equal(d_k: int, d_v: int, pct: float, check) -> tuple[int, int] | None:
    """The equal split of the same state (the plain ``-kv`` cut's widths), or None where no pair passes ``check``."""
    from statereduce.core.cuts import joint_widths

    try:
        return joint_widths(d_k, d_v, pct, check)
    except ValueError:
        return None


def read_split(path: str | Path, expect: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A split artifact (:func:`choose_split`), checked against the reading job (model, family, method, pct, and
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
    return doc
