"""The SLURM profile (profiles/slurm): plans without SLURM or conda installed, and names only real rules.

A dry run goes through snakemake-executor-plugin-slurm (a test dependency) up to the point of submitting, so it
checks the profile's keys and resources against the plugin; nothing is submitted.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "profiles" / "slurm"


def _snakemake(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.yaml").write_text((ROOT / "config.yaml").read_text())
    cmd = [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "--directory", str(workdir), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_profile_plans_hub_and_tiny_targets_without_slurm_or_conda(tmp_path):
    pytest.importorskip("snakemake_executor_plugin_slurm", reason="pip install -e '.[slurm]'")
    out = _snakemake(tmp_path, "--profile", str(PROFILE), "-n", "results/gdn1.3b/drrqr_50/eval.json",
                     "results/qwen35-9b/drrqr_50/eval.json", "results/tiny-dn/drrqr_50/eval.json")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "conda" not in text.lower()  # software deployment is off unless --sdm conda is given
    for rule in ("base_source", "pretrain", "calibrate", "prune", "rft", "summarize"):
        assert f"rule {rule}:" in text or f"localrule {rule}:" in text, rule


def test_profile_names_only_existing_rules_and_no_flags_the_plugin_refuses(tmp_path):
    profile = yaml.safe_load((PROFILE / "config.yaml").read_text())
    assert "software-deployment-method" not in profile and profile["executor"] == "slurm"
    assert profile["rerun-incomplete"] is True and profile["latency-wait"] >= 30
    out = _snakemake(tmp_path, "--list-rules")
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    rules = set(out.stdout.split())
    assert set(profile["set-resources"]) <= rules, set(profile["set-resources"]) - rules
    # the GPU-heavy rules (those that declare a gpu resource) all go to the GPU partition
    gpu_rules = {"calibrate", "grad_scores", "eval_baseline", "prune", "rft", "rank", "rank_baseline", "speed",
                 "speed_baseline"}
    assert gpu_rules <= rules
    assert all(profile["set-resources"][r]["slurm_partition"] == "gpu" for r in gpu_rules)
    for resources in [profile["default-resources"], *profile["set-resources"].values()]:
        extra = str(resources.get("slurm_extra", ""))
        assert not any(flag in extra for flag in ("--gres", "--gpus", "--mem", "-p ")), extra
