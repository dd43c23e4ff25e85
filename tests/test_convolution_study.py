"""The convolution study (paper Tables 14-15): config validation, the tables' layout from evaluation documents, and
its place in ``all_paper``."""

from __future__ import annotations

import copy

import pytest
import yaml
from _paths import ROOT
from _snakemake import dry_run_outputs

from statereduce.config import ConfigError, validate_config
from statereduce.studies import check_studies
from statereduce.studies.convolutions import convolution_frames

STUDY = {"models": {"none": "tiny-dn", "head": "tiny-dn-shared", "all": "tiny-dn-shared-all"},
         "selectors": ["pca-adv", "pca", "grad"], "pcts": [75, 50]}


def _config() -> dict:
    return yaml.safe_load((ROOT / "config.yaml").read_text())


def test_shipped_study_cells_in_table_order():
    cells = check_studies(validate_config(_config()))["convolutions"]
    assert len(cells) == 3 * 2 * 3
    assert cells[:3] == [("tiny-dn", "pca-adv", 75.0), ("tiny-dn", "pca", 75.0), ("tiny-dn", "grad", 75.0)]
    assert {m for m, _, _ in cells} == {"tiny-dn", "tiny-dn-shared", "tiny-dn-shared-all"}


@pytest.mark.parametrize("change, message", [
    (lambda s: s["models"].update(head="tiny-dn"),
     r"^studies\.convolutions\.models\.head: model 'tiny-dn' trains with share_conv 'none'; valid: a model whose "
     r"pretrain\.share_conv is 'head'"),
    (lambda s: s["models"].update(none="nomodel"), r"^studies\.convolutions\.models\.none: unknown model 'nomodel'"),
    (lambda s: s.update(selectors=["pcaa"]), r"^studies\.convolutions\.selectors: unknown selector 'pcaa'; valid: "),
    (lambda s: s.update(pcts=[100]), r"config error at studies\.convolutions\.pcts\.0"),
    (lambda s: s["models"].update(some="tiny-dn"), r"config error at studies\.convolutions\.models"),
])
def test_bad_study_fails_in_one_line(change, message):
    import re

    cfg = _config()
    study = copy.deepcopy(STUDY)
    change(study)
    cfg["studies"]["convolutions"] = study
    with pytest.raises(ConfigError) as err:
        check_studies(validate_config(cfg))
    assert "\n" not in str(err.value) and re.search(message, str(err.value)), str(err.value)


def _eval(bpb, recall=None):
    """An eval.json document as statereduce.eval.run writes it (metrics, suites; model and cell in the path)."""
    doc = {"metrics": {"heldout": {"bits_per_byte": bpb}}, "provenance": {"model_id": "ignored"}}
    if recall is not None:
        doc["metrics"]["recall_mqar_4"] = {"acc": recall}
        doc["suites"] = {"recall_probe": {"recall_mqar_avg": recall}}
    return doc


def test_tables_layout_and_missing_cells(tmp_path):
    baselines = {"tiny-dn": _eval(3.5, recall=0.6), "tiny-dn-shared": _eval(3.6, recall=0.5)}
    pruned = {("tiny-dn", "pca", 75.0): _eval(4.0), ("tiny-dn-shared", "pca", 75): _eval(3.9),
              ("tiny-dn", "pca-adv", 75.0): _eval(7.25), ("other", "pca", 75.0): _eval(1.0)}
    shared, pca = convolution_frames(baselines, pruned, STUDY)
    assert shared["sharing"].tolist() == ["none", "head", "all"]
    assert shared["heldout/bits_per_byte"].tolist()[:2] == [3.5, 3.6]
    cell = pca[(pca.pct == 75.0) & (pca.method == "pca") & (pca.sharing == "head")]
    assert cell["heldout/bits_per_byte"].tolist() == [3.9]
    from _study import write_study

    cells = [list(c) for c in pruned]
    frames = write_study(tmp_path, "convolutions", {"baselines": [baselines.get(m, {}) for m in
                                                                  ("tiny-dn", "tiny-dn-shared", "tiny-dn-shared-all")],
                                                    "pruned": list(pruned.values())},
                         {"block": STUDY, "cells": cells})
    assert set(frames) == {"shared_convolutions", "pca_convolutions"}
    md14 = (tmp_path / "shared_convolutions.md").read_text()
    md15 = (tmp_path / "pca_convolutions.md").read_text()
    assert "| ×✓ | tiny-dn-shared | 3.600 |" in md14 and "| ✓✓ | tiny-dn-shared-all | – |" in md14
    assert "recall_probe/recall_mqar_avg" in md14
    rows = [line for line in md15.splitlines() if line.startswith("| 75% ") or line.startswith("| 0% ")]
    assert rows == ["| 75% | PCA (adv.) | 7.250 | – | – |", "| 75% | PCA (prop.) | 4.000 | 3.900 | – |",
                    "| 75% | Grad | – | – | – |", "| 0% | – | 3.500 | 3.600 | – |"]
    assert md15.index("| 75% ") < md15.index("| 50% ")  # the paper's order: 75% first
    assert (tmp_path / "pca_convolutions.csv").read_text().startswith("pct,method,sharing,model,")


def test_all_paper_plans_the_convolution_tables(tmp_path):
    """``all_paper`` plans the convolution tables, the shared models' pretraining and every cell's pruned
    evaluation, without RFT for them; without the study, none of it."""
    cfg = _config()
    jobs = dry_run_outputs(tmp_path / "paper", "all_paper", "--resources", "gpu=1", cfg=cfg)
    assert set(jobs["convolution_tables"]) == {f"results/tables/{name}_convolutions.{ext}"
                                               for name in ("shared", "pca") for ext in ("md", "csv", "html", "rst")}
    pruned = {p for p in jobs["prune"] if p.endswith("/pruned/eval.json")}
    for model in ("tiny-dn", "tiny-dn-shared", "tiny-dn-shared-all"):
        for target in ("pca-adv_75", "pca_75", "grad_75", "pca-adv_50", "pca_50", "grad_50"):
            assert f"results/{model}/{target}/pruned/eval.json" in pruned, (model, target)
    summaries = set(jobs["summarize"])
    assert not any(p.startswith("results/tiny-dn-shared") for p in summaries)  # read before RFT
    assert {p.split("/")[1] for p in jobs["pretrain"] if p.endswith("pretrain.json")} >= {
        "tiny-dn-shared", "tiny-dn-shared-all"}
    del cfg["studies"]["convolutions"]
    assert "convolution_tables" not in dry_run_outputs(tmp_path / "none", "all_paper", "--resources", "gpu=1", cfg=cfg)
