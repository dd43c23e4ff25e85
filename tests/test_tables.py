"""The comparison table from synthetic result files: values land in the right cells (pre- and post-RFT side
by side, baseline in both), a missing result is shown as missing (never invented), and the CSV keeps every
metric in long format."""

from __future__ import annotations

import pandas as pd
import pytest

from statereduce.analysis.tables import comparison_frame, write_comparison

BPB = "heldout/bits_per_byte"
WPPL = "heldout/word_perplexity"


def _summary(model, method, pct, bpb, rft_bpb=None, wppl=None):
    pruned = {"heldout": {"bits_per_byte": bpb, **({"word_perplexity": wppl} if wppl is not None else {})}}
    rft = {"heldout": {"bits_per_byte": rft_bpb}} if rft_bpb is not None else None
    return {
        "model": model,
        "method": method,
        "pct": pct,
        "metrics": {"baseline": {"heldout": {"bits_per_byte": 1.0}}, "pruned": pruned, "rft": rft},
        "state": {"bytes_after": 100},
    }


def _baseline(bpb, wppl=None):
    metrics = {"heldout": {"bits_per_byte": bpb, **({"word_perplexity": wppl} if wppl is not None else {})}}
    return {"metrics": metrics, "state": {"state_bytes_per_sequence": 400}}


def _tables(md: str) -> dict[tuple[str, str], list[list[str]]]:
    """(## heading, ### heading) -> table body rows (cells stripped), header row first, separator dropped."""
    out, h2, h3 = {}, None, None
    for line in md.splitlines():
        if line.startswith("## "):
            h2, h3 = line[3:], None
        elif line.startswith("### "):
            h3 = line[4:]
        elif line.startswith("|") and "---" not in line:
            out.setdefault((h2, h3), []).append([c.strip() for c in line.strip("|").split("|")])
    return out


def _lead(md: str, h2: str, h3: str) -> list[str]:
    """Non-table, non-empty lines under the given headings."""
    cur, lines = (None, None), []
    for line in md.splitlines():
        if line.startswith("## "):
            cur = (line[3:], None)
        elif line.startswith("### "):
            cur = (cur[0], line[4:])
        elif cur == (h2, h3) and line and not line.startswith("|"):
            lines.append(line)
    return lines


@pytest.fixture
def written(tmp_path):
    summaries = [
        _summary("m1", "drrqr", 50, 1.25, rft_bpb=1.125, wppl=30.0),
        _summary("m1", "drrqr", 75, 1.5),  # RFT not run
        _summary("m1", "l1", 50, 2.0, rft_bpb=1.25, wppl=4000.0),  # l1 at 75 never computed
        _summary("m2", "drrqr", 50, 3.0, rft_bpb=3.5),  # RFT made it worse: Δ positive
    ]
    baselines = {"m1": _baseline(1.0, wppl=25.0), "m2": _baseline(2.5)}
    df = write_comparison(summaries, baselines, tmp_path / "t.md", tmp_path / "t.csv")
    return df, (tmp_path / "t.md").read_text(), pd.read_csv(tmp_path / "t.csv")


def test_markdown_pre_post_blocks(written):
    _, md, _ = written
    t = _tables(md)
    h2 = f"{BPB} (lower is better)"
    header = ["model", "method", "pre-RFT", "post-RFT", "Δ (post − pre)"]
    assert t[(h2, "50% of key channels removed")] == [
        header,
        ["m1", "baseline", "1.000", "1.000", "–"],
        ["m1", "drrqr", "1.250", "1.125", "-0.125"],
        ["m1", "l1", "2.000", "1.250", "-0.750"],
        ["m2", "baseline", "2.500", "2.500", "–"],
        ["m2", "drrqr", "3.000", "3.500", "+0.500"],
    ]
    assert t[(h2, "75% of key channels removed")] == [
        header,
        ["m1", "baseline", "1.000", "1.000", "–"],
        ["m1", "drrqr", "1.500", "–", "–"],  # rft null: missing, Δ missing
        ["m1", "l1", "–", "–", "–"],  # pct present for drrqr only
        ["m2", "baseline", "2.500", "2.500", "–"],
        ["m2", "drrqr", "–", "–", "–"],
    ]


