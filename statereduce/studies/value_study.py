"""Cutting the state on its other side: key channels only (``<selector>``), value channels only (``<selector>-v``) or
both (``<selector>-kv``, the state split equally between d_k' and d_v'; with ``split``, also ``<selector>-kv@<split>``,
the split chosen by calibration loss) at the same share of the state, per model, selector and pct, pre- and post-RFT,
with the best key-only recipe (a per-layer budget, e.g. ``drrqr@sens``) beside them. Block ``studies.values``; cells
are summaries."""

from __future__ import annotations

import math
from pathlib import Path

from statereduce.common import layout
from statereduce.common.layout import MethodSpec, format_method, format_pct, parse_token
from statereduce.config.blocks import ConfigError, check_budget_cell, check_method, check_reduction, model_budget
from statereduce.core.runtime import json_number, read_json
from statereduce.studies.base import (
    PCTS, Figure, Study, Table, known_models, known_selectors, register, summary_paths, unique_list,
)

#: The cuts in table order, with their labels.
CUTS = (("keys", "keys"), ("values", "values"), ("joint", "keys+values"))
#: The row of a joint cut split by calibration loss (``<selector>-kv@<split>``), with its label.
SPLIT = ("split", "keys+values, split by loss")
#: The row of a joint cut split per layer (``<selector>-kv@<split_layers>``: a split budget with ``per_layer``).
LAYERSPLIT = ("layersplit", "keys+values, split per layer")
LABELS = dict((*CUTS, SPLIT, LAYERSPLIT))
#: The cuts compared with the key-only cut of the same selector.
COMPARED = ("values", "joint", SPLIT[0], LAYERSPLIT[0])


@register
class ValuesStudy(Study):
    name = "values"
    rule = "value_study"
    doc = ("Key-only, value-only and joint key/value cuts at the same share of the state, pre- and post-RFT, from "
           "the summaries of the cells of studies.values; with the pruning-loss figure and HTML page for the report.")
    schema = {
        "type": "object",
        "additionalProperties": False,
        "description": "key-only, value-only and joint cuts at equal state (docs/values.md)",
        "required": ["models", "selectors", "pcts"],
        "properties": {
            "models": unique_list(),
            "selectors": unique_list(description="selectors with a value side (-v, -kv)"),
            "pcts": PCTS,
            "recipe": {"type": "string", "description": "a key-only method shown beside them, e.g. drrqr@sens"},
            "split": {"type": "string", "description": "a budget of policy split: adds each selector's joint cut split "
                                                       "by calibration loss (<selector>-kv@<split>)"},
            "split_layers": {"type": "string", "description": "a budget of policy split with per_layer: true: adds "
                                                              "each selector's joint cut split per layer"},
        },
    }
    tables = (Table("value_study", "key, value and joint cuts", """
**Key, value and joint cuts at equal state** (``studies.values``): each selector cuts the key channels (keys, the
paper's cut), the value channels (values, ``<selector>-v``) or both (keys+values, ``<selector>-kv``: d_k'/d_k and
d_v'/d_v near sqrt of the kept share; keys+values split by loss, ``<selector>-kv@<split>``: the split of lowest
calibration loss) so that the same share of every head's d_v x d_k state is removed; ``recipe``
is the block's key-only method with a per-layer budget. Held-out bits per byte before → after recovery fine-tuning
(Δ against the key-only cut of the same selector), the recall probe's mean accuracy ± standard error, and the kept
widths. The long CSV is ``results/tables/value_study.csv``.
"""),)
    figures = (Figure("value_loss", "pruning loss of key, value and joint cuts", """
**Pruning loss of key, value and joint cuts**: held-out bits per byte of each pruned model before recovery
fine-tuning minus the unpruned model's, per model (panels) and share of the state removed (rows), one bar per cut
and selector of ``studies.values`` (lower is better).
"""),)

    def cells(self, config, block):
        """Per model, pct and selector the key, value and joint cut; then the recipe (key-only) at each pct."""
        from statereduce.selectors.registry import value_side_names

        where = "studies.values"
        known_models(config, where, block["models"])
        known_selectors(where, block["selectors"], value_side_names(),
                        lambda info: "has no value side (no -v or -kv)")
        recipe = block.get("recipe")
        if recipe is not None:
            try:
                check_method(config, recipe)
            except ConfigError as e:
                raise ConfigError(f"{where}.recipe: {e}") from None
            if parse_token(recipe).cut != "keys":
                raise ConfigError(f"{where}.recipe: {recipe!r} is not a key-only method; valid: e.g. drrqr@sens")
        for key in ("split", "split_layers"):
            if block.get(key) is None:
                continue
            try:
                check_method(config, f"{block['selectors'][0]}-kv@{block[key]}")
            except ConfigError as e:
                raise ConfigError(f"{where}.{key}: {e}") from None
            per_layer = bool(model_budget(config, block[key]).per_layer)
            if (key == "split_layers") != per_layer:
                raise ConfigError(f"{where}.{key}: budgets.{block[key]} has per_layer {str(per_layer).lower()}; {key} "
                                  f"takes a split budget with per_layer {'true' if key == 'split_layers' else 'false'}")
        cells = _cells(block)
        for model, method, pct in cells:
            try:
                check_reduction(config, model, pct, method)
                check_budget_cell(config, model, method, pct)
            except ConfigError as e:
                raise ConfigError(f"{where}: {method} {e}") from None
        return cells

    def inputs(self, config, block, cells):
        return {"summaries": summary_paths(cells),
                "activations": [layout.path(layout.ACTIVATIONS, model=m, calib="default") for m in block["models"]]}

    def frames(self, inputs, params):
        df = value_frame([read_json(p) for p in inputs["summaries"]], params)
        use = utilisation_frame(dict(zip(params["models"], inputs["activations"])))
        return {"value_study": (df, markdown(df, params, use))}

    def draw(self, inputs, params, outputs):
        df = value_frame([read_json(p) for p in inputs["summaries"]], params)
        loss_figure(df, params, outputs["value_loss"])


