"""rule eval_baseline: results/{model}/baseline/eval.json (unpruned model)."""
from pathlib import Path

from statereduce.core.runtime import start

log = start(snakemake.log[0], snakemake.threads)
from statereduce.eval.run import evaluate_checkpoint  # noqa: E402
from statereduce.common.settings import EvalSettings  # noqa: E402

doc = evaluate_checkpoint(Path(snakemake.input.base).parent, EvalSettings.from_dict(snakemake.params.eval),
                          snakemake.params.info, snakemake.output[0], extra={"method": "baseline", "pct": 0})
log.info("metrics: %s", doc["metrics"])
