"""Rewrite README.md's generated blocks from the files their numbers come from; ``--check`` names any that differ.

    python dev/readme_blocks.py [--check] [--readme README.md] [NAME ...]

A block is the lines between ``<!-- generated:NAME -->`` and ``<!-- /generated:NAME -->``; nothing else of the
README is touched. Every source is committed. Blocks (all by default):

- ``results``: the overview of the default run recorded in ``docs/results/default_run/`` (``comparison.md``: held-out
  bits per byte and recall pre → post RFT, standard errors, the step RFT kept; ``run.json``: the CPU kind, the
  command, job count, wall time, date and commit), written by ``python dev/publish_run.py`` from a finished
  ``snakemake --cores all``.
- ``install``: ``docs/results/install_size.json`` (``python dev/install_size.py``).
- ``hub-cost``: the measurements of ``docs/records/paper_scale_h200.md`` at the paper's sizes, from
  ``docs/results/paper_scale_*/`` (``jobs.json``, ``sizes.tsv``, ``rft.json``: ``python dev/paper_scale_table.py RUN
  --save DIR``).
- ``recipe``: ``docs/experiments/recipe/summary.md``, verbatim, which names the CPU kind of its runs (the ``cpu``
  column of ``results.csv`` beside it; both written by ``docs/experiments/recipe/table.py``).
- ``compensation``: ``docs/experiments/compensation/goal.md``, verbatim (the best new cell of the compensation study
  against the recipe, with the CPU kind of its runs; written by ``docs/experiments/compensation/table.py``).

Each problem is one line naming the block, and makes the command exit 1: a block whose source is missing (the block
is left as it is), a block that differs from what its source renders (``--check``: every line is compared), and a
``results`` and a ``recipe`` block made on different kinds of CPU (torch picks its kernels by the CPU, so another
kind trains other numbers: docs/results.md, "Why the CPU matters"; checked where both blocks are selected).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the package of this checkout, also where it is not installed

from statereduce.analysis.tables import OVERVIEW, parse_made_on  # noqa: E402
from statereduce.core.run_report import format_seconds  # noqa: E402

DEFAULT_RUN = Path("docs/results/default_run")
COMPARISON = DEFAULT_RUN / "comparison.md"
RUN_JSON = DEFAULT_RUN / "run.json"
INSTALL = Path("docs/results/install_size.json")
RECIPE = Path("docs/experiments/recipe/summary.md")
COMPENSATION = Path("docs/experiments/compensation/goal.md")
RECIPE_CSV = RECIPE.with_name("results.csv")
#: The paper-scale runs (docs/records/paper_scale_h200.md), oldest first: a later run's measurement of a stage replaces
#: an earlier one's (the later runs measured RFT with the config's ``micro_batch_size: auto``), with the GPU each ran on.
PAPER_SCALE_RUNS = (("docs/results/paper_scale_h200", "H200"), ("docs/results/paper_scale_h200_gdn", "H200"),
                    ("docs/results/paper_scale_h200_selectors", "H200"))
HUB_MODELS = ("dn1.3b-init", "gdn1.3b-init")
PUBLISH = "python dev/publish_run.py"
#: What the results block reads from ``run.json``.
RUN_KEYS = ("cpu", "python", "jobs", "wall_seconds", "date", "command")


class SourceError(Exception):
    """A block's source cannot give the block (its message says why)."""


class SourceMissing(SourceError):
    """A file a block is made from is not there."""


@dataclass(frozen=True)
class Block:
    """A generated block: ``render(root)`` gives its text (``SourceError`` where its source cannot)."""

    source: str
    render: Callable[[Path], str]


def _read(root: Path, path: Path, hint: str) -> str:
    if not (root / path).is_file():
        raise SourceMissing(f"source missing: no {path} ({hint})")
    return (root / path).read_text()


# ---- results ------------------------------------------------------------------------------------------------------
def overview_sections(md: str) -> list[tuple[str, str]]:
    """``(heading, body)`` of each ``## Overview: …`` section of a comparison Markdown, body stripped."""
    out, head, body = [], None, []
    for line in md.splitlines() + ["## end"]:
        if line.startswith("## "):
            if head is not None:
                out.append((head, "\n".join(body).strip()))
            head, body = (line[3:].split(": ", 1)[1] if line.startswith(f"## {OVERVIEW}: ") else None), []
        elif head is not None:
            body.append(line)
    return out


