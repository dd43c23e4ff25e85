"""One checkpoint in vLLM: greedy decoding, what the engine allocates, one batch's throughput. Runs in the serving
environment (``envs/serve-cpu.txt``), never in statereduce's: it imports the standard library and vLLM only, and
statereduce starts it as a script (:func:`statereduce.serve.engine.run_vllm`).

::

    .venv-serve/bin/python statereduce/serve/vllm_worker.py JOB.json OUT.json

``JOB.json``: ``{"model": folder, "prompts": [[token ids], ...], "max_tokens": 32, "dtype": "bfloat16",
"max_model_len": 512, "kv_cache_bytes": int, "max_num_seqs": int, "throughput": {"prompt_len", "max_tokens",
"max_batch"} or null}``. ``OUT.json`` gets ``{"ok": true, "allocation", "generations", "throughput", "versions",
"load_s"}``, or ``{"ok": false, "stage": "load" | "generate", "error": the engine's own message}``: a checkpoint the
engine refuses is a result, not a crash. The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that
its allocation is read from its own objects: the scheduler's ``KVCacheConfig`` and the cache config it resolved.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
import traceback


def _error(exc: BaseException) -> str:
    """The engine's message: the exception's type and its first line that says something (a pydantic validation
    error's first line only counts the errors: its second holds the message)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if len(lines) > 1 and "validation error" in lines[0]:
        lines = lines[1:]
    text = lines[0] if lines else ""
    end = text.find(". ", 40)  # the first sentence: what follows repeats the path or says where to read more
    return f"{type(exc).__name__}: {text[:end + 1] if end > 0 else text[:300]}"


def _allocation(llm) -> dict:
    """What vLLM allocated, read from the engine: per KV-cache group its spec's page bytes, block size, and state
    shapes and dtypes (Mamba-type groups), the number of blocks, the token capacity and the largest concurrency for a
    request of ``max_model_len`` tokens as vLLM computed them."""
    config = llm.llm_engine.vllm_config
    cache = config.cache_config
    kv = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    groups = []
    for group in kv.kv_cache_groups:
        spec = group.kv_cache_spec
        entry = {"kind": type(spec).__name__, "layers": len(group.layer_names), "page_bytes": spec.page_size_bytes,
                 "block_size": spec.block_size}
        if hasattr(spec, "shapes"):
            entry["shapes"] = [list(s) for s in spec.shapes]
            entry["dtypes"] = [str(d).replace("torch.", "") for d in spec.dtypes]
            entry["real_page_bytes"] = spec.real_page_size_bytes
        groups.append(entry)
    return {"num_blocks": kv.num_blocks, "block_size": cache.block_size,
            "mamba_page_size_padded": cache.mamba_page_size_padded, "kv_cache_tokens": cache.kv_cache_size_tokens,
            "max_concurrency": cache.kv_cache_max_concurrency, "max_model_len": config.model_config.max_model_len,
            "mamba_ssm_cache_dtype": cache.mamba_ssm_cache_dtype, "groups": groups}


def _throughput(llm, spec: dict, capacity: float) -> dict:
    """Greedy decoding of one batch as large as the engine admits (vLLM's concurrency, at most ``max_batch``): wall
    time of ``llm.generate`` and output tokens per second."""
    from vllm import SamplingParams

    batch = max(1, min(int(capacity), int(spec["max_batch"])))
    prompts = [{"prompt_token_ids": [(7 * i + j) % 200 + 32 for j in range(spec["prompt_len"])]} for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"batch": batch, "prompt_len": spec["prompt_len"], "max_tokens": spec["max_tokens"], "wall_s": wall,
            "output_tokens": tokens, "tokens_per_s": tokens / wall}


def run(job: dict) -> dict:
    """The job's result (the module docstring's ``OUT.json``)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm
    from vllm import LLM, SamplingParams

    out: dict = {"versions": {"vllm": vllm.__version__, "python": platform.python_version(),
                              "cpu": platform.processor() or platform.machine()}}
    start = time.perf_counter()
    try:
        llm = LLM(model=job["model"], dtype=job.get("dtype", "bfloat16"), max_model_len=job.get("max_model_len", 512),
                  max_num_seqs=job.get("max_num_seqs", 256), kv_cache_memory_bytes=job["kv_cache_bytes"],
                  enforce_eager=True, seed=0, **job.get("engine_args", {}))
    except Exception as exc:  # noqa: BLE001 - the engine's refusal is the result
        return {**out, "ok": False, "stage": "load", "error": _error(exc), "traceback": traceback.format_exc()[-4000:]}
    out["load_s"] = time.perf_counter() - start
    out["allocation"] = _allocation(llm)
    params = SamplingParams(temperature=0.0, max_tokens=job.get("max_tokens", 32), logprobs=1, ignore_eos=True)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], params, use_tqdm=False)
    except Exception as exc:  # noqa: BLE001
        return {**out, "ok": False, "stage": "generate", "error": _error(exc),
                "traceback": traceback.format_exc()[-4000:]}
    out["generations"] = [{"tokens": list(o.outputs[0].token_ids),
                           "logprobs": [step[tok].logprob for tok, step in zip(o.outputs[0].token_ids,
                                                                               o.outputs[0].logprobs)]}
                          for o in outs]
    if job.get("throughput"):
        out["throughput"] = _throughput(llm, job["throughput"], out["allocation"]["max_concurrency"])
    return {**out, "ok": True}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: vllm_worker.py JOB.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        job = json.load(f)
    result = run(job)
    tmp = argv[1] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, argv[1])
    return 0


if __name__ == "__main__":  # the engine spawns processes: everything runs under this guard
    sys.exit(main(sys.argv[1:]))
