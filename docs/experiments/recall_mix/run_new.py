"""run.py for the transformers families (tiny-mamba2, tiny-qwen35): recall-mixed pretraining, then held-out
bits/byte and recall-probe acc (4 and 8 pairs) before/after 50% pruning (drrqr, l1; no RFT).

Usage (from the repo root):
  .venv/bin/python docs/experiments/recall_mix/run_new.py NAME FAMILY '{mix}' '{train}' [noprune]
  FAMILY: mamba2 | qwen3_5; mix: statereduce.pretrain's recall_mix ({} = none); train: overrides of the
  tiny models' config train block. `noprune` skips the pruned evaluations (diagnostic runs, e.g. the
  recall-only phase alone with train {"steps": 1, "warmup": 0, "lr": 1e-12}).
Writes runs/NAME/ (checkpoint, eval.json); prints one JSON line of results.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from statereduce.adapters import adapter_class
from statereduce.models import load_model
from statereduce.eval import recall as rc
from statereduce.capture import capture_activations, export_qk_weights
from statereduce.data import load_split, token_blocks
from statereduce.pretrain import pretrain
from statereduce.select import select_channels
from statereduce.prune import prune_model
from statereduce.eval.run import heldout_docs
from statereduce.tokenizer import byte_level_tokenizer

ROOT = Path(__file__).resolve().parent / "runs"  # git-ignored (docs/experiments/*/runs/)
CORPUS = {"source": "embedded"}
ARCH = {  # config.yaml's tiny-mamba2 / tiny-qwen35
    "mamba2": {"hidden_size": 128, "num_hidden_layers": 4, "num_heads": 8, "head_dim": 32, "expand": 2,
               "n_groups": 2, "state_size": 64, "chunk_size": 64},
    "qwen3_5": {"hidden_size": 128, "num_hidden_layers": 4, "intermediate_size": 512, "num_attention_heads": 2,
                "num_key_value_heads": 1, "head_dim": 64, "linear_num_key_heads": 2, "linear_key_head_dim": 64,
                "linear_num_value_heads": 4, "linear_value_head_dim": 32,
                "layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention"]},
}
TRAIN = {"steps": 700, "batch_size": 4, "seq_len": 128, "lr": 3.0e-3, "warmup": 50, "seed": 0, "threads": 1}
LEVELS = (4, 8)
PCT = 50
TOK = byte_level_tokenizer()


@torch.no_grad()
def recall_acc(model, levels=LEVELS, n_docs=100, seed=0) -> dict[str, float]:
    """lm-eval's multiple_choice acc by hand: argmax over choices of log p(choice | prompt), choice right after '='."""
    out = {}
    for n in levels:
        correct = 0
        for d in rc.generate_recall_docs(n_docs, n, seed=seed):
            x = torch.tensor([TOK(d["prompt"] + c, add_special_tokens=False)["input_ids"] for c in d["choices"]])
            logp = torch.log_softmax(model(input_ids=x[:, :-1]).logits.float(), -1)
            ll = logp[:, -2:].gather(2, x[:, -2:, None]).sum((1, 2))
            correct += int(torch.argmax(ll)) == d["gold"]
        out[f"r{n}"] = correct / n_docs
    return out


_HELD = heldout_docs(CORPUS, 32, 2048)


@torch.no_grad()
def heldout_bpb(model) -> float:
    """lm-eval loglikelihood_rolling bits/byte of the eval task (32 held-out docs cut to 2048 bytes, EOS first)."""
    nll, nbytes = 0.0, 0
    for d in _HELD:
        x = torch.tensor([[TOK.eos_token_id] + TOK(d, add_special_tokens=False)["input_ids"]])
        logp = torch.log_softmax(model(input_ids=x[:, :-1]).logits.float(), -1)
        nll -= float(logp.gather(2, x[:, 1:, None]).sum())
        nbytes += len(d.encode())
    return nll / nbytes / math.log(2)


def keep_sets(model, d: Path, methods=("drrqr", "l1"), pct=PCT) -> dict:
    """The package's selections (the tiny models' calibration settings) as {method: {layer: LongTensor [H, d_k']}}."""
    export_qk_weights(model, d / "qk.h5")
    blocks = token_blocks(TOK, load_split(CORPUS, "calib"), 32, 256, 0)
    capture_activations(model, blocks, d / "activations.h5", rows_per_head=2500, seed=0, batch_size=8)
    out = {}
    for m in methods:
        rows, _ = select_channels(d / "qk.h5", m, pct, activations=d / "activations.h5", seed=0,
                                options={"f": 2.0} if m == "drrqr" else {})
        keep: dict = {}
        for layer, head, sel in rows:
            keep.setdefault(layer, {})[head] = sorted(np.asarray(sel.keep).tolist())
        out[m] = {layer: torch.tensor([hs[h] for h in sorted(hs)]) for layer, hs in keep.items()}
    return out


def load(path: Path):
    return load_model(path, dtype="float32")[0].eval()


def main(name: str, family: str, mix: dict, train: dict, prune: bool = True) -> dict:
    adapter_class(family).install_fallbacks()
    torch.set_num_threads(1)
    d = ROOT / name
    t0 = time.perf_counter()
    rec = pretrain(family, ARCH[family], CORPUS, {**TRAIN, **train}, d / "base", recall_mix=mix or None)
    model = load(d / "base")
    res = {"name": name, "family": family, "mix": mix, "train": train, "train_s": round(rec["train_seconds"]),
           "unpruned": {"bpb": heldout_bpb(model), **recall_acc(model)}}
    print("unpruned", json.dumps(res["unpruned"]), flush=True)
    res["pure_s"] = round(rec.get("recall_mix", {}).get("pure_seconds", 0))
    for m, keep in (keep_sets(model, d).items() if prune else ()):
        pm = load(d / "base")
        prune_model(pm, keep, {"method": m, "pct": PCT})
        res[f"{m}_{PCT}"] = {"bpb": heldout_bpb(pm), **recall_acc(pm)}
        print(f"{m}_{PCT}", json.dumps(res[f"{m}_{PCT}"]), flush=True)
    res["total_s"] = round(time.perf_counter() - t0)
    (d / "eval.json").write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    out = main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4]),
               prune="noprune" not in sys.argv[5:])
    print(json.dumps(out, default=lambda v: round(v, 3) if isinstance(v, float) else v))
