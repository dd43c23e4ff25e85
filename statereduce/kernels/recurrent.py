"""Triton kernels for one recurrent decode step that update the state in place.

A decode step of a DeltaNet / Gated DeltaNet layer reads the recurrent state ``S`` (``d_k x d_v`` per head, float32)
and writes it back; at large batch that traffic dominates the step (paper Sec. 5, App. G.1). fla 0.6.0's
``fused_recurrent_*`` functions write the new state to a *new* tensor. This module gives two in-place steps that
a CUDA graph can replay with static buffers:

- :func:`fla_delta_rule_step` / :func:`fla_gated_delta_rule_step`: fla's own Triton kernels launched exactly as
  fla launches them, but with the final state pointer equal to the initial one. Each program loads its state tile
  before it stores the same tile, and programs own disjoint tiles, so this is safe.
- :func:`recurrent_step`: our Triton kernel for ``T = 1``. fla's kernels give each program a ``BV = 8``-row tile
  with one warp, which moves the state at about 2.0 TB/s when ``d_k = 32`` on an H200. Ours tiles ``BV`` rows of
  the value dimension against the whole key dimension with a block shape and warp count autotuned per
  ``(d_k, d_v, layout)``, so small-``d_k`` states stream in wide coalesced rows. The L2 norm of q and k is done in
  the kernel in float32.

The recurrences are the delta rule ``S <- S + beta k (v - S^T k)^T`` and the gated delta rule with
``S <- exp(g) S`` first (paper Sec. 2), in fla's state layouts ``[N, HV, K, V]`` and (``state_v_first``)
``[N, HV, V, K]``. This module imports nothing else from the package.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

TILE_CONFIGS = ((16, 2), (16, 4), (32, 2), (32, 4), (32, 8), (64, 2), (64, 4), (64, 8), (128, 4), (128, 8))
"""(BV, num_warps) pairs the autotuner of :func:`recurrent_step` tries, each with and without streaming hints."""

_STEP = None  # the autotuned Triton kernel (:func:`_kernel`), built on first use

_PDL = True  # programmatic_launch's switch
_TUNED: set[tuple] = set()  # autotuning keys of recurrent_step already launched once (without PDL)


def pdl_supported(device: torch.device) -> bool:
    """Whether our decode kernels can use programmatic dependent launch on ``device`` (CUDA, Hopper or later, not
    under Triton's interpreter)."""
    return (device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
            and torch.cuda.get_device_capability(device)[0] >= 9)


@contextlib.contextmanager
def programmatic_launch(enabled: bool = True) -> Iterator[None]:
    """Within the block our decode kernels (:func:`recurrent_step`, :func:`statereduce.kernels.conv.conv_step`) use
    programmatic dependent launch (PDL) where :func:`pdl_supported` (``enabled=True``, the default outside any
    block) or never (``False``).

    With PDL a kernel's programs may start while the previous kernel in the stream still runs: each loads what that
    kernel does not write (the recurrent state, the conv cache), waits for it (``griddepcontrol.wait``), then reads
    its outputs; and each lets its own successor start early (``griddepcontrol.launch_dependents``). A captured CUDA
    graph keeps these edges. Results are identical either way; the launch gap and ramp-up of each of our kernels
    overlap the kernel before it. Kernels that are not ours (cuBLAS, fla's) launch as usual.
    """
    global _PDL
    before, _PDL = _PDL, bool(enabled)
    try:
        yield
    finally:
        _PDL = before


def launch_options(device: torch.device) -> dict:
    """The ``PDL`` constexpr (and Triton's ``launch_pdl`` option when on) for a launch of one of our decode kernels."""
    return {"PDL": True, "launch_pdl": True} if _PDL and pdl_supported(device) else {"PDL": False}


def _kernel():
    """:func:`step_kernel` autotuned over :data:`TILE_CONFIGS`, each with and without streaming hints; built on first
    use."""
    global _STEP
    if _STEP is not None:
        return _STEP
    # STREAM: load the state with evict-first and store it with the streaming (.cs) hint: each tile is touched once
    # per step, so keeping it in L2 only evicts the weights.
    configs = [triton.Config({"BV": bv, "STREAM": st}, num_warps=w) for bv, w in TILE_CONFIGS for st in (False, True)]

    def bench(fn, quantiles=None):  # short timing runs: 24 configs per key would take seconds at the defaults
        return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)

    # NHB (the number of state tiles' rows of programs, rounded to a power of two) is in the key so that a tile
    # tuned on a batch of one is not reused at batch 64, where the best tile differs. cache_results keeps the
    # choice in TRITON_CACHE_DIR, as fla does for its kernels.
    _STEP = triton.autotune(configs=configs, key=["K", "V", "STATE_V_FIRST", "USE_G", "NHB"], restore_value=["h"],
                            do_bench=bench, cache_results=True)(step_kernel)
    return _STEP


