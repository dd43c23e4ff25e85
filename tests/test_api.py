"""statereduce.api and ``python -m statereduce``.

Each check has an independent reference: the example of docs/api.md runs as written; every registered selector,
through the API on in-memory statistics, gives the selection the workflow makes from its HDF5 artifacts and a
pruned model identical (weights and logits) to the workflow's prune of that selection file; keeping every channel
reproduces the logits exactly and leaves the original model alone; a saved checkpoint reloads in a fresh process
with identical logits; bad input fails in one line naming the value and the valid choices; the overview lists
every family, selector, configured model and command-line tool, and no --help text carries Markdown or RST markup.
"""

from __future__ import annotations

import contextlib
import io
import re
import runpy
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import _fresh as fresh
import torch
import yaml
from _models import tiny_inputs, tiny_model
from _paths import ROOT

from statereduce import api
from statereduce.adapters import adapter_families, get_adapter
from statereduce.stages.capture import capture_activations, export_qk_weights, grad_scores
from statereduce.stages.prune import prune_model
from statereduce.stages.select import read_selection, select_channels, write_selection
from statereduce.core.runtime import write_json
from statereduce.selectors import selector_names
from statereduce.core.tokenizer import byte_level_tokenizer

DOC = ROOT / "docs" / "api.md"
FAMILIES = ["delta_net", "gated_deltanet", "mamba2", "qwen3_5"]
CALIB = {"rows_per_head": 40, "seed": 3, "batch_size": 2}  # the same settings for both paths


def _doc_code() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", DOC.read_text(), re.S | re.M)


def _same_rows(got, want) -> None:
    """Two selections' rows are identical: heads, kept channels or transforms, and scores."""
    assert [(layer, head) for layer, head, _ in got] == [(layer, head) for layer, head, _ in want]
    for (_, _, a), (_, _, b) in zip(got, want):
        for name in ("keep", "transform", "scores"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None and y is None) or np.array_equal(x, y), name


def _same_model(a: torch.nn.Module, b: torch.nn.Module, ids: torch.Tensor) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa), [k for k in sa if not torch.equal(sa[k], sb[k])][:3]
    assert a.config.to_dict() == b.config.to_dict()
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


# ---- the documented example ---------------------------------------------------------------------
def test_the_documented_example_runs(tmp_path, monkeypatch, capsys):
    blocks = _doc_code()
    assert len(blocks) >= 2 and "api.calibrate" in blocks[0] and "api.save" in blocks[0]
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for code in blocks:  # the page's blocks in order, in one namespace, as a reader runs them
        exec(compile(code, str(DOC), "exec"), namespace)
    out = capsys.readouterr().out
    assert "d_k 32 -> 16: held-out loss" in out
    printed = set(re.findall(r"^(\S+) +held-out loss", out, re.M))
    assert printed == {"rand", "l1", "swanda", "grad", "drrqr", "pca", "pca-adv", "l1-q"}
    record = (tmp_path / "gdn-drrqr-50" / "prune_record.json").read_text()
    assert '"method": "drrqr"' in record and '"d_k_new": 16' in record
    assert namespace["strict"].d_k_new == 8


# ---- the API against the workflow's files --------------------------------------------------------
@pytest.fixture(scope="module")
def workflow_artifacts(tmp_path_factory):
    """A tiny Gated DeltaNet's qk.h5, activations.h5 and grad_scores.h5 as the workflow's jobs write them, and the
    API's statistics of a second instance of the same model on the same blocks."""
    out = tmp_path_factory.mktemp("workflow")
    blocks = tiny_inputs(batch=4, length=24)
    model = tiny_model("gated_deltanet")
    export_qk_weights(model, out / "qk.h5")
    capture_activations(model, blocks, out / "activations.h5", **CALIB)
    grad_scores(model, blocks, out / "grad_scores.h5", batch_size=CALIB["batch_size"])
    mine = tiny_model("gated_deltanet")
    stats = api.calibrate(mine, blocks, gradients=True, **CALIB)
    assert all(p.requires_grad for p in mine.parameters()) and all(p.grad is None for p in mine.parameters())
    assert not mine.training
    return {"dir": out, "model": mine, "stats": stats, "blocks": blocks}


