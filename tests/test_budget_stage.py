"""Per-layer key budgets through the stages (rule allocate, then select_channels and prune): a uniform budget gives
the plain method's checkpoint bit for bit; every policy meets the uniform cut's total with its floor and multiple;
the selection keeps each layer's width and pruning writes it; the spectrum policy finds a planted rank difference;
the sensitivity loss of a masked layer equals that of the model pruned in that layer alone; DRRQR's objective
equals an independent least-squares projection; bad budgets fail in one line before any job."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
import yaml
from _models import tiny_inputs, tiny_model
from _paths import ROOT

from statereduce.adapters import get_adapter
from statereduce.stages.allocate import allocation_document, calibration_loss, sensitivity_losses, spectrum_eigenvalues
from statereduce.core.budgets import allocate, read_allocation, spectrum_values
from statereduce.stages.capture import capture_activations, export_qk_weights, grad_scores
from statereduce.config import ConfigError, check_target, validate_config
from statereduce.core.h5files import layer_head_data
from statereduce.stages.prune import prune_model
from statereduce.core.runtime import write_json
from statereduce.stages.select import read_selection, select_channels, write_selection
from statereduce.selectors import METHOD_REGEX, HeadData, MethodSpec, format_method, get_selector, parse_method
from statereduce.common.settings import BudgetSettings
from statereduce.core.slicing import KEY_DIMS_FIELD, masked_channels

FAMILIES = ["delta_net", "gated_deltanet", "mamba2", "qwen3_5"]
CALIB = {"rows_per_head": 48, "seed": 0, "batch_size": 2}
NEEDS = {"spectrum": {"activations"}, "uniform": set()}


def artifacts(family, folder):
    """The tiny model of ``family`` with its qk.h5, activations.h5 and grad_scores.h5 in ``folder``."""
    model = tiny_model(family, **({"norm_eps": 1e-2} if family in ("delta_net", "gated_deltanet") else {}))
    blocks = tiny_inputs(batch=4, length=24)
    export_qk_weights(model, folder / "qk.h5")
    capture_activations(model, blocks, folder / "activations.h5", **CALIB)
    grad_scores(model, blocks, folder / "grad_scores.h5", batch_size=2)
    return model, blocks


def allocation_file(folder, model, method, pct, settings, blocks=None):
    """The allocation of ``method`` (``...@<budget>``) written as rule allocate writes it."""
    spec = parse_method(method)
    ad = get_adapter(model)
    needs = NEEDS.get(settings.policy, set(get_selector(spec.selector).needs))
    doc = allocation_document(
        method, pct, spec.budget, settings, d_k=ad.head_k_dim, num_heads=ad.num_heads,
        layers=[i for i, _ in ad.mixer_layers()],
        layer_data=lambda: layer_head_data(folder / "qk.h5", needs | {"weights"}, folder / "activations.h5",
                                           folder / "grad_scores.h5"),
        model=model, blocks=blocks, provenance={"family": ad.family})
    path = folder / f"{method}_{pct}.allocation.json"
    write_json(path, doc)
    return path, doc


def select(folder, method, pct, allocation=None):
    rows, meta = select_channels(folder / "qk.h5", method, pct, activations=folder / "activations.h5",
                                 grads=folder / "grad_scores.h5", allocation=allocation)
    return read_selection(write_selection(folder / f"{method}_{pct}.parquet", rows, meta))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_uniform_budget_gives_the_plain_checkpoint_bit_for_bit(family, tmp_path):
    model, _ = artifacts(family, tmp_path)
    path, doc = allocation_file(tmp_path, model, "drrqr@uniform", 75, BudgetSettings(policy="uniform"))
    assert set(doc["key_dims"].values()) == {doc["uniform_width"]} == {8}
    keep_b, meta_b = select(tmp_path, "drrqr@uniform", 75, path)
    keep_a, meta_a = select(tmp_path, "drrqr", 75)
    assert keep_a == keep_b and meta_b["d_k_new"] == meta_a["d_k_new"] == 8
    assert meta_b["allocation"]["policy"] == "uniform" and meta_b["budget"] == "uniform"
    plain, budget = copy.deepcopy(model), copy.deepcopy(model)
    prune_model(plain, keep_a, meta_a, norm_eps="exact")
    record = prune_model(budget, keep_b, meta_b, norm_eps="exact")
    assert plain.config.to_dict() == budget.config.to_dict()  # stock config: one head size, no per-layer field
    assert not hasattr(budget.config, KEY_DIMS_FIELD)
    a, b = plain.state_dict(), budget.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert record.extra["allocation"]["policy"] == "uniform"


POLICIES = [
    ("drrqr@energy", BudgetSettings(policy="spectrum", statistic="energy")),
    ("grad@erank", BudgetSettings(policy="spectrum", statistic="effective_rank")),
    ("drrqr@greedy", BudgetSettings(policy="greedy")),
    ("grad@greedy", BudgetSettings(policy="greedy")),
    ("l1@raw", BudgetSettings(policy="greedy", normalize=False)),
    ("grad@sens", BudgetSettings(policy="sensitivity", floor=4, multiple=4)),
]


@pytest.mark.parametrize("family", ["delta_net", "qwen3_5"])
@pytest.mark.parametrize("method,settings", POLICIES, ids=[m for m, _ in POLICIES])
def test_every_policy_meets_the_total_with_floor_and_multiple(family, method, settings, tmp_path):
    model, blocks = artifacts(family, tmp_path)
    d_k = get_adapter(model).head_k_dim
    path, doc = allocation_file(tmp_path, model, method, 50, settings, blocks=blocks)
    widths = list(doc["key_dims"].values())
    assert sum(widths) == doc["uniform_width"] * len(widths) == doc["allocation"]["total"]
    assert all(w >= settings.floor and (w % settings.multiple == 0 or w == d_k) for w in widths), widths
    assert read_allocation(path, {"method": method, "pct": 50})["key_dims"] == doc["key_dims"]
    keep, meta = select(tmp_path, method, 50, path)
    assert {str(layer): len(rows[0]) for layer, rows in keep.keys.items()} == doc["key_dims"]
    assert {str(layer): w for layer, w in keep.cut.key_widths.items()} == doc["key_dims"]
    pruned = copy.deepcopy(model)
    record = prune_model(pruned, keep, meta, norm_eps="exact")
    if len(set(widths)) > 1:
        key_dims = getattr(pruned.config, KEY_DIMS_FIELD)
        assert [key_dims[int(layer)] for layer in doc["key_dims"]] == widths
    assert record.extra["allocation"]["key_dims"] == doc["key_dims"]


def test_the_spectrum_policy_gives_a_high_rank_layer_more_channels():
    """Layer 0's keys and queries span all 32 directions evenly, layer 1's only 4: the energy policy keeps the
    fewest channels allowed in layer 1 and the rest in layer 0, at the uniform total."""
    rng = np.random.default_rng(0)
    full = rng.standard_normal((400, 32))
    low = rng.standard_normal((400, 4)) @ rng.standard_normal((4, 32))
    layers = [(0, [HeadData(K=full, Q=full)] * 2), (1, [HeadData(K=low, Q=low)] * 2)]
    eigs = spectrum_eigenvalues(layers, "kq")
    for mode in ("energy", "effective_rank"):
        assert allocate(spectrum_values([eigs[0], eigs[1]], [8, 16, 24, 32], mode=mode), 32) == [24, 8]


def test_masking_one_layer_equals_pruning_it_alone():
    """The sensitivity policy's loss of one layer cut (dropped channels zeroed in place) equals the calibration loss
    of the model pruned in that layer alone with norm_eps exact; the weights are restored after."""
    model = tiny_model("gated_deltanet", norm_eps=1e-2)
    blocks = tiny_inputs(batch=2, length=24)
    ad = get_adapter(model)
    h, d_k = ad.num_heads, ad.head_k_dim
    keep = torch.stack([torch.randperm(d_k, generator=torch.Generator().manual_seed(h_))[:8].sort().values
                        for h_ in range(h)])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    mixer = dict(ad.mixer_layers())[1]
    with torch.no_grad():
        full = model(blocks).logits
        with masked_channels(ad, mixer, keep):
            masked, masked_loss = model(blocks).logits, calibration_loss(model, blocks, 2)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    pruned = copy.deepcopy(model)
    prune_model(pruned, {0: torch.arange(d_k).expand(h, -1), 1: keep}, {"method": "test"}, norm_eps="exact")
    with torch.no_grad():
        ref = pruned(blocks).logits
    scale = float(ref.abs().max())
    assert float((masked - ref).abs().max()) < 1e-5 * scale < 1e-2 * float((full - ref).abs().max())
    assert masked_loss == pytest.approx(calibration_loss(pruned, blocks, 2), rel=1e-6)


def test_sensitivity_losses_rank_a_layer_that_matters():
    model = tiny_model("delta_net")
    blocks = tiny_inputs(batch=2, length=24)
    ad = get_adapter(model)
    rng = np.random.default_rng(0)
    heads = [HeadData(W_q=rng.standard_normal((32, 64)), W_k=rng.standard_normal((32, 64)))] * ad.num_heads
    base, losses = sensitivity_losses(model, blocks, [(0, heads), (1, heads)], "l1", [8, 16, 32], variant="kq",
                                      seed=0, options={}, batch_size=2, progress=False)
    assert base == pytest.approx(calibration_loss(model, blocks, 2))
    assert all(losses[i][32] == base and set(losses[i]) == {8, 16, 32} for i in (0, 1))
    assert all(losses[i][8] != base for i in (0, 1))


def test_the_drrqr_objective_is_the_captured_energy_of_its_selection():
    rng = np.random.default_rng(1)
    K = rng.standard_normal((300, 16)) * np.linspace(3, 0.1, 16)
    Q = rng.standard_normal((300, 16)) * np.linspace(0.2, 2, 16)
    data = HeadData(K=K, Q=Q)
    sel = get_selector("drrqr")
    shares = sel.objective_values(data, [2, 4, 8, 16], rng=np.random.default_rng(0))
    M = np.vstack([K, Q])
    for w in (2, 4, 8):
        cols = sel(data, w, rng=np.random.default_rng(0)).keep
        coef, *_ = np.linalg.lstsq(M[:, cols], M, rcond=None)
        residual = np.linalg.norm(M - M[:, cols] @ coef) ** 2
        assert shares[w] == pytest.approx(1 - residual / np.linalg.norm(M) ** 2, rel=1e-9)
    assert shares[16] == 1.0 and list(shares.values()) == sorted(shares.values())
    grad = get_selector("grad").objective_values(HeadData(grad_q=np.arange(1.0, 5), grad_k=np.zeros(4)), [1, 4],
                                                 rng=np.random.default_rng(0))
    assert grad == {1: pytest.approx(0.4), 4: 1.0}


@pytest.mark.parametrize("token,spec", [
    ("drrqr@energy", MethodSpec("drrqr", budget="energy")),
    ("grad-k.prose@sens", MethodSpec("grad", variant="k", calib="prose", budget="sens")),
    ("pca-adv-q", MethodSpec("pca-adv", variant="q")),
])
def test_method_tokens_with_a_budget(token, spec):
    import re

    assert parse_method(token) == spec and format_method(spec) == token and re.fullmatch(METHOD_REGEX, token)
    assert spec.uniform.budget is None


@pytest.mark.parametrize("token", ["drrqr@", "drrqr@Energy", "drrqr@a_b", "drrqr@x@y"])
def test_bad_budget_ids_fail_in_one_line(token):
    import re

    with pytest.raises(ValueError, match=r"^bad budget id .* in method token") as err:
        parse_method(token)
    assert "\n" not in str(err.value) and not re.fullmatch(METHOD_REGEX, token)


def _config(**budgets):
    cfg = yaml.safe_load((ROOT / "config.yaml").read_text())
    cfg["budgets"] = budgets or cfg["budgets"]
    cfg.pop("studies")
    return cfg


@pytest.mark.parametrize("budgets,method,message", [
    ({"e": {"policy": "spectrum"}}, "drrqr@nope", r"unknown budget 'nope' \(method token suffix @nope\); valid: e$"),
    ({"e": {"policy": "spectrum"}}, "pca@e", r"selector 'pca' returns transforms; per-layer budgets apply to index"),
    ({"g": {"policy": "greedy"}}, "rand@g", r"policy 'greedy' needs channel scores or an objective, and selector "
                                           r"'rand' has neither"),
    ({"f": {"floor": 80}}, "drrqr@f", r"budget floor=80 exceeds d_k=64; valid: a floor in \[1, 64\]$"),
    ({"m": {"multiple": 24}}, "drrqr@m", r"total=128 is not reachable: .* nearest reachable total\(s\): 120, 136$"),
    ({"p": {"policy": "best"}}, "drrqr@p", r"^config error at budgets.p.policy: 'best' is not one of"),
])
def test_bad_budgets_fail_before_any_job(budgets, method, message):
    cfg = _config(**budgets)
    cfg["targets"]["methods"], cfg["targets"]["pcts"] = [method], [50]  # the messages' totals are 50%'s
    with pytest.raises(ConfigError, match=message) as err:
        validate_config(cfg)
    assert "\n" not in str(err.value)
    cfg["targets"]["methods"] = ["drrqr"]
    if "policy" in message or "config error" in message:
        return
    valid = validate_config(cfg)
    with pytest.raises(ConfigError, match=message):
        check_target(valid, f"results/tiny-dn/{method}_50/eval.json")


def test_an_allocation_for_another_cell_is_refused(tmp_path):
    model, _ = artifacts("delta_net", tmp_path)
    path, _ = allocation_file(tmp_path, model, "drrqr@energy", 50, BudgetSettings())
    with pytest.raises(ValueError, match=r"was written with method='drrqr@energy', pct=50; this job expects "
                                         r"method='drrqr@erank', pct=75; delete it"):
        select_channels(tmp_path / "qk.h5", "drrqr@erank", 75, activations=tmp_path / "activations.h5",
                        allocation=path)
    doc = json.loads(path.read_text())
    doc["key_dims"]["0"] += 8
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"do not add up to the uniform total 16 x 2; delete it and rerun \(rule "
                                         r"allocate rebuilds it\)"):
        read_allocation(path)


MEASURED_CASES = [("grad@g", {"policy": "greedy"}),
                  ("drrqr@s", {"policy": "sensitivity", "floor": 8, "multiple": 8, "n_samples": 2})]


@pytest.mark.parametrize("method,settings", MEASURED_CASES, ids=[m for m, _ in MEASURED_CASES])
def test_measured_values_made_once_give_every_pcts_allocation(method, settings, tmp_path):
    """Rule budget_values measures a greedy or sensitivity budget's values once; rule allocate reads them at every pct
    and writes the allocation it writes when it measures them itself, byte for byte; values of other settings are
    refused in one line."""
    from _workflow_run import save_checkpoint

    from statereduce.stages.allocate import allocate_budget, budget_values
    from statereduce.core.models import load_model
    from statereduce.common.settings import BudgetPlan

    save_checkpoint(tmp_path / "base", seed=0)
    model = load_model(tmp_path / "base")[0]
    blocks = tiny_inputs(batch=4, length=24) % 256
    export_qk_weights(model, tmp_path / "qk.h5")
    capture_activations(model, blocks, tmp_path / "activations.h5", **CALIB)
    grad_scores(model, blocks, tmp_path / "grad_scores.h5", batch_size=2)
    files = {"activations": tmp_path / "activations.h5", "grads": tmp_path / "grad_scores.h5"}
    cal = {"corpus": "embedded", "n_samples": 2, "seq_len": 32, "seed": 0, "batch_size": 2}
    corpus = {"source": "embedded", "max_bytes": 600_000}
    values = tmp_path / f"{method}.values.json"
    plan = BudgetPlan.from_dict({"name": "b", "settings": settings, "calibration": cal, "corpus": corpus})
    write_json(values, budget_values(tmp_path / "qk.h5", method, plan, **files, base=tmp_path / "base"))
    for pct in (50, 75):
        measured_here = allocate_budget(tmp_path / "qk.h5", method, pct, plan, **files, base=tmp_path / "base")
        read = allocate_budget(tmp_path / "qk.h5", method, pct, plan.replace(corpus=None), values=values)
        assert json.dumps(read) == json.dumps(measured_here), pct
    other = plan.replace(settings=plan.settings.replace(floor=16), corpus=None)
    with pytest.raises(ValueError, match=r"^\S+values\.json was measured with settings=\{.*\}; this job has \{.*"
                                         r"'floor': 16.*delete it and rerun \(rule budget_values rebuilds it\)$"):
        allocate_budget(tmp_path / "qk.h5", method, 50, other, values=values)


def test_a_values_file_is_a_target_of_its_own(tmp_path):
    """``results/{model}/select/{method}.values.json`` plans rule budget_values (what it reads, nothing after it); for
    a budget whose values are not measured (spectrum) the dry run stops in one line naming the measured policies."""
    from _snakemake import job_counts, snakemake

    out = snakemake(tmp_path, "results/tiny-dn/select/drrqr@sens.values.json", "-n")
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert job_counts(out.stdout) == {"pretrain": 1, "qk_weights": 1, "calibrate": 1, "budget_values": 1}
    job = out.stdout[out.stdout.index("rule budget_values:"):]
    inputs = [p.strip() for p in job.split("input: ", 1)[1].split("\n", 1)[0].split(",")]
    assert [p for p in inputs if p.endswith((".py", ".h5", ".json"))] == [  # the selector's code: editing it reruns
        "results/tiny-dn/weights/qk.h5", str(ROOT / "statereduce/selectors/drrqr.py"),
        str(ROOT / "statereduce/selectors/rrqr.py"), "results/tiny-dn/calib/default/activations.h5",
        "results/tiny-dn/base/pretrain.json"]
    out = snakemake(tmp_path, "results/tiny-dn/select/drrqr@energy.values.json", "-n")
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert ("method 'drrqr@energy': budgets.energy (policy spectrum) has no measured values; measured policies: "
            "greedy, sensitivity") in text, text[-3000:]


def _summary(model, method, pct, pre, post, acc):
    level = {"acc": acc, "acc_stderr": 0.05}
    stage = lambda bpb: {"heldout": {"bits_per_byte": bpb}, "recall_mqar_4": level, "recall_mqar_8": level}  # noqa
    return {"model": model, "method": method, "pct": pct,
            "metrics": {"baseline": stage(2.0), "pruned": stage(pre), "rft": stage(post)}}


def test_the_budget_study_table_compares_each_budget_with_its_uniform_cut(tmp_path):
    from _study import write_study

    from statereduce.studies.budget_study import budget_wins

    study = {"models": ["a", "b"], "selectors": ["drrqr"], "budgets": ["energy"], "pcts": [75]}
    summaries = [_summary("a", "drrqr", 75, 3.0, 2.9, 0.5), _summary("a", "drrqr@energy", 75, 2.8, 2.95, 0.6),
                 _summary("b", "drrqr", 75, 3.0, 2.9, 0.5), _summary("b", "drrqr@energy", 75, 3.1, 2.9, 0.4)]
    alloc = [{"model": m, "method": "drrqr@energy", "pct": 75, "selector": "drrqr", "budget": "energy", "d_k": 64,
              "uniform_width": 16, "key_dims": {"0": 24, "1": 8}, "allocation": {"policy": "energy"}} for m in "ab"]
    df = write_study(tmp_path, "budgets", {"summaries": summaries, "allocations": alloc}, study)["budget_study"]
    pre = df[(df["stage"] == "pruned") & (df["budget"] == "energy")].set_index("model")
    assert pre.loc["a", "d_bits_per_byte"] == pytest.approx(-0.2)
    assert pre.loc["b", "d_bits_per_byte"] == pytest.approx(0.1)
    assert pre.loc["a", "d_recall"] == pytest.approx(0.1)
    assert pre.loc["a", "d_recall_se"] == pytest.approx(np.hypot(0.05 / np.sqrt(2), 0.05 / np.sqrt(2)))
    assert pre.loc["a", "key_dims"] == "24 8"
    wins = budget_wins(df).set_index("budget")
    assert wins.loc["energy", "models_better"] == 1 and wins.loc["energy", "which"] == "a"
    md = (tmp_path / "budget_study.md").read_text()
    assert "| a | drrqr | energy | 24 8 | 2.800 → 2.950 | -0.200 | +0.050 |" in md
    assert "| 75 | drrqr | energy | 1 of 2: a |" in md
    assert (tmp_path / "budget_allocations.png").read_bytes()[:4] == b"\x89PNG"
    assert "uniform cut, whose total every budget keeps" in (tmp_path / "budget_allocations.rst").read_text()


def test_powers_of_two_keep_the_widths_the_kernels_tile_without_padding():
    from statereduce.core.budgets import allowed_widths

    assert allowed_widths(64, BudgetSettings()) == [8, 16, 24, 32, 40, 48, 56, 64]
    assert allowed_widths(64, BudgetSettings(powers_of_two=True)) == [8, 16, 32, 64]
    assert allowed_widths(96, BudgetSettings(powers_of_two=True, floor=16, multiple=16)) == [16, 32, 64, 96]
    with pytest.raises(ValueError, match=r"^budget powers_of_two='yes' must be true or false$"):
        BudgetSettings(powers_of_two="yes")
