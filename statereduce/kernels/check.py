"""A run-time check of fla's kernels on CUDA, at a job's own head shapes, before the job first calls them.

fla's Triton kernels are wrong or fault at some head shapes on some stacks (:mod:`statereduce.kernels.shapes` holds
the shapes measured on one stack; docs/gpu_checks.md). A user on another GPU, torch, Triton or fla would learn of a
wrong kernel only from bad numbers. So before a job on CUDA runs a model of an fla family, :func:`check_routes`
compares every kernel route the job will use (each kernel function the family's layers call, at each head shape
H x HV x d_k x d_v of the model, in the forward, and in the backward for jobs that differentiate: RFT and Grad
scores) with its PyTorch reference (:mod:`statereduce.kernels.fla_fallback`, itself tested against the float64
recurrence of :mod:`statereduce.kernels.reference`), on a small random input in bf16:

- The routes run in a child process (``python -m statereduce.kernels.check``): an illegal memory access poisons the
  CUDA context of the process it happens in, so it must not happen in the job's. A route whose child dies or
  raises a CUDA error counts as a ``fault``, and a fresh child runs the routes after it.
- Each outcome is cached on disk (:func:`cache_dir`, one small JSON file per route), keyed by the GPU's name and
  compute capability, the versions of torch, Triton and fla, this check's :data:`CHECK_VERSION`, the route and the
  shape: a job whose routes are all cached starts no child.
- Outcomes: ``right`` (relative error of every output, final state and gradient at most :data:`TOLERANCE`),
  ``wrong`` (above it, or not finite), ``fault`` (the child died or hit a CUDA error) and ``error`` (the kernel
  raised, as fla 0.6's refusal of the gated chunk backward with Triton < 3.7.1 on Hopper).
- The policy (:data:`POLICIES`; the environment variable :data:`POLICY_ENV`, default ``fallback``): ``fallback``
  routes every failed route's calls to the PyTorch reference on CUDA (:func:`route_to_torch`) with a warning,
  ``stop`` raises one line naming the kernel, shape, versions and measured error, ``off`` skips the check.

The record of a check (:func:`check_routes`' return) names every route, its outcome, its measured error, whether
it came from the cache and which path runs it (``fla`` or ``torch``); the job writes it into its own record.

This module imports nothing from the package above the kernels; the adapters name the kernels and their flags
(:meth:`statereduce.adapters.base.LinearAttentionAdapter.kernel_routes`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import importlib
import importlib.metadata
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from statereduce.kernels import fla_fallback
from statereduce.kernels.shapes import _needs_grad  # whether a kernel call will be differentiated

log = logging.getLogger(__name__)

CHECK_VERSION = 1
"""Bumped when the check's input or comparison changes, so that cached outcomes of an older check are not reused."""

TOLERANCE = 5e-2
"""Largest relative error (Frobenius, per output tensor) of a ``right`` route. fla's kernels in bf16 against the
float32 reference: about 7e-3 where right, 0.3 to 90 where wrong (docs/gpu_checks.md)."""

POLICIES = ("fallback", "stop", "off")
"""What a job does with a route that is not right: run it in PyTorch (warning), stop (one line), or skip the check."""

POLICY_ENV = "STATEREDUCE_KERNEL_CHECK"
"""Environment variable holding the policy (one of :data:`POLICIES`; default ``fallback``)."""

CACHE_ENV = "STATEREDUCE_KERNEL_CACHE"
"""Environment variable naming the cache folder (default: ``$XDG_CACHE_HOME/statereduce/kernel_checks``)."""

PASSES = ("forward", "backward")

BACKWARD = frozenset({"chunk_delta_rule", "chunk_gated_delta_rule"})
"""References whose kernels a training step differentiates: fla's layers and Qwen3.5's run the chunk kernels on
sequences longer than 64 tokens and in training, the recurrent ones only to decode."""

SEQ_LEN = {"chunk": 256, "recurrent": 64}
"""Tokens of the check's input: four chunks of 64 for a chunk kernel, 64 steps for a recurrent one."""

CHILD_TIMEOUT_S = 900.0
"""Seconds one child may take (a fresh machine compiles and autotunes every kernel it checks)."""


