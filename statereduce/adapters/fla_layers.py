"""The fused one-token decode step of the stock fla layers (DeltaNet and Gated DeltaNet), shared by their adapters.

At batch 64 a 1.3B DeltaNet's graph-replayed decode step spends about 2.2 ms outside the recurrent state update
(docs/speed.md): per layer the stock layer launches three or four narrow projections (q, k, v, beta; Gated
DeltaNet also a and the output gate), three short-convolution updates, a sigmoid and two L2 norms, and its MLP two
more projections. A projection with 2048 outputs at 64 rows fills a fraction of an H200's SMs, and each small
kernel costs a few microseconds whatever its size. That fixed part does not shrink with the state, so it caps the
speedup that state reduction can show.

Under :func:`fused_patches` the decode calls (one token, a cache, no mask, no autograd) of the adapter's fla layer
run (what differs by family, the projections after q, k, v and g and the recurrent step, comes from the adapter:
``mixer_class``, ``block_class``, ``fused_decode_rows``, ``fused_conv_extra``, ``fused_conv_l2norm``,
``fused_recurrent_step``):

1. one projection ``x @ [W_q; W_k; W_v; (W_g); (W_a); W_b]^T`` (the weights packed once into one tensor, padded
   with zero rows to an aligned width, the stock ``nn.Linear`` parameters rebound as views of it, so values and the
   stock forward are unchanged);
2. one launch of :func:`statereduce.kernels.conv.conv_step`, the three short-convolution updates (and SiLU) over
   the q, k and v channels of that output, each reading and writing its own cache tensor in place (fla's cache
   layout is kept); for the fla kernels it writes q, k and v as three contiguous tensors (fla's functions would
   copy views) and, where the adapter asks, more of the row (DeltaNet's beta through its sigmoid);
3. the recurrent step on views into those rows (the adapter's ``fused_recurrent_step``);
4. the stock output norm (gated by the packed projection's gate slice) and output projection;

each fla ``GatedMLP`` with SwiGLU computes gate and up with one packed projection, and the decoder block adds its
residual in the down projection (``addmm``) instead of a separate add. Layer configurations the fused step does
not cover (no short convolution, other activations or q/k norms) run the stock forward. The result equals the
stock step up to rounding (beta's sigmoid is taken in float32 in the kernel, fla rounds it to the input dtype
first), checked against fla's own decoding in tests and before every timed GPU run.

The module also holds :class:`FlaAdapter`, what the adapters of fla's linear-attention families share (slot names,
capture at the kernel functions, the in-place routing of the one-token recurrent function).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from statereduce.adapters.base import (
    ChannelRows,
    EpsAttribute,
    LinearAttentionAdapter,
    ScaledRows,
    decoder_layers,
    head_major_rows,
)

Patch = tuple[Any, str, Callable[[Any], Any]]
"""``(owner, attribute, make)``: while a patch is applied, ``owner.attribute`` is ``make(original)``."""


class FlaAdapter(LinearAttentionAdapter):
    """The part of an adapter that every fla linear-attention family shares: the layer module's slot names
    (``q_proj``, ``k_proj``, ``q_conv1d``, ``k_conv1d``), mixers found as ``block.attn`` of ``mixer_class``
    (softmax-attention layers of fla hybrids are skipped), q and k captured where they enter the layer module's
    kernel functions, and decoding routed through the layer module's one-token recurrent function."""

    recurrent_function: ClassVar[str]  # layer_module's one-token recurrent function, routed by decode_patches
    conv_channel_attrs = ("hidden_size",)  # fla's ShortConvolution keeps its channel count there too

    def unfuse_for_lora(self) -> Callable[[], None]:
        """Make every LoRA target go through its own ``forward`` during RFT; return a function that undoes it.

        fla's ``GatedMLP`` with ``fuse_swiglu`` (the default) hands ``down_proj.weight`` straight to a fused
        SwiGLU-linear kernel, so a LoRA wrapper on ``down_proj`` would never run (and its merge would add
        an update that training never saw). Unfused, the MLP computes the same ``down_proj(swiglu(g, u))``.
        """
        touched = [m for m in self.model.modules() if getattr(m, "fuse_swiglu", False) and hasattr(m, "down_proj")]
        for m in touched:
            m.fuse_swiglu = False

        def undo() -> None:
            for m in touched:
                m.fuse_swiglu = True

        return undo

    # ---- facts the fused one-token step (below) reads -----------------------------------------------------
    #: the family's fla layer class (a LazyImport) whose one-token decode the fused step may take over; None: none
    mixer_class: ClassVar[Any] = None
    block_class: ClassVar[Any] = None
    """The fla decoder block holding ``mixer_class`` (the fused decode step also takes over its one-token forward)."""

    @classmethod
    def fused_decode_rows(cls, layer: nn.Module) -> list[str] | None:
        """The layer's projections that follow q, k, v (and the output gate g) in the fused step's packed projection,
        in order, or None when the fused step does not cover the layer's configuration (the default)."""
        return None

    @classmethod
    def fused_conv_extra(cls, layer: nn.Module, kernel: str) -> tuple[int, str | None] | None:
        """For fla's kernels: the first ``E`` columns of the tail that the fused step's conv launch should write
        contiguous, and through which ``statereduce.kernels.conv.EXTRA_ACTIVATIONS`` entry; None: none."""
        return None

    @classmethod
    def fused_conv_l2norm(cls, layer: nn.Module, kernel: str) -> int | None:
        """For fla's kernels: the head size over which the fused step's conv launch should L2-normalise q and k
        (``statereduce.kernels.conv.conv_step``'s ``l2norm``), for a function that would normalise them in launches
        of its own; None: the conv leaves them as they are (the default)."""
        return None

    @classmethod
    def fused_recurrent_step(cls, layer: nn.Module, kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             tail: torch.Tensor, state: torch.Tensor,
                             extra: torch.Tensor | None = None) -> torch.Tensor:
        """One token's recurrent step of ``layer`` with ``kernel`` (``statereduce.speed.inplace.KERNELS``), ``state``
        updated in place; q, k ``[N, 1, H, d_k]`` and v ``[N, 1, HV, d_v]`` are views into the convolved rows,
        ``tail`` the packed projection's columns of :meth:`fused_decode_rows`, ``extra`` the conv launch's output for
        :meth:`fused_conv_extra`; q and k come L2-normalised where :meth:`fused_conv_l2norm` asked for it. Returns o
        ``[N, 1, HV, d_v]``."""
        raise NotImplementedError(f"{cls.family} has no fused decode step")


    @classmethod
    def install_fallbacks(cls, torch_device_types: tuple[str, ...] = ("cpu",)) -> None:
        """The torch fallbacks (base class), then the shape guard on the layer module's kernels
        (:data:`padded_kernels`): CUDA calls at a head shape stock fla mishandles go through a zero-padded call."""
        super().install_fallbacks(torch_device_types)
        from statereduce.kernels import shapes

        shapes.install(cls.layer_module, cls.padded_kernels)

    def mixer_layers(self) -> list[tuple[int, nn.Module]]:
        mixer = self.mixer_class
        return [(i, block.attn) for i, block in enumerate(decoder_layers(self.model)) if isinstance(block.attn, mixer)]

    def q_proj(self, mixer: nn.Module) -> nn.Linear:
        """The query projection, [H * d_k, hidden], head h in rows h*d_k .. (h+1)*d_k."""
        return mixer.q_proj

    def k_proj(self, mixer: nn.Module) -> nn.Linear:
        """The key projection, same layout as :meth:`q_proj`."""
        return mixer.k_proj

    def q_conv(self, mixer: nn.Module) -> nn.Conv1d | None:
        """The depthwise short conv on queries ([H * d_k, 1, W], same channel order), or None."""
        return mixer.q_conv1d if mixer.use_short_conv else None

    def k_conv(self, mixer: nn.Module) -> nn.Conv1d | None:
        """The depthwise short conv on keys, or None."""
        return mixer.k_conv1d if mixer.use_short_conv else None

    def channel_rows(self, mixer: nn.Module) -> list[ChannelRows]:
        rows = head_major_rows(self.num_heads, self.mixer_key_dim(mixer))
        out = [ChannelRows("q_proj", self.q_proj(mixer), rows, None),
               ChannelRows("k_proj", self.k_proj(mixer), None, rows)]
        if mixer.use_short_conv:
            out += [ChannelRows("q_conv1d", mixer.q_conv1d, rows, None),
                    ChannelRows("k_conv1d", mixer.k_conv1d, None, rows)]
        return out

    def projection_input(self, mixer: nn.Module) -> nn.Module:
        return mixer.q_proj

    # ---- exact zero-masking through the norm eps (LinearAttentionAdapter) ----------------------------------
    def residual_writers(self) -> list[ScaledRows]:
        """``embeddings``; per block (``DeltaNetBlock`` / ``GatedDeltaNetBlock``, whose forward is ``h + attn(
        attn_norm(h))`` then ``h + mlp(mlp_norm(h))``) the mixer's ``o_proj`` (or, in an fla hybrid's softmax layer,
        ``Attention.o_proj``) and the ``GatedMLP``'s ``down_proj``; none of them has a bias in fla 0.6."""
        names = self.qualified_names()
        modules = [self.model.get_input_embeddings()]
        for block in decoder_layers(self.model):
            modules += [block.attn.o_proj, block.mlp.down_proj]
        return [ScaledRows(names[id(m)], m) for m in modules]

    def mixer_output_norm_eps(self, mixer: nn.Module) -> list[EpsAttribute]:
        """``eps`` of the mixer's ``o_norm``."""
        return [EpsAttribute(self.qualified_names()[id(mixer.o_norm)], mixer.o_norm, "eps")]

    def config_eps_attributes(self) -> list[EpsAttribute]:
        """``eps`` of each block's ``attn_norm`` and ``mlp_norm``, of each linear-attention mixer's ``o_norm`` (fla's
        ``RMSNorm`` / ``FusedRMSNormGated``) and of the final ``norm`` (fla's or torch's ``RMSNorm`` by
        ``fuse_norm``). fla's softmax ``Attention`` takes no eps from the config."""
        names = self.qualified_names()
        mixers = {id(m) for _, m in self.mixer_layers()}
        modules = []
        for block in decoder_layers(self.model):
            modules += [block.attn_norm, block.mlp_norm] + ([block.attn.o_norm] if id(block.attn) in mixers else [])
        modules.append(self.model.get_decoder().norm)
        return [EpsAttribute(names[id(m)], m, "eps") for m in modules]

    def conv_sharing(self, mixer: nn.Module) -> str:
        """How ``mixer``'s ``q_conv1d`` / ``k_conv1d`` filters are shared: "head" (equal within each head), "all"
        (equal across the layer) or "none" (paper App. B.5, Table 14; :mod:`statereduce.adapters.conv_sharing`)."""
        from statereduce.adapters.conv_sharing import conv_sharing

        return conv_sharing(mixer, self.num_heads, self.mixer_key_dim(mixer))

    @classmethod
    def inplace_recurrent(cls, original: Callable, kernel: str, device_types: tuple[str, ...]) -> Callable:
        """``original`` (the layer module's one-token recurrent function) with its decode calls routed to
        ``kernel``'s in-place step."""
        raise NotImplementedError(f"{cls.family} does not route its decode calls")

    @classmethod
    def decode_patches(cls, kernel: str, device_types: tuple[str, ...]) -> list[Patch]:
        return [decode_patch(cls.layer_module, cls.recurrent_function,
                             lambda original: cls.inplace_recurrent(original, kernel, device_types))]

    @classmethod
    def fused_patches(cls, kernel: str, device_types: tuple[str, ...]) -> list[Patch]:
        return fused_patches(cls, kernel, device_types)

    def pack_for_decode(self) -> int:
        return pack_for_decode(type(self), self.model)


