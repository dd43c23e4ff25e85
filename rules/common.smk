# Config validation, wildcard constraints and every input function (the command line's checks: cli.smk; conda
# environments, GPU resources and report items: resources.smk). Stage files hold only rules.
import importlib.util
import os
import re
import sys
from pathlib import Path

# The package next to this Snakefile wins over an installed copy, here and in every job's script (conda envs
# included, which do not install the package).
sys.path.insert(0, workflow.basedir)
if workflow.basedir not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [workflow.basedir, os.environ.get("PYTHONPATH")]))

from snakemake.exceptions import WorkflowError
from snakemake_interface_executor_plugins.settings import ExecMode

from statereduce import config as srconfig
from statereduce import studies as srstudies
from statereduce.common import layout
from statereduce.selectors import METHOD_REGEX, method_regex, parse_method
from statereduce.stages.select import selector_code_files
from statereduce.common.settings import HubSettings

# --configfile takes every path up to the next option: a path under results/ among them was meant as a target. An
# existing one would be read as config here (a missing one stops Snakemake before it reads this file). One line.
_configfiles = [str(f) if os.path.relpath(f).startswith(os.pardir) else os.path.relpath(f)
                for f in workflow.overwrite_configfiles or ()]
_taken = [f for f in _configfiles if Path(f).parts[:1] == (layout.RESULTS,)]
if _taken:
    raise WorkflowError(
        f"--configfile read {' '.join(_taken)} as config (it takes every path up to the next option): put the "
        f"targets first, snakemake {' '.join(_taken)} --configfile "
        f"{' '.join(f for f in _configfiles if f not in _taken)} ..., or after --"
    )

try:
    CFG = srconfig.validate_config(config)
    STUDIES = srstudies.check_studies(CFG)  # study -> [(model, method, pct)]; empty without a `studies` block
except srconfig.ConfigError as e:
    raise WorkflowError(str(e)) from None

MODELS = CFG["models"]
TARGETS = CFG["targets"]


