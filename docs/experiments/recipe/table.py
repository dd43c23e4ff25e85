"""The recipe table of docs/experiments/recipe/README.md: pruning loss of the paper's pruning against the recipe.

    python docs/experiments/recipe/table.py PAPER_DIR RECIPE_DIR [--out DIR]

PAPER_DIR is a working directory where ``results/<model>/drrqr_<pct>/pruned/eval.json`` ran with ``prune.norm_eps:
stock`` (``configs/norm_eps_stock.yaml``: the paper's pruning); RECIPE_DIR one where the same models ran with the
default ``norm_eps: exact``, with any of the methods of :data:`METHODS` (the recipe is ``drrqr@sens``). Reads each
cell's pre-RFT evaluation (``pruned/eval.json``), the unpruned model's (``baseline/eval.json``), the pruning record
and the job benchmarks, and writes to DIR (default: this script's folder)

* ``results.csv``: one row per (model, pct, setting, method): held-out bits per byte and the recall probe's mean
  accuracy before RFT and of the unpruned model, the pruning loss (pruned minus unpruned bits per byte), the kept key
  width of every pruned layer, the CPU of the evaluation and the seconds of the cell's own jobs;
* ``summary.md``: the recipe, the command that builds it, and per model the paper's and the recipe's pruning loss
  with their ratio;

and prints the whole table (every method) for the README, then the seconds of every job of RECIPE_DIR.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path

PAPER = ("stock", "drrqr")  # (norm_eps, method): the paper's pruning
RECIPE = ("exact", "drrqr@sens")
#: Methods read from RECIPE_DIR, in the order of the tables.
METHODS = ("drrqr", "drrqr@sens", "grad", "grad@sens")
#: Rules whose benchmark is one cell's own work (the shared calibration and baseline jobs count in the directory total).
CELL_RULES = ("allocate", "select_channels", "prune")


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def bench_seconds(root: Path, rule: str, model: str, stage: str) -> float:
    f = root / "benchmarks" / rule / model / f"{stage}.tsv"
    if not f.exists():
        return 0.0
    lines = f.read_text().splitlines()
    return float(lines[-1].split("\t")[0])


def cells(root: Path, norm_eps: str, methods: tuple[str, ...]) -> list[dict]:
    rows = []
    for base in sorted((root / "results").glob("*/baseline/eval.json")):
        model = base.parent.parent.name
        b = read(base)
        for f in sorted(base.parent.parent.glob("*_*/pruned/eval.json")):
            stage = f.parent.parent.name
            method, _, pct = stage.rpartition("_")
            if method not in methods:
                continue
            d, record = read(f), read(f.parent / "prune_record.json")
            scale = record["kernel_scale"]
            scaled = scale.get("original") is not None or any(
                v.get("original") is not None for v in scale.get("per_layer", {}).values())
            choice = scale.get("norm_eps", {}).get("choice", "stock" if scaled else norm_eps)  # Mamba-2: no scale
            if choice != norm_eps:
                raise ValueError(f"{f}: pruned with norm_eps {choice}, expected {norm_eps}")
            state = d["state"]
            widths = state.get("key_dims") or {str(i): state["d_k"] for i in range(state["layers"])}
            key_dims = [w for _, w in sorted((int(k), v) for k, v in widths.items()) if w is not None]
            recall = d["suites"]["recall_probe"]["recall_mqar_avg"]
            ses = [v["acc_stderr"] for k, v in d["metrics"].items() if k.startswith("recall_mqar_")]
            rows.append({
                "model": model, "pct": float(pct), "norm_eps": norm_eps, "method": method,
                "baseline_bpb": b["metrics"]["heldout"]["bits_per_byte"],
                "pruned_bpb": d["metrics"]["heldout"]["bits_per_byte"],
                "loss_bpb": d["metrics"]["heldout"]["bits_per_byte"] - b["metrics"]["heldout"]["bits_per_byte"],
                "baseline_recall": b["suites"]["recall_probe"]["recall_mqar_avg"],
                "pruned_recall": recall,
                "recall_se": math.sqrt(sum(x * x for x in ses)) / len(ses) if ses else None,
                "key_dims": "/".join(map(str, key_dims)),
                "cpu": d["provenance"]["versions"].get("cpu"),
                "job_s": round(sum(bench_seconds(root, r, model, stage) for r in CELL_RULES), 1),
            })
    return rows


def run_seconds(root: Path) -> float:
    return sum(float(f.read_text().splitlines()[-1].split("\t")[0]) for f in (root / "benchmarks").rglob("*.tsv")
               if f.relative_to(root / "benchmarks").parts[0] != "pretrain")


def fmt_ratio(paper: float, recipe: float) -> str:
    """paper / recipe where both lose; otherwise which of them loses nothing (a ratio of signs means nothing)."""
    if recipe > 0 and paper > 0:
        return f"{paper / recipe:.1f}×"
    if recipe > 0:
        return "– (paper's loses nothing)"
    return "– (recipe loses nothing)" if paper > 0 else "– (neither loses)"


def span(values: list[float]) -> str:
    if not values:
        return "–"
    lo, hi = min(values), max(values)
    return f"{lo:.1f}×" if f"{lo:.1f}" == f"{hi:.1f}" else f"{lo:.1f}-{hi:.1f}×"


def summary(rows: list[dict], paper_dir: Path, recipe_dir: Path) -> str:
    by = {(r["model"], r["pct"], r["norm_eps"], r["method"]): r for r in rows}
    models = sorted({r["model"] for r in rows})
    pcts = sorted({p for m, p, e, meth in by if (e, meth) == RECIPE and (m, p, *PAPER) in by}, reverse=True)
    if not pcts:
        raise ValueError(f"no (model, pct) with both {PAPER} in {paper_dir} and {RECIPE} in {recipe_dir}")
    lines = [
        "**Recipe:** DRRQR with the measured per-layer budget `@sens` and `prune.norm_eps: exact` (the default): "
        f"`snakemake results/{models[0]}/drrqr@sens_{pcts[0]:g}/eval.json --cores all` (any model, any pct).",
        "",
        "| model | " + " | ".join(f"{p:g}%: paper | recipe | paper / recipe" for p in pcts) + " |",
        "| --- | " + " | ".join("---: | ---: | ---:" for _ in pcts) + " |",
    ]
    verdict = {p: {"ratios": [], "wins": [], "others": []} for p in pcts}
    for model in models:
        cols = []
        for p in pcts:
            pa, re_ = by.get((model, p, *PAPER)), by.get((model, p, *RECIPE))
            if pa is None or re_ is None:
                cols.append("– | – | –")
                continue
            cols.append(f"{pa['loss_bpb']:.4f} | {re_['loss_bpb']:.4f} | {fmt_ratio(pa['loss_bpb'], re_['loss_bpb'])}")
            if re_["loss_bpb"] > 0 and pa["loss_bpb"] > 0:
                verdict[p]["ratios"].append(pa["loss_bpb"] / re_["loss_bpb"])
            best = min((r for r in rows if (r["model"], r["pct"]) == (model, p)), key=lambda r: r["loss_bpb"])
            if re_["loss_bpb"] <= best["loss_bpb"]:  # a tie (the budget chose the uniform widths) counts as lowest
                verdict[p]["wins"].append(model)
            else:
                verdict[p]["others"].append(f"{model}: {best['method']} {best['norm_eps']}, "
                                            f"{best['loss_bpb']:.4f}")
        lines.append(f"| {model} | " + " | ".join(cols) + " |")
    settings = sorted({f"{r['method']} {r['norm_eps']}" for r in rows})
    cpus = sorted({r["cpu"] for r in rows if r["cpu"]})
    lines += [
        "",
        "Pruning loss: held-out bits per byte before RFT minus the unpruned model's (lower is better); paper: `drrqr` "
        f"with `prune.norm_eps: stock`. Measured settings: {', '.join(settings)}. On the tiny models, which the "
        f"defaults were tuned on; {', '.join(cpus)}; [docs/experiments/recipe](README.md).",
        "",
    ]
    for p in pcts:
        v = verdict[p]
        n = len(v["wins"]) + len(v["others"])
        lines.append(f"- {p:g}%: the paper's pruning loss is {span(v['ratios'])} the recipe's; the recipe's is the "
                     f"lowest of the {len(settings)} settings on {len(v['wins'])} of {n} models"
                     + (f" (best otherwise: {'; '.join(v['others'])})" if v["others"] else "") + ".")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paper", type=Path, help="working directory pruned with norm_eps: stock")
    ap.add_argument("recipe", type=Path, help="working directory pruned with norm_eps: exact")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = ap.parse_args()
    rows = cells(args.paper, "stock", (PAPER[1],)) + cells(args.recipe, "exact", METHODS)
    order = {(e, m): i for i, (e, m) in enumerate([PAPER] + [("exact", m) for m in METHODS])}
    rows.sort(key=lambda r: (-r["pct"], r["model"], order[(r["norm_eps"], r["method"])]))
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    (args.out / "summary.md").write_text(summary(rows, args.paper, args.recipe))
    print("| pct | model | norm_eps | method | pre-RFT bpb | pruning loss | recall (± s.e.) | key widths | job s |")
    print("| --- | --- | --- | --- | ---: | ---: | --- | --- | ---: |")
    last = None
    for r in rows:
        if (r["pct"], r["model"]) != last:
            print(f"| {r['pct']:g} | {r['model']} | | unpruned | {r['baseline_bpb']:.3f} | | "
                  f"{r['baseline_recall']:.2f} | | |")
            last = (r["pct"], r["model"])
        se = f" ± {r['recall_se']:.2f}" if r["recall_se"] is not None else ""
        print(f"| {r['pct']:g} | {r['model']} | {r['norm_eps']} | {r['method']} | {r['pruned_bpb']:.3f} | "
              f"{r['loss_bpb']:+.3f} | {r['pruned_recall']:.2f}{se} | {r['key_dims']} | {r['job_s']:.0f} |")
    print(f"\nJob seconds of RECIPE_DIR (every job but pretraining, summed over the benchmarks): "
          f"{run_seconds(args.recipe):.0f} s")


if __name__ == "__main__":
    main()
