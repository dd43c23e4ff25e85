"""Calibration sensitivity (paper Tables 2 and 7): each selector under each calibration variant (corpus, sample
count, seed) at one ratio, pre- and post-RFT. Block ``studies.calibration``; cells are summaries, method tokens
``<selector>.<variant>`` (``default``: the plain token)."""

from __future__ import annotations

from statereduce.common.layout import MethodSpec, format_method, format_pct
from statereduce.common.settings import CalibrationSettings
from statereduce.config.blocks import ConfigError, check_reduction, model_calibration
from statereduce.core.runtime import read_json
from statereduce.studies.base import (
    KEY, Study, Table, known_models, known_selectors, register, summary_paths, unique_list,
)

#: Selector needs that depend on the calibration data (a selector needing none of them ignores the calibration).
CALIBRATION_NEEDS = frozenset({"activations", "xnorm", "grad"})


def calibration_label(settings: CalibrationSettings | dict, default: CalibrationSettings | dict | None = None) -> str:
    """Row label of a calibration as in the paper's Table 7: ``corpus, n=N, seed S``, plus ``key=value`` for any
    other setting that differs from ``default`` (the model's own calibration).

    Args:
        settings: the calibration (:func:`statereduce.config.model_calibration`, or its ``to_dict()`` as the
            table job's params carry it).
        default: the model's default calibration, to show only what a variant changes beyond the three axes.
    """
    settings, default = (s.to_dict() if isinstance(s, CalibrationSettings) else s for s in (settings, default))
    label = f"{settings.get('corpus')}, n={settings.get('n_samples')}, seed {settings.get('seed')}"
    other = sorted(k for k in settings if k not in ("corpus", "n_samples", "seed", "batch_size")
                   and default is not None and settings[k] != default.get(k))
    return label + "".join(f", {k}={settings[k]}" for k in other)


@register
class CalibrationStudy(Study):
    name = "calibration"
    rule = "calibration_study"
    doc = ("Calibration sensitivity (paper Tables 2/7), pre- and post-RFT, from the summaries of the cells of "
           "studies.calibration; with its HTML page for the report.")
    schema = {
        "type": "object",
        "additionalProperties": False,
        "description": "paper Tables 2/7: each selector under each calibration variant",
        "required": ["models", "selectors", "variants", "pct"],
        "properties": {
            "models": unique_list(),
            "selectors": unique_list(description="selectors that read calibration data"),
            "variants": unique_list(KEY, "'default' (the model's own calibration) or keys of calibrations"),
            "pct": {"$ref": "#/$defs/pct"},
        },
    }
    tables = (Table("calibration_study", "calibration sensitivity (Tables 2, 7)", """
**Calibration sensitivity** (paper Tables 2 and 7): each selector of ``studies.calibration`` at one ratio,
calibrated on each variant: ``default`` (the model's own calibration) and the named ``calibrations`` that change
the corpus, the sample count n or the sampling seed. Per model, rows are the variants (labelled corpus, n, seed),
columns the selectors; the pre-RFT block is the paper's setting, the post-RFT block follows recovery fine-tuning.
The metric is the comparison table's first (held-out bits per byte on the tiny models, WikiText-2 perplexity on
the paper's). Only selectors that read calibration data take part: rand and L1 select the same channels under
every variant. "–" marks a value that was not computed; nothing is filled in. The long CSV is
``results/tables/calibration_study.csv``.
"""),)

    def cells(self, config, block):
        """Each model × selector × variant at ``pct``; only selectors that read calibration data (a weight-only
        selector, rand or l1, keeps the same channels under every variant)."""
        from statereduce.selectors import get_selector, selector_names

        where = "studies.calibration"
        known_models(config, where, block["models"])
        known_selectors(where, block["selectors"],
                        [s for s in selector_names() if get_selector(s).needs & CALIBRATION_NEEDS],
                        lambda info: f"reads no calibration data (needs: {', '.join(sorted(info.needs))}), so every "
                                     "variant keeps the same channels")
        valid = ["default", *sorted(config.get("calibrations", {}))]
        for v in block["variants"]:
            if v not in valid:
                raise ConfigError(f"{where}.variants: unknown calibration {v!r}; valid: {', '.join(valid)}")
        for model in block["models"]:
            try:
                check_reduction(config, model, block["pct"])
                for v in block["variants"]:
                    model_calibration(config, model, v)
            except ConfigError as e:
                raise ConfigError(f"{where}: {e}") from None
        return [(m, format_method(MethodSpec(s, calib=v)), float(block["pct"])) for m in block["models"]
                for s in block["selectors"] for v in block["variants"]]

    def inputs(self, config, block, cells):
        return {"summaries": summary_paths(cells)}

    def params(self, config, block, cells):
        """The block, and model -> variant -> calibration settings (the row labels)."""
        calibrations = {m: {v: model_calibration(config, m, v).to_dict() for v in block["variants"]}
                        for m in block["models"]}
        return {"block": block, "calibrations": calibrations}

    def frames(self, inputs, params):
        from statereduce.analysis.tables import cells_frame

        block = params["block"]
        labels = {m: {v: calibration_label(s, by_variant.get("default")) for v, s in by_variant.items()}
                  for m, by_variant in params["calibrations"].items()}
        cells = [{"model": m, "selector": s, "variant": v, "method": format_method(MethodSpec(s, calib=v)),
                  "pct": float(block["pct"]), "calibration": labels.get(m, {}).get(v, v)}
                 for m in block["models"] for s in block["selectors"] for v in block["variants"]]
        df = cells_frame(cells, [read_json(p) for p in inputs["summaries"]], block["models"])
        return {"calibration_study": (df, markdown(df, block))}


def markdown(df, block: dict) -> str:
    """Tables 2/7 layout per model: rows calibration variant, columns selector; a pre-RFT block (the paper's) and a
    post-RFT block; ``–`` where a value was never computed."""
    from statereduce.analysis.tables import MISSING, STAGE_LABELS, STAGES, fmt, metric_values

    parts = [
        "# Calibration sensitivity (paper Tables 2 and 7)\n\n",
        (f"Each selector at {format_pct(block['pct'])}% of key channels removed, calibrated on each variant (corpus, "
         "sample count n, seed; the model's own calibration is `default`). Pre-RFT is the paper's setting; post-RFT "
         f"follows recovery fine-tuning. {MISSING} = not computed.\n"),
    ]
    for model in block["models"]:
        note, values = metric_values(df, model)
        sub = df[(df["model"] == model) & (df["stage"] != "unpruned")]
        label = dict(zip(sub["variant"], sub["calibration"]))
        parts.append(f"\n## {model}: {note}\n\nbaseline (unpruned): {fmt(values.get(('baseline', '', 'unpruned')))}\n")
        for stage in STAGES:
            lines = ["| variant | calibration | " + " | ".join(block["selectors"]) + " |",
                     "|" + " --- |" * (len(block["selectors"]) + 2)]
            for v in block["variants"]:
                cells = [fmt(values.get((s, v, stage))) for s in block["selectors"]]
                lines.append(f"| {v} | {label.get(v, v)} | " + " | ".join(cells) + " |")
            parts.append(f"\n### {STAGE_LABELS[stage]}\n\n" + "\n".join(lines) + "\n")
    return "".join(parts)
