"""Evaluation through lm-eval (statereduce.eval: harness, tasks, documents): local tasks, metrics, eval.json, summary.

The perplexity checks compare lm-eval's numbers with an independent computation: a plain forward pass
per rolling window, the window layout written out here (first window conditioned on the prefix token,
later windows of ``max_length`` predicted tokens each conditioned on the token before them, the last
window left-extended to ``max_length`` inputs) and words counted as lm-eval's wikitext task does,
``len(re.split(r"\\s+", doc))``.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from _models import tiny_arch

from statereduce.eval import documents as ed
from statereduce.eval import harness as ev
from statereduce.eval import tasks as et

EOS = 256
DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    (" = Valkyria Chronicles III = \n\n"
     " Senjō no Valkyria 3 : Unrecorded Chronicles is a tactical role @-@ playing game .\n"),
    "[1, 2, 3]",  # a rendered "{{text}}" target would be literal_eval-ed into a list
    "naïve café — ünïcödé bytes, tabs\tand  double  spaces ",
    "x",
]


@pytest.fixture(scope="module")
def model():
    from statereduce.kernels import fla_fallback

    fla_fallback.install()
    from fla.models import DeltaNetConfig, DeltaNetForCausalLM

    torch.manual_seed(0)
    arch = tiny_arch("delta_net", vocab_size=257, bos_token_id=EOS, eos_token_id=EOS, pad_token_id=EOS)
    cfg = DeltaNetConfig(**arch, fuse_cross_entropy=False)
    m = DeltaNetForCausalLM(cfg)
    with torch.no_grad():  # fla's conv init (std 0.02) leaves the model almost uniform; make it less trivial
        for name, p in m.named_parameters():
            if "conv1d" in name or "embeddings" in name:
                p.normal_(0.0, 0.5)
    return m.float().eval()


def _window_nll(model, inputs: list[int], targets: list[int]) -> float:
    """Sum of -log p(targets) from the last len(targets) positions of one plain forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([inputs]), use_cache=False).logits[0].double()
    logp = torch.log_softmax(logits[-len(targets) :], dim=-1)
    return -float(logp.gather(1, torch.tensor(targets)[:, None]).sum())


def _independent_nll(model, tok, doc: str, max_length: int) -> float:
    """Rolling-window NLL of one document, written out independently of lm-eval's code."""
    ids = tok.encode(doc)
    full = [EOS] + ids  # full[i] is the input that predicts ids[i]
    n, total = len(ids), 0.0
    for start in range(0, n, max_length):
        end = min(start + max_length, n)
        lo = max(0, end - max_length)  # the last window is left-extended to max_length inputs
        total += _window_nll(model, full[lo:end], ids[start:end])
    return total


def _words(doc: str) -> int:
    return len(re.split(r"\s+", doc))


@pytest.fixture(scope="module")
def single_window(model, tok, tmp_path_factory):
    """One lm-eval run on docs shorter than max_length (one window each), through evaluate_and_write."""
    out = tmp_path_factory.mktemp("eval") / "pruned" / "eval.json"
    doc = ev.evaluate_and_write(
        model,
        tok,
        out,
        eval_cfg={"tasks": [], "batch_size": 1, "max_length": 256, "device": "cpu"},
        heldout_docs=DOCS,
        checkpoint="results/tiny/l1_50/pruned",
        model_id="tiny",
        extra_provenance={"stage": "pruned"},
    )
    return out, doc


