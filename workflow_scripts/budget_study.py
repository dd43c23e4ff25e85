"""rule budget_study: results/tables/budget_study.{md,csv,html}, results/figures/budget_allocations.png."""
from pathlib import Path

from statereduce.core.runtime import read_json, start

log = start(snakemake.log[0], torch_threads=False)
from statereduce.analysis.figures import budget_allocations, write_markdown_html  # noqa: E402
from statereduce.analysis.tables import write_budget_study  # noqa: E402

summaries = [read_json(p) for p in snakemake.input.summaries]
allocations = [read_json(p) for p in snakemake.input.allocations]
df = write_budget_study(summaries, snakemake.params.study, allocations, Path(snakemake.output.table).parent)
write_markdown_html(snakemake.output.table, snakemake.output.html)
budget_allocations(allocations, snakemake.output.figure)
log.info("wrote %d rows from %d summaries and %d allocations", len(df), len(summaries), len(allocations))
