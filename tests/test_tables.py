"""The comparison table from synthetic result files: values land in the right cells (pre- and post-RFT side
by side, baseline in both), a missing result is shown as missing (never invented), and the CSV keeps every
metric in long format."""

from __future__ import annotations

import math

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
    # the held-out word perplexity (millions for a tiny model on source code) stays in the CSV only, said so
    assert h2s == ["Overview: 50% of key channels removed", "Overview: 75% of key channels removed",
                   f"{BPB} (lower is better)"]
    assert "left out here" in md and f"`{WPPL}`" in md


def test_overview_wide_tables(written):
    _, md, _ = written
    t = _tables(md)
    assert t[("Overview: 50% of key channels removed", None)] == [
        ["method", "m1", "m2"],
        ["baseline", "1.000", "2.500"],
        ["drrqr", "1.250 → 1.125", "3.000 → 3.500"],
        ["l1", "2.000 → 1.250", "–"],  # m2 has no l1 at all
    ]
    assert t[("Overview: 75% of key channels removed", None)][2:] == [["drrqr", "1.500 → –", "–"], ["l1", "–", "–"]]
    assert _lead(md, "Overview: 50% of key channels removed", None) == [
        "Held-out bits per byte (lower is better, pre-RFT → post-RFT):"]


def test_one_ratio_has_no_every_ratio_blocks(tmp_path):
    summaries = [_summary("m", "drrqr", 50, 1.25, rft_bpb=1.125), _summary("m", "l1", 50, 2.0)]
    write_comparison(summaries, {"m": _baseline(1.0)}, tmp_path / "t.md", tmp_path / "t.csv")
    md = (tmp_path / "t.md").read_text()
    assert "every ratio" not in md
    assert [h for h, _ in _tables(md)] == ["Overview: 50% of key channels removed", f"{BPB} (lower is better)"]


def _levels(accs: dict[int, float], n: int = 100, stderr: bool = True) -> dict:
    """Recall probe metrics: per level ``acc`` and lm-eval's ``acc_stderr`` sqrt(p (1 - p) / (n - 1))."""
    return {f"recall_mqar_{k}": {"acc": a, **({"acc_stderr": math.sqrt(a * (1 - a) / (n - 1))} if stderr else {})}
            for k, a in accs.items()}


def _recall_summary(model, pct, pre: dict, post: dict | None, rft: dict | None = None, **kw):
    def suites(m):
        return {"recall_probe": {"recall_mqar_avg": sum(v["acc"] for v in m.values()) / len(m)}}

    base = _levels({4: 0.6, 8: 0.4})
    doc = {"model": model, "method": "grad", "pct": pct, "state": {"bytes_after": 1},
           "metrics": {"baseline": base, "pruned": pre, "rft": post},
           "suites": {"baseline": suites(base), "pruned": suites(pre), "rft": suites(post) if post else None}, **kw}
    if rft is not None:
        doc["rft"] = rft
    return doc, {"metrics": base, "suites": suites(base), "state": {"state_bytes_per_sequence": 2}}


def test_recall_cells_carry_standard_errors(tmp_path):
    """The recall probe's mean over its levels carries sqrt(se_4^2 + se_8^2) / 2 in every cell (pre, post, baseline,
    Δ with both combined); a level without a standard error gives the mean without one, never a made-up one."""
    pre, post = _levels({4: 0.5, 8: 0.3}), _levels({4: 0.7, 8: 0.3})
    summ, base = _recall_summary("m", 50, pre, post)
    summ2, _ = _recall_summary("m2", 50, _levels({4: 0.5, 8: 0.3}, stderr=False), None)
    df = write_comparison([summ, summ2], {"m": base, "m2": base}, tmp_path / "t.md", tmp_path / "t.csv")
    se = {k: math.sqrt(sum(v["acc_stderr"] ** 2 for v in d.values())) / 2 for k, d in
          (("base", base["metrics"]), ("pre", pre), ("post", post))}
    col = "recall_probe/recall_mqar_avg"
    got = dict(zip(df["model"] + "/" + df["stage"], df[col + "_stderr"]))
    assert got["m/pruned"] == pytest.approx(se["pre"]) and got["m/rft"] == pytest.approx(se["post"])
    assert math.isnan(got["m2/pruned"])  # its levels lack acc_stderr
    t = _tables((tmp_path / "t.md").read_text())
    rows = t[(f"{col} (higher is better)", "50% of key channels removed")]
    b, p, q = (f"{x:.3f}" for x in (se["base"], se["pre"], se["post"]))
    assert rows[1:3] == [
        ["m", "baseline", f"0.500 ± {b}", f"0.500 ± {b}", "–"],
        ["m", "grad", f"0.400 ± {p}", f"0.500 ± {q}", f"+0.100 ± {math.hypot(se['pre'], se['post']):.3f}"],
    ]
    assert rows[4] == ["m2", "grad", "0.400", "–", "–"]
    assert t[("Overview: 50% of key channels removed", None)][-2:] == [
        ["baseline", f"0.500 ± {b}", f"0.500 ± {b}"], ["grad", f"0.400 ± {p} → 0.500 ± {q}", "0.400 → –"]]
    # the average recorded in the document must be the one the levels give; otherwise no standard error
    bad, _ = _recall_summary("m", 50, pre, post)
    bad["suites"]["pruned"]["recall_probe"]["recall_mqar_avg"] = 0.45
    frame = comparison_frame([bad], {"m": base})
    assert frame.loc[frame["stage"] == "pruned", col + "_stderr"].isna().all()


