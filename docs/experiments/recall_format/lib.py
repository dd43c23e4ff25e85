"""Experiment helpers: recall-mixed pretraining of the tiny models, fast recall/bpb scoring, pruning."""
from __future__ import annotations

import json
import math
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo root
from statereduce.kernels import fla_fallback  # noqa: E402
from statereduce.eval import recall as rc  # noqa: E402
from statereduce.data import load_split, token_stream  # noqa: E402
from statereduce.models import tiny_config  # noqa: E402
from statereduce.pretrain import _eval_blocks, _train_cfg, mean_loss, seed_everything, train_loop  # noqa: E402
from statereduce.tokenizer import byte_level_tokenizer  # noqa: E402

fla_fallback.install()
ROOT = Path(__file__).resolve().parent / "runs"  # git-ignored model folders
CORPUS = {"source": "embedded"}
ARCH = {
    "delta_net": {"hidden_size": 128, "num_hidden_layers": 4, "num_heads": 2, "expand_k": 1.0, "expand_v": 1.0},
    "gated_deltanet": {"hidden_size": 128, "num_hidden_layers": 4, "num_heads": 2, "head_dim": 64, "expand_v": 1.0},
}
TRAIN = {"steps": 700, "batch_size": 4, "seq_len": 128, "lr": 3.0e-3, "warmup": 50, "seed": 0, "threads": 1}


def train_doc(rng: random.Random, n_pairs: int, query_frac: float = 1.0) -> str:
    """Context of n_pairs compact `kx=47` lines, then answered queries over a shuffled subset of the keys."""
    keys = rng.sample(rc.KEYS, n_pairs)
    values = rng.sample(rc.VALUES, n_pairs)
    q = []
    full, part = int(query_frac), query_frac - int(query_frac)
    for _ in range(full):
        q += rng.sample(range(n_pairs), n_pairs)
    if part > 0 or not q:
        q += rng.sample(range(n_pairs), max(1, round(part * n_pairs)))
    lines = [f"{k}={v}" for k, v in zip(keys, values)] + [f"{keys[i]}={values[i]}" for i in q]
    return "\n".join(lines)


def mixed_docs(corpus_docs: list[str], fraction: float, n_pairs: list[int], seed: int, query_frac: float = 1.0):
    """Insert recall docs so they take ~fraction of the bytes; each inserted at a random slot between corpus docs."""
    rng = random.Random(f"exp.train:{seed}")
    corpus_bytes = sum(len(d.encode()) + 1 for d in corpus_docs)
    target = fraction / (1 - fraction) * corpus_bytes
    recall, total = [], 0
    while total < target:
        d = train_doc(rng, rng.choice(n_pairs), query_frac)
        recall.append(d)
        total += len(d) + 1
    slots = [rng.randrange(len(corpus_docs) + 1) for _ in recall]
    by_slot: dict[int, list[str]] = {}
    for s, d in zip(slots, recall):
        by_slot.setdefault(s, []).append(d)
    out = []
    for i in range(len(corpus_docs) + 1):
        out.extend(by_slot.get(i, []))
        if i < len(corpus_docs):
            out.append(corpus_docs[i])
    return out, len(recall)


def train(name: str, family: str, fraction: float = 0.0, n_pairs=(4, 16), mix_seed: int = 1, query_frac: float = 1.0,
          **train_over):
    from transformers import AutoModelForCausalLM

    out = ROOT / name
    if (out / "model.pt").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    cfg = _train_cfg({**TRAIN, **train_over})
    torch.set_num_threads(1)
    seed_everything(int(cfg["seed"]))
    tok = byte_level_tokenizer()
    docs = load_split(CORPUS, "train")
    n_recall = 0
    if fraction > 0:
        docs, n_recall = mixed_docs(docs, fraction, list(n_pairs), mix_seed, query_frac)
    stream = token_stream(tok, docs)
    model = AutoModelForCausalLM.from_config(tiny_config(family, ARCH[family]), dtype=torch.float32)
    stats = train_loop(model, stream, cfg, [out / "train_log.jsonl"], desc=name)
    model.eval()
    blocks = _eval_blocks(tok, CORPUS, "heldout", 16, 128, 0)
    stats["heldout_loss_128"] = mean_loss(model, blocks)
    stats.update(family=family, fraction=fraction, n_pairs=list(n_pairs), mix_seed=mix_seed, query_frac=query_frac,
                 n_recall_docs=n_recall, stream_tokens=int(stream.numel()), cfg=cfg)
    torch.save(model.state_dict(), out / "model.pt")
    (out / "train.json").write_text(json.dumps(stats, indent=1))
    return out


