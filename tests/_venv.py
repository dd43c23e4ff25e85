"""A virtual environment without statereduce, for the tests of checkpoints that must load without it
(tests/test_portable.py, tests/test_export.py): this interpreter's packages linked into a fresh venv, minus statereduce
(and minus fla unless asked), and the child script that loads checkpoints there (``_portable_child.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

CHILD = Path(__file__).with_name("_portable_child.py")


def without_statereduce(root: Path, *, fla: bool) -> Path:
    """A virtual environment of this interpreter whose site-packages links every package of this one but statereduce
    (and fla unless ``fla``): the environment a user without the package has. Made once per ``root``."""
    env = root / ("venv_fla" if fla else "venv")
    if (env / "bin" / "python").exists():
        return env
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    here = Path(sysconfig.get_paths()["purelib"])
    there = Path(subprocess.run([str(env / "bin" / "python"), "-c",
                                 "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                check=True, capture_output=True, text=True).stdout.strip())
    for entry in here.iterdir():
        name = entry.name.lower()
        if name.endswith(".pth") or name.startswith(("statereduce", "__editable__", "__pycache__")):
            continue
        if not fla and name.startswith(("fla", "flash_linear_attention")):
            continue
        (there / entry.name).symlink_to(entry)
    return env


def load_there(env: Path, cases: list[dict], workdir: Path) -> subprocess.CompletedProcess:
    """Run the child script in ``env`` on ``cases`` (its manifest entries), in ``workdir``, with transformers' module
    cache there too; returns the finished process (its stdout says how many loaded)."""
    manifest = workdir / f"manifest_{env.name}_{len(list(workdir.glob('manifest_*')))}.json"
    manifest.write_text(json.dumps({"cases": cases}))
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    environ["HF_MODULES_CACHE"] = str(workdir / "hf_modules")
    return subprocess.run([str(env / "bin" / "python"), str(CHILD), str(manifest)], cwd=workdir, env=environ,
                          capture_output=True, text=True)
