"""rule rank_tables: results/tables/{rank_utilization,conditioning,overlap}.{md,csv,html} (Tables 5, 6, App. C.2)."""
from pathlib import Path

from statereduce.core.runtime import read_json, start  # noqa: E402

log = start(snakemake.log[0], torch_threads=False)
from statereduce.core.selection_file import read_selection  # noqa: E402
from statereduce.analysis.figures import write_markdown_html  # noqa: E402
from statereduce.analysis.tables import write_rank_tables  # noqa: E402

ranks, selections = {}, {}
for rank_path, sel_path in zip(snakemake.input.ranks, snakemake.input.selections):
    doc = read_json(rank_path)
    key = (doc["provenance"]["model"], doc["provenance"]["method"], float(doc["provenance"]["pct"]))
    ranks[key] = doc
    selections[key] = read_selection(sel_path, expect=dict(zip(("model", "method", "pct"), key)))[0].keys
baseline_docs = [read_json(p) for p in snakemake.input.baselines]
baselines = {doc["provenance"]["model"]: doc for doc in baseline_docs}
frames = write_rank_tables(ranks, baselines, selections, Path(snakemake.output.utilization).parent)
for name in ("utilization", "conditioning", "overlap"):
    write_markdown_html(snakemake.output[name], snakemake.output[f"{name}_html"])
log.info("wrote %s", {k: len(v) for k, v in frames.items()})
