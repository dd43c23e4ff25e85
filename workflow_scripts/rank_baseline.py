"""rule rank_baseline: results/{model}/baseline/rank.json (rank utilization and [Q; K] conditioning, unpruned)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parent))
from statereduce.runtime import start  # noqa: E402

log = start(snakemake.log[0], snakemake.threads)
from statereduce.stages import rank_analysis  # noqa: E402

doc = rank_analysis(Path(snakemake.input.base).parent, snakemake.params.rank, snakemake.params.info, snakemake.output[0],
                    activations=snakemake.input.activations, extra={"method": "baseline", "pct": 0})
log.info("utilization summary: %s", doc["summary"]["u"])
