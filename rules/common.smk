# Config validation, wildcard constraints and every input function. Stage files hold only rules.
import contextlib
import io
import os
import re
import sys
from pathlib import Path

# The package next to this Snakefile wins over an installed copy, here and in every job's script (conda envs
# included, which do not install the package).
sys.path.insert(0, workflow.basedir)
if workflow.basedir not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [workflow.basedir, os.environ.get("PYTHONPATH")]))

from snakemake.exceptions import ResourceValidationError, WorkflowError
from snakemake_interface_executor_plugins.settings import ExecMode

from statereduce import config as srconfig
from statereduce import layout
from statereduce.selectors import METHOD_REGEX, parse_method
from statereduce.select import selector_code_files

try:
    CFG = srconfig.validate_config(config)
except srconfig.ConfigError as e:
    raise WorkflowError(str(e)) from None

MODELS = CFG["models"]
TARGETS = CFG["targets"]
STUDIES = srconfig.check_studies(CFG)  # study -> [(model, method, pct)]; empty without a `studies` block


def command_line():
    """Snakemake's own reading of the ``snakemake`` command line (targets, executor, profiles applied), or None when
    Snakemake was started otherwise (its Python API, a job's own process).

    Snakemake 9 reads this Snakefile before it hands the targets to the workflow (``workflow.dag_settings`` is still
    unset here, an ``onstart`` handler runs only in real runs and after the jobs are planned, and a target that names
    an unknown model matches no rule, so no input function sees it), and a dry run plans with the local dry-run
    executor whatever ``--executor`` says. So both come from ``sys.argv``, through ``snakemake.cli.parse_args``: the
    function ``snakemake`` itself parsed it with before it read this file, which gives the same result for any order
    of options and targets that Snakemake accepts. (An option of several values, such as ``--resources``,
    ``--forcerun`` or ``--until``, takes every word up to the next option: a target right after it is read as one of
    its values by Snakemake itself, or stops Snakemake before it reads this file. Targets go first.)"""
    prog = Path(sys.argv[0])
    if prog.name != "snakemake" and prog.parts[-2:] != ("snakemake", "__main__.py"):
        return None
    try:
        from snakemake.cli import parse_args

        with contextlib.redirect_stderr(io.StringIO()):  # its "Using profile ..." line, printed once already
            args = parse_args(sys.argv[1:])[1]
    except (Exception, SystemExit):
        return None
    return args if args.mode == ExecMode.DEFAULT else None


CLI = command_line()

# A requested path under results/ naming an unknown model, selector or calibration, or an impossible pct, fails here
# in one line with the valid choices (Snakemake alone would answer only "No rule to produce ...").
for _target in sorted(CLI.targets) if CLI else []:
    try:
        srconfig.check_target(CFG, os.path.relpath(_target) if os.path.isabs(_target) else _target)
    except srconfig.ConfigError as e:
        raise WorkflowError(str(e)) from None

# With no target, a list of rule names and paths after --forcerun, --until, --omit-from or --prioritize means that the
# option took the targets: Snakemake would build the default target instead (`-R select_channels <target>` plans every
# selection and all that depends on them) or stop with "BUG: Out of jobs ready" (`--until`). One line instead.
for _option, _values in (("--forcerun", CLI.forcerun), ("--until", CLI.until), ("--omit-from", CLI.omit_from),
                         ("--prioritize", CLI.prioritize)) if CLI and not CLI.targets else []:
    _paths, _rules = sorted(v for v in _values or () if "/" in v), sorted(v for v in _values or () if "/" not in v)
    if _paths and _rules:
        raise WorkflowError(
            f"no target was given: {_option} read {' '.join(_paths)} as its own values (it takes every word up to "
            f"the next option); put the targets first: snakemake {' '.join(_paths)} {_option} {' '.join(_rules)} ..."
        )


wildcard_constraints:
    model="|".join(re.escape(m) for m in MODELS),
    method=METHOD_REGEX,
    pct=layout.PCT_RE,
    calib=r"[a-z0-9]+",


