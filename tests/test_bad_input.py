"""Bad input between jobs and on the command line fails in one line naming the bad value and the remedy.

- An artifact written for another job (another model, family, calibration, head size, method or pct) is refused
  by every reader that knows what its job expects (selection, pruning, RFT, rank analysis), instead of giving a
  silently wrong result; the error names the file, what it was written for, what the job is for, and the rule
  that rebuilds it.
- A requested path under ``results/`` with an unknown model, selector or calibration, or an impossible pct, fails
  before any job is planned, naming that part and the valid choices (not Snakemake's "No rule to produce ...").
- ``models.<name>.local`` that is not an HF checkpoint folder fails config validation, not the job.
- An artifact that cannot be read (a truncated HDF5 file, a file that is not Parquet or not a selection file, a
  prune record that is not JSON) fails the same way: its path, what is wrong, and the rule that rebuilds it.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from _models import tiny_inputs, tiny_model
from _snakemake import snakemake

from statereduce.core.artifacts import ArtifactError
from statereduce.stages.capture import capture_activations, export_qk_weights, grad_scores
from statereduce.stages.select import read_selection, select_channels, write_selection

DN = {"model": "tiny-dn", "family": "delta_net", "dtype": "float32", "device": "cpu"}  # a job's params.info
GDN = {"model": "tiny-gdn", "family": "gated_deltanet", "dtype": "float32", "device": "cpu"}


def _one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict[str, Path]:
    """qk.h5 and activations.h5 of a tiny DeltaNet ('tiny-dn') and a tiny Gated DeltaNet ('tiny-gdn') of the same
    head sizes (2 heads of d_k = 32, hidden 64), written as the workflow's rules write them."""
    root = tmp_path_factory.mktemp("artifacts")
    out = {}
    blocks = tiny_inputs(batch=2, length=16)
    for info in (DN, GDN):
        model = tiny_model(info["family"])
        folder = root / info["model"]
        out[f"{info['model']}/qk"] = export_qk_weights(
            model, folder / "weights" / "qk.h5", attrs={"model": info["model"]}
        )
        out[f"{info['model']}/acts"] = capture_activations(
            model, blocks, folder / "calib" / "default" / "activations.h5", rows_per_head=40,
            attrs={"model": info["model"], "calibration": "default"})
    return out


# ---- 1. provenance: artifacts written for another job --------------------------------------------------------
def test_activations_of_another_model_are_refused(artifacts):
    """tiny-gdn's activations.h5 in place of tiny-dn's (same shapes): the selection fails instead of succeeding."""
    acts = artifacts["tiny-gdn/acts"]
    with pytest.raises(ArtifactError) as err:
        select_channels(artifacts["tiny-dn/qk"], "drrqr", 50, activations=acts, expect=DN)
    assert _one_line(err) == (
        f"{acts} was written for model 'tiny-gdn' (gated_deltanet); this job is for 'tiny-dn' (delta_net); "
        "delete it and rerun (rule calibrate rebuilds it)"
    )


def test_weights_of_another_model_are_refused(artifacts):
    with pytest.raises(ArtifactError, match=r"qk\.h5 was written for model 'tiny-gdn' \(gated_deltanet\); this job "
                       r"is for 'tiny-dn' \(delta_net\); delete it and rerun \(rule qk_weights rebuilds it\)$"):
        select_channels(artifacts["tiny-gdn/qk"], "l1", 50, expect=DN)


def test_matching_artifacts_pass_and_the_selection_records_model_and_family(artifacts, tmp_path):
    rows, meta = select_channels(artifacts["tiny-dn/qk"], "drrqr", 50, activations=artifacts["tiny-dn/acts"], expect=DN)
    assert meta["model"] == "tiny-dn" and meta["family"] == "delta_net"
    sel = write_selection(tmp_path / "drrqr_50.parquet", rows, meta)
    keep, meta2 = read_selection(sel, expect={**DN, "method": "drrqr", "pct": 50})
    assert meta2 == meta and len(keep.keys) == 2 and keep.values is None


