"""Slicing the q/k channels out of a mixer's modules (:func:`slice_mixer`), shared by pruning
(:mod:`statereduce.stages.prune`) and by loading a checkpoint whose layers keep different key widths
(:func:`shape_mixers`, :func:`statereduce.core.models.load_model`).

A mixer's q/k channels sit in rows of its projections and short convolutions (``adapter.layout(mixer).channel_rows()``: fused
layouts included); slicing keeps every other row in order, so a head's kept channels stay in place. A transform
selection first rotates each head's channels into its first d_k' rows (:func:`transform_rows`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from statereduce.adapters import ChannelRows, LinearAttentionAdapter
from statereduce.adapters.conv_sharing import filters_equal
from statereduce.families.base import KEY_DIMS_FIELD  # noqa: F401  (re-exported: the field this module shapes from)

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
    layout's ``conv_channel_attrs``)."""
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


def mix_filters(weight: torch.Tensor, transform: torch.Tensor) -> torch.Tensor:
    """The depthwise filters of channels rotated by ``transform`` (paper App. B.4, Proposition B.1).

    Channel a's new filter is ``sum_b T[a, b]^2 w_b``: at every lag j, ``diag(w'_j)`` is the diagonal matrix closest
    in Frobenius norm to the exact rotated filter matrix ``T diag(w_j) T^T``. Where the head's filters are all equal
    (a shared convolution, App. B.5) the convolution commutes with the rotation and the filter is carried over
    exactly instead.

    Args:
        weight: [d_k, *filter] the head's filters (a depthwise ``Conv1d`` weight's rows: [d_k, 1, W]).
        transform: [d_k', d_k] with orthonormal rows.
    Returns:
        [d_k', *filter] in ``weight``'s dtype.
    """
    if filters_equal(weight):
        return weight[:1].expand(transform.shape[0], *weight.shape[1:]).clone()
    t2 = transform.to(torch.float64).square()
    mixed = (t2 @ weight.reshape(weight.shape[0], -1).to(torch.float64)).reshape(transform.shape[0], *weight.shape[1:])
    return mixed.to(weight.dtype)


def transform_rows(module: nn.Module, entry: ChannelRows, transform: torch.Tensor, what: str) -> dict[str, int]:
    """Write the transformed q/k channels of one module into the first d_k' rows of each head, in place (the
    rows :func:`slice_rows` then keeps with ``keep = 0..d_k'-1``).

    ``nn.Linear`` rows (and bias) become ``T_h W_h``; depthwise ``nn.Conv1d`` filters are mixed
    (:func:`mix_filters`) and a conv bias becomes ``T_h b_h`` (exact: the bias adds after the convolution).

    Args:
        module: the module ``entry`` describes.
        entry: where its q/k channels sit (``[H, d_k]`` row indices).
        transform: [H, d_k', d_k] float64, orthonormal rows per head.
    Returns:
        {"mixed": heads whose filters were mixed, "shared": heads whose shared filter was carried over} (convs).
    """
    counts = {"mixed": 0, "shared": 0}
    d_new = transform.shape[1]
    weight = module.weight.data
    for side in ("q", "k"):
        rows = getattr(entry, side)
        if rows is None:
            continue
        if rows.shape[0] != transform.shape[0] or rows.shape[1] != transform.shape[2]:
            raise ValueError(f"{what}: {side} rows {tuple(rows.shape)} do not match transform {tuple(transform.shape)}")
        for h in range(rows.shape[0]):
            src, dst, t = rows[h].to(weight.device), rows[h, :d_new].to(weight.device), transform[h]
            if isinstance(module, nn.Conv1d):
                counts["shared" if filters_equal(weight[src]) else "mixed"] += 1
                weight[dst] = mix_filters(weight[src], t.to(weight.device))
            else:
                new = t.to(weight.device) @ weight[src].to(torch.float64)
                weight[dst] = new.to(weight.dtype)
            if module.bias is not None:
                bias = module.bias.data
                bias[dst] = (t.to(bias.device) @ bias[src].to(torch.float64)).to(bias.dtype)
    return counts


