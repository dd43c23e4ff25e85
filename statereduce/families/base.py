"""What a model family is, from its config alone: the facts the workflow validates a run with, importing no torch.

A :class:`FamilySpec` subclass per family names its HF config class and that class's keyword defaults, and derives
from a config (or from a workflow ``arch`` block) the head sizes, the linear-attention layers, the config fields
that describe a smaller key dimension and the per-layer state. The family's adapter
(:mod:`statereduce.adapters`) subclasses its spec and adds everything that needs a loaded model; configuration
validation (:mod:`statereduce.config`) and the Snakefile use the specs alone, so that planning a run imports neither
torch nor fla.
"""

from __future__ import annotations

import copy
import importlib
import json
import numbers
import types
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

from statereduce.common.settings import PretrainSettings

_FAMILIES: dict[str, Family] = {}

#: The config field of a checkpoint whose layers keep different key widths: per decoder layer, its d_k' (None for a
#: layer without a linear-attention mixer). The config's own head sizes stay those of the unpruned model
#: (:func:`statereduce.stages.prune.prune_model` writes it, :func:`statereduce.core.slicing.shape_mixers` reads it
#: on load).
KEY_DIMS_FIELD = "statereduce_key_dims"
#: config field of a checkpoint whose value width the stock config cannot express (Mamba-2): per decoder layer, the
#: mixer's d_v' (None for other layers); :func:`statereduce.core.models.load_model` shapes the mixers from it
VALUE_DIMS_FIELD = "statereduce_value_dims"
#: The ``model_type`` prefix of a checkpoint that carries its own modeling code (:mod:`statereduce.core.portable`):
#: ``statereduce_delta_net`` is a ``delta_net`` checkpoint whose layers keep different widths. A model type of its
#: own makes transformers load the checkpoint's code, where fla's registration of the stock type would win.
PORTABLE_PREFIX = "statereduce_"

SHARE_CONV = PretrainSettings.valid("share_conv")
"""Values of ``share_conv``: a filter per channel (stock), one per head, one per layer (each of q and k)."""


@dataclass
class Family:
    """A registered family: its spec (config facts, no torch) and, once :mod:`statereduce.adapters` is imported, its
    adapter (the spec's subclass that reads and changes loaded models)."""

    spec: type[FamilySpec]
    adapter: type | None = None


def register_family(cls: type[FamilySpec]) -> type[FamilySpec]:
    """Class decorator: register a family spec under its ``family`` name."""
    if cls.family in _FAMILIES:
        raise ValueError(f"model family {cls.family!r} registered twice")
    _FAMILIES[cls.family] = Family(cls)
    return cls


def registered(family: str) -> Family:
    """The registry's entry of a family name, with a one-line error listing valid names."""
    try:
        return _FAMILIES[family]
    except (KeyError, TypeError):
        raise ValueError(f"unknown model family {family!r}; valid: {', '.join(family_names())}") from None


def attach_adapter(cls: type) -> type:
    """Record ``cls`` as the adapter of its family's entry (it must subclass that family's spec)."""
    entry = registered(cls.family)
    if not issubclass(cls, entry.spec):
        raise TypeError(f"adapter {cls.__name__} does not subclass the spec of family {cls.family!r}")
    if entry.adapter is not None:
        raise ValueError(f"adapter family {cls.family!r} registered twice")
    entry.adapter = cls
    return cls


def family_names() -> list[str]:
    return sorted(_FAMILIES)


def family_spec(family: str) -> type[FamilySpec]:
    """The spec class for a family name, with a one-line error listing valid names."""
    return registered(family).spec


def model_type_family(model_type: str | None) -> type[FamilySpec] | None:
    """The spec of the family whose ``model_types`` holds ``model_type`` (an HF config's), None if no family takes
    it. A checkpoint with its own modeling code names its stock type after :data:`PORTABLE_PREFIX`."""
    if model_type is not None:
        model_type = model_type.removeprefix(PORTABLE_PREFIX)
    return next((s.spec for s in _FAMILIES.values() if model_type in s.spec.model_types), None)


