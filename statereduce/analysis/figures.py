"""Figures of the rank analysis and HTML pages of the tables, for the Snakemake report (paper Figs. 2, 3 and 5).

* :func:`utilization_histograms`: histograms of the per-head mean rank utilization u of the baseline and of each
  pruned model (paper Fig. 3, pre-RFT), one panel per model on a shared logarithmic u axis.
* :func:`spectrum_figure`: the singular values of one head's recurrent state, mean over (sequence, position)
  samples with the 10-90% band, for the baseline and each pruned model (paper Figs. 2 and 5), log-log axes.
* :func:`markdown_html`: a standalone HTML page from one of the workflow's Markdown tables (the report shows
  HTML inline; Markdown only as a download).

The figures read ``rank.json`` documents (:func:`statereduce.stages.rank.rank_report`, also after a JSON round trip,
where non-finite floats are strings). They use matplotlib's object API on an Agg canvas (no pyplot, no global
backend state) and are written atomically: a temporary file next to the target, then ``os.replace``. matplotlib is
imported by the functions that draw (a job that writes HTML pages of tables loads none of it).
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from statereduce.common.layout import format_pct
from statereduce.core.runtime import atomic_file, json_number, write_text_atomic

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DPI = 150
BASELINE_COLOR = "0.25"
METHOD_COLORS = (
    "tab:blue",
    "tab:orange",
    "tab:green",
    "tab:red",
    "tab:purple",
    "tab:brown",
    "tab:pink",
    "tab:olive",
    "tab:cyan",
)
SPECTRUM_KEYS = ("layer", "head", "mean", "q10", "q90")


# ---- document access ------------------------------------------------------------------------------------------
def _check_docs(baseline_doc: Mapping, method_docs: Mapping[str, Mapping], key: str) -> dict[str, Mapping]:
    """{label: doc} with the baseline first; every doc must be a mapping with ``key``."""
    if not isinstance(method_docs, Mapping):
        raise TypeError(f"method_docs must be a {{label: rank document}} mapping, got {type(method_docs).__name__}")
    if "baseline" in method_docs:
        raise ValueError(
            f"method_docs has the label 'baseline', reserved for baseline_doc; labels: {list(method_docs)}"
        )
    docs = {"baseline": baseline_doc, **method_docs}
    for label, doc in docs.items():
        if not isinstance(doc, Mapping) or key not in doc:
            got = sorted(doc) if isinstance(doc, Mapping) else type(doc).__name__
            raise ValueError(f"rank document {label!r} lacks {key!r} (has {got}); expected a rank_report document")
    return docs


def _head_utilization(label: str, doc: Mapping) -> np.ndarray:
    """The finite per-head mean utilizations of one document."""
    records = doc["per_head"]
    if not isinstance(records, Sequence) or not all(isinstance(r, Mapping) and "u_mean" in r for r in records):
        raise ValueError(f"rank document {label!r}: 'per_head' must be a list of records with 'u_mean'")
    u = np.array([json_number(r["u_mean"]) for r in records], dtype=np.float64)
    return u[np.isfinite(u) & (u > 0)]


def _d_k(doc: Mapping) -> int | None:
    d_k = (doc.get("model") or {}).get("d_k")
    return int(d_k) if d_k is not None else None


def _series_label(label: str, doc: Mapping) -> str:
    d_k = _d_k(doc)
    return f"{label} (d_k = {d_k})" if d_k is not None else label


def _title(baseline_doc: Mapping, method_docs: Mapping[str, Mapping], model: str | None, pct: float | None) -> str:
    """``"<model>, <pct>% of key channels removed"`` from the arguments, else from the documents' provenance."""
    if model is None:
        prov = baseline_doc.get("provenance") or {}
        model = prov.get("model") or (baseline_doc.get("model") or {}).get("family") or "unknown model"
    if pct is None:
        pcts = {json_number((d.get("provenance") or {}).get("pct")) for d in method_docs.values()}
        text = ", ".join(format_pct(p) for p in sorted(p for p in pcts if math.isfinite(p))) or "?"
    else:
        text = format_pct(pct)
    return f"{model}, {text}% of key channels removed"


def _colors(labels) -> dict[str, str]:
    methods = [x for x in labels if x != "baseline"]
    return {"baseline": BASELINE_COLOR, **{m: METHOD_COLORS[i % len(METHOD_COLORS)] for i, m in enumerate(methods)}}


