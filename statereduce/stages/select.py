"""Per-head channel selections: run a selector over a model's artifacts and store the result as Parquet.

Selection reads only HDF5 artifacts (q/k weights, calibration activations, gradient scores), never
the model, so it needs neither torch nor fla.

``results/{model}/select/{method}_{pct}.parquet`` holds one row per (layer, head) with the kept
channel indices (sorted), or for a transform selector (``pca``) the head's transform ``T`` [d_k', d_k] (row-major),
and, where the selector has scores, their scores. The file's key/value metadata records the format version
(:data:`SELECTION_FORMAT`), the kind (``index`` or ``transform``), model, family, selector, variant, pct, d_k, d_k',
calibration id, seed, options and version. Reading validates the rows against the metadata (head count, d_k', sorted
in-range indices, orthonormal transforms).

Both ends check provenance (:mod:`statereduce.core.artifacts`): :func:`select_channels` that its HDF5 inputs were
written for the job's model and calibration (and agree on the head sizes), :func:`read_selection` that the
selection was written for the reading job's model, method and pct.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from statereduce import __version__
from statereduce.core.h5files import H5Artifact, head_data, head_data_iter, layer_head_data  # noqa: F401  (re-exported)
from statereduce.core.selection_file import (  # noqa: F401  (re-exported)
    SELECTION_FORMAT, read_selection, write_selection,
)
from statereduce.common.layout import MethodSpec
from statereduce.common.settings import BudgetPlan
from statereduce.core.artifacts import ArtifactError, remedy
from statereduce.core.budgets import (
    JOINT_TOLERANCE, allowed_widths, joint_allocate, joint_bounds, joint_pairs, joint_usable,
)
from statereduce.core.calib_loss import calibration_loss, loss_inputs
from statereduce.core.cuts import STATE_SPLIT_FORMAT, Cut, joint_widths, plan_cut, state_split_candidates, state_pair_check
from statereduce.selectors import HeadData, format_method, get_selector, n_keep_for, parse_method, select_heads
from statereduce.selectors.registry import head_rng, value_side
from statereduce.selectors.values import ValueData

log = logging.getLogger(__name__)

#: The budget policies of a joint cut (``-kv@<budget>``): ``split`` (one split of the state, or with ``per_layer`` a
#: split per layer at the pct's state) and ``joint`` (each layer's share of the state and its split together).
JOINT_POLICIES = ("split", "joint")

#: Version of the selection file layout: 1 had only index selections (no ``transform`` column, no ``format`` key).


def selector_code_files(name: str) -> list[str]:
    """Source files a selector's results depend on: its own module plus the statereduce modules it uses
    (e.g. ``rrqr.py`` for ``drrqr``), excluding the shared registry. The workflow makes these inputs of
    that selector's jobs only, so editing one selector reruns only its selections."""
    selector = get_selector(name)
    module = sys.modules[selector.fn.__module__]
    files = {selector.source_file}
    for value in vars(module).values():
        owner = value if inspect.ismodule(value) else sys.modules.get(getattr(value, "__module__", "") or "")
        mod_name = getattr(owner, "__name__", "")
        if mod_name.startswith("statereduce.") and not mod_name.startswith("statereduce.selectors.registry"):
            src = getattr(owner, "__file__", None)
            if src and mod_name != "statereduce.selectors":
                files.add(os.path.abspath(src))
    return sorted(files)


