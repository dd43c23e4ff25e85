"""Adapter for fla DeltaNet (``fla/layers/delta_net.py``, ``fla/models/delta_net/``).

Layout: ``key_dim = round(hidden_size * expand_k)``, ``head_k_dim = key_dim // num_heads``;
``q_proj``/``k_proj`` are ``[H*d_k, hidden]`` and ``q_conv1d``/``k_conv1d`` ``[H*d_k, 1, W]``, head h
in rows ``h*d_k + j``. The value side (``v_proj``, ``v_conv1d``, ``b_proj``, ``o_norm``, ``o_proj``) is
untouched by key/query pruning. d_k is global through ``expand_k``: per-layer d_k' is not expressible.

q and k are captured where they enter ``chunk_delta_rule`` / ``fused_recurrent_delta_rule`` (after the
conv and its SiLU, or after the relu/elu/identity activation of non-silu configs; before the in-kernel
L2 norm; with ``qk_norm='sum'`` the L1 sum-norm runs in the layer, so q/k arrive sum-normalised).
"""

from __future__ import annotations

import importlib
from typing import Any, ClassVar

import torch
from torch import nn

from statereduce.adapters.base import Dims, LazyImport, StateShape, fla_qk_of_call, register_adapter
from statereduce.adapters.fla_layers import FlaAdapter, one_token_call

KERNELS = ("chunk_delta_rule", "fused_recurrent_delta_rule")


@register_adapter
class DeltaNetAdapter(FlaAdapter):
    """fla DeltaNet: ``expand_k`` carries d_k (paper Sec. 3, App. A)."""

    family = "delta_net"
    model_types = ("delta_net",)
    config_class = LazyImport("fla.models:DeltaNetConfig")
    layer_module = "fla.layers.delta_net"
    recurrent_function = "fused_recurrent_delta_rule"
    qk_readers = dict.fromkeys(KERNELS, fla_qk_of_call)  # q, k first or as keywords
    padded_kernels = KERNELS  # statereduce.kernels.shapes: zero-padded at shapes stock fla mishandles
    mixer_class = LazyImport("fla.layers.delta_net:DeltaNet")
    block_class = LazyImport("fla.models.delta_net.modeling_delta_net:DeltaNetBlock")
    # fla 0.6 DeltaNetConfig.__init__ keywords and defaults (pinned by tests/test_config.py)
    # fmt: off
    config_defaults: ClassVar[dict[str, Any]] = {
        "attn_mode": "chunk", "hidden_size": 2048, "expand_k": 1.0, "expand_v": 1.0, "use_gate": False,
        "use_short_conv": True, "allow_neg_eigval": False, "conv_size": 4, "use_beta": True, "use_output_norm": True,
        "num_heads": 16, "qk_norm": "l2", "qk_activation": "silu", "max_position_embeddings": 2048, "hidden_ratio": 4,
        "intermediate_size": None, "hidden_act": "swish", "num_hidden_layers": 24, "norm_eps": 1e-06, "attn": None,
        "use_cache": True, "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
        "initializer_range": 0.02, "fuse_norm": True, "fuse_swiglu": True, "fuse_cross_entropy": True,
        "fuse_linear_cross_entropy": False, "use_l2warp": False, "vocab_size": 32000, "attnres_block_size": None,
    }
    # fmt: on

    @classmethod
    def dims(cls, config) -> Dims:
        key_dim, value_dim = round(config.hidden_size * config.expand_k), round(config.hidden_size * config.expand_v)
        h = config.num_heads
        return Dims(num_heads=h, num_v_heads=h, head_k_dim=key_dim // h, head_v_dim=value_dim // h)

    @classmethod
    def config_updates(cls, config, d_k_new: int) -> dict[str, Any]:
        """``expand_k = H * d_k' / hidden_size``, checked to give back exactly ``H * d_k'``."""
        d = cls.dims(config)
        cls.check_reduction(d.head_k_dim, d.head_v_dim, d_k_new)
        d_k_new = int(d_k_new)
        key_dim = config.num_heads * d_k_new
        expand_k = key_dim / config.hidden_size
        if int(config.hidden_size * expand_k) != key_dim:
            raise ValueError(
                f"DeltaNet cannot express d_k'={d_k_new}: expand_k={expand_k!r} gives "
                f"int(hidden_size={config.hidden_size} * expand_k)={int(config.hidden_size * expand_k)} "
                f"!= num_heads * d_k' = {key_dim}"
            )
        return {"expand_k": expand_k}

    @classmethod
    def mixer_updates(cls, config, d_k_new: int) -> dict[str, Any]:
        expand_k = cls.config_updates(config, d_k_new)["expand_k"]
        return {"expand_k": expand_k, "key_dim": config.num_heads * int(d_k_new), "head_k_dim": int(d_k_new)}

    @classmethod
    def config_state_shape(cls, config) -> StateShape:
        h, _, d_k, d_v = cls.dims(config)
        conv_channels = h * (2 * d_k + d_v) if config.use_short_conv else 0
        return StateShape(num_heads=h, d_k=d_k, d_v=d_v, conv_channels=conv_channels, conv_width=config.conv_size)

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
