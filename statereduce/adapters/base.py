"""The adapter interface: every model-family difference lives behind it.

An adapter wraps one loaded causal-LM and answers where the key/query channels of each linear-attention
head live (:meth:`LinearAttentionAdapter.channel_rows`: rows of separate or fused projections and
depthwise convolutions), how to capture K and Q as they enter the recurrence, how to write the reduced
config, which modules write into the residual stream and which norms read the config's eps (pruning with
``norm_eps="exact"``), which class loads the family's checkpoints and which PyTorch fallbacks run it on CPU. Nothing
outside ``statereduce/adapters`` may branch on ``model_type``. Adapters are pure mapping: the slicing
itself is done by the verb functions of :mod:`statereduce.stages.prune`, driven by the rows and sizes an
adapter hands out.

Everything that depends only on the config (``dims``, ``reduced_config``, ``mixer_layer_indices``,
``config_state_shape``, ``arch_dims``, ...) is a classmethod of the family's spec
(:mod:`statereduce.families`), which each adapter subclasses: the workflow validates a run from the specs before
any weights are loaded and without importing torch or fla. The instance properties and methods here are
conveniences over ``model.config``; adapter modules import fla only inside the methods that use it.

To add a family: write its spec in ``families/<family>.py`` (``@register_family``, imported in
``families/__init__.py``), then ``adapters/<family>.py`` with a subclass of the spec and of
:class:`LinearAttentionAdapter` decorated with ``@register_adapter``, import it in ``adapters/__init__.py``, and add
a subclass of the contract test class in ``tests/test_adapters.py``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types
from abc import abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from statereduce.common.settings import RftSettings
from statereduce.families.base import (  # noqa: F401  (re-exported)
    Dims, FamilySpec, LazyImport, StateShape, attach_adapter, family_names, family_spec, registered,
)


def register_adapter(cls: type[LinearAttentionAdapter]) -> type[LinearAttentionAdapter]:
    """Class decorator: record an adapter (a subclass of its family's spec) in the family registry
    (:func:`statereduce.families.base.attach_adapter`)."""
    return attach_adapter(cls)


def adapter_families() -> list[str]:
    return [f for f in family_names() if registered(f).adapter is not None]


def adapter_class(family: str) -> type[LinearAttentionAdapter]:
    """The adapter class for a family name; an unknown name gets the registry's one-line error."""
    return registered(family).adapter


def adapter_for_config(config) -> type[LinearAttentionAdapter]:
    """The adapter class whose ``model_types`` contains ``config.model_type``."""
    adapters = [adapter_class(f) for f in adapter_families()]
    for cls in adapters:
        if config.model_type in cls.model_types:
            return cls
    known = sorted(t for c in adapters for t in c.model_types)
    raise ValueError(f"no adapter for model_type {config.model_type!r}; supported: {', '.join(known)}")


def get_adapter(model: nn.Module) -> LinearAttentionAdapter:
    """Instantiate the right adapter for a loaded model."""
    return adapter_for_config(model.config)(model)


# A capture callback receives (layer_idx, q, k) with q, k of shape [B, T, H, d_k]: the tensors
# exactly as they enter the recurrence kernel (post conv + activation, before the in-kernel L2 norm).
# They are the live tensors of the forward pass: detach/copy them, never modify them in place.
QKCallback = Callable[[int, torch.Tensor, torch.Tensor], None]
# A projection weight and the rows [H, d_k] of channel (h, j) of the queries or the keys in it.
WeightRows = tuple[nn.Parameter, torch.Tensor]
# Reads (q, k) [B, T, H, d_k] from the (args, kwargs) of one call of a family's kernel function.
QKOfCall = Callable[[tuple, dict], tuple[torch.Tensor, torch.Tensor]]
# An input callback receives (layer_idx, x) with x [B, T, hidden], the input of the q/k projections.
XCallback = Callable[[int, torch.Tensor], None]


RFT_SCOPES = tuple(s for s in RftSettings.valid("scope") if s != "auto")
"""What recovery fine-tuning may train (:meth:`LinearAttentionAdapter.rft_roots`): ``rft.scope``'s values but
``auto``, which each adapter resolves (``rft_default_scope``)."""


@dataclass(frozen=True)
class ChannelRows:
    """Where the key/query channels sit in one module of a mixer.

    ``q[h, j]`` / ``k[h, j]`` is the row (output feature of an ``nn.Linear``, channel of a depthwise ``nn.Conv1d``) of
    query / key channel j of q/k head h, or None when the module holds no such channels. Under grouped heads (Mamba-2's
    B/C groups, GVA) h is the q/k head (group) whose selection its value heads share.
    """

    name: str  # the module's name inside the mixer, for messages
    module: nn.Module
    q: torch.Tensor | None
    k: torch.Tensor | None


@dataclass(frozen=True)
class ScaledRows:
    """Rows of a module's weight (and bias) that pruning with ``norm_eps="exact"`` multiplies by c = sqrt(d_k/d_k')
    (:func:`statereduce.stages.prune.exact_norm_eps`): output features of an ``nn.Linear``, or the whole weight of an
    ``nn.Embedding`` (``rows`` None: every row)."""

    name: str  # the module's qualified name in the model, for messages and the record
    module: nn.Module
    rows: torch.Tensor | None = None


@dataclass(frozen=True)
class EpsAttribute:
    """An attribute of a live module that the family's stock class sets from the config's norm eps
    (``FamilySpec.norm_eps_field``): ``module.<attr>``, e.g. an RMSNorm's ``eps``."""

    name: str  # the module's qualified name in the model
    module: nn.Module
    attr: str


#: the attribute names under which the stock norm modules (and layers) of the supported families keep an eps
EPS_ATTRIBUTES = ("eps", "variance_epsilon", "layer_norm_epsilon", "norm_eps")


def head_major_rows(num_heads: int, d_k: int, offset: int = 0) -> torch.Tensor:
    """Rows ``offset + h*d_k + j`` as [H, d_k]: the head-major layout of a q or k block."""
    return offset + torch.arange(num_heads * d_k, dtype=torch.long).reshape(num_heads, d_k)


class LinearAttentionAdapter(FamilySpec):
    """Structural facts about one family's loaded models; the config facts come from its
    :class:`~statereduce.families.base.FamilySpec`, which each adapter subclasses."""

    def __init__(self, model: nn.Module):
        self.model = model

    @property
    def config(self):
        """The model's live config (``prune_model`` rewrites it in place)."""
        return self.model.config

    # ---- structure ----------------------------------------------------------------------------
    @abstractmethod
    def mixer_layers(self) -> list[tuple[int, nn.Module]]:
        """(layer index, linear-attention mixer) for every prunable layer; softmax layers skipped."""

    @abstractmethod
    def channel_rows(self, mixer: nn.Module) -> list[ChannelRows]:
        """Every module of ``mixer`` that holds key/query channels, with the rows of channel (h, j).

        Projections come first (an ``nn.Linear`` whose output rows include q and/or k channels: fla's separate
        ``q_proj``/``k_proj``, or one fused ``in_proj``), then depthwise convolutions over the same channels.
        Pruning keeps every row that is not a dropped q/k channel, in the original order
        (:func:`statereduce.core.slicing.slice_rows`), so fused layouts stay fused.
        """

    @abstractmethod
    def projection_input(self, mixer: nn.Module) -> nn.Module:
        """The module whose forward input is the q/k projection input x [B, T, hidden] (``on_x`` of :meth:`capture`)."""

    @property
    def num_heads(self) -> int:
        """Number of q/k heads H."""
        return self.dims(self.config).num_heads

    @property
    def num_v_heads(self) -> int:
        """Value heads HV (GVA: HV = r * H, value head i reads key head i // r)."""
        return self.dims(self.config).num_v_heads

    @property
    def head_k_dim(self) -> int:
        """d_k of each q/k head."""
        return self.dims(self.config).head_k_dim

    @property
    def head_v_dim(self) -> int:
        """d_v of each value head."""
        return self.dims(self.config).head_v_dim

    def qk_weight_rows(self, mixer: nn.Module) -> tuple[WeightRows, WeightRows]:
        """((W, rows_q), (W, rows_k)): the projection weight parameters holding the query and the key channels (the
        same parameter for a fused projection) and the rows [H, d_k] of channel (h, j) in each."""
        found: dict[str, tuple[nn.Parameter, torch.Tensor]] = {}
        for entry in self.channel_rows(mixer):
            if isinstance(entry.module, nn.Linear):
                for side in ("q", "k"):
                    rows = getattr(entry, side)
                    if rows is not None and side not in found:
                        found[side] = (entry.module.weight, rows)
        if set(found) != {"q", "k"}:
            raise ValueError(f"{type(self).__name__}.channel_rows names no projection of the {set('qk') - set(found)}")
        return found["q"], found["k"]

    def qk_weights(self, mixer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_q, W_k), each [H * d_k, hidden], copies; head h is rows h*d_k .. (h+1)*d_k."""
        return tuple(w[rows.reshape(-1).to(w.device)] for w, rows in self.qk_weight_rows(mixer))

    def pruned_config(self, d_k_new: int):
        """Instance convenience for :meth:`reduced_config` on the model's own config."""
        return self.reduced_config(self.config, d_k_new)

    #: the attribute of a live mixer that holds its key width d_k' (set by ``mixer_updates``); in a checkpoint whose
    #: layers keep different widths it differs from the config's d_k
    mixer_key_dim_attr: ClassVar[str] = "head_k_dim"

    def mixer_key_dim(self, mixer: nn.Module) -> int:
        """The key width d_k' of one live mixer (its own, which a per-layer-width checkpoint sets per layer)."""
        return int(getattr(mixer, self.mixer_key_dim_attr))

    def layer_key_dims(self) -> dict[int, int]:
        """{layer: d_k'} of every linear-attention layer, read from the live mixers."""
        return {layer: self.mixer_key_dim(mixer) for layer, mixer in self.mixer_layers()}

    def layer_state_shapes(self) -> dict[int, StateShape]:
        """{layer: per-sequence recurrent/conv state shape} of every linear-attention layer at its own key width
        (:meth:`layer_key_dims`; :meth:`~statereduce.families.base.FamilySpec.width_state_shape`)."""
        widths = self.layer_key_dims()
        shapes = {w: self.width_state_shape(self.config, w) for w in set(widths.values())}
        return {layer: shapes[w] for layer, w in widths.items()}

    def state_shape(self) -> StateShape:
        """The per-layer, per-sequence recurrent/conv state shape that every linear-attention layer has.

        Raises:
            ValueError: the layers keep different key widths (:meth:`layer_state_shapes` has each one's).
        """
        shapes = set(self.layer_state_shapes().values())
        if len(shapes) > 1:
            raise ValueError(f"the layers keep different key widths {self.layer_key_dims()}; use layer_state_shapes()")
        return shapes.pop() if shapes else self.config_state_shape(self.config)

    def num_mixer_layers(self) -> int:
        return len(self.mixer_layers())

    def conv_sharing(self, mixer: nn.Module) -> str:
        """How ``mixer``'s q/k short-conv filters are shared ("none" | "head" | "all"); the default: "none"."""
        return "none"

    def state_bytes(self, dtype_bytes: int = 4) -> int:
        """Recurrent state bytes per sequence over all linear-attention layers, each at its own key width (fp32 state
        by default)."""
        return sum(s.recurrent_elems for s in self.layer_state_shapes().values()) * int(dtype_bytes)

    # ---- exact zero-masking through the norm eps (statereduce.stages.prune, "Kernel scale") -----------------------
    # After pruning, the stock delta-rule kernels scale q.k by 1/sqrt(d_k') instead of 1/sqrt(d_k): the mixer output
    # is c = sqrt(d_k/d_k') times that of zero-masking, and its per-head RMSNorm sees it with the config's eps.
    # norm_eps="exact" multiplies that eps (shared by every norm the field feeds) by c^2 and makes every other norm's
    # input c times larger: the residual stream (the input embedding and every module that adds into it) and the
    # projections that feed norms off the residual stream. These three members say where that is in the family.
    def residual_writers(self) -> list[ScaledRows]:
        """The input embedding and every module whose output is added to the residual stream (each block's mixer or
        attention output projection and its MLP's down projection), weight and bias rows all scaled by c."""
        raise NotImplementedError(f"{self.family} has no exact norm-eps construction")

    def norm_input_rows(self) -> list[ScaledRows]:
        """Projection rows (weight and bias) that feed a norm reading the config's eps from something other than the
        residual stream (Qwen3.5's attention q_norm/k_norm read the query and key projections); the default: none."""
        return []

    def config_eps_attributes(self) -> list[EpsAttribute]:
        """Every attribute of a live module that the stock class sets from ``config.<norm_eps_field>`` (the norms'
        eps, and layers that keep a copy of it), so that the model in memory equals the one reloaded."""
        raise NotImplementedError(f"{self.family} has no exact norm-eps construction")

    def mixer_output_norm_eps(self, mixer: nn.Module) -> list[EpsAttribute]:
        """The eps attributes of ``mixer``'s own output norm (the per-head RMSNorm that removes the kernel scale, and
        any copy the mixer keeps): what a checkpoint whose layers keep different key widths sets per layer, eps times
        d_k/d_k'(layer), instead of the shared config eps (:func:`statereduce.core.slicing.shape_mixers`). The default:
        none (no kernel scale)."""
        return []

    def check_exact_norm_eps(self) -> None:
        """Raise a one-line ValueError if ``norm_eps="exact"`` cannot be stored for this model: the spec's
        :meth:`~statereduce.families.base.FamilySpec.exact_norm_eps_refusal`, or input and output embeddings that
        share one weight in memory."""
        reason = self.exact_norm_eps_refusal(self.model.config)
        inp = self.model.get_input_embeddings()
        out = self.model.get_output_embeddings()
        if reason is None and out is not None and out.weight is inp.weight:
            reason = ("the input and output embeddings share one weight, so scaling the residual stream would scale "
                      "the logits")
        if reason is not None:
            raise ValueError(f"norm_eps='exact' cannot be stored for this {self.family} model: {reason}; "
                             f"use norm_eps='stock' (in the workflow: prune: {{norm_eps: stock}})")

    def qualified_names(self) -> dict[int, str]:
        """{id(module): its qualified name in the model}, for the entries above."""
        return {id(m): n for n, m in self.model.named_modules()}

    # ---- recovery fine-tuning -----------------------------------------------------------------
    #: The RFT scope of the family when the config says ``scope: auto``. Hybrids (Qwen3.5) set "recurrent":
    #: only their linear-attention components train, their softmax layers and MLPs stay frozen (paper Table 4).
    rft_default_scope: ClassVar[str] = "all"

    def rft_roots(self, scope: str) -> list[tuple[str, nn.Module]]:
        """The (qualified name, module) subtrees whose modules recovery fine-tuning may train.

        ``"all"``: every decoder block and the decoder's final norm (the paper's RFT of DeltaNet / Gated
        DeltaNet). ``"recurrent"``: only the linear-attention mixers (:meth:`mixer_layers`). Embeddings and
        the LM head are never included. :mod:`statereduce.stages.rft` puts LoRA on the ``nn.Linear`` modules of
        these subtrees and trains their convolutions and norms fully.
        """
        if scope not in RFT_SCOPES:
            raise ValueError(f"unknown RFT scope {scope!r}; valid: {', '.join(RFT_SCOPES)}")
        names = {id(m): n for n, m in self.model.named_modules()}
        if scope == "recurrent":
            roots = [mixer for _, mixer in self.mixer_layers()]
        else:
            roots = list(decoder_layers(self.model))
            decoder = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model
            norms = [getattr(decoder, n, None) for n in ("norm", "norm_f")]  # fla, Qwen3.5: norm; Mamba-2: norm_f
            roots.extend(n for n in norms if isinstance(n, nn.Module))
        return [(names[id(m)], m) for m in roots]

    #: attributes of the family's depthwise conv modules that hold their channel count besides ``nn.Conv1d``'s
    #: (``in_channels``, ``out_channels``, ``groups``); pruning sets them with the sliced channels
    conv_channel_attrs: ClassVar[tuple[str, ...]] = ()

    #: names (last component) of ``nn.Linear`` modules inside :meth:`rft_roots` that get no LoRA and stay frozen
    lora_excluded: ClassVar[tuple[str, ...]] = ()

    def rft_trains_fully(self, module: nn.Module) -> bool:
        """Whether recovery fine-tuning trains ``module`` (inside :meth:`rft_roots`) fully rather than through LoRA:
        convolutions (LoRA on a depthwise conv could not be merged) and norms (a class name ending in ``Norm`` or
        ``NormGated``, as fla's and transformers' norm modules are named)."""
        return isinstance(module, nn.Conv1d) or type(module).__name__.endswith(("Norm", "NormGated"))

    def unfuse_for_lora(self) -> Callable[[], None]:
        """Make every LoRA target go through its own ``forward`` during RFT; return a function that undoes it.
        Nothing to do unless the family fuses a LoRA target into a kernel (fla's, :mod:`.fla_layers`)."""
        return lambda: None

    # ---- capture ------------------------------------------------------------------------------
    #: the module whose globals the family's layers call for the recurrence, e.g. "fla.layers.delta_net"
    layer_module: ClassVar[str]
    #: those globals (chunked prefill and one-token decode) -> the reader of (q, k) from a call's (args, kwargs)
    qk_readers: ClassVar[dict[str, QKOfCall]]

    @contextlib.contextmanager
    def capture(self, on_qk: QKCallback | None = None, on_x: XCallback | None = None) -> Iterator[None]:
        """Within the context, every forward pass calls ``on_qk(layer, q, k)`` with q, k [B,T,H,d_k]
        as they enter the kernel, and ``on_x(layer, x)`` with the q/k projection input [B,T,hidden].

        The kernel globals ``qk_readers`` of ``layer_module`` are wrapped (:func:`capture_kernel_calls`), so fused
        paths whose conv or projection modules never run are covered too."""
        module = importlib.import_module(self.layer_module)
        with capture_kernel_calls(self.mixer_layers(), module, self.qk_readers, self.projection_input, on_qk, on_x):
            yield

    # ---- recurrent state ----------------------------------------------------------------------
    #: True when fla caches this family's state as [B, HV, d_v, d_k] (kernels called with ``state_v_first``).
    cache_state_v_first: ClassVar[bool] = False

    def recurrent_states(self, cache) -> dict[int, torch.Tensor]:
        """The recurrent state of every linear-attention layer held by an fla cache, each [B, HV, d_v, d_k].

        This is the paper's memory matrix S (Sec. 2.1, d_v x d_k): the readout is ``S @ q`` and the rows of S
        lie in the span of the keys. The generic implementation reads ``cache[mixer.layer_idx]["recurrent_state"]``
        in the layout of fla's delta-rule kernels called without ``state_v_first``, [B, HV, d_k, d_v], and returns
        its transpose; a family whose layer calls its kernel with ``state_v_first=True`` (the cache then holds
        [B, HV, d_v, d_k]) sets :attr:`cache_state_v_first` and gets it as is. The
        tensors are views of the cache: clone them if they must outlive the next forward.

        Args:
            cache: the fla ``Cache`` of a forward with ``use_cache=True`` (``out.past_key_values``).
        Returns:
            {layer index: S [B, HV, d_v, d_k]} for every layer of :meth:`mixer_layers`, d_k the layer's own width
            (:meth:`mixer_key_dim`).
        Raises:
            ValueError: a layer's state is missing or not of the cache layout for the live config.
        """
        d = self.dims(self.config)
        states = {}
        for layer, mixer in self.mixer_layers():
            state = self.cached_recurrent_state(cache, getattr(mixer, "layer_idx", layer))
            v_first = self.cache_state_v_first
            d_k = self.mixer_key_dim(mixer)  # the layer's own width (per-layer-width checkpoints)
            expected = (d.num_v_heads, *((d.head_v_dim, d_k) if v_first else (d_k, d.head_v_dim)))
            if not isinstance(state, torch.Tensor) or state.dim() != 4 or state.shape[1:] != expected:
                got = tuple(state.shape) if isinstance(state, torch.Tensor) else type(state).__name__
                dims = f"d_v={d.head_v_dim}, d_k={d_k}" if v_first else f"d_k={d_k}, d_v={d.head_v_dim}"
                raise ValueError(
                    f"layer {layer}: cached recurrent state is {got}; expected [B, HV={d.num_v_heads}, {dims}] "
                    f"({self.family})"
                )
            states[layer] = state if v_first else state.transpose(-1, -2)
        return states

    def cached_recurrent_state(self, cache, layer_idx: int) -> torch.Tensor | None:
        """The raw recurrent state of layer ``layer_idx`` in ``cache`` (fla's ``cache[i]["recurrent_state"]``),
        or None when the cache holds none for it."""
        try:
            return cache[layer_idx]["recurrent_state"]
        except (KeyError, IndexError, TypeError):  # layer not in the cache, or its entry still empty
            return None

    #: the keyword through which the family's causal LM takes a cache to continue from (fla: ``past_key_values``;
    #: transformers' Mamba-2 takes ``cache`` and silently ignores ``past_key_values``)
    cache_argument: ClassVar[str] = "past_key_values"

    # ---- loading --------------------------------------------------------------------------------------------
    #: the causal-LM class that loads the family's checkpoints (a LazyImport); None: ``AutoModelForCausalLM``
    causal_lm_class: ClassVar[Any] = None

    #: the layer module's delta-rule kernel functions that :mod:`statereduce.kernels.shapes` guards on CUDA (calls at
    #: a head shape stock fla mishandles are zero-padded); empty: the family calls no such kernel of fla's
    padded_kernels: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def install_fallbacks(cls, torch_device_types: tuple[str, ...] = ("cpu",)) -> None:
        """Route the family's kernel calls on ``torch_device_types`` to PyTorch implementations (idempotent): fla's
        Triton-only functions to :mod:`statereduce.kernels.fla_fallback`. Families that need more extend it."""
        from statereduce.kernels import fla_fallback

        fla_fallback.install(torch_device_types=torch_device_types)

    @classmethod
    def backward_kernels(cls, device: str | torch.device, requested: str = "auto") -> str:
        """``"fla"`` or ``"torch"`` for a backward pass on ``device``: ``requested`` unless it is ``"auto"``, which
        picks ``"torch"`` where fla refuses the backward of a family that needs it (:attr:`fla_gated_backward`,
        :func:`statereduce.kernels.routing.fla_refuses_gated_backward`), else ``"fla"``. On CPU both mean the torch
        fallbacks (fla's kernels are Triton-only)."""
        if requested != "auto":
            return requested
        from statereduce.kernels import routing

        return "torch" if cls.fla_gated_backward and routing.fla_refuses_gated_backward(device) else "fla"

    def route_backward(self, requested: str = "auto") -> str:
        """Apply :meth:`backward_kernels` to the model: with ``"torch"`` on CUDA, the family's kernel calls on CUDA
        tensors go to the torch fallbacks too (``load_model`` routes only CPU tensors). Returns the choice."""
        device = next(self.model.parameters()).device
        kernels = self.backward_kernels(device, requested)
        if kernels == "torch" and device.type == "cuda":
            self.install_fallbacks(torch_device_types=("cpu", "cuda"))
        return kernels

    @classmethod
    def build(cls, config, dtype: torch.dtype = torch.float32) -> nn.Module:
        """A randomly initialised causal LM of ``config`` (the tiny models the workflow trains, speed runs)."""
        if cls.causal_lm_class is not None:
            return cls.causal_lm_class._from_config(config, dtype=dtype)
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(config, dtype=dtype)

    # ---- decoding with the state updated in place (statereduce.speed) --------------------------------
    @classmethod
    def decode_patches(cls, kernel: str, device_types: tuple[str, ...]) -> list[tuple[Any, str, Callable]]:
        """Patches ``(owner, attribute, make)`` that route the family's one-token recurrent calls on
        ``device_types`` to ``kernel``'s in-place step (``statereduce.speed.inplace.KERNELS``): while applied,
        ``owner.attribute`` is ``make(original)``. The default, none: the family decodes as it does."""
        return []

    @classmethod
    def fused_patches(cls, kernel: str, device_types: tuple[str, ...]) -> list[tuple[Any, str, Callable]]:
        """Patches (as :meth:`decode_patches`) that give the family's layers a leaner one-token step around
        ``kernel``'s in-place state update (``inplace_decode`` with a ``+fused`` kernel). The default: none."""
        return []

    def pack_for_decode(self) -> int:
        """Lay out the weights the fused step reads (values unchanged); the number of modules packed."""
        return 0

    def cache_tensors(self, cache) -> list[torch.Tensor]:
        """Every state tensor (recurrent and conv) of the model's decoding cache ``cache``, for static CUDA-graph
        buffers. The default reads fla's per-layer ``recurrent_state`` / ``conv_state`` entries."""
        out = []
        for i in range(len(cache)):
            layer = cache[i]
            for key in ("recurrent_state", "conv_state"):
                value = layer.get(key) if isinstance(layer, dict) else None
                for t in value if isinstance(value, (tuple, list)) else [value]:
                    if isinstance(t, torch.Tensor):
                        out.append(t)
        return out


class TransformersAdapter(LinearAttentionAdapter):
    """The part of an adapter that the families implemented in transformers share (Mamba-2, Qwen3.5): the model
    takes its cache as ``cache=`` and keeps recurrent states behind ``cache.get_recurrent_state``."""

    cache_argument = "cache"

    def cached_recurrent_state(self, cache, layer_idx: int) -> torch.Tensor | None:
        try:
            return cache.get_recurrent_state(layer_idx, state_idx=0)
        except (AttributeError, IndexError, KeyError, TypeError, ValueError):  # no such layer, or not a linear one
            return None


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The list of decoder blocks of a causal LM, a bare decoder, or a PEFT wrapper of either."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}: {type(decoder).__name__}.layers")
    return layers


