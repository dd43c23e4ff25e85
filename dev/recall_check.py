"""Does the default run show the paper's recall finding on this CPU? One command, any machine.

    python dev/recall_check.py --run            # snakemake --cores all first, then the check
    python dev/recall_check.py                  # the check on the run already in results/

Two checks on the default target (config.yaml's ``targets``), each line printed with its numbers:

1. Every tiny model's unpruned recall probe (mean accuracy over its levels, chance 0.25) is at least 0.45: the
   model learned the lookup in pretraining on this CPU.
2. At each default pct, DRRQR's pruned model, before and after RFT: the pure Gated DeltaNet (tiny-gdn) loses more
   recall than the hybrid (tiny-qwen35), by more than twice the standard error of that difference. A drop is the
   baseline's accuracy minus the pruned model's on the same documents; its standard error comes from the paired
   per-document differences (the two models are independent), so the probe's documents are scored again here, one
   by one (:func:`statereduce.eval.recall.recall_accuracy`). Each model's mean must equal the accuracy lm-eval
   wrote into its eval.json, or the check stops.

Writes ``docs/results/recall_check_<cpu>.json`` (``--out``) and exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import yaml

THRESHOLD = 0.45
PURE, HYBRID, SELECTOR = "tiny-gdn", "tiny-qwen35", "drrqr"


def probe_docs(model_cfg: dict) -> dict[str, list[dict]]:
    """The recall probe's documents of a model's eval settings, by task name."""
    from statereduce.common.settings import RecallProbeSettings
    from statereduce.eval.recall import RecallLevel, generate_recall_docs

    probe = RecallProbeSettings.from_dict(model_cfg["eval"].get("recall_probe"))
    out = {}
    for level in map(RecallLevel.parse, probe.levels):
        out[level.task_name] = generate_recall_docs(probe.n_docs, level.n_pairs, level.n_choices, level.depth,
                                                    level.n_queries, probe.seed)
    return out


def lm_eval_accs(eval_json: Path, tasks: list[str]) -> dict[str, float]:
    """The probe tasks' ``acc`` in an eval.json (wherever the task's metrics sit in it)."""
    found: dict[str, float] = {}

    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key in tasks and isinstance(value, dict) and "acc" in value:
                    found.setdefault(key, float(value["acc"]))
                walk(value)

    walk(json.loads(eval_json.read_text()))
    missing = [t for t in tasks if t not in found]
    if missing:
        raise SystemExit(f"{eval_json}: no acc of {missing}; run the workflow first (--run)")
    return found


def per_document(checkpoint: Path, eval_json: Path, docs: dict[str, list[dict]]) -> list[int]:
    """1/0 per probe document (all levels in order), checked against the accuracies lm-eval wrote."""
    from statereduce.core.models import load_model
    from statereduce.eval.recall import recall_accuracy

    model, tokenizer = load_model(checkpoint)
    hits: list[int] = []
    expected = lm_eval_accs(eval_json, list(docs))
    for task, task_docs in docs.items():
        level = [int(recall_accuracy(model, tokenizer, [d])) for d in task_docs]
        if abs(sum(level) / len(level) - expected[task]) > 1e-9:
            raise SystemExit(f"{checkpoint}: {task} scored {sum(level) / len(level):.3f} here, lm-eval wrote "
                             f"{expected[task]:.3f} in {eval_json}: the direct scoring no longer matches lm-eval's")
        hits += level
    return hits


def drop_stats(base: list[int], pruned: list[int]) -> tuple[float, float]:
    """Mean paired drop (base - pruned) and the variance of one document's difference."""
    diffs = [b - p for b, p in zip(base, pruned)]
    mean = sum(diffs) / len(diffs)
    var = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)
    return mean, var


def cpu_kind() -> str:
    from statereduce.core.runtime import versions

    return versions().get("cpu", "unknown CPU")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", action="store_true", help="run `snakemake --cores all` first")
    ap.add_argument("--root", default=".", help="the workflow directory (config.yaml, results/)")
    ap.add_argument("--out", help="the record (default docs/results/recall_check_<cpu>.json)")
    args = ap.parse_args(argv)
    root = Path(args.root)
    if args.run:
        subprocess.run([sys.executable, "-m", "snakemake", "--cores", "all"], cwd=root, check=True)
    config = yaml.safe_load((root / "config.yaml").read_text())
    targets, models = config["targets"], config["models"]
    cpu = cpu_kind()
    record: dict = {"cpu": cpu, "command": "python dev/recall_check.py" + (" --run" if args.run else ""),
                    "threshold": THRESHOLD, "baselines": {}, "contrast": [], "passed": True}
    lines = [f"recall checks of the default run on {cpu}"]
    base_hits: dict[str, list[int]] = {}
    for name in targets["models"]:
        docs = probe_docs(models[name])
        hits = per_document(root / "results" / name / "base", root / "results" / name / "baseline" / "eval.json", docs)
        base_hits[name] = hits
        acc = sum(hits) / len(hits)
        se = math.sqrt(acc * (1 - acc) / len(hits))
        ok = acc >= THRESHOLD
        record["baselines"][name] = {"acc": acc, "se": se, "n": len(hits), "passed": ok}
        record["passed"] &= ok
        lines.append(f"  {'ok  ' if ok else 'FAIL'} {name} baseline recall {acc:.3f} ± {se:.3f} (>= {THRESHOLD})")
    for pct in targets["pcts"]:
        for stage in ("pruned", "rft"):
            row = {"pct": pct, "stage": stage, "selector": SELECTOR}
            for name in (PURE, HYBRID):
                chain = root / "results" / name / f"{SELECTOR}_{pct}" / stage
                hits = per_document(chain, chain / "eval.json", probe_docs(models[name]))
                mean, var = drop_stats(base_hits[name], hits)
                row[name] = {"acc": sum(hits) / len(hits), "drop": mean, "drop_se": math.sqrt(var / len(hits))}
            diff = row[PURE]["drop"] - row[HYBRID]["drop"]
            se = math.hypot(row[PURE]["drop_se"], row[HYBRID]["drop_se"])
            ok = diff > 2 * se
            row.update({"difference": diff, "difference_se": se, "passed": ok})
            record["contrast"].append(row)
            record["passed"] &= ok
            when = "before RFT" if stage == "pruned" else "after RFT"
            lines.append(f"  {'ok  ' if ok else 'FAIL'} {SELECTOR} {pct}% {when}: {PURE} loses "
                         f"{row[PURE]['drop']:+.3f} ± {row[PURE]['drop_se']:.3f}, {HYBRID} "
                         f"{row[HYBRID]['drop']:+.3f} ± {row[HYBRID]['drop_se']:.3f}; difference {diff:+.3f} ± "
                         f"{se:.3f} ({'>' if ok else '<='} 2 SE)")
    print("\n".join(lines))
    slug = re.sub(r"[^a-z0-9]+", "_", cpu.lower()).strip("_")
    out = Path(args.out) if args.out else root / "docs" / "results" / f"recall_check_{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(out)
    print(f"wrote {out}")
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
