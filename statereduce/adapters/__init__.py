"""Model-family adapters; importing this package registers every family.

See :mod:`statereduce.adapters.base` for the interface and how to add a family,
:mod:`statereduce.adapters.mixer_layout` for the parts an adapter is composed of.
"""

from __future__ import annotations

from statereduce.adapters import deltanet, gated_deltanet, mamba2, qwen3_5  # noqa: F401  (registers the adapters)
from statereduce.adapters.base import (
    ChannelRows,
    Dims,
    EpsAttribute,
    ExactNorms,
    LinearAttentionAdapter,
    MixerLayout,
    QKCallback,
    ScaledRows,
    StateShape,
    XCallback,
    adapter_class,
    adapter_families,
    adapter_for_config,
    decoder_layers,
    get_adapter,
    head_major_rows,
    register_adapter,
)
from statereduce.adapters.deltanet import DeltaNetAdapter
from statereduce.adapters.gated_deltanet import GatedDeltaNetAdapter
from statereduce.adapters.mamba2 import Mamba2Adapter
from statereduce.adapters.qwen3_5 import Qwen35Adapter

__all__ = [
    "ChannelRows",
    "DeltaNetAdapter",
    "Dims",
    "EpsAttribute",
    "ExactNorms",
    "GatedDeltaNetAdapter",
    "LinearAttentionAdapter",
    "Mamba2Adapter",
    "MixerLayout",
    "QKCallback",
    "Qwen35Adapter",
    "ScaledRows",
    "StateShape",
    "XCallback",
    "adapter_class",
    "adapter_families",
    "adapter_for_config",
    "decoder_layers",
    "get_adapter",
    "head_major_rows",
    "register_adapter",
]
