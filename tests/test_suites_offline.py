"""The paper's evaluation suites (``lm``, ``recall``) without a network: their lm-eval tasks' code, and a contract run.

* Every lm-eval task that a model of the shipped config.yaml evaluates loads its code as lm-eval's ``TaskManager``
  loads it (the task YAML with its ``!function`` modules, a Python task's class), with no data: a package the install
  lacks (RULER's ``wonderwords``, ``nltk``) fails here rather than in the first evaluation job, after calibration.
* The contract run (``slow``): gdn1.3b's eval settings from config.yaml (``statereduce.config.model_eval``) through
  the eval stage (``statereduce.eval.run.evaluate_checkpoint``), lm-eval's ``simple_evaluate`` and the written
  ``eval.json``, on a tiny Gated DeltaNet checkpoint with the byte-level tokenizer saved in its folder. Each task's
  hub dataset is replaced by a handful of stand-in rows with the real dataset's columns and types (``datasets.
  load_dataset`` answers from memory, :data:`STAND_INS`), RULER's essay haystack too (it is a hub dataset as well),
  RULER generates 2 documents per length instead of 500, its tokenizer is the checkpoint's folder (as the eval stage
  passes it), and nltk's ``punkt_tab`` model is a stand-in (an untrained Punkt model: split at every full stop).
  Everything else is lm-eval's and ours: the task configs and utils, prompts, requests, the model's scoring and
  generation, metrics and aggregations, the suites' report columns and averages.
"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import pytest

from statereduce.eval.suites import SUITES
from statereduce.eval.tasks import HELDOUT

HUB_MODEL = "gdn1.3b"
"""The hub model of config.yaml whose eval settings the contract run uses (``eval.suites: [lm, recall]``)."""

RULER_DOCS = 2
"""RULER documents generated per task and length in the contract run (lm-eval generates 500)."""

WORDS = ("river stone garden window paper morning letter basket silver market candle engine harbor pocket ladder "
         "meadow lantern orchard thunder violin").split()


def _sentences(n: int, seed: int) -> str:
    """``n`` plain English-like sentences, seeded: stand-in prose."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = rng.sample(WORDS, 6)
        out.append(f"The {words[0]} near the {words[1]} was {words[2]}, and a {words[3]} kept the {words[4]} "
                   f"by the {words[5]}.")
    return " ".join(out)


