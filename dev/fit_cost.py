"""The cost of the compensation stage (rule ``fit``) and of one calibration-loss measurement (what the ``sensitivity``
and ``joint`` budgets repeat per candidate) at a model's speed shape, with random weights (the cost does not depend on
them), written as JSON.

    python dev/fit_cost.py MODEL --pct 50 --samples 16 --seq-len 2048 --out FILE [--device cuda] [--dtype bfloat16]

MODEL is a model of config.yaml with a ``speed.arch`` (dn1.3b, gdn1.3b, ...). Both are timed after a warm-up pass
at both shapes (fla's kernels checked, compiled and autotuned), as on a machine that ran a job before. The model is built at that shape, a copy
is pruned with a random uniform key cut at ``pct`` (``norm_eps: exact``), and the fit (scope layer, target stream, as
``fits.fit``) runs on ``samples`` random sequences of ``seq_len`` tokens. Reports the fit's wall time and peak device
memory, the seconds per calibration sequence, one calibration-loss pass over the same sequences, and each layer's
output error before and after the fit (random weights: a cost check, not a quality one).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import time
from pathlib import Path

import torch
import yaml

from statereduce.core.calib_loss import calibration_loss
from statereduce.core.fit import fit_out_projections
from statereduce.core.models import tiny_config
from statereduce.speed.bench import build_model
from statereduce.stages.prune import prune_model


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--pct", type=float, default=50)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--arch", default=None, help="JSON arch overriding the model's speed.arch (a CPU check)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    cfg = yaml.safe_load((Path(__file__).resolve().parents[1] / "config.yaml").read_text())
    m = cfg["models"][args.model]
    arch = json.loads(args.arch) if args.arch else m["speed"]["arch"]
    dtype = getattr(torch, args.dtype)
    teacher = build_model(tiny_config(m["family"], arch), dtype, args.device)
    from statereduce.adapters import get_adapter

    adapter = get_adapter(teacher)
    d_k, heads = adapter.head_k_dim, adapter.num_heads
    d_k_new = d_k - round(d_k * args.pct / 100)
    g = torch.Generator().manual_seed(0)
    keep = {layer: torch.stack([torch.randperm(d_k, generator=g)[:d_k_new].sort().values for _ in range(heads)])
            for layer, _ in adapter.mixer_layers()}
    student = copy.deepcopy(teacher)
    prune_model(student, keep, {"method": "random", "pct": args.pct, "source_model": args.model})
    vocab = teacher.get_input_embeddings().weight.shape[0]
    blocks = torch.randint(0, vocab, (args.samples, args.seq_len), generator=g)

    # warm-up at both shapes (kernels checked, compiled and autotuned once per machine), then the timed passes
    calibration_loss(teacher, blocks[: args.batch], args.batch)
    calibration_loss(student, blocks[: args.batch], args.batch)
    fit_out_projections(teacher, copy.deepcopy(student), blocks[: args.batch], scope="layer", target="stream",
                        damping=0.1, batch_size=args.batch)
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    _sync(args.device)
    t0 = time.perf_counter()
    calibration_loss(student, blocks, args.batch)
    _sync(args.device)
    loss_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    result = fit_out_projections(teacher, student, blocks, scope="layer", target="stream", damping=0.1,
                                 batch_size=args.batch)
    _sync(args.device)
    fit_s = time.perf_counter() - t0
    doc = {
        "model": args.model, "family": m["family"], "arch": arch, "dtype": args.dtype, "pct": args.pct,
        "d_k": d_k, "d_k_new": d_k_new, "layers": len(keep), "samples": args.samples, "seq_len": args.seq_len,
        "batch": args.batch, "fit_seconds": round(fit_s, 3), "fit_seconds_per_sequence": round(fit_s / args.samples, 4),
        "calibration_loss_seconds": round(loss_s, 3),
        "peak_memory_gib": (round(torch.cuda.max_memory_allocated() / 2**30, 2)
                            if args.device.startswith("cuda") else None),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu",
        "torch": torch.__version__,
        "errors": {str(k): [round(v["error_cut"], 4), round(v["error_fit"], 4)] for k, v in result.layers.items()},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({k: v for k, v in doc.items() if k != "errors"}))


if __name__ == "__main__":
    main()