def select_channels(weights: str | Path, method: str, pct: float, *, activations: str | Path | None = None,
                    grads: str | Path | None = None, seed: int = 0, options: dict | None = None, workers: int = 1,
                    expect: dict | None = None, allocation: str | Path | None = None,
                    widths: tuple[int, int] | Mapping[int, tuple[int, int]] | None = None) -> tuple[list[tuple], dict]:
    """Select the channels ``method`` keeps in every (layer, head) of a model: key channels, value channels or both.

    The widths come from the method's :class:`~statereduce.core.cuts.Cut` (:func:`statereduce.core.cuts.plan_cut`);
    the key side runs the method's selector at each layer's d_k' (:func:`run_selector`), the value side its
    registered value side (:mod:`statereduce.selectors.values`) at each layer's d_v' for each value head.

    Args:
        weights: the model's ``qk.h5`` (head rows of the q/k projections, and the value and output projections; also
            gives H, d_k, d_v, layers).
        method: method token, e.g. ``drrqr``, ``l1-q``, ``grad.prose``, ``drrqr@sens``, ``drrqr-v``, ``grad-kv@split``
            (see ``parse_method``).
        pct: percent removed: of key channels (a key cut), of value channels (``-v``) or of the state (``-kv``).
        activations: ``activations.h5`` (needed by activation/xnorm-based selectors and value sides).
        grads: ``grad_scores.h5`` (needed by ``grad``).
        seed: selection seed (``rand``; tie-breaking elsewhere is deterministic).
        options: selector options from the config (e.g. DRRQR's ``f``); a value side gets them where it takes them.
        workers: heads selected in parallel (threads, single-threaded BLAS each).
        expect: what the job expects of its inputs (e.g. the rule's ``params.info``: ``model``, ``family``).
            ``weights`` must have been written for it, and ``activations``/``grads`` for it, for the method's
            calibration id and for the weights' head sizes (:func:`statereduce.core.artifacts.check_provenance`).
        allocation: for a key cut with ``@<budget>``, its allocation artifact (:mod:`statereduce.stages.allocate`);
            for a joint cut with ``@<budget>``, its split artifact (:func:`choose_state_split`).
        widths: a joint cut's (d_k', d_v'), or {layer: (d_k', d_v')}, given directly (the split stage's candidates;
            the metadata's method is then the token without its budget).

    Returns:
        (rows, meta): rows of (layer, head, HeadSelection) for a key cut, of (layer, unit or head, HeadSelection,
        side "k" or "v") for a value or joint cut, and the file metadata: the model and family, the cut's widths
        (``d_k_new``, and ``d_v_new``, ``value_units``, ``value_selection``, ``state_fraction`` for a value or joint
        cut: :meth:`~statereduce.core.cuts.Cut.widths_meta`) and, with a budget, the allocation or split it read.

    Raises:
        ValueError: one line, for an artifact the token does not take or lacks, or widths the family cannot hold.
        ArtifactError: one line, for an input written for another model, family, calibration or head size, one
            that cannot be read, or weights written before value channels were exported (a value or joint cut).
    """
    spec = parse_method(method)
    w = H5Artifact(weights)
    wattrs = w.expect(expect)
    if spec.cut != "keys" and "head_v_dim" not in wattrs:
        raise ArtifactError(f"{weights} has no value weights (written before value channels were exported); "
                            f"{remedy(Path(weights))}")
    d_k, d_v = int(wattrs["head_k_dim"]), wattrs.get("head_v_dim")
    d_v = None if d_v is None else int(d_v)
    cut, record = plan_cut(method, pct, d_k, d_v, w.layers(), family=wattrs.get("family"), allocation=allocation,
                           widths=widths, expect=expect)
    if widths is not None:
        method = format_method(spec.uniform)
    acts, grad = calibration_inputs(method, activations, grads, {**(expect or {}), "calibration": spec.calib,
                                                                 "num_heads": wattrs["num_heads"], "head_k_dim": d_k})
    provenance = {"model": (expect or {}).get("model") or wattrs.get("model"), "family": wattrs.get("family"),
                  "base_checkpoint": json.loads(wattrs["base_checkpoint"]) if wattrs.get("base_checkpoint") else None}
    rows, key_meta = [], None
    if spec.cut != "values":
        heads = head_data_iter(Path(weights), set(get_selector(spec.selector).needs),
                               Path(activations) if acts is not None else None, Path(grads) if grad is not None else None)
        rows, key_meta = select_keys(heads, method, pct, cut, int(wattrs["num_heads"]), seed=seed, options=options,
                                     workers=workers, provenance=provenance, record=record)
        if spec.cut == "keys":
            return rows, key_meta
        rows = [(*row, "k") for row in rows]
    value_rows = select_values(w, spec, cut, acts, grad, seed, options)
    meta = {
        "format": SELECTION_FORMAT,
        "kind": "index",
        **{k: v for k, v in provenance.items() if v is not None},
        "method": method,
        "selector": spec.selector,
        "variant": spec.variant,
        "calibration": spec.calib,
        "budget": spec.budget if widths is None else None,
        "pct": pct,
        "num_heads": int(wattrs["num_heads"]),
        **cut_meta(cut, value_rows, record),
        "seed": seed,
        "options": options or {},
        "package_version": __version__,
    }
    if key_meta is not None:
        meta["key_pct"] = key_meta["pct"]
    return rows + value_rows, meta