def test_markdown_every_ratio_blocks(written):
    _, md, _ = written
    t = _tables(md)
    h2 = f"{BPB} (lower is better)"
    assert t[(h2, "m1, every ratio")] == [
        ["RFT", "method", "50% removed", "75% removed"],
        ["pre", "drrqr", "1.250", "1.500"],
        ["pre", "l1", "2.000", "–"],
        ["post", "drrqr", "1.125", "–"],
        ["post", "l1", "1.250", "–"],
    ]
    assert _lead(md, h2, "m1, every ratio") == ["baseline (0% removed): 1.000"]
    assert t[(h2, "m2, every ratio")] == [
        ["RFT", "method", "50% removed"],
        ["pre", "drrqr", "3.000"],
        ["post", "drrqr", "3.500"],
    ]


def test_markdown_metric_sections(written):
    _, md, _ = written
    assert md.startswith("# Pruned models against their baseline, before and after recovery fine-tuning (RFT)\n")
    assert "(pre-RFT)" not in md.splitlines()[0]
    h2s = [line[3:] for line in md.splitlines() if line.startswith("## ")]
    assert h2s == [f"{BPB} (lower is better)", f"{WPPL} (lower is better)"]
    t = _tables(md)
    # word perplexity: only m1 has it; rft documents lack it, so post-RFT is missing, not copied from pre-RFT
    assert t[(f"{WPPL} (lower is better)", "50% of key channels removed")][1:] == [
        ["m1", "baseline", "25.000", "25.000", "–"],
        ["m1", "drrqr", "30.000", "–", "–"],
        ["m1", "l1", "4000.0", "–", "–"],
    ]
    assert (f"{WPPL} (lower is better)", "m2, every ratio") not in t


def test_csv_long_format(written):
    df, _, csv = written
    assert len(csv) == len(df) == 2 + 4 + 3  # baselines, pruned rows, rft rows
    assert csv.groupby("stage").size().to_dict() == {"unpruned": 2, "pruned": 4, "rft": 3}
    row = csv[(csv["model"] == "m1") & (csv["method"] == "l1") & (csv["pct"] == 50)].set_index("stage")
    assert row.loc["pruned", BPB] == 2.0 and row.loc["rft", BPB] == 1.25
    assert row.loc["pruned", WPPL] == 4000.0 and pd.isna(row.loc["rft", WPPL])
    assert not ((csv["model"] == "m1") & (csv["pct"] == 75) & (csv["stage"] == "rft")).any()
    assert set(csv.columns) == {"model", "method", "pct", "stage", BPB, WPPL, "state_bytes"}


def test_without_rft_all_post_cells_missing(tmp_path):
    summaries = [_summary("m", "drrqr", 50, 1.25), _summary("m", "drrqr", 75, 1.5), _summary("m", "l1", 50, 2.0)]
    df = write_comparison(summaries, {"m": _baseline(1.0)}, tmp_path / "t.md", tmp_path / "t.csv")
    t = _tables((tmp_path / "t.md").read_text())
    h2 = f"{BPB} (lower is better)"
    assert t[(h2, "m, every ratio")][1:] == [
        ["pre", "drrqr", "1.250", "1.500"],
        ["pre", "l1", "2.000", "–"],
        ["post", "drrqr", "–", "–"],
        ["post", "l1", "–", "–"],
    ]
    assert t[(h2, "50% of key channels removed")][1:] == [
        ["m", "baseline", "1.000", "1.000", "–"],
        ["m", "drrqr", "1.250", "–", "–"],
        ["m", "l1", "2.000", "–", "–"],
    ]
    assert set(pd.read_csv(tmp_path / "t.csv")["stage"]) == {"unpruned", "pruned"} and len(df) == 4


