#!/usr/bin/env python
"""Sweep fla's delta-rule kernels over every head shape state reduction can give, on a CUDA GPU.

For DeltaNet and Gated DeltaNet, the chunk and the fused recurrent kernel, and a grid of head shapes d_k' x d_v': one
process per case runs the kernel forward and backward on bf16 inputs (q and k L2-normalised in the kernel, as fla's
layers call it; an initial state; the final state returned) and compares the output, the final state and the
gradients of q, k, v, beta (g) and the initial state with the float64 per-step recurrence
:func:`statereduce.kernels.reference.delta_rule`. A process per case, because an illegal memory access loses the CUDA
context.

Two grids (``--grid``):

- ``keys`` (the default): each key width d_k' that the ratio grid (``--pcts``, percent of key channels removed, plus
  the unpruned width) gives for d_k in ``--d-k`` {64, 128, 256}, times each d_v in ``--d-v`` {64, 128, 256, 512}.
  ``--padded`` cases call the chunk kernels through :func:`statereduce.kernels.shapes.call_padded` with q and k
  zero-padded to 64 channels at d_k' < 64, as the adapters route faulty shapes.
- ``values``: the value widths d_v' that the same ratios give for d_v in ``--d-v`` (the widths the keys grid did not
  already run at every key width), times ``--key-widths`` (d_k in {64, 128, 256} and the pruned widths whose key tile
  differs), plus the joint cuts ``--joint`` (d_k' x d_v' near 0.71 x (d_k x d_v): half the state with both sides cut).
  Then, for the chunk kernels (``--padded auto``), padded calls: q and k padded as
  :data:`statereduce.kernels.shapes.FAULTY` pads them wherever that rule does, and v zero-padded (to 64, or the next
  power of two) wherever the stock call failed, so one run shows whether the key guard covers small value widths and
  whether value padding repairs a value width that fails. ``--device cpu`` runs the same cases on the torch kernels
  of :mod:`statereduce.kernels.fla_fallback` (a dry run of the grid, the padded calls and the reference).

Usage::

    python scripts/sweep_fla_shapes.py OUT.json [--gpus 2] [--jobs 24] [--T 1024]
    python scripts/sweep_fla_shapes.py OUT.json --grid values [--families delta_net] [--kernels chunk]
    python scripts/sweep_fla_shapes.py OUT.json --grid values --resume EARLIER.json [MORE.json]  # what they lack
    python scripts/sweep_fla_shapes.py --case delta_net,chunk,16,64,0   # one case, prints its JSON line
    python scripts/sweep_fla_shapes.py --case delta_net,chunk,64,48,v64 # v padded to 64 channels (k64v64: both)

Status of a case: ``ok`` (every relative error below ``--tol``), ``wrong`` (a finite error above it), ``refused``
(fla raised its own refusal, e.g. the Gated DeltaNet chunk backward on Hopper with Triton < 3.7.1, or the
fused-recurrent Gated DeltaNet backward it does not implement; the forward was right), ``error`` (the kernel raised
otherwise), ``crash`` (the process died, e.g. an illegal memory access). Paper: Nazari & Rusch (2026), Sec. 3 (the
pruned state d_v x d_k').
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = {
    ("delta_net", "chunk"): "chunk_delta_rule",
    ("delta_net", "fused_recurrent"): "fused_recurrent_delta_rule",
    ("gated_deltanet", "chunk"): "chunk_gated_delta_rule",
    ("gated_deltanet", "fused_recurrent"): "fused_recurrent_gated_delta_rule",
}


def key_widths(d_ks: list[int], pcts: list[float]) -> list[int]:
    """Every d_k' of the grid: ``round(d_k * (1 - pct/100))`` for each d_k and pct, and each d_k itself."""
    sys.path.insert(0, str(ROOT))
    from statereduce.selectors.registry import n_keep_for

    out = set(d_ks)
    for d_k in d_ks:
        for pct in pcts:
            out.add(n_keep_for(d_k, pct))
    return sorted(out)


#: messages with which fla refuses a call by design (not a failure of the kernel at that shape)
REFUSALS = ("NotImplementedError:", "produces incorrect results")

