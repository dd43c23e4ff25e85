"""The selection file: ``results/{model}/select/{method}_{pct}.parquet``, one row per (layer, head) with the kept
channel indices (sorted), or for a transform selector (``pca``) the head's transform ``T`` [d_k', d_k] (row-major),
and, where the selector has scores, their scores. The file's key/value metadata records the format version
(:data:`SELECTION_FORMAT`), the kind (``index`` or ``transform``), model, family, selector, variant, pct, d_k, d_k'
(``d_k_new``: an int, or ``{"<layer>": width}`` for a per-layer budget, with its ``budget`` and ``allocation``),
calibration id, seed, options and version. Reading validates the rows against the metadata (head count, d_k', sorted
in-range indices, orthonormal transforms) and checks that the file was written for the reading job
(:mod:`statereduce.core.artifacts`). Written by the selection stage (:mod:`statereduce.stages.select`), read by pruning
and the rank analysis.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from statereduce.core.artifacts import ArtifactError, check_provenance, missing, remedy, unreadable
from statereduce.core.cuts import Cut, layer_widths
from statereduce.selectors.registry import check_transform

SELECTION_FORMAT = 2


def write_selection(path: str | Path, rows, meta: dict) -> Path:
    """Write the selection Parquet file atomically (temp file + rename). Rows are (layer, head, HeadSelection), or
    (layer, unit, HeadSelection, side) for a value or joint cut, whose ``side`` ("k" or "v") becomes a column."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with_side = bool(rows) and len(rows[0]) > 3
    side = {"side": pa.array([r[3] for r in rows], pa.string())} if with_side else {}
    table = pa.table(
        {
            "layer": pa.array([r[0] for r in rows], pa.int32()),
            "head": pa.array([r[1] for r in rows], pa.int32()),
            "keep": pa.array([None if r[2].keep is None else np.asarray(r[2].keep, dtype=np.int64).tolist()
                              for r in rows], pa.list_(pa.int64())),
            "transform": pa.array([None if r[2].transform is None else np.asarray(r[2].transform, np.float64).ravel()
                                   .tolist() for r in rows], pa.list_(pa.float64())),
            "scores": pa.array(
                [None if r[2].scores is None else np.asarray(r[2].scores, np.float64).tolist() for r in rows],
                pa.list_(pa.float64()),
            ),
            **side,
        }
    )
    table = table.replace_schema_metadata({"statereduce": json.dumps(meta, sort_keys=True)})
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def read_selection(path: str | Path, expect: dict | None = None) -> tuple[KeptChannels, dict]:
    """Read a selection file: (:class:`KeptChannels`, metadata): the selection's cut, kept key channels (or
    transforms, ``meta["kind"]``) and kept value channels, checked against the metadata.

    Args:
        path: the Parquet file :func:`write_selection` wrote.
        expect: what the reading job expects (e.g. ``params.info`` with the ``method`` and ``pct`` of its path);
            the file must have been written for it (:func:`statereduce.core.artifacts.check_provenance`).

    Raises:
        ArtifactError: one line naming the file and the rule that rebuilds it, for a file that is not a
            selection file or was written for another model, method or pct.
    """
    if not Path(path).exists():
        raise missing(path)
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as err:
        raise unreadable(path, "Parquet", err) from None
    absent = [c for c in ("layer", "head", "keep") if c not in table.column_names]
    if b"statereduce" not in (table.schema.metadata or {}) or absent:
        what = f"column {absent[0]!r}" if absent else "statereduce metadata"
        raise ArtifactError(f"{path} is not a selection file (it has no {what}); {remedy(path)}")
    try:
        meta = json.loads(table.schema.metadata[b"statereduce"])
    except ValueError as err:
        raise unreadable(path, "selection", err) from None
    fmt = meta.setdefault("format", 1)
    kind = meta.setdefault("kind", "index")
    if fmt not in (1, SELECTION_FORMAT) or kind not in ("index", "transform") or (fmt == 1 and kind != "index"):
        raise ArtifactError(f"{path}: selection format {fmt!r} / kind {kind!r} is not supported; valid: format 1 "
                            f"(index) or {SELECTION_FORMAT} (index or transform); {remedy(path)}")
    df = table.to_pydict()
    check_provenance(path, meta, expect)
    kind_of_cut = meta.get("cut", "keys")
    keys = values = None
    if kind_of_cut != "keys":
        values = _value_rows(path, df, meta)
        if kind_of_cut == "joint":
            keys, _ = _key_rows(path, {name: [x for x, side in zip(col, df["side"]) if side == "k"]
                                       for name, col in df.items()}, meta, kind)
    else:
        keys, _ = _key_rows(path, df, meta, kind)
    layers = sorted(keys if keys is not None else values)
    try:
        cut = Cut.from_meta(meta, layers)
    except (KeyError, TypeError, ValueError) as err:
        raise ArtifactError(f"{path}: its metadata names no valid widths ({err}); {remedy(path)}") from None
    return KeptChannels(cut, keys, values, kind), meta


