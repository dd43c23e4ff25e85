"""One value selection per layer (shared by its heads) against one per head, on finished runs' models.

fla's and Qwen3.5's output norm has one weight of d_v entries for all heads of a layer. Heads that keep different
value channels need that weight moved into the output projection first (statereduce.stages.prune.fold_output_norm);
one selection per layer needs nothing. This measures what sharing would cost:
for each model, selector value side and share of the value channels removed, the held-out cross entropy (bits per
token) of the model with the dropped value channels zeroed (what the exact checkpoint equals), with one selection
per layer (the layer's heads pooled, as the workflow selects) and with one per head (each head's own statistics).

    python dev/value_sharing.py RESULTS_DIR OUT_PREFIX [--models tiny-dn tiny-gdn tiny-qwen35] [--pcts 50 75]

RESULTS_DIR is a workflow directory whose results/{model}/base, weights/qk.h5, calib/default/activations.h5 and
grad_scores.h5 exist; OUT_PREFIX.json and OUT_PREFIX.md are written (with the CPU that ran it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
from pathlib import Path

import numpy as np
import torch


def heldout_bits(model, blocks: torch.Tensor) -> float:
    """Mean next-token cross entropy over ``blocks``, in bits per token."""
    with torch.no_grad():
        logits = model(blocks, use_cache=False).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), blocks[:, 1:].reshape(-1))
    return float(loss) / float(np.log(2))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results_dir", type=Path)
    ap.add_argument("out_prefix", type=Path)
    ap.add_argument("--models", nargs="+", default=["tiny-dn", "tiny-gdn", "tiny-qwen35"])
    ap.add_argument("--selectors", nargs="+", default=["grad", "drrqr", "l1"])
    ap.add_argument("--pcts", nargs="+", type=float, default=[50.0, 75.0])
    ap.add_argument("--n-samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    args = ap.parse_args(argv)

    from statereduce.adapters import get_adapter
    from statereduce.core.cuts import cut_widths
    from statereduce.core.data import load_split, token_blocks
    from statereduce.core.h5files import H5Artifact
    from statereduce.core.models import load_model
    from statereduce.core.slicing import masked_values
    from statereduce.selectors.registry import head_rng, value_side
    from statereduce.stages.select import value_units

    rows = []
    for name in args.models:
        root = args.results_dir / "results" / name
        model, tokenizer = load_model(root / "base", dtype="float32", device="cpu")
        torch.set_num_threads(2)
        adapter = get_adapter(model)
        blocks = token_blocks(tokenizer, load_split({"source": "embedded"}, "heldout"), args.n_samples, args.seq_len, 0)
        base = heldout_bits(model, blocks)
        weights = H5Artifact(root / "weights" / "qk.h5")
        acts = H5Artifact(root / "calib" / "default" / "activations.h5")
        grads = H5Artifact(root / "calib" / "default" / "grad_scores.h5")
        mixers = dict(adapter.mixer_layers())
        d_v = int(weights.attrs()["head_v_dim"])

        def arrays(layer: int):
            return weights.read(layer, ["W_v", "W_o", "w_norm"]) | acts.read(layer, ["V"]) | grads.read(layer, ["grad_v"])

        for sel in args.selectors:
            for pct in args.pcts:
                _, d_v_new = cut_widths("values", 1, d_v, pct)
                result = {"model": name, "family": adapter.family, "selector": sel, "pct": pct, "d_v": d_v,
                          "d_v_new": d_v_new, "baseline_bits": base}
                for how in ("layer", "head"):
                    keep = {}
                    for layer in mixers:
                        units = list(value_units([(layer, arrays(layer))], pool=how == "layer"))
                        kept = [value_side(sel)(data, d_v_new, rng=head_rng(0, layer, unit)).keep
                                for _, unit, data in units]
                        keep[layer] = torch.as_tensor(np.stack(kept))
                    with contextlib.ExitStack() as stack:
                        for layer, mixer in mixers.items():
                            k = keep[layer]
                            hv = max(e.index.shape[0] for e in adapter.layout(mixer).value_channels())
                            stack.enter_context(masked_values(adapter, mixer, k.expand(hv, -1) if k.shape[0] == 1
                                                              else k))
                        result[f"{how}_bits"] = heldout_bits(model, blocks)
                result["needs"] = sorted(value_side(sel).needs)
                rows.append(result)
                print(json.dumps(result), file=sys.stderr)

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    capability = torch.backends.cpu.get_cpu_capability()
    doc = {"command": "python dev/value_sharing.py " + " ".join(map(str, argv or sys.argv[1:])), "cpu": cpu,
           "torch_cpu_capability": capability, "rows": rows}
    args.out_prefix.parent.mkdir(parents=True, exist_ok=True)
    args.out_prefix.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = [f"Held-out cross entropy (bits per token, lower is better) with value channels zeroed, one selection per "
             f"layer (its heads pooled) or one per head (its own statistics); {args.n_samples} × {args.seq_len} held-out "
             f"tokens; {cpu}, torch CPU capability {capability}. Command: `{doc['command']}`.", "",
             "| model | selector | value channels removed | d_v' of d_v | baseline | per layer | per head | "
             "per layer − per head |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['selector']} | {r['pct']:g}% | {r['d_v_new']} of {r['d_v']} | "
                     f"{r['baseline_bits']:.4f} | {r['layer_bits']:.4f} | {r['head_bits']:.4f} | "
                     f"{r['layer_bits'] - r['head_bits']:+.4f} |")
    args.out_prefix.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
