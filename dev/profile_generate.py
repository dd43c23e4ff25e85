"""Where a `generate()` decode step spends its time, per variant: torch.profiler over a short `generate` call.

    python dev/profile_generate.py OUT_DIR --model qwen35-9b-init --config config.yaml \
        --config configs/gpu_paper_scale.yaml --pcts 50 --batch 1 --prompt 2048 --steps 16 --step-tokens 256

Builds each variant as `python -m statereduce.speed.generate` does (random weights of the model's shape; the baseline
and each ratio of --pcts), warms it up with two `generate` calls at the profiled shapes, then profiles one more.
Writes OUT_DIR/<variant>.txt (the operators by self device time and by self CPU time; CPU only: by self CPU time) and
OUT_DIR/profile.json (per variant: wall seconds of the profiled call and of a decode step, the top operators, and with
--step-tokens the wall time of each step of an unprofiled call: does a step's cost grow with the position?). On CUDA
the gap between a step's wall time and its device time is the host's (Python, launches); an operator that is slow on
the device shows at the top of the first table; `--reverse` runs the baseline last. `--device cpu` runs the same on a
tiny arch (`--family`, `--arch`).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import StoppingCriteria

from statereduce.core.runtime import versions, write_json
from statereduce.speed import bench
from statereduce.speed import generate as gen


def _top(events, key: str, n: int) -> list[dict]:
    rows = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:n]
    return [{"op": e.key, "calls": e.count, "self_cpu_us": round(e.self_cpu_time_total, 1),
             "self_device_us": round(getattr(e, "self_device_time_total", 0.0), 1)} for e in rows]


class _StepClock(StoppingCriteria):
    """Never stops; notes the (synchronised) wall time each time ``generate`` appends a token."""

    def __init__(self, cuda: bool):
        self.cuda, self.marks = cuda, []

    def __call__(self, input_ids, scores, **kwargs):
        if self.cuda:
            torch.cuda.synchronize()
        self.marks.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def step_times(model, batch: int, prompt: int, steps: int, cuda: bool, seed: int = 4) -> dict:
    """Wall milliseconds of each decode step of one unprofiled ``generate`` (whether a step's cost grows with the
    position): all of them, and the median of the first and the last eight."""
    device = next(model.parameters()).device
    ids = torch.randint(model.config.vocab_size, (batch, prompt), device=device,
                        generator=torch.Generator(device=device).manual_seed(seed))
    clock = _StepClock(cuda)
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), stopping_criteria=[clock],
                       **gen._generate_kwargs(model, steps))
    ms = [round(1e3 * (b - a), 2) for a, b in zip(clock.marks, clock.marks[1:])]
    return {"first_8_ms": statistics.median(ms[:8]), "last_8_ms": statistics.median(ms[-8:]),
            "median_ms": statistics.median(ms), "each_ms": ms}


def profile_variant(model, batch: int, prompt: int, steps: int, cuda: bool) -> tuple[dict, str]:
    """Warm up at the shapes, then profile one ``generate`` of ``steps`` tokens; the record and the text tables."""
    for seed in (1, 2):
        del gen.time_generate(model, batch, prompt, steps, seed=seed)["sequences"]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        timed = gen.time_generate(model, batch, prompt, steps, seed=3)
    events = prof.key_averages()
    tables = []
    if cuda:
        tables.append(events.table(sort_by="self_device_time_total", row_limit=30))
    tables.append(events.table(sort_by="self_cpu_time_total", row_limit=30))
    record = {"total_s": round(timed["total_s"], 4), "ttft_s": round(timed["ttft_s"], 4),
              "step_ms": round(1e3 * timed["decode_s"] / max(1, steps - 1), 2),
              "top_device": _top(events, "self_device_time_total", 15) if cuda else [],
              "top_cpu": _top(events, "self_cpu_time_total", 15)}
    return record, "\n\n".join(tables)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="folder to write")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a model of the workflow config")
    src.add_argument("--family", help="adapter family, with --arch")
    p.add_argument("--arch", type=json.loads, default={}, help="JSON of config keywords (with --family)")
    p.add_argument("--config", action="append", default=[], help="workflow config file(s) for --model")
    p.add_argument("--pcts", default="50", help="comma-separated ratios beside the baseline")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--steps", type=int, default=16, help="new tokens of the profiled call")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: the model's speed dtype, else bfloat16")
    p.add_argument("--reverse", action="store_true",
                   help="build and profile the variants in reverse order (the baseline last): an order effect?")
    p.add_argument("--step-tokens", type=int, default=0,
                   help="also time each decode step of an unprofiled generate of this many tokens (0: none)")
    args = p.parse_args(argv)
    if args.batch < 1 or args.prompt < 1 or args.steps < 2:
        p.error(f"--batch {args.batch}, --prompt {args.prompt} and --steps {args.steps}: batch and prompt >= 1, "
                "steps >= 2")
    plan = (gen.workflow_plan(args.model, args.config or ["config.yaml"]) if args.model
            else {"family": args.family, "arch": dict(args.arch)})
    dtype = args.dtype or plan.get("dtype", "bfloat16")
    pcts = [float(x) if "." in x else int(x) for x in args.pcts.split(",") if x.strip()]
    if args.device == "cuda":
        bench.require_cuda()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"model": args.model or args.family, "batch": args.batch, "prompt": args.prompt, "steps": args.steps,
           "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
           "versions": versions(), "variants": {}}
    variants = list(gen.variants(plan["family"], plan["arch"], pcts))
    if args.reverse:
        variants.reverse()
    doc["order"] = [v.name for v in variants]
    for v in variants:
        t0 = time.perf_counter()
        model = bench.build_model(v.config, getattr(torch, dtype), args.device)
        gen.install_cache_alias(model)
        record, text = profile_variant(model, args.batch, args.prompt, args.steps, args.device == "cuda")
        if args.step_tokens > 1:
            record["steps"] = step_times(model, args.batch, args.prompt, args.step_tokens, args.device == "cuda")
        record["seconds"] = round(time.perf_counter() - t0, 1)
        doc["variants"][v.name] = {**v.record, **record}
        (out / f"{v.name}.txt").write_text(text + "\n")
        write_json(out / "profile.json", doc)
        steps = record.get("steps")
        print(f"{v.name}: {record['step_ms']} ms a decode step" + (
            f"; unprofiled {steps['first_8_ms']} ms (first 8), {steps['last_8_ms']} ms (last 8)" if steps else ""),
            file=sys.stderr)
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
