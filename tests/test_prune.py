"""Pruning invariants (paper Sec. 3.3-3.4), on every family, tiny random CPU models.

1. keeping every channel reproduces the logits exactly;
2. the pruned model equals the original with the dropped q/k channels zeroed. The zeroing is done here
   independently of the adapters, through row maps written out per family from its documented layout (fla:
   the rows of q_proj/k_proj, no conv bias and SiLU(0) = 0; Mamba-2: B and C rows of in_proj plus their conv
   weight and bias; Qwen3.5: q and k rows of in_proj_qkv). For the delta-rule families equality holds to 1e-5
   once the pruned output norm's eps is multiplied by d_k/d_k' (the kernel scale held at its original value)
   and differs slightly without it (the default ``norm_eps="stock"``; ``"exact"`` stores an equal checkpoint:
   tests/test_norm_eps.py); Mamba-2's scan has no scale, so its checkpoint equals zeroing as saved;
3. ``save_pruned`` + ``from_pretrained`` of the stock transformers class in a fresh process gives identical
   logits, and cached step-by-step decoding of the pruned model matches its full forward pass.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import _fresh as fresh
import torch

from _models import random_keep, tiny_inputs, tiny_model
from statereduce.adapters import adapter_class, get_adapter
from statereduce.stages.prune import (
    RECORD_NAME,
    PruneRecord,
    head_rows,
    load_prune_record,
    prune_model,
    save_pruned,
)
from statereduce.core.tokenizer import byte_level_tokenizer

D_K = 32
CASES = {  # case id -> (family, config overrides)
    "delta_net": ("delta_net", {}),
    "gdn": ("gated_deltanet", {}),
    "gdn_gva": ("gated_deltanet", {"num_v_heads": 4}),
    "gdn_nogate": ("gated_deltanet", {"use_gate": False}),
    "mamba2": ("mamba2", {}),
    "qwen3_5": ("qwen3_5", {}),
}
META = {"method": "rand", "pct": 50, "source_model": "tiny-test", "calibration": "none"}


def logits(model, inputs: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(inputs, use_cache=False).logits


def qk_row_map(family: str, mixer) -> dict[str, list[torch.Tensor]]:
    """{module name in the mixer: [rows [H, d_k] of q, of k]} written out from each family's documented layout."""
    if family in ("delta_net", "gated_deltanet"):
        h, d = mixer.num_heads, mixer.head_k_dim
        rows = torch.arange(h * d).reshape(h, d)
        out = {"q_proj": [rows], "k_proj": [rows]}
        return out | ({"q_conv1d": [rows], "k_conv1d": [rows]} if mixer.use_short_conv else {})
    if family == "mamba2":  # in_proj [z I | x I | B GN | C GN | dt], conv1d [x | B | C]
        i, g, n = mixer.intermediate_size, mixer.n_groups, mixer.ssm_state_size
        b, c = torch.arange(g * n).reshape(g, n), torch.arange(g * n).reshape(g, n) + g * n
        return {"in_proj": [c + 2 * i, b + 2 * i], "conv1d": [c + i, b + i]}
    if family == "qwen3_5":  # in_proj_qkv and conv1d [q Hk d_k | k Hk d_k | v]
        h, d = mixer.num_k_heads, mixer.head_k_dim
        q = torch.arange(h * d).reshape(h, d)
        return {"in_proj_qkv": [q, q + h * d], "conv1d": [q, q + h * d]}
    raise ValueError(family)


def zero_dropped(model, keep: dict[int, torch.Tensor]) -> None:
    """Zero the dropped channels' rows (weights and biases) in place (the reference for invariant 2)."""
    adapter = get_adapter(model)
    for layer, mixer in adapter.mixer_layers():
        for name, row_sets in qk_row_map(adapter.family, mixer).items():
            module = mixer.get_submodule(name)
            for rows in row_sets:
                dropped = torch.ones(rows.shape, dtype=torch.bool)
                dropped.scatter_(1, keep[layer], False)
                with torch.no_grad():
                    module.weight[rows[dropped]] = 0
                    if module.bias is not None:
                        module.bias[rows[dropped]] = 0


