"""The rule of a study (rules/studies.smk): its tables, HTML pages, report captions and figures
(statereduce.studies.write_outputs)."""
from statereduce.core.runtime import start

log = start(snakemake.log[0], torch_threads=False)
from statereduce.studies import get_study, write_outputs  # noqa: E402

study = get_study(snakemake.params.study)
inputs = {name: list(paths) for name, paths in snakemake.input.items()}
rows = write_outputs(study, inputs, snakemake.params.data, dict(snakemake.output.items()))
log.info("study %s: wrote %s from %s", study.name, rows, {k: len(v) for k, v in inputs.items()})
