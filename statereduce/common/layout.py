"""The results layout: every path the workflow writes under ``results/``, and the parser of such a path.

Templates use Snakemake's wildcard names (``{model}``, ``{method}``, ``{pct}``, ``{calib}``), so a rule's output is
the template itself and an input function fills it with :func:`path`. A pct appears in paths as
:func:`format_pct` writes it (``50``, ``37.5``). :func:`parse` reads a path back into its parts; configuration
checks of requested targets (:func:`statereduce.config.check_target`) and the scripts that need the model of an
input use it, so that the layout is written down here only.

::

    results/{model}/base/                 the base checkpoint (or source.json naming it)
    results/{model}/weights/qk.h5         q/k projection weights
    results/{model}/calib/{calib}/        activations.h5, grad_scores.h5
    results/{model}/select/{method}_{pct}.parquet
    results/{model}/select/{method}_{pct}.allocation.json   per-layer key widths of a method with @<budget>
    results/{model}/select/{method}_{pct}.split.json        d_k' and d_v' of a joint cut with @<budget> (policy split)
    results/{model}/select/{method}.values.json    a measured budget's per-width values (every pct's allocation)
    results/{model}/select/{method}_{pct}.fit.safetensors   re-fitted output projections of a method with +<fit>
    results/{model}/baseline/             eval.json, rank.json, speed.json of the unpruned model; generate.json
                                          (generate() speed, baseline and pruned shapes side by side)
    results/{model}/{method}_{pct}/       pruned/, rft/, eval.json (the summary), rank.json, speed.json
    results/{model}/{method}_{pct}/export/{stage}/   pruned/ or rft/ ready to upload, with a model card
    results/tables/, results/figures/     across models

Method tokens name a selection in these paths (``{method}``)::

    <selector>[-k|-q|-v|-kv][.<calib>][@<budget>][+<fit>]

Selector names are ``[a-z][a-z0-9]*`` words joined by dashes (``pca-adv``); none ends in ``-k``, ``-q``, ``-v`` or
``-kv``. ``-k`` / ``-q`` score from the key / query side only (paper App. C.7, Table 16); no suffix scores from both
(the default, "kq"). These cut key channels, and ``{pct}`` is the percent of key channels removed. ``-v`` cuts value
channels instead (each head's state rows; ``{pct}``: percent of value channels removed, the same percent of the
state), ``-kv`` both (``{pct}``: percent of the state removed, split equally: d_k'/d_k and d_v'/d_v near
sqrt(1 - pct/100); :func:`statereduce.core.cuts.joint_widths`), each side scored by the selector's value or key
side (:mod:`statereduce.selectors.values`). ``.<calib>`` (``[a-z0-9]+``) names a non-default calibration set (paper Tables 2 and 7); the default
calibration has no suffix, so ``drrqr`` and ``drrqr.default`` are not both valid: only the plain token is.
``@<budget>`` (``[a-z0-9]+``) names a per-layer key budget (:mod:`statereduce.core.budgets`): each layer keeps its own
d_k' at the uniform cut's total; without it every layer keeps the same d_k'. On a joint cut (``-kv@<budget>``, a budget
of policy ``split``) it chooses the split of the state between d_k' and d_v' by calibration loss instead of the equal
split (:func:`statereduce.stages.select.choose_state_split`). A value cut (``-v``) takes no budget. Examples: ``drrqr``, ``l1-q``,
``grad-k``, ``pca-adv-k``, ``drrqr.prose``, ``grad-q.prose``, ``drrqr@energy``, ``grad.prose@sens``, ``drrqr-v``,
``grad-kv``, ``drrqr-kv@split``. ``+<fit>`` (``[a-z0-9]+``) names a compensation under ``fits:``
(:mod:`statereduce.core.fit`): the same selection (the token without ``+<fit>``, :attr:`MethodSpec.selection`), then
each cut mixer's output projection re-fitted on calibration tokens before the checkpoint is written
(``drrqr+fit``, ``drrqr@sens+fit``, ``grad-kv@layersplit+fit``).

:func:`parse_token` reads a token against a vocabulary (selector name -> its variants), or against the grammar alone
without one; :func:`statereduce.selectors.parse_method` reads it against the registered selectors (the parser the
rest of the package uses).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import PurePosixPath

RESULTS = "results"
TABLES = f"{RESULTS}/tables"
FIGURES = f"{RESULTS}/figures"

MODEL = f"{RESULTS}/{{model}}"
BASE = f"{MODEL}/base"
QK_WEIGHTS = f"{MODEL}/weights/qk.h5"
CALIB = f"{MODEL}/calib/{{calib}}"
ACTIVATIONS = f"{CALIB}/activations.h5"
GRAD_SCORES = f"{CALIB}/grad_scores.h5"
SELECTION = f"{MODEL}/select/{{method}}_{{pct}}.parquet"
ALLOCATION = f"{MODEL}/select/{{method}}_{{pct}}.allocation.json"
SPLIT = f"{MODEL}/select/{{method}}_{{pct}}.split.json"
FIT = f"{MODEL}/select/{{method}}_{{pct}}.fit.safetensors"
BUDGET_VALUES = f"{MODEL}/select/{{method}}.values.json"
BASELINE = f"{MODEL}/baseline"
BASELINE_EVAL = f"{BASELINE}/eval.json"
BASELINE_RANK = f"{BASELINE}/rank.json"
BASELINE_SPEED = f"{BASELINE}/speed.json"
BASELINE_GENERATE = f"{BASELINE}/generate.json"
STAGE = f"{MODEL}/{{method}}_{{pct}}"
PRUNED = f"{STAGE}/pruned"
RFT = f"{STAGE}/rft"
RFT_RESUME = f"{STAGE}/.rft_resume"
EXPORT = f"{STAGE}/export/{{stage}}"
"""An upload-ready folder of the ``pruned`` or ``rft`` checkpoint with its model card (rule export)."""
SUMMARY = f"{STAGE}/eval.json"
RANK = f"{STAGE}/rank.json"
SPEED = f"{STAGE}/speed.json"

#: Folders of ``results/{model}/`` whose name is not a ``<method>_<pct>`` stage.
FOLDERS = ("base", "baseline", "calib", "select", "weights")
#: A pct as paths write it (percent of key channels removed): :func:`format_pct`'s one spelling per ratio, so no
#: leading zero and no trailing zero after the point (``50``, ``37.5``; not ``050``, ``50.0``, ``50.00``).
PCT_RE = r"(?:0|[1-9]\d*)(?:\.\d*[1-9])?"


def format_pct(pct: float | int | str) -> str:
    """Path form of a pct: 50 -> '50', 37.5 -> '37.5' (a string is taken as already written)."""
    if isinstance(pct, str):
        return pct
    return str(int(pct)) if float(pct).is_integer() else str(pct)


def path(template: str, **parts) -> str:
    """``template`` with the given wildcards filled (others stay wildcards); ``pct`` goes through
    :func:`format_pct`."""
    for name, value in parts.items():
        template = template.replace(f"{{{name}}}", format_pct(value) if name == "pct" else str(value))
    return template


def table(name: str, ext: str) -> str:
    """``results/tables/{name}.{ext}``."""
    return f"{TABLES}/{name}.{ext}"


def figure(name: str) -> str:
    """``results/figures/{name}.png``."""
    return f"{FIGURES}/{name}.png"


@dataclass(frozen=True)
class ResultPath:
    """The parts of a path under ``results/{model}/``: ``folder`` is one of :data:`FOLDERS` or a stage
    ``<method>_<pct>``; ``stage`` is that stage, or a selection file's, split into ``method`` and ``pct`` (as written;
    ``None`` where the path has none: a budget values file has a method and no pct); ``calib`` the calibration id of a
    ``calib/`` path; ``rest`` what follows."""

    model: str
    folder: str
    rest: tuple[str, ...]
    stage: str | None = None
    method: str | None = None
    pct: str | None = None
    calib: str | None = None


def parse(target: str) -> ResultPath | None:
    """The parts of ``target`` when it lies under ``results/{model}/`` (not tables or figures), else None.

    A stage whose name is not ``<method>_<pct>`` keeps ``method`` None and ``pct`` None with ``stage`` set, so that
    callers can say what is wrong with it; ``pct`` is not checked against :data:`PCT_RE` here.
    """
    parts = PurePosixPath(target).parts
    if len(parts) < 3 or parts[0] != RESULTS or parts[1] in ("tables", "figures"):
        return None
    model, folder, rest = parts[1], parts[2], parts[3:]
    calib = rest[0] if folder == "calib" and rest else None
    if folder in FOLDERS and not (folder == "select" and rest):
        return ResultPath(model, folder, rest, calib=calib)
    if folder == "select" and rest[0].endswith(".values.json"):  # one per method with @<budget>, every pct's
        method = rest[0].removesuffix(".values.json")
        return ResultPath(model, folder, rest, stage=method, method=method)
    stage = folder
    if folder == "select":
        stage = (rest[0].removesuffix(".parquet").removesuffix(".allocation.json").removesuffix(".split.json")
                 .removesuffix(".fit.safetensors"))
    method, sep, pct = stage.rpartition("_")
    if not sep:
        return ResultPath(model, folder, rest, stage=stage)
    return ResultPath(model, folder, rest, stage=stage, method=method, pct=pct)


def is_pct(text: str) -> bool:
    """Whether ``text`` is a pct as paths write it (:data:`PCT_RE`)."""
    return re.fullmatch(PCT_RE, text) is not None


def canonical_pct(text: str) -> str | None:
    """The path form (:func:`format_pct`) of the number ``text`` spells (``50.0``, ``050`` -> ``50``), or None when
    it spells no number that paths can write."""
    try:
        pct = format_pct(float(text))
    except (TypeError, ValueError):
        return None
    return pct if is_pct(pct) else None


def with_pct(target: str, pct: str) -> str:
    """``target`` (a path under ``results/{model}/`` with a ``<method>_<pct>`` stage, :func:`parse`) with its pct
    written ``pct``."""
    found = parse(target)
    if found is None or found.method is None:
        raise ValueError(f"{target!r} has no <method>_<pct> stage")
    parts = list(PurePosixPath(target).parts)
    i = 3 if found.folder == "select" else 2
    parts[i] = parts[i].replace(found.stage, f"{found.method}_{pct}", 1)
    return str(PurePosixPath(*parts))


# ---- method tokens ----------------------------------------------------------------------------------------------
VARIANTS = ("kq", "k", "q")
DEFAULT_VARIANT = "kq"
#: What a method cuts: key channels (the default: no suffix), value channels (``-v``) or both (``-kv``).
CUTS = ("keys", "values", "joint")
DEFAULT_CUT = "keys"
CUT_SUFFIXES = {"values": "v", "joint": "kv"}
DEFAULT_CALIB = "default"
CALIB_PATTERN = r"[a-z0-9]+"
BUDGET_PATTERN = r"[a-z0-9]+"
FIT_PATTERN = r"[a-z0-9]+"
NAME_PATTERN = r"[a-z][a-z0-9]*(?:-[a-z0-9]+)*"
"""Selector names: lowercase words joined by dashes; none may end in ``-k`` or ``-q`` (the variant suffixes)."""

Vocabulary = Mapping[str, tuple[str, ...]]
"""Selector name -> the variants it scores (``kq`` always among them) and the suffixes of the cuts it makes besides
keys (``v``, ``kv``: a selector with a value side)."""


@dataclass(frozen=True)
class MethodSpec:
    """A parsed method token: selector name, scoring variant ("kq", "k", "q"), calibration id, per-layer key
    budget (None: every layer keeps the same d_k'), cut ("keys", "values", "joint") and compensation (``fit``: a name
    under ``fits:``; None: the kept weights stay as they were)."""

    selector: str
    variant: str = DEFAULT_VARIANT
    calib: str = DEFAULT_CALIB
    budget: str | None = None
    cut: str = DEFAULT_CUT
    fit: str | None = None

    @property
    def selection(self) -> MethodSpec:
        """The same cut without compensation: the token whose selection file (and budget artifacts) a ``+<fit>``
        method reads."""
        return MethodSpec(self.selector, self.variant, self.calib, self.budget, self.cut)

    @property
    def uniform(self) -> MethodSpec:
        """The same selection without a per-layer budget (the uniform cut it is compared with)."""
        return MethodSpec(self.selector, self.variant, self.calib, cut=self.cut)

    @property
    def keys(self) -> MethodSpec:
        """The key cut of the same selector and calibration (the key side of a joint cut, without the joint cut's
        split budget)."""
        return MethodSpec(self.selector, self.variant, self.calib, self.budget if self.cut == DEFAULT_CUT else None)


def unknown_selector(name: str, vocabulary: Vocabulary, context: str = "") -> ValueError:
    """The one-line error for a selector name outside ``vocabulary`` (with close matches)."""
    close = difflib.get_close_matches(name, sorted(vocabulary), n=3)
    hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
    return ValueError(f"unknown selector {name!r}{context}{hint}; valid: {', '.join(sorted(vocabulary))}")


def _token_help(vocabulary: Vocabulary | None) -> str:
    if vocabulary is None:
        return (f"expected <selector>[-k|-q|-v|-kv][.<calib>][@<budget>][+<fit>] with selector matching "
                f"{NAME_PATTERN}, calib matching {CALIB_PATTERN} (omit it for the default calibration), budget matching "
                f"{BUDGET_PATTERN} (omit it for the uniform cut), fit matching {FIT_PATTERN} (omit it for none)")
    with_kq = [n for n, v in sorted(vocabulary.items()) if set(v) & {"k", "q"}]
    with_v = [n for n, v in sorted(vocabulary.items()) if set(v) & set(CUT_SUFFIXES.values())]
    return (
        f"expected <selector>[-k|-q|-v|-kv][.<calib>][@<budget>][+<fit>] with selector in "
        f"{{{', '.join(sorted(vocabulary))}}}, -k/-q only for {{{', '.join(with_kq)}}}, -v/-kv only for "
        f"{{{', '.join(with_v)}}} (-v without @<budget>), calib matching {CALIB_PATTERN} (omit it for the default "
        f"calibration), budget matching {BUDGET_PATTERN} (omit it for the uniform cut), fit matching {FIT_PATTERN} "
        "(omit it for none)"
    )


def parse_token(token: str, vocabulary: Vocabulary | None = None) -> MethodSpec:
    """Parse a method token ``<selector>[-k|-q|-v|-kv][.<calib>][@<budget>][+<fit>]`` (module docstring) into a
    :class:`MethodSpec`; with ``vocabulary`` the selector must be in it and have the variant.

    Raises:
        ValueError: one line naming the bad part and the grammar.
    """
    if not isinstance(token, str) or not token:
        raise ValueError(f"bad method token {token!r}; {_token_help(vocabulary)}")
    token_cut, plus, fit = token.partition("+")
    if plus and not re.fullmatch(FIT_PATTERN, fit):
        raise ValueError(f"bad fit id {fit!r} in method token {token!r}; {_token_help(vocabulary)}")
    spec = _parse_cut(token_cut, token, vocabulary)
    return replace(spec, fit=fit) if plus else spec


def selection_token(token: str) -> str:
    """``token`` without its ``+<fit>``, as written: the method whose selection (and budget artifacts) a fitted method
    reads (:attr:`MethodSpec.selection`, without parsing)."""
    return token.partition("+")[0]


def _parse_cut(token_cut: str, token: str, vocabulary: Vocabulary | None) -> MethodSpec:
    """:func:`parse_token` of the token without its ``+<fit>``."""
    rest, at, budget = token_cut.partition("@")
    if at and not re.fullmatch(BUDGET_PATTERN, budget):
        raise ValueError(f"bad budget id {budget!r} in method token {token!r}; {_token_help(vocabulary)}")
    head, dot, calib = rest.partition(".")
    if dot:
        if not re.fullmatch(CALIB_PATTERN, calib):
            raise ValueError(f"bad calibration id {calib!r} in method token {token!r}; {_token_help(vocabulary)}")
        if calib == DEFAULT_CALIB:
            raise ValueError(f"method token {token!r}: write {head!r} for the default calibration; "
                             f"{_token_help(vocabulary)}")
    else:
        calib = DEFAULT_CALIB
    name, dash, variant = head.rpartition("-")
    suffixes = ("k", "q", *CUT_SUFFIXES.values())
    if vocabulary is None:  # the grammar alone: a trailing suffix is one (no selector name ends in one)
        if re.fullmatch(NAME_PATTERN, head) and not re.search(r"-(?:k|q|v|kv)$", head):
            name, variant = head, DEFAULT_VARIANT
        elif not (dash and variant in suffixes and re.fullmatch(NAME_PATTERN, name)):
            raise ValueError(f"bad selector {head!r} in method token {token!r}; {_token_help(vocabulary)}")
    elif head in vocabulary:  # a selector name (dashes included), no variant suffix
        name, variant = head, DEFAULT_VARIANT
    elif not dash or name not in vocabulary:
        raise unknown_selector(name if dash and variant in (*VARIANTS, *suffixes) else head, vocabulary,
                               f" in method token {token!r}")
    elif variant not in suffixes:
        raise ValueError(f"bad variant suffix {'-' + variant!r} in method token {token!r}; {_token_help(vocabulary)}")
    elif variant not in vocabulary[name]:
        what = "variant" if variant in VARIANTS else "value side for the cut"
        raise ValueError(f"selector {name!r} in method token {token!r} has no {what} {variant!r}; "
                         f"{_token_help(vocabulary)}")
    cut = next((c for c, suffix in CUT_SUFFIXES.items() if suffix == variant), DEFAULT_CUT)
    if cut != DEFAULT_CUT:
        variant = DEFAULT_VARIANT
        if at and cut == "values":
            raise ValueError(f"method token {token!r}: a value cut takes no budget (@{budget}: per-layer key widths, or "
                             f"on a joint cut -kv the split between keys and values); drop @{budget}")
    return MethodSpec(selector=name, variant=variant, calib=calib, budget=budget if at else None, cut=cut)


def format_method(spec: MethodSpec, vocabulary: Vocabulary | None = None) -> str:
    """The canonical method token of a :class:`MethodSpec` (inverse of :func:`parse_token`)."""
    suffix = "" if spec.variant == DEFAULT_VARIANT else f"-{spec.variant}"
    if spec.cut != DEFAULT_CUT:
        suffix = f"-{CUT_SUFFIXES.get(spec.cut, spec.cut)}" + ("" if spec.variant == DEFAULT_VARIANT else "?")
    calib = "" if spec.calib == DEFAULT_CALIB else f".{spec.calib}"
    budget = "" if spec.budget is None else f"@{spec.budget}"
    fit = "" if spec.fit is None else f"+{spec.fit}"
    token = f"{spec.selector}{suffix}{calib}{budget}{fit}"
    if parse_token(token, vocabulary) != spec:  # validates selector, variant and calib
        raise ValueError(f"MethodSpec {spec!r} has no canonical token; {_token_help(vocabulary)}")
    return token


def method_regex(vocabulary: Vocabulary, fit: bool | None = None) -> str:
    """Regex (unanchored, for Snakemake ``wildcard_constraints``) matching exactly the valid method tokens of
    ``vocabulary``: with or without ``+<fit>`` (``fit`` None), only with it (True) or only without it (False)."""
    alts = []
    for name in sorted(vocabulary, key=lambda s: (-len(s), s)):
        extra = [v for v in vocabulary[name] if v != DEFAULT_VARIANT]
        alts.append(re.escape(name) + (f"(?:-(?:{'|'.join(extra)}))?" if extra else ""))
    calib = rf"(?:\.(?!{DEFAULT_CALIB}(?![a-z0-9])){CALIB_PATTERN})?"
    plus = {None: f"(?:\\+{FIT_PATTERN})?", True: f"\\+{FIT_PATTERN}", False: ""}[fit]
    return f"(?:{'|'.join(alts)}){calib}(?:@{BUDGET_PATTERN})?{plus}"
