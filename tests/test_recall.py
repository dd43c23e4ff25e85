"""The offline recall probe (statereduce.eval.recall): generator invariants, task files, and lm-eval scoring.

lm-eval's ``acc`` is checked against an independent computation (one plain forward pass per
candidate, the sum of the candidate's token log-probs, argmax against the gold index) on tiny random
byte-level models, and against two model-independent references: an induction "oracle" that copies
the token that followed the longest earlier match of the current suffix (it must score 1.0), and a
constant model whose candidates all tie (lm-eval's argmax then picks index 0, so acc equals the
fraction of documents whose gold index is 0).
"""

from __future__ import annotations

import json
import math
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from _models import tiny_model
from torch import nn

from statereduce.eval import recall as rc
from statereduce.common.settings import EvalSettings, RecallMixSettings, RecallProbeSettings


def _lines(doc: dict) -> list[str]:
    return doc["prompt"].split("\n")


# ---------------------------------------------------------------------------------------------
# generator
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "n_pairs, n_choices, depth, n_queries",
    [(4, 4, None, 1), (16, 4, None, 1), (64, 8, None, 1), (16, 4, 0.0, 1), (16, 3, 1.0, 5), (2, 2, 0.5, 1)],
    ids=lambda v: str(v),
)
def test_generator_invariants(n_pairs, n_choices, depth, n_queries):
    docs = rc.generate_recall_docs(30, n_pairs, n_choices, depth, n_queries, seed=3)
    assert docs == rc.generate_recall_docs(30, n_pairs, n_choices, depth, n_queries, seed=3)  # deterministic
    for doc in docs:
        lines = _lines(doc)
        assert len(lines) == n_pairs + n_queries
        context, answered, query = lines[:n_pairs], lines[n_pairs:-1], lines[-1]
        pairs = [line.split("=") for line in context]
        keys, values = [k for k, _ in pairs], [v for _, v in pairs]
        assert all(len(k) == 2 and k.isalpha() and k.islower() for k in keys)
        assert all(len(v) == 2 and v.isdigit() and v[0] != "0" for v in values)
        assert len(set(keys)) == n_pairs and len(set(values)) == n_pairs
        # the query: "{key}=", its key exactly once in the context, with the answer as its value
        assert query == f"{doc['key']}=" and keys.count(doc["key"]) == 1
        assert context[doc["position"]] == f"{doc['key']}={doc['answer']}"
        assert doc["distance"] == len(lines) - 1 - doc["position"]
        # answered queries repeat other context lines verbatim
        assert all(a in context and not a.startswith(doc["key"] + "=") for a in answered)
        # choices: distinct context values, the answer exactly once at the gold index
        choices = doc["choices"]
        assert len(choices) == n_choices == len(set(choices))
        assert choices.count(doc["answer"]) == 1 and choices[doc["gold"]] == doc["answer"]
        # every candidate value occurs exactly once in the prompt: frequency gives no hint
        for c in choices:
            assert c in values and sum(line.endswith(f"={c}") for line in lines[:-1]) == 1
        if depth is not None:
            assert doc["position"] == round(depth * (n_pairs - 1))
    assert all(d["n_pairs"] == n_pairs for d in docs)


