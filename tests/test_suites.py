"""Evaluation suites (statereduce.eval.suites): expansion into lm-eval tasks, errors, and the suite averages.

The ``lm`` average is checked against the paper itself (Table 10's baseline row: the six accuracies
average to the printed 64.4) and against a hand computation; a task that was not evaluated gives
``None``. No test here runs lm-eval's real tasks (they need network); the ``slow`` test only checks
the names against lm-eval's task index. ``tests/test_suites_offline.py`` loads the tasks' code and runs them on
stand-in data.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from _paths import ROOT

from statereduce.eval import suites as su
from statereduce.common.settings import EvalSettings, RecallProbeSettings

LM_TASKS = ["wikitext", "lambada_openai", "arc_easy", "arc_challenge", "hellaswag", "winogrande", "piqa"]
RECALL_TASKS = ["niah_single_1", "niah_single_2", "niah_single_3", "squad_completion", "swde"]


def _lm_metrics(acc: dict[str, float]) -> dict:
    """An eval.json ``metrics`` mapping with the lm suite's reported metrics."""
    return {
        "wikitext": {"word_perplexity": 16.3, "byte_perplexity": 1.7},
        "lambada_openai": {"perplexity": 12.0, "acc": acc["lambada_openai"], "acc_stderr": 0.01},
        "arc_easy": {"acc": 0.7, "acc_norm": acc["arc_easy"]},
        "arc_challenge": {"acc": 0.3, "acc_norm": acc["arc_challenge"]},
        "hellaswag": {"acc": 0.5, "acc_norm": acc["hellaswag"]},
        "winogrande": {"acc": acc["winogrande"]},
        "piqa": {"acc": 0.7, "acc_norm": acc["piqa"]},
    }


# paper Table 10, Mamba-Codestral-7B baseline: ARC-e 71.5, ARC-c 44.8, Hella. 70.5, Wino. 64.2, PIQA 77.0,
# LMB. acc 58.2 -> Avg 64.4
TABLE10_BASELINE = {
    "arc_easy": 0.715,
    "arc_challenge": 0.448,
    "hellaswag": 0.705,
    "winogrande": 0.642,
    "piqa": 0.770,
    "lambada_openai": 0.582,
}


# ---------------------------------------------------------------------------------------------
# expansion
# ---------------------------------------------------------------------------------------------
def test_expand_lm_and_recall():
    ev = su.expand_eval(EvalSettings.from_dict({"tasks": ["heldout", "wikitext"], "suites": ["lm", "recall"],
                                                "max_length": 2048}))
    assert ev.tasks == ["heldout", "wikitext"] + LM_TASKS[1:] + RECALL_TASKS  # configured first, each once
    assert ev.suites == ["lm", "recall"]
    assert ev.metadata == {"max_seq_lengths": [2048, 4096]}
    assert ev.task_max_length == dict.fromkeys(RECALL_TASKS[:3], 4096 + 128)  # SQuAD/SWDE keep max_length
    assert ev.max_length == 2048 and ev.recall_probe is None
    assert su.expand_eval(ev) == ev  # idempotent: evaluate_loaded may expand model_eval's output again


def test_expand_without_suites_is_unchanged():
    ev = EvalSettings(tasks=["heldout"], max_docs=32, batch_size=16)
    assert su.expand_eval(ev) is ev
    assert su.expand_eval(ev.replace(suites=[])).to_dict() == {**ev.to_dict(), "suites": []}


def test_expand_recall_probe_fills_defaults():
    ev = su.expand_eval(EvalSettings.from_dict({"tasks": [], "suites": ["recall_probe"]}))
    assert ev.tasks == [] and ev.metadata is None and ev.task_max_length is None
    assert ev.recall_probe == {"levels": [4, 16, 64], "n_docs": 100, "seed": 0}
    ev = su.expand_eval(EvalSettings.from_dict({"tasks": [], "suites": ["recall_probe"],
                                                "recall_probe": {"levels": [8], "n_docs": 5}}))
    assert ev.recall_probe == {"levels": [8], "n_docs": 5, "seed": 0}
    assert ev.probe == RecallProbeSettings(levels=[8], n_docs=5)


def _workflow_function(name: str, **globals_):
    """A function of rules/common.smk (plain Python in a Snakemake file), run on stand-ins for the workflow's
    globals."""
    lines = (ROOT / "rules" / "common.smk").read_text().splitlines()
    start = lines.index(next(line for line in lines if line.startswith(f"def {name}(")))
    end = next(i for i in range(start + 1, len(lines)) if lines[i] and not lines[i][0].isspace())
    scope = dict(globals_)
    exec(compile("\n".join(lines[start:end]), "rules/common.smk", "exec"), scope)
    return scope[name]