def select_keys(heads: Iterable[tuple[int, int, HeadData]], method: str, pct: float, cut: Cut, num_heads: int, *,
                seed: int, options: Mapping[str, Any] | None, workers: int, provenance: Mapping[str, Any],
                record: Mapping[str, Any]) -> tuple[list[tuple[int, int, object]], dict]:
    """The key side of ``method``'s selection at ``cut.key_widths`` (:func:`run_selector`): a key cut's rows and
    metadata (with its allocation's summary where a budget chose the widths), or a joint cut's key rows, whose
    metadata's ``pct`` is the percent of key channels removed on average."""
    spec, d_k = parse_method(method), cut.d_k
    if spec.cut == "keys":
        return run_selector(heads, method, pct, d_k=d_k, num_heads=num_heads, seed=seed, options=options,
                            workers=workers, provenance={**provenance, **record},
                            widths=cut.key_widths if record else None)
    key_pct = 100.0 * (d_k - sum(cut.key_widths.values()) / len(cut.key_widths)) / d_k
    return run_selector(heads, format_method(spec.keys), key_pct, d_k=d_k, num_heads=num_heads, seed=seed,
                        options=options, workers=workers, provenance=provenance, widths=cut.key_widths)


def calibration_inputs(method: str, activations: str | Path | None, grads: str | Path | None,
                       expect: Mapping[str, Any]) -> tuple[H5Artifact | None, H5Artifact | None]:
    """The calibration artifacts ``method``'s selection reads (:func:`cut_needs`), each checked against ``expect``
    (the job's model, calibration and head sizes): (activations or None, gradient scores or None).

    Raises:
        ValueError: one line, for an artifact the selector or its value side needs and was not given.
    """
    spec, needs = parse_method(method), cut_needs(method)
    acts = H5Artifact(activations) if activations is not None and needs & {"activations", "xnorm"} else None
    grad = H5Artifact(grads) if grads is not None and "grad" in needs else None
    for need, art, what in (({"activations", "xnorm"}, acts, "calibration activations (activations.h5)"),
                            ({"grad"}, grad, "gradient scores (grad_scores.h5)")):
        if needs & need and art is None:
            side = f"the value side of {spec.selector!r}" if spec.cut != "keys" and need & value_side_needs(spec) \
                else f"selector {spec.selector!r}"
            raise ValueError(f"{side} needs {what}")
    for art in (acts, grad):
        if art is not None:
            art.expect(expect)
    return acts, grad


def cut_meta(cut: Cut, value_rows: list[tuple], record: Mapping[str, Any]) -> dict[str, Any]:
    """A value or joint cut's entries of the selection metadata: the cut and its widths
    (:meth:`~statereduce.core.cuts.Cut.widths_meta`), the value units per layer, the state kept and, where a split
    artifact chose the widths, its summary."""
    out = {
        "cut": cut.kind,
        "d_k": cut.d_k,
        "d_v": cut.d_v,
        **cut.widths_meta(),
        "value_units": max(sum(1 for r in value_rows if r[0] == layer) for layer in cut.layers),
        "value_selection": "head",
        "state_fraction": cut.state_fraction,
    }
    if "split" in record:
        split = record["split"]
        out["split"] = {"budget": split["budget"], "policy": (split.get("settings") or {}).get("policy", "split"),
                        "equal": split["equal"],
                        "candidates": len(split["candidates"])}
    return out


def value_side_needs(spec: MethodSpec) -> set[str]:
    """What the value side of ``spec``'s selector reads, as selection needs ("weights", "activations", "grad")."""
    return set(value_side(spec.selector).needs)


