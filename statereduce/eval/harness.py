"""Evaluation through lm-eval-harness: a loaded model, lm-eval's own tasks, clean metrics.

The paper (Sec. 5, Tables 1, 3, 10, 20-24) reports WikiText-2 word perplexity, LAMBADA perplexity and accuracy,
ARC-Easy/Challenge, HellaSwag, WinoGrande and PIQA, plus a recall suite. All of them run here
through lm-eval's own tasks and ``lm_eval.simple_evaluate`` on an already-loaded model wrapped in
``HFLM``. Offline, the same code path runs *local-file* tasks (:mod:`statereduce.eval.tasks`: a held-out
perplexity task mirroring lm-eval's ``wikitext``, multiple-choice mirrors of its accuracy tasks), and
:func:`evaluate_model` is pointed at their folder with ``include_path``. Which lm-eval tasks a model runs
comes from its ``eval.tasks`` and named ``eval.suites`` (:mod:`statereduce.eval.suites`, paper Sec. 5 and
App. C.4).

- :func:`evaluate_model` returns ``{"metrics": {task: {metric: value}}, "lm_eval": {...raw...},
  "settings": {...}, "timing": {...}}``; metric names are clean (``word_perplexity``), lm-eval's raw
  keys (``word_perplexity,none``) stay in the raw part.
- :func:`evaluate_and_write` writes the local tasks, runs lm-eval once per window, merges the results
  (:func:`merge_results`), adds a ``suites`` block (suite averages such as ``lm_avg``; ``None`` for a task
  that did not run) when the model's eval selects suites, and writes the checkpoint's ``eval.json``
  (:mod:`statereduce.eval.documents`).

Recurrent models and HFLM: for ``loglikelihood_rolling`` (and every other loglikelihood request)
HFLM calls ``model(input_ids)`` with no attention mask (``HFLM._model_call``), right-padding the
batch. Right padding cannot change earlier positions of a causal model, so batch sizes > 1 give
the same numbers as 1, and fla never takes its varlen path (which an attention mask would trigger).
"""

from __future__ import annotations

import contextlib
import difflib
import numbers
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import nn

from statereduce.core.checkpoints import base_checkpoint
from statereduce.core.models import kernel_check_record
from statereduce.core.runtime import jsonable
from statereduce.eval.documents import state_record, write_eval_json
from statereduce.eval.suites import summarize_suites
from statereduce.eval.tasks import HELDOUT, write_perplexity_task

EVAL_CFG_KEYS = (
    "tasks",
    "batch_size",
    "max_length",
    "device",
    "limit",
    "bootstrap_iters",
    "metadata",
    "task_max_length",
    "suites",
)
"""Keys accepted in the ``eval_cfg`` mapping of :func:`evaluate_and_write`."""

TOKENIZER_METADATA_KEYS = ("tokenizer", "pretrained")
"""Task-metadata keys from which lm-eval's synthetic tasks (RULER) load a tokenizer by name."""

# Keys of lm-eval's per-task config kept in the raw record (the rest is prompts, functions, filters).
_CONFIG_KEYS = (
    "task",
    "tag",
    "dataset_path",
    "dataset_name",
    "dataset_kwargs",
    "training_split",
    "validation_split",
    "test_split",
    "fewshot_split",
    "output_type",
    "num_fewshot",
    "metric_list",
    "repeats",
    "target_delimiter",
    "fewshot_delimiter",
    "metadata",
)
# Top-level parts of simple_evaluate's result that are kept (``samples`` is never requested).
_RAW_KEYS = ("results", "groups", "group_subtasks", "versions", "n-shot", "higher_is_better", "n-samples", "config")
# Those of them keyed by task (merged across calls by merge_results), plus the per-task configs.
_PER_TASK_RAW_KEYS = (
    "results",
    "groups",
    "group_subtasks",
    "versions",
    "n-shot",
    "higher_is_better",
    "n-samples",
    "configs",
)

