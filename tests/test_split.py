"""The split of a joint cut chosen by calibration loss (``<selector>-kv@<budget>``, policy ``split``): the grammar and
config checks, the candidate pairs (statereduce.core.cuts.state_split_candidates), the split stage against an independent
reference (each candidate's masked loss equals the loss of the checkpoint pruned to it with ``norm_eps: exact``; the
chosen pair is the lowest), the selection it drives, the artifact's checks, and the workflow's plan, on tiny random
CPU models."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from _models import tiny_inputs, tiny_model
from statereduce.common.settings import BudgetPlan, BudgetSettings
from statereduce.core.artifacts import ArtifactError
from statereduce.core.budgets import candidate_widths
from statereduce.core.calib_loss import calibration_loss
from statereduce.core.cuts import STATE_TOLERANCE, joint_widths, read_state_split, state_split_candidates
from statereduce.selectors import format_method, n_keep_for, parse_method
from statereduce.stages.capture import capture_activations, export_qk_weights, grad_scores
from statereduce.stages.prune import prune_model
from statereduce.stages.select import choose_state_split, read_selection, select_channels, write_selection


# ---- grammar, candidates, config ------------------------------------------------------------------------------------
def test_a_joint_cut_takes_a_budget_and_a_value_cut_does_not():
    spec = parse_method("drrqr-kv@split")
    assert (spec.cut, spec.budget) == ("joint", "split") and format_method(spec) == "drrqr-kv@split"
    assert format_method(spec.keys) == "drrqr"  # the key side of a joint cut has no split budget
    assert format_method(parse_method("drrqr@sens").keys) == "drrqr@sens"
    with pytest.raises(ValueError, match=r"a value cut takes no budget \(@sens") as err:
        parse_method("drrqr-v@sens")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("d_k, d_v", [(32, 32), (32, 64), (64, 64), (128, 128), (256, 512), (32, 16)])
@pytest.mark.parametrize("pct", [50, 75])
def test_split_candidates_run_from_key_only_to_value_only_at_the_pcts_state(d_k, d_v, pct):
    got = state_split_candidates(d_k, d_v, pct, candidate_widths(d_k, 8, 8))
    target = (1 - pct / 100) * d_k * d_v
    assert got == sorted(set(got))
    assert got[0] == (n_keep_for(d_k, pct), d_v) and got[-1] == (d_k, n_keep_for(d_v, pct))
    assert joint_widths(d_k, d_v, pct) in got
    for k, v in got:
        assert 1 <= k <= d_k and 1 <= v <= d_v
        assert abs(k * v - target) <= STATE_TOLERANCE * d_k * d_v
    # every allowed key width between the two ends has a candidate
    inner = [w for w in candidate_widths(d_k, 8, 8) if n_keep_for(d_k, pct) < w < d_k]
    assert {k for k, _ in got} >= {w for w in inner if abs(w * round(target / w) - target) <= STATE_TOLERANCE * d_k * d_v}


@pytest.mark.parametrize("d_k, d_v", [(64, 64), (32, 64), (256, 256)])
@pytest.mark.parametrize("pct", [0.5, 0.78, 1, 1.6])
def test_a_joint_cut_removes_a_channel_or_is_refused(d_k, d_v, pct):
    """A joint pct removes a channel when it rounds one channel of the larger side to one (round(max(d_k, d_v) *
    pct / 100) >= 1); then the equal split and every split candidate cut the state, and a side that the pct cuts to
    nothing is no candidate. Otherwise (a fraction written for a percent) both refuse in one line."""
    if round(max(d_k, d_v) * pct / 100) == 0:
        for call in (lambda: joint_widths(d_k, d_v, pct), lambda: state_split_candidates(d_k, d_v, pct, [8, 16])):
            with pytest.raises(ValueError) as err:
                call()
            assert str(err.value) == (
                f"pct {pct:g} removes no channel of the d_k x d_v = {d_k} x {d_v} state (round({max(d_k, d_v)}*"
                f"{pct:g}/100) = 0); pcts of a joint cut are percent of the state removed, e.g. drrqr-kv_50 "
                "removes half")
        return
    assert joint_widths(d_k, d_v, pct) != (d_k, d_v)
    got = state_split_candidates(d_k, d_v, pct, candidate_widths(d_k, 8, 8))
    assert got and (d_k, d_v) not in got  # the key-only cut of a pct that cuts no key is the whole state: left out


def test_split_candidates_skip_pairs_the_family_refuses():
    def check(k, v):
        if v % 16:
            raise ValueError(f"d_v'={v} is not a multiple of 16")

    got = state_split_candidates(64, 64, 50, candidate_widths(64, 8, 8), check)
    assert got and all(v % 16 == 0 for _, v in got)
    with pytest.raises(ValueError, match=r"no key and value widths of d_k=64, d_v=64 remove 50% of the state"):
        state_split_candidates(64, 64, 50, [], lambda k, v: (_ for _ in ()).throw(ValueError("no")))


def test_the_config_pairs_split_budgets_with_joint_cuts_in_one_line():
    from statereduce.config import ConfigError, check_method

    cfg = {"budgets": {"split": {"policy": "split"}, "sens": {"policy": "sensitivity"}}, "calibrations": {}}
    check_method(cfg, "drrqr-kv@split")
    for token, message in (("drrqr-kv@sens", r"budgets.sens has policy 'sensitivity'.*takes a budget of policy 'split'"),
                           ("drrqr@split", r"budgets.split has policy 'split'.*use it as <selector>-kv@split")):
        with pytest.raises(ConfigError, match=message) as err:
            check_method(cfg, token)
        assert "\n" not in str(err.value)


# ---- the split stage ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["gated_deltanet", "mamba2"])
def artifacts(request, tmp_path_factory):
    family = request.param
    out = tmp_path_factory.mktemp(f"split_{family}")
    model = tiny_model(family, **({"norm_eps": 1e-2} if family == "gated_deltanet" else {}))
    inputs = tiny_inputs(batch=4, length=32)
    attrs = {"model": "t", "calibration": "default"}
    return {"family": family, "model": model, "dir": out, "blocks": tiny_inputs(batch=3, length=24),
            "weights": export_qk_weights(model, out / "qk.h5", attrs={"model": "t"}),
            "activations": capture_activations(model, inputs, out / "a.h5", rows_per_head=40, attrs=attrs),
            "grads": grad_scores(model, inputs, out / "g.h5", attrs=attrs)}


def _split(a, method="drrqr-kv@split", pct=75, **settings):
    plan = BudgetPlan(name="split", settings=BudgetSettings(policy="split", floor=4, multiple=4, **settings))
    return choose_state_split(a["weights"], method, pct, plan, activations=a["activations"], grads=a["grads"],
                        expect={"model": "t"}, model=a["model"], blocks=a["blocks"], progress=False)


def _pruned_loss(a, method, pct, widths):
    """The calibration loss of the checkpoint pruned to the joint selection at ``widths`` (norm_eps exact): the
    reference the split stage's masked loss must equal."""

    rows, meta = select_channels(a["weights"], method, pct, activations=a["activations"], grads=a["grads"],
                            expect={"model": "t"}, widths=widths)
    path = write_selection(a["dir"] / f"ref_{widths[0]}x{widths[1]}.parquet", rows, meta)
    cut, got = read_selection(path, expect={"model": "t"})
    model = copy.deepcopy(a["model"])
    prune_model(model, cut, got, norm_eps="exact")
    return calibration_loss(model, a["blocks"], a["blocks"].shape[0])