def select_values(w: H5Artifact, spec: MethodSpec, cut: Cut, acts: H5Artifact | None, grad: H5Artifact | None,
                  seed: int, options: Mapping[str, Any] | None) -> list[tuple[int, int, object, str]]:
    """The value rows (layer, unit, HeadSelection, "v") of a value or joint cut: the selector's value side at each
    layer's d_v' (``cut.value_widths``), one unit per value head, with the arrays its needs name."""
    side = value_side(spec.selector)

    def layers():
        for layer in w.layers():
            names = ["W_v", "W_o"] + (["w_norm"] if "w_norm" in w.datasets(layer) else [])
            arrays = w.read(layer, names)
            if acts is not None and "activations" in side.needs:
                arrays |= acts.read(layer, ["V"])
            if grad is not None and "grad" in side.needs:
                arrays |= grad.read(layer, ["grad_v"])
            yield layer, arrays

    return [(layer, unit, side(data, cut.value_widths[layer], rng=head_rng(seed, layer, unit), options=options), "v")
            for layer, unit, data in value_units(layers())]


def run_selector(
    heads: Iterable[tuple[int, int, HeadData]],
    method: str,
    pct: float,
    *,
    d_k: int,
    num_heads: int,
    seed: int = 0,
    options: dict | None = None,
    workers: int = 1,
    provenance: Mapping[str, Any] | None = None,
    widths: Mapping[int, int] | None = None,
) -> tuple[list[tuple[int, int, object]], dict]:
    """Run the method's selector over ``heads`` (:func:`head_data`) and describe the result: the part of
    :func:`select_channels` after its inputs are read and checked.

    Args:
        heads: (layer, head, HeadData) with what the selector needs.
        method, pct, seed, options, workers: as for :func:`select_channels`.
        d_k: the heads' key dimension; num_heads: H (both recorded in the metadata).
        provenance: ``model`` and ``family`` for the metadata (None values are left out).
        widths: {layer: kept width} of a per-layer budget, or None for ``n_keep_for(d_k, pct)`` in every layer.

    Returns:
        (rows, meta) as :func:`select_channels` returns them.
    """
    spec = parse_method(method)
    selector = get_selector(spec.selector)
    if widths is None:
        n_keep = n_keep_for(d_k, pct)
        rows = select_heads(selector, heads, n_keep, spec.variant, seed, options or {}, workers=workers)
    else:
        rows = select_heads(selector, heads, dict(widths), spec.variant, seed, options or {}, workers=workers)
        extra = sorted(set(widths) - {r[0] for r in rows})  # select_heads refuses a layer the widths lack
        if extra:
            raise ValueError(f"the widths name layers {extra} that the model's linear-attention layers lack")
        n_keep = Cut("keys", d_k, {int(k): int(v) for k, v in widths.items()}).widths_meta()["d_k_new"]
    kinds = {"transform" if r[2].transform is not None else "index" for r in rows}
    if len(kinds) > 1:
        raise RuntimeError(f"selector {spec.selector!r} returned index and transform selections for different heads")
    meta = {
        "format": SELECTION_FORMAT,
        "kind": kinds.pop() if kinds else "index",
        **{k: v for k, v in (provenance or {}).items() if v is not None},
        "method": method,
        "selector": spec.selector,
        "variant": spec.variant,
        "calibration": spec.calib,
        "budget": spec.budget,
        "pct": pct,
        "d_k": d_k,
        "d_k_new": n_keep,
        "num_heads": int(num_heads),
        "seed": seed,
        "options": options or {},
        "package_version": __version__,
    }
    return rows, meta


# ---- value and joint cuts (``-v``, ``-kv``) ---------------------------------------------------------------------
def cut_needs(method: str) -> set[str]:
    """What a method's selection reads: "weights", "activations", "xnorm", "grad" (its key selector's needs for a key
    or joint cut, its value side's for a value or joint cut)."""
    spec = parse_method(method)
    needs = set(get_selector(spec.selector).needs) if spec.cut != "values" else {"weights"}
    if spec.cut != "keys":
        needs |= value_side_needs(spec) | {"weights"}
    return needs


def cut_code_files(method: str) -> list[str]:
    """:func:`selector_code_files` of the method's selector, with its value side's module for a value or joint cut."""
    spec = parse_method(method)
    files = selector_code_files(spec.selector)
    if spec.cut != "keys":
        files = sorted({*files, value_side(spec.selector).source_file})
    return files