def test_generator_seeds_and_spread():
    a, b = rc.generate_recall_docs(50, 16, seed=0), rc.generate_recall_docs(50, 16, seed=1)
    assert a != b and [d["prompt"] for d in a] != [d["prompt"] for d in b]
    assert all(x["prompt"] != y["prompt"] for x, y in zip(a, b))
    # a level's stream depends on its own parameters: another level with the same seed is not a prefix copy
    assert rc.generate_recall_docs(5, 16, n_choices=3, seed=0)[0]["prompt"] != a[0]["prompt"]
    # gold indices and needle positions are spread out (uniform draws), not constant
    assert len({d["gold"] for d in a}) == 4 and len({d["position"] for d in a}) > 8
    assert "as" not in rc.KEYS and "if" not in rc.KEYS and len(rc.KEYS) == 26 * 26 - 5


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"n_pairs": 0}, ValueError, "n_pairs"),
        ({"n_pairs": 91}, ValueError, "n_pairs"),
        ({"n_pairs": 4, "n_choices": 5}, ValueError, "n_choices"),
        ({"n_pairs": 4, "n_choices": 1}, ValueError, "n_choices"),
        ({"n_pairs": 4, "n_queries": 2}, ValueError, "n_queries"),
        ({"n_pairs": 4, "depth": 1.5}, ValueError, "depth"),
        ({"n_pairs": 4.0}, TypeError, "n_pairs"),
        ({"n_pairs": 4, "seed": "0"}, TypeError, "seed"),
        ({"n_pairs": 4, "n_docs": 0}, ValueError, "n_docs"),
    ],
    ids=[
        "no-pairs",
        "too-many-pairs",
        "choices>pairs",
        "one-choice",
        "queries-eat-choices",
        "depth",
        "float",
        "seed",
        "docs",
    ],
)
def test_generator_rejects(kwargs, exc, match):
    kwargs = {"n_docs": 2, **kwargs}
    with pytest.raises(exc, match=match):
        rc.generate_recall_docs(**kwargs)


def test_level_names_and_parsing():
    assert rc.RecallLevel.parse(16).task_name == "recall_mqar_16"
    lv = rc.RecallLevel.parse({"n_pairs": 32, "depth": 0.25, "n_choices": 8, "n_queries": 3})
    assert lv.task_name == "recall_mqar_32_d25_c8_q3"
    assert rc.RecallLevel.parse({"n_pairs": 8, "name": "my_recall"}).task_name == "my_recall"
    with pytest.raises(ValueError, match=r"unknown recall level keys \['pairs'\]; valid: n_pairs"):
        rc.RecallLevel.parse({"pairs": 8})
    with pytest.raises(ValueError, match="a recall level is"):
        rc.RecallLevel.parse("16")


