"""Stage functions the workflow scripts call: config settings in, artifact out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from statereduce.data import load_split

HELDOUT = "heldout"  # the task name of the local-file perplexity task on a corpus's held-out split


def heldout_docs(corpus_spec: dict, max_docs: int | None, max_doc_bytes: int | None) -> list[str]:
    """The first ``max_docs`` held-out documents, each cut to at most ``max_doc_bytes`` UTF-8 bytes."""
    docs = load_split(corpus_spec, "heldout")
    if not docs:
        raise ValueError(f"corpus {corpus_spec} has an empty heldout split")
    docs = docs[:max_docs] if max_docs else docs
    if max_doc_bytes:
        docs = [d.encode("utf-8")[:max_doc_bytes].decode("utf-8", errors="ignore") for d in docs]
    return [d for d in docs if d.strip()]


def evaluate_checkpoint(checkpoint: str | Path, settings: dict[str, Any], info: dict[str, Any], out_path: str | Path,
                        extra: dict[str, Any] | None = None) -> dict:
    """Load a checkpoint (or base artifact), run its lm-eval tasks and write ``eval.json``.

    Args:
        checkpoint: HF checkpoint folder, or a base folder holding ``source.json``.
        settings: the model's ``eval`` config (tasks, corpus_spec for ``heldout``, max_docs, ...).
        info: model name, dtype, device.
        out_path: the ``eval.json`` to write.
        extra: further provenance (e.g. the prune record's method and pct).
    """
    from statereduce.models import load_model

    model, tokenizer = load_model(checkpoint, dtype=info["dtype"], device=info["device"])
    return evaluate_loaded(model, tokenizer, checkpoint, settings, info, out_path, extra)


def evaluate_loaded(model, tokenizer, checkpoint: str | Path, settings: dict[str, Any], info: dict[str, Any],
                    out_path: str | Path, extra: dict[str, Any] | None = None) -> dict:
    """Run the lm-eval tasks of ``settings`` on an already loaded model and write ``eval.json``."""
    from statereduce.evaluate import evaluate_and_write

    tasks = list(settings["tasks"])
    docs = None
    if HELDOUT in tasks:
        tasks.remove(HELDOUT)
        docs = heldout_docs(settings["corpus_spec"], settings.get("max_docs"), settings.get("max_doc_bytes"))
    cfg = {"tasks": tasks, "batch_size": settings.get("batch_size", 1), "max_length": settings.get("max_length"),
           "limit": settings.get("limit"), "heldout_task": HELDOUT}
    return evaluate_and_write(model, tokenizer, out_path, eval_cfg=cfg, heldout_docs=docs,
                              task_dir=Path(out_path).parent / ".lm_eval_tasks", checkpoint=str(checkpoint),
                              model_id=info["model"], extra_provenance=extra)


def recover(pruned_dir: str | Path, base_dir: str | Path, out_dir: str | Path, plan: dict[str, Any],
            corpus_spec: dict, eval_settings: dict[str, Any], info: dict[str, Any], eval_out: str | Path, *,
            resume_dir: str | Path | None = None, log_jsonl: str | Path | None = None,
            extra: dict[str, Any] | None = None) -> dict:
    """The ``rft`` stage: fine-tune the pruned checkpoint (:mod:`statereduce.finetune`), save it, evaluate it.

    The held-out documents of the ``heldout`` evaluation task are excluded from the training data. With
    ``plan["gpus"] > 1`` training runs under ``torchrun`` (one process per GPU, DDP through accelerate) and the saved
    checkpoint is then loaded for evaluation; otherwise everything runs in this process and the merged model
    is evaluated in memory.

    Returns:
        The ``eval.json`` document of the RFT checkpoint.
    """
    from statereduce import finetune

    exclude = load_split(eval_settings["corpus_spec"], "heldout") if HELDOUT in eval_settings["tasks"] else []
    out: dict[str, Any] = {}

    def evaluate(model, tokenizer, saved: Path) -> None:
        out["doc"] = evaluate_loaded(model.to(info["device"]), tokenizer, saved, eval_settings, info, eval_out, extra)

    if int(plan.get("gpus", 1)) > 1:
        finetune.launch(int(plan["gpus"]), pruned_dir, base_dir, out_dir, plan["settings"], corpus_spec,
                        exclude_docs=exclude, dtype=info["dtype"], device=info["device"], resume_dir=resume_dir,
                        log_path=log_jsonl)
        return evaluate_checkpoint(out_dir, eval_settings, info, eval_out, extra)
    finetune.run_rft(pruned_dir, base_dir, out_dir, plan["settings"], corpus_spec, exclude_docs=exclude,
                     dtype=info["dtype"], device=info["device"], resume_dir=resume_dir, log_path=log_jsonl,
                     on_saved=evaluate)
    return out["doc"]
