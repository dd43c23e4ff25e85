#!/usr/bin/env python
"""The run-time kernel check (:mod:`statereduce.kernels.check`) on a CUDA GPU: what it costs and what it catches.

Standalone (no snakemake, no pytest); needs a CUDA GPU with fla and Triton. Writes one JSON document:

- ``jobs``: the routes of the jobs of the paper's hub chains (DeltaNet 1.3B, Gated DeltaNet 1.3B, the Qwen3.5-9B
  text model; the baseline, 50 % and 75 % key cuts; forward for evaluation and calibration, forward and backward for
  RFT's student and Grad scores), each checked as a job checks them (:func:`~statereduce.kernels.check.check_routes`)
  with an empty outcome cache, then again with the cache that first call filled: the seconds of both, the outcomes.
  The first job also pays for Triton compiling and autotuning fla's kernels in the child (Triton's own cache, kept
  on disk, serves later children).
- ``raw_kernel``: fla's chunk DeltaNet kernel without statereduce's zero-padding guard (:mod:`statereduce.kernels.
  shapes`), at head shapes where fla 0.6.0 is wrong (16 x 64) or faults (32 x 64) on Triton 3.6: the outcomes the
  check finds, the one line the ``stop`` policy raises, and that this process's CUDA context survives the fault.
- ``model``: a tiny DeltaNet of that wrong shape (d_k 16, d_v 64) loaded on the GPU with the guard removed (the stand-in
  for a kernel that is wrong on the user's stack and unknown to statereduce): its logits on a 512-token input
  against the float32 CPU model, without the check (fla's wrong kernel runs) and with it (policy ``fallback``: the
  route runs in PyTorch), and :func:`~statereduce.core.models.load_model`'s record.

Usage::

    PYTHONPATH=scripts:. python scripts/check_kernels_gpu.py OUT.json

``PYTHONPATH`` must include ``scripts/`` so that the check's child process imports this module's stand-in setup
(:class:`Unguarded`).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from statereduce.kernels import check

#: where the checks run; only a CPU dry run of this script's plumbing (--device cpu) changes it
DEVICE = "cuda"

#: (name, family kernels, flags, setup) of the three hub families' layers
FAMILIES = {
    "delta_net": ("fla.layers.delta_net", {"chunk_delta_rule": "chunk_delta_rule",
                                           "fused_recurrent_delta_rule": "fused_recurrent_delta_rule"},
                  {}, "statereduce.adapters.deltanet:DeltaNetAdapter"),
    "gated_deltanet": ("fla.layers.gated_deltanet",
                       {"chunk_gated_delta_rule": "chunk_gated_delta_rule",
                        "fused_recurrent_gated_delta_rule": "fused_recurrent_gated_delta_rule"},
                       {"state_v_first": True, "use_gate_in_kernel": True, "use_beta_sigmoid_in_kernel": True},
                       "statereduce.adapters.gated_deltanet:GatedDeltaNetAdapter"),
    "qwen3_5": ("transformers.models.qwen3_5.modeling_qwen3_5",
                {"torch_chunk_gated_delta_rule": "chunk_gated_delta_rule",
                 "torch_recurrent_gated_delta_rule": "fused_recurrent_gated_delta_rule"},
                {}, "statereduce.adapters.qwen3_5:Qwen35Adapter"),
}

#: model -> (family, H, HV, d_k, d_v): the hub checkpoints' head shapes (config.yaml, docs/families.md)
MODELS = {
    "dn1.3b": ("delta_net", 16, 16, 128, 128),
    "gdn1.3b": ("gated_deltanet", 8, 8, 256, 256),
    "qwen35-9b": ("qwen3_5", 16, 32, 128, 128),
}


def routes_of(model: str, pct: int, backward: bool) -> list[check.Route]:
    """The routes a job of ``model`` at ``pct`` % of key channels removed uses (as the adapter's kernel_routes)."""
    family, h, hv, d_k, d_v = MODELS[model]
    module, kernels, flags, setup = FAMILIES[family]
    d_k = d_k - round(d_k * pct / 100)
    return [check.Route(module, kernel, ref, p, h, hv, d_k, d_v, flags=tuple(sorted(flags.items())), setup=setup)
            for kernel, ref in kernels.items()
            for p in (("forward", "backward") if backward and ref in check.BACKWARD else ("forward",))]


def timed_check(routes: list[check.Route], folder: Path, policy: str = "fallback") -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        record = check.check_routes(routes, DEVICE, policy, folder=folder)
        error = None
    except RuntimeError as exc:
        record, error = [], str(exc)
    return {"seconds": round(time.perf_counter() - t0, 3), "record": record, **({"stopped": error} if error else {})}


def jobs(folder: Path, out: list | None = None, save=lambda: None, pcts: tuple[int, ...] = (0, 50, 75)
         ) -> list[dict[str, Any]]:
    out = [] if out is None else out
    for model in MODELS:
        for pct in pcts:
            for job, backward in (("eval", False), ("rft student", True)):
                if job == "rft student" and pct == 0:
                    continue
                routes = routes_of(model, pct, backward)
                first = timed_check(routes, folder)
                cached = timed_check(routes, folder)
                out.append({"model": model, "pct": pct, "job": job, "routes": len(routes),
                            "first_s": first["seconds"], "cached_s": cached["seconds"],
                            "outcomes": {f"{e['kernel']} {e['pass']} {e['shape']['d_k']}x{e['shape']['d_v']}":
                                         [e["outcome"], e["error"], e["path"]] for e in first["record"]},
                            "all_cached": all(e["cached"] for e in cached["record"])})
                print(json.dumps(out[-1]), flush=True)
                save()
                check.unroute()
    return out


def raw_kernel(folder: Path) -> dict[str, Any]:
    base = check.Route("fla.ops.delta_rule", "chunk_delta_rule", "chunk_delta_rule", "forward", 4, 4, 64, 64)
    routes = [dataclasses.replace(base, d_k=d, pass_=p) for d in (16, 32, 64) for p in ("forward", "backward")]
    res = timed_check(routes, folder)
    stop = timed_check(routes[:1], folder, policy="stop")
    x = torch.ones(4, device=DEVICE)
    check.unroute()
    return {**res, "stop_line": stop.get("stopped"), "parent_cuda_alive": float((x * 2).sum()) == 8.0}


class Unguarded:
    """A stand-in setup for :class:`~statereduce.kernels.check.Route`: the DeltaNet adapter's bindings, then
    ``chunk_delta_rule`` without statereduce's zero-padding guard (fla's kernel as a user's stack might have it:
    wrong at d_k 16 x d_v 64 on fla 0.6.0, Triton 3.6)."""

    @classmethod
    def install_fallbacks(cls) -> None:
        from statereduce.adapters.deltanet import DeltaNetAdapter

        DeltaNetAdapter.install_fallbacks()
        mod = importlib.import_module("fla.layers.delta_net")
        current = mod.chunk_delta_rule
        while getattr(current, "_statereduce_guard", None) is not None:
            current = current._statereduce_inner
        mod.chunk_delta_rule = current


def model(folder: Path, tmp: Path) -> dict[str, Any]:
    from statereduce.adapters import get_adapter
    from statereduce.core.models import check_kernels, load_model, tiny_config

    import fla  # noqa: F401
    from transformers import AutoModelForCausalLM

    from statereduce.core.tokenizer import byte_level_tokenizer

    torch.manual_seed(0)
    cfg = tiny_config("delta_net", {"hidden_size": 128, "num_hidden_layers": 2, "num_heads": 8, "expand_k": 1.0,
                                    "expand_v": 4.0})  # d_k 16, d_v 64
    ckpt = tmp / "dn16x64"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(ckpt)
    byte_level_tokenizer().save_pretrained(ckpt)
    ids = torch.randint(0, 256, (2, 512))
    cpu, _ = load_model(ckpt)
    with torch.no_grad():
        want = cpu(ids).logits.float()

    def logits(m) -> float:
        with torch.no_grad(), torch.autocast(DEVICE, dtype=torch.bfloat16):
            got = m(ids.to(DEVICE)).logits.float().cpu()
        return float((got - want).norm() / want.norm())

    os.environ[check.POLICY_ENV] = "off"
    gpu, _ = load_model(ckpt, device=DEVICE)
    Unguarded.install_fallbacks()
    unchecked = logits(gpu)
    routes = [dataclasses.replace(r, setup="check_kernels_gpu:Unguarded") for r in get_adapter(gpu).kernel_routes()]
    os.environ[check.POLICY_ENV] = "fallback"
    t0 = time.perf_counter()
    record = check.check_routes(routes, DEVICE, folder=folder)
    first = time.perf_counter() - t0
    checked = logits(gpu)
    t0 = time.perf_counter()
    check.check_routes(routes, DEVICE, folder=folder)
    cached = time.perf_counter() - t0
    check.unroute()
    # load_model's own check on a guarded binding (what a job runs), with its record
    from statereduce.adapters.deltanet import DeltaNetAdapter

    importlib.import_module("fla.layers.delta_net").chunk_delta_rule = _guarded_again()
    DeltaNetAdapter.install_fallbacks()
    os.environ[check.CACHE_ENV] = str(tmp / "cache-load-model")  # an empty cache: load_model's first check
    t0 = time.perf_counter()
    job, _ = load_model(ckpt, device=DEVICE)
    load_s = time.perf_counter() - t0
    check_kernels(job, backward=True)
    return {"shape": "H 8 x d_k 16 x d_v 64, 2 layers, 2 x 512 tokens, bf16 autocast",
            "relative_logit_error_unchecked": unchecked, "relative_logit_error_checked": checked,
            "record": record, "first_s": round(first, 3), "cached_s": round(cached, 3),
            "guarded_job_logit_error": logits(job), "guarded_job_record": getattr(job, "_statereduce_kernel_check", None),
            "guarded_job_load_s": round(load_s, 3)}


def _guarded_again():
    from statereduce.kernels import shapes

    mod = importlib.import_module("fla.layers.delta_net")
    return shapes.guard(mod.chunk_delta_rule, "chunk_delta_rule")


def table(doc: dict[str, Any]) -> str:
    """The Markdown of docs/records/gpu_checks.md ("The kernel check on an H100") from a document this script wrote."""
    st = doc["stack"]
    lines = [f"On {st['gpu']} (torch {st['torch']}, Triton {st['triton']}, fla {st['fla']}); "
             f"`{doc['command']}`."]
    found = doc.get("jobs") if isinstance(doc.get("jobs"), list) else []
    if found:
        lines += ["", "| model | cut | job | routes | first check, s | cached, s | outcomes (largest relative error) |",
                  "| --- | --- | --- | ---: | ---: | ---: | --- |"]
    for j in found:
        kinds = sorted({f"{o[0]}" for o in j["outcomes"].values()})
        worst = max((o[1] for o in j["outcomes"].values() if o[1] is not None), default=None)
        said = ", ".join(kinds) + (f" ({worst:.1e})" if worst is not None else "")
        lines.append(f"| {j['model']} | {j['pct']} % | {j['job']} | {j['routes']} | {j['first_s']:.1f} | "
                     f"{j['cached_s']:.3f} | {said} |")
    m = doc.get("model", {})
    if "record" in m:
        lines += ["", f"A tiny DeltaNet ({m['shape']}) with fla's chunk kernel unguarded:", "",
                  "| run | relative logit error against float32 on the CPU |", "| --- | --- |",
                  f"| fla's kernel, no check | {m['relative_logit_error_unchecked']:.3g} |",
                  f"| after the check (fallback) | {m['relative_logit_error_checked']:.3g} |",
                  f"| a job's binding (zero-padding guard), `load_model`'s check | {m['guarded_job_logit_error']:.3g} |",
                  "", "| check | route | outcome | detail | path | seconds |", "| --- | --- | --- | --- | --- | ---: |"]
        for label, rec in (("unguarded, first", m["record"]), ("job: load_model, then backward", m["guarded_job_record"])):
            for e in rec:
                lines.append(f"| {label} | {e['kernel']} {e['pass']} | {e['outcome']} | {e['detail']} | {e['path']} | "
                             f"{'cached' if e['cached'] else format(e['seconds'], '.1f')} |")
        lines += ["", f"The unguarded check: {m['first_s']:.1f} s the first time, {m['cached_s']:.3f} s cached; "
                      f"`load_model` with its check: {m['guarded_job_load_s']:.1f} s (an empty outcome cache)."]
    raw = doc.get("raw_kernel", {})
    if raw.get("record"):
        lines += ["", "| fla's chunk DeltaNet kernel, unguarded, H 4 | pass | outcome | detail |",
                  "| --- | --- | --- | --- |"]
        for e in raw["record"]:
            lines.append(f"| d_k {e['shape']['d_k']} x d_v {e['shape']['d_v']} | {e['pass']} | {e['outcome']} | "
                         f"{e['detail'][:120]} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--parts", default="raw_kernel,model,jobs")
    ap.add_argument("--pcts", default="0,50,75", help="the cuts whose jobs the jobs part checks (default 0,50,75)")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the plumbing (no fla kernel runs)")
    ap.add_argument("--table", action="store_true", help="print the Markdown tables of the document OUT and exit")
    args = ap.parse_args(argv)
    if args.table:
        print(table(json.loads(args.out.read_text())), end="")
        return 0
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU: nothing to check", file=sys.stderr)
        return 2
    doc: dict[str, Any] = {"stack": check.stack(DEVICE), "tolerance": check.TOLERANCE,
                           "command": f"PYTHONPATH=scripts:. python scripts/check_kernels_gpu.py docs/results/{args.out.name}"}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for part in args.parts.split(","):
            folder = tmp / f"cache-{part}"  # each part starts with an empty outcome cache
            t0 = time.perf_counter()
            try:
                if part == "jobs":  # the document is rewritten after each job: a deadline keeps what finished
                    doc[part] = []
                    jobs(folder, doc[part], lambda: args.out.write_text(json.dumps(doc, indent=1, default=str)),
                         tuple(int(p) for p in args.pcts.split(",")))
                else:
                    doc[part] = model(folder, tmp) if part == "model" else raw_kernel(folder)
            except Exception:  # noqa: BLE001 (the other parts still run; the document says what broke)
                doc[part] = {"error": traceback.format_exc()}
            doc[part + "_s"] = round(time.perf_counter() - t0, 1)
            args.out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
            print(f"{part}: {doc[part + '_s']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
