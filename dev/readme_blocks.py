"""Rewrite README.md's generated blocks from the files their numbers come from; ``--check`` names any that differ.

    python dev/readme_blocks.py [--check] [--readme README.md] [NAME ...]

A block is the lines between ``<!-- generated:NAME -->`` and ``<!-- /generated:NAME -->``; nothing else of the
README is touched. Blocks (all by default):

- ``results``: the overview of ``results/tables/comparison.md`` (held-out bits per byte and recall pre → post RFT,
  standard errors, the step RFT kept) of a finished default run (``snakemake --cores all``), the CPU kind it names,
  and the run time from Snakemake's log of the newest run that trained the models (``.snakemake/log/``).
- ``install``: ``docs/results/install_size.json`` (``python dev/install_size.py``).
- ``hub-cost``: the measurements of ``docs/paper_scale.md`` at the paper's sizes, from ``docs/results/paper_scale_*/``
  (``jobs.json``, ``sizes.tsv``, ``rft.json``: ``python dev/paper_scale_table.py RUN --save DIR``).
- ``recipe``: ``docs/experiments/recipe/summary.md``, verbatim.

A block whose source is absent is left as it is, and said so. ``--check`` compares each block with what its source
renders and exits 1 naming each that differs; it leaves out lines of timings (the run time varies from run to run)
and does not compare a ``results`` block made on another kind of CPU than the table at hand (torch picks its kernels
by the CPU, so another kind trains other numbers: README, "The same numbers on another CPU").
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import difflib
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

COMPARISON = Path("results/tables/comparison.md")
SNAKEMAKE_LOGS = Path(".snakemake/log")
INSTALL = Path("docs/results/install_size.json")
RECIPE = Path("docs/experiments/recipe/summary.md")
#: The paper-scale runs (docs/paper_scale.md), oldest first: a later run's measurement of a stage replaces an earlier
#: one's (the later runs measured RFT with the ``micro_batch_size: auto`` of today's config), with the GPU each ran on.
PAPER_SCALE_RUNS = (("docs/results/paper_scale_h200", "H200"), ("docs/results/paper_scale_h200_gdn", "H200"),
                    ("docs/results/paper_scale_h200_selectors", "H200"))
HUB_MODELS = ("dn1.3b-init", "gdn1.3b-init")
RUN_TIME = "Run time: "  # the results block's timing line (not compared by --check)


class SourceMissing(Exception):
    """The file a block is made from is not there (the block is left as it is)."""


@dataclass(frozen=True)
class Block:
    """A generated block: ``render(root)`` gives its text (``SourceMissing`` if its source is absent); lines starting
    with one of ``volatile`` (timings) are not compared by ``--check``."""

    source: str
    render: Callable[[Path], str]
    volatile: tuple[str, ...] = ()


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


def made_on_text(kinds: list[str], capability: str | None) -> str:
    """``AMD EPYC (AVX512), torch CPU capability AVX512`` (several kinds: joined by ``; ``)."""
    return ("; ".join(kinds) or "a CPU not recorded") + (f", torch CPU capability {capability}" if capability else "")


def block_made_on(block: str) -> tuple[list[str], str | None] | None:
    """(CPU kinds, torch capability) that a rendered ``results`` block names; None if it names none."""
    m = re.search(r"^From `[^`]+`, made on (.*?)(?:, torch CPU capability (\S+))?\.$", block, re.M)
    if m is None:
        return None
    return ([] if m.group(1) == "a CPU not recorded" else m.group(1).split("; ")), m.group(2)


def run_time(root: Path) -> str | None:
    """``snakemake --cores all`` ran N jobs in M min S s, from the newest complete Snakemake log of a run that
    trained the models (rule ``pretrain``): its ``Date:`` to its last time stamp. None without one."""
    logs = sorted((root / SNAKEMAKE_LOGS).glob("*.snakemake.log"), reverse=True)
    for log in logs:
        text = log.read_text(errors="replace")
        done = re.findall(r"^(\d+) of (\d+) steps \(100%\) done", text, re.M)
        if not done or not re.search(r"^(local)?rule pretrain:", text, re.M):
            continue
        cmd = re.search(r"^\s*Command: (.*)$", text, re.M)
        start = re.search(r"^\s*Date: (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)", text, re.M)
        stamps = re.findall(r"^\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]$", text, re.M)
        if not (start and stamps):
            continue
        t0 = dt.datetime.strptime(start.group(1), "%Y-%m-%d %H:%M:%S")
        t1 = dt.datetime.strptime(re.sub(" +", " ", stamps[-1]), "%a %b %d %H:%M:%S %Y")
        seconds = int((t1 - t0).total_seconds())
        command = re.sub(r"^\S*/", "", cmd.group(1).strip()) if cmd else "snakemake"
        return (f"`{command}` ran {done[-1][1]} jobs in {seconds // 60} min {seconds % 60} s "
                f"(Snakemake's log `{log.relative_to(root)}`).")
    return None


def render_results(root: Path) -> str:
    path = root / COMPARISON
    if not path.is_file():
        raise SourceMissing(f"no {COMPARISON} (run `snakemake --cores all` first)")
    md = path.read_text()
    made = parse_made_on(md)
    sections = overview_sections(md)
    if made is None or not sections:
        raise SourceMissing(f"{COMPARISON} has no 'Made on' line or no overview: made by an older statereduce, "
                            "rerun its rule (`snakemake --cores all --forcerun comparison_table`)")
    parts = [f"From `{COMPARISON}`, made on {made_on_text(*made)}."]
    for head, body in sections:
        parts += [f"**{head[0].upper() + head[1:]}.**", body]
    timing = run_time(root)
    if timing:
        parts.append(RUN_TIME + timing)
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
        raise SourceMissing(f"no {INSTALL} (run `python dev/install_size.py`)")
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
        raise SourceMissing("no docs/results/paper_scale_*/jobs.json (dev/paper_scale_table.py RUN --save DIR)")
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
def render_recipe(root: Path) -> str:
    path = root / RECIPE
    if not path.is_file():
        raise SourceMissing(f"no {RECIPE} yet")
    return rebase_links(path.read_text(), RECIPE.parent).strip("\n") + "\n"


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
    "results": Block(str(COMPARISON), render_results, volatile=(RUN_TIME,)),
    "install": Block(str(INSTALL), render_install),
    "hub-cost": Block("docs/results/paper_scale_*/", render_hub_cost),
    "recipe": Block(str(RECIPE), render_recipe),
}


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


def stable(body: str, volatile: tuple[str, ...]) -> str:
    """``body`` without its volatile lines (timings)."""
    return "\n".join(line for line in body.splitlines() if not line.startswith(volatile)).strip() + "\n"


def check_block(name: str, current: str, rendered: str) -> str | None:
    """Why README's ``current`` block does not match ``rendered``, or None where it does (or cannot be compared)."""
    block = BLOCKS[name]
    if name == "results":
        made, ours = block_made_on(current), block_made_on(rendered)
        if made is not None and ours is not None and made != ours:
            print(f"results: README's block was made on {made_on_text(*made)}, {COMPARISON} on "
                  f"{made_on_text(*ours)}: not compared (another kind of CPU trains other numbers)")
            return None
    if stable(current, block.volatile) == stable(rendered, block.volatile):
        return None
    diff = difflib.unified_diff(stable(current, block.volatile).splitlines(),
                                stable(rendered, block.volatile).splitlines(), "README.md", block.source, lineterm="",
                                n=0)
    return "\n".join(list(diff)[:40])


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
    text = args.readme.read_text()
    new, differs = text, []
    for name in args.names or list(BLOCKS):
        current = block_text(text, name)
        if current is None:
            print(f"{name}: no <!-- generated:{name} --> markers in {args.readme.name}")
            if args.names:
                differs.append(name)
            continue
        try:
            rendered = BLOCKS[name].render(args.root)
        except SourceMissing as e:
            print(f"{name}: {e}; block left as it is")
            continue
        if args.check:
            why = check_block(name, current, rendered)
            if why is not None:
                differs.append(name)
                print(f"{name}: README's block differs from what {BLOCKS[name].source} renders:\n{why}")
        elif current != rendered.rstrip("\n") + "\n":
            new = replace_block(new, name, rendered)
            print(f"{name}: rewritten from {BLOCKS[name].source}")
        else:
            print(f"{name}: unchanged")
    if args.check:
        if differs:
            print(f"differs: {', '.join(differs)} (python dev/readme_blocks.py rewrites them)")
            return 1
        return 0
    if new != text:
        args.readme.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
