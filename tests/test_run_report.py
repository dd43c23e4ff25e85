"""The report at the end of a run (statereduce.core.run_report, printed by rules/cli.smk's onsuccess/onerror handlers):
what the run made, where its jobs' logs lie, its wall time and, for a failed run, each failed job's log with its last
lines; read from Snakemake's own log of the run.

- On synthetic Snakemake logs written in Snakemake 9's format (finished, failed, under the SLURM executor): every
  line of the report, checked against the log by hand.
- Never in the way: no job ran -> no report; a log that cannot be read -> one line, never an exception.
- End to end (real Snakemake runs of the repository's workflow, one cheap job each): a finished run prints the
  report, a job that fails on a bad input (an empty weights file) prints its log's path and last lines; a dry run and
  a run with nothing to do print none.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest
import yaml
from _paths import ROOT
from _snakemake import snakemake

from statereduce.core import run_report
from statereduce.core.run_report import format_seconds, parse_log, report, summary

NAME = "2026-12-06T101500.250000.snakemake.log"
START = dt.datetime(2026, 12, 6, 10, 15, 0, 250000)

HEAD = """Assuming unrestricted shared filesystem usage.

SNAKEMAKE
=========
  Date: 2026-12-06 10:15:00
  Command: snakemake --cores 2 all_paper

Building DAG of jobs...
Job stats:
job                 count
----------------  -------
comparison_table        1
figures                 1
summarize               2
all_paper               1
total                   5

