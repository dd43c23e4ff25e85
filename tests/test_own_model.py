"""A user's own checkpoint through the workflow (configs/my_model.yaml, docs/workflow.md "Adding a model").

A tiny random DeltaNet saved as a stock HF checkpoint stands in for the user's model. The shipped overlay, pointed at
it, plans and (in the workflow tier's one finished run, tests/_workflow_run.py) runs the whole chain (base_source,
calibrate, select, prune and evaluate, RFT and evaluate) with the defaults of every optional block; ``source.json`` and every artifact record the SHA-256 of the checkpoint's files;
the evaluations leave nothing of lm-eval under ``results/``; new weights rerun base_source and everything downstream.
Bad minimal entries fail validation in one line.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import subprocess
from pathlib import Path

import _workflow_run
import pytest
import yaml
from _models import tiny_arch
from _paths import ROOT
from _snakemake import copy_workflow, job_outputs, snakemake

from statereduce.config import ConfigError, load_schema, validate_config
from statereduce.common.settings import CalibrationSettings, EvalSettings

OVERLAY = ROOT / "configs" / "my_model.yaml"
MODEL, TARGET, OVERLAY_FILE = _workflow_run.OWN_MODEL, _workflow_run.OWN_TARGET, _workflow_run.OVERLAY_FILE
CHAIN = {"base_source", "qk_weights", "calibrate", "eval_baseline", "select_channels", "prune", "rft", "summarize"}


def _snakemake(work: Path, *args: str) -> subprocess.CompletedProcess:
    """Snakemake on the workflow copy in ``work``: targets and options in ``args``, the overlay last (``--configfile``
    takes every path after it)."""
    return snakemake(work, *args, "--configfile", str(work / OVERLAY_FILE), workflow=work, timeout=1200)


def _planned(work: Path) -> tuple[dict[str, list[str]], str]:
    """(rule -> planned outputs, the dry run's text) of ``snakemake -n TARGET``."""
    out = _snakemake(work, TARGET, "-n")
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    return job_outputs(out.stdout + out.stderr), out.stdout + out.stderr


@pytest.fixture(scope="module")
def own_run(workflow_run, tmp_path_factory) -> dict:
    """This module's copy of the finished run, where the overlay, pointed at a tiny checkpoint, was planned (before
    anything ran) and run to the end: ``{"work", "ckpt", "planned"}``."""
    work = _workflow_run.copy_run(workflow_run, tmp_path_factory.mktemp("own") / "run")
    return {"work": work, "ckpt": workflow_run["ckpt"], "planned": workflow_run["own_planned"]}


def test_overlay_plans_the_whole_chain_with_the_shipped_config(tmp_path):
    """The overlay on the shipped config.yaml (its corpora and top-level blocks), pointed at a checkpoint: the dry run
    plans every stage of the chain, nothing else."""
    ckpt = tmp_path / "ckpt"
    _workflow_run.save_checkpoint(ckpt, seed=0)
    (tmp_path / OVERLAY_FILE).write_text(yaml.safe_dump(_workflow_run.own_overlay(ckpt)))
    out = snakemake(tmp_path / "work", TARGET, "-n", "--configfile", str(tmp_path / OVERLAY_FILE))
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert set(job_outputs(out.stdout + out.stderr)) == CHAIN


def test_minimal_entry_runs_the_whole_chain(own_run):
    assert set(own_run["planned"]) == CHAIN
    results = own_run["work"] / "results" / MODEL
    summary = json.loads((results / "drrqr_50" / "eval.json").read_text())
    for stage in ("baseline", "pruned", "rft"):
        assert summary["metrics"][stage]["heldout"]["bits_per_byte"] > 0, stage
    baseline = json.loads((results / "baseline" / "eval.json").read_text())
    assert baseline["settings"]["max_length"] == 512  # the model's eval block, with the default task list
    for stage in ("pruned", "rft"):
        assert (results / "drrqr_50" / stage / "model.safetensors").is_file()
    rft = json.loads((results / "drrqr_50" / "rft" / "rft_record.json").read_text())
    assert rft["data"]["split"] == "train" and rft["data"]["corpus"]["source"] == "embedded"  # the calibration corpus


def test_checkpoint_sha256_in_source_json_and_every_artifact(own_run):
    import h5py
    import pyarrow.parquet as pq

    ckpt, results = own_run["ckpt"], own_run["work"] / "results" / MODEL
    digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in ckpt.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(digests)
    source = json.loads((results / "base" / "source.json").read_text())
    assert source["sha256"] == digests and source["hub_id"] == str(ckpt.resolve())
    expected = {"checkpoint": str(ckpt.resolve()), "sha256": digests}
    stage = results / "drrqr_50"
    found = {
        "qk.h5": json.loads(h5py.File(results / "weights" / "qk.h5").attrs["base_checkpoint"]),
        "activations.h5": json.loads(
            h5py.File(results / "calib" / "default" / "activations.h5").attrs["base_checkpoint"]),
        "selection": json.loads(pq.read_schema(results / "select" / "drrqr_50.parquet").metadata[b"statereduce"])[
            "base_checkpoint"],
        "prune_record": json.loads((stage / "pruned" / "prune_record.json").read_text())["base_checkpoint"],
        "rft_record": json.loads((stage / "rft" / "rft_record.json").read_text())["base_checkpoint"],
        "summary": json.loads((stage / "eval.json").read_text())["provenance"]["evals"]["rft"]["base_checkpoint"],
    }
    for path in (results / "baseline" / "eval.json", stage / "pruned" / "eval.json", stage / "rft" / "eval.json"):
        found[str(path.relative_to(results))] = json.loads(path.read_text())["provenance"]["base_checkpoint"]
    assert found == {name: expected for name in found}


def test_evaluations_leave_no_lm_eval_files_under_results(own_run):
    """lm-eval's local tasks and the ``datasets`` cache beside them (Arrow and ``.lock`` files) live in a temporary
    folder: an evaluation leaves only its eval.json."""
    results = own_run["work"] / "results"
    assert sorted(results.rglob("*.lock")) == []
    assert sorted(p for p in results.rglob(".*") if not p.name.startswith(".rft_resume")) == []
    assert sorted(p.name for p in (results / MODEL / "baseline").iterdir()) == ["eval.json"]


@pytest.mark.workflow
def test_new_weights_rerun_base_source_and_everything_downstream(tmp_path):
    """Its own checkpoint (the finished run's is shared by the session), the chain's first two jobs run: a dry run of
    the whole chain plans the rest. New weights in the checkpoint folder (the same file names): base_source reruns for
    the updated file, and the job after it that had run reruns too."""
    work = copy_workflow(tmp_path / "work", _workflow_run.CONFIG)
    ckpt = tmp_path / "ckpt"
    _workflow_run.save_checkpoint(ckpt, seed=0)
    (work / OVERLAY_FILE).write_text(yaml.safe_dump(_workflow_run.own_overlay(ckpt)))
    done = _snakemake(work, f"results/{MODEL}/weights/qk.h5", "--cores", "2")
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert set(_planned(work)[0]) == CHAIN - {"base_source", "qk_weights"}
    _workflow_run.save_checkpoint(ckpt, seed=1)
    planned, text = _planned(work)
    assert set(planned) == CHAIN
    base = text[text.index("rule base_source:"):]
    assert re.search(r"reason: Updated input files: .*model\.safetensors", base[: base.index("wildcards:")])


# ---- bad minimal entries: one line each, before any job ---------------------------------------------------------
@pytest.fixture(scope="module")
def shipped_with_overlay(shipped_config) -> dict:
    """config.yaml extended by configs/my_model.yaml, as ``--configfile`` merges them (targets and the model)."""
    cfg = copy.deepcopy(shipped_config)
    overlay = yaml.safe_load(OVERLAY.read_text())
    cfg["targets"] = overlay["targets"]
    cfg["models"].update(overlay["models"])
    return cfg


@pytest.fixture()
def fake_checkpoint(tmp_path) -> Path:
    """A folder that passes for a DeltaNet checkpoint with heads of d_k = 32 in validation (which reads config.json
    and lists the weights)."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "delta_net", **tiny_arch("delta_net")}))  # d_k = 32
    (folder / "model.safetensors").write_bytes(b"")
    return folder


CORPORA = "embedded, fineweb, pydoc-topics"
BAD_ENTRIES = {
    "no_calibration": (lambda m, cfg: m.pop("calibration"),
                       rf"models\.my-model\.calibration\.corpus is not set: every model needs a calibration corpus "
                       rf"\(also its default evaluation and RFT text\); valid: {CORPORA}"),
    "unknown_corpus": (lambda m, cfg: m["calibration"].update(corpus="wiki"),
                       rf"models\.my-model\.calibration\.corpus: unknown corpus 'wiki'; valid: {CORPORA}"),
    "no_family": (lambda m, cfg: m.pop("family"), r"config error at models\.my-model: 'family' is a required property"),
    "unknown_family": (lambda m, cfg: m.update(family="deltanet"),
                       r"model 'my-model': unknown family 'deltanet'; valid: delta_net, gated_deltanet, mamba2, "
                       r"qwen3_5"),
    "no_checkpoint": (lambda m, cfg: m.pop("local"),
                      r"config error at models\.my-model: a model needs exactly one of hub, local, pretrain, init"),
    "missing_folder": (lambda m, cfg: m.update(local="/nonexistent/ckpt"),
                       r"models\.my-model\.local: '/nonexistent/ckpt' does not exist; expected an HF checkpoint "
                       r"folder with config\.json and its weights"),
    "no_weights": (lambda m, cfg: (Path(m["local"]) / "model.safetensors").unlink(),
                   r"models\.my-model\.local: '.*ckpt' has no weights \(\*\.safetensors or pytorch_model\*\.bin\); "
                   r"expected an HF checkpoint folder with config\.json and its weights"),
    "other_family": (lambda m, cfg: m.update(family="gated_deltanet"),
                     r"models\.my-model\.local: '.*ckpt' is a 'delta_net' checkpoint, not gated_deltanet "
                     r"\(model_type 'gated_deltanet'\); fix the id or the family"),
    "no_heldout_split": (lambda m, cfg: (cfg["corpora"].update(mine={"source": "files",
                                                                     "splits": {"train": "a.txt", "calib": "b.txt"}}),
                                         m["calibration"].update(corpus="mine")),
                         r"models\.my-model\.eval: corpus 'mine' has no heldout split \(the heldout task reads it; set "
                         r"eval\.corpus to another corpus\); its splits: calib, train"),
    "no_train_split": (lambda m, cfg: (cfg["corpora"].update(mine={"source": "files", "paths": "a.txt",
                                                                   "fractions": {"calib": 0.5, "heldout": 0.5}}),
                                       m["calibration"].update(corpus="mine")),
                       r"models\.my-model\.rft: corpus 'mine' has no train split \(RFT trains on it; set "
                       r"rft\.corpus\); its splits: calib, heldout"),
    "pct_leaves_no_channel": (lambda m, cfg: cfg["targets"].update(pcts=[50, 99]),  # d_k from the checkpoint's config
                              r"model 'my-model' at pct 99(\.0)?: pct=99(\.0)? removes every channel of d_k=32 "
                              r"\(keeps 0\); use a smaller pct"),
}


@pytest.mark.parametrize("case", sorted(BAD_ENTRIES))
def test_bad_minimal_entry_fails_in_one_line(shipped_with_overlay, fake_checkpoint, case):
    cfg = copy.deepcopy(shipped_with_overlay)
    entry = cfg["models"][MODEL]
    entry["local"] = str(fake_checkpoint)
    mutate, message = BAD_ENTRIES[case]
    mutate(entry, cfg)
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    assert "\n" not in str(err.value)
    assert re.fullmatch(message, str(err.value)), str(err.value)


def test_minimal_entry_is_valid(shipped_with_overlay, fake_checkpoint):
    cfg = copy.deepcopy(shipped_with_overlay)
    cfg["models"][MODEL]["local"] = str(fake_checkpoint)
    assert validate_config(cfg)["models"][MODEL]["local"] == str(fake_checkpoint)


def test_shipped_overlay_names_its_placeholder_before_any_job(tmp_path):
    """Run as shipped, the overlay stops the dry run in one line naming the placeholder path."""
    out = snakemake(tmp_path, "-n", TARGET, "--configfile", str(OVERLAY))
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert ("models.my-model.local: '/path/to/checkpoint' does not exist; expected an HF checkpoint folder with "
            "config.json and its weights") in text.splitlines(), text
    assert "rule " not in text


def test_schema_documents_the_defaults():
    """The schema's `default`s of the calibration and eval blocks are the ones the settings classes apply (every
    other block: tests/test_settings.py)."""
    defs = load_schema()["$defs"]
    for block, defaults in (("calibration", CalibrationSettings().to_dict()), ("evaluation", EvalSettings().to_dict())):
        documented = {k: v["default"] for k, v in defs[block]["properties"].items() if "default" in v}
        assert documented == defaults, block


def test_checkpoint_files_and_streamed_sha256(tmp_path):
    from statereduce.core.checkpoints import checkpoint_files, checkpoint_sha256, sha256_file, weight_files

    names = ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
             "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
             "generation_config.json"]
    for i, name in enumerate(names):
        (tmp_path / name).write_bytes(bytes([i]) * (3 << 20 if name.endswith(".safetensors") else 10))
    for other in ("README.md", "optimizer.pt", "training_args.bin", ".hidden.safetensors"):
        (tmp_path / other).write_bytes(b"x")
    (tmp_path / "checkpoint-100").mkdir()
    assert [p.name for p in checkpoint_files(tmp_path)] == sorted(names)
    assert [p.name for p in weight_files(tmp_path)] == sorted(n for n in names if n.startswith("model"))
    shard = tmp_path / names[1]
    assert sha256_file(shard) == hashlib.sha256(shard.read_bytes()).hexdigest()  # 3 MiB: read in several chunks
    assert checkpoint_sha256(tmp_path) == {n: hashlib.sha256((tmp_path / n).read_bytes()).hexdigest()
                                           for n in sorted(names)}
