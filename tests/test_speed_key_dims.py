"""Per-layer key widths in the speed benchmark (:mod:`statereduce.speed.bench`): a random model of the unpruned shape
with each mixer shaped to its own d_k', its byte floor and state bytes against the uniform cut of the same total,
its decoding through every routed kernel (CPU, Triton's interpreter), the document's ratios and the command line.
The GPU check (``-m gpu``) decodes such a model through CUDA graphs against fla's own decoding."""

from __future__ import annotations

import json
import os

import pytest
import _fresh as fresh
import torch
from _models import tiny_arch, tiny_inputs
from _paths import ROOT
from _speed import fake_gpu

from statereduce.adapters import adapter_class, get_adapter
from statereduce.core.slicing import KEY_DIMS_FIELD
from statereduce.speed import bench as speed

FAMILIES = ["delta_net", "gated_deltanet"]
# 4 layers of 2 heads, d_k = 32 (DeltaNet d_v 32, Gated DeltaNet d_v 64): the widths keep 16 channels a layer on
# average, the uniform cut at 50 %; 24 is not a power of two (fla's kernels tile it at 32)
WIDTHS = [8, 24, 24, 8]


def _arch(family):
    return tiny_arch(family, num_hidden_layers=4)


@pytest.mark.parametrize("family", FAMILIES)
def test_per_layer_model_has_each_width_and_the_uniform_bytes(family):
    arch = _arch(family)
    ad = adapter_class(family)
    config = speed.model_config(family, arch, key_dims=WIDTHS)
    assert getattr(config, KEY_DIMS_FIELD) == WIDTHS and ad.dims(config).head_k_dim == 32  # unpruned head sizes
    model = speed.build_model(config, torch.float32, device="cpu")
    uniform_config = speed.model_config(family, arch, 50)
    uniform = speed.build_model(uniform_config, torch.float32, device="cpu")
    h, hv, _, d_v = ad.dims(config)
    mixers = get_adapter(model).mixer_layers()
    for (layer, mixer), w in zip(mixers, WIDTHS):
        assert mixer.head_k_dim == w and mixer.key_dim == h * w, layer
        assert mixer.q_proj.out_features == mixer.k_proj.out_features == h * w
        assert mixer.q_conv1d.weight.shape[0] == mixer.k_conv1d.weight.shape[0] == h * w
        assert mixer.v_proj.out_features == hv * d_v  # the value side is untouched
    # equal totals: the same parameters, state and conv caches, so the same bytes per step
    for batch in (1, 3):
        assert speed.step_bytes(model, config, family, batch) == speed.step_bytes(uniform, uniform_config, family,
                                                                                  batch)
    # the counted state is the cache a prefill leaves (float32 model: every state tensor 4 bytes an element)
    ids = tiny_inputs(batch=3, length=9)
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    from statereduce.speed.inplace import cache_tensors

    tensors = cache_tensors(model, cache)
    assert 2 * sum(t.numel() * 4 for t in tensors) == speed.step_bytes(model, config, family, 3)["state"]
    recurrent = [cache[i]["recurrent_state"] for i, _ in mixers]
    k_axis = -1 if ad.cache_state_v_first else -2
    assert [s.shape[k_axis] for s in recurrent] == WIDTHS
    record = speed.key_dims_record(family, arch, WIDTHS, [0, 50, 75])
    assert (record["pct"], record["uniform_pct"], record["total_channels"]) == (50.0, 50, h * sum(WIDTHS))
    assert record["state_bytes_per_sequence"] == sum(s.numel() for s in recurrent) // 3 * 4
    assert [s.d_k for s in speed.layer_state_shapes(family, config)] == WIDTHS


@pytest.mark.parametrize("widths,msg", [
    ([8, 24], r"key_dims has 2 widths; the delta_net model has 4 decoder layers, 4 of them with linear attention"),
    ([8, 24, None, 8], r"key_dims names widths for layers \[0, 1, 3\]; the model's linear-attention layers are "
                       r"\[0, 1, 2, 3\]"),
    ([8, 24, 24, 40], r"key_dims\[3\]: d_k'=40 is invalid for delta_net; valid: an integer in \[1, d_k=32\]"),
    ([8, 24, 24.0, 8], r"key_dims\[2\]=24.0 is not an integer width"),
])
def test_bad_key_dims_fail_with_one_line(widths, msg):
    with pytest.raises(ValueError, match=msg):
        speed.model_config("delta_net", _arch("delta_net"), key_dims=widths)


def test_key_dims_exclude_a_pct():
    with pytest.raises(ValueError, match="give a pct or per-layer key_dims, not both"):
        speed.model_config("delta_net", _arch("delta_net"), 50, key_dims=WIDTHS)


