"""Pretraining the embedded tiny models from scratch (the offline default of the workflow).

The workflow's default models are stock language models of each family (fla DeltaNet / Gated DeltaNet,
transformers Mamba-2 / Qwen3.5) with a byte-level tokenizer, trained here on the ``train`` split of a
corpus (by default the embedded Python-stdlib corpus, :mod:`statereduce.core.data`) so that every later stage
(calibration, selection, slicing, recovery fine-tuning, evaluation) has a model that has actually learned
something. On CPU the layers run through the family adapter's fallbacks (fla's through
:mod:`statereduce.kernels.fla_fallback`).

:func:`init_random` writes an untrained model of any shape instead (a model's ``init:`` source): the cost of every
stage at a hub model's size, where nothing can be downloaded.

Paper: Nazari & Rusch (2026), "On State Reduction in Linear Attention", Sec. 5 (the pretrained DeltaNet
and Gated DeltaNet models that are pruned); the tiny models stand in for them offline.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from statereduce.adapters import adapter_class
from statereduce.adapters.conv_sharing import tie_qk_convs
from statereduce.core.data import corpus_provenance, load_split, token_stream
from statereduce.core.models import build_random, save_checkpoint, tiny_config
from statereduce.core.runtime import (  # noqa: F401  (lr_at re-exported)
    atomic_dir, lr_at, seed_everything, versions, write_json,
)
from statereduce.common.settings import (
    DeviceSettings, InitSettings, PretrainSettings, RecallMixSettings, TrainSettings,
)
from statereduce.core.tokenizer import byte_level_tokenizer
from statereduce.eval.recall import (
    answer_labels, generate_recall_docs, joined_bytes, mix_recall_docs, recall_accuracy, recall_stream_docs,
)
from statereduce.families import check_share_conv


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices (projections, embeddings, lm head); none on norms, biases, gates' scalars."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


@torch.no_grad()
def mean_loss(model: torch.nn.Module, blocks: torch.Tensor, batch_size: int = 8) -> float:
    """Mean next-token cross entropy (nats/token) over ``blocks`` [N, T], each block scored on its own."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, blocks.shape[0], batch_size):
        x = blocks[i : i + batch_size]
        logits = model(input_ids=x).logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
        )
        total += float(loss)
        count += x[:, 1:].numel()
    model.train(was_training)
    return total / count


def _eval_blocks(tokenizer, corpus_spec: dict, split: str, n: int, seq_len: int, seed: int) -> torch.Tensor | None:
    """Up to ``n`` non-overlapping blocks of the split, seeded; None when the split has no full block."""
    stream = token_stream(tokenizer, load_split(corpus_spec, split))
    n_blocks = stream.numel() // seq_len
    if n_blocks == 0 or n < 1:
        return None
    g = torch.Generator().manual_seed(seed)
    pick = torch.randperm(n_blocks, generator=g)[: min(n, n_blocks)]
    return stream[: n_blocks * seq_len].view(n_blocks, seq_len)[pick]


