"""Head shapes at which stock fla's delta-rule kernels fail on CUDA, and the zero-padded call that avoids them.

fla 0.6.0's Triton kernels (Triton 3.6, H200 and H100) give wrong outputs or fault at some of the small key and value
widths that state reduction produces (``scripts/sweep_fla_shapes.py``, every shape in its own process, bf16 forward and
backward against a float64 per-step recurrence; results in ``docs/results/fla_shapes_h200.json``, summary in
``docs/gpu_checks.md``). :data:`FAULTY` holds, per kernel function, the rule that covers them and in which pass
(forward, backward). Where a call on a CUDA tensor has such a shape (a backward-only one when the call will be
differentiated), :func:`guard` pads q and k (and a key-dimension gate and the initial state) with zero channels to
the width the sweep found right (:data:`PAD_TO`), passes the unpadded scale, and slices the final state back. The
result is exact: a zero key channel adds nothing to ``S k`` or to ``S``'s other columns, a zero query channel nothing
to ``S q``, and zeros leave the L2 norms of q and k unchanged; only the kernel's work is that of the padded width.

Value cuts give value widths outside :data:`SWEPT_D_V` at every key width. ``scripts/sweep_fla_shapes.py --grid
values`` sweeps them (``docs/results/fla_value_shapes_h100_all.json``, on an H100 with the same fla and Triton): the
chunk DeltaNet kernel's backward is wrong or faults wherever the value tile is at most 32 (d_v' <= 32) at key tiles
16 to 128, with or without the key padding, and right once v is zero-padded to 64; the Gated DeltaNet chunk backward
faults at some value tiles of 16 and below before fla refuses it. :data:`VALUE_FAULTY` holds these rules; where they
apply the guard pads v too (:func:`call_padded`'s ``value_width``, exact as well), and then q and k where
:data:`FAULTY` says so at the padded value width (:func:`padded_widths`).

The adapter of a family names the kernels to guard (``padded_kernels``); the guard sits around whatever the layer
module binds (fla's kernel, or the CPU dispatcher of :mod:`statereduce.kernels.fla_fallback`), so capture hooks
installed later still see the unpadded q and k.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from statereduce.kernels.fla_fallback import torch_device_types

#: where the sweep ran
MEASURED_ON = "fla 0.6.0, Triton 3.6.0, torch 2.11.0+cu130, NVIDIA H200"
#: where the values sweep (:data:`VALUE_FAULTY`) ran
VALUES_MEASURED_ON = "fla 0.6.0, Triton 3.6.0, torch 2.11.0+cu130, NVIDIA H100 80GB HBM3"

#: key widths the sweep ran: every d_k' that removing 25, 50, 75 or 87.5% of d_k in {64, 128, 256} gives, and d_k
SWEPT_D_K: tuple[int, ...] = (8, 16, 32, 48, 64, 96, 128, 192, 256)

#: value widths the sweep ran
SWEPT_D_V: tuple[int, ...] = (64, 128, 256, 512)

#: head shapes the values sweep ran: every d_v' that removing 25, 50, 75 or 87.5% of d_v in {64, 128, 256, 512} gives
#: outside :data:`SWEPT_D_V`, at key widths 16 to 256, and joint cuts of about half the state
SWEPT_VALUE_SHAPES: frozenset[tuple[int, int]] = frozenset(
    {(d_k, d_v) for d_k in (16, 32, 48, 64, 128, 256) for d_v in (8, 16, 32, 48, 96, 192, 384)}
    | {(48, 48), (88, 88), (96, 96), (176, 176), (184, 184), (176, 368), (184, 360)})

#: the width faulty shapes are padded to (the sweep ran the padded calls at it and found them right)
PAD_TO = 64


def _tile(d: int) -> int:
    """The power-of-two tile fla's kernels give a dimension of ``d`` channels (``triton.next_power_of_2``)."""
    return 1 << max(d - 1, 0).bit_length()


def _chunk_delta_rule_faulty(d_k: int, d_v: int) -> frozenset[str]:
    """fla 0.6.0's chunk DeltaNet kernel, bf16, T = 1024, with a key tile of at most 32 (docs/results/fla_shapes_h200.json
    and fla_value_shapes_h100_dn_chunk_small.json): at d_v = 48 and 64 wrong in both passes (relative errors 2 to 90),
    at d_v = 96 the backward wrong (dq) and at d_v = 128 an illegal memory access in the backward, the forwards right.
    Every shape with a 64-wide key tile and a value tile above 32, or a value tile of 256 or more (d_v 192 to 512), is
    right (<= 1.1e-2). Value tiles of at most 32 (wrong at every key tile, erratic below 64) count as faulty in both
    passes here; :func:`_chunk_delta_rule_value_faulty` pads their values first."""
    if _tile(d_k) > 32 or _tile(d_v) > 128:
        return frozenset()
    return frozenset({"backward"}) if _tile(d_v) == 128 else frozenset({"forward", "backward"})