def test_the_workflows_eval_params_keep_the_key_order_finished_runs_recorded():
    """The settings are in field order; the workflow's params (get_eval) put a recall_probe block the suite added
    after metadata and task_max_length, and corpus_spec last, as finished runs recorded them (Snakemake compares the
    params' repr). A configured block keeps its field's place."""
    from types import SimpleNamespace

    from statereduce import config as srconfig

    def params(block, heldout_spec=None):
        cfg = {"models": {"m": {"eval": block}}}
        get_eval = _workflow_function(
            "get_eval", MODELS=cfg["models"], CFG=cfg, get_corpus_spec=lambda name: heldout_spec,
            srconfig=SimpleNamespace(model_eval=srconfig.model_eval, model_eval_corpus=lambda c, m: "embedded"))
        return list(get_eval(SimpleNamespace(model="m")))

    added = params({"suites": ["recall", "recall_probe"], "tasks": []})
    assert added[-4:] == ["suites", "metadata", "task_max_length", "recall_probe"]
    with_spec = params({"suites": ["recall_probe"], "tasks": ["heldout"]}, {"source": "embedded"})
    assert with_spec[-2:] == ["recall_probe", "corpus_spec"]
    configured = params({"recall_probe": {"levels": [8]}, "suites": ["recall_probe"], "tasks": []})
    assert configured[-2:] == ["recall_probe", "suites"]
    plain = su.expand_eval(EvalSettings.from_dict({"suites": ["recall", "recall_probe"]}))
    assert list(plain.to_dict()) == [n for n in EvalSettings.field_names() if n in plain.to_dict()]


@pytest.mark.parametrize(
    "names, exc, match",
    [
        (["lm", "recal"], ValueError, r"^unknown evaluation suite 'recal'; valid: lm, recall, recall_probe$"),
        (["lm", "lm"], ValueError, r"^evaluation suite 'lm' is listed twice$"),
        ("lm", TypeError, r"suites must be a list of names, got 'lm'; valid names: lm, recall, recall_probe"),
    ],
    ids=["unknown", "repeated", "string"],
)
def test_bad_suites(names, exc, match):
    with pytest.raises(exc, match=match):
        su.expand_eval(EvalSettings.from_dict({"tasks": [], "suites": names}))


def test_unknown_recall_probe_key():
    with pytest.raises(ValueError, match=r"unknown recall_probe keys \['level'\]; valid: levels, n_docs, seed"):
        su.expand_eval(EvalSettings.from_dict({"tasks": [], "suites": ["recall_probe"],
                                               "recall_probe": {"level": [4]}}))


def test_conflicting_metadata():
    with pytest.raises(ValueError, match=r"suite 'recall' needs task metadata max_seq_lengths=\[2048, 4096\]"):
        su.expand_eval(EvalSettings.from_dict({"tasks": [], "suites": ["recall"],
                                               "metadata": {"max_seq_lengths": [8192]}}))