def test_calibration_and_head_size_are_checked(artifacts, tmp_path):
    """grad_scores.h5 of another calibration id, and activations of a model with other head sizes (no model
    name recorded) are refused, naming the facts that differ."""
    model = tiny_model("delta_net")
    grads = grad_scores(model, tiny_inputs(batch=2, length=16), tmp_path / "grad_scores.h5",
                        attrs={"model": "tiny-dn", "calibration": "prose"})
    with pytest.raises(ArtifactError) as err:
        select_channels(artifacts["tiny-dn/qk"], "grad", 50, grads=grads, expect=DN)
    assert _one_line(err) == (f"{grads} was written with calibration='prose'; this job expects calibration='default'; "
                              "delete it and rerun (rule grad_scores rebuilds it)")
    select_channels(artifacts["tiny-dn/qk"], "grad.prose", 50, grads=grads, expect=DN)  # the job of that calibration

    small = tiny_model("delta_net", expand_k=0.5)  # d_k = 16
    acts = capture_activations(small, tiny_inputs(batch=1, length=8), tmp_path / "activations.h5", rows_per_head=4)
    with pytest.raises(ArtifactError,
                       match=r"was written with head_k_dim=16; this job expects head_k_dim=32; .*calibrate"):
        select_channels(artifacts["tiny-dn/qk"], "swanda", 50, activations=acts, expect=DN)


def test_selection_of_another_model_method_or_pct_is_refused(artifacts, tmp_path):
    rows, meta = select_channels(artifacts["tiny-gdn/qk"], "l1", 50, expect=GDN)
    sel = write_selection(tmp_path / "l1_50.parquet", rows, meta)
    with pytest.raises(ArtifactError) as err:
        read_selection(sel, expect={**DN, "method": "l1", "pct": 50.0})
    assert _one_line(err) == (f"{sel} was written for model 'tiny-gdn' (gated_deltanet); this job is for 'tiny-dn' "
                              "(delta_net); delete it and rerun (rule select_channels rebuilds it)")
    with pytest.raises(ArtifactError, match=r"was written with method='l1', pct=50; this job expects "
                                            r"method='drrqr', pct=75\.0; .*select_channels"):
        read_selection(sel, expect={**GDN, "method": "drrqr", "pct": 75.0})


def _fake_record(folder: Path, model: str, family: str, method: str, pct: float) -> Path:
    """A pruned checkpoint folder holding only the provenance part of its prune_record.json."""
    folder.mkdir(parents=True, exist_ok=True)
    record = {"family": family, "method": method, "pct": pct, "d_k": 32, "num_heads": 2, "extra": {"model": model}}
    (folder / "prune_record.json").write_text(json.dumps(record))
    return folder


def test_rft_refuses_a_checkpoint_pruned_for_another_job(tmp_path):
    from statereduce.stages.rft import run_rft
    from statereduce.common.settings import EvalSettings, RftPlan

    pruned = _fake_record(tmp_path / "pruned", "tiny-gdn", "gated_deltanet", "drrqr", 75.0)
    with pytest.raises(ArtifactError) as err:  # before any model, corpus or evaluation is touched
        run_rft(pruned, tmp_path / "base", tmp_path / "rft", RftPlan(), {}, EvalSettings(), DN, tmp_path / "eval.json",
                extra={"method": "drrqr", "pct": 75.0, "stage": "rft"})
    assert _one_line(err) == (f"{pruned / 'prune_record.json'} was written for model 'tiny-gdn' (gated_deltanet); "
                              "this job is for 'tiny-dn' (delta_net); delete it and rerun (rule prune rebuilds it)")
    with pytest.raises(ArtifactError, match=r"with method='drrqr'; this job expects method='l1'"):
        run_rft(pruned, tmp_path / "base", tmp_path / "rft", RftPlan(), {}, EvalSettings(), GDN, tmp_path / "eval.json",
                extra={"method": "l1", "pct": 75.0, "stage": "rft"})