def _chunk_delta_rule_value_faulty(d_k: int, d_v: int) -> frozenset[str]:
    """The same kernel with a value tile of at most 32 (d_v' <= 32; fla_value_shapes_h100_all.json): the backward
    wrong (dk, dv, beta and the initial state, relative errors 0.3 to 1.7) at key widths 48, 64 and 128 (an illegal
    memory access at 128 x 8 and 128 x 16), and at 16 and 32 with q and k padded to 64; the forward right there.
    Stock calls at key tiles 16 and 32 were erratic (wrong at 16 x 32 and 32 x 8, right at 16 x 8, 16 x 16, 32 x 16,
    32 x 32). v zero-padded to 64 was right at every such shape (<= 8.8e-3). At key width 256 both passes were right
    (256 x 8, 16 and 32, <= 6.2e-3); key tiles above 256 are unswept with such values and count as faulty in both
    passes."""
    if _tile(d_v) > 32 or _tile(d_k) == 256:
        return frozenset()
    return frozenset({"backward"}) if _tile(d_k) <= 128 else frozenset({"forward", "backward"})


def _chunk_gated_delta_rule_value_faulty(d_k: int, d_v: int) -> frozenset[str]:
    """fla 0.6.0's chunk Gated DeltaNet kernel with a value tile of at most 16 and a key tile of at most 64
    (fla_value_shapes_h100_all.json): its forward is right at every shape of the values grid (<= 4.8e-3), but its
    backward faulted with an illegal memory access at 32 x 8, 32 x 16 and 48 x 16, in a kernel that runs before fla's
    refusal of this backward (Triton < 3.7.1 on Hopper), while 16 x 8, 16 x 16, 48 x 8, 64 x 8 and 64 x 16 reached
    the refusal. With v zero-padded to 64 all three reached the refusal. Whether the backward is right where fla runs
    it (Triton >= 3.7.1) is unmeasured: the rule keeps such calls off the shapes that faulted here."""
    return frozenset({"backward"}) if _tile(d_v) <= 16 and _tile(d_k) <= 64 else frozenset()


#: kernel function -> (d_k, d_v) -> the passes ("forward", "backward") in which stock fla is wrong or faults on CUDA
#: at that head shape. The Gated DeltaNet kernels' forwards are right at every swept shape; their backwards could
#: not be checked (fla refuses the chunk backward with Triton < 3.7.1 on Hopper, and has no fused-recurrent backward).
FAULTY: dict[str, Callable[[int, int], frozenset[str]]] = {
    "chunk_delta_rule": _chunk_delta_rule_faulty,
}

#: kernel function -> (d_k, d_v) -> the passes in which stock fla is wrong or faults on CUDA at a value width that
#: zero-padding v (to :data:`PAD_TO`) repairs. The fused recurrent kernels' forwards (and DeltaNet's backward) were
#: right at every value width.
VALUE_FAULTY: dict[str, Callable[[int, int], frozenset[str]]] = {
    "chunk_delta_rule": _chunk_delta_rule_value_faulty,
    "chunk_gated_delta_rule": _chunk_gated_delta_rule_value_faulty,
}

Table = Mapping[str, Callable[[int, int], frozenset[str]]]


def _hits(passes: frozenset[str], backward: bool) -> bool:
    return "forward" in passes or (backward and "backward" in passes)


