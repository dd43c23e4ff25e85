#!/usr/bin/env python
"""Sweep fla's delta-rule kernels over every head shape state reduction can give, on a CUDA GPU.

For DeltaNet and Gated DeltaNet, the chunk and the fused recurrent kernel, each key width d_k' that the ratio grid
(``--pcts``, percent of key channels removed, plus the unpruned width) gives for d_k in {64, 128, 256}, and each
d_v in {64, 128, 256, 512}: one process runs the kernel forward and backward on bf16 inputs (q and k L2-normalised in
the kernel, as fla's layers call it; an initial state; the final state returned) and compares the output, the final
state and the gradients of q, k, v, beta (g) and the initial state with the float64 per-step recurrence
:func:`statereduce.kernels.reference.delta_rule`. A process per case, because an illegal memory access loses the CUDA
context. ``--padded`` cases call the kernel through :func:`statereduce.kernels.shapes.call_padded` (q and k
zero-padded), as the adapters route faulty shapes.

Usage::

    python scripts/sweep_fla_shapes.py OUT.json [--gpus 2] [--jobs 24] [--T 1024]
    python scripts/sweep_fla_shapes.py --case delta_net,chunk,16,64,0   # one case, prints its JSON line

Status of a case: ``ok`` (every relative error below ``--tol``), ``wrong`` (a finite error above it), ``error`` (the
kernel raised; fla refuses some backwards on some Triton versions), ``crash`` (the process died, e.g. an illegal
memory access). Paper: Nazari & Rusch (2026), Sec. 3 (the pruned state d_v x d_k').
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = {
    ("delta_net", "chunk"): "chunk_delta_rule",
    ("delta_net", "fused_recurrent"): "fused_recurrent_delta_rule",
    ("gated_deltanet", "chunk"): "chunk_gated_delta_rule",
    ("gated_deltanet", "fused_recurrent"): "fused_recurrent_gated_delta_rule",
}


def key_widths(d_ks: list[int], pcts: list[float]) -> list[int]:
    """Every d_k' of the grid: ``round(d_k * (1 - pct/100))`` for each d_k and pct, and each d_k itself."""
    sys.path.insert(0, str(ROOT))
    from statereduce.selectors.registry import n_keep_for

    out = set(d_ks)
    for d_k in d_ks:
        for pct in pcts:
            out.add(n_keep_for(d_k, pct))
    return sorted(out)


def run_case(family: str, kernel: str, d_k: int, d_v: int, padded: bool, T: int, B: int = 1, H: int = 2) -> dict:
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT))
    import fla.ops.delta_rule as dr
    import fla.ops.gated_delta_rule as gdr

    from statereduce.kernels.reference import delta_rule
    from statereduce.kernels.shapes import call_padded

    fn = {**vars(dr), **vars(gdr)}[KERNELS[family, kernel]]
    gen = torch.Generator(device="cuda").manual_seed(1000 * d_k + d_v)
    dev, bf = "cuda", torch.bfloat16

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=dev) * scale).to(bf)

    q, k, v = rnd(B, T, H, d_k), rnd(B, T, H, d_k), rnd(B, T, H, d_v)
    beta = torch.rand(B, T, H, generator=gen, device=dev).to(bf)
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen, device=dev) + 3) if family == "gated_deltanet" else None
    h0 = torch.randn(B, H, d_k, d_v, generator=gen, device=dev) * 0.1
    do, dh = torch.randn(B, T, H, d_v, generator=gen, device=dev), torch.randn(B, H, d_k, d_v, generator=gen, device=dev)
    leaves = {"q": q, "k": k, "v": v, "beta": beta, "h0": h0, **({"g": g} if g is not None else {})}
    scale = d_k**-0.5
    doc: dict = {"family": family, "kernel": kernel, "d_k": d_k, "d_v": d_v, "padded": padded, "T": T}

    # reference in float64 (q, k normalised outside: the kernel normalises in float32)
    ref_in = {n: t.detach().double().requires_grad_() for n, t in leaves.items()}
    qn, kn = F.normalize(ref_in["q"], dim=-1), F.normalize(ref_in["k"], dim=-1)
    o_ref, s_ref = delta_rule(qn, kn, ref_in["v"], ref_in["beta"], ref_in.get("g"), scale=scale,
                              initial_state=ref_in["h0"])
    ((o_ref * do.double()).sum() + (s_ref * dh.double()).sum()).backward()

    args = dict(scale=scale, initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ins = {n: t.detach().clone().requires_grad_() for n, t in leaves.items()}
    args["initial_state"] = ins["h0"]
    call = (lambda *a, **kw: call_padded(fn, max(64, d_k), *a, **kw)) if padded else fn
    try:
        if family == "gated_deltanet":
            o, s = call(ins["q"], ins["k"], ins["v"], g=ins["g"], beta=ins["beta"], **args)
        else:
            o, s = call(ins["q"], ins["k"], ins["v"], ins["beta"], **args)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 -- fla refuses some shapes / backwards with an exception: record it
        return {**doc, "status": "error", "stage": "forward", "message": f"{type(e).__name__}: {e}"[:400]}

    def rel(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))

    doc["forward"] = {"o": rel(o, o_ref), "final_state": rel(s, s_ref)}
    try:
        ((o.float() * do).sum() + (s.float() * dh).sum()).backward()
        torch.cuda.synchronize()
        doc["backward"] = {f"d{n}": rel(ins[n].grad, ref_in[n].grad) for n in leaves}
    except Exception as e:  # noqa: BLE001
        doc["backward_error"] = f"{type(e).__name__}: {e}"[:400]
    return doc


