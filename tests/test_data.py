"""Corpus sources (embedded / pydoc_topics / files / hf) and token blocks."""

from __future__ import annotations

import hashlib
import platform
from pathlib import Path

import pytest
import torch
from _paths import ROOT

from statereduce.core import data
# Real text files next to the repository (not part of it): the tests that read them skip without them.
SHARED_DATA = ROOT.parent / "shared" / "data"
SMALL_EMBEDDED = {"source": "embedded", "max_bytes": 600_000}


def need_shared(name: str) -> Path:
    p = SHARED_DATA / name
    if not p.is_file():
        pytest.skip(f"needs the text file {p}, which lies outside the repository and is absent on this machine")
    return p


# ---- embedded ---------------------------------------------------------------------------------------
def test_embedded_splits_disjoint_deterministic_and_complete():
    files = data.embedded_corpus(SMALL_EMBEDDED["max_bytes"])
    splits = {s: data.load_split(SMALL_EMBEDDED, s) for s in data.SPLITS}
    assert all(splits.values()), {s: len(d) for s, d in splits.items()}
    # every file lands in exactly one split, order preserved
    assert sorted(t for d in splits.values() for t in d) == sorted(t for _, t in files)
    by_text = {t: rel for rel, t in files}
    rels = {s: {by_text[t] for t in d} for s, d in splits.items()}
    assert (
        not (rels["train"] & rels["calib"])
        and not (rels["train"] & rels["heldout"])
        and not (rels["calib"] & rels["heldout"])
    )
    assert splits == {s: data.load_split(dict(SMALL_EMBEDDED), s) for s in data.SPLITS}
    # the split is a pure function of the relative path
    fr = data._fractions(SMALL_EMBEDDED)
    for rel, _ in files:
        assert rel in rels[data.split_of(rel, fr)]


def test_embedded_provenance_matches_corpus():
    files = data.embedded_corpus(SMALL_EMBEDDED["max_bytes"])
    prov = data.embedded_provenance(SMALL_EMBEDDED)
    texts = [t for _, t in files]
    assert prov["python_version"] == platform.python_version()
    assert prov["n_files"] == len(files) > 5
    assert prov["total_bytes"] == sum(len(t.encode()) for t in texts) <= SMALL_EMBEDDED["max_bytes"]
    assert prov["total_bytes"] > SMALL_EMBEDDED["max_bytes"] // 2
    assert prov["sha256"] == hashlib.sha256("".join(texts).encode()).hexdigest()
    assert sum(v["n_docs"] for v in prov["splits"].values()) == len(files)
    assert prov["splits"]["heldout"]["bytes"] == sum(
        len(t.encode()) for t in data.load_split(SMALL_EMBEDDED, "heldout")
    )
    rels = [r for r, _ in files]
    assert prov["first_file"] == rels[0] and all(r.endswith(".py") for r in rels)
    assert not any(part in ("test", "idlelib", "site-packages") for r in rels for part in r.split("/"))
    # top-level modules, sorted
    top = [r for r in rels if "/" not in r]
    assert top == sorted(top) and top[0] == rels[0]


def test_embedded_budget_and_packages():
    big = data.embedded_corpus(20_000_000)
    assert any("/" in r for r, _ in big), "packages are read after the top-level modules"
    assert sum(len(t.encode()) for _, t in big) <= 20_000_000
    small = data.embedded_corpus(100_000)
    assert [r for r, _ in small] == [r for r, _ in big][: len(small)]


def test_fractions_and_source_errors():
    with pytest.raises(ValueError, match="sum to 1"):
        data.load_split({"source": "embedded", "fractions": {"train": 0.5, "calib": 0.1, "heldout": 0.1}}, "train")
    with pytest.raises(ValueError, match="unknown corpus source 'nope'; valid: embedded, pydoc_topics, files, hf"):
        data.load_split({"source": "nope"}, "train")
    with pytest.raises(ValueError, match="unknown split 'test'"):
        data.load_split(SMALL_EMBEDDED, "test")
    with pytest.raises(ValueError, match="unknown key"):
        data.load_split({"source": "embedded", "max_byte": 5}, "train")
    only_train = {"source": "embedded", "max_bytes": 200_000, "fractions": {"train": 1.0}}
    assert data.load_split(only_train, "calib") == [] and len(data.load_split(only_train, "train")) > 0


# ---- pydoc_topics -----------------------------------------------------------------------------------
PYDOC = {"source": "pydoc_topics"}