def load(name: str, family: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config(family, ARCH[family]), dtype=torch.float32)
    model.load_state_dict(torch.load(ROOT / name / "model.pt"))
    return model.eval()


@torch.no_grad()
def recall_acc(model, levels=(4, 16, 64), n_docs=100, seed=0) -> dict[str, float]:
    """lm-eval multiple_choice acc, computed by hand: argmax of the sum of log p(' ' + choice | prompt)."""
    tok = byte_level_tokenizer()
    out = {}
    for n in levels:
        docs = rc.generate_recall_docs(n_docs, n, seed=seed)
        correct = 0
        for d in docs:
            seqs = [tok(d["prompt"] + " " + c, add_special_tokens=False)["input_ids"] for c in d["choices"]]
            x = torch.tensor(seqs)
            logp = torch.log_softmax(model(input_ids=x[:, :-1]).logits.float(), -1)
            ll = logp[:, -3:].gather(2, x[:, -3:, None]).sum((1, 2))
            correct += int(torch.argmax(ll)) == d["gold"]
        out[f"recall_mqar_{n}"] = correct / n_docs
    return out


_HELD = None


@torch.no_grad()
def heldout_bpb(model) -> float:
    """lm-eval loglikelihood_rolling bits/byte over the eval task's heldout docs (32 docs, 2048 bytes)."""
    global _HELD
    from statereduce.eval.run import heldout_docs

    if _HELD is None:
        _HELD = heldout_docs(CORPUS, 32, 2048)
    tok = byte_level_tokenizer()
    nll, nbytes = 0.0, 0
    for d in _HELD:
        ids = [256] + tok(d, add_special_tokens=False)["input_ids"]
        x = torch.tensor([ids])
        logp = torch.log_softmax(model(input_ids=x[:, :-1]).logits.float(), -1)
        nll -= float(logp.gather(2, x[:, 1:, None]).sum())
        nbytes += len(d.encode())
    return nll / nbytes / math.log(2)


def keep_sets(model, name: str, methods=("drrqr", "rand"), pct=75):
    """Selections of the package's selectors: qk weights + calibration activations (config's calib settings)."""
    from statereduce.capture import capture_activations, export_qk_weights
    from statereduce.data import token_blocks
    from statereduce.select import select_channels

    d = ROOT / name
    tok = byte_level_tokenizer()
    if not (d / "qk.h5").exists():
        export_qk_weights(model, d / "qk.h5")
    if not (d / "activations.h5").exists():
        blocks = token_blocks(tok, load_split(CORPUS, "calib"), 32, 256, 0)
        capture_activations(model, blocks, d / "activations.h5", rows_per_head=2500, seed=0, batch_size=8)
    out = {}
    for m in methods:
        rows, _ = select_channels(d / "qk.h5", m, pct, activations=d / "activations.h5", seed=0,
                                options={"f": 2.0} if m == "drrqr" else {})
        keep: dict[int, list] = {}
        for layer, head, sel in rows:
            keep.setdefault(layer, {})[head] = sorted(np.asarray(sel.keep).tolist())
        out[m] = {layer: torch.tensor([heads[h] for h in sorted(heads)]) for layer, heads in keep.items()}
    return out


def evaluate_all(name: str, family: str, pct: int = 75) -> dict:
    from statereduce.prune import prune_model

    res_path = ROOT / name / f"eval_{pct}.json"
    if res_path.exists():
        return json.loads(res_path.read_text())
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    model = load(name, family)
    res = {"unpruned": {"bpb": heldout_bpb(model), **recall_acc(model)}}
    keeps = keep_sets(model, name, pct=pct)
    for m, keep in keeps.items():
        pm = load(name, family)
        prune_model(pm, keep, {"method": m, "pct": pct})
        res[f"{m}_{pct}"] = {"bpb": heldout_bpb(pm), **recall_acc(pm)}
    res["eval_s"] = time.perf_counter() - t0
    res["train"] = {k: v for k, v in json.loads((ROOT / name / "train.json").read_text()).items() if k != "cfg"}
    res_path.write_text(json.dumps(res, indent=1))
    return res
