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
    """Run the lm-eval tasks and suites of ``settings`` on an already loaded model and write ``eval.json``.

    ``settings`` is a model's ``eval`` config (:func:`statereduce.config.model_eval`); its ``suites`` are
    expanded here too (idempotent), so plain ``{"tasks": [...], "suites": [...]}`` works as well. Local
    tasks (the ``heldout`` perplexity task, the ``recall_probe`` suite's MQAR levels from
    :mod:`statereduce.recall`) are written to ``.lm_eval_tasks/`` next to ``out_path`` and scored in the
    same lm-eval call as the other tasks; the document gets a ``suites`` block of suite averages.
    """
    from statereduce.evaluate import evaluate_and_write
    from statereduce.suites import expand_eval

    settings = expand_eval(settings)
    tasks = list(settings["tasks"])
    docs = None
    if HELDOUT in tasks:
        tasks.remove(HELDOUT)
        docs = heldout_docs(settings["corpus_spec"], settings.get("max_docs"), settings.get("max_doc_bytes"))
    suites = list(settings.get("suites") or [])
    local = {}
    if "recall_probe" in suites:
        from statereduce.recall import recall_probe_writer

        local["recall_probe"] = recall_probe_writer(settings.get("recall_probe"), tokenizer, settings.get("max_length"))
    cfg = {"tasks": tasks, "batch_size": settings.get("batch_size", 1), "max_length": settings.get("max_length"),
           "limit": settings.get("limit"), "heldout_task": HELDOUT}
    cfg.update({k: settings[k] for k in ("metadata", "task_max_length") if settings.get(k)})
    if suites:
        cfg["suites"] = suites
    return evaluate_and_write(model, tokenizer, out_path, eval_cfg=cfg, heldout_docs=docs, local_tasks=local,
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


def rank_analysis(checkpoint: str | Path, settings: dict[str, Any], info: dict[str, Any], out_path: str | Path, *,
                  baseline: str | Path | None = None, selection: str | Path | None = None,
                  activations: str | Path | None = None, extra: dict[str, Any] | None = None) -> dict:
    """The ``rank.json`` of one checkpoint (paper Sec. 2.2, App. C.1, C.5; Tables 5 and 6).

    Rank utilization of the recurrent state of every head over ``n_samples`` held-out blocks of ``seq_len``
    tokens (:func:`statereduce.rank.rank_report`: states from the model's own forward pass, positions before
    ``skip`` left out, one sample every ``stride`` tokens), the singular values of ``spectrum_head``, the
    Pearson correlation of per-head utilization with the baseline's ``rank.json`` when given, and the
    conditioning of the selected [Q; K] calibration columns when ``activations`` is given (every channel for
    the baseline, the ``selection``'s for a pruned model).
    """
    from statereduce import rank
    from statereduce.data import token_blocks
    from statereduce.h5files import H5Artifact
    from statereduce.models import load_model
    from statereduce.runtime import jsonable, read_json, write_json
    from statereduce.selection import read_selection

    model, tokenizer = load_model(checkpoint, dtype=info["dtype"], device=info["device"])
    docs = load_split(settings["corpus_spec"], "heldout")
    ids = token_blocks(tokenizer, docs, int(settings["n_samples"]), int(settings["seq_len"]), int(settings["seed"]))
    head = settings.get("spectrum_head")
    doc = rank.rank_report(model, ids.to(info["device"]), skip=int(settings["skip"]), stride=int(settings["stride"]),
                           spectrum_head=tuple(head) if head is not None else None,
                           baseline=read_json(baseline) if baseline is not None else None)
    if activations is not None:
        acts = H5Artifact(Path(activations))
        layers = acts.layers()
        data = {layer: acts.read(layer, ["K", "Q"]) for layer in layers}
        keep = read_selection(selection)[0] if selection is not None else None
        cond = rank.selected_conditioning({lay: d["K"] for lay, d in data.items()},
                                          {lay: d["Q"] for lay, d in data.items()}, keep)
        cond["per_head"] = [{"layer": lay, "head": h, **v} for (lay, h), v in sorted(cond["per_head"].items())]
        doc["conditioning"] = {**cond, "activations": str(activations), "selection": str(selection)}
    doc["provenance"] = {"checkpoint": str(checkpoint), "model": info["model"], "corpus": settings["corpus_spec"],
                         "split": "heldout", **(extra or {})}
    write_json(out_path, jsonable(doc))
    return doc