def value_units(layers: Iterable[tuple[int, Mapping[str, np.ndarray]]], pool: bool = False):
    """Yield (layer, unit, ValueData) from per-layer arrays (``W_v``, ``W_o`` [HV, d_v, hidden], ``w_norm`` [1 or HV,
    d_v], ``V`` [HV, rows, d_v], ``grad_v`` [HV, d_v]; absent ones stay None): one unit per value head (a norm weight
    that the heads share is every head's). With ``pool``, where the heads share their output norm (``w_norm`` has one
    row) the layer is one unit instead (heads pooled: V stacked, weights side by side, Grad summed): one selection
    per layer, which ``dev/value_sharing.py`` compares with one per head."""
    for layer, a in layers:
        hv = next(a[n].shape[0] for n in ("W_v", "W_o", "V", "grad_v") if n in a)
        shared = "w_norm" in a and a["w_norm"].shape[0] == 1
        if shared and pool:
            yield layer, 0, ValueData(
                W_v=np.concatenate(list(a["W_v"]), axis=1) if "W_v" in a else None,
                W_o=np.concatenate(list(a["W_o"]), axis=1) if "W_o" in a else None,
                w_norm=a["w_norm"][0],
                V=np.concatenate(list(a["V"]), axis=0) if "V" in a else None,
                grad_v=a["grad_v"].sum(axis=0) if "grad_v" in a else None)
            continue
        for h in range(hv):
            yield layer, h, ValueData(**{n: a[n][h] for n in ("W_v", "W_o", "V", "grad_v") if n in a},
                                      w_norm=a["w_norm"][0 if shared else h] if "w_norm" in a else None)


# ---- the split of a joint cut (``-kv@<budget>``, policy ``split``) -----------------------------------------------
def state_split_per_layer(model, blocks, batch: int, cuts: Mapping[tuple[int, int], tuple[dict, dict]],
                     uniform: tuple[int, int], uniform_loss: float, d_k: int, d_v: int,
                     progress: bool = True) -> dict[str, Any]:
    """A split policy's ``per_layer`` choice: each layer in turn takes each candidate (``cuts``: its selections,
    :func:`cut_tensors`) with the other layers whole, as the sensitivity budget measures a layer, and keeps its
    candidate of lowest calibration loss (ties: the candidate nearer the equal split, as the uniform choice). The
    combination's loss is measured; it is the artifact's choice where it is below the best uniform split's
    (``uniform_loss``), else every layer takes ``uniform``.

    Returns:
        the split artifact's ``per_layer`` entry: ``widths`` ({layer: [d_k', d_v']} chosen), ``loss`` (theirs),
        ``combination_loss`` (the per-layer combination's, whether chosen or not), ``state_fraction`` (the mean
        over layers) and ``layer_losses`` ({layer: {"<d_k'>x<d_v'>": loss}}).
    """
    from tqdm.auto import tqdm

    from statereduce.core.slicing import masked_cut

    layers = sorted(cuts[uniform][0])

    def loss_of(choice: Mapping[int, tuple[int, int]]) -> float:
        keys = {layer: cuts[pair][0][layer] for layer, pair in choice.items()}
        values = {layer: cuts[pair][1][layer] for layer, pair in choice.items()}
        with masked_cut(model, keys, values):
            return calibration_loss(model, blocks, batch)

    layer_losses: dict[int, dict[tuple[int, int], float]] = {}
    with tqdm(total=len(layers) * len(cuts), desc="split per layer", unit="pair", disable=not progress) as bar:
        for layer in layers:
            layer_losses[layer] = {}
            for pair in cuts:
                layer_losses[layer][pair] = loss_of({layer: pair})
                bar.update()
    chosen = {layer: min(losses, key=lambda c: (losses[c], abs(c[0] / d_k - c[1] / d_v)))
              for layer, losses in layer_losses.items()}
    combination = loss_of(chosen)
    log.info("per layer: %s, loss %.5f (the best uniform split %dx%d: %.5f)",
             ", ".join(f"{layer}: {k}x{v}" for layer, (k, v) in chosen.items()), combination, *uniform, uniform_loss)
    if combination >= uniform_loss:
        chosen, loss = {layer: uniform for layer in layers}, uniform_loss
    else:
        loss = combination
    return {
        "widths": {str(layer): list(pair) for layer, pair in chosen.items()},
        "loss": loss,
        "combination_loss": combination,
        "state_fraction": sum(k * v for k, v in chosen.values()) / (len(layers) * d_k * d_v),
        "layer_losses": {str(layer): {f"{k}x{v}": x for (k, v), x in losses.items()}
                         for layer, losses in layer_losses.items()},
    }