#: joint cuts of the values grid: d_k' x d_v' of about 0.71 x (d_k x d_v) in multiples of 8 and 16 (half the state
#: with both sides cut), for d_k = d_v in {64, 128, 256} and for Gated DeltaNet's 256 x 512
JOINT = ((48, 48), (88, 88), (96, 96), (176, 176), (184, 184), (176, 368), (184, 360))

#: key widths of the values grid: d_k in {64, 128, 256} and the pruned widths with another key tile (16, 32: the
#: tiles of the DeltaNet chunk failures; 48: a masked 64-wide tile)
VALUE_GRID_KEY_WIDTHS = (16, 32, 48, 64, 128, 256)


def value_widths(d_vs: list[int], pcts: list[float]) -> list[int]:
    """Every d_v' of the grid: ``round(d_v * (1 - pct/100))`` for each d_v and pct, and each d_v itself."""
    return key_widths(d_vs, pcts)


def parse_pad(spec: str, d_k: int) -> tuple[int | None, int | None]:
    """A case's padding field as (key width, value width), None for a side not padded: ``0`` (none), ``1`` (q and k to
    max(64, d_k): the keys grid's padded cases), or ``k<W>``, ``v<W>``, ``k<W>v<W>``."""
    if spec in ("0", "1"):
        return (max(64, d_k) if spec == "1" else None), None
    import re

    m = re.fullmatch(r"(?:k(\d+))?(?:v(\d+))?", spec)
    if not spec or m is None:
        raise ValueError(f"padding {spec!r}: give 0, 1, k<W>, v<W> or k<W>v<W>")
    return (int(m[1]) if m[1] else None), (int(m[2]) if m[2] else None)


def pad_spec(pad_k: int | None, pad_v: int | None) -> str:
    """The case field of :func:`parse_pad` for (key width, value width)."""
    return (f"k{pad_k}" if pad_k else "") + (f"v{pad_v}" if pad_v else "") or "0"


def _pad_fields(padded: bool | str, d_k: int) -> dict:
    """A case's padding as its record holds it: ``padded`` (bool), and ``pad_k``, ``pad_v`` for the values grid's
    padding specs (``k<W>``, ``v<W>``, ``k<W>v<W>``; the keys grid's ``0`` / ``1`` records only ``padded``)."""
    if isinstance(padded, bool) or padded in ("0", "1"):
        return {"padded": padded if isinstance(padded, bool) else padded == "1"}
    pad_k, pad_v = parse_pad(padded, d_k)
    return {"padded": bool(pad_k or pad_v), "pad_k": pad_k, "pad_v": pad_v}


