"""The adapter interface: every model-family difference lives behind it.

An adapter wraps one loaded causal-LM and answers, in fla's slot names, where the key/query
channels of each linear-attention head live, how to capture K and Q as they enter the recurrence,
how to slice them out, and how to write the reduced config. Nothing outside ``statereduce/adapters``
may branch on ``model_type``.

To add a family: write ``adapters/<family>.py`` with a subclass of :class:`LinearAttentionAdapter`
decorated with ``@register_adapter``, import it in ``adapters/__init__.py``, and add a subclass of
the contract test class in ``tests/test_adapters.py``.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

_ADAPTERS: dict[str, type[LinearAttentionAdapter]] = {}


def register_adapter(cls: type[LinearAttentionAdapter]) -> type[LinearAttentionAdapter]:
    """Class decorator: register an adapter under its ``family`` name."""
    if cls.family in _ADAPTERS:
        raise ValueError(f"adapter family {cls.family!r} registered twice")
    _ADAPTERS[cls.family] = cls
    return cls


def adapter_families() -> list[str]:
    return sorted(_ADAPTERS)


def adapter_class(family: str) -> type[LinearAttentionAdapter]:
    """The adapter class for a family name, with a one-line error listing valid names."""
    try:
        return _ADAPTERS[family]
    except KeyError:
        raise ValueError(f"unknown model family {family!r}; valid: {', '.join(adapter_families())}") from None


def adapter_for_config(config) -> type[LinearAttentionAdapter]:
    """The adapter class whose ``model_types`` contains ``config.model_type``."""
    for cls in _ADAPTERS.values():
        if config.model_type in cls.model_types:
            return cls
    known = sorted(t for c in _ADAPTERS.values() for t in c.model_types)
    raise ValueError(f"no adapter for model_type {config.model_type!r}; supported: {', '.join(known)}")


def get_adapter(model: nn.Module) -> LinearAttentionAdapter:
    """Instantiate the right adapter for a loaded model."""
    return adapter_for_config(model.config)(model)


# A capture callback receives (layer_idx, q, k) with q, k of shape [B, T, H, d_k]: the tensors
# exactly as they enter the recurrence kernel (post conv + activation, before the in-kernel L2 norm).
QKCallback = Callable[[int, torch.Tensor, torch.Tensor], None]
# An input callback receives (layer_idx, x) with x [B, T, hidden], the input of q_proj/k_proj.
XCallback = Callable[[int, torch.Tensor], None]


@dataclass(frozen=True)
class StateShape:
    """Recurrent and conv state of one linear-attention layer, per sequence."""

    num_heads: int  # heads of the recurrent state (value heads under GVA)
    d_k: int
    d_v: int
    conv_channels: int  # channels of all short-conv states of the layer (q + k + v)
    conv_width: int

    @property
    def recurrent_elems(self) -> int:
        return self.num_heads * self.d_k * self.d_v

    @property
    def conv_elems(self) -> int:
        return self.conv_channels * self.conv_width


class LinearAttentionAdapter(ABC):
    """Structural facts about one family (fla slot names)."""

    family: ClassVar[str]  # config name of the family, e.g. "delta_net"
    model_types: ClassVar[tuple[str, ...]]  # HF config.model_type values handled

    def __init__(self, model: nn.Module):
        self.model = model
        self.config = model.config

    # ---- structure -------------------------------------------------------------------------
    @abstractmethod
    def mixer_layers(self) -> list[tuple[int, nn.Module]]:
        """(layer index, linear-attention mixer) for every prunable layer; softmax layers skipped."""

    @property
    @abstractmethod
    def num_heads(self) -> int:
        """Number of q/k heads H."""

    @property
    @abstractmethod
    def head_k_dim(self) -> int:
        """d_k of each q/k head."""

    @property
    @abstractmethod
    def head_v_dim(self) -> int:
        """d_v of each value head."""

    @property
    def num_v_heads(self) -> int:
        """Value heads HV (GVA: HV = r * H, value head i reads key head i // r)."""
        return self.num_heads

    @abstractmethod
    def qk_weights(self, mixer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_q, W_k), each [H * d_k, hidden]; head h is rows h*d_k .. (h+1)*d_k."""

    # ---- capture ---------------------------------------------------------------------------
    @abstractmethod
    @contextlib.contextmanager
    def capture(self, on_qk: QKCallback | None = None, on_x: XCallback | None = None) -> Iterator[None]:
        """Within the context, every forward pass calls ``on_qk(layer, q, k)`` with q, k [B,T,H,d_k]
        as they enter the kernel, and ``on_x(layer, x)`` with the q/k projection input [B,T,hidden]."""

    # ---- slicing ---------------------------------------------------------------------------
    @abstractmethod
    def slice_layer(self, mixer: nn.Module, keep: torch.Tensor) -> None:
        """Keep channels ``keep`` ([H, d_k'] long, sorted per row) of q/k projections and convs in place."""

    @abstractmethod
    def reduced_config(self, d_k_new: int):
        """A copy of the model config describing d_k = d_k_new, everything else unchanged.
        Raises ValueError (one line, with values) if the family cannot express it."""

    @abstractmethod
    def state_shape(self) -> StateShape:
        """Per-layer, per-sequence recurrent/conv state shape of the current config."""

    def num_mixer_layers(self) -> int:
        return len(self.mixer_layers())

    def state_bytes(self, dtype_bytes: int = 4) -> int:
        """Recurrent state bytes per sequence over all linear-attention layers (fp32 state by default)."""
        s = self.state_shape()
        return self.num_mixer_layers() * s.recurrent_elems * dtype_bytes