def state_split_joint(model, blocks, batch: int, select, cuts: Mapping[tuple[int, int], tuple[dict, dict]],
                      uniform: tuple[int, int], uniform_loss: float, base_loss: float, *, d_k: int, d_v: int,
                      pct: float, settings, check=None, progress: bool = True) -> dict[str, Any]:
    """A ``joint`` budget's choice: one d_k' x d_v' per layer, its share of the state and its split chosen together.

    Every layer takes, with the other layers whole, every pair of :func:`statereduce.core.budgets.joint_pairs` (the
    budget's key widths times its value widths, the whole layer, and the uniform split candidates ``cuts``) that some
    choice within :data:`statereduce.core.budgets.JOINT_TOLERANCE` of the pct's total state can hold
    (:func:`statereduce.core.budgets.joint_usable`), and its calibration loss is measured with the dropped channels
    zeroed; the channels of each width come from the selector (``select(widths=pair)``: :func:`select_channels`, one
    call per key or value width, the uniform candidates' reused). :func:`statereduce.core.budgets.joint_allocate`
    then picks one pair per layer with the least summed loss increase whose total state is within 1% of the pct's.
    The combination's loss is measured; it is the artifact's choice where it is below the best uniform split's
    (``uniform_loss``), else every layer takes ``uniform``.

    Returns:
        the split artifact's ``per_layer`` entry: ``policy`` ("joint"), ``widths`` ({layer: [d_k', d_v']} chosen),
        ``kept`` ("joint" or "uniform"), ``loss`` (the chosen widths'), ``combination`` and ``combination_loss`` (the
        knapsack's choice and its loss, whether kept or not), ``predicted_increase`` (its summed single-layer
        increases), the total state per head (``state_total``: sum over layers of d_k' d_v'), the pct's
        (``target_total``), the bounds, the best uniform split's (``uniform_total``) and the ratios to the two,
        ``state_fraction`` (the mean over layers), ``pairs`` (the pairs measured) and ``layer_losses`` ({layer:
        {"<d_k'>x<d_v'>": loss}}, the whole layer's being the unpruned loss).
    """
    from tqdm.auto import tqdm

    from statereduce.core.slicing import cut_tensors, masked_cut

    layers = sorted(cuts[uniform][0])
    target, lo, hi = joint_bounds(d_k, d_v, pct, len(layers))
    pairs = joint_usable(joint_pairs(d_k, d_v, settings, check, list(cuts)), len(layers), lo, hi)
    if not pairs:
        raise ValueError(f"no (d_k', d_v') of d_k x d_v = {d_k} x {d_v} keeps a total state within "
                         f"{JOINT_TOLERANCE:.0%} of {target:g} over {len(layers)} layers")
    keys = {k: cut[0] for (k, _), cut in cuts.items() if k < d_k}  # the kept channels of each width
    values = {v: cut[1] for (_, v), cut in cuts.items() if v < d_v}
    for k, v in pairs:
        if (k < d_k and k not in keys) or (v < d_v and v not in values):
            sel_keys, sel_values = cut_tensors(select(widths=(k, v))[0])
            keys.setdefault(k, sel_keys)
            values.setdefault(v, sel_values)

    def loss_of(choice: Mapping[int, tuple[int, int]]) -> float:
        with masked_cut(model, {layer: keys[k][layer] for layer, (k, _) in choice.items() if k < d_k},
                        {layer: values[v][layer] for layer, (_, v) in choice.items() if v < d_v}):
            return calibration_loss(model, blocks, batch)

    layer_losses: dict[int, dict[tuple[int, int], float]] = {}
    with tqdm(total=len(layers) * len(pairs), desc="joint per layer", unit="pair", disable=not progress) as bar:
        for layer in layers:
            layer_losses[layer] = {}
            for pair in pairs:
                layer_losses[layer][pair] = base_loss if pair == (d_k, d_v) else loss_of({layer: pair})
                bar.update()
            if (d_k, d_v) not in layer_losses[layer]:
                layer_losses[layer][d_k, d_v] = base_loss
    increases = [{pair: x - base_loss for pair, x in layer_losses[layer].items() if pair in pairs} for layer in layers]
    combination = dict(zip(layers, joint_allocate(increases, lo, hi, target=target, d_k=d_k, d_v=d_v)))
    combination_loss = loss_of(combination)
    predicted = sum(layer_losses[layer][pair] - base_loss for layer, pair in combination.items())
    log.info("joint: %s (state %d of %g), loss %.5f, predicted %+.5f (the best uniform split %dx%d: %.5f)",
             ", ".join(f"{layer}: {k}x{v}" for layer, (k, v) in combination.items()),
             sum(k * v for k, v in combination.values()), target, combination_loss, predicted, *uniform, uniform_loss)
    if combination_loss < uniform_loss:
        chosen, loss, kept = combination, combination_loss, "joint"
    else:
        chosen, loss, kept = {layer: uniform for layer in layers}, uniform_loss, "uniform"
    total = sum(k * v for k, v in chosen.values())
    uniform_total = len(layers) * uniform[0] * uniform[1]
    return {
        "policy": "joint",
        "widths": {str(layer): list(pair) for layer, pair in chosen.items()},
        "kept": kept,
        "loss": loss,
        "combination": {str(layer): list(pair) for layer, pair in combination.items()},
        "combination_loss": combination_loss,
        "predicted_increase": predicted,
        "state_total": total,
        "target_total": target,
        "bounds": [lo, hi],
        "ratio": total / target,
        "uniform_total": uniform_total,
        "ratio_to_uniform": total / uniform_total,
        "state_fraction": total / (len(layers) * d_k * d_v),
        "pairs": [list(pair) for pair in pairs],
        "layer_losses": {str(layer): {f"{k}x{v}": x for (k, v), x in sorted(losses.items())}
                         for layer, losses in layer_losses.items()},
    }


