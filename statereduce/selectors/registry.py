"""Selector registry, per-head data containers, method tokens of the registered selectors and the per-model driver.

A *selector* maps the statistics of one (layer, head) to the key/query channels to keep (paper
Sec. 3.4: the same indices apply to K, Q and their conv filters). Each selector lives in its own
module (``rand.py``, ``l1.py``, ``swanda.py``, ``grad.py``, ``drrqr.py``) and registers itself with
:func:`register_selector`; the workflow makes that module file an input of that selector's jobs only
(``Selector.source_file``), so editing one selector recomputes only its own results.

Method tokens (``<selector>[-k|-q|-v|-kv][.<calib>][@<budget>][+<fit>]``, grammar in :mod:`statereduce.common.layout`) name a
selection in result paths ``results/{model}/{method}_{pct}/``; :func:`parse_method` reads one against the registered
selectors.

Most selectors keep a subset of channels (an index selection). A selector may instead return a semi-orthogonal
transform ``T`` [d_k', d_k] per head (``pca``: paper App. B.3-B.5, C.6); an index selection is the special case
``T = rows keep of the identity``.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from statereduce.common import layout
from statereduce.common.layout import DEFAULT_VARIANT, NAME_PATTERN, VARIANTS, MethodSpec, unknown_selector

#: What a value side may read (:class:`ValueSide`).
VALUE_NEEDS = frozenset({"weights", "activations", "grad"})
#: Data a selector may declare it needs (what the workflow must load for its jobs).
NEEDS = frozenset({"weights", "activations", "xnorm", "grad"})
#: Largest deviation of ``T T^T`` from the identity that a transform selection may have.
ORTHONORMAL_TOL = 1e-8


@dataclass
class HeadData:
    """Everything a selector may need for one (layer, head); fields a selector does not need may be None.

    Args:
        W_q: [d_k, hidden] the head's rows of the query projection.
        W_k: [d_k, hidden] the head's rows of the key projection.
        K: [N, d_k] calibration keys as they enter the recurrence (after conv and activation, before
            the L2 norm).
        Q: [N, d_k] calibration queries, likewise.
        xnorm: [hidden] column L2 norms of the projection input X over all calibration tokens (S-Wanda).
        grad_q: [d_k] per-channel Grad saliency of W_q, ``sum_i |W_q[j,i] dL/dW_q[j,i]|``.
        grad_k: [d_k] per-channel Grad saliency of W_k.
    """

    W_q: np.ndarray | None = None
    W_k: np.ndarray | None = None
    K: np.ndarray | None = None
    Q: np.ndarray | None = None
    xnorm: np.ndarray | None = None
    grad_q: np.ndarray | None = None
    grad_k: np.ndarray | None = None

    @property
    def d_k(self) -> int:
        """The head's key dimension, read off the first field that is present."""
        for name, axis in (("W_q", 0), ("W_k", 0), ("K", 1), ("Q", 1), ("grad_q", 0), ("grad_k", 0)):
            value = getattr(self, name)
            if value is not None:
                return int(np.shape(value)[axis])
        raise ValueError("HeadData has none of W_q, W_k, K, Q, grad_q, grad_k: cannot tell d_k")


@dataclass
class HeadSelection:
    """The channels kept for one head, or the transform that maps its d_k channels to d_k'.

    Args:
        keep: sorted int64 [d_k'] kept channel indices; None for a transform selection.
        scores: float64 [d_k'] the selector's scores of the kept channels (of the transform's rows), or None.
        transform: float64 [d_k', d_k] with orthonormal rows (``T T^T = I``), or None for an index selection.
            The pruned head's keys and queries are ``T k`` and ``T q``.
    """

    keep: np.ndarray | None
    scores: np.ndarray | None = None
    transform: np.ndarray | None = None


SelectorFn = Callable[..., HeadSelection]
ObjectiveFn = Callable[..., dict]


