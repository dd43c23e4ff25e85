"""Corpus sources and token blocks for pretraining, calibration and held-out evaluation.

A corpus is described by a small spec dict (the ``corpus`` entries of ``config.yaml``) and read as a
list of documents (``str``) per split: ``"train"`` (pretraining the embedded tiny models),
``"calib"`` (calibration activations / gradient scores, paper Sec. 3.4 and App. B.2) and
``"heldout"`` (loss/perplexity on text the model never saw). Four sources:

``embedded``
    An offline corpus that exists on every machine with Python installed: the Python source files
    of the running interpreter's standard library. Nothing is downloaded. Keys (all optional):
    ``max_bytes`` (corpus byte budget, default 4,000,000), ``fractions`` (default
    ``{"train": 0.8, "calib": 0.1, "heldout": 0.1}``; whole files are documents, so the split is
    lumpy, and 5% gave the calibration split only 3 files on CPython 3.11), ``packages`` (stdlib
    packages read after the top-level modules, default :data:`EMBEDDED_PACKAGES`). See
    :func:`embedded_corpus` and :func:`embedded_provenance`.
``pydoc_topics``
    Offline English prose that exists on every machine with Python installed: the help texts of the
    Python documentation that CPython ships for ``help("TOPIC")`` (``pydoc_data.topics.topics``, about
    80 topics such as ``assert``, ``lists``, ``formatstrings``; 466,117 bytes on CPython 3.11.7). One topic
    = one document, in sorted topic order; the split is the same stable hash as ``embedded``'s, of the
    topic name. Keys (all optional): ``fractions`` (as for ``embedded``) and ``max_bytes`` (corpus byte
    budget before splitting, default: all topics). See :func:`pydoc_topics_corpus` and
    :func:`pydoc_topics_provenance`.
``files``
    Local UTF-8 text files. Either ``paths: [...]`` (all files cut into documents, then split by
    ``fractions`` with the same stable hash as ``embedded``) or ``splits: {"train": [...],
    "heldout": [...]}`` (explicit files per split; a split not listed is an error). ``doc_mode``:
    ``"paragraphs"`` (default: blank-line-separated paragraphs grouped greedily into documents of at
    least ``doc_bytes`` bytes, default 8192, paragraphs re-joined with one blank line),
    ``"wikitext"`` (one document per top-level `` = Title = `` heading of the WikiText release) or
    ``"file"`` (one document per file). Optional ``max_docs``/``max_bytes`` cap each returned split.
``hf``
    A Hugging Face dataset through ``datasets.load_dataset(path, name, data_files=..., split=...,
    revision=..., streaming=...)``. Keys: ``path`` (required), ``name``, ``data_files``, ``revision``,
    ``cache_dir``, ``streaming`` (default False), ``text_field`` (default ``"text"``), ``splits``
    (our split -> HF split, default ``{"train": "train", "calib": "train", "heldout": "test"}``; HF
    slicing such as ``"train[:95%]"`` works when not streaming, and row ranges such as
    ``"train[100000:110000]"`` also when streaming, so that splits of one HF split can be disjoint),
    ``doc_mode`` (``"rows"``, default: one document per row; ``"paragraphs"``/``"wikitext"``: rows are
    joined into one text first, as in WikiText-2-raw where each row is a line), ``doc_bytes``,
    ``max_docs``, ``max_bytes``. A streamed split of parquet data files (FineWeb) is read from the files that hold
    its row range (:func:`parquet_shards`): each is downloaded once into the Hugging Face cache and only the row
    groups of the range are read, giving the rows, in the order, that streaming ``skip``/``take`` gives; offline
    (``HF_HUB_OFFLINE``) the cache alone serves them (docs/offline.md).

Document order is deterministic for every source; byte caps are hard budgets (documents are taken
in order while the running total of UTF-8 bytes stays within the budget).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
import platform
import re
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import torch

SPLITS = ("train", "calib", "heldout")
SOURCES = ("embedded", "pydoc_topics", "files", "hf")
DOC_MODES = ("paragraphs", "wikitext", "file")
HF_DOC_MODES = ("rows", "paragraphs", "wikitext")

DEFAULT_FRACTIONS = {"train": 0.80, "calib": 0.10, "heldout": 0.10}
DEFAULT_EMBEDDED_MAX_BYTES = 4_000_000
DEFAULT_DOC_BYTES = 8192
DEFAULT_HF_SPLITS = {"train": "train", "calib": "train", "heldout": "test"}

# Pure-Python stdlib packages read (sorted by relative path) after the top-level ``*.py`` modules,
# when the byte budget asks for more. Packages absent from an interpreter version are skipped.
EMBEDDED_PACKAGES = (
    "asyncio",
    "collections",
    "concurrent",
    "email",
    "html",
    "http",
    "importlib",
    "json",
    "logging",
    "multiprocessing",
    "re",
    "sqlite3",
    "tomllib",
    "unittest",
    "urllib",
    "wsgiref",
    "xml",
    "xmlrpc",
    "zoneinfo",
)
# Directory names never read, wherever they occur.
_EXCLUDED_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "lib2to3"})

_WIKITEXT_HEADING = re.compile(r"^ = [^=\n](?:.*[^=\n])? = $", flags=re.MULTILINE)
_BLANK_LINES = re.compile(r"\n[ \t]*\n")


# ---- shared helpers -------------------------------------------------------------------------------
def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")


def _check_keys(spec: dict, allowed: Iterable[str]) -> None:
    allowed = set(allowed) | {"source"}
    bad = sorted(set(spec) - allowed)
    if bad:
        raise ValueError(f"unknown key(s) {bad} for corpus source {spec.get('source')!r}; valid: {sorted(allowed)}")


def _fractions(spec: dict) -> dict[str, float]:
    fr = dict(spec.get("fractions") or DEFAULT_FRACTIONS)
    bad = sorted(set(fr) - set(SPLITS))
    if bad:
        raise ValueError(f"unknown split(s) {bad} in fractions; valid: {', '.join(SPLITS)}")
    fr = {s: float(fr.get(s, 0.0)) for s in SPLITS}
    if any(v < 0 for v in fr.values()) or abs(sum(fr.values()) - 1.0) > 1e-9:
        raise ValueError(f"fractions must be >= 0 and sum to 1, got {fr}")
    return fr


def hash_fraction(key: str) -> float:
    """A stable number in [0, 1) from the SHA-1 of ``key`` (independent of Python's hash seed)."""
    return int(hashlib.sha1(key.encode("utf-8")).hexdigest()[:15], 16) / float(16**15)


def split_of(key: str, fractions: dict[str, float]) -> str:
    """The split a document with stable key ``key`` belongs to, under cumulative ``fractions``."""
    u = hash_fraction(key)
    acc = 0.0
    for s in SPLITS:
        acc += fractions.get(s, 0.0)
        if u < acc:
            return s
    return [s for s in SPLITS if fractions.get(s, 0.0) > 0][-1]  # u within rounding of 1.0


def _cap(docs: Iterable[str], max_docs: int | None = None, max_bytes: int | None = None) -> list[str]:
    """Documents in order while count <= max_docs and total UTF-8 bytes <= max_bytes."""
    out: list[str] = []
    total = 0
    for d in docs:
        if max_docs is not None and len(out) >= max_docs:
            break
        n = len(d.encode("utf-8"))
        if max_bytes is not None and total + n > max_bytes:
            break
        out.append(d)
        total += n
    return out


def split_documents(text: str, doc_mode: str, doc_bytes: int = DEFAULT_DOC_BYTES) -> list[str]:
    """Cut one text into documents.

    Args:
        text: the whole text (e.g. a file).
        doc_mode: ``"paragraphs"`` (blank-line-separated paragraphs, grouped greedily until a group
            has at least ``doc_bytes`` UTF-8 bytes, re-joined with one blank line), ``"wikitext"``
            (one document per top-level `` = Title = `` line, the heading included; text before the
            first heading forms its own document when not blank), or ``"file"`` (the whole text).
        doc_bytes: target document size for ``"paragraphs"``.
    """
    if doc_mode == "file":
        return [text] if text.strip() else []
    if doc_mode == "wikitext":
        starts = [m.start() for m in _WIKITEXT_HEADING.finditer(text)]
        bounds = [0, *starts, len(text)]
        docs = [text[a:b] for a, b in itertools.pairwise(bounds)]
        return [d for d in docs if d.strip()]
    if doc_mode == "paragraphs":
        if doc_bytes < 1:
            raise ValueError(f"doc_bytes must be >= 1, got {doc_bytes}")
        docs, group, size = [], [], 0
        for p in _BLANK_LINES.split(text):
            if not p.strip():
                continue
            size += len(p.encode("utf-8")) + (2 if group else 0)  # the joined document's size
            group.append(p)
            if size >= doc_bytes:
                docs.append("\n\n".join(group))
                group, size = [], 0
        if group:
            docs.append("\n\n".join(group))
        return docs
    raise ValueError(f"unknown doc_mode {doc_mode!r}; valid: {', '.join(DOC_MODES)}")


def _sha256_docs(docs: Sequence[str]) -> str:
    h = hashlib.sha256()
    for d in docs:
        h.update(d.encode("utf-8"))
    return h.hexdigest()


# ---- embedded: the running interpreter's standard library -----------------------------------------
def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@functools.lru_cache(maxsize=8)
def _embedded_files(root: str, max_bytes: int, packages: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    base = Path(root)
    candidates = sorted(p for p in base.glob("*.py") if p.is_file())
    pkg_files = []
    for pkg in packages:
        d = base / pkg
        if d.is_dir():
            pkg_files += [p for p in d.rglob("*.py") if not (_EXCLUDED_DIRS & set(p.relative_to(base).parts[:-1]))]
    candidates += sorted(pkg_files, key=lambda p: p.relative_to(base).as_posix())
    out: list[tuple[str, str]] = []
    total = 0
    for p in candidates:
        try:
            text = p.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        n = len(text.encode("utf-8"))
        if total + n > max_bytes:
            break
        out.append((p.relative_to(base).as_posix(), text))
        total += n
    return tuple(out)


def embedded_corpus(max_bytes: int = DEFAULT_EMBEDDED_MAX_BYTES, packages: Sequence[str] = EMBEDDED_PACKAGES):
    """The embedded corpus: ``[(relative path, text)]`` in corpus order.

    Files: the top-level ``*.py`` modules of ``sysconfig.get_paths()["stdlib"]`` sorted by name, then
    the ``*.py`` files of ``packages`` sorted by relative path (directories ``test``, ``tests``,
    ``idlelib``, ``site-packages``, ``lib2to3``, ``__pycache__`` skipped), decoded as UTF-8 (files
    that do not decode are skipped). Files are taken in that order while the total stays within
    ``max_bytes``; the first file that would cross the budget ends the corpus. One file = one document.

    Args:
        max_bytes: byte budget of the whole corpus (UTF-8 bytes).
        packages: stdlib packages read after the top-level modules.
    """
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    files = _embedded_files(str(_stdlib_root()), int(max_bytes), tuple(packages))
    if not files:
        raise ValueError(
            f"embedded corpus is empty: no readable *.py files under {_stdlib_root()} within {max_bytes} bytes"
        )
    return list(files)


def _embedded_split(spec: dict, split: str) -> list[str]:
    _check_keys(spec, ("max_bytes", "fractions", "packages"))
    fr = _fractions(spec)
    files = embedded_corpus(
        int(spec.get("max_bytes", DEFAULT_EMBEDDED_MAX_BYTES)), spec.get("packages", EMBEDDED_PACKAGES)
    )
    return [text for rel, text in files if split_of(rel, fr) == split]


def _split_sizes(named_docs: Sequence[tuple[str, str]], fractions) -> dict[str, dict[str, int]]:
    """Documents and UTF-8 bytes per split of ``(name, text)`` documents split by name (:func:`split_of`)."""
    per_split = {s: {"n_docs": 0, "bytes": 0} for s in SPLITS}
    for name, text in named_docs:
        s = per_split[split_of(name, fractions)]
        s["n_docs"] += 1
        s["bytes"] += len(text.encode("utf-8"))
    return per_split


def embedded_provenance(spec: dict | None = None) -> dict[str, Any]:
    """What the embedded corpus is, exactly: interpreter, file count, bytes, SHA-256, split sizes.

    The SHA-256 is over the UTF-8 bytes of all documents concatenated in corpus order (no separators).
    """
    spec = dict(spec or {"source": "embedded"})
    fr = _fractions(spec)
    max_bytes = int(spec.get("max_bytes", DEFAULT_EMBEDDED_MAX_BYTES))
    packages = list(spec.get("packages", EMBEDDED_PACKAGES))
    files = embedded_corpus(max_bytes, packages)
    per_split = _split_sizes(files, fr)
    return {
        "source": "embedded",
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "stdlib": str(_stdlib_root()),
        "packages": packages,
        "max_bytes": max_bytes,
        "n_files": len(files),
        "total_bytes": sum(len(t.encode("utf-8")) for _, t in files),
        "sha256": _sha256_docs([t for _, t in files]),
        "first_file": files[0][0],
        "last_file": files[-1][0],
        "fractions": fr,
        "splits": per_split,
        "split_hash": "sha1(relative posix path)[:15 hex] / 16**15, cumulative over train, calib, heldout",
    }


# ---- pydoc_topics: the Python documentation's help topics ------------------------------------------
def pydoc_topics_corpus(max_bytes: int | None = None) -> list[tuple[str, str]]:
    """The pydoc-topics corpus: ``[(topic name, text)]`` sorted by topic name.

    The texts are ``pydoc_data.topics.topics`` (the reference-manual sections behind ``help("assert")``,
    ``help("lists")``, ...), which CPython ships with its standard library. Topics are taken in sorted
    order while the total UTF-8 bytes stay within ``max_bytes``; the first topic that would cross the
    budget ends the corpus. Empty texts are skipped.

    Args:
        max_bytes: byte budget of the whole corpus (UTF-8 bytes); None reads every topic.
    """
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    try:
        from pydoc_data.topics import topics
    except ImportError as e:  # some distributions package pydoc_data separately
        raise ValueError(
            f"corpus source 'pydoc_topics' needs the standard library's pydoc_data package, which this "
            f"interpreter lacks ({e}); use source 'embedded' instead"
        ) from None
    docs = [(name, topics[name]) for name in sorted(topics) if topics[name].strip()]
    out, total = [], 0
    for name, text in docs:
        n = len(text.encode("utf-8"))
        if max_bytes is not None and total + n > max_bytes:
            break
        out.append((name, text))
        total += n
    if not out:
        smallest = min((len(t.encode("utf-8")) for _, t in docs), default=0)
        raise ValueError(f"pydoc_topics corpus is empty within max_bytes={max_bytes} (smallest topic: {smallest} B)")
    return out


_PYDOC_KEYS = ("fractions", "max_bytes")


def _pydoc_topics_split(spec: dict, split: str) -> list[str]:
    _check_keys(spec, _PYDOC_KEYS)
    fr = _fractions(spec)
    return [text for name, text in pydoc_topics_corpus(spec.get("max_bytes")) if split_of(name, fr) == split]


def pydoc_topics_provenance(spec: dict | None = None) -> dict[str, Any]:
    """What the pydoc-topics corpus is, exactly: interpreter, topic count, bytes, SHA-256, split sizes.

    The SHA-256 is over the UTF-8 bytes of all documents concatenated in corpus order (no separators).
    """
    spec = dict(spec or {"source": "pydoc_topics"})
    _check_keys(spec, _PYDOC_KEYS)
    fr = _fractions(spec)
    max_bytes = spec.get("max_bytes")
    docs = pydoc_topics_corpus(max_bytes)
    per_split = _split_sizes(docs, fr)
    return {
        "source": "pydoc_topics",
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "module": "pydoc_data.topics.topics",
        "max_bytes": max_bytes,
        "n_docs": len(docs),
        "total_bytes": sum(len(t.encode("utf-8")) for _, t in docs),
        "sha256": _sha256_docs([t for _, t in docs]),
        "first_topic": docs[0][0],
        "last_topic": docs[-1][0],
        "fractions": fr,
        "splits": per_split,
        "split_hash": "sha1(topic name)[:15 hex] / 16**15, cumulative over train, calib, heldout",
    }


# ---- files: local text files ----------------------------------------------------------------------
_FILES_KEYS = ("paths", "splits", "doc_mode", "doc_bytes", "fractions", "max_docs", "max_bytes", "encoding")


def _read_text(path: str | Path, encoding: str) -> str:
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"corpus file {str(p)!r} does not exist (cwd {Path.cwd()})")
    return p.read_text(encoding=encoding)


def _files_docs(paths: Sequence[str], spec: dict) -> list[tuple[str, str]]:
    """[(stable key, document)] for all files in order; key = '<file name>:<document index>'."""
    mode = spec.get("doc_mode", "paragraphs")
    if mode not in DOC_MODES:
        raise ValueError(f"unknown doc_mode {mode!r}; valid: {', '.join(DOC_MODES)}")
    out = []
    for path in paths:
        docs = split_documents(
            _read_text(path, spec.get("encoding", "utf-8")), mode, int(spec.get("doc_bytes", DEFAULT_DOC_BYTES))
        )
        out += [(f"{Path(path).name}:{i}", d) for i, d in enumerate(docs)]
    return out


def _files_split(spec: dict, split: str) -> list[str]:
    _check_keys(spec, _FILES_KEYS)
    if ("paths" in spec) == ("splits" in spec):
        raise ValueError(
            "corpus source 'files' needs exactly one of 'paths' (split by fractions) or 'splits' (files per split)"
        )
    if "splits" in spec:
        explicit = spec["splits"]
        bad = sorted(set(explicit) - set(SPLITS))
        if bad:
            raise ValueError(f"unknown split(s) {bad} in 'splits'; valid: {', '.join(SPLITS)}")
        if split not in explicit:
            raise ValueError(f"split {split!r} not listed in corpus 'splits' (listed: {', '.join(explicit)})")
        docs = [d for _, d in _files_docs(_as_list(explicit[split]), spec)]
    else:
        fr = _fractions(spec)
        docs = [d for key, d in _files_docs(_as_list(spec["paths"]), spec) if split_of(key, fr) == split]
    return _cap(docs, spec.get("max_docs"), spec.get("max_bytes"))


def _as_list(x: str | Sequence[str]) -> list[str]:
    return [x] if isinstance(x, (str, Path)) else list(x)


def _file_record(path: str) -> dict[str, Any]:
    data = Path(path).expanduser().read_bytes()
    return {"path": str(path), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


# ---- hf: Hugging Face datasets ----------------------------------------------------------------------
_HF_KEYS = (
    "path",
    "name",
    "data_files",
    "revision",
    "cache_dir",
    "streaming",
    "text_field",
    "splits",
    "doc_mode",
    "doc_bytes",
    "max_docs",
    "max_bytes",
)


def _hf_split(spec: dict, split: str) -> list[str]:
    _check_keys(spec, _HF_KEYS)
    if "path" not in spec:
        raise ValueError(
            "corpus source 'hf' needs 'path' (a dataset id, or a builder such as 'text'/'json' with data_files)"
        )
    mode = spec.get("doc_mode", "rows")
    if mode not in HF_DOC_MODES:
        raise ValueError(f"unknown doc_mode {mode!r} for source 'hf'; valid: {', '.join(HF_DOC_MODES)}")
    mapping = dict(spec.get("splits") or DEFAULT_HF_SPLITS)
    if split not in mapping:
        raise ValueError(f"split {split!r} not mapped in corpus 'splits' (mapped: {', '.join(mapping)})")
    import datasets  # lazy: heavy import, only this source needs it

    streaming = bool(spec.get("streaming", False))
    hf_split, row_range = streaming_slice(mapping[split]) if streaming else (mapping[split], None)
    field = spec.get("text_field", "text")
    shards = parquet_shards(spec, hf_split) if streaming else None
    if shards is not None:
        rows = shards.rows(field, *(row_range or (0, None)))
    else:
        ds = datasets.load_dataset(
            spec["path"],
            spec.get("name"),
            data_files=spec.get("data_files"),
            split=hf_split,
            revision=spec.get("revision"),
            cache_dir=spec.get("cache_dir"),
            streaming=streaming,
        )
        if row_range is not None:
            start, stop = row_range
            ds = ds.skip(start) if start else ds
            ds = ds.take(stop - start) if stop is not None else ds
        rows = _hf_rows(ds, field)
    max_docs, max_bytes = spec.get("max_docs"), spec.get("max_bytes")
    if mode == "rows":
        return _cap((r for r in rows if r.strip()), max_docs, max_bytes)
    # join rows into one text (a newline added to rows without one), read only up to the byte budget
    parts, total = [], 0
    for r in rows:
        r = r if r.endswith("\n") else r + "\n"
        n = len(r.encode("utf-8"))
        if max_bytes is not None and total + n > max_bytes:
            break
        parts.append(r)
        total += n
    docs = split_documents(
        "".join(parts),
        "paragraphs" if mode == "paragraphs" else "wikitext",
        int(spec.get("doc_bytes", DEFAULT_DOC_BYTES)),
    )
    return _cap(docs, max_docs, None)


_ROW_SLICE = re.compile(r"^(?P<split>[^\[\]]+)\[(?P<start>\d*):(?P<stop>\d*)\]$")


def streaming_slice(split: str) -> tuple[str, tuple[int, int | None] | None]:
    """``"train[1000:2000]"`` -> ("train", (1000, 2000)) for streaming datasets, which take no HF slicing;
    row ranges are applied with ``skip``/``take``. Percent slices cannot stream (the length is unknown)."""
    if "[" not in split:
        return split, None
    m = _ROW_SLICE.match(split.strip())
    if m is None:
        raise ValueError(f"split {split!r} cannot be streamed; with streaming use row ranges such as 'train[0:5000]'")
    start = int(m["start"] or 0)
    stop = int(m["stop"]) if m["stop"] else None
    if stop is not None and stop <= start:
        raise ValueError(f"empty row range in split {split!r}")
    return m["split"], (start, stop)


def _hf_rows(ds, field: str):
    for row in ds:
        if field not in row:
            raise ValueError(f"text_field {field!r} not in dataset columns {sorted(row)}")
        yield row[field] or ""


# ---- hf streaming over parquet shards: a row range read from the shard files that hold it -----------------------
PARQUET_INDEX_DIR = ("statereduce", "parquet_splits")
"""Where the shard index of a streamed parquet split is kept, under ``HF_HOME`` (:func:`parquet_shards`)."""

_HF_URL = re.compile(r"^hf://datasets/(?P<repo>[^@]+)@(?P<revision>[^/]+)/(?P<path>.+)$")


def hf_offline() -> bool:
    """Whether the Hugging Face libraries run offline (``HF_HUB_OFFLINE``, or ``HF_DATASETS_OFFLINE`` for datasets)."""
    import datasets
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE or datasets.config.HF_HUB_OFFLINE)


def _fetch_hint(what: str) -> str:
    from huggingface_hub import constants

    return (f"{what} is not in the Hugging Face cache (HF_HOME={constants.HF_HOME}) and the libraries run offline; "
            "fetch it on a machine with network: python -m statereduce.fetch <target> (docs/offline.md)")


@dataclass(frozen=True)
class ParquetShard:
    """One parquet data file of a split: ``url`` as ``datasets`` resolved it (``hf://datasets/<repo>@<commit>/<path>``
    or a local path), its rows and bytes."""

    url: str
    num_rows: int
    bytes: int

    @property
    def hub_file(self) -> tuple[str, str, str] | None:
        """``(repo_id, revision, path in repo)`` of a hub file, None for a local one."""
        m = _HF_URL.match(self.url)
        return None if m is None else (m["repo"], unquote(m["revision"]), m["path"])

    def local_path(self) -> str:
        """The file on this machine: a hub file from the Hugging Face cache, downloaded there first when online."""
        if self.hub_file is None:
            return self.url
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        repo, revision, path = self.hub_file
        try:
            return hf_hub_download(repo, path, repo_type="dataset", revision=revision)
        except LocalEntryNotFoundError:
            raise ValueError(_fetch_hint(f"dataset file {path} of {repo}@{revision}")) from None


@dataclass(frozen=True)
class ParquetShards:
    """The parquet files of one split of a ``datasets`` dataset, in the order ``datasets`` reads them (streaming
    yields their rows file by file, row group by row group)."""

    shards: tuple[ParquetShard, ...]

    def covering(self, start: int, stop: int | None) -> list[tuple[ParquetShard, int, int]]:
        """``(shard, first row, end row)`` within each shard that holds rows ``[start, stop)`` of the split."""
        out, offset = [], 0
        for shard in self.shards:
            lo = max(start - offset, 0)
            hi = shard.num_rows if stop is None else min(stop - offset, shard.num_rows)
            if hi > lo:
                out.append((shard, lo, hi))
            offset += shard.num_rows
            if stop is not None and offset >= stop:
                break
        return out

    def rows(self, field: str, start: int = 0, stop: int | None = None):
        """The ``field`` values of rows ``[start, stop)`` (fewer where the split ends first), reading only the row
        groups that hold them; a hub shard is downloaded when the reading reaches it."""
        import pyarrow.parquet as pq

        for shard, lo, hi in self.covering(start, stop):
            pf = pq.ParquetFile(shard.local_path())
            names = pf.schema_arrow.names
            if field not in names:
                raise ValueError(f"text_field {field!r} not in dataset columns {sorted(names)}")
            offset = 0
            for group in range(pf.num_row_groups):
                n = pf.metadata.row_group(group).num_rows
                a, b = max(lo - offset, 0), min(hi - offset, n)
                offset += n
                if b > a:
                    column = pf.read_row_group(group, columns=[field]).column(0)
                    yield from (v or "" for v in column.slice(a, b - a).to_pylist())
                if offset >= hi:
                    break


def parquet_shards(spec: dict, hf_split: str) -> ParquetShards | None:
    """The parquet files of HF split ``hf_split`` of an ``hf`` corpus, or None when its data files are not parquet.

    Online, ``datasets.load_dataset_builder`` resolves the data files (the hub's commit included) and each file's row
    count is read from its parquet footer (a few ranged reads, nothing downloaded); the result is kept as a small index
    under ``HF_HOME/statereduce/parquet_splits/``. Offline (``HF_HUB_OFFLINE``/``HF_DATASETS_OFFLINE``) the index is
    read instead, so that a streamed row range needs only the shard files that hold it in the hub cache
    (:mod:`statereduce.fetch` puts them there).
    """
    import datasets
    from huggingface_hub import constants

    key = {k: spec.get(k) for k in ("path", "name", "data_files", "revision")} | {"split": hf_split}
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    index = Path(constants.HF_HOME, *PARQUET_INDEX_DIR, f"{digest}.json")
    known = json.loads(index.read_text()) if index.is_file() else None
    if known is not None and hf_offline():
        return ParquetShards(tuple(ParquetShard(**s) for s in known["shards"]))
    try:
        builder = datasets.load_dataset_builder(spec["path"], spec.get("name"), data_files=spec.get("data_files"),
                                                revision=spec.get("revision"), cache_dir=spec.get("cache_dir"))
    except (ConnectionError, OSError) as e:
        if hf_offline():
            raise ValueError(_fetch_hint(f"the index of split {hf_split!r} of dataset {spec['path']!r}") +
                             f" ({type(e).__name__})") from None
        raise
    if builder.name != "parquet":
        return None
    files = (builder.config.data_files or {}).get(hf_split)
    if files is None:
        raise ValueError(f"dataset {spec['path']!r} has no split {hf_split!r}; its splits: "
                         f"{', '.join(builder.config.data_files or {}) or '(none)'}")
    counted = {s["url"]: ParquetShard(**s) for s in (known or {}).get("shards", [])}
    shards = tuple(counted.get(str(url)) or _parquet_shard(str(url)) for url in files)
    if any(s.hub_file for s in shards) and [s.url for s in shards] != list(counted):
        index.parent.mkdir(parents=True, exist_ok=True)
        tmp = index.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "shards": [vars(s) for s in shards]}, indent=1))
        tmp.replace(index)
    return ParquetShards(shards)