def equal_split(d_k: int, d_v: int, pct: float, check) -> list[int] | None:
    """The equal split of the state at ``pct`` (:func:`~statereduce.core.cuts.joint_widths`) as the split artifact
    records it, or None where the family holds no such pair."""
    try:
        return list(joint_widths(d_k, d_v, pct, check))
    except ValueError:
        return None


def measure_splits(model, blocks, batch: int, candidates: list[tuple[int, int]], select, d_k: int, d_v: int,
                   base_loss: float, progress: bool = True) -> tuple[list[dict[str, Any]], dict]:
    """Each candidate pair (d_k', d_v') selected on both sides (``select(widths=pair)``: :func:`select_channels`) and
    measured: the calibration loss with the dropped key and value channels zeroed. Returns (one row per candidate:
    widths, state share, loss; {pair: its kept channels, :func:`~statereduce.core.slicing.cut_tensors`})."""
    from tqdm.auto import tqdm

    from statereduce.core.slicing import cut_tensors, masked_cut

    rows, cuts = [], {}
    for k, v in tqdm(candidates, desc="split", unit="pair", disable=not progress):
        sel_rows, _ = select(widths=(k, v))
        cuts[k, v] = cut_tensors(sel_rows)
        with masked_cut(model, *cuts[k, v]):
            loss = calibration_loss(model, blocks, batch)
        rows.append({"d_k_new": k, "d_v_new": v, "state_fraction": k * v / (d_k * d_v), "loss": loss})
        log.info("d_k'=%d x d_v'=%d (%.4f of the state): loss %.5f (+%.5f)", k, v, k * v / (d_k * d_v), loss,
                 loss - base_loss)
    return rows, cuts