def test_rft_kept_step_per_cell(tmp_path):
    """A summary's ``rft`` block (the kept validation pass) shows as ``k of N (start → kept)``; a summary without one
    (no RFT, or an older run) as missing; with none, no RFT table at all."""
    rft = {"steps": 16, "kept_step": 12, "best_step": 12, "metric": "ce", "val_loss_start": 2.4514,
           "val_loss_kept": 2.3981,
           "curve": [[0, 2.4514], [4, 2.41], [8, 2.40], [12, 2.3981], [16, 2.3990]]}
    pre, post = _levels({4: 0.5, 8: 0.3}), _levels({4: 0.7, 8: 0.3})
    a, base = _recall_summary("m", 50, pre, post, rft=rft)
    b, _ = _recall_summary("m2", 50, pre, post, rft=None)
    c, _ = _recall_summary("m3", 50, pre, post)  # no key at all
    df = write_comparison([a, b, c], {m: base for m in ("m", "m2", "m3")}, tmp_path / "t.md", tmp_path / "t.csv")
    md = (tmp_path / "t.md").read_text()
    assert "RFT: step kept of N, 0 being the pruned model itself (validation cross entropy before RFT" in md
    assert t_rows(md, "RFT: step kept of N") == [["method", "m", "m2", "m3"],
                                                 ["grad", "12 of 16 (2.451 → 2.398)", "–", "–"]]
    row = df[(df["model"] == "m") & (df["stage"] == "rft")].iloc[0]
    assert (row["rft_kept_step"], row["rft_steps"]) == (12, 16)
    assert "rft_kept_step" in pd.read_csv(tmp_path / "t.csv").columns
    write_comparison([b, c], {m: base for m in ("m2", "m3")}, tmp_path / "u.md", tmp_path / "u.csv")
    assert "RFT: step kept" not in (tmp_path / "u.md").read_text()


def t_rows(md: str, lead: str) -> list[list[str]]:
    """The table right after the line starting with ``lead`` (header row first, separator dropped)."""
    lines = md.splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith(lead)) + 1
    while not lines[i].startswith("|"):
        i += 1
    rows = []
    while i < len(lines) and lines[i].startswith("|"):
        if "---" not in lines[i]:
            rows.append([c.strip() for c in lines[i].strip("|").split("|")])
        i += 1
    return rows


def test_made_on_line_names_the_cpu(tmp_path):
    """The documents' CPU kind (``versions.cpu``) is named under the header, with torch's CPU capability when it is
    this machine's; :func:`parse_made_on` reads it back."""
    from statereduce.analysis.tables import made_on_line, parse_made_on
    from statereduce.core.runtime import cpu_kind

    here = {"provenance": {"versions": {"cpu": cpu_kind()}}}
    other = {"provenance": {"versions": {"cpu": "Some CPU (AVX)"}}}
    line = made_on_line([], {"m": here})
    kinds, cap = parse_made_on("x\n" + line + "\n")
    assert kinds == [cpu_kind()] and cap
    assert parse_made_on(made_on_line([], {"m": here, "n": other})) == (sorted([cpu_kind(), "Some CPU (AVX)"]), None)
    assert parse_made_on(made_on_line([], {"m": {}})) == ([], None)
    assert parse_made_on("no such line") is None
    summ = _summary("m", "drrqr", 50, 1.25)
    summ["provenance"] = {"evals": {"pruned": {"versions": {"cpu": cpu_kind()}}}}
    write_comparison([summ], {"m": here}, tmp_path / "t.md", tmp_path / "t.csv")
    assert parse_made_on((tmp_path / "t.md").read_text())[0] == [cpu_kind()]


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
    from _study import write_study

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
    frames = write_study(tmp_path, "calibration", {"summaries": summaries},
                         {"block": CAL_STUDY, "calibrations": calibrations})
    frames |= write_study(tmp_path, "scoring", {"summaries": summaries}, SCORING_STUDY)
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
    from _study import write_study

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
    write_study(tmp_path, "scoring", {"summaries": [hub, tiny]}, study)
    md = (tmp_path / "scoring_ablation.md").read_text()
    assert f"tiny: {BPB} (lower is better); hub: wikitext/word_perplexity (lower is better)" in md
    t = _tables(md)
    assert t[("pre-RFT", None)][1] == ["grad", "–", "–", "1.500", "–", "–", "19.500"]
    assert t[("pre-RFT", None)][2] == ["baseline", "1.000", "1.000", "1.000", "16.700", "16.700", "16.700"]
    assert "Table 16" in (tmp_path / "scoring_ablation.rst").read_text()  # the report caption, from the module
    assert "<table>" in (tmp_path / "scoring_ablation.html").read_text()


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
