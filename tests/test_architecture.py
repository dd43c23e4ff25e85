"""The package's layers import downward only (docs/architecture.md): its folders are the layers. Every module's layer
is its folder's (the package root holds the api layer alone: a new top-level module, or a folder in no layer, fails),
and it imports only from its own layer or lower ones (stages never from each other); the kernel layer imports nothing
else from the package, the family specs only the common vocabulary and no torch (config validation reads them:
planning a run imports no torch), the adapters only kernels, specs and the common vocabulary; code that drives models reads family facts from the adapters
(no fla layer modules of its own); no two modules import each other, at top level or inside functions; and only the
modules that docs/architecture.md names under "Imports inside functions" import inside functions."""

from __future__ import annotations

import ast
import fnmatch
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "statereduce"
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"

#: docs/architecture.md's map, lowest layer first: (layer, the package's folders in it). The package root is the api
#: layer and holds :data:`API_MODULES` only; the package itself (``__init__``: ``__version__``) imports nothing and
#: sits below every layer.
LAYERS = [
    ("common", ["common"]),
    ("kernels", ["kernels"]),
    ("families", ["families"]),
    ("adapters", ["adapters"]),
    ("selectors", ["selectors"]),
    ("core", ["core"]),
    ("eval", ["eval"]),
    ("config", ["config"]),
    ("analysis", ["analysis"]),
    ("speed", ["speed"]),
    ("serve", ["serve"]),
    ("studies", ["studies"]),
    ("stages", ["stages"]),
]
API = len(LAYERS)
API_MODULES = {"statereduce.__main__", "statereduce.api", "statereduce.fetch"}


def _modules(package: Path = PACKAGE) -> dict[str, Path]:
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _imports(path: Path, modules: dict[str, Path] = MODULES) -> set[str]:
    """Every module a file imports, at any depth (top level, inside functions, under TYPE_CHECKING alike)."""
    tree = ast.parse(path.read_text(), str(path))
    name = next(n for n, p in modules.items() if p == path)
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
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
    return out


def _package_imports(name: str, modules: dict[str, Path] = MODULES) -> set[str]:
    return {m for m in _imports(modules[name], modules) if m in modules and m != name}


