"""The goal check and the job costs of docs/experiments/compensation/README.md, from a run of the compensation study.

    python docs/experiments/compensation/table.py RUN_DIR [--out DIR]

RUN_DIR is a working directory where ``snakemake results/tables/compensation_study.md`` ran (``studies.compensation``
of config.yaml). Reads every cell's summary (``results/<model>/<method>_<pct>/eval.json``) and the job benchmarks, and
writes to DIR (default: this script's folder)

* ``goal.md``: per model and pct, the reference's pruning loss (bits per byte above the unpruned model, before RFT),
  the best new cell's (a method with ``+<fit>``, a ``@joint`` budget or ``ghost``) and their ratio, and whether it is
  at most half of the reference's and not worse;
* ``costs.md``: the wall seconds of each new stage's jobs (rules ``fit``, ``prune_fit``, ``split`` of ``@joint`` and
  of ``@layersplit``, ``select_channels`` of ``ghost`` and of ``drrqr``) per model, median over the run's jobs.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import yaml



def is_new(method: str) -> bool:
    """A new cell: compensation (+<fit>), the joint budget (@joint) or GHOST."""
    return "+" in method or "@joint" in method or method.startswith("ghost")


def loss(root: Path, model: str, method: str, pct: str, stage: str = "pruned") -> float:
    f = root / "results" / model / f"{method}_{pct}" / "eval.json"
    if not f.exists():
        return math.nan
    m = json.loads(f.read_text())["metrics"]
    try:
        return m[stage]["heldout"]["bits_per_byte"] - m["baseline"]["heldout"]["bits_per_byte"]
    except (KeyError, TypeError):
        return math.nan


def cpus(root: Path, block: dict) -> list[str]:
    """The CPU kinds that evaluated the study's cells (each summary's ``provenance.evals.*.versions.cpu``)."""
    kinds = set()
    for model in block["models"]:
        for f in (root / "results" / model).glob("*_*/eval.json"):
            for ev in (json.loads(f.read_text()).get("provenance") or {}).get("evals", {}).values():
                kinds.add((ev.get("versions") or {}).get("cpu"))
    return sorted(k for k in kinds if k)


def seconds(root: Path, rule: str, model: str, pattern: str) -> list[float]:
    return [float(f.read_text().splitlines()[-1].split("\t")[0])
            for f in sorted((root / "benchmarks" / rule / model).glob(pattern))]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent)
    args = ap.parse_args(argv)
    root = args.run_dir
    block = yaml.safe_load((root / "config.yaml").read_text())["studies"]["compensation"]
    ref = block["reference"]
    lines = [f"| model | pct | `{ref}` | best new cell | its loss | × ref. | at most half, none worse |",
             "| --- | ---: | ---: | --- | ---: | ---: | --- |"]
    met = {}
    for pct in map(str, block["pcts"]):
        for model in block["models"]:
            r = loss(root, model, ref, pct)
            new = {m: loss(root, model, m, pct) for m in block["methods"] if is_new(m)}
            new = {m: v for m, v in new.items() if not math.isnan(v)}
            best = min(new, key=new.get) if new else None
            b = new.get(best, math.nan)
            ratio = b / r if r > 0 and b >= 0 else math.nan  # a negative loss beats the unpruned model
            ok = (b <= 0.5 * r) if r > 0 else (b <= r)
            met.setdefault(pct, []).append((model, ok, b <= r))
            lines.append(f"| {model} | {pct} | {r:.4f} | `{best}` | {b:.4f} | "
                         f"{'–' if math.isnan(ratio) else f'{ratio:.2f}'} | {'yes' if ok else 'no'} |")
    summary = []
    for pct, rows in met.items():
        half = [m for m, ok, _ in rows if ok]
        worse = [m for m, _, not_worse in rows if not not_worse]
        summary.append(f"- {pct}%: at most half of `{ref}`'s pruning loss on {len(half)} of {len(rows)} models "
                       f"({', '.join(half) or 'none'}); worse than it on {len(worse)} ({', '.join(worse) or 'none'}).")
    for pct in map(str, block["pcts"]):
        for stage, label in (("pruned", "before RFT"), ("rft", "after RFT")):
            total = {m: sum(loss(root, model, m, pct, stage) for model in block["models"]) for m in block["methods"]}
            top = sorted((v, m) for m, v in total.items() if not math.isnan(v))[:3]
            summary.append(f"- {pct}%, {label}: lowest summed loss over the {len(block['models'])} models: "
                           + ", ".join(f"`{m}` {v:.4f}" for v, m in top) + f" (`{ref}`: {total[ref]:.4f}).")
    head = (f"**Beyond selection, measured** (`studies.compensation`, {', '.join(cpus(root, block))}; "
            f"[docs/experiments/compensation](README.md)): pruning loss before RFT (held-out bits per byte above the "
            f"unpruned model) of `{ref}` against the best new cell (`+fit`, `@joint`, `ghost`); × ref. is their ratio "
            "where both are positive (a negative loss beats the unpruned model).\n\n")
    (args.out / "goal.md").write_text(head + "\n".join(lines) + "\n\n" + "\n".join(summary) + "\n")

    jobs = [("fit", "fit", "*+*.tsv"), ("prune_fit (prune + fitted weights + eval)", "prune_fit", "*+*.tsv"),
            ("prune (+ eval), for comparison", "prune", "drrqr@sens_*.tsv"),
            ("split of `@joint`", "split", "*@joint_*.tsv"), ("split of `@layersplit`", "split", "*@layersplit_*.tsv"),
            ("select_channels of `ghost`", "select_channels", "ghost_*.tsv"),
            ("select_channels of `drrqr`", "select_channels", "drrqr_*.tsv")]
    cost = ["| job | " + " | ".join(block["models"]) + " |", "| --- |" + " ---: |" * len(block["models"])]
    for label, rule, pattern in jobs:
        cells = []
        for model in block["models"]:
            s = seconds(root, rule, model, pattern)
            cells.append(f"{statistics.median(s):.1f} ({len(s)})" if s else "–")
        cost.append(f"| {label} | " + " | ".join(cells) + " |")
    (args.out / "costs.md").write_text("\n".join(cost) + "\n\nWall seconds per job, median (jobs).\n")
    print((args.out / "goal.md").read_text())
    print((args.out / "costs.md").read_text())


if __name__ == "__main__":
    main()
