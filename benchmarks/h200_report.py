"""The tables and figure of docs/speed_h200.md from the recorded H200 runs in docs/results/.

Each model's cells come from several runs (one GPU call cannot measure everything); every ratio is still taken
within one run: the runs below measure disjoint batch sizes (decode) or disjoint parts, and `speed_ratios` matches a
pruned cell only with the baseline cell of the same batch and kernel.

The mixer's time comes from the graph-timed run and its peak memory from the eager run before it (``mixer_memory``):
the graph-timed run of that session measured memory around the graph capture, which adds the graph pool's buffers;
`speed._time_call` now takes the peak from one eager call before capturing, as the eager run did.

    python benchmarks/h200_report.py docs/speedup_h200.png > /tmp/tables.md
"""

import json
import sys
from pathlib import Path

from statereduce.figures import speedup_figure
from statereduce.speed import speed_ratios
from statereduce.tables import speed_markdown

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"

# model -> [(file, part, keep(cell) -> bool)]
SOURCES = {
    "dn1.3b": [
        ("speed_dn1.3b_h200_run3.json", "decode", lambda c: c["batch"] <= 8),
        ("speed_dn1.3b_h200_run4.json", "decode", lambda c: c["batch"] >= 16),
        ("speed_dn1.3b_h200_copy.json", "decode", lambda c: c["kernel"] == "fla_copy"),
        ("speed_dn1.3b_h200_prefill.json", "prefill", lambda c: True),
        ("speed_dn1.3b_h200_mixer.json", "mixer", lambda c: True),
        ("speed_dn1.3b_h200_mixer_eager.json", "mixer_memory", lambda c: True),
    ],
    "gdn1.3b": [
        ("speed_gdn1.3b_h200_run2.json", "decode", lambda c: True),
        ("speed_gdn1.3b_h200_mid.json", "decode", lambda c: True),
        ("speed_gdn1.3b_h200_copy.json", "decode", lambda c: c["kernel"] == "fla_copy"),
        ("speed_gdn1.3b_h200_prefill.json", "prefill", lambda c: True),
        ("speed_gdn1.3b_h200_mixer.json", "mixer", lambda c: True),
        ("speed_gdn1.3b_h200_mixer_eager.json", "mixer_memory", lambda c: True),
    ],
}


def merged(model: str) -> dict:
    """One speed document of ``model`` from its runs in :data:`SOURCES`."""
    doc: dict = {"decode": [], "prefill": [], "mixer": []}
    for name, part, keep in SOURCES[model]:
        run = json.loads((RESULTS / name).read_text())
        for key in ("model", "family", "device", "settings", "copy_bandwidth_Bps"):
            doc.setdefault(key, run[key])
        if part == "mixer_memory":
            eager = {(c["pct"], c["batch"], c["seq_len"]): c for c in run["mixer"] if keep(c)}
            for cell in doc["mixer"]:
                src = eager[cell["pct"], cell["batch"], cell["seq_len"]]
                cell.update({k: src[k] for k in ("peak_mem_bytes", "peak_mem_delta_bytes")}, memory_from=name)
            continue
        doc[part] += [c for c in run[part] if keep(c)]
    doc["ratios"] = speed_ratios(doc)
    return doc


def main(figure: str) -> None:
    docs = [merged(m) for m in SOURCES]
    print(speed_markdown(docs))
    speedup_figure(docs, figure)


if __name__ == "__main__":
    main(sys.argv[1])
