"""Where the tests find the repository: ``ROOT`` (its Snakefile, config.yaml, scripts/, docs/)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