def default_run(root: Path) -> tuple[str, dict]:
    """(``comparison.md``, ``run.json``) of the recorded default run; ``SourceError`` where either is missing or they
    name different CPU kinds."""
    hint = f"`snakemake --cores all`, then `{PUBLISH}` records it"
    md = _read(root, COMPARISON, hint)
    run = json.loads(_read(root, RUN_JSON, hint))
    lacking = [k for k in RUN_KEYS if run.get(k) is None]
    if lacking:
        raise SourceError(f"{RUN_JSON} lacks {', '.join(lacking)} ({hint} again)")
    made = parse_made_on(md)
    if made is None or made[0] != [run.get("cpu")]:
        named = "; ".join(made[0]) if made and made[0] else "no CPU"
        raise SourceError(f"{COMPARISON} names {named}, {RUN_JSON} {run.get('cpu')!r}: not one run ({hint} again)")
    return md, run


def results_cpu(root: Path) -> list[str]:
    return [default_run(root)[1]["cpu"]]


def render_results(root: Path) -> str:
    md, run = default_run(root)
    sections = overview_sections(md)
    if not sections:
        raise SourceError(f"{COMPARISON} has no overview: made by an older statereduce (rerun the default and "
                          f"`{PUBLISH}`)")
    cap = run.get("torch_cpu_capability")
    parts = [f"From `{COMPARISON}`, made on {run['cpu']}" + (f", torch CPU capability {cap}" if cap else "") + "."]
    for head, body in sections:
        parts += [f"**{head[0].upper() + head[1:]}.**", body]
    commit = f", commit {run['commit'][:7]}" if run.get("commit") else ""
    parts.append(f"Run time: `{run['command']}` ran {run['jobs']} jobs in {format_seconds(run['wall_seconds'])} "
                 f"on {run['date'][:10]}{commit}, Python {run['python']} (`{RUN_JSON}`).")
    return "\n\n".join(parts) + "\n"


# ---- install ------------------------------------------------------------------------------------------------------
def _mb(n: float) -> str:
    """Bytes as MB (one decimal below 10 MB) or GB."""
    return f"{n / 1e6:.1f} MB" if n < 1e7 else f"{n / 1e6:,.0f} MB" if n < 1e9 else f"{n / 1e9:.1f} GB"


def _install_line(m: dict, top: int = 5) -> str:
    big = ", ".join(f"{p['name']} {p['version']} {_mb(p['bytes'])}" for p in m["packages"][:top])
    return f"{len(m['packages'])} packages, **{_mb(m['total_bytes'])}** to download; the largest: {big}"


def render_install(root: Path) -> str:
    path = root / INSTALL
    if not path.is_file():
        raise SourceMissing(f"source missing: no {INSTALL} (`python dev/install_size.py` writes it)")
    doc = json.loads(path.read_text())
    nvidia = sum(p["bytes"] for p in doc["packages"] if p["name"].startswith(("nvidia-", "cuda-")))
    lines = [f"- `pip install -c constraints.txt -e .` from PyPI ({doc['platform']}, Python {doc['python']}; the same "
             "for the CPU-only default run): "
             f"{_install_line(doc)}; NVIDIA's CUDA libraries {_mb(nvidia)} of it."]
    for url, m in doc.get("variants", {}).items():
        if "error" in m:
            lines.append(f"- with `--extra-index-url {url}`: not measured ({m['error']}).")
        else:
            lines.append(f"- with `--extra-index-url {url}`: {_install_line(m)}.")
    lines.append(f"\nMeasured {doc['date']} by `{doc['command']}` (pip's dry run resolves the install, the index lists "
                 f"each file's size; `{INSTALL}`).")
    return "\n".join(lines) + "\n"


# ---- hub-cost -----------------------------------------------------------------------------------------------------
#: The stages of one chain in order: (rule, label)
CHAIN = (("init_random", "model (random weights at the hub shape; a download in its place)"),
         ("qk_weights", "q/k weights (CPU)"), ("calibrate", "calibrate (128 × 2048 tokens)"),
         ("grad_scores", "Grad scores"), ("eval_baseline", "evaluate the baseline"),
         ("select_channels", "select channels"), ("prune", "prune + evaluate"),
         ("rft", "RFT ({steps} steps) + evaluate"))
