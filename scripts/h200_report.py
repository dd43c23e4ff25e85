"""The tables of docs/records/speed_h200.md ("All cells") and the figure of docs/speed.md from the recorded H200 runs
in docs/results/.

Each model's cells come from several runs (one GPU call cannot measure everything); every ratio is still taken
within one run: the runs below measure disjoint batch sizes (decode) or disjoint parts, and `speed_ratios` matches a
pruned cell only with the baseline cell of the same batch and kernel.

The fused decode kernels come from one run per model (`speed_*_h200_fused.json`: every batch; PDL on, the conv
PDL-launched only before our recurrent kernel; q, k, v contiguous for fla's functions, DeltaNet's beta sigmoid and
q, k L2 norms in the conv launch; the residual added in place by the down projection). The mixer's time and peak
memory come from one run per model (`speed._time_call`: memory around one eager call, then graph timing; one
warm-up stream for every capture, so cuBLAS workspaces do not pile up across cells).

    python scripts/h200_report.py docs/speedup_h200.png > /tmp/tables.md
"""

import json
import sys
from pathlib import Path

from statereduce.analysis.figures import speedup_figure
from statereduce.speed.bench import speed_ratios
from statereduce.analysis.tables import speed_markdown

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"

ALL = lambda c: True


def _runs(model: str, decode: list[tuple]) -> list[tuple]:
    """``model``'s runs: its stock decode runs, then those every model has (fla copy, fused, prefill, mixer)."""
    common = [("fla_copy", "decode"), ("fused", "decode"), ("prefill", "prefill"),
              ("prefill_16k", "prefill"), ("mixer", "mixer")]
    return [*decode, *((f"speed_{model}_h200_{name}.json", part,
                        (lambda c: c["kernel"] == "fla_copy") if name == "fla_copy" else ALL) for name, part in common)]


# model -> [(file, part, keep(cell) -> bool)]
SOURCES = {
    "dn1.3b": _runs("dn1.3b", [("speed_dn1.3b_h200_stock.json", "decode", lambda c: c["batch"] <= 8),
                               ("speed_dn1.3b_h200_stock_b16-64.json", "decode", lambda c: c["batch"] >= 16)]),
    "gdn1.3b": _runs("gdn1.3b", [("speed_gdn1.3b_h200_stock.json", "decode", ALL),
                                 ("speed_gdn1.3b_h200_stock_b2-32.json", "decode", ALL)]),
}


def merged(model: str) -> dict:
    """One speed document of ``model`` from its runs in :data:`SOURCES`."""
    doc: dict = {"decode": [], "prefill": [], "mixer": []}
    for name, part, keep in SOURCES[model]:
        run = json.loads((RESULTS / name).read_text())
        for key in ("model", "family", "device", "settings", "copy_bandwidth_Bps"):
            doc.setdefault(key, run[key])
        doc[part] += [c for c in run[part] if keep(c)]
    doc["ratios"] = speed_ratios(doc)
    return doc


def main(figure: str) -> None:
    docs = [merged(m) for m in SOURCES]
    print(speed_markdown(docs))
    speedup_figure(docs, figure)


if __name__ == "__main__":
    main(sys.argv[1])
