"""Two phases, each with its own schedule and optimizer: PURE steps of recall documents only at lr 1e-3, then the
tiny model's default corpus pretraining (700 steps, lr 3e-3) with recall documents mixed in.
Usage: .venv/bin/python docs/experiments/recall_mix/two_phase.py NAME FAMILY PURE '{mix}'  -> runs/NAME/eval.json"""
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run

from statereduce.data import load_split, token_stream
from statereduce.models import tiny_config
from statereduce.pretrain import _train_cfg, seed_everything, train_loop
from statereduce.eval.recall import mix_recall_docs, recall_stream_docs
from statereduce.prune import prune_model

name, family, pure, mix = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
d = run.ROOT / name
d.mkdir(parents=True, exist_ok=True)
run.fla_fallback.install()
torch.set_num_threads(1)
seed_everything(0)
t0 = time.perf_counter()
model = AutoModelForCausalLM.from_config(tiny_config(family, run.ARCH[family]), dtype=torch.float32)
cfg1 = _train_cfg({**run.TRAIN, "lr": 1e-3, "steps": pure})
train_loop(model, token_stream(run.TOK, recall_stream_docs(pure * 512, mix["n_pairs"], 0)), cfg1, [d / "log1.jsonl"])
docs, _ = mix_recall_docs(load_split(run.CORPUS, "train"), mix["fraction"], mix["n_pairs"], 0)
train_loop(model, token_stream(run.TOK, docs), _train_cfg(run.TRAIN), [d / "log2.jsonl"])
train_s = time.perf_counter() - t0
model.eval().save_pretrained(d / "base")
res = {"name": name, "family": family, "mix": {**mix, "pure_steps_own_schedule_lr1e-3": pure}, "train": {},
       "train_s": round(train_s), "unpruned": {"bpb": run.heldout_bpb(model), **run.recall_acc(model)}}
print("unpruned", json.dumps(res["unpruned"]), flush=True)
for m, keep in run.keep_sets(model, d).items():
    pm = AutoModelForCausalLM.from_pretrained(d / "base", dtype=torch.float32).eval()
    prune_model(pm, keep, {"method": m, "pct": 75})
    res[f"{m}_75"] = {"bpb": run.heldout_bpb(pm), **run.recall_acc(pm)}
(d / "eval.json").write_text(json.dumps(res, indent=1))
print(json.dumps(res))
