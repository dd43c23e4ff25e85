"""The stages after pruning on checkpoints whose layers keep different key widths (per-layer budgets): state size in
``eval.json``, rank analysis and recovery fine-tuning, each against a reference computed without the per-layer
code (sizes written out by hand, the zero-masked full-width model, a fresh process)."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import _fresh as fresh
import torch
from _models import tiny_arch, tiny_inputs, tiny_model
from _paths import ROOT
from safetensors.torch import load_file
from test_mixed_widths import EPS, FAMILIES, mixed_selection, zero_masked

from statereduce.stages import rft as ft
from statereduce.adapters import adapter_for_config, get_adapter
from statereduce.adapters.conv_sharing import tie_qk_convs
from statereduce.stages.rank import check_selection_widths, collect_rank_samples, rank_report
from statereduce.eval.documents import state_record
from statereduce.core.models import build_random, checkpoint_config, load_model, save_checkpoint
from statereduce.stages.prune import prune_model, save_pruned
from statereduce.common.settings import RftSettings
from statereduce.core.slicing import KEY_DIMS_FIELD, OUTPUT_NORM_EPS_FIELD
from statereduce.core.tokenizer import byte_level_tokenizer

# tests/_models.py TINY, written out: (linear-attention layers, value heads HV, d_v) of every family; d_k = 32
STATE = {"delta_net": ([0, 1], 2, 32), "gated_deltanet": ([0, 1], 2, 64), "mamba2": ([0, 1], 8, 16),
         "qwen3_5": ([0, 1], 4, 16)}


def uniform_selection(keep: dict[int, torch.Tensor], width: int) -> dict[int, torch.Tensor]:
    """The first ``width`` of each head's channels 0..d_k-1 in every layer of ``keep``."""
    return {layer: torch.arange(width).expand(rows.shape[0], -1).clone() for layer, rows in keep.items()}


def cached_states(model, ids) -> dict[int, torch.Tensor]:
    """{layer: recurrent state [B, HV, d_v, d_k']} of one forward with the cache, read through the adapter."""
    with torch.no_grad():
        out = model(ids, use_cache=True)
    cache = out.past_key_values if getattr(out, "cache", None) is None else out.cache
    return {k: v.clone() for k, v in get_adapter(model).recurrent_states(cache).items()}


# ---- state size ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_state_bytes_sum_each_layers_own_width(family, tmp_path):
    model = tiny_model(family, **EPS[family])
    keep = mixed_selection(model)  # widths 8 and 16 in the two linear-attention layers
    layers, hv, d_v = STATE[family]
    full = 4 * sum(hv * 32 * d_v for _ in layers)
    assert get_adapter(model).state_bytes() == full
    record = prune_model(model, keep, {"method": "test"}, norm_eps="exact")
    adapter = get_adapter(model)
    by_hand = 4 * (hv * 8 * d_v + hv * 16 * d_v)
    assert adapter.layer_key_dims() == {layers[0]: 8, layers[1]: 16}
    assert adapter.state_bytes() == by_hand
    states = cached_states(model, tiny_inputs(batch=3, length=8))  # the model's own cache, per sequence
    assert sum(s[0].numel() for s in states.values()) * 4 == by_hand
    with pytest.raises(ValueError, match="the layers keep different key widths"):
        adapter.state_shape()
    state = state_record(model)
    assert state["state_bytes_per_sequence"] == by_hand and state["layers"] == 2
    assert state["key_dims"] == {str(layers[0]): 8, str(layers[1]): 16} and state["d_k"] == 12
    # the config alone (no model: planning, speed) counts the same
    folder = save_pruned(model, byte_level_tokenizer(), record, tmp_path / "p")

    config = checkpoint_config(folder)[1]  # the stock config (AutoConfig needs trust_remote_code: portable.py)
    assert adapter_for_config(config).config_state_bytes(config) == by_hand
    assert get_adapter(load_model(folder)[0]).state_bytes() == by_hand


