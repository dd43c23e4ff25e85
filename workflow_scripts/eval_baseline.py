"""rule eval_baseline: results/{model}/baseline/eval.json (unpruned model)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parent))
from statereduce.runtime import start  # noqa: E402

log = start(snakemake.log[0], snakemake.threads)
from statereduce.stages import evaluate_checkpoint  # noqa: E402

doc = evaluate_checkpoint(Path(snakemake.input.base).parent, snakemake.params.eval, snakemake.params.info,
                          snakemake.output[0], extra={"method": "baseline", "pct": 0})
log.info("metrics: %s", doc["metrics"])
