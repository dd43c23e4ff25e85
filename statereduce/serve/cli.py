"""``python -m statereduce.serve``: serve checkpoints with vLLM and check them against transformers; render the tables.

::

    python -m statereduce.serve check sv-qwen/base=results/sv-qwen/base \\
        sv-qwen/drrqr-kv_75=results/sv-qwen/drrqr-kv_75/export/pruned --out serving.json [--throughput]
    python -m statereduce.serve tables serving.json

``check`` takes ``NAME=FOLDER`` pairs, names of the form ``MODEL/CUT``; ``MODEL/base`` is the unpruned model the
model's other rows are compared with. Each checkpoint runs in vLLM in a process of its own (the serving environment's
Python: ``--python``, ``$STATEREDUCE_SERVE_PYTHON``, or ``.venv-serve/bin/python``) at one KV-cache budget
(``--kv-cache-mib``), and the document (JSON) holds per checkpoint vLLM's tokens, its allocation, its message where it
refused the checkpoint, and the parity against transformers (:mod:`statereduce.serve.engine`). ``tables`` prints the
Markdown tables of docs/serving.md from such a document.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

DOC_FORMAT = 1


def _pair(text: str) -> tuple[str, str]:
    name, sep, folder = text.partition("=")
    if not sep or "/" not in name or not folder:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=FOLDER with NAME as MODEL/CUT "
                                         "(e.g. tiny-mamba2/drrqr_75=results/tiny-mamba2/drrqr_75/export/pruned)")
    if not (Path(folder) / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"{folder!r} (for {name}) is not a checkpoint folder: it has no config.json")
    return name, folder


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"--engine-args {text!r} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"--engine-args {text!r} is not a JSON object of vllm.LLM keyword arguments")
    return value


def _cpu() -> str:
    """The CPU's model name (/proc/cpuinfo) and torch's CPU capability."""
    import torch

    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, torch CPU capability {torch.backends.cpu.get_cpu_capability()}"


def check(pairs: Sequence[tuple[str, str]], out: Path, *, python: str | None, kv_cache_mib: float,
          throughput: bool, command: str, results: Path | None = None,
          engine_args: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Run :func:`~statereduce.serve.engine.check_checkpoint` on every pair and write the document to ``out``
    (a temporary file renamed into place); with ``results`` (the workflow's ``results/``), each pair's quality
    (:func:`cell_quality`)."""
    from statereduce.core.runtime import write_json
    from statereduce.serve.engine import check_checkpoint, serve_python

    python = str(serve_python(python))
    spec = {"prompt_len": 64, "max_tokens": 32, "max_batch": 512} if throughput else None
    doc = {"format": DOC_FORMAT, "made": datetime.date.today().isoformat(), "cpu": _cpu(), "command": command,
           "kv_cache_bytes": int(kv_cache_mib * (1 << 20)), "throughput": spec, "engine_args": dict(engine_args or {}),
           "checkpoints": {}}
    for name, folder in pairs:
        print(f"{name}: {folder}", file=sys.stderr)
        doc["checkpoints"][name] = check_checkpoint(folder, python=python, kv_cache_bytes=doc["kv_cache_bytes"],
                                                    throughput=spec, engine_args=engine_args)
        result = doc["checkpoints"][name]
        print(f"  {'served' if result['vllm']['ok'] else 'refused: ' + result['vllm']['error']}", file=sys.stderr)
        if results is not None:
            result["quality"] = cell_quality(results, name)
    write_json(out, doc)
    return doc


def cell_quality(results: Path, name: str) -> dict[str, Any] | None:
    """Held-out bits per byte of the workflow's cell ``MODEL/CUT`` under ``results`` (the workflow's ``results/``):
    ``{"base"}`` from ``MODEL/baseline/eval.json`` for ``MODEL/base``, else ``{"base", "pruned", "rft"}`` from the
    cell's summary ``MODEL/CUT/eval.json``; None where the workflow has not written it."""
    from statereduce.core.runtime import read_json

    model, cut = name.split("/", 1)
    if cut == "base":
        path = results / model / "baseline" / "eval.json"
        return {"base": _bpb(read_json(path)["metrics"])} if path.is_file() else None
    path = results / model / cut / "eval.json"
    if not path.is_file():
        return None
    metrics = read_json(path)["metrics"]
    return {stage: _bpb(metrics.get(key)) for stage, key in (("base", "baseline"), ("pruned", "pruned"),
                                                              ("rft", "rft"))}