#: method tokens without / with +<fit>: rule prune makes the former's checkpoints, rule prune_fit the latter's
METHOD_PLAIN_REGEX = method_regex(fit=False)
METHOD_FIT_REGEX = method_regex(fit=True)
#: the compensation's code (statereduce/core/fit.py), an input of rule fit, found without importing it (torch)
FIT_CODE = importlib.util.find_spec("statereduce.core.fit").origin


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
    statereduce.core.checkpoints.checkpoint_files): inputs of base_source and of every job that loads the base model, so
    that new weights rerun them and everything downstream. Empty for hub models and models the workflow makes."""
    from statereduce.core.checkpoints import checkpoint_files

    local = MODELS[wildcards.model].get("local")
    return [str(p) for p in checkpoint_files(local)] if local else []


def get_calibration(wildcards):
    return srconfig.model_calibration(CFG, wildcards.model, wildcards.calib).to_dict()


def get_grad_settings(wildcards):
    return CFG.get("selectors", {}).get("grad", {})


def get_corpus_spec(name):
    """The corpus spec ``corpora.<name>`` with a ``files`` corpus's paths under the workflow directory
    (:func:`statereduce.config.corpus_spec`): a missing file fails when the jobs are planned."""
    try:
        return srconfig.corpus_spec(CFG, name, workflow.basedir)
    except srconfig.ConfigError as e:
        raise WorkflowError(str(e)) from None


def get_calib_corpus(wildcards):
    return get_corpus_spec(srconfig.model_calibration(CFG, wildcards.model, wildcards.calib).corpus)


def get_pretrain(wildcards):
    p = MODELS[wildcards.model].get("pretrain")
    if p is None:
        raise WorkflowError(f"model {wildcards.model!r} is not trained by the workflow (it has no pretrain block)")
    return p


def pretrain_threads(wildcards):
    """``threads`` of a pretrain job: ``pretrain.train.threads`` (statereduce.common.settings.TrainSettings)."""
    get_pretrain(wildcards)  # one line for a model without a pretrain block
    return srconfig.model_pretrain(CFG, wildcards.model).train.threads


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
        hub = HubSettings.from_dict(m["hub"])
        return {"hub_id": hub.id, "revision": hub.revision, "dtype": m["dtype"]}
    if m.get("local"):
        return {"hub_id": str(Path(m["local"]).expanduser().resolve()), "revision": None, "dtype": m["dtype"]}
    raise WorkflowError(f"model {wildcards.model!r} has no checkpoint: set models.{wildcards.model}.local (or hub)")


def here_relative(path):
    """``path`` relative to the working directory when it lies under it (the package of a clone), else as given: a
    job's input paths are part of what Snakemake records, so a project folder moved or copied elsewhere keeps its
    results."""
    rel = os.path.relpath(path)
    return path if rel.startswith(os.pardir) else rel


@checked
def get_select_inputs(wildcards):
    srconfig.check_method(CFG, wildcards.method)
    srconfig.check_reduction(CFG, wildcards.model, float(wildcards.pct), wildcards.method)
    spec = parse_method(wildcards.method)
    from statereduce.stages.select import cut_code_files, cut_needs
    if spec.fit is not None:
        raise WorkflowError(f"method {wildcards.method!r} re-fits the selection of {layout.selection_token(wildcards.method)!r}: "
                            f"it has no selection file of its own")

    needs = cut_needs(wildcards.method)
    inputs = {"weights": layout.path(layout.QK_WEIGHTS, model=wildcards.model),
              "code": [here_relative(f) for f in cut_code_files(wildcards.method)]}
    if needs & {"activations", "xnorm"}:
        inputs["activations"] = layout.path(layout.ACTIVATIONS, model=wildcards.model, calib=spec.calib)
    if "grad" in needs:
        inputs["grads"] = layout.path(layout.GRAD_SCORES, model=wildcards.model, calib=spec.calib)
    if spec.budget is not None:
        srconfig.check_budget_cell(CFG, wildcards.model, wildcards.method, float(wildcards.pct))
        budget_file = layout.SPLIT if spec.cut == "joint" else layout.ALLOCATION
        inputs["allocation"] = layout.path(budget_file, model=wildcards.model, method=wildcards.method,
                                           pct=wildcards.pct)
    return inputs


@checked
def get_split_inputs(wildcards):
    """Rule split (a joint cut with @<budget>, policy split): what the joint cut's selection reads, its code, and the
    base model whose calibration loss ranks the candidate splits."""
    spec, budget = _budget_spec(wildcards)
    if spec.cut != "joint":
        raise WorkflowError(f"method {wildcards.method!r} is not a joint cut (-kv): it has no split")
    inputs = get_select_inputs(wildcards)
    del inputs["allocation"]
    inputs["base"] = get_base(wildcards)
    inputs["checkpoint"] = get_checkpoint_files(wildcards)
    return inputs


def _budget_spec(wildcards):
    """The method token's parsed spec and its budget's settings (a method without @<budget> has none)."""
    srconfig.check_method(CFG, wildcards.method)
    spec = parse_method(wildcards.method)
    if spec.budget is None:
        raise WorkflowError(f"method {wildcards.method!r} has no @<budget>: it has no allocation")
    return spec, srconfig.model_budget(CFG, spec.budget)


@checked
def get_budget_values_inputs(wildcards):
    """Rule budget_values (a measured policy: greedy or sensitivity): the q/k weights (head sizes, layers), the
    selector's own inputs and code (both policies run it), for sensitivity the model."""
    from statereduce.stages.allocate import MEASURED
    from statereduce.core.budgets import check_budget_selector, policy_needs

    spec, budget = _budget_spec(wildcards)
    if budget.policy not in MEASURED:
        raise WorkflowError(f"method {wildcards.method!r}: budgets.{spec.budget} (policy {budget.policy}) has no "
                            f"measured values; measured policies: {', '.join(MEASURED)}")
    try:
        check_budget_selector(budget, spec.selector)
    except ValueError as e:
        raise WorkflowError(f"method {wildcards.method!r} (budgets.{spec.budget}): {e}") from None
    needs = policy_needs(budget, spec.selector)
    inputs = {"weights": layout.path(layout.QK_WEIGHTS, model=wildcards.model)}
    inputs["code"] = [here_relative(f) for f in selector_code_files(spec.selector)]  # both policies run the selector
    if needs & {"activations", "xnorm"}:
        inputs["activations"] = layout.path(layout.ACTIVATIONS, model=wildcards.model, calib=spec.calib)
    if "grad" in needs:
        inputs["grads"] = layout.path(layout.GRAD_SCORES, model=wildcards.model, calib=spec.calib)
    if budget.policy == "sensitivity":
        inputs["base"] = get_base(wildcards)
        inputs["checkpoint"] = get_checkpoint_files(wildcards)
    return inputs


