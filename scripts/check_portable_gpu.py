"""On a GPU: checkpoints whose layers keep different widths, loaded without statereduce, compute what ``load_model``
computes, with fla's own kernels (tests/test_portable.py compares the fla families by structure and weights only: their
Triton kernels do not run on a CPU).

    python scripts/check_portable_gpu.py OUT.json [--layers 4]

For DeltaNet and Gated DeltaNet at their 1.3B head shapes (few layers, random weights), a per-layer key cut and a
per-layer key and value cut are pruned and saved; each is loaded with ``load_model`` (bf16, CUDA) and, in a child
process whose ``sys.path`` has no statereduce, with ``AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)``
(bf16, CUDA). OUT.json holds, per case, the widths, the largest logit difference and the greedy tokens of both.
Widths are powers of two (stock fla's kernels mishandle some small head shapes, which load_model pads and a user's
plain fla does not: docs/gpu_checks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

CHILD = r'''
import importlib.util, json, sys, torch
assert importlib.util.find_spec("statereduce") is None, "statereduce is importable in the child"
from transformers import AutoModelForCausalLM
folder, ids_file, out = sys.argv[1:4]
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.bfloat16).cuda().eval()
ids = torch.load(ids_file).cuda()
with torch.no_grad():
    logits = model(ids).logits.float().cpu()
    tokens = model.generate(ids[:, :32], max_new_tokens=16, min_new_tokens=16, do_sample=False,
                            attention_mask=torch.ones_like(ids[:, :32])).cpu()
torch.save({"logits": logits, "tokens": tokens, "class": type(model).__name__,
            "statereduce": "statereduce" in sys.modules}, out)
'''

ARCH = {
    "delta_net": {"hidden_size": 2048, "num_heads": 16, "expand_k": 1.0, "expand_v": 1.0, "intermediate_size": 2048},
    "gated_deltanet": {"hidden_size": 2048, "num_heads": 6, "head_dim": 256, "expand_v": 2.0,
                       "intermediate_size": 2048},
}


def cases(family: str, layers: int):
    """(name, {layer: key width}, {layer: value width} or None) of the family's per-layer cuts."""
    d_k = 128 if family == "delta_net" else 256
    d_v = 128 if family == "delta_net" else 512
    keys = {i: (d_k // 2, d_k // 4)[i % 2] for i in range(layers)}
    values = {i: (d_v // 2, d_v)[i % 2] for i in range(layers)}
    return [("keys_per_layer", keys, None), ("keys_values_per_layer", keys, values)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("check_portable_gpu.py needs a CUDA GPU")
    from statereduce.adapters import get_adapter
    from statereduce.core.models import build_random, load_model
    from statereduce.core.tokenizer import byte_level_tokenizer
    from statereduce.speed.generate import install_cache_alias
    from statereduce.stages.prune import prune_model, save_pruned

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    here = Path(__file__).resolve().parents[1]
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != here]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        env["HF_MODULES_CACHE"] = str(tmp / "modules")
        ids = torch.randint(0, 256, (2, 256), generator=torch.Generator().manual_seed(0))
        torch.save(ids, tmp / "ids.pt")
        for family, arch in ARCH.items():
            for name, keys, values in cases(family, args.layers):
                model = build_random(family, {**arch, "num_hidden_layers": args.layers}, seed=1)
                ad = get_adapter(model)
                _, hv, _, _ = ad.dims(ad.config)
                gen = torch.Generator().manual_seed(2)
                keep = {i: torch.stack([torch.randperm(ad.head_k_dim, generator=gen)[:w].sort().values
                                        for _ in range(ad.num_heads)]) for i, w in keys.items()}
                vals = None if values is None else {
                    i: torch.stack([torch.randperm(ad.dims(ad.config).head_v_dim, generator=gen)[:w].sort().values
                                    for _ in range(hv)]) for i, w in values.items()}
                record = prune_model(model, keep, {"method": name, "pct": 50}, values=vals)
                folder = save_pruned(model, byte_level_tokenizer(), record, tmp / family / name)
                ours, _ = load_model(folder, dtype="bfloat16", device="cuda")
                install_cache_alias(ours)  # stock fla 0.6.0 ignores generate()'s cache= (the carried code maps it)
                with torch.no_grad():
                    want = ours(ids.cuda()).logits.float().cpu()
                    want_tokens = ours.generate(ids[:, :32].cuda(), max_new_tokens=16, min_new_tokens=16,
                                                do_sample=False,
                                                attention_mask=torch.ones_like(ids[:, :32]).cuda()).cpu()
                del ours
                out = tmp / f"{family}-{name}.pt"
                done = subprocess.run([sys.executable, "-c", CHILD, str(folder), str(tmp / "ids.pt"), str(out)],
                                      env=env, cwd=tmp, capture_output=True, text=True)
                if done.returncode != 0:
                    results.append({"family": family, "case": name, "error": done.stderr[-2000:]})
                    continue
                got = torch.load(out)
                diff = float((got["logits"] - want).abs().max())
                results.append({"family": family, "case": name, "key_dims": keys, "value_dims": values,
                                "class": got["class"], "statereduce_imported": got["statereduce"],
                                "max_abs_logit_diff": diff, "logit_scale": float(want.abs().max()),
                                "tokens_equal": bool(torch.equal(got["tokens"], want_tokens))})
                print(json.dumps(results[-1]))
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": results}
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
