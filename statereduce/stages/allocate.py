"""Per-layer key budgets in the workflow (rule ``allocate``): one kept width d_k' per layer at the uniform cut's total.

A method token ending in ``@<budget>`` (``drrqr@energy_75``) names a budget of the config's ``budgets`` block
(:class:`statereduce.common.settings.BudgetSettings`). Its allocation,
``results/{model}/select/{method}_{pct}.allocation.json``, holds each pruned layer's width, the policy's value of
every candidate width, and the statistics behind them; the selection of the same token
(:func:`statereduce.stages.select.select_channels`) runs the selector with each layer's width, and pruning
(:func:`statereduce.stages.prune.prune_model`) writes a checkpoint whose layers keep different widths
(``statereduce_key_dims`` in its config; :func:`statereduce.core.models.load_model` loads it).

Every allocation keeps ``n_keep_for(d_k, pct) * layers`` channels per head position in all (every linear-attention
layer has the same heads and d_v, so the state bytes equal the uniform cut's), with widths from
:func:`statereduce.core.budgets.allowed_widths` (a floor, multiples of ``multiple`` or the full d_k, and widths the
family's config can express). The policies (:mod:`statereduce.core.budgets` solves the exact knapsack over their
values):

* ``uniform``: the uniform width in every layer (the plain method's selection and checkpoint, byte for byte);
* ``spectrum``: each layer's calibration second moment of [K; Q] (K or Q alone for ``-k``/``-q``), per head, with
  its sorted eigenvalues summed over the layer's heads: ``energy`` (the share of the trace in the top w) or
  ``effective_rank`` (:func:`statereduce.core.budgets.spectrum_values`);
* ``greedy``: per head the share of the selector's own objective its selection of each width captures
  (:meth:`statereduce.selectors.Selector.objective_values`: DRRQR's captured energy, Grad's score mass), averaged
  over the layer's heads, or its raw value (``normalize: false``);
* ``sensitivity``: the calibration loss with one layer alone cut to each width by the selector (the others whole),
  measured on the model (:func:`sensitivity_losses`): ``layers x (candidates - 1)`` forwards over the calibration
  sequences. On the tiny models (4 layers, 7 widths, 16 x 256 tokens) 15-20 s on a CPU; a 24-layer 1.3B model with
  d_k 128 and multiples of 16 takes 24 x 7 = 168 forwards of the calibration set.

The values of the two measured policies (:data:`MEASURED`) do not depend on the pct: rule ``budget_values`` measures
them once per model, method and budget (``results/{model}/select/{method}.values.json``, :func:`budget_values`), and
the allocation of every pct reads them (:func:`read_values`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from statereduce import __version__
from statereduce.core.budgets import (
    ALLOCATION_FORMAT,
    Allocation,
    allowed_widths,
    check_budget,
    check_budget_selector,
    effective_rank,
    policy_needs,
    sensitivity_values,
    spectrum_values,
)
from statereduce.selectors import HeadData, get_selector, head_rng, n_keep_for, parse_method
from statereduce.common.settings import BudgetPlan, BudgetSettings
from statereduce.core.calib_loss import calibration_loss, loss_inputs  # noqa: F401  (calibration_loss re-exported)
from statereduce.core.artifacts import ArtifactError, read_json_artifact, remedy
from statereduce.core.h5files import H5Artifact, layer_head_data
from statereduce.families import family_spec

log = logging.getLogger(__name__)

MEASURED = ("greedy", "sensitivity")
"""The budget policies whose per-width values run the selector (and, for ``sensitivity``, the model)."""
VALUES_FORMAT = 1


def _sides(data: HeadData, variant: str) -> list[np.ndarray | None]:
    """The head's calibration rows the variant scores from: [K, Q], [K] or [Q] (None where absent)."""
    return [getattr(data, f) for f in ("K", "Q") if variant in ("kq", f.lower())]


