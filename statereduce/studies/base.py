"""What a study is: its config block's schema and check, its cells, the inputs and params of its table job, and what
that job writes (tables, figures and their report captions). Each study is one module of :mod:`statereduce.studies`
that defines a :class:`Study` subclass and registers it with :func:`register`; the package finds them all.

A study's cells are ordinary targets (summaries, pruned evaluations: ``results/{model}/{method}_{pct}/...``), so a
cell shared by two studies, or by a study and the default target, is built once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from statereduce.common import layout
from statereduce.config.blocks import ConfigError

#: A study cell: (model, method token, pct).
Cell = tuple[str, str, float]


@dataclass(frozen=True)
class Table:
    """A table a study writes: ``results/tables/<name>.{md,csv,html}`` and its report caption
    ``results/tables/<name>.rst`` (:attr:`caption`, reStructuredText)."""

    name: str
    label: str  # the table's label in the Snakemake report
    caption: str


@dataclass(frozen=True)
class Figure:
    """A figure a study draws: ``results/figures/<name>.png``, captioned in the report like a :class:`Table`."""

    name: str
    label: str
    caption: str


class Study:
    """One study: a block ``studies.<name>`` of the config, and the table job that reads its cells.

    Subclasses set the class attributes and implement :meth:`cells`, :meth:`inputs` and :meth:`frames` (and
    :meth:`draw` when they have :attr:`figures`); :meth:`params` defaults to the block itself.
    """

    #: the key under ``studies:``
    name: ClassVar[str]
    #: the Snakemake rule that writes its tables (``logs/<rule>/<rule>.log``)
    rule: ClassVar[str]
    #: the rule's docstring (``snakemake --list-rules``, the report)
    doc: ClassVar[str]
    #: JSON schema of the block (``$ref`` resolves against ``schemas/config.schema.yaml``'s ``$defs``)
    schema: ClassVar[dict]
    tables: ClassVar[tuple[Table, ...]]
    figures: ClassVar[tuple[Figure, ...]] = ()

    def cells(self, config: dict, block: dict) -> list[Cell]:
        """Check the block (beyond its schema) against the rest of ``config``; its cells in table order.

        Raises:
            statereduce.config.ConfigError: one line naming the bad value and the valid ones.
        """
        raise NotImplementedError

    def inputs(self, config: dict, block: dict, cells: list[Cell]) -> dict[str, list[str]]:
        """The table job's inputs: name -> paths (the same names reach :meth:`frames`)."""
        raise NotImplementedError

    def params(self, config: dict, block: dict, cells: list[Cell]) -> dict:
        """What the table job reads besides its inputs (JSON values; a change reruns it). Default: the block."""
        return block

    def frames(self, inputs: dict[str, list[str]], params: dict) -> dict:
        """Table name -> ``(pandas.DataFrame, Markdown text)`` for every table of :attr:`tables`: the CSV is the
        frame, the Markdown (and its HTML page) the text."""
        raise NotImplementedError

    def draw(self, inputs: dict[str, list[str]], params: dict, outputs: dict[str, str]) -> None:
        """Draw :attr:`figures` to ``outputs[figure.name]`` (PNG)."""


# ---- schemas, checks and paths the studies share ---------------------------------------------------------------
def unique_list(items: dict | None = None, description: str | None = None) -> dict:
    """JSON schema of a non-empty list of distinct ``items`` (default: strings), e.g. a study's models or pcts."""
    out = {"type": "array", "items": items or {"type": "string"}, "minItems": 1, "uniqueItems": True}
    return out | ({"description": description} if description else {})


#: a study block's list of percentages (``$defs/pct`` of schemas/config.schema.yaml)
PCTS = unique_list({"$ref": "#/$defs/pct"})
#: a list of config keys (budgets, calibration variants): the key pattern of the config
KEY = {"type": "string", "pattern": "^[a-z0-9]+$"}


def known_models(config: dict, where: str, models) -> None:
    """Raise ConfigError (one line) for the first of ``models`` that ``config`` does not define."""
    for model in models:
        if model not in config["models"]:
            raise ConfigError(f"{where}.models: unknown model {model!r}; valid: {', '.join(sorted(config['models']))}")


def known_selectors(where: str, selectors, valid: list[str] | None = None, why=None) -> None:
    """Raise ConfigError (one line) for the first of ``selectors`` that is unknown or not in ``valid`` (``why(info)``:
    the reason, e.g. what the selector reads)."""
    from statereduce.selectors import get_selector, selector_names

    valid = selector_names() if valid is None else valid
    for sel in selectors:
        if sel not in selector_names():
            raise ConfigError(f"{where}.selectors: unknown selector {sel!r}; valid: {', '.join(valid)}")
        if sel not in valid:
            raise ConfigError(f"{where}.selectors: selector {sel!r} {why(get_selector(sel))}; valid: {', '.join(valid)}")


def summary_paths(cells) -> list[str]:
    """The summary of every cell, in cell order."""
    return [layout.path(layout.SUMMARY, model=m, method=method, pct=pct) for m, method, pct in cells]



_REGISTRY: dict[str, Study] = {}


def register(cls: type[Study]) -> type[Study]:
    """Class decorator: make ``cls`` the study of config key ``cls.name``.

    Raises:
        ValueError: a second study with the same name, or one that shares a rule or a table with another.
    """
    study = cls()
    for other in _REGISTRY.values():
        if study.name == other.name or study.rule == other.rule:
            raise ValueError(f"study {cls.__module__}.{cls.__name__}: name {study.name!r} or rule {study.rule!r} "
                             f"is taken by {type(other).__module__}")
        shared = {t.name for t in (*study.tables, *study.figures)} & {t.name for t in (*other.tables, *other.figures)}
        if shared:
            raise ValueError(f"study {study.name!r}: output(s) {sorted(shared)} are also study {other.name!r}'s")
    _REGISTRY[study.name] = study
    return cls
