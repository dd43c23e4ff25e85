"""Typed settings: each configuration block a stage reads, as a frozen dataclass holding its defaults.

In the style of transformers' ``TrainingArguments`` and peft's ``LoraConfig``: :mod:`statereduce.config` builds these
objects from the validated ``config.yaml`` (a model's ``calibration``, ``eval``, ``rank``, ``rft``, ``speed`` and
``pretrain`` blocks), and the stages take them (``cfg.lr``, not ``cfg["lr"]``). Every default lives here, in a field;
the schema's ``default:`` entries repeat them for the reader and ``tests/test_settings.py`` checks that they agree.

Every class has:

* ``from_dict(d)``: the defaults updated by ``d`` (a nested block merged key by key); an unknown key is a one-line
  ``ValueError`` naming it and the valid keys;
* ``__post_init__``: the checks of its values (one-line ``ValueError`` naming the bad value and what is valid); a
  field made by :func:`choice` holds its valid values, checked here for every class, and ``valid(name)`` returns
  them (the schema's ``enum`` entries repeat them and ``tests/test_settings.py`` checks that they agree);
* ``to_dict()``: the plain dict (fields in order, nested settings as dicts, an optional field left out while unset).
  Snakemake tracks a rule's params by their ``repr`` and ignores objects it cannot represent, so the workflow hands
  jobs ``to_dict()`` and each workflow script builds the object again with ``from_dict``; records and resume
  fingerprints store ``to_dict()`` too;
* ``overrides()``: the block as configured (the mapping ``from_dict`` was given). A job's plan (:class:`RftPlan`,
  :class:`SpeedPlan`) gives the rule's params its nested settings in this form, so that a default changed here
  reruns no job that did not set it;
* ``replace(**changes)``: a copy with some fields changed, checked again.

This module imports no torch and nothing else from the package: config validation (every dry run) builds these.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, TypeVar

S = TypeVar("S", bound="Settings")

OPTIONAL = {"optional": True}
"""Field metadata: ``to_dict`` leaves the field out while it is None."""

RECALL_MAX_PAIRS = 90
"""Most key-value lines of a recall document: the two-digit values 10..99 (:mod:`statereduce.eval.recall`)."""


def choice(default: Any, valid: tuple, *, label: str | None = None, describe: str | None = None) -> Any:
    """A field whose value must be one of ``valid`` (checked by :meth:`Settings.__post_init__`).

    Args:
        default: the field's default (one of ``valid``).
        valid: the valid values, in the order the error lists them.
        label: the error's name of the field (default: ``"<section> <field>"``).
        describe: the error's text after ``valid:`` (default: ``valid`` joined by commas).
    """
    assert default in valid, (default, valid)
    return field(default=default, metadata={"valid": tuple(valid), "label": label, "describe": describe})


def _plain(value: Any) -> Any:
    """``value`` with settings turned into dicts and containers copied (what ``to_dict`` hands out)."""
    if isinstance(value, Settings):
        return value.to_dict()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return value


def _calibration_subset(kind: str, n_samples: int | None, batch_size: int | None) -> None:
    """Check a block's ``n_samples`` and ``batch_size`` over its calibration's sequences (positive, or unset)."""
    for name, value in (("n_samples", n_samples), ("batch_size", batch_size)):
        if value is not None and (not _is_int(value) or value < 1):
            raise ValueError(f"{kind} {name}={value!r} must be a positive integer (or unset)")


def _subset_sizes(n_samples: int | None, batch_size: int | None, calibration) -> tuple[int, int]:
    """``(n_samples, batch_size)`` over ``calibration``'s sequences: the first ``n_samples`` of them (all when unset),
    ``batch_size`` per forward (the calibration's when unset)."""
    n = calibration.n_samples if n_samples is None else min(n_samples, calibration.n_samples)
    return n, calibration.batch_size if batch_size is None else batch_size


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Settings:
    """What every settings dataclass shares: ``from_dict``, ``coerce``, ``to_dict``, ``overrides``, ``replace``,
    ``valid`` and the check of its :func:`choice` fields.

    Class attributes of a subclass: ``section`` (the block's name in messages), ``unknown_message`` (the unknown-key
    error, formatted with ``section``, ``key`` (the first unknown key), ``bad`` (the unknown keys, sorted) and
    ``valid``), ``sort_valid`` (list the valid keys sorted, else in field order) and ``nested`` (field -> the
    settings class its mapping is merged into).
    """

    section: ClassVar[str] = ""
    unknown_message: ClassVar[str] = "unknown {section} key(s) {bad}; valid: {valid}"
    sort_valid: ClassVar[bool] = True
    nested: ClassVar[Mapping[str, type[Settings]]] = {}

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The block's keys: the public fields, in order."""
        return tuple(f.name for f in fields(cls) if not f.name.startswith("_"))

    @classmethod
    def from_dict(cls: type[S], d: Mapping[str, Any] | None = None) -> S:
        """The defaults updated by ``d`` (nested blocks merged key by key), checked.

        Raises:
            ValueError: one line naming an unknown key and the valid ones, or a bad value.
        """
        d = dict(d or {})
        keys = cls.field_names()
        unknown = [k for k in d if k not in keys]
        if unknown:
            valid = ", ".join(sorted(keys) if cls.sort_valid else keys)
            raise ValueError(cls.unknown_message.format(section=cls.section, key=unknown[0], bad=sorted(unknown),
                                                        valid=valid))
        given = _plain(d)
        for key, sub in cls.nested.items():
            if d.get(key) is not None:
                d[key] = sub.coerce(d[key])
        out = cls(**d)
        object.__setattr__(out, "_given", given)
        return out

    @classmethod
    def coerce(cls: type[S], obj: S | Mapping[str, Any] | None) -> S:
        """``obj`` itself when it is already a ``cls``, else ``cls.from_dict(obj)``."""
        return obj if isinstance(obj, cls) else cls.from_dict(obj)

    def overrides(self) -> dict[str, Any]:
        """The block as configured: the mapping :meth:`from_dict` was given (a rule's params carry it, so that a
        default changed in this module reruns nothing that did not set it); for an object made otherwise, the
        fields that differ from the defaults."""
        given = getattr(self, "_given", None)
        if given is not None:
            return _plain(given)
        default = type(self)()
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if not f.name.startswith("_") and value != getattr(default, f.name):
                out[f.name] = value.overrides() if isinstance(value, Settings) else _plain(value)
        return out

    def to_dict(self) -> dict[str, Any]:
        """The block as a plain dict: fields in order, nested settings as dicts, unset optional fields left out."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.startswith("_") or (value is None and f.metadata.get("optional")):
                continue
            out[f.name] = _plain(value)
        return out

    def replace(self: S, **changes: Any) -> S:
        """A copy with ``changes`` (checked again); its :meth:`overrides` are this one's updated by ``changes``."""
        out = dataclasses.replace(self, **changes)
        given = getattr(self, "_given", None)
        if given is not None:
            public = {k: v for k, v in changes.items() if not k.startswith("_")}
            object.__setattr__(out, "_given", {**given, **_plain(public)})
        return out

    @classmethod
    def valid(cls, name: str) -> tuple:
        """The valid values of the :func:`choice` field ``name``."""
        return next(f.metadata["valid"] for f in fields(cls) if f.name == name)

    def __post_init__(self):
        """Every :func:`choice` field holds one of its valid values (one-line ``ValueError`` otherwise)."""
        for f in fields(self):
            valid = f.metadata.get("valid")
            value = getattr(self, f.name)
            if valid is not None and value not in valid:
                label = f.metadata["label"] or f"{self.section} {f.name}"
                describe = f.metadata["describe"] or ", ".join(map(str, valid))
                raise ValueError(f"unknown {label} {value!r}; valid: {describe}")

    def _set(self, name: str, value: Any) -> None:
        """Normalise a field in ``__post_init__`` (the dataclasses are frozen)."""
        object.__setattr__(self, name, value)


# ---- a model's jobs -----------------------------------------------------------------------------------------------
DEFAULT_THREADS = {"cpu": 1, "cuda": 4}
"""CPU threads of a model's jobs by its ``device``: one for the CPU models, whose numbers depend on torch's thread
count; four for a GPU job's host-side work. Under SLURM they are each job's CPUs."""


@dataclass(frozen=True)
class DeviceSettings(Settings):
    """Where a model's jobs run (``models.<name>``'s ``dtype``, ``device``, ``threads``).

    Args:
        dtype: the dtype the model is loaded and saved in.
        device: ``cpu`` or ``cuda``.
        threads: CPU threads of each of its jobs; None: :data:`DEFAULT_THREADS` of the device.
    """

    section: ClassVar[str] = "model"

    dtype: str = choice("float32", ("float32", "bfloat16", "float16"), label="model dtype")
    device: str = choice("cpu", tuple(DEFAULT_THREADS), label="device")
    threads: int | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.threads is None:
            self._set("threads", DEFAULT_THREADS[self.device])


@dataclass(frozen=True)
class HubSettings(Settings):
    """``models.<name>.hub``: a checkpoint on the Hugging Face hub."""

    section: ClassVar[str] = "hub"

    id: str = ""
    revision: str = "main"


@dataclass(frozen=True)
class InitSettings(Settings):
    """``models.<name>.init``: random weights of the shape ``arch`` (rule ``init_random``), drawn after seeding
    with ``seed``."""

    section: ClassVar[str] = "init"

    arch: dict = field(default_factory=dict)
    seed: int = 0


# ---- calibration and selection ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CalibrationSettings(Settings):
    """A model's ``calibration`` block, or a variant under ``calibrations`` (paper Sec. 3, App. B).

    Args:
        split: the corpus split the sequences come from.
        n_samples: calibration sequences (paper: 128).
        seq_len: tokens per sequence (paper: 2048).
        seed: draws the sequences and the kept rows.
        rows_per_head: K rows and Q rows kept per head (paper: 2,500 + 2,500).
        batch_size: sequences per forward pass.
        corpus: a key of ``corpora`` (every model needs one: also the default text of its evaluation and RFT).
    """

    section: ClassVar[str] = "calibration"

    split: str = choice("calib", ("train", "calib", "heldout"))
    n_samples: int = 32
    seq_len: int = 256
    seed: int = 0
    rows_per_head: int = 2500
    batch_size: int = 4
    corpus: str | None = field(default=None, metadata=OPTIONAL)


@dataclass(frozen=True)
class GradSettings(Settings):
    """``selectors.grad``: the gradient pass of rule ``grad_scores``; None takes the calibration's value."""

    section: ClassVar[str] = "selectors.grad"

    n_samples: int | None = field(default=None, metadata=OPTIONAL)
    batch_size: int | None = field(default=None, metadata=OPTIONAL)

    def sizes(self, calibration: CalibrationSettings) -> tuple[int, int]:
        """``(n_samples, batch_size)`` of the gradient pass over ``calibration``'s sequences."""
        return (calibration.n_samples if self.n_samples is None else self.n_samples,
                calibration.batch_size if self.batch_size is None else self.batch_size)


# ---- evaluation ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RecallProbeSettings(Settings):
    """``eval.recall_probe``: the offline MQAR probe (:mod:`statereduce.eval.recall`): one task per level (an int,
    the context's key-value lines, or a mapping of ``RecallLevel`` fields), ``n_docs`` documents each, seeded."""

    section: ClassVar[str] = "recall_probe"
    unknown_message: ClassVar[str] = "unknown recall_probe keys {bad}; valid: {valid}"
    sort_valid: ClassVar[bool] = False

    levels: list = field(default_factory=lambda: [4, 16, 64])
    n_docs: int = 100
    seed: int = 0


@dataclass(frozen=True)
class EvalSettings(Settings):
    """A model's ``eval`` block (:func:`statereduce.config.model_eval`), with its ``suites`` expanded there
    (:func:`statereduce.eval.suites.expand_eval`: their lm-eval tasks added to ``tasks``, ``metadata``,
    ``task_max_length``, the ``recall_probe`` block filled).

    Args:
        tasks: lm-eval task names; ``heldout`` is the local bits-per-byte task on the corpus's held-out split.
        max_docs: held-out documents.
        max_doc_bytes: each held-out document cut to this many UTF-8 bytes.
        batch_size: lm-eval's batch size.
        max_length: tokens per window.
        limit: lm-eval's per-task document limit (None: all).
        corpus: the corpus of the ``heldout`` task, where configured (else the model's, ``model_eval_corpus``).
        recall_probe: the ``recall_probe`` block as configured, all keys filled once its suite is selected
            (typed: :attr:`probe`).
        suites: named task sets (:mod:`statereduce.eval.suites`).
        metadata: lm-eval task metadata the suites need.
        task_max_length: task -> the smallest window it needs.
        corpus_spec: the ``heldout`` task's corpus spec, resolved by the workflow for the job.
    """

    section: ClassVar[str] = "eval"

    tasks: list = field(default_factory=lambda: ["heldout"])
    max_docs: int = 64
    max_doc_bytes: int = 2048
    batch_size: int = 1
    max_length: int = 2048
    limit: int | None = None
    corpus: str | None = field(default=None, metadata=OPTIONAL)
    recall_probe: dict | None = field(default=None, metadata=OPTIONAL)
    suites: list | None = field(default=None, metadata=OPTIONAL)
    metadata: dict | None = field(default=None, metadata=OPTIONAL)
    task_max_length: dict | None = field(default=None, metadata=OPTIONAL)
    corpus_spec: dict | None = field(default=None, metadata=OPTIONAL)

    @property
    def probe(self) -> RecallProbeSettings:
        """The ``recall_probe`` block, typed, defaults filled."""
        return RecallProbeSettings.coerce(self.recall_probe)


# ---- pruning ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PruneSettings(Settings):
    """Pruning (:func:`statereduce.stages.prune.prune_model`): the top-level ``prune`` block updated by the model's.

    Args:
        norm_eps: ``exact`` (the workflow's default) stores a stock checkpoint equal to zero-masking to float
            precision (:func:`statereduce.stages.prune.exact_norm_eps`; refused for tied embeddings); ``stock`` keeps
            the config's norm eps (the pruned model equals zero-masking up to the mixers' output-norm eps, as the
            paper's checkpoints). docs/experiments/norm_eps measures both.
    """

    section: ClassVar[str] = "prune"

    norm_eps: str = choice("exact", ("stock", "exact"))


# ---- per-layer key budgets ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BudgetSettings(Settings):
    """``budgets.<name>``: a per-layer key budget (:mod:`statereduce.core.budgets`, :mod:`statereduce.stages.allocate`),
    used by method tokens ending in ``@<name>``. Every layer keeps its own d_k' (the same for its heads) so that the
    total of kept key channels equals the uniform cut's at the same pct. A budget of policy ``split`` or ``joint``
    serves joint cuts (``<selector>-kv@<name>``) instead: it chooses d_k' x d_v'
    (:func:`statereduce.stages.select.choose_state_split`).

    Args:
        policy: ``uniform`` (every layer the uniform cut's d_k': the plain method's checkpoint), ``spectrum`` (each
            layer's calibration [K; Q] second-moment spectrum, see ``statistic``), ``greedy`` (the share of the
            selector's own objective its selection of each width captures: DRRQR's captured energy, Grad's and the
            other scoring selectors' score mass) or ``sensitivity`` (the calibration loss when that layer alone is cut
            to each width by the selector, the others kept whole); for joint cuts only, ``split`` (the calibration loss of
            the whole model cut to each key/value split of the pct's state, from the key-only to the value-only cut,
            the lowest kept) and ``joint`` (each layer's share of the state and its split together: the calibration
            loss of each layer alone cut to each d_k' x d_v', then the pairs of least summed loss increase within 1% of
            the pct's total state, kept where they beat the best uniform split;
            :func:`statereduce.stages.select.state_split_joint`).
        statistic: for ``spectrum``: ``energy`` (share of the second moment's trace in the top-w eigenvalues) or
            ``effective_rank`` (channels up to each layer's effective rank are worth the same everywhere).
        floor: the fewest channels a layer may keep (``split``: the fewest key channels of a candidate split;
            ``joint``: of either side).
        multiple: kept widths are multiples of this (or the full d_k); 8 or 16 suit the GPU kernels (``split``: the
            candidates' key widths, each with the value width nearest the pct's state; ``joint``: the key and the
            value widths a layer may take, the full d_k and d_v among them).
        powers_of_two: keep only widths that are powers of two (or the full d_k): the GPU kernels hold a head's key
            channels in a tile of the next power of two, so a width just above one (80, 144) costs decode time
            beyond its bytes (docs/speed.md, "Per-layer key widths").
        normalize: for ``greedy``: compare layers by the share of their own objective (true) or by its raw value
            (false: Grad's saliency is a first-order loss estimate on one scale across layers).
        n_samples: for ``sensitivity``, ``split`` and ``joint``: calibration sequences of the loss (the model's
            calibration sequences, the first ``n_samples``); None: all of them.
        batch_size: for ``sensitivity``, ``split`` and ``joint``: sequences per forward; None: the calibration's.
        per_layer: for ``split``: each layer may take its own candidate split (each layer's candidate of lowest
            calibration loss with the other layers whole, kept where the combination beats the best uniform split;
            :func:`statereduce.stages.select.state_split_per_layer`); unset or false: one split for every layer.
        engine: for ``split`` (one split for every layer): only candidates the serving engine takes, ``vllm-cpu``
            (vLLM's CPU build, as measured) or ``vllm`` (its CUDA build, from its source)
            (:func:`statereduce.core.engines.pair_check`; docs/serving.md); unset: every candidate.
    """

    section: ClassVar[str] = "budgets"

    policy: str = choice("spectrum", ("uniform", "spectrum", "greedy", "sensitivity", "split", "joint"),
                         label="budget policy")
    statistic: str = choice("energy", ("energy", "effective_rank"), label="budget statistic")
    floor: int = 8
    multiple: int = 8
    powers_of_two: bool = False
    normalize: bool = True
    n_samples: int | None = field(default=None, metadata=OPTIONAL)
    batch_size: int | None = field(default=None, metadata=OPTIONAL)
    per_layer: bool | None = field(default=None, metadata=OPTIONAL)  # unset: false (left out of the job's params)
    engine: str | None = field(default=None, metadata=OPTIONAL)

    def __post_init__(self):
        super().__post_init__()
        for name in ("floor", "multiple"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(f"budget {name}={getattr(self, name)!r} must be a positive integer")
        for name in ("normalize", "powers_of_two", "per_layer"):
            if not isinstance(getattr(self, name), bool) and not (name == "per_layer" and self.per_layer is None):
                raise ValueError(f"budget {name}={getattr(self, name)!r} must be true or false")
        if self.per_layer and self.policy != "split":
            raise ValueError(f"budget per_layer=true chooses a joint cut's split per layer; it takes policy 'split', "
                             f"not {self.policy!r}")
        if self.engine is not None:
            if self.engine not in SERVING_ENGINES:
                raise ValueError(f"budget engine={self.engine!r} is unknown; valid: {', '.join(SERVING_ENGINES)}")
            if self.policy != "split" or self.per_layer:
                raise ValueError(f"budget engine={self.engine!r} keeps a joint cut to splits the engine serves, which "
                                 "hold one width in every layer: it takes policy 'split' without per_layer, not "
                                 f"policy {self.policy!r}" + (" with per_layer" if self.per_layer else ""))
        _calibration_subset("budget", self.n_samples, self.batch_size)

    def sizes(self, calibration: CalibrationSettings) -> tuple[int, int]:
        """``(n_samples, batch_size)`` of the sensitivity or split loss over ``calibration``'s sequences."""
        return _subset_sizes(self.n_samples, self.batch_size, calibration)


SERVING_ENGINES = ("vllm-cpu", "vllm")
"""A split budget's ``engine`` values (:data:`statereduce.core.engines.ENGINES`, which has the facts)."""


@dataclass(frozen=True)
class BudgetPlan(Settings):
    """What rules ``budget_values`` and ``allocate`` need of a method token's budget
    (:func:`statereduce.config.model_budget_plan`; the rules' params carry ``to_dict()``).

    Args:
        name: the budget's id (``budgets.<name>``, the token's ``@<name>``).
        settings: its :class:`BudgetSettings`.
        head_v_dim: the model's d_v, to leave out widths the family's config cannot express (None: not checked).
        calibration: for ``sensitivity`` and ``split``: the calibration whose sequences give the loss (the token's
            ``.<calib>``).
        corpus: for ``sensitivity`` and ``split``: that calibration corpus's spec, resolved by the workflow for the job.
    """

    section: ClassVar[str] = "budget plan"
    nested: ClassVar[Mapping[str, type[Settings]]] = {"settings": BudgetSettings, "calibration": CalibrationSettings}

    name: str = ""
    settings: BudgetSettings = field(default_factory=BudgetSettings)
    head_v_dim: int | None = None
    calibration: CalibrationSettings | None = field(default=None, metadata=OPTIONAL)
    corpus: dict | None = field(default=None, metadata=OPTIONAL)


# ---- compensation after the cut ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FitSettings(Settings):
    """``fits.<name>``: a compensation after the cut (:mod:`statereduce.core.fit`), used by method tokens ending in
    ``+<name>``: each cut mixer's output projection re-fitted by damped least squares on calibration tokens.

    Args:
        scope: ``layer`` (one solve over all of a layer's projection columns: the heads' outputs may mix) or ``head``
            (one solve per value head, its own columns).
        target: ``stream`` (match the unpruned model's residual stream after the mixer: the fit also takes up the
            error that reached the layer; with ``scope: layer`` only) or ``mixer`` (match the unpruned mixer's output).
        damping: the ridge toward the plain cut's weights, as a share of the mean input energy (> 0).
        n_samples: calibration sequences the fit reads (the first ``n_samples`` of the token's calibration); None:
            all of them.
        batch_size: sequences per forward; None: the calibration's.
    """

    section: ClassVar[str] = "fits"

    scope: str = choice("layer", ("layer", "head"), label="fit scope")
    target: str = choice("stream", ("stream", "mixer"), label="fit target")
    damping: float = 0.1
    n_samples: int | None = field(default=None, metadata=OPTIONAL)
    batch_size: int | None = field(default=None, metadata=OPTIONAL)

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.damping, bool) or not isinstance(self.damping, (int, float)) or not self.damping > 0:
            raise ValueError(f"fit damping={self.damping!r} must be a number > 0 (0.1: a tenth of the mean input "
                             "energy)")
        if self.target == "stream" and self.scope != "layer":
            raise ValueError("fit target 'stream' matches the whole residual stream, which one head cannot; use scope "
                             "'layer' with it, or target 'mixer' with scope 'head'")
        _calibration_subset("fit", self.n_samples, self.batch_size)

    def sizes(self, calibration: CalibrationSettings) -> tuple[int, int]:
        """``(n_samples, batch_size)`` of the fit over ``calibration``'s sequences."""
        return _subset_sizes(self.n_samples, self.batch_size, calibration)


@dataclass(frozen=True)
class FitPlan(Settings):
    """What rule ``fit`` needs of a method token's ``+<fit>`` (:func:`statereduce.config.model_fit_plan`; the rule's
    params carry ``to_dict()``).

    Args:
        name: the fit's id (``fits.<name>``).
        settings: its :class:`FitSettings`.
        calibration: the calibration whose sequences it reads (the token's ``.<calib>``).
        corpus: that calibration corpus's spec, resolved by the workflow for the job.
    """

    section: ClassVar[str] = "fit plan"
    nested: ClassVar[Mapping[str, type[Settings]]] = {"settings": FitSettings, "calibration": CalibrationSettings}

    name: str = ""
    settings: FitSettings = field(default_factory=FitSettings)
    calibration: CalibrationSettings | None = field(default=None, metadata=OPTIONAL)
    corpus: dict | None = field(default=None, metadata=OPTIONAL)


# ---- rank analysis ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankSettings(Settings):
    """Rank analysis (paper Sec. 2.2, App. C.1, C.5): the top-level ``rank`` block updated by the model's.

    Args:
        corpus: the corpus whose ``heldout`` split is analysed (default: the evaluation's).
        n_samples: held-out sequences.
        seed: draws the sequences.
        seq_len: tokens per sequence.
        skip: positions left out at the start (paper: 128).
        spectrum_head: ``[layer, head]`` whose spectrum is kept (Figs. 2, 5).
        stride: one state sample every ``stride`` tokens.
        corpus_spec: that corpus's spec, resolved by the workflow for the job.
    """

    section: ClassVar[str] = "rank"

    corpus: str | None = field(default=None, metadata=OPTIONAL)
    n_samples: int = 4
    seed: int = 0
    seq_len: int = 512
    skip: int = 128
    spectrum_head: list | None = field(default_factory=lambda: [0, 0])
    stride: int = 64
    corpus_spec: dict | None = field(default=None, metadata=OPTIONAL)


# ---- pretraining --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrainSettings(Settings):
    """``pretrain.train``: training an embedded tiny model (:func:`statereduce.stages.pretrain.pretrain`).

    The defaults suit the embedded tiny models (hidden 128, 4 layers, 2 heads, d_k = d_v = 64, ~1.1M parameters)
    on the embedded corpus: 700 steps x 4 x 128 = 358k tokens take ~150 s (DeltaNet) / ~165 s (Gated DeltaNet) on
    one CPU thread and reach held-out losses of ~1.95 / ~1.64 nats per byte (uniform: ln 257 = 5.55). Measured
    against batch 8 / 16 with fewer steps, seq_len 256, and lr 2e-3 / 6e-3 at the same token budget: more, smaller
    steps won; lr 6e-3 hurt DeltaNet.

    Args:
        steps, batch_size, seq_len: optimizer steps, windows per step, tokens per window.
        lr, min_lr: peak learning rate; the cosine's floor (None: lr / 10).
        weight_decay, betas: AdamW's (decay on matrices only).
        warmup: linear warm-up steps, in [0, steps).
        grad_clip: gradient-norm clipping.
        seed: the model's initialisation and the batch order.
        threads: ``torch.set_num_threads`` (the job's CPUs).
        log_every: steps per log line.
        eval_blocks: calib and heldout blocks of the final losses.
    """

    section: ClassVar[str] = "train"

    steps: int = 700
    batch_size: int = 4
    seq_len: int = 128
    lr: float = 3e-3
    min_lr: float | None = None
    weight_decay: float = 0.1
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    warmup: int = 50
    grad_clip: float = 1.0
    seed: int = 0
    threads: int = 1
    log_every: int = 10
    eval_blocks: int = 16

    def __post_init__(self):
        for key in ("steps", "batch_size", "seq_len", "threads", "log_every"):
            if int(getattr(self, key)) < 1:
                raise ValueError(f"train {key} must be >= 1, got {getattr(self, key)}")
        if not 0 <= int(self.warmup) < int(self.steps):
            raise ValueError(f"train warmup must be in [0, steps={self.steps}), got {self.warmup}")
        self._set("betas", [float(b) for b in self.betas])


@dataclass(frozen=True)
class RecallMixSettings(Settings):
    """``pretrain.recall_mix``: synthetic recall documents mixed into the training text
    (docs/experiments/recall_mix/README.md).

    Args:
        fraction: share of the mixed training stream's bytes that are recall documents, in (0, 1).
        n_pairs: context sizes; each document draws one uniformly (each 1..90).
        seed: draws the documents.
        pure_steps: steps of a first, recall-only training phase (>= 0); with ``until``, its most steps.
        pure_lr: that phase's peak learning rate (> 0).
        answer_loss: that phase's loss covers only the answers of its documents' query lines (the two value bytes
            after ``key=``), not the random keys and values of the context, which no model can predict.
        until: end that phase once the recall probe's accuracy on 64 documents of 4 pairs, drawn apart from the
            probe's and the training documents, reaches this (in (0, 1]); checked every ``check_every`` steps.
            Its lr then stays at ``pure_lr`` after the warmup (no cosine to an unknown end). None: all
            ``pure_steps``, cosine to a tenth.
        check_every: steps between two such checks.
    """

    section: ClassVar[str] = "recall_mix"
    unknown_message: ClassVar[str] = "unknown recall_mix keys {bad}; valid: {valid}"
    sort_valid: ClassVar[bool] = False

    fraction: float = 0.2
    n_pairs: list = field(default_factory=lambda: [1, 2])
    seed: int = 0
    pure_steps: int = 0
    pure_lr: float = 1e-3
    answer_loss: bool = False
    until: float | None = field(default=None, metadata=OPTIONAL)
    check_every: int = 50

    def __post_init__(self):
        fraction, n_pairs = self.fraction, self.n_pairs
        if not _is_number(fraction) or not 0.0 < fraction < 1.0:
            raise ValueError(f"recall_mix fraction must be a number in (0, 1), got {fraction!r}")
        if (
            not isinstance(n_pairs, (list, tuple))
            or not n_pairs
            or not all(_is_int(n) and 1 <= n <= RECALL_MAX_PAIRS for n in n_pairs)
        ):
            raise ValueError(
                f"recall_mix n_pairs must be a non-empty list of ints in 1..{RECALL_MAX_PAIRS}, got {n_pairs!r}"
            )
        if not _is_int(self.seed):
            raise TypeError(f"recall_mix seed must be an int, got {self.seed!r}")
        if not _is_int(self.pure_steps) or self.pure_steps < 0:
            raise ValueError(f"recall_mix pure_steps must be an int >= 0, got {self.pure_steps!r}")
        if not _is_number(self.pure_lr) or not self.pure_lr > 0:
            raise ValueError(f"recall_mix pure_lr must be a number > 0, got {self.pure_lr!r}")
        self._set("pure_lr", float(self.pure_lr))
        if not isinstance(self.answer_loss, bool):
            raise TypeError(f"recall_mix answer_loss must be true or false, got {self.answer_loss!r}")
        if self.until is not None:
            if not _is_number(self.until) or not 0.0 < self.until <= 1.0:
                raise ValueError(f"recall_mix until must be an accuracy in (0, 1] or null, got {self.until!r}")
            if self.pure_steps < 1:
                raise ValueError(f"recall_mix until={self.until} needs pure_steps >= 1 (the phase's most steps), "
                                 f"got {self.pure_steps}")
            self._set("until", float(self.until))
        if not _is_int(self.check_every) or self.check_every < 1:
            raise ValueError(f"recall_mix check_every must be an int >= 1, got {self.check_every!r}")
        self._set("fraction", float(fraction))
        self._set("n_pairs", list(n_pairs))


@dataclass(frozen=True)
class PretrainSettings(Settings):
    """``models.<name>.pretrain``: an embedded tiny model the workflow trains (rule ``pretrain``).

    Args:
        corpus: a key of ``corpora`` whose ``train`` split it trains on.
        arch: config fields of the family's config class.
        train: the optimisation (:class:`TrainSettings`).
        recall_mix: recall documents mixed into the text (:class:`RecallMixSettings`); None: corpus only.
        share_conv: ``none``, ``head`` or ``all``: q/k short-convolution filters tied while training (paper App.
            B.5, Table 14).
    """

    section: ClassVar[str] = "pretrain"
    nested: ClassVar[Mapping[str, type[Settings]]] = {"train": TrainSettings, "recall_mix": RecallMixSettings}

    corpus: str | None = None
    arch: dict = field(default_factory=dict)
    train: TrainSettings = field(default_factory=TrainSettings)
    recall_mix: RecallMixSettings | None = field(default=None, metadata=OPTIONAL)
    share_conv: str = choice("none", ("none", "head", "all"), label="share_conv")


# ---- recovery fine-tuning -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoraSettings(Settings):
    """``rft.lora``: LoRA on the RFT scope's projections (peft ``LoraConfig``'s ``r``, ``lora_alpha``,
    ``lora_dropout``; paper App. A: rank 32, alpha 64)."""

    section: ClassVar[str] = "rft.lora"

    rank: int = 32
    alpha: float = 64
    dropout: float = 0.0

    def __post_init__(self):
        if int(self.rank) < 1 or float(self.alpha) <= 0 or not 0 <= float(self.dropout) < 1:
            raise ValueError(f"rft lora needs rank >= 1, alpha > 0, dropout in [0, 1); got {self.to_dict()}")


@dataclass(frozen=True)
class DistillSettings(Settings):
    """``rft.distill``: the loss, ``kl_weight * T^2 * KL(teacher^T || student^T) + lm_weight * CE``."""

    section: ClassVar[str] = "rft.distill"

    temperature: float = 2.0
    kl_weight: float = 1.0
    lm_weight: float = 0.0

    def __post_init__(self):
        if float(self.temperature) <= 0:
            raise ValueError(f"rft distill temperature must be > 0, got {self.temperature!r}")
        kl, lm = float(self.kl_weight), float(self.lm_weight)
        if kl < 0 or lm < 0 or not (kl or lm):
            raise ValueError(f"rft distill weights must be >= 0 and not both 0; got {self.to_dict()}")


@dataclass(frozen=True)
class RftSettings(Settings):
    """Recovery fine-tuning (:mod:`statereduce.stages.rft`): the paper's defaults (App. A); the embedded tiny models
    override sizes and LR in config.yaml.

    Args:
        lora, distill: :class:`LoraSettings`, :class:`DistillSettings`.
        scope: which subtrees train: ``auto`` (the adapter's default), ``all`` or ``recurrent``.
        n_samples, seq_len: training sequences and their tokens (one pass).
        batch_size: the effective batch (sequences per optimizer step, over all processes).
        micro_batch_size: sequences per forward pass; ``batch_size / (micro_batch_size * processes)`` accumulate.
            ``auto``: on a GPU the most that fit in its memory (``statereduce.stages.rft.auto_micro_batch``), on a CPU
        1. lr, min_lr, warmup_frac: AdamW's peak learning rate, linear warm-up over ``warmup_frac`` of the steps, cosine
            to ``min_lr``.
        weight_decay, betas, grad_clip: AdamW's, and gradient-norm clipping.
        precision: ``auto`` (bf16 autocast on CUDA, fp32 on CPU), ``bf16`` or ``fp32``.
        kernels: the student's backward: ``auto`` (the adapter's ``backward_kernels``: torch where fla refuses the
            family's backward, else fla), ``fla`` or ``torch``.
        seed: data order and LoRA's initialisation.
        log_every: optimizer steps per log line.
        save_every: optimizer steps between resume checkpoints and validation passes.
        val_samples: validation documents of the RFT corpus's train split that feed no training sequence (held-out
            evaluation documents are never among them), each scored from its start with a fresh state, as the
            held-out evaluation scores its documents; the validation loss is measured before the first step, at
            every ``save_every`` and after the last step. 0: no validation.
        val_seq_len: the tokens scored of each validation document, from its start (shorter documents whole);
            None: ``seq_len``. Set it to the evaluation's document length where that is longer than ``seq_len``.
        keep: which fine-tuned weights are saved: ``best`` (the validation pass with the lowest ``best_metric``,
            step 0, the pruned model itself, included; as Hugging Face's ``load_best_model_at_end``) or ``last``.
        best_metric: what ``keep: best`` compares: ``ce`` (the student's next-token cross entropy, what the held-out
            evaluation measures) or ``loss`` (the training loss: distillation plus ``lm_weight`` times CE).
    """

    section: ClassVar[str] = "rft"
    nested: ClassVar[Mapping[str, type[Settings]]] = {"lora": LoraSettings, "distill": DistillSettings}

    lora: LoraSettings = field(default_factory=LoraSettings)
    distill: DistillSettings = field(default_factory=DistillSettings)
    scope: str = choice("auto", ("auto", "all", "recurrent"))
    n_samples: int = 32000
    seq_len: int = 2048
    batch_size: int = 16
    micro_batch_size: int | str = "auto"
    lr: float = 1e-4
    min_lr: float = 1e-5
    warmup_frac: float = 0.05
    weight_decay: float = 0.0
    betas: list = field(default_factory=lambda: [0.9, 0.999])
    grad_clip: float = 1.0
    precision: str = choice("auto", ("auto", "bf16", "fp32"))
    kernels: str = choice("auto", ("auto", "fla", "torch"))
    seed: int = 0
    log_every: int = 10
    save_every: int = 100
    val_samples: int = 64
    val_seq_len: int | None = None
    keep: str = choice("best", ("best", "last"))
    best_metric: str = choice("ce", ("ce", "loss"))

    def __post_init__(self):
        super().__post_init__()
        if not _is_int(self.val_samples) or self.val_samples < 0:
            raise ValueError(f"rft val_samples must be an integer >= 0, got {self.val_samples!r}")
        if self.val_seq_len is not None and (not _is_int(self.val_seq_len) or self.val_seq_len < 2):
            raise ValueError(f"rft val_seq_len must be an integer >= 2 or null (seq_len), got {self.val_seq_len!r}")
        if self.keep == "best" and self.val_samples == 0:
            raise ValueError("rft keep: best needs validation sequences, got val_samples=0; valid: val_samples >= 1, "
                             "or keep: last")
        for key in ("n_samples", "seq_len", "batch_size", "micro_batch_size", "log_every", "save_every"):
            value = getattr(self, key)
            if key == "micro_batch_size" and value == "auto":
                continue
            if not _is_int(value) or value < 1:
                valid = "an integer >= 1 or auto" if key == "micro_batch_size" else "an integer >= 1"
                raise ValueError(f"rft {key} must be {valid}, got {value!r}")
        if self.micro_batch_size != "auto" and self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"rft batch_size={self.batch_size} is not a multiple of micro_batch_size={self.micro_batch_size}"
            )
        if self.n_samples < self.batch_size:
            raise ValueError(f"rft n_samples={self.n_samples} is smaller than one batch (batch_size={self.batch_size})")
        if not 0 <= float(self.warmup_frac) < 1:
            raise ValueError(f"rft warmup_frac must be in [0, 1), got {self.warmup_frac!r}")
        if float(self.lr) <= 0 or float(self.min_lr) < 0:
            raise ValueError(f"rft lr must be > 0 and min_lr >= 0; got lr={self.lr!r}, min_lr={self.min_lr!r}")
        self._set("betas", [float(b) for b in self.betas])