@checked
def get_allocate_inputs(wildcards):
    """Rule allocate: the q/k weights (head sizes, layers) and what the budget's policy reads: the calibration
    activations for spectrum, the measured values (rule budget_values, one file for every pct) for greedy and
    sensitivity."""
    from statereduce.stages.allocate import MEASURED

    spec, budget = _budget_spec(wildcards)
    srconfig.check_budget_cell(CFG, wildcards.model, wildcards.method, float(wildcards.pct))
    inputs = {"weights": layout.path(layout.QK_WEIGHTS, model=wildcards.model)}
    if budget.policy == "spectrum":
        inputs["activations"] = layout.path(layout.ACTIVATIONS, model=wildcards.model, calib=spec.calib)
    elif budget.policy in MEASURED:
        inputs["values"] = layout.path(layout.BUDGET_VALUES, model=wildcards.model, method=wildcards.method)
    return inputs


def get_budget(wildcards):
    """The method token's budget plan (config.model_budget_plan), with the sensitivity calibration's corpus spec."""
    plan = srconfig.model_budget_plan(CFG, wildcards.model, wildcards.method)
    if plan.calibration is not None:
        plan = plan.replace(corpus=get_corpus_spec(plan.calibration.corpus))
    return plan.to_dict()


def get_selector_options(wildcards):
    """The selector's own options from ``selectors.<name>`` (other keys there belong to other rules)."""
    from statereduce.selectors import get_selector

    spec = parse_method(wildcards.method)
    block = CFG.get("selectors", {}).get(spec.selector, {})
    opts = {k: v for k, v in block.items() if k in get_selector(spec.selector).options}
    return {"options": opts, "seed": block.get("seed", 0)}


def get_eval(wildcards):
    """The model's eval settings (suites expanded, the heldout corpus resolved) as the jobs' params. Snakemake reruns
    a job whose params' repr changed, so the keys keep the order finished runs recorded: a recall_probe block that
    the suite expansion filled in (none in the model's eval block) comes after the suites' additions, and
    corpus_spec last."""
    ev = srconfig.model_eval(CFG, wildcards.model)
    if "heldout" in ev.tasks:
        ev = ev.replace(corpus_spec=get_corpus_spec(srconfig.model_eval_corpus(CFG, wildcards.model)))
    params = ev.to_dict()
    if "recall_probe" in params and "recall_probe" not in MODELS[wildcards.model].get("eval", {}):
        params["recall_probe"] = params.pop("recall_probe")
        if "corpus_spec" in params:
            params["corpus_spec"] = params.pop("corpus_spec")
    return params


def model_info(wildcards):
    m = MODELS[wildcards.model]
    return {"model": wildcards.model, "family": m["family"], "dtype": m["dtype"], "device": m["device"]}


def model_threads(wildcards):
    """``threads`` of a job that loads or reads the model: ``models.<name>.threads`` (settings.DEFAULT_THREADS: 1 on
    CPU, 4 on CUDA). The job's script gives torch that many threads; the SLURM plugin asks for that many CPUs."""
    return MODELS[wildcards.model]["threads"]


def get_rft(wildcards):
    """The model's RFT plan (config.model_rft): activate, corpus, gpus, settings."""
    return srconfig.model_rft(CFG, wildcards.model).to_dict()


def rft_active(model):
    return bool(srconfig.model_rft(CFG, model).activate)


def get_rft_corpus(wildcards):
    return get_corpus_spec(srconfig.model_rft(CFG, wildcards.model).corpus)