def test_pydoc_topics_are_the_help_texts_split_by_topic_name():
    from pydoc_data.topics import topics

    docs = data.pydoc_topics_corpus()
    assert [name for name, _ in docs] == sorted(n for n, t in topics.items() if t.strip()) and len(docs) > 50
    assert all(text == topics[name] for name, text in docs)
    splits = {s: data.load_split(PYDOC, s) for s in data.SPLITS}
    assert all(splits.values()), {s: len(d) for s, d in splits.items()}
    fr = data._fractions(PYDOC)
    for s in data.SPLITS:  # the split of a topic is a pure function of its name; corpus order is kept
        assert splits[s] == [t for name, t in docs if data.split_of(name, fr) == s]
    assert splits == {s: data.load_split(dict(PYDOC), s) for s in data.SPLITS}
    assert data.load_split({**PYDOC, "fractions": {"calib": 1.0}}, "calib") == [t for _, t in docs]
    capped = data.pydoc_topics_corpus(max_bytes=50_000)
    assert capped == docs[: len(capped)] and 0 < sum(len(t.encode()) for _, t in capped) <= 50_000
    with pytest.raises(ValueError, match="unknown key"):
        data.load_split({**PYDOC, "packages": ["json"]}, "train")
    with pytest.raises(ValueError, match="pydoc_topics corpus is empty within max_bytes=10"):
        data.load_split({**PYDOC, "max_bytes": 10}, "train")


def test_pydoc_topics_provenance_matches_corpus():
    docs = data.pydoc_topics_corpus()
    prov = data.corpus_provenance(PYDOC)
    texts = [t for _, t in docs]
    assert prov["source"] == "pydoc_topics" and prov["python_version"] == platform.python_version()
    assert prov["n_docs"] == len(docs) and prov["total_bytes"] == sum(len(t.encode()) for t in texts)
    assert prov["sha256"] == hashlib.sha256("".join(texts).encode()).hexdigest()
    assert (prov["first_topic"], prov["last_topic"]) == (docs[0][0], docs[-1][0])
    for s in data.SPLITS:
        split = data.load_split(PYDOC, s)
        assert prov["splits"][s] == {"n_docs": len(split), "bytes": sum(len(t.encode()) for t in split)}


# ---- files ------------------------------------------------------------------------------------------
def test_split_documents_modes():
    text = " = A = \n \n body a \n = = Sub = = \n more a \n = B = \n body b \n"
    assert data.split_documents(text, "wikitext") == [
        " = A = \n \n body a \n = = Sub = = \n more a \n",
        " = B = \n body b \n",
    ]
    paras = "\n\n".join(f"p{i} " + "x" * 10 for i in range(10))
    docs = data.split_documents(paras, "paragraphs", doc_bytes=30)
    assert "\n\n".join(docs) == paras and all(len(d) >= 30 for d in docs[:-1]) and len(docs) == 4
    assert data.split_documents("abc", "file") == ["abc"]
    with pytest.raises(ValueError, match="unknown doc_mode 'lines'"):
        data.split_documents("abc", "lines")