def _stand_ins() -> dict[tuple[str, str | None], dict]:
    """``{(dataset path, config name): {"features", "splits", "rows"}}`` for every hub dataset the ``lm`` and
    ``recall`` suites read, 3 rows each (every split holds the same rows), with the real dataset's columns and types:
    its whole schema for WikiText, LAMBADA, ARC, HellaSwag, WinoGrande and PIQA (their dataset cards); for the
    Based parquet files of SQuAD- and SWDE-completion and RULER's essays, the columns lm-eval 0.4.13's code reads
    (``text``, ``value``; SWDE's ``key``, which the Based harness's SWDE prompt reads; the essays' ``text``), all
    strings, as their other columns are not known here."""
    import datasets as ds

    s, i32, i64 = ds.Value("string"), ds.Value("int32"), ds.Value("int64")
    wiki = {"page": s}
    wiki_rows = [{"page": " = Stand @-@ in = \n\n " + _sentences(6, k) + " \n"} for k in range(3)]
    arc = {"id": s, "question": s, "choices": ds.Sequence({"text": s, "label": s}), "answerKey": s}
    arc_rows = [
        {"id": "Mercury_1", "question": "Which object is a source of light?",
         "choices": {"text": ["a candle", "a stone", "a basket", "a ladder"], "label": ["A", "B", "C", "D"]},
         "answerKey": "A"},
        {"id": "Mercury_2", "question": "What do plants need to grow?",
         "choices": {"text": ["sunlight", "silver", "thunder"], "label": ["A", "B", "C"]}, "answerKey": "A"},
        {"id": "NYSEDREGENTS_3", "question": "Which tool measures length?",
         "choices": {"text": ["a clock", "a ruler", "a thermometer", "a scale"], "label": ["1", "2", "3", "4"]},
         "answerKey": "2"},
    ]
    hella = {"ind": i32, "activity_label": s, "ctx_a": s, "ctx_b": s, "ctx": s, "endings": ds.List(s),
             "source_id": s, "split": s, "split_type": s, "label": s}
    hella_rows = [
        {"ind": 24, "activity_label": "Roof shingle removal", "ctx_a": "A man is sitting on a roof.", "ctx_b": "he",
         "ctx": "A man is sitting on a roof. he", "endings": ["is using wrap to wrap a pair of skis.",
                                                             "is ripping level tiles off.",
                                                             "is holding a rubik's cube.",
                                                             "starts pulling up roofing on a roof."],
         "source_id": "activitynet~v_-JhWjGDPHMY", "split": "val", "split_type": "indomain", "label": "3"},
        {"ind": 92, "activity_label": "Baking cookies", "ctx_a": "A woman opens an oven [title] door.",
         "ctx_b": "she", "ctx": "A woman opens an oven door. she",
         "endings": ["takes out a tray of cookies.", "paints the wall.", "rides a bicycle.", "sings a song."],
         "source_id": "wikihow~1", "split": "val", "split_type": "zeroshot", "label": "0"},
        {"ind": 106, "activity_label": "Washing hands", "ctx_a": "A boy turns on the tap.", "ctx_b": "he",
         "ctx": "A boy turns on the tap. he",
         "endings": ["eats the soap.", "washes his hands with soap.", "climbs a tree.", "reads a letter."],
         "source_id": "activitynet~v_x", "split": "val", "split_type": "indomain", "label": "1"},
    ]
    wino = {"sentence": s, "option1": s, "option2": s, "answer": s}
    wino_rows = [
        {"sentence": "Sarah was a much better surgeon than Maria so _ always got the harder cases.",
         "option1": "Sarah", "option2": "Maria", "answer": "1"},
        {"sentence": "The trophy doesn't fit into the suitcase because the _ is too small.",
         "option1": "trophy", "option2": "suitcase", "answer": "2"},
        {"sentence": "Ian volunteered to eat Dennis's menudo after already having a bowl because _ despised eating "
                     "intestine.", "option1": "Ian", "option2": "Dennis", "answer": "2"},
    ]
    piqa = {"goal": s, "sol1": s, "sol2": s, "label": i64}
    piqa_rows = [
        {"goal": "How to boil eggs.", "sol1": "Place your eggs in a pot and cover with no water.",
         "sol2": "Place your eggs in a pot and cover with cold water.", "label": 1},
        {"goal": "Keep bread fresh.", "sol1": "Store it in a sealed bag.", "sol2": "Leave it in the rain.",
         "label": 0},
        {"goal": "Dry wet shoes.", "sol1": "Stuff them with newspaper.", "sol2": "Fill them with water.", "label": 0},
    ]
    squad = {"text": s, "value": s}
    squad_rows = [{"text": f" {context} {question}", "value": f" {value} "} for context, question, value in [
        ("The old harbor was built in 1820 by the river.", "The harbor was built in", "1820"),
        ("The orchard grows apples and pears near the meadow.", "The orchard grows apples and", "pears"),
        ("Anna played the violin at the morning market.", "Anna played the", "violin"),
    ]]
    swde = {"key": s, "value": s, "text": s}
    swde_rows = [{"key": key, "value": f" {value} ",
                  "text": f"<html><title>{title}</title><td>{key.title()}</td><td>{value}</td></html>\n{key}:"}
                 for title, key, value in [("Harbor Lights", "director", "Ann Lee"), ("Stone Garden", "genre", "Drama"),
                                           ("Silver Engine", "mpaa_rating", "PG-13")]]
    essays = {"text": s}
    essay_rows = [{"text": _sentences(120, 100 + k)} for k in range(3)]  # ~1,900 words each: 4K haystacks fit
    all_splits = ("train", "validation", "test")
    return {
        ("EleutherAI/wikitext_document_level", "wikitext-2-raw-v1"): {"features": wiki, "splits": all_splits,
                                                                       "rows": wiki_rows},
        ("EleutherAI/lambada_openai", "default"): {
            "features": {"text": s}, "splits": ("test",),
            "rows": [{"text": t} for t in ("The lantern by the window was lit, so she read the letter",
                                           "He climbed the ladder to reach the top of the ladder",
                                           "They walked to the market to buy fresh bread at the market")]},
        ("allenai/ai2_arc", "ARC-Easy"): {"features": arc, "splits": all_splits, "rows": arc_rows},
        ("allenai/ai2_arc", "ARC-Challenge"): {"features": arc, "splits": all_splits, "rows": arc_rows},
        ("Rowan/hellaswag", None): {"features": hella, "splits": all_splits, "rows": hella_rows},
        ("allenai/winogrande", "winogrande_xl"): {"features": wino, "splits": all_splits, "rows": wino_rows},
        ("baber/piqa", None): {"features": piqa, "splits": all_splits, "rows": piqa_rows},
        ("hazyresearch/based-squad", "default"): {"features": squad, "splits": ("validation",), "rows": squad_rows},
        ("hazyresearch/based-swde-v2", "default"): {"features": swde, "splits": ("validation",), "rows": swde_rows},
        ("baber/paul_graham_essays", None): {"features": essays, "splits": ("train",), "rows": essay_rows},
    }


