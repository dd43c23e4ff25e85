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

from statereduce.adapters.base import LazyImport, fla_qk_of_call, fla_v_of_call, register_adapter
from statereduce.adapters.fla_layers import FlaAdapter
from statereduce.families.deltanet import DeltaNetFamily

KERNELS = ("chunk_delta_rule", "fused_recurrent_delta_rule")


@register_adapter
class DeltaNetAdapter(DeltaNetFamily, FlaAdapter):
    """fla DeltaNet: ``expand_k`` carries d_k (paper Sec. 3, App. A)."""

    layer_module = "fla.layers.delta_net"
    qk_readers = dict.fromkeys(KERNELS, fla_qk_of_call)  # q, k first or as keywords
    v_readers = dict.fromkeys(KERNELS, fla_v_of_call)
    padded_kernels = KERNELS  # statereduce.kernels.shapes: zero-padded at shapes stock fla mishandles
    checked_kernels = {k: k for k in KERNELS}  # statereduce.kernels.check: compared on CUDA with fla_fallback's
    mixer_class = LazyImport("fla.layers.delta_net:DeltaNet")

    @classmethod
    def mixer_expand_v(cls, mixer, value_dim: int) -> float:
        return value_dim / mixer.hidden_size  # value_dim = hidden_size * expand_v
