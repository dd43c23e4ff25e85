"""The ``snakemake`` command line: targets before or after options, GPUs granted with ``--resources gpu=N``.

Dry runs of the shipped config in an empty work directory (nothing is built, hub models plan offline):
- a target plans the same whether the options come before or after it (or after ``--``), and a bad target (an
  unknown part, a ratio that keeps no channel, a pct spelled otherwise than paths write it) fails in one line either
  way; an option of several values (``-R``, ``--until``, ``--configfile`` once the target exists) that took the
  target fails in one line instead of planning the default target or ending in Snakemake's "BUG: Out of jobs
  ready"; ``--resources`` and ``--configfile`` before a target that does not exist stop Snakemake before it reads
  the workflow (pinned, with the spellings that work); an option after ``--`` fails in one line;
- run on this machine, a GPU job (a model on ``device: cuda``) stops the run in one line unless the run was granted
  at least its GPUs (``--resources gpu=N``), and each GPU job asks for its own GPUs (not fewer, as Snakemake would
  scale it to the granted ones); CPU models need no ``gpu`` resource at all.
"""

from __future__ import annotations

import json

import pytest
import yaml
from _paths import ROOT
from _snakemake import job_counts, planned_jobs, snakemake

HUB = "results/gdn1.3b/drrqr_50/eval.json"
TINY = "results/tiny-dn/drrqr_50/eval.json"
BOTH_RATIOS = ROOT / "configs" / "both_ratios.yaml"
HUB_JOBS = {"base_source": 1, "qk_weights": 1, "calibrate": 1, "eval_baseline": 1, "select_channels": 1, "prune": 1,
            "rft": 1, "summarize": 1}
GPU_RULES = {"calibrate", "grad_scores", "eval_baseline", "prune", "rft", "rank_baseline", "rank", "speed",
             "speed_baseline"}


def _message_line(text: str, start: str) -> str:
    lines = [line for line in text.splitlines() if start in line]
    assert lines, text[-3000:]
    return lines[0]


@pytest.mark.parametrize("args", [
    [HUB, "--cores", "all", "--resources", "gpu=1", "-n"],
    ["--cores", "all", "--resources", "gpu=1", "-n", HUB],
    ["--cores", "all", "--resources", "gpu=1", "-n", "--", HUB],
], ids=["target-first", "target-last", "after-double-dash"])
def test_a_target_plans_with_options_before_or_after_it(tmp_path, args):
    out = snakemake(tmp_path, *args)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert job_counts(out.stdout + out.stderr) == HUB_JOBS


@pytest.mark.parametrize("args", [
    ["results/tiny-dn/foo_50/eval.json", "--cores", "all", "--resources", "gpu=1", "-n"],
    ["--cores", "all", "--resources", "gpu=1", "-n", "results/tiny-dn/foo_50/eval.json"],
    ["results/tiny-dn/foo_50/eval.json", "--profile", str(ROOT / "profiles" / "local"), "-n"],
], ids=["target-first", "target-last", "profile"])
def test_a_bad_target_fails_in_one_line_wherever_it_stands(tmp_path, args):
    out = snakemake(tmp_path, *args)
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert _message_line(text, "results/tiny-dn/foo_50/eval.json: ") == (
        "results/tiny-dn/foo_50/eval.json: unknown selector 'foo' in method token 'foo'; valid: drrqr, ghost, grad, "
        "l1, pca, pca-adv, rand, swanda")
    assert "Traceback" not in text and "Job stats" not in text


@pytest.mark.parametrize("args, option", [
    (["-n", "-R", "select_channels", "results/tiny-dn/select/drrqr_50.parquet"], "--forcerun"),
    (["-n", "--forcerun", "select_channels", "--until", "select_channels", "results/tiny-dn/drrqr_50/eval.json"],
     "--until"),
], ids=["forcerun", "until"])
def test_an_option_that_took_the_target_fails_in_one_line(tmp_path, args, option):
    out = snakemake(tmp_path, *args)
    text = out.stdout + out.stderr
    assert out.returncode != 0
    line = _message_line(text, "no target was given")
    assert line.startswith(f"no target was given: {option} read {args[-1]} as its own values")
    assert line.endswith(f"put the targets first: snakemake {args[-1]} {option} select_channels ...")
    assert "Job stats" not in text and "BUG" not in text


