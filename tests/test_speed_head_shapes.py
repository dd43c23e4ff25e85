"""Head shapes in the speed benchmark (:mod:`statereduce.speed.bench`): a uniform cut of keys and values (d_k' x d_v'
per head, e.g. values only, or both sides) built from the config fields a stock checkpoint with that cut has, its
state fraction and byte floor, its decoding through every routed kernel (CPU, Triton's interpreter), the document's
ratios, the table against the key-only ratios, and the command line. The GPU check (``-m gpu``) decodes such a
model through CUDA graphs against fla's own decoding."""

from __future__ import annotations

import json
import os

import _fresh as fresh
import pytest
import torch
from _models import tiny_arch, tiny_inputs
from _paths import ROOT
from _speed import fake_gpu

from statereduce.adapters import adapter_class, get_adapter
from statereduce.speed import bench as speed

FAMILIES = ["delta_net", "gated_deltanet"]
# 4 layers of 2 heads, d_k = 32; DeltaNet d_v 32, Gated DeltaNet d_v 64. Per family: values only at half the state,
# and a joint cut with widths that are not powers of two (fla's kernels and ours tile them at 32 and 64)
SHAPES = {"delta_net": {"values": (32, 16), "joint": (24, 24)},
          "gated_deltanet": {"values": (32, 32), "joint": (24, 40)}}


def _arch(family):
    return tiny_arch(family, num_hidden_layers=4)


@pytest.mark.parametrize("family", FAMILIES)
def test_head_shape_model_has_both_widths_and_the_bytes_of_its_state(family):
    arch = _arch(family)
    ad = adapter_class(family)
    full = ad.dims(ad.config_class(**arch))
    for name, (d_k, d_v) in SHAPES[family].items():
        config = speed.head_shape_config(family, arch, d_k, d_v)
        assert (ad.dims(config).head_k_dim, ad.dims(config).head_v_dim) == (d_k, d_v)
        model = speed.build_model(config, torch.float32, device="cpu")
        h, hv = full.num_heads, full.num_v_heads
        for layer, mixer in get_adapter(model).mixer_layers():
            assert (mixer.head_k_dim, mixer.head_v_dim) == (d_k, d_v), (name, layer)
            assert mixer.q_proj.out_features == mixer.k_proj.out_features == h * d_k
            assert mixer.v_proj.out_features == mixer.o_proj.in_features == hv * d_v
        record = speed.head_shape_record(family, arch, d_k, d_v)
        assert record["state_fraction"] == pytest.approx(d_k * d_v / (full.head_k_dim * full.head_v_dim))
        assert (record["d_k"], record["d_v"], record["full_d_k"], record["full_d_v"]) == (d_k, d_v, full.head_k_dim,
                                                                                          full.head_v_dim)
        # the counted state is the cache a prefill leaves (float32 model: every state tensor 4 bytes an element)
        ids = tiny_inputs(batch=3, length=9)
        with torch.no_grad():
            cache = model(ids, use_cache=True).past_key_values
        from statereduce.speed.inplace import cache_tensors

        assert 2 * sum(t.numel() * 4 for t in cache_tensors(model, cache)) == speed.step_bytes(model, config, family,
                                                                                                3)["state"]
        recurrent = [cache[i]["recurrent_state"] for i, _ in get_adapter(model).mixer_layers()]
        assert record["state_bytes_per_sequence"] == sum(s.numel() for s in recurrent) // 3 * 4
    # a key-only head shape is the key ratio's config
    key_only = speed.head_shape_config(family, arch, 16, full.head_v_dim)
    assert key_only.to_dict() == speed.model_config(family, arch, 50).to_dict()
    assert speed.head_shape_config(family, arch, 32, full.head_v_dim).to_dict() == speed.model_config(
        family, arch).to_dict()


def test_head_shapes_refuse_what_the_family_cannot_build():
    with pytest.raises(ValueError, match=r"d_v'=48 is invalid for delta_net; valid: an integer in \[1, d_v=32\]"):
        speed.head_shape_config("delta_net", _arch("delta_net"), 32, 48)
    with pytest.raises(ValueError, match=r"d_k'=40 is invalid for delta_net"):
        speed.head_shape_config("delta_net", _arch("delta_net"), 40, 16)
    with pytest.raises(ValueError, match="mamba2's config cannot hold d_v'=8"):
        speed.head_shape_config("mamba2", tiny_arch("mamba2"), *_mamba2_widths())


