"""rule grad_scores: results/{model}/calib/{calib}/grad_scores.h5 (Grad saliency)."""
from pathlib import Path

from statereduce.core.runtime import start

log = start(snakemake.log[0], snakemake.threads)
from statereduce.stages.capture import grad_scores  # noqa: E402
from statereduce.core.data import load_split, token_blocks  # noqa: E402
from statereduce.core.models import load_model  # noqa: E402
from statereduce.common.settings import CalibrationSettings, GradSettings  # noqa: E402

info, corpus = snakemake.params.info, snakemake.params.corpus
cal = CalibrationSettings.from_dict(snakemake.params.calibration)
n_samples, batch_size = GradSettings.from_dict(snakemake.params.grad).sizes(cal)
model, tokenizer = load_model(Path(snakemake.input.base).parent, dtype=info["dtype"], device=info["device"])
blocks = token_blocks(tokenizer, load_split(corpus, cal.split), n_samples, cal.seq_len, cal.seed)
grad_scores(model, blocks, snakemake.output[0], batch_size=batch_size,
            attrs={"model": info["model"], "calibration": snakemake.wildcards.calib, "corpus": cal.corpus,
                   "seed": cal.seed})
log.info("wrote %s (%d sequences x %d tokens)", snakemake.output[0], *blocks.shape)
