"""GPU speed of state reduction: decode, prefill and mixer-only, baseline and pruned side by side
(paper Sec. 5, App. G.1).

Speed does not depend on weight values, so the models here are built from a config with random weights (the
JSON says so): a family's config (``arch``: keyword arguments of fla's ``DeltaNetConfig`` / ``GatedDeltaNetConfig``)
and, for each ratio, the adapter's ``reduced_config`` with ``d_k' = n_keep_for(d_k, pct)``: exactly the shapes the
pruned checkpoint has. Every measurement of one run shares the device, so each speedup is a ratio from one job.

- **Decode** (Table 17): a prompt of ``prompt`` tokens is prefilled, then the one-token step is captured in a CUDA
  graph over static buffers (the recurrent state is updated in place by :mod:`statereduce.speed.inplace`, with fla's own
  kernel or ours, or, as ``fla_copy``, by fla's unmodified function plus a copy back; each also as ``+fused``, with
  the decode routes' leaner one-token layer step around it) and replayed: ``warmup``
  replays, then ``trials`` x ``steps`` timed replays; the median trial gives ms/token and tokens/s. Each cell
  records peak memory and its *byte floor*: the bytes one step must move (every weight once, the embedding rows of
  the batch, the recurrent state (float32) and conv state read and written per sequence, the logits written) over
  the copy bandwidth measured in the same run. ``ideal_speedup`` is the ratio of
  those bytes. Before timing, a few graph replays are checked against fla's own eager decoding.
- **Per-layer key widths**: a named allocation (``key_dims``: one d_k' per layer, as a checkpoint pruned with a
  per-layer budget stores it) is built at the unpruned shape with each mixer shaped to its width
  (:func:`statereduce.core.slicing.shape_mixers`, as :func:`statereduce.core.models.load_model` does) and timed like
  a ratio (decode, prefill, profile); each cell is also compared with the uniform cut of the same total
  (``ratios["key_dims"]``: ``vs_uniform`` = per-layer ms / uniform ms).
- **Head shapes**: a named uniform cut of both sides of the state (``head_shapes``: d_k' x d_v' per head in every
  layer, e.g. values only, or keys and values together) is built from the config with both widths
  (:func:`head_shape_config`: the adapter's reduced config for d_k', its ``value_config_updates`` for d_v', the
  fields a stock checkpoint with that cut has) and timed like a ratio after them (decode, prefill, profile); the
  document records each shape's state fraction and ``ratios["head_shapes"]`` its cells against the baseline.
- **Prefill** (Table 18): ``model(ids, use_cache=True, logits_to_keep=1)`` over a batch x length grid, captured in a
  CUDA graph and replayed (``graph``: eager, a forward of a 1.3B model at 1 x 2K waits on Python's kernel launches
  for most of its time); ``device_ms`` (``profile``) is the kernels' summed device time of one eager call. Cells that
  do not fit in memory are recorded as skipped.
- **Mixer** (Table 19): one linear-attention layer's forward at ``seq_len`` tokens, graph-timed the same way; time and
  peak memory ratios (the layer alone is on the device: weights, input and activations).

Run with ``python -m statereduce.speed`` (no Snakemake needed) or through the workflow's ``speed`` rule. Triton's
autotuning of fla's chunk kernels takes minutes on first use; it runs in untimed warm-up, and its results are kept
in ``TRITON_CACHE_DIR`` (fla caches autotuning results there), so keep that folder between runs.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import logging
import numbers
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import yaml
from torch.profiler import ProfilerActivity, profile

from statereduce.adapters import adapter_class, adapter_for_config, get_adapter
from statereduce.common.settings import (
    DecodeSettings, MixerSettings, PrefillSettings, SpeedProfileSettings, SpeedSettings,
)
from statereduce.config import model_speed, validate_config
from statereduce.core.runtime import versions, write_json
from statereduce.core.slicing import KEY_DIMS_FIELD, shape_mixers
from statereduce.kernels import recurrent
from statereduce.selectors import n_keep_for
from statereduce.speed.inplace import FUSED, cache_tensors, inplace_decode, pack_for_decode, parse_kernel

log = logging.getLogger(__name__)

PARTS = ("decode", "prefill", "mixer", "profile")
"""Measurements :func:`run_speed` can make; ``profile`` (per-kernel device time of eager decode steps, to see where
a step's time goes) is not in the default set."""
DEFAULT_PARTS = ("decode", "prefill", "mixer")


def speed_settings(overrides: Mapping[str, Any] | None = None) -> SpeedSettings:
    """:class:`~statereduce.common.settings.SpeedSettings` (the paper's protocol, App. G.1) updated by ``overrides``
    (the parts' blocks key by key), each decode kernel checked (:func:`check_kernels`); unknown keys and bad values are
    one-line ValueErrors."""
    return check_kernels(SpeedSettings.from_dict(overrides))


def check_kernels(settings: SpeedSettings) -> SpeedSettings:
    """``settings`` once each of its decode kernels is one this module runs (a one-line ValueError otherwise)."""
    for kernel in settings.decode.kernels:
        parse_kernel(kernel)
    return settings


def speed_pcts(settings: SpeedSettings) -> list:
    """The ratios a run measures: the baseline (0) first, then ``settings.pcts``."""
    return [0, *[p for p in settings.pcts if float(p) != 0]]


def workflow_model(name: str, config: str | Path,
                   overrides: Mapping[str, Any] | None = None) -> tuple[str, dict, SpeedSettings]:
    """``(family, arch, settings)`` of model ``name`` of the workflow config file ``config``: its speed block, then
    ``overrides``. Raises ValueError (one line) for a missing file or an unknown model."""
    if not Path(config).is_file():
        raise ValueError(f"workflow config {str(config)!r} not found; pass the workflow's config.yaml as --config PATH")
    cfg = validate_config(yaml.safe_load(Path(config).read_text()))
    if name not in cfg["models"]:
        raise ValueError(f"unknown model {name!r} in {str(config)!r}; valid: {', '.join(sorted(cfg['models']))}")
    plan = model_speed(cfg, name)
    return plan.family, plan.arch, speed_settings({**plan.settings.overrides(), **(overrides or {})})


def require_cuda() -> None:
    """Raise a one-line RuntimeError unless a CUDA device is present."""
    if not torch.cuda.is_available():
        raise RuntimeError("speed benchmarks need a CUDA GPU and this machine has none (torch.cuda.is_available() is "
                           "False); run them on a GPU node (resources: gpu=1), e.g. python -m statereduce.speed ...")


# ---------------------------------------------------------------------------------------------
# models from configs
# ---------------------------------------------------------------------------------------------
def model_config(family: str, arch: Mapping[str, Any], pct: float = 0,
                 key_dims: Sequence[int | None] | None = None):
    """The HF config of ``family`` with ``arch`` and ``pct`` percent of key channels removed (0: baseline).

    With ``key_dims`` (a per-layer allocation, :func:`layer_key_dims`) the config keeps the unpruned head sizes and
    records each layer's d_k' in :data:`statereduce.core.slicing.KEY_DIMS_FIELD`, as the config of a checkpoint pruned
    with a per-layer budget does; :func:`build_model` then shapes each mixer to its width. ``pct`` must be 0 then.
    """
    adapter = adapter_class(family)
    adapter.check_arch(dict(arch))
    config = adapter.config_class(**arch)
    if key_dims is not None:
        if pct:
            raise ValueError(f"give a pct or per-layer key_dims, not both (pct={pct!r})")
        setattr(config, KEY_DIMS_FIELD, layer_key_dims(family, config, key_dims))
    elif pct:
        config = adapter.reduced_config(config, n_keep_for(adapter.dims(config).head_k_dim, float(pct)))
    return config


def head_shape_config(family: str, arch: Mapping[str, Any], d_k: int, d_v: int):
    """The HF config of ``family`` with ``arch`` and every linear-attention head cut to ``d_k x d_v`` (d_k' key
    channels per q/k head, d_v' value channels per value head; a width equal to the unpruned one leaves that side
    alone): the adapter's :meth:`reduced_config` for the keys, then its ``value_config_updates`` for the values, the
    config fields a stock checkpoint with that cut has.

    Raises:
        ValueError: one line, for a width the family cannot express, or a family whose config cannot hold d_v'
            (Mamba-2 names it per layer in :data:`statereduce.core.slicing.VALUE_DIMS_FIELD`, which the speed
            benchmark does not build).
    """
    adapter = adapter_class(family)
    adapter.check_arch(dict(arch))
    config = adapter.config_class(**arch)
    dims = adapter.dims(config)
    if int(d_k) != dims.head_k_dim:
        config = adapter.reduced_config(config, int(d_k))
    if int(d_v) != dims.head_v_dim:
        updates = adapter.value_config_updates(config, d_v)
        if updates is None:
            raise ValueError(f"{family}'s config cannot hold d_v'={d_v} (it names value widths per layer, which the "
                             "speed benchmark does not build); time value cuts of the fla families")
        config = copy.deepcopy(config)
        for name, value in updates.items():
            setattr(config, name, value)
    got = adapter.dims(config)
    if (got.head_k_dim, got.head_v_dim) != (int(d_k), int(d_v)):
        raise ValueError(f"{family}: the config for {d_k}x{d_v} describes {got.head_k_dim}x{got.head_v_dim}")
    return config


def layer_key_dims(family: str, config, widths: Sequence[int | None]) -> list[int | None]:
    """A per-layer allocation as :data:`statereduce.core.slicing.KEY_DIMS_FIELD` holds it: one d_k' per decoder layer of
    ``config`` (the unpruned config), None for a layer without a linear-attention mixer.

    Args:
        family: adapter family.
        config: the family's config at the unpruned head sizes.
        widths: one entry per decoder layer (None where the layer has no linear-attention mixer), or one width per
            linear-attention layer in order.
    Raises:
        ValueError: one line, for the wrong number of widths, a None at a linear-attention layer, or a width the
            family cannot express (``config_updates``).
    """
    adapter = adapter_class(family)
    layers = adapter.mixer_layer_indices(config)
    n_layers = max(getattr(config, "num_hidden_layers", 0), 1 + max(layers, default=-1))
    widths = list(widths)
    if len(widths) == n_layers:
        out = widths
    elif len(widths) == len(layers) and None not in widths:
        out = [None] * n_layers
        for layer, w in zip(layers, widths):
            out[layer] = w
    else:
        raise ValueError(f"key_dims has {len(widths)} widths; the {family} model has {n_layers} decoder layers, "
                         f"{len(layers)} of them with linear attention: give one width per decoder layer (null "
                         "without linear attention) or one per linear-attention layer")
    named = [i for i, w in enumerate(out) if w is not None]
    if named != layers:
        raise ValueError(f"key_dims names widths for layers {named}; the model's linear-attention layers are {layers}")
    for i in layers:
        if isinstance(out[i], bool) or not isinstance(out[i], numbers.Integral):
            raise ValueError(f"key_dims[{i}]={out[i]!r} is not an integer width")
        out[i] = int(out[i])
        try:
            adapter.config_updates(config, out[i])  # one-line ValueError for a width the family cannot express
        except ValueError as e:
            raise ValueError(f"key_dims[{i}]: {e}") from None
    return out


def layer_state_shapes(family: str, config) -> list:
    """The recurrent and conv state shape (:class:`~statereduce.families.base.StateShape`, per sequence) of every
    linear-attention layer of ``config``, in order: the config's one shape, or with
    :data:`statereduce.core.slicing.KEY_DIMS_FIELD` each layer's own (the config's at that layer's d_k')."""
    return list(adapter_class(family).config_layer_state_shapes(config).values())


def build_model(config, dtype: torch.dtype, device: str = "cuda"):
    """A randomly initialised causal LM of ``config`` on ``device`` in ``dtype``, in eval mode (the adapter's
    :meth:`~statereduce.adapters.base.LinearAttentionAdapter.build`). A config with per-layer widths
    (:data:`statereduce.core.slicing.KEY_DIMS_FIELD`) is built at the unpruned shape and each mixer shaped to its width
    (:func:`statereduce.core.slicing.shape_mixers`, as :func:`statereduce.core.models.load_model` loads such a
    checkpoint)."""
    adapter = adapter_for_config(config)
    adapter.install_fallbacks()  # on CUDA: calls at shapes stock fla mishandles are padded
    torch.manual_seed(0)
    with torch.device(device):
        model = adapter.build(config, dtype=dtype)
    widths = getattr(config, KEY_DIMS_FIELD, None)
    if widths is not None:  # outside the device context: the slicing's index tensors live on the CPU
        shape_mixers(adapter(model), widths)
    return model.eval()


def step_bytes(model, config, family: str, batch: int) -> dict[str, int]:
    """Bytes a one-token decode step must move through device memory at ``batch`` sequences (the floor's numerator).

    Every parameter is read once, except the input embedding, of which only the batch's rows are read; the
    recurrent state (float32) and the conv state (model dtype) of every layer, each at its own key width
    (:func:`layer_state_shapes`), are read and written once per sequence; the logits are written once.
    """
    emb = model.get_input_embeddings().weight
    tied = model.get_output_embeddings() is not None and model.get_output_embeddings().weight is emb
    elem = emb.element_size()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if not tied:
        weights -= emb.numel() * elem
    weights += batch * emb.shape[1] * elem
    shapes = layer_state_shapes(family, config)
    state = 2 * batch * sum(s.recurrent_elems * 4 + s.conv_elems * elem for s in shapes)
    logits = batch * config.vocab_size * elem
    return {"weights": int(weights), "state": int(state), "logits": int(logits),
            "total": int(weights + state + logits)}


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------
def time_ms(fn: Callable[[], Any], *, warmup: int, steps: int, trials: int) -> list[float]:
    """Per-call milliseconds of ``fn`` (CUDA events around ``steps`` calls), one value per trial, after ``warmup``."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / steps)
    return out


def device_ms(fn: Callable[[], Any]) -> float:
    """Summed device time (ms) of the kernels one call of ``fn`` launches (``torch.profiler``).

    Beside the timed wall milliseconds this shows whether a call is host-bound: when the device is busy for much less
    than the wall time, the GPU waits for Python to launch kernels, and a smaller model cannot run faster.
    """
    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e3


def copy_bandwidth(nbytes: int = 2 << 30, trials: int = 5) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read plus bytes written), median of ``trials``."""
    n = nbytes // 4
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), warmup=3, steps=10, trials=trials)
    src = dst = None
    torch.cuda.empty_cache()
    return 2 * nbytes / (statistics.median(ms) / 1e3)


