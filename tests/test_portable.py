"""Checkpoints that load without statereduce (statereduce.core.portable): every kind of cut in the four families is
saved, then loaded with ``AutoModelForCausalLM.from_pretrained`` in a virtual environment that has torch,
transformers (and fla for the fla families) but not statereduce, and compared with ``load_model``'s model: logits and
generated tokens for the transformers families, structure and weights for the fla families (their Triton kernels do
not run on a CPU; the same checkpoints' logits through the carried code are compared in this process instead)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from _models import random_keep, tiny_inputs, tiny_model
from _venv import load_there, without_statereduce

from statereduce.adapters import get_adapter
from statereduce.core.models import load_model, save_checkpoint
from statereduce.core.portable import LAYOUT_FIELD, MODELING_FILE, is_portable, module_layout, write_portable
from statereduce.core.tokenizer import byte_level_tokenizer
from statereduce.families.base import PORTABLE_PREFIX
from statereduce.stages.prune import prune_model, save_pruned

FAMILIES = ["delta_net", "gated_deltanet", "qwen3_5", "mamba2"]
FLA = {"delta_net", "gated_deltanet"}
CUTS = ["keys", "keys_per_layer", "values", "keys_values", "keys_values_per_layer"]
# The cuts the stock class cannot hold: per-layer widths anywhere, and Mamba-2's value cuts (its config has no d_v').
REMOTE = ({(f, c) for f in FAMILIES for c in ("keys_per_layer", "keys_values_per_layer")}
          | {("mamba2", "values"), ("mamba2", "keys_values")})


def _keys(model, cut):
    ad = get_adapter(model)
    if cut == "values":
        return None
    if cut in ("keys", "keys_values"):
        return random_keep(model, ad.head_k_dim // 2)
    gen = torch.Generator().manual_seed(1)
    layers = [i for i, _ in ad.mixer_layers()]
    widths = {layer: (ad.head_k_dim // 4, ad.head_k_dim // 2)[j % 2] for j, layer in enumerate(layers)}
    return {layer: torch.stack([torch.randperm(ad.head_k_dim, generator=gen)[:w].sort().values
                                for _ in range(ad.num_heads)]) for layer, w in widths.items()}


def _values(model, cut):
    if cut not in ("values", "keys_values", "keys_values_per_layer"):
        return None
    ad = get_adapter(model)
    _, hv, _, d_v = ad.dims(ad.config)
    gen = torch.Generator().manual_seed(2)
    layers = [i for i, _ in ad.mixer_layers()]
    widths = {layer: (d_v // 2, d_v // 4 * 3)[j % 2] if cut.endswith("per_layer") else d_v // 2
              for j, layer in enumerate(layers)}
    return {layer: torch.stack([torch.randperm(d_v, generator=gen)[:w].sort().values for _ in range(hv)])
            for layer, w in widths.items()}


def _pruned(family, cut):
    model = tiny_model(family)
    with torch.no_grad():  # weights of order one, so that every module matters to the logits
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0.0, module.in_features**-0.5)
    keys, values = _keys(model, cut), _values(model, cut)
    record = prune_model(model, keys, {"method": f"test-{cut}", "pct": 50}, norm_eps="exact", values=values)
    return model, record


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[tuple[str, str], dict]:
    """{(family, cut): {"folder", "logits" (load_model's), "ids"}} for every family and cut."""
    root = tmp_path_factory.mktemp("portable")
    ids = tiny_inputs(batch=2, length=20)
    torch.save(ids, root / "ids.pt")
    cases = {}
    for family in FAMILIES:
        for cut in CUTS:
            model, record = _pruned(family, cut)
            folder = save_pruned(model, byte_level_tokenizer(), record, root / family / cut)
            loaded, _ = load_model(folder)
            with torch.no_grad():
                logits = loaded(ids).logits
                assert torch.equal(logits, model(ids).logits), (family, cut)  # load_model reloads it exactly
            cases[family, cut] = {"folder": folder, "logits": logits, "ids": root / "ids.pt", "model": loaded}
    return cases


@pytest.mark.parametrize("cut", CUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_only_widths_the_stock_class_cannot_hold_carry_modeling_code(family, cut, saved):
    folder = saved[family, cut]["folder"]
    config = json.loads((folder / "config.json").read_text())
    remote = (family, cut) in REMOTE
    assert (folder / MODELING_FILE).is_file() == remote
    assert is_portable(config) == remote
    assert (LAYOUT_FIELD in config) == remote and ("auto_map" in config) == remote
    if remote:
        assert config["model_type"].startswith(PORTABLE_PREFIX)
        code = (folder / MODELING_FILE).read_text()
        assert "statereduce" not in "".join(line for line in code.splitlines() if line.startswith(("import", "from")))
        assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_statereduce.StateReduceForCausalLM"


@pytest.mark.parametrize("cut", CUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_the_carried_code_gives_load_models_logits(family, cut, saved):
    """In this process (fla's layers on the torch fallbacks): ``AutoModelForCausalLM.from_pretrained(...,
    trust_remote_code=True)``, the way a user loads it, equals ``load_model`` bit for bit."""
    from transformers import AutoModelForCausalLM

    if family in FLA:
        import fla  # noqa: F401  (a stock fla checkpoint needs fla's registration)
    case = saved[family, cut]
    cls = AutoModelForCausalLM
    if family == "mamba2" and (family, cut) not in REMOTE:  # fla, imported by other tests here, registers its own
        from transformers import Mamba2ForCausalLM as cls  # Mamba-2 for the stock type (the venv test has no fla)
    model = cls.from_pretrained(case["folder"], trust_remote_code=True, dtype=torch.float32).eval()
    assert type(model).__name__ == ("StateReduceForCausalLM" if (family, cut) in REMOTE else
                                    type(case["model"]).__name__)
    with torch.no_grad():
        assert torch.equal(model(torch.load(case["ids"])).logits, case["logits"])


def _strip(attrs: dict) -> dict:
    return {k: v for k, v in attrs.items() if k not in ("training", "gradient_checkpointing", "name_or_path")}


def test_every_cut_loads_without_statereduce(saved, tmp_path):
    """One child process per environment loads every checkpoint it can run: the transformers families in one without
    fla (transformers would pick fla's Triton kernels for Qwen3.5 where fla is installed), the fla families in one
    with it."""
    reports = {}
    for with_fla in (False, True):
        env = without_statereduce(tmp_path, fla=with_fla)
        cases = []
        for (family, cut), case in saved.items():
            if (family in FLA) != with_fla:
                continue
            out = tmp_path / f"{family}-{cut}.pt"
            cases.append({"name": f"{family}/{cut}", "folder": str(case["folder"]), "out": str(out),
                          "ids": str(case["ids"]), "import_fla": family in FLA and (family, cut) not in REMOTE,
                          "forward": family not in FLA})
            reports[family, cut] = out
        done = load_there(env, cases, tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"loaded {len(cases)} checkpoints" in done.stdout
    for (family, cut), out in reports.items():
        got, case = torch.load(out), saved[family, cut]
        model = case["model"]
        assert got["class"][0] == ("StateReduceForCausalLM" if (family, cut) in REMOTE else type(model).__name__)
        ours = model.state_dict()
        assert set(got["tensors"]) == set(ours), (family, cut)
        for name, tensor in ours.items():
            assert torch.equal(got["tensors"][name], tensor), (family, cut, name)
        modules = dict(model.named_modules())
        assert set(got["modules"]) == set(modules), (family, cut)
        for path, module in modules.items():
            if not path:
                continue
            entry = got["modules"][path]
            assert entry["class"] == type(module).__name__, (family, cut, path)
            mine = {k: v for k, v in _strip(entry["attributes"]).items()}
            for name, value in mine.items():
                theirs = getattr(module, name)
                theirs = list(theirs) if isinstance(theirs, tuple) else theirs
                assert value == theirs or (isinstance(value, list) and value == [*theirs]), (family, cut, path, name)
        if "logits" in got:
            assert torch.equal(got["logits"], case["logits"]), (family, cut)
            with torch.no_grad():
                ids = torch.load(case["ids"])[:, :8]
                want = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                                      attention_mask=torch.ones_like(ids))
            assert torch.equal(got["generated"], want), (family, cut)
        assert got["tokenizer"] and got["vocab"] == 257


@pytest.mark.parametrize("family", FAMILIES)
def test_a_stock_model_has_no_layout_and_resaving_a_stock_width_drops_the_code(family, tmp_path):
    model = tiny_model(family)
    assert module_layout(model) == {}
    pruned, _ = _pruned(family, "keys_per_layer")
    layout = module_layout(pruned)
    assert layout and all(isinstance(e, dict) for e in layout.values())
    save_checkpoint(pruned, None, tmp_path)
    assert (tmp_path / MODELING_FILE).is_file()
    model.config.auto_map = {"AutoModel": "other.Model"}  # someone else's entry is kept
    save_checkpoint(model, None, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert not (tmp_path / MODELING_FILE).exists() and LAYOUT_FIELD not in config
    assert config["auto_map"] == {"AutoModel": "other.Model"} and not is_portable(config)


def test_training_flags_are_not_widths():
    model = tiny_model("delta_net")
    model.gradient_checkpointing_enable()
    model.train()
    assert module_layout(model) == {}


def test_a_module_the_stock_class_does_not_build_fails_in_one_line():
    model = tiny_model("delta_net")
    model.model.layers[0].attn.extra = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"^the model's modules differ from its stock class's: extra "
                                         r"\['model.layers.0.attn.extra'\], missing \[\]$"):
        module_layout(model)


def test_a_replaced_module_class_fails_in_one_line():
    model = tiny_model("delta_net")
    model.model.layers[0].attn.q_proj = torch.nn.Identity()
    with pytest.raises(ValueError, match=r"^model.layers.0.attn.q_proj is a Identity; the stock class builds a "
                                         r"Linear$"):
        module_layout(model)


def test_write_portable_on_a_copy_keeps_the_models_config(tmp_path):
    pruned, _ = _pruned("qwen3_5", "keys_per_layer")
    before = copy.deepcopy(pruned.config.to_dict())
    save_checkpoint(pruned, None, tmp_path)
    after = pruned.config.to_dict()
    after["architectures"] = before["architectures"]  # save_pretrained's own
    assert after == before and not hasattr(pruned.config, "auto_map")  # the file changes, not the model in memory
    assert write_portable(pruned, tmp_path) == json.loads((tmp_path / "config.json").read_text())[LAYOUT_FIELD]


def test_attributes_the_stock_class_does_not_have_are_not_layout(saved):
    """load_model attaches its provenance to the model; the stock code never reads it."""
    model = saved["delta_net", "keys"]["model"]
    assert hasattr(model, "statereduce_base_checkpoint") and module_layout(model) == {}


@pytest.mark.parametrize("family", sorted(FLA))
def test_generate_with_the_carried_code_of_an_fla_model_keeps_its_state(family, saved):
    """transformers' generate() passes the cache as ``cache=``, fla's models read ``past_key_values``: the carried code
    maps one onto the other, so generated tokens equal greedy decoding by full forward passes."""
    from transformers import AutoModelForCausalLM

    case = saved[family, "keys_per_layer"]
    model = AutoModelForCausalLM.from_pretrained(case["folder"], trust_remote_code=True, dtype=torch.float32).eval()
    ids = torch.load(case["ids"])[:, :8]
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                             attention_mask=torch.ones_like(ids))
        want = ids
        for _ in range(4):
            want = torch.cat([want, case["model"](want).logits[:, -1:].argmax(-1)], 1)
    assert torch.equal(got, want)
