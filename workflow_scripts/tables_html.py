"""rule tables_html: results/tables/{comparison,rank_utilization,conditioning,overlap}.html for the report."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parent))
from statereduce.runtime import start  # noqa: E402

log = start(snakemake.log[0], torch_threads=False)
from statereduce.figures import write_markdown_html  # noqa: E402

for name, md_path in snakemake.input.items():
    write_markdown_html(md_path, snakemake.output[name])
    log.info("wrote %s from %s", snakemake.output[name], md_path)
