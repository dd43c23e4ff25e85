"""Running the workflow's ``snakemake`` command line in a test, and reading what a dry run plans.

:func:`snakemake` is the one way the tests start Snakemake: the repository's workflow with a config written into an
empty work directory, or a copy of the workflow (:func:`copy_workflow`) that the test changes and reruns. The
parsers read a dry run's text: :func:`job_counts` (its ``Job stats`` table), :func:`planned_jobs` (each job's rule,
wildcards, threads and resources) and :func:`job_outputs` (each rule's output files); :func:`dry_run_outputs` runs
a dry run and parses it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import _fresh as fresh
import yaml
from _paths import ROOT

COPY = ["Snakefile", "rules", "workflow_scripts", "statereduce", "schemas", "envs"]
"""What a copy of the workflow holds (:func:`copy_workflow`)."""


def copy_workflow(dest: Path, config: Path | None = None) -> Path:
    """Copy the workflow (:data:`COPY`, without ``__pycache__``) into ``dest`` (created if missing), with ``config``
    as its config.yaml if given; returns ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in COPY:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dest / name)
    if config is not None:
        shutil.copy2(config, dest / "config.yaml")
    return dest


def snakemake(
    workdir: Path,
    *args: str,
    cfg: dict | None = None,
    workflow: Path = ROOT,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    background: bool = False,
) -> subprocess.CompletedProcess | subprocess.Popen:
    """``snakemake -s <workflow>/Snakefile --directory workdir args`` run by this Python: ``args`` (targets and
    options) in the order given, the command line as a user types it, in a fresh process (a child of the session's
    Snakemake fork server, :mod:`_fresh`, which has imported Snakemake already).

    Args:
        workdir: the work directory; created if missing.
        *args: targets and options.
        cfg: written as ``workdir/config.yaml``. If None: the shipped config.yaml when ``workflow`` is the
            repository; a copy's work directory keeps the config.yaml it has.
        workflow: the folder whose Snakefile runs: the repository, or a copy made by :func:`copy_workflow`.
        cwd: the command's working directory; default: the repository for its own workflow, this process's for a copy.
        env: the command's environment; default: this process's.
        timeout: seconds before ``subprocess.TimeoutExpired`` (not with ``background``).
        background: start the command and return its ``Popen`` (stdout and stderr merged into one text pipe)
            instead of waiting for it.

    Returns:
        The finished process (stdout and stderr captured as text), or the running one with ``background``.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    if cfg is None and workflow == ROOT:
        cfg = yaml.safe_load((ROOT / "config.yaml").read_text())
    if cfg is not None:
        (workdir / "config.yaml").write_text(yaml.safe_dump(cfg))
    if cwd is None and workflow == ROOT:
        cwd = ROOT
    args = ["-m", "snakemake", "-s", str(workflow / "Snakefile"), "--directory", str(workdir), *args]
    if background:
        return subprocess.Popen([sys.executable, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    return fresh.run(args, preload=fresh.SNAKEMAKE, timeout=timeout, cwd=cwd, env=env)


def dry_run_outputs(workdir: Path, *args: str, cfg: dict | None = None) -> dict[str, list[str]]:
    """rule -> planned outputs (:func:`job_outputs`) of ``snakemake -n args`` with the repository's workflow and
    ``cfg`` (default: the shipped config) in ``workdir``; asserts that the dry run succeeds."""
    out = snakemake(workdir, "-n", *args, cfg=cfg)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    return job_outputs(out.stdout + out.stderr)


def job_counts(dry_run_output: str) -> dict[str, int]:
    """rule -> jobs, from the ``Job stats`` table a dry run prints (empty when it plans nothing)."""
    counts: dict[str, int] = {}
    lines = dry_run_output.splitlines()
    if "Job stats:" not in lines:
        return counts
    for line in lines[lines.index("Job stats:") + 3:]:
        rule, _, count = line.partition(" ")
        if rule == "total" or not count.strip().isdigit():
            break
        counts[rule] = int(count)
    return counts


def planned_jobs(dry_run_output: str) -> list[dict]:
    """The jobs a dry run lists: rule, wildcards (dict), threads (1 when not printed) and resources (dict)."""
    jobs: list[dict] = []
    for line in dry_run_output.splitlines():
        m = re.match(r"^(?:local)?rule (\w+):$", line.strip())
        if m:
            jobs.append({"rule": m.group(1), "wildcards": {}, "threads": 1, "resources": {}})
            continue
        m = re.match(r"^\s+(wildcards|threads|resources): (.*)$", line)
        if m and jobs:
            key, value = m.groups()
            if key == "threads":
                jobs[-1]["threads"] = int(value)
            else:
                jobs[-1][key] = dict(item.split("=", 1) for item in value.split(", "))
    return jobs


def job_outputs(dry_run_output: str) -> dict[str, list[str]]:
    """rule -> output files of the jobs listed in a dry run's output."""
    jobs: dict[str, list[str]] = {}
    rule = None
    for line in dry_run_output.splitlines():
        m = re.match(r"^(?:local)?rule (\w+):", line.strip())
        if m:
            rule = m.group(1)
            continue
        m = re.match(r"^\s*output: (.*)$", line)
        if m and rule:
            jobs.setdefault(rule, []).extend(s.strip() for s in m.group(1).split(","))
            rule = None
    return jobs
