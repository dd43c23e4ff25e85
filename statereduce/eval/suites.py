"""Named evaluation suites: the paper's task sets, selectable from a model's ``eval.suites`` in config.

A suite expands to lm-eval's own task names plus what running them needs (task metadata, a longer
``max_length`` window), and names the metric each paper table reports and the averages built from
them. Everything here is plain data: importing this module imports neither lm-eval nor fla, so
config validation (``snakemake -n``) stays fast.

- ``lm`` (paper Sec. 5, Tables 1, 3, 10, 20, 21): WikiText-2 word perplexity, LAMBADA (OpenAI)
  perplexity and accuracy, ARC-Easy/Challenge ``acc_norm``, HellaSwag ``acc_norm``, WinoGrande
  ``acc``, PIQA ``acc_norm``. ``lm_avg`` is the paper's "LM Evals Avg" / "ZS" column: the mean of the
  six accuracies LAMBADA acc, ARC-e, ARC-c, HellaSwag, WinoGrande and PIQA (Table 10's baseline:
  (71.5 + 44.8 + 70.5 + 64.2 + 77.0 + 58.2) / 6 = 64.4; Table 21's first row gives 31.0 likewise).
- ``recall`` (App. C.4, Tables 4, 11, 12): RULER single-needle NIAH (``niah_single_1..3``) at 2K and
  4K tokens (task metadata ``max_seq_lengths: [2048, 4096]``; lm-eval's metric is named after the
  length, ``"2048"``/``"4096"``), SQuAD- and SWDE-completion (``contains``). Needs network (datasets
  and the tokenizer by name). The NIAH tasks run with an lm-eval window of at least 4096 + 128
  tokens so no 4K prompt is cut; SQuAD/SWDE keep the configured ``max_length``.
- ``recall_probe``: the offline synthetic MQAR probe of :mod:`statereduce.eval.recall`, written as local
  tasks next to the held-out perplexity task (levels from ``eval.recall_probe``); ``recall_mqar_avg``
  is the mean ``acc`` over its levels.

:func:`suite_summary` / :func:`summarize_suites` turn an ``eval.json`` ``metrics`` mapping into the
averages; a task or metric that was not evaluated gives ``None``, never a guess.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from statereduce.common.settings import EvalSettings

Item = tuple[str, str]
"""A ``(task, metric)`` pair of an ``eval.json`` ``metrics`` mapping."""

RULER_LENGTHS = (2048, 4096)
"""The paper's RULER/NIAH context lengths (App. C.4: trained at 2K, evaluated at 2K and 4K)."""

RULER_GEN_TOKENS = 128
"""``max_gen_toks`` of lm-eval's RULER tasks; prompts are sized to ``length - 128`` tokens, plus a short
generation prefix, so a window of ``length + 128`` never cuts one."""

NIAH_TASKS = ("niah_single_1", "niah_single_2", "niah_single_3")

@dataclass(frozen=True)
class Suite:
    """One named evaluation suite.

    Args:
        name: the name used in ``eval.suites``.
        description: one line, with the paper reference.
        tasks: lm-eval task names it adds to ``eval.tasks`` (empty for a suite of locally written tasks).
        report: the ``(task, metric)`` columns the paper's tables show.
        averages: summary name -> the ``(task, metric)`` items it averages.
        metadata: lm-eval task metadata (``TaskManager(metadata=...)``) the tasks need.
        task_max_length: task -> the smallest lm-eval window (HFLM ``max_length``) it needs; other
            tasks run with the configured ``max_length``.
        network: whether the tasks download data (lm-eval's datasets, a tokenizer by name).
        local_metric: for a suite of locally written tasks (``tasks`` empty), the metric of each task
            that ``local_average`` averages.
        local_average: the summary name of that average.
        local_prefix: the common prefix of those tasks' names, to find them among a document's metrics.
        missing: metric values that mean "not evaluated" (lm-eval's RULER aggregation gives -1 for a
            length with no documents).
    """

    name: str
    description: str
    tasks: tuple[str, ...] = ()
    report: tuple[Item, ...] = ()
    averages: Mapping[str, tuple[Item, ...]] = field(default_factory=dict)
    metadata: Mapping[str, Any] = field(default_factory=dict)
    task_max_length: Mapping[str, int] = field(default_factory=dict)
    network: bool = True
    local_metric: str | None = None
    local_average: str | None = None
    local_prefix: str | None = None
    missing: tuple[float, ...] = ()

    def summary_items(self, tasks: Sequence[str] | None = None) -> dict[str, tuple[Item, ...]]:
        """Summary name -> items; ``tasks`` are the written task names of a local suite (default: none)."""
        if self.local_average is None:
            return dict(self.averages)
        return {self.local_average: tuple((t, self.local_metric) for t in (tasks or ()))}


