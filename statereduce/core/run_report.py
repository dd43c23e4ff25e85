"""The report at the end of a workflow run: what it made, where each job's log lies, how long it took, and for a
failed run the failed jobs' logs with their last lines.

Everything comes from Snakemake's own log of the run (``.snakemake/log/<start>.snakemake.log``, the file the
workflow's ``onsuccess``/``onerror`` handlers receive as ``log``): its header (``Date:``, ``Python version:``,
``Command:``), each job's announcement (``rule x:`` with its ``output:``, ``log:``, ``jobid:``, ``benchmark:`` and
``wildcards:``), ``Finished jobid: N``, ``Error in rule x:`` blocks, the ``Job stats`` total, the progress lines
(``N of M steps (100%) done``) and time stamps, and, under the SLURM executor, where SLURM writes each job's output.
The requested targets (files, and the inputs of target rules) add the tables and figures they name. Snakemake calls
the handlers after real runs only: a dry run (``-n``) and a run with nothing to do print no report. :func:`report`
never raises: a report that cannot be made is one line saying why. :func:`newest_complete_log` and
:func:`job_seconds` read a finished run's log and benchmark files for its record (``dev/publish_run.py``).

Paths in the report are relative to the run's working directory, as the rules write them: ``logs/<rule>/...`` per
job, ``benchmarks/<rule>/...`` beside them (:mod:`statereduce.common.layout` for what lies under ``results/``).
"""

from __future__ import annotations

import csv
import datetime as dt
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from statereduce.common import layout

#: lines of each failed job's log that the report shows
TAIL_LINES = 20
#: at most this many paths are listed one by one in a line; more are grouped by folder
LIST_AT_MOST = 12
#: the first line of every report
HEADER = "Run summary (statereduce)"

_JOB = re.compile(r"^(?:local)?(?:rule|checkpoint) (\S+):$")
_ERROR = re.compile(r"^Error in rule (\S+):$")
_FIELD = re.compile(r"^\s+(\w+): (.*)$")
_FINISHED = re.compile(r"^Finished job(?:id)?:? (\d+)")
_TOTAL = re.compile(r"^total\s+(\d+)$")
_SLURM = re.compile(r"^Job (\d+) has been submitted with SLURM jobid \S+ \(log: (.+)\)\.$")
_DATE = re.compile(r"^\s*Date: (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)")
_COMMAND = re.compile(r"^\s*Command: (.*)$")
_PYTHON = re.compile(r"^\s*Python version: (\S+)")
_STEPS = re.compile(r"^(\d+) of (\d+) steps \(\d+%\) done")
_STAMP = re.compile(r"^\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]$")
_NAME = re.compile(r"^(\d{4}-\d\d-\d\dT\d{6}(?:\.\d+)?)\.snakemake\.log$")
_CHECK_LOG = " (check log file(s) for error details)"


@dataclass
class Job:
    """One job as Snakemake's log announces it (``rule x:`` and its indented fields)."""

    rule: str
    jobid: str | None = None
    outputs: list[str] = field(default_factory=list)
    logs: list[str] = field(default_factory=list)
    wildcards: str = ""
    benchmark: str | None = None


@dataclass
class RunLog:
    """What :func:`parse_log` reads from Snakemake's log of one run.

    Attributes:
        jobs: jobid -> the job as announced.
        finished: jobids of the jobs that finished, in order.
        failed: the ``Error in rule`` blocks (rule, jobid, log paths; outputs and wildcards from the announcement).
        total: the planned jobs (the ``Job stats`` total), None where the log has none.
        slurm_logs: jobid -> SLURM's output file of the job (SLURM executor only).
        started: the run's start (the log file's name, else its ``Date:`` line), None where neither says.
        ended: the last time stamp (``[Wed Dec  2 18:55:21 2026]``), None where the log has none.
        steps: (done, planned) of the last progress line, None where the log has none.
        command: the command line the run was started with (the header's ``Command:``).
        python: the version of the Python that ran Snakemake (the header's ``Python version:``).
    """

    jobs: dict[str, Job] = field(default_factory=dict)
    finished: list[str] = field(default_factory=list)
    failed: list[Job] = field(default_factory=list)
    total: int | None = None
    slurm_logs: dict[str, str] = field(default_factory=dict)
    started: dt.datetime | None = None
    ended: dt.datetime | None = None
    steps: tuple[int, int] | None = None
    command: str | None = None
    python: str | None = None

    @property
    def complete(self) -> bool:
        """Whether the last progress line says every planned job is done."""
        return self.steps is not None and self.steps[1] > 0 and self.steps[0] == self.steps[1]

    @property
    def wall_seconds(self) -> float | None:
        """From the start to the last time stamp; None where the log lacks either."""
        if self.started is None or self.ended is None:
            return None
        return max(0.0, (self.ended - self.started).total_seconds())


