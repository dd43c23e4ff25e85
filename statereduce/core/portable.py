"""Checkpoints that load without statereduce.

A pruned checkpoint whose widths its stock config can describe (one key width for every layer, a value cut of a
family whose config has a value-width field) loads with the family's own class. One whose layers keep different
widths (a per-layer key budget such as ``drrqr@sens``, a per-layer key/value split, Mamba-2's value cuts) cannot: the
stock class builds every layer at the config's sizes. For those, :func:`write_portable` puts a small modeling file
beside the weights (:data:`MODELING_FILE`) and names it in ``config.json``'s ``auto_map``, so that::

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

(its ``model_type`` is the stock one after :data:`~statereduce.families.base.PORTABLE_PREFIX`) builds the stock model
and then gives each listed module the shapes and size attributes the pruned model has, before
the weights load. What to change is not derived from per-family rules: it is the difference between the pruned model
and the stock model its own config builds (:func:`module_layout`), stored in ``config.json`` as
:data:`LAYOUT_FIELD` (``{module path: {"parameters": {name: shape}, "buffers": {...}, "attributes": {name: value}}}``).
The modeling file is the same for every family but its two import lines (the stock config and model classes), needs
torch, transformers and, for the fla families, fla; it never imports statereduce.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from statereduce import __version__
from statereduce.families.base import PORTABLE_PREFIX

MODELING_FILE = "modeling_statereduce.py"
"""The modeling code a checkpoint with per-layer widths carries (``auto_map`` names its two classes)."""
LAYOUT_FIELD = "statereduce_layout"
"""The ``config.json`` field holding :func:`module_layout`: what the modeling code changes in the stock model."""
CONFIG_CLASS = "StateReduceConfig"
MODEL_CLASS = "StateReduceForCausalLM"
_STOCK_PACKAGES = ("fla.", "transformers.")
_SIMPLE = (bool, int, float, str, type(None))
_RUNTIME_ATTRS = frozenset({"training", "gradient_checkpointing"})  # set by training, not by the widths

_TEMPLATE = '''"""Loads a checkpoint pruned by statereduce whose layers keep different state widths, which the stock
{model} cannot hold: it builds the stock model from this config and gives each module listed in
config.json's "{field}" its pruned shapes and size attributes before the weights load.

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)

