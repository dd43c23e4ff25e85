"""Scoring from keys only, queries only, or both (paper Table 16): each selector with channel scores from keys and
queries (``<selector>``), keys only (``<selector>-k``) and queries only (``<selector>-q``) at one ratio, pre- and
post-RFT. Block ``studies.scoring``; cells are summaries."""

from __future__ import annotations

from statereduce.common.layout import MethodSpec, format_method, format_pct
from statereduce.config.blocks import ConfigError, check_reduction
from statereduce.core.runtime import read_json
from statereduce.studies.base import Study, Table, known_models, known_selectors, register, summary_paths, unique_list

#: Scoring variants in Table 16's column order, with the paper's column labels.
SCORING = (("kq", "K,Q"), ("k", "K"), ("q", "Q"))


@register
class ScoringStudy(Study):
    name = "scoring"
    rule = "scoring_ablation"
    doc = ("Scoring from keys only, queries only or both (paper Table 16), pre- and post-RFT, from the summaries of "
           "the cells of studies.scoring; with its HTML page for the report.")
    schema = {
        "type": "object",
        "additionalProperties": False,
        "description": "paper Table 16: scores from keys and queries, keys only, queries only",
        "required": ["models", "selectors", "pct"],
        "properties": {
            "models": unique_list(),
            "selectors": unique_list(description="selectors with -k/-q variants"),
            "pct": {"$ref": "#/$defs/pct"},
        },
    }
    tables = (Table("scoring_ablation", "K / Q / K+Q scoring (Table 16)", """
**Scoring from keys only, queries only, or both** (paper Table 16): each selector of ``studies.scoring`` at one
ratio, with channel scores from keys and queries together (K,Q; the default), keys only (K, method ``<selector>-k``)
or queries only (Q, ``<selector>-q``). Rows are the selectors and the unpruned baseline, columns K,Q / K / Q per
model, before (pre-RFT) and after recovery fine-tuning (post-RFT). The metric is the comparison table's first
(held-out bits per byte on the tiny models, WikiText-2 perplexity on the paper's). "–" marks a value that was not
computed; nothing is filled in. The long CSV is ``results/tables/scoring_ablation.csv``.
"""),)

    def cells(self, config, block):
        """Each model × selector × (K,Q; K; Q) at ``pct``; only selectors with ``-k``/``-q`` variants (not rand)."""
        from statereduce.selectors import get_selector, selector_names

        where = "studies.scoring"
        known_models(config, where, block["models"])
        known_selectors(where, block["selectors"],
                        [s for s in selector_names() if {"k", "q"} <= set(get_selector(s).variants)],
                        lambda info: f"has no keys-only/queries-only variants (variants: "
                                     f"{', '.join(sorted(info.variants))})")
        for model in block["models"]:
            try:
                check_reduction(config, model, block["pct"])
            except ConfigError as e:
                raise ConfigError(f"{where}: {e}") from None
        return [(m, method, float(block["pct"])) for m, _, _, method in _cells(block)]

    def inputs(self, config, block, cells):
        return {"summaries": summary_paths(cells)}

    def frames(self, inputs, params):
        from statereduce.analysis.tables import cells_frame

        cells = [{"model": m, "selector": s, "variant": v, "method": method, "pct": float(params["pct"])}
                 for m, s, v, method in _cells(params)]
        df = cells_frame(cells, [read_json(p) for p in inputs["summaries"]], params["models"])
        return {"scoring_ablation": (df, markdown(df, params))}


def _cells(block: dict) -> list[tuple[str, str, str, str]]:
    """(model, selector, variant, method token) of every cell, in table order."""
    return [(m, s, v, format_method(MethodSpec(s, variant=v))) for m in block["models"] for s in block["selectors"]
            for v, _ in SCORING]


def markdown(df, block: dict) -> str:
    """Table 16 layout: rows selector (and the baseline), columns K,Q / K / Q per model; pre- and post-RFT blocks; the
    baseline row repeats the model's unpruned value in its three columns; ``–`` where a value was never computed."""
    from statereduce.analysis.tables import MISSING, STAGE_LABELS, STAGES, fmt, metric_values

    models = block["models"]
    notes = {m: metric_values(df, m) for m in models}
    texts = [notes[m][0] for m in models]
    metric_line = texts[0] if len(set(texts)) == 1 else "; ".join(f"{m}: {t}" for m, t in zip(models, texts))
    parts = [
        "# Scoring from keys only, queries only, or both (paper Table 16)\n\n",
        (f"Channels selected at {format_pct(block['pct'])}% of key channels removed from scores of keys and queries "
         "(K,Q; the default), keys only (K, method token `<selector>-k`) or queries only (Q, `<selector>-q`). "
         f"Metric: {metric_line}. {MISSING} = not computed.\n"),
    ]
    head = "| method | " + " | ".join(f"{m} {label}" for m in models for _, label in SCORING) + " |"
    sep = "|" + " --- |" * (1 + 3 * len(models))
    for stage in STAGES:
        lines = [head, sep]
        for s in block["selectors"]:
            lines.append(f"| {s} | " + " | ".join(fmt(notes[m][1].get((s, v, stage))) for m in models
                                                  for v, _ in SCORING) + " |")
        base = [fmt(notes[m][1].get(("baseline", "", "unpruned"))) for m in models for _ in SCORING]
        lines.append("| baseline | " + " | ".join(base) + " |")
        parts.append(f"\n## {STAGE_LABELS[stage]}\n\n" + "\n".join(lines) + "\n")
    return "".join(parts)