@dataclasses.dataclass(frozen=True)
class Route:
    """One kernel route of a job: a kernel function as the family's layer module binds it, in one pass, at one
    head shape.

    Args:
        layer_module: the module whose global ``kernel`` the family's layers call (``fla.layers.delta_net``).
        kernel: that global's name (``chunk_delta_rule``).
        reference: the name of the PyTorch reference in :mod:`statereduce.kernels.fla_fallback`.
        pass_: ``forward`` or ``backward``.
        num_heads, num_v_heads, d_k, d_v: the head shape (q/k heads, value heads, key and value widths).
        flags: the keyword flags the layer passes (``state_v_first``, ``use_gate_in_kernel``,
            ``use_beta_sigmoid_in_kernel``).
        setup: ``module:Class`` whose ``install_fallbacks()`` binds the kernel as a job binds it (the family's adapter).
    """

    layer_module: str
    kernel: str
    reference: str
    pass_: str
    num_heads: int
    num_v_heads: int
    d_k: int
    d_v: int
    flags: tuple[tuple[str, bool], ...] = ()
    setup: str = ""

    def __post_init__(self):
        if self.pass_ not in PASSES:
            raise ValueError(f"pass {self.pass_!r} is invalid; valid: {', '.join(PASSES)}")
        for name in ("num_heads", "num_v_heads", "d_k", "d_v"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.num_v_heads % self.num_heads:
            raise ValueError(f"num_v_heads={self.num_v_heads} must be a multiple of num_heads={self.num_heads}")

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.num_heads, self.num_v_heads, self.d_k, self.d_v)

    @property
    def gated(self) -> bool:
        return "gated" in self.reference

    @property
    def kind(self) -> str:
        return "recurrent" if "recurrent" in self.reference else "chunk"

    def label(self) -> str:
        h, hv, d_k, d_v = self.shape
        return f"{self.kernel} {self.pass_} at H={h}, HV={hv}, d_k={d_k}, d_v={d_v}"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["flags"] = dict(self.flags)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Route:
        return cls(**{**d, "flags": tuple(sorted(dict(d.get("flags") or {}).items()))})


def policy(value: str | None = None) -> str:
    """The check's policy: ``value``, else the environment's :data:`POLICY_ENV`, else ``fallback``; one-line
    ``ValueError`` for anything else."""
    chosen = value if value is not None else os.environ.get(POLICY_ENV, "fallback")
    if chosen not in POLICIES:
        where = "" if value is not None else f" (environment variable {POLICY_ENV})"
        raise ValueError(f"kernel check policy {chosen!r}{where} is invalid; valid: {', '.join(POLICIES)}")
    return chosen


def cache_dir() -> Path:
    """Where outcomes are cached: :data:`CACHE_ENV`, else ``$XDG_CACHE_HOME`` (``~/.cache``)``/statereduce/kernel_checks``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "statereduce" / "kernel_checks"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def stack(device: torch.device | str | int | None = None) -> dict[str, Any]:
    """What an outcome depends on besides its route: the GPU, its compute capability, torch, Triton and fla
    (``fla-core``, which holds the kernels) versions, and :data:`CHECK_VERSION`."""
    device = torch.device(device if device is not None else "cuda")
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        gpu = {"gpu": torch.cuda.get_device_name(index),
               "capability": ".".join(map(str, torch.cuda.get_device_capability(index)))}
    else:  # the tests check planted kernels on the CPU
        gpu = {"gpu": device.type, "capability": None}
    return {
        **gpu,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "fla": _version("fla-core") or _version("flash-linear-attention"),
        "check": CHECK_VERSION,
    }


def route_key(route: Route, on: Mapping[str, Any]) -> str:
    """The cache key of ``route`` on stack ``on``: a SHA-256 of both, in canonical JSON."""
    doc = {"stack": dict(on), "route": {k: v for k, v in route.to_dict().items() if k != "setup"}}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]


def _read_cached(folder: Path, key: str) -> dict[str, Any] | None:
    try:
        doc = json.loads((folder / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and doc.get("outcome") in OUTCOMES else None


def _write_cached(folder: Path, key: str, doc: Mapping[str, Any]) -> None:
    """Write one outcome atomically (a temporary file renamed into place); a cache that cannot be written only
    costs the next job a check."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{key}.", suffix=".tmp")
        with os.fdopen(fd, "w") as fh:
            json.dump(doc, fh)
        os.replace(tmp, folder / f"{key}.json")
    except OSError as exc:
        log.warning("kernel check: could not cache an outcome in %s (%s)", folder, exc)


