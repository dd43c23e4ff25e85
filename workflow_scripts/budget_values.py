"""rule budget_values: results/{model}/select/{method}.values.json (a measured budget policy's per-width values)."""
from pathlib import Path

from statereduce.core.runtime import start

log = start(snakemake.log[0], snakemake.threads)
from statereduce.stages.allocate import budget_values  # noqa: E402
from statereduce.core.runtime import write_json  # noqa: E402
from statereduce.common.settings import BudgetPlan  # noqa: E402

inp, selector = snakemake.input, snakemake.params.selector
doc = budget_values(
    inp.weights, snakemake.wildcards.method, BudgetPlan.from_dict(snakemake.params.budget),
    activations=inp.get("activations"), grads=inp.get("grads"),
    base=Path(inp.base).parent if "base" in inp.keys() else None,
    seed=selector["seed"], options=selector["options"], expect=snakemake.params.info,
)
write_json(snakemake.output[0], doc)
log.info("%s: values of widths %s in layers %s", doc["settings"]["policy"], doc["widths"], doc["layers"])