def hold_kernel_scale(family: str, mixer, factor: float) -> None:
    """Multiply the eps of the per-head output norm by ``factor`` (== holding the kernel scale at 1/sqrt(d_k))."""
    if family == "qwen3_5":
        mixer.norm.variance_epsilon *= factor
    else:
        mixer.o_norm.eps *= factor


def cached_steps(model, inputs: torch.Tensor) -> torch.Tensor:
    """Logits of feeding ``inputs`` one token at a time through the model's cache (the family's cache keyword)."""
    adapter = get_adapter(model)
    steps, cache = [], None
    with torch.no_grad():
        for t in range(inputs.shape[1]):
            out = model(inputs[:, t : t + 1], **{adapter.cache_argument: cache}, use_cache=True)
            steps.append(out.logits)
            cache = out.past_key_values if getattr(out, "cache", None) is None else out.cache
    return torch.cat(steps, dim=1)


# Stock classes: AutoModelForCausalLM, except transformers' Mamba2ForCausalLM for mamba2 (fla's registration
# overrides the Auto mapping once fla is imported); fla's layers and Qwen3.5's fla-bound kernels on CPU go to
# torch implementations (the adapters' install_fallbacks, which leave the model classes alone).
_RELOAD_SCRIPT = """
import json, sys, torch
torch.set_num_threads(1)
from transformers import AutoModelForCausalLM, Mamba2ForCausalLM
from statereduce.adapters import adapter_families, adapter_class
for family in adapter_families():
    adapter_class(family).install_fallbacks()
for ckpt in sys.argv[1:]:
    model_type = json.load(open(ckpt + "/config.json"))["model_type"]
    cls = Mamba2ForCausalLM if model_type == "mamba2" else AutoModelForCausalLM
    model = cls.from_pretrained(ckpt).float().eval()
    inputs = torch.load(ckpt + "/../inputs.pt")
    with torch.no_grad():
        torch.save(model(inputs, use_cache=False).logits, ckpt + "/../reloaded_logits.pt")
"""


@pytest.fixture(scope="module")
def reloaded(tmp_path_factory) -> dict[str, dict]:
    """Prune, save and reload every case; all reloads share ONE fresh python process (imports cost seconds)."""
    root = tmp_path_factory.mktemp("pruned")
    out: dict[str, dict] = {}
    for case, (family, overrides) in CASES.items():
        model = tiny_model(family, **overrides)
        record = prune_model(model, random_keep(model, 16, seed=5), META, norm_eps="stock")
        inputs = tiny_inputs(length=20)
        (root / case).mkdir()
        torch.save(inputs, root / case / "inputs.pt")
        ckpt = save_pruned(model, byte_level_tokenizer(), record, root / case / "ckpt")
        out[case] = {"ckpt": ckpt, "record": record, "logits": logits(model, inputs)}
    script = root / "reload.py"
    script.write_text(_RELOAD_SCRIPT)
    proc = fresh.run([str(script), *(str(v["ckpt"]) for v in out.values())], preload=fresh.TORCH)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for case, v in out.items():
        v["reloaded"] = torch.load(root / case / "reloaded_logits.pt")
    return out


def test_head_rows():
    assert head_rows(torch.tensor([[0, 2], [1, 3]]), 4).tolist() == [0, 2, 5, 7]


