"""rule allocate: results/{model}/select/{method}_{pct}.allocation.json (per-layer key widths of a budget)."""
from statereduce.core.runtime import start

log = start(snakemake.log[0], snakemake.threads)
from statereduce.stages.allocate import allocate_budget  # noqa: E402
from statereduce.core.runtime import write_json  # noqa: E402
from statereduce.common.settings import BudgetPlan  # noqa: E402

inp, selector, wc = snakemake.input, snakemake.params.selector, snakemake.wildcards
doc = allocate_budget(
    inp.weights, wc.method, float(wc.pct), BudgetPlan.from_dict(snakemake.params.budget),
    activations=inp.get("activations"), values=inp.get("values"), seed=selector["seed"], options=selector["options"],
    expect=snakemake.params.info,
)
write_json(snakemake.output[0], doc)
log.info("%s: widths %s (uniform %d, total %d)", doc["allocation"]["policy"], doc["key_dims"], doc["uniform_width"],
         doc["allocation"]["total"])
