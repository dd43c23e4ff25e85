"""Where a family keeps what pruning changes: the parts an adapter is composed of.

:class:`MixerLayout` answers for one linear-attention mixer: the rows of its key/query channels in projections and
depthwise convolutions (fused or not), its key width, the projection input that calibration captures, its conv
filter sharing and its output norm's eps. :class:`ExactNorms` answers for the whole model what ``norm_eps="exact"``
touches: the modules that write into the residual stream, the projections that feed other norms, and every eps the
config sets. Slicing (:mod:`statereduce.core.slicing`), pruning (:mod:`statereduce.stages.prune`), the budgets,
capture and loading read a model only through these two and the adapter (:mod:`statereduce.adapters.base`), which
names its family's classes in ``mixer_layout`` and ``exact_norms``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn


@dataclass(frozen=True)
class ChannelRows:
    """Where the key/query channels sit in one module of a mixer.

    ``q[h, j]`` / ``k[h, j]`` is the row (output feature of an ``nn.Linear``, channel of a depthwise ``nn.Conv1d``) of
    query / key channel j of q/k head h, or None when the module holds no such channels. Under grouped heads (Mamba-2's
    B/C groups, GVA) h is the q/k head (group) whose selection its value heads share.
    """

    name: str  # the module's name inside the mixer, for messages
    module: nn.Module
    q: torch.Tensor | None
    k: torch.Tensor | None


@dataclass(frozen=True)
class ScaledRows:
    """Rows of a module's weight (and bias) that pruning with ``norm_eps="exact"`` multiplies by c = sqrt(d_k/d_k')
    (:func:`statereduce.stages.prune.exact_norm_eps`): output features of an ``nn.Linear``, or the whole weight of an
    ``nn.Embedding`` (``rows`` None: every row)."""

    name: str  # the module's qualified name in the model, for messages and the record
    module: nn.Module
    rows: torch.Tensor | None = None


@dataclass(frozen=True)
class EpsAttribute:
    """An attribute of a live module that the family's stock class sets from the config's norm eps
    (``FamilySpec.norm_eps_field``): ``module.<attr>``, e.g. an RMSNorm's ``eps``."""

    name: str  # the module's qualified name in the model
    module: nn.Module
    attr: str


@dataclass(frozen=True)
class ValueChannels:
    """Where the value channels sit in one module of a mixer.

    ``index[h, j]`` is the position of value channel j of value head h along ``axis``: ``"out"``, a row of an
    ``nn.Linear`` (output feature) or a channel of a depthwise ``nn.Conv1d``; ``"in"``, a column (input feature) of the
    mixer's output projection; ``"norm"``, an entry of the output norm's weight. A norm weight that all heads share (fla,
    Qwen3.5: ``[d_v]``) has one row, ``[1, d_v]``: its heads can only drop the same channels.
    """

    name: str  # the module's name inside the mixer, for messages
    module: nn.Module
    index: torch.Tensor
    axis: str


#: the attribute names under which the stock norm modules (and layers) of the supported families keep an eps
EPS_ATTRIBUTES = ("eps", "variance_epsilon", "layer_norm_epsilon", "norm_eps")

#: A projection weight and the rows [H, d_k] of channel (h, j) of the queries or the keys in it.
WeightRows = tuple[nn.Parameter, torch.Tensor]


def head_major_rows(num_heads: int, d_k: int, offset: int = 0) -> torch.Tensor:
    """Rows ``offset + h*d_k + j`` as [H, d_k]: the head-major layout of a q or k block."""
    return offset + torch.arange(num_heads * d_k, dtype=torch.long).reshape(num_heads, d_k)


def module_names(model: nn.Module) -> dict[int, str]:
    """{id(module): its qualified name in ``model``}."""
    return {id(m): n for n, m in model.named_modules()}


