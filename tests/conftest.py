"""Shared test set-up: one torch thread (tiny tensors: intra-op threading only adds synchronisation,
up to 20x slower matmuls on a loaded 2-core machine), offline Hugging Face libraries, and the fixtures several test
files use, and the number of pytest-xdist workers. The helper modules beside it (``_paths``, ``_models``,
``_snakemake``, ``_fresh``, ``_pins``) are imported by name: pytest puts this folder on ``sys.path``."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from _paths import ROOT

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The modeling code of portable checkpoints (statereduce.core.portable) that transformers copies when it loads one.
os.environ.setdefault("HF_MODULES_CACHE", tempfile.mkdtemp(prefix="statereduce-hf-modules-"))
torch.set_num_threads(1)

# The fixtures that read the finished tiny DAG run: a test that takes one is in the `workflow` tier (docs/testing.md).
WORKFLOW_FIXTURES = ("workflow_run", "finished_run", "own_run")


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto`` (pyproject's addopts): one worker per CPU this process may use, at most 4 (each worker holds torch
    and two fork servers, ~1.5 GB)."""
    return max(1, min(len(os.sched_getaffinity(0)), 4))


@pytest.hookimpl(tryfirst=True)  # before the -m selection of pyproject's addopts reads the markers
def pytest_collection_modifyitems(items):
    for item in items:
        if any(name in WORKFLOW_FIXTURES for name in getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.workflow)


def _package_digest() -> str:
    """SHA-256 of every source file of the package: what builds the cached checkpoints."""
    h = hashlib.sha256()
    for path in sorted((ROOT / "statereduce").rglob("*.py")):
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


@pytest.fixture(scope="session")
def built(request, tmp_path_factory) -> Callable[[str, dict, Callable[[Path], None]], Path]:
    """``built(name, params, build)``: the folder ``build(folder)`` fills, made once and then reused: within the
    session, and across sessions under pytest's cache (``.pytest_cache/d/statereduce``) keyed by the package's
    source, the build parameters, torch's version and CPU capability (they set trained numbers); a build that fails
    leaves nothing behind. With ``-p no:cacheprovider`` the folders live for the session only."""
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    root = Path(cache.mkdir("statereduce")) if cache is not None else tmp_path_factory.mktemp("built")
    base = {"package": _package_digest(), "torch": torch.__version__,
            "cpu": torch.backends.cpu.get_cpu_capability()}

    def get(name: str, params: dict, build: Callable[[Path], None]) -> Path:
        key = hashlib.sha256(json.dumps({**base, "params": params}, sort_keys=True, default=str).encode())
        folder = root / f"{name}-{key.hexdigest()[:16]}"
        if not folder.is_dir():
            for stale in root.glob(f"{name}-*"):  # built by other code: never read again
                shutil.rmtree(stale, ignore_errors=True)
            partial = root / f".{folder.name}.partial-{os.getpid()}"
            shutil.rmtree(partial, ignore_errors=True)
            try:
                build(partial)
                try:
                    partial.rename(folder)
                except OSError:  # another xdist worker built it first
                    if not folder.is_dir():
                        raise
            finally:
                shutil.rmtree(partial, ignore_errors=True)
        return folder

    return get


@pytest.fixture(scope="session")
def workflow_run(tmp_path_factory) -> dict:
    """The workflow tier's finished run (``tests/_workflow_run.py``), built once per session: under xdist by the
    first worker that asks, while the others wait on a lock in the session's shared temporary folder (a failed build
    fails theirs at once, with its message). Read it, or copy it (``_workflow_run.copy_run``) before changing
    anything."""
    import _workflow_run
    from filelock import FileLock

    if not os.environ.get("PYTEST_XDIST_WORKER"):  # one process
        return _workflow_run.build(tmp_path_factory.mktemp("workflow_run"))
    shared = tmp_path_factory.getbasetemp().parent / "workflow_run"  # the session's folder, above every worker's
    done, failed = shared.with_suffix(".json"), shared.with_suffix(".failed")
    with FileLock(str(shared.with_suffix(".lock"))):
        if failed.is_file():
            pytest.fail(f"the workflow run failed in another worker: {failed.read_text()}", pytrace=False)
        if not done.is_file():
            try:
                run = _workflow_run.build(shared)
            except BaseException as e:
                failed.write_text(f"{type(e).__name__}: {e}"[-5000:])
                raise
            done.write_text(json.dumps(run, default=str))
        run = json.loads(done.read_text())
    return {**run, "work": Path(run["work"]), "ckpt": Path(run["ckpt"])}


@pytest.fixture(scope="module")
def shipped_config() -> dict:
    """The repository's config.yaml, loaded once per test module (copy it before changing it)."""
    return yaml.safe_load((ROOT / "config.yaml").read_text())


@pytest.fixture(scope="module")
def tok():
    """The byte-level tokenizer of the tiny models (statereduce.core.tokenizer)."""
    from statereduce.core.tokenizer import byte_level_tokenizer

    return byte_level_tokenizer()
