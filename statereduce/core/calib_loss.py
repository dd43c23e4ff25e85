"""The calibration loss that the measured budget policies rank cuts by (``sensitivity``: one layer cut at a time;
``split``: a joint cut's key/value split): the mean next-token cross-entropy over the first ``n_samples``
calibration sequences, and what it reads."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from statereduce.common.settings import BudgetPlan, BudgetSettings
from statereduce.core.models import load_model


def calibration_loss(model, blocks, batch_size: int) -> float:
    """Mean next-token cross-entropy (nats) of ``model`` over ``blocks`` [N, T]."""
    import torch  # off the start-up of the allocate and select jobs, which import this module

    device = next(model.parameters()).device
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, blocks.shape[0], batch_size):
            ids = blocks[start:start + batch_size].to(device)
            logits = model(ids).logits[:, :-1].float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                     reduction="sum")
            total += float(loss)
            count += ids[:, 1:].numel()
    return total / count


def loss_inputs(plan: BudgetPlan, base: str | Path | None, expect: Mapping[str, Any] | None, *,
                load: bool = True) -> tuple[Any, Any, BudgetSettings]:
    """What a policy that measures the calibration loss (``sensitivity``, ``split``) reads: with ``load`` the base
    model and the first ``n_samples`` calibration blocks [N, T] (else None, None), and the settings with their batch
    size set."""
    settings, cal = plan.settings, plan.calibration
    if cal is None or (load and (base is None or plan.corpus is None)):
        raise ValueError(f"the {settings.policy} budget needs the base checkpoint, its calibration and corpus")
    n_samples, batch = settings.sizes(cal)
    model = blocks = None
    if load:
        from statereduce.core.data import load_split, token_blocks  # torch: off the allocate job's start-up

        info = dict(expect or {})
        model, tokenizer = load_model(base, dtype=info.get("dtype"), device=info.get("device", "cpu"))
        blocks = token_blocks(tokenizer, load_split(dict(plan.corpus), cal.split), cal.n_samples, cal.seq_len,
                              cal.seed)[:n_samples]
    return model, blocks, settings.replace(batch_size=batch)
