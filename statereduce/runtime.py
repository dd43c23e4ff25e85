"""Process set-up shared by the workflow scripts: logs, threads, determinism."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path


def start(log_path: str | Path | None, threads: int = 1, torch_threads: bool = True) -> logging.Logger:
    """Send stdout, stderr (progress bars included) and ``logging`` to ``log_path``; pin torch threads.

    Args:
        log_path: the rule's log file (``snakemake.log[0]``); None keeps the console.
        threads: CPU threads for torch (the rule's ``threads``).
        torch_threads: False for jobs that never import torch (keeps their start-up fast).
    """
    if log_path is not None:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        stream = open(log_path, "w", buffering=1)
        sys.stdout = sys.stderr = stream
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr, force=True
    )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if torch_threads:
        import torch

        torch.set_num_threads(max(1, int(threads)))
    return logging.getLogger("statereduce")


def write_json(path: str | Path, obj) -> Path:
    """Write JSON atomically: a temporary file in the same folder, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=False, default=_default)
            f.write("\n")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def read_json(path: str | Path):
    with open(path) as f:
        return json.load(f)


def _default(o):
    import numpy as np

    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