@triton.jit
def step_kernel(q, k, v, beta, g, A_log, dt_bias, h, o, scale, NHB, s_q, s_k, s_v, s_b, s_g,
                H: tl.constexpr, HV: tl.constexpr,
                K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, STREAM: tl.constexpr,
                STATE_V_FIRST: tl.constexpr, USE_G: tl.constexpr, GATE_IN_KERNEL: tl.constexpr,
                HAS_DT_BIAS: tl.constexpr, L2NORM: tl.constexpr, ROUND_QK: tl.constexpr,
                BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr, PDL: tl.constexpr):
    """One token's (gated) delta-rule step of one ``BV``-row tile of one sequence's value head: program
    ``(i_v, i_nh)`` owns rows ``[i_v * BV, (i_v + 1) * BV)`` of the value dimension of state ``i_nh`` (sequence
    ``i_nh // HV``, value head ``i_nh % HV``) against the whole key dimension."""
    if PDL:  # let the next kernel's programs start while our last ones run (it waits for our results)
        gdc_launch_dependents()
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1).to(tl.int64)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V

    # the state first: the previous kernel does not write it (this layer's step of the previous token did), so
    # with PDL its load overlaps that kernel's tail; q, k, v, beta and g are its outputs, read after gdc_wait
    p_h, m_h = _state_tile(h, i_nh, o_k, o_v, m_k, m_v, K, V, STATE_V_FIRST)
    if STREAM:
        b_h = tl.load(p_h, mask=m_h, other=0, eviction_policy="evict_first").to(tl.float32)
    else:
        b_h = tl.load(p_h, mask=m_h, other=0).to(tl.float32)
    if PDL:
        gdc_wait()

    # s_*: each input's stride between sequences (heads and channels are packed within a sequence's row)
    b_q = tl.load(q + i_n * s_q + i_h * K + o_k, mask=m_k, other=0).to(tl.float32)
    b_k = tl.load(k + i_n * s_k + i_h * K + o_k, mask=m_k, other=0).to(tl.float32)
    b_v = tl.load(v + i_n * s_v + i_hv * V + o_v, mask=m_v, other=0).to(tl.float32)
    b_beta = tl.load(beta + i_n * s_b + i_hv).to(tl.float32)
    b_q, b_k, b_beta = _step_inputs(b_q, b_k, b_beta, q, k, scale, L2NORM, ROUND_QK, BETA_SIGMOID, NEG_EIGVAL)
    if USE_G:
        b_h = b_h * tl.exp(_log_decay(g, A_log, dt_bias, i_n, i_hv, s_g, GATE_IN_KERNEL, HAS_DT_BIAS))

    b_h, b_o = _delta_update(b_h, b_q, b_k, b_v, b_beta, STATE_V_FIRST)
    if STREAM:
        tl.store(p_h, b_h.to(p_h.dtype.element_ty), mask=m_h, cache_modifier=".cs")
    else:
        tl.store(p_h, b_h.to(p_h.dtype.element_ty), mask=m_h)
    tl.store(o + (i_n * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)


@triton.jit
def _state_tile(h, i_nh, o_k, o_v, m_k, m_v, K: tl.constexpr, V: tl.constexpr, STATE_V_FIRST: tl.constexpr):
    """The pointers and mask of a program's state tile (:func:`step_kernel`), in either state layout."""
    if STATE_V_FIRST:
        p_h = h + i_nh * K * V + o_v[:, None] * K + o_k[None, :]
        m_h = m_v[:, None] & m_k[None, :]
    else:
        p_h = h + i_nh * K * V + o_k[:, None] * V + o_v[None, :]
        m_h = m_k[:, None] & m_v[None, :]
    return p_h, m_h


@triton.jit
def _step_inputs(b_q, b_k, b_beta, q, k, scale, L2NORM: tl.constexpr, ROUND_QK: tl.constexpr,
                 BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr):
    """q and k L2-normalised (and rounded to their dtype, ``ROUND_QK``) when ``L2NORM``, q scaled, beta through its
    sigmoid (times 2, ``NEG_EIGVAL``) when ``BETA_SIGMOID``: all in float32."""
    if L2NORM:
        b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)
        b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
        if ROUND_QK:  # as fla's DeltaNet, which normalises q and k in a kernel of their own dtype first
            b_q = b_q.to(q.dtype.element_ty).to(tl.float32)
            b_k = b_k.to(k.dtype.element_ty).to(tl.float32)
    b_q = b_q * scale
    if BETA_SIGMOID:
        b_beta = tl.sigmoid(b_beta)
        if NEG_EIGVAL:
            b_beta = b_beta * 2
    return b_q, b_k, b_beta


