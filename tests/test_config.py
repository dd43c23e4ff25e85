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
    elif case == "unknown_arch_key":
        cfg["models"]["tiny-gdn"]["pretrain"]["arch"]["head_dims"] = 64
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
    "unknown_arch_key": r"models\.tiny-gdn\.pretrain\.arch: unknown arch key\(s\) \['head_dims'\].*valid: .*head_dim",
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


# (family, arch): omitted keys take fla's defaults, so cover all-default, partial and the shipped archs
ARCHS = [
    ("delta_net", {}),
    ("delta_net", {"hidden_size": 128, "num_hidden_layers": 4, "num_heads": 2, "expand_k": 1.0, "expand_v": 1.0}),
    ("delta_net", {"hidden_size": 96, "num_heads": 4, "expand_k": 0.5}),
    ("delta_net", {"hidden_size": 100, "num_heads": 3, "expand_k": 0.75, "expand_v": 2}),
    ("delta_net", {"num_heads": 8, "expand_v": 0.5}),
    ("gated_deltanet", {}),
    ("gated_deltanet", {"hidden_size": 128, "num_hidden_layers": 4, "num_heads": 2, "head_dim": 64, "expand_v": 1.0}),
    ("gated_deltanet", {"head_dim": 48, "expand_v": 1.5, "num_v_heads": 12}),
    ("gated_deltanet", {"hidden_size": 64, "num_heads": 2}),
    ("gated_deltanet", {"expand_v": 0.75}),
]


@pytest.mark.parametrize("family,arch", ARCHS, ids=[f"{f}-{'-'.join(a) or 'defaults'}" for f, a in ARCHS])
def test_arch_dims_match_fla_config(family, arch):
    """Config-only dims (validation, no fla) equal the adapter's dims of the real fla config."""
    from statereduce.adapters import adapter_class
    from statereduce.models import tiny_config

    cls = adapter_class(family)
    assert cls.arch_dims(arch) == cls.dims(tiny_config(family, arch))


@pytest.mark.parametrize("family", ["delta_net", "gated_deltanet"])
def test_config_defaults_pinned_to_fla(family):
    """The adapter's copy of the fla config keywords and defaults is exactly the real signature's
    (fails after an fla upgrade that adds, drops or changes one: update ``config_defaults``)."""
    import inspect

    from statereduce.adapters import adapter_class

    cls = adapter_class(family)
    params = inspect.signature(cls.config_class.__init__).parameters
    real = {name: p.default for name, p in params.items() if name not in ("self", "kwargs")}
    assert cls.config_defaults == real


def test_unknown_arch_key_rejected_like_tiny_config():
    """Validation rejects exactly the arch keys ``tiny_config`` rejects (one line, valid keys listed)."""
    from statereduce.adapters import adapter_class
    from statereduce.models import tiny_config

    for family in ("delta_net", "gated_deltanet"):
        with pytest.raises(ValueError, match=r"unknown arch key\(s\) \['expand_kk'\].*valid: .*expand_v") as exc:
            adapter_class(family).arch_dims({"expand_kk": 1.0})
        assert "\n" not in str(exc.value)
        with pytest.raises(ValueError, match="expand_kk"):
            tiny_config(family, {"expand_kk": 1.0})


def test_validation_does_not_import_fla():
    """Validating the config and what rules/common.smk imports at parse time stay clear of fla and
    transformers' model code (importing fla costs ~15 s on every snakemake call)."""
    code = (
        "import sys, yaml\n"
        "from statereduce import config, selection, selectors\n"
        f"cfg = config.validate_config(yaml.safe_load(open({str(ROOT / 'config.yaml')!r})))\n"
        "for model in cfg['targets']['models']:\n"
        "    config.model_dims(cfg, model)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'fla' or m.startswith('transformers.models'))\n"
        "assert not bad, bad[:5]\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr


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


@pytest.mark.parametrize("case", ["unknown_selector", "gdn_value_dim_not_integral", "unknown_key", "unknown_arch_key"])
def test_bad_config_through_snakemake(base_config, tmp_path, case):
    out = _snakemake_dry(tmp_path, _mutate(base_config, case))
    assert out.returncode != 0
    text = out.stderr + out.stdout
    assert re.search(CASES[case], text), text
    lines = [ln for ln in text.splitlines() if re.search(CASES[case], ln)]
    assert lines, text  # the message sits on one line
    assert "rule " not in text  # no job was planned
