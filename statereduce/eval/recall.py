"""An offline recall probe: synthetic multi-query associative recall (MQAR) scored through lm-eval.

The paper's recall finding (Sec. 5, Table 4; App. C.4) is that pure recurrent models lose in-context
recall first when their state shrinks. This module generates a probe that needs no download, in
the spirit of MQAR (Arora et al., 2023, "Zoology") and needle-in-a-haystack: a context of
``n_pairs`` compact assignment lines ``kx=47`` (distinct two-letter keys, distinct two-digit
values), optionally ``n_queries - 1`` answered query lines (teacher-forced, as MQAR scores every
query), then the scored query ``ab=``. The answer is the value assigned to ``ab`` earlier::

    kx=47
    ab=12
    qz=85
    mu=33
    ab=                  choices: ["85", "12", "33", "47"], gold 1 (continuation "12")

The query repeats the key line's bytes up to the value, so the value's bytes follow ``=`` directly,
exactly as in the context (the task's ``target_delimiter`` is empty). This compact format is one the
embedded tiny models can learn (the spaced format ``kx = 47`` stayed at chance for them; the runs are in
git history at commit a3498a9, docs/experiments/recall_format/); it suits byte-level and BPE tokenizers
alike. Scoring is lm-eval's ``multiple_choice``:
the log-likelihood of the choice after the prompt for ``n_choices`` distinct candidates, all of them
values present in the context exactly once, so that value frequency gives no hint (chance is
``1 / n_choices``); metric ``acc``. ``acc_norm`` is not reported: every candidate has the same
number of characters, so it would always equal ``acc``.

Each difficulty level (context size ``n_pairs``; needle depth; ``n_choices``; ``n_queries``) is a
separate local-file task, ``recall_mqar_{n_pairs}`` by default, tagged ``recall_mqar``.
:func:`write_recall_tasks` writes JSONL + YAML into a task folder exactly as
:func:`statereduce.eval.tasks.write_perplexity_task` does, so the same folder can hold both and be
passed once as ``include_path``; :func:`evaluate_recall` runs them through
:func:`statereduce.eval.harness.evaluate_model`.

Training documents: a tiny model trained only on source code has never seen the lookup this probe
asks for. :func:`recall_train_docs` generates documents of the same format (context lines, then
every key queried once more with its answer, in shuffled order), and :func:`mix_recall_docs` inserts
them among a corpus's training documents (``models.<m>.pretrain.recall_mix``,
:func:`statereduce.stages.pretrain.pretrain`); the held-out split is never mixed. Training and probe
documents come from separate random streams.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import keyword
import random
import string
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from statereduce.eval.tasks import TASK_NAME_RE, write_multiple_choice_task
from statereduce.common.settings import RECALL_MAX_PAIRS, RecallMixSettings, RecallProbeSettings

if TYPE_CHECKING:
    import torch
    from torch import nn

TASK_PREFIX = "recall_mqar"
"""Prefix of the task names and the lm-eval tag that selects every written level."""

DEFAULT_LEVELS = tuple(RecallProbeSettings().levels)
"""Default context sizes (``n_pairs``), one task each (the ``recall_probe`` suite's defaults)."""

DEFAULT_N_DOCS = RecallProbeSettings.n_docs
KEY_LEN = 2
ASSIGN = "="
"""Between a key and its value, in context lines and queries (no spaces: the compact format)."""
VALUES = tuple(str(v) for v in range(10, 10 + RECALL_MAX_PAIRS))
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
        One dict per document: ``prompt`` (context + answered queries + ``"{key}="``), ``choices``
        (candidate values; scored right after the ``=``), ``gold`` (index of the answer in
        ``choices``), ``key``, ``answer``, ``position`` (0-based context line of the needle),
        ``distance`` (lines from the needle to the scored query; 1 = the line just before it),
        ``n_pairs``.
    """
    level = RecallLevel(n_pairs=n_pairs, n_choices=n_choices, depth=depth, n_queries=n_queries)
    if isinstance(n_docs, bool) or not isinstance(n_docs, int) or n_docs < 1:
        raise ValueError(f"n_docs must be an int >= 1, got {n_docs!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    # the seed's name is fixed (it is not this module's path): renaming it would change every probe document
    rng = random.Random(f"statereduce.recall:{seed}:{n_pairs}:{n_choices}:{depth!r}:{n_queries}")
    return [_one_doc(rng, level) for _ in range(n_docs)]


def _line(key: str, value: str) -> str:
    return f"{key}{ASSIGN}{value}"


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
    lines = [_line(keys[i], values[i]) for i in range(n)] + [_line(keys[i], values[i]) for i in answered]
    prompt = "\n".join(lines + [keys[position] + ASSIGN])
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


def recall_train_doc(rng: random.Random, n_pairs: int) -> str:
    """One training document in the probe's format: ``n_pairs`` context lines ``kx=47``, then every key
    queried once more with its answer (``kx=47`` again), in shuffled order; lines joined by newlines.

    Args:
        rng: the random stream (keys, values, query order).
        n_pairs: context lines, 1..90.

    Returns:
        The document text (``2 * n_pairs`` lines, no trailing newline).
    """
    if isinstance(n_pairs, bool) or not isinstance(n_pairs, int) or not 1 <= n_pairs <= len(VALUES):
        raise ValueError(f"n_pairs must be an int in 1..{len(VALUES)}, got {n_pairs!r}")
    keys = rng.sample(KEYS, n_pairs)
    values = rng.sample(VALUES, n_pairs)
    order = rng.sample(range(n_pairs), n_pairs)
    return "\n".join([_line(k, v) for k, v in zip(keys, values)] + [_line(keys[i], values[i]) for i in order])


def _train_doc_stream(seed: int, n_pairs: Sequence[int]) -> tuple[random.Random, Iterator[str]]:
    """The seeded stream of training documents (``"statereduce.recall.train:{seed}"``, separate from the probe's)
    and its random generator; a consumer that draws from the generator between documents shares the stream."""
    rng = random.Random(f"statereduce.recall.train:{seed}")  # a fixed name, as the probe's seed
    sizes = list(n_pairs)

    def docs() -> Iterator[str]:
        while True:
            yield recall_train_doc(rng, rng.choice(sizes))

    return rng, docs()


def joined_bytes(doc: str) -> int:
    """A document's share of a joined training text: its UTF-8 bytes plus one separator."""
    return len(doc.encode("utf-8")) + 1


def recall_train_docs(n_docs: int, n_pairs: Sequence[int], seed: int = 0) -> list[str]:
    """``n_docs`` seeded training documents (:func:`recall_train_doc`), each of a context size drawn from
    ``n_pairs``. The stream (``"statereduce.recall.train:{seed}"``) is separate from the probe's."""
    return list(itertools.islice(_train_doc_stream(seed, n_pairs)[1], n_docs))


def recall_stream_docs(n_bytes: int, n_pairs: Sequence[int], seed: int = 0) -> list[str]:
    """Recall training documents (:func:`recall_train_docs`' stream) until they hold ``n_bytes`` UTF-8 bytes,
    one separator each included: the recall-only phase of ``recall_mix.pure_steps``."""
    docs, total = [], 0
    stream = _train_doc_stream(seed, n_pairs)[1]
    while total < n_bytes:
        docs.append(next(stream))
        total += joined_bytes(docs[-1])
    return docs


def answer_labels(tokenizer, docs: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """The token stream of recall training documents (:func:`statereduce.core.data.token_stream`'s: joined with EOS)
    and its labels for a loss on the answers alone: each query line's value tokens keep their id, every other
    position (context lines, keys, separators) is -100, which the models' loss ignores.

    Args:
        tokenizer: the byte-level tokenizer (one token per byte; the documents are ASCII).
        docs: documents of :func:`recall_train_doc`'s format (context lines, then as many query lines).

    Returns:
        ``(ids, labels)``, two 1-D LongTensors of one length.
    """
    import torch

    from statereduce.core.data import token_stream

    ids = token_stream(tokenizer, docs)
    labels = torch.full_like(ids, -100)
    start = 0
    for doc in (d for d in docs if d):
        n = len(tokenizer(doc, add_special_tokens=False)["input_ids"])
        if n != len(doc.encode("utf-8")):
            raise ValueError(f"answer_labels needs a byte-level tokenizer (one token per byte); "
                             f"{type(tokenizer).__name__} gave {n} tokens for {len(doc.encode())} bytes")
        lines = doc.split("\n")
        offset = start
        for i, line in enumerate(lines):
            if i >= len(lines) // 2:  # query lines: the value follows the key and '='
                value_at = offset + line.index(ASSIGN) + 1
                labels[value_at:offset + len(line)] = ids[value_at:offset + len(line)]
            offset += len(line) + 1
        start += n + 1  # the document and the EOS after it
    return ids, labels


def recall_accuracy(model: nn.Module, tokenizer, docs: Sequence[Mapping[str, Any]], batch_docs: int = 32) -> float:
    """Accuracy of ``model`` on probe documents (:func:`generate_recall_docs`), scored as lm-eval's
    ``multiple_choice`` ``acc`` is (the summed log-likelihood of each choice after the prompt; the best one wins),
    computed directly: the check of ``recall_mix.until`` during pretraining, which must not start lm-eval.
    ``batch_docs``: documents per forward (:func:`choice_scores`)."""
    scores = choice_scores(model, tokenizer, docs, batch_docs)
    hits = sum(int(max(range(len(s)), key=s.__getitem__) == doc["gold"]) for s, doc in zip(scores, docs))
    return hits / len(docs)


def choice_scores(model: nn.Module, tokenizer, docs: Sequence[Mapping[str, Any]],
                  batch_docs: int = 32) -> list[list[float]]:
    """Per document, the summed log-likelihood of each choice after the prompt. ``batch_docs`` documents go through
    one forward, each choice a row right-padded with token 0 (the models are causal, so a row's scored positions
    never see its padding)."""
    import torch

    was_training = model.training
    model.eval()
    out: list[list[float]] = []
    with torch.no_grad():
        for start in range(0, len(docs), batch_docs):
            batch = docs[start:start + batch_docs]
            rows, spans = [], []
            for doc in batch:
                prompt = tokenizer(doc["prompt"], add_special_tokens=False)["input_ids"]
                for c in doc["choices"]:
                    ids = tokenizer(c, add_special_tokens=False)["input_ids"]
                    spans.append((len(prompt), ids))
                    rows.append(prompt + ids)
            width = max(map(len, rows))
            x = torch.tensor([r + [0] * (width - len(r)) for r in rows])
            logp = torch.log_softmax(model(input_ids=x).logits.float(), dim=-1)
            scores = iter(float(logp[j, n - 1 + torch.arange(len(c)), torch.tensor(c)].sum())
                          for j, (n, c) in enumerate(spans))
            out += [[next(scores) for _ in doc["choices"]] for doc in batch]
    model.train(was_training)
    return out


def mix_recall_docs(
    corpus_docs: Sequence[str], fraction: float, n_pairs: Sequence[int], seed: int = 0
) -> tuple[list[str], int]:
    """Insert recall training documents among ``corpus_docs`` so they make up ~``fraction`` of the bytes.

    Documents are drawn (:func:`recall_train_docs`' stream) until their UTF-8 bytes, one separator each
    included, reach ``fraction / (1 - fraction)`` times the corpus's; each goes to a slot between corpus
    documents drawn uniformly from the same seeded stream, so the corpus order is kept and the result
    depends only on the arguments.

    Args:
        corpus_docs: the corpus's training documents, in order.
        fraction, n_pairs, seed: see :class:`~statereduce.common.settings.RecallMixSettings`.

    Returns:
        ``(docs, n_recall)``: the mixed document list and how many recall documents it holds.
    """
    mix = RecallMixSettings(fraction=fraction, n_pairs=list(n_pairs), seed=seed)
    rng, stream = _train_doc_stream(mix.seed, mix.n_pairs)
    target = mix.fraction / (1.0 - mix.fraction) * sum(map(joined_bytes, corpus_docs))
    by_slot: dict[int, list[str]] = {}
    total, n_recall = 0, 0
    while total < target:
        doc = next(stream)
        by_slot.setdefault(rng.randrange(len(corpus_docs) + 1), []).append(doc)
        total += joined_bytes(doc)
        n_recall += 1
    out: list[str] = []
    for i, doc in enumerate([*corpus_docs, None]):
        out.extend(by_slot.get(i, []))
        if doc is not None:
            out.append(doc)
    return out, n_recall


def write_recall_tasks(
    task_dir: str | Path,
    levels: Iterable[int | Mapping[str, Any] | RecallLevel] = DEFAULT_LEVELS,
    n_docs: int = DEFAULT_N_DOCS,
    seed: int = 0,
) -> list[str]:
    """Write one local lm-eval ``multiple_choice`` task per level (``{name}.jsonl`` + ``{name}.yaml``).

    Args:
        task_dir: folder for the files (created); pass it as ``include_path`` (it may also hold the
            held-out perplexity task of :func:`statereduce.eval.tasks.write_perplexity_task`). Each task is
            a :func:`statereduce.eval.tasks.write_multiple_choice_task` with ``doc_to_text: prompt``, an
            empty ``target_delimiter`` (the value follows ``=`` directly), metric ``acc`` only (every
            candidate has two characters, so ``acc_norm`` would equal it) and the level's parameters,
            ``seed`` and ``chance`` in its ``metadata``.
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
            docs,
            task_dir,
            name,
            metrics=("acc",),
            text_field="prompt",
            target_delimiter="",
            tag=TASK_PREFIX,
            metadata=metadata,
        )
    return names


def recall_probe_writer(
    settings: RecallProbeSettings, tokenizer=None, max_length: int | None = None
) -> Callable[[str | Path], list[str]]:
    """A local-task writer for :func:`statereduce.eval.harness.evaluate_and_write` (the ``recall_probe`` suite).

    Args:
        settings: ``eval.recall_probe`` (:class:`~statereduce.common.settings.RecallProbeSettings`).
        tokenizer, max_length: when both are given, the written documents are checked to fit the
            window (see :func:`check_recall_fits`).

    Returns:
        ``writer(task_dir) -> task names``.
    """
    probe = settings

    def writer(task_dir: str | Path) -> list[str]:
        names = write_recall_tasks(task_dir, probe.levels, probe.n_docs, probe.seed)
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

    Same path as every other metric: :func:`statereduce.eval.harness.evaluate_model` (``HFLM`` on the
    in-memory model, ``TaskManager`` with ``include_path=task_dir``).

    Args:
        model: loaded causal LM (fla on CPU: ``fla_fallback.install()`` first).
        tokenizer: its tokenizer.
        task_dir: folder for the task files.
        levels, n_docs, seed: see :func:`write_recall_tasks`.
        batch_size, max_length, device, limit: see :func:`statereduce.eval.harness.evaluate_model`. A
            ``max_length`` shorter than a document (prompt + answer) is an error: lm-eval would cut
            the context from the left, needle included.

    Returns:
        ``{task: {"acc": ..., "acc_stderr": ...}}`` for every level.
    """
    names = write_recall_tasks(task_dir, levels, n_docs, seed)
    check_recall_fits(tokenizer, task_dir, names, max_length)
    from statereduce.eval.harness import evaluate_model  # torch and lm-eval: only where a model runs

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
            text = doc["prompt"] + max(doc["choices"], key=len)
            longest = max(longest, len(tokenizer.encode(text)))
    return longest
