rule pretrain:
    """Train an embedded tiny model (byte-level tokenizer) into an HF checkpoint folder."""
    output:
        marker=f"{layout.BASE}/pretrain.json",
        config=f"{layout.BASE}/config.json",
    wildcard_constraints:
        model=models_made_by("pretrain"),
    params:
        family=get_family,
        pretrain=get_pretrain,
        corpus=get_pretrain_corpus,
    threads: pretrain_threads
    log:
        "logs/pretrain/{model}.log",
    benchmark:
        "benchmarks/pretrain/{model}.tsv"
    conda:
        conda_env("fla")
    script:
        "../workflow_scripts/pretrain.py"


rule base_source:
    """Record which hub (or local) checkpoint a model is: a small source.json, never a copy of the weights (a local
    checkpoint's files are inputs, and source.json records their SHA-256)."""
    input:
        checkpoint=get_checkpoint_files,
    output:
        f"{layout.BASE}/source.json",
    params:
        source=get_source,
        family=get_family,
    log:
        "logs/base_source/{model}.log",
    benchmark:
        "benchmarks/base_source/{model}.tsv",
    conda:
        conda_env("fla")
    script:
        "../workflow_scripts/base_source.py"


rule init_random:
    """An untrained checkpoint of a model's `init.arch` shape (random weights, byte-level tokenizer): what every stage
    costs at a hub model's size where nothing can be downloaded."""
    output:
        marker=f"{layout.BASE}/init.json",
        config=f"{layout.BASE}/config.json",
        weights=f"{layout.BASE}/model.safetensors",
    wildcard_constraints:
        model=models_made_by("init"),
    params:
        family=get_family,
        init=get_init,
        info=model_info,
    threads: model_threads
    resources:
        gpu=gpu_of,
    log:
        "logs/init_random/{model}.log",
    benchmark:
        "benchmarks/init_random/{model}.tsv"
    conda:
        conda_env("fla")
    script:
        "../workflow_scripts/init_random.py"