#: The artifacts of one chain: (label, path pattern with {model} and {cell}, a selector's cell)
ARTIFACTS = (("base checkpoint (bf16)", "results/{model}/base/model.safetensors"),
             ("q/k weights", "results/{model}/weights/qk.h5"),
             ("calibration activations", "results/{model}/calib/default/activations.h5"),
             ("Grad scores", "results/{model}/calib/default/grad_scores.h5"),
             ("selection", "results/{model}/select/{cell}.parquet"),
             ("pruned checkpoint", "results/{model}/{cell}/pruned/model.safetensors"),
             ("RFT checkpoint", "results/{model}/{cell}/rft/model.safetensors"))


def _paper_scale(root: Path) -> dict:
    """Per model, the newest run's jobs (rule -> [job]), sizes (path -> bytes) and RFT rates, with the run's folder."""
    out: dict[str, dict] = {}
    found = False
    for folder, gpu in PAPER_SCALE_RUNS:
        d = root / folder
        if not (d / "jobs.json").is_file():
            continue
        found = True
        jobs = json.loads((d / "jobs.json").read_text())
        sizes = {}
        if (d / "sizes.tsv").is_file():
            for row in csv.reader((d / "sizes.tsv").read_text().splitlines(), delimiter="\t"):
                sizes[row[1]] = int(row[0])
        rft = json.loads((d / "rft.json").read_text()) if (d / "rft.json").is_file() else {}
        for model in HUB_MODELS:
            m = out.setdefault(model, {"jobs": {}, "sizes": {}, "rft": {}})
            rules: dict[str, list] = {}
            for j in jobs:
                rule, rest = j["job"].split("/", 1)
                if rest.split("/", 1)[0] == model:
                    rules.setdefault(rule, []).append({**j, "run": folder, "gpu": gpu})
            m["jobs"].update(rules)  # a later run replaces a stage's measurements
            m["sizes"].update({p: b for p, b in sizes.items() if p.startswith(f"results/{model}/")})
            rates = {k: v for k, v in rft.items() if k.startswith(f"{model}/")}
            if rates:
                kernels = {json.loads(f.read_text()).get("kernels") for f in d.glob(f"rft_record_{model}_*.json")}
                m["rft"] = {"rates": rates, "run": folder, "gpu": gpu, "kernels": sorted(k for k in kernels if k)}
    if not found:
        raise SourceMissing("source missing: no docs/results/paper_scale_*/jobs.json "
                            "(`python dev/paper_scale_table.py RUN --save DIR` writes it)")
    return out


def _span(values: list[float], fmt: str) -> str:
    lo, hi = min(values), max(values)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}-{fmt.format(hi)}"


