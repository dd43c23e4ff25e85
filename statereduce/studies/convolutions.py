"""Shared convolutions and PCA (paper Tables 14 and 15): models trained with per-channel or shared q/k conv filters
(``pretrain.share_conv``), unpruned (Table 14) and pruned by PCA (proper, adversarial) and Grad before RFT (Table
15). Block ``studies.convolutions``; cells are pre-RFT evaluations ``results/{model}/{method}_{pct}/pruned/eval.json``.
"""

from __future__ import annotations

from statereduce.common import layout
from statereduce.common.layout import MethodSpec, format_method, format_pct
from statereduce.config.blocks import ConfigError, check_reduction, model_pretrain
from statereduce.core.runtime import read_json
from statereduce.families import SHARE_CONV  # Table 14's rows, in the paper's order
from statereduce.studies.base import PCTS, Study, Table, known_selectors, register, unique_list

#: Table 14's notation for how q/k conv filters are shared: across heads, inside a head (× = no, ✓ = yes)
SHARING_MARKS = {"none": "××", "head": "×✓", "all": "✓✓"}
SHARING_LABELS = {"none": "non-shared", "head": "shared (in a head)", "all": "shared (in and across heads)"}
#: Table 15's method names of the paper, by selector
PCA_METHOD_LABELS = {"pca-adv": "PCA (adv.)", "pca": "PCA (prop.)", "grad": "Grad"}


def _models(block: dict) -> list[str]:
    """The study's models, each once, in Table 14's row order (``none``, ``head``, ``all``)."""
    return list(dict.fromkeys(block["models"][k] for k in SHARE_CONV if k in block["models"]))


@register
class ConvolutionStudy(Study):
    name = "convolutions"
    rule = "convolution_tables"
    doc = ("Shared against per-channel q/k conv filters (paper Table 14: the unpruned models) and PCA (proper, "
           "adversarial) against Grad on both, before RFT (Table 15), from studies.convolutions; with HTML pages.")
    schema = {
        "type": "object",
        "additionalProperties": False,
        "description": "paper Tables 14-15: models with per-channel and shared q/k conv filters, PCA against Grad "
                       "before RFT",
        "required": ["models", "selectors", "pcts"],
        "properties": {
            "models": {"type": "object", "additionalProperties": False, "minProperties": 1,
                       "description": "share_conv (none, head, all) -> the model trained with it",
                       "properties": {"none": {"type": "string"}, "head": {"type": "string"},
                                      "all": {"type": "string"}}},
            "selectors": unique_list(),
            "pcts": PCTS,
        },
    }
    tables = (
        Table("shared_convolutions", "shared convolutions (Table 14)", """
**Shared convolutions** (paper Table 14): the unpruned models of ``studies.convolutions``, trained with per-channel
q/k conv filters (××), filters tied across the channels of each head (×✓), or across every channel of the layer
(✓✓) (``pretrain.share_conv``), on the held-out text and the recall probe. "–" marks a value that was not computed.
The long CSV is ``results/tables/shared_convolutions.csv``.
"""),
        Table("pca_convolutions", "PCA and convolutions (Table 15)", """
**PCA with shared and per-channel convolutions** (paper Table 15): each model of ``studies.convolutions`` pruned by
proper PCA (``pca``: the top principal directions of the calibration keys and queries), adversarial PCA
(``pca-adv``: the bottom ones) and Grad at each ratio, before recovery fine-tuning; the 0% row is the unpruned
model. The PCA transform mixes per-channel conv filters and carries shared ones over exactly. "–" marks a value that
was not computed. The long CSV is ``results/tables/pca_convolutions.csv``.
"""),
    )

    def cells(self, config, block):
        """Every model at every pct by every selector. ``models`` maps a sharing (Table 14's rows) to a model; a model
        the workflow pretrains must train with that ``share_conv``."""
        where, models = "studies.convolutions", config["models"]
        for share, model in block["models"].items():
            if model not in models:
                raise ConfigError(f"{where}.models.{share}: unknown model {model!r}; valid: "
                                  f"{', '.join(sorted(models))}")
            trained = model_pretrain(config, model).share_conv if "pretrain" in models[model] else None
            if trained is not None and trained != share:
                raise ConfigError(f"{where}.models.{share}: model {model!r} trains with share_conv {trained!r}; "
                                  f"valid: a model whose pretrain.share_conv is {share!r} (or a hub/local model)")
        known_selectors(where, block["selectors"])
        for model in block["models"].values():
            for pct in block["pcts"]:
                try:
                    check_reduction(config, model, pct)
                except ConfigError as e:
                    raise ConfigError(f"{where}: {e}") from None
        ordered = [block["models"][k] for k in SHARE_CONV if k in block["models"]]
        return [(m, format_method(MethodSpec(sel)), float(pct)) for m in ordered for pct in block["pcts"]
                for sel in block["selectors"]]

    def inputs(self, config, block, cells):
        """The unpruned evaluation of every model (Table 14, Table 15's 0% row) and each cell's pre-RFT one."""
        return {"baselines": [layout.path(layout.BASELINE_EVAL, model=m) for m in _models(block)],
                "pruned": [layout.path(f"{layout.PRUNED}/eval.json", model=m, method=method, pct=pct)
                           for m, method, pct in cells]}

    def params(self, config, block, cells):
        return {"block": block, "cells": [list(c) for c in cells]}

    def frames(self, inputs, params):
        block = params["block"]
        baselines = {m: read_json(p) for m, p in zip(_models(block), inputs["baselines"], strict=True)}
        pruned = {tuple(c): read_json(p) for c, p in zip(params["cells"], inputs["pruned"], strict=True)}
        shared, pca = convolution_frames(baselines, pruned, block)
        return {"shared_convolutions": (shared, shared_markdown(shared, block)),
                "pca_convolutions": (pca, pca_markdown(pca, block))}