class MixerLayout:
    """One live linear-attention mixer as pruning sees it. A family subclasses it and names the subclass in its
    adapter's ``mixer_layout``; the adapter builds one per mixer (``adapter.layouts()``, ``adapter.layout(mixer)``).

    Everything is read from the live modules when asked, so a layout stays right after its mixer was sliced.
    """

    #: the attribute of the live mixer that holds its key width d_k' (a per-layer-width checkpoint sets it per layer)
    key_dim_attr: ClassVar[str] = "head_k_dim"
    #: attributes of the family's depthwise conv modules that hold their channel count besides ``nn.Conv1d``'s
    #: (``in_channels``, ``out_channels``, ``groups``); slicing sets them with the sliced channels
    conv_channel_attrs: ClassVar[tuple[str, ...]] = ()

    def __init__(self, adapter: Any, layer: int, mixer: nn.Module):  # adapter: its LinearAttentionAdapter
        self.adapter = adapter
        self.layer = layer
        self.mixer = mixer

    @property
    def key_dim(self) -> int:
        """The mixer's key width d_k' (its own: a per-layer-width checkpoint sets it per layer)."""
        return int(getattr(self.mixer, self.key_dim_attr))

    def channel_rows(self) -> list[ChannelRows]:
        """Every module of the mixer that holds key/query channels, with the rows of channel (h, j).

        Projections come first (an ``nn.Linear`` whose output rows include q and/or k channels: fla's separate
        ``q_proj``/``k_proj``, or one fused ``in_proj``), then depthwise convolutions over the same channels.
        Pruning keeps every row that is not a dropped q/k channel, in the original order
        (:func:`statereduce.core.slicing.slice_rows`), so fused layouts stay fused.
        """
        raise NotImplementedError(f"{type(self).__name__}.channel_rows")

    def projection_input(self) -> nn.Module:
        """The module whose forward input is the q/k projection input x [B, T, hidden] (``on_x`` of capture)."""
        raise NotImplementedError(f"{type(self).__name__}.projection_input")

    def output_norm_eps(self) -> list[EpsAttribute]:
        """The eps attributes of the mixer's own output norm (the per-head RMSNorm that removes the kernel scale, and
        any copy the mixer keeps): what a checkpoint whose layers keep different key widths sets per layer, eps times
        d_k/d_k'(layer), instead of the shared config eps (:func:`statereduce.core.slicing.shape_mixers`). The
        default: none (no kernel scale)."""
        return []

    def conv_sharing(self) -> str:
        """How the mixer's q/k short-conv filters are shared ("none" | "head" | "all"); the default: "none"."""
        return "none"

    def qk_convs(self) -> tuple[nn.Conv1d | None, nn.Conv1d | None]:
        """The depthwise short convs of the queries and of the keys when each has one of its own (``[H * d_k, 1, W]``,
        the channel order of the projections), which ``pretrain.share_conv`` can tie; the default: none."""
        return None, None

    # ---- the value side (each head's d_v channels: the rows of its state) ----
    #: the attribute of the live mixer that holds its value width d_v
    value_dim_attr: ClassVar[str] = "head_v_dim"

    @property
    def value_dim(self) -> int:
        """The mixer's value width d_v (per value head)."""
        return int(getattr(self.mixer, self.value_dim_attr))

    def value_channels(self) -> list[ValueChannels]:
        """Every module of the mixer that holds value channels, with the position of channel (h, j) in it: the value
        projection rows and their short conv, the output gate's rows, the output norm's weight and the output
        projection's columns (:func:`statereduce.core.slicing.slice_values` keeps the rest in order)."""
        raise NotImplementedError(f"{type(self).__name__}.value_channels")

    def value_updates(self, d_v_new: int) -> dict[str, int]:
        """The mixer's size attributes after keeping ``d_v_new`` value channels per head (``"sub.attr"`` names an
        attribute of a submodule)."""
        raise NotImplementedError(f"{type(self).__name__}.value_updates")

    def value_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(W_v, W_o, w): copies of the value projection's rows [HV, d_v, hidden] (the first ``"out"`` entry of
        :meth:`value_channels`, its first part where a channel has several), the output projection's columns as rows
        [HV, d_v, hidden] and the output norm's weight [1 or HV, d_v] (None without one)."""
        entries = self.value_channels()
        proj = next(e for e in entries if e.axis == "out" and isinstance(e.module, nn.Linear))
        out = next(e for e in entries if e.axis == "in")
        norm = next((e for e in entries if e.axis == "norm"), None)
        rows = proj.index[..., 0] if proj.index.ndim == 3 else proj.index
        w = proj.module.weight.detach()
        w_v = w[rows.reshape(-1).to(w.device)].reshape(*rows.shape, -1)
        wo = out.module.weight.detach()
        w_o = wo[:, out.index.reshape(-1).to(wo.device)].T.reshape(*out.index.shape, -1)
        w_n = None
        if norm is not None:
            wn = norm.module.weight.detach()
            w_n = wn[norm.index.reshape(-1).to(wn.device)].reshape(norm.index.shape)
        return w_v.clone(), w_o.clone(), None if w_n is None else w_n.clone()

    def shared_value_selection(self) -> bool:
        """Whether the value heads of this mixer must keep the same channels: its output norm's weight has one entry
        per channel that all heads share."""
        return any(e.axis == "norm" and e.index.shape[0] == 1 for e in self.value_channels())

    def qk_weight_rows(self) -> tuple[WeightRows, WeightRows]:
        """((W, rows_q), (W, rows_k)): the projection weight parameters holding the query and the key channels (the
        same parameter for a fused projection) and the rows [H, d_k] of channel (h, j) in each."""
        found: dict[str, WeightRows] = {}
        for entry in self.channel_rows():
            if isinstance(entry.module, nn.Linear):
                for side in ("q", "k"):
                    rows = getattr(entry, side)
                    if rows is not None and side not in found:
                        found[side] = (entry.module.weight, rows)
        if set(found) != {"q", "k"}:
            raise ValueError(f"{type(self).__name__}.channel_rows names no projection of the {set('qk') - set(found)}")
        return found["q"], found["k"]

    def qk_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_q, W_k), each [H * d_k, hidden], copies; head h is rows h*d_k .. (h+1)*d_k."""
        return tuple(w[rows.reshape(-1).to(w.device)] for w, rows in self.qk_weight_rows())


class ExactNorms:
    """What ``norm_eps="exact"`` changes in a model (:mod:`statereduce.stages.prune`, "Kernel scale").

    After pruning, the stock delta-rule kernels scale q.k by 1/sqrt(d_k') instead of 1/sqrt(d_k): the mixer output is
    c = sqrt(d_k/d_k') times that of zero-masking, and its per-head RMSNorm sees it with the config's eps.
    norm_eps="exact" multiplies that eps (shared by every norm the field feeds) by c^2 and makes every other norm's
    input c times larger: the residual stream (the input embedding and every module that adds into it) and the
    projections that feed norms off the residual stream. A family with a kernel scale subclasses this and names the
    subclass in its adapter's ``exact_norms``.
    """

    def __init__(self, adapter: Any):  # adapter: the model's LinearAttentionAdapter
        self.adapter = adapter
        self.model = adapter.model
        self.names = module_names(adapter.model)

    def residual_writers(self) -> list[ScaledRows]:
        """The input embedding and every module whose output is added to the residual stream (each block's mixer or
        attention output projection and its MLP's down projection), weight and bias rows all scaled by c."""
        raise NotImplementedError(f"{type(self).__name__}.residual_writers")

    def norm_input_rows(self) -> list[ScaledRows]:
        """Projection rows (weight and bias) that feed a norm reading the config's eps from something other than the
        residual stream (Qwen3.5's attention q_norm/k_norm read the query and key projections); the default: none."""
        return []

    def config_eps_attributes(self) -> list[EpsAttribute]:
        """Every attribute of a live module that the stock class sets from ``config.<norm_eps_field>`` (the norms'
        eps, and layers that keep a copy of it), so that the model in memory equals the one reloaded."""
        raise NotImplementedError(f"{type(self).__name__}.config_eps_attributes")

    def scaled(self, module: nn.Module, rows: torch.Tensor | None = None) -> ScaledRows:
        return ScaledRows(self.names[id(module)], module, rows)

    def eps(self, module: nn.Module, attr: str = "eps") -> EpsAttribute:
        return EpsAttribute(self.names[id(module)], module, attr)

    def check(self) -> None:
        """Raise a one-line ValueError if ``norm_eps="exact"`` cannot be stored for this model: the spec's
        :meth:`~statereduce.families.base.FamilySpec.exact_norm_eps_refusal`, or input and output embeddings that
        share one weight in memory."""
        adapter = self.adapter
        reason = adapter.exact_norm_eps_refusal(self.model.config)
        inp = self.model.get_input_embeddings()
        out = self.model.get_output_embeddings()
        if reason is None and out is not None and out.weight is inp.weight:
            reason = ("the input and output embeddings share one weight, so scaling the residual stream would scale "
                      "the logits")
        if reason is not None:
            raise ValueError(f"norm_eps='exact' cannot be stored for this {adapter.family} model: {reason}; "
                             f"use norm_eps='stock' (in the workflow: prune: {{norm_eps: stock}})")
