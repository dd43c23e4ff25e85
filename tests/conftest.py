"""Shared test set-up: one torch thread (tiny tensors: intra-op threading only adds synchronisation,
up to 20x slower matmuls on a loaded 2-core machine), offline Hugging Face libraries, and the fixtures several test
files use. The helper modules beside it (``_paths``, ``_models``, ``_snakemake``, ``_pins``) are imported by name:
pytest puts this folder on ``sys.path``."""

from __future__ import annotations

import os

import pytest
import torch
import yaml
from _paths import ROOT

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)

# The fixtures that run a whole tiny DAG: a test that takes one is in the `workflow` tier (docs/testing.md).
WORKFLOW_FIXTURES = ("finished_run", "own_run")


@pytest.hookimpl(tryfirst=True)  # before the -m selection of pyproject's addopts reads the markers
def pytest_collection_modifyitems(items):
    for item in items:
        if any(name in WORKFLOW_FIXTURES for name in getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.workflow)


@pytest.fixture(scope="module")
def shipped_config() -> dict:
    """The repository's config.yaml, loaded once per test module (copy it before changing it)."""
    return yaml.safe_load((ROOT / "config.yaml").read_text())


@pytest.fixture(scope="module")
def tok():
    """The byte-level tokenizer of the tiny models (statereduce.tokenizer)."""
    from statereduce.tokenizer import byte_level_tokenizer

    return byte_level_tokenizer()
