"""Calibration statistics: K/Q activations (HDF5) and Grad saliency scores.

``activations.h5``: for every linear-attention layer, a uniform sample of token rows of
K and Q per head as they enter the recurrence (after conv and activation, before the in-kernel L2
norm), and the column L2 norms of the q/k projection input X over *all* calibration tokens (the
S-Wanda statistic). Rows are drawn by bottom-k sampling (each token gets a random priority from the
seeded generator; the ``rows`` smallest are kept), so memory is bounded by the rows kept, not the
tokens seen, and the sample is uniform without replacement and deterministic given the seed.

Layout::

    /layer_000/K      float32 [H, rows, d_k]   (same token positions for K and Q)
    /layer_000/Q      float32 [H, rows, d_k]
    /layer_000/xnorm  float64 [hidden]
    /layer_000/V      float32 [HV, rows, d_v]  (the values as they enter the recurrence, same positions)
    attrs: model, revision, corpus, n_samples, seq_len, seed, rows_per_head, n_tokens, num_heads,
           head_k_dim, hidden_size, layers, dtype, package_version, created; kernel_check (JSON) on CUDA

``grad_scores.h5``: per layer ``grad_q``/``grad_k`` float64 [H, d_k] with
s_j = sum_i |W[j, i] * dL/dW[j, i]| for the full model's mean LM loss over the calibration blocks
(paper Sec. 3.4, "Grad").

``weights/qk.h5``: per layer the head rows of the q/k projections, so that selection jobs read
weights without loading the model (:mod:`statereduce.core.h5files`).

:func:`activation_arrays`, :func:`grad_score_arrays` and :func:`qk_weight_arrays` compute the same per-layer arrays in
memory (what the three writers store, and what :mod:`statereduce.api` hands to the selectors without files).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.utils.checkpoint
from tqdm import tqdm

from statereduce import __version__
from statereduce.adapters import decoder_layers, get_adapter
from statereduce.core.h5files import write_layers
from statereduce.core.checkpoints import base_checkpoint
from statereduce.core.models import check_kernels, kernel_check_record
from statereduce.common.settings import CalibrationSettings


class BottomKReservoir:
    """Uniform sample of ``rows`` items from a stream, by keeping the smallest random priorities.

    Args:
        rows: number of rows to keep.
        rng: numpy Generator drawing the priorities (seeded by the caller).
    """

    def __init__(self, rows: int, rng: np.random.Generator):
        if rows < 1:
            raise ValueError(f"rows_per_head must be >= 1, got {rows}")
        self.rows = rows
        self.rng = rng
        self.keys = np.empty(0)
        self.data: np.ndarray | None = None  # [n_kept, *row_shape]
        self.seen = 0

    def add(self, batch: np.ndarray | torch.Tensor) -> None:
        """Offer ``batch`` [n, *row_shape] (numpy or torch) to the sample; only rows that enter are copied."""
        n = batch.shape[0]
        self.seen += n
        keys = self.rng.random(n)
        if self.keys.size == self.rows:
            # only candidates that beat the current worst kept key can enter
            sel = np.flatnonzero(keys < self.keys.max())
            if sel.size == 0:
                return
            keys, batch = keys[sel], batch[torch.from_numpy(sel) if isinstance(batch, torch.Tensor) else sel]
        if isinstance(batch, torch.Tensor):
            batch = batch.detach().float().cpu().numpy()
        if self.data is None:
            self.data = np.empty((0, *batch.shape[1:]), dtype=batch.dtype)
        all_keys = np.concatenate([self.keys, keys])
        all_data = np.concatenate([self.data, batch])
        if all_keys.size > self.rows:
            idx = np.argpartition(all_keys, self.rows - 1)[: self.rows]
            all_keys, all_data = all_keys[idx], all_data[idx]
        self.keys, self.data = all_keys, all_data

    def result(self) -> np.ndarray:
        """The kept rows in stream order (sorted by priority is arbitrary; stream order is stable)."""
        assert self.data is not None, "no rows were offered"
        return self.data[np.argsort(self.keys, kind="stable")]


@dataclass
class _LayerStats:
    reservoir: BottomKReservoir
    values: BottomKReservoir  # the same priorities as ``reservoir``: V rows at the token positions of K and Q
    xsq: np.ndarray | None = None  # running sum of squares of X columns (float64)
    shape: tuple[int, int] | None = None  # (H, d_k)


def activation_arrays(
    model: torch.nn.Module,
    blocks: torch.Tensor,
    *,
    rows_per_head: int = CalibrationSettings.rows_per_head,
    seed: int = CalibrationSettings.seed,
    batch_size: int = CalibrationSettings.batch_size,
) -> tuple[dict[int, dict[str, np.ndarray]], int]:
    """Run the calibration blocks through ``model``; the statistics ``activations.h5`` holds, in memory.

    Args:
        model: a loaded causal LM with an adapter (eval mode).
        blocks: LongTensor [n_samples, seq_len] of calibration token ids.
        rows_per_head: rows of K and of Q kept per head (2,500 + 2,500 by default, as in the paper).
        seed: seeds the row sampling.
        batch_size: sequences per forward pass.

    Returns:
        ({layer: {"K": float32 [H, rows, d_k], "Q": float32 [H, rows, d_k], "xnorm": float64 [hidden],
        "V": float32 [HV, rows, d_v]}}, tokens seen), the layers in the adapter's order; V holds the values as they
        enter the recurrence at the token positions of K and Q.
    """
    adapter = get_adapter(model)
    layers = [i for i, _ in adapter.mixer_layers()]
    rng = np.random.default_rng(seed)
    seeds = {i: rng.integers(1 << 63) for i in layers}
    stats = {i: _LayerStats(BottomKReservoir(rows_per_head, np.random.default_rng(seeds[i])),
                            BottomKReservoir(rows_per_head, np.random.default_rng(seeds[i]))) for i in layers}

    def on_qk(layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        st = stats[layer]
        b, t, h, d = k.shape
        st.shape = (h, d)
        # rows = tokens; each row holds all heads' K and Q so K and Q share token positions
        st.reservoir.add(torch.stack([k, q], dim=2).reshape(b * t, 2, h, d))

    def on_v(layer: int, v: torch.Tensor) -> None:
        b, t = v.shape[:2]
        stats[layer].values.add(v.reshape(b * t, *v.shape[2:]))

    def on_x(layer: int, x: torch.Tensor) -> None:
        st = stats[layer]
        sq = x.detach().float().pow(2).sum(dim=(0, 1)).double().cpu().numpy()
        st.xsq = sq if st.xsq is None else st.xsq + sq

    device = next(model.parameters()).device
    n_tokens = 0
    with torch.no_grad(), adapter.capture(on_qk=on_qk, on_x=on_x, on_v=on_v):
        for start in tqdm(range(0, blocks.shape[0], batch_size), desc="calibration", unit="batch"):
            batch = blocks[start : start + batch_size].to(device)
            model(input_ids=batch, use_cache=False)
            n_tokens += batch.numel()

    arrays = {}
    for i in layers:
        st = stats[i]
        if st.shape is None or st.xsq is None:
            raise RuntimeError(f"layer {i}: capture callbacks never fired; the adapter's capture is broken")
        rows = st.reservoir.result()  # [R, 2, H, d]
        arrays[i] = {
            "K": np.ascontiguousarray(rows[:, 0].transpose(1, 0, 2), dtype=np.float32),
            "Q": np.ascontiguousarray(rows[:, 1].transpose(1, 0, 2), dtype=np.float32),
            "xnorm": np.sqrt(st.xsq),
            "V": np.ascontiguousarray(st.values.result().transpose(1, 0, 2), dtype=np.float32),
        }
    return arrays, n_tokens


def capture_activations(
    model: torch.nn.Module,
    blocks: torch.Tensor,
    out_path: str | Path,
    *,
    rows_per_head: int = CalibrationSettings.rows_per_head,
    seed: int = CalibrationSettings.seed,
    batch_size: int = CalibrationSettings.batch_size,
    attrs: dict | None = None,
) -> Path:
    """Run the calibration blocks through ``model`` and write ``activations.h5`` atomically.

    Args:
        model: a loaded causal LM with an adapter (eval mode).
        blocks: LongTensor [n_samples, seq_len] of calibration token ids.
        out_path: destination; written to a temporary file and renamed.
        rows_per_head: rows of K and of Q kept per head (2,500 + 2,500 by default, as in the paper).
        seed: seeds the row sampling.
        batch_size: sequences per forward pass.
        attrs: provenance attributes to store (model, revision, corpus, ...).
    """
    arrays, n_tokens = activation_arrays(model, blocks, rows_per_head=rows_per_head, seed=seed, batch_size=batch_size)
    return write_layers(out_path, arrays, _meta(model, list(arrays)) | {
        "n_samples": int(blocks.shape[0]),
        "seq_len": int(blocks.shape[1]),
        "seed": seed,
        "rows_per_head": rows_per_head,
        "n_tokens": n_tokens,
    } | dict(attrs or {}))


@contextlib.contextmanager
def recomputed_layers(model: torch.nn.Module, enabled: bool = True) -> Iterator[None]:
    """While active, each decoder layer runs under ``torch.utils.checkpoint`` (non-reentrant): the backward recomputes
    a layer's activations from its input instead of keeping every layer's, so a backward's memory grows with one
    layer's activations, not all of them. Works in ``eval()`` (unlike ``gradient_checkpointing_enable``, which
    transformers applies in training mode only). The Grad backward of the Qwen3.5 9B shape over 8 × 2048 tokens
    needed more than an H200's 140 GB without it (docs/paper_scale.md)."""
    if not enabled:
        yield
        return

    def run(forward, *args, **kwargs):
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    layers = list(decoder_layers(model))
    saved = [layer.__dict__.get("forward") for layer in layers]  # an instance-level forward (hooks) to restore
    for layer in layers:
        layer.forward = functools.partial(run, layer.forward)
    try:
        yield
    finally:
        for layer, own in zip(layers, saved, strict=True):
            if own is None:
                del layer.forward
            else:
                layer.forward = own


