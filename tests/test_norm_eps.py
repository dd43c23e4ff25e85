"""``prune_model(..., norm_eps=...)`` (statereduce.stages.prune, "Kernel scale"), tiny random CPU models.

After pruning, the stock delta-rule kernels scale q.k by 1/sqrt(d_k') instead of 1/sqrt(d_k), which changes the
model only through the eps of the per-head output RMSNorm. ``"stock"`` (the default) keeps the config's eps;
``"exact"`` multiplies it by c^2 = d_k/d_k' and the residual stream (and Qwen3.5's attention q/k projections) by c,
so that every norm sees what it saw before. Here, with an eps large enough to matter (1e-2):

1. ``"exact"`` equals the original with the dropped q/k channels zeroed (tests/test_prune.py's ``zero_dropped``, written
   from each family's documented layout) to float32 precision, at 50% and 75%, in memory and after saving and
   reloading in a fresh process with the stock classes and with ``statereduce.core.models.load_model``; ``"stock"``
   does not;
2. ``"stock"`` writes today's checkpoint and record bit for bit (every tensor outside the sliced rows, the config
   and the record's ``kernel_scale`` as before; the default and an explicit ``"stock"`` write identical files);
3. Mamba-2 has no kernel scale: ``"exact"`` is a no-op there (identical checkpoint, the record says so);
4. cached one-token decoding of an ``"exact"`` model equals its full forward;
5. what the construction cannot store (tied embeddings, attention-residual blocks, an eps the adapter does not
   know about) is refused with one line before any weight changes.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import _fresh as fresh
import torch

from _models import random_keep, tiny_inputs, tiny_model
from statereduce.adapters import get_adapter
from statereduce.adapters.base import EPS_ATTRIBUTES
from statereduce.stages.prune import kernel_scale_note, prune_model, save_pruned
from statereduce.core.tokenizer import byte_level_tokenizer
from test_prune import cached_steps, logits, zero_dropped

D_K = 32
EPS = 1e-2  # large enough that the output norm's eps changes the logits visibly
META = {"method": "rand", "pct": 50, "source_model": "tiny-test"}
# case id -> (family, config overrides); the first of each family is the one reloaded in a fresh process
CASES = {
    "delta_net": ("delta_net", {"norm_eps": EPS}),
    "delta_net_gate_unfused": ("delta_net", {"norm_eps": EPS, "use_gate": True, "fuse_norm": False}),
    "gdn": ("gated_deltanet", {"norm_eps": EPS}),
    "gdn_gva_nogate": ("gated_deltanet", {"norm_eps": EPS, "num_v_heads": 4, "use_gate": False}),
    "qwen3_5": ("qwen3_5", {"rms_norm_eps": EPS}),
    "qwen3_5_bias": ("qwen3_5", {"rms_norm_eps": EPS, "attention_bias": True}),
}
RELOADED = ("delta_net", "gdn", "qwen3_5")
KEPT = {50: 16, 75: 8}  # pct removed -> d_k'


def model_of(case: str, seed: int = 0):
    """The tiny model of ``case`` with activations of order one: every linear weight drawn with std 1/sqrt(fan_in)
    (the families' init of 0.02 leaves the mixers' contributions to the logits near float noise) and every bias with
    std 0.1 (they start at zero: their scaling would go untested)."""
    family, overrides = CASES[case]
    model = tiny_model(family, seed=seed, **overrides)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0.0, module.in_features**-0.5)
                if module.bias is not None:
                    module.bias.normal_(0.0, 0.1)
    return model


def tolerance(ref: torch.Tensor) -> float:
    """Float32 precision of these models' logits: 1e-5 of max|ref|. Perturbing the zero-masked models' weights by a
    float32 rounding (relative 6e-8) moves their logits by up to 4e-6 of max|ref|; "exact" differs from them by
    4e-7..4e-6 of it, "stock" by 0.1..1 (at eps 1e-2)."""
    return 1e-5 * ref.abs().max().item()


def pruned_and_reference(case: str, pct: int, norm_eps: str, seed: int = 2):
    """(the pruned model, the zero-masked original, the record)."""
    model = model_of(case)
    keep = random_keep(model, KEPT[pct], seed=seed)
    zeroed = copy.deepcopy(model)
    zero_dropped(zeroed, keep)
    record = prune_model(model, keep, META, norm_eps=norm_eps)
    return model, zeroed, record


def float_attributes(model) -> dict[tuple[str, str], float]:
    """{(module name, attribute): value} of every float attribute of every module (eps, dropout rates, ...)."""
    return {(name, attr): value for name, module in model.named_modules() for attr, value in vars(module).items()
            if isinstance(value, float)}


# ---- 1. exact equals zero-masking; stock does not --------------------------------------------------------------
@pytest.mark.parametrize("length", [20, 80], ids=["recurrent", "chunk"])
@pytest.mark.parametrize("pct", [50, 75])
@pytest.mark.parametrize("case", list(CASES))
def test_exact_equals_zero_masking_and_stock_does_not(case, pct, length):
    inputs = tiny_inputs(length=length)
    exact, zeroed, record = pruned_and_reference(case, pct, "exact")
    ref = logits(zeroed, inputs)
    original = logits(model_of(case), inputs)
    tol = tolerance(ref)
    assert (original - ref).abs().max().item() > 1e3 * tol  # the dropped channels matter
    assert (logits(exact, inputs) - ref).abs().max().item() <= tol
    stock, _, _ = pruned_and_reference(case, pct, "stock")
    assert (logits(stock, inputs) - ref).abs().max().item() > 1e3 * tol  # the stock eps shows at this eps

    factor = D_K / KEPT[pct]
    field = get_adapter(exact).norm_eps_field
    note = record.kernel_scale["norm_eps"]
    assert note == {"choice": "exact", "field": field, "factor": factor, "before": EPS, "after": EPS * factor,
                    "residual_scale": math.sqrt(factor), "scaled_weights": note["scaled_weights"],
                    "eps_attributes": note["eps_attributes"]}
    assert record.config_changes[field] == [EPS, EPS * factor]
    assert getattr(get_adapter(exact).config, field) == EPS * factor
    assert "norm_eps exact" in record.kernel_scale["note"]


def test_what_exact_scales_per_family():
    """The weights scaled by c and the eps set: every residual writer, Qwen3.5's q rows (not its output-gate rows) and
    k_proj, every norm; nothing else changes apart from the sliced q/k rows."""
    for case in ("delta_net", "gdn", "qwen3_5_bias"):
        model = model_of(case)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        keep = random_keep(model, 16, seed=1)
        record = prune_model(model, keep, META, norm_eps="exact")
        c = math.sqrt(2.0)
        after = model.state_dict()
        scaled = {k for k in after if k.endswith(("embeddings.weight", "embed_tokens.weight", "o_proj.weight",
                                                  "o_proj.bias", "out_proj.weight", "down_proj.weight",
                                                  "k_proj.bias"))}
        scaled |= {k for k in after if k.endswith("k_proj.weight") and "self_attn" in k}
        for k, v in after.items():
            if k in scaled:
                assert torch.allclose(v, before[k] * c, rtol=1e-6, atol=0), k
            elif "self_attn.q_proj" in k:  # per head [query | output gate]: only the query half is scaled
                d = model.config.head_dim
                rows = v.reshape(-1, 2, d, *v.shape[1:])
                want = before[k].reshape(-1, 2, d, *v.shape[1:])
                assert torch.allclose(rows[:, 0], want[:, 0] * c, rtol=1e-6, atol=0)
                assert torch.equal(rows[:, 1], want[:, 1])
            elif v.shape == before[k].shape:
                assert torch.equal(v, before[k]), k
        eps = {(n, a): v for (n, a), v in float_attributes(model).items() if a in EPS_ATTRIBUTES}
        assert eps and set(eps.values()) == {2 * EPS}
        n_layers = model.config.num_hidden_layers
        assert record.kernel_scale["norm_eps"]["scaled_weights"] == 1 + 2 * n_layers + 2 * (case == "qwen3_5_bias")


# ---- 1. ... after saving and reloading in a fresh process -------------------------------------------------------
# Stock classes (AutoModelForCausalLM after `import fla`; fla's layers on CPU go to torch implementations through the
# adapters' install_fallbacks, which leave the model classes alone) and the project's load path.
_RELOAD_SCRIPT = """
import sys, torch
torch.set_num_threads(1)
from transformers import AutoModelForCausalLM
import fla  # registers fla's classes with the Auto classes
from statereduce.adapters import adapter_families, adapter_class
from statereduce.core.models import load_model
for family in adapter_families():
    adapter_class(family).install_fallbacks()