@dataclass(frozen=True)
class KeptChannels:
    """What a selection file holds (:func:`read_selection`), and what :func:`statereduce.stages.prune.prune_model`
    takes.

    Attributes:
        cut: the :class:`~statereduce.core.cuts.Cut` (each layer's kept key and value widths).
        keys: {layer: [kept key channels of head 0, head 1, ...]} (``kind`` "index") or {layer: float64 [H, d_k',
            d_k]} transforms (``kind`` "transform"); None for a value cut (every key channel stays).
        values: {layer: int64 [units, d_v']} kept value channels, one row per value head or, where the heads share
            the output norm (``meta["value_selection"] == "layer"``), one [d_v'] row for the layer; None for a key
            cut.
        kind: "index" or "transform" (of the key side).
    """

    cut: Cut
    keys: dict | None
    values: dict[int, np.ndarray] | None
    kind: str = "index"


def _value_rows(path, df: dict, meta: dict) -> dict[int, np.ndarray]:
    if "side" not in df:
        raise ArtifactError(f"{path} is a {meta.get('cut')} cut without a 'side' column; {remedy(path)}")
    by_layer: dict[int, dict[int, list]] = {}
    for layer, unit, value, side in zip(df["layer"], df["head"], df["keep"], df["side"]):
        if side == "v":
            by_layer.setdefault(layer, {})[unit] = value
    units, d_v = meta.get("value_units"), meta.get("d_v")
    values = {}
    widths = layer_widths(meta.get("d_v_new"), by_layer)
    if sorted(widths) != sorted(by_layer):
        raise ArtifactError(f"{path}: value rows of layers {sorted(by_layer)} where the metadata's d_v_new names "
                            f"{sorted(widths)}; {remedy(path)}")
    for layer, rows in sorted(by_layer.items()):
        d_new = widths[layer]
        if units is not None and sorted(rows) != list(range(int(units))):
            raise ArtifactError(f"{path}: layer {layer} has value units {sorted(rows)} where the metadata says "
                                f"value_units={units}; {remedy(path)}")
        arr = np.asarray([rows[u] for u in sorted(rows)], dtype=np.int64)
        if arr.ndim != 2 or d_new is None or d_v is None or arr.shape[1] != int(d_new) or \
                np.any(np.diff(arr, axis=1) <= 0) or arr.min() < 0 or arr.max() >= int(d_v):
            raise ArtifactError(f"{path}: layer {layer}: kept value channels are not {d_new} sorted channels of "
                                f"d_v={d_v}; {remedy(path)}")
        values[layer] = arr[0] if meta.get("value_selection") == "layer" else arr
    if not values:
        raise ArtifactError(f"{path} holds no value rows; {remedy(path)}")
    return values


def _key_rows(path, df: dict, meta: dict, kind: str):
    column = "transform" if kind == "transform" else "keep"
    if column not in df:
        raise ArtifactError(f"{path} is a {kind} selection without a {column!r} column; {remedy(path)}")
    by_layer: dict[int, dict[int, list]] = {}
    for layer, head, value in zip(df["layer"], df["head"], df[column]):
        by_layer.setdefault(layer, {})[head] = value
    try:
        widths = layer_widths(meta.get("d_k_new"), by_layer)
        if sorted(widths) != sorted(by_layer):
            raise ValueError(f"layers {sorted(by_layer)} where the metadata's d_k_new names {sorted(widths)}")
        out = {layer: _check_heads(heads, kind, {**meta, "d_k_new": widths[layer]})
               for layer, heads in by_layer.items()}
    except (ValueError, RuntimeError) as err:
        raise ArtifactError(f"{path}: {err}; {remedy(path)}") from None
    return out, meta


def _check_heads(heads: dict[int, list], kind: str, meta: dict) -> list[list[int]] | np.ndarray:
    """One layer's rows of a selection file, checked against the metadata: heads 0..H-1, each with d_k' sorted
    in-range indices or an orthonormal [d_k', d_k] transform."""
    n_heads, d_k, d_new = meta.get("num_heads"), meta.get("d_k"), meta.get("d_k_new")
    if n_heads is not None and sorted(heads) != list(range(int(n_heads))):
        raise ValueError(f"heads {sorted(heads)} where the metadata says num_heads={n_heads}")
    rows = [heads[h] for h in sorted(heads)]
    if kind == "index":
        for h, keep in enumerate(rows):
            k = np.asarray(keep if keep is not None else [], dtype=np.int64)
            if keep is None or (d_new is not None and k.size != int(d_new)) or np.any(np.diff(k) <= 0) or (
                    k.size and (k[0] < 0 or (d_k is not None and k[-1] >= int(d_k)))):
                raise ValueError(f"head {h}: kept indices {keep} are not {d_new} sorted channels of d_k={d_k}")
        return rows
    return np.stack([check_transform(np.asarray(t if t is not None else [], np.float64).reshape(int(d_new), int(d_k)),
                                     int(d_new), int(d_k), f"head {h}") for h, t in enumerate(rows)])

