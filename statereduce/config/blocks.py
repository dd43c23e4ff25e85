"""The config's blocks, read and checked one at a time (:func:`statereduce.config.validate_config` runs them all).

``check_schema`` checks a config against ``schemas/config.schema.yaml`` (unknown keys are errors); the ``check_*``
helpers check what a schema cannot express: known families and selectors, method tokens, corpus and calibration
references, and that a (model, pct) leaves at least one channel and a representable head size. Every error is one
line naming the bad value and the valid choices.

The ``model_*`` helpers build each stage's typed settings (:mod:`statereduce.common.settings`) from the validated
config; the defaults are those classes' fields. The studies' own checks (:mod:`statereduce.studies`) build on them.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TypeVar

import yaml

from statereduce.common import layout
from statereduce.common.settings import (
    BudgetPlan,
    BudgetSettings,
    FitPlan,
    FitSettings,
    CalibrationSettings,
    EvalSettings,
    PretrainSettings,
    PruneSettings,
    RankSettings,
    RftPlan,
    Settings,
    SpeedPlan,
)
from statereduce.core.checkpoints import weight_files
from statereduce.eval.recall import RecallLevel
from statereduce.eval.suites import expand_eval
from statereduce.families import check_family, family_names, family_spec
from statereduce.families import check_share_conv as check_family_share_conv

__all__ = [
    "ConfigError",
    "SCHEMA_PATH",
    "canonical",
    "check_budget_cell",
    "check_checkpoint_family",
    "check_eval",
    "check_has_checkpoint",
    "check_local",
    "check_method",
    "check_reduction",
    "check_rft",
    "check_schema",
    "check_share_conv",
    "check_split",
    "check_target",
    "corpus_spec",
    "load_schema",
    "model_budget",
    "model_budget_plan",
    "model_calibration",
    "model_fit",
    "model_fit_plan",
    "model_dims",
    "model_eval",
    "model_eval_corpus",
    "model_mixer_layers",
    "model_pretrain",
    "model_prune",
    "model_rank",
    "model_rft",
    "model_speed",
]

S = TypeVar("S", bound=Settings)

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "schemas" / "config.schema.yaml"


class ConfigError(ValueError):
    """A one-line configuration error."""


def load_schema(path: str | Path = SCHEMA_PATH) -> dict:
    with open(path) as f:
        return yaml.safe_load(f)


def _where(path) -> str:
    return ".".join(str(p) for p in path) or "<top level>"


def check_schema(config: dict, schema: dict | None = None) -> None:
    """Raise ConfigError (one line) for the first schema violation, naming where it is."""
    import jsonschema  # here: GPU images without it can still import the package's modules that read configs

    schema = schema or load_schema()
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(config), key=lambda e: (len(e.path), list(map(str, e.path))))
    if not errors:
        return
    err = errors[0]
    if err.validator == "oneOf" and list(err.path)[:1] == ["models"]:
        raise ConfigError(
            f"config error at {_where(err.path)}: a model needs exactly one of hub, local, pretrain, init"
        )
    if err.validator == "required" and list(err.path)[:1] == ["models"] and len(err.path) <= 3 and (
            "dims" in err.path or "'dims'" in err.message):
        raise ConfigError(f"config error at {_where(err.path)}: {err.message}; a hub model needs dims: {{num_heads, "
                          "head_k_dim, head_v_dim} (its checkpoint's head sizes), so that an impossible ratio fails "
                          "before any job runs")
    valid = err.schema.get("description") if err.validator in ("oneOf", "anyOf") else None
    raise ConfigError(f"config error at {_where(err.path)}: {err.message}" + (f"; valid: {valid}" if valid else ""))


def model_calibration(config: dict, model: str, calib: str = "default") -> CalibrationSettings:
    """The calibration settings of ``model`` for calibration id ``calib``: the model's ``calibration`` block updated
    by the variant ``calibrations.<calib>``."""
    block = dict(config["models"][model].get("calibration", {}))
    if calib != "default":
        variants = config.get("calibrations", {})
        if calib not in variants:
            raise ConfigError(
                f"unknown calibration {calib!r}; valid: default, {', '.join(sorted(variants)) or '(none)'}"
            )
        block.update(variants[calib])
    try:
        cal = CalibrationSettings.from_dict(block)
    except ValueError as e:
        raise ConfigError(f"models.{model}.calibration: {e}") from None
    if cal.corpus is None:
        raise ConfigError(f"models.{model}.calibration.corpus is not set: every model needs a calibration corpus "
                          f"(also its default evaluation and RFT text); valid: {', '.join(sorted(config['corpora']))}")
    return cal


def model_eval_corpus(config: dict, model: str) -> str | None:
    """The corpus whose ``heldout`` split the ``heldout`` task and the rank analysis read: ``eval.corpus``, else the
    pretraining corpus of a model the workflow trains, else the calibration corpus."""
    m = config["models"][model]
    return (m.get("eval", {}).get("corpus") or m.get("pretrain", {}).get("corpus")
            or m.get("calibration", {}).get("corpus"))


def check_split(config: dict, corpus: str, split: str, where: str, why: str) -> None:
    """Check that ``corpus`` gives documents to ``split`` where its spec says which splits it has (a ``splits``
    mapping, or ``fractions`` with zeros); every other corpus has all three.

    Raises:
        ConfigError: one line: ``where``, the corpus, the missing split, ``why`` it is read and the splits it has.
    """
    spec = config["corpora"][corpus]
    if "splits" in spec:
        have = sorted(spec["splits"])
    elif "fractions" in spec:
        have = sorted(s for s, share in spec["fractions"].items() if share > 0)
    else:
        return
    if split not in have:
        raise ConfigError(f"{where}: corpus {corpus!r} has no {split} split ({why}); its splits: "
                          f"{', '.join(have) or '(none)'}")


def corpus_spec(config: dict, name: str, basedir: str | Path) -> dict:
    """The spec ``corpora.<name>``; a ``files`` corpus's relative paths (under ``paths`` or ``splits``) made paths under
    ``basedir`` (the workflow directory), so that jobs read the same files whatever their working directory.

    Raises:
        ConfigError: one line naming a corpus file that does not exist.
    """
    spec = dict(config["corpora"][name])
    if spec["source"] != "files":
        return spec  # a files corpus has exactly one of paths and splits (validate_config)

    def resolve(where: str, paths: str | list[str]) -> list[str]:
        out = []
        for p in [paths] if isinstance(paths, str) else paths:
            path = Path(basedir, Path(p).expanduser())  # an absolute path stays as it is
            if not path.is_file():
                raise ConfigError(f"corpora.{name}.{where}: corpus file {str(path)!r} does not exist")
            out.append(str(path))
        return out

    if "paths" in spec:
        spec["paths"] = resolve("paths", spec["paths"])
    else:
        spec["splits"] = {split: resolve(f"splits.{split}", paths) for split, paths in spec["splits"].items()}
    return spec


def model_eval(config: dict, model: str) -> EvalSettings:
    """The eval settings of ``model``: :class:`~statereduce.common.settings.EvalSettings` updated by
    ``models.<model>.eval``, suites expanded.

    ``suites`` (:mod:`statereduce.eval.suites`) add their lm-eval tasks to ``tasks`` and, where needed, task
    ``metadata``, per-task windows (``task_max_length``) and ``recall_probe`` settings; without suites
    the settings are exactly the configured ones. Raises ConfigError (one line) for an unknown suite.
    """
    try:
        return expand_eval(EvalSettings.from_dict(config["models"][model].get("eval", {})))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"models.{model}.eval: {e}") from None


def check_eval(config: dict, model: str) -> EvalSettings:
    """Validate the eval settings of ``model`` (suites, recall-probe levels, something to evaluate)."""
    ev = model_eval(config, model)
    if not ev.tasks and not ev.suites:
        raise ConfigError(f"models.{model}.eval: nothing to evaluate; give tasks (e.g. [heldout]) or suites")
    if "heldout" in ev.tasks:
        corpus = model_eval_corpus(config, model)
        if corpus is None:
            raise ConfigError(f"models.{model}.eval: the heldout task needs a corpus; set models.{model}.eval.corpus "
                              f"or models.{model}.calibration.corpus")
        check_split(config, corpus, "heldout", f"models.{model}.eval",
                    "the heldout task reads it; set eval.corpus to another corpus")
    if ev.recall_probe is not None:
        try:
            names = [RecallLevel.parse(lv).task_name for lv in ev.probe.levels]
        except (TypeError, ValueError) as e:
            raise ConfigError(f"models.{model}.eval.recall_probe.levels: {e}") from None
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(f"models.{model}.eval.recall_probe.levels give duplicate task names {dupes}")
    return ev


def _merge_rft(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = {**out.get(key, {}), **value} if isinstance(value, dict) else value
    return out


def _model_block(cls: type[S], model: str, block: str, d: dict) -> S:
    """``cls.from_dict(d)``, ``d`` being the top-level ``block`` updated by ``models.<model>.<block>``; a bad key or
    value is a one-line ConfigError naming both blocks."""
    try:
        return cls.from_dict(d)
    except ValueError as e:
        raise ConfigError(f"models.{model}.{block} (with the top-level {block} block): {e}") from None


def model_rft(config: dict, model: str) -> RftPlan:
    """The RFT plan of ``model``: top-level ``rft`` updated by ``models.<model>.rft``.

    Returns:
        The :class:`~statereduce.common.settings.RftPlan`: ``activate``, ``corpus`` (default: the model's calibration
        corpus), ``gpus`` and ``settings``, the fine-tuning settings (their ``overrides()`` the keys as configured).

    Raises:
        ConfigError: one line for a bad fine-tuning key or value.
    """
    merged = _merge_rft(config.get("rft", {}), config["models"][model].get("rft", {}))
    workflow = {key: merged.pop(key) for key in RftPlan.WORKFLOW_KEYS if key in merged}
    plan = _model_block(RftPlan, model, "rft", {**workflow, "settings": canonical(merged)})
    if plan.corpus is None:
        plan = plan.replace(corpus=config["models"][model].get("calibration", {}).get("corpus"))
    return plan


def check_rft(config: dict, model: str) -> RftPlan:
    """Validate the RFT plan of ``model`` (its fine-tuning settings are checked by :func:`model_rft`)."""
    plan = model_rft(config, model)
    if not plan.activate:
        return plan
    if plan.corpus is None:
        raise ConfigError(f"model {model!r} has no RFT corpus: set models.{model}.rft.corpus (or a calibration corpus)")
    if plan.corpus not in config["corpora"]:
        raise ConfigError(
            f"models.{model}.rft.corpus: unknown corpus {plan.corpus!r}; "
            f"valid: {', '.join(sorted(config['corpora']))}"
        )
    check_split(config, plan.corpus, "train", f"models.{model}.rft", "RFT trains on it; set rft.corpus")
    return plan


def model_prune(config: dict, model: str) -> PruneSettings:
    """Pruning settings of ``model``: :class:`~statereduce.common.settings.PruneSettings` updated by the top-level
    ``prune`` block, then by ``models.<model>.prune``."""
    return _model_block(PruneSettings, model, "prune",
                        {**config.get("prune", {}), **config["models"][model].get("prune", {})})


def model_rank(config: dict, model: str) -> RankSettings:
    """Rank-analysis settings of ``model``: :class:`~statereduce.common.settings.RankSettings` updated by the top-level
    ``rank`` block, then by ``models.<model>.rank``.

    The corpus (whose ``heldout`` split is analysed) defaults to the evaluation's (:func:`model_eval_corpus`).
    """
    m = config["models"][model]
    out = _model_block(RankSettings, model, "rank", {**config.get("rank", {}), **m.get("rank", {})})
    if out.corpus is None:
        out = out.replace(corpus=model_eval_corpus(config, model))
    if out.corpus is None:
        raise ConfigError(f"model {model!r} has no corpus for the rank analysis: set models.{model}.rank.corpus")
    if out.corpus not in config["corpora"]:
        raise ConfigError(
            f"models.{model}.rank.corpus: unknown corpus {out.corpus!r}; "
            f"valid: {', '.join(sorted(config['corpora']))}"
        )
    if out.skip >= out.seq_len:
        raise ConfigError(
            f"rank.skip={out.skip} must be smaller than rank.seq_len={out.seq_len} (model {model!r})"
        )
    return out


def model_speed(config: dict, model: str) -> SpeedPlan:
    """The speed-benchmark plan of ``model``: ``family``, ``arch`` and ``settings``.

    ``arch`` (the family's config keywords) is ``models.<model>.speed.arch``, else the ``pretrain.arch`` or
    ``init.arch`` of a model the workflow makes; speed runs use random weights of that shape, so they need no
    checkpoint. ``settings`` are the top-level ``speed`` block updated by the model's own ``speed`` block (part
    blocks key by key), which update :class:`~statereduce.common.settings.SpeedSettings` (checked here).
    """
    m = config["models"][model]
    if not family_spec(m["family"]).speed_benchmark:
        covered = ", ".join(f for f in family_names() if family_spec(f).speed_benchmark)
        raise ConfigError(f"model {model!r}: the speed benchmarks do not cover family {m['family']!r}; "
                          f"they cover {covered}")
    own = dict(m.get("speed", {}))
    arch = own.pop("arch", None)
    if arch is None:
        arch = (m.get("pretrain") or m.get("init") or {}).get("arch")
    if arch is None:
        raise ConfigError(f"model {model!r} has no architecture for speed runs: set models.{model}.speed.arch "
                          "(fla config keywords: hidden_size, num_hidden_layers, num_heads, ...)")
    try:
        family_spec(m["family"]).check_arch(arch)
    except ValueError as e:
        raise ConfigError(f"models.{model}.speed.arch: {e}") from None
    settings = copy.deepcopy(config.get("speed", {}))
    settings.pop("models", None)
    if "models" in own:
        raise ConfigError(f"models.{model}.speed.models: 'models' belongs to the top-level speed block only")
    for key, value in own.items():
        settings[key] = {**settings.get(key, {}), **value} if isinstance(value, dict) else value
    return _model_block(SpeedPlan, model, "speed",
                        canonical({"family": m["family"], "arch": arch, "settings": settings}))


def model_dims(config: dict, model: str) -> dict | None:
    """(num_heads, head_k_dim, head_v_dim) of a model known from config alone, or None.

    For a ``pretrain`` or ``init`` model the sizes come from its ``arch`` block through the family spec's ``arch_dims``
    (the config class's defaults for omitted keys), without importing fla. Raises ConfigError (one line) for
    an arch key the family's config class does not take. A hub model's are its ``dims``; a ``local`` model's are its
    ``dims``, else read the same way from its checkpoint's ``config.json`` (its ``text_config`` where it has one).
    """
    m = config["models"][model]
    block = next((b for b in ("pretrain", "init") if b in m), None)
    if block is not None:
        try:
            d = family_spec(m["family"]).arch_dims(m[block]["arch"])
        except ValueError as e:
            raise ConfigError(f"models.{model}.{block}.arch: {e}") from None
        return {"num_heads": d.num_heads, "head_k_dim": d.head_k_dim, "head_v_dim": d.head_v_dim}
    if m.get("local") and "dims" not in m:
        return _checkpoint_dims(m["family"], m["local"])
    return m.get("dims")


def _checkpoint_dims(family: str, folder: str) -> dict | None:
    """(num_heads, head_k_dim, head_v_dim) from a checkpoint folder's ``config.json`` through the adapter's
    ``arch_dims``; None when it cannot be read that way (the jobs check the loaded model)."""
    cls = family_spec(family)
    try:
        cfg = json.loads((Path(folder).expanduser() / "config.json").read_text())
        cfg = cfg.get("text_config") or cfg
        d = cls.arch_dims({k: v for k, v in cfg.items() if k in cls.config_defaults})
    except (OSError, ValueError, TypeError, KeyError, AttributeError, ZeroDivisionError):
        return None
    return {"num_heads": d.num_heads, "head_k_dim": d.head_k_dim, "head_v_dim": d.head_v_dim}


def check_has_checkpoint(config: dict, model: str) -> None:
    """A one-line ConfigError for a model with no checkpoint to read (``local: null`` and no other source)."""
    m = config["models"][model]
    if not any(m.get(source) for source in ("hub", "local", "pretrain", "init")):
        raise ConfigError(f"model {model!r} has no checkpoint: set models.{model}.local (or hub)")


def check_reduction(config: dict, model: str, pct: float, method: str | None = None) -> int:
    """Check that ``method``'s cut at ``pct`` is possible for ``model`` (None or a key cut: removing ``pct`` percent
    of its key channels; ``-v``: of its value channels; ``-kv``: of its state, :mod:`statereduce.core.cuts`); return
    d_k'.

    The head sizes come from :func:`model_dims`; a model whose sizes the config cannot give (no checkpoint yet, a
    ``local`` checkpoint whose config.json the family cannot read, ``dims`` without ``head_k_dim``) is refused in one
    line, so that no job is planned for a ratio that may keep no channel."""
    from statereduce.core.cuts import cut_widths
    from statereduce.selectors import parse_method

    cut = "keys" if method is None else parse_method(method).cut
    if not 0 < pct < 100:
        what = {"keys": "key channels", "values": "value channels", "joint": "the state"}[cut]
        raise ConfigError(f"pct {pct} is outside (0, 100): it is the percent of {what} removed")
    dims = model_dims(config, model)
    if dims is None or "head_k_dim" not in dims or (cut != "keys" and "head_v_dim" not in dims):
        check_has_checkpoint(config, model)
        raise ConfigError(f"model {model!r}: its head sizes are unknown (no models.{model}.dims, and its checkpoint's "
                          f"config.json gives none); add dims: {{num_heads, head_k_dim, head_v_dim}}")
    spec = family_spec(config["models"][model]["family"])

    def check(d_k_new: int, d_v_new: int) -> None:
        if "head_v_dim" in dims:
            spec.check_reduction(dims["head_k_dim"], d_v_new, d_k_new)
            spec.check_value_reduction(dims["head_v_dim"], d_v_new)

    try:
        d_k_new, d_v_new = cut_widths(cut, dims["head_k_dim"], dims.get("head_v_dim", 1), pct, check)
        check(d_k_new, d_v_new)
    except ValueError as e:
        raise ConfigError(f"model {model!r} at pct {pct}: {e}") from None
    return d_k_new


def check_method(config: dict, method: str) -> None:
    from statereduce.selectors import parse_method

    try:
        spec = parse_method(method)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if spec.calib != "default" and spec.calib not in config.get("calibrations", {}):
        raise ConfigError(
            f"method {method!r} names calibration {spec.calib!r}; "
            f"valid: {', '.join(sorted(config.get('calibrations', {}))) or '(none defined)'}"
        )
    if spec.budget is not None:
        check_budget_cut(model_budget(config, spec.budget), spec, method)
    if spec.fit is not None:
        model_fit(config, spec.fit)


def check_budget_cut(settings: BudgetSettings, spec, method: str) -> None:
    """A budget of policy ``split`` or ``joint`` serves joint cuts (``-kv@<budget>``) only, and a joint cut takes no
    other."""
    if (settings.policy in ("split", "joint")) != (spec.cut == "joint"):
        if spec.cut == "joint":
            raise ConfigError(f"method {method!r}: budgets.{spec.budget} has policy {settings.policy!r}, which chooses "
                              f"per-layer key widths; a joint cut (-kv@<budget>) takes a budget of policy 'split' or "
                              f"'joint'")
        raise ConfigError(f"method {method!r}: budgets.{spec.budget} has policy {settings.policy!r}, which chooses the "
                          f"split of a joint cut; use it as <selector>-kv@{spec.budget}")


def _named(config: dict, cls: type[S], kind: str, name: str, sigil: str) -> S:
    """The settings ``cls`` of ``<kind>s.<name>``, a block a method token names with ``<sigil><name>``."""
    blocks = config.get(f"{kind}s") or {}
    if name not in blocks:
        raise ConfigError(f"unknown {kind} {name!r} (method token suffix {sigil}{name}); valid: "
                          f"{', '.join(sorted(blocks)) or f'(none defined: add a {kind}s block)'}")
    try:
        return cls.from_dict(blocks[name])
    except ValueError as e:
        raise ConfigError(f"{kind}s.{name}: {e}") from None


def model_budget(config: dict, budget: str) -> BudgetSettings:
    """The settings of ``budgets.<budget>`` (:class:`~statereduce.common.settings.BudgetSettings`)."""
    return _named(config, BudgetSettings, "budget", budget, "@")


def model_fit(config: dict, fit: str) -> FitSettings:
    """The settings of ``fits.<fit>`` (:class:`~statereduce.common.settings.FitSettings`)."""
    return _named(config, FitSettings, "fit", fit, "+")


def model_fit_plan(config: dict, model: str, method: str) -> FitPlan:
    """The fit plan of ``method`` (ending in ``+<fit>``) for ``model``: the fit's settings and the calibration of the
    token's ``.<calib>`` (its ``corpus`` spec is the workflow's to resolve)."""
    spec = layout.parse_token(method)
    return FitPlan(name=spec.fit, settings=model_fit(config, spec.fit),
                   calibration=model_calibration(config, model, spec.calib))


def model_budget_plan(config: dict, model: str, method: str) -> BudgetPlan:
    """The budget plan of ``method`` (ending in ``@<budget>``) for ``model``: the budget's settings, the model's d_v
    where its config gives it and, for the ``sensitivity`` policy, the calibration of the token's ``.<calib>`` (its
    ``corpus`` spec is the workflow's to resolve)."""
    spec = layout.parse_token(method)
    settings = model_budget(config, spec.budget)
    plan = BudgetPlan(name=spec.budget, settings=settings,
                      head_v_dim=(model_dims(config, model) or {}).get("head_v_dim"))
    if settings.policy in ("sensitivity", "split", "joint"):
        plan = plan.replace(calibration=model_calibration(config, model, spec.calib))
    return plan