@triton.jit
def _log_decay(g, A_log, dt_bias, i_n, i_hv, s_g, GATE_IN_KERNEL: tl.constexpr, HAS_DT_BIAS: tl.constexpr):
    """The log decay of value head ``i_hv`` of sequence ``i_n``: ``g``, or from its raw input with
    ``GATE_IN_KERNEL``, ``-exp(A_log) * softplus(g + dt_bias)`` (fla's ``use_gate_in_kernel``)."""
    b_g = tl.load(g + i_n * s_g + i_hv).to(tl.float32)
    if GATE_IN_KERNEL:
        if HAS_DT_BIAS:
            b_g = b_g + tl.load(dt_bias + i_hv).to(tl.float32)
        # softplus with fla's threshold (x > 20: x)
        b_sp = tl.where(b_g > 20.0, b_g, tl.log(1 + tl.exp(tl.minimum(b_g, 20.0))))
        b_g = -tl.exp(tl.load(A_log + i_hv).to(tl.float32)) * b_sp
    return b_g


@triton.jit
def _delta_update(b_h, b_q, b_k, b_v, b_beta, STATE_V_FIRST: tl.constexpr):
    """The delta rule on a (decayed) state tile: ``S <- S + beta k (v - S^T k)^T``, and the output ``S^T q``."""
    if STATE_V_FIRST:
        b_u = b_beta * (b_v - tl.sum(b_h * b_k[None, :], 1))
        b_h = b_h + b_u[:, None] * b_k[None, :]
        b_o = tl.sum(b_h * b_q[None, :], 1)
    else:
        b_u = b_beta * (b_v - tl.sum(b_h * b_k[:, None], 0))
        b_h = b_h + b_k[:, None] * b_u[None, :]
        b_o = tl.sum(b_h * b_q[:, None], 0)
    return b_h, b_o


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, state: torch.Tensor, *,
                   g: torch.Tensor | None = None, A_log: torch.Tensor | None = None,
                   dt_bias: torch.Tensor | None = None, scale: float | None = None, l2norm: bool = False,
                   round_qk: bool = False, beta_sigmoid: bool = False, allow_neg_eigval: bool = False,
                   state_v_first: bool = False, block_v: int | None = None, num_warps: int | None = None,
                   stream: bool = False) -> torch.Tensor:
    """One delta-rule (``g is None``) or gated-delta-rule step; ``state`` is updated in place.

    Args:
        q, k: ``[N, 1, H, K]``; v: ``[N, 1, HV, V]`` (HV a multiple of H: grouped value heads). These, beta and g
            may be views into wider rows (slices of a fused projection's output): each sequence's heads must lie
            next to each other, the sequences at any stride; other layouts are copied.
        beta: ``[N, 1, HV]``, one writing strength per head (raw logits when ``beta_sigmoid``).
        state: ``[N, HV, K, V]`` float32 (``[N, HV, V, K]`` when ``state_v_first``), contiguous; updated in place.
        g: ``[N, 1, HV]`` log decay, or its raw input when ``A_log`` is given (then
            ``g = -exp(A_log) * softplus(g + dt_bias)``, fla's ``use_gate_in_kernel``).
        scale: query scale, default ``K ** -0.5``.
        l2norm: L2-normalise q and k (``x / sqrt(sum(x^2) + 1e-6)``) in the kernel.
        round_qk: round the normalised q and k to their dtype, as fla's DeltaNet does (its L2 norm is a separate
            kernel writing q's dtype); Gated DeltaNet normalises in float32 (``False``).
        beta_sigmoid, allow_neg_eigval: ``beta = sigmoid(beta)`` (times 2 with ``allow_neg_eigval``).
        state_v_first: the state layout, as fla's argument of that name.
        block_v, num_warps: a fixed tile height and warp count instead of the autotuned choice (both or neither;
            also used under ``TRITON_INTERPRET=1``, where the autotuner cannot time, with 16 and 4 by default).
        stream: with a fixed tile, load and store the state with streaming cache hints (an autotuned choice
            otherwise).

    Returns:
        The output ``[N, 1, HV, V]`` in v's dtype.
    """
    n, t, h, kd = k.shape
    hv, vd = v.shape[2], v.shape[3]
    if t != 1 or q.shape != k.shape or v.shape[:2] != (n, 1) or hv % h:
        raise ValueError(f"recurrent_step takes one token: q, k [N, 1, H, K], v [N, 1, HV, V]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    want = (n, hv, vd, kd) if state_v_first else (n, hv, kd, vd)
    if tuple(state.shape) != want or state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"state must be a contiguous float32 tensor of shape {want}; got {tuple(state.shape)} "
                         f"{state.dtype}{'' if state.is_contiguous() else ', strided ' + str(state.stride())}")
    if beta.numel() != n * hv:
        raise ValueError(f"beta must hold one value per (sequence, head) = {n * hv}; got shape {tuple(beta.shape)}")
    # rows of packed heads: views into a wider row (a fused projection's output) are read in place
    q, k = _rows(q, n, h * kd), _rows(k, n, h * kd)
    v, beta = _rows(v, n, hv * vd), _rows(beta, n, hv)
    g = _rows(g, n, hv) if g is not None else None
    o = torch.empty(n, 1, hv, vd, dtype=v.dtype, device=v.device)
    kernel = _kernel()
    fixed: dict = {}
    if (block_v is None) != (num_warps is None):
        raise ValueError(f"give both block_v and num_warps or neither; got block_v={block_v}, num_warps={num_warps}")
    if block_v is None and os.environ.get("TRITON_INTERPRET") == "1":
        block_v, num_warps = 16, 4
    if block_v is not None:
        kernel, fixed = kernel.fn, {"BV": int(block_v), "num_warps": int(num_warps), "STREAM": bool(stream)}
    grid = lambda meta: (triton.cdiv(vd, meta["BV"]), n * hv)
    launch = launch_options(state.device)
    nhb = triton.next_power_of_2(n * hv)
    if not fixed and launch["PDL"]:
        # The first call of an autotuning key runs without PDL: triton's do_bench flushes L2 (a 256 MB memset) just
        # before each timed launch, and a PDL launch may start under that memset, so its timings would include it
        # (seen on the H200: 70 us for a 3 us step, and a poor tile picked). The tile chosen serves PDL launches too.
        key = (kd, vd, state_v_first, nhb, *(None if t is None else t.dtype for t in (q, k, v, beta, g, A_log,
                                                                                       dt_bias, o)))
        if key not in _TUNED:
            _TUNED.add(key)
            launch = {"PDL": False}
    kernel[grid](q, k, v, beta, g, A_log, dt_bias, state, o, kd ** -0.5 if scale is None else scale, nhb,
                 q.stride(0), k.stride(0), v.stride(0), beta.stride(0), g.stride(0) if g is not None else 0, H=h,
                 HV=hv, K=kd, V=vd, BK=triton.next_power_of_2(kd), STATE_V_FIRST=state_v_first, USE_G=g is not None,
                 GATE_IN_KERNEL=A_log is not None, HAS_DT_BIAS=dt_bias is not None, L2NORM=l2norm, ROUND_QK=round_qk,
                 BETA_SIGMOID=beta_sigmoid, NEG_EIGVAL=allow_neg_eigval, **launch, **fixed)
    return o


