"""The joint budget of a joint cut (``<selector>-kv@<budget>``, policy ``joint``): each layer's share of the state and
its key/value split chosen together from the measured calibration loss. The knapsack against brute force, the pairs
and bounds, the split stage on tiny random CPU models (the total state within 1% of the pct's; every measured loss
against a checkpoint pruned to it; a planted layer whose cut costs nothing gets the least state), the artifact read
back and the selection it drives, the config's one-line errors and the workflow's plan."""

from __future__ import annotations

import copy
import itertools
import json
import random

import pytest
import torch

from _models import tiny_inputs, tiny_model
from statereduce.common.settings import BudgetPlan, BudgetSettings
from statereduce.core.artifacts import ArtifactError
from statereduce.core.budgets import (
    JOINT_TOLERANCE, check_joint_budget, joint_allocate, joint_bounds, joint_pairs, joint_usable,
)
from statereduce.core.calib_loss import calibration_loss
from statereduce.core.cuts import Cut, read_state_split, state_split_candidates
from statereduce.stages.capture import capture_activations, export_qk_weights, grad_scores
from statereduce.stages.prune import prune_model
from statereduce.stages.select import choose_state_split, read_selection, select_channels, write_selection

SETTINGS = BudgetSettings(policy="joint", floor=8, multiple=8)


# ---- the knapsack, the pairs, the bounds ----------------------------------------------------------------------------
def _brute(increases, lo, hi):
    best = None
    for combo in itertools.product(*[sorted(layer) for layer in increases]):
        if lo <= sum(k * v for k, v in combo) <= hi:
            cost = sum(layer[p] for layer, p in zip(increases, combo))
            best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_the_knapsack_finds_the_least_summed_increase_within_the_bounds(seed):
    rng = random.Random(seed)
    d_k, d_v, n_layers, pct = 32, 16, 3, rng.choice([50, 75])
    pairs = joint_pairs(d_k, d_v, SETTINGS, extra=[(24, 5)])
    target, lo, hi = joint_bounds(d_k, d_v, pct, n_layers)
    assert lo <= target <= hi and hi - lo <= 2 * JOINT_TOLERANCE * target + 1
    increases = [{p: rng.uniform(-0.01, 1) / (p[0] * p[1]) ** 0.5 for p in pairs} for _ in range(n_layers)]
    got = joint_allocate(increases, lo, hi, target=target, d_k=d_k, d_v=d_v)
    assert lo <= sum(k * v for k, v in got) <= hi
    assert sum(layer[p] for layer, p in zip(increases, got)) == pytest.approx(_brute(increases, lo, hi), abs=1e-12)
    # the usable pairs are those of some choice within the bounds
    usable = joint_usable(pairs, n_layers, lo, hi)
    on_some = {p for combo in itertools.product(pairs, repeat=n_layers) if lo <= sum(k * v for k, v in combo) <= hi
               for p in combo}
    assert set(usable) == on_some


def test_joint_pairs_cross_the_allowed_widths_with_the_whole_layer_and_the_uniform_candidates():
    pairs = joint_pairs(64, 32, SETTINGS, extra=state_split_candidates(64, 32, 75, [8, 16, 24, 32, 40, 48, 56, 64]))
    assert {(k, v) for k in range(8, 65, 8) for v in range(8, 33, 8)} <= set(pairs)
    assert (64, 32) in pairs and (24, 21) in pairs and pairs == sorted(set(pairs))
    assert set(joint_pairs(64, 32, BudgetSettings(policy="joint", powers_of_two=True))) == {
        (k, v) for k in (8, 16, 32, 64) for v in (8, 16, 32)}
    refused = joint_pairs(64, 32, SETTINGS, lambda k, v: (_ for _ in ()).throw(ValueError("no")) if v == 8 else None)
    assert all(v != 8 for _, v in refused) and (64, 32) in refused


def test_an_unreachable_total_is_refused_in_one_line():
    with pytest.raises(ValueError) as err:
        check_joint_budget(64, 64, 75, 4, BudgetSettings(policy="joint", floor=64, multiple=64))
    assert str(err.value) == ("pct 75: 4 layers of d_k x d_v = 64 x 64 keep 4096 in all per head (1024 a layer) "
                              "within 1%; no choice of one (d_k', d_v') per layer keeps a total state in [4056, 4136] "
                              "(the layers' pairs keep totals in [16384, 16384], multiples of 4096)")
    assert "\n" not in str(err.value)
    assert check_joint_budget(64, 64, 75, 4, SETTINGS)


