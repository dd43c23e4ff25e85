"""rule export: results/{model}/{method}_{pct}/export/{stage}/ (an upload-ready checkpoint with its model card)."""
from pathlib import Path

from statereduce.core.runtime import start

log = start(snakemake.log[0], snakemake.threads)
from statereduce.stages.export import base_description, export_checkpoint  # noqa: E402

params, inputs = snakemake.params, snakemake.input
evals = {k: inputs.get(k) for k in ("base", "pruned", "rft")}
out = export_checkpoint(Path(inputs.config).parent, Path(snakemake.output.card).parent,
                        model_name=snakemake.wildcards.model, evals=evals,
                        base=base_description(Path(inputs.source).parent), calibration=params.calibration,
                        command=params.command)
log.info("exported %s into %s", Path(inputs.config).parent, out)