def _rows(block: dict) -> list[tuple[str, str, str]]:
    """(selector label, cut, method token) of each table row, in order: selectors × cuts (and the split joint cut),
    then the recipe."""
    rows = []
    for s in block["selectors"]:
        rows += [(s, cut, format_method(MethodSpec(s, cut=cut))) for cut, _ in CUTS]
        if block.get("split"):
            rows.append((s, SPLIT[0], format_method(MethodSpec(s, cut="joint", budget=block["split"]))))
        if block.get("split_layers"):
            rows.append((s, LAYERSPLIT[0], format_method(MethodSpec(s, cut="joint", budget=block["split_layers"]))))
    if block.get("recipe"):
        rows.append((block["recipe"], "keys", block["recipe"]))
    return rows


def _cells(block: dict) -> list[tuple[str, str, float]]:
    return [(m, method, float(p)) for m in block["models"] for p in block["pcts"] for _, _, method in _rows(block)]


def _layer_widths(state: dict, d_v) -> str:
    """"d_k' × d_v'" of each layer, comma-separated, for a summary whose layers keep different widths; else ""."""
    keys, values = state.get("key_dims_after") or {}, state.get("value_dims_after") or {}
    if len(set(keys.values())) <= 1 and not values:
        return ""
    d_v_after = state.get("d_v_after", d_v)
    return ", ".join(f"{k}×{values.get(layer, d_v_after)}" for layer, k in keys.items())


def value_frame(summaries: list[dict], block: dict):
    """One row per (model, pct, selector, cut, stage) of ``studies.values`` and one baseline row per model: held-out
    bits/byte, its change against the key-only cut of the same selector, pct and stage (NaN for the recipe), the
    recall probe's mean accuracy and standard error, the kept widths and the kept share of the state."""
    import pandas as pd

    from statereduce.analysis.tables import STAGES, recall_mean

    by_cell = {(s["model"], s["method"], float(s["pct"])): s for s in summaries}
    rows = []
    for model in block["models"]:
        base = next(((s.get("metrics") or {}).get("baseline") for s in summaries if s["model"] == model), None) or {}
        d_v = next(((s.get("state") or {}).get("d_v_before") for s in summaries
                    if s["model"] == model and (s.get("state") or {}).get("d_v_before") is not None), math.nan)
        recall, se = recall_mean(base)
        rows.append({"model": model, "pct": 0.0, "selector": "baseline", "cut": "", "method": "baseline",
                     "stage": "unpruned", "bits_per_byte": json_number((base.get("heldout") or {}).get("bits_per_byte")),
                     "recall": recall, "recall_se": se, "d_k": math.nan, "d_v": math.nan, "state": 1.0})
        for pct in map(float, block["pcts"]):
            for label, cut, method in _rows(block):
                doc = by_cell.get((model, method, pct)) or {}
                state = doc.get("state") or {}
                for stage in STAGES:
                    m = (doc.get("metrics") or {}).get(stage) or {}
                    recall, se = recall_mean(m)
                    rows.append({
                        "model": model, "pct": pct, "selector": label, "cut": cut, "method": method, "stage": stage,
                        "bits_per_byte": json_number((m.get("heldout") or {}).get("bits_per_byte")),
                        "recall": recall, "recall_se": se,
                        "d_k": state.get("d_k_after", math.nan),
                        "d_v": state.get("d_v_after", d_v),  # a key cut keeps d_v (its summary names none)
                        "widths": _layer_widths(state, d_v),
                        "state": state.get("ratio", math.nan),
                    })
    df = pd.DataFrame(rows)
    keys = df[df["cut"] == "keys"].set_index(["model", "pct", "selector", "stage"])["bits_per_byte"]
    df["d_bits_per_byte"] = [
        b - keys.get((m, p, s, st), math.nan) if c in COMPARED else math.nan
        for b, m, p, s, st, c in zip(df["bits_per_byte"], df["model"], df["pct"], df["selector"], df["stage"],
                                     df["cut"])]
    return df


