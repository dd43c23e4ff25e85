"""Value and joint cuts: the method grammar (``-v``, ``-kv``), their widths (statereduce.core.cuts), the value sides
of the selectors (statereduce.selectors.values) on planted data, the calibration artifacts they read (V, grad_v,
W_v/W_o), and the selection file from selection to pruning, on tiny random CPU models."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from _models import tiny_inputs, tiny_model
from statereduce.adapters import get_adapter
from statereduce.core.artifacts import ArtifactError
from statereduce.core.cuts import STATE_TOLERANCE, cut_widths, joint_widths
from statereduce.core.selection_file import KeptChannels
from statereduce.selectors import format_method, parse_method
from statereduce.selectors.registry import value_side
from statereduce.selectors.values import ValueData
from statereduce.stages.capture import (
    activation_arrays, capture_activations, export_qk_weights, grad_score_arrays, grad_scores,
)
from statereduce.stages.prune import prune_model
from statereduce.stages.select import read_selection, select_channels, write_selection

RNG = np.random.default_rng(0)


# ---- grammar and widths -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("token, cut", [("drrqr", "keys"), ("drrqr-v", "values"), ("grad-kv", "joint"),
                                        ("l1-v.prose", "values"), ("l1-q", "keys"), ("rand-kv", "joint")])
def test_cut_suffixes_parse_and_format(token, cut):
    spec = parse_method(token)
    assert spec.cut == cut and spec.variant == ("q" if token == "l1-q" else "kq")
    assert format_method(spec) == token


@pytest.mark.parametrize("token, message", [
    ("pca-v", r"selector 'pca' in method token 'pca-v' has no value side for the cut 'v'"),
    ("drrqr-v@sens", r"a value cut takes no budget \(@sens"),
    ("drrqr-x", r"bad variant suffix '-x'"),
])
def test_bad_cut_tokens_fail_in_one_line(token, message):
    with pytest.raises(ValueError, match=message) as err:
        parse_method(token)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("d_k, d_v", [(16, 16), (32, 32), (64, 32), (128, 128), (256, 128), (64, 48)])
@pytest.mark.parametrize("pct", [25, 50, 75, 87.5])
def test_joint_widths_cut_the_state_and_split_it_evenly(d_k, d_v, pct):
    k, v = joint_widths(d_k, d_v, pct)
    target = (1 - pct / 100) * d_k * d_v
    assert abs(k * v - target) <= STATE_TOLERANCE * d_k * d_v
    # no pair within the tolerance splits more evenly
    best = min(abs(a / d_k - b / d_v) for a in range(1, d_k + 1) for b in range(1, d_v + 1)
               if abs(a * b - target) <= STATE_TOLERANCE * d_k * d_v)
    assert abs(k / d_k - v / d_v) == pytest.approx(best)


def test_joint_widths_skip_pairs_the_family_refuses():
    refused = joint_widths(32, 32, 75)
    assert refused == (16, 16)

    def check(k, v):
        if (k, v) == refused:
            raise ValueError("not expressible")

    assert joint_widths(32, 32, 75, check) != refused
    assert cut_widths("values", 32, 64, 75) == (32, 16)
    assert cut_widths("keys", 32, 64, 75) == (8, 64)
    with pytest.raises(ValueError, match="pct=100 is invalid for a joint cut"):
        joint_widths(32, 32, 100)


# ---- the value sides on planted data --------------------------------------------------------------------------------
def test_l1_value_side_keeps_the_heaviest_weights():
    w_v, w_o = RNG.normal(size=(8, 6)) * 0.01, RNG.normal(size=(8, 6)) * 0.01
    w_v[[1, 6]] *= 100
    w_o[[3]] *= 100
    sel = value_side("l1")(ValueData(W_v=w_v, W_o=w_o), 3, rng=RNG)
    assert sel.keep.tolist() == [1, 3, 6]


def test_swanda_value_side_weighs_activations_by_what_the_channel_writes():
    v = RNG.normal(size=(200, 6))
    v[:, 2] *= 10  # large values, but written with a tiny column
    w_o = np.ones((6, 5))
    w_o[2] *= 1e-3
    w_o[4] *= 5
    sel = value_side("swanda")(ValueData(W_o=w_o, V=v, w_norm=np.array([1, 1, 1, 1, 1, 0.01])), 2, rng=RNG)
    assert 2 not in sel.keep and 5 not in sel.keep and 4 in sel.keep


def test_drrqr_value_side_keeps_independent_channels():
    base = RNG.normal(size=(300, 3))
    v = np.concatenate([base, base[:, :1] * 2, base[:, 1:2] - base[:, 2:3], 1e-3 * RNG.normal(size=(300, 1))], 1)
    sel = value_side("drrqr")(ValueData(V=v), 3, rng=RNG)
    assert np.linalg.matrix_rank(v[:, sel.keep]) == 3
    assert 5 not in sel.keep


def test_grad_value_side_and_rand_value_side():
    g = np.array([0.1, 5.0, 0.2, 3.0, 0.0])
    assert value_side("grad")(ValueData(grad_v=g), 2, rng=RNG).keep.tolist() == [1, 3]
    a = value_side("rand")(ValueData(grad_v=g), 3, rng=np.random.default_rng(1)).keep
    b = value_side("rand")(ValueData(grad_v=g), 3, rng=np.random.default_rng(1)).keep
    assert a.tolist() == b.tolist() and len(set(a.tolist())) == 3
    with pytest.raises(ValueError, match="the value side of selector 'grad' needs ValueData.grad_v"):
        value_side("grad")(ValueData(V=np.ones((3, 4))), 2, rng=RNG)


# ---- calibration ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["delta_net", "gated_deltanet", "qwen3_5", "mamba2"])
def test_values_are_sampled_at_the_token_positions_of_the_keys(family):
    """The V rows of activations.h5 are the values the kernel received at the same tokens as the sampled K rows."""
    model, inputs = tiny_model(family), tiny_inputs(batch=2, length=24)
    adapter = get_adapter(model)
    full = {}
    with torch.no_grad(), adapter.capture(on_qk=lambda layer, q, k: full.setdefault(layer, {}).update(k=k),
                                          on_v=lambda layer, v: full.setdefault(layer, {}).update(v=v)):
        model(inputs, use_cache=False)
    arrays, _ = activation_arrays(model, inputs, rows_per_head=10, seed=3, batch_size=2)
    for layer, a in arrays.items():
        k = full[layer]["k"].reshape(-1, *full[layer]["k"].shape[2:]).float().numpy()  # [tokens, H, d_k]
        v = full[layer]["v"].reshape(-1, *full[layer]["v"].shape[2:]).float().numpy()  # [tokens, HV, d_v]
        rows = [int(np.flatnonzero((k[:, 0] == a["K"][0, r]).all(1))[0]) for r in range(a["K"].shape[1])]
        assert np.array_equal(a["V"], v[rows].transpose(1, 0, 2))


@pytest.mark.parametrize("family", ["delta_net", "qwen3_5"])
def test_value_grad_scores_leave_the_key_scores_bit_for_bit(family):
    model, inputs = tiny_model(family), tiny_inputs(batch=4, length=24)
    with_values = grad_score_arrays(copy.deepcopy(model), inputs, batch_size=2)
    keys_only = grad_score_arrays(copy.deepcopy(model), inputs, batch_size=2, values=False)
    for layer, arrays in keys_only.items():
        assert set(arrays) == {"grad_q", "grad_k"}
        for name, value in arrays.items():
            assert np.array_equal(value, with_values[layer][name])
        assert with_values[layer]["grad_v"].min() >= 0 and with_values[layer]["grad_v"].max() > 0


# ---- selection file to pruning --------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["gated_deltanet", "mamba2"])
def artifacts(request, tmp_path_factory):
    family = request.param
    out = tmp_path_factory.mktemp(family)
    model, inputs = tiny_model(family), tiny_inputs(batch=4, length=32)
    attrs = {"model": "t", "calibration": "default"}
    return {"family": family, "model": model, "dir": out,
            "weights": export_qk_weights(model, out / "qk.h5", attrs={"model": "t"}),
            "activations": capture_activations(model, inputs, out / "a.h5", rows_per_head=40, attrs=attrs),
            "grads": grad_scores(model, inputs, out / "g.h5", attrs=attrs)}


@pytest.mark.parametrize("method", ["rand-v", "l1-v", "swanda-v", "grad-v", "drrqr-v", "drrqr-kv", "grad-kv"])
def test_a_value_or_joint_selection_prunes_what_it_names(artifacts, method):
    a = artifacts
    rows, meta = select_channels(a["weights"], method, 75, activations=a["activations"], grads=a["grads"],
                                 expect={"model": "t"})
    path = write_selection(a["dir"] / f"{method}.parquet", rows, meta)
    cut, got = read_selection(path, expect={"model": "t", "method": method, "pct": 75})
    assert isinstance(cut, KeptChannels) and cut.cut.kind == ("values" if method.endswith("-v") else "joint")
    assert set(cut.cut.value_widths.values()) == {got["d_v_new"]}
    assert meta["state_fraction"] == pytest.approx(0.25)
    assert got["value_selection"] == "head"  # fla folds its shared norm weight into the output projection
    assert (cut.keys is None) == (method.endswith("-v"))
    model = copy.deepcopy(a["model"])
    record = prune_model(model, cut, got)
    adapter = get_adapter(model)
    assert {layout.value_dim for layout in adapter.layouts()} == {got["d_v_new"]}
    assert adapter.state_bytes() == pytest.approx(0.25 * get_adapter(a["model"]).state_bytes())
    assert record.values["d_v_new"] == got["d_v_new"]


def test_artifacts_without_values_are_refused_in_one_line(artifacts, tmp_path):
    import h5py

    a = artifacts
    old = tmp_path / "a_old.h5"
    with h5py.File(a["activations"], "r") as src, h5py.File(old, "w") as dst:
        for name, value in src.attrs.items():
            dst.attrs[name] = value
        for group in src:
            g = dst.create_group(group)
            g.attrs["layer"] = src[group].attrs["layer"]
            for ds in ("K", "Q", "xnorm"):
                g.create_dataset(ds, data=src[group][ds][()])
    with pytest.raises(ArtifactError, match=r"a_old.h5 has no dataset layer_000/V") as err:
        select_channels(a["weights"], "drrqr-v", 50, activations=old, expect={"model": "t"})
    assert "\n" not in str(err.value)
    rows, meta = select_channels(a["weights"], "drrqr", 50, activations=old, expect={"model": "t"})  # keys still read
    assert meta["d_k_new"] == meta["d_k"] // 2


def test_the_api_refuses_a_value_cut_in_one_line():
    from statereduce import api

    with pytest.raises(ValueError, match=r"selector 'drrqr-v' cuts values: api.select cuts key channels") as err:
        api.select(tiny_model("delta_net"), None, "drrqr-v", 50)
    assert "\n" not in str(err.value)


def test_value_cuts_plan_their_cells_and_rank_and_refuse_speed_in_one_line(tmp_path):
    """``drrqr-kv_75`` plans selection, pruning, RFT and summary, and a value cut its rank analysis; its speed is
    refused at planning with the reason (rule speed times key cuts; the decode benchmark's --head-shape times value
    cuts)."""
    from _snakemake import dry_run_outputs, snakemake

    jobs = dry_run_outputs(tmp_path / "ok", "results/tiny-gdn/drrqr-kv_75/eval.json")
    assert jobs["select_channels"] == ["results/tiny-gdn/select/drrqr-kv_75.parquet"]
    assert {"prune", "rft", "summarize"} <= set(jobs)
    jobs = dry_run_outputs(tmp_path / "rank", "results/tiny-gdn/drrqr-v_50/rank.json")
    assert jobs["rank"] == ["results/tiny-gdn/drrqr-v_50/rank.json"]
    out = snakemake(tmp_path / "speed", "-n", "results/tiny-gdn/drrqr-v_50/speed.json")
    assert out.returncode != 0 and "rule speed times key cuts" in out.stdout + out.stderr