def _rows(x: torch.Tensor, n: int, width: int) -> torch.Tensor:
    """``x`` as ``[n, width]`` with unit stride along a row, as a view when its layout allows (else a copy)."""
    x = x.reshape(n, width)
    return x if x.stride(1) == 1 or width == 1 else x.contiguous()


# ---------------------------------------------------------------------------------------------
# fla's kernels, in place
# ---------------------------------------------------------------------------------------------
def fla_delta_rule_step(q, k, v, beta, state, *, scale=None, l2norm=False) -> torch.Tensor:
    """fla's DeltaNet recurrent kernel for one token with the final state written over ``state`` (``[N, H, K, V]``)."""
    from fla.modules.norm.l2norm import l2norm_fwd
    from fla.ops.delta_rule.fused_recurrent import fused_recurrent_delta_rule_fwd_kernel

    if l2norm:
        q, k = l2norm_fwd(q)[0], l2norm_fwd(k)[0]
    n, t, h, kd = k.shape
    vd = v.shape[-1]
    bk, bv = triton.next_power_of_2(kd), min(triton.next_power_of_2(vd), 8)  # as fused_recurrent_delta_rule_fwd
    o = q.new_empty(1, *v.shape)
    u = torch.empty_like(v)
    fused_recurrent_delta_rule_fwd_kernel[(triton.cdiv(vd, bv) * n * h,)](
        q, k, v, u, beta, o, state, state, None, kd ** -0.5 if scale is None else scale, T=t, B=n, H=h, K=kd, V=vd,
        BK=bk, BV=bv, IS_BETA_HEADWISE=beta.ndim == v.ndim, num_warps=1, num_stages=1)
    return o.squeeze(0)


