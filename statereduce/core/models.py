"""Building the embedded tiny models and loading any base model of the workflow.

A base model artifact ``results/{model}/base/`` is either

- an HF checkpoint folder (``config.json`` + safetensors + tokenizer), as written by
  :func:`statereduce.stages.pretrain.pretrain` for the embedded tiny models or for any local model, or
- a folder holding only ``source.json`` (:func:`write_hub_source`) for hub models: the hub id, the
  revision (resolved to a commit sha when the hub was reachable) and the dtype; the weights stay in
  the Hugging Face cache and are never copied into ``results/``.

Importing this module loads neither torch nor transformers (a job that only writes ``source.json`` needs neither):
the functions that build or load a model import them.

Paper: Nazari & Rusch (2026), "On State Reduction in Linear Attention", Sec. 4 (the DeltaNet and
Gated DeltaNet checkpoints whose key/query channels are pruned).
"""

from __future__ import annotations

import contextlib
import inspect
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from statereduce.common.settings import DeviceSettings
from statereduce.core.checkpoints import BASE_ATTR, SOURCE_FILE, checkpoint_provenance, checkpoint_sha256
from statereduce.core.runtime import write_json
from statereduce.core.tokenizer import VOCAB_SIZE
from statereduce.families import check_family, model_type_family
from statereduce.families.base import KEY_DIMS_FIELD, VALUE_DIMS_FIELD

if TYPE_CHECKING:
    import torch

WEIGHTS_FILE = "model.safetensors"
"""The weights of every checkpoint the workflow writes (pruned, fine-tuned): one file, which the rules name."""
_ONE_SHARD = "1000TB"  # save_pretrained's max_shard_size: above any model, so the weights are never sharded
DTYPES = DeviceSettings.valid("dtype")
"""The names of a model's ``dtype`` setting (:func:`torch_dtype` gives the torch dtype of each)."""
# Fields set for every tiny model unless the arch dict overrides them (byte-level tokenizer: EOS = BOS = 256).
TINY_DEFAULTS: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "bos_token_id": 256,
    "eos_token_id": 256,
    "pad_token_id": None,  # fla's and Qwen3.5's default; Mamba-2's is 1 (a byte here)
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a model's ``dtype`` setting (one of :data:`DTYPES`).

    Raises:
        ValueError: one line naming the unknown dtype and the valid ones.
    """
    check_dtype(name)
    import torch

    return getattr(torch, name)


def check_dtype(name: str) -> str:
    """``name`` if it is one of :data:`DTYPES`, else a one-line ValueError naming the valid ones (imports no torch)."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; valid: {', '.join(DTYPES)}")
    return name


def config_class(family: str) -> type:
    """The HF config class of a model family, from the adapter registry (``adapter_class(family).config_class``)."""
    from statereduce.adapters import adapter_class

    return adapter_class(family).config_class


def tiny_config(family: str, arch: dict[str, Any]):
    """The config of a tiny model trained from scratch (the embedded default models).

    Args:
        family: adapter family, e.g. ``"delta_net"`` (fla ``DeltaNetConfig``: ``hidden_size``,
            ``num_hidden_layers``, ``num_heads``, ``expand_k``, ``expand_v``; d_k = hidden*expand_k/H),
            ``"gated_deltanet"`` (fla ``GatedDeltaNetConfig``: ``head_dim`` = d_k, ``expand_v``
            with d_v = head_dim*expand_v, optional ``num_v_heads``), ``"mamba2"`` (transformers
            ``Mamba2Config``: ``state_size`` = d_k, ``n_groups`` q/k heads) or ``"qwen3_5"`` (transformers
            ``Qwen3_5TextConfig``: ``linear_key_head_dim`` = d_k, ``layer_types``).
        arch: keyword arguments of the family's config class. Defaults added unless given:
            ``vocab_size`` 257, ``bos_token_id``/``eos_token_id`` 256 (the byte tokenizer's EOS),
            the family's ``config_overrides`` (fla's: ``fuse_cross_entropy`` False); ``pad_token_id`` None (fla
            and Qwen3.5 use it as the embedding's ``padding_idx``, which would freeze EOS); everything else keeps the
            class default.

    Raises:
        ValueError: unknown family, or a key the config class does not take (typos would otherwise
            be stored silently by ``PretrainedConfig``).
    """
    cls = config_class(family)
    params = inspect.signature(cls.__init__).parameters
    valid = sorted(p for p in params if p not in ("self", "kwargs"))
    bad = sorted(set(arch) - set(valid))
    if bad:
        raise ValueError(f"unknown arch key(s) {bad} for family {family!r} ({cls.__name__}); valid: {', '.join(valid)}")
    from statereduce.adapters import adapter_class

    defaults = {k: v for k, v in TINY_DEFAULTS.items() if k in params}
    return cls(**{**defaults, **adapter_class(family).config_overrides, **arch})