class SlicingContract:
    """Invariant tests for one family/variant (``case`` in ``CASES``)."""

    case: str

    @property
    def family(self) -> str:
        return CASES[self.case][0]

    def model(self, **extra):
        return tiny_model(self.family, **CASES[self.case][1], **extra)

    def test_keep_all_is_exact(self):
        model = self.model()
        inputs = tiny_inputs(length=20)
        before, config_before = logits(model, inputs), model.config.to_dict()
        keep = {layer: torch.arange(D_K).repeat(2, 1) for layer, _ in get_adapter(model).mixer_layers()}
        record = prune_model(model, keep, {"method": "all", "pct": 0}, norm_eps="stock")
        assert torch.equal(logits(model, inputs), before)
        assert model.config.to_dict() == config_before
        assert (record.d_k, record.d_k_new) == (D_K, D_K)

    def test_shapes_and_weights_after_prune(self):
        model = self.model()
        original = copy.deepcopy(model)
        keep = random_keep(model, 12, seed=1)
        prune_model(model, keep, META, norm_eps="stock")
        adapter, orig_adapter = get_adapter(model), get_adapter(original)
        h, hv, d_k, d_v = orig_adapter.dims(orig_adapter.config)
        assert tuple(adapter.dims(adapter.config)) == (h, hv, 12, d_v)
        for (layer, mixer), (_, orig) in zip(adapter.mixer_layers(), orig_adapter.mixer_layers()):
            row_map = qk_row_map(self.family, orig)
            for name, row_sets in row_map.items():
                module, orig_module = mixer.get_submodule(name), orig.get_submodule(name)
                n = orig_module.weight.shape[0]
                dropped = torch.zeros(n, dtype=torch.bool)
                for rows in row_sets:
                    mask = torch.ones(rows.shape, dtype=torch.bool)
                    mask.scatter_(1, keep[layer], False)
                    dropped[rows[mask]] = True
                kept = (~dropped).nonzero().squeeze(1)
                assert torch.equal(module.weight, orig_module.weight[kept])
                if orig_module.bias is not None:
                    assert torch.equal(module.bias, orig_module.bias[kept])
                size = module.out_features if isinstance(module, torch.nn.Linear) else module.out_channels
                assert size == n - len(row_sets) * h * (d_k - 12)
                if isinstance(module, torch.nn.Conv1d):
                    assert module.in_channels == module.groups == size
            for attr, value in self.mixer_sizes(h, hv, 12, d_v).items():
                assert getattr(mixer, attr) == value, attr
            untouched = [n for n, _ in orig.named_parameters() if n.rsplit(".", 1)[0] not in row_map]
            assert all(torch.equal(mixer.get_parameter(n), orig.get_parameter(n)) for n in untouched)
        assert adapter.state_shape().recurrent_elems == hv * 12 * d_v

    def mixer_sizes(self, h, hv, d_k_new, d_v) -> dict:
        """The mixer's size attributes after pruning to d_k_new (family hook)."""
        return {"key_dim": h * d_k_new, "head_k_dim": d_k_new, "head_v_dim": d_v}

    @pytest.mark.parametrize("length", [20, 80], ids=["recurrent", "chunk"])
    def test_prune_equals_zeroing_up_to_o_norm_eps(self, length):
        model = self.model()
        inputs = tiny_inputs(length=length)
        keep = random_keep(model, 16, seed=2)
        zeroed = copy.deepcopy(model)
        zero_dropped(zeroed, keep)
        ref = logits(zeroed, inputs)
        assert (logits(model, inputs) - ref).abs().max() > 1e-2  # the dropped channels matter
        prune_model(model, keep, META, norm_eps="stock")
        as_saved = (logits(model, inputs) - ref).abs().max().item()
        if not get_adapter(model).kernel_scale:
            assert as_saved <= 1e-5  # no kernel scale (Mamba-2): exact as saved
            return
        for _, mixer in get_adapter(model).mixer_layers():
            hold_kernel_scale(self.family, mixer, D_K / 16)
        held = (logits(model, inputs) - ref).abs().max().item()
        assert held <= 1e-5
        assert 1e-4 < as_saved < 0.5  # the eps effect is real but small (documented in the record)

    def test_reload_in_fresh_process_is_identical(self, reloaded):
        r = reloaded[self.case]
        assert (r["reloaded"] - r["logits"]).abs().max().item() == 0.0
        ckpt: Path = r["ckpt"]
        assert {"config.json", "model.safetensors", "tokenizer.json", RECORD_NAME} <= {p.name for p in ckpt.iterdir()}
        assert [p.name for p in ckpt.parent.iterdir() if p.name.startswith(".")] == []  # no temp dirs left
        assert load_prune_record(ckpt) == r["record"]
        config = adapter_class(self.family).config_class.from_pretrained(ckpt)
        assert adapter_class(self.family).dims(config).head_k_dim == 16

    def test_cached_decoding_matches_full_forward(self):
        model = self.model()
        prune_model(model, random_keep(model, 16, seed=3), META, norm_eps="stock")
        inputs = tiny_inputs(length=20)
        assert torch.allclose(cached_steps(model, inputs), logits(model, inputs), atol=1e-4)

    def test_record(self):
        model = self.model()
        keep = random_keep(model, 8, seed=4)
        record = prune_model(model, keep, META, norm_eps="stock")
        assert PruneRecord.from_json(record.to_json()) == record
        assert all(torch.equal(record.keep_tensors()[layer], keep[layer]) for layer in keep)
        assert (record.family, record.method, record.pct, record.source_model) == (self.family, "rand", 50, "tiny-test")
        assert (record.d_k, record.d_k_new, record.extra) == (D_K, 8, {"calibration": "none"})
        agreeing = {**META, "d_k": D_K, "d_k_new": 8, "num_heads": 2, "family": self.family, "source": "x"}
        other = prune_model(self.model(), keep, {k: v for k, v in agreeing.items() if k != "source_model"},
                            norm_eps="stock")
        assert (other.source_model, other.extra) == ("x", {"calibration": "none"})
        assert "norm_eps" not in record.kernel_scale  # the default, norm_eps="stock", records no norm_eps entry
        if get_adapter(model).kernel_scale:
            assert record.kernel_scale["pruned"] == 8**-0.5 and record.kernel_scale["original"] == D_K**-0.5
            assert record.kernel_scale["o_norm_eps_factor_for_exact_zeroing"] == 4.0
        else:
            assert record.kernel_scale["pruned"] is None and "no q/k scale" in record.kernel_scale["note"]
        head_line = json.dumps(keep[0][0].tolist())
        assert head_line in record.to_json()  # one line per head

    def test_bad_keep_is_rejected_before_any_change(self):
        model = self.model()
        state = {k: v.clone() for k, v in model.state_dict().items()}
        good = random_keep(model, 16)
        bad_cases = {
            "missing layer": ({0: good[0]}, r"covers layers \[0\]; .* are \[0, 1\]"),
            "wrong heads": ({0: good[0][:1], 1: good[1][:1]}, r"shape \(1, 16\); expected \[num_heads=2"),
            "out of range": ({0: good[0], 1: good[1] + 16}, r"span \[\d+, \d+\]; valid: \[0, d_k=32\)"),
            "repeated": ({0: good[0], 1: torch.zeros(2, 16, dtype=torch.long)}, "repeated"),
            "one repeated": ({0: good[0], 1: torch.cat([good[1][:, :1], good[1][:, :15]], dim=1)}, "repeated"),
            "meta pct": (good, "pct='50' must be a number"),
            "meta d_k_new": (good, r"meta d_k_new=8 disagrees with the model/selection: d_k_new=16"),
            "meta json": (good, "JSON-serialisable"),
        }
        bad_meta = {"meta pct": {"pct": "50"}, "meta d_k_new": {"d_k_new": 8}, "meta json": {"when": object()}}
        for name, (keep, msg) in bad_cases.items():
            meta = bad_meta.get(name, META)
            with pytest.raises(ValueError, match=msg):
                prune_model(model, keep, meta, norm_eps="stock")
        assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())

    def test_unsorted_keep_is_sorted(self):
        model, other = self.model(), self.model()
        keep = random_keep(model, 16, seed=6)
        prune_model(model, keep, META, norm_eps="stock")
        prune_model(other, {layer: idx.flip(1) for layer, idx in keep.items()}, META, norm_eps="stock")
        inputs = tiny_inputs()
        assert torch.equal(logits(model, inputs), logits(other, inputs))