def _stats(ms: list[float]) -> dict[str, Any]:
    return {"ms": statistics.median(ms), "trials_ms": [round(x, 5) for x in ms]}


@contextlib.contextmanager
def _peak_memory(record: dict):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    yield
    torch.cuda.synchronize()
    record["peak_mem_bytes"] = int(torch.cuda.max_memory_allocated())
    record["peak_mem_delta_bytes"] = int(torch.cuda.max_memory_allocated() - before)


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------------------------
class GraphDecoder:
    """One-token decode step of ``model`` captured in a CUDA graph, state updated in place.

    Args:
        model: an fla causal LM in eval mode on CUDA.
        batch, prompt: sequences and prompt tokens prefilled before capture.
        kernel: the in-place recurrent step (:data:`statereduce.speed.inplace.KERNELS`), ``+fused`` for the leaner layer
            step of the family's decode route around it (its packed weights are laid out before capture).
    """

    def __init__(self, model, batch: int, prompt: int, kernel: str, seed: int = 0):
        self.model, self.kernel = model, kernel
        vocab = model.config.vocab_size
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.prompt_ids = torch.randint(vocab, (batch, prompt), device="cuda", generator=gen)
        self.tokens = torch.randint(vocab, (batch, 8), device="cuda", generator=gen)
        self.ids = self.tokens[:, :1].clone()
        self._decode = inplace_decode(kernel)
        if kernel.endswith(FUSED):
            pack_for_decode(model)
        with torch.no_grad(), self._decode:
            self.cache = model(self.prompt_ids, use_cache=True, logits_to_keep=1).past_key_values
            self.states = cache_tensors(model, self.cache)
            snapshot = [t.clone() for t in self.states]

            def forward():  # the captured call's logits stay in the graph's static output buffer
                self.logits = model(self.ids, past_key_values=self.cache, use_cache=True).logits

            self._replay = graphed(forward, warmup=3)  # the warm-up steps are where autotuning happens
            for t, s in zip(self.states, snapshot):
                t.copy_(s)
        torch.cuda.synchronize()

    def step(self, token: torch.Tensor | None = None) -> torch.Tensor:
        """Replay the graph once (with ``token`` ``[batch, 1]`` as input when given); returns the static logits."""
        if token is not None:
            self.ids.copy_(token)
        self._replay()
        return self.logits


