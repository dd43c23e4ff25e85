"""rule convolution_tables: results/tables/{shared,pca}_convolutions.{md,csv,html} (paper Tables 14, 15)."""
from pathlib import Path

from statereduce.core.runtime import read_json, start  # noqa: E402

log = start(snakemake.log[0], torch_threads=False)
from statereduce.analysis.figures import write_markdown_html  # noqa: E402
from statereduce.analysis.tables import write_convolution_tables  # noqa: E402

p = snakemake.params
baselines = {model: read_json(path) for model, path in zip(p.models, snakemake.input.baselines, strict=True)}
pruned = {tuple(cell): read_json(path) for cell, path in zip(p.cells, snakemake.input.pruned, strict=True)}
frames = write_convolution_tables(baselines, pruned, snakemake.params.study, Path(snakemake.output.shared).parent)
for name in ("shared", "pca"):
    write_markdown_html(snakemake.output[name], snakemake.output[f"{name}_html"])
log.info("wrote %s from %d baselines and %d pruned evaluations", {k: len(v) for k, v in frames.items()},
         len(baselines), len(pruned))
