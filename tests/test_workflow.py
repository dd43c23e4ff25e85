"""Minimal recompute, proven on the workflow tier's finished tiny run (Snakemake dry runs).

The one finished run of the session (``tests/_workflow_run.py``: the tiny config in ``tests/workflow/`` run to the
end, ``all_paper`` and budget cells included) is copied into this module's own folder; then dry runs show that
- nothing reruns when nothing changed,
- editing the DRRQR selector's code schedules only DRRQR selections and their dependents,
- a Grad-only setting touches only Grad jobs,
- an RFT setting reruns only RFT and what reads it; switching RFT off drops it from the summaries,
- the commands of docs/workflow.md's "Rerunning one step" plan exactly the jobs the docs name.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from _paths import ROOT
from _snakemake import dry_run_outputs, job_counts, job_outputs, snakemake
from _workflow_run import BUDGET_TARGETS, copy_run


def _snakemake(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    """Snakemake on the workflow copy in ``workdir``."""
    return snakemake(workdir, *args, workflow=workdir, timeout=900)


def planned_outputs(workdir: Path, *targets: str) -> dict[str, list[str]]:
    """rule -> output files of the jobs a dry run of ``targets`` (default: the default target) would execute."""
    out = _snakemake(workdir, *targets, "-n", "--printshellcmds")
    assert out.returncode == 0, out.stderr[-3000:]
    return job_outputs(out.stdout + out.stderr)


@pytest.fixture(scope="module")
def finished_run(workflow_run, tmp_path_factory) -> Path:
    """This module's copy of the finished run (its tests change the config and the code, and rerun jobs)."""
    work = copy_run(workflow_run, tmp_path_factory.mktemp("wf") / "run")
    assert (work / "results" / "tables" / "comparison.md").exists()
    return work


def test_summaries_carry_pre_and_post_rft_metrics(finished_run):
    for method in ("rand", "grad", "drrqr"):
        summary = yaml.safe_load((finished_run / "results" / "wf-dn" / f"{method}_50" / "eval.json").read_text())
        pruned, rft = summary["metrics"]["pruned"]["heldout"], summary["metrics"]["rft"]["heldout"]
        kept = summary["rft"]["kept_step"]
        assert pruned["bits_per_byte"] > 0 and rft["bits_per_byte"] > 0 and summary["rft"]["steps"] == 2
        # keep: best: the RFT checkpoint is the pruned model itself where no step beat it on validation (step 0)
        assert (rft == pruned) == (kept == 0), (method, kept, pruned, rft)
    stage = finished_run / "results" / "wf-dn" / "drrqr_50"
    assert (stage / "rft" / "model.safetensors").exists() and not (stage / ".rft_resume").exists()
    assert len((stage / "rft" / "train_log.jsonl").read_text().splitlines()) == 2
    table = (finished_run / "results" / "tables" / "comparison.md").read_text()
    assert "post-RFT" in table


def test_nothing_reruns_when_nothing_changed(finished_run):
    assert planned_outputs(finished_run) == {}


def test_a_moved_project_folder_keeps_its_results(finished_run, tmp_path):
    """A project folder copied elsewhere (results and Snakemake's records with it) plans nothing: no job's recorded
    inputs name the folder's absolute path."""
    moved = tmp_path / "moved"
    shutil.copytree(finished_run, moved, symlinks=True)
    assert planned_outputs(moved) == {}