def check_decoder(model, decoder: GraphDecoder, steps: int) -> float:
    """Max relative error of ``steps`` graph replays against fla's own eager decoding from the same prompt.

    Must be called right after construction (the decoder's state is the prompt's). Returns
    ``max_t ||logits_graph - logits_eager|| / ||logits_eager||``.
    """
    with torch.no_grad():
        cache = model(decoder.prompt_ids, use_cache=True, logits_to_keep=1).past_key_values
        worst = 0.0
        for t in range(steps):
            token = decoder.tokens[:, t:t + 1]
            ref = model(token, past_key_values=cache, use_cache=True).logits.float()
            got = decoder.step(token).float()
            worst = max(worst, float((got - ref).norm() / ref.norm()))
    return worst


def decode_cells(model, config, family: str, settings: DecodeSettings, bandwidth: float,
                 on_cell: Callable[[dict], None]) -> None:
    """Time the decode step of ``model`` for every batch and kernel of ``settings`` (``speed.decode``)."""
    for batch in settings.batches:
        bytes_ = step_bytes(model, config, family, batch)
        for kernel in settings.kernels:
            cell: dict[str, Any] = {"batch": batch, "kernel": kernel, "prompt": settings.prompt}
            if kernel.endswith(FUSED):
                pack_for_decode(model)  # once per model, outside the memory window (packing copies each layer once)
            try:
                with _peak_memory(cell):
                    t0 = time.perf_counter()
                    dec = GraphDecoder(model, batch, settings.prompt, kernel)
                    t1 = time.perf_counter()
                    if settings.check_steps:
                        cell["check_rel_err"] = check_decoder(model, dec, settings.check_steps)
                    t2 = time.perf_counter()
                    ms = time_ms(dec.step, warmup=settings.warmup, steps=settings.steps, trials=settings.trials)
                    # wall seconds of each phase (prefill + capture, check, timing): where a run's time goes
                    cell["wall_s"] = {"capture": round(t1 - t0, 2), "check": round(t2 - t1, 2),
                                      "timing": round(time.perf_counter() - t2, 2)}
            except torch.cuda.OutOfMemoryError:
                cell["skipped"] = "out of memory"
                _free()
                on_cell(cell)
                continue
            floor_ms = bytes_["total"] / bandwidth * 1e3
            cell.update(_stats(ms))
            cell.update({"tokens_per_s": batch / (cell["ms"] / 1e3), "bytes": bytes_, "floor_ms": floor_ms,
                         "floor_fraction": floor_ms / cell["ms"]})
            del dec
            _free()
            on_cell(cell)


