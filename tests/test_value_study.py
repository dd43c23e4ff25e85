"""Study ``values`` (statereduce/studies/value_study.py): its cells, its checks, and its table and figure from planted
summaries and calibration activations."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import yaml

from _paths import ROOT
from statereduce.config.blocks import ConfigError
from statereduce.core.h5files import write_layers
from statereduce.studies import get_study, outputs, write_outputs
from statereduce.studies.value_study import utilisation_frame, value_frame

BLOCK = {"models": ["m1", "m2"], "selectors": ["drrqr"], "pcts": [75], "recipe": "drrqr@sens", "split": "split",
         "split_layers": "layersplit"}


def _config() -> dict:
    return yaml.safe_load((ROOT / "config.yaml").read_text())


def test_cells_are_every_cut_at_equal_state_and_the_recipe():
    cfg = _config()
    cells = get_study("values").cells(cfg, cfg["studies"]["values"])
    block = cfg["studies"]["values"]
    assert block["split"] == "split" and block["split_layers"] == "layersplit"
    assert len(cells) == len(block["models"]) * len(block["pcts"]) * (5 * len(block["selectors"]) + 1)
    assert ("tiny-qwen35", "grad-kv@layersplit", 75.0) in cells
    assert ("tiny-gdn", "drrqr-kv", 75.0) in cells and ("tiny-qwen35", "grad-v", 50.0) in cells
    assert ("tiny-dn", "drrqr@sens", 50.0) in cells and ("tiny-mamba2", "grad-kv@split", 75.0) in cells
    for key in ("split", "split_layers"):
        without = get_study("values").cells(cfg, {k: v for k, v in block.items() if k != key})
        assert len(without) == len(cells) - len(block["models"]) * len(block["pcts"]) * len(block["selectors"])


@pytest.mark.parametrize("change, message", [
    ({"selectors": ["pca"]}, r"studies.values.selectors: selector 'pca' has no value side \(no -v or -kv\)"),
    ({"recipe": "drrqr-v"}, r"studies.values.recipe: 'drrqr-v' is not a key-only method"),
    ({"recipe": "drrqr@nope"}, r"studies.values.recipe: unknown budget 'nope'"),
    ({"models": ["nope"]}, r"studies.values.models: unknown model 'nope'"),
    ({"split": "sens"}, r"studies.values.split: method 'grad-kv@sens': budgets.sens has policy 'sensitivity'"),
    ({"split": "nope"}, r"studies.values.split: unknown budget 'nope'"),
    ({"split": "layersplit"}, r"studies.values.split: budgets.layersplit has per_layer true; split takes a split "
                              r"budget with per_layer false"),
    ({"split_layers": "split"}, r"studies.values.split_layers: budgets.split has per_layer false; split_layers takes "
                                r"a split budget with per_layer true"),
])
def test_a_bad_block_fails_in_one_line(change, message):
    cfg = _config()
    block = {**copy.deepcopy(cfg["studies"]["values"]), **change}
    with pytest.raises(ConfigError, match=message) as err:
        get_study("values").cells(cfg, block)
    assert "\n" not in str(err.value)


def _summary(model, method, pct, pre, post, d_k, d_v, ratio, key_dims=None, value_dims=None):
    def metrics(bpb):
        return {"heldout": {"bits_per_byte": bpb},
                "recall_mqar_4": {"acc": 0.5, "acc_stderr": 0.05}, "recall_mqar_8": {"acc": 0.3, "acc_stderr": 0.05}}

    return {"model": model, "method": method, "pct": pct,
            "metrics": {"baseline": metrics(1.0), "pruned": metrics(pre), "rft": metrics(post)},
            "state": {"ratio": ratio, "d_k_after": d_k, "d_v_after": d_v, "d_v_before": 64,
                      **({"key_dims_after": key_dims} if key_dims else {}),
                      **({"value_dims_after": value_dims} if value_dims else {})}}


def _activations(path, key_rank: int, seed: int):
    """Two layers, 2 heads of d_k = 16 keys of rank ``key_rank``, 2 value heads of d_v = 8 at full rank."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for layer in (0, 1):
        k = rng.normal(size=(2, 200, key_rank)) @ rng.normal(size=(key_rank, 16))
        arrays[layer] = {"K": k.astype(np.float32), "Q": k.astype(np.float32),
                         "V": rng.normal(size=(2, 200, 8)).astype(np.float32), "xnorm": np.ones(4)}
    return write_layers(path, arrays, {"model": "m"})