LM_ACCURACY: tuple[Item, ...] = (
    ("lambada_openai", "acc"),
    ("arc_easy", "acc_norm"),
    ("arc_challenge", "acc_norm"),
    ("hellaswag", "acc_norm"),
    ("winogrande", "acc"),
    ("piqa", "acc_norm"),
)
"""The six accuracies of the paper's "LM Evals Avg" (Tables 10, 20, 21) and "ZS" (Tables 1, 3, 13)."""

SUITES: dict[str, Suite] = {
    "lm": Suite(
        name="lm",
        description="language modelling and zero-shot accuracy (paper Sec. 5, Tables 1, 20, 21)",
        tasks=("wikitext", "lambada_openai", "arc_easy", "arc_challenge", "hellaswag", "winogrande", "piqa"),
        report=(("wikitext", "word_perplexity"), ("lambada_openai", "perplexity"), *LM_ACCURACY),
        averages={"lm_avg": LM_ACCURACY},
    ),
    "recall": Suite(
        name="recall",
        description="RULER single-needle NIAH at 2K/4K, SQuAD- and SWDE-completion (paper App. C.4, Tables 4, 11)",
        tasks=(*NIAH_TASKS, "squad_completion", "swde"),
        report=(
            *((t, str(n)) for n in RULER_LENGTHS for t in NIAH_TASKS),
            ("squad_completion", "contains"),
            ("swde", "contains"),
        ),
        averages={
            **{f"niah_{n}": tuple((t, str(n)) for t in NIAH_TASKS) for n in RULER_LENGTHS},
            "squad": (("squad_completion", "contains"),),
            "swde": (("swde", "contains"),),
        },
        metadata={"max_seq_lengths": list(RULER_LENGTHS)},
        task_max_length=dict.fromkeys(NIAH_TASKS, max(RULER_LENGTHS) + RULER_GEN_TOKENS),
        missing=(-1.0,),
    ),
    "recall_probe": Suite(
        name="recall_probe",
        description="offline synthetic MQAR recall probe (statereduce.eval.recall), written as local tasks",
        network=False,
        local_metric="acc",
        local_average="recall_mqar_avg",
        local_prefix="recall_mqar_",
    ),
}

SUITE_NAMES = tuple(SUITES)


def get_suite(name: str) -> Suite:
    """The suite called ``name``; ``ValueError`` naming the valid ones otherwise."""
    if name not in SUITES:
        raise ValueError(f"unknown evaluation suite {name!r}; valid: {', '.join(SUITE_NAMES)}")
    return SUITES[name]


def check_suites(names: Sequence[str]) -> list[str]:
    """``names`` as a list, each a known suite (``ValueError`` for the first unknown or repeated one)."""
    if isinstance(names, str):
        raise TypeError(f"suites must be a list of names, got {names!r}; valid names: {', '.join(SUITE_NAMES)}")
    out: list[str] = []
    for name in names:
        get_suite(name)
        if name in out:
            raise ValueError(f"evaluation suite {name!r} is listed twice")
        out.append(name)
    return out


def expand_eval(settings: EvalSettings) -> EvalSettings:
    """A model's ``eval`` settings with its ``suites`` expanded (idempotent; unchanged without suites).

    Adds every suite's lm-eval tasks to ``tasks`` (after the configured ones, each once), merges the
    suites' task ``metadata``, records each task's minimum window in ``task_max_length`` and fills
    ``recall_probe`` (:class:`~statereduce.common.settings.RecallProbeSettings`' defaults) when that suite is selected.

    Args:
        settings: the ``eval`` settings.

    Returns:
        The expanded settings; ``ValueError`` for an unknown suite or conflicting metadata.
    """
    names = check_suites(settings.suites or [])
    if not names:
        return settings
    tasks = list(settings.tasks or [])
    metadata = dict(settings.metadata or {})
    windows = dict(settings.task_max_length or {})
    for name in names:
        suite = SUITES[name]
        tasks += [t for t in suite.tasks if t not in tasks]
        for key, value in suite.metadata.items():
            if key in metadata and metadata[key] != value:
                raise ValueError(f"suite {name!r} needs task metadata {key}={value!r}, but it is {metadata[key]!r}")
            metadata[key] = value
        for t, window in suite.task_max_length.items():
            windows[t] = max(windows.get(t, 0), window)
    changes: dict[str, Any] = {"tasks": tasks, "suites": names}
    if metadata:
        changes["metadata"] = metadata
    if windows:
        changes["task_max_length"] = windows
    if "recall_probe" in names:
        changes["recall_probe"] = settings.probe.to_dict()
    return settings.replace(**changes)


