"""Compensation after the cut (statereduce.core.fit, method tokens ``+<fit>``), tiny random CPU models.

1. The solver: where the unpruned projection input is an exact linear map of the pruned one, the fit reproduces the
   unpruned output to float64 precision; where nothing changed, it returns the plain cut's weights.
2. With nothing cut the fit changes nothing (no layer is fitted, every weight is bit-identical).
3. A planted model, in all four families: every value head's second half of value channels duplicates its first half
   (value rows, their conv, the output gate, the output norm's weight; written from the families' documented layouts
   in test_values, not the package's), and the cut keeps the first half. The dropped channels are then exact linear
   combinations of kept ones, so the fitted checkpoint reproduces the unpruned logits to float precision, where the
   plain cut does not.
4. The fitted checkpoint reloads in a fresh process with identical logits.
5. The artifact round trip and its one-line errors; tokens, config and the rule's inputs.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from _models import tiny_inputs, tiny_model
from statereduce.adapters import get_adapter
from statereduce.common.settings import FitSettings
from statereduce.core.artifacts import ArtifactError
from statereduce.core.tokenizer import byte_level_tokenizer
from statereduce.core.fit import (
    FitResult,
    LayerStats,
    apply_fit,
    fit_out_projections,
    out_projections,
    read_fit,
    solve_projection,
    write_fit,
)
from statereduce.stages.prune import prune_model, save_pruned
from test_values import logits, rel, value_layout

META = {"method": "custom", "pct": 50, "source_model": "tiny-test"}
TINY_EPS = 1e-30  # the planted relation is exact through the output norms only without their eps (a token whose
# readout is ~1e-6 has a mean square near 1e-12)
# family -> config overrides (tiny eps) and the modules of the output gate (rows as the value rows, head-major)
PLANTED = {
    "delta_net": ({"norm_eps": TINY_EPS}, []),
    "gated_deltanet": ({"norm_eps": TINY_EPS}, [("g_proj", 0)]),
    "qwen3_5": ({"rms_norm_eps": TINY_EPS}, [("in_proj_z", 0)]),
    "mamba2": ({"layer_norm_epsilon": TINY_EPS}, [("in_proj", 0)]),  # z rows [0, I)
}


def _stats(z: torch.Tensor, zp: torch.Tensor) -> LayerStats:
    return LayerStats(z.T @ zp, zp.T @ zp, z.T @ z, z.shape[0])


def test_solver_recovers_an_exact_linear_relation():
    g = torch.Generator().manual_seed(0)
    zp = torch.randn(500, 6, generator=g, dtype=torch.float64)
    a = torch.randn(10, 6, generator=g, dtype=torch.float64)
    z = zp @ a.T  # the unpruned input: 10 channels, each a linear combination of the 6 kept ones
    w_o = torch.randn(7, 10, generator=g, dtype=torch.float64)
    w_p = w_o[:, :6] * 1.7  # any plain cut
    new = solve_projection(w_o, w_p, _stats(z, zp), [(torch.arange(10), torch.arange(6))], scale=1.7,
                           damping=1e-12)
    assert torch.allclose(zp @ new.T, 1.7 * z @ w_o.T, rtol=0, atol=1e-8)
    assert not torch.allclose(zp @ w_p.T, 1.7 * z @ w_o.T, atol=1e-2)


@pytest.mark.parametrize("damping", [1e-6, 0.1, 10.0])
def test_solver_keeps_the_weights_where_nothing_changed(damping):
    g = torch.Generator().manual_seed(1)
    z = torch.randn(300, 8, generator=g, dtype=torch.float64)
    w = torch.randn(5, 8, generator=g, dtype=torch.float64)
    blocks = [(torch.arange(4), torch.arange(4)), (torch.arange(4, 8), torch.arange(4, 8))]
    new = solve_projection(w, w, _stats(z, z), blocks, damping=damping)
    assert torch.allclose(new, w, rtol=0, atol=1e-12)


@pytest.mark.parametrize("family", list(PLANTED))
def test_nothing_cut_changes_nothing(family):
    teacher = tiny_model(family)
    student = copy.deepcopy(teacher)
    prune_model(student, None, META)  # keeps every channel
    before = {k: v.clone() for k, v in student.state_dict().items()}
    result = fit_out_projections(teacher, student, tiny_inputs(4, 16), scope="layer", damping=0.1)
    assert result.weights == {} and result.layers == {}
    assert all(torch.equal(before[k], v) for k, v in student.state_dict().items())


def planted_model(family: str) -> torch.nn.Module:
    """The tiny model of ``family`` whose value channels j + d_v/2 duplicate channels j in every value head."""
    overrides, gates = PLANTED[family]
    model = tiny_model(family, **overrides)
    adapter = get_adapter(model)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0.0, module.in_features**-0.5)
        for _, mixer in adapter.mixer_layers():
            hv, d_v, modules = value_layout(family, mixer)
            half = d_v // 2
            src = (torch.arange(hv)[:, None] * d_v + torch.arange(half)).reshape(-1)
            for name, offset in modules + gates:
                module = mixer.get_submodule(name)
                module.weight[src + half + offset] = module.weight[src + offset]
                if getattr(module, "bias", None) is not None:
                    module.bias[src + half + offset] = module.bias[src + offset]
            norm = mixer.norm if family in ("qwen3_5", "mamba2") else mixer.o_norm
            w = norm.weight
            if w.numel() == d_v:  # shared by the heads
                w[half:] = w[:half]
            else:
                w[src + half] = w[src]
    return model


def first_half(model) -> dict[int, torch.Tensor]:
    adapter = get_adapter(model)
    out = {}
    for layer, mixer in adapter.mixer_layers():
        hv, d_v, _ = value_layout(adapter.family, mixer)
        out[layer] = torch.arange(d_v // 2).expand(hv, -1).contiguous()
    return out


@pytest.mark.parametrize("scope, target", [("layer", "mixer"), ("head", "mixer"), ("layer", "stream")])
@pytest.mark.parametrize("family", list(PLANTED))
def test_planted_duplicates_are_recovered_exactly(family, scope, target):
    teacher = planted_model(family)
    inputs = tiny_inputs(2, 24, seed=7)
    student = copy.deepcopy(teacher)
    prune_model(student, None, META, values=first_half(teacher))
    want, plain = logits(teacher, inputs), logits(student, inputs)
    result = fit_out_projections(teacher, student, tiny_inputs(8, 32, seed=3), scope=scope, damping=1e-10,
                                 target=target)
    assert sorted(result.layers) == [layer for layer, _ in get_adapter(teacher).mixer_layers()]
    assert result.scale > 1.0  # norm_eps="exact": the pruned residual stream is r times the unpruned one
    assert rel(plain, want) > 1e-3
    assert rel(logits(student, inputs), want) < 1e-4
    assert all(row["error_fit"] < 1e-8 for row in result.layers.values())


_RELOAD = """
import json, sys, torch
from transformers import AutoModelForCausalLM, Mamba2ForCausalLM
from statereduce.adapters import adapter_families, adapter_class
from statereduce.core.models import load_model
for family in adapter_families():
    adapter_class(family).install_fallbacks()
