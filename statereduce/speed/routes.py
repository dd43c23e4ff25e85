"""How each family's decoding is routed to in-place state updates, registered per family (:func:`register_route`).

Every family declares its route: fla's DeltaNet and Gated DeltaNet register theirs in
:mod:`statereduce.speed.fla_decode`; Mamba-2 and Qwen3.5 register :class:`StockDecode` here (they decode as their
transformers code does). :func:`registered_route` refuses a family that declared none, in one line, so that a new
family's decode benchmark never falls back silently. :mod:`statereduce.speed.inplace` imports those modules and
applies the routes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Patch = tuple[Any, str, Callable[[Any], Any]]
"""``(owner, attribute, make)``: while a patch is applied, ``owner.attribute`` is ``make(original)``."""


class DecodeRoute:
    """One family's in-place decoding; the defaults route nothing."""

    def patches(self, kernel: str, device_types: tuple[str, ...]) -> list[Patch]:
        """Patches that route the family's one-token recurrent calls on ``device_types`` to ``kernel``'s in-place step
        (:data:`statereduce.speed.inplace.KERNELS`). The default, none: the family decodes as it does."""
        return []

    def fused_patches(self, kernel: str, device_types: tuple[str, ...]) -> list[Patch]:
        """Patches (as :meth:`patches`) that give the family's layers a leaner one-token step around ``kernel``'s
        in-place state update (``inplace_decode`` with a ``+fused`` kernel). The default: none."""
        return []

    def pack(self, model: nn.Module) -> int:
        """Lay out the weights the fused step reads (values unchanged); the number of modules packed."""
        return 0

    def cache_tensors(self, cache) -> list[torch.Tensor]:
        """Every state tensor (recurrent and conv) of the model's decoding cache ``cache``, for static CUDA-graph
        buffers. The default reads fla's per-layer ``recurrent_state`` / ``conv_state`` entries."""
        out = []
        for i in range(len(cache)):
            layer = cache[i]
            for key in ("recurrent_state", "conv_state"):
                value = layer.get(key) if isinstance(layer, dict) else None
                for t in value if isinstance(value, (tuple, list)) else [value]:
                    if isinstance(t, torch.Tensor):
                        out.append(t)
        return out


_ROUTES: dict[str, DecodeRoute] = {}


def register_route(family: str) -> Callable[[type[DecodeRoute]], type[DecodeRoute]]:
    """Class decorator: the decode route of ``family`` (a family name of :mod:`statereduce.families`)."""

    def register(cls: type[DecodeRoute]) -> type[DecodeRoute]:
        if family in _ROUTES:
            raise ValueError(f"family {family!r} has a decode route already ({type(_ROUTES[family]).__name__})")
        _ROUTES[family] = cls()
        return cls

    return register


def registered_route(family: str) -> DecodeRoute:
    """The decode route registered for ``family`` (the modules that register routes are imported by
    :mod:`statereduce.speed.inplace`).

    Raises:
        ValueError: one line, for a family that registered no route.
    """
    if family not in _ROUTES:
        raise ValueError(f"family {family!r} declares no decode route; routed: {', '.join(sorted(_ROUTES))} "
                         "(register one with statereduce.speed.routes.register_route; StockDecode routes nothing)")
    return _ROUTES[family]


@register_route("mamba2")
@register_route("qwen3_5")
class StockDecode(DecodeRoute):
    """The route of a family that decodes as its own code does: no patch, no packing, the default cache walk."""