def run_case(family: str, kernel: str, d_k: int, d_v: int, padded: bool | str, T: int, B: int = 1,
             H: int = 2, device: str = "cuda") -> dict:
    """One case: fla's kernel (``device="cpu"``: the torch kernels of :mod:`statereduce.kernels.fla_fallback`, a dry
    run of the case without a GPU) against the float64 recurrence; the record without its status
    (:func:`classify`)."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT))
    from statereduce.kernels.reference import delta_rule
    from statereduce.kernels.shapes import call_padded

    if device == "cpu":
        from statereduce.kernels import fla_fallback

        fn = getattr(fla_fallback, KERNELS[family, kernel])
    else:
        import fla.ops.delta_rule as dr
        import fla.ops.gated_delta_rule as gdr

        fn = {**vars(dr), **vars(gdr)}[KERNELS[family, kernel]]
    gen = torch.Generator(device=device).manual_seed(1000 * d_k + d_v)
    dev, bf = device, torch.bfloat16

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=dev) * scale).to(bf)

    q, k, v = rnd(B, T, H, d_k), rnd(B, T, H, d_k), rnd(B, T, H, d_v)
    beta = torch.rand(B, T, H, generator=gen, device=dev).to(bf)
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen, device=dev) + 3) if family == "gated_deltanet" else None
    h0 = torch.randn(B, H, d_k, d_v, generator=gen, device=dev) * 0.1
    do, dh = torch.randn(B, T, H, d_v, generator=gen, device=dev), torch.randn(B, H, d_k, d_v, generator=gen, device=dev)
    leaves = {"q": q, "k": k, "v": v, "beta": beta, "h0": h0, **({"g": g} if g is not None else {})}
    scale = d_k**-0.5
    fields = _pad_fields(padded, d_k)
    pad_k, pad_v = fields.get("pad_k"), fields.get("pad_v")
    if fields["padded"] and "pad_k" not in fields:  # the keys grid's padded case: q and k to max(64, d_k)
        pad_k = max(64, d_k)
    doc: dict = {"family": family, "kernel": kernel, "d_k": d_k, "d_v": d_v, **fields, "T": T}

    # reference in float64 (q, k normalised outside: the kernel normalises in float32)
    ref_in = {n: t.detach().double().requires_grad_() for n, t in leaves.items()}
    qn, kn = F.normalize(ref_in["q"], dim=-1), F.normalize(ref_in["k"], dim=-1)
    o_ref, s_ref = delta_rule(qn, kn, ref_in["v"], ref_in["beta"], ref_in.get("g"), scale=scale,
                              initial_state=ref_in["h0"])
    ((o_ref * do.double()).sum() + (s_ref * dh.double()).sum()).backward()

    args = dict(scale=scale, initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ins = {n: t.detach().clone().requires_grad_() for n, t in leaves.items()}
    args["initial_state"] = ins["h0"]
    call = (lambda *a, **kw: call_padded(fn, pad_k, *a, value_width=pad_v, **kw)) if doc["padded"] else fn
    try:
        if family == "gated_deltanet":
            o, s = call(ins["q"], ins["k"], ins["v"], g=ins["g"], beta=ins["beta"], **args)
        else:
            o, s = call(ins["q"], ins["k"], ins["v"], ins["beta"], **args)
        if device == "cuda":
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 -- fla refuses some shapes / backwards with an exception: record it
        return {**doc, "status": "error", "stage": "forward", "message": f"{type(e).__name__}: {e}"[:400]}

    def rel(a, b):
        a, b = a.detach().double(), b.detach().double()
        return float((a - b).norm() / b.norm().clamp_min(1e-30))

    doc["forward"] = {"o": rel(o, o_ref), "final_state": rel(s, s_ref)}
    try:
        ((o.float() * do).sum() + (s.float() * dh).sum()).backward()
        if device == "cuda":
            torch.cuda.synchronize()
        doc["backward"] = {f"d{n}": rel(ins[n].grad, ref_in[n].grad) for n in leaves}
    except Exception as e:  # noqa: BLE001
        doc["backward_error"] = f"{type(e).__name__}: {e}"[:400]
    return doc


def refused(message: str) -> bool:
    """Whether ``message`` is one of fla's refusals by design (:data:`REFUSALS`)."""
    return any(r in message for r in REFUSALS)


def classify(doc: dict, tol: float) -> dict:
    if "status" in doc:
        if doc["status"] == "error" and refused(doc.get("message", "")):
            doc["status"] = "refused"
        return doc
    errs = {**doc["forward"], **doc.get("backward", {})}
    worst = max(errs.values())
    doc["max_rel_error"] = worst
    if worst != worst or worst > tol:  # NaN or above tolerance
        doc["status"] = "wrong"
    elif "backward_error" in doc:
        doc["stage"] = "backward"
        doc["message"] = doc.pop("backward_error")
        doc["status"] = "refused" if refused(doc["message"]) else "error"
    else:
        doc["status"] = "ok"
    return doc


def _case_head(case: tuple) -> dict:
    """The fields that name a case (the document's keys), for a case that left no JSON line."""
    family, kernel, d_k, d_v, padded = case
    return {"family": family, "kernel": kernel, "d_k": d_k, "d_v": d_v, **_pad_fields(padded, d_k)}


def record_key(c: dict) -> tuple:
    """The case tuple (family, kernel, d_k, d_v, padding spec) a record was run for (``0``/``1`` for the keys grid's
    stock/padded cases, :func:`pad_spec` for the values grid's)."""
    pad = pad_spec(c.get("pad_k"), c.get("pad_v")) if "pad_v" in c else str(int(bool(c["padded"])))
    return c["family"], c["kernel"], c["d_k"], c["d_v"], pad


