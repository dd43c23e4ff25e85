"""Float64 references of the delta rule and the gated delta rule, written token by token from the paper's equations.

The tests of :mod:`statereduce.kernels.fla_fallback` and :mod:`statereduce.kernels.shapes` and the GPU sweep of fla's
kernels (``scripts/sweep_fla_shapes.py``) compare the kernels' outputs, final states and gradients with
:func:`delta_rule`. It shares no code with the kernels: one value head at a time, in the paper's state layout
``S in R^{V x K}``, a value head reading its key head by explicit indexing, everything in float64, gradients from
torch autograd. It is slow (a Python loop over heads and tokens) and meant for small shapes only.

Paper: Nazari & Rusch (2026), "On State Reduction in Linear Attention", Sec. 2 (delta rule and gated delta rule
recurrences). This module imports nothing else from the package.
"""

from __future__ import annotations

import torch

L2NORM_EPS = 1e-6
"""The eps of fla's in-kernel L2 norm of q and k: ``x / sqrt(sum(x**2) + eps)``."""


def delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    l2norm: bool = False,
    state_v_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (gated) delta rule, one token at a time, in float64.

    Per value head and token: ``S_t = a_t S_{t-1} + beta_t (v_t - a_t S_{t-1} k_t) k_t^T`` and
    ``o_t = scale * S_t q_t``, with ``a_t = exp(g_t)`` (gated delta rule, Gated DeltaNet) or 1 (``g=None``: delta
    rule, DeltaNet). It is the reference of fla's ``chunk_delta_rule``, ``fused_recurrent_delta_rule``,
    ``chunk_gated_delta_rule`` and ``fused_recurrent_gated_delta_rule`` (and of their CPU versions in
    :mod:`statereduce.kernels.fla_fallback`), whose conventions it takes.

    Args:
        q, k: ``[B, T, H, K]``.
        v: ``[B, T, HV, V]``; ``HV`` a multiple of ``H`` (grouped value heads: value head ``i`` reads key head
            ``i // (HV // H)``).
        beta: ``[B, T, HV]``, or ``[B, T, HV, V]`` (one beta per value channel).
        g: ``[B, T, HV]`` log decay, or None for the delta rule.
        scale: the query scale; default ``K ** -0.5``.
        initial_state: ``[B, HV, K, V]`` (fla's layout), ``[B, HV, V, K]`` with ``state_v_first``; default zeros.
        l2norm: normalise q and k first as fla's kernels do with ``use_qk_l2norm_in_kernel=True``
            (``x / sqrt(sum(x**2) + 1e-6)``).
        state_v_first: the layout of ``initial_state`` and of the returned state: ``[B, HV, V, K]`` (the paper's
            ``S in R^{V x K}``) instead of ``[B, HV, K, V]``.

    Returns:
        The output ``[B, T, HV, V]`` and the final state (layout as ``state_v_first`` says), both float64.

    Raises:
        ValueError: shapes that do not fit together (the actual shapes named).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if k.shape != q.shape or v.shape[:2] != (B, T) or HV % H != 0:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} do not fit "
                         "([B, T, H, K], [B, T, H, K], [B, T, HV, V] with HV a multiple of H)")
    if beta.shape not in ((B, T, HV), (B, T, HV, V)):
        raise ValueError(f"beta {tuple(beta.shape)}: expected [B, T, HV] = {(B, T, HV)} or [B, T, HV, V]")
    if g is not None and g.shape != (B, T, HV):
        raise ValueError(f"g {tuple(g.shape)}: expected [B, T, HV] = {(B, T, HV)}")
    state_shape = (B, HV, V, K) if state_v_first else (B, HV, K, V)
    if initial_state is not None and initial_state.shape != state_shape:
        raise ValueError(f"initial_state {tuple(initial_state.shape)}: expected {state_shape}"
                         f" (state_v_first={state_v_first})")
    r = HV // H
    q, k, v, beta = q.double(), k.double(), v.double(), beta.double()
    if l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + L2NORM_EPS)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + L2NORM_EPS)
    scale = K**-0.5 if scale is None else scale
    h0 = None if initial_state is None else initial_state.double()
    if h0 is not None and not state_v_first:
        h0 = h0.transpose(-1, -2)  # to the paper's [V, K]
    outs, finals = [], []
    for i in range(HV):
        kh = i // r  # value head i reads key head i // r
        S = torch.zeros(B, V, K, dtype=torch.float64, device=v.device) if h0 is None else h0[:, i]
        o_i = []
        for t in range(T):
            kt, qt = k[:, t, kh], q[:, t, kh]
            if g is None:
                Sa = S
            else:
                Sa = g[:, t, i].double().exp()[:, None, None] * S
            bt = beta[:, t, i] if beta.dim() == 4 else beta[:, t, i, None]
            delta = bt * (v[:, t, i] - torch.einsum("bvk,bk->bv", Sa, kt))
            S = Sa + delta[:, :, None] * kt[:, None, :]
            o_i.append(scale * torch.einsum("bvk,bk->bv", S, qt))
        outs.append(torch.stack(o_i, 1))
        finals.append(S)
    final = torch.stack(finals, 1)
    return torch.stack(outs, 2), (final if state_v_first else final.transpose(-1, -2))


def gated_deltanet_gate(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Gated DeltaNet's log decay ``g = -exp(A_log) * softplus(a + dt_bias)`` in float64: the reference of the gate
    fla's kernels compute with ``use_gate_in_kernel=True``.

    Args:
        a: ``[B, T, HV]``, the gate projection's output.
        A_log, dt_bias: ``[HV]``.
    """
    return -A_log.double().exp() * torch.log1p(torch.exp(a.double() + dt_bias.double()))

