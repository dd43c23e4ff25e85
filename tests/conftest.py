"""Shared test set-up: one torch thread (tiny tensors: intra-op threading only adds synchronisation,
up to 20x slower matmuls on a loaded 2-core machine), offline Hugging Face libraries."""

from __future__ import annotations

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)
