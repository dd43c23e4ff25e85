"""python -m statereduce: this overview of the package, in plain text.

Lists the model families (adapters), the registered channel selectors, the models of a workflow config
(./config.yaml unless --config names another) and the package's command-line tools, then points to the Python API
(statereduce.api). Reads the config as YAML without validating it and imports neither fla nor a model.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import yaml

from statereduce import __version__

PACKAGE = Path(__file__).resolve().parent


def plain(doc: str | None) -> str:
    """The first paragraph of a docstring as one line of plain text (RST markup removed)."""
    para = (doc or "").strip().split("\n\n")[0]
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", " ".join(para.split()))  # :func:`x` -> x
    return text.replace("``", "").replace("`", "").replace("**", "")


def families() -> list[tuple[str, str]]:
    """(family, description) of every registered adapter."""
    from statereduce.adapters import adapter_class, adapter_families  # torch: not for --help

    return [(f, plain(adapter_class(f).__doc__)) for f in adapter_families()]


def selectors() -> list[tuple[str, str]]:
    """(selector, description) of every registered selector: what it needs, its variants and options, its doc."""
    from statereduce.selectors import get_selector, selector_names  # scipy: not for --help

    out = []
    for name in selector_names():
        sel = get_selector(name)
        facts = [f"needs {', '.join(sorted(sel.needs))}"]
        facts += [f"variants -{', -'.join(v for v in sel.variants if v != 'kq')}"] if len(sel.variants) > 1 else []
        facts += [f"options {', '.join(sel.options)}"] if sel.options else []
        out.append((name, f"{plain(sel.__doc__)} ({'; '.join(facts)})"))
    return out


def clis() -> list[tuple[str, str]]:
    """(command, description) of every module of the package that runs as a program: a package with a
    ``__main__.py`` or a module with an ``if __name__ == "__main__":`` block; read from the source, nothing imported."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if path.name == "__main__.py":
            name = ".".join(parts[:-1])
        elif path.parent != PACKAGE and (path.parent / "__main__.py").is_file():
            continue  # reached through its subpackage's __main__ (statereduce.speed.bench: python -m statereduce.speed)
        elif re.search(r"^if __name__ == ['\"]__main__['\"]:", path.read_text(), re.M):
            name = ".".join(parts)
        else:
            continue
        doc = plain(ast.get_docstring(ast.parse(path.read_text())))
        doc = re.sub(r"^python -m [\w.]+[^:]*: *", "", doc)  # a docstring that starts with its own usage
        out.append((f"python -m {name}", doc[:1].upper() + doc[1:]))
    return out


def configured_models(path: Path) -> tuple[str, list[tuple[str, str, str]]]:
    """(where it looked, [(model, family, source)]) of a workflow config; no models when the file is absent."""
    where = str(path.resolve())
    if not path.is_file():
        return f"no config at {where} (give --config PATH)", []
    try:
        config = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        return f"{where} is not valid YAML: {' '.join(str(err).split())}", []
    models = config.get("models") if isinstance(config, dict) else None
    if not isinstance(models, dict) or not models:
        return f"{where} declares no models", []
    rows = []
    for name, spec in models.items():
        spec = spec if isinstance(spec, dict) else {}
        if "pretrain" in spec:
            source = "trained from scratch by the workflow (pretrain)"
        elif "init" in spec:
            source = "random weights of a given shape (init)"
        elif "hub" in spec:
            hub = spec["hub"]
            source = f"hub {hub.get('id') if isinstance(hub, dict) else hub}"
        elif "local" in spec:
            source = f"local {spec['local']}" if spec["local"] else "local (path not set)"
        else:
            source = "no source"
        rows.append((str(name), str(spec.get("family", "?")), source))
    return where, rows


def configured_budgets(path: Path) -> list[tuple[str, str]]:
    """[(budget, its settings)] of a workflow config's ``budgets`` block (method token suffix ``@<budget>``)."""
    try:
        config = yaml.safe_load(path.read_text()) or {} if path.is_file() else {}
    except yaml.YAMLError:
        return []
    budgets = config.get("budgets") if isinstance(config, dict) else None
    if not isinstance(budgets, dict):
        return []
    return [(str(name), ", ".join(f"{k}: {v}" for k, v in (spec or {}).items()) if isinstance(spec, dict) else "?")
            for name, spec in budgets.items()]


def _table(rows: Sequence[tuple[str, ...]], width: int = 118) -> list[str]:
    """Rows in columns, two spaces indented; the last column wraps under itself."""
    if not rows:
        return []
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = []
    for r in rows:
        head = "  " + "".join(c.ljust(w + 2) for c, w in zip(r, widths))
        lines += textwrap.wrap(r[-1], width, initial_indent=head, subsequent_indent=" " * len(head)) or [head]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m statereduce",
        description="List the model families, the channel selectors, the models of a workflow config and the "
                    "command-line tools of statereduce.",
    )
    p.add_argument("--config", default="config.yaml",
                   help="workflow config whose models to list (default: config.yaml in the current directory)")
    args = p.parse_args(argv)
    lines = [f"statereduce {__version__}: key/query channel pruning of linear-attention language models", ""]
    lines += ["Model families (adapters):", *_table(families()), ""]
    lines += ["Selectors (method token: <selector>[-k|-q|-v|-kv][.<calib>][@<budget>][+<fit>]):", *_table(selectors()), ""]
    budgets = configured_budgets(Path(args.config))
    if budgets:
        lines += ["Per-layer key budgets of the config (method token suffix @<budget>; docs/budgets.md):",
                  *_table(budgets), ""]
    where, models = configured_models(Path(args.config))
    lines += [f"Configured models ({where}):" if models else f"Configured models: {where}"]
    lines += [*_table(models), ""] if models else [""]
    lines += ["Command-line tools (each takes --help):", *_table(clis()), ""]
    lines += ["Python API: statereduce.api (build, calibrate, select, prune, save); docs/api.md.",
              "Workflow: snakemake --cores all (docs/workflow.md)."]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