@pytest.mark.parametrize("args, last_line", [
    (["--cores", "all", "--resources", "gpu=1", HUB, "-n"],
     "ValueError: dictionary update sequence element #1 has length 1; 2 is required"),
    (["--configfile", str(BOTH_RATIOS), TINY, "-n"],
     f"FileNotFoundError: [Errno 2] No such file or directory: '{TINY}'"),
], ids=["resources", "configfile"])
def test_snakemake_itself_stops_on_a_target_after_an_option_of_several_values(tmp_path, args, last_line):
    """These two fail in Snakemake's own reading of the command line, before it reads the Snakefile, so nothing of
    the workflow can answer them (docs/workflow.md, "Targets first", quotes these last lines): pinned here, so that a
    Snakemake that reads them otherwise shows up. The spellings that work are tested beside it."""
    out = snakemake(tmp_path, *args, cwd=tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert text.strip().splitlines()[-1] == last_line, text[-2000:]
    assert "Snakefile" not in text and ".smk" not in text  # the workflow was never read


def test_a_built_target_after_configfile_fails_in_one_line(tmp_path):
    """Once the target exists, --configfile reads it as config (Snakemake merges any JSON or YAML file): the workflow
    says so before validating that config."""
    built = tmp_path / TINY
    built.parent.mkdir(parents=True)
    built.write_text(json.dumps({"model": "tiny-dn", "eval": {}}))
    out = snakemake(tmp_path, "--configfile", str(BOTH_RATIOS), TINY, "-n", cwd=tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert _message_line(text, "--configfile read") == (
        f"--configfile read {TINY} as config (it takes every path up to the next option): put the targets first, "
        f"snakemake {TINY} --configfile {BOTH_RATIOS} ..., or after --")
    assert "Traceback" not in text and "Job stats" not in text


@pytest.mark.parametrize("order", ["target-first", "after-double-dash"])
def test_a_target_with_an_overlay_plans_when_it_comes_first_or_after_double_dash(tmp_path, order):
    args = [TINY, "--configfile", str(BOTH_RATIOS), "-n"] if order == "target-first" else \
        ["--configfile", str(BOTH_RATIOS), "-n", "--", TINY]
    out = snakemake(tmp_path, *args, cwd=tmp_path)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert job_counts(out.stdout + out.stderr) == {
        "pretrain": 1, "qk_weights": 1, "calibrate": 1, "eval_baseline": 1, "select_channels": 1, "prune": 1,
        "rft": 1, "summarize": 1}


def test_an_option_after_double_dash_fails_in_one_line(tmp_path):
    """Every word after ``--`` is a target: ``-- <target> -n`` would plan a real run of ``-n``, a file no rule makes."""
    out = snakemake(tmp_path, "--cores", "all", "--resources", "gpu=1", "--", HUB, "-n")
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert _message_line(text, "stands after --") == (
        "-n stands after --, which makes every word after it a target: put the options before -- "
        "(snakemake --cores all -n -- <targets>)")
    assert "Job stats" not in text and "MissingRuleException" not in text


@pytest.mark.parametrize("target", [f"results/tiny-dn/drrqr_{p}/eval.json" for p in ("50.0", "050", "50.00")])
def test_a_ratio_spelled_otherwise_fails_in_one_line_naming_its_spelling(tmp_path, target):
    out = snakemake(tmp_path, target, "-n")
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert _message_line(text, f"{target}: ") == (
        f"{target}: pct '{target.split('_')[1].split('/')[0]}' is written '50' in paths (one spelling per ratio): "
        f"{TINY}")
    assert "Job stats" not in text


def test_a_hub_model_at_an_impossible_ratio_fails_in_one_line(tmp_path):
    target = "results/gdn1.3b/drrqr_99.9/eval.json"
    out = snakemake(tmp_path, target, "--resources", "gpu=1", "-n")
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert _message_line(text, f"{target}: ") == (
        f"{target}: model 'gdn1.3b' at pct 99.9: pct=99.9 removes every channel of d_k=256 (keeps 0); use a smaller "
        "pct")
    assert "Job stats" not in text


def _gpus(jobs: list[dict]) -> dict[str, str | None]:
    return {job["rule"]: job["resources"].get("gpu") for job in jobs}


@pytest.mark.parametrize("resources", [[], ["--resources", "gpu=0"]], ids=["no-gpu-resource", "gpu=0"])
def test_a_gpu_job_without_a_granted_gpu_stops_the_run_in_one_line(tmp_path, resources):
    out = snakemake(tmp_path, HUB, "-n", *resources)
    text = out.stdout + out.stderr
    assert out.returncode != 0
    line = _message_line(text, "needs 1 GPU")
    assert line.startswith("ResourceValidationError: rule ") and "(model=gdn1.3b" in line
    assert line.endswith("needs 1 GPU and this run was granted 0: give it the machine's GPUs with --resources gpu=N "
                         "(at most N GPU jobs then run at once), or run it under --profile profiles/slurm")
    assert not [job for job in planned_jobs(text) if job["rule"] in GPU_RULES]  # listed no GPU job


@pytest.mark.parametrize("granted", [1, 2])
def test_each_gpu_job_asks_for_its_gpus(tmp_path, granted):
    out = snakemake(tmp_path, HUB, "-n", "--resources", f"gpu={granted}")
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    gpus = _gpus(planned_jobs(out.stdout + out.stderr))
    assert gpus == {"base_source": None, "qk_weights": None, "select_channels": None, "summarize": None,
                    "calibrate": "1", "eval_baseline": "1", "prune": "1", "rft": "1"}


def test_a_job_of_several_gpus_needs_as_many_granted(tmp_path):
    """rft with ``rft.gpus: 2``: one granted GPU stops the run (Snakemake alone would run it on one); two plan it."""
    cfg = yaml.safe_load((ROOT / "config.yaml").read_text())
    cfg["models"]["gdn1.3b"].setdefault("rft", {})["gpus"] = 2
    out = snakemake(tmp_path, HUB, "-n", "--resources", "gpu=1", cfg=cfg)
    assert out.returncode != 0
    assert _message_line(out.stdout + out.stderr, "needs 2 GPUs").startswith(
        "ResourceValidationError: rule rft (model=gdn1.3b, method=drrqr, pct=50) needs 2 GPUs and this run was "
        "granted 1: ")
    out = snakemake(tmp_path, HUB, "-n", "--resources", "gpu=2", cfg=cfg)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert _gpus(planned_jobs(out.stdout + out.stderr))["rft"] == "2"


def test_cpu_models_need_no_gpu_resource(tmp_path):
    """The default target (the tiny CPU models) plans without ``--resources``: every job asks for 0 GPUs or none, and
    runs on one thread (a dry run caps threads at --cores, 1 unless given)."""
    out = snakemake(tmp_path, "-n", "--cores", "8")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    jobs = planned_jobs(text)
    assert len(jobs) == sum(job_counts(text).values()) > 100
    assert {job["resources"].get("gpu") for job in jobs} == {None, "0"}
    assert {job["threads"] for job in jobs} == {1}
