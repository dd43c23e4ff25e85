"""What each workflow job spends before its real work: its start-up, per rule script, on this CPU.

    python dev/job_startup.py [OUT.json] [--before REF] [--after REF] [--repeat N] [--keep DIR]

Copies the workflow (``Snakefile``, ``rules/``, ``workflow_scripts/``, ``statereduce/``, ``schemas/``, ``envs/``,
``report/``) of commit ``--after`` (default ``HEAD``; ``--after worktree``: this checkout's files as they are), and with
``--before`` the same files of commit REF, into a temporary folder each, and runs there, with the copy's own package
(``PYTHONPATH``), the tests' workflow config (``tests/workflow/config.yaml``) plus a tiny Mamba-2, a split budget, a
study and a local checkpoint: its default target (DRRQR only), ``all_paper``, a budget cell, a joint cut split by
calibration loss, the ``init:`` model's chain and the Mamba-2's, on two cores, keeping Snakemake's copies of the rule
scripts (``--skip-script-cleanup``: each holds its job's ``snakemake`` object).
Then, one job per rule script (per model family where the rule loads a model), in a fresh interpreter, the jobs of the
two commits in turns (what else the machine does touches both alike; best with nothing else running):

* the import phase (Snakemake's preamble and the script's statements up to its first real work: its imports and
  ``runtime.start``): the median over ``--repeat`` runs of the seconds from process start to its end;
* the whole job under ``python -X importtime``, ``--repeat`` times, the run of median import seconds kept: the seconds
  of imports in the import phase and during the work (where the package imports lazily), per top-level package, and
  which of the heavy packages it loads.

A job's start-up is its import phase plus the imports during its work. Rules that run no job here (the speed rules
need CUDA) get their import phase measured with a stand-in ``snakemake`` object. OUT.json (default
``docs/results/job_startup_<vector extension>.json``) gets the CPU kind (``statereduce.core.runtime.cpu_kind``), the
date, the commits and the table per commit; OUT.md the same as one Markdown table, the commits side by side.
"""

from __future__ import annotations

import argparse
import ast
import datetime as dt
import io
import json
import os
import pickle
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ["Snakefile", "rules", "workflow_scripts", "statereduce", "schemas", "envs", "report",
            "tests/workflow/config.yaml"]
"""What a measured copy holds."""
HEAVY = ("torch", "transformers", "fla", "triton", "peft", "accelerate", "lm_eval", "datasets", "matplotlib", "pandas")
"""The packages whose loading the record names per job."""
PREAMBLE_END = "######## snakemake preamble end #########"
MARK = "job-startup: import phase done"
MODEL_SCRIPTS = {"pretrain", "init_random", "qk_weights", "calibrate", "grad_scores", "eval_baseline", "prune", "rft",
                 "rank", "rank_baseline"}
"""The rule scripts whose jobs load a model: measured once per model family (the others once)."""
MAMBA2 = {
    "family": "mamba2",
    "pretrain": {"corpus": "embedded",
                 "arch": {"hidden_size": 64, "num_hidden_layers": 2, "num_heads": 4, "head_dim": 32, "expand": 2,
                          "n_groups": 2, "state_size": 16, "chunk_size": 32}},
}
"""A tiny Mamba-2 beside the tests' DeltaNet (train, calibration, eval and RFT settings copied from it)."""


def import_phase(source: str) -> int:
    """The number of lines of ``source`` (a rule script) before its first real work: its docstring, imports and the
    ``log = start(...)`` call (:func:`statereduce.core.runtime.start`), up to the first other statement."""
    end = 0
    for node in ast.parse(source).body:
        docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        starts = (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                  and getattr(node.value.func, "id", None) == "start")
        if not (docstring or starts or isinstance(node, (ast.Import, ast.ImportFrom))):
            break
        end = node.end_lineno
    return end


def stand_in(script: Path, log: Path) -> str:
    """The import phase of ``script`` with a stand-in ``snakemake`` object (its log, one thread): for a rule that ran
    no job, and for the tests that check what a script's imports load."""
    lines = script.read_text().splitlines()
    head = f"import types\nsnakemake = types.SimpleNamespace(log=[{str(log)!r}], threads=1)\n"
    return head + "\n".join(lines[: import_phase(script.read_text())]) + "\n"


