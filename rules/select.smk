rule budget_values:
    """Per-width values of a measured budget policy for a method with @<budget> (greedy: the share of the selector's
    objective; sensitivity: the calibration loss of each single-layer cut), measured once for the allocation of every
    pct (results/{model}/select/{method}.values.json)."""
    input:
        unpack(get_budget_values_inputs),
    output:
        layout.BUDGET_VALUES,
    params:
        info=model_info,
        budget=get_budget,
        selector=get_selector_options,
    threads: model_threads
    resources:
        gpu=budget_values_gpu,
    log:
        "logs/budget_values/{model}/{method}.log",
    benchmark:
        "benchmarks/budget_values/{model}/{method}.tsv"
    conda:
        conda_env("fla")
    script:
        "../workflow_scripts/budget_values.py"


rule allocate:
    """Per-layer key widths of a method with @<budget> (budgets.<name>): one d_k' per layer at the uniform cut's total,
    with the policy's values and statistics (results/{model}/select/{method}_{pct}.allocation.json)."""
    input:
        unpack(get_allocate_inputs),
    output:
        layout.ALLOCATION,
    params:
        info=model_info,
        budget=get_budget,
        selector=get_selector_options,
    threads: model_threads
    log:
        "logs/allocate/{model}/{method}_{pct}.log",
    benchmark:
        "benchmarks/allocate/{model}/{method}_{pct}.tsv"
    conda:
        conda_env("fla")
    script:
        "../workflow_scripts/allocate.py"


rule split:
    """The split of a joint cut's state between d_k' and d_v' (a method <selector>-kv@<budget>, policy split): the
    candidate pair of lowest calibration loss, every candidate's loss beside it
    (results/{model}/select/{method}_{pct}.split.json)."""
    input:
        unpack(get_split_inputs),
    output:
        layout.SPLIT,
    params:
        info=model_info,
        budget=get_budget,
        selector=get_selector_options,
    threads: model_threads
    resources:
        gpu=gpu_of,
    log:
        "logs/split/{model}/{method}_{pct}.log",
    benchmark:
        "benchmarks/split/{model}/{method}_{pct}.tsv"
    conda:
        conda_env("fla")
    script:
        "../workflow_scripts/split.py"


rule select_channels:
    """Per-head kept channels of one selector at one ratio. The selector's own source files are inputs,
    so editing one selector reruns only its selections and what depends on them."""
    input:
        unpack(get_select_inputs),
    output:
        layout.SELECTION,
    params:
        info=model_info,
        selector=get_selector_options,
    threads: model_threads
    log:
        "logs/select_channels/{model}/{method}_{pct}.log",
    benchmark:
        "benchmarks/select_channels/{model}/{method}_{pct}.tsv"
    conda:
        conda_env("fla")
    script:
        "../workflow_scripts/select_channels.py"


rule fit:
    """The output projections of a method with +<fit> re-fitted on calibration tokens (statereduce.core.fit): the
    base model pruned with the selection of the token without +<fit>, then each cut mixer's output projection solved
    by damped least squares, layer by layer (results/{model}/select/{method}_{pct}.fit.safetensors). The fit's code is
    an input: editing it reruns the fits and what depends on them."""
    wildcard_constraints:
        method=METHOD_FIT_REGEX,
    input:
        unpack(get_fit_inputs),
    output:
        layout.FIT,
    params:
        info=model_info,
        fit=get_fit,
        prune=get_prune,
    threads: model_threads
    resources:
        gpu=gpu_of,
    log:
        "logs/fit/{model}/{method}_{pct}.log",
    benchmark:
        "benchmarks/fit/{model}/{method}_{pct}.tsv"
    conda:
        conda_env("fla")
    script:
        "../workflow_scripts/fit.py"