def model_mixer_layers(config: dict, model: str) -> int | None:
    """The number of linear-attention layers of ``model`` when its config gives its architecture (``pretrain`` or
    ``init`` models), else None (the jobs read it off the checkpoint)."""
    m = config["models"][model]
    block = next((b for b in ("pretrain", "init") if b in m), None)
    return None if block is None else len(family_spec(m["family"]).arch_mixer_layers(m[block]["arch"]))


def check_budget_cell(config: dict, model: str, method: str, pct: float) -> None:
    """Check a method with ``@<budget>`` against the model at ``pct`` before any job: the budget's policy suits the cut
    (:func:`check_budget_cut`); for a key cut the selector can take the budget (index selections; scores or an
    objective for ``greedy``), the floor fits d_k and the allowed widths meet the uniform cut's total
    (:func:`statereduce.core.budgets.check_budget`); for a joint cut some split of the pct's state is left
    (:func:`statereduce.core.cuts.state_split_candidates`) and, for policy ``joint``, some choice of a pair per layer
    within 1% of the pct's total state (:func:`statereduce.core.budgets.check_joint_budget`). A no-op for a method
    without a budget."""
    from statereduce.core.budgets import allowed_widths, check_budget, check_budget_selector, check_joint_budget
    from statereduce.core.cuts import state_pair_check, state_split_candidates
    from statereduce.selectors import parse_method

    spec = parse_method(method)
    if spec.budget is None:
        return
    settings = model_budget(config, spec.budget)
    check_budget_cut(settings, spec, method)
    dims = model_dims(config, model)
    layers = model_mixer_layers(config, model)
    fam = family_spec(config["models"][model]["family"])
    d_k = (dims or {}).get("head_k_dim")
    d_v = (dims or {}).get("head_v_dim")
    try:
        if spec.cut == "joint":
            if d_k is not None and d_v is not None:  # otherwise the split job checks the widths on the checkpoint
                check = state_pair_check(config["models"][model]["family"], d_k, d_v, settings.engine)
                uniform = state_split_candidates(d_k, d_v, pct, allowed_widths(d_k, settings), check)
                if settings.policy == "joint" and layers is not None:
                    check_joint_budget(d_k, d_v, pct, layers, settings, check, uniform)
            return
        check_budget_selector(settings, spec.selector)
        if d_k is not None and layers is not None:  # otherwise the allocate job checks the widths on the checkpoint
            check_budget(settings, spec.selector, d_k=d_k, n_layers=layers, pct=pct,
                         check_width=(lambda w: fam.check_reduction(d_k, d_v, w)) if d_v else None)
    except ValueError as e:
        raise ConfigError(f"model {model!r}, method {method!r} (budgets.{spec.budget}): {e}") from None