def merged_runs(docs: list[dict]) -> dict:
    """The records of several earlier runs as one ``{"cases": [...]}``: for a case recorded more than once, the first
    record that is not a ``crash`` (else its first record)."""
    chosen: dict[tuple, dict] = {}
    for doc in docs:
        for c in doc["cases"]:
            key = record_key(c)
            if key not in chosen or (chosen[key]["status"] == "crash" and c["status"] != "crash"):
                chosen[key] = c
    return {"cases": list(chosen.values())}


def resumed(previous: dict, cases: list[tuple]) -> tuple[list[dict], list[tuple]]:
    """(the records of ``previous`` to keep, the cases still to run): a case with a record that is not a ``crash``
    (the process died or timed out, which says nothing of the kernel) is not run again."""
    keep = [c for c in previous["cases"] if c["status"] != "crash"]
    done = {record_key(c) for c in keep}
    return keep, [c for c in cases if (*c[:4], str(int(c[4])) if isinstance(c[4], bool) else c[4]) not in done]


def _spawn(case: tuple, gpu: int, T: int, tol: float, timeout: float, device: str = "cuda") -> dict:
    family, kernel, d_k, d_v, padded = case
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)}
    t0 = time.perf_counter()
    pad = str(int(padded)) if isinstance(padded, bool) else padded
    cmd = [sys.executable, __file__, "--case", f"{family},{kernel},{d_k},{d_v},{pad}", "--T", str(T),
           "--device", device]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**_case_head(case), "status": "crash", "message": f"timed out after {timeout:.0f} s"}
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = [x for x in p.stderr.strip().splitlines() if "Warning" not in x][-3:]
        return {**_case_head(case), "status": "crash", "returncode": p.returncode,
                "message": " | ".join(tail)[-400:]}
    doc = classify(json.loads(lines[-1]), tol)
    doc["seconds"] = round(time.perf_counter() - t0, 1)
    return doc


def keys_grid_cases(args) -> tuple[dict, list[tuple], list[tuple]]:
    """The keys grid: (document fields, stock cases, padded cases)."""
    widths = key_widths(args.d_k, args.pcts)
    stock = [(f, kern, dk, dv, False) for f in args.families for kern in args.kernels
             for dk in widths for dv in args.d_v]
    padded = ([(f, kern, dk, dv, True) for f, kern, dk, dv, _ in stock if dk < 64 and kern == "chunk"]
              if args.padded != "none" else [])
    meta = {"d_k": args.d_k, "pcts": args.pcts, "key_widths": widths, "d_v": args.d_v}
    return meta, stock, padded


def value_grid_shapes(d_vs: list[int], pcts: list[float], key_widths_: list[int],
                      joint: list[tuple[int, int]]) -> tuple[list[int], list[tuple[int, int]]]:
    """The values grid's (new value widths, head shapes): every d_v' of the ratio grid that is not one of ``d_vs``
    (the keys grid ran those at every key width) times ``key_widths_``, then the ``joint`` shapes not already in."""
    widths = [w for w in value_widths(d_vs, pcts) if w not in d_vs]
    shapes_ = [(dk, dv) for dk in key_widths_ for dv in widths]
    shapes_ += [s for s in dict.fromkeys(map(tuple, joint)) if s not in shapes_]
    return widths, shapes_


def values_grid_cases(args) -> tuple[dict, list[tuple]]:
    """The values grid: (document fields, stock cases)."""
    widths, shapes_ = value_grid_shapes(args.d_v, args.pcts, args.key_widths, args.joint)
    stock = [(f, kern, dk, dv, "0") for f in args.families for kern in args.kernels for dk, dv in shapes_]
    meta = {"grid": "values", "d_v": args.d_v, "pcts": args.pcts, "key_widths": args.key_widths,
            "value_widths": widths, "joint": [list(j) for j in args.joint], "shapes": [list(s) for s in shapes_]}
    return meta, stock


def _next_pow2(d: int) -> int:
    return 1 << max(d - 1, 0).bit_length()


