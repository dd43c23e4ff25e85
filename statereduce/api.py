"""State reduction of a model in memory, without Snakemake or intermediate files (docs/api.md).

::

    from statereduce import api

    stats = api.calibrate(model, blocks)                    # K/Q rows and input norms per head (+ Grad scores)
    selection = api.select(model, stats, "drrqr", pct=50)   # any registered selector
    pruned = api.prune(model, selection)                    # a pruned copy of the model and its PruneRecord
    api.save(pruned, "pruned/", tokenizer)                  # reloads with statereduce.core.models.load_model
    api.export("pruned/", "upload/", model_name="my-gdn")     # a folder a model hub accepts, with a model card

    widths = api.allocate(model, stats, "drrqr", 75, {"policy": "spectrum"})["key_dims"]   # per-layer budget
    mixed = api.prune(model, api.select(model, stats, "drrqr", pct=75, widths=widths))

Every step runs the workflow's own stage code on in-memory arrays: :func:`calibrate` the capture of
:mod:`statereduce.stages.capture` (``activation_arrays``, ``grad_score_arrays``), :func:`select` the selector driver of
:mod:`statereduce.stages.select` (``head_data``, ``run_selector``), :func:`prune`
:func:`statereduce.stages.prune.prune_model`,
:func:`save` :func:`statereduce.stages.prune.save_pruned` and :func:`allocate` the per-layer budgets of
:mod:`statereduce.stages.allocate`. So a selection made here equals the one the workflow makes from the same model,
blocks and settings, and the pruned checkpoints are the same.

Paper: Nazari & Rusch (2026), "On State Reduction in Linear Attention", Sec. 3.3-3.4 (selection and slicing of the
key/query channels per head) and App. B.2 (calibration).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from statereduce.adapters import LinearAttentionAdapter, adapter_class, adapter_families, get_adapter
from statereduce.stages.allocate import allocation_document
from statereduce.core.budgets import policy_needs
from statereduce.core.cuts import Cut
from statereduce.stages.capture import activation_arrays, grad_score_arrays, qk_weight_arrays
from statereduce.core.models import build_random
from statereduce.stages.pretrain import mean_loss
from statereduce.stages.export import export_checkpoint
from statereduce.stages.prune import PruneRecord, prune_model, save_pruned
from statereduce.stages.select import head_data, run_selector, write_selection
from statereduce.selectors import HeadSelection, format_method, get_selector, n_keep_for, parse_method
from statereduce.common.settings import BudgetSettings, CalibrationSettings, PruneSettings

__all__ = ["Calibration", "Pruned", "Selection", "allocate", "build", "calibrate", "export", "mean_loss", "prune",
           "save", "select"]

#: What each selector ``need`` takes from a :class:`Calibration` layer.
_STATS_FOR_NEED = {"activations": ("K", "Q"), "xnorm": ("xnorm",), "grad": ("grad_q", "grad_k")}


@dataclass
class Calibration:
    """Calibration statistics of one model, in memory: what ``activations.h5`` (and ``grad_scores.h5``) hold.

    Attributes:
        layers: per linear-attention layer, ``K`` and ``Q`` float32 [H, rows, d_k] (the same sampled token rows of
            the keys and queries as they enter the recurrence), ``xnorm`` float64 [hidden] (column L2 norms of the
            q/k projection input over all tokens) and, when calibrated with ``gradients=True``, ``grad_q`` and
            ``grad_k`` float64 [H, d_k] (the Grad saliency of each channel).
        info: the model's ``family``, ``num_heads``, ``head_k_dim`` and ``hidden_size``, and the settings:
            ``n_samples``, ``seq_len``, ``n_tokens``, ``rows_per_head``, ``seed``, ``batch_size``, ``gradients``.
    """

    layers: dict[int, dict[str, np.ndarray]]
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def has_gradients(self) -> bool:
        """Whether every layer holds Grad scores (``calibrate(..., gradients=True)``)."""
        return bool(self.layers) and all("grad_q" in a and "grad_k" in a for a in self.layers.values())


@dataclass
class Selection:
    """The channels (or, for ``pca``/``pca-adv``, the transform) that every head keeps.

    Attributes:
        rows: ``(layer, head, HeadSelection)`` per head, layer by layer, heads in order.
        meta: what the workflow's selection file records: ``kind`` ("index" or "transform"), ``method``,
            ``selector``, ``variant``, ``pct``, ``d_k``, ``d_k_new``, ``num_heads``, ``family``, ``seed``, ``options``.
    """

    rows: list[tuple[int, int, HeadSelection]]
    meta: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.meta["kind"])

    @property
    def cut(self) -> Cut:
        """The :class:`~statereduce.core.cuts.Cut`: each layer's kept key width."""
        return Cut.from_meta(self.meta, sorted({layer for layer, _, _ in self.rows}))

    @property
    def d_k_new(self) -> int | dict[int, int]:
        """Channels each head keeps, d_k'; {layer: d_k'} for a selection whose layers keep different widths."""
        widths = self.cut.key_widths
        return next(iter(widths.values())) if self.cut.uniform_keys else dict(widths)

    def channels(self) -> dict[int, np.ndarray]:
        """{layer: int64 [H, d_k'] kept channel indices}, or for a transform selection {layer: float64 [H, d_k', d_k]}:
        the form :func:`statereduce.stages.prune.prune_model` takes."""
        by_layer: dict[int, list[np.ndarray]] = {}
        for layer, _, sel in self.rows:
            by_layer.setdefault(layer, []).append(sel.transform if self.kind == "transform" else sel.keep)
        return {layer: np.stack(heads) for layer, heads in by_layer.items()}

    def save(self, path: str | os.PathLike) -> Path:
        """Write the workflow's selection file (Parquet, :func:`statereduce.stages.select.write_selection`)."""
        return write_selection(path, self.rows, self.meta)


