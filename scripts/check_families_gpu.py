"""Mamba-2 and Qwen3.5 on a CUDA GPU: the transformers families against their CPU path, unpruned and pruned.

For each family a tiny random model (the test suite's shapes, ``tests/_models.py``, scaled up with ``--scale``) is
pruned to half its key channels at random and saved; then, on the GPU:

* full forward of the unpruned and the pruned checkpoint in float32 and in bf16 autocast against the CPU float32
  logits (relative L2 error), over a sequence long enough for the chunked kernels (``--length``);
* cached one-token decoding of the pruned checkpoint against its full forward on the GPU;
* which implementation ran: for Qwen3.5 the calls that reach fla's ``chunk_gated_delta_rule`` /
  ``fused_recurrent_gated_delta_rule`` on CUDA (transformers binds them when fla is installed; the adapter's CPU
  dispatch must leave CUDA tensors to them), for Mamba-2 transformers' torch scan (no mamba_ssm here).

    python scripts/check_families_gpu.py families_gpu.json [--scale 2] [--length 300]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def count_calls(module, names: tuple[str, ...], counts: dict[str, int]):
    """Wrap ``module.<name>`` to count calls on CUDA tensors; returns a function that restores them."""
    originals = {n: getattr(module, n) for n in names}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            first = args[0] if args else next(iter(kwargs.values()))
            if first.is_cuda:
                counts[name] = counts.get(name, 0) + 1
            return fn(*args, **kwargs)

        return counted

    for n, fn in originals.items():
        setattr(module, n, wrap(n, fn))
    return lambda: [setattr(module, n, fn) for n, fn in originals.items()]


def _bf16(model, x):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return model(x).logits


def _decode_error(model, x, cache_argument: str, dtype: str) -> float:
    """Relative error of cached one-token decoding against the full forward of ``x`` on the GPU."""
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if dtype == "bf16" else torch.autocast("cuda", enabled=False)
    with torch.no_grad(), ctx:
        full = model(x).logits
        steps, cache = [], None
        for t in range(x.shape[1]):
            o = model(x[:, t : t + 1], **{cache_argument: cache}, use_cache=True)
            steps.append(o.logits)
            cache = o.past_key_values if getattr(o, "cache", None) is None else o.cache
    return rel(torch.cat(steps, dim=1), full)


def _bound(fn) -> str:
    """What a kernel name runs on CUDA: for transformers' hub-kernel wrappers, the implementation they bound."""
    fn = getattr(fn, "_statereduce_stock", fn)  # the adapter's CPU dispatch leaves CUDA tensors to this
    cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
    impl = cells.get("implementation", fn)
    return f"{impl.__module__}.{impl.__qualname__}"


def check_family(family: str, scale: int, length: int, root: Path) -> dict:
    from _models import random_keep, tiny_model
    from statereduce.adapters import adapter_class, get_adapter
    from statereduce.core.models import load_model
    from statereduce.stages.prune import prune_model, save_pruned
    from statereduce.core.tokenizer import byte_level_tokenizer

    over = {"mamba2": {"hidden_size": 64 * scale, "num_heads": 8 * scale},
            "qwen3_5": {"hidden_size": 64 * scale}}[family]
    model = tiny_model(family, vocab_size=257, **over)
    tok = byte_level_tokenizer()
    base = root / family / "base"
    model.save_pretrained(base)
    tok.save_pretrained(base)
    d_k = get_adapter(model).head_k_dim
    record = prune_model(model, random_keep(model, d_k // 2, seed=1), {"method": "rand", "pct": 50},
                          norm_eps="stock")
    pruned = save_pruned(model, tok, record, root / family / "pruned")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, length), generator=g)
    out: dict = {"family": family, "d_k": d_k, "d_k_new": d_k // 2, "length": length}
    adapter = adapter_class(family)
    import importlib

    kernel_module = importlib.import_module({"mamba2": "transformers.models.mamba2.modeling_mamba2",
                                             "qwen3_5": "transformers.models.qwen3_5.modeling_qwen3_5"}[family])
    names = {"mamba2": ("mamba2_chunk_scan", "mamba2_selective_state_update"),
             "qwen3_5": ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")}[family]
    for label, ckpt in (("base", base), ("pruned", pruned)):
        cpu, _ = load_model(ckpt)
        with torch.no_grad():
            ref = cpu(ids).logits
        gpu, _ = load_model(ckpt, device="cuda")
        counts: dict[str, int] = {}
        rec: dict = {}
        restore = count_calls(kernel_module, names, counts)
        x = ids.cuda()
        try:
            for what, run in (("fp32_vs_cpu", lambda: gpu(x).logits), ("bf16_vs_cpu", lambda: _bf16(gpu, x))):
                try:
                    with torch.no_grad():
                        rec[what] = rel(run().float().cpu(), ref)
                except Exception as e:  # noqa: BLE001 -- record what the kernel refused
                    rec[what] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            for dtype in ("fp32", "bf16"):
                try:
                    rec[f"decode_vs_full_{dtype}"] = _decode_error(gpu, x[:, :64], adapter.cache_argument, dtype)
                except Exception as e:  # noqa: BLE001
                    rec[f"decode_vs_full_{dtype}"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        finally:
            restore()
        rec["cuda_calls"] = counts
        rec["cuda_implementation"] = {n: _bound(getattr(kernel_module, n)) for n in names}
        out[label] = rec
        print(json.dumps({family: {label: out[label]}}), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--scale", type=int, default=2, help="multiply the test models' hidden size (and Mamba-2 heads)")
    p.add_argument("--length", type=int, default=300)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("check_families_gpu.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import fla  # noqa: F401  (as every workflow job: transformers' Qwen3.5 then binds fla's kernels)
    import transformers

    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "transformers": transformers.__version__, "fla": getattr(fla, "__version__", None), "families": []}
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for family in ("mamba2", "qwen3_5"):
            results["families"].append(check_family(family, args.scale, args.length, Path(tmp)))
    results["seconds"] = time.time() - start
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
