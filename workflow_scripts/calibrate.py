"""rule calibrate: results/{model}/calib/{calib}/activations.h5."""
from pathlib import Path

from statereduce.core.runtime import start

log = start(snakemake.log[0], snakemake.threads)
from statereduce.stages.capture import capture_activations  # noqa: E402
from statereduce.core.data import load_split, token_blocks  # noqa: E402
from statereduce.core.models import load_model  # noqa: E402
from statereduce.common.settings import CalibrationSettings  # noqa: E402

info, corpus = snakemake.params.info, snakemake.params.corpus
cal = CalibrationSettings.from_dict(snakemake.params.calibration)
model, tokenizer = load_model(Path(snakemake.input.base).parent, dtype=info["dtype"], device=info["device"])
blocks = token_blocks(tokenizer, load_split(corpus, cal.split), cal.n_samples, cal.seq_len, cal.seed)
capture_activations(
    model, blocks, snakemake.output[0], rows_per_head=cal.rows_per_head, seed=cal.seed, batch_size=cal.batch_size,
    attrs={"model": info["model"], "calibration": snakemake.wildcards.calib, "corpus": cal.corpus,
           "revision": getattr(model.config, "_commit_hash", None) or "local"},
)
log.info("wrote %s (%d sequences x %d tokens)", snakemake.output[0], *blocks.shape)