def pretrain(
    family: str,
    arch: dict[str, Any],
    corpus_spec: dict[str, Any],
    train_cfg: TrainSettings,
    out_dir: str | Path,
    log_path: str | Path | None = None,
    recall_mix: RecallMixSettings | None = None,
    share_conv: str = PretrainSettings.share_conv,
) -> dict[str, Any]:
    """Train a tiny stock model of ``family`` from scratch and save it as an HF checkpoint folder.

    Training: byte-level tokenizer; the ``train`` split's documents joined with EOS into one token stream;
    each step reads ``batch_size`` windows of ``seq_len`` tokens at offsets drawn from a generator seeded
    with ``seed`` (so the batch order is fixed by the seed); loss = the model's next-token cross entropy;
    AdamW (weight decay on matrices only), linear warmup then cosine decay to ``min_lr`` (default lr/10),
    gradient-norm clipping. Deterministic on CPU for a given seed and thread count. With ``recall_mix``,
    synthetic recall documents (:func:`statereduce.eval.recall.mix_recall_docs`, the format of the offline
    recall probe) are inserted among the training documents before they are joined; the calib/heldout
    blocks (and the workflow's held-out evaluation) stay pure corpus text. With ``recall_mix.pure_steps``
    a first phase of that many steps trains on recall documents only, with its own AdamW and schedule
    (peak ``pure_lr``, the same warmup, cosine to a tenth); then the corpus phase runs as above
    (``train.steps`` more steps). Without that phase the tiny models never learned the lookup from a
    mix (docs/experiments/recall_mix/README.md). With ``share_conv`` ``"head"`` / ``"all"`` the q/k short-conv
    filters train tied, one per head / one per layer (paper App. B.5, C.6.1, Table 14;
    :func:`statereduce.adapters.conv_sharing.tie_qk_convs`), starting from the first of the filters they replace;
    the saved checkpoint is a stock one whose tied filters are exactly equal.

    Args:
        family: an adapter family, e.g. ``"delta_net"`` or ``"qwen3_5"`` (:func:`statereduce.core.models.tiny_config`).
        arch: config fields of the family (hidden_size, num_hidden_layers, num_heads, expand_k / head_dim,
            expand_v, ...).
        corpus_spec: a corpus spec (:func:`statereduce.core.data.load_split`); its ``train`` split is used for
            training, a few ``calib`` / ``heldout`` blocks for the final losses.
        train_cfg: the optimisation (:class:`~statereduce.common.settings.TrainSettings`: steps, batch_size, seq_len,
            lr, min_lr, weight_decay, betas, warmup, grad_clip, seed, threads (``torch.set_num_threads``), log_every,
            eval_blocks).
        out_dir: the checkpoint folder to create (replaced if it exists); written to a temporary sibling
            and renamed, so it is never half-written.
        log_path: optional extra JSONL file receiving the training log lines (the checkpoint always holds
            ``train_log.jsonl``).
        recall_mix: recall documents mixed in (:class:`~statereduce.common.settings.RecallMixSettings`: fraction,
            n_pairs, seed, pure_steps, pure_lr); ``None`` trains on the corpus alone.
        share_conv: ``"none"`` (stock convolutions), ``"head"`` or ``"all"``; only for families with q and k short
            convolutions in modules of their own (DeltaNet, Gated DeltaNet).

    Returns:
        The ``pretrain.json`` record: arch, train config, corpus provenance, final train loss (mean of the
        last logged window), calib/heldout losses in nats per token, wall time, tokens/s, versions, and
        with ``recall_mix`` its settings plus ``n_docs`` (recall documents), ``byte_share`` (their share of
        the training text's bytes, one separator per document counted) and ``pure_seconds`` (the recall-only
        phase's share of ``train_seconds``; with that phase, ``train_tokens`` and the times cover both), and
        ``share_conv``.
    """
    family_adapter = adapter_class(family)
    cfg, mix = train_cfg, recall_mix
    check_share_conv(family, share_conv, arch)
    family_adapter.install_fallbacks()
    torch.set_num_threads(int(cfg.threads))
    seed_everything(int(cfg.seed))
    tokenizer = byte_level_tokenizer()
    config = tiny_config(family, arch)
    stream, mix_record = _training_stream(tokenizer, corpus_spec, mix)
    pure = _recall_phase(tokenizer, cfg, mix)
    if stream.numel() < int(cfg.seq_len) + 1:
        raise ValueError(f"train split too small: {stream.numel()} tokens for seq_len={cfg.seq_len}")
    model = family_adapter.build(config, dtype=torch.float32)
    untie = tie_qk_convs(family_adapter(model), share_conv)  # "none": nothing changes

    with atomic_dir(out_dir) as tmp:
        log_paths = [tmp / "train_log.jsonl"] + ([Path(log_path)] if log_path is not None else [])
        stats = _train_phases(model, stream, cfg, pure, mix_record, log_paths, family)
        untie()
        model.eval()
        record = _pretrain_record(model, tokenizer, family, arch, cfg, corpus_spec, mix_record, share_conv, stats)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "pretrain.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def _pretrain_record(model: torch.nn.Module, tokenizer, family: str, arch: dict[str, Any], cfg: TrainSettings,
                     corpus_spec: dict[str, Any], mix_record: dict[str, Any] | None, share_conv: str,
                     stats: dict[str, Any]) -> dict[str, Any]:
    """The ``pretrain.json`` record of a trained ``model`` (:func:`pretrain`'s Returns): the run's settings, corpus
    and training statistics ``stats``, and the calib/heldout losses measured here (:func:`_eval_losses`)."""
    return {
        "family": family,
        "arch": dict(arch),
        "n_params": sum(p.numel() for p in model.parameters()),
        "train": cfg.to_dict(),
        "corpus": corpus_provenance(corpus_spec),
        **({"recall_mix": mix_record} if mix_record is not None else {}),
        "share_conv": share_conv,
        **stats,
        "eval_loss": _eval_losses(model, tokenizer, corpus_spec, cfg),
        "eval_blocks": {"n": int(cfg.eval_blocks), "seq_len": int(cfg.seq_len), "seed": int(cfg.seed)},
        "loss_unit": "nats per token (byte-level tokenizer: nats per byte)",
        "versions": versions(),
    }


