"""The comparison table from synthetic result files: values land in the right cells (pre- and post-RFT side
by side, baseline in both), a missing result is shown as missing (never invented), and the CSV keeps every
metric in long format."""

from __future__ import annotations

import pandas as pd
import pytest

from statereduce.tables import comparison_frame, write_comparison

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
    from statereduce.tables import write_rank_tables

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
    assert "| m | rand | 75 | 2 | – | – | – |" in cond and "| m | drrqr | 75 | 2 | 1.000 | 9.000 | 9.000 |" in cond
    over = frames["overlap"].iloc[0]
    assert (over["method_a"], over["method_b"], over["median_shared"]) == ("drrqr", "rand", 0.5)  # heads share 1, 0
    assert over["random_shared"] == 2 * 2 / 8
    assert (tmp_path / "overlap.csv").read_text().startswith("model,pct,method_a,method_b")