@pytest.mark.parametrize("family", FAMILIES)
def test_a_mixed_allocation_of_the_uniform_total_has_the_uniform_state_bytes(family):
    mixed, uniform = tiny_model(family), tiny_model(family)
    keep = mixed_selection(mixed)  # 8 + 16 channels per head = 2 x 12
    prune_model(mixed, keep, {"method": "test"})
    prune_model(uniform, uniform_selection(keep, 12), {"method": "test"})
    assert not hasattr(uniform.config, KEY_DIMS_FIELD) and hasattr(mixed.config, KEY_DIMS_FIELD)
    a, b = get_adapter(mixed), get_adapter(uniform)
    assert a.state_bytes() == b.state_bytes() == 4 * sum(STATE[family][1] * 12 * STATE[family][2] for _ in range(2))
    ra, rb = state_record(mixed), state_record(uniform)
    assert ra["state_bytes_per_sequence"] == rb["state_bytes_per_sequence"] and ra["d_k"] == rb["d_k"] == 12
    assert ra["conv_elems_per_layer"] == rb["conv_elems_per_layer"]


# ---- rank analysis ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_rank_utilization_divides_by_each_layers_width(family):
    """With ``norm_eps="exact"`` the pruned model computes what the full-width zero-masked one does, so its states
    are the masked model's kept columns: the same stable rank, and u over min(d_v, d_k'(layer)) instead of d_k."""
    model = tiny_model(family, **EPS[family])
    keep = mixed_selection(model)
    ref = zero_masked(model, keep)
    pruned = copy.deepcopy(model)
    prune_model(pruned, keep, {"method": "test"}, norm_eps="exact")
    h, hv = get_adapter(model).num_heads, STATE[family][1]
    d_v = STATE[family][2]
    ids = tiny_inputs(batch=2, length=20)
    got, want = cached_states(pruned, ids), cached_states(ref, ids)
    for layer, S in got.items():
        cols = keep[layer][torch.arange(hv) // (hv // h)]  # value head i reads q/k head i // (HV / H)
        masked = torch.take_along_dim(want[layer], cols[None, :, None, :].expand(S.shape), dim=-1)
        torch.testing.assert_close(S, masked, rtol=1e-4, atol=1e-5)
        assert torch.count_nonzero(want[layer]) == torch.count_nonzero(masked)  # dropped columns are zero there
    samples = collect_rank_samples(pruned, ids, skip=8, stride=4)
    base = collect_rank_samples(ref, ids, skip=8, stride=4)
    widths = {layer: len(rows[0]) for layer, rows in keep.items()}
    assert samples.key_dims == widths and base.key_dims == dict.fromkeys(widths, 32) and samples.d_k == 12
    for key, er in samples.er.items():
        np.testing.assert_allclose(er, base.er[key], rtol=1e-3)
        np.testing.assert_allclose(samples.u[key], er / min(d_v, widths[key[0]]))
        np.testing.assert_allclose(base.u[key], base.er[key] / min(d_v, 32))
    doc = json.loads(json.dumps(rank_report(pruned, ids, skip=8, stride=4, spectrum_head=(1, 0))))
    assert doc["model"]["key_dims"] == {str(k): w for k, w in widths.items()} and doc["model"]["d_k"] == 12
    assert {(r["layer"], r["d_k"]) for r in doc["per_head"]} == set(widths.items())
    assert len(doc["spectrum"]["mean"]) == min(d_v, widths[1])


def test_a_selection_must_keep_the_checkpoints_widths():
    keep = {0: [[0, 1], [2, 3]], 1: np.zeros((2, 4, 8))}  # an index layer and a transform layer
    check_selection_widths(keep, {0: 2, 1: 4}, "sel.parquet", "pruned")
    with pytest.raises(ValueError, match=r"^sel.parquet keeps widths \{0: 2, 1: 4\} per layer but pruned's layers have "
                                         r"\{0: 2, 1: 8\}; rebuild the pruned checkpoint from it$"):
        check_selection_widths(keep, {0: 2, 1: 8}, "sel.parquet", "pruned")


# ---- recovery fine-tuning --------------------------------------------------------------------------------------
# keep: last, so that the saved checkpoint is the trained one (two steps may not beat step 0 on validation); two
# validation documents, as the 100 KB corpus's train split holds only a few
RFT = {"n_samples": 4, "seq_len": 32, "batch_size": 2, "micro_batch_size": 2, "log_every": 1, "save_every": 100,
       "keep": "last", "val_samples": 2}
CORPUS = {"source": "embedded", "max_bytes": 100_000}


@pytest.mark.parametrize("family", ["delta_net", "gated_deltanet"])
def test_shared_filters_of_a_mixed_checkpoint_tie_per_layer(family):
    """Filters shared within each head (``pretrain.share_conv: head``) stay so per layer after a mixed pruning, and
    RFT ties them in blocks of each layer's own d_k'."""
    model = tiny_model(family)
    adapter = get_adapter(model)
    with torch.no_grad():
        for _, mixer in adapter.mixer_layers():
            for conv in (mixer.q_conv1d, mixer.k_conv1d):
                w = conv.weight.view(adapter.num_heads, 32, *conv.weight.shape[1:])
                w.copy_(w[:, :1].expand_as(w))
    prune_model(model, mixed_selection(model), {"method": "test"})
    assert {layout.conv_sharing() for layout in adapter.layouts()} == {"head"}
    ids = tiny_inputs(batch=1, length=12)
    with torch.no_grad():
        before = model(ids).logits
        untie = tie_qk_convs(adapter, "head")
        tied = model(ids).logits
    untie()
    torch.testing.assert_close(tied, before, rtol=0, atol=0)
    assert {layout.conv_sharing() for layout in adapter.layouts()} == {"head"}


@pytest.mark.parametrize("family", FAMILIES)
def test_rft_of_a_mixed_checkpoint_keeps_its_widths_and_reloads(family, tmp_path):
    tok = byte_level_tokenizer()
    base = tmp_path / "base"
    save_checkpoint(build_random(family, tiny_arch(family, byte_vocab=True, **EPS[family])), tok, base)
    model, _ = load_model(base)
    record = prune_model(model, mixed_selection(model), {"source": str(base), "method": "rand", "pct": 62.5},
                         norm_eps="exact")
    pruned = save_pruned(model, tok, record, tmp_path / "pruned")
    out, kept = tmp_path / "rft", {}
    rec = ft.fine_tune(pruned, base, out, RftSettings.from_dict(RFT), CORPUS, on_saved=lambda m, t, o: kept.update(model=m))
    assert rec["steps"] == 2
    before, after = load_file(str(pruned / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert {k: v.shape for k, v in after.items()} == {k: v.shape for k, v in before.items()}
    assert any(not torch.equal(before[k], after[k]) for k in before)  # it trained
    config, pruned_config = (json.loads((d / "config.json").read_text()) for d in (out, pruned))
    assert config[KEY_DIMS_FIELD] == pruned_config[KEY_DIMS_FIELD] == getattr(model.config, KEY_DIMS_FIELD)
    assert config.get(OUTPUT_NORM_EPS_FIELD) == pruned_config.get(OUTPUT_NORM_EPS_FIELD)
    if get_adapter(model).kernel_scale:
        assert any(e is not None for e in config[OUTPUT_NORM_EPS_FIELD])
    assert get_adapter(kept["model"]).layer_key_dims() == get_adapter(model).layer_key_dims()
    ids = tiny_inputs(batch=2, length=20) % 256
    with torch.no_grad():
        logits = kept["model"](ids).logits
    torch.save({"ids": ids, "logits": logits}, tmp_path / "x.pt")
    script = ("import torch\nfrom statereduce.core.models import load_model\n"
              "from statereduce.adapters import get_adapter\n"
              f"m, _ = load_model({str(out)!r}); d = torch.load({str(tmp_path / 'x.pt')!r})\n"
              "with torch.no_grad(): out = m(d['ids']).logits\n"
              "assert torch.equal(out, d['logits']), float((out - d['logits']).abs().max())\n"
              "print(get_adapter(m).state_bytes())\n")
    run = fresh.run(["-c", script], timeout=300, cwd=ROOT, preload=fresh.TORCH)
    assert run.returncode == 0, run.stderr[-2000:]
    assert int(run.stdout.split()[-1]) == get_adapter(model).state_bytes()