INIT_RECORD = "init.json"
"""The record of a checkpoint :func:`init_random` wrote (beside its config and weights)."""


def init_random(
    family: str, arch: dict[str, Any], out_dir: str | Path, *, seed: int = InitSettings.seed,
    dtype: str = DeviceSettings.dtype, device: str | torch.device = DeviceSettings.device,
) -> dict[str, Any]:
    """Write an untrained checkpoint of ``family`` and shape ``arch`` (weights, config, byte-level tokenizer) and
    ``init.json`` into ``out_dir``, atomically.

    The weights are the config class's own initialisation, seeded, built directly on ``device`` in ``dtype`` (a 9B
    model needs no copy in host memory). Every later stage treats the folder like a trained checkpoint; what they
    cost (time, memory, file sizes) is that of a trained model of the same shape, what they measure of its quality
    means nothing.

    Args:
        family: adapter family.
        arch: keyword arguments of the family's config class (:func:`statereduce.core.models.tiny_config`; give
            ``vocab_size`` for a hub model's embedding size: the byte-level tokenizer uses only its first 257 ids).
        seed: seeds torch before the weights are drawn.
        dtype: float32 (the default, a model's ``dtype`` in the workflow too), bfloat16 or float16: the dtype of
            the saved weights.

    Returns:
        The record written to ``init.json``: family, arch, seed, dtype, parameter count, seconds, versions.
    """
    start = time.perf_counter()
    model = build_random(family, arch, seed=int(seed), dtype=dtype, device=device).eval()
    record = {
        "family": family,
        "arch": dict(arch),
        "seed": int(seed),
        "dtype": dtype,
        "device": str(device),
        "n_params": sum(p.numel() for p in model.parameters()),
        "weights": "random (the config class's initialisation); not a trained model",
        "seconds": None,
        "versions": versions(),
    }
    with atomic_dir(out_dir) as tmp:
        save_checkpoint(model, byte_level_tokenizer(), tmp)
        record["seconds"] = round(time.perf_counter() - start, 3)
        write_json(tmp / INIT_RECORD, record)
    return record


def _eval_losses(model: torch.nn.Module, tokenizer, corpus_spec: dict[str, Any],
                 cfg: TrainSettings) -> dict[str, float | None]:
    """Mean loss on ``eval_blocks`` seeded blocks of the ``calib`` and ``heldout`` splits (None for a split
    without a full block)."""
    losses: dict[str, float | None] = {}
    for split in ("calib", "heldout"):
        blocks = _eval_blocks(tokenizer, corpus_spec, split, int(cfg.eval_blocks), int(cfg.seq_len), int(cfg.seed))
        losses[split] = None if blocks is None else mean_loss(model, blocks)
    return losses


def _training_stream(tokenizer, corpus_spec: dict[str, Any],
                     mix: RecallMixSettings | None) -> tuple[torch.Tensor, dict[str, Any] | None]:
    """The token stream of the ``train`` split's documents, with ``mix``'s recall documents inserted among them.

    Returns:
        ``(stream, record)``: ``record`` is ``mix`` as a dict plus ``n_docs`` (recall documents) and ``byte_share``
        (their share of the training text's bytes); None without ``mix``.
    """
    docs = load_split(corpus_spec, "train")
    record = None
    if mix is not None:
        corpus_bytes = sum(map(joined_bytes, docs))
        docs, n_recall = mix_recall_docs(docs, mix.fraction, mix.n_pairs, mix.seed)
        byte_share = 1.0 - corpus_bytes / sum(map(joined_bytes, docs))
        record = {**mix.to_dict(), "n_docs": n_recall, "byte_share": byte_share}
    return token_stream(tokenizer, docs), record


