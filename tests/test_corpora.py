"""Every corpus form statereduce/core/data.py documents works in the workflow.

For each form (``embedded``, ``pydoc_topics``, ``files`` with ``paths``, ``files`` with ``splits``, ``hf``) a
tiny config (the shipped tiny-dn model, every corpus reference pointed at the corpus under test) makes
``snakemake -n`` plan the default target, and ``data.load_split`` returns the documents the test wrote.
The ``files`` corpora use paths relative to the workflow directory (a copy of the workflow under
``tmp_path``), which is not the work directory: the dry run only succeeds when they are resolved there.
"""

from __future__ import annotations

import copy
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from _paths import ROOT
from _snakemake import copy_workflow, snakemake

from statereduce.core import data
from statereduce.config import ConfigError, validate_config

FRACTIONS = {"train": 0.6, "calib": 0.2, "heldout": 0.2}
# rules the default target plans for a model trained by the workflow, pruned with grad and drrqr
DEFAULT_RULES = {"pretrain", "qk_weights", "calibrate", "grad_scores", "select_channels", "prune", "rft", "summarize",
                 "eval_baseline", "comparison_table"}


@pytest.fixture(scope="module")
def workflow_copy(tmp_path_factory) -> Path:
    """A copy of the workflow with the corpus files of the ``files`` forms under its ``data/``."""
    wf = copy_workflow(tmp_path_factory.mktemp("workflow"))
    (wf / "data").mkdir()
    for name, text in corpus_files().items():
        (wf / "data" / name).write_text(text, encoding="utf-8")
    return wf


def corpus_files() -> dict[str, str]:
    """Plain-text files: two of 40 paragraphs each; a WikiText-style file per split (articles ' = Title = ')."""
    files = {f"{n}.txt": "\n\n".join(f"Paragraph {i} of {n}: " + "words " * (i % 5 + 1) for i in range(40)) + "\n"
             for n in ("alpha", "beta")}
    for split, n_articles in (("train", 6), ("valid", 3), ("test", 2)):
        files[f"wiki_{split}.txt"] = "".join(f" = {split} article {i} = \n \n Body of {split} article {i} . \n \n"
                                             for i in range(n_articles))
    return files


def tiny_config(spec: dict) -> dict:
    """The shipped config reduced to tiny-dn (grad and drrqr at 75%) reading only the corpus ``c`` = ``spec``."""
    base = yaml.safe_load((ROOT / "config.yaml").read_text())
    model = copy.deepcopy(base["models"]["tiny-dn"])
    for block in ("pretrain", "calibration", "eval"):
        model[block]["corpus"] = "c"
    cfg = {k: base[k] for k in ("rft", "rank", "selectors")}
    cfg.update(targets={"models": ["tiny-dn"], "methods": ["grad", "drrqr"], "pcts": [75]}, corpora={"c": spec},
               models={"tiny-dn": model})
    return cfg


def dry_run(workflow: Path, workdir: Path, cfg: dict) -> subprocess.CompletedProcess:
    """``snakemake -n`` of the default target with ``cfg`` in the empty work directory ``workdir``."""
    return snakemake(workdir, "-n", cfg=cfg, workflow=workflow)


def planned_rules(out: subprocess.CompletedProcess) -> set[str]:
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    return set(re.findall(r"^\s*(?:local)?rule (\w+):", out.stdout + out.stderr, flags=re.MULTILINE))


def paragraphs(name: str) -> list[tuple[str, str]]:
    """(stable key, document) of a ``corpus_files`` file read with doc_bytes 1: one document per paragraph."""
    return [(f"{name}:{i}", p) for i, p in enumerate(corpus_files()[name].split("\n\n"))]


def articles(name: str) -> list[str]:
    text = corpus_files()[name]
    starts = [m.start() for m in re.finditer(r"^ = ", text, flags=re.MULTILINE)]
    return [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)])]


def in_workflow(spec: dict, workflow: Path) -> dict:
    """``spec`` with its relative file paths under ``workflow``, as the workflow hands it to the jobs."""
    spec = copy.deepcopy(spec)
    if "paths" in spec:
        spec["paths"] = [str(workflow / p) for p in spec["paths"]]
    if "splits" in spec:
        spec["splits"] = {s: str(workflow / p) for s, p in spec["splits"].items()}
    return spec


# ---- one test per corpus form -----------------------------------------------------------------------------------
def test_embedded(workflow_copy, tmp_path):
    spec = {"source": "embedded", "max_bytes": 300_000, "fractions": FRACTIONS}
    assert DEFAULT_RULES <= planned_rules(dry_run(workflow_copy, tmp_path, tiny_config(spec)))
    files = data.embedded_corpus(300_000)
    for s in data.SPLITS:
        assert data.load_split(spec, s) == [t for rel, t in files if data.split_of(rel, FRACTIONS) == s]
    assert sorted(t for s in data.SPLITS for t in data.load_split(spec, s)) == sorted(t for _, t in files)


