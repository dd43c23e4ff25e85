"""Adapter for transformers' Mamba-2 (``transformers/models/mamba2``; paper App. C.3, Tables 3 and 8-10).

In Mamba-2 the input-dependent B and C play the roles of keys and queries: the state of head i is
``S_t = exp(dt A) S_{t-1} + dt x_t B_t^T`` ([head_dim, N]) and the readout is ``y_t = S_t C_t``. B and C are shared
per group: the ``num_heads`` heads fall into ``n_groups`` groups of ``num_heads / n_groups``, each reading its
group's B and C. So the groups are the q/k heads here (H = n_groups), the Mamba heads are the value heads
(HV = num_heads, d_v = head_dim) and d_k = ``state_size`` (N); one selection per group serves all its heads,
and every group keeps the same N' (``state_size`` is global).

Layout (I = expand * hidden_size = num_heads * head_dim, G = n_groups):

- ``in_proj.weight`` ``[2I + 2GN + num_heads, hidden]``, split ``[z (I) | x (I) | B (GN) | C (GN) | dt]``: B of group g,
  channel n is row ``2I + g*N + n``, C is row ``2I + GN + g*N + n`` (``in_proj.bias`` too when ``use_bias``);
- ``conv1d`` ``[I + 2GN, 1, W]`` with a bias (``use_conv_bias``, the default) over ``[x | B | C]``: conv channel =
  in_proj row - I. Its module forward never runs (the weight is used functionally).

Pruning keeps the other rows in place and sets ``state_size = N'``; ``A_log``, ``D``, ``dt_bias``, the gated norm
(group size I/G, independent of N) and ``out_proj`` are untouched. The scan has no scale and no normalisation
of B and C, so the pruned model equals the original with the dropped B/C channels zeroed (conv weight and bias).

Capture: q = C and k = B ``[b, T, G, N]`` where they enter ``mamba2_chunk_scan`` (prefill; post conv + SiLU) or
``mamba2_selective_state_update`` (one-token decode, ``[b, G, N]``, returned as T = 1). With ``model.train()`` and
no cache the layer first tries the fused ``mamba2_split_conv1d_scan_combined`` kernel (mamba_ssm, GPU), which
bypasses both: calibration and Grad scores run the model in ``eval()``.

RFT trains ``in_proj`` (LoRA), ``conv1d`` and the norms; ``out_proj`` stays frozen (``Mamba2Family.rft_targets``).

Loading: fla registers its own ``mamba2`` model with the Auto classes once imported, so checkpoints load through
transformers' ``Mamba2ForCausalLM`` explicitly (:attr:`causal_lm_class`). Its forward takes a cache as
``cache=`` and silently ignores ``past_key_values=`` (:attr:`cache_argument`).
"""

from __future__ import annotations

import torch
from torch import nn

from statereduce.adapters.base import LazyImport, TransformersAdapter, decoder_layers, register_adapter
from statereduce.adapters.mixer_layout import (
    ChannelRows, EpsAttribute, ExactNorms, MixerLayout, ScaledRows, ValueChannels, head_major_rows, module_names,
)
from statereduce.families.mamba2 import Mamba2Family

LAYER_MODULE = "transformers.models.mamba2.modeling_mamba2"
CHUNK, STEP = "mamba2_chunk_scan", "mamba2_selective_state_update"


