"""``swanda``: structured Wanda, s_j = sum_i (|W_Q[j,i]| + |W_K[j,i]|) ||X[:, i]||_2 (paper Sec. 3.4).

Wanda (Sun et al., 2024) weighs each weight by the norm of the input feature it multiplies; summed over
a channel's row it becomes a structured per-channel score. ``xnorm`` is the column L2 norm of the
projection input X over all calibration tokens, captured per layer.
"""

from __future__ import annotations

import numpy as np

from statereduce.selectors.registry import HeadData, HeadSelection, check_weights, register_selector, require, top_k


@register_selector("swanda", needs={"weights", "xnorm"})
def swanda(data: HeadData, n_keep: int, *, variant: str = "kq", rng: np.random.Generator) -> HeadSelection:
    """Keep the channels with the largest activation-weighted L1 norm of their projection rows.

    ``s_j = sum_i (|W_Q[j,i]| + |W_K[j,i]|) * xnorm[i]`` for "kq"; only the key (query) term for "k" ("q").

    Args:
        data: needs ``xnorm`` ([hidden]) and ``W_q`` and/or ``W_k`` ([d_k, hidden]) depending on the variant.
        n_keep: channels to keep.
        variant: "kq", "k" or "q".
        rng: unused (deterministic).
    """
    W = require(data, "swanda", variant, {"k": "W_k", "q": "W_q"})
    hidden = check_weights(W, data.d_k)
    if data.xnorm is None:
        raise ValueError("selector 'swanda' needs HeadData.xnorm, which is None")
    xnorm = np.asarray(data.xnorm, dtype=np.float64)
    if xnorm.shape != (hidden,):
        raise ValueError(f"xnorm must be [hidden={hidden}], got shape {xnorm.shape}")
    if np.any(xnorm < 0):
        raise ValueError("xnorm holds L2 norms and must be non-negative")
    scores = sum(np.abs(w) @ xnorm for w in W.values())
    return top_k(scores, n_keep)
