"""Slicing the q/k channels out of a mixer's modules, shared by pruning (:mod:`statereduce.prune`) and by loading a
checkpoint whose layers keep different key widths (:func:`shape_mixers`, :func:`statereduce.models.load_model`).

A mixer's q/k channels sit in rows of its projections and short convolutions (``adapter.channel_rows``: fused
layouts included); slicing keeps every other row in order, so a head's kept channels stay in place.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from statereduce.adapters import ChannelRows, LinearAttentionAdapter

#: The config field of a checkpoint whose layers keep different key widths: per decoder layer, its d_k' (None for a
#: layer without a linear-attention mixer). The config's own head sizes stay those of the unpruned model.
KEY_DIMS_FIELD = "statereduce_key_dims"
#: Per decoder layer, the eps of the mixer's output norm (None where unchanged or absent), set after shaping.
OUTPUT_NORM_EPS_FIELD = "statereduce_output_norm_eps"


def head_rows(keep: torch.Tensor, d_k: int) -> torch.Tensor:
    """Flat row indices ``h*d_k + keep[h, j]`` (head-major) of the kept channels.

    Args:
        keep: [H, d_k'] long, channel indices per head.
        d_k: the current head size.
    Returns:
        [H * d_k'] long.
    """
    offsets = torch.arange(keep.shape[0], device=keep.device, dtype=torch.long)[:, None] * d_k
    return (offsets + keep).reshape(-1)


def kept_rows(n_rows: int, entry: ChannelRows, keep: torch.Tensor) -> torch.Tensor:
    """The rows of ``entry.module`` that pruning keeps: every row except the dropped q/k channels, in order.

    Args:
        n_rows: the module's rows (output features or channels).
        entry: where its q/k channels sit (``entry.q``/``entry.k`` [H, d_k] row indices, or None).
        keep: [H, d_k'] kept channel indices per head, sorted.
    Returns:
        [n_rows - dropped] long, ascending: a head's kept channels stay in place within a fused layout.
    """
    mask = torch.ones(n_rows, dtype=torch.bool)
    for side in ("q", "k"):
        rows = getattr(entry, side)
        if rows is None:
            continue
        if rows.shape[0] != keep.shape[0]:
            raise ValueError(
                f"{entry.name} has {rows.shape[0]} {side} heads; keep {tuple(keep.shape)} has {keep.shape[0]}"
            )
        if keep.numel() and int(keep.max()) >= rows.shape[1]:
            raise ValueError(f"{entry.name}: keep index {int(keep.max())} out of range for d_k={rows.shape[1]}")
        if int(rows.max()) >= n_rows:
            raise ValueError(f"{entry.name}: {side} row {int(rows.max())} out of range for its {n_rows} rows")
        dropped = torch.ones(rows.shape, dtype=torch.bool)
        dropped.scatter_(1, keep.cpu(), False)
        mask[rows[dropped]] = False
    return mask.nonzero().squeeze(1)


def slice_rows(module: nn.Module, rows: torch.Tensor, what: str, conv_attrs: tuple[str, ...] = ()) -> None:
    """Keep ``rows`` of an ``nn.Linear`` (output features: weight and bias rows, ``out_features``) or a depthwise
    ``nn.Conv1d`` (channels: weight, bias, ``in_channels``/``out_channels``/``groups``, and ``conv_attrs``, the
    adapter's ``conv_channel_attrs``)."""
    depthwise = module.groups == module.in_channels == module.out_channels if isinstance(module, nn.Conv1d) else True
    if not depthwise:
        raise ValueError(
            f"{what} is not depthwise (groups={module.groups}, in={module.in_channels}, out={module.out_channels})"
        )
    if not isinstance(module, (nn.Linear, nn.Conv1d)):
        raise ValueError(f"{what} is a {type(module).__name__}; only nn.Linear and depthwise nn.Conv1d can be sliced")
    rows = rows.to(module.weight.device)
    module.weight = nn.Parameter(module.weight.data[rows].clone(), requires_grad=module.weight.requires_grad)
    if module.bias is not None:
        module.bias = nn.Parameter(module.bias.data[rows].clone(), requires_grad=module.bias.requires_grad)
    n = rows.numel()
    if isinstance(module, nn.Linear):
        module.out_features = n
        return
    module.in_channels = module.out_channels = module.groups = n
    for name in conv_attrs:
        if hasattr(module, name):
            setattr(module, name, n)


def set_mixer_dims(mixer: nn.Module, updates: Mapping[str, Any]) -> None:
    """Set the mixer's size attributes (``key_dim``, ``head_k_dim``, ...) from ``adapter.mixer_updates``."""
    for name, value in updates.items():
        if not hasattr(mixer, name):
            raise ValueError(f"{type(mixer).__name__} has no attribute {name!r} to update")
        setattr(mixer, name, value)


def shape_mixers(adapter: LinearAttentionAdapter, key_dims: Sequence[int | None],
                 output_norm_eps: Sequence[float | None] | None = None) -> None:
    """Give each linear-attention mixer the key width ``key_dims[layer]`` (its first d_k' channels per head: only
    the shapes matter, the weights are loaded next) and its output norm's eps, as :func:`statereduce.prune.prune_model`
    stored them for a mixed allocation.

    Raises:
        ValueError: one line, when ``key_dims`` does not name a width for exactly the mixer layers.
    """
    layers = dict(adapter.mixer_layers())
    named = {i for i, w in enumerate(key_dims) if w is not None}
    if named != set(layers):
        raise ValueError(f"{KEY_DIMS_FIELD} names widths for layers {sorted(named)}; the model's linear-attention "
                         f"layers are {sorted(layers)}")
    h = adapter.num_heads
    for layer, mixer in layers.items():
        width = int(key_dims[layer])
        keep = torch.arange(width).expand(h, -1)
        for entry in adapter.channel_rows(mixer):
            slice_rows(entry.module, kept_rows(entry.module.weight.shape[0], entry, keep), entry.name,
                       adapter.conv_channel_attrs)
        set_mixer_dims(mixer, adapter.mixer_updates(adapter.config, width))
        eps = None if output_norm_eps is None else output_norm_eps[layer]
        if eps is not None:
            for attr in adapter.mixer_output_norm_eps(mixer):
                setattr(attr.module, attr.attr, float(eps))