class LazyImport:
    """A class attribute that is ``module:name``, imported on first access (keeps fla out of config validation).

    ``config_class = LazyImport("fla.models:DeltaNetConfig")`` reads ``cls.config_class`` as the class itself.
    """

    def __init__(self, target: str):
        self.target = target

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        module, _, name = self.target.partition(":")
        return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class StateShape:
    """Recurrent and conv state of one linear-attention layer, per sequence."""

    num_heads: int  # heads of the recurrent state (value heads under GVA)
    d_k: int
    d_v: int
    conv_channels: int  # channels of all short-conv states of the layer (q + k + v); 0 without short conv
    conv_width: int

    @property
    def recurrent_elems(self) -> int:
        return self.num_heads * self.d_k * self.d_v

    @property
    def conv_elems(self) -> int:
        return self.conv_channels * self.conv_width

    def with_value_dim(self, d_v: int) -> StateShape:
        """The same layer keeping ``d_v`` value channels per head (its value conv, where it has one, too)."""
        if int(d_v) == self.d_v:
            return self
        conv = self.conv_channels - self.num_heads * (self.d_v - int(d_v)) if self.conv_channels else 0
        return StateShape(self.num_heads, self.d_k, int(d_v), conv, self.conv_width)


class Dims(NamedTuple):
    """Head sizes (H, HV, d_k, d_v) of a family's linear-attention layers, read from a config."""

    num_heads: int  # H: q/k heads
    num_v_heads: int  # HV: value heads (GVA: HV = r * H, value head i reads key head i // r)
    head_k_dim: int  # d_k
    head_v_dim: int  # d_v


@dataclass(frozen=True)
class RftTargets:
    """What recovery fine-tuning trains in one family's models (:attr:`FamilySpec.rft_targets`,
    :mod:`statereduce.stages.rft`)."""

    #: the scope of ``rft.scope: auto``. Hybrids (Qwen3.5) set "recurrent": only their linear-attention components
    #: train, their softmax layers and MLPs stay frozen (paper Table 4)
    default_scope: str = "all"
    #: names (last component) of ``nn.Linear`` modules inside the trained subtrees that get no LoRA and stay frozen
    lora_excluded: tuple[str, ...] = ()