class _LayerTracker:
    """Knows which tracked mixer is running, through forward pre-/post-hooks (mixers never nest)."""

    def __init__(self) -> None:
        self.current: int | None = None


@contextlib.contextmanager
def capture_kernel_calls(
    mixers: Sequence[tuple[int, nn.Module]],
    kernel_module: types.ModuleType,
    readers: Mapping[str, QKOfCall],
    x_input: Callable[[nn.Module], nn.Module],
    on_qk: QKCallback | None,
    on_x: XCallback | None,
) -> Iterator[None]:
    """Capture q/k at the recurrence kernel and x at the q projection, for the given mixers.

    Rebinds each ``kernel_module.<name>`` named in ``readers`` (the module globals a layer calls, e.g.
    ``fla.layers.gated_deltanet.chunk_gated_delta_rule``) to a wrapper around whatever object is bound
    there at enter time (fla's kernel, or a CPU dispatcher installed by ``statereduce.kernels.fla_fallback``),
    and restores that object on exit. The current layer is known through a forward pre-hook on each
    mixer, so calls from other models or untracked layers pass straight through. Hooking the kernel
    rather than the conv modules also covers fused conv paths whose conv modules never run.

    Args:
        mixers: (layer index, mixer) pairs to track.
        kernel_module: the module whose globals the mixers call.
        readers: name of each kernel global -> the function that reads (q, k) [B, T, H, d_k] from the (args,
            kwargs) of a call (``fla_qk_of_call`` for fla's functions).
        x_input: mixer -> the module whose forward input is the q/k projection input (for ``on_x``).
        on_qk, on_x: the callbacks (see ``QKCallback`` / ``XCallback``); either may be None.
    """
    tracker = _LayerTracker()
    handles = []
    originals = {name: getattr(kernel_module, name) for name in readers}
    wrappers = {name: _kernel_wrapper(fn, tracker, on_qk, readers[name]) for name, fn in originals.items()}
    try:
        for layer_idx, mixer in mixers:
            handles.append(mixer.register_forward_pre_hook(_push_hook(tracker, layer_idx)))
            handles.append(mixer.register_forward_hook(_pop_hook(tracker)))
            if on_x is not None:
                handles.append(x_input(mixer).register_forward_pre_hook(_x_hook(tracker, layer_idx, on_x)))
        for name, wrapper in wrappers.items():
            setattr(kernel_module, name, wrapper)
        yield
    finally:
        for handle in handles:
            handle.remove()
        for name, fn in originals.items():
            # leave a binding made inside the context (e.g. a later install()) alone
            if getattr(kernel_module, name) is wrappers[name]:
                setattr(kernel_module, name, fn)


def fla_qk_of_call(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) of a call of one of fla's kernel functions: the first two positional arguments, or keywords."""
    q = kwargs["q"] if "q" in kwargs else args[0]
    k = kwargs["k"] if "k" in kwargs else args[1]
    return q, k


def _kernel_wrapper(fn: Callable, tracker: _LayerTracker, on_qk: QKCallback | None, qk_of_call: QKOfCall) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        layer_idx = tracker.current
        if layer_idx is not None and on_qk is not None:
            on_qk(layer_idx, *qk_of_call(args, kwargs))
        return fn(*args, **kwargs)

    return wrapper


def _push_hook(tracker: _LayerTracker, layer_idx: int) -> Callable:
    def hook(module, args):
        tracker.current = layer_idx

    return hook


def _pop_hook(tracker: _LayerTracker) -> Callable:
    def hook(module, args, output):
        tracker.current = None

    return hook


def _x_hook(tracker: _LayerTracker, layer_idx: int, on_x: XCallback) -> Callable:
    def hook(module, args):
        # only while the owning mixer runs (the projection module is not shared, but be explicit)
        if tracker.current == layer_idx:
            on_x(layer_idx, args[0])

    return hook
