"""The SLURM profile (profiles/slurm): plans without SLURM or conda installed, and names only real rules.

A dry run goes through snakemake-executor-plugin-slurm (a test dependency) up to the point of submitting, so it
checks the profile's keys and resources against the plugin; nothing is submitted.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from _paths import ROOT
from _snakemake import planned_jobs, snakemake

PROFILE = ROOT / "profiles" / "slurm"
INSTALL = "pip install -c constraints.txt -e '.[slurm]'"


def test_profile_plans_hub_and_tiny_targets_without_slurm_or_conda(tmp_path):
    pytest.importorskip("snakemake_executor_plugin_slurm", reason=INSTALL)
    out = snakemake(tmp_path, "--profile", str(PROFILE), "-n", "results/gdn1.3b/drrqr_50/eval.json",
                    "results/qwen35-9b/drrqr_50/eval.json", "results/tiny-dn/drrqr_50/eval.json")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "conda" not in text.lower()  # software deployment is off unless --sdm conda is given
    for rule in ("base_source", "pretrain", "calibrate", "prune", "rft", "summarize"):
        assert f"rule {rule}:" in text or f"localrule {rule}:" in text, rule


#: ``snakemake`` run by a Python that does not see the SLURM plugin (as after ``pip install -e .`` without the extra):
#: Snakemake finds executor plugins with ``pkgutil.iter_modules`` and the profile asks ``importlib.util.find_spec``.
WITHOUT_PLUGIN = """
import pkgutil, sys
_modules = pkgutil.iter_modules
pkgutil.iter_modules = lambda *a, **k: (m for m in _modules(*a, **k)
                                        if not m.name.startswith("snakemake_executor_plugin_slurm"))
