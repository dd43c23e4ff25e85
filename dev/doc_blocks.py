"""Rewrite the generated blocks of the docs pages from the documents their numbers come from; ``--check`` names any
that differ.

    python dev/doc_blocks.py [--check] [PAGE.md ...]

A block is the lines between ``<!-- generated: COMMAND -->`` and ``<!-- /generated -->`` in a page of ``docs/`` or
``docs/records/`` (all of them by default). COMMAND is a ``python -m statereduce.speed.generate --tables DOC ...`` or
``--summary DOC ...`` call, or a ``python -m statereduce.serve tables DOC`` call, on committed documents, run from the
repository root; the block is what it prints. No other command is run, and nothing outside the blocks is touched.

Each problem is one line naming the page and the block's command, and makes the command exit 1: a command that is
not one of the two, a document it names that is missing, an unclosed block, and (``--check``) a block that differs from
what its command prints.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPEN = re.compile(r"^<!-- generated: (?P<command>python -m statereduce\.(speed\.generate|serve) .+?) -->$")
ANY_OPEN = re.compile(r"^<!-- generated: (?P<command>.+?) -->$")
CLOSE = "<!-- /generated -->"
RENDERERS = ("--tables", "--summary")


def pages(root: Path = ROOT) -> list[Path]:
    """Every Markdown page of ``docs/`` and ``docs/records/`` that holds a block."""
    found = sorted((root / "docs").glob("*.md")) + sorted((root / "docs" / "records").glob("*.md"))
    return [p for p in found if "<!-- generated: " in p.read_text()]


def render(command: str, root: Path = ROOT) -> str:
    """What ``command`` prints, run in-process from ``root``.

    Raises:
        ValueError: one line, for a command other than ``--tables``/``--summary`` of statereduce.speed.generate,
            or a document it names that is missing.
    """
    argv = shlex.split(command)[3:]
    if shlex.split(command)[2] == "statereduce.serve":
        return _render_serve(command, argv, root)
    if not argv or argv[0] not in RENDERERS or len(argv) < 2 or any(a.startswith("-") for a in argv[1:]):
        raise ValueError(f"block command {command!r} is not `python -m statereduce.speed.generate "
                         f"{{{'|'.join(RENDERERS)}}} DOC.json ...`")
    missing = [a for a in argv[1:] if not (root / a).is_file()]
    if missing:
        raise ValueError(f"block command {command!r}: {missing[0]} not found")
    from statereduce.speed import generate

    out = io.StringIO()
    cwd = os.getcwd()
    try:
        os.chdir(root)
        with contextlib.redirect_stdout(out):
            rc = generate.main(argv)
    finally:
        os.chdir(cwd)
    if rc:
        raise ValueError(f"block command {command!r} failed (exit {rc})")
    return out.getvalue()


def _render_serve(command: str, argv: list[str], root: Path) -> str:
    """What ``python -m statereduce.serve tables DOC`` prints."""
    if len(argv) != 2 or argv[0] != "tables":
        raise ValueError(f"block command {command!r} is not `python -m statereduce.serve tables DOC.json`")
    if not (root / argv[1]).is_file():
        raise ValueError(f"block command {command!r}: {argv[1]} not found")
    from statereduce.serve import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main(["tables", str(root / argv[1])])
    if rc:
        raise ValueError(f"block command {command!r} failed (exit {rc})")
    return out.getvalue()


def rewrite(page: Path, root: Path = ROOT) -> tuple[str, list[str]]:
    """The page with every block re-rendered, and the problems (one line each; a block with a problem is kept)."""
    lines = page.read_text().splitlines(keepends=True)
    out: list[str] = []
    problems: list[str] = []
    i = 0
    name = page.relative_to(root) if page.is_relative_to(root) else page
    while i < len(lines):
        line = lines[i]
        out.append(line)
        i += 1
        m = ANY_OPEN.match(line.rstrip("\n"))
        if not m:
            continue
        end = next((j for j in range(i, len(lines)) if lines[j].rstrip("\n") == CLOSE), None)
        if end is None:
            problems.append(f"{name}: block `{m['command']}` has no closing {CLOSE}")
            out += lines[i:]
            break
        try:
            if not OPEN.match(line.rstrip("\n")):
                raise ValueError(f"block command {m['command']!r} is neither `python -m statereduce.speed.generate "
                                 "...` nor `python -m statereduce.serve tables ...`")
            body = "\n" + render(m["command"], root) + "\n"
        except ValueError as e:
            problems.append(f"{name}: {e}")
            body = "".join(lines[i:end])
        out.append(body)
        out.append(lines[end])
        i = end + 1
    return "".join(out), problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="write nothing; name every block that differs")
    p.add_argument("pages", nargs="*", type=Path, help="pages to rewrite (default: every page of docs/ with a block)")
    args = p.parse_args(argv)
    problems: list[str] = []
    for page in args.pages or pages():
        page = page.resolve()
        text, found = rewrite(page)
        problems += found
        if text != page.read_text():
            if args.check:
                problems.append(f"{page.relative_to(ROOT)}: a generated block differs from what its command prints "
                                f"(python dev/doc_blocks.py rewrites it)")
            else:
                tmp = page.with_suffix(page.suffix + ".tmp")
                tmp.write_text(text)
                tmp.replace(page)
    for line in problems:
        print(line, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
