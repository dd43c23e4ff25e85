rule prune:
    """Slice the kept channels out of the checkpoint (HF checkpoint + prune_record.json), then evaluate the
    pruned model with lm-eval in the same process (pruned/eval.json): loading fla and lm-eval costs more
    than either step, and the pruned model in memory equals the reloaded checkpoint bit for bit."""
    wildcard_constraints:
        method=METHOD_PLAIN_REGEX,
    input:
        base=get_base,
        checkpoint=get_checkpoint_files,
        selection=layout.SELECTION,
    output:
        record=f"{layout.PRUNED}/prune_record.json",
        config=f"{layout.PRUNED}/config.json",
        weights=f"{layout.PRUNED}/model.safetensors",
        eval=f"{layout.PRUNED}/eval.json",
    params:
        info=model_info,
        prune=get_prune,
        eval=get_eval,
    threads: model_threads
    resources:
        gpu=gpu_of,
    log:
        "logs/prune/{model}/{method}_{pct}.log",
    benchmark:
        "benchmarks/prune/{model}/{method}_{pct}.tsv"
    conda:
        conda_env("lm_eval")
    script:
        "../workflow_scripts/prune.py"


rule prune_fit:
    """A method with +<fit>: slice the selection of the token without it, as rule prune does, load the fitted output
    projections (rule fit) into the sliced model, and evaluate it (pruned/eval.json)."""
    wildcard_constraints:
        method=METHOD_FIT_REGEX,
    input:
        base=get_base,
        checkpoint=get_checkpoint_files,
        selection=get_fit_selection,
        fit=layout.FIT,
    output:
        record=f"{layout.PRUNED}/prune_record.json",
        config=f"{layout.PRUNED}/config.json",
        weights=f"{layout.PRUNED}/model.safetensors",
        eval=f"{layout.PRUNED}/eval.json",
    params:
        info=model_info,
        prune=get_prune,
        eval=get_eval,
    threads: model_threads
    resources:
        gpu=gpu_of,
    log:
        "logs/prune/{model}/{method}_{pct}.log",
    benchmark:
        "benchmarks/prune_fit/{model}/{method}_{pct}.tsv"
    conda:
        conda_env("lm_eval")
    script:
        "../workflow_scripts/prune_fit.py"
