"""Gated DeltaNet (fla ``GatedDeltaNetConfig``): ``head_dim`` carries d_k, ``expand_v`` keeps d_v."""

from __future__ import annotations

from typing import Any, ClassVar

from statereduce.families.base import Dims, LazyImport, StateShape, register_family
from statereduce.families.fla import FlaFamily


@register_family
class GatedDeltaNetFamily(FlaFamily):
    """fla Gated DeltaNet: ``head_dim`` carries d_k, ``expand_v`` keeps d_v (paper Sec. 3, App. A)."""

    family = "gated_deltanet"
    fla_gated_backward = True
    model_types = ("gated_deltanet",)
    config_class = LazyImport("fla.models:GatedDeltaNetConfig")
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
    def sized_arch(cls, hidden: int, layers: int, heads: int, d_k: int, d_v: int) -> dict[str, Any]:
        return {"hidden_size": hidden, "num_hidden_layers": layers, "num_heads": heads, "head_dim": d_k,
                "expand_v": d_v / d_k}

    @classmethod
    def config_updates(cls, config, d_k_new: int) -> dict[str, Any]:
        """``head_dim = d_k'`` and ``expand_v = d_v / d_k'``, checked to give back exactly ``d_v``."""
        d = cls.dims(config)
        cls.check_reduction(d.head_k_dim, d.head_v_dim, d_k_new)
        return {"head_dim": int(d_k_new), "expand_v": d.head_v_dim / int(d_k_new)}

    @classmethod
    def value_config_updates(cls, config, d_v_new: int) -> dict[str, Any]:
        """``expand_v = d_v' / head_dim``, checked to give back exactly d_v' (fla: ``int(head_dim * expand_v)``)."""
        d = cls.dims(config)
        cls.check_value_reduction(d.head_v_dim, d_v_new)
        expand_v = int(d_v_new) / d.head_k_dim
        if int(d.head_k_dim * expand_v) != d_v_new:
            raise ValueError(f"Gated DeltaNet cannot express d_v'={d_v_new} with d_k={d.head_k_dim}: expand_v={expand_v!r} "
                             f"gives int(d_k * expand_v)={int(d.head_k_dim * expand_v)}; choose another d_v'")
        return {"expand_v": expand_v}

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

