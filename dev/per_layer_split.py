"""Would a joint split chosen per layer beat the key-only cut? An experiment on finished runs' models.

Rule ``split`` gives every layer the same d_k' x d_v', the candidate of lowest calibration loss; with the budget's
``per_layer: true`` each layer may take a different candidate of the same state share, so the total state stays the
pct's (:func:`statereduce.stages.select.state_split_per_layer`: each layer in turn takes each candidate with the other
layers whole, and keeps its candidate of lowest calibration loss; the combination is kept where it beats the best
uniform split). For each model, selector and pct this measures that combination beside the key-only cut and the
uniform split, on the calibration blocks and on held-out blocks (dropped channels zeroed: the loss of the exact
checkpoint), before RFT.

    python dev/per_layer_split.py RESULTS_DIR OUT_PREFIX [--models tiny-dn ...] [--selectors grad drrqr] [--pcts 75]

RESULTS_DIR is a workflow directory whose results/{model}/base, weights/qk.h5, calib/default/activations.h5,
grad_scores.h5 and select/{selector}-kv@split_{pct}.split.json exist (after ``snakemake
results/tables/value_study.md``); OUT_PREFIX.json and OUT_PREFIX.md are written, with the CPU that ran it.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from pathlib import Path

import torch


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results_dir", type=Path)
    ap.add_argument("out_prefix", type=Path)
    ap.add_argument("--models", nargs="+", default=["tiny-dn", "tiny-gdn", "tiny-mamba2", "tiny-qwen35"])
    ap.add_argument("--selectors", nargs="+", default=["grad", "drrqr"])
    ap.add_argument("--pcts", nargs="+", type=float, default=[75.0])
    ap.add_argument("--heldout-samples", type=int, default=32)
    ap.add_argument("--calib-samples", type=int, default=32, help="the models' calibration n_samples (config.yaml)")
    args = ap.parse_args(argv)

    from statereduce.core.calib_loss import calibration_loss
    from statereduce.core.data import load_split, token_blocks
    from statereduce.core.models import load_model
    from statereduce.core.slicing import cut_tensors, masked_cut
    from statereduce.stages.select import select_channels, state_split_per_layer

    torch.set_num_threads(2)
    rows = []
    for name in args.models:
        root = args.results_dir / "results" / name
        model, tokenizer = load_model(root / "base", dtype="float32", device="cpu")
        heldout = token_blocks(tokenizer, load_split({"source": "embedded"}, "heldout"), args.heldout_samples, 256, 0)
        for sel in args.selectors:
            for pct in args.pcts:
                split = json.loads((root / "select" / f"{sel}-kv@split_{pct:g}.split.json").read_text())
                # the split rule's blocks: the first n_samples of the model's calibration blocks
                calib = token_blocks(tokenizer, load_split({"source": "embedded"}, "calib"), args.calib_samples,
                                     split["seq_len"], split["seed"])[:split["n_samples"]]
                batch = split["settings"]["batch_size"]
                cands = [(c["d_k_new"], c["d_v_new"]) for c in split["candidates"]]
                cuts = {}
                for k, v in cands:
                    sel_rows, _ = select_channels(root / "weights" / "qk.h5", f"{sel}-kv", pct,
                                             activations=root / "calib" / "default" / "activations.h5",
                                             grads=root / "calib" / "default" / "grad_scores.h5",
                                             options=split["options"], widths=(k, v))
                    cuts[(k, v)] = cut_tensors(sel_rows)
                key_only = max(cands, key=lambda c: c[1] / split["d_v"] - c[0] / split["d_k"])  # d_v kept whole
                layers = sorted(cuts[key_only][0])

                def combo(choice: dict[int, tuple[int, int]]):
                    return ({l: cuts[choice[l]][0][l] for l in layers}, {l: cuts[choice[l]][1][l] for l in layers})

                def loss(choice, blocks):
                    keys, values = combo(choice)
                    with masked_cut(model, keys, values):
                        return calibration_loss(model, blocks, batch)

                base_choice = {l: key_only for l in layers}
                recorded = {(c["d_k_new"], c["d_v_new"]): c["loss"] for c in split["candidates"]}
                uniform_pair = (split["d_k_new"], split["d_v_new"])
                for c in (key_only, uniform_pair):  # the split rule's own losses, reproduced
                    got = loss({l: c for l in layers}, calib)
                    if abs(got - recorded[c]) > 1e-6 * recorded[c]:
                        raise SystemExit(f"{name} {sel} {pct}: {c} loss {got} is not the split artifact's {recorded[c]}")
                # the workflow's choice (budget per_layer: true): each layer's lowest candidate with the others whole
                per = state_split_per_layer(model, calib, batch, cuts, uniform_pair, recorded[uniform_pair], split["d_k"],
                                      split["d_v"], progress=False)
                chosen = {int(l): tuple(w) for l, w in per["widths"].items()}
                combination = {l: tuple(map(int, min(per["layer_losses"][str(l)],
                                                     key=per["layer_losses"][str(l)].get).split("x"))) for l in layers}
                uniform = {l: uniform_pair for l in layers}
                result = {"model": name, "selector": sel, "pct": pct, "d_k": split["d_k"], "d_v": split["d_v"],
                          "candidates": [f"{k}x{v}" for k, v in cands], "key_only": f"{key_only[0]}x{key_only[1]}",
                          "uniform_split": f"{uniform_pair[0]}x{uniform_pair[1]}",
                          "per_layer_choice": {l: f"{k}x{v}" for l, (k, v) in combination.items()},
                          "chosen": {l: f"{k}x{v}" for l, (k, v) in chosen.items()},
                          "state_fraction": sum(k * v for k, v in combination.values()) / (
                              len(layers) * split["d_k"] * split["d_v"]),
                          "layer_losses": per["layer_losses"]}
                for what, choice in (("key_only", base_choice), ("uniform_split", uniform), ("per_layer", combination)):
                    result[f"{what}_calib_nats"] = loss(choice, calib)
                    result[f"{what}_heldout_bits"] = loss(choice, heldout) / math.log(2)
                rows.append(result)
                print(json.dumps({k: v for k, v in result.items() if k != "layer_losses"}), flush=True)

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    doc = {"command": " ".join(["python", *sys.argv]), "cpu": f"{cpu}, torch CPU capability "
           f"{torch.backends.cpu.get_cpu_capability()}", "torch": torch.__version__, "rows": rows}
    args.out_prefix.parent.mkdir(parents=True, exist_ok=True)
    args.out_prefix.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = [f"Joint split per layer against the key-only cut and the uniform split (`{doc['command']}`; "
             f"{doc['cpu']}). Loss of the model with the dropped channels zeroed: calibration blocks (nats, the "
             "blocks the choice was made on) and held-out blocks (bits per token).", "",
             "| model | selector | pct | key-only | uniform split | per-layer choice | state | the split keeps | "
             "calib: key-only / uniform / per-layer | held-out: key-only / uniform / per-layer |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        kept = "per layer" if r["chosen"] == r["per_layer_choice"] and len(set(r["chosen"].values())) > 1 \
            else "uniform"
        lines.append(f"| {r['model']} | {r['selector']} | {r['pct']:g} | {r['key_only']} | {r['uniform_split']} | "
                     f"{', '.join(r['per_layer_choice'].values())} | {100 * r['state_fraction']:.1f} % | {kept} | "
                     f"{r['key_only_calib_nats']:.4f} / {r['uniform_split_calib_nats']:.4f} / "
                     f"{r['per_layer_calib_nats']:.4f} | {r['key_only_heldout_bits']:.4f} / "
                     f"{r['uniform_split_heldout_bits']:.4f} / {r['per_layer_heldout_bits']:.4f} |")
    args.out_prefix.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
