"""Tiny random models of every family shared by the tests (no downloads, CPU, seconds).

``tiny_model("delta_net")`` / ``tiny_model("gated_deltanet", num_v_heads=4)``: hidden 64, 2 layers,
2 heads of d_k = 32, vocab 300 (``fuse_cross_entropy=False`` for fla's configs, from ``tiny_config``);
keyword overrides go to the family's config class through :func:`statereduce.core.models.tiny_config`. The
family adapter's ``install_fallbacks()`` is called first so the models run on CPU.

:func:`tiny_arch` gives the arch dict of every test model, these and the smaller ones the pretraining tests train on
the byte-level tokenizer (``small=True, byte_vocab=True``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from statereduce.core.models import tiny_config
from statereduce.common.settings import RecallMixSettings, TrainSettings

VOCAB = 300

# d_k = 32 and 2 q/k heads in every family; DeltaNet d_v = 32, Gated DeltaNet d_v = 64; Mamba-2: 2 groups of
# N = 32 over 8 heads of 16 (chunk 16, so 20+ tokens cross chunks); Qwen3.5: 2 key heads, 4 value heads of 16
# (GVA), layers [linear, linear, attention] so that a softmax layer sits between and after linear ones.
TINY: dict[str, dict[str, Any]] = {
    "delta_net": {"hidden_size": 64, "num_hidden_layers": 2, "num_heads": 2, "expand_k": 1.0, "expand_v": 1.0},
    "gated_deltanet": {"hidden_size": 64, "num_hidden_layers": 2, "num_heads": 2, "head_dim": 32, "expand_v": 2.0},
    "mamba2": {"hidden_size": 64, "num_hidden_layers": 2, "num_heads": 8, "head_dim": 16, "expand": 2, "n_groups": 2,
               "state_size": 32, "chunk_size": 16},
    "qwen3_5": {"hidden_size": 64, "num_hidden_layers": 3, "intermediate_size": 128, "num_attention_heads": 2,
                "num_key_value_heads": 1, "head_dim": 32, "linear_key_head_dim": 32, "linear_value_head_dim": 16,
                "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                "layer_types": ["linear_attention", "linear_attention", "full_attention"]},
}
# Smaller still, for the tests that pretrain (a few steps each): hidden 32, 2 layers, d_k = 16; DeltaNet d_v = 16,
# Gated DeltaNet d_v = 16, Mamba-2 4 heads of 16 in 2 groups of N = 16, Qwen3.5 2 value heads of 16 and layers
# [linear, attention].
SMALL: dict[str, dict[str, Any]] = {
    "delta_net": {"hidden_size": 32, "num_hidden_layers": 2, "num_heads": 2, "expand_k": 1.0, "expand_v": 1.0},
    "gated_deltanet": {"hidden_size": 32, "num_hidden_layers": 2, "num_heads": 2, "head_dim": 16, "expand_v": 1.0},
    "mamba2": {"hidden_size": 32, "num_hidden_layers": 2, "num_heads": 4, "head_dim": 16, "n_groups": 2,
               "state_size": 16, "chunk_size": 16},
    "qwen3_5": {"hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64, "num_attention_heads": 2,
                "num_key_value_heads": 1, "head_dim": 16, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
                "linear_num_value_heads": 2, "linear_value_head_dim": 16,
                "layer_types": ["linear_attention", "full_attention"]},
}
COMMON: dict[str, Any] = {"vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2}  # tiny_config adds the rest


def tiny_arch(family: str, *, small: bool = False, byte_vocab: bool = False, **overrides: Any) -> dict[str, Any]:
    """The arch dict of a test model of ``family``, for :func:`statereduce.core.models.tiny_config` (or the family's
    config class): ``COMMON`` + ``TINY`` (the models of :func:`tiny_model`) unless ``small`` or ``byte_vocab`` say
    otherwise, with ``overrides`` applied (a copy: changing it changes no other test's model).

    Args:
        family: adapter family name.
        small: the ``SMALL`` shape instead of ``TINY``.
        byte_vocab: no vocabulary fields (no ``COMMON``): ``tiny_config`` then gives the byte-level tokenizer's 257
            ids with BOS/EOS 256, as for the models the tests pretrain.
        **overrides: config fields.
    """
    shapes = SMALL if small else TINY
    if family not in shapes:
        raise ValueError(f"no tiny config for family {family!r}; valid: {', '.join(sorted(shapes))}")
    return copy.deepcopy({**({} if byte_vocab else COMMON), **shapes[family], **overrides})


def tiny_model(family: str, seed: int = 0, conv_std: float | None = 0.3, **overrides: Any) -> nn.Module:
    """A tiny random causal LM of ``family`` in eval mode, float32, ready for CPU.

    Args:
        family: adapter family name.
        seed: torch seed for the initialisation.
        conv_std: if not None, re-draw the short-conv weights with this std (fla's default init of 0.02
            leaves conv outputs ~1e-3, far from trained models; 0.3 gives activations of order one).
        **overrides: config fields.
    """
    from statereduce.adapters import adapter_class

    adapter = adapter_class(family)
    adapter.install_fallbacks()
    torch.manual_seed(seed)
    model = adapter.build(tiny_config(family, tiny_arch(family, **overrides)))
    if conv_std is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "conv1d" in name:
                    p.normal_(0.0, conv_std)
    return model.float().eval()


def tiny_inputs(batch: int = 2, length: int = 24, seed: int = 1) -> torch.Tensor:
    """Random token ids [batch, length] in the tiny vocabulary."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=g)


def random_keep(model: nn.Module, d_k_new: int, seed: int = 0) -> dict[int, torch.Tensor]:
    """A random sorted per-head selection {layer: [H, d_k']} for every linear-attention layer."""
    from statereduce.adapters import get_adapter

    adapter = get_adapter(model)
    g = torch.Generator().manual_seed(seed)
    h, d_k = adapter.num_heads, adapter.head_k_dim
    return {
        layer: torch.stack([torch.randperm(d_k, generator=g)[:d_k_new].sort().values for _ in range(h)])
        for layer, _ in adapter.mixer_layers()
    }


def pretrain(family: str, arch: dict, corpus: dict, train: dict, out, *, recall_mix: dict | None = None, **kw):
    """:func:`statereduce.stages.pretrain.pretrain` with its settings given as config blocks (read by their
    ``from_dict``, as the workflow script reads the rule's params)."""
    from statereduce.stages import pretrain as pt
    mix = None if recall_mix is None else RecallMixSettings.from_dict(recall_mix)
    return pt.pretrain(family, arch, corpus, TrainSettings.from_dict(train), out, recall_mix=mix, **kw)
