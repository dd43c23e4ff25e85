"""rule base_source: write results/{model}/base/source.json for a hub or local checkpoint."""
from pathlib import Path

from statereduce.core.runtime import start

log = start(snakemake.log[0], torch_threads=False)
from statereduce.core.models import write_hub_source  # noqa: E402

src = snakemake.params.source
write_hub_source(Path(snakemake.output[0]).parent, src["hub_id"], src["revision"], src["dtype"],
                 family=snakemake.params.family)
log.info("wrote %s", snakemake.output[0])
