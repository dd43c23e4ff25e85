"""rule comparison_table: results/tables/comparison.{md,csv,html} from every targeted summary."""
from statereduce.common import layout
from statereduce.core.runtime import read_json, start  # noqa: E402

log = start(snakemake.log[0], torch_threads=False)
from statereduce.analysis.figures import write_markdown_html  # noqa: E402
from statereduce.analysis.tables import write_comparison  # noqa: E402

summaries = [read_json(p) for p in snakemake.input.summaries]
baselines = {layout.parse(p).model: read_json(p) for p in snakemake.input.baselines}
df = write_comparison(summaries, baselines, snakemake.output.md, snakemake.output.csv)
write_markdown_html(snakemake.output.md, snakemake.output.html)
log.info("wrote %d rows to %s", len(df), snakemake.output.md)
