"""rule prune: results/{model}/{method}_{pct}/pruned/ (HF checkpoint + prune_record.json + eval.json)."""
from pathlib import Path

from statereduce.core.runtime import start

log = start(snakemake.log[0], snakemake.threads)
from statereduce.core.models import load_model  # noqa: E402
from statereduce.core.selection_file import read_selection  # noqa: E402
from statereduce.stages.prune import prune_model, save_pruned  # noqa: E402
from statereduce.eval.run import evaluate_loaded  # noqa: E402
from statereduce.common.settings import EvalSettings, PruneSettings  # noqa: E402

info, wc = snakemake.params.info, snakemake.wildcards
model, tokenizer = load_model(Path(snakemake.input.base).parent, dtype=info["dtype"], device="cpu")
keep, meta = read_selection(snakemake.input.selection, expect={**info, "method": wc.method, "pct": float(wc.pct)})
meta.update(source=str(Path(snakemake.input.base).parent), selection=snakemake.input.selection)
record = prune_model(model, keep, meta, norm_eps=PruneSettings.from_dict(snakemake.params.prune).norm_eps)
out_dir = save_pruned(model, tokenizer, record, Path(snakemake.output.record).parent)
log.info("pruned d_k %s -> %s into %s", meta["d_k"], meta["d_k_new"], out_dir)
doc = evaluate_loaded(model.to(info["device"]), tokenizer, out_dir, EvalSettings.from_dict(snakemake.params.eval),
                      info, snakemake.output.eval, extra={"method": wc.method, "pct": float(wc.pct)})
log.info("metrics: %s", doc["metrics"])
