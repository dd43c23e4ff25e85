"""Comparison tables from result files (Markdown and CSV). A missing cell is shown as missing.

The Markdown follows the paper's Table 20 (pruned models before and after recovery fine-tuning, RFT, side by
side, with the unpruned baseline in both column groups) and Table 21 (every compression ratio, pre- and
post-RFT). The CSV is long: one row per (model, method, pct, stage) with every metric.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

PRIMARY = ("heldout", "bits_per_byte")  # (task, metric) shown first when present
# Metrics the Markdown table shows, when present: byte-level models on the embedded corpus are compared
# in bits per byte (word perplexity of source code is dominated by rare long "words"); WikiText-2 word
# perplexity is the paper's headline number for hub models. The CSV keeps every metric.
TABLE_METRICS = ("heldout/bits_per_byte", "heldout/word_perplexity", "wikitext/word_perplexity")
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
        lacks it) and ``state_bytes``; sorted by model, pct, stage, method. Raises ``ValueError`` if two
        documents give the same (model, method, pct, stage).
    """
    rows = []
    for model, doc in baselines.items():
        row = {"model": model, "method": "baseline", "pct": 0, "stage": "unpruned"}
        for (t, m), v in _flat(doc.get("metrics", {})).items():
            row[f"{t}/{m}"] = v
        row["state_bytes"] = doc.get("state", {}).get("state_bytes_per_sequence")
        rows.append(row)
    for s in summaries:
        for stage in STAGES:
            metrics = (s.get("metrics") or {}).get(stage)
            if metrics is None:
                continue
            row = {"model": s["model"], "method": s["method"], "pct": s["pct"], "stage": stage}
            for (t, m), v in _flat(metrics).items():
                row[f"{t}/{m}"] = v
            row["state_bytes"] = (s.get("state") or {}).get("bytes_after")
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


def _flat(metrics: dict) -> dict[tuple[str, str], float]:
    return {(t, m): v for t, ms in metrics.items() for m, v in ms.items()}


def _direction(metric: str) -> str:
    """``"lower is better"``, ``"higher is better"`` or ``""`` (unknown) for a ``task/metric`` name."""
    name = metric.rsplit("/", 1)[-1]
    if name.endswith(LOWER_IS_BETTER):
        return "lower is better"
    if name.startswith("acc"):
        return "higher is better"
    return ""


