"""Rank analysis of the recurrent state and of the selected key/query subspace (paper Sec. 2.2, App. C.1-C.5).

* Metrics: stable rank ``er(S) = ||S||_F^2 / ||S||_2^2`` and rank utilization ``u(S) = er(S) / min(d_v, d_k)``
  of a state S [d_v, d_k] (paper Eq. 3 and Sec. 2.2.1; d is the smaller side, the largest rank S can have). In a
  checkpoint whose layers keep different key widths each layer's states are [d_v, d_k'(layer)] and its u divides by
  min(d_v, d_k'(layer)); a value or joint cut's states are [d_v', d_k'] and u divides by min(d_v', d_k').
* States come from the model's own forward pass (fla's kernels, or :mod:`statereduce.kernels.fla_fallback` on CPU):
  the input is fed in segments of ``stride`` tokens with the HF cache carried over, and after each segment
  every linear-attention layer's recurrent state is read from the cache (:meth:`LinearAttentionAdapter.
  recurrent_states`). States whose last token lies before position ``skip`` are not scored.
* Summaries: per-head utilization statistics and the Pearson correlation with the baseline (Table 5), the
  conditioning of the selected columns of the calibration matrix [Q; K] (Table 6), the overlap between two
  selections against its random expectation (App. C.2), and the singular values of one head (Figure 5).

:func:`rank_report` bundles these into the JSON document written as ``results/{model}/.../rank.json``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from statereduce import __version__
from statereduce.adapters import get_adapter
from statereduce.eval.documents import layer_mean
from statereduce.core.artifacts import check_prune_record
from statereduce.core.checkpoints import base_checkpoint
from statereduce.core.data import load_split, token_blocks
from statereduce.core.h5files import H5Artifact
from statereduce.core.models import kernel_check_record, load_model
from statereduce.core.runtime import jsonable, read_json, write_json
from statereduce.core.selection_file import read_selection
from statereduce.selectors.overlap import as_layers, head_keep, keep_overlap  # noqa: F401  (keep_overlap re-exported)
from statereduce.common.settings import RankSettings

HeadKey = tuple[int, int]  # (layer index, head index)


# ---- metrics ----------------------------------------------------------------------------------
def _as_matrices(S: torch.Tensor | np.ndarray) -> torch.Tensor:
    S = torch.as_tensor(S)
    if S.dim() < 2:
        raise ValueError(f"expected a batch of matrices [..., d_v, d_k], got shape {tuple(S.shape)}")
    if S.shape[-1] == 0 or S.shape[-2] == 0:
        raise ValueError(f"matrices must have d_v >= 1 and d_k >= 1, got shape {tuple(S.shape)}")
    return S.detach().to(torch.float64)


def singular_values(S: torch.Tensor | np.ndarray) -> torch.Tensor:
    """Singular values of a batch of matrices, float64 [..., min(d_v, d_k)] in descending order.

    A matrix with a non-finite entry gets all-NaN singular values (instead of LAPACK's error).
    """
    S = _as_matrices(S)
    finite = torch.isfinite(S).all(dim=-1).all(dim=-1)
    sv = torch.linalg.svdvals(torch.where(finite[..., None, None], S, torch.zeros((), dtype=S.dtype, device=S.device)))
    return torch.where(finite[..., None], sv, torch.full_like(sv, math.nan))


def _er_from(S: torch.Tensor, sv: torch.Tensor) -> torch.Tensor:
    fro2 = torch.linalg.matrix_norm(torch.nan_to_num(S), ord="fro") ** 2
    fro2 = torch.where(torch.isnan(sv[..., 0]), torch.full_like(fro2, math.nan), fro2)
    return fro2 / sv[..., 0] ** 2  # 0 / 0 = NaN for a zero matrix


def stable_rank(S: torch.Tensor | np.ndarray) -> torch.Tensor:
    """Stable rank ``er(S) = ||S||_F^2 / ||S||_2^2`` of each matrix (paper Sec. 2.2), float64 [...].

    1 <= er(S) <= rank(S). Computed in float64. A zero matrix (no spectral norm to divide by) or a matrix with
    a non-finite entry gives NaN, never an error.

    Args:
        S: a matrix or a batch of matrices [..., d_v, d_k] (torch or numpy, any float dtype).
    """
    S = _as_matrices(S)
    return _er_from(S, singular_values(S))


def utilization(S: torch.Tensor | np.ndarray) -> torch.Tensor:
    """Rank utilization ``u(S) = er(S) / min(d_v, d_k)`` of each matrix (paper Sec. 2.2.1), float64 [...], in
    (0, 1]; NaN where :func:`stable_rank` is NaN."""
    S = _as_matrices(S)
    return stable_rank(S) / min(S.shape[-2], S.shape[-1])


# ---- states from the forward pass -------------------------------------------------------------
def _output_cache(out):
    """The cache of a model output (``cache`` in transformers >= 5, ``past_key_values`` before)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _check_segments(input_ids: torch.Tensor, stride: int, skip: int) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] < 1:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a LongTensor [B, T] with T >= 1, got {shape}")
    if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
        raise ValueError(f"stride={stride!r} is invalid; valid: an integer >= 1")
    if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
        raise ValueError(f"skip={skip!r} is invalid; valid: an integer >= 0")