class FamilySpec(ABC):
    """The config facts of one family (class attributes and classmethods only)."""

    family: ClassVar[str]  # config name of the family, e.g. "delta_net"
    model_types: ClassVar[tuple[str, ...]]  # HF config.model_type values handled
    config_class: ClassVar[type]  # the HF config class of the family (a LazyImport: loads on access)
    # every keyword argument of ``config_class.__init__`` with its default, copied so that config
    # validation needs no fla import; tests/test_config.py pins it against the real signature
    config_defaults: ClassVar[dict[str, Any]]

    #: whether the family's models run fla's code: fla's own models, or fla's kernels that transformers binds where fla
    #: is installed (Qwen3.5). Loading a checkpoint then imports fla first (it registers its configs and models with
    #: transformers' Auto classes) and routes its kernels on CPU to PyTorch (the adapter's ``install_fallbacks``);
    #: a family that runs none (Mamba-2: transformers' model, its PyTorch path on CPU) loads without importing fla
    uses_fla: ClassVar[bool] = True
    #: the vLLM model class that serves the family's stock checkpoints (the ``architectures`` name vLLM registers),
    #: None where vLLM has none (fla's DeltaNet and Gated DeltaNet); :mod:`statereduce.core.engines`
    vllm_architecture: ClassVar[str | None] = None
    #: whether a value cut (d_v' < d_v in every layer) is a stock checkpoint: the config has a value-width field that
    #: :meth:`value_config_updates` sets (False: Mamba-2, whose value cut carries modeling code)
    stock_value_cut: ClassVar[bool] = True
    #: the kind of vLLM layer that holds the family's recurrent state: "gdn" (Gated DeltaNet kernels) or "mamba"
    #: (Mamba-2's SSD kernels); its constraints on head sizes are :mod:`statereduce.core.engines`'
    vllm_state_layer: ClassVar[str | None] = None
    #: whether the GPU speed benchmarks (statereduce.speed) cover the family
    speed_benchmark: ClassVar[bool] = False
    #: whether the family's training backward runs fla's gated delta rule chunk kernel, which fla 0.6.0 refuses on
    #: Hopper GPUs with Triton >= 3.4.0, < 3.7.1 (the adapter's ``backward_kernels`` then picks the torch fallbacks)
    fla_gated_backward: ClassVar[bool] = False
    #: whether the family's recurrence scales q.k by 1/sqrt(d_k) (delta-rule kernels; not Mamba-2's scan): pruning then
    #: changes the scale (statereduce.stages.prune, "Kernel scale")
    kernel_scale: ClassVar[bool] = True
    #: the config field of the RMSNorm eps that the per-head output norm of a delta-rule mixer shares with the block
    #: norms (fla: ``norm_eps``, Qwen3.5: ``rms_norm_eps``); pruning with ``norm_eps="exact"`` multiplies it by
    #: d_k/d_k' (statereduce.stages.prune, "Kernel scale"). None for a family without a kernel scale (nothing to change)
    norm_eps_field: ClassVar[str | None]
    #: config fields every model of the family is built and loaded with (:func:`statereduce.core.models.load_model`,
    #: :func:`statereduce.core.models.tiny_config`; an ``arch`` block may still set them)
    config_overrides: ClassVar[dict[str, Any]] = {}
    #: whether q and k have short convolutions in modules of their own, whose filters can be shared
    #: (``pretrain.share_conv``, :mod:`statereduce.adapters.conv_sharing`)
    qk_conv_modules: ClassVar[bool] = False
    #: what recovery fine-tuning trains (:class:`RftTargets`). Every family declares it: a family without one is
    #: refused when RFT starts (:func:`statereduce.stages.rft.rft_targets`), never given a default
    rft_targets: ClassVar[RftTargets]

    @classmethod
    @abstractmethod
    def dims(cls, config) -> Dims:
        """(H, HV, d_k, d_v) of the linear-attention layers described by ``config``."""

    @classmethod
    @abstractmethod
    def sized_arch(cls, hidden: int, layers: int, heads: int, d_k: int, d_v: int) -> dict[str, Any]:
        """Config fields of a model of the family with ``layers`` layers of width ``hidden`` whose linear-attention
        layers have ``heads`` q/k heads of d_k channels and value heads of d_v channels (for benchmarks and checks
        at a chosen size; hybrids put a softmax-attention layer last)."""

    @classmethod
    def check_arch(cls, arch: dict[str, Any]) -> None:
        """Raise a one-line ValueError if ``arch`` has a key that ``config_class`` does not take.

        Args:
            arch: keyword arguments for ``config_class`` (a ``pretrain.arch`` block of the workflow config).
        """
        bad = sorted(set(arch) - set(cls.config_defaults))
        if bad:
            raise ValueError(
                f"unknown arch key(s) {bad} for family {cls.family!r}; valid: {', '.join(sorted(cls.config_defaults))}"
            )

    @classmethod
    def arch_dims(cls, arch: dict[str, Any]) -> Dims:
        """:meth:`dims` of ``config_class(**arch)``, computed without building it (no fla import).

        Args:
            arch: keyword arguments for ``config_class``; omitted ones take ``config_defaults``.
        Raises:
            ValueError: an unknown key (:meth:`check_arch`).
        """
        cls.check_arch(arch)
        return cls.dims(types.SimpleNamespace(**{**cls.config_defaults, **arch}))

    @classmethod
    def arch_mixer_layers(cls, arch: dict[str, Any]) -> list[int]:
        """:meth:`mixer_layer_indices` of ``config_class(**arch)``, computed without building it (no fla import)."""
        cls.check_arch(arch)
        return cls.mixer_layer_indices(types.SimpleNamespace(**{**cls.config_defaults, **arch}))

    @classmethod
    @abstractmethod
    def mixer_layer_indices(cls, config) -> list[int]:
        """Indices of the linear-attention layers of ``config`` (softmax-attention layers excluded)."""

    @classmethod
    @abstractmethod
    def config_updates(cls, config, d_k_new: int) -> dict[str, Any]:
        """Config fields (name -> new value) that describe d_k = d_k_new with everything else unchanged.
        Raises ValueError (one line, with values) if the family cannot express it."""

    @classmethod
    @abstractmethod
    def mixer_updates(cls, config, d_k_new: int) -> dict[str, Any]:
        """Attributes (name -> new value) of each mixer module that change with d_k = d_k_new."""

    @classmethod
    @abstractmethod
    def config_state_shape(cls, config) -> StateShape:
        """Per-layer, per-sequence recurrent/conv state shape described by ``config``."""

    @classmethod
    def config_key_dims(cls, config) -> dict[int, int]:
        """{layer: d_k'} of every linear-attention layer of ``config``: the per-layer widths of
        :data:`KEY_DIMS_FIELD` where the config has them, else the config's one d_k for every layer.

        Raises:
            ValueError: one line, when :data:`KEY_DIMS_FIELD` does not name a width for exactly the mixer layers.
        """
        layers = cls.mixer_layer_indices(config)
        widths = getattr(config, KEY_DIMS_FIELD, None)
        if widths is None:
            return dict.fromkeys(layers, cls.dims(config).head_k_dim)
        named = {i: int(w) for i, w in enumerate(widths) if w is not None}
        if sorted(named) != layers:
            raise ValueError(f"{KEY_DIMS_FIELD} names widths for layers {sorted(named)}; the config's linear-attention "
                             f"layers are {layers}")
        return named

    @classmethod
    def width_state_shape(cls, config, d_k_new: int) -> StateShape:
        """The state shape of one linear-attention layer of ``config`` that keeps d_k' = ``d_k_new`` channels per
        q/k head (:meth:`config_state_shape` of :meth:`reduced_config`; ``config`` itself at its own d_k)."""
        if int(d_k_new) == cls.dims(config).head_k_dim:
            return cls.config_state_shape(config)
        return cls.config_state_shape(cls.reduced_config(config, int(d_k_new)))

    @classmethod
    def config_layer_state_shapes(cls, config) -> dict[int, StateShape]:
        """{layer: state shape} of every linear-attention layer, each at its own width (:meth:`config_key_dims`) and
        value width (:data:`VALUE_DIMS_FIELD` where the config has it)."""
        widths = cls.config_key_dims(config)
        shapes = {w: cls.width_state_shape(config, w) for w in set(widths.values())}
        value_dims = getattr(config, VALUE_DIMS_FIELD, None)  # a value cut the stock config cannot hold
        return {layer: shapes[w] if value_dims is None else shapes[w].with_value_dim(value_dims[layer])
                for layer, w in widths.items()}

    @classmethod
    def config_state_bytes(cls, config, dtype_bytes: int = 4) -> int:
        """Recurrent state bytes per sequence over every linear-attention layer of ``config``, each at its own width
        (fp32 state by default)."""
        return sum(s.recurrent_elems for s in cls.config_layer_state_shapes(config).values()) * int(dtype_bytes)

    @classmethod
    def reduced_config(cls, config, d_k_new: int):
        """A copy of ``config`` describing d_k = d_k_new, everything else unchanged.

        Args:
            config: the family's HF config.
            d_k_new: the new key/query head size d_k' (1 <= d_k' <= d_k).
        Raises:
            ValueError: one line with the values, if the family cannot express d_k'.
        """
        new = copy.deepcopy(config)
        for name, value in cls.config_updates(config, d_k_new).items():
            setattr(new, name, value)
        return new

    @classmethod
    def exact_norm_eps_refusal(cls, config) -> str | None:
        """Why ``norm_eps="exact"`` pruning cannot be stored for a model of ``config`` (one line), or None.

        The construction (statereduce.stages.prune, "Kernel scale") multiplies the input embedding by c =
        sqrt(d_k/d_k'): with input and output embeddings tied that would multiply the logits by c. Families add what
        else their configs allow that the construction does not cover."""
        if getattr(config, "tie_word_embeddings", False):
            return ("the input and output embeddings are tied (tie_word_embeddings), so scaling the residual stream "
                    "would scale the logits")
        return None

    @classmethod
    def value_config_updates(cls, config, d_v_new: int) -> dict[str, Any] | None:
        """Config fields (name -> new value) that describe d_v = d_v_new per value head in every linear-attention
        layer, everything else unchanged; None when the family's stock config cannot express it (the checkpoint then
        names each layer's d_v' in :data:`VALUE_DIMS_FIELD`, which only :func:`statereduce.core.models.load_model`
        reads). Raises ValueError (one line) for a d_v' outside ``[1, d_v]``."""
        cls.check_value_reduction(cls.dims(config).head_v_dim, d_v_new)
        return None

    @classmethod
    def check_value_reduction(cls, head_v_dim: int, d_v_new: int) -> None:
        """Raise a one-line ValueError unless d_v = head_v_dim can shrink to d_v_new (``1 <= d_v' <= d_v``)."""
        if isinstance(d_v_new, bool) or not isinstance(d_v_new, numbers.Integral) or not 1 <= d_v_new <= head_v_dim:
            raise ValueError(
                f"d_v'={d_v_new!r} is invalid for {cls.family}; valid: an integer in [1, d_v={head_v_dim}]"
            )

    @classmethod
    def check_reduction(cls, head_k_dim: int, head_v_dim: int, d_k_new: int) -> None:
        """Raise a one-line ValueError unless d_k = head_k_dim can shrink to d_k_new with d_v = head_v_dim kept.

        The config-free part of :meth:`config_updates`' checks (usable from head sizes alone); the base checks
        ``1 <= d_k_new <= d_k``, families add what their config fields impose.
        """
        if isinstance(d_k_new, bool) or not isinstance(d_k_new, numbers.Integral) or not 1 <= d_k_new <= head_k_dim:
            raise ValueError(
                f"d_k'={d_k_new!r} is invalid for {cls.family}; valid: an integer in [1, d_k={head_k_dim}]"
            )


