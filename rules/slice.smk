rule prune:
    """Slice the kept channels out of the checkpoint; save an HF checkpoint + prune_record.json."""
    input:
        base=get_base,
        selection="results/{model}/select/{method}_{pct}.parquet",
    output:
        record="results/{model}/{method}_{pct}/pruned/prune_record.json",
        config="results/{model}/{method}_{pct}/pruned/config.json",
    params:
        info=model_info,
    log:
        "logs/prune/{model}/{method}_{pct}.log",
    benchmark:
        "benchmarks/prune/{model}/{method}_{pct}.tsv"
    conda:
        "../envs/fla.yaml"
    script:
        "../workflow_scripts/prune.py"
