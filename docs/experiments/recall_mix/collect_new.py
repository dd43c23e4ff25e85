"""Table of the run_new.py runs (runs/*/eval.json with drrqr_50): bits/byte and probe acc, unpruned and pruned 50%."""
import json
from pathlib import Path

print("| run | recall_mix | train overrides | train s (pure) | unpruned bpb / acc@4 @8 | drrqr_50 | l1_50 |")
print("|---|---|---|---|---|---|---|")
for f in sorted((Path(__file__).resolve().parent / "runs").glob("*/eval.json")):
    r = json.loads(f.read_text())
    if "drrqr_50" not in r:
        continue
    mix = {k: v for k, v in r["mix"].items() if k != "seed"}
    cells = [f"{r[k]['bpb']:.3f} / {r[k]['r4']:.2f} {r[k]['r8']:.2f}" for k in ("unpruned", "drrqr_50", "l1_50")]
    head = f"| {r['name']} | {json.dumps(mix)} | {json.dumps(r['train'])} | {r['train_s']} ({r['pure_s']}) | "
    print(head + " | ".join(cells) + " |")
