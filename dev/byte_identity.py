"""Byte-identity of a refactor: build the same results at two commits and compare them file by file.

    python dev/byte_identity.py build COMMIT OUT     # a worktree of COMMIT in OUT/tree; its results under OUT
    python dev/byte_identity.py compare A B          # cmp every file of A's results against B's; exit 1 on a difference

``build`` runs, in a fresh worktree of COMMIT with this checkout's virtual environment (the worktree's package first
on ``PYTHONPATH``):

- the default run (``snakemake --cores all``) and, on its four tiny models, the pruned checkpoints of every other kind
  of cut: value (``drrqr-v``), joint (``drrqr-kv``), a joint split (``drrqr-kv@split``, ``grad-kv@layersplit``) and
  per-layer key budgets (``drrqr@sens``, ``grad@energy``), at 75 %;
- the test workflow's run (``tests/_workflow_run.build``: the default target, ``all_paper``, its budget cells, an
  ``init:`` model and a local checkpoint) with its value and joint cells added.

``compare`` walks both ``results/`` trees and compares every file byte for byte (``filecmp`` with ``shallow=False``,
which is what ``cmp`` does), leaving out the folders that record time or place: ``logs/``, ``benchmarks/``,
Snakemake's ``.snakemake/`` and the speed records (:data:`TIMED`). A JSON, JSON-lines or HDF5 file that differs is
compared again with the entries that record when, how fast, at which commit or in which temporary folder a job ran
masked (:data:`VOLATILE`: wall times, tokens/s, dates, the lm-eval temp folder, the git hash, and the RFT
fingerprint, a hash over the base model's ``pretrain.json`` and its wall time); one equal then is counted "equal but
for time and place", listed by name, and anything else is a difference. Checkpoints (``model.safetensors``,
``config.json``), selections and tables must be equal byte for byte.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("tiny-dn", "tiny-gdn", "tiny-mamba2", "tiny-qwen35")
EXTRA_METHODS = ("drrqr-v", "drrqr-kv", "drrqr-kv@split", "grad-kv@layersplit", "drrqr@sens", "grad@energy")
WF_METHODS = ("drrqr-v", "drrqr-kv", "grad-kv@split")
#: Files that record when or where a job ran, not what it computed (matched on the path's parts).
TIMED = ("logs", "benchmarks", ".snakemake", "speed.json", "run_report.json", "timings.json")
#: Keys of JSON documents and HDF5 attributes that record when, how fast, at which commit or where a job ran.
VOLATILE = re.compile(r"(seconds|_s$|per_s$|^date$|^created$|^time|git_hash|include_path|cache_dir|data_files|"
                      r"config_source|fingerprint)")


#: The two build folders being compared: a path under either reads as "<OUT>" (a local checkpoint's recorded path).
PLACES: list[str] = []


def _masked(doc):
    if isinstance(doc, dict):
        return {k: _masked(v) for k, v in doc.items() if not VOLATILE.search(str(k))}
    if isinstance(doc, list):
        return [_masked(v) for v in doc]
    if isinstance(doc, str):
        for place in PLACES:
            doc = doc.replace(place, "<OUT>")
    return doc


def equal_but_for_time(a: Path, b: Path) -> bool:
    """Whether two JSON, JSON-lines, Parquet or HDF5 files are equal once their :data:`VOLATILE` entries are masked and
    the build folders' paths (:data:`PLACES`) read alike."""
    if a.suffix == ".parquet":
        import pyarrow.parquet as pq

        ta, tb = pq.read_table(a), pq.read_table(b)
        return ta.to_pydict() == tb.to_pydict() and all(
            _masked(json.loads(ta.schema.metadata[k])) == _masked(json.loads(tb.schema.metadata[k]))
            for k in ta.schema.metadata or {} if k == b"statereduce") and \
            set(ta.schema.metadata or {}) == set(tb.schema.metadata or {})
    if a.suffix == ".json":
        return _masked(json.loads(a.read_text())) == _masked(json.loads(b.read_text()))
    if a.suffix == ".jsonl":
        la, lb = a.read_text().splitlines(), b.read_text().splitlines()
        return len(la) == len(lb) and all(_masked(json.loads(x)) == _masked(json.loads(y)) for x, y in zip(la, lb))
    if a.suffix == ".h5":
        import h5py
        import numpy as np

        def same(x, y) -> bool:
            if isinstance(x, np.ndarray):
                return np.array_equal(x, y)
            if isinstance(x, (str, bytes)) and isinstance(y, (str, bytes)):
                x, y = (v.decode() if isinstance(v, bytes) else v for v in (x, y))
                return _masked(x) == _masked(y)
            return x == y

        with h5py.File(a) as fa, h5py.File(b) as fb:
            names = []
            fa.visit(names.append)
            nodes = [("/", fa["/"], fb["/"])]
            for n in names:
                if n not in fb:
                    return False
                nodes.append((n, fa[n], fb[n]))
            for _, x, y in nodes:
                if isinstance(x, h5py.Dataset) and not np.array_equal(x[()], y[()]):
                    return False
                keys = {k for k in (*x.attrs, *y.attrs) if not VOLATILE.search(k)}
                if any(k not in x.attrs or k not in y.attrs or not same(x.attrs[k], y.attrs[k]) for k in keys):
                    return False
        return True
    return False


