"""Compensation after the cut: re-fit each cut mixer's output projection on calibration tokens (method tokens with
``+<fit>``, e.g. ``drrqr@sens+fit``); :func:`statereduce.stages.prune.fit_selection` is rule ``fit``'s entry.

Selection only chooses which channels stay; the weights that stay are left as they were. The fit changes them:
for every linear-attention layer whose key or value width was cut, it re-solves the columns of the mixer's output
projection (fla's ``o_proj``, Mamba-2's and Qwen3.5's ``out_proj``) so that the pruned mixer's output matches the
unpruned model's on the calibration tokens, as SparseGPT and OBS-style updates re-solve kept weights by least squares.

The output projection is the one place where a cut's error is linear in the weights: its input z (the mixer's
readout ``S q`` per head after the output norm and gate) is what the cut changed, and the projection is a plain
``nn.Linear``. With ``z`` the unpruned mixer's projection input and ``z'`` the pruned one's on the same tokens, the
fit solves, per value head (``scope: head``; the block of the head's columns) or for the whole layer (``scope:
layer``), the damped least squares

    min_W  sum_t || y_t - W z'_t ||^2 + lam || W - W_p ||_F^2,   W = (r W_o C + D + lam W_p) (G + lam I)^-1,

with ``C = sum z z'^T``, ``G = sum z' z'^T`` (float64), ``W_o`` the unpruned projection, ``W_p`` the pruned one (what
the plain cut keeps), ``lam = damping * mean(diag G)`` and ``r`` the pruned checkpoint's residual-stream scale (1, or
the ``norm_eps="exact"`` factor; read from the input embeddings). The target ``y_t`` is the unpruned mixer's output
``r W_o z_t`` (``target="mixer"``, ``D = 0``), or with ``target="stream"`` (``scope: layer`` only) that plus the
drift of the residual stream entering the block, ``r h_t - h'_t`` (unpruned minus pruned), so that the stream after
the mixer matches the unpruned one (``D = sum (r h - h') z'^T``). The damping pulls toward the plain cut, so a layer
whose statistics say nothing keeps it. The layers are fitted in order, each on the stream that the earlier fitted
layers produce.

Value cuts shrink the projection's input (``z'`` has d_v' channels per head); key cuts keep its shape. Layers that
keep every channel are left as they are, so with nothing cut the fit changes nothing. The fitted weights are an
artifact of their own (``results/{model}/select/{method}_{pct}.fit.safetensors``: one tensor per fitted projection,
named as in the pruned checkpoint, and the settings, selection and per-layer errors in its metadata); the prune rule
loads them into the sliced model, which stays a plain checkpoint of the smaller shape.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open, save_file
from torch import nn
from tqdm.auto import tqdm

from statereduce.adapters import get_adapter
from statereduce.adapters.base import decoder_layers
from statereduce.core.artifacts import ArtifactError, check_provenance, missing, remedy, unreadable

FIT_FORMAT = 1
SCOPES = ("head", "layer")
TARGETS = ("mixer", "stream")


class _Stop(Exception):
    """Raised by a capture hook once the fitted layer's projection input is in hand: the rest of the forward is not
    needed."""


@dataclass
class LayerStats:
    """Float64 sums over calibration tokens at one layer's output projection: ``cross`` = sum z z'^T [n, m], ``gram``
    = sum z' z'^T [m, m], ``target`` = sum z z^T [n, n] (for the reported error only), ``tokens``."""

    cross: torch.Tensor
    gram: torch.Tensor
    target: torch.Tensor
    tokens: int = 0
    drift: torch.Tensor | None = None


@dataclass(frozen=True)
class OutProjection:
    """One mixer's output projection and the columns of each value head in it ([HV, d_v], the layout's ``"in"``
    entry)."""

    name: str
    module: nn.Linear
    columns: torch.Tensor


def out_projections(model: nn.Module) -> dict[int, OutProjection]:
    """{layer: its mixer's :class:`OutProjection`} of every linear-attention layer of ``model``."""
    adapter = get_adapter(model)
    names = {id(m): n for n, m in model.named_modules()}
    found = {}
    for layer, mixer in adapter.mixer_layers():
        entry = next(e for e in adapter.layout(mixer).value_channels() if e.axis == "in")
        found[layer] = OutProjection(names[id(entry.module)], entry.module, entry.index.detach().cpu())
    return found


def cut_layers(teacher: nn.Module, student: nn.Module) -> list[int]:
    """The layers of ``student`` (a pruned copy of ``teacher``) whose key or value width is smaller."""
    t, s = get_adapter(teacher), get_adapter(student)
    t_layouts = {layer: t.layout(m) for layer, m in t.mixer_layers()}
    cut = []
    for layer, mixer in s.mixer_layers():
        ls, lt = s.layout(mixer), t_layouts[layer]
        if ls.key_dim < lt.key_dim or ls.value_dim < lt.value_dim:
            cut.append(layer)
    return cut


def residual_scale(teacher: nn.Module, student: nn.Module) -> float:
    """The factor r by which ``student``'s residual stream is ``teacher``'s (``norm_eps="exact"`` scales the input
    embeddings and every residual writer by it; 1 otherwise), read from the input embeddings."""
    e_t = teacher.get_input_embeddings().weight.detach().double()
    e_s = student.get_input_embeddings().weight.detach().double().to(e_t.device)
    return float((e_s * e_t).sum() / (e_t * e_t).sum())


def solve_projection(w_teacher: torch.Tensor, w_pruned: torch.Tensor, stats: LayerStats,
                     blocks: Sequence[tuple[torch.Tensor, torch.Tensor]], *, scale: float = 1.0,
                     damping: float = 0.01) -> torch.Tensor:
    """The fitted output projection [D, m] (module docstring): for each block (teacher columns, pruned columns),
    ``W[:, s] = (r W_o[:, t] C[t, s] + lam W_p[:, s]) (G[s, s] + lam I)^-1``; columns outside every block keep
    ``w_pruned``'s. ``stats`` are indexed by the teacher's and the pruned projection's input columns."""
    w_t = w_teacher.detach().double().cpu()
    new = w_pruned.detach().double().cpu().clone()
    for t_cols, s_cols in blocks:
        g = stats.gram[s_cols][:, s_cols]
        scale_g = float(g.diagonal().mean())
        if not scale_g > 0:  # no signal in these columns: keep the plain cut
            continue
        lam = damping * scale_g
        rhs = scale * w_t[:, t_cols] @ stats.cross[t_cols][:, s_cols] + lam * new[:, s_cols]
        if stats.drift is not None:
            rhs = rhs + stats.drift[:, s_cols]
        eye = torch.eye(len(s_cols), dtype=torch.float64)
        new[:, s_cols] = torch.linalg.solve(g + lam * eye, rhs.T).T  # G is symmetric
    return new


def output_error(w_teacher: torch.Tensor, w: torch.Tensor, stats: LayerStats, scale: float = 1.0) -> float:
    """Relative squared error ``sum ||r W_o z - W z'||^2 / sum ||r W_o z||^2`` from the sums alone."""
    w_t, w = w_teacher.detach().double().cpu(), w.detach().double().cpu()
    target = scale ** 2 * torch.einsum("dn,nm,dm->", w_t, stats.target, w_t)
    cross = scale * torch.einsum("dn,nm,dm->", w_t, stats.cross, w)
    own = torch.einsum("dn,nm,dm->", w, stats.gram, w)
    return float((target - 2 * cross + own) / target) if target > 0 else 0.0


def _capture(module: nn.Module, into: list) -> Any:
    def hook(mod, args):
        into.append(args[0].detach())
        raise _Stop
    return module.register_forward_pre_hook(hook)


def _block_input(block: nn.Module, into: list) -> Any:
    def hook(mod, args, kwargs):
        h = args[0] if args else kwargs["hidden_states"]
        into.append(h.detach())
    return block.register_forward_pre_hook(hook, with_kwargs=True)


def _projection_input(model: nn.Module, module: nn.Module, ids: torch.Tensor, block: nn.Module | None = None):
    """The input [B*T, n] (float64, on the model's device) of ``module`` in ``model``'s forward on ``ids`` (the
    forward stops there), and with ``block`` that block's input hidden state [B*T, D]."""
    got: list = []
    res: list = []
    handles = [_capture(module, got)] + ([_block_input(block, res)] if block is not None else [])
    try:
        model(ids, use_cache=False)
    except _Stop:
        pass
    finally:
        for h in handles:
            h.remove()
    if not got:
        raise RuntimeError(f"the forward never reached {type(module).__name__}")
    z = got[0].reshape(-1, got[0].shape[-1]).double()  # on the model's device: the sums are taken there
    return z, (res[0].reshape(-1, res[0].shape[-1]).double() if res else None)


def layer_stats(teacher: nn.Module, student: nn.Module, t_proj: nn.Module, s_proj: nn.Module, blocks: torch.Tensor,
                batch_size: int, t_block=None, s_block=None, scale: float = 1.0) -> LayerStats:
    """:class:`LayerStats` of one layer over the calibration ``blocks`` [N, T]."""
    device = next(student.parameters()).device
    stats = None
    with torch.no_grad():
        for start in range(0, blocks.shape[0], batch_size):
            ids = blocks[start:start + batch_size].to(device)
            z, h_t = _projection_input(teacher, t_proj, ids, t_block)
            zp, h_s = _projection_input(student, s_proj, ids, s_block)
            if stats is None:
                n, m = z.shape[1], zp.shape[1]
                stats = LayerStats(*(torch.zeros(a, b, dtype=torch.float64, device=z.device)
                                     for a, b in ((n, m), (m, m), (n, n))))
            stats.cross += z.T @ zp
            stats.gram += zp.T @ zp
            stats.target += z.T @ z
            stats.tokens += z.shape[0]
            if h_t is not None:
                d = (scale * h_t - h_s).T @ zp
                stats.drift = d if stats.drift is None else stats.drift + d
    return LayerStats(stats.cross.cpu(), stats.gram.cpu(), stats.target.cpu(), stats.tokens,
                      None if stats.drift is None else stats.drift.cpu())


def fit_blocks(t_proj: OutProjection, s_proj: OutProjection, scope: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (teacher columns, pruned columns) blocks the fit solves: one per value head, or the whole layer."""
    if scope == "layer":
        return [(t_proj.columns.reshape(-1), s_proj.columns.reshape(-1))]
    return list(zip(t_proj.columns, s_proj.columns))


@dataclass
class FitResult:
    """The fitted projections {name in the pruned model: weight} and per layer the relative output error of the
    plain cut and of the fit on the calibration tokens, the tokens and the residual scale."""

    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    layers: dict[int, dict[str, Any]] = field(default_factory=dict)
    scale: float = 1.0


def fit_out_projections(teacher: nn.Module, student: nn.Module, blocks: torch.Tensor, *, scope: str = "head",
                        damping: float = 0.01, batch_size: int = 8, target: str = "mixer",
                        progress: bool = False) -> FitResult:
    """Fit, in place and layer by layer, the output projection of every cut mixer of ``student`` (a pruned copy of
    ``teacher``) on the calibration ``blocks`` [N, T] (module docstring; ``scope`` "head" or "layer", ``target``
    "mixer" or "stream"). Returns the :class:`FitResult`."""
    if scope not in SCOPES:
        raise ValueError(f"fit scope {scope!r} is not one of {', '.join(SCOPES)}")
    if target not in TARGETS:
        raise ValueError(f"fit target {target!r} is not one of {', '.join(TARGETS)}")
    if target == "stream" and scope != "layer":
        raise ValueError("fit target 'stream' matches the whole residual stream, which one head cannot; use scope "
                         "'layer' with it")
    if not damping > 0:
        raise ValueError(f"fit damping {damping!r} must be > 0 (0.01: one percent of the mean input energy)")
    t_projs, s_projs = out_projections(teacher), out_projections(student)
    result = FitResult(scale=residual_scale(teacher, student))
    layers = cut_layers(teacher, student)
    if progress:
        layers = tqdm(layers, desc="fit", unit="layer")
    for layer in layers:
        t_proj, s_proj = t_projs[layer], s_projs[layer]
        t_block = s_block = None
        if target == "stream":
            t_block, s_block = decoder_layers(teacher)[layer], decoder_layers(student)[layer]
        stats = layer_stats(teacher, student, t_proj.module, s_proj.module, blocks, batch_size, t_block, s_block,
                            result.scale)
        w_t, w_p = t_proj.module.weight, s_proj.module.weight
        new = solve_projection(w_t, w_p, stats, fit_blocks(t_proj, s_proj, scope), scale=result.scale,
                               damping=damping)
        before = output_error(w_t, w_p, stats, result.scale)
        with torch.no_grad():
            s_proj.module.weight.copy_(new.to(w_p.dtype))
        result.layers[layer] = {"error_cut": before, "error_fit": output_error(w_t, new, stats, result.scale),
                                "tokens": stats.tokens}
        result.weights[f"{s_proj.name}.weight"] = s_proj.module.weight.detach().cpu().clone()
    return result


# ---- the artifact: rule fit writes it, rule prune_fit loads it ----------------------------------------------
def write_fit(path: str | os.PathLike, result: FitResult, doc: Mapping[str, Any]) -> Path:
    """Write the fit artifact atomically: the fitted weights (safetensors) with ``doc`` as its metadata."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        save_file({k: v.contiguous() for k, v in result.weights.items()}, str(tmp),
                  metadata={"statereduce": json.dumps(doc, sort_keys=True)})
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def read_fit(path: str | os.PathLike, expect: Mapping[str, Any] | None = None) -> tuple[dict[str, torch.Tensor],
                                                                                         dict[str, Any]]:
    """(fitted weights by name in the pruned model, metadata) of a fit artifact, checked against ``expect``."""
    if not Path(path).exists():
        raise missing(path)
    try:
        with safe_open(str(path), "pt") as f:
            meta = (f.metadata() or {}).get("statereduce")
        weights = load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise unreadable(path, "safetensors", err) from None
    if meta is None:
        raise ArtifactError(f"{path} is not a fit artifact (it has no statereduce metadata); {remedy(path)}")
    doc = json.loads(meta)
    if doc.get("format") != FIT_FORMAT:
        raise ArtifactError(f"{path}: fit format {doc.get('format')!r} is not supported; valid: {FIT_FORMAT}; "
                            f"{remedy(path)}")
    check_provenance(path, doc, expect)
    return weights, doc


def apply_fit(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> list[str]:
    """Load the fitted projections into ``model`` (the pruned checkpoint in memory); every name must be one of its
    linear-attention output projections with the same shape. Returns the names."""
    fitted = {f"{p.name}.weight": p.module for p in out_projections(model).values()}
    bad = sorted(set(weights) - set(fitted))
    if bad:
        raise ValueError(f"fit weights {bad[:3]} are not output projections of this model; valid: "
                         f"{', '.join(sorted(fitted)[:4])}, ...")
    with torch.no_grad():
        for name, w in weights.items():
            mod = fitted[name]
            if tuple(mod.weight.shape) != tuple(w.shape):
                raise ValueError(f"fit weight {name} has shape {tuple(w.shape)}; the pruned model's is "
                                 f"{tuple(mod.weight.shape)} (was the selection rebuilt after the fit?)")
            mod.weight.copy_(w.to(mod.weight.dtype))
    return sorted(weights)
