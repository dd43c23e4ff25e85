"""The exact pins of ``constraints.txt`` (read by dev/sync_envs.py, the one reader) and whether PyPI answers, for the
tests of the install lines and the conda envs."""

from __future__ import annotations

import importlib.util
import socket

from _paths import ROOT

_spec = importlib.util.spec_from_file_location("sync_envs", ROOT / "dev" / "sync_envs.py")
_sync_envs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_sync_envs)
canonical = _sync_envs.canonical
constraints = _sync_envs.constraints


def pypi_reachable() -> bool:
    """Whether pypi.org accepts a connection (the resolver tests skip, saying so, where it does not)."""
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
        return True
    except OSError:
        return False
