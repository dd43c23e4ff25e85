#!/usr/bin/env python
"""RFT's training step against a plain bf16 training step of the same pruned model, side by side in one run.

    python scripts/bench_rft_step.py OUT.json --config configs/gpu_paper_scale.yaml --model dn1.3b-init \
        [--pct 50] [--micro 1 4 auto] [--steps 6] [--seq-len 2048] [--batch 16]

The model is the ``init.arch`` shape of ``--model`` in the config (``--config`` is an overlay of config.yaml) with
random weights: the teacher in bf16, the student pruned at random to ``--pct`` percent of its key channels, in float32
as RFT holds it. For each micro-batch size (``auto``: what RFT's ``micro_batch_size: auto`` picks, for both kinds), on
``--steps`` optimizer steps of ``--batch`` sequences:

- ``rft``: :func:`statereduce.stages.rft.train` as the workflow runs it (LoRA, the bf16 teacher's forward, the KL over
  the vocabulary, bf16 autocast, kernels by ``rft.kernels: auto``);
- ``plain``: an ordinary LM training step of the same student (every parameter trained by AdamW, cross entropy,
  bf16 autocast, the same micro-batches and kernel routing), the reference the issue's target names.

Prints and writes steady tokens/s (the median over the steps after the first), the ratio rft / plain, and peak GPU
memory; OUT.json after every measurement. ``--profile DIR`` then runs two more steps of each kind at the first
row's micro-batch size (for ``auto``, the size it picked) under ``torch.profiler`` (after the timed runs, so that
Triton's autotuning is done and the profile shows the steady step) and writes their operators by device time
(``DIR/<plain|rft>_micro<N>.txt``) and by host time (``..._host.txt``) and the share of wall time the device was busy
(OUT.json's ``profile``): a low share means the step waits on the host (launches, syncs), a high one on the kernels
listed first. Random token ids below 257 (the byte-level tokenizer's) stand in for text. Runs on a CPU too (slowly),
which the tests use with a tiny shape.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _model_spec(config: Path | None, model: str, arch_json: str | None) -> tuple[str, dict]:
    """(family, arch) of ``model`` in config.yaml merged with the ``config`` overlay, or ``arch_json``'s."""
    cfg = yaml.safe_load((ROOT / "config.yaml").read_text())
    if config is not None:
        cfg["models"].update(yaml.safe_load(config.read_text()).get("models", {}))
    if model not in cfg["models"]:
        raise SystemExit(f"unknown model {model!r}; valid: {', '.join(sorted(cfg['models']))}")
    m = cfg["models"][model]
    arch = json.loads(arch_json) if arch_json else (m.get("init") or m.get("pretrain") or m.get("speed") or {}).get(
        "arch")
    if arch is None:
        raise SystemExit(f"model {model!r} has no init/pretrain/speed arch; give --arch-json")
    return m["family"], arch


def _micro(text: str) -> int | str:
    return text if text == "auto" else int(text)


def _steady(rates: list[float]) -> float:
    return statistics.median(rates[1:] or rates)


def _rft(student, teacher, blocks, micro: int, args) -> dict:
    from statereduce.stages.rft import attach_lora, train
    from statereduce.common.settings import RftSettings

    blocks = blocks[: args.batch * args.steps]
    cfg = RftSettings.from_dict({"n_samples": blocks.shape[0], "seq_len": blocks.shape[1], "batch_size": args.batch,
                                 "micro_batch_size": micro, "log_every": 1, "save_every": 10**6})
    peft_model, _ = attach_lora(copy.deepcopy(student), cfg)
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "log.jsonl"
        stats = train(peft_model, teacher, blocks, cfg, log_path=log, desc=f"rft micro {micro}")
        rates = [json.loads(line)["tokens_per_s"] for line in log.read_text().splitlines()]
    return {"tokens_per_s": _steady(rates), "per_step": rates, "micro_batch_size": stats["micro_batch_size"],
            **({"micro_batch_probe": stats["micro_batch_probe"]} if "micro_batch_probe" in stats else {})}