def grad_score_arrays(
    model: torch.nn.Module,
    blocks: torch.Tensor,
    *,
    batch_size: int = CalibrationSettings.batch_size,
    recompute: bool | None = None,
    values: bool = True,
) -> dict[int, dict[str, np.ndarray]]:
    """Grad saliency of every q/k channel from the full model's LM loss; the scores ``grad_scores.h5`` holds.

    The gradient of the mean next-token loss over all calibration blocks is accumulated, then
    s_q[h, j] = sum_i |W_q[h*d_k + j, i] * dL/dW_q[h*d_k + j, i]| (same for k). Afterwards only the q/k
    projection weights have ``requires_grad`` set, and every ``.grad`` is None.

    Args:
        model: loaded causal LM (its parameters' ``requires_grad`` is managed here).
        blocks: LongTensor [n_samples, seq_len].
        batch_size: sequences per backward pass.
        recompute: recompute each decoder layer's activations in the backward instead of keeping them all
            (:func:`recomputed_layers`); None: on CUDA only, where memory is the limit (the CPU results stay as
            they were).

        values: also the Grad saliency of every value channel, ``grad_v`` [HV, d_v]: the value projection's rows
            plus the output projection's columns, s_v[h, j] = sum_i |W_v[hj, i] dL/dW_v[hj, i]| + sum_i |W_o[i, hj]
            dL/dW_o[i, hj]| (the q/k scores are the same either way).

    Returns:
        {layer: {"grad_q": float64 [H, d_k], "grad_k": float64 [H, d_k], "grad_v": float64 [HV, d_v]}}, the layers
        in the adapter's order.
    """
    adapter = get_adapter(model)
    if adapter.route_backward() == "fla":  # the torch kernels on a GPU where fla refuses the family's backward
        check_kernels(model, backward=True)  # on CUDA: fla's backward at these head shapes, checked first
    weights = {lay.layer: lay.qk_weight_rows() for lay in adapter.layouts()}  # {layer: ((W, rows_q), (W, rows_k))}
    value_weights = {lay.layer: _value_weight_positions(lay) for lay in adapter.layouts()} if values else {}
    targets = {id(w) for pair in weights.values() for w, _ in pair}
    targets |= {id(w) for pair in value_weights.values() for w, _ in pair}
    for p in model.parameters():
        p.requires_grad_(id(p) in targets)
        p.grad = None
    model.eval()  # no dropout; autograd still records
    device = next(model.parameters()).device
    n_total = blocks.shape[0]
    with recomputed_layers(model, device.type == "cuda" if recompute is None else recompute):
        for start in tqdm(range(0, n_total, batch_size), desc="grad scores", unit="batch"):
            batch = blocks[start : start + batch_size].to(device)
            logits = model(input_ids=batch, use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1), reduction="mean"
            )
            (loss * batch.shape[0] / n_total).backward()
    h, d = adapter.num_heads, adapter.head_k_dim
    arrays: dict[int, dict[str, np.ndarray]] = {}
    for i, (q_side, k_side) in weights.items():
        arrays[i] = {}
        for name, (w, rows) in (("grad_q", q_side), ("grad_k", k_side)):
            if w.grad is None:
                raise RuntimeError(f"layer {i}: no gradient reached the {name[-1]} projection")
            flat = rows.reshape(-1).to(w.device)
            s = (w.detach()[flat].double() * w.grad[flat].double()).abs().sum(dim=1).reshape(h, d)
            arrays[i][name] = s.cpu().numpy()
        if i in value_weights:
            (w_v, rows_v), (w_o, cols_o) = value_weights[i]
            if w_v.grad is None or w_o.grad is None:
                raise RuntimeError(f"layer {i}: no gradient reached the value or output projection")
            flat = rows_v.reshape(-1).to(w_v.device)
            s_v = (w_v.detach()[flat].double() * w_v.grad[flat].double()).abs().sum(dim=1)
            flat = cols_o.reshape(-1).to(w_o.device)
            s_o = (w_o.detach()[:, flat].double() * w_o.grad[:, flat].double()).abs().sum(dim=0)
            arrays[i]["grad_v"] = (s_v + s_o).reshape(rows_v.shape).cpu().numpy()
    for p in model.parameters():
        p.grad = None
    return arrays


