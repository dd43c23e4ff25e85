"""Value channels: ``prune_model(..., values=...)`` (statereduce.stages.prune, "Value channels"), tiny random CPU models.

Each head's state is d_v x d_k; keeping d_v' value channels slices the value projections and their convs, the
output gate, the output norm's weight and the output projection's columns. The references here zero the dropped
value channels where they enter the recurrence, written from each family's documented layout (docs/families.md,
not the package's layouts): fla's ``v_proj`` rows and ``v_conv1d`` channels, Qwen3.5's value rows of
``in_proj_qkv`` and ``conv1d`` (after the queries and keys), Mamba-2's x rows of ``in_proj`` and x channels of
``conv1d`` (weight and bias). Checked, with an eps large enough to matter (1e-2):

1. ``"exact"`` equals the zero-masked original to float32 precision, values alone and with half the keys cut too, in
   all four families, at 50% and 75% of the value channels;
2. ``"stock"`` equals the zero-masked original whose output norms have eps / (d_v/d_v') (the eps effect only);
   each value head keeps its own channels, or (fla, Qwen3.5, whose output norm weight the heads share) every head of
   a layer the same ones;
3. the checkpoint reloads in a fresh process: fla and Qwen3.5 with the stock classes (per-head selections too: the
   shared norm weight is folded into the output projection), Mamba-2 (whose strict config
   cannot hold d_v') with ``load_model``; the stock Mamba-2 class refuses it;
4. cached one-token decoding equals the full forward;
5. bad selections fail with one line before any weight changes; a keys-only record has no ``values`` entry.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch

from _models import tiny_inputs, tiny_model
from statereduce.adapters import get_adapter
from statereduce.core.models import load_model
from statereduce.core.tokenizer import byte_level_tokenizer
from statereduce.stages.prune import PruneRecord, prune_model, save_pruned
from test_prune import cached_steps

EPS = 1e-2
META = {"method": "custom", "pct": 50, "source_model": "tiny-test"}
# case id -> (family, config overrides)
CASES = {
    "delta_net": ("delta_net", {"norm_eps": EPS}),
    "delta_net_gate": ("delta_net", {"norm_eps": EPS, "use_gate": True, "fuse_norm": False}),
    "gdn": ("gated_deltanet", {"norm_eps": EPS}),
    "gdn_gva": ("gated_deltanet", {"norm_eps": EPS, "num_v_heads": 4}),
    "qwen3_5": ("qwen3_5", {"rms_norm_eps": EPS}),
    "mamba2": ("mamba2", {"layer_norm_epsilon": EPS}),
}
SHARED = {"delta_net", "gated_deltanet", "qwen3_5"}  # the output norm's weight is [d_v], shared by the heads


def model_of(case: str):
    """The tiny model of ``case``, linear weights drawn with std 1/sqrt(fan_in) so that every mixer matters."""
    family, overrides = CASES[case]
    model = tiny_model(family, **overrides)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0.0, module.in_features**-0.5)
    return model


def value_layout(family: str, mixer) -> tuple[int, int, list[tuple[str, int]]]:
    """(value heads, d_v, [(module name, offset of value channel (0, 0))]) from the documented layouts: where a
    dropped value channel is zeroed (rows of a projection, channels of a conv; both head-major)."""
    if family in ("delta_net", "gated_deltanet"):
        hv, d_v = mixer.v_proj.out_features // mixer.head_v_dim, mixer.head_v_dim
        return hv, d_v, [("v_proj", 0)] + ([("v_conv1d", 0)] if mixer.use_short_conv else [])
    if family == "qwen3_5":
        offset = 2 * mixer.num_k_heads * mixer.head_k_dim
        return mixer.num_v_heads, mixer.head_v_dim, [("in_proj_qkv", offset), ("conv1d", offset)]
    inner = mixer.num_heads * mixer.head_dim  # mamba2: in_proj [z | x | B | C | dt], conv1d [x | B | C]
    return mixer.num_heads, mixer.head_dim, [("in_proj", inner), ("conv1d", 0)]


def random_values(model, d_v_new: int, seed: int = 3, per_head: bool = True) -> dict[int, torch.Tensor]:
    """Kept value channels per layer: [HV, d_v'] per head, or (``per_head`` False, where the heads share the output
    norm) [d_v'] for the layer."""
    adapter = get_adapter(model)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer, mixer in adapter.mixer_layers():
        hv, d_v, _ = value_layout(adapter.family, mixer)
        if adapter.family in SHARED and not per_head:
            out[layer] = torch.randperm(d_v, generator=g)[:d_v_new].sort().values
        else:
            out[layer] = torch.stack([torch.randperm(d_v, generator=g)[:d_v_new].sort().values for _ in range(hv)])
    return out


def random_keys(model, d_k_new: int, seed: int = 5) -> dict[int, torch.Tensor]:
    adapter = get_adapter(model)
    g = torch.Generator().manual_seed(seed)
    return {layer: torch.stack([torch.randperm(adapter.head_k_dim, generator=g)[:d_k_new].sort().values
                                for _ in range(adapter.num_heads)]) for layer, _ in adapter.mixer_layers()}


def zero_values(model, values: dict[int, torch.Tensor]) -> None:
    """Zero the dropped value channels' rows (weights and biases) in place."""
    adapter = get_adapter(model)
    for layer, mixer in adapter.mixer_layers():
        hv, d_v, modules = value_layout(adapter.family, mixer)
        keep = values[layer] if values[layer].ndim == 2 else values[layer].expand(hv, -1)
        dropped = torch.ones(hv, d_v, dtype=torch.bool)
        dropped.scatter_(1, keep, False)
        rows = (torch.arange(hv)[:, None] * d_v + torch.arange(d_v))[dropped]
        for name, offset in modules:
            module = mixer.get_submodule(name)
            with torch.no_grad():
                module.weight[rows + offset] = 0
                if module.bias is not None:
                    module.bias[rows + offset] = 0


def zero_keys(model, keep: dict[int, torch.Tensor]) -> None:
    from test_prune import zero_dropped

    zero_dropped(model, keep)


def output_norm_eps_times(model, factor: float) -> None:
    """Multiply the eps of every mixer's output norm by ``factor``."""
    adapter = get_adapter(model)
    for _, mixer in adapter.mixer_layers():
        if adapter.family == "qwen3_5":
            mixer.norm.variance_epsilon *= factor
        elif adapter.family == "mamba2":
            mixer.norm.variance_epsilon *= factor
        else:
            mixer.o_norm.eps *= factor


def logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(inputs, use_cache=False).logits


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("per_head", [True, False], ids=["per-head", "per-layer"])
@pytest.mark.parametrize("pct", [50, 75])
@pytest.mark.parametrize("with_keys", [False, True], ids=["values", "joint"])
@pytest.mark.parametrize("case", list(CASES))
def test_exact_equals_zeroing(case, with_keys, pct, per_head):
    if not per_head and CASES[case][0] not in SHARED:
        pytest.skip("Mamba-2's output norm has a weight per channel: a selection per layer is a per-head one")
    model, inputs = model_of(case), tiny_inputs()
    d_v = get_adapter(model).dims(get_adapter(model).config).head_v_dim
    values = random_values(model, d_v * (100 - pct) // 100, per_head=per_head)
    keys = random_keys(model, get_adapter(model).head_k_dim // 2) if with_keys else None
    reference = copy.deepcopy(model)
    zero_values(reference, values)
    if keys is not None:
        zero_keys(reference, keys)
    want = logits(reference, inputs)
    pruned = copy.deepcopy(model)
    adapter = get_adapter(pruned)
    all_keys = {layer: torch.arange(adapter.head_k_dim).expand(adapter.num_heads, -1)
                for layer, _ in adapter.mixer_layers()}
    record = prune_model(pruned, keys or all_keys, META, norm_eps="exact", values=values)
    assert rel(logits(pruned, inputs), want) < 1e-5
    assert rel(logits(model, inputs), want) > 1e-2  # the cut matters
    assert record.values["d_v_new"] == d_v * (100 - pct) // 100
    assert record.values["selection"] == ("head" if per_head else "layer")
    assert record.values["output_norm_folded"] == (sorted(values) if per_head and CASES[case][0] in SHARED else [])
    assert record.values["norm_eps"]["choice"] == "exact"


@pytest.mark.parametrize("case", list(CASES))
def test_stock_differs_by_the_eps_only(case):
    model, inputs = model_of(case), tiny_inputs()
    d_v = get_adapter(model).dims(get_adapter(model).config).head_v_dim
    values = random_values(model, d_v // 2)
    reference = copy.deepcopy(model)
    zero_values(reference, values)
    plain = logits(reference, inputs)
    output_norm_eps_times(reference, 1 / 2)  # stock: RMSNorm over d_v' with eps == over d_v with eps * d_v'/d_v
    pruned = copy.deepcopy(model)
    record = prune_model(pruned, {l: torch.arange(get_adapter(model).head_k_dim).expand(get_adapter(model).num_heads, -1)
                                  for l, _ in get_adapter(model).mixer_layers()}, META, norm_eps="stock", values=values)
    got = logits(pruned, inputs)
    assert rel(got, logits(reference, inputs)) < 1e-5
    assert rel(got, plain) > 1e-3
    assert record.values["norm_eps"]["choice"] == "stock"
    assert "norm_eps" not in json.dumps(record.config_changes)


@pytest.mark.parametrize("case", ["delta_net", "gdn_gva", "qwen3_5", "mamba2"])
def test_cached_decode_equals_forward(case):
    model, inputs = model_of(case), tiny_inputs(length=12)
    values = random_values(model, get_adapter(model).dims(get_adapter(model).config).head_v_dim // 2)
    adapter = get_adapter(model)
    prune_model(model, random_keys(model, adapter.head_k_dim // 2), META, values=values)
    assert rel(cached_steps(model, inputs), logits(model, inputs)) < 1e-4


_RELOAD = """
import json, sys, torch
from transformers import AutoModelForCausalLM
from statereduce.adapters import adapter_families, adapter_class
from statereduce.core.models import load_model
for family in adapter_families():
    adapter_class(family).install_fallbacks()
out = {}
for ckpt in sys.argv[1:]:
    portable = json.load(open(ckpt + "/config.json"))["model_type"].startswith("statereduce_")
    model = (load_model(ckpt)[0] if portable else AutoModelForCausalLM.from_pretrained(ckpt)).float().eval()
    with torch.no_grad():
        out[ckpt] = model(torch.load(ckpt + "/../inputs.pt"), use_cache=False).logits
torch.save(out, sys.argv[1] + "/../../reloaded.pt")
"""


@pytest.mark.slow
def test_reload_in_a_fresh_process(tmp_path):
    """Every family's value-pruned checkpoint in one fresh process: the stock classes for fla and Qwen3.5,
    ``load_model`` for Mamba-2 (its config keeps head_dim and names d_v' in statereduce_value_dims; the checkpoint
    carries its modeling code, tests/test_portable.py)."""
    folders, want = [], {}
    for case in ("delta_net", "gdn_gva", "qwen3_5", "mamba2"):
        model, inputs = model_of(case), tiny_inputs()
        adapter = get_adapter(model)
        values = random_values(model, adapter.dims(adapter.config).head_v_dim // 2)
        record = prune_model(model, random_keys(model, adapter.head_k_dim // 2), META, values=values)
        folder = tmp_path / case / "pruned"
        save_pruned(model, byte_level_tokenizer(), record, folder)
        torch.save(inputs, tmp_path / case / "inputs.pt")
        folders.append(str(folder))
        want[str(folder)] = logits(model, inputs)
        saved = json.loads((folder / "prune_record.json").read_text())
        assert saved["values"]["stock_loadable"] == (case != "mamba2")
    subprocess.run([sys.executable, "-c", _RELOAD, *folders], check=True, cwd=tmp_path)
    got = torch.load(tmp_path / "reloaded.pt")
    for folder in folders:
        assert torch.equal(got[folder], want[folder]), folder


def test_mamba2_value_checkpoint_loads_with_load_model_only(tmp_path):
    """The stock class builds head_dim-sized mixers and refuses the sliced weights' shapes; ``load_model`` gives the
    pruned model back."""
    from transformers import Mamba2ForCausalLM

    model = model_of("mamba2")
    adapter = get_adapter(model)
    record = prune_model(model, {l: torch.arange(adapter.head_k_dim).expand(adapter.num_heads, -1)
                                 for l, _ in adapter.mixer_layers()}, META, values=random_values(model, 8))
    save_pruned(model, byte_level_tokenizer(), record, tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["statereduce_value_dims"] == [8, 8]
    inputs = tiny_inputs()
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        Mamba2ForCausalLM.from_pretrained(tmp_path / "m")
    again = load_model(tmp_path / "m")[0]
    assert torch.equal(logits(again, inputs), logits(model, inputs))


def _all_keys(model):
    adapter = get_adapter(model)
    return {l: torch.arange(adapter.head_k_dim).expand(adapter.num_heads, -1) for l, _ in adapter.mixer_layers()}


@pytest.mark.parametrize("bad, message", [
    (lambda v: {0: v[0]}, r"values cover layers \[0\]; the model's linear-attention layers are \[0, 1\]"),
    (lambda v: {0: v[0], 1: torch.tensor([0, 1, 99])}, r"layer 1: values has shape|value indices span \[0, 99\]"),
    (lambda v: {0: v[0], 1: torch.tensor([3, 3] + list(range(4, 18)))}, r"layer 1: values repeat a channel"),
], ids=["layers", "range", "repeats"])
def test_bad_value_selections_fail_in_one_line_before_any_change(bad, message):
    model = model_of("delta_net")
    before = copy.deepcopy(model.state_dict())
    values = random_values(model, 16, per_head=False)
    with pytest.raises(ValueError, match=message) as err:
        prune_model(model, _all_keys(model), META, values=bad(values))
    assert "\n" not in str(err.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def layer_values(model, fractions: tuple[float, ...], seed: int = 3, per_head: bool = True) -> dict[int, torch.Tensor]:
    """Kept value channels whose width differs between layers: layer i keeps d_v * fractions[i % len(fractions)]."""
    adapter = get_adapter(model)
    d_v = adapter.dims(adapter.config).head_v_dim
    out = {}
    for i, (layer, _) in enumerate(adapter.mixer_layers()):
        width = int(d_v * fractions[i % len(fractions)])
        out[layer] = random_values(model, width, seed=seed + i, per_head=per_head)[layer]
    return out


def layer_keys(model, fractions: tuple[float, ...], seed: int = 5) -> dict[int, torch.Tensor]:
    adapter = get_adapter(model)
    return {layer: random_keys(model, int(adapter.head_k_dim * fractions[i % len(fractions)]), seed=seed + i)[layer]
            for i, (layer, _) in enumerate(adapter.mixer_layers())}


@pytest.mark.parametrize("per_head", [True, False], ids=["per-head", "per-layer"])
@pytest.mark.parametrize("keys", ["none", "uniform", "per-layer"])
@pytest.mark.parametrize("case", list(CASES))
def test_layers_with_different_value_widths_equal_zeroing(case, keys, per_head):
    """Each layer its own d_v' (a split chosen per layer), with every key, half the keys or a key width per layer:
    the exact checkpoint equals the zero-masked original; the config names each layer's widths and output-norm eps."""
    from statereduce.core.slicing import KEY_DIMS_FIELD, OUTPUT_NORM_EPS_FIELD, VALUE_DIMS_FIELD

    if not per_head and CASES[case][0] not in SHARED:
        pytest.skip("Mamba-2's output norm has a weight per channel: a selection per layer is a per-head one")
    model, inputs = model_of(case), tiny_inputs()
    adapter = get_adapter(model)
    values = layer_values(model, (0.5, 0.25, 0.75), per_head=per_head)
    keep = {"none": _all_keys(model), "uniform": random_keys(model, adapter.head_k_dim // 2),
            "per-layer": layer_keys(model, (0.25, 0.5))}[keys]
    reference = copy.deepcopy(model)
    zero_values(reference, values)
    zero_keys(reference, keep)
    want = logits(reference, inputs)
    pruned = copy.deepcopy(model)
    record = prune_model(pruned, keep, META, norm_eps="exact", values=values)
    assert rel(logits(pruned, inputs), want) < 1e-5
    assert rel(logits(model, inputs), want) > 1e-2  # the cut matters
    widths = {layer: int(v.shape[-1]) for layer, v in values.items()}
    assert len(set(widths.values())) > 1
    assert record.values["widths"] == {str(layer): w for layer, w in sorted(widths.items())}
    assert record.values["d_v_new"] == max(widths.values()) and not record.values["stock_loadable"]
    dims = getattr(pruned.config, VALUE_DIMS_FIELD)
    assert {i: w for i, w in enumerate(dims) if w is not None} == widths
    key_dims = getattr(pruned.config, KEY_DIMS_FIELD)
    assert {i: w for i, w in enumerate(key_dims) if w is not None} == {l: int(k.shape[-1]) for l, k in keep.items()}
    assert len(getattr(pruned.config, OUTPUT_NORM_EPS_FIELD)) == len(dims)
    # eval.json's state block counts each layer at its own widths
    from statereduce.eval.documents import state_record

    state = state_record(pruned)
    assert state["value_dims"] == {str(layer): w for layer, w in widths.items()}
    assert state["d_v"] == pytest.approx(sum(widths.values()) / len(widths))


@pytest.mark.parametrize("case", ["delta_net", "gdn_gva", "qwen3_5", "mamba2"])
def test_layers_with_different_value_widths_stock_differs_by_each_layers_eps(case):
    """``norm_eps="stock"``: each layer's output norm keeps the config's eps, so the checkpoint equals the zero-masked
    original whose output norms have eps * d_v'(layer)/d_v."""
    model, inputs = model_of(case), tiny_inputs()
    adapter = get_adapter(model)
    d_v = adapter.dims(adapter.config).head_v_dim
    values = layer_values(model, (0.5, 0.25, 0.75))
    reference = copy.deepcopy(model)
    zero_values(reference, values)
    plain = logits(reference, inputs)
    for (layer, mixer), (_, ref_mixer) in zip(adapter.mixer_layers(), get_adapter(reference).mixer_layers()):
        for attr in get_adapter(reference).layout(ref_mixer).output_norm_eps():
            setattr(attr.module, attr.attr, getattr(attr.module, attr.attr) * values[layer].shape[-1] / d_v)
    pruned = copy.deepcopy(model)
    record = prune_model(pruned, _all_keys(model), META, norm_eps="stock", values=values)
    got = logits(pruned, inputs)
    assert rel(got, logits(reference, inputs)) < 1e-5
    assert rel(got, plain) > 1e-3
    assert record.values["norm_eps"]["choice"] == "stock"


_RELOAD_MIXED = """
import sys, torch
from statereduce.core.models import load_model
out = {}
for ckpt in sys.argv[1:]:
    model = load_model(ckpt)[0].float().eval()
    with torch.no_grad():
        out[ckpt] = model(torch.load(ckpt + "/../inputs.pt"), use_cache=False).logits
torch.save(out, sys.argv[1] + "/../../reloaded.pt")
"""


@pytest.mark.slow  # default tier under 3 min: a child process or a whole run; .ci/run runs it
def test_layers_with_different_value_widths_reload_in_a_fresh_process(tmp_path):
    """Every family's checkpoint with a key and a value width per layer, loaded by ``load_model`` in one fresh
    process: the logits of the pruned model, to the bit; cached decoding equals the forward."""
    folders, want = [], {}
    for case in ("delta_net", "gdn_gva", "qwen3_5", "mamba2"):
        model, inputs = model_of(case), tiny_inputs()
        record = prune_model(model, layer_keys(model, (0.25, 0.5)), META, values=layer_values(model, (0.5, 0.25)))
        folder = tmp_path / case / "pruned"
        save_pruned(model, byte_level_tokenizer(), record, folder)
        torch.save(inputs, tmp_path / case / "inputs.pt")
        folders.append(str(folder))
        want[str(folder)] = logits(model, inputs)
        assert rel(cached_steps(model, tiny_inputs(length=12)), logits(model, tiny_inputs(length=12))) < 1e-4
    subprocess.run([sys.executable, "-c", _RELOAD_MIXED, *folders], check=True, cwd=tmp_path)
    got = torch.load(tmp_path / "reloaded.pt")
    for folder in folders:
        assert torch.equal(got[folder], want[folder]), folder


def test_keys_only_record_has_no_values_entry():
    model = model_of("gdn")
    record = prune_model(model, random_keys(model, 16), META)
    assert record.values == {}
    assert "values" not in json.loads(record.to_json())
    assert PruneRecord.from_json(record.to_json()).values == {}
