"""An offline recall probe: synthetic multi-query associative recall (MQAR) scored through lm-eval.

The paper's recall finding (Sec. 4, recall suite) is that pure recurrent models lose in-context
recall first when their state shrinks. This module generates a probe that needs no download, in
the spirit of MQAR (Arora et al., 2023, "Zoology") and needle-in-a-haystack: a context of
``n_pairs`` Python-like assignment lines ``kx = 47`` (distinct two-letter keys, distinct two-digit
values), optionally ``n_queries - 1`` answered query lines (teacher-forced, as MQAR scores every
query), then the scored query ``ab =``. The answer is the value assigned to ``ab`` earlier::

    kx = 47
    ab = 12
    qz = 85
    mu = 33
    ab =                 choices: ["85", "12", "33", "47"], gold 1 (continuation " 12")

The text suits byte-level and BPE tokenizers alike (the query repeats the key line's bytes up to
the value) and the tiny models' domain (Python source). Scoring is lm-eval's ``multiple_choice``:
the log-likelihood of ``" " + choice`` after the prompt for ``n_choices`` distinct candidates, all
of them values present in the context exactly once, so that value frequency gives no hint (chance
is ``1 / n_choices``); metric ``acc``. ``acc_norm`` is not reported: every candidate has the same
number of characters, so it would always equal ``acc``.

Each difficulty level (context size ``n_pairs``; needle depth; ``n_choices``; ``n_queries``) is a
separate local-file task, ``recall_mqar_{n_pairs}`` by default, tagged ``recall_mqar``.
:func:`write_recall_tasks` writes JSONL + YAML into a task folder exactly as
:func:`statereduce.evaluate.write_perplexity_task` does, so the same folder can hold both and be
passed once as ``include_path``; :func:`evaluate_recall` runs them through
:func:`statereduce.evaluate.evaluate_model`.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import keyword
import random
import string
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from statereduce.evaluate import TASK_NAME_RE, evaluate_model, write_multiple_choice_task
from statereduce.suites import RECALL_PROBE_DEFAULTS, recall_probe_settings

TASK_PREFIX = "recall_mqar"
"""Prefix of the task names and the lm-eval tag that selects every written level."""

DEFAULT_LEVELS = tuple(RECALL_PROBE_DEFAULTS["levels"])
"""Default context sizes (``n_pairs``), one task each (the ``recall_probe`` suite's defaults)."""

DEFAULT_N_DOCS = RECALL_PROBE_DEFAULTS["n_docs"]
KEY_LEN = 2
VALUES = tuple(str(v) for v in range(10, 100))
"""Two-digit values; a context uses each at most once, so ``n_pairs <= 90``."""

KEYS = tuple(
    k
    for k in ("".join(p) for p in itertools.product(string.ascii_lowercase, repeat=KEY_LEN))
    if not keyword.iskeyword(k)
)
"""Candidate keys: two lowercase letters, Python keywords (``as``, ``if``, ``in``, ``is``, ``or``) left out."""


@dataclass(frozen=True)
class RecallLevel:
    """One difficulty level of the probe, i.e. one lm-eval task.

    Args:
        n_pairs: key-value lines in the context (the haystack), 1..90.
        n_choices: candidate values per query, 2..n_pairs; chance accuracy is ``1 / n_choices``.
        depth: needle depth, the scored key's line as a fraction of the context: 0.0 the first line
            (farthest from the query), 1.0 the last line; ``None`` draws it uniformly per document.
        n_queries: query lines per document; the first ``n_queries - 1`` come with their answers
            (teacher forcing; keys other than the scored one and the distractors') and only the last
            is scored; at most ``n_pairs - n_choices + 1``.
        name: task name; ``None`` gives ``recall_mqar_{n_pairs}`` plus ``_d{depth%}``, ``_c{n_choices}``,
            ``_q{n_queries}`` for non-default settings.
    """

    n_pairs: int
    n_choices: int = 4
    depth: float | None = None
    n_queries: int = 1
    name: str | None = None

    def __post_init__(self):
        for field in ("n_pairs", "n_choices", "n_queries"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{field} must be an int, got {value!r}")
        if not 1 <= self.n_pairs <= len(VALUES):
            raise ValueError(f"n_pairs must be in 1..{len(VALUES)} (distinct two-digit values), got {self.n_pairs}")
        if not 2 <= self.n_choices <= self.n_pairs:
            raise ValueError(f"n_choices must be in 2..n_pairs={self.n_pairs}, got {self.n_choices}")
        if not 1 <= self.n_queries <= self.n_pairs - self.n_choices + 1:
            raise ValueError(
                f"n_queries must be in 1..n_pairs - n_choices + 1 = {self.n_pairs - self.n_choices + 1} "
                f"(answered queries never reuse a candidate's key), got {self.n_queries}"
            )
        if self.depth is not None and not (isinstance(self.depth, (int, float)) and 0.0 <= self.depth <= 1.0):
            raise ValueError(f"depth must be a number in [0, 1] or None, got {self.depth!r}")
        if self.name is not None and not (isinstance(self.name, str) and TASK_NAME_RE.match(self.name)):
            raise ValueError(f"invalid task name {self.name!r}; use letters, digits, '_', '.', '-'")

    @property
    def task_name(self) -> str:
        """The lm-eval task name of this level."""
        if self.name is not None:
            return self.name
        name = f"{TASK_PREFIX}_{self.n_pairs}"
        if self.depth is not None:
            name += f"_d{round(100 * self.depth)}"
        if self.n_choices != 4:
            name += f"_c{self.n_choices}"
        if self.n_queries != 1:
            name += f"_q{self.n_queries}"
        return name

    @classmethod
    def parse(cls, spec: int | Mapping[str, Any] | RecallLevel) -> RecallLevel:
        """A level from an int (``n_pairs``), a mapping of the fields (e.g. from config YAML) or a level."""
        if isinstance(spec, RecallLevel):
            return spec
        if isinstance(spec, int) and not isinstance(spec, bool):
            return cls(n_pairs=spec)
        if isinstance(spec, Mapping):
            fields = [f.name for f in dataclasses.fields(cls)]
            unknown = sorted(set(spec) - set(fields))
            if unknown:
                raise ValueError(f"unknown recall level keys {unknown}; valid: {', '.join(fields)}")
            return cls(**spec)
        raise ValueError(f"a recall level is an int (n_pairs), a mapping or a RecallLevel, got {spec!r}")


def generate_recall_docs(
    n_docs: int,
    n_pairs: int,
    n_choices: int = 4,
    depth: float | None = None,
    n_queries: int = 1,
    seed: int = 0,
) -> list[dict]:
    """Deterministic MQAR documents (see the module docstring for the format).

    The random stream depends on ``seed`` and on every level parameter, so levels written with one
    seed are independent of each other and adding a level changes no other. Python's
    ``random.Random`` seeded with a string is stable across runs and platforms.

    Args:
        n_docs: documents to generate (>= 1).
        n_pairs, n_choices, depth, n_queries: the level, see :class:`RecallLevel`.
        seed: integer seed.

    Returns:
        One dict per document: ``prompt`` (context + answered queries + ``"{key} ="``), ``choices``
        (candidate values, without the leading space), ``gold`` (index of the answer in
        ``choices``), ``key``, ``answer``, ``position`` (0-based context line of the needle),
        ``distance`` (lines from the needle to the scored query; 1 = the line just before it),
        ``n_pairs``.
    """
    level = RecallLevel(n_pairs=n_pairs, n_choices=n_choices, depth=depth, n_queries=n_queries)
    if isinstance(n_docs, bool) or not isinstance(n_docs, int) or n_docs < 1:
        raise ValueError(f"n_docs must be an int >= 1, got {n_docs!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    rng = random.Random(f"statereduce.recall:{seed}:{n_pairs}:{n_choices}:{depth!r}:{n_queries}")
    return [_one_doc(rng, level) for _ in range(n_docs)]


def _one_doc(rng: random.Random, level: RecallLevel) -> dict:
    n = level.n_pairs
    keys = rng.sample(KEYS, n)
    values = rng.sample(VALUES, n)
    if level.depth is None:
        position = rng.randrange(n)
    else:
        position = round(level.depth * (n - 1))
    others = [i for i in range(n) if i != position]
    answered = rng.sample(others, level.n_queries - 1)
    # candidates avoid the answered keys, so every candidate value occurs exactly once in the prompt
    distractors = rng.sample([i for i in others if i not in answered], level.n_choices - 1)
    choice_idx = distractors + [position]
    rng.shuffle(choice_idx)
    lines = [f"{keys[i]} = {values[i]}" for i in range(n)] + [f"{keys[i]} = {values[i]}" for i in answered]
    prompt = "\n".join(lines + [f"{keys[position]} ="])
    return {
        "prompt": prompt,
        "choices": [values[i] for i in choice_idx],
        "gold": choice_idx.index(position),
        "key": keys[position],
        "answer": values[position],
        "position": position,
        "distance": len(lines) - position,
        "n_pairs": n,
    }


def write_recall_tasks(
    task_dir: str | Path,
    levels: Iterable[int | Mapping[str, Any] | RecallLevel] = DEFAULT_LEVELS,
    n_docs: int = DEFAULT_N_DOCS,
    seed: int = 0,
) -> list[str]:
    """Write one local lm-eval ``multiple_choice`` task per level (``{name}.jsonl`` + ``{name}.yaml``).

    Args:
        task_dir: folder for the files (created); pass it as ``include_path`` (it may also hold the
            held-out perplexity task of :func:`statereduce.evaluate.write_perplexity_task`). Each task is
            a :func:`statereduce.evaluate.write_multiple_choice_task` with ``doc_to_text: prompt``,
            metric ``acc`` only (every candidate has two characters, so ``acc_norm`` would equal it)
            and the level's parameters, ``seed`` and ``chance`` in its ``metadata``.
        levels: ints (``n_pairs``), mappings of :class:`RecallLevel` fields, or levels.
        n_docs: documents per level.
        seed: integer seed (each level draws its own stream from it).

    Returns:
        The task names, in the order of ``levels``; every task also carries the tag ``recall_mqar``.
    """
    levels = [RecallLevel.parse(s) for s in levels]
    if not levels:
        raise ValueError("levels is empty; give at least one level, e.g. [4, 16, 64]")
    names = [lv.task_name for lv in levels]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"recall levels give duplicate task names {dupes}; set distinct 'name's")
    for lv, name in zip(levels, names):
        docs = generate_recall_docs(n_docs, lv.n_pairs, lv.n_choices, lv.depth, lv.n_queries, seed)
        metadata = {
            "n_pairs": lv.n_pairs,
            "n_choices": lv.n_choices,
            "depth": lv.depth,
            "n_queries": lv.n_queries,
            "seed": seed,
            "chance": 1.0 / lv.n_choices,
        }
        write_multiple_choice_task(
            docs, task_dir, name, metrics=("acc",), text_field="prompt", tag=TASK_PREFIX, metadata=metadata
        )
    return names


def recall_probe_writer(
    settings: Mapping[str, Any] | None = None, tokenizer=None, max_length: int | None = None
) -> Callable[[str | Path], list[str]]:
    """A local-task writer for :func:`statereduce.evaluate.evaluate_and_write` (the ``recall_probe`` suite).

    Args:
        settings: ``eval.recall_probe`` (``levels``, ``n_docs``, ``seed``; defaults filled).
        tokenizer, max_length: when both are given, the written documents are checked to fit the
            window (see :func:`check_recall_fits`).

    Returns:
        ``writer(task_dir) -> task names``.
    """
    probe = recall_probe_settings(settings)

    def writer(task_dir: str | Path) -> list[str]:
        names = write_recall_tasks(task_dir, probe["levels"], probe["n_docs"], probe["seed"])
        check_recall_fits(tokenizer, task_dir, names, max_length)
        return names

    return writer


def evaluate_recall(
    model: nn.Module,
    tokenizer,
    task_dir: str | Path,
    levels: Sequence[int | Mapping[str, Any] | RecallLevel] = DEFAULT_LEVELS,
    n_docs: int = DEFAULT_N_DOCS,
    seed: int = 0,
    *,
    batch_size: int | str = 1,
    max_length: int | None = None,
    device: str | None = None,
    limit: float | None = None,
) -> dict[str, dict[str, float]]:
    """Write the recall tasks into ``task_dir`` and evaluate ``model`` on them through lm-eval.

    Same path as every other metric: :func:`statereduce.evaluate.evaluate_model` (``HFLM`` on the
    in-memory model, ``TaskManager`` with ``include_path=task_dir``).

    Args:
        model: loaded causal LM (fla on CPU: ``fla_fallback.install()`` first).
        tokenizer: its tokenizer.
        task_dir: folder for the task files.
        levels, n_docs, seed: see :func:`write_recall_tasks`.
        batch_size, max_length, device, limit: see :func:`statereduce.evaluate.evaluate_model`. A
            ``max_length`` shorter than a document (prompt + answer) is an error: lm-eval would cut
            the context from the left, needle included.

    Returns:
        ``{task: {"acc": ..., "acc_stderr": ...}}`` for every level.
    """
    names = write_recall_tasks(task_dir, levels, n_docs, seed)
    check_recall_fits(tokenizer, task_dir, names, max_length)
    result = evaluate_model(
        model,
        tokenizer,
        names,
        include_path=task_dir,
        batch_size=batch_size,
        max_length=max_length,
        device=device,
        limit=limit,
    )
    return {name: result["metrics"][name] for name in names}


def check_recall_fits(tokenizer, task_dir: str | Path, names: Sequence[str], max_length: int | None) -> None:
    """``ValueError`` if a written recall document (prompt + answer) is longer than ``max_length`` tokens.

    lm-eval would cut such a context from the left, needle included. Nothing is checked when
    ``max_length`` is ``None`` or ``tokenizer`` has no ``encode``.
    """
    if max_length is None or not hasattr(tokenizer, "encode"):
        return
    longest = _longest_doc_tokens(tokenizer, Path(task_dir), names)
    if longest > max_length:
        raise ValueError(f"max_length {max_length} is shorter than the longest recall document ({longest} tokens)")


def _longest_doc_tokens(tokenizer, task_dir: Path, names: Sequence[str]) -> int:
    longest = 0
    for name in names:
        for line in (task_dir.resolve() / f"{name}.jsonl").read_text(encoding="utf-8").splitlines():
            doc = json.loads(line)
            text = doc["prompt"] + " " + max(doc["choices"], key=len)
            longest = max(longest, len(tokenizer.encode(text)))
    return longest
