"""Evaluation through lm-eval-harness, and the ``eval.json`` documents of the workflow.

The paper (Sec. 4, Tables 1-6) reports WikiText-2 word perplexity, LAMBADA perplexity and accuracy,
ARC-Easy/Challenge, HellaSwag, WinoGrande and PIQA, plus a recall suite. All of them run here
through lm-eval's own tasks and ``lm_eval.simple_evaluate`` on an already-loaded model wrapped in
``HFLM``. Offline, the same code path runs *local-file* tasks: :func:`write_perplexity_task` writes
held-out documents to JSONL plus an lm-eval task YAML that mirrors lm-eval's ``wikitext`` task
(``loglikelihood_rolling``; word perplexity, byte perplexity, bits per byte with lm-eval's own
aggregations), :func:`write_multiple_choice_task` mirrors lm-eval's zero-shot accuracy tasks
(``multiple_choice``; ``acc``, ``acc_norm``), and :func:`evaluate_model` is pointed at that folder
with ``include_path``. Which lm-eval tasks a model runs comes from its ``eval.tasks`` and named
``eval.suites`` (:mod:`statereduce.eval.suites`, paper Sec. 5 and App. C.4).

Documents:
- :func:`evaluate_model` returns ``{"metrics": {task: {metric: value}}, "lm_eval": {...raw...},
  "settings": {...}, "timing": {...}}``; metric names are clean (``word_perplexity``), lm-eval's raw
  keys (``word_perplexity,none``) stay in the raw part.
- :func:`write_eval_json` writes one checkpoint's ``eval.json``: that result plus a ``state`` block
  (recurrent-state size, from the adapter) and ``provenance``.
- :func:`evaluate_and_write` adds a ``suites`` block (suite averages such as ``lm_avg``; ``None``
  for a task that did not run) when the model's eval selects suites.
- :func:`summarize` builds ``results/{model}/{method}_{pct}/eval.json`` from the baseline, pruned
  and (later) RFT documents.

Recurrent models and HFLM: for ``loglikelihood_rolling`` (and every other loglikelihood request)
HFLM calls ``model(input_ids)`` with no attention mask (``HFLM._model_call``), right-padding the
batch. Right padding cannot change earlier positions of a causal model, so batch sizes > 1 give
the same numbers as 1, and fla never takes its varlen path (which an attention mask would trigger).
"""

from __future__ import annotations

import datetime as _dt
import difflib
import hashlib
import importlib.metadata
import json
import logging
import numbers
import re
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

import statereduce
from statereduce.runtime import jsonable, write_json, write_text_atomic

log = logging.getLogger(__name__)

HELDOUT_TASK = "statereduce_heldout"
"""Default name of the local held-out perplexity task (prefixed so it never shadows an lm-eval task)."""

PERPLEXITY_METRICS = ("word_perplexity", "byte_perplexity", "bits_per_byte")

EVAL_CFG_KEYS = (
    "tasks",
    "batch_size",
    "max_length",
    "device",
    "limit",
    "bootstrap_iters",
    "heldout_task",
    "metadata",
    "task_max_length",
    "suites",
)
"""Keys accepted in the ``eval_cfg`` mapping of :func:`evaluate_and_write`."""

TASK_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
"""Valid local task names: letters, digits, ``_``, ``.``, ``-``, not starting with ``.`` or ``-``."""

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


# ---------------------------------------------------------------------------------------------
# local-file tasks
# ---------------------------------------------------------------------------------------------
def write_perplexity_task(docs: Sequence[str], task_dir: Path, name: str = HELDOUT_TASK) -> str:
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
        The task name, to put in the ``tasks`` list of :func:`evaluate_model`.
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


MULTIPLE_CHOICE_METRICS = ("acc", "acc_norm")


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
    import yaml

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