def test_duplicate_documents_rejected():
    with pytest.raises(ValueError, match="several result documents"):
        comparison_frame([_summary("m", "l1", 50, 2.0), _summary("m", "l1", 50.0, 2.1)], {})


def _rank_doc(model, method, pct, d_k, u, rho=None, cond=None):
    doc = {
        "model": {"d_k": d_k},
        "summary": {"u": dict(zip(("mean", "std", "min", "max"), u))},
        "provenance": {"model": model, "method": method, "pct": pct},
    }
    if rho is not None:
        doc["pearson_u"] = rho
    if cond is not None:
        doc["conditioning"] = {"median": dict(zip(("sigma_min", "sigma_max", "kappa"), cond))}
    return doc


def test_rank_tables_from_synthetic_documents(tmp_path):
    from statereduce.analysis.tables import write_rank_tables

    baselines = {"m": _rank_doc("m", "baseline", 0, 8, (0.1, 0.02, 0.05, 0.2), cond=(0.1, 10.0, 100.0))}
    ranks = {
        ("m", "drrqr", 75.0): _rank_doc("m", "drrqr", 75, 2, (0.3, 0.05, 0.2, 0.4), rho=0.9, cond=(1.0, 9.0, 9.0)),
        ("m", "rand", 75.0): _rank_doc("m", "rand", 75, 2, (0.2, 0.05, 0.1, 0.3), rho="nan"),  # no conditioning
    }
    keep = {
        ("m", "drrqr", 75.0): {0: [[0, 1], [2, 3]]},
        ("m", "rand", 75.0): {0: [[0, 5], [6, 7]]},
    }
    frames = write_rank_tables(ranks, baselines, keep, tmp_path)
    util = (tmp_path / "rank_utilization.md").read_text().splitlines()
    assert "| m | baseline | 0 | 8 | 0.100 | 0.020 | 0.050 | 0.200 | 1.000 |" in util
    assert "| m | drrqr | 75 | 2 | 0.300 | 0.050 | 0.200 | 0.400 | 0.900 |" in util
    assert "| m | rand | 75 | 2 | 0.200 | 0.050 | 0.100 | 0.300 | – |" in util  # NaN rho: missing, not invented
    cond = (tmp_path / "conditioning.md").read_text().splitlines()
    assert ("| m | rand | 75 | 2 | – | – | – |" in cond
            and "| m | drrqr | 75 | 2 | 1.000 | 9.000 | 9.000 |" in cond)
    over = frames["overlap"].iloc[0]
    assert (over["method_a"], over["method_b"], over["median_shared"]) == ("drrqr", "rand", 0.5)  # heads share 1, 0
    assert over["random_shared"] == 2 * 2 / 8
    assert (tmp_path / "overlap.csv").read_text().startswith("model,pct,method_a,method_b")


# ---- study tables (paper Tables 2/7 and 16) -------------------------------------------------------------------
CAL_STUDY = {"models": ["m1"], "selectors": ["grad", "drrqr"], "variants": ["default", "prose", "n16"], "pct": 75}
SCORING_STUDY = {"models": ["m1", "m2"], "selectors": ["l1", "drrqr"], "pct": 75}