for ckpt in sys.argv[1:]:
    inputs = torch.load(ckpt + "/../inputs.pt")
    out = {}
    for how in ("stock", "load_model"):
        model = (AutoModelForCausalLM.from_pretrained(ckpt) if how == "stock" else load_model(ckpt)[0]).float().eval()
        with torch.no_grad():
            out[how] = [model(x, use_cache=False).logits for x in inputs]
    torch.save(out, ckpt + "/../reloaded.pt")
"""


@pytest.fixture(scope="module")
def reloaded(tmp_path_factory) -> dict[tuple[str, int], dict]:
    """Prune with norm_eps="exact", save, and reload every (case, pct) of RELOADED x KEPT in ONE fresh process."""
    root = tmp_path_factory.mktemp("exact")
    out: dict[tuple[str, int], dict] = {}
    inputs = [tiny_inputs(length=20), tiny_inputs(length=80, seed=3)]
    for case in RELOADED:
        for pct in KEPT:
            model, zeroed, record = pruned_and_reference(case, pct, "exact")
            folder = root / f"{case}_{pct}"
            folder.mkdir()
            torch.save(inputs, folder / "inputs.pt")
            ckpt = save_pruned(model, byte_level_tokenizer(), record, folder / "ckpt")
            out[case, pct] = {"ckpt": ckpt, "model": model, "record": record,
                              "logits": [logits(model, x) for x in inputs], "ref": [logits(zeroed, x) for x in inputs]}
    script = root / "reload.py"
    script.write_text(_RELOAD_SCRIPT)
    proc = fresh.run([str(script), *(str(v["ckpt"]) for v in out.values())], preload=fresh.TORCH)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for v in out.values():
        v["reloaded"] = torch.load(v["ckpt"].parent / "reloaded.pt")
    return out


@pytest.mark.parametrize("pct", list(KEPT))
@pytest.mark.parametrize("case", RELOADED)
def test_exact_checkpoint_reloads_equal_to_zero_masking(reloaded, case, pct, tmp_path):
    r = reloaded[case, pct]
    for how in ("stock", "load_model"):
        for got, in_memory, ref in zip(r["reloaded"][how], r["logits"], r["ref"]):
            assert torch.equal(got, in_memory), how  # the reloaded model is the model in memory
            assert (got - ref).abs().max().item() <= tolerance(ref), how
    assert json.loads((r["ckpt"] / "prune_record.json").read_text())["kernel_scale"] == r["record"].kernel_scale
    # the config differs from the stock checkpoint's in the eps field's value only: no field a stock class ignores
    stock, _, stock_record = pruned_and_reference(case, pct, "stock")
    save_pruned(stock, None, stock_record, tmp_path / "stock")
    saved, saved_stock = (json.loads((d / "config.json").read_text()) for d in (r["ckpt"], tmp_path / "stock"))
    field = get_adapter(r["model"]).norm_eps_field
    assert saved == {**saved_stock, field: EPS * D_K / KEPT[pct]} and saved_stock[field] == EPS


@pytest.mark.parametrize("case", RELOADED)
def test_live_eps_equals_the_reloaded_models(reloaded, case):
    """Every float attribute of every module (the norms' eps above all) is what the stock class builds from the saved
    config: the model in memory is the model reloaded."""
    from transformers import AutoModelForCausalLM

    r = reloaded[case, 50]
    fresh = AutoModelForCausalLM.from_pretrained(r["ckpt"])
    assert float_attributes(r["model"]) == float_attributes(fresh)


# ---- 2. stock: today's checkpoint ------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["delta_net", "gdn", "qwen3_5", "mamba2"])
def test_stock_is_todays_checkpoint(case, tmp_path):
    """Two "stock" prunings write identical files; every tensor outside the sliced q/k rows, every eps and the config
    outside ``config_changes`` are the original's; the record's kernel_scale is today's entry."""
    family, overrides = CASES.get(case, ("mamba2", {}))
    model = tiny_model(family, **overrides)
    keep = random_keep(model, 16, seed=4)
    default, explicit = copy.deepcopy(model), copy.deepcopy(model)
    r_default = prune_model(default, keep, META, norm_eps="stock")
    r_explicit = prune_model(explicit, keep, META, norm_eps="stock")
    assert r_default.to_json() == r_explicit.to_json()
    old, new = model.config.to_dict(), default.config.to_dict()  # (saving sets config.architectures)
    assert {k for k in old if old[k] != new.get(k)} == set(r_default.config_changes)
    save_pruned(default, None, r_default, tmp_path / "default")
    save_pruned(explicit, None, r_explicit, tmp_path / "explicit")
    for name in ("model.safetensors", "config.json", "prune_record.json"):
        assert (tmp_path / "default" / name).read_bytes() == (tmp_path / "explicit" / name).read_bytes(), name

    adapter = get_adapter(default)
    sliced = {f"{n}.{p}" for n, m in default.named_modules() for p in ("weight", "bias")
              if any(m is e.module for layout in adapter.layouts() for e in layout.channel_rows())}
    before, after = model.state_dict(), default.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(after[k], before[k]) for k in before if k not in sliced)
    assert float_attributes(default).items() >= {k: v for k, v in float_attributes(model).items()
                                                 if k[1] in EPS_ATTRIBUTES}.items()
    assert r_default.kernel_scale == kernel_scale_note(D_K, 16, adapter.kernel_scale)
    assert "norm_eps" not in r_default.kernel_scale and "\"norm_eps\": {" not in r_default.to_json()
    if adapter.kernel_scale:
        assert r_default.kernel_scale == {
            "original": D_K**-0.5, "pruned": 16**-0.5, "o_norm_eps_factor_for_exact_zeroing": 2.0,
            "note": ("stock kernels of the pruned checkpoint use scale 1/sqrt(d_k'=16), not 1/sqrt(d_k=32); the output "
                     "is linear in the scale and goes through the per-head o_norm, so the checkpoint equals the "
                     "original with dropped q/k channels zeroed only up to the o_norm eps (exact with eps * 2)")}


