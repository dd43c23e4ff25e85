"""rule fit: results/{model}/select/{method}_{pct}.fit.safetensors (the output projections of a +<fit> method)."""
from pathlib import Path

from statereduce.core.runtime import start

log = start(snakemake.log[0], snakemake.threads)
from statereduce.common.settings import FitPlan, PruneSettings  # noqa: E402
from statereduce.core.fit import write_fit  # noqa: E402
from statereduce.stages.prune import fit_selection  # noqa: E402

inp, wc = snakemake.input, snakemake.wildcards
result, doc = fit_selection(Path(inp.base).parent, inp.selection, wc.method, float(wc.pct),
                            FitPlan.from_dict(snakemake.params.fit),
                            norm_eps=PruneSettings.from_dict(snakemake.params.prune).norm_eps,
                            expect=snakemake.params.info)
write_fit(snakemake.output[0], result, doc)
for layer, row in doc["layers"].items():
    log.info("layer %s: output error %.4f -> %.4f over %d tokens", layer, row["error_cut"], row["error_fit"],
             row["tokens"])
log.info("fitted %d output projections in %.1f s", len(result.weights), doc["seconds"])