@pytest.fixture
def studies_written(tmp_path):
    from statereduce.analysis.tables import write_study_tables

    summaries = [
        _summary("m1", "grad", 75, 1.5, rft_bpb=1.25),
        _summary("m1", "grad.prose", 75, 1.75),  # RFT not run
        _summary("m1", "drrqr", 75, 1.375, rft_bpb=1.125),
        _summary("m1", "drrqr.prose", 75, 1.4, rft_bpb=1.2),
        _summary("m1", "drrqr.n16", 75, 1.38, rft_bpb=1.13),  # grad.n16 never computed
        _summary("m1", "l1-q", 75, 2.5, rft_bpb=1.5),  # l1 and l1-k of m1 never computed
        _summary("m1", "drrqr-k", 75, 3.0, rft_bpb=2.0),
        _summary("m1", "drrqr-q", 75, 1.625),
        _summary("m2", "l1", 75, 4.0, rft_bpb=3.0),  # m2 has only this cell
        _summary("m1", "rand", 75, 9.0),  # not in any study: ignored
        _summary("m1", "drrqr", 50, 1.1),  # another ratio: ignored
    ]
    calibrations = {
        "m1": {
            "default": {"corpus": "embedded", "n_samples": 32, "seed": 0, "seq_len": 256, "batch_size": 8},
            "prose": {"corpus": "pydoc-topics", "n_samples": 32, "seed": 0, "seq_len": 256, "batch_size": 8},
            "n16": {"corpus": "embedded", "n_samples": 16, "seed": 0, "seq_len": 128, "batch_size": 4},
        }
    }
    studies = {"calibration": CAL_STUDY, "scoring": SCORING_STUDY}
    frames = write_study_tables(summaries, studies, tmp_path, calibrations)
    md = {n: (tmp_path / f"{n}.md").read_text() for n in ("calibration_study", "scoring_ablation")}
    csv = {n: pd.read_csv(tmp_path / f"{n}.csv") for n in ("calibration_study", "scoring_ablation")}
    return frames, md, csv


def test_calibration_study_layout(studies_written):
    """Tables 2/7: per model, rows calibration variant (labelled corpus, n, seed), columns selector; pre-RFT and
    post-RFT blocks; a result never computed (grad.n16, grad.prose after RFT) is missing, not filled in."""
    _, md, _ = studies_written
    t = _tables(md["calibration_study"])
    h2 = f"m1: {BPB} (lower is better)"
    assert t[(h2, "pre-RFT")] == [
        ["variant", "calibration", "grad", "drrqr"],
        ["default", "embedded, n=32, seed 0", "1.500", "1.375"],
        ["prose", "pydoc-topics, n=32, seed 0", "1.750", "1.400"],
        ["n16", "embedded, n=16, seed 0, seq_len=128", "–", "1.380"],  # seq_len differs from default: shown
    ]
    assert t[(h2, "post-RFT")][1:] == [
        ["default", "embedded, n=32, seed 0", "1.250", "1.125"],
        ["prose", "pydoc-topics, n=32, seed 0", "–", "1.200"],
        ["n16", "embedded, n=16, seed 0, seq_len=128", "–", "1.130"],
    ]
    assert "baseline (unpruned): 1.000" in _lead(md["calibration_study"], h2, None)
    assert "75% of key channels removed" in md["calibration_study"]


def test_scoring_ablation_layout(studies_written):
    """Table 16: rows selector then baseline, columns K,Q / K / Q per model; missing cells stay missing."""
    _, md, _ = studies_written
    t = _tables(md["scoring_ablation"])
    header = ["method", "m1 K,Q", "m1 K", "m1 Q", "m2 K,Q", "m2 K", "m2 Q"]
    assert t[("pre-RFT", None)] == [
        header,
        ["l1", "–", "–", "2.500", "4.000", "–", "–"],
        ["drrqr", "1.375", "3.000", "1.625", "–", "–", "–"],
        ["baseline", *["1.000"] * 6],
    ]
    assert t[("post-RFT", None)][1:3] == [
        ["l1", "–", "–", "1.500", "3.000", "–", "–"],
        ["drrqr", "1.125", "2.000", "–", "–", "–", "–"],
    ]
    assert f"Metric: {BPB} (lower is better)." in md["scoring_ablation"]