@pytest.mark.parametrize("selector", ["drrqr", "grad"])
def test_the_split_is_the_candidate_of_lowest_loss_and_each_loss_is_the_pruned_checkpoints(artifacts, selector):
    a = artifacts
    before = {k: v.clone() for k, v in a["model"].state_dict().items()}
    doc = _split(a, f"{selector}-kv@split")
    assert all(torch.equal(before[k], v) for k, v in a["model"].state_dict().items())  # masks are undone
    pairs = [(c["d_k_new"], c["d_v_new"]) for c in doc["candidates"]]
    assert pairs == state_split_candidates(doc["d_k"], doc["d_v"], 75, candidate_widths(doc["d_k"], 4, 4))
    best = min(doc["candidates"], key=lambda c: c["loss"])
    assert (doc["d_k_new"], doc["d_v_new"]) == (best["d_k_new"], best["d_v_new"])
    assert doc["base_loss"] == pytest.approx(calibration_loss(a["model"], a["blocks"], 3), rel=1e-6)
    assert doc["equal"] == list(joint_widths(doc["d_k"], doc["d_v"], 75))
    # the ends and the chosen pair against the pruned checkpoints: key-only, value-only, chosen
    for c in {0: doc["candidates"][0], -1: doc["candidates"][-1], "best": best}.values():
        ref = _pruned_loss(a, f"{selector}-kv", 75, (c["d_k_new"], c["d_v_new"]))
        assert c["loss"] == pytest.approx(ref, rel=1e-5)