# ---------------------------------------------------------------------------------------------
# running lm-eval
# ---------------------------------------------------------------------------------------------
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
    """Evaluate an already-loaded causal LM on lm-eval tasks (paper Sec. 4 metrics).

    Wraps ``model`` in ``lm_eval.models.huggingface.HFLM`` (scoring without building a cache, see
    :func:`_scoring_hflm_class`) and calls ``lm_eval.simple_evaluate``
    with a ``TaskManager`` that also indexes ``include_path``. If every requested task lives in
    ``include_path`` the built-in task index (about 15k YAML files, ~15 s to scan) is skipped.

    Args:
        model: a loaded ``PreTrainedModel`` (fla DeltaNet/GatedDeltaNet, transformers Mamba2/Qwen3.5, ...).
            On CPU, call ``statereduce.kernels.fla_fallback.install()`` first for fla models.
        tokenizer: its tokenizer (instance or name/path).
        tasks: lm-eval task, group or tag names (``"wikitext"``, ``"lambada_openai"``, ...) and/or
            local task names written by :func:`write_perplexity_task`.
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
    if isinstance(tasks, str) or not tasks:
        raise ValueError(f"tasks must be a non-empty list of task names, got {tasks!r}")
    tasks = list(tasks)
    if isinstance(batch_size, int) and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 or 'auto', got {batch_size}")
    if max_length is not None and max_length < 2:
        raise ValueError(f"max_length must be >= 2 or None, got {max_length}")

    metadata = task_metadata(metadata, tokenizer)
    t0 = time.perf_counter()
    task_manager = build_task_manager(tasks, include_path, metadata=metadata)
    t_index = time.perf_counter() - t0

    from lm_eval import simple_evaluate

    if device is not None:
        model.to(device)
    was_training = model.training
    lm = _scoring_hflm_class()(
        pretrained=model,
        tokenizer=tokenizer,
        backend="causal",
        batch_size=batch_size,
        max_length=max_length,
        device=str(model.device),
    )
    t1 = time.perf_counter()
    try:
        out = simple_evaluate(
            model=lm,
            tasks=tasks,
            task_manager=task_manager,
            limit=limit,
            num_fewshot=num_fewshot,
            bootstrap_iters=bootstrap_iters,
            log_samples=False,
        )
    finally:
        model.train(was_training)
    t_eval = time.perf_counter() - t1
    if out is None:  # only non-zero ranks get None; we never run distributed here
        raise RuntimeError("lm_eval.simple_evaluate returned no results")

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


# ---------------------------------------------------------------------------------------------
# eval.json of one checkpoint
# ---------------------------------------------------------------------------------------------
def state_record(model: nn.Module, dtype_bytes: int = 4) -> dict:
    """The recurrent-state block of ``eval.json``, from the model's adapter (paper Sec. 2: state d_k x d_v per head).

    Args:
        model: a loaded model whose family has an adapter.
        dtype_bytes: bytes per state element (fp32 state by default, as fla keeps it).
    """
    import statereduce.adapters  # noqa: F401  (registers the family adapters)
    from statereduce.adapters.base import get_adapter

    adapter = get_adapter(model)
    shape = adapter.state_shape()
    return {
        "state_bytes_per_sequence": int(adapter.state_bytes(dtype_bytes)),
        "dtype_bytes": int(dtype_bytes),
        "d_k": int(shape.d_k),
        "d_v": int(shape.d_v),
        "num_heads": int(shape.num_heads),
        "layers": int(adapter.num_mixer_layers()),
        "conv_elems_per_layer": int(shape.conv_elems),
    }


def eval_record(
    result: Mapping[str, Any],
    state: Mapping[str, Any],
    *,
    checkpoint: str | Path | None = None,
    model_id: str | None = None,
    extra_provenance: Mapping[str, Any] | None = None,
) -> dict:
    """The ``eval.json`` document of one checkpoint: ``result`` + ``state`` + ``provenance``.

    Args:
        result: the output of :func:`evaluate_model`.
        state: the output of :func:`state_record` (must hold ``state_bytes_per_sequence``).
        checkpoint: path of the evaluated checkpoint (or hub id).
        model_id: the workflow's model name (``{model}`` wildcard).
        extra_provenance: more provenance fields (stage, method, pct, revision, ...).
    """
    for key in ("metrics", "settings"):
        if key not in result:
            raise ValueError(f"result lacks {key!r}; pass the output of evaluate_model (keys: {sorted(result)})")
    if "state_bytes_per_sequence" not in state:
        raise ValueError(f"state lacks 'state_bytes_per_sequence' (keys: {sorted(state)}); use state_record(model)")
    provenance = {
        "checkpoint": str(checkpoint) if checkpoint is not None else None,
        "model_id": model_id,
        "tasks": list(result["settings"].get("tasks", [])),
        "settings": dict(result["settings"]),
        **versions(),
        "date": _now(),
    }
    provenance.update(extra_provenance or {})
    return jsonable({**result, "state": dict(state), "provenance": provenance})


def write_eval_json(path: str | Path, result: Mapping[str, Any], extra: Mapping[str, Any]) -> dict:
    """Write a checkpoint's ``eval.json`` atomically and return the document.

    Args:
        path: output file.
        result: the output of :func:`evaluate_model`.
        extra: ``{"state": state_record(model), "checkpoint": ..., "model_id": ..., <more provenance>}``;
            ``state`` is required, every other key goes into ``provenance``.
    """
    if "state" not in extra:
        raise ValueError(f"extra lacks 'state' (keys: {sorted(extra)}); pass {{'state': state_record(model), ...}}")
    rest = {k: v for k, v in extra.items() if k not in ("state", "checkpoint", "model_id")}
    doc = eval_record(
        result,
        extra["state"],
        checkpoint=extra.get("checkpoint"),
        model_id=extra.get("model_id"),
        extra_provenance=rest,
    )
    write_json(path, doc)
    return doc


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
    into ``task_dir``, which is then passed as ``include_path`` together with ``include_path``. Tasks
    whose ``task_max_length`` exceeds ``max_length`` run in a second lm-eval call with that window (so
    the RULER 4K prompts of the ``recall`` suite are never cut while WikiText keeps its 2K windows);
    the results are merged and ``settings.runs`` lists every call's tasks and window.

    Args:
        model: loaded model (fla on CPU: ``fla_fallback.install()`` first).
        tokenizer: its tokenizer.
        out_path: the ``eval.json`` to write.
        eval_cfg: ``tasks`` (lm-eval names, may be empty when local tasks are given),
            ``batch_size`` (1), ``max_length`` (None: from config), ``device`` (None: keep),
            ``limit`` (None), ``bootstrap_iters`` (100000), ``heldout_task`` (``statereduce_heldout``),
            ``metadata`` (task metadata, see :func:`evaluate_model`), ``task_max_length``
            (``{task: smallest window}``), ``suites`` (suite names whose averages go into the
            document's ``suites`` block, see :mod:`statereduce.eval.suites`).
        heldout_docs: held-out documents; when given, a local perplexity task is written to
            ``task_dir`` and evaluated first.
        local_tasks: ``{label: writer}``; each ``writer(task_dir)`` writes local tasks and returns their
            names. A label that is a suite name (``recall_probe``) gives that suite its tasks.
        include_path: more folders of already written local tasks.
        task_dir: folder for the local tasks (default: a folder next to ``out_path``).
        checkpoint, model_id, extra_provenance: provenance fields.

    Returns:
        The written document: :func:`eval_record` plus ``suites`` (``{suite: {summary: value or None}}``)
        when ``eval_cfg["suites"]`` is non-empty.
    """
    from statereduce.eval.suites import summarize_suites

    unknown = sorted(set(eval_cfg) - set(EVAL_CFG_KEYS))
    if unknown:
        raise ValueError(f"unknown eval_cfg keys {unknown}; valid: {', '.join(EVAL_CFG_KEYS)}")
    task_dir = Path(task_dir) if task_dir is not None else Path(out_path).parent / "lm_eval_tasks"
    local: list[str] = []
    written: dict[str, list[str]] = {}
    if heldout_docs is not None:
        local.append(write_perplexity_task(heldout_docs, task_dir, eval_cfg.get("heldout_task", HELDOUT_TASK)))
    for label, writer in (local_tasks or {}).items():
        written[label] = list(writer(task_dir))
        local += [t for t in written[label] if t not in local]
    tasks = local + [t for t in eval_cfg.get("tasks") or [] if t not in local]
    if not tasks:
        raise ValueError("nothing to evaluate: eval_cfg['tasks'] is empty and no local tasks were given")
    paths = ([task_dir] if local else []) + _as_list(include_path)
    runs = _window_runs(tasks, eval_cfg.get("max_length"), eval_cfg.get("task_max_length") or {})
    results = [
        evaluate_model(
            model,
            tokenizer,
            run_tasks,
            include_path=paths or None,
            batch_size=eval_cfg.get("batch_size", 1),
            max_length=window,
            device=eval_cfg.get("device"),
            limit=eval_cfg.get("limit"),
            bootstrap_iters=eval_cfg.get("bootstrap_iters", 100_000),
            metadata=eval_cfg.get("metadata"),
        )
        for window, run_tasks in runs
    ]
    result = merge_results(results)
    if eval_cfg.get("suites"):
        result["suites"] = summarize_suites(result["metrics"], eval_cfg["suites"], written)
    extra = {"state": state_record(model), "checkpoint": checkpoint, "model_id": model_id, **(extra_provenance or {})}
    return write_eval_json(out_path, result, extra)


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