Select jobs to execute...
"""


def _job(rule: str, jobid: int, outputs: list[str], log: str | None, wildcards: str = "", local: bool = False) -> str:
    lines = [f"[Sun Dec  6 10:15:0{jobid} 2026]", f"{'local' if local else ''}rule {rule}:",
             "    input: results/x/in.json", f"    output: {', '.join(outputs)}"]
    if log:
        lines.append(f"    log: {log}")
    lines.append(f"    jobid: {jobid}")
    if wildcards:
        lines.append(f"    wildcards: {wildcards}")
    lines.append("    resources: tmpdir=/tmp")
    return "\n".join(lines) + "\n"


def _finished(jobid: int, rule: str) -> str:
    return f"[Sun Dec  6 10:16:0{jobid} 2026]\nFinished jobid: {jobid} (Rule: {rule})\n"


def _write(tmp_path: Path, text: str) -> Path:
    log = tmp_path / ".snakemake" / "log" / NAME
    log.parent.mkdir(parents=True)
    log.write_text(text)
    return log


FINISHED = (
    HEAD
    + _job("summarize", 3, ["results/m/drrqr_50/eval.json"], "logs/summarize/m/drrqr_50.log",
           "model=m, method=drrqr, pct=50")
    + _job("summarize", 4, ["results/m/l1_50/eval.json"], "logs/summarize/m/l1_50.log", "model=m, method=l1, pct=50")
    + _finished(3, "summarize") + "1 of 5 steps (20%) done\n" + _finished(4, "summarize")
    + _job("comparison_table", 2, ["results/tables/comparison.md", "results/tables/comparison.csv"],
           "logs/comparison_table.log", local=True)
    + _job("figures", 1, ["results/figures/m_utilization_50.png", "results/figures/m_spectrum_50.png"],
           "logs/figures/m_50.log", "model=m, pct=50")
    + _finished(2, "comparison_table") + _finished(1, "figures")
    + "[Sun Dec  6 10:16:09 2026]\nlocalrule all_paper:\n    input: results/tables/comparison.md\n    jobid: 0\n"
    + _finished(0, "all_paper") + "5 of 5 steps (100%) done\n"
)


def test_a_finished_run_lists_its_jobs_tables_figures_logs_and_wall_time(tmp_path):
    log = _write(tmp_path, FINISHED)
    (tmp_path / "results" / "tables").mkdir(parents=True)
    (tmp_path / "results" / "tables" / "rank_utilization.md").write_text("x")  # requested, made before this run
    targets = ["results/tables/comparison.md", "results/tables/rank_utilization.md", "results/tables/overlap.md",
               "results/m/drrqr_50/eval.json"]
    text = report([str(log)], targets, failed=False, now=START + dt.timedelta(seconds=75))
    assert text.splitlines() == [
        "Run summary (statereduce): 5 jobs finished in 1 min 15 s: all_paper 1, comparison_table 1, figures 1, "
        "summarize 2.",
        "  Tables and figures (* written by this run):",
        "    results/tables/comparison.md *",
        "    results/tables/comparison.csv *",
        "    results/figures/m_utilization_50.png *",
        "    results/figures/m_spectrum_50.png *",
        "    results/tables/rank_utilization.md",  # requested and present; overlap.md is missing: not listed
        "  Requested: 1 file(s), 0 present",
        "    results/m/drrqr_50/eval.json",
        "  Job logs: logs/<rule>/..., one per job, benchmarks/<rule>/... beside them; this run's 4:",
        "    logs/summarize/m/drrqr_50.log",
        "    logs/summarize/m/l1_50.log",
        "    logs/comparison_table.log",
        "    logs/figures/m_50.log",
        f"  Snakemake's log of this run: .snakemake/log/{NAME}",
    ]


def test_many_logs_are_grouped_by_folder(tmp_path):
    jobs = "".join(_job("rft", i, [f"results/m/s{i}_50/rft/eval.json"], f"logs/rft/m/s{i}_50.log", f"model=m")
                   + _finished(i, "rft") for i in range(1, 15))
    jobs += _job("prune", 20, ["results/m/a_50/pruned/eval.json"], "logs/prune/m/a_50.log") + _finished(20, "prune")
    text = report(_write(tmp_path, HEAD + jobs), failed=False, now=START + dt.timedelta(hours=1, minutes=2, seconds=3))
    lines = text.splitlines()
    assert lines[0] == "Run summary (statereduce): 15 jobs finished in 1 h 2 min 3 s: prune 1, rft 14."
    assert lines[1:4] == ["  Job logs: logs/<rule>/..., one per job, benchmarks/<rule>/... beside them; this run's 15:",
                          "    logs/prune/m/ (1)", "    logs/rft/m/ (14)"]


FAILED = (
    HEAD
    + _job("summarize", 3, ["results/m/drrqr_50/eval.json"], "logs/summarize/m/drrqr_50.log",
           "model=m, method=drrqr, pct=50")
    + "Job 3 has been submitted with SLURM jobid 4242 (log: /w/.snakemake/slurm_logs/rule_summarize/m/4242.log).\n"
    + _job("summarize", 4, ["results/m/l1_50/eval.json"], "logs/summarize/m/l1_50.log", "model=m, method=l1, pct=50")
    + _finished(4, "summarize")
    + "RuleException:\nCalledProcessError in file rules/evaluate.smk, line 40:\nCommand 'python x.py' returned "
      "non-zero exit status 1.\n[Sun Dec  6 10:16:05 2026]\nError in rule summarize:\n    message: None\n"
      "    jobid: 3\n    output: results/m/drrqr_50/eval.json\n"
      "    log: logs/summarize/m/drrqr_50.log (check log file(s) for error details)\n"
      "Shutting down, this might take some time.\nExiting because a job execution failed. Look above for error "
      "messages\n"
)


def test_a_failed_run_shows_each_failed_jobs_log_path_and_last_lines(tmp_path):
    log = _write(tmp_path, FAILED)
    job_log = tmp_path / "logs" / "summarize" / "m" / "drrqr_50.log"
    job_log.parent.mkdir(parents=True)
    job_log.write_text("".join(f"step {i}\n" for i in range(30)) + "ValueError: planted\n")
    text = summary(log, ["results/m/drrqr_50/eval.json"], failed=True, now=START + dt.timedelta(seconds=9), tail=3)
    assert text.splitlines() == [
        "Run summary (statereduce): the run failed in 9 s: 1 of 5 jobs failed (summarize), 1 finished (summarize 1).",
        "  Requested: 1 file(s), 0 present",
        "    results/m/drrqr_50/eval.json",
        "  Failed: rule summarize (model=m, method=drrqr, pct=50): log logs/summarize/m/drrqr_50.log, its last lines:",
        "    | step 28",
        "    | step 29",
        "    | ValueError: planted",
        "    SLURM's output of the job: /w/.snakemake/slurm_logs/rule_summarize/m/4242.log",
        "  Job logs: logs/<rule>/..., one per job, benchmarks/<rule>/... beside them; this run's 1:",
        "    logs/summarize/m/l1_50.log",
        f"  Snakemake's log of this run: .snakemake/log/{NAME}",
    ]
    assert report(log, failed=True).count("    | ") == run_report.TAIL_LINES  # the default: the last 20 lines
    job_log.unlink()
    assert "    | (cannot be read: No such file or directory)" in summary(log, failed=True).splitlines()


def test_the_log_is_parsed_into_jobs_finished_failed_and_the_start():
    run = parse_log(FAILED, NAME)
    assert run.started == START and run.total == 5 and run.finished == ["4"]
    assert {j: (job.rule, job.logs, job.wildcards) for j, job in run.jobs.items()} == {
        "3": ("summarize", ["logs/summarize/m/drrqr_50.log"], "model=m, method=drrqr, pct=50"),
        "4": ("summarize", ["logs/summarize/m/l1_50.log"], "model=m, method=l1, pct=50")}
    assert [(job.rule, job.jobid, job.logs) for job in run.failed] == [("summarize", "3",
                                                                         ["logs/summarize/m/drrqr_50.log"])]
    assert parse_log(FAILED).started == dt.datetime(2026, 12, 6, 10, 15)  # no file name: its Date line


def test_the_log_gives_the_command_progress_and_wall_time(tmp_path):
    run = parse_log(FINISHED, NAME)
    assert run.command == "snakemake --cores 2 all_paper" and run.steps == (5, 5) and run.complete
    assert run.ended == dt.datetime(2026, 12, 6, 10, 16, 0) and run.wall_seconds == 59.75  # the last time stamp
    failed = parse_log(FAILED, NAME)
    assert failed.steps is None and not failed.complete and failed.ended == dt.datetime(2026, 12, 6, 10, 16, 5)
    log = _write(tmp_path, FINISHED)
    _write(tmp_path / "later", FAILED).rename(log.with_name("2026-12-07T090000.snakemake.log"))
    assert run_report.newest_complete_log(tmp_path, "all_paper") == log  # the newer log's run failed
    assert run_report.newest_complete_log(tmp_path, "pretrain") is None


@pytest.mark.parametrize("seconds, text", [(0, "0 s"), (59.6, "1 min 0 s"), (3725, "1 h 2 min 5 s")])
def test_format_seconds(seconds, text):
    assert format_seconds(seconds) == text


def test_the_report_is_never_in_the_way(tmp_path, monkeypatch):
    """No job ran (a run stopped before any): nothing; no log kept: nothing; a report that cannot be made: one line."""
    assert report(_write(tmp_path, HEAD), failed=False) == ""
    assert report([], failed=False) == report(None, failed=True) == ""
    assert report(tmp_path / "missing.log", failed=True) == (
        f"Run summary (statereduce): none (FileNotFoundError: [Errno 2] No such file or directory: "
        f"'{tmp_path / 'missing.log'}')")

    def broken(*args, **kwargs):
        raise RuntimeError("a bug\nover two lines")

    monkeypatch.setattr(run_report, "summary", broken)  # a bug in the report: one line
    assert report(tmp_path / "x.log", failed=False) == ("Run summary (statereduce): none (RuntimeError: a bug over two "
                                                       "lines)")


# ---- end to end: the repository's workflow ----------------------------------------------------------------------
@pytest.fixture
def own_checkpoint_run(tmp_path) -> tuple[Path, dict]:
    """A work directory whose config (tests/workflow/config.yaml) adds model ``own``: a local checkpoint folder with a
    DeltaNet config.json and an empty weights file (enough for rule base_source; a bad input for any job that loads
    the model)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "delta_net", "hidden_size": 64, "num_heads": 2,
                                                  "num_hidden_layers": 2, "vocab_size": 300}))
    (ckpt / "model.safetensors").write_bytes(b"")
    cfg = yaml.safe_load((ROOT / "tests" / "workflow" / "config.yaml").read_text())
    cfg["models"]["own"] = {"family": "delta_net", "local": str(ckpt), "calibration": {"corpus": "embedded"}}
    return tmp_path / "work", cfg