def render_hub_cost(root: Path) -> str:
    from statereduce.common.settings import RftSettings

    data = _paper_scale(root)
    models = [m for m in HUB_MODELS if data.get(m, {}).get("jobs")]
    lines = ["| stage | " + " | ".join(f"{m}: wall s | GPU GiB" for m in models) + " |",
             "|" + " --- |" * (1 + 2 * len(models))]
    steps = sorted({v["steps"] for m in models for v in data[m]["rft"].get("rates", {}).values()})
    for rule, label in CHAIN:
        cells = []
        for m in models:
            jobs = data[m]["jobs"].get(rule, [])
            if not jobs:
                cells += ["–", "–"]
                continue
            gpu = [j["gpu_gib"] for j in jobs if j.get("gpu_gib")]
            cells += [_span([j["seconds"] for j in jobs], "{:.0f}"), _span(gpu, "{:.1f}") if gpu else "–"]
        label = label.format(steps="/".join(map(str, steps)) or "?")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "| artifact | " + " | ".join(models) + " |", "|" + " --- |" * (1 + len(models))]
    for label, pattern in ARTIFACTS:
        cells = []
        for m in models:
            sizes = data[m]["sizes"]
            rx = re.compile(re.escape(pattern.format(model=m, cell="@")).replace("@", r"[^/]+_\d+") + "$")
            found = [b for p, b in sizes.items() if rx.match(p)]
            cells.append(_mb(statistics.median(found)) if found else "–")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    rft = RftSettings()
    tokens = rft.n_samples * rft.seq_len
    rates, hours = [], []
    for m in models:
        r = data[m]["rft"]
        if not r:
            continue
        rate = statistics.median(v["steady_tokens_per_s"] for v in r["rates"].values())
        kernels = f" ({', '.join(r['kernels'])} kernels)" if r.get("kernels") else ""
        rates.append(f"{m} {rate:,.0f} tokens/s{kernels}")
        seconds = tokens / rate
        hours.append(f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h")
    cells = sorted({j["job"].split("/")[-1] for m in models for j in data[m]["jobs"].get("prune", [])})
    runs = sorted({j["run"] for m in models for js in data[m]["jobs"].values() for j in js})
    gpus = sorted({j["gpu"] for m in models for js in data[m]["jobs"].values() for j in js})
    text = "\n".join(lines) + "\n\n"
    text += (f"Random weights at each hub model's exact shape on one NVIDIA {' / '.join(gpus)} "
             f"(`configs/gpu_paper_scale.yaml`: the paper's calibration and RFT batches of {rft.batch_size} × "
             f"{rft.seq_len} tokens). Wall time is Snakemake's per job (Python, imports and model loading included), "
             f"GPU memory torch's peak allocation; a range spans the cells {', '.join(cells)}. ")
    if rates:
        text += (f"RFT in steady state: {'; '.join(rates)}; the paper's full RFT ({rft.n_samples:,} sequences × "
                 f"{rft.seq_len} tokens) at these rates: {' and '.join(hours)}. ")
    text += ("Sources: " + ", ".join(f"`{r}/`" for r in runs) +
             " ([docs/paper_scale.md](docs/paper_scale.md) says which jobs shared the GPU).\n")
    return text


# ---- recipe -------------------------------------------------------------------------------------------------------
def recipe_cpu(root: Path) -> list[str]:
    """The CPU kinds of the recipe's runs: the ``cpu`` column of ``results.csv``."""
    text = _read(root, RECIPE_CSV, "python docs/experiments/recipe/table.py writes it beside summary.md")
    cpus = sorted({row.get("cpu") or "" for row in csv.DictReader(text.splitlines())} - {""})
    if not cpus:
        raise SourceError(f"{RECIPE_CSV} records no CPU (its `cpu` column is empty or absent)")
    return cpus


def render_recipe(root: Path) -> str:
    text = _read(root, RECIPE, "python docs/experiments/recipe/table.py writes it")
    unnamed = [c for c in recipe_cpu(root) if c not in text]
    if unnamed:
        raise SourceError(f"{RECIPE} does not name {', '.join(unnamed)}, the CPU of {RECIPE_CSV} "
                          "(python docs/experiments/recipe/table.py writes both)")
    return rebase_links(text, RECIPE.parent).strip("\n") + "\n"


def render_compensation(root: Path) -> str:
    text = _read(root, COMPENSATION, "python docs/experiments/compensation/table.py RUN_DIR writes it")
    return rebase_links(text, COMPENSATION.parent).strip("\n") + "\n"


def rebase_links(text: str, folder: Path) -> str:
    """``text``'s relative Markdown links, written relative to ``folder``, rewritten relative to the repository root
    (where the README that includes the text lies); URLs and in-page anchors stay."""
    def rebase(m: re.Match) -> str:
        target = m.group(1)
        if target.startswith("#") or re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", target):
            return m.group(0)
        return f"]({os.path.normpath(folder / target)})"
    return re.sub(r"\]\(([^)\s]+)\)", rebase, text)


BLOCKS: dict[str, Block] = {
    "results": Block(f"{DEFAULT_RUN}/", render_results),
    "install": Block(str(INSTALL), render_install),
    "hub-cost": Block("docs/results/paper_scale_*/", render_hub_cost),
    "recipe": Block(str(RECIPE), render_recipe),
    "compensation": Block(str(COMPENSATION), render_compensation),
}
#: Blocks whose numbers must come from one kind of CPU, each with the file that names its kind and how it is read;
#: the first names the kind, the others are checked against it.
SAME_CPU: dict[str, tuple[Path, Callable[[Path], list[str]]]] = {"results": (RUN_JSON, results_cpu),
                                                                  "recipe": (RECIPE_CSV, recipe_cpu)}


# ---- the README ---------------------------------------------------------------------------------------------------
def _markers(name: str) -> tuple[str, str]:
    return f"<!-- generated:{name} -->", f"<!-- /generated:{name} -->"


def find_block(text: str, name: str) -> tuple[int, int] | None:
    """(start, end) offsets of block ``name``'s content (between its marker lines); None without markers."""
    begin, end = _markers(name)
    i = text.find(begin + "\n")
    if i < 0:
        return None
    j = text.find("\n" + end, i)
    if j < 0:
        raise ValueError(f"{begin} has no closing {end}")
    return i + len(begin) + 1, j + 1


def block_text(text: str, name: str) -> str | None:
    span = find_block(text, name)
    return None if span is None else text[span[0]:span[1]]


def replace_block(text: str, name: str, body: str) -> str:
    span = find_block(text, name)
    if span is None:
        raise KeyError(name)
    return text[:span[0]] + body.rstrip("\n") + "\n" + text[span[1]:]


def _clip(line: str, at: int, width: int = 60) -> str:
    """``line`` around column ``at``, at most about ``width`` characters, elided with …."""
    lo = max(0, at - width // 3)
    hi = lo + width
    return ("…" if lo else "") + line[lo:hi] + ("…" if hi < len(line) else "")


def first_difference(current: str, rendered: str) -> str | None:
    """Where README's block ``current`` first differs from ``rendered``, in words; None where they are equal."""
    ours, theirs = current.split("\n"), (rendered.rstrip("\n") + "\n").split("\n")
    for i, (a, b) in enumerate(zip(ours, theirs), 1):
        if a != b:
            at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return f"line {i}: README has {_clip(a, at)!r}, the source gives {_clip(b, at)!r}"
    if len(ours) != len(theirs):
        n = min(len(ours), len(theirs)) + 1
        return (f"README's block ends before line {n}" if len(ours) < len(theirs)
                else f"README's block has more lines from line {n}")
    return None


def cpu_mismatch(root: Path, names: list[str]) -> str | None:
    """One line where the blocks of :data:`SAME_CPU` (all among ``names``) come from different kinds of CPU; None
    where they agree or a source cannot say (its block reports that)."""
    if not all(n in names for n in SAME_CPU):
        return None
    kinds = {}
    for name, (_, read) in SAME_CPU.items():
        try:
            kinds[name] = read(root)
        except SourceError:
            return None
    first, *others = SAME_CPU
    for name in others:
        if kinds[name] != kinds[first]:
            return (f"{name}: made on {'; '.join(kinds[name])} ({SAME_CPU[name][0]}), the {first} block on "
                    f"{'; '.join(kinds[first])} ({SAME_CPU[first][0]}): README's numbers come from one kind of CPU "
                    "(rerun one of them on the other's kind)")
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", metavar="NAME", help=f"blocks (default: all of {', '.join(BLOCKS)})")
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 naming each block that differs")
    ap.add_argument("--readme", type=Path, default=ROOT / "README.md")
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout whose files the blocks come from")
    args = ap.parse_args(argv)
    unknown = [n for n in args.names if n not in BLOCKS]
    if unknown:
        ap.error(f"unknown block {', '.join(unknown)}; valid: {', '.join(BLOCKS)}")
    names = args.names or list(BLOCKS)
    text = args.readme.read_text()
    new, failed = text, False
    for name in names:
        current = block_text(text, name)
        if current is None:
            print(f"{name}: no <!-- generated:{name} --> markers in {args.readme.name}")
            failed = failed or bool(args.names)
            continue
        try:
            rendered = BLOCKS[name].render(args.root)
        except SourceError as e:
            print(f"{name}: {e}; block left as it is")
            failed = True
            continue
        why = first_difference(current, rendered)
        if args.check:
            if why is not None:
                failed = True
                print(f"{name}: README's block differs from what {BLOCKS[name].source} renders: {why} "
                      f"(python dev/readme_blocks.py {name} rewrites it)")
        elif why is not None:
            new = replace_block(new, name, rendered)
            print(f"{name}: rewritten from {BLOCKS[name].source}")
        else:
            print(f"{name}: unchanged")
    mismatch = cpu_mismatch(args.root, names)
    if mismatch:
        print(mismatch)
        failed = True
    if not args.check and new != text:
        args.readme.write_text(new)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