def check_target(config: dict, target: str) -> None:
    """Check a requested path under ``results/`` against the configuration, before any job is planned.

    ``results/{model}/...`` must name a configured model, ``calib/{calib}/...`` a calibration id of it, and
    ``select/{method}_{pct}.parquet`` and ``{method}_{pct}/...`` a valid method token (:func:`check_method`) and a
    pct the model can take (:func:`check_reduction`). Other paths (tables, figures, outside ``results/``) are
    left to Snakemake. The layout is :mod:`statereduce.common.layout`'s.

    Raises:
        ConfigError: one line: the target, its unknown or impossible part, and the valid choices.
    """
    found = layout.parse(target)
    if found is None:
        return
    try:
        if found.model not in config["models"]:
            raise ConfigError(f"unknown model {found.model!r}; valid: {', '.join(sorted(config['models']))}")
        check_has_checkpoint(config, found.model)
        if found.calib is not None:
            model_calibration(config, found.model, found.calib)
        if found.stage is None:
            return
        if found.method is None:
            raise ConfigError(
                f"{found.stage!r} is neither <method>_<pct> (e.g. drrqr_75) nor one of {', '.join(layout.FOLDERS)}"
            )
        check_method(config, found.method)
        if found.pct is None:  # a budget values file: rule budget_values checks its budget when it plans it
            return
        if not layout.is_pct(found.pct):
            pct = layout.canonical_pct(found.pct)
            if pct is None:
                raise ConfigError(
                    f"pct {found.pct!r} in {found.stage!r} is not a number such as 75 or 37.5 (percent of key "
                    "channels removed)"
                )
            raise ConfigError(f"pct {found.pct!r} is written {pct!r} in paths (one spelling per ratio): "
                              f"{layout.with_pct(target, pct)}")
        check_reduction(config, found.model, float(found.pct), found.method)
        check_budget_cell(config, found.model, found.method, float(found.pct))
        if found.rest[:1] == ("export",) and found.rest[1:2] not in (("pruned",), ("rft",)):
            stage = found.rest[1] if len(found.rest) > 1 else ""
            raise ConfigError(f"export of {stage!r}: valid: export/pruned/README.md, export/rft/README.md")
    except ConfigError as e:
        raise ConfigError(f"{target}: {e}") from None


