#!/usr/bin/env python
"""Recovery fine-tuning on a CUDA GPU with fla's Triton kernels (no snakemake, no lm-eval needed).

Builds a random model (the teacher; DeltaNet by default), prunes key channels at random (the student), runs
:func:`statereduce.stages.rft.fine_tune` on the GPU (bf16 autocast, fp32 master weights, saved in bf16), and
checks what the CPU tests cannot: the distillation KL falls, the merged checkpoint reloads with
``from_pretrained`` in a fresh process with the same logits on the GPU, and the run's throughput. With
``--gpus N`` (N > 1) it also runs the same job through :func:`statereduce.stages.rft.launch` (accelerate,
DDP) right after the one-GPU run (so the DDP processes reuse Triton's autotuning cache) and compares the two
logs; the reload check comes last.

Usage::

    python scripts/check_rft_gpu.py OUT.json [--gpus 2] [--steps 40] [--hidden-size 512 --layers 4 --heads 4]

Paper: Nazari & Rusch (2026), App. A (RFT). ``--family`` takes the four families; Gated DeltaNet and the Qwen3.5
hybrid need ``--kernels torch`` on Hopper with Triton < 3.7.1, where fla 0.6.0 refuses the chunk backward
(docs/gpu_checks.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from statereduce.stages import rft as finetune
from statereduce.common.settings import RftSettings

ARCH = {"hidden_size": 512, "num_hidden_layers": 4, "num_heads": 4, "expand_k": 0.5}  # defaults: d_k 64


def _write(out: Path, doc: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")


def steady_tokens_per_s(run: dict) -> float:
    """Median tokens/s of the logged windows after the first (which holds Triton's compiling and autotuning)."""
    rates = sorted(r["tokens_per_s"] for r in run["log"][1:] or run["log"])
    return rates[len(rates) // 2]


def compare(runs: dict, gpus: int) -> dict:
    """One GPU against ``gpus``: the same global batch, so the logged losses should agree up to bf16 rounding and
    reduction order; steady-state tokens/s and its scaling efficiency; peak memory per GPU."""
    one, many = runs["single"], runs[f"ddp{gpus}"]
    rel = [abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(one["log"], many["log"], strict=True)]
    t1, tn = steady_tokens_per_s(one), steady_tokens_per_s(many)
    return {
        "loss_max_rel_diff": max(rel),
        "loss_rel_diff_by_logged_step": rel,
        "steady_tokens_per_s": {"1": t1, str(gpus): tn},
        "speedup": tn / t1,
        "scaling_efficiency": tn / (gpus * t1),
        "peak_memory_gib_per_gpu": {"1": [b / 2**30 for b in one["peak_memory_bytes"] or []],
                                    str(gpus): [b / 2**30 for b in many["peak_memory_bytes"] or []]},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--hidden-size", type=int, default=ARCH["hidden_size"])
    p.add_argument("--layers", type=int, default=ARCH["num_hidden_layers"])
    p.add_argument("--heads", type=int, default=ARCH["num_heads"])
    p.add_argument("--expand-k", type=float, default=ARCH["expand_k"], help="d_k = hidden_size * expand_k / heads")
    p.add_argument("--keep", type=int, default=32, help="d_k' kept per head")
    p.add_argument("--family", default="delta_net", choices=["delta_net", "gated_deltanet", "mamba2", "qwen3_5"])
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (gloo processes, torch kernels)")
    p.add_argument("--kernels", default="fla", choices=["fla", "torch"], help="rft setting `kernels`")
    args = p.parse_args()
    import fla
    import transformers

    from statereduce.adapters import adapter_class
    from statereduce.core.models import tiny_config
    from statereduce.stages.prune import prune_model, save_pruned
    from statereduce.core.tokenizer import byte_level_tokenizer

    sys.path.insert(0, str(ROOT / "tests"))
    from _models import random_keep

    doc: dict = {
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "fla": fla.__version__,
        "transformers": transformers.__version__,
        "runs": {},
    }
    work = Path(tempfile.mkdtemp(prefix="rft_gpu_"))
    torch.manual_seed(0)
    tok = byte_level_tokenizer()
    d_k, d_v = int(args.hidden_size * args.expand_k / args.heads), args.hidden_size // args.heads
    arch = adapter_class(args.family).sized_arch(args.hidden_size, args.layers, args.heads, d_k, d_v)
    doc["arch"], doc["family"], doc["kernels"] = arch, args.family, args.kernels
    model = adapter_class(args.family).build(tiny_config(args.family, arch))
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if "conv1d" in name:
                prm.normal_(0.0, 0.3)
    model.save_pretrained(work / "base")
    tok.save_pretrained(work / "base")
    from statereduce.adapters import get_adapter

    pct = 100 * (1 - args.keep / get_adapter(model).head_k_dim)
    record = prune_model(
        model, random_keep(model, args.keep, seed=1), {"source": "random", "method": "rand", "pct": pct},
        norm_eps="stock",
    )
    save_pruned(model, tok, record, work / "pruned")
    corpus = {"source": "embedded"}
    cfg = {
        "n_samples": 16 * args.steps,
        "seq_len": 512,
        "batch_size": 16,
        "micro_batch_size": 4,
        "lr": 1e-3,
        "min_lr": 1e-4,
        "log_every": 5,
        "save_every": 10,
        "kernels": args.kernels,
    }
    doc["settings"] = cfg
    kept: dict = {}
    t0 = time.perf_counter()
    rec = finetune.fine_tune(
        work / "pruned",
        work / "base",
        work / "rft1",
        RftSettings.from_dict(cfg),
        corpus,
        dtype="bfloat16",
        device=args.device,
        resume_dir=work / "resume1",
        on_saved=lambda m, t, o: kept.update(model=m),
    )
    doc["runs"]["single"] = {
        "wall_s": time.perf_counter() - t0,
        **{
            k: rec[k]
            for k in ("steps", "train_seconds", "tokens_per_s", "final_loss", "final_kl", "processes", "device",
                      "peak_memory_bytes")
        },
        "log": [json.loads(x) for x in (work / "rft1" / "train_log.jsonl").read_text().splitlines()],
    }
    _write(args.out, doc)
    if args.gpus > 1:
        t0 = time.perf_counter()
        finetune.launch(
            args.gpus,
            work / "pruned",
            work / "base",
            work / "rftN",
            RftSettings.from_dict(cfg),
            corpus,
            dtype="bfloat16",
            device=args.device,
            resume_dir=work / "resumeN",
        )
        recN = json.loads((work / "rftN" / "rft_record.json").read_text())
        doc["runs"][f"ddp{args.gpus}"] = {
            "wall_s": time.perf_counter() - t0,
            **{
                k: recN[k]
                for k in ("steps", "train_seconds", "tokens_per_s", "final_loss", "final_kl", "processes", "device",
                      "peak_memory_bytes")
            },
            "log": [json.loads(x) for x in (work / "rftN" / "train_log.jsonl").read_text().splitlines()],
        }
        _write(args.out, doc)
    if len(doc["runs"]) > 1:
        doc["comparison"] = compare(doc["runs"], args.gpus)
        _write(args.out, doc)
    if args.device == "cuda":  # the merged checkpoint reloads in a fresh process with the same logits
        x = torch.randint(0, 256, (4, 512), generator=torch.Generator().manual_seed(0)).cuda()
        with torch.no_grad():
            expected = kept["model"].cuda()(input_ids=x).logits.float().cpu()
        torch.save(x.cpu(), work / "x.pt")
        # plain from_pretrained of the family's class (Mamba-2: transformers', which fla overrides in Auto)
        cls = adapter_class(args.family).causal_lm_class
        kind = f"{cls.__module__}:{cls.__name__}" if cls is not None else "transformers:AutoModelForCausalLM"
        extra = ", ".join(f"{k}={v!r}" for k, v in adapter_class(args.family).config_overrides.items())
        code = (
            "import importlib, sys, torch, fla; mod, name = sys.argv[4].split(':'); "
            "cls = getattr(importlib.import_module(mod), name); "
            f"m = cls.from_pretrained(sys.argv[1], {extra}).cuda().eval(); "
            "x = torch.load(sys.argv[2]).cuda(); torch.set_grad_enabled(False); "
            "torch.save(m(input_ids=x).logits.float().cpu(), sys.argv[3])"
        )
        subprocess.run([sys.executable, "-c", code, str(work / "rft1"), str(work / "x.pt"), str(work / "y.pt"), kind],
                       check=True)
        got = torch.load(work / "y.pt")
        doc["reload"] = {
            "max_abs_diff": float((got - expected).abs().max()),
            "max_abs_logit": float(expected.abs().max()),
            "rel_diff": float((got - expected).norm() / expected.norm()),
            "equal": bool(torch.equal(got, expected)),
            "saved_dtype": json.loads((work / "rft1" / "config.json").read_text()).get("torch_dtype")
            or json.loads((work / "rft1" / "config.json").read_text()).get("dtype"),
        }
        _write(args.out, doc)
    print(json.dumps({k: v for k, v in doc.items() if k != "runs"}, indent=1))
    for name, run in doc["runs"].items():
        print(name, {k: v for k, v in run.items() if k != "log"})
        print("  kl:", [round(r["kl"], 5) for r in run["log"]])


if __name__ == "__main__":
    main()
