"""Tiny-model configs, model loading (checkpoint folder and source.json) and pretraining."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from _models import SMALL, pretrain, tiny_arch
from safetensors.torch import load_file

from statereduce.stages import pretrain as pt
from statereduce.core.models import load_model, tiny_config, write_hub_source
from statereduce.stages.pretrain import lr_at
from statereduce.common.settings import TrainSettings

CORPUS = {"source": "embedded", "max_bytes": 600_000}
ARCH = {family: tiny_arch(family, small=True, byte_vocab=True) for family in SMALL}  # hidden 32, d_k 16
TRAIN = {
    "steps": 5,
    "batch_size": 2,
    "seq_len": 32,
    "lr": 1e-3,
    "warmup": 2,
    "seed": 7,
    "log_every": 2,
    "eval_blocks": 2,
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One tiny checkpoint per family (5 steps)."""
    root = tmp_path_factory.mktemp("pretrain")
    out = {}
    for family, arch in ARCH.items():
        record = pretrain(family, arch, CORPUS, TRAIN, root / family / "base", log_path=root / f"{family}.jsonl")
        out[family] = (root / family / "base", record, root / f"{family}.jsonl")
    return out


def test_tiny_config_fields():
    dn = tiny_config(
        "delta_net", {"hidden_size": 128, "num_hidden_layers": 4, "num_heads": 2, "expand_k": 1.0, "expand_v": 1.0}
    )
    assert (dn.model_type, dn.vocab_size, dn.eos_token_id, dn.bos_token_id) == ("delta_net", 257, 256, 256)
    assert dn.fuse_cross_entropy is False and dn.pad_token_id is None
    assert int(dn.hidden_size * dn.expand_k) // dn.num_heads == 64
    gdn = tiny_config(
        "gated_deltanet", {"hidden_size": 128, "num_hidden_layers": 4, "num_heads": 2, "head_dim": 64, "expand_v": 1.0}
    )
    assert gdn.model_type == "gated_deltanet" and gdn.head_dim == 64 and gdn.vocab_size == 257
    with pytest.raises(ValueError, match=r"unknown arch key\(s\) \['head_dims'\] for family 'gated_deltanet'"):
        tiny_config("gated_deltanet", {"head_dims": 64})
    with pytest.raises(ValueError, match="unknown model family 'mamba9'"):
        tiny_config("mamba9", {})


def test_lr_schedule():
    cfg = TrainSettings(steps=101, warmup=10, lr=1e-3, min_lr=1e-4)
    assert lr_at(0, cfg) == pytest.approx(1e-4) and lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(10, cfg) == pytest.approx(1e-3) and lr_at(100, cfg) == pytest.approx(1e-4)
    assert lr_at(55, cfg) == pytest.approx(0.55e-3)
    lrs = [lr_at(s, cfg) for s in range(10, 101)]
    assert all(a >= b for a, b in itertools.pairwise(lrs))


def test_pretrain_record_and_logs(checkpoints):
    for family, (ckpt, record, log_path) in checkpoints.items():
        assert {"config.json", "model.safetensors", "pretrain.json", "train_log.jsonl", "tokenizer.json"} <= {
            p.name for p in ckpt.iterdir()
        }
        assert json.loads((ckpt / "pretrain.json").read_text()) == json.loads(json.dumps(record))
        assert record["family"] == family and record["train"]["steps"] == 5 and record["train_tokens"] == 5 * 2 * 32
        assert record["corpus"]["source"] == "embedded" and len(record["corpus"]["sha256"]) == 64
        for v in (record["final_train_loss"], record["eval_loss"]["calib"], record["eval_loss"]["heldout"]):
            assert math.isfinite(v) and 3.0 < v < 7.0  # about ln(257) = 5.55 after 5 steps
        lines = [json.loads(x) for x in (ckpt / "train_log.jsonl").read_text().splitlines()]
        assert [x["step"] for x in lines] == [2, 4, 5]
        assert lines[-1]["loss"] == record["final_train_loss"]
        assert {"loss", "lr", "tokens_per_s", "grad_norm"} <= set(lines[0])
        assert log_path.read_text() == (ckpt / "train_log.jsonl").read_text()
        assert not [p for p in ckpt.parent.iterdir() if p.name.startswith(".")], "temporary folder left behind"