Needs torch and transformers{needs}; not statereduce. Written by statereduce {version}.
"""

import torch
from torch import nn
from {config_module} import {config} as _StockConfig
from {model_module} import {model} as _StockForCausalLM


class {config_class}(_StockConfig):
    """The stock config under a model type of its own, so that the Auto classes load this file's model class (fla
    registers its classes for the stock type); "{field}" is one more field of it."""

    model_type = "{model_type}"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)


def apply_layout(model, layout):
    """Give each module of ``layout`` its pruned parameter/buffer shapes (empty tensors: the weights load next) and
    size attributes."""
    for path, entry in layout.items():
        module = model.get_submodule(path)
        for name, shape in entry.get("parameters", {{}}).items():
            old = getattr(module, name)
            new = torch.empty(shape, dtype=old.dtype, device=old.device)
            setattr(module, name, nn.Parameter(new, requires_grad=old.requires_grad))
        for name, shape in entry.get("buffers", {{}}).items():
            old = getattr(module, name)
            module.register_buffer(name, torch.empty(shape, dtype=old.dtype, device=old.device))
        for name, value in entry.get("attributes", {{}}).items():
            if isinstance(value, list) and isinstance(getattr(module, name, None), tuple):
                value = tuple(value)
            setattr(module, name, value)


class {model_class}(_StockForCausalLM):
    """The stock {model} with each layer at its pruned widths."""

    config_class = {config_class}

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        apply_layout(self, getattr(config, "{field}", None) or {{}})
{cache_alias}'''

# fla 0.6.0's models read their cache from ``past_key_values``; transformers >= 5.24's generate() passes it as
# ``cache``, and the model would then decode every step from an empty state. The carried code of an fla model maps one
# onto the other (statereduce.speed.generate.install_cache_alias does the same for any loaded model).
_FLA_CACHE_ALIAS = '''
    def forward(self, *args, cache=None, **kwargs):
        """The stock forward; a cache given as ``cache`` (transformers' generate) is the model's ``past_key_values``."""
        if cache is not None and kwargs.get("past_key_values") is None:
            kwargs["past_key_values"] = cache
        return super().forward(*args, **kwargs)
'''


def stock_class(obj: Any) -> type:
    """The first class of ``type(obj)``'s MRO that the family's library defines (fla or transformers), so that a model
    loaded through :data:`MODELING_FILE` maps back to its stock class.

    Raises:
        ValueError: one line, when no class of the MRO comes from fla or transformers.
    """
    for cls in type(obj).__mro__:
        if cls.__module__.startswith(_STOCK_PACKAGES):
            return cls
    raise ValueError(f"{type(obj).__name__} derives from no fla or transformers class; its checkpoint cannot name a "
                     "stock class")


def stock_model(model: nn.Module) -> nn.Module:
    """The model the stock class builds from ``model.config``, on the meta device (no memory, any size)."""
    cls = stock_class(model)
    with torch.device("meta"):
        return cls._from_config(model.config)


def _simple(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_simple(v) for v in value)
    return isinstance(value, _SIMPLE)


def _plain(value: Any) -> Any:
    return [_plain(v) for v in value] if isinstance(value, (tuple, list)) else value


def module_layout(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Where ``model`` differs from the stock model of its config (:func:`stock_model`): per module path, the
    parameters and persistent buffers of another shape and the plain attributes (numbers, strings, tuples of them) the
    stock module has with another value (attributes it lacks, such as the provenance ``load_model`` attaches, are not
    the stock code's). Empty for a model the stock class holds.

    Raises:
        ValueError: one line, where the difference is one the modeling code cannot rebuild: another module tree,
            module class, parameter set, or a non-persistent buffer of another shape.
    """
    stock = stock_model(model)
    ours, theirs = dict(model.named_modules()), dict(stock.named_modules())
    if set(ours) != set(theirs):
        extra, missing = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
        raise ValueError(f"the model's modules differ from its stock class's: extra {extra[:5]}, missing {missing[:5]}")
    layout: dict[str, dict[str, Any]] = {}
    for path, module in ours.items():
        ref = theirs[path]
        where = path or type(model).__name__
        if not isinstance(module, type(ref)):  # a subclass: the root of a model loaded through the carried code
            raise ValueError(f"{where} is a {type(module).__name__}; the stock class builds a {type(ref).__name__}")
        entry: dict[str, Any] = {}
        for kind, mine, stock_items in (("parameters", module._parameters, ref._parameters),
                                        ("buffers", module._buffers, ref._buffers)):
            if set(mine) != set(stock_items):
                raise ValueError(f"{where} has {kind} {sorted(mine)}; the stock class builds {sorted(stock_items)}")
            for name, tensor in mine.items():
                other = stock_items[name]
                if (tensor is None) != (other is None):
                    raise ValueError(f"{where}.{name} is {'absent' if tensor is None else 'present'} here but not in "
                                     "the stock class's model")
                if tensor is None or tuple(tensor.shape) == tuple(other.shape):
                    continue
                if kind == "buffers" and name in module._non_persistent_buffers_set:
                    raise ValueError(f"{where}.{name} is a non-persistent buffer of shape {tuple(tensor.shape)} (stock "
                                     f"{tuple(other.shape)}): the weights file does not hold it")
                entry.setdefault(kind, {})[name] = list(tensor.shape)
        stock_vars = vars(ref)
        for name, value in vars(module).items():
            if name.startswith("_") or name in _RUNTIME_ATTRS or not _simple(value):
                continue
            if name in stock_vars and _plain(stock_vars[name]) != _plain(value):  # what the stock code reads
                entry.setdefault("attributes", {})[name] = _plain(value)
        if entry:
            layout[path] = entry
    return layout


def modeling_code(model: nn.Module) -> str:
    """The text of :data:`MODELING_FILE` for ``model``'s stock classes."""
    model_cls, config_cls = stock_class(model), stock_class(model.config)
    fla = model_cls.__module__.startswith("fla.")
    needs = ", fla" if fla else ""
    return _TEMPLATE.format(
        model=model_cls.__name__, model_module=model_cls.__module__, config=config_cls.__name__,
        config_module=config_cls.__module__, config_class=CONFIG_CLASS, model_class=MODEL_CLASS, field=LAYOUT_FIELD,
        needs=needs, version=__version__, model_type=PORTABLE_PREFIX + stock_type(model),
        cache_alias=_FLA_CACHE_ALIAS if fla else "",
    )


def stock_type(model: nn.Module) -> str:
    """The ``model_type`` of ``model``'s stock config class."""
    return stock_class(model.config).model_type


def write_portable(model: nn.Module, folder: str | os.PathLike) -> dict[str, Any] | None:
    """Make the checkpoint ``folder`` (``model`` saved with ``save_pretrained``) load without statereduce: when the
    stock class cannot hold ``model``'s widths, write :data:`MODELING_FILE` and add ``auto_map`` and
    :data:`LAYOUT_FIELD` to ``config.json``; otherwise remove both (a stock checkpoint stays a stock one).

    Returns:
        The layout written, or None for a stock checkpoint.
    """
    folder = Path(folder)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    layout = module_layout(model)
    code = folder / MODELING_FILE
    if not layout:
        config.pop(LAYOUT_FIELD, None)
        config["model_type"] = config["model_type"].removeprefix(PORTABLE_PREFIX)
        auto_map = {k: v for k, v in config.pop("auto_map", {}).items() if not v.startswith(MODELING_FILE[:-3] + ".")}
        if auto_map:
            config["auto_map"] = auto_map
        code.unlink(missing_ok=True)
        _write_text(config_file, json.dumps(config, indent=2, sort_keys=True) + "\n")
        return None
    stem = MODELING_FILE[:-3]
    config["auto_map"] = {"AutoConfig": f"{stem}.{CONFIG_CLASS}", "AutoModelForCausalLM": f"{stem}.{MODEL_CLASS}"}
    config[LAYOUT_FIELD] = layout
    config["model_type"] = PORTABLE_PREFIX + stock_type(model)
    _write_text(code, modeling_code(model))
    _write_text(config_file, json.dumps(config, indent=2, sort_keys=True) + "\n")
    return layout


def is_portable(config: Mapping[str, Any]) -> bool:
    """Whether a ``config.json``'s dict is that of a checkpoint carrying :data:`MODELING_FILE` (it loads with
    ``trust_remote_code=True``)."""
    return str(config.get("model_type", "")).startswith(PORTABLE_PREFIX)


def stock_config(config: Mapping[str, Any], config_class: type):
    """``config_class`` (the family's stock config class) built from a portable checkpoint's ``config.json`` dict,
    without its model type and ``auto_map``: the config :func:`statereduce.core.models.load_model` builds the stock
    model from."""
    fields = {k: v for k, v in config.items() if k not in ("model_type", "auto_map", "transformers_version")}
    return config_class.from_dict(fields)


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