def test_study_csv_long_with_missing_cells(studies_written):
    """One CSV row per (cell, stage) of the study plus a baseline row per model; never-computed cells are empty."""
    frames, _, csv = studies_written
    cal = csv["calibration_study"]
    assert len(cal) == 1 + 2 * 3 * 2  # baseline + selectors x variants x stages
    row = cal[(cal["method"] == "grad.n16") & (cal["stage"] == "pruned")].iloc[0]
    assert row["variant"] == "n16" and row["selector"] == "grad" and pd.isna(row[BPB])
    assert set(cal["method"]) == {
        "baseline",
        "grad",
        "grad.prose",
        "grad.n16",
        "drrqr",
        "drrqr.prose",
        "drrqr.n16",
    }
    sc = csv["scoring_ablation"]
    assert len(sc) == 2 + 2 * 2 * 3 * 2  # baselines + models x selectors x scorings x stages
    got = sc[(sc["model"] == "m1") & (sc["stage"] == "pruned")].set_index("method")[BPB]
    assert got["drrqr-k"] == 3.0 and got["l1-q"] == 2.5 and pd.isna(got["l1"]) and pd.isna(got["l1-k"])
    assert list(sc.columns[:6]) == ["model", "selector", "variant", "method", "pct", "stage"]
    assert frames["scoring_ablation"].shape[0] == len(sc)


def test_study_primary_metric_per_model(tmp_path):
    """Each model shows the comparison table's first metric it has (bits per byte, else WikiText-2 perplexity)."""
    from statereduce.analysis.tables import write_study_tables

    hub = {
        "model": "hub",
        "method": "grad-q",
        "pct": 50.0,
        "metrics": {
            "baseline": {"wikitext": {"word_perplexity": 16.7}},
            "pruned": {"wikitext": {"word_perplexity": 19.5}},
            "rft": None,
        },
    }
    tiny = _summary("tiny", "grad-q", 50, 1.5)
    study = {"models": ["tiny", "hub"], "selectors": ["grad"], "pct": 50}
    write_study_tables([hub, tiny], {"scoring": study}, tmp_path)
    md = (tmp_path / "scoring_ablation.md").read_text()
    assert f"tiny: {BPB} (lower is better); hub: wikitext/word_perplexity (lower is better)" in md
    t = _tables(md)
    assert t[("pre-RFT", None)][1] == ["grad", "–", "–", "1.500", "–", "–", "19.500"]
    assert t[("pre-RFT", None)][2] == ["baseline", "1.000", "1.000", "1.000", "16.700", "16.700", "16.700"]
    # a study that is not configured gets a one-line note and an empty CSV
    assert "no calibration study configured" in (tmp_path / "calibration_study.md").read_text()
    assert (tmp_path / "calibration_study.csv").read_text().strip() == ""


def test_suite_averages_become_table_columns(tmp_path):
    """The eval.json ``suites`` blocks (e.g. the paper's "LM Evals avg") appear as ``suite/summary`` columns, and a
    suite average that could not be computed (None) stays missing."""
    from statereduce.analysis.tables import comparison_frame, write_comparison

    base = {"metrics": {"wikitext": {"word_perplexity": 20.0}}, "suites": {"lm": {"lm_avg": 0.5}},
            "state": {"state_bytes_per_sequence": 8}}
    summ = {"model": "m", "method": "drrqr", "pct": 50, "state": {"bytes_after": 4},
            "metrics": {"baseline": base["metrics"], "pruned": {"wikitext": {"word_perplexity": 25.0}},
                        "rft": {"wikitext": {"word_perplexity": 21.0}}},
            "suites": {"baseline": base["suites"], "pruned": {"lm": {"lm_avg": 0.4}}, "rft": {"lm": {"lm_avg": None}}}}
    df = comparison_frame([summ], {"m": base})
    got = dict(zip(df["stage"], df["lm/lm_avg"]))
    assert got["unpruned"] == 0.5 and got["pruned"] == 0.4 and got["rft"] != got["rft"]  # NaN: missing
    write_comparison([summ], {"m": base}, tmp_path / "c.md", tmp_path / "c.csv")
    md = (tmp_path / "c.md").read_text()
    assert "## lm/lm_avg (higher is better)" in md and "## wikitext/word_perplexity" in md