def iter_states(
    model: nn.Module, input_ids: torch.Tensor, stride: int = 64, skip: int = 0
) -> Iterator[tuple[int, dict[int, torch.Tensor]]]:
    """Run the model over ``input_ids`` in segments of ``stride`` tokens and yield the recurrent states.

    Segments end at multiples of ``stride`` (and at T). Segment i is ``model(ids[:, s:e], <cache_argument>=cache,
    use_cache=True)`` with the cache of segment i-1, so the states are those of one causal pass over the whole
    input, computed by the model's own kernels. The segments whose states are not yielded (last token before
    ``skip``) are merged into one forward.

    Args:
        model: a causal LM of a registered family, in eval mode.
        input_ids: [B, T] token ids (no padding).
        stride: tokens per segment; states are read every ``stride`` tokens.
        skip: states whose last token position (0-based) is below ``skip`` are not yielded.
    Yields:
        (pos, {layer: S [B, HV, d_v, d_k]}): pos is the 0-based position of the last token the states include
        (they have absorbed tokens 0..pos); the tensors are views of the live cache, valid until the next step.
    """
    _check_segments(input_ids, stride, skip)
    if model.training:
        raise ValueError("model is in training mode; call model.eval() first (dropout would perturb the states)")
    adapter = get_adapter(model)
    device = next(model.parameters()).device
    ids = input_ids.to(device)
    length = ids.shape[1]
    bounds = list(range(stride, length, stride)) + [length]
    # the states at boundaries b with b - 1 < skip are never read: run up to the last of them in one call
    first = max((b for b in bounds if b - 1 < skip), default=None)
    if first is not None:
        bounds = [first] + [b for b in bounds if b > first]
    cache, start = None, 0
    with torch.no_grad():
        for end in bounds:
            out = model(input_ids=ids[:, start:end], **{adapter.cache_argument: cache}, use_cache=True,
                        logits_to_keep=1)
            cache = _output_cache(out)
            if end - 1 >= skip:
                yield end - 1, adapter.recurrent_states(cache)
            start = end


@dataclass
class RankSamples:
    """Stable rank / utilization of every (layer, head) state over (sequence, position) samples.

    Args:
        positions: int64 [P] 0-based position of the last token of each sample's state.
        er: {(layer, head): float64 [B, P]} stable rank per sequence and position (NaN for a zero state).
        u: {(layer, head): float64 [B, P]} rank utilization, ``er / min(d_v(layer), d_k(layer))``.
        d_k, d_v: state sizes (each the mean over the layers, an int when every layer keeps one width);
            num_heads: state heads per layer (value heads HV under GVA).
        key_dims: {layer: d_k} of every layer's states (the widths a per-layer-width checkpoint keeps).
        spectrum_head: the (layer, head) whose singular values were kept, or None.
        spectrum: float64 [B, P, min(d_v, d_k)] singular values of ``spectrum_head``'s states, or None.
    """

    positions: np.ndarray
    er: dict[HeadKey, np.ndarray]
    u: dict[HeadKey, np.ndarray]
    d_k: int | float
    d_v: int | float
    num_heads: int
    key_dims: dict[int, int]
    spectrum_head: HeadKey | None = None
    spectrum: np.ndarray | None = None

    def head_means(self, which: str = "u") -> dict[HeadKey, float]:
        """Per-head mean of ``"u"`` or ``"er"`` over all (sequence, position) samples (NaN samples ignored)."""
        return {key: _finite_mean(v) for key, v in self._metric(which).items()}

    def head_stds(self, which: str = "u") -> dict[HeadKey, float]:
        """Per-head standard deviation (ddof 0) of ``"u"`` or ``"er"`` over the finite samples."""
        return {key: _finite_std(v) for key, v in self._metric(which).items()}

    def _metric(self, which: str) -> dict[HeadKey, np.ndarray]:
        if which not in ("u", "er"):
            raise ValueError(f"unknown metric {which!r}; valid: u, er")
        return self.u if which == "u" else self.er