def convolution_frames(baselines: dict[str, dict], pruned: dict[tuple[str, str, float], dict], block: dict):
    """The frames of Tables 14 and 15 from the study's evaluation documents.

    Args:
        baselines: model -> its unpruned ``results/{model}/baseline/eval.json``.
        pruned: (model, method, pct) -> the cell's pre-RFT ``results/{model}/{method}_{pct}/pruned/eval.json``;
            documents of other cells are ignored.
        block: the ``studies.convolutions`` block.

    Returns:
        (shared, pca): ``shared`` has a row per model (``sharing``, ``model``, then every metric column of its
        baseline); ``pca`` a row per (pct, selector, sharing) plus pct 0 rows (the baselines), with ``model``,
        ``method`` and every metric column. Missing documents leave NaN (shown as missing, never invented).
    """
    import pandas as pd

    from statereduce.analysis.tables import eval_columns

    order = [k for k in SHARING_MARKS if k in block["models"]]
    shared = pd.DataFrame([{"sharing": k, "model": block["models"][k],
                            **eval_columns(baselines.get(block["models"][k], {}))} for k in order])
    by_cell = {(m, method, float(pct)): d for (m, method, pct), d in pruned.items()}
    rows = []
    for pct in block["pcts"]:
        for sel in block["selectors"]:
            for k in order:
                model = block["models"][k]
                doc = by_cell.get((model, sel, float(pct)), {})
                rows.append({"pct": float(pct), "method": sel, "sharing": k, "model": model, **eval_columns(doc)})
    for k in order:
        model = block["models"][k]
        rows.append({"pct": 0.0, "method": "baseline", "sharing": k, "model": model,
                     **eval_columns(baselines.get(model, {}))})
    return shared, pd.DataFrame(rows)


def shared_markdown(df, block: dict) -> str:
    """Table 14 layout: a row per sharing (the paper's ×× / ×✓ / ✓✓), the unpruned models' metrics as columns."""
    from statereduce.analysis.tables import MISSING, TABLE_METRICS, fmt, metric_direction

    metrics = [m for m in TABLE_METRICS if m in df.columns and df[m].notna().any()]
    metrics += sorted(c for c in df.columns if c.startswith("recall_mqar") and c.endswith("/acc") and c not in metrics)
    lines = [
        "# Shared convolutions (paper Table 14)\n",
        "The unpruned models: q/k short-convolution filters per channel (××), tied across the channels of each head "
        "(×✓), or across every channel of the layer (✓✓) while training (`pretrain.share_conv`). "
        f"{MISSING} = not computed.\n",
        "| shared conv (heads, channels) | model | " + " | ".join(
            f"{m} ({metric_direction(m).split()[0]})" if metric_direction(m) else m for m in metrics) + " |",
        "|" + " --- |" * (len(metrics) + 2),
    ]
    for r in df.to_dict("records"):
        lines.append(f"| {SHARING_MARKS[r['sharing']]} | {r['model']} | "
                     + " | ".join(fmt(r.get(m)) for m in metrics) + " |")
    return "\n".join(lines) + "\n"


def pca_markdown(df, block: dict) -> str:
    """Table 15 layout: rows compression × method (and the unpruned 0% row), a column per sharing; pre-RFT."""
    from statereduce.analysis.tables import MISSING, fmt, metric_direction, primary_metric

    order = [k for k in SHARING_MARKS if k in block["models"]]
    metric = primary_metric(df)
    direction = metric_direction(metric)
    values = {(r["pct"], r["method"], r["sharing"]): r.get(metric) for r in df.to_dict("records")}
    lines = [
        "# PCA with shared and per-channel convolutions, before RFT (paper Table 15)\n",
        "Each model pruned by each method, before recovery fine-tuning. PCA (prop.) keeps the principal directions "
        "of largest second moment of the calibration keys and queries, PCA (adv.) those of smallest (`pca`, "
        "`pca-adv`); their transform mixes the per-channel conv filters (paper App. B.4) and carries shared ones "
        "over exactly (App. B.5). Grad keeps channels. "
        f"Metric: {metric}{f' ({direction})' if direction else ''}. {MISSING} = not computed.\n",
        "| comp. | method | " + " | ".join(f"{SHARING_LABELS[k]} ({block['models'][k]})" for k in order) + " |",
        "|" + " --- |" * (len(order) + 2),
    ]
    for pct in sorted(block["pcts"], reverse=True):
        for sel in block["selectors"]:
            label = PCA_METHOD_LABELS.get(sel, sel)
            lines.append(f"| {format_pct(pct)}% | {label} | "
                         + " | ".join(fmt(values.get((float(pct), sel, k))) for k in order) + " |")
    lines.append("| 0% | – | " + " | ".join(fmt(values.get((0.0, "baseline", k))) for k in order) + " |")
    return "\n".join(lines) + "\n"
