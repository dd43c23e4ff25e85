"""The value side of the selectors: which of each head's d_v value channels (the rows of its d_v x d_k state) to
keep, for the method tokens ``<selector>-v`` (values only) and ``<selector>-kv`` (values and keys).

A value channel j of value head h is written by row j of the value projection, read out as channel j of the
head's output, scaled by the output norm's weight w_j and mixed into the residual stream by column j of the output
projection. Where the output norm's weight is shared by a layer's heads (fla, Qwen3.5) every head keeps the same
channels, so the unit of selection is the layer and its heads' statistics are pooled (rows of V stacked, weights
concatenated, scores summed); in Mamba-2 each head chooses its own (:class:`ValueData`, built by
:func:`statereduce.stages.select.value_units`). Per unit:

- ``rand``: a seeded uniform subset;
- ``l1``: ``||W_v[j]||_1 + ||W_o[:, j]||_1`` (the magnitude of the channel's weights);
- ``swanda``: ``||V[:, j]||_2 * ||w_j W_o[:, j]||_2``, output-aware as S-Wanda is input-aware: the value activations
  on the calibration data times the norm of what the channel writes;
- ``grad``: ``sum_i |W_v[j, i] dL/dW_v[j, i]| + sum_i |W_o[i, j] dL/dW_o[i, j]|`` (``grad_scores.h5``'s ``grad_v``);
- ``drrqr``: the first d_v' pivots of a strong rank-revealing QR of V (calibration values, rows = tokens), as the
  key side factors [K; Q].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from statereduce.selectors.registry import HeadData, HeadSelection, get_selector, register_value_side, top_k


@dataclass
class ValueData:
    """One unit's value statistics (a layer whose heads share the output norm, or one value head).

    Args:
        W_v: [d_v, m] the value projection's rows (a layer's heads side by side along m).
        W_o: [d_v, m] the output projection's columns, as rows.
        w_norm: [d_v] the output norm's weight, or None.
        V: [N, d_v] calibration values as they enter the recurrence (a layer's heads stacked).
        grad_v: [d_v] Grad saliency of the channel's value-projection row and output-projection column.
    """

    W_v: np.ndarray | None = None
    W_o: np.ndarray | None = None
    w_norm: np.ndarray | None = None
    V: np.ndarray | None = None
    grad_v: np.ndarray | None = None

    @property
    def d_v(self) -> int:
        for name, axis in (("W_v", 0), ("W_o", 0), ("V", 1), ("grad_v", 0)):
            value = getattr(self, name)
            if value is not None:
                return int(np.shape(value)[axis])
        raise ValueError("ValueData has none of W_v, W_o, V, grad_v: cannot tell d_v")

    def need(self, name: str, selector: str) -> np.ndarray:
        value = getattr(self, name)
        if value is None:
            raise ValueError(f"the value side of selector {selector!r} needs ValueData.{name}, which is None")
        return np.asarray(value, dtype=np.float64)


@register_value_side("rand", needs={"weights"})
def rand_values(data: ValueData, n_keep: int, *, rng: np.random.Generator) -> HeadSelection:
    """A uniform subset of the unit's d_v channels from its own generator (the key side's ``rand``)."""
    return get_selector("rand")(HeadData(W_q=np.zeros((data.d_v, 1))), n_keep, rng=rng)


@register_value_side("l1", needs={"weights"})
def l1_values(data: ValueData, n_keep: int, *, rng: np.random.Generator) -> HeadSelection:
    """The key side's ``l1`` on the value projection's rows and the output projection's columns."""
    return get_selector("l1")(HeadData(W_q=data.need("W_v", "l1"), W_k=data.need("W_o", "l1")), n_keep, rng=rng)


@register_value_side("swanda", needs={"weights", "activations"})
def swanda_values(data: ValueData, n_keep: int, *, rng: np.random.Generator) -> HeadSelection:
    """``||V[:, j]||_2 * ||w_j W_o[:, j]||_2``: the channel's calibration energy times what it writes."""
    w_o = data.need("W_o", "swanda")
    if data.w_norm is not None:
        w_o = w_o * np.asarray(data.w_norm, dtype=np.float64)[:, None]
    return top_k(np.linalg.norm(data.need("V", "swanda"), axis=0) * np.linalg.norm(w_o, axis=1), n_keep)


@register_value_side("grad", needs={"grad"})
def grad_values(data: ValueData, n_keep: int, *, rng: np.random.Generator) -> HeadSelection:
    """The largest Grad saliencies ``grad_v``."""
    return top_k(data.need("grad_v", "grad"), n_keep)


@register_value_side("drrqr", needs={"activations"})
def drrqr_values(data: ValueData, n_keep: int, *, rng: np.random.Generator, **options) -> HeadSelection:
    """The key side's ``drrqr`` on V alone (its variant "k" with K = V); the same options (``f``, ...)."""
    return get_selector("drrqr")(HeadData(K=data.need("V", "drrqr")), n_keep, variant="k", rng=rng, **options)
