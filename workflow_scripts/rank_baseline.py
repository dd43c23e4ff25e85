"""rule rank_baseline: results/{model}/baseline/rank.json (rank utilization and [Q; K] conditioning, unpruned)."""
from pathlib import Path

from statereduce.core.runtime import start

log = start(snakemake.log[0], snakemake.threads)
from statereduce.stages.rank import rank_analysis  # noqa: E402
from statereduce.common.settings import RankSettings  # noqa: E402

doc = rank_analysis(Path(snakemake.input.base).parent, RankSettings.from_dict(snakemake.params.rank),
                    snakemake.params.info, snakemake.output[0], activations=snakemake.input.activations,
                    extra={"method": "baseline", "pct": 0})
log.info("utilization summary: %s", doc["summary"]["u"])
