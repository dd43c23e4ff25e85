"""fla chunk_delta_rule forward + backward at one head size K, bf16 (run one K per process: a CUDA fault ends it)."""

import sys

import torch
from fla.ops.delta_rule import chunk_delta_rule

K = int(sys.argv[1])
B, T, H, V = 4, 512, 4, 128
g = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(B, T, H, K, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
k = (
    torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda", generator=g), dim=-1)
    .bfloat16()
    .requires_grad_()
)
v = torch.randn(B, T, H, V, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
beta = torch.rand(B, T, H, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
o, _ = chunk_delta_rule(q, k, v, beta)
print(f"K={K} forward ok", flush=True)
o.float().pow(2).sum().backward()
torch.cuda.synchronize()
print(f"K={K} backward ok, |dq|={q.grad.float().norm():.3f}", flush=True)
