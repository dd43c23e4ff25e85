"""The decode routes of fla's DeltaNet and Gated DeltaNet: their one-token recurrent calls in place, and the fused
one-token step of their stock layers.

At batch 64 a 1.3B DeltaNet's graph-replayed decode step spends about 2.2 ms outside the recurrent state update
(docs/speed.md): per layer the stock layer launches three or four narrow projections (q, k, v, beta; Gated
DeltaNet also a and the output gate), three short-convolution updates, a sigmoid and two L2 norms, and its MLP two
more projections. A projection with 2048 outputs at 64 rows fills a fraction of an H200's SMs, and each small
kernel costs a few microseconds whatever its size. That fixed part does not shrink with the state, so it caps the
speedup that state reduction can show.

Under :func:`fused_patches` the decode calls (one token, a cache, no mask, no autograd) of the adapter's fla layer
run (what differs by family, the projections after q, k, v and g and the recurrent step, comes from the family's
route, :class:`DeltaNetRoute` or :class:`GatedDeltaNetRoute`: ``block_class``, ``fused_decode_rows``,
``fused_conv_extra``, ``fused_conv_l2norm``, ``fused_recurrent_step``):

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

Without ``+fused`` (:meth:`FlaRoute.patches`) only the layer module's one-token recurrent function is routed to the
in-place step (:mod:`statereduce.speed.inplace`).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from statereduce.adapters.base import LazyImport, adapter_class
from statereduce.kernels import conv
from statereduce.kernels.recurrent import fla_delta_rule_step, fla_gated_delta_rule_step, recurrent_step
from statereduce.speed.routes import DecodeRoute, Patch, register_route


class FlaRoute(DecodeRoute):
    """The decode route of an fla linear-attention family: its layer module's one-token recurrent function routed to
    the in-place step, and (``+fused``) the fused one-token step of its layer, its decoder block and fla's SwiGLU MLP
    (module docstring)."""

    family: ClassVar[str]
    recurrent_function: ClassVar[str]  # the layer module's one-token recurrent function, routed by patches

    @classmethod
    def adapter(cls):
        """The family's adapter class (its layer module and mixer class)."""
        return adapter_class(cls.family)

    # ---- facts the fused one-token step (below) reads -----------------------------------------------------
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
    def inplace_recurrent(cls, original: Callable, kernel: str, device_types: tuple[str, ...]) -> Callable:
        """``original`` (the layer module's one-token recurrent function) with its decode calls routed to
        ``kernel``'s in-place step."""
        raise NotImplementedError(f"{cls.family} does not route its decode calls")

    def patches(self, kernel: str, device_types: tuple[str, ...]) -> list[Patch]:
        cls = type(self)
        return [decode_patch(cls.adapter().layer_module, cls.recurrent_function,
                             lambda original: cls.inplace_recurrent(original, kernel, device_types))]

    def fused_patches(self, kernel: str, device_types: tuple[str, ...]) -> list[Patch]:
        return fused_patches(type(self), kernel, device_types)

    def pack(self, model: nn.Module) -> int:
        return pack_for_decode(type(self), model)


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


def mixer_plan(route, layer: nn.Module) -> dict[str, Any] | None:
    """How ``route``'s fla linear-attention layer's decode step is fused (the packed projection's rows), or None
    to keep the stock step. What differs between the fla families (the rows after q, k, v and g, the recurrent
    step) comes from the family's route."""
    if type(layer) is not route.adapter().mixer_class or not getattr(layer, "use_short_conv", False):
        return None
    convs = (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d)
    if any(getattr(c, "activation", None) not in ("silu", "swish") for c in convs):
        return None
    if len({c.kernel_size[0] for c in convs}) != 1 or len({c.bias is None for c in convs}) != 1:
        return None
    tail = route.fused_decode_rows(layer)
    if tail is None:
        return None
    return {"route": route, "rows": ["q_proj", "k_proj", "v_proj"] + (["g_proj"] if layer.use_gate else []) + tail}


def pack_for_decode(route, model: nn.Module) -> int:
    """Pack the weights the fused step reads (each of ``route``'s mixers' projections and conv filters, each SwiGLU
    MLP's gate and up) into one tensor per group, rebinding the stock parameters as views (values unchanged).
    Returns the number of modules packed."""
    count = 0
    for module in model.modules():
        plan = mixer_plan(route, module)
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