def _parquet_shard(url: str) -> ParquetShard:
    """A parquet file's row count and size from its footer (a hub file through ``HfFileSystem``: ranged reads)."""
    import pyarrow.parquet as pq

    if _HF_URL.match(url):
        from huggingface_hub import HfFileSystem

        with HfFileSystem().open(url, "rb") as f:
            return ParquetShard(url, pq.ParquetFile(f).metadata.num_rows, int(f.size))
    return ParquetShard(url, pq.ParquetFile(url).metadata.num_rows, Path(url).stat().st_size)


# ---- public entry points --------------------------------------------------------------------------
_LOADERS = {"embedded": _embedded_split, "pydoc_topics": _pydoc_topics_split, "files": _files_split, "hf": _hf_split}


def load_split(spec: dict, split: str) -> list[str]:
    """Documents of one split of a corpus.

    Args:
        spec: corpus spec; ``spec["source"]`` is one of ``embedded``, ``pydoc_topics``, ``files``, ``hf``
            and the other keys are those of that source (module docstring).
        split: ``"train"``, ``"calib"`` or ``"heldout"``.

    Returns:
        The split's documents, in a deterministic order.
    """
    _check_split(split)
    source = spec.get("source")
    if source not in _LOADERS:
        raise ValueError(f"unknown corpus source {source!r}; valid: {', '.join(SOURCES)}")
    return _LOADERS[source](spec, split)


