"""One-token recurrent decode steps that update the state in place (for CUDA-graph decoding and its benchmarks).

A decode step of a DeltaNet / Gated DeltaNet layer reads the recurrent state ``S`` (``d_k x d_v`` per head, float32)
and writes it back; at large batch that traffic dominates the step (paper Sec. 5, App. G.1). fla 0.6.0's
``fused_recurrent_*`` functions write the new state to a *new* tensor, so a captured CUDA graph would either need
a copy back (a second read and write of the state) or fresh buffers per step. This module gives two in-place
steps that a graph can replay with static buffers:

- ``kernel="fla"``: fla's own Triton kernels (``fused_recurrent_delta_rule_fwd_kernel``,
  ``fused_recurrent_gated_delta_rule_fwd_kernel``) launched exactly as fla launches them, but with the final
  state pointer equal to the initial one. Each program loads its state tile before it stores the same tile, and
  programs own disjoint tiles, so this is safe. It is the unmodified-kernel baseline of the speed benchmarks.
- ``kernel="fla_copy"``: fla's public ``fused_recurrent_*`` function as it is, returning a new state, then
  ``state.copy_(new)``: what a CUDA-graph decoder built on the unmodified function must do (the paper's setup
  uses fla's kernels unmodified). It reads and writes the state twice, so it is the slowest of the three.
- ``kernel="statereduce"``: :func:`recurrent_step`, our Triton kernel for ``T = 1``. fla's kernels give each
  program a ``BV = 8``-row tile with one warp, which moves the state at about 2.0 TB/s when ``d_k = 32``
  (issue 5, measured on an H200). Ours tiles ``BV`` rows of the value dimension against the whole key dimension
  with a block shape and warp count autotuned per ``(d_k, d_v, layout)``, so small-``d_k`` states stream in
  wide coalesced rows. The L2 norm of q and k is done in the kernel in float32 (fla rounds the normalised q and
  k of DeltaNet to the input dtype first, a difference at the bf16 rounding level).

:func:`install` routes the stock fla layers' decode calls (``T = 1`` with an initial state, no ``cu_seqlens``,
no autograd) to one of the two and leaves every other call to fla. The recurrences are the delta rule
``S <- S + beta k (v - S^T k)^T`` and the gated delta rule with ``S <- exp(g) S`` first (paper Sec. 2), in fla's
state layouts ``[N, HV, K, V]`` and (``state_v_first``) ``[N, HV, V, K]``.
"""


from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

import torch

from statereduce.kernels.recurrent import fla_delta_rule_step, fla_gated_delta_rule_step, recurrent_step

KERNELS = ("fla", "statereduce", "fla_copy")
"""Recurrent steps of :func:`inplace_decode`: fla's kernel in place, ours in place, and fla's public function
unmodified (a new state tensor each step) with the graph copying it back into the static state buffer. Each may
carry the suffix :data:`FUSED` (:func:`parse_kernel`)."""

FUSED = "+fused"
"""Kernel-name suffix: the rest of the layer takes :mod:`statereduce.speed.fused`'s step as well."""


# ---------------------------------------------------------------------------------------------
# routing the stock fla layers' decode calls
# ---------------------------------------------------------------------------------------------
_DEVICE_TYPES: tuple[str, ...] = ("cuda",)  # devices whose decode calls are routed (tests add "cpu" with the interpreter)


def _decode_call(q, initial_state, cu_seqlens) -> bool:
    return (q.shape[1] == 1 and initial_state is not None and cu_seqlens is None and q.device.type in _DEVICE_TYPES
            and initial_state.is_contiguous() and initial_state.dtype == torch.float32
            and not torch.is_grad_enabled())


def _delta_rule_wrapper(original, kernel: str):
    def fused_recurrent_delta_rule(q, k, v, beta=None, scale=None, initial_state=None, output_final_state=False,
                                   use_qk_l2norm_in_kernel=False, cu_seqlens=None):
        if not _decode_call(q, initial_state, cu_seqlens):
            return original(q, k, v, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                            cu_seqlens)
        if kernel == "fla_copy":
            o, final = original(q, k, v, beta, scale, initial_state, True, use_qk_l2norm_in_kernel, cu_seqlens)
            initial_state.copy_(final)
            return o, (initial_state if output_final_state else None)
        if beta is None:
            beta = torch.ones_like(q[..., 0])
        if kernel == "fla":
            o = fla_delta_rule_step(q, k, v, beta, initial_state, scale=scale, l2norm=use_qk_l2norm_in_kernel)
        else:
            o = recurrent_step(q, k, v, beta, initial_state, scale=scale, l2norm=use_qk_l2norm_in_kernel,
                               round_qk=True)
        return o, (initial_state if output_final_state else None)

    return fused_recurrent_delta_rule


def _gated_delta_rule_wrapper(original, kernel: str):
    def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None,
                                         initial_state=None, output_final_state=False,
                                         use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        simple = gk is None and gv is None and beta is not None and (beta.ndim != v.ndim)
        extra = set(kwargs) - {"use_gate_in_kernel", "A_log", "dt_bias", "use_beta_sigmoid_in_kernel",
                               "allow_neg_eigval", "state_v_first"}
        if not (simple and not extra and _decode_call(q, initial_state, cu_seqlens)):
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


_TARGETS = (
    ("fla.layers.delta_net", "fused_recurrent_delta_rule", _delta_rule_wrapper),
    ("fla.layers.gated_deltanet", "fused_recurrent_gated_delta_rule", _gated_delta_rule_wrapper),
)


def parse_kernel(name: str) -> tuple[str, bool]:
    """A decode kernel setting (``"fla"``, ``"statereduce+fused"``, ...) as (kernel, fused); one-line error if bad."""
    kernel, fused = (name[:-len(FUSED)], True) if name.endswith(FUSED) else (name, False)
    if kernel not in KERNELS:
        valid = ", ".join([*KERNELS, *(k + FUSED for k in KERNELS)])
        raise ValueError(f"unknown decode kernel {name!r}; valid: {valid}")
    return kernel, fused


@contextlib.contextmanager
def inplace_decode(kernel: str = "statereduce", device_types: tuple[str, ...] = ("cuda",)) -> Iterator[None]:
    """Within the block, the stock fla DeltaNet / GatedDeltaNet layers decode with in-place state updates.

    Args:
        kernel: ``"statereduce"`` (:func:`recurrent_step`), ``"fla"`` (fla's own kernels, in place) or
            ``"fla_copy"`` (fla's functions unmodified, the new state copied back into the cache's tensor); with
            ``"+fused"`` appended, the layers also take :mod:`statereduce.speed.fused`'s leaner step (packed
            projections, one conv launch) around that state update.
        device_types: devices whose one-token calls are routed; ``("cpu",)`` only makes sense for
            ``"statereduce"`` under ``TRITON_INTERPRET=1`` (tests).
    """
    global _DEVICE_TYPES
    kernel, fused = parse_kernel(kernel)
    saved = []
    before, _DEVICE_TYPES = _DEVICE_TYPES, tuple(device_types)
    try:
        with contextlib.ExitStack() as stack:
            for module_name, attr, make in _TARGETS:
                module = importlib.import_module(module_name)
                original = getattr(module, attr)
                saved.append((module, attr, original))
                setattr(module, attr, make(original, kernel))
            if fused:
                from statereduce.speed.fused import fused_layers

                stack.enter_context(fused_layers(kernel, device_types))
            yield
    finally:
        _DEVICE_TYPES = before
        for module, attr, original in saved:
            setattr(module, attr, original)
