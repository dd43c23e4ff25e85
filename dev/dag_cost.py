"""What a target costs on the CPU of the committed default run: its planned jobs times each rule's measured mean.

    python dev/dag_cost.py all_paper [--configfile configs/both_ratios.yaml] [--run docs/results/default_run]
    python dev/dag_cost.py --measured RUN_DIR TARGET ...   # a finished run's own job times instead

Snakemake plans the target from scratch (``-n --forceall``: every job, as a fresh clone runs it); each rule's job
count is multiplied by the mean job time of that rule in the default run's record (``run.json``'s ``rules``; a
rule the default run does not run gets the mean of a measured run given with ``--measured``, or stays unpriced and
is named). The estimate of the wall time divides the job time by the run's cores (2 on the machines the records come
from), which a DAG of long sequential chains does not reach; it is a lower bound, as the default run's own ratio of
job time to wall time shows (printed beside it).
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def planned_jobs(targets: list[str], configfiles: list[str]) -> dict[str, int]:
    """{rule: jobs} of a from-scratch plan of ``targets``."""
    cmd = [sys.executable, "-m", "snakemake", *targets, "-n", "--forceall", "--quiet", "rules"]
    for c in configfiles:
        cmd += ["--configfile", c]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"snakemake -n failed: {out.stderr.strip().splitlines()[-1] if out.stderr else out.returncode}")
    jobs: dict[str, int] = {}
    table = False
    for line in out.stdout.splitlines():
        if line.startswith("job") and "count" in line:
            table = True
            continue
        m = re.match(r"^(\w+)\s+(\d+)$", line.strip())
        if table and m:
            if m.group(1) == "total":
                break
            jobs[m.group(1)] = int(m.group(2))
    return jobs


def measured_means(run_dir: Path) -> dict[str, float]:
    """{rule: mean job seconds} of a run's benchmark files (``benchmarks/<rule>/...tsv``, column ``s``)."""
    sums: dict[str, list[float]] = {}
    for f in (run_dir / "benchmarks").rglob("*.tsv"):
        rows = list(csv.DictReader(f.open(), delimiter="\t"))
        if rows:
            sums.setdefault(f.relative_to(run_dir / "benchmarks").parts[0], []).append(float(rows[-1]["s"]))
    return {rule: sum(v) / len(v) for rule, v in sums.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("targets", nargs="+")
    ap.add_argument("--configfile", action="append", default=[])
    ap.add_argument("--run", default=str(ROOT / "docs" / "results" / "default_run"), help="a published run record")
    ap.add_argument("--measured", action="append", default=[], help="a finished run dir; its rules' means fill gaps")
    args = ap.parse_args(argv)
    record = json.loads((Path(args.run) / "run.json").read_text())
    means = {rule: float(r["mean_seconds"]) for rule, r in record["rules"].items()}
    for run_dir in args.measured:
        for rule, mean in measured_means(Path(run_dir)).items():
            means.setdefault(rule, mean)
    jobs = planned_jobs(args.targets, args.configfile)
    priced = {rule: n * means[rule] for rule, n in jobs.items() if rule in means}
    unpriced = {rule: n for rule, n in jobs.items() if rule not in means and rule != "all"}
    total = sum(priced.values())
    job_s = sum(float(r["seconds"]) for r in record["rules"].values())
    ratio = job_s / float(record["wall_seconds"])
    print(f"{' '.join(args.targets)} {' '.join('--configfile ' + c for c in args.configfile)}".strip())
    print(f"per-rule means from {args.run} ({record['cpu']}), {sum(jobs.values())} jobs planned")
    print("| rule | jobs | mean s | job s |\n| --- | ---: | ---: | ---: |")
    for rule, n in sorted(jobs.items(), key=lambda kv: -priced.get(kv[0], 0)):
        mean = f"{means[rule]:.1f}" if rule in means else "not measured"
        cost = f"{priced[rule]:.0f}" if rule in priced else "–"
        print(f"| {rule} | {n} | {mean} | {cost} |")
    print(f"job time {total:.0f} s ({total / 60:.1f} min) for the priced rules; at the default run's "
          f"{ratio:.2f} jobs in parallel: {total / ratio / 60:.1f} min wall")
    if unpriced:
        print("not priced (no measured mean): " + ", ".join(f"{r} ({n})" for r, n in sorted(unpriced.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