OUTCOMES = ("right", "wrong", "fault", "error")


# --------------------------------------------------------------------------------------------------------------------
# the comparison (runs in the child)
# --------------------------------------------------------------------------------------------------------------------
def _inputs(route: Route, device: torch.device, seed: int = 0) -> tuple[tuple, dict[str, Any]]:
    """A small random call of ``route``'s kernel as its layer makes it: ``(args, kwargs)`` in bf16, with a random
    initial state and the final state requested."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    h, hv, d_k, d_v = route.shape
    t = SEQ_LEN[route.kind]
    flags = dict(route.flags)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    q, k = rnd(1, t, h, d_k), rnd(1, t, h, d_k)
    v = rnd(1, t, hv, d_v)
    kwargs: dict[str, Any] = {"use_qk_l2norm_in_kernel": True, "output_final_state": True}
    state = (1, hv, d_v, d_k) if flags.get("state_v_first") else (1, hv, d_k, d_v)
    kwargs["initial_state"] = rnd(*state, scale=0.1).float()
    beta_logits = rnd(1, t, hv)
    if flags.get("use_beta_sigmoid_in_kernel"):
        kwargs["beta"] = beta_logits
    else:
        kwargs["beta"] = torch.sigmoid(beta_logits)
    if route.gated:
        if flags.get("use_gate_in_kernel"):
            kwargs["g"] = rnd(1, t, hv)
            kwargs["A_log"] = rnd(hv, scale=0.5).float()
            kwargs["dt_bias"] = rnd(hv, scale=0.5).float()
        else:
            kwargs["g"] = torch.nn.functional.logsigmoid(rnd(1, t, hv)) / 4
    for name, value in flags.items():
        if value:
            kwargs[name] = True
    args = tuple(x.to(torch.bfloat16) for x in (q, k, v))
    kwargs = {name: (x.to(torch.bfloat16) if isinstance(x, torch.Tensor) and name in ("beta", "g") else x)
              for name, x in kwargs.items()}
    return args, kwargs


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return math.inf
    if not torch.isfinite(a).all():
        return math.inf
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _run(fn: Callable, args: tuple, kwargs: dict[str, Any], backward: bool, seed: int = 1) -> list[torch.Tensor]:
    """The outputs of one call (output, final state) and, with ``backward``, the gradients of every floating input
    under a fixed random cotangent."""
    leaves = [x.detach().clone().requires_grad_(backward) for x in args]
    kw = {name: (x.detach().clone().requires_grad_(backward) if isinstance(x, torch.Tensor) and x.is_floating_point()
                 and name in ("initial_state", "beta", "g") else x) for name, x in kwargs.items()}
    o, state = fn(*leaves, **kw)
    outs = [o.float(), state.float()]
    if backward:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        go = torch.randn(o.shape, generator=gen).to(o.device, o.dtype)
        gs = torch.randn(state.shape, generator=gen).to(state.device, state.dtype)
        inputs = leaves + [x for x in kw.values() if isinstance(x, torch.Tensor) and x.requires_grad]
        grads = torch.autograd.grad((o, state), inputs, (go, gs), allow_unused=True)
        outs += [g.float() if g is not None else torch.zeros_like(x, dtype=torch.float32) for g, x in zip(grads, inputs)]
    return outs


def bound_kernel(route: Route) -> Callable:
    """The kernel as a job calls it: the family's ``install_fallbacks()`` (``route.setup``), then the global
    ``route.kernel`` of ``route.layer_module``."""
    if route.setup:
        module, _, qualname = route.setup.partition(":")
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        obj.install_fallbacks()
    return getattr(importlib.import_module(route.layer_module), route.kernel)


def reference_kernel(route: Route) -> Callable:
    """The PyTorch reference of ``route``: :mod:`statereduce.kernels.fla_fallback`'s function of that name."""
    return getattr(fla_fallback, route.reference)


