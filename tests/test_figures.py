"""Rank-analysis figures (paper Figs. 2, 3, 5) from synthetic rank.json documents: non-empty PNGs written
atomically, also after a JSON round trip with non-finite values; clear errors on documents that lack what a
figure needs; and the HTML pages of the Markdown tables for the report."""

from __future__ import annotations

import json

import numpy as np
import pytest

from statereduce.analysis.figures import markdown_html, spectrum_figure, utilization_histograms, write_markdown_html
from statereduce.core.runtime import jsonable

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _doc(method: str, d_k: int, u_scale: float, seed: int, layers: int = 4, heads: int = 4) -> dict:
    """A rank.json-shaped document: per-head utilization records and one head's spectrum summary."""
    rng = np.random.default_rng(seed)
    per_head = [
        {"layer": layer, "head": head, "u_mean": float(u_scale * rng.uniform(0.5, 2.0)), "u_std": 0.01}
        for layer in range(layers)
        for head in range(heads)
    ]
    mean = np.sort(rng.uniform(0.01, 1.0, size=d_k))[::-1] * np.geomspace(1.0, 1e-4, d_k)
    spectrum = {
        "layer": 1,
        "head": 0,
        "mean": mean,
        "q10": 0.5 * mean,
        "median": mean,
        "q90": 1.5 * mean,
        "n_samples": 24,
    }
    return {
        "model": {"family": "delta_net", "num_heads": heads, "d_k": d_k, "d_v": 64, "layers": list(range(layers))},
        "per_head": per_head,
        "spectrum": spectrum,
        "provenance": {"model": "toy-dn", "method": method, "pct": 0 if method == "baseline" else 75.0},
    }


@pytest.fixture
def docs():
    baseline = _doc("baseline", 64, 0.05, seed=0)
    methods = {m: _doc(m, 16, 0.2, seed=i + 1) for i, m in enumerate(("drrqr", "l1", "rand"))}
    return baseline, methods


def _assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000, (data[:8], len(data))
    assert [p.name for p in path.parent.iterdir()] == [path.name], "a temporary file was left behind"


@pytest.mark.parametrize("figure", [utilization_histograms, spectrum_figure], ids=["utilization", "spectrum"])
def test_figure_writes_png(tmp_path, docs, figure):
    out = tmp_path / "figs" / "fig.png"
    assert figure(*docs, out) == out
    _assert_png(out)
    figure(*docs, out)  # overwriting in place works too
    _assert_png(out)


@pytest.mark.parametrize("figure", [utilization_histograms, spectrum_figure], ids=["utilization", "spectrum"])
def test_figure_after_json_round_trip_with_non_finite_values(tmp_path, docs, figure):
    baseline, methods = docs
    methods["l1"]["per_head"][0]["u_mean"] = float("nan")
    methods["l1"]["spectrum"]["q10"][-1] = float("nan")
    methods["rand"]["spectrum"]["mean"][-1] = 0.0  # a zero singular value on the log axis is masked
    baseline, methods = json.loads(json.dumps(jsonable([baseline, methods])))
    assert methods["l1"]["per_head"][0]["u_mean"] == "nan"
    out = tmp_path / "fig.png"
    figure(baseline, methods, out, model="toy-dn", pct=75)
    _assert_png(out)


@pytest.mark.parametrize("figure", [utilization_histograms, spectrum_figure], ids=["utilization", "spectrum"])
def test_baseline_only(tmp_path, docs, figure):
    out = tmp_path / "fig.png"
    figure(docs[0], {}, out)
    _assert_png(out)


@pytest.mark.parametrize(
    "figure, key",
    [(utilization_histograms, "per_head"), (spectrum_figure, "spectrum")],
    ids=["utilization", "spectrum"],
)
@pytest.mark.parametrize("who", ["baseline", "method"])
def test_document_without_the_needed_entry_fails_clearly(tmp_path, docs, figure, key, who):
    baseline, methods = docs
    target = baseline if who == "baseline" else methods["l1"]
    del target[key]
    label = "baseline" if who == "baseline" else "l1"
    with pytest.raises(ValueError, match=rf"rank document '{label}' lacks '{key}'"):
        figure(baseline, methods, tmp_path / "fig.png")
    assert not list(tmp_path.iterdir())


def test_spectrum_of_different_heads_fails(tmp_path, docs):
    baseline, methods = docs
    methods["drrqr"]["spectrum"]["head"] = 1
    with pytest.raises(ValueError, match=r"different \(layer, head\)s"):
        spectrum_figure(baseline, methods, tmp_path / "fig.png")


def test_utilization_without_finite_values_fails(tmp_path, docs):
    baseline, _ = docs
    for record in baseline["per_head"]:
        record["u_mean"] = "nan"
    with pytest.raises(ValueError, match="no finite positive per-head utilization"):
        utilization_histograms(baseline, {}, tmp_path / "fig.png")


def test_markdown_table_as_html(tmp_path):
    md = (
        "# Table 5 <draft>\n\nu = er(S) / d; ||S||_F^2 stays as text, `code` and **bold** render.\n\n"
        "| model | method | mean |\n| --- | --- | --- |\n| toy | drrqr | 0.231 |\n| toy | rand | – |\n\n"
        "_no overlap results_\n"
    )
    page = markdown_html(md)
    assert page.startswith("<!DOCTYPE html>") and "<title>Table 5 &lt;draft&gt;</title>" in page
    assert "<h1>Table 5 &lt;draft&gt;</h1>" in page and "||S||_F^2" in page
    assert "<code>code</code>" in page and "<strong>bold</strong>" in page
    assert "<tr><th>model</th><th>method</th><th>mean</th></tr>" in page and "---" not in page
    assert '<tr><td>toy</td><td>drrqr</td><td class="num">0.231</td></tr>' in page
    assert "<p><em>no overlap results</em></p>" in page
    (tmp_path / "t.md").write_text(md)
    assert write_markdown_html(tmp_path / "t.md", tmp_path / "out" / "t.html").read_text() == page


def test_method_labelled_baseline_fails(tmp_path, docs):
    baseline, methods = docs
    with pytest.raises(ValueError, match="reserved for baseline_doc"):
        utilization_histograms(baseline, {"baseline": methods["l1"]}, tmp_path / "fig.png")
