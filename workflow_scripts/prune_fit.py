"""rule prune_fit: results/{model}/{method}_{pct}/pruned/ of a method with +<fit> (the selection of the token without
it, sliced as rule prune does, with the fitted output projections of rule fit)."""
from pathlib import Path

from statereduce.core.runtime import start

log = start(snakemake.log[0], snakemake.threads)
from statereduce.core.models import load_model  # noqa: E402
from statereduce.core.selection_file import read_selection  # noqa: E402
from statereduce.core.fit import apply_fit, read_fit  # noqa: E402
from statereduce.stages.prune import prune_model, save_pruned  # noqa: E402
from statereduce.eval.run import evaluate_loaded  # noqa: E402
from statereduce.common.settings import EvalSettings, PruneSettings  # noqa: E402

info, wc, inp = snakemake.params.info, snakemake.wildcards, snakemake.input
weights, fit = read_fit(inp.fit, expect={**info, "method": wc.method, "pct": float(wc.pct)})
model, tokenizer = load_model(Path(inp.base).parent, dtype=info["dtype"], device="cpu")
keep, meta = read_selection(inp.selection, expect={**info, "method": fit["selection_method"], "pct": float(wc.pct)})
meta.update(source=str(Path(inp.base).parent), selection=inp.selection, method=wc.method,
            fit={k: fit[k] for k in ("fit", "settings", "layers", "residual_scale")} | {"artifact": inp.fit})
record = prune_model(model, keep, meta, norm_eps=PruneSettings.from_dict(snakemake.params.prune).norm_eps)
names = apply_fit(model, weights)
out_dir = save_pruned(model, tokenizer, record, Path(snakemake.output.record).parent)
log.info("pruned d_k %s -> %s with %d fitted output projections into %s", meta["d_k"], meta["d_k_new"], len(names),
         out_dir)
doc = evaluate_loaded(model.to(info["device"]), tokenizer, out_dir, EvalSettings.from_dict(snakemake.params.eval),
                      info, snakemake.output.eval, extra={"method": wc.method, "pct": float(wc.pct)})
log.info("metrics: %s", doc["metrics"])