def corpus_provenance(spec: dict) -> dict[str, Any]:
    """A JSON-serialisable record of what a corpus spec reads (for artifact metadata and the README).

    ``embedded``: :func:`embedded_provenance`. ``pydoc_topics``: :func:`pydoc_topics_provenance`. ``files``: the
    spec plus size and SHA-256 of every file.
    ``hf``: the spec (dataset id, config name, revision, split mapping) and the ``datasets`` version.
    """
    source = spec.get("source")
    if source == "embedded":
        return embedded_provenance(spec)
    if source == "pydoc_topics":
        return pydoc_topics_provenance(spec)
    if source == "files":
        _check_keys(spec, _FILES_KEYS)
        paths = (
            _as_list(spec["paths"]) if "paths" in spec else [p for v in spec["splits"].values() for p in _as_list(v)]
        )
        return {**spec, "files": [_file_record(p) for p in dict.fromkeys(paths)]}
    if source == "hf":
        _check_keys(spec, _HF_KEYS)
        import datasets

        return {
            **spec,
            "splits": dict(spec.get("splits") or DEFAULT_HF_SPLITS),
            "datasets_version": datasets.__version__,
        }
    raise ValueError(f"unknown corpus source {source!r}; valid: {', '.join(SOURCES)}")


def token_stream(tokenizer, docs: Sequence[str]) -> torch.Tensor:
    """All documents tokenized once (no special tokens added) and joined with EOS between them.

    Args:
        tokenizer: a Hugging Face tokenizer with ``eos_token_id`` (the byte tokenizer or a hub one).
        docs: documents in order.

    Returns:
        A 1-D LongTensor.
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has no eos_token_id; documents cannot be separated")
    docs = [d for d in docs if d]
    if not docs:
        return torch.empty(0, dtype=torch.long)
    flat: list[int] = []
    for x in tokenizer(list(docs), add_special_tokens=False)["input_ids"]:
        flat.extend(x)
        flat.append(eos)
    flat.pop()  # EOS between documents, none after the last
    out = torch.tensor(flat, dtype=torch.long)
    return out


def token_blocks(tokenizer, docs: Sequence[str], n_samples: int, seq_len: int, seed: int) -> torch.Tensor:
    """``n_samples`` token blocks of length ``seq_len``, chosen deterministically from ``seed``.

    The documents are joined with EOS (:func:`token_stream`) and cut into non-overlapping blocks of
    ``seq_len`` tokens (the tail shorter than ``seq_len`` is dropped); ``n_samples`` distinct blocks
    are drawn by ``torch.randperm`` under a generator seeded with ``seed``, in that random order.
    This is how calibration samples are drawn (paper App. B.2: N sequences of length L).

    Args:
        tokenizer: Hugging Face tokenizer.
        docs: the split's documents (:func:`load_split`).
        n_samples: number of blocks.
        seq_len: tokens per block.
        seed: selection seed.

    Returns:
        LongTensor ``[n_samples, seq_len]``.
    """
    if n_samples < 1 or seq_len < 1:
        raise ValueError(f"n_samples and seq_len must be >= 1, got n_samples={n_samples}, seq_len={seq_len}")
    stream = token_stream(tokenizer, docs)
    n_blocks = stream.numel() // seq_len
    if n_blocks < n_samples:
        raise ValueError(
            f"split too small: {stream.numel()} tokens give {n_blocks} blocks of seq_len={seq_len}, "
            f"but n_samples={n_samples} were asked"
        )
    g = torch.Generator().manual_seed(int(seed))
    pick = torch.randperm(n_blocks, generator=g)[:n_samples]
    return stream[: n_blocks * seq_len].view(n_blocks, seq_len)[pick].contiguous()


__all__ = [
    "SOURCES",
    "SPLITS",
    "corpus_provenance",
    "embedded_corpus",
    "embedded_provenance",
    "load_split",
    "pydoc_topics_corpus",
    "pydoc_topics_provenance",
    "split_documents",
    "split_of",
    "token_blocks",
    "token_stream",
]