def checked(fn):
    """Turn configuration errors raised in input functions into one-line workflow errors."""

    def wrapper(wildcards):
        try:
            return fn(wildcards)
        except ValueError as e:
            raise WorkflowError(str(e)) from None

    return wrapper


def _targets():
    """(model, method, pct as in paths) of every targeted combination."""
    return [(m, method, layout.format_pct(pct)) for m in TARGETS["models"] for method in TARGETS["methods"]
            for pct in TARGETS["pcts"]]


def target_summaries():
    """The summary of every targeted (model, method, pct)."""
    return [layout.path(layout.SUMMARY, model=m, method=method, pct=pct) for m, method, pct in _targets()]


def get_final_output():
    return [layout.table("comparison", "md"), *get_baselines(None), *target_summaries()]


def base_marker(model):
    """The file that marks a finished base artifact of ``model``."""
    m = MODELS[model]
    kind = "pretrain.json" if "pretrain" in m else "init.json" if "init" in m else "source.json"
    return layout.path(f"{layout.BASE}/{kind}", model=model)


def models_made_by(kind):
    """A wildcard regex of the models whose base artifact the rule for ``kind`` ("pretrain", "init") makes: pretrain and
    init_random both write results/{model}/base/config.json, and each may claim only its own models (a regex that
    matches nothing where none are configured)."""
    names = [m for m in MODELS if kind in MODELS[m]]
    return "|".join(re.escape(m) for m in names) or "(?!)"


def get_base(wildcards):
    return base_marker(wildcards.model)


def get_checkpoint_files(wildcards):
    """The files of a ``local`` model's checkpoint that loading reads (config, weights, tokenizer:
    statereduce.checkpoints.checkpoint_files): inputs of base_source and of every job that loads the base model, so
    that new weights rerun them and everything downstream. Empty for hub models and models the workflow makes."""
    from statereduce.checkpoints import checkpoint_files

    local = MODELS[wildcards.model].get("local")
    return [str(p) for p in checkpoint_files(local)] if local else []


# conda environments of `--sdm conda`: by where the job runs, and stack (envs/*.yaml say what each holds)
CONDA_ENVS = {
    "cpu": {"fla": "envs/fla.yaml", "lm_eval": "envs/lm_eval.yaml"},
    "cuda": {"fla": "envs/fla_cuda.yaml", "lm_eval": "envs/lm_eval_cuda.yaml"},
}


