"""rule split: results/{model}/select/{method}_{pct}.split.json (a joint cut's d_k' x d_v' of lowest calibration loss)."""
from pathlib import Path

from statereduce.core.runtime import start

log = start(snakemake.log[0], snakemake.threads)
from statereduce.common.settings import BudgetPlan  # noqa: E402
from statereduce.core.runtime import write_json  # noqa: E402
from statereduce.stages.select import choose_state_split  # noqa: E402

inp, selector, wc = snakemake.input, snakemake.params.selector, snakemake.wildcards
doc = choose_state_split(
    inp.weights, wc.method, float(wc.pct), BudgetPlan.from_dict(snakemake.params.budget),
    activations=inp.get("activations"), grads=inp.get("grads"), base=Path(inp.base).parent, seed=selector["seed"],
    options=selector["options"], workers=snakemake.threads, expect=snakemake.params.info,
)
write_json(snakemake.output[0], doc)
log.info("d_k'=%d x d_v'=%d of %d x %d (equal split %s), from %d candidates", doc["d_k_new"], doc["d_v_new"],
         doc["d_k"], doc["d_v"], doc["equal"], len(doc["candidates"]))