def build_random(family: str, arch: dict[str, Any], *, seed: int = 0, dtype: str = "float32",
                 device: str | torch.device = "cpu"):
    """A randomly initialised causal LM of ``family`` with the config :func:`tiny_config` makes of ``arch``: the config
    class's own initialisation after ``torch.manual_seed(seed)`` (torch's global CPU generator is left as it was),
    built directly on ``device`` in ``dtype`` (a 9B model needs no copy in host memory).

    Raises:
        ValueError: one line, for an unknown family, dtype or config keyword.
    """
    import torch

    from statereduce.adapters import adapter_class

    cls = adapter_class(family)
    torch_type = torch_dtype(dtype)
    config = tiny_config(family, arch)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        return cls.build(config, dtype=torch_type)


def resolve_revision(hub_id: str, revision: str | None) -> tuple[str | None, bool]:
    """(commit sha, True) from the hub, or (revision as given, False) when offline / unreachable / local."""
    if Path(hub_id).expanduser().is_dir():
        return revision, False
    try:
        from huggingface_hub import HfApi, constants

        if constants.HF_HUB_OFFLINE:
            return revision, False
        info = HfApi().model_info(hub_id, revision=revision, timeout=15)
        return info.sha, info.sha is not None
    except Exception:  # noqa: BLE001 -- any failure (no network, auth, unknown repo) keeps the given revision
        return revision, False


def write_hub_source(
    out_dir: str | Path, hub_id: str, revision: str | None = None, dtype: str = DeviceSettings.dtype,
    tokenizer: str | None = None, family: str | None = None,
) -> dict[str, Any]:
    """Write ``out_dir/source.json`` for a hub model (atomically): what :func:`load_model` loads.

    Args:
        out_dir: the base artifact folder, ``results/{model}/base/``.
        hub_id: Hugging Face model id (or a local checkpoint folder).
        revision: branch, tag or commit; resolved to a commit sha through ``HfApi().model_info`` when
            the hub answers. Offline, the given revision is kept and ``resolved`` is false.
        dtype: one of float32 (the default, a model's ``dtype`` in the workflow too), bfloat16, float16.
        tokenizer: a different tokenizer id, when the model repo has none.
        family: when given, the checkpoint's ``config.json`` (a local folder's, or the hub's when it answers) must be
            of that adapter family; a ValueError names both otherwise.

    Returns:
        The record written: ``hub_id``, ``revision``, ``requested_revision``, ``resolved``, ``dtype``,
        ``tokenizer`` (only when given) and, for a local checkpoint folder, ``sha256``: ``{file name: SHA-256}`` of
        every file loading reads (:func:`statereduce.core.checkpoints.checkpoint_sha256`), which the jobs that load the
        model copy into their artifacts' provenance (:func:`statereduce.core.checkpoints.base_checkpoint`).
    """
    check_dtype(dtype)
    sha, resolved = resolve_revision(hub_id, revision)
    if family is not None:
        check_family(hub_id, sha if resolved else revision, family, download=resolved)
    record: dict[str, Any] = {
        "hub_id": hub_id,
        "revision": sha,
        "requested_revision": revision,
        "resolved": resolved,
        "dtype": dtype,
    }
    if tokenizer is not None:
        record["tokenizer"] = tokenizer
    if Path(hub_id).expanduser().is_dir():
        record["sha256"] = checkpoint_sha256(hub_id)
    write_json(Path(out_dir) / SOURCE_FILE, record)
    return record