def utilisation_frame(activations: dict[str, str]):
    """Per model and linear-attention layer, how much of each side of the state the calibration activations use:
    the effective rank (:func:`statereduce.core.budgets.effective_rank`) of the second moment of [K; Q] (keys and
    queries, summed over the q/k heads) over d_k, and of V (summed over the value heads) over d_v. A side used at
    low rank loses little when it is cut."""
    import numpy as np
    import pandas as pd

    from statereduce.core.budgets import effective_rank
    from statereduce.core.h5files import H5Artifact

    rows = []
    for model, path in activations.items():
        art = H5Artifact(path)
        for layer in art.layers():
            a = art.read(layer, ["K", "Q", "V"])
            kq = sum(np.linalg.eigvalsh(m.T @ m / m.shape[0]) for m in
                     (np.concatenate([k, q]).astype(np.float64) for k, q in zip(a["K"], a["Q"])))
            vv = sum(np.linalg.eigvalsh(v.astype(np.float64).T @ v.astype(np.float64) / v.shape[0]) for v in a["V"])
            rows.append({"model": model, "layer": layer, "d_k": kq.size, "d_v": vv.size,
                         "key_use": effective_rank(kq) / kq.size, "value_use": effective_rank(vv) / vv.size})
    return pd.DataFrame(rows)


def joint_wins(df, stage: str = "pruned"):
    """Per (pct, selector, cut) of value and joint cuts: the models on which its bits/byte is below the key-only
    cut's at ``stage``."""
    import pandas as pd

    sub = df[(df["stage"] == stage) & df["cut"].isin(COMPARED)].dropna(subset=["d_bits_per_byte"])
    rows = []
    for (pct, sel, cut), g in sub.groupby(["pct", "selector", "cut"], sort=False):
        better = g.loc[g["d_bits_per_byte"] < 0, "model"].tolist()
        rows.append({"pct": pct, "selector": sel, "cut": cut, "models_better": len(better), "of": g["model"].nunique(),
                     "which": ", ".join(better)})
    return pd.DataFrame(rows)


