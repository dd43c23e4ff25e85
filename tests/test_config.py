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
from _paths import ROOT
from _snakemake import snakemake

from statereduce.config import ConfigError, validate_config
from statereduce.studies import check_studies


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
    elif case == "recall_mix_fraction":
        cfg["models"]["tiny-dn"]["pretrain"]["recall_mix"] = {"fraction": 1.0}
    elif case == "recall_mix_n_pairs":
        cfg["models"]["tiny-dn"]["pretrain"]["recall_mix"] = {"n_pairs": [4, 128]}
    elif case == "recall_mix_key":
        cfg["models"]["tiny-dn"]["pretrain"]["recall_mix"] = {"fractions": 0.3}
    elif case == "speed_kernel":
        cfg["speed"]["decode"] = {"kernels": ["statereduce+fused", "fused"]}
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
    "recall_mix_fraction": r"models\.tiny-dn\.pretrain\.recall_mix\.fraction: 1\.0 is (greater than or equal to the "
    r"maximum of 1|not less than 1)",
    "recall_mix_n_pairs": r"models\.tiny-dn\.pretrain\.recall_mix\.n_pairs\.1: 128 is (greater than the maximum of 90|"
    r"not less than or equal to 90)",
    "recall_mix_key": r"fractions",
    "speed_kernel": r"speed\.decode\.kernels\.1: 'fused' is not one of .*'statereduce\+fused'",
}


def test_shipped_config_is_valid(shipped_config):
    validate_config(shipped_config)


def test_recall_mix_optional(shipped_config):
    """pretrain.recall_mix is optional; given, it passes validation unchanged (statereduce.eval.recall fills
    defaults)."""
    cfg = copy.deepcopy(shipped_config)
    for m in ("tiny-dn", "tiny-gdn"):
        cfg["models"][m]["pretrain"].pop("recall_mix", None)
    assert not {"recall_mix"} & set(validate_config(cfg)["models"]["tiny-dn"]["pretrain"])
    cfg["models"]["tiny-dn"]["pretrain"]["recall_mix"] = {"fraction": 0.25, "n_pairs": [2, 4], "seed": 1}
    out = validate_config(cfg)["models"]["tiny-dn"]["pretrain"]["recall_mix"]
    assert {k: out[k] for k in ("fraction", "n_pairs", "seed")} == {"fraction": 0.25, "n_pairs": [2, 4], "seed": 1}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_config_in_process(shipped_config, case):
    with pytest.raises(ConfigError) as exc:
        validate_config(_mutate(shipped_config, case))
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
    from statereduce.core.models import tiny_config

    cls = adapter_class(family)
    assert cls.arch_dims(arch) == cls.dims(tiny_config(family, arch))


@pytest.mark.parametrize("family", ["delta_net", "gated_deltanet", "mamba2", "qwen3_5"])
def test_config_defaults_pinned_to_fla(family):
    """The adapter's copy of the config keywords and defaults is exactly the real signature's (fails after an
    fla or transformers upgrade that adds, drops or changes one: update ``config_defaults``)."""
    import inspect

    from statereduce.adapters import adapter_class

    cls = adapter_class(family)
    params = inspect.signature(cls.config_class.__init__).parameters
    real = {name: p.default for name, p in params.items() if name not in ("self", "kwargs")}
    assert cls.config_defaults == real


def test_unknown_arch_key_rejected_like_tiny_config():
    """Validation rejects exactly the arch keys ``tiny_config`` rejects (one line, valid keys listed)."""
    from statereduce.adapters import adapter_class
    from statereduce.core.models import tiny_config

    for family, valid in (("delta_net", "expand_v"), ("gated_deltanet", "expand_v"), ("mamba2", "state_size"),
                          ("qwen3_5", "linear_key_head_dim")):
        with pytest.raises(ValueError, match=rf"unknown arch key\(s\) \['expand_kk'\].*valid: .*{valid}") as exc:
            adapter_class(family).arch_dims({"expand_kk": 1.0})
        assert "\n" not in str(exc.value)
        with pytest.raises(ValueError, match="expand_kk"):
            tiny_config(family, {"expand_kk": 1.0})


