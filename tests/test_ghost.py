"""The ``ghost`` selector (GHOST, arXiv:2602.11408): a balanced-truncation proxy per channel from calibration K and Q.

Registration and tokens, the planted answer (a channel no input drives or the readout never sees goes first), the
score against an independent numpy computation, determinism, and one run through the real selection stage on a
tiny random model of each family: capture, select, write and read the selection file, prune, and compare with the
model whose dropped channels are zeroed.
"""

from __future__ import annotations

import copy

import h5py
import numpy as np
import pytest
import torch
from _models import tiny_inputs, tiny_model

from statereduce.selectors import HeadData, get_selector, parse_method, select_heads
from statereduce.selectors.registry import value_side_names
from statereduce.stages.select import cut_code_files, selector_code_files

RNG = np.random.default_rng(0)


def call(data: HeadData, n_keep: int, variant: str = "kq"):
    return get_selector("ghost")(data, n_keep, variant=variant, rng=np.random.default_rng(0))


def reference(K: np.ndarray | None, Q: np.ndarray | None, n_keep: int) -> tuple[list[int], np.ndarray]:
    """The formula written out independently: s_j = sqrt(mean K_j^2 * mean Q_j^2) (a missing side counts as 1);
    keep the n_keep largest (ties: lower index), sorted."""
    d = (K if K is not None else Q).shape[1]
    p = (K.astype(np.float64) ** 2).sum(axis=0) / K.shape[0] if K is not None else np.ones(d)
    q = (Q.astype(np.float64) ** 2).sum(axis=0) / Q.shape[0] if Q is not None else np.ones(d)
    s = np.sqrt(p * q)
    order = sorted(range(d), key=lambda j: (-s[j], j))[:n_keep]
    keep = sorted(order)
    return keep, s[keep]


# ---- registration -------------------------------------------------------------------------------------------------


def test_registered_with_activations_only_and_its_own_module():
    sel = get_selector("ghost")
    assert sel.needs == {"activations"}
    assert sel.variants == ("kq", "k", "q") and sel.kind == "index" and sel.scores
    assert sel.options == ()
    assert sel.source_file.endswith("statereduce/selectors/ghost.py")
    assert selector_code_files("ghost") == [sel.source_file]  # editing another selector reruns no ghost job
    assert cut_code_files("ghost-q") == [sel.source_file]
    assert parse_method("ghost").selector == "ghost" and parse_method("ghost-k").variant == "k"
    assert parse_method("ghost@sens").budget == "sens"
    assert "ghost" not in value_side_names()  # key side only
    with pytest.raises(ValueError, match="ghost"):
        parse_method("ghost-v")


# ---- planted answers -----------------------------------------------------------------------------------------------


def test_channels_without_key_or_query_energy_go_first():
    n, d = 200, 8
    K = RNG.normal(size=(n, d))
    Q = RNG.normal(size=(n, d))
    K[:, 1] = 0.0        # no input drives channel 1 (uncontrollable), however loud its query
    Q[:, 1] *= 100.0
    Q[:, 5] = 0.0        # channel 5 is never read (unobservable), however loud its key
    K[:, 5] *= 100.0
    K[:, 6] = 0.0        # neither side
    Q[:, 6] = 0.0
    for n_keep in (1, 3, 5):
        sel = call(HeadData(K=K, Q=Q), n_keep)
        assert not {1, 5, 6} & set(sel.keep.tolist())
    sel = call(HeadData(K=K, Q=Q), d)
    assert sel.scores[[1, 5, 6]].tolist() == [0.0, 0.0, 0.0] and np.all(sel.scores[[0, 2, 3, 4, 7]] > 0)
    # what an additive score of [K; Q] (column energy, as DRRQR's M) would keep first: the loud one-sided channels
    additive = (K ** 2).sum(0) + (Q ** 2).sum(0)
    assert set(np.argsort(-additive)[:2].tolist()) == {1, 5}
    # one side alone keeps them: "k" keeps the loud key of channel 5, "q" the loud query of channel 1
    assert 5 in call(HeadData(K=K), 1, "k").keep.tolist()
    assert 1 in call(HeadData(Q=Q), 1, "q").keep.tolist()


@pytest.mark.parametrize("variant", ["kq", "k", "q"])
@pytest.mark.parametrize("n_keep", [1, 4, 7, 12])
def test_score_matches_an_independent_computation(variant, n_keep):
    n, d = 321, 12
    scale = np.exp(RNG.normal(size=d))
    K = (RNG.normal(size=(n, d)) * scale + 0.3).astype(np.float32)
    Q = (RNG.normal(size=(n + 17, d)) * scale[::-1]).astype(np.float32)  # K and Q rows may differ in number
    data = HeadData(K=K if variant != "q" else None, Q=Q if variant != "k" else None)
    sel = call(data, n_keep, variant)
    keep, scores = reference(data.K, data.Q, n_keep)
    assert sel.keep.tolist() == keep
    np.testing.assert_allclose(sel.scores, scores, rtol=1e-12)
    assert sel.keep.dtype == np.int64 and sel.scores.dtype == np.float64


