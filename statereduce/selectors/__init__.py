"""Channel selectors (paper Sec. 3.4): which key/query channels each head keeps.

Importing this package registers every selector (``rand``, ``l1``, ``swanda``, ``grad``, ``drrqr``, ``ghost``,
``pca``, ``pca-adv``); each lives in its own module so that the workflow can make that file an input of its own jobs
only. See :mod:`statereduce.selectors.registry` for the API, and
:mod:`statereduce.common.layout` for the method-token grammar ``<selector>[-k|-q|-v|-kv][.<calib>][@<budget>][+<fit>]``
that :func:`parse_method` reads against the registered selectors; :mod:`statereduce.selectors.values` holds the value
side of the selectors that have one (``-v``, ``-kv``).

To add a selector: write ``selectors/<name>.py`` with a function decorated by
``@register_selector("<name>", needs={...})`` and import the module below.
"""

from __future__ import annotations

from statereduce.selectors import drrqr, ghost, grad, l1, pca, rand, swanda  # noqa: F401  (registration)
from statereduce.selectors import values  # noqa: F401, E402  (the value sides; after the selectors they extend)
from statereduce.common.layout import DEFAULT_CALIB, DEFAULT_VARIANT, VARIANTS, MethodSpec
from statereduce.selectors.registry import (
    NEEDS,
    HeadData,
    HeadSelection,
    Selector,
    format_method,
    get_selector,
    head_rng,
    method_regex,
    n_keep_for,
    parse_method,
    register_selector,
    select_heads,
    selector_names,
)

#: Unanchored regex of every valid method token, for Snakemake ``wildcard_constraints``.
METHOD_REGEX = method_regex()

__all__ = [
    "DEFAULT_CALIB",
    "DEFAULT_VARIANT",
    "METHOD_REGEX",
    "NEEDS",
    "VARIANTS",
    "HeadData",
    "HeadSelection",
    "MethodSpec",
    "Selector",
    "format_method",
    "get_selector",
    "head_rng",
    "method_regex",
    "n_keep_for",
    "parse_method",
    "register_selector",
    "select_heads",
    "selector_names",
]
