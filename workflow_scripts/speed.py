"""rules speed / speed_baseline: results/{model}/.../speed.json (GPU; random weights of the model's shape)."""
import sys

from statereduce.core.runtime import start

log = start(snakemake.log[0], snakemake.threads)
from statereduce.common.settings import SpeedPlan  # noqa: E402
from statereduce.speed.bench import check_kernels, require_cuda, run_speed  # noqa: E402

try:
    require_cuda()
except RuntimeError as e:
    log.error("%s", e)
    sys.exit(f"error: {e}")
plan = SpeedPlan.from_dict(snakemake.params.speed)
run_speed(plan.family, plan.arch, check_kernels(plan.settings), snakemake.output[0],
          model_name=snakemake.params.info["model"])