def test_files_fraction_split_on_shared_data():
    path = need_shared("tinyshakespeare.txt")
    spec = {"source": "files", "paths": [str(path)], "doc_mode": "paragraphs", "doc_bytes": 4096}
    splits = {s: data.load_split(spec, s) for s in data.SPLITS}
    assert all(splits.values())
    assert not (set(splits["train"]) & set(splits["heldout"])) and not (set(splits["calib"]) & set(splits["heldout"]))
    n = sum(len(d) for d in splits.values())
    assert n == len(data.split_documents(path.read_text(), "paragraphs", 4096))
    assert 0.6 < len(splits["train"]) / n < 0.95
    assert splits == {s: data.load_split(spec, s) for s in data.SPLITS}
    capped = data.load_split({**spec, "max_bytes": 10_000}, "train")
    assert capped == splits["train"][: len(capped)] and sum(len(d.encode()) for d in capped) <= 10_000 and capped
    prov = data.corpus_provenance(spec)
    assert prov["files"][0]["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()


def test_files_explicit_splits_wikitext():
    valid, test = need_shared("wikitext2_valid.txt"), need_shared("wikitext2_test.txt")
    spec = {"source": "files", "splits": {"train": [str(valid)], "heldout": str(test)}, "doc_mode": "wikitext"}
    heldout = data.load_split(spec, "heldout")
    assert len(heldout) == 62 and heldout[0].startswith(" = Robert <unk> = \n")
    assert "".join(heldout).strip() == test.read_text(encoding="utf-8").strip()
    assert len(data.load_split(spec, "train")) == 60
    with pytest.raises(ValueError, match="split 'calib' not listed"):
        data.load_split(spec, "calib")
    with pytest.raises(ValueError, match="exactly one of"):
        data.load_split({"source": "files"}, "train")
    with pytest.raises(ValueError, match="does not exist"):
        data.load_split({"source": "files", "paths": ["/nonexistent/x.txt"]}, "train")


# ---- hf ---------------------------------------------------------------------------------------------
def test_hf_source_with_local_text_dataset(tmp_path):
    train_lines = [f"train line {i} " + "abc" * (i % 7) for i in range(200)]
    test_lines = [f"test line {i}" for i in range(50)]
    (tmp_path / "train.txt").write_text("\n".join(train_lines) + "\n")
    (tmp_path / "test.txt").write_text("\n".join(test_lines) + "\n")
    spec = {
        "source": "hf",
        "path": "text",
        "data_files": {"train": str(tmp_path / "train.txt"), "test": str(tmp_path / "test.txt")},
        "cache_dir": str(tmp_path / "cache"),
    }
    assert data.load_split(spec, "train") == train_lines
    assert data.load_split(spec, "heldout") == test_lines
    assert data.load_split(spec, "calib") == train_lines  # default mapping: calib reads HF "train"
    assert data.load_split({**spec, "max_docs": 7}, "train") == train_lines[:7]
    capped = data.load_split({**spec, "max_bytes": 500}, "train")
    assert capped == train_lines[: len(capped)] and 0 < sum(len(x) for x in capped) <= 500
    sliced = {**spec, "splits": {"train": "train[:50%]", "calib": "train[50%:]", "heldout": "test"}}
    assert data.load_split(sliced, "train") + data.load_split(sliced, "calib") == train_lines
    streamed = data.load_split({**spec, "streaming": True, "max_docs": 10}, "heldout")
    assert streamed == test_lines[:10]
    rows = {
        **spec,
        "streaming": True,
        "splits": {"train": "train[:150]", "calib": "train[150:180]", "heldout": "test[40:]"},
    }
    assert data.load_split(rows, "train") == train_lines[:150]
    assert data.load_split(rows, "calib") == train_lines[150:180]
    assert data.load_split(rows, "heldout") == test_lines[40:]
    with pytest.raises(ValueError, match="cannot be streamed"):
        data.load_split({**rows, "splits": {"train": "train[:50%]"}}, "train")
    joined = data.load_split({**spec, "doc_mode": "paragraphs"}, "heldout")
    assert joined == ["\n".join(test_lines) + "\n"]
    with pytest.raises(ValueError, match="text_field 'body' not in dataset columns"):
        data.load_split({**spec, "text_field": "body"}, "train")
    assert data.corpus_provenance(spec)["splits"]["heldout"] == "test"


# ---- token blocks -----------------------------------------------------------------------------------
def test_token_stream_joins_with_eos(tok):
    s = data.token_stream(tok, ["ab", "", "é"])
    assert s.tolist() == [97, 98, 256, 0xC3, 0xA9]


def test_token_blocks_deterministic_and_errors(tok):
    docs = data.load_split(SMALL_EMBEDDED, "heldout")
    a = data.token_blocks(tok, docs, n_samples=8, seq_len=64, seed=3)
    b = data.token_blocks(tok, docs, n_samples=8, seq_len=64, seed=3)
    c = data.token_blocks(tok, docs, n_samples=8, seq_len=64, seed=4)
    assert a.shape == (8, 64) and a.dtype == torch.long and torch.equal(a, b) and not torch.equal(a, c)
    stream = data.token_stream(tok, docs)
    blocks = stream[: stream.numel() // 64 * 64].view(-1, 64)
    # every sample is one of the aligned, non-overlapping blocks, all distinct
    idx = [next(i for i in range(blocks.shape[0]) if torch.equal(blocks[i], row)) for row in a]
    assert len(set(idx)) == 8
    assert int(a.max()) <= 256 and int(a.min()) >= 0
    n_blocks = stream.numel() // 64
    with pytest.raises(
        ValueError, match=rf"{stream.numel()} tokens give {n_blocks} blocks of seq_len=64, but n_samples={n_blocks + 1}"
    ):
        data.token_blocks(tok, docs, n_samples=n_blocks + 1, seq_len=64, seed=0)
    assert data.token_blocks(tok, docs, n_samples=n_blocks, seq_len=64, seed=0).shape == (n_blocks, 64)
