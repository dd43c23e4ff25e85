"""The package's layers import downward only (docs/architecture.md): the kernel layer imports nothing else from the
package, the adapters only kernels, code that drives models reads family facts from the adapters (no fla layer
modules of its own), and no two modules import each other, at top level or inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "statereduce"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (top level, inside functions, under TYPE_CHECKING alike)."""
    tree = ast.parse(path.read_text(), str(path))
    name = next(n for n, p in MODULES.items() if p == path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:  # `from pkg import mod` imports the module pkg.mod
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base)
    return out


def _package_imports(name: str) -> set[str]:
    return {m for m in _imports(MODULES[name]) if m in MODULES and m != name}


def _under(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


@pytest.mark.parametrize("name", [n for n in MODULES if _under(n, "statereduce.kernels")])
def test_kernel_layer_imports_nothing_else_from_the_package(name):
    others = {m for m in _package_imports(name) if not _under(m, "statereduce.kernels")}
    assert not others, f"{name} imports {sorted(others)}"


@pytest.mark.parametrize("name", [n for n in MODULES if _under(n, "statereduce.adapters")])
def test_adapters_import_only_kernels(name):
    others = {m for m in _package_imports(name) if not _under(m, "statereduce.kernels", "statereduce.adapters")}
    assert not others, f"{name} imports {sorted(others)}"


@pytest.mark.parametrize("name", [n for n in MODULES if not _under(n, "statereduce.adapters", "statereduce.kernels")])
def test_only_adapters_and_kernels_name_fla_layer_modules(name):
    """Code outside the adapters and kernels asks an adapter for every family fact: it imports no fla layer or
    model module (importing ``fla`` itself to register its models, or its utilities, is fine)."""
    bad = {m for m in _imports(MODULES[name]) if _under(m, "fla.layers", "fla.models") and m != "fla.models"}
    assert not bad, f"{name} imports {sorted(bad)}"


def test_no_import_cycles():
    graph = {name: _package_imports(name) for name in MODULES}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_the_walk_sees_imports_inside_functions(tmp_path):
    """The checks above would miss a cycle hidden in a function body if the walk looked at the top level only."""
    code = "def f():\n    from statereduce.runtime import write_json\n    import statereduce.kernels.conv\n"
    MODULES["_probe"] = tmp_path / "probe.py"
    try:
        (tmp_path / "probe.py").write_text(code)
        assert {"statereduce.runtime", "statereduce.kernels.conv"} <= _imports(tmp_path / "probe.py")
    finally:
        del MODULES["_probe"]