def test_the_default_is_the_workflows(tmp_path):
    """prune_model and api.prune default to the workflow's norm_eps (PruneSettings, the one place of that default):
    the default writes the files an explicit "exact" writes."""
    import inspect

    from statereduce import api
    from statereduce.common.settings import PruneSettings

    assert PruneSettings().norm_eps == "exact"
    for fn in (prune_model, api.prune):
        assert inspect.signature(fn).parameters["norm_eps"].default == PruneSettings().norm_eps, fn.__name__
    family, overrides = CASES["gdn"]
    model = tiny_model(family, **overrides)
    keep = random_keep(model, 16, seed=4)
    default, explicit = copy.deepcopy(model), copy.deepcopy(model)
    r_default = prune_model(default, keep, META)
    r_explicit = prune_model(explicit, keep, META, norm_eps="exact")
    assert r_default.kernel_scale["norm_eps"]["choice"] == "exact"
    save_pruned(default, None, r_default, tmp_path / "default")
    save_pruned(explicit, None, r_explicit, tmp_path / "explicit")
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "default" / name).read_bytes() == (tmp_path / "explicit" / name).read_bytes(), name


# ---- 3. Mamba-2: a no-op -----------------------------------------------------------------------------------------
def test_mamba2_exact_is_a_no_op(tmp_path):
    model = tiny_model("mamba2")
    keep = random_keep(model, 8, seed=4)
    stock, exact = copy.deepcopy(model), copy.deepcopy(model)
    r_stock = prune_model(stock, keep, META, norm_eps="stock")
    r_exact = prune_model(exact, keep, META, norm_eps="exact")
    save_pruned(stock, None, r_stock, tmp_path / "stock")
    save_pruned(exact, None, r_exact, tmp_path / "exact")
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "stock" / name).read_bytes() == (tmp_path / "exact" / name).read_bytes(), name
    assert r_exact.config_changes == r_stock.config_changes == {"state_size": [32, 8]}
    note = r_exact.kernel_scale.pop("norm_eps")
    assert r_exact.kernel_scale == r_stock.kernel_scale
    assert (note["choice"], note["factor"], note["field"], note["scaled_weights"]) == ("exact", 1.0, None, 0)
    assert "nothing to change" in note["note"]


