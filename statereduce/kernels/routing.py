"""Whether fla runs a backward pass on this GPU (the adapters' ``backward_kernels`` / ``route_backward`` decide with it).

fla 0.6.0 refuses the gated delta rule's chunk backward on Hopper GPUs with Triton >= 3.4.0, < 3.7.1 (fla issue
#640: wrong gradients there); Triton 3.7.1 (``constraints.txt``) runs it. Where it refuses, the families whose
backward runs that kernel (the adapters' ``fla_gated_backward``: Gated DeltaNet, Qwen3.5) train through the PyTorch
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
