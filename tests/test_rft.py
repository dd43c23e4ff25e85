"""Recovery fine-tuning (statereduce.stages.rft): LoRA + distillation, merge, resume, reload.

The fixtures pretrain one tiny model per family for a few dozen steps on the embedded corpus (so that
pruning does measurable damage), prune 75% of its key channels at random and save both checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import _fresh as fresh
import torch
from _models import pretrain, random_keep, tiny_arch, tiny_inputs, tiny_model
from _paths import ROOT
from safetensors.torch import load_file

from statereduce.stages import rft as ft
from statereduce.adapters import get_adapter
from statereduce.core.data import load_split
from statereduce.core.models import load_model
from statereduce.stages.pretrain import _eval_blocks, mean_loss
from statereduce.stages.prune import prune_model, save_pruned
from statereduce.common.settings import DistillSettings, LoraSettings, RftSettings
from statereduce.core.tokenizer import byte_level_tokenizer

CORPUS = {"source": "embedded", "max_bytes": 600_000}
# tiny_model's shapes trained on the byte-level tokenizer, with Gated DeltaNet d_v = 32, Mamba-2 4 heads of 32 (chunk
# 32) and Qwen3.5 2 value heads of 32 in layers [linear, attention, linear]
ARCH = {
    "delta_net": tiny_arch("delta_net", byte_vocab=True),
    "gated_deltanet": tiny_arch("gated_deltanet", byte_vocab=True, expand_v=1.0),
    "mamba2": tiny_arch("mamba2", byte_vocab=True, num_heads=4, head_dim=32, chunk_size=32),
    "qwen3_5": tiny_arch("qwen3_5", byte_vocab=True, linear_num_value_heads=2, linear_value_head_dim=32,
                         layer_types=["linear_attention", "full_attention", "linear_attention"]),
}
FAMILIES = list(ARCH)
PRETRAIN = {"steps": 150, "batch_size": 4, "seq_len": 64, "lr": 1e-2, "warmup": 5, "seed": 0, "eval_blocks": 0}
RFT = {
    "n_samples": 32,
    "seq_len": 64,
    "batch_size": 4,
    "micro_batch_size": 2,
    "lr": 3e-3,
    "min_lr": 3e-4,
    "log_every": 2,
    "save_every": 2,
    "val_samples": 16,
}


@pytest.fixture(scope="module")
def pairs(built):
    """{family: (base dir, pruned dir)}: a briefly pretrained tiny model and its copy with 28 of its 32 key
    channels per head removed at random (87.5%, so that the damage is clear); built once (conftest's ``built``)."""

    def build(family: str, folder: Path) -> None:
        pretrain(family, ARCH[family], CORPUS, PRETRAIN, folder / "base")
        model, tok = load_model(folder / "base")
        meta = {"source": "base", "method": "rand", "pct": 87.5}  # the folder beside it
        save_pruned(model, tok, prune_model(model, random_keep(model, 4, seed=3), meta), folder / "pruned")

    out = {}
    for family in FAMILIES:
        folder = built(f"rft-pair-{family}", {"arch": ARCH[family], "corpus": CORPUS, "pretrain": PRETRAIN},
                       lambda f, family=family: build(family, f))
        out[family] = (folder / "base", folder / "pruned")
    return out


def _run(pair, out, **kw):
    base, pruned = pair
    kw.setdefault("resume_dir", out.parent / f".{out.name}_resume")
    return ft.fine_tune(pruned, base, out, RftSettings.from_dict({**RFT, **kw.pop("cfg", {})}), CORPUS, **kw)


# ---- settings and loss -----------------------------------------------------------------------------
def test_settings_defaults_are_the_papers():
    cfg = RftSettings()
    assert cfg.lora == LoraSettings(rank=32, alpha=64, dropout=0.0)
    assert cfg.distill == DistillSettings(temperature=2.0, kl_weight=1.0, lm_weight=0.0)
    assert (cfg.n_samples, cfg.seq_len, cfg.batch_size) == (32000, 2048, 16)
    assert (cfg.lr, cfg.min_lr, cfg.warmup_frac) == (1e-4, 1e-5, 0.05)
    assert ft.n_steps(cfg) == 2000 and ft._schedule(cfg).warmup == 100


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"lr_max": 1}, r"unknown rft key\(s\) \['lr_max'\]; valid: "),
        ({"lora": {"r": 8}}, r"unknown rft.lora key\(s\) \['r'\]"),
        ({"batch_size": 6, "micro_batch_size": 4}, "batch_size=6 is not a multiple of micro_batch_size=4"),
        ({"n_samples": 8, "batch_size": 16}, "n_samples=8 is smaller than one batch"),
        ({"precision": "fp16"}, "unknown rft precision 'fp16'; valid: auto, bf16, fp32"),
        ({"distill": {"kl_weight": 0.0, "lm_weight": 0.0}}, "not both 0"),
        ({"seq_len": 0}, "seq_len must be an integer >= 1, got 0"),
        ({"micro_batch_size": "max"}, "micro_batch_size must be an integer >= 1 or auto, got 'max'"),
        ({"keep": "first"}, "unknown rft keep 'first'; valid: best, last"),
        ({"best_metric": "kl"}, "unknown rft best_metric 'kl'; valid: ce, loss"),
        ({"val_samples": 0}, "rft keep: best needs validation sequences, got val_samples=0"),
        ({"val_samples": -1}, "val_samples must be an integer >= 0, got -1"),
        ({"val_seq_len": 1}, r"rft val_seq_len must be an integer >= 2 or null \(seq_len\), got 1"),
    ],
    ids=["unknown-key", "unknown-lora-key", "accumulation", "too-few-samples", "precision", "no-loss", "seq_len",
         "micro-batch", "keep", "best-metric", "best-without-validation", "val-samples",
         "val-seq-len"],
)
def test_settings_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        RftSettings.from_dict(overrides)


