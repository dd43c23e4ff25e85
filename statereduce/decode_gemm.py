"""A weight-streaming GEMM for decode-shaped projections (a few rows against a large weight), with split K.

At batch 64 a decode step's projections read each weight once and do little arithmetic, so their time is the weight
bytes over the bandwidth they reach. cuBLAS reaches 1.3 TB/s on DeltaNet's 2048 x 2048 output projection and 2.1
TB/s on its 5632 -> 2048 down projection on an H200 (docs/speed_h200.md; 4.26 TB/s copy bandwidth): with 2048
outputs there are too few output tiles to keep every SM streaming. :func:`linear` also splits the reduction
dimension, so that ``cdiv(N, BN) * SPLIT`` programs stream disjoint slices of the weight. Each program stores its
float32 partial tile to a workspace and counts itself in, and the program that arrives last for an output tile sums
the partials in a fixed order (the result is deterministic) and writes the output, then resets its counter for the
next call. One launch, no memset.

Options fused around the product (each removes a launch from the decode step):

- ``swiglu=True``: the input is ``[gate | up]`` (width ``2K``) and the product is taken of ``silu(gate) * up``,
  computed in float32 and rounded to the input dtype as fla's ``swiglu`` kernel does;
- ``residual``: added to the float32 accumulator before the output is rounded.

Our kernel launches with programmatic dependent launch where :func:`statereduce.decode.pdl_supported` (as the
recurrent step and the conv do), so its programs can take their SMs while the previous kernel drains.
"""

from __future__ import annotations

import os

import torch

from statereduce import decode

SPLITS = (1, 2, 4, 8)
TILES = ((32, 128), (64, 128), (64, 256), (128, 64), (128, 128))
"""(BN, BK) pairs; with each split in :data:`SPLITS` the autotuner's candidates, pruned by :func:`_prune`."""

MAX_PROGRAMS = 1024
"""Candidates with more programs than this (or split candidates with programs for under 3/4 of the SMs) are not
timed."""

_KERNEL = None
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_WORKSPACE: dict[torch.device, torch.Tensor] = {}


