"""The test suite's measured figures in docs/records/testing.md: coverage, planted faults and times, from the runs that
made them.

    python dev/testing_figures.py time LABEL -- COMMAND...   # run COMMAND, record its wall time and CPU kind
    python dev/testing_figures.py render                      # print the figures block from docs/results/tests/
    python dev/testing_figures.py write                       # put it into docs/records/testing.md between its markers
    python dev/testing_figures.py check                       # exit 1 if docs/records/testing.md's block differs

The documents in docs/results/tests/ come from `dev/coverage_run.py` (`coverage_<when>_<tier>.json`; `<tier>_copies`
with its `--copies`),
`dev/planted_faults.py` (`faults_<when>.json`) and `time` above (`timings.json`); `<when>` is `before` or `after`
(the checkouts docs/records/testing.md names), `<tier>` `default` or `all`.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results" / "tests"
DOC = ROOT / "docs" / "records" / "testing.md"
BEGIN, END = "<!-- testing-figures: begin (dev/testing_figures.py write) -->", "<!-- testing-figures: end -->"


def cpu_kind() -> str:
    """The CPU's model name and torch's CPU capability (they set speed and trained numbers)."""
    name = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")), platform.processor())
    capability = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                                capture_output=True, text=True).stdout.strip()
    return f"{name}, {len(os.sched_getaffinity(0))} cores, torch CPU capability {capability}"


def phases(output: str) -> list[dict]:
    """The commands `.ci/run` echoed (``+ COMMAND``) with the seconds it printed after each (``(N s)``)."""
    found, command = [], None
    for line in output.splitlines():
        if line.startswith("+ "):
            command = line[2:].strip()
        elif command is not None and (m := re.fullmatch(r"\((\d+) s\)", line.strip())):
            found.append({"command": command, "wall_s": int(m.group(1))})
            command = None
    return found


def record_time(label: str, command: list[str]) -> int:
    start = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:  # shown as it comes (a whole .ci/run takes most of an hour)
        sys.stdout.write(line)
        lines.append(line)
    proc.wait()
    wall, output = time.monotonic() - start, "".join(lines)
    summary = next((line.strip("= ") for line in reversed(output.splitlines()) if " in " in line and
                    re.search(r"\d+ (passed|failed)", line)), "")
    path = RESULTS / "timings.json"
    doc = json.loads(path.read_text()) if path.exists() else {}
    doc[label] = {"command": " ".join(command), "cwd": os.getcwd(), "exit_status": proc.returncode,
                  "wall_s": round(wall, 1), "pytest": summary, "cpu": cpu_kind(),
                  "date": time.strftime("%Y-%m-%d"), **({"phases": found} if (found := phases(output)) else {})}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(sorted(doc.items())), indent=1) + "\n")
    print(f"{label}: {wall:.0f} s, exit {proc.returncode}")
    return proc.returncode


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {round(seconds % 60):02d} s"


def render() -> str:
    lines = ["| coverage of `statereduce/` and `workflow_scripts/` | lines | branches |", "| --- | --- | --- |"]
    for when in ("before", "after"):
        for tier, name in (("default", "default tier"), ("all", "all tiers"),
                           ("all_copies", "all tiers, workflow copies counted (`--copies`)")):
            path = RESULTS / f"coverage_{when}_{tier}.json"
            if not path.exists():
                continue
            d = json.loads(path.read_text())
            lines.append(f"| {when}, {name} | {d['lines']['covered']:,} of {d['lines']['all']:,} "
                         f"({d['lines']['percent']:.2f} %) | {d['branches']['covered']:,} of {d['branches']['all']:,} "
                         f"({d['branches']['percent']:.2f} %) |")
    faults = {when: json.loads(p.read_text()) for when in ("before", "after")
              if (p := RESULTS / f"faults_{when}.json").exists()}
    if faults:
        ids = [f["id"] for f in next(iter(faults.values()))["faults"]]
        lines += ["", "| planted fault | file | " + " | ".join(faults) + " |",
                  "| --- | --- | " + " | ".join("---" for _ in faults) + " |"]
        by_id = {when: {f["id"]: f for f in doc["faults"]} for when, doc in faults.items()}
        for fid in ids:
            first = by_id[next(iter(faults))][fid]
            cells = []
            for when in faults:
                f = by_id[when].get(fid)
                cells.append("—" if f is None else ("caught" if f.get("caught") is True else
                                                    "**missed**" if f.get("caught") is False else "error"))
            lines.append(f"| `{fid}` | `{first['path']}` | " + " | ".join(cells) + " |")
        lines.append("| caught | | " + " | ".join(f"{d['caught']} of {d['total']}" for d in faults.values()) + " |")
    path = RESULTS / "timings.json"
    if path.exists():
        lines += ["", "| run | command | tests | wall time | CPU |", "| --- | --- | --- | --- | --- |"]
        timings = json.loads(path.read_text())
        for label, t in timings.items():
            lines.append(f"| {label} | `{t['command']}` | {t['pytest']} | {_minutes(t['wall_s'])} | {t['cpu']} |")
        staged = {label: t["phases"] for label, t in timings.items() if t.get("phases")}
        if staged:
            lines += ["", "| run | its command | wall time |", "| --- | --- | --- |"]
            for label, found in staged.items():
                lines += [f"| {label} | `{p['command']}` | {_minutes(p['wall_s'])} |" for p in found]
    return "\n".join(lines) + "\n"


def _block(text: str) -> tuple[int, int]:
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{DOC.relative_to(ROOT)} has no '{BEGIN}' ... '{END}' block")
    return text.index(BEGIN) + len(BEGIN) + 1, text.index(END)


def main(argv: list[str]) -> int:
    if argv[:1] == ["time"] and len(argv) >= 4 and argv[2] == "--":
        return record_time(argv[1], argv[3:])
    if argv == ["render"]:
        sys.stdout.write(render())
        return 0
    if argv in (["write"], ["check"]):
        text = DOC.read_text()
        a, b = _block(text)
        new = text[:a] + render() + text[b:]
        if argv == ["write"]:
            DOC.write_text(new)
            return 0
        if new != text:
            print(f"{DOC.relative_to(ROOT)}: the figures block differs from docs/results/tests/ "
                  "(python dev/testing_figures.py write)")
            return 1
        return 0
    print(__doc__.strip().splitlines()[2].strip() + " | render | write | check")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
