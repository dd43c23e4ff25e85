"""Planted kernel faults for tests/test_kernel_check.py, importable by the check's child process.

:class:`PlantDeltaNet` is a stand-in adapter setup (a :class:`~statereduce.kernels.check.Route`'s ``setup``): its
``install_fallbacks`` installs the DeltaNet adapter's bindings as a job does, then wraps ``fla.layers.delta_net``'s
``chunk_delta_rule`` so that at key width :data:`WRONG_D_K` its output is off by half (a wrong kernel result) and at
:data:`FAULT_D_K` the process dies (as after an illegal memory access); other shapes run the real binding. The parent
test installs the same plant, so that the check's child and the test's model see the same kernel.
"""

from __future__ import annotations

import functools
import os

WRONG_D_K = 16
FAULT_D_K = 24
LAYER_MODULE = "fla.layers.delta_net"
KERNEL = "chunk_delta_rule"


def _planted(inner):
    @functools.wraps(inner)
    def kernel(*args, **kwargs):
        q = args[0] if args else kwargs["q"]
        if q.shape[-1] == FAULT_D_K:
            os._exit(134)  # the process ends at once, as a CUDA fault ends a kernel's process
        o, state = inner(*args, **kwargs)
        return (o * 1.5, state) if q.shape[-1] == WRONG_D_K else (o, state)

    kernel._planted = True
    return kernel


class PlantDeltaNet:
    """``install_fallbacks()``: the DeltaNet adapter's, then the planted fault (idempotent)."""

    @classmethod
    def install_fallbacks(cls) -> None:
        import importlib

        from statereduce.adapters.deltanet import DeltaNetAdapter

        DeltaNetAdapter.install_fallbacks()
        mod = importlib.import_module(LAYER_MODULE)
        current = getattr(mod, KERNEL)
        if not getattr(current, "_planted", False):
            setattr(mod, KERNEL, _planted(current))

    @classmethod
    def remove(cls) -> None:
        import importlib

        mod = importlib.import_module(LAYER_MODULE)
        current = getattr(mod, KERNEL)
        while getattr(current, "_planted", False):  # the plant, and any wrapper around it (functools.wraps)
            current = current.__wrapped__
        setattr(mod, KERNEL, current)
