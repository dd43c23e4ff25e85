"""Pruning invariants (paper Sec. 3.3-3.4), on every family, tiny random CPU models.

1. keeping every channel reproduces the logits exactly;
2. the pruned model equals the original with the dropped q/k channels zeroed (zeroed here independently, through
   the dropped rows of q_proj/k_proj: no conv bias and SiLU(0) = 0) to 1e-5 once the pruned o_norm eps is
   multiplied by d_k/d_k' (the kernel scale held at its original value), and differs slightly without it;
3. ``save_pruned`` + ``from_pretrained`` in a fresh process gives identical logits, and cached step-by-step
   decoding of the pruned model matches its full forward pass.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _models import random_keep, tiny_inputs, tiny_model
from statereduce.adapters import adapter_class, get_adapter
from statereduce.prune import (
    RECORD_NAME,
    PruneRecord,
    head_rows,
    load_prune_record,
    prune_model,
    save_pruned,
)
from statereduce.tokenizer import byte_level_tokenizer

D_K = 32
CASES = {  # case id -> (family, config overrides)
    "delta_net": ("delta_net", {}),
    "gdn": ("gated_deltanet", {}),
    "gdn_gva": ("gated_deltanet", {"num_v_heads": 4}),
    "gdn_nogate": ("gated_deltanet", {"use_gate": False}),
}
META = {"method": "rand", "pct": 50, "source_model": "tiny-test", "calibration": "none"}


def logits(model, inputs: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(inputs, use_cache=False).logits


def zero_dropped(model, keep: dict[int, torch.Tensor]) -> None:
    """Zero the q_proj/k_proj rows of the dropped channels, in place (the reference for invariant 2)."""
    adapter = get_adapter(model)
    for layer, mixer in adapter.mixer_layers():
        dropped = torch.ones(adapter.num_heads, adapter.head_k_dim, dtype=torch.bool)
        dropped.scatter_(1, keep[layer], False)
        with torch.no_grad():
            mixer.q_proj.weight[dropped.reshape(-1)] = 0
            mixer.k_proj.weight[dropped.reshape(-1)] = 0


_RELOAD_SCRIPT = """
import sys, torch
torch.set_num_threads(1)
from statereduce.kernels import fla_fallback
fla_fallback.install()
from transformers import AutoModelForCausalLM
for ckpt in sys.argv[1:]:
    model = AutoModelForCausalLM.from_pretrained(ckpt).float().eval()
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
        record = prune_model(model, random_keep(model, 16, seed=5), META)
        inputs = tiny_inputs(length=20)
        (root / case).mkdir()
        torch.save(inputs, root / case / "inputs.pt")
        ckpt = save_pruned(model, byte_level_tokenizer(), record, root / case / "ckpt")
        out[case] = {"ckpt": ckpt, "record": record, "logits": logits(model, inputs)}
    script = root / "reload.py"
    script.write_text(_RELOAD_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), *(str(v["ckpt"]) for v in out.values())], capture_output=True, text=True
    )
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
        record = prune_model(model, keep, {"method": "all", "pct": 0})
        assert torch.equal(logits(model, inputs), before)
        assert model.config.to_dict() == config_before
        assert (record.d_k, record.d_k_new) == (D_K, D_K)

    def test_shapes_and_weights_after_prune(self):
        model = self.model()
        original = copy.deepcopy(model)
        keep = random_keep(model, 12, seed=1)
        prune_model(model, keep, META)
        adapter, orig_adapter = get_adapter(model), get_adapter(original)
        h, hv, d_k, d_v = orig_adapter.dims(original.config)
        assert tuple(adapter.dims(model.config)) == (h, hv, 12, d_v)
        for (layer, mixer), (_, orig) in zip(adapter.mixer_layers(), orig_adapter.mixer_layers()):
            rows = head_rows(keep[layer], d_k)
            for name in ("q_proj", "k_proj"):
                lin, orig_lin = getattr(mixer, name), getattr(orig, name)
                assert lin.out_features == h * 12 and torch.equal(lin.weight, orig_lin.weight[rows])
            for name in ("q_conv1d", "k_conv1d"):
                conv, orig_conv = getattr(mixer, name), getattr(orig, name)
                assert conv.in_channels == conv.out_channels == conv.groups == conv.hidden_size == h * 12
                assert torch.equal(conv.weight, orig_conv.weight[rows])
            assert (mixer.key_dim, mixer.head_k_dim, mixer.head_v_dim) == (h * 12, 12, d_v)
            untouched = [n for n, _ in orig.named_parameters() if not n.startswith(("q_", "k_"))]
            assert all(torch.equal(mixer.get_parameter(n), orig.get_parameter(n)) for n in untouched)
        assert adapter.state_shape().recurrent_elems == hv * 12 * d_v

    @pytest.mark.parametrize("length", [20, 80], ids=["recurrent", "chunk"])
    def test_prune_equals_zeroing_up_to_o_norm_eps(self, length):
        model = self.model()
        inputs = tiny_inputs(length=length)
        keep = random_keep(model, 16, seed=2)
        zeroed = copy.deepcopy(model)
        zero_dropped(zeroed, keep)
        ref = logits(zeroed, inputs)
        assert (logits(model, inputs) - ref).abs().max() > 1e-2  # the dropped channels matter
        prune_model(model, keep, META)
        as_saved = (logits(model, inputs) - ref).abs().max().item()
        for _, mixer in get_adapter(model).mixer_layers():
            mixer.o_norm.eps *= D_K / 16  # == holding the kernel scale at 1/sqrt(d_k)
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
        prune_model(model, random_keep(model, 16, seed=3), META)
        inputs = tiny_inputs(length=16)
        full = logits(model, inputs)
        steps, cache = [], None
        with torch.no_grad():
            for t in range(inputs.shape[1]):
                out = model(inputs[:, t : t + 1], past_key_values=cache, use_cache=True)
                steps.append(out.logits)
                cache = out.past_key_values
        assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-4)

    def test_record(self):
        model = self.model()
        keep = random_keep(model, 8, seed=4)
        record = prune_model(model, keep, META)
        assert PruneRecord.from_json(record.to_json()) == record
        assert all(torch.equal(record.keep_tensors()[layer], keep[layer]) for layer in keep)
        assert (record.family, record.method, record.pct, record.source_model) == (self.family, "rand", 50, "tiny-test")
        assert (record.d_k, record.d_k_new, record.extra) == (D_K, 8, {"calibration": "none"})
        agreeing = {**META, "d_k": D_K, "d_k_new": 8, "num_heads": 2, "family": self.family, "source": "x"}
        other = prune_model(self.model(), keep, {k: v for k, v in agreeing.items() if k != "source_model"})
        assert (other.source_model, other.extra) == ("x", {"calibration": "none"})
        assert record.kernel_scale["pruned"] == 8**-0.5 and record.kernel_scale["original"] == D_K**-0.5
        assert record.kernel_scale["o_norm_eps_factor_for_exact_zeroing"] == 4.0
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
            "d_k' differs": ({0: good[0], 1: good[1][:, :8]}, "keeps 8 channels per head, other layers 16"),
            "meta pct": (good, "pct='50' must be a number"),
            "meta d_k_new": (good, r"meta d_k_new=8 disagrees with the model/selection: d_k_new=16"),
            "meta json": (good, "JSON-serialisable"),
        }
        bad_meta = {"meta pct": {"pct": "50"}, "meta d_k_new": {"d_k_new": 8}, "meta json": {"when": object()}}
        for name, (keep, msg) in bad_cases.items():
            meta = bad_meta.get(name, META)
            with pytest.raises(ValueError, match=msg):
                prune_model(model, keep, meta)
        assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())

    def test_unsorted_keep_is_sorted(self):
        model, other = self.model(), self.model()
        keep = random_keep(model, 16, seed=6)
        prune_model(model, keep, META)
        prune_model(other, {layer: idx.flip(1) for layer, idx in keep.items()}, META)
        inputs = tiny_inputs()
        assert torch.equal(logits(model, inputs), logits(other, inputs))

    def test_hybrid_softmax_layer_untouched(self, monkeypatch):
        import fla.layers.attn

        monkeypatch.setattr(fla.layers.attn, "flash_attn_func", object())  # construction only
        model = self.model(attn={"layers": [1], "num_heads": 2})
        attn_state = {k: v.clone() for k, v in model.model.layers[1].state_dict().items()}
        with pytest.raises(ValueError, match=r"are \[0\]"):
            prune_model(model, random_keep(self.model(), 16), META)  # keep names layer 1
        record = prune_model(model, random_keep(model, 16), META)
        assert list(record.keep) == [0]
        assert model.model.layers[0].attn.q_proj.out_features == 32
        assert all(torch.equal(v, attn_state[k]) for k, v in model.model.layers[1].state_dict().items())