def test_rank_refuses_artifacts_of_another_job(artifacts, tmp_path):
    from statereduce.stages.rank import rank_analysis
    from statereduce.common.settings import RankSettings

    rows, meta = select_channels(artifacts["tiny-dn/qk"], "l1", 50, expect=DN)
    sel = write_selection(tmp_path / "l1_50.parquet", rows, meta)
    job = {"method": "l1", "pct": 50.0, "stage": "pruned"}
    gdn_pruned = _fake_record(tmp_path / "gdn", "tiny-gdn", "gated_deltanet", "l1", 50.0)
    with pytest.raises(ArtifactError, match=re.escape(f"{gdn_pruned / 'prune_record.json'} was written for model "
                                                      "'tiny-gdn'")):
        rank_analysis(gdn_pruned, RankSettings(), DN, tmp_path / "rank.json", selection=sel,
                      activations=artifacts["tiny-dn/acts"], extra=job)
    dn_pruned = _fake_record(tmp_path / "dn", "tiny-dn", "delta_net", "l1", 50.0)
    acts = artifacts["tiny-gdn/acts"]
    with pytest.raises(ArtifactError, match=re.escape(f"{acts} was written for model 'tiny-gdn'")):
        rank_analysis(dn_pruned, RankSettings(), DN, tmp_path / "rank.json", selection=sel, activations=acts,
                      extra=job)


# ---- 4. artifacts that cannot be read ----------------------------------------------------------------------------
def _truncate(src: Path, dest: Path, n: int = 100) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(src.read_bytes()[:n])
    return dest


@pytest.mark.parametrize("name, rule", [("qk.h5", "qk_weights"), ("activations.h5", "calibrate"),
                                        ("grad_scores.h5", "grad_scores")])
@pytest.mark.parametrize("keep_bytes", [100, 5000])
def test_truncated_hdf5_names_the_rule_that_rebuilds_it(artifacts, tmp_path, name, rule, keep_bytes):
    from statereduce.core.h5files import H5Artifact

    bad = _truncate(artifacts["tiny-dn/acts"], tmp_path / name, keep_bytes)
    for read in (lambda a: a.attrs(), lambda a: a.layers(), lambda a: a.read(0, ["K"])):
        with pytest.raises(ArtifactError) as err:
            read(H5Artifact(bad))
        assert re.fullmatch(rf"{re.escape(str(bad))} is not a readable HDF5 file \(.+\); delete it and rerun "
                            rf"\(rule {rule} rebuilds it\)", _one_line(err))


def test_selection_job_reports_a_truncated_input(artifacts, tmp_path):
    bad = _truncate(artifacts["tiny-dn/acts"], tmp_path / "calib" / "default" / "activations.h5")
    with pytest.raises(ArtifactError, match=r"activations\.h5 is not a readable HDF5 file .*rule calibrate rebuilds"):
        select_channels(artifacts["tiny-dn/qk"], "drrqr", 50, activations=bad, expect=DN)
    bad = _truncate(artifacts["tiny-dn/qk"], tmp_path / "weights" / "qk.h5")
    with pytest.raises(ArtifactError, match=r"qk\.h5 is not a readable HDF5 file .*rule qk_weights rebuilds"):
        select_channels(bad, "l1", 50, expect=DN)


def test_missing_dataset_and_missing_file(artifacts, tmp_path):
    from statereduce.core.h5files import H5Artifact

    with pytest.raises(ArtifactError,
                       match=r"qk\.h5 has no dataset layer_000/K; delete it and rerun \(rule qk_weights"):
        H5Artifact(artifacts["tiny-dn/qk"]).read(0, ["K"])
    with pytest.raises(FileNotFoundError, match=r"activations\.h5 does not exist; rule calibrate builds it$"):
        H5Artifact(tmp_path / "activations.h5").attrs()


