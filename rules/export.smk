# Upload-ready folders of the workflow's checkpoints (statereduce.stages.export). Never part of the default target:
# `snakemake results/{model}/{method}_{pct}/export/rft/README.md --cores all`.


rule export:
    """The pruned or fine-tuned checkpoint as a folder a model hub accepts: weights, config, tokenizer, the modeling
    code of per-layer widths, RFT's LoRA adapter (peft's format), and a model card (base model and revision, method,
    every layer's widths, calibration, metrics before and after RFT, the command)."""
    wildcard_constraints:
        stage="pruned|rft",
    input:
        unpack(get_export_inputs),
    output:
        card=f"{layout.EXPORT}/README.md",
    params:
        info=model_info,
        calibration=get_export_calibration,
        command=get_export_command,
    log:
        "logs/export/{model}/{method}_{pct}_{stage}.log",
    benchmark:
        "benchmarks/export/{model}/{method}_{pct}_{stage}.tsv"
    conda:
        conda_env("lm_eval")
    script:
        "../workflow_scripts/export.py"
