"""The typed settings (statereduce/common/settings.py): their defaults, one-line errors, the plain dicts they give back
(the rules' params, byte for byte: Snakemake reruns a job whose params' repr changed) and the schema's documented
defaults."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import yaml
from _paths import ROOT

from statereduce import config as srconfig
from statereduce.common import settings as st
# The defaults as the dicts that held them before the settings were typed (config.CALIBRATION_DEFAULTS, EVAL_DEFAULTS,
# RANK_DEFAULTS, DEFAULT_RFT, DEFAULT_THREADS; pretrain.DEFAULT_TRAIN; speed.bench.DEFAULT_SPEED; eval.recall's
# RECALL_MIX_DEFAULTS; eval.suites' RECALL_PROBE_DEFAULTS), after their checks normalised them (betas as lists of
# floats).
OLD_DEFAULTS = {
    st.CalibrationSettings: {"split": "calib", "n_samples": 32, "seq_len": 256, "seed": 0, "rows_per_head": 2500,
                             "batch_size": 4},
    st.EvalSettings: {"tasks": ["heldout"], "max_docs": 64, "max_doc_bytes": 2048, "batch_size": 1,
                      "max_length": 2048, "limit": None},
    st.RankSettings: {"n_samples": 4, "seed": 0, "seq_len": 512, "skip": 128, "spectrum_head": [0, 0], "stride": 64},
    st.RftSettings: {
        "lora": {"rank": 32, "alpha": 64, "dropout": 0.0},
        "distill": {"temperature": 2.0, "kl_weight": 1.0, "lm_weight": 0.0},
        "scope": "auto", "n_samples": 32000, "seq_len": 2048, "batch_size": 16, "micro_batch_size": "auto",
        "lr": 1e-4, "min_lr": 1e-5, "warmup_frac": 0.05, "weight_decay": 0.0, "betas": [0.9, 0.999],
        "grad_clip": 1.0, "precision": "auto", "kernels": "auto", "seed": 0, "log_every": 10, "save_every": 100,
        "val_samples": 64, "val_seq_len": None, "keep": "best", "best_metric": "ce",
    },
    st.TrainSettings: {"steps": 700, "batch_size": 4, "seq_len": 128, "lr": 3e-3, "min_lr": None,
                       "weight_decay": 0.1, "betas": [0.9, 0.95], "warmup": 50, "grad_clip": 1.0, "seed": 0,
                       "threads": 1, "log_every": 10, "eval_blocks": 16},
    st.SpeedSettings: {
        "pcts": [50, 75], "dtype": "bfloat16", "blas": None, "pdl": True,
        "decode": {"prompt": 512, "batches": [1, 2, 4, 8, 16, 32, 64], "warmup": 10, "steps": 100, "trials": 3,
                   "kernels": ["fla", "statereduce", "fla_copy", "fla+fused", "statereduce+fused", "fla_copy+fused"],
                   "check_steps": 3},
        "prefill": {"batches": [1, 4, 8, 16], "lengths": [2048, 8192, 16384], "warmup": 1, "steps": 3, "trials": 3,
                    "graph": True, "profile": True},
        "mixer": {"batches": [8, 16, 32], "seq_len": 2048, "warmup": 3, "steps": 10, "trials": 3, "arch": {},
                  "graph": True, "profile": True},
        "profile": {"batches": [1, 64], "steps": 10, "top": 30},
    },
    st.RecallMixSettings: {"fraction": 0.2, "n_pairs": [1, 2], "seed": 0, "pure_steps": 0, "pure_lr": 1e-3,
                           "answer_loss": False, "check_every": 50},
    st.RecallProbeSettings: {"levels": [4, 16, 64], "n_docs": 100, "seed": 0},
    st.DeviceSettings: {"dtype": "float32", "device": "cpu", "threads": 1},
    st.RftPlan: {"activate": True, "corpus": None, "gpus": 1, "settings": {}},
    st.GradSettings: {},
    st.InitSettings: {"arch": {}, "seed": 0},
    st.HubSettings: {"id": "", "revision": "main"},
}
CLASSES = sorted(OLD_DEFAULTS, key=lambda c: c.__name__)


def _same(a, b) -> bool:
    """The same plain data, key order and value types included (what a job's params and a record hold)."""
    return repr(a) == repr(b) and json.dumps(a) == json.dumps(b)


@pytest.fixture(scope="module")
def cfg():
    return srconfig.validate_config(yaml.safe_load((ROOT / "config.yaml").read_text()))


# ---- defaults ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_defaults_are_the_old_ones(cls):
    assert _same(cls().to_dict(), OLD_DEFAULTS[cls])
    assert cls.from_dict(None) == cls.from_dict({}) == cls()


def test_device_threads_default_by_device():
    assert st.DeviceSettings(device="cuda").threads == 4 and st.DeviceSettings(threads=3).threads == 3


def test_nested_blocks_merge_key_by_key():
    rft = st.RftSettings.from_dict({"lora": {"rank": 4}, "betas": [1, 0.9]})
    assert rft.lora == st.LoraSettings(rank=4, alpha=64, dropout=0.0) and rft.betas == [1.0, 0.9]
    speed = st.SpeedSettings.from_dict({"decode": {"batches": [64]}})
    assert speed.decode.batches == [64] and speed.decode.steps == 100
    assert st.PretrainSettings.from_dict({"train": {"steps": 9, "warmup": 1}}).train.lr == 3e-3


def test_settings_are_frozen_and_replace_checks_again():
    rft = st.RftSettings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        rft.lr = 1.0
    assert rft.replace(lr=2e-4).lr == 2e-4 and rft.lr == 1e-4
    with pytest.raises(ValueError, match=r"rft lr must be > 0 and min_lr >= 0; got lr=0"):
        rft.replace(lr=0)
    assert st.RftSettings.coerce(rft) is rft


def test_to_dict_hands_out_copies():
    rft = st.RftSettings()
    d = rft.to_dict()
    d["betas"].append(1.0)
    d["lora"]["rank"] = 1
    assert rft.betas == [0.9, 0.999] and rft.lora.rank == 32


# ---- errors -----------------------------------------------------------------------------------------------------
UNKNOWN = {
    st.RftSettings: r"^unknown rft key\(s\) \['bogus'\]; valid: batch_size, best_metric, betas, distill, grad_clip, keep, ",
    st.LoraSettings: r"^unknown rft\.lora key\(s\) \['bogus'\]; valid: alpha, dropout, rank$",
    st.DistillSettings: r"^unknown rft\.distill key\(s\) \['bogus'\]; valid: kl_weight, lm_weight, temperature$",
    st.TrainSettings: r"^unknown train key\(s\) \['bogus'\]; valid: batch_size, betas, eval_blocks, ",
    st.SpeedSettings: r"^unknown speed setting 'bogus'; valid: pcts, dtype, blas, pdl, decode, prefill, mixer, "
                      r"profile$",
    st.DecodeSettings: r"^unknown speed\.decode setting\(s\) \['bogus'\]; valid: prompt, batches, warmup, steps, ",
    st.RecallMixSettings: r"^unknown recall_mix keys \['bogus'\]; valid: fraction, n_pairs, seed, pure_steps, "
                          r"pure_lr, answer_loss, until, check_every$",
    st.RecallProbeSettings: r"^unknown recall_probe keys \['bogus'\]; valid: levels, n_docs, seed$",
    st.CalibrationSettings: r"^unknown calibration key\(s\) \['bogus'\]; valid: batch_size, corpus, n_samples, "
                            r"rows_per_head, seed, seq_len, split$",
    st.EvalSettings: r"^unknown eval key\(s\) \['bogus'\]; valid: batch_size, corpus, corpus_spec, limit, ",
    st.RankSettings: r"^unknown rank key\(s\) \['bogus'\]; valid: corpus, corpus_spec, n_samples, seed, seq_len, ",
    st.PretrainSettings: r"^unknown pretrain key\(s\) \['bogus'\]; valid: arch, corpus, recall_mix, share_conv, "
                         r"train$",
    st.RftPlan: r"^unknown rft key\(s\) \['bogus'\]; valid: activate, corpus, gpus, settings$",
}


@pytest.mark.parametrize("cls", sorted(UNKNOWN, key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_unknown_key_names_it_and_the_valid_ones(cls):
    with pytest.raises(ValueError, match=UNKNOWN[cls]) as err:
        cls.from_dict({"bogus": 1})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("cls", "block", "message"),
    [
        (st.RftSettings, {"precision": "fp16"}, r"^unknown rft precision 'fp16'; valid: auto, bf16, fp32$"),
        (st.RftSettings, {"kernels": "cuda"}, r"^unknown rft kernels 'cuda'; valid: auto, fla, torch$"),
        (st.RftSettings, {"micro_batch_size": 0}, r"^rft micro_batch_size must be an integer >= 1 or auto, got 0$"),
        (st.SpeedSettings, {"blas": "cuBLAS"}, r"^unknown speed blas 'cuBLAS'; valid: cublas, cublaslt, or null"),
        (st.SpeedSettings, {"pdl": "yes"}, r"^speed pdl must be true or false; got 'yes'$"),
        (st.DeviceSettings, {"device": "tpu"}, r"^unknown device 'tpu'; valid: cpu, cuda$"),
        (st.TrainSettings, {"steps": 3, "warmup": 3}, r"^train warmup must be in \[0, steps=3\), got 3$"),
        (st.LoraSettings, {"rank": 0}, r"^rft lora needs rank >= 1, alpha > 0, dropout in \[0, 1\); got "
                                       r"\{'rank': 0, 'alpha': 64, 'dropout': 0\.0\}$"),
    ],
    ids=["rft-precision", "rft-kernels", "micro-batch", "blas", "pdl", "device", "warmup", "lora"],
)
def test_bad_values_fail_in_one_line(cls, block, message):
    with pytest.raises(ValueError, match=message):
        cls.from_dict(block)


def test_micro_batch_takes_auto_or_a_divisor():
    assert st.RftSettings.from_dict({"micro_batch_size": "auto"}).micro_batch_size == "auto"
    assert st.RftSettings.from_dict({"batch_size": 4, "micro_batch_size": 2}).micro_batch_size == 2


# ---- the plain dicts: params and records --------------------------------------------------------------------------
def _typed(cfg, model):
    """Every typed settings object config.py builds for ``model``, by name."""
    out = {"calibration": srconfig.model_calibration(cfg, model), "eval": srconfig.model_eval(cfg, model),
           "rank": srconfig.model_rank(cfg, model), "rft": srconfig.model_rft(cfg, model)}
    for variant in cfg.get("calibrations", {}):
        out[f"calibration.{variant}"] = srconfig.model_calibration(cfg, model, variant)
    if "pretrain" in cfg["models"][model]:
        out["pretrain"] = srconfig.model_pretrain(cfg, model)
    try:
        out["speed"] = srconfig.model_speed(cfg, model)
    except srconfig.ConfigError:  # a family the speed benchmarks do not cover
        pass
    plan = out["rft"]
    if plan.activate:
        out["rft.settings"] = plan.settings
    return out


def test_to_dict_round_trips_byte_for_byte_for_the_shipped_models(cfg):
    seen = 0
    for model in cfg["models"]:
        for name, obj in _typed(cfg, model).items():
            d = obj.to_dict()
            again = type(obj).from_dict(json.loads(json.dumps(d))).to_dict()
            assert _same(again, d), (model, name)
            assert type(obj).from_dict(d) == obj, (model, name)
            seen += 1
    assert seen > 50


def test_params_are_the_dicts_of_the_old_merges(cfg):
    """The rules' params from the typed settings equal what the untyped merges gave: the defaults dict updated by the
    configured blocks (calibration; rank, canonical; the RFT plan, canonical)."""
    for model, m in cfg["models"].items():
        old_cal = {**OLD_DEFAULTS[st.CalibrationSettings], **m.get("calibration", {})}
        assert _same(srconfig.model_calibration(cfg, model).to_dict(), old_cal), model
        for variant, block in cfg.get("calibrations", {}).items():
            assert _same(srconfig.model_calibration(cfg, model, variant).to_dict(), {**old_cal, **block})
        rank = {**OLD_DEFAULTS[st.RankSettings], **cfg.get("rank", {}), **m.get("rank", {})}
        rank["corpus"] = rank.get("corpus") or srconfig.model_eval_corpus(cfg, model)
        assert _same(srconfig.model_rank(cfg, model).to_dict(), srconfig.canonical(rank)), model
        merged = copy.deepcopy(cfg.get("rft", {}))
        for key, value in m.get("rft", {}).items():
            merged[key] = {**merged.get(key, {}), **value} if isinstance(value, dict) else value
        plan = {"activate": merged.pop("activate", True), "corpus": merged.pop("corpus", None),
                "gpus": merged.pop("gpus", 1)}
        plan["corpus"] = plan["corpus"] or m.get("calibration", {}).get("corpus")
        plan["settings"] = merged
        assert _same(srconfig.model_rft(cfg, model).to_dict(), srconfig.canonical(plan)), model


def test_eval_settings_are_in_field_order():
    """The settings keep their fields' order and nothing else: the order Snakemake's params keep for finished runs
    (a recall_probe block the suite expansion filled in, last) is the workflow's (rules/common.smk: get_eval)."""
    ev = st.EvalSettings.from_dict({"suites": ["recall_probe"], "recall_probe": {"n_docs": 8}, "tasks": ["heldout"]})
    assert list(ev.to_dict()) == [n for n in st.EvalSettings.field_names() if n in ev.to_dict()]
    assert "_probe_last" not in repr(ev) and not any(n.startswith("_") for n in st.EvalSettings.field_names())


def test_records_store_the_plain_settings():
    """What the stages write (rft_record settings and schedule, pretrain.json's train block, speed.json's settings) is
    ``to_dict()``: JSON-serialisable, with the old keys."""
    from statereduce.core.runtime import Schedule

    sched = Schedule(lr=1e-4, min_lr=1e-5, warmup=100, steps=2000)
    assert list(sched.to_dict()) == ["lr", "min_lr", "warmup", "steps"]
    for cls in (st.RftSettings, st.TrainSettings, st.SpeedSettings):
        json.dumps(cls().to_dict())


# ---- the schema documents these defaults ---------------------------------------------------------------------------
def _schema_defaults(node, path=()):
    """``(path to the property, default)`` of every ``default`` in the schema."""
    if isinstance(node, dict):
        if "default" in node:
            yield path, node["default"]
        for key, value in node.items():
            if key != "default":
                yield from _schema_defaults(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _schema_defaults(value, (*path, i))


def _owner(block: tuple, key: str) -> type[st.Settings]:
    """The settings class whose field the schema property ``block.properties.key`` documents."""
    model = ("$defs", "model", "properties")
    owners = {
        ("$defs", "calibration"): st.CalibrationSettings,
        ("$defs", "evaluation"): st.EvalSettings,
        ("$defs", "rft"): st.RftPlan if key in st.RftPlan.field_names() else st.RftSettings,
        ("$defs", "prune"): st.PruneSettings,
        ("$defs", "budget"): st.BudgetSettings,
        ("$defs", "fit"): st.FitSettings,
        (*model, "pretrain", "properties", "recall_mix"): st.RecallMixSettings,
        (*model, "pretrain"): st.PretrainSettings,
        (*model, "init"): st.InitSettings,
        (*model, "hub"): st.HubSettings,
        ("$defs", "model"): st.DeviceSettings,
        ("$defs", "speed"): st.SpeedSettings,
    }
    assert block in owners, f"schema default at {'.'.join(map(str, block))}.{key} documents no settings class"
    return owners[block]


def _schema_enums(node, path=()):
    """``(block, key, enum)`` of every property with an ``enum`` in the schema."""
    if isinstance(node, dict):
        for key, value in node.get("properties", {}).items():
            if isinstance(value, dict) and "enum" in value:
                yield path, key, value["enum"]
        for key, value in node.items():
            yield from _schema_enums(value, (*path, key))


def test_schema_enums_are_the_fields_valid_values():
    """A :func:`~statereduce.common.settings.choice` field's valid values are the schema's enum of it, and every choice
    field of a documented block has one."""
    checked = set()
    for path, key, enum in _schema_enums(srconfig.load_schema()):
        block = path[:-1] if path and path[-1] == "properties" else path
        try:
            cls = _owner(block, key)
        except AssertionError:
            continue  # a block that no settings class holds (corpora, suites)
        field = next((f for f in dataclasses.fields(cls) if f.name == key), None)
        if field is not None and "valid" in field.metadata:
            assert sorted(map(str, enum)) == sorted(map(str, cls.valid(key))), \
                f"{cls.__name__}.{key}: schema {enum}, field {cls.valid(key)}"
            checked.add((cls, key))
    choices = {(cls, f.name) for cls in (st.CalibrationSettings, st.EvalSettings, st.RftSettings, st.PruneSettings,
                                          st.BudgetSettings, st.DeviceSettings, st.SpeedSettings, st.PretrainSettings)
               for f in dataclasses.fields(cls) if "valid" in f.metadata}
    assert choices <= checked, sorted((c.__name__, k) for c, k in choices - checked)
    assert len(checked) >= 13


@pytest.mark.parametrize("cls", [c for c in vars(st).values()
                                 if isinstance(c, type) and issubclass(c, st.Settings) and dataclasses.is_dataclass(c)])
def test_a_choice_field_refuses_what_it_does_not_list(cls):
    for f in dataclasses.fields(cls):
        if "valid" in f.metadata:
            with pytest.raises(ValueError, match=r"^unknown .*'not-valid'; valid: "):
                cls(**{f.name: "not-valid"})


def test_every_schema_default_is_the_settings_default():
    schema = srconfig.load_schema()
    found = 0
    for path, default in _schema_defaults(schema):
        assert path[-2] == "properties", path
        block, key = path[:-2], path[-1]
        cls = _owner(block, key)
        value = getattr(cls(), key)
        value = value.to_dict() if isinstance(value, st.Settings) else value
        assert _same(default, value), f"{'.'.join(map(str, path))}: schema {default!r}, {cls.__name__} {value!r}"
        found += 1
    assert found >= 20
