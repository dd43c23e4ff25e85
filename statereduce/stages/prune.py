"""Slice selected key/query channels out of a linear-attention checkpoint (paper Sec. 3.3-3.4).

Per head h, a selector keeps an index set I_h of d_k' of the d_k key/query channels; the same
indices apply to the query and the key channels wherever they sit: fla's separate ``q_proj``/``k_proj``
and q/k short convs, or the fused input projection and convolution of Mamba-2 (B and C per group) and
Qwen3.5 (``in_proj_qkv``, ``conv1d``). The adapter names those modules and rows
(:meth:`~statereduce.adapters.MixerLayout.channel_rows`); two small verbs (:func:`slice_rows`,
:func:`set_mixer_dims`) change weights and shape metadata together, driven by one orchestrator,
:func:`prune_model`, which also rewrites ``model.config`` through the adapter and returns a
:class:`PruneRecord` of every decision. :func:`save_pruned` writes the stock HF checkpoint, the tokenizer
and ``prune_record.json`` atomically.

Kernel scale: the pruned checkpoint uses the stock classes, whose delta-rule kernels (DeltaNet, Gated
DeltaNet, Qwen3.5) use ``scale = d_k'**-0.5`` instead of the original ``d_k**-0.5``. q and k are L2-normalised
(or sum-normalised) in the kernel and the state does not depend on the q scale, so the mixer output is
``c = sqrt(d_k/d_k')`` times that of the original with the dropped q/k channels zeroed (after conv and
activation). It passes through the per-head output RMSNorm, and ``RMSNorm(c o; eps) = RMSNorm(o; eps/c^2)``: the
pruned model equals zero-masking exactly when that norm's eps is multiplied by ``c^2 = d_k/d_k'``. The config
holds one eps for that norm and the block norms (the spec's ``norm_eps_field``), so :func:`prune_model` offers
two choices (``norm_eps``, ``PruneSettings.valid("norm_eps")``):

- ``"stock"``: the checkpoint keeps the stock eps and differs from zero-masking by that eps effect only; the record
  says so (``kernel_scale``).
- ``"exact"`` (the default, :class:`~statereduce.common.settings.PruneSettings`'s, which the workflow's ``prune`` block
  also starts from; :func:`exact_norm_eps`): the config's eps is multiplied by c^2, and every norm other than the
  mixers' output norms is made to see a c times larger input, which an RMSNorm ignores apart from its eps
  (``RMSNorm(c x; eps c^2) = RMSNorm(x; eps)``): the residual stream is multiplied by c (the input embedding and
  every module that adds into it, ``adapter.norms().residual_writers``), and so are the projections that feed norms off
  the residual stream (Qwen3.5's attention q_norm/k_norm, ``norm_input_rows``). Every block norm then sees
  ``c h`` with ``eps c^2``, every mixer output norm ``c o`` with ``eps c^2``, every residual writer adds c times
  what it added under zero-masking, and the final norm sees ``c h``: the logits equal zero-masking up to float
  rounding of the scaled weights (in bfloat16 a relative 2^-9 per weight where c is not a power of two; none at
  c = 2, i.e. 75%). Only weights and the eps field change, so the checkpoint loads with the stock classes; the
  live modules get the new eps too (``config_eps_attributes``), so the model in memory equals the one
  reloaded. Refused (one line, before any change): tied input/output embeddings (scaling the embedding would
  scale the logits) and what the spec's ``exact_norm_eps_refusal`` names.

Mamba-2's scan has no scale: there pruning equals zeroing the dropped B/C channels (and their conv bias), and
``"exact"`` changes nothing.

Rule ``fit`` (a method token with ``+<fit>``) enters here too: :func:`fit_selection` prunes a copy of the base model
as above and re-fits its output projections (:mod:`statereduce.core.fit`); rule ``prune_fit`` slices the same
selection and loads the fitted weights.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from statereduce import __version__
from statereduce.adapters import EpsAttribute, LinearAttentionAdapter, ScaledRows, get_adapter
from statereduce.adapters.mixer_layout import EPS_ATTRIBUTES
from statereduce.core.artifacts import PRUNE_RECORD, check_prune_record  # noqa: F401  (check_prune_record re-exported)
from statereduce.core.checkpoints import base_checkpoint
from statereduce.common.layout import parse_token, selection_token
from statereduce.core.data import load_split, token_blocks
from statereduce.core.fit import FIT_FORMAT, FitResult, fit_out_projections
from statereduce.core.selection_file import KeptChannels, read_selection
from statereduce.kernels.shapes import record_note
from statereduce.core.models import load_model, save_checkpoint
from statereduce.core.runtime import atomic_dir, versions
from statereduce.common.settings import PruneSettings
from statereduce.core.slicing import (  # noqa: F401  (the slicing verbs re-exported)
    KEY_DIMS_FIELD, OUTPUT_NORM_EPS_FIELD, VALUE_DIMS_FIELD, head_rows, kept_rows, mix_filters, output_norms,
    set_mixer_dims, slice_mixer, slice_rows, slice_values, transform_rows,
)

RECORD_NAME = PRUNE_RECORD  # the record's file name in a pruned checkpoint folder
RECORD_FORMAT = 1
_NUMBER_LIST = re.compile(r"\[\n\s*(-?[\d.e+-]+(?:,\n\s*-?[\d.e+-]+)*)\n\s*\]")


# ---- the record ---------------------------------------------------------------------------------
@dataclass
class PruneRecord:
    """Every decision of one pruning run, saved as ``prune_record.json`` next to the checkpoint.

    ``keep[layer][h]`` lists the kept channels (sorted) of q/k head h in the ORIGINAL channel numbering;
    under GVA each list serves ``num_v_heads // num_heads`` value heads. A transform selection leaves ``keep``
    empty and fills ``transform`` (the transforms' SHA-256 and how many conv filters were mixed or carried over;
    the transforms themselves are in the selection file). ``kernel_scale`` documents that the
    stock kernels of the saved checkpoint use ``1/sqrt(d_k')`` (module docstring) and, pruned with
    ``norm_eps="exact"``, holds ``norm_eps`` (:func:`exact_norm_eps`: the eps field, c^2 = d_k/d_k', the eps before and
    after, the residual scale c; the eps field is then in ``config_changes`` too); ``fla_kernel_shapes`` whether
    stock fla's kernels are known to mishandle the pruned head shape on CUDA (:mod:`statereduce.kernels.shapes`).
    ``base_checkpoint`` names the hub or local checkpoint that was pruned (a local one with the SHA-256 of its files,
    :func:`statereduce.core.checkpoints.checkpoint_provenance`); None for a model the workflow trained.
    """

    source_model: str
    family: str
    method: str
    pct: float
    d_k: int
    d_k_new: int
    num_heads: int
    num_v_heads: int
    head_v_dim: int
    keep: dict[int, list[list[int]]]
    config_changes: dict[str, list[Any]]  # field -> [old, new]
    kernel_scale: dict[str, Any]
    fla_kernel_shapes: dict[str, Any] = field(default_factory=dict)  # statereduce.kernels.shapes.record_note
    transform: dict[str, Any] = field(default_factory=dict)  # transform selections: transform_note
    package_version: str = __version__
    versions: dict[str, str | None] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    base_checkpoint: dict[str, Any] | None = None
    values: dict[str, Any] = field(default_factory=dict)  # value channels kept (prune_model's values): value_note
    format: int = RECORD_FORMAT

    def to_json(self) -> str:
        """Indented JSON with each list of numbers on one line (one line per head of ``keep``); a record that keeps
        every value channel has no ``values`` entry."""
        d = asdict(self)
        if not self.values:
            del d["values"]
        d["keep"] = {str(layer): rows for layer, rows in sorted(self.keep.items())}
        text = json.dumps(d, indent=2, sort_keys=True)
        # only indentation puts newlines inside a list (JSON strings cannot hold raw newlines)
        return _NUMBER_LIST.sub(lambda m: "[" + ", ".join(re.split(r",\s*", m.group(1))) + "]", text)

    @classmethod
    def from_json(cls, text: str) -> PruneRecord:
        d = json.loads(text)
        if d.get("format") != RECORD_FORMAT:
            raise ValueError(f"prune record format {d.get('format')!r} is not supported; valid: {RECORD_FORMAT}")
        d["keep"] = {int(layer): rows for layer, rows in d["keep"].items()}
        return cls(**d)

    def keep_tensors(self) -> dict[int, torch.Tensor]:
        """``keep`` as {layer: LongTensor [H, d_k']}, the form :func:`prune_model` takes."""
        return {layer: torch.tensor(rows, dtype=torch.long) for layer, rows in self.keep.items()}


def load_prune_record(path: str | os.PathLike) -> PruneRecord:
    """Read a record from a checkpoint directory or a ``prune_record.json`` path."""
    path = Path(path)
    return PruneRecord.from_json((path / RECORD_NAME if path.is_dir() else path).read_text())


def transform_note(transforms: Mapping[int, torch.Tensor], counts: Mapping[str, int]) -> dict[str, Any]:
    """The record's ``transform`` entry: a digest of the float64 transforms, and the conv filter counts."""
    digest = hashlib.sha256()
    for layer in sorted(transforms):
        digest.update(transforms[layer].to(torch.float64).contiguous().numpy().tobytes())
    return {
        "sha256": digest.hexdigest(),
        "conv_heads_mixed": int(counts["mixed"]),
        "conv_heads_shared": int(counts["shared"]),
        "note": ("q/k projection rows are T_h W_h; per-channel conv filters are mixed with weights T_ab^2 (paper App. "
                 "B.4) where a head's filters differ, carried over exactly where they are shared (App. B.5); SiLU "
                 "between the convolution and the recurrence does not commute with T, so the pruned model is an "
                 "approximation even with shared filters"),
    }


def kernel_scale_note(d_k: int, d_k_new: int, scaled: bool = True,
                      norm_eps: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The kernel-scale facts of a d_k -> d_k' pruning (module docstring); ``scaled`` False: a scan without one.

    ``norm_eps``: None for ``norm_eps="stock"`` (the entry as it always was); for ``"exact"``, the facts
    :func:`exact_norm_eps` returns, stored under ``norm_eps`` (and the note says what was done)."""
    if not scaled:
        note = {"original": None, "pruned": None, "o_norm_eps_factor_for_exact_zeroing": None,
                "note": "the scan has no q/k scale: the checkpoint equals the original with dropped channels zeroed"}
        return note if norm_eps is None else {**note, "norm_eps": dict(norm_eps)}
    note = {
        "original": d_k**-0.5,
        "pruned": d_k_new**-0.5,
        "o_norm_eps_factor_for_exact_zeroing": d_k / d_k_new,
        "note": (
            f"stock kernels of the pruned checkpoint use scale 1/sqrt(d_k'={d_k_new}), not 1/sqrt(d_k={d_k}); "
            f"the output is linear in the scale and goes through the per-head o_norm, so the checkpoint equals the "
            f"original with dropped q/k channels zeroed only up to the o_norm eps (exact with eps * {d_k / d_k_new:g})"
        ),
    }
    if norm_eps is None:
        return note
    note["norm_eps"] = dict(norm_eps)
    if norm_eps["factor"] != 1:
        note["note"] = (
            f"stock kernels of the pruned checkpoint use scale 1/sqrt(d_k'={d_k_new}), not 1/sqrt(d_k={d_k}), so each "
            f"mixer output is c = sqrt({d_k}/{d_k_new}) times that of zero-masking; norm_eps exact: the config's "
            f"{norm_eps['field']} times c^2 = {d_k / d_k_new:g} ({norm_eps['before']!r} -> {norm_eps['after']!r}), the "
            f"residual stream (input embedding and every residual writer) and the other inputs of norms reading it "
            f"times c, so every RMSNorm sees what it saw under zero-masking: the checkpoint equals the original with "
            f"dropped q/k channels zeroed up to float rounding of the scaled weights"
        )
    return note


# ---- norm_eps="exact" ---------------------------------------------------------------------------
EpsPlan = tuple[list[ScaledRows], list[EpsAttribute]]
"""What :func:`exact_norm_eps` changes: the weights scaled by c, the live eps attributes set."""


def plan_exact_norm_eps(adapter: LinearAttentionAdapter) -> EpsPlan:
    """What :func:`exact_norm_eps` will change in ``adapter.model``, checked before anything changes.

    Returns:
        (``residual_writers() + norm_input_rows()`` of ``adapter.norms()``, the weights to scale by c; its
        ``config_eps_attributes()``, the live eps attributes to set).
    Raises:
        ValueError: one line, when the construction cannot be stored for the model
            (:meth:`~statereduce.adapters.ExactNorms.check`: tied embeddings, the
            spec's ``exact_norm_eps_refusal``), when a listed eps attribute does not hold the config's eps, when a
            module holds the config's eps in an attribute the adapter does not list (a layout the construction was
            not made for: that norm's input would not be scaled), or when a weight is listed twice.
    """
    norms = adapter.norms()
    norms.check()
    field_name = adapter.norm_eps_field
    eps = getattr(adapter.config, field_name)
    attributes = norms.config_eps_attributes()
    listed = set()
    for a in attributes:
        value = getattr(a.module, a.attr)
        if value != eps:
            raise ValueError(f"norm_eps='exact': {a.name}.{a.attr} = {value!r} is not the config's {field_name} = "
                             f"{eps!r}; use norm_eps='stock' (in the workflow: prune: {{norm_eps: stock}})")
        listed.add((id(a.module), a.attr))
    for name, module in adapter.model.named_modules():
        for attr in EPS_ATTRIBUTES:
            value = getattr(module, attr, None)
            if isinstance(value, float) and value == eps and (id(module), attr) not in listed:
                raise ValueError(f"norm_eps='exact': {name or 'the model'}.{attr} holds the config's {field_name} but "
                                 f"the {adapter.family} adapter does not scale its input; use norm_eps='stock' "
                                 "(in the workflow: prune: {norm_eps: stock})")
    scaled = norms.residual_writers() + norms.norm_input_rows()
    seen = set()
    for entry in scaled:
        if not isinstance(entry.module, (nn.Linear, nn.Embedding)):
            raise ValueError(f"norm_eps='exact': {entry.name} is a {type(entry.module).__name__}; only nn.Linear and "
                             f"nn.Embedding weights are scaled")
        if id(entry.module.weight) in seen:
            raise ValueError(f"norm_eps='exact': the weight of {entry.name} is listed twice (or shared)")
        seen.add(id(entry.module.weight))
    return scaled, attributes


def scale_rows(entry: ScaledRows, factor: float) -> None:
    """Multiply ``entry.rows`` (all rows when None) of the module's weight and bias by ``factor``, in place, in the
    parameter's dtype (one rounding per entry)."""
    with torch.no_grad():
        for p in (entry.module.weight, getattr(entry.module, "bias", None)):
            if p is None:
                continue
            if entry.rows is None:
                p.mul_(factor)
            else:
                rows = entry.rows.to(p.device)
                p[rows] = p[rows] * factor


def exact_norm_eps(adapter: LinearAttentionAdapter, factor: float, plan: EpsPlan | None = None, *,
                   values: bool = False) -> dict[str, Any]:
    """Make the stock model equal zero-masking (module docstring, "Kernel scale"), in place: the config's norm eps
    and every live eps attribute times ``factor`` = c^2 = d_k/d_k', the residual writers and norm inputs times c.

    Args:
        adapter: the pruned model's adapter.
        factor: d_k/d_k' (1: nothing changes). A family without a kernel scale (Mamba-2) changes nothing.
        plan: :func:`plan_exact_norm_eps`'s result, made before pruning changed anything (made here when None).
        values: the pruning also keeps fewer value channels (``factor`` then includes d_v/d_v'): the output norms
            average over fewer channels, so the eps changes in a family without a kernel scale too.
    Returns:
        the record's ``kernel_scale["norm_eps"]``: ``choice`` "exact", ``field`` (the config field), ``factor`` c^2,
        ``before`` and ``after`` (the eps), ``residual_scale`` c, and how many weights (``scaled_weights``) and live
        eps attributes (``eps_attributes``) changed.
    """
    field_name = adapter.norm_eps_field if (adapter.kernel_scale or values) else None
    if field_name is None:
        return {"choice": "exact", "field": None, "factor": 1.0, "before": None, "after": None, "residual_scale": 1.0,
                "scaled_weights": 0, "eps_attributes": 0, "note": "the scan has no q/k scale: nothing to change"}
    before = getattr(adapter.config, field_name)
    if factor == 1:
        return {"choice": "exact", "field": field_name, "factor": 1.0, "before": before, "after": before,
                "residual_scale": 1.0, "scaled_weights": 0, "eps_attributes": 0}
    scaled, attributes = plan if plan is not None else plan_exact_norm_eps(adapter)
    after, c = before * factor, math.sqrt(factor)
    for entry in scaled:
        scale_rows(entry, c)
    for a in attributes:
        setattr(a.module, a.attr, after)
    setattr(adapter.config, field_name, after)
    return {"choice": "exact", "field": field_name, "factor": factor, "before": before, "after": after,
            "residual_scale": c, "scaled_weights": len(scaled), "eps_attributes": len(attributes)}


# ---- the orchestrator ---------------------------------------------------------------------------
def check_transforms(adapter: LinearAttentionAdapter, transforms: Mapping[int, Any]) -> tuple[dict[int, torch.Tensor],
                                                                                              int]:
    """Validate a transform selection against the model: {layer: [H, d_k', d_k]} with orthonormal rows per head,
    covering exactly the linear-attention layers, one d_k' for all; returns float64 tensors and d_k'."""
    layers = [i for i, _ in adapter.mixer_layers()]
    out = {int(layer): torch.as_tensor(t, dtype=torch.float64) for layer, t in transforms.items()}
    if sorted(out) != layers:
        raise ValueError(f"transforms cover layers {sorted(out)}; the model's linear-attention layers are {layers}")
    h, d_k = adapter.num_heads, adapter.head_k_dim
    sizes = {t.shape[1] if t.ndim == 3 else -1 for t in out.values()}
    for layer, t in out.items():
        if t.ndim != 3 or t.shape[0] != h or t.shape[2] != d_k or not 0 < t.shape[1] <= d_k:
            raise ValueError(f"layer {layer}: transform has shape {tuple(t.shape)}; expected [num_heads={h}, "
                             f"d_k' in 1..{d_k}, d_k={d_k}]")
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"layer {layer}: transform has non-finite entries")
        dev = float((t @ t.transpose(1, 2) - torch.eye(t.shape[1], dtype=t.dtype)).abs().max())
        if dev > 1e-6:
            raise ValueError(f"layer {layer}: transform rows are not orthonormal (|T T^T - I| = {dev:.1e} > 1e-6)")
    if len(sizes) != 1:
        raise ValueError(f"transforms keep {sorted(sizes)} channels per head in different layers; d_k' is global")
    return out, sizes.pop()


def is_transform_selection(selection: Mapping[int, Any]) -> bool:
    """Whether a selection maps layers to float [H, d_k', d_k] transforms (else to [H, d_k'] channel indices)."""
    first = next(iter(selection.values()), None)
    try:
        t = torch.as_tensor(first)
    except (TypeError, ValueError, RuntimeError):  # ragged or not numeric: check_keep names the problem
        return False
    return t.is_floating_point() and t.ndim == 3


def check_keep(adapter: LinearAttentionAdapter, keep: Mapping[int, Any], *,
               mixed: bool = False) -> tuple[dict[int, torch.Tensor], dict[int, int]]:
    """Validate a selection against the model; return it as sorted LongTensors and each layer's d_k'.

    Args:
        adapter: the model's adapter.
        keep: {layer: [H, d_k'] channel indices} covering exactly the model's linear-attention layers.
        mixed: allow layers to keep different widths; otherwise every layer must keep the same d_k' (the stock
            configs hold one global d_k).
    Returns:
        ({layer: sorted LongTensor [H, d_k']}, {layer: d_k'}).
    Raises:
        ValueError: one line naming the bad value.
    """
    layers = [i for i, _ in adapter.mixer_layers()]
    try:
        keep = {int(layer): torch.as_tensor(idx, dtype=torch.long) for layer, idx in keep.items()}
    except (TypeError, ValueError) as err:
        raise ValueError(f"keep must map layer index -> [H, d_k'] integer indices: {err}") from None
    if sorted(keep) != layers:
        raise ValueError(f"keep covers layers {sorted(keep)}; the model's linear-attention layers are {layers}")
    h, d_k = adapter.num_heads, adapter.head_k_dim
    out, d_k_new, widths = {}, None, {}
    for layer in layers:
        idx = keep[layer]
        if idx.ndim != 2 or idx.shape[0] != h or idx.shape[1] == 0:
            raise ValueError(f"layer {layer}: keep has shape {tuple(idx.shape)}; expected [num_heads={h}, d_k'>0]")
        widths[layer] = int(idx.shape[1])
        if d_k_new is None:
            d_k_new = idx.shape[1]
        elif idx.shape[1] != d_k_new and not mixed:
            raise ValueError(
                f"layer {layer}: keeps {idx.shape[1]} channels per head, other layers {d_k_new}; d_k' is global"
            )
        if int(idx.min()) < 0 or int(idx.max()) >= d_k:
            lo, hi = int(idx.min()), int(idx.max())
            raise ValueError(f"layer {layer}: keep indices span [{lo}, {hi}]; valid: [0, d_k={d_k})")
        idx = idx.sort(dim=1).values
        if bool((idx[:, 1:] == idx[:, :-1]).any()):
            raise ValueError(f"layer {layer}: keep has repeated channel indices within a head")
        out[layer] = idx
    if d_k_new is None:
        raise ValueError("the model has no linear-attention layers to prune")
    return out, widths


# ---- value channels -----------------------------------------------------------------------------
@dataclass(frozen=True)
class ValuePlan:
    """A checked value selection (:func:`check_values`): per layer [HV, d_v'] sorted kept value channels, d_v', the
    layers whose heads keep different channels under an output norm weight they share (``fold``: the weight goes into
    the output projection's columns first), and the config fields that hold d_v' (None: :data:`VALUE_DIMS_FIELD`)."""

    keep: dict[int, torch.Tensor]
    d_v: int
    d_v_new: int
    fold: frozenset[int]
    config_updates: dict[str, Any] | None

    @property
    def widths(self) -> dict[int, int]:
        """Each layer's d_v' (``d_v_new`` is the widest)."""
        return {layer: int(idx.shape[1]) for layer, idx in self.keep.items()}

    @property
    def mixed(self) -> bool:
        """The layers keep different value widths."""
        return len(set(self.widths.values())) > 1

    @property
    def shared(self) -> bool:
        """Every layer's heads keep the same channels."""
        return all(bool((idx == idx[:1]).all()) for idx in self.keep.values())


def _value_widths(values: Mapping[int, Any]) -> set[int]:
    """The d_v' of each layer's entry of a value selection (empty for an entry that is no tensor: check_values then
    says what is wrong in one line)."""
    widths = set()
    for v in values.values():
        try:
            widths.add(int(torch.as_tensor(v).shape[-1]))
        except (TypeError, ValueError, IndexError, RuntimeError):
            return set()
    return widths


def check_values(adapter: LinearAttentionAdapter, values: Mapping[int, Any], reduced_config=None, *,
                 mixed: bool = False) -> ValuePlan:
    """Validate a value selection against the model (:func:`prune_model`'s ``values``).

    Args:
        adapter: the model's adapter.
        values: {layer: [HV, d_v'] or [d_v'] kept value channels} covering exactly the linear-attention layers.
        reduced_config: the config after the key cut (the value fields are written on top of it); None: the model's.
        mixed: the layers may keep different widths (:func:`per_layer_plan`: the config keeps the unpruned sizes and
            the plan's ``config_updates`` is None).
    Raises:
        ValueError: one line naming the bad value: layers, shape, range, repeats, widths that differ (unless
            ``mixed``), heads of a layer that keep different channels where the output norm's weight is shared and
            has a bias, a d_v' the config cannot hold.
    """
    config = adapter.config if reduced_config is None else reduced_config
    layouts = {layer: adapter.layout(mixer) for layer, mixer in adapter.mixer_layers()}
    if sorted(int(k) for k in values) != sorted(layouts):
        raise ValueError(f"values cover layers {sorted(int(k) for k in values)}; the model's linear-attention layers "
                         f"are {sorted(layouts)}")
    out, widths, fold = {}, set(), set()
    d_v = adapter.dims(adapter.config).head_v_dim
    for layer, layout in layouts.items():
        try:
            idx = torch.as_tensor(values[layer] if layer in values else values[str(layer)], dtype=torch.long)
        except (TypeError, ValueError) as err:
            raise ValueError(f"layer {layer}: values must be [HV, d_v'] or [d_v'] integer indices: {err}") from None
        hv = max(e.index.shape[0] for e in layout.value_channels())
        layer_shared = layout.shared_value_selection()
        if idx.ndim == 1:
            idx = idx.expand(hv, -1)
        if idx.ndim != 2 or idx.shape[0] != hv or idx.shape[1] == 0:
            raise ValueError(f"layer {layer}: values has shape {tuple(idx.shape)}; expected [num_v_heads={hv}, d_v'>0] "
                             "or [d_v']")
        if int(idx.min()) < 0 or int(idx.max()) >= layout.value_dim:
            raise ValueError(f"layer {layer}: value indices span [{int(idx.min())}, {int(idx.max())}]; valid: "
                             f"[0, d_v={layout.value_dim})")
        idx = idx.sort(dim=1).values
        if bool((idx.diff(dim=1) == 0).any()):
            raise ValueError(f"layer {layer}: values repeat a channel within a head")
        if layer_shared and bool((idx != idx[:1]).any()):  # each head its own channels: fold the shared weight
            norms = [e.module for e in layout.value_channels() if e.axis == "norm"]
            if any(getattr(n, "bias", None) is not None for n in norms):
                raise ValueError(f"layer {layer}: value heads keep different channels, but the {adapter.family} output "
                                 f"norm's weight ([d_v]) is shared by the heads and has a bias; give one selection "
                                 f"per layer ([d_v'])")
            fold.add(layer)
        widths.add(int(idx.shape[1]))
        out[layer] = idx.contiguous()
    if len(widths) != 1 and not mixed:
        raise ValueError(f"layers keep {sorted(widths)} value channels per head; d_v' must be the same in every layer")
    updates = None
    for width in sorted(widths):
        updates = adapter.value_config_updates(config, width)  # raises for a d_v' outside [1, d_v]
    return ValuePlan(out, d_v, max(widths), frozenset(fold), None if mixed else updates)


def write_value_dims(adapter: LinearAttentionAdapter, plan: ValuePlan, changes: dict[str, list[Any]]) -> None:
    """Write one d_v' for every layer into the config (its fields, else :data:`VALUE_DIMS_FIELD`; both recorded in
    ``changes``), after :func:`slice_layers` has cut the value channels."""
    config = adapter.config
    if plan.config_updates is not None:
        for name, value in plan.config_updates.items():
            changes[name] = [getattr(config, name), value]
            setattr(config, name, value)
    else:
        n_layers = max(1 + max(plan.keep), getattr(config, "num_hidden_layers", 0))
        dims = [plan.d_v_new if i in plan.keep else None for i in range(n_layers)]
        setattr(config, VALUE_DIMS_FIELD, dims)
        changes[VALUE_DIMS_FIELD] = [None, dims]


def cut_mixer_values(adapter: LinearAttentionAdapter, mixer: nn.Module, layer: int, plan: ValuePlan,
                     weight_scale: float) -> None:
    """Slice ``plan``'s value channels of ``layer`` out of ``mixer`` (first folding an output norm weight its heads
    share, where ``plan.fold`` says so) and multiply its output norms' weight by ``weight_scale``."""
    if layer in plan.fold:
        fold_output_norm(adapter, mixer)
    slice_values(adapter, mixer, plan.keep[layer])
    if weight_scale != 1:
        with torch.no_grad():
            for norm in output_norms(adapter, mixer):
                norm.weight.mul_(weight_scale)


def values_entry(plan: ValuePlan, weight_scale: float | Mapping[str, float],
                 widths: Mapping[int, int] | None = None) -> dict[str, Any]:
    """The record's ``values`` entry of ``plan`` (without ``norm_eps``): with ``widths``, each layer's d_v' and a
    weight scale per layer."""
    return {
        "d_v": plan.d_v,
        "d_v_new": plan.d_v_new,
        **({"widths": {str(layer): w for layer, w in sorted(widths.items())}} if widths is not None else {}),
        "selection": "layer" if plan.shared else "head",
        "keep": {str(layer): (idx[0].tolist() if plan.shared else idx.tolist())
                 for layer, idx in sorted(plan.keep.items())},
        "output_norm_weight_scale": weight_scale,
        "output_norm_folded": sorted(plan.fold),
        "stock_loadable": plan.config_updates is not None,
    }


def fold_output_norm(adapter: LinearAttentionAdapter, mixer: nn.Module) -> None:
    """Move the weight of a mixer's output norm that all its heads share ([d_v]) into the columns of its output
    projection (``W_o[:, h d_v + j] *= w_j`` for every head h) and set it to ones: the same model (the weight scales each
    channel between the norm and the projection, the output gate included), whose heads can then keep different value
    channels under a norm weight they still share."""
    entries = adapter.layout(mixer).value_channels()
    norm = next(e for e in entries if e.axis == "norm")
    out = next(e for e in entries if e.axis == "in")
    with torch.no_grad():
        w = norm.module.weight[norm.index[0].to(norm.module.weight.device)].to(torch.float64)
        cols = out.module.weight
        index = out.index.to(cols.device)
        for h in range(index.shape[0]):
            cols[:, index[h]] = (cols[:, index[h]].to(torch.float64) * w.to(cols.device)).to(cols.dtype)
        norm.module.weight[norm.index[0].to(norm.module.weight.device)] = 1.0


def value_eps_note(norm_eps: str, eps_note: Mapping[str, Any] | None, d_v: int, d_v_new: int) -> dict[str, Any]:
    """The record's ``values["norm_eps"]``: what the choice does on the value side."""
    s = d_v / d_v_new
    if norm_eps == "exact":
        return {"choice": "exact", "value_factor": s, "factor": eps_note["factor"], "residual_scale":
                eps_note["residual_scale"],
                "note": f"output norms average over d_v'={d_v_new} of d_v={d_v} channels: their weight times "
                        f"sqrt({s:g}); the config's eps and the residual stream carry the factor {s:g} (with the key "
                        "cut's), so the checkpoint equals zero-masking the dropped value channels"}
    return {"choice": "stock", "value_factor": s,
            "note": f"output norms average over d_v'={d_v_new} of d_v={d_v} channels: their weight times sqrt({s:g}); "
                    f"the eps is the config's, so the checkpoint equals zero-masking only up to the output norms' eps "
                    f"(exact with eps * {s:g})"}


def prune_model(model: nn.Module, keep: Mapping[int, Any] | None, meta: Mapping[str, Any] | None = None, *,
                norm_eps: str = PruneSettings.norm_eps, values: Mapping[int, Any] | None = None) -> PruneRecord:
    """Slice the kept key/query channels out of every linear-attention layer, in place (paper Sec. 3.3).

    Validates everything (selection, reduced config, ``norm_eps``) before touching any weight, slices each mixer,
    then writes the adapter's config fields into ``model.config`` in place (so every module sharing it
    sees them). Softmax-attention layers of hybrid models are left untouched (with ``norm_eps="exact"``, apart from
    the scaling of their output projections and Qwen3.5's q/k projections). The result is a stock model of the same
    class whose kernel scale is ``1/sqrt(d_k')`` (module docstring).

    Args:
        model: a loaded causal LM with an adapter.
        keep: a :class:`~statereduce.core.selection_file.KeptChannels` (a selection file's: its key and value
            channels, of any cut), or {layer: LongTensor [H, d_k']} kept channel indices per q/k head (the same for
            q and k); the rows are sorted here, since channel order does not change the model. None keeps every key
            channel (a value cut). Or a transform selection,
            {layer: float [H, d_k', d_k]} with orthonormal rows per head (``pca``): the q and k projection rows
            become ``T_h W_h``, the q/k conv filters are mixed (App. B.4) or, where a head's filters are all equal,
            carried over exactly (App. B.5) (:func:`transform_rows`); the record's ``transform`` says how many.
        meta: provenance. ``source_model`` (alias ``source``), ``method`` and ``pct`` (percent of key channels
            removed) fill the record's fields; ``family``, ``d_k``, ``d_k_new``, ``num_heads``, ``num_v_heads``
            and ``head_v_dim``, when present (e.g. a selection file's metadata), must agree with the model and
            ``keep``; every other JSON-serialisable entry goes to ``record.extra``.
        norm_eps: ``"exact"`` (the default, :class:`~statereduce.common.settings.PruneSettings`'s, as in the workflow;
            :func:`exact_norm_eps`): equal to zero-masking to float precision, still a stock checkpoint; the
            record's ``kernel_scale["norm_eps"]`` and ``config_changes`` hold the eps before and after; refused for
            tied input/output embeddings. ``"stock"`` keeps the config's norm eps: the checkpoint equals
            zero-masking up to the output norms' eps (the record's ``kernel_scale`` names the factor that would make
            it exact), as the paper's checkpoints. A no-op for Mamba-2 (no kernel scale) and when every channel is
            kept.
        values: value channels to keep as well ("Value channels" below): {layer: [HV, d_v'] kept value channels per
            value head, or [d_v'] for all heads of the layer}; None keeps them all. Layers that keep different
            value widths (or different key widths) make a checkpoint that :func:`statereduce.core.models.load_model`
            loads (:func:`per_layer_plan`).
    Returns:
        the :class:`PruneRecord`.
    Raises:
        ValueError: one line, before any weight changes, for a bad selection, meta or ``norm_eps``, a d_k' the
            family's config cannot express, or a model that ``norm_eps="exact"`` cannot be stored for
            (:func:`plan_exact_norm_eps`: e.g. tied input/output embeddings).

    Value channels: each head's state is d_v x d_k; keeping d_v' of its d_v value channels slices the rows of the
    value projections and their convs, of the output gate, the entries of the output norm's weight and the columns
    of the output projection (the layout's ``value_channels``). A dropped value channel is a zero row of the state
    and a zero output channel, so the pruned mixer's output equals zero-masking's except that its per-head output
    norm averages over d_v' channels instead of d_v: ``RMSNorm(o'; eps s) = RMSNorm(o; eps) / sqrt(s)`` with
    s = d_v/d_v'. The norm's weight is multiplied by sqrt(s) (both choices of ``norm_eps``); ``"exact"`` also
    multiplies the config's eps by s (by c^2 s with keys cut too) and the residual stream by sqrt(s) (sqrt(c^2 s)), as
    for the kernel scale, so the checkpoint equals zero-masking to float precision; ``"stock"`` differs through the
    eps only. Each value head may keep its own channels: where the output norm's weight has d_v entries shared by the
    heads (fla, Qwen3.5) and the heads of a layer keep different ones, the weight first moves into the output
    projection's columns and becomes ones (:func:`fold_output_norm`), so the checkpoint stays stock-loadable. Mamba-2's
    gated norm has one entry per channel, but its strict config cannot hold d_v' (``expand`` is an integer): the
    checkpoint keeps the unpruned sizes and names each layer's d_v' in
    :data:`~statereduce.families.base.VALUE_DIMS_FIELD`, which :func:`statereduce.core.models.load_model` reads (the
    stock ``from_pretrained`` refuses its weights' shapes).
    """
    norm_eps = PruneSettings(norm_eps=norm_eps).norm_eps  # a one-line ValueError for a bad value
    adapter = get_adapter(model)
    keep_t, widths, transforms, values = key_side(adapter, keep, values)
    one_width = transforms is not None or (len(set(widths.values())) == 1
                                           and (values is None or len(_value_widths(values)) <= 1))
    plan = (stock_plan if one_width else per_layer_plan)(adapter, widths, values, norm_eps, dict(meta or {}))
    counts = slice_layers(adapter, plan, keep_t, transforms)
    return (stock_record if one_width else per_layer_record)(adapter, plan, keep_t, transforms, counts)


@dataclass(frozen=True)
class PrunePlan:
    """What :func:`prune_model` does, checked before any weight changes (:func:`stock_plan`, :func:`per_layer_plan`):
    each layer's key width and the mixer sizes that go with it, the value channels with each layer's output-norm
    weight scale, each mixer's own output-norm eps (a per-layer cut under ``norm_eps="exact"``), and what the record
    and the config write afterwards (:func:`stock_record`, :func:`per_layer_record`)."""

    widths: dict[int, int]
    mixer_updates: dict[int, dict[str, Any]]
    norm_eps: str
    #: record_meta's (meta, extra, source, base)
    record: tuple[dict[str, Any], dict[str, Any], str, dict[str, Any] | None]
    value_plan: ValuePlan | None = None
    value_scale: dict[int, float] = field(default_factory=dict)
    output_eps: dict[int, float] = field(default_factory=dict)
    config_updates: dict[str, Any] = field(default_factory=dict)  # a stock config's fields
    eps_factor: float = 1.0  # a stock config's norm eps factor (norm_eps="exact")
    eps_plan: EpsPlan | None = None
    exact: bool = False  # a per-layer cut's output norms get their own eps (norm_eps="exact" where it applies)


def key_side(adapter: LinearAttentionAdapter, keep, values):
    """:func:`prune_model`'s selection, checked: (sorted kept key channels {layer: LongTensor [H, d_k']}, each layer's
    d_k', the transforms of a transform selection or None, the value selection or None)."""
    if isinstance(keep, KeptChannels):  # a selection file's: its key and value sides
        if values is not None and keep.values is not None:
            raise ValueError("values are given twice: in the KeptChannels and as values=")
        keep, values = keep.keys, keep.values if keep.values is not None else values
    if keep is None:
        keep = {layer: torch.arange(adapter.head_k_dim).expand(adapter.num_heads, -1)
                for layer, _ in adapter.mixer_layers()}
    if is_transform_selection(keep):
        transforms, d_k_new = check_transforms(adapter, keep)
        keep_t = {layer: torch.arange(d_k_new).expand(adapter.num_heads, -1) for layer in transforms}
        return keep_t, {layer: d_k_new for layer in transforms}, transforms, values
    keep_t, widths = check_keep(adapter, keep, mixed=True)
    return keep_t, widths, None, values


def slice_layers(adapter: LinearAttentionAdapter, plan: PrunePlan, keep_t: Mapping[int, torch.Tensor],
                 transforms: Mapping[int, torch.Tensor] | None) -> dict[str, int]:
    """Slice every mixer as ``plan`` says: its kept key channels (rotated first for a transform selection), its kept
    value channels with the output norm's weight scaled, and its own output-norm eps where the plan sets one. Returns
    the conv filter counts of a transform selection (:func:`~statereduce.core.slicing.transform_rows`)."""
    counts = {"mixed": 0, "shared": 0}
    for layer, mixer in adapter.mixer_layers():
        done = slice_mixer(adapter, mixer, keep_t[layer], plan.mixer_updates[layer],
                           transforms[layer] if transforms is not None else None)
        counts = {k: counts[k] + done[k] for k in counts}
        if plan.value_plan is not None:
            cut_mixer_values(adapter, mixer, layer, plan.value_plan, plan.value_scale[layer])
        if layer in plan.output_eps:
            for attr in adapter.layout(mixer).output_norm_eps():
                setattr(attr.module, attr.attr, plan.output_eps[layer])
    return counts


def stock_plan(adapter: LinearAttentionAdapter, widths: Mapping[int, int], values: Mapping[int, Any] | None,
               norm_eps: str, meta: Mapping[str, Any]) -> PrunePlan:
    """The plan of a cut that one key width and one value width serve in every layer: the family's stock config
    fields hold them (:meth:`~statereduce.adapters.LinearAttentionAdapter.config_updates`), and ``norm_eps="exact"``
    scales the config's eps and the residual stream (:func:`plan_exact_norm_eps`)."""
    d_k_new = next(iter(widths.values()))
    config = adapter.config  # the text config of a multimodal checkpoint
    h, hv, d_k, d_v = adapter.dims(config)
    config_updates = adapter.config_updates(config, d_k_new)  # raises before any weight changes
    mixer_updates = adapter.mixer_updates(config, d_k_new)
    facts = {"family": adapter.family, "d_k": d_k, "d_k_new": d_k_new, "num_heads": h, "num_v_heads": hv,
             "head_v_dim": d_v}
    record = record_meta(adapter, meta, facts)
    eps_factor = d_k / d_k_new
    value_plan = None
    if values is not None:  # checked against the key-pruned config, before any weight changes
        value_plan = check_values(adapter, values, adapter.reduced_config(config, d_k_new))
        eps_factor = (eps_factor if adapter.kernel_scale else 1.0) * d_v / value_plan.d_v_new
    eps_plan = None
    if norm_eps == "exact" and (adapter.kernel_scale or value_plan is not None) and eps_factor != 1:
        eps_plan = plan_exact_norm_eps(adapter)  # raises before any weight changes
    scale = math.sqrt(d_v / value_plan.d_v_new) if value_plan is not None else None
    return PrunePlan(dict(widths), dict.fromkeys(widths, mixer_updates), norm_eps, record, value_plan,
                     {} if scale is None else dict.fromkeys(widths, scale), {}, config_updates, eps_factor, eps_plan)


def stock_record(adapter: LinearAttentionAdapter, plan: PrunePlan, keep_t: Mapping[int, torch.Tensor],
                 transforms: Mapping[int, torch.Tensor] | None, counts: Mapping[str, int]) -> PruneRecord:
    """Write a :func:`stock_plan`'s config fields (and under ``norm_eps="exact"`` its eps, :func:`exact_norm_eps`)
    into the sliced model's config; its :class:`PruneRecord`."""
    config, value_plan = adapter.config, plan.value_plan
    h, hv, d_k, d_v = adapter.dims(config)
    d_k_new = next(iter(plan.widths.values()))
    meta, extra, source, base = plan.record
    changes = {name: [getattr(config, name), value] for name, value in plan.config_updates.items()}
    for name, value in plan.config_updates.items():
        setattr(config, name, value)
    value_entry = {}
    if value_plan is not None:
        write_value_dims(adapter, value_plan, changes)
        value_entry = values_entry(value_plan, next(iter(plan.value_scale.values())))
    eps_note = None
    if plan.norm_eps == "exact":
        eps_note = exact_norm_eps(adapter, plan.eps_factor, plan.eps_plan, values=value_plan is not None)
        if eps_note["before"] != eps_note["after"]:
            changes[eps_note["field"]] = [eps_note["before"], eps_note["after"]]
    kernel_scale = kernel_scale_note(d_k, d_k_new, adapter.kernel_scale, eps_note)
    if value_plan is not None:
        value_entry["norm_eps"] = value_eps_note(plan.norm_eps, eps_note, d_v, value_plan.d_v_new)
    return PruneRecord(
        source_model=str(source),
        family=adapter.family,
        method=str(meta.get("method", "custom")),
        pct=meta["pct"] if "pct" in meta else 100.0 * (1 - d_k_new / d_k),
        d_k=d_k,
        d_k_new=d_k_new,
        num_heads=h,
        num_v_heads=hv,
        head_v_dim=d_v,
        keep={} if transforms is not None else {layer: idx.tolist() for layer, idx in keep_t.items()},
        transform=transform_note(transforms, counts) if transforms is not None else {},
        config_changes=changes,
        kernel_scale=kernel_scale,
        fla_kernel_shapes=record_note(tuple(adapter.padded_kernels), d_k_new,
                                      d_v if value_plan is None else value_plan.d_v_new),
        versions=versions(),
        extra=extra,
        base_checkpoint=base,
        values=value_entry,
    )


def record_meta(adapter: LinearAttentionAdapter, meta: Mapping[str, Any],
                facts: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any], str, dict[str, Any] | None]:
    """Check a pruning's ``meta`` against the model's ``facts`` (family, head sizes) and split it for the record:
    ``(meta, extra, source, base_checkpoint)``. A selection file's ``format`` becomes ``selection_format``.

    Raises:
        ValueError: one line, for a fact that disagrees, a pct that is no number, or an entry that is not JSON.
    """
    meta = dict(meta)
    if "format" in meta:  # a selection file's metadata: its layout version, not the record's
        meta["selection_format"] = meta.pop("format")
    for name, value in facts.items():
        if name in meta and meta[name] != value:
            raise ValueError(f"meta {name}={meta[name]!r} disagrees with the model/selection: {name}={value!r}")
    if "pct" in meta and (isinstance(meta["pct"], bool) or not isinstance(meta["pct"], (int, float))):
        raise ValueError(f"meta pct={meta['pct']!r} must be a number (percent of key channels removed)")
    base = base_checkpoint(adapter.model) or meta.get("base_checkpoint")  # the selection's copy, for a built model
    extra = {k: v for k, v in meta.items()
             if k not in {"source_model", "source", "method", "pct", "base_checkpoint", "d_k_new", *facts}}
    try:
        json.dumps(extra)
    except TypeError as err:
        raise ValueError(f"meta must be JSON-serialisable: {err}") from None
    source = (meta.get("source_model") or meta.get("source") or getattr(adapter.config, "name_or_path", "")
              or "unknown")
    return meta, extra, str(source), base


def per_layer_plan(adapter: LinearAttentionAdapter, widths: Mapping[int, int], values: Mapping[int, Any] | None,
                   norm_eps: str, meta: Mapping[str, Any]) -> PrunePlan:
    """The plan of a cut whose layers keep different widths (per-layer key budgets, or value widths that differ
    between layers), which no stock config holds.

    The config keeps the unpruned head sizes and gains :data:`~statereduce.core.slicing.KEY_DIMS_FIELD` (each decoder
    layer's d_k', None for other layers) and, with values, :data:`~statereduce.core.slicing.VALUE_DIMS_FIELD` (each
    layer's d_v'), which :func:`statereduce.core.models.load_model` reads to shape each mixer before loading the
    weights. Each output norm's weight is multiplied by sqrt(d_v/d_v'(layer)), after folding a weight the heads share
    where they keep different value channels (:func:`fold_output_norm`). With ``norm_eps="exact"`` each mixer's own
    output norm gets eps times d_k/d_k'(layer) (with a kernel scale) times d_v/d_v'(layer)
    (:data:`~statereduce.core.slicing.OUTPUT_NORM_EPS_FIELD`): the checkpoint equals zero-masking to float precision
    without touching the residual stream, so tied embeddings are no obstacle."""
    config = adapter.config
    h, hv, d_k, d_v = adapter.dims(config)
    for width in sorted(set(widths.values())):
        adapter.config_updates(config, width)  # raises before any weight changes for a width the family cannot hold
    value_plan = check_values(adapter, values, mixed=True) if values is not None else None
    facts = {"family": adapter.family, "d_k": d_k, "num_heads": h, "num_v_heads": hv, "head_v_dim": d_v}
    record = record_meta(adapter, meta, facts)
    value_widths = value_plan.widths if value_plan is not None else {}
    eps_field = adapter.norm_eps_field
    eps = getattr(config, eps_field) if eps_field else None
    exact = norm_eps == "exact" and eps is not None and (adapter.kernel_scale or value_plan is not None)
    output_eps = {}
    for layer, width in widths.items():
        factor = (d_k / width if adapter.kernel_scale else 1.0) * (
            d_v / value_widths[layer] if layer in value_widths else 1.0)
        if exact and factor != 1:
            output_eps[layer] = eps * factor
    value_scale = {layer: math.sqrt(d_v / value_widths[layer]) for layer in widths} if value_plan is not None else {}
    return PrunePlan(dict(widths), {layer: adapter.mixer_updates(config, w) for layer, w in widths.items()}, norm_eps,
                     record, value_plan, value_scale, output_eps, exact=exact)


def per_layer_record(adapter: LinearAttentionAdapter, plan: PrunePlan, keep_t: Mapping[int, torch.Tensor],
                     transforms: None, counts: Mapping[str, int]) -> PruneRecord:
    """Write a :func:`per_layer_plan`'s per-layer fields into the sliced model's config; its :class:`PruneRecord`, whose
    ``d_k_new`` is the widest layer's, ``keep`` every layer's channels, ``kernel_scale["per_layer"]`` each layer's
    scale and ``values`` each layer's d_v' (``widths``) and weight scale."""
    config, value_plan, widths = adapter.config, plan.value_plan, plan.widths
    h, hv, d_k, d_v = adapter.dims(config)
    meta, extra, source, base = plan.record
    n_layers = 1 + max(i for i, _ in adapter.mixer_layers())
    n_layers = max(n_layers, getattr(config, "num_hidden_layers", n_layers))
    value_widths = value_plan.widths if value_plan is not None else {}
    key_dims = [widths.get(i) for i in range(n_layers)]
    output_eps = [plan.output_eps.get(i) for i in range(n_layers)]
    eps_field, exact = adapter.norm_eps_field, plan.exact
    eps = getattr(config, eps_field) if eps_field else None
    setattr(config, KEY_DIMS_FIELD, key_dims)
    changes = {KEY_DIMS_FIELD: [None, key_dims]}
    value_entry = {}
    if value_plan is not None:
        value_dims = [value_widths.get(i) for i in range(n_layers)]
        setattr(config, VALUE_DIMS_FIELD, value_dims)
        changes[VALUE_DIMS_FIELD] = [None, value_dims]
        scales = {str(layer): math.sqrt(d_v / w) for layer, w in sorted(value_widths.items())}
        value_entry = {
            **values_entry(value_plan, scales, value_widths),
            "norm_eps": {"choice": plan.norm_eps, "note": "each mixer's output-norm eps times d_v/d_v'(layer)"
                         if exact else "the output norms keep the config's eps: equal to zero-masking up to it"},
        }
    if plan.output_eps:
        setattr(config, OUTPUT_NORM_EPS_FIELD, output_eps)
        changes[OUTPUT_NORM_EPS_FIELD] = [None, output_eps]
    per_layer = {str(layer): kernel_scale_note(d_k, w, adapter.kernel_scale) for layer, w in sorted(widths.items())}
    scale = {"per_layer": per_layer,
             "note": "layers keep different widths; each mixer's kernel scale is 1/sqrt of its own d_k'"
             + ("; norm_eps exact: each mixer's output-norm eps times d_k/d_k'(layer)" if exact else "")}
    if exact:  # as the single-width record: a norm_eps entry only for exact
        scale["norm_eps"] = {"choice": "exact", "field": eps_field, "before": eps, "after": output_eps}
    return PruneRecord(
        source_model=source,
        family=adapter.family,
        method=str(meta.get("method", "custom")),
        pct=meta["pct"] if "pct" in meta else 100.0 * (1 - sum(widths.values()) / (len(widths) * d_k)),
        d_k=d_k,
        d_k_new=max(widths.values()),
        num_heads=h,
        num_v_heads=hv,
        head_v_dim=d_v,
        keep={layer: idx.tolist() for layer, idx in keep_t.items()},
        config_changes=changes,
        kernel_scale=scale,
        fla_kernel_shapes=mixed_shape_notes(adapter, widths, value_widths, d_v),
        versions=versions(),
        extra=extra,
        base_checkpoint=base,
        values=value_entry,
    )


def mixed_shape_notes(adapter: LinearAttentionAdapter, widths: Mapping[int, int], value_widths: Mapping[int, int],
                      d_v: int) -> dict[str, Any]:
    """The record's ``fla_kernel_shapes`` of a checkpoint whose layers keep different widths: per key width d_k'
    (keys only), or per head shape ``"<d_k'>x<d_v'>"`` (with value widths)."""
    kernels = tuple(adapter.padded_kernels)
    if not value_widths:
        return {str(w): record_note(kernels, w, d_v) for w in sorted(set(widths.values()))}
    shapes = sorted({(widths[layer], value_widths[layer]) for layer in widths})
    return {f"{k}x{v}": record_note(kernels, k, v) for k, v in shapes}


def save_pruned(model: nn.Module, tokenizer, record: PruneRecord, out_dir: str | os.PathLike) -> Path:
    """Write the pruned HF checkpoint (one ``model.safetensors``), the tokenizer and ``prune_record.json`` atomically.

    Everything is written into a temporary sibling directory that is renamed into place at the end, so a
    crash never leaves a directory that looks like a valid checkpoint. An existing ``out_dir`` is replaced.

    Args:
        model: the pruned model (``prune_model`` output).
        tokenizer: saved with ``save_pretrained`` when not None.
        record: the :class:`PruneRecord` of the pruning.
        out_dir: the checkpoint directory; ``AutoModelForCausalLM.from_pretrained(out_dir)`` reloads it.
    Returns:
        ``out_dir`` as a Path.
    """
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        save_checkpoint(model, tokenizer, tmp)
        (tmp / RECORD_NAME).write_text(record.to_json() + "\n")
    return out_dir


# ---- compensation: rule fit (statereduce.core.fit) -----------------------------------------------------------------
def fit_selection(base: str | os.PathLike, selection: str | os.PathLike, method: str, pct: float, plan,
                  *, norm_eps: str, expect: Mapping[str, Any] | None = None, progress: bool = True,
                  model=None, tokenizer=None) -> tuple[FitResult, dict[str, Any]]:
    """Rule ``fit``: prune a copy of the base model with ``selection`` (the token without ``+<fit>``), fit its output
    projections (``plan``: a :class:`~statereduce.common.settings.FitPlan`) on the first ``n_samples`` calibration
    sequences, and return the :class:`FitResult` with the artifact's metadata. ``model``/``tokenizer``: the loaded
    base (else loaded from ``base``)."""
    spec = parse_token(method)
    if spec.fit is None:
        raise ValueError(f"method {method!r} has no +<fit>: nothing to fit")
    info = dict(expect or {})
    settings, cal = plan.settings, plan.calibration
    if cal is None or plan.corpus is None:
        raise ValueError(f"fit {plan.name!r} needs its calibration and corpus (the workflow resolves them)")
    start = time.perf_counter()
    if model is None:
        model, tokenizer = load_model(base, dtype=info.get("dtype"), device=info.get("device", "cpu"))
    selection_method = selection_token(method)
    keep, meta = read_selection(selection, expect={**info, "method": selection_method, "pct": float(pct)})
    student = copy.deepcopy(model)  # the base stays whole: it gives the targets
    prune_model(student, keep, meta, norm_eps=norm_eps)
    n_samples, batch = settings.sizes(cal)
    blocks = token_blocks(tokenizer, load_split(dict(plan.corpus), cal.split), cal.n_samples, cal.seq_len,
                          cal.seed)[:n_samples]
    result = fit_out_projections(model, student, blocks, scope=settings.scope, damping=settings.damping,
                                 batch_size=batch, target=settings.target, progress=progress)
    doc = {
        "format": FIT_FORMAT, "model": info.get("model"), "family": info.get("family"), "method": method,
        "pct": float(pct), "selection_method": selection_method, "selection": str(selection),
        "calibration": spec.calib, "fit": plan.name, "settings": settings.to_dict(), "norm_eps": norm_eps,
        "n_samples": int(n_samples), "seq_len": int(cal.seq_len), "residual_scale": result.scale,
        "layers": {str(k): v for k, v in sorted(result.layers.items())},
        "seconds": round(time.perf_counter() - start, 3),
    }
    return result, doc
