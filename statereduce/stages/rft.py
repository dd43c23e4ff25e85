"""Recovery fine-tuning (RFT) of a pruned checkpoint: LoRA plus distillation from the unpruned model.

Paper: Nazari & Rusch (2026), Sec. 5 and App. A. After the key/query channels are sliced out, the pruned
model (the *student*) is fine-tuned with LoRA (rank 32, alpha 64) on the projections of its decoder blocks;
the depthwise short convolutions and the norms train fully (peft ``modules_to_save``: LoRA on a depthwise
conv could not be merged; q/k filters that the model shares, ``pretrain.share_conv``, stay tied); embeddings, LM
head and everything else stay frozen. The loss distils the
unpruned model (the *teacher*): KL divergence between temperature-softened next-token distributions,
times T^2 (Hinton et al., 2015), optionally plus the language-modelling cross entropy. The paper trains on
32k sequences of 2048 tokens, effective batch 16, AdamW, LR 1e-4 -> 1e-5 cosine with 5% warm-up, bf16.
Afterwards LoRA is merged, and the result is a plain HF checkpoint of the pruned shapes; the adapter itself is kept
beside it in peft's format (``adapter/``, :func:`save_adapter`).

Which subtrees may train is declared by each family (``FamilySpec.rft_targets``, :func:`rft_roots`): all decoder
blocks for DeltaNet / Gated DeltaNet and Mamba-2, only the recurrent mixers for hybrids such as Qwen3.5.

Data: ``n_samples`` non-overlapping blocks of ``seq_len`` tokens of a corpus's ``train`` split (the same
corpus sources as calibration), drawn with a seeded generator; documents equal to a held-out evaluation
document are dropped first, so RFT never sees evaluation text. Sample i of the run is fixed by the seed,
which makes the run deterministic on CPU and lets a killed run resume exactly: every ``save_every``
optimizer steps the trainable tensors, the optimizer state and the log are saved atomically to a resume
folder, and a rerun with the same inputs and settings continues from there.

Training runs through ``accelerate``: a single process by default; under ``torchrun`` with
several GPUs each process trains on its share of every batch (DDP), and only the main process writes.
Run it on its own with ``python -m statereduce.stages.rft --help``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from statereduce.adapters import decoder_layers, get_adapter
from statereduce.adapters.conv_sharing import model_conv_sharing, tie_qk_convs, untie_convs
from statereduce.adapters.mixer_layout import module_names
from statereduce.core.artifacts import check_prune_record
from statereduce.core.checkpoints import checkpoint_provenance
from statereduce.core.data import corpus_provenance, load_split, token_blocks
from statereduce.core.checkpoints import ADAPTER_DIR
from statereduce.core.models import check_kernels, kernel_check_record, load_model, save_checkpoint, torch_dtype
from statereduce.core.runtime import (
    Schedule,
    atomic_dir,
    atomic_file,
    jsonable,
    lr_at,
    read_json,
    seed_everything,
    write_json,
)
from statereduce.common.settings import EvalSettings, RftPlan, RftSettings
from statereduce.eval.run import evaluate_checkpoint, evaluate_loaded
from statereduce.eval.tasks import HELDOUT
from statereduce.families.base import RftTargets, family_names, family_spec

RECORD_FILE = "rft_record.json"
LOG_FILE = "train_log.jsonl"
RESUME_FILE = "resume.pt"


class _Stop(Exception):
    """Raised by a ``stop_after`` test hook to simulate a killed run."""


def n_steps(cfg: RftSettings) -> int:
    """Optimizer steps of a run: ``n_samples // batch_size`` (one pass over the samples)."""
    return cfg.n_samples // cfg.batch_size


def _schedule(cfg: RftSettings) -> Schedule:
    steps = n_steps(cfg)
    warmup = min(round(cfg.warmup_frac * steps), steps - 1)
    return Schedule(lr=cfg.lr, min_lr=cfg.min_lr, warmup=warmup, steps=steps)


# ---- data -------------------------------------------------------------------------------------------
def _doc_hash(doc: str) -> str:
    return hashlib.sha256(doc.encode("utf-8")).hexdigest()


def _tokenized(tokenizer, ordered: Sequence[str], start: int, chunk_docs: int = 8):
    """``(document, token ids)`` of ``ordered`` from ``start`` on, tokenized ``chunk_docs`` at a time: only the
    documents read (a few, on the tiny default) and never a large split whole."""
    for i in range(start, len(ordered), chunk_docs):
        chunk = ordered[i : i + chunk_docs]
        yield from zip(chunk, tokenizer(list(chunk), add_special_tokens=False)["input_ids"])


def _take_documents(tokenizer, ordered: Sequence[str], start: int, need: int,
                    min_docs: int = 0) -> tuple[list[str], int, int]:
    """Documents of ``ordered`` from ``start`` on until they hold ``need`` tokens (each document's tokens plus its
    EOS) and number at least ``min_docs``.

    Returns:
        ``(documents, index after the last one taken, tokens they hold)``.
    """
    used, have = [], 0
    for doc, ids in _tokenized(tokenizer, ordered, start):
        if have >= need and len(used) >= min_docs:
            break
        used.append(doc)
        have += len(ids) + 1
    return used, start + len(used), have


PAD = -1
"""Token id that right-pads the validation sequences (:func:`rft_blocks`) to one length; never fed to a model."""