out = {}
for ckpt in sys.argv[1:]:
    mamba = json.load(open(ckpt + "/config.json"))["model_type"] == "mamba2"  # fla's Auto mapping overrides it
    model = (Mamba2ForCausalLM if mamba else AutoModelForCausalLM).from_pretrained(ckpt).float().eval()
    with torch.no_grad():
        out[ckpt] = model(torch.load(ckpt + "/../inputs.pt"), use_cache=False).logits
torch.save(out, sys.argv[1] + "/../../reloaded.pt")
"""


@pytest.mark.slow
def test_fitted_checkpoint_reloads_in_a_fresh_process(tmp_path):
    """A key cut with the fit, saved and loaded with the stock classes in a fresh process (transformers'
    ``Mamba2ForCausalLM``: fla's ``mamba2`` registration overrides the Auto mapping): identical logits."""
    folders, want = [], {}
    for family in ("delta_net", "gated_deltanet", "qwen3_5", "mamba2"):
        teacher, inputs = tiny_model(family), tiny_inputs()
        student = copy.deepcopy(teacher)
        adapter = get_adapter(teacher)
        keep = {layer: torch.arange(adapter.head_k_dim // 2).expand(adapter.num_heads, -1).contiguous()
                for layer, _ in adapter.mixer_layers()}
        record = prune_model(student, keep, META)
        result = fit_out_projections(teacher, student, tiny_inputs(4, 16, seed=2))
        assert result.weights
        folder = tmp_path / family / "pruned"
        save_pruned(student, byte_level_tokenizer(), record, folder)
        torch.save(inputs, tmp_path / family / "inputs.pt")
        folders.append(str(folder))
        want[str(folder)] = logits(student, inputs)
    subprocess.run([sys.executable, "-c", _RELOAD, *folders], check=True, cwd=tmp_path)
    got = torch.load(tmp_path / "reloaded.pt")
    for folder in folders:
        assert torch.equal(got[folder], want[folder]), folder


def test_artifact_round_trip_and_errors(tmp_path):
    teacher = tiny_model("delta_net")
    student = copy.deepcopy(teacher)
    adapter = get_adapter(teacher)
    keep = {layer: torch.arange(16).expand(adapter.num_heads, -1).contiguous() for layer, _ in adapter.mixer_layers()}
    prune_model(student, keep, META)
    result = fit_out_projections(teacher, student, tiny_inputs(4, 16))
    doc = {"format": 1, "model": "tiny-dn", "family": "delta_net", "method": "drrqr+fit", "pct": 75.0}
    path = write_fit(tmp_path / "select" / "drrqr+fit_75.fit.safetensors", result, doc)
    assert not list(path.parent.glob(".*tmp*"))
    weights, meta = read_fit(path, {"model": "tiny-dn", "method": "drrqr+fit", "pct": 75})
    assert meta == doc and set(weights) == set(result.weights)
    other = copy.deepcopy(teacher)
    prune_model(other, keep, META)
    assert apply_fit(other, weights) == sorted(weights)
    assert all(torch.equal(other.get_parameter(k), v) for k, v in weights.items())
    with pytest.raises(ArtifactError, match=r"written with method='drrqr\+fit'.*expects method='grad\+fit'.*rule fit"):
        read_fit(path, {"method": "grad+fit"})
    wider = copy.deepcopy(teacher)  # a selection of another width: the shapes disagree
    prune_model(wider, {k: torch.arange(32).expand(adapter.num_heads, -1).contiguous() for k in keep}, META)
    name = next(iter(weights))
    with pytest.raises(ValueError, match="has shape"):
        apply_fit(wider, {name: weights[name][:, :3]})
    with pytest.raises(ValueError, match="not output projections"):
        apply_fit(other, {"lm_head.weight": torch.zeros(1)})
    (tmp_path / "bad.fit.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ArtifactError, match="bad.fit.safetensors"):
        read_fit(tmp_path / "bad.fit.safetensors")
    assert isinstance(result, FitResult) and set(out_projections(other)) == set(keep)


@pytest.mark.parametrize("bad, message", [
    ({"scope": "all"}, "fit scope"),
    ({"damping": 0}, "damping=0"),
    ({"damping": True}, "damping=True"),
    ({"scope": "head", "target": "stream"}, "scope 'layer'"),
    ({"n_samples": 0}, "n_samples=0"),
])
def test_bad_fit_settings_fail_in_one_line(bad, message):
    with pytest.raises(ValueError, match=message) as err:
        FitSettings.from_dict(bad)
    assert "\n" not in str(err.value)


# ---- the token, the config and the workflow ---------------------------------------------------------------------
def test_the_token_names_its_selection():
    import re

    from statereduce.common.layout import MethodSpec, format_method
    from statereduce.selectors import method_regex, parse_method

    spec = parse_method("drrqr-kv@layersplit+fit")
    assert spec.fit == "fit" and spec.selection == MethodSpec("drrqr", budget="layersplit", cut="joint")
    assert format_method(spec) == "drrqr-kv@layersplit+fit" and format_method(spec.selection) == "drrqr-kv@layersplit"
    for token, plain, fitted in (("drrqr", True, False), ("drrqr@sens+fit", False, True), ("grad+fithead", False, True)):
        assert bool(re.fullmatch(method_regex(fit=False), token)) == plain
        assert bool(re.fullmatch(method_regex(fit=True), token)) == fitted
        assert re.fullmatch(method_regex(), token)
    with pytest.raises(ValueError, match=r"bad fit id 'Fit'"):
        parse_method("drrqr+Fit")


def test_the_config_check_names_the_fits(shipped_config):
    from statereduce.config import ConfigError, check_method, validate_config

    check_method(shipped_config, "pca+fit")  # any selector: the fit reads only the pruned model
    with pytest.raises(ConfigError, match=r"^unknown fit 'fitt' \(method token suffix \+fitt\); valid: fit, fithead$"):
        check_method(shipped_config, "drrqr+fitt")
    bad = copy.deepcopy(shipped_config)
    bad["fits"]["fit"]["scope"] = "head"
    with pytest.raises(ConfigError, match=r"fits\.fit: fit target 'stream' matches the whole residual stream"):
        validate_config(bad)


def test_the_workflow_plans_fit_then_prune_fit(tmp_path):
    from _snakemake import dry_run_outputs

    jobs = dry_run_outputs(tmp_path, "results/tiny-dn/drrqr@sens+fit_75/pruned/eval.json")
    assert jobs["fit"] == ["results/tiny-dn/select/drrqr@sens+fit_75.fit.safetensors"]
    assert "results/tiny-dn/drrqr@sens+fit_75/pruned/eval.json" in jobs["prune_fit"]
    assert "prune" not in jobs  # the selection is drrqr@sens's: nothing of the plain cut is pruned
    assert jobs["select_channels"] == ["results/tiny-dn/select/drrqr@sens_75.parquet"]