# ---------------------------------------------------------------------------------------------
# the summary results/{model}/{method}_{pct}/eval.json
# ---------------------------------------------------------------------------------------------
def summarize(
    baseline_eval: Mapping[str, Any],
    pruned_eval: Mapping[str, Any],
    rft_eval: Mapping[str, Any] | None,
    meta: Mapping[str, Any],
) -> dict:
    """The summary ``eval.json`` the user asks for: metrics before/after pruning (and after RFT), state size.

    Args:
        baseline_eval: ``eval.json`` document of the unpruned model.
        pruned_eval: ``eval.json`` of the pruned checkpoint.
        rft_eval: ``eval.json`` of the recovery-fine-tuned checkpoint, or ``None`` (slot stays null).
        meta: ``model``, ``method``, ``pct`` (percent of key channels removed, paper's "compression");
            any other keys go into ``provenance``.

    Returns:
        ``{"model", "method", "pct", "metrics": {"baseline", "pruned", "rft"}, "state": {"bytes_before",
        "bytes_after", "ratio"}, "provenance"}``, plus ``"suites": {"baseline", "pruned", "rft"}`` (the
        documents' suite averages) when any document has them. Raises ``ValueError`` if the documents were evaluated
        on different tasks or windows (their metrics would not be comparable).
    """
    missing = [k for k in ("model", "method", "pct") if k not in meta]
    if missing:
        raise ValueError(f"meta lacks {missing}; required: model, method, pct")
    docs = {"baseline": baseline_eval, "pruned": pruned_eval}
    if rft_eval is not None:
        docs["rft"] = rft_eval
    for stage, doc in docs.items():
        for key in ("metrics", "state"):
            if key not in doc:
                raise ValueError(f"{stage} eval lacks {key!r} (keys: {sorted(doc)}); pass an eval.json document")
    ref = _comparable(baseline_eval)
    for stage, doc in docs.items():
        if _comparable(doc) != ref:
            raise ValueError(f"{stage} eval settings {_comparable(doc)} differ from baseline's {ref}; not comparable")
    before = int(baseline_eval["state"]["state_bytes_per_sequence"])
    after = int(pruned_eval["state"]["state_bytes_per_sequence"])
    if rft_eval is not None and int(rft_eval["state"]["state_bytes_per_sequence"]) != after:
        raise ValueError(
            f"RFT state bytes {rft_eval['state']['state_bytes_per_sequence']} != pruned state bytes {after}; "
            "RFT must not change shapes"
        )
    provenance = {
        "evals": {stage: _brief_provenance(doc) for stage, doc in docs.items()},
        **{k: v for k, v in meta.items() if k not in ("model", "method", "pct")},
        "statereduce_version": statereduce.__version__,
        "date": _now(),
    }
    return jsonable(
        {
            "model": meta["model"],
            "method": meta["method"],
            "pct": meta["pct"],
            "metrics": {
                "baseline": baseline_eval["metrics"],
                "pruned": pruned_eval["metrics"],
                "rft": rft_eval["metrics"] if rft_eval is not None else None,
            },
            **(
                {"suites": {stage: docs[stage].get("suites") if stage in docs else None for stage in _STAGES}}
                if any(doc.get("suites") for doc in docs.values())
                else {}
            ),
            "state": {
                "bytes_before": before,
                "bytes_after": after,
                "ratio": after / before if before else None,
                "d_k_before": baseline_eval["state"].get("d_k"),
                "d_k_after": pruned_eval["state"].get("d_k"),
            },
            "provenance": provenance,
        }
    )


_STAGES = ("baseline", "pruned", "rft")


def _comparable(doc: Mapping[str, Any]) -> dict:
    s = doc.get("settings") or doc.get("provenance", {}).get("settings") or {}
    return {"tasks": sorted(doc["metrics"]), "max_length": s.get("max_length"), "limit": s.get("limit")}


def _brief_provenance(doc: Mapping[str, Any]) -> dict:
    p = doc.get("provenance", {})
    return {k: p.get(k) for k in ("checkpoint", "model_id", "date", "statereduce_version", "lm_eval_version")}


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def versions() -> dict[str, str | None]:
    """Versions of the packages an evaluation depends on."""
    out: dict[str, str | None] = {"statereduce_version": statereduce.__version__, "torch_version": torch.__version__}
    for key, dist in (
        ("lm_eval_version", "lm_eval"),
        ("transformers_version", "transformers"),
        ("datasets_version", "datasets"),
        ("fla_version", "flash-linear-attention"),
    ):
        try:
            out[key] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[key] = None
    return out


def _as_list(x) -> list:
    if x is None:
        return []
    if isinstance(x, (list, tuple)):
        return list(x)
    return [x]


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