def _half_values_model(tmp_path, layers: set[int] | None) -> dict:
    """A Gated DeltaNet whose value channels 32..63 are zero (v_proj rows) in ``layers`` (None: every layer), made
    confident (its output head scaled), with its own greedy continuations as calibration blocks and its artifacts."""
    from statereduce.adapters import get_adapter

    model = tiny_model("gated_deltanet")
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
        for layer, mixer in get_adapter(model).mixer_layers():
            if layers is None or layer in layers:
                mixer.v_proj.weight.view(-1, 64, mixer.v_proj.weight.shape[-1])[:, 32:] = 0  # [HV, d_v, hidden]
        ids = tiny_inputs(batch=3, length=4)
        for _ in range(20):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
    inputs = tiny_inputs(batch=4, length=32)
    attrs = {"model": "t", "calibration": "default"}
    return {"model": model, "blocks": ids, "dir": tmp_path,
            "weights": export_qk_weights(model, tmp_path / "qk.h5", attrs={"model": "t"}),
            "activations": capture_activations(model, inputs, tmp_path / "a.h5", rows_per_head=40, attrs=attrs),
            "grads": grad_scores(model, inputs, tmp_path / "g.h5", attrs=attrs)}


def test_a_model_whose_values_use_half_their_width_gets_the_value_only_cut(tmp_path):
    """Planted: every Gated DeltaNet head's value channels 32..63 are zero (v_proj rows), the model is confident (its
    output head scaled) and the calibration blocks are its own greedy continuations. At half the state the value-only
    cut loses nothing (its loss equals the unpruned model's), every cut that removes key channels loses, so the split
    is the value-only end; the equal split is not chosen."""
    a = _half_values_model(tmp_path, layers=None)
    doc = _split(a, "drrqr-kv@split", pct=50)
    by_pair = {(c["d_k_new"], c["d_v_new"]): c["loss"] for c in doc["candidates"]}
    assert (doc["d_k_new"], doc["d_v_new"]) == (32, 32) != tuple(doc["equal"])
    assert by_pair[32, 32] == pytest.approx(doc["base_loss"], rel=1e-6)
    assert min(loss for pair, loss in by_pair.items() if pair != (32, 32)) > doc["base_loss"] + 1e-3


def test_the_selection_of_a_split_token_keeps_the_chosen_widths(artifacts, tmp_path):
    a = artifacts
    doc = _split(a)
    path = tmp_path / "drrqr-kv@split_75.split.json"
    path.write_text(json.dumps(doc))
    rows, meta = select_channels(a["weights"], "drrqr-kv@split", 75, activations=a["activations"], grads=a["grads"],
                                 expect={"model": "t"}, allocation=path)
    assert (meta["d_k_new"], meta["d_v_new"]) == (doc["d_k_new"], doc["d_v_new"])
    assert meta["method"] == "drrqr-kv@split" and meta["budget"] == "split" and meta["split"]["policy"] == "split"

    direct, _ = select_channels(a["weights"], "drrqr-kv", 75, activations=a["activations"], grads=a["grads"],
                           expect={"model": "t"}, widths=(doc["d_k_new"], doc["d_v_new"]))
    assert [(r[0], r[1], r[3], list(r[2].keep)) for r in rows] == [(r[0], r[1], r[3], list(r[2].keep)) for r in direct]
    sel = write_selection(tmp_path / "drrqr-kv@split_75.parquet", rows, meta)
    cut, got = read_selection(sel, expect={"model": "t", "method": "drrqr-kv@split", "pct": 75})
    model = copy.deepcopy(a["model"])
    prune_model(model, cut, got, norm_eps="exact")
    assert calibration_loss(model, a["blocks"], 3) == pytest.approx(
        min(c["loss"] for c in doc["candidates"]), rel=1e-5)