def test_parse_key_dims_from_a_list_a_budget_file_or_a_checkpoint_config(tmp_path):
    assert speed.parse_key_dims("16,48,null", 2) == ("key_dims_2", [16, 48, None])
    assert speed.parse_key_dims("ramp=16, 32,48") == ("ramp", [16, 32, 48])
    (tmp_path / "budget.json").write_text(json.dumps({"widths": [8, 24], "total": 64, "policy": "energy"}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "delta_net", KEY_DIMS_FIELD: [8, None]}))
    assert speed.parse_key_dims(str(tmp_path / "budget.json")) == ("budget", [8, 24])
    assert speed.parse_key_dims(f"ckpt={tmp_path / 'config.json'}") == ("ckpt", [8, None])
    with pytest.raises(ValueError, match=r"--key-dims '16,x': 'x' is not a width"):
        speed.parse_key_dims("16,x")
    with pytest.raises(ValueError, match="not found"):
        speed.parse_key_dims("missing.json")
    with pytest.raises(ValueError, match="may hold only letters"):
        speed.parse_key_dims("a b=16")


def test_key_dims_ratios_against_the_uniform_cut_and_the_table():
    def dec(b, kernel, ms, total, state, **tag):
        return {**tag, "batch": b, "kernel": kernel, "ms": ms, "floor_fraction": 0.5,
                "bytes": {"total": total, "state": state}, "peak_mem_bytes": 1, "peak_mem_delta_bytes": 1}

    record = {"widths": [16, 48] * 2, "pct": 75.0, "uniform_pct": 75, "decode": [dec(64, "fla", 1.1, 50, 20)],
              "prefill": [{"batch": 1, "length": 2048, "ms": 2.0}]}
    doc = {"decode": [dec(64, "fla", 4.0, 100, 80, pct=0), dec(64, "fla", 1.0, 50, 20, pct=75)],
           "prefill": [{"pct": 0, "batch": 1, "length": 2048, "ms": 3.0}], "key_dims": {"pm16": record}}
    ratios = speed.speed_ratios(doc)
    assert [r["pct"] for r in ratios["decode"]] == [75]  # the uniform rows stay as they are
    d, p = ratios["key_dims"]
    assert d == pytest.approx({"key_dims": "pm16", "part": "decode", "pct": 75.0, "batch": 64, "kernel": "fla",
                               "ms": 1.1, "speedup": 4.0 / 1.1, "uniform_pct": 75, "uniform_ms": 1.0,
                               "vs_uniform": 1.1, "bytes_vs_uniform": 1.0, "state_bytes_vs_uniform": 1.0})
    assert p["speedup"] == 1.5 and "vs_uniform" not in p  # no uniform prefill cell measured
    table = speed.key_dims_markdown(doc)
    assert "| pm16 | 2×48 + 2×16 | 75 | decode | 64 | fla | 1.000 | 1.100 | 1.100 | 1.000 |" in table
    assert "| pm16 | 2×48 + 2×16 | 75 | prefill | 1 | 2048 | – | 2.000 | – | – |" in table
    assert "key_dims" not in speed.speed_ratios({k: v for k, v in doc.items() if k != "key_dims"})


def test_run_speed_times_the_allocations_after_the_ratios(tmp_path, monkeypatch):
    """run_speed's flow without a GPU (the measurements replaced by a fake that reports the step's bytes as its
    time): the uniform ratios' cells as before, each allocation's cells under ``key_dims`` with the equal-total pct,
    and their ratios against the uniform cut; the mixer part leaves the allocations out."""
    built = fake_gpu(monkeypatch)
    settings = speed.speed_settings({"pcts": [50], "dtype": "float32",
                                     "decode": {"batches": [2], "kernels": ["fla", "statereduce+fused"]}})
    doc = speed.run_speed("delta_net", _arch("delta_net"), settings, tmp_path / "s.json", parts=["decode", "mixer"],
                          key_dims={"wide": [32, 32, 24, 24], "mixed": WIDTHS})
    # each allocation right after the uniform cut of its total; one that matches none after every ratio
    assert [getattr(c, KEY_DIMS_FIELD, None) for c in built] == [None, None, WIDTHS, [32, 32, 24, 24]]
    assert [c.num_hidden_layers for c in built] == [4] * 4
    assert [c["pct"] for c in doc["decode"]] == [0, 0, 50, 50] and len(doc["mixer"]) == 2
    mixed, wide = doc["key_dims"]["mixed"], doc["key_dims"]["wide"]
    assert (mixed["pct"], mixed["uniform_pct"], wide["pct"], wide["uniform_pct"]) == (50.0, 50, 12.5, None)
    assert mixed["state_bytes_per_sequence"] == doc["configs"]["50"]["state_bytes_per_sequence"]
    assert [c["kernel"] for c in mixed["decode"]] == ["fla", "statereduce+fused"] and "mixer" not in mixed
    rows = doc["ratios"]["key_dims"]
    assert [(r["key_dims"], r.get("vs_uniform")) for r in rows] == [("wide", None), ("wide", None), ("mixed", 1.0),
                                                                     ("mixed", 1.0)]
    assert json.loads((tmp_path / "s.json").read_text())["key_dims"]["mixed"]["widths"] == WIDTHS