def _paths(value: str) -> list[str]:
    return [p.strip() for p in value.removesuffix(_CHECK_LOG).split(",") if p.strip()]


def parse_log(text: str, name: str = "") -> RunLog:
    """Read Snakemake's log of a run (module docstring); ``name`` is the log file's name (its start time)."""
    run = RunLog()
    block: Job | None = None  # the job announcement or error block whose indented fields follow

    def close() -> None:
        if block is not None and block.jobid is not None and not any(block is job for job in run.failed):
            run.jobs[block.jobid] = block

    for line in text.splitlines():
        m = _FIELD.match(line)
        if block is not None and m:
            key, value = m.groups()
            if key == "jobid":
                block.jobid = value.strip()
            elif key == "output":
                block.outputs = _paths(value)
            elif key == "log":
                block.logs = _paths(value)
            elif key == "wildcards":
                block.wildcards = value.strip()
            elif key == "benchmark":
                block.benchmark = value.strip()
            continue
        close()
        block = None
        if m := _JOB.match(line):
            block = Job(m.group(1))
        elif m := _ERROR.match(line):
            block = Job(m.group(1))
            run.failed.append(block)
        elif m := _FINISHED.match(line):
            run.finished.append(m.group(1))
        elif m := _TOTAL.match(line):
            run.total = int(m.group(1))
        elif m := _SLURM.match(line):
            run.slurm_logs[m.group(1)] = m.group(2)
        elif m := _STEPS.match(line):
            run.steps = int(m.group(1)), int(m.group(2))
        elif m := _STAMP.match(line):
            run.ended = dt.datetime.strptime(" ".join(m.group(1).split()), "%a %b %d %H:%M:%S %Y")
        elif run.started is None and (m := _DATE.match(line)):
            run.started = dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")
        elif run.command is None and (m := _COMMAND.match(line)):
            run.command = m.group(1).strip()
        elif run.python is None and (m := _PYTHON.match(line)):
            run.python = m.group(1)
    close()
    for job in run.failed:  # an error block names the log; the announcement has the wildcards
        seen = run.jobs.get(job.jobid or "")
        if seen is not None:
            job.wildcards = job.wildcards or seen.wildcards
            job.outputs = job.outputs or seen.outputs
            job.logs = job.logs or seen.logs
    if m := _NAME.match(name):
        run.started = dt.datetime.strptime(m.group(1), "%Y-%m-%dT%H%M%S.%f" if "." in m.group(1)
                                           else "%Y-%m-%dT%H%M%S")
    return run


def newest_complete_log(workdir: str | Path, rule: str) -> Path | None:
    """The newest Snakemake log under ``workdir``'s ``.snakemake/log/`` of a run that finished every job it planned
    (:attr:`RunLog.complete`) and ran a job of ``rule``; None where there is none."""
    for log in sorted((Path(workdir) / ".snakemake" / "log").glob("*.snakemake.log"), reverse=True):
        run = parse_log(log.read_text(errors="replace"), log.name)
        if run.complete and any(job.rule == rule for job in run.jobs.values()):
            return log
    return None


def benchmark_seconds(path: str | Path) -> float:
    """A job's wall seconds from its Snakemake benchmark file (a TSV whose column ``s`` is wall seconds; the mean of
    its rows where the rule repeats the job)."""
    with open(path, newline="") as f:
        rows = [float(row["s"]) for row in csv.DictReader(f, delimiter="\t")]
    if not rows:
        raise ValueError(f"{path}: no rows under its header")
    return sum(rows) / len(rows)


def job_seconds(run: RunLog, workdir: str | Path) -> dict[str, list[float]]:
    """rule -> the wall seconds of each of the run's finished jobs that names a benchmark file (read from
    ``workdir``); a job whose file is gone is left out."""
    out: dict[str, list[float]] = {}
    for jobid in dict.fromkeys(run.finished):
        job = run.jobs.get(jobid)
        if job is None or not job.benchmark or not (Path(workdir) / job.benchmark).is_file():
            continue
        out.setdefault(job.rule, []).append(benchmark_seconds(Path(workdir) / job.benchmark))
    return dict(sorted(out.items()))


def _jobs(n: int) -> str:
    return f"{n} job" if n == 1 else f"{n} jobs"


def format_seconds(seconds: float) -> str:
    """``17 s``, ``2 min 5 s``, ``1 h 2 min 3 s``."""
    s = max(0, int(round(seconds)))
    h, m, s = s // 3600, s // 60 % 60, s % 60
    return f"{h} h {m} min {s} s" if h else f"{m} min {s} s" if m else f"{s} s"


def _is_made(path: str) -> bool:
    return PurePosixPath(path).parts[:2] in (tuple(PurePosixPath(layout.TABLES).parts),
                                             tuple(PurePosixPath(layout.FIGURES).parts))


