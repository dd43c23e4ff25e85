"""rule summarize: results/{model}/{method}_{pct}/eval.json from the baseline, pruned and RFT evaluations."""
from statereduce.core.runtime import read_json, start, write_json  # noqa: E402

log = start(snakemake.log[0], torch_threads=False)
from statereduce.eval.documents import summarize  # noqa: E402

record = read_json(snakemake.input.record)
meta = {"model": snakemake.wildcards.model, "method": snakemake.wildcards.method,
        "pct": float(snakemake.wildcards.pct), "prune_record": record}
rft = read_json(snakemake.input.rft) if "rft" in snakemake.input.keys() else None
rft_record = read_json(snakemake.input.rft_record) if "rft_record" in snakemake.input.keys() else None
summary = summarize(read_json(snakemake.input.baseline), read_json(snakemake.input.pruned), rft, meta, rft_record)
write_json(snakemake.output[0], summary)
log.info("wrote %s", snakemake.output[0])
