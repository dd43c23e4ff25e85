"""rule budget_values: results/{model}/select/{method}.values.json (a measured budget policy's per-width values)."""
from pathlib import Path

from statereduce.runtime import start

log = start(snakemake.log[0], snakemake.threads)
from statereduce.allocate import budget_values  # noqa: E402
from statereduce.runtime import write_json  # noqa: E402

inp, budget = snakemake.input, snakemake.params.budget
doc = budget_values(
    inp.weights, snakemake.wildcards.method, budget["name"], budget["settings"],
    activations=inp.get("activations"), grads=inp.get("grads"),
    base=Path(inp.base).parent if "base" in inp.keys() else None,
    calibration=budget.get("calibration"), corpus=budget.get("corpus"), head_v_dim=budget["head_v_dim"],
    seed=snakemake.params.selector["seed"], options=snakemake.params.selector["options"], expect=snakemake.params.info,
)
write_json(snakemake.output[0], doc)
log.info("%s: values of widths %s in layers %s", doc["settings"]["policy"], doc["widths"], doc["layers"])
