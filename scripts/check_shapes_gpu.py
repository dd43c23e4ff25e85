#!/usr/bin/env python
"""Pruned DeltaNet / Gated DeltaNet checkpoints at the head shapes stock fla mishandles, on a CUDA GPU.

For each (family, d_k -> d_k', d_v) given, a random tiny model is pruned at random to d_k' key channels and saved;
then in fresh processes on the GPU (all at once, spread over the visible GPUs):

* ``ours``: :func:`statereduce.core.models.load_model` (the adapter installs its kernel routing, so the chunk calls at a
  faulty shape go through the zero-padded call of :mod:`statereduce.kernels.shapes`): the bf16-autocast forward of
  a ``--length``-token input (the chunk kernel) and the gradient of every parameter (training mode) against the same
  checkpoint on the CPU in float32 (the project's fallback kernels);
* ``stock``: plain ``from_pretrained`` with fla and no routing, the same forward and backward, to show what a user
  loading the checkpoint outside our code gets (a crash is recorded, not raised).

    python scripts/check_shapes_gpu.py OUT.json [--length 512]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = [  # family, d_k, d_v, d_k': faulty shapes of docs/results/fla_shapes_h200.json (16 x 64 wrong, 32 x 128 a
    # fault) and an unswept width in the faulty region (24)
    ("delta_net", 64, 64, 16),
    ("delta_net", 64, 64, 24),
    ("delta_net", 128, 128, 32),
]


def _worker(ckpt: str, mode: str, length: int, out: str) -> None:
    """One run in this process: forward logits and parameter gradients of ``ckpt`` (see the module docstring)."""
    import torch

    sys.path.insert(0, str(ROOT))
    from transformers import AutoModelForCausalLM

    from statereduce.core.models import load_model

    cuda = mode != "cpu"
    if mode == "stock":
        __import__("fla")  # registers fla's model classes with transformers
        model = AutoModelForCausalLM.from_pretrained(ckpt, fuse_cross_entropy=False).cuda()
    else:
        model, _ = load_model(ckpt, dtype="float32", device="cuda" if cuda else "cpu")
    x = torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(0)).to(model.device)
    model.train()
    doc = {}
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            logits = model(input_ids=x).logits.float()
        logits.square().mean().backward()
        if cuda:
            torch.cuda.synchronize()
        doc["logits"] = logits.detach().cpu()
        doc["grads"] = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    except Exception as e:  # noqa: BLE001 -- the stock path may raise or fault: record it
        doc["error"] = f"{type(e).__name__}: {e}"[:300]
    torch.save(doc, out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, nargs="?")
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--worker", nargs=3, metavar=("CKPT", "MODE", "OUT"))
    args = p.parse_args()
    if args.worker:
        _worker(args.worker[0], args.worker[1], args.length, args.worker[2])
        return
    import torch

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))
    from _models import random_keep
    from transformers import AutoModelForCausalLM

    from statereduce.adapters import adapter_class, get_adapter
    from statereduce.kernels import shapes
    from statereduce.core.models import tiny_config
    from statereduce.stages.prune import prune_model, save_pruned
    from statereduce.core.tokenizer import byte_level_tokenizer

    work = Path(tempfile.mkdtemp(prefix="shapes_gpu_"))
    tok = byte_level_tokenizer()
    doc = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "length": args.length, "cases": []}
    todo = []
    for family, d_k, d_v, keep in CASES:
        heads = 2
        arch = {"hidden_size": 256, "num_hidden_layers": 2, "num_heads": heads, "expand_k": heads * d_k / 256,
                "expand_v": heads * d_v / 256}
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(family, arch)).float()
        dims = get_adapter(model).dims(model.config)
        assert (dims.head_k_dim, dims.head_v_dim) == (d_k, d_v)
        record = prune_model(model, random_keep(model, keep, seed=1),
                             {"source": "random", "method": "rand", "pct": 100 * (1 - keep / d_k)}, norm_eps="stock")
        ckpt = work / f"{family}_{keep}x{d_v}"
        save_pruned(model, tok, record, ckpt)
        kernels = tuple(adapter_class(family).padded_kernels)
        case = {"family": family, "d_k": d_k, "d_v": d_v, "d_k_pruned": keep,
                "routed": shapes.faulty_shapes(kernels, keep, d_v),
                "prune_record_note": json.loads((ckpt / "prune_record.json").read_text()).get("fla_kernel_shapes")}
        todo.append((case, ckpt))

    def run(ckpt: Path, mode: str, gpu: int) -> dict:
        out = work / f"{ckpt.name}_{mode}.pt"
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)}
        r = subprocess.run([sys.executable, __file__, "--worker", str(ckpt), mode, str(out), "--length",
                            str(args.length)], capture_output=True, text=True, env=env)
        if r.returncode != 0 or not out.exists():
            tail = [x for x in r.stderr.strip().splitlines() if "Warning" not in x][-2:]
            return {"error": f"process died (rc {r.returncode}): " + " | ".join(tail)[-300:]}
        return torch.load(out)

    jobs = [(i, mode) for i in range(len(todo)) for mode in ("cpu", "ours", "stock")]
    pool = cf.ThreadPoolExecutor(len(jobs))
    futs = {pool.submit(run, todo[i][1], mode, n % torch.cuda.device_count()): (i, mode)
            for n, (i, mode) in enumerate(jobs)}
    results: dict[int, dict] = {}
    for fut in cf.as_completed(futs):  # a case is compared and written as soon as its three runs are in
        i, mode = futs[fut]
        results.setdefault(i, {})[mode] = fut.result()
        if len(results[i]) < 3:
            continue
        case, runs = todo[i][0], results[i]
        ref = runs["cpu"]
        for mode in ("ours", "stock"):
            r = runs[mode]
            if "error" in r or "error" in ref:
                case[mode] = {"error": r.get("error") or ref.get("error")}
                continue
            g_err = {n: float((g - ref["grads"][n]).norm() / ref["grads"][n].norm().clamp_min(1e-30))
                     for n, g in r["grads"].items()}
            worst = max(g_err, key=g_err.get)
            case[mode] = {
                "logits_rel_error": float((r["logits"] - ref["logits"]).norm() / ref["logits"].norm()),
                "grad_max_rel_error": g_err[worst],
                "grad_worst_parameter": worst,
            }
        doc["cases"].append(case)
        print(json.dumps(case), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