#: The tables of results/tables/ in the Snakemake report: name -> its label (the caption is report/<name>.rst).
TABLES = {
    "comparison": "pruned vs. baseline (Tables 20, 21)",
    "rank_utilization": "rank utilization (Table 5)",
    "conditioning": "[Q; K] conditioning (Table 6)",
    "overlap": "kept-channel overlap (App. C.2)",
    "calibration_study": "calibration sensitivity (Tables 2, 7)",
    "scoring_ablation": "K / Q / K+Q scoring (Table 16)",
    "shared_convolutions": "shared convolutions (Table 14)",
    "pca_convolutions": "PCA and convolutions (Table 15)",
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


def one_gpu(wildcards, rulename):
    """Rules that always run on CUDA (speed) ask for one GPU (:func:`gpu_request`)."""
    return gpu_request(1, rulename, wildcards)


onstart:
    # Snakemake evaluates a job's resources when the job is next to start; evaluating those of every planned job here
    # makes a GPU job without a granted GPU (gpu_request) stop the run before its first job. A dry run meets the
    # same error while it lists the jobs.
    for _job in workflow.dag.needrun_jobs():
        _job.resources


def get_calibration(wildcards):
    return srconfig.model_calibration(CFG, wildcards.model, wildcards.calib)


def get_grad_settings(wildcards):
    return CFG.get("selectors", {}).get("grad", {})


def get_corpus_spec(name):
    """The corpus spec ``corpora.<name>``. A ``files`` corpus's relative paths (under ``paths`` or ``splits``)
    become paths under the workflow directory, so jobs read the same files whatever their working directory,
    and a missing file fails when the jobs are planned, not when one of them runs."""
    spec = dict(CFG["corpora"][name])
    if spec["source"] != "files":
        return spec  # a files corpus has exactly one of paths and splits (validate_config)

    def resolve(where, paths):
        out = []
        for p in [paths] if isinstance(paths, str) else paths:
            path = Path(workflow.basedir, Path(p).expanduser())  # an absolute path stays as it is
            if not path.is_file():
                raise WorkflowError(f"corpora.{name}.{where}: corpus file {str(path)!r} does not exist")
            out.append(str(path))
        return out

    if "paths" in spec:
        spec["paths"] = resolve("paths", spec["paths"])
    else:
        spec["splits"] = {split: resolve(f"splits.{split}", paths) for split, paths in spec["splits"].items()}
    return spec


def get_calib_corpus(wildcards):
    return get_corpus_spec(get_calibration(wildcards)["corpus"])


def get_pretrain(wildcards):
    p = MODELS[wildcards.model].get("pretrain")
    if p is None:
        raise WorkflowError(f"model {wildcards.model!r} is not trained by the workflow (it has no pretrain block)")
    return p


def pretrain_threads(wildcards):
    """``threads`` of a pretrain job: ``pretrain.train.threads`` (default 1)."""
    return get_pretrain(wildcards)["train"].get("threads", 1)


def get_init(wildcards):
    """The ``init`` block (arch, seed) of a model of random weights (rule init_random)."""
    return MODELS[wildcards.model]["init"]


def get_family(wildcards):
    return MODELS[wildcards.model]["family"]


def get_pretrain_corpus(wildcards):
    return get_corpus_spec(get_pretrain(wildcards)["corpus"])


def get_source(wildcards):
    m = MODELS[wildcards.model]
    if "hub" in m:
        return {"hub_id": m["hub"]["id"], "revision": m["hub"].get("revision", "main"), "dtype": m["dtype"]}
    if m.get("local"):
        return {"hub_id": str(Path(m["local"]).expanduser().resolve()), "revision": None, "dtype": m["dtype"]}
    raise WorkflowError(f"model {wildcards.model!r} has no checkpoint: set models.{wildcards.model}.local (or hub)")


@checked
def get_select_inputs(wildcards):
    srconfig.check_method(CFG, wildcards.method)
    srconfig.check_reduction(CFG, wildcards.model, float(wildcards.pct))
    spec = parse_method(wildcards.method)
    from statereduce.selectors import get_selector

    needs = set(get_selector(spec.selector).needs)
    inputs = {"weights": layout.path(layout.QK_WEIGHTS, model=wildcards.model), "code": selector_code_files(spec.selector)}
    if needs & {"activations", "xnorm"}:
        inputs["activations"] = layout.path(layout.ACTIVATIONS, model=wildcards.model, calib=spec.calib)
    if "grad" in needs:
        inputs["grads"] = layout.path(layout.GRAD_SCORES, model=wildcards.model, calib=spec.calib)
    return inputs


def get_selector_options(wildcards):
    """The selector's own options from ``selectors.<name>`` (other keys there belong to other rules)."""
    from statereduce.selectors import get_selector

    spec = parse_method(wildcards.method)
    block = CFG.get("selectors", {}).get(spec.selector, {})
    opts = {k: v for k, v in block.items() if k in get_selector(spec.selector).options}
    return {"options": opts, "seed": block.get("seed", 0)}


def get_eval(wildcards):
    ev = srconfig.model_eval(CFG, wildcards.model)
    if "heldout" in ev["tasks"]:
        ev["corpus_spec"] = get_corpus_spec(srconfig.model_eval_corpus(CFG, wildcards.model))
    return ev


def model_info(wildcards):
    m = MODELS[wildcards.model]
    return {"model": wildcards.model, "family": m["family"], "dtype": m["dtype"], "device": m["device"]}


def model_threads(wildcards):
    """``threads`` of a job that loads or reads the model: ``models.<name>.threads`` (config.DEFAULT_THREADS: 1 on
    CPU, 4 on CUDA). The job's script gives torch that many threads; the SLURM plugin asks for that many CPUs."""
    return MODELS[wildcards.model]["threads"]


def get_rft(wildcards):
    """The model's RFT plan (config.model_rft): activate, corpus, gpus, settings."""
    return srconfig.model_rft(CFG, wildcards.model)


def rft_active(model):
    return bool(srconfig.model_rft(CFG, model)["activate"])


def get_rft_corpus(wildcards):
    return get_corpus_spec(get_rft(wildcards)["corpus"])


def get_rft_gpus(wildcards, rulename):
    """The rft job's GPUs: ``rft.gpus`` for models on CUDA, none on CPU (:func:`gpu_request`)."""
    n = int(get_rft(wildcards)["gpus"]) if MODELS[wildcards.model]["device"] == "cuda" else 0
    return gpu_request(n, rulename, wildcards)


def get_rft_inputs(wildcards):
    if not rft_active(wildcards.model):
        raise WorkflowError(f"RFT is off for model {wildcards.model!r} (rft.activate: false); it has no rft/ artifact")
    stage = layout.path(layout.STAGE, model=wildcards.model, method=wildcards.method, pct=wildcards.pct)
    return {"base": get_base(wildcards), "checkpoint": get_checkpoint_files(wildcards),
            "pruned": f"{stage}/pruned/config.json", "record": f"{stage}/pruned/prune_record.json"}


def get_summary_inputs(wildcards):
    stage = layout.path(layout.STAGE, model=wildcards.model, method=wildcards.method, pct=wildcards.pct)
    inputs = {"baseline": layout.path(layout.BASELINE_EVAL, model=wildcards.model), "pruned": f"{stage}/pruned/eval.json",
              "record": f"{stage}/pruned/prune_record.json"}
    if rft_active(wildcards.model):
        inputs["rft"] = f"{stage}/rft/eval.json"
    return inputs


def get_rank(wildcards):
    """Rank-analysis settings of the model (config.model_rank) with the corpus spec resolved."""
    settings = srconfig.model_rank(CFG, wildcards.model)
    return {**settings, "corpus_spec": get_corpus_spec(settings["corpus"])}


def get_rank_inputs(wildcards):
    spec = parse_method(wildcards.method)
    stage = layout.path(layout.STAGE, model=wildcards.model, method=wildcards.method, pct=wildcards.pct)
    return {"pruned": f"{stage}/pruned/config.json", "baseline": layout.path(layout.BASELINE_RANK, model=wildcards.model),
            "selection": layout.path(layout.SELECTION, model=wildcards.model, method=wildcards.method, pct=wildcards.pct),
            "activations": layout.path(layout.ACTIVATIONS, model=wildcards.model, calib=spec.calib)}


def get_target_ranks(wildcards):
    return [layout.path(layout.RANK, model=m, method=method, pct=pct) for m, method, pct in _targets()]


def get_target_selections(wildcards):
    return [layout.path(layout.SELECTION, model=m, method=method, pct=pct) for m, method, pct in _targets()]


def get_baseline_ranks(wildcards):
    return [layout.path(layout.BASELINE_RANK, model=m) for m in TARGETS["models"]]


def get_figure_inputs(wildcards):
    """Rule figures: the baseline's rank.json and that of every targeted method of the model at ``pct``."""
    return {"baseline": layout.path(layout.BASELINE_RANK, model=wildcards.model),
            "ranks": [layout.path(layout.RANK, model=wildcards.model, method=method, pct=wildcards.pct) for method in TARGETS["methods"]]}


def figure_outputs():
    """The rank-analysis figures of every targeted (model, pct): utilization histograms and one head's spectrum."""
    return [layout.figure(f"{m}_{kind}_{layout.format_pct(pct)}") for m in TARGETS["models"]
            for pct in TARGETS["pcts"] for kind in ("utilization", "spectrum")]


def study_summaries():
    """The summary of every cell of the calibration and scoring studies (paper Tables 2/7 and 16), each once, in
    table order."""
    paths = [layout.path(layout.SUMMARY, model=m, method=method, pct=pct)
             for name, cells in STUDIES.items() if name != "convolutions" for m, method, pct in cells]
    return list(dict.fromkeys(paths))


def get_convolution_cells(wildcards):
    """The convolution study's cells ``[model, method, pct]``, in the order of :func:`get_convolution_pruned`."""
    return [list(cell) for cell in STUDIES.get("convolutions", [])]


def get_convolution_models(wildcards):
    """The convolution study's models, each once, in the order of :func:`get_convolution_baselines`."""
    return list(dict.fromkeys(CFG.get("studies", {}).get("convolutions", {}).get("models", {}).values()))


def get_convolution_pruned(wildcards):
    """The convolution study's cells, read before RFT (paper Table 15): each pruned model's evaluation."""
    return [layout.path(f"{layout.PRUNED}/eval.json", model=m, method=method, pct=pct)
            for m, method, pct in get_convolution_cells(wildcards)]


def get_convolution_baselines(wildcards):
    """The unpruned evaluation of every model of the convolution study (paper Table 14, Table 15's 0% row)."""
    return [layout.path(layout.BASELINE_EVAL, model=m) for m in get_convolution_models(wildcards)]


def get_convolution_study(wildcards):
    return srconfig.canonical(CFG["studies"]["convolutions"])


def get_study_summaries(wildcards):
    return study_summaries()


def get_studies(wildcards):
    """The ``studies`` block (table layout: models, selectors, variants, pct)."""
    return CFG.get("studies", {})


def get_study_calibrations(wildcards):
    """model -> calibration variant -> its settings, for the calibration study's row labels."""
    study = CFG.get("studies", {}).get("calibration")
    if not study:
        return {}
    return srconfig.canonical({m: {v: srconfig.model_calibration(CFG, m, v) for v in study["variants"]}
                               for m in study["models"]})


def study_outputs():
    """The study tables (Markdown and their HTML pages) of the studies ``studies`` names."""
    names = []
    if set(STUDIES) & {"calibration", "scoring"}:
        names += ["calibration_study", "scoring_ablation"]
    if "convolutions" in STUDIES:
        names += ["shared_convolutions", "pca_convolutions"]
    return [layout.table(name, ext) for name in names for ext in ("md", "html")]


def get_paper_output():
    """``all_paper``: the default outputs plus the rank analysis, its tables (paper Tables 5, 6, App. C.2) and
    figures (Figs. 2, 3, 5), the studies' tables (Tables 2/7, 16: their cells are ordinary summaries; Tables 14-15:
    unpruned and pre-RFT evaluations) and HTML pages of the tables for the Snakemake report."""
    tables = [layout.table(name, "md") for name in ("rank_utilization", "conditioning", "overlap")]
    pages = [layout.table(name, "html") for name in ("comparison", "rank_utilization", "conditioning", "overlap")]
    return [*get_final_output(), *tables, *figure_outputs(), *pages, *study_outputs()]


def get_summaries(wildcards):
    return target_summaries()


def get_baselines(wildcards):
    return [layout.path(layout.BASELINE_EVAL, model=m) for m in TARGETS["models"]]


# ---- speed (GPU; paper Sec. 5, App. G.1) ----------------------------------------------------------------------
SPEED_MODELS = CFG.get("speed", {}).get("models", [])


@checked
def get_speed(wildcards):
    """The model's speed plan (config.model_speed); a pruned target measures the baseline and its own pct."""
    plan = srconfig.model_speed(CFG, wildcards.model)
    pcts = [float(wildcards.pct)] if hasattr(wildcards, "pct") else plan["settings"].get("pcts")
    if pcts is not None:
        plan["settings"]["pcts"] = pcts
    return plan


def speed_outputs():
    """``all_speed``: every speed model's baseline speed.json (which holds all its ratios), the table and figure."""
    return [*[layout.path(layout.BASELINE_SPEED, model=m) for m in SPEED_MODELS], layout.table("speed", "md"),
            layout.figure("speedup")]


def get_speed_docs(wildcards):
    return [layout.path(layout.BASELINE_SPEED, model=m) for m in SPEED_MODELS]
