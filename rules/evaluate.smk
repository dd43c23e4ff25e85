rule eval_baseline:
    """lm-eval on the unpruned model."""
    input:
        base=get_base,
        checkpoint=get_checkpoint_files,
    output:
        layout.BASELINE_EVAL,
    params:
        info=model_info,
        eval=get_eval,
    threads: model_threads
    resources:
        gpu=gpu_of,
    log:
        "logs/eval_baseline/{model}.log",
    benchmark:
        "benchmarks/eval_baseline/{model}.tsv"
    conda:
        conda_env("lm_eval")
    script:
        "../workflow_scripts/eval_baseline.py"


rule summarize:
    """The summary the user asks for: baseline, pruned and post-RFT metrics side by side, state bytes, provenance."""
    input:
        unpack(get_summary_inputs),
    output:
        layout.SUMMARY,
    log:
        "logs/summarize/{model}/{method}_{pct}.log",
    benchmark:
        "benchmarks/summarize/{model}/{method}_{pct}.tsv",
    conda:
        conda_env("lm_eval")
    script:
        "../workflow_scripts/summarize.py"


rule comparison_table:
    """Every targeted (model, method, pct) before and after RFT beside its baseline (paper Tables 20/21 layout), with
    its HTML page for the report."""
    input:
        summaries=get_summaries,
        baselines=get_baselines,
    output:
        md=table_report("comparison", "md"),
        csv=layout.table("comparison", "csv"),
        html=table_report("comparison", "html"),
    log:
        "logs/comparison_table/comparison.log",
    benchmark:
        "benchmarks/comparison_table/comparison.tsv",
    conda:
        conda_env("lm_eval")
    script:
        "../workflow_scripts/comparison_table.py"
