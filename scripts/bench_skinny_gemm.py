"""Decode-shaped GEMMs (64 rows) on the GPU: cuBLAS (torch's F.linear) against a plain Triton weight-streaming
kernel over a small tile sweep, each timed as 24 launches on distinct weights in one CUDA graph (as in a decode
step: every layer's weights come from HBM). Prints, per shape, µs per launch and TB/s of weight bytes, and writes
JSON. It asks whether the fused decode step's projections leave bandwidth to a better kernel
(docs/records/speed_h200.md, "Decode-shaped GEMMs").

    python scripts/bench_skinny_gemm.py OUT.json
"""

import itertools
import json
import sys

import torch
import triton
import triton.language as tl

from statereduce.speed.bench import graphed, time_ms


@triton.jit
def skinny_mm(x, w, y, M, N, K: tl.constexpr, s_xm, s_wn, s_ym, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    o_m = tl.arange(0, BM)
    o_n = tl.program_id(0) * BN + tl.arange(0, BN)
    m_m, m_n = o_m < M, o_n < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        a = tl.load(x + o_m[:, None] * s_xm + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0)
        b = tl.load(w + o_n[None, :] * s_wn + o_k[:, None], mask=m_n[None, :] & m_k[:, None], other=0)
        acc = tl.dot(a, b, acc)
    tl.store(y + o_m[:, None] * s_ym + o_n[None, :], acc.to(y.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


def graph_us(fns, reps=50):
    """Best of 3 trials of µs per launch of a graph running every fn in fns once."""
    return min(time_ms(graphed(lambda: [f() for f in fns]), warmup=5, steps=reps, trials=3)) * 1e3 / len(fns)


def main(out):
    torch.manual_seed(0)
    # (name, N, K): DeltaNet 1.3B fused step at 0 % / 75 %, Gated DeltaNet 1.3B
    shapes = [("dn qkvb", 6208, 2048), ("dn qkvb 75%", 3136, 2048), ("dn o", 2048, 2048), ("gate|up", 11264, 2048),
              ("down", 2048, 5632), ("gdn proj", 9280, 2048), ("gdn o", 2048, 3072), ("lm head", 32000, 2048)]
    results = []
    for name, n, k in shapes:
        for m in (64, 1):
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(24)]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ys = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in ws]
            ref = torch.nn.functional.linear(x, ws[0])
            cublas = graph_us([lambda w=w, y=y, x=x: torch.mm(x, w.t(), out=y) for w, y in zip(ws, ys)])
            row = {"shape": name, "M": m, "N": n, "K": k, "weight_MB": n * k * 2 / 1e6, "cublas_us": cublas,
                   "triton": []}
            for bn, bk, warps, stages in itertools.product((16, 32, 64), (64, 128, 256), (4,), (3, 5)):
                bm = 16 if m <= 16 else 64
                grid = (triton.cdiv(n, bn),)

                def call(w, y, bn=bn, bk=bk, warps=warps, stages=stages, bm=bm, grid=grid, x=x, m=m, n=n, k=k):
                    skinny_mm[grid](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0), BM=bm, BN=bn, BK=bk,
                                    num_warps=warps, num_stages=stages)
                try:
                    call(ws[0], ys[0])
                    err = float((ys[0].float() - ref.float()).norm() / ref.float().norm())
                    us = graph_us([lambda w=w, y=y, call=call: call(w, y) for w, y in zip(ws, ys)])
                except Exception as e:  # noqa: BLE001 (a config that does not compile, e.g. shared memory, is skipped)
                    row["triton"].append({"BN": bn, "BK": bk, "warps": warps, "stages": stages, "error": str(e)[:80]})
                    continue
                row["triton"].append({"BN": bn, "BK": bk, "warps": warps, "stages": stages, "us": us, "rel_err": err})
            ok = [t for t in row["triton"] if "us" in t]
            best = min(ok, key=lambda t: t["us"]) if ok else None
            row["best"] = best
            tb = lambda us, n=n, k=k: n * k * 2 / (us * 1e-6) / 1e12
            print(f"{name:12s} M={m:2d} N={n:5d} K={k:4d}  cuBLAS {cublas:6.2f} us ({tb(cublas):.2f} TB/s)  "
                  f"Triton best {best['us']:6.2f} us ({tb(best['us']):.2f} TB/s) BN{best['BN']} BK{best['BK']} "
                  f"s{best['stages']} err {best['rel_err']:.1e}", flush=True)
            results.append(row)
            del ws, ys
            torch.cuda.empty_cache()
    with open(out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
