"""Recall-only phase alone (pretrain's own stream, schedule and loop), probe acc@4/@8 every EVERY steps.

Usage (repo root): .venv/bin/python docs/experiments/recall_mix/diag_pure.py FAMILY '{mix}' [EVERY]
  mix: recall_mix with pure_steps (the schedule length) and pure_lr. Prints step, mean train loss, acc.
"""
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run_new as rn  # noqa: E402
from statereduce.adapters import adapter_class  # noqa: E402
from statereduce.models import tiny_config  # noqa: E402
from statereduce.pretrain import (  # noqa: E402
    _mix_settings, _param_groups, _recall_phase, _train_cfg, lr_at, seed_everything,
)

family, mix = sys.argv[1], _mix_settings(json.loads(sys.argv[2]))
every = int(sys.argv[3]) if len(sys.argv) > 3 else 100
ad = adapter_class(family)
ad.install_fallbacks()
torch.set_num_threads(1)
cfg = _train_cfg(rn.TRAIN)
seed_everything(0)
stream, pcfg = _recall_phase(rn.TOK, cfg, mix)
model = ad.build(tiny_config(family, rn.ARCH[family]), dtype=torch.float32)
model.train()
opt = torch.optim.AdamW(_param_groups(model, 0.1), lr=lr_at(0, pcfg), betas=(0.9, 0.95))
g = torch.Generator().manual_seed(0)
off = torch.arange(128)
t, losses = time.perf_counter(), []
for step in range(int(pcfg["steps"])):
    x = stream[torch.randint(0, stream.numel() - 128 + 1, (4,), generator=g)[:, None] + off]
    for gr in opt.param_groups:
        gr["lr"] = lr_at(step, pcfg)
    loss = model(input_ids=x, labels=x).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    losses.append(loss.item())
    if (step + 1) % every == 0:
        model.eval()
        acc = rn.recall_acc(model, levels=(4, 8))
        model.train()
        print(step + 1, round(sum(losses) / len(losses), 3), acc, round(time.perf_counter() - t), flush=True)
        losses = []