def test_validation_does_not_import_fla():
    """Validating the config and what rules/common.smk imports at parse time stay clear of fla and
    transformers' model code (importing fla costs ~15 s on every snakemake call)."""
    code = (
        "import sys, yaml\n"
        "from statereduce import config, selectors\n"
        "from statereduce.stages import select\n"
        f"cfg = config.validate_config(yaml.safe_load(open({str(ROOT / 'config.yaml')!r})))\n"
        "for model in cfg['targets']['models']:\n"
        "    config.model_dims(cfg, model)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'fla' or m.startswith('transformers.models'))\n"
        "assert not bad, bad[:5]\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr


def test_validation_imports_no_stage():
    """Config validation (RFT settings included) imports no stage module and none of transformers or peft."""
    code = (
        "import sys, yaml\n"
        "from statereduce import config\n"
        f"cfg = config.validate_config(yaml.safe_load(open({str(ROOT / 'config.yaml')!r})))\n"
        "for model in cfg['models']:\n"
        "    config.check_rft(cfg, model)\n"
        "stages = ('stages.pretrain', 'stages.capture', 'stages.select', 'stages.prune', 'stages.rft', 'core.models')\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('fla', 'transformers', 'peft')\n"
        "             or m in {f'statereduce.{s}' for s in stages})\n"
        "assert not bad, bad[:5]\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr


def test_bad_pct_in_requested_target_fails_at_dag_build(tmp_path):
    """A target path outside the config's pcts is checked too (input functions), before any job."""
    out = _snakemake_dry(tmp_path, None, ["results/tiny-gdn/drrqr_23.4375/eval.json"])
    assert out.returncode != 0
    assert re.search(r"tiny-gdn.*23\.4375.*49", out.stderr + out.stdout)


def _snakemake_dry(tmp_path: Path, cfg: dict | None, targets: list[str] = ()) -> subprocess.CompletedProcess:
    """``snakemake -n`` in ``tmp_path`` with ``cfg`` (default: the shipped config) as its config.yaml; ``--quiet all``
    last (it takes every word after it)."""
    return snakemake(tmp_path, *targets, "-n", "--quiet", "all", cfg=cfg)


@pytest.mark.parametrize("case", ["unknown_selector", "gdn_value_dim_not_integral", "unknown_key", "unknown_arch_key"])
def test_bad_config_through_snakemake(shipped_config, tmp_path, case):
    out = _snakemake_dry(tmp_path, _mutate(shipped_config, case))
    assert out.returncode != 0
    text = out.stderr + out.stdout
    assert re.search(CASES[case], text), text
    lines = [ln for ln in text.splitlines() if re.search(CASES[case], ln)]
    assert lines, text  # the message sits on one line
    assert "rule " not in text  # no job was planned


# studies (paper Tables 2/7 and 16): case -> (mutation of the shipped studies block, one-line message regex)
STUDY_CASES = {
    "unknown_model": (
        lambda s: s["calibration"]["models"].append("tiny-xl"),
        r"^studies\.calibration\.models: unknown model 'tiny-xl'; valid: .*tiny-dn",
    ),
    "unknown_selector": (
        lambda s: s["scoring"]["selectors"].append("wanda"),
        r"^studies\.scoring\.selectors: unknown selector 'wanda'; valid: drrqr, ghost, grad, l1, pca, pca-adv, swanda$",
    ),
    "calibration_free_selector": (
        lambda s: s["calibration"]["selectors"].append("l1"),
        r"^studies\.calibration\.selectors: selector 'l1' reads no calibration data \(needs: weights\).*swanda$",
    ),
    "selector_without_k_q": (
        lambda s: s["scoring"]["selectors"].append("rand"),
        r"^studies\.scoring\.selectors: selector 'rand' has no keys-only/queries-only variants",
    ),
    "unknown_variant": (
        lambda s: s["calibration"]["variants"].append("pg19"),
        r"^studies\.calibration\.variants: unknown calibration 'pg19'; valid: default, n16, prose, seed1$",
    ),
    "pct_leaves_no_channel": (lambda s: s["scoring"].update(pct=99.5), r"^studies\.scoring: .*99\.5.*d_k=64"),
    "pct_out_of_range": (lambda s: s["calibration"].update(pct=100), r"studies\.calibration\.pct: 100 is"),
    "unknown_study": (lambda s: s.update(pruning={}), r"studies.*'pruning' was unexpected"),
}


@pytest.mark.parametrize("case", sorted(STUDY_CASES))
def test_bad_studies_rejected(shipped_config, case):
    cfg = copy.deepcopy(shipped_config)
    mutate, pattern = STUDY_CASES[case]
    mutate(cfg["studies"])
    with pytest.raises(ConfigError) as exc:
        check_studies(validate_config(cfg))
    msg = str(exc.value)
    assert "\n" not in msg
    assert re.search(pattern, msg), msg


def test_studies_cells(shipped_config):
    """The shipped studies expand to one target per cell; no block, no cells."""
    cells = check_studies(validate_config(shipped_config))
    assert len(cells["calibration"]) == 2 * 2 * 4 and len(cells["scoring"]) == 2 * 4 * 3
    assert ("tiny-dn", "grad.prose", 75.0) in cells["calibration"]
    assert ("tiny-dn", "drrqr", 75.0) in cells["calibration"]  # the default variant is the plain token
    assert [c[1] for c in cells["scoring"][:3]] == ["l1", "l1-k", "l1-q"]
    cfg = copy.deepcopy(shipped_config)
    del cfg["studies"]
    assert check_studies(validate_config(cfg)) == {}


# evaluation suites (statereduce.eval.suites): case -> (eval block of tiny-dn, one-line message regex)
EVAL_CASES = {
    "unknown_suite": (
        {"suites": ["lm", "ruler"]},
        r"models\.tiny-dn\.eval\.suites\.1: 'ruler' is not one of \['lm', 'recall', 'recall_probe'\]",
    ),
    "nothing_to_evaluate": (
        {"tasks": [], "suites": []},
        r"^models\.tiny-dn\.eval: nothing to evaluate; give tasks .* or suites$",
    ),
    "bad_probe_level": (
        {"suites": ["recall_probe"], "recall_probe": {"levels": [{"n_pairs": 4, "n_choices": 8}]}},
        r"^models\.tiny-dn\.eval\.recall_probe\.levels: n_choices must be in 2\.\.n_pairs=4, got 8$",
    ),
    "duplicate_probe_level": (
        {"suites": ["recall_probe"], "recall_probe": {"levels": [4, {"n_pairs": 4}]}},
        r"recall_probe\.levels give duplicate task names \['recall_mqar_4'\]",
    ),
}


@pytest.mark.parametrize("case", sorted(EVAL_CASES))
def test_bad_eval_rejected(shipped_config, case):
    cfg = copy.deepcopy(shipped_config)
    block, pattern = EVAL_CASES[case]
    cfg["models"]["tiny-dn"]["eval"].update(block)
    with pytest.raises(ConfigError) as exc:
        validate_config(cfg)
    msg = str(exc.value)
    assert "\n" not in msg
    assert re.search(pattern, msg), msg


def test_unknown_suite_without_schema_names_valid_ones(shipped_config):
    """The package's own check (the schema's enum aside) names the bad suite and the valid ones."""
    from statereduce.config import model_eval

    cfg = copy.deepcopy(shipped_config)
    cfg["models"]["tiny-dn"]["eval"]["suites"] = ["ruler"]
    match = r"^models\.tiny-dn\.eval: unknown evaluation suite 'ruler'; valid: lm, recall, recall_probe$"
    with pytest.raises(ConfigError, match=match):
        model_eval(cfg, "tiny-dn")


def test_model_eval_expands_suites(shipped_config):
    from statereduce.config import model_eval

    cfg = validate_config(shipped_config)
    ev = model_eval(cfg, "gdn1.3b")
    assert ev.suites == ["lm", "recall"]
    lm = ["wikitext", "lambada_openai", "arc_easy", "arc_challenge", "hellaswag", "winogrande", "piqa"]
    assert ev.tasks[:7] == lm
    assert ev.tasks[7:] == ["niah_single_1", "niah_single_2", "niah_single_3", "squad_completion", "swde"]
    assert ev.metadata == {"max_seq_lengths": [2048, 4096]} and ev.max_length == 2048
    assert set(ev.task_max_length) == {"niah_single_1", "niah_single_2", "niah_single_3"}
    # a model without suites keeps exactly its configured settings (no new keys: its rules' params are unchanged)
    tiny = {k: v for k, v in cfg["models"]["tiny-dn"]["eval"].items() if k not in ("suites", "recall_probe")}
    cfg["models"]["tiny-dn"]["eval"] = tiny
    assert not {"suites", "metadata", "task_max_length", "recall_probe"} & set(model_eval(cfg, "tiny-dn").to_dict())
    cfg["models"]["tiny-dn"]["eval"] = {**tiny, "suites": ["recall_probe"], "recall_probe": {"levels": [8]}}
    ev = model_eval(validate_config(cfg), "tiny-dn")
    assert ev.tasks == tiny["tasks"] and ev.recall_probe == {"levels": [8], "n_docs": 100, "seed": 0}


@pytest.mark.parametrize("value", ["max", 0])
def test_bad_micro_batch_names_what_is_valid(shipped_config, value):
    """A value no alternative of the schema accepts fails naming the alternatives (the schema's description)."""
    cfg = copy.deepcopy(shipped_config)
    cfg["rft"]["micro_batch_size"] = value
    with pytest.raises(ConfigError, match=r"^config error at rft\.micro_batch_size: .*; valid: an integer >= 1 .* or "
                                          r"auto \(as many as fit on the GPU, 1 on a CPU\)$"):
        validate_config(cfg)


def test_prune_settings_merge_and_bad_norm_eps(shipped_config):
    """prune.norm_eps: exact by default (also without a prune block), a model's block overrides the top level, a bad
    value fails in one line."""
    from statereduce.config import model_prune

    cfg = copy.deepcopy(shipped_config)
    assert model_prune(cfg, "tiny-dn").norm_eps == "exact"
    assert model_prune(validate_config({k: v for k, v in cfg.items() if k != "prune"}), "tiny-dn").norm_eps == "exact"
    cfg["models"]["tiny-dn"]["prune"] = {"norm_eps": "stock"}
    assert model_prune(validate_config(cfg), "tiny-dn").norm_eps == "stock"
    assert model_prune(cfg, "tiny-gdn").norm_eps == "exact"
    cfg["prune"] = {"norm_eps": "precise"}
    with pytest.raises(ConfigError,
                       match=r"^config error at prune\.norm_eps: 'precise' is not one of \['stock', 'exact'\]$"):
        validate_config(cfg)
    with pytest.raises(ConfigError, match=r"^models\.tiny-gdn\.prune \(with the top-level prune block\): unknown prune "
                                          r"norm_eps 'precise'; valid: stock, exact$"):
        model_prune(cfg, "tiny-gdn")


def test_norm_eps_stock_overlay_sets_stock_for_every_model(shipped_config):
    """configs/norm_eps_stock.yaml, merged after config.yaml as ``--configfile`` merges it, prunes every model with
    ``norm_eps: stock`` (the paper's checkpoints; the overlay of docs/experiments/norm_eps)."""
    import yaml

    from statereduce.config import model_prune

    overlay = yaml.safe_load((ROOT / "configs" / "norm_eps_stock.yaml").read_text())
    assert set(overlay) == {"prune"}
    cfg = validate_config({**copy.deepcopy(shipped_config), **overlay})
    assert {model_prune(cfg, m).norm_eps for m in cfg["models"]} == {"stock"}


@pytest.mark.parametrize("skip", [95, 96, 97])
def test_rank_skip_must_leave_positions(shipped_config, skip):
    """rank.skip positions are dropped from each rank-analysis sequence: at least one must be left."""
    from statereduce.config import model_rank

    cfg = copy.deepcopy(shipped_config)
    cfg["rank"] = {**cfg.get("rank", {}), "seq_len": 96, "skip": skip}
    for m in cfg["models"].values():
        m.pop("rank", None)
    if skip < 96:
        assert model_rank(validate_config(cfg), "tiny-dn").skip == skip
        return
    with pytest.raises(ConfigError, match=rf"^rank\.skip={skip} must be smaller than rank\.seq_len=96 \(model '"):
        validate_config(cfg)
