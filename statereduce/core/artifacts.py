"""Checks made where a job reads an artifact of another job: was it written for this job, and can it be read?

Each artifact records where it comes from: the HDF5 files' attributes (``qk.h5``, ``activations.h5``,
``grad_scores.h5``), the selection file's Parquet metadata and the pruned checkpoint's ``prune_record.json``
name the model, its family, head sizes and, where they apply, the calibration id, method token and pct. A
reader passes what its job expects (the rule's ``params.info``, the method and pct of its path) and
:func:`check_provenance` compares every fact of :data:`CHECKED` that both sides name, so a file copied from
another model or calibration fails instead of giving a silently wrong result. A file that cannot be read
(truncated, or not of its format) fails the same way: one line naming the file and the rule that rebuilds it.
Imports nothing heavy (selection jobs use it without torch).
"""

from __future__ import annotations

import json
import numbers
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: The rule that writes each artifact, by file name (a suffix for the selection files).
REBUILT_BY = {
    "qk.h5": "qk_weights",
    "activations.h5": "calibrate",
    "grad_scores.h5": "grad_scores",
    ".parquet": "select_channels",
    ".allocation.json": "allocate",
    ".split.json": "split",
    ".values.json": "budget_values",
    ".fit.safetensors": "fit",
    "prune_record.json": "prune",
}

#: Provenance facts compared between an artifact and the job reading it (other keys of either side are ignored).
CHECKED = ("model", "family", "calibration", "method", "pct", "num_heads", "head_k_dim")


class ArtifactError(ValueError):
    """An artifact that cannot be read or was written for another job (one line, with the remedy)."""


def rebuilt_by(path: str | os.PathLike) -> str | None:
    """The rule that writes ``path`` (by its file name), or None for a file no rule writes."""
    name = Path(path).name
    for key, rule in REBUILT_BY.items():
        if name == key or (key.startswith(".") and name.endswith(key)):
            return rule
    return None


def remedy(path: str | os.PathLike) -> str:
    """``delete it and rerun (rule X rebuilds it)`` for ``path``."""
    rule = rebuilt_by(path)
    return f"delete it and rerun ({f'rule {rule}' if rule else 'the rule that wrote it'} rebuilds it)"


def unreadable(path: str | os.PathLike, kind: str, err: BaseException) -> ArtifactError:
    """The one-line error for an artifact ``path`` that ``kind``'s reader (HDF5, Parquet, JSON) failed on."""
    text = str(err).strip()
    detail = text.splitlines()[0] if text else type(err).__name__
    return ArtifactError(f"{path} is not a readable {kind} file ({detail}); {remedy(path)}")


def missing(path: str | os.PathLike) -> FileNotFoundError:
    """The one-line error for an artifact ``path`` that does not exist."""
    rule = rebuilt_by(path)
    return FileNotFoundError(
        f"{path} does not exist; {f'rule {rule} builds it' if rule else 'rerun the rule that writes it'}"
    )


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") and getattr(value, "ndim", 1) == 0 else value


def _same(recorded: Any, expected: Any) -> bool:
    recorded, expected = _plain(recorded), _plain(expected)
    numeric = (numbers.Real,)
    if isinstance(recorded, numeric) and isinstance(expected, numeric) and not isinstance(recorded, bool):
        return float(recorded) == float(expected)
    return str(recorded) == str(expected)


def _model(facts: Mapping[str, Any]) -> str:
    name, family = facts.get("model"), facts.get("family")
    if name is None:
        return f"a {family} model"
    return f"{str(name)!r} ({family})" if family is not None else repr(str(name))


def check_provenance(path: str | os.PathLike, recorded: Mapping[str, Any], expected: Mapping[str, Any] | None) -> None:
    """Raise :class:`ArtifactError` when ``path`` was written for another job.

    Args:
        path: the artifact (named in the message).
        recorded: its provenance (HDF5 attributes, selection metadata, record fields).
        expected: what the reading job expects; only the keys of :data:`CHECKED` that both sides give (not None)
            are compared, numbers as floats.
    Raises:
        ArtifactError: one line, e.g. ``activations.h5 was written for model 'tiny-gdn' (gated_deltanet); this
            job is for 'tiny-dn' (delta_net); delete it and rerun (rule calibrate rebuilds it)``.
    """
    expected = expected or {}
    diffs = [
        k for k in CHECKED
        if expected.get(k) is not None and recorded.get(k) is not None and not _same(recorded[k], expected[k])
    ]
    if not diffs:
        return
    if {"model", "family"} & set(diffs):
        was = f"model {_model(recorded)}" if recorded.get("model") is not None else _model(recorded)
        raise ArtifactError(f"{path} was written for {was}; this job is for {_model(expected)}; {remedy(path)}")
    was = ", ".join(f"{k}={_plain(recorded[k])!r}" for k in diffs)
    wants = ", ".join(f"{k}={_plain(expected[k])!r}" for k in diffs)
    raise ArtifactError(f"{path} was written with {was}; this job expects {wants}; {remedy(path)}")


PRUNE_RECORD = "prune_record.json"
"""The record a pruned (or RFT) checkpoint folder holds (:mod:`statereduce.stages.prune`)."""


def read_json_artifact(path: str | os.PathLike, kind: str, fmt: int, key: str,
                       expected: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A JSON artifact of ``kind`` (``allocation``, ``budget values``): read, of format ``fmt`` with a ``key`` entry,
    and written for the job that reads it (:func:`check_provenance`).

    Raises:
        FileNotFoundError, ArtifactError: one line naming the file and the rule that rebuilds it.
    """
    if not Path(path).exists():
        raise missing(path)
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise unreadable(path, kind, err) from None
    if not isinstance(doc, dict) or doc.get("format") != fmt or key not in doc:
        article = "an" if kind[0] in "aeiou" else "a"
        raise ArtifactError(f"{path} is not {article} {kind} file (format {fmt}); {remedy(path)}")
    check_provenance(path, doc, expected)
    return doc


def check_prune_record(checkpoint: str | os.PathLike, expected: Mapping[str, Any]) -> dict[str, Any]:
    """The ``prune_record.json`` of a pruned (or RFT) checkpoint as a dict, checked against a job's expectations.

    Args:
        checkpoint: the checkpoint folder.
        expected: what the reading job expects (``params.info`` with the ``method`` and ``pct`` of its path);
            the record's model (recorded in ``extra`` from the selection file), family, method and pct must agree
            (:func:`statereduce.core.artifacts.check_provenance`).
    Raises:
        ArtifactError: one line, for a record that is not JSON or was written for another job.
    """
    path = Path(checkpoint) / PRUNE_RECORD
    if not path.is_file():
        raise missing(path)
    try:
        record = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise unreadable(path, "JSON", err) from None
    if not isinstance(record, dict):
        raise ArtifactError(f"{path} is not a prune record (not a JSON object); {remedy(path)}")
    extra = record.get("extra") if isinstance(record.get("extra"), dict) else {}
    check_provenance(path, {**record, "model": extra.get("model")}, expected)
    return record