@dataclass(frozen=True)
class RftPlan(Settings):
    """A model's RFT plan: the top-level ``rft`` block updated by ``models.<name>.rft``
    (:func:`statereduce.config.model_rft`).

    Args:
        activate: false: no RFT (summaries keep a null rft slot).
        corpus: a key of ``corpora`` whose ``train`` split feeds RFT (default: the model's calibration corpus).
        gpus: GPUs of the rft job; > 1 runs accelerate (DDP) under torchrun.
        settings: the fine-tuning settings (:class:`RftSettings`); ``to_dict`` gives them as configured
            (:meth:`~Settings.overrides`), which the rule's params carry.
    """

    section: ClassVar[str] = "rft"
    nested: ClassVar[Mapping[str, type[Settings]]] = {"settings": RftSettings}

    activate: bool = True
    corpus: str | None = None
    gpus: int = 1
    settings: RftSettings = field(default_factory=RftSettings)

    WORKFLOW_KEYS: ClassVar[tuple[str, ...]] = ("activate", "corpus", "gpus")
    """The rft keys the workflow reads; the rest go to fine-tuning."""

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "settings": self.settings.overrides()}


# ---- speed benchmarks ---------------------------------------------------------------------------------------------
class _SpeedPart(Settings):
    unknown_message: ClassVar[str] = "unknown {section} setting(s) {bad}; valid: {valid}"
    sort_valid: ClassVar[bool] = False