def test_keeping_every_channel_changes_nothing():
    model = model_of("gdn")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    keep = {layer: torch.arange(D_K).repeat(2, 1) for layer, _ in get_adapter(model).mixer_layers()}
    record = prune_model(model, keep, {"method": "all", "pct": 0}, norm_eps="exact")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert model.config.norm_eps == EPS and record.config_changes == {"head_dim": [32, 32], "expand_v": [2.0, 2.0]}
    assert record.kernel_scale["norm_eps"]["factor"] == 1.0


# ---- 4. decoding -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["delta_net", "gdn", "qwen3_5"])
def test_cached_decoding_of_exact_matches_full_forward(case):
    model, zeroed, _ = pruned_and_reference(case, 50, "exact", seed=3)
    inputs = tiny_inputs(length=20)
    full = logits(model, inputs)
    assert torch.allclose(cached_steps(model, inputs), full, atol=1e-4)
    assert (full - logits(zeroed, inputs)).abs().max().item() <= tolerance(full)


# ---- 5. refusals -------------------------------------------------------------------------------------------------
def _unchanged(model, state) -> bool:
    return all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_tied_embeddings_are_refused_before_any_change():
    model = tiny_model("delta_net", norm_eps=EPS, tie_word_embeddings=True)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"^norm_eps='exact' cannot be stored for this delta_net model: the input and "
                                         r"output embeddings are tied .*; use norm_eps='stock' \(in the workflow: "
                                         r"prune: \{norm_eps: stock\}\)$"):
        prune_model(model, random_keep(model, 16), META, norm_eps="exact")
    assert _unchanged(model, state) and model.config.norm_eps == EPS
    model.config.tie_word_embeddings = False  # weights still shared in memory: refused as well
    with pytest.raises(ValueError, match="share one weight"):
        prune_model(model, random_keep(model, 16), META, norm_eps="exact")
    prune_model(model, random_keep(model, 16), META, norm_eps="stock")  # stock is fine


