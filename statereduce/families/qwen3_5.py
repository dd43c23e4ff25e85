"""The Qwen3.5 hybrid (transformers ``Qwen3_5TextConfig``): ``linear_key_head_dim`` carries d_k of its Gated DeltaNet
layers; the softmax-attention layers (``layer_types``, by default every fourth layer) stay."""

from __future__ import annotations

from typing import Any, ClassVar

from statereduce.families.base import Dims, FamilySpec, LazyImport, RftTargets, StateShape, register_family

LINEAR = "linear_attention"


def text_config(config):
    """The text config of a Qwen3.5 config (the vision-language ``qwen3_5`` nests it as ``text_config``)."""
    text = getattr(config, "text_config", None)
    return text if text is not None else config


@register_family
class Qwen35Family(FamilySpec):
    """Qwen3.5: ``linear_key_head_dim`` carries d_k of the Gated DeltaNet layers; attention layers stay."""

    family = "qwen3_5"
    rft_targets = RftTargets(default_scope="recurrent")  # paper Table 4: only the recurrent components are fine-tuned
    model_types = ("qwen3_5_text", "qwen3_5")
    config_class = LazyImport("transformers.models.qwen3_5:Qwen3_5TextConfig")
    vllm_architecture = "Qwen3_5ForCausalLM"  # vLLM's Qwen3.5 text model
    vllm_state_layer = "gdn"
    fla_gated_backward = True  # with fla installed, transformers binds fla's chunk_gated_delta_rule
    # every RMSNorm of the text model reads it: the block norms, the Gated DeltaNet layers' gated `norm`, the final norm
    # and the attention layers' q_norm/k_norm
    norm_eps_field = "rms_norm_eps"
    # transformers 5.24 Qwen3_5TextConfig.__init__ keywords and defaults (pinned by tests/test_config.py)
    # fmt: off
    config_defaults: ClassVar[dict[str, Any]] = {
        "transformers_version": None, "architectures": None, "output_hidden_states": False, "return_dict": True,
        "dtype": None, "chunk_size_feed_forward": 0, "is_encoder_decoder": False, "id2label": None, "label2id": None,
        "problem_type": None, "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288,
        "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4, "hidden_act": "silu",
        "max_position_embeddings": 32768, "initializer_range": 0.02, "rms_norm_eps": 1e-06, "use_cache": True,
        "tie_word_embeddings": False, "rope_parameters": None, "attention_bias": False, "attention_dropout": 0.0,
        "head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "layer_types": None, "pad_token_id": None,
        "bos_token_id": None, "eos_token_id": None,
    }
    # fmt: on

    @classmethod
    def dims(cls, config) -> Dims:
        c = text_config(config)
        h, hv = c.linear_num_key_heads, c.linear_num_value_heads
        if hv % h:
            raise ValueError(f"Qwen3.5 linear_num_value_heads={hv} is not a multiple of linear_num_key_heads={h}")
        return Dims(num_heads=h, num_v_heads=hv, head_k_dim=c.linear_key_head_dim, head_v_dim=c.linear_value_head_dim)

    @classmethod
    def mixer_layer_indices(cls, config) -> list[int]:
        c = text_config(config)
        types = c.layer_types or [LINEAR if (i + 1) % 4 else "full_attention" for i in range(c.num_hidden_layers)]
        return [i for i, kind in enumerate(types) if kind == LINEAR]

    @classmethod
    def sized_arch(cls, hidden: int, layers: int, heads: int, d_k: int, d_v: int) -> dict[str, Any]:
        """The last layer is softmax attention (``heads`` heads of d_v, half as many key/value heads)."""
        return {"hidden_size": hidden, "num_hidden_layers": layers, "intermediate_size": 2 * hidden,
                "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2), "head_dim": d_v,
                "linear_num_key_heads": heads, "linear_key_head_dim": d_k, "linear_num_value_heads": heads,
                "linear_value_head_dim": d_v, "layer_types": [LINEAR] * (layers - 1) + ["full_attention"]}

    @classmethod
    def config_updates(cls, config, d_k_new: int) -> dict[str, Any]:
        """``linear_key_head_dim = d_k'`` (of the text config; a Python int: the config is strict)."""
        d = cls.dims(config)
        cls.check_reduction(d.head_k_dim, d.head_v_dim, d_k_new)
        return {"linear_key_head_dim": int(d_k_new)}

    @classmethod
    def value_config_updates(cls, config, d_v_new: int) -> dict[str, Any]:
        """``linear_value_head_dim = d_v'`` (of the text config)."""
        cls.check_value_reduction(cls.dims(config).head_v_dim, d_v_new)
        return {"linear_value_head_dim": int(d_v_new)}

    @classmethod
    def exact_norm_eps_refusal(cls, config) -> str | None:
        """Of the text config, or of the vision-language config around it (either may say the embeddings are tied)."""
        return super().exact_norm_eps_refusal(config) or super().exact_norm_eps_refusal(text_config(config))

    @classmethod
    def config_key_dims(cls, config) -> dict[int, int]:
        """Of the text config (which a per-layer-width checkpoint, a text model, carries)."""
        return super().config_key_dims(text_config(config))

    @classmethod
    def reduced_config(cls, config, d_k_new: int):
        """The reduced text config (of the text config, for a vision-language ``qwen3_5`` config)."""
        return super().reduced_config(text_config(config), d_k_new)

    @classmethod
    def mixer_updates(cls, config, d_k_new: int) -> dict[str, Any]:
        h, hv, _, d_v = cls.dims(config)
        key_dim = h * int(d_k_new)
        return {"head_k_dim": int(d_k_new), "key_dim": key_dim, "conv_dim": 2 * key_dim + hv * d_v}

    @classmethod
    def config_state_shape(cls, config) -> StateShape:
        h, hv, d_k, d_v = cls.dims(config)
        return StateShape(num_heads=hv, d_k=d_k, d_v=d_v, conv_channels=2 * h * d_k + hv * d_v,
                          conv_width=text_config(config).linear_conv_kernel_dim)

