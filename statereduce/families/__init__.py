"""Model families from their configs alone (no torch): importing this package registers every family.

See :mod:`statereduce.families.base`; each family's adapter (:mod:`statereduce.adapters`) subclasses its spec.
"""

from __future__ import annotations

from statereduce.families import deltanet, gated_deltanet, mamba2, qwen3_5  # noqa: F401  (registers the families)
from statereduce.families.base import (
    SHARE_CONV,
    Dims,
    FamilySpec,
    LazyImport,
    StateShape,
    check_family,
    check_share_conv,
    family_names,
    family_spec,
    model_type_family,
    register_family,
    share_conv_families,
)
from statereduce.families.deltanet import DeltaNetFamily
from statereduce.families.fla import FlaFamily
from statereduce.families.gated_deltanet import GatedDeltaNetFamily
from statereduce.families.mamba2 import Mamba2Family
from statereduce.families.qwen3_5 import Qwen35Family

__all__ = [
    "SHARE_CONV",
    "DeltaNetFamily",
    "Dims",
    "FamilySpec",
    "FlaFamily",
    "GatedDeltaNetFamily",
    "LazyImport",
    "Mamba2Family",
    "Qwen35Family",
    "StateShape",
    "check_family",
    "check_share_conv",
    "family_names",
    "family_spec",
    "model_type_family",
    "register_family",
    "share_conv_families",
]
