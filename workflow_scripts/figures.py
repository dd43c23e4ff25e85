"""rule figures: results/figures/{model}_{utilization,spectrum}_{pct}.png (paper Figs. 3 and 2/5, pre-RFT)."""
from statereduce.core.runtime import read_json, start  # noqa: E402

log = start(snakemake.log[0], torch_threads=False)
from statereduce.analysis.figures import spectrum_figure, utilization_histograms  # noqa: E402

wc = snakemake.wildcards
baseline = read_json(snakemake.input.baseline)
methods = {}
for path in snakemake.input.ranks:
    doc = read_json(path)
    methods[doc["provenance"]["method"]] = doc
utilization_histograms(baseline, methods, snakemake.output.utilization, model=wc.model, pct=float(wc.pct))
spectrum_figure(baseline, methods, snakemake.output.spectrum, model=wc.model, pct=float(wc.pct))
log.info("wrote %s and %s (baseline and %s)", snakemake.output.utilization, snakemake.output.spectrum, list(methods))