# ---------------------------------------------------------------------------------------------
def test_write_perplexity_task_files(tmp_path):
    name = et.write_perplexity_task(DOCS, tmp_path / "tasks", "my_ppl")
    assert name == "my_ppl"
    cfg = yaml.safe_load((tmp_path / "tasks" / "my_ppl.yaml").read_text())
    assert cfg["task"] == "my_ppl"
    assert cfg["dataset_path"] == "json"
    data = Path(cfg["dataset_kwargs"]["data_files"]["test"])
    assert data.is_absolute() and data == (tmp_path / "tasks" / "my_ppl.jsonl").resolve()
    assert cfg["output_type"] == "loglikelihood_rolling" and cfg["test_split"] == "test"
    assert cfg["doc_to_text"] == ""
    assert [m["metric"] for m in cfg["metric_list"]] == ["word_perplexity", "byte_perplexity", "bits_per_byte"]
    assert "version" in cfg["metadata"]
    rows = [json.loads(line) for line in data.read_text(encoding="utf-8").splitlines()]
    assert [r["text"] for r in rows] == DOCS  # exact round trip, whitespace and non-ASCII included
    assert not [p for p in (tmp_path / "tasks").iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize(
    "docs, name, match",
    [([], "ok", "docs is empty"), (["a", ""], "ok", r"docs\[1\]"), (["a"], "bad name", "invalid task name")],
    ids=["no-docs", "empty-doc", "bad-name"],
)
def test_write_perplexity_task_rejects(tmp_path, docs, name, match):
    with pytest.raises(ValueError, match=match):
        et.write_perplexity_task(docs, tmp_path, name)


def test_local_perplexity_matches_independent(model, tok, single_window):
    _, doc = single_window
    m = doc["metrics"][et.HELDOUT]
    assert set(m) == {"word_perplexity", "byte_perplexity", "bits_per_byte"}
    assert all(math.isfinite(v) and v > 0 for v in m.values())
    assert doc["lm_eval"]["n-samples"][et.HELDOUT]["effective"] == len(DOCS)
    assert all(len(tok.encode(d)) < 256 for d in DOCS)

    nll = sum(_independent_nll(model, tok, d, 256) for d in DOCS)
    words = sum(_words(d) for d in DOCS)
    nbytes = sum(len(d.encode("utf-8")) for d in DOCS)
    assert math.log(m["word_perplexity"]) == pytest.approx(nll / words, rel=1e-5)
    assert math.log(m["byte_perplexity"]) == pytest.approx(nll / nbytes, rel=1e-5)
    assert m["bits_per_byte"] == pytest.approx(nll / nbytes / math.log(2), rel=1e-5)
    # a random model is near uniform over 257 tokens but must not be exactly uniform
    assert 100 < m["byte_perplexity"] < 1000 and m["byte_perplexity"] != pytest.approx(257.0, rel=1e-3)
    # raw lm-eval keys are kept in the raw part
    assert "word_perplexity,none" in doc["lm_eval"]["results"][et.HELDOUT]


def test_lm_evals_environment_report_is_not_run(model, tok, tmp_path, monkeypatch):
    """lm-eval's add_env_info (torch's collect_env: pip list and other programs, seconds a call) is not run: its keys
    are dropped from eval.json anyway."""
    import torch.utils.collect_env

    calls = []
    monkeypatch.setattr(torch.utils.collect_env, "get_pretty_env_info", lambda: calls.append(1) or "")
    doc = ev.evaluate_and_write(model, tok, tmp_path / "eval.json",
                                eval_cfg={"tasks": [], "batch_size": 1, "max_length": 256, "device": "cpu"},
                                heldout_docs=DOCS[:1], checkpoint="results/tiny/l1_50/pruned", model_id="tiny")
    assert calls == [] and "pretty_env_info" not in json.dumps(doc)
    assert math.isfinite(doc["metrics"][et.HELDOUT]["bits_per_byte"])


def test_rolling_windows_and_padded_batches_match_independent(model, tok, tmp_path):
    docs = [DOCS[1], DOCS[3] * 2, DOCS[0]]  # 92, ~120, 44 tokens: 3, 4 and 2 windows of 32, mixed lengths
    name = et.write_perplexity_task(docs, tmp_path, "rolling_ppl")
    res = ev.evaluate_model(model, tok, [name], include_path=tmp_path, batch_size=3, max_length=32, device="cpu")
    m = res["metrics"][name]
    nll = sum(_independent_nll(model, tok, d, 32) for d in docs)
    assert math.log(m["word_perplexity"]) == pytest.approx(nll / sum(_words(d) for d in docs), rel=1e-5)
    # the window layout is visible at this tolerance: one long window per doc gives another number
    nll_one_window = sum(_independent_nll(model, tok, d, 1024) for d in docs)
    assert abs(nll_one_window - nll) > 20 * 1e-5 * nll
    assert res["settings"]["max_length"] == 32 and res["settings"]["batch_size"] == 3
    json.dumps(res, allow_nan=False)


def test_unknown_task_is_a_clear_error(tmp_path):
    et.write_perplexity_task(["a b"], tmp_path, "present_ppl")
    with pytest.raises(
        ValueError, match=r"unknown lm-eval task 'presnt_ppl' \(searched .*\); close matches: present_ppl"
    ):
        ev.build_task_manager(["present_ppl", "presnt_ppl"], tmp_path, include_defaults=False)


@pytest.mark.slow
def test_unknown_task_is_a_clear_error_with_lm_eval_index(tmp_path):
    """Scans lm-eval's ~15k task YAMLs (15-70 s on 2 cores)."""
    et.write_perplexity_task(["a b"], tmp_path, "present_ppl")
    with pytest.raises(ValueError, match=r"unknown lm-eval task 'wikitextt'.*close matches: .*\bwikitext\b"):
        ev.build_task_manager(["present_ppl", "wikitextt"], tmp_path)


def test_task_manager_skips_builtin_index_for_local_tasks(tmp_path):
    et.write_perplexity_task(["a b"], tmp_path, "only_local_ppl")
    tm = ev.build_task_manager(["only_local_ppl"], tmp_path)
    assert "only_local_ppl" in tm.all_tasks and "wikitext" not in tm.all_tasks


def test_eval_json_written_with_state_and_provenance(single_window):
    out, doc = single_window
    on_disk = json.loads(out.read_text())
    assert on_disk == doc
    # tiny DeltaNet: 2 layers x 2 heads x d_k 32 x d_v 32 x 4 bytes
    assert doc["state"]["state_bytes_per_sequence"] == 2 * 2 * 32 * 32 * 4
    assert (doc["state"]["d_k"], doc["state"]["d_v"], doc["state"]["num_heads"], doc["state"]["layers"]) == (
        32,
        32,
        2,
        2,
    )
    p = doc["provenance"]
    assert p["checkpoint"] == "results/tiny/l1_50/pruned" and p["model_id"] == "tiny" and p["stage"] == "pruned"
    assert p["tasks"] == [et.HELDOUT] and p["settings"]["max_length"] == 256
    for key in ("statereduce", "lm_eval", "torch"):
        assert p["versions"][key]
    assert p["date"]
    assert not [f for f in os.listdir(out.parent) if f.endswith(".tmp")]


def test_write_json_atomic_keeps_old_file_on_failure(tmp_path, monkeypatch):
    from statereduce.core import runtime
    path = tmp_path / "eval.json"
    runtime.write_json(path, {"a": 1, "nan": float("nan"), "np": np.float32(0.5)})
    assert json.loads(path.read_text()) == {"a": 1, "nan": "nan", "np": 0.5}

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(runtime.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        runtime.write_json(path, {"a": 2})
    assert json.loads(path.read_text())["a"] == 1
    assert sorted(os.listdir(tmp_path)) == ["eval.json"]


def test_write_eval_json_requires_state(tmp_path):
    result = {"metrics": {}, "settings": {"tasks": []}}
    with pytest.raises(ValueError, match="state"):
        ed.write_eval_json(tmp_path / "e.json", result, {"checkpoint": "x"})
    assert not (tmp_path / "e.json").exists()


def test_clean_metrics_names():
    raw = {
        "lambada_openai": {
            "alias": "lambada_openai",
            "perplexity,none": np.float64(3.5),
            "perplexity_stderr,none": 0.1,
            "acc,none": 0.5,
            "acc_stderr,none": "N/A",
            "sample_len": 5153,
        },
        "gsm8k": {"exact_match,strict-match": 0.25, "exact_match,flexible-extract": 0.3},
    }
    clean = ev.clean_metrics(raw)
    assert clean == {
        "lambada_openai": {"perplexity": 3.5, "perplexity_stderr": 0.1, "acc": 0.5},
        "gsm8k": {"exact_match/strict-match": 0.25, "exact_match/flexible-extract": 0.3},
    }


# ---------------------------------------------------------------------------------------------
def _fake_eval(ppl: float, state_bytes: int, d_k: int, tasks=("statereduce_heldout",), max_length=256) -> dict:
    return {
        "metrics": {t: {"word_perplexity": ppl} for t in tasks},
        "settings": {"tasks": list(tasks), "max_length": max_length, "limit": None},
        "state": {"state_bytes_per_sequence": state_bytes, "d_k": d_k, "d_v": 32, "num_heads": 2, "layers": 2},
        "provenance": {"checkpoint": f"ckpt_{d_k}", "date": "2026-01-01T00:00:00+00:00"},
    }


def test_summarize_synthetic():
    base, pruned = _fake_eval(20.0, 16384, 32), _fake_eval(25.0, 8192, 16)
    s = ed.summarize(base, pruned, None, {"model": "tiny", "method": "l1", "pct": 50, "selection": "x.parquet"})
    assert (s["model"], s["method"], s["pct"]) == ("tiny", "l1", 50)
    assert s["metrics"]["baseline"]["statereduce_heldout"]["word_perplexity"] == 20.0
    assert s["metrics"]["pruned"]["statereduce_heldout"]["word_perplexity"] == 25.0
    assert s["metrics"]["rft"] is None
    assert s["state"]["bytes_before"] == 16384 and s["state"]["bytes_after"] == 8192 and s["state"]["ratio"] == 0.5
    assert s["provenance"]["selection"] == "x.parquet"
    assert s["provenance"]["evals"]["pruned"]["checkpoint"] == "ckpt_16"
    json.dumps(s, allow_nan=False)

    rft = _fake_eval(21.0, 8192, 16)
    s2 = ed.summarize(base, pruned, rft, {"model": "tiny", "method": "l1", "pct": 50})
    assert s2["metrics"]["rft"]["statereduce_heldout"]["word_perplexity"] == 21.0


@pytest.mark.parametrize(
    "pruned, rft, meta, match",
    [
        (_fake_eval(25.0, 8192, 16, tasks=("other",)), None, {"model": "m", "method": "l1", "pct": 50}, "differ"),
        (_fake_eval(25.0, 8192, 16, max_length=64), None, {"model": "m", "method": "l1", "pct": 50}, "differ"),
        (_fake_eval(25.0, 8192, 16), _fake_eval(21.0, 4096, 8), {"model": "m", "method": "l1", "pct": 50}, "RFT"),
        (_fake_eval(25.0, 8192, 16), None, {"model": "m", "pct": 50}, "method"),
    ],
    ids=["task-mismatch", "window-mismatch", "rft-state-changed", "meta-missing-method"],
)
def test_summarize_rejects(pruned, rft, meta, match):
    with pytest.raises(ValueError, match=match):
        ed.summarize(_fake_eval(20.0, 16384, 32), pruned, rft, meta)


# ---------------------------------------------------------------------------------------------
# local multiple-choice mirror tasks, task metadata, several windows
# ---------------------------------------------------------------------------------------------
MC_DOCS = [
    {"context": "The capital of France is", "choices": ["Paris", "a city in the north of Spain", "x"], "gold": 0},
    {"context": "2 + 2 =", "choices": ["4", "five", "twenty-two point zero"], "gold": 0},
    {"context": "Water boils at", "choices": ["100 degrees", "the moon", "7", "cold"], "gold": 0},
    {"context": "def f(x):\n    return", "choices": ["x + 1", "None and never anything else", "]"], "gold": 1},
    {"context": "[1, 2, 3]", "choices": ["[4]", "and so on, forever", "."], "gold": 2},
    {"context": "naïve café —", "choices": ["ünïcödé", "ascii", "a very long continuation here"], "gold": 1},
    {"context": "Q: yes or no? A:", "choices": ["yes", "no"], "gold": 1},
    {"context": "abc abc abc", "choices": ["abc", "xyz xyz xyz xyz"], "gold": 0},
]


def _choice_lls(model, tok, doc: dict) -> list[float]:
    """Sum of log p(" " + choice | context) from one plain forward pass per choice."""
    ctx = tok.encode(doc["context"])
    lls = []
    for choice in doc["choices"]:
        cont = tok.encode(" " + choice)
        assert tok.encode(doc["context"] + " " + choice) == ctx + cont  # byte level: no merge across the cut
        lls.append(-_window_nll(model, ctx + cont[:-1], cont))
    return lls


def test_write_multiple_choice_task_files(tmp_path):
    docs = [{**d, "extra": i} for i, d in enumerate(MC_DOCS)]
    name = et.write_multiple_choice_task(docs, tmp_path / "tasks", "my_mc", tag="mirror", metadata={"source": "t"})
    cfg = yaml.safe_load((tmp_path / "tasks" / "my_mc.yaml").read_text())
    assert name == "my_mc" and cfg["task"] == "my_mc" and cfg["tag"] == ["mirror"]
    assert (cfg["output_type"], cfg["test_split"], cfg["target_delimiter"]) == ("multiple_choice", "test", " ")
    assert (cfg["doc_to_text"], cfg["doc_to_choice"], cfg["doc_to_target"]) == ("context", "choices", "gold")
    assert [m["metric"] for m in cfg["metric_list"]] == ["acc", "acc_norm"]
    assert all(m["aggregation"] == "mean" and m["higher_is_better"] for m in cfg["metric_list"])
    assert cfg["metadata"]["source"] == "t" and cfg["metadata"]["n_docs"] == len(MC_DOCS)
    data = Path(cfg["dataset_kwargs"]["data_files"]["test"])
    assert data == (tmp_path / "tasks" / "my_mc.jsonl").resolve()
    assert [json.loads(line) for line in data.read_text(encoding="utf-8").splitlines()] == docs


@pytest.mark.parametrize(
    "docs, kwargs, match",
    [
        ([], {}, "docs is empty"),
        ([{"context": "", "choices": ["a", "b"], "gold": 0}], {}, r"docs\[0\]\['context'\]"),
        ([{"prompt": "c", "choices": ["a", "b"], "gold": 0}], {}, r"docs\[0\]\['context'\] is None"),
        ([{"context": "c", "choices": ["a"], "gold": 0}], {}, r"docs\[0\]\['choices'\].*>= 2"),
        ([{"context": "c", "choices": ["a", "b"], "gold": 2}], {}, r"docs\[0\]\['gold'\] is 2.*2 choices"),
        ([{"context": "c", "choices": ["a", "b"], "gold": True}], {}, r"docs\[0\]\['gold'\] is True"),
        (MC_DOCS, {"metrics": ("acc", "f1")}, r"metrics \['acc', 'f1'\] invalid; choose from acc, acc_norm"),
        (MC_DOCS, {"name": "-bad"}, "invalid task name"),
    ],
    ids=["no-docs", "empty-context", "no-context", "one-choice", "gold-range", "gold-bool", "metric", "name"],
)
def test_write_multiple_choice_task_rejects(tmp_path, docs, kwargs, match):
    kwargs = {"name": "mc", **kwargs}
    with pytest.raises(ValueError, match=match):
        et.write_multiple_choice_task(docs, tmp_path, **kwargs)


def test_mirror_multiple_choice_matches_hand_argmax(model, tok, tmp_path):
    """lm-eval's acc / acc_norm on the local mirror task equal the argmax of hand-computed log-likelihoods
    (acc_norm: divided by the choice's length in characters, lm-eval's definition); task metadata is passed."""
    name = et.write_multiple_choice_task(MC_DOCS, tmp_path, "mc_mirror")
    res = ev.evaluate_model(
        model, tok, [name], include_path=tmp_path, batch_size=4, device="cpu", metadata={"max_seq_lengths": [64]}
    )
    lls = [np.array(_choice_lls(model, tok, d)) for d in MC_DOCS]
    lens = [np.array([len(c) for c in d["choices"]], dtype=float) for d in MC_DOCS]
    pred = [int(np.argmax(ll)) for ll in lls]
    pred_norm = [int(np.argmax(ll / n)) for ll, n in zip(lls, lens)]
    assert pred != pred_norm  # the documents tell the two metrics apart
    m = res["metrics"][name]
    assert m["acc"] == np.mean([p == d["gold"] for p, d in zip(pred, MC_DOCS)])
    assert m["acc_norm"] == np.mean([p == d["gold"] for p, d in zip(pred_norm, MC_DOCS)])
    assert math.isfinite(m["acc_stderr"]) and math.isfinite(m["acc_norm_stderr"])
    # metadata reaches the task config (lm-eval hands it to custom_dataset functions such as RULER's)
    assert res["lm_eval"]["configs"][name]["metadata"]["max_seq_lengths"] == [64]
    assert res["settings"]["metadata"] == {"max_seq_lengths": [64]}  # the byte tokenizer has no name to add


def test_task_metadata_adds_tokenizer_name():
    import types

    named = types.SimpleNamespace(name_or_path="fla-hub/delta_net-1.3B-100B")
    assert ev.task_metadata(None, named) is None and ev.task_metadata({}, named) is None
    assert ev.task_metadata({"max_seq_lengths": [2048]}, named) == {
        "max_seq_lengths": [2048],
        "tokenizer": "fla-hub/delta_net-1.3B-100B",
    }
    assert ev.task_metadata({"a": 1, "pretrained": "p"}, named) == {"a": 1, "pretrained": "p"}
    assert ev.task_metadata({"a": 1}, "org/tok") == {"a": 1, "tokenizer": "org/tok"}


def test_window_runs():
    tasks = ["statereduce_heldout", "wikitext", "niah_single_1", "swde", "niah_single_2"]
    need = {"niah_single_1": 4224, "niah_single_2": 4224, "swde": 1024}
    assert ev._window_runs(tasks, 2048, need) == [
        (2048, ["statereduce_heldout", "wikitext", "swde"]),
        (4224, ["niah_single_1", "niah_single_2"]),
    ]
    assert ev._window_runs(tasks, 8192, need) == [(8192, tasks)]
    assert ev._window_runs(["a", "b"], None, {"b": 64}) == [(None, ["a"]), (64, ["b"])]


def test_evaluate_and_write_local_writers_and_two_windows(model, tok, tmp_path):
    """Heldout + a local-writer task, the latter needing a longer window: two lm-eval calls, one document."""
    docs = [DOCS[1], DOCS[0]]  # 92 and 44 tokens: windows of 32
    out = tmp_path / "eval.json"
    doc = ev.evaluate_and_write(
        model,
        tok,
        out,
        eval_cfg={
            "tasks": [],
            "max_length": 32,
            "device": "cpu",
            "task_max_length": {"mc_mirror": 256},
            "suites": ["lm"],
        },
        heldout_docs=docs,
        local_tasks={"mirror": lambda d: [et.write_multiple_choice_task(MC_DOCS, d, "mc_mirror")]},
        model_id="tiny",
    )
    assert doc["settings"]["runs"] == [
        {"tasks": [et.HELDOUT], "max_length": 32},
        {"tasks": ["mc_mirror"], "max_length": 256},
    ]
    assert doc["settings"]["tasks"] == [et.HELDOUT, "mc_mirror"] and doc["settings"]["max_length"] == 32
    assert doc["provenance"]["tasks"] == [et.HELDOUT, "mc_mirror"]
    assert set(doc["lm_eval"]["results"]) == set(doc["metrics"]) == {et.HELDOUT, "mc_mirror"}
    nll = sum(_independent_nll(model, tok, d, 32) for d in docs)
    m = doc["metrics"][et.HELDOUT]
    assert math.log(m["word_perplexity"]) == pytest.approx(nll / sum(_words(d) for d in docs), rel=1e-5)
    pred = [int(np.argmax(_choice_lls(model, tok, d))) for d in MC_DOCS]
    assert doc["metrics"]["mc_mirror"]["acc"] == np.mean([p == d["gold"] for p, d in zip(pred, MC_DOCS)])
    assert doc["suites"] == {"lm": {"lm_avg": None}}  # none of the lm tasks ran: missing, not invented
    assert json.loads(out.read_text()) == doc


def test_summarize_carries_suite_averages():
    base, pruned = _fake_eval(20.0, 16384, 32), _fake_eval(25.0, 8192, 16)
    base["suites"], pruned["suites"] = {"lm": {"lm_avg": 0.6}}, {"lm": {"lm_avg": 0.55}}
    s = ed.summarize(base, pruned, None, {"model": "tiny", "method": "l1", "pct": 50})
    assert s["suites"] == {"baseline": {"lm": {"lm_avg": 0.6}}, "pruned": {"lm": {"lm_avg": 0.55}}, "rft": None}
    s = ed.summarize(
        _fake_eval(20.0, 16384, 32), _fake_eval(25.0, 8192, 16), None, {"model": "t", "method": "l1", "pct": 5}
    )
    assert "suites" not in s