# ---------------------------------------------------------------------------------------------
# prefill and mixer
# ---------------------------------------------------------------------------------------------
_CAPTURE_STREAM: torch.cuda.Stream | None = None


def capture_stream() -> torch.cuda.Stream:
    """The one side stream every graph of this process warms up and is captured on, with its cuBLAS workspace made.

    cuBLAS keeps a workspace (32 MiB on an H200) for every stream it has run on. With a new stream per capture, every
    measured cell would hold one more workspace than the one before (on an H200 the pruned mixer cells had 100-170
    MB more allocated before the call than the baseline's). With one stream, made with its workspace before the first
    measurement (:func:`run_speed` calls this first), every cell starts from the same allocations.
    """
    global _CAPTURE_STREAM
    if _CAPTURE_STREAM is None:
        _CAPTURE_STREAM = torch.cuda.Stream()
        a = torch.ones(16, 16, device="cuda", dtype=torch.bfloat16)
        for stream in (torch.cuda.current_stream(), _CAPTURE_STREAM):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                torch.mm(a, a)  # allocates this stream's cuBLAS workspace
        torch.cuda.synchronize()
    return _CAPTURE_STREAM


def graphed(fn: Callable[[], Any], warmup: int = 1) -> Callable[[], None]:
    """``fn`` captured in a CUDA graph (after ``warmup`` calls on a side stream, as torch asks); returns the graph's
    replay. Timing replays measures the device's work without Python's launch overhead. Warm-up and capture run on
    :func:`capture_stream`."""
    side = capture_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        fn()
    return graph.replay


def _time_call(fn: Callable[[], Any], settings: PrefillSettings | MixerSettings, cell: dict) -> None:
    """Measure ``fn`` into ``cell``: peak memory of one eager call, then time per ``settings``.

    Two eager warm-up calls come first (autotuning happens there). Peak memory (``_peak_memory``) is taken around one
    more eager call, before any graph exists, so it is the call's own footprint (a graph's private pool would add its
    capture-time buffers). The timing (``warmup``, ``steps``, ``trials``) replays a CUDA graph of ``fn`` when
    ``settings.graph`` (eager if capture fails: the cell says why); ``device_ms`` is added when ``profile``.
    """
    for _ in range(2):
        fn()
    with _peak_memory(cell):
        fn()
    call: Callable[[], Any] = fn
    cell["graph"] = False
    if settings.graph:
        try:
            call = graphed(fn)
            cell["graph"] = True
        except RuntimeError as e:  # a kernel that syncs with the host cannot be captured: time it eagerly
            if isinstance(e, torch.cuda.OutOfMemoryError):
                raise
            cell["graph_error"] = str(e).splitlines()[0][:200]
            torch.cuda.synchronize()
    ms = time_ms(call, warmup=settings.warmup, steps=settings.steps, trials=settings.trials)
    cell.update(_stats(ms))
    if settings.profile:
        cell["device_ms"] = device_ms(fn)


def prefill_cells(model, settings: PrefillSettings, on_cell: Callable[[dict], None]) -> None:
    """Time ``model(ids, use_cache=True, logits_to_keep=1)`` over the batch x length grid of ``speed.prefill``."""
    vocab = model.config.vocab_size
    for length in settings.lengths:
        for batch in settings.batches:
            cell: dict[str, Any] = {"batch": batch, "length": length}
            try:
                ids = torch.randint(vocab, (batch, length), device="cuda")
                with torch.no_grad():
                    _time_call(lambda ids=ids: model(ids, use_cache=True, logits_to_keep=1), settings, cell)
                cell["tokens_per_s"] = batch * length / (cell["ms"] / 1e3)
            except torch.cuda.OutOfMemoryError:
                cell = {"batch": batch, "length": length, "skipped": "out of memory"}
            ids = None
            _free()
            on_cell(cell)


def mixer_cells(config, settings: MixerSettings, dtype: torch.dtype, on_cell: Callable[[dict], None]) -> None:
    """Time one linear-attention layer's forward (the first mixer of a one-layer model of ``config``)."""
    one = copy.deepcopy(config)
    one.num_hidden_layers = 1
    layer = get_adapter(build_model(one, dtype)).mixer_layers()[0][1]  # the rest of the model is freed here
    _free()
    for batch in settings.batches:
        cell: dict[str, Any] = {"batch": batch, "seq_len": settings.seq_len}
        try:
            x = torch.randn(batch, settings.seq_len, config.hidden_size, device="cuda", dtype=dtype)
            with torch.no_grad():
                _time_call(lambda x=x: layer(x), settings, cell)
        except torch.cuda.OutOfMemoryError:
            cell = {"batch": batch, "seq_len": settings.seq_len, "skipped": "out of memory"}
        x = None
        _free()
        on_cell(cell)
    layer = None
    _free()


def kernel_rows(prof, calls: int = 1) -> list[tuple[str, float, int]]:
    """``(name, device µs, launches)`` per kernel name of a ``torch.profiler`` run over ``calls`` calls, per call,
    the most time first."""
    rows = [(e.key, e.self_device_time_total / calls, e.count // calls)
            for e in prof.key_averages() if e.self_device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])


