"""README's generated blocks (dev/readme_blocks.py): on planted sources the generator fills every block between its
markers and ``--check`` names a block whose number was changed by hand; on a finished default run of this
checkout, README's ``results`` block is what the generator renders from its ``results/tables/comparison.md``, where
this machine is the kind of CPU that the block names."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import re
import runpy
import sys
from pathlib import Path

import pytest

from statereduce.analysis.tables import parse_made_on, torch_cpu_capability, write_comparison
from statereduce.core.runtime import cpu_kind

ROOT = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("readme_blocks", ROOT / "dev" / "readme_blocks.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


rb = _generator()
NAMES = ("results", "install", "hub-cost", "recipe")
README = "# x\n\nProse stays.\n\n" + "".join(
    f"<!-- generated:{n} -->\n(placeholder)\n<!-- /generated:{n} -->\n\nMore prose about {n}.\n\n" for n in NAMES)


def _levels(a4: float, a8: float) -> dict:
    return {f"recall_mqar_{k}": {"acc": a, "acc_stderr": math.sqrt(a * (1 - a) / 99)} for k, a in ((4, a4), (8, a8))}


def _doc(bpb: float, a4: float, a8: float) -> tuple[dict, dict]:
    metrics = {"heldout": {"bits_per_byte": bpb, "word_perplexity": 8.1e7}, **_levels(a4, a8)}
    return metrics, {"recall_probe": {"recall_mqar_avg": (a4 + a8) / 2}}


def _plant_results(root: Path, cpu: str) -> None:
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
    tables = root / "results" / "tables"
    tables.mkdir(parents=True)
    write_comparison(summaries, baselines, tables / "comparison.md", tables / "comparison.csv")
    log = root / ".snakemake" / "log" / "2026-12-02T184400.000000.snakemake.log"
    log.parent.mkdir(parents=True)
    log.write_text("  Date: 2026-12-02 18:44:00\n  Command: .venv/bin/snakemake --cores all\n"
                   "[Wed Dec  2 18:44:02 2026]\nlocalrule pretrain:\n[Wed Dec  2 18:55:21 2026]\n"
                   "102 of 102 steps (100%) done\n")


def _plant_other(root: Path) -> None:
    results = root / "docs" / "results"
    results.mkdir(parents=True)
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
    recipe = root / "docs" / "experiments" / "recipe"
    recipe.mkdir(parents=True)
    (recipe / "summary.md").write_text("| recipe | bits/byte |\n| --- | --- |\n| drrqr@sens | 3.141 |\n")


@pytest.fixture
def planted(tmp_path):
    _plant_results(tmp_path, cpu_kind())
    _plant_other(tmp_path)
    (tmp_path / "README.md").write_text(README)
    return tmp_path


def _run(root: Path, *args: str) -> int:
    return rb.main(["--root", str(root), "--readme", str(root / "README.md"), *args])


def test_generator_fills_blocks_and_check_names_a_changed_number(planted, capsys):
    assert _run(planted, "--check") == 1  # placeholders differ from their sources
    assert _run(planted) == 0
    text = (planted / "README.md").read_text()
    assert "(placeholder)" not in text and "Prose stays." in text
    assert all(f"More prose about {n}." in text for n in NAMES)
    results = rb.block_text(text, "results")
    assert rb.block_made_on(results) == parse_made_on((planted / "results/tables/comparison.md").read_text())
    assert "| drrqr | 3.600 → 3.550 | 4.600 → 4.550 |" in results  # bits/byte pre → post, from the overview
    assert "0.450 ± 0.035 → 0.465 ± 0.035" in results  # recall with its standard error
    assert "12 of 16 (2.450 → 2.400)" in results and "8 of 16 (2.450 → 2.400)" in results  # the step RFT kept
    assert "81" not in results.replace("0.81", "")  # the held-out word perplexity stays out
    assert "ran 102 jobs in 11 min 21 s" in results
    install = rb.block_text(text, "install")
    assert "3 packages, **1.6 GB** to download" in install and "torch 2.13.0 900 MB" in install
    assert "not measured (LookupError: not reachable)" in install
    hub = rb.block_text(text, "hub-cost")
    assert "| prune + evaluate | 30-40 | 4.3 |" in hub and "| RFT (8 steps) + evaluate | 42 | 116.2 |" in hub
    assert "| base checkpoint (bf16) | 2.7 GB |" in hub and "36,130 tokens/s" in hub
    assert "at these rates: 30 min" in hub  # 32,000 × 2048 tokens at 36,130 tokens/s
    assert rb.block_text(text, "recipe") == "| recipe | bits/byte |\n| --- | --- |\n| drrqr@sens | 3.141 |\n"
    capsys.readouterr()

    assert _run(planted, "--check") == 0
    assert _run(planted) == 0 and (planted / "README.md").read_text() == text  # idempotent

    # a changed run time is no difference; a changed number is, and --check names its block
    (planted / "README.md").write_text(text.replace("11 min 21 s", "12 min 2 s"))
    assert _run(planted, "--check") == 0
    (planted / "README.md").write_text(text.replace("4.600 → 4.550", "4.600 → 4.551"))
    capsys.readouterr()
    assert _run(planted, "--check") == 1
    out = capsys.readouterr().out
    assert "results: README's block differs" in out and "differs: results " in out
    (planted / "README.md").write_text(text.replace("36,130", "36,131"))
    assert _run(planted, "--check") == 1 and "differs: hub-cost " in capsys.readouterr().out


def test_absent_source_leaves_its_block(planted, capsys):
    (planted / "docs" / "experiments" / "recipe" / "summary.md").unlink()
    assert _run(planted, "recipe") == 0
    assert "recipe: no docs/experiments/recipe/summary.md yet; block left as it is" in capsys.readouterr().out
    assert rb.block_text((planted / "README.md").read_text(), "recipe") == "(placeholder)\n"
    assert _run(planted, "--check", "recipe") == 0


def test_results_of_another_cpu_are_not_compared(planted, capsys):
    assert _run(planted) == 0
    text = (planted / "README.md").read_text()
    (planted / "README.md").write_text(text.replace(rb.block_made_on(rb.block_text(text, "results"))[0][0],
                                                    "Other CPU (AVX2)").replace("3.600 → 3.550", "3.700 → 3.650"))
    capsys.readouterr()
    assert _run(planted, "--check", "results") == 0
    assert "not compared (another kind of CPU trains other numbers)" in capsys.readouterr().out


def _default_run_on_the_readmes_cpu() -> tuple[Path, str]:
    """(comparison.md, README's results block) of this checkout's finished default run; skips where there is none, or
    where this machine, or the run, is not the kind of CPU that README's block names."""
    table = ROOT / rb.COMPARISON
    if not table.is_file():
        pytest.skip(f"no finished default run here ({rb.COMPARISON} is missing; `snakemake --cores all` makes it)")
    block = rb.block_text((ROOT / "README.md").read_text(), "results")
    if block is None:
        pytest.skip("README.md has no results block")
    named = rb.block_made_on(block)
    if named is None:
        pytest.skip("README's results block names no CPU (not generated yet: python dev/readme_blocks.py)")
    here = ([cpu_kind()], torch_cpu_capability())
    if named != here:
        pytest.skip(f"README's results block was made on {rb.made_on_text(*named)}, this machine is "
                    f"{rb.made_on_text(*here)}: another kind of CPU trains other numbers (torch picks its kernels "
                    "by the CPU)")
    made = parse_made_on(table.read_text())
    if made != here:
        pytest.skip(f"{rb.COMPARISON} was made on {rb.made_on_text(*made) if made else 'an unrecorded CPU'}, not on "
                    f"this machine's kind ({rb.made_on_text(*here)})")
    return table, block


def test_readme_results_block_is_the_default_runs_table():
    """The README's ``results`` block equals what the generator renders from this checkout's finished default run
    (``.ci/run`` runs it before the tests), where this machine is the kind of CPU the block names; the run time
    line is left out."""
    _, block = _default_run_on_the_readmes_cpu()
    rendered = rb.render_results(ROOT)
    assert rb.stable(block, rb.BLOCKS["results"].volatile) == rb.stable(rendered, rb.BLOCKS["results"].volatile), (
        "README's results block is not what results/tables/comparison.md of this run gives: if the run is older than "
        "the workflow, `snakemake --cores all` brings it up to date (`-n` lists what it remakes); if the README is "
        "behind, `python dev/readme_blocks.py results` rewrites the block")
    assert re.search(r"^\| baseline \|", rendered, re.M)


def test_default_runs_rft_helps_where_there_is_something_to_recover():
    """In the default run on the README's kind of CPU, RFT never makes a cell worse by more than 0.001 held-out bits
    per byte, and it improves every ``rand`` cell (keep: best falls back to the pruned model where no step helps on
    validation; docs/experiments/rft_tiny)."""
    table, _ = _default_run_on_the_readmes_cpu()
    rows = list(csv.DictReader(table.with_suffix(".csv").open()))
    bpb = {stage: {(r["model"], r["method"], r["pct"]): float(r["heldout/bits_per_byte"]) for r in rows
                   if r["stage"] == stage} for stage in ("pruned", "rft")}
    pre, post = bpb["pruned"], bpb["rft"]
    assert pre and post.keys() == pre.keys()
    worse = {k: post[k] - pre[k] for k in pre if post[k] > pre[k] + 0.001 or (k[1] == "rand" and post[k] >= pre[k])}
    assert not worse, f"RFT made these cells worse (post - pre bits per byte): {worse}"


def test_testing_page_figures_are_the_recorded_runs():
    """docs/testing.md's coverage, planted-fault and time tables are what dev/testing_figures.py renders from the
    documents in docs/results/tests/."""
    figures = runpy.run_path(str(ROOT / "dev" / "testing_figures.py"))
    assert figures["main"](["check"]) == 0
