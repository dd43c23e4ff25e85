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

from torch import nn

from statereduce.adapters.base import LazyImport, fla_qk_of_call, register_adapter
from statereduce.adapters.fla_layers import FlaAdapter, one_token_call
from statereduce.families.gated_deltanet import GatedDeltaNetFamily

KERNELS = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule")


@register_adapter
class GatedDeltaNetAdapter(GatedDeltaNetFamily, FlaAdapter):
    """fla Gated DeltaNet: ``head_dim`` carries d_k, ``expand_v`` keeps d_v (paper Sec. 3, App. A)."""

    cache_state_v_first = True  # fla's GatedDeltaNet calls its kernels with state_v_first=True
    layer_module = "fla.layers.gated_deltanet"
    recurrent_function = "fused_recurrent_gated_delta_rule"
    qk_readers = dict.fromkeys(KERNELS, fla_qk_of_call)  # q, k first or as keywords
    padded_kernels = KERNELS  # statereduce.kernels.shapes: zero-padded at shapes stock fla mishandles
    mixer_class = LazyImport("fla.layers.gated_deltanet:GatedDeltaNet")
    block_class = LazyImport("fla.models.gated_deltanet.modeling_gated_deltanet:GatedDeltaNetBlock")
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