def choose_state_split(weights: str | Path, method: str, pct: float, plan: BudgetPlan, *,
                 activations: str | Path | None = None, grads: str | Path | None = None,
                 base: str | Path | None = None, seed: int = 0, options: Mapping[str, Any] | None = None,
                 workers: int = 1, expect: Mapping[str, Any] | None = None, model=None, blocks=None,
                 progress: bool = True) -> dict[str, Any]:
    """Rule ``split``: the split artifact of a joint cut ``method`` (``<selector>-kv@<budget>``) at ``pct``.

    Every pair of :func:`statereduce.core.cuts.state_split_candidates` at the pct's state (from the key-only cut through the
    equal split to the value-only cut, the key widths between them those the budget allows: ``floor``, ``multiple``,
    ``powers_of_two``) is selected on both sides (:func:`select_channels`) and measured: the calibration loss of the whole
    model with the dropped key and value channels zeroed (:func:`statereduce.core.slicing.masked_cut`), which is the
    loss of the checkpoint pruned to that pair under ``norm_eps: exact``. The pair of lowest loss is every layer's
    d_k' x d_v'. ``results/{model}/select/{method}_{pct}.split.json`` holds it, every candidate's widths, state share
    and loss, the unpruned loss, the settings and the provenance; the selection of the same token reads it
    (:func:`statereduce.core.cuts.read_state_split`). Cost: one selection of both sides and one pass over the calibration
    sequences per candidate. With ``per_layer`` (policy ``split``) each layer may then take its own candidate
    (:func:`state_split_per_layer`); with policy ``joint`` each layer its own share of the state and its split
    (:func:`state_split_joint`): the artifact's ``per_layer`` entry, which the selection reads before the uniform pair.

    Args:
        weights, activations, grads: the artifacts the joint cut's selection reads (as for
            :func:`select_channels`).
        method, pct: the method token and the percent of the state removed.
        plan: the token's budget (:class:`~statereduce.common.settings.BudgetPlan`, policy ``split`` or ``joint``),
            with the
            calibration and corpus of the loss.
        base: the base checkpoint folder (the model whose loss is measured).
        seed, options, workers: the selector's seed, options and threads.
        expect: the job's ``params.info`` (model, family, dtype, device).
        model, blocks: the loaded model and calibration blocks [N, T] instead of ``base`` and the plan's corpus.

    Raises:
        ValueError: one line, for a token that is not a joint cut with a budget, or a budget of another policy.
    """
    spec, settings = parse_method(method), plan.settings
    if spec.cut != "joint" or spec.budget is None:
        raise ValueError(f"method {method!r}: a split is chosen for a joint cut with a budget, "
                         f"e.g. {format_method(spec.uniform.keys)}-kv@{plan.name or 'split'}")
    if settings.policy not in JOINT_POLICIES:
        raise ValueError(f"budgets.{plan.name}: policy {settings.policy!r} chooses per-layer key widths; a joint cut "
                         f"(-kv@{plan.name}) takes policy 'split' or 'joint'")
    wattrs = H5Artifact(weights).expect(expect)
    d_k, d_v, family = int(wattrs["head_k_dim"]), int(wattrs["head_v_dim"]), wattrs.get("family")
    check = state_pair_check(family, d_k, d_v, settings.engine)
    candidates = state_split_candidates(d_k, d_v, pct, allowed_widths(d_k, settings), check)
    if model is None:
        model, blocks, settings = loss_inputs(plan, base, expect)
    else:
        settings = settings.replace(batch_size=settings.batch_size or blocks.shape[0])
    batch = settings.batch_size
    base_loss = calibration_loss(model, blocks, batch)
    select = functools.partial(select_channels, weights, method, pct, activations=activations, grads=grads,
                               seed=seed, options=dict(options or {}), workers=workers, expect=expect)
    rows, cuts = measure_splits(model, blocks, batch, candidates, select, d_k, d_v, base_loss, progress)
    best = min(rows, key=lambda r: (r["loss"], abs(r["d_k_new"] / d_k - r["d_v_new"] / d_v)))
    layers = [int(x) for x in np.asarray(wattrs["layers"]).tolist()]
    provenance = {"model": (expect or {}).get("model") or wattrs.get("model"), "family": family}
    per_layer = None
    if settings.policy == "joint":
        per_layer = state_split_joint(model, blocks, batch, select, cuts, (best["d_k_new"], best["d_v_new"]),
                                      best["loss"], base_loss, d_k=d_k, d_v=d_v, pct=pct, settings=settings,
                                      check=check, progress=progress)
    elif settings.per_layer:
        per_layer = state_split_per_layer(model, blocks, batch, cuts, (best["d_k_new"], best["d_v_new"]), best["loss"],
                                     d_k, d_v, progress)
    return {
        "format": STATE_SPLIT_FORMAT,
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
        "equal": equal_split(d_k, d_v, pct, check),
        "base_loss": base_loss,
        "candidates": rows,
        **({"per_layer": per_layer} if per_layer is not None else {}),
        "n_samples": int(blocks.shape[0]),
        "seq_len": int(blocks.shape[1]),
        "seed": seed,
        "options": dict(options or {}),
        "package_version": __version__,
    }