def _mamba2_widths():
    ad = adapter_class("mamba2")
    d = ad.dims(ad.config_class(**tiny_arch("mamba2")))
    return d.head_k_dim, 8


def test_parse_head_shape():
    assert speed.parse_head_shape("values50=128x64") == ("values50", (128, 64))
    assert speed.parse_head_shape("88X96", 3) == ("head_shape_3", (88, 96))
    for bad in ("128", "a=128x", "128x64x2", "x=1.5x64"):
        with pytest.raises(ValueError, match=r"give \[NAME=\]DKxDV"):
            speed.parse_head_shape(bad)
    with pytest.raises(ValueError, match="may hold only letters"):
        speed.parse_head_shape("a b=16x16")


def _fake_run(tmp_path, monkeypatch, family, head_shapes, parts=("decode", "mixer")):
    """run_speed's flow without a GPU: the measurements replaced by a fake that reports the step's bytes as its
    time."""
    built = fake_gpu(monkeypatch)
    settings = speed.speed_settings({"pcts": [50], "dtype": "float32",
                                     "decode": {"batches": [2], "kernels": ["fla", "statereduce+fused"]}})
    doc = speed.run_speed(family, _arch(family), settings, tmp_path / "s.json", parts=list(parts),
                          head_shapes=head_shapes)
    return doc, built


def test_run_speed_times_the_head_shapes_after_the_ratios(tmp_path, monkeypatch):
    ad = adapter_class("delta_net")
    doc, built = _fake_run(tmp_path, monkeypatch, "delta_net", SHAPES["delta_net"])
    dims = [(ad.dims(c).head_k_dim, ad.dims(c).head_v_dim) for c in built]
    assert dims == [(32, 32), (16, 32), (32, 16), (24, 24)]  # baseline, keys 50 %, then the head shapes
    assert [c["pct"] for c in doc["decode"]] == [0, 0, 50, 50] and len(doc["mixer"]) == 2
    values, joint = doc["head_shapes"]["values"], doc["head_shapes"]["joint"]
    assert (values["state_fraction"], joint["state_fraction"]) == (0.5, 24 * 24 / 32**2)
    assert values["state_bytes_per_sequence"] == doc["configs"]["50"]["state_bytes_per_sequence"]
    assert [c["kernel"] for c in values["decode"]] == ["fla", "statereduce+fused"] and "mixer" not in values
    rows = doc["ratios"]["head_shapes"]
    assert [(r["head_shape"], r["kernel"]) for r in rows] == [("values", "fla"), ("values", "statereduce+fused"),
                                                              ("joint", "fla"), ("joint", "statereduce+fused")]
    for r in rows:  # the fake's time is the bytes: speedup = ideal speedup
        assert r["speedup"] == pytest.approx(r["ideal_speedup"]) and r["speedup"] > 1
    saved = json.loads((tmp_path / "s.json").read_text())
    assert saved["head_shapes"]["joint"]["d_k"] == 24 and saved["ratios"]["head_shapes"] == rows
    lines = speed.head_shapes_markdown(doc).splitlines()
    assert lines[0] == "| cut | d_k' × d_v' | state | B | kernel | ms/token | speedup | ideal |"
    # per kernel: the baseline, then by state (the joint cut keeps 56 %), key-only before the head shapes
    assert [line.split(" | ")[0][2:] for line in lines[2:]] == ["baseline", "joint", "keys 50 %", "values"] * 2
    assert [line.split(" | ")[4] for line in lines[2:]] == ["fla"] * 4 + ["statereduce+fused"] * 4
    base = next(c for c in doc["decode"] if c["pct"] == 0 and c["kernel"] == "fla")
    assert lines[2] == f"| baseline | 32 × 32 | 100.0 % | 2 | fla | {base['ms']:.3f} | 1.00× | 1.00× |"
    r = rows[0]
    assert lines[5] == (f"| values | 32 × 16 | 50.0 % | 2 | fla | {r['ms']:.3f} | {r['speedup']:.2f}× | "
                        f"{r['ideal_speedup']:.2f}× |")
    assert lines[3].startswith("| joint | 24 × 24 | 56.2 % | 2 | fla |")
    assert lines[4].startswith("| keys 50 % | 16 × 32 | 50.0 % | 2 | fla |")