def collect_rank_samples(
    model: nn.Module,
    input_ids: torch.Tensor,
    skip: int = RankSettings.skip,
    stride: int = RankSettings.stride,
    spectrum_head: HeadKey | None = None,
) -> RankSamples:
    """Stable rank and utilization of every recurrent-state head, read from the model's forward pass.

    Args:
        model: a causal LM of a registered family (baseline or pruned), in eval mode.
        input_ids: [B, T] evaluation token ids.
        skip: states whose last token position is below ``skip`` are not scored (design: first 128 tokens).
        stride: read the states every ``stride`` tokens (see :func:`iter_states`).
        spectrum_head: (layer, head) whose singular values are also returned (Figure 5), or None.
    Raises:
        ValueError: bad arguments, ``spectrum_head`` not a state head, or no position reaches ``skip``.
    """
    adapter = get_adapter(model)
    dims = adapter.dims(adapter.config)
    layers = [layer for layer, _ in adapter.mixer_layers()]
    if spectrum_head is not None:
        layer, head = spectrum_head
        if layer not in layers or not 0 <= head < dims.num_v_heads:
            raise ValueError(
                f"spectrum_head={spectrum_head!r} is not a state head; valid: layer in {layers}, "
                f"head in [0, {dims.num_v_heads})"
            )
    positions, er, spectra = [], {layer: [] for layer in layers}, []
    key_dims: dict[int, int] = {}
    value_dims: dict[int, int] = {}
    for pos, states in iter_states(model, input_ids, stride=stride, skip=skip):
        positions.append(pos)
        for layer, S in states.items():
            value_dims[layer], key_dims[layer] = (int(x) for x in S.shape[-2:])  # [B, HV, d_v'(layer), d_k'(layer)]
            S = S.to(torch.float64)
            sv = singular_values(S)  # [B, HV, min(d_v, d_k)]
            er[layer].append(_er_from(S, sv).cpu().numpy())  # [B, HV]
            if spectrum_head is not None and layer == spectrum_head[0]:
                spectra.append(sv[:, spectrum_head[1]].cpu().numpy())
    if not positions:
        raise ValueError(f"no state to score: skip={skip} >= sequence length T={input_ids.shape[1]}")
    er_heads = {}
    for layer in layers:
        stacked = np.stack(er[layer], axis=1)  # [B, P, HV]
        for head in range(dims.num_v_heads):
            er_heads[(layer, head)] = np.ascontiguousarray(stacked[:, :, head])
    return RankSamples(
        positions=np.asarray(positions, dtype=np.int64),
        er=er_heads,
        u={key: v / min(key_dims[key[0]], value_dims[key[0]]) for key, v in er_heads.items()},
        d_k=layer_mean(list(key_dims.values())),
        d_v=layer_mean(list(value_dims.values())),
        num_heads=dims.num_v_heads,
        key_dims=key_dims,
        spectrum_head=spectrum_head,
        spectrum=np.stack(spectra, axis=1) if spectrum_head is not None else None,
    )


# ---- summaries --------------------------------------------------------------------------------
def _finite(values) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64).ravel()
    return v[np.isfinite(v)]


def _finite_mean(values) -> float:
    v = _finite(values)
    return float(v.mean()) if v.size else math.nan


def _finite_std(values) -> float:
    v = _finite(values)
    return float(v.std()) if v.size else math.nan


def utilization_table(per_head_u: Mapping[HeadKey, float]) -> dict[str, float | int]:
    """Mean, std (ddof 0), min and max over heads of the per-head mean utilization (paper Table 5).

    Args:
        per_head_u: {(layer, head): mean u of that head} (e.g. :meth:`RankSamples.head_means`).
    Returns:
        {"mean", "std", "min", "max", "n_heads", "n_nan"}: statistics over the heads with a finite value
        (NaN if there is none); ``n_nan`` counts the heads left out.
    """
    values = np.asarray(list(per_head_u.values()), dtype=np.float64)
    v = values[np.isfinite(values)]
    stats = (float(v.mean()), float(v.std()), float(v.min()), float(v.max())) if v.size else (math.nan,) * 4
    return {
        **dict(zip(("mean", "std", "min", "max"), stats)),
        "n_heads": int(v.size),
        "n_nan": int(values.size - v.size),
    }