def save_figure(fig: Figure, out_png: str | Path) -> Path:
    """Write ``fig`` as a PNG at :data:`DPI` to a temporary file next to ``out_png`` and rename it into place."""
    out = Path(out_png)
    with atomic_file(out, "wb") as fh:
        fig.savefig(fh, format="png", dpi=DPI)
    return out


def new_figure(width: float, height: float) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)  # Agg canvas: no pyplot, no GUI backend
    return fig


# ---- figures --------------------------------------------------------------------------------------------------
def utilization_histograms(
    baseline_doc: Mapping,
    method_docs: Mapping[str, Mapping],
    out_png: str | Path,
    *,
    model: str | None = None,
    pct: float | None = None,
) -> Path:
    """Histograms of the per-head mean rank utilization u, baseline and each method (paper Fig. 3, pre-RFT).

    One panel per model (baseline first, then ``method_docs`` in order), all on one logarithmic u axis with the
    same bins; a dashed line marks each panel's mean over heads. The baseline's u divides by its full d_k, the
    pruned models' by d_k' (each panel's label names its d_k).

    Args:
        baseline_doc: the unpruned model's ``rank.json`` document.
        method_docs: {label: ``rank.json`` of a pruned model}, e.g. {"drrqr": ..., "l1": ...}; may be empty.
        out_png: where the PNG goes (written atomically, :data:`DPI` dpi).
        model, pct: for the title; default: the documents' ``provenance`` (model of the baseline, pct of the methods).
    Returns:
        ``out_png`` as a Path.
    Raises:
        ValueError: a document lacks ``per_head``, or no document has a finite positive utilization.
    """
    from matplotlib.ticker import FormatStrFormatter, LogLocator, MaxNLocator, NullFormatter

    docs = _check_docs(baseline_doc, method_docs, "per_head")
    values = {label: _head_utilization(label, doc) for label, doc in docs.items()}
    pooled = np.concatenate(list(values.values()))
    if not pooled.size:
        raise ValueError(f"no finite positive per-head utilization in any of the documents {list(docs)}")
    lo, hi = float(pooled.min()) / 1.15, float(pooled.max()) * 1.15
    bins = np.geomspace(lo, hi, 31)
    colors = _colors(docs)
    fig = new_figure(7.0, 1.1 + 1.4 * len(docs))
    axes = fig.subplots(len(docs), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (label, doc) in zip(axes, docs.items()):
        u = values[label]
        text = _series_label(label, doc)
        if u.size:
            ax.hist(u, bins=bins, histtype="stepfilled", color=colors[label], alpha=0.75, edgecolor=colors[label])
            ax.axvline(float(u.mean()), color="black", ls="--", lw=1.0)
            text += f": mean u = {u.mean():.3f} over {u.size} heads (dashed)"
        else:
            text += ": no finite utilization"
        ax.set_title(text, loc="left", fontsize=9, pad=3)
        ax.set_xscale("log")
        ax.set_ylabel("heads", fontsize=9)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=3))
        ax.tick_params(labelsize=8)
        ax.grid(True, axis="x", which="both", alpha=0.25)
    axes[-1].set_xlim(lo, hi)
    axes[-1].xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axes[-1].xaxis.set_major_formatter(FormatStrFormatter("%g"))
    axes[-1].xaxis.set_minor_formatter(NullFormatter())
    axes[-1].set_xlabel("per-head mean rank utilization u = er(S) / min(d_v, d_k)  (log scale)", fontsize=9)
    fig.suptitle(
        f"{_title(baseline_doc, method_docs, model, pct)}\nrank utilization of the recurrent state per head (pre-RFT)",
        fontsize=10,
    )
    return save_figure(fig, out_png)


def _spectrum(label: str, doc: Mapping) -> dict[str, object]:
    spec = doc["spectrum"]
    if not isinstance(spec, Mapping) or any(k not in spec for k in SPECTRUM_KEYS):
        got = sorted(spec) if isinstance(spec, Mapping) else type(spec).__name__
        raise ValueError(f"rank document {label!r}: 'spectrum' must have keys {list(SPECTRUM_KEYS)}, got {got}")
    arrays = {k: np.array([json_number(v) for v in spec[k]], dtype=np.float64) for k in ("mean", "q10", "q90")}
    if not arrays["mean"].size == arrays["q10"].size == arrays["q90"].size:
        sizes = {k: int(v.size) for k, v in arrays.items()}
        raise ValueError(f"rank document {label!r}: spectrum mean/q10/q90 differ in length: {sizes}")
    return {"head": (int(spec["layer"]), int(spec["head"])), "n_samples": spec.get("n_samples"), **arrays}


