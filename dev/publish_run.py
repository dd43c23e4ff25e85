"""Record a finished default run for the README: ``docs/results/default_run/{comparison.md,run.json}``.

    python dev/publish_run.py [--run-dir .] [--out docs/results/default_run] [--log SNAKEMAKE_LOG]

RUN_DIR is the working directory of a finished ``snakemake --cores all``. The record holds

* ``comparison.md``: a copy of the run's ``results/tables/comparison.md``;
* ``run.json``: the CPU kind the evaluations recorded (``versions.cpu``, from the table's ``Made on`` line) with
  torch's CPU capability, the Python that ran Snakemake, the command, the jobs and the wall time (start to the last
  time stamp), the run's start, the commit checked out in RUN_DIR, Snakemake's log's name, and per rule its jobs'
  count, total and mean wall seconds (from the benchmark file each finished job names, ``benchmarks/<rule>/...tsv``).

Everything but the commit comes from the run's files: Snakemake's log of the run (``--log``; default: the newest
log under ``.snakemake/log/`` of a run that finished every job and trained the models) is read by
:mod:`statereduce.core.run_report`. The folder is written whole or not at all (a temporary sibling renamed into
place). ``python dev/readme_blocks.py`` renders README's ``results`` block from it.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the package of this checkout, also where it is not installed

from statereduce.analysis.tables import parse_made_on  # noqa: E402
from statereduce.common import layout  # noqa: E402
from statereduce.core import run_report  # noqa: E402
from statereduce.core.runtime import atomic_dir  # noqa: E402

COMPARISON = Path(layout.table("comparison", "md"))
OUT = ROOT / "docs" / "results" / "default_run"
#: A run that ran this rule trained the models: the default run, not a later partial one.
TRAINING_RULE = "pretrain"


class Refused(Exception):
    """The run directory cannot give a record (the message says why, in one line)."""


def git_commit(folder: Path) -> str | None:
    """``git rev-parse HEAD`` of ``folder``, or None where it is no git checkout."""
    try:
        out = subprocess.run(["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True)
    except OSError:
        return None
    return out.stdout.strip() or None


def _command(command: str | None) -> str | None:
    """The run's command line without the program's folder; ``python -m snakemake`` (whose argv[0] is snakemake's
    ``__main__.py``, as ``dev/recall_check.py --run`` starts it) reads as ``snakemake``."""
    if not command:
        return None
    return re.sub(r"^\S*/", "", command).replace("__main__.py", "snakemake", 1)


def run_record(run_dir: Path, comparison: str, log: Path) -> dict:
    """``run.json`` of the run in ``run_dir`` whose table is ``comparison`` and whose Snakemake log is ``log``."""
    made = parse_made_on(comparison)
    if made is None or len(made[0]) != 1:
        named = "no 'Made on' line" if made is None else f"the CPU kinds {made[0] or 'none'}"
        raise Refused(f"{COMPARISON} has {named}: a default run is recorded with the one CPU kind it ran on")
    run = run_report.parse_log(log.read_text(errors="replace"), log.name)
    if not run.complete:
        done = f"{run.steps[0]} of {run.steps[1]} steps" if run.steps else "no progress line"
        raise Refused(f"{log} records no finished run ({done})")
    if run.wall_seconds is None:
        raise Refused(f"{log} has no start or no time stamp: no wall time")
    rules = {rule: {"jobs": len(s), "seconds": round(sum(s), 1), "mean_seconds": round(sum(s) / len(s), 2)}
             for rule, s in run_report.job_seconds(run, run_dir).items()}
    return {
        "cpu": made[0][0],
        "torch_cpu_capability": made[1],
        "python": run.python,
        "jobs": run.steps[1],
        "wall_seconds": round(run.wall_seconds, 1),
        "date": run.started.isoformat(timespec="seconds"),
        "command": _command(run.command),
        "commit": git_commit(run_dir),
        "snakemake_log": log.name,
        "rules": rules,
    }


def publish(run_dir: Path, out: Path, log: Path | None = None) -> dict:
    """Write ``comparison.md`` and ``run.json`` of the run in ``run_dir`` to the folder ``out`` (replaced whole);
    returns the record. Raises :class:`Refused` where the run directory cannot give one."""
    table = run_dir / COMPARISON
    if not table.is_file():
        raise Refused(f"{run_dir} has no {COMPARISON}: not a finished default run (`snakemake --cores all` makes it)")
    if log is None:
        log = run_report.newest_complete_log(run_dir, TRAINING_RULE)
        if log is None:
            raise Refused(f"{run_dir} has no Snakemake log of a finished run that trained the models "
                          "(.snakemake/log/; --log names one)")
    elif not log.is_file():
        raise Refused(f"no Snakemake log {log}")
    text = table.read_text()
    record = run_record(run_dir, text, log)
    with atomic_dir(out) as tmp:
        shutil.copyfile(table, tmp / "comparison.md")
        (tmp / "run.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", type=Path, default=Path("."), help="the finished run's working directory")
    ap.add_argument("--out", type=Path, default=OUT, help="the record's folder (replaced whole)")
    ap.add_argument("--log", type=Path, help="Snakemake's log of the run (default: the newest complete one that "
                    "trained the models)")
    args = ap.parse_args(argv)
    try:
        record = publish(args.run_dir, args.out, args.log)
    except Refused as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}/comparison.md and run.json: {record['cpu']}, {record['jobs']} jobs in "
          f"{run_report.format_seconds(record['wall_seconds'])} ({record['snakemake_log']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