def spectrum_eigenvalues(layers: Iterable[tuple[int, list[HeadData]]], variant: str) -> dict[int, np.ndarray]:
    """Per layer the eigenvalues of each head's calibration second moment ``M^T M / rows`` (M = [K; Q], K or Q),
    each sorted descending, summed over the layer's heads."""
    out = {}
    for layer, heads in layers:
        total = None
        for data in heads:
            mats = _sides(data, variant)
            if any(m is None for m in mats):
                need = "K and Q" if variant == "kq" else variant.upper()
                raise ValueError(f"layer {layer}: the spectrum budget needs calibration {need}")
            M = np.concatenate([np.asarray(m, np.float64) for m in mats])
            lam = np.sort(np.linalg.eigvalsh(M.T @ M / M.shape[0]))[::-1]
            total = lam if total is None else total + lam
        out[int(layer)] = total
    return out


def greedy_layer_values(layers: Iterable[tuple[int, list[HeadData]]], selector: str, widths: list[int], *,
                        variant: str, seed: int, options: Mapping[str, Any],
                        normalize: bool) -> dict[int, dict[int, float]]:
    """Per layer ``{width: value}``: the heads' mean share of the selector's objective (``normalize``), or with
    ``normalize=False`` the shares times each head's raw objective total (score sum; DRRQR: ``||M||_F^2``)."""
    sel = get_selector(selector)
    out = {}
    for layer, heads in layers:
        acc = {w: 0.0 for w in widths}
        for head, data in enumerate(heads):
            shares = sel.objective_values(data, widths, variant=variant, rng=head_rng(seed, layer, head), **options)
            scale = 1.0 / len(heads) if normalize else _objective_total(sel, data, variant, seed, layer, head, options)
            for w in widths:
                acc[w] += scale * shares[w]
        out[int(layer)] = acc
    return out


def _objective_total(sel, data: HeadData, variant: str, seed: int, layer: int, head: int, options) -> float:
    """A head's raw objective at full width: its channel scores' sum, or (DRRQR) the squared norm of its M."""
    if sel.objective is not None:
        return float(sum(np.sum(np.asarray(m, np.float64) ** 2) for m in _sides(data, variant) if m is not None))
    return float(np.sum(sel(data, data.d_k, variant=variant, rng=head_rng(seed, layer, head), **options).scores))


def sensitivity_losses(model, blocks, layers: Iterable[tuple[int, list[HeadData]]], selector: str, widths: list[int],
                       *, variant: str, seed: int, options: Mapping[str, Any], batch_size: int,
                       progress: bool = True) -> tuple[float, dict[int, dict[int, float]]]:
    """The calibration loss with one layer alone cut to each width (its heads' channels chosen by the selector at
    that width, the dropped ones zeroed: :func:`statereduce.core.slicing.masked_channels`), the other layers whole.

    Returns:
        (the unpruned model's loss, {layer: {width: loss}}), the full width's loss being the unpruned one.
    """
    import torch
    from tqdm.auto import tqdm

    from statereduce.adapters import get_adapter
    from statereduce.core.slicing import masked_channels

    adapter = get_adapter(model)
    mixers = dict(adapter.mixer_layers())
    d_k = adapter.head_k_dim
    sel = get_selector(selector)
    base = calibration_loss(model, blocks, batch_size)
    layers = list(layers)
    cut = [w for w in widths if w < d_k]
    out = {}
    with tqdm(total=len(layers) * len(cut), desc="sensitivity", unit="cut", disable=not progress) as bar:
        for layer, heads in layers:
            losses = {d_k: base}
            for w in cut:
                keep = [sel(data, w, variant=variant, rng=head_rng(seed, layer, head), **options).keep
                        for head, data in enumerate(heads)]
                with masked_channels(adapter, mixers[int(layer)], torch.as_tensor(np.stack(keep))):
                    losses[w] = calibration_loss(model, blocks, batch_size)
                bar.update()
            out[int(layer)] = losses
            log.info("layer %d: loss increase %s", layer, {w: round(v - base, 5) for w, v in sorted(losses.items())})
    return base, out