class FlaSlicing(SlicingContract):
    def test_hybrid_softmax_layer_untouched(self, monkeypatch):
        import fla.layers.attn

        monkeypatch.setattr(fla.layers.attn, "flash_attn_func", object())  # construction only
        model = self.model(attn={"layers": [1], "num_heads": 2})
        attn_state = {k: v.clone() for k, v in model.model.layers[1].state_dict().items()}
        with pytest.raises(ValueError, match=r"are \[0\]"):
            prune_model(model, random_keep(self.model(), 16), META, norm_eps="stock")  # keep names layer 1
        record = prune_model(model, random_keep(model, 16), META, norm_eps="stock")
        assert list(record.keep) == [0]
        assert model.model.layers[0].attn.q_proj.out_features == 32
        assert all(torch.equal(v, attn_state[k]) for k, v in model.model.layers[1].state_dict().items())


class TestDeltaNet(FlaSlicing):
    case = "delta_net"

    def test_config_fields(self):
        model = self.model()
        record = prune_model(model, random_keep(model, 16), META, norm_eps="stock")
        assert model.config.expand_k == 0.5 and record.config_changes == {"expand_k": [1.0, 0.5]}


class TestGatedDeltaNet(FlaSlicing):
    case = "gdn"

    def test_config_fields(self):
        model = self.model()
        record = prune_model(model, random_keep(model, 16), META, norm_eps="stock")
        assert (model.config.head_dim, model.config.expand_v) == (16, 4.0)
        assert record.config_changes == {"head_dim": [32, 16], "expand_v": [2.0, 4.0]}

    def test_unrepresentable_value_dim_is_rejected_before_any_change(self):
        model = tiny_model("gated_deltanet", head_dim=64)  # d_v = 128; d_k' = 49 truncates to 127
        state = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(ValueError, match="d_k'=49 with d_v=128"):
            prune_model(model, random_keep(model, 49), META, norm_eps="stock")
        assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
        assert model.config.head_dim == 64


