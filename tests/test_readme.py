"""README's generated blocks (dev/readme_blocks.py) and the default run's record they come from (dev/publish_run.py).

- publish_run turns a run directory (its comparison table, Snakemake's log, the benchmark files the log's jobs name)
  into ``docs/results/default_run/{comparison.md,run.json}``, replacing the folder whole, and refuses in one line a
  directory without a comparison table or without a finished run's log.
- On planted sources the generator fills every block between its markers; ``--check`` fails in one line naming the
  block where a number or the run time was changed by hand, a source is missing, or the ``results`` and ``recipe``
  blocks come from different kinds of CPU.
- On a finished default run of this checkout, the recorded run is its table, where this machine is the kind of CPU
  that the record names.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from statereduce.analysis.tables import parse_made_on, torch_cpu_capability, write_comparison
from statereduce.core.runtime import cpu_kind

ROOT = Path(__file__).resolve().parents[1]


def _dev_module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "dev" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


rb = _dev_module("readme_blocks")
publish_run = _dev_module("publish_run")
NAMES = ("results", "install", "hub-cost", "recipe", "compensation")
README = "# x\n\nProse stays.\n\n" + "".join(
    f"<!-- generated:{n} -->\n(placeholder)\n<!-- /generated:{n} -->\n\nMore prose about {n}.\n\n" for n in NAMES)
LOG_NAME = "2026-12-02T184400.000000.snakemake.log"
BENCH_HEADER = "s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\n"


def _levels(a4: float, a8: float) -> dict:
    return {f"recall_mqar_{k}": {"acc": a, "acc_stderr": math.sqrt(a * (1 - a) / 99)} for k, a in ((4, a4), (8, a8))}


def _doc(bpb: float, a4: float, a8: float) -> tuple[dict, dict]:
    metrics = {"heldout": {"bits_per_byte": bpb, "word_perplexity": 8.1e7}, **_levels(a4, a8)}
    return metrics, {"recall_probe": {"recall_mqar_avg": (a4 + a8) / 2}}


def _job(stamp: str, rule: str, jobid: int, benchmark: str | None, local: bool = False) -> str:
    lines = [f"[Wed Dec  2 {stamp} 2026]", f"{'local' if local else ''}rule {rule}:",
             f"    output: results/{rule}/{jobid}.json", f"    log: logs/{rule}/{jobid}.log", f"    jobid: {jobid}"]
    if benchmark:
        lines.append(f"    benchmark: {benchmark}")
    return "\n".join(lines + ["    resources: tmpdir=/tmp", ""])


def _snakemake_log(done: int = 4) -> str:
    """Snakemake 9's log of a default run of 4 jobs: two pretrain jobs, a summarize job, the target rule."""
    return ("Assuming unrestricted shared filesystem usage.\n\nSNAKEMAKE\n=========\n  Date: 2026-12-02 18:44:00\n"
            "  Python version: 3.11.7 (main, Dec  4 2023, 18:10:11) [GCC 11.4.0]\n"
            "  Command: /home/u/statereduce/.venv/bin/snakemake --cores all\n\nBuilding DAG of jobs...\n"
            + _job("18:44:02", "pretrain", 2, "benchmarks/pretrain/tiny-dn.tsv")
            + _job("18:44:02", "pretrain", 3, "benchmarks/pretrain/tiny-gdn.tsv")
            + "[Wed Dec  2 18:49:03 2026]\nFinished jobid: 2 (Rule: pretrain)\n1 of 4 steps (25%) done\n"
            + "[Wed Dec  2 18:49:04 2026]\nFinished jobid: 3 (Rule: pretrain)\n2 of 4 steps (50%) done\n"
            + _job("18:49:05", "summarize", 1, "benchmarks/summarize/tiny-dn/drrqr_50.tsv")
            + "[Wed Dec  2 18:55:19 2026]\nFinished jobid: 1 (Rule: summarize)\n3 of 4 steps (75%) done\n"
            + (_job("18:55:20", "all", 0, None, local=True)
               + "[Wed Dec  2 18:55:21 2026]\nFinished jobid: 0 (Rule: all)\n4 of 4 steps (100%) done\n"
               if done == 4 else ""))


