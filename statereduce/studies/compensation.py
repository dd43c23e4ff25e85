"""Beyond selection: the best selection-only cells against the same cells with compensation (``+<fit>``), the joint
budget across layers and sides (``-kv@<joint>``) and an outside selector (``ghost``), per model and pct, pre- and
post-RFT, each cell's pruning loss also as a multiple of a reference cell's (``drrqr@sens``). Block
``studies.compensation``; cells are summaries."""

from __future__ import annotations

import math

from statereduce.common.layout import format_pct, selection_token
from statereduce.config.blocks import ConfigError, check_budget_cell, check_method, check_reduction
from statereduce.core.runtime import json_number, read_json
from statereduce.studies.base import PCTS, Study, Table, known_models, register, summary_paths, unique_list


@register
class CompensationStudy(Study):
    name = "compensation"
    rule = "compensation_study"
    doc = ("Selection-only cells against compensation (+<fit>), the joint budget and GHOST, pre- and post-RFT, with "
           "each cell's pruning loss as a multiple of the reference's, from the summaries of studies.compensation.")
    schema = {
        "type": "object",
        "additionalProperties": False,
        "description": "compensation beyond selection (docs/compensation.md)",
        "required": ["models", "methods", "pcts", "reference"],
        "properties": {
            "models": unique_list(),
            "methods": unique_list(description="method tokens, in table order"),
            "pcts": PCTS,
            "reference": {"type": "string", "description": "the method whose pruning loss the others are compared "
                                                           "with, e.g. drrqr@sens (one of methods)"},
        },
    }
    tables = (Table("compensation_study", "compensation beyond selection", """
**Compensation beyond selection** (``studies.compensation``): each method token at each share of the state removed.
Pruning loss is the pruned model's held-out bits per byte minus the unpruned model's, before recovery fine-tuning;
× ref. divides it by the reference method's at the same model and pct (below 1: better; "–" where either is
negative, i.e. beats the unpruned model). Then held-out bits per
byte before → after RFT and the recall probe's mean accuracy ± standard error before → after RFT. The long CSV is
``results/tables/compensation_study.csv``.
"""),)

    def cells(self, config, block):
        """Each model × pct × method of the block, the reference among the methods."""
        where = "studies.compensation"
        known_models(config, where, block["models"])
        if block["reference"] not in block["methods"]:
            raise ConfigError(f"{where}.reference: {block['reference']!r} is not one of methods "
                              f"({', '.join(block['methods'])})")
        cells = [(m, method, float(p)) for m in block["models"] for p in block["pcts"] for method in block["methods"]]
        for model, method, pct in cells:
            try:
                check_method(config, method)
                check_reduction(config, model, pct, selection_token(method))
                check_budget_cell(config, model, method, pct)
            except ConfigError as e:
                raise ConfigError(f"{where}: {method} {e}") from None
        return cells

    def inputs(self, config, block, cells):
        return {"summaries": summary_paths(cells)}

    def frames(self, inputs, params):
        df = compensation_frame([read_json(p) for p in inputs["summaries"]], params)
        return {"compensation_study": (df, markdown(df, params))}


def compensation_frame(summaries: list[dict], block: dict):
    """One row per (model, pct, method, stage): held-out bits/byte, pruning loss (bits/byte above the unpruned model)
    and its ratio to the reference's, recall probe mean ± standard error, kept share of the state."""
    import pandas as pd

    from statereduce.analysis.tables import STAGES, recall_mean

    by_cell = {(s["model"], s["method"], float(s["pct"])): s for s in summaries}
    rows = []
    for model in block["models"]:
        for pct in map(float, block["pcts"]):
            for method in block["methods"]:
                doc = by_cell.get((model, method, pct)) or {}
                metrics = doc.get("metrics") or {}
                base = json_number(((metrics.get("baseline") or {}).get("heldout") or {}).get("bits_per_byte"))
                for stage in STAGES:
                    m = metrics.get(stage) or {}
                    bpb = json_number((m.get("heldout") or {}).get("bits_per_byte"))
                    recall, se = recall_mean(m)
                    rows.append({"model": model, "pct": pct, "method": method, "stage": stage, "bits_per_byte": bpb,
                                 "loss": bpb - base, "recall": recall, "recall_se": se,
                                 "state": (doc.get("state") or {}).get("ratio", math.nan)})
    df = pd.DataFrame(rows)
    ref = df[df["method"] == block["reference"]].set_index(["model", "pct", "stage"])["loss"]
    # a ratio only where both losses are positive: a negative loss beats the unpruned model, and noise around zero
    # makes any ratio meaningless
    df["loss_vs_reference"] = [loss / r if r > 0 and loss >= 0 else math.nan
                               for loss, r in ((loss, ref.get((m, p, st), math.nan)) for loss, m, p, st in
                                               zip(df["loss"], df["model"], df["pct"], df["stage"]))]
    return df


def markdown(df, block: dict) -> str:
    """Per model and pct: one row per method with the pre-RFT pruning loss and its ratio to the reference's, bits per
    byte and recall before → after RFT."""
    from statereduce.analysis.tables import fmt

    def pair(a, b, digits=3):
        return f"{fmt(a)} → {fmt(b)}"

    def recall(row):
        return MISSING_RECALL if math.isnan(row["recall"]) else f"{row['recall']:.3f} ± {row['recall_se']:.3f}"

    parts = ["# Compensation beyond selection\n\n",
             f"Pruning loss: held-out bits per byte above the unpruned model before RFT; × ref.: its ratio to "
             f"`{block['reference']}`'s where both are positive (– where either beats the unpruned model). Bits per "
             "byte and recall (probe mean ± standard error): pre-RFT → post-RFT.\n"]
    for model in block["models"]:
        for pct in map(float, block["pcts"]):
            lines = ["| method | state kept | pruning loss | × ref. | bits/byte | recall |",
                     "| --- | --- | --- | --- | --- | --- |"]
            cell = df[(df["model"] == model) & (df["pct"] == pct)]
            for method in block["methods"]:
                pre = cell[(cell["method"] == method) & (cell["stage"] == "pruned")].iloc[0]
                post = cell[(cell["method"] == method) & (cell["stage"] == "rft")].iloc[0]
                ratio = "–" if math.isnan(pre["loss_vs_reference"]) else f"{pre['loss_vs_reference']:.2f}"
                lines.append(f"| {method} | {fmt(pre['state'])} | {fmt(pre['loss'])} | {ratio} | "
                             f"{pair(pre['bits_per_byte'], post['bits_per_byte'])} | {recall(pre)} → {recall(post)} |")
            parts.append(f"\n## {model}, {format_pct(pct)}% of the state removed\n\n" + "\n".join(lines) + "\n")
    return "".join(parts)


MISSING_RECALL = "–"