def test_suites_import_neither_lm_eval_nor_torch():
    code = (
        "import sys\nimport statereduce.eval.suites\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('lm_eval', 'torch', 'fla'))\n"
        "assert not bad, bad[:5]\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


@pytest.mark.slow
def test_suite_tasks_exist_in_lm_eval():
    """Every lm-eval task a suite names is in the installed lm-eval's task index (scans ~15k YAMLs, 15-70 s)."""
    from lm_eval.tasks import TaskManager

    names = {t for s in su.SUITES.values() for t in s.tasks}
    assert names == set(LM_TASKS + RECALL_TASKS)
    missing = sorted(names - set(TaskManager().all_tasks))
    assert not missing, missing


# ---------------------------------------------------------------------------------------------
# averages
# ---------------------------------------------------------------------------------------------
def test_lm_avg_reproduces_paper_table10():
    avg = su.suite_summary("lm", _lm_metrics(TABLE10_BASELINE))["lm_avg"]
    assert round(100 * avg, 1) == 64.4


def test_lm_avg_hand_computation_and_missing_task():
    acc = {"lambada_openai": 0.40, "arc_easy": 0.60, "arc_challenge": 0.25, "hellaswag": 0.35, "winogrande": 0.5}
    acc["piqa"] = 0.65
    metrics = _lm_metrics(acc)
    hand = (0.40 + 0.60 + 0.25 + 0.35 + 0.5 + 0.65) / 6
    assert su.suite_summary("lm", metrics) == {"lm_avg": pytest.approx(hand, abs=1e-12)}
    # arc_easy's acc (0.7) is not the reported acc_norm: the average uses the paper's metric per task
    assert su.suite_summary("lm", metrics)["lm_avg"] != pytest.approx((0.40 + 0.7 + 0.3 + 0.5 + 0.5 + 0.7) / 6)

    del metrics["piqa"]
    assert su.suite_summary("lm", metrics) == {"lm_avg": None}
    metrics["piqa"] = {"acc": 0.7}  # the task ran, but without the reported metric
    assert su.suite_summary("lm", metrics) == {"lm_avg": None}
    metrics["piqa"] = {"acc_norm": "nan"}  # jsonable's NaN
    assert su.suite_summary("lm", metrics) == {"lm_avg": None}


def test_recall_summary_and_ruler_sentinel():
    metrics = {
        "niah_single_1": {"2048": 1.0, "4096": 0.9},
        "niah_single_2": {"2048": 0.8, "4096": 0.6},
        "niah_single_3": {"2048": 0.6, "4096": -1.0},  # lm-eval's RULER aggregation: no documents of 4K
        "squad_completion": {"contains": 0.405},
    }
    out = su.suite_summary("recall", metrics)
    assert out == {"niah_2048": pytest.approx(0.8), "niah_4096": None, "squad": 0.405, "swde": None}


def test_recall_probe_summary_needs_its_tasks():
    metrics = {"recall_mqar_4": {"acc": 0.5}, "recall_mqar_16": {"acc": 0.25}}
    assert su.suite_summary("recall_probe", metrics, ["recall_mqar_4", "recall_mqar_16"]) == {"recall_mqar_avg": 0.375}
    assert su.suite_summary("recall_probe", metrics, ["recall_mqar_4", "recall_mqar_64"]) == {"recall_mqar_avg": None}
    assert su.suite_summary("recall_probe", metrics) == {"recall_mqar_avg": None}


def test_suite_stderr_of_an_average():
    """The mean of n items has standard error sqrt(sum se_i^2) / n; an item without one (lm-eval's RULER lengths,
    an older document) leaves the average without one; a local suite finds its tasks by their prefix."""
    metrics = {"recall_mqar_4": {"acc": 0.5, "acc_stderr": 0.05}, "recall_mqar_8": {"acc": 0.3, "acc_stderr": 0.04},
               "heldout": {"bits_per_byte": 3.0}}
    assert su.local_tasks("recall_probe", metrics) == ["recall_mqar_4", "recall_mqar_8"]
    assert su.local_tasks("lm", metrics) is None
    expected = (0.05**2 + 0.04**2) ** 0.5 / 2
    assert su.suite_stderr("recall_probe", metrics) == {"recall_mqar_avg": pytest.approx(expected)}
    assert su.suite_stderr("recall_probe", metrics, ["recall_mqar_4"]) == {"recall_mqar_avg": pytest.approx(0.05)}
    del metrics["recall_mqar_8"]["acc_stderr"]
    assert su.suite_stderr("recall_probe", metrics) == {"recall_mqar_avg": None}
    squad = {"squad_completion": {"contains": 0.4, "contains_stderr": 0.02}, "niah_single_1": {"2048": 1.0}}
    out = su.suite_stderr("recall", squad)
    assert out["squad"] == pytest.approx(0.02) and out["niah_2048"] is None and out["swde"] is None


def test_summarize_suites():
    metrics = {**_lm_metrics(TABLE10_BASELINE), "recall_mqar_4": {"acc": 0.5}}
    out = su.summarize_suites(metrics, ["lm", "recall", "recall_probe"], {"recall_probe": ["recall_mqar_4"]})
    assert list(out) == ["lm", "recall", "recall_probe"]
    assert out["lm"]["lm_avg"] == pytest.approx(sum(TABLE10_BASELINE.values()) / 6)
    assert out["recall"] == dict.fromkeys(["niah_2048", "niah_4096", "squad", "swde"])
    assert out["recall_probe"] == {"recall_mqar_avg": 0.5}


def test_report_columns_follow_the_paper():
    """Table 20/21 columns: Wiki ppl, LMB ppl, ARC-e/c acc_n, Hella. acc_n, Wino. acc, PIQA acc_n, LMB acc."""
    assert su.SUITES["lm"].report == (
        ("wikitext", "word_perplexity"),
        ("lambada_openai", "perplexity"),
        ("lambada_openai", "acc"),
        ("arc_easy", "acc_norm"),
        ("arc_challenge", "acc_norm"),
        ("hellaswag", "acc_norm"),
        ("winogrande", "acc"),
        ("piqa", "acc_norm"),
    )
    assert not su.SUITES["recall_probe"].network and su.SUITES["lm"].network and su.SUITES["recall"].network