def test_channel_independent_factors_change_nothing():
    """kappa_P, kappa_O of the derivation: scaling every key (query) channel alike, or repeating the rows, keeps the
    same channels; scaling one channel's key by c scales its score by |c|."""
    K, Q = RNG.normal(size=(150, 10)), RNG.normal(size=(150, 10))
    base = call(HeadData(K=K, Q=Q), 4)
    for data in (HeadData(K=3.0 * K, Q=Q), HeadData(K=K, Q=0.01 * Q), HeadData(K=np.vstack([K, K]), Q=Q)):
        assert call(data, 4).keep.tolist() == base.keep.tolist()
    K2 = K.copy()
    K2[:, 0] *= -5.0
    full, full2 = call(HeadData(K=K, Q=Q), 10), call(HeadData(K=K2, Q=Q), 10)
    np.testing.assert_allclose(full2.scores[0], 5.0 * full.scores[0], rtol=1e-12)


def test_ties_keep_the_lowest_indices_and_missing_sides_are_named():
    ones = np.ones((5, 6))
    assert call(HeadData(K=ones, Q=ones), 3).keep.tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match=r"needs HeadData\.Q"):
        call(HeadData(K=ones), 2)
    with pytest.raises(ValueError, match=r"needs HeadData\.K"):
        call(HeadData(Q=ones), 2, "k")
    with pytest.raises(ValueError, match=r"K must be \[N, d_k=6\] with N >= 1"):
        call(HeadData(K=np.ones((0, 6)), Q=ones), 2)
    with pytest.raises(ValueError, match="non-finite"):
        call(HeadData(K=np.full((5, 6), np.nan), Q=ones), 2)


def test_deterministic_sorted_and_independent_of_order_and_workers():
    heads = [(layer, head, HeadData(K=RNG.normal(size=(40, 16)) * np.arange(1, 17),
                                    Q=RNG.normal(size=(40, 16)) * np.arange(16, 0, -1)))
             for layer in range(3) for head in range(2)]
    a = select_heads("ghost", heads, 6, seed=0, progress=False)
    b = select_heads("ghost", iter(heads[::-1]), 6, seed=99, progress=False)  # the seed plays no part
    c = select_heads("ghost", iter(heads), 6, seed=0, progress=False, workers=2)
    by_head = {(layer, head): s for layer, head, s in b}
    for (layer, head, s), (_, _, s_c) in zip(a, c):
        assert np.all(np.diff(s.keep) > 0) and s.keep.shape == (6,)
        assert s.keep.tolist() == by_head[layer, head].keep.tolist() == s_c.keep.tolist()
        np.testing.assert_array_equal(s.scores, by_head[layer, head].scores)


# ---- the real selection stage ------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["mamba2", "gated_deltanet", "delta_net", "qwen3_5"])
def test_selection_stage_end_to_end(family, tmp_path):
    """Capture a tiny random model's calibration statistics as rule ``calibrate`` writes them, select with
    ``ghost_50`` through :func:`select_channels`, write and read the selection file, check the kept channels against
    the formula on the HDF5 rows, prune, and compare with the unpruned model with the dropped channels zeroed."""
    from statereduce.core.slicing import masked_cut
    from statereduce.stages.capture import capture_activations, export_qk_weights
    from statereduce.stages.prune import prune_model
    from statereduce.stages.select import read_selection, select_channels, write_selection

    info = {"model": f"tiny-{family}", "family": family, "dtype": "float32", "device": "cpu"}
    model = tiny_model(family)
    qk = export_qk_weights(model, tmp_path / "weights" / "qk.h5", attrs={"model": info["model"]})
    acts = capture_activations(model, tiny_inputs(batch=2, length=40), tmp_path / "activations.h5",
                               rows_per_head=60, attrs={"model": info["model"], "calibration": "default"})
    rows, meta = select_channels(qk, "ghost", 50, activations=acts, expect=info)
    d_k = meta["d_k"]
    assert meta["selector"] == "ghost" and meta["d_k_new"] == d_k // 2 and meta["family"] == family
    path = write_selection(tmp_path / "select" / "ghost_50.parquet", rows, meta)
    kept, meta_read = read_selection(path, expect={**info, "method": "ghost", "pct": 50})
    assert meta_read["selector"] == "ghost"

    with h5py.File(acts) as f:  # the formula on the stored rows, head by head (for Mamba-2: group by group)
        for layer, head, sel in rows:
            group = f[f"layer_{layer:03d}"]
            keep, scores = reference(group["K"][head], group["Q"][head], d_k // 2)
            assert sel.keep.tolist() == keep
            np.testing.assert_allclose(sel.scores, scores, rtol=1e-10)
    ordered = sorted(rows, key=lambda r: r[:2])
    keys = {layer: torch.as_tensor(np.stack([s.keep for lay, _, s in ordered if lay == layer]))
            for layer in sorted({r[0] for r in rows})}

    inputs = tiny_inputs(batch=1, length=24, seed=5)
    reference_model = copy.deepcopy(model)
    with torch.no_grad(), masked_cut(reference_model, keys, {}):
        masked = reference_model(inputs, use_cache=False).logits
    prune_model(model, kept, meta_read)
    with torch.no_grad():
        pruned = model(inputs, use_cache=False).logits
    torch.testing.assert_close(pruned, masked, atol=1e-4, rtol=1e-4)
