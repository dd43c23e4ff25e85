"""The workflow at the paper's sizes (configs/gpu_paper_scale.yaml, docs/paper_scale.md), as far as a CPU can check it.

Models of a hub model's shape with random weights (``init:``, rule init_random): the committed overlay dry-runs on a
machine without a GPU and plans every stage; each model has its hub entry's shape; init_random writes a seeded
checkpoint that the later stages load, through the workflow on a tiny shape. The kernel routing of a backward on a
GPU where fla refuses it (``rft.kernels: auto``, Grad scores) picks the torch ops for the families that need it.
"""

from __future__ import annotations

import copy

import pytest
import torch
import yaml
from _models import tiny_arch
from _paths import ROOT
from _snakemake import job_counts, snakemake

from statereduce.config import ConfigError, model_dims, validate_config

OVERLAY = ROOT / "configs" / "gpu_paper_scale.yaml"
SELECTORS = 5


def _merged() -> dict:
    """config.yaml with the overlay, merged as ``--configfile`` merges it (dicts key by key)."""
    def merge(a: dict, b: dict) -> dict:
        out = dict(a)
        for k, v in b.items():
            out[k] = merge(a[k], v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v
        return out

    return merge(yaml.safe_load((ROOT / "config.yaml").read_text()), yaml.safe_load(OVERLAY.read_text()))


def test_overlay_dry_runs_every_stage_without_a_gpu(tmp_path):
    """The overlay's default target plans the whole chain of both 1.3B shapes (five selectors at 50%, RFT, summaries)
    and its other documented targets plan speed and capture -> select -> prune -> eval, on a machine without CUDA."""
    out = snakemake(tmp_path, "-n", "--resources", "gpu=1", "--configfile", str(OVERLAY))
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    counts = job_counts(out.stdout)
    for rule, n in {"init_random": 2, "calibrate": 2, "grad_scores": 2, "qk_weights": 2, "eval_baseline": 2,
                    "select_channels": 2 * SELECTORS, "prune": 2 * SELECTORS, "rft": 2 * SELECTORS,
                    "summarize": 2 * SELECTORS, "comparison_table": 1}.items():
        assert counts.get(rule) == n, (rule, counts)
    targets = ["results/dn1.3b-init/drrqr_50/speed.json", "results/qwen35-9b-init/drrqr_50/pruned/eval.json",
               "results/mamba2-370m-init/grad_50/pruned/eval.json"]
    out = snakemake(tmp_path, *targets, "-n", "--resources", "gpu=1", "--configfile", str(OVERLAY))
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    counts = job_counts(out.stdout)
    # speed builds its own random weights; drrqr reads the calibration, grad the Grad scores
    assert counts == {"init_random": 2, "speed": 1, "calibrate": 1, "grad_scores": 1, "qk_weights": 2,
                      "select_channels": 2, "prune": 2}, counts


def test_a_base_config_target_names_the_rule_of_its_model_source(tmp_path):
    """pretrain and init_random both write results/{model}/base/config.json: a target naming that file plans the one
    rule of the model's own source (an ambiguity error otherwise), with pretrained and init models in one config."""
    for model, rule in (("tiny-dn", "pretrain"), ("dn1.3b-init", "init_random")):
        out = snakemake(tmp_path, f"results/{model}/base/config.json", "-n", "--resources", "gpu=1",
                        "--configfile", str(OVERLAY))
        assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
        assert job_counts(out.stdout) == {rule: 1}, out.stdout[-3000:]


def test_overlay_models_have_their_hub_entries_shapes():
    """Each ``<hub key>-init`` model has the shape of the hub entry beside it: the speed runs' arch where the entry
    has one (gdn1.3b's is fla's GatedDeltaNetConfig 1.3B layout, not its checkpoint's dims), else its ``dims``."""
    cfg = validate_config(_merged())
    hub_keys = [name.removesuffix("-init") for name in cfg["models"] if name.endswith("-init")]
    assert sorted(hub_keys) == sorted(n for n, m in cfg["models"].items() if "hub" in m)
    for key in hub_keys:
        hub, init = cfg["models"][key], cfg["models"][f"{key}-init"]
        assert init["family"] == hub["family"], key
        if "speed" in hub:
            assert init["init"]["arch"] == hub["speed"]["arch"], key
        else:
            assert model_dims(cfg, f"{key}-init") == hub["dims"], key
    assert model_dims(cfg, "dn1.3b-init") == cfg["models"]["dn1.3b"]["dims"]


def test_init_model_needs_one_source_and_a_valid_arch():
    cfg = _merged()
    both = copy.deepcopy(cfg)
    both["models"]["dn1.3b-init"]["hub"] = {"id": "fla-hub/delta_net-1.3B-100B"}
    with pytest.raises(ConfigError, match=r"models\.dn1\.3b-init: a model needs exactly one of hub, local, pretrain, "
                                          r"init$"):
        validate_config(both)
    typo = copy.deepcopy(cfg)
    typo["models"]["dn1.3b-init"]["init"]["arch"]["num_head"] = 16
    with pytest.raises(ConfigError, match=r"^models\.dn1\.3b-init\.init\.arch: unknown arch key\(s\) \['num_head'\]"):
        validate_config(typo)


@pytest.mark.parametrize("family", ["delta_net", "gated_deltanet", "mamba2", "qwen3_5"])
def test_init_random_writes_a_seeded_checkpoint_that_loads(tmp_path, family):
    from statereduce.core.models import load_model
    from statereduce.stages.pretrain import INIT_RECORD, init_random

    arch = tiny_arch(family, vocab_size=400)  # more ids than the byte-level tokenizer's 257, as at hub sizes
    a = init_random(family, arch, tmp_path / "a", seed=3, dtype="float32")
    init_random(family, arch, tmp_path / "b", seed=3, dtype="float32")
    init_random(family, arch, tmp_path / "c", seed=4, dtype="float32")
    assert yaml.safe_load((tmp_path / "a" / INIT_RECORD).read_text())["n_params"] == a["n_params"]
    (ma, tok), (mb, _), (mc, _) = (load_model(tmp_path / k) for k in "abc")
    assert ma.config.vocab_size == 400 and tok("ab")["input_ids"][-2:] == [97, 98]
    sa, sb, sc = ma.state_dict(), mb.state_dict(), mc.state_dict()
    assert sum(p.numel() for p in ma.parameters()) == a["n_params"]
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    ids = torch.tensor([list(b"def f(x):\n    return x")])
    assert torch.isfinite(ma(input_ids=ids).logits).all()


def test_init_model_ran_capture_select_prune_eval_through_the_workflow(workflow_run):
    """A tiny ``init`` model (``wf-init`` of the workflow tier's run) on the CPU through init_random -> calibrate ->
    select -> prune + evaluate."""
    from _workflow_run import INIT_TARGET

    from statereduce.core.models import load_model

    work = workflow_run["work"]
    base = work / "results" / "wf-init" / "base"
    assert {"init.json", "config.json", "model.safetensors"} <= {p.name for p in base.iterdir()}
    assert (work / "benchmarks" / "init_random" / "wf-init.tsv").is_file()
    assert (work / INIT_TARGET).is_file()
    assert load_model(base)[0].config.vocab_size == 300


def test_auto_kernels_pick_torch_only_where_fla_refuses_the_family_backward(monkeypatch):
    from statereduce.adapters import adapter_class
    from statereduce.kernels import routing

    assert routing.fla_refuses_gated_backward("cpu") is False
    monkeypatch.setattr(routing, "fla_refuses_gated_backward", lambda device: True)
    picks = {f: adapter_class(f).backward_kernels("cuda") for f in ("delta_net", "gated_deltanet", "mamba2", "qwen3_5")}
    assert picks == {"delta_net": "fla", "gated_deltanet": "torch", "mamba2": "fla", "qwen3_5": "torch"}
    assert adapter_class("gated_deltanet").backward_kernels("cuda", "fla") == "fla"
    monkeypatch.setattr(routing, "fla_refuses_gated_backward", lambda device: False)
    assert adapter_class("gated_deltanet").backward_kernels("cuda") == "fla"
    assert adapter_class("delta_net").backward_kernels("cpu", "torch") == "torch"


@pytest.mark.slow  # 47 s on 2 cores: the benchmark script under torch's profiler, in a fresh interpreter
def test_rft_step_benchmark_measures_both_steps_side_by_side(tmp_path):
    """scripts/bench_rft_step.py (the RFT-throughput target's measurement) runs end to end on a tiny shape: both
    steps timed in one run, the ratio written, and the profiled steady steps' tables."""
    import json
    import subprocess
    import sys

    out = tmp_path / "bench.json"
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_rft_step.py"), str(out), "--model", "tiny-dn",
                        "--micro", "1", "2", "auto", "--steps", "2", "--batch", "2", "--seq-len", "32",
                        "--device", "cpu",
                        "--profile", str(tmp_path / "prof")],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["d_k"] == [64, 32] and [r["micro_batch_size"] for r in doc["runs"]] == [1, 2, "auto"]
    assert doc["runs"][2]["rft"]["micro_batch_size"] == 1  # auto on a CPU
    for run in doc["runs"]:
        assert run["plain"]["tokens_per_s"] > 0 and run["rft"]["tokens_per_s"] > 0
        assert run["ratio"] == run["rft"]["tokens_per_s"] / run["plain"]["tokens_per_s"]
    assert "| 2 |" in p.stdout
    for name in ("plain", "rft"):  # the steady steps' operator tables
        assert doc["profile"][name]["wall_s"] > 0
        assert "aten::" in (tmp_path / "prof" / doc["profile"][name]["table"]).read_text()