def test_micro_batch_is_auto_by_default_and_fits_the_measured_memory():
    assert RftSettings().micro_batch_size == "auto"
    # 1 sequence peaks at 10 bytes, 2 at 15: 5 per sequence, 5 besides; within 30 bytes up to 5 fit, 4 divides 16
    assert ft.fit_micro_batch(16, [10, 15], 30) == 4
    assert ft.fit_micro_batch(16, [10, 15], 1000) == 16
    assert ft.fit_micro_batch(6, [10, 15], 30) == 3
    assert ft.fit_micro_batch(16, [10], 1000) == 1  # 2 sequences did not fit
    assert ft.fit_micro_batch(16, [10, 15], 12) == 1  # not even 1 fits by the estimate: 1, and let it fail loudly


def test_auto_micro_batch_on_a_cpu_trains_as_micro_batch_one(pairs, tmp_path):
    """On a CPU ``auto`` is 1: the same run as ``micro_batch_size: 1``, bit for bit, and the record says so."""
    cfg = {"n_samples": 8, "log_every": 1}
    auto = _run(pairs["delta_net"], tmp_path / "auto", cfg={**cfg, "micro_batch_size": "auto"})
    one = _run(pairs["delta_net"], tmp_path / "one", cfg={**cfg, "micro_batch_size": 1})
    assert auto["micro_batch_size"] == one["micro_batch_size"] == 1 and "micro_batch_probe" not in auto
    a, b = load_file(tmp_path / "auto" / "model.safetensors"), load_file(tmp_path / "one" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_distill_loss_matches_hand_computation():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 5, 7, generator=g), torch.randn(2, 5, 7, generator=g)
    ids = torch.randint(0, 7, (2, 5), generator=g)
    loss, kl, ce = ft.distill_loss(s, t, ids, temperature=2.0, kl_weight=1.0, lm_weight=0.5)
    # float64 reference: mean over positions of sum_v p_t (log p_t - log p_s), softened by T = 2
    ps = np.exp(s.double().numpy() / 2) / np.exp(s.double().numpy() / 2).sum(-1, keepdims=True)
    pt = np.exp(t.double().numpy() / 2) / np.exp(t.double().numpy() / 2).sum(-1, keepdims=True)
    ref_kl = (pt * (np.log(pt) - np.log(ps))).sum(-1).mean()
    lsm = s.double().numpy()[:, :-1] - np.log(np.exp(s.double().numpy()[:, :-1]).sum(-1, keepdims=True))
    ref_ce = -np.take_along_axis(lsm, ids.numpy()[:, 1:, None], -1).mean()
    assert float(kl) == pytest.approx(ref_kl, rel=1e-5)
    assert float(ce) == pytest.approx(ref_ce, rel=1e-5)
    assert float(loss) == pytest.approx(4 * ref_kl + 0.5 * ref_ce, rel=1e-5)


