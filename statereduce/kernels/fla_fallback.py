"""Pure-PyTorch fallbacks for the fla (flash-linear-attention 0.6.0) kernels used by DeltaNet and Gated DeltaNet.

fla's kernels are Triton and only run on a GPU. :func:`install` rebinds the fla functions that the stock
``fla.layers.delta_net.DeltaNet`` / ``fla.layers.gated_deltanet.GatedDeltaNet`` layers and the
``fla.models.delta_net`` / ``fla.models.gated_deltanet`` models call in their forward and backward passes, in
every ``fla.*`` module namespace that looked them up, so that the stock classes and checkpoints run unchanged on
CPU tensors (training, no-cache scoring, cached step-by-step decoding, and padded batches with an
``attention_mask``, which fla turns into packed ``cu_seqlens`` calls). Each replacement dispatches on the
device of its first tensor argument: CPU tensors (or any device type passed to ``install(torch_device_types=...)``)
go to the PyTorch implementation below, everything else to the original fla function, which is kept.

Patched module-level functions (each also rebound wherever the same function object is bound in a loaded
``fla.*`` module, e.g. ``fla.layers.delta_net.chunk_delta_rule``, ``fla.ops.gated_delta_rule.chunk_gdn``,
``fla.layers.gated_deltanet.causal_conv1d``, ``fla.modules.convolution.causal_conv1d``,
``fla.modules.mlp.swiglu``):

- ``fla.ops.delta_rule.chunk.chunk_delta_rule`` -> :func:`chunk_delta_rule` (chunked WY/UT form)
- ``fla.ops.delta_rule.fused_recurrent.fused_recurrent_delta_rule`` -> :func:`fused_recurrent_delta_rule`
- ``fla.ops.gated_delta_rule.chunk.chunk_gated_delta_rule`` (alias ``chunk_gdn``) -> :func:`chunk_gated_delta_rule`
- ``fla.ops.gated_delta_rule.fused_recurrent.fused_recurrent_gated_delta_rule`` (alias ``fused_recurrent_gdn``)
  -> :func:`fused_recurrent_gated_delta_rule`
- ``fla.modules.causal_conv1d.ops.causal_conv1d`` -> :func:`causal_conv1d` (ShortConvolution.forward and GDN's
  fused q/k/v conv path ``_use_fused_qkv_conv``)
- ``fla.modules.causal_conv1d.ops.causal_conv1d_update`` -> :func:`causal_conv1d_update` (ShortConvolution.step)
- ``fla.modules.norm.layernorm.rms_norm`` / ``layer_norm`` -> :func:`rms_norm` / :func:`layer_norm`
  (``fla.modules.RMSNorm`` / ``LayerNorm``: the layers' ``o_norm`` and, with ``fuse_norm=True``, the block norms
  including the fused ``residual``/``prenorm`` path)
- ``fla.modules.norm.fused_norm_gate.rms_norm_gated`` / ``layer_norm_gated`` -> :func:`rms_norm_gated` /
  :func:`layer_norm_gated` (``FusedRMSNormGated``: ``o_norm`` when ``use_gate=True``)
- ``fla.modules.activations.ops.swiglu`` / ``swiglu_linear`` -> :func:`swiglu` / :func:`swiglu_linear`
  (``GatedMLP`` with and without ``fuse_swiglu``)
- ``fla.modules.activations.ops.elu_p1`` -> :func:`elu_p1` (DeltaNet with ``qk_activation='elu'``)
- ``fla.modules.norm.l2norm.l2norm`` (alias ``l2_norm``) -> :func:`l2norm` (``L2Norm``)

Patched methods:

- ``fla.modules.ShortConvolution.step`` (also covers ``backend='cuda'``, whose step bypasses
  ``causal_conv1d_update``)
- ``fla.modules.FusedCrossEntropyLoss.forward`` (used when labels are passed and ``fuse_cross_entropy=True``)

Not covered: context parallelism (``cp_context``), ``use_attnres`` blocks (``fla.ops.attnres``),
``fuse_linear_cross_entropy``, and softmax-attention (hybrid ``attn``) layers.

Conventions follow fla exactly: tensors are ``[B, T, H, D]``; recurrent states are ``[N, HV, K, V]`` float32, or
``[N, HV, V, K]`` when ``state_v_first=True`` (what ``GatedDeltaNet`` requests); conv caches are ``[N, D, W]`` holding
the last ``W`` inputs; the in-kernel L2 norm is ``x / sqrt(sum(x**2) + 1e-6)``; the default scale is
``K ** -0.5``; GVA value head ``i`` reads key head ``i // (HV // H)``. Everything is computed in float32 and
returned in the input dtype; gradients come from torch autograd.

Paper: Nazari & Rusch (2026), "On State Reduction in Linear Attention", Sec. 2 (delta rule and gated delta rule
recurrences); the chunked form is the WY / UT-transform of Yang et al. (2024), "Parallelizing Linear Transformers
with the Delta Rule over Sequence Length".
"""

from __future__ import annotations

import functools
import importlib
import itertools
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "PATCHED_FUNCTIONS",
    "PATCHED_METHODS",
    "causal_conv1d",
    "causal_conv1d_update",
    "chunk_delta_rule",
    "chunk_gated_delta_rule",
    "cross_entropy_loss",
    "elu_p1",
    "fused_cross_entropy_forward",
    "fused_recurrent_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "install",
    "is_installed",
    "l2norm",
    "layer_norm",
    "layer_norm_gated",
    "rms_norm",
    "rms_norm_gated",
    "short_conv_step",
    "swiglu",
    "swiglu_linear",
    "uninstall",
]

