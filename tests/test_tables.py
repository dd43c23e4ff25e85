"""The comparison table from synthetic result files: values land in the right cells, a missing result
is shown as missing (never invented), and the CSV keeps every metric."""

from __future__ import annotations

import pandas as pd

from statereduce.tables import write_comparison


def _summary(model, method, pct, bpb):
    return {"model": model, "method": method, "pct": pct,
            "metrics": {"baseline": {"heldout": {"bits_per_byte": 1.0}}, "pruned": {"heldout": {"bits_per_byte": bpb}},
                        "rft": None},
            "state": {"bytes_after": 100}}


def test_table_cells_and_missing(tmp_path):
    summaries = [_summary("m", "drrqr", 50, 1.25), _summary("m", "drrqr", 75, 1.5), _summary("m", "l1", 50, 2.0)]
    baselines = {"m": {"metrics": {"heldout": {"bits_per_byte": 1.0}}, "state": {"state_bytes_per_sequence": 400}}}
    df = write_comparison(summaries, baselines, tmp_path / "t.md", tmp_path / "t.csv")
    md = (tmp_path / "t.md").read_text()
    assert "| drrqr | 1.250 | 1.500 |" in md
    assert "| l1 | 2.000 | – |" in md  # l1 at 75 was never computed
    assert "baseline (0% removed): 1.000" in md
    csv = pd.read_csv(tmp_path / "t.csv")
    assert len(csv) == len(df) == 4 and set(csv["stage"]) == {"unpruned", "pruned"}
    assert csv.loc[csv["method"] == "l1", "heldout/bits_per_byte"].item() == 2.0