def spectrum_figure(
    baseline_doc: Mapping,
    method_docs: Mapping[str, Mapping],
    out_png: str | Path,
    *,
    model: str | None = None,
    pct: float | None = None,
) -> Path:
    """Singular values of one head's recurrent state, baseline and each method (paper Figs. 2 and 5, pre-RFT).

    For each model, the mean of the i-th largest singular value over the (sequence, position) samples as a line
    and its 10-90% quantile band, against i = 1..min(d_v, d_k); both axes are logarithmic (as in Fig. 2), so the
    pruned models' d_k' values are not squeezed into a corner. Pruning shortens the spectrum and removes its tail.

    Args:
        baseline_doc: the unpruned model's ``rank.json`` document (its ``spectrum`` entry).
        method_docs: {label: ``rank.json`` of a pruned model}; all must summarise the same (layer, head).
        out_png: where the PNG goes (written atomically, :data:`DPI` dpi).
        model, pct: for the title; default: the documents' ``provenance``.
    Returns:
        ``out_png`` as a Path.
    Raises:
        ValueError: a document lacks ``spectrum`` (rank.spectrum_head unset) or has a malformed one, the
            documents summarise different heads, or none has a finite singular value.
    """
    from matplotlib.ticker import FixedLocator, FormatStrFormatter, NullFormatter

    docs = _check_docs(baseline_doc, method_docs, "spectrum")
    spectra = {label: _spectrum(label, doc) for label, doc in docs.items()}
    heads = {label: s["head"] for label, s in spectra.items()}
    if len(set(heads.values())) > 1:
        raise ValueError(f"the documents summarise different (layer, head)s: {heads}; expected one head for all")
    if not any(np.isfinite(s["mean"]).any() for s in spectra.values()):
        raise ValueError(f"no finite singular value in any of the documents {list(docs)}")
    layer, head = heads["baseline"]
    colors = _colors(docs)
    fig = new_figure(7.0, 5.2)
    ax = fig.subplots()
    for label, s in spectra.items():
        text = _series_label(label, docs[label])
        mean, q10, q90 = s["mean"], s["q10"], s["q90"]
        if not mean.size:
            ax.plot([], [], color=colors[label], label=f"{text}: no finite states")
            continue
        idx = np.arange(1, mean.size + 1)
        ax.fill_between(idx, q10, q90, color=colors[label], alpha=0.12, lw=0)
        ax.plot(idx, mean, color=colors[label], lw=1.6, marker="o" if mean.size <= 32 else None, ms=3, label=text)
    ax.set_yscale("log", nonpositive="mask")
    ax.set_xscale("log")
    width = max(s["mean"].size for s in spectra.values())
    ax.set_xlim(0.9, width * 1.1)
    ax.xaxis.set_major_locator(FixedLocator(sorted({2**k for k in range(int(math.log2(width)) + 1)} | {width})))
    ax.xaxis.set_major_formatter(FormatStrFormatter("%d"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("singular value index i, descending  (log scale)", fontsize=9)
    ax.set_ylabel("singular value σ_i of the state S  (log scale)", fontsize=9)
    ax.tick_params(labelsize=8)
    ax.grid(True, which="major", alpha=0.3)
    fig.legend(
        loc="outside lower center",
        ncols=min(3, len(docs)),
        fontsize=8,
        title="line: mean over samples, band: 10–90%",
        title_fontsize=8,
        frameon=False,
    )
    n = spectra["baseline"]["n_samples"]
    samples = f", {n} samples per model" if n is not None else ""
    fig.suptitle(
        f"{_title(baseline_doc, method_docs, model, pct)}\nsingular values of the recurrent state of layer "
        f"{layer}, head {head} (pre-RFT{samples})",
        fontsize=10,
    )
    return save_figure(fig, out_png)


# ---- tables as HTML -------------------------------------------------------------------------------------------
_STYLE = (
    "body{font-family:system-ui,sans-serif;margin:1em;color:#111}"
    "table{border-collapse:collapse;margin:0.5em 0 1.5em}"
    "th,td{border:1px solid #bbb;padding:2px 8px}th{background:#eee}td.num{text-align:right}"
    "h1{font-size:1.3em}h2{font-size:1.15em}h3{font-size:1.0em}"
)
_NUMBER = re.compile(r"^[+\-−]?(\d[\d,]*(\.\d*)?|\.\d+)(e[+\-]?\d+)?%?$|^–$|^(nan|inf|-inf)$", re.IGNORECASE)


def _inline(text: str) -> str:
    """HTML of one line of Markdown text: escaped, with `code`, **bold** and _emphasis_."""
    out = html.escape(text, quote=False)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    out = re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", out)
    return re.sub(r"(?<![\w|])_([^_\s][^_]*?)_(?!\w)", r"<em>\1</em>", out)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _table_html(lines: list[str]) -> str:
    rows = [_cells(x) for x in lines]
    body = rows[2:] if len(rows) > 1 and all(re.fullmatch(r":?-{3,}:?", c) for c in rows[1]) else rows[1:]
    out = ["<table>", "<tr>" + "".join(f"<th>{_inline(c)}</th>" for c in rows[0]) + "</tr>"]
    for row in body:
        tds = "".join(
            f'<td class="num">{_inline(c)}</td>' if _NUMBER.match(c) else f"<td>{_inline(c)}</td>" for c in row
        )
        out.append(f"<tr>{tds}</tr>")
    return "\n".join(out + ["</table>"])


def markdown_html(text: str, title: str | None = None) -> str:
    """A standalone HTML page from the Markdown the workflow writes (headings, paragraphs, pipe tables).

    Covers the subset used by :mod:`statereduce.analysis.tables`: ``#``-headings, paragraphs, pipe tables with a
    ``---`` separator row, `code`, **bold** and _emphasis_; everything else is kept as escaped text.

    Args:
        text: the Markdown.
        title: the page title; default: the first heading, else "table".
    """
    blocks, para, table = [], [], []

    def flush():
        if para:
            blocks.append(f"<p>{_inline(' '.join(para))}</p>")
            para.clear()
        if table:
            blocks.append(_table_html(table))
            table.clear()

    first_heading = None
    for line in text.splitlines():
        stripped = line.strip()
        heading = re.match(r"^(#{1,6})\s+(.*)$", stripped)
        if stripped.startswith("|"):
            if para:
                flush()
            table.append(stripped)
        elif heading:
            flush()
            level = len(heading.group(1))
            first_heading = first_heading or heading.group(2)
            blocks.append(f"<h{level}>{_inline(heading.group(2))}</h{level}>")
        elif not stripped:
            flush()
        else:
            if table:
                flush()
            para.append(stripped)
    flush()
    page_title = html.escape(title or first_heading or "table")
    return (
        f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>{page_title}</title>\n'
        f"<style>{_STYLE}</style>\n</head>\n<body>\n" + "\n".join(blocks) + "\n</body>\n</html>\n"
    )


def write_markdown_html(md_path: str | Path, out_html: str | Path) -> Path:
    """Write :func:`markdown_html` of the Markdown file ``md_path`` to ``out_html`` (atomically)."""
    return write_text_atomic(out_html, markdown_html(Path(md_path).read_text(encoding="utf-8")))


def speedup_figure(docs: Sequence[Mapping], out_png: str | Path) -> Path:
    """Decode speedup against batch size (paper Fig. 4a) and prefill speedup per batch x length (Fig. 4b).

    One decode panel per model (a line per decode kernel and ratio, from the ``ratios`` of ``speed.json``
    documents; grey lines: the byte-ratio ideals; open points: a kernel measured at some batch sizes only), and one
    prefill panel below for all models. Without prefill cells in any document the figure has the decode panels only.
    """
    from matplotlib.lines import Line2D

    has_prefill = any(doc.get("ratios", {}).get("prefill") for doc in docs)
    models = [doc for doc in docs if doc.get("ratios", {}).get("decode")] or list(docs[:1])
    fig = new_figure(max(5.0 * len(models), 10.0 if has_prefill else 5.0), 8.0 if has_prefill else 4.2)
    grid = fig.add_gridspec(2 if has_prefill else 1, len(models))
    axes_d = [fig.add_subplot(grid[0, j]) for j in range(len(models))]
    ax_p = fig.add_subplot(grid[1, :]) if has_prefill else None
    kernels = {"fla": "fla", "statereduce": "ours", "fla_copy": "fla copy", "fla+fused": "fla, fused",
               "statereduce+fused": "ours, fused", "fla_copy+fused": "fla copy, fused"}
    colors = {k: METHOD_COLORS[i % len(METHOD_COLORS)] for i, k in enumerate(kernels)}
    pct_styles = [("--", "o"), ("-", "s"), (":", "^")]  # by ratio: 50 % dashed circles, 75 % solid squares, ...
    for ax_d, doc in zip(axes_d, models):
        rows = doc.get("ratios", {}).get("decode", [])
        pcts = sorted({r["pct"] for r in rows})
        shown = []
        for p_i, pct in enumerate(pcts):
            line, marker = pct_styles[p_i % len(pct_styles)]
            batches = {r["batch"] for r in rows if r["pct"] == pct}
            for kernel in kernels:
                pts = sorted((r["batch"], r["speedup"]) for r in rows if r["pct"] == pct and r["kernel"] == kernel)
                # a kernel measured at a few of the batch sizes only is drawn as open points, not a line through gaps
                sparse = len(pts) < len(batches)
                if pts:
                    ax_d.plot(*zip(*pts), linestyle="none" if sparse else line, marker=marker, markersize=4,
                              color=colors[kernel], fillstyle="none" if sparse else "full")
                    shown.append(kernel)
            ideal = sorted({(r["batch"], r["ideal_speedup"]) for r in rows if r["pct"] == pct})
            if ideal:
                ax_d.plot(*zip(*ideal), line, color="0.55", linewidth=1)
        ax_d.set_xscale("log", base=2)
        ax_d.set_xlabel("batch size")
        ax_d.set_ylabel("decode speedup (×)")
        ax_d.axhline(1.0, color="0.6", linewidth=0.8)
        ax_d.set_title(f"{doc.get('model') or doc.get('family')}: decode (grey: byte-ratio ideal)", fontsize=9)
        handles = [Line2D([], [], color=colors[k], linewidth=2, label=kernels[k]) for k in kernels if k in shown]
        handles += [Line2D([], [], color="0.3", linestyle=pct_styles[i % len(pct_styles)][0],
                           marker=pct_styles[i % len(pct_styles)][1], markersize=4, label=f"{format_pct(p)}% removed")
                    for i, p in enumerate(pcts)]
        if shown:
            ax_d.legend(handles=handles, fontsize=7, loc="upper left")
    if ax_p is None:
        return save_figure(fig, out_png)
    # grouped bars: one group per batch x length cell, one bar per (model, ratio)
    series: dict[tuple, dict] = {}
    for doc in docs:
        for r in sorted(doc.get("ratios", {}).get("prefill", []), key=lambda r: r["pct"]):
            key = (doc.get("model") or doc.get("family"), r["pct"])
            series.setdefault(key, {})[(r["length"], r["batch"])] = r["speedup"]
    cells = sorted({c for values in series.values() for c in values})
    width = 0.8 / max(len(series), 1)
    for k, ((name, pct), values) in enumerate(series.items()):
        xs = [i + (k - (len(series) - 1) / 2) * width for i, c in enumerate(cells) if c in values]
        ax_p.bar(xs, [values[c] for c in cells if c in values], width, color=METHOD_COLORS[k % len(METHOD_COLORS)],
                 label=f"{name} {format_pct(pct)}%")
    ax_p.set_xticks(range(len(cells)), [f"{b}×{t // 1024}K" for t, b in cells], fontsize=7)
    ax_p.axhline(1.0, color="0.6", linewidth=0.8)
    if series:
        top = max(v for values in series.values() for v in values.values())
        ax_p.set_ylim(0, max(top, 1.0) * 1.3)  # room for the legend above the bars
        ax_p.legend(fontsize=7, ncol=2, loc="upper center")
    ax_p.set_xlabel("batch × length")
    ax_p.set_ylabel("prefill speedup (×)")
    ax_p.set_title("prefill")
    return save_figure(fig, out_png)
