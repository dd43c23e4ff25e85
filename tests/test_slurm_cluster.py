"""The workflow through ``profiles/slurm`` on a real one-node SLURM (munged, slurmctld, slurmd on 127.0.0.1).

Needs Debian's ``slurm-wlm`` and ``munge`` and root (``.ci/run`` installs them with apt); skipped otherwise. The
cluster has partitions ``cpu`` and ``gpu`` and one fake GPU (``gres.conf``: ``File=/dev/null``); without an
accounting database ``sacct`` fails, so the test profile asks the plugin to poll ``squeue``. Every daemon the
fixture starts is stopped by its PID.

1. A tiny DAG (pretrain, qk_weights, calibrate) runs as SLURM jobs, one of them asking for a GPU.
2. A job cancelled mid-run (``scancel``) fails the run without leaving a complete-looking output; rerunning the same
   command completes and the checkpoint loads.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from _paths import ROOT
from _snakemake import copy_workflow, snakemake

DAEMONS = ("munged", "slurmctld", "slurmd")

pytestmark = [pytest.mark.cluster, pytest.mark.skipif(
    not all(shutil.which(d) for d in (*DAEMONS, "sbatch", "squeue", "scancel", "srun")) or os.geteuid() != 0,
    reason="needs root and Debian's slurm-wlm and munge (apt-get install slurm-wlm munge)",
)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slurm_conf(root: Path, node: str, cpus: int) -> str:
    ctld, slurmd = _free_port(), _free_port()
    return f"""ClusterName=statereduce-test
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld}
SlurmdPort={slurmd}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
AuthInfo=socket={root}/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
GresTypes=gpu
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=8000 Gres=gpu:1 State=UNKNOWN
PartitionName=cpu Nodes={node} Default=YES MaxTime=INFINITE State=UP
PartitionName=gpu Nodes={node} MaxTime=INFINITE State=UP
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A running one-node SLURM; yields the environment for its clients (``SLURM_CONF``)."""
    root = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (root / sub).mkdir()
    node = socket.gethostname()
    (root / "slurm.conf").write_text(_slurm_conf(root, node, os.cpu_count() or 1))
    (root / "gres.conf").write_text(f"NodeName={node} Name=gpu File=/dev/null\n")
    (root / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")  # Slurm 22.05 wants one even without cgroups
    # snakemake-executor-plugin-slurm-jobstep drops SLURM_CONF (every SLURM_* but the job's identity) before the
    # nested srun of a job step; a real cluster's clients read /etc/slurm/slurm.conf instead. An srun shim first on
    # PATH (which the jobs inherit through sbatch --export=ALL) restores it for this test's cluster.
    shims = root / "bin"
    shims.mkdir()
    (shims / "srun").write_text(f"#!/bin/sh\nSLURM_CONF={root}/slurm.conf exec {shutil.which('srun')} \"$@\"\n")
    (shims / "srun").chmod(0o755)
    env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf"), "PATH": f"{shims}:{os.environ['PATH']}"}
    pid_files = {"munged": root / "munged.pid", "slurmctld": root / "slurmctld.pid", "slurmd": root / "slurmd.pid"}
    commands = {
        "munged": ["munged", "--force", f"--socket={root}/munge.socket", f"--pid-file={pid_files['munged']}",
                   f"--log-file={root}/munged.log", f"--seed-file={root}/munge.seed"],
        "slurmctld": ["slurmctld", "-f", str(root / "slurm.conf")],
        "slurmd": ["slurmd", "-f", str(root / "slurm.conf")],
    }
    try:
        for name in DAEMONS:
            subprocess.run(commands[name], env=env, check=True, capture_output=True, timeout=60)
            _wait(lambda: pid_files[name].is_file(), f"{name} did not start", 30)
        _wait(lambda: "idle" in subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True,
                                               text=True).stdout, "the node never became idle", 60)
        yield env
    finally:
        for name in reversed(DAEMONS):
            if pid_files[name].is_file():
                try:
                    os.kill(int(pid_files[name].read_text().split()[0]), signal.SIGTERM)
                except (ProcessLookupError, ValueError):
                    pass


def _wait(condition, message: str, seconds: float) -> None:
    end = time.time() + seconds
    while time.time() < end:
        if condition():
            return
        time.sleep(0.5)
    raise AssertionError(message)


def _workdir(path: Path) -> Path:
    """The workflow, the tests' tiny config and a test copy of profiles/slurm (small resources, squeue polling)."""
    copy_workflow(path, ROOT / "tests" / "workflow" / "config.yaml")
    profile = yaml.safe_load((ROOT / "profiles" / "slurm" / "config.yaml").read_text())
    profile["default-resources"].update({"mem_mb": 1000, "cpus_per_task": 1, "runtime": 30})
    for resources in profile["set-resources"].values():
        resources["mem_mb"] = 1000
    profile["set-resources"].setdefault("qk_weights", {})["gpu"] = 1  # one rule asks for the (fake) GPU
    profile.update({"slurm-status-command": "squeue", "slurm-init-seconds-before-status-checks": 2, "jobs": 2,
                    "latency-wait": 5})
    (path / "profile").mkdir()
    (path / "profile" / "config.yaml").write_text(yaml.safe_dump(profile))
    return path