def measured_values(method: str, settings: BudgetSettings, widths: list[int], *, d_k: int, layers: list[int],
                    layer_data, seed: int = 0, options: Mapping[str, Any] | None = None, model=None,
                    blocks=None) -> tuple[list[dict[int, float]], dict[str, Any]]:
    """A measured policy's (:data:`MEASURED`) per-layer ``{width: value}`` over ``widths``, in the order of
    ``layers``, and its statistics; the arguments as for :func:`allocation_document`. Nothing here depends on the
    pct."""
    spec = parse_method(method)
    options = dict(options or {})
    if settings.policy == "greedy":
        by_layer = greedy_layer_values(layer_data(), spec.selector, widths, variant=spec.variant, seed=seed,
                                       options=options, normalize=settings.normalize)
        values = [by_layer[i] for i in layers]
        return values, {"value_at_full": [v[max(v)] for v in values], "normalize": settings.normalize}
    if settings.policy != "sensitivity":
        raise ValueError(f"budget policy {settings.policy!r} is not measured; measured: {', '.join(MEASURED)}")
    if model is None or blocks is None:
        raise ValueError("the sensitivity budget needs the model and calibration blocks")
    batch = settings.batch_size or blocks.shape[0]
    base, losses = sensitivity_losses(model, blocks, layer_data(), spec.selector, widths, variant=spec.variant,
                                      seed=seed, options=options, batch_size=batch)
    values = sensitivity_values([losses[i] for i in layers], d_k=d_k)
    return values, {"base_loss": base, "losses": [[losses[i][w] for w in sorted(losses[i])] for i in layers],
                    "n_samples": int(blocks.shape[0]), "seq_len": int(blocks.shape[1])}


def _header(fmt: int, provenance: Mapping[str, Any] | None, method: str, budget: str,
            settings: BudgetSettings) -> dict[str, Any]:
    """The first entries of an allocation or budget values document: format, provenance, the method token's parts,
    the budget and its settings."""
    spec = parse_method(method)
    return {"format": fmt, **{k: v for k, v in (provenance or {}).items() if v is not None}, "method": method,
            "selector": spec.selector, "variant": spec.variant, "calibration": spec.calib, "budget": budget,
            "settings": settings.to_dict()}


def allocation_document(method: str, pct: float, budget: str, settings: BudgetSettings, *, d_k: int, num_heads: int,
                        layers: list[int], layer_data, check_width=None, seed: int = 0,
                        options: Mapping[str, Any] | None = None, model=None, blocks=None,
                        provenance: Mapping[str, Any] | None = None,
                        measured: tuple[list[dict[int, float]], dict[str, Any]] | None = None) -> dict[str, Any]:
    """The allocation artifact of ``method`` (with ``@budget``) at ``pct``: widths, values, statistics, provenance.

    Args:
        method: the method token (its selector, variant and calibration).
        pct: percent of key channels removed (the total is the uniform cut's at this pct).
        budget: the budget id; settings: its :class:`BudgetSettings`.
        d_k, num_heads, layers: the model's head sizes and pruned layers (in order).
        layer_data: a callable returning an iterable of ``(layer, [HeadData per head])`` with what the policy needs
            (called once per pass).
        check_width: raises ValueError for a width the family's config cannot express.
        seed, options: the selector's seed and options (as for its selection).
        model, blocks: the loaded model and calibration token blocks [N, T] (``sensitivity`` only).
        provenance: model, family, base checkpoint for the document.
        measured: a measured policy's values and statistics (:func:`measured_values`, :func:`read_values`) when
            they were measured before; None: measured here.
    """
    spec = parse_method(method)
    n_keep = n_keep_for(d_k, pct)
    n_layers = len(layers)
    total = n_keep * n_layers
    widths = check_budget(settings, spec.selector, d_k=d_k, n_layers=n_layers, pct=pct, check_width=check_width)
    options = dict(options or {})
    stats: dict[str, Any] = {}
    if settings.policy == "uniform":
        alloc = Allocation(widths=(n_keep,) * n_layers, total=total, policy="uniform")
    elif settings.policy == "spectrum":
        eigs = spectrum_eigenvalues(layer_data(), spec.variant)
        values = spectrum_values([eigs[i] for i in layers], widths, mode=settings.statistic)
        alloc = Allocation.solve(values, total, settings.statistic)
        stats = {"eigenvalues": [eigs[i].tolist() for i in layers],
                 "effective_rank": [effective_rank(eigs[i]) for i in layers],
                 "energy_at_uniform": [float(np.cumsum(eigs[i])[n_keep - 1] / eigs[i].sum()) for i in layers]}
    else:  # greedy, sensitivity
        if measured is None:
            measured = measured_values(method, settings, widths, d_k=d_k, layers=layers, layer_data=layer_data,
                                       seed=seed, options=options, model=model, blocks=blocks)
        values, stats = measured
        if len(values) != n_layers or any(set(v) != set(widths) for v in values):
            raise ValueError(f"the measured values are of widths {[sorted(v) for v in values]} in {len(values)} "
                             f"layers; the budget allows {widths} in {n_layers}")
        alloc = Allocation.solve(values, total, settings.policy)
    if sum(alloc.widths) != total:  # pragma: no cover - allocate meets the total exactly
        raise RuntimeError(f"allocation {alloc.widths} misses the total {total}")
    return {
        **_header(ALLOCATION_FORMAT, provenance, method, budget, settings),
        "pct": pct,
        "d_k": d_k,
        "num_heads": num_heads,
        "layers": list(layers),
        "uniform_width": n_keep,
        "key_dims": {str(i): w for i, w in zip(layers, alloc.widths)},
        "allocation": alloc.to_dict(),
        "statistics": stats,
        "seed": seed,
        "options": options,
        "package_version": __version__,
    }