def failed(case: dict) -> bool:
    """Whether stock fla failed in ``case`` (wrong, crashed, or raised other than by a refusal by design)."""
    return case["status"] in ("wrong", "crash", "error")


def padded_followups(results: list[dict]) -> list[tuple]:
    """The values grid's padded cases, chosen from its stock results: for each chunk-kernel shape, q and k padded
    where :data:`statereduce.kernels.shapes.FAULTY` pads them, and where the stock call failed also v zero-padded
    (to ``max(PAD_TO, next power of two)``; with the key padding where the rule pads keys)."""
    from statereduce.kernels.shapes import PAD_TO, padded_width

    out = []
    for c in results:
        if c["kernel"] != "chunk" or c["padded"]:
            continue
        name = KERNELS[c["family"], c["kernel"]]
        dk, dv = c["d_k"], c["d_v"]
        pad_k = padded_width(name, dk, dv, backward=True)
        pad_v = max(PAD_TO, _next_pow2(dv))
        pad_v = pad_v if pad_v > dv else 2 * dv
        if pad_k:
            out.append((c["family"], c["kernel"], dk, dv, pad_spec(pad_k, None)))
        if failed(c):
            out.append((c["family"], c["kernel"], dk, dv, pad_spec(pad_k, pad_v)))
    return out


def _run(cases: list[tuple], doc: dict, args, t0: float) -> list[dict]:
    """Run ``cases`` (one process each, ``--jobs`` at a time over ``--gpus``), append their records to ``doc`` and
    write it after each case (a run cut off by a deadline keeps every case it finished); returns the records."""
    done = []
    with cf.ThreadPoolExecutor(args.jobs) as pool:
        futs = [pool.submit(_spawn, c, i % args.gpus, args.T, args.tol, args.timeout, args.device)
                for i, c in enumerate(cases)]
        for n, fut in enumerate(cf.as_completed(futs), 1):
            r = fut.result()
            done.append(r)
            doc["cases"].append(r)
            pad = pad_spec(r.get("pad_k"), r.get("pad_v")) if "pad_v" in r else ("padded" if r["padded"] else "")
            print(f"[{n}/{len(cases)} {time.perf_counter() - t0:.0f}s] {r['family']} {r['kernel']} {r['d_k']}x{r['d_v']}"
                  f"{' ' + pad if r['padded'] else ''}: {r['status']} {r.get('max_rel_error', r.get('message', ''))}",
                  flush=True)
            _write(doc, args.out)
    return done


def _sort_key(c: dict) -> tuple:
    return (c["family"], c["kernel"], c["padded"], c["d_k"], c["d_v"], c.get("pad_k") or 0, c.get("pad_v") or 0)


def _write(doc: dict, out: Path) -> None:
    """Write ``doc`` to ``out`` atomically: a run killed mid-write leaves the last whole document."""
    sys.path.insert(0, str(ROOT))
    from statereduce.core.runtime import write_text_atomic

    doc["cases"].sort(key=_sort_key)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, json.dumps(doc, indent=1) + "\n")


