"""Fetch on a machine with network, then run offline (docs/offline.md): ``python -m statereduce.fetch`` downloads a hub
checkpoint pinned to a commit, streamed parquet row ranges, a non-streamed split and an lm-eval task's data from a
fake hub on loopback HTTP (``tests/_fakehub.py``) into a fresh ``HF_HOME``; the hub is then shut down and, with
``HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1``, the base source, the model, the splits and the task load from that cache
alone, while a split that was not fetched fails with the fetch hint. Each side runs in its own interpreter, since the
libraries read the variables when imported."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from _fakehub import FakeHub
from _paths import ROOT

from statereduce.core import data
from statereduce.fetch import checkpoint_files, merge, target_models

SHARDS = (30, 25, 40)  # rows per parquet file of the streamed dataset (row groups of 8)
WEB_SPLITS = {"train": "train[0:20]", "calib": "train[35:60]", "heldout": "train[90:95]"}


def parquet(columns: dict) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.table(columns), buf, row_group_size=8)
    return buf.getvalue()


def web_repo() -> dict[str, bytes]:
    """A FineWeb-like dataset: a named config over sample/tiny/*, three shards."""
    files = {"README.md": b"---\nconfigs:\n- config_name: sample-tiny\n  data_files:\n  - split: train\n"
                          b"    path: sample/tiny/*\n---\n"}
    start = 0
    for i, n in enumerate(SHARDS):
        files[f"sample/tiny/{i:03d}_00000.parquet"] = parquet({"text": [f"web row {j}" for j in range(start, start + n)],
                                                               "id": list(range(start, start + n))})
        start += n
    return files


QA_TASK = """\
task: fake_qa
dataset_path: fake-org/qa
output_type: multiple_choice
test_split: test
doc_to_text: "{{question}}"
doc_to_target: "{{label}}"
doc_to_choice: ["yes", "no"]
metric_list:
  - metric: acc
metadata:
  version: 1.0
"""

OFFLINE = """
import json, sys
from pathlib import Path
from statereduce.core import data
from statereduce.core.models import load_model, write_hub_source
from statereduce.eval.harness import build_task_manager
import torch

out = {}
cfg = json.loads(sys.argv[1])
rec = write_hub_source(cfg["base"], "fake-org/tiny-gdn", cfg["commit"], "float32", family="gated_deltanet")
out["resolved"] = rec["resolved"]
model, tok = load_model(cfg["base"])
with torch.no_grad():
    out["logits"] = list(model(torch.tensor([tok("abc")["input_ids"]])).logits.shape)
write_hub_source(cfg["base"] + "-main", "fake-org/tiny-gdn", "main", "float32", family="gated_deltanet")
same = load_model(cfg["base"] + "-main")[0]
out["same_weights"] = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), same.state_dict().values()))
out["calib"] = data.load_split(cfg["web"], "calib")
out["wiki"] = data.load_split(cfg["wiki"], "heldout")
try:
    data.load_split(cfg["web"], "train")
except ValueError as e:
    out["train_error"] = str(e)
task = build_task_manager(["fake_qa"], cfg["tasks"]).load(["fake_qa"])["tasks"]["fake_qa"]
out["qa_docs"] = len(list(task.test_docs()))
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def fetched(tmp_path_factory):
    """Serve the fake hub, run the fetch, shut the hub down: (paths, fetch output, requests, commit)."""
    from statereduce.core.models import save_checkpoint
    from statereduce.core.tokenizer import byte_level_tokenizer
    from _models import tiny_model

    tmp = tmp_path_factory.mktemp("fetch")
    ckpt = tmp / "ckpt"
    save_checkpoint(tiny_model("gated_deltanet"), byte_level_tokenizer(), ckpt)
    hub = FakeHub()
    try:
        model_files = {p.name: p.read_bytes() for p in ckpt.iterdir()}
        model_files |= {"pytorch_model.bin": b"not read", "README.md": b"# tiny", "extra/big.pth": b"x" * 1000}
        commit = hub.add("models", "fake-org/tiny-gdn", model_files)
        hub.add("datasets", "fake-org/web", web_repo())
        hub.add("datasets", "fake-org/wiki", {"data/test-00000-of-00001.parquet":
                                              parquet({"text": [f"wiki {i}" for i in range(12)]})})
        hub.add("datasets", "fake-org/qa", {"data/test-00000-of-00001.parquet":
                                            parquet({"question": [f"q{i}?" for i in range(6)], "label": [0, 1] * 3})})
        (tmp / "tasks").mkdir()
        (tmp / "tasks" / "fake_qa.yaml").write_text(QA_TASK)
        web = {"source": "hf", "path": "fake-org/web", "name": "sample-tiny", "streaming": True, "splits": WEB_SPLITS}
        wiki = {"source": "hf", "path": "fake-org/wiki", "splits": {"heldout": "test"}}
        overlay = {
            "targets": {"models": ["fake"], "methods": ["drrqr"], "pcts": [50]},
            "corpora": {"web": web, "wiki": wiki},
            "models": {"fake": {"family": "gated_deltanet", "hub": {"id": "fake-org/tiny-gdn", "revision": commit},
                                "dims": {"num_heads": 2, "head_k_dim": 32, "head_v_dim": 64},
                                "calibration": {"corpus": "web", "n_samples": 2, "seq_len": 8},
                                "eval": {"tasks": ["heldout"], "corpus": "wiki"}, "rft": {"activate": False}},
                       "fake-main": {"family": "gated_deltanet", "hub": {"id": "fake-org/tiny-gdn", "revision": "main"},
                                     "dims": {"num_heads": 2, "head_k_dim": 32, "head_v_dim": 64},
                                     "calibration": {"corpus": "web", "n_samples": 2, "seq_len": 8},
                                     "eval": {"tasks": ["heldout"], "corpus": "wiki"}, "rft": {"activate": False}}},
        }
        (tmp / "overlay.yaml").write_text(yaml.safe_dump(overlay))
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp / "hf"), "HF_HUB_OFFLINE": "0",
               "HF_DATASETS_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1"}
        cli = subprocess.run([sys.executable, "-m", "statereduce.fetch", "results/fake/drrqr_50/eval.json",
                              "results/fake-main/base/source.json", "--configfile", str(tmp / "overlay.yaml")], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=600)
        tasks = subprocess.run([sys.executable, "-c", "import sys; from statereduce.fetch import fetch_tasks; "
                                "fetch_tasks(['fake_qa'], include_path=sys.argv[1])", str(tmp / "tasks")],
                               cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    finally:
        hub.close()
    return {"tmp": tmp, "commit": commit, "web": web, "wiki": wiki, "cli": cli, "tasks": tasks,
            "requests": list(hub.requests)}


def test_fetch_downloads_what_the_target_reads(fetched):
    cli = fetched["cli"]
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert f"checkpoint fake-org/tiny-gdn@{fetched['commit']}: 5 files" in cli.stdout, cli.stdout
    assert f"checkpoint fake-org/tiny-gdn@main (commit {fetched['commit']}): 5 files" in cli.stdout, cli.stdout
    # shard 0 holds rows 0-29, shard 1 rows 30-54, shard 2 rows 55-94: calibration reads the last two
    assert "corpus web, calib = train[35:60]: 2 of 3 parquet files (95 rows in all)" in cli.stdout, cli.stdout
    assert "001_00000.parquet  rows 5-25 of 25" in cli.stdout and "002_00000.parquet  rows 0-5 of 40" in cli.stdout
    assert "corpus wiki, heldout = test: loaded into the datasets cache (12 documents)" in cli.stdout, cli.stdout
    assert "corpus web, train" not in cli.stdout and "corpus web, heldout" not in cli.stdout  # no RFT; eval: wiki
    assert "Run offline with: export HF_HOME=" in cli.stdout
    got = " ".join(fetched["requests"])
    assert "pytorch_model.bin" not in got and "extra/big.pth" not in got  # safetensors only, top-level files only
    assert "GET /datasets/fake-org/web/resolve/main/sample/tiny/000_00000.parquet" not in got
    tasks = fetched["tasks"]
    assert tasks.returncode == 0 and "lm-eval task fake_qa:" in tasks.stdout, tasks.stdout + tasks.stderr


def test_offline_run_reads_only_the_cache(fetched):
    tmp = fetched["tmp"]
    n_requests = len(fetched["requests"])
    env = {**os.environ, "HF_HOME": str(tmp / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_ENDPOINT": "http://127.0.0.1:9"}  # the hub is down; port 9 (discard) would refuse anyway
    args = {"base": str(tmp / "base"), "commit": fetched["commit"], "web": fetched["web"], "wiki": fetched["wiki"],
            "tasks": str(tmp / "tasks")}
    run = subprocess.run([sys.executable, "-c", OFFLINE, json.dumps(args)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = json.loads(run.stdout.split("RESULT ", 1)[1])
    assert out["resolved"] is False and out["logits"][:2] == [1, 3] and out["same_weights"]
    assert out["calib"] == [f"web row {j}" for j in range(35, 60)]
    assert out["wiki"] == [f"wiki {i}" for i in range(12)]
    assert "python -m statereduce.fetch" in out["train_error"], out  # shard 0 was never fetched
    assert out["qa_docs"] == 6
    assert len(fetched["requests"]) == n_requests


# ---- the pieces, without a hub ----------------------------------------------------------------------------------
def test_parquet_rows_equal_streaming_skip_take(tmp_path):
    """The shard reader gives exactly the rows datasets' streaming skip/take gives, across files and row groups."""
    import datasets

    files, start = [], 0
    for i, n in enumerate((37, 1, 55, 23)):
        f = tmp_path / f"part{i}.parquet"
        f.write_bytes(parquet({"text": [f"doc {j}" if j % 13 else None for j in range(start, start + n)]}))
        files.append(str(f))
        start += n
    spec = {"source": "hf", "path": "parquet", "data_files": {"train": files}, "streaming": True}
    shards = data.parquet_shards(spec, "train")
    assert [s.num_rows for s in shards.shards] == [37, 1, 55, 23]
    for a, b in ((0, None), (5, 17), (30, 95), (37, 38), (100, 200)):
        ds = datasets.load_dataset("parquet", data_files={"train": files}, split="train", streaming=True)
        ds = ds.skip(a) if a else ds
        ds = ds.take(b - a) if b else ds
        assert list(shards.rows("text", a, b)) == [r["text"] or "" for r in ds], (a, b)
    assert [(s.url, lo, hi) for s, lo, hi in shards.covering(30, 95)] == [(files[0], 30, 37), (files[1], 0, 1),
                                                                           (files[2], 0, 55), (files[3], 0, 2)]
    split = {**spec, "splits": {"train": "train[30:95]", "calib": "train[5:17]", "heldout": "train[100:]"}}
    assert data.load_split(split, "calib") == [f"doc {j}" for j in range(5, 17) if j % 13]
    with pytest.raises(ValueError, match="text_field 'body' not in dataset columns"):
        data.load_split({**split, "text_field": "body"}, "calib")


def test_checkpoint_files_prefer_safetensors():
    names = ["README.md", "config.json", "model.safetensors", "pytorch_model.bin", "tokenizer.json", "sub/x.json",
             "generation_config.json", "original/consolidated.00.pth"]
    assert checkpoint_files(names) == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
    assert checkpoint_files(["config.json", "pytorch_model.bin"]) == ["config.json", "pytorch_model.bin"]


def test_targets_name_models_and_calibration_variants(shipped_config):
    from statereduce.config import ConfigError, validate_config

    cfg = validate_config(merge(shipped_config, {"models": {"gdn1.3b": {"hub": {"revision": "0" * 39 + "a"}}}}))
    assert cfg["models"]["gdn1.3b"]["hub"]["revision"] == "0" * 39 + "a"  # a commit hash is a revision like any
    got = target_models(cfg, ["results/gdn1.3b/drrqr.prose_50/eval.json", "results/tiny-dn/baseline/rank.json"])
    assert got == {"gdn1.3b": ({"default", "prose"}, False), "tiny-dn": ({"default"}, True)}
    assert set(target_models(cfg, ["all"])) == set(cfg["targets"]["models"])
    with pytest.raises(ConfigError, match="target 'results/nope/x_50/eval.json': expected all or all_paper"):
        target_models(cfg, ["results/nope/x_50/eval.json"])


def test_model_needs_of_a_hub_model(shipped_config):
    from statereduce.config import validate_config
    from statereduce.fetch import model_needs

    cfg = validate_config(shipped_config)
    needs = model_needs(cfg, "gdn1.3b")
    assert needs.hub == ("m-a-p/1.3B-100B-GatedDeltaNet-pure", "main")
    assert needs.splits == {"fineweb": {"calib", "train"}}  # calibration and RFT; no heldout task
    assert "arc_easy" in needs.tasks and "niah_single_1" in needs.tasks
    assert needs.metadata["tokenizer"] == "m-a-p/1.3B-100B-GatedDeltaNet-pure"
    assert model_needs(cfg, "tiny-dn").splits == {}  # embedded corpus: nothing to download