def test_masked_distill_loss_counts_only_the_marked_positions():
    """With ``mask`` (validation rows right-padded to one length), KL is the mean over the marked positions and CE
    over the next tokens both of whose positions are marked: a float64 sum over each row's own prefix."""
    g = torch.Generator().manual_seed(1)
    s, t = torch.randn(3, 6, 7, generator=g), torch.randn(3, 6, 7, generator=g)
    ids = torch.randint(0, 7, (3, 6), generator=g)
    lengths = [6, 4, 2]
    mask = torch.arange(6)[None] < torch.tensor(lengths)[:, None]
    _, kl, ce = ft.distill_loss(s, t, ids, temperature=2.0, mask=mask)
    kl_sum = ce_sum = 0.0
    for b, n in enumerate(lengths):
        ls = torch.log_softmax(s[b, :n].double() / 2, -1)
        lt = torch.log_softmax(t[b, :n].double() / 2, -1)
        kl_sum += float((lt.exp() * (lt - ls)).sum())
        ce_sum += float(torch.nn.functional.cross_entropy(s[b, : n - 1].double(), ids[b, 1:n], reduction="sum"))
    assert float(kl) == pytest.approx(kl_sum / sum(lengths), rel=1e-5)
    assert float(ce) == pytest.approx(ce_sum / sum(n - 1 for n in lengths), rel=1e-5)
    full = ft.distill_loss(s, t, ids, temperature=2.0, mask=torch.ones(3, 6, dtype=torch.bool))
    assert all(float(a) == pytest.approx(float(b), rel=1e-6) for a, b in zip(full, ft.distill_loss(s, t, ids)))


def test_distill_loss_is_zero_when_student_is_teacher():
    model = tiny_model("delta_net")
    x = tiny_inputs(2, 16)
    with torch.no_grad():
        a, b = model(input_ids=x).logits, model(input_ids=x).logits
    loss, kl, _ = ft.distill_loss(a, b, x)
    assert float(kl) == 0.0 and float(loss) == 0.0


# ---- which modules train ---------------------------------------------------------------------------
def test_rft_modules_of_the_new_families():
    """Mamba-2: LoRA on in_proj only (peft refuses out_proj), conv1d and norms fully. Qwen3.5: only the Gated
    DeltaNet layers (scope recurrent): their four input projections and out_proj, conv1d and norm."""
    lora, full, scope = ft.rft_modules(tiny_model("mamba2"))
    assert scope == "all"
    assert lora == ["backbone.layers.0.mixer.in_proj", "backbone.layers.1.mixer.in_proj"]
    assert {"backbone.layers.0.mixer.conv1d", "backbone.layers.0.mixer.norm", "backbone.layers.0.norm",
            "backbone.norm_f"} <= set(full)
    lora, full, scope = ft.rft_modules(tiny_model("qwen3_5"))
    assert scope == "recurrent"
    projections = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
    assert sorted(lora) == sorted(f"model.layers.{i}.linear_attn.{p}" for i in (0, 1) for p in projections)
    assert sorted(full) == sorted(f"model.layers.{i}.linear_attn.{m}" for i in (0, 1) for m in ("conv1d", "norm"))


def test_every_family_declares_its_rft_targets_and_one_without_is_refused():
    """What RFT trains is each family's own fact: every registered family declares it (no default), and a family
    spec without one is refused in one line that names the families that declare theirs."""
    from statereduce.families.base import FamilySpec, RftTargets, family_names

    assert all(isinstance(ft.rft_targets(family), RftTargets) for family in family_names())
    assert ft.rft_targets("qwen3_5").default_scope == "recurrent"
    assert ft.rft_targets("mamba2").lora_excluded == ("out_proj",)

    class Undeclared(FamilySpec):
        family = "undeclared"

    refused = r"^family 'undeclared' declares no RFT targets .*families that do: .*qwen3_5"
    with pytest.raises(ValueError, match=refused) as err:
        ft.targets_of(Undeclared)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("family", ["delta_net", "gated_deltanet"])
def test_rft_modules(family):
    model = tiny_model(family)
    lora, full, scope = ft.rft_modules(model)
    assert scope == "all"
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(lora) == linears - {"lm_head"}  # every projection of every block, never the LM head
    assert any(n.endswith("attn.q_proj") for n in lora) and any(n.endswith("mlp.down_proj") for n in lora)
    convs = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Conv1d)}
    assert convs and convs <= set(full)
    assert (
        "model.norm" in full and any(n.endswith("attn_norm") for n in full) and any(n.endswith("o_norm") for n in full)
    )
    assert not any("embed" in n for n in lora + full)
    rec_lora, rec_full, _ = ft.rft_modules(model, "recurrent")
    assert rec_lora and all(".attn." in n for n in rec_lora + rec_full)
    assert not any("mlp" in n or n.endswith("attn_norm") for n in rec_lora + rec_full)
    with pytest.raises(ValueError, match="unknown RFT scope 'mixers'; valid: all, recurrent"):
        ft.rft_modules(model, "mixers")


@pytest.mark.parametrize("family", FAMILIES)
def test_merge_equals_unmerged_peft_model(family):
    model = tiny_model(family)
    cfg = RftSettings.from_dict({"lora": {"rank": 4, "alpha": 8}})
    torch.manual_seed(0)
    peft_model, _ = ft.attach_lora(model, cfg)
    with torch.no_grad():  # LoRA B starts at zero: give every trainable tensor a non-trivial value
        for p in peft_model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    x = tiny_inputs(2, 24)
    with torch.no_grad():
        unmerged = peft_model(input_ids=x).logits
        merged_model = ft.merge(peft_model)
        merged = merged_model(input_ids=x).logits
    assert type(merged_model).__name__.endswith("ForCausalLM")
    assert not any("lora" in n or "modules_to_save" in n for n, _ in merged_model.named_parameters())
    torch.testing.assert_close(merged, unmerged, rtol=1e-5, atol=1e-5)


