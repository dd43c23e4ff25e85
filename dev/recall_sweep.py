"""Pretraining schedules of the tiny models against the recall probe, many runs in parallel processes.

Each run trains one tiny model (config.yaml's arch) with a recall-only phase and a corpus phase given on the
command line, then measures held-out loss and the recall probe (levels 4 and 8, 100 documents, seed 0: the
default eval's documents, scored directly as lm-eval's multiple_choice acc) unpruned and after DRRQR / L1
selection at 50 % and 75 % (no RFT). Used to choose the default's schedules (docs/experiments/recall_mix).

    python dev/recall_sweep.py OUT_DIR --jobs 16 --spec 'tiny-gdn:pure=400,plr=1e-3,mask=1,stop=0.9,steps=300,seed=0' ...
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

KEYS = {"pure": int, "plr": float, "mask": int, "stop": float, "steps": int, "lr": float, "seed": int,
        "frac": float, "pbs": int, "pseq": int, "pairs": str, "every": int, "const": int, "warm": int, "full": int}


def parse(spec: str) -> dict:
    model, _, rest = spec.partition(":")
    out = {"model": model, "pure": 500, "plr": 1e-3, "mask": 0, "stop": 0.0, "steps": 700, "lr": 3e-3, "seed": 0,
           "frac": 0.2, "pbs": 4, "pseq": 128, "pairs": "1-2", "every": 50, "const": 0, "warm": 50, "full": -1}
    for kv in filter(None, rest.split(",")):
        k, v = kv.split("=")
        out[k] = KEYS[k](v)
    out["name"] = spec.replace(":", "__").replace(",", "_").replace("=", "")
    return out


def probe_acc(model, tok, docs, torch) -> list[int]:
    hits = []
    with torch.no_grad():
        for d in docs:
            ids = [tok(d["prompt"] + c, add_special_tokens=False)["input_ids"] for c in d["choices"]]
            n = len(tok(d["choices"][0], add_special_tokens=False)["input_ids"])
            x = torch.tensor(ids)
            logp = torch.log_softmax(model(input_ids=x).logits.float(), -1)
            tgt = x[:, -n:]
            s = logp[:, -n - 1:-1].gather(-1, tgt[..., None]).squeeze(-1).sum(-1)
            hits.append(int(int(s.argmax()) == d["gold"]))
    return hits


def masked_stream(tok, docs, torch):
    """Token stream of recall training docs with labels only on the answered queries' value bytes."""
    ids, lab = [], []
    eos = tok.eos_token_id
    for doc in docs:
        lines = doc.split("\n")
        half = len(lines) // 2
        for i, line in enumerate(lines):
            t = tok(line + ("\n" if i < len(lines) - 1 else ""), add_special_tokens=False)["input_ids"]
            ids += t
            if i >= half:
                key_len = len(tok(line.split("=")[0] + "=", add_special_tokens=False)["input_ids"])
                val_len = len(tok(line.split("=")[1], add_special_tokens=False)["input_ids"])
                lab += [-100] * key_len + t[key_len:key_len + val_len] + [-100] * (len(t) - key_len - val_len)
            else:
                lab += [-100] * len(t)
        ids.append(eos)
        lab.append(-100)
    return torch.tensor(ids), torch.tensor(lab)