def test_pydoc_topics(workflow_copy, tmp_path):
    from pydoc_data.topics import topics

    spec = {"source": "pydoc_topics"}
    assert DEFAULT_RULES <= planned_rules(dry_run(workflow_copy, tmp_path, tiny_config(spec)))
    fr = data._fractions(spec)
    for s in data.SPLITS:
        expected = [topics[name] for name in sorted(topics) if topics[name].strip() and data.split_of(name, fr) == s]
        assert data.load_split(spec, s) == expected and expected


def test_files_paths(workflow_copy, tmp_path):
    spec = {"source": "files", "paths": ["data/alpha.txt", "data/beta.txt"], "doc_bytes": 1, "fractions": FRACTIONS}
    assert DEFAULT_RULES <= planned_rules(dry_run(workflow_copy, tmp_path, tiny_config(spec)))
    docs = paragraphs("alpha.txt") + paragraphs("beta.txt")
    for s in data.SPLITS:
        expected = [d for key, d in docs if data.split_of(key, FRACTIONS) == s]
        assert data.load_split(in_workflow(spec, workflow_copy), s) == expected and expected


def test_files_splits(workflow_copy, tmp_path):
    spec = {"source": "files", "doc_mode": "wikitext",
            "splits": {"train": "data/wiki_train.txt", "calib": "data/wiki_valid.txt", "heldout": "data/wiki_test.txt"}}
    assert DEFAULT_RULES <= planned_rules(dry_run(workflow_copy, tmp_path, tiny_config(spec)))
    spec = in_workflow(spec, workflow_copy)
    assert data.load_split(spec, "train") == articles("wiki_train.txt") and len(articles("wiki_train.txt")) == 6
    assert data.load_split(spec, "calib") == articles("wiki_valid.txt")
    assert data.load_split(spec, "heldout") == [" = test article 0 = \n \n Body of test article 0 . \n \n",
                                                " = test article 1 = \n \n Body of test article 1 . \n \n"]


def test_hf_local_text_files(workflow_copy, tmp_path):
    lines = {split: [f"{split} row {i}: " + "text " * (i % 4 + 1) for i in range(n)] for split, n in
             (("train", 40), ("test", 10))}
    for split, rows in lines.items():
        (tmp_path / f"{split}.txt").write_text("\n".join(rows) + "\n")
    spec = {"source": "hf", "path": "text", "cache_dir": str(tmp_path / "hf_cache"),
            "data_files": {s: str(tmp_path / f"{s}.txt") for s in lines},
            "splits": {"train": "train[:75%]", "calib": "train[75%:]", "heldout": "test"}}
    assert DEFAULT_RULES <= planned_rules(dry_run(workflow_copy, tmp_path / "work", tiny_config(spec)))
    assert data.load_split(spec, "train") == lines["train"][:30]
    assert data.load_split(spec, "calib") == lines["train"][30:]
    assert data.load_split(spec, "heldout") == lines["test"]


# ---- bad corpora fail before any job runs, with one line ------------------------------------------------------
def test_missing_corpus_file_fails_when_planning(workflow_copy, tmp_path):
    spec = {"source": "files", "splits": {"train": "data/wiki_train.txt", "calib": "data/wiki_valid.txt",
                                          "heldout": "data/wiki_tset.txt"}}
    out = dry_run(workflow_copy, tmp_path, tiny_config(spec))
    text = out.stdout + out.stderr
    assert out.returncode != 0
    missing = str(workflow_copy / "data" / "wiki_tset.txt")
    assert re.search(rf"corpora\.c\.splits\.heldout: corpus file '{re.escape(missing)}' does not exist", text), text


def test_files_needs_paths_or_splits(workflow_copy, tmp_path):
    spec = {"source": "files", "paths": ["data/alpha.txt"], "splits": {"train": "data/beta.txt"}}
    out = dry_run(workflow_copy, tmp_path, tiny_config(spec))
    assert out.returncode != 0
    assert "corpora.c: a files corpus needs exactly one of 'paths' (split by fractions) or 'splits'" in (
        out.stdout + out.stderr
    )


BAD_SPECS = {
    "unknown_key": ({"source": "embedded", "max_byte": 5}, r"corpora\.c: .*'max_byte' was unexpected"),
    "unknown_source": ({"source": "pg19"}, r"corpora\.c\.source: 'pg19' is not one of .*'pydoc_topics'"),
    "files_key_on_pydoc": ({"source": "pydoc_topics", "paths": ["x.txt"]}, r"corpora\.c: .*'paths' was unexpected"),
    "bad_split_name": ({"source": "files", "splits": {"test": "x.txt"}}, r"corpora\.c\.splits: 'test' is not one of"),
    "bad_doc_mode": ({"source": "files", "paths": "x.txt", "doc_mode": "lines"}, r"corpora\.c\.doc_mode: 'lines'"),
    "hf_without_path": ({"source": "hf", "name": "x"}, r"corpora\.c: 'path' is a required property"),
}


@pytest.mark.parametrize("case", sorted(BAD_SPECS))
def test_bad_corpus_spec_rejected_by_validation(case):
    spec, pattern = BAD_SPECS[case]
    with pytest.raises(ConfigError) as exc:
        validate_config(tiny_config(spec))
    assert "\n" not in str(exc.value) and re.search(pattern, str(exc.value)), str(exc.value)
