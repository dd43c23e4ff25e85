"""Shared short convolutions of fla's DeltaNet and Gated DeltaNet (paper App. B.5, C.6.1, Table 14).

fla's layers convolve q and k depthwise and causally (``q_conv1d``, ``k_conv1d``, weight ``[H * d_k, 1, W]``, head h
in rows ``h*d_k .. (h+1)*d_k``): every channel has a filter of its own, so the convolution does not commute with a
rotation of a head's channels, and a pruning transform that rotates them has to mix the filters (App. B.4). A
*shared* convolution ties the filter across the channels of each head and then commutes with any map of them
(App. B.5); shared across heads, one filter serves every channel of the layer (Table 14's ✓✓ row). q and k keep
filters of their own either way, and a conv bias (where the config has one) stays per channel: it adds after the
convolution, so a rotation carries it over exactly.

* :func:`conv_sharing` tells how a loaded layer's q/k filters are shared (exact equality);
* :func:`model_conv_sharing` tells it for a whole model;
* :func:`tie_qk_convs` ties them while a model trains (:func:`statereduce.stages.pretrain.pretrain`'s ``share_conv``,
  and recovery fine-tuning of a model whose filters are shared) and unties them into stock modules whose tied filters
  are exactly equal, so the saved checkpoint is a standard one; :func:`untie_convs` does the same for every tied
  conv of a model, including copies (peft's ``modules_to_save``);
* :func:`statereduce.families.check_share_conv` validates the option against a family and its ``arch`` without
  importing torch or fla.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn.utils import parametrize

from statereduce.adapters.base import LinearAttentionAdapter
from statereduce.families.base import SHARE_CONV


def filters_equal(weight: torch.Tensor, groups: int = 1) -> bool:
    """Whether the rows (filters) of ``weight`` [D, ...] are equal within each of ``groups`` contiguous blocks."""
    if weight.shape[0] % groups:
        raise ValueError(f"{weight.shape[0]} conv channels do not split into {groups} heads")
    w = weight.detach().reshape(groups, weight.shape[0] // groups, -1)
    return bool((w == w[:, :1]).all())


def conv_sharing(mixer: nn.Module, num_heads: int, head_k_dim: int) -> str:
    """How the q/k short convolutions of an fla DeltaNet / Gated DeltaNet layer share their filters.

    Args:
        mixer: the layer (``use_short_conv``, ``q_conv1d``, ``k_conv1d`` with weights ``[H * d_k, 1, W]``).
        num_heads: H, the q/k heads.
        head_k_dim: d_k of the config; a layer of a checkpoint whose layers keep different key widths holds H heads of
            its own d_k' <= d_k.
    Returns:
        ``"all"`` when every channel of ``q_conv1d`` has the same filter and so has every channel of ``k_conv1d``
        (q's and k's may differ), else ``"head"`` when that holds within each head, else ``"none"`` (also for a
        layer without short convolutions). Equality is exact. With one head "all" and "head" coincide: "all".
    """
    if not getattr(mixer, "use_short_conv", False):
        return "none"
    convs = (mixer.q_conv1d, mixer.k_conv1d)
    for conv in convs:
        channels = conv.weight.shape[0]
        if channels % num_heads or not 0 < channels <= num_heads * head_k_dim:
            raise ValueError(f"conv weight {tuple(conv.weight.shape)} does not hold H={num_heads} heads of "
                             f"d_k' <= d_k={head_k_dim} channels")
    for share, groups in (("all", 1), ("head", num_heads)):
        if all(filters_equal(conv.weight, groups) for conv in convs):
            return share
    return "none"


def model_conv_sharing(adapter: LinearAttentionAdapter) -> str:
    """How the q/k filters of every linear-attention layer of ``adapter.model`` are shared: ``"all"`` when every
    layer shares them across the layer, else ``"head"`` when every layer shares them at least within each head, else
    ``"none"`` (also for families whose layout does not tell, :meth:`~statereduce.adapters.MixerLayout.conv_sharing`)."""
    found = {layout.conv_sharing() for layout in adapter.layouts()}
    if found == {"all"}:
        return "all"
    return "head" if found and found <= {"all", "head"} else "none"


class SharedRows(nn.Module):
    """Parametrization of a depthwise conv weight ``[groups * size, 1, W]`` by ``groups`` filters ``[groups, 1, W]``,
    each repeated over its block of ``size`` consecutive channels; registered, it starts from each block's first
    filter (:meth:`right_inverse`), which keeps the scale of the stock initialisation (a mean of d_k independent
    filters would be sqrt(d_k) times smaller)."""

    def __init__(self, groups: int, size: int):
        super().__init__()
        self.groups, self.size = int(groups), int(size)

    def forward(self, shared: torch.Tensor) -> torch.Tensor:
        return shared.repeat_interleave(self.size, dim=0)

    def right_inverse(self, weight: torch.Tensor) -> torch.Tensor:
        if weight.shape[0] != self.groups * self.size:
            raise ValueError(f"conv weight {tuple(weight.shape)} does not have {self.groups} x {self.size} channels")
        return weight.reshape(self.groups, self.size, *weight.shape[1:])[:, 0].clone()


def tie_qk_convs(adapter: LinearAttentionAdapter, share: str) -> Callable[[], None]:
    """Tie the q/k conv filters of every linear-attention layer of ``adapter.model`` for training.

    Each ``q_conv1d`` / ``k_conv1d`` weight is parametrized (``torch.nn.utils.parametrize``, :class:`SharedRows`) by
    one filter per head (``"head"``) or one for the layer (``"all"``), initialised to the first of the filters it
    replaces; the optimizer then trains those filters. ``"none"`` touches nothing.

    Args:
        adapter: the adapter of the model to train (``num_heads``, and each layer's ``qk_convs`` and ``key_dim``:
            :class:`~statereduce.adapters.MixerLayout`).
        share: one of :data:`~statereduce.families.base.SHARE_CONV`.
    Returns:
        ``untie()``: :func:`untie_convs` of the model, leaving every conv a stock module whose weight is a plain
        ``[H * d_k, 1, W]`` parameter with exactly equal tied filters (a standard checkpoint once saved).
    Raises:
        ValueError: an unknown ``share``, or a layer without q/k short convolutions.
    """
    if share not in SHARE_CONV:
        raise ValueError(f"unknown share_conv {share!r}; valid: {', '.join(SHARE_CONV)}")
    if share == "none":
        return lambda: None
    h = adapter.num_heads
    convs = []
    for layout in adapter.layouts():
        pair = layout.qk_convs()
        if any(c is None for c in pair):
            raise ValueError(f"share_conv {share!r}: layer {layout.layer} has no q/k short convolutions (use_short_conv "
                             "off)")
        d_k = layout.key_dim  # the layer's own width (per-layer-width checkpoints)
        convs.extend((conv, (h, d_k) if share == "head" else (1, h * d_k)) for conv in pair)
    for conv, (groups, size) in convs:
        parametrize.register_parametrization(conv, "weight", SharedRows(groups, size))
    return lambda: untie_convs(adapter.model)


def untie_convs(model: nn.Module) -> int:
    """Remove every :class:`SharedRows` parametrization in ``model`` (leaving each weight a plain parameter with its
    tied filters exactly equal); returns how many convs it untied."""
    tied = [m for m in model.modules()
            if parametrize.is_parametrized(m, "weight")
            and any(isinstance(p, SharedRows) for p in m.parametrizations.weight)]
    for module in tied:
        # removing a parametrization deletes the weight property from the module's class, and a deepcopy (peft's
        # trained copy) shares that class with its original: give each module a class of its own first
        cls = type(module)
        own = {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")}
        module.__class__ = type(cls.__name__, cls.__bases__, own)
        parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
    return len(tied)
