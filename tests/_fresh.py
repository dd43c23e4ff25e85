"""Fresh Python processes without paying for their imports each time: a fork server per set of preloaded modules.

A test that needs a process of its own (``python -m snakemake ...``, a checkpoint reloaded where nothing of the test's
memory can leak in) calls :func:`run` with the arguments it would give the interpreter.
The first call for a given ``preload`` starts one server interpreter for the session, which imports those modules
(Snakemake's command line and its dependencies, or torch and transformers) and nothing else, and then forks one child
per call. The child is a fresh process in every way a test can observe: it has run no test code, it gets its own
working directory, environment, ``sys.argv``, stdin and stdout/stderr files, runs ``-c CODE``, ``-m MODULE`` or a
script as ``python`` would (``runpy``, so ``sys.argv[0]`` and ``__main__`` are what the interpreter sets), and exits
with the code a real interpreter would (``SystemExit`` and uncaught exceptions included). What it lacks is only the
import time of the preloaded modules, and they are in ``sys.modules`` from the start: tests that check which modules
an import pulls in use a plain ``subprocess`` instead.
Nothing of this project is preloaded: a child must import the package from wherever its own ``sys.path`` and working
directory say (a copy of the workflow holds its own copy of the package).

Forking is safe here because the server has only imported modules, never run torch ops or started threads, and it
forks from one thread. Coverage (dev/coverage_run.py) follows the children: pyproject's ``patch`` names ``fork`` and
``_exit``.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from _paths import ROOT

SNAKEMAKE = ("snakemake.cli", "snakemake.api", "jsonschema", "yaml")
"""What a ``python -m snakemake`` child would import before it reads the Snakefile (not statereduce: the Snakefile of a
workflow copy imports the copy's package, :func:`_snakemake.copy_workflow`)."""
TORCH = ("torch", "transformers", "safetensors.torch")
"""The libraries every checkpoint reload imports (fla and statereduce are left to the child: some tests look at
what importing them does)."""

_SERVER = r'''
import json, os, runpy, signal, sys, traceback
import importlib
for name in sys.argv[1:]:
    importlib.import_module(name)
control = sys.stdin.buffer
reply = os.fdopen(os.dup(1), "w", buffering=1)
devnull = os.open(os.devnull, os.O_RDWR)
os.dup2(devnull, 1)
for line in control:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.chdir(req["cwd"])
            os.environ.clear()
            os.environ.update(req["env"])
            for fd, path, flags in ((0, req["stdin"], os.O_RDONLY), (1, req["stdout"], os.O_WRONLY),
                                    (2, req["stderr"], os.O_WRONLY)):
                os.dup2(os.open(path, flags), fd)
            sys.stdin = open(0, closefd=False)
            sys.stdout = open(1, "w", closefd=False)
            sys.stderr = open(2, "w", closefd=False)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            args = req["args"]
            try:
                if args[0] == "-c":
                    sys.argv = ["-c", *args[2:]]
                    sys.path.insert(0, "")
                    exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
                elif args[0] == "-m":
                    sys.argv = [args[1], *args[2:]]
                    sys.path.insert(0, os.getcwd())
                    runpy.run_module(args[1], run_name="__main__", alter_sys=True)
                else:
                    sys.argv = list(args)
                    sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
                    runpy.run_path(args[0], run_name="__main__")
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if e.code is not None and not isinstance(e.code, int):
                    print(e.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
                code = 1
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            try:
                import threading
                threading._shutdown()
                import atexit
                atexit._run_exitfuncs()
            except Exception:
                pass
            os._exit(code)
    reply.write(json.dumps({"pid": pid}) + "\n")
    _, status = os.waitpid(pid, 0)
    reply.write(json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n")
'''


class _Server:
    """One server interpreter with ``preload`` imported; :meth:`run` forks a child per call (one call at a time)."""

    def __init__(self, preload: tuple[str, ...]):
        self.lock = threading.Lock()
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER, *preload], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, cwd=ROOT, text=True, bufsize=1)

    def run(self, args: list[str], *, cwd: Path, env: dict[str, str], input: str | None,
            timeout: float | None) -> subprocess.CompletedProcess:
        with self.lock, tempfile.TemporaryDirectory(prefix="fresh-") as tmp:
            files = {name: Path(tmp) / name for name in ("stdin", "stdout", "stderr")}
            files["stdin"].write_text(input or "")
            for name in ("stdout", "stderr"):
                files[name].touch()
            req = {"args": args, "cwd": str(cwd), "env": env, **{k: str(v) for k, v in files.items()}}
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            pid = json.loads(self.proc.stdout.readline())["pid"]
            killed = threading.Event()

            def kill() -> None:
                killed.set()
                os.kill(pid, signal.SIGKILL)

            timer = threading.Timer(timeout, kill) if timeout else None
            if timer:
                timer.start()
            line = self.proc.stdout.readline()
            if timer:
                timer.cancel()
            if not line:
                raise RuntimeError(f"the fork server died (exit {self.proc.poll()}) running {args}")
            status = json.loads(line)["status"]
            stdout, stderr = files["stdout"].read_text(), files["stderr"].read_text()
        if killed.is_set():
            raise subprocess.TimeoutExpired([sys.executable, *args], timeout, stdout, stderr)
        return subprocess.CompletedProcess([sys.executable, *args], status, stdout, stderr)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


_servers: dict[tuple[str, ...], _Server] = {}


def run(args: list[str], *, preload: tuple[str, ...] = (), cwd: Path | str | None = None,
        env: dict[str, str] | None = None, input: str | None = None, timeout: float | None = None,
        check: bool = False) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *args], capture_output=True, text=True, ...)`` in a fresh child of the
    session's fork server for ``preload`` (:data:`SNAKEMAKE`, :data:`TORCH`, or nothing)."""
    key = tuple(preload)
    if key not in _servers:
        _servers[key] = _Server(key)
    out = _servers[key].run(list(args), cwd=Path(cwd or os.getcwd()).resolve(),
                            env=dict(os.environ if env is None else env), input=input, timeout=timeout)
    if check:
        out.check_returncode()
    return out


@atexit.register
def _close() -> None:
    for server in _servers.values():
        server.close()
