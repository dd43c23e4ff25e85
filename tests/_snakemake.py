"""Running the workflow's ``snakemake`` command line in a test, and reading what a dry run plans."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def snakemake(workdir: Path, *args: str, cfg: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """``snakemake args`` of the repository's workflow in ``workdir``, in the order given (the command line as a user
    types it, after ``-s Snakefile --directory workdir``); ``cfg`` (default: the shipped config.yaml) becomes the
    work directory's config.yaml."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = yaml.safe_load((ROOT / "config.yaml").read_text()) if cfg is None else cfg
    (workdir / "config.yaml").write_text(yaml.safe_dump(config))
    cmd = [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "--directory", str(workdir), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


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