class Selector:
    """A registered channel selector (use :func:`get_selector`; do not instantiate directly).

    Attributes:
        name: registry name (the first part of a method token).
        needs: subset of {"weights", "activations", "xnorm", "grad"}: what the workflow must load.
        variants: the scoring variants the selector accepts.
        source_file: absolute path of the module defining the selector (a workflow input of its jobs).
        options: names of the keyword options the selector accepts (config ``selectors.<name>``).
        kind: "index" (keeps a subset of channels) or "transform" (returns a semi-orthogonal transform per head).
        scores: whether its selections carry channel scores (the greedy budget's score mass needs them).
    """

    def __init__(self, name: str, needs: frozenset[str], variants: tuple[str, ...], fn: SelectorFn, *,
                 kind: str = "index", scores: bool = True) -> None:
        self.name = name
        self.needs = needs
        self.variants = variants
        self.kind = kind
        self.scores = scores
        self.fn = fn
        self.objective: ObjectiveFn | None = None  # set by register_objective
        self.source_file = os.path.abspath(inspect.getsourcefile(fn) or inspect.getfile(fn))
        params = inspect.signature(fn).parameters.values()
        self.options = tuple(
            p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in ("rng", "variant")
        )
        self.__doc__ = fn.__doc__

    def __repr__(self) -> str:
        return f"Selector({self.name!r}, needs={sorted(self.needs)}, variants={list(self.variants)})"

    def __call__(
        self, data: HeadData, n_keep: int, *, variant: str = DEFAULT_VARIANT, rng: np.random.Generator, **options: Any
    ) -> HeadSelection:
        """Select ``n_keep`` channels of one head.

        Args:
            data: the head's statistics (see :class:`HeadData`).
            n_keep: number of channels to keep, ``1 <= n_keep <= d_k``.
            variant: "kq" (score from both sides), "k" (keys only) or "q" (queries only); paper Table 16.
            rng: the head's random generator (only ``rand`` draws from it).
            **options: selector-specific keyword options (see ``Selector.options``).

        Returns:
            A :class:`HeadSelection` with sorted int64 ``keep``.
        """
        if variant not in self.variants:
            raise ValueError(
                f"selector {self.name!r} does not support variant {variant!r}; valid: {list(self.variants)}"
            )
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            raise ValueError(
                f"unknown option(s) {unknown} for selector {self.name!r}; valid: {list(self.options) or 'none'}"
            )
        d_k = data.d_k
        if isinstance(n_keep, bool) or not isinstance(n_keep, (int, np.integer)) or not 1 <= n_keep <= d_k:
            raise ValueError(f"n_keep={n_keep!r} must be an integer in [1, d_k={d_k}]")
        sel = self.fn(data, int(n_keep), variant=variant, rng=rng, **options)
        scores = None if sel.scores is None else np.asarray(sel.scores, dtype=np.float64)
        if scores is not None and scores.shape != (n_keep,):
            raise RuntimeError(f"selector {self.name!r} returned scores of shape {scores.shape} for n_keep={n_keep}")
        if sel.transform is not None:
            return HeadSelection(keep=None, scores=scores, transform=check_transform(sel.transform, n_keep, d_k,
                                                                                     f"selector {self.name!r}"))
        keep = np.asarray(sel.keep, dtype=np.int64)
        if keep.shape != (n_keep,) or np.any(np.diff(keep) <= 0) or keep[0] < 0 or keep[-1] >= d_k:
            raise RuntimeError(
                f"selector {self.name!r} returned invalid keep {keep.tolist()} for d_k={d_k}, n_keep={n_keep}"
            )
        return HeadSelection(keep=keep, scores=scores)

    def objective_values(self, data: HeadData, widths: Iterable[int], *, variant: str = DEFAULT_VARIANT,
                         rng: np.random.Generator, **options: Any) -> dict[int, float]:
        """The share of the selector's own objective that its selection of each width captures, for one head.

        The greedy per-layer budget (:func:`statereduce.core.budgets.greedy_values`) ranks widths by it. A selector with
        a registered objective (:func:`register_objective`, e.g. DRRQR's captured energy) uses that; otherwise the
        value of width w is the selector's score mass, the sum of its ``w`` largest channel scores over the sum of
        all (``n_keep = d_k``; e.g. Grad's saliency). Non-decreasing in w, 1.0 at ``d_k``.

        Raises:
            ValueError: one line for a selector with neither an objective nor channel scores (``rand``), or scores
                that are negative or sum to zero.
        """
        ws = sorted({int(w) for w in widths})
        if self.objective is not None:
            return {int(w): float(v) for w, v in self.objective(data, ws, variant=variant, rng=rng, **options).items()}
        full = self(data, data.d_k, variant=variant, rng=rng, **options)
        if full.scores is None:
            raise ValueError(f"selector {self.name!r} has no channel scores and no objective: the greedy budget "
                             "policy cannot rank its widths (use a spectrum or sensitivity budget)")
        s = np.sort(np.asarray(full.scores, dtype=np.float64))[::-1]
        if s.min() < 0 or not s.sum() > 0:
            raise ValueError(f"selector {self.name!r}: scores must be non-negative with a positive sum for the "
                             f"greedy budget policy (min {s.min():.3g}, sum {s.sum():.3g})")
        cum = np.cumsum(s) / s.sum()
        return {w: float(cum[w - 1]) for w in ws}


