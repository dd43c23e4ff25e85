"""The conda environments of `--sdm conda` (envs/*.yaml, rules/resources.smk: conda_env).

* GPU jobs (models with ``device: cuda``, the speed rules) get the CUDA envs, CPU jobs the CPU ones, and config
  ``conda_envs`` points either at the user's own: checked with Snakemake's ``--list-conda-envs`` through a stand-in
  ``conda`` that answers Snakemake's checks (no conda here, no environment is built);
* the env files agree with each other (the evaluation stack holds the model stack; the CUDA envs differ from the
  CPU ones only in where torch comes from and the Triton it needs);
* the env files' pins resolve together: pip's resolver, dry, against PyPI (skipped where PyPI is out of reach).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from _paths import ROOT
from _pins import pypi_reachable
from _snakemake import snakemake

ENVS = ROOT / "envs"
FAKE_CONDA = """#!/bin/sh
case "$*" in
  "--version") echo "conda 25.1.1" ;;
  "info --json") echo '{"conda_prefix": "/nonexistent", "platform": "linux-64", "envs_dirs": []}' ;;
  "config --get channel_priority --json") echo '{"get": {"channel_priority": "strict"}}' ;;
  *) echo "stand-in conda: $*" >&2; exit 1 ;;
esac
"""
GPU_TARGETS = ["results/gdn1.3b/drrqr_50/eval.json", "results/gdn1.3b/baseline/speed.json"]
CPU_TARGETS = ["results/tiny-dn/drrqr_50/eval.json", "results/tiny-mamba2/l1_50/eval.json"]


def _pip_lines(name: str) -> list[str]:
    doc = yaml.safe_load((ENVS / name).read_text())
    pip = [d["pip"] for d in doc["dependencies"] if isinstance(d, dict)]
    assert len(pip) == 1 and "python=3.11" in doc["dependencies"]
    return pip[0]


def _pins(name: str) -> dict[str, str]:
    return dict(line.split("==") for line in _pip_lines(name) if not line.startswith("-"))


def _listed_envs(tmp_path: Path, targets: list[str], *configfiles: Path) -> set[str]:
    work = tmp_path / "wf"
    skip = shutil.ignore_patterns(".venv", "results", ".snakemake", "logs", ".git", ".whl", "*.pyc")
    shutil.copytree(ROOT, work, ignore=skip)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "conda").write_text(FAKE_CONDA)
    (bin_dir / "conda").chmod(0o755)
    args = ["-n", "--sdm", "conda", "--list-conda-envs", "--cores", "1"]
    if configfiles:
        args += ["--configfile", "config.yaml", *map(str, configfiles)]
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    p = snakemake(work, *args, "--", *targets, workflow=work, cwd=work, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("environment\t"))
    return {line.split("\t")[0] for line in lines[start + 1 :] if line.strip()}


def test_gpu_jobs_get_the_cuda_envs_and_cpu_jobs_the_cpu_envs(tmp_path):
    assert _listed_envs(tmp_path / "gpu", GPU_TARGETS) == {"envs/fla_cuda.yaml", "envs/lm_eval_cuda.yaml"}
    assert _listed_envs(tmp_path / "cpu", CPU_TARGETS) == {"envs/fla.yaml", "envs/lm_eval.yaml"}


def test_config_points_gpu_jobs_at_the_users_own_envs(tmp_path):
    mine = tmp_path / "mine.yaml"
    shutil.copy(ENVS / "lm_eval_cuda.yaml", mine)
    override = tmp_path / "override.yaml"
    override.write_text(yaml.safe_dump({"conda_envs": {"cuda": {"fla": "my-gpu-env", "lm_eval": str(mine)}}}))
    # the named env is used as it is (Snakemake lists only the envs it would build): only mine.yaml is left
    assert _listed_envs(tmp_path / "o", GPU_TARGETS, override) == {str(mine)}


def test_bad_conda_envs_key_fails_config_validation():
    from statereduce import config as srconfig

    cfg = yaml.safe_load((ROOT / "config.yaml").read_text())
    cfg["conda_envs"] = {"gpu": {"fla": "x"}}
    with pytest.raises(srconfig.ConfigError, match="conda_envs"):
        srconfig.validate_config(cfg)


def test_env_files_agree():
    for stack in ("fla", "lm_eval"):
        cpu, cuda = _pins(f"{stack}.yaml"), _pins(f"{stack}_cuda.yaml")
        assert cuda["triton"] == "3.7.1"  # fla's Gated DeltaNet backward on Hopper needs >= 3.7.1
        assert cpu == cuda and cpu["torch"] == "2.13.0"  # the CPU envs hold Triton too: fla imports it
        assert "--extra-index-url https://download.pytorch.org/whl/cpu" in _pip_lines(f"{stack}.yaml")
        assert not any(line.startswith("-") for line in _pip_lines(f"{stack}_cuda.yaml"))
    fla, lm_eval = _pins("fla.yaml"), _pins("lm_eval.yaml")
    assert {k: lm_eval[k] for k in fla} == fla and {"lm-eval", "matplotlib"} <= set(lm_eval)


@pytest.mark.network
@pytest.mark.parametrize("name", ["lm_eval.yaml", "lm_eval_cuda.yaml"])  # each holds its fla env's pins too
def test_env_file_resolves_with_pip(name, tmp_path):
    """pip's resolver, dry, on PyPI alone (``--isolated``: no local index or find-links): every pin exists for
    Python 3.11 on Linux and they fit together. The CPU env's PyTorch index is left out (it only swaps torch's
    build for one of the same version); the CUDA env must bring CUDA torch."""
    if not pypi_reachable():
        pytest.skip("PyPI (pypi.org:443) is out of reach: the env files' pins cannot be resolved here")
    if sys.version_info[:2] != (3, 11):
        pytest.skip(f"the envs pin python=3.11; this is Python {sys.version_info[0]}.{sys.version_info[1]}")
    reqs = tmp_path / "requirements.txt"
    reqs.write_text("\n".join(x for x in _pip_lines(name) if not x.startswith("-")) + "\n")
    report = tmp_path / "report.json"
    p = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--isolated",
                        "--quiet", "--report", str(report), "-r", str(reqs)], capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    got = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"]
           for i in json.loads(report.read_text())["install"]}
    for pkg, version in _pins(name).items():
        assert got.get(pkg.lower().replace("_", "-")) == version, (pkg, version, got.get(pkg.lower()))
    if "cuda" in name:
        assert any(k.startswith("nvidia-") for k in got), "the CUDA env resolved a torch without CUDA libraries"
