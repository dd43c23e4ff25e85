"""Local lm-eval tasks: documents written to JSONL plus a task YAML that lm-eval reads from ``include_path``.

:func:`write_perplexity_task` mirrors lm-eval's ``wikitext`` task (``loglikelihood_rolling``; word
perplexity, byte perplexity, bits per byte with lm-eval's own aggregations), and
:func:`write_multiple_choice_task` mirrors lm-eval's zero-shot accuracy tasks (``multiple_choice``; ``acc``,
``acc_norm``); both go through :func:`write_local_task`. :func:`statereduce.eval.harness.evaluate_model`
scores them like any lm-eval task.

The held-out perplexity task has one name, :data:`HELDOUT`: the entry in a model's ``eval.tasks`` that asks
for it, and the lm-eval task it is written and scored under (so ``eval.json``, its raw ``lm_eval`` record and
the tables key its metrics by that name).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from statereduce.core.runtime import write_text_atomic

HELDOUT = "heldout"
"""The held-out perplexity task on a corpus's held-out split: its name in a model's ``eval.tasks`` and the lm-eval
task name its documents are written and scored under (so metrics keep it)."""

PERPLEXITY_METRICS = ("word_perplexity", "byte_perplexity", "bits_per_byte")

MULTIPLE_CHOICE_METRICS = ("acc", "acc_norm")

TASK_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
"""Valid local task names: letters, digits, ``_``, ``.``, ``-``, not starting with ``.`` or ``-``."""


def write_perplexity_task(docs: Sequence[str], task_dir: Path, name: str = HELDOUT) -> str:
    """Write ``docs`` as a local lm-eval perplexity task (a JSONL file plus a task YAML).

    The YAML mirrors lm-eval's ``wikitext`` task: ``output_type: loglikelihood_rolling``, empty
    ``doc_to_text``, the document as target, metrics ``word_perplexity``, ``byte_perplexity`` and
    ``bits_per_byte`` with lm-eval's default aggregations (weighted perplexity; words counted as
    ``len(re.split(r"\\s+", doc))``, bytes as UTF-8 bytes). The target is the feature name ``text``
    rather than the template ``"{{text}}"``: lm-eval returns a feature verbatim, whereas a rendered
    template that starts with ``[`` and ends with ``]`` is ``ast.literal_eval``-ed into a list.
    ``datasets`` loads the file with its packaged ``json`` builder (no network); its Arrow cache goes
    to ``task_dir/.hf_datasets`` so concurrent jobs never share a cache.

    Args:
        docs: non-empty documents, one request each (split long texts before; lm-eval rolls windows
            of ``max_length`` tokens over each document, restarting the model's state per window).
        task_dir: folder for ``{name}.jsonl`` and ``{name}.yaml``; pass it as ``include_path``.
        name: task name; letters, digits, ``_``, ``.``, ``-``.

    Returns:
        The task name, to put in the ``tasks`` list of :func:`statereduce.eval.harness.evaluate_model`.
    """
    docs = list(docs)
    if not docs:
        raise ValueError("docs is empty; a perplexity task needs at least one document")
    for i, d in enumerate(docs):
        if not isinstance(d, str) or not d:
            raise ValueError(f"docs[{i}] is {d!r}; every document must be a non-empty string")
    config = {
        "output_type": "loglikelihood_rolling",
        "doc_to_text": "",
        "doc_to_target": "text",
        "metric_list": [{"metric": m} for m in PERPLEXITY_METRICS],
    }
    return write_local_task([{"text": d} for d in docs], task_dir, name, config)


def write_multiple_choice_task(
    docs: Sequence[Mapping[str, Any]],
    task_dir: Path,
    name: str,
    *,
    metrics: Sequence[str] = MULTIPLE_CHOICE_METRICS,
    text_field: str = "context",
    target_delimiter: str = " ",
    tag: str | Sequence[str] | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> str:
    """Write ``docs`` as a local lm-eval ``multiple_choice`` task (a JSONL file plus a task YAML).

    A local mirror of lm-eval's zero-shot accuracy tasks (ARC, HellaSwag, PIQA, ...): the score of a
    choice is the log-likelihood of ``target_delimiter + choice`` after the context; ``acc`` is the
    argmax against ``gold``, ``acc_norm`` the argmax of the log-likelihood divided by the choice's
    length in characters (lm-eval's own definitions and names). ``doc_to_text``/``doc_to_choice``/
    ``doc_to_target`` name document fields, which lm-eval returns verbatim (no template rendering).

    Args:
        docs: mappings with ``text_field`` (non-empty string), ``choices`` (>= 2 strings) and ``gold``
            (index into ``choices``); other fields are kept in the JSONL.
        task_dir: folder for ``{name}.jsonl`` and ``{name}.yaml``; pass it as ``include_path``.
        name: task name; letters, digits, ``_``, ``.``, ``-``.
        metrics: lm-eval metric names, ``acc`` and/or ``acc_norm`` (mean aggregation, higher is better).
        text_field: the context field of each document.
        target_delimiter: put between context and choice.
        tag: lm-eval tag(s) that also select the task.
        metadata: more ``metadata`` fields of the YAML (``version``, ``n_docs`` and ``sha256`` are set).

    Returns:
        The task name.
    """
    docs = [dict(d) for d in docs]
    if not docs:
        raise ValueError("docs is empty; a multiple-choice task needs at least one document")
    bad = sorted(set(metrics) - set(MULTIPLE_CHOICE_METRICS))
    if bad or not metrics:
        raise ValueError(f"metrics {list(metrics)} invalid; choose from {', '.join(MULTIPLE_CHOICE_METRICS)}")
    for i, d in enumerate(docs):
        text, choices, gold = d.get(text_field), d.get("choices"), d.get("gold")
        if not isinstance(text, str) or not text:
            raise ValueError(f"docs[{i}][{text_field!r}] is {text!r}; it must be a non-empty string")
        if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
            raise ValueError(f"docs[{i}]['choices'] is {choices!r}; it must be a list of >= 2 non-empty strings")
        if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(choices):
            raise ValueError(f"docs[{i}]['gold'] is {gold!r}; it must be an index into its {len(choices)} choices")
    config: dict[str, Any] = {}
    if tag is not None:
        config["tag"] = [tag] if isinstance(tag, str) else list(tag)
    config.update(
        {
            "output_type": "multiple_choice",
            "doc_to_text": text_field,
            "doc_to_choice": "choices",
            "doc_to_target": "gold",
            "target_delimiter": target_delimiter,
            "metric_list": [{"metric": m, "aggregation": "mean", "higher_is_better": True} for m in metrics],
        }
    )
    return write_local_task(docs, task_dir, name, config, metadata)


def write_local_task(
    rows: Sequence[Mapping[str, Any]],
    task_dir: Path,
    name: str,
    config: Mapping[str, Any],
    metadata: Mapping[str, Any] | None = None,
) -> str:
    """Write ``rows`` to ``task_dir/{name}.jsonl`` and an lm-eval task YAML reading it, both atomically.

    The YAML holds ``task``, ``tag`` (when in ``config``), ``dataset_path: json`` with the JSONL as its
    ``test`` split and the Arrow cache in ``task_dir/.hf_datasets`` (``datasets``' packaged ``json``
    builder, no network, no cache shared between concurrent jobs), ``test_split``, the rest of
    ``config``, and ``metadata`` (``version`` 1.0, ``metadata``, ``n_docs`` and the JSONL's ``sha256``).

    Args:
        rows: JSON-serialisable documents.
        task_dir: folder (created); pass it as ``include_path``.
        name: task name; letters, digits, ``_``, ``.``, ``-``, not starting with ``.`` or ``-``.
        config: the task-specific YAML keys (``output_type``, ``doc_to_*``, ``metric_list``, ...).
        metadata: more ``metadata`` fields.

    Returns:
        The task name.
    """
    if not isinstance(name, str) or not TASK_NAME_RE.match(name):
        raise ValueError(
            f"invalid task name {name!r}; use letters, digits, '_', '.', '-' (not starting with '.' or '-')"
        )
    task_dir = Path(task_dir).resolve()
    task_dir.mkdir(parents=True, exist_ok=True)
    data_path = task_dir / f"{name}.jsonl"
    payload = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    write_text_atomic(data_path, payload)
    rest = {k: v for k, v in config.items() if k not in ("task", "tag", "metadata")}
    doc = {
        "task": name,
        **({"tag": config["tag"]} if "tag" in config else {}),
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data_path)}, "cache_dir": str(task_dir / ".hf_datasets")},
        "test_split": "test",
        **rest,
        "metadata": {
            "version": 1.0,
            **(metadata or {}),
            "n_docs": len(rows),
            "sha256": hashlib.sha256(payload.encode("utf-8")).hexdigest(),
        },
    }
    write_text_atomic(task_dir / f"{name}.yaml", yaml.safe_dump(doc, sort_keys=False, allow_unicode=True))
    return name