def fla_gated_delta_rule_step(q, k, v, beta, state, *, g=None, A_log=None, dt_bias=None, scale=None, l2norm=False,
                              beta_sigmoid=False, allow_neg_eigval=False, state_v_first=False) -> torch.Tensor:
    """fla's Gated DeltaNet recurrent kernel for one token with the final state written over ``state``."""
    from fla.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule_fwd_kernel

    n, t, h, kd = k.shape
    hv, vd = v.shape[2], v.shape[3]
    bk, bv = triton.next_power_of_2(kd), min(8, triton.next_power_of_2(vd))  # as fused_recurrent_gated_delta_rule_fwd
    o = torch.empty_like(v)
    fused_recurrent_gated_delta_rule_fwd_kernel[(triton.cdiv(vd, bv) * n * hv,)](
        q=q, k=k, v=v, g=g, gk=None, gv=None, beta=beta, A_log=A_log, dt_bias=dt_bias, o=o, h0=state, ht=state,
        cu_seqlens=None, scale=kd ** -0.5 if scale is None else scale, T=t, H=h, HV=hv, K=kd, V=vd, BK=bk, BV=bv,
        IS_BETA_HEADWISE=beta.ndim != v.ndim, USE_QK_L2NORM_IN_KERNEL=l2norm, APPLY_BETA_SIGMOID=beta_sigmoid,
        ALLOW_NEG_EIGVAL=allow_neg_eigval, STATE_V_FIRST=state_v_first, num_warps=1, num_stages=3)
    return o
