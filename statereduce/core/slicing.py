"""Slicing the q/k channels out of a mixer's modules (:func:`slice_mixer`), shared by pruning
(:mod:`statereduce.stages.prune`) and by loading a checkpoint whose layers keep different key widths
(:func:`shape_mixers`, :func:`statereduce.core.models.load_model`).

A mixer's q/k channels sit in rows of its projections and short convolutions (``adapter.layout(mixer).channel_rows()``: fused
layouts included); slicing keeps every other row in order, so a head's kept channels stay in place. A transform
selection first rotates each head's channels into its first d_k' rows (:func:`transform_rows`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn

from statereduce.adapters import ChannelRows, LinearAttentionAdapter, get_adapter
from statereduce.adapters.mixer_layout import ValueChannels
from statereduce.adapters.conv_sharing import filters_equal
from statereduce.families.base import KEY_DIMS_FIELD, VALUE_DIMS_FIELD  # noqa: F401  (the fields shaped from)

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
    entries = adapter.layout(mixer).channel_rows()
    with zeroed_rows([(e.module, kept_rows(e.module.weight.shape[0], e, keep.to(torch.long))) for e in entries]):
        yield


@contextmanager
def zeroed_rows(kept: Sequence[tuple[nn.Module, torch.Tensor]]) -> Iterator[None]:
    """Zero every row (weight and bias) of each module except its ``kept`` rows for the duration of the block, then
    restore them: :func:`masked_channels` and :func:`masked_values`."""
    saved = []
    with torch.no_grad():
        for module, keep_rows in kept:
            dropped = torch.ones(module.weight.shape[0], dtype=torch.bool)
            dropped[keep_rows] = False
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


# ---- the value side -----------------------------------------------------------------------------
def value_positions(entry: ValueChannels, keep_v: torch.Tensor, n: int) -> torch.Tensor:
    """The positions of ``entry.module`` along its axis that keeping ``keep_v`` leaves: every position except the
    dropped value channels, in order (a fused projection keeps its other rows in place).

    Args:
        entry: where the module's value channels sit (``index`` [HV, d_v], [1, d_v] for a shared norm weight, or
            [HV, d_v, P] for a module holding P rows per channel).
        keep_v: [HV, d_v'] kept value channels per value head, sorted (a shared entry reads row 0), or [d_v'] for
            every head.
        n: the module's size along the axis.
    """
    index = entry.index
    if keep_v.ndim == 1:
        keep_v = keep_v[None].expand(index.shape[0], -1)
    keep = keep_v[:1] if index.shape[0] == 1 else keep_v
    if keep.shape[0] != index.shape[0]:
        raise ValueError(f"{entry.name} has {index.shape[0]} value heads; keep_v {tuple(keep_v.shape)} has "
                         f"{keep_v.shape[0]}")
    if keep.numel() and int(keep.max()) >= index.shape[1]:
        raise ValueError(f"{entry.name}: value index {int(keep.max())} out of range for d_v={index.shape[1]}")
    dropped = torch.ones(index.shape[:2], dtype=torch.bool)
    dropped.scatter_(1, keep.cpu(), False)
    mask = torch.ones(n, dtype=torch.bool)
    mask[index[dropped]] = False  # a [HV, d_v, P] index: every position of the channel's P parts
    return mask.nonzero().squeeze(1)


def _axis_size(entry: ValueChannels) -> int:
    weight = entry.module.weight
    return weight.shape[1] if entry.axis == "in" else weight.shape[0]


def slice_values(adapter: LinearAttentionAdapter, mixer: nn.Module, keep_v: torch.Tensor) -> None:
    """Keep the value channels ``keep_v`` ([HV, d_v'] per value head, sorted) of one mixer: rows of its value
    projections and convs, entries of its output norm's weight, columns of its output projection (its layout's
    ``value_channels``), then set its sizes (``value_updates``). Weights only: rescaling the norm is the caller's
    (:func:`statereduce.stages.prune.prune_model`)."""
    layout = adapter.layout(mixer)
    entries = layout.value_channels()  # every position map is read before any module changes
    updates = layout.value_updates(int(keep_v.shape[1]))
    plans = [(entry, value_positions(entry, keep_v, _axis_size(entry))) for entry in entries]
    for entry, kept in plans:
        module = entry.module
        if entry.axis == "out":
            slice_rows(module, kept, entry.name, layout.conv_channel_attrs)
        elif entry.axis == "in":
            if not isinstance(module, nn.Linear):
                raise ValueError(f"{entry.name} is a {type(module).__name__}; only nn.Linear columns can be sliced")
            kept = kept.to(module.weight.device)
            module.weight = nn.Parameter(module.weight.data[:, kept].clone(), requires_grad=module.weight.requires_grad)
            module.in_features = kept.numel()
        elif entry.axis == "norm":
            kept = kept.to(module.weight.device)
            module.weight = nn.Parameter(module.weight.data[kept].clone(), requires_grad=module.weight.requires_grad)
            if getattr(module, "bias", None) is not None:
                module.bias = nn.Parameter(module.bias.data[kept].clone(), requires_grad=module.bias.requires_grad)
        else:
            raise ValueError(f"{entry.name}: unknown value axis {entry.axis!r}; valid: out, in, norm")
    for name, value in updates.items():
        owner, _, attr = name.rpartition(".")
        set_mixer_dims(mixer.get_submodule(owner) if owner else mixer, {attr: value})


def output_norms(adapter: LinearAttentionAdapter, mixer: nn.Module) -> list[nn.Module]:
    """The mixer's output norm modules (the ``"norm"`` entries of its value channels)."""
    return [e.module for e in adapter.layout(mixer).value_channels() if e.axis == "norm"]


def shape_values(adapter: LinearAttentionAdapter, value_dims: Sequence[int | None]) -> None:
    """Give each linear-attention mixer ``value_dims[layer]`` value channels per head (its first d_v': only the shapes
    matter, the weights are loaded next), as :func:`statereduce.stages.prune.prune_model` stored them in
    :data:`VALUE_DIMS_FIELD` for a family whose config cannot hold d_v'.

    Raises:
        ValueError: one line, when ``value_dims`` does not name a width for exactly the mixer layers.
    """
    layers = dict(adapter.mixer_layers())
    named = {i for i, w in enumerate(value_dims) if w is not None}
    if named != set(layers):
        raise ValueError(f"{VALUE_DIMS_FIELD} names widths for layers {sorted(named)}; the model's linear-attention "
                         f"layers are {sorted(layers)}")
    for layer, mixer in layers.items():
        layout = adapter.layout(mixer)
        hv = max(e.index.shape[0] for e in layout.value_channels())
        slice_values(adapter, mixer, torch.arange(int(value_dims[layer])).expand(hv, -1))


@contextmanager
def masked_values(adapter: LinearAttentionAdapter, mixer: nn.Module, keep_v: torch.Tensor) -> Iterator[None]:
    """Zero the dropped value channels of one mixer for the duration of the block (the rows of its value projections
    and convs, weight and bias: a dropped channel's value is zero after the conv and activation, so is its row of the
    state and its output), then restore them.

    Args:
        adapter: the model's adapter.
        mixer: one of ``adapter.mixer_layers()``'s mixers.
        keep_v: [HV, d_v'] kept value channels per value head.
    """
    entries = [e for e in adapter.layout(mixer).value_channels() if e.axis == "out"]
    with zeroed_rows([(e.module, value_positions(e, keep_v.to(torch.long), e.module.weight.shape[0]))
                      for e in entries]):
        yield


def cut_tensors(rows) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """({layer: int64 [H, d_k']}, {layer: int64 [units, d_v']}) kept key and value channels of a joint cut's
    selection rows (:func:`statereduce.stages.select.select_channels`: layer, head or unit, HeadSelection, side)."""
    sides: dict[str, dict[int, dict[int, np.ndarray]]] = {"k": {}, "v": {}}
    for layer, unit, sel, side in rows:
        sides[side].setdefault(int(layer), {})[int(unit)] = np.asarray(sel.keep, np.int64)
    return tuple({layer: torch.as_tensor(np.stack([units[u] for u in sorted(units)]))
                  for layer, units in sorted(sides[s].items())} for s in ("k", "v"))


def masked_cut(model: nn.Module, keys: Mapping[int, torch.Tensor], values: Mapping[int, torch.Tensor]) -> ExitStack:
    """A context in which ``model`` has every layer's dropped key channels (``keys``: {layer: [H, d_k']}) and value
    channels (``values``: {layer: [units, d_v']}) zeroed: the joint cut under ``norm_eps: exact``."""
    adapter = get_adapter(model)
    mixers = dict(adapter.mixer_layers())
    stack = ExitStack()
    with stack:
        for layer, keep in keys.items():
            stack.enter_context(masked_channels(adapter, mixers[layer], keep))
        for layer, keep_v in values.items():
            stack.enter_context(masked_values(adapter, mixers[layer], keep_v))
        return stack.pop_all()