@pytest.mark.parametrize("method", [*selector_names(), "l1-q", "drrqr-k", "pca-q"])
def test_every_selector_matches_the_workflow(workflow_artifacts, method, tmp_path):
    art, d = workflow_artifacts, workflow_artifacts["dir"]
    rows, meta = select_channels(d / "qk.h5", method, 50, activations=d / "activations.h5",
                                 grads=d / "grad_scores.h5", seed=5)
    selection = api.select(art["model"], art["stats"], method, pct=50, seed=5)
    _same_rows(selection.rows, rows)
    assert selection.meta == meta
    # the workflow's prune job: the selection file read back, sliced into a freshly loaded model
    keep, file_meta = read_selection(write_selection(tmp_path / "sel.parquet", rows, meta))
    reference = tiny_model("gated_deltanet")
    prune_model(reference, keep, file_meta)
    pruned = api.prune(art["model"], selection)
    assert pruned.model is not art["model"] and get_adapter(pruned.model).head_k_dim == 16
    assert get_adapter(art["model"]).head_k_dim == 32  # the original keeps its shape
    _same_model(pruned.model, reference, art["blocks"])
    assert pruned.record.method == method and pruned.record.d_k_new == 16
    assert (pruned.record.transform != {}) == (selection.kind == "transform")


@pytest.mark.parametrize("family", ["delta_net", "mamba2", "qwen3_5"])
def test_selection_matches_the_workflow_in_every_family(family, tmp_path):
    blocks = tiny_inputs(batch=2, length=24)
    model = tiny_model(family)
    export_qk_weights(model, tmp_path / "qk.h5")
    capture_activations(model, blocks, tmp_path / "activations.h5", **CALIB)
    stats = api.calibrate(model, blocks, **CALIB)
    for method in ("swanda", "drrqr", "pca"):
        rows, meta = select_channels(tmp_path / "qk.h5", method, 50, activations=tmp_path / "activations.h5")
        selection = api.select(model, stats, method, pct=50)
        _same_rows(selection.rows, rows)
        assert selection.meta == meta
    keep, file_meta = read_selection(write_selection(tmp_path / "sel.parquet", rows, meta))  # pca: a transform
    reference = tiny_model(family)
    prune_model(reference, keep, file_meta)
    _same_model(api.prune(model, selection).model, reference, blocks)


