rule calibrate:
    """K/Q rows per head as they enter the recurrence, and projection-input column norms (HDF5)."""
    input:
        base=get_base,
        checkpoint=get_checkpoint_files,
    output:
        layout.ACTIVATIONS,
    params:
        info=model_info,
        calibration=get_calibration,
        corpus=get_calib_corpus,
    threads: model_threads
    resources:
        gpu=gpu_of,
    log:
        "logs/calibrate/{model}/{calib}.log",
    benchmark:
        "benchmarks/calibrate/{model}/{calib}.tsv"
    conda:
        conda_env("fla")
    script:
        "../workflow_scripts/calibrate.py"


rule grad_scores:
    """Grad saliency of every q/k channel from the full model's LM loss (read by `grad` only)."""
    input:
        base=get_base,
        checkpoint=get_checkpoint_files,
    output:
        layout.GRAD_SCORES,
    params:
        info=model_info,
        calibration=get_calibration,
        corpus=get_calib_corpus,
        grad=get_grad_settings,
    threads: model_threads
    resources:
        gpu=gpu_of,
    log:
        "logs/grad_scores/{model}/{calib}.log",
    benchmark:
        "benchmarks/grad_scores/{model}/{calib}.tsv"
    conda:
        conda_env("fla")
    script:
        "../workflow_scripts/grad_scores.py"


rule qk_weights:
    """The head rows of every layer's q/k projections, so selections never load the model."""
    input:
        base=get_base,
        checkpoint=get_checkpoint_files,
    output:
        layout.QK_WEIGHTS,
    params:
        info=model_info,
    threads: model_threads
    log:
        "logs/qk_weights/{model}.log",
    benchmark:
        "benchmarks/qk_weights/{model}.tsv"
    conda:
        conda_env("fla")
    script:
        "../workflow_scripts/qk_weights.py"
