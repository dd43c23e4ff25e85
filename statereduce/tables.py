"""Comparison tables from result files (Markdown and CSV). A missing cell is shown as missing."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

PRIMARY = ("heldout", "bits_per_byte")  # (task, metric) shown first when present
# Metrics the Markdown table shows, when present: byte-level models on the embedded corpus are compared
# in bits per byte (word perplexity of source code is dominated by rare long "words"); WikiText-2 word
# perplexity is the paper's headline number for hub models. The CSV keeps every metric.
TABLE_METRICS = ("heldout/bits_per_byte", "heldout/word_perplexity", "wikitext/word_perplexity")


def _metric_columns(metrics: dict) -> list[tuple[str, str]]:
    cols = [(t, m) for t, ms in metrics.items() for m in ms]
    return sorted(cols, key=lambda c: (c != PRIMARY, c))


def comparison_frame(summaries: list[dict], baselines: dict[str, dict]) -> pd.DataFrame:
    """One row per (model, method, pct) plus one baseline row per model.

    Args:
        summaries: the summary documents (``results/{model}/{method}_{pct}/eval.json``).
        baselines: model -> baseline eval document (``results/{model}/baseline/eval.json``).
    """
    rows = []
    for model, doc in baselines.items():
        row = {"model": model, "method": "baseline", "pct": 0, "stage": "unpruned"}
        for (t, m), v in _flat(doc.get("metrics", {})).items():
            row[f"{t}/{m}"] = v
        row["state_bytes"] = doc.get("state", {}).get("state_bytes_per_sequence")
        rows.append(row)
    for s in summaries:
        for stage in ("pruned", "rft"):
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
    return df.sort_values(["model", "pct", "stage", "method"], kind="stable").reset_index(drop=True)


def _flat(metrics: dict) -> dict[tuple[str, str], float]:
    return {(t, m): v for t, ms in metrics.items() for m, v in ms.items()}


def comparison_markdown(df: pd.DataFrame, metric: str = "/".join(PRIMARY)) -> str:
    """Pivot: rows (model, method), columns pct, cells ``metric`` (pre-RFT), baseline as pct 0."""
    if df.empty or metric not in df.columns:
        return f"_no results with metric `{metric}`_\n"
    pre = df[df["stage"].isin(["unpruned", "pruned"])]
    piv = pre.pivot_table(index=["model", "method"], columns="pct", values=metric, aggfunc="first", dropna=False)
    lines = []
    for model in piv.index.get_level_values(0).unique():
        sub = piv.loc[model]
        pcts = [c for c in sub.columns if c != 0]
        base = sub.loc["baseline", 0] if ("baseline" in sub.index and 0 in sub.columns) else None
        lines.append(f"### {model}\n")
        lines.append(f"{metric} (lower is better); baseline (0% removed): {_fmt(base)}\n")
        header = "| method | " + " | ".join(f"{_pct(p)}% removed" for p in pcts) + " |"
        lines += [header, "|" + " --- |" * (len(pcts) + 1)]
        for method in [m for m in sub.index if m != "baseline"]:
            cells = [_fmt(sub.loc[method, p]) for p in pcts]
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def _pct(p) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def _fmt(v) -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "–"  # missing, never invented
    return f"{v:.3f}" if abs(v) < 1000 else f"{v:.1f}"


def write_comparison(summaries: list[dict], baselines: dict[str, dict], md_path: str | Path, csv_path: str | Path) -> pd.DataFrame:
    """Write ``comparison.md`` (one pivot per metric in ``TABLE_METRICS`` present) and ``comparison.csv``."""
    import os

    df = comparison_frame(summaries, baselines)
    sections = [comparison_markdown(df, m) for m in TABLE_METRICS if m in df.columns] or [comparison_markdown(df)]
    md = "# Pruned models against their baseline (pre-RFT)\n\n" + "\n".join(
        f"## {m}\n\n{text}" for m, text in zip([m for m in TABLE_METRICS if m in df.columns] or ["-"], sections)
    )
    for path, text in ((Path(md_path), md), (Path(csv_path), df.to_csv(index=False))):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return df
