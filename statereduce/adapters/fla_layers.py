"""What the adapters of fla's linear-attention families (DeltaNet, Gated DeltaNet) share.

fla's layers keep the queries and keys in separate projections ``q_proj``/``k_proj`` ``[H*d_k, hidden]`` and, with
``use_short_conv``, depthwise convolutions ``q_conv1d``/``k_conv1d`` ``[H*d_k, 1, W]``, head h in rows ``h*d_k + j``
(:class:`FlaMixerLayout`). Each decoder block (``DeltaNetBlock`` / ``GatedDeltaNetBlock``) computes ``h + attn(
attn_norm(h))`` then ``h + mlp(mlp_norm(h))``, and the mixer's output goes through its per-head ``o_norm``
(:class:`FlaNorms`). Mixers are found as ``block.attn`` of the family's ``mixer_class`` (softmax-attention layers of
fla hybrids are skipped); q and k are captured where they enter the layer module's kernel functions.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from statereduce.adapters.base import LinearAttentionAdapter, decoder_layers
from statereduce.adapters.conv_sharing import conv_sharing
from statereduce.adapters.mixer_layout import (
    ChannelRows, EpsAttribute, ExactNorms, MixerLayout, ScaledRows, ValueChannels, head_major_rows, module_names,
)
from statereduce.kernels import shapes


class FlaMixerLayout(MixerLayout):
    """An fla DeltaNet / GatedDeltaNet layer: separate q/k projections, then (``use_short_conv``) their convs."""

    conv_channel_attrs = ("hidden_size",)  # fla's ShortConvolution keeps its channel count there too

    def channel_rows(self) -> list[ChannelRows]:
        mixer = self.mixer
        rows = head_major_rows(self.adapter.num_heads, self.key_dim)
        out = [ChannelRows("q_proj", mixer.q_proj, rows, None), ChannelRows("k_proj", mixer.k_proj, None, rows)]
        if mixer.use_short_conv:
            out += [ChannelRows("q_conv1d", mixer.q_conv1d, rows, None),
                    ChannelRows("k_conv1d", mixer.k_conv1d, None, rows)]
        return out

    def projection_input(self) -> nn.Module:
        return self.mixer.q_proj

    def output_norm_eps(self) -> list[EpsAttribute]:
        """``eps`` of the mixer's ``o_norm``."""
        return [EpsAttribute(module_names(self.adapter.model)[id(self.mixer.o_norm)], self.mixer.o_norm, "eps")]

    def value_channels(self) -> list[ValueChannels]:
        """``v_proj`` rows and ``v_conv1d`` channels (``[HV*d_v]``, head-major), ``g_proj`` rows (the output gate, with
        ``use_gate``), ``o_norm.weight`` (``[d_v]``, shared by the heads) and ``o_proj`` columns."""
        mixer = self.mixer
        hv = mixer.value_dim // self.value_dim
        rows = head_major_rows(hv, self.value_dim)
        out = [ValueChannels("v_proj", mixer.v_proj, rows, "out")]
        if mixer.use_short_conv:
            out.append(ValueChannels("v_conv1d", mixer.v_conv1d, rows, "out"))
        if getattr(mixer, "use_gate", False):
            out.append(ValueChannels("g_proj", mixer.g_proj, rows, "out"))
        out += [ValueChannels("o_norm", mixer.o_norm, rows[:1] - rows[0, 0], "norm"),
                ValueChannels("o_proj", mixer.o_proj, rows, "in")]
        return out

    def value_updates(self, d_v_new: int) -> dict[str, int | float]:
        hv = self.mixer.value_dim // self.value_dim
        return {"head_v_dim": int(d_v_new), "value_dim": hv * int(d_v_new), "o_norm.hidden_size": int(d_v_new),
                "expand_v": self.adapter.mixer_expand_v(self.mixer, hv * int(d_v_new))}

    def qk_convs(self) -> tuple[nn.Conv1d | None, nn.Conv1d | None]:
        return (self.mixer.q_conv1d, self.mixer.k_conv1d) if self.mixer.use_short_conv else (None, None)

    def conv_sharing(self) -> str:
        """How ``q_conv1d`` / ``k_conv1d`` filters are shared: "head" (equal within each head), "all" (equal across
        the layer) or "none" (paper App. B.5, Table 14; :mod:`statereduce.adapters.conv_sharing`)."""
        return conv_sharing(self.mixer, self.adapter.num_heads, self.key_dim)


class FlaNorms(ExactNorms):
    """``norm_eps="exact"`` in an fla model: the blocks' residual writers and every norm's ``eps``."""

    def residual_writers(self) -> list[ScaledRows]:
        """``embeddings``; per block the mixer's ``o_proj`` (or, in an fla hybrid's softmax layer, ``Attention.o_proj``)
        and the ``GatedMLP``'s ``down_proj``; none of them has a bias in fla 0.6."""
        modules = [self.model.get_input_embeddings()]
        for block in decoder_layers(self.model):
            modules += [block.attn.o_proj, block.mlp.down_proj]
        return [self.scaled(m) for m in modules]

    def config_eps_attributes(self) -> list[EpsAttribute]:
        """``eps`` of each block's ``attn_norm`` and ``mlp_norm``, of each linear-attention mixer's ``o_norm`` (fla's
        ``RMSNorm`` / ``FusedRMSNormGated``) and of the final ``norm`` (fla's or torch's ``RMSNorm`` by
        ``fuse_norm``). fla's softmax ``Attention`` takes no eps from the config."""
        mixers = {id(m) for _, m in self.adapter.mixer_layers()}
        modules = []
        for block in decoder_layers(self.model):
            modules += [block.attn_norm, block.mlp_norm] + ([block.attn.o_norm] if id(block.attn) in mixers else [])
        modules.append(self.model.get_decoder().norm)
        return [self.eps(m) for m in modules]


class FlaAdapter(LinearAttentionAdapter):
    """The adapter part every fla linear-attention family shares: its layout, its norms, its mixers, and the shape
    guard on its kernels."""

    mixer_layout = FlaMixerLayout
    exact_norms = FlaNorms
    #: the family's fla layer class (a LazyImport): ``block.attn`` of this class is a linear-attention mixer
    mixer_class: ClassVar[Any] = None

    @classmethod
    def mixer_expand_v(cls, mixer: nn.Module, value_dim: int) -> float:
        """The mixer's ``expand_v`` after a value cut to ``value_dim`` channels: the value the family's config field
        takes for that width (:meth:`value_config_updates`), so that the layer equals the one fla builds from it."""
        raise NotImplementedError(f"{cls.__name__}.mixer_expand_v")

    @classmethod
    def install_fallbacks(cls, torch_device_types: tuple[str, ...] = ("cpu",)) -> None:
        """The torch fallbacks (base class), then the shape guard on the layer module's kernels
        (:data:`padded_kernels`): CUDA calls at a head shape stock fla mishandles go through a zero-padded call."""
        super().install_fallbacks(torch_device_types)

        shapes.install(cls.layer_module, cls.padded_kernels)

    def mixer_layers(self) -> list[tuple[int, nn.Module]]:
        mixer = self.mixer_class
        return [(i, block.attn) for i, block in enumerate(decoder_layers(self.model)) if isinstance(block.attn, mixer)]