# ---- the split stage on tiny random models --------------------------------------------------------------------------
def _artifacts(model, out, family):
    inputs = tiny_inputs(batch=4, length=32)
    attrs = {"model": "t", "calibration": "default"}
    return {"family": family, "model": model, "dir": out, "blocks": tiny_inputs(batch=3, length=24),
            "weights": export_qk_weights(model, out / "qk.h5", attrs={"model": "t"}),
            "activations": capture_activations(model, inputs, out / "a.h5", rows_per_head=40, attrs=attrs),
            "grads": grad_scores(model, inputs, out / "g.h5", attrs=attrs)}


@pytest.fixture(scope="module", params=["gated_deltanet", "mamba2"])
def artifacts(request, tmp_path_factory):
    family = request.param
    model = tiny_model(family, num_hidden_layers=3, **({"norm_eps": 1e-2} if family == "gated_deltanet" else {}))
    return _artifacts(model, tmp_path_factory.mktemp(f"joint_{family}"), family)


def _joint(a, method="drrqr-kv@joint", pct=75, settings=SETTINGS):
    plan = BudgetPlan(name="joint", settings=settings)
    return choose_state_split(a["weights"], method, pct, plan, activations=a["activations"], grads=a["grads"],
                              expect={"model": "t"}, model=a["model"], blocks=a["blocks"], progress=False)


def _pruned_loss(a, method, pct, widths: dict):
    """The calibration loss of the checkpoint pruned (norm_eps exact) to the joint selection with {layer: (d_k',
    d_v')}, through the selection file."""
    rows, meta = select_channels(a["weights"], method, pct, activations=a["activations"], grads=a["grads"],
                                 expect={"model": "t"}, widths=widths)
    name = "_".join(f"{k}x{v}" for k, v in widths.values())
    cut, got = read_selection(write_selection(a["dir"] / f"ref_{name}.parquet", rows, meta), expect={"model": "t"})
    model = copy.deepcopy(a["model"])
    prune_model(model, cut, got, norm_eps="exact")
    return calibration_loss(model, a["blocks"], a["blocks"].shape[0])


@pytest.mark.parametrize("selector", ["drrqr", "grad"])
def test_a_joint_budget_keeps_the_pcts_total_state_and_its_losses_are_the_pruned_checkpoints(artifacts, selector):
    a = artifacts
    before = {k: v.clone() for k, v in a["model"].state_dict().items()}
    doc = _joint(a, f"{selector}-kv@joint")
    assert all(torch.equal(before[k], v) for k, v in a["model"].state_dict().items())  # masks are undone
    per, d_k, d_v, layers = doc["per_layer"], doc["d_k"], doc["d_v"], doc["layers"]
    assert per["policy"] == "joint" and doc["settings"]["policy"] == "joint"
    target = len(layers) * 0.25 * d_k * d_v
    assert per["target_total"] == target and per["bounds"] == list(joint_bounds(d_k, d_v, 75, len(layers))[1:])
    combo = {int(layer): tuple(w) for layer, w in per["combination"].items()}
    total = sum(k * v for k, v in combo.values())
    assert abs(total - target) <= JOINT_TOLERANCE * target  # the knapsack's choice: within 1% of the pct's state
    assert per["state_total"] == sum(k * v for k, v in per["widths"].values())
    assert per["ratio"] == pytest.approx(per["state_total"] / target)
    # every layer measured every usable pair, the whole layer at the unpruned loss
    pairs = [tuple(p) for p in per["pairs"]]
    assert pairs == joint_usable(joint_pairs(d_k, d_v, SETTINGS, None, [(c["d_k_new"], c["d_v_new"])
                                                                         for c in doc["candidates"]]), len(layers),
                                 *per["bounds"])
    for layer in layers:
        losses = per["layer_losses"][str(layer)]
        assert set(losses) == {f"{k}x{v}" for k, v in pairs} | {f"{d_k}x{d_v}"}
        assert losses[f"{d_k}x{d_v}"] == doc["base_loss"]
    assert per["predicted_increase"] == pytest.approx(
        sum(per["layer_losses"][str(layer)][f"{k}x{v}"] - doc["base_loss"] for layer, (k, v) in combo.items()))
    # the chosen widths: the combination where it beats the best uniform split, else that split everywhere
    uniform = min(c["loss"] for c in doc["candidates"])
    if per["combination_loss"] < uniform:
        assert per["kept"] == "joint" and per["loss"] == per["combination_loss"]
        assert {int(layer): tuple(w) for layer, w in per["widths"].items()} == combo
    else:
        assert per["kept"] == "uniform" and per["loss"] == uniform
        assert all(tuple(w) == (doc["d_k_new"], doc["d_v_new"]) for w in per["widths"].values())
    # a single-layer loss and the combination's against checkpoints pruned to those widths
    first, small = layers[0], pairs[0]
    one = {layer: (small if layer == first else (d_k, d_v)) for layer in layers}
    assert per["layer_losses"][str(first)][f"{small[0]}x{small[1]}"] == pytest.approx(
        _pruned_loss(a, f"{selector}-kv", 75, one), rel=1e-5)
    assert per["combination_loss"] == pytest.approx(_pruned_loss(a, f"{selector}-kv", 75, combo), rel=1e-5)


