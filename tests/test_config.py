"""Bad input fails before any job runs, with one line naming the bad value and the valid choices.

Each case is checked twice: in-process against ``validate_config`` (fast, precise message), and
through ``snakemake -n`` on a copy of the config (the real entry point: the error must surface
before any job is scheduled, as a single line).
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from statereduce.config import ConfigError, validate_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def base_config() -> dict:
    with open(ROOT / "config.yaml") as f:
        return yaml.safe_load(f)


def _mutate(cfg: dict, case: str) -> dict:
    cfg = copy.deepcopy(cfg)
    if case == "unknown_model":
        cfg["targets"]["models"] = ["tiny-dn", "tiny-xl"]
    elif case == "unknown_family":
        cfg["models"]["tiny-dn"]["family"] = "mamba3"
    elif case == "unknown_selector":
        cfg["targets"]["methods"] = ["drrqr", "wanda2"]
    elif case == "pct_out_of_range":
        cfg["targets"]["pcts"] = [50, 100]
    elif case == "pct_leaves_no_channel":
        cfg["targets"]["pcts"] = [99.5]  # d_k = 64: removes round(63.68) = 64 channels
    elif case == "gdn_value_dim_not_integral":
        cfg["targets"]["pcts"] = [23.4375]  # d_k 64 -> 49 kept; int(49 * (64 / 49)) == 63 != d_v
    elif case == "unknown_key":
        cfg["models"]["tiny-dn"]["calibration"]["n_sampels"] = 8
    elif case == "unknown_top_key":
        cfg["selecters"] = {}
    else:
        raise AssertionError(case)
    return cfg


# case -> regex the one-line message must match (bad value and valid choices named)
CASES = {
    "unknown_model": r"unknown model 'tiny-xl'; valid: .*tiny-dn",
    "unknown_family": r"unknown family 'mamba3'; valid: delta_net, gated_deltanet",
    "unknown_selector": r"'wanda2'.*(drrqr|valid)",
    "pct_out_of_range": r"targets\.pcts\.1: 100 is (greater than or equal to the maximum of 100|not less than 100)",
    "pct_leaves_no_channel": r"99\.5.*64",
    "gdn_value_dim_not_integral": r"tiny-gdn.*23\.4375.*49",
    "unknown_key": r"n_sampels",
    "unknown_top_key": r"selecters",
}


def test_shipped_config_is_valid(base_config):
    validate_config(base_config)


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_config_in_process(base_config, case):
    with pytest.raises(ConfigError) as exc:
        validate_config(_mutate(base_config, case))
    msg = str(exc.value)
    assert "\n" not in msg
    assert re.search(CASES[case], msg), msg


def test_bad_pct_in_requested_target_fails_at_dag_build(tmp_path):
    """A target path outside the config's pcts is checked too (input functions), before any job."""
    out = _snakemake_dry(tmp_path, None, ["results/tiny-gdn/drrqr_23.4375/eval.json"])
    assert out.returncode != 0
    assert re.search(r"tiny-gdn.*23\.4375.*49", out.stderr + out.stdout)


def _snakemake_dry(tmp_path: Path, cfg: dict | None, targets: list[str] = ()) -> subprocess.CompletedProcess:
    """``snakemake -n`` in ``tmp_path`` with ``cfg`` (default: the shipped config) as its config.yaml."""
    if cfg is None:
        cfg = yaml.safe_load((ROOT / "config.yaml").read_text())
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    args = [sys.executable, "-m", "snakemake", "-n", "--quiet", "all", "-s", str(ROOT / "Snakefile"),
            "--directory", str(tmp_path)]
    return subprocess.run(args + list(targets), capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("case", ["unknown_selector", "gdn_value_dim_not_integral", "unknown_key"])
def test_bad_config_through_snakemake(base_config, tmp_path, case):
    out = _snakemake_dry(tmp_path, _mutate(base_config, case))
    assert out.returncode != 0
    text = out.stderr + out.stdout
    assert re.search(CASES[case], text), text
    lines = [ln for ln in text.splitlines() if re.search(CASES[case], ln)]
    assert lines, text  # the message sits on one line
    assert "rule " not in text  # no job was planned