class TestDeltaNet(SlicingContract):
    case = "delta_net"

    def test_config_fields(self):
        model = self.model()
        record = prune_model(model, random_keep(model, 16), META)
        assert model.config.expand_k == 0.5 and record.config_changes == {"expand_k": [1.0, 0.5]}


class TestGatedDeltaNet(SlicingContract):
    case = "gdn"

    def test_config_fields(self):
        model = self.model()
        record = prune_model(model, random_keep(model, 16), META)
        assert (model.config.head_dim, model.config.expand_v) == (16, 4.0)
        assert record.config_changes == {"head_dim": [32, 16], "expand_v": [2.0, 4.0]}

    def test_unrepresentable_value_dim_is_rejected_before_any_change(self):
        model = tiny_model("gated_deltanet", head_dim=64)  # d_v = 128; d_k' = 49 truncates to 127
        state = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(ValueError, match="d_k'=49 with d_v=128"):
            prune_model(model, random_keep(model, 49), META)
        assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
        assert model.config.head_dim == 64


class TestGatedDeltaNetGVA(SlicingContract):
    case = "gdn_gva"


class TestGatedDeltaNetNoGate(SlicingContract):
    case = "gdn_nogate"


def test_save_pruned_is_atomic(tmp_path):
    """A failure while writing leaves no out_dir and no temp dir; a second save replaces the first."""
    model = tiny_model("delta_net")
    record = prune_model(model, random_keep(model, 16), META)

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
