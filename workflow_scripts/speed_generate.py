"""rule speed_generate: results/{model}/baseline/generate.json (GPU; random weights of the model's shape)."""
import sys

from statereduce.core.runtime import start

log = start(snakemake.log[0], snakemake.threads)
from statereduce.speed.bench import require_cuda  # noqa: E402
from statereduce.speed.generate import GenerateSettings, generate_plan, run_generate  # noqa: E402

try:
    require_cuda()
    plan = generate_plan(snakemake.params.model, snakemake.params.speed, name=snakemake.wildcards.model)
    settings = GenerateSettings.from_dict({"dtype": plan["dtype"]})
except (RuntimeError, ValueError) as e:
    log.error("%s", e)
    sys.exit(f"error: {e}")
run_generate(plan["family"], plan["arch"], settings, snakemake.output[0], model_name=snakemake.params.info["model"],
             pcts=plan["pcts"])