def profile_cells(model, settings: SpeedProfileSettings, kernels: Iterable[str], on_cell: Callable[[dict], None],
                  prompt: int = 64) -> None:
    """Device time per kernel over ``steps`` eager decode steps (``torch.profiler``), the ``top`` kernels by time.

    Eager steps launch the same kernels as the graph, so this shows where a step's device time goes (the graph
    removes only the launch gaps). ``total_us`` is the sum over every kernel of the steps, per step.
    """
    vocab = model.config.vocab_size
    for batch in settings.batches:
        for kernel in kernels:
            ids = torch.randint(vocab, (batch, prompt), device="cuda")
            tok = torch.randint(vocab, (batch, 1), device="cuda")
            with torch.no_grad(), inplace_decode(kernel):
                cache = model(ids, use_cache=True, logits_to_keep=1).past_key_values
                for _ in range(3):
                    model(tok, past_key_values=cache, use_cache=True)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(settings.steps):
                        model(tok, past_key_values=cache, use_cache=True)
                    torch.cuda.synchronize()
            rows = kernel_rows(prof, settings.steps)
            on_cell({"batch": batch, "kernel": kernel, "total_us": sum(r[1] for r in rows),
                     "launches": sum(r[2] for r in rows),
                     "top": [{"name": n[:120], "us": round(t, 2), "count": c} for n, t, c in rows[:settings.top]]})
            cache = None
            _free()


# ---------------------------------------------------------------------------------------------
# one run
# ---------------------------------------------------------------------------------------------
def run_speed(family: str, arch: Mapping[str, Any], settings: SpeedSettings, out_path: str | Path, *,
              model_name: str | None = None, parts: Iterable[str] = DEFAULT_PARTS,
              extra: Mapping[str, Any] | None = None,
              key_dims: Mapping[str, Sequence[int | None]] | None = None,
              head_shapes: Mapping[str, tuple[int, int]] | None = None) -> dict:
    """Measure the baseline (pct 0) and every ``settings.pcts`` ratio, every per-layer allocation of
    ``key_dims`` and every head shape of ``head_shapes``; write ``out_path`` after every cell.

    Args:
        family: adapter family (``delta_net``, ``gated_deltanet``).
        arch: keyword arguments of the family's fla config (hidden size, layers, heads, head dims, vocab).
        settings: :func:`speed_settings` output.
        out_path: the JSON to write (rewritten atomically after each cell, so a killed run keeps what it measured).
        model_name: the workflow's model name, recorded.
        parts: which of :data:`PARTS` to run.
        key_dims: named per-layer allocations (name -> widths, :func:`layer_key_dims`), each measured like one more
            ratio right after the uniform cut of the same total (after every ratio if none has it): decode, prefill
            and profile (the mixer part times one layer of one width and leaves them out).
        head_shapes: named uniform cuts of keys and values (name -> (d_k', d_v'), :func:`head_shape_config`), each
            measured like one more ratio after the ratios and allocations: decode, prefill and profile.

    Returns:
        The document: ``configs`` (d_k, state bytes per pct), ``decode`` / ``prefill`` / ``mixer`` cells (each with
        ``pct``), ``ratios`` (pruned over baseline of the same cell; decode also against fla's baseline kernel),
        the measured copy bandwidth, device and versions. With ``key_dims``: ``key_dims`` (per allocation its widths,
        total, the equal-total pct and state bytes, and its cells) and ``ratios["key_dims"]`` (each cell against the
        baseline and against the uniform cut of the same total, :func:`speed_ratios`). With ``head_shapes``:
        ``head_shapes`` (per shape its widths, state bytes and state fraction, and its cells) and
        ``ratios["head_shapes"]``.
    """
    require_cuda()
    parts = list(parts)
    bad = sorted(set(parts) - set(PARTS))
    if bad:
        raise ValueError(f"unknown speed part(s) {bad}; valid: {', '.join(PARTS)}")
    dtype = getattr(torch, settings.dtype)
    pcts = speed_pcts(settings)
    adapter = adapter_class(family)
    allocations = {name: key_dims_record(family, arch, widths, pcts) for name, widths in (key_dims or {}).items()}
    shaped = {name: head_shape_record(family, arch, *shape) for name, shape in (head_shapes or {}).items()}
    doc = _speed_document(family, arch, settings, parts, model_name, extra, allocations, shaped)
    if settings.blas:
        torch.backends.cuda.preferred_blas_library(settings.blas)
    doc["blas_library"] = str(torch.backends.cuda.preferred_blas_library())
    doc["pdl"] = settings.pdl and recurrent.pdl_supported(torch.device("cuda"))
    capture_stream()  # its cuBLAS workspace exists before the first cell's memory is measured
    t0 = time.perf_counter()
    doc["copy_bandwidth_Bps"] = copy_bandwidth()
    log.info("copy bandwidth %.0f GB/s", doc["copy_bandwidth_Bps"] / 1e9)

    def save():
        doc["ratios"] = speed_ratios(doc)
        doc["elapsed_s"] = round(time.perf_counter() - t0, 1)
        write_json(out_path, doc)

    def allocation(name, record):
        config = model_config(family, arch, key_dims=record["widths"])
        _model_cells(config, family, settings, parts, dtype, record, {}, f"key_dims={name}", doc, save)

    with recurrent.programmatic_launch(settings.pdl):
        for pct in pcts:
            _speed_pct(family, arch, settings, parts, pct, dtype, adapter, doc, save)
            for name, record in allocations.items():  # right after the uniform cut of the same total
                if record["uniform_pct"] == pct:
                    allocation(name, record)
        for name, record in allocations.items():
            if record["uniform_pct"] is None:
                allocation(name, record)
        for name, record in shaped.items():
            config = head_shape_config(family, arch, record["d_k"], record["d_v"])
            _model_cells(config, family, settings, parts, dtype, record, {}, f"head_shape={name}", doc, save)
    save()
    return doc


def _speed_document(family: str, arch: Mapping[str, Any], settings: SpeedSettings, parts: list[str],
                    model_name: str | None, extra: Mapping[str, Any] | None, allocations: dict[str, dict],
                    shaped: dict[str, dict]) -> dict[str, Any]:
    """:func:`run_speed`'s document before its first measurement: the model, settings and parts, the device and
    versions, empty cell lists, ``extra``, and the per-layer allocations and head shapes to time (where there are
    any)."""
    doc: dict[str, Any] = {
        "model": model_name, "family": family, "arch": dict(arch), "settings": settings.to_dict(),
        "parts": parts,
        "weights": "random (speed does not depend on weight values); shapes from arch and the pruned config",
        "device": torch.cuda.get_device_name(), "versions": versions(), "configs": {},
        "decode": [], "prefill": [], "mixer": [], "profile": [], **(extra or {}),
    }
    if allocations:
        doc["key_dims"] = allocations
    if shaped:
        doc["head_shapes"] = shaped
    return doc


