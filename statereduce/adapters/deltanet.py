"""Adapter for fla DeltaNet (``fla/layers/delta_net.py``, ``fla/models/delta_net/``).

Layout: ``key_dim = round(hidden_size * expand_k)``, ``head_k_dim = key_dim // num_heads``;
``q_proj``/``k_proj`` are ``[H*d_k, hidden]`` and ``q_conv1d``/``k_conv1d`` ``[H*d_k, 1, W]``, head h
in rows ``h*d_k + j``. The value side (``v_proj``, ``v_conv1d``, ``b_proj``, ``o_norm``, ``o_proj``) is
untouched by key/query pruning. d_k is global through ``expand_k``: a stock config cannot express per-layer d_k'
(a per-layer-width checkpoint lists them in ``statereduce_key_dims``).

q and k are captured where they enter ``chunk_delta_rule`` / ``fused_recurrent_delta_rule`` (after the
conv and its SiLU, or after the relu/elu/identity activation of non-silu configs; before the in-kernel
L2 norm; with ``qk_norm='sum'`` the L1 sum-norm runs in the layer, so q/k arrive sum-normalised).
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from statereduce.adapters.base import LazyImport, fla_qk_of_call, register_adapter
from statereduce.adapters.fla_layers import FlaAdapter, one_token_call
from statereduce.families.deltanet import DeltaNetFamily

KERNELS = ("chunk_delta_rule", "fused_recurrent_delta_rule")


@register_adapter
class DeltaNetAdapter(DeltaNetFamily, FlaAdapter):
    """fla DeltaNet: ``expand_k`` carries d_k (paper Sec. 3, App. A)."""

    layer_module = "fla.layers.delta_net"
    recurrent_function = "fused_recurrent_delta_rule"
    qk_readers = dict.fromkeys(KERNELS, fla_qk_of_call)  # q, k first or as keywords
    padded_kernels = KERNELS  # statereduce.kernels.shapes: zero-padded at shapes stock fla mishandles
    mixer_class = LazyImport("fla.layers.delta_net:DeltaNet")
    block_class = LazyImport("fla.models.delta_net.modeling_delta_net:DeltaNetBlock")
    @classmethod
    def inplace_recurrent(cls, original, kernel: str, device_types: tuple[str, ...]):
        return _inplace_delta_rule(original, kernel, device_types)

    # ---- fused one-token decode ---------------------------------------------------------------
    @classmethod
    def fused_decode_rows(cls, layer: nn.Module) -> list[str] | None:
        if layer.qk_activation != "silu" or layer.qk_norm not in ("l2", None) or not layer.use_beta:
            return None
        return ["b_proj"]

    @classmethod
    def fused_conv_extra(cls, layer, kernel):
        # beta's sigmoid, computed by the conv launch instead of a kernel of its own (fla's kernels take beta after it)
        return layer.num_heads, "2sigmoid" if layer.allow_neg_eigval else "sigmoid"

    @classmethod
    def fused_conv_l2norm(cls, layer, kernel):
        # fla's function normalises q and k in two launches of their own (l2norm_fwd); the conv launch does it for
        # heads of a power-of-two width (pruned widths that are not keep fla's path)
        dk = layer.head_k_dim
        return dk if layer.qk_norm == "l2" and dk & (dk - 1) == 0 else None

    @classmethod
    def fused_recurrent_step(cls, layer, kernel, q, k, v, tail, state, extra=None):
        from statereduce.kernels.recurrent import recurrent_step

        beta, l2 = tail[..., :layer.num_heads], layer.qk_norm == "l2"
        if kernel == "statereduce":  # L2 norms (rounded as fla's DeltaNet does) and beta's sigmoid in the kernel
            return recurrent_step(q, k, v, beta, state, l2norm=l2, round_qk=l2, beta_sigmoid=True,
                                  allow_neg_eigval=layer.allow_neg_eigval)
        # fla's function as inplace_decode routes it: q, k, v contiguous, beta through its sigmoid and (where
        # fused_conv_l2norm says so) q and k L2-normalised, all written by the conv launch
        step = importlib.import_module("fla.layers.delta_net").fused_recurrent_delta_rule
        o, _ = step(q=q, k=k, v=v, beta=extra, initial_state=state, output_final_state=True,
                    use_qk_l2norm_in_kernel=l2 and cls.fused_conv_l2norm(layer, kernel) is None)
        return o


def _inplace_delta_rule(original, kernel: str, device_types: tuple[str, ...]):
    """fla's one-token recurrent function, routed to ``kernel``'s in-place step (speed.inplace)."""
    from statereduce.kernels.recurrent import fla_delta_rule_step, recurrent_step

    def fused_recurrent_delta_rule(q, k, v, beta=None, scale=None, initial_state=None, output_final_state=False,
                                   use_qk_l2norm_in_kernel=False, cu_seqlens=None):
        if not one_token_call(q, initial_state, cu_seqlens, device_types):
            return original(q, k, v, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                            cu_seqlens)
        if kernel == "fla_copy":
            o, final = original(q, k, v, beta, scale, initial_state, True, use_qk_l2norm_in_kernel, cu_seqlens)
            initial_state.copy_(final)
            return o, (initial_state if output_final_state else None)
        if beta is None:
            beta = torch.ones_like(q[..., 0])
        if kernel == "fla":
            o = fla_delta_rule_step(q, k, v, beta, initial_state, scale=scale, l2norm=use_qk_l2norm_in_kernel)
        else:
            o = recurrent_step(q, k, v, beta, initial_state, scale=scale, l2norm=use_qk_l2norm_in_kernel,
                               round_qk=True)
        return o, (initial_state if output_final_state else None)

    return fused_recurrent_delta_rule
