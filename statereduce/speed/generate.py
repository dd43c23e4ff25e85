"""Speed of Hugging Face ``model.generate()``, the loop users run, baseline and pruned side by side on one GPU, and
what a smaller state buys a server at a fixed memory budget.

Speed does not depend on weight values, so the models are built with random weights of the model's shape, as
:mod:`statereduce.speed.bench` builds them (:func:`~statereduce.speed.bench.model_config`): the baseline, the
adapter's reduced config for every ratio (``d_k' = n_keep_for(d_k, pct)``, exactly the shapes a pruned checkpoint
has) and named per-layer allocations (one d_k' per layer; :func:`scale_allocation` carries an allocation made for a
smaller model onto this model's layers and head size). Two parts:

- **table**: ``generate(ids, do_sample=False, max_new_tokens=N, min_new_tokens=N)`` (so every sequence runs all N
  steps) after a ``prompt``-token prompt, per batch of ``batches``. Each cell records the time to first token (the
  prefill and the first token, wall clock with CUDA synchronised: a stopping criterion notes the moment the first
  token is appended), the total time, the decode rate ``B (N - 1) / (total - TTFT)`` (tokens/s of the steps after the
  first token), the end-to-end rate ``B N / total`` and peak memory (``torch.cuda.max_memory_allocated``, reset per
  cell: weights included). A cell whose prefill does not fit prefills the prompt in sub-batches (at most
  ``prefill_tokens`` tokens a forward; the caches are laid into one batch cache, the first token is the argmax of the
  prefill's last logits and ``generate`` runs the other N - 1 steps from that cache); the cell says so
  (``prefill_chunks``). A cell that does not fit even so is recorded as skipped with the reason.
- **budget**: for a memory budget of ``budget_gib`` (weights plus every per-sequence cache tensor: recurrent and conv
  state, and a hybrid's attention KV cache at ``context + new tokens``) the largest batch (a multiple of
  ``budget_multiple``) that fits at each context, from the byte counts of the cache tensors a one-sequence prefill
  leaves (:func:`cache_bytes`; :func:`config_cache_bytes` computes the same from the config, and the document holds
  both), and the throughput of ``generate`` at that batch (prefill in sub-batches, then ``budget_new_tokens`` steps)
  with its measured peak beside the budget.

Every ratio is pruned over baseline of the same run: the variants are measured one after another in one process,
each warmed up the same way (short ``generate`` calls at ``warmup_batches``, where Triton compiles and autotunes).

fla 0.6.0's models take their cache as ``past_key_values`` while ``generate`` of transformers >= 5.24 hands it on as
``cache``, which they ignore: each decode step would start from an empty state. :func:`install_cache_alias` maps one
onto the other (``tests/test_speed_generate.py`` checks ``generate`` against greedy decoding by full forwards).

Run with ``python -m statereduce.speed.generate OUT.json --model NAME`` or through the workflow's ``speed_generate``
rule; ``python -m statereduce.speed.generate --tables DOC.json ...`` prints the Markdown tables of documents.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import inspect
import json
import logging
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
import yaml
from tqdm.auto import tqdm
from transformers import StoppingCriteria

from statereduce.adapters import adapter_class
from statereduce.common.settings import OPTIONAL, Settings, choice
from statereduce.config import validate_config
from statereduce.core.runtime import versions, write_json
from statereduce.core.slicing import KEY_DIMS_FIELD, shape_mixers
from statereduce.selectors import n_keep_for
from statereduce.speed import bench

log = logging.getLogger(__name__)

PARTS = ("table", "budget")
GIB = 1 << 30


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class GenerateSettings(Settings):
    """What :func:`run_generate` measures.

    Args:
        prompt, new_tokens, batches: the table's prompt length, generated tokens (every step runs: min = max) and
            batch sizes.
        pcts: ratios beside the baseline (None: the model's ``speed.pcts``).
        trials: timed ``generate`` calls per cell (the median of each measure is reported).
        warmup_prompt, warmup_tokens, warmup_batches: the short ``generate`` calls that warm up each model.
        cell_warmup: before a cell's timed calls, one untimed ``generate`` of 2 tokens at the cell's own batch, prompt
            and prefill plan. fla 0.6.0 autotunes its norm kernels (RMSNorm, the q/k L2 norm, the gated output norm)
            per bucket of the row count (``NB``), so the first call at a new batch x length autotunes inside the
            prefill: without this warm-up a TTFT at a new shape holds seconds of autotuning.
        budget_gib: the server's memory budget for weights and caches (GiB).
        contexts: prompt lengths of the budget part.
        timed_contexts: the contexts whose largest batch is timed (None: all); the others get the byte count only.
        budget_new_tokens: generated tokens of a budget cell.
        budget_multiple: the largest batch is rounded down to a multiple of this.
        budget_max_batch: a cap on the timed batch (None: none); the document records the uncapped one too.
        budget_prompt: the prompt of a timed budget cell (None: the context). Only for models whose cache holds no
            attention KV: their per-sequence cache and decode step do not depend on the prompt's length, so the
            decode rate at the largest batch is the one at the context (a shorter prompt saves the prefill of
            thousands of sequences); refused for a model whose cache grows with the context.
        prefill_tokens: tokens per forward of a prefill in sub-batches.
        dtype: the models' dtype.
    """

    section: ClassVar[str] = "generate"
    unknown_message: ClassVar[str] = "unknown generate setting(s) {bad}; valid: {valid}"
    sort_valid: ClassVar[bool] = False

    prompt: int = 2048
    new_tokens: int = 256
    batches: list = field(default_factory=lambda: [1, 16, 64, 256])
    pcts: list | None = field(default=None, metadata=OPTIONAL)
    trials: int = 1
    warmup_prompt: int = 128
    warmup_tokens: int = 4
    warmup_batches: list = field(default_factory=lambda: [1, 16])
    cell_warmup: bool = True
    budget_gib: float = 40.0
    contexts: list = field(default_factory=lambda: [2048, 16384])
    timed_contexts: list | None = field(default=None, metadata=OPTIONAL)
    budget_new_tokens: int = 256
    budget_multiple: int = 1
    budget_max_batch: int | None = field(default=None, metadata=OPTIONAL)
    budget_prompt: int | None = field(default=None, metadata=OPTIONAL)
    prefill_tokens: int = 262144
    dtype: str = choice("bfloat16", ("bfloat16", "float16", "float32"))

    def __post_init__(self):
        super().__post_init__()
        for name in ("prompt", "new_tokens", "trials", "warmup_prompt", "warmup_tokens", "budget_new_tokens",
                     "budget_multiple", "prefill_tokens"):
            if not _positive_int(getattr(self, name)):
                raise ValueError(f"generate {name}={getattr(self, name)!r} must be a positive integer")
        for name in ("budget_max_batch", "budget_prompt"):
            if getattr(self, name) is not None and not _positive_int(getattr(self, name)):
                raise ValueError(f"generate {name}={getattr(self, name)!r} must be a positive integer (or unset)")
        for name in ("batches", "warmup_batches", "contexts", "timed_contexts"):
            values = getattr(self, name)
            if values is None or (name == "timed_contexts" and values == []):
                continue
            if not isinstance(values, (list, tuple)) or not values:
                raise ValueError(f"generate {name}={values!r} must be a non-empty list of positive integers")
            bad = [v for v in values if not _positive_int(v)]
            if bad:
                raise ValueError(f"generate {name}: {bad[0]!r} is not a positive integer (a batch size or token count)")
        if self.timed_contexts is not None and set(self.timed_contexts) - set(self.contexts):
            raise ValueError(f"generate timed_contexts {sorted(set(self.timed_contexts) - set(self.contexts))} are not "
                             f"in contexts {self.contexts}")
        if not isinstance(self.cell_warmup, bool):
            raise ValueError(f"generate cell_warmup must be true or false; got {self.cell_warmup!r}")  # noqa: TRY004
        if isinstance(self.budget_gib, bool) or not isinstance(self.budget_gib, (int, float)) or not (
                math.isfinite(self.budget_gib) and self.budget_gib > 0):
            raise ValueError(f"generate budget_gib={self.budget_gib!r} must be a positive number of GiB")
        for pct in self.pcts or []:
            if isinstance(pct, bool) or not isinstance(pct, (int, float)) or not 0 < float(pct) < 100:
                raise ValueError(f"generate pct {pct!r} must be in (0, 100): the percent of key channels removed")

    @property
    def timed(self) -> list[int]:
        return list(self.contexts if self.timed_contexts is None else self.timed_contexts)


# ---------------------------------------------------------------------------------------------
# what to measure
# ---------------------------------------------------------------------------------------------
def generate_plan(entry: Mapping[str, Any], speed: Mapping[str, Any] | None = None, *,
                  name: str = "model") -> dict[str, Any]:
    """``{"family", "arch", "pcts", "dtype"}`` of one ``models.<name>`` entry of the workflow config: the arch its speed
    runs use (``speed.arch``, else the ``pretrain.arch`` or ``init.arch`` of a model the workflow makes) and the
    ratios (the model's ``speed.pcts``, else the top-level ``speed`` block's ``pcts``, else 50 and 75) and the dtype
    (the same way from ``speed.dtype``, else bfloat16). Unlike the decode benchmark this covers every family
    ``generate`` runs (Qwen3.5 too).

    Raises:
        ValueError: one line, for a model without an arch or an arch key the family does not take.
    """
    family = entry["family"]
    own = dict(entry.get("speed") or {})
    arch = own.get("arch")
    if arch is None:
        arch = (entry.get("pretrain") or entry.get("init") or {}).get("arch")
    if arch is None:
        raise ValueError(f"model {name!r} has no architecture for speed runs: set models.{name}.speed.arch "
                         "(its config keywords: hidden_size, num_hidden_layers, ...)")
    adapter_class(family).check_arch(dict(arch))
    pcts = own.get("pcts", (speed or {}).get("pcts", [50, 75]))
    dtype = own.get("dtype", (speed or {}).get("dtype", "bfloat16"))
    return {"family": family, "arch": dict(arch), "pcts": [p for p in pcts if float(p) != 0], "dtype": dtype}


def _merge(base: dict, over: Mapping) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), dict) else value
    return out


def workflow_plan(name: str, configs: Sequence[str | Path]) -> dict[str, Any]:
    """:func:`generate_plan` of model ``name`` of the workflow config files ``configs``, merged in order as
    ``snakemake --configfile`` overlays them (a later file's blocks update the earlier ones key by key)."""
    merged: dict = {}
    for path in configs:
        if not Path(path).is_file():
            raise ValueError(f"workflow config {str(path)!r} not found; pass the workflow's config.yaml as "
                             "--config PATH")
        merged = _merge(merged, yaml.safe_load(Path(path).read_text()) or {})
    cfg = validate_config(merged)
    if name not in cfg["models"]:
        raise ValueError(f"unknown model {name!r} in {', '.join(map(str, configs))}; valid: "
                         f"{', '.join(sorted(cfg['models']))}")
    return generate_plan(cfg["models"][name], cfg.get("speed"), name=name)


@dataclass
class Variant:
    """One model of a run: ``name`` (``base``, a pct as written, or an allocation's name), its config and what the
    document records of it."""

    name: str
    config: Any
    record: dict


def _block_bounds(n_source: int, n_target: int) -> list[tuple[int, int]]:
    return [(i * n_target // n_source, (i + 1) * n_target // n_source) for i in range(n_source)]


def scale_allocation(source: Mapping[str, Any], family: str, arch: Mapping[str, Any], pct: float | None = None,
                     multiple: int = 16) -> dict[str, Any]:
    """A per-layer allocation of a smaller model carried onto the model of ``arch`` (a stated stand-in for running the
    budget at this size).

    The rule: source layer i of n keeps the fraction ``w_i / d_k_source`` of its keys; it covers the contiguous block
    ``[i L / n, (i + 1) L / n)`` of this model's L linear-attention layers (floors), each of which keeps
    ``w_i / d_k_source * d_k`` channels rounded to a multiple of ``multiple`` (within ``[multiple, d_k]``). The total is
    then made equal to the uniform cut's (``n_keep_for(d_k, pct)`` in every layer, ``pct`` the source's) by moving
    single layers one ``multiple`` at a time: those whose rounding lost (or, when over, gained) the most first, ties
    to the lower layer.

    Args:
        source: a per-layer budget's allocation (``results/{model}/select/{method}_{pct}.allocation.json``: ``d_k``,
            ``pct``, ``allocation.widths``), or ``{"widths", "d_k", "pct"}``.
        family, arch: the target model.
        pct: the removal percent whose uniform total to meet (default: the source's).
        multiple: the width step.
    Returns:
        ``{"widths"`` (one per decoder layer, None without linear attention), ``"source_widths"``, ``"source_d_k"``,
        ``"pct"``, ``"rule"}``.
    Raises:
        ValueError: one line, for a source without widths or d_k, or a total no such allocation reaches.
    """
    widths = (source.get("allocation") or {}).get("widths", source.get("widths"))
    d_src = source.get("d_k")
    pct = source.get("pct") if pct is None else pct
    if not widths or not _positive_int(d_src) or pct is None:
        raise ValueError("the allocation to scale needs its widths (allocation.widths), d_k and pct")
    adapter = adapter_class(family)
    config = adapter.config_class(**arch)
    layers = adapter.mixer_layer_indices(config)
    d_k = adapter.dims(config).head_k_dim
    if d_k % multiple:
        raise ValueError(f"d_k={d_k} is not a multiple of {multiple}")
    exact = [0.0] * len(layers)
    for (lo, hi), w in zip(_block_bounds(len(widths), len(layers)), widths):
        for j in range(lo, hi):
            exact[j] = w / d_src * d_k
    out = [min(d_k, max(multiple, multiple * round(x / multiple))) for x in exact]
    target = n_keep_for(d_k, float(pct)) * len(layers)
    if target % multiple:
        raise ValueError(f"the uniform total {target} is not a multiple of {multiple}")
    while sum(out) != target:
        step = multiple if sum(out) < target else -multiple
        order = sorted(range(len(out)), key=lambda j: (-(exact[j] - out[j]) * (1 if step > 0 else -1), j))
        movable = [j for j in order if multiple <= out[j] + step <= d_k]
        if not movable:
            raise ValueError(f"no allocation of widths in [{multiple}, {d_k}] reaches the total {target}")
        out[movable[0]] += step
    full: list[int | None] = [None] * max(layers[-1] + 1, getattr(config, "num_hidden_layers", 0))
    for layer, w in zip(layers, out):
        full[layer] = int(w)
    rule = (f"source layer i of {len(widths)} (d_k {d_src}) -> target layers [i*{len(layers)}/{len(widths)}, "
            f"(i+1)*{len(layers)}/{len(widths)}) keep w_i/{d_src}*{d_k} rounded to a multiple of {multiple}, the total "
            f"moved to the uniform {float(pct):g} % cut's ({target}) one multiple at a time, largest rounding loss "
            "first")
    return {"widths": full, "source_widths": list(widths), "source_d_k": d_src, "pct": float(pct), "rule": rule}


def variants(family: str, arch: Mapping[str, Any], pcts: Sequence, allocations: Mapping[str, Mapping] | None = None,
             ) -> list[Variant]:
    """The baseline, every ratio of ``pcts`` and every named allocation (name -> ``{"widths", ...}``) of the model of
    ``arch``, each with its config and record (d_k' or the widths, the recurrent state bytes per sequence)."""
    adapter = adapter_class(family)
    out = []
    for pct in [0, *pcts]:
        config = bench.model_config(family, arch, pct)
        name = "base" if not pct else f"{float(pct):g}"
        out.append(Variant(name, config, {"pct": float(pct), "d_k": adapter.dims(config).head_k_dim,
                                          "state_bytes_per_sequence": adapter.config_state_bytes(config)}))
    for name, alloc in (allocations or {}).items():
        if name == "base" or any(v.name == name for v in out):
            raise ValueError(f"allocation name {name!r} is taken (base and the pcts name the uniform cuts)")
        config = bench.model_config(family, arch, key_dims=alloc["widths"])
        record = {**dict(alloc), "widths": getattr(config, KEY_DIMS_FIELD),
                  "state_bytes_per_sequence": adapter.config_state_bytes(config)}
        out.append(Variant(name, config, record))
    return out


# ---------------------------------------------------------------------------------------------
# the generation loop and its cache
# ---------------------------------------------------------------------------------------------
def install_cache_alias(model) -> bool:
    """Let ``model`` take its cache as ``cache=`` too (True where it was needed).

    ``generate`` of transformers >= 5.24 passes the cache on as ``cache``; a model whose forward knows only
    ``past_key_values`` (fla 0.6.0's) ignores it and starts each step from an empty state. The model's forward is
    wrapped (an instance attribute) to map ``cache`` onto ``past_key_values``; its signature gains ``cache`` so that
    ``generate`` accepts a prefilled cache.
    """
    forward = model.forward
    sig = inspect.signature(forward)
    if "cache" in sig.parameters or "past_key_values" not in sig.parameters:
        return False

    @functools.wraps(forward)
    def with_cache(*args, cache=None, **kwargs):
        if cache is not None and kwargs.get("past_key_values") is None:
            kwargs["past_key_values"] = cache
        return forward(*args, **kwargs)

    params = list(sig.parameters.values())
    at = next((i for i, p in enumerate(params) if p.kind is inspect.Parameter.VAR_KEYWORD), len(params))
    extra = inspect.Parameter("cache", inspect.Parameter.KEYWORD_ONLY, default=None)
    with_cache.__signature__ = sig.replace(parameters=[*params[:at], extra, *params[at:]])
    model.forward = with_cache
    return True


def output_cache(out):
    """The cache of a model or ``generate`` output (``cache`` in transformers >= 5.24, ``past_key_values`` before)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


# A cache slot: (kind, getter, setter, token axis). Kinds: "recurrent" and "conv" (the state), "attention" (K and V
# of a softmax layer: tokens on axis -2 in transformers' layout, on axis 1 in fla's), "other".
def _slots(cache) -> list[tuple[str, Callable[[], Any], Callable[[Any], None], int | None]]:
    out = []
    for layer in getattr(cache, "layers", []):
        state = getattr(layer, "state", None)
        if isinstance(state, dict):  # fla's FLALayer
            for key, kind in (("recurrent_state", "recurrent"), ("conv_state", "conv"), ("attn_state", "attention"),
                              ("ffn_state", "other")):
                value = state.get(key)
                axis = 1 if kind == "attention" else None
                if isinstance(value, torch.Tensor):
                    out.append((kind, functools.partial(state.get, key), functools.partial(state.__setitem__, key),
                                axis))
                elif isinstance(value, (tuple, list)):
                    for i, t in enumerate(value):
                        if isinstance(t, torch.Tensor):
                            out.append((kind, lambda s=state, k=key, i=i: s[k][i],
                                        lambda v, s=state, k=key, i=i: _set_item(s, k, i, v), axis))
            continue
        for name in ("keys", "values"):  # transformers' layers
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor) and t.numel():
                out.append(("attention", lambda la=layer, n=name: getattr(la, n),
                            lambda v, la=layer, n=name: setattr(la, n, v), -2))
        for name, kind in (("conv_states", "conv"), ("recurrent_states", "recurrent")):
            states = getattr(layer, name, None)
            if isinstance(states, dict):
                for i, t in states.items():
                    if isinstance(t, torch.Tensor):
                        out.append((kind, functools.partial(states.get, i), functools.partial(states.__setitem__, i),
                                    None))
    return out


def _set_item(state: dict, key: str, i: int, value: torch.Tensor) -> None:
    items = list(state[key])
    items[i] = value
    state[key] = tuple(items) if isinstance(state[key], tuple) else items


def cache_items(cache) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of a decoding cache (fla's or transformers'), in a fixed order, with its kind: ``recurrent``,
    ``conv``, ``attention`` (a softmax layer's keys or values) or ``other``. Batch is the first axis of each."""
    return [(kind, get()) for kind, get, _, _ in _slots(cache)]


def cache_bytes(cache) -> dict[str, int]:
    """Bytes of every tensor of ``cache`` by kind, with ``batch`` (the first axis) and ``attention_tokens`` (tokens
    held by the attention layers, 0 without them): ``{"recurrent", "conv", "attention", "other", "total",
    "batch", "attention_tokens"}``."""
    out = dict.fromkeys(("recurrent", "conv", "attention", "other"), 0)
    batch = tokens = 0
    for kind, get, _, axis in _slots(cache):
        t = get()
        out[kind] += t.numel() * t.element_size()
        batch = batch or t.shape[0]
        if axis is not None:
            tokens = tokens or t.shape[axis]
    out["total"] = sum(out.values())
    return {**out, "batch": int(batch), "attention_tokens": int(tokens)}


def per_sequence(measured: Mapping[str, int]) -> dict[str, float]:
    """Of :func:`cache_bytes` of a cache: per sequence, the state (recurrent + conv + other) and the attention bytes
    per token held (``attention_per_token``, 0 without attention layers)."""
    b = max(measured["batch"], 1)
    state = (measured["recurrent"] + measured["conv"] + measured["other"]) / b
    per_token = measured["attention"] / b / measured["attention_tokens"] if measured["attention_tokens"] else 0.0
    return {"recurrent": measured["recurrent"] / b, "conv": measured["conv"] / b, "state": state,
            "attention_per_token": per_token}


def config_cache_bytes(family: str, config, tokens: int, dtype: torch.dtype, state_bytes: int = 4) -> dict[str, int]:
    """Per-sequence cache bytes the config describes at ``tokens`` tokens held: the recurrent state of every
    linear-attention layer at its own width (``state_bytes`` an element: fla and transformers keep it in float32),
    the conv states (``dtype``), and K and V of every other decoder layer (softmax attention: ``num_key_value_heads``
    x ``head_dim`` per token, ``dtype``).

    Raises:
        ValueError: one line, for softmax layers whose K/V width the config does not give.
    """
    adapter = adapter_class(family)
    elem = torch.empty((), dtype=dtype).element_size()
    shapes = adapter.config_layer_state_shapes(config)
    recurrent = sum(s.recurrent_elems for s in shapes.values()) * state_bytes
    conv = sum(s.conv_elems for s in shapes.values()) * elem
    text = getattr(config, "text_config", None) or config
    n_attention = text.num_hidden_layers - len(shapes)
    attention = 0
    if n_attention:
        heads = getattr(text, "num_key_value_heads", None)
        head_dim = getattr(text, "head_dim", None)
        if heads is None or head_dim is None:
            raise ValueError(f"{family}: {n_attention} softmax-attention layers whose K/V width the config does not "
                             "give (num_key_value_heads, head_dim)")
        attention = n_attention * 2 * heads * head_dim * elem * int(tokens)
    return {"recurrent": recurrent, "conv": conv, "attention": attention, "total": recurrent + conv + attention}


def weight_bytes(model) -> int:
    """Bytes of the model's parameters and buffers (a tied weight once; on the meta device, by tensor)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        key = id(t) if t.is_meta else t.data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def max_batch(budget_bytes: float, weights: float, per_sequence_bytes: float, multiple: int = 1) -> int:
    """The largest batch, a multiple of ``multiple``, whose caches fit beside the weights:
    ``floor((budget - weights) / per_sequence / multiple) * multiple`` (0 when not even ``multiple`` fit)."""
    if per_sequence_bytes <= 0:
        raise ValueError(f"per-sequence bytes must be positive; got {per_sequence_bytes}")
    free = budget_bytes - weights
    if free <= 0:
        return 0
    return int(free // per_sequence_bytes) // multiple * multiple


class _Clock:
    """Wall clock of one ``generate`` call, CUDA synchronised at each mark."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.start = self.first = None

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def criterion(self) -> _FirstToken:
        return _FirstToken(self)


class _FirstToken(StoppingCriteria):
    """A stopping criterion that never stops and notes on its clock when the first token was appended."""

    def __init__(self, clock: _Clock):
        self.clock = clock

    def __call__(self, input_ids, scores, **kwargs):
        if self.clock.first is None:
            self.clock.first = self.clock.now()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _generate_kwargs(model, new_tokens: int) -> dict[str, Any]:
    eos = model.config.eos_token_id
    pad = model.config.pad_token_id
    pad = pad if pad is not None else (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    return {"do_sample": False, "num_beams": 1, "max_new_tokens": new_tokens, "min_new_tokens": new_tokens,
            "pad_token_id": pad, "use_cache": True, "return_dict_in_generate": True}


def prefill_in_chunks(model, ids: torch.Tensor, per_chunk: int):
    """The cache and last-position logits of ``model`` over ``ids`` ``[B, T]``, prefilled ``per_chunk`` sequences a
    forward; each chunk's cache tensors are copied into one batch cache (the first chunk's cache object, its tensors
    replaced), so the peak holds one chunk's activations beside the batch cache."""
    batch = ids.shape[0]
    cache = slots = None
    logits = []
    with torch.no_grad():
        for start in range(0, batch, per_chunk):
            end = min(batch, start + per_chunk)
            out = model(ids[start:end], use_cache=True, logits_to_keep=1)
            part = output_cache(out)
            if cache is None:
                cache, slots = part, _slots(part)
                for _, get, put, _ in slots:
                    t = get()
                    full = t.new_empty((batch, *t.shape[1:]))
                    full[:end].copy_(t)
                    put(full)
            else:
                for (_, get, _, _), (_, t) in zip(slots, cache_items(part)):
                    get()[start:end].copy_(t)
            logits.append(out.logits[:, -1])
            del out, part
    return cache, torch.cat(logits)


def time_generate(model, batch: int, prompt: int, new_tokens: int, *, per_chunk: int | None = None,
                  seed: int = 0) -> dict[str, Any]:
    """One timed generation of ``new_tokens`` tokens after random ``prompt``-token prompts at ``batch`` sequences.

    ``per_chunk`` None (or at least ``batch``): one ``generate`` call; else the prompt is prefilled ``per_chunk``
    sequences a forward (:func:`prefill_in_chunks`), the first token is the argmax of the last logits, and ``generate``
    runs the other steps from that cache. Returns ``ttft_s``, ``total_s``, ``decode_s``, the tokens (``sequences``)
    and the cache's bytes at the end (:func:`cache_bytes`).
    """
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(model.config.vocab_size, (batch, prompt), device=device, generator=gen)
    clock = _Clock(device)
    with torch.no_grad():
        clock.start = clock.now()
        if per_chunk is None or per_chunk >= batch:
            out = model.generate(ids, attention_mask=torch.ones_like(ids), stopping_criteria=[clock.criterion()],
                                 **_generate_kwargs(model, new_tokens))
            sequences, cache = out.sequences, output_cache(out)
        else:
            cache, last = prefill_in_chunks(model, ids, per_chunk)
            sequences = torch.cat([ids, last.argmax(-1, keepdim=True)], 1)
            clock.first = clock.now()
            del last
            if new_tokens > 1:
                out = model.generate(sequences, attention_mask=torch.ones_like(sequences), cache=cache,
                                     **_generate_kwargs(model, new_tokens - 1))
                sequences, cache = out.sequences, output_cache(out)
        end = clock.now()
    if sequences.shape[1] != prompt + new_tokens:
        raise RuntimeError(f"generate made {sequences.shape[1] - prompt} tokens, not {new_tokens}")
    return {"ttft_s": clock.first - clock.start, "total_s": end - clock.start, "decode_s": end - clock.first,
            "sequences": sequences, "cache_bytes": cache_bytes(cache)}


def _sync_free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _prefill_plans(batch: int, per_chunk: int | None, chunk: int):
    """Sequences per prefill forward to try in turn (None: one ``generate`` call): ``per_chunk`` (or one call, then
    ``chunk``), each next one half the last, down to one."""
    if per_chunk is None:
        yield None
        size = min(chunk, (batch + 1) // 2) if batch > 1 else 0
    else:
        size = per_chunk
    while size >= 1:
        yield size
        size //= 2


def measure_cell(model, batch: int, prompt: int, new_tokens: int, *, trials: int, per_chunk: int | None,
                 prefill_tokens: int, warmup: bool = True) -> dict[str, Any]:
    """A cell: ``trials`` timed generations (:func:`time_generate`), the median of each measure, tokens/s and peak
    memory, after (``warmup``) one untimed generation of 2 tokens at the same shapes. Without ``per_chunk`` it first
    tries one ``generate`` call; if that runs out of memory it prefills in sub-batches of ``prefill_tokens // prompt``
    sequences (at most half the batch), halved while it does not fit. Out of memory at one sequence a forward:
    ``{"skipped": reason}``."""
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    cell: dict[str, Any] = {"batch": batch, "prompt": prompt, "new_tokens": new_tokens}
    notes, runs, used = [], None, None
    for used in _prefill_plans(batch, per_chunk, max(1, prefill_tokens // prompt)):
        _sync_free(device)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            resident = torch.cuda.memory_allocated()
        try:
            if warmup:
                t0 = time.perf_counter()
                del time_generate(model, batch, prompt, min(2, new_tokens), per_chunk=used, seed=99)["sequences"]
                cell["warmup_s"] = round(time.perf_counter() - t0, 2)
                _sync_free(device)
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
            runs = []
            for t in range(trials):
                run = time_generate(model, batch, prompt, new_tokens, per_chunk=used, seed=t)
                del run["sequences"]
                runs.append(run)
            break
        except torch.cuda.OutOfMemoryError as e:
            how = "one generate call" if used is None or used >= batch else f"{used} sequences a prefill forward"
            notes.append(f"out of memory with {how} ({str(e).splitlines()[0][:100]})")
            runs = None
    if runs is None:
        _sync_free(device)
        cell["skipped"] = "; ".join(notes) or "out of memory"
        return cell
    if notes:
        cell["fallback"] = notes
    cell["prefill_chunks"] = 1 if used is None or used >= batch else math.ceil(batch / used)
    cell["sequences_per_prefill"] = batch if used is None else min(used, batch)
    med = {k: statistics.median(r[k] for r in runs) for k in ("ttft_s", "total_s", "decode_s")}
    cell.update(med)
    cell["trials"] = [{k: round(r[k], 5) for k in ("ttft_s", "total_s")} for r in runs]
    cell["decode_tokens_per_s"] = batch * (new_tokens - 1) / med["decode_s"] if new_tokens > 1 else None
    cell["tokens_per_s"] = batch * new_tokens / med["total_s"]
    cell["cache_bytes"] = runs[-1]["cache_bytes"]
    if cuda:
        cell["peak_mem_bytes"] = int(torch.cuda.max_memory_allocated())
        cell["resident_before_bytes"] = int(resident)
    return cell


def warm_up(model, settings: GenerateSettings) -> float:
    """Short ``generate`` calls at ``warmup_batches`` (Triton compiles and autotunes here); their seconds."""
    t0 = time.perf_counter()
    for b in settings.warmup_batches:
        del time_generate(model, b, settings.warmup_prompt, settings.warmup_tokens, seed=99)["sequences"]
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# one run
# ---------------------------------------------------------------------------------------------
def machine_id(device: torch.device) -> str:
    """The host and the device a run measured on: ``host/GPU-UUID`` on CUDA, ``host/cpu`` otherwise."""
    if device.type == "cuda":
        return f"{platform.node()}/{torch.cuda.get_device_properties(device).uuid}"
    return f"{platform.node()}/cpu"


# what a resumed run must share with the document it continues (the variants' records without what a build measures)
RESUME_KEYS = ("kind", "model", "family", "arch", "settings", "parts", "versions", "machine", "budget_bytes")
MEASURED_VARIANT_KEYS = ("weights_bytes", "build_s", "warmup_s", "cache")


def _resumed(out_path: Path, doc: Mapping[str, Any]) -> dict | None:
    """The document at ``out_path`` to continue, or None where there is none.

    Raises:
        ValueError: one line, where it was measured with another model, settings, versions or machine (its ratios
            would mix two runs).
    """
    if not out_path.is_file():
        log.info("--resume: %s does not exist; measuring afresh", out_path)
        return None
    old = json.loads(out_path.read_text())
    for key in RESUME_KEYS:
        if json.loads(json.dumps(old.get(key))) != json.loads(json.dumps(doc[key])):
            raise ValueError(f"--resume: {out_path} was measured with another {key} ({old.get(key)!r}; this run: "
                             f"{doc[key]!r}); its ratios would mix two runs: measure afresh into another file")
    strip = [{n: {k: v for k, v in r.items() if k not in MEASURED_VARIANT_KEYS} for n, r in d["variants"].items()}
             for d in (old, doc)]
    if json.loads(json.dumps(strip[0])) != json.loads(json.dumps(strip[1])):
        raise ValueError(f"--resume: {out_path} measured other variants ({', '.join(old['variants'])}; this run: "
                         f"{', '.join(doc['variants'])}); measure afresh into another file")
    return old


def run_generate(family: str, arch: Mapping[str, Any], settings: GenerateSettings, out_path: str | Path, *,
                 model_name: str | None = None, parts: Sequence[str] = PARTS,
                 allocations: Mapping[str, Mapping] | None = None, device: str = "cuda",
                 pcts: Sequence | None = None, resume: bool = False) -> dict:
    """Measure every variant (:func:`variants`) of the model of ``arch``: the table and the budget (``parts``); write
    ``out_path`` after every cell (atomically, so a killed run keeps what it measured).

    With ``resume``, a document already at ``out_path`` is continued: its cells are kept and only the missing ones
    measured (a variant with none missing is not built). It must come from this machine and GPU (:func:`machine_id`),
    with the same model, settings, parts, variants and versions, so that every ratio stays within one machine's
    measurements; the document counts the runs that made it (``runs``).

    Args:
        family, arch: the model (random weights of that shape).
        settings: what to measure.
        out_path: the JSON to write.
        model_name: the workflow's model name, recorded.
        parts: a subset of :data:`PARTS`.
        allocations: named per-layer allocations (name -> ``{"widths": [...], ...}``), measured after the ratios.
        device: ``cuda`` (CPU only for tests: no memory figures).
        pcts: the ratios when ``settings.pcts`` is None (default 50 and 75).
        resume: continue the document at ``out_path`` (above).
    Returns:
        The document: ``variants`` (per variant its widths, state bytes, weights and the cache bytes a one-sequence
        prefill leaves at each context), ``table`` and ``budget`` cells, ``ratios`` (:func:`generate_ratios`), the
        device and versions.
    """
    parts = list(parts)
    bad = sorted(set(parts) - set(PARTS))
    if bad:
        raise ValueError(f"unknown generate part(s) {bad}; valid: {', '.join(PARTS)}")
    if device == "cuda":
        bench.require_cuda()
    dev = torch.device(device)
    pcts = list(settings.pcts if settings.pcts is not None else (pcts if pcts is not None else [50, 75]))
    models = variants(family, arch, pcts, allocations)
    dtype = getattr(torch, settings.dtype)
    if settings.budget_prompt is not None and "budget" in parts and any(
            config_cache_bytes(family, v.config, 1, dtype)["attention"] for v in models):
        raise ValueError("generate budget_prompt shortens the prompt of the timed budget cells, which is exact only "
                         f"for models whose cache holds no attention KV; {model_name or family}'s grows with the "
                         "context")
    doc: dict[str, Any] = {
        "kind": "generate", "model": model_name, "family": family, "arch": dict(arch), "settings": settings.to_dict(),
        "parts": parts, "weights": "random (speed does not depend on weight values); shapes from arch and the pruned "
        "config", "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "versions": versions(),
        "kernels": _kernel_record(), "budget_bytes": int(settings.budget_gib * GIB),
        "variants": {v.name: v.record for v in models}, "table": [], "budget": [], "machine": machine_id(dev),
        "runs": 1,
    }
    t0, before = time.perf_counter(), 0.0
    previous = _resumed(Path(out_path), doc) if resume else None
    if previous is not None:
        doc["variants"] = previous["variants"]
        doc["table"], doc["budget"] = previous["table"], previous["budget"]
        doc["runs"], before = previous.get("runs", 1) + 1, previous.get("elapsed_s", 0.0)

    def save():
        doc["ratios"] = generate_ratios(doc)
        doc["elapsed_s"] = round(before + time.perf_counter() - t0, 1)
        write_json(out_path, doc)

    def missing(v: Variant) -> tuple[list[int], list[int]]:
        table = {c["batch"] for c in doc["table"] if c["variant"] == v.name}
        budget = {c["context"] for c in doc["budget"] if c["variant"] == v.name}
        return ([b for b in settings.batches if b not in table] if "table" in parts else [],
                [c for c in settings.contexts if c not in budget] if "budget" in parts else [])

    todo = {v.name: missing(v) for v in models}
    n_cells = sum(len(t) + len([c for c in b if c in settings.timed]) for t, b in todo.values())
    if previous is not None:
        log.info("--resume: %s holds %d table and %d budget cells; %d timed cells to go", out_path,
                 len(doc["table"]), len(doc["budget"]), n_cells)
    bar = tqdm(total=n_cells, desc=f"generate {model_name or family}", unit="cell")
    for v in models:
        batches, contexts = todo[v.name]
        if not batches and not contexts:
            continue
        t_build = time.perf_counter()
        model = bench.build_model(v.config, dtype, device)
        install_cache_alias(model)
        record = doc["variants"][v.name]
        record["weights_bytes"] = weight_bytes(model)
        record["build_s"] = round(time.perf_counter() - t_build, 2)
        record["warmup_s"] = round(warm_up(model, settings), 2)
        log.info("%s: built in %.1f s, warmed up in %.1f s", v.name, record["build_s"], record["warmup_s"])
        if "budget" in parts and "cache" not in record:
            record["cache"] = _cache_record(model, family, v.config, settings, dtype)
        save()
        if "table" in parts:
            for batch in batches:
                cell = {"variant": v.name, **measure_cell(model, batch, settings.prompt, settings.new_tokens,
                                                         trials=settings.trials, per_chunk=None,
                                                         prefill_tokens=settings.prefill_tokens,
                                                         warmup=settings.cell_warmup)}
                doc["table"].append(cell)
                log.info("table %s B=%d %s", v.name, batch, _brief(cell))
                bar.update()
                save()
        if "budget" in parts:
            for context in contexts:
                cell = _budget_cell(model, v.name, record, context, settings, doc["budget_bytes"])
                if "max_batch" in cell and cell["max_batch"] and context in settings.timed:
                    batch = cell["batch"]
                    prompt = _budget_prompt(record, context, settings)
                    per_chunk = max(1, min(batch, settings.prefill_tokens // prompt))
                    cell.update(measure_cell(model, batch, prompt, settings.budget_new_tokens, trials=1,
                                             per_chunk=per_chunk, prefill_tokens=settings.prefill_tokens,
                                             warmup=settings.cell_warmup))
                    bar.update()
                elif context in settings.timed:
                    cell["skipped"] = "no sequence fits beside the weights"
                    bar.update()
                doc["budget"].append(cell)
                log.info("budget %s context=%d %s", v.name, context, _brief(cell))
                save()
        del model
        _sync_free(dev)
    bar.close()
    save()
    return doc


def _brief(cell: Mapping[str, Any]) -> dict:
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in cell.items()
            if k not in ("trials", "cache_bytes", "fallback")}


def _kernel_record() -> dict[str, bool]:
    """Which optional kernel packages this process can import (transformers' Qwen3.5 uses fla's delta rule and
    causal-conv1d's short convolution where they are installed, its PyTorch code otherwise)."""
    return {name: importlib.util.find_spec(name) is not None for name in ("fla", "causal_conv1d")}


def _cache_record(model, family: str, config, settings: GenerateSettings, dtype: torch.dtype) -> dict:
    """Per context: the cache bytes a one-sequence prefill of that many tokens leaves (:func:`cache_bytes`, per
    sequence) and what the config says (:func:`config_cache_bytes`) at the same tokens."""
    device = next(model.parameters()).device
    out = {}
    for context in settings.contexts:
        ids = torch.randint(model.config.vocab_size, (1, context), device=device)
        with torch.no_grad():
            measured = cache_bytes(output_cache(model(ids, use_cache=True, logits_to_keep=1)))
        from_config = config_cache_bytes(family, config, measured["attention_tokens"] or context, dtype)
        out[str(context)] = {"measured": measured, "config": from_config,
                             "matches_config": all(measured[k] == from_config[k]
                                                   for k in ("recurrent", "conv", "attention"))}
        _sync_free(device)
    return out


def _budget_prompt(record: Mapping[str, Any], context: int, settings: GenerateSettings) -> int:
    """The prompt of a timed budget cell: ``budget_prompt`` where the cache holds no attention KV (checked by
    :func:`run_generate` from the config, and here on the measured cache), else the context."""
    if settings.budget_prompt is None:
        return context
    assert not any(c["measured"]["attention"] for c in record["cache"].values())
    return settings.budget_prompt


def _budget_cell(model, name: str, record: dict, context: int, settings: GenerateSettings, budget: int) -> dict:
    """The budget arithmetic of one variant at one context: per-sequence bytes at ``context + budget_new_tokens``
    tokens (state + attention per token x tokens, from the one-sequence prefill), the largest batch and, capped,
    the batch to time."""
    cache = record["cache"][str(context)]["measured"]
    per = per_sequence(cache)
    tokens = context + settings.budget_new_tokens
    per_seq = per["state"] + per["attention_per_token"] * tokens
    weights = record["weights_bytes"]
    largest = max_batch(budget, weights, per_seq, settings.budget_multiple)
    batch = largest if settings.budget_max_batch is None else min(largest, settings.budget_max_batch)
    return {"variant": name, "context": context, "tokens_held": tokens, "weights_bytes": weights,
            "state_bytes_per_sequence": per["state"], "recurrent_bytes_per_sequence": per["recurrent"],
            "conv_bytes_per_sequence": per["conv"],
            "attention_bytes_per_sequence": per["attention_per_token"] * tokens, "per_sequence_bytes": per_seq,
            "max_batch": largest, "batch": batch, "capped": batch != largest,
            "predicted_resident_bytes": weights + batch * per_seq}


def budget_from_config(family: str, arch: Mapping[str, Any], settings: GenerateSettings, *,
                       model_name: str | None = None, pcts: Sequence | None = None,
                       allocations: Mapping[str, Mapping] | None = None) -> dict:
    """The budget part's arithmetic without a GPU: every variant's weights (a model built on the meta device) and its
    per-sequence cache bytes from the config (:func:`config_cache_bytes`, float32 recurrent state as fla and
    transformers keep it), the largest batch at each context; nothing is timed. The document's ``source`` says so;
    the run's own documents hold the measured counts (which equal these where both exist)."""
    pcts = list(settings.pcts if settings.pcts is not None else (pcts if pcts is not None else [50, 75]))
    dtype = getattr(torch, settings.dtype)
    doc: dict[str, Any] = {
        "kind": "generate", "source": "config (no GPU: the byte counts of the config, nothing timed)",
        "model": model_name, "family": family, "arch": dict(arch), "settings": settings.to_dict(), "parts": ["budget"],
        "device": "none", "versions": versions(), "budget_bytes": int(settings.budget_gib * GIB), "variants": {},
        "table": [], "budget": [],
    }
    adapter = adapter_class(family)
    for v in variants(family, arch, pcts, allocations):
        with torch.device("meta"):
            model = adapter.build(v.config, dtype=dtype)
        if getattr(v.config, KEY_DIMS_FIELD, None) is not None:  # per-layer widths: each mixer at its own
            shape_mixers(adapter(model), getattr(v.config, KEY_DIMS_FIELD))
        record = {**v.record, "weights_bytes": weight_bytes(model), "cache": {}}
        for context in settings.contexts:
            c = config_cache_bytes(family, v.config, context, dtype)
            record["cache"][str(context)] = {"config": c, "measured": {**c, "other": 0, "batch": 1,
                                                                       "attention_tokens": context if c["attention"]
                                                                       else 0}}
        doc["variants"][v.name] = record
        for context in settings.contexts:
            doc["budget"].append(_budget_cell(None, v.name, record, context, settings, doc["budget_bytes"]))
        del model
    doc["ratios"] = generate_ratios(doc)
    return doc


# ---------------------------------------------------------------------------------------------
# ratios and tables
# ---------------------------------------------------------------------------------------------
def generate_ratios(doc: Mapping[str, Any]) -> dict[str, list[dict]]:
    """Every variant over the baseline of the same document and cell: ``table`` rows per (variant, batch):
    ``speedup`` (base total / total: end to end), ``decode_speedup`` (decode tokens/s over base's), ``ttft_speedup``
    (base TTFT / TTFT) and ``memory_ratio`` (peak / base peak); ``budget`` rows per (variant, context): ``batch_ratio``
    (largest batch over base's), ``throughput_ratio`` (tokens/s at the largest batch over base's at its own)."""
    out: dict[str, list[dict]] = {"table": [], "budget": []}
    base = {c["batch"]: c for c in doc.get("table", []) if c["variant"] == "base" and "total_s" in c}
    for c in doc.get("table", []):
        ref = base.get(c["batch"])
        if c["variant"] == "base" or ref is None or "total_s" not in c:
            continue
        row = {"variant": c["variant"], "batch": c["batch"], "speedup": ref["total_s"] / c["total_s"],
               "ttft_speedup": ref["ttft_s"] / c["ttft_s"]}
        if c.get("decode_tokens_per_s") and ref.get("decode_tokens_per_s"):
            row["decode_speedup"] = c["decode_tokens_per_s"] / ref["decode_tokens_per_s"]
        if "peak_mem_bytes" in c and "peak_mem_bytes" in ref:
            row["memory_ratio"] = c["peak_mem_bytes"] / ref["peak_mem_bytes"]
        if c.get("prefill_chunks") != ref.get("prefill_chunks"):
            row["prefill_differs"] = True
        out["table"].append(row)
    bud = {c["context"]: c for c in doc.get("budget", []) if c["variant"] == "base"}
    for c in doc.get("budget", []):
        ref = bud.get(c["context"])
        if c["variant"] == "base" or ref is None:
            continue
        row = {"variant": c["variant"], "context": c["context"],
               "batch_ratio": c["max_batch"] / ref["max_batch"] if ref.get("max_batch") else None}
        if c.get("tokens_per_s") and ref.get("tokens_per_s"):
            row["throughput_ratio"] = c["tokens_per_s"] / ref["tokens_per_s"]
            if c.get("decode_tokens_per_s") and ref.get("decode_tokens_per_s"):
                row["decode_throughput_ratio"] = c["decode_tokens_per_s"] / ref["decode_tokens_per_s"]
        out["budget"].append(row)
    return out


def _gib(n: float | None) -> str:
    return "–" if n is None else f"{n / GIB:.2f}"


def _mib(n: float | None) -> str:
    return "–" if n is None else f"{n / (1 << 20):.1f}"


def _variant_label(doc: Mapping[str, Any], name: str) -> str:
    if name == "base":
        return "base"
    rec = doc["variants"][name]
    if rec.get("widths") is not None:
        return f"{name} ({bench.widths_summary(rec['widths'])})"
    return f"{name} % (d_k' {rec['d_k']})"


FIRST_USE_NOTE = ("† measured without the per-cell warm-up (`cell_warmup`): the time to first token, and with it the "
                  "total, the end-to-end rate and their ratios, hold fla's first-call autotuning at the cell's batch x "
                  "length (seconds); the decode rate excludes the prefill (its first step can hold an autotuning at a "
                  "new batch).")


def _first_use(doc: Mapping[str, Any]) -> bool:
    """Whether a document's cells were timed without the per-cell warm-up (documents from before ``cell_warmup``)."""
    return not doc.get("settings", {}).get("cell_warmup", False)


def table_markdown(doc: Mapping[str, Any]) -> str:
    """The table part of a document: per batch and variant, decode tokens/s, end-to-end tokens/s, TTFT, total, peak
    memory and the ratios against the baseline (a document timed without the per-cell warm-up marks what its
    first calls' autotuning holds with †, :data:`FIRST_USE_NOTE`)."""
    head = ["B", "variant", "decode tok/s", "end-to-end tok/s", "TTFT s", "total s", "peak GiB", "speedup (end to end)",
            "decode ×", "TTFT ×", "memory ×"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    ratios = {(r["variant"], r["batch"]): r for r in generate_ratios(doc)["table"]}
    order = list(doc["variants"])
    dag = "†" if _first_use(doc) else ""
    for c in sorted(doc["table"], key=lambda c: (c["batch"], order.index(c["variant"]))):
        label = _variant_label(doc, c["variant"])
        if "skipped" in c:
            lines.append(f"| {c['batch']} | {label} | skipped: {c['skipped'][:80]} |" + " |" * (len(head) - 3))
            continue
        r = ratios.get((c["variant"], c["batch"]), {})
        base = c["variant"] == "base"
        chunks = f" ({c['prefill_chunks']} prefill forwards)" if c.get("prefill_chunks", 1) > 1 else ""
        lines.append("| " + " | ".join([
            str(c["batch"]), label, f"{c['decode_tokens_per_s']:,.0f}" if c.get("decode_tokens_per_s") else "–",
            f"{c['tokens_per_s']:,.0f}{dag}", f"{c['ttft_s']:.3f}{dag}{chunks}", f"{c['total_s']:.2f}{dag}",
            _gib(c.get("peak_mem_bytes")),
            "1.00×" if base else (f"{r['speedup']:.2f}×{dag}" if "speedup" in r else "–"),
            "1.00×" if base else (f"{r['decode_speedup']:.2f}×" if "decode_speedup" in r else "–"),
            "1.00×" if base else (f"{r['ttft_speedup']:.2f}×{dag}" if "ttft_speedup" in r else "–"),
            "1.00×" if base else (f"{r['memory_ratio']:.2f}×" if "memory_ratio" in r else "–")]) + " |")
    return "\n".join(lines)


def budget_markdown(doc: Mapping[str, Any]) -> str:
    """The budget part of a document: per context and variant, the bytes per sequence (state, attention), the largest
    batch at the budget, the measured peak and the throughput at that batch, with ratios against the baseline."""
    head = ["context", "variant", "state MiB/seq", "attention KV MiB/seq", "weights GiB", "largest batch",
            "batch ×", "predicted GiB", "peak GiB", "tok/s (decode)", "decode ×", "tok/s (end to end)",
            "end to end ×"]
    ratios = {(r["variant"], r["context"]): r for r in generate_ratios(doc)["budget"]}
    order = list(doc["variants"])
    dag = "†" if _first_use(doc) else ""
    width = len(head) if any("tokens_per_s" in c or "skipped" in c for c in doc["budget"]) else 8  # bytes only
    head = head[:width]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for c in sorted(doc["budget"], key=lambda c: (c["context"], order.index(c["variant"]))):
        r = ratios.get((c["variant"], c["context"]), {})
        base = c["variant"] == "base"
        timed = "tokens_per_s" in c
        batch = f"{c['max_batch']:,}" + (f" (timed at {c['batch']:,})" if c.get("capped") else "")
        lines.append("| " + " | ".join([
            f"{c['context']:,}", _variant_label(doc, c["variant"]), _mib(c["state_bytes_per_sequence"]),
            _mib(c["attention_bytes_per_sequence"]), _gib(c["weights_bytes"]), batch,
            "1.00×" if base else (f"{r['batch_ratio']:.2f}×" if r.get("batch_ratio") else "–"),
            _gib(c["predicted_resident_bytes"]), _gib(c.get("peak_mem_bytes")),
            (f"{c['decode_tokens_per_s']:,.0f}" + (f" (prompt {c['prompt']:,})" if c["prompt"] != c["context"] else ""))
            if c.get("decode_tokens_per_s") else ("not timed" if not timed and "skipped" not in c else "–"),
            "1.00×" if base and timed else (f"{r['decode_throughput_ratio']:.2f}×" if "decode_throughput_ratio" in r
                                            else "–"),
            f"{c['tokens_per_s']:,.0f}{dag}" if timed else (f"skipped: {c['skipped'][:60]}" if "skipped" in c else "–"),
            "1.00×" if base and timed else (f"{r['throughput_ratio']:.2f}×{dag}" if "throughput_ratio" in r else "–"),
        ][:width]) + " |")
    return "\n".join(lines)


def documents_markdown(paths: Sequence[str | Path]) -> str:
    """Both parts of every document in ``paths`` (a heading per model and part, the device and settings named)."""
    out = []
    for path in paths:
        doc = json.loads(Path(path).read_text())
        s = doc["settings"]
        name = doc.get("model") or doc["family"]
        where = f"{doc['device']}, {Path(path).name}" if doc["device"] != "none" else (
            f"byte counts of the config, nothing timed, {Path(path).name}")
        if doc.get("table"):
            out += [f"#### {name}: `generate()`, prompt {s['prompt']:,}, {s['new_tokens']} new tokens ({where})", "",
                    table_markdown(doc), ""]
        if doc.get("budget"):
            title = (f"#### {name}: largest batch at {s['budget_gib']:g} GiB, {s['budget_new_tokens']} new tokens "
                     f"({where})")
            out += [title, "", budget_markdown(doc), ""]
        for vname, rec in doc["variants"].items():
            if rec.get("widths") is not None:
                src = rec.get("source") or {}
                origin = (f" (scaled from {src.get('model')}'s {src.get('method')} {rec['pct']:g} % allocation "
                          f"{rec['source_widths']}, d_k {rec['source_d_k']}: {rec['rule']})" if src else "")
                widths = ", ".join("–" if w is None else str(w) for w in rec["widths"])
                out += [f"- {name} `{vname}`: d_k' per layer {widths}{origin}", ""]
        if _first_use(doc):
            out += [FIRST_USE_NOTE, ""]
    return "\n".join(out).rstrip() + "\n"



def summary_markdown(paths: Sequence[str | Path]) -> str:
    """One table over the documents in ``paths``: per model and pruned variant, the end-to-end speedup of
    ``generate()`` at every batch of the table, the decode speedup and peak memory at the largest batch, and the
    largest batch at the budget per context (with the throughput ratio where that batch was timed). A model's table
    and budget may come from different documents (a timed table beside a ``--bytes-only`` budget), and its variants
    from several table documents (each variant's row from the document with most of its cells, the first on a tie);
    each ratio is within its own document, against the base measured in that run. Models keep the order of
    ``paths``."""
    docs = [(Path(p).name, json.loads(Path(p).read_text())) for p in paths]
    models: dict[str, dict[str, Any]] = {}
    for name, doc in docs:
        entry = models.setdefault(doc.get("model") or doc["family"], {"tables": []})
        if doc.get("table"):
            entry["tables"].append((name, doc))
        timed = any("tokens_per_s" in c for c in doc.get("budget", []))
        if doc.get("budget") and ("budget" not in entry or (timed and not entry["budget_timed"])):
            entry["budget"], entry["budget_timed"] = (name, doc), timed
    batches = sorted({c["batch"] for e in models.values() for _, d in e["tables"] for c in d["table"]})
    contexts = sorted({c["context"] for e in models.values() if "budget" in e for c in e["budget"][1]["budget"]})
    top = batches[-1] if batches else None
    head = (["model", "variant"] + [f"end to end × B = {b}" for b in batches]
            + ([f"decode × B = {top}", f"peak memory × B = {top}"] if batches else [])
            + [f"largest batch {_tokens(c)}" for c in contexts]
            + [f"tok/s × at that batch, {_tokens(c)}" for c in contexts])
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    sources, first_use = [], False
    for model, entry in models.items():
        tables = entry["tables"]
        bname, bdoc = entry.get("budget", (None, None))
        parts = [f"table {name} ({doc['device']})" for name, doc in tables]
        if bdoc:
            parts.append(f"budget {bname} ({bdoc['device'] if bdoc['device'] != 'none' else 'byte counts, untimed'})")
        sources.append(f"{model}: " + "; ".join(parts))
        trat = [{(r["variant"], r["batch"]): r for r in generate_ratios(d)["table"]} for _, d in tables]
        base_batches = {c["batch"] for _, d in tables for c in d["table"] if c["variant"] == "base"}
        brat = {(r["variant"], r["context"]): r for r in generate_ratios(bdoc)["budget"]} if bdoc else {}
        bcell = {(c["variant"], c["context"]): c for c in bdoc["budget"]} if bdoc else {}
        names = list(dict.fromkeys([v for _, d in tables for v in d.get("variants", {})]
                                   + list((bdoc or {}).get("variants", {}))))
        for v in names:
            shapes = {n: json.dumps([d["variants"][v].get("d_k"), d["variants"][v].get("widths")])
                      for n, d in tables if v in d.get("variants", {})}
            if len(set(shapes.values())) > 1:
                raise ValueError(f"--summary: variant {v!r} of {model} has other widths in "
                                 f"{', '.join(sorted(shapes))}; summarise one of them")
            counts = [sum(c["variant"] == v for c in d["table"]) for _, d in tables]
            k = counts.index(max(counts)) if counts and max(counts) else None
            tdoc, rat = (tables[k][1], trat[k]) if k is not None else (None, {})
            dag = "†" if tdoc and _first_use(tdoc) else ""
            first_use = first_use or bool(dag and v != "base")
            row = [model, _variant_label(tdoc if tdoc else bdoc, v)]
            for b in batches:
                r = rat.get((v, b), {})
                row.append("1.00×" if v == "base" and b in base_batches
                           else (f"{r['speedup']:.2f}×{dag}" if "speedup" in r else "–"))
            if batches:
                r = rat.get((v, top), {})
                base_top = v == "base" and top in base_batches
                row += [f"{r['decode_speedup']:.2f}×" if "decode_speedup" in r else ("1.00×" if base_top else "–"),
                        f"{r['memory_ratio']:.2f}×" if "memory_ratio" in r else ("1.00×" if base_top else "–")]
            for c in contexts:
                cell, r = bcell.get((v, c), {}), brat.get((v, c), {})
                row.append("–" if not cell.get("max_batch") else f"{cell['max_batch']:,}" + (
                    f" ({r['batch_ratio']:.2f}×)" if r.get("batch_ratio") else ""))
            for c in contexts:
                cell, r = bcell.get((v, c), {}), brat.get((v, c), {})
                bdag = "†" if _first_use(bdoc) else ""
                first_use = first_use or bool(bdag and "throughput_ratio" in r)
                row.append(f"{r['throughput_ratio']:.2f}×{bdag}" if "throughput_ratio" in r else (
                    "1.00×" if v == "base" and "tokens_per_s" in cell else "not timed" if cell else "–"))
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n\nSources: " + "; ".join(sources) + ".\n" + (f"\n{FIRST_USE_NOTE}\n" if first_use
                                                                             else "")


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else f"{n:,}"


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
def parse_allocation(spec: str, family: str, arch: Mapping[str, Any], multiple: int = 16) -> tuple[str, dict]:
    """``--recipe NAME=FILE``: a per-layer budget's allocation file of another model scaled onto this one
    (:func:`scale_allocation`), recorded with its source."""
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--recipe {spec!r}: give NAME=ALLOCATION.json")
    if not all(c.isalnum() or c in "_-." for c in name):
        raise ValueError(f"--recipe name {name!r} may hold only letters, digits, '_', '-' and '.'")
    if not Path(path).is_file():
        raise ValueError(f"--recipe file {path!r} not found")
    source = json.loads(Path(path).read_text())
    record = scale_allocation(source, family, arch, multiple=multiple)
    record["source"] = {"file": path, "model": source.get("model"), "method": source.get("method")}
    return name, record


def _int_list(option: str, text: str, allow_empty: bool = False) -> list[int]:
    """A comma-separated list of positive integers (``--batches 1,16``), or a one-line ValueError."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items and not allow_empty:
        raise ValueError(f"{option} {text!r}: give comma-separated positive integers")
    for item in items:
        if not item.isdigit() or int(item) < 1:
            raise ValueError(f"{option} {text!r}: {item!r} is not a positive integer")
    return [int(item) for item in items]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m statereduce.speed.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", help="generate.json to write")
    p.add_argument("--tables", nargs="+", metavar="DOC", help="print the Markdown tables of these documents and exit")
    p.add_argument("--summary", nargs="+", metavar="DOC",
                   help="print one table over these documents (per model and variant: end-to-end speedups, largest "
                        "batch at the budget) and exit")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="a model of the workflow config (its family and speed arch)")
    src.add_argument("--family", help="adapter family, with --arch")
    p.add_argument("--config", action="append", default=[], metavar="PATH",
                   help="workflow config file(s) for --model, merged in order (default: config.yaml)")
    p.add_argument("--arch", type=json.loads, default={}, help="JSON of config keywords (with --family)")
    p.add_argument("--settings", type=json.loads, default={},
                   help='JSON overriding the settings, e.g. \'{"batches": [1, 16], "contexts": [2048]}\'')
    p.add_argument("--batches", help="comma-separated batch sizes of the table (these flags override --settings)")
    p.add_argument("--pcts", help="comma-separated ratios beside the baseline (default: the model's speed.pcts; '' "
                   "for none)")
    p.add_argument("--contexts", help="comma-separated prompt lengths of the budget part")
    p.add_argument("--timed-contexts", help="comma-separated contexts whose largest batch is timed ('' for none)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--key-dims", action="append", default=[], metavar="[NAME=]WIDTHS",
                   help="a per-layer allocation of this model (as python -m statereduce.speed takes it); repeatable")
    p.add_argument("--resume", action="store_true",
                   help="continue OUT where a killed run stopped: keep its cells, measure the missing ones (refused "
                        "unless it was measured on this GPU with the same model, settings and versions)")
    p.add_argument("--bytes-only", action="store_true",
                   help="no GPU: write the budget part's byte counts and largest batches from the config, untimed")
    p.add_argument("--recipe", action="append", default=[], metavar="NAME=ALLOCATION.json",
                   help="a per-layer budget's allocation of another model, scaled onto this one (each source layer's "
                        "fraction of d_k on a contiguous block of layers, multiples of 16, the uniform total); "
                        "repeatable")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        for option, render in (("tables", documents_markdown), ("summary", summary_markdown)):
            docs = getattr(args, option)
            if docs:
                missing = [t for t in docs if not Path(t).is_file()]
                if missing:
                    raise ValueError(f"--{option}: {missing[0]!r} not found")
                print(render(docs), end="")
                return 0
        if not args.out:
            raise ValueError("give the document to write (OUT.json), or --tables DOC.json ...")
        if not (args.model or args.family):
            raise ValueError("give --model NAME (a model of the workflow config) or --family with --arch")
        overrides = dict(args.settings)
        for option, key in (("batches", "batches"), ("pcts", "pcts"), ("contexts", "contexts"),
                            ("timed_contexts", "timed_contexts")):
            value = getattr(args, option)
            if value is not None:
                overrides[key] = _int_list("--" + option.replace("_", "-"), value,
                                           allow_empty=key in ("timed_contexts", "pcts"))
        settings = GenerateSettings.from_dict(overrides)
        if args.model:
            plan = workflow_plan(args.model, args.config or ["config.yaml"])
        else:
            adapter_class(args.family).check_arch(dict(args.arch))
            plan = {"family": args.family, "arch": dict(args.arch), "pcts": [50, 75]}
        allocations: dict[str, dict] = {}
        for i, spec in enumerate(args.key_dims, 1):
            name, widths = bench.parse_key_dims(spec, i)
            allocations[name] = {"widths": widths}
        for spec in args.recipe:
            name, record = parse_allocation(spec, plan["family"], plan["arch"])
            if name in allocations:
                raise ValueError(f"allocation name {name!r} given twice")
            allocations[name] = record
        variants(plan["family"], plan["arch"], plan["pcts"] if settings.pcts is None else settings.pcts,
                 allocations)  # one line if bad
        parts = [x.strip() for x in args.parts.split(",") if x.strip()]
        bad = sorted(set(parts) - set(PARTS))
        if bad or not parts:
            raise ValueError(f"unknown --parts {bad or parts}; valid: {', '.join(PARTS)}")
        if args.bytes_only:
            write_json(args.out, budget_from_config(plan["family"], plan["arch"], settings, model_name=args.model,
                                                    pcts=plan["pcts"], allocations=allocations))
            print(documents_markdown([args.out]), end="")
            return 0
        bench.require_cuda()
        run_generate(plan["family"], plan["arch"], settings, args.out, model_name=args.model, parts=parts,
                     allocations=allocations, pcts=plan["pcts"], resume=args.resume)
        print(documents_markdown([args.out]), end="")
    except (RuntimeError, ValueError) as e:
        if isinstance(e, torch.cuda.OutOfMemoryError):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
