"""rule select_channels: results/{model}/select/{method}_{pct}.parquet (reads HDF5 artifacts only)."""
from statereduce.core.runtime import start

log = start(snakemake.log[0], snakemake.threads, torch_threads=False)
from statereduce.stages.select import select_channels, write_selection  # noqa: E402

rows, meta = select_channels(
    snakemake.input.weights, snakemake.wildcards.method, float(snakemake.wildcards.pct),
    activations=snakemake.input.get("activations"), grads=snakemake.input.get("grads"),
    seed=snakemake.params.selector["seed"], options=snakemake.params.selector["options"], workers=snakemake.threads,
    expect=snakemake.params.info, allocation=snakemake.input.get("allocation"),
)
write_selection(snakemake.output[0], rows, meta)
log.info("kept %s of %d channels per head in %d heads", meta["d_k_new"], meta["d_k"], len(rows))