def test_split_artifacts_are_checked_in_one_line(artifacts, tmp_path):
    a = artifacts
    doc = _split(a)
    worse = max(doc["candidates"], key=lambda c: c["loss"])
    for name, change, message in (
        ("tampered", {"d_k_new": worse["d_k_new"], "d_v_new": worse["d_v_new"]}, r"are not its lowest-loss candidate"),
        ("other_pct", {"pct": 50}, r"pct"),
        ("other_dk", {"d_k": doc["d_k"] * 2}, r"was chosen for d_k="),
    ):
        path = tmp_path / f"{name}.split.json"
        path.write_text(json.dumps({**doc, **change}))
        with pytest.raises(ArtifactError, match=message) as err:
            read_state_split(path, {"model": "t", "method": "drrqr-kv@split", "pct": 75, "d_k": doc["d_k"],
                              "d_v": doc["d_v"]})
        assert "\n" not in str(err.value) and "rule split rebuilds it" in str(err.value)
    with pytest.raises(ValueError, match=r"give either the split artifact \(rule split\) or the widths"):
        select_channels(a["weights"], "drrqr-kv@split", 75, activations=a["activations"], grads=a["grads"],
                        expect={"model": "t"})
    with pytest.raises(ValueError, match=r"a split is chosen for a joint cut with a budget"):
        _split(a, method="drrqr-kv")


def test_split_cells_plan_a_split_job_before_their_selection(tmp_path):
    """``drrqr-kv@split_75`` plans rule split (reading the base model, the calibration artifacts and the selector's
    code), then selection, pruning, RFT and summary; a split budget on a key cut is refused before any job."""
    from _snakemake import dry_run_outputs, snakemake

    jobs = dry_run_outputs(tmp_path / "ok", "results/tiny-gdn/drrqr-kv@split_75/eval.json")
    assert jobs["split"] == ["results/tiny-gdn/select/drrqr-kv@split_75.split.json"]
    assert jobs["select_channels"] == ["results/tiny-gdn/select/drrqr-kv@split_75.parquet"]
    assert {"prune", "rft", "summarize", "calibrate"} <= set(jobs)
    out = snakemake(tmp_path / "bad", "-n", "results/tiny-gdn/drrqr@split_75/eval.json")
    assert out.returncode != 0 and "budgets.split has policy 'split'" in out.stdout + out.stderr


# ---- a split per layer (per_layer: true) ----------------------------------------------------------------------------
def _write(a, name: str, doc: dict):
    path = a["dir"] / f"{name}.split.json"
    path.write_text(json.dumps(doc))
    return path


def _per_layer_pruned_loss(a, method, pct, widths: dict):
    """The calibration loss of the checkpoint pruned to the joint selection with a d_k' x d_v' per layer (norm_eps
    exact), through the selection file: the reference of the per-layer losses."""

    rows, meta = select_channels(a["weights"], method, pct, activations=a["activations"], grads=a["grads"],
                            expect={"model": "t"}, widths=widths)
    name = "_".join(f"{k}x{v}" for k, v in widths.values())
    cut, got = read_selection(write_selection(a["dir"] / f"ref_layers_{name}.parquet", rows, meta),
                              expect={"model": "t"})
    model = copy.deepcopy(a["model"])
    prune_model(model, cut, got, norm_eps="exact")
    return calibration_loss(model, a["blocks"], a["blocks"].shape[0])


def test_a_split_per_layer_takes_each_layers_lowest_candidate_and_its_losses_are_the_pruned_checkpoints(artifacts):
    a = artifacts
    doc = _split(a, "grad-kv@split", per_layer=True)
    per = doc["per_layer"]
    pairs = [(c["d_k_new"], c["d_v_new"]) for c in doc["candidates"]]
    layers = [str(layer) for layer in doc["layers"]]
    assert sorted(per["widths"]) == sorted(per["layer_losses"]) == sorted(layers)
    chosen = {}
    for layer, losses in per["layer_losses"].items():
        assert sorted(losses) == sorted(f"{k}x{v}" for k, v in pairs)
        low = min(losses.values())
        chosen[layer] = next(tuple(map(int, p.split("x"))) for p in losses if losses[p] == low)
    uniform = min(c["loss"] for c in doc["candidates"])
    assert per["combination_loss"] > 0 and per["loss"] <= uniform
    if per["combination_loss"] < uniform:
        assert {layer: tuple(w) for layer, w in per["widths"].items()} == chosen and per["loss"] == per["combination_loss"]
    else:
        assert all(tuple(w) == (doc["d_k_new"], doc["d_v_new"]) for w in per["widths"].values())
    # one layer's candidate with the others whole, and the choice, against checkpoints pruned to those widths (the
    # others keep every channel: d_k x d_v)
    first, last = layers[0], pairs[-1]
    one = {int(layer): (last if layer == first else (doc["d_k"], doc["d_v"])) for layer in layers}
    assert per["layer_losses"][first][f"{last[0]}x{last[1]}"] == pytest.approx(
        _per_layer_pruned_loss(a, "grad-kv", 75, one), rel=1e-5)
    widths = {int(layer): tuple(w) for layer, w in per["widths"].items()}
    if len(set(widths.values())) > 1:
        assert per["loss"] == pytest.approx(_per_layer_pruned_loss(a, "grad-kv", 75, widths), rel=1e-5)