def save_checkpoint(model, tokenizer, folder: str | Path) -> Path:
    """Save ``model`` into ``folder`` as one :data:`WEIGHTS_FILE` (never sharded, whatever its size, so that the
    rules can name the file as an output) with its config, and ``tokenizer`` when not None. A model whose layers keep
    widths its stock class cannot hold also gets the modeling code that loads it without statereduce
    (:func:`statereduce.core.portable.write_portable`).

    Returns:
        The weights file.
    """
    from statereduce.core.portable import write_portable

    model.save_pretrained(folder, safe_serialization=True, max_shard_size=_ONE_SHARD)
    write_portable(model, folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    weights = Path(folder) / WEIGHTS_FILE
    if not weights.is_file():
        raise RuntimeError(f"save_pretrained wrote no {WEIGHTS_FILE} into {folder} (files: "
                           f"{', '.join(sorted(p.name for p in Path(folder).iterdir()))})")
    return weights


def load_model(base: str | Path, *, dtype: str | None = None, device: str | torch.device = "cpu"):
    """Load a base model artifact: ``(model in eval mode, tokenizer)``.

    Args:
        base: ``results/{model}/base/``: an HF checkpoint folder (``config.json``) or a folder with
            ``source.json`` (hub model: ``from_pretrained(hub_id, revision=...)``; weights come from
            the HF cache or the hub).
        dtype: float32 / bfloat16 / float16; None uses ``source.json``'s dtype, else float32.
        device: where to put the model. The family's adapter installs its kernel routing
            (:meth:`~statereduce.adapters.base.LinearAttentionAdapter.install_fallbacks`): fla's Triton-only layers
            run in PyTorch on CPU, and on CUDA the calls at head shapes stock fla mishandles are zero-padded
            (:mod:`statereduce.kernels.shapes`).

    The model class is the adapter's ``causal_lm_class`` (transformers' ``Mamba2ForCausalLM``: fla's own
    ``mamba2`` registration overrides the Auto mapping) or ``AutoModelForCausalLM``.

    Imports ``fla`` first (which registers its models with the Auto classes) unless the checkpoint's family runs no
    fla code (:attr:`~statereduce.families.base.FamilySpec.uses_fla`: Mamba-2), and applies the family's
    ``config_overrides`` (fla's: ``fuse_cross_entropy=False``; the fused loss is CUDA-only).
    The model carries :func:`~statereduce.core.checkpoints.checkpoint_provenance` of ``base`` as
    :data:`~statereduce.core.checkpoints.BASE_ATTR` (:func:`~statereduce.core.checkpoints.base_checkpoint`), which the
    artifacts written from it record.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from statereduce.adapters import adapter_for_config
    from statereduce.core.portable import is_portable

    base = Path(base)
    source_file = base / SOURCE_FILE
    if source_file.is_file():
        src = json.loads(source_file.read_text())
        if "hub_id" not in src:
            raise ValueError(f"{source_file} has no 'hub_id' (keys: {sorted(src)})")
        model_id, revision = src["hub_id"], src.get("revision")
        tok_id = src.get("tokenizer") or model_id
        dtype = dtype or src.get("dtype", "float32")
    elif (base / "config.json").is_file():
        model_id, revision, tok_id = str(base), None, str(base)
        dtype = dtype or "float32"
    else:
        raise ValueError(f"base model {str(base)!r} has neither {SOURCE_FILE} nor config.json")
    torch_type = torch_dtype(dtype)
    device = torch.device(device)
    config_dict, config = checkpoint_config(model_id, revision)
    adapter = adapter_for_config(config)
    adapter.install_fallbacks()  # CPU tensors to the torch kernels; CUDA calls at shapes fla mishandles padded
    kwargs: dict[str, Any] = {"revision": revision, "dtype": torch_type, **adapter.config_overrides}
    if getattr(config, KEY_DIMS_FIELD, None) is not None or getattr(config, VALUE_DIMS_FIELD, None) is not None:
        model = load_mixed_widths(adapter.causal_lm_class or AutoModelForCausalLM, Path(model_id), config,
                                  torch_type, adapter.config_overrides)
    else:
        if is_portable(config_dict):  # the stock class from the stock config (from_pretrained would read the file's)
            for name in adapter.config_overrides:
                setattr(config, name, kwargs.pop(name))
            kwargs["config"] = config
        model = (adapter.causal_lm_class or AutoModelForCausalLM).from_pretrained(model_id, **kwargs)
    model.to(device).eval()
    setattr(model, BASE_ATTR, checkpoint_provenance(base))
    check_kernels(model)
    own = tok_id == model_id  # the checkpoint's own tokenizer: AutoTokenizer reads its config (given, when portable)
    tokenizer = AutoTokenizer.from_pretrained(tok_id, revision=revision if own else None,
                                              **({"config": config} if own and is_portable(config_dict) else {}))
    return model, tokenizer


def checkpoint_config(model_id: str | Path, revision: str | None = None) -> tuple[dict[str, Any], Any]:
    """(``config.json``'s dict, the config object :func:`load_model` builds the model from) of a checkpoint folder or
    hub id. Imports fla first where the family needs it (its Auto registration); a checkpoint carrying its own modeling
    code (:mod:`statereduce.core.portable`) gives its family's stock config class, whatever its model type says."""
    from transformers import AutoConfig, PretrainedConfig

    from statereduce.adapters import adapter_class
    from statereduce.core.portable import is_portable, stock_config

    config_dict = PretrainedConfig.get_config_dict(str(model_id), revision=revision)[0]
    family = model_type_family(config_dict.get("model_type"))
    if family is None or family.uses_fla:
        import fla  # noqa: F401  (registers fla's configs and models with transformers' Auto classes)
    if is_portable(config_dict) and family is not None:
        return config_dict, stock_config(config_dict, adapter_class(family.family).config_class)
    return config_dict, AutoConfig.from_pretrained(str(model_id), revision=revision)


KERNEL_CHECK_ATTR = "_statereduce_kernel_check"
"""The attribute of a loaded model holding the record of its kernel check (:func:`check_kernels`)."""


def checkpoint_widths(folder: str | Path, base_folder: str | Path | None = None) -> list[dict[str, Any]]:
    """Per linear-attention layer of the checkpoint in ``folder``: its key and value widths (``d_k``, ``d_v`` per
    head), state heads and state bytes per sequence (float32), and the base's where ``base_folder`` has a config."""
    from statereduce.adapters import adapter_for_config

    config = checkpoint_config(Path(folder))[1]
    shapes = adapter_for_config(config).config_layer_state_shapes(config)
    before = {}
    if base_folder is not None:
        base_config = checkpoint_config(Path(base_folder))[1]
        before = adapter_for_config(base_config).config_layer_state_shapes(base_config)
    rows = []
    for layer, shape in sorted(shapes.items()):
        row = {"layer": layer, "heads": shape.num_heads, "d_k": shape.d_k, "d_v": shape.d_v,
               "state_bytes": shape.recurrent_elems * 4}
        if layer in before:
            row.update(base_d_k=before[layer].d_k, base_d_v=before[layer].d_v,
                       base_state_bytes=before[layer].recurrent_elems * 4)
        rows.append(row)
    return rows


def check_kernels(model: torch.nn.Module, backward: bool = False, policy: str | None = None) -> list[dict[str, Any]]:
    """The run-time check of the fla kernels ``model`` will run, on CUDA (:mod:`statereduce.kernels.check`).

    :func:`load_model` runs it for the forward; a job that differentiates (RFT's student, Grad scores) runs it again
    with ``backward`` before its first backward (the forward routes come from the cache then). Routes that are not
    right run in PyTorch from then on, or the job stops, as ``policy`` (default: the environment's
    ``STATEREDUCE_KERNEL_CHECK``, else ``fallback``) says. Nothing happens on CPU or for a family that calls no fla
    kernel (Mamba-2).

    Returns:
        This call's record; the model's :data:`KERNEL_CHECK_ATTR` keeps every route checked for it so far, which
        the job's record (``eval.json``, the RFT record, the HDF5 attributes of calibration and Grad scores) names.
    """
    device = next(model.parameters()).device
    if device.type != "cuda":
        return []
    from statereduce.adapters import get_adapter
    from statereduce.kernels import check

    record = check.check_routes(get_adapter(model).kernel_routes(backward), device, policy)
    merged: dict[tuple, dict[str, Any]] = {}
    for e in [*getattr(model, KERNEL_CHECK_ATTR, []), *record]:  # a route's first check is the one that decided it
        merged.setdefault((e["kernel"], e["pass"], tuple(e["shape"].values())), e)
    setattr(model, KERNEL_CHECK_ATTR, list(merged.values()))
    return record


def kernel_check_record(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Every route checked for ``model`` (:func:`check_kernels`); empty on CPU."""
    return list(getattr(model, KERNEL_CHECK_ATTR, []))


def load_mixed_widths(cls, folder: Path, config, dtype: torch.dtype, overrides: dict[str, Any]):
    """A checkpoint whose widths its stock config cannot describe, written by
    :func:`statereduce.stages.prune.prune_model`: layers that keep different key widths (``config.statereduce_key_dims``,
    a per-layer allocation) or value widths the config has no field for (``config.statereduce_value_dims``,
    Mamba-2). The stock class is built from the config (the unpruned head sizes), each mixer shaped to its key width
    and output-norm eps (:func:`statereduce.core.slicing.shape_mixers`) and to its value width
    (:func:`statereduce.core.slicing.shape_values`), then the weights of ``model.safetensors`` are loaded strictly
    (tied output embeddings excepted).

    The stock ``from_pretrained`` cannot load it. Any other code gets the same model with::

        model = AutoModelForCausalLM.from_config(config)
        adapter = statereduce.adapters.get_adapter(model)
        statereduce.core.slicing.shape_mixers(adapter, config.statereduce_key_dims,
                                              getattr(config, "statereduce_output_norm_eps", None))  # if key dims
        statereduce.core.slicing.shape_values(adapter, config.statereduce_value_dims)  # if value dims
        model.load_state_dict(safetensors.torch.load_file("model.safetensors"), strict=False)
    """
    from safetensors.torch import load_file

    if not (folder / "model.safetensors").is_file():
        raise ValueError(f"{folder} holds a checkpoint with per-layer widths but no model.safetensors (a local "
                         "checkpoint folder is needed)")
    model = build_shaped(cls, folder, config, dtype, overrides)
    config = model.config
    missing, unexpected = model.load_state_dict(load_file(folder / "model.safetensors"), strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise ValueError(f"{folder}: weights do not match the per-layer widths: missing "
                         f"{sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
    if tied:
        model.tie_weights()
    return model.to(dtype)


def build_shaped(cls, folder: Path, config, dtype: torch.dtype, overrides: dict[str, Any],
                 device: str | torch.device | None = None):
    """The model of ``cls`` built from ``config`` (re-read from ``folder`` as the class's own config class where it is
    another, as for Mamba-2) with each mixer shaped to the checkpoint's per-layer widths; its weights are whatever
    the class initialises, on ``device`` (None: the default; ``meta`` allocates nothing)."""
    import torch

    from statereduce.adapters import get_adapter
    from statereduce.core.portable import stock_config
    from statereduce.core.slicing import OUTPUT_NORM_EPS_FIELD, shape_mixers, shape_values

    config_class = getattr(cls, "config_class", None)
    if config_class is not None and not isinstance(config, config_class):  # the model class's own config class (fla
        # registers its mamba2); read as transformers reads it: its JSON writes an infinite float as {"__float__": ...}
        config = stock_config(config_class.get_config_dict(str(folder))[0], config_class)
    for name, value in overrides.items():
        setattr(config, name, value)
    build = getattr(cls, "from_config", None) or cls._from_config  # an Auto class, or the model class itself
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = build(config, dtype=dtype)
    adapter = get_adapter(model)  # shaped outside the device context: the channel maps stay on the CPU
    if getattr(config, KEY_DIMS_FIELD, None) is not None:
        shape_mixers(adapter, getattr(config, KEY_DIMS_FIELD), getattr(config, OUTPUT_NORM_EPS_FIELD, None))
    if getattr(config, VALUE_DIMS_FIELD, None) is not None:
        shape_values(adapter, getattr(config, VALUE_DIMS_FIELD))
    return model


def shaped_model(folder: str | Path, *, device: str | torch.device = "meta"):
    """The model :func:`load_model` builds from the checkpoint ``folder``, at its shapes and size attributes, without
    reading its weights (on ``meta`` by default: any size, no memory). What :func:`statereduce.core.portable.
    write_portable` needs to describe a checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM

    from statereduce.adapters import adapter_for_config

    config = checkpoint_config(folder)[1]
    adapter = adapter_for_config(config)
    for name, value in adapter.config_overrides.items():
        setattr(config, name, value)
    return build_shaped(adapter.causal_lm_class or AutoModelForCausalLM, Path(folder), config, torch.float32,
                        adapter.config_overrides, device=device)