def copy_workflow(dest: Path, ref: str | None) -> str:
    """The workflow files of commit ``ref`` (None: this checkout's files as they are) into ``dest``; returns the commit
    (with the changed files named for a checkout whose workflow files differ from its commit)."""
    dest.mkdir(parents=True)
    git = ["git", "-C", str(ROOT)]
    commit = subprocess.run([*git, "rev-parse", ref or "HEAD"], check=True, capture_output=True, text=True).stdout
    commit = commit.strip()[:12]
    if ref is not None:
        archive = subprocess.run([*git, "archive", ref, *WORKFLOW], check=True, capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(dest, filter="data")
        return commit
    for name in WORKFLOW:
        src, out = ROOT / name, dest / name
        out.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, out, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, out)
    dirty = subprocess.run([*git, "status", "--porcelain", "--", *WORKFLOW], check=True, capture_output=True,
                           text=True).stdout.splitlines()
    return commit + (f" with changes to {', '.join(line[3:] for line in dirty)}" if dirty else "")


def measurement_config(work: Path) -> dict:
    """The tests' workflow config with a tiny Mamba-2, a split budget and a study added."""
    cfg = yaml.safe_load((work / "tests" / "workflow" / "config.yaml").read_text())
    dn = cfg["models"]["wf-dn"]
    m2 = json.loads(json.dumps(MAMBA2))
    m2["pretrain"]["train"] = dn["pretrain"]["train"]
    m2.update({k: dn[k] for k in ("calibration", "eval", "rft")})
    cfg["models"]["wf-m2"] = m2
    cfg["budgets"]["split"] = {"policy": "split", "n_samples": 2}
    cfg["studies"] = {"scoring": {"models": ["wf-dn"], "selectors": ["l1"], "pct": 50}}
    cfg["targets"]["methods"] = ["drrqr"]  # one chain per target: each rule runs a job, and few run twice
    return cfg


TARGETS = ["all", "all_paper", "results/wf-dn/drrqr@sens_50/eval.json", "results/wf-dn/drrqr-kv@split_50/eval.json",
           "results/wf-init/drrqr_50/pruned/eval.json", "results/wf-m2/grad_50/eval.json",
           "results/wf-m2/drrqr_50/rank.json"]
"""What the measurement runs (the local checkpoint's source.json follows in a second run)."""


def env_for(work: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(work), "HF_HUB_OFFLINE": "1", "PYTHONDONTWRITEBYTECODE": ""}