# ---------------------------------------------------------------------------------------------
# training documents and the pretraining mix
# ---------------------------------------------------------------------------------------------
def test_recall_train_docs_format():
    docs = rc.recall_train_docs(40, [1, 3, 8], seed=2)
    assert docs == rc.recall_train_docs(40, [1, 3, 8], seed=2) and docs != rc.recall_train_docs(40, [1, 3, 8], seed=3)
    assert {len(d.split("\n")) // 2 for d in docs} == {1, 3, 8}
    for doc in docs:
        lines = doc.split("\n")
        n = len(lines) // 2
        context, queries = lines[:n], lines[n:]
        pairs = dict(line.split("=") for line in context)
        assert len(pairs) == n == len(set(pairs.values()))
        assert all(k in rc.KEYS and v in rc.VALUES for k, v in pairs.items())
        # every key is queried once more, answered with its own value: the probe's lookup, teacher-forced
        assert sorted(queries) == sorted(context)
    # the probe's documents come from another stream: no training context is a probe context
    probe = {d["prompt"].rsplit("\n", 1)[0] for d in rc.generate_recall_docs(50, 4, seed=2)}
    assert not probe & {"\n".join(d.split("\n")[:4]) for d in docs}
    with pytest.raises(ValueError, match=r"n_pairs must be an int in 1\.\.90, got 0"):
        rc.recall_train_docs(1, [0])


def test_mix_recall_docs_fraction_and_order():
    corpus = [f"def f{i}():\n    return {i}\n" * (5 + i) for i in range(30)]
    mixed, n_recall = rc.mix_recall_docs(corpus, 0.3, [2, 4], seed=1)
    assert (mixed, n_recall) == rc.mix_recall_docs(corpus, 0.3, [2, 4], seed=1)
    assert [d for d in mixed if d.startswith("def ")] == corpus  # corpus order kept, nothing dropped
    recall = [d for d in mixed if not d.startswith("def ")]
    assert len(recall) == n_recall > 0
    share = sum(len(d) + 1 for d in recall) / sum(len(d) + 1 for d in mixed)
    assert 0.3 <= share < 0.31  # drawn until the share is reached, one short document over at most
    assert recall[0] != rc.mix_recall_docs(corpus, 0.3, [2, 4], seed=2)[0][0]


@pytest.mark.parametrize(
    "spec, match",
    [
        ({"fraction": 0.0}, r"fraction must be a number in \(0, 1\), got 0\.0"),
        ({"fraction": 1}, r"fraction must be a number in \(0, 1\), got 1"),
        ({"n_pairs": []}, r"n_pairs must be a non-empty list of ints in 1\.\.90, got \[\]"),
        ({"n_pairs": [4, 91]}, r"n_pairs must be a non-empty list"),
        ({"seed": 1.5}, r"recall_mix seed must be an int, got 1\.5"),
        ({"pure_steps": -1}, r"recall_mix pure_steps must be an int >= 0, got -1"),
        ({"pure_lr": 0}, r"recall_mix pure_lr must be a number > 0, got 0"),
        (
            {"fractio": 0.2},
            r"unknown recall_mix keys \['fractio'\]; valid: fraction, n_pairs, seed, pure_steps, pure_lr",
        ),
    ],
    ids=["zero", "one", "no-pairs", "too-many-pairs", "seed", "pure-steps", "pure-lr", "typo"],
)
def test_recall_mix_settings_rejects(spec, match):
    with pytest.raises(TypeError if "seed" in spec else ValueError, match=match):
        RecallMixSettings.from_dict(spec)


def test_recall_mix_settings_defaults():
    assert RecallMixSettings.from_dict(None) == RecallMixSettings()
    out = RecallMixSettings.from_dict({"fraction": 0.5, "n_pairs": (2,)}).to_dict()
    assert out == {"fraction": 0.5, "n_pairs": [2], "seed": 0, "pure_steps": 0, "pure_lr": 1e-3, "answer_loss": False,
                   "check_every": 50}
    docs = rc.recall_stream_docs(1000, [2, 4], seed=1)
    assert docs == rc.recall_stream_docs(1000, [2, 4], seed=1)
    assert 1000 <= sum(len(d) + 1 for d in docs) < 1000 + 50  # stops at the first document over the budget


# ---------------------------------------------------------------------------------------------
# task files
# ---------------------------------------------------------------------------------------------
def test_write_recall_tasks_files(tmp_path):
    names = rc.write_recall_tasks(tmp_path / "tasks", [4, {"n_pairs": 8, "depth": 0.0}], n_docs=7, seed=5)
    assert names == ["recall_mqar_4", "recall_mqar_8_d0"]
    for name, (n_pairs, depth) in zip(names, [(4, None), (8, 0.0)]):
        cfg = yaml.safe_load((tmp_path / "tasks" / f"{name}.yaml").read_text())
        assert cfg["task"] == name and cfg["tag"] == ["recall_mqar"]
        assert cfg["output_type"] == "multiple_choice" and cfg["test_split"] == "test"
        assert (cfg["doc_to_text"], cfg["doc_to_choice"], cfg["doc_to_target"]) == ("prompt", "choices", "gold")
        assert cfg["target_delimiter"] == ""  # the value's bytes follow "=" directly
        assert [m["metric"] for m in cfg["metric_list"]] == ["acc"]
        meta = cfg["metadata"]
        assert (meta["n_docs"], meta["n_pairs"], meta["depth"], meta["seed"], meta["chance"]) == (
            7,
            n_pairs,
            depth,
            5,
            0.25,
        )
        data = Path(cfg["dataset_kwargs"]["data_files"]["test"])
        assert data.is_absolute() and data == (tmp_path / "tasks" / f"{name}.jsonl").resolve()
        rows = [json.loads(line) for line in data.read_text(encoding="utf-8").splitlines()]
        assert rows == rc.generate_recall_docs(7, n_pairs, depth=depth, seed=5)
    assert not [p for p in (tmp_path / "tasks").iterdir() if p.name.endswith(".tmp")]
    with pytest.raises(ValueError, match=r"duplicate task names \['recall_mqar_4'\]"):
        rc.write_recall_tasks(tmp_path / "tasks", [4, 4], n_docs=2)
    with pytest.raises(ValueError, match="levels is empty"):
        rc.write_recall_tasks(tmp_path / "tasks", [], n_docs=2)


# ---------------------------------------------------------------------------------------------
# scoring through lm-eval
# ---------------------------------------------------------------------------------------------
LEVELS = [4, {"n_pairs": 8, "depth": 0.0}, {"n_pairs": 8, "n_choices": 3, "n_queries": 3}]
N_DOCS = 12
SEED = 11


def _level_docs(level) -> list[dict]:
    lv = rc.RecallLevel.parse(level)
    return rc.generate_recall_docs(N_DOCS, lv.n_pairs, lv.n_choices, lv.depth, lv.n_queries, seed=SEED)


def _hand_acc(model, tok, docs: list[dict]) -> float:
    """Accuracy from plain forward passes: argmax over candidates of sum log p(choice | prompt), choice after '='."""
    correct = 0
    for doc in docs:
        ctx = tok.encode(doc["prompt"])
        lls = []
        for choice in doc["choices"]:
            cont = tok.encode(choice)
            assert tok.encode(doc["prompt"] + choice) == ctx + cont  # byte level: no merges across the cut
            with torch.no_grad():
                logits = model(torch.tensor([ctx + cont[:-1]]), use_cache=False).logits[0]
            logp = torch.log_softmax(logits[-len(cont) :], dim=-1)
            lls.append(float(logp.gather(1, torch.tensor(cont)[:, None]).sum()))
        correct += int(np.argmax(lls)) == doc["gold"]
    return correct / len(docs)


@pytest.mark.parametrize("family", ["delta_net", "gated_deltanet", "mamba2", "qwen3_5"])
def test_lm_eval_acc_equals_hand_computation(family, tok, tmp_path):
    model = tiny_model(family, vocab_size=257)
    with torch.no_grad():  # fla's embedding init (std 0.02) leaves the logits almost uniform; spread them
        model.get_input_embeddings().weight.normal_(0.0, 0.5)
    res = rc.evaluate_recall(model, tok, tmp_path, LEVELS, n_docs=N_DOCS, seed=SEED, device="cpu")
    names = ["recall_mqar_4", "recall_mqar_8_d0", "recall_mqar_8_c3_q3"]
    assert list(res) == names
    for name, level in zip(names, LEVELS):
        acc = res[name]["acc"]
        assert 0.0 <= acc <= 1.0 and math.isfinite(res[name]["acc_stderr"])
        assert acc == _hand_acc(model, tok, _level_docs(level)), name


class _ConstOrOracleLM(nn.Module):
    """A byte-level stand-in LM for HFLM: a perfect induction copier ("oracle") or constant logits.

    The oracle puts logit 30 on the token that followed the latest earlier position sharing the
    longest common suffix (>= 3 tokens) with the current one, and 0 elsewhere. On a recall prompt
    ``... kx=47 ... kx=`` that suffix is ``\nkx=``, then ``\nkx=4``, so it continues with the right
    value; no other text is needed.
    """

    def __init__(self, oracle: bool, vocab: int = 257):
        super().__init__()
        self.oracle, self.vocab = oracle, vocab
        self.dummy = nn.Parameter(torch.zeros(1))
        from transformers import PretrainedConfig

        self.config = PretrainedConfig()

    @property
    def device(self) -> torch.device:
        return self.dummy.device

    def tie_weights(self):
        pass

    def forward(self, input_ids, use_cache=False):
        b, t = input_ids.shape
        logits = torch.zeros(b, t, self.vocab)
        if self.oracle:
            for row, ids in enumerate(input_ids.tolist()):
                ids = np.asarray(ids)
                match = ids[:, None] == ids[None, :]
                suffix = np.zeros((t, t), dtype=int)  # suffix[i, j]: common suffix length of ids[:i+1], ids[:j+1]
                suffix[0] = match[0]
                for i in range(1, t):
                    suffix[i, 0] = match[i, 0]
                    suffix[i, 1:] = match[i, 1:] * (1 + suffix[i - 1, :-1])
                for i in range(1, t):
                    s = suffix[i, :i]
                    j = i - 1 - int(np.argmax(s[::-1]))  # the latest earlier position with the longest match
                    if s[j] >= 3:
                        logits[row, i, ids[j + 1]] = 30.0
        return types.SimpleNamespace(logits=logits)


def test_oracle_scores_one_and_constant_model_picks_index_zero(tok, tmp_path):
    levels = LEVELS + [{"n_pairs": 16, "depth": 1.0}]
    oracle = rc.evaluate_recall(_ConstOrOracleLM(oracle=True), tok, tmp_path, levels, n_docs=N_DOCS, seed=SEED)
    assert {name: m["acc"] for name, m in oracle.items()} == dict.fromkeys(oracle, 1.0)
    const = rc.evaluate_recall(_ConstOrOracleLM(oracle=False), tok, tmp_path, levels, n_docs=N_DOCS, seed=SEED)
    for name, level in zip(const, levels):
        gold0 = np.mean([d["gold"] == 0 for d in _level_docs(level)])
        assert const[name]["acc"] == gold0 and gold0 < 1.0


def test_evaluate_recall_rejects_short_max_length(tok, tmp_path):
    with pytest.raises(ValueError, match=r"max_length 16 is shorter than the longest recall document \(\d+ tokens\)"):
        rc.evaluate_recall(_ConstOrOracleLM(oracle=False), tok, tmp_path, [8], n_docs=2, max_length=16)


# ---------------------------------------------------------------------------------------------
# the recall_probe suite in the workflow's eval path (eval.run.evaluate_loaded)
# ---------------------------------------------------------------------------------------------
def test_evaluate_loaded_recall_probe_suite_without_heldout(tok, tmp_path):
    """tasks=[] and suites=[recall_probe]: the levels are written to a temporary folder and scored by lm-eval; nothing
    but eval.json is left next to it (no task files, no ``datasets`` cache or ``.lock`` files)."""
    from statereduce.eval.run import evaluate_loaded

    model = tiny_model("delta_net", vocab_size=257)
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0.0, 0.5)
    levels = LEVELS[:2]
    settings = {
        "tasks": [],
        "suites": ["recall_probe"],
        "recall_probe": {"levels": levels, "n_docs": N_DOCS, "seed": SEED},
        "batch_size": 2,
        "max_length": 256,
    }
    out = tmp_path / "baseline" / "eval.json"
    doc = evaluate_loaded(model, tok, "ckpt", EvalSettings.from_dict(settings), {"model": "tiny-dn"}, out,
                          {"method": "baseline"})
    names = ["recall_mqar_4", "recall_mqar_8_d0"]
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["baseline", "baseline/eval.json"]
    assert list(doc["metrics"]) == names and doc["settings"]["tasks"] == names
    accs = [_hand_acc(model, tok, _level_docs(level)) for level in levels]
    assert [doc["metrics"][n]["acc"] for n in names] == accs
    assert doc["suites"] == {"recall_probe": {"recall_mqar_avg": pytest.approx(sum(accs) / 2)}}
    assert doc["provenance"]["model_id"] == "tiny-dn" and doc["provenance"]["method"] == "baseline"
    assert json.loads(out.read_text()) == doc


