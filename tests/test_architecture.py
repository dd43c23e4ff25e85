"""The package's layers import downward only (docs/architecture.md): every module sits in one layer of the map below
and imports only from its own layer or lower ones (stages never from each other); the kernel layer imports nothing
else from the package, the family specs nothing at all and no torch (config validation reads them: planning a run
imports no torch), the adapters only kernels and specs; code that drives models reads family facts from the
adapters (no fla layer modules of its own); and no two modules import each other, at top level or inside
functions."""

from __future__ import annotations

import ast
import subprocess
import sys
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
def test_adapters_import_only_kernels_and_family_specs(name):
    others = {m for m in _package_imports(name)
              if not _under(m, "statereduce.kernels", "statereduce.families", "statereduce.adapters")}
    assert not others, f"{name} imports {sorted(others)}"


@pytest.mark.parametrize("name", [n for n in MODULES if _under(n, "statereduce.families")])
def test_family_specs_import_no_torch_and_nothing_else_from_the_package(name):
    others = {m for m in _package_imports(name) if not _under(m, "statereduce.families")}
    heavy = {m for m in _imports(MODULES[name]) if _under(m, "torch", "numpy", "transformers")}
    assert not others and not heavy, f"{name} imports {sorted(others | heavy)}"


#: docs/architecture.md's map, lowest layer first: (layer, module prefixes); a module belongs to the layer of its
#: longest matching prefix.
LAYERS = [
    ("layout", ["statereduce.layout"]),
    ("kernels", ["statereduce.kernels"]),
    ("families", ["statereduce.families"]),
    ("adapters", ["statereduce.adapters"]),
    ("selectors", ["statereduce.selectors"]),
    ("foundations", ["statereduce", "statereduce.models", "statereduce.data", "statereduce.tokenizer",
                     "statereduce.checkpoints", "statereduce.h5files", "statereduce.artifacts", "statereduce.runtime",
                     "statereduce.selection_file", "statereduce.settings",
                     "statereduce.budgets", "statereduce.slicing"]),
    ("services", ["statereduce.eval", "statereduce.analysis", "statereduce.speed", "statereduce.config"]),
    ("stages", ["statereduce.pretrain", "statereduce.capture", "statereduce.allocate", "statereduce.select",
                "statereduce.prune", "statereduce.rft", "statereduce.analysis.rank"]),
    ("api", ["statereduce.api", "statereduce.__main__", "statereduce.fetch"]),
]


def _layer(name: str) -> int:
    matches = [(len(p), i) for i, (_, prefixes) in enumerate(LAYERS) for p in prefixes if _under(name, p)]
    assert matches, f"{name} is in no layer of LAYERS (docs/architecture.md): add it"
    return max(matches)[1]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_imports_only_its_layer_or_lower_ones(name):
    """Upward imports break the map; a stage importing another stage ties two rules' code together (what they share
    belongs in a lower layer)."""
    here = _layer(name)
    bad = sorted(m for m in _package_imports(name) if _layer(m) > here)
    if LAYERS[here][0] == "stages":
        bad += sorted(m for m in _package_imports(name) if _layer(m) == here and not _under(m, name))
    assert not bad, f"{name} ({LAYERS[here][0]}) imports {bad}"


def test_settings_import_nothing_else_from_the_package_and_no_torch():
    """The typed settings are built on every dry run (config validation) and read by every layer above them."""
    others = _package_imports("statereduce.settings")
    heavy = {m for m in _imports(MODULES["statereduce.settings"]) if _under(m, "torch", "numpy", "transformers")}
    assert not others and not heavy, sorted(others | heavy)


def test_validating_the_default_config_imports_no_torch():
    """The Snakefile validates the config on every dry run: it reads the family specs, never the adapters."""
    code = ("import sys, yaml; from statereduce.config import validate_config; "
            "validate_config(yaml.safe_load(open('config.yaml'))); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'fla', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


OWN_FLA = ("statereduce.adapters", "statereduce.families", "statereduce.kernels")


@pytest.mark.parametrize("name", [n for n in MODULES if not _under(n, *OWN_FLA)])
def test_only_adapters_specs_and_kernels_name_fla_layer_modules(name):
    """Code outside the adapters, family specs and kernels asks them for every family fact: it imports no fla layer
    or model module (importing ``fla`` itself to register its models, or its utilities, is fine)."""
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
