"""rule convolution_tables: results/tables/{shared,pca}_convolutions.{md,csv,html} (paper Tables 14, 15)."""
from pathlib import Path

from statereduce.runtime import read_json, start  # noqa: E402

log = start(snakemake.log[0], torch_threads=False)
from statereduce.analysis.figures import write_markdown_html  # noqa: E402
from statereduce.analysis.tables import write_convolution_tables  # noqa: E402

# results/{model}/baseline/eval.json and results/{model}/{method}_{pct}/pruned/eval.json
baselines = {Path(p).parts[-3]: read_json(p) for p in snakemake.input.baselines}
pruned = {}
for p in snakemake.input.pruned:
    method, _, pct = Path(p).parts[-3].rpartition("_")
    pruned[(Path(p).parts[-4], method, float(pct))] = read_json(p)
frames = write_convolution_tables(baselines, pruned, snakemake.params.study, Path(snakemake.output.shared).parent)
for name in ("shared", "pca"):
    write_markdown_html(snakemake.output[name], snakemake.output[f"{name}_html"])
log.info("wrote %s from %d baselines and %d pruned evaluations", {k: len(v) for k, v in frames.items()},
         len(baselines), len(pruned))
