"""Write the exact pins of constraints.txt into the conda envs' pip sections (envs/*.yaml).

    python dev/sync_envs.py           # rewrite the pinned versions in place
    python dev/sync_envs.py --check   # exit 1 (listing them) where an env file differs from constraints.txt

constraints.txt is the one place of exact versions. Each env file names the packages it holds; this script only
sets their versions, so that Snakemake, which hashes an env file's text to name its environment, builds a new one
whenever a pin changes. A package an env names that constraints.txt does not pin is an error.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PIN = re.compile(r"^(?P<lead>\s*-\s+)(?P<name>[A-Za-z0-9_.-]+)==(?P<version>[^\s#]+)(?P<rest>.*)$")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def constraints() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[canonical(name)] = version
    return pins


def synced(text: str, pins: dict[str, str], where: str) -> str:
    out = []
    for line in text.splitlines(keepends=True):
        m = PIN.match(line.rstrip("\n"))
        if m:
            name = canonical(m["name"])
            if name not in pins:
                raise SystemExit(f"{where}: {m['name']} is not pinned in constraints.txt")
            line = f"{m['lead']}{m['name']}=={pins[name]}{m['rest']}\n"
        out.append(line)
    return "".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 where an env file differs")
    args = ap.parse_args()
    pins = constraints()
    stale = []
    for path in sorted((ROOT / "envs").glob("*.yaml")):
        text = path.read_text()
        new = synced(text, pins, str(path.relative_to(ROOT)))
        if new != text:
            stale.append(str(path.relative_to(ROOT)))
            if not args.check:
                path.write_text(new)
    if stale:
        print(("differ from constraints.txt: " if args.check else "updated: ") + ", ".join(stale))
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