def test_editing_drrqr_code_reruns_only_drrqr(finished_run):
    code = finished_run / "statereduce" / "selectors" / "drrqr.py"
    original, stat = code.read_text(), code.stat()
    try:
        code.write_text(original + "\n# edited\n")
        jobs = planned_outputs(finished_run)
        budget_jobs = planned_outputs(finished_run, *BUDGET_TARGETS)
    finally:
        code.write_text(original)
        os.utime(code, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the file as it was: a clean state for the next test
    assert set(jobs) == {"select_channels", "prune", "rft", "summarize", "comparison_table"}, jobs
    per_method = [p for r, ps in jobs.items() if r != "comparison_table" for p in ps]
    assert per_method and all("drrqr_50" in p for p in per_method), per_method
    assert not any(r in jobs for r in ("pretrain", "calibrate", "grad_scores", "eval_baseline"))
    # the sensitivity budget's values run the selector; the uniform budget's selection too; grad@energy neither
    assert budget_jobs["budget_values"] == ["results/wf-dn/select/drrqr@sens.values.json"], budget_jobs
    assert not any("grad@" in p for ps in budget_jobs.values() for p in ps), budget_jobs


def test_grad_setting_touches_only_grad_jobs(finished_run):
    cfg_path = finished_run / "config.yaml"
    original = cfg_path.read_text()
    cfg = yaml.safe_load(original)
    cfg["selectors"]["grad"]["batch_size"] = 2
    try:
        cfg_path.write_text(yaml.safe_dump(cfg))
        jobs = planned_outputs(finished_run)
    finally:
        cfg_path.write_text(original)
    assert "grad_scores" in jobs, jobs
    per_method = [p for r, ps in jobs.items() if r not in ("comparison_table", "grad_scores") for p in ps]
    assert per_method and all("/grad_50" in p or "grad_50." in p for p in per_method), per_method
    assert not any(r in jobs for r in ("pretrain", "calibrate", "eval_baseline"))


def test_rft_setting_reruns_only_rft(finished_run):
    cfg_path = finished_run / "config.yaml"
    original = cfg_path.read_text()
    cfg = yaml.safe_load(original)
    cfg["models"]["wf-dn"]["rft"]["lr"] = 2.0e-3
    try:
        cfg_path.write_text(yaml.safe_dump(cfg))
        jobs = planned_outputs(finished_run)
        cfg["models"]["wf-dn"]["rft"]["activate"] = False
        cfg_path.write_text(yaml.safe_dump(cfg))
        jobs_off = planned_outputs(finished_run)
    finally:
        cfg_path.write_text(original)
    assert set(jobs) == {"rft", "summarize", "comparison_table"}, jobs
    assert len(jobs["rft"]) == 3 * 5  # three methods, five declared outputs each
    assert set(jobs_off) == {"summarize", "comparison_table"}, jobs_off


def _documented_rerun_commands() -> list[str]:
    """The commands of docs/workflow.md's "Rerunning one step", in order, without their comments."""
    doc = (ROOT / "docs" / "workflow.md").read_text()
    section = doc.split("## Rerunning one step", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.startswith("snakemake ")]


def test_documented_rerun_commands_plan_what_the_docs_say(finished_run):
    """docs/workflow.md's commands for rerunning one step, run as written (through bash, for the globs) with ``-n``
    on the finished run, the tiny default's tiny-dn replaced by this config's wf-dn (the default target's only model,
    so a "column" of it is one cell; the glob of selections also finds the run's other models'): each plans exactly
    the jobs the docs list, all of drrqr cells."""
    commands = _documented_rerun_commands()
    cell = {"select_channels": 1, "prune": 1, "rft": 1, "summarize": 1}
    column = {"select_channels": len(list((finished_run / "results").glob("*/select/drrqr_*.parquet")))}
    assert column == {"select_channels": 3}  # wf-dn, wf-init, my-model
    # the fourth forces every selection the glob finds, downstream of those in the default target
    expected = [{"select_channels": 1}, cell, column, {**cell, **column, "comparison_table": 1, "all": 1}]
    assert len(commands) == len(expected), commands
    until = "snakemake results/tiny-dn/drrqr_50/eval.json --forcerun select_channels --until select_channels"
    assert f"`{until}`" in (ROOT / "docs" / "workflow.md").read_text()  # "plans the same single job as the first"
    commands, expected = [*commands, until], [*expected, {"select_channels": 1}]
    for command, counts in zip(commands, expected):
        line = command.replace("tiny-dn", "wf-dn").replace("snakemake", f"{sys.executable} -m snakemake", 1)
        out = subprocess.run(["bash", "-c", f"{line} -n"], cwd=finished_run, capture_output=True, text=True,
                             timeout=300)
        text = out.stdout + out.stderr
        assert out.returncode == 0, (command, text[-3000:])
        assert job_counts(text) == counts, (command, job_counts(text))
        outputs = [p for rule, paths in job_outputs(text).items() if rule not in ("comparison_table", "all")
                   for p in paths]
        assert outputs and all("drrqr_50" in p for p in outputs), (command, outputs)
    assert planned_outputs(finished_run) == {}  # dry runs: still complete


def test_all_paper_adds_rank_analysis_and_tables(finished_run):
    """``all_paper`` = the default outputs plus rank.json per checkpoint and the Table 5/6/overlap tables."""
    assert planned_outputs(finished_run, "all_paper") == {}  # the finished run built it
    results = finished_run / "results"
    base = yaml.safe_load((results / "wf-dn" / "baseline" / "rank.json").read_text())
    assert base["model"]["d_k"] == 32 and 0 < base["summary"]["u"]["mean"] <= 1
    assert base["conditioning"]["n_heads"] == 4 and base["spectrum"]["layer"] == 1
    for method in ("rand", "grad", "drrqr"):
        doc = yaml.safe_load((results / "wf-dn" / f"{method}_50" / "rank.json").read_text())
        assert doc["model"]["d_k"] == 16 and -1 <= float(doc["pearson_u"]) <= 1
        cond = doc["conditioning"]["median"]
        assert 0 < cond["sigma_min"] <= cond["sigma_max"]
    table = (results / "tables" / "rank_utilization.md").read_text()
    assert "| wf-dn | baseline | 0 | 32 |" in table and "| wf-dn | drrqr | 50 | 16 |" in table
    assert "| wf-dn | 50 | drrqr | grad | 16 |" in (results / "tables" / "overlap.md").read_text()
    assert planned_outputs(finished_run) == {}  # the default target is still complete


def test_report_has_tables_and_figures(finished_run, tmp_path):
    """``--report`` after ``all_paper``: one self-contained HTML with the captioned tables and rank figures."""
    assert (finished_run / "report").is_dir()  # the captions and the workflow description of the Snakefile
    figures = finished_run / "results" / "figures"
    assert {p.name for p in figures.glob("*.png")} == {"wf-dn_utilization_50.png", "wf-dn_spectrum_50.png"}
    page = (finished_run / "results" / "tables" / "rank_utilization.html").read_text()
    assert page.count("<tr>") == 5  # header, baseline, three methods
    report = tmp_path / "report.html"
    run = _snakemake(finished_run, "--report", str(report), "all_paper")
    assert run.returncode == 0, (run.stdout + run.stderr)[-5000:]
    assert report.stat().st_size > 100_000
    html = report.read_text()
    for words in (
        "Targets of this run: models wf-dn",  # report/workflow.rst, rendered with the config
        "Pruned models against their unpruned baseline",  # report/comparison.rst
        "Rank utilization of the recurrent state",  # report/rank_utilization.rst
        "Conditioning of the selected key/query subspace",  # report/conditioning.rst
        "Kept-channel overlap between selectors",  # report/overlap.rst
        "Rank utilization per head</strong> of wf-dn at 50%",  # report/utilization.rst with the wildcards
        "Singular-value spectrum of one head",  # report/spectrum.rst
        "results/figures/wf-dn_spectrum_50.png",
        "results/tables/overlap.html",
    ):
        assert words in html, words
    assert "data:image/png" in html and "data:text/html" in html  # embedded, not linked


def test_all_paper_plans_study_tables(tmp_path):
    """``all_paper`` with the shipped ``studies`` plans every study cell as an ordinary summary (calibration
    variants, -k/-q scorings) and the study tables (paper Tables 2/7, 16); ``all`` plans none of it, and a config
    without ``studies`` plans no study table."""
    cfg = yaml.safe_load((ROOT / "config.yaml").read_text())
    jobs = dry_run_outputs(tmp_path / "paper", "all_paper", "--resources", "gpu=1", cfg=cfg)
    for rule, name in (("calibration_study", "calibration_study"), ("scoring_ablation", "scoring_ablation")):
        assert set(jobs[rule]) == {f"results/tables/{name}.{ext}" for ext in ("md", "csv", "html", "rst")}
    summaries = set(jobs["summarize"])
    for cell in ("grad.prose", "drrqr.n16", "grad.seed1", "l1-k", "swanda-q", "drrqr-k", "grad-q"):
        for model in ("tiny-dn", "tiny-gdn"):
            assert f"results/{model}/{cell}_75/eval.json" in summaries, (model, cell)
    t = cfg["targets"]
    targets = {f"results/{m}/{s}_{p}/eval.json" for m in t["models"] for s in t["methods"] for p in t["pcts"]}
    cal, sco = cfg["studies"]["calibration"], cfg["studies"]["scoring"]
    cells = {f"results/{m}/{s}{'' if v == 'default' else '.' + v}_{cal['pct']}/eval.json"
             for m in cal["models"] for s in cal["selectors"] for v in cal["variants"]}
    cells |= {f"results/{m}/{s}{k}_{sco['pct']}/eval.json" for m in sco["models"] for s in sco["selectors"]
              for k in ("", "-k", "-q")}
    bud = cfg["studies"]["budgets"]
    budget_cells = {f"results/{m}/{s}{b}_{p}/eval.json" for m in bud["models"] for s in bud["selectors"]
                    for b in ["", *(f"@{b}" for b in bud["budgets"])] for p in bud["pcts"]}
    val = cfg["studies"]["values"]
    value_cells = {f"results/{m}/{s}{c}_{p}/eval.json" for m in val["models"] for s in val["selectors"]
                   for c in ("", "-v", "-kv") for p in val["pcts"]}
    value_cells |= {f"results/{m}/{val['recipe']}_{p}/eval.json" for m in val["models"] for p in val["pcts"]}
    split_cells = {f"results/{m}/{s}-kv@{val[key]}_{p}/eval.json" for m in val["models"] for s in val["selectors"]
                   for p in val["pcts"] for key in ("split", "split_layers")}
    value_cells |= split_cells
    com = cfg["studies"]["compensation"]
    compensation_cells = {f"results/{m}/{x}_{p}/eval.json" for m in com["models"] for x in com["methods"]
                          for p in com["pcts"]}
    assert summaries == targets | cells | budget_cells | value_cells | compensation_cells  # each once
    fitted = {p for p in compensation_cells if "+" in p}
    assert set(jobs["fit"]) == {p.replace(f"/{p.split('/')[2]}/eval.json", "/select/") + p.split("/")[2]
                                + ".fit.safetensors" for p in fitted}
    joint_cells = {p.split("+")[0] + "_" + p.rsplit("_", 1)[1] if "+" in p else p
                   for p in compensation_cells if "-kv@" in p}
    assert set(jobs["split"]) == {p.replace(f"/{p.split('/')[2]}/eval.json", "/select/") + p.split("/")[2]
                                  + ".split.json" for p in split_cells | joint_cells}
    assert set(jobs["allocate"]) == {p.replace(f"/{p.split('/')[2]}/eval.json", "/select/") + p.split("/")[2]
                                     + ".allocation.json" for p in budget_cells if "@" in p}
    measured = [b for b in bud["budgets"] if cfg["budgets"][b]["policy"] in ("greedy", "sensitivity")]
    assert measured == ["greedy", "sens"]  # measured once for both pcts; the spectrum budgets in allocate itself
    assert set(jobs["budget_values"]) == {f"results/{m}/select/{s}@{b}.values.json" for m in bud["models"]
                                          for s in bud["selectors"] for b in measured}
    assert set(jobs["budget_study"]) == {"results/tables/budget_study.md", "results/tables/budget_study.csv",
                                         "results/tables/budget_study.html", "results/tables/budget_study.rst",
                                         "results/figures/budget_allocations.png",
                                         "results/figures/budget_allocations.rst"}
    calibrations = {p.split("/")[3] for p in jobs["calibrate"]}
    assert calibrations == {"default", "prose", "n16", "seed1"}
    study_rules = {"calibration_study", "scoring_ablation", "budget_study", "convolution_tables"}
    assert not study_rules & set(dry_run_outputs(tmp_path / "all", "all", "--resources", "gpu=1", cfg=cfg))
    del cfg["studies"]
    none = dry_run_outputs(tmp_path / "none", "all_paper", "--resources", "gpu=1", cfg=cfg)
    assert not study_rules & set(none) and "allocate" not in none
    out = snakemake(tmp_path / "none", "results/tables/budget_study.md", "-n", cfg=cfg)  # by path: one line
    assert out.returncode != 0
    assert "study 'budgets' is not configured: add a studies.budgets block to the config to build budget_study" \
        in out.stdout + out.stderr, (out.stdout + out.stderr)[-2000:]


def test_all_speed_plans_gpu_jobs_only_there(tmp_path):
    """``all_speed`` plans one baseline speed job per ``speed.models`` model (GPU, random weights: no checkpoint,
    calibration or pruning job) and the speed table; the default target plans no speed job."""
    cfg = yaml.safe_load((ROOT / "config.yaml").read_text())
    jobs = dry_run_outputs(tmp_path / "speed", "all_speed", "--resources", "gpu=1", cfg=cfg)
    assert set(jobs) == {"speed_baseline", "speed_table"}
    assert sorted(jobs["speed_baseline"]) == [f"results/{m}/baseline/speed.json" for m in ("dn1.3b", "gdn1.3b")]
    assert not {"speed", "speed_baseline"} & set(dry_run_outputs(tmp_path / "all", "all", "--resources", "gpu=1",
                                                                 cfg=cfg))
    cfg["speed"]["models"] = ["dn13b"]
    out = snakemake(tmp_path / "bad", "-n", "all_speed", cfg=cfg)
    assert out.returncode != 0
    assert "speed.models: unknown model 'dn13b'; valid: " in out.stdout + out.stderr


def test_every_rule_that_runs_a_job_records_a_benchmark():
    """Every rule with a job (script, shell or run) writes Snakemake's benchmark TSV (wall time, peak memory), which
    docs/records/paper_scale_h200.md reads; only target rules (inputs alone) have none."""
    missing = []
    for smk in sorted((ROOT / "rules").glob("*.smk")):
        for block in re.split(r"\n(?=rule \w+:)", smk.read_text()):
            name = re.match(r"rule (\w+):", block)
            if name and re.search(r"^\s+(script|shell|run):", block, re.M) and "benchmark:" not in block:
                missing.append(f"{smk.name}:{name.group(1)}")
    assert not missing, f"rules without benchmark: {missing}"


def test_budget_cells_run_through_the_dag_and_rerun_alone(finished_run):
    """Methods with @<budget> ran (budget_values ->) allocate -> select_channels -> prune -> rft -> summarize in the
    finished run: the uniform budget's pruned checkpoint is the plain method's byte for byte, a sensitivity budget's
    widths reach the prune record and keep the summary's state bytes, and a budget's setting reruns only that
    budget's cells (and its values)."""
    targets = list(BUDGET_TARGETS)
    assert planned_outputs(finished_run, *targets) == {}
    res = finished_run / "results" / "wf-dn"
    for name in ("model.safetensors", "config.json"):
        plain = (res / "drrqr_50" / "pruned" / name).read_bytes()
        assert (res / "drrqr@uniform_50" / "pruned" / name).read_bytes() == plain, name
    alloc = json.loads((res / "select" / "drrqr@sens_50.allocation.json").read_text())
    assert sum(alloc["key_dims"].values()) == alloc["uniform_width"] * 2 == 32
    assert alloc["allocation"]["policy"] == "sensitivity"
    record = json.loads((res / "drrqr@sens_50" / "pruned" / "prune_record.json").read_text())
    assert record["extra"]["allocation"]["key_dims"] == alloc["key_dims"]
    state = {m: json.loads((res / f"{m}_50" / "eval.json").read_text())["state"] for m in ("drrqr", "drrqr@sens")}
    assert state["drrqr@sens"]["bytes_after"] == state["drrqr"]["bytes_after"]
    cfg_path = finished_run / "config.yaml"
    original = cfg_path.read_text()
    cfg = yaml.safe_load(original)
    cfg["budgets"]["sens"]["n_samples"] = 1
    try:
        cfg_path.write_text(yaml.safe_dump(cfg))
        out = _snakemake(finished_run, *targets, "-n", "--printshellcmds")
    finally:
        cfg_path.write_text(original)
    assert out.returncode == 0, out.stderr[-3000:]
    jobs = job_outputs(out.stdout + out.stderr)
    assert set(jobs) == {"budget_values", "allocate", "select_channels", "prune", "rft", "summarize"}, jobs
    assert jobs["budget_values"] == ["results/wf-dn/select/drrqr@sens.values.json"]
    assert all("drrqr@sens_50" in p for rule, ps in jobs.items() if rule != "budget_values" for p in ps), jobs


def test_prune_norm_eps_reruns_pruning_and_what_reads_it(finished_run):
    """The default prune.norm_eps (exact) writes an exact checkpoint; stock replans only pruning and its dependents
    and writes the stock one. Runs last on the finished run (it leaves wf-dn's drrqr_50 pruned with stock)."""
    record_path = finished_run / "results" / "wf-dn" / "drrqr_50" / "pruned" / "prune_record.json"
    record = json.loads(record_path.read_text())
    eps = record["kernel_scale"]["norm_eps"]
    assert eps["choice"] == "exact" and eps["factor"] == record["kernel_scale"]["o_norm_eps_factor_for_exact_zeroing"]
    assert eps["after"] == eps["before"] * eps["factor"]
    cfg_path = finished_run / "config.yaml"
    original = cfg_path.read_text()
    cfg = yaml.safe_load(original)
    cfg["prune"] = {"norm_eps": "stock"}
    try:
        cfg_path.write_text(yaml.safe_dump(cfg))
        jobs = planned_outputs(finished_run)
        run = _snakemake(finished_run, "results/wf-dn/drrqr_50/pruned/prune_record.json", "--cores", "1")
    finally:
        cfg_path.write_text(original)
    assert set(jobs) == {"prune", "rft", "summarize", "comparison_table"}, jobs
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    record = json.loads(record_path.read_text())
    assert "norm_eps" not in record["kernel_scale"]  # stock records only the factor that would make it exact
    assert record["kernel_scale"]["o_norm_eps_factor_for_exact_zeroing"] == eps["factor"]


def test_export_of_a_per_layer_rft_checkpoint_runs_alone_and_loads_without_the_package(finished_run, tmp_path):
    """``export/rft`` of a per-layer budget's cell plans the export job only; the folder carries the modeling code,
    RFT's adapter and a card with the base, the widths, the metrics before and after RFT and the command, and it
    loads in an environment without statereduce as the checkpoint does in the workflow."""
    from _venv import load_there, without_statereduce

    target = "results/wf-dn/drrqr@sens_50/export/rft/README.md"
    assert planned_outputs(finished_run, target) == {"export": [target]}
    run = _snakemake(finished_run, target, "--cores", "1")
    assert run.returncode == 0, run.stderr[-3000:]
    out = finished_run / target.rsplit("/", 1)[0]
    names = {p.name for p in out.iterdir()}
    assert {"modeling_statereduce.py", "adapter", "model.safetensors", "config.json", "tokenizer.json",
            "prune_record.json", "rft_record.json", "eval.json"} <= names
    card = (out / "README.md").read_text()
    assert "`drrqr@sens`, 50 % of key channels removed, fine-tuned" in card and "optimizer steps" in card
    assert "| task | metric | base | pruned | after RFT |" in card
    assert f"snakemake --cores all {target}" in card
    widths = json.loads((out / "config.json").read_text())["statereduce_key_dims"]
    assert len({w for w in widths if w is not None}) > 1  # per-layer widths: the modeling code is needed
    torch_ids = tmp_path / "ids.pt"
    import torch

    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    torch.save(ids, torch_ids)
    env = without_statereduce(tmp_path, fla=True)
    done = load_there(env, [{"name": "export", "folder": str(out), "out": str(tmp_path / "got.pt"),
                             "ids": str(torch_ids), "import_fla": False, "forward": False}], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    got = torch.load(tmp_path / "got.pt")
    from safetensors.torch import load_file

    weights = load_file(out / "model.safetensors")
    assert all(torch.equal(got["tensors"][k], v) for k, v in weights.items())
