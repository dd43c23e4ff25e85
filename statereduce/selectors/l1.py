"""``l1``: weight-magnitude scoring, s_j = ||W_Q[j]||_1 + ||W_K[j]||_1 (paper Sec. 3.4, Eq. for L1)."""

from __future__ import annotations

import numpy as np

from statereduce.selectors.registry import HeadData, HeadSelection, check_weights, register_selector, require, top_k


@register_selector("l1", needs={"weights"})
def l1(data: HeadData, n_keep: int, *, variant: str = "kq", rng: np.random.Generator) -> HeadSelection:
    """Keep the channels with the largest L1 norm of their projection rows.

    ``s_j = ||W_Q[j, :]||_1 + ||W_K[j, :]||_1`` for variant "kq"; only the key (query) term for "k" ("q")
    (paper App. C.7, Table 16). Scores are the s_j of the kept channels.

    Args:
        data: needs ``W_q`` and/or ``W_k`` ([d_k, hidden]) depending on the variant.
        n_keep: channels to keep.
        variant: "kq", "k" or "q".
        rng: unused (deterministic).
    """
    W = require(data, "l1", variant, {"k": "W_k", "q": "W_q"})
    check_weights(W, data.d_k)
    scores = sum(np.abs(w).sum(axis=1) for w in W.values())
    return top_k(scores, n_keep)
