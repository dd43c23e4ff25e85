"""Studies built by ``all_paper``: one module each in this folder, found the way lm-eval finds its tasks.

A study module defines a :class:`~statereduce.studies.base.Study` (its config block's schema and check, its cells,
its table job's inputs and params, its tables, figures and report captions) and registers it with
:func:`~statereduce.studies.base.register`. The check of the config's ``studies`` blocks (:func:`check_studies`), the
workflow's study rules (``rules/studies.smk``: one rule per study) and ``all_paper`` iterate :func:`registered`, so a
new study is a new module here plus its block under ``studies:`` in the config.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

from statereduce.common import layout
from statereduce.config.blocks import check_schema, load_schema
from statereduce.core.runtime import write_text_atomic
from statereduce.studies.base import Cell, Figure, Study, Table, register, _REGISTRY

__all__ = ["Cell", "Figure", "Study", "Table", "register", "registered", "get_study", "schema", "check_studies", "outputs",
           "write_outputs"]


def registered() -> dict[str, Study]:
    """Every study, by config key (sorted): importing this folder's modules registers them."""
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if info.name != "base" and not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")
    return dict(sorted(_REGISTRY.items()))


def get_study(name: str) -> Study:
    """The study of config key ``name``.

    Raises:
        ValueError: one line naming the unknown study and the valid ones.
    """
    studies = registered()
    if name not in studies:
        raise ValueError(f"unknown study {name!r}; valid: {', '.join(studies)}")
    return studies[name]


def schema() -> dict:
    """The JSON schema of the config's ``studies`` block: one property per registered study, its module's
    :attr:`~statereduce.studies.base.Study.schema`; no other key."""
    return {"type": "object", "additionalProperties": False,
            "properties": {name: study.schema for name, study in registered().items()}}


def check_studies(config: dict) -> dict[str, list[Cell]]:
    """Check every block of ``studies`` against its study's schema and then its study's own checks
    (:meth:`~statereduce.studies.base.Study.cells`), and list the cells: study name -> ``[(model, method token, pct)]``
    in table order; empty without a ``studies`` block.

    Args:
        config: the configuration, validated by :func:`statereduce.config.validate_config` (which leaves the
            contents of the ``studies`` blocks to this function).

    Raises:
        statereduce.config.ConfigError: one line naming the bad value and the valid ones.
    """
    blocks = config.get("studies") or {}
    check_schema({"studies": blocks}, {"type": "object", "properties": {"studies": schema()},
                                       "$defs": load_schema()["$defs"]})  # the blocks' $refs resolve there
    return {name: get_study(name).cells(config, block) for name, block in blocks.items()}


def outputs(study: Study) -> dict[str, str]:
    """The paths the study's table job writes, by output name: per table ``<name>`` (Markdown), ``<name>_csv``,
    ``<name>_html`` and ``<name>_caption`` (its report caption); per figure ``<name>`` and ``<name>_caption``."""
    out = {}
    for t in study.tables:
        out |= {t.name: layout.table(t.name, "md"), f"{t.name}_csv": layout.table(t.name, "csv"),
                f"{t.name}_html": layout.table(t.name, "html"), f"{t.name}_caption": layout.table(t.name, "rst")}
    for f in study.figures:
        out |= {f.name: layout.figure(f.name), f"{f.name}_caption": layout.figure(f.name)[: -len(".png")] + ".rst"}
    return out


def write_outputs(study: Study, inputs: dict[str, list[str]], params: dict, paths: dict[str, str]) -> dict[str, int]:
    """Write everything of :func:`outputs` (each atomically) from the study's inputs and params; table name -> rows.

    Raises:
        ValueError: a study whose :meth:`~statereduce.studies.base.Study.frames` misses one of its tables.
    """
    from statereduce.analysis.figures import markdown_html

    frames = study.frames(inputs, params)
    missing = [t.name for t in study.tables if t.name not in frames]
    if missing:
        raise ValueError(f"study {study.name!r} made no frame for table(s) {missing}")
    for t in study.tables:
        df, md = frames[t.name]
        write_text_atomic(paths[t.name], md)
        write_text_atomic(paths[f"{t.name}_csv"], df.to_csv(index=False))
        write_text_atomic(paths[f"{t.name}_html"], markdown_html(md))
        write_text_atomic(paths[f"{t.name}_caption"], t.caption.strip() + "\n")
    study.draw(inputs, params, paths)
    for f in study.figures:
        write_text_atomic(paths[f"{f.name}_caption"], f.caption.strip() + "\n")
    return {t.name: len(frames[t.name][0]) for t in study.tables}
