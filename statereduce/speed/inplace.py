"""Decoding with the recurrent state updated in place (for CUDA-graph decoding and its benchmarks).

A decode step of a DeltaNet / Gated DeltaNet layer reads the recurrent state ``S`` (``d_k x d_v`` per head, float32)
and writes it back; at large batch that traffic dominates the step (paper Sec. 5, App. G.1). fla 0.6.0's
``fused_recurrent_*`` functions write the new state to a *new* tensor, so a captured CUDA graph would either need
a copy back (a second read and write of the state) or fresh buffers per step. :func:`inplace_decode` routes the
stock layers' one-token calls (``T = 1`` with an initial state, no ``cu_seqlens``, no autograd) to one of three
steps and leaves every other call alone:

- ``kernel="fla"``: fla's own Triton kernels launched with the final state pointer equal to the initial one
  (:mod:`statereduce.kernels.recurrent`). It is the unmodified-kernel baseline of the speed benchmarks.
- ``kernel="fla_copy"``: fla's public ``fused_recurrent_*`` function as it is, returning a new state, then
  ``state.copy_(new)``: what a CUDA-graph decoder built on the unmodified function must do (the paper's setup
  uses fla's kernels unmodified). It reads and writes the state twice, so it is the slowest of the three.
- ``kernel="statereduce"``: :func:`statereduce.kernels.recurrent.recurrent_step`, our Triton kernel for ``T = 1``,
  which streams small-``d_k`` states in wide coalesced rows.

Which functions are routed, and how, is each family's decode route (:mod:`statereduce.speed.routes`, registered per
family: fla's in :mod:`statereduce.speed.fla_decode`); this module only applies the patches.
"""


from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from statereduce.adapters import adapter_families, get_adapter
from statereduce.speed import fla_decode  # noqa: F401  (registers fla's decode routes)
from statereduce.speed.routes import registered_route

KERNELS = ("fla", "statereduce", "fla_copy")
"""Recurrent steps of :func:`inplace_decode`: fla's kernel in place, ours in place, and fla's public function
unmodified (a new state tensor each step) with the graph copying it back into the static state buffer. Each may
carry the suffix :data:`FUSED` (:func:`parse_kernel`)."""

FUSED = "+fused"
"""Kernel-name suffix: the rest of the layer takes its adapter's fused one-token step as well."""


def parse_kernel(name: str) -> tuple[str, bool]:
    """A decode kernel setting (``"fla"``, ``"statereduce+fused"``, ...) as (kernel, fused); one-line error if bad."""
    kernel, fused = (name[:-len(FUSED)], True) if name.endswith(FUSED) else (name, False)
    if kernel not in KERNELS:
        valid = ", ".join([*KERNELS, *(k + FUSED for k in KERNELS)])
        raise ValueError(f"unknown decode kernel {name!r}; valid: {valid}")
    return kernel, fused


@contextlib.contextmanager
def patched(patches: list[tuple[Any, str, Callable]]) -> Iterator[None]:
    """Within the block, each ``(owner, attribute, make)`` of ``patches`` has ``owner.attribute = make(original)``
    (a class's own attribute where it has one); every original is restored on exit, also on error. A patch that
    names the same attribute as an earlier one is applied once."""
    saved = []
    try:
        for owner, attr, make in patches:
            if any(o is owner and a == attr for o, a, _ in saved):
                continue
            original = owner.__dict__[attr] if isinstance(owner, type) and attr in owner.__dict__ else getattr(owner,
                                                                                                            attr)
            saved.append((owner, attr, original))
            setattr(owner, attr, make(original))
        yield
    finally:
        for owner, attr, original in reversed(saved):
            setattr(owner, attr, original)


@contextlib.contextmanager
def inplace_decode(kernel: str = "statereduce", device_types: tuple[str, ...] = ("cuda",)) -> Iterator[None]:
    """Within the block, the stock layers of every family with a decode route (:mod:`statereduce.speed.routes`: fla's
    DeltaNet and Gated DeltaNet) decode with in-place state updates.

    Args:
        kernel: ``"statereduce"`` (:func:`statereduce.kernels.recurrent.recurrent_step`), ``"fla"`` (fla's own
            kernels, in place) or ``"fla_copy"`` (fla's functions unmodified, the new state copied back into the
            cache's tensor); with ``"+fused"`` appended, the layers also take their route's leaner one-token step
            around that state update (``fused_patches``; for fla's layers :mod:`statereduce.speed.fla_decode`:
            packed projections, one conv launch, the residual added by the down projection).
        device_types: devices whose one-token calls are routed; ``("cpu",)`` only makes sense for
            ``"statereduce"`` under ``TRITON_INTERPRET=1`` (tests).
    """
    kernel, fused = parse_kernel(kernel)
    device_types = tuple(device_types)
    routes = [registered_route(f) for f in adapter_families()]
    patches = [p for r in routes for p in r.patches(kernel, device_types)]
    if fused:
        patches += [p for r in routes for p in r.fused_patches(kernel, device_types)]
    with patched(patches):
        yield


def pack_for_decode(model: nn.Module) -> int:
    """Lay out the weights the fused step reads (for fla's layers: each mixer's projections and conv filters, each
    SwiGLU MLP's gate and up, packed into one tensor per group with the stock parameters rebound as views; values
    unchanged). The fused step also packs on first use; calling this first keeps the allocation out of a timed or
    captured region. Returns the number of modules packed."""
    return registered_route(get_adapter(model).family).pack(model)


def cache_tensors(model: nn.Module, cache) -> list:
    """Every state tensor (recurrent and conv) of ``model``'s decoding cache ``cache``, for static CUDA-graph buffers
    (:meth:`statereduce.speed.routes.DecodeRoute.cache_tensors`)."""
    return registered_route(get_adapter(model).family).cache_tensors(cache)