def _budget_inputs(weights: str | Path, method: str, plan: BudgetPlan, *, activations, grads, base, expect,
                   load: bool) -> dict[str, Any]:
    """What rules allocate and budget_values read: head sizes, layers, the per-layer data callable, the width check,
    the provenance, the settings as recorded (``sensitivity``: with its batch size), and with ``load`` the model and
    calibration blocks of the sensitivity loss."""
    spec, settings, head_v_dim = parse_method(method), plan.settings, plan.head_v_dim
    wattrs = H5Artifact(weights).expect(expect)
    d_k, h, family = int(wattrs["head_k_dim"]), int(wattrs["num_heads"]), wattrs.get("family")
    layers = [int(x) for x in np.asarray(wattrs["layers"]).tolist()]
    calib_expect = {**(expect or {}), "calibration": spec.calib, "num_heads": h, "head_k_dim": d_k}
    for path in (activations, grads):
        if path is not None:
            H5Artifact(path).expect(calib_expect)
    needs = policy_needs(settings, spec.selector)

    def layer_data():
        return layer_head_data(Path(weights), needs, Path(activations) if activations else None,
                               Path(grads) if grads else None)

    check_width = None
    if head_v_dim is not None and family is not None:
        check_width = lambda w: family_spec(family).check_reduction(d_k, int(head_v_dim), w)  # noqa: E731
    model = blocks = None
    if settings.policy == "sensitivity":
        model, blocks, settings = loss_inputs(plan, base, expect, load=load)
    provenance = {"model": (expect or {}).get("model") or wattrs.get("model"), "family": family,
                  "base_checkpoint": json.loads(wattrs["base_checkpoint"]) if wattrs.get("base_checkpoint") else None}
    return {"d_k": d_k, "num_heads": h, "layers": layers, "layer_data": layer_data, "check_width": check_width,
            "settings": settings, "model": model, "blocks": blocks, "provenance": provenance}