def pearson(baseline: Mapping[HeadKey, float], method: Mapping[HeadKey, float]) -> float:
    """Pearson correlation of two per-head statistics over their common (layer, head) keys (Table 5's rho).

    Keys where either value is not finite are left out. Returns NaN with fewer than two common keys or
    when either side is constant over them.
    """
    keys = [k for k in baseline if k in method and math.isfinite(baseline[k]) and math.isfinite(method[k])]
    if len(keys) < 2:
        return math.nan
    a = np.array([baseline[k] for k in keys], dtype=np.float64)
    b = np.array([method[k] for k in keys], dtype=np.float64)
    a, b = a - a.mean(), b - b.mean()
    denom = math.sqrt(float(a @ a) * float(b @ b))
    return float(a @ b) / denom if denom > 0 else math.nan


def selected_conditioning(K, Q, keep=None) -> dict:
    """Conditioning of the selected columns of the calibration matrix M = [Q; K] per head (paper Table 6).

    For each head, M_h = [Q_h; K_h] (rows: calibration samples, 2N; columns: channels) restricted to the kept
    columns, [2N, d_k']; sigma_max and sigma_min are its largest and d_k'-th singular values (sigma_min is 0
    when 2N < d_k'), kappa = sigma_max / sigma_min (inf for sigma_min = 0, NaN for a zero matrix). The
    medians are over all heads of all layers given; Table 6's kappa is the median of per-head ratios.

    Args:
        K, Q: calibration keys / queries as stored in ``activations.h5``, [H, N, d_k] for one layer, or
            {layer: [H, N, d_k]} for several.
        keep: the selection: per-head kept indices [H][d_k'] (one layer) or {layer: [H][d_k']}, or transforms
            [H, d_k', d_k] / {layer: [H, d_k', d_k]} (as :func:`~statereduce.core.selection_file.read_selection`
            returns); None keeps every channel (the baseline).
    Returns:
        {"per_head": {(layer, head): {"sigma_min", "sigma_max", "kappa"}}, "median": {"sigma_min",
        "sigma_max", "kappa"}, "n_heads", "key_dims": {layer: d_k'}}; each layer may keep its own d_k' (per-layer
        budgets), whose sigma_min is the d_k'(layer)-th singular value; a single layer is reported as layer 0.
    """
    K_layers, Q_layers = as_layers(K, "K"), as_layers(Q, "Q")
    keep_layers = {layer: None for layer in K_layers} if keep is None else as_layers(keep, "keep")
    if set(K_layers) != set(Q_layers) or set(K_layers) != set(keep_layers):
        raise ValueError(
            f"K, Q and keep cover different layers: {sorted(K_layers)}, {sorted(Q_layers)}, {sorted(keep_layers)}"
        )
    per_head: dict[HeadKey, dict[str, float]] = {}
    key_dims: dict[int, int] = {}
    for layer in sorted(K_layers):
        k, q = np.asarray(K_layers[layer]), np.asarray(Q_layers[layer])
        if k.ndim != 3 or k.shape != q.shape:
            raise ValueError(f"layer {layer}: K {k.shape} and Q {q.shape} must both be [H, N, d_k]")
        heads = head_keep(keep_layers[layer], k.shape[0], k.shape[2], f"layer {layer}")
        widths = sorted({idx.shape[0] for idx in heads})
        if len(widths) != 1:
            raise ValueError(f"layer {layer}: the heads keep different numbers of channels {widths}")
        key_dims[layer] = int(widths[0])
        for head, idx in enumerate(heads):
            m = np.concatenate([q[head], k[head]], axis=0).astype(np.float64)
            m = m @ idx.T if idx.ndim == 2 else m[:, idx]  # a transform selection projects: M T^T
            if np.isfinite(m).all():
                s = np.linalg.svd(m, compute_uv=False)
                s_max, s_min = float(s[0]), (float(s[-1]) if s.size >= m.shape[1] else 0.0)
            else:
                s_max = s_min = math.nan
            with np.errstate(divide="ignore", invalid="ignore"):
                kappa = float(np.float64(s_max) / np.float64(s_min))
            per_head[(layer, head)] = {"sigma_min": s_min, "sigma_max": s_max, "kappa": kappa}
    median = {
        name: float(np.nanmedian([v[name] for v in per_head.values()])) if per_head else math.nan
        for name in ("sigma_min", "sigma_max", "kappa")
    }
    return {"per_head": per_head, "median": median, "n_heads": len(per_head), "key_dims": key_dims}