def test_cli_checks_key_dims_before_cuda(tmp_path, capsys):
    args = [str(tmp_path / "out.json"), "--family", "delta_net", "--arch", json.dumps(_arch("delta_net"))]
    assert speed.main([*args, "--key-dims", "8,24"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: key_dims has 2 widths;")
    assert speed.main([*args, "--key-dims", "a=8,24,24,8", "--key-dims", "a=16,16,16,16"]) == 2
    assert "error: --key-dims name 'a' given twice" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert speed.main([*args, "--key-dims", "8,24,24,8"]) == 2
        assert "error: speed benchmarks need a CUDA GPU" in capsys.readouterr().err


DECODE_CHECK = """
import sys, torch
sys.path.insert(0, {tests!r})
from _models import tiny_inputs
from statereduce.kernels import conv
from statereduce.speed import bench as speed, inplace

conv_step, calls = conv.conv_step, []
conv.conv_step = lambda *a, **k: calls.append(1) or conv_step(*a, **k)  # one launch per fused layer step
for family, arch in {archs!r}.items():
    config = speed.model_config(family, arch, key_dims={widths!r})
    model = speed.build_model(config, torch.float32, device="cpu")
    ids, steps = tiny_inputs(batch=2, length=12), tiny_inputs(batch=2, length=2, seed=7)
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        ref = [model(steps[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(2)]
        for kernel in ("statereduce", "fla_copy", "statereduce+fused", "fla_copy+fused"):
            calls.clear()
            with inplace.inplace_decode(kernel, device_types=("cpu",)):
                cache = model(ids, use_cache=True).past_key_values
                states = [cache[i]["recurrent_state"] for i in range(len(cache))]
                got = [model(steps[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(2)]
                assert all(cache[i]["recurrent_state"] is s for i, s in enumerate(states)), kernel  # in place
            assert len(calls) == (2 * len(states) if kernel.endswith("+fused") else 0), (kernel, len(calls))
            for r, g in zip(ref, got):
                torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5, msg=lambda m: f"{{family}} {{kernel}}: {{m}}")
            print(family, kernel, "ok")
"""


@pytest.mark.slow  # default tier under 3 min: a child process or a whole run; .ci/run runs it
def test_per_layer_model_decodes_through_every_routed_kernel_under_interpreter():
    """The stock layers with our in-place kernel and with fla's function plus a copy, and the fused step (packed
    projections, one conv launch per layer) around either, decode a model whose layers keep 8, 24, 24 and 8 channels
    like its plain decoding (CPU: Triton's interpreter for our kernels, the torch fallbacks for fla's)."""
    archs = {f: _arch(f) for f in FAMILIES}
    code = DECODE_CHECK.format(tests=str(ROOT / "tests"), archs=archs, widths=WIDTHS)
    out = fresh.run(["-c", code], timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"}, preload=fresh.TORCH)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count(" ok") == 8, out.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_per_layer_graph_decode_matches_fla_on_gpu(family):
    """On CUDA: every decode kernel of the benchmark (stock and fused) replays a CUDA graph of a bf16 model whose layers
    keep 16, 48, 48 and 16 of 64 channels like fla's own eager decoding, and counts the uniform cut's bytes."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from statereduce.speed.inplace import FUSED, KERNELS

    arch = tiny_arch(family, vocab_size=512, num_hidden_layers=4, hidden_size=256, num_heads=4,
                     **({"expand_k": 1.0, "expand_v": 1.0} if family == "delta_net" else {"head_dim": 64}))
    config = speed.model_config(family, arch, key_dims=[16, 48, 48, 16])
    model = speed.build_model(config, torch.bfloat16)
    uniform_config = speed.model_config(family, arch, 50)
    uniform = speed.build_model(uniform_config, torch.bfloat16)
    assert speed.step_bytes(model, config, family, 8) == speed.step_bytes(uniform, uniform_config, family, 8)
    for kernel in [*KERNELS, *(k + FUSED for k in KERNELS)]:
        decoder = speed.GraphDecoder(model, batch=8, prompt=64, kernel=kernel)
        assert speed.check_decoder(model, decoder, steps=3) < 0.05, kernel
