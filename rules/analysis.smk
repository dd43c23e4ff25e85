rule rank_baseline:
    """Rank utilization of the unpruned model's recurrent states over held-out sequences, and the conditioning of
    all its [Q; K] calibration columns (paper Sec. 2.2, App. C.1, Table 6's baseline row)."""
    input:
        base=get_base,
        activations="results/{model}/calib/default/activations.h5",
    output:
        "results/{model}/baseline/rank.json",
    params:
        info=model_info,
        rank=get_rank,
    resources:
        gpu=gpu_of,
    log:
        "logs/rank_baseline/{model}.log",
    benchmark:
        "benchmarks/rank_baseline/{model}.tsv"
    conda:
        "../envs/fla.yaml"
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
    resources:
        gpu=gpu_of,
    log:
        "logs/rank/{model}/{method}_{pct}.log",
    benchmark:
        "benchmarks/rank/{model}/{method}_{pct}.tsv"
    conda:
        "../envs/fla.yaml"
    script:
        "../workflow_scripts/rank.py"


rule rank_tables:
    """Tables 5 and 6 and the selectors' kept-channel overlap (App. C.2) for every targeted (model, method, pct)."""
    input:
        ranks=get_target_ranks,
        baselines=get_baseline_ranks,
        selections=get_target_selections,
    output:
        utilization="results/tables/rank_utilization.md",
        conditioning="results/tables/conditioning.md",
        overlap="results/tables/overlap.md",
    log:
        "logs/rank_tables/rank_tables.log",
    conda:
        "../envs/lm_eval.yaml"
    script:
        "../workflow_scripts/rank_tables.py"
