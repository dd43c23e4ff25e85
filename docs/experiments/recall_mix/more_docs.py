"""The recall contrast of a finished default run (drrqr at a pct) scored on N probe documents per level (seed 0;
the first 100 are the probe's own):  python docs/experiments/recall_mix/more_docs.py RUN_DIR N [PCT]"""
import math, sys, json
from pathlib import Path
import yaml
from statereduce.core.models import load_model
from statereduce.eval.recall import RecallLevel, generate_recall_docs, recall_accuracy
root = Path(sys.argv[1]); N = int(sys.argv[2]); pct = int(sys.argv[3]) if len(sys.argv) > 3 else 75
cfg = yaml.safe_load((root / "config.yaml").read_text())
def docs(n):
    out = []
    for lv in [4, 8]:
        level = RecallLevel.parse(lv)
        out += generate_recall_docs(n, level.n_pairs, level.n_choices, level.depth, level.n_queries, 0)
    return out
d100, dN = docs(100), docs(N)
print("prefix property:", [x["prompt"] for x in d100[:100]] == [x["prompt"] for x in dN[:100]])
def hits(path, ds):
    m, t = load_model(path)
    return [int(recall_accuracy(m, t, [d])) for d in ds]
res = {}
for name in ["tiny-gdn", "tiny-qwen35"]:
    base = hits(root / "results" / name / "base", dN)
    for stage in ["pruned", "rft"]:
        p = hits(root / "results" / name / f"drrqr_{pct}" / stage, dN)
        diffs = [b - q for b, q in zip(base, p)]
        m = sum(diffs) / len(diffs); v = sum((x - m) ** 2 for x in diffs) / (len(diffs) - 1)
        res[(name, stage)] = (m, math.sqrt(v / len(diffs)))
    print(name, "base", sum(base) / len(base), res[(name, "pruned")], res[(name, "rft")], flush=True)
for stage in ["pruned", "rft"]:
    (a, sa), (b, sb) = res[("tiny-gdn", stage)], res[("tiny-qwen35", stage)]
    print(stage, f"diff {a-b:+.3f} ± {math.hypot(sa, sb):.3f}  z={(a-b)/math.hypot(sa, sb):.2f}")