STAND_INS = _stand_ins()


def shipped_lm_eval_tasks(config: dict) -> list[str]:
    """Every lm-eval task a model of ``config`` evaluates (its ``eval`` block, suites expanded), without the local
    ones (the held-out task; the recall probe's levels are written, not named in ``tasks``)."""
    from statereduce import config as srconfig

    tasks: list[str] = []
    for model in config["models"]:
        tasks += [t for t in srconfig.model_eval(config, model).tasks if t != HELDOUT and t not in tasks]
    return tasks


def write_punkt_stand_in(root: Path) -> Path:
    """An nltk data folder under ``root`` holding an English ``punkt_tab`` model (an untrained one: empty parameter
    files, which split at every full stop), so that lm-eval's RULER code finds one and downloads none
    (``prepare_niah`` calls ``nltk.download("punkt_tab")`` on import where nltk finds no model)."""
    model = root / "tokenizers" / "punkt_tab" / "english"
    model.mkdir(parents=True, exist_ok=True)
    for name in ("collocations.tab", "sent_starters.txt", "abbrev_types.txt", "ortho_context.tab"):
        (model / name).write_text("")
    return root


def load_task_code(tasks: list[str]) -> dict[str, list[str]]:
    """Load each lm-eval task's code as lm-eval does before it loads the task's data; returns task -> the config keys
    that hold code (the resolved ``!function`` references, a Python task's ``class``).

    The task YAMLs are found among lm-eval's own by their ``task:`` line, lm-eval's ``TaskManager`` indexes their
    folders (:func:`statereduce.eval.harness.build_task_manager`; the folders alone, not lm-eval's ~14,000 YAMLs),
    and each task's YAML is loaded with its ``!function`` references resolved, as ``TaskFactory`` loads it before
    it builds the task: that imports the task's utils (RULER's ``niah_utils`` imports ``prepare_niah``, which needs
    ``wonderwords`` and ``nltk``; SQuAD- and SWDE-completion are Python task classes)."""
    import importlib.util
    import re

    from lm_eval.tasks._yaml_loader import load_yaml

    from statereduce.eval.harness import build_task_manager

    root = Path(importlib.util.find_spec("lm_eval").submodule_search_locations[0]) / "tasks"
    line = re.compile(r"^task:[ \t]*['\"]?([\w.\-]+)['\"]?[ \t]*$", re.M)
    found: dict[str, list[Path]] = {}
    for path in sorted(root.rglob("*.yaml")):
        for name in line.findall(path.read_text(errors="ignore")):
            if name in tasks:
                found.setdefault(name, []).append(path)
    assert {t: len(found.get(t, [])) for t in tasks} == dict.fromkeys(tasks, 1), found
    manager = build_task_manager(tasks, sorted({str(found[t][0].parent) for t in tasks}))
    code = {}
    for task in tasks:
        cfg = load_yaml(manager.task_index[task].yaml_path, resolve_func=True)
        code[task] = sorted(k for k, v in cfg.items() if callable(v))
    return code


