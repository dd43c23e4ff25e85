"""Per-layer key budgets against the uniform cut at the same state (beyond the paper; docs/budgets.md): each selector
with each budget of ``budgets:`` (``<selector>@<budget>``) against its uniform cut, at each ratio, pre- and post-RFT,
with recall and the per-layer widths. Block ``studies.budgets``; cells are summaries, and the budget cells'
allocations."""

from __future__ import annotations

import math
from pathlib import Path

from statereduce.common import layout
from statereduce.common.layout import MethodSpec, format_method, format_pct, parse_token
from statereduce.config.blocks import ConfigError, check_budget_cell, check_reduction, model_budget
from statereduce.core.runtime import json_number, read_json
from statereduce.studies.base import (
    KEY, PCTS, Figure, Study, Table, known_models, known_selectors, register, summary_paths, unique_list,
)


@register
class BudgetStudy(Study):
    name = "budgets"
    rule = "budget_study"
    doc = ("Per-layer key budgets against the uniform cut at the same state (studies.budgets), pre- and post-RFT, "
           "from the summaries and allocations of its cells; with the HTML page and a figure of every allocation.")
    schema = {
        "type": "object",
        "additionalProperties": False,
        "description": "per-layer key budgets against the uniform cut at the same total state, pre- and post-RFT",
        "required": ["models", "selectors", "budgets", "pcts"],
        "properties": {
            "models": unique_list(),
            "selectors": unique_list(description="index selectors"),
            "budgets": unique_list(KEY, "keys of budgets"),
            "pcts": PCTS,
        },
    }
    tables = (Table("budget_study", "per-layer key budgets vs. the uniform cut", """
**Per-layer key budgets against the uniform cut** (``studies.budgets``): each budget keeps the uniform cut's total
of key channels, hence the same state bytes, but lets every layer keep its own d_k' (multiples of the budget's
``multiple`` above its ``floor``). Rows: model, selector and budget (``uniform`` is the paper's cut; ``energy`` and
``erank`` rank widths by each layer's calibration [K; Q] spectrum, ``greedy`` by the selector's own objective,
``sens`` by the measured calibration loss of cutting one layer alone). Columns: the per-layer widths, held-out bits
per byte before and after RFT with the change against the uniform cut, and the recall probe's mean accuracy ± its
standard error. The last table counts the models on which each budget beats the uniform cut before RFT. The CSV
is ``results/tables/budget_study.csv``; docs/budgets.md discusses the numbers.
"""),)
    figures = (Figure("budget_allocations", "per-layer key budgets", """
**Per-layer key budgets**: the kept key channels d_k' of every linear-attention layer under each budget of
``studies.budgets`` (one panel per model and ratio, one line per selector and budget); the dashed line is the
uniform cut, whose total every budget keeps.
"""),)

    def cells(self, config, block):
        """Per model, pct and selector the uniform cut (the plain token) and then each budget (``<selector>@<budget>``),
        in that order."""
        where = "studies.budgets"
        known_models(config, where, block["models"])
        known_selectors(where, block["selectors"])
        for budget in block["budgets"]:
            try:
                model_budget(config, budget)
            except ConfigError as e:
                raise ConfigError(f"{where}.budgets: {e}") from None
        cells = []
        for model in block["models"]:
            for pct in block["pcts"]:
                try:
                    check_reduction(config, model, pct)
                except ConfigError as e:
                    raise ConfigError(f"{where}: {e}") from None
                for sel in block["selectors"]:
                    for budget in [None, *block["budgets"]]:
                        method = format_method(MethodSpec(sel, budget=budget))
                        try:
                            check_budget_cell(config, model, method, pct)
                        except ConfigError as e:
                            raise ConfigError(f"{where}: {e}") from None
                        cells.append((model, method, float(pct)))
        return cells

    def inputs(self, config, block, cells):
        """Every cell's summary and every budget cell's allocation (the uniform cells have none)."""
        return {"summaries": summary_paths(cells),
                "allocations": [layout.path(layout.ALLOCATION, model=m, method=method, pct=pct)
                                for m, method, pct in cells if parse_token(method).budget is not None]}

    def frames(self, inputs, params):
        df = budget_frame([read_json(p) for p in inputs["summaries"]], params,
                          [read_json(p) for p in inputs["allocations"]])
        return {"budget_study": (df, markdown(df, params))}

    def draw(self, inputs, params, outputs):
        allocations_figure([read_json(p) for p in inputs["allocations"]], outputs["budget_allocations"])


