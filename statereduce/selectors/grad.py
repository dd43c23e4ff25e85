"""``grad``: first-order Taylor saliency, s_j = sum_i |W_Q[j,i] dL/dW_Q[j,i]| + |W_K[j,i] dL/dW_K[j,i]|.

Paper Sec. 3.4. The per-channel sums ``grad_q[j]``/``grad_k[j]`` come precomputed from the full model's
language-model loss on the calibration set (the ``grad_scores.h5`` artifact, which only this selector reads).
"""

from __future__ import annotations

import numpy as np

from statereduce.selectors.registry import HeadData, HeadSelection, register_selector, require, top_k


@register_selector("grad", needs={"grad"})
def grad(data: HeadData, n_keep: int, *, variant: str = "kq", rng: np.random.Generator) -> HeadSelection:
    """Keep the channels with the largest gradient saliency ``gq[j] + gk[j]`` (only gk for "k", gq for "q").

    Args:
        data: needs ``grad_q`` and/or ``grad_k`` ([d_k], non-negative) depending on the variant.
        n_keep: channels to keep.
        variant: "kq", "k" or "q".
        rng: unused (deterministic).
    """
    g = require(data, "grad", variant, {"k": "grad_k", "q": "grad_q"})
    d_k = data.d_k
    for side, v in g.items():
        if v.shape != (d_k,):
            raise ValueError(f"grad_{side} must be [d_k={d_k}], got shape {v.shape}")
        if np.any(v < 0):
            raise ValueError(f"grad_{side} holds sums of absolute values and must be non-negative")
    return top_k(sum(g.values()), n_keep)
