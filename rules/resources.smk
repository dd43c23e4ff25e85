# Where jobs run and what they ask for: conda environments (--sdm conda), GPUs, and the report's items.
from snakemake.exceptions import ResourceValidationError


# conda environments of `--sdm conda`: by where the job runs, and stack (envs/*.yaml say what each holds)
CONDA_ENVS = {
    "cpu": {"fla": "envs/fla.yaml", "lm_eval": "envs/lm_eval.yaml"},
    "cuda": {"fla": "envs/fla_cuda.yaml", "lm_eval": "envs/lm_eval_cuda.yaml"},
}


#: The tables of results/tables/ in the Snakemake report: name -> its label (the caption is report/<name>.rst); the
#: studies' tables are their modules' (rules/studies.smk).
TABLES = {
    "comparison": "pruned vs. baseline (Tables 20, 21)",
    "rank_utilization": "rank utilization (Table 5)",
    "conditioning": "[Q; K] conditioning (Table 6)",
    "overlap": "kept-channel overlap (App. C.2)",
}


def table_report(name, ext):
    """results/tables/<name>.<ext> (md or html) as an item of the report's Tables category."""
    return report(layout.table(name, ext), caption=f"../report/{name}.rst", category="Tables",
                  labels={"table": TABLES[name], "format": {"md": "Markdown", "html": "HTML"}[ext]})


def conda_env(stack, device=None):
    """The ``conda:`` of a rule on ``stack`` (fla or lm_eval): the CUDA environment for jobs of models with
    ``device: cuda`` (or every job, with ``device="cuda"``), the CPU one otherwise; config ``conda_envs`` overrides
    either with an env file (relative to the working directory), an env folder or an existing env's name."""

    def choose(wildcards):
        where = device or (MODELS[wildcards.model]["device"] if "model" in wildcards.keys() else "cpu")
        spec = CFG.get("conda_envs", {}).get(where, {}).get(stack)
        if spec is None:
            return str(Path(workflow.basedir) / CONDA_ENVS[where][stack])
        if spec.endswith((".yaml", ".yml")) or os.path.isdir(spec):
            return str(Path(spec).resolve())
        return spec

    return choose


def runs_here():
    """Whether this Snakemake runs the jobs itself (its local executor, dry runs of it included), as opposed to
    submitting them (SLURM), touching outputs, or being a job's own process."""
    if workflow.executor_plugin is None or workflow.touch or workflow.exec_mode != ExecMode.DEFAULT:
        return False
    if CLI is None:  # the Python API: a dry run is judged by the dry-run executor
        return workflow.local_exec
    from snakemake_interface_executor_plugins.registry import ExecutorPluginRegistry

    return ExecutorPluginRegistry().get_plugin(CLI.executor or "local").common_settings.local_exec


def gpu_request(n, rulename, wildcards):
    """The ``gpu`` resource of a job that needs ``n`` GPUs.

    Run on this machine, Snakemake would cut a job's request down to the run's ``--resources gpu=N`` (0 included)
    and start it anyway, and without that option it starts every GPU job at once. So here a job that needs more GPUs
    than the run was granted stops the run before any job starts (the ``onstart`` below; a dry run stops where it
    lists the job). Jobs submitted by an executor plugin (SLURM) pass their request on: the plugin asks for that many
    GPUs."""
    granted = workflow.global_resources.get("gpu").value or 0
    if n and granted < n and runs_here():
        where = ", ".join(f"{k}={v}" for k, v in wildcards.items())
        raise ResourceValidationError(
            f"rule {rulename} ({where}) needs {n} GPU{'s' if n > 1 else ''} and this run was granted {granted}: "
            "give it the machine's GPUs with --resources gpu=N (at most N GPU jobs then run at once), or run it "
            "under --profile profiles/slurm"
        )
    return n


def gpu_of(wildcards, rulename):
    """GPU rules ask for one GPU for models configured with ``device: cuda`` (:func:`gpu_request`)."""
    return gpu_request(1 if MODELS[wildcards.model]["device"] == "cuda" else 0, rulename, wildcards)


def budget_values_gpu(wildcards, rulename):
    """Rule budget_values loads the model only for the sensitivity policy: one GPU then, for models on CUDA."""
    from statereduce.selectors import parse_method

    policy = srconfig.model_budget(CFG, parse_method(wildcards.method).budget).policy
    cuda = policy == "sensitivity" and MODELS[wildcards.model]["device"] == "cuda"
    return gpu_request(1 if cuda else 0, rulename, wildcards)


def one_gpu(wildcards, rulename):
    """Rules that always run on CUDA (speed) ask for one GPU (:func:`gpu_request`)."""
    return gpu_request(1, rulename, wildcards)


onstart:
    # Snakemake evaluates a job's resources when the job is next to start; evaluating those of every planned job here
    # makes a GPU job without a granted GPU (gpu_request) stop the run before its first job. A dry run meets the
    # same error while it lists the jobs.
    for _job in workflow.dag.needrun_jobs():
        _job.resources
