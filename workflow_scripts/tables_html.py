"""rule tables_html: results/tables/{comparison,rank_utilization,conditioning,overlap}.html for the report."""
from statereduce.runtime import start

log = start(snakemake.log[0], torch_threads=False)
from statereduce.analysis.figures import write_markdown_html  # noqa: E402

for name, md_path in snakemake.input.items():
    write_markdown_html(md_path, snakemake.output[name])
    log.info("wrote %s from %s", snakemake.output[name], md_path)
