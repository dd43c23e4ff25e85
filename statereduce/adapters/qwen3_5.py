"""Adapter for the Qwen3.5 hybrid (transformers ``qwen3_5``, text model; paper Sec. 5, App. C.4, Tables 4, 12, 13).

Qwen3.5 interleaves Gated DeltaNet layers (``Qwen3_5GatedDeltaNet``, ``linear_attn`` of a decoder layer) with
softmax-attention layers (``self_attn``; ``layer_types``, by default every fourth layer). Only the Gated DeltaNet
layers are pruned and fine-tuned (``rft.scope: auto`` is ``recurrent`` here: ``Qwen35Family.rft_targets``);
the attention layers, MLPs, embeddings and norms outside the mixers never change
(apart from the scaling of ``norm_eps="exact"``, below).

Layout of a Gated DeltaNet layer (Hk = ``linear_num_key_heads``, HV = ``linear_num_value_heads``, d_k =
``linear_key_head_dim``, d_v = ``linear_value_head_dim``):

- ``in_proj_qkv.weight`` ``[2 Hk d_k + HV d_v, hidden]``: query head h channel j is row ``h*d_k + j``, key head h
  is row ``Hk*d_k + h*d_k + j``, the values start at ``2 Hk d_k``;
- ``conv1d`` ``[same, 1, W]``, the same channel order, no bias (its module forward never runs);
- untouched: ``in_proj_z`` ``[HV d_v]``, ``in_proj_a``/``in_proj_b``/``A_log``/``dt_bias`` ``[HV]``, ``norm``
  ``[d_v]``, ``out_proj``. Under GVA (HV = r Hk) value head i reads key head ``i // r``: one key head's selection
  serves its r value heads.

Pruning sets ``linear_key_head_dim = d_k'``. Kernel scale: the stock kernels use ``1/sqrt(d_k')`` after pruning;
the output goes through the per-head ``norm`` (``Qwen3_5RMSNormGated``), so the pruned model equals zeroing the
dropped channels exactly when that norm's ``variance_epsilon`` is multiplied by d_k/d_k' (as for Gated DeltaNet,
:mod:`statereduce.stages.prune`). ``rms_norm_eps`` feeds every norm of the text model, so ``norm_eps="exact"``
multiplies it by d_k/d_k' and scales by sqrt(d_k/d_k') the residual stream (``embed_tokens``, each ``out_proj`` /
``o_proj`` and ``down_proj``) and the query rows of the attention layers' ``q_proj`` and their ``k_proj``, which feed
``q_norm``/``k_norm`` (:meth:`Qwen35Norms.residual_writers`, :meth:`Qwen35Norms.norm_input_rows`); with the
default ``"stock"`` everything outside the Gated DeltaNet layers' q/k rows stays as it was.

Capture: q and k ``[B, T, Hk, d_k]`` where they enter ``torch_chunk_gated_delta_rule`` /
``torch_recurrent_gated_delta_rule`` (the module globals the layer calls): post conv + SiLU, before the in-kernel
L2 norm and before the GVA repeat. The names stay ``torch_*`` whichever implementation transformers bound to them.

CPU: with fla installed, transformers binds fla's Triton ``chunk_gated_delta_rule`` to those globals at import
time, which fails on CPU; :meth:`install_fallbacks` rebinds them to dispatchers that send tensors on the given
device types to transformers' own PyTorch implementation. Hub checkpoints of the vision-language ``qwen3_5``
model load through ``AutoModelForCausalLM`` as the text model ``Qwen3_5ForCausalLM`` (``mtp.*`` weights dropped).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

import torch
from torch import nn

from statereduce.adapters.base import TransformersAdapter, decoder_layers, register_adapter
from statereduce.adapters.mixer_layout import (
    ChannelRows, EpsAttribute, ExactNorms, MixerLayout, ScaledRows, ValueChannels, head_major_rows, module_names,
)
from statereduce.families.qwen3_5 import Qwen35Family, text_config

LAYER_MODULE = "transformers.models.qwen3_5.modeling_qwen3_5"
KERNELS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
def _qk_of_call(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    q = kwargs["query"] if "query" in kwargs else args[0]
    k = kwargs["key"] if "key" in kwargs else args[1]
    return q, k


def _v_of_call(args: tuple, kwargs: dict) -> torch.Tensor:
    return kwargs["value"] if "value" in kwargs else args[2]


def _device_dispatch(stock: Callable, reference: Callable, device_types: tuple[str, ...]) -> Callable:
    """``stock`` (whatever transformers bound), except for queries on ``device_types``: ``reference`` (its PyTorch
    implementation)."""

    @functools.wraps(stock)
    def dispatch(query, *args, **kwargs):
        fn = reference if query.device.type in device_types else stock
        return fn(query, *args, **kwargs)

    dispatch._statereduce_stock = stock
    return dispatch


class Qwen35Layout(MixerLayout):
    """A Qwen3.5 Gated DeltaNet layer: queries then keys in the fused ``in_proj_qkv`` and the same rows of ``conv1d``."""

    def channel_rows(self) -> list[ChannelRows]:
        mixer = self.mixer
        h, d_k = mixer.num_k_heads, mixer.head_k_dim
        q, k = head_major_rows(h, d_k), head_major_rows(h, d_k, offset=h * d_k)
        return [ChannelRows("in_proj_qkv", mixer.in_proj_qkv, q=q, k=k), ChannelRows("conv1d", mixer.conv1d, q=q, k=k)]

    def projection_input(self) -> nn.Module:
        return self.mixer.in_proj_qkv

    def value_channels(self) -> list[ValueChannels]:
        """The value rows of ``in_proj_qkv`` and ``conv1d`` (after the queries and keys), ``in_proj_z`` rows (the
        output gate), ``norm.weight`` (``[d_v]``, shared by the value heads) and ``out_proj`` columns."""
        mixer = self.mixer
        rows = head_major_rows(mixer.num_v_heads, mixer.head_v_dim)
        offset = 2 * mixer.num_k_heads * mixer.head_k_dim
        return [ValueChannels("in_proj_qkv", mixer.in_proj_qkv, rows + offset, "out"),
                ValueChannels("conv1d", mixer.conv1d, rows + offset, "out"),
                ValueChannels("in_proj_z", mixer.in_proj_z, rows, "out"),
                ValueChannels("norm", mixer.norm, rows[:1], "norm"),
                ValueChannels("out_proj", mixer.out_proj, rows, "in")]

    def value_updates(self, d_v_new: int) -> dict[str, int]:
        mixer = self.mixer
        value_dim = mixer.num_v_heads * int(d_v_new)
        return {"head_v_dim": int(d_v_new), "value_dim": value_dim, "conv_dim": 2 * mixer.key_dim + value_dim}

    def output_norm_eps(self) -> list[EpsAttribute]:
        """``variance_epsilon`` of the Gated DeltaNet's ``norm`` and the layer's copy (``layer_norm_epsilon``)."""
        names = module_names(self.adapter.model)
        return [EpsAttribute(names[id(self.mixer.norm)], self.mixer.norm, "variance_epsilon"),
                EpsAttribute(names[id(self.mixer)], self.mixer, "layer_norm_epsilon")]


class Qwen35Norms(ExactNorms):
    """``norm_eps="exact"`` in Qwen3.5: ``rms_norm_eps`` feeds every norm of the text model."""

    def residual_writers(self) -> list[ScaledRows]:
        """``embed_tokens``; per decoder layer (``h + mixer(input_layernorm(h))`` then ``h +
        mlp(post_attention_layernorm(h))``) the Gated DeltaNet's ``out_proj`` or the attention's ``o_proj`` (with its
        bias under ``attention_bias``) and the MLP's ``down_proj``."""
        modules = [self.model.get_input_embeddings()]
        for layer in decoder_layers(self.model):
            mixer = layer.linear_attn.out_proj if hasattr(layer, "linear_attn") else layer.self_attn.o_proj
            modules += [mixer, layer.mlp.down_proj]
        return [self.scaled(m) for m in modules]

    def norm_input_rows(self) -> list[ScaledRows]:
        """The attention layers' ``q_norm`` and ``k_norm`` read the query and key projections of the normalised
        hidden state: the query rows of ``q_proj`` (per head ``[query (head_dim) | output gate (head_dim)]``; the gate
        rows stay) and all of ``k_proj``."""
        out = []
        for layer in decoder_layers(self.model):
            attn = getattr(layer, "self_attn", None)
            if attn is None:
                continue
            d = attn.head_dim
            heads = attn.q_proj.out_features // (2 * d)
            query = (torch.arange(heads)[:, None] * 2 * d + torch.arange(d)).reshape(-1)
            out += [self.scaled(attn.q_proj, query), self.scaled(attn.k_proj)]
        return out

    def config_eps_attributes(self) -> list[EpsAttribute]:
        """``eps`` of every ``Qwen3_5RMSNorm`` (each layer's ``input_layernorm`` and ``post_attention_layernorm``, the
        attention layers' ``q_norm`` and ``k_norm``, the final ``norm``), ``variance_epsilon`` of each Gated DeltaNet's
        ``norm`` (``Qwen3_5RMSNormGated``) and the copy the Gated DeltaNet layer keeps (``layer_norm_epsilon``)."""
        out = []
        for layer in decoder_layers(self.model):
            out += [self.eps(layer.input_layernorm), self.eps(layer.post_attention_layernorm)]
            if hasattr(layer, "linear_attn"):
                out += [self.eps(layer.linear_attn.norm, "variance_epsilon"),
                        self.eps(layer.linear_attn, "layer_norm_epsilon")]
            else:
                out += [self.eps(layer.self_attn.q_norm), self.eps(layer.self_attn.k_norm)]
        out.append(self.eps(self.model.get_decoder().norm))
        return out


