"""Per-head channel selections: run a selector over a model's artifacts and store the result as Parquet.

Selection reads only HDF5 artifacts (q/k weights, calibration activations, gradient scores), never
the model, so it needs neither torch nor fla.

``results/{model}/select/{method}_{pct}.parquet`` holds one row per (layer, head) with the kept
channel indices (sorted) and, where the selector has scores, their scores. The file's key/value
metadata records model, family, selector, variant, pct, d_k, d_k', calibration id, seed, options and version.

Both ends check provenance (:mod:`statereduce.artifacts`): :func:`select_channels` that its HDF5 inputs were
written for the job's model and calibration (and agree on the head sizes), :func:`read_selection` that the
selection was written for the reading job's model, method and pct.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from statereduce import __version__
from statereduce.artifacts import ArtifactError, check_provenance, missing, remedy, unreadable
from statereduce.h5files import H5Artifact
from statereduce.selectors import HeadData, get_selector, n_keep_for, parse_method, select_heads


def selector_code_files(name: str) -> list[str]:
    """Source files a selector's results depend on: its own module plus the statereduce modules it uses
    (e.g. ``rrqr.py`` for ``drrqr``), excluding the shared registry. The workflow makes these inputs of
    that selector's jobs only, so editing one selector reruns only its selections."""
    selector = get_selector(name)
    module = sys.modules[selector.fn.__module__]
    files = {selector.source_file}
    for value in vars(module).values():
        owner = value if inspect.ismodule(value) else sys.modules.get(getattr(value, "__module__", "") or "")
        mod_name = getattr(owner, "__name__", "")
        if mod_name.startswith("statereduce.") and not mod_name.startswith("statereduce.selectors.registry"):
            src = getattr(owner, "__file__", None)
            if src and mod_name != "statereduce.selectors":
                files.add(os.path.abspath(src))
    return sorted(files)


def _head_data_iter(weights: Path, needs: set[str], activations: Path | None, grads: Path | None):
    """Yield (layer, head, HeadData) with only the fields the selector needs."""
    w = H5Artifact(weights)
    h = int(w.attrs()["num_heads"])
    acts = H5Artifact(activations) if activations is not None else None
    grad = H5Artifact(grads) if grads is not None else None
    for layer in w.layers():
        wts = w.read(layer, ["W_q", "W_k"]) if "weights" in needs else {}
        a = acts.read(layer, [n for n in ("K", "Q", "xnorm") if _wanted(n, needs)]) if acts else {}
        g = grad.read(layer, ["grad_q", "grad_k"]) if grad and "grad" in needs else {}
        for head in range(h):
            yield layer, head, HeadData(
                W_q=wts["W_q"][head] if wts else None,
                W_k=wts["W_k"][head] if wts else None,
                K=a["K"][head] if "K" in a else None,
                Q=a["Q"][head] if "Q" in a else None,
                xnorm=a.get("xnorm"),
                grad_q=g["grad_q"][head] if g else None,
                grad_k=g["grad_k"][head] if g else None,
            )


def _wanted(name: str, needs: set[str]) -> bool:
    return ("activations" in needs and name in ("K", "Q")) or ("xnorm" in needs and name == "xnorm")


