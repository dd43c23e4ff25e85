"""Table of every run under runs/ (eval.json): held-out bits/byte and probe acc, unpruned and pruned 75%."""
import json
from pathlib import Path

rows = []
for f in sorted((Path(__file__).resolve().parent / "runs").glob("*/eval.json")):
    r = json.loads(f.read_text())
    cells = [f"{r[k]['bpb']:.3f} / " + " ".join(f"{r[k][lv]:.2f}" for lv in ("r4", "r8", "r16"))
             for k in ("unpruned", "drrqr_75", "l1_75")]
    head = f"| {r['name']} | {json.dumps(r['mix'])} | {json.dumps(r['train'])} | {r['train_s']} | "
    rows.append(head + " | ".join(cells) + " |")
print("| run | recall_mix | train overrides | train s | unpruned bpb / acc@4 @8 @16 | drrqr_75 | l1_75 |")
print("|---|---|---|---|---|---|---|")
print("\n".join(rows))
