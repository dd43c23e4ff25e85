"""rule speed_table: results/tables/speed.md and results/figures/speedup.png from the baselines' speed.json."""
from statereduce.core.runtime import start

log = start(snakemake.log[0], snakemake.threads, torch_threads=False)
from statereduce.analysis.figures import speedup_figure  # noqa: E402
from statereduce.core.runtime import read_json, write_text_atomic  # noqa: E402
from statereduce.analysis.tables import speed_markdown  # noqa: E402

docs = [read_json(p) for p in snakemake.input]
write_text_atomic(snakemake.output.md, speed_markdown(docs))
speedup_figure(docs, snakemake.output.figure)
log.info("speed table and figure from %d documents", len(docs))