def test_unreadable_selection_names_select_channels(artifacts, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows, meta = select_channels(artifacts["tiny-dn/qk"], "l1", 50, expect=DN)
    good = write_selection(tmp_path / "good.parquet", rows, meta)
    text = tmp_path / "l1_50.parquet"
    text.write_text("layer,head,keep\n0,0,[1, 2]\n")
    cut = _truncate(good, tmp_path / "l1_75.parquet")
    for bad in (text, cut):
        with pytest.raises(ArtifactError) as err:
            read_selection(bad)
        assert re.fullmatch(rf"{re.escape(str(bad))} is not a readable Parquet file \(.+\); delete it and rerun "
                            r"\(rule select_channels rebuilds it\)", _one_line(err))
    plain = tmp_path / "rand_50.parquet"
    pq.write_table(pa.table({"layer": [0], "head": [0], "keep": [[1, 2]]}), plain)
    with pytest.raises(ArtifactError, match=r"rand_50\.parquet is not a selection file \(it has no statereduce "
                                            r"metadata\); delete it and rerun \(rule select_channels"):
        read_selection(plain)


def test_unreadable_prune_record(tmp_path):
    from statereduce.stages.prune import check_prune_record

    (tmp_path / "prune_record.json").write_text('{"family": "delta_net", ')
    with pytest.raises(ArtifactError, match=r"prune_record\.json is not a readable JSON file \(.+\); delete it and "
                                            r"rerun \(rule prune rebuilds it\)$"):
        check_prune_record(tmp_path, DN)


# ---- 3. a local checkpoint path that is not a checkpoint --------------------------------------------------------
def test_local_checkpoint_must_be_a_folder_with_config_json(shipped_config, tmp_path):
    import copy

    from statereduce.config import ConfigError, validate_config

    def validate(local):
        cfg = copy.deepcopy(shipped_config)
        cfg["models"]["dn370m"]["local"] = str(local)
        return validate_config(cfg)

    expected = "expected an HF checkpoint folder with config.json and its weights"
    with pytest.raises(ConfigError) as err:
        validate("/nonexistent/ckpt")
    assert _one_line(err) == f"models.dn370m.local: '/nonexistent/ckpt' does not exist; {expected}"
    (tmp_path / "weights.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError,
                       match=rf"^models\.dn370m\.local: '.*weights\.safetensors' is not a folder; {expected}$"):
        validate(tmp_path / "weights.safetensors")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    with pytest.raises(ConfigError, match=rf"^models\.dn370m\.local: '{re.escape(str(folder))}' has no config\.json"):
        validate(folder)
    (folder / "config.json").write_text("{}")
    with pytest.raises(ConfigError) as err:
        validate(folder)
    assert _one_line(err) == (f"models.dn370m.local: '{folder}' has no weights (*.safetensors or pytorch_model*.bin); "
                              f"{expected}")
    (folder / "model.safetensors").write_bytes(b"")
    assert validate(folder)["models"]["dn370m"]["local"] == str(folder)


# ---- 2. a requested path naming something unknown -----------------------------------------------------------------
@pytest.mark.parametrize("target, message", [
    ("results/tiny-dn/foo_75/eval.json",
     "unknown selector 'foo' in method token 'foo'; valid: drrqr, ghost, grad, l1, pca, pca-adv, rand, swanda"),
    ("results/nomodel/drrqr_75/eval.json",
     "unknown model 'nomodel'; valid: codestral7b, dn1.3b, dn370m, gdn1.3b, gdn370m, mamba2-370m, qwen35-9b, "
     "tiny-dn, tiny-dn-shared, tiny-dn-shared-all, tiny-gdn, tiny-mamba2, tiny-qwen35"),
    ("results/tiny-mamba2/drrqr_99.5/eval.json",
     "model 'tiny-mamba2' at pct 99.5: pct=99.5 removes every channel of d_k=64 (keeps 0); use a smaller pct"),
    ("results/tiny-dn/calib/bogus/activations.h5", "unknown calibration 'bogus'; valid: default, n16, prose, seed1"),
    ("results/tiny-gdn/select/drrqr.bogus_75.parquet",
     "method 'drrqr.bogus' names calibration 'bogus'; valid: n16, prose, seed1"),
    ("results/tiny-dn/drrqr_7x5/eval.json", "pct '7x5' in 'drrqr_7x5' is not a number such as 75 or 37.5"),
    ("results/tiny-dn/drrqr_100/rft/eval.json", "pct 100.0 is outside (0, 100)"),
    ("results/tiny-dn/drrqr_0.5/eval.json",
     "model 'tiny-dn' at pct 0.5: pct 0.5 removes no key channel of d_k=64 (round(64*0.5/100) = 0); pcts are percent "
     "of channels removed, e.g. drrqr_50 removes half"),
    ("results/tiny-gdn/select/grad-v_0.5.parquet",
     "model 'tiny-gdn' at pct 0.5: pct 0.5 removes no value channel of d_v=64 (round(64*0.5/100) = 0); pcts are "
     "percent of channels removed, e.g. drrqr_50 removes half"),
    ("results/tiny-gdn/grad-kv_0.5/eval.json",
     "model 'tiny-gdn' at pct 0.5: pct 0.5 removes no channel of the d_k x d_v = 64 x 64 state (round(64*0.5/100) = "
     "0); pcts of a joint cut are percent of the state removed, e.g. drrqr-kv_50 removes half"),
    ("results/tiny-dn/drrqr@sens_0.5/eval.json",
     "model 'tiny-dn' at pct 0.5: pct 0.5 removes no key channel of d_k=64"),
    ("results/tiny-dn/drrqr_1.6/eval.json", None),
    ("results/tiny-dn/evals/eval.json", "'evals' is neither <method>_<pct> (e.g. drrqr_75) nor one of base, baseline,"),
    ("results/tiny-dn/baseline/eval.json", None),
    ("results/tiny-dn/drrqr_75/export/merged/README.md",
     "export of 'merged': valid: export/pruned/README.md, export/rft/README.md"),
    ("results/tiny-dn/drrqr@sens_75/export/rft/README.md", None),
    ("results/tiny-dn/select/l1-q.prose_75.parquet", None),
    ("results/tables/comparison.md", None),
])
def test_check_target(shipped_config, target, message):
    from statereduce.config import ConfigError, check_target, validate_config

    cfg = validate_config(shipped_config)
    if message is None:
        check_target(cfg, target)
        return
    with pytest.raises(ConfigError) as err:
        check_target(cfg, target)
    assert _one_line(err).startswith(f"{target}: {message}")


@pytest.mark.parametrize("spelling", ["50.0", "050", "50.00", "5e1"])
@pytest.mark.parametrize("template", ["results/tiny-dn/drrqr_{}/eval.json", "results/tiny-dn/select/drrqr_{}.parquet",
                                      "results/tiny-gdn/grad.prose_{}/rft/eval.json"])
def test_a_ratio_spelled_otherwise_is_refused_naming_its_one_spelling(shipped_config, template, spelling):
    """One spelling per ratio (layout.format_pct's): 50.0, 050, 50.00 and 5e1 would each start a chain of their own
    for the same work; they are refused in one line that names the target as it is written."""
    from statereduce.config import ConfigError, check_target, validate_config

    cfg = validate_config(shipped_config)
    check_target(cfg, template.format("50"))
    target = template.format(spelling)
    with pytest.raises(ConfigError) as err:
        check_target(cfg, target)
    assert _one_line(err) == (f"{target}: pct {spelling!r} is written '50' in paths (one spelling per ratio): "
                              f"{template.format('50')}")


def _checkpoint_entries() -> list[str]:
    import yaml
    from _paths import ROOT

    models = yaml.safe_load((ROOT / "config.yaml").read_text())["models"]
    return sorted(name for name, m in models.items() if "hub" in m or "local" in m)


@pytest.mark.parametrize("model", _checkpoint_entries())
def test_every_hub_and_local_entry_refuses_an_impossible_ratio(shipped_config, model):
    """Each hub or local entry of config.yaml knows its head sizes before any job (a hub entry's ``dims``), or has
    no checkpoint yet: a ratio that keeps no channel is refused in one line either way, never planned."""
    from statereduce.config import ConfigError, check_target, validate_config

    cfg = validate_config(shipped_config)
    target = f"results/{model}/drrqr_99.9/eval.json"
    with pytest.raises(ConfigError) as err:
        check_target(cfg, target)
    line = _one_line(err)
    if cfg["models"][model].get("hub") or cfg["models"][model].get("local"):
        assert re.fullmatch(rf"{re.escape(target)}: model '{re.escape(model)}' at pct 99\.9: pct=99\.9 removes every "
                            r"channel of d_k=\d+ \(keeps 0\); use a smaller pct", line), line
    else:
        assert line == f"{target}: model '{model}' has no checkpoint: set models.{model}.local (or hub)"


def test_gdn13b_has_its_checkpoints_head_sizes(shipped_config):
    """m-a-p/1.3B-100B-GatedDeltaNet-pure loaded by fla has 1,466,343,808 parameters and 8 per-head D scalars per
    layer: hidden 2048, 24 layers, 8 heads of d_k = d_v = 256 is the fla layout of exactly that count."""
    assert shipped_config["models"]["gdn1.3b"]["dims"] == {"num_heads": 8, "head_k_dim": 256, "head_v_dim": 256}
    from statereduce.config import check_reduction, validate_config

    assert check_reduction(validate_config(shipped_config), "gdn1.3b", 75) == 64


@pytest.mark.parametrize("drop", [("dims",), ("dims", "head_v_dim")], ids=["no-dims", "no-head_v_dim"])
def test_a_hub_entry_needs_all_its_dims(shipped_config, drop):
    import copy

    from statereduce.config import ConfigError, validate_config

    cfg = copy.deepcopy(shipped_config)
    block = cfg["models"]["dn1.3b"]
    for key in drop[:-1]:
        block = block[key]
    del block[drop[-1]]
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    where = ".".join(("models", "dn1.3b", *drop[:-1]))
    assert _one_line(err) == (f"config error at {where}: '{drop[-1]}' is a required property; a hub model needs dims: "
                              "{num_heads, head_k_dim, head_v_dim} (its checkpoint's head sizes), so that an "
                              "impossible ratio fails before any job runs")


def _dry_run(workdir: Path, *targets: str, cfg: dict | None = None) -> subprocess.CompletedProcess:
    """``snakemake -n --quiet targets`` of the repository's workflow in ``workdir`` with ``cfg`` (default: the shipped
    one); ``--quiet`` last (it takes every word after it)."""
    return snakemake(workdir, *targets, "-n", "--quiet", cfg=cfg)


@pytest.mark.parametrize("target, message", [
    ("results/tiny-dn/foo_75/eval.json",
     "unknown selector 'foo' in method token 'foo'; valid: drrqr, ghost, grad, l1, pca, pca-adv, rand, swanda"),
    ("results/nomodel/drrqr_75/eval.json", "unknown model 'nomodel'; valid: "),
    ("results/tiny-dn/drrqr_0.5/eval.json",
     "model 'tiny-dn' at pct 0.5: pct 0.5 removes no key channel of d_k=64 (round(64*0.5/100) = 0); pcts are percent "
     "of channels removed, e.g. drrqr_50 removes half"),
])
def test_unknown_part_of_a_target_fails_before_any_job(tmp_path, target, message):
    out = _dry_run(tmp_path, "all", target)
    text = out.stdout + out.stderr
    assert out.returncode != 0
    lines = text.splitlines()
    hits = [i for i, line in enumerate(lines) if line.startswith(f"{target}: {message}")]
    assert hits and lines[hits[0] - 1].startswith("WorkflowError"), text  # one line, Snakemake's WorkflowError
    assert "No rule to produce" not in text and "rule " not in text  # nothing was planned


def test_rule_names_and_known_paths_still_plan(tmp_path):
    out = _dry_run(tmp_path, "all_paper", "results/tiny-dn/drrqr.prose_75/eval.json",
                   "results/tiny-gdn/select/l1-k_50.parquet", "results/tiny-dn/drrqr_1.6/eval.json")
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]


