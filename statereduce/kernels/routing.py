"""Which kernels a backward pass on the GPU uses (Grad scores, RFT).

fla 0.6.0 refuses the gated delta rule's chunk backward on Hopper GPUs with Triton >= 3.4.0, < 3.7.1 (fla issue
#640: wrong gradients there); Triton 3.7.1 (``constraints.txt``) runs it. Where it refuses, the families whose
backward runs that kernel (``fla_gated_backward``: Gated DeltaNet, Qwen3.5) train through the PyTorch
implementations of :mod:`statereduce.kernels.fla_fallback` on CUDA too: slower, same results.
"""

from __future__ import annotations

import torch


def fla_refuses_gated_backward(device: str | torch.device) -> bool:
    """Whether fla would refuse the gated delta rule's chunk backward on ``device``, by fla's own flags (the
    condition of ``fla.ops.common.chunk_o``). False on CPU and without fla."""
    if torch.device(device).type != "cuda":
        return False
    try:
        from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1
    except ImportError:
        return False
    return bool(IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1)


def backward_kernels(adapter_cls, device: str | torch.device, requested: str = "auto") -> str:
    """``"fla"`` or ``"torch"``: ``requested`` unless it is ``"auto"``, which picks ``"torch"`` on a device where fla
    refuses the backward of a family that needs it (:func:`fla_refuses_gated_backward`), else ``"fla"``. On CPU
    both mean the torch fallbacks (fla's kernels are Triton-only)."""
    if requested != "auto":
        return requested
    return "torch" if adapter_cls.fla_gated_backward and fla_refuses_gated_backward(device) else "fla"


def route_backward(model: torch.nn.Module, requested: str = "auto") -> str:
    """Apply :func:`backward_kernels` to a loaded model: with ``"torch"`` on CUDA, its family's kernel calls on
    CUDA tensors go to the torch fallbacks too (after ``load_model``, which routes only CPU tensors). Returns the
    choice."""
    from statereduce.adapters import get_adapter

    adapter = get_adapter(model)
    device = next(model.parameters()).device
    kernels = backward_kernels(type(adapter), device, requested)
    if kernels == "torch" and device.type == "cuda":
        adapter.install_fallbacks(torch_device_types=("cpu", "cuda"))
    return kernels
