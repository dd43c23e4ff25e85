"""rule pretrain: train an embedded tiny model into results/{model}/base/."""
from pathlib import Path

from statereduce.core.runtime import start

log = start(snakemake.log[0], snakemake.threads)
from statereduce.stages.pretrain import pretrain  # noqa: E402
from statereduce.common.settings import PretrainSettings  # noqa: E402

p = PretrainSettings.from_dict(snakemake.params.pretrain)
out_dir = Path(snakemake.output.marker).parent
pretrain(snakemake.params.family, p.arch, snakemake.params.corpus, p.train, out_dir,
         log_path=Path(snakemake.log[0]).with_suffix(".jsonl"), recall_mix=p.recall_mix, share_conv=p.share_conv)
log.info("trained %s into %s", snakemake.wildcards.model, out_dir)