def selection_widths(keep: Mapping[int, Any]) -> dict[int, int]:
    """{layer: d_k'} of a selection as :func:`~statereduce.core.selection_file.read_selection` returns it (kept indices
    per head, or transforms [H, d_k', d_k]); each layer may keep its own width."""
    return {int(layer): int(np.asarray(heads[0]).shape[0]) for layer, heads in keep.items()}


def check_selection_widths(keep: Mapping[int, Any], key_dims: Mapping[int, int], selection, checkpoint) -> None:
    """Raise a one-line ValueError unless the selection keeps, in every layer, the width the checkpoint's layer has
    (``key_dims``: :meth:`~statereduce.adapters.base.LinearAttentionAdapter.layer_key_dims`)."""
    widths = selection_widths(keep)
    if widths != dict(key_dims):
        raise ValueError(f"{selection} keeps widths {dict(sorted(widths.items()))} per layer but {checkpoint}'s "
                         f"layers have {dict(sorted(key_dims.items()))}; rebuild the pruned checkpoint from it")


# ---- report -----------------------------------------------------------------------------------
def per_head_utilization(report: Mapping) -> dict[HeadKey, float]:
    """{(layer, head): mean u} from a :func:`rank_report` document (also after a JSON round trip)."""
    return {(int(r["layer"]), int(r["head"])): float(r["u_mean"]) for r in report["per_head"]}


def _spectrum_summary(spectrum: np.ndarray) -> dict[str, list[float]]:
    flat = spectrum.reshape(-1, spectrum.shape[-1])
    flat = flat[np.isfinite(flat).all(axis=1)]
    if not flat.size:
        return {"mean": [], "q10": [], "median": [], "q90": [], "n_samples": 0}
    q10, q50, q90 = np.quantile(flat, [0.1, 0.5, 0.9], axis=0)
    return {"mean": flat.mean(0), "q10": q10, "median": q50, "q90": q90, "n_samples": int(flat.shape[0])}


def rank_report(
    model: nn.Module,
    input_ids: torch.Tensor,
    skip: int = RankSettings.skip,
    stride: int = RankSettings.stride,
    *,
    spectrum_head: HeadKey | None = None,
    baseline: Mapping | None = None,
) -> dict:
    """The ``rank.json`` document of one model: per-head rank utilization of its recurrent states (paper App. C.1).

    Args:
        model: a causal LM of a registered family (baseline or pruned), in eval mode.
        input_ids: [B, T] evaluation token ids.
        skip, stride: see :func:`collect_rank_samples`.
        spectrum_head: (layer, head) whose singular values are summarised per index (Figure 5), or None.
        baseline: the baseline model's report; when given, adds ``pearson_u`` over the common heads (Table 5).
    Returns:
        A JSON-serialisable dict (non-finite floats as strings, see :func:`statereduce.core.runtime.jsonable`):
        ``settings``, ``model`` (state sizes; ``key_dims``: {layer: d_k'} and ``d_k`` their mean), ``per_head`` (one
        record per (layer, head) with its layer's ``d_k`` and er/u mean and std), ``summary`` ({"u", "er"}:
        :func:`utilization_table` of the per-head means), optionally ``pearson_u`` and ``spectrum``.
    """
    samples = collect_rank_samples(model, input_ids, skip=skip, stride=stride, spectrum_head=spectrum_head)
    u_mean, u_std = samples.head_means("u"), samples.head_stds("u")
    er_mean, er_std = samples.head_means("er"), samples.head_stds("er")
    adapter = get_adapter(model)
    doc = {
        "settings": {
            "skip": skip,
            "stride": stride,
            "n_sequences": int(input_ids.shape[0]),
            "seq_len": int(input_ids.shape[1]),
            "positions": samples.positions,
            "n_samples_per_head": int(input_ids.shape[0]) * len(samples.positions),
        },
        "model": {
            "family": adapter.family,
            "num_heads": samples.num_heads,
            "d_k": samples.d_k,
            "key_dims": {str(layer): width for layer, width in sorted(samples.key_dims.items())},
            "d_v": samples.d_v,
            "layers": sorted({layer for layer, _ in samples.u}),
        },
        "per_head": [
            {
                "layer": key[0],
                "head": key[1],
                "d_k": samples.key_dims[key[0]],
                "u_mean": u_mean[key],
                "u_std": u_std[key],
                "er_mean": er_mean[key],
                "er_std": er_std[key],
            }
            for key in sorted(samples.u)
        ],
        "summary": {"u": utilization_table(u_mean), "er": utilization_table(er_mean)},
        "package_version": __version__,
    }
    if baseline is not None:
        doc["pearson_u"] = pearson(per_head_utilization(baseline), u_mean)
    if samples.spectrum is not None:
        layer, head = samples.spectrum_head
        doc["spectrum"] = {"layer": layer, "head": head, **_spectrum_summary(samples.spectrum)}
    return jsonable(doc)


