"""Adapter for fla Gated DeltaNet (``fla/layers/gated_deltanet.py``, ``fla/models/gated_deltanet/``).

Layout: ``head_k_dim = head_dim``, ``head_v_dim = int(head_dim * expand_v)``;
``q_proj``/``k_proj`` are ``[H*d_k, hidden]`` and ``q_conv1d``/``k_conv1d`` ``[H*d_k, 1, W]``, head h in
rows ``h*d_k + j``. Everything per value head (``v_proj``, ``g_proj``, ``a_proj``, ``b_proj``, ``A_log``,
``dt_bias``, ``o_norm``, ``o_proj``) is untouched. Under GVA (``num_v_heads = r * num_heads``) value
head i reads key head ``i // r``, so one key head's selection serves r value heads.

Because the value size is derived from ``head_dim``, pruning sets ``head_dim = d_k'`` and
``expand_v = d_v / d_k'`` together; changing ``head_dim`` alone would silently shrink the values.

Capture: without a cache the layer fuses the q/k/v short convs into one ``causal_conv1d`` call, so
conv-module hooks never fire; q and k are taken where they enter ``chunk_gated_delta_rule`` /
``fused_recurrent_gated_delta_rule`` (post conv + SiLU, before the in-kernel L2 norm, before the GVA
head mapping), which covers the fused and the cached paths alike.
"""

from __future__ import annotations

import importlib
from typing import Any, ClassVar

from torch import nn

from statereduce.adapters.base import Dims, LazyImport, StateShape, fla_qk_of_call, register_adapter
from statereduce.adapters.fla_layers import FlaAdapter, one_token_call

KERNELS = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule")


@register_adapter
class GatedDeltaNetAdapter(FlaAdapter):
    """fla Gated DeltaNet: ``head_dim`` carries d_k, ``expand_v`` keeps d_v (paper Sec. 3, App. A)."""

    family = "gated_deltanet"
    cache_state_v_first = True  # fla's GatedDeltaNet calls its kernels with state_v_first=True
    fla_gated_backward = True
    model_types = ("gated_deltanet",)
    config_class = LazyImport("fla.models:GatedDeltaNetConfig")
    layer_module = "fla.layers.gated_deltanet"
    recurrent_function = "fused_recurrent_gated_delta_rule"
    qk_readers = dict.fromkeys(KERNELS, fla_qk_of_call)  # q, k first or as keywords
    padded_kernels = KERNELS  # statereduce.kernels.shapes: zero-padded at shapes stock fla mishandles
    mixer_class = LazyImport("fla.layers.gated_deltanet:GatedDeltaNet")
    block_class = LazyImport("fla.models.gated_deltanet.modeling_gated_deltanet:GatedDeltaNetBlock")
    # fla 0.6 GatedDeltaNetConfig.__init__ keywords and defaults (pinned by tests/test_config.py)
    # fmt: off
    config_defaults: ClassVar[dict[str, Any]] = {
        "attn_mode": "chunk", "hidden_size": 2048, "expand_v": 2.0, "use_gate": True, "use_short_conv": True,
        "allow_neg_eigval": False, "conv_size": 4, "head_dim": 256, "num_heads": 6, "num_v_heads": None,
        "max_position_embeddings": 2048, "hidden_ratio": 4, "intermediate_size": None, "hidden_act": "swish",
        "num_hidden_layers": 21, "norm_eps": 1e-06, "attn": None, "use_cache": True, "pad_token_id": None,
        "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False, "initializer_range": 0.02,
        "fuse_norm": True, "fuse_swiglu": True, "fuse_cross_entropy": True, "fuse_linear_cross_entropy": False,
        "use_l2warp": False, "vocab_size": 32000, "attnres_block_size": None, "output_gate_activation": "swish",
    }
    # fmt: on

    @classmethod
    def dims(cls, config) -> Dims:
        h = config.num_heads
        hv = config.num_v_heads if config.num_v_heads is not None else h
        d_v = int(config.head_dim * config.expand_v)  # as fla's layer derives it
        return Dims(num_heads=h, num_v_heads=hv, head_k_dim=config.head_dim, head_v_dim=d_v)

    @classmethod
    def config_updates(cls, config, d_k_new: int) -> dict[str, Any]:
        """``head_dim = d_k'`` and ``expand_v = d_v / d_k'``, checked to give back exactly ``d_v``."""
        d = cls.dims(config)
        cls.check_reduction(d.head_k_dim, d.head_v_dim, d_k_new)
        return {"head_dim": int(d_k_new), "expand_v": d.head_v_dim / int(d_k_new)}

    @classmethod
    def check_reduction(cls, head_k_dim: int, head_v_dim: int, d_k_new: int) -> None:
        """Also require ``int(d_k' * (d_v / d_k')) == d_v``: fla derives ``head_v_dim = int(head_dim * expand_v)``,
        and the float quotient truncates for some pairs (e.g. d_v=128, d_k'=49; multiples of 16 are safe)."""
        super().check_reduction(head_k_dim, head_v_dim, d_k_new)
        expand_v = head_v_dim / d_k_new
        if int(d_k_new * expand_v) != head_v_dim:
            raise ValueError(
                f"Gated DeltaNet cannot express d_k'={d_k_new} with d_v={head_v_dim}: expand_v=d_v/d_k'={expand_v!r} "
                f"gives int(d_k' * expand_v)={int(d_k_new * expand_v)} != d_v={head_v_dim}; choose another d_k'"
            )

    @classmethod
    def mixer_updates(cls, config, d_k_new: int) -> dict[str, Any]:
        fields = cls.config_updates(config, d_k_new)
        return {**fields, "head_k_dim": fields["head_dim"], "key_dim": config.num_heads * fields["head_dim"]}

    @classmethod
    def config_state_shape(cls, config) -> StateShape:
        h, hv, d_k, d_v = cls.dims(config)
        conv_channels = 2 * h * d_k + hv * d_v if config.use_short_conv else 0
        return StateShape(num_heads=hv, d_k=d_k, d_v=d_v, conv_channels=conv_channels, conv_width=config.conv_size)

    @classmethod
    def inplace_recurrent(cls, original, kernel: str, device_types: tuple[str, ...]):
        return _inplace_gated_delta_rule(original, kernel, device_types)

    # ---- fused one-token decode ---------------------------------------------------------------
    @classmethod
    def fused_decode_rows(cls, layer: nn.Module) -> list[str] | None:
        return ["a_proj", "b_proj"]

    @classmethod
    def fused_recurrent_step(cls, layer, kernel, q, k, v, tail, state, extra=None):
        from statereduce.kernels.recurrent import recurrent_step

        hv = layer.num_v_heads
        a, beta = tail[..., :hv], tail[..., hv:2 * hv]
        opts = {"A_log": layer.A_log, "dt_bias": layer.dt_bias, "allow_neg_eigval": layer.allow_neg_eigval}
        if kernel == "statereduce":  # L2 norms, beta's sigmoid and the decay in the kernel
            return recurrent_step(q, k, v, beta, state, g=a, l2norm=True, beta_sigmoid=True, state_v_first=True,
                                  **opts)
        # fla's function as inplace_decode routes it (q, k, v arrive contiguous from the conv launch; a and beta are
        # views into the projection's rows)
        step = importlib.import_module("fla.layers.gated_deltanet").fused_recurrent_gated_delta_rule
        o, _ = step(q, k, v, g=a.contiguous(), beta=beta.contiguous(),
                    initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True,
                    use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True, **opts)
        return o


