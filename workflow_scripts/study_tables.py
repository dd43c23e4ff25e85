"""rule study_tables: results/tables/{calibration_study,scoring_ablation}.{md,csv,html} (paper Tables 2/7, 16)."""
from pathlib import Path

from statereduce.core.runtime import read_json, start  # noqa: E402

log = start(snakemake.log[0], torch_threads=False)
from statereduce.analysis.figures import write_markdown_html  # noqa: E402
from statereduce.analysis.tables import write_study_tables  # noqa: E402

summaries = [read_json(p) for p in snakemake.input.summaries]
out_dir = Path(snakemake.output.calibration).parent
frames = write_study_tables(summaries, snakemake.params.studies, out_dir, snakemake.params.calibrations)
for name in ("calibration", "scoring"):
    write_markdown_html(snakemake.output[name], snakemake.output[f"{name}_html"])
log.info("wrote %s from %d summaries", {k: len(v) for k, v in frames.items()}, len(summaries))