sys.modules["snakemake_executor_plugin_slurm"] = sys.modules["snakemake_executor_plugin_slurm_jobstep"] = None
from snakemake.cli import main
main(sys.argv[1:])
"""


@pytest.mark.parametrize("hidden", [True, False], ids=["without-plugin", "with-plugin"])
def test_a_python_without_the_plugin_stops_in_one_line_naming_the_install(tmp_path, hidden):
    """Without snakemake-executor-plugin-slurm, Snakemake would print argparse's usage (about 150 lines) and
    ``invalid choice: 'slurm'``; the profile's YTE definition stops it first, in one line naming the install."""
    import subprocess
    import sys

    if not hidden:
        pytest.importorskip("snakemake_executor_plugin_slurm", reason=INSTALL)
    (tmp_path / "config.yaml").write_text((ROOT / "config.yaml").read_text())
    code = WITHOUT_PLUGIN if hidden else "import sys\nfrom snakemake.cli import main\nmain(sys.argv[1:])"
    out = subprocess.run([sys.executable, "-c", code, "-s", str(ROOT / "Snakefile"), "--directory", str(tmp_path),
                          "--profile", str(PROFILE), "-n", "results/tiny-dn/drrqr_50/eval.json"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    text = out.stdout + out.stderr
    if hidden:
        assert out.returncode == 1
        assert text.strip().splitlines()[-1] == ("profiles/slurm needs snakemake-executor-plugin-slurm, which this "
                                                 f"Python lacks: {INSTALL}")
        assert len(text.strip().splitlines()) <= 2 and "invalid choice" not in text, text[-2000:]
    else:
        assert out.returncode == 0, text[-3000:]
        assert "rule prune:" in text


def test_every_slurm_install_line_names_the_constraints():
    """Without ``-c constraints.txt`` pip takes the newest torch and Triton (untested with this code)."""
    found = []
    for path in [*sorted((ROOT / "docs").rglob("*.md")), PROFILE / "config.yaml"]:
        for line in Path(path).read_text().splitlines():
            if "'.[slurm]'" in line and "pip install" in line:
                found.append(line)
                assert INSTALL in line, f"{path}: {line}"
    assert found


def _rules_declaring_a_gpu() -> set[str]:
    """The rules of rules/*.smk whose ``resources`` name ``gpu``."""
    found = set()
    for path in sorted((ROOT / "rules").glob("*.smk")):
        for m in re.finditer(r"^rule (\w+):\n(.*?)(?=^rule |\Z)", path.read_text(), re.S | re.M):
            if re.search(r"^\s+gpu=", m.group(2), re.M):
                found.add(m.group(1))
    return found


def test_profile_names_only_existing_rules_and_no_flags_the_plugin_refuses(tmp_path):
    profile = yaml.safe_load((PROFILE / "config.yaml").read_text())
    assert "software-deployment-method" not in profile and profile["executor"] == "slurm"
    assert profile["rerun-incomplete"] is True and profile["latency-wait"] >= 30
    out = snakemake(tmp_path, "--list-rules")
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    rules = set(out.stdout.split())
    assert set(profile["set-resources"]) <= rules, set(profile["set-resources"]) - rules
    # the rules that declare a gpu resource (read from rules/*.smk) go to the GPU partition, and only they
    gpu_rules = _rules_declaring_a_gpu()
    assert {"calibrate", "grad_scores", "prune", "rft", "split", "speed"} <= gpu_rules <= rules
    partitions = {r: res.get("slurm_partition") for r, res in profile["set-resources"].items()}
    assert {r for r in gpu_rules if partitions.get(r) != "gpu"} == set()
    assert {r for r, p in partitions.items() if p == "gpu"} - gpu_rules == set()
    for resources in [profile["default-resources"], *profile["set-resources"].values()]:
        extra = str(resources.get("slurm_extra", ""))
        assert not any(flag in extra for flag in ("--gres", "--gpus", "--mem", "-p ")), extra


def test_jobs_ask_for_their_threads_as_cpus_and_their_gpus(tmp_path):
    """Every job that loads or reads a model declares ``threads`` (the model's ``threads``: 4 on CUDA, 1 for the tiny
    CPU models, whose numbers depend on torch's thread count), the profile sets no ``cpus_per_task``, so the plugin
    asks SLURM for that many CPUs; GPU jobs keep their own ``gpu`` request with no ``--resources`` (none is needed
    under SLURM). A dry run caps threads at ``--cores`` (1 unless given), a SLURM run does not: hence ``--cores 64``."""
    pytest.importorskip("snakemake_executor_plugin_slurm", reason=INSTALL)
    from snakemake_executor_plugin_slurm_jobstep import get_cpu_setting

    profile = yaml.safe_load((PROFILE / "config.yaml").read_text())
    assert not any("cpus_per_task" in r for r in [profile["default-resources"], *profile["set-resources"].values()])
    out = snakemake(tmp_path, "results/gdn1.3b/drrqr_50/eval.json", "results/tiny-dn/drrqr_50/eval.json",
                    "--profile", str(PROFILE), "-n", "--cores", "64")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    torch_rules = {"pretrain", "qk_weights", "calibrate", "eval_baseline", "select_channels", "prune", "rft"}
    seen = set()
    for job in planned_jobs(text):
        model, rule = job["wildcards"].get("model"), job["rule"]
        if rule in torch_rules:
            assert job["threads"] == (4 if model == "gdn1.3b" else 1), job
            seen.add((rule, model))
        else:
            assert job["threads"] == 1, job
        assert "cpus_per_task" not in job["resources"], job
        if rule in ("calibrate", "eval_baseline", "prune", "rft"):
            assert job["resources"]["gpu"] == ("1" if model == "gdn1.3b" else "0"), job
    assert seen == {(r, m) for r in torch_rules for m in ("gdn1.3b", "tiny-dn") if (r, m) != ("pretrain", "gdn1.3b")}

    class Job:  # what the plugin reads of a job to build sbatch's CPU option
        threads = 4
        resources = type("Resources", (dict,), {"get": dict.get})()

    assert get_cpu_setting(Job(), gpu=True) == "--cpus-per-task=4"
