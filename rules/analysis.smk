rule rank_baseline:
    """Rank utilization of the unpruned model's recurrent states over held-out sequences, and the conditioning of
    all its [Q; K] calibration columns (paper Sec. 2.2, App. C.1, Table 6's baseline row)."""
    input:
        base=get_base,
        checkpoint=get_checkpoint_files,
        activations=layout.path(layout.ACTIVATIONS, calib="default"),
    output:
        layout.BASELINE_RANK,
    params:
        info=model_info,
        rank=get_rank,
    threads: model_threads
    resources:
        gpu=gpu_of,
    log:
        "logs/rank_baseline/{model}.log",
    benchmark:
        "benchmarks/rank_baseline/{model}.tsv"
    conda:
        conda_env("fla")
    script:
        "../workflow_scripts/rank_baseline.py"


rule rank:
    """Rank utilization of a pruned model (pre-RFT, as the paper's Table 5), its Pearson correlation with the
    baseline per head, and the conditioning of its selected [Q; K] calibration columns (Table 6)."""
    input:
        unpack(get_rank_inputs),
    output:
        layout.RANK,
    params:
        info=model_info,
        rank=get_rank,
    threads: model_threads
    resources:
        gpu=gpu_of,
    log:
        "logs/rank/{model}/{method}_{pct}.log",
    benchmark:
        "benchmarks/rank/{model}/{method}_{pct}.tsv"
    conda:
        conda_env("fla")
    script:
        "../workflow_scripts/rank.py"


rule rank_tables:
    """Tables 5 and 6 and the selectors' kept-channel overlap (App. C.2) for every targeted (model, method, pct), with
    their HTML pages for the report."""
    input:
        ranks=get_target_ranks,
        baselines=get_baseline_ranks,
        selections=get_target_selections,
    output:
        utilization=table_report("rank_utilization", "md"),
        conditioning=table_report("conditioning", "md"),
        overlap=table_report("overlap", "md"),
        utilization_html=table_report("rank_utilization", "html"),
        conditioning_html=table_report("conditioning", "html"),
        overlap_html=table_report("overlap", "html"),
    log:
        "logs/rank_tables/rank_tables.log",
    benchmark:
        "benchmarks/rank_tables/rank_tables.tsv",
    conda:
        conda_env("lm_eval")
    script:
        "../workflow_scripts/rank_tables.py"


rule figures:
    """Per-head rank utilization histograms (paper Fig. 3) and one head's singular-value spectrum (Figs. 2, 5) of
    the baseline and every targeted method of a model at one ratio (pre-RFT), from their rank.json."""
    input:
        unpack(get_figure_inputs),
    output:
        utilization=report(
            layout.figure("{model}_utilization_{pct}"),
            caption="../report/utilization.rst",
            category="Figures",
            subcategory="{model}",
            labels={"figure": "rank utilization per head (Fig. 3)", "pct": "{pct}% removed"},
        ),
        spectrum=report(
            layout.figure("{model}_spectrum_{pct}"),
            caption="../report/spectrum.rst",
            category="Figures",
            subcategory="{model}",
            labels={"figure": "state spectrum of one head (Figs. 2, 5)", "pct": "{pct}% removed"},
        ),
    log:
        "logs/figures/{model}_{pct}.log",
    benchmark:
        "benchmarks/figures/{model}_{pct}.tsv"
    conda:
        conda_env("lm_eval")
    script:
        "../workflow_scripts/figures.py"