def budget_values(weights: str | Path, method: str, plan: BudgetPlan, *, activations: str | Path | None = None,
                  grads: str | Path | None = None, base: str | Path | None = None, seed: int = 0,
                  options: Mapping[str, Any] | None = None, expect: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Rule ``budget_values``: the per-width values of a measured policy (:data:`MEASURED`) for ``method`` (ending in
    ``@budget``), for the allocation of every pct (``results/{model}/select/{method}.values.json``): each layer's
    allowed widths and their values, the policy's statistics, the settings and the provenance. The arguments are
    those of :func:`allocate_budget`, without the pct."""
    settings, budget, spec = plan.settings, plan.name, parse_method(method)
    if settings.policy not in MEASURED:
        raise ValueError(f"budgets.{budget}: policy {settings.policy!r} has no measured values; measured: "
                         f"{', '.join(MEASURED)}")
    check_budget_selector(settings, spec.selector)
    got = _budget_inputs(weights, method, plan, activations=activations, grads=grads, base=base, expect=expect,
                         load=True)
    d_k, layers, settings = got["d_k"], got["layers"], got["settings"]
    widths = allowed_widths(d_k, settings, got["check_width"], nonempty=True)
    values, stats = measured_values(method, settings, widths, d_k=d_k, layers=layers, layer_data=got["layer_data"],
                                    seed=seed, options=options, model=got["model"], blocks=got["blocks"])
    return {
        **_header(VALUES_FORMAT, got["provenance"], method, budget, settings),
        "d_k": d_k,
        "num_heads": got["num_heads"],
        "layers": layers,
        "widths": widths,
        "values": [{str(w): v for w, v in layer.items()} for layer in values],
        "statistics": stats,
        "seed": seed,
        "options": dict(options or {}),
        "package_version": __version__,
    }


def read_values(path: str | Path, expect: Mapping[str, Any] | None = None) -> tuple[list[dict[int, float]],
                                                                                     dict[str, Any]]:
    """The per-layer ``{width: value}`` and statistics of a budget values file (:func:`budget_values`), checked
    against ``expect`` (the reading job's model, family, method, settings, d_k, layers, seed and options).

    Raises:
        ArtifactError: one line naming the file and the rule that rebuilds it.
    """
    expect = dict(expect or {})
    doc = read_json_artifact(path, "budget values", VALUES_FORMAT, "values", expect)
    for key in ("settings", "d_k", "layers", "seed", "options"):
        if key in expect and doc.get(key) != expect[key]:
            raise ArtifactError(f"{path} was measured with {key}={doc.get(key)!r}; this job has {expect[key]!r}; "
                                f"{remedy(path)}")
    return [{int(w): v for w, v in layer.items()} for layer in doc["values"]], doc["statistics"]


def allocate_budget(weights: str | Path, method: str, pct: float, plan: BudgetPlan, *,
                    activations: str | Path | None = None, grads: str | Path | None = None,
                    base: str | Path | None = None, seed: int = 0, options: Mapping[str, Any] | None = None,
                    values: str | Path | None = None, expect: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Rule ``allocate``: the allocation artifact of ``method`` (ending in ``@budget``) at ``pct``.

    Args:
        weights: the model's ``qk.h5`` (head sizes, pruned layers; the weights where the selector reads them).
        method, pct: the method token and percent of key channels removed.
        plan: the token's budget (:class:`~statereduce.common.settings.BudgetPlan`: its id and settings, d_v, and the
            calibration and corpus spec of the sensitivity loss's sequences).
        activations, grads: the calibration artifacts the policy and the selector read.
        base: the base checkpoint folder (sensitivity: the model whose loss is measured).
        seed, options: the selector's seed and options.
        values: a measured policy's values file (:func:`budget_values`, the workflow's); None: measured here.
        expect: the job's ``params.info`` (model, family, dtype, device): every input must have been written for it.
    """
    got = _budget_inputs(weights, method, plan, activations=activations, grads=grads, base=base, expect=expect,
                         load=values is None)
    settings, measured = got["settings"], None
    if values is not None and settings.policy in MEASURED:
        measured = read_values(values, {**(expect or {}), "method": method, "settings": settings.to_dict(),
                                        "d_k": got["d_k"], "layers": got["layers"], "seed": seed,
                                        "options": dict(options or {})})
    return allocation_document(method, pct, plan.name, settings, d_k=got["d_k"], num_heads=got["num_heads"],
                               layers=got["layers"], layer_data=got["layer_data"], check_width=got["check_width"],
                               seed=seed, options=options, model=got["model"], blocks=got["blocks"],
                               provenance=got["provenance"], measured=measured)
