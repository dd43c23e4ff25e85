# GPU speed benchmarks (paper Sec. 5, App. G.1, Tables 17-19, Fig. 4). Random weights of the model's shape, so they
# need no checkpoint; never part of the default CPU target. On a machine without CUDA these jobs fail at once.


rule speed_baseline:
    """Decode, prefill and mixer-only speed of the unpruned model and of every `speed.pcts` ratio, in one job."""
    output:
        layout.BASELINE_SPEED,
    params:
        info=model_info,
        speed=get_speed,
    threads: model_threads
    resources:
        gpu=one_gpu,
    log:
        "logs/speed_baseline/{model}.log",
    benchmark:
        "benchmarks/speed_baseline/{model}.tsv",
    conda:
        conda_env("fla", device="cuda")
    script:
        "../workflow_scripts/speed.py"


rule speed:
    """Speed of the {pct} ratio beside the baseline, measured in the same job (the method does not change shapes)."""
    output:
        layout.SPEED,
    params:
        info=model_info,
        speed=get_speed,
    threads: model_threads
    resources:
        gpu=one_gpu,
    log:
        "logs/speed/{model}/{method}_{pct}.log",
    benchmark:
        "benchmarks/speed/{model}/{method}_{pct}.tsv",
    conda:
        conda_env("fla", device="cuda")
    script:
        "../workflow_scripts/speed.py"


rule speed_table:
    """Tables 17-19 layouts (decode, prefill, mixer) with byte floors, and the decode/prefill speedup figure
    (Fig. 4)."""
    input:
        get_speed_docs,
    output:
        md=report(
            layout.table("speed", "md"),
            caption="../report/speed.rst",
            category="Tables",
            labels={"table": "speed (Tables 17-19)", "format": "Markdown"},
        ),
        figure=report(
            layout.figure("speedup"),
            caption="../report/speedup.rst",
            category="Figures",
            labels={"figure": "speedup vs batch (Fig. 4)"},
        ),
    log:
        "logs/speed_table/speed_table.log",
    benchmark:
        "benchmarks/speed_table/speed_table.tsv",
    conda:
        conda_env("lm_eval")
    script:
        "../workflow_scripts/speed_table.py"


rule all_speed:
    """The speed of every `speed.models` model on a GPU node: `snakemake all_speed --cores all --resources gpu=1`."""
    input:
        speed_outputs(),


rule speed_generate:
    """Hugging Face `generate()` of the unpruned model and of every `speed.pcts` ratio (tokens/s, time to first token,
    peak memory) and the largest batch at a 40 GiB budget at 2K and 16K tokens, in one job (docs/speed.md,
    "Generation with generate()")."""
    output:
        layout.BASELINE_GENERATE,
    params:
        info=model_info,
        model=lambda wildcards: {k: MODELS[wildcards.model].get(k) for k in ("family", "speed", "pretrain", "init")},
        speed={k: v for k, v in CFG.get("speed", {}).items() if k in ("pcts", "dtype")},
    threads: model_threads
    resources:
        gpu=one_gpu,
    log:
        "logs/speed_generate/{model}.log",
    benchmark:
        "benchmarks/speed_generate/{model}.tsv",
    conda:
        conda_env("fla", device="cuda")
    script:
        "../workflow_scripts/speed_generate.py"
