"""rule init_random: an untrained checkpoint of a given shape into results/{model}/base/."""
from pathlib import Path

from statereduce.core.runtime import start

log = start(snakemake.log[0], snakemake.threads)
from statereduce.stages.pretrain import init_random  # noqa: E402
from statereduce.common.settings import InitSettings  # noqa: E402

init, info = InitSettings.from_dict(snakemake.params.init), snakemake.params.info
out_dir = Path(snakemake.output.marker).parent
record = init_random(snakemake.params.family, init.arch, out_dir, seed=init.seed, dtype=info["dtype"],
                     device=info["device"])
log.info("random %s of %.3fB parameters into %s (%.1f s)", snakemake.wildcards.model, record["n_params"] / 1e9,
         out_dir, record["seconds"])