def share_conv_families() -> list[str]:
    """The families with q and k short convolutions in modules of their own (``qk_conv_modules``)."""
    return [f for f in family_names() if family_spec(f).qk_conv_modules]


def check_share_conv(family: str, share: str, arch: Mapping[str, Any]) -> None:
    """Raise a one-line ValueError unless a model of ``family`` with config fields ``arch`` can train with
    ``share_conv = share`` (paper App. B.5, Table 14).

    Args:
        family: a model family.
        share: the ``pretrain.share_conv`` value.
        arch: the ``pretrain.arch`` block (omitted keys take the family's ``config_defaults``).
    """
    if share not in SHARE_CONV:
        raise ValueError(f"unknown share_conv {share!r}; valid: {', '.join(SHARE_CONV)}")
    if share == "none":
        return
    valid = share_conv_families()
    if family not in valid:
        raise ValueError(f"share_conv {share!r} needs q/k short convolutions in modules of their own, which family "
                         f"{family!r} does not have; valid: share_conv none, or a family of {', '.join(valid)}")
    if not {**family_spec(family).config_defaults, **arch}.get("use_short_conv", True):
        raise ValueError(f"share_conv {share!r} needs short convolutions; valid with use_short_conv false: none")


def check_family(checkpoint: str, revision: str | None, family: str, download: bool = False) -> None:
    """Raise a one-line ValueError if the checkpoint's ``config.json`` has a ``model_type`` the family does not take.

    Reads a local folder's ``config.json``, else the hub's (fetched when ``download``, else from the cache only);
    does nothing when neither is available.
    """
    folder = Path(checkpoint).expanduser()
    path: Any = folder / "config.json" if folder.is_dir() else None
    if path is None:
        from huggingface_hub import hf_hub_download, try_to_load_from_cache

        try:
            path = (hf_hub_download(checkpoint, "config.json", revision=revision, etag_timeout=15) if download
                    else try_to_load_from_cache(checkpoint, "config.json", revision=revision))
        except Exception:  # noqa: BLE001 -- no network, private repo: the load itself reports it
            path = None
    if not isinstance(path, (str, Path)) or not Path(path).is_file():
        return
    model_type = json.loads(Path(path).read_text()).get("model_type")
    if model_type is not None:
        model_type = model_type.removeprefix(PORTABLE_PREFIX)
    valid = family_spec(family).model_types
    if model_type is not None and model_type not in valid:
        raise ValueError(f"{checkpoint!r} is a {model_type!r} checkpoint, not {family} "
                         f"(model_type {', '.join(map(repr, valid))}); fix the id or the family")
