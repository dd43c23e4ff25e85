"""Shared q/k short convolutions (paper App. B.5, C.6.1, Table 14): ``pretrain.share_conv`` ties the filters while
training, the checkpoint is a stock fla one that plain ``from_pretrained`` reloads, the adapter tells the sharing, and
the config rejects it for families without separate q/k convolutions in one line."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import _fresh as fresh
import torch
from _models import VOCAB, pretrain, tiny_arch, tiny_inputs, tiny_model
from _paths import ROOT
from safetensors.torch import load_file

from statereduce.stages import pretrain as pt
from statereduce.adapters import get_adapter
from statereduce.adapters.conv_sharing import conv_sharing, model_conv_sharing, tie_qk_convs, untie_convs
from statereduce.config import ConfigError, validate_config
from statereduce.common.settings import TrainSettings

CORPUS = {"source": "embedded", "max_bytes": 600_000}
ARCH = {family: tiny_arch(family, small=True, byte_vocab=True) for family in ("delta_net", "gated_deltanet")}
TRAIN = {"steps": 4, "batch_size": 2, "seq_len": 32, "lr": 1e-2, "warmup": 1, "seed": 7, "log_every": 2,
         "eval_blocks": 2}
QK_CONVS = ("q_conv1d", "k_conv1d")


def _qk_convs(model) -> list[torch.nn.Module]:
    adapter = get_adapter(model)
    return [c for layout in adapter.layouts() for c in layout.qk_convs()]


def _tied(weight: torch.Tensor, groups: int) -> bool:
    w = weight.detach().reshape(groups, weight.shape[0] // groups, -1)
    return bool((w == w[:, :1]).all())


# ---- tying while training ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("family,share", [("delta_net", "head"), ("delta_net", "all"), ("gated_deltanet", "head"),
                                          ("gated_deltanet", "all")])
def test_tied_filters_train_and_stay_tied(family, share, tmp_path):
    """A few optimizer steps of the pretraining loop keep the tied filters exactly equal and move them away from
    their start (each head's first filter); untied, the model is stock again and computes the same logits."""
    model = tiny_model(family)
    adapter = get_adapter(model)
    h, d_k = adapter.num_heads, adapter.head_k_dim
    groups = h if share == "head" else 1
    convs = _qk_convs(model)
    before = [c.weight.detach().clone() for c in convs]
    untie = tie_qk_convs(adapter, share)
    for conv, w in zip(convs, before):
        start = w.reshape(groups, -1, *w.shape[1:])[:, 0]
        assert tuple(conv.parametrizations.weight.original.shape) == (groups, 1, w.shape[-1])
        assert torch.equal(conv.weight, start.repeat_interleave(h * d_k // groups, 0))
    tied_start = [c.weight.detach().clone() for c in convs]

    stream = torch.randint(0, VOCAB, (4000,), generator=torch.Generator().manual_seed(0))
    cfg = TrainSettings(steps=3, batch_size=2, seq_len=16, lr=1e-2, warmup=1, log_every=3)
    model.train()
    pt.train_loop(model, stream, cfg, [tmp_path / "log.jsonl"])
    model.eval()
    for conv, start in zip(convs, tied_start):
        assert _tied(conv.weight, groups) and not torch.equal(conv.weight, start)
    assert {layout.conv_sharing() for layout in adapter.layouts()} == {share}

    x = tiny_inputs()
    with torch.no_grad():
        tied_logits = model(input_ids=x).logits
    untie()
    stock = tiny_model(family)
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in stock.state_dict().items()}
    for conv in convs:
        assert type(conv) is type(_qk_convs(stock)[0]) and type(conv.weight) is torch.nn.Parameter
        assert conv.weight.is_contiguous() and conv.weight.shape == (h * d_k, 1, conv.kernel_size[0])
        assert _tied(conv.weight, groups)
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, tied_logits)


def test_tie_none_changes_nothing():
    model = tiny_model("delta_net")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tie_qk_convs(get_adapter(model), "none")()
    assert all(type(c).__name__ == "ShortConvolution" for c in _qk_convs(model))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match=r"^unknown share_conv 'heads'; valid: none, head, all$"):
        tie_qk_convs(get_adapter(model), "heads")