def _plant_run(run: Path, cpu: str) -> None:
    """A finished default run's working directory: its comparison table (two models, two methods), Snakemake's log
    and the benchmark files of its jobs, and one of an earlier run that this run's log does not name."""
    prov = {"versions": {"cpu": cpu}}
    base_m, base_s = _doc(3.535, 0.63, 0.47)
    baselines, summaries = {}, []
    for i, model in enumerate(("tiny-dn", "tiny-gdn")):
        baselines[model] = {"metrics": base_m, "suites": base_s, "state": {"state_bytes_per_sequence": 8},
                            "provenance": prov}
        for j, method in enumerate(("drrqr", "rand")):
            (pm, ps), (rm, rs) = _doc(3.6 + i + j, 0.5, 0.4), _doc(3.55 + i + j, 0.52, 0.41)
            summaries.append({
                "model": model, "method": method, "pct": 50.0, "state": {"bytes_after": 4},
                "metrics": {"baseline": base_m, "pruned": pm, "rft": rm},
                "suites": {"baseline": base_s, "pruned": ps, "rft": rs},
                "provenance": {"versions": {"cpu": cpu}, "evals": {"pruned": prov, "rft": prov}},
                "rft": {"steps": 16, "kept_step": 12 - 4 * j, "val_loss_start": 2.45, "val_loss_kept": 2.40,
                        "curve": [[0, 2.45], [12, 2.40]]},
            })
    tables = run / "results" / "tables"
    tables.mkdir(parents=True)
    write_comparison(summaries, baselines, tables / "comparison.md", tables / "comparison.csv")
    log = run / ".snakemake" / "log" / LOG_NAME
    log.parent.mkdir(parents=True)
    log.write_text(_snakemake_log())
    bench = run / "benchmarks"
    for rel, rows in (("pretrain/tiny-dn.tsv", ["300.5"]), ("pretrain/tiny-gdn.tsv", ["250.3"]),
                      ("summarize/tiny-dn/drrqr_50.tsv", ["11.0", "13.0"]),  # a rule with `repeat`: two rows
                      ("speed/tiny-dn.tsv", ["99.0"])):  # an earlier run's job
        (bench / rel).parent.mkdir(parents=True, exist_ok=True)
        (bench / rel).write_text(BENCH_HEADER + "".join(f"{s}\t0:00:00\t1\t1\t1\t1\t0\t0\t0.5\t1.0\n"
                                                        for s in rows))


def _plant_other(root: Path) -> None:
    results = root / "docs" / "results"
    results.mkdir(parents=True, exist_ok=True)
    pkgs = [{"name": "torch", "version": "2.13.0", "file": "torch.whl", "bytes": 900_000_000},
            {"name": "nvidia-cudnn-cu13", "version": "9.1", "file": "n.whl", "bytes": 700_000_000},
            {"name": "numpy", "version": "2.5.2", "file": "np.whl", "bytes": 16_500_000}]
    (results / "install_size.json").write_text(json.dumps({
        "command": "python dev/install_size.py", "date": "2026-12-02", "platform": "Linux x86_64",
        "python": "3.11.7", "packages": pkgs, "total_bytes": sum(p["bytes"] for p in pkgs),
        "variants": {"https://example.org/cpu": {"error": "LookupError: not reachable"}}}))
    run = results / "paper_scale_h200"
    run.mkdir()
    jobs = [{"job": f"{rule}/dn1.3b-init/{cell}", "seconds": s, "host_rss_mib": 1.0, "gpu_gib": g,
             "gpu_reserved_gib": g} for rule, cell, s, g in
            (("calibrate", "default", 64.1, 3.1), ("prune", "grad_50", 29.5, 4.34), ("prune", "l1_50", 39.7, 4.34),
             ("rft", "grad_50", 42.1, 116.25))]
    (run / "jobs.json").write_text(json.dumps(jobs))
    (run / "sizes.tsv").write_text("2731397520\tresults/dn1.3b-init/base/model.safetensors\n"
                                   "834752\tresults/dn1.3b-init/calib/default/grad_scores.h5\n")
    (run / "rft.json").write_text(json.dumps({"dn1.3b-init/grad_50": {"steps": 8, "steady_tokens_per_s": 36130.0}}))