def test_recall_probe_writer_checks_window(tok, tmp_path):
    writer = rc.recall_probe_writer(RecallProbeSettings(levels=[8], n_docs=2), tok, max_length=16)
    with pytest.raises(ValueError, match=r"max_length 16 is shorter than the longest recall document"):
        writer(tmp_path)
    writer = rc.recall_probe_writer(RecallProbeSettings(levels=[8], n_docs=2), tok, max_length=512)
    assert writer(tmp_path) == ["recall_mqar_8"]


def test_documents_are_pinned():
    """The probe's and the training documents' streams are fixed by their seeds' names: the hashes below were computed
    by the code that produced the published results, so a change to the generators or their seed names (which would
    silently change every probe document and the recall-mix pretraining) fails here."""
    import hashlib
    import json

    probe = rc.generate_recall_docs(20, 8, seed=0)
    train = rc.recall_train_docs(20, [1, 2], seed=0)
    assert hashlib.sha256(json.dumps(probe, sort_keys=True).encode()).hexdigest() == (
        "fc658db32a39d59ea36e04df88ace6e3cb94c19bb72c68082d62accab4a4553d")
    assert hashlib.sha256("\n\n".join(train).encode()).hexdigest() == (
        "c688cdea57ad91f9ca2a84bc493b74408321e4058663f997746f7d2d2a5a3dd8")


