"""statereduce: key/query channel pruning of linear-attention language models.

Reproduces and extends "On State Reduction in Linear Attention" (Nazari & Rusch, 2026).
The package never imports snakemake; the workflow in ``rules/`` calls it through thin scripts.
"""

from __future__ import annotations

__version__ = "0.2.0"