# ---- invariants -----------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_keep_all_reproduces_the_logits_and_the_original_stays(family):
    model = tiny_model(family)
    ids = tiny_inputs()
    adapter = get_adapter(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        logits = model(ids).logits
    d_k = adapter.head_k_dim
    keep_all = {layer: np.tile(np.arange(d_k), (adapter.num_heads, 1)) for layer, _ in adapter.mixer_layers()}
    pruned = api.prune(model, keep_all)
    with torch.no_grad():
        assert torch.equal(pruned.model(ids).logits, logits)
    api.prune(model, api.select(model, None, "l1", pct=50))  # a real pruning of a copy
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    in_place = api.prune(model, api.select(model, None, "rand", pct=50), inplace=True)
    assert in_place.model is model and get_adapter(model).head_k_dim == d_k // 2


RELOADED = {"delta_net": "pca", "qwen3_5": "grad"}  # an fla family with a transform, a hybrid with gradients


def test_saved_checkpoints_reload_in_a_fresh_process(tmp_path):
    """Checkpoints saved through the API load with statereduce.core.models.load_model in another process with identical
    logits (one process for all: its imports cost seconds; tests/test_prune.py reloads every family)."""
    ids = tiny_inputs(batch=2, length=24)
    torch.save(ids, tmp_path / "ids.pt")
    expected = {}
    for family, method in RELOADED.items():
        model = tiny_model(family)
        stats = api.calibrate(model, ids, rows_per_head=20, gradients=method == "grad")
        pruned = api.prune(model, api.select(model, stats, method, pct=50))
        path = api.save(pruned, tmp_path / family, byte_level_tokenizer())
        assert path == tmp_path / family and (path / "prune_record.json").is_file()
        with torch.no_grad():
            expected[family] = pruned.model(ids).logits
    code = textwrap.dedent(f"""
        import torch
        from statereduce.core.models import load_model
        root = {str(tmp_path)!r}
        ids = torch.load(root + "/ids.pt")
        for family in {list(RELOADED)!r}:
            model, tokenizer = load_model(root + "/" + family)
            with torch.no_grad():
                torch.save(model(ids).logits, root + "/" + family + ".pt")
    """)
    out = fresh.run(["-c", code], cwd=ROOT, timeout=600, preload=fresh.TORCH)
    assert out.returncode == 0, out.stderr[-3000:]
    for family in RELOADED:
        assert torch.equal(torch.load(tmp_path / f"{family}.pt"), expected[family]), family


# ---- bad input --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dn():
    model = tiny_model("delta_net")
    return model, api.calibrate(model, tiny_inputs(batch=2, length=16), rows_per_head=10)


@pytest.mark.parametrize("call, message", [
    (lambda m, s: api.select(m, s, "drrqx"),
     r"unknown selector 'drrqx'.*did you mean 'drrqr'.*valid: drrqr, ghost, grad"),
    (lambda m, s: api.select(m, s, "rand-k"), r"'rand'.* has no variant 'k'"),
    (lambda m, s: api.select(m, s, "drrqr", pct=150), r"pct=150 must be in \(0, 100\)"),
    (lambda m, s: api.select(m, s, "drrqr", pct="half"), r"pct='half' must be a number in \(0, 100\)"),
    (lambda m, s: api.select(m, s, "drrqr", pct=99.9), r"pct=99.9 removes every channel of d_k=32"),
    (lambda m, s: api.allocate(m, s, "drrqr", 0.5), r"^pct 0\.5 removes no key channel of d_k=32 "),
    (lambda m, s: api.select(m, s, "drrqr", g=2), r"unknown option\(s\) \['g'\] for selector 'drrqr'; valid: \['f'"),
    (lambda m, s: api.select(m, None, "drrqr"), r"'drrqr' needs calibration statistics \(K, Q\)"),
    (lambda m, s: api.select(m, s, "grad"), r"'grad' needs Grad scores.*gradients=True"),
    (lambda m, s: api.select(m, {"K": 1}, "l1"), r"stats must be what api.calibrate returns.*got dict"),
    (lambda m, s: api.select(tiny_model("gated_deltanet"), s, "l1"), r"family='delta_net'; this model has "
                                                                     r"family='gated_deltanet'"),
    (lambda m, s: api.calibrate(m, torch.arange(10)), r"shape \[n_samples, seq_len\], got shape \(10,\)"),
    (lambda m, s: api.calibrate(m, torch.rand(2, 8)), r"integer token ids, got dtype torch.float32"),
    (lambda m, s: api.calibrate(m, [[1, 2, 300]]), r"token ids in \[1, 300\]; valid: \[0, vocab_size=300\)"),
    (lambda m, s: api.calibrate(m, [[1, 2]], rows_per_head=0), r"rows_per_head=0 must be a positive integer"),
    (lambda m, s: api.calibrate(m, [[1]], gradients=True), r"at least 2 tokens.*seq_len=1"),
    (lambda m, s: api.calibrate(torch.nn.Linear(2, 2), [[1]]), r"one of the families delta_net, gated_deltanet"),
    (lambda m, s: api.prune(m, "drrqr"), r"selection must be what api.select returns.*got str"),
    (lambda m, s: api.prune(m, {0: [[0, 1]]}), r"keep covers layers \[0\]; the model's linear-attention layers"),
    (lambda m, s: api.save(m, "x"), r"save takes what api.prune returns"),
    (lambda m, s: api.build("deltanet"), r"unknown model family 'deltanet'; valid: delta_net, gated_deltanet"),
    (lambda m, s: api.build("delta_net", hiden_size=8), r"unknown arch key\(s\) \['hiden_size'\]"),
], ids=["selector", "variant", "pct-range", "pct-type", "pct-keeps-none", "allocate-pct-removes-none", "option",
        "no-stats", "no-grad", "stats-type", "stats-of-another-model", "blocks-shape", "blocks-dtype", "blocks-vocab",
        "rows", "grad-seq", "not-a-model", "selection-type", "selection-layers", "save-type", "family", "arch"])
def test_bad_input_fails_in_one_line(dn, call, message):
    with pytest.raises(ValueError, match=message) as err:
        call(*dn)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("pct, kept", [(0.5, None), (1.5, None), (1.6, 31), (50, 16)])
def test_a_pct_is_a_percent_and_one_that_removes_no_channel_is_refused(dn, pct, kept):
    """A fraction written for a percent (0.5 meaning half) removes no channel of d_k=32: refused in one line that
    says what pcts are; 1.6 removes one channel (round(0.512) = 1), 50 removes half."""
    model, stats = dn
    if kept is None:
        with pytest.raises(ValueError) as err:
            api.select(model, stats, "drrqr", pct=pct)
        assert str(err.value) == (f"pct {pct:g} removes no key channel of d_k=32 (round(32*{pct:g}/100) = 0); pcts "
                                  "are percent of channels removed, e.g. drrqr_50 removes half")
        return
    selection = api.select(model, stats, "drrqr", pct=pct)
    assert selection.d_k_new == kept and all(len(sel.keep) == kept for _, _, sel in selection.rows)


# ---- python -m statereduce and the --help texts ----------------------------------------------------
def _run_main(module: str, *args: str) -> str:
    """stdout of ``python -m module args`` run in this process (runpy; the imports are already paid)."""
    buf = io.StringIO()
    argv = sys.argv
    sys.argv = [module, *args]
    try:
        with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module is already imported (rft)
            runpy.run_module(module, run_name="__main__", alter_sys=False)
    finally:
        sys.argv = argv
    return buf.getvalue()


def test_overview_lists_families_selectors_models_and_tools():
    code = textwrap.dedent("""
        import runpy, sys
        sys.argv = ["statereduce"]
        try:
            runpy.run_module("statereduce", run_name="__main__")
        except SystemExit as exit:
            assert exit.code == 0, exit.code
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("fla", "transformers", "peft"))
        print("heavy imports:", heavy)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "heavy imports: []" in text
    for name in [*adapter_families(), *selector_names()]:
        assert re.search(rf"^  {re.escape(name)}  ", text, re.M), name
    models = yaml.safe_load((ROOT / "config.yaml").read_text())["models"]
    assert f"Configured models ({ROOT / 'config.yaml'}):" in text
    for name, spec in models.items():
        assert re.search(rf"^  {re.escape(name)} +{spec['family']} ", text, re.M), name
    for tool in ("python -m statereduce ", "python -m statereduce.stages.rft ", "python -m statereduce.speed "):
        assert f"\n  {tool}" in text, tool
    assert "python -m statereduce.speed.bench" not in text  # reached through statereduce.speed
    assert "`" not in text and "**" not in text and ":func:" not in text


def test_overview_says_where_it_looked_for_the_config(tmp_path):
    missing = tmp_path / "nowhere.yaml"
    assert f"Configured models: no config at {missing} (give --config PATH)" in _run_main(
        "statereduce", "--config", str(missing))
    other = tmp_path / "other.yaml"
    other.write_text("models:\n  mine: {family: mamba2, local: /ckpt/m2}\n")
    text = _run_main("statereduce", "--config", str(other))
    assert f"Configured models ({other}):" in text and re.search(r"^  mine +mamba2 +local /ckpt/m2$", text, re.M)


def test_every_cli_help_is_plain_text():
    from statereduce.__main__ import clis

    tools = [cmd.split()[-1] for cmd, _ in clis()]
    assert {"statereduce", "statereduce.stages.rft", "statereduce.speed"} <= set(tools)
    for module in tools:
        text = _run_main(module, "--help")
        assert text.startswith(f"usage: python -m {module}"), (module, text[:200])
        assert "`" not in text and "**" not in text and ":func:" not in text, (module, text)


def test_import_statereduce_is_light():
    code = "import statereduce, sys; print(sorted(m for m in ('torch', 'fla', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize("method,policy", [("drrqr", "spectrum"), ("grad", "greedy"), ("drrqr-k", "greedy")])
def test_a_budget_matches_the_workflow(workflow_artifacts, method, policy, tmp_path):
    """api.allocate gives the widths and values rule allocate computes from the files, and api.select with them the
    workflow's per-layer selection."""
    from statereduce.stages.allocate import allocate_budget
    from statereduce.common.settings import BudgetPlan

    art, d = workflow_artifacts, workflow_artifacts["dir"]
    budget = {"policy": policy, "floor": 4, "multiple": 4}
    doc = api.allocate(art["model"], art["stats"], method, 50, budget)
    ref = allocate_budget(d / "qk.h5", f"{method}@b", 50, BudgetPlan.from_dict({"name": "b", "settings": budget}),
                          activations=d / "activations.h5", grads=d / "grad_scores.h5")
    assert doc["key_dims"] == ref["key_dims"] and doc["allocation"]["values"] == ref["allocation"]["values"]
    selection = api.select(art["model"], art["stats"], method, pct=50, widths=doc["key_dims"])
    write_json(tmp_path / "a.json", ref)
    rows, meta = select_channels(d / "qk.h5", f"{method}@b", 50, activations=d / "activations.h5",
                                 grads=d / "grad_scores.h5", allocation=tmp_path / "a.json")
    _same_rows(selection.rows, rows)
    widths = {int(k): v for k, v in doc["key_dims"].items()}
    assert selection.d_k_new == (widths if len(set(widths.values())) > 1 else widths[0])
    pruned = api.prune(art["model"], selection, norm_eps="exact")
    assert get_adapter(pruned.model).layer_key_dims() == widths