def classify(doc: dict, tol: float) -> dict:
    if "status" in doc:
        return doc
    errs = {**doc["forward"], **doc.get("backward", {})}
    worst = max(errs.values())
    doc["max_rel_error"] = worst
    if worst != worst or worst > tol:  # NaN or above tolerance
        doc["status"] = "wrong"
    elif "backward_error" in doc:
        doc["status"] = "error"
        doc["stage"] = "backward"
        doc["message"] = doc.pop("backward_error")
    else:
        doc["status"] = "ok"
    return doc


def _spawn(case: tuple, gpu: int, T: int, tol: float, timeout: float) -> dict:
    family, kernel, d_k, d_v, padded = case
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)}
    t0 = time.perf_counter()
    cmd = [sys.executable, __file__, "--case", f"{family},{kernel},{d_k},{d_v},{int(padded)}", "--T", str(T)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"family": family, "kernel": kernel, "d_k": d_k, "d_v": d_v, "padded": padded, "status": "crash",
                "message": f"timed out after {timeout:.0f} s"}
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = [x for x in p.stderr.strip().splitlines() if "Warning" not in x][-3:]
        return {"family": family, "kernel": kernel, "d_k": d_k, "d_v": d_v, "padded": padded, "status": "crash",
                "returncode": p.returncode, "message": " | ".join(tail)[-400:]}
    doc = classify(json.loads(lines[-1]), tol)
    doc["seconds"] = round(time.perf_counter() - t0, 1)
    return doc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, nargs="?")
    p.add_argument("--case", help="family,kernel,d_k,d_v,padded: run one case in this process")
    p.add_argument("--T", type=int, default=1024)
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--jobs", type=int, default=8)
    p.add_argument("--tol", type=float, default=0.05, help="largest relative error of a right result (bf16: ~1e-2)")
    p.add_argument("--d-k", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--d-v", type=int, nargs="+", default=[64, 128, 256, 512])
    p.add_argument("--pcts", type=float, nargs="+", default=[25, 50, 75, 87.5])
    p.add_argument("--families", nargs="+", default=["delta_net", "gated_deltanet"])
    p.add_argument("--padded", choices=["none", "below64", "all"], default="below64",
                   help="also run the chunk kernels through the zero-padded call (to 64 channels) at d_k' < 64")
    p.add_argument("--timeout", type=float, default=400)
    args = p.parse_args()
    if args.case:
        family, kernel, d_k, d_v, padded = args.case.split(",")
        print(json.dumps(run_case(family, kernel, int(d_k), int(d_v), bool(int(padded)), args.T)), flush=True)
        return
    import torch

    widths = key_widths(args.d_k, args.pcts)
    stock = [(f, kern, dk, dv, False) for f in args.families for kern in ("chunk", "fused_recurrent")
             for dk in widths for dv in args.d_v]
    padded = [(f, kern, dk, dv, True) for f, kern, dk, dv, _ in stock if dk < 64 and kern == "chunk"] if args.padded != "none" else []
    # widest first: the cases that compile the most kernels start early; padded ones last (their kernels exist)
    cases = sorted(stock, key=lambda c: -c[2] * c[3]) + padded
    doc = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "fla": __import__("fla").__version__,
        "triton": __import__("triton").__version__,
        "T": args.T, "batch": 1, "heads": 2, "dtype": "bfloat16", "tol": args.tol,
        "d_k": args.d_k, "pcts": args.pcts, "key_widths": widths, "d_v": args.d_v,
        "cases": [],
    }
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(args.jobs) as pool:
        futs = [pool.submit(_spawn, c, i % args.gpus, args.T, args.tol, args.timeout) for i, c in enumerate(cases)]
        for n, fut in enumerate(cf.as_completed(futs), 1):
            r = fut.result()
            doc["cases"].append(r)
            print(f"[{n}/{len(cases)} {time.perf_counter() - t0:.0f}s] {r['family']} {r['kernel']} {r['d_k']}x{r['d_v']}"
                  f"{' padded' if r['padded'] else ''}: {r['status']} {r.get('max_rel_error', r.get('message', ''))}",
                  flush=True)
            if n % 10 == 0 or n == len(cases):
                doc["cases"].sort(key=lambda c: (c["family"], c["kernel"], c["padded"], c["d_k"], c["d_v"]))
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(doc, indent=1) + "\n")
    doc["seconds"] = round(time.perf_counter() - t0, 1)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    bad = [c for c in doc["cases"] if c["status"] != "ok"]
    print(f"{len(doc['cases'])} cases, {len(bad)} not ok:")
    for c in bad:
        print(" ", c["family"], c["kernel"], f"{c['d_k']}x{c['d_v']}", "padded" if c["padded"] else "", c["status"],
              c.get("max_rel_error", c.get("message", "")))


if __name__ == "__main__":
    main()