def padded_width(kernel: str, d_k: int, d_v: int, backward: bool = True, table: Table = FAULTY) -> int | None:
    """The key width to call ``kernel`` with at head shape ``d_k x d_v`` (``backward``: the call will be
    differentiated): None where stock fla is right there, else :data:`PAD_TO` (or the smallest multiple of it above
    ``d_k``)."""
    rule = table.get(kernel)
    passes = rule(d_k, d_v) if rule is not None else frozenset()
    if "forward" not in passes and not (backward and "backward" in passes):
        return None
    width = PAD_TO * (d_k // PAD_TO + 1)
    if rule(width, d_v):
        raise ValueError(f"{kernel} at d_k={d_k}, d_v={d_v}: the padded width {width} is faulty too")
    return width


def padded_widths(kernel: str, d_k: int, d_v: int, backward: bool = True, table: Table = FAULTY,
                  values: Table = VALUE_FAULTY) -> tuple[int | None, int | None]:
    """(key width, value width) to call ``kernel`` with at head shape ``d_k x d_v`` (``backward``: the call will be
    differentiated), None for a side that needs no padding: v to :data:`PAD_TO` where ``values`` says so, then q and
    k where ``table`` says so at that value width (:func:`padded_width`).

    Raises:
        ValueError: where the padded shape is faulty too (a rule that cannot be repaired this way).
    """
    rule = values.get(kernel)
    width_v = None
    if rule is not None and _hits(rule(d_k, d_v), backward):
        width_v = PAD_TO * (d_v // PAD_TO + 1)
    width_k = padded_width(kernel, d_k, width_v or d_v, backward, table)
    if width_v is not None and rule(width_k or d_k, width_v):
        raise ValueError(f"{kernel} at d_k={d_k}, d_v={d_v}: the padded value width {width_v} is faulty too")
    return width_k, width_v


def faulty_shapes(kernels: tuple[str, ...], d_k: int, d_v: int) -> dict[str, dict[str, Any]]:
    """``{kernel: {"passes": [...], "padded_to": width, "values_padded_to": width}}`` for each of ``kernels`` that
    stock fla mishandles at ``d_k x d_v`` (``values_padded_to`` where v is padded too)."""
    out: dict[str, dict[str, Any]] = {}
    for name in kernels:
        passes = frozenset()
        for table in (FAULTY, VALUE_FAULTY):
            rule = table.get(name)
            passes |= rule(d_k, d_v) if rule is not None else frozenset()
        if passes:
            width_k, width_v = padded_widths(name, d_k, d_v)
            out[name] = {"passes": sorted(passes), "padded_to": width_k,
                         **({"values_padded_to": width_v} if width_v is not None else {})}
    return out


def call_padded(fn: Callable[..., Any], width: int | None, *args: Any, value_width: int | None = None,
                **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` (a delta-rule kernel with fla's signature) with q and k zero-padded to ``width`` key
    channels and, with ``value_width``, v zero-padded to ``value_width`` value channels; returns ``(o, final_state)``
    with the output and the final state sliced back to the call's widths, as contiguous tensors (a width at or below
    the call's own pads nothing; ``width=None`` pads no key channel).

    Both paddings are exact. Keys: a zero key channel adds nothing to ``S k`` or to ``S``'s other columns, a zero
    query channel nothing to ``S q``, and zeros leave the L2 norms of q and k unchanged (the unpadded scale is
    passed). Values: each value channel is one row of the state, updated from its own value entry alone
    (``S_i <- S_i + beta (v_i - S_i k) k^T``, times the decay for Gated DeltaNet), so a zero value channel with a zero
    initial row keeps a zero row, gives a zero output channel, and takes no part in the other rows or in any
    gradient (its output and final-state cotangents are zero after the slice)."""
    bound = inspect.signature(fn).bind(*args, **kwargs)
    a = bound.arguments
    extra = a.pop("kwargs", {}) if "kwargs" in a and isinstance(a.get("kwargs"), dict) else {}
    d_k, d_v = a["q"].shape[-1], a["v"].shape[-1]
    pad = max((width or 0) - d_k, 0)
    pad_v = max((value_width or 0) - d_v, 0)
    if pad <= 0 and pad_v <= 0:
        return fn(*args, **kwargs)
    v_first = bool(a.get("state_v_first", False))
    h0 = a.get("initial_state")  # [N, H, K, V] (or [N, H, V, K] with state_v_first)
    if pad > 0:
        a["q"], a["k"] = F.pad(a["q"], (0, pad)), F.pad(a["k"], (0, pad))
        if a.get("gk") is not None:  # log-space key gate: 0 on the padded channels (their state columns stay 0)
            a["gk"] = F.pad(a["gk"], (0, pad))
        if a.get("scale") is None:
            a["scale"] = d_k**-0.5
        if h0 is not None:
            h0 = F.pad(h0, (0, pad)) if v_first else F.pad(h0, (0, 0, 0, pad))
    if pad_v > 0:
        a["v"] = F.pad(a["v"], (0, pad_v))
        beta = a.get("beta")
        if isinstance(beta, torch.Tensor) and beta.ndim == a["v"].ndim:  # one beta per value channel
            a["beta"] = F.pad(beta, (0, pad_v))
        if h0 is not None:
            h0 = F.pad(h0, (0, 0, 0, pad_v)) if v_first else F.pad(h0, (0, pad_v))
    if h0 is not None:
        a["initial_state"] = h0
    o, state = fn(**a, **extra)
    # contiguous, as the kernels return them: the decode kernels update a cached state in place and take it only so
    if pad_v > 0:
        o = o[..., :d_v].contiguous()
    if state is not None:
        state = (state[..., :d_v, :d_k] if v_first else state[..., :d_k, :d_v]).contiguous()
    return o, state


def _needs_grad(args: tuple, kwargs: dict) -> bool:
    if not torch.is_grad_enabled():
        return False
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in (*args, *kwargs.values()))


def guard(inner: Callable[..., Any], kernel: str, table: Table = FAULTY,
          device_types: tuple[str, ...] = ("cuda",)) -> Callable[..., Any]:
    """``inner`` with its calls on ``device_types`` tensors at a faulty shape of ``kernel`` made through
    :func:`call_padded` at :func:`padded_widths` (a shape faulty only in the backward only when the call will be
    differentiated); every other
    call (and every call that :mod:`~statereduce.kernels.fla_fallback` routes to its torch kernels, which take any
    shape) goes to ``inner`` unchanged. fla's delta-rule kernels take q, k, v first (positional or keyword)."""
    @functools.wraps(inner)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        q = args[0] if args else kwargs.get("q")
        v = args[2] if len(args) > 2 else kwargs.get("v")
        if (isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor) and q.device.type in device_types
                and q.device.type not in torch_device_types()):
            width, width_v = padded_widths(kernel, q.shape[-1], v.shape[-1], _needs_grad(args, kwargs), table)
            if width is not None or width_v is not None:
                return call_padded(inner, width, *args, value_width=width_v, **kwargs)
        return inner(*args, **kwargs)

    guarded._statereduce_guard = kernel  # type: ignore[attr-defined]
    guarded._statereduce_inner = inner  # type: ignore[attr-defined]
    return guarded


def install(layer_module: str, kernels: tuple[str, ...], table: Table = FAULTY) -> None:
    """Wrap each of ``kernels`` bound in ``layer_module`` with :func:`guard` (idempotent: a guarded name is left)."""
    mod = importlib.import_module(layer_module)
    for name in kernels:
        current = getattr(mod, name)
        if getattr(current, "_statereduce_guard", None) is None:
            setattr(mod, name, guard(current, name, table))


def is_guarded(layer_module: str, kernel: str) -> bool:
    """Whether ``layer_module.kernel`` is wrapped by :func:`guard`."""
    return getattr(getattr(importlib.import_module(layer_module), kernel), "_statereduce_guard", None) is not None


def record_note(kernels: tuple[str, ...], d_k: int, d_v: int) -> dict[str, Any]:
    """What ``prune_record.json`` says of stock fla at a pruned head shape ``d_k x d_v`` (``fla_kernel_shapes``)."""
    if not kernels:
        return {}
    faulty = faulty_shapes(kernels, d_k, d_v)
    swept_values = (d_k, d_v) in SWEPT_VALUE_SHAPES
    swept = swept_values or (d_k in SWEPT_D_K and d_v in SWEPT_D_V)
    if faulty:
        names = ", ".join(f"{k} ({' and '.join(f['passes'])})" for k, f in faulty.items())
        seen = "is wrong or faults" if swept else "lies in the region where it is wrong or faults"
        what = " and ".join(side for side, key in (("q and k", "padded_to"), ("v", "values_padded_to"))
                            if any(f.get(key) for f in faulty.values()))
        note = (f"stock fla {seen} on CUDA at d_k={d_k} x d_v={d_v} in {names}; statereduce pads {what} with zero "
                f"channels to {PAD_TO} there (exact). Outside statereduce, keep such calls off that kernel (fla's "
                f"layers use the recurrent kernel for inputs of at most 64 tokens) or pad as "
                f"statereduce.kernels.shapes.call_padded does")
    elif swept:
        note = f"stock fla's kernels ({', '.join(kernels)}) were measured right at d_k={d_k} x d_v={d_v}"
    else:
        note = f"d_k={d_k} x d_v={d_v} is outside the measured sweep: stock fla's kernels are unchecked at it"
    values = swept_values or any("values_padded_to" in f for f in faulty.values())
    return {"measured_on": MEASURED_ON, **({"values_measured_on": VALUES_MEASURED_ON} if values else {}),
            "faulty": faulty, "swept": swept, "note": note}