def test_answer_labels_mark_the_query_values():
    """answer_labels: the ids are token_stream's; the labels keep exactly the query lines' value bytes."""
    from statereduce.core.data import token_stream
    from statereduce.core.tokenizer import byte_level_tokenizer
    from statereduce.eval.recall import answer_labels

    tok = byte_level_tokenizer()
    docs = ["ab=12\ncd=34\ncd=34\nab=12", "xy=56\nxy=56"]
    ids, labels = answer_labels(tok, docs)
    assert torch.equal(ids, token_stream(tok, docs))
    kept = "".join(chr(i) if lab != -100 else "_" for i, lab in zip(ids.tolist(), labels.tolist()))
    assert kept == "_" * 15 + "34" + "_" * 4 + "12" + "_" * 10 + "56"  # the EOS between the documents too


class _BigramLM(torch.nn.Module):
    """A bigram model: the logits after a token are a fixed random row of that token."""

    def __init__(self, seed: int):
        super().__init__()
        self.table = torch.randn(300, 300, generator=torch.Generator().manual_seed(seed))

    def forward(self, input_ids):
        return types.SimpleNamespace(logits=self.table[input_ids])


def test_recall_accuracy_scores_like_multiple_choice():
    """recall_accuracy against a hand count: each choice's summed bigram log-likelihood after the prompt, the best
    choice against gold."""
    from statereduce.core.tokenizer import byte_level_tokenizer
    from statereduce.eval.recall import generate_recall_docs, recall_accuracy

    tok = byte_level_tokenizer()
    docs = generate_recall_docs(60, 4, seed=5)
    for seed in range(3):
        lm = _BigramLM(seed)
        logp = torch.log_softmax(lm.table, dim=-1)
        hits = 0
        for d in docs:
            scores = []
            for choice in d["choices"]:
                ids = tok(d["prompt"] + choice, add_special_tokens=False)["input_ids"]
                n = len(choice)
                scores.append(sum(float(logp[ids[k - 1], ids[k]]) for k in range(len(ids) - n, len(ids))))
            hits += scores.index(max(scores)) == d["gold"]
        assert recall_accuracy(lm, tok, docs) == hits / len(docs)


