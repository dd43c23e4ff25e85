"""Mamba-2 (transformers ``Mamba2Config``): ``state_size`` carries d_k (N), one B/C selection per group."""

from __future__ import annotations

from typing import Any, ClassVar

from statereduce.families.base import Dims, FamilySpec, LazyImport, RftTargets, StateShape, register_family


@register_family
class Mamba2Family(FamilySpec):
    """transformers Mamba-2: ``state_size`` carries d_k (N), one B/C selection per group (paper App. C.3)."""

    family = "mamba2"
    model_types = ("mamba2",)
    config_class = LazyImport("transformers:Mamba2Config")
    uses_fla = False  # transformers' model; on CPU its PyTorch path, on CUDA mamba_ssm's kernels where installed
    vllm_architecture = "Mamba2ForCausalLM"
    vllm_state_layer = "mamba"
    stock_value_cut = False  # Mamba2Config has no d_v field: num_heads * head_dim is tied to expand * hidden_size
    # the fused training kernel (mamba_ssm) reads out_proj.weight directly, so a LoRA on it would never run; peft
    # refuses LoRA on a Mamba out_proj for that reason. RFT trains in_proj (LoRA), conv1d and the norms
    rft_targets = RftTargets(lora_excluded=("out_proj",))
    kernel_scale = False
    # no kernel scale: B/C pruning with norm_eps="exact" changes nothing; keeping fewer value channels (head_dim)
    # changes the gated norm's group size, which the eps of this field compensates
    norm_eps_field = "layer_norm_epsilon"
    # transformers 5.24 Mamba2Config.__init__ keywords and defaults (pinned by tests/test_config.py)
    # fmt: off
    config_defaults: ClassVar[dict[str, Any]] = {
        "transformers_version": None, "architectures": None, "output_hidden_states": False, "return_dict": True,
        "dtype": None, "chunk_size_feed_forward": 0, "is_encoder_decoder": False, "id2label": None, "label2id": None,
        "problem_type": None, "num_heads": 128, "head_dim": 64, "vocab_size": 32768, "hidden_size": 4096,
        "state_size": 128, "num_hidden_layers": 64, "layer_norm_epsilon": 1e-05, "pad_token_id": 1, "bos_token_id": 0,
        "eos_token_id": 2, "expand": 2, "conv_kernel": 4, "n_groups": 8, "use_bias": False, "use_conv_bias": True,
        "hidden_act": "silu", "initializer_range": 0.1, "residual_in_fp32": True, "time_step_rank": "auto",
        "time_step_min": 0.001, "time_step_max": 0.1, "time_step_floor": 0.0001, "time_step_limit": (0.0, float("inf")),
        "rescale_prenorm_residual": False, "use_cache": True, "chunk_size": 256, "tie_word_embeddings": False,
    }
    # fmt: on

    @classmethod
    def dims(cls, config) -> Dims:
        if config.num_heads % config.n_groups:
            raise ValueError(f"Mamba-2 num_heads={config.num_heads} is not a multiple of n_groups={config.n_groups}")
        return Dims(num_heads=config.n_groups, num_v_heads=config.num_heads, head_k_dim=config.state_size,
                    head_v_dim=config.head_dim)

    @classmethod
    def mixer_layer_indices(cls, config) -> list[int]:
        return list(range(config.num_hidden_layers))

    @classmethod
    def sized_arch(cls, hidden: int, layers: int, heads: int, d_k: int, d_v: int) -> dict[str, Any]:
        """``heads`` groups (the q/k heads); value heads of d_v fill ``expand * hidden`` (expand 2); d_k is
        ``state_size``."""
        return {"hidden_size": hidden, "num_hidden_layers": layers, "num_heads": 2 * hidden // d_v, "head_dim": d_v,
                "expand": 2, "n_groups": heads, "state_size": d_k, "chunk_size": 256}

    @classmethod
    def config_updates(cls, config, d_k_new: int) -> dict[str, Any]:
        """``state_size = N'`` (a Python int: the config is strict)."""
        d = cls.dims(config)
        cls.check_reduction(d.head_k_dim, d.head_v_dim, d_k_new)
        return {"state_size": int(d_k_new)}

    @classmethod
    def mixer_updates(cls, config, d_k_new: int) -> dict[str, Any]:
        intermediate = int(config.expand * config.hidden_size)
        return {"ssm_state_size": int(d_k_new), "conv_dim": intermediate + 2 * config.n_groups * int(d_k_new)}

    @classmethod
    def config_state_shape(cls, config) -> StateShape:
        g, nh, n, p = cls.dims(config)
        conv_channels = int(config.expand * config.hidden_size) + 2 * g * n
        return StateShape(num_heads=nh, d_k=n, d_v=p, conv_channels=conv_channels, conv_width=config.conv_kernel)