def run_workflow(work: Path) -> None:
    """The measurement's jobs, in two Snakemake runs (the second adds a local checkpoint: the first one's model)."""
    cfg = measurement_config(work)
    base = [sys.executable, "-m", "snakemake", "-s", str(work / "Snakefile"), "--directory", str(work), "--cores", "2",
            "--skip-script-cleanup"]
    for targets in (TARGETS, ["results/wf-local/base/source.json"]):
        if targets[0].startswith("results/wf-local"):
            cfg["models"]["wf-local"] = {"family": "delta_net", "local": str(work / "results" / "wf-dn" / "base"),
                                         "calibration": cfg["models"]["wf-dn"]["calibration"]}
        (work / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        out = subprocess.run([*base, *targets], cwd=work, env=env_for(work), capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"snakemake failed in {work}:\n{(out.stdout + out.stderr)[-4000:]}")


def kept_jobs(work: Path, cfg: dict) -> dict[tuple[str, str | None], tuple[Path, dict]]:
    """One kept job script per (rule script, model family), the wildcards preferring drrqr at 50 %:
    ``{(script, family): (path, wildcards)}``; family None for rules of no model."""
    found: dict[tuple[str, str | None], list[tuple[tuple, Path, dict]]] = {}
    for path in sorted((work / ".snakemake" / "scripts").glob("tmp*.py")):
        script = path.name.split(".", 1)[1][: -len(".py")]
        text = path.read_text()
        preamble = text[: text.index(PREAMBLE_END)]
        call = next(n for n in ast.walk(ast.parse(preamble)) if isinstance(n, ast.Call)
                    and getattr(n.func, "attr", None) == "loads")
        job = pickle.loads(call.args[0].value)
        wildcards = dict(job.wildcards.items())
        model = wildcards.get("model")
        family = cfg["models"][model]["family"] if script in MODEL_SCRIPTS and model in cfg["models"] else None
        rank = (wildcards.get("method") != "drrqr", str(wildcards.get("pct")) != "50", model != "wf-dn",
                sorted(wildcards.items()))
        found.setdefault((script, family), []).append((rank, path, wildcards))
    return {key: min(jobs, key=lambda j: j[0])[1:] for key, jobs in found.items()}


def run_timed(script: Path, work: Path, mark_file: Path) -> float:
    """Seconds from starting a fresh interpreter on ``script`` to the time it writes into ``mark_file``."""
    mark_file.unlink(missing_ok=True)
    t0 = time.time()
    out = subprocess.run([sys.executable, str(script)], cwd=work, env=env_for(work), capture_output=True, text=True)
    if out.returncode != 0 or not mark_file.is_file():
        raise RuntimeError(f"the import phase failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return float(mark_file.read_text()) - t0


def importtime(stderr: str) -> tuple[list[tuple[int, int, str]], list[tuple[int, int, str]]]:
    """``-X importtime`` lines (self µs, depth, module) before and after the import phase's mark."""
    phases: list[list[tuple[int, int, str]]] = [[], []]
    phase = 0
    for line in stderr.splitlines():
        if line.startswith(MARK):
            phase = 1
            continue
        m = re.match(r"import time:\s+(\d+) \|\s+\d+ \| ( *)(\S+)", line)
        if m:
            phases[phase].append((int(m.group(1)), len(m.group(2)) // 2, m.group(3)))
    return phases[0], phases[1]


def job_scripts(work: Path, path: Path | None, script: str) -> tuple[Path, Path]:
    """The two scripts one job is measured with, written under ``work/.job_startup/``: its import phase, which writes
    the time it ends to ``mark``, and the whole job with a line on stderr where the import phase ends. ``path`` is the
    kept job (Snakemake's preamble and the rule script); None: the script's import phase with a stand-in object."""
    source = (work / "workflow_scripts" / f"{script}.py").read_text()
    n = import_phase(source)
    tmp = work / ".job_startup"
    tmp.mkdir(exist_ok=True)
    if path is None:
        preamble, lines = "", stand_in(work / "workflow_scripts" / f"{script}.py", tmp / f"{script}.log").splitlines()
        n = len(lines)
    else:
        text = path.read_text()
        cut = text.index(PREAMBLE_END) + len(PREAMBLE_END) + 1
        preamble, lines = text[:cut], text[cut:].splitlines()
    body = "\n".join(lines[:n]) + "\n"
    done = f"\nopen({str(tmp / 'mark')!r}, 'w').write(repr(__import__('time').time())); __import__('os')._exit(0)\n"
    mark = f"__import__('os').write(2, b{MARK + chr(10)!r})\n"
    phase_script, job_script = tmp / f"phase.{script}.py", tmp / f"job.{script}.py"
    phase_script.write_text(preamble + body + done)
    job_script.write_text(preamble + body + mark + "\n".join(lines[n:]) + "\n")
    return phase_script, job_script


def sample(work: Path, path: Path | None, script: str) -> dict:
    """One measurement of a job (:func:`job_scripts`): the import phase timed, and the whole job under
    ``-X importtime``."""
    phase_script, job_script = job_scripts(work, path, script)
    phase = run_timed(phase_script, work, phase_script.parent / "mark")
    t0 = time.time()
    out = subprocess.run([sys.executable, "-X", "importtime", str(job_script)], cwd=work, env=env_for(work),
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"job {path or script} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    before, after = importtime(out.stderr)
    return {"phase": phase, "seconds": time.time() - t0, "before": before, "after": after,
            "imports": sum(us for us, _, _ in before + after)}


def summary(samples: list[dict], job: bool) -> dict:
    """A job's row from its samples: the median import phase, and the run of median import seconds."""
    run = sorted(samples, key=lambda r: r["imports"])[len(samples) // 2]
    before, after = run["before"], run["after"]
    per_package: Counter[str] = Counter()
    for us, _, name in before + after:
        per_package[name.split(".")[0]] += us
    heavy = [(p, name) for _, _, name in before + after for p in HEAVY if name == p or name.startswith(p + ".")]
    in_phase = {p for _, _, name in before for p in HEAVY if name == p or name.startswith(p + ".")}
    phase, work_imports = statistics.median(r["phase"] for r in samples), sum(us for us, _, _ in after) / 1e6
    return {
        "import_phase_s": round(phase, 3),
        "work_imports_s": round(work_imports, 3),
        "startup_s": round(phase + work_imports, 3),
        "imports_s": round(sum(per_package.values()) / 1e6, 3),
        "job_s": round(run["seconds"], 2) if job else None,
        "packages": {name: round(us / 1e6, 3) for name, us in per_package.most_common(8)},
        "heavy_in_import_phase": sorted(in_phase),
        "heavy_in_job": sorted({p for p, _ in heavy}),
    }


def build(ref: str | None, keep: Path | None) -> dict:
    """A copy of the workflow (of commit ``ref``, or this checkout's files) with the measurement's run made in it."""
    parent = Path(tempfile.mkdtemp(prefix="job-startup-", dir=keep))
    work = parent / "work"
    commit = copy_workflow(work, ref)
    print(f"{commit}: running the workflow in {work}", flush=True)
    t0 = time.time()
    run_workflow(work)
    print(f"  the run took {time.time() - t0:.0f} s", flush=True)
    jobs = kept_jobs(work, yaml.safe_load((work / "config.yaml").read_text()))
    scripts = {p.stem for p in (work / "workflow_scripts").glob("*.py")}
    alone = {(s, None): (None, None) for s in sorted(scripts - {script for script, _ in jobs})}
    return {"parent": parent, "work": work, "commit": commit, "jobs": {**jobs, **alone}}


def measure(builds: list[dict], repeat: int) -> list[list[dict]]:
    """Every job of every build, the builds' jobs of one rule script (and family) measured in turns, ``repeat`` times
    (so that what else the machine does touches them alike): a row per job and build."""
    keys = sorted({k for b in builds for k in b["jobs"]}, key=lambda k: (k[0], k[1] or ""))
    rows: list[list[dict]] = [[] for _ in builds]
    for script, family in keys:
        have = [(i, b) for i, b in enumerate(builds) if (script, family) in b["jobs"]]
        samples: dict[int, list[dict]] = {i: [] for i, _ in have}
        for _ in range(repeat):
            for i, b in have:
                samples[i].append(sample(b["work"], b["jobs"][script, family][0], script))
        for i, b in have:
            path, wildcards = b["jobs"][script, family]
            rows[i].append({"script": script, "family": family, "wildcards": wildcards,
                            **summary(samples[i], path is not None)})
        print(f"  {script:18s} {family or '':10s} start-up s: "
              + ", ".join(f"{rows[i][-1]['startup_s']:.2f}" for i, _ in have), flush=True)
    return rows


def label(row: dict) -> str:
    family = f" ({row['family']})" if row["family"] else ""
    alone = " (import phase only: no job here)" if row["wildcards"] is None else ""
    return f"`{row['script']}`{family}{alone}"


def markdown(doc: dict) -> str:
    """The record as Markdown: the start-up per rule script (and family) of each checkout, side by side."""
    runs = doc["runs"]
    lines = [f"# Job start-up per rule script ({doc['cpu']})", "",
             f"Written by `{doc['command']}` on {doc['date']} (Python {doc['python']}, {doc['cores']} cores). "
             "Start-up: seconds from process start to the end of the script's imports, plus the imports during its "
             "work; imports: `python -X importtime` over the whole job, per top-level package; each the median of "
             f"{doc['repeat']} runs.", ""]
    head = " | ".join(f"{r['label']} ({r['commit']}): start-up s" for r in runs)
    lines += [f"| rule script | {head} | heavy packages loaded ({runs[-1]['label']}) | largest imports, s "
              f"({runs[-1]['label']}) |", "| --- |" + " ---: |" * len(runs) + " --- | --- |"]
    keys = [(r["script"], r["family"]) for r in runs[-1]["rows"]]
    for key in keys:
        cells = []
        for run in runs:
            row = next((r for r in run["rows"] if (r["script"], r["family"]) == key), None)
            cells.append(f"{row['startup_s']:.2f}" if row else "–")
        last = next(r for r in runs[-1]["rows"] if (r["script"], r["family"]) == key)
        top = ", ".join(f"{k} {v:.2f}" for k, v in list(last["packages"].items())[:5])
        lines.append(f"| {label(last)} | {' | '.join(cells)} | {', '.join(last['heavy_in_job']) or 'none'} | {top} |")
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", type=Path)
    ap.add_argument("--before", metavar="REF", help="also measure the workflow of commit REF, first")
    ap.add_argument("--after", metavar="REF", default="HEAD",
                    help="the commit measured (default HEAD; 'worktree': this checkout's files as they are)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each import phase and each job (the median is kept)")
    ap.add_argument("--keep", type=Path, help="build the runs under this folder and keep them")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from statereduce.core.runtime import cpu_kind

    cpu = cpu_kind()
    width = re.search(r"\((AVX\d*)\)$", cpu)
    out = args.out or ROOT / "docs" / "results" / f"job_startup_{(width.group(1) if width else 'cpu').lower()}.json"
    after = None if args.after == "worktree" else args.after
    named = ([("before", args.before)] if args.before else []) + [("after", after)]
    builds = [build(ref, args.keep) for _, ref in named]
    print("measuring", flush=True)
    rows = measure(builds, args.repeat)
    runs = [{"label": name, "commit": b["commit"], "rows": r} for (name, _), b, r in zip(named, builds, rows)]
    if args.keep is None:
        for b in builds:
            shutil.rmtree(b["parent"])
    options = (f" --before {args.before}" if args.before else "") + (f" --after {args.after}" if args.after != "HEAD"
                                                                      else "")
    doc = {"command": f"python dev/job_startup.py{options}",
           "cpu": cpu, "date": dt.date.today().isoformat(), "python": sys.version.split()[0],
           "cores": os.cpu_count(), "repeat": args.repeat, "runs": runs}
    out.write_text(json.dumps(doc, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(doc))
    print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