class TestGatedDeltaNetGVA(FlaSlicing):
    case = "gdn_gva"


class TestGatedDeltaNetNoGate(FlaSlicing):
    case = "gdn_nogate"


class TestMamba2(SlicingContract):
    case = "mamba2"

    def mixer_sizes(self, h, hv, d_k_new, d_v):
        return {"ssm_state_size": d_k_new, "conv_dim": 128 + 2 * h * d_k_new, "head_dim": d_v}

    def test_config_fields(self):
        model = self.model()
        record = prune_model(model, random_keep(model, 16), META, norm_eps="stock")
        assert model.config.state_size == 16 and record.config_changes == {"state_size": [32, 16]}

    def test_no_channel_left_in_a_group_is_rejected(self):
        model = self.model()
        with pytest.raises(ValueError, match=r"expected \[num_heads=2, d_k'>0\]"):
            prune_model(model, {0: torch.zeros(2, 0, dtype=torch.long), 1: torch.zeros(2, 0, dtype=torch.long)}, META,
                        norm_eps="stock")


class TestQwen35(SlicingContract):
    case = "qwen3_5"

    def mixer_sizes(self, h, hv, d_k_new, d_v):
        return {"key_dim": h * d_k_new, "head_k_dim": d_k_new, "conv_dim": 2 * h * d_k_new + hv * d_v}

    def test_config_fields(self):
        model = self.model()
        record = prune_model(model, random_keep(model, 16), META, norm_eps="stock")
        assert model.config.linear_key_head_dim == 16
        assert record.config_changes == {"linear_key_head_dim": [32, 16]}

    def test_attention_layer_and_everything_outside_the_mixers_untouched(self):
        model = self.model()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        prune_model(model, random_keep(model, 16), META, norm_eps="stock")
        after = model.state_dict()
        changed = {k for k in before if k not in after or not torch.equal(before[k], after[k])}
        sliced = ("in_proj_qkv", "conv1d")
        assert changed == {f"model.layers.{i}.linear_attn.{m}.weight" for i in (0, 1) for m in sliced}
        assert all(k.startswith("model.layers.2.") for k in before if "self_attn" in k)


def test_save_pruned_is_atomic(tmp_path):
    """A failure while writing leaves no out_dir and no temp dir; a second save replaces the first."""
    model = tiny_model("delta_net")
    record = prune_model(model, random_keep(model, 16), META, norm_eps="stock")

    class BrokenTokenizer:
        def save_pretrained(self, path):
            raise OSError("disk full")

    out = tmp_path / "pruned"
    with pytest.raises(OSError, match="disk full"):
        save_pruned(model, BrokenTokenizer(), record, out)
    assert list(tmp_path.iterdir()) == []
    save_pruned(model, None, record, out)
    (out / "stale.txt").write_text("old")
    save_pruned(model, byte_level_tokenizer(), record, out)
    assert not (out / "stale.txt").exists() and (out / "tokenizer.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["pruned"]