def _plant_recipe(root: Path, cpu: str) -> None:
    recipe = root / "docs" / "experiments" / "recipe"
    recipe.mkdir(parents=True, exist_ok=True)
    (recipe / "summary.md").write_text(f"| recipe | bits/byte |\n| --- | --- |\n| drrqr@sens | 3.141 |\n\nOn {cpu}; "
                                       "[docs/experiments/recipe](README.md).\n")
    (recipe / "results.csv").write_text(f"model,pct,method,loss_bpb,cpu\ntiny-dn,75.0,drrqr@sens,0.02,{cpu}\n"
                                        f"tiny-gdn,75.0,drrqr@sens,0.07,{cpu}\n")


def _plant_compensation(root: Path) -> None:
    folder = root / "docs" / "experiments" / "compensation"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "goal.md").write_text("| model | pct | `drrqr@sens` | best new cell |\n| --- | ---: | ---: | --- |\n"
                                    "| tiny-dn | 75 | 0.0154 | `drrqr@sens+fit` |\n")


@pytest.fixture
def planted(tmp_path):
    """A checkout with every block's source (the default run published from a planted run directory; the recipe
    on this machine's kind of CPU) and a README of placeholders."""
    root = tmp_path / "checkout"
    _plant_run(tmp_path / "run", cpu_kind())
    publish_run.publish(tmp_path / "run", root / rb.DEFAULT_RUN)
    _plant_other(root)
    _plant_recipe(root, cpu_kind())
    _plant_compensation(root)
    (root / "README.md").write_text(README)
    return root


def _run(root: Path, *args: str) -> int:
    return rb.main(["--root", str(root), "--readme", str(root / "README.md"), *args])


def _lines(capsys) -> list[str]:
    return capsys.readouterr().out.splitlines()


