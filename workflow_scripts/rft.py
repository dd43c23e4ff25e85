"""rule rft: results/{model}/{method}_{pct}/rft/ (RFT checkpoint, rft_record.json, train_log.jsonl, eval.json)."""
from pathlib import Path

from statereduce.core.runtime import start

log = start(snakemake.log[0], snakemake.threads)
from statereduce.stages.rft import run_rft  # noqa: E402
from statereduce.common.settings import EvalSettings, RftPlan  # noqa: E402

wc, out = snakemake.wildcards, snakemake.output
plan, ev = RftPlan.from_dict(snakemake.params.rft), EvalSettings.from_dict(snakemake.params.eval)
doc = run_rft(Path(snakemake.input.pruned).parent, Path(snakemake.input.base).parent, Path(out.config).parent,
              plan, snakemake.params.corpus, ev, snakemake.params.info, out.eval,
              resume_dir=snakemake.params.resume, log_jsonl=f"{snakemake.log[0]}.jsonl",
              extra={"method": wc.method, "pct": float(wc.pct), "stage": "rft"})
log.info("metrics: %s", doc["metrics"])