def run(cmd: list[str], cwd: Path, env: dict) -> None:
    print("+", " ".join(cmd), f"(in {cwd})", flush=True)
    subprocess.run(cmd, cwd=cwd, env=env, check=True)


def build(commit: str, out: Path) -> None:
    out = out.resolve()
    tree = out / "tree"
    out.mkdir(parents=True, exist_ok=True)
    if not tree.exists():
        run(["git", "worktree", "add", "--detach", str(tree), commit], ROOT, os.environ.copy())
    env = dict(os.environ, PYTHONPATH=str(tree))
    py = sys.executable
    run([py, "-m", "snakemake", "--cores", "all"], tree, env)
    extras = [f"results/{m}/{meth}_75/pruned/model.safetensors" for m in MODELS for meth in EXTRA_METHODS]
    run([py, "-m", "snakemake", *extras, "--cores", "all"], tree, env)
    code = (
        "import sys, yaml; from pathlib import Path; sys.path[:0] = ['tests']\n"
        "import _workflow_run as w\n"
        f"root = Path({str(out / 'wf')!r}); root.mkdir(exist_ok=True)\n"
        "cfg = yaml.safe_load(w.CONFIG.read_text())\n"
        "cfg['budgets']['split'] = {'policy': 'split', 'n_samples': 2}\n"
        "w.CONFIG = root / 'config.yaml'; w.CONFIG.write_text(yaml.safe_dump(cfg, sort_keys=False))\n"
        f"w.BUDGET_TARGETS = w.BUDGET_TARGETS + tuple(f'results/wf-dn/{{m}}_50/eval.json' for m in {WF_METHODS!r})\n"
        "w.build(root)\n"
    )
    run([py, "-c", code], tree, env)


def results_of(out: Path) -> dict[str, Path]:
    roots = {"default": out / "tree" / "results", "wf": out / "wf" / "run" / "run" / "results"}
    roots["wf"] = next((p for p in (out / "wf" / "run" / "results", roots["wf"]) if p.exists()), roots["wf"])
    return roots


def files(root: Path) -> dict[str, Path]:
    found = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if p.is_file() and not any(part in TIMED for part in rel.parts):
            found[str(rel)] = p
    return found


def compare(a: Path, b: Path) -> int:
    PLACES[:] = [str(a.resolve()), str(b.resolve())]
    bad = 0
    for name, ra in results_of(a).items():
        rb = results_of(b)[name]
        fa, fb = files(ra), files(rb)
        only = sorted(set(fa) ^ set(fb))
        unequal = [k for k in sorted(set(fa) & set(fb)) if not filecmp.cmp(fa[k], fb[k], shallow=False)]
        timed = [k for k in unequal if equal_but_for_time(fa[k], fb[k])]
        differ = [k for k in unequal if k not in timed]
        ckpts = [k for k in fa if k.endswith("model.safetensors")]
        kinds = sorted({Path(k).name for k in timed})
        print(f"{name}: {len(fa)} files compared ({len(ckpts)} checkpoints): {len(fa) - len(unequal) - len(only)} "
              f"byte-identical, {len(timed)} equal but for time and place ({', '.join(kinds) or 'none'}), "
              f"{len(differ)} differ, {len(only)} in one only")
        for k in differ:
            print(f"  differ: {k}")
        for k in only:
            print(f"  only in {'A' if k in fa else 'B'}: {k}")
        bad += len(differ) + len(only)
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("commit")
    b.add_argument("out", type=Path)
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "build":
        build(args.commit, args.out)
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