_REGISTRY: dict[str, Selector] = {}


def register_selector(
    name: str, needs: set[str] | frozenset[str], *, variants: tuple[str, ...] = VARIANTS, kind: str = "index",
    scores: bool = True,
) -> Callable[[SelectorFn], SelectorFn]:
    """Decorator registering ``fn(data, n_keep, *, variant, rng, **options) -> HeadSelection`` under ``name``.

    Args:
        name: registry name, ``[a-z][a-z0-9]*`` (it appears in method tokens and paths).
        needs: subset of {"weights", "activations", "xnorm", "grad"}.
        variants: scoring variants the selector supports (default all of "kq", "k", "q").
        kind: "index" (the default: keeps a subset of channels) or "transform" (per-head transforms, ``pca``).
        scores: False for a selector whose selections carry no channel scores (``rand``).
    """
    if not re.fullmatch(NAME_PATTERN, name) or re.search(r"-[kq]$", name):
        raise ValueError(f"selector name {name!r} must match {NAME_PATTERN} and not end in -k or -q")
    bad = set(needs) - NEEDS
    if bad:
        raise ValueError(f"selector {name!r}: unknown needs {sorted(bad)}; valid: {sorted(NEEDS)}")
    bad_var = [v for v in variants if v not in VARIANTS] + ([] if DEFAULT_VARIANT in variants else [DEFAULT_VARIANT])
    if bad_var or not variants:
        raise ValueError(f"selector {name!r}: variants {list(variants)} must be a subset of {list(VARIANTS)} with 'kq'")

    def decorator(fn: SelectorFn) -> SelectorFn:
        if name in _REGISTRY:
            raise ValueError(f"selector {name!r} registered twice ({_REGISTRY[name].source_file})")
        if kind not in ("index", "transform"):
            raise ValueError(f"selector {name!r}: kind {kind!r} must be 'index' or 'transform'")
        _REGISTRY[name] = Selector(name, frozenset(needs), tuple(variants), fn, kind=kind, scores=scores)
        return fn

    return decorator


def register_objective(name: str) -> Callable[[ObjectiveFn], ObjectiveFn]:
    """Decorator registering ``fn(data, widths, *, variant, rng, **options) -> {width: share}`` as the objective of
    the registered selector ``name`` (:meth:`Selector.objective_values`); put it in the selector's own module."""

    def decorator(fn: ObjectiveFn) -> ObjectiveFn:
        get_selector(name).objective = fn
        return fn

    return decorator


def selector_names() -> list[str]:
    """Registered selector names, sorted."""
    return sorted(_REGISTRY)


class ValueSide:
    """The value side of a registered selector (:mod:`statereduce.selectors.values`): what its ``-v`` and ``-kv``
    tokens cut with (use :func:`value_side`).

    Attributes:
        name: the selector's name.
        needs: subset of {"weights", "activations", "grad"}: what the side reads (W_v, W_o and the output norm's
            weight; calibration values V; Grad saliencies ``grad_v``).
        fn: ``fn(data: ValueData, n_keep, *, rng, **options) -> HeadSelection``.
        takes_options: whether ``fn`` takes the selector's options (config ``selectors.<name>``): it has ``**options``.
    """

    def __init__(self, name: str, needs: frozenset[str], fn: Callable[..., HeadSelection]) -> None:
        self.name, self.needs, self.fn = name, needs, fn
        self.takes_options = any(p.kind is inspect.Parameter.VAR_KEYWORD
                                 for p in inspect.signature(fn).parameters.values())
        self.source_file = os.path.abspath(inspect.getsourcefile(fn) or inspect.getfile(fn))

    def __call__(self, data: Any, n_keep: int, *, rng: np.random.Generator,
                 options: Mapping[str, Any] | None = None) -> HeadSelection:
        """The unit's selection of ``n_keep`` value channels; ``options`` reach ``fn`` where it takes them."""
        return self.fn(data, n_keep, rng=rng, **(dict(options or {}) if self.takes_options else {}))

    def __repr__(self) -> str:
        return f"ValueSide({self.name!r}, needs={sorted(self.needs)})"


