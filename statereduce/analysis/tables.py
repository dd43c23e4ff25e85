"""Comparison tables from result files (Markdown and CSV). A missing cell is shown as missing.

The Markdown names the CPU kind the evaluations ran on, gives an overview per ratio (method × model, pre → post
RFT, with the step RFT kept), then follows the paper's Table 20 (pruned models before and after recovery
fine-tuning, RFT, side by side, with the unpruned baseline in both column groups) and Table 21 (every compression
ratio, pre- and post-RFT). Values carry ± their standard errors where lm-eval gives them. The CSV is long: one row
per (model, method, pct, stage) with every metric.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pandas as pd

from statereduce.common.layout import format_pct, parse_token
from statereduce.core.runtime import cpu_kind, json_number, write_text_atomic
from statereduce.eval.suites import local_tasks, suite_stderr, suite_summary

PRIMARY = ("heldout", "bits_per_byte")  # (task, metric) shown first when present
# Metrics the Markdown table shows, when present: byte-level models on the embedded corpus are compared
# in bits per byte; WikiText-2 word perplexity is the paper's headline number for hub models. The held-out word
# perplexity is left out: on source code it is dominated by rare long "words" (tens of millions for a tiny model
# whose bits per byte are fine). The CSV keeps every metric.
TABLE_METRICS = ("heldout/bits_per_byte", "wikitext/word_perplexity",
                 "lambada_openai/perplexity", "lm/lm_avg", "recall/niah_2048", "recall/niah_4096", "recall/squad",
                 "recall/swde", "recall_probe/recall_mqar_avg")
STDERR = "_stderr"  # suffix of a standard-error column (lm-eval's: ``acc`` -> ``acc_stderr``)
# Per-cell RFT provenance (a summary's top-level ``"rft"`` block: the validation pass whose checkpoint was kept),
# as columns of the frame's ``rft`` rows: column -> key of the block.
RFT_COLUMNS = {"rft_steps": "steps", "rft_kept_step": "kept_step", "rft_val_metric": "metric",
               "rft_val_loss_start": "val_loss_start", "rft_val_loss_kept": "val_loss_kept"}
#: How the RFT table names a validation metric (``rft.best_metric``)
VAL_METRICS = {"ce": "cross entropy", "loss": "loss"}
# Suite averages (eval.json "suites" blocks, statereduce.eval.suites) enter the frame as "<suite>/<summary>" columns:
# "lm/lm_avg" is the paper's "LM Evals avg" (Table 20), the recall ones its Table 4/11 columns.
# Metric names (the part after "task/") ending in one of these are lower-is-better; "acc*" higher-is-better.
LOWER_IS_BETTER = ("perplexity", "bits_per_byte", "loss")
STAGES = ("pruned", "rft")  # summary stages, in table order: pre-RFT, post-RFT
MISSING = "–"  # shown for a value that was never computed; nothing is invented


def _metric_columns(metrics: dict) -> list[tuple[str, str]]:
    cols = [(t, m) for t, ms in metrics.items() for m in ms]
    return sorted(cols, key=lambda c: (c != PRIMARY, c))


def comparison_frame(summaries: list[dict], baselines: dict[str, dict]) -> pd.DataFrame:
    """Long frame: one row per (model, method, pct, stage) plus one baseline row per model.

    Args:
        summaries: the summary documents (``results/{model}/{method}_{pct}/eval.json``); each gives a
            ``"pruned"`` row and, when its ``metrics.rft`` slot is not null, an ``"rft"`` row.
        baselines: model -> baseline eval document (``results/{model}/baseline/eval.json``); its row has
            method ``"baseline"``, pct 0 and stage ``"unpruned"``.

    Returns:
        Columns ``model, method, pct, stage``, one column ``task/metric`` per metric seen (NaN where a row
        lacks it; lm-eval's standard errors are ``task/metric_stderr``), one ``suite/summary`` column per suite
        average and, where its items carry standard errors, ``suite/summary_stderr``
        (:func:`statereduce.eval.suites.suite_stderr`), ``state_bytes``, and on ``rft`` rows of summaries with an
        ``"rft"`` block the :data:`RFT_COLUMNS` (step kept of how many, validation loss before RFT and kept);
        sorted by model, pct, stage, method. Raises ``ValueError`` if two documents give the same (model, method,
        pct, stage).
    """
    rows = []
    for model, doc in baselines.items():
        row = {"model": model, "method": "baseline", "pct": 0, "stage": "unpruned"}
        for (t, m), v in flat_metrics(doc.get("metrics", {})).items():
            row[f"{t}/{m}"] = v
        row.update(suite_columns(doc.get("suites")))
        row.update(_suite_stderr_columns(doc.get("suites"), doc.get("metrics") or {}))
        row["state_bytes"] = doc.get("state", {}).get("state_bytes_per_sequence")
        rows.append(row)
    for s in summaries:
        for stage in STAGES:
            metrics = (s.get("metrics") or {}).get(stage)
            if metrics is None:
                continue
            row = {"model": s["model"], "method": s["method"], "pct": s["pct"], "stage": stage}
            for (t, m), v in flat_metrics(metrics).items():
                row[f"{t}/{m}"] = v
            suites = (s.get("suites") or {}).get(stage)
            row.update(suite_columns(suites))
            row.update(_suite_stderr_columns(suites, metrics))
            row["state_bytes"] = (s.get("state") or {}).get("bytes_after")
            if stage == "rft" and isinstance(s.get("rft"), dict):
                row.update({col: s["rft"].get(key) for col, key in RFT_COLUMNS.items()})
            rows.append(row)
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    keys = ["model", "method", "pct", "stage"]
    dup = df[df.duplicated(keys, keep=False)]
    if not dup.empty:
        raise ValueError(
            f"several result documents for {dup[keys].drop_duplicates().values.tolist()}; "
            "expected one per (model, method, pct, stage)"
        )
    return df.sort_values(["model", "pct", "stage", "method"], kind="stable").reset_index(drop=True)


def suite_columns(suites: dict | None) -> dict[str, float]:
    """``{suite: {summary: value}}`` as ``{"suite/summary": value}``; a None value (task not run) stays missing."""
    return {f"{suite}/{name}": float(v) for suite, block in (suites or {}).items() for name, v in (block or {}).items()
            if v is not None}


def _suite_stderr_columns(suites: dict | None, metrics: dict) -> dict[str, float]:
    """``{"suite/summary_stderr": se}`` for every suite average of ``suites`` whose items all carry a standard error
    in ``metrics`` (:func:`statereduce.eval.suites.suite_stderr`); none where one lacks it, or where the average
    recomputed from ``metrics`` is not the recorded one (the items would not be the averaged ones)."""
    out = {}
    for suite, block in (suites or {}).items():
        tasks = local_tasks(suite, metrics)
        means, ses = suite_summary(suite, metrics, tasks), suite_stderr(suite, metrics, tasks)
        for name, value in (block or {}).items():
            mean, se = means.get(name), ses.get(name)
            if value is not None and mean is not None and se is not None and math.isclose(mean, value, rel_tol=1e-9):
                out[f"{suite}/{name}{STDERR}"] = se
    return out


def flat_metrics(metrics: dict) -> dict[tuple[str, str], float]:
    return {(t, m): v for t, ms in metrics.items() for m, v in ms.items()}


def metric_direction(metric: str) -> str:
    """``"lower is better"``, ``"higher is better"`` or ``""`` (unknown) for a ``task/metric`` name."""
    name = metric.rsplit("/", 1)[-1]
    if name.endswith(LOWER_IS_BETTER):
        return "lower is better"
    if name.startswith("acc") or name.endswith("_avg") or metric.split("/", 1)[0] == "recall":
        return "higher is better"  # accuracies, suite averages of accuracies, recall scores
    return ""


def _lookup(df: pd.DataFrame, metric: str) -> dict[tuple, float]:
    """(model, method, pct, stage) -> value of ``metric``, only where it was computed; empty if no such column."""
    if metric not in df.columns:
        return {}
    sub = df.dropna(subset=[metric])
    return {(r.model, r.method, float(r.pct), r.stage): v for r, v in zip(sub.itertuples(), sub[metric])}


def _layout(df: pd.DataFrame, metric: str) -> tuple[list[str], dict[str, list[str]], list[float]]:
    """Models with any value of ``metric``, their pruning methods (every method with a summary, sorted) and
    the pruned pcts of those models (sorted). Every (model, method) appears in every pct block, so a result
    that was never computed shows as missing instead of silently dropping its row."""
    models = sorted(df.loc[df[metric].notna(), "model"].unique())
    pruned = df[df["model"].isin(models) & (df["stage"] != "unpruned")]
    methods = {m: sorted(pruned.loc[pruned["model"] == m, "method"].unique()) for m in models}
    pcts = sorted({float(p) for p in pruned["pct"]})
    return models, methods, pcts


def stage_markdown(df: pd.DataFrame, metric: str, pct: float) -> str:
    """Table 20-style block for one compression ratio: pre- and post-RFT side by side.

    Args:
        df: the frame of :func:`comparison_frame`.
        metric: a ``task/metric`` column of ``df``.
        pct: percent of key channels removed.

    Returns:
        ``| model | method | pre-RFT | post-RFT | Δ (post − pre) |`` rows; per model the baseline first
        (its value in both columns, Δ missing: it is not fine-tuned), then every method of that model.
        A value never computed (RFT not run, pct not run for that method) is ``–``, and so is its Δ. Where
        ``df`` has the metric's standard error (``metric_stderr``), every value carries ``± se`` and a Δ the
        two standard errors combined as independent.
    """
    values, ses = _lookup(df, metric), _lookup(df, metric + STDERR)
    models, methods, _ = _layout(df, metric)
    lines = ["| model | method | pre-RFT | post-RFT | Δ (post − pre) |", "| --- | --- | --- | --- | --- |"]
    for model in models:
        key = (model, "baseline", 0.0, "unpruned")
        base = _cell(values.get(key), ses.get(key))
        lines.append(f"| {model} | baseline | {base} | {base} | {MISSING} |")
        for method in methods[model]:
            keys = [(model, method, float(pct), s) for s in STAGES]
            pre, post = (values.get(k) for k in keys)
            se_pre, se_post = (ses.get(k) for k in keys)
            delta = post - pre if pre is not None and post is not None else None
            se = math.hypot(se_pre, se_post) if se_pre is not None and se_post is not None else None
            lines.append(f"| {model} | {method} | {_cell(pre, se_pre)} | {_cell(post, se_post)} | "
                         f"{_cell(delta, se, signed=True)} |")
    return "\n".join(lines) + "\n"


def ratios_markdown(df: pd.DataFrame, metric: str, model: str) -> str:
    """Table 21-style block for one model: rows (RFT, method), columns every pct; baseline in a lead line.

    Args:
        df: the frame of :func:`comparison_frame`.
        metric: a ``task/metric`` column of ``df``.
        model: a model of ``df``.

    Returns:
        The lead line and a table with pre-RFT rows, then post-RFT rows; ``–`` where never computed; ``± se``
        where ``df`` has the metric's standard error.
    """
    values, ses = _lookup(df, metric), _lookup(df, metric + STDERR)
    _, methods, pcts = _layout(df[df["model"] == model], metric)
    key = (model, "baseline", 0.0, "unpruned")
    lines = [f"baseline (0% removed): {_cell(values.get(key), ses.get(key))}\n"]
    lines.append("| RFT | method | " + " | ".join(f"{format_pct(p)}% removed" for p in pcts) + " |")
    lines.append("|" + " --- |" * (len(pcts) + 2))
    for stage, label in zip(STAGES, ("pre", "post")):
        for method in methods.get(model, []):
            cells = [_cell(values.get((model, method, p, stage)), ses.get((model, method, p, stage))) for p in pcts]
            lines.append(f"| {label} | {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def comparison_markdown(df: pd.DataFrame, metric: str = "/".join(PRIMARY)) -> str:
    """One metric's section: a pre/post-RFT block per pct (all models), then, where more than one pct was run, an
    all-ratios block per model.

    Args:
        df: the frame of :func:`comparison_frame`.
        metric: a ``task/metric`` column of ``df``.

    Returns:
        Markdown starting with a ``## metric`` heading; a one-line note if no row has ``metric``.
    """
    direction = metric_direction(metric)
    head = f"## {metric}" + (f" ({direction})" if direction else "") + "\n\n"
    if df.empty or metric not in df.columns or df[metric].isna().all():
        return head + f"_no results with metric `{metric}`_\n"
    models, _, pcts = _layout(df, metric)
    parts = [head]
    for pct in pcts:
        parts.append(f"### {removed_label(df, pct)}\n\n{stage_markdown(df, metric, pct)}\n")
    if len(pcts) > 1:  # with one ratio the block per model would repeat the one above
        for model in models:
            parts.append(f"### {model}, every ratio\n\n{ratios_markdown(df, metric, model)}\n")
    return "".join(parts)


#: Lead lines of the overview tables, by metric (others: the metric's name)
METRIC_LABELS = {
    "heldout/bits_per_byte": "Held-out bits per byte",
    "wikitext/word_perplexity": "WikiText-2 word perplexity",
    "lm/lm_avg": "Mean zero-shot accuracy (the paper's LM Evals avg)",
    "recall_probe/recall_mqar_avg": "Recall probe: mean accuracy over its levels",
}
def removed_label(df, pct: float) -> str:
    """What a pct removes in the rows of ``df`` at it: ``"50% of key channels removed"`` where every method cuts keys;
    with value (``-v``) or joint (``-kv``) cuts among them, what each removes."""
    methods = set(df.loc[df["pct"] == pct, "method"]) if {"pct", "method"} <= set(df.columns) else set()
    cuts = set()
    for m in methods:
        try:
            cuts.add(parse_token(str(m)).cut)
        except ValueError:  # the baseline's row
            pass
    if cuts <= {"keys"}:
        return f"{format_pct(pct)}% of key channels removed"
    return (f"{format_pct(pct)}% removed (of the key channels; -v: of the value channels; -kv: of the state, split "
            "between keys and values)")


OVERVIEW = "Overview"  # heading of the overview sections: ``## Overview: N% of key channels removed``


def overview_metrics(df: pd.DataFrame) -> list[str]:
    """The metrics of the overview: the first of :data:`TABLE_METRICS` with a value, and the first recall metric
    (``recall/…`` or ``recall_probe/…``) with one."""
    present = [m for m in TABLE_METRICS if m in df.columns and df[m].notna().any()]
    recall = [m for m in present if m.split("/", 1)[0] in ("recall", "recall_probe")]
    return list(dict.fromkeys(present[:1] + recall[:1]))


def overview_markdown(df: pd.DataFrame, pct: float, metrics: list[str] | None = None) -> str:
    """Wide tables of one ratio: per metric a row per method (the baseline first) and a column per model, cells
    ``pre-RFT → post-RFT`` (``± se`` where the frame has the metric's standard error); then, where summaries
    carry RFT provenance, the step RFT kept (:func:`rft_markdown`).

    Args:
        df: the frame of :func:`comparison_frame`.
        pct: percent of key channels removed.
        metrics: the metrics (default: :func:`overview_metrics`).
    """
    parts = []
    for metric in overview_metrics(df) if metrics is None else metrics:
        values, ses = _lookup(df, metric), _lookup(df, metric + STDERR)
        models, methods, _ = _layout(df, metric)
        direction = metric_direction(metric)
        label = METRIC_LABELS.get(metric, f"`{metric}`") + (" ± standard error" if ses else "")
        lines = [f"{label} ({direction + ', ' if direction else ''}pre-RFT → post-RFT):", "",
                 "| method | " + " | ".join(models) + " |", "|" + " --- |" * (len(models) + 1)]
        bases = [(m, "baseline", 0.0, "unpruned") for m in models]
        lines.append("| baseline | " + " | ".join(_cell(values.get(k), ses.get(k)) for k in bases) + " |")
        for method in sorted(set().union(*methods.values())):
            cells = []
            for model in models:
                pre, post = ((model, method, float(pct), s) for s in STAGES)
                if pre not in values and post not in values:
                    cells.append(MISSING)
                else:
                    cells.append(f"{_cell(values.get(pre), ses.get(pre))} → {_cell(values.get(post), ses.get(post))}")
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        parts.append("\n".join(lines) + "\n")
    rft = rft_markdown(df, pct)
    return "\n".join(parts + ([rft] if rft else []))


def rft_markdown(df: pd.DataFrame, pct: float) -> str:
    """The checkpoint RFT kept, per method (rows) and model (columns) at one ratio: ``k of N (start → kept)``, the
    optimizer step of the kept validation pass of N steps and the validation loss (the metric RFT compared, e.g.
    cross entropy) before RFT and at the kept step;
    ``–`` where a summary has no RFT provenance. Empty when none has any."""
    col = "rft_kept_step"
    if col not in df.columns:
        return ""
    sub = df[(df["stage"] == "rft") & (df["pct"].astype(float) == float(pct))]
    if sub[col].isna().all():
        return ""
    models = sorted(sub["model"].unique())
    cells = {(r["model"], r["method"]): r for r in sub.to_dict("records")}
    names = set(sub.loc[sub[col].notna(), "rft_val_metric"].dropna()) if "rft_val_metric" in sub.columns else set()
    metric = VAL_METRICS.get(next(iter(names)), next(iter(names))) if len(names) == 1 else "loss"
    lines = [f"RFT: step kept of N, 0 being the pruned model itself (validation {metric} before RFT → at the kept "
             "step):", "",
             "| method | " + " | ".join(models) + " |", "|" + " --- |" * (len(models) + 1)]
    for method in sorted(sub["method"].unique()):
        row = []
        for model in models:
            r = cells.get((model, method))
            if r is None or pd.isna(r.get(col)):
                row.append(MISSING)
                continue
            text = f"{int(r[col])} of {MISSING if pd.isna(r.get('rft_steps')) else int(r['rft_steps'])}"
            start, kept = r.get("rft_val_loss_start"), r.get("rft_val_loss_kept")
            if not (pd.isna(start) or pd.isna(kept)):
                text += f" ({start:.3f} → {kept:.3f})"
            row.append(text)
        lines.append(f"| {method} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def fmt(v) -> str:
    if v is None or pd.isna(v):
        return MISSING  # missing, never invented
    return f"{v:.3f}" if abs(v) < 1000 else f"{v:.1f}"


def fmt_delta(v) -> str:
    """As :func:`fmt`, with an explicit ``+`` on a positive difference."""
    text = fmt(v)
    return f"+{text}" if v is not None and v > 0 else text


def _cell(v, se=None, signed: bool = False) -> str:
    """A value as :func:`fmt` (:func:`fmt_delta` if ``signed``), with ``± se`` when both are known."""
    text = fmt_delta(v) if signed else fmt(v)
    return text if text == MISSING or se is None or pd.isna(se) else f"{text} ± {se:.3f}"


HEADER = (
    "# Pruned models against their baseline, before and after recovery fine-tuning (RFT)\n\n"
    "Pre-RFT: the pruned model; post-RFT: after recovery fine-tuning; Δ = post-RFT − pre-RFT. "
    "The baseline (unpruned, not fine-tuned) shows its value in both columns. "
    "± is a standard error: lm-eval's for one task; sqrt(Σ se²) / n for the mean of n tasks; for a Δ both "
    "standard errors combined as independent (both stages score the same documents, so this overstates it). "
    f"{MISSING} = not computed (e.g. RFT not run).\n\n"
)
MADE_ON = "Made on: "  # the line that names the CPU kind the numbers were made on (:func:`made_on_line`)


def _doc_cpus(summaries: list[dict], baselines: dict[str, dict]) -> list[str]:
    """The CPU kinds the documents record (``versions.cpu`` of their provenance), sorted."""
    found = set()
    for doc in baselines.values():
        found.add(((doc.get("provenance") or {}).get("versions") or {}).get("cpu"))
    for s in summaries:
        prov = s.get("provenance") or {}
        found.add((prov.get("versions") or {}).get("cpu"))
        for ev in (prov.get("evals") or {}).values():
            found.add(((ev or {}).get("versions") or {}).get("cpu"))
    return sorted(c for c in found if c)


def torch_cpu_capability() -> str | None:
    """torch's CPU capability on this machine (``"AVX512"``, ``"AVX2"``, ...: the kernels it picks), if torch runs."""
    try:
        import torch

        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # noqa: BLE001 - provenance only; the table is written without it
        return None


def made_on_line(summaries: list[dict], baselines: dict[str, dict]) -> str:
    """``Made on: <CPU kinds the documents record>[, torch CPU capability <X>].`` The capability is this process's,
    given only when the documents name one CPU kind and it is this machine's
    (:func:`statereduce.core.runtime.cpu_kind`);
    torch, MKL and oneDNN pick their kernels by it, so the trained numbers depend on it (README, "The same numbers
    on another CPU")."""
    cpus = _doc_cpus(summaries, baselines)
    line = MADE_ON + ("; ".join(cpus) if cpus else "CPU not recorded")
    cap = torch_cpu_capability() if cpus == [cpu_kind()] else None
    return line + (f", torch CPU capability {cap}" if cap else "") + "."


def parse_made_on(md: str) -> tuple[list[str], str | None] | None:
    """(CPU kinds, torch CPU capability or None) from the :data:`MADE_ON` line of a comparison Markdown; None
    without one."""
    for line in md.splitlines():
        if line.startswith(MADE_ON):
            m = re.fullmatch(r"(.*?)(?:, torch CPU capability (\S+))?\.", line[len(MADE_ON):])
            if m is None:
                return None
            kinds = [] if m.group(1) == "CPU not recorded" else m.group(1).split("; ")
            return kinds, m.group(2)
    return None


def comparison_document(df: pd.DataFrame, made_on: str | None = None) -> str:
    """The whole ``comparison.md``: :data:`HEADER`, what it shows, the :data:`MADE_ON` line, an overview per ratio
    (:func:`overview_markdown`), then a section per metric of :data:`TABLE_METRICS` present
    (:func:`comparison_markdown`)."""
    present = [m for m in TABLE_METRICS if m in df.columns and df[m].notna().any()]
    shown = ", ".join(f"`{m}`" for m in present) or "no metric"
    left = "heldout/word_perplexity" in df.columns
    note = (f"Shown: {shown}; `comparison.csv` holds every metric of the evaluations" +
            (" (also `heldout/word_perplexity`, left out here: on source code it is dominated by rare long "
             "\"words\")" if left else "") + ".\n")
    parts = [HEADER, note, "\n" + made_on + "\n" if made_on else "", "\n"]
    if present:
        _, _, pcts = _layout(df, present[0])
        for pct in pcts:
            parts.append(f"## {OVERVIEW}: {removed_label(df, pct)}\n\n"
                         f"{overview_markdown(df, pct)}\n")
    parts.append("\n".join(comparison_markdown(df, m).rstrip("\n") + "\n" for m in present or ["/".join(PRIMARY)]))
    return "".join(parts)


def write_comparison(
    summaries: list[dict], baselines: dict[str, dict], md_path: str | Path, csv_path: str | Path
) -> pd.DataFrame:
    """Write ``comparison.md`` (:func:`comparison_document`, with the CPU kind the documents were made on) and
    ``comparison.csv``.

    Args:
        summaries: the summary documents, as for :func:`comparison_frame`.
        baselines: model -> baseline eval document.
        md_path: where the Markdown goes.
        csv_path: where the long CSV (every metric, one row per model, method, pct, stage) goes.

    Returns:
        The frame of :func:`comparison_frame`.
    """
    df = comparison_frame(summaries, baselines)
    write_text_atomic(md_path, comparison_document(df, made_on_line(summaries, baselines)))
    write_text_atomic(csv_path, df.to_csv(index=False))
    return df


# ---- rank analysis (paper Tables 5 and 6, App. C.2) ----------------------------------------------------------
def rank_frames(
    ranks: dict[tuple[str, str, float], dict], baselines: dict[str, dict]
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Table 5 (per-head rank utilization) and Table 6 (conditioning of the selected [Q; K] columns) as frames.

    Args:
        ranks: (model, method, pct) -> ``rank.json`` of the pruned model.
        baselines: model -> the baseline's ``rank.json``.

    Returns:
        (utilization: one row per (model, method, pct) with d_k, mean, std, min, max of the per-head mean
        utilization and rho = Pearson correlation with the baseline's per-head utilization; conditioning: one row
        per (model, method, pct) with the per-head medians of sigma_min, sigma_max and kappa). Baseline rows have
        method ``baseline`` and pct 0; a value a document lacks is NaN, shown as missing.
    """
    util, cond = [], []
    items = [((m, "baseline", 0.0), doc) for m, doc in baselines.items()] + list(ranks.items())
    for (model, method, pct), doc in items:
        u = (doc.get("summary") or {}).get("u") or {}
        rho = 1.0 if method == "baseline" else json_number(doc.get("pearson_u"))
        key = {"model": model, "method": method, "pct": pct, "d_k": (doc.get("model") or {}).get("d_k")}
        util.append({**key, **{s: json_number(u.get(s)) for s in ("mean", "std", "min", "max")}, "rho": rho})
        med = (doc.get("conditioning") or {}).get("median") or {}
        cond.append({**key, **{s: json_number(med.get(s)) for s in ("sigma_min", "sigma_max", "kappa")}})
    order = ["model", "pct", "method"]
    return (
        pd.DataFrame(util).sort_values(order, kind="stable").reset_index(drop=True),
        pd.DataFrame(cond).sort_values(order, kind="stable").reset_index(drop=True),
    )


def overlap_frame(selections: dict[tuple[str, str, float], dict], d_k: dict[str, int]) -> pd.DataFrame:
    """Median per-head overlap of kept channels between every two methods of a (model, pct) (paper App. C.2).

    Args:
        selections: (model, method, pct) -> {layer: [H][d_k']} kept indices
            (:func:`statereduce.core.selection_file.read_selection`); transform selections are left out.
        d_k: model -> head size before pruning.

    Returns:
        One row per (model, pct, method_a, method_b): d_k', median shared channels, median fraction and the
        random-selection expectation d_k'^2 / d_k.
    """
    from statereduce.selectors.overlap import keep_overlap

    rows = []
    groups: dict[tuple[str, float], dict[str, dict]] = {}
    for (model, method, pct), keep in selections.items():
        if any(np.asarray(heads).dtype.kind == "f" for heads in keep.values()):
            continue  # a transform selection (pca) keeps no channel subset: no overlap to count
        groups.setdefault((model, pct), {})[method] = keep
    for (model, pct), by_method in sorted(groups.items()):
        names = sorted(by_method)
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                ov = keep_overlap(by_method[a], by_method[b], d_k[model])
                rows.append(
                    {
                        "model": model,
                        "pct": pct,
                        "method_a": a,
                        "method_b": b,
                        **{k: ov[k] for k in ("median_shared", "median_fraction", "random_shared")},
                        "d_k_new": _widths_text(ov["d_k_new"]),
                    }
                )
    return pd.DataFrame(rows)


def _widths_text(d_k_new) -> int | str:
    """An overlap's kept width: the int of a single width, else ``layer:width`` per layer (``a/b`` where the two
    selections keep different widths in that layer)."""
    if not isinstance(d_k_new, dict):
        return d_k_new
    return " ".join(f"{layer}:{'/'.join(map(str, w)) if isinstance(w, (list, tuple)) else w}"
                    for layer, w in sorted(d_k_new.items(), key=lambda kv: int(kv[0])))


def _md_table(df: pd.DataFrame, cols: list[str]) -> list[str]:
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for _, r in df.iterrows():
        cells = [
            str(r[c])
            if isinstance(r[c], str)
            else (format_pct(r[c]) if c in ("pct", "d_k", "d_k_new") and not pd.isna(r[c]) else fmt(r[c]))
            for c in cols
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def write_rank_tables(
    ranks: dict[tuple[str, str, float], dict],
    baselines: dict[str, dict],
    selections: dict[tuple[str, str, float], dict],
    out_dir: str | Path,
) -> dict[str, pd.DataFrame]:
    """Write ``rank_utilization``, ``conditioning`` and ``overlap`` (``.md`` and ``.csv``) into ``out_dir``."""
    util, cond = rank_frames(ranks, baselines)
    d_k = {m: int(doc["model"]["d_k"]) for m, doc in baselines.items()}
    over = overlap_frame(selections, d_k)
    texts = {
        "rank_utilization": (
            (
                "# Per-head rank utilization of the recurrent state (paper Table 5; pre-RFT)\n\n"
                "u = er(S) / min(d_v, d_k), er(S) = ||S||_F^2 / ||S||_2^2, averaged per head over held-out positions; "
                "mean/std/min/max over all (layer, head); rho = Pearson correlation of the per-head means with the "
                "baseline's.\n\n"
            ),
            util,
            ["model", "method", "pct", "d_k", "mean", "std", "min", "max", "rho"],
        ),
        "conditioning": (
            (
                "# Selected key/query subspace (paper Table 6)\n\n"
                "Per-head medians over the kept columns of the calibration matrix [Q; K]; kappa is the median of "
                "the per-head ratios.\n\n"
            ),
            cond,
            ["model", "method", "pct", "d_k", "sigma_min", "sigma_max", "kappa"],
        ),
        "overlap": (
            (
                "# Kept-channel overlap between selectors (paper App. C.2)\n\n"
                "Median over heads of the channels two methods both keep; random: the expectation d_k'^2 / d_k for "
                "independent uniform selections (k_a k_b / d_k per head, median over heads, where layers keep "
                "different widths: d_k_new is then layer:width).\n\n"
            ),
            over,
            ["model", "pct", "method_a", "method_b", "d_k_new", "median_shared", "median_fraction", "random_shared"],
        ),
    }
    out_dir = Path(out_dir)
    frames = {}
    for name, (head, df, cols) in texts.items():
        body = "\n".join(_md_table(df, cols)) if not df.empty else f"_no {name} results_"
        write_text_atomic(out_dir / f"{name}.md", head + body + "\n")
        write_text_atomic(out_dir / f"{name}.csv", df.to_csv(index=False))
        frames[name] = df
    return frames


#: How the study tables name a summary stage
STAGE_LABELS = {"pruned": "pre-RFT", "rft": "post-RFT"}


def cells_frame(cells: list[dict], summaries: list[dict], models: list[str]) -> pd.DataFrame:
    """Long frame of a study's cells: one row per (cell, stage) and one baseline row per model.

    Args:
        cells: the cells in table order, each a dict with ``model``, ``selector``, ``variant``, ``method`` and
            ``pct``, and any label columns of the study (e.g. ``calibration``).
        summaries: summary documents (``results/{model}/{method}_{pct}/eval.json``); any others are ignored.
        models: the study's models (their baseline rows, in this order).

    Returns:
        Columns ``model, selector, variant, method, pct, stage``, the cells' label columns, then one
        ``task/metric`` column per metric seen. Every cell has a ``pruned`` and an ``rft`` row; a cell without a
        summary, or without RFT, keeps NaN metrics (shown as missing, never invented). Baseline rows (selector
        ``baseline``, stage ``unpruned``, empty labels) take ``metrics.baseline`` of the model's first summary.
    """
    ids = ["model", "selector", "variant", "method", "pct", "stage"]
    labels = [k for k in (cells[0] if cells else {}) if k not in ids]
    wanted = {(c["model"], c["method"], c["pct"]) for c in cells}
    docs = [s for s in summaries if (s["model"], s["method"], float(s["pct"])) in wanted]
    baselines = {}
    for s in summaries:
        base = (s.get("metrics") or {}).get("baseline")
        if s["model"] in models and base is not None:
            baselines.setdefault(s["model"], {"metrics": base})
    df = comparison_frame(docs, baselines)
    metrics = [c for c in df.columns if "/" in c]
    values = {}
    for r in df.to_dict("records"):
        values[(r["model"], r["method"], float(r["pct"]), r["stage"])] = {m: r[m] for m in metrics}
    rows = []
    for model in models:
        rows.append({"model": model, "selector": "baseline", "variant": "", "method": "baseline", "pct": 0.0,
                     "stage": "unpruned", **{k: "" for k in labels},
                     **values.get((model, "baseline", 0.0, "unpruned"), {})})
    for c in cells:
        for stage in STAGES:
            rows.append({**c, "stage": stage, **values.get((c["model"], c["method"], c["pct"], stage), {})})
    out = pd.DataFrame(rows)
    return out.reindex(columns=ids + labels + [m for m in metrics if m in out.columns])


def metric_values(df: pd.DataFrame, model: str) -> tuple[str, dict]:
    """(``metric (direction)`` text, (selector, variant, stage) -> value) of a model's :func:`primary_metric` in a
    :func:`cells_frame`."""
    metric = primary_metric(df, model)
    direction = metric_direction(metric)
    sub = df[df["model"] == model]
    col = sub[metric] if metric in sub.columns else pd.Series([None] * len(sub), index=sub.index)
    values = {(r.selector, r.variant, r.stage): v for r, v in zip(sub.itertuples(), col)}
    return metric + (f" ({direction})" if direction else ""), values


def recall_mean(metrics: dict) -> tuple[float, float]:
    """(mean accuracy over the recall probe's levels, its standard error: sqrt(sum se^2) / levels), NaN if absent."""
    levels = [v for k, v in sorted(metrics.items()) if k.startswith("recall_mqar_") and "acc" in v]
    if not levels:
        return math.nan, math.nan
    mean = sum(v["acc"] for v in levels) / len(levels)
    se = math.sqrt(sum(v.get("acc_stderr", math.nan) ** 2 for v in levels)) / len(levels)
    return mean, se


def eval_columns(doc: dict) -> dict[str, float]:
    """An ``eval.json`` document's metrics and suite averages as ``{"task/metric": value}``."""
    row = {f"{t}/{m}": v for (t, m), v in flat_metrics(doc.get("metrics") or {}).items() if isinstance(v, (int, float))}
    row.update(suite_columns(doc.get("suites")))
    return row


def pm(v: float, se: float, signed: bool = False) -> str:
    """``v ± se`` (three decimals; ``se`` left out when NaN); missing when ``v`` is."""
    if v is None or pd.isna(v):
        return MISSING
    return (f"{v:+.3f}" if signed else f"{v:.3f}") + ("" if pd.isna(se) else f" ± {se:.3f}")


def primary_metric(df: pd.DataFrame, model: str | None = None) -> str:
    """The metric a study table shows: the first of ``TABLE_METRICS`` (the comparison table's order) with a
    value for ``model`` (any model when None), else ``PRIMARY``.

    Args:
        df: a frame with ``model`` and ``task/metric`` columns (:func:`comparison_frame`, :func:`cells_frame`).
        model: restrict to this model's rows.
    """
    sub = df if model is None or df.empty else df[df["model"] == model]
    for metric in TABLE_METRICS:
        if metric in sub.columns and sub[metric].notna().any():
            return metric
    return "/".join(PRIMARY)


# ---------------------------------------------------------------------------------------------
# speed (paper Tables 17-19)
# ---------------------------------------------------------------------------------------------
def _x(v) -> str:
    return MISSING if v is None else f"{v:.2f}×"


def _decode_table(doc: dict, pcts: list, ratio: dict, suffix: str) -> list[str]:
    """Table 17's rows for the decode kernels named with ``suffix`` ("" or ``+fused``); no lines if none measured."""
    cells = [c for c in doc.get("decode", []) if c["kernel"].endswith("+fused") == bool(suffix)]
    base = {(c["batch"], c["kernel"]): c for c in cells if c["pct"] == 0 and "ms" in c}
    batches = sorted({c["batch"] for c in cells})
    if not batches:
        return []
    fla, ours, copy_k = "fla" + suffix, "statereduce" + suffix, "fla_copy" + suffix
    tag = " " + suffix.lstrip("+") if suffix else ""
    copy_ = any(c["kernel"] == copy_k for c in cells)
    head = ["B", f"base ms (fla{tag})", "base floor %", *([f"base ms (fla copy{tag})"] if copy_ else [])]
    for p in map(format_pct, pcts):
        head += [*([f"{p}% fla copy{tag}"] if copy_ else []), f"{p}% fla{tag}", f"{p}% ours{tag}",
                 f"{p}% ours vs fla base{tag}", f"{p}% ideal", f"{p}% floor % (ours{tag})"]
    title = ("Decode (Table 17; speedup = baseline ms / pruned ms, prompt "
             f"{doc.get('settings', {}).get('decode', {}).get('prompt')})")
    if suffix:
        title += ("; fused layers: packed projections and one conv launch per layer around the same state update "
                  "(statereduce.speed.fla_decode)")
    lines = [title + ":", "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for b in batches:
        ref = base.get((b, fla))
        row = [str(b), fmt(ref["ms"]) if ref else MISSING, f"{100 * ref['floor_fraction']:.0f}" if ref else MISSING]
        if copy_:
            ref_c = base.get((b, copy_k))
            row.append(fmt(ref_c["ms"]) if ref_c else MISSING)
        for p in pcts:
            r_fla, r_ours = ratio.get(("decode", p, b, fla)), ratio.get(("decode", p, b, ours))
            if copy_:
                row.append(_x(ratio.get(("decode", p, b, copy_k), {}).get("speedup")))
            row += [_x(r_fla and r_fla["speedup"]), _x(r_ours and r_ours["speedup"]),
                    _x(r_ours and r_ours.get("speedup_vs_fla_baseline")),
                    _x((r_fla or r_ours) and (r_fla or r_ours)["ideal_speedup"]),
                    f"{100 * r_ours['floor_fraction']:.0f}" if r_ours else MISSING]
        lines.append("| " + " | ".join(row) + " |")
    return lines + [""]


def speed_markdown(docs: list[dict]) -> str:
    """Tables 17-19 layouts from ``speed.json`` documents (:func:`statereduce.speed.run_speed`), one block per model.

    Decode (Table 17): per batch, the baseline's ms/token and each ratio's speedup with fla's kernels in place, with
    fla's unmodified functions plus a state copy (``fla copy``, the paper's setup; shown when measured), with ours
    (statereduce's in-place step), ours against fla's in-place baseline, the byte-ratio ideal and the fraction of
    the byte floor reached. Prefill (Table 18): speedup per batch x length. Mixer (Table 19): speedup
    and peak-memory ratio. A cell never measured is shown as missing.
    """
    lines = ["# Speed", ""]
    for doc in docs:
        name = doc.get("model") or doc.get("family")
        bw = doc.get("copy_bandwidth_Bps")
        lines += [f"## {name} ({doc.get('device')}; copy bandwidth {bw / 1e12:.2f} TB/s)" if bw else f"## {name}", ""]
        pcts = sorted({c["pct"] for c in doc.get("decode", []) + doc.get("prefill", []) + doc.get("mixer", [])
                       if c["pct"]})
        ratio = {(p, r["pct"], *[r[k] for k in keys]): r for p, keys in
                 (("decode", ("batch", "kernel")), ("prefill", ("batch", "length")), ("mixer", ("batch", "seq_len")))
                 for r in doc.get("ratios", {}).get(p, [])}
        for suffix in ("", "+fused"):
            lines += _decode_table(doc, pcts, ratio, suffix)
        cells = sorted({(c["batch"], c["length"]) for c in doc.get("prefill", [])}, key=lambda t: (t[1], t[0]))
        if cells:
            base_p = {(c["batch"], c["length"]): c for c in doc["prefill"] if c["pct"] == 0}
            dev = any("device_ms" in c for c in doc["prefill"])
            head = ["B × T", "base ms", *(["base device ms"] if dev else [])]
            head += [h for p in map(format_pct, pcts) for h in ([f"{p}%", f"{p}% device"] if dev else [f"{p}%"])]
            note = "; device: the ratio of summed kernel time, which the wall ratio matches unless host-bound"
            note = note if dev else ""
            lines += [f"Prefill (Table 18; speedup{note}):", "", "| " + " | ".join(head) + " |",
                      "|" + " --- |" * len(head)]
            for b, t in cells:
                ref = base_p.get((b, t), {})
                row = [f"{b} × {t}", fmt(ref["ms"]) if "ms" in ref else ref.get("skipped", MISSING)]
                if dev:
                    row.append(fmt(ref["device_ms"]) if "device_ms" in ref else MISSING)
                for p in pcts:
                    r = ratio.get(("prefill", p, b, t), {})
                    row += [_x(r.get("speedup")), *([_x(r.get("device_speedup"))] if dev else [])]
                lines.append("| " + " | ".join(row) + " |")
            lines.append("")
        mix = sorted({(c["batch"], c["seq_len"]) for c in doc.get("mixer", [])})
        if mix:
            base_m = {(c["batch"], c["seq_len"]): c for c in doc["mixer"] if c["pct"] == 0}
            head = ["B", "T", "base ms"] + [f"{format_pct(p)}% {w}" for p in pcts for w in ("speedup", "memory")]
            lines += ["Mixer only (Table 19; memory = peak-memory ratio):", "", "| " + " | ".join(head) + " |",
                      "|" + " --- |" * len(head)]
            for b, t in mix:
                ref = base_m.get((b, t), {})
                row = [str(b), str(t), fmt(ref["ms"]) if "ms" in ref else MISSING]
                for p in pcts:
                    r = ratio.get(("mixer", p, b, t), {})
                    row += [_x(r.get("speedup")), _x(r.get("memory_ratio"))]
                lines.append("| " + " | ".join(row) + " |")
            lines.append("")
    return "\n".join(lines)
