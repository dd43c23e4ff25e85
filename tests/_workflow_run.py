"""The workflow tier's one finished run: a copy of the workflow that runs the combined config of
``tests/workflow/config.yaml`` to the end in a single Snakemake invocation (both cores busy throughout).

What the one run holds (docs/testing.md, "Tiers"):

- ``wf-dn``, a tiny DeltaNet the workflow pretrains: its default target (rand, grad, drrqr at 50 %, each pruned,
  recovery-fine-tuned and summarised, the comparison table) and ``all_paper`` (rank analysis and its tables);
- its budget cells :data:`BUDGET_TARGETS` (allocate -> select -> prune -> RFT -> summary);
- ``wf-init``, random weights of a hub model's kind (rule init_random), through calibration, selection, pruning and
  evaluation (:data:`INIT_TARGET`);
- ``my-model``, the shipped overlay ``configs/my_model.yaml`` pointed at a tiny random DeltaNet saved as a stock HF
  checkpoint (``ckpt`` beside the run), its whole chain (:data:`OWN_TARGET`).

``build(root)`` makes it; the tests copy it (:func:`copy_run`) before they change anything.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml
from _paths import ROOT
from _snakemake import copy_workflow, job_outputs, snakemake

CONFIG = ROOT / "tests" / "workflow" / "config.yaml"
OVERLAY = ROOT / "configs" / "my_model.yaml"
OWN_MODEL = "my-model"
OWN_TARGET = f"results/{OWN_MODEL}/drrqr_50/eval.json"
INIT_TARGET = "results/wf-init/drrqr_50/pruned/eval.json"
BUDGET_TARGETS = tuple(f"results/wf-dn/{m}_50/eval.json" for m in ("drrqr@uniform", "drrqr@sens", "grad@energy"))
OVERLAY_FILE = "my_model.yaml"
"""The overlay's name in the run folder (the own-model tests pass it with ``--configfile``)."""


def save_checkpoint(folder: Path, seed: int) -> None:
    """A tiny random DeltaNet (tests/_models.py's) with the byte-level tokenizer, saved as a stock HF checkpoint."""
    from _models import tiny_model

    from statereduce.core.tokenizer import VOCAB_SIZE, byte_level_tokenizer

    model = tiny_model("delta_net", seed=seed, vocab_size=VOCAB_SIZE, bos_token_id=256, eos_token_id=256)
    model.save_pretrained(folder)
    byte_level_tokenizer().save_pretrained(folder)


def own_overlay(local: Path) -> dict:
    """The shipped overlay with ``local`` set, and sizes for a CPU test; eval and RFT keep their default corpus."""
    cfg = yaml.safe_load(OVERLAY.read_text())
    entry = cfg["models"][OWN_MODEL]
    assert set(entry) == {"family", "local", "calibration"}  # the overlay ships the minimal entry
    entry["local"] = str(local)
    entry["calibration"].update(n_samples=4, seq_len=64, rows_per_head=64)
    entry["eval"] = {"max_docs": 3, "max_doc_bytes": 256, "max_length": 512}
    entry["rft"] = {"n_samples": 8, "seq_len": 32, "batch_size": 4, "micro_batch_size": 4, "save_every": 1}
    return cfg


def run_snakemake(work: Path, *args: str, timeout: float = 1200):
    """Snakemake on the workflow copy in ``work`` (its own config.yaml)."""
    return snakemake(work, *args, workflow=work, timeout=timeout)


def build(root: Path) -> dict:
    """The finished run in ``root/run`` (the local checkpoint in ``root/ckpt``): ``{"work", "ckpt", "own_planned"}``,
    ``own_planned`` what a dry run of :data:`OWN_TARGET` with the overlay planned before anything ran.

    The run's config.yaml is ``tests/workflow/config.yaml`` with the overlay's model entry added (its ``targets``
    stay wf-dn's); the overlay itself lies beside it as :data:`OVERLAY_FILE`."""
    work = copy_workflow(root / "run", CONFIG)
    shutil.copytree(ROOT / "report", work / "report")  # the report's captions and the Snakefile's description
    ckpt = root / "ckpt"
    save_checkpoint(ckpt, seed=0)
    overlay = own_overlay(ckpt)
    (work / OVERLAY_FILE).write_text(yaml.safe_dump(overlay))
    planned = run_snakemake(work, OWN_TARGET, "-n", "--configfile", str(work / OVERLAY_FILE))
    assert planned.returncode == 0, (planned.stdout + planned.stderr)[-3000:]
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["models"][OWN_MODEL] = overlay["models"][OWN_MODEL]
    (work / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    run = run_snakemake(work, "all_paper", *BUDGET_TARGETS, INIT_TARGET, OWN_TARGET, "--cores", "2", timeout=2400)
    assert run.returncode == 0, (run.stdout + run.stderr)[-5000:]
    return {"work": work, "ckpt": ckpt, "own_planned": job_outputs(planned.stdout + planned.stderr)}


def copy_run(run: dict, dest: Path) -> Path:
    """A copy of the finished run's folder at ``dest`` (results and Snakemake's records with it; the local checkpoint
    stays where it is, as the config names it)."""
    shutil.copytree(run["work"], dest, symlinks=True)
    return dest