def _prune(configs, named_args, **kwargs):
    """The candidates worth timing for this shape: BK dividing K, no empty slice, at most :data:`MAX_PROGRAMS`
    programs, and a split only where it gives most SMs a program."""
    args = {**named_args, **kwargs}  # the autotuner passes constexprs given by keyword (K) in kwargs
    n, k = args["N"], args["K"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132
    keep = []
    for c in configs:
        bn, bk, split = c.kwargs["BN"], c.kwargs["BK"], c.kwargs["SPLIT"]
        programs = -(-n // bn) * split
        steps = -(-(k // bk) // split)  # K blocks per slice, as the kernel takes them
        if (k % bk == 0 and (split - 1) * steps * bk < k and programs <= MAX_PROGRAMS
                and (split == 1 or 4 * programs >= 3 * sms)):
            keep.append(c)
    return keep or [c for c in configs if c.kwargs["SPLIT"] == 1]


def _kernel():
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    configs = [triton.Config({"BN": bn, "BK": bk, "SPLIT": s}, num_warps=4, num_stages=4)
               for bn, bk in TILES for s in SPLITS]

    def bench(fn, quantiles=None):
        return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)

    @triton.autotune(configs=configs, key=["N", "K", "BM", "SWIGLU"], prune_configs_by={"early_config_prune": _prune},
                     do_bench=bench, cache_results=True)
    @triton.jit
    def linear_kernel(x, w, y, r, ws, counters, M, N, s_x, s_w, s_y, s_r, K: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
                      SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr, PRECISION: tl.constexpr,
                      PDL: tl.constexpr):
        if PDL:
            gdc_launch_dependents()
        i_n = tl.program_id(0)
        i_s = tl.program_id(1)
        o_m = tl.arange(0, BM)
        o_n = i_n * BN + tl.arange(0, BN)
        m_m = o_m < M
        m_n = o_n < N
        # this program's slice of K: STEPS blocks of BK (the last slice may run past K: masked, EVEN_K False)
        STEPS: tl.constexpr = (K // BK + SPLIT - 1) // SPLIT
        EVEN_K: tl.constexpr = K % (BK * SPLIT) == 0
        o_k = i_s * STEPS * BK + tl.arange(0, BK)
        p_x = x + o_m[:, None] * s_x + o_k[None, :]
        p_w = w + o_n[None, :].to(tl.int64) * s_w + o_k[:, None]
        if PDL:
            gdc_wait()
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for i in range(STEPS):
            if EVEN_K:
                m_x, m_w = m_m[:, None], m_n[None, :]
            else:
                m_k = o_k + i * BK < K
                m_x, m_w = m_m[:, None] & m_k[None, :], m_n[None, :] & m_k[:, None]
            if SWIGLU:  # x holds [gate | up]: the product is taken of silu(gate) * up, rounded as fla's swiglu
                b_g = tl.load(p_x, mask=m_x, other=0).to(tl.float32)
                b_u = tl.load(p_x + K, mask=m_x, other=0).to(tl.float32)
                b_x = (b_g * tl.sigmoid(b_g) * b_u).to(w.dtype.element_ty)
            else:
                b_x = tl.load(p_x, mask=m_x, other=0)
            b_w = tl.load(p_w, mask=m_w, other=0)
            acc = tl.dot(b_x, b_w, acc, input_precision=PRECISION)
            p_x += BK
            p_w += BK
        p_y = y + o_m[:, None] * s_y + o_n[None, :]
        m_y = m_m[:, None] & m_n[None, :]
        if SPLIT > 1:
            # each slice's partial to the workspace; the last program in for this tile sums them in slice order
            p_ws = ws + (i_s * BM + o_m[:, None]) * N + o_n[None, :]
            tl.store(p_ws, acc, mask=m_y)
            tl.debug_barrier()
            arrived = tl.atomic_add(counters + i_n, 1, sem="acq_rel")
            if arrived == SPLIT - 1:
                acc = tl.zeros((BM, BN), dtype=tl.float32)
                for s in range(SPLIT):
                    acc += tl.load(ws + (s * BM + o_m[:, None]) * N + o_n[None, :], mask=m_y, other=0,
                                   cache_modifier=".cg")
                if RESIDUAL:
                    acc += tl.load(r + o_m[:, None] * s_r + o_n[None, :], mask=m_y, other=0).to(tl.float32)
                tl.store(p_y, acc.to(y.dtype.element_ty), mask=m_y)
                tl.atomic_xchg(counters + i_n, 0, sem="relaxed")
        else:
            if RESIDUAL:
                acc += tl.load(r + o_m[:, None] * s_r + o_n[None, :], mask=m_y, other=0).to(tl.float32)
            tl.store(p_y, acc.to(y.dtype.element_ty), mask=m_y)

    _KERNEL = linear_kernel
    return _KERNEL


def _buffers(device: torch.device, tiles: int, floats: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The device's tile counters (zero between calls: each call's last programs reset theirs) and float32
    workspace, grown when a call needs more. Grow them outside graph capture (:func:`reserve`)."""
    counters, ws = _COUNTERS.get(device), _WORKSPACE.get(device)
    if counters is None or counters.numel() < tiles:
        counters = _COUNTERS[device] = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
    if ws is None or ws.numel() < floats:
        ws = _WORKSPACE[device] = torch.empty(max(floats, 1 << 20), dtype=torch.float32, device=device)
    return counters, ws


def _bm(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64


def reserve(device: torch.device, rows: int, n: int) -> None:
    """Allocate the counters and workspace a call with ``rows`` rows and ``n`` outputs may need (before a graph
    capture: buffers grown during a capture would belong to the graph's pool)."""
    _buffers(device, -(-n // min(bn for bn, _ in TILES)), max(SPLITS) * _bm(rows) * n)


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear` takes this call: a weight whose K is a multiple of 64, x in its dtype, at most 64 rows.
    (float32 products are exact, ``ieee``: for tests under Triton's interpreter, whose bf16 dot is wrong in Triton
    3.6; decode runs bf16.)"""
    return (weight.dtype in (torch.bfloat16, torch.float16, torch.float32) and x.dtype == weight.dtype and weight.dim() == 2
            and weight.shape[1] % 64 == 0 and x.numel() // x.shape[-1] <= 64 and weight.is_contiguous())


def linear(x: torch.Tensor, weight: torch.Tensor, *, residual: torch.Tensor | None = None,
           swiglu: bool = False, config: dict | None = None) -> torch.Tensor:
    """``x @ weight.T`` (``+ residual``) for up to 64 rows; ``swiglu``: of ``silu(gate) * up`` with ``x = [gate | up]``.

    Args:
        x: ``[..., K]`` (``[..., 2K]`` with ``swiglu``), rows at any stride, unit stride along a row; at most 64 rows.
        weight: ``[N, K]`` contiguous, x's dtype (an ``nn.Linear`` weight).
        residual: ``[..., N]`` like the output, added in float32 before rounding.
        config: a fixed ``{"BN", "BK", "SPLIT"}`` instead of the autotuned choice (tests; under
            ``TRITON_INTERPRET=1`` the default is ``{"BN": 32, "BK": 32, "SPLIT": 2}``).
    """
    import triton

    n, kd = weight.shape
    lead = x.shape[:-1]
    width = 2 * kd if swiglu else kd
    if x.shape[-1] != width or not weight.is_contiguous() or x.dtype != weight.dtype:
        raise ValueError(f"linear: x must be [..., {width}] in the weight's dtype {weight.dtype} and the weight "
                         f"contiguous; got x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)}")
    x2 = x.reshape(-1, width)
    m = x2.shape[0]
    if m > 64:
        raise ValueError(f"linear takes at most 64 rows (decode batches); got {m}")
    if kd % 64:
        raise ValueError(f"linear: K must be a multiple of 64; got {kd}")
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    r = None
    if residual is not None:
        r = residual.reshape(m, n)
        r = r if r.stride(1) == 1 else r.contiguous()
    bm = _bm(m)
    counters, ws = _buffers(x.device, -(-n // min(bn for bn, _ in TILES)), max(SPLITS) * bm * n)
    kernel, fixed = _kernel(), {}
    if config is None and os.environ.get("TRITON_INTERPRET") == "1":
        config = {"BN": 32, "BK": 32, "SPLIT": 2}
    if config is not None:
        steps = -(-(kd // config["BK"]) // config["SPLIT"])
        if kd % config["BK"] or (config["SPLIT"] - 1) * steps * config["BK"] >= kd:
            raise ValueError(f"linear: config {config} does not split K = {kd} (BK must divide it, no slice empty)")
        kernel, fixed = kernel.fn, {**config, "num_warps": 4}
    launch = decode.launch_options(x.device)
    if not fixed and launch["PDL"]:  # first launch of an autotuning key without PDL (see decode.recurrent_step)
        key = ("linear", n, kd, bm, swiglu, x.dtype)
        if key not in decode._TUNED:
            decode._TUNED.add(key)
            launch = {"PDL": False}
    grid = lambda meta: (triton.cdiv(n, meta["BN"]), meta["SPLIT"])
    kernel[grid](x2, weight, y, r, ws, counters, m, n, x2.stride(0), weight.stride(0), y.stride(0),
                 r.stride(0) if r is not None else 0, K=kd, BM=bm, SWIGLU=swiglu, RESIDUAL=r is not None,
                 PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **launch,
                 **fixed)
    return y.reshape(*lead, n)