def compare(route: Route, device: torch.device | str = "cuda", kernel: Callable | None = None) -> dict[str, Any]:
    """Run ``route`` once through the job's kernel (``kernel``, default :func:`bound_kernel`) and once through its
    reference, in this process: ``{"outcome": "right" | "wrong" | "error", "error": max relative error or None,
    "detail": ...}``. A CUDA error propagates (the caller's process is then unusable for CUDA)."""
    device = torch.device(device)
    fn = kernel if kernel is not None else bound_kernel(route)
    args, kwargs = _inputs(route, device)
    backward = route.pass_ == "backward"
    with torch.no_grad() if not backward else torch.enable_grad():
        want = _run(reference_kernel(route), args, kwargs, backward)
        try:
            got = _run(fn, args, kwargs, backward)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except Exception as exc:  # noqa: BLE001 (a kernel's refusal is an outcome; CUDA errors go up)
            if _is_cuda_error(exc):
                raise
            return {"outcome": "error", "error": None, "detail": _one_line(exc)}
    names = ["output", "final state"] + (["dq", "dk", "dv", "d" + "/d".join(
        n for n in ("initial_state", "beta", "g") if n in kwargs)] if backward else [])
    errors = [_relative(a, b) for a, b in zip(got, want)]
    worst = max(errors)
    where = names[min(errors.index(worst), len(names) - 1)]
    outcome = "right" if worst <= TOLERANCE else "wrong"
    return {"outcome": outcome, "error": worst if math.isfinite(worst) else None,
            "detail": f"largest relative error {worst:.3g} ({where})"}


def _is_cuda_error(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, getattr(torch, "AcceleratorError", ())) or "CUDA error" in text or "illegal memory" in text


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


def _child(routes_file: str, out_file: str, device: str) -> int:
    """The child's body: each route of ``routes_file`` in order, one JSON line per finished route to ``out_file``;
    exit 3 after a CUDA error (the context is lost)."""
    routes = [Route.from_dict(d) for d in json.loads(Path(routes_file).read_text())]
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    with open(out_file, "a", buffering=1) as out:
        for route in routes:
            t0 = time.perf_counter()
            try:
                res = compare(route, dev)
            except Exception as exc:  # noqa: BLE001
                if not _is_cuda_error(exc):
                    raise
                res = {"outcome": "fault", "error": None, "detail": _one_line(exc)}
            res["seconds"] = round(time.perf_counter() - t0, 3)
            out.write(json.dumps({"route": route.to_dict(), **res}) + "\n")
            out.flush()
            os.fsync(out.fileno())
            if res["outcome"] == "fault":
                return 3
    return 0