LOAD_TASK_CODE = """\
import json, sys
{hide}sys.path.insert(0, {tests!r})
from test_suites_offline import load_task_code
print("CODE " + json.dumps(load_task_code(json.loads(sys.argv[1]))))
"""

HIDE_WONDERWORDS = """\
class Hidden:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "wonderwords":
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, Hidden())
"""


@pytest.mark.slow
@pytest.mark.parametrize("hidden", [False, True], ids=["installed", "wonderwords-hidden"])
def test_every_shipped_suite_task_loads_its_code(shipped_config, tmp_path, hidden):
    """Every lm-eval task of the shipped config's suites loads its code (:func:`load_task_code`) in a fresh
    interpreter (RULER's code builds a list of six million words on import: ~1 GB, freed with the process); with
    ``wonderwords`` hidden from imports, as where lm-eval's ``ruler`` extra is not installed, the same load fails
    naming it."""
    import json
    import os
    import subprocess

    tasks = shipped_lm_eval_tasks(shipped_config)
    suite_tasks = [t for name in ("lm", "recall") for t in SUITES[name].tasks]
    assert set(suite_tasks) <= set(tasks), sorted(set(suite_tasks) - set(tasks))
    code = LOAD_TASK_CODE.format(hide=HIDE_WONDERWORDS if hidden else "", tests=str(Path(__file__).parent))
    env = {**os.environ, "NLTK_DATA": str(write_punkt_stand_in(tmp_path / "nltk_data"))}
    p = subprocess.run([sys.executable, "-c", code, json.dumps(tasks)], capture_output=True, text=True, env=env,
                       timeout=600)
    if hidden:
        assert p.returncode != 0 and "No module named 'wonderwords'" in p.stderr, p.stderr[-2000:]
        return
    assert p.returncode == 0, p.stderr[-3000:]
    assert "punkt_tab" not in p.stdout + p.stderr  # RULER found the stand-in model and downloaded nothing
    loaded = json.loads(next(x for x in p.stdout.splitlines() if x.startswith("CODE "))[5:])
    assert list(loaded) == tasks
    assert all(loaded[t] == ["custom_dataset", "process_results"] for t in tasks if t.startswith("niah_single_"))
    assert loaded["squad_completion"] == ["class"] and loaded["swde"] == ["class"]
    assert loaded["hellaswag"] == ["process_docs"] and "doc_to_target" in loaded["wikitext"]


@pytest.fixture(scope="module")
def punkt_stand_in(tmp_path_factory):
    """:func:`write_punkt_stand_in`'s folder first on nltk's data path in this process."""
    import nltk

    root = str(write_punkt_stand_in(tmp_path_factory.mktemp("nltk_data")))
    nltk.data.path.insert(0, root)
    yield root
    nltk.data.path.remove(root)