@dataclass(frozen=True)
class DecodeSettings(_SpeedPart):
    """``speed.decode`` (Table 17): a ``prompt``-token prefill, then the one-token step replayed in a CUDA graph
    (``warmup`` replays, ``trials`` x ``steps`` timed) per batch and decode kernel; ``check_steps`` replays are
    checked against fla's eager decoding first."""

    section: ClassVar[str] = "speed.decode"

    prompt: int = 512
    batches: list = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    warmup: int = 10
    steps: int = 100
    trials: int = 3
    kernels: list = field(default_factory=lambda: ["fla", "statereduce", "fla_copy", "fla+fused",
                                                   "statereduce+fused", "fla_copy+fused"])
    check_steps: int = 3


@dataclass(frozen=True)
class PrefillSettings(_SpeedPart):
    """``speed.prefill`` (Table 18): the batch x length grid; ``graph``: time replays of a CUDA graph of the call,
    ``profile``: also the kernels' summed device time of one call."""

    section: ClassVar[str] = "speed.prefill"

    batches: list = field(default_factory=lambda: [1, 4, 8, 16])
    lengths: list = field(default_factory=lambda: [2048, 8192, 16384])
    warmup: int = 1
    steps: int = 3
    trials: int = 3
    graph: bool = True
    profile: bool = True


