"""rule qk_weights: results/{model}/weights/qk.h5 (head rows of the q/k projections)."""
from pathlib import Path

from statereduce.core.runtime import start

log = start(snakemake.log[0], snakemake.threads)
from statereduce.stages.capture import export_qk_weights  # noqa: E402
from statereduce.core.models import load_model  # noqa: E402

model, _ = load_model(Path(snakemake.input.base).parent, dtype="float32", device="cpu")
export_qk_weights(model, snakemake.output[0], attrs={"model": snakemake.params.info["model"]})
log.info("wrote %s", snakemake.output[0])
