"""The structure counts that issue reviews quote, measured the same way each time.

    python dev/structure_counts.py [ROOT]

Prints, for the package ``statereduce/`` and ``workflow_scripts/`` of ROOT (default: this checkout):

- functions longer than 80 lines (``def`` to its last line, decorators and docstring included), longest first;
- ``import`` statements inside a function body, and the functions that hold them;
- ``isinstance(..., dict)`` / ``isinstance(..., int)`` branches in the package (type branches on a width);
- lines of ``docs/*.md`` (the manual; the experiment and record folders below docs/ are not counted).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def inner_imports(fn: ast.AST) -> int:
    n = 0
    for node in ast.walk(fn):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            n += 1
    return n


def main(argv: list[str]) -> int:
    root = Path(argv[0] if argv else Path(__file__).resolve().parents[1])
    sources = sorted([*(root / "statereduce").rglob("*.py"), *(root / "workflow_scripts").glob("*.py")])
    long, imports, branches = [], {}, []
    for src in sources:
        tree = ast.parse(src.read_text())
        rel = src.relative_to(root)
        outer = [f for f in functions(tree)]
        nested = {id(g) for f in outer for g in ast.walk(f) if g is not f and isinstance(g, ast.FunctionDef)}
        for fn in outer:
            start = min([fn.lineno, *(d.lineno for d in fn.decorator_list)])
            size = fn.end_lineno - start + 1
            if size > 80:
                long.append((size, f"{rel}:{fn.lineno} {fn.name}"))
            if id(fn) not in nested:
                n = inner_imports(fn)
                if n:
                    imports[f"{rel}:{fn.lineno} {fn.name}"] = n
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance"
                    and len(node.args) == 2):
                kinds = ast.unparse(node.args[1])
                if "dict" in kinds.split(", ") or kinds in ("dict", "int", "(int, dict)", "(dict, int)"):
                    branches.append(f"{rel}:{node.lineno} isinstance({ast.unparse(node.args[0])}, {kinds})")
    docs = sorted((root / "docs").glob("*.md"))
    doc_lines = sum(len(p.read_text().splitlines()) for p in docs)
    print(f"functions over 80 lines: {len(long)}")
    for size, name in sorted(long, reverse=True):
        print(f"  {size:4d}  {name}")
    print(f"imports inside functions: {sum(imports.values())} statements in {len(imports)} functions")
    print(f"isinstance(..., int|dict) checks: {len(branches)}")
    for b in branches:
        print(f"  {b}")
    print(f"docs/*.md: {doc_lines} lines in {len(docs)} pages")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