def _under(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


@pytest.mark.parametrize("name", [n for n in MODULES if _under(n, "statereduce.kernels")])
def test_kernel_layer_imports_nothing_else_from_the_package(name):
    others = {m for m in _package_imports(name) if not _under(m, "statereduce.kernels")}
    assert not others, f"{name} imports {sorted(others)}"


@pytest.mark.parametrize("name", [n for n in MODULES if _under(n, "statereduce.adapters")])
def test_adapters_import_only_kernels_family_specs_and_common(name):
    others = {m for m in _package_imports(name) if not _under(m, "statereduce.kernels", "statereduce.families",
                                                                "statereduce.adapters", "statereduce.common")}
    assert not others, f"{name} imports {sorted(others)}"


@pytest.mark.parametrize("name", [n for n in MODULES if _under(n, "statereduce.families")])
def test_family_specs_import_no_torch_and_only_common_from_the_package(name):
    others = {m for m in _package_imports(name) if not _under(m, "statereduce.families", "statereduce.common")}
    heavy = {m for m in _imports(MODULES[name]) if _under(m, "torch", "numpy", "transformers")}
    assert not others and not heavy, f"{name} imports {sorted(others | heavy)}"


def layer_violations(package: Path = PACKAGE) -> list[str]:
    """Every break of the layer map in ``package`` (a copy of the package, for the planted faults): a module at the
    root outside :data:`API_MODULES`, a folder in no layer, an import from a higher layer, a stage importing another
    stage."""
    modules = _modules(package)
    out = []
    layers = {}
    for name, path in modules.items():
        parts = name.split(".")
        if len(parts) == 2 and not (package / parts[1]).is_dir() and name not in API_MODULES:
            out.append(f"{name} is a new module at the package root, which holds the api layer only "
                       f"({', '.join(sorted(API_MODULES))}): put it in the folder of its layer")
            continue
        folder = parts[1] if len(parts) > 1 and (package / parts[1]).is_dir() else None
        if name == "statereduce":
            layers[name] = -1
        elif folder is None:
            layers[name] = API
        else:
            found = [i for i, (_, folders) in enumerate(LAYERS) if folder in folders]
            if not found:
                out.append(f"{name}: folder statereduce/{folder}/ is in no layer of LAYERS: add it to one")
                continue
            layers[name] = found[0]
    for name, here in layers.items():
        imports = {m for m in _imports(modules[name], modules) if m in modules and m != name}
        bad = sorted(m for m in imports if layers.get(m, -1) > here)
        if here < API and LAYERS[here][0] == "stages":
            bad += sorted(m for m in imports if layers.get(m) == here and not _under(m, name))
        if bad:
            label = "package" if here < 0 else LAYERS[here][0] if here < API else "api"
            out.append(f"{name} ({label}) imports {bad}")
    return out


def test_every_folder_is_a_layer_and_the_root_holds_the_api_only():
    """The layer map is the folders: every folder of the package is in one layer, every layer's folders exist."""
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    mapped = {f for _, fs in LAYERS for f in fs}
    assert folders == mapped, (sorted(folders - mapped), sorted(mapped - folders))
    root = {n for n in MODULES if n.count(".") == 1 and not (PACKAGE / n.split(".")[-1]).is_dir()}
    assert root == API_MODULES, sorted(root ^ API_MODULES)


def test_every_module_imports_only_its_layer_or_lower_ones():
    """Upward imports break the map; a stage importing another stage ties two rules' code together (what they share
    belongs in a lower layer)."""
    assert layer_violations() == []


def _planted_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "statereduce"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def test_the_layer_check_fails_on_a_planted_upward_import(tmp_path):
    copy = _planted_copy(tmp_path)
    path = copy / "core" / "runtime.py"
    path.write_text(path.read_text() + "\n\ndef _planted():\n    from statereduce.stages.prune import prune_model\n")
    assert layer_violations(copy) == ["statereduce.core.runtime (core) imports ['statereduce.stages.prune']"]
    stage = copy / "stages" / "select.py"
    stage.write_text(stage.read_text() + "\nfrom statereduce.stages import rft  # noqa\n")
    assert "statereduce.stages.select (stages) imports ['statereduce.stages.rft']" in layer_violations(copy)


def test_the_layer_check_fails_on_a_planted_top_level_module_and_folder(tmp_path):
    copy = _planted_copy(tmp_path)
    (copy / "helpers.py").write_text("from statereduce.core.runtime import write_json\n")
    (copy / "extras").mkdir()
    (copy / "extras" / "__init__.py").write_text("")
    found = layer_violations(copy)
    assert any(v.startswith("statereduce.helpers is a new module at the package root") for v in found), found
    assert any(v.startswith("statereduce.extras: folder statereduce/extras/ is in no layer") for v in found), found


@pytest.mark.parametrize("name", [n for n in MODULES if _under(n, "statereduce.common")])
def test_common_imports_nothing_else_from_the_package_and_no_torch(name):
    """The layout and the typed settings are read on every dry run (config validation) and by every layer above."""
    others = {m for m in _package_imports(name) if not _under(m, "statereduce.common")}
    heavy = {m for m in _imports(MODULES[name]) if _under(m, "torch", "numpy", "transformers")}
    assert not others and not heavy, sorted(others | heavy)


def test_validating_the_default_config_imports_no_torch():
    """The Snakefile validates the config on every dry run: it reads the family specs, never the adapters."""
    code = ("import sys, yaml; from statereduce.config import validate_config; "
            "validate_config(yaml.safe_load(open('config.yaml'))); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'fla', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


OWN_FLA = ("statereduce.adapters", "statereduce.families", "statereduce.kernels", "statereduce.speed.fla_decode")


@pytest.mark.parametrize("name", [n for n in MODULES if not _under(n, *OWN_FLA)])
def test_only_adapters_specs_and_kernels_name_fla_layer_modules(name):
    """Code outside the adapters, family specs, kernels and fla's decode routes (speed/fla_decode.py, which patches
    fla's layers for in-place decoding) asks them for every family fact: it imports no fla layer or model module
    (importing ``fla`` itself to register its models, or its utilities, is fine)."""
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
    code = "def f():\n    from statereduce.core.runtime import write_json\n    import statereduce.kernels.conv\n"
    MODULES["_probe"] = tmp_path / "probe.py"
    try:
        (tmp_path / "probe.py").write_text(code)
        assert {"statereduce.core.runtime", "statereduce.kernels.conv"} <= _imports(tmp_path / "probe.py")
    finally:
        del MODULES["_probe"]


# ---- imports inside functions: only in the modules docs/architecture.md names ----------------------------------------
INNER_SECTION = "Imports inside functions"


def inner_imports(path: Path) -> list[str]:
    """``function:line`` of every import statement inside a function body of ``path`` (methods and nested functions
    too; imports at module level or in a class body are not inside a function)."""
    out = []

    def visit(node: ast.AST, function: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, child.name if function is None else f"{function}.{child.name}")
            elif isinstance(child, (ast.Import, ast.ImportFrom)) and function is not None:
                out.append(f"{function}:{child.lineno}")
            else:
                visit(child, function)

    visit(ast.parse(path.read_text(), str(path)), None)
    return out


def inner_import_modules(doc: str) -> list[str]:
    """The module paths (relative to ``statereduce/``; a glob such as ``studies/*.py`` names a folder's modules) that
    the section "Imports inside functions" of ``doc`` (docs/architecture.md) names in backticks."""
    m = re.search(rf"^## {INNER_SECTION}\n(.*?)(?=^## |\Z)", doc, re.S | re.M)
    if m is None:
        raise AssertionError(f"docs/architecture.md has no section {INNER_SECTION!r}")
    return re.findall(r"`([\w./*]+\.py)`", m.group(1))


def inner_import_violations(package: Path = PACKAGE, doc: str | None = None) -> list[str]:
    """A module of ``package`` with an import inside a function that the section does not name, and a name of the
    section that matches no module with one (a line left behind when the imports moved to the top)."""
    listed = inner_import_modules(ARCHITECTURE.read_text() if doc is None else doc)
    found = {p.relative_to(package).as_posix(): inner_imports(p) for p in sorted(package.rglob("*.py"))}
    found = {rel: where for rel, where in found.items() if where}
    out = [f"statereduce/{rel} imports inside {', '.join(where)}: move the imports to its top, or name the module "
           f"and why in docs/architecture.md, \"{INNER_SECTION}\""
           for rel, where in found.items() if not any(fnmatch.fnmatch(rel, pattern) for pattern in listed)]
    out += [f"docs/architecture.md, \"{INNER_SECTION}\", names {pattern}: no module of that name imports inside a "
            "function; drop or correct its line" for pattern in listed
            if not any(fnmatch.fnmatch(rel, pattern) for rel in found)]
    return out


def test_only_the_modules_the_architecture_names_import_inside_functions():
    """An import inside a function keeps a heavy library off a start-up that does not need it; every module that
    has one is named, with its reason, in docs/architecture.md, and every module named there has one."""
    assert inner_import_violations() == []


def test_the_inner_import_check_fails_on_a_planted_import_and_a_stale_line(tmp_path):
    copy = _planted_copy(tmp_path)
    path = copy / "core" / "artifacts.py"
    path.write_text(path.read_text() + "\n\ndef _planted():\n    import json\n")
    found = inner_import_violations(copy)
    assert len(found) == 1 and found[0].startswith("statereduce/core/artifacts.py imports inside _planted:"), found
    doc = ARCHITECTURE.read_text().replace("* `stages/rft.py`", "* `stages/rtf.py`")  # a misspelt line
    found = inner_import_violations(PACKAGE, doc)
    assert len(found) == 2 and found[0].startswith("statereduce/stages/rft.py imports inside attach_lora:"), found
    assert "names stages/rtf.py: no module of that name imports inside a function" in found[1], found
