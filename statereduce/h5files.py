"""Reading and writing the workflow's HDF5 artifacts without importing torch or fla.

Selection jobs only read these files, so they start in a fraction of the time a model-loading job
needs. Files:

* ``results/{model}/weights/qk.h5``: per layer ``W_q``/``W_k`` float32 [H, d_k, hidden] (the head rows
  of the q/k projections), attributes num_heads, head_k_dim, hidden_size, layers, family, source.
* ``results/{model}/calib/{calib}/activations.h5`` and ``grad_scores.h5`` (see :mod:`statereduce.capture`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np


def layer_group(layer: int) -> str:
    return f"layer_{layer:03d}"


@contextlib.contextmanager
def atomic_h5(path: str | Path) -> Iterator[h5py.File]:
    """Open a temporary HDF5 file next to ``path``; rename it into place only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with h5py.File(tmp, "w") as f:
            yield f
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_attrs(f: h5py.File, attrs: Mapping) -> None:
    for k, v in attrs.items():
        if v is not None:
            f.attrs[k] = v


@dataclass
class H5Artifact:
    """Read access to a per-layer HDF5 artifact (weights, activations or gradient scores)."""

    path: Path

    def __post_init__(self) -> None:
        self.path = Path(self.path)

    def attrs(self) -> dict:
        with h5py.File(self.path, "r") as f:
            return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in f.attrs.items()}

    def layers(self) -> list[int]:
        with h5py.File(self.path, "r") as f:
            return sorted(int(f[name].attrs["layer"]) for name in f)

    def read(self, layer: int, names: Iterable[str]) -> dict[str, np.ndarray]:
        with h5py.File(self.path, "r") as f:
            g = f[layer_group(layer)]
            return {n: g[n][()] for n in names}