def evaluate_model(
    model: nn.Module,
    tokenizer,
    tasks: Sequence[str],
    *,
    include_path: Path | str | None = None,
    batch_size: int | str = 1,
    max_length: int | None = None,
    device: str | torch.device | None = None,
    limit: float | None = None,
    bootstrap_iters: int = 100_000,
    num_fewshot: int | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> dict:
    """Evaluate an already-loaded causal LM on lm-eval tasks (paper Sec. 5 metrics).

    Wraps ``model`` in ``lm_eval.models.huggingface.HFLM`` (scoring without building a cache, see
    :func:`_scoring_hflm_class`) and calls ``lm_eval.simple_evaluate``
    with a ``TaskManager`` that also indexes ``include_path``. If every requested task lives in
    ``include_path`` the built-in task index (about 15k YAML files, ~15 s to scan) is skipped.

    Args:
        model: a loaded ``PreTrainedModel`` (fla DeltaNet/GatedDeltaNet, transformers Mamba2/Qwen3.5, ...).
            On CPU, call ``statereduce.kernels.fla_fallback.install()`` first for fla models.
        tokenizer: its tokenizer (instance or name/path).
        tasks: lm-eval task, group or tag names (``"wikitext"``, ``"lambada_openai"``, ...) and/or
            local task names written by :mod:`statereduce.eval.tasks`.
        include_path: folder(s) with local task YAMLs.
        batch_size: HFLM batch size (int or ``"auto"``); right padding, no attention mask.
        max_length: tokens per forward window (rolling-window length for perplexity); ``None`` lets
            HFLM read it from the config (default 2048).
        device: move the model there first; ``None`` keeps its current device (HFLM ignores its own
            ``device`` argument for a pre-loaded model).
        limit: documents per task (int) or fraction (float < 1); for smoke tests only.
        bootstrap_iters: lm-eval's bootstrap draws for the stderr of bootstrappable metrics (0: none).
        num_fewshot: override the tasks' few-shot count (``None``: each task's own default, else 0).
        metadata: task metadata merged into every task's config (``TaskManager(metadata=...)``), e.g.
            RULER's ``max_seq_lengths``. When given without ``tokenizer``/``pretrained``, the tokenizer's
            ``name_or_path`` is added as ``tokenizer`` (RULER sizes its prompts with a tokenizer loaded
            by name).

    Returns:
        ``{"metrics", "lm_eval", "settings", "timing"}``, JSON-serialisable.
    """
    tasks = _checked_tasks(tasks, batch_size, max_length)
    metadata = task_metadata(metadata, tokenizer)
    t0 = time.perf_counter()
    task_manager = build_task_manager(tasks, include_path, metadata=metadata)
    t_index = time.perf_counter() - t0

    lm = _scoring_lm(model, tokenizer, batch_size, max_length, device)
    t1 = time.perf_counter()
    out = _simple_evaluate(
        model, lm, tasks, task_manager, limit=limit, num_fewshot=num_fewshot, bootstrap_iters=bootstrap_iters
    )
    t_eval = time.perf_counter() - t1

    settings = {
        "tasks": tasks,
        "include_path": [str(Path(p).resolve()) for p in _as_list(include_path)],
        "batch_size": batch_size,
        "max_length": int(lm.max_length),
        "device": str(model.device),
        "dtype": str(next(model.parameters()).dtype),
        "limit": limit,
        "bootstrap_iters": bootstrap_iters,
        "num_fewshot": num_fewshot,
        "prefix_token_id": int(lm.prefix_token_id),
        **({"metadata": dict(metadata)} if metadata else {}),
    }
    return {
        "metrics": clean_metrics(out["results"]),
        "lm_eval": jsonable(_raw_lm_eval(out)),
        "settings": jsonable(settings),
        "timing": {"task_index_s": round(t_index, 3), "evaluate_s": round(t_eval, 3)},
    }


def _checked_tasks(tasks: Sequence[str], batch_size: int | str, max_length: int | None) -> list[str]:
    """``tasks`` as a list, after checking the arguments of :func:`evaluate_model`."""
    if isinstance(tasks, str) or not tasks:
        raise ValueError(f"tasks must be a non-empty list of task names, got {tasks!r}")
    if isinstance(batch_size, int) and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 or 'auto', got {batch_size}")
    if max_length is not None and max_length < 2:
        raise ValueError(f"max_length must be >= 2 or None, got {max_length}")
    return list(tasks)


def _scoring_lm(model: nn.Module, tokenizer, batch_size: int | str, max_length: int | None, device):
    """``model`` (moved to ``device`` when given) wrapped in the scoring ``HFLM`` on the model's device."""
    if device is not None:
        model.to(device)
    return _scoring_hflm_class()(
        pretrained=model,
        tokenizer=tokenizer,
        backend="causal",
        batch_size=batch_size,
        max_length=max_length,
        device=str(model.device),
    )


def _simple_evaluate(model: nn.Module, lm, tasks: list[str], task_manager, **kwargs) -> dict:
    """``lm_eval.simple_evaluate`` without samples; the model's train/eval mode is restored afterwards.

    lm-eval's environment report (``add_env_info``: ``torch.utils.collect_env``, which runs ``pip list`` and other
    programs, about 2 s a call on a CPU) is skipped: its keys are not among those kept (:data:`_RAW_KEYS`), and
    eval.json records the versions itself."""
    import lm_eval.evaluator
    from lm_eval import simple_evaluate

    was_training = model.training
    quiet = (mock.patch.object(lm_eval.evaluator, "add_env_info", lambda storage: None)
             if hasattr(lm_eval.evaluator, "add_env_info") else contextlib.nullcontext())
    try:
        with quiet:
            out = simple_evaluate(model=lm, tasks=tasks, task_manager=task_manager, log_samples=False, **kwargs)
    finally:
        model.train(was_training)
    if out is None:  # only non-zero ranks get None; we never run distributed here
        raise RuntimeError("lm_eval.simple_evaluate returned no results")
    return out


def build_task_manager(
    tasks: Sequence[str],
    include_path: Path | str | Sequence[Path | str] | None = None,
    include_defaults: bool = True,
    metadata: Mapping[str, Any] | None = None,
):
    """A ``TaskManager`` that knows every task in ``tasks``; a clear ``ValueError`` for unknown names.

    If every task is in ``include_path`` the built-in index is skipped (fast); otherwise lm-eval's
    full index plus ``include_path`` (later paths take precedence), unless ``include_defaults`` is off.
    ``metadata`` is merged into every loaded task's ``metadata`` (lm-eval passes it to a task's
    ``custom_dataset`` function as keyword arguments, which is how RULER reads ``max_seq_lengths``).
    """
    from lm_eval.tasks import TaskManager

    paths = [str(Path(p).resolve()) for p in _as_list(include_path)]
    meta = dict(metadata) if metadata else None
    for p in paths:
        if not Path(p).is_dir():
            raise ValueError(f"include_path {p!r} is not a folder")
    manager = None
    if paths:
        manager = TaskManager(include_path=paths, include_defaults=False, metadata=meta)
        if all(_known(manager, t) for t in tasks):
            return manager
    if include_defaults:
        manager = TaskManager(include_path=paths or None, metadata=meta)
    for t in tasks:
        if manager is None or not _known(manager, t):
            close = difflib.get_close_matches(t, manager.all_tasks, n=5, cutoff=0.6) if manager else []
            hint = f"; close matches: {', '.join(close)}" if close else ""
            where = ["lm-eval's tasks"] * include_defaults + paths
            raise ValueError(f"unknown lm-eval task {t!r} (searched {', '.join(where) or 'nothing'}){hint}")
    return manager


def task_metadata(metadata: Mapping[str, Any] | None, tokenizer) -> dict | None:
    """``metadata`` plus ``tokenizer`` (the tokenizer's name or path) when it names none; ``None`` if empty.

    lm-eval's RULER tasks generate their documents with a tokenizer loaded by name
    (``AutoTokenizer.from_pretrained``) from the task metadata (``tokenizer``, else ``pretrained``).
    """
    if not metadata:
        return None
    out = dict(metadata)
    if not any(isinstance(out.get(k), str) and out[k] for k in TOKENIZER_METADATA_KEYS):
        name = tokenizer if isinstance(tokenizer, str) else getattr(tokenizer, "name_or_path", None)
        if isinstance(name, str) and name:
            out["tokenizer"] = name
    return out


def _scoring_hflm_class():
    """``HFLM`` with one change: scoring forwards pass ``use_cache=False``.

    ``HFLM._model_call`` runs ``model(input_ids)``, so a recurrent model whose config says
    ``use_cache=True`` (fla's default) also builds and returns its recurrent and conv states for
    every scoring batch: wasted memory, and on CPU about twice the time. Generation
    (``_model_generate``) is untouched and keeps its cache. Defined lazily so that importing this
    module does not import lm-eval (~10 s).
    """
    global _ScoringHFLM
    if _ScoringHFLM is None:
        from lm_eval.models.huggingface import HFLM

        class ScoringHFLM(HFLM):
            def _model_call(self, inps, attn_mask=None, labels=None):
                if attn_mask is not None or labels is not None:  # seq2seq only
                    return super()._model_call(inps, attn_mask=attn_mask, labels=labels)
                with (
                    torch.no_grad(),
                    torch.autocast(
                        device_type=self.device.type,
                        dtype=self.mixed_precision_dtype,
                        enabled=self.mixed_precision_dtype is not None,
                    ),
                ):
                    return self.model(inps, use_cache=False).logits

        _ScoringHFLM = ScoringHFLM
    return _ScoringHFLM


_ScoringHFLM = None


def clean_metrics(results: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """lm-eval's ``results`` with clean metric names: ``{task: {metric: value}}``.

    ``"word_perplexity,none"`` becomes ``"word_perplexity"``; a non-default filter is kept as
    ``"exact_match/flexible-extract"``; stderrs keep their ``_stderr`` suffix and are dropped when
    lm-eval has none (``"N/A"``). ``alias`` and other non-numeric entries are dropped.
    """
    clean: dict[str, dict[str, Any]] = {}
    for task, res in results.items():
        row: dict[str, Any] = {}
        for key, value in res.items():
            if "," not in key or isinstance(value, bool) or not isinstance(value, numbers.Real):
                continue
            metric, filt = key.split(",", 1)
            row[metric if filt == "none" else f"{metric}/{filt}"] = jsonable(float(value))
        clean[task] = row
    return clean


def _known(manager, task: str) -> bool:
    return task in manager.all_tasks or (task.endswith((".yaml", ".yml")) and Path(task).is_file())


def _raw_lm_eval(out: Mapping[str, Any]) -> dict:
    raw = {k: out[k] for k in _RAW_KEYS if k in out}
    raw["configs"] = {
        task: {k: cfg[k] for k in _CONFIG_KEYS if k in cfg and cfg[k] is not None}
        for task, cfg in out.get("configs", {}).items()
    }
    for k in ("date", "git_hash", "lm_eval_version", "transformers_version"):
        if k in out:
            raw[k] = out[k]
    return raw


def evaluate_and_write(
    model: nn.Module,
    tokenizer,
    out_path: str | Path,
    *,
    eval_cfg: Mapping[str, Any],
    heldout_docs: Sequence[str] | None = None,
    local_tasks: Mapping[str, Callable[[Path], Sequence[str]]] | None = None,
    include_path: Path | str | Sequence[Path | str] | None = None,
    task_dir: str | Path | None = None,
    checkpoint: str | Path | None = None,
    model_id: str | None = None,
    extra_provenance: Mapping[str, Any] | None = None,
) -> dict:
    """Evaluate a loaded model and write its ``eval.json`` (the whole body of an evaluation rule).

    Local tasks (the held-out perplexity task, then each ``local_tasks`` writer's tasks) are written
    into ``task_dir``, which is then passed as ``include_path`` together with ``include_path``; without a
    ``task_dir`` they go to a temporary folder that is removed afterwards, so that neither the task files nor the
    ``datasets`` cache lm-eval builds beside them (Arrow files, ``.lock`` files) are left next to ``out_path``. Tasks
    whose ``task_max_length`` exceeds ``max_length`` run in a second lm-eval call with that window (so
    the RULER 4K prompts of the ``recall`` suite are never cut while WikiText keeps its 2K windows);
    the results are merged and ``settings.runs`` lists every call's tasks and window.

    Args:
        model: loaded model (fla on CPU: ``fla_fallback.install()`` first).
        tokenizer: its tokenizer.
        out_path: the ``eval.json`` to write.
        eval_cfg: ``tasks`` (lm-eval names, may be empty when local tasks are given),
            ``batch_size`` (1), ``max_length`` (None: from config), ``device`` (None: keep),
            ``limit`` (None), ``bootstrap_iters`` (100000), ``metadata`` (task metadata, see
            :func:`evaluate_model`), ``task_max_length`` (``{task: smallest window}``), ``suites`` (suite
            names whose averages go into the document's ``suites`` block, see :mod:`statereduce.eval.suites`).
        heldout_docs: held-out documents; when given, a local perplexity task named
            :data:`~statereduce.eval.tasks.HELDOUT` is written to ``task_dir`` and evaluated first.
        local_tasks: ``{label: writer}``; each ``writer(task_dir)`` writes local tasks and returns their
            names. A label that is a suite name (``recall_probe``) gives that suite its tasks.
        include_path: more folders of already written local tasks.
        task_dir: folder for the local tasks, kept afterwards (default: a temporary folder, removed).
        checkpoint, model_id, extra_provenance: provenance fields; the model's ``base_checkpoint``
            (:func:`statereduce.core.checkpoints.base_checkpoint`) is added when it has one.

    Returns:
        The written document: :func:`statereduce.eval.documents.eval_record` plus ``suites``
        (``{suite: {summary: value or None}}``) when ``eval_cfg["suites"]`` is non-empty.
    """
    unknown = sorted(set(eval_cfg) - set(EVAL_CFG_KEYS))
    if unknown:
        raise ValueError(f"unknown eval_cfg keys {unknown}; valid: {', '.join(EVAL_CFG_KEYS)}")
    with contextlib.ExitStack() as stack:
        if task_dir is None:
            task_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="statereduce-lm-eval-"))
        task_dir = Path(task_dir)
        local, written = write_local_tasks(task_dir, heldout_docs, local_tasks)
        tasks = local + [t for t in eval_cfg.get("tasks") or [] if t not in local]
        if not tasks:
            raise ValueError("nothing to evaluate: eval_cfg['tasks'] is empty and no local tasks were given")
        paths = ([task_dir] if local else []) + _as_list(include_path)
        result = evaluate_windows(model, tokenizer, tasks, paths, eval_cfg)
    if eval_cfg.get("suites"):
        result["suites"] = summarize_suites(result["metrics"], eval_cfg["suites"], written)
    base = base_checkpoint(model)
    checked = kernel_check_record(model)  # on CUDA: the fla kernel routes checked and which path ran each
    extra = {"state": state_record(model), "checkpoint": checkpoint, "model_id": model_id,
             **({"base_checkpoint": base} if base is not None else {}),
             **({"kernel_check": checked} if checked else {}), **(extra_provenance or {})}
    return write_eval_json(out_path, result, extra)


