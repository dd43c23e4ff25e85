"""Checkpoint folders: the files :func:`statereduce.core.models.load_model` reads, their SHA-256, and the provenance
every artifact made from a model records.

A ``local:`` model's checkpoint lives outside ``results/``. The workflow makes these files inputs of every job that
reads them (``rules/common.smk``, ``get_checkpoint_files``), so new weights rerun the base job and everything
downstream, and the base job records their SHA-256 in ``source.json``
(:func:`statereduce.core.models.write_hub_source`).
The jobs that load the model copy the digests from there (:func:`checkpoint_provenance`, attached to the loaded model,
:func:`base_checkpoint`) instead of hashing the weights again.

Imports nothing heavy and nothing else from the package: config validation and the DAG build use it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

SOURCE_FILE = "source.json"
"""The base artifact of a hub or local model: what to load, never a copy of the weights."""

ADAPTER_DIR = "adapter"
"""The folder of an RFT checkpoint holding its LoRA adapter in peft's format
(:func:`statereduce.stages.rft.save_adapter`), which rule export copies."""

BASE_ATTR = "statereduce_base_checkpoint"
"""The attribute :func:`statereduce.core.models.load_model` sets on every model it loads: :func:`checkpoint_provenance`
of its folder."""

#: Weight files, in the names ``save_pretrained`` gives them (one file, or shards and their index).
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json", "pytorch_model*.bin.index.json")

#: Everything else that loading reads: the config, the generation config, the tokenizer's files.
CHECKPOINT_PATTERNS = (
    "config.json",
    "generation_config.json",
    *WEIGHT_PATTERNS,
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "chat_template*",
)

_CHUNK = 1 << 20


def _matching(folder: str | Path, patterns: tuple[str, ...]) -> list[Path]:
    folder = Path(folder).expanduser()
    found = {p for pattern in patterns for p in folder.glob(pattern) if p.is_file() and not p.name.startswith(".")}
    return sorted(found)


def weight_files(folder: str | Path) -> list[Path]:
    """The weight files (and shard indexes) at the top of ``folder``, sorted; empty when it holds none."""
    return _matching(folder, WEIGHT_PATTERNS)


def checkpoint_files(folder: str | Path) -> list[Path]:
    """The files of ``folder`` that loading the checkpoint reads (:data:`CHECKPOINT_PATTERNS`), sorted; other files
    (a README, optimizer states, sub-folders) are not part of it."""
    return _matching(folder, CHECKPOINT_PATTERNS)


def sha256_file(path: str | Path) -> str:
    """The SHA-256 of a file as hex, read in 1 MiB chunks (a checkpoint of any size in constant memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_sha256(folder: str | Path) -> dict[str, str]:
    """``{file name: SHA-256}`` of every :func:`checkpoint_files` file of ``folder``."""
    return {p.name: sha256_file(p) for p in checkpoint_files(folder)}


def checkpoint_provenance(folder: str | Path) -> dict[str, Any] | None:
    """Which checkpoint the model in ``folder`` comes from, as every artifact made from it records it
    (``base_checkpoint``); read from small JSON files only, never by hashing weights again.

    Returns:
        For a base folder with ``source.json``: ``checkpoint`` (the hub id or local folder), ``revision`` (hub) and
        ``sha256`` (a local folder's files, :func:`checkpoint_sha256`). For a pruned or fine-tuned checkpoint: its
        ``prune_record.json``'s ``base_checkpoint``. None for a checkpoint the workflow made (``pretrain.json`` or
        ``init.json`` records how).
    """
    folder = Path(folder)
    if (folder / SOURCE_FILE).is_file():
        src = json.loads((folder / SOURCE_FILE).read_text())
        out = {"checkpoint": src.get("hub_id"), "revision": src.get("revision"), "sha256": src.get("sha256")}
        return {k: v for k, v in out.items() if v is not None}
    record = folder / "prune_record.json"  # statereduce.stages.prune.RECORD_NAME
    if record.is_file():
        return json.loads(record.read_text()).get("base_checkpoint")
    return None


def base_checkpoint(model) -> dict[str, Any] | None:
    """The ``base_checkpoint`` provenance of a model :func:`statereduce.core.models.load_model` loaded
    (:func:`checkpoint_provenance`), or None (a model built otherwise, or one the workflow trained)."""
    return getattr(model, BASE_ATTR, None)
