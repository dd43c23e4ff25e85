"""The adapter interface: every model-family difference lives behind it.

An adapter wraps one loaded causal-LM. It is composed of its family's parts: the spec's config facts (each adapter
subclasses its :class:`~statereduce.families.base.FamilySpec`: ``dims``, ``reduced_config``, ``mixer_layer_indices``,
``config_state_shape``, ``arch_dims``, ...; torch-free, so the workflow validates a run before any weights are
loaded), one :class:`~statereduce.adapters.MixerLayout` per linear-attention mixer (where its key/query
channels live: rows of separate or fused projections and depthwise convolutions, its key width, its output norm's
eps) and the model's :class:`~statereduce.adapters.ExactNorms` (what ``norm_eps="exact"`` scales and sets).
The adapter itself finds the mixers, captures K and Q as they enter the recurrence, reads the recurrent states, and
says which class loads the family's checkpoints and which PyTorch fallbacks run it on CPU. Nothing outside
``statereduce/adapters`` may branch on ``model_type``; what fine-tuning trains (:mod:`statereduce.stages.rft`) and
how decoding is routed in place (:mod:`statereduce.speed`) are registered per family there. Adapters are pure
mapping: the slicing itself is done by :mod:`statereduce.core.slicing` and :mod:`statereduce.stages.prune`, driven by
the rows and sizes the layouts hand out. Adapter modules import fla only inside the methods that use it.

To add a family: write its spec in ``families/<family>.py`` (``@register_family``, imported in
``families/__init__.py``), then ``adapters/<family>.py`` with its ``MixerLayout`` (and ``ExactNorms`` where its kernels
scale q.k by 1/sqrt(d_k)) and a subclass of the spec and of :class:`LinearAttentionAdapter` decorated with
``@register_adapter``, import it in ``adapters/__init__.py``, and add a subclass of the contract test class in
``tests/test_adapters.py``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types
from abc import abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from statereduce.adapters.mixer_layout import (  # noqa: F401  (re-exported)
    EPS_ATTRIBUTES, ChannelRows, EpsAttribute, ExactNorms, MixerLayout, ScaledRows, WeightRows, head_major_rows,
)
from statereduce.families.base import (  # noqa: F401  (re-exported)
    Dims, FamilySpec, LazyImport, StateShape, attach_adapter, family_names, family_spec, registered,
)
from statereduce.kernels import fla_fallback, routing
from statereduce.kernels.check import BACKWARD, Route


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
# Reads (q, k) [B, T, H, d_k] from the (args, kwargs) of one call of a family's kernel function.
QKOfCall = Callable[[tuple, dict], tuple[torch.Tensor, torch.Tensor]]
# An input callback receives (layer_idx, x) with x [B, T, hidden], the input of the q/k projections.
XCallback = Callable[[int, torch.Tensor], None]
#: ``on_v(layer, v)``: the values [B, T, HV, d_v] as they enter the recurrence.
VCallback = Callable[[int, torch.Tensor], None]
#: Reads the values [B, T, HV, d_v] from the (args, kwargs) of a kernel call.
VOfCall = Callable[[tuple, dict], torch.Tensor]


class LinearAttentionAdapter(FamilySpec):
    """Structural facts about one family's loaded models; the config facts come from its
    :class:`~statereduce.families.base.FamilySpec`, which each adapter subclasses, and each mixer's from its
    :attr:`mixer_layout`."""

    #: the family's :class:`~statereduce.adapters.MixerLayout` (one per linear-attention mixer)
    mixer_layout: ClassVar[type[MixerLayout]]
    #: the family's :class:`~statereduce.adapters.ExactNorms` (``norm_eps="exact"``); the base class refuses
    exact_norms: ClassVar[type[ExactNorms]] = ExactNorms

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

    def layouts(self) -> list[MixerLayout]:
        """The :class:`~statereduce.adapters.MixerLayout` of every mixer of :meth:`mixer_layers`, in order."""
        return [self.mixer_layout(self, layer, mixer) for layer, mixer in self.mixer_layers()]

    def layout(self, mixer: nn.Module) -> MixerLayout:
        """The :class:`~statereduce.adapters.MixerLayout` of one mixer of :meth:`mixer_layers`."""
        for layer, m in self.mixer_layers():
            if m is mixer:
                return self.mixer_layout(self, layer, mixer)
        raise ValueError(f"{type(mixer).__name__} is not a linear-attention mixer of this {self.family} model")

    def norms(self) -> ExactNorms:
        """What ``norm_eps="exact"`` scales and sets in the model (:class:`~statereduce.adapters.ExactNorms`)."""
        return self.exact_norms(self)

    @property
    def num_heads(self) -> int:
        """Number of q/k heads H."""
        return self.dims(self.config).num_heads

    @property
    def head_k_dim(self) -> int:
        """d_k of each q/k head (the config's; a per-layer-width checkpoint's layers keep their own,
        :meth:`layer_key_dims`)."""
        return self.dims(self.config).head_k_dim

    def layer_key_dims(self) -> dict[int, int]:
        """{layer: d_k'} of every linear-attention layer, read from the live mixers."""
        return {layout.layer: layout.key_dim for layout in self.layouts()}

    def layer_state_shapes(self) -> dict[int, StateShape]:
        """{layer: per-sequence recurrent/conv state shape} of every linear-attention layer at its own key width
        (:meth:`layer_key_dims`; :meth:`~statereduce.families.base.FamilySpec.width_state_shape`) and its own value
        width (the live mixer's, which a value cut changes)."""
        widths = self.layer_key_dims()
        shapes = {w: self.width_state_shape(self.config, w) for w in set(widths.values())}
        out = {}
        for layout in self.layouts():
            shape = shapes[widths[layout.layer]]
            out[layout.layer] = shape.with_value_dim(layout.value_dim)
        return out

    def state_shape(self) -> StateShape:
        """The per-layer, per-sequence recurrent/conv state shape that every linear-attention layer has.

        Raises:
            ValueError: the layers keep different key widths (:meth:`layer_state_shapes` has each one's).
        """
        shapes = set(self.layer_state_shapes().values())
        if len(shapes) > 1:
            raise ValueError(f"the layers keep different key widths {self.layer_key_dims()}; use layer_state_shapes()")
        return shapes.pop() if shapes else self.config_state_shape(self.config)

    def state_bytes(self, dtype_bytes: int = 4) -> int:
        """Recurrent state bytes per sequence over all linear-attention layers, each at its own key width (fp32 state
        by default)."""
        return sum(s.recurrent_elems for s in self.layer_state_shapes().values()) * int(dtype_bytes)

    # ---- capture ------------------------------------------------------------------------------
    #: the module whose globals the family's layers call for the recurrence, e.g. "fla.layers.delta_net"
    layer_module: ClassVar[str]
    #: those globals (chunked prefill and one-token decode) -> the reader of (q, k) from a call's (args, kwargs)
    qk_readers: ClassVar[dict[str, QKOfCall]]
    #: the same globals -> the reader of the values v [B, T, HV, d_v] from a call's (args, kwargs)
    v_readers: ClassVar[dict[str, VOfCall]] = {}

    @contextlib.contextmanager
    def capture(self, on_qk: QKCallback | None = None, on_x: XCallback | None = None,
                on_v: VCallback | None = None) -> Iterator[None]:
        """Within the context, every forward pass calls ``on_qk(layer, q, k)`` with q, k [B,T,H,d_k]
        as they enter the kernel, ``on_v(layer, v)`` with the values v [B,T,HV,d_v] there (``v_readers``), and
        ``on_x(layer, x)`` with the q/k projection input [B,T,hidden].

        The kernel globals ``qk_readers`` of ``layer_module`` are wrapped (:func:`capture_kernel_calls`), so fused
        paths whose conv or projection modules never run are covered too."""
        module = importlib.import_module(self.layer_module)
        inputs = {id(layout.mixer): layout.projection_input() for layout in self.layouts()}
        with capture_kernel_calls(self.mixer_layers(), module, self.qk_readers, lambda m: inputs[id(m)], on_qk, on_x,
                                  self.v_readers, on_v):
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
            {layer index: S [B, HV, d_v, d_k]} for every layer of :meth:`mixer_layers`, d_k and d_v the layer's own
            widths (:attr:`MixerLayout.key_dim <statereduce.adapters.mixer_layout.MixerLayout.key_dim>`, ``value_dim``).
        Raises:
            ValueError: a layer's state is missing or not of the cache layout for the live config.
        """
        d = self.dims(self.config)
        states = {}
        for layout in self.layouts():
            layer = layout.layer
            state = self.cached_recurrent_state(cache, getattr(layout.mixer, "layer_idx", layer))
            v_first = self.cache_state_v_first
            d_k, d_v = layout.key_dim, layout.value_dim  # the layer's own widths (per-layer widths, value cuts)
            expected = (d.num_v_heads, *((d_v, d_k) if v_first else (d_k, d_v)))
            if not isinstance(state, torch.Tensor) or state.dim() != 4 or state.shape[1:] != expected:
                got = tuple(state.shape) if isinstance(state, torch.Tensor) else type(state).__name__
                dims = f"d_v={d_v}, d_k={d_k}" if v_first else f"d_k={d_k}, d_v={d_v}"
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

    #: the layer module's kernel functions that the run-time check (:mod:`statereduce.kernels.check`) compares on CUDA
    #: with their PyTorch reference: name -> the reference's name in :mod:`statereduce.kernels.fla_fallback`
    checked_kernels: ClassVar[Mapping[str, str]] = {}
    #: the keyword flags the family's layers pass to those kernels (the check calls them so)
    kernel_flags: ClassVar[Mapping[str, bool]] = {}

    def kernel_routes(self, backward: bool = False) -> list:
        """The kernel routes a job on this model uses (:class:`statereduce.kernels.check.Route`): each of
        :attr:`checked_kernels` at each head shape of the model's linear-attention layers (q/k heads, value heads,
        each layer's key and value widths), in the forward and, with ``backward``, in the backward of the kernels a
        training step differentiates (:data:`~statereduce.kernels.check.BACKWARD`)."""
        shapes = sorted({(self.num_heads, s.num_heads, s.d_k, s.d_v) for s in self.layer_state_shapes().values()})
        setup = f"{type(self).__module__}:{type(self).__qualname__}"
        flags = tuple(sorted(self.kernel_flags.items()))
        return [Route(self.layer_module, kernel, reference, pass_, *shape, flags=flags, setup=setup)
                for kernel, reference in self.checked_kernels.items()
                for pass_ in (("forward", "backward") if backward and reference in BACKWARD else ("forward",))
                for shape in shapes]

    @classmethod
    def install_fallbacks(cls, torch_device_types: tuple[str, ...] = ("cpu",)) -> None:
        """Route the family's kernel calls on ``torch_device_types`` to PyTorch implementations (idempotent): fla's
        Triton-only functions to :mod:`statereduce.kernels.fla_fallback`. Families that need more extend it; a family
        that runs no fla code (:attr:`uses_fla`) has nothing to route, and fla is not imported."""
        if not cls.uses_fla:
            return

        fla_fallback.install(torch_device_types=torch_device_types)

    @classmethod
    def backward_kernels(cls, device: str | torch.device, requested: str = "auto") -> str:
        """``"fla"`` or ``"torch"`` for a backward pass on ``device``: ``requested`` unless it is ``"auto"``, which
        picks ``"torch"`` where fla refuses the backward of a family that needs it (:attr:`fla_gated_backward`,
        :func:`statereduce.kernels.routing.fla_refuses_gated_backward`), else ``"fla"``. On CPU both mean the torch
        fallbacks (fla's kernels are Triton-only)."""
        if requested != "auto":
            return requested

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
    v_readers: Mapping[str, VOfCall] | None = None,
    on_v: VCallback | None = None,
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
        v_readers, on_v: the reader of the values of each kernel global and their callback (``VCallback``);
            ``on_v`` needs a reader for every global of ``readers``.
    """
    tracker = _LayerTracker()
    handles = []
    originals = {name: getattr(kernel_module, name) for name in readers}
    if on_v is not None and set(readers) - set(v_readers or {}):
        raise ValueError(f"no value reader for the kernels {sorted(set(readers) - set(v_readers or {}))}")
    wrappers = {name: _kernel_wrapper(fn, tracker, on_qk, readers[name], on_v, (v_readers or {}).get(name))
                for name, fn in originals.items()}
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


def fla_v_of_call(args: tuple, kwargs: dict) -> torch.Tensor:
    """v of a call of one of fla's kernel functions: the third positional argument, or the keyword."""
    return kwargs["v"] if "v" in kwargs else args[2]


def _kernel_wrapper(fn: Callable, tracker: _LayerTracker, on_qk: QKCallback | None, qk_of_call: QKOfCall,
                    on_v: VCallback | None = None, v_of_call: VOfCall | None = None) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        layer_idx = tracker.current
        if layer_idx is not None and on_qk is not None:
            on_qk(layer_idx, *qk_of_call(args, kwargs))
        if layer_idx is not None and on_v is not None:
            on_v(layer_idx, v_of_call(args, kwargs))
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