def key_dims_record(family: str, arch: Mapping[str, Any], widths: Sequence[int | None], pcts: Iterable = ()) -> dict:
    """What a speed document records of a per-layer allocation before its cells: the widths per decoder layer, the
    unpruned d_k, the heads-weighted total of kept key channels, the removal pct it equals, the uniform ratio of
    ``pcts`` with the same total (``uniform_pct``, None if none has it) and the recurrent state bytes per sequence.

    Raises:
        ValueError: one line, for widths :func:`layer_key_dims` refuses.
    """
    adapter = adapter_class(family)
    config = model_config(family, arch, key_dims=widths)
    h, _, d_k, _ = adapter.dims(config)
    layers = adapter.mixer_layer_indices(config)
    kept = getattr(config, KEY_DIMS_FIELD)
    total = h * sum(kept[i] for i in layers)
    uniform = [p for p in pcts if float(p) and h * n_keep_for(d_k, float(p)) * len(layers) == total]
    shapes = layer_state_shapes(family, config)
    return {"widths": kept, "d_k": d_k, "heads": h, "layers": len(layers), "total_channels": total,
            "pct": round(100 * (1 - total / (h * d_k * len(layers))), 4), "uniform_pct": uniform[0] if uniform else None,
            "state_bytes_per_sequence": sum(s.recurrent_elems for s in shapes) * 4,
            "decode": [], "prefill": [], "profile": []}


def head_shape_record(family: str, arch: Mapping[str, Any], d_k: int, d_v: int) -> dict:
    """What a speed document records of a head shape before its cells: d_k' and d_v', the unpruned d_k and d_v, the
    heads and layers, the recurrent state bytes per sequence and their fraction of the unpruned state's.

    Raises:
        ValueError: one line, for widths :func:`head_shape_config` refuses.
    """
    adapter = adapter_class(family)
    full = adapter.config_state_shape(adapter.config_class(**arch))
    shape = adapter.config_state_shape(head_shape_config(family, arch, d_k, d_v))
    layers = len(adapter.mixer_layer_indices(adapter.config_class(**arch)))
    return {"d_k": shape.d_k, "d_v": shape.d_v, "full_d_k": full.d_k, "full_d_v": full.d_v,
            "heads": shape.num_heads, "layers": layers,
            "state_bytes_per_sequence": shape.recurrent_elems * 4 * layers,
            "state_fraction": shape.recurrent_elems / full.recurrent_elems,
            "decode": [], "prefill": [], "profile": []}


def _speed_pct(family, arch, settings, parts, pct, dtype, adapter, doc, save) -> None:
    """:func:`run_speed`'s cells of one ratio."""
    config = model_config(family, arch, pct)
    shape = adapter.config_state_shape(config)
    layers = len(adapter.mixer_layer_indices(config))
    doc["configs"][str(pct)] = {"d_k": shape.d_k, "d_v": shape.d_v, "heads": shape.num_heads, "layers": layers,
                                "state_bytes_per_sequence": shape.recurrent_elems * 4 * layers}
    add = _model_cells(config, family, settings, parts, dtype, doc, {"pct": pct}, f"pct={pct}", doc, save)
    if "mixer" in parts:
        mixer_arch = {**arch, **settings.mixer.arch}
        mixer_cells(model_config(family, mixer_arch, pct), settings.mixer, dtype, add("mixer"))


def _model_cells(config, family, settings, parts, dtype, target: dict, tag: dict, label: str, doc: dict, save):
    """The decode, prefill and profile cells of the model of ``config``, each appended (with ``tag``) to
    ``target[part]`` and the document saved; returns the cell callback maker (``add(part)``)."""
    def add(part):
        def on_cell(cell):
            target[part].append({**tag, **cell})
            log.info("%s %s %s", part, label, {k: v for k, v in cell.items() if k not in ("bytes", "trials_ms")})
            save()
        return on_cell

    if {"decode", "prefill", "profile"} & set(parts):
        t_build = time.perf_counter()
        model = build_model(config, dtype)
        log.info("built the %s model in %.1f s", label, time.perf_counter() - t_build)
        if "profile" in parts:
            profile_cells(model, settings.profile, settings.decode.kernels, add("profile"))
        if "decode" in parts:
            decode_cells(model, config, family, settings.decode, doc["copy_bandwidth_Bps"], add("decode"))
        if "prefill" in parts:
            prefill_cells(model, settings.prefill, add("prefill"))
        del model
        _free()
    return add


_RATIO_KEYS = {"decode": ("batch", "kernel"), "prefill": ("batch", "length"), "mixer": ("batch", "seq_len")}


def speed_ratios(doc: Mapping[str, Any]) -> dict[str, list[dict]]:
    """Pruned over baseline for every cell measured at both (speedup = base ms / pruned ms; memory = pruned / base).

    Decode cells are matched on (batch, kernel); each also gets ``speedup_vs_fla_baseline`` (pruned with this
    kernel against the baseline with fla's kernel, fused layers against fused) and ``ideal_speedup`` (ratio of the
    byte floors). Cells profiled at both (``device_ms``) get ``device_speedup``, the same ratio of summed kernel time.
    A document with per-layer allocations (``key_dims``) also gets ``key_dims``: per allocation cell, ``speedup``
    against the baseline and, where the uniform cut of the same total was measured, ``vs_uniform`` (per-layer ms /
    uniform ms) and, for decode, ``bytes_vs_uniform`` (the ratio of the step's bytes).
    """
    out: dict[str, list[dict]] = {"decode": [], "prefill": [], "mixer": []}
    for part, key in _RATIO_KEYS.items():
        base = {tuple(c[k] for k in key): c for c in doc.get(part, []) if c["pct"] == 0 and "ms" in c}
        for cell in doc.get(part, []):
            ref = base.get(tuple(cell[k] for k in key))
            if cell["pct"] == 0 or ref is None or "ms" not in cell:
                continue
            row = {"pct": cell["pct"], **{k: cell[k] for k in key}, "speedup": ref["ms"] / cell["ms"]}
            if "peak_mem_bytes" in cell:
                row["memory_ratio"] = cell["peak_mem_bytes"] / ref["peak_mem_bytes"]
                row["memory_delta_ratio"] = cell["peak_mem_delta_bytes"] / max(ref["peak_mem_delta_bytes"], 1)
            if "device_ms" in cell and "device_ms" in ref:
                row["device_speedup"] = ref["device_ms"] / cell["device_ms"]
            if part == "decode":
                row["ideal_speedup"] = ref["bytes"]["total"] / cell["bytes"]["total"]
                row["floor_fraction"] = cell["floor_fraction"]
                fused = FUSED if cell["kernel"].endswith(FUSED) else ""
                fla_ref = base.get((cell["batch"], "fla" + fused))
                if fla_ref is not None:
                    row["speedup_vs_fla_baseline"] = fla_ref["ms"] / cell["ms"]
            out[part].append(row)
    if doc.get("key_dims"):
        out["key_dims"] = _key_dims_ratios(doc)
    if doc.get("head_shapes"):
        out["head_shapes"] = _head_shape_ratios(doc)
    return out