def _snakemake(work: Path, env: dict, *targets: str, background: bool = False):
    """Snakemake on the workflow copy in ``work`` through its test profile, run in ``work``."""
    return snakemake(work, "--profile", "profile", *targets, workflow=work, cwd=work, env=env, timeout=900,
                     background=background)


def _jobs(env: dict) -> list[tuple[str, str, str]]:
    """(job id, name, state) of every job squeue knows."""
    out = subprocess.run(["squeue", "-h", "-o", "%i|%j|%T"], env=env, capture_output=True, text=True).stdout
    return [tuple(line.split("|")) for line in out.splitlines() if line]


def test_dag_runs_as_slurm_jobs_and_a_gpu_rule_gets_a_gpu(cluster, tmp_path):
    work = _workdir(tmp_path / "wf")
    target = "results/wf-dn/calib/default/activations.h5"
    run = _snakemake(work, cluster, target, "results/wf-dn/weights/qk.h5")
    text = run.stdout + run.stderr
    assert run.returncode == 0, text[-5000:]
    assert (work / target).is_file() and (work / "results/wf-dn/base/config.json").is_file()
    submitted = dict(re.findall(r"submitted with SLURM jobid (\d+) \(log: \S*/rule_(\w+)/", text))
    by_rule = {rule: job_id for job_id, rule in submitted.items()}
    assert set(by_rule) == {"pretrain", "qk_weights", "calibrate"}, text[-3000:]
    for rule, gpus in (("qk_weights", 1), ("pretrain", 0)):  # slurmctld keeps finished jobs for MinJobAge (300 s)
        job = subprocess.run(["scontrol", "show", "job", by_rule[rule]], env=cluster, capture_output=True,
                             text=True).stdout
        assert ("TresPerJob=gres:gpu:1" in job) == bool(gpus), job
    assert (work / "logs" / "pretrain" / "wf-dn.log").is_file()  # the job's own log where docs/cluster.md says


def test_cancelled_job_leaves_nothing_complete_and_a_rerun_finishes(cluster, tmp_path):
    work = _workdir(tmp_path / "wf")
    target = "results/wf-dn/base/config.json"
    proc = _snakemake(work, cluster, target, background=True)
    try:
        _wait(lambda: any(state == "RUNNING" for _, _, state in _jobs(cluster)), "no job started", 120)
        time.sleep(3)  # inside the job: the pretraining has begun
        for job_id, _, _ in _jobs(cluster):
            subprocess.run(["scancel", job_id], env=cluster, check=True)
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, output[-3000:]
    assert not (work / target).exists()  # written atomically: a cancelled pretrain leaves no checkpoint
    rerun = _snakemake(work, cluster, target)
    assert rerun.returncode == 0, (rerun.stdout + rerun.stderr)[-5000:]
    check = subprocess.run(
        [sys.executable, "-c", "import sys; from statereduce.core.models import load_model; load_model(sys.argv[1])",
         str(work / "results/wf-dn/base")], cwd=work, capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr[-3000:]
