rule rft:
    """Recovery fine-tuning of a pruned checkpoint (LoRA + distillation from the unpruned model, paper App. A),
    LoRA merged into a plain HF checkpoint, then evaluated with lm-eval in the same process (rft/eval.json).
    A killed job resumes from results/{model}/{method}_{pct}/.rft_resume/ when rerun with the same inputs."""
    input:
        unpack(get_rft_inputs),
    output:
        config=f"{layout.RFT}/config.json",
        weights=f"{layout.RFT}/model.safetensors",
        record=f"{layout.RFT}/rft_record.json",
        train_log=f"{layout.RFT}/train_log.jsonl",
        eval=f"{layout.RFT}/eval.json",
    params:
        info=model_info,
        rft=get_rft,
        corpus=get_rft_corpus,
        eval=get_eval,
        resume=layout.RFT_RESUME,
    threads: model_threads
    resources:
        gpu=get_rft_gpus,
    log:
        "logs/rft/{model}/{method}_{pct}.log",
    benchmark:
        "benchmarks/rft/{model}/{method}_{pct}.tsv"
    conda:
        conda_env("lm_eval")
    script:
        "../workflow_scripts/rft.py"