@pytest.mark.parametrize("family", ["delta_net", "qwen3_5"])
def test_choice_scores_in_batches_are_the_one_document_scores(family):
    """Documents of 4 and 8 pairs (rows of different lengths, right-padded together) score as they do one at a time,
    for every batch size: a row's scored positions never see another row or its padding."""
    from statereduce.core.tokenizer import byte_level_tokenizer
    from statereduce.eval.recall import choice_scores, generate_recall_docs, recall_accuracy

    tok = byte_level_tokenizer()
    model = tiny_model(family, vocab_size=257)
    docs = generate_recall_docs(12, 4, seed=3) + generate_recall_docs(12, 8, seed=4)
    docs = [docs[i] for i in torch.randperm(len(docs), generator=torch.Generator().manual_seed(0)).tolist()]
    one = [choice_scores(model, tok, [d])[0] for d in docs]
    for batch_docs in (5, 24):
        assert torch.allclose(torch.tensor(choice_scores(model, tok, docs, batch_docs=batch_docs)),
                              torch.tensor(one), rtol=0, atol=1e-4)
    hits = sum(max(range(4), key=s.__getitem__) == d["gold"] for s, d in zip(one, docs))
    assert recall_accuracy(model, tok, docs, batch_docs=5) == hits / len(docs)