def _recall_phase(tokenizer, cfg: TrainSettings, mix: RecallMixSettings | None) -> dict[str, Any] | None:
    """The recall-only first phase (``mix.pure_steps`` steps at peak ``pure_lr``, the corpus phase's warmup, cosine
    to a tenth; with ``mix.until`` a constant lr after the warmup and a stop once the check passes), or None.

    Returns:
        ``{"stream", "labels", "cfg", "until"}``: the token stream, its labels (None: every next token;
        ``mix.answer_loss``: :func:`~statereduce.eval.recall.answer_labels`), the phase's train settings and its
        stop check (a callable ``model -> accuracy`` and the target, or None).
    """
    n_pure = 0 if mix is None else int(mix.pure_steps)
    if n_pure <= 0:
        return None
    floor = mix.pure_lr if mix.until is not None else None
    pure_cfg = cfg.replace(steps=n_pure, lr=mix.pure_lr, min_lr=floor, warmup=min(cfg.warmup, n_pure - 1))
    pure_docs = recall_stream_docs(n_pure * int(cfg.batch_size) * int(cfg.seq_len), mix.n_pairs, mix.seed)
    if mix.answer_loss:
        stream, labels = answer_labels(tokenizer, pure_docs)
    else:
        stream, labels = token_stream(tokenizer, pure_docs), None
    until = None
    if mix.until is not None:
        # 4-pair documents of a seed the probe (seed 0 of its eval settings) and the training stream never draw
        check_docs = generate_recall_docs(UNTIL_DOCS, UNTIL_PAIRS, seed=UNTIL_SEED + int(mix.seed))
        until = (lambda model: recall_accuracy(model, tokenizer, check_docs), float(mix.until), int(mix.check_every))
    return {"stream": stream, "labels": labels, "cfg": pure_cfg, "until": until}


UNTIL_DOCS, UNTIL_PAIRS, UNTIL_SEED = 64, 4, 1000
"""The documents of ``recall_mix.until``'s check: 64 of 4 pairs, seed 1000 + ``recall_mix.seed``."""


def _train_phases(model: torch.nn.Module, stream: torch.Tensor, cfg: TrainSettings, pure: dict[str, Any] | None,
                  mix: dict[str, Any] | None, log_paths: list[Path], family: str) -> dict[str, Any]:
    """Run the recall-only phase ``pure`` (when given), then the corpus phase, logging both to ``log_paths``.

    Returns:
        The corpus phase's :func:`train_loop` statistics, with tokens and times covering both phases; the
        recall phase's seconds go to ``mix["pure_seconds"]`` (``mix``: the recall mix's record).
    """
    if pure is None:
        return train_loop(model, stream, cfg, log_paths, f"pretrain {family}", step_offset=0, append=False)
    pure_stats = train_loop(model, pure["stream"], pure["cfg"], log_paths, desc=f"pretrain {family} (recall only)",
                            labels=pure["labels"], until=pure["until"])
    mix["pure_seconds"] = pure_stats["train_seconds"]
    mix["pure_steps_run"] = pure_stats["steps"]
    if pure["until"] is not None:
        mix["pure_check"] = pure_stats["check"]
    stats = train_loop(model, stream, cfg, log_paths, f"pretrain {family}", step_offset=pure_stats["steps"],
                       append=True)
    for key in ("train_tokens", "train_seconds", "train_cpu_seconds"):
        stats[key] += pure_stats[key]
    stats["tokens_per_s"] = stats["train_tokens"] / stats["train_seconds"]
    return stats