def parse_joint(spec: str) -> tuple[int, int]:
    """``--joint``'s ``DKxDV``."""
    try:
        dk, dv = (int(x) for x in spec.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"joint shape {spec!r}: give d_k'xd_v', e.g. 88x88") from None
    return dk, dv


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, nargs="?")
    p.add_argument("--case", help="family,kernel,d_k,d_v,padded: run one case in this process (padded: 0, 1, k<W>, "
                                  "v<W> or k<W>v<W>)")
    p.add_argument("--grid", choices=["keys", "values"], default="keys",
                   help="keys: d_k' of the ratio grid x d_v; values: d_v' of the ratio grid x --key-widths, "
                        "and --joint")
    p.add_argument("--T", type=int, default=1024)
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--jobs", type=int, default=8)
    p.add_argument("--tol", type=float, default=0.05, help="largest relative error of a right result (bf16: ~1e-2)")
    p.add_argument("--d-k", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--d-v", type=int, nargs="+", default=[64, 128, 256, 512])
    p.add_argument("--pcts", type=float, nargs="+", default=[25, 50, 75, 87.5])
    p.add_argument("--key-widths", type=int, nargs="+", default=list(VALUE_GRID_KEY_WIDTHS),
                   help="the values grid's key widths")
    p.add_argument("--joint", type=parse_joint, nargs="*", default=list(JOINT), metavar="DKxDV",
                   help="the values grid's joint cuts (default: %(default)s)")
    p.add_argument("--families", nargs="+", default=["delta_net", "gated_deltanet"])
    p.add_argument("--kernels", nargs="+", choices=["chunk", "fused_recurrent"], default=["chunk", "fused_recurrent"])
    p.add_argument("--padded", choices=["none", "below64", "all", "auto"], default=None,
                   help="keys grid (below64, the default): also run the chunk kernels with q and k zero-padded to 64 "
                        "at d_k' < 64; values grid (auto, the default): padded calls chosen from the stock results "
                        "(padded_followups); none: no padded case")
    p.add_argument("--timeout", type=float, default=400)
    p.add_argument("--resume", type=Path, nargs="+", metavar="PREVIOUS.json",
                   help="keep the records of earlier runs of the same grid (one or more documents, e.g. a run "
                        "limited by --families or --key-widths) and run only the cases they lack or that crashed or "
                        "timed out there")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: a dry run on the torch kernels of statereduce.kernels.fla_fallback (no GPU; checks the "
                        "grid, the padded calls and the reference, not fla)")
    return p


def main() -> None:
    args = parser().parse_args()
    if args.case:
        family, kernel, d_k, d_v, padded = args.case.split(",")
        pad: bool | str = bool(int(padded)) if padded in ("0", "1") else padded
        print(json.dumps(run_case(family, kernel, int(d_k), int(d_v), pad, args.T, device=args.device)), flush=True)
        return
    import torch

    args.padded = args.padded or ("auto" if args.grid == "values" else "below64")
    if args.grid == "keys":
        meta, stock, padded = keys_grid_cases(args)
    else:
        meta, stock = values_grid_cases(args)
        padded = []
    # widest first: the cases that compile the most kernels start early; padded ones last (their kernels exist)
    cases = sorted(stock, key=lambda c: -c[2] * c[3]) + padded
    doc = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (torch kernels of fla_fallback)",
        "torch": torch.__version__,
        "fla": __import__("fla").__version__,
        "triton": __import__("triton").__version__,
        "T": args.T, "batch": 1, "heads": 2, "dtype": "bfloat16", "tol": args.tol,
        **meta,
        "cases": [],
    }
    kept: list[dict] = []
    if args.resume:
        earlier = [json.loads(path.read_text()) for path in args.resume]
        kept, cases = resumed(merged_runs(earlier), cases)
        doc["cases"] = list(kept)
        doc["resumed_from"] = [{"file": path.name, "device": d.get("device"), "cases": len(d["cases"])}
                               for path, d in zip(args.resume, earlier)]
        print(f"{len(kept)} cases kept from {', '.join(map(str, args.resume))}, {len(cases)} to run", flush=True)
    t0 = time.perf_counter()
    results = _run(cases, doc, args, t0)
    if args.grid == "values" and args.padded != "none":
        stock = [c for c in kept if not c["padded"]] + results
        _, follow = resumed({"cases": kept}, padded_followups(stock))
        print(f"{len(follow)} padded cases chosen from the stock results", flush=True)
        _run(follow, doc, args, t0)
    doc["seconds"] = round(time.perf_counter() - t0, 1)
    _write(doc, args.out)
    bad = [c for c in doc["cases"] if c["status"] not in ("ok", "refused")]
    n_refused = sum(c["status"] == "refused" for c in doc["cases"])
    print(f"{len(doc['cases'])} cases, {n_refused} refused by fla, {len(bad)} not ok otherwise:")
    for c in bad:
        pad = pad_spec(c.get("pad_k"), c.get("pad_v")) if "pad_v" in c else ("padded" if c["padded"] else "")
        print(" ", c["family"], c["kernel"], f"{c['d_k']}x{c['d_v']}", pad, c["status"],
              c.get("max_rel_error", c.get("message", "")))


if __name__ == "__main__":
    main()
