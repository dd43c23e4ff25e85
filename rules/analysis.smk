rule rank_baseline:
    """Rank utilization of the unpruned model's recurrent states over held-out sequences, and the conditioning of
    all its [Q; K] calibration columns (paper Sec. 2.2, App. C.1, Table 6's baseline row)."""
    input:
        base=get_base,
        checkpoint=get_checkpoint_files,
        activations="results/{model}/calib/default/activations.h5",
    output:
        "results/{model}/baseline/rank.json",
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
        "results/{model}/{method}_{pct}/rank.json",
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
    """Tables 5 and 6 and the selectors' kept-channel overlap (App. C.2) for every targeted (model, method, pct)."""
    input:
        ranks=get_target_ranks,
        baselines=get_baseline_ranks,
        selections=get_target_selections,
    output:
        utilization=report(
            "results/tables/rank_utilization.md",
            caption="../report/rank_utilization.rst",
            category="Tables",
            labels={"table": "rank utilization (Table 5)", "format": "Markdown"},
        ),
        conditioning=report(
            "results/tables/conditioning.md",
            caption="../report/conditioning.rst",
            category="Tables",
            labels={"table": "[Q; K] conditioning (Table 6)", "format": "Markdown"},
        ),
        overlap=report(
            "results/tables/overlap.md",
            caption="../report/overlap.rst",
            category="Tables",
            labels={"table": "kept-channel overlap (App. C.2)", "format": "Markdown"},
        ),
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
            "results/figures/{model}_utilization_{pct}.png",
            caption="../report/utilization.rst",
            category="Figures",
            subcategory="{model}",
            labels={"figure": "rank utilization per head (Fig. 3)", "pct": "{pct}% removed"},
        ),
        spectrum=report(
            "results/figures/{model}_spectrum_{pct}.png",
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
        calibration=report(
            "results/tables/calibration_study.md",
            caption="../report/calibration_study.rst",
            category="Tables",
            labels={"table": "calibration sensitivity (Tables 2, 7)", "format": "Markdown"},
        ),
        calibration_csv="results/tables/calibration_study.csv",
        calibration_html=report(
            "results/tables/calibration_study.html",
            caption="../report/calibration_study.rst",
            category="Tables",
            labels={"table": "calibration sensitivity (Tables 2, 7)", "format": "HTML"},
        ),
        scoring=report(
            "results/tables/scoring_ablation.md",
            caption="../report/scoring_ablation.rst",
            category="Tables",
            labels={"table": "K / Q / K+Q scoring (Table 16)", "format": "Markdown"},
        ),
        scoring_csv="results/tables/scoring_ablation.csv",
        scoring_html=report(
            "results/tables/scoring_ablation.html",
            caption="../report/scoring_ablation.rst",
            category="Tables",
            labels={"table": "K / Q / K+Q scoring (Table 16)", "format": "HTML"},
        ),
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


rule convolution_tables:
    """Shared against per-channel q/k conv filters (paper Table 14: the unpruned models) and PCA (proper,
    adversarial) against Grad on both, before RFT (Table 15), from `studies.convolutions`; with HTML pages."""
    input:
        baselines=get_convolution_baselines,
        pruned=get_convolution_pruned,
    output:
        shared=report(
            "results/tables/shared_convolutions.md",
            caption="../report/shared_convolutions.rst",
            category="Tables",
            labels={"table": "shared convolutions (Table 14)", "format": "Markdown"},
        ),
        shared_csv="results/tables/shared_convolutions.csv",
        shared_html=report(
            "results/tables/shared_convolutions.html",
            caption="../report/shared_convolutions.rst",
            category="Tables",
            labels={"table": "shared convolutions (Table 14)", "format": "HTML"},
        ),
        pca=report(
            "results/tables/pca_convolutions.md",
            caption="../report/pca_convolutions.rst",
            category="Tables",
            labels={"table": "PCA and convolutions (Table 15)", "format": "Markdown"},
        ),
        pca_csv="results/tables/pca_convolutions.csv",
        pca_html=report(
            "results/tables/pca_convolutions.html",
            caption="../report/pca_convolutions.rst",
            category="Tables",
            labels={"table": "PCA and convolutions (Table 15)", "format": "HTML"},
        ),
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


rule tables_html:
    """HTML pages of the Markdown tables: the Snakemake report shows HTML inline (Markdown only as a download)."""
    input:
        comparison="results/tables/comparison.md",
        utilization="results/tables/rank_utilization.md",
        conditioning="results/tables/conditioning.md",
        overlap="results/tables/overlap.md",
    output:
        comparison=report(
            "results/tables/comparison.html",
            caption="../report/comparison.rst",
            category="Tables",
            labels={"table": "pruned vs. baseline (Tables 20, 21)", "format": "HTML"},
        ),
        utilization=report(
            "results/tables/rank_utilization.html",
            caption="../report/rank_utilization.rst",
            category="Tables",
            labels={"table": "rank utilization (Table 5)", "format": "HTML"},
        ),
        conditioning=report(
            "results/tables/conditioning.html",
            caption="../report/conditioning.rst",
            category="Tables",
            labels={"table": "[Q; K] conditioning (Table 6)", "format": "HTML"},
        ),
        overlap=report(
            "results/tables/overlap.html",
            caption="../report/overlap.rst",
            category="Tables",
            labels={"table": "kept-channel overlap (App. C.2)", "format": "HTML"},
        ),
    log:
        "logs/tables_html/tables_html.log",
    benchmark:
        "benchmarks/tables_html/tables_html.tsv",
    conda:
        conda_env("lm_eval")
    script:
        "../workflow_scripts/tables_html.py"
