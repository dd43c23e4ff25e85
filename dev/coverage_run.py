"""Line and branch coverage of `statereduce/` and `workflow_scripts/` under a pytest run, subprocesses included.

    python dev/coverage_run.py [--copies] OUT.json [PYTEST ARGS...]   # e.g. OUT.json, or OUT.json -m "workflow or slow"

coverage.py (configured in pyproject.toml: branch, parallel, `patch = ["subprocess"]`) measures pytest and every
Python process it starts: fresh-process reloads, `python -m snakemake` and the jobs Snakemake runs. Snakemake runs a
rule's `script:` from a copy, `.snakemake/scripts/tmpXXXX.<name>.py` in the job's folder, made of a three-line preamble
and the script's text; this maps the copies' lines back onto `workflow_scripts/<name>.py`. With `--copies` the files of
the workflow copies the tests run (the workflow tier's run among them) count as the repository's files they were
copied from. OUT.json gets the totals
(lines and branches, covered and all), per-file figures, the pytest command and its exit status and wall time;
OUT.coverage the merged data.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import coverage

ROOT = Path(__file__).resolve().parents[1]
PREAMBLE_LINES = 3  # snakemake.script.PythonScript.generate_preamble: start marker, one minified line, end marker
COPY = re.compile(r"/\.snakemake/scripts/tmp[^/.]+\.(?P<name>[^/]+\.py)$")


def _shift(line: int) -> int | None:
    """A line (or, negative, a code object's first line in an arc) of a script copy on the original script."""
    if line > 0:
        return line - PREAMBLE_LINES if line > PREAMBLE_LINES else None
    return -max(-line - PREAMBLE_LINES, 1)


def _canonical(path: str, copies: bool = False) -> str | None:
    """The repository file a measured path stands for, or None for code outside the repository. With ``copies``, a
    file of a workflow copy (``tests/_snakemake.py``'s ``copy_workflow``: the workflow tier's run and the copies
    tests edit) stands for the repository's file it was copied from while its text still begins with that file's
    (tests only append to the files they edit), so that its lines map one to one."""
    match = COPY.search(path)
    if match:
        return str(ROOT / "workflow_scripts" / match["name"])
    for part in ("statereduce", "workflow_scripts"):
        marker = f"/{part}/"
        if marker not in path:
            continue
        target = ROOT / part / path.rsplit(marker, 1)[1]
        if path.startswith(str(ROOT) + "/"):
            return str(ROOT / part / path.split(marker, 1)[1])
        copy = Path(path)
        if copies and target.is_file() and copy.is_file() and copy.read_bytes().startswith(target.read_bytes()):
            return str(target)
    return None


def merge(data_dir: Path, out_file: Path, copies: bool = False) -> coverage.CoverageData:
    """Combine the parallel data files of `data_dir` into `out_file`, with script copies mapped onto their scripts
    (and with ``copies`` the files of workflow copies onto the repository's: :func:`_canonical`)."""
    raw = coverage.Coverage(data_file=str(data_dir / ".coverage"), config_file=str(ROOT / "pyproject.toml"))
    raw.combine(data_paths=[str(data_dir)], keep=False)
    data = raw.get_data()
    merged = coverage.CoverageData(basename=str(out_file))
    arcs: dict[str, set] = {}
    for path in data.measured_files():
        target = _canonical(path, copies)
        if target is None or not Path(target).exists():
            continue
        shifted = set()
        for a, b in data.arcs(path) or ():
            a2, b2 = (_shift(a), _shift(b)) if COPY.search(path) else (a, b)
            if a2 is not None and b2 is not None:
                shifted.add((a2, b2))
        arcs.setdefault(target, set()).update(shifted)
    merged.add_arcs({path: sorted(pairs) for path, pairs in arcs.items()})
    merged.write()
    return merged


def totals(out_file: Path) -> dict:
    """coverage.py's JSON report of the merged data: totals and per-file figures of the repository's two folders."""
    cov = coverage.Coverage(data_file=str(out_file), config_file=str(ROOT / "pyproject.toml"))
    cov.load()
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "coverage.json"
        files = sorted(str(path) for part in ("statereduce", "workflow_scripts") for path in (ROOT / part).rglob("*.py"))
        cov.json_report(morfs=files, outfile=str(report), ignore_errors=True)  # files no test ran count, at 0 %
        doc = json.loads(report.read_text())
    files = {}
    for path, info in doc["files"].items():
        s = info["summary"]
        files[str(Path(path).resolve().relative_to(ROOT))] = {
            k: s[k] for k in ("covered_lines", "num_statements", "covered_branches", "num_branches")}
    t = doc["totals"]
    return {"lines": {"covered": t["covered_lines"], "all": t["num_statements"],
                      "percent": round(100 * t["covered_lines"] / t["num_statements"], 2)},
            "branches": {"covered": t["covered_branches"], "all": t["num_branches"],
                         "percent": round(100 * t["covered_branches"] / t["num_branches"], 2)},
            "files": dict(sorted(files.items()))}


def main(argv: list[str]) -> int:
    copies = argv[:1] == ["--copies"]
    argv = argv[1:] if copies else argv
    if not argv or argv[0].startswith("-"):
        print(__doc__.strip().splitlines()[2].strip())
        return 2
    out = Path(argv[0]).resolve()
    pytest_args = argv[1:]
    with tempfile.TemporaryDirectory(prefix="statereduce-coverage-") as tmp:
        env = dict(os.environ, STATEREDUCE_COVERAGE_DIR=tmp)
        command = [sys.executable, "-m", "coverage", "run", f"--rcfile={ROOT / 'pyproject.toml'}", "-m", "pytest",
                   *pytest_args]
        start = time.monotonic()
        status = subprocess.run(command, cwd=ROOT, env=env).returncode
        wall = time.monotonic() - start
        merged = out.with_suffix(".coverage")  # kept: `coverage combine` of two such files gives their union
        merge(Path(tmp), merged, copies)
        doc = {"pytest": ["pytest", *pytest_args], "exit_status": status, "wall_s": round(wall, 1),
               "workflow_copies_counted": copies, **totals(merged)}
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"lines {doc['lines']['covered']}/{doc['lines']['all']} ({doc['lines']['percent']} %), branches "
          f"{doc['branches']['covered']}/{doc['branches']['all']} ({doc['branches']['percent']} %); pytest exit "
          f"{status} in {wall:.0f} s -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