def _inplace_gated_delta_rule(original, kernel: str, device_types: tuple[str, ...]):
    """fla's one-token recurrent function, routed to ``kernel``'s in-place step (speed.inplace)."""
    from statereduce.kernels.recurrent import fla_gated_delta_rule_step, recurrent_step

    def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None,
                                         initial_state=None, output_final_state=False,
                                         use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        simple = gk is None and gv is None and beta is not None and (beta.ndim != v.ndim)
        extra = set(kwargs) - {"use_gate_in_kernel", "A_log", "dt_bias", "use_beta_sigmoid_in_kernel",
                               "allow_neg_eigval", "state_v_first"}
        if not (simple and not extra and one_token_call(q, initial_state, cu_seqlens, device_types)):
            return original(q, k, v, g=g, gk=gk, gv=gv, beta=beta, scale=scale, initial_state=initial_state,
                            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                            cu_seqlens=cu_seqlens, **kwargs)
        if kernel == "fla_copy":
            o, final = original(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                                output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)
            initial_state.copy_(final)
            return o, (initial_state if output_final_state else None)
        in_kernel = kwargs.get("use_gate_in_kernel", False)
        opts = {"g": g, "A_log": kwargs.get("A_log") if in_kernel else None,
                "dt_bias": kwargs.get("dt_bias") if in_kernel else None, "scale": scale,
                "l2norm": use_qk_l2norm_in_kernel, "beta_sigmoid": kwargs.get("use_beta_sigmoid_in_kernel", False),
                "allow_neg_eigval": kwargs.get("allow_neg_eigval", False),
                "state_v_first": kwargs.get("state_v_first", False)}
        step = fla_gated_delta_rule_step if kernel == "fla" else recurrent_step
        o = step(q, k, v, beta, initial_state, **opts)
        return o, (initial_state if output_final_state else None)

    return fused_recurrent_gated_delta_rule