def test_hub_models_of_every_family_plan_offline(tmp_path):
    targets = [f"results/{m}/drrqr_50/eval.json" for m in ("codestral7b", "mamba2-370m", "qwen35-9b", "gdn1.3b")]
    out = _dry_run(tmp_path, *targets)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]


def _fake_hub_cache(root: Path, repo: str, model_type: str) -> Path:
    """A Hugging Face hub cache holding only ``repo``'s config.json at ``main`` (the layout huggingface_hub reads)."""
    sha = "0" * 40
    folder = root / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(sha)
    (folder / "snapshots" / sha).mkdir(parents=True)
    (folder / "snapshots" / sha / "config.json").write_text(f'{{"model_type": "{model_type}"}}')
    return root


@pytest.mark.parametrize("model, model_type, family", [("codestral7b", "llama", "mamba2"),
                                                       ("qwen35-9b", "qwen3_next", "qwen3_5")])
def test_hub_checkpoint_of_another_family_fails_validation(shipped_config, tmp_path, monkeypatch, model, model_type,
                                                             family):
    """A hub id whose cached config.json (or a local folder's) is not of the model's family fails in one line."""
    import copy

    import huggingface_hub.constants

    from statereduce.config import ConfigError, validate_config

    cfg = copy.deepcopy(shipped_config)
    repo = "someone/not-the-model"
    cfg["models"][model]["hub"]["id"] = repo
    validate_config(cfg)  # not in the cache: checked later, by the base job
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(_fake_hub_cache(tmp_path / "hub", repo,
                                                                                          model_type)))
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    valid = {"mamba2": "'mamba2'", "qwen3_5": "'qwen3_5_text', 'qwen3_5'"}[family]
    assert _one_line(err) == (f"models.{model}.hub.id: '{repo}' is a '{model_type}' checkpoint, not {family} "
                              f"(model_type {valid}); fix the id or the family")
    folder = tmp_path / "local"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "delta_net"}')
    cfg["models"][model]["hub"]["id"] = str(folder)
    with pytest.raises(ConfigError, match=rf"^models\.{model}\.hub\.id: '.*local' is a 'delta_net' checkpoint"):
        validate_config(cfg)