# ---- detection ---------------------------------------------------------------------------------------------------
def test_conv_sharing_detects_exact_ties():
    model = tiny_model("delta_net")
    adapter = get_adapter(model)
    h, d_k = adapter.num_heads, adapter.head_k_dim
    _, mixer = adapter.mixer_layers()[0]
    assert adapter.layout(mixer).conv_sharing() == "none"  # stock: a filter per channel
    with torch.no_grad():
        for name in QK_CONVS:
            w = getattr(mixer, name).weight
            w.copy_(w.reshape(h, d_k, 1, -1)[:, :1].expand(h, d_k, 1, w.shape[-1]).reshape(w.shape))
    assert adapter.layout(mixer).conv_sharing() == "head" == conv_sharing(mixer, h, d_k)
    with torch.no_grad():
        mixer.k_conv1d.weight[d_k + 1, 0, 0] += 1e-6  # one channel of k's second head off by a hair
    assert adapter.layout(mixer).conv_sharing() == "none"
    with torch.no_grad():
        for name in QK_CONVS:
            w = getattr(mixer, name).weight
            w.copy_(w[:1].expand_as(w))
        mixer.k_conv1d.weight.mul_(2.0)  # q's and k's shared filters may differ
    assert adapter.layout(mixer).conv_sharing() == "all"
    with torch.no_grad():
        mixer.q_conv1d.weight[:d_k] *= 3.0  # q tied per head only: the layer is "head"
    assert adapter.layout(mixer).conv_sharing() == "head"
    mixer.use_short_conv = False
    assert conv_sharing(mixer, h, d_k) == "none"


@pytest.mark.parametrize("family", ["delta_net", "gated_deltanet", "mamba2", "qwen3_5"])
def test_ordinary_models_share_nothing(family):
    """Stock initialisations have a filter per channel; families without separate q/k convolutions answer the base
    class's "none"."""
    adapter = get_adapter(tiny_model(family))
    assert {layout.conv_sharing() for layout in adapter.layouts()} == {"none"}
    assert model_conv_sharing(adapter) == "none"


def test_model_conv_sharing_is_what_every_layer_has():
    """The model's sharing is the weakest of its layers' ("all" implies "head"); untie_convs removes the ties of
    every conv, copies included, and leaves the tied values."""
    model = tiny_model("delta_net")
    adapter = get_adapter(model)
    (_, first), (_, second) = adapter.mixer_layers()
    tie_qk_convs(adapter, "all")
    assert model_conv_sharing(adapter) == "all"
    copy_of_conv = copy.deepcopy(first.q_conv1d)
    assert untie_convs(model) == 4 and untie_convs(copy_of_conv) == 1 and untie_convs(model) == 0
    assert type(copy_of_conv.weight) is torch.nn.Parameter and _tied(copy_of_conv.weight, 1)
    h, d_k = adapter.num_heads, adapter.head_k_dim
    with torch.no_grad():
        second.q_conv1d.weight[:d_k] *= 3.0  # the second layer's q tied per head only
    assert [adapter.layout(m).conv_sharing() for m in (first, second)] == ["all", "head"]
    assert model_conv_sharing(adapter) == "head"
    with torch.no_grad():
        first.k_conv1d.weight[h * d_k - 1] += 1.0
    assert model_conv_sharing(adapter) == "none"


# ---- pretrain end to end -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Tiny checkpoints: DeltaNet stock (no share_conv key) and per head, Gated DeltaNet shared across heads."""
    root = tmp_path_factory.mktemp("shared_conv")
    runs = {"dn": ("delta_net", None), "dn-head": ("delta_net", "head"), "gdn-all": ("gated_deltanet", "all")}
    out = {}
    for name, (family, share) in runs.items():
        kwargs = {} if share is None else {"share_conv": share}
        record = pretrain(family, ARCH[family], CORPUS, TRAIN, root / name, **kwargs)
        out[name] = (root / name, record)
    return out


