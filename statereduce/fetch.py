"""python -m statereduce.fetch TARGET [TARGET ...] [--configfile FILE ...]: download what the targets read from the
network into one Hugging Face cache (``HF_HOME``), so that the workflow then runs with ``HF_HUB_OFFLINE=1
HF_DATASETS_OFFLINE=1`` on machines without network (docs/offline.md).

For each model of the targets (a path under ``results/{model}/``, ``all`` for the default target, ``all_paper`` for
it and the studies) it fetches:

- the hub checkpoint (``models.<name>.hub``) at its configured revision: the files loading reads
  (:data:`statereduce.core.checkpoints.CHECKPOINT_PATTERNS`; safetensors only where the repo has them), through
  ``huggingface_hub.snapshot_download``, so that the revision (a branch, tag or commit) resolves offline;
- the splits of its ``hf`` corpora that its jobs read (calibration under every calibration variant of the targets,
  the ``heldout`` task's and the rank analysis's held-out split, RFT's and pretraining's train split), as
  :func:`statereduce.core.data.load_split` reads them: a streamed row range of a parquet dataset downloads the shard
  files that hold it (:func:`statereduce.core.data.parquet_shards`), any other split is loaded once into the
  ``datasets`` cache;
- the lm-eval tasks of its ``eval`` block (suites expanded), built through lm-eval's ``TaskManager`` exactly as
  the evaluation builds them, which downloads their datasets (and for RULER the
  tokenizer by name and nltk's ``punkt_tab``).

Everything downloaded is printed with its size. The module never imports snakemake; the config is read as Snakemake
reads it (``config.yaml`` of the working directory, each ``--configfile`` merged over it) and validated.
"""

from __future__ import annotations

import argparse
import copy
import fnmatch
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from statereduce import config as srconfig
from statereduce.common import layout
from statereduce.common.settings import HubSettings
from statereduce.core.checkpoints import CHECKPOINT_PATTERNS
from statereduce.studies import check_studies

DEFAULT_TARGETS = ("all", "all_paper")
"""Target names besides ``results/{model}/...`` paths: the default target (``all``) and ``all_paper``."""


@dataclass
class ModelNeeds:
    """What the jobs of one model read from the network: ``hub`` (id, revision) or None, ``splits`` (corpus name ->
    splits), lm-eval ``tasks`` with their ``metadata``."""

    model: str
    hub: tuple[str, str] | None = None
    splits: dict[str, set[str]] = field(default_factory=dict)
    tasks: list[str] = field(default_factory=list)
    metadata: dict | None = None


def merge(base: dict, over: dict) -> dict:
    """``over`` merged into a copy of ``base``, mappings key by key (as Snakemake merges ``--configfile``)."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_config(configfiles: Sequence[str | Path] = (), base: str | Path = "config.yaml") -> dict:
    """The validated workflow config: ``base`` with each of ``configfiles`` merged over it in order.

    Raises:
        ConfigError: one line, for a missing file or an invalid config.
    """
    cfg: dict = {}
    for path in [base, *configfiles]:
        if not Path(path).is_file():
            raise srconfig.ConfigError(f"config file {str(path)!r} not found (cwd {Path.cwd()})")
        cfg = merge(cfg, yaml.safe_load(Path(path).read_text()) or {})
    cfg = srconfig.validate_config(cfg)
    check_studies(cfg)
    return cfg


def target_models(cfg: dict, targets: Sequence[str]) -> dict[str, tuple[set[str], bool]]:
    """model -> (calibration ids, whether the rank analysis runs) of ``targets``.

    Raises:
        ConfigError: a target that is neither a results path of a configured model nor ``all``/``all_paper``.
    """
    from statereduce.selectors import parse_method

    out: dict[str, tuple[set[str], bool]] = {}

    def add(model: str, method: str | None = None, calib: str | None = None, rank: bool = False) -> None:
        calibs, has_rank = out.get(model, (set(), False))
        calibs |= {"default", calib or (parse_method(method).calib if method else "default")}
        out[model] = (calibs, has_rank or rank)

    for target in targets:
        if target in DEFAULT_TARGETS:
            paper = target == "all_paper"
            for model in cfg["targets"]["models"]:
                for method in cfg["targets"]["methods"]:
                    add(model, method, rank=paper)
            if paper:
                for cells in check_studies(cfg).values():
                    for model, method, _pct in cells:
                        add(model, method, rank=True)
            continue
        parsed = layout.parse(target)
        if parsed is None or parsed.model not in cfg["models"]:
            valid = ", ".join(sorted(cfg["models"]))
            raise srconfig.ConfigError(f"target {target!r}: expected {' or '.join(DEFAULT_TARGETS)} or a path "
                                       f"results/<model>/... of a configured model ({valid})")
        if parsed.method is not None:
            srconfig.check_method(cfg, parsed.method)
        add(parsed.model, parsed.method, parsed.calib, rank="rank.json" in (parsed.rest or ()))
    return out


def model_needs(cfg: dict, model: str, calibs: Iterable[str] = ("default",), rank: bool = False) -> ModelNeeds:
    """What the chain of ``model`` (base, calibration under ``calibs``, evaluation, RFT, and the rank analysis when
    ``rank``) reads from the network."""
    from statereduce.eval.harness import task_metadata  # torch: only once the config and targets are checked

    m = cfg["models"][model]
    needs = ModelNeeds(model)
    if "hub" in m:
        hub = HubSettings.from_dict(m["hub"])
        needs.hub = (hub.id, hub.revision)

    def read(corpus: str | None, split: str) -> None:
        if corpus is not None and cfg["corpora"][corpus]["source"] == "hf":
            needs.splits.setdefault(corpus, set()).add(split)

    for calib in sorted(calibs):
        cal = srconfig.model_calibration(cfg, model, calib)
        read(cal.corpus, cal.split)
    ev = srconfig.model_eval(cfg, model)
    if "heldout" in ev.tasks:
        read(srconfig.model_eval_corpus(cfg, model), "heldout")
    if rank:
        read(srconfig.model_rank(cfg, model).corpus, "heldout")
    plan = srconfig.model_rft(cfg, model)
    if plan.activate:
        read(plan.corpus, "train")
    if "pretrain" in m:
        read(m["pretrain"]["corpus"], "train")
    needs.tasks = [t for t in ev.tasks if t != "heldout"]
    tokenizer = needs.hub[0] if needs.hub else m.get("local")
    needs.metadata = task_metadata(ev.metadata, tokenizer)
    return needs


# ---- fetching -----------------------------------------------------------------------------------------------------
def size(n: int) -> str:
    """Bytes in decimal units: 512 B, 1.5 kB, 2.15 GB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def folder_bytes(folder: str | Path) -> int:
    """Bytes of the regular files under ``folder`` (symlinks not followed: the hub cache links snapshots to blobs)."""
    total = 0
    for root, _dirs, files in os.walk(folder):
        for f in files:
            p = os.path.join(root, f)
            if not os.path.islink(p):
                total += os.path.getsize(p)
    return total


