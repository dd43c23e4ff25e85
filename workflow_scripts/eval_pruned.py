"""rule eval_pruned: results/{model}/{method}_{pct}/pruned/eval.json (before recovery fine-tuning)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parent))
from statereduce.runtime import start  # noqa: E402

log = start(snakemake.log[0], snakemake.threads)
from statereduce.stages import evaluate_checkpoint  # noqa: E402

wc = snakemake.wildcards
doc = evaluate_checkpoint(Path(snakemake.input.record).parent, snakemake.params.eval, snakemake.params.info,
                          snakemake.output[0], extra={"method": wc.method, "pct": float(wc.pct)})
log.info("metrics: %s", doc["metrics"])