# ---- publish_run ----------------------------------------------------------------------------------------------------
def test_publish_records_the_run_from_its_table_log_and_benchmarks(tmp_path):
    run, out = tmp_path / "run", tmp_path / "record"
    _plant_run(run, cpu_kind())
    git = ["git", "-C", str(run), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q", str(run)], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "x"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    out.mkdir()
    (out / "stale.txt").write_text("from an earlier record")

    assert publish_run.main(["--run-dir", str(run), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["comparison.md", "run.json"]  # replaced whole
    assert not list(tmp_path.glob(".record*"))  # no temporary folder left beside it
    assert (out / "comparison.md").read_text() == (run / "results/tables/comparison.md").read_text()
    assert json.loads((out / "run.json").read_text()) == {
        "cpu": cpu_kind(), "torch_cpu_capability": torch_cpu_capability(), "python": "3.11.7", "jobs": 4,
        "wall_seconds": 681.0, "date": "2026-12-02T18:44:00", "command": "snakemake --cores all", "commit": head,
        "snakemake_log": LOG_NAME,
        "rules": {"pretrain": {"jobs": 2, "seconds": 550.8, "mean_seconds": 275.4},  # speed/: not this run's job
                  "summarize": {"jobs": 1, "seconds": 12.0, "mean_seconds": 12.0}}}

    # the README's results block names the commit and the run time of the record
    root = tmp_path / "checkout"
    publish_run.publish(run, root / rb.DEFAULT_RUN)
    assert (f"Run time: `snakemake --cores all` ran 4 jobs in 11 min 21 s on 2026-12-02, commit {head[:7]}, "
            "Python 3.11.7 (`docs/results/default_run/run.json`).") in rb.render_results(root)


def test_publish_refuses_a_run_without_a_table_or_a_finished_log(tmp_path, capsys):
    run, out = tmp_path / "run", tmp_path / "record"
    _plant_run(run, cpu_kind())
    out.mkdir()
    (out / "run.json").write_text("{}")
    (run / "results/tables/comparison.md").rename(run / "elsewhere.md")
    assert publish_run.main(["--run-dir", str(run), "--out", str(out)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [f"error: {run} has no results/tables/comparison.md: not a finished default run "
                   "(`snakemake --cores all` makes it)"]
    assert [p.name for p in out.iterdir()] == ["run.json"]  # the earlier record stays as it was

    (run / "elsewhere.md").rename(run / "results/tables/comparison.md")
    log = run / ".snakemake" / "log" / LOG_NAME
    log.write_text(_snakemake_log(done=3))
    assert publish_run.main(["--run-dir", str(run), "--out", str(out)]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"error: {run} has no Snakemake log of a finished run that trained the models (.snakemake/log/; --log "
        "names one)"]
    assert publish_run.main(["--run-dir", str(run), "--out", str(out), "--log", str(log)]) == 1
    assert capsys.readouterr().err.splitlines() == [f"error: {log} records no finished run (3 of 4 steps)"]
    assert (out / "run.json").read_text() == "{}"


# ---- readme_blocks --------------------------------------------------------------------------------------------------
def test_generator_fills_blocks_and_check_names_a_changed_number(planted, capsys):
    assert _run(planted, "--check") == 1  # placeholders differ from their sources
    first = _lines(capsys)[0]
    assert first.startswith("results: README's block differs from what docs/results/default_run/ renders: line 1: "
                            "README has '(placeholder)', the source gives 'From `docs/results/default_run/comparison"
                            ".md`, made on ")
    assert first.endswith("…' (python dev/readme_blocks.py results rewrites it)")
    assert _run(planted) == 0
    text = (planted / "README.md").read_text()
    assert "(placeholder)" not in text and "Prose stays." in text
    assert all(f"More prose about {n}." in text for n in NAMES)
    results = rb.block_text(text, "results")
    cap = torch_cpu_capability()
    assert results.startswith(f"From `docs/results/default_run/comparison.md`, made on {cpu_kind()}"
                              + (f", torch CPU capability {cap}." if cap else "."))
    assert "| drrqr | 3.600 → 3.550 | 4.600 → 4.550 |" in results  # bits/byte pre → post, from the overview
    assert "0.450 ± 0.035 → 0.465 ± 0.035" in results  # recall with its standard error
    assert "12 of 16 (2.450 → 2.400)" in results and "8 of 16 (2.450 → 2.400)" in results  # the step RFT kept
    assert "81" not in results.replace("0.81", "")  # the held-out word perplexity stays out
    assert ("Run time: `snakemake --cores all` ran 4 jobs in 11 min 21 s on 2026-12-02, Python 3.11.7 "
            "(`docs/results/default_run/run.json`).") in results
    install = rb.block_text(text, "install")
    assert "3 packages, **1.6 GB** to download" in install and "torch 2.13.0 900 MB" in install
    assert "not measured (LookupError: not reachable)" in install
    hub = rb.block_text(text, "hub-cost")
    assert "| prune + evaluate | 30-40 | 4.3 |" in hub and "| RFT (8 steps) + evaluate | 42 | 116.2 |" in hub
    assert "| base checkpoint (bf16) | 2.7 GB |" in hub and "36,130 tokens/s" in hub
    assert "at these rates: 30 min" in hub  # 32,000 × 2048 tokens at 36,130 tokens/s
    assert rb.block_text(text, "recipe") == (f"| recipe | bits/byte |\n| --- | --- |\n| drrqr@sens | 3.141 |\n\n"
                                             f"On {cpu_kind()}; [docs/experiments/recipe](docs/experiments/recipe/"
                                             "README.md).\n")
    capsys.readouterr()

    assert _run(planted, "--check") == 0 and _lines(capsys) == []
    assert _run(planted) == 0 and (planted / "README.md").read_text() == text  # idempotent

    # nothing is left out of the comparison: a changed number or run time fails, naming its block in one line
    (planted / "README.md").write_text(text.replace("4.600 → 4.550", "4.600 → 4.551"))
    capsys.readouterr()
    assert _run(planted, "--check") == 1
    assert _lines(capsys) == ["results: README's block differs from what docs/results/default_run/ renders: "
                              "line 10: README has '…3.550 | 4.600 → 4.551 |', the source gives "
                              "'…3.550 | 4.600 → 4.550 |' (python dev/readme_blocks.py results rewrites it)"]
    (planted / "README.md").write_text(text.replace("11 min 21 s", "12 min 2 s"))
    assert _run(planted, "--check") == 1 and _lines(capsys)[0].startswith("results: README's block differs")
    (planted / "README.md").write_text(text.replace("36,130", "36,131"))
    assert _run(planted, "--check") == 1 and _lines(capsys)[0].startswith("hub-cost: README's block differs")
    (planted / "README.md").write_text(text.replace("\n<!-- /generated:recipe -->", "\n\n<!-- /generated:recipe -->"))
    assert _run(planted, "--check") == 1  # a blank line too many counts too
    assert _lines(capsys) == ["recipe: README's block differs from what docs/experiments/recipe/summary.md renders: "
                              "README's block has more lines from line 7 (python dev/readme_blocks.py recipe "
                              "rewrites it)"]


@pytest.mark.parametrize("path, message", [
    ("docs/results/default_run/comparison.md",
     "results: source missing: no docs/results/default_run/comparison.md (`snakemake --cores all`, then `python "
     "dev/publish_run.py` records it); block left as it is"),
    ("docs/results/default_run/run.json",
     "results: source missing: no docs/results/default_run/run.json (`snakemake --cores all`, then `python "
     "dev/publish_run.py` records it); block left as it is"),
    ("docs/experiments/recipe/summary.md",
     "recipe: source missing: no docs/experiments/recipe/summary.md (python docs/experiments/recipe/table.py writes "
     "it); block left as it is"),
    ("docs/experiments/recipe/results.csv",
     "recipe: source missing: no docs/experiments/recipe/results.csv (python docs/experiments/recipe/table.py writes "
     "it beside summary.md); block left as it is"),
], ids=["default-run-table", "default-run-record", "recipe-summary", "recipe-csv"])
def test_a_missing_source_fails_and_leaves_its_block(planted, capsys, path, message):
    assert _run(planted) == 0
    text = (planted / "README.md").read_text()
    (planted / path).unlink()
    capsys.readouterr()
    assert _run(planted, "--check") == 1
    assert _lines(capsys) == [message]
    assert _run(planted) == 1 and message in _lines(capsys)
    assert (planted / "README.md").read_text() == text


def test_results_and_recipe_of_different_cpus_fail(planted, capsys):
    _plant_recipe(planted, "Other CPU (AVX2)")
    assert _run(planted) == 1  # the blocks are written, and the mismatch named
    mismatch = (f"recipe: made on Other CPU (AVX2) (docs/experiments/recipe/results.csv), the results block on "
                f"{cpu_kind()} (docs/results/default_run/run.json): README's numbers come from one kind of CPU "
                "(rerun one of them on the other's kind)")
    assert _lines(capsys)[-1] == mismatch
    assert "On Other CPU (AVX2);" in rb.block_text((planted / "README.md").read_text(), "recipe")
    assert _run(planted, "--check") == 1 and _lines(capsys) == [mismatch]
    assert _run(planted, "--check", "recipe") == 0  # one block alone: nothing to compare it with
    _plant_recipe(planted, cpu_kind())
    assert _run(planted) == 0 and _run(planted, "--check") == 0


def test_sources_that_disagree_with_themselves_fail(planted, capsys):
    assert _run(planted) == 0
    (planted / "docs/experiments/recipe/summary.md").write_text("| recipe | bits/byte |\n")  # names no CPU
    record = planted / rb.RUN_JSON
    doc = json.loads(record.read_text())
    record.write_text(json.dumps({**doc, "cpu": "Other CPU (AVX2)"}))
    capsys.readouterr()
    assert _run(planted, "--check") == 1
    assert _lines(capsys) == [
        f"results: docs/results/default_run/comparison.md names {cpu_kind()}, docs/results/default_run/run.json "
        "'Other CPU (AVX2)': not one run (`snakemake --cores all`, then `python dev/publish_run.py` records it "
        "again); block left as it is",
        f"recipe: docs/experiments/recipe/summary.md does not name {cpu_kind()}, the CPU of "
        "docs/experiments/recipe/results.csv (python docs/experiments/recipe/table.py writes both); block left as "
        "it is"]


# ---- this checkout's finished default run ---------------------------------------------------------------------------
def _finished_run_of_the_records_cpu() -> Path:
    """This checkout's finished default run's comparison.md; skips where there is none, no recorded run, or where
    this machine, or the run, is not the kind of CPU that the record names."""
    table = ROOT / publish_run.COMPARISON
    if not table.is_file():
        pytest.skip(f"no finished default run here ({publish_run.COMPARISON} is missing; `snakemake --cores all` "
                    "makes it)")
    if not (ROOT / rb.RUN_JSON).is_file():
        pytest.skip(f"no recorded default run ({rb.RUN_JSON}: python dev/publish_run.py)")
    record = json.loads((ROOT / rb.RUN_JSON).read_text())
    named = ([record["cpu"]], record.get("torch_cpu_capability"))
    here = ([cpu_kind()], torch_cpu_capability())
    if named != here:
        pytest.skip(f"the recorded run was made on {named}, this machine is {here}: another kind of CPU trains other "
                    "numbers (torch picks its kernels by the CPU)")
    made = parse_made_on(table.read_text())
    if made != here:
        pytest.skip(f"{publish_run.COMPARISON} was made on {made or 'an unrecorded CPU'}, not on this machine's kind "
                    f"({here})")
    return table


def test_recorded_default_run_is_this_checkouts_run():
    """The recorded default run (``docs/results/default_run/comparison.md``, README's ``results`` block) is the
    table this checkout's finished default run made (``.ci/run`` runs it before the tests), where this machine is
    the kind of CPU the record names."""
    table = _finished_run_of_the_records_cpu()
    assert (ROOT / rb.COMPARISON).read_text() == table.read_text(), (
        "the recorded default run is not this checkout's: if the run is older than the workflow, `snakemake --cores "
        "all` brings it up to date (`-n` lists what it remakes); if the record is behind, `python dev/publish_run.py` "
        "records the run and `python dev/readme_blocks.py` rewrites README's blocks")


#: pruning loss (held-out bits per byte above the unpruned model's) from which a ``rand`` cell has something to recover
RECOVERABLE = 0.1


def test_default_runs_rft_helps_where_there_is_something_to_recover():
    """In this checkout's default run on the recorded run's kind of CPU, RFT never makes a cell worse by more than
    0.001 held-out bits per byte, and it improves every ``rand`` cell whose pruning lost at least
    :data:`RECOVERABLE` bits per byte (keep: best falls back to the pruned model where no step helps on validation,
    as on tiny-mamba2, whose random cut loses 0.04; docs/experiments/rft_tiny)."""
    table = _finished_run_of_the_records_cpu()
    rows = list(csv.DictReader(table.with_suffix(".csv").open()))
    bpb = {stage: {(r["model"], r["method"], r["pct"]): float(r["heldout/bits_per_byte"]) for r in rows
                   if r["stage"] == stage} for stage in ("pruned", "rft")}
    unpruned = {r["model"]: float(r["heldout/bits_per_byte"]) for r in rows if r["stage"] == "unpruned"}
    pre, post = bpb["pruned"], bpb["rft"]
    assert pre and post.keys() == pre.keys()
    recoverable = [k for k in pre if k[1] == "rand" and pre[k] - unpruned[k[0]] >= RECOVERABLE]
    assert recoverable, "no rand cell lost enough to check RFT's recovery on"
    worse = {k: post[k] - pre[k] for k in pre if post[k] > pre[k] + 0.001 or (k in recoverable and post[k] >= pre[k])}
    assert not worse, f"RFT made these cells worse (post - pre bits per byte): {worse}"


def test_testing_page_figures_are_the_recorded_runs():
    """docs/records/testing.md's coverage, planted-fault and time tables are what dev/testing_figures.py renders from
    the documents in docs/results/tests/."""
    figures = runpy.run_path(str(ROOT / "dev" / "testing_figures.py"))
    assert figures["main"](["check"]) == 0