class Pruned(NamedTuple):
    """What :func:`prune` returns: the pruned model and the :class:`~statereduce.stages.prune.PruneRecord` of every
    decision (unpacks as ``model, record = api.prune(...)``)."""

    model: nn.Module
    record: PruneRecord


def build(family: str, *, seed: int = 0, dtype: str = "float32", **arch: Any) -> nn.Module:
    """A randomly initialised causal LM of a family, in eval mode, ready to run on CPU.

    Args:
        family: an adapter family (``python -m statereduce`` lists them).
        seed: seeds the initialisation (the global torch generator is left as it was).
        dtype: float32, bfloat16 or float16.
        **arch: keyword arguments of the family's config class (:func:`statereduce.core.models.tiny_config`), e.g.
            ``hidden_size=64, num_hidden_layers=2, num_heads=2, head_dim=32`` for ``gated_deltanet``.
    Raises:
        ValueError: one line, for an unknown family, dtype or config keyword.
    """
    model = build_random(family, arch, seed=seed, dtype=dtype)
    adapter_class(family).install_fallbacks()
    return model.eval()


def calibrate(
    model: nn.Module,
    blocks: Any,
    *,
    rows_per_head: int = CalibrationSettings.rows_per_head,
    seed: int = CalibrationSettings.seed,
    batch_size: int = CalibrationSettings.batch_size,
    gradients: bool = False,
) -> Calibration:
    """Run calibration blocks through the model and keep the statistics the selectors read (paper App. B.2).

    Args:
        model: a causal LM of a supported family (``load_model`` or :func:`build`); its mode and its parameters'
            ``requires_grad`` are restored afterwards.
        blocks: token ids [n_samples, seq_len] (a LongTensor, an array or nested lists), e.g.
            :func:`statereduce.core.data.token_blocks`.
        rows_per_head: token rows of K and of Q kept per head (a seeded uniform sample; 2,500 as in the paper).
        seed: seeds the row sampling.
        batch_size: sequences per forward (and backward) pass.
        gradients: also compute the Grad scores (one backward pass over the blocks), which ``grad`` needs.
    Returns:
        a :class:`Calibration`.
    Raises:
        ValueError: one line, for a model of no supported family, blocks of another shape or dtype or with ids
            outside the vocabulary, or a setting that is not a positive integer.
    """
    adapter = _adapter(model)
    vocab = int(model.get_input_embeddings().num_embeddings)
    ids = _token_blocks(blocks, vocab)
    for name, value in (("rows_per_head", rows_per_head), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if gradients and ids.shape[1] < 2:
        raise ValueError(f"gradients need blocks of at least 2 tokens (a next-token loss); got seq_len={ids.shape[1]}")
    adapter.install_fallbacks()
    training = model.training
    model.eval()
    try:
        layers, n_tokens = activation_arrays(model, ids, rows_per_head=rows_per_head, seed=seed, batch_size=batch_size)
        if gradients:
            flags = [(p, p.requires_grad) for p in model.parameters()]
            try:
                for layer, scores in grad_score_arrays(model, ids, batch_size=batch_size).items():
                    layers[layer].update(scores)
            finally:
                for p, flag in flags:
                    p.requires_grad_(flag)
    finally:
        model.train(training)
    info = {
        **_model_facts(model, adapter),
        "n_samples": int(ids.shape[0]),
        "seq_len": int(ids.shape[1]),
        "n_tokens": int(n_tokens),
        "rows_per_head": int(rows_per_head),
        "seed": seed,
        "batch_size": int(batch_size),
        "gradients": bool(gradients),
    }
    return Calibration(layers, info)


def select(
    model: nn.Module,
    stats: Calibration | None = None,
    selector: str = "drrqr",
    pct: float = 50,
    *,
    seed: int = 0,
    workers: int = 1,
    widths: Mapping[int | str, int] | None = None,
    **options: Any,
) -> Selection:
    """Choose the key/query channels each head keeps, with a registered selector (paper Sec. 3.4).

    Args:
        model: the model ``stats`` were calibrated on (selectors that read weights take the q/k projection rows
            from it).
        stats: :func:`calibrate`'s result; None for selectors that read only weights (``rand``, ``l1``).
        selector: a registered selector (``python -m statereduce`` lists them), optionally with ``-k`` or ``-q``
            to score from the keys or the queries alone (paper Table 16): ``drrqr``, ``l1-q``, ``pca``, ...
        pct: percent of the key channels removed, in (0, 100) (50 removes half; 0.5 is half a percent); each head
            keeps ``d_k - round(d_k * pct / 100)``, and a pct that removes no channel is refused.
        seed: seeds ``rand`` (each head draws from its own generator of (seed, layer, head)).
        workers: heads selected in parallel threads.
        widths: {layer: d_k'} per linear-attention layer (a per-layer key budget: :func:`allocate`'s ``key_dims``);
            None keeps ``d_k - round(d_k * pct / 100)`` in every layer.
        **options: the selector's keyword options, e.g. ``f=2.0`` for ``drrqr``.
    Returns:
        a :class:`Selection`.
    Raises:
        ValueError: one line, for an unknown selector, variant or option, a pct outside (0, 100) or one that keeps
            or removes no channel (:func:`statereduce.selectors.n_keep_for`), missing statistics (``grad`` needs
            ``calibrate(..., gradients=True)``), or statistics of another model.
    """
    spec = parse_method(selector)
    if spec.cut != "keys":
        raise ValueError(f"selector {selector!r} cuts {spec.cut}: api.select cuts key channels; select value or joint "
                         "cuts with statereduce.stages.select.select_channels on the calibration artifacts and prune "
                         "with prune_model(model, keep, values=...)")
    sel = get_selector(spec.selector)
    adapter = _adapter(model)
    h, d_k = adapter.num_heads, adapter.head_k_dim
    n_keep_for(d_k, pct)
    unknown = sorted(set(options) - set(sel.options))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for selector {sel.name!r}; valid: {list(sel.options) or 'none'}")
    layers = [i for i, _ in adapter.mixer_layers()]
    if stats is not None:
        _check_stats(stats, model, adapter, layers)
    needed = [name for need in sorted(sel.needs) for name in _STATS_FOR_NEED.get(need, ())]
    if needed and stats is None:
        grad = ", gradients=True" if "grad" in sel.needs else ""
        raise ValueError(f"selector {sel.name!r} needs calibration statistics ({', '.join(needed)}): "
                         f"pass stats=api.calibrate(model, blocks{grad})")
    if "grad" in sel.needs and not stats.has_gradients:
        raise ValueError(f"selector {sel.name!r} needs Grad scores, which these statistics lack: "
                         f"calibrate with api.calibrate(model, blocks, gradients=True)")
    weights = qk_weight_arrays(model) if "weights" in sel.needs else {}

    def per_layer():
        for i in layers:
            yield i, {**weights.get(i, {}), **{name: stats.layers[i][name] for name in needed}}

    if widths is not None:
        widths = {int(k): int(v) for k, v in widths.items()}
        if sorted(widths) != layers:
            raise ValueError(f"widths name layers {sorted(widths)}; the model's linear-attention layers are {layers}")
        bad = [(i, w) for i, w in widths.items() if not 1 <= w <= d_k]
        if bad:
            raise ValueError(f"widths[{bad[0][0]}]={bad[0][1]} is invalid; valid: an integer in [1, d_k={d_k}]")
    provenance = {"model": getattr(adapter.config, "name_or_path", None) or None, "family": adapter.family}
    rows, meta = run_selector(head_data(per_layer(), h), selector, pct, d_k=d_k, num_heads=h, seed=seed,
                              options=options, workers=workers, provenance=provenance, widths=widths)
    return Selection(rows, meta)


def allocate(
    model: nn.Module,
    stats: Calibration | None,
    selector: str,
    pct: float,
    budget: BudgetSettings | Mapping[str, Any] | None = None,
    *,
    blocks: torch.Tensor | None = None,
    seed: int = 0,
    options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Per-layer key widths at the uniform cut's total (a per-layer key budget; docs/budgets.md), as rule
    ``allocate`` computes them from the workflow's files.

    Args:
        model: the model ``stats`` were calibrated on.
        stats: :func:`calibrate`'s result (what the policy and the selector read; None for a ``uniform`` budget or a
            weight-only selector under ``sensitivity``).
        selector: the selector (and ``-k``/``-q``) whose objective or selections the policy uses.
        pct: percent of the key channels removed, in (0, 100); every allocation keeps the uniform cut's total.
        budget: :class:`~statereduce.common.settings.BudgetSettings` or its mapping (policy, statistic, floor, multiple,
            ...); None: the spectrum policy with the captured energy.
        blocks: [N, T] calibration token ids, for the sensitivity policy's loss.
        seed, options: the selector's seed and keyword options.
    Returns:
        the allocation document (``key_dims``: {"<layer>": d_k'}, ``allocation``, ``statistics``); pass its
        ``key_dims`` as :func:`select`'s ``widths``.
    Raises:
        ValueError: one line, before any work, for a pct that keeps or removes no channel (as :func:`select`).
    """
    settings = BudgetSettings.coerce(budget)
    spec = parse_method(selector)
    adapter = _adapter(model)
    h, d_k = adapter.num_heads, adapter.head_k_dim
    n_keep_for(d_k, pct)
    layers = [i for i, _ in adapter.mixer_layers()]
    if stats is not None:
        _check_stats(stats, model, adapter, layers)
    reads = policy_needs(settings, spec.selector)
    needed = [name for need in sorted(reads) for name in _STATS_FOR_NEED.get(need, ())]
    if needed and stats is None:
        raise ValueError(f"the {settings.policy} budget with selector {spec.selector!r} needs calibration statistics "
                         f"({', '.join(needed)}): pass stats=api.calibrate(model, blocks)")
    weights = qk_weight_arrays(model) if "weights" in reads else {}
    dims = adapter.dims(adapter.config)

    def layer_data():
        for i in layers:
            arrays = {**weights.get(i, {}), **{name: stats.layers[i][name] for name in needed}}
            heads = [data for _, _, data in head_data([(i, arrays)], h)]
            yield i, heads

    if settings.policy == "sensitivity":
        if blocks is None:
            raise ValueError("the sensitivity budget measures the loss on calibration sequences: pass blocks=")
        settings = settings.replace(batch_size=settings.batch_size or int(blocks.shape[0]))
    name = "api"
    return allocation_document(
        f"{format_method(spec)}@{name}", pct, name, settings, d_k=d_k, num_heads=h, layers=layers,
        layer_data=layer_data, check_width=lambda w: adapter.check_reduction(d_k, dims.head_v_dim, w), seed=seed,
        options=options, model=model, blocks=blocks,
        provenance={"model": getattr(adapter.config, "name_or_path", None) or None, "family": adapter.family})


def prune(model: nn.Module, selection: Selection | Mapping[int, Any], *, inplace: bool = False,
          norm_eps: str = PruneSettings.norm_eps) -> Pruned:
    """Slice the selected key/query channels out of every linear-attention layer (paper Sec. 3.3).

    The result is a stock model of the same class with a smaller d_k (``head_k_dim``, ``expand_k``, ``state_size``
    or ``linear_key_head_dim`` in its config); softmax-attention layers of hybrids are left alone.

    Args:
        model: the model the selection was made for.
        selection: :func:`select`'s result, or a mapping {layer: [H, d_k'] channel indices} covering every
            linear-attention layer (or {layer: float [H, d_k', d_k]} transforms with orthonormal rows).
        inplace: prune ``model`` itself instead of a deep copy (no second copy of the weights in memory).
        norm_eps: ``"exact"`` (the default, the workflow's: :class:`~statereduce.common.settings.PruneSettings`) equals
            zero-masking to float precision and is still a stock checkpoint
            (:func:`statereduce.stages.prune.exact_norm_eps`;
            refused for tied embeddings); ``"stock"`` keeps the config's norm eps (the pruned model equals
            zero-masking up to the mixers' output-norm eps, as the paper's checkpoints).
    Returns:
        ``Pruned(model, record)``.
    Raises:
        ValueError: one line, before any weight changes, for a selection that does not fit the model.
    """
    if isinstance(selection, Selection):
        keep, meta = selection.channels(), dict(selection.meta)
    elif isinstance(selection, Mapping):
        keep, meta = selection, {}
    else:
        raise ValueError(f"selection must be what api.select returns or a mapping layer -> [H, d_k'] channel indices, "
                         f"got {type(selection).__name__}")
    _adapter(model)
    target = model if inplace else copy.deepcopy(model)
    return Pruned(target, prune_model(target, keep, meta, norm_eps=norm_eps))


def save(pruned: Pruned, path: str | os.PathLike, tokenizer: Any = None) -> Path:
    """Write the pruned model as a Hugging Face checkpoint folder, with ``prune_record.json`` (and the tokenizer).

    The folder is written atomically (an existing one is replaced). ``statereduce.core.models.load_model(path)`` loads
    it (it needs the tokenizer in the folder); so does the family's stock class (``AutoModelForCausalLM`` after
    ``import fla`` for DeltaNet and Gated DeltaNet; transformers' own classes for Mamba-2 and Qwen3.5).

    Args:
        pruned: :func:`prune`'s result.
        path: the checkpoint folder.
        tokenizer: the model's tokenizer, saved into the folder (None: none is saved).
    Returns:
        ``path`` as a Path.
    """
    if not isinstance(pruned, Pruned):
        raise ValueError(f"save takes what api.prune returns (Pruned(model, record)), got {type(pruned).__name__}")
    return save_pruned(pruned.model, tokenizer, pruned.record, path)


# ---- checks -------------------------------------------------------------------------------------
def export(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, *, model_name: str,
           evals: Mapping[str, str | os.PathLike | None] | None = None, base: Mapping[str, Any] | None = None,
           calibration: Mapping[str, Any] | None = None, command: str | None = None,
           pruned_repo: str | None = None) -> Path:
    """A saved checkpoint (:func:`save`, or the workflow's ``pruned/`` / ``rft/``) as a folder ready to upload:
    weights, config, tokenizer, the modeling code of per-layer widths (it loads with ``trust_remote_code=True`` and
    without statereduce), RFT's adapter, and a model card; what rule ``export`` writes
    (:func:`statereduce.stages.export.export_checkpoint`, whose arguments these are; ``evals`` defaults to the
    checkpoint's own ``eval.json`` where it has one, as the pruned model's)."""
    if evals is None:
        own = Path(checkpoint) / "eval.json"
        evals = {"pruned": own if own.is_file() else None}
    return export_checkpoint(checkpoint, out_dir, model_name=model_name, evals=evals, base=base,
                             calibration=calibration, command=command, pruned_repo=pruned_repo)


def _adapter(model: Any) -> LinearAttentionAdapter:
    """The model's adapter; anything that is not a causal LM of a registered family fails in one line."""
    if not isinstance(model, nn.Module) or getattr(model, "config", None) is None:
        raise ValueError(f"model must be a causal LM of one of the families {', '.join(adapter_families())} "
                         f"(statereduce.core.models.load_model or api.build), got {type(model).__name__}")
    return get_adapter(model)


def _model_facts(model: nn.Module, adapter: LinearAttentionAdapter) -> dict[str, Any]:
    return {"family": adapter.family, "num_heads": adapter.num_heads, "head_k_dim": adapter.head_k_dim,
            "hidden_size": int(adapter.config.hidden_size)}


def _token_blocks(blocks: Any, vocab_size: int) -> torch.Tensor:
    """``blocks`` as a LongTensor [n_samples, seq_len] of ids in [0, vocab_size), or a one-line ValueError."""
    try:
        ids = torch.as_tensor(blocks)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"blocks must be token ids of shape [n_samples, seq_len]: {err}") from None
    if ids.ndim != 2 or 0 in ids.shape:
        raise ValueError(f"blocks must be token ids of shape [n_samples, seq_len], got shape {tuple(ids.shape)}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"blocks must hold integer token ids, got dtype {ids.dtype}")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"blocks hold token ids in [{lo}, {hi}]; valid: [0, vocab_size={vocab_size})")
    return ids.long()


def _check_stats(stats: Any, model: nn.Module, adapter: LinearAttentionAdapter, layers: list[int]) -> None:
    """``stats`` must be a :class:`Calibration` of a model with the same family, head sizes and layers."""
    if not isinstance(stats, Calibration):
        raise ValueError(f"stats must be what api.calibrate returns (a Calibration) or None, "
                         f"got {type(stats).__name__}")
    for name, value in _model_facts(model, adapter).items():
        if stats.info.get(name) != value:
            raise ValueError(f"stats were calibrated on a model with {name}={stats.info.get(name)!r}; "
                             f"this model has {name}={value!r}")
    if sorted(stats.layers) != layers:
        raise ValueError(f"stats cover layers {sorted(stats.layers)}; the model's linear-attention layers are {layers}")