def train_loop(
    model: torch.nn.Module,
    stream: torch.Tensor,
    cfg: TrainSettings,
    log_paths: list[Path],
    desc: str = "pretrain",
    step_offset: int = 0,
    append: bool = False,
    labels: torch.Tensor | None = None,
    until: tuple[Any, float, int] | None = None,
) -> dict[str, Any]:
    """The optimisation loop of :func:`pretrain`.

    Each step reads ``batch_size`` windows of ``seq_len`` tokens of ``stream`` at offsets drawn from a
    generator seeded with ``cfg.seed``. Each call builds a fresh AdamW and follows the schedule of
    ``cfg``, so a second call is a second training phase. Writes a JSONL line every ``log_every`` steps
    (and at the last step) to each of ``log_paths``: step (plus ``step_offset``), mean loss since the
    previous line, lr, grad norm, tokens/s, elapsed wall and process-CPU seconds; ``append`` appends to
    the files instead of replacing them. ``labels`` (a stream as long as ``stream``, -100 where no loss is taken)
    replaces the next-token targets. ``until`` = ``(check, target, every)`` calls ``check(model)`` every ``every``
    steps (and logs it as ``recall_acc``) and stops once it returns at least ``target``.

    Returns:
        ``final_train_loss`` (mean loss of the last logged window), ``steps`` (run), ``train_tokens``,
        ``train_seconds``, ``train_cpu_seconds``, ``tokens_per_s``, and with ``until`` ``check``: the last check's
        step, accuracy and target.
    """
    batch_size, seq_len, steps = int(cfg.batch_size), int(cfg.seq_len), int(cfg.steps)
    model.train()
    opt = torch.optim.AdamW(_param_groups(model, float(cfg.weight_decay)), lr=lr_at(0, cfg), betas=tuple(cfg.betas))
    batch_gen = torch.Generator().manual_seed(int(cfg.seed))
    offsets = torch.arange(seq_len)
    for p in log_paths:
        p.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        log_files = [stack.enter_context(open(p, "a" if append else "w")) for p in log_paths]
        recent: list[float] = []
        final_train_loss = float("nan")
        done, check = 0, None
        t_start = t_window = time.perf_counter()
        cpu_start = time.process_time()
        bar = tqdm(range(steps), desc=desc, mininterval=5.0, unit="step")
        for step in bar:
            starts = torch.randint(0, stream.numel() - seq_len + 1, (batch_size,), generator=batch_gen)
            x = stream[starts[:, None] + offsets]
            y = x if labels is None else labels[starts[:, None] + offsets]
            lr = lr_at(step, cfg)
            loss, grad_norm = _train_step(model, opt, x, y, lr, float(cfg.grad_clip), step)
            recent.append(loss)
            done = step + 1
            passed = False
            if until is not None and (done % until[2] == 0 or done == steps):
                check = {"step": done, "recall_acc": until[0](model), "target": until[1]}
                passed = check["recall_acc"] >= until[1]
            if done % int(cfg.log_every) == 0 or done == steps or passed:
                recall_acc = check["recall_acc"] if check and check["step"] == done else None
                rec, now = _log_line(log_files, step_offset + step + 1, recent, lr, grad_norm, batch_size * seq_len,
                                     t_window, t_start, cpu_start, recall_acc)
                bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}")
                final_train_loss, recent, t_window = rec["loss"], [], now
            if passed:
                break
    train_s = time.perf_counter() - t_start
    return {
        "final_train_loss": final_train_loss,
        "steps": done,
        "train_tokens": done * batch_size * seq_len,
        "train_seconds": train_s,
        "train_cpu_seconds": time.process_time() - cpu_start,
        "tokens_per_s": done * batch_size * seq_len / train_s,
        **({"check": check} if until is not None else {}),
    }


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, lr: float,
                grad_clip: float, step: int) -> tuple[float, torch.Tensor]:
    """One optimizer step of :func:`train_loop` at learning rate ``lr``: the model's loss on the batch ``x`` with
    targets ``y``, its backward, the gradient norm clipped to ``grad_clip``, AdamW's update.

    Returns:
        ``(loss, gradient norm before clipping)``.
    Raises:
        FloatingPointError: the loss is not finite (at ``step``).
    """
    for group in opt.param_groups:
        group["lr"] = lr
    loss = model(input_ids=x, labels=y).loss
    if not torch.isfinite(loss):
        raise FloatingPointError(f"non-finite training loss {float(loss)} at step {step}")
    opt.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    return loss.item(), grad_norm


def _log_line(log_files: list, step: int, recent: list[float], lr: float, grad_norm: torch.Tensor,
              tokens_per_step: int, t_window: float, t_start: float, cpu_start: float,
              recall_acc: float | None) -> tuple[dict[str, Any], float]:
    """One JSONL line of :func:`train_loop`, written to each of ``log_files``: ``step``, the mean loss of the
    ``recent`` steps, lr, grad norm, tokens/s since ``t_window``, the wall seconds since ``t_start`` and the
    process-CPU seconds since ``cpu_start`` (``time.perf_counter()`` and ``time.process_time()`` values) and, when a
    recall check ran at this step, its accuracy.

    Returns:
        ``(line, time.perf_counter() at it)``.
    """
    now = time.perf_counter()
    rec = {
        "step": step,
        "loss": sum(recent) / len(recent),
        "lr": lr,
        "grad_norm": float(grad_norm),
        "tokens_per_s": len(recent) * tokens_per_step / (now - t_window),
        "elapsed_s": now - t_start,
        "cpu_s": time.process_time() - cpu_start,
        **({"recall_acc": recall_acc} if recall_acc is not None else {}),
    }
    for f in log_files:
        f.write(json.dumps(rec) + "\n")
        f.flush()
    return rec, now
