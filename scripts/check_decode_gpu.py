"""GPU check and kernel-level timing of the in-place one-token decode steps (statereduce.speed.inplace), on one device.

1. Correctness: statereduce's ``recurrent_step`` and fla's kernels run in place against fla's own
   ``fused_recurrent_*`` (new-state) functions on fresh random inputs: DeltaNet layout ([N, H, K, V]) and
   Gated DeltaNet layout ([N, HV, V, K], gate and beta sigmoid in the kernel, grouped value heads), d_k from 32 to
   256, d_k not a power of two. Also fla's ``chunk_delta_rule`` against ``fused_recurrent_delta_rule`` (on an H200
   it gave wrong outputs at d_k = 32, d_v = 64 in one of two processes; docs/speed.md).
2. Timing: ``layers`` launches (one state buffer each, far more than L2) captured in a CUDA graph, batch 64:
   fla's function (new state), fla's kernel in place, ours (autotuned) and a sweep of every tile config the
   autotuner tries (``statereduce.kernels.recurrent.TILE_CONFIGS``, each with and without streaming cache hints);
   bandwidth = state bytes read + written / time, against the measured copy bandwidth.
3. Conv: the fused decode step's one-launch short convolution (``statereduce.kernels.conv.conv_step``) against fla's
   ``causal_conv1d_update`` run per q / k / v segment.
4. PDL: our kernels with programmatic dependent launch off against on, in one run (``pdl_ab``).
5. Floor: our step (autotuned, PDL as configured) against torch moving the same bytes in the same graph layout:
   a copy of each state into a second buffer and an in-place ``mul_`` of each state (``floor_ab``). Says what
   share of the copy bandwidth any kernel reaches at that size, so the step's share can be read against it.

    python scripts/check_decode_gpu.py OUT.json [correctness,chunk,timing,conv,pdl,floor]
"""

from __future__ import annotations

import json
import statistics
import sys

import torch

from statereduce.kernels import recurrent as decode
from statereduce.speed.bench import copy_bandwidth, graphed, time_ms

# (name, heads, value heads, d_k, d_v, gated): the 1.3B models' layers at 0 / 50 / 75 %
SHAPES = [*(("dn", 16, 16, kd, 128, False) for kd in (128, 64, 32)),
          *(("gdn", 6, 6, kd, 512, True) for kd in (256, 128, 64))]


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def inputs(n, h, hv, k, v, gated, dtype=torch.bfloat16, t=1):
    q = torch.randn(n, t, h, k, device="cuda", dtype=dtype)
    kk = torch.randn(n, t, h, k, device="cuda", dtype=dtype)
    vv = torch.randn(n, t, hv, v, device="cuda", dtype=dtype)
    if gated:
        beta = torch.randn(n, t, hv, device="cuda", dtype=dtype)  # raw: sigmoid in kernel
        g = torch.randn(n, t, hv, device="cuda", dtype=dtype)
        a_log = torch.randn(hv, device="cuda").abs().log()
        dt_bias = torch.randn(hv, device="cuda")
        state = torch.randn(n, hv, v, k, device="cuda") * 0.1
    else:
        beta = torch.rand(n, t, h, device="cuda", dtype=dtype)
        g = a_log = dt_bias = None
        state = torch.randn(n, h, k, v, device="cuda") * 0.1
    return q, kk, vv, beta, g, a_log, dt_bias, state


def reference(q, k, v, beta, g, a_log, dt_bias, state, gated):
    """fla's own ``fused_recurrent_*`` function on a copy of ``state`` (it returns a new state tensor): what the
    in-place steps must give on the GPU."""
    from fla.ops.delta_rule import fused_recurrent_delta_rule
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    if gated:
        return fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=state.clone(),
                                                output_final_state=True, use_qk_l2norm_in_kernel=True,
                                                use_gate_in_kernel=True, A_log=a_log, dt_bias=dt_bias,
                                                use_beta_sigmoid_in_kernel=True, state_v_first=True)
    return fused_recurrent_delta_rule(q, k, v, beta, initial_state=state.clone(), output_final_state=True,
                                      use_qk_l2norm_in_kernel=True)


def step(kind, q, k, v, beta, g, a_log, dt_bias, state, gated, **fixed):
    if gated:
        opts = {"g": g, "A_log": a_log, "dt_bias": dt_bias, "l2norm": True, "beta_sigmoid": True,
                "state_v_first": True}
        fn = decode.fla_gated_delta_rule_step if kind == "fla" else decode.recurrent_step
    else:
        opts = {"l2norm": True} if kind == "fla" else {"l2norm": True, "round_qk": True}
        fn = decode.fla_delta_rule_step if kind == "fla" else decode.recurrent_step
    if kind != "fla":
        opts.update(fixed)
    return fn(q, k, v, beta, state, **opts)