def checkpoint_files(names: Iterable[str]) -> list[str]:
    """The files of a hub repo that loading reads (:data:`~statereduce.core.checkpoints.CHECKPOINT_PATTERNS`), with the
    ``pytorch_model*.bin`` weights left out where the repo has safetensors (transformers loads those)."""
    names = sorted(names)
    chosen = [n for n in names if "/" not in n and any(fnmatch.fnmatch(n, p) for p in CHECKPOINT_PATTERNS)]
    if any(n.endswith(".safetensors") for n in chosen):
        chosen = [n for n in chosen if not n.startswith("pytorch_model")]
    return chosen


def fetch_checkpoint(hub_id: str, revision: str, log: Callable[[str], None] = print) -> dict:
    """Download the files of ``hub_id`` at ``revision`` that loading reads into the hub cache; returns
    ``{"commit", "files": {name: bytes}}``."""
    from huggingface_hub import HfApi, snapshot_download

    info = HfApi().model_info(hub_id, revision=revision)
    files = checkpoint_files(s.rfilename for s in info.siblings or [])
    if not any(n.endswith((".safetensors", ".bin")) for n in files):
        raise ValueError(f"hub repo {hub_id}@{revision} has no weights among its top-level files")
    folder = Path(snapshot_download(hub_id, revision=revision, allow_patterns=files))
    sizes = {n: (folder / n).stat().st_size for n in files}
    pinned = "" if revision == info.sha else f" (commit {info.sha})"
    log(f"checkpoint {hub_id}@{revision}{pinned}: {len(files)} files, {size(sum(sizes.values()))}")
    for n, b in sizes.items():
        log(f"    {n}  {size(b)}")
    return {"commit": info.sha, "files": sizes}


def fetch_split(name: str, spec: dict, split: str, log: Callable[[str], None] = print) -> dict:
    """Put split ``split`` of the ``hf`` corpus ``name`` into the cache as :func:`statereduce.core.data.load_split`
    reads it; returns ``{"files": {file: bytes}}`` for a streamed parquet range, ``{"docs": n}`` otherwise.

    Raises:
        ValueError: a streamed split whose data files are not parquet (it could only be streamed, never offline).
    """
    from statereduce.core import data
    hf_split = dict(spec.get("splits") or data.DEFAULT_HF_SPLITS)[split]
    if not spec.get("streaming"):
        docs = data.load_split(spec, split)
        log(f"corpus {name}, {split} = {hf_split}: loaded into the datasets cache ({len(docs)} documents)")
        return {"docs": len(docs)}
    base, row_range = data.streaming_slice(hf_split)
    shards = data.parquet_shards(spec, base)
    if shards is None:
        raise ValueError(f"corpora.{name}: a streamed split of non-parquet files cannot be cached for an offline run; "
                         "set streaming: false (the split is then downloaded and prepared once)")
    covering = shards.covering(*(row_range or (0, None)))
    files = {}
    for shard, lo, hi in covering:
        files[shard.local_path()] = shard.bytes
    total = sum(s.num_rows for s in shards.shards)
    log(f"corpus {name}, {split} = {hf_split}: {len(covering)} of {len(shards.shards)} parquet files "
        f"({total:,} rows in all), {size(sum(files.values()))}")
    for (shard, lo, hi) in covering:
        where = shard.hub_file[2] if shard.hub_file else shard.url
        log(f"    {where}  rows {lo:,}-{hi:,} of {shard.num_rows:,}  {size(shard.bytes)}")
    return {"files": files}


