"""Per-head channel selections: run a selector over a model's artifacts and store the result as Parquet.

Selection reads only HDF5 artifacts (q/k weights, calibration activations, gradient scores), never
the model, so it needs neither torch nor fla.

``results/{model}/select/{method}_{pct}.parquet`` holds one row per (layer, head) with the kept
channel indices (sorted), or for a transform selector (``pca``) the head's transform ``T`` [d_k', d_k] (row-major),
and, where the selector has scores, their scores. The file's key/value metadata records the format version
(:data:`SELECTION_FORMAT`), the kind (``index`` or ``transform``), model, family, selector, variant, pct, d_k, d_k',
calibration id, seed, options and version. Reading validates the rows against the metadata (head count, d_k', sorted
in-range indices, orthonormal transforms).

Both ends check provenance (:mod:`statereduce.core.artifacts`): :func:`select_channels` that its HDF5 inputs were
written for the job's model and calibration (and agree on the head sizes), :func:`read_selection` that the
selection was written for the reading job's model, method and pct.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from statereduce import __version__
from statereduce.core.h5files import H5Artifact, head_data, head_data_iter, layer_head_data  # noqa: F401  (re-exported)
from statereduce.core.selection_file import (  # noqa: F401  (re-exported)
    SELECTION_FORMAT, read_selection, write_selection,
)
from statereduce.selectors import HeadData, get_selector, n_keep_for, parse_method, select_heads

#: Version of the selection file layout: 1 had only index selections (no ``transform`` column, no ``format`` key).


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
    allocation: str | Path | None = None,
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
            calibration id and for the weights' head sizes (:func:`statereduce.core.artifacts.check_provenance`).
        allocation: for a method with ``@<budget>``, its allocation artifact (:mod:`statereduce.stages.allocate`): each
            layer keeps its own width; the metadata's ``d_k_new`` is then ``{"<layer>": width}`` (an int when every
            layer keeps the same) and ``allocation`` summarises the policy.

    Returns:
        (rows, meta): rows of (layer, head, HeadSelection) and the file metadata (with the model and family).

    Raises:
        ArtifactError: one line, for an input written for another model, family, calibration or head size, or
            one that cannot be read.
    """
    spec = parse_method(method)
    if (spec.budget is None) != (allocation is None):
        raise ValueError(f"method {method!r} " + ("has no @<budget>: give no allocation" if spec.budget is None
                                                  else "names a budget: give its allocation (rule allocate)"))
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
    heads = head_data_iter(
        Path(weights),
        needs,
        Path(activations) if activations and needs & {"activations", "xnorm"} else None,
        Path(grads) if grads and "grad" in needs else None,
    )
    provenance = {"model": (expect or {}).get("model") or wattrs.get("model"), "family": wattrs.get("family"),
                  "base_checkpoint": json.loads(wattrs["base_checkpoint"]) if wattrs.get("base_checkpoint") else None}
    widths = None
    if allocation is not None:
        from statereduce.core.budgets import read_allocation

        doc = read_allocation(allocation, {**(expect or {}), "method": method, "pct": pct})
        widths = {int(k): int(v) for k, v in doc["key_dims"].items()}
        provenance = {**provenance, "allocation": {"budget": doc["budget"], "policy": doc["allocation"]["policy"],
                                                   "key_dims": doc["key_dims"], "total": doc["allocation"]["total"],
                                                   "uniform_width": doc["uniform_width"]}}
    return run_selector(heads, method, pct, d_k=d_k, num_heads=int(wattrs["num_heads"]), seed=seed, options=options,
                        workers=workers, provenance=provenance, widths=widths)


def run_selector(
    heads: Iterable[tuple[int, int, HeadData]],
    method: str,
    pct: float,
    *,
    d_k: int,
    num_heads: int,
    seed: int = 0,
    options: dict | None = None,
    workers: int = 1,
    provenance: Mapping[str, Any] | None = None,
    widths: Mapping[int, int] | None = None,
) -> tuple[list[tuple[int, int, object]], dict]:
    """Run the method's selector over ``heads`` (:func:`head_data`) and describe the result: the part of
    :func:`select_channels` after its inputs are read and checked.

    Args:
        heads: (layer, head, HeadData) with what the selector needs.
        method, pct, seed, options, workers: as for :func:`select_channels`.
        d_k: the heads' key dimension; num_heads: H (both recorded in the metadata).
        provenance: ``model`` and ``family`` for the metadata (None values are left out).
        widths: {layer: kept width} of a per-layer budget, or None for ``n_keep_for(d_k, pct)`` in every layer.

    Returns:
        (rows, meta) as :func:`select_channels` returns them.
    """
    spec = parse_method(method)
    selector = get_selector(spec.selector)
    n_keep = n_keep_for(d_k, pct) if widths is None else dict(widths)
    rows = select_heads(selector, heads, n_keep, spec.variant, seed, options or {}, workers=workers)
    if isinstance(n_keep, dict):  # select_heads refuses a layer the widths lack; here the reverse
        extra = sorted(set(n_keep) - {r[0] for r in rows})
        if extra:
            raise ValueError(f"the widths name layers {extra} that the model's linear-attention layers lack")
        one = set(n_keep.values())
        n_keep = one.pop() if len(one) == 1 else {str(k): v for k, v in sorted(n_keep.items())}
    kinds = {"transform" if r[2].transform is not None else "index" for r in rows}
    if len(kinds) > 1:
        raise RuntimeError(f"selector {spec.selector!r} returned index and transform selections for different heads")
    meta = {
        "format": SELECTION_FORMAT,
        "kind": kinds.pop() if kinds else "index",
        **{k: v for k, v in (provenance or {}).items() if v is not None},
        "method": method,
        "selector": spec.selector,
        "variant": spec.variant,
        "calibration": spec.calib,
        "budget": spec.budget,
        "pct": pct,
        "d_k": d_k,
        "d_k_new": n_keep,
        "num_heads": int(num_heads),
        "seed": seed,
        "options": options or {},
        "package_version": __version__,
    }
    return rows, meta