def test_base_job_checks_the_family_of_a_local_checkpoint(tmp_path):
    from statereduce.core.models import write_hub_source

    (tmp_path / "config.json").write_text('{"model_type": "mamba2"}')
    with pytest.raises(ValueError, match=r"is a 'mamba2' checkpoint, not qwen3_5"):
        write_hub_source(tmp_path / "base", str(tmp_path), None, "bfloat16", family="qwen3_5")
    assert not (tmp_path / "base").exists()
    write_hub_source(tmp_path / "base", str(tmp_path), None, "bfloat16", family="mamba2")
    assert (tmp_path / "base" / "source.json").is_file()


def test_speed_refuses_families_it_does_not_cover(shipped_config):
    from statereduce.config import ConfigError, model_speed, validate_config

    cfg = validate_config(shipped_config)
    with pytest.raises(ConfigError) as err:
        model_speed(cfg, "tiny-qwen35")
    assert _one_line(err) == ("model 'tiny-qwen35': the speed benchmarks do not cover family 'qwen3_5'; "
                              "they cover delta_net, gated_deltanet")


def test_missing_local_checkpoint_fails_the_dry_run(shipped_config, tmp_path):
    import copy

    cfg = copy.deepcopy(shipped_config)
    cfg["models"]["dn370m"]["local"] = "/nonexistent/ckpt"
    out = _dry_run(tmp_path, cfg=cfg)
    assert out.returncode != 0
    line = ("models.dn370m.local: '/nonexistent/ckpt' does not exist; "
            "expected an HF checkpoint folder with config.json and its weights")
    assert line in (out.stdout + out.stderr).splitlines()