def run(spec: dict) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import yaml

    from statereduce.adapters import adapter_class
    from statereduce.core.data import load_split, token_blocks, token_stream
    from statereduce.core.models import tiny_config
    from statereduce.core.runtime import lr_at, seed_everything
    from statereduce.common.settings import TrainSettings
    from statereduce.core.tokenizer import byte_level_tokenizer
    from statereduce.eval.recall import generate_recall_docs, mix_recall_docs, recall_stream_docs
    from statereduce import api

    torch.set_num_threads(1)
    cfg = yaml.safe_load((Path(__file__).resolve().parents[1] / "config.yaml").read_text())["models"][spec["model"]]
    family, arch = cfg["family"], dict(cfg["pretrain"]["arch"])
    if spec["full"] >= 0:  # the hybrid's softmax layer at another index
        arch["layer_types"] = ["full_attention" if i == spec["full"] else "linear_attention"
                               for i in range(arch["num_hidden_layers"])]
    corpus = {"source": "embedded"}
    seed = spec["seed"]
    seed_everything(seed)
    tok = byte_level_tokenizer()
    A = adapter_class(family)
    A.install_fallbacks()
    model = A.build(tiny_config(family, arch), dtype=torch.float32)
    pairs = [int(p) for p in spec["pairs"].split("-")]
    val_docs = generate_recall_docs(64, 4, seed=1000 + seed)
    log = []
    t0 = time.perf_counter()

    def train(stream, labels, steps, lr, bs, seq, warm, const, stop_acc=0.0, every=50, tag=""):
        sched = TrainSettings(steps=max(steps, 2), lr=lr, warmup=min(warm, steps - 1), seq_len=seq, batch_size=bs,
                              min_lr=lr if const else None)
        decay = [p for p in model.parameters() if p.dim() >= 2]
        nod = [p for p in model.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": nod, "weight_decay": 0.0}],
                                lr=lr, betas=(0.9, 0.95))
        g = torch.Generator().manual_seed(seed)
        off = torch.arange(seq)
        model.train()
        recent = []
        for step in range(steps):
            st = torch.randint(0, stream.numel() - seq + 1, (bs,), generator=g)
            x = stream[st[:, None] + off]
            y = x if labels is None else labels[st[:, None] + off]
            for gr in opt.param_groups:
                gr["lr"] = lr_at(step, sched)
            loss = model(input_ids=x, labels=y).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            recent.append(loss.item())
            if stop_acc > 0 and (step + 1) % every == 0:
                model.eval()
                acc = sum(probe_acc(model, tok, val_docs, torch)) / len(val_docs)
                model.train()
                log.append({"tag": tag, "step": step + 1, "loss": sum(recent) / len(recent), "val_acc4": acc,
                            "t": time.perf_counter() - t0})
                recent = []
                if acc >= stop_acc:
                    return step + 1
        log.append({"tag": tag, "step": steps, "loss": sum(recent) / max(1, len(recent)), "t": time.perf_counter() - t0})
        return steps

    pure_used = 0
    if spec["pure"] > 0:
        docs = recall_stream_docs(spec["pure"] * spec["pbs"] * spec["pseq"] + 10000, pairs, 0)
        if spec["mask"]:
            s, lab = masked_stream(tok, docs, torch)
        else:
            s, lab = token_stream(tok, docs), None
        pure_used = train(s, lab, spec["pure"], spec["plr"], spec["pbs"], spec["pseq"], spec["warm"], spec["const"],
                          spec["stop"], spec["every"], "pure")
    t_pure = time.perf_counter() - t0
    train_docs = load_split(corpus, "train")
    mixed, _ = mix_recall_docs(train_docs, spec["frac"], pairs, 0) if spec["frac"] > 0 else (train_docs, 0)
    if spec["steps"] > 0:
        train(token_stream(tok, mixed), None, spec["steps"], spec["lr"], 4, 128, 50, 0, tag="corpus")
    t_train = time.perf_counter() - t0
    model.eval()
    held = token_blocks(tok, load_split(corpus, "heldout"), 16, 256, 0)
    with torch.no_grad():
        out = model(input_ids=held, labels=held)
    bpb = float(out.loss) / math.log(2)
    probe = {n: generate_recall_docs(100, n, seed=0) for n in (4, 8)}

    def recall(m):
        return {n: probe_acc(m, tok, d, torch) for n, d in probe.items()}

    res = {"spec": spec, "pure_used": pure_used, "t_pure": t_pure, "t_train": t_train, "bpb": bpb,
           "base": recall(model), "log": log}
    calib = token_blocks(tok, load_split(corpus, "calib"), 32, 256, 0)
    stats = api.calibrate(model, calib)
    for sel in ("drrqr", "l1"):
        for pct in (50, 75):
            pr = api.prune(model, api.select(model, stats, sel, pct)).model.eval()
            with torch.no_grad():
                b = float(pr(input_ids=held, labels=held).loss) / math.log(2)
            res[f"{sel}_{pct}"] = {"bpb": b, "acc": recall(pr)}
    res["t_total"] = time.perf_counter() - t0
    return res


def summary(r: dict) -> str:
    def m(acc):
        a = [x for v in acc.values() for x in v]
        return sum(a) / len(a)
    s = r["spec"]
    cells = [f"{s['name']:<60}", f"pure {r['pure_used']:>4}", f"t {r['t_train']:5.0f}s", f"bpb {r['bpb']:.3f}",
             f"base {m(r['base']):.3f}"]
    for k in ("drrqr_50", "drrqr_75", "l1_50", "l1_75"):
        cells.append(f"{k} {m(r[k]['acc']):.3f}")
    return " | ".join(cells)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--spec", nargs="+", required=True)
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    specs = [parse(s) for s in a.spec]
    with ProcessPoolExecutor(a.jobs) as ex:
        futs = {ex.submit(run, s): s for s in specs}
        for f in as_completed(futs):
            s = futs[f]
            try:
                r = f.result()
            except Exception as e:  # noqa: BLE001
                print("FAILED", s["name"], repr(e), flush=True)
                continue
            (out / f"{s['name']}.json").write_text(json.dumps(r, indent=1))
            print(summary(r), flush=True)


if __name__ == "__main__":
    sys.exit(main())