def correctness(out):
    cases = [(n, 16, 16, kd, vd, False) for n in (1, 64) for kd in (32, 48, 64, 128) for vd in (64, 128)]
    cases += [(n, h, hv, kd, vd, True) for n in (1, 64) for h, hv, kd, vd in
              ((6, 6, 256, 512), (6, 6, 128, 512), (6, 6, 64, 512), (4, 8, 96, 128), (16, 16, 32, 128))]
    for n, h, hv, kd, vd, gated in cases:
        torch.manual_seed(hash((n, h, hv, kd, vd, gated)) % 2**31)
        args = inputs(n, h, hv, kd, vd, gated)
        o_ref, s_ref = reference(*args, gated)
        row = {"n": n, "h": h, "hv": hv, "k": kd, "v": vd, "gated": gated}
        for kind in ("fla", "statereduce"):
            st = args[-1].clone()
            o = step(kind, *args[:-1], st, gated, **({} if kind == "fla" else {"block_v": 32, "num_warps": 4}))
            torch.cuda.synchronize()
            row[f"{kind}_o_rel"] = rel(o, o_ref)
            row[f"{kind}_state_rel"] = rel(st, s_ref)
        out["correctness"].append(row)
    worst = {k: max(r[k] for r in out["correctness"]) for k in out["correctness"][0] if k.endswith("_rel")}
    out["correctness_worst"] = worst
    print("correctness worst:", worst, flush=True)