def _mixer_forward(route, original, kernel: str, device_types: tuple[str, ...]):
    from fla.layers.utils import get_layer_cache, update_layer_cache

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, use_cache=False,
                output_attentions=False, **kwargs):
        plan = mixer_plan(route, self)
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
        y = F.linear(hidden_states, weight)  # [N, 1, q | k | v | (g) | the route's rows]
        ck, cv, dk, dv = self.key_dim, self.value_dim, self.head_k_dim, self.head_v_dim
        at = 2 * ck + cv
        gate = y[..., at:at + cv].unflatten(-1, (cv // dv, dv)) if self.use_gate else None
        tail = y[..., at + (cv if self.use_gate else 0):]
        # PDL only before our recurrent kernel, which loads its state while the conv runs. fla's functions take q, k
        # and v contiguous (they would copy views into one row), and the route may have the same launch write
        # more of the tail's columns for them and normalise q and k (DeltaNet: beta's sigmoid, the L2 norms)
        ours = kernel == "statereduce"
        spec = None if ours else plan["route"].fused_conv_extra(self, kernel)
        out = conv.conv_step(y[..., :2 * ck + cv], tuple(last["conv_state"]), conv_w, conv_b, self.q_conv1d.activation,
                        pdl=ours, separate=not ours, extra=tail[..., :spec[0]] if spec else None,
                        extra_act=spec[1] if spec else None,
                        l2norm=None if ours else plan["route"].fused_conv_l2norm(self, kernel))
        q, k, v = (out[..., :ck], out[..., ck:2 * ck], out[..., 2 * ck:]) if ours else out[:3]
        q, k, v = q.unflatten(-1, (ck // dk, dk)), k.unflatten(-1, (ck // dk, dk)), v.unflatten(-1, (cv // dv, dv))
        state = last["recurrent_state"]
        o = plan["route"].fused_recurrent_step(self, kernel, q, k, v, tail, state,
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


def fused_patches(route, kernel: str, device_types: tuple[str, ...]) -> list[Patch]:
    """The class patches that give ``route``'s fla layer, its decoder block and fla's SwiGLU MLP the fused
    one-token step (module docstring), with ``kernel``'s in-place recurrent step."""
    patches: list[Patch] = [(route.adapter().mixer_class, "forward",
                             lambda f: _mixer_forward(route, f, kernel, device_types))]
    if route.block_class is not None:
        patches.append((route.block_class, "forward", lambda f: _block_forward(f, device_types)))
    patches.append((importlib.import_module("fla.modules.mlp").GatedMLP, "forward",
                    lambda f: _mlp_forward(f, device_types)))
    return patches


@register_route("delta_net")
class DeltaNetRoute(FlaRoute):
    """fla DeltaNet: ``fused_recurrent_delta_rule`` in place; the fused step packs ``b_proj`` after q, k, v."""

    family = "delta_net"
    recurrent_function = "fused_recurrent_delta_rule"
    block_class = LazyImport("fla.models.delta_net.modeling_delta_net:DeltaNetBlock")

    @classmethod
    def inplace_recurrent(cls, original, kernel: str, device_types: tuple[str, ...]):
        return _inplace_delta_rule(original, kernel, device_types)

    # ---- fused one-token decode ---------------------------------------------------------------
    @classmethod
    def fused_decode_rows(cls, layer: nn.Module) -> list[str] | None:
        if layer.qk_activation != "silu" or layer.qk_norm not in ("l2", None) or not layer.use_beta:
            return None
        return ["b_proj"]

    @classmethod
    def fused_conv_extra(cls, layer, kernel):
        # beta's sigmoid, computed by the conv launch instead of a kernel of its own (fla's kernels take beta after it)
        return layer.num_heads, "2sigmoid" if layer.allow_neg_eigval else "sigmoid"

    @classmethod
    def fused_conv_l2norm(cls, layer, kernel):
        # fla's function normalises q and k in two launches of their own (l2norm_fwd); the conv launch does it for
        # heads of a power-of-two width (pruned widths that are not keep fla's path)
        dk = layer.head_k_dim
        return dk if layer.qk_norm == "l2" and dk & (dk - 1) == 0 else None

    @classmethod
    def fused_recurrent_step(cls, layer, kernel, q, k, v, tail, state, extra=None):
        beta, l2 = tail[..., :layer.num_heads], layer.qk_norm == "l2"
        if kernel == "statereduce":  # L2 norms (rounded as fla's DeltaNet does) and beta's sigmoid in the kernel
            return recurrent_step(q, k, v, beta, state, l2norm=l2, round_qk=l2, beta_sigmoid=True,
                                  allow_neg_eigval=layer.allow_neg_eigval)
        # fla's function as inplace_decode routes it: q, k, v contiguous, beta through its sigmoid and (where
        # fused_conv_l2norm says so) q and k L2-normalised, all written by the conv launch
        step = importlib.import_module("fla.layers.delta_net").fused_recurrent_delta_rule
        o, _ = step(q=q, k=k, v=v, beta=extra, initial_state=state, output_final_state=True,
                    use_qk_l2norm_in_kernel=l2 and cls.fused_conv_l2norm(layer, kernel) is None)
        return o


def _inplace_delta_rule(original, kernel: str, device_types: tuple[str, ...]):
    """fla's one-token recurrent function, routed to ``kernel``'s in-place step (speed.inplace)."""
    def fused_recurrent_delta_rule(q, k, v, beta=None, scale=None, initial_state=None, output_final_state=False,
                                   use_qk_l2norm_in_kernel=False, cu_seqlens=None):
        if not one_token_call(q, initial_state, cu_seqlens, device_types):
            return original(q, k, v, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                            cu_seqlens)
        if kernel == "fla_copy":
            o, final = original(q, k, v, beta, scale, initial_state, True, use_qk_l2norm_in_kernel, cu_seqlens)
            initial_state.copy_(final)
            return o, (initial_state if output_final_state else None)
        if beta is None:
            beta = torch.ones_like(q[..., 0])
        if kernel == "fla":
            o = fla_delta_rule_step(q, k, v, beta, initial_state, scale=scale, l2norm=use_qk_l2norm_in_kernel)
        else:
            o = recurrent_step(q, k, v, beta, initial_state, scale=scale, l2norm=use_qk_l2norm_in_kernel,
                               round_qk=True)
        return o, (initial_state if output_final_state else None)

    return fused_recurrent_delta_rule


@register_route("gated_deltanet")
class GatedDeltaNetRoute(FlaRoute):
    """fla Gated DeltaNet: ``fused_recurrent_gated_delta_rule`` in place; the fused step packs ``a_proj`` and
    ``b_proj`` after q, k, v and g."""

    family = "gated_deltanet"
    recurrent_function = "fused_recurrent_gated_delta_rule"
    block_class = LazyImport("fla.models.gated_deltanet.modeling_gated_deltanet:GatedDeltaNetBlock")

    @classmethod
    def inplace_recurrent(cls, original, kernel: str, device_types: tuple[str, ...]):
        return _inplace_gated_delta_rule(original, kernel, device_types)

    # ---- fused one-token decode ---------------------------------------------------------------
    @classmethod
    def fused_decode_rows(cls, layer: nn.Module) -> list[str] | None:
        return ["a_proj", "b_proj"]

    @classmethod
    def fused_recurrent_step(cls, layer, kernel, q, k, v, tail, state, extra=None):
        hv = layer.num_v_heads
        a, beta = tail[..., :hv], tail[..., hv:2 * hv]
        opts = {"A_log": layer.A_log, "dt_bias": layer.dt_bias, "allow_neg_eigval": layer.allow_neg_eigval}
        if kernel == "statereduce":  # L2 norms, beta's sigmoid and the decay in the kernel
            return recurrent_step(q, k, v, beta, state, g=a, l2norm=True, beta_sigmoid=True, state_v_first=True,
                                  **opts)
        # fla's function as inplace_decode routes it (q, k, v arrive contiguous from the conv launch; a and beta are
        # views into the projection's rows)
        step = importlib.import_module("fla.layers.gated_deltanet").fused_recurrent_gated_delta_rule
        o, _ = step(q, k, v, g=a.contiguous(), beta=beta.contiguous(),
                    initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True,
                    use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True, **opts)
        return o


def _inplace_gated_delta_rule(original, kernel: str, device_types: tuple[str, ...]):
    """fla's one-token recurrent function, routed to ``kernel``'s in-place step (speed.inplace)."""
    def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None,
                                         initial_state=None, output_final_state=False,
                                         use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        simple = gk is None and gv is None and beta is not None and (beta.ndim != v.ndim)
        extra = set(kwargs) - {"use_gate_in_kernel", "A_log", "dt_bias", "use_beta_sigmoid_in_kernel",
                               "allow_neg_eigval", "state_v_first"}
        if not (simple and not extra and one_token_call(q, initial_state, cu_seqlens, device_types)):
            return original(q, k, v, g=g, gk=gk, gv=gv, beta=beta, scale=scale, initial_state=initial_state,
                            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                            cu_seqlens=cu_seqlens, **kwargs)
        if kernel == "fla_copy":
            o, final = original(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                                output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)
            initial_state.copy_(final)
            return o, (initial_state if output_final_state else None)
        in_kernel = kwargs.get("use_gate_in_kernel", False)
        opts = {"g": g, "A_log": kwargs.get("A_log") if in_kernel else None,
                "dt_bias": kwargs.get("dt_bias") if in_kernel else None, "scale": scale,
                "l2norm": use_qk_l2norm_in_kernel, "beta_sigmoid": kwargs.get("use_beta_sigmoid_in_kernel", False),
                "allow_neg_eigval": kwargs.get("allow_neg_eigval", False),
                "state_v_first": kwargs.get("state_v_first", False)}
        step = fla_gated_delta_rule_step if kernel == "fla" else recurrent_step
        o = step(q, k, v, beta, initial_state, **opts)
        return o, (initial_state if output_final_state else None)

    return fused_recurrent_gated_delta_rule