def _listed(paths: Sequence[str], indent: str = "    ") -> list[str]:
    """The paths one per line, or beyond :data:`LIST_AT_MOST` their folders with a count each."""
    if len(paths) <= LIST_AT_MOST:
        return [f"{indent}{p}" for p in paths]
    folders = Counter(str(PurePosixPath(p).parent) for p in paths)
    return [f"{indent}{folder}/ ({n})" for folder, n in sorted(folders.items())]


def _tail(path: Path, n: int) -> list[str]:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as e:
        return [f"(cannot be read: {e.strerror or e})"]
    return lines[-n:] if lines else ["(empty)"]


def summary(log_file: str | Path, targets: Iterable[str] = (), *, failed: bool, now: dt.datetime | None = None,
            tail: int = TAIL_LINES) -> str:
    """The end-of-run report of the run that ``log_file`` (Snakemake's log) records.

    Args:
        log_file: Snakemake's log of the run; the run's working directory is the folder above ``.snakemake/``.
        targets: the requested files (the inputs of target rules included), relative to the working directory.
        failed: whether the run failed (Snakemake's ``onerror``).
        now: the end of the run (default: now), for the wall time.
        tail: lines of each failed job's log to show.
    Returns:
        The report, several lines; "" when the run ran no job.
    """
    log_file = Path(log_file)
    run = parse_log(log_file.read_text(errors="replace"), log_file.name)
    workdir = log_file.parent.parent.parent if log_file.parent.parent.name == ".snakemake" else Path.cwd()
    if not run.finished and not run.failed:
        return ""
    wall = ""
    if run.started is not None:
        wall = f" in {format_seconds(((now or dt.datetime.now()) - run.started).total_seconds())}"
    finished = [run.jobs[j] for j in dict.fromkeys(run.finished) if j in run.jobs]
    rules = ", ".join(f"{rule} {n}" for rule, n in sorted(Counter(job.rule for job in finished).items()))
    n_done = len(dict.fromkeys(run.finished))
    if failed or run.failed:
        failures = f"{len(run.failed)} of {_jobs(run.total)}" if run.total else _jobs(len(run.failed))
        names = ", ".join(sorted({job.rule for job in run.failed})) or "Snakemake's messages above say which"
        lines = [f"{HEADER}: the run failed{wall}: {failures} failed ({names}), {n_done} finished"
                 + (f" ({rules})." if rules else ".")]
    else:
        lines = [f"{HEADER}: {_jobs(n_done)} finished{wall}" + (f": {rules}." if rules else ".")]

    written = [p for job in finished for p in job.outputs if _is_made(p)]
    requested = list(dict.fromkeys(str(t) for t in targets))
    made = list(dict.fromkeys(written + [t for t in requested if _is_made(t) and (workdir / t).is_file()]))
    if made:
        lines.append("  Tables and figures (* written by this run):")
        lines += _listed([f"{p}{' *' if p in written else ''}" for p in made])
    other = [t for t in requested if not _is_made(t)]
    if other:
        present = sum((workdir / t).exists() for t in other)
        lines.append(f"  Requested: {len(other)} file(s), {present} present")
        lines += _listed(other) if len(other) <= LIST_AT_MOST else []

    for job in run.failed:
        where = f" ({job.wildcards})" if job.wildcards else ""
        if not job.logs:
            lines.append(f"  Failed: rule {job.rule}{where}: it keeps no log; Snakemake's messages above say why.")
        for path in job.logs:
            lines.append(f"  Failed: rule {job.rule}{where}: log {path}, its last lines:")
            lines += [f"    | {line}" for line in _tail(workdir / path, tail)]
        if job.jobid in run.slurm_logs:
            lines.append(f"    SLURM's output of the job: {run.slurm_logs[job.jobid]}")

    logs = [p for job in finished for p in job.logs]
    lines.append("  Job logs: logs/<rule>/..., one per job, benchmarks/<rule>/... beside them"
                 + (f"; this run's {len(logs)}:" if logs else "."))
    lines += _listed(logs)
    lines.append(f"  Snakemake's log of this run: {_relative(log_file, workdir)}")
    return "\n".join(lines)


def _relative(path: Path, base: Path) -> str:
    try:
        return str(path.resolve().relative_to(base.resolve()))
    except ValueError:
        return str(path)


def report(log: str | Path | Sequence[str | Path] | None, targets: Iterable[str] = (), *, failed: bool,
           now: dt.datetime | None = None) -> str:
    """:func:`summary` of the run whose Snakemake log is ``log`` (the handlers' ``log``: a path or a list of them,
    the first taken), never raising: "" where Snakemake kept no log, one line where the report cannot be made."""
    try:
        if isinstance(log, (list, tuple)):
            log = log[0] if log else None
        if not log:
            return ""
        return summary(log, targets, failed=failed, now=now)
    except Exception as e:  # noqa: BLE001 - the report must never fail the run
        detail = " ".join(f"{type(e).__name__}: {e}".split())
        return f"{HEADER}: none ({detail[:300]})"