def check_checkpoint_family(model: str, family: str, where: str, checkpoint: str, revision: str | None = None) -> None:
    """Check that the checkpoint ``checkpoint`` (a local folder or a hub id) is of ``family`` where its ``config.json``
    can be read without the network (a local folder, or a hub id in the Hugging Face cache); otherwise the base
    job checks it when it resolves the hub id (:func:`statereduce.core.models.write_hub_source`).

    Raises:
        ConfigError: one line naming the model, the checkpoint, its ``model_type`` and the family's.
    """
    try:
        check_family(checkpoint, revision, family)
    except ValueError as e:
        raise ConfigError(f"models.{model}.{where}: {e}") from None


def check_local(model: str, path: str | None) -> None:
    """Check ``models.<model>.local``: a folder holding ``config.json`` and weights (an HF checkpoint), or None (no
    checkpoint yet). A relative path is relative to the working directory, as the jobs resolve it.

    Raises:
        ConfigError: one line naming the model, the path and what was expected.
    """
    if path is None:
        return

    folder = Path(path).expanduser()
    if not folder.is_dir():
        problem = "is not a folder" if folder.exists() else "does not exist"
    elif not (folder / "config.json").is_file():
        problem = "has no config.json"
    elif not weight_files(folder):
        problem = "has no weights (*.safetensors or pytorch_model*.bin)"
    else:
        return
    raise ConfigError(f"models.{model}.local: {path!r} {problem}; expected an HF checkpoint folder with config.json "
                      "and its weights")