def test_the_artifact_reloads_and_the_selection_keeps_each_layers_pair(artifacts, tmp_path):
    """The split artifact reads back (read_state_split), and the selection of the token keeps per layer the chosen
    pair (``d_k_new``/``d_v_new`` per layer, the rows' widths); the checkpoint pruned from it has the chosen loss. The
    knapsack's combination, forced into the artifact where the uniform split was kept, reads back the same way."""
    a = artifacts
    doc = _joint(a)
    per = doc["per_layer"]
    if per["kept"] == "uniform":  # take the combination through the same path
        per = {**per, "widths": per["combination"], "kept": "joint",
               "loss": min(c["loss"] for c in doc["candidates"])}
        doc = {**doc, "per_layer": per}
    path = tmp_path / "drrqr-kv@joint_75.split.json"
    path.write_text(json.dumps(doc))
    assert read_state_split(path, {"model": "t", "method": "drrqr-kv@joint", "pct": 75, "d_k": doc["d_k"],
                                   "d_v": doc["d_v"]})["per_layer"]["widths"] == per["widths"]
    rows, meta = select_channels(a["weights"], "drrqr-kv@joint", 75, activations=a["activations"], grads=a["grads"],
                                 expect={"model": "t"}, allocation=path)
    want = {int(layer): tuple(w) for layer, w in per["widths"].items()}
    uniform_keys = len({k for k, _ in want.values()}) == 1
    uniform_values = len({v for _, v in want.values()}) == 1
    assert meta["d_k_new"] == (next(iter(want.values()))[0] if uniform_keys else
                               {str(layer): k for layer, (k, _) in want.items()})
    assert meta["d_v_new"] == (next(iter(want.values()))[1] if uniform_values else
                               {str(layer): v for layer, (_, v) in want.items()})
    assert meta["budget"] == "joint" and meta["split"]["policy"] == "joint"
    for layer, (k, v) in want.items():
        assert {len(r[2].keep) for r in rows if r[0] == layer and r[3] == "k"} == {k}
        assert {len(r[2].keep) for r in rows if r[0] == layer and r[3] == "v"} == {v}
    sel = write_selection(tmp_path / "drrqr-kv@joint_75.parquet", rows, meta)
    cut, got = read_selection(sel, expect={"model": "t", "method": "drrqr-kv@joint", "pct": 75})
    assert Cut.from_meta(got, list(want)).pairs == want
    model = copy.deepcopy(a["model"])
    prune_model(model, cut, got, norm_eps="exact")
    assert calibration_loss(model, a["blocks"], 3) == pytest.approx(per["combination_loss"], rel=1e-5)


def test_joint_artifacts_are_checked_in_one_line(artifacts, tmp_path):
    a = artifacts
    doc = _joint(a)
    per = {**doc["per_layer"], "kept": "joint"}
    layer = next(iter(per["widths"]))
    d_k, d_v = doc["d_k"], doc["d_v"]
    big = {str(x): [d_k, d_v] for x in doc["layers"]}  # measured pairs (the whole layer), far above the total
    for name, change, message in (
        ("unmeasured", {"widths": {**per["widths"], layer: [3, 5]}}, r"per-layer widths \(" + layer + ": "),
        ("over", {"widths": big}, r"keep a total state of \d+, outside its bounds"),
        ("worse", {"loss": max(c["loss"] for c in doc["candidates"]) + 1}, r"at or below the uniform split's loss"),
    ):
        path = tmp_path / f"{name}.split.json"
        path.write_text(json.dumps({**doc, "per_layer": {**per, **change}}))
        with pytest.raises(ArtifactError, match=message) as err:
            read_state_split(path, {"model": "t", "method": "drrqr-kv@joint", "pct": 75})
        assert "\n" not in str(err.value) and "rule split rebuilds it" in str(err.value)