def _value_weight_positions(layout) -> tuple[tuple[torch.nn.Parameter, torch.Tensor],
                                                  tuple[torch.nn.Parameter, torch.Tensor]]:
    """((W, rows [HV, d_v]) of the value projection, (W, columns [HV, d_v]) of the output projection) of a mixer."""
    entries = layout.value_channels()
    proj = next(e for e in entries if e.axis == "out" and isinstance(e.module, torch.nn.Linear))
    out = next(e for e in entries if e.axis == "in")
    rows = proj.index[..., 0] if proj.index.ndim == 3 else proj.index
    return (proj.module.weight, rows), (out.module.weight, out.index)


def grad_scores(
    model: torch.nn.Module,
    blocks: torch.Tensor,
    out_path: str | Path,
    *,
    batch_size: int = CalibrationSettings.batch_size,
    attrs: dict | None = None,
) -> Path:
    """Grad saliency of every q/k channel from the full model's LM loss; writes ``grad_scores.h5``.

    The gradient of the mean next-token loss over all calibration blocks is accumulated, then
    s_q[h, j] = sum_i |W_q[h*d_k + j, i] * dL/dW_q[h*d_k + j, i]| (same for k) (:func:`grad_score_arrays`).

    Args:
        model: loaded causal LM (its parameters' ``requires_grad`` is managed here).
        blocks: LongTensor [n_samples, seq_len].
        out_path: destination (atomic write).
        batch_size: sequences per backward pass.
        attrs: provenance attributes.
    """
    arrays = grad_score_arrays(model, blocks, batch_size=batch_size)
    return write_layers(out_path, arrays, _meta(model, list(arrays))
                        | {"n_samples": int(blocks.shape[0]), "seq_len": int(blocks.shape[1])} | dict(attrs or {}))


