"""The studies registry (statereduce/studies/): every study module is found, config validation checks each block
against its study's schema and checks, the workflow defines one rule per study, and a new study is one new module
plus its config block (planted in a copy of the workflow, it is validated and planned by ``all_paper``; its table
code runs as the shipped studies' does, tests/test_tables.py)."""

from __future__ import annotations

import copy
import re
import textwrap

import pytest
import yaml
from _paths import ROOT
from _snakemake import copy_workflow, job_outputs, snakemake

from statereduce.config import ConfigError, validate_config
from statereduce.studies import check_studies, get_study, outputs, registered, schema

SHIPPED = ("budgets", "calibration", "compensation", "convolutions", "scoring", "values")


def _config() -> dict:
    return yaml.safe_load((ROOT / "config.yaml").read_text())


def test_the_registry_finds_every_study_module():
    studies = registered()
    assert tuple(studies) == SHIPPED
    assert {s.rule for s in studies.values()} == {"budget_study", "calibration_study", "compensation_study",
                                                 "convolution_tables", "scoring_ablation", "value_study"}
    for study in studies.values():
        assert schema()["properties"][study.name] == study.schema
        assert set(outputs(study)) >= {t.name for t in study.tables} | {f.name for f in study.figures}
        assert all(t.caption.strip() and t.label for t in study.tables)
    with pytest.raises(ValueError, match=r"^unknown study 'pruning'; valid: budgets, calibration, compensation, convolutions, "
                                         r"scoring, values$"):
        get_study("pruning")


@pytest.mark.parametrize("name, change, message", [
    ("scoring", lambda b: b.update(pcts=[75]), r"config error at studies\.scoring: .*'pcts' was unexpected"),
    ("budgets", lambda b: b.pop("budgets"), r"config error at studies\.budgets: 'budgets' is a required property"),
    ("calibration", lambda b: b.update(pct=100), r"config error at studies\.calibration\.pct: 100 is "),
])
def test_a_study_block_is_checked_against_its_modules_schema(name, change, message):
    cfg = _config()
    change(cfg["studies"][name])
    with pytest.raises(ConfigError) as err:
        check_studies(validate_config(cfg))
    assert "\n" not in str(err.value) and re.search(message, str(err.value)), str(err.value)


#: A study that is not shipped: the RFT gain of every targeted cell (a table from the summaries), as a user adds it.
PLANTED = '''
"""RFT gain of each targeted cell: held-out bits per byte before and after RFT."""

from statereduce.common import layout
from statereduce.config.blocks import ConfigError
from statereduce.studies.base import Study, Table, known_models, register, summary_paths


@register
class RftGainStudy(Study):
    name = "rft_gain"
    rule = "rft_gain_table"
    doc = "RFT gain per targeted cell."
    schema = {"type": "object", "additionalProperties": False, "required": ["models"],
              "properties": {"models": {"type": "array", "items": {"type": "string"}, "minItems": 1}}}
    tables = (Table("rft_gain", "RFT gain", "**RFT gain** per cell."),)

    def cells(self, config, block):
        known_models(config, "studies.rft_gain", block["models"])
        t = config["targets"]
        if not set(block["models"]) <= set(t["models"]):
            raise ConfigError("studies.rft_gain.models: only targeted models")
        return [(m, method, float(p)) for m in block["models"] for method in t["methods"] for p in t["pcts"]]

    def inputs(self, config, block, cells):
        return {"summaries": summary_paths(cells)}

    def frames(self, inputs, params):
        import pandas as pd

        from statereduce.core.runtime import read_json

        rows = []
        for doc in map(read_json, inputs["summaries"]):
            m = doc["metrics"]
            rows.append({"model": doc["model"], "method": doc["method"],
                         "gain": m["pruned"]["heldout"]["bits_per_byte"] - m["rft"]["heldout"]["bits_per_byte"]})
        df = pd.DataFrame(rows)
        return {"rft_gain": (df, "# RFT gain\\n\\n" + df.to_markdown(index=False) + "\\n")}
'''


def test_a_new_study_is_one_module_and_its_config_block(tmp_path):
    """Planted in a copy of the workflow, the module alone gives the config a ``studies.rft_gain`` block (checked
    against its schema), a rule and its place in ``all_paper``; nothing else changes."""
    wf = copy_workflow(tmp_path / "wf")
    (wf / "statereduce" / "studies" / "rft_gain.py").write_text(textwrap.dedent(PLANTED))
    cfg = _config()
    cfg["studies"] = {"rft_gain": {"models": ["tiny-dn"]}}
    (wf / "config.yaml").write_text(yaml.safe_dump(cfg))
    out = snakemake(wf, "all_paper", "-n", workflow=wf)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    jobs = job_outputs(out.stdout + out.stderr)
    assert set(jobs["rft_gain_table"]) == {f"results/tables/rft_gain.{ext}" for ext in ("md", "csv", "html", "rst")}
    assert not {"budget_study", "calibration_study", "scoring_ablation", "convolution_tables"} & set(jobs)
    bad = copy.deepcopy(cfg)
    bad["studies"]["rft_gain"]["model"] = ["tiny-dn"]
    (wf / "config.yaml").write_text(yaml.safe_dump(bad))
    out = snakemake(wf, "all_paper", "-n", workflow=wf)
    assert out.returncode != 0
    assert "config error at studies.rft_gain: Additional properties are not allowed ('model' was unexpected)" in (
        out.stdout + out.stderr), (out.stdout + out.stderr)[-3000:]