def _head_shape_ratios(doc: Mapping[str, Any]) -> list[dict]:
    """:func:`speed_ratios`' rows of the head shapes: each cell against the baseline cell of the same key."""
    rows = []
    for name, record in doc["head_shapes"].items():
        for part in ("decode", "prefill"):
            key = _RATIO_KEYS[part]
            base = {tuple(c[k] for k in key): c for c in doc.get(part, []) if c["pct"] == 0 and "ms" in c}
            for cell in record.get(part, []):
                if "ms" not in cell:
                    continue
                k = tuple(cell[x] for x in key)
                row = {"head_shape": name, "part": part, "d_k": record["d_k"], "d_v": record["d_v"],
                       "state_fraction": record["state_fraction"], **dict(zip(key, k)), "ms": cell["ms"]}
                if k in base:
                    row["speedup"] = base[k]["ms"] / cell["ms"]
                    if part == "decode":
                        row["ideal_speedup"] = base[k]["bytes"]["total"] / cell["bytes"]["total"]
                rows.append(row)
    return rows


def _key_dims_ratios(doc: Mapping[str, Any]) -> list[dict]:
    """:func:`speed_ratios`' rows of the per-layer allocations."""
    rows = []
    for name, record in doc["key_dims"].items():
        for part in ("decode", "prefill"):
            key = _RATIO_KEYS[part]
            cells = [c for c in doc.get(part, []) if "ms" in c]
            base = {tuple(c[k] for k in key): c for c in cells if c["pct"] == 0}
            uniform_pct = record.get("uniform_pct")
            uniform = {tuple(c[k] for k in key): c for c in cells
                       if uniform_pct is not None and float(c["pct"]) == float(uniform_pct)}
            for cell in record.get(part, []):
                if "ms" not in cell:
                    continue
                k = tuple(cell[x] for x in key)
                row = {"key_dims": name, "part": part, "pct": record["pct"], **dict(zip(key, k)), "ms": cell["ms"]}
                if k in base:
                    row["speedup"] = base[k]["ms"] / cell["ms"]
                if k in uniform:
                    row.update({"uniform_pct": uniform_pct, "uniform_ms": uniform[k]["ms"],
                                "vs_uniform": cell["ms"] / uniform[k]["ms"]})
                    if part == "decode":
                        row["bytes_vs_uniform"] = cell["bytes"]["total"] / uniform[k]["bytes"]["total"]
                        row["state_bytes_vs_uniform"] = cell["bytes"]["state"] / uniform[k]["bytes"]["state"]
                rows.append(row)
    return rows


def widths_summary(widths: Sequence[int | None]) -> str:
    """A per-layer allocation in a few characters: how many layers keep each width, widest first (``8×64 + 16×16``)."""
    counts: dict[int, int] = {}
    for w in widths:
        if w is not None:
            counts[w] = counts.get(w, 0) + 1
    return " + ".join(f"{n}×{w}" for w, n in sorted(counts.items(), reverse=True))


