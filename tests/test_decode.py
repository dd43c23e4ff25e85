"""The in-place decode step (statereduce.speed.inplace) against the torch reference, run by Triton's interpreter on CPU.

The GPU side (fla's kernels in place, autotuned configs, CUDA graphs) is checked by scripts/check_decode_gpu.py.
"""

import os
import re
import sys
from pathlib import Path

import pytest
import torch

from statereduce.speed import fla_decode
from statereduce.kernels import conv, fla_fallback, recurrent
from statereduce.speed import inplace


def _inputs(n, h, hv, k, v, gated, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)
    q, kk, vv = r(n, 1, h, k), r(n, 1, h, k), r(n, 1, hv, v)
    if gated:
        return {"q": q, "k": kk, "v": vv, "beta": r(n, 1, hv), "g": r(n, 1, hv), "A_log": r(hv).abs().log(),
                "dt_bias": r(hv), "state": r(n, hv, v, k) * 0.3}
    return {"q": q, "k": kk, "v": vv, "beta": torch.rand(n, 1, h, generator=g), "state": r(n, h, k, v) * 0.3}


def _check_delta_rule(k, v):
    x = _inputs(3, 2, 2, k, v, gated=False, seed=k * v)
    o_ref, s_ref = fla_fallback.fused_recurrent_delta_rule(
        x["q"].double(), x["k"].double(), x["v"].double(), x["beta"].double(), initial_state=x["state"].double(),
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    state = x["state"].clone()
    o = recurrent.recurrent_step(x["q"], x["k"], x["v"], x["beta"], state, l2norm=True)
    assert o.shape == o_ref.shape
    torch.testing.assert_close(o.double(), o_ref.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.double(), s_ref.double(), rtol=1e-5, atol=1e-5)  # updated in place


def _check_gated_delta_rule(h, hv, k, v):
    x = _inputs(2, h, hv, k, v, gated=True, seed=h * 100 + k)
    o_ref, s_ref = fla_fallback.fused_recurrent_gated_delta_rule(
        x["q"].double(), x["k"].double(), x["v"].double(), g=x["g"].double(), beta=x["beta"].double(),
        initial_state=x["state"].double(), output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, A_log=x["A_log"].double(), dt_bias=x["dt_bias"].double(),
        use_beta_sigmoid_in_kernel=True, state_v_first=True)
    state = x["state"].clone()
    o = recurrent.recurrent_step(x["q"], x["k"], x["v"], x["beta"], state, g=x["g"], A_log=x["A_log"],
                              dt_bias=x["dt_bias"], l2norm=True, beta_sigmoid=True, state_v_first=True)
    torch.testing.assert_close(o.double(), o_ref.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.double(), s_ref.double(), rtol=1e-5, atol=1e-5)


def _check_fixed_configs_agree():
    x = _inputs(2, 2, 2, 16, 48, gated=False, seed=3)
    outs = []
    for bv, w, stream in ((8, 1, False), (16, 4, True), (64, 2, False)):
        state = x["state"].clone()
        outs.append((recurrent.recurrent_step(x["q"], x["k"], x["v"], x["beta"], state, block_v=bv, num_warps=w,
                                           stream=stream), state))
    for o, s in outs[1:]:
        torch.testing.assert_close(o, outs[0][0])
        torch.testing.assert_close(s, outs[0][1])


def _routed_decoding(family, kernel, return_model=False):
    """Logits of 4 one-token steps after a 12-token prompt, decoded plainly and through ``inplace_decode(kernel)``
    (on CPU); asserts that the routed steps keep the cache's state tensors and write new values into them."""
    sys.path.insert(0, str(Path(__file__).parent))
    from _models import tiny_inputs, tiny_model

    model = tiny_model(family)
    ids = tiny_inputs(batch=2, length=12)
    steps = tiny_inputs(batch=2, length=4, seed=7)
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        ref = [model(steps[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(4)]
        with inplace.inplace_decode(kernel, device_types=("cpu",)):
            cache = model(ids, use_cache=True).past_key_values
            states = [cache[i]["recurrent_state"] for i in range(len(cache))]
            before = [s.clone() for s in states]
            got = [model(steps[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(4)]
            assert all(cache[i]["recurrent_state"] is s for i, s in enumerate(states))  # the same tensors ...
            assert not any(torch.equal(s, b) for s, b in zip(states, before))  # ... written through
    return (ref, got, model) if return_model else (ref, got)


def _check_model_decode(family):
    """Stock fla layers decoding with ``inplace_decode("statereduce")`` equal the torch fallback's decoding."""
    for r, g in zip(*_routed_decoding(family, "statereduce")):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


def _check_strided_inputs():
    """Views into wider rows (a fused projection's output) give the same step as contiguous copies."""
    x = _inputs(3, 2, 4, 8, 12, gated=True, seed=5)
    n = 3
    wide = torch.randn(n, 1, 2 * 16 + 48 + 4 + 4 + 5)  # q | k | v | g | beta | padding
    q, k = wide[..., :16].unflatten(-1, (2, 8)), wide[..., 16:32].unflatten(-1, (2, 8))
    v, g, beta = wide[..., 32:80].unflatten(-1, (4, 12)), wide[..., 80:84], wide[..., 84:88]
    opts = {"A_log": x["A_log"], "dt_bias": x["dt_bias"], "l2norm": True, "beta_sigmoid": True, "state_v_first": True}
    s1, s2 = x["state"].clone(), x["state"].clone()
    o1 = recurrent.recurrent_step(q, k, v, beta, s1, g=g, **opts)
    o2 = recurrent.recurrent_step(q.contiguous(), k.contiguous(), v.contiguous(), beta.contiguous(), s2,
                               g=g.contiguous(), **opts)
    torch.testing.assert_close(o1, o2, rtol=0, atol=0)
    torch.testing.assert_close(s1, s2, rtol=0, atol=0)


def _check_conv_step():
    """conv.conv_step (three segments, one launch) against fla_fallback's one-segment update, with a strided
    input row, with and without bias, and a width that is not a multiple of the block."""
    g = torch.Generator().manual_seed(11)
    n, w, dims = 3, 4, (20, 20, 36)
    for bias in (False, True):
        wide = torch.randn(n, 1, sum(dims) + 7, generator=g)
        x = wide[..., :sum(dims)]
        weight = torch.randn(sum(dims), 1, w, generator=g)
        b = torch.randn(sum(dims), generator=g) if bias else None
        caches = tuple(torch.randn(n, d, w, generator=g) for d in dims)
        refs, start = [], 0
        for d, c in zip(dims, caches):
            sl = slice(start, start + d)
            y, _ = fla_fallback.causal_conv1d_update(x[..., sl].contiguous(), c.clone(), weight=weight[sl, 0],
                                                     bias=b[sl] if bias else None, activation="silu")
            state = torch.cat([c[..., 1:], x[:, 0, sl, None]], -1)
            refs.append((y, state))
            start += d
        start_caches = [c.clone() for c in caches]
        got = conv.conv_step(x, caches, weight, b, "silu", block=16)
        torch.testing.assert_close(got, torch.cat([r[0] for r in refs], -1), rtol=1e-5, atol=1e-6)
        for c, (_, state) in zip(caches, refs):
            torch.testing.assert_close(c, state, rtol=0, atol=0)  # shifted in place
        # separate: the same values, each segment its own contiguous [N, 1, Di] tensor
        for c, c0 in zip(caches, start_caches):
            c.copy_(c0)
        parts = conv.conv_step(x, caches, weight, b, "silu", block=16, separate=True)
        assert [p.shape for p in parts] == [(n, 1, d) for d in dims] and all(p.is_contiguous() for p in parts)
        torch.testing.assert_close(torch.cat(parts, -1), got, rtol=0, atol=0)
        for c, (_, state) in zip(caches, refs):
            torch.testing.assert_close(c, state, rtol=0, atol=0)
        # extra columns (here the row's last 7, strided): written contiguous by the same launch, through sigmoid
        for act, ref in ((None, wide[..., -7:]), ("sigmoid", wide[..., -7:].sigmoid()),
                         ("2sigmoid", 2 * wide[..., -7:].sigmoid())):
            for c, c0 in zip(caches, start_caches):
                c.copy_(c0)
            *parts, e = conv.conv_step(x, caches, weight, b, "silu", block=16, separate=True,
                                               extra=wide[..., -7:], extra_act=act)
            assert e.shape == (n, 1, 7) and e.is_contiguous()
            torch.testing.assert_close(e, ref, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(torch.cat(parts, -1), got, rtol=0, atol=0)
    _check_conv_step_l2norm()


def _check_conv_step_l2norm():
    """conv_step's per-head L2 norm of q and k against fla_fallback's l2norm of the plain conv output (rounded to
    the dtype first, as fla's DeltaNet does): heads smaller than the block, a head wider than the block (raised to
    it), a width that is not a multiple of the block, float32 and bfloat16; v is left as it is."""
    g = torch.Generator().manual_seed(12)
    n, w = 3, 4
    for dims, head, dtype in (((20, 20, 36), 4, torch.float32), ((64, 64, 40), 32, torch.float32),
                              ((32, 32, 24), 8, torch.bfloat16)):
        x = torch.randn(n, 1, sum(dims), generator=g).to(dtype)
        weight = torch.randn(sum(dims), 1, w, generator=g).to(dtype)
        caches = tuple(torch.randn(n, d, w, generator=g).to(dtype) for d in dims)
        start = [c.clone() for c in caches]
        plain = conv.conv_step(x, caches, weight, None, "silu", block=16, separate=True)
        after = [c.clone() for c in caches]
        for c, c0 in zip(caches, start):
            c.copy_(c0)
        normed = conv.conv_step(x, caches, weight, None, "silu", block=16, separate=True, l2norm=head)
        for i, (a, b) in enumerate(zip(normed, plain)):
            ref = fla_fallback.l2norm(b.unflatten(-1, (-1, head))).flatten(-2) if i < 2 else b
            tol = {"rtol": 8e-3, "atol": 4e-3} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}
            torch.testing.assert_close(a, ref, **tol)
            assert a.dtype == dtype
        if dtype == torch.float32:
            heads = normed[0].unflatten(-1, (-1, head)).norm(dim=-1)
            torch.testing.assert_close(heads, torch.ones_like(heads), rtol=1e-5, atol=1e-5)
        for c, c1 in zip(caches, after):
            torch.testing.assert_close(c, c1, rtol=0, atol=0)  # the caches move as without the norm


def _check_fused_model_decode(family):
    """The fused layer step (packed projections, one conv launch, the recurrent step on views) decodes the stock
    model like fla's own step, with our kernel and with fla's function (here the torch fallback) plus a copy."""
    conv_step, calls, addmm, adds = conv.conv_step, [], torch.addmm, []
    conv.conv_step = lambda *a, **k: (calls.append((k.get("pdl"), k.get("separate"), k.get("extra_act"),
                                                            k.get("l2norm"))) or conv_step(*a, **k))
    # the blocks' down projection adds the residual in place (addmm_ into the norm's residual sum)
    addmm_ = torch.Tensor.addmm_
    torch.addmm = lambda *a, **k: adds.append("addmm") or addmm(*a, **k)
    torch.Tensor.addmm_ = lambda *a, **k: adds.append("addmm_") or addmm_(*a, **k)
    try:
        for kernel in ("statereduce+fused", "fla_copy+fused"):
            ref, got, model = _routed_decoding(family, kernel, return_model=True)
            for r, g in zip(ref, got):
                torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)
            # the fused step ran (one conv launch per layer and step) and packed every mixer and MLP
            n_layers = model.config.num_hidden_layers
            assert len(calls) == 4 * n_layers, (kernel, len(calls))
            # PDL only before our recurrent kernel; q, k, v in separate contiguous tensors for fla's function, and
            # DeltaNet's beta through its sigmoid and q, k through their L2 norms by the same launch
            ours = kernel == "statereduce+fused"
            fla_dn = family == "delta_net" and not ours
            dk = model.model.layers[0].attn.head_k_dim
            assert set(calls) == {(ours, not ours, "sigmoid" if fla_dn else None, dk if fla_dn else None)}
            assert adds == ["addmm_"] * (4 * n_layers), (kernel, adds)
            calls.clear()
            adds.clear()
            for layer in model.model.layers:
                packed = layer.attn._statereduce_packed["proj"]
                assert layer.attn.q_proj.weight.data_ptr() == packed.data_ptr()
                assert packed.shape[0] % fla_decode.PROJ_ALIGN == 0 and not packed[-1].any()  # zero padding rows
                assert layer.mlp.up_proj.weight.data_ptr() > layer.mlp.gate_proj.weight.data_ptr()
                assert "gate_up" in layer.mlp._statereduce_packed
    finally:
        conv.conv_step, torch.addmm, torch.Tensor.addmm_ = conv_step, addmm, addmm_


def _check_all():
    """Every kernel check; run by Triton's interpreter (TRITON_INTERPRET=1 must be set before triton is imported)."""
    _check_strided_inputs()
    _check_conv_step()
    for family in ("delta_net", "gated_deltanet"):
        _check_fused_model_decode(family)
        _check_model_decode(family)
    for k, v in ((8, 16), (12, 20), (32, 8)):
        _check_delta_rule(k, v)
    for h, hv, k, v in ((2, 2, 16, 8), (1, 2, 12, 24), (2, 4, 8, 40)):
        _check_gated_delta_rule(h, hv, k, v)
    _check_fixed_configs_agree()


@pytest.mark.slow
def test_kernel_matches_reference_under_interpreter():
    """The Triton kernel against float64 torch references (DeltaNet and Gated DeltaNet layouts, GVA, d_k not a power
    of two, fixed and default tiles), and whole stock fla models decoding through ``inplace_decode`` against the
    torch fallback's decoding, run by Triton's interpreter in a fresh process."""
    import _fresh as fresh  # here: the child runs this file, where tests/ is not on sys.path

    code = f"import runpy; runpy.run_path({str(Path(__file__))!r})['_check_all'](); print('ok')"
    out = fresh.run(["-c", code], env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600, preload=fresh.TORCH)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_bad_inputs_fail_with_one_line():
    x = _inputs(2, 2, 2, 8, 8, gated=False, seed=0)
    with pytest.raises(ValueError, match=r"state must be a contiguous float32 tensor of shape \(2, 2, 8, 8\)"):
        recurrent.recurrent_step(x["q"], x["k"], x["v"], x["beta"], x["state"].double())
    strided = torch.zeros(2, 2, 8, 16)[..., :8]  # a state sliced out of a wider one (right shape, not contiguous)
    with pytest.raises(ValueError, match=r"got \(2, 2, 8, 8\) torch.float32, strided \(256, 128, 16, 1\)"):
        recurrent.recurrent_step(x["q"], x["k"], x["v"], x["beta"], strided)
    with pytest.raises(ValueError, match="one token"):
        recurrent.recurrent_step(x["q"].repeat(1, 2, 1, 1), x["k"], x["v"], x["beta"], x["state"])
    with pytest.raises(ValueError, match="both block_v and num_warps"):
        recurrent.recurrent_step(x["q"], x["k"], x["v"], x["beta"], x["state"], block_v=8)
    with pytest.raises(ValueError,
                       match="unknown decode kernel 'cuda'; valid: fla, statereduce, fla_copy, fla[+]fused"), \
            inplace.inplace_decode("cuda"):
        pass


def test_inplace_decode_restores_fla_functions():
    import fla.layers.delta_net as dn
    import fla.layers.gated_deltanet as gdn
    from fla.modules import mlp

    before = dn.fused_recurrent_delta_rule, gdn.fused_recurrent_gated_delta_rule
    forwards = dn.DeltaNet.forward, gdn.GatedDeltaNet.forward, mlp.GatedMLP.forward
    with inplace.inplace_decode("statereduce"):
        assert dn.fused_recurrent_delta_rule is not before[0]
        assert gdn.fused_recurrent_gated_delta_rule is not before[1]
        assert (dn.DeltaNet.forward, gdn.GatedDeltaNet.forward, mlp.GatedMLP.forward) == forwards  # not fused
    assert (dn.fused_recurrent_delta_rule, gdn.fused_recurrent_gated_delta_rule) == before
    with pytest.raises(RuntimeError, match="boom"), inplace.inplace_decode("fla+fused"):
        assert all(f is not g for f, g in zip((dn.DeltaNet.forward, gdn.GatedDeltaNet.forward,
                                               mlp.GatedMLP.forward), forwards))
        raise RuntimeError("boom")
    assert (dn.DeltaNet.forward, gdn.GatedDeltaNet.forward, mlp.GatedMLP.forward) == forwards  # restored on error
    assert (dn.fused_recurrent_delta_rule, gdn.fused_recurrent_gated_delta_rule) == before


@pytest.mark.parametrize("family", ["delta_net", "gated_deltanet"])
def test_fla_copy_decodes_like_the_unrouted_model(family):
    """``fla_copy`` (fla's function unmodified, its new state copied back) keeps the cache's state tensors and gives
    the logits of ordinary decoding exactly (here with the torch fallback standing in for fla's kernels on CPU)."""
    for r, g in zip(*_routed_decoding(family, "fla_copy")):
        torch.testing.assert_close(g, r, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["delta_net", "gated_deltanet"])
def test_packing_keeps_the_stock_forward_and_is_done_once(family):
    """pack_for_decode rebinds the projections, conv filters and MLP gate/up as views of packed tensors: the stock
    forward's logits are unchanged exactly, a second call reuses the packing, parameters keep requires_grad, and it
    works under inference_mode (a Parameter cannot wrap an inference tensor)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from _models import tiny_inputs, tiny_model

    from statereduce.speed.inplace import pack_for_decode

    model = tiny_model(family)
    ids = tiny_inputs(batch=2, length=6)
    with torch.no_grad():
        ref = model(ids).logits
    with torch.inference_mode():
        assert pack_for_decode(model) == 2 * model.config.num_hidden_layers  # every mixer and MLP
    attn = model.model.layers[0].attn
    packed = attn._statereduce_packed["proj"]
    assert attn.q_proj.weight.data_ptr() == packed.data_ptr() and attn.q_proj.weight.requires_grad
    assert attn.k_proj.weight.data_ptr() == packed[attn.q_proj.weight.shape[0]:].data_ptr()
    pack_for_decode(model)
    assert attn._statereduce_packed["proj"] is packed  # reused, not packed again
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref, rtol=0, atol=0)


def _ptx(fn, args: dict, options: dict) -> str:
    """PTX of a Triton kernel compiled for an H100/H200 (sm_90) without a GPU: ``args`` maps each argument to a
    signature type (``"*fp32"``, ``"i32"``) or, for constexprs, its value."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {name: t if isinstance(t, str) and (t.startswith("*") or t in ("i32", "fp32")) else "constexpr"
           for name, t in args.items()}
    consts = {name: v for name, v in args.items() if sig[name] == "constexpr"}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                          options=options).asm["ptx"]


def _check_pdl_order(ptx: str) -> None:
    """Under PDL a kernel may run beside the previous one: it must not store before ``griddepcontrol.wait`` (the
    previous kernel may still read that memory) and it should load its independent inputs before the wait."""
    lines = [re.sub(r"^@!?%p\d+\s+", "", line.strip()) for line in ptx.splitlines()]  # without predicates
    waits = [i for i, line in enumerate(lines) if line.startswith("griddepcontrol.wait")]
    assert waits and any(line.startswith("griddepcontrol.launch_dependents") for line in lines)
    first_wait = waits[0]
    assert any(line.startswith("ld.global") for line in lines[:first_wait]), "nothing is loaded before the wait"
    assert not any(line.startswith(("st.global", "atom.", "red.")) for line in lines[:first_wait])


def test_pdl_kernels_load_state_before_the_wait_and_store_after():
    """Compiled for sm_90 with PDL, our two decode kernels load the state (the conv cache) before
    ``griddepcontrol.wait`` and store nothing before it; without PDL they carry no griddepcontrol."""
    from statereduce.kernels.conv import _conv_kernel

    step = recurrent._kernel().fn
    step_args = {"q": "*bf16", "k": "*bf16", "v": "*bf16", "beta": "*bf16", "g": "*bf16", "A_log": "*fp32",
                 "dt_bias": "*fp32", "h": "*fp32", "o": "*bf16", "scale": "fp32", "NHB": "i32", "s_q": "i32",
                 "s_k": "i32", "s_v": "i32", "s_b": "i32", "s_g": "i32", "H": 16, "HV": 16, "K": 32, "V": 128,
                 "BK": 32, "BV": 64, "STREAM": False, "STATE_V_FIRST": False, "USE_G": False,
                 "GATE_IN_KERNEL": False, "HAS_DT_BIAS": False, "L2NORM": True, "ROUND_QK": True,
                 "BETA_SIGMOID": False, "NEG_EIGVAL": False}
    conv_args = {"x": "*bf16", "y": "*bf16", "c0": "*bf16", "c1": "*bf16", "c2": "*bf16", "w": "*bf16",
                 "b": "*bf16", "e": "*bf16", "f": "*bf16", "s_x": "i32", "s_y": "i32", "s_e": "i32", "D0": 512,
                 "D1": 512, "D2": 2048, "NB0": 4, "NB1": 4, "NB2": 16, "E": 16, "EXTRA_ACT": 1,
                 "W": 4, "BD": 128, "BW": 4, "HAS_BIAS": False, "SILU": True, "SEPARATE": True, "L2": 32}
    for fn, args, warps in ((step, step_args, 2), (_conv_kernel, conv_args, 4)):
        _check_pdl_order(_ptx(fn, {**args, "PDL": True}, {"num_warps": warps, "launch_pdl": True}))
        assert "griddepcontrol" not in _ptx(fn, {**args, "PDL": False}, {"num_warps": warps})
    # the convs the fused step launches (no bias: None pointers): before our kernel (one row, PDL), before fla's
    # DeltaNet function (separate q, k, v, beta's sigmoid, q and k L2-normalised: heads of 32 and 128) and Gated
    # DeltaNet's (separate, no extra columns, no norm)
    plain = {**conv_args, "b": None, "e": None, "f": None, "E": 0, "EXTRA_ACT": 0, "SEPARATE": False, "L2": 0}
    _check_pdl_order(_ptx(_conv_kernel, {**plain, "PDL": True}, {"num_warps": 4, "launch_pdl": True}))
    for variant in ({**conv_args, "b": None}, {**conv_args, "b": None, "L2": 128}, {**plain, "SEPARATE": True}):
        assert "st.global" in _ptx(_conv_kernel, {**variant, "PDL": False}, {"num_warps": 4})


def test_conv_step_bad_extra_or_l2norm_fails_with_one_line():
    x, caches, w = torch.zeros(2, 1, 12), tuple(torch.zeros(2, 4, 4) for _ in range(3)), torch.zeros(12, 4)
    with pytest.raises(ValueError, match="extra_act 'relu' is not supported; valid: sigmoid, 2sigmoid, None"):
        conv.conv_step(x, caches, w, extra=torch.zeros(2, 1, 3), extra_act="relu", separate=True)
    with pytest.raises(ValueError, match=r"extra columns need separate=True and \[N=2, 1, E\] rows"):
        conv.conv_step(x, caches, w, extra=torch.zeros(2, 1, 3))
    for head in (3, 8, 0):
        with pytest.raises(ValueError, match=f"l2norm head size {head} must be a power of two dividing the q and k "
                                             "widths 4 and 4"):
            conv.conv_step(x, caches, w, l2norm=head)


def test_programmatic_launch_switch():
    cpu = torch.device("cpu")
    assert recurrent.launch_options(cpu) == {"PDL": False} and not recurrent.pdl_supported(cpu)
    with recurrent.programmatic_launch(False):
        assert not recurrent._PDL
        with recurrent.programmatic_launch(True):
            assert recurrent._PDL
        assert not recurrent._PDL
    assert recurrent._PDL


def test_first_autotuned_launch_of_a_key_goes_without_pdl(monkeypatch):
    """The autotuner times configs right after triton's L2-flush memset, and a PDL launch may overlap it: so the first
    launch of each autotuning key goes without PDL (it tunes), later ones with it."""
    launches = []

    class Recorder:  # stands in for the autotuned kernel: records each launch's PDL options
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((kw["K"], kw["PDL"], kw.get("launch_pdl", False)))

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(recurrent, "_STEP", Recorder())
    monkeypatch.setattr(recurrent, "_TUNED", set())
    monkeypatch.setattr(recurrent, "pdl_supported", lambda device: True)
    for kd in (8, 8, 8, 16, 16):
        x = _inputs(2, 2, 2, kd, 8, gated=False, seed=0)
        recurrent.recurrent_step(x["q"], x["k"], x["v"], x["beta"], x["state"])
    assert launches == [(8, False, False), (8, True, True), (8, True, True), (16, False, False), (16, True, True)]
    launches.clear()
    with recurrent.programmatic_launch(False):
        recurrent.recurrent_step(x["q"], x["k"], x["v"], x["beta"], x["state"])
    assert launches == [(16, False, False)]


def test_conv_step_uses_pdl_only_when_asked(monkeypatch):
    launches = []

    class Recorder:  # stands in for the conv kernel: records each launch's PDL options
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((kw["PDL"], kw.get("launch_pdl", False)))

    monkeypatch.setattr(conv, "_conv_kernel", Recorder())
    monkeypatch.setattr(recurrent, "pdl_supported", lambda device: True)
    x, w = torch.randn(2, 1, 24), torch.randn(24, 4)
    caches = tuple(torch.zeros(2, 8, 4) for _ in range(3))
    conv.conv_step(x, caches, w)
    conv.conv_step(x, caches, w, pdl=False)
    with recurrent.programmatic_launch(False):
        conv.conv_step(x, caches, w)
    assert launches == [(True, True), (False, False), (False, False)]