@pytest.fixture
def stand_in_hub(monkeypatch, punkt_stand_in):
    """``datasets.load_dataset`` (as lm-eval's tasks and RULER's haystack call it) answers from :data:`STAND_INS`
    and fails for any other dataset; RULER generates :data:`RULER_DOCS` documents per task and length. Yields what was
    read: ``{"datasets": [(path, name), ...], "ruler": [each generated RULER document's length and max_length]}``."""
    import datasets
    import lm_eval.tasks.ruler.prepare_niah as prepare_niah

    read: dict[str, list] = {"datasets": [], "ruler": []}

    def load_dataset(path, name=None, split=None, **kwargs):
        key = (path, name)
        if key not in STAND_INS:
            raise LookupError(f"no stand-in for the dataset {path!r}, config {name!r}: add it to STAND_INS")
        read["datasets"].append(key)
        spec = STAND_INS[key]
        features = datasets.Features(spec["features"])
        dd = datasets.DatasetDict({sp: datasets.Dataset.from_list(spec["rows"], features=features, split=sp)
                                   for sp in spec["splits"]})
        return dd if split is None else dd[split]

    generate = prepare_niah.generate_samples

    def few_samples(*args, **kwargs):
        docs = generate(*args, **{**kwargs, "num_samples": RULER_DOCS})
        read["ruler"] += [(d["length"], d["max_length"]) for d in docs]
        return docs

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(prepare_niah, "generate_samples", few_samples)
    # niah_utils binds generate_samples when lm-eval first loads it, and lm-eval keeps a module it loaded
    niah_utils = sys.modules.get("lm_eval.tasks.ruler.niah_utils")
    if niah_utils is not None:
        monkeypatch.setattr(niah_utils, "generate_samples", few_samples)
    prepare_niah.get_haystack.cache_clear()  # the essay haystack comes from the stand-in essays
    yield read
    prepare_niah.get_haystack.cache_clear()


@pytest.mark.slow
def test_shipped_suites_run_offline_on_stand_in_data(shipped_config, stand_in_hub, tmp_path):
    """gdn1.3b's ``lm`` and ``recall`` suites through the eval stage on a tiny Gated DeltaNet: every reported
    ``(task, metric)`` of both suites is a finite number in the written eval.json and every suite average is one."""
    import json

    from _models import tiny_model

    from statereduce import config as srconfig
    from statereduce.core.models import save_checkpoint
    from statereduce.core.tokenizer import VOCAB_SIZE, byte_level_tokenizer
    from statereduce.eval.run import evaluate_checkpoint

    settings = srconfig.model_eval(shipped_config, HUB_MODEL)
    assert settings.suites == ["lm", "recall"] and settings.metadata == {"max_seq_lengths": [2048, 4096]}
    ckpt = tmp_path / "base"
    save_checkpoint(tiny_model("gated_deltanet", vocab_size=VOCAB_SIZE, bos_token_id=256, eos_token_id=256),
                    byte_level_tokenizer(), ckpt)
    out = tmp_path / "baseline" / "eval.json"
    doc = evaluate_checkpoint(ckpt, settings, {"model": HUB_MODEL, "dtype": "float32", "device": "cpu"}, out,
                              extra={"method": "baseline", "pct": 0})
    assert json.loads(out.read_text()) == doc
    assert set(stand_in_hub["datasets"]) == set(STAND_INS)  # every stand-in was read: no data came from elsewhere
    # RULER's documents: 2 per length for each NIAH task, each within its length; the 4K ones longer than the 2K
    # window plus generation, so that a NIAH run at max_length would have cut them
    ruler = stand_in_hub["ruler"]
    assert sorted(n for _, n in ruler) == sorted([2048, 4096] * RULER_DOCS * 3)
    assert all(length <= n for length, n in ruler)
    assert all(length > 2048 + 128 for length, n in ruler if n == 4096), ruler

    for name in settings.suites:
        for task, metric in SUITES[name].report:
            value = doc["metrics"].get(task, {}).get(metric)
            assert isinstance(value, float) and math.isfinite(value), (task, metric, doc["metrics"].get(task))
    assert doc["suites"].keys() == {"lm", "recall"}
    for name, averages in doc["suites"].items():
        assert averages.keys() == SUITES[name].averages.keys()
        assert all(isinstance(v, float) and math.isfinite(v) for v in averages.values()), (name, averages)
    # the NIAH tasks ran in their own lm-eval call with the 4K window plus generation, the rest at max_length
    runs = {tuple(r["tasks"]): r["max_length"] for r in doc["settings"]["runs"]}
    assert runs[tuple(settings.tasks[:7] + settings.tasks[10:])] == 2048
    assert runs[("niah_single_1", "niah_single_2", "niah_single_3")] == 4096 + 128