def _lookup(df: pd.DataFrame, metric: str) -> dict[tuple, float]:
    """(model, method, pct, stage) -> value of ``metric``, only where it was computed."""
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
        A value never computed (RFT not run, pct not run for that method) is ``–``, and so is its Δ.
    """
    values = _lookup(df, metric)
    models, methods, _ = _layout(df, metric)
    lines = ["| model | method | pre-RFT | post-RFT | Δ (post − pre) |", "| --- | --- | --- | --- | --- |"]
    for model in models:
        base = values.get((model, "baseline", 0.0, "unpruned"))
        lines.append(f"| {model} | baseline | {_fmt(base)} | {_fmt(base)} | {MISSING} |")
        for method in methods[model]:
            pre, post = (values.get((model, method, float(pct), s)) for s in STAGES)
            delta = post - pre if pre is not None and post is not None else None
            lines.append(f"| {model} | {method} | {_fmt(pre)} | {_fmt(post)} | {_fmt_delta(delta)} |")
    return "\n".join(lines) + "\n"


def ratios_markdown(df: pd.DataFrame, metric: str, model: str) -> str:
    """Table 21-style block for one model: rows (RFT, method), columns every pct; baseline in a lead line.

    Args:
        df: the frame of :func:`comparison_frame`.
        metric: a ``task/metric`` column of ``df``.
        model: a model of ``df``.

    Returns:
        The lead line and a table with pre-RFT rows, then post-RFT rows; ``–`` where never computed.
    """
    values = _lookup(df, metric)
    _, methods, pcts = _layout(df[df["model"] == model], metric)
    base = values.get((model, "baseline", 0.0, "unpruned"))
    lines = [f"baseline (0% removed): {_fmt(base)}\n"]
    lines.append("| RFT | method | " + " | ".join(f"{_pct(p)}% removed" for p in pcts) + " |")
    lines.append("|" + " --- |" * (len(pcts) + 2))
    for stage, label in zip(STAGES, ("pre", "post")):
        for method in methods.get(model, []):
            cells = [_fmt(values.get((model, method, p, stage))) for p in pcts]
            lines.append(f"| {label} | {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def comparison_markdown(df: pd.DataFrame, metric: str = "/".join(PRIMARY)) -> str:
    """One metric's section: a pre/post-RFT block per pct (all models), then an all-ratios block per model.

    Args:
        df: the frame of :func:`comparison_frame`.
        metric: a ``task/metric`` column of ``df``.

    Returns:
        Markdown starting with a ``## metric`` heading; a one-line note if no row has ``metric``.
    """
    direction = _direction(metric)
    head = f"## {metric}" + (f" ({direction})" if direction else "") + "\n\n"
    if df.empty or metric not in df.columns or df[metric].isna().all():
        return head + f"_no results with metric `{metric}`_\n"
    models, _, pcts = _layout(df, metric)
    parts = [head]
    for pct in pcts:
        parts.append(f"### {_pct(pct)}% of key channels removed\n\n{stage_markdown(df, metric, pct)}\n")
    for model in models:
        parts.append(f"### {model}, every ratio\n\n{ratios_markdown(df, metric, model)}\n")
    return "".join(parts)


def _pct(p) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def _fmt(v) -> str:
    if v is None or pd.isna(v):
        return MISSING  # missing, never invented
    return f"{v:.3f}" if abs(v) < 1000 else f"{v:.1f}"


def _fmt_delta(v) -> str:
    """As :func:`_fmt`, with an explicit ``+`` on a positive difference."""
    text = _fmt(v)
    return f"+{text}" if v is not None and v > 0 else text


HEADER = (
    "# Pruned models against their baseline, before and after recovery fine-tuning (RFT)\n\n"
    "Pre-RFT: the pruned model; post-RFT: after recovery fine-tuning; Δ = post-RFT − pre-RFT. "
    "The baseline (unpruned, not fine-tuned) shows its value in both columns. "
    f"{MISSING} = not computed (e.g. RFT not run).\n\n"
)


def write_comparison(
    summaries: list[dict], baselines: dict[str, dict], md_path: str | Path, csv_path: str | Path
) -> pd.DataFrame:
    """Write ``comparison.md`` (a section per metric of ``TABLE_METRICS`` present) and ``comparison.csv``.

    Args:
        summaries: the summary documents, as for :func:`comparison_frame`.
        baselines: model -> baseline eval document.
        md_path: where the Markdown goes.
        csv_path: where the long CSV (every metric, one row per model, method, pct, stage) goes.

    Returns:
        The frame of :func:`comparison_frame`.
    """
    import os

    df = comparison_frame(summaries, baselines)
    present = [m for m in TABLE_METRICS if m in df.columns and df[m].notna().any()]
    md = HEADER + "\n".join(comparison_markdown(df, m).rstrip("\n") + "\n" for m in present or ["/".join(PRIMARY)])
    for path, text in ((Path(md_path), md), (Path(csv_path), df.to_csv(index=False))):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return df


# ---- rank analysis (paper Tables 5 and 6, App. C.2) ----------------------------------------------------------
def _num(v) -> float:
    """A number from a rank.json value (non-finite floats are stored as strings there)."""
    if v is None:
        return float("nan")
    return float(v)


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
        rho = 1.0 if method == "baseline" else _num(doc.get("pearson_u"))
        key = {"model": model, "method": method, "pct": pct, "d_k": (doc.get("model") or {}).get("d_k")}
        util.append({**key, **{s: _num(u.get(s)) for s in ("mean", "std", "min", "max")}, "rho": rho})
        med = (doc.get("conditioning") or {}).get("median") or {}
        cond.append({**key, **{s: _num(med.get(s)) for s in ("sigma_min", "sigma_max", "kappa")}})
    order = ["model", "pct", "method"]
    return (
        pd.DataFrame(util).sort_values(order, kind="stable").reset_index(drop=True),
        pd.DataFrame(cond).sort_values(order, kind="stable").reset_index(drop=True),
    )


def overlap_frame(selections: dict[tuple[str, str, float], dict], d_k: dict[str, int]) -> pd.DataFrame:
    """Median per-head overlap of kept channels between every two methods of a (model, pct) (paper App. C.2).

    Args:
        selections: (model, method, pct) -> {layer: [H][d_k']} kept indices (:func:`statereduce.selection.read_selection`).
        d_k: model -> head size before pruning.

    Returns:
        One row per (model, pct, method_a, method_b): d_k', median shared channels, median fraction and the
        random-selection expectation d_k'^2 / d_k.
    """
    from statereduce.rank import keep_overlap

    rows = []
    groups: dict[tuple[str, float], dict[str, dict]] = {}
    for (model, method, pct), keep in selections.items():
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
                        **{k: ov[k] for k in ("d_k_new", "median_shared", "median_fraction", "random_shared")},
                    }
                )
    return pd.DataFrame(rows)


def _md_table(df: pd.DataFrame, cols: list[str]) -> list[str]:
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for _, r in df.iterrows():
        cells = [
            str(r[c])
            if isinstance(r[c], str)
            else (_pct(r[c]) if c in ("pct", "d_k", "d_k_new") and not pd.isna(r[c]) else _fmt(r[c]))
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
    from statereduce.runtime import write_text_atomic

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
                "independent uniform selections.\n\n"
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