def slice_mixer(
    adapter: LinearAttentionAdapter, mixer: nn.Module, keep: torch.Tensor, updates: Mapping[str, Any],
    transform: torch.Tensor | None = None,
) -> dict[str, int]:
    """Slice every module of the mixer that holds q/k channels (its layout's ``channel_rows``), then set its sizes.

    With ``transform`` ([H, d_k', d_k]) each module's q/k channels are first rotated into the first d_k' rows of
    each head (:func:`transform_rows`), and ``keep`` must be ``0..d_k'-1`` per head. Returns the conv filter counts
    of :func:`transform_rows` (zeros for an index selection)."""
    counts = {"mixed": 0, "shared": 0}
    layout = adapter.layout(mixer)
    entries = layout.channel_rows()  # all row maps are read before any module changes
    plans = [(entry, kept_rows(entry.module.weight.shape[0], entry, keep)) for entry in entries]
    for entry, rows in plans:
        if transform is not None:
            for key, n in transform_rows(entry.module, entry, transform, entry.name).items():
                counts[key] += n
        slice_rows(entry.module, rows, entry.name, layout.conv_channel_attrs)
    set_mixer_dims(mixer, updates)
    return counts


def shape_mixers(adapter: LinearAttentionAdapter, key_dims: Sequence[int | None],
                 output_norm_eps: Sequence[float | None] | None = None) -> None:
    """Give each linear-attention mixer the key width ``key_dims[layer]`` (its first d_k' channels per head: only
    the shapes matter, the weights are loaded next) and its output norm's eps, as
    :func:`statereduce.stages.prune.prune_model` stored them for a mixed allocation.

    Raises:
        ValueError: one line, when ``key_dims`` does not name a width for exactly the mixer layers.
    """
    layers = dict(adapter.mixer_layers())
    named = {i for i, w in enumerate(key_dims) if w is not None}
    if named != set(layers):
        raise ValueError(f"{KEY_DIMS_FIELD} names widths for layers {sorted(named)}; the model's linear-attention "
                         f"layers are {sorted(layers)}")
    for layer, mixer in layers.items():
        width = int(key_dims[layer])
        slice_mixer(adapter, mixer, torch.arange(width).expand(adapter.num_heads, -1),
                    adapter.mixer_updates(adapter.config, width))
        eps = None if output_norm_eps is None else output_norm_eps[layer]
        if eps is not None:
            for attr in adapter.layout(mixer).output_norm_eps():
                setattr(attr.module, attr.attr, float(eps))


@contextmanager
def masked_channels(adapter: LinearAttentionAdapter, mixer: nn.Module, keep: torch.Tensor) -> Iterator[None]:
    """Zero the dropped q/k channels of one mixer (weight and bias rows of every module ``channel_rows`` names) for
    the duration of the block, then restore them.

    Inside, the model equals one whose mixer was pruned to ``keep`` with the kernel scale held (``norm_eps="exact"``):
    a dropped channel is zero after the projection, the conv and the activation. The sensitivity budget policy
    measures the loss of cutting one layer this way without reshaping anything.

    Args:
        adapter: the model's adapter.
        mixer: one of ``adapter.mixer_layers()``'s mixers.
        keep: [H, d_k'] kept channel indices per head.
    """
    saved = []
    with torch.no_grad():
        for entry in adapter.layout(mixer).channel_rows():
            module = entry.module
            n_rows = module.weight.shape[0]
            dropped = torch.ones(n_rows, dtype=torch.bool)
            dropped[kept_rows(n_rows, entry, keep.to(torch.long))] = False
            rows = dropped.nonzero().squeeze(1).to(module.weight.device)
            for param in (module.weight, module.bias):
                if param is not None:
                    saved.append((param, rows, param[rows].clone()))
                    param[rows] = 0
    try:
        yield
    finally:
        with torch.no_grad():
            for param, rows, value in saved:
                param[rows] = value
