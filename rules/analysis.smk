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


rule study_tables:
    """Calibration sensitivity (paper Tables 2/7) and scoring from keys only, queries only or both (Table 16), pre-
    and post-RFT, from the summaries of the cells of `studies`; with HTML pages for the report."""
    input:
        summaries=get_study_summaries,
    output:
        calibration=table_report("calibration_study", "md"),
        calibration_csv=layout.table("calibration_study", "csv"),
        calibration_html=table_report("calibration_study", "html"),
        scoring=table_report("scoring_ablation", "md"),
        scoring_csv=layout.table("scoring_ablation", "csv"),
        scoring_html=table_report("scoring_ablation", "html"),
    params:
        studies=get_studies,
        calibrations=get_study_calibrations,
    log:
        "logs/study_tables/study_tables.log",
    benchmark:
        "benchmarks/study_tables/study_tables.tsv",
    conda:
        conda_env("lm_eval")
    script:
        "../workflow_scripts/study_tables.py"


rule budget_study:
    """Per-layer key budgets against the uniform cut at the same state (studies.budgets), pre- and post-RFT, from the
    summaries and allocations of its cells; with the HTML page and a figure of every allocation."""
    input:
        summaries=get_budget_study_summaries,
        allocations=get_budget_study_allocations,
    output:
        table=table_report("budget_study", "md"),
        csv=layout.table("budget_study", "csv"),
        html=table_report("budget_study", "html"),
        figure=report(
            layout.figure("budget_allocations"),
            caption="../report/budget_allocations.rst",
            category="Figures",
            labels={"figure": "per-layer key budgets"},
        ),
    params:
        study=get_budget_study,
    log:
        "logs/budget_study/budget_study.log",
    benchmark:
        "benchmarks/budget_study/budget_study.tsv",
    conda:
        conda_env("lm_eval")
    script:
        "../workflow_scripts/budget_study.py"


rule convolution_tables:
    """Shared against per-channel q/k conv filters (paper Table 14: the unpruned models) and PCA (proper,
    adversarial) against Grad on both, before RFT (Table 15), from `studies.convolutions`; with HTML pages."""
    input:
        baselines=get_convolution_baselines,
        pruned=get_convolution_pruned,
    output:
        shared=table_report("shared_convolutions", "md"),
        shared_csv=layout.table("shared_convolutions", "csv"),
        shared_html=table_report("shared_convolutions", "html"),
        pca=table_report("pca_convolutions", "md"),
        pca_csv=layout.table("pca_convolutions", "csv"),
        pca_html=table_report("pca_convolutions", "html"),
    params:
        study=get_convolution_study,
        cells=get_convolution_cells,
        models=get_convolution_models,
    log:
        "logs/convolution_tables/convolution_tables.log",
    benchmark:
        "benchmarks/convolution_tables/convolution_tables.tsv",
    conda:
        conda_env("lm_eval")
    script:
        "../workflow_scripts/convolution_tables.py"