def get_rft_gpus(wildcards, rulename):
    """The rft job's GPUs: ``rft.gpus`` for models on CUDA, none on CPU (:func:`gpu_request`)."""
    n = int(srconfig.model_rft(CFG, wildcards.model).gpus) if MODELS[wildcards.model]["device"] == "cuda" else 0
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
        inputs["rft_record"] = f"{stage}/rft/rft_record.json"
    return inputs


def get_fit_selection(wildcards):
    """The selection file of a method (of the token without +<fit>, for a fitted method)."""
    return layout.path(layout.SELECTION, model=wildcards.model, method=layout.selection_token(wildcards.method),
                       pct=wildcards.pct)


@checked
def get_fit_inputs(wildcards):
    """Rule fit: the base model, the selection of the token without +<fit>, and the fit's code."""
    srconfig.check_method(CFG, wildcards.method)
    srconfig.check_reduction(CFG, wildcards.model, float(wildcards.pct), layout.selection_token(wildcards.method))
    return {"base": get_base(wildcards), "checkpoint": get_checkpoint_files(wildcards),
            "selection": get_fit_selection(wildcards), "code": [here_relative(FIT_CODE)]}


def get_fit(wildcards):
    """The method token's fit plan (config.model_fit_plan), with its calibration's corpus spec."""
    plan = srconfig.model_fit_plan(CFG, wildcards.model, wildcards.method)
    return plan.replace(corpus=get_corpus_spec(plan.calibration.corpus)).to_dict()


def get_prune(wildcards):
    """Pruning settings of the model (config.model_prune)."""
    return srconfig.model_prune(CFG, wildcards.model).to_dict()


def get_rank(wildcards):
    """Rank-analysis settings of the model (config.model_rank) with the corpus spec resolved."""
    settings = srconfig.model_rank(CFG, wildcards.model)
    return settings.replace(corpus_spec=get_corpus_spec(settings.corpus)).to_dict()


def get_rank_inputs(wildcards):
    spec = parse_method(wildcards.method)
    stage = layout.path(layout.STAGE, model=wildcards.model, method=wildcards.method, pct=wildcards.pct)
    return {"pruned": f"{stage}/pruned/config.json", "baseline": layout.path(layout.BASELINE_RANK, model=wildcards.model),
            "selection": get_fit_selection(wildcards),
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
    if hasattr(wildcards, "method") and parse_method(wildcards.method).cut != "keys":
        raise WorkflowError(f"results/{wildcards.model}/{wildcards.method}_{wildcards.pct}/speed.json: rule speed times "
                            "key cuts; time value and joint cuts with the decode benchmark's --head-shape "
                            "(docs/speed.md)")
    plan = srconfig.model_speed(CFG, wildcards.model).to_dict()
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


def get_export_inputs(wildcards):
    """What rule export reads: the checkpoint of its stage, the base artifact's marker (the card's base model), and
    the eval.json of the base, the pruned model and (for an RFT export) the fine-tuned one."""
    stage = layout.path(layout.STAGE, model=wildcards.model, method=wildcards.method, pct=wildcards.pct)
    if wildcards.stage == "rft" and not rft_active(wildcards.model):
        raise WorkflowError(f"RFT is off for model {wildcards.model!r} (rft.activate: false): export its pruned "
                            f"checkpoint instead, {stage}/export/pruned/README.md")
    folder = f"{stage}/{wildcards.stage}"
    inputs = {"config": f"{folder}/config.json", "weights": f"{folder}/model.safetensors",
              "record": f"{folder}/prune_record.json", "source": get_base(wildcards),
              "base": layout.path(layout.BASELINE_EVAL, model=wildcards.model), "pruned": f"{stage}/pruned/eval.json"}
    if wildcards.stage == "rft":
        inputs["rft"] = f"{folder}/eval.json"
    return inputs


def get_export_calibration(wildcards):
    """The calibration settings of the method's selection (the model card names them)."""
    calib = layout.parse_token(wildcards.method).calib or layout.DEFAULT_CALIB
    return srconfig.model_calibration(CFG, wildcards.model, calib).to_dict()


def get_export_command(wildcards, output):
    """The command that makes this export (the model card records it): the target and the config files given."""
    files = [str(f) for f in getattr(workflow.config_settings, "configfiles", [])]
    return " ".join(["snakemake --cores all", *(f"--configfile {f}" for f in files), str(output.card)])