def test_default_run_has_no_head_shapes(tmp_path, monkeypatch):
    doc, built = _fake_run(tmp_path, monkeypatch, "gated_deltanet", None, parts=("decode",))
    assert "head_shapes" not in doc and "head_shapes" not in doc["ratios"] and len(built) == 2


def test_cli_checks_head_shapes_before_cuda(tmp_path, capsys):
    args = [str(tmp_path / "out.json"), "--family", "delta_net", "--arch", json.dumps(_arch("delta_net"))]
    assert speed.main([*args, "--head-shape", "v=32x48"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: d_v'=48 is invalid for delta_net")
    assert speed.main([*args, "--head-shape", "a=32x16", "--head-shape", "a=16x32"]) == 2
    assert "error: --head-shape name 'a' given twice" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert speed.main([*args, "--head-shape", "32x16"]) == 2
        assert "error: speed benchmarks need a CUDA GPU" in capsys.readouterr().err


DECODE_CHECK = """
import sys, torch
sys.path.insert(0, {tests!r})
from _models import tiny_inputs
from statereduce.speed import bench as speed, inplace

for family, (arch, shapes) in {cases!r}.items():
    for name, (d_k, d_v) in shapes.items():
        model = speed.build_model(speed.head_shape_config(family, arch, d_k, d_v), torch.float32, device="cpu")
        ids, steps = tiny_inputs(batch=2, length=12), tiny_inputs(batch=2, length=2, seed=7)
        with torch.no_grad():
            cache = model(ids, use_cache=True).past_key_values
            ref = [model(steps[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(2)]
            for kernel in ("statereduce", "fla_copy", "statereduce+fused", "fla_copy+fused"):
                with inplace.inplace_decode(kernel, device_types=("cpu",)):
                    cache = model(ids, use_cache=True).past_key_values
                    states = [cache[i]["recurrent_state"] for i in range(len(cache))]
                    got = [model(steps[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(2)]
                    assert all(cache[i]["recurrent_state"] is s for i, s in enumerate(states)), kernel  # in place
                for r, g in zip(ref, got):
                    torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5,
                                               msg=lambda m: f"{{family}} {{name}} {{kernel}}: {{m}}")
                print(family, name, kernel, "ok")
"""


@pytest.mark.slow
def test_head_shapes_decode_through_every_routed_kernel_under_interpreter():
    """The stock layers with our in-place kernel and with fla's function plus a copy, and the fused step around
    either, decode models cut on the value side (and on both sides, at widths that are not powers of two) like their
    plain decoding (CPU: Triton's interpreter for our kernels, the torch fallbacks for fla's)."""
    cases = {f: (_arch(f), SHAPES[f]) for f in FAMILIES}
    code = DECODE_CHECK.format(tests=str(ROOT / "tests"), cases=cases)
    out = fresh.run(["-c", code], timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"}, preload=fresh.TORCH)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count(" ok") == 16, out.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_head_shape_graph_decode_matches_fla_on_gpu(family):
    """On CUDA: every decode kernel of the benchmark (stock and fused) replays a CUDA graph of a bf16 model cut to
    half its value channels, and of one cut on both sides, like fla's own eager decoding."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from statereduce.speed.inplace import FUSED, KERNELS

    arch = tiny_arch(family, vocab_size=512, num_hidden_layers=4, hidden_size=256, num_heads=4,
                     **({"expand_k": 1.0, "expand_v": 1.0} if family == "delta_net" else {"head_dim": 64}))
    d_v = 64 if family == "delta_net" else 128
    for d_k_cut, d_v_cut in ((64, d_v // 2), (48, 3 * d_v // 4)):
        model = speed.build_model(speed.head_shape_config(family, arch, d_k_cut, d_v_cut), torch.bfloat16)
        for kernel in [*KERNELS, *(k + FUSED for k in KERNELS)]:
            decoder = speed.GraphDecoder(model, batch=8, prompt=64, kernel=kernel)
            assert speed.check_decoder(model, decoder, steps=3) < 0.05, (d_k_cut, d_v_cut, kernel)