def _bpb(metrics: Mapping[str, Any] | None) -> float | None:
    return ((metrics or {}).get("heldout") or {}).get("bits_per_byte")


def widths(state: Sequence[Mapping[str, Any]]) -> str:
    """``d_k × d_v`` of a checkpoint's linear-attention layers: one pair, or each layer's where they differ."""
    pairs = [(row["d_k"], row["d_v"]) for row in state]
    if len(set(pairs)) == 1:
        return f"{pairs[0][0]} × {pairs[0][1]}"
    return "per layer: " + ", ".join(f"{k} × {v}" for k, v in pairs)


def tables(doc: Mapping[str, Any]) -> str:
    """The Markdown tables of a ``check`` document: parity of every served checkpoint, the engine's message for every
    refused one, and vLLM's allocation (with the throughput of one batch at its largest size) against each model's
    base."""
    rows = doc["checkpoints"]
    served = {n: r for n, r in rows.items() if r["vllm"]["ok"]}
    refused = {n: r for n, r in rows.items() if not r["vllm"]["ok"]}
    tol = next((r["parity"]["gap_tol"] for r in served.values()), None)
    out = [f"vLLM {_vllm_version(rows)} on {doc['cpu']}, {doc['made']}; KV-cache budget "
           f"{doc['kv_cache_bytes'] / (1 << 20):g} MiB, weights in bf16; `{doc['command']}`.", ""]
    if served:
        out += ["| checkpoint | d_k × d_v | tokens as transformers' | within the tolerance | largest gap (nats) | "
                "largest \\|Δ log p\\| | first divergence |", "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
        for name, r in served.items():
            p = r["parity"]
            row = next((row for row in p["rows"] if "first_divergence" in row), None)
            where = "none" if row is None else (f"prompt {row['prompt']}, token {row['first_divergence']['position']}: "
                                                f"gap {row['first_divergence']['gap']:.3f}")
            out.append(f"| {name} | {widths(r['state'])} | {p['match']} of {p['prompts']} | {p['agree']} of "
                       f"{p['prompts']} | {p['max_gap']:.3f} | {p['max_logprob_diff']:.3f} | {where} |")
        out += ["", f"Greedy decoding of 8 prompts, 32 tokens each. Gap: the float32 reference's best log-probability "
                f"minus that of the token vLLM chose, on vLLM's own tokens; within the tolerance: every gap at most "
                f"{tol} nats.", ""]
    if refused:
        out += ["| checkpoint | d_k × d_v | refused at | vLLM's message |", "| --- | --- | --- | --- |"]
        for name, r in refused.items():
            out.append(f"| {name} | {widths(r['state'])} | {r['vllm']['stage']} | `{_cell(r['vllm']['error'])}` |")
            again = r.get("vllm_remote_code")
            if again is not None:
                out.append(f"| {name}, `trust_remote_code=True` | | {again.get('stage', 'served')} | "
                           + (f"`{_cell(again['error'])}` |" if not again["ok"] else "served |"))
        out.append("")
    quality = {n: r for n, r in rows.items() if r.get("quality")}
    if quality:
        out += ["| checkpoint | d_k × d_v | vLLM CPU serves it | vLLM CUDA (its source) | bits per byte: pruned | "
                "after RFT | above the base, after RFT |", "| --- | --- | --- | --- | ---: | ---: | ---: |"]
        for name, r in quality.items():
            q = r["quality"]
            base = q.get("base")
            after = q.get("rft", base if name.endswith("/base") else None)
            loss = f"{after - base:+.4f}" if after is not None and base is not None else "–"
            cuda = next((v["serves"] for v in r.get("verdicts", []) if "CUDA" in v["engine"]), "–")
            out.append(f"| {name} | {widths(r['state'])} | {'yes' if r['vllm']['ok'] else 'no'} | {cuda} | "
                       f"{_num(q.get('pruned', base))} | {_num(after)} | {loss} |")
        out += ["", "Held-out bits per byte (lower is better) of the workflow's cells: the pruned checkpoint and the "
                "one recovery fine-tuning made of it (the base's in both columns of its row). vLLM CPU: measured in "
                "this run; vLLM CUDA: the verdict of `statereduce.core.engines` (expected: its source admits the "
                "shape; not run).", ""]
    if served:
        out += ["| checkpoint | state page (bytes) | attention block (tokens) | blocks | largest concurrency | "
                "batch | tokens/s | × base |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for name, r in served.items():
            a, t = r["vllm"]["allocation"], r["vllm"].get("throughput") or {}
            mamba = [g for g in a["groups"] if g["kind"] == "MambaSpec"]
            page = mamba[0]["page_bytes"] if mamba else None
            base = served.get(name.split("/")[0] + "/base")
            ratio = ""
            if base is not None and t and (base["vllm"].get("throughput") or {}).get("tokens_per_s"):
                ratio = f"{t['tokens_per_s'] / base['vllm']['throughput']['tokens_per_s']:.2f}"
            out.append(f"| {name} | {page:,} | {a['block_size']} | {a['num_blocks']:,} | {a['max_concurrency']:.1f} | "
                       + (f"{t['batch']} | {t['tokens_per_s']:.0f} | {ratio} |" if t else "– | – | – |"))
        out += ["", "Read from vLLM's engine: the state page of the linear-attention layers (padded to the attention "
                "page in a hybrid), the attention block size vLLM chose to match it, the number of blocks and the "
                "largest concurrency for a request of the model length. Throughput: one batch of that many sequences "
                + (f"({doc['throughput']['prompt_len']}-token prompts, {doc['throughput']['max_tokens']} tokens each "
                   "decoded greedily), " if doc.get("throughput") else "")
                + "output tokens per second, each checkpoint after the one before it in one run."]
    return "\n".join(out)


def _num(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("`", "'")


def _vllm_version(rows: Mapping[str, Any]) -> str:
    return next((r["vllm"]["versions"]["vllm"] for r in rows.values() if r["vllm"].get("versions")), "?")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m statereduce.serve",
                                description="Serve checkpoints with vLLM, check them against transformers, and print "
                                            "the tables of docs/serving.md.")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="serve checkpoints with vLLM and check them against transformers")
    c.add_argument("pairs", nargs="+", type=_pair, metavar="MODEL/CUT=FOLDER")
    c.add_argument("--out", type=Path, required=True, help="the document to write (JSON)")
    c.add_argument("--python", help="the serving environment's Python (default: $STATEREDUCE_SERVE_PYTHON or "
                                     ".venv-serve/bin/python)")
    c.add_argument("--kv-cache-mib", type=float, default=64.0, help="vLLM's KV-cache budget (default 64 MiB)")
    c.add_argument("--engine-args", type=_json_object, default={}, metavar="JSON",
                   help="more keyword arguments of vllm.LLM, e.g. on a Hopper GPU for d_k != d_v: "
                        "'{\"additional_config\": {\"gdn_prefill_backend\": \"triton\"}}'")
    c.add_argument("--results", type=Path, help="the workflow's results/ folder: each MODEL/CUT's held-out bits per "
                   "byte before and after RFT go into the document (its quality table)")
    c.add_argument("--throughput", action="store_true",
                   help="also decode one batch at the largest concurrency vLLM admits, and time it")
    t = sub.add_parser("tables", help="print the Markdown tables of a check document")
    t.add_argument("doc", type=Path)
    args = p.parse_args(argv)
    from statereduce.core.runtime import read_json

    if args.cmd == "check":
        try:
            command = "python -m statereduce.serve " + " ".join(sys.argv[1:] if argv is None else argv)
            check(args.pairs, args.out, python=args.python, kv_cache_mib=args.kv_cache_mib,
                  throughput=args.throughput, results=args.results, engine_args=args.engine_args, command=command)
        except (FileNotFoundError, RuntimeError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    doc = read_json(args.doc)
    if doc.get("format") != DOC_FORMAT:
        print(f"error: {args.doc} is not a serve check document (format {doc.get('format')!r}, "
              f"expected {DOC_FORMAT})", file=sys.stderr)
        return 1
    print(tables(doc))
    return 0