def test_pretrain_deterministic(checkpoints, tmp_path):
    ckpt, record, _ = checkpoints["gated_deltanet"]
    again = pretrain("gated_deltanet", ARCH["gated_deltanet"], CORPUS, TRAIN, tmp_path / "again")
    a, b = load_file(ckpt / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert again["final_train_loss"] == record["final_train_loss"]
    other = pretrain("gated_deltanet", ARCH["gated_deltanet"], CORPUS, {**TRAIN, "seed": 8}, tmp_path / "other")
    c = load_file(tmp_path / "other" / "model.safetensors")
    assert not all(torch.equal(a[k], c[k]) for k in a)
    assert other["final_train_loss"] != record["final_train_loss"]


@pytest.mark.parametrize("family", list(ARCH))
def test_checkpoint_reloads(checkpoints, family):
    ckpt, _, _ = checkpoints[family]
    model, tok = load_model(ckpt)
    from statereduce.adapters import adapter_class

    assert not model.training and model.config.model_type in adapter_class(family).model_types
    assert getattr(model.config, "fuse_cross_entropy", False) is False
    ids = tok("def f(x):\n    return x", add_special_tokens=False)["input_ids"]
    assert ids == list(b"def f(x):\n    return x") and tok.eos_token_id == 256
    assert tok.decode(ids) == "def f(x):\n    return x"
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model(input_ids=x, labels=x)
    assert out.logits.shape == (1, len(ids), 257) and torch.isfinite(out.logits).all() and torch.isfinite(out.loss)


def test_load_model_from_source_json(checkpoints, tmp_path):
    ckpt, _, _ = checkpoints["delta_net"]
    base = tmp_path / "base"
    rec = write_hub_source(base, str(ckpt), revision=None, dtype="float32")
    import hashlib

    sha = rec.pop("sha256")  # a local folder's files, each hashed (statereduce.core.checkpoints)
    assert sha["model.safetensors"] == hashlib.sha256((ckpt / "model.safetensors").read_bytes()).hexdigest()
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(sha)
    assert rec == {
        "hub_id": str(ckpt),
        "revision": None,
        "requested_revision": None,
        "resolved": False,
        "dtype": "float32",
    }
    rec["sha256"] = sha
    assert json.loads((base / "source.json").read_text()) == rec
    assert [p.name for p in base.iterdir()] == ["source.json"]
    m_src, tok_src = load_model(base)
    m_dir, _ = load_model(ckpt)
    x = torch.tensor([list(b"import os\n")])
    with torch.no_grad():
        assert torch.equal(m_src(input_ids=x).logits, m_dir(input_ids=x).logits)
    assert tok_src.eos_token_id == 256
    m_bf16, _ = load_model(base, dtype="bfloat16")
    assert next(m_bf16.parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        write_hub_source(base, str(ckpt), dtype="fp8")
    with pytest.raises(ValueError, match="neither source.json nor config.json"):
        load_model(tmp_path / "empty")


def test_pretrain_learns(tmp_path):
    """A few dozen steps at a high learning rate clearly reduce the byte-level loss (fails if training is broken)."""
    cfg = {**TRAIN, "steps": 40, "batch_size": 4, "seq_len": 64, "lr": 1e-2, "warmup": 4, "log_every": 10}
    rec = pretrain("delta_net", ARCH["delta_net"], CORPUS, cfg, tmp_path / "learn")
    lines = [json.loads(x) for x in (tmp_path / "learn" / "train_log.jsonl").read_text().splitlines()]
    assert lines[0]["loss"] > 4.5 and rec["final_train_loss"] < lines[0]["loss"] - 1.0
    assert rec["eval_loss"]["heldout"] < 4.5


def test_train_cfg_errors(tmp_path):
    with pytest.raises(ValueError, match=r"unknown train key\(s\) \['step'\]"):
        pretrain("delta_net", ARCH["delta_net"], CORPUS, {"step": 3}, tmp_path / "x")
    with pytest.raises(ValueError, match="warmup must be in"):
        pretrain("delta_net", ARCH["delta_net"], CORPUS, {"steps": 3, "warmup": 3}, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_pretrain_recall_mix(checkpoints, tmp_path, monkeypatch):
    """recall_mix puts recall documents into the training stream only; calib/held-out blocks stay corpus text."""
    mix = {"fraction": 0.5, "n_pairs": [2, 4], "seed": 3}
    rec = pretrain("delta_net", ARCH["delta_net"], CORPUS, TRAIN, tmp_path / "mixed", recall_mix=mix)
    assert rec["recall_mix"]["n_pairs"] == [2, 4] and rec["recall_mix"]["seed"] == 3 and rec["recall_mix"]["n_docs"] > 0
    assert 0.5 <= rec["recall_mix"]["byte_share"] < 0.51
    assert "recall_mix" not in checkpoints["delta_net"][1]  # absent: the record (and training) as before
    a = load_file(checkpoints["delta_net"][0] / "model.safetensors")
    b = load_file(tmp_path / "mixed" / "model.safetensors")
    assert not all(torch.equal(a[k], b[k]) for k in a)

    calls: list[dict] = []
    blocks: list[torch.Tensor] = []

    def fake_loop(model, stream, cfg, log_paths, desc="pretrain", step_offset=0, append=False, labels=None,
                  until=None):
        calls.append({"stream": stream, "cfg": cfg, "step_offset": step_offset, "append": append, "labels": labels,
                      "until": until})
        return {"steps": cfg.steps, "train_tokens": 10, "train_seconds": 1.0, "train_cpu_seconds": 1.0,
                "tokens_per_s": 10.0, **({"check": {}} if until else {})}

    def fake_loss(model, x, batch_size=8):
        blocks.append(x)
        return 0.0

    monkeypatch.setattr(pt, "train_loop", fake_loop)
    monkeypatch.setattr(pt, "mean_loss", fake_loss)
    pretrain("delta_net", ARCH["delta_net"], CORPUS, TRAIN, tmp_path / "a")
    pretrain("delta_net", ARCH["delta_net"], CORPUS, TRAIN, tmp_path / "b", recall_mix=mix)
    plain, mixed = calls[0]["stream"], calls[1]["stream"]
    assert mixed.numel() >= 2 * plain.numel() - 1000
    from statereduce.eval.recall import recall_train_docs

    assert recall_train_docs(1, [2, 4], seed=3)[0].encode() in bytes(mixed[mixed < 256].tolist())
    assert (
        len(blocks) == 4 and torch.equal(blocks[0], blocks[2]) and torch.equal(blocks[1], blocks[3])
    )  # calib, heldout
    # pure_steps: a first phase on recall documents only (own lr and schedule), then the corpus phase, logged on
    rec = pretrain(
        "delta_net",
        ARCH["delta_net"],
        CORPUS,
        TRAIN,
        tmp_path / "c",
        recall_mix={**mix, "pure_steps": 3, "pure_lr": 2e-3},
    )
    first, second = calls[2:]
    assert first["cfg"].steps == 3 and first["cfg"].lr == 2e-3 and first["cfg"].warmup == TRAIN["warmup"]
    assert first["cfg"].min_lr is None  # the recall phase's cosine ends at a tenth of its peak
    assert (first["step_offset"], first["append"], second["step_offset"], second["append"]) == (0, False, 3, True)
    assert second["cfg"].steps == TRAIN["steps"] and torch.equal(second["stream"], mixed)
    pure = first["stream"]
    assert pure.numel() >= 3 * TRAIN["batch_size"] * TRAIN["seq_len"] - 1  # its bytes, less the last EOS
    assert set(bytes(pure[pure < 256].tolist()).decode()) <= set("abcdefghijklmnopqrstuvwxyz0123456789=\n")
    assert rec["train_tokens"] == 20 and rec["train_seconds"] == 2.0 and rec["recall_mix"]["pure_seconds"] == 1.0
    assert first["labels"] is None and first["until"] is None and rec["recall_mix"]["pure_steps_run"] == 3
    # answer_loss: labels on the answers only; until: a constant lr after the warmup and a check every check_every
    rec = pretrain("delta_net", ARCH["delta_net"], CORPUS, TRAIN, tmp_path / "d",
                   recall_mix={**mix, "pure_steps": 3, "answer_loss": True, "until": 0.5, "check_every": 2})
    first = calls[4]
    assert first["cfg"].min_lr == first["cfg"].lr and first["until"][1:] == (0.5, 2)
    labels = first["labels"]
    assert labels.shape == first["stream"].shape and 0 < (labels != -100).float().mean() < 0.3
    assert set(bytes(labels[labels != -100].tolist()).decode()) <= set("0123456789")
    with pytest.raises(ValueError, match=r"recall_mix fraction must be a number in \(0, 1\), got 1\.5"):
        pretrain("delta_net", ARCH["delta_net"], CORPUS, TRAIN, tmp_path / "x", recall_mix={"fraction": 1.5})
    assert not (tmp_path / "x").exists()


def test_pretrain_recall_phase_trains_and_logs(tmp_path):
    """A real two-phase run: one log with the steps of both phases, the first at the recall phase's learning rate."""
    cfg = {**TRAIN, "steps": 4, "warmup": 1}
    mix = {"fraction": 0.3, "n_pairs": [1, 2], "pure_steps": 2, "pure_lr": 5e-4}
    rec = pretrain("gated_deltanet", ARCH["gated_deltanet"], CORPUS, cfg, tmp_path / "m", recall_mix=mix)
    lines = [json.loads(x) for x in (tmp_path / "m" / "train_log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [2, 4, 6] and lines[0]["lr"] <= 5e-4 < lines[1]["lr"]
    assert rec["train_tokens"] == 6 * 2 * 32 and rec["recall_mix"]["pure_steps"] == 2


def test_recall_phase_until_stops_at_the_check(tmp_path):
    """until: the recall phase ends at the first check that reaches the target; a target it never reaches runs every
    step, checking at each multiple of check_every and at the last step; the checks are logged."""
    cfg = {**TRAIN, "steps": 2, "warmup": 1}
    mix = {"n_pairs": [1, 2], "pure_steps": 5, "answer_loss": True, "check_every": 2}
    rec = pretrain("delta_net", ARCH["delta_net"], CORPUS, cfg, tmp_path / "a", recall_mix={**mix, "until": 1e-9})
    assert rec["recall_mix"]["pure_steps_run"] == 2 and rec["recall_mix"]["pure_check"]["step"] == 2
    lines = [json.loads(x) for x in (tmp_path / "a" / "train_log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [2, 4] and "recall_acc" in lines[0] and "recall_acc" not in lines[1]
    assert rec["train_tokens"] == 4 * 2 * 32
    rec = pretrain("delta_net", ARCH["delta_net"], CORPUS, cfg, tmp_path / "b", recall_mix={**mix, "until": 1.0})
    lines = [json.loads(x) for x in (tmp_path / "b" / "train_log.jsonl").read_text().splitlines()]
    assert rec["recall_mix"]["pure_steps_run"] == 5
    assert [x["step"] for x in lines if "recall_acc" in x] == [2, 4, 5]
    assert 0.0 <= rec["recall_mix"]["pure_check"]["recall_acc"] <= 1.0


@pytest.mark.parametrize(("mix", "message"), [
    ({"until": 0.8}, r"recall_mix until=0.8 needs pure_steps >= 1"),
    ({"pure_steps": 3, "until": 1.5}, r"recall_mix until must be an accuracy in \(0, 1\] or null, got 1.5"),
    ({"answer_loss": "yes"}, r"recall_mix answer_loss must be true or false, got 'yes'"),
    ({"check_every": 0}, r"recall_mix check_every must be an int >= 1, got 0"),
])
def test_recall_mix_refuses(mix, message, tmp_path):
    with pytest.raises((ValueError, TypeError), match=message):
        pretrain("delta_net", ARCH["delta_net"], CORPUS, TRAIN, tmp_path / "x", recall_mix=mix)
    assert not (tmp_path / "x").exists()
