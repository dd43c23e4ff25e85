"""Tests for statereduce.kernels.fla_fallback: the pure-PyTorch versions of fla's DeltaNet / Gated DeltaNet kernels.

The delta-rule ops are checked against the independent token-by-token recurrence of
:mod:`statereduce.kernels.reference`, written from the paper's equations (Nazari & Rusch 2026, Sec. 2), in float64,
in the paper's ``[V, K]`` state layout, with GVA done by explicit indexing: outputs, final states and gradients w.r.t.
every input. The small modules are checked against their formulas, and whole stock fla models are run on CPU
(training step, cached decoding vs full forward).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from _models import tiny_arch

from statereduce.kernels import fla_fallback as ff
from statereduce.kernels.reference import delta_rule, gated_deltanet_gate

ff.install()

import fla.layers.delta_net as fla_delta_net
import fla.layers.gated_deltanet as fla_gdn
from fla.models import (
    DeltaNetConfig,
    DeltaNetForCausalLM,
    GatedDeltaNetConfig,
    GatedDeltaNetForCausalLM,
)
from fla.modules import (
    FusedCrossEntropyLoss,
    FusedRMSNormGated,
    GatedMLP,
    RMSNorm,
    ShortConvolution,
)

warnings.filterwarnings("ignore", message=".*past_key_values.*")


def make_inputs(B, T, H, HV, K, V, gated, h0, seed=0, headwise_beta=False):
    gen = torch.Generator().manual_seed(seed)
    d = {"dtype": torch.float64, "generator": gen}
    x = {
        "q": torch.randn(B, T, H, K, **d),
        "k": torch.randn(B, T, H, K, **d),
        "v": torch.randn(B, T, HV, V, **d),
        "beta": torch.rand(B, T, HV, V, **d) if headwise_beta else torch.rand(B, T, HV, **d),
    }
    if gated:
        x["g"] = F.logsigmoid(torch.randn(B, T, HV, **d) + 2.0)
    if h0:
        x["h0"] = 0.5 * torch.randn(B, HV, V, K, **d)
    return {n: t.requires_grad_() for n, t in x.items()}


def loss_of(o, ht, seed=1):
    gen = torch.Generator().manual_seed(seed)
    wo = torch.randn(o.shape, dtype=torch.float64, generator=gen)
    ws = torch.randn(ht.shape, dtype=torch.float64, generator=gen)
    return (o.double() * wo).sum() + (ht.double() * ws).sum()


def assert_close(a, b, what, tol=2e-4):
    a, b = a.double(), b.double()
    err = (a - b).abs().max().item()
    ref = max(b.abs().max().item(), 1.0)
    assert err <= tol * ref, f"{what}: max abs err {err:.3e} (ref scale {ref:.3e})"


def run_ours(fn, x, gated, l2, scale, chunk_size, kv_first):
    kw = {"scale": scale, "output_final_state": True, "use_qk_l2norm_in_kernel": l2}
    h0 = x.get("h0")
    if h0 is not None:
        kw["initial_state"] = h0 if kv_first else h0.transpose(-1, -2)
    if chunk_size is not None:
        kw["chunk_size"] = chunk_size
    if gated:
        o, ht = fn(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], state_v_first=kv_first, **kw)
    else:
        o, ht = fn(x["q"], x["k"], x["v"], beta=x["beta"], **kw)
    assert ht.dtype == torch.float32
    return o, (ht if kv_first else ht.transpose(-1, -2))


SHAPES = [
    # id, B, T, H, HV, K, V, chunk, h0, l2, scale
    ("T37-chunk16", 2, 37, 2, 2, 16, 8, 16, False, True, None),
    ("T48-chunk16-h0", 2, 48, 2, 2, 16, 12, 16, True, True, 0.3),
    ("T70-chunk64-h0-nol2", 1, 70, 1, 1, 8, 8, 64, True, False, 0.2),
    ("GVA-H2-HV4-T29-chunk8-h0", 2, 29, 2, 4, 16, 8, 8, True, True, None),
    # below RECURRENT_AS_CHUNK tokens fused_recurrent runs its step loop, from it on the chunks
    ("T9-chunk8-h0", 2, 9, 2, 2, 16, 8, 8, True, True, None),
]


@pytest.mark.parametrize("gated", [False, True], ids=["delta", "gated"])
@pytest.mark.parametrize("mode", ["chunk", "fused_recurrent"])
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_delta_rule_matches_reference(shape, mode, gated):
    _, B, T, H, HV, K, V, chunk, h0, l2, scale = shape
    assert (T < ff.RECURRENT_AS_CHUNK) == (shape[0] == "T9-chunk8-h0")
    if not gated and HV != H:
        pytest.skip("DeltaNet has no grouped value heads")
    x = make_inputs(B, T, H, HV, K, V, gated, h0)
    fn = {
        ("chunk", False): ff.chunk_delta_rule,
        ("fused_recurrent", False): ff.fused_recurrent_delta_rule,
        ("chunk", True): ff.chunk_gated_delta_rule,
        ("fused_recurrent", True): ff.fused_recurrent_gated_delta_rule,
    }[mode, gated]
    o, ht = run_ours(fn, x, gated, l2, scale, chunk if mode == "chunk" else None, kv_first=gated)
    o_ref, ht_ref = delta_rule(x["q"], x["k"], x["v"], x["beta"], x.get("g"), scale=scale, initial_state=x.get("h0"),
                               l2norm=l2, state_v_first=True)
    assert o.shape == (B, T, HV, V) and o.dtype == x["v"].dtype
    assert_close(o, o_ref, "output")
    assert_close(ht, ht_ref, "final state")
    leaves = list(x.values())
    grads = torch.autograd.grad(loss_of(o, ht), leaves)
    grads_ref = torch.autograd.grad(loss_of(o_ref, ht_ref), leaves)
    for name, gr, gr_ref in zip(x, grads, grads_ref):
        assert_close(gr, gr_ref, f"grad {name}")


def test_headwise_beta_recurrent_matches_reference():
    x = make_inputs(2, 11, 2, 2, 8, 4, gated=True, h0=True, headwise_beta=True)
    o, ht = ff.fused_recurrent_gated_delta_rule(
        x["q"],
        x["k"],
        x["v"],
        g=x["g"],
        beta=x["beta"],
        initial_state=x["h0"],
        output_final_state=True,
        state_v_first=True,
    )
    o_ref, ht_ref = delta_rule(x["q"], x["k"], x["v"], x["beta"], x["g"], initial_state=x["h0"], state_v_first=True)
    assert_close(o, o_ref, "output")
    assert_close(ht, ht_ref, "final state")


def test_chunk_rejects_headwise_beta():
    x = make_inputs(1, 8, 1, 1, 4, 4, gated=False, h0=False, headwise_beta=True)
    with pytest.raises(ValueError, match="beta"):
        ff.chunk_delta_rule(x["q"], x["k"], x["v"], x["beta"])


def test_in_kernel_gate_and_beta_sigmoid():
    """GDN layer flags: use_gate_in_kernel (A_log, dt_bias), use_beta_sigmoid_in_kernel, allow_neg_eigval."""
    B, T, H, HV, K, V = 2, 21, 2, 4, 8, 8
    x = make_inputs(B, T, H, HV, K, V, gated=False, h0=True)
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(B, T, HV, dtype=torch.float64, generator=gen)
    b_logit = torch.randn(B, T, HV, dtype=torch.float64, generator=gen)
    A_log = torch.randn(HV, dtype=torch.float64, generator=gen) * 0.5
    dt_bias = torch.randn(HV, dtype=torch.float64, generator=gen)
    for neg in (False, True):
        beta_ref = torch.sigmoid(b_logit) * (2.0 if neg else 1.0)
        g_ref = gated_deltanet_gate(a, A_log, dt_bias)
        o_ref, ht_ref = delta_rule(
            x["q"], x["k"], x["v"], beta_ref, g_ref, initial_state=x["h0"], l2norm=True, state_v_first=True
        )
        for fn, extra in ((ff.chunk_gated_delta_rule, {"chunk_size": 8}), (ff.fused_recurrent_gated_delta_rule, {})):
            o, ht = fn(
                q=x["q"],
                k=x["k"],
                v=x["v"],
                g=a,
                beta=b_logit,
                initial_state=x["h0"],
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
                use_beta_sigmoid_in_kernel=True,
                allow_neg_eigval=neg,
                state_v_first=True,
                use_gate_in_kernel=True,
                A_log=A_log,
                dt_bias=dt_bias,
                **extra,
            )
            assert_close(o, o_ref, f"{fn.__name__} output neg={neg}")
            assert_close(ht, ht_ref, f"{fn.__name__} state neg={neg}")
    with pytest.raises(ValueError, match="allow_neg_eigval"):
        ff.chunk_gated_delta_rule(x["q"], x["k"], x["v"], a, b_logit, allow_neg_eigval=True)


def test_state_layout_and_dtype():
    """GDN states are [N, HV, V, K] with state_v_first, else [N, HV, K, V]; outputs keep the input dtype."""
    B, T, H, HV, K, V = 1, 9, 1, 2, 8, 4
    q, k = torch.randn(B, T, H, K, dtype=torch.bfloat16), torch.randn(B, T, H, K, dtype=torch.bfloat16)
    v = torch.randn(B, T, HV, V, dtype=torch.bfloat16)
    g, beta = F.logsigmoid(torch.randn(B, T, HV)).bfloat16(), torch.rand(B, T, HV).bfloat16()
    o1, s1 = ff.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, state_v_first=True)
    _, s2 = ff.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, state_v_first=False)
    assert o1.dtype == torch.bfloat16 and s1.dtype == torch.float32
    assert s1.shape == (B, HV, V, K) and s2.shape == (B, HV, K, V)
    torch.testing.assert_close(s1, s2.transpose(-1, -2))
    _, none = ff.chunk_gated_delta_rule(q, k, v, g, beta)
    assert none is None


@pytest.mark.parametrize("gated", [False, True], ids=["delta", "gated"])
def test_chunk_matches_fused_recurrent_and_splits(gated):
    """chunk == fused_recurrent; running [0, t) then [t, T) with the carried state == one call; varlen == loop."""
    B, T, H, K, V = 2, 100, 2, 16, 16
    torch.manual_seed(0)
    q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, V)
    beta = torch.rand(B, T, H)
    g = F.logsigmoid(torch.randn(B, T, H) + 1)
    if gated:
        chunk = lambda *a, **kw: ff.chunk_gated_delta_rule(a[0], a[1], a[2], g[:, kw.pop("sl")], a[3], **kw)
        rec = lambda *a, **kw: ff.fused_recurrent_gated_delta_rule(
            a[0], a[1], a[2], g=g[:, kw.pop("sl")], beta=a[3], **kw
        )
    else:
        chunk = lambda *a, **kw: (kw.pop("sl"), ff.chunk_delta_rule(*a, **kw))[1]
        rec = lambda *a, **kw: (kw.pop("sl"), ff.fused_recurrent_delta_rule(*a, **kw))[1]
    full = slice(0, T)
    kw = {"use_qk_l2norm_in_kernel": True, "output_final_state": True}
    o_c, s_c = chunk(q, k, v, beta, sl=full, **kw)
    o_r, s_r = rec(q, k, v, beta, sl=full, **kw)
    torch.testing.assert_close(o_c, o_r, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(s_c, s_r, atol=1e-5, rtol=1e-4)
    t = 67
    a, b = slice(0, t), slice(t, T)
    o_a, s_a = chunk(q[:, a], k[:, a], v[:, a], beta[:, a], sl=a, **kw)
    o_b, s_b = rec(q[:, b], k[:, b], v[:, b], beta[:, b], sl=b, initial_state=s_a, **kw)
    torch.testing.assert_close(torch.cat([o_a, o_b], 1), o_c, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(s_b, s_c, atol=1e-5, rtol=1e-4)
    if not gated:  # varlen: pack the two batch rows with different lengths
        lens = [40, 75]
        packed = [torch.cat([x[0, : lens[0]], x[1, : lens[1]]])[None] for x in (q, k, v, beta)]
        cu = torch.tensor([0, lens[0], sum(lens)])
        o_p, s_p = ff.chunk_delta_rule(*packed, cu_seqlens=cu, **kw)
        for i, n in enumerate(lens):
            row = [x[i : i + 1, :n] for x in (q, k, v, beta)]
            o_i, s_i = ff.chunk_delta_rule(*row, **kw)
            torch.testing.assert_close(o_p[:, cu[i] : cu[i + 1]], o_i)
            torch.testing.assert_close(s_p[i : i + 1], s_i)


# --------------------------------------------------------------------------------------------------------------------
# short convolution
# --------------------------------------------------------------------------------------------------------------------
def conv_reference(x, weight, bias, activation):
    D, W = weight.shape
    conv = torch.nn.Conv1d(D, D, W, groups=D, padding=W - 1, bias=bias is not None).double()
    with torch.no_grad():
        conv.weight.copy_(weight[:, None].double())
        if bias is not None:
            conv.bias.copy_(bias.double())
    y = conv(x.double().transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)
    return F.silu(y) if activation == "silu" else y


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("with_bias", [False, True])
def test_causal_conv1d_matches_conv1d(activation, with_bias):
    torch.manual_seed(0)
    B, T, D, W = 2, 13, 6, 4
    x, w = torch.randn(B, T, D), torch.randn(D, W)
    b = torch.randn(D) if with_bias else None
    y, final = ff.causal_conv1d(x, w, b, activation=activation, output_final_state=True)
    torch.testing.assert_close(y.double(), conv_reference(x, w, b, activation), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, x[:, -W:].transpose(1, 2))  # cache = last W inputs, [N, D, W]
    # continuing from the cache == convolving the concatenation
    x2 = torch.randn(B, 5, D)
    y2, final2 = ff.causal_conv1d(x2, w, b, activation=activation, initial_state=final, output_final_state=True)
    y_cat = conv_reference(torch.cat([x, x2], 1), w, b, activation)
    torch.testing.assert_close(y2.double(), y_cat[:, T:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final2, torch.cat([x, x2], 1)[:, -W:].transpose(1, 2))
    # one-token steps with an in-place cache == full
    cache = torch.zeros(B, D, W)
    steps = []
    for t in range(T):
        y_t, cache_ret = ff.causal_conv1d_update(x[:, t : t + 1], cache, weight=w, bias=b, activation=activation)
        assert cache_ret is cache
        steps.append(y_t)
    torch.testing.assert_close(torch.cat(steps, 1), y, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(cache, final)


def test_short_convolution_module_step_matches_full():
    torch.manual_seed(0)
    B, T, D, W = 2, 9, 8, 4
    conv = ShortConvolution(D, W, activation="silu")
    x = torch.randn(B, T, D)
    with torch.no_grad():
        y_full, _ = conv(x)
        torch.testing.assert_close(
            y_full.double(), conv_reference(x, conv.weight[:, 0], None, "silu"), atol=1e-5, rtol=1e-5
        )
        y_pre, cache = conv(x[:, :4], output_final_state=True)
        outs = [y_pre]
        for t in range(4, T):
            y_t, cache = conv(x[:, t : t + 1], cache=cache, output_final_state=True)
            outs.append(y_t)
    torch.testing.assert_close(torch.cat(outs, 1), y_full, atol=1e-6, rtol=1e-5)
    y, _ = conv(x.requires_grad_())
    y.sum().backward()
    assert conv.weight.grad is not None and x.grad is not None


# --------------------------------------------------------------------------------------------------------------------
# norms, swiglu, loss
# --------------------------------------------------------------------------------------------------------------------
def test_rms_norm_module_and_prenorm():
    torch.manual_seed(0)
    D, eps = 16, 1e-5
    norm = RMSNorm(D, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(D))
    x, res = torch.randn(3, 5, D), torch.randn(3, 5, D)
    expected = lambda h: h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm.weight
    torch.testing.assert_close(norm(x), expected(x))
    y, h = norm(x, residual=res, prenorm=True)
    torch.testing.assert_close(h, x + res)
    torch.testing.assert_close(y, expected(x + res))
    y, h = norm(x.bfloat16(), prenorm=True, residual_in_fp32=True)
    assert y.dtype == torch.bfloat16 and h.dtype == torch.float32


@pytest.mark.parametrize("activation", ["swish", "sigmoid"])
def test_fused_rms_norm_gated(activation):
    torch.manual_seed(0)
    D, eps = 8, 1e-6
    norm = FusedRMSNormGated(D, eps=eps, activation=activation)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(D))
    x, g = torch.randn(2, 3, 4, D), torch.randn(2, 3, 4, D)
    act = F.silu(g) if activation == "swish" else torch.sigmoid(g)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm.weight * act
    torch.testing.assert_close(norm(x, g), expected)


@pytest.mark.parametrize("fuse_swiglu", [False, True])
def test_gated_mlp(fuse_swiglu):
    torch.manual_seed(0)
    mlp = GatedMLP(hidden_size=16, intermediate_size=24, fuse_swiglu=fuse_swiglu)
    x = torch.randn(2, 5, 16, requires_grad=True)
    expected = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    y = mlp(x)
    torch.testing.assert_close(y, expected)
    y.sum().backward()
    assert mlp.gate_proj.weight.grad is not None and mlp.down_proj.weight.grad is not None


def test_l2norm_and_elu_p1():
    x = torch.randn(4, 7)
    torch.testing.assert_close(ff.l2norm(x), x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6))
    from fla.modules import L2Norm
    from fla.modules.activations import elu_p1

    torch.testing.assert_close(L2Norm()(x), ff.l2norm(x))
    torch.testing.assert_close(elu_p1(x), torch.where(x > 0, x + 1, torch.exp(x)))


def test_fused_cross_entropy_on_cpu():
    torch.manual_seed(0)
    logits, target = torch.randn(10, 17, requires_grad=True), torch.randint(0, 17, (10,))
    target[3] = -100
    torch.testing.assert_close(FusedCrossEntropyLoss()(logits, target), F.cross_entropy(logits, target))
    torch.testing.assert_close(
        FusedCrossEntropyLoss(label_smoothing=0.1)(logits, target), F.cross_entropy(logits, target, label_smoothing=0.1)
    )
    torch.testing.assert_close(
        FusedCrossEntropyLoss(reduction="sum")(logits, target), F.cross_entropy(logits, target, reduction="sum")
    )


# --------------------------------------------------------------------------------------------------------------------
# install / dispatch
# --------------------------------------------------------------------------------------------------------------------
def test_install_idempotent_and_dispatch():
    ff.install()
    ff.install()
    wrapped = fla_delta_net.chunk_delta_rule
    original = wrapped._statereduce_original
    assert not hasattr(original, "_statereduce_original")  # wrapped exactly once
    assert original.__module__ == "fla.ops.delta_rule.chunk"
    for mod, name in [
        (fla_delta_net, "fused_recurrent_delta_rule"),
        (fla_gdn, "chunk_gated_delta_rule"),
        (fla_gdn, "fused_recurrent_gated_delta_rule"),
        (fla_gdn, "causal_conv1d"),
    ]:
        assert hasattr(getattr(mod, name), "_statereduce_original"), f"{mod.__name__}.{name} not patched"
    q = torch.randn(1, 4, 1, 8)
    try:  # route CPU to fla's own kernel: it refuses float32, which proves the dispatch went there
        ff.install(torch_device_types=("meta",))
        with pytest.raises(AssertionError, match="float32"):
            fla_delta_net.chunk_delta_rule(q, q, q, torch.rand(1, 4, 1))
    finally:
        ff.install()
    o, _ = fla_delta_net.chunk_delta_rule(q, q, q, torch.rand(1, 4, 1))
    assert o.shape == q.shape
    with pytest.raises(ValueError, match="torch_device_types"):
        ff.install(torch_device_types=())


def test_uninstall_restores_originals():
    original = fla_delta_net.chunk_delta_rule._statereduce_original
    try:
        ff.uninstall()
        assert fla_delta_net.chunk_delta_rule is original
        assert not ff.is_installed()
    finally:
        ff.install()
    assert ff.is_installed()


# --------------------------------------------------------------------------------------------------------------------
# whole stock fla models on CPU
# --------------------------------------------------------------------------------------------------------------------
def tiny_models():
    """Stock fla models of the tests' small shapes (hidden 32, d_k 16), vocabulary 64: DeltaNet with and without its
    output gate, Gated DeltaNet with 4 value heads on 2 key heads (GVA)."""
    dn = DeltaNetConfig(**tiny_arch("delta_net", small=True, vocab_size=64), fuse_cross_entropy=False, use_gate=False)
    dn_gate = DeltaNetConfig(**tiny_arch("delta_net", small=True, num_hidden_layers=1, vocab_size=64),
                             fuse_cross_entropy=False, use_gate=True)
    gdn = GatedDeltaNetConfig(**tiny_arch("gated_deltanet", small=True, num_v_heads=4, vocab_size=64),
                              fuse_cross_entropy=False)
    return [
        ("deltanet", DeltaNetForCausalLM, dn),
        ("deltanet-gate", DeltaNetForCausalLM, dn_gate),
        ("gdn-gva", GatedDeltaNetForCausalLM, gdn),
    ]


MODELS = tiny_models()


def _build(cls, cfg, seed=0):
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():  # fla's init leaves some norms at ones: perturb so errors in them would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("name,cls,cfg", MODELS, ids=[m[0] for m in MODELS])
def test_model_train_step(name, cls, cfg):
    assert cfg.fuse_norm and cfg.fuse_swiglu  # fla defaults: fused paths are the ones exercised
    model = _build(cls, cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (2, 80))  # > 64 tokens: chunk mode
    out = model(input_ids=ids, labels=ids)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.any())]
    assert not missing, f"no gradient for {missing}"
    # the fused cross-entropy path gives the same loss on CPU
    model.config.fuse_cross_entropy = True
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, out.loss.detach())
    model.config.fuse_cross_entropy = False


@pytest.mark.parametrize("prefill", [0, 70], ids=["token-by-token", "prefill70"])
@pytest.mark.parametrize("name,cls,cfg", MODELS, ids=[m[0] for m in MODELS])
def test_model_cached_decoding_matches_full_forward(name, cls, cfg, prefill):
    model = _build(cls, cfg).eval()
    T = 80 if prefill else 12
    ids = torch.randint(0, cfg.vocab_size, (2, T))
    with torch.no_grad():
        full = model(input_ids=ids).logits
        steps, pkv = [], None
        if prefill:
            out = model(input_ids=ids[:, :prefill], use_cache=True)
            steps.append(out.logits)
            pkv = out.past_key_values
        for t in range(prefill, T):
            out = model(input_ids=ids[:, t : t + 1], past_key_values=pkv, use_cache=True)
            steps.append(out.logits)
            pkv = out.past_key_values
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-4, rtol=1e-4)
    # the grad-enabled (training-mode kernels, GDN fused qkv conv) forward agrees as well
    torch.testing.assert_close(model(input_ids=ids).logits.detach(), full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name,cls,cfg", MODELS[::2], ids=[m[0] for m in MODELS[::2]])
def test_model_attention_mask_varlen(name, cls, cfg):
    """A left-padded batch goes through fla's packed (cu_seqlens) path; each row equals its unpadded forward."""
    model = _build(cls, cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 72))
    mask = torch.ones(2, 72, dtype=torch.long)
    mask[1, :25] = 0
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(out[0], model(input_ids=ids[:1]).logits[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(out[1, 25:], model(input_ids=ids[1:, 25:]).logits[0], atol=1e-5, rtol=1e-4)