def rft_blocks(
    tokenizer, docs: Sequence[str], n_samples: int, seq_len: int, seed: int, exclude: Sequence[str] = (),
    val_samples: int = 0, val_seq_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """The RFT training and validation sequences, from disjoint documents in a seeded order.

    Documents whose text equals one of ``exclude`` (the held-out evaluation documents) are dropped. The rest are
    visited in a seeded random order. The first ``val_samples`` of them are the validation documents; each gives one
    validation sequence, its first ``val_seq_len`` tokens (default ``seq_len``; a shorter document whole), so that
    validation scores documents from their start as the held-out evaluation does. The following documents, until
    they hold twice the tokens of the training blocks and number at least ``n_samples`` (so that the blocks come
    from many documents, not from the first long ones), are the training documents: ``n_samples`` distinct
    ``seq_len``-token blocks are drawn from them as for calibration (:func:`statereduce.core.data.token_blocks`). With
    ``val_samples=0`` the training blocks are those of :func:`training_blocks`.

    Returns:
        (LongTensor ``[n_samples, seq_len]``, LongTensor ``[val_samples, L]`` right-padded with :data:`PAD` to the
        longest validation sequence ``L``, info: documents available, used for training and for validation,
        dropped, tokens; ``validation_hashes``: SHA-256 of the validation documents).
    """
    banned = {_doc_hash(d) for d in exclude}
    kept = [d for d in docs if d and _doc_hash(d) not in banned]
    g = torch.Generator().manual_seed(int(seed))
    ordered = [kept[j] for j in torch.randperm(len(kept), generator=g).tolist()]
    val_len = int(val_seq_len or seq_len)
    val_docs, val, pos = _validation_starts(tokenizer, ordered, val_samples, val_len)
    used, _, have = _take_documents(tokenizer, ordered, pos, 2 * n_samples * seq_len, n_samples)
    blocks = token_blocks(tokenizer, used, n_samples, seq_len, seed)
    info = {
        "documents": len(kept),
        "documents_used": len(used),
        "documents_dropped_as_heldout": sum(1 for d in docs if d and _doc_hash(d) in banned),
        "tokens_read": have,
        "tokens": blocks.numel(),
        "validation": {"documents": len(val_docs), "tokens": int((val != PAD).sum()), "samples": int(val_samples),
                       "seq_len": val_len},
        "validation_hashes": sorted(_doc_hash(d) for d in val_docs),
    }
    return blocks, val, info


def _validation_starts(tokenizer, ordered: Sequence[str], n: int,
                       length: int) -> tuple[list[str], torch.Tensor, int]:
    """The first ``n`` documents of ``ordered`` that hold at least two tokens, and their first ``length`` tokens as
    rows of a LongTensor right-padded with :data:`PAD`; the index of the first document after them."""
    docs: list[str] = []
    rows: list[list[int]] = []
    i = 0
    if n:
        for doc, ids in _tokenized(tokenizer, ordered, 0):
            i += 1
            if len(ids) >= 2:
                docs.append(doc)
                rows.append(list(ids[:length]))
            if len(docs) == n:
                break
    if len(docs) < n:
        raise ValueError(f"rft val_samples={n} asks for more validation documents than the train split holds "
                         f"({len(docs)} with two tokens or more); valid: val_samples <= {len(docs)}")
    width = max((len(r) for r in rows), default=0)
    val = torch.full((len(rows), width), PAD, dtype=torch.long)
    for j, r in enumerate(rows):
        val[j, : len(r)] = torch.tensor(r, dtype=torch.long)
    return docs, val, i


def training_blocks(
    tokenizer, docs: Sequence[str], n_samples: int, seq_len: int, seed: int, exclude: Sequence[str] = ()
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The RFT samples without validation: ``n_samples`` distinct ``seq_len``-token blocks of ``docs``, in a seeded
    order (:func:`rft_blocks` with ``val_samples=0``).

    Returns:
        (LongTensor ``[n_samples, seq_len]``, info: documents available, used and dropped, tokens).
    """
    blocks, _, info = rft_blocks(tokenizer, docs, n_samples, seq_len, seed, exclude)
    return blocks, {k: v for k, v in info.items() if k not in ("validation", "validation_hashes")}


# ---- what fine-tuning trains, per family -------------------------------------------------------------------------
RFT_SCOPES = tuple(s for s in RftSettings.valid("scope") if s != "auto")
"""What recovery fine-tuning may train (:func:`rft_roots`): ``rft.scope``'s values but ``auto``, which each family
resolves (``RftTargets.default_scope``)."""


def rft_targets(family: str) -> RftTargets:
    """What RFT trains in ``family``'s models: its :attr:`~statereduce.families.base.FamilySpec.rft_targets`.
    Raises ValueError (one line) for a family that declares none."""
    return targets_of(family_spec(family))


def targets_of(spec) -> RftTargets:
    """``spec.rft_targets`` of a family spec class, or ValueError naming the families that declare one."""
    targets = getattr(spec, "rft_targets", None)
    if not isinstance(targets, RftTargets):
        declared = [f for f in family_names() if isinstance(getattr(family_spec(f), "rft_targets", None), RftTargets)]
        raise ValueError(f"family {getattr(spec, 'family', spec.__name__)!r} declares no RFT targets (its FamilySpec's "
                         f"rft_targets: the default scope and the Linear modules without LoRA); families that do: "
                         f"{', '.join(declared)}")
    return targets


def rft_roots(adapter, scope: str) -> list[tuple[str, nn.Module]]:
    """The (qualified name, module) subtrees whose modules recovery fine-tuning may train.

    ``"all"``: every decoder block and the decoder's final norm (the paper's RFT of DeltaNet / Gated DeltaNet).
    ``"recurrent"``: only the linear-attention mixers (``adapter.mixer_layers()``). Embeddings and the LM head are
    never included. :func:`attach_lora` puts LoRA on the ``nn.Linear`` modules of these subtrees and trains their
    convolutions and norms fully.
    """
    if scope not in RFT_SCOPES:
        raise ValueError(f"unknown RFT scope {scope!r}; valid: {', '.join(RFT_SCOPES)}")
    model = adapter.model
    names = module_names(model)
    if scope == "recurrent":
        roots = [mixer for _, mixer in adapter.mixer_layers()]
    else:
        roots = list(decoder_layers(model))
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
        norms = [getattr(decoder, n, None) for n in ("norm", "norm_f")]  # fla, Qwen3.5: norm; Mamba-2: norm_f
        roots.extend(n for n in norms if isinstance(n, nn.Module))
    return [(names[id(m)], m) for m in roots]


def trains_fully(module: nn.Module) -> bool:
    """Whether recovery fine-tuning trains ``module`` (inside :func:`rft_roots`) fully rather than through LoRA:
    convolutions (LoRA on a depthwise conv could not be merged) and norms (a class name ending in ``Norm`` or
    ``NormGated``, as fla's and transformers' norm modules are named)."""
    return isinstance(module, nn.Conv1d) or type(module).__name__.endswith(("Norm", "NormGated"))


def unfuse_for_lora(model: nn.Module) -> Callable[[], None]:
    """Make every LoRA target go through its own ``forward`` during RFT; return a function that undoes it.

    fla's ``GatedMLP`` with ``fuse_swiglu`` (the default) hands ``down_proj.weight`` straight to a fused SwiGLU-linear
    kernel, so a LoRA wrapper on ``down_proj`` would never run (and its merge would add an update that training never
    saw). Unfused, the MLP computes the same ``down_proj(swiglu(g, u))``. Models without such modules are left as
    they are.
    """
    touched = [m for m in model.modules() if getattr(m, "fuse_swiglu", False) and hasattr(m, "down_proj")]
    for m in touched:
        m.fuse_swiglu = False

    def undo() -> None:
        for m in touched:
            m.fuse_swiglu = True

    return undo


# ---- model ------------------------------------------------------------------------------------------
def rft_modules(model: nn.Module, scope: str = "auto") -> tuple[list[str], list[str], str]:
    """Which modules RFT touches: (LoRA targets, fully trained modules, resolved scope).

    LoRA goes on every ``nn.Linear`` inside the family's RFT subtrees (:func:`rft_roots`) except its
    ``lora_excluded`` (Mamba-2's ``out_proj``, which stays frozen); the modules there that train fully
    (:func:`trains_fully`: convolutions and norms) train fully. Names are full module names of ``model``.
    """
    adapter = get_adapter(model)
    targets = rft_targets(adapter.family)
    scope = targets.default_scope if scope == "auto" else scope
    lora, full = [], []
    for root_name, root in rft_roots(adapter, scope):
        for name, module in root.named_modules():
            full_name = f"{root_name}.{name}" if name else root_name
            if isinstance(module, nn.Linear):
                if full_name.rsplit(".", 1)[-1] not in targets.lora_excluded:
                    lora.append(full_name)
            elif trains_fully(module):
                full.append(full_name)
    # a norm/conv inside another fully trained module is covered by it
    full = [n for n in full if not any(n.startswith(p + ".") for p in full)]
    if not lora:
        raise ValueError(f"no nn.Linear found for LoRA in the RFT scope {scope!r} of {type(model).__name__}")
    return lora, full, scope


def attach_lora(model: nn.Module, cfg: RftSettings):
    """Wrap ``model`` in a peft LoRA model per ``cfg`` (:class:`~statereduce.common.settings.RftSettings`: ``scope``,
    ``lora``); only RFT parameters train.

    Returns:
        (peft model, ``{"lora_targets", "trained_fully", "scope", "conv_sharing"}``): ``conv_sharing`` is how the
        model's q/k short-conv filters are shared (:func:`~statereduce.adapters.conv_sharing.model_conv_sharing`);
        shared filters stay tied while they train (:func:`~statereduce.adapters.conv_sharing.tie_qk_convs`).
    """
    from peft import LoraConfig, get_peft_model  # peft: RFT's work only (test_job_imports)

    lora_targets, full, scope = rft_modules(model, cfg.scope)
    adapter = get_adapter(model)
    model._statereduce_refuse = unfuse_for_lora(model)  # merge() restores the fused kernels
    # shared q/k filters (pretrain.share_conv) stay tied while they train; merge() unties them
    share = model_conv_sharing(adapter)
    tie_qk_convs(adapter, share)
    for p in model.parameters():
        p.requires_grad_(False)
    lcfg = LoraConfig(
        r=int(cfg.lora.rank),
        lora_alpha=float(cfg.lora.alpha),
        lora_dropout=float(cfg.lora.dropout),
        target_modules=lora_targets,
        modules_to_save=full,
        bias="none",
    )
    peft_model = get_peft_model(model, lcfg)
    return peft_model, {"lora_targets": lora_targets, "trained_fully": full, "scope": scope, "conv_sharing": share}


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable tensors of ``model`` by name (what a resume checkpoint stores)."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def save_adapter(peft_model, folder: Path) -> None:
    """Save the trained adapter in peft's format (``adapter_config.json``, ``adapter_model.safetensors``: the LoRA
    weights and the fully trained modules), before :func:`merge` folds it in. It applies to the pruned checkpoint::

        base = AutoModelForCausalLM.from_pretrained(pruned, trust_remote_code=True)  # fla: fuse_swiglu=False
        model = PeftModel.from_pretrained(base, rft / "adapter")

    ``base_model_name_or_path`` names the pruned checkpoint's folder. fla's fused SwiGLU hands ``down_proj.weight``
    to its kernel without calling the module (:func:`unfuse_for_lora`), so an fla base is loaded with
    ``fuse_swiglu=False`` for the adapter's ``down_proj`` update to run unmerged; ``merge_and_unload()`` needs nothing.
    """
    peft_model.save_pretrained(folder, safe_serialization=True)


def merge(peft_model) -> nn.Module:
    """Merge LoRA into the base weights and put the fully trained copies back: a plain HF model."""
    model = peft_model.merge_and_unload()
    untie_convs(model)
    refuse = model.__dict__.pop("_statereduce_refuse", None)
    if refuse is not None:
        refuse()
    model.train(False)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


# ---- loss -------------------------------------------------------------------------------------------
def distill_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    input_ids: torch.Tensor,
    temperature: float = 2.0,
    kl_weight: float = 1.0,
    lm_weight: float = 0.0,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RFT loss on one micro-batch: ``kl_weight * T^2 * KL(p_teacher^T || p_student^T) + lm_weight * CE``.

    KL is summed over the vocabulary and averaged over positions; CE is the next-token cross entropy of
    the student. Both in float32. Returns (loss, kl, ce); ``kl`` is exactly 0 when the logits agree. ``mask``
    (bool ``[batch, positions]``): only the positions it marks count (KL at them, CE of the tokens they predict
    whose next position it marks too); right padding of causal models leaves the marked positions unchanged.
    """
    t = float(temperature)
    s = student_logits.float() / t
    q = teacher_logits.float() / t
    vocab = s.shape[-1]
    if mask is None:
        kl = F.kl_div(
            F.log_softmax(s, dim=-1).reshape(-1, vocab),
            F.log_softmax(q, dim=-1).reshape(-1, vocab),
            log_target=True,
            reduction="batchmean",
        )
        ce = F.cross_entropy(student_logits[:, :-1].float().reshape(-1, vocab), input_ids[:, 1:].reshape(-1))
    else:
        m = mask.to(s.device, torch.float32)
        per = F.kl_div(F.log_softmax(s, dim=-1), F.log_softmax(q, dim=-1), log_target=True, reduction="none").sum(-1)
        kl = (per * m).sum() / m.sum()
        tm = m[:, :-1] * m[:, 1:]
        nll = F.cross_entropy(student_logits[:, :-1].float().reshape(-1, vocab), input_ids[:, 1:].reshape(-1),
                              reduction="none").view_as(tm)
        ce = (nll * tm).sum() / tm.sum()
    loss = float(kl_weight) * t * t * kl + float(lm_weight) * ce
    return loss, kl.detach(), ce.detach()


# ---- training ---------------------------------------------------------------------------------------
def _save_resume(path: Path, state: dict[str, Any]) -> None:
    with atomic_file(path, "wb") as fh:
        torch.save(state, fh)


def train(
    student,
    teacher: nn.Module,
    blocks: torch.Tensor,
    cfg: RftSettings,
    *,
    resume_dir: str | Path | None = None,
    log_path: str | Path | None = None,
    accelerator=None,
    stop_after: int | None = None,
    desc: str = "rft",
    val_blocks: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Optimise the trainable parameters of ``student`` (a peft model) to match ``teacher`` on ``blocks``.

    Optimizer step ``s`` uses samples ``s*batch_size .. (s+1)*batch_size`` of ``blocks``; process ``r`` of
    ``W`` takes every W-th of them, in micro-batches of ``micro_batch_size``, and gradients accumulate over
    its micro-batches (each micro-batch loss weighted by its share of the batch). AdamW on the trainable
    parameters; LR: linear warm-up over ``warmup_frac`` of the steps, then cosine to ``min_lr``
    (:func:`statereduce.core.runtime.lr_at`); gradient-norm clipping.

    Args:
        student: peft-wrapped pruned model (:func:`attach_lora`).
        teacher: the unpruned model (frozen; run without gradients).
        blocks: LongTensor ``[n_samples, seq_len]`` (:func:`training_blocks`).
        cfg: the RFT settings (:class:`~statereduce.common.settings.RftSettings`).
        resume_dir: folder for ``resume.pt``; when it holds one, training continues from it.
        log_path: the JSONL log (rewritten from the resume state's lines, then appended).
        accelerator: an ``accelerate.Accelerator``; a default single-process one when None.
        stop_after: test hook: raise after this many optimizer steps (after any checkpoint at that step).
        val_blocks: LongTensor ``[val_samples, L]`` of validation sequences (:func:`rft_blocks`, right-padded):
            their loss (:func:`validation_loss`) is measured before the first step, at every ``save_every`` and after
            the last step (the teacher's logits of the first pass are kept for the later ones: :class:`TeacherLogits`);
            with ``cfg.keep == "best"`` the student ends with the trainable tensors of the pass with the lowest
            ``cfg.best_metric`` (the earliest of equal ones).

    Returns:
        Training statistics: steps, tokens, seconds, tokens/s, final loss/KL/CE, resumed_from, the micro-batch size
        used (with ``micro_batch_probe`` when it was ``auto`` on a GPU: :func:`auto_micro_batch`), on CUDA each
        process's peak allocated memory (``peak_memory_bytes``, by process index), and with validation blocks
        ``validation``: ``{"samples", "metric", "keep", "curve": [{"step", "loss", "kl", "ce"}, ...], "best_step",
        "kept_step"}``.
    """
    from accelerate import Accelerator  # accelerate: RFT's work only (test_job_imports)

    acc = accelerator or Accelerator(cpu=not torch.cuda.is_available())
    student, opt, params, steps, sched = _prepare_training(student, teacher, blocks, cfg, acc)
    autocast = _autocast(cfg.precision, acc.device)
    resume_file = Path(resume_dir) / RESUME_FILE if resume_dir is not None else None
    start_step, log_lines, val = _load_resume(resume_file, acc, student, opt)
    student.train()
    local, micro, mbs, probe = _micro_batches(student, teacher, blocks, cfg, acc, autocast, opt)
    validate = val_blocks is not None and val_blocks.shape[0] > 0
    teacher_logits = TeacherLogits() if validate else None  # the teacher's validation logits, computed once
    if validate and start_step == 0:
        _validate(val, 0, student, teacher, val_blocks, cfg, acc, autocast, mbs, teacher_logits)
    with contextlib.ExitStack() as stack:
        bar = tqdm(range(start_step, steps), desc=desc, initial=start_step, total=steps, mininterval=5.0, unit="step",
                   disable=not acc.is_main_process)
        log = _TrainLog(_open_log(stack, log_path, acc, log_lines), log_lines, cfg.batch_size * blocks.shape[1], bar)
        for step in bar:
            lr = lr_at(step, sched)
            totals, grad_norm = _optimizer_step(student, teacher, blocks, step, lr, cfg, local, micro, acc, autocast,
                                                opt, params)
            log.add(totals)
            done = step + 1
            if done % cfg.log_every == 0 or done == steps:
                log.line(done, lr, grad_norm)
            if validate and (done % cfg.save_every == 0 or done == steps):
                _validate(val, done, student, teacher, val_blocks, cfg, acc, autocast, mbs, teacher_logits)
                bar.set_postfix(val=f"{val['curve'][-1][cfg.best_metric]:.4f}", best=val["best_step"])
            if resume_file is not None and (done % cfg.save_every == 0 and done < steps):
                _checkpoint(resume_file, acc, student, opt, done, log_lines, val)
            if stop_after is not None and done >= stop_after:
                raise _Stop(f"stopped after step {done} (test hook)")
    stats = _train_stats(steps, start_step, log.tokens_per_step, time.perf_counter() - log.t_start, log_lines, acc)
    if validate:
        stats["validation"] = _keep(val, student, cfg, acc, int(val_blocks.shape[0]))
    return {**stats, "micro_batch_size": mbs, **({"micro_batch_probe": probe} if probe is not None else {})}


class TeacherLogits:
    """The teacher's logits of each validation micro-batch, kept on the host after the first validation pass so that
    later passes run only the student (the teacher is frozen and its inputs are the same: the logits are the ones a
    new forward would give, bit for bit). Once they would pass ``max_bytes`` (default :data:`TEACHER_LOGITS_BYTES`)
    nothing is kept and every pass runs the teacher again."""

    def __init__(self, max_bytes: int | None = None):
        self.max_bytes = TEACHER_LOGITS_BYTES if max_bytes is None else int(max_bytes)
        self.kept: list[torch.Tensor] | None = []
        self.complete = False
        self._bytes = 0

    def logits(self, i: int, teacher: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The teacher's logits of micro-batch ``i`` (``x``), from the cache or a forward (kept if there is room)."""
        if self.complete:
            return self.kept[i].to(x.device)
        out = teacher(input_ids=x).logits
        if self.kept is not None:
            self._bytes += out.numel() * out.element_size()
            if self._bytes <= self.max_bytes:
                self.kept.append(out.detach().to("cpu", copy=True))
            else:
                self.kept = None
        return out

    def pass_done(self) -> None:
        """The end of a validation pass: from now on the kept logits answer (when all of them fitted)."""
        self.complete = self.kept is not None


TEACHER_LOGITS_BYTES = 1 << 30
"""The most host memory :class:`TeacherLogits` keeps: 1 GiB (a tiny model's 32 sequences of 2,048 byte tokens take
67 MB; 32 of 2,048 tokens of a 32k-token vocabulary in bfloat16 would take 4 GB, and are recomputed instead)."""


def validation_loss(model, teacher: nn.Module, blocks: torch.Tensor, cfg: RftSettings, acc, autocast,
                    micro_batch_size: int, teacher_logits: TeacherLogits | None = None) -> dict[str, float]:
    """RFT's loss (:func:`distill_loss`) of ``model`` on the validation ``blocks`` (rows right-padded with
    :data:`PAD`), without gradients, in eval mode: ``{"loss", "kl", "ce"}``, ``kl`` the mean over every scored
    position, ``ce`` over every scored next token, ``loss`` their weighted sum. Process ``r`` of ``W`` takes every
    W-th sequence; the sums are reduced over the processes. ``teacher_logits``, given to every pass of one run,
    keeps the teacher's logits after the first (:class:`TeacherLogits`)."""
    dist = cfg.distill
    cache = teacher_logits or TeacherLogits(max_bytes=0)
    mine = list(range(acc.process_index, blocks.shape[0], acc.num_processes))
    sums = torch.zeros(4, device=acc.device, dtype=torch.float64)  # kl sum, positions, ce sum, next tokens
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for n, i in enumerate(range(0, len(mine), micro_batch_size)):
            x = blocks[mine[i : i + micro_batch_size]]
            mask = x != PAD
            width = int(mask.sum(1).max())
            x, mask = x[:, :width].clamp(min=0).to(acc.device), mask[:, :width].to(acc.device)
            with autocast:
                t_logits = cache.logits(n, teacher, x)
                s_logits = model(input_ids=x).logits
            _, kl, ce = distill_loss(s_logits, t_logits, x, dist.temperature, dist.kl_weight, dist.lm_weight, mask)
            n_pos = mask.sum().double()
            n_next = (mask[:, :-1] & mask[:, 1:]).sum().double()
            sums += torch.stack([kl.double() * n_pos, n_pos, ce.double() * n_next, n_next])
    cache.pass_done()
    model.train(was_training)
    sums = acc.reduce(sums, reduction="sum")
    kl, ce = float(sums[0]) / float(sums[1]), float(sums[2]) / float(sums[3])
    t = float(dist.temperature)
    return {"loss": float(dist.kl_weight) * t * t * kl + float(dist.lm_weight) * ce, "kl": kl, "ce": ce}


def _validate(val: dict[str, Any], step: int, student, teacher: nn.Module, blocks: torch.Tensor, cfg: RftSettings,
              acc, autocast, micro_batch_size: int, teacher_logits: TeacherLogits | None = None) -> None:
    """One validation pass after ``step`` optimizer steps, appended to ``val["curve"]``; a new lowest
    ``cfg.best_metric`` makes this step ``val["best_step"]`` and (with ``keep: best``) its trainable tensors
    ``val["best_state"]``."""
    model = acc.unwrap_model(student)
    rec = {"step": step, **validation_loss(model, teacher, blocks, cfg, acc, autocast, micro_batch_size,
                                           teacher_logits)}
    val["curve"].append(rec)
    if val["best_step"] is None or rec[cfg.best_metric] < val["best"]:
        val["best_step"], val["best"] = step, rec[cfg.best_metric]
        if cfg.keep == "best":
            val["best_state"] = {k: v.cpu() for k, v in trainable_state(model).items()}


def _keep(val: dict[str, Any], student, cfg: RftSettings, acc, n_samples: int) -> dict[str, Any]:
    """Put the kept step's trainable tensors back into ``student`` (``keep: best``) and return the validation
    record."""
    kept = val["best_step"] if cfg.keep == "best" else val["curve"][-1]["step"]
    if cfg.keep == "best" and val["best_state"] is not None:
        named = dict(acc.unwrap_model(student).named_parameters())
        with torch.no_grad():
            for name, value in val["best_state"].items():
                named[name].copy_(value)
    return {"samples": n_samples, "metric": cfg.best_metric, "keep": cfg.keep, "curve": val["curve"],
            "best_step": val["best_step"], "kept_step": kept}


def auto_micro_batch(student, teacher: nn.Module, blocks: torch.Tensor, cfg: RftSettings, acc, autocast,
                     n_local: int) -> tuple[int, dict[str, Any] | None]:
    """``micro_batch_size: auto``: the largest divisor of ``n_local`` (this process's sequences per optimizer step)
    whose micro-batches fit in the GPU's memory; 1 on a CPU, where a larger forward gains little.

    On CUDA, one forward and backward of RFT's loss on 1 and on 2 sequences (the first of ``blocks``, gradients
    not synchronised; the caller drops them) measure the peak memory a micro-batch adds per sequence and what it
    needs besides; the choice keeps their sum within 85 % of what the device has free plus what this process
    holds. A step is host-bound at small micro-batches (fla's and LoRA's per-call overhead), so throughput grows
    with the micro-batch until the device is busy. Under several processes all take the smallest choice.

    Returns:
        ``(micro-batch size, probe record)``: the peak bytes of 1 and 2 sequences, their difference (bytes per
        sequence), the budget and the sequences per process (None on a CPU).
    """
    dev = acc.device
    if dev.type != "cuda":
        return 1, None
    peaks: list[int] = []
    for m in (1, 2)[: min(2, n_local)]:
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        try:
            with acc.no_sync(student):
                _micro_loss_backward(student, teacher, blocks[:m].to(dev), cfg, acc, autocast, 1.0)
            torch.cuda.synchronize(dev)
        except torch.OutOfMemoryError:
            if m == 1:
                raise
            break
        peaks.append(torch.cuda.max_memory_allocated(dev) - before)
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(dev)
    budget = int(0.85 * (free + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)))
    mbs = fit_micro_batch(n_local, peaks, budget)
    if acc.num_processes > 1:
        mbs = int(acc.gather(torch.tensor([mbs], device=dev)).min())
    per_seq = peaks[-1] - peaks[0] if len(peaks) == 2 else None
    return mbs, {"peak_bytes": peaks, "bytes_per_sequence": per_seq, "budget_bytes": budget,
                 "sequences_per_process": n_local}


def fit_micro_batch(n_local: int, peaks: Sequence[int], budget: int) -> int:
    """The largest divisor ``d`` of ``n_local`` with ``fixed + d * per_sequence <= budget``, from the peak bytes of a
    micro-batch of 1 and of 2 sequences (``peaks``; ``per_sequence`` is their difference, ``fixed`` the rest of
    the first); 1 when only the first was measured (2 did not fit, or ``n_local`` is 1)."""
    if len(peaks) < 2:
        return 1
    per_seq = max(peaks[1] - peaks[0], 1)
    fixed = max(peaks[0] - per_seq, 0)
    return max([d for d in range(1, n_local + 1) if n_local % d == 0 and fixed + d * per_seq <= budget] or [1])


def _prepare_training(student, teacher: nn.Module, blocks: torch.Tensor, cfg: RftSettings, acc):
    """Check the batch layout against ``blocks`` and the processes, build AdamW on the student's trainable
    parameters, let ``acc`` wrap student and optimizer, and freeze the teacher on the device.

    Returns:
        ``(student, optimizer, trainable parameters, steps, schedule)``.
    """
    world = acc.num_processes
    bs, mbs = cfg.batch_size, cfg.micro_batch_size
    if mbs == "auto" and bs % world:
        raise ValueError(f"rft batch_size={bs} is not divisible by processes={world}")
    if mbs != "auto" and bs % (mbs * world):
        raise ValueError(f"rft batch_size={bs} is not divisible by micro_batch_size={mbs} x processes={world}")
    steps, sched = n_steps(cfg), _schedule(cfg)
    if blocks.shape[0] < steps * bs:
        raise ValueError(f"{blocks.shape[0]} samples for {steps} steps of batch {bs}")
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params, lr=lr_at(0, sched), betas=tuple(cfg.betas), weight_decay=float(cfg.weight_decay)
    )
    student, opt = acc.prepare(student, opt)
    teacher.to(acc.device).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return student, opt, params, steps, sched


def _load_resume(resume_file: Path | None, acc, student, opt) -> tuple[int, list[dict], dict[str, Any]]:
    """Restore the trainable tensors and the optimizer from ``resume_file`` when it exists.

    Returns:
        ``(optimizer steps already done, log lines so far, validation state)``; ``(0, [], empty validation)``
        without a checkpoint.
    """
    empty = {"curve": [], "best_step": None, "best": None, "best_state": None}
    if resume_file is None or not resume_file.is_file():
        return 0, [], empty
    state = torch.load(resume_file, map_location="cpu", weights_only=False)
    named = dict(acc.unwrap_model(student).named_parameters())
    with torch.no_grad():
        for name, value in state["trainable"].items():
            named[name].copy_(value)
    opt.load_state_dict(state["optimizer"])
    return int(state["step"]), list(state["log"]), state.get("validation") or empty


def _checkpoint(resume_file: Path, acc, student, opt, done: int, log_lines: list[dict],
                val: dict[str, Any] | None = None) -> None:
    """Save the resume state after ``done`` optimizer steps (main process), then wait for every process."""
    if acc.is_main_process:
        resume_file.parent.mkdir(parents=True, exist_ok=True)
        _save_resume(
            resume_file,
            {
                "step": done,
                "trainable": trainable_state(acc.unwrap_model(student)),
                "optimizer": opt.state_dict(),
                "log": log_lines,
                "validation": val,
            },
        )
    acc.wait_for_everyone()


def _open_log(stack: contextlib.ExitStack, log_path: str | Path | None, acc, log_lines: list[dict]):
    """The main process's JSONL log, opened on ``stack`` and rewritten with ``log_lines``; None on other
    processes or without ``log_path``."""
    if log_path is None or not acc.is_main_process:
        return None
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    log_file = stack.enter_context(open(log_path, "w"))
    log_file.writelines(json.dumps(rec) + "\n" for rec in log_lines)
    log_file.flush()
    return log_file


def _micro_batches(student, teacher: nn.Module, blocks: torch.Tensor, cfg: RftSettings, acc, autocast,
                   opt) -> tuple[list[int], list[list[int]], int, dict[str, Any] | None]:
    """This process's positions within each batch (every W-th of ``batch_size``) and their micro-batches of
    ``cfg.micro_batch_size``, or with ``auto`` of the size :func:`auto_micro_batch` measures (its probe's gradients
    dropped).

    Returns:
        ``(positions, micro-batches of positions, micro-batch size, probe record or None)``.
    """
    local = list(range(acc.process_index, cfg.batch_size, acc.num_processes))
    mbs, probe = cfg.micro_batch_size, None
    if mbs == "auto":
        mbs, probe = auto_micro_batch(student, teacher, blocks, cfg, acc, autocast, len(local))
        opt.zero_grad(set_to_none=True)  # the probe's gradients are not training's
    micro = [local[i : i + mbs] for i in range(0, len(local), mbs)]
    return local, micro, mbs, probe


def _optimizer_step(student, teacher: nn.Module, blocks: torch.Tensor, step: int, lr: float, cfg: RftSettings,
                    local: list[int], micro: list[list[int]], acc, autocast, opt,
                    params: list[torch.Tensor]) -> tuple[torch.Tensor, Any]:
    """Optimizer step ``step`` at learning rate ``lr``: this process's micro-batches (:func:`_accumulate_step`), the
    gradient norm clipped to ``cfg.grad_clip``, AdamW's update.

    Returns:
        ``([loss, kl, ce]`` averaged over the processes, the gradient norm before clipping).
    """
    for group in opt.param_groups:
        group["lr"] = lr
    totals = _accumulate_step(student, teacher, blocks, step, cfg, local, micro, acc, autocast)
    grad_norm = acc.clip_grad_norm_(params, float(cfg.grad_clip))
    opt.step()
    opt.zero_grad(set_to_none=True)
    return acc.reduce(totals, reduction="mean"), grad_norm


class _TrainLog:
    """The JSONL log of a run: the ``(loss, kl, ce)`` of the optimizer steps since the last line, and the lines,
    each appended to ``lines``, written to ``file`` (the main process's log; None elsewhere) and shown on the
    progress bar ``bar``. Its clock (``t_start``, the run's seconds) starts when it is made."""

    def __init__(self, file, lines: list[dict], tokens_per_step: int, bar):
        self.file, self.lines, self.tokens_per_step, self.bar = file, lines, tokens_per_step, bar
        self.window: list[tuple[float, float, float]] = []
        self.t_start = self.t_window = time.perf_counter()

    def add(self, totals: torch.Tensor) -> None:
        """One optimizer step's ``[loss, kl, ce]``."""
        self.window.append(tuple(float(v) for v in totals))

    def line(self, done: int, lr: float, grad_norm) -> None:
        """The line of the steps since the last one, ending at step ``done`` (:func:`_log_record`): kept, written and
        shown; the window starts again."""
        now = time.perf_counter()
        rec = _log_record(self.window, done, lr, grad_norm, self.tokens_per_step, now - self.t_window,
                          now - self.t_start)
        self.lines.append(rec)
        if self.file is not None:
            self.file.write(json.dumps(rec) + "\n")
            self.file.flush()
        self.bar.set_postfix(loss=f"{rec['loss']:.4f}", kl=f"{rec['kl']:.4f}", tok_s=f"{rec['tokens_per_s']:.0f}")
        self.window, self.t_window = [], now


def _accumulate_step(student, teacher: nn.Module, blocks: torch.Tensor, step: int, cfg: RftSettings,
                     local: list[int], micro: list[list[int]], acc, autocast) -> torch.Tensor:
    """Forward and backward passes of this process's micro-batches of optimizer step ``step``, gradients
    accumulated (synchronised across processes on the last micro-batch only).

    Returns:
        ``[loss, kl, ce]`` of this process's share of the batch (each micro-batch weighted by its share).
    """
    bs = cfg.batch_size
    totals = torch.zeros(3, device=acc.device)
    for j, idx in enumerate(micro):
        x = blocks[[step * bs + i for i in idx]].to(acc.device)
        sync = contextlib.nullcontext() if j == len(micro) - 1 else acc.no_sync(student)
        share = len(idx) / len(local)
        with sync:
            loss, kl, ce = _micro_loss_backward(student, teacher, x, cfg, acc, autocast, share, step)
        totals += torch.stack([loss, kl, ce]) * share
    return totals


def _micro_loss_backward(student, teacher: nn.Module, x: torch.Tensor, cfg: RftSettings, acc, autocast,
                         share: float, step: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The teacher's forward, the student's forward and backward of ``share`` times RFT's loss on the micro-batch
    ``x``. Returns the detached (loss, kl, ce)."""
    dist = cfg.distill
    with torch.no_grad(), autocast:
        t_logits = teacher(input_ids=x).logits
    with autocast:
        s_logits = student(input_ids=x).logits
    loss, kl, ce = distill_loss(s_logits, t_logits, x, dist.temperature, dist.kl_weight, dist.lm_weight)
    if not torch.isfinite(loss):
        where = f" at step {step}" if step is not None else " (micro-batch probe)"
        raise FloatingPointError(f"non-finite RFT loss {float(loss)}{where}")
    acc.backward(loss * share)
    return loss.detach(), kl, ce


def _train_stats(steps: int, start_step: int, tokens_per_step: int, seconds: float, log_lines: list[dict],
                 acc) -> dict[str, Any]:
    """What :func:`train` returns: steps, tokens, seconds and tokens/s of this run, the last log line's losses."""
    last = log_lines[-1] if log_lines else {}
    peak = None
    if acc.device.type == "cuda":  # every process's peak, gathered (a collective: all processes are here)
        mine = torch.tensor([torch.cuda.max_memory_allocated(acc.device)], device=acc.device)
        peak = [int(x) for x in acc.gather(mine).tolist()]
    return {
        "steps": steps,
        "resumed_from_step": start_step,
        "train_tokens": steps * tokens_per_step,
        "train_seconds": seconds,
        "tokens_per_s": (steps - start_step) * tokens_per_step / seconds if seconds > 0 else None,
        "final_loss": last.get("loss"),
        "final_kl": last.get("kl"),
        "final_ce": last.get("ce"),
        "processes": acc.num_processes,
        "device": str(acc.device),
        "peak_memory_bytes": peak,
    }


def _log_record(window: list[tuple[float, float, float]], done: int, lr: float, grad_norm, tokens_per_step: int,
                seconds: float, elapsed: float) -> dict[str, Any]:
    """One JSONL log line: the mean (loss, kl, ce) of the steps in ``window`` (``seconds`` long), ending at step
    ``done``."""
    n = len(window)
    return {
        "step": done,
        "loss": sum(w[0] for w in window) / n,
        "kl": sum(w[1] for w in window) / n,
        "ce": sum(w[2] for w in window) / n,
        "lr": lr,
        "grad_norm": float(grad_norm),
        "tokens_per_s": n * tokens_per_step / seconds,
        "elapsed_s": elapsed,
    }


def _autocast(precision: str, device: torch.device):
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


# ---- the stage --------------------------------------------------------------------------------------
def fingerprint(pruned_dir: str | Path, base_dir: str | Path, cfg: RftSettings, data: dict[str, Any]) -> str:
    """What a resume checkpoint belongs to: the pruned and base artifacts' records and the settings."""
    h = hashlib.sha256()
    for path in (Path(pruned_dir) / "config.json", Path(pruned_dir) / "prune_record.json"):
        h.update(path.read_bytes() if path.is_file() else b"-")
    for name in ("pretrain.json", "init.json", "source.json", "config.json"):
        path = Path(base_dir) / name
        h.update(path.read_bytes() if path.is_file() else b"-")
    h.update(json.dumps(jsonable({"cfg": cfg.to_dict(), "data": data}), sort_keys=True).encode())
    return h.hexdigest()[:16]


def fine_tune(
    pruned_dir: str | Path,
    base_dir: str | Path,
    out_dir: str | Path,
    cfg: RftSettings,
    corpus_spec: dict[str, Any],
    *,
    exclude_docs: Sequence[str] = (),
    dtype: str = "float32",
    device: str = "cpu",
    resume_dir: str | Path | None = None,
    log_path: str | Path | None = None,
    stop_after: int | None = None,
    on_saved: Callable[[nn.Module, Any, Path], None] | None = None,
) -> dict[str, Any]:
    """Fine-tune the pruned checkpoint, merge LoRA and save ``out_dir`` (an HF checkpoint), atomically.

    ``out_dir`` gets the merged model in ``dtype``, the tokenizer, ``prune_record.json`` (the pruned
    checkpoint's decision record with an ``rft`` section: settings, data, statistics), ``rft_record.json``
    (the same ``rft`` section), ``train_log.jsonl`` and ``adapter/`` (the LoRA adapter in peft's format, for the
    pruned checkpoint: :func:`save_adapter`). Written to a temporary sibling and renamed.

    Args:
        pruned_dir: the pruned checkpoint (``results/{model}/{method}_{pct}/pruned``).
        base_dir: the unpruned model's base artifact (teacher).
        out_dir: the RFT checkpoint folder to create.
        cfg: the RFT settings (:class:`~statereduce.common.settings.RftSettings`).
        corpus_spec: corpus of the training samples (its ``train`` split).
        exclude_docs: held-out evaluation documents, never trained on.
        dtype: dtype of the saved checkpoint (training keeps float32 weights; bf16 autocast on CUDA).
        device: ``cpu`` or ``cuda``.
        resume_dir: where resume checkpoints live (outside ``out_dir``; removed after success).
        log_path: an extra copy of the JSONL training log (e.g. under ``logs/``).
        stop_after: test hook (:func:`train`).
        on_saved: called as ``on_saved(merged_model, tokenizer, out_dir)`` by the main process after
            saving (the workflow evaluates the model in memory there).

    Returns:
        The ``rft`` record.
    Raises:
        RuntimeError: ``device`` is CUDA and there is no CUDA GPU, or under ``torchrun`` accelerate did not join
            every process (each would train alone and write ``out_dir``).
    """
    out_dir = Path(out_dir)
    acc, cpu = _accelerator(device, out_dir)
    seed_everything(int(cfg.seed))
    teacher, student, tokenizer, kernels = _load_pair(base_dir, pruned_dir, cfg, cpu, acc)
    checked = {name: kernel_check_record(m) for name, m in (("teacher", teacher), ("student", student))
               if kernel_check_record(m)}  # on CUDA: the fla kernel routes checked and the path of each
    blocks, val_blocks, data = _rft_data(tokenizer, corpus_spec, cfg, exclude_docs)
    key = fingerprint(pruned_dir, base_dir, cfg, data)
    resume = _resume_folder(resume_dir, key, acc)
    seed_everything(int(cfg.seed))  # LoRA's initialisation
    peft_model, modules = attach_lora(student, cfg)
    n_trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    with contextlib.ExitStack() as stack:
        # the main process builds out_dir in a temporary sibling, swapped in only when everything succeeded;
        # after a failure the resume checkpoint, not this folder, carries the progress
        tmp = stack.enter_context(atomic_dir(out_dir)) if acc.is_main_process else None
        stats = train(peft_model, teacher, blocks, cfg, resume_dir=resume, accelerator=acc, stop_after=stop_after,
                      log_path=tmp / LOG_FILE if tmp is not None else None, val_blocks=val_blocks)
        del teacher
        record = _rft_record(cfg, modules, n_trainable, data, base_dir, pruned_dir, dtype, kernels, checked, key,
                             stats)
        if tmp is None:
            acc.wait_for_everyone()
            return record
        save_adapter(acc.unwrap_model(peft_model), tmp / ADAPTER_DIR)
        model = merge(acc.unwrap_model(peft_model)).to(torch_dtype(dtype))
        _write_checkpoint(tmp, model, tokenizer, pruned_dir, record, log_path)
    _drop_resume(resume)
    acc.wait_for_everyone()
    if on_saved is not None:
        on_saved(model, tokenizer, out_dir)
    return record


def _accelerator(device: str, out_dir: Path):
    """The ``accelerate.Accelerator`` of a run on ``device``, and whether that is the CPU.

    Raises:
        RuntimeError: ``device`` is CUDA and there is no CUDA GPU (accelerate would quietly train on the CPU), or
            under ``torchrun`` accelerate did not join every process (each would train alone and write ``out_dir``).
    """
    from accelerate import Accelerator  # accelerate: RFT's work only (test_job_imports)

    cpu = torch.device(device).type == "cpu"
    if not cpu and not torch.cuda.is_available():
        raise RuntimeError(f"RFT on device {device!r} needs a CUDA GPU and this machine has none "
                           "(torch.cuda.is_available() is False); run it on a GPU node or give the model device: cpu")
    acc = Accelerator(cpu=cpu)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if acc.num_processes != world:
        raise RuntimeError(f"torchrun started {world} processes but accelerate joined {acc.num_processes} "
                           f"(distributed type {acc.distributed_type}); every process would write {out_dir}")
    return acc, cpu


def _rft_record(cfg: RftSettings, modules: dict[str, Any], n_trainable: int, data: dict[str, Any],
                base_dir: str | Path, pruned_dir: str | Path, dtype: str, kernels: str, checked: dict[str, Any],
                key: str, stats: dict[str, Any]) -> dict[str, Any]:
    """The ``rft`` record of a run: settings, schedule, LoRA modules, data, teacher (with its checkpoint's provenance:
    a local one with its files' SHA-256) and student, saved dtype, kernels (and their check on CUDA), the resume
    fingerprint and :func:`train`'s statistics."""
    base = checkpoint_provenance(base_dir)
    return {
        "settings": cfg.to_dict(),
        "schedule": _schedule(cfg).to_dict(),
        "modules": modules,
        "n_trainable": n_trainable,
        "data": data,
        "teacher": str(base_dir),
        **({"base_checkpoint": base} if base is not None else {}),
        "student": str(pruned_dir),
        "saved_dtype": dtype,
        "kernels": kernels,
        **({"kernel_check": checked} if checked else {}),
        "fingerprint": key,
        **stats,
    }


def _load_pair(base_dir: str | Path, pruned_dir: str | Path, cfg: RftSettings, cpu: bool, acc):
    """``(teacher, student, tokenizer, kernels)`` on this process's device: the teacher in float32 on CPU and
    bfloat16 on GPU, the student in float32. ``kernels`` is what the student's backward uses
    (the adapter's ``route_backward`` of ``cfg.kernels``: with ``torch`` fla's ops go to the torch fallbacks on
    CUDA too)."""
    here = "cpu" if cpu else acc.device  # under torchrun: this process's own GPU (cuda:LOCAL_RANK)
    teacher, tokenizer = load_model(base_dir, dtype="float32" if cpu else "bfloat16", device=here)
    student, _ = load_model(pruned_dir, dtype="float32", device=here)
    kernels = get_adapter(student).route_backward(cfg.kernels)
    if kernels == "fla":
        check_kernels(student, backward=True)  # on CUDA: fla's backward at the student's head shapes, checked first
    return teacher, student, tokenizer, kernels


def _rft_data(tokenizer, corpus_spec: dict[str, Any], cfg: RftSettings,
              exclude_docs: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """The training and validation blocks of ``corpus_spec``'s ``train`` split (:func:`rft_blocks`) and their
    record."""
    corpus_spec = dict(corpus_spec)
    if corpus_spec.get("source") == "hf" and corpus_spec.get("max_bytes") is None:
        # read a bounded prefix of a large hub split: 8 bytes per token is generous for BPE tokenizers on text
        val_tokens = cfg.val_samples * (cfg.val_seq_len or cfg.seq_len)
        corpus_spec["max_bytes"] = 8 * (cfg.n_samples * cfg.seq_len + val_tokens)
    blocks, val_blocks, data_info = rft_blocks(
        tokenizer, load_split(corpus_spec, "train"), cfg.n_samples, cfg.seq_len, cfg.seed, exclude_docs,
        val_samples=cfg.val_samples, val_seq_len=cfg.val_seq_len,
    )
    data_info.pop("validation_hashes")
    return blocks, val_blocks, {"corpus": corpus_provenance(corpus_spec), "split": "train", **data_info}


def _resume_folder(resume_dir: str | Path | None, key: str, acc) -> Path | None:
    """``resume_dir/<key>``, the resume folder of this run's inputs and settings; the main process removes the
    folders of other keys (stale). None without ``resume_dir``."""
    if resume_dir is None:
        return None
    if Path(resume_dir).is_dir():
        for other in Path(resume_dir).iterdir():
            if other.name != key and acc.is_main_process:
                shutil.rmtree(other, ignore_errors=True)
    return Path(resume_dir) / key


def _drop_resume(resume: Path | None) -> None:
    """Remove a finished run's resume folder, and its parent when no other run's checkpoint is left there."""
    if resume is not None:
        shutil.rmtree(resume, ignore_errors=True)
        with contextlib.suppress(OSError):
            resume.parent.rmdir()


def _write_checkpoint(tmp: Path, model: nn.Module, tokenizer, pruned_dir: str | Path, record: dict[str, Any],
                      log_path: str | Path | None) -> None:
    """Write the merged model, the tokenizer, ``prune_record.json`` (the pruned checkpoint's, with ``record`` as
    its ``rft`` section) and ``rft_record.json`` into ``tmp``; copy the training log to ``log_path``."""
    prune_record = read_json(Path(pruned_dir) / "prune_record.json")
    prune_record["rft"] = record
    save_checkpoint(model, tokenizer, tmp)
    write_json(tmp / "prune_record.json", prune_record)
    write_json(tmp / RECORD_FILE, record)
    if log_path is not None:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tmp / LOG_FILE, log_path)


def launch(
    gpus: int,
    pruned_dir: str | Path,
    base_dir: str | Path,
    out_dir: str | Path,
    settings: RftSettings,
    corpus_spec: dict[str, Any],
    *,
    exclude_docs: Sequence[str] = (),
    dtype: str = "float32",
    device: str = "cuda",
    resume_dir: str | Path | None = None,
    log_path: str | Path | None = None,
) -> None:
    """Run :func:`fine_tune` in ``gpus`` processes, one per GPU: ``torchrun --standalone`` of this module's
    :func:`main`; in each process ``accelerate.Accelerator`` joins the process group and wraps the student in DDP
    (NCCL on CUDA; with ``device="cpu"``, gloo, which the tests use). On CUDA, fewer visible GPUs than ``gpus`` is
    a ValueError before any process starts.

    The job description goes through a JSON file next to ``out_dir``; the package that imported this module
    is put first on the children's ``PYTHONPATH``. Raises ``subprocess.CalledProcessError`` on failure.
    """
    if torch.device(device).type == "cuda" and torch.cuda.device_count() < int(gpus):
        raise ValueError(f"rft.gpus {int(gpus)} needs {int(gpus)} CUDA devices and torch sees "
                         f"{torch.cuda.device_count()} "
                         f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); "
                         f"valid: rft.gpus up to {max(torch.cuda.device_count(), 1)}, or ask the job for more GPUs")
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    job = out_dir.with_name(f".{out_dir.name}.job-{os.getpid()}.json")
    write_json(
        job,
        {
            "settings": settings.to_dict(),
            "corpus_spec": corpus_spec,
            "exclude_docs": list(exclude_docs),
            "dtype": dtype,
            "device": device,
        },
    )
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(int(gpus)),
        "-m", "statereduce.stages.rft", "--pruned", str(pruned_dir), "--base", str(base_dir), "--out", str(out_dir),
        "--job", str(job),
    ]  # fmt: skip
    cmd += ["--resume-dir", str(resume_dir)] if resume_dir is not None else []
    cmd += ["--log", str(log_path)] if log_path is not None else []
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    try:
        subprocess.run(cmd, check=True, env=env)
    finally:
        job.unlink(missing_ok=True)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m statereduce.stages.rft``: one RFT run (also under ``torchrun``, one process per GPU)."""
    p = argparse.ArgumentParser(
        prog="python -m statereduce.stages.rft",
        description="One recovery fine-tuning run of a pruned checkpoint: LoRA plus distillation from the unpruned "
                    "model (also under torchrun, one process per GPU). The workflow's rft rule runs the same; "
                    "docs/rft.md describes it.",
    )
    p.add_argument("--pruned", required=True, help="pruned checkpoint folder (student)")
    p.add_argument("--base", required=True, help="base artifact of the unpruned model (teacher)")
    p.add_argument("--out", required=True, help="RFT checkpoint folder to write")
    p.add_argument(
        "--job", required=True, help="JSON file: {settings: the rft settings (keys of RftSettings, the rest defaults), "
                                     "corpus_spec, exclude_docs?, dtype?, device?}"
    )
    p.add_argument("--resume-dir", default=None, help="folder for resume checkpoints")
    p.add_argument("--log", default=None, help="extra copy of the JSONL training log")
    args = p.parse_args(argv)
    job = read_json(args.job)
    fine_tune(
        args.pruned,
        args.base,
        args.out,
        RftSettings.from_dict(job.get("settings")),
        job["corpus_spec"],
        exclude_docs=job.get("exclude_docs") or (),
        dtype=job.get("dtype", "float32"),
        device=job.get("device", "cpu"),
        resume_dir=args.resume_dir,
        log_path=args.log,
    )


if __name__ == "__main__":
    main()


def run_rft(pruned_dir: str | Path, base_dir: str | Path, out_dir: str | Path, plan: RftPlan,
            corpus_spec: dict, eval_settings: EvalSettings, info: dict[str, Any], eval_out: str | Path, *,
            resume_dir: str | Path | None = None, log_jsonl: str | Path | None = None,
            extra: dict[str, Any] | None = None) -> dict:
    """The ``rft`` stage: fine-tune the pruned checkpoint (:mod:`statereduce.stages.rft`), save it, evaluate it.

    The held-out documents of the ``heldout`` evaluation task are excluded from the training data. With
    ``plan.gpus > 1`` training runs under ``torchrun`` (one process per GPU, DDP through accelerate) and the saved
    checkpoint is then loaded for evaluation; otherwise everything runs in this process and the merged model
    is evaluated in memory. ``plan`` is the model's :class:`~statereduce.common.settings.RftPlan`, ``eval_settings`` its
    :class:`~statereduce.common.settings.EvalSettings`. First the pruned
    checkpoint's ``prune_record.json`` must have been written for this job: ``info``'s model and family, ``extra``'s
    method and pct (:func:`statereduce.core.artifacts.check_prune_record`).

    Returns:
        The ``eval.json`` document of the RFT checkpoint.
    """
    check_prune_record(pruned_dir, {**info, **(extra or {})})
    exclude = load_split(eval_settings.corpus_spec, "heldout") if HELDOUT in eval_settings.tasks else []
    out: dict[str, Any] = {}

    def evaluate(model, tokenizer, saved: Path) -> None:
        out["doc"] = evaluate_loaded(model.to(info["device"]), tokenizer, saved, eval_settings, info, eval_out, extra)

    if int(plan.gpus) > 1:
        launch(int(plan.gpus), pruned_dir, base_dir, out_dir, plan.settings, corpus_spec, exclude_docs=exclude,
               dtype=info["dtype"], device=info["device"], resume_dir=resume_dir, log_path=log_jsonl)
        return evaluate_checkpoint(out_dir, eval_settings, info, eval_out, extra)
    fine_tune(pruned_dir, base_dir, out_dir, plan.settings, corpus_spec, exclude_docs=exclude, dtype=info["dtype"],
              device=info["device"], resume_dir=resume_dir, log_path=log_jsonl, on_saved=evaluate)
    return out["doc"]