def budget_frame(summaries: list[dict], block: dict, allocations: list[dict]):
    """One row per (model, pct, selector, budget, stage) of ``studies.budgets``, ``budget`` ``uniform`` for the plain
    method; with held-out bits/byte, the recall probe's mean accuracy and its standard error, and the change of
    both against the uniform cut of the same selector, pct and stage; ``key_dims`` are the allocation's widths.

    Args:
        summaries: summary documents (others are ignored).
        block: the ``studies.budgets`` block.
        allocations: the allocation documents of the budget cells (others are ignored).
    """
    import pandas as pd

    from statereduce.analysis.tables import STAGES, recall_mean

    by_cell = {(s["model"], s["method"], float(s["pct"])): s for s in summaries}
    allocations = {(a["model"], a["method"], float(a["pct"])): a for a in allocations}
    rows = []
    for model in block["models"]:
        for pct in map(float, block["pcts"]):
            for sel in block["selectors"]:
                for budget in ["uniform", *block["budgets"]]:
                    method = format_method(MethodSpec(sel, budget=None if budget == "uniform" else budget))
                    doc = by_cell.get((model, method, pct)) or {}
                    alloc = allocations.get((model, method, pct))
                    widths = list(alloc["key_dims"].values()) if alloc else None
                    for stage in STAGES:
                        m = (doc.get("metrics") or {}).get(stage) or {}
                        recall, se = recall_mean(m)
                        rows.append({
                            "model": model, "pct": pct, "selector": sel, "budget": budget, "method": method,
                            "policy": alloc["allocation"]["policy"] if alloc else "uniform", "stage": stage,
                            "bits_per_byte": json_number((m.get("heldout") or {}).get("bits_per_byte")),
                            "recall": recall, "recall_se": se,
                            "key_dims": " ".join(map(str, widths)) if widths else "",
                        })
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    ref = df[df["budget"] == "uniform"].set_index(["model", "pct", "selector", "stage"])
    keys = list(zip(df["model"], df["pct"], df["selector"], df["stage"]))
    df["d_bits_per_byte"] = [b - ref["bits_per_byte"].get(k, math.nan) for b, k in zip(df["bits_per_byte"], keys)]
    df["d_recall"] = [r - ref["recall"].get(k, math.nan) for r, k in zip(df["recall"], keys)]
    df["d_recall_se"] = [math.hypot(s, ref["recall_se"].get(k, math.nan)) for s, k in zip(df["recall_se"], keys)]
    return df


def budget_wins(df, stage: str = "pruned"):
    """Per (pct, selector, budget): the models on which the budget's bits/byte is below the uniform cut's at
    ``stage``, and how many; ``any`` counts models on which at least one budget is."""
    import pandas as pd

    sub = df[(df["stage"] == stage) & (df["budget"] != "uniform")].dropna(subset=["d_bits_per_byte"])
    rows = []
    for (pct, sel), g in sub.groupby(["pct", "selector"], sort=False):
        for budget, b in g.groupby("budget", sort=False):
            better = b.loc[b["d_bits_per_byte"] < 0, "model"].tolist()
            rows.append({"pct": pct, "selector": sel, "budget": budget, "models_better": len(better),
                         "of": b["model"].nunique(), "which": ", ".join(better)})
        any_better = sorted({m for m, d in zip(g["model"], g["d_bits_per_byte"]) if d < 0})
        rows.append({"pct": pct, "selector": sel, "budget": "any", "models_better": len(any_better),
                     "of": g["model"].nunique(), "which": ", ".join(any_better)})
    return pd.DataFrame(rows)