def chunk_check(out):
    from fla.ops.delta_rule import chunk_delta_rule, fused_recurrent_delta_rule

    for kd, vd in ((32, 64), (32, 128), (64, 64), (64, 128), (128, 128)):
        torch.manual_seed(kd * 1000 + vd)
        q = torch.randn(2, 256, 4, kd, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(2, 256, 4, kd, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(2, 256, 4, vd, device="cuda", dtype=torch.bfloat16)
        beta = torch.rand(2, 256, 4, device="cuda", dtype=torch.bfloat16)
        o1, s1 = chunk_delta_rule(q, k, v, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
        o2, s2 = fused_recurrent_delta_rule(q, k, v, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
        out["chunk_vs_recurrent"].append({"k": kd, "v": vd, "o_rel": rel(o1, o2), "state_rel": rel(s1, s2)})
    print("chunk vs recurrent:", out["chunk_vs_recurrent"], flush=True)


def graph_time(fn_list, trials=5, reps=20):
    """Median per-replay ms of a graph running every fn in fn_list once."""
    return statistics.median(time_ms(graphed(lambda: [fn() for fn in fn_list]), warmup=3, steps=reps, trials=trials))


def timing(out, layers=24, n=64):
    shapes = [*SHAPES, *(("gdn_mixer", 16, 16, kd, 128, True) for kd in (128, 64, 32))]
    bw = out["copy_bandwidth_Bps"]
    for name, h, hv, kd, vd, gated in shapes:
        bufs = [inputs(n, h, hv, kd, vd, gated) for _ in range(layers)]
        state_bytes = sum(b[-1].numel() * 4 for b in bufs)
        row = {"shape": name, "n": n, "h": hv, "k": kd, "v": vd, "layers": layers,
               "state_bytes_per_launch": state_bytes // layers}

        def record(label, fns, row=row, state_bytes=state_bytes):
            ms = graph_time(fns)
            row[label + "_ms"] = ms
            row[label + "_TBps"] = 2 * state_bytes / (ms / 1e3) / 1e12
            row[label + "_of_copy"] = 2 * state_bytes / (ms / 1e3) / bw

        record("fla_new_state", [lambda b=b, gt=gated: reference(*b, gt) for b in bufs])
        record("fla_inplace", [lambda b=b, gt=gated: step("fla", *b, gt) for b in bufs])
        record("ours", [lambda b=b, gt=gated: step("statereduce", *b, gt) for b in bufs])
        best = decode._kernel().best_config
        row["ours_best_config"] = {"BV": best.kwargs.get("BV"), "STREAM": best.kwargs.get("STREAM"),
                                   "num_warps": best.num_warps}
        sweep = {}
        for bv, w in decode.TILE_CONFIGS:
            for stream in (False, True):
                if bv > vd:
                    continue
                fixed = {"block_v": bv, "num_warps": w, "stream": stream}
                ms = graph_time([lambda b=b, gt=gated, f=fixed: step("statereduce", *b, gt, **f) for b in bufs],
                                trials=3, reps=10)
                sweep[f"BV{bv}_w{w}{'_s' if stream else ''}"] = round(2 * state_bytes / (ms / 1e3) / 1e12, 3)
        row["ours_sweep_TBps"] = sweep
        if sweep:
            top = max(sweep, key=sweep.get)
            row["sweep_best"], row["sweep_best_of_copy"] = top, sweep[top] * 1e12 / bw
        out["timing"].append(row)
        print(name, kd, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                         if k != "ours_sweep_TBps"}, flush=True)
        del bufs
        torch.cuda.empty_cache()


def conv_check(out):
    """conv_step (q, k and v channels in one launch) against fla's causal_conv1d_update per segment,
    bf16, with the row a slice of a wider projection output (the fused step's layout)."""
    from fla.modules.causal_conv1d.ops import causal_conv1d_update

    from statereduce.kernels.conv import conv_step

    for n, dims in ((1, (2048, 2048, 2048)), (64, (2048, 2048, 2048)), (64, (512, 512, 2048)),
                    (64, (1536, 1536, 3072)), (3, (40, 40, 72))):
        torch.manual_seed(n + sum(dims))
        d = sum(dims)
        wide = torch.randn(n, 1, d + 64, device="cuda", dtype=torch.bfloat16)
        x = wide[..., :d]
        weight = torch.randn(d, 1, 4, device="cuda", dtype=torch.bfloat16) * 0.3
        caches = [torch.randn(n, di, 4, device="cuda", dtype=torch.bfloat16) for di in dims]
        ref_caches = [c.clone() for c in caches]
        refs, start = [], 0
        for di, c in zip(dims, ref_caches):
            sl = slice(start, start + di)
            y_ref, _ = causal_conv1d_update(x[..., sl].contiguous(), c, weight=weight[sl, 0], activation="silu")
            refs.append(y_ref)
            start += di
        y = conv_step(x, tuple(caches), weight, None, "silu")
        torch.cuda.synchronize()
        ref = torch.cat(refs, -1).reshape(y.shape)
        out["conv"].append({"n": n, "dims": dims, "y_max_abs": float((y.float() - ref.float()).abs().max()),
                            "cache_equal": all(torch.equal(a, b) for a, b in zip(caches, ref_caches))})
    print("conv_step vs fla:", out["conv"], flush=True)


def pdl_ab(out, layers=24, n=64):
    """Programmatic dependent launch off against on, in one run, for our two decode kernels:

    - ``steps``: ``layers`` recurrent steps in a row (distinct state buffers), as in ``timing``;
    - ``pairs``: ``layers`` pairs of conv_step then recurrent step on views of its output, the fused layer's order.

    The two graphs of each row are captured first and their trials interleaved. With PDL each step loads its state
    before waiting for the previous kernel. Outputs and states after one replay from the same start must be equal
    bit for bit."""
    for shape in SHAPES:
        row = _pdl_row(out["copy_bandwidth_Bps"], *shape, layers=layers, n=n)
        out["pdl"].append(row)
        print("pdl", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        torch.cuda.empty_cache()


def _pdl_row(bw, name, h, hv, kd, vd, gated, layers, n, trials=7, reps=20):
    from statereduce.kernels.conv import conv_step

    torch.manual_seed(kd * 7 + vd)
    bufs = [inputs(n, h, hv, kd, vd, gated) for _ in range(layers)]
    dims = (h * kd, h * kd, hv * vd)
    convs = [{"x": torch.randn(n, 1, sum(dims) + 64, device="cuda", dtype=torch.bfloat16)[..., :sum(dims)],
              "caches": tuple(torch.randn(n, d, 4, device="cuda", dtype=torch.bfloat16) for d in dims),
              "w": torch.randn(sum(dims), 4, device="cuda", dtype=torch.bfloat16) * 0.3} for _ in range(layers)]
    live = [b[-1] for b in bufs] + [c for cv in convs for c in cv["caches"]]
    start = [t.clone() for t in live]

    def pair(b, c):
        y = conv_step(c["x"], c["caches"], c["w"], None, "silu")
        q, k = y[..., :dims[0]].unflatten(-1, (h, kd)), y[..., dims[0]:2 * dims[0]].unflatten(-1, (h, kd))
        v = y[..., 2 * dims[0]:].unflatten(-1, (hv, vd))
        return step("statereduce", q, k, v, *b[3:], gated)

    kinds = {"steps": lambda: [step("statereduce", *b, gated) for b in bufs],
             "pairs": lambda: [pair(b, c) for b, c in zip(bufs, convs)]}
    row = {"shape": name, "n": n, "h": hv, "k": kd, "v": vd, "layers": layers,
           "state_bytes_per_launch": bufs[0][-1].numel() * 4}
    row["floor_us_per_layer"] = 2 * row["state_bytes_per_launch"] / bw * 1e6
    for kind, fn in kinds.items():
        results, replays = {}, {}
        for on in (False, True):
            with decode.programmatic_launch(on):
                sink = []
                check = graphed(lambda fn=fn, sink=sink: sink.append(fn()) if not sink else
                                [a.copy_(b) for a, b in zip(sink[0], fn())])
                for t, s0 in zip(live, start):
                    t.copy_(s0)
                check()
                torch.cuda.synchronize()
                results[on] = [o.clone() for o in sink[0]] + [t.clone() for t in live]
                replays[on] = graphed(fn)
        row[f"{kind}_bit_equal"] = all(torch.equal(a, b) for a, b in zip(results[False], results[True]))
        ms = {False: [], True: []}
        for _ in range(trials):  # interleaved: one trial of each graph in turn
            for on in (False, True):
                ms[on] += time_ms(replays[on], warmup=0, steps=reps, trials=1)
        for on, label in ((False, "off"), (True, "on")):
            t = statistics.median(ms[on])
            row[f"{kind}_{label}_us_per_layer"] = t * 1e3 / layers
            row[f"{kind}_{label}_state_of_copy"] = 2 * row["state_bytes_per_launch"] * layers / (t / 1e3) / bw
        row[f"{kind}_pdl_speedup"] = statistics.median(ms[False]) / statistics.median(ms[True])
    return row


def floor_ab(out, layers=24, n=64, trials=7, reps=20):
    """Our step against a copy and an in-place multiply of the same state bytes, each ``layers`` launches on distinct
    buffers in one graph, trials interleaved; medians."""
    bw = out["copy_bandwidth_Bps"]
    for name, h, hv, kd, vd, gated in SHAPES:
        bufs = [inputs(n, h, hv, kd, vd, gated) for _ in range(layers)]
        sinks = [torch.empty_like(b[-1]) for b in bufs]
        state_bytes = bufs[0][-1].numel() * 4
        step("statereduce", *bufs[0], gated)  # tunes outside the graph
        graphs = {"ours": graphed(lambda bufs=bufs, gt=gated: [step("statereduce", *b, gt) for b in bufs]),
                  "copy": graphed(lambda bufs=bufs, sinks=sinks: [d.copy_(b[-1]) for d, b in zip(sinks, bufs)]),
                  "mul_inplace": graphed(lambda bufs=bufs: [b[-1].mul_(1.0) for b in bufs])}
        ms = {k: [] for k in graphs}
        for _ in range(trials):
            for k, g in graphs.items():
                ms[k] += time_ms(g, warmup=3, steps=reps, trials=1)
        row = {"shape": name, "n": n, "h": hv, "k": kd, "v": vd, "layers": layers, "state_bytes_per_launch": state_bytes,
               "floor_us": 2 * state_bytes / bw * 1e6, "pdl": decode._PDL}
        for k, v in ms.items():
            t = statistics.median(v) / layers
            row[f"{k}_us"] = t * 1e3
            row[f"{k}_of_copy"] = 2 * state_bytes / (t / 1e3) / bw
        row["ours_over_copy"] = row["ours_us"] / row["copy_us"]
        out["floor"].append(row)
        print(name, kd, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        del bufs, sinks, graphs
        torch.cuda.empty_cache()


PARTS = {"correctness": correctness, "chunk": chunk_check, "timing": timing, "conv": conv_check, "pdl": pdl_ab,
         "floor": floor_ab}


def main(path, parts=tuple(PARTS)):
    out = {"device": torch.cuda.get_device_name(), "correctness": [], "chunk_vs_recurrent": [], "timing": [],
           "conv": [], "pdl": [], "floor": []}
    out["copy_bandwidth_Bps"] = copy_bandwidth()
    print("copy bandwidth GB/s", out["copy_bandwidth_Bps"] / 1e9, flush=True)
    for part in (PARTS[p] for p in parts):
        try:
            part(out)
        except Exception as e:  # noqa: BLE001 (keep what the other parts measured)
            out.setdefault("errors", []).append(f"{part.__name__}: {type(e).__name__}: {e}")
            print("ERROR", part.__name__, repr(e), flush=True)
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3) or (len(sys.argv) == 3 and set(sys.argv[2].split(",")) - set(PARTS)):
        sys.exit(f"usage: python scripts/check_decode_gpu.py OUT.json [PARTS]; PARTS: comma-separated of "
                 f"{','.join(PARTS)} (default all)")
    main(sys.argv[1], sys.argv[2].split(",") if len(sys.argv) == 3 else tuple(PARTS))