@register_adapter
class Qwen35Adapter(Qwen35Family, TransformersAdapter):
    """Qwen3.5: ``linear_key_head_dim`` carries d_k of the Gated DeltaNet layers; attention layers stay."""

    layer_module = LAYER_MODULE
    # statereduce.kernels.check: compared on CUDA with fla_fallback's (transformers binds fla's kernels here when fla
    # is installed, its own PyTorch versions otherwise)
    checked_kernels = dict(zip(KERNELS, ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule")))
    qk_readers = dict.fromkeys(KERNELS, _qk_of_call)
    v_readers = dict.fromkeys(KERNELS, _v_of_call)
    mixer_layout = Qwen35Layout
    exact_norms = Qwen35Norms

    @property
    def config(self):
        return text_config(self.model.config)

    def mixer_layers(self) -> list[tuple[int, nn.Module]]:
        return [(i, layer.linear_attn) for i, layer in enumerate(decoder_layers(self.model))
                if hasattr(layer, "linear_attn")]

    @classmethod
    def install_fallbacks(cls, torch_device_types: tuple[str, ...] = ("cpu",)) -> None:
        super().install_fallbacks(torch_device_types)
        module = importlib.import_module(LAYER_MODULE)
        for name in KERNELS:
            bound = getattr(module, name)
            stock = getattr(bound, "_statereduce_stock", bound)
            reference = getattr(stock, "__wrapped__", stock)  # transformers' own torch implementation
            setattr(module, name, _device_dispatch(stock, reference, tuple(torch_device_types)))