def markdown(df, block: dict) -> str:
    """Per pct a table of every model, selector and budget: bits/byte pre- and post-RFT with the change against the
    uniform cut, recall (mean ± standard error) pre- and post-RFT, and the per-layer widths; then the count of models
    on which each budget beats the uniform cut before RFT."""
    from statereduce.analysis.tables import MISSING, fmt, fmt_delta, pm

    parts = [
        "# Per-layer key budgets against the uniform cut\n\n",
        ("Each budget keeps the uniform cut's total of key channels (the same state bytes) but gives each layer its "
         "own d_k' (`key dims`, per linear-attention layer). bits/byte: held-out bits per byte (lower is better), Δ "
         "against the uniform cut of the same selector; recall: the recall probe's mean accuracy over its levels ± "
         f"standard error (Δ with the uniform cut's error included). {MISSING} = not computed.\n"),
    ]
    for pct in map(float, block["pcts"]):
        sub = df[df["pct"] == pct]
        lines = ["| model | selector | budget | key dims | bits/byte pre → post | Δ pre | Δ post | recall pre | "
                 "recall post | Δ recall pre |", "|" + " --- |" * 10]
        for (model, sel, budget), g in sub.groupby(["model", "selector", "budget"], sort=False):
            pre = g[g["stage"] == "pruned"].iloc[0]
            post = g[g["stage"] == "rft"].iloc[0]
            uniform = budget == "uniform"
            lines.append(
                f"| {model} | {sel} | {budget} | {pre['key_dims'] or MISSING} | {fmt(pre['bits_per_byte'])} → "
                f"{fmt(post['bits_per_byte'])} | {'' if uniform else fmt_delta(pre['d_bits_per_byte'])} | "
                f"{'' if uniform else fmt_delta(post['d_bits_per_byte'])} | {pm(pre['recall'], pre['recall_se'])} | "
                f"{pm(post['recall'], post['recall_se'])} | "
                f"{'' if uniform else pm(pre['d_recall'], pre['d_recall_se'], signed=True)} |")
        parts.append(f"\n## {format_pct(pct)}% of key channels removed\n\n" + "\n".join(lines) + "\n")
    wins = budget_wins(df)
    if not wins.empty:
        lines = ["| pct | selector | budget | models where bits/byte beats uniform (pre-RFT) |", "|" + " --- |" * 4]
        for r in wins.itertuples():
            lines.append(f"| {format_pct(r.pct)} | {r.selector} | {r.budget} | {r.models_better} of {r.of}"
                         + (f": {r.which}" if r.which else "") + " |")
        parts.append("\n## Where a budget beats the uniform cut\n\n" + "\n".join(lines) + "\n")
    return "".join(parts)


def allocations_figure(allocations: list[dict], out_png: str | Path) -> Path:
    """Per-layer kept key widths of every budget, one panel per (model, pct), one line per (selector, budget), with
    the uniform cut's width dashed (the per-layer budgets of ``studies.budgets``).

    Args:
        allocations: allocation documents (:mod:`statereduce.stages.allocate`): ``model``, ``pct``, ``selector``,
            ``budget``, ``key_dims``, ``uniform_width``, ``d_k``.
        out_png: the PNG to write.
    """
    from matplotlib.ticker import FixedLocator

    from statereduce.analysis.figures import BASELINE_COLOR, METHOD_COLORS, new_figure, save_figure

    if not allocations:
        raise ValueError("no allocation to plot: the budget study has no cell")
    panels: dict[tuple[str, float], list[dict]] = {}
    for doc in allocations:
        panels.setdefault((doc["model"], float(doc["pct"])), []).append(doc)
    models = list(dict.fromkeys(m for m, _ in panels))
    pcts = sorted({p for _, p in panels})
    fig = new_figure(3.2 * len(models), 2.6 * len(pcts))
    axes = fig.subplots(len(pcts), len(models), squeeze=False, sharey="row")
    series = list(dict.fromkeys(f"{d['selector']}@{d['budget']}" for d in allocations))
    colors = {s: METHOD_COLORS[i % len(METHOD_COLORS)] for i, s in enumerate(series)}
    markers = "osD^vP*X"
    for r, pct in enumerate(pcts):
        for c, model in enumerate(models):
            ax = axes[r][c]
            docs = panels.get((model, pct), [])
            for doc in docs:
                layers = [int(k) for k in doc["key_dims"]]
                label = f"{doc['selector']}@{doc['budget']}"
                ax.plot(layers, list(doc["key_dims"].values()), marker=markers[series.index(label) % len(markers)],
                        color=colors[label], label=label, linewidth=1.2, markersize=4, alpha=0.85)
            if docs:
                ax.axhline(docs[0]["uniform_width"], color=BASELINE_COLOR, linestyle="--", linewidth=1, label="uniform")
                ax.set_ylim(0, docs[0]["d_k"] + 4)
                ax.xaxis.set_major_locator(FixedLocator([int(k) for k in docs[0]["key_dims"]]))
            ax.set_title(f"{model}, {format_pct(pct)}% removed", fontsize=9)
            ax.set_xlabel("layer", fontsize=8)
            if c == 0:
                ax.set_ylabel("kept key channels d_k'", fontsize=8)
            ax.tick_params(labelsize=7)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 6), fontsize=7)
    return save_figure(fig, out_png)
