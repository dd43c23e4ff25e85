"""rule allocate: results/{model}/select/{method}_{pct}.allocation.json (per-layer key widths of a budget)."""
from statereduce.runtime import start

log = start(snakemake.log[0], snakemake.threads)
from statereduce.allocate import allocate_budget  # noqa: E402
from statereduce.runtime import write_json  # noqa: E402

inp, budget = snakemake.input, snakemake.params.budget
doc = allocate_budget(
    inp.weights, snakemake.wildcards.method, float(snakemake.wildcards.pct), budget["name"], budget["settings"],
    activations=inp.get("activations"), values=inp.get("values"), calibration=budget.get("calibration"),
    head_v_dim=budget["head_v_dim"], seed=snakemake.params.selector["seed"],
    options=snakemake.params.selector["options"], expect=snakemake.params.info,
)
write_json(snakemake.output[0], doc)
log.info("%s: widths %s (uniform %d, total %d)", doc["allocation"]["policy"], doc["key_dims"], doc["uniform_width"],
         doc["allocation"]["total"])
