"""The per-job table of docs/records/paper_scale_h200.md from what dev/paper_scale_call.sh returns.

    python dev/paper_scale_table.py RUN_DIR [--save docs/results/paper_scale_h200]

RUN_DIR is an unpacked ``run.tgz`` (``benchmarks/``, ``logs/``, ``run/sizes.tsv``, ``results/``). Prints one Markdown
row per job: rule and wildcards, wall seconds (Snakemake's benchmark TSV), peak GPU memory (the ``peak GPU memory``
line that every job that used CUDA logs at exit), host peak RSS; then the artifact sizes and RFT's tokens/s.
``--save`` copies the small raw files (benchmarks, the log lines read, sizes, RFT logs) to a folder for the repo.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import shutil
from pathlib import Path

PEAK = re.compile(r"peak GPU memory on cuda:0: ([\d.]+) GiB allocated, ([\d.]+) GiB reserved")
ARTIFACTS = ("activations.h5", "grad_scores.h5", ".parquet", "model.safetensors")


def jobs(run: Path) -> list[dict]:
    rows = []
    for tsv in sorted((run / "benchmarks").rglob("*.tsv")):
        rel = tsv.relative_to(run / "benchmarks").with_suffix("")
        with open(tsv) as f:
            bench = next(csv.DictReader(f, delimiter="\t"))
        log = run / "logs" / f"{rel}.log"  # not with_suffix: model names hold dots (dn1.3b-init)
        peak = PEAK.findall(log.read_text(errors="replace")) if log.is_file() else []
        rows.append({"job": str(rel), "seconds": float(bench["s"]), "host_rss_mib": float(bench["max_rss"]),
                     "gpu_gib": float(peak[-1][0]) if peak else None,
                     "gpu_reserved_gib": float(peak[-1][1]) if peak else None})
    return rows


def sizes(run: Path) -> list[tuple[str, float]]:
    out = []
    for line in (run / "run" / "sizes.tsv").read_text().splitlines():
        size, path = line.split("\t")
        if path.endswith(ARTIFACTS):
            out.append((path, int(size) / 2**20))
    return out


def rft_rates(run: Path) -> dict[str, dict]:
    out = {}
    for log in sorted((run / "results").glob("*/*/rft/train_log.jsonl")):
        rates = [json.loads(line)["tokens_per_s"] for line in log.read_text().splitlines() if line.strip()]
        steady = sorted(rates[1:] or rates)
        out[str(log.parent.parent.relative_to(run / "results"))] = {
            "steps": len(rates), "steady_tokens_per_s": steady[len(steady) // 2], "first_step_tokens_per_s": rates[0]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--save", type=Path)
    args = ap.parse_args()
    print("| job | wall s | peak GPU GiB (allocated / reserved) | host RSS MiB |\n| --- | --- | --- | --- |")
    for r in jobs(args.run):
        gpu = "–" if r["gpu_gib"] is None else f"{r['gpu_gib']:.1f} / {r['gpu_reserved_gib']:.1f}"
        print(f"| {r['job']} | {r['seconds']:.0f} | {gpu} | {r['host_rss_mib']:.0f} |")
    print("\n| artifact | MiB |\n| --- | --- |")
    for path, mib in sizes(args.run):
        print(f"| {path} | {mib:,.1f} |")
    print("\nRFT:", json.dumps(rft_rates(args.run), indent=1))
    if args.save:
        args.save.mkdir(parents=True, exist_ok=True)
        (args.save / "jobs.json").write_text(json.dumps(jobs(args.run), indent=1) + "\n")
        (args.save / "rft.json").write_text(json.dumps(rft_rates(args.run), indent=1) + "\n")
        shutil.copy(args.run / "run" / "sizes.tsv", args.save / "sizes.tsv")


if __name__ == "__main__":
    main()
