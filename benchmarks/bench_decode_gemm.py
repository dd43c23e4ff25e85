"""Our split-K decode GEMM (statereduce.decode_gemm.linear, autotuned) against cuBLAS (torch's F.linear) on the
decode step's projection shapes, side by side in one run on the GPU. Each is timed as 24 launches on distinct
weights in one CUDA graph (every layer's weights come from HBM), PDL on and off for ours. Also the MLP's down
projection with SwiGLU fused in, against fla's swiglu kernel then cuBLAS. Checks each result against a float32
product and that replays give the same bits. Prints µs per launch and weight TB/s; writes JSON.

    python benchmarks/bench_decode_gemm.py OUT.json [ROWS]   (ROWS: comma-separated batch sizes, default 64,1,16)
"""

import json
import sys

import torch
import torch.nn.functional as F

from statereduce import decode_gemm
from statereduce.decode import programmatic_launch
from statereduce.speed import graphed, time_ms

# (name, N, K): DeltaNet 1.3B's fused step at 0 / 50 / 75 %, then Gated DeltaNet 1.3B's at 0 / 50 / 75 %
SHAPES = [("dn qkvb", 6208, 2048), ("dn qkvb 50%", 4160, 2048), ("dn qkvb 75%", 3136, 2048), ("dn o", 2048, 2048),
          ("gate|up", 11264, 2048), ("gdn proj", 9280, 2048), ("gdn proj 50%", 7744, 2048),
          ("gdn proj 75%", 6976, 2048), ("gdn o", 2048, 3072)]


def graph_us(fns, reps=50):
    """Best of 3 trials of µs per launch of a graph running every fn in fns once."""
    return min(time_ms(graphed(lambda: [f() for f in fns]), warmup=5, steps=reps, trials=3)) * 1e3 / len(fns)


def chosen(n, k, m, swiglu):
    """The autotuner's choice for this key, as text."""
    for key, cfg in decode_gemm._kernel().cache.items():
        if key[:4] == (n, k, decode_gemm._bm(m), swiglu):
            return f"BN{cfg.kwargs['BN']} BK{cfg.kwargs['BK']} split{cfg.kwargs['SPLIT']}"
    return "?"


def measure(name, n, k, m, swiglu):
    from fla.modules.mlp import swiglu as fla_swiglu

    width = 2 * k if swiglu else k
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(24)]
    x = torch.randn(m, width, device="cuda", dtype=torch.bfloat16)
    a = F.silu(x[:, :k].float()) * x[:, k:].float() if swiglu else x.float()
    ref = a @ ws[0].float().T
    ys = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in ws]
    if swiglu:
        torch_fns = [lambda w=w, y=y: torch.mm(fla_swiglu(x[:, :k], x[:, k:]), w.t(), out=y) for w, y in zip(ws, ys)]
    else:
        torch_fns = [lambda w=w, y=y: torch.mm(x, w.t(), out=y) for w, y in zip(ws, ys)]
    row = {"shape": name, "M": m, "N": n, "K": k, "swiglu": swiglu, "weight_MB": n * k * 2 / 1e6,
           "cublas_us": graph_us(torch_fns)}
    ours = [lambda w=w: decode_gemm.linear(x, w, swiglu=swiglu) for w in ws]
    first = decode_gemm.linear(x, ws[0], swiglu=swiglu)  # tunes on the first call of the key (without PDL)
    for pdl in (False, True):
        with programmatic_launch(pdl):
            row[f"ours_pdl_{'on' if pdl else 'off'}_us"] = graph_us(ours)
    row["config"] = chosen(n, k, m, swiglu)
    last = decode_gemm.linear(x, ws[0], swiglu=swiglu)  # after 2 x 24 x 440 replays: the counters were reset
    row["rel_err"] = float((last.float() - ref).norm() / ref.norm())
    torch_fns[0]()
    row["cublas_rel_err"] = float((ys[0].float() - ref).norm() / ref.norm())
    row["replays_equal"] = bool(torch.equal(first, last))
    tb = lambda us: n * k * 2 / (us * 1e-6) / 1e12
    print(f"{name:14s} M={m:2d} N={n:5d} K={k:4d}  cuBLAS {row['cublas_us']:6.2f} us ({tb(row['cublas_us']):.2f} "
          f"TB/s)  ours {row['ours_pdl_off_us']:6.2f} / PDL {row['ours_pdl_on_us']:6.2f} us "
          f"({tb(row['ours_pdl_on_us']):.2f} TB/s) {row['config']}  err {row['rel_err']:.1e} "
          f"(cuBLAS {row['cublas_rel_err']:.1e}) same bits {row['replays_equal']}", flush=True)
    return row


def main(out, rows=(64, 1, 16)):
    torch.manual_seed(0)
    decode_gemm.reserve(torch.device("cuda"), 64, 11264)
    results = []
    for m in rows:
        for name, n, k in SHAPES:
            results.append(measure(name, n, k, m, swiglu=False))
        results.append(measure("swiglu+down", 2048, 5632, m, swiglu=True))
        torch.cuda.empty_cache()
        with open(out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], *([tuple(int(r) for r in sys.argv[2].split(","))] if len(sys.argv) > 2 else []))
