"""DeltaNet (fla ``DeltaNetConfig``): ``expand_k`` carries d_k.

``key_dim = round(hidden_size * expand_k)``, ``head_k_dim = key_dim // num_heads``; d_k is global through ``expand_k``,
so a per-layer d_k' is not expressible.
"""

from __future__ import annotations

from typing import Any, ClassVar

from statereduce.families.base import Dims, LazyImport, StateShape, register_family
from statereduce.families.fla import FlaFamily


@register_family
class DeltaNetFamily(FlaFamily):
    """fla DeltaNet: ``expand_k`` carries d_k (paper Sec. 3, App. A)."""

    family = "delta_net"
    model_types = ("delta_net",)
    config_class = LazyImport("fla.models:DeltaNetConfig")
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
    def sized_arch(cls, hidden: int, layers: int, heads: int, d_k: int, d_v: int) -> dict[str, Any]:
        return {"hidden_size": hidden, "num_hidden_layers": layers, "num_heads": heads,
                "expand_k": heads * d_k / hidden, "expand_v": heads * d_v / hidden}

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
    def value_config_updates(cls, config, d_v_new: int) -> dict[str, Any]:
        """``expand_v = H * d_v' / hidden_size``, checked to give back exactly ``H * d_v'``."""
        cls.check_value_reduction(cls.dims(config).head_v_dim, d_v_new)
        value_dim = config.num_heads * int(d_v_new)
        expand_v = value_dim / config.hidden_size
        if round(config.hidden_size * expand_v) != value_dim:
            raise ValueError(f"DeltaNet cannot express d_v'={d_v_new}: expand_v={expand_v!r} gives "
                             f"round(hidden_size={config.hidden_size} * expand_v) != num_heads * d_v' = {value_dim}")
        return {"expand_v": expand_v}

    @classmethod
    def mixer_updates(cls, config, d_k_new: int) -> dict[str, Any]:
        expand_k = cls.config_updates(config, d_k_new)["expand_k"]
        return {"expand_k": expand_k, "key_dim": config.num_heads * int(d_k_new), "head_k_dim": int(d_k_new)}

    @classmethod
    def config_state_shape(cls, config) -> StateShape:
        h, _, d_k, d_v = cls.dims(config)
        conv_channels = h * (2 * d_k + d_v) if config.use_short_conv else 0
        return StateShape(num_heads=h, d_k=d_k, d_v=d_v, conv_channels=conv_channels, conv_width=config.conv_size)