def metric_value(metrics: Mapping[str, Mapping[str, Any]], task: str, metric: str, missing: Sequence[float] = ()):
    """``metrics[task][metric]`` as a float, or ``None`` if absent, not a finite number, or a ``missing`` sentinel."""
    value = metrics.get(task, {}).get(metric)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        return None
    if float(value) in missing:
        return None
    return float(value)


def suite_summary(
    name: str, metrics: Mapping[str, Mapping[str, Any]], tasks: Sequence[str] | None = None
) -> dict[str, float | None]:
    """The averages of suite ``name`` over an ``eval.json`` ``metrics`` mapping.

    Args:
        name: a suite name.
        metrics: ``{task: {metric: value}}`` (clean names, as in ``eval.json``).
        tasks: for a suite of local tasks (``recall_probe``), the task names that were written.

    Returns:
        ``{summary: mean or None}``; ``None`` when any averaged item is missing (or when a local
        suite has no tasks), so a partial run never shows a made-up average.
    """
    suite = get_suite(name)
    out: dict[str, float | None] = {}
    for key, items in suite.summary_items(tasks).items():
        values = [metric_value(metrics, t, m, suite.missing) for t, m in items]
        out[key] = sum(values) / len(values) if values and None not in values else None
    return out


def local_tasks(name: str, metrics: Mapping[str, Mapping[str, Any]]) -> list[str] | None:
    """The tasks of local suite ``name`` among an ``eval.json`` ``metrics`` mapping (named with its
    ``local_prefix`` and carrying its ``local_metric``), sorted; ``None`` for a suite of lm-eval tasks."""
    suite = get_suite(name)
    if suite.local_average is None:
        return None
    return sorted(t for t, ms in metrics.items() if t.startswith(suite.local_prefix or "") and suite.local_metric in ms)


def suite_stderr(
    name: str, metrics: Mapping[str, Mapping[str, Any]], tasks: Sequence[str] | None = None
) -> dict[str, float | None]:
    """The standard error of each average of :func:`suite_summary`, from its items' standard errors.

    The average of n items with standard errors se_i has standard error sqrt(sum se_i^2) / n when the items are
    independent samples (lm-eval's ``acc_stderr`` of each recall level: sqrt(p (1 - p) / (N - 1)) over its N
    documents).

    Args:
        name: a suite name.
        metrics: ``{task: {metric: value}}``, with lm-eval's ``<metric>_stderr`` beside each metric.
        tasks: for a suite of local tasks, the task names that were written (default: :func:`local_tasks`).

    Returns:
        ``{summary: standard error or None}``; ``None`` when the average is missing or any item lacks a standard
        error (lm-eval gives none for some metrics), never a guess.
    """
    suite = get_suite(name)
    if suite.local_average is not None and tasks is None:
        tasks = local_tasks(name, metrics)
    means = suite_summary(name, metrics, tasks)
    out: dict[str, float | None] = {}
    for key, items in suite.summary_items(tasks).items():
        ses = [metric_value(metrics, t, f"{m}_stderr") for t, m in items]
        ok = means.get(key) is not None and ses and None not in ses
        out[key] = math.sqrt(sum(se**2 for se in ses)) / len(ses) if ok else None
    return out


def summarize_suites(
    metrics: Mapping[str, Mapping[str, Any]],
    names: Sequence[str],
    local_tasks: Mapping[str, Sequence[str]] | None = None,
) -> dict[str, dict[str, float | None]]:
    """``{suite: suite_summary(...)}`` for every suite in ``names`` (the ``suites`` block of ``eval.json``).

    Args:
        metrics: an ``eval.json`` ``metrics`` mapping.
        names: suite names.
        local_tasks: suite name -> the local task names written for it (``recall_probe``).
    """
    local_tasks = local_tasks or {}
    return {name: suite_summary(name, metrics, local_tasks.get(name)) for name in check_suites(names)}