def _scan_qk(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(C, B) [b, T, G, N] of a ``mamba2_chunk_scan(hidden_states, dt, A, B, C, ...)`` call."""
    b = kwargs["B"] if "B" in kwargs else args[3]
    c = kwargs["C"] if "C" in kwargs else args[4]
    return c, b


def _step_qk(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(C, B) [b, 1, G, N] of a ``mamba2_selective_state_update(state, hidden_states, dt, A, B, C, ...)`` call."""
    b = kwargs["B"] if "B" in kwargs else args[4]
    c = kwargs["C"] if "C" in kwargs else args[5]
    return c.unsqueeze(1), b.unsqueeze(1)


def _scan_v(args: tuple, kwargs: dict) -> torch.Tensor:
    """x [b, T, num_heads, head_dim] of a ``mamba2_chunk_scan(hidden_states, ...)`` call (the values)."""
    return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


def _step_v(args: tuple, kwargs: dict) -> torch.Tensor:
    """x [b, 1, num_heads, head_dim] of a ``mamba2_selective_state_update(state, hidden_states, ...)`` call."""
    return (kwargs["hidden_states"] if "hidden_states" in kwargs else args[1]).unsqueeze(1)


class Mamba2Layout(MixerLayout):
    """A Mamba-2 mixer: B (keys) and C (queries) of each group in the fused ``in_proj`` and the ``conv1d`` over
    ``[x | B | C]``."""

    key_dim_attr = "ssm_state_size"  # N of the layer's B/C groups

    def channel_rows(self) -> list[ChannelRows]:
        mixer = self.mixer
        i, g, n = mixer.intermediate_size, mixer.n_groups, mixer.ssm_state_size
        b_rows, c_rows = head_major_rows(g, n, offset=i), head_major_rows(g, n, offset=i + g * n)  # in [x | B | C]
        return [ChannelRows("in_proj", mixer.in_proj, q=c_rows + i, k=b_rows + i),
                ChannelRows("conv1d", mixer.conv1d, q=c_rows, k=b_rows)]

    def projection_input(self) -> nn.Module:
        return self.mixer.in_proj

    value_dim_attr = "head_dim"

    def value_channels(self) -> list[ValueChannels]:
        """Per Mamba head (``[num_heads, head_dim]``, head-major): the x rows (``[I, 2I)``, the values) and z rows (the
        gate, ``[0, I)``) of ``in_proj``, the x channels of ``conv1d`` (``[0, I)``, weight and bias), the gated norm's weight (one
        entry per channel) and the ``out_proj`` columns."""
        mixer = self.mixer
        rows = head_major_rows(mixer.num_heads, mixer.head_dim)
        return [ValueChannels("in_proj", mixer.in_proj, torch.stack([rows + mixer.intermediate_size, rows], -1),
                               "out"),
                ValueChannels("conv1d", mixer.conv1d, rows, "out"),
                ValueChannels("norm", mixer.norm, rows, "norm"),
                ValueChannels("out_proj", mixer.out_proj, rows, "in")]

    def output_norm_eps(self) -> list[EpsAttribute]:
        """``variance_epsilon`` of the gated ``norm`` and the mixer's copy (``layer_norm_epsilon``): set per layer when
        the layers keep different value widths (the norm averages over each layer's own d_v'); B/C pruning has no
        kernel scale and leaves them."""
        names = module_names(self.adapter.model)
        return [EpsAttribute(names[id(self.mixer.norm)], self.mixer.norm, "variance_epsilon"),
                EpsAttribute(names[id(self.mixer)], self.mixer, "layer_norm_epsilon")]

    def value_updates(self, d_v_new: int) -> dict[str, int]:
        mixer = self.mixer
        inner = mixer.num_heads * int(d_v_new)
        return {"head_dim": int(d_v_new), "intermediate_size": inner,
                "conv_dim": inner + 2 * mixer.n_groups * mixer.ssm_state_size, "norm.group_size": inner // mixer.n_groups}


class Mamba2Norms(ExactNorms):
    """What keeping fewer value channels with ``norm_eps="exact"`` changes in Mamba-2: ``layer_norm_epsilon`` feeds
    the blocks' norms, each mixer's gated norm and the final norm (B/C pruning has no kernel scale and changes
    none of them)."""

    def residual_writers(self) -> list[ScaledRows]:
        """``embeddings`` and each block's ``mixer.out_proj`` (a Mamba-2 block is ``h + mixer(norm(h))``)."""
        modules = [self.model.get_input_embeddings()]
        modules += [block.mixer.out_proj for block in decoder_layers(self.model)]
        return [self.scaled(m) for m in modules]

    def config_eps_attributes(self) -> list[EpsAttribute]:
        """``variance_epsilon`` of each block's ``norm``, each mixer's gated ``norm`` and the final ``norm_f``, and the
        copy each mixer keeps (``layer_norm_epsilon``)."""
        out = []
        for block in decoder_layers(self.model):
            out += [self.eps(block.norm, "variance_epsilon"), self.eps(block.mixer.norm, "variance_epsilon"),
                    self.eps(block.mixer, "layer_norm_epsilon")]
        out.append(self.eps(self.model.get_decoder().norm_f, "variance_epsilon"))
        return out


@register_adapter
class Mamba2Adapter(Mamba2Family, TransformersAdapter):
    """transformers Mamba-2: ``state_size`` carries d_k (N), one B/C selection per group (paper App. C.3)."""

    causal_lm_class = LazyImport("transformers:Mamba2ForCausalLM")
    layer_module = LAYER_MODULE
    qk_readers = {CHUNK: _scan_qk, STEP: _step_qk}
    v_readers = {CHUNK: _scan_v, STEP: _step_v}
    cache_state_v_first = True  # the cache holds [B, num_heads, head_dim, N]
    mixer_layout = Mamba2Layout
    exact_norms = Mamba2Norms

    def mixer_layers(self) -> list[tuple[int, nn.Module]]:
        return [(i, block.mixer) for i, block in enumerate(decoder_layers(self.model))]
