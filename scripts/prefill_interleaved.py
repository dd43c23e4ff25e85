"""Prefill speedup with the baseline and pruned models timed in alternation (a cross-check of ``statereduce.speed.bench``).

``statereduce.speed.bench`` measures one ratio's model after the other (baseline first), three trials each. On an H200
the prefill trials of one cell spread by up to 6 %, more than the 0.01-0.02 the paper's prefill ratios leave to
discuss. Here every model of a cell stays resident with its captured CUDA graph and the timing goes round by round:
each round times every model once (``steps`` replays), in an order rotated every round, so a drift of the clock or
temperature during the cell hits every model alike. The speedup is the median over rounds of the per-round ratio;
the ratio of the medians is recorded beside it.

    python scripts/prefill_interleaved.py OUT.json MODEL[,MODEL] [BxT,...] [--rounds 15] [--steps 5] [--profile]
        [--config config.yaml]

MODEL names a model of the workflow config (``--config``, default ``config.yaml`` in the current directory), as
for ``python -m statereduce.speed``.

e.g. ``python scripts/prefill_interleaved.py $OUT/prefill_ab.json gdn1.3b,dn1.3b 8x2048,4x2048,16x2048``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys

import torch

from statereduce.core.runtime import write_json
from statereduce.common.settings import SpeedSettings
from statereduce.speed.bench import (
    _free,
    build_model,
    graphed,
    kernel_rows,
    model_config,
    require_cuda,
    speed_pcts,
    time_ms,
    workflow_model,
)

log = logging.getLogger("prefill_interleaved")


def rounds_of(calls: dict, rounds: int, steps: int, timer=time_ms) -> dict:
    """Per-key milliseconds of ``calls`` (key -> zero-argument callable), one value per round; round ``r`` times the
    keys in their order rotated by ``r``."""
    keys, out = list(calls), {k: [] for k in calls}
    for r in range(rounds):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            out[k].append(timer(calls[k], warmup=1, steps=steps, trials=1)[0])
    return out


def speedups(ms: dict, base) -> dict:
    """Each non-baseline key's median per-round speedup over ``base`` and the ratio of the medians."""
    return {k: {"speedup": statistics.median(b / p for b, p in zip(ms[base], v)),
                "speedup_of_medians": statistics.median(ms[base]) / statistics.median(v)}
            for k, v in ms.items() if k != base}


def kernel_times(fn, top: int = 25) -> list[dict]:
    """Device time per kernel name of one call of ``fn`` (``torch.profiler``), the ``top`` names by time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [{"name": n[:120], "ms": round(t / 1e3, 3), "count": c} for n, t, c in kernel_rows(prof)[:top]]


def measure(name: str, plan: tuple[str, dict, SpeedSettings], cells: list[tuple[int, int]], rounds: int, steps: int,
            profile: bool = False) -> dict:
    """Time every ratio of model ``name`` (``plan``: its ``(family, arch, settings)`` from :func:`workflow_model`)
    round by round on each ``(batch, length)`` of ``cells``."""
    family, arch, settings = plan
    pcts = speed_pcts(settings)
    dtype = getattr(torch, settings.dtype)
    models = {p: build_model(model_config(family, arch, p), dtype) for p in pcts}
    doc = {"model": name, "family": family, "arch": arch, "pcts": pcts, "rounds": rounds,
           "steps": steps, "device": torch.cuda.get_device_name(), "cells": []}
    vocab = models[0].config.vocab_size
    for batch, length in cells:
        ids = torch.randint(vocab, (batch, length), device="cuda")
        calls, kernels = {}, {}
        with torch.no_grad():
            for p, model in models.items():
                def fn(model=model, ids=ids):
                    return model(ids, use_cache=True, logits_to_keep=1)
                for _ in range(2):  # autotuning happens here, outside the timing
                    fn()
                if profile:
                    kernels[str(p)] = kernel_times(fn)
                calls[p] = graphed(fn)
            ms = rounds_of(calls, rounds, steps)
        cell = {"batch": batch, "length": length, "ms": {str(p): v for p, v in ms.items()},
                "median_ms": {str(p): statistics.median(v) for p, v in ms.items()},
                "speedup": {str(p): s for p, s in speedups(ms, 0).items()}, **({"kernels": kernels} if profile else {})}
        log.info("%s %dx%d %s", name, batch, length, cell["speedup"])
        doc["cells"].append(cell)
        calls, ids = None, None
        _free()
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("models", help="comma-separated models of the workflow config")
    p.add_argument("cells", nargs="?", default="8x2048", help="comma-separated BxT (default 8x2048)")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--profile", action="store_true", help="also record each model's device time per kernel")
    p.add_argument("--config", default="config.yaml",
                   help="workflow config naming the models (default: config.yaml in the current directory)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    try:
        plans = {name: workflow_model(name, args.config) for name in args.models.split(",")}
        require_cuda()
    except (RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cells = [tuple(int(x) for x in c.split("x")) for c in args.cells.split(",")]
    out = {"command": " ".join(sys.argv), "runs": []}
    for name, plan in plans.items():
        out["runs"].append(measure(name, plan, cells, args.rounds, args.steps, args.profile))
        write_json(args.out, out)
        _free()
    print(json.dumps([{r["model"]: [(c["batch"], c["length"], c["speedup"]) for c in r["cells"]]}
                      for r in out["runs"]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