def markdown(df, block: dict, use=None) -> str:
    """Per pct a table of every model, selector and cut (bits/byte pre → post with Δ against the key-only cut, recall
    pre and post, kept widths and state); then where the value and joint cuts beat the key-only cut before RFT, and
    how much of each side the calibration activations use per layer (``use``: :func:`utilisation_frame`)."""
    from statereduce.analysis.tables import MISSING, fmt, fmt_delta, pm

    labels = LABELS
    parts = [
        "# Key, value and joint cuts at equal state\n\n",
        ("Each head's state is d_v × d_k. keys: key channels removed (the paper's cut); values: value channels "
         "(`<selector>-v`); keys+values: both (`<selector>-kv`), each side near the square root of the kept share; "
         "split by loss (`<selector>-kv@<budget>`): the split of the state between the two sides with the lowest "
         "calibration loss (from key-only to value-only); split per layer: each layer its own such split (widths "
         "per layer). "
         "The pct is the share of the state removed; `state` is the kept share as measured. bits/byte: held-out bits "
         "per byte (lower is better), Δ against the key-only cut of the same selector; recall: the recall probe's "
         f"mean accuracy over its levels ± standard error. {MISSING} = not computed.\n"),
    ]
    base = df[df["stage"] == "unpruned"].set_index("model")
    for pct in map(float, block["pcts"]):
        sub = df[df["pct"] == pct]
        lines = ["| model | method | cut | d_k' × d_v' | state | bits/byte pre → post | Δ pre | Δ post | recall pre | "
                 "recall post |", "|" + " --- |" * 10]
        for model in block["models"]:
            b = base.loc[model] if model in base.index else None
            if b is not None:
                lines.append(f"| {model} | baseline | | | 1 | {fmt(b['bits_per_byte'])} | | | "
                             f"{pm(b['recall'], b['recall_se'])} | |")
            for (sel, cut), g in sub[sub["model"] == model].groupby(["selector", "cut"], sort=False):
                pre = g[g["stage"] == "pruned"].iloc[0]
                post = g[g["stage"] == "rft"].iloc[0]
                widths = pre["widths"] or (f"{int(pre['d_k'])} × {int(pre['d_v'])}" if not (
                    math.isnan(pre["d_k"]) or math.isnan(pre["d_v"])) else MISSING)
                state = MISSING if math.isnan(pre["state"]) else f"{pre['state']:.3f}"
                lines.append(
                    f"| {model} | {pre['method']} | {labels.get(cut, cut)} | {widths} | {state} | "
                    f"{fmt(pre['bits_per_byte'])} → {fmt(post['bits_per_byte'])} | {fmt_delta(pre['d_bits_per_byte'])} "
                    f"| {fmt_delta(post['d_bits_per_byte'])} | {pm(pre['recall'], pre['recall_se'])} | "
                    f"{pm(post['recall'], post['recall_se'])} |")
        parts.append(f"\n## {format_pct(pct)}% of the state removed\n\n" + "\n".join(lines) + "\n")
    wins = joint_wins(df)
    if not wins.empty:
        lines = ["| pct | selector | cut | models where bits/byte beats the key-only cut (pre-RFT) |",
                 "|" + " --- |" * 4]
        for r in wins.itertuples():
            lines.append(f"| {format_pct(r.pct)} | {r.selector} | {labels.get(r.cut, r.cut)} | {r.models_better} of "
                         f"{r.of}" + (f": {r.which}" if r.which else "") + " |")
        parts.append("\n## Where a value or joint cut beats the key-only cut\n\n" + "\n".join(lines) + "\n")
    if use is not None and not use.empty:
        lines = ["| model | layer | keys: erank / d_k | values: erank / d_v |", "|" + " --- |" * 4]
        for r in use.itertuples():
            lines.append(f"| {r.model} | {r.layer} | {r.key_use:.2f} (of {r.d_k}) | {r.value_use:.2f} (of {r.d_v}) |")
        parts.append("\n## How much of each side the model uses\n\nEffective rank of the calibration activations' "
                     "second moment per layer, over its width: [K; Q] on the key side, V on the value side (summed "
                     "over the heads). A side used at a low share loses little when it is cut.\n\n"
                     + "\n".join(lines) + "\n")
    return "".join(parts)


def loss_figure(df, block: dict, out_png: str | Path) -> Path:
    """Pruning loss (pre-RFT bits/byte minus the baseline's) per model (columns) and pct (rows), one bar per
    (selector, cut)."""
    import numpy as np

    from statereduce.analysis.figures import METHOD_COLORS, new_figure, save_figure

    models, pcts = list(block["models"]), [float(p) for p in block["pcts"]]
    rows = [(sel, cut) for sel, cut, _ in _rows(block)]
    base = df[df["stage"] == "unpruned"].set_index("model")["bits_per_byte"]
    fig = new_figure(3.0 * len(models), 2.6 * len(pcts))
    axes = fig.subplots(len(pcts), len(models), squeeze=False)
    hatches = {"keys": "", "values": "//", "joint": "xx", SPLIT[0]: "..", LAYERSPLIT[0]: "oo"}
    selectors = list(dict.fromkeys(sel for sel, _ in rows))
    for r, pct in enumerate(pcts):
        for c, model in enumerate(models):
            ax = axes[r][c]
            sub = df[(df["model"] == model) & (df["pct"] == pct) & (df["stage"] == "pruned")]
            values = [sub.loc[(sub["selector"] == sel) & (sub["cut"] == cut), "bits_per_byte"] for sel, cut in rows]
            losses = [float(v.iloc[0]) - float(base.get(model, np.nan)) if len(v) else np.nan for v in values]
            for i, ((sel, cut), loss) in enumerate(zip(rows, losses)):
                ax.bar(i, 0 if np.isnan(loss) else loss, color=METHOD_COLORS[selectors.index(sel) % len(METHOD_COLORS)],
                       hatch=hatches.get(cut, ""), edgecolor="black", linewidth=0.4,
                       label=f"{sel} {LABELS.get(cut, cut)}" if r == 0 and c == 0 else None)
            ax.axhline(0, color="black", linewidth=0.6)
            ax.set_xticks([])
            ax.set_title(f"{model}, {format_pct(pct)}% of the state", fontsize=9)
            if c == 0:
                ax.set_ylabel("pruning loss (bits/byte)", fontsize=8)
            ax.tick_params(labelsize=7)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 4), fontsize=7)
    return save_figure(fig, out_png)