def write_local_tasks(
    task_dir: Path,
    heldout_docs: Sequence[str] | None,
    local_tasks: Mapping[str, Callable[[Path], Sequence[str]]] | None,
) -> tuple[list[str], dict[str, list[str]]]:
    """Write the local tasks of :func:`evaluate_and_write` into ``task_dir``.

    Returns:
        ``(names, written)``: every local task name once, the held-out task (:data:`HELDOUT`, when
        ``heldout_docs`` is given) first, then each writer's in order; and ``{label: names}`` per writer.
    """
    local: list[str] = []
    written: dict[str, list[str]] = {}
    if heldout_docs is not None:
        local.append(write_perplexity_task(heldout_docs, task_dir, HELDOUT))
    for label, writer in (local_tasks or {}).items():
        written[label] = list(writer(task_dir))
        local += [t for t in written[label] if t not in local]
    return local, written


def evaluate_windows(
    model: nn.Module, tokenizer, tasks: Sequence[str], include_path: Sequence[Path | str], eval_cfg: Mapping[str, Any]
) -> dict:
    """:func:`evaluate_model` once per window (:func:`_window_runs`), merged by :func:`merge_results`."""
    runs = _window_runs(tasks, eval_cfg.get("max_length"), eval_cfg.get("task_max_length") or {})
    results = [
        evaluate_model(
            model,
            tokenizer,
            run_tasks,
            include_path=list(include_path) or None,
            batch_size=eval_cfg.get("batch_size", 1),
            max_length=window,
            device=eval_cfg.get("device"),
            limit=eval_cfg.get("limit"),
            bootstrap_iters=eval_cfg.get("bootstrap_iters", 100_000),
            metadata=eval_cfg.get("metadata"),
        )
        for window, run_tasks in runs
    ]
    return merge_results(results)