#: selector name -> its value side: what ``-v`` / ``-kv`` tokens cut with
_VALUE_SIDES: dict[str, ValueSide] = {}


def register_value_side(name: str, needs: Iterable[str]) -> Callable[[Callable[..., HeadSelection]],
                                                                     Callable[..., HeadSelection]]:
    """Decorator registering ``fn(data: ValueData, n_keep, *, rng, **options) -> HeadSelection`` as the value side of
    the registered selector ``name``, reading ``needs`` (a subset of "weights", "activations", "grad"): its method
    tokens then take ``-v`` and ``-kv``."""
    needs = frozenset(needs)
    if not needs or needs - VALUE_NEEDS:
        raise ValueError(f"value side {name!r}: needs {sorted(needs)}; valid: a non-empty subset of "
                         f"{sorted(VALUE_NEEDS)}")

    def decorator(fn):
        if name not in _REGISTRY:
            raise ValueError(f"value side for unknown selector {name!r}; valid: {', '.join(sorted(_REGISTRY))}")
        _VALUE_SIDES[name] = ValueSide(name, needs, fn)
        return fn

    return decorator


def value_side(name: str) -> ValueSide:
    """The value side of selector ``name``; one line naming the selectors that have one otherwise."""
    if name not in _VALUE_SIDES:
        raise ValueError(f"selector {name!r} has no value side; valid: {', '.join(sorted(_VALUE_SIDES))}")
    return _VALUE_SIDES[name]


def value_side_names() -> list[str]:
    """The selectors with a value side (their tokens take ``-v`` and ``-kv``)."""
    return sorted(_VALUE_SIDES)


def _vocabulary() -> dict[str, tuple[str, ...]]:
    """The registered selectors and their variants (with ``v`` and ``kv`` where a selector has a value side), the
    vocabulary of method tokens."""
    return {name: sel.variants + (("v", "kv") if name in _VALUE_SIDES else ()) for name, sel in _REGISTRY.items()}