def _conv_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in load_file(ckpt / "model.safetensors").items() if k.endswith(("q_conv1d.weight",
                                                                                           "k_conv1d.weight"))}


def test_pretrain_share_conv_writes_stock_checkpoints(trained):
    """Same keys, shapes and config as a stock checkpoint; the tied filters are exactly equal in the file; the record
    names the option."""
    stock = load_file(trained["dn"][0] / "model.safetensors")
    shared = load_file(trained["dn-head"][0] / "model.safetensors")
    assert {k: v.shape for k, v in stock.items()} == {k: v.shape for k, v in shared.items()}
    config = json.loads((trained["dn-head"][0] / "config.json").read_text())
    assert config == json.loads((trained["dn"][0] / "config.json").read_text())
    for name, groups in (("dn-head", 2), ("gdn-all", 1), ("dn", None)):
        ckpt, record = trained[name]
        assert record["share_conv"] == {"dn-head": "head", "gdn-all": "all", "dn": "none"}[name]
        assert json.loads((ckpt / "pretrain.json").read_text())["share_conv"] == record["share_conv"]
        weights = _conv_weights(ckpt)
        assert len(weights) == 2 * 2  # q and k of both layers
        for w in weights.values():
            assert (groups is None) != _tied(w, groups or 2), name
    # the per-head model's heads have filters of their own ("head", not "all")
    assert not any(_tied(w, 1) for w in _conv_weights(trained["dn-head"][0]).values())


RELOAD = """
import json, sys, torch
import fla  # noqa: F401  registers fla's models with transformers' Auto classes
from transformers import AutoModelForCausalLM
from statereduce.adapters import adapter_class, get_adapter
out = {}
for path in sys.argv[2:]:
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    model.eval()
    adapter = get_adapter(model)
    adapter.install_fallbacks()  # fla's Triton kernels do not run on CPU
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(b"def f(x):\\n    return x + 1\\n")])).logits
    out[path] = {"logits": logits, "info": {k: list(v) for k, v in info.items()}, "class": type(model).__name__,
                 "sharing": [layout.conv_sharing() for layout in adapter.layouts()]}
torch.save(out, sys.argv[1])
"""


