"""The results layout: every path the workflow writes under ``results/``, and the parser of such a path.

Templates use Snakemake's wildcard names (``{model}``, ``{method}``, ``{pct}``, ``{calib}``), so a rule's output is
the template itself and an input function fills it with :func:`path`. A pct appears in paths as
:func:`format_pct` writes it (``50``, ``37.5``). :func:`parse` reads a path back into its parts; configuration
checks of requested targets (:func:`statereduce.config.check_target`) and the scripts that need the model of an
input use it, so that the layout is written down here only.

::

    results/{model}/base/                 the base checkpoint (or source.json naming it)
    results/{model}/weights/qk.h5         q/k projection weights
    results/{model}/calib/{calib}/        activations.h5, grad_scores.h5
    results/{model}/select/{method}_{pct}.parquet
    results/{model}/select/{method}_{pct}.allocation.json   per-layer key widths of a method with @<budget>
    results/{model}/select/{method}.values.json    a measured budget's per-width values (every pct's allocation)
    results/{model}/baseline/             eval.json, rank.json, speed.json of the unpruned model
    results/{model}/{method}_{pct}/       pruned/, rft/, eval.json (the summary), rank.json, speed.json
    results/tables/, results/figures/     across models
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath

RESULTS = "results"
TABLES = f"{RESULTS}/tables"
FIGURES = f"{RESULTS}/figures"

MODEL = f"{RESULTS}/{{model}}"
BASE = f"{MODEL}/base"
QK_WEIGHTS = f"{MODEL}/weights/qk.h5"
CALIB = f"{MODEL}/calib/{{calib}}"
ACTIVATIONS = f"{CALIB}/activations.h5"
GRAD_SCORES = f"{CALIB}/grad_scores.h5"
SELECTION = f"{MODEL}/select/{{method}}_{{pct}}.parquet"
ALLOCATION = f"{MODEL}/select/{{method}}_{{pct}}.allocation.json"
BUDGET_VALUES = f"{MODEL}/select/{{method}}.values.json"
BASELINE = f"{MODEL}/baseline"
BASELINE_EVAL = f"{BASELINE}/eval.json"
BASELINE_RANK = f"{BASELINE}/rank.json"
BASELINE_SPEED = f"{BASELINE}/speed.json"
STAGE = f"{MODEL}/{{method}}_{{pct}}"
PRUNED = f"{STAGE}/pruned"
RFT = f"{STAGE}/rft"
RFT_RESUME = f"{STAGE}/.rft_resume"
SUMMARY = f"{STAGE}/eval.json"
RANK = f"{STAGE}/rank.json"
SPEED = f"{STAGE}/speed.json"

#: Folders of ``results/{model}/`` whose name is not a ``<method>_<pct>`` stage.
FOLDERS = ("base", "baseline", "calib", "select", "weights")
#: A pct as paths write it (percent of key channels removed): :func:`format_pct`'s one spelling per ratio, so no
#: leading zero and no trailing zero after the point (``50``, ``37.5``; not ``050``, ``50.0``, ``50.00``).
PCT_RE = r"(?:0|[1-9]\d*)(?:\.\d*[1-9])?"


def format_pct(pct: float | int | str) -> str:
    """Path form of a pct: 50 -> '50', 37.5 -> '37.5' (a string is taken as already written)."""
    if isinstance(pct, str):
        return pct
    return str(int(pct)) if float(pct).is_integer() else str(pct)


def path(template: str, **parts) -> str:
    """``template`` with the given wildcards filled (others stay wildcards); ``pct`` goes through
    :func:`format_pct`."""
    for name, value in parts.items():
        template = template.replace(f"{{{name}}}", format_pct(value) if name == "pct" else str(value))
    return template


def table(name: str, ext: str) -> str:
    """``results/tables/{name}.{ext}``."""
    return f"{TABLES}/{name}.{ext}"


def figure(name: str) -> str:
    """``results/figures/{name}.png``."""
    return f"{FIGURES}/{name}.png"


@dataclass(frozen=True)
class ResultPath:
    """The parts of a path under ``results/{model}/``: ``folder`` is one of :data:`FOLDERS` or a stage
    ``<method>_<pct>``; ``stage`` is that stage, or a selection file's, split into ``method`` and ``pct`` (as written;
    ``None`` where the path has none: a budget values file has a method and no pct); ``calib`` the calibration id of a ``calib/`` path; ``rest`` what follows."""

    model: str
    folder: str
    rest: tuple[str, ...]
    stage: str | None = None
    method: str | None = None
    pct: str | None = None
    calib: str | None = None


def parse(target: str) -> ResultPath | None:
    """The parts of ``target`` when it lies under ``results/{model}/`` (not tables or figures), else None.

    A stage whose name is not ``<method>_<pct>`` keeps ``method`` None and ``pct`` None with ``stage`` set, so that
    callers can say what is wrong with it; ``pct`` is not checked against :data:`PCT_RE` here.
    """
    parts = PurePosixPath(target).parts
    if len(parts) < 3 or parts[0] != RESULTS or parts[1] in ("tables", "figures"):
        return None
    model, folder, rest = parts[1], parts[2], parts[3:]
    calib = rest[0] if folder == "calib" and rest else None
    if folder in FOLDERS and not (folder == "select" and rest):
        return ResultPath(model, folder, rest, calib=calib)
    if folder == "select" and rest[0].endswith(".values.json"):  # one per method with @<budget>, every pct's
        method = rest[0].removesuffix(".values.json")
        return ResultPath(model, folder, rest, stage=method, method=method)
    stage = rest[0].removesuffix(".parquet").removesuffix(".allocation.json") if folder == "select" else folder
    method, sep, pct = stage.rpartition("_")
    if not sep:
        return ResultPath(model, folder, rest, stage=stage)
    return ResultPath(model, folder, rest, stage=stage, method=method, pct=pct)


def is_pct(text: str) -> bool:
    """Whether ``text`` is a pct as paths write it (:data:`PCT_RE`)."""
    return re.fullmatch(PCT_RE, text) is not None


def canonical_pct(text: str) -> str | None:
    """The path form (:func:`format_pct`) of the number ``text`` spells (``50.0``, ``050`` -> ``50``), or None when
    it spells no number that paths can write."""
    try:
        pct = format_pct(float(text))
    except (TypeError, ValueError):
        return None
    return pct if is_pct(pct) else None


def with_pct(target: str, pct: str) -> str:
    """``target`` (a path under ``results/{model}/`` with a ``<method>_<pct>`` stage, :func:`parse`) with its pct
    written ``pct``."""
    found = parse(target)
    if found is None or found.method is None:
        raise ValueError(f"{target!r} has no <method>_<pct> stage")
    parts = list(PurePosixPath(target).parts)
    i = 3 if found.folder == "select" else 2
    parts[i] = parts[i].replace(found.stage, f"{found.method}_{pct}", 1)
    return str(PurePosixPath(*parts))