def run_children(routes: Sequence[Route], device: torch.device | str, timeout: float = CHILD_TIMEOUT_S,
                 python: str | None = None) -> list[dict[str, Any]]:
    """Check ``routes`` in child processes (a new child after a route that faulted or killed its child); one result
    per route, in order, each with ``seconds``."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dev = str(device)
    results: dict[int, dict[str, Any]] = {}
    todo = list(range(len(routes)))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryDirectory(prefix="statereduce-kernel-check-") as tmp:
        while todo:
            routes_file, out_file = Path(tmp) / "routes.json", Path(tmp) / "out.jsonl"
            routes_file.write_text(json.dumps([routes[i].to_dict() for i in todo]))
            out_file.write_text("")
            t0 = time.perf_counter()
            try:
                proc = subprocess.run([python or sys.executable, "-m", __name__, str(routes_file), str(out_file), dev],
                                      env=env, capture_output=True, text=True, timeout=timeout)
                lines = (proc.stderr or proc.stdout).strip().splitlines()
                rc, tail = proc.returncode, [x for x in lines if x.strip() and not x[0].isspace()
                                             and "Warning" not in x][-2:]
            except subprocess.TimeoutExpired:
                rc, tail = "timeout", [f"no answer in {timeout:.0f} s"]
            done = [json.loads(line) for line in out_file.read_text().splitlines() if line.strip()]
            for i, res in zip(todo, done):
                res.pop("route", None)
                results[i] = res
            todo = todo[len(done):]
            if todo and (rc == 0 or rc == 3):
                continue
            if todo:  # the child died (or timed out) in the route after its last line: that route faulted
                results[todo[0]] = {"outcome": "fault", "error": None, "seconds": round(time.perf_counter() - t0, 3),
                                    "detail": f"the checking process ended with {rc}"
                                              f"{': ' + ' | '.join(tail) if tail else ''}"[:400],
                                    **({"timed_out": True} if rc == "timeout" else {})}
                todo = todo[1:]
    return [results[i] for i in range(len(routes))]


def check_routes(routes: Iterable[Route], device: torch.device | str = "cuda", policy_name: str | None = None,
                 folder: Path | None = None) -> list[dict[str, Any]]:
    """Check each of ``routes`` on ``device`` (cached outcomes reused), apply the policy and return the record.

    Args:
        routes: the job's routes (:meth:`~statereduce.adapters.base.LinearAttentionAdapter.kernel_routes`).
        device: the job's CUDA device.
        policy_name: one of :data:`POLICIES`; None reads :data:`POLICY_ENV` (default ``fallback``).
        folder: the cache (default :func:`cache_dir`).

    Returns:
        One entry per route: ``kernel``, ``pass``, ``shape``, ``outcome``, ``error``, ``detail``, ``cached``,
        ``seconds`` (of the check, 0 when cached) and ``path`` (``fla`` or ``torch``: what runs the route's calls).
        Empty with policy ``off``.

    Raises:
        RuntimeError: policy ``stop`` and a route that is not right (one line: kernel, shape, versions, error).
    """
    chosen = policy(policy_name)
    routes = list(dict.fromkeys(routes))
    if chosen == "off" or not routes:
        return []
    on = stack(device)
    folder = Path(folder) if folder is not None else cache_dir()
    keys = [route_key(r, on) for r in routes]
    found = [_read_cached(folder, k) for k in keys]
    missing = [i for i, doc in enumerate(found) if doc is None]
    if missing:
        t0 = time.perf_counter()
        fresh = run_children([routes[i] for i in missing], device)
        log.info("kernel check: %d route(s) checked in child processes in %.1f s on %s", len(missing),
                 time.perf_counter() - t0, on["gpu"])
        for i, res in zip(missing, fresh):
            doc = {**res, "stack": on, "route": routes[i].to_dict()}
            if not res.get("timed_out"):  # a child that gave no answer in time is asked again next time
                _write_cached(folder, keys[i], doc)
            found[i] = {**doc, "cached": False}
    record = []
    for route, doc in zip(routes, found):
        ok = doc["outcome"] == "right"
        entry = {"kernel": route.kernel, "pass": route.pass_, "shape": dict(zip(("H", "HV", "d_k", "d_v"), route.shape)),
                 "outcome": doc["outcome"], "error": doc.get("error"), "detail": doc.get("detail", ""),
                 "cached": bool(doc.get("cached", True)), "seconds": 0.0 if doc.get("cached", True) else
                 doc.get("seconds", 0.0), "path": "fla" if ok else "torch"}
        record.append(entry)
        if ok:
            continue
        versions = ", ".join(f"{k} {on[k]}" for k in ("torch", "triton", "fla"))
        said = {"wrong": "is wrong", "fault": "faulted", "error": "raised an error"}[doc["outcome"]]
        line = (f"fla kernel {route.label()} {said} on {on['gpu']} ({versions}): "
                f"{doc.get('detail', '')}")
        if chosen == "stop":
            raise RuntimeError(f"{line}; set {POLICY_ENV}=fallback to run it in PyTorch instead")
        warnings.warn(f"{line}; its calls run in PyTorch ({POLICY_ENV}=stop stops instead)", RuntimeWarning,
                      stacklevel=2)
        log.warning("kernel check: %s; its calls run in PyTorch", line)
        route_to_torch(route, torch.device(device).type)
    reapply()
    for entry in record:
        log.info("kernel check: %s %s at %s: %s%s, runs in %s", entry["kernel"], entry["pass"], entry["shape"],
                 entry["outcome"], " (cached)" if entry["cached"] else f" ({entry['seconds']:.1f} s)", entry["path"])
    return record


# --------------------------------------------------------------------------------------------------------------------
# the fallback
# --------------------------------------------------------------------------------------------------------------------
def _call_shape(args: tuple, kwargs: dict) -> tuple[int, int, int, int] | None:
    q = args[0] if args else kwargs.get("q", kwargs.get("query"))
    v = args[2] if len(args) > 2 else kwargs.get("v", kwargs.get("value"))
    if not (isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor)) or q.ndim != 4 or v.ndim != 4:
        return None
    return (q.shape[2], v.shape[2], q.shape[3], v.shape[3])


def _torch_routed(inner: Callable, reference: Callable, failed: dict) -> Callable:
    @functools.wraps(inner)
    def routed(*args: Any, **kwargs: Any) -> Any:
        shape = _call_shape(args, kwargs)
        if shape is not None:
            q = args[0] if args else kwargs.get("q", kwargs.get("query"))
            passes = failed.get((q.device.type, shape))
            if passes and ("forward" in passes or _needs_grad(args, kwargs)):
                return reference(*args, **kwargs)
        return inner(*args, **kwargs)

    routed._statereduce_checked = failed  # type: ignore[attr-defined]
    routed._statereduce_inner = inner  # type: ignore[attr-defined]
    return routed


_ROUTED: dict[tuple[str, str], tuple[Callable, dict]] = {}
"""(layer module, kernel) -> (its reference, {(device type, head shape): failed passes}) of every route sent to
PyTorch."""


def route_to_torch(route: Route, device_type: str = "cuda") -> None:
    """From now on, calls of ``route.layer_module.route.kernel`` on ``device_type`` tensors at ``route``'s head shape
    go to its PyTorch reference (in every call where the forward failed; where only the backward failed, in calls that will be
    differentiated). Idempotent; the routes of one kernel share one wrapper, which :func:`reapply` puts back where a
    family's ``install_fallbacks`` rebound the kernel since."""
    key = (route.layer_module, route.kernel)
    reference, failed = _ROUTED.setdefault(key, (reference_kernel(route), {}))
    failed.setdefault((device_type, route.shape), set()).add(route.pass_)
    reapply()


def reapply() -> None:
    """Wrap every kernel :func:`route_to_torch` routed whose module binding lost its wrapper."""
    for (module_name, kernel), (reference, failed) in _ROUTED.items():
        mod = importlib.import_module(module_name)
        current = getattr(mod, kernel)
        if getattr(current, "_statereduce_checked", None) is not failed:
            setattr(mod, kernel, _torch_routed(current, reference, failed))


def unroute() -> None:
    """Undo :func:`route_to_torch` for every kernel (tests): each binding gets back what it wrapped."""
    for (module_name, kernel), (_, failed) in _ROUTED.items():
        mod = importlib.import_module(module_name)
        current = getattr(mod, kernel)
        if getattr(current, "_statereduce_checked", None) is failed:
            setattr(mod, kernel, current._statereduce_inner)
    _ROUTED.clear()


def torch_routed(layer_module: str, kernel: str) -> dict[tuple[str, tuple[int, int, int, int]], set[str]]:
    """The (device type, head shape) pairs, and passes, whose calls of ``layer_module.kernel`` :func:`route_to_torch` sends to PyTorch."""
    current = getattr(importlib.import_module(layer_module), kernel)
    return {k: set(v) for k, v in (getattr(current, "_statereduce_checked", None) or {}).items()}


def main(argv: Sequence[str] | None = None) -> int:
    """The child process: check the routes of a JSON file, one JSON line per route to an output file."""
    ap = argparse.ArgumentParser(
        prog="python -m statereduce.kernels.check",
        description="Check fla kernel routes against their PyTorch references in this process (the kernel check's "
                    "child process: a job on CUDA starts it; docs/gpu_checks.md). Exits 3 after a CUDA error.")
    ap.add_argument("routes", help="JSON file: a list of routes (Route.to_dict)")
    ap.add_argument("out", help="JSON-lines file each finished route's outcome is appended to")
    ap.add_argument("device", nargs="?", default="cuda", help="the device to check on (default: cuda)")
    args = ap.parse_args(argv)
    return _child(args.routes, args.out, args.device)


if __name__ == "__main__":
    sys.exit(main())