def _window_runs(
    tasks: Sequence[str], max_length: int | None, task_max_length: Mapping[str, int]
) -> list[tuple[int | None, list[str]]]:
    """Group ``tasks`` by lm-eval window: ``max_length``, or a task's larger ``task_max_length``."""
    runs: dict[int | None, list[str]] = {}
    for t in tasks:
        need = task_max_length.get(t)
        window = need if need is not None and (max_length is None or need > max_length) else max_length
        runs.setdefault(window, []).append(t)
    return list(runs.items())


def merge_results(results: Sequence[Mapping[str, Any]]) -> dict:
    """One :func:`evaluate_model` result from several calls on disjoint tasks (one per window).

    ``metrics`` and every per-task part of the raw ``lm_eval`` record are merged; ``settings`` are the
    first call's with ``tasks`` of all calls and, for more than one call, ``runs``
    (``[{"tasks", "max_length"}, ...]``); ``timing`` adds up.
    """
    if not results:
        raise ValueError("results is empty; pass at least one evaluate_model result")
    if len(results) == 1:
        return dict(results[0])
    first = results[0]
    raw: dict[str, Any] = {}
    for res in results:
        for key, value in res["lm_eval"].items():
            if key in _PER_TASK_RAW_KEYS and isinstance(value, Mapping):
                raw[key] = {**raw.get(key, {}), **value}
            else:
                raw.setdefault(key, value)  # the model's config, versions: the first call's
    settings = dict(first["settings"])
    settings["tasks"] = [t for res in results for t in res["settings"]["tasks"]]
    settings["runs"] = [
        {"tasks": res["settings"]["tasks"], "max_length": res["settings"]["max_length"]} for res in results
    ]
    timing = {k: round(sum(res["timing"].get(k, 0.0) for res in results), 3) for k in first["timing"]}
    metrics = {task: row for res in results for task, row in res["metrics"].items()}
    return {"metrics": metrics, "lm_eval": raw, "settings": settings, "timing": timing}


def _as_list(x) -> list:
    if x is None:
        return []
    if isinstance(x, (list, tuple)):
        return list(x)
    return [x]

