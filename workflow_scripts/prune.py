"""rule prune: results/{model}/{method}_{pct}/pruned/ (HF checkpoint + prune_record.json + eval.json)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parent))
from statereduce.runtime import start  # noqa: E402

log = start(snakemake.log[0], snakemake.threads)
from statereduce.models import load_model  # noqa: E402
from statereduce.selection import read_selection  # noqa: E402
from statereduce.slicing import prune_model, save_pruned  # noqa: E402
from statereduce.stages import evaluate_loaded  # noqa: E402

info, wc = snakemake.params.info, snakemake.wildcards
model, tokenizer = load_model(Path(snakemake.input.base).parent, dtype=info["dtype"], device="cpu")
keep, meta = read_selection(snakemake.input.selection)
meta.update(source=str(Path(snakemake.input.base).parent), selection=snakemake.input.selection)
record = prune_model(model, keep, meta)
out_dir = save_pruned(model, tokenizer, record, Path(snakemake.output.record).parent)
log.info("pruned d_k %s -> %s into %s", meta["d_k"], meta["d_k_new"], out_dir)
doc = evaluate_loaded(model.to(info["device"]), tokenizer, out_dir, snakemake.params.eval, info,
                      snakemake.output.eval, extra={"method": wc.method, "pct": float(wc.pct)})
log.info("metrics: %s", doc["metrics"])