@pytest.fixture()
def study_inputs(tmp_path):
    docs = []
    for model, (keys, values, joint) in {"m1": (1.5, 1.2, 1.3), "m2": (1.5, 1.9, 1.6)}.items():
        docs += [_summary(model, "drrqr", 75, keys, keys - 0.1, 16, 64, 0.25),
                 _summary(model, "drrqr-v", 75, values, values - 0.1, 64, 16, 0.25),
                 _summary(model, "drrqr-kv", 75, joint, joint - 0.1, 32, 32, 0.25),
                 _summary(model, "drrqr-kv@split", 75, min(keys, values) - 0.05, 1.0, 64, 16, 0.25),
                 _summary(model, "drrqr-kv@layersplit", 75, keys - 0.01, keys - 0.2, 20, 52, 0.2503,
                          {"0": 24, "1": 16}, {"0": 43, "1": 64}),
                 _summary(model, "drrqr@sens", 75, 1.4, 1.3, 16, 64, 0.25)]
    paths = []
    for i, doc in enumerate(docs):
        paths.append(tmp_path / f"s{i}.json")
        paths[-1].write_text(json.dumps(doc))
    acts = [str(_activations(tmp_path / "a1.h5", 2, 0)), str(_activations(tmp_path / "a2.h5", 12, 1))]
    return {"summaries": [str(p) for p in paths], "activations": acts}, docs


def test_frame_table_and_figure(study_inputs, tmp_path):
    inputs, docs = study_inputs
    study = get_study("values")
    paths = {k: str(tmp_path / "out" / p.split("/")[-1]) for k, p in outputs(study).items()}
    (tmp_path / "out").mkdir()
    write_outputs(study, inputs, BLOCK, paths)
    md = (tmp_path / "out" / "value_study.md").read_text()
    assert "## 75% of the state removed" in md
    assert "| m1 | drrqr-kv | keys+values | 32 × 32 | 0.250 | 1.300 → 1.200 | -0.200 | -0.200 |" in md
    assert "| 75 | drrqr | keys+values | 1 of 2: m1 |" in md and "| 75 | drrqr | values | 1 of 2: m1 |" in md
    assert "| m1 | drrqr-kv@split | keys+values, split by loss | 64 × 16 | 0.250 | 1.150 → 1.000 | -0.350 |" in md
    assert "| 75 | drrqr | keys+values, split by loss | 2 of 2: m1, m2 |" in md
    assert ("| m2 | drrqr-kv@layersplit | keys+values, split per layer | 24×43, 16×64 | 0.250 | 1.490 → 1.300 | "
            "-0.010 | -0.100 |") in md
    assert "| 75 | drrqr | keys+values, split per layer | 2 of 2: m1, m2 |" in md
    assert (tmp_path / "out" / "value_loss.png").stat().st_size > 1000
    df = value_frame(docs, BLOCK)
    recipe = df[(df["method"] == "drrqr@sens") & (df["stage"] == "pruned")]
    assert recipe["d_bits_per_byte"].isna().all() and len(recipe) == 2  # the recipe is shown, not compared
    assert df.loc[(df["model"] == "m2") & (df["method"] == "drrqr-v") & (df["stage"] == "pruned"),
                  "d_bits_per_byte"].item() == pytest.approx(0.4)


def test_utilisation_tells_a_low_rank_side(study_inputs):
    inputs, _ = study_inputs
    use = utilisation_frame(dict(zip(BLOCK["models"], inputs["activations"])))
    m1 = use[use["model"] == "m1"]
    assert (m1["key_use"] < 0.2).all() and (m1["value_use"] > 0.9).all()  # keys of rank 2 of 16, values full
    assert (use.loc[use["model"] == "m2", "key_use"] > 2 * m1["key_use"].max()).all()  # rank 12 of 16
    assert not math.isnan(use["value_use"].sum())