@dataclass(frozen=True)
class MixerSettings(_SpeedPart):
    """``speed.mixer`` (Table 19): one linear-attention layer's forward at ``seq_len`` tokens; ``arch`` overrides
    the model's arch for that layer (the paper's Table 19: hidden 2048, 16 heads, d_v = 128)."""

    section: ClassVar[str] = "speed.mixer"

    batches: list = field(default_factory=lambda: [8, 16, 32])
    seq_len: int = 2048
    warmup: int = 3
    steps: int = 10
    trials: int = 3
    arch: dict = field(default_factory=dict)
    graph: bool = True
    profile: bool = True


@dataclass(frozen=True)
class SpeedProfileSettings(_SpeedPart):
    """``speed.profile``: per-kernel device time of ``steps`` eager decode steps, the ``top`` kernels."""

    section: ClassVar[str] = "speed.profile"

    batches: list = field(default_factory=lambda: [1, 64])
    steps: int = 10
    top: int = 30


@dataclass(frozen=True)
class SpeedSettings(Settings):
    """GPU speed benchmarks (:mod:`statereduce.speed.bench`): the paper's protocol (App. G.1).

    Args:
        pcts: ratios measured beside the baseline.
        dtype: ``bfloat16`` or ``float16``.
        blas: torch's GEMM library (``torch.backends.cuda.preferred_blas_library``: ``cublas`` or ``cublaslt``;
            None leaves torch's default): at one sequence the GEMV kernel chosen for a pruned projection can be
            slower than the unpruned one's (docs/speed.md).
        pdl: our decode kernels use programmatic dependent launch where the GPU has it
            (:func:`statereduce.kernels.recurrent.programmatic_launch`; the document's ``pdl`` says whether they did).
        decode, prefill, mixer, profile: each part's settings.
    """

    section: ClassVar[str] = "speed"
    unknown_message: ClassVar[str] = "unknown speed setting {key!r}; valid: {valid}"
    sort_valid: ClassVar[bool] = False
    nested: ClassVar[Mapping[str, type[Settings]]] = {"decode": DecodeSettings, "prefill": PrefillSettings,
                                                      "mixer": MixerSettings, "profile": SpeedProfileSettings}

    pcts: list = field(default_factory=lambda: [50, 75])
    dtype: str = "bfloat16"
    blas: str | None = choice(None, (None, "cublas", "cublaslt"),
                              describe="cublas, cublaslt, or null for torch's default")
    pdl: bool = True
    decode: DecodeSettings = field(default_factory=DecodeSettings)
    prefill: PrefillSettings = field(default_factory=PrefillSettings)
    mixer: MixerSettings = field(default_factory=MixerSettings)
    profile: SpeedProfileSettings = field(default_factory=SpeedProfileSettings)

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.pdl, bool):
            raise ValueError(f"speed pdl must be true or false; got {self.pdl!r}")  # noqa: TRY004 (a setting's value)
        for pct in self.pcts:
            if not 0 <= float(pct) < 100:
                raise ValueError(f"speed pct {pct} is outside [0, 100): it is the percent of key channels removed")


@dataclass(frozen=True)
class SpeedPlan(Settings):
    """A model's speed plan (:func:`statereduce.config.model_speed`): its family, the arch measured (random weights
    of that shape) and the speed settings (the top-level ``speed`` block updated by the model's); ``to_dict`` gives
    them as configured (:meth:`~Settings.overrides`), which the rule's params carry."""

    section: ClassVar[str] = "speed plan"
    nested: ClassVar[Mapping[str, type[Settings]]] = {"settings": SpeedSettings}

    arch: dict = field(default_factory=dict)
    family: str = ""
    settings: SpeedSettings = field(default_factory=SpeedSettings)

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "settings": self.settings.overrides()}