def test_attention_residual_blocks_are_refused():
    from statereduce.adapters import DeltaNetAdapter, GatedDeltaNetAdapter, Qwen35Adapter

    config = model_of("gdn").config
    assert GatedDeltaNetAdapter.exact_norm_eps_refusal(config) is None
    config.attnres_block_size = 2
    assert "attnres_block_size" in GatedDeltaNetAdapter.exact_norm_eps_refusal(config)
    assert "attnres_block_size" in DeltaNetAdapter.exact_norm_eps_refusal(config)
    qwen = model_of("qwen3_5").config
    qwen.tie_word_embeddings = True
    assert "tied" in Qwen35Adapter.exact_norm_eps_refusal(qwen)


def test_an_eps_the_adapter_does_not_list_is_refused(monkeypatch):
    """A module that holds the config's eps in an attribute the adapter does not list is a layout the construction
    was not made for (its norm's input would not be scaled): refused, nothing changed."""
    model = model_of("gdn")
    norms_cls = type(get_adapter(model)).exact_norms
    listed = norms_cls.config_eps_attributes
    monkeypatch.setattr(norms_cls, "config_eps_attributes", lambda self: listed(self)[1:])
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"model\.layers\.0\.attn_norm\.eps holds the config's norm_eps but the "
                                         r"gated_deltanet adapter does not scale its input"):
        prune_model(model, random_keep(model, 16), META, norm_eps="exact")
    assert _unchanged(model, state)


@pytest.mark.parametrize("bad", ["Exact", None, 1])
def test_bad_norm_eps_is_rejected(bad):
    model = tiny_model("delta_net")
    with pytest.raises(ValueError, match=r"^unknown prune norm_eps .*; valid: stock, exact$"):
        prune_model(model, random_keep(model, 16), META, norm_eps=bad)