def key_dims_markdown(doc: Mapping[str, Any]) -> str:
    """The per-layer allocations of a speed document against the uniform cut of the same total, one row per decode
    and prefill cell (per-layer ms / uniform ms; 1.00 when the widths cost what the uniform cut costs)."""
    head = ["allocation", "layers × d_k'", "pct", "part", "B", "kernel / T", "uniform ms", "per-layer ms",
            "per-layer / uniform", "bytes ratio"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for row in speed_ratios(doc).get("key_dims", []):
        record = doc["key_dims"][row["key_dims"]]
        lines.append("| " + " | ".join([
            row["key_dims"], widths_summary(record["widths"]), f"{row['pct']:g}", row["part"], str(row["batch"]),
            str(row.get("kernel", row.get("length"))),
            f"{row['uniform_ms']:.3f}" if "uniform_ms" in row else "–", f"{row['ms']:.3f}",
            f"{row['vs_uniform']:.3f}" if "vs_uniform" in row else "–",
            f"{row['bytes_vs_uniform']:.3f}" if "bytes_vs_uniform" in row else "–"]) + " |")
    return "\n".join(lines)


def head_shapes_markdown(doc: Mapping[str, Any]) -> str:
    """The decode cells of the baseline, the key-only ratios and the head shapes of a speed document side by side:
    per batch and kernel, by state fraction (largest first), d_k' x d_v', ms per token, speedup over the baseline of
    the same run and the byte floor's ideal speedup."""
    head = ["cut", "d_k' × d_v'", "state", "B", "kernel", "ms/token", "speedup", "ideal"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    base_state = doc["configs"]["0"]["state_bytes_per_sequence"]
    kernels = list(dict.fromkeys(c["kernel"] for c in doc["decode"]))
    rows = []  # (batch, kernel index, -state fraction, order, cells)
    for c in doc["decode"]:
        if "ms" not in c:
            continue
        cfg = doc["configs"][str(c["pct"])]
        cut = "baseline" if c["pct"] == 0 else f"keys {c['pct']:g} %"
        rows.append((c["batch"], kernels.index(c["kernel"]), -cfg["state_bytes_per_sequence"] / base_state, 0,
                     [cut, cfg["d_k"], cfg["d_v"], cfg["state_bytes_per_sequence"] / base_state, c, c["pct"]]))
    ratios = {(r["pct"], r["batch"], r["kernel"]): r for r in speed_ratios(doc)["decode"]}
    shaped = {(r["head_shape"], r["batch"], r["kernel"]): r for r in speed_ratios(doc).get("head_shapes", [])
              if r["part"] == "decode"}
    for order, (name, record) in enumerate(doc.get("head_shapes", {}).items(), 1):
        for c in record["decode"]:
            if "ms" in c:
                rows.append((c["batch"], kernels.index(c["kernel"]), -record["state_fraction"], order,
                             [name, record["d_k"], record["d_v"], record["state_fraction"], c, name]))
    for *_, (cut, dk, dv, frac, c, key) in sorted(rows, key=lambda r: r[:4]):
        r = (shaped if isinstance(key, str) else ratios).get((key, c["batch"], c["kernel"]), {})
        speedup, ideal = (1.0, 1.0) if key == 0 else (r.get("speedup"), r.get("ideal_speedup"))
        lines.append("| " + " | ".join([
            cut, f"{dk} × {dv}", f"{100 * frac:.1f} %", str(c["batch"]), c["kernel"], f"{c['ms']:.3f}",
            f"{speedup:.2f}×" if speedup is not None else "–",
            f"{ideal:.2f}×" if ideal is not None else "–"]) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
def parse_head_shape(spec: str, index: int = 1) -> tuple[str, tuple[int, int]]:
    """``--head-shape``'s ``[NAME=]DKxDV`` as (name, (d_k', d_v')); the name defaults to ``head_shape_<index>``."""
    name, sep, body = spec.partition("=")
    if not sep:
        name, body = "", spec
    parts = body.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"--head-shape {spec!r}: give [NAME=]DKxDV, d_k' and d_v' per head, e.g. values50=128x64")
    name = name or f"head_shape_{index}"
    if not all(c.isalnum() or c in "_-." for c in name):
        raise ValueError(f"--head-shape name {name!r} may hold only letters, digits, '_', '-' and '.'")
    return name, (int(parts[0]), int(parts[1]))


def parse_key_dims(spec: str, index: int = 1) -> tuple[str, list[int | None]]:
    """``--key-dims``' ``[NAME=]WIDTHS`` as (name, widths).

    WIDTHS is comma-separated d_k' per layer (``null`` for a layer without linear attention) or a JSON file holding a
    list, ``{"widths": [...]}`` (a per-layer budget's allocation) or ``{"statereduce_key_dims": [...]}`` (a pruned
    checkpoint's ``config.json``). The name defaults to the file's stem, else ``key_dims_<index>``.
    """
    name, sep, body = spec.partition("=")
    if not sep:
        name, body = "", spec
    path = Path(body)
    if body.endswith(".json") or path.is_file():
        if not path.is_file():
            raise ValueError(f"--key-dims file {body!r} not found")
        data = json.loads(path.read_text())
        if isinstance(data, Mapping):
            data = data.get("widths", data.get(KEY_DIMS_FIELD))
        if not isinstance(data, list):
            raise ValueError(f"--key-dims file {body!r} holds no list of widths (a list, {{\"widths\": [...]}} or "
                             f"{{\"{KEY_DIMS_FIELD}\": [...]}})")
        widths, name = data, name or path.stem
    else:
        widths = []
        for item in body.split(","):
            item = item.strip()
            if item.lower() in ("null", "none"):
                widths.append(None)
            elif item.isdigit():
                widths.append(int(item))
            else:
                raise ValueError(f"--key-dims {spec!r}: {item!r} is not a width; give comma-separated integers "
                                 "(null for a layer without linear attention) or a JSON file")
    name = name or f"key_dims_{index}"
    if not all(c.isalnum() or c in "_-." for c in name):
        raise ValueError(f"--key-dims name {name!r} may hold only letters, digits, '_', '-' and '.'")
    return name, widths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m statereduce.speed", description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="speed.json to write")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a model of the workflow config (its family and speed.arch)")
    src.add_argument("--family", help="adapter family, with --arch")
    p.add_argument("--config", default="config.yaml",
                   help="workflow config for --model (default: config.yaml in the current directory)")
    p.add_argument("--arch", type=json.loads, default={}, help="JSON of fla config keywords (with --family)")
    p.add_argument("--settings", type=json.loads, default={}, help="JSON overriding speed settings, e.g. "
                   '\'{"pcts": [50], "decode": {"batches": [64]}}\'')
    p.add_argument("--parts", default=",".join(DEFAULT_PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--key-dims", action="append", default=[], metavar="[NAME=]WIDTHS",
                   help="a per-layer allocation timed after the ratios and against the uniform cut of the same total: "
                        "comma-separated d_k' per layer (e.g. 16,48,16,48,...) or a JSON file with "
                        '{"widths": [...]} or a pruned checkpoint\'s config.json; repeatable')
    p.add_argument("--head-shape", action="append", default=[], metavar="[NAME=]DKxDV",
                   help="a uniform cut of keys and values, d_k' x d_v' per head in every layer (e.g. values50=128x64, "
                        "joint50=88x96), timed after the ratios against the same baseline; repeatable")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        key_dims: dict[str, list[int | None]] = {}
        for i, spec in enumerate(args.key_dims, 1):
            name, widths = parse_key_dims(spec, i)
            if name in key_dims:
                raise ValueError(f"--key-dims name {name!r} given twice")
            key_dims[name] = widths
        head_shapes: dict[str, tuple[int, int]] = {}
        for i, spec in enumerate(args.head_shape, 1):
            name, shape = parse_head_shape(spec, i)
            if name in head_shapes:
                raise ValueError(f"--head-shape name {name!r} given twice")
            head_shapes[name] = shape
        if args.model:
            family, arch, settings = workflow_model(args.model, args.config, args.settings)
        else:
            family, arch = args.family, args.arch
            settings = speed_settings(args.settings)
        for widths in key_dims.values():  # before the GPU check: a bad allocation fails in one line anywhere
            key_dims_record(family, arch, widths)
        for shape in head_shapes.values():
            head_shape_record(family, arch, *shape)
        require_cuda()
        doc = run_speed(family, arch, settings, args.out, model_name=args.model, parts=args.parts.split(","),
                        key_dims=key_dims, head_shapes=head_shapes)
        if key_dims:
            print(key_dims_markdown(doc))
        if head_shapes and doc["decode"]:
            print(head_shapes_markdown(doc))
    except (RuntimeError, ValueError) as e:
        if isinstance(e, torch.cuda.OutOfMemoryError):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
