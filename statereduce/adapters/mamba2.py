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

Loading: fla registers its own ``mamba2`` model with the Auto classes once imported, so checkpoints load through
transformers' ``Mamba2ForCausalLM`` explicitly (:attr:`causal_lm_class`). Its forward takes a cache as
``cache=`` and silently ignores ``past_key_values=`` (:attr:`cache_argument`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from statereduce.adapters.base import (
    ChannelRows,
    Dims,
    LazyImport,
    StateShape,
    TransformersAdapter,
    decoder_layers,
    head_major_rows,
    register_adapter,
)

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


@register_adapter
class Mamba2Adapter(TransformersAdapter):
    """transformers Mamba-2: ``state_size`` carries d_k (N), one B/C selection per group (paper App. C.3)."""

    family = "mamba2"
    model_types = ("mamba2",)
    config_class = LazyImport("transformers:Mamba2Config")
    causal_lm_class = LazyImport("transformers:Mamba2ForCausalLM")
    layer_module = LAYER_MODULE
    qk_readers = {CHUNK: _scan_qk, STEP: _step_qk}
    cache_state_v_first = True  # the cache holds [B, num_heads, head_dim, N]
    kernel_scale = False
    # the fused training kernel (mamba_ssm) reads out_proj.weight directly, so a LoRA on it would never run; peft
    # refuses LoRA on a Mamba out_proj for that reason. RFT trains in_proj (LoRA), conv1d and the norms.
    lora_excluded = ("out_proj",)
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

    def mixer_layers(self) -> list[tuple[int, nn.Module]]:
        return [(i, block.mixer) for i, block in enumerate(decoder_layers(self.model))]

    def channel_rows(self, mixer: nn.Module) -> list[ChannelRows]:
        i, g, n = mixer.intermediate_size, mixer.n_groups, mixer.ssm_state_size
        b_rows, c_rows = head_major_rows(g, n, offset=i), head_major_rows(g, n, offset=i + g * n)  # in [x | B | C]
        return [ChannelRows("in_proj", mixer.in_proj, q=c_rows + i, k=b_rows + i),
                ChannelRows("conv1d", mixer.conv1d, q=c_rows, k=b_rows)]

    def projection_input(self, mixer: nn.Module) -> nn.Module:
        return mixer.in_proj