def test_a_layer_whose_values_use_half_their_width_gets_the_value_only_cut_alone(tmp_path):
    """Planted: only layer 0's value channels 32..63 are zero (as in the uniform test above); at half the state the
    split per layer gives layer 0 the value-only cut (its loss, with the other layers whole, is the unpruned model's;
    every other candidate of layer 0 loses) and beats the best uniform split."""
    a = _half_values_model(tmp_path, layers={0})
    doc = _split(a, "drrqr-kv@split", pct=50, per_layer=True)
    per = doc["per_layer"]
    assert per["widths"]["0"] == [32, 32]
    losses = per["layer_losses"]["0"]
    assert losses["32x32"] == pytest.approx(doc["base_loss"], rel=1e-6)
    assert min(x for p, x in losses.items() if p != "32x32") > doc["base_loss"] + 1e-3
    assert per["loss"] == per["combination_loss"] < min(c["loss"] for c in doc["candidates"])


def test_the_selection_of_a_per_layer_split_keeps_each_layers_widths(artifacts, tmp_path):
    """The selection reads the per-layer widths; its file names them per layer and round-trips; the checkpoint
    pruned from it (a width per layer: statereduce_key_dims and _value_dims) has the split's loss."""
    a = artifacts
    doc = _split(a, per_layer=True)
    widths = {"0": [doc["d_k_new"], doc["d_v_new"]]} | {
        str(layer): pair for layer, pair in zip(doc["layers"][1:], [[c["d_k_new"], c["d_v_new"]]
                                                                      for c in doc["candidates"]][::-1])}
    forced = {**doc, "per_layer": {**doc["per_layer"], "widths": widths, "loss": min(c["loss"] for c in
                                                                                     doc["candidates"])}}
    path = _write(a, "drrqr-kv@split_75", forced)
    rows, meta = select_channels(a["weights"], "drrqr-kv@split", 75, activations=a["activations"], grads=a["grads"],
                                 expect={"model": "t"}, allocation=path)
    want = {layer: tuple(w) for layer, w in widths.items()}
    assert meta["d_k_new"] == {layer: k for layer, (k, _) in want.items()}
    assert meta["d_v_new"] == {layer: v for layer, (_, v) in want.items()}
    assert meta["state_fraction"] == pytest.approx(sum(k * v for k, v in want.values())
                                                   / (len(want) * doc["d_k"] * doc["d_v"]))
    sel = write_selection(tmp_path / "drrqr-kv@split_75.parquet", rows, meta)
    cut, got = read_selection(sel, expect={"model": "t", "method": "drrqr-kv@split", "pct": 75})
    assert {str(layer): len(v[0]) if np.ndim(v) == 2 else len(v) for layer, v in cut.values.items()} == \
        {layer: v for layer, (_, v) in want.items()}
    model = copy.deepcopy(a["model"])
    prune_model(model, cut, got, norm_eps="exact")
    assert calibration_loss(model, a["blocks"], 3) == pytest.approx(
        _per_layer_pruned_loss(a, "drrqr-kv", 75, {int(layer): w for layer, w in want.items()}), rel=1e-6)


def test_per_layer_split_artifacts_and_settings_are_checked_in_one_line(artifacts):
    a = artifacts
    doc = _split(a, per_layer=True)
    per = doc["per_layer"]
    layer = next(iter(per["widths"]))
    for name, change, message in (
        ("not_a_candidate", {"widths": {**per["widths"], layer: [3, 5]}}, r"per-layer widths \(" + layer + ": "),
        ("worse", {"loss": max(c["loss"] for c in doc["candidates"]) + 1}, r"at or below the uniform split's loss"),
        ("layers", {"widths": {layer: per["widths"][layer]}}, r"per-layer widths \(layers \["),
    ):
        path = _write(a, name, {**doc, "per_layer": {**per, **change}})
        with pytest.raises(ArtifactError, match=message) as err:
            read_state_split(path, {"model": "t", "method": "drrqr-kv@split", "pct": 75})
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"budget per_layer=true .* takes policy 'split', not 'sensitivity'"):
        BudgetSettings(policy="sensitivity", per_layer=True)
    with pytest.raises(ValueError, match=r"budget per_layer='yes' must be true or false"):
        BudgetSettings(policy="split", per_layer="yes")