def test_checkpoints_reload_with_stock_from_pretrained(trained, tmp_path):
    """A fresh process loads each checkpoint with plain ``AutoModelForCausalLM.from_pretrained`` (no missing or
    unexpected keys) and computes the logits statereduce's loader gets; ``conv_sharing`` reports the training's
    sharing there."""
    from statereduce.core.models import load_model

    paths = {name: str(ckpt) for name, (ckpt, _) in trained.items()}
    result = tmp_path / "reloaded.pt"
    proc = fresh.run(["-c", RELOAD, str(result), *paths.values()], timeout=300, cwd=ROOT, preload=fresh.TORCH)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reloaded = torch.load(result)
    x = torch.tensor([list(b"def f(x):\n    return x + 1\n")])
    expected = {"dn": "none", "dn-head": "head", "gdn-all": "all"}
    for name, path in paths.items():
        got = reloaded[path]
        assert got["class"] in ("DeltaNetForCausalLM", "GatedDeltaNetForCausalLM")
        assert not any(got["info"][k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), got["info"]
        assert got["sharing"] == [expected[name]] * 2
        model, _ = load_model(trained[name][0])
        with torch.no_grad():
            assert torch.equal(model(input_ids=x).logits, got["logits"]), name


def test_default_share_conv_is_bit_identical(trained, tmp_path):
    """``share_conv: none`` trains exactly what a call without the option trains (same draws, same op order)."""
    record = pretrain("delta_net", ARCH["delta_net"], CORPUS, TRAIN, tmp_path / "none", share_conv="none")
    a = load_file(trained["dn"][0] / "model.safetensors")
    b = load_file(tmp_path / "none" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert record["final_train_loss"] == trained["dn"][1]["final_train_loss"]
    assert record["eval_loss"] == trained["dn"][1]["eval_loss"]


def test_pretrain_rejects_share_conv_before_training(tmp_path):
    arch = tiny_arch("mamba2", small=True, byte_vocab=True)
    with pytest.raises(ValueError, match=r"^share_conv 'head' needs q/k short convolutions .* family 'mamba2'") as exc:
        pretrain("mamba2", arch, CORPUS, TRAIN, tmp_path / "x", share_conv="head")
    assert "\n" not in str(exc.value)
    with pytest.raises(ValueError, match=r"^unknown share_conv 'heads'; valid: none, head, all$"):
        pretrain("delta_net", ARCH["delta_net"], CORPUS, TRAIN, tmp_path / "x", share_conv="heads")
    with pytest.raises(ValueError, match="use_short_conv"):
        pretrain("delta_net", {**ARCH["delta_net"], "use_short_conv": False}, CORPUS, TRAIN, tmp_path / "x",
                    share_conv="all")
    assert not (tmp_path / "x").exists()


# ---- configuration -----------------------------------------------------------------------------------------------
def test_shipped_shared_models(shipped_config):
    """tiny-dn-shared(-all) are tiny-dn plus share_conv, outside the default target; the option is part of the
    pretrain rule's params (the model's whole pretrain block), and models without it keep theirs unchanged."""
    cfg = validate_config(shipped_config)
    models = cfg["models"]
    assert "share_conv" not in models["tiny-dn"]["pretrain"]  # not filled in: existing models' params unchanged
    for name, share in (("tiny-dn-shared", "head"), ("tiny-dn-shared-all", "all")):
        assert models[name]["pretrain"] == {**models["tiny-dn"]["pretrain"], "share_conv": share}
        assert {k: v for k, v in models[name].items() if k != "pretrain"} == {
            k: v for k, v in models["tiny-dn"].items() if k != "pretrain"}
        assert name not in cfg["targets"]["models"]
    assert cfg["targets"]["models"] == ["tiny-dn", "tiny-gdn", "tiny-mamba2", "tiny-qwen35"]


@pytest.mark.parametrize("model,share,arch,match", [
    ("tiny-mamba2", "head", None, r"^models\.tiny-mamba2\.pretrain\.share_conv: share_conv 'head' needs q/k short "
     r"convolutions in modules of their own, which family 'mamba2' does not have; valid: share_conv none, or a "
     r"family of delta_net, gated_deltanet$"),
    ("tiny-qwen35", "all", None, r"^models\.tiny-qwen35\.pretrain\.share_conv: share_conv 'all' .* family 'qwen3_5'"),
    ("tiny-dn", "heads", None, r"^config error at models\.tiny-dn\.pretrain\.share_conv: 'heads' is not one of "
     r"\['none', 'head', 'all'\]$"),
    ("tiny-gdn", "head", {"use_short_conv": False}, r"^models\.tiny-gdn\.pretrain\.share_conv: share_conv 'head' "
     r"needs short convolutions; valid with use_short_conv false: none$"),
], ids=["mamba2", "qwen3_5", "bad-value", "no-short-conv"])
def test_bad_share_conv_rejected_in_one_line(shipped_config, model, share, arch, match):
    cfg = copy.deepcopy(shipped_config)
    cfg["models"][model]["pretrain"]["share_conv"] = share
    cfg["models"][model]["pretrain"]["arch"].update(arch or {})
    with pytest.raises(ConfigError) as exc:
        validate_config(cfg)
    assert "\n" not in str(exc.value) and re.search(match, str(exc.value)), str(exc.value)


def test_share_conv_none_valid_for_every_family(shipped_config):
    cfg = copy.deepcopy(shipped_config)
    for name in ("tiny-mamba2", "tiny-qwen35", "tiny-gdn"):
        cfg["models"][name]["pretrain"]["share_conv"] = "none"
    assert validate_config(cfg)["models"]["tiny-mamba2"]["pretrain"]["share_conv"] == "none"
