"""Tables of probe.py's records: the change of held-out bits per byte that RFT makes, per cell and variant.

    python docs/experiments/rft_tiny/table.py docs/experiments/rft_tiny/results/*.jsonl

For each variant (its settings relative to the model's ``rft`` block of config.yaml): one row per model, one column
per method, each cell ``Δ (kept step)``, where Δ is post-RFT minus pre-RFT held-out bits per byte (probe.py's own
scoring of the ``heldout`` task's documents at full context) and the kept step is the one ``keep: best`` chose (0:
the pruned model itself). Below each table: the cells above +0.001 and the ``rand`` cells that did not improve.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

METHODS = ("rand", "l1", "swanda", "grad", "drrqr")


def main(paths: list[str]) -> None:
    rows = [{**json.loads(line), "file": Path(p).name} for p in paths for line in Path(p).read_text().splitlines()
            if line.strip()]
    variants = list(dict.fromkeys((r["file"], r["variant"]) for r in rows))
    for f, v in variants:
        cells = {(r["model"], r["method"]): r for r in rows if (r["file"], r["variant"]) == (f, v)}
        models = sorted({m for m, _ in cells})
        methods = [m for m in METHODS if any(k[1] == m for k in cells)]
        print(f"**{f}: {v}**\n")
        print("| model | " + " | ".join(methods) + " |")
        print("| --- |" + " ---: |" * len(methods))
        bad = []
        for model in models:
            out = []
            for method in methods:
                r = cells.get((model, method))
                if r is None:
                    out.append("–")
                    continue
                out.append(f"{r['delta_full']:+.4f} ({r.get('kept_step', 'last')})")
                if r["delta_full"] > 0.001 or (method == "rand" and r["delta_full"] >= 0):
                    bad.append(f"{model} {method} {r['delta_full']:+.4f}")
            print(f"| {model} | " + " | ".join(out) + " |")
        print(f"\nCells that miss (Δ > +0.001, or a rand cell that does not improve): {', '.join(bad) or 'none'}.\n")


if __name__ == "__main__":
    main(sys.argv[1:])
