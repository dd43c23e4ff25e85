"""rule rank: results/{model}/{method}_{pct}/rank.json (rank utilization, correlation with the baseline, conditioning)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parent))
from statereduce.runtime import start  # noqa: E402

log = start(snakemake.log[0], snakemake.threads)
from statereduce.stages import rank_analysis  # noqa: E402

inp, wc = snakemake.input, snakemake.wildcards
doc = rank_analysis(Path(inp.pruned).parent, snakemake.params.rank, snakemake.params.info, snakemake.output[0],
                    baseline=inp.baseline, selection=inp.selection, activations=inp.activations,
                    extra={"method": wc.method, "pct": float(wc.pct), "stage": "pruned"})
log.info("utilization summary: %s, rho vs baseline: %s", doc["summary"]["u"], doc.get("pearson_u"))