def _report_of(output: str) -> list[str]:
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(run_report.HEADER))
    end = next(i for i in range(start + 1, len(lines)) if not lines[i].startswith(" "))
    return lines[start:end]


@pytest.mark.slow  # default tier under 3 min: a child process or a whole run; .ci/run runs it
def test_a_real_run_prints_the_report_and_a_failed_job_its_log(own_checkpoint_run):
    work, cfg = own_checkpoint_run
    done = snakemake(work, "results/own/base/source.json", "--cores", "1", cfg=cfg)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-3000:]
    lines = _report_of(text)
    assert lines[0].startswith("Run summary (statereduce): 1 job finished in ") and lines[0].endswith(
        " s: base_source 1."), lines
    (snakemake_log,) = (work / ".snakemake" / "log").glob("*.snakemake.log")
    assert lines[1:] == [
        "  Requested: 1 file(s), 1 present",
        "    results/own/base/source.json",
        "  Job logs: logs/<rule>/..., one per job, benchmarks/<rule>/... beside them; this run's 1:",
        "    logs/base_source/own.log",
        f"  Snakemake's log of this run: .snakemake/log/{snakemake_log.name}",
    ]
    assert (work / "logs" / "base_source" / "own.log").is_file()

    for quiet in (["-n"], []):  # a dry run, and a run with nothing to do: no report
        again = snakemake(work, "results/own/base/source.json", "--cores", "1", *quiet, cfg=cfg)
        assert again.returncode == 0 and run_report.HEADER not in again.stdout + again.stderr

    failed = snakemake(work, "results/own/weights/qk.h5", "--cores", "1", cfg=cfg)
    text = failed.stdout + failed.stderr
    assert failed.returncode != 0, text[-3000:]
    lines = _report_of(text)
    assert lines[0].startswith("Run summary (statereduce): the run failed in ") and lines[0].endswith(
        " s: 1 of 1 job failed (qk_weights), 0 finished."), lines
    assert "  Failed: rule qk_weights (model=own): log logs/qk_weights/own.log, its last lines:" in lines
    job_log = (work / "logs" / "qk_weights" / "own.log").read_text().splitlines()
    shown = [line.removeprefix("    | ") for line in lines if line.startswith("    | ")]
    assert shown == job_log[-run_report.TAIL_LINES:] and "safetensors" in "\n".join(shown).lower(), shown
