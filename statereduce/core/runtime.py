"""Process set-up shared by the workflow scripts: logs, threads, determinism, atomic files, the version record."""

from __future__ import annotations

import atexit
import contextlib
import importlib.metadata
import importlib.util
import json
import logging
import math
import os
import platform
import random
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from statereduce import __version__


def start(log_path: str | Path | None, threads: int = 1, torch_threads: bool = True) -> logging.Logger:
    """Send stdout, stderr (progress bars included) and ``logging`` to ``log_path``; pin torch threads.

    Imports nothing heavy: torch's threads are pinned when the job imports torch (:func:`pin_torch_threads`), so a
    job whose work needs no torch never loads it.

    Args:
        log_path: the rule's log file (``snakemake.log[0]``); None keeps the console.
        threads: CPU threads for torch (the rule's ``threads``).
        torch_threads: False leaves torch's threads at its default (jobs that run no torch).
    """
    if log_path is not None:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        stream = open(log_path, "w", buffering=1)
        sys.stdout = sys.stderr = stream
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr, force=True
    )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    log = logging.getLogger("statereduce")
    if torch_threads:
        pin_torch_threads(max(1, int(threads)))
        atexit.register(_log_peak_gpu_memory, log)
    return log


def pin_torch_threads(threads: int) -> None:
    """``torch.set_num_threads(threads)``: now if torch is loaded, else as soon as its import finishes (a one-time
    hook on ``sys.meta_path``), before any code of the job runs a torch op."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)
    elif not any(isinstance(f, _PinThreadsOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PinThreadsOnImport(threads))
    else:
        next(f for f in sys.meta_path if isinstance(f, _PinThreadsOnImport)).threads = threads


class _PinThreadsOnImport:
    """A meta-path finder that only watches for ``torch``: it removes itself, lets the other finders find torch, and
    has torch's own loader load it, then pins its threads (:func:`pin_torch_threads`)."""

    def __init__(self, threads: int):
        self.threads = threads

    def find_spec(self, name: str, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenPinThreads(spec.loader, self.threads)
        return spec


class _ThenPinThreads:
    """torch's loader, and ``set_num_threads`` once it has run; the module keeps torch's own loader."""

    def __init__(self, loader, threads: int):
        self.loader, self.threads = loader, threads

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        module.set_num_threads(self.threads)

    def __getattr__(self, name: str):
        return getattr(self.loader, name)


def _log_peak_gpu_memory(log: logging.Logger) -> None:
    """At exit of a job that used CUDA: one log line with torch's peak allocated and reserved GPU memory, the number
    docs/paper_scale.md reads per stage (Snakemake's benchmark TSVs hold host memory only). A job that never loaded
    torch has nothing to report (and loads nothing)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()):
            log.info("peak GPU memory on cuda:%d: %.2f GiB allocated, %.2f GiB reserved", i,
                     torch.cuda.max_memory_allocated(i) / 2**30, torch.cuda.max_memory_reserved(i) / 2**30)


def cpu_kind() -> str:
    """The CPU this process runs on, as the provenance of its numbers: model name and widest vector extension, e.g.
    ``"AMD EPYC (AVX2)"``. The tiny models' CPU results depend on it: torch, MKL and oneDNN pick their kernels by the
    CPU, and kernels of different CPUs round differently (docs/results.md, "Why the CPU matters")."""
    found: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():  # the first processor's lines
            key, _, value = line.partition(":")
            found.setdefault(key.strip(), value.strip())
    name, flags = found.get("model name") or platform.machine(), set(found.get("flags", "").split())
    width = next((label for flag, label in (("avx512f", "AVX512"), ("avx2", "AVX2"), ("avx", "AVX")) if flag in flags),
                 None)
    return f"{name} ({width})" if width else name


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_file(path: str | Path, mode: str = "w") -> Iterator:
    """Open a temporary file next to ``path`` (``mode`` "w" text UTF-8 or "wb"); when the block succeeds, fsync
    it, give it the usual permissions (umask applied; ``mkstemp`` makes 0600) and rename it to ``path``. On any
    exception the temporary file is removed and ``path`` is left as it was."""
    if mode not in ("w", "wb"):
        raise ValueError(f"mode {mode!r} is invalid; valid: 'w', 'wb'")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, **({"encoding": "utf-8"} if mode == "w" else {})) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to a temporary file next to ``path``, fsync it, and rename it into place."""
    with atomic_file(path, "w") as fh:
        fh.write(text)
    return Path(path)


@contextlib.contextmanager
def atomic_dir(out_dir: str | Path) -> Iterator[Path]:
    """Build a folder artifact in a temporary sibling and swap it into place only when the block succeeds.

    Yields the temporary folder (created empty). On success an existing ``out_dir`` is renamed aside, the new
    folder renamed into place and the old one removed; on any exception the temporary folder is removed and
    ``out_dir`` is left as it was. A crash therefore never leaves a half-written folder under ``out_dir``.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{tag}"
    tmp.mkdir()
    try:
        yield tmp
        if out_dir.exists():
            old = out_dir.parent / f".{out_dir.name}.old-{tag}"
            out_dir.rename(old)
            tmp.rename(out_dir)
            shutil.rmtree(old)
        else:
            tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def write_json(path: str | Path, doc: Any) -> Path:
    """Write ``doc`` as strict JSON (non-finite floats as strings), atomically."""
    return write_text_atomic(path, json.dumps(jsonable(doc), indent=2, allow_nan=False) + "\n")


def read_json(path: str | Path):
    with open(path) as f:
        return json.load(f)


def jsonable(obj: Any) -> Any:
    """A JSON-serialisable copy: numpy/torch scalars to Python, dtypes/paths/callables to str,
    non-finite floats to the strings ``"nan"``, ``"inf"``, ``"-inf"``."""
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (bool, str, int)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)
    if hasattr(obj, "item") and callable(obj.item) and getattr(obj, "ndim", 0) == 0:
        return jsonable(obj.item())
    if hasattr(obj, "tolist") and callable(obj.tolist):
        return jsonable(obj.tolist())
    if callable(obj):
        return getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or repr(obj)
    return str(obj)


def json_number(v: Any) -> float:
    """A float from a value :func:`jsonable` wrote (non-finite floats are the strings ``"nan"``, ``"inf"``,
    ``"-inf"`` there); None is NaN."""
    return math.nan if v is None else float(v)


VERSIONED_PACKAGES = {
    "torch": "torch",
    "triton": "triton",
    "transformers": "transformers",
    "fla": "flash-linear-attention",
    "datasets": "datasets",
    "lm_eval": "lm_eval",
}
"""The libraries whose versions every artifact records: ``{record key: distribution name}``."""


def versions() -> dict[str, str | None]:
    """Versions of statereduce and the libraries its results depend on: ``{"statereduce", "torch", ...}``.

    The one version record of every artifact (``pretrain.json``, ``prune_record.json``, ``eval.json``
    provenance, the summary and speed documents). Read from the installed distributions' metadata, so nothing
    heavy is imported; a library that is not installed is ``None``.
    """
    out: dict[str, str | None] = {"statereduce": __version__, "cpu": cpu_kind()}
    for key, dist in VERSIONED_PACKAGES.items():
        try:
            out[key] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[key] = None
    return out


# ---- training (pretraining and RFT) ------------------------------------------------------------------------
@dataclass(frozen=True)
class Schedule:
    """A learning-rate schedule (:func:`lr_at`): peak ``lr``, floor ``min_lr`` (None: ``lr / 10``), ``warmup`` and
    ``steps`` optimizer steps."""

    lr: float
    min_lr: float | None
    warmup: int
    steps: int

    def to_dict(self) -> dict[str, Any]:
        return {"lr": self.lr, "min_lr": self.min_lr, "warmup": self.warmup, "steps": self.steps}


def lr_at(step: int, schedule: Schedule) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup over ``warmup`` steps, then cosine
    decay from ``lr`` to ``min_lr`` (default ``lr / 10``) at the last step.

    ``schedule`` is a :class:`Schedule`, or anything with those four attributes (the pretraining settings,
    :class:`statereduce.common.settings.TrainSettings`)."""
    lr, warmup, steps = float(schedule.lr), int(schedule.warmup), int(schedule.steps)
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - 1 - warmup)
    floor = lr / 10 if schedule.min_lr is None else float(schedule.min_lr)
    return floor + (lr - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
