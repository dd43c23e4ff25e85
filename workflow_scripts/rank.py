"""rule rank: results/{model}/{method}_{pct}/rank.json (rank utilization, correlation with the baseline,
conditioning)."""
from pathlib import Path

from statereduce.core.runtime import start

log = start(snakemake.log[0], snakemake.threads)
from statereduce.stages.rank import rank_analysis  # noqa: E402
from statereduce.common.settings import RankSettings  # noqa: E402

inp, wc = snakemake.input, snakemake.wildcards
doc = rank_analysis(Path(inp.pruned).parent, RankSettings.from_dict(snakemake.params.rank), snakemake.params.info,
                    snakemake.output[0], baseline=inp.baseline, selection=inp.selection, activations=inp.activations,
                    extra={"method": wc.method, "pct": float(wc.pct), "stage": "pruned"})
log.info("utilization summary: %s, rho vs baseline: %s", doc["summary"]["u"], doc.get("pearson_u"))