def select_channels(
    weights: str | Path,
    method: str,
    pct: float,
    *,
    activations: str | Path | None = None,
    grads: str | Path | None = None,
    seed: int = 0,
    options: dict | None = None,
    workers: int = 1,
    expect: dict | None = None,
) -> tuple[list[tuple[int, int, object]], dict]:
    """Select channels for every (layer, head) of a model.

    Args:
        weights: the model's ``qk.h5`` (head rows of the q/k projections; also gives H, d_k, layers).
        method: method token, e.g. ``drrqr``, ``l1-q``, ``grad.prose`` (see ``parse_method``).
        pct: percent of key channels removed.
        activations: ``activations.h5`` (needed by activation/xnorm-based selectors).
        grads: ``grad_scores.h5`` (needed by ``grad``).
        seed: selection seed (``rand``; tie-breaking elsewhere is deterministic).
        options: selector options from the config (e.g. DRRQR's ``f``).
        workers: heads selected in parallel (threads, single-threaded BLAS each).
        expect: what the job expects of its inputs (e.g. the rule's ``params.info``: ``model``, ``family``).
            ``weights`` must have been written for it, and ``activations``/``grads`` for it, for the method's
            calibration id and for the weights' head sizes (:func:`statereduce.artifacts.check_provenance`).

    Returns:
        (rows, meta): rows of (layer, head, HeadSelection) and the file metadata (with the model and family).

    Raises:
        ArtifactError: one line, for an input written for another model, family, calibration or head size, or
            one that cannot be read.
    """
    spec = parse_method(method)
    selector = get_selector(spec.selector)
    wattrs = H5Artifact(weights).expect(expect)
    d_k = int(wattrs["head_k_dim"])
    n_keep = n_keep_for(d_k, pct)
    needs = set(selector.needs)
    if needs & {"activations", "xnorm"} and activations is None:
        raise ValueError(f"selector {spec.selector!r} needs calibration activations (activations.h5)")
    if "grad" in needs and grads is None:
        raise ValueError(f"selector {spec.selector!r} needs gradient scores (grad_scores.h5)")
    calib_expect = {**(expect or {}), "calibration": spec.calib, "num_heads": wattrs["num_heads"], "head_k_dim": d_k}
    if activations is not None and needs & {"activations", "xnorm"}:
        H5Artifact(activations).expect(calib_expect)
    if grads is not None and "grad" in needs:
        H5Artifact(grads).expect(calib_expect)
    heads = _head_data_iter(
        Path(weights),
        needs,
        Path(activations) if activations and needs & {"activations", "xnorm"} else None,
        Path(grads) if grads and "grad" in needs else None,
    )
    rows = select_heads(selector, heads, n_keep, spec.variant, seed, options or {}, workers=workers)
    provenance = {"model": (expect or {}).get("model") or wattrs.get("model"), "family": wattrs.get("family")}
    meta = {
        **{k: v for k, v in provenance.items() if v is not None},
        "method": method,
        "selector": spec.selector,
        "variant": spec.variant,
        "calibration": spec.calib,
        "pct": pct,
        "d_k": d_k,
        "d_k_new": n_keep,
        "num_heads": int(wattrs["num_heads"]),
        "seed": seed,
        "options": options or {},
        "package_version": __version__,
    }
    return rows, meta


def write_selection(path: str | Path, rows, meta: dict) -> Path:
    """Write the selection Parquet file atomically (temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {
            "layer": pa.array([r[0] for r in rows], pa.int32()),
            "head": pa.array([r[1] for r in rows], pa.int32()),
            "keep": pa.array([np.asarray(r[2].keep, dtype=np.int64).tolist() for r in rows], pa.list_(pa.int64())),
            "scores": pa.array(
                [None if r[2].scores is None else np.asarray(r[2].scores, np.float64).tolist() for r in rows],
                pa.list_(pa.float64()),
            ),
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


def read_selection(path: str | Path, expect: dict | None = None) -> tuple[dict[int, list[list[int]]], dict]:
    """Read a selection file: ({layer: [kept indices of head 0, head 1, ...]}, metadata).

    Args:
        path: the Parquet file :func:`write_selection` wrote.
        expect: what the reading job expects (e.g. ``params.info`` with the ``method`` and ``pct`` of its path);
            the file must have been written for it (:func:`statereduce.artifacts.check_provenance`).

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
    df = table.to_pydict()
    check_provenance(path, meta, expect)
    by_layer: dict[int, dict[int, list[int]]] = {}
    for layer, head, keep in zip(df["layer"], df["head"], df["keep"]):
        by_layer.setdefault(layer, {})[head] = keep
    return {layer: [heads[h] for h in sorted(heads)] for layer, heads in by_layer.items()}, meta