def qk_weight_arrays(model: torch.nn.Module) -> dict[int, dict[str, np.ndarray]]:
    """The head rows of every layer's q/k projections and its value weights: {layer: {"W_q", "W_k": float32 [H, d_k,
    hidden], "W_v": [HV, d_v, hidden] (value projection rows), "W_o": [HV, d_v, hidden] (output projection columns),
    "w_norm": [1 or HV, d_v] (output norm weight: one row where the heads share it)}}."""
    adapter = get_adapter(model)
    h, d = adapter.num_heads, adapter.head_k_dim
    arrays = {}
    for layout in adapter.layouts():
        wq, wk = layout.qk_weights()
        w_v, w_o, w_n = layout.value_weights()
        arrays[layout.layer] = {"W_q": wq.detach().float().cpu().numpy().reshape(h, d, -1),
                                "W_k": wk.detach().float().cpu().numpy().reshape(h, d, -1),
                                "W_v": w_v.float().cpu().numpy(), "W_o": w_o.float().cpu().numpy(),
                                **({} if w_n is None else {"w_norm": w_n.float().cpu().numpy()})}
    return arrays


def export_qk_weights(model: torch.nn.Module, out_path: str | Path, *, attrs: dict | None = None) -> Path:
    """Write the head rows of every layer's q/k projections to ``qk.h5`` (float32 [H, d_k, hidden])."""
    arrays = qk_weight_arrays(model)
    return write_layers(out_path, arrays, _meta(model, list(arrays)) | dict(attrs or {}))


def _meta(model: torch.nn.Module, layers: list[int]) -> dict:
    """Attributes every per-layer HDF5 artifact carries; ``base_checkpoint`` (JSON) for a hub or local model
    (:func:`statereduce.core.checkpoints.base_checkpoint`)."""
    adapter = get_adapter(model)
    base = base_checkpoint(model)
    return {
        "base_checkpoint": json.dumps(base, sort_keys=True) if base is not None else None,
        "family": adapter.family,
        "num_heads": adapter.num_heads,
        "head_k_dim": adapter.head_k_dim,
        "num_v_heads": adapter.dims(adapter.config).num_v_heads,
        "head_v_dim": adapter.dims(adapter.config).head_v_dim,
        "hidden_size": int(model.config.hidden_size),
        "layers": np.asarray(layers, dtype=np.int64),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "package_version": __version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        # on CUDA, the fla kernel routes checked for the model and which path ran each (statereduce.kernels.check)
        "kernel_check": json.dumps(kernel_check_record(model)) if kernel_check_record(model) else None,
    }
