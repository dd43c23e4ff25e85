"""The stock-vs-exact table of docs/experiments/norm_eps/README.md from two results trees of the same config.

    python docs/experiments/norm_eps/table.py STOCK_DIR EXACT_DIR [--csv OUT.csv]

STOCK_DIR and EXACT_DIR are working directories where the same targets ran with ``prune.norm_eps: stock`` and
``exact`` (``configs/norm_eps_exact.yaml``). Reads every ``results/<model>/<method>_<pct>/eval.json`` present in
both and prints, per model and pct, held-out bits per byte and the recall probe's mean accuracy before and after
RFT under each setting, then whether the order of the selectors changes.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

STAGES = ("pruned", "rft")


def cells(root: Path) -> dict[tuple[str, float, str], dict]:
    out = {}
    for f in sorted((root / "results").glob("*/*_*/eval.json")):
        d = json.loads(f.read_text())
        if "method" not in d:
            continue
        row = {"baseline_bpb": d["metrics"]["baseline"]["heldout"]["bits_per_byte"],
               "baseline_recall": d["suites"]["baseline"]["recall_probe"]["recall_mqar_avg"]}
        for stage in STAGES:
            if stage in d["metrics"]:
                row[f"{stage}_bpb"] = d["metrics"][stage]["heldout"]["bits_per_byte"]
                row[f"{stage}_recall"] = d["suites"][stage]["recall_probe"]["recall_mqar_avg"]
        out[(d["model"], float(d["pct"]), d["method"])] = row
    return out


def order(rows: dict[str, dict], key: str) -> list[str]:
    return sorted((m for m in rows if key in rows[m]), key=lambda m: (rows[m][key], m))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stock", type=Path)
    ap.add_argument("exact", type=Path)
    ap.add_argument("--csv", type=Path)
    args = ap.parse_args()
    stock, exact = cells(args.stock), cells(args.exact)
    keys = sorted(set(stock) & set(exact))
    print("| model | pct | selector | pre-RFT bpb stock | exact | post-RFT bpb stock | exact | "
          "pre-RFT recall stock | exact | post-RFT recall stock | exact |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    last = None
    flat = []
    for model, pct, method in keys:
        s, e = stock[(model, pct, method)], exact[(model, pct, method)]
        if (model, pct) != last:
            base = f"{s['baseline_bpb']:.3f} | | | | {s['baseline_recall']:.2f} | | | |"
            print(f"| {model} | {pct:g} | baseline | {base}")
            last = (model, pct)
        vals = []
        for what, fmt in (("bpb", ".3f"), ("recall", ".2f")):
            for stage in STAGES:
                for side in (s, e):
                    v = side.get(f"{stage}_{what}")
                    vals.append("–" if v is None else format(v, fmt))
        print(f"| {model} | {pct:g} | {method} | " + " | ".join(vals) + " |")
        flat.append({"model": model, "pct": pct, "method": method,
                     **{f"stock_{k}": v for k, v in s.items()}, **{f"exact_{k}": v for k, v in e.items()}})
    print("\nSelector order by bits per byte (best first), stock / exact:\n")
    for model, pct in sorted({(m, p) for m, p, _ in keys}):
        for stage in STAGES:
            rs = {m: stock[(model, pct, m)] for mm, p, m in keys if (mm, p) == (model, pct)}
            re_ = {m: exact[(model, pct, m)] for mm, p, m in keys if (mm, p) == (model, pct)}
            a, b = order(rs, f"{stage}_bpb"), order(re_, f"{stage}_bpb")
            same = "same" if a == b else "changes"
            print(f"- {model} {pct:g}% {'pre' if stage == 'pruned' else 'post'}-RFT: {' < '.join(a)} / "
                  f"{' < '.join(b)} ({same})")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(flat[0]))
            w.writeheader()
            w.writerows(flat)


if __name__ == "__main__":
    main()