def one_token_call(q, initial_state, cu_seqlens, device_types: tuple[str, ...]) -> bool:
    """Whether a call of one of fla's recurrent functions is a routable decode step: one token, a contiguous float32
    initial state, no ``cu_seqlens``, no autograd, on one of ``device_types``."""
    return (q.shape[1] == 1 and initial_state is not None and cu_seqlens is None and q.device.type in device_types
            and initial_state.is_contiguous() and initial_state.dtype == torch.float32
            and not torch.is_grad_enabled())


def decode_patch(module_name: str, attr: str, wrapper: Callable[..., Callable]) -> Patch:
    """The patch that replaces fla layer module ``module_name``'s ``attr`` (the recurrent function the layer
    calls) by ``wrapper(original)``."""
    return importlib.import_module(module_name), attr, wrapper


# ---------------------------------------------------------------------------------------------
# packed weights
# ---------------------------------------------------------------------------------------------
def _pack(module: nn.Module, key: str, params: list[tuple[nn.Module, str]], align: int = 1) -> torch.Tensor:
    """One tensor holding ``params`` (stacked along dim 0), each rebound as a view of it; reused while valid.

    ``align``: zero rows are appended up to a multiple of it. A projection whose output width is not a multiple of
    8 has rows that are not 16-byte aligned, and cuBLAS then falls back to a slow kernel (seen on the H200: a
    Gated DeltaNet q|k|v|g|a|b projection of 9228 outputs ran on an ``align2`` CUTLASS kernel at 1.8 TB/s).
    """
    packed = getattr(module, "_statereduce_packed", {}).get(key)
    tensors = [getattr(m, name) for m, name in params]
    rows = sum(t.shape[0] for t in tensors)
    if packed is not None:
        offset, ok = 0, True
        for t in tensors:
            ok = ok and t.data_ptr() == packed[offset:].data_ptr() and t.is_contiguous()
            offset += t.shape[0]
        if ok and packed.shape[0] == -(-rows // align) * align:
            return packed
    # ordinary tensors even when called under inference_mode (a Parameter cannot wrap an inference tensor)
    with torch.inference_mode(False), torch.no_grad():
        pad = -rows % align
        tail = [tensors[0].new_zeros(pad, *tensors[0].shape[1:])] if pad else []
        packed = torch.cat([t.detach() for t in tensors] + tail, 0)
        offset = 0
        for (m, name), t in zip(params, tensors):
            view = packed[offset:offset + t.shape[0]]
            setattr(m, name, nn.Parameter(view, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter)
                    else view)
            offset += t.shape[0]
    if not hasattr(module, "_statereduce_packed"):
        module._statereduce_packed = {}
    module._statereduce_packed[key] = packed
    return packed


PROJ_ALIGN = 64
"""The packed projection's output width is padded (zero rows) to a multiple of this."""


def mixer_plan(adapter, layer: nn.Module) -> dict[str, Any] | None:
    """How ``adapter``'s fla linear-attention layer's decode step is fused (the packed projection's rows), or None
    to keep the stock step. What differs between the fla families (the rows after q, k, v and g, the recurrent
    step) comes from the family's adapter."""
    if type(layer) is not adapter.mixer_class or not getattr(layer, "use_short_conv", False):
        return None
    convs = (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d)
    if any(getattr(c, "activation", None) not in ("silu", "swish") for c in convs):
        return None
    if len({c.kernel_size[0] for c in convs}) != 1 or len({c.bias is None for c in convs}) != 1:
        return None
    tail = adapter.fused_decode_rows(layer)
    if tail is None:
        return None
    return {"adapter": adapter, "rows": ["q_proj", "k_proj", "v_proj"] + (["g_proj"] if layer.use_gate else []) + tail}


def pack_for_decode(adapter, model: nn.Module) -> int:
    """Pack the weights the fused step reads (each of ``adapter``'s mixers' projections and conv filters, each SwiGLU
    MLP's gate and up) into one tensor per group, rebinding the stock parameters as views (values unchanged).
    Returns the number of modules packed."""
    count = 0
    for module in model.modules():
        plan = mixer_plan(adapter, module)
        if plan is not None:
            _pack(module, "proj", [(getattr(module, r), "weight") for r in plan["rows"]], PROJ_ALIGN)
            _pack(module, "conv", [(c, "weight") for c in (module.q_conv1d, module.k_conv1d, module.v_conv1d)])
            if module.q_conv1d.bias is not None:
                _pack(module, "conv_bias", [(c, "bias") for c in (module.q_conv1d, module.k_conv1d, module.v_conv1d)])
            count += 1
        elif _mlp_fusable(module):
            _pack(module, "gate_up", [(module.gate_proj, "weight"), (module.up_proj, "weight")])
            count += 1
    return count


# ---------------------------------------------------------------------------------------------
# fused forwards
# ---------------------------------------------------------------------------------------------
def _mlp_fusable(module: nn.Module) -> bool:
    return (type(module) is importlib.import_module("fla.modules.mlp").GatedMLP
            and getattr(module, "hidden_act", None) == "swish"
            and module.gate_proj.bias is None and module.up_proj.bias is None)


def _one_token(x: torch.Tensor, device_types: tuple[str, ...]) -> bool:
    return x.dim() == 3 and x.shape[1] == 1 and x.device.type in device_types and not torch.is_grad_enabled()


def _mixer_forward(adapter, original, kernel: str, device_types: tuple[str, ...]):
    from fla.layers.utils import get_layer_cache, update_layer_cache

    from statereduce.kernels import conv  # triton: imported when a model is patched, not with the adapters

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, use_cache=False,
                output_attentions=False, **kwargs):
        plan = mixer_plan(adapter, self)
        last = get_layer_cache(self, past_key_values) if past_key_values is not None else None
        if (plan is None or last is None or not use_cache or attention_mask is not None or kwargs.get("cu_seqlens")
                is not None or not _one_token(hidden_states, device_types)
                or last.get("recurrent_state") is None or last.get("conv_state") is None):
            return original(self, hidden_states, attention_mask, past_key_values, use_cache, output_attentions,
                            **kwargs)
        n = hidden_states.shape[0]
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        weight = _pack(self, "proj", [(getattr(self, r), "weight") for r in plan["rows"]], PROJ_ALIGN)
        conv_w = _pack(self, "conv", [(c, "weight") for c in convs])
        conv_b = _pack(self, "conv_bias", [(c, "bias") for c in convs]) if self.q_conv1d.bias is not None else None
        y = F.linear(hidden_states, weight)  # [N, 1, q | k | v | (g) | the adapter's rows]
        ck, cv, dk, dv = self.key_dim, self.value_dim, self.head_k_dim, self.head_v_dim
        at = 2 * ck + cv
        gate = y[..., at:at + cv].unflatten(-1, (cv // dv, dv)) if self.use_gate else None
        tail = y[..., at + (cv if self.use_gate else 0):]
        # PDL only before our recurrent kernel, which loads its state while the conv runs. fla's functions take q, k
        # and v contiguous (they would copy views into one row), and the adapter may have the same launch write
        # more of the tail's columns for them and normalise q and k (DeltaNet: beta's sigmoid, the L2 norms)
        ours = kernel == "statereduce"
        spec = None if ours else plan["adapter"].fused_conv_extra(self, kernel)
        out = conv.conv_step(y[..., :2 * ck + cv], tuple(last["conv_state"]), conv_w, conv_b, self.q_conv1d.activation,
                        pdl=ours, separate=not ours, extra=tail[..., :spec[0]] if spec else None,
                        extra_act=spec[1] if spec else None,
                        l2norm=None if ours else plan["adapter"].fused_conv_l2norm(self, kernel))
        q, k, v = (out[..., :ck], out[..., ck:2 * ck], out[..., 2 * ck:]) if ours else out[:3]
        q, k, v = q.unflatten(-1, (ck // dk, dk)), k.unflatten(-1, (ck // dk, dk)), v.unflatten(-1, (cv // dv, dv))
        state = last["recurrent_state"]
        o = plan["adapter"].fused_recurrent_step(self, kernel, q, k, v, tail, state,
                                                 extra=out[3] if spec else None)
        update_layer_cache(self, past_key_values, recurrent_state=state, conv_state=last["conv_state"], offset=1)
        o = self.o_norm(o, gate) if gate is not None else self.o_norm(o)
        return self.o_proj(o.reshape(n, 1, cv)), None, past_key_values

    return forward


def _gate_up_swiglu(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a SwiGLU MLP with gate and up computed by one packed projection."""
    width = mlp.gate_proj.weight.shape[0]
    gate_up = F.linear(x, _pack(mlp, "gate_up", [(mlp.gate_proj, "weight"), (mlp.up_proj, "weight")]))
    return sys.modules["fla.modules.mlp"].swiglu(gate_up[..., :width], gate_up[..., width:])


def _mlp_forward(original, device_types: tuple[str, ...]):
    def forward(self, x, **kwargs):
        if not (_mlp_fusable(self) and _one_token(x, device_types)):
            return original(self, x, **kwargs)
        return self.down_proj(_gate_up_swiglu(self, x))

    return forward


def _block_forward(original, device_types: tuple[str, ...]):
    """A decoder block's one-token step with the residual added by the MLP's down projection (``addmm_`` into the
    residual sum: one launch fewer per layer than the stock ``residual + mlp(x)``); other calls take the stock
    forward."""
    def forward(self, hidden_states, *args, **kwargs):
        mlp = getattr(self, "mlp", None)
        if (args or getattr(self, "use_attnres", False) or not getattr(self.config, "fuse_norm", False)
                or mlp is None or not _mlp_fusable(mlp) or mlp.down_proj.bias is not None
                or not kwargs.get("use_cache") or kwargs.get("past_key_values") is None
                or kwargs.get("attention_mask") is not None or not _one_token(hidden_states, device_types)):
            return original(self, hidden_states, *args, **kwargs)
        attnres_states = kwargs.pop("attnres_states", None)
        residual = hidden_states
        h, attentions, past_key_values = self.attn(hidden_states=self.attn_norm(hidden_states), **kwargs)
        h, residual = self.mlp_norm(h, residual=residual, prenorm=True)
        a = _gate_up_swiglu(mlp, h)
        a = a.reshape(-1, a.shape[-1])
        r, w = residual.reshape(-1, residual.shape[-1]), mlp.down_proj.weight.t()
        # into the norm's new residual sum where nothing else reads it: an addmm into a new tensor first copies
        # the residual there (a memcpy launch per layer)
        fresh = not r.requires_grad and r.data_ptr() != hidden_states.data_ptr()
        out = r.addmm_(a, w) if fresh else torch.addmm(r, a, w)
        return out.view(residual.shape), attentions, past_key_values, attnres_states

    return forward


def fused_patches(adapter, kernel: str, device_types: tuple[str, ...]) -> list[Patch]:
    """The class patches that give ``adapter``'s fla layer, its decoder block and fla's SwiGLU MLP the fused
    one-token step (module docstring), with ``kernel``'s in-place recurrent step."""
    patches: list[Patch] = [(adapter.mixer_class, "forward",
                             lambda f: _mixer_forward(adapter, f, kernel, device_types))]
    if adapter.block_class is not None:
        patches.append((adapter.block_class, "forward", lambda f: _block_forward(f, device_types)))
    patches.append((importlib.import_module("fla.modules.mlp").GatedMLP, "forward",
                    lambda f: _mlp_forward(f, device_types)))
    return patches
