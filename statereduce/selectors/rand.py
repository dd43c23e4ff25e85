"""``rand``: a seeded uniform subset of channels (paper Sec. 3.4, the random baseline)."""

from __future__ import annotations

import numpy as np

from statereduce.selectors.registry import HeadData, HeadSelection, register_selector


@register_selector("rand", needs={"weights"}, variants=("kq",), scores=False)
def rand(data: HeadData, n_keep: int, *, variant: str = "kq", rng: np.random.Generator) -> HeadSelection:
    """Keep ``n_keep`` channels drawn uniformly without replacement from the head's own generator.

    Only the head's d_k is read (from ``W_q``/``W_k``, hence ``needs={"weights"}``). Determinism comes from
    the per-head generator that :func:`~statereduce.selectors.registry.select_heads` derives from
    (seed, layer, head). Has no scores.

    Args:
        data: the head's data; only its shape is used.
        n_keep: channels to keep.
        variant: must be "kq" (a random subset has no key/query side).
        rng: the head's generator.
    """
    keep = np.sort(rng.choice(data.d_k, size=n_keep, replace=False)).astype(np.int64)
    return HeadSelection(keep=keep, scores=None)