def fetch_tasks(tasks: Sequence[str], metadata: dict | None = None, include_path: str | Path | None = None,
                log: Callable[[str], None] = print) -> dict[str, int]:
    """Build each lm-eval task as the evaluation does (``TaskManager`` with the suites' metadata, ``TaskManager.load``
    as ``simple_evaluate`` calls it),
    which downloads its data into the ``datasets`` cache; returns task -> bytes added to ``HF_HOME``.

    Raises:
        RuntimeError: naming every task that failed to build, after trying all.
    """
    from huggingface_hub import constants

    from statereduce.eval.harness import build_task_manager  # torch: only once the config and targets are checked

    manager = build_task_manager(tasks, include_path, metadata=metadata)
    added, failed = {}, []
    for task in tasks:
        before = folder_bytes(constants.HF_HOME)
        try:
            manager.load([task])
        except Exception as e:  # noqa: BLE001 -- report every task, then fail
            failed.append(f"{task} ({type(e).__name__}: {' '.join(str(e).split())[:200]})")
            log(f"lm-eval task {task}: FAILED: {failed[-1]}")
            continue
        added[task] = folder_bytes(constants.HF_HOME) - before
        log(f"lm-eval task {task}: {size(added[task])} added to the cache")
    if failed:
        raise RuntimeError(f"lm-eval tasks that could not be built: {', '.join(f.split(' (')[0] for f in failed)}")
    return added


def fetch(cfg: dict, targets: Sequence[str], log: Callable[[str], None] = print) -> list[str]:
    """Fetch what ``targets`` read (module docstring) into the Hugging Face cache; returns the failures, one line
    each (an empty list when everything is in the cache)."""
    from statereduce.core.data import hf_offline

    if hf_offline():
        raise ValueError("HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set: fetching needs network (unset them)")
    done: set = set()
    failures: list[str] = []

    def once(key, what: str, fn: Callable[[], object]) -> None:
        if key in done:
            return
        done.add(key)
        try:
            fn()
        except Exception as e:  # noqa: BLE001 -- go on with the rest, report at the end
            failures.append(f"{what}: {type(e).__name__}: {' '.join(str(e).split())}")
            log(f"FAILED {failures[-1]}")

    for model, (calibs, rank) in target_models(cfg, targets).items():
        needs = model_needs(cfg, model, calibs, rank)
        log(f"== {model}")
        if needs.hub is not None:
            once(("hub", *needs.hub), f"checkpoint {needs.hub[0]}", lambda: fetch_checkpoint(*needs.hub, log=log))
        for corpus, splits in sorted(needs.splits.items()):
            for split in sorted(splits):
                spec = srconfig.corpus_spec(cfg, corpus, Path.cwd())
                once(("split", corpus, split), f"corpus {corpus} {split}",
                     lambda: fetch_split(corpus, spec, split, log=log))
        if needs.tasks:
            once(("tasks", tuple(needs.tasks), repr(needs.metadata)), f"lm-eval tasks of {model}",
                 lambda: fetch_tasks(needs.tasks, needs.metadata, log=log))
        if not (needs.hub or needs.splits or needs.tasks):
            log("nothing to download (local checkpoint or trained by the workflow; local corpora; offline tasks)")
    return failures


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m statereduce.fetch",
        description="Download what the targets read from the network (hub checkpoints, dataset splits, lm-eval task "
                    "data) into the Hugging Face cache (HF_HOME), to run them offline (docs/offline.md).")
    p.add_argument("targets", nargs="+", metavar="TARGET",
                   help="results/<model>/... paths as given to snakemake, or all (the default target) or all_paper")
    p.add_argument("--configfile", nargs="+", default=[], metavar="FILE",
                   help="config overlays merged over ./config.yaml in order, as snakemake's --configfile")
    args = p.parse_args(argv)
    from huggingface_hub import constants  # it reads HF_HOME when first imported

    try:
        cfg = load_config(args.configfile)
        failures = fetch(cfg, args.targets)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    total = folder_bytes(constants.HF_HOME) if Path(constants.HF_HOME).is_dir() else 0
    print(f"\nHF_HOME={constants.HF_HOME}: {size(total)} in all")
    if failures:
        print(f"{len(failures)} item(s) failed:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    print(f"Run offline with: export HF_HOME={constants.HF_HOME} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1")
    return 0


if __name__ == "__main__":
    sys.exit(main())