def get_selector(name: str) -> Selector:
    """The registered selector called ``name``; an unknown name raises a one-line ValueError listing valid ones."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise unknown_selector(str(name), _vocabulary()) from None


# ----------------------------------------------------------------------------------------------------
# Method tokens


def method_regex(fit: bool | None = None) -> str:
    """Regex (unanchored, for Snakemake ``wildcard_constraints``) matching exactly the valid method tokens (``fit``:
    :func:`statereduce.common.layout.method_regex`'s)."""
    return layout.method_regex(_vocabulary(), fit)


def parse_method(token: str) -> MethodSpec:
    """Parse a method token of a registered selector into a :class:`~statereduce.common.layout.MethodSpec`
    (:func:`statereduce.common.layout.parse_token`)."""
    return layout.parse_token(token, _vocabulary())


def format_method(spec: MethodSpec) -> str:
    """The canonical method token of a :class:`~statereduce.common.layout.MethodSpec` of a registered selector."""
    return layout.format_method(spec, _vocabulary())


# ----------------------------------------------------------------------------------------------------
# Compression ratio and the per-model driver


#: What a pct means, for the errors of a pct that removes no channel.
PCT_MEANING = "pcts are percent of channels removed, e.g. drrqr_50 removes half"


def n_removed_for(d: int, pct: float) -> int:
    """Channels removed per head when ``pct`` percent of ``d`` are: ``round(d * pct / 100)`` (Python's round, half to
    even); unchecked (:func:`n_keep_for` checks)."""
    return round(int(d) * float(pct) / 100.0)


def no_channel_removed(pct: float, d: int, what: str, meaning: str = PCT_MEANING) -> ValueError:
    """The one-line error of a pct that removes none of ``d`` channels (``what``: e.g. "key channel of d_k=64")."""
    return ValueError(f"pct {float(pct):g} removes no {what} (round({d}*{float(pct):g}/100) = 0); {meaning}")


def n_keep_for(d_k: int, pct: float, side: str = "key") -> int:
    """Channels kept per head when ``pct`` percent of the ``d_k`` key (or value) channels are removed.

    ``d_k - round(d_k * pct / 100)`` (:func:`n_removed_for`); ``pct`` is the paper's "compression" (50 keeps half).
    Every cut's widths come from here (:mod:`statereduce.core.cuts`, the per-layer budgets' uniform total), so a
    pct that removes no channel (a fraction written for a percent: 0.5 of d_k=64) or all of them is refused here.

    Args:
        d_k: the head's key (or value) dimension (>= 1).
        pct: percent of channels removed, strictly between 0 and 100.
        side: "key" (d_k) or "value" (d_v): which channels the errors name.
    Raises:
        ValueError: one line, for a pct outside (0, 100), one that removes no channel or every channel.
    """
    name = "d_v" if side == "value" else "d_k"
    if isinstance(d_k, bool) or not isinstance(d_k, (int, np.integer)) or d_k < 1:
        raise ValueError(f"{name}={d_k!r} must be a positive integer")
    try:
        p = float(pct)
    except (TypeError, ValueError):
        raise ValueError(f"pct={pct!r} must be a number in (0, 100)") from None
    if isinstance(pct, bool) or not 0.0 < p < 100.0:
        raise ValueError(f"pct={pct!r} must be in (0, 100) (percent of {name}={d_k} channels removed)")
    n_removed = n_removed_for(d_k, p)
    if n_removed == 0:
        raise no_channel_removed(p, d_k, f"{side} channel of {name}={d_k}")
    n_keep = int(d_k) - n_removed
    if n_keep < 1:
        raise ValueError(f"pct={pct!r} removes every channel of {name}={d_k} (keeps {n_keep}); use a smaller pct")
    return n_keep


def head_rng(seed: int, layer: int, head: int) -> np.random.Generator:
    """The random generator of one (layer, head): ``default_rng(SeedSequence([seed, layer, head]))``, independent of
    which other heads are processed and in which order."""
    return np.random.default_rng(np.random.SeedSequence([int(seed), int(layer), int(head)]))


def select_heads(
    selector: str | Selector,
    heads: Iterable[tuple[int, int, HeadData]],
    n_keep: int | Mapping[int, int],
    variant: str = DEFAULT_VARIANT,
    seed: int = 0,
    options: Mapping[str, Any] | None = None,
    *,
    progress: bool = True,
    workers: int = 1,
) -> list[tuple[int, int, HeadSelection]]:
    """Run a selector over every (layer, head), deterministically given ``seed``.

    Each head gets its own generator ``np.random.default_rng(SeedSequence([seed, layer, head]))``, so a
    head's selection does not depend on which other heads are processed, in which order, or by how many
    workers.

    Args:
        selector: a registered name or a :class:`Selector`.
        heads: iterable of ``(layer, head, HeadData)`` (a generator is fine: heads are pulled lazily, at
            most ``2 * workers`` ahead of the results).
        n_keep: channels kept per head (see :func:`n_keep_for`), or {layer: channels kept per head of that layer}
            (a per-layer key budget).
        variant: scoring variant, "kq", "k" or "q".
        seed: non-negative integer seed.
        options: selector-specific keyword options.
        progress: show a tqdm progress bar (on stderr).
        workers: heads processed concurrently by a thread pool (NumPy/LAPACK release the GIL); with more
            than one worker BLAS is limited to one thread each (threadpoolctl), which uses the cores better
            than multithreaded BLAS on the small per-head matrices (give the rule's ``threads``).

    Returns:
        ``[(layer, head, HeadSelection), ...]`` in input order.
    """
    from tqdm.auto import tqdm

    sel = selector if isinstance(selector, Selector) else get_selector(selector)
    if variant not in sel.variants:
        raise ValueError(f"selector {sel.name!r} does not support variant {variant!r}; valid: {list(sel.variants)}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed={seed!r} must be a non-negative integer")
    if isinstance(workers, bool) or not isinstance(workers, (int, np.integer)) or workers < 1:
        raise ValueError(f"workers={workers!r} must be a positive integer")
    opts = dict(options or {})

    def one(item: tuple[int, int, HeadData]) -> tuple[int, int, HeadSelection]:
        layer, head, data = item
        rng = head_rng(seed, layer, head)
        try:
            if isinstance(n_keep, Mapping) and int(layer) not in n_keep:
                raise ValueError(f"n_keep names layers {sorted(n_keep)}, not this one")
            result = sel(data, n_keep[int(layer)] if isinstance(n_keep, Mapping) else n_keep, variant=variant,
                         rng=rng, **opts)
        except ValueError as err:
            raise ValueError(f"layer {layer} head {head}: {err}") from err
        return int(layer), int(head), result

    total = len(heads) if hasattr(heads, "__len__") else None  # type: ignore[arg-type]
    out: list[tuple[int, int, HeadSelection]] = []
    with tqdm(total=total, desc=f"select {sel.name}", unit="head", disable=not progress) as bar:
        if workers == 1:
            for item in heads:
                out.append(one(item))
                bar.update()
            return out
        with contextlib.ExitStack() as stack:
            try:
                from threadpoolctl import threadpool_limits

                stack.enter_context(threadpool_limits(limits=1, user_api="blas"))
            except ImportError:  # pragma: no cover - threadpoolctl ships with scipy's usual stacks
                pass
            pool = stack.enter_context(ThreadPoolExecutor(max_workers=int(workers)))
            pending: deque[Future] = deque()
            for item in heads:
                pending.append(pool.submit(one, item))
                if len(pending) >= 2 * workers:
                    out.append(pending.popleft().result())
                    bar.update()
            while pending:
                out.append(pending.popleft().result())
                bar.update()
    return out


# ----------------------------------------------------------------------------------------------------
# Helpers shared by the selector modules


def top_k(scores: np.ndarray, n_keep: int) -> HeadSelection:
    """Keep the ``n_keep`` highest scores (ties: lower index first); keep sorted, scores in keep order."""
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim != 1:
        raise ValueError(f"scores must be 1-D, got shape {s.shape}")
    if not np.isfinite(s).all():
        bad = np.flatnonzero(~np.isfinite(s))[:5].tolist()
        raise ValueError(f"non-finite channel scores at channels {bad}")
    order = np.lexsort((np.arange(s.shape[0]), -s))  # primary: score descending; secondary: index ascending
    keep = np.sort(order[:n_keep]).astype(np.int64)
    return HeadSelection(keep=keep, scores=s[keep])


def require(data: HeadData, selector: str, variant: str, fields_by_side: Mapping[str, str]) -> dict[str, np.ndarray]:
    """Fetch the fields a variant needs (``{"k": "W_k", "q": "W_q"}``), as float64; missing ones raise ValueError."""
    sides = "kq" if variant == "kq" else variant
    out = {}
    for side in sides:
        field = fields_by_side[side]
        value = getattr(data, field)
        if value is None:
            raise ValueError(f"selector {selector!r} (variant {variant!r}) needs HeadData.{field}, which is None")
        out[side] = np.asarray(value, dtype=np.float64)
    return out


def check_transform(transform: Any, n_keep: int, d_k: int, who: str = "transform") -> np.ndarray:
    """Validate a transform selection: float64 [n_keep, d_k], finite, orthonormal rows; returns it as float64."""
    t = np.asarray(transform, dtype=np.float64)
    if t.shape != (n_keep, d_k):
        raise RuntimeError(f"{who}: transform of shape {t.shape}, expected [d_k'={n_keep}, d_k={d_k}]")
    if not np.isfinite(t).all():
        raise RuntimeError(f"{who}: transform has non-finite entries")
    dev = float(np.abs(t @ t.T - np.eye(n_keep)).max())
    if dev > ORTHONORMAL_TOL:
        raise RuntimeError(f"{who}: transform rows are not orthonormal (|T T^T - I| = {dev:.1e} > {ORTHONORMAL_TOL})")
    return t


def check_weights(W: Mapping[str, np.ndarray], d_k: int) -> int:
    """Validate [d_k, hidden] projection rows; returns hidden."""
    hidden = None
    for side, w in W.items():
        if w.ndim != 2 or w.shape[0] != d_k:
            raise ValueError(f"W_{side} must be [d_k={d_k}, hidden], got shape {w.shape}")
        if hidden is not None and w.shape[1] != hidden:
            raise ValueError(f"W_q and W_k disagree on hidden: {hidden} vs {w.shape[1]}")
        hidden = w.shape[1]
    assert hidden is not None
    return hidden