def test_a_layer_whose_cut_costs_nothing_gets_the_least_state(tmp_path):
    """Planted: layer 1 of a three-layer Gated DeltaNet writes nothing (its output projection is zero), so cutting it
    to any pair leaves the loss at the unpruned model's; the model is confident (its output head scaled) and the
    calibration blocks are its own greedy continuations, so that cutting the other layers costs. The joint budget
    gives it the smallest pair it has, the other layers the state it frees, and beats the best uniform split (which cuts every layer to a quarter of its state)."""
    from statereduce.adapters import get_adapter

    model = tiny_model("gated_deltanet", num_hidden_layers=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(40)  # confident, on its own greedy continuations: every other cut costs
        dict(get_adapter(model).mixer_layers())[1].o_proj.weight.zero_()
        ids = tiny_inputs(batch=3, length=4)
        for _ in range(20):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
    a = {**_artifacts(model, tmp_path, "gated_deltanet"), "blocks": ids}
    doc = _joint(a)
    per = doc["per_layer"]
    losses = per["layer_losses"]["1"]
    assert max(losses.values()) == min(losses.values()) == doc["base_loss"]
    states = {int(layer): k * v for layer, (k, v) in per["widths"].items()}
    assert per["kept"] == "joint" and per["loss"] < min(c["loss"] for c in doc["candidates"])
    assert states[1] == min(k * v for k, v in per["pairs"]) < min(states[0], states[2])
    assert abs(per["state_total"] - per["target_total"]) <= JOINT_TOLERANCE * per["target_total"]


# ---- config and workflow --------------------------------------------------------------------------------------------
def test_the_config_takes_joint_budgets_on_joint_cuts_only_in_one_line(shipped_config):
    from statereduce.config import ConfigError, check_budget_cell, check_method, model_budget_plan, validate_config

    cfg = {"budgets": {"joint": {"policy": "joint", "n_samples": 16}, "sens": {"policy": "sensitivity"}},
           "calibrations": {}}
    check_method(cfg, "drrqr-kv@joint")
    for token, message in (
        ("drrqr@joint", r"^method 'drrqr@joint': budgets.joint has policy 'joint', which chooses the split of a joint "
                        r"cut; use it as <selector>-kv@joint$"),
        ("grad-kv@sens", r"budgets.sens has policy 'sensitivity'.*takes a budget of policy 'split' or 'joint'$"),
        ("drrqr-v@joint", r"a value cut takes no budget"),
    ):
        with pytest.raises(ConfigError, match=message) as err:
            check_method(cfg, token)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"budget per_layer=true .* takes policy 'split', not 'joint'"):
        BudgetSettings(policy="joint", per_layer=True)
    shipped = validate_config(copy.deepcopy(shipped_config))
    assert shipped["budgets"]["joint"] == {"policy": "joint", "n_samples": 16}
    for model in ("tiny-dn", "tiny-gdn", "tiny-mamba2", "tiny-qwen35"):
        for method, pct in (("drrqr-kv@joint", 75.0), ("grad-kv@joint", 50.0)):
            check_budget_cell(shipped, model, method, pct)
            plan = model_budget_plan(shipped, model, method)
            assert plan.settings.policy == "joint" and plan.calibration is not None
    bad = {**shipped, "budgets": {**shipped["budgets"], "joint": {"policy": "joint", "floor": 65}}}
    with pytest.raises(ConfigError, match=r"^model 'tiny-gdn', method 'drrqr-kv@joint' \(budgets.joint\): budget "
                                          r"floor=65 exceeds d_k=64") as err:
        check_budget_cell(bad, "tiny-gdn", "drrqr-kv@joint", 75.0)
    assert "\n" not in str(err.value)


def test_joint_cells_plan_a_split_job_before_their_selection(tmp_path):
    """``drrqr-kv@joint_75`` plans rule split (the joint budget's artifact), then selection, pruning, RFT and summary;
    a joint budget on a key cut is refused before any job."""
    from _snakemake import dry_run_outputs, snakemake

    jobs = dry_run_outputs(tmp_path / "ok", "results/tiny-gdn/drrqr-kv@joint_75/eval.json",
                           "results/tiny-qwen35/grad-kv@joint_50/eval.json")
    assert sorted(jobs["split"]) == ["results/tiny-gdn/select/drrqr-kv@joint_75.split.json",
                                     "results/tiny-qwen35/select/grad-kv@joint_50.split.json"]
    assert "results/tiny-gdn/select/drrqr-kv@joint_75.parquet" in jobs["select_channels"]
    assert {"prune", "rft", "summarize", "calibrate"} <= set(jobs)
    out = snakemake(tmp_path / "bad", "-n", "results/tiny-gdn/drrqr@joint_75/eval.json")
    assert out.returncode != 0 and "budgets.joint has policy 'joint'" in out.stdout + out.stderr