L2NORM_EPS = 1e-6
_SUPPORTED_CHUNK_SIZES = "any positive int (fla allows 16, 32, 64)"


# --------------------------------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------------------------------
def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS, output_dtype: torch.dtype | None = None) -> torch.Tensor:
    """L2-normalise the last dim exactly as fla's ``l2norm_fwd``: ``x / sqrt(sum(x**2) + eps)``.

    Args:
        x: input of shape ``[..., D]``.
        eps: added to the sum of squares before the square root (fla: 1e-6).
        output_dtype: dtype of the result; defaults to ``x.dtype``.
    """
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)
    return y.to(output_dtype or x.dtype)


def _l2norm_f32(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + L2NORM_EPS)


def _gdn_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None) -> torch.Tensor:
    """fla's in-kernel GDN gate ``-exp(A_log) * softplus(g + dt_bias)`` (log-space decay), float32."""
    g = g.float()
    if dt_bias is not None:
        g = g + dt_bias.float()
    return -A_log.float().exp() * F.softplus(g)


def _expand_gva(x: torch.Tensor, hv: int) -> torch.Tensor:
    """Repeat key heads ``[B, T, H, K]`` to ``[B, T, HV, K]`` so that value head i reads key head ``i // (HV // H)``."""
    h = x.shape[2]
    if hv == h:
        return x
    if hv % h != 0:
        raise ValueError(f"For GVA, num_v_heads (HV={hv}) must be divisible by num_heads (H={h}).")
    return x.repeat_interleave(hv // h, dim=2)


def _check_varlen(q: torch.Tensor, initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None) -> None:
    if cu_seqlens is None:
        return
    if q.shape[0] != 1:
        raise ValueError(f"The batch size is expected to be 1 rather than {q.shape[0]} when using `cu_seqlens`.")
    if initial_state is not None and initial_state.shape[0] != len(cu_seqlens) - 1:
        raise ValueError(
            f"The number of initial states ({initial_state.shape[0]}) must equal the number of sequences "
            f"({len(cu_seqlens) - 1})."
        )


def _varlen(
    core: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
    cu_seqlens: torch.Tensor | None,
    per_token: tuple[torch.Tensor | None, ...],
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    **kw: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run ``core`` on one packed batch (``cu_seqlens``) sequence by sequence, or once when ``cu_seqlens`` is None."""
    if cu_seqlens is None:
        return core(*per_token, initial_state=initial_state, output_final_state=output_final_state, **kw)
    bounds = [int(b) for b in cu_seqlens.tolist()]
    outs, states = [], []
    for i, (bos, eos) in enumerate(itertools.pairwise(bounds)):
        sl = tuple(None if t is None else t[:, bos:eos] for t in per_token)
        h0 = None if initial_state is None else initial_state[i : i + 1]
        o, ht = core(*sl, initial_state=h0, output_final_state=output_final_state, **kw)
        outs.append(o)
        states.append(ht)
    o = torch.cat(outs, dim=1)
    return o, (torch.cat(states, dim=0) if output_final_state else None)


# --------------------------------------------------------------------------------------------------------------------
# delta-rule cores (float32, heads already expanded; states [B, HV, K, V])
# --------------------------------------------------------------------------------------------------------------------
def _chunk_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None,
    *,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    scale: float,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked (WY / UT-transform) gated delta rule.

    Recurrence (per head, state ``S`` of shape ``[K, V]``, ``alpha_t = exp(g_t)``, ``alpha_t = 1`` without ``g``)::

        S_t = alpha_t S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - alpha_t S_{t-1}^T k_t),   o_t = scale * S_t^T q_t

    Inside a chunk with local cumulative log-decay ``G_t`` (``gamma_t = exp(G_t)``), the ``u_t`` solve the unit
    lower-triangular system ``(I + A) U = diag(beta) V - diag(beta gamma) K S_0`` with
    ``A_tj = beta_t (gamma_t / gamma_j) k_t.k_j`` for ``j < t``; it is solved with ``solve_triangular`` for all
    chunks at once, and only the chunk-to-chunk state pass is a Python loop (``T / chunk_size`` steps).

    Args:
        q, k: ``[B, T, HV, K]`` float32 (already normalised and GVA-expanded).
        v: ``[B, T, HV, V]`` float32.
        beta: ``[B, T, HV]`` float32.
        g: ``[B, T, HV]`` float32 log-space decay, or None (plain delta rule).
        initial_state: ``[B, HV, K, V]`` float32 or None.
        output_final_state: whether to return the final state.
        scale: query scale.
        chunk_size: chunk length C; T is zero-padded to a multiple of C (padded steps leave the state unchanged).
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    if T == 0:
        S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state
        return v.new_zeros(B, 0, H, V), (S if output_final_state else None)
    q, k, v, beta, g = _chunked(q, k, v, beta, g, scale, chunk_size)
    u0, w, intra, G, gamma = _ut_transform(q, k, v, beta, g)
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state
    outs, S = _chunk_pass(q, k, u0, w, intra, G, gamma, S)
    n, C = q.shape[2], q.shape[3]
    o = torch.stack(outs, dim=2).reshape(B, H, n * C, V)[:, :, :T].transpose(1, 2)
    return o, (S if output_final_state else None)


def _chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor | None,
             scale: float, C: int) -> tuple[torch.Tensor, ...]:
    """:func:`_chunk_core`'s inputs in chunks of ``C`` tokens: ``T`` zero-padded to a multiple ``n * C``, heads
    first, q scaled.

    Returns:
        ``(q, k [B, H, n, C, K], v [B, H, n, C, V], beta [B, H, n, C, 1], g [B, H, n * C] or None)``.
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    pad = (-T) % C
    # [B, H, T, D]
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    beta = beta.transpose(1, 2)
    if g is not None:
        g = g.transpose(1, 2)
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        beta = F.pad(beta, (0, pad))
        if g is not None:
            g = F.pad(g, (0, pad))
    n = (T + pad) // C
    q = (q * scale).reshape(B, H, n, C, K)
    k = k.reshape(B, H, n, C, K)
    v = v.reshape(B, H, n, C, V)
    beta = beta.reshape(B, H, n, C, 1)
    return q, k, v, beta, g


def _ut_transform(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                  g: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """What every chunk of :func:`_chunk_core` computes on its own, for all chunks at once (chunked inputs of
    :func:`_chunked`): the UT transform ``(I + A)^{-1}`` applied to ``diag(beta) V`` and ``diag(beta gamma) K``, and
    the chunk's causal, decayed ``q k^T``.

    Returns:
        ``(u0, w, intra, G, gamma)``: ``U = u0 - w S_0`` solves the chunk's system for its start state ``S_0``;
        ``intra`` ``[B, H, n, C, C]``; ``G`` the cumulative log-decay ``[B, H, n, C]`` and ``gamma = exp(G)``
        ``[B, H, n, C, 1]`` (both None without ``g``).
    """
    B, H, n, C, _ = k.shape
    k_beta = k * beta
    v_beta = v * beta

    lower_incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    if g is not None:
        G = g.reshape(B, H, n, C).cumsum(-1)
        # tril before exp keeps the masked (positive) differences from overflowing
        decay = (G.unsqueeze(-1) - G.unsqueeze(-2)).tril().exp() * lower_incl
        gamma = G.exp().unsqueeze(-1)
        rhs_k = k_beta * gamma
    else:
        G = gamma = None
        decay = lower_incl.to(q.dtype)
        rhs_k = k_beta
    A = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    # (I + A)^{-1}; an identity right-hand side is cheaper than solving for [v_beta, rhs_k] (C < K + V columns)
    T_inv = torch.linalg.solve_triangular(A + eye, eye.expand_as(A), upper=False, unitriangular=True)
    u0 = T_inv @ v_beta
    w = T_inv @ rhs_k
    intra = (q @ k.transpose(-1, -2)) * decay
    return u0, w, intra, G, gamma


def _chunk_pass(q: torch.Tensor, k: torch.Tensor, u0: torch.Tensor, w: torch.Tensor, intra: torch.Tensor,
                G: torch.Tensor | None, gamma: torch.Tensor | None,
                S: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The chunk-to-chunk pass of :func:`_chunk_core` (a Python loop over the ``n`` chunks): each chunk's ``U``, its
    output from the state it starts with and its own ``intra`` part, and the state it hands on.

    Returns:
        ``(outputs [B, H, C, V] per chunk, final state [B, H, K, V])``.
    """
    # unbind (not indexing) along the chunk dim: its backward is one stack instead of N zero-filled scatters
    u0_c, w_c, intra_c, k_c = u0.unbind(2), w.unbind(2), intra.unbind(2), k.unbind(2)
    q_c = (q if G is None else q * gamma).unbind(2)
    if G is not None:
        g_last = G[..., -1:]  # [B, H, n, 1]
        k_dec_c = (k * (g_last - G).exp().unsqueeze(-1)).unbind(2)
        s_dec_c = g_last.exp().unsqueeze(-1).unbind(2)  # [B, H, 1, 1] each
    outs = []
    for i in range(len(u0_c)):
        u = u0_c[i] - w_c[i] @ S
        outs.append(q_c[i] @ S + intra_c[i] @ u)
        if G is None:
            S = S + k_c[i].transpose(-1, -2) @ u
        else:
            S = S * s_dec_c[i] + k_dec_c[i].transpose(-1, -2) @ u
    return outs, S


RECURRENT_AS_CHUNK = 16
"""Inputs of at least this many tokens go to the chunked core from :func:`_recurrent_core` (on one CPU thread the
step loop is faster below 16 tokens, the chunks from 16 on)."""


def _recurrent_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None,
    gk: torch.Tensor | None,
    gv: torch.Tensor | None,
    *,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token (gated) delta rule, as fla's ``fused_recurrent`` kernels.

    Per step: decay ``S`` by ``exp(g_t)`` (and per-key ``exp(gk_t)`` / per-value ``exp(gv_t)``), then
    ``u = beta_t * (v_t - S^T k_t)``, ``S += k_t u^T``, ``o_t = S^T (scale q_t)``. ``beta`` is ``[B, T, HV]`` or
    head-wise ``[B, T, HV, V]``. Shapes otherwise as in :func:`_chunk_core`.

    From :data:`RECURRENT_AS_CHUNK` tokens on, without per-key or per-value decay or head-wise ``beta``, the same
    recurrence is computed in chunks (:func:`_chunk_core`; equal up to float rounding): a step loop over the whole
    state costs more there (fla's layers take this path for every input of up to 64 tokens, e.g. the recall
    probe's documents).
    """
    B, T, H, K = k.shape
    if T >= RECURRENT_AS_CHUNK and gk is None and gv is None and beta.dim() == 3:
        return _chunk_core(q, k, v, beta, g, initial_state=initial_state, output_final_state=output_final_state,
                           scale=scale, chunk_size=64)
    V = v.shape[-1]
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state
    q = q * scale
    outs = []
    for t in range(T):
        if g is not None:
            S = S * g[:, t].exp()[..., None, None]
        if gk is not None:
            S = S * gk[:, t].exp()[..., :, None]
        if gv is not None:
            S = S * gv[:, t].exp()[..., None, :]
        k_t = k[:, t]
        b_t = beta[:, t] if beta.dim() == 4 else beta[:, t, :, None]
        u = b_t * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k_t))
        S = S + k_t[..., :, None] * u[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, H, V)
    return o, (S if output_final_state else None)


def _prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    use_qk_l2norm_in_kernel: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must have the same number of heads, got {q.shape[2]} and {k.shape[2]}.")
    hv = v.shape[2]
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm_f32(q), _l2norm_f32(k)
    else:
        q, k = q.float(), k.float()
    return _expand_gva(q, hv), _expand_gva(k, hv), v.float()


def _state_in(initial_state: torch.Tensor | None, state_v_first: bool) -> torch.Tensor | None:
    if initial_state is None:
        return None
    h0 = initial_state.float()
    return h0.transpose(-1, -2) if state_v_first else h0


def _state_out(final_state: torch.Tensor | None, state_v_first: bool) -> torch.Tensor | None:
    if final_state is None:
        return None
    return (final_state.transpose(-1, -2) if state_v_first else final_state).contiguous()


def _chunk_size(kwargs: dict[str, Any]) -> int:
    chunk_size = kwargs.pop("chunk_size", 64)
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size!r} is invalid; valid: {_SUPPORTED_CHUNK_SIZES}.")
    if "head_first" in kwargs:
        raise ValueError("head_first has been removed in fla; inputs must be [B, T, H, ...] (valid: head_first unset).")
    return chunk_size


def _state_v_first(state_v_first: bool, kwargs: dict[str, Any]) -> bool:
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ValueError("Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`.")
        state_v_first = bool(kwargs.pop("transpose_state_layout"))
    return state_v_first


def _no_cp(cp_context: Any) -> None:
    if cp_context is not None:
        raise ValueError(
            f"cp_context={cp_context!r} (context parallelism) is not supported by the torch fallback; valid: None."
        )


def _beta_in(beta: torch.Tensor, use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool) -> torch.Tensor:
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    beta = beta.float()
    if use_beta_sigmoid_in_kernel:
        beta = beta.sigmoid() * (2.0 if allow_neg_eigval else 1.0)
    return beta


# --------------------------------------------------------------------------------------------------------------------
# public replacements of fla's delta-rule ops (same signatures as fla 0.6.0)
# --------------------------------------------------------------------------------------------------------------------
def chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Torch version of ``fla.ops.delta_rule.chunk_delta_rule`` (DeltaNet, paper Sec. 2).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; beta: ``[B, T, H]`` (post-sigmoid).
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]``; output_final_state: also return the final ``[N, H, K, V]`` float32 state.
        use_qk_l2norm_in_kernel: L2-normalise q and k first (``x / sqrt(sum x^2 + 1e-6)``).
        cu_seqlens: packed variable-length boundaries ``[N+1]`` (batch size must be 1).
        kwargs: ``chunk_size`` (default 64).
    """
    chunk_size = _chunk_size(kwargs)
    if beta.dim() != 3:
        raise ValueError(f"beta must be [B, T, H] for the chunk delta rule, got shape {tuple(beta.shape)}.")
    _check_varlen(q, initial_state, cu_seqlens)
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    qf, kf, vf = _prepare(q, k, v, use_qk_l2norm_in_kernel)
    o, ht = _varlen(
        _chunk_core,
        cu_seqlens,
        (qf, kf, vf, beta.float(), None),
        _state_in(initial_state, False),
        output_final_state,
        scale=scale,
        chunk_size=chunk_size,
    )
    return o.to(v.dtype), ht


def fused_recurrent_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Torch version of ``fla.ops.delta_rule.fused_recurrent_delta_rule`` (token-by-token; decoding).

    Args: as :func:`chunk_delta_rule`; ``beta`` may also be head-wise ``[B, T, H, V]`` and defaults to ones.
    """
    _check_varlen(q, initial_state, cu_seqlens)
    if scale is None:
        scale = k.shape[-1] ** -0.5
    elif scale <= 0:
        raise ValueError(f"scale={scale} must be positive.")
    if beta is None:
        beta = torch.ones_like(q[..., 0])
    qf, kf, vf = _prepare(q, k, v, use_qk_l2norm_in_kernel)
    o, ht = _varlen(
        _recurrent_core,
        cu_seqlens,
        (qf, kf, vf, beta.float(), None, None, None),
        _state_in(initial_state, False),
        output_final_state,
        scale=scale,
    )
    return o.to(v.dtype), ht


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    chunk_indices: torch.LongTensor | None = None,
    cp_context: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Torch version of ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (Gated DeltaNet, paper Sec. 2).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]`` (GVA when ``HV > H``); g, beta: ``[B, T, HV]``.
        g: log-space decay, or with ``use_gate_in_kernel=True`` the raw input of ``-exp(A_log) * softplus(g+dt_bias)``.
        beta: post-sigmoid, or logits with ``use_beta_sigmoid_in_kernel`` (times 2 with ``allow_neg_eigval``).
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` when ``state_v_first``).
        output_final_state: also return the final float32 state in the same layout.
        cu_seqlens: packed variable-length boundaries ``[N+1]``.
        kwargs: ``use_gate_in_kernel``, ``A_log``, ``dt_bias``, ``chunk_size`` (default 64),
            deprecated ``transpose_state_layout``.
    """
    _no_cp(cp_context)
    state_v_first = _state_v_first(state_v_first, kwargs)
    use_gate_in_kernel = kwargs.pop("use_gate_in_kernel", False)
    A_log, dt_bias = kwargs.pop("A_log", None), kwargs.pop("dt_bias", None)
    chunk_size = _chunk_size(kwargs)
    _check_varlen(q, initial_state, cu_seqlens)
    if v.shape[2] % q.shape[2] != 0:
        raise ValueError(f"For GVA, num_v_heads (HV={v.shape[2]}) must be divisible by num_heads (H={q.shape[2]}).")
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError("A_log must be provided when use_gate_in_kernel=True.")
        gf = _gdn_gate(g, A_log, dt_bias)
    else:
        gf = g.float()
    betaf = _beta_in(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    if betaf.dim() != 3:
        raise ValueError(f"beta must be [B, T, HV] for the chunk gated delta rule, got shape {tuple(beta.shape)}.")
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    qf, kf, vf = _prepare(q, k, v, use_qk_l2norm_in_kernel)
    o, ht = _varlen(
        _chunk_core,
        cu_seqlens,
        (qf, kf, vf, betaf, gf),
        _state_in(initial_state, state_v_first),
        output_final_state,
        scale=scale,
        chunk_size=chunk_size,
    )
    return o.to(v.dtype), _state_out(ht, state_v_first)


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Torch version of ``fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule`` (token-by-token; decoding).

    Args: as :func:`chunk_gated_delta_rule`, plus optional per-key ``gk [B, T, HV, K]`` and per-value
    ``gv [B, T, HV, V]`` log decays; ``beta`` may be head-wise ``[B, T, HV, V]`` and defaults to ones.
    """
    state_v_first = _state_v_first(state_v_first, kwargs)
    _check_varlen(q, initial_state, cu_seqlens)
    if v.shape[2] % q.shape[2] != 0:
        raise ValueError(f"For GVA, num_v_heads (HV={v.shape[2]}) must be divisible by num_heads (H={q.shape[2]}).")
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    if beta is None:
        beta = torch.ones_like(v[..., 0])
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError("`A_log` must be provided when `use_gate_in_kernel=True`.")
        if g is None:
            raise ValueError("`g` (raw pre-activation) must be provided when `use_gate_in_kernel=True`.")
        gf = _gdn_gate(g, A_log, dt_bias)
    else:
        gf = None if g is None else g.float()
    betaf = _beta_in(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    qf, kf, vf = _prepare(q, k, v, use_qk_l2norm_in_kernel)
    gkf = None if gk is None else gk.float()
    gvf = None if gv is None else gv.float()
    o, ht = _varlen(
        _recurrent_core,
        cu_seqlens,
        (qf, kf, vf, betaf, gf, gkf, gvf),
        _state_in(initial_state, state_v_first),
        output_final_state,
        scale=scale,
    )
    return o.to(v.dtype), _state_out(ht, state_v_first)


# --------------------------------------------------------------------------------------------------------------------
# short convolution
# --------------------------------------------------------------------------------------------------------------------
def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation in ("silu", "swish"):
        return F.silu(y)
    if activation is None:
        return y
    raise ValueError(f"activation={activation!r} is not supported; valid: 'silu', 'swish', None.")


def _conv_core(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    activation: str | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Depthwise causal conv of ``x [B, T, D]`` with weight ``[D, W]`` and cache ``[B, D, W]`` (last W inputs)."""
    B, _, D = x.shape
    W = weight.shape[-1]
    xt = x.transpose(1, 2)  # [B, D, T]
    hist = initial_state if initial_state is not None else x.new_zeros(B, D, W)
    xpad = torch.cat([hist[..., 1:].to(x.dtype), xt], dim=-1)  # [B, D, W-1+T]
    y = F.conv1d(xpad.float(), weight.float().unsqueeze(1), None if bias is None else bias.float(), groups=D)
    y = _activate(y.transpose(1, 2), activation)
    if residual is not None:
        y = y + residual.float()
    final = None
    if output_final_state:
        final = torch.cat([hist.to(x.dtype), xt], dim=-1)[..., -W:].contiguous()
    return y.to(x.dtype), final


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool | None = False,
    activation: str | None = None,
    backend: str | None = "triton",
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    chunk_indices: torch.LongTensor | None = None,
    cp_context: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Torch version of ``fla.modules.causal_conv1d`` (ShortConvolution and GDN's fused q/k/v conv).

    ``y_t = act(sum_{w} weight[:, w] * x_{t - W + 1 + w} + bias) + residual``, where positions before the start read
    the last ``W - 1`` columns of ``initial_state`` (zeros if None). The final state is the last ``W`` inputs.

    Args:
        x: ``[B, T, D]`` (or ``[B, T, H, d]`` with ``H * d = D``); weight: ``[D, W]``; bias: ``[D]``;
        residual: ``[B, T, D]`` added after the activation; initial_state: ``[N, D, W]``;
        output_final_state: also return ``[N, D, W]``; activation: 'silu'/'swish'/None;
        backend: ignored (any of fla's backends computes the same function); cu_seqlens: packed boundaries.
    """
    _no_cp(cp_context)
    if weight is None:
        raise ValueError("weight=None is not supported by the torch fallback; valid: a [D, W] tensor.")
    shape = x.shape
    if x.shape[-1] != weight.shape[0]:
        x = x.reshape(*x.shape[:2], -1)
    if residual is not None:
        residual = residual.reshape(x.shape)
    if cu_seqlens is None:
        y, final = _conv_core(x, weight, bias, residual, initial_state, bool(output_final_state), activation)
    else:
        if x.shape[0] != 1:
            raise ValueError(f"The batch size is expected to be 1 rather than {x.shape[0]} when using `cu_seqlens`.")
        bounds = [int(b) for b in cu_seqlens.tolist()]
        ys, finals = [], []
        for i, (bos, eos) in enumerate(itertools.pairwise(bounds)):
            h0 = None if initial_state is None else initial_state[i : i + 1]
            r = None if residual is None else residual[:, bos:eos]
            y_i, f_i = _conv_core(x[:, bos:eos], weight, bias, r, h0, bool(output_final_state), activation)
            ys.append(y_i)
            finals.append(f_i)
        y = torch.cat(ys, dim=1)
        final = torch.cat(finals, dim=0) if output_final_state else None
    return y.view(shape), final


def causal_conv1d_update(
    x: torch.Tensor,
    cache: torch.Tensor,
    residual: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch version of ``fla.modules.causal_conv1d_update``: one decoding step, updating ``cache`` in place.

    Args:
        x: one token per sequence, ``[N, D]``, ``[N, 1, D]`` or ``[1, N, D]``; cache: ``[N, D, W]``, shifted left
        by one with ``x`` written into the last column; residual, weight ``[D, W]``, bias, activation: as
        :func:`causal_conv1d`.
    """
    if weight is None:
        raise ValueError("weight=None is not supported by the torch fallback; valid: a [D, W] tensor.")
    shape = x.shape
    D = weight.shape[0]
    x2 = x.reshape(-1, D)  # [N, D]
    new_cache = torch.cat([cache[..., 1:], x2.unsqueeze(-1).to(cache.dtype)], dim=-1)
    y = (new_cache.float() * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    y = _activate(y, activation)
    if residual is not None:
        y = y + residual.reshape(-1, D).float()
    with torch.no_grad():
        cache.copy_(new_cache)
    return y.to(x.dtype).view(shape), cache


def short_conv_step(
    self: Any,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    cache: torch.Tensor | None,
    output_final_state: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Torch version of ``fla.modules.ShortConvolution.step`` (any backend): one token per sequence."""
    B, _, D = x.shape
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    if cache is None:
        cache = x.new_zeros(N, D, self.kernel_size[0])
    y, cache = causal_conv1d_update(
        x=x, cache=cache, residual=residual, weight=self.weight.squeeze(1), bias=self.bias, activation=self.activation
    )
    return y, (cache if output_final_state else None)


# --------------------------------------------------------------------------------------------------------------------
# norms, activations, loss
# --------------------------------------------------------------------------------------------------------------------
def _norm_core(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    eps: float,
    prenorm: bool,
    residual_in_fp32: bool,
    is_rms_norm: bool,
    gate: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """fla's (gated) layer/RMS norm with the fused residual add: ``h = x + residual``; ``y = norm(h) * w + b``;
    gated: ``y *= silu(gate)`` ('swish'/'silu') or ``sigmoid(gate)``; returns ``y`` (x's dtype) or ``(y, h)``."""
    xf = x.float()
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}.")
        xf = xf + residual.float()
        res_dtype = residual.dtype
    else:
        res_dtype = torch.float32 if residual_in_fp32 else x.dtype
    if is_rms_norm:
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    else:
        mu = xf.mean(-1, keepdim=True)
        y = (xf - mu) * torch.rsqrt((xf - mu).square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    if gate is not None:
        gf = gate.float()
        if activation in ("swish", "silu"):
            y = y * F.silu(gf)
        elif activation == "sigmoid":
            y = y * torch.sigmoid(gf)
        else:
            raise ValueError(f"activation={activation!r} is not supported; valid: 'swish', 'silu', 'sigmoid'.")
    y = y.to(x.dtype)
    if not prenorm:
        return y
    return y, (x if residual is None and res_dtype == x.dtype else xf.to(res_dtype))


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None = None,
    eps: float = 1e-5,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Torch version of ``fla.modules.norm.layernorm.rms_norm`` (``fla.modules.RMSNorm``).

    Args:
        x: ``[..., D]``; weight/bias: ``[D]`` or None; residual: added to x before the norm;
        eps: variance epsilon; prenorm: also return the (residual-added) input; residual_in_fp32: keep it float32.
    """
    return _norm_core(x, weight, bias, residual, eps, prenorm, residual_in_fp32, True)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None = None,
    eps: float = 1e-5,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
    is_rms_norm: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Torch version of ``fla.modules.norm.layernorm.layer_norm`` (``fla.modules.LayerNorm``); args as rms_norm."""
    return _norm_core(x, weight, bias, residual, eps, prenorm, residual_in_fp32, is_rms_norm)


def rms_norm_gated(
    x: torch.Tensor,
    g: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    activation: str = "swish",
    residual: torch.Tensor | None = None,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Torch version of ``fla.modules.norm.fused_norm_gate.rms_norm_gated`` (``FusedRMSNormGated``):
    ``rmsnorm(x) * weight * act(g)`` with act = silu ('swish'/'silu') or sigmoid."""
    return _norm_core(x, weight, bias, residual, eps, prenorm, residual_in_fp32, True, gate=g, activation=activation)


def layer_norm_gated(
    x: torch.Tensor,
    g: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    activation: str = "swish",
    residual: torch.Tensor | None = None,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Torch version of ``fla.modules.norm.fused_norm_gate.layer_norm_gated`` (``FusedLayerNormGated``)."""
    return _norm_core(x, weight, bias, residual, eps, prenorm, residual_in_fp32, False, gate=g, activation=activation)


def swiglu(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Torch version of ``fla.modules.activations.swiglu``: ``silu(x) * y`` (float32 math, x's dtype)."""
    return (F.silu(x.float()) * y.float()).to(x.dtype)


def swiglu_linear(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Torch version of ``fla.modules.activations.swiglu_linear``: ``linear(silu(x) * y, weight, bias)``."""
    return F.linear(swiglu(x, y).to(weight.dtype), weight, bias)


def elu_p1(x: torch.Tensor) -> torch.Tensor:
    """Torch version of ``fla.modules.activations.elu_p1``: ``elu(x) + 1`` (float32 math, x's dtype)."""
    return (F.elu(x.float()) + 1.0).to(x.dtype)


def cross_entropy_loss(
    logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    logit_scale: float = 1.0,
    lse_square_scale: float = 0.0,
    logit_softcapping: float | None = None,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unreduced float32 cross entropy ``[N]`` and its (non-differentiable) z-loss ``[N]``, as fla's fused kernel.

    ``loss = lse(z) - (1-s) z_y - s mean(z) + lse_square_scale * lse^2`` with ``z = softcap(logit_scale * logits)``,
    zero at ``ignore_index`` targets.
    """
    z = logits.float() * logit_scale
    if logit_softcapping is not None:
        z = logit_softcapping * torch.tanh(z / logit_softcapping)
    lse = torch.logsumexp(z, dim=-1)
    valid = target != ignore_index
    tgt = torch.where(valid, target, torch.zeros_like(target))
    z_y = z.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
    loss = -z_y
    if label_smoothing > 0:
        loss = (1 - label_smoothing) * loss - label_smoothing * z.sum(-1) / z.shape[-1]
    z_loss = lse_square_scale * lse.square()
    loss = loss + lse + z_loss
    zero = torch.zeros((), dtype=loss.dtype, device=loss.device)
    return torch.where(valid, loss, zero), torch.where(valid, z_loss, zero).detach()


def fused_cross_entropy_forward(self: Any, input: torch.Tensor, target: torch.Tensor) -> Any:
    """Torch version of ``fla.modules.FusedCrossEntropyLoss.forward`` (reductions 'mean', 'sum', 'none')."""
    if self.process_group is not None:
        raise ValueError("process_group is not supported by the torch fallback; valid: None.")
    loss, z_loss = cross_entropy_loss(
        input,
        target,
        self.label_smoothing,
        self.logit_scale,
        self.lse_square_scale,
        self.logit_softcapping,
        self.ignore_index,
    )
    if self.reduction != "none":
        loss = loss.sum()
        z_loss = z_loss.sum()
        if self.reduction == "mean":
            total = (target != self.ignore_index).sum()
            loss = loss / total
            z_loss = z_loss / total
    return (loss, z_loss) if self.return_z_loss else loss


# --------------------------------------------------------------------------------------------------------------------
# install / uninstall
# --------------------------------------------------------------------------------------------------------------------
#: (module holding fla's definition, attribute name) -> our torch implementation
PATCHED_FUNCTIONS: dict[tuple[str, str], Callable[..., Any]] = {
    ("fla.ops.delta_rule.chunk", "chunk_delta_rule"): chunk_delta_rule,
    ("fla.ops.delta_rule.fused_recurrent", "fused_recurrent_delta_rule"): fused_recurrent_delta_rule,
    ("fla.ops.gated_delta_rule.chunk", "chunk_gated_delta_rule"): chunk_gated_delta_rule,
    ("fla.ops.gated_delta_rule.fused_recurrent", "fused_recurrent_gated_delta_rule"): fused_recurrent_gated_delta_rule,
    ("fla.modules.causal_conv1d.ops", "causal_conv1d"): causal_conv1d,
    ("fla.modules.causal_conv1d.ops", "causal_conv1d_update"): causal_conv1d_update,
    ("fla.modules.norm.layernorm", "rms_norm"): rms_norm,
    ("fla.modules.norm.layernorm", "layer_norm"): layer_norm,
    ("fla.modules.norm.fused_norm_gate", "rms_norm_gated"): rms_norm_gated,
    ("fla.modules.norm.fused_norm_gate", "layer_norm_gated"): layer_norm_gated,
    ("fla.modules.activations.ops", "swiglu"): swiglu,
    ("fla.modules.activations.ops", "swiglu_linear"): swiglu_linear,
    ("fla.modules.activations.ops", "elu_p1"): elu_p1,
    ("fla.modules.norm.l2norm", "l2norm"): l2norm,
}

#: (module, class name, method name) -> our torch implementation (takes ``self``)
PATCHED_METHODS: dict[tuple[str, str, str], Callable[..., Any]] = {
    ("fla.modules.causal_conv1d.ops", "ShortConvolution", "step"): short_conv_step,
    ("fla.modules.fused_cross_entropy.ops", "FusedCrossEntropyLoss", "forward"): fused_cross_entropy_forward,
}

_TORCH_DEVICE_TYPES: set[str] = {"cpu"}
_ORIGINALS: dict[tuple[str, ...], Callable[..., Any]] = {}
_WRAPPERS: dict[tuple[str, ...], Callable[..., Any]] = {}
_REBOUND: list[tuple[Any, str, Callable[..., Any]]] = []  # (namespace object, attribute, original)


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    for a in kwargs.values():
        if isinstance(a, torch.Tensor):
            return a
    return None


def _use_torch(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    t = _first_tensor(args, kwargs)
    return t is not None and t.device.type in _TORCH_DEVICE_TYPES


def _make_function_wrapper(original: Callable[..., Any], impl: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _use_torch(args, kwargs):
            return impl(*args, **kwargs)
        return original(*args, **kwargs)

    wrapper._statereduce_original = original  # type: ignore[attr-defined]
    wrapper._statereduce_impl = impl  # type: ignore[attr-defined]
    return wrapper


def _make_method_wrapper(original: Callable[..., Any], impl: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _use_torch(args, kwargs):
            return impl(self, *args, **kwargs)
        return original(self, *args, **kwargs)

    wrapper._statereduce_original = original  # type: ignore[attr-defined]
    wrapper._statereduce_impl = impl  # type: ignore[attr-defined]
    return wrapper


def _fla_modules() -> list[Any]:
    return [m for name, m in list(sys.modules.items()) if m is not None and (name == "fla" or name.startswith("fla."))]


def install(torch_device_types: Iterable[str] = ("cpu",)) -> None:
    """Patch fla so that DeltaNet / Gated DeltaNet run on CPU tensors (idempotent; safe to call repeatedly).

    Imports ``fla`` (which loads every layer and model), wraps each function in :data:`PATCHED_FUNCTIONS` and each
    method in :data:`PATCHED_METHODS`, and rebinds every attribute of every loaded ``fla.*`` module that is the
    original function object (so ``from ... import`` copies in layer modules are replaced too). Calling it again
    re-scans modules loaded since and updates the device set.

    Args:
        torch_device_types: device types (``tensor.device.type``) routed to the torch implementations; all others
            go to fla's original kernels. Default ``("cpu",)``; e.g. ``("cpu", "cuda")`` to run everything in torch.
    """
    types = {str(t) for t in torch_device_types}
    if not types:
        raise ValueError(f"torch_device_types={tuple(torch_device_types)!r} is empty; valid: e.g. ('cpu',).")
    _TORCH_DEVICE_TYPES.clear()
    _TORCH_DEVICE_TYPES.update(types)
    importlib.import_module("fla")
    for (mod_name, attr), impl in PATCHED_FUNCTIONS.items():
        key = (mod_name, attr)
        if key not in _ORIGINALS:
            mod = importlib.import_module(mod_name)
            original = getattr(mod, attr)
            if hasattr(original, "_statereduce_original"):
                original = original._statereduce_original
            _ORIGINALS[key] = original
            _WRAPPERS[key] = _make_function_wrapper(original, impl)
    for (mod_name, cls_name, meth), impl in PATCHED_METHODS.items():
        key = (mod_name, cls_name, meth)
        cls = getattr(importlib.import_module(mod_name), cls_name)
        current = cls.__dict__[meth]
        if hasattr(current, "_statereduce_original"):
            continue
        _ORIGINALS[key] = current
        _WRAPPERS[key] = _make_method_wrapper(current, impl)
        setattr(cls, meth, _WRAPPERS[key])
        _REBOUND.append((cls, meth, current))
    originals = {id(_ORIGINALS[k]): _WRAPPERS[k] for k in PATCHED_FUNCTIONS if k in _ORIGINALS}
    for mod in _fla_modules():
        for attr, val in list(vars(mod).items()):
            wrapper = originals.get(id(val))
            if wrapper is not None:
                setattr(mod, attr, wrapper)
                _REBOUND.append((mod, attr, val))


def torch_device_types() -> frozenset[str]:
    """The device types :func:`install` currently routes to the torch implementations."""
    return frozenset(_TORCH_DEVICE_TYPES)


def uninstall() -> None:
    """Undo :func:`install`: restore every rebound attribute to fla's original function or method."""
    while _REBOUND:
        obj, attr, original = _REBOUND.pop()
        setattr(obj, attr, original)


def is_installed() -> bool:
    """Whether :func:`install` is in effect (the DeltaNet chunk op in ``fla.layers.delta_net`` is wrapped)."""
    mod = sys.modules.get("fla.layers.delta_net")
    return mod is not None and hasattr(getattr(mod, "chunk_delta_rule", None), "_statereduce_original")