def _plain(student, blocks, micro: int, args, device) -> dict:
    model = copy.deepcopy(student).train()
    for p in model.parameters():
        p.requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    rates = []
    for step in range(args.steps):
        _sync(device)
        t0 = time.perf_counter()
        batch = blocks[step * args.batch:(step + 1) * args.batch]
        for chunk in batch.split(micro):
            x = chunk.to(device)
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                                     x[:, 1:].reshape(-1))
            (loss * len(chunk) / len(batch)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        rates.append(batch.numel() / (time.perf_counter() - t0))
    del model, opt
    return {"tokens_per_s": _steady(rates), "per_step": rates}


@contextlib.contextmanager
def _profiled(folder: Path, name: str, device, row: dict):
    """Run the block under torch.profiler; write its table to ``folder`` and its wall time and device-busy time into
    ``row``."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        yield
        _sync(device)
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.txt").write_text(events.table(sort_by=sort, row_limit=45, max_name_column_width=70))
    # the host's side: where a step that leaves the device idle spends its time
    (folder / f"{name}_host.txt").write_text(events.table(sort_by="cpu_time_total", row_limit=60,
                                                          max_name_column_width=70))
    busy = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA) / 1e6
    row.update({"table": f"{name}.txt", "wall_s": wall, "device_busy_s": busy,
                "device_busy_share": busy / wall if device.type == "cuda" else None})


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--config", type=Path, help="an overlay of config.yaml (e.g. configs/gpu_paper_scale.yaml)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--arch-json", help="the arch as JSON instead of the model's")
    ap.add_argument("--pct", type=float, default=50.0)
    ap.add_argument("--micro", type=_micro, nargs="+", default=[1, 4, "auto"],
                    help="micro-batch sizes (integers, or auto: RFT's pick)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--profile", type=Path, metavar="DIR",
                    help="then profile two steady steps of each kind; operator tables into DIR")
    args = ap.parse_args()

    from statereduce.adapters import adapter_class, get_adapter
    from statereduce.core.models import build_random
    from statereduce.stages.prune import prune_model
    from statereduce.core.runtime import versions

    family, arch = _model_spec(args.config, args.model, args.arch_json)
    device = torch.device(args.device)
    adapter_class(family).install_fallbacks()
    teacher = build_random(family, arch, dtype="bfloat16" if device.type == "cuda" else "float32", device=device).eval()
    student = copy.deepcopy(teacher).float()
    adapter = get_adapter(student)
    d_k = adapter.head_k_dim
    keep_n = d_k - round(d_k * args.pct / 100)
    g = torch.Generator().manual_seed(0)
    keep = {i: torch.stack([torch.randperm(d_k, generator=g)[:keep_n].sort().values
                            for _ in range(adapter.num_heads)]) for i, _ in adapter.mixer_layers()}
    prune_model(student, keep, norm_eps="stock")
    kernels = adapter.route_backward("auto")
    blocks = torch.randint(0, 257, (args.batch * args.steps, args.seq_len), generator=g)
    out = {"model": args.model, "family": family, "arch": arch, "pct": args.pct, "d_k": [d_k, keep_n],
           "seq_len": args.seq_len, "batch": args.batch, "steps": args.steps, "device": str(device),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None, "kernels": kernels,
           "versions": versions(), "runs": []}
    print(f"{args.model} ({family}) d_k {d_k} -> {keep_n}, {args.batch} x {args.seq_len} tokens per step, "
          f"kernels {kernels}, on {out['gpu'] or device}")
    print("| micro-batch | plain tokens/s | rft tokens/s | rft / plain | peak GiB plain / rft |")
    print("| --- | --- | --- | --- | --- |")
    for micro in args.micro:
        row = {"micro_batch_size": micro}
        for name in ("rft", "plain"):  # rft first: plain runs at the size an auto rft picked
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            try:
                size = row["rft"].get("micro_batch_size", 1) if name == "plain" and micro == "auto" else micro
                row[name] = _measure(name, student, teacher, blocks, size, args, device)
            except torch.OutOfMemoryError as err:
                row[name] = {"error": f"out of memory: {' '.join(str(err).split())[:160]}"}
            row[name]["peak_gib"] = _peak(device)
            args.out.write_text(json.dumps({**out, "runs": [*out["runs"], row]}, indent=1) + "\n")
        ok = all("tokens_per_s" in row[k] for k in ("plain", "rft"))
        row["ratio"] = row["rft"]["tokens_per_s"] / row["plain"]["tokens_per_s"] if ok else None
        out["runs"].append(row)
        fmt = lambda r: f"{r['tokens_per_s']:,.0f}" if "tokens_per_s" in r else "OOM"  # noqa: E731
        peaks = " / ".join("–" if row[k]["peak_gib"] is None else f"{row[k]['peak_gib']:.1f}" for k in ("plain", "rft"))
        ratio = f"{row['ratio']:.2f}" if ok else "–"
        picked = f" ({row['rft']['micro_batch_size']})" if micro == "auto" and "micro_batch_size" in row["rft"] else ""
        print(f"| {micro}{picked} | {fmt(row['plain'])} | {fmt(row['rft'])} | {ratio} | {peaks} |", flush=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    if args.profile is not None:
        short = argparse.Namespace(**{**vars(args), "steps": 2})
        micro, out["profile"] = out["runs"][0]["rft"].get("micro_batch_size", 1), {}
        for name in ("plain", "rft"):
            with _profiled(args.profile, f"{name}_micro{micro}", device, out["profile"].setdefault(name, {})):
                _measure(name, student, teacher, blocks, micro, short, device)
            args.out.write_text(json.dumps(out, indent=1) + "\n")
        print(json.dumps(out["profile"], indent=1))


def _measure(name: str, student, teacher, blocks, micro: int, args, device) -> dict:
    return (_plain(student, blocks, micro, args, device) if name == "plain"
            else _rft(student, teacher, blocks, micro, args))


if __name__ == "__main__":
    main()
