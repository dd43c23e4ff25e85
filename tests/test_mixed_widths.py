"""Per-layer key widths (per-layer key budgets): a selection whose layers keep different d_k' prunes every
family to a checkpoint that equals zero-masking (``norm_eps="exact"``: each mixer's output-norm eps times
d_k/d_k'(layer)), reloads in a fresh process through ``load_model`` with identical logits, and decodes with its
cache as the full forward computes; a uniform selection keeps today's path."""

from __future__ import annotations

import copy
import json

import pytest
import _fresh as fresh
import torch
from _models import tiny_inputs, tiny_model
from _paths import ROOT

from statereduce.adapters import get_adapter
from statereduce.core.models import load_model
from statereduce.stages.prune import prune_model, save_pruned
from statereduce.core.slicing import KEY_DIMS_FIELD, OUTPUT_NORM_EPS_FIELD
from statereduce.core.tokenizer import byte_level_tokenizer

FAMILIES = ["delta_net", "gated_deltanet", "qwen3_5", "mamba2"]
EPS = {"delta_net": {"norm_eps": 1e-2}, "gated_deltanet": {"norm_eps": 1e-2}, "qwen3_5": {"rms_norm_eps": 1e-2},
       "mamba2": {}}


def mixed_selection(model, seed=1):
    """{layer: [H, d_k'] sorted random channels}, d_k/4 and d_k/2 in alternate linear-attention layers."""
    ad = get_adapter(model)
    h, _, d_k, _ = ad.dims(ad.config)
    gen = torch.Generator().manual_seed(seed)
    layers = [i for i, _ in ad.mixer_layers()]
    widths = {layer: (d_k // 4, d_k // 2)[j % 2] for j, layer in enumerate(layers)}
    return {layer: torch.stack([torch.randperm(d_k, generator=gen)[:w].sort().values for _ in range(h)])
            for layer, w in widths.items()}


def zero_masked(model, keep):
    """A copy of ``model`` with the dropped q/k channel rows of every mixer module set to zero (scale unchanged)."""
    ref = copy.deepcopy(model)
    ad = get_adapter(ref)
    with torch.no_grad():
        for layer, mixer in ad.mixer_layers():
            for entry in ad.layout(mixer).channel_rows():
                for side in ("q", "k"):
                    rows = getattr(entry, side)
                    if rows is None:
                        continue
                    dropped = torch.ones(rows.shape, dtype=torch.bool).scatter_(1, keep[layer], False)
                    entry.module.weight[rows[dropped]] = 0
                    if entry.module.bias is not None:
                        entry.module.bias[rows[dropped]] = 0
    return ref


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def mixed_cases(tmp_path_factory) -> dict[tuple[str, str], dict]:
    """{(family, norm_eps mode): case}: each family's tiny model pruned to mixed widths with ``stock`` and ``exact``,
    saved, and reloaded in ONE fresh process that compares each reloaded model's logits with the in-memory ones
    (``case["reload"]``: "ok", or the largest difference)."""
    root = tmp_path_factory.mktemp("mixed_widths")
    cases = {}
    for family in FAMILIES:
        model = tiny_model(family, **EPS[family])
        keep = mixed_selection(model)
        ids = tiny_inputs(batch=2, length=24)
        with torch.no_grad():
            ref = zero_masked(model, keep)(ids).logits
        for mode in ("stock", "exact"):
            pruned = copy.deepcopy(model)
            record = prune_model(pruned, keep, {"method": "test", "pct": 62.5}, norm_eps=mode)
            with torch.no_grad():
                logits = pruned(ids).logits
            folder = save_pruned(pruned, byte_level_tokenizer(), record, root / family / mode)
            torch.save({"ids": ids, "logits": logits}, root / family / f"{mode}.pt")
            cases[family, mode] = {"widths": getattr(pruned.config, KEY_DIMS_FIELD), "record": record,
                                   "error": rel_err(logits, ref), "folder": str(folder),
                                   "tensors": str(root / family / f"{mode}.pt"),
                                   "kernel_scale": get_adapter(model).kernel_scale}
    paths = json.dumps({f"{f}/{m}": (c["folder"], c["tensors"]) for (f, m), c in cases.items()})
    script = (f"import json, sys, torch; sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
              "from statereduce.core.models import load_model\n"
              f"cases = json.loads({paths!r})\n"
              "out = {}\n"
              "for key, (folder, tensors) in cases.items():\n"
              "    m, _ = load_model(folder); d = torch.load(tensors)\n"
              "    with torch.no_grad(): got = m(d['ids']).logits\n"
              "    out[key] = 'ok' if torch.equal(got, d['logits']) else float((got - d['logits']).abs().max())\n"
              "print(json.dumps(out))\n")
    run = fresh.run(["-c", script], timeout=600, preload=fresh.TORCH)
    assert run.returncode == 0, run.stderr[-2000:]
    reloads = json.loads(run.stdout.strip().splitlines()[-1])
    for (family, mode), case in cases.items():
        case["reload"] = reloads[f"{family}/{mode}"]
    return cases


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_widths_equal_zero_masking_and_reload_in_a_fresh_process(family, mixed_cases):
    for mode in ("stock", "exact"):
        case = mixed_cases[family, mode]
        widths, record = case["widths"], case["record"]
        assert [w for w in widths if w is not None] == [len(rows[0]) for _, rows in sorted(record.keep.items())]
        assert record.d_k_new == max(w for w in widths if w is not None)
        assert case["reload"] == "ok", (mode, case["reload"])  # a fresh process's reload gives identical logits
    errors = {mode: mixed_cases[family, mode]["error"] for mode in ("stock", "exact")}
    assert errors["exact"] < 1e-5, errors
    if mixed_cases[family, "exact"]["kernel_scale"]:
        assert errors["stock"] > 100 * errors["exact"], errors  # the eps effect that exact removes
    else:
        assert errors["stock"] == errors["exact"], errors  # Mamba-2: no kernel scale, nothing to hold


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_widths_decode_with_the_cache_as_the_full_forward(family):
    model = tiny_model(family, **EPS[family])
    prune_model(model, mixed_selection(model), {"method": "test"}, norm_eps="exact")
    ids, steps = tiny_inputs(batch=2, length=12), tiny_inputs(batch=2, length=4, seed=7)
    with torch.no_grad():
        full = model(torch.cat([ids, steps], 1)).logits[:, -4:]
        out = model(ids, use_cache=True)
        if family == "mamba2":  # transformers' Mamba-2 returns `cache` and takes it back as `cache_params`
            cache, n = out.cache, ids.shape[1]
            got = [model(steps[:, t:t + 1], cache_params=cache, use_cache=True, cache_position=torch.tensor([n + t]))
                   for t in range(4)]
        else:
            cache = out.past_key_values
            got = [model(steps[:, t:t + 1], past_key_values=cache, use_cache=True) for t in range(4)]
        got = torch.cat([o.logits for o in got], 1)
    torch.testing.assert_close(got, full, rtol=1e-4, atol=1e-4)


def test_a_uniform_selection_keeps_the_stock_checkpoint():
    """Equal widths in every layer take the single-width path: the config's own head size changes, no per-layer
    field is written."""
    model = tiny_model("delta_net")
    keep = mixed_selection(model)
    width = min(len(rows[0]) for rows in keep.values())
    uniform = {layer: rows[:, :width] for layer, rows in keep.items()}
    prune_model(model, uniform, {"method": "test"}, norm_eps="exact")
    assert not hasattr(model.config, KEY_DIMS_FIELD) and not hasattr(model.config, OUTPUT_NORM_EPS_FIELD)
    assert get_adapter(model).head_k_dim == width


def test_a_mixed_checkpoint_with_wrong_widths_fails_in_one_line(tmp_path):
    model = tiny_model("delta_net")
    record = prune_model(model, mixed_selection(model), {"method": "test"})
    folder = save_pruned(model, byte_level_tokenizer(), record, tmp_path / "p")
    config = (folder / "config.json").read_text()
    (folder / "config.json").write_text(config.replace(f'"{KEY_DIMS_FIELD}": [', f'"{KEY_DIMS_FIELD}": [null, '))
    with pytest.raises(ValueError, match=rf"^{KEY_DIMS_FIELD} names widths for layers \[.*\]; the model's "
                                         r"linear-attention layers are \[0, 1\]$"):
        load_model(folder)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_mixed_checkpoint_names_each_layers_own_channel_rows(family):
    """channel_rows (what capture, masking and further pruning read) follows each mixer's own width."""
    model = tiny_model(family)
    keep = mixed_selection(model)
    prune_model(model, keep, {"method": "test"})
    ad = get_adapter(model)
    for layer, mixer in ad.mixer_layers():
        for entry in ad.layout(mixer).channel_rows():
            for rows in (entry.q, entry.k):
                if rows is not None:
                    assert tuple(rows.shape) == tuple(keep[layer].shape), (layer, entry.name)
