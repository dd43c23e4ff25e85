"""The ``eval.json`` documents of the workflow: one checkpoint's evaluation, and the per-method summary.

- :func:`eval_record` / :func:`write_eval_json`: one checkpoint's ``eval.json``, the result of
  :func:`statereduce.eval.harness.evaluate_model` plus a ``state`` block (recurrent-state size, from the
  adapter, :func:`state_record`) and ``provenance`` (checkpoint, model, settings, ``versions``, date).
- :func:`summarize`: ``results/{model}/{method}_{pct}/eval.json`` from the baseline, pruned and (later) RFT
  documents: metrics per stage, suite averages, state size before and after.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from statereduce.core.runtime import jsonable, versions, write_json

if TYPE_CHECKING:
    from torch import nn

_STAGES = ("baseline", "pruned", "rft")


def state_record(model: nn.Module, dtype_bytes: int = 4) -> dict:
    """The recurrent-state block of ``eval.json``, from the model's adapter (paper Sec. 2: state d_k x d_v per head).

    Each linear-attention layer counts at its own key width (``key_dims``: {layer: d_k'}; a checkpoint whose layers
    keep different widths has several) and value width (``value_dims``, given where the layers' differ);
    ``d_k``, ``d_v`` and ``conv_elems_per_layer`` are the means over the layers.

    Args:
        model: a loaded model whose family has an adapter.
        dtype_bytes: bytes per state element (fp32 state by default, as fla keeps it).
    """
    from statereduce.adapters import get_adapter  # the package registers every family's adapter

    adapter = get_adapter(model)
    shapes = adapter.layer_state_shapes()
    first = next(iter(shapes.values()))
    return {
        "state_bytes_per_sequence": int(adapter.state_bytes(dtype_bytes)),
        "dtype_bytes": int(dtype_bytes),
        "d_k": layer_mean([s.d_k for s in shapes.values()]),
        "key_dims": {str(layer): int(s.d_k) for layer, s in shapes.items()},
        "d_v": layer_mean([s.d_v for s in shapes.values()]),
        **({"value_dims": {str(layer): int(s.d_v) for layer, s in shapes.items()}}
           if len({s.d_v for s in shapes.values()}) > 1 else {}),
        "num_heads": int(first.num_heads),
        "layers": len(shapes),
        "conv_elems_per_layer": layer_mean([s.conv_elems for s in shapes.values()]),
    }


def layer_mean(values: Sequence[int]) -> int | float:
    """The mean of a per-layer size (d_k', conv elements): an int when it is one (every layer alike, or a per-layer
    allocation of the same total as a uniform one), else a float."""
    total, n = sum(int(v) for v in values), len(values)
    return total // n if total % n == 0 else total / n


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
        result: the output of :func:`statereduce.eval.harness.evaluate_model`.
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
        "versions": versions(),
        "date": _now(),
    }
    provenance.update(extra_provenance or {})
    return jsonable({**result, "state": dict(state), "provenance": provenance})


def write_eval_json(path: str | Path, result: Mapping[str, Any], extra: Mapping[str, Any]) -> dict:
    """Write a checkpoint's ``eval.json`` atomically and return the document.

    Args:
        path: output file.
        result: the output of :func:`statereduce.eval.harness.evaluate_model`.
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


def summarize(
    baseline_eval: Mapping[str, Any],
    pruned_eval: Mapping[str, Any],
    rft_eval: Mapping[str, Any] | None,
    meta: Mapping[str, Any],
    rft_record: Mapping[str, Any] | None = None,
) -> dict:
    """The summary ``eval.json`` the user asks for: metrics before/after pruning (and after RFT), state size.

    Args:
        baseline_eval: ``eval.json`` document of the unpruned model.
        pruned_eval: ``eval.json`` of the pruned checkpoint.
        rft_eval: ``eval.json`` of the recovery-fine-tuned checkpoint, or ``None`` (slot stays null).
        meta: ``model``, ``method``, ``pct`` (percent of key channels removed, paper's "compression");
            any other keys go into ``provenance``.
        rft_record: ``rft_record.json`` of the RFT checkpoint: its steps and validation curve become the summary's
            ``rft`` entry.

    Returns:
        ``{"model", "method", "pct", "metrics": {"baseline", "pruned", "rft"}, "state": {"bytes_before",
        "bytes_after", "ratio", "d_k_before", "d_k_after", "key_dims_after"}, "provenance"}`` (``key_dims_after``: the
        pruned model's {layer: d_k'}, where its document has them; ``d_v_before`` and ``d_v_after`` where a value cut
        changed d_v, and ``value_dims_after`` ({layer: d_v'}) where its layers keep different ones), plus
        ``"suites": {"baseline", "pruned", "rft"}`` (the documents' suite averages) when any document has them, and
        ``"rft": {"steps", "kept_step", "best_step", "metric", "val_loss_start", "val_loss_kept", "curve": [[step,
        val_loss], ...]}`` (the validation loss is the record's ``metric``) when ``rft_record`` has a validation curve,
        else null. Raises ``ValueError`` if the documents were evaluated on different tasks or windows (their metrics
        would not be comparable).
    """
    docs = _summarized_documents(baseline_eval, pruned_eval, rft_eval, meta)
    state = _state_summary(baseline_eval["state"], pruned_eval["state"], rft_eval)
    provenance = {
        "evals": {stage: _brief_provenance(doc) for stage, doc in docs.items()},
        **{k: v for k, v in meta.items() if k not in ("model", "method", "pct")},
        "versions": versions(),
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
            "state": state,
            "rft": _rft_brief(rft_record),
            "provenance": provenance,
        }
    )


def _summarized_documents(baseline_eval: Mapping[str, Any], pruned_eval: Mapping[str, Any],
                          rft_eval: Mapping[str, Any] | None, meta: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """The documents :func:`summarize` compares, by stage (``rft`` where given), once ``meta`` names the model,
    method and pct and every document has ``metrics`` and ``state`` and was evaluated on the baseline's tasks and
    window (one-line ValueErrors)."""
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
    return docs


def _state_summary(baseline: Mapping[str, Any], pruned: Mapping[str, Any],
                   rft_eval: Mapping[str, Any] | None) -> dict[str, Any]:
    """The summary's ``state`` entry from the baseline's and the pruned model's ``state`` blocks (:func:`summarize`'s
    Returns); a ValueError when the RFT checkpoint's state bytes differ from the pruned one's."""
    before = int(baseline["state_bytes_per_sequence"])
    after = int(pruned["state_bytes_per_sequence"])
    if rft_eval is not None and int(rft_eval["state"]["state_bytes_per_sequence"]) != after:
        raise ValueError(
            f"RFT state bytes {rft_eval['state']['state_bytes_per_sequence']} != pruned state bytes {after}; "
            "RFT must not change shapes"
        )
    return {
        "bytes_before": before,
        "bytes_after": after,
        "ratio": after / before if before else None,
        "d_k_before": baseline.get("d_k"),
        "d_k_after": pruned.get("d_k"),
        **({"key_dims_after": pruned["key_dims"]} if "key_dims" in pruned else {}),
        **({"d_v_before": baseline["d_v"], "d_v_after": pruned["d_v"]} if baseline.get("d_v") != pruned.get("d_v")
           else {}),
        **({"value_dims_after": pruned["value_dims"]} if "value_dims" in pruned else {}),
    }


def _rft_brief(record: Mapping[str, Any] | None) -> dict | None:
    """The summary's ``rft`` entry: steps, the kept step and the validation curve of an ``rft_record.json``."""
    val = (record or {}).get("validation")
    if not val:
        return None
    metric = val["metric"]
    curve = [[int(r["step"]), float(r[metric])] for r in val["curve"]]
    by_step = dict(curve)
    return {"steps": int(record["steps"]), "kept_step": int(val["kept_step"]), "best_step": int(val["best_step"]),
            "metric": metric, "val_loss_start": by_step.get(0), "val_loss_kept": by_step.get(int(val["kept_step"])),
            "curve": curve}


def _comparable(doc: Mapping[str, Any]) -> dict:
    s = doc.get("settings") or doc.get("provenance", {}).get("settings") or {}
    return {"tasks": sorted(doc["metrics"]), "max_length": s.get("max_length"), "limit": s.get("limit")}


def _brief_provenance(doc: Mapping[str, Any]) -> dict:
    p = doc.get("provenance", {})
    brief = {k: p.get(k) for k in ("checkpoint", "model_id", "date", "versions")}
    return {**brief, "base_checkpoint": p["base_checkpoint"]} if "base_checkpoint" in p else brief


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
