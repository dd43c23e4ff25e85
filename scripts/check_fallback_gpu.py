#!/usr/bin/env python
"""Check statereduce.kernels.fla_fallback's pure-PyTorch kernels against fla's Triton kernels on a CUDA GPU.

Standalone (no snakemake, no pytest). Needs a CUDA GPU with fla 0.6.0 and Triton. For every op it builds random
inputs on the GPU, runs fla's kernel (bf16, and fp32 where fla accepts it) and our torch implementation (called
directly, on the same inputs upcast to fp32), then compares the forward outputs (and final states) and the
gradients of every input (q, k, v, beta, g, initial state, conv weight, ...) under a random cotangent. A kernel
that fla refuses (e.g. the Gated DeltaNet chunk backward on Hopper with Triton < 3.7.1, the fused_recurrent
gated backward, the fp32 DeltaNet chunk) is recorded as ``refused`` with fla's message. It also times our torch
chunk ops on the GPU (a possible GDN training path where fla's backward is refused).

Errors: ``max_abs`` = max |fla - ours|; ``rel_max`` = max_abs / max |ours|; ``rel_l2`` = ||fla - ours|| / ||ours||.
bf16 rows measure bf16 rounding of fla's kernels (expect rel_l2 ~1e-2); fp32 rows should be ~1e-5.

Usage::

    python scripts/check_fallback_gpu.py results/check_fallback_gpu.json [--seed 0] [--quick]

Paper: Nazari & Rusch (2026), "On State Reduction in Linear Attention", Sec. 2 (the recurrences checked here).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from statereduce.kernels import fla_fallback as ours

Record = dict[str, Any]

#: device the comparisons run on; only a CPU dry run of this script's plumbing changes it
DEVICE = "cuda"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _errors(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    a, b = a.detach().double(), b.detach().double()
    diff = (a - b).abs()
    max_abs = diff.max().item() if diff.numel() else 0.0
    ref_max = b.abs().max().item() if b.numel() else 0.0
    ref_l2 = b.norm().item()
    return {
        "max_abs": max_abs,
        "rel_max": max_abs / ref_max if ref_max > 0 else float("nan"),
        "rel_l2": (a - b).norm().item() / ref_l2 if ref_l2 > 0 else float("nan"),
        "ref_max": ref_max,
    }


def _status_of(exc: BaseException) -> tuple[str, str]:
    msg = f"{type(exc).__name__}: {exc}".strip()
    refused = isinstance(exc, (NotImplementedError, AssertionError)) or "Triton >=" in msg or "not support" in msg
    return ("refused" if refused else "error"), msg[:2000]


def compare(
    case: str,
    dtype: torch.dtype,
    make_inputs: Callable[[], dict[str, torch.Tensor]],
    fla_fn: Callable[..., Any],
    ours_fn: Callable[..., Any],
    grad_names: list[str],
    out_names: list[str],
    seed: int,
    keep_fp32: tuple[str, ...] = ("initial_state", "A_log", "dt_bias"),
) -> list[Record]:
    """Run fla (inputs in ``dtype``; ``keep_fp32`` ones stay fp32, as the layers pass them) and ours (the same
    values in fp32) forward and backward and compare."""
    torch.manual_seed(seed)
    base = make_inputs()
    floating = {n: t for n, t in base.items() if isinstance(t, torch.Tensor) and t.is_floating_point()}
    x_fla = {n: (t.to(dtype) if n in floating and n not in keep_fp32 else t) for n, t in base.items()}
    # clones: in-place ops (the conv-update cache) must not leak from one side to the other
    x_fla = {n: (t.detach().clone().requires_grad_(n in grad_names) if n in floating else t) for n, t in x_fla.items()}
    # ours sees exactly the values fla sees (rounded to dtype), upcast to fp32
    x_our = {
        n: (t.detach().float().clone().requires_grad_(n in grad_names) if n in floating else t)
        for n, t in x_fla.items()
    }
    tag = str(dtype).replace("torch.", "")
    recs: list[Record] = []

    def rec(quantity: str, status: str, **kw: Any) -> None:
        recs.append({"case": case, "dtype": tag, "quantity": quantity, "status": status, **kw})

    try:
        out_fla = fla_fn(**x_fla)
        _sync()
    except Exception as exc:  # noqa: BLE001 - the message is the result
        status, msg = _status_of(exc)
        rec("forward", status, message=msg)
        return recs
    out_our = ours_fn(**x_our)
    out_fla = out_fla if isinstance(out_fla, (tuple, list)) else (out_fla,)
    out_our = out_our if isinstance(out_our, (tuple, list)) else (out_our,)
    pairs = [(n, a, b) for n, a, b in zip(out_names, out_fla, out_our) if a is not None and b is not None]
    for n, a, b in pairs:
        if a.shape != b.shape:
            rec(n, "error", message=f"shape mismatch: fla {tuple(a.shape)} vs ours {tuple(b.shape)}")
            continue
        rec(n, "ok", **_errors(a, b))
    if not grad_names:
        return recs
    gen = torch.Generator(device=DEVICE).manual_seed(seed + 1)
    cots = [torch.randn(b.shape, device=b.device, generator=gen) for _, _, b in pairs]
    loss_our = sum((b.float() * c).sum() for (_, _, b), c in zip(pairs, cots))
    g_our = torch.autograd.grad(loss_our, [x_our[n] for n in grad_names], allow_unused=True)
    try:
        loss_fla = sum((a.float() * c).sum() for (_, a, _), c in zip(pairs, cots))
        g_fla = torch.autograd.grad(loss_fla, [x_fla[n] for n in grad_names], allow_unused=True)
        _sync()
    except Exception as exc:  # noqa: BLE001
        status, msg = _status_of(exc)
        rec("backward", status, message=msg)
        return recs
    for n, a, b in zip(grad_names, g_fla, g_our):
        if a is None or b is None:
            rec(f"d{n}", "error", message=f"gradient missing: fla {a is None}, ours {b is None}")
        else:
            rec(f"d{n}", "ok", **_errors(a, b))
    return recs


# ----------------------------------------------------------------------------------------------------------------
# input factories (fp32 on cuda; compare() casts)
# ----------------------------------------------------------------------------------------------------------------
def delta_inputs(B: int, T: int, H: int, K: int, V: int, h0: bool) -> Callable[[], dict[str, torch.Tensor]]:
    def make() -> dict[str, torch.Tensor]:
        d = {"device": DEVICE}
        x = {
            "q": torch.randn(B, T, H, K, **d),
            "k": torch.randn(B, T, H, K, **d),
            "v": torch.randn(B, T, H, V, **d),
            "beta": torch.rand(B, T, H, **d).sigmoid(),
        }
        if h0:
            x["initial_state"] = 0.1 * torch.randn(B, H, K, V, **d)
        return x

    return make


def gdn_inputs(
    B: int, T: int, H: int, HV: int, K: int, V: int, h0: bool, in_kernel_gate: bool
) -> Callable[[], dict[str, torch.Tensor]]:
    """Inputs as GatedDeltaNet passes them: raw gate/beta logits with A_log/dt_bias, state_v_first [N,HV,V,K]."""

    def make() -> dict[str, torch.Tensor]:
        d = {"device": DEVICE}
        x = {
            "q": torch.randn(B, T, H, K, **d),
            "k": torch.randn(B, T, H, K, **d),
            "v": torch.randn(B, T, HV, V, **d),
        }
        if in_kernel_gate:
            x["g"] = torch.randn(B, T, HV, **d)
            x["beta"] = torch.randn(B, T, HV, **d)
            x["A_log"] = torch.log(torch.empty(HV, **d).uniform_(1, 16))
            x["dt_bias"] = torch.randn(HV, **d) * 0.5
        else:
            x["g"] = F.logsigmoid(torch.randn(B, T, HV, **d) + 3)
            x["beta"] = torch.rand(B, T, HV, **d)
        if h0:
            x["initial_state"] = 0.1 * torch.randn(B, HV, V, K, **d)
        return x

    return make


def run_delta(records: list[Record], quick: bool, seed: int) -> None:
    from fla.ops.delta_rule import chunk_delta_rule, fused_recurrent_delta_rule

    shapes = [(2, 200, 4, 64, 64, True)] if quick else [(2, 200, 4, 64, 64, True), (4, 512, 4, 128, 128, False)]
    for B, T, H, K, V, h0 in shapes:
        for name, fla_fn, our_fn, t in [
            ("delta_rule.chunk", chunk_delta_rule, ours.chunk_delta_rule, T),
            ("delta_rule.fused_recurrent", fused_recurrent_delta_rule, ours.fused_recurrent_delta_rule, min(T, 64)),
        ]:
            grads = ["q", "k", "v", "beta"] + (["initial_state"] if h0 else [])
            kw = {"output_final_state": True, "use_qk_l2norm_in_kernel": True}
            for dtype in (torch.bfloat16, torch.float32):
                records += compare(
                    f"{name} B{B} T{t} H{H} K{K} V{V} h0={h0}",
                    dtype,
                    delta_inputs(B, t, H, K, V, h0),
                    lambda fn=fla_fn, kw=kw, **x: fn(**x, **kw),
                    lambda fn=our_fn, kw=kw, **x: fn(**x, **kw),
                    grads,
                    ["o", "final_state"],
                    seed,
                )


def run_gdn(records: list[Record], quick: bool, seed: int) -> None:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    shapes = [(2, 200, 2, 4, 64, 128, True)]
    if not quick:
        shapes.append((4, 512, 4, 4, 128, 256, False))
    for B, T, H, HV, K, V, h0 in shapes:
        for name, fla_fn, our_fn, t in [
            ("gated_delta_rule.chunk", chunk_gated_delta_rule, ours.chunk_gated_delta_rule, T),
            (
                "gated_delta_rule.fused_recurrent",
                fused_recurrent_gated_delta_rule,
                ours.fused_recurrent_gated_delta_rule,
                min(T, 64),
            ),
        ]:
            for in_kernel in (True, False):
                grads = ["q", "k", "v", "g", "beta"] + (["initial_state"] if h0 else [])
                if in_kernel:
                    grads += ["A_log", "dt_bias"]
                kw: dict[str, Any] = {
                    "output_final_state": True,
                    "use_qk_l2norm_in_kernel": True,
                    "state_v_first": True,
                }
                if in_kernel:
                    kw.update(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
                for dtype in (torch.bfloat16, torch.float32):
                    records += compare(
                        f"{name} B{B} T{t} H{H} HV{HV} K{K} V{V} h0={h0} gate_in_kernel={in_kernel}",
                        dtype,
                        gdn_inputs(B, t, H, HV, K, V, h0, in_kernel),
                        lambda fn=fla_fn, kw=kw, **x: fn(**x, **kw),
                        lambda fn=our_fn, kw=kw, **x: fn(**x, **kw),
                        grads,
                        ["o", "final_state"],
                        seed,
                    )


def run_modules(records: list[Record], seed: int) -> None:
    from fla.modules.activations import swiglu, swiglu_linear
    from fla.modules.causal_conv1d import causal_conv1d, causal_conv1d_update
    from fla.modules.norm.fused_norm_gate import rms_norm_gated
    from fla.modules.norm.layernorm import rms_norm

    B, T, D, W = 2, 300, 256, 4

    def conv_inputs() -> dict[str, torch.Tensor]:
        return {
            "x": torch.randn(B, T, D, device=DEVICE),
            "weight": torch.randn(D, W, device=DEVICE) * 0.5,
            "bias": torch.randn(D, device=DEVICE) * 0.1,
            "initial_state": torch.randn(B, D, W, device=DEVICE),
        }

    kw = {"activation": "silu", "output_final_state": True}
    for dtype in (torch.bfloat16, torch.float32):
        records += compare(
            f"causal_conv1d B{B} T{T} D{D} W{W} h0",
            dtype,
            conv_inputs,
            lambda **x: causal_conv1d(**x, **kw),
            lambda **x: ours.causal_conv1d(**x, **kw),
            ["x", "weight", "bias", "initial_state"],
            ["y", "final_state"],
            seed,
        )

        def step_inputs() -> dict[str, torch.Tensor]:
            return {
                "x": torch.randn(B, 1, D, device=DEVICE),
                "cache": torch.randn(B, D, W, device=DEVICE),
                "weight": torch.randn(D, W, device=DEVICE) * 0.5,
                "bias": torch.randn(D, device=DEVICE) * 0.1,
            }

        records += compare(
            f"causal_conv1d_update B{B} D{D} W{W}",
            dtype,
            step_inputs,
            lambda **x: causal_conv1d_update(**x, activation="silu"),
            lambda **x: ours.causal_conv1d_update(**x, activation="silu"),
            [],
            ["y", "cache"],
            seed,
        )

        def norm_inputs() -> dict[str, torch.Tensor]:
            return {
                "x": torch.randn(B, T, D, device=DEVICE),
                "weight": 1 + 0.1 * torch.randn(D, device=DEVICE),
                "residual": torch.randn(B, T, D, device=DEVICE),
            }

        nkw = {"bias": None, "eps": 1e-6, "prenorm": True, "residual_in_fp32": True}
        records += compare(
            f"rms_norm+residual B{B} T{T} D{D}",
            dtype,
            norm_inputs,
            lambda nkw=nkw, **x: rms_norm(**x, **nkw),
            lambda nkw=nkw, **x: ours.rms_norm(**x, **nkw),
            ["x", "weight", "residual"],
            ["y", "residual_out"],
            seed,
        )

        def gnorm_inputs() -> dict[str, torch.Tensor]:
            return {
                "x": torch.randn(B, T, 4, 64, device=DEVICE),
                "g": torch.randn(B, T, 4, 64, device=DEVICE),
                "weight": 1 + 0.1 * torch.randn(64, device=DEVICE),
            }

        for act in ("swish", "sigmoid"):
            records += compare(
                f"rms_norm_gated[{act}] B{B} T{T} 4x64",
                dtype,
                gnorm_inputs,
                lambda act=act, **x: rms_norm_gated(**x, bias=None, activation=act, eps=1e-5),
                lambda act=act, **x: ours.rms_norm_gated(**x, bias=None, activation=act, eps=1e-5),
                ["x", "g", "weight"],
                ["y"],
                seed,
            )

        def glu_inputs() -> dict[str, torch.Tensor]:
            return {"x": torch.randn(B, T, 512, device=DEVICE), "y": torch.randn(B, T, 512, device=DEVICE)}

        records += compare(
            f"swiglu B{B} T{T} 512",
            dtype,
            glu_inputs,
            lambda **x: swiglu(x["x"], x["y"]),
            lambda **x: ours.swiglu(x["x"], x["y"]),
            ["x", "y"],
            ["z"],
            seed,
        )

        def glu_lin_inputs() -> dict[str, torch.Tensor]:
            x = glu_inputs()
            x["weight"] = torch.randn(D, 512, device=DEVICE) * 512**-0.5
            return x

        records += compare(
            f"swiglu_linear B{B} T{T} 512->{D}",
            dtype,
            glu_lin_inputs,
            lambda **x: swiglu_linear(x["x"], x["y"], x["weight"], None),
            lambda **x: ours.swiglu_linear(x["x"], x["y"], x["weight"], None),
            ["x", "y", "weight"],
            ["out"],
            seed,
        )


def time_ours(records: list[Record], quick: bool) -> None:
    """Wall time of our torch chunk GDN forward+backward on the GPU (fp32), e.g. for GDN training there."""
    B, T, H, HV, K, V = (8, 512, 4, 4, 128, 256) if quick else (16, 2048, 4, 4, 128, 256)
    x = gdn_inputs(B, T, H, HV, K, V, False, True)()
    x = {n: t.requires_grad_() for n, t in x.items()}
    kw = {
        "use_qk_l2norm_in_kernel": True,
        "state_v_first": True,
        "use_gate_in_kernel": True,
        "use_beta_sigmoid_in_kernel": True,
    }
    for _ in range(2):  # warm-up
        ours.chunk_gated_delta_rule(**x, **kw)[0].sum().backward()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    n = 5
    for _ in range(n):
        ours.chunk_gated_delta_rule(**x, **kw)[0].sum().backward()
    torch.cuda.synchronize()
    records.append(
        {
            "case": f"timing ours chunk_gated_delta_rule fwd+bwd B{B} T{T} H{H} HV{HV} K{K} V{V}",
            "dtype": "float32",
            "quantity": "seconds_per_call",
            "status": "ok",
            "value": (time.perf_counter() - t0) / n,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        }
    )


def print_table(records: list[Record]) -> None:
    print(f"{'case':<78} {'dtype':<9} {'quantity':<14} {'status':<8} {'max_abs':>10} {'rel_max':>10} {'rel_l2':>10}")
    for r in records:
        if r["status"] == "ok" and "max_abs" in r:
            print(
                f"{r['case']:<78} {r['dtype']:<9} {r['quantity']:<14} {'ok':<8} "
                f"{r['max_abs']:>10.2e} {r['rel_max']:>10.2e} {r['rel_l2']:>10.2e}"
            )
        elif "value" in r:
            print(
                f"{r['case']:<78} {r['dtype']:<9} {r['quantity']:<14} {'ok':<8} {r['value']:>10.4f} s "
                f"(peak {r['peak_mem_gib']:.2f} GiB)"
            )
        else:
            print(f"{r['case']:<78} {r['dtype']:<9} {r['quantity']:<14} {r['status']:<8} {r.get('message', '')[:160]}")


def _write(path: str, meta: Record, records: list[Record]) -> None:
    out_dir = os.path.dirname(os.path.abspath(path))
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=out_dir, delete=False, suffix=".tmp") as fh:
        json.dump({"meta": meta, "records": records}, fh, indent=1)
        tmp = fh.name
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_json", help="where to write the JSON records")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="one shape per op")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("check_fallback_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    import fla
    import triton

    records: list[Record] = []
    sections = [
        ("delta rule", lambda: run_delta(records, args.quick, args.seed)),
        ("gated delta rule", lambda: run_gdn(records, args.quick, args.seed)),
        ("modules", lambda: run_modules(records, args.seed)),
        ("timing", lambda: time_ours(records, args.quick)),
    ]
    meta = {
        "torch": torch.__version__,
        "fla": getattr(fla, "__version__", "?"),
        "triton": triton.__version__,
        "device": torch.cuda.get_device_name(),
        "seed": args.seed,
        "quick": args.quick,
    }
    for name, fn in sections:
        t0 = time.perf_counter()
        print(f"== {name} ...", flush=True)
        try:
            fn()
        except Exception:  # noqa: BLE001 - keep going; the traceback is recorded
            records.append(
                {
                    "case": name,
                    "dtype": "-",
                    "quantity": "section",
                    "status": "error",
                    "message": traceback.format_exc()[-2000:],
                }
            )
        print(f"   {name}: {time.perf_counter() - t0:.1f} s", flush=True)
        _write(args.out_json, meta, records)  # partial results survive a time limit
    print_table(records)
    n_err = sum(r["status"] == "error" for r in records)
    print(
        f"\n{len(records)} records, {n_err} errors, "
        f"{sum(r['status'] == 'refused' for r in records)} refused -> {args.out_json}"
    )
    return 1 if n_err else 0


if __name__ == "__main__":
    sys.exit(main())
