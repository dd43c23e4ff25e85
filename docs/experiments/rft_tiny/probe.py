"""RFT settings of the tiny models, tried on the pruned checkpoints of a finished default run.

For each cell (model, method at 50%) and each variant of the RFT settings, fine-tune the pruned checkpoint exactly as
the ``rft`` rule does (:func:`statereduce.stages.rft.fine_tune`, the model's ``rft`` block from ``config.yaml`` updated
by the variant, ``keep: last``) and score the result on the held-out documents the ``heldout`` task reads (the first
``max_docs`` held-out documents cut to ``max_doc_bytes``), at the evaluation's full context and in windows of the
RFT sequence length. The validation curve of every variant is kept, so that one can see whether a validation pass
would have picked the step that helps on held-out documents.

    python docs/experiments/rft_tiny/probe.py RUN_DIR OUT.jsonl --cells tiny-gdn:drrqr,tiny-gdn:rand \\
        --variant base --variant 'lr=1e-3' --variant 'val_seq_len=2048'

``RUN_DIR`` is a checkout where ``snakemake --cores all`` finished (its ``results/`` and ``config.yaml``).
Each variant is ``name`` or ``key=value,key=value`` (values as YAML); ``base`` is the config's settings.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch
import yaml

from statereduce import config as srconfig
from statereduce.core.data import load_split
from statereduce.eval.run import heldout_docs
from statereduce.core.models import load_model
from statereduce.stages.rft import fine_tune


@torch.no_grad()
def bits_per_byte(model, tokenizer, docs: list[str], window: int | None = None) -> float:
    """Next-token bits per UTF-8 byte of ``docs`` (the byte-level tokenizer: one token per byte); ``window``: score in
    disjoint windows of that many tokens (each window starts with an empty state)."""
    nll, n_bytes = 0.0, 0
    for doc in docs:
        ids = torch.tensor(tokenizer(doc, add_special_tokens=False)["input_ids"])
        step = window or len(ids)
        for start in range(0, len(ids) - 1, step):
            chunk = ids[start:start + step + 1][None]
            logits = model(chunk[:, :-1]).logits.float()
            nll += torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum").item()
        n_bytes += len(doc.encode("utf-8")) - 1
    return nll / math.log(2) / n_bytes


def parse_variant(text: str) -> tuple[str, dict]:
    if text == "base":
        return text, {}
    return text, {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in text.split(","))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--cells", required=True, help="model:method[,model:method...] (50%% chains)")
    ap.add_argument("--pct", default="50")
    ap.add_argument("--variant", action="append", default=[])
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = yaml.safe_load((args.run / "config.yaml").read_text())
    for cell in args.cells.split(","):
        model_name, method = cell.split(":")
        plan, ev = srconfig.model_rft(cfg, model_name), srconfig.model_eval(cfg, model_name)
        corpus = srconfig.corpus_spec(cfg, plan.corpus, args.run)
        eval_corpus = srconfig.corpus_spec(cfg, ev.corpus, args.run)
        docs = heldout_docs(eval_corpus, ev.max_docs, ev.max_doc_bytes)
        train = load_split(corpus, "train")
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(0)).tolist()
        starts = [train[j].encode()[:ev.max_doc_bytes].decode("utf-8", errors="ignore") for j in order[-16:]]
        exclude = load_split(eval_corpus, "heldout")
        res = args.run / "results" / model_name
        pruned = res / f"{method}_{args.pct}" / "pruned"
        seq = int(plan.settings.get("seq_len", 128))
        scores = {}
        for name, path in (("base", res / "base"), ("pruned", pruned)):
            m, tok = load_model(path)
            scores[name] = {"full": bits_per_byte(m, tok, docs), "window": bits_per_byte(m, tok, docs, seq),
                            "starts": bits_per_byte(m, tok, starts)}
        for vname, over in map(parse_variant, args.variant):
            settings = {**plan.settings, **over}
            t0 = time.time()
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "rft"
                rec = fine_tune(pruned, res / "base", out, settings, corpus, exclude_docs=exclude)
                m, tok = load_model(out)
                got = {"full": bits_per_byte(m, tok, docs), "window": bits_per_byte(m, tok, docs, seq),
                       "starts": bits_per_byte(m, tok, starts)}
            row = {"model": model_name, "method": method, "pct": args.pct, "variant": vname, "settings": over,
                   "base": scores["base"], "pruned": scores["pruned"], "rft": got,
                   "delta_full": got["full"] - scores["pruned"]["full"],
                   "curve": rec["validation"]["curve"] if rec.get("validation") else None,
                   "kept_step": rec["validation"]["kept_step"] if rec.get("validation") else rec["steps"],
                   "seconds": round(time.time() - t0, 1)}
            brief = ("model", "method", "variant", "delta_full", "kept_step", "seconds")
            print(json.dumps({k: row[k] for k in brief}), flush=True)
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
