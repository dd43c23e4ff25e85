"""Evaluating a checkpoint as the workflow does: the model's ``eval`` settings in, ``eval.json`` out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from statereduce.common.settings import EvalSettings
from statereduce.core.data import load_split
from statereduce.core.models import load_model
from statereduce.eval.harness import evaluate_and_write
from statereduce.eval.recall import recall_probe_writer
from statereduce.eval.suites import expand_eval
from statereduce.eval.tasks import HELDOUT


def heldout_docs(corpus_spec: dict, max_docs: int | None, max_doc_bytes: int | None) -> list[str]:
    """The first ``max_docs`` held-out documents, each cut to at most ``max_doc_bytes`` UTF-8 bytes."""
    docs = load_split(corpus_spec, "heldout")
    if not docs:
        raise ValueError(f"corpus {corpus_spec} has an empty heldout split")
    docs = docs[:max_docs] if max_docs else docs
    if max_doc_bytes:
        docs = [d.encode("utf-8")[:max_doc_bytes].decode("utf-8", errors="ignore") for d in docs]
    return [d for d in docs if d.strip()]


def evaluate_checkpoint(checkpoint: str | Path, settings: EvalSettings, info: dict[str, Any], out_path: str | Path,
                        extra: dict[str, Any] | None = None) -> dict:
    """Load a checkpoint (or base artifact), run its lm-eval tasks and write ``eval.json``.

    Args:
        checkpoint: HF checkpoint folder, or a base folder holding ``source.json``.
        settings: the model's ``eval`` settings (tasks, corpus_spec for ``heldout``, max_docs, ...).
        info: model name, dtype, device.
        out_path: the ``eval.json`` to write.
        extra: further provenance (e.g. the prune record's method and pct).
    """
    model, tokenizer = load_model(checkpoint, dtype=info["dtype"], device=info["device"])
    return evaluate_loaded(model, tokenizer, checkpoint, settings, info, out_path, extra)


def evaluate_loaded(model, tokenizer, checkpoint: str | Path, settings: EvalSettings, info: dict[str, Any],
                    out_path: str | Path, extra: dict[str, Any] | None = None) -> dict:
    """Run the lm-eval tasks and suites of ``settings`` on an already loaded model and write ``eval.json``.

    ``settings`` are a model's ``eval`` settings (:func:`statereduce.config.model_eval`); their ``suites`` are
    expanded here too (idempotent), so ``EvalSettings.from_dict({"tasks": [...], "suites": [...]})`` works as well.
    Local
    tasks (the ``heldout`` perplexity task, the ``recall_probe`` suite's MQAR levels from
    :mod:`statereduce.eval.recall`) are written to a temporary folder (removed afterwards: nothing but
    ``out_path`` is written under ``results/``) and scored in the same lm-eval call as the other tasks; the
    document gets a ``suites`` block of suite averages.
    """
    settings = expand_eval(settings)
    tasks = list(settings.tasks)
    docs = None
    if HELDOUT in tasks:
        tasks.remove(HELDOUT)
        docs = heldout_docs(settings.corpus_spec, settings.max_docs, settings.max_doc_bytes)
    suites = list(settings.suites or [])
    local = {}
    if "recall_probe" in suites:
        local["recall_probe"] = recall_probe_writer(settings.probe, tokenizer, settings.max_length)
    cfg = {"tasks": tasks, "batch_size": settings.batch_size, "max_length": settings.max_length,
           "limit": settings.limit}
    cfg.update({k: v for k, v in (("metadata", settings.metadata), ("task_max_length", settings.task_max_length))
                if v})
    if suites:
        cfg["suites"] = suites
    return evaluate_and_write(model, tokenizer, out_path, eval_cfg=cfg, heldout_docs=docs, local_tasks=local,
                              checkpoint=str(checkpoint), model_id=info["model"], extra_provenance=extra)
