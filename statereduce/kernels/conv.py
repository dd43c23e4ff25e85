"""One Triton launch for the one-token step of three depthwise short convolutions (fla's ``ShortConvolution``).

:func:`conv_step` updates the q, k and v conv caches in place and writes the convolved (and SiLU-activated) row,
optionally as three contiguous tensors, with extra columns through a sigmoid and q, k L2-normalised per head.
This module imports nothing else from the package except the launch options of :mod:`.recurrent`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from statereduce.kernels.recurrent import launch_options


@triton.jit
def _conv_segment(x, y, cache, w, b, i_n, i_b, s_x, s_y, OFF: tl.constexpr, D: tl.constexpr, W: tl.constexpr,
                  BD: tl.constexpr, BW: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                  PDL: tl.constexpr, L2: tl.constexpr = 0):
    o_d = i_b * BD + tl.arange(0, BD)
    o_w = tl.arange(0, BW)
    m_d = o_d < D
    m_w = o_w < W
    # the cache and the filters first: the previous kernel (the projection) does not write them, so with PDL these
    # loads overlap its tail; x is its output, read after gdc_wait
    p_c = cache + i_n * D * W + o_d[:, None] * W + o_w[None, :]
    # the window moves by one: the cache's last W - 1 inputs, then this token's
    b_c = tl.load(p_c + 1, mask=m_d[:, None] & ((o_w + 1) < W)[None, :], other=0).to(tl.float32)
    b_w = tl.load(w + (OFF + o_d)[:, None] * W + o_w[None, :], mask=m_d[:, None] & m_w[None, :], other=0)
    if PDL:
        gdc_wait()
    b_x = tl.load(x + i_n * s_x + OFF + o_d, mask=m_d, other=0).to(tl.float32)
    b_c = tl.where((o_w == W - 1)[None, :], b_x[:, None], b_c)
    b_y = tl.sum(b_c * b_w.to(tl.float32), 1)
    if HAS_BIAS:
        b_y += tl.load(b + OFF + o_d, mask=m_d, other=0).to(tl.float32)
    if SILU:
        b_y = b_y * tl.sigmoid(b_y)
    if L2 > 0:  # each head of L2 channels (BD holds whole heads) over its L2 norm, as fla's l2norm_fwd does on
        # the conv output in y's dtype: x / sqrt(sum(x^2) + eps), in float32
        b_h = tl.reshape(b_y.to(y.dtype.element_ty).to(tl.float32), (BD // L2, L2))
        b_h = b_h * (1 / tl.sqrt(tl.sum(b_h * b_h, 1) + 1e-6))[:, None]  # fla's default eps
        b_y = tl.reshape(b_h, (BD,))
    tl.store(y + i_n * s_y + o_d, b_y.to(y.dtype.element_ty), mask=m_d)  # y: this segment's first channel
    tl.store(p_c, b_c.to(cache.dtype.element_ty), mask=m_d[:, None] & m_w[None, :])


@triton.jit
def _conv_kernel(x, y, c0, c1, c2, w, b, e, f, s_x, s_y, s_e, D0: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
                 NB0: tl.constexpr, NB1: tl.constexpr, NB2: tl.constexpr, E: tl.constexpr, EXTRA_ACT: tl.constexpr,
                 W: tl.constexpr, BD: tl.constexpr, BW: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                 SEPARATE: tl.constexpr, PDL: tl.constexpr, L2: tl.constexpr = 0):
    if PDL:  # the recurrent step may start loading its state now (it waits for our outputs)
        gdc_launch_dependents()
    # programs [0, NB0) update the first segment's channels, the next NB1 the second's, the next NB2 the third's;
    # the rest (E > 0) write the extra columns e (EXTRA_ACT 1: sigmoid, 2: twice the sigmoid) to f, contiguous.
    # L2 > 0: the first two segments (q and k) are L2-normalised per head of L2 channels
    i_b = tl.program_id(0)
    i_n = tl.program_id(1).to(tl.int64)
    # y holds the segments side by side in each sequence's row (stride s_y), or (SEPARATE) one after another, each
    # a contiguous [N, Di] block
    n = tl.num_programs(1).to(tl.int64)
    if i_b < NB0:
        _conv_segment(x, y, c0, w, b, i_n, i_b, s_x, D0 if SEPARATE else s_y, 0, D0, W, BD, BW, HAS_BIAS, SILU,
                      PDL, L2)
    elif i_b < NB0 + NB1:
        y1 = y + n * D0 if SEPARATE else y + D0
        _conv_segment(x, y1, c1, w, b, i_n, i_b - NB0, s_x, D1 if SEPARATE else s_y, D0, D1, W, BD, BW, HAS_BIAS,
                      SILU, PDL, L2)
    elif i_b < NB0 + NB1 + NB2:
        y2 = y + n * (D0 + D1) if SEPARATE else y + D0 + D1
        _conv_segment(x, y2, c2, w, b, i_n, i_b - NB0 - NB1, s_x, D2 if SEPARATE else s_y, D0 + D1, D2, W, BD, BW,
                      HAS_BIAS, SILU, PDL)
    elif E > 0:  # a compile-time branch: without extra columns e and f are None
        if PDL:
            gdc_wait()
        o_e = (i_b - NB0 - NB1 - NB2) * BD + tl.arange(0, BD)
        b_e = tl.load(e + i_n * s_e + o_e, mask=o_e < E, other=0).to(tl.float32)
        if EXTRA_ACT > 0:
            b_e = tl.sigmoid(b_e) * EXTRA_ACT
        tl.store(f + i_n * E + o_e, b_e.to(f.dtype.element_ty), mask=o_e < E)


EXTRA_ACTIVATIONS = {None: 0, "sigmoid": 1, "2sigmoid": 2}
"""``conv_step``'s ``extra_act`` values: none, ``sigmoid(x)``, ``2 * sigmoid(x)`` (DeltaNet's beta with negative
eigenvalues allowed)."""


def conv_step(x: torch.Tensor, caches: tuple[torch.Tensor, torch.Tensor, torch.Tensor], weight: torch.Tensor,
              bias: torch.Tensor | None = None, activation: str | None = "silu", block: int = 128,
              pdl: bool = True, separate: bool = False, extra: torch.Tensor | None = None,
              extra_act: str | None = None, l2norm: int | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """One token of three depthwise causal convolutions (fla's ``ShortConvolution`` step) in one launch.

    Args:
        x: ``[N, 1, D0 + D1 + D2]`` (or ``[N, D]``), unit stride along the channels, any stride between sequences
            (a slice of a wider projection output).
        caches: the three conv states ``[N, Di, W]`` (contiguous), the last ``W`` inputs of channels
            ``[0, D0)``, ``[D0, D0 + D1)`` and ``[D0 + D1, D)``; each is shifted by one and updated in place.
        weight: ``[D, W]`` or ``[D, 1, W]`` filters of all channels, contiguous; bias: ``[D]`` or None.
        activation: ``"silu"`` / ``"swish"`` or None.
        pdl: launch with programmatic dependent launch where :func:`statereduce.kernels.recurrent.launch_options`
            allows it. Worth it only before a kernel of ours that waits on it: before fla's recurrent kernels a
            PDL-launched conv makes the whole step up to 0.9 % slower on an H200 (docs/speed.md).
        separate: write the three segments to three contiguous tensors (one allocation) instead of one row each:
            for consumers that need contiguous q, k and v (fla's functions copy strided views, three more launches
            per layer).
        extra, extra_act: ``[N, 1, E]`` (or ``[N, E]``) more columns (unit stride along a row, e.g. DeltaNet's beta
            logits in the packed projection's output) that the same launch writes contiguous, through ``extra_act``
            (:data:`EXTRA_ACTIVATIONS`); only with ``separate``.
        l2norm: a head size (a power of two, dividing D0 and D1): the first two segments (q and k) come out
            L2-normalised per head, ``x / sqrt(sum(x^2) + 1e-6)`` on the convolved values rounded to x's dtype, as
            fla's ``l2norm_fwd`` does after the convolution (which takes two launches of its own). ``block`` is
            raised to it where smaller.

    Returns:
        ``[N, 1, D]`` (``[N, D]`` for a 2-D ``x``), contiguous, in x's dtype; with ``separate`` a tuple of the three
        segments ``[N, 1, Di]`` (``[N, Di]``), each contiguous, and the extra columns' output last if given.
    """
    n, d = x.shape[0], x.shape[-1]
    dims = [c.shape[1] for c in caches]
    w = weight.shape[-1]
    if len(caches) != 3 or sum(dims) != d or x.numel() != n * d:
        raise ValueError(f"conv_step takes one token [N, 1, D] and three caches whose channels sum to D; got x "
                         f"{tuple(x.shape)}, caches {[tuple(c.shape) for c in caches]}")
    if any(not c.is_contiguous() or c.shape[0] != n or c.shape[2] != w for c in caches):
        raise ValueError(f"conv caches must be contiguous [N={n}, Di, W={w}]; got "
                         f"{[(tuple(c.shape), c.is_contiguous()) for c in caches]}")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"conv_step activation {activation!r} is not supported; valid: silu, swish, None")
    if extra_act not in EXTRA_ACTIVATIONS:
        raise ValueError(f"conv_step extra_act {extra_act!r} is not supported; valid: sigmoid, 2sigmoid, None")
    if extra is not None and (not separate or extra.shape[0] != n or extra.stride(-1) != 1):
        raise ValueError(f"conv_step extra columns need separate=True and [N={n}, 1, E] rows with unit stride; got "
                         f"{tuple(extra.shape)} stride {tuple(extra.stride())}, separate={separate}")
    if l2norm is not None and (l2norm < 1 or l2norm & (l2norm - 1) or dims[0] % l2norm or dims[1] % l2norm):
        raise ValueError(f"conv_step l2norm head size {l2norm} must be a power of two dividing the q and k widths "
                         f"{dims[0]} and {dims[1]}")
    block = max(block, l2norm or 0)
    rows = x.reshape(n, d)
    rows = rows if rows.stride(1) == 1 else rows.contiguous()
    weight = weight.reshape(d, w).contiguous()
    y = torch.empty(n, d, dtype=x.dtype, device=x.device)
    nb = [triton.cdiv(di, block) for di in dims]
    width = extra.shape[-1] if extra is not None else 0
    e_in = extra.reshape(n, width) if extra is not None else None
    e_out = torch.empty(n, width, dtype=extra.dtype, device=x.device) if extra is not None else None
    _conv_kernel[(sum(nb) + triton.cdiv(width, block), n)](
        rows, y, *caches, weight, bias, e_in, e_out, rows.stride(0), y.stride(0),
        e_in.stride(0) if e_in is not None else 0, D0=dims[0], D1=dims[1], D2=dims[2], NB0=nb[0], NB1=nb[1],
        NB2=nb[2], E=width, EXTRA_ACT=EXTRA_ACTIVATIONS[extra_act], W=w, BD=block, BW=triton.next_power_of_2(w),
        HAS_BIAS=bias is not None, SILU=activation is not None, SEPARATE=separate, L2=l2norm or 0, num_warps=4,
        **(launch_options(x.device) if pdl else {"PDL": False}))
    if separate:
        flat, offsets = y.view(-1), [0, n * dims[0], n * (dims[0] + dims[1]), n * d]
        lead = (n, 1) if x.dim() == 3 else (n,)
        parts = tuple(flat[a:b].view(*lead, di) for a, b, di in zip(offsets, offsets[1:], dims))
        return parts + ((e_out.view(*lead, width),) if extra is not None else ())
    return y.view(x.shape) if x.dim() == 3 else y