def model_pretrain(config: dict, model: str) -> PretrainSettings:
    """The ``pretrain`` block of ``model`` (a model the workflow trains), typed: its ``train`` and ``recall_mix``
    blocks update :class:`~statereduce.common.settings.TrainSettings` and
    :class:`~statereduce.common.settings.RecallMixSettings`.
    The pretrain rule's params stay the block as configured (defaults are filled in the job), so that a model
    without ``share_conv`` or ``recall_mix`` keeps the params it had.

    Raises:
        ConfigError: one line naming the model, the bad key or value and what is valid.
    """
    try:
        return PretrainSettings.from_dict(config["models"][model]["pretrain"])
    except (TypeError, ValueError) as e:
        raise ConfigError(f"models.{model}.pretrain: {e}") from None


def check_share_conv(model: str, family: str, pretrain: PretrainSettings) -> None:
    """Check ``models.<model>.pretrain.share_conv`` (paper App. B.5, Table 14): tied q/k conv filters need a family
    with q and k short convolutions in modules of their own (:mod:`statereduce.adapters.conv_sharing`).

    Raises:
        ConfigError: one line naming the model, the value and what is valid.
    """
    try:
        check_family_share_conv(family, pretrain.share_conv, pretrain.arch)
    except ValueError as e:
        raise ConfigError(f"models.{model}.pretrain.share_conv: {e}") from None


def canonical(obj):
    """``obj`` with every mapping's keys sorted, recursively: reordering keys in config.yaml must not
    change any rule's params (Snakemake reruns a job whose params' representation changed)."""
    if isinstance(obj, dict):
        return {k: canonical(obj[k]) for k in sorted(obj)}
    if isinstance(obj, list):
        return [canonical(v) for v in obj]
    return obj
