"""The results layout (statereduce.common.layout): templates filled by ``path`` read back by ``parse``, pct forms, and
the paths the rules write (a dry run of the default target) all parse to their model, stage and calibration."""

from __future__ import annotations

import re

import pytest
from _snakemake import snakemake

from statereduce.common import layout
@pytest.mark.parametrize("pct, text", [(50, "50"), (50.0, "50"), (37.5, "37.5"), ("75", "75")])
def test_format_pct(pct, text):
    assert layout.format_pct(pct) == text


@pytest.mark.parametrize("text, canonical", [
    ("50", "50"), ("37.5", "37.5"), ("0.5", "0.5"), ("50.0", "50"), ("050", "50"), ("50.00", "50"),
    ("37.50", "37.5"), ("00.5", "0.5"), ("1e1", "10"), ("7x5", None), ("nan", None),
])
def test_a_ratio_has_one_spelling_in_paths(text, canonical):
    """The wildcard pattern takes only format_pct's spelling; canonical_pct names it for any other spelling."""
    assert layout.canonical_pct(text) == canonical
    assert layout.is_pct(text) == (re.fullmatch(layout.PCT_RE, text) is not None) == (text == canonical)


def test_with_pct_rewrites_only_the_stages_pct():
    assert layout.with_pct("results/m/drrqr.n16_050/rft/eval.json", "50") == "results/m/drrqr.n16_50/rft/eval.json"
    assert layout.with_pct("results/m/select/grad-k_75.0.parquet", "75") == "results/m/select/grad-k_75.parquet"


def test_path_fills_the_given_wildcards_and_leaves_the_others():
    assert layout.path(layout.SUMMARY, model="m", method="drrqr", pct=50.0) == "results/m/drrqr_50/eval.json"
    assert layout.path(layout.ACTIVATIONS, calib="default") == "results/{model}/calib/default/activations.h5"
    assert layout.table("comparison", "md") == "results/tables/comparison.md"
    assert layout.figure("speedup") == "results/figures/speedup.png"


@pytest.mark.parametrize("template, parts, expect", [
    (layout.SELECTION, {"model": "m", "method": "drrqr.n16", "pct": 37.5},
     {"folder": "select", "stage": "drrqr.n16_37.5", "method": "drrqr.n16", "pct": "37.5", "calib": None}),
    (f"{layout.PRUNED}/config.json", {"model": "dn1.3b", "method": "grad-k", "pct": 75},
     {"folder": "grad-k_75", "stage": "grad-k_75", "method": "grad-k", "pct": "75", "rest": ("pruned", "config.json")}),
    (layout.GRAD_SCORES, {"model": "m", "calib": "seed1"},
     {"folder": "calib", "stage": None, "method": None, "calib": "seed1", "rest": ("seed1", "grad_scores.h5")}),
    (layout.ALLOCATION, {"model": "m", "method": "drrqr@sens", "pct": 75},
     {"folder": "select", "stage": "drrqr@sens_75", "method": "drrqr@sens", "pct": "75", "calib": None}),
    (layout.BUDGET_VALUES, {"model": "m", "method": "drrqr-k.prose@sens"},
     {"folder": "select", "stage": "drrqr-k.prose@sens", "method": "drrqr-k.prose@sens", "pct": None, "calib": None}),
    (layout.BASELINE_EVAL, {"model": "m"}, {"folder": "baseline", "stage": None, "rest": ("eval.json",)}),
    (f"{layout.BASE}/config.json", {"model": "m"}, {"folder": "base", "stage": None}),
])
def test_parse_reads_back_what_path_writes(template, parts, expect):
    found = layout.parse(layout.path(template, **parts))
    assert found is not None and found.model == parts["model"]
    for key, value in expect.items():
        assert getattr(found, key) == value, key


@pytest.mark.parametrize("target", ["results/tables/comparison.md", "results/figures/x.png", "logs/x.log", "results"])
def test_parse_leaves_paths_outside_a_models_results(target):
    assert layout.parse(target) is None


def test_a_stage_that_is_no_method_and_pct_keeps_only_its_name():
    found = layout.parse("results/m/drrqr/eval.json")
    assert (found.stage, found.method, found.pct) == ("drrqr", None, None)


@pytest.fixture(scope="module")
def default_plan(tmp_path_factory):
    """The dry run of the default target with the shipped config."""
    out = snakemake(tmp_path_factory.mktemp("plan"), "-n", "--cores", "1")
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    return out