def rank_analysis(checkpoint: str | Path, settings: RankSettings, info: dict[str, Any], out_path: str | Path, *,
                  baseline: str | Path | None = None, selection: str | Path | None = None,
                  activations: str | Path | None = None, extra: dict[str, Any] | None = None) -> dict:
    """The ``rank.json`` of one checkpoint (paper Sec. 2.2, App. C.1, C.5; Tables 5 and 6).

    Rank utilization of the recurrent state of every head over ``n_samples`` held-out blocks of ``seq_len``
    tokens (:func:`statereduce.stages.rank.rank_report`: states from the model's own forward pass, positions before
    ``skip`` left out, one sample every ``stride`` tokens), the singular values of ``spectrum_head``, the
    Pearson correlation of per-head utilization with the baseline's ``rank.json`` when given, and the
    conditioning of the selected [Q; K] calibration columns when ``activations`` is given (every channel for
    the baseline, the ``selection``'s for a pruned model). ``settings`` are the model's rank settings
    (:class:`~statereduce.common.settings.RankSettings`, with ``corpus_spec``).

    Before the model is loaded, the artifacts must have been written for this job (``info``'s model and family,
    ``extra``'s method and pct): a pruned checkpoint's ``prune_record.json`` and the ``selection``, and the
    ``activations`` for the selection's calibration id and head sizes (:mod:`statereduce.core.artifacts`).
    """
    expected = {**info, **(extra or {})}
    keep = None
    if selection is not None:
        check_prune_record(checkpoint, expected)
        chosen, sel_meta = read_selection(selection, expect=expected)
        keep = chosen.keys  # None for a value cut: every key channel kept
        expected.update(calibration=sel_meta.get("calibration"), num_heads=sel_meta.get("num_heads"),
                        head_k_dim=sel_meta.get("d_k"))
    if activations is not None:
        H5Artifact(activations).expect({k: v for k, v in expected.items() if k not in ("method", "pct")})
    model, tokenizer = load_model(checkpoint, dtype=info["dtype"], device=info["device"])
    if keep is not None:
        check_selection_widths(keep, get_adapter(model).layer_key_dims(), selection, checkpoint)
    docs = load_split(settings.corpus_spec, "heldout")
    ids = token_blocks(tokenizer, docs, int(settings.n_samples), int(settings.seq_len), int(settings.seed))
    head = settings.spectrum_head
    doc = rank_report(model, ids.to(info["device"]), skip=int(settings.skip), stride=int(settings.stride),
                           spectrum_head=tuple(head) if head is not None else None,
                           baseline=read_json(baseline) if baseline is not None else None)
    if activations is not None:
        acts = H5Artifact(activations)
        layers = acts.layers()
        data = {layer: acts.read(layer, ["K", "Q"]) for layer in layers}
        cond = selected_conditioning({lay: d["K"] for lay, d in data.items()},
                                          {lay: d["Q"] for lay, d in data.items()}, keep)
        cond["per_head"] = [{"layer": lay, "head": h, "d_k": cond["key_dims"][lay], **v}
                            for (lay, h), v in sorted(cond["per_head"].items())]
        cond["key_dims"] = {str(lay): w for lay, w in sorted(cond["key_dims"].items())}
        doc["conditioning"] = {**cond, "activations": str(activations), "selection": str(selection)}
    base = base_checkpoint(model)
    checked = kernel_check_record(model)  # on CUDA: the fla kernel routes checked and which path ran each
    doc["provenance"] = {"checkpoint": str(checkpoint), "model": info["model"], "corpus": settings.corpus_spec,
                         "split": "heldout", **({"base_checkpoint": base} if base is not None else {}),
                         **({"kernel_check": checked} if checked else {}), **(extra or {})}
    write_json(out_path, jsonable(doc))
    return doc