# ---- training on real (briefly pretrained) checkpoints --------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_only_intended_parameters_change(pairs, family, tmp_path):
    _, pruned = pairs[family]
    before = load_file(str(pruned / "model.safetensors"))
    out = tmp_path / "rft"
    record = _run(pairs[family], out, cfg={"keep": "last"})  # the trained weights, whatever validation says
    after = load_file(str(out / "model.safetensors"))
    assert set(after) == set(before) and all(after[k].shape == before[k].shape for k in before)
    lora, full = set(record["modules"]["lora_targets"]), set(record["modules"]["trained_fully"])
    assert record["modules"]["conv_sharing"] == "none"  # stock filters train one per channel
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    for k in before:
        module = k.rsplit(".", 1)[0]
        if module in lora or any(module == f or module.startswith(f + ".") for f in full):
            continue
        assert k not in changed, f"{k} is outside the RFT scope but changed"
    frozen = [k for k in before if "embed" in k or k.startswith("lm_head") or k.endswith(("A_log", "dt_bias"))]
    assert frozen and not set(frozen) & changed
    assert any(k.rsplit(".", 1)[0] in lora for k in changed) and any("conv1d" in k for k in changed)
    assert any(k.endswith("norm.weight") for k in changed)
    if family == "qwen3_5":  # the hybrid: every tensor outside the Gated DeltaNet layers stays bit for bit
        assert changed and all(".linear_attn." in k for k in changed)
        assert any("self_attn" in k for k in before)