def test_every_path_the_default_target_plans_parses_to_its_jobs_wildcards(default_plan):
    out = default_plan
    jobs = re.findall(r"output: (.+)\n(?:.+\n)*?\s+wildcards: (.+)", out.stdout)  # within one job block
    assert len(jobs) > 20, out.stdout[-2000:]
    for outputs, wildcards in jobs:
        wc = dict(w.split("=", 1) for w in wildcards.split(", "))
        for target in outputs.split(", "):
            found = layout.parse(target)
            if found is None:
                continue
            assert found.model == wc["model"], target
            if "method" in wc:
                assert (found.method, found.pct) == (wc["method"], wc["pct"]), target
            if "calib" in wc:
                assert found.calib == wc["calib"], target


def test_each_summary_reads_its_stages_evaluations_and_records(default_plan):
    """A summary (rule summarize) reads the baseline's evaluation, its stage's pruned and RFT evaluations, the
    prune record and the RFT record, and nothing else."""
    jobs = re.findall(r"^rule summarize:\n\s+input: (.+)\n\s+output: (.+)$", default_plan.stdout, re.M)
    assert len(jobs) == 20, default_plan.stdout[-2000:]
    for inputs, output in jobs:
        stage = output.removesuffix("/eval.json")
        model = stage.split("/")[1]
        assert sorted(inputs.split(", ")) == sorted([
            f"results/{model}/baseline/eval.json", f"{stage}/pruned/eval.json", f"{stage}/pruned/prune_record.json",
            f"{stage}/rft/eval.json", f"{stage}/rft/rft_record.json"]), output


# ---- method tokens: the grammar here, the vocabulary from the selector registry --------------------------------
TOKENS = ["drrqr", "l1-q", "grad-k", "pca-adv-k", "pca-adv", "drrqr.prose", "grad-q.prose", "drrqr@energy",
          "grad.prose@sens", "swanda-k.x1@b2"]
BAD = ["", "DRRQR", "drrqr.default", "drrqr.Prose", "drrqr@", "drrqr@Big", "-k", "drrqr-k-", "1abc"]


@pytest.mark.parametrize("token", TOKENS)
def test_the_grammar_alone_reads_what_the_registry_reads(token):
    from statereduce.selectors import format_method, parse_method

    spec = layout.parse_token(token)
    assert spec == parse_method(token) == layout.parse_token(token, {"drrqr": ("kq",), "l1": ("kq", "k", "q"),
                                                                      "grad": ("kq", "k", "q"), "pca-adv": ("kq", "k"),
                                                                      "swanda": ("kq", "k")})
    assert layout.format_method(spec) == format_method(spec) == token


@pytest.mark.parametrize("token", BAD)
def test_the_grammar_alone_refuses_a_bad_token_in_one_line(token):
    with pytest.raises(ValueError, match=r"^[^\n]*expected <selector>\[-k\|-q\|-v\|-kv\]\[\.<calib>\]\[@<budget>\][^\n]*$"):
        layout.parse_token(token)


def test_the_vocabulary_decides_names_and_variants():
    vocabulary = {"drrqr": ("kq",), "l1": ("kq", "k", "q")}
    with pytest.raises(ValueError, match=r"^unknown selector 'drrq' in method token 'drrq-k' \(did you mean "
                                         r"'drrqr'\?\); valid: drrqr, l1$"):
        layout.parse_token("drrq-k", vocabulary)
    with pytest.raises(ValueError, match=r"^selector 'drrqr' in method token 'drrqr-k' has no variant 'k'; "):
        layout.parse_token("drrqr-k", vocabulary)
    assert layout.parse_token("drrqr-k") == layout.MethodSpec("drrqr", "k")  # the grammar alone allows it
    assert re.fullmatch(layout.method_regex(vocabulary), "l1-q.prose@b") and not re.fullmatch(
        layout.method_regex(vocabulary), "drrqr-k")


def test_the_method_grammar_is_the_same_wherever_it_is_printed(capsys):
    """The grammar the parser states is the one config.yaml's header, `python -m statereduce` and the docs print."""
    from pathlib import Path

    from statereduce.__main__ import main

    root = Path(__file__).resolve().parents[1]
    grammar = re.search(r"expected (<selector>\S+)", layout._token_help(None)).group(1)
    assert grammar == "<selector>[-k|-q|-v|-kv][.<calib>][@<budget>][+<fit>]"
    assert f"# Method tokens: {grammar}\n" in (root / "config.yaml").read_text()
    assert main([]) == 0 and f"method token: {grammar}" in capsys.readouterr().out
    for doc in ("statereduce/common/layout.py", "statereduce/selectors/registry.py"):
        tokens = set(re.findall(r"<selector>\[[^\s`]*", (root / doc).read_text()))
        assert tokens == {grammar}, (doc, tokens)
