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

from statereduce.adapters.base import LazyImport, fla_qk_of_call, fla_v_of_call, register_adapter
from statereduce.adapters.fla_layers import FlaAdapter
from statereduce.families.gated_deltanet import GatedDeltaNetFamily

KERNELS = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule")


@register_adapter
class GatedDeltaNetAdapter(GatedDeltaNetFamily, FlaAdapter):
    """fla Gated DeltaNet: ``head_dim`` carries d_k, ``expand_v`` keeps d_v (paper Sec. 3, App. A)."""

    cache_state_v_first = True  # fla's GatedDeltaNet calls its kernels with state_v_first=True
    layer_module = "fla.layers.gated_deltanet"
    qk_readers = dict.fromkeys(KERNELS, fla_qk_of_call)  # q, k first or as keywords
    v_readers = dict.fromkeys(KERNELS, fla_v_of_call)
    padded_kernels = KERNELS  # statereduce.kernels.shapes: zero-padded at shapes stock fla mishandles
    checked_kernels = {k: k for k in KERNELS}  # statereduce.kernels.check: compared on CUDA with fla_fallback's
    # what fla's GatedDeltaNet passes its kernels: the gate and beta's sigmoid computed in the kernel, the state [V, K]
    kernel_flags = {"state_v_first": True, "use_gate_in_kernel": True, "use_beta_sigmoid_in_kernel": True}
    mixer_class = LazyImport("fla.layers.gated_deltanet:GatedDeltaNet")

    @classmethod
    def mixer_expand_v(cls, mixer, value_dim: int) -> float:
        return value_dim // mixer.num_v_heads / mixer.head_k_dim  # head_v_dim = head_dim * expand_v
