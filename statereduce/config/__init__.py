"""Workflow configuration: schema validation and semantic checks, before any job runs.

``validate_config`` checks ``config.yaml`` against ``schemas/config.schema.yaml`` (unknown keys are errors) and then
what a schema cannot express: known families and selectors, method tokens, corpus and calibration references, that
every targeted (model, pct) leaves at least one channel and a representable head size. Every error is one line naming
the bad value and the valid choices. The blocks under ``studies:`` belong to the studies, a layer above this one:
:func:`statereduce.studies.check_studies` checks each against its study's schema and checks, and the workflow runs
both (``rules/common.smk``, :func:`statereduce.fetch.load_config`).

The helpers that read and check one block at a time live in :mod:`statereduce.config.blocks` (all of them importable
from here): the ``model_*`` helpers build each stage's typed settings (:mod:`statereduce.common.settings`) from the
validated config; the defaults are those classes' fields.
"""

from __future__ import annotations

import copy

from statereduce.common.settings import DeviceSettings
from statereduce.config import blocks
from statereduce.config.blocks import *  # noqa: F403 (the block helpers: blocks.__all__)
from statereduce.config.blocks import (
    ConfigError,
    canonical,
    check_budget_cell,
    check_checkpoint_family,
    check_eval,
    check_local,
    check_method,
    check_reduction,
    check_rft,
    check_schema,
    check_share_conv,
    check_split,
    load_schema,
    model_budget,
    model_fit,
    model_calibration,
    model_prune,
    model_pretrain,
    model_rank,
    model_speed,
)
from statereduce.families import family_names, family_spec

__all__ = [*blocks.__all__, "validate_config"]


def validate_config(config: dict, schema: dict | None = None) -> dict:
    """Validate ``config`` (all but the contents of its ``studies`` blocks: :func:`statereduce.studies.check_studies`);
    return a canonical copy (sorted keys) with defaults filled. Raises ConfigError (one line)."""
    check_schema(config, schema or load_schema())
    cfg = canonical(copy.deepcopy(config))
    families = family_names()
    corpora = cfg["corpora"]
    for name, spec in corpora.items():
        if spec["source"] == "files" and ("paths" in spec) == ("splits" in spec):
            raise ConfigError(f"corpora.{name}: a files corpus needs exactly one of 'paths' (split by fractions) "
                              "or 'splits' (files per split)")
    for name, m in cfg["models"].items():
        if m["family"] not in families:
            raise ConfigError(f"model {name!r}: unknown family {m['family']!r}; valid: {', '.join(families)}")
        for block in ("pretrain", "init"):
            if block in m:
                try:
                    family_spec(m["family"]).check_arch(m[block]["arch"])
                except ValueError as e:
                    raise ConfigError(f"models.{name}.{block}.arch: {e}") from None
        if "pretrain" in m:
            check_share_conv(name, m["family"], model_pretrain(cfg, name))
        m.update(DeviceSettings.from_dict({k: m[k] for k in DeviceSettings.field_names() if k in m}).to_dict())
        check_local(name, m.get("local"))
        if m.get("local"):
            check_checkpoint_family(name, m["family"], "local", m["local"])
        if "hub" in m:
            check_checkpoint_family(name, m["family"], "hub.id", m["hub"]["id"], m["hub"].get("revision"))
        for where, cname in (("calibration", m.get("calibration", {}).get("corpus")),
                             ("eval", m.get("eval", {}).get("corpus")),
                             ("pretrain", m.get("pretrain", {}).get("corpus"))):
            if cname is not None and cname not in corpora:
                raise ConfigError(
                    f"models.{name}.{where}.corpus: unknown corpus {cname!r}; valid: {', '.join(sorted(corpora))}"
                )
    for name in cfg["models"]:
        cal = model_calibration(cfg, name)
        check_split(cfg, cal.corpus, cal.split, f"models.{name}.calibration",
                    "calibration reads it; set calibration.split")
        check_eval(cfg, name)
        check_rft(cfg, name)
        model_prune(cfg, name)
        model_rank(cfg, name)
    for cname, cal in cfg.get("calibrations", {}).items():
        if "corpus" in cal and cal["corpus"] not in corpora:
            raise ConfigError(
                f"calibrations.{cname}.corpus: unknown corpus {cal['corpus']!r}; valid: {', '.join(sorted(corpora))}"
            )
    t = cfg["targets"]
    for model in t["models"]:
        if model not in cfg["models"]:
            raise ConfigError(f"targets.models: unknown model {model!r}; valid: {', '.join(sorted(cfg['models']))}")
    for method in t["methods"]:
        check_method(cfg, method)
    for name in cfg.get("budgets") or {}:
        model_budget(cfg, name)
    for name in cfg.get("fits") or {}:
        model_fit(cfg, name)
    for model in t["models"]:
        for pct in t["pcts"]:
            check_reduction(cfg, model, pct)
            for method in t["methods"]:
                check_reduction(cfg, model, pct, method)
                check_budget_cell(cfg, model, method, pct)
    for name in cfg.get("speed", {}).get("models", []):
        if name not in cfg["models"]:
            raise ConfigError(f"speed.models: unknown model {name!r}; valid: {', '.join(sorted(cfg['models']))}")
        model_speed(cfg, name)
    return cfg
