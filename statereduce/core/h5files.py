"""Reading and writing the workflow's HDF5 artifacts without importing torch or fla.

Selection jobs only read these files, so they start in a fraction of the time a model-loading job
needs. Files:

* ``results/{model}/weights/qk.h5``: per layer ``W_q``/``W_k`` float32 [H, d_k, hidden] (the head rows
  of the q/k projections), attributes num_heads, head_k_dim, hidden_size, layers, family, source.
* ``results/{model}/calib/{calib}/activations.h5`` and ``grad_scores.h5`` (see :mod:`statereduce.stages.capture`).
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from statereduce.core.artifacts import ArtifactError, check_provenance, missing, remedy, unreadable
from statereduce.selectors.registry import HeadData


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


def write_layers(path: str | Path, arrays: Mapping[int, Mapping[str, np.ndarray]], attrs: Mapping) -> Path:
    """Write a per-layer artifact atomically: one group per layer (:func:`layer_group`) holding its named arrays
    (their own dtypes) and a ``layer`` attribute, then the file's attributes (None values left out)."""
    with atomic_h5(path) as f:
        for i, named in arrays.items():
            g = f.create_group(layer_group(i))
            for name, data in named.items():
                g.create_dataset(name, data=data)
            g.attrs["layer"] = i
        write_attrs(f, attrs)
    return Path(path)


@dataclass
class H5Artifact:
    """Read access to a per-layer HDF5 artifact (weights, activations or gradient scores).

    A file that does not exist, is truncated or is not HDF5, or lacks a dataset that is read, fails in one line
    naming the file and the rule that rebuilds it (:mod:`statereduce.core.artifacts`); :meth:`expect` checks its
    recorded provenance against what the reading job expects.
    """

    path: Path

    def __post_init__(self) -> None:
        self.path = Path(self.path)

    @contextlib.contextmanager
    def _open(self) -> Iterator[h5py.File]:
        if not self.path.exists():
            raise missing(self.path)
        try:
            with h5py.File(self.path, "r") as f:
                yield f
        except OSError as err:
            raise unreadable(self.path, "HDF5", err) from None
        except KeyError as err:
            detail = str(err.args[0]) if err.args else "a missing entry"
            raise ArtifactError(f"{self.path} is incomplete ({detail}); {remedy(self.path)}") from None

    def attrs(self) -> dict:
        with self._open() as f:
            return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in f.attrs.items()}

    def expect(self, expected: Mapping | None) -> dict:
        """The attributes, after checking that the file was written for a job expecting ``expected``
        (:func:`statereduce.core.artifacts.check_provenance`: model, family, calibration, head sizes)."""
        attrs = self.attrs()
        check_provenance(self.path, attrs, expected)
        return attrs

    def layers(self) -> list[int]:
        with self._open() as f:
            return sorted(int(f[name].attrs["layer"]) for name in f)

    def datasets(self, layer: int) -> set[str]:
        """The names of the datasets of ``layer``'s group."""
        with self._open() as f:
            return set(f[layer_group(layer)])

    def read(self, layer: int, names: Iterable[str]) -> dict[str, np.ndarray]:
        names = list(names)
        with self._open() as f:
            group = layer_group(layer)
            absent = [n for n in names if f"{group}/{n}" not in f]
            if absent:
                raise ArtifactError(f"{self.path} has no dataset {group}/{absent[0]}; {remedy(self.path)}")
            g = f[group]
            return {n: g[n][()] for n in names}


# ---- per-head selector inputs -------------------------------------------------------------------------------------
#: HeadData fields that the per-layer arrays hold per head (axis 0); ``xnorm`` is shared by a layer's heads.
_PER_HEAD = ("W_q", "W_k", "K", "Q", "grad_q", "grad_k")


def head_data(layers: Iterable[tuple[int, Mapping[str, np.ndarray]]], num_heads: int):
    """Yield (layer, head, HeadData) from per-layer arrays, as the HDF5 artifacts hold them.

    Args:
        layers: (layer, arrays) pairs (a generator is fine: a layer is read when its heads are reached); arrays maps
            any of ``W_q``, ``W_k`` [H, d_k, hidden], ``K``, ``Q`` [H, rows, d_k], ``grad_q``, ``grad_k`` [H, d_k]
            (split per head) and ``xnorm`` [hidden] (shared by the layer's heads) to arrays; absent ones stay None.
        num_heads: H.
    """
    for layer, arrays in layers:
        for head in range(num_heads):
            yield layer, head, HeadData(
                **{name: arrays[name][head] for name in _PER_HEAD if name in arrays}, xnorm=arrays.get("xnorm")
            )


def head_data_iter(weights: Path, needs: set[str], activations: Path | None, grads: Path | None):
    """Yield (layer, head, HeadData) from the q/k weights and calibration artifacts, with only the fields ``needs``
    names (a selector's ``needs``)."""
    w = H5Artifact(weights)
    h = int(w.attrs()["num_heads"])
    acts = H5Artifact(activations) if activations is not None else None
    grad = H5Artifact(grads) if grads is not None else None

    def layers():
        for layer in w.layers():
            wts = w.read(layer, ["W_q", "W_k"]) if "weights" in needs else {}
            a = acts.read(layer, [n for n in ("K", "Q", "xnorm") if _wanted(n, needs)]) if acts else {}
            g = grad.read(layer, ["grad_q", "grad_k"]) if grad and "grad" in needs else {}
            yield layer, {**wts, **a, **g}

    return head_data(layers(), h)


def layer_head_data(weights: Path, needs: set[str], activations: Path | None, grads: Path | None):
    """Yield (layer, [HeadData of each head]) with only the fields in ``needs`` (a layer at a time)."""
    for layer, rows in itertools.groupby(head_data_iter(Path(weights), needs, activations, grads), key=lambda r: r[0]):
        yield layer, [data for _, _, data in rows]


def _wanted(name: str, needs: set[str]) -> bool:
    return ("activations" in needs and name in ("K", "Q")) or ("xnorm" in needs and name == "xnorm")