# Not mamba2: random pruning of the briefly trained tiny Mamba-2 costs it under 0.01 nats (its B/C state barely
# matters after 150 steps), so there is nothing to recover; its RFT is covered by the tests above.
@pytest.mark.parametrize("family", ["delta_net", "gated_deltanet", "qwen3_5"])
def test_short_rft_lowers_heldout_loss(pairs, family, tmp_path):
    base, pruned = pairs[family]
    tok = byte_level_tokenizer()
    blocks = _eval_blocks(tok, CORPUS, "heldout", 16, 64, seed=1)
    pre = mean_loss(load_model(pruned)[0], blocks)
    teacher = mean_loss(load_model(base)[0], blocks)
    kept = {}
    record = _run(pairs[family], tmp_path / "rft", on_saved=lambda m, t, o: kept.update(model=m))
    post = mean_loss(kept["model"], blocks)
    assert pre > teacher + 0.05, ("the fixture's pruning should hurt", pre, teacher)
    assert post < pre - 0.3 * (pre - teacher), (pre, post, teacher)  # RFT recovers a good part of the damage
    log = [json.loads(x) for x in (tmp_path / "rft" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [2, 4, 6, 8] and log[-1]["kl"] < log[0]["kl"]
    assert {"step", "loss", "kl", "ce", "lr", "tokens_per_s"} <= set(log[0])
    assert record["steps"] == 8 and record["data"]["split"] == "train"


@pytest.mark.parametrize("family,share", [("delta_net", "head"), ("gated_deltanet", "all")])
def test_shared_filters_stay_shared(family, share, tmp_path):
    """A model pretrained with shared q/k filters (``share_conv``) keeps them exactly tied through RFT: they train
    (they move) as one filter per head (per layer), and the saved checkpoint is a stock one with the same keys."""
    base = tmp_path / "base"
    pretrain(family, ARCH[family], CORPUS, {**PRETRAIN, "steps": 20}, base, share_conv=share)
    model, tok = load_model(base)
    record = prune_model(model, random_keep(model, 4, seed=3), {"source": str(base), "method": "rand", "pct": 87.5})
    pruned = save_pruned(model, tok, record, tmp_path / "pruned")
    adapter = get_adapter(load_model(pruned)[0])
    assert {layout.conv_sharing() for layout in adapter.layouts()} == {share}
    out, last = tmp_path / "rft", {"keep": "last"}  # the last step's filters: they moved, whatever validation says
    with pytest.raises(ft._Stop):  # the tied filters resume exactly, too
        _run((base, pruned), out, stop_after=5, cfg=last)
    rec = _run((base, pruned), out, cfg=last)
    assert rec["modules"]["conv_sharing"] == share and rec["resumed_from_step"] == 4
    _run((base, pruned), tmp_path / "whole", cfg=last)
    whole = load_file(str(tmp_path / "whole" / "model.safetensors"))
    before, after = load_file(str(pruned / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert {k: v.shape for k, v in after.items()} == {k: v.shape for k, v in before.items()}
    assert all(torch.equal(whole[k], after[k]) for k in after)
    convs = [k for k in before if k.endswith(("q_conv1d.weight", "k_conv1d.weight"))]
    assert convs and all(not torch.equal(before[k], after[k]) for k in convs)
    adapter = get_adapter(load_model(out)[0])
    assert {layout.conv_sharing() for layout in adapter.layouts()} == {share}


def test_rft_checkpoint_reloads_in_fresh_process(pairs, tmp_path):
    out = tmp_path / "rft"
    kept = {}
    _run(pairs["gated_deltanet"], out, on_saved=lambda m, t, o: kept.update(model=m))
    x = tiny_inputs(2, 40, seed=5) % 256
    with torch.no_grad():
        expected = kept["model"](input_ids=x).logits
    torch.save(x, tmp_path / "x.pt")
    code = (
        "import sys, torch; torch.set_num_threads(1); sys.path.insert(0, sys.argv[1]); import fla; "
        "from statereduce.kernels import fla_fallback; "
        "fla_fallback.install(); from transformers import AutoModelForCausalLM; "
        "m = AutoModelForCausalLM.from_pretrained(sys.argv[2], fuse_cross_entropy=False).eval(); "
        "x = torch.load(sys.argv[3]); torch.set_grad_enabled(False); torch.save(m(input_ids=x).logits, sys.argv[4])"
    )
    fresh.run(["-c", code, str(ROOT), str(out), str(tmp_path / "x.pt"), str(tmp_path / "y.pt")], check=True,
              timeout=300, preload=fresh.TORCH)
    got = torch.load(tmp_path / "y.pt")
    assert torch.equal(got, expected), float((got - expected).abs().max())
    record = json.loads((out / "prune_record.json").read_text())
    assert record["rft"]["settings"]["lora"]["rank"] == 32 and record["method"] == "rand"
    assert json.loads((out / "config.json").read_text())["expand_v"] == 8.0  # pruned shapes: d_v 32 / d_k' 4


def test_resume_after_interrupt_equals_uninterrupted_run(pairs, tmp_path):
    whole = tmp_path / "whole"
    whole_record = _run(pairs["delta_net"], whole)
    out = tmp_path / "resumed"
    with pytest.raises(ft._Stop):
        _run(pairs["delta_net"], out, stop_after=5)  # checkpoints at steps 2 and 4; step 5 is lost
    resume = tmp_path / ".resumed_resume"
    assert not out.exists() and len(list(resume.glob("*/resume.pt"))) == 1
    record = _run(pairs["delta_net"], out)
    assert record["resumed_from_step"] == 4 and not resume.exists()
    assert record["validation"] == whole_record["validation"]  # the curve and the best state resume too
    a, b = load_file(str(whole / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)  # deterministic on CPU, and resumed exactly
    la = (whole / "train_log.jsonl").read_text().splitlines()
    lb = (out / "train_log.jsonl").read_text().splitlines()
    assert [json.loads(x)["loss"] for x in la] == [json.loads(x)["loss"] for x in lb]


@pytest.mark.slow  # a fresh process run until its first checkpoint; the default tier resumes in process
def test_killed_process_resumes_and_finishes(pairs, tmp_path):
    """SIGKILL a ``python -m statereduce.stages.rft`` run after its first checkpoint; the rerun finishes from it."""
    base, pruned = pairs["delta_net"]
    job = tmp_path / "job.json"
    cfg = {**RFT, "n_samples": 80, "save_every": 1, "log_every": 1}  # 20 steps (~0.3 s each): longer than the wait
    job.write_text(json.dumps({"settings": cfg, "corpus_spec": CORPUS}))
    out, resume = tmp_path / "rft", tmp_path / "resume"
    args = [
        "--pruned",
        str(pruned),
        "--base",
        str(base),
        "--out",
        str(out),
        "--job",
        str(job),
        "--resume-dir",
        str(resume),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "statereduce.stages.rft", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 240
        while not list(resume.glob("*/resume.pt")) and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not out.exists()
    saved = torch.load(next(resume.glob("*/resume.pt")), weights_only=False)["step"]
    assert 1 <= saved < 20
    ft.main(args)
    record = json.loads((out / "rft_record.json").read_text())
    assert record["steps"] == 20 and record["resumed_from_step"] == saved
    assert len((out / "train_log.jsonl").read_text().splitlines()) == 20


def test_training_blocks_skip_heldout_documents():
    tok = byte_level_tokenizer()
    docs = [f"doc {i} " + chr(65 + i) * 200 for i in range(10)]
    heldout = docs[3:5]
    blocks, info = ft.training_blocks(tok, docs, n_samples=6, seq_len=50, seed=0, exclude=heldout)
    text = bytes(b for b in blocks.flatten().tolist() if b < 256).decode()
    assert "D" not in text and "E" not in text  # the held-out documents' letters never appear
    assert info["documents_dropped_as_heldout"] == 2 and info["documents"] == 8
    again, _ = ft.training_blocks(tok, docs, n_samples=6, seq_len=50, seed=0, exclude=heldout)
    assert torch.equal(blocks, again)


def test_validation_documents_are_disjoint_from_training_and_heldout():
    """RFT's validation sequences come from train-split documents that feed no training sequence, never from a
    held-out evaluation document; without validation the training sequences are the same as before."""
    tok = byte_level_tokenizer()
    docs = [f"doc {i} " + chr(65 + i) * 300 for i in range(20)]
    heldout = docs[3:5]
    blocks, val, info = ft.rft_blocks(tok, docs, n_samples=6, seq_len=50, seed=0, exclude=heldout, val_samples=4)
    letters = {i: chr(65 + i) for i in range(20)}
    seen_train = {i for i, c in letters.items() if c in bytes(b for b in blocks.flatten().tolist() if b < 256).decode()}
    seen_val = {i for i, c in letters.items() if c in bytes(b for b in val.flatten().tolist() if b < 256).decode()}
    assert val.shape == (4, 50) and blocks.shape == (6, 50)
    assert seen_val and seen_train and not seen_val & seen_train and not (seen_val | seen_train) & {3, 4}
    assert {ft._doc_hash(docs[i]) for i in seen_val} <= set(info["validation_hashes"])
    assert info["validation"]["documents"] == len(info["validation_hashes"]) and info["validation"]["samples"] == 4
    # each validation sequence is the start of its own document, as the held-out evaluation scores documents
    starts = {tuple(tok(d, add_special_tokens=False)["input_ids"][:50]) for d in docs}
    assert all(tuple(row) in starts for row in val.tolist()) and len(seen_val) == 4
    # the training blocks come from at least n_samples documents, not from the first long one
    assert info["documents_used"] >= 6 and len(seen_train) >= 3
    # val_seq_len: a document shorter than it is scored whole, the row right-padded with PAD
    short = ["x" * 30] + docs[5:]
    _, val, info = ft.rft_blocks(tok, short, n_samples=2, seq_len=50, seed=0, val_samples=len(short) - 3,
                                 val_seq_len=200)
    lengths = sorted((val != ft.PAD).sum(1).tolist())
    assert val.shape[1] == 200 and lengths[0] == 30 and lengths[-1] == 200 and info["validation"]["seq_len"] == 200
    assert (val[:, :30] != ft.PAD).all() and info["validation"]["tokens"] == sum(lengths)
    with pytest.raises(ValueError, match=r"^rft val_samples=30 asks for more validation documents than the train "):
        ft.rft_blocks(tok, docs, n_samples=2, seq_len=50, seed=0, val_samples=30)
    # the embedded corpus: validation documents are train-split documents, none of them held out
    train, held = load_split(CORPUS, "train"), load_split(CORPUS, "heldout")
    _, _, info = ft.rft_blocks(tok, train, 8, 64, 0, exclude=held, val_samples=8)
    val_docs = set(info["validation_hashes"])
    assert val_docs and val_docs <= {ft._doc_hash(d) for d in train} and not val_docs & {ft._doc_hash(d) for d in held}
    alone, _ = ft.training_blocks(tok, docs, n_samples=6, seq_len=50, seed=0, exclude=heldout)
    plain, none, _ = ft.rft_blocks(tok, docs, n_samples=6, seq_len=50, seed=0, exclude=heldout)
    assert torch.equal(alone, plain) and none.shape[0] == 0


def test_best_validation_step_is_kept(pairs, tmp_path):
    """``keep: best`` saves the weights of the validation pass with the lowest CE: with a learning rate that wrecks
    the model that is step 0, the pruned checkpoint itself; ``keep: last`` saves the wrecked one. The curve (step 0,
    every ``save_every``, the last step) and the kept step are in ``rft_record.json`` and equal a recomputation."""
    base, pruned = pairs["delta_net"]
    wreck = {"lr": 0.5, "min_lr": 0.5, "n_samples": 16}
    kept = {}
    best = _run(pairs["delta_net"], tmp_path / "best", cfg=wreck, on_saved=lambda m, t, o: kept.update(model=m))
    val = best["validation"]
    assert [r["step"] for r in val["curve"]] == [0, 2, 4]
    assert val["keep"] == "best" and val["metric"] == "ce"
    assert val["kept_step"] == val["best_step"] == 0, val["curve"]
    assert all(r["ce"] > val["curve"][0]["ce"] for r in val["curve"][1:])
    x = tiny_inputs(2, 40, seed=5) % 256
    with torch.no_grad():
        assert torch.equal(kept["model"](input_ids=x).logits, load_model(pruned)[0](input_ids=x).logits)
    assert json.loads((tmp_path / "best" / "rft_record.json").read_text())["validation"] == val
    last = _run(pairs["delta_net"], tmp_path / "last", cfg={**wreck, "keep": "last"})
    assert last["validation"]["kept_step"] == 4 and last["validation"]["curve"] == val["curve"]
    a, b = load_file(tmp_path / "best" / "model.safetensors"), load_file(tmp_path / "last" / "model.safetensors")
    assert any(not torch.equal(a[k], b[k]) for k in a)
    # the recorded step-0 loss is the pruned model's on the same validation sequences
    tok = byte_level_tokenizer()
    _, vblocks, _ = ft._rft_data(tok, CORPUS, RftSettings.from_dict({**RFT, **wreck}), [])
    teacher = load_model(base)[0]
    got = ft.validation_loss(load_model(pruned)[0], teacher, vblocks, RftSettings.from_dict({**RFT, **wreck}),
                             _Acc(), contextlib.nullcontext(), 4)
    assert math.isclose(got["ce"], val["curve"][0]["ce"], rel_tol=1e-6)
    # independently: each validation document's start alone, its next-token losses summed, over all next tokens
    model, nll, count = load_model(pruned)[0], 0.0, 0
    with torch.no_grad():
        for row in vblocks:
            ids = row[row != ft.PAD][None]
            logits = model(input_ids=ids).logits[0, :-1]
            nll += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
            count += ids.shape[1] - 1
    assert math.isclose(got["ce"], nll / count, rel_tol=1e-5)


def test_teacher_logits_are_computed_once_per_run(pairs):
    """Validation passes of one run share the teacher's logits of the first pass (the teacher runs once, the losses are
    those of passes that run it every time, bit for bit); logits over the byte limit are never kept and the teacher
    runs in every pass."""
    base, pruned = pairs["delta_net"]
    cfg = RftSettings.from_dict({**RFT, "val_samples": 6, "val_seq_len": 100})
    _, vblocks, _ = ft._rft_data(byte_level_tokenizer(), CORPUS, cfg, [])
    teacher, student = load_model(base)[0], load_model(pruned)[0]
    calls = []
    teacher.register_forward_hook(lambda module, args, out: calls.append(1))

    def passes(cache):
        calls.clear()
        losses = [ft.validation_loss(student, teacher, vblocks, cfg, _Acc(), contextlib.nullcontext(), 4, cache)
                  for _ in range(3)]
        return losses, len(calls)

    plain, plain_calls = passes(None)
    cached, cached_calls = passes(ft.TeacherLogits())
    over, over_calls = passes(ft.TeacherLogits(max_bytes=6 * 100 * 257 * 4 // 2))  # half of 6 rows' float32 logits
    assert plain_calls == over_calls == 3 * 2 and cached_calls == 2  # two micro-batches of at most 4 sequences
    assert cached == plain == over


class _Acc:
    """A one-process stand-in for accelerate's Accelerator in :func:`statereduce.stages.rft.validation_loss`."""

    process_index, num_processes, device = 0, 1, torch.device("cpu")

    @staticmethod
    def reduce(t, reduction="sum"):
        return t


def test_embedded_train_split_never_holds_heldout_text():
    train, heldout = load_split(CORPUS, "train"), load_split(CORPUS, "heldout")
    assert train and heldout and not {ft._doc_hash(d) for d in train} & {ft._doc_hash(d) for d in heldout}


def test_resume_checkpoint_of_other_settings_is_discarded(pairs, tmp_path):
    resume = tmp_path / "resume"
    (resume / "0123456789abcdef").mkdir(parents=True)
    torch.save({"step": 3}, resume / "0123456789abcdef" / "resume.pt")
    record = _run(pairs["delta_net"], tmp_path / "rft", resume_dir=resume)
    assert record["resumed_from_step"] == 0 and not resume.exists()
    assert math.isfinite(record["final_loss"])


@pytest.mark.slow
def test_two_process_ddp_matches_one_process(pairs, tmp_path):
    """``launch(2, ...)`` (torchrun, DDP through accelerate, gloo on CPU) trains like the single process: each
    process takes half of every batch and DDP averages the gradients."""
    base, pruned = pairs["delta_net"]
    one = tmp_path / "one"
    _run(pairs["delta_net"], one)
    two = tmp_path / "two"
    ft.launch(2, pruned, base, two, RftSettings.from_dict(RFT), CORPUS, device="cpu", resume_dir=tmp_path / "resume2")
    record = json.loads((two / "rft_record.json").read_text())
    assert record["processes"] == 2 and record["steps"] == 8
    la = [json.loads(x)["loss"] for x in (one / "train_log.jsonl").read_text().splitlines()]
    lb = [json.loads(x)["loss"] for x in (two / "train_log.jsonl").read_text().splitlines()]
    np.testing.assert_allclose(lb, la, rtol=1e-4)
    a, b = load_file(str(one / "model.safetensors")), load_file(str(two / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5)


# ---- devices -----------------------------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_rft_without_cuda_fails_in_one_line(pairs, tmp_path):
    """Asked for CUDA on a machine without it, RFT stops before training instead of quietly running on the CPU (with
    a bf16 teacher); two processes are refused before torchrun starts, instead of each training alone."""
    base, pruned = pairs["delta_net"]
    with pytest.raises(RuntimeError, match=r"^RFT on device 'cuda' needs a CUDA GPU and this machine has none \("):
        _run((base, pruned), tmp_path / "one", device="cuda")
    with pytest.raises(ValueError, match=r"^rft\.gpus 2 needs 2 CUDA devices and torch sees 0 .*valid: rft\.gpus up"):
        ft.launch(2, pruned, base, tmp_path / "two", RftSettings.from_dict(RFT), CORPUS, device="cuda")
    assert not (tmp_path / "one").exists() and not (tmp_path / "two").exists()


def test_processes_accelerate_did_not_join_are_refused(pairs, tmp_path, monkeypatch):
    """Under torchrun (WORLD_SIZE 2) a process that accelerate runs alone would write the output folder as if it were
    the only one: refused before training."""
    import accelerate

    class Alone:
        num_processes, distributed_type = 1, "NO"

        def __init__(self, cpu: bool):
            pass

    monkeypatch.setattr(accelerate, "Accelerator", Alone)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"^torchrun started 2 processes but accelerate joined 1 "):
        _run(pairs["delta_net"], tmp_path / "rft")
    assert not (tmp_path / "rft").exists()


# ---- what RFT leaves for use outside the workflow ---------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_rft_keeps_its_lora_adapter_in_peft_format_for_the_pruned_checkpoint(pairs, family, tmp_path):
    """``rft/adapter`` on the pruned checkpoint, loaded the way a peft user loads it, gives the merged checkpoint's
    logits (unmerged, to float32 rounding; fla's base with ``fuse_swiglu=False``), and merges to them."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, Mamba2ForCausalLM

    out = tmp_path / "rft"
    kept = {}
    _run(pairs[family], out, on_saved=lambda m, t, o: kept.update(model=m))
    adapter = out / "adapter"  # statereduce.core.checkpoints.ADAPTER_DIR
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.iterdir()}
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 32
    x = tiny_inputs(2, 40, seed=5) % 256
    with torch.no_grad():
        want = kept["model"](input_ids=x).logits
    cls = Mamba2ForCausalLM if family == "mamba2" else AutoModelForCausalLM  # fla registers its own Mamba-2
    extra = {"fuse_swiglu": False, "fuse_cross_entropy": False} if family in ("delta_net", "gated_deltanet") else {}
    base = cls.from_pretrained(pairs[family][1], dtype=torch.float32, **extra).eval()
    model = PeftModel.from_pretrained(base, adapter).eval()
    with torch.no_grad():
        unmerged = model(input_ids=x).logits
        merged = model.merge_and_unload()(input_ids=x).logits
    torch.testing.assert_close(unmerged, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(merged, want, rtol=1e-5, atol=1e-5)


def test_rft_of_per_layer_widths_writes_a_checkpoint_that_loads_without_the_package(pairs, built, tmp_path):
    """A per-layer cut stays one after RFT: the merged checkpoint carries its modeling code, and the way a user
    loads it gives the merged model's logits."""
    from transformers import AutoModelForCausalLM

    from statereduce.core.portable import MODELING_FILE

    def build(folder: Path) -> None:
        model, tok = load_model(pairs["delta_net"][0])
        keep = random_keep(model, 8, seed=4)
        keep[0] = keep[0][:, :4]  # layer 0 keeps 4 channels, the others 8
        save_pruned(model, tok, prune_model(model, keep, {"source": "base", "method": "rand", "pct": 80}), folder)

    pruned = built("rft-mixed-delta_net", {"arch": ARCH["delta_net"], "keep": "8, layer 0: 4"}, build)
    out = tmp_path / "rft"
    kept = {}
    _run((pairs["delta_net"][0], pruned), out, on_saved=lambda m, t, o: kept.update(model=m))
    assert (out / MODELING_FILE).is_file()
    x = tiny_inputs(2, 40, seed=5) % 256
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, kept["model"](input_ids=x).logits)
