"""Transform selections (paper App. B.3-B.5, C.6, F.2): ``pca`` / ``pca-adv``, their selection files, and pruning
with a semi-orthogonal transform per head.

* the selectors return the top (bottom) eigenvectors of the activations' second moment, orthonormal; PCA on the
  keys does not lower their rank utilization, ``u(K T^T) >= u(K)`` (App. F.2);
* a transform selection survives its Parquet file, a corrupted one fails to read in one line, and old index files
  still read;
* pruning with ``T`` = rows of the identity equals index pruning bit for bit; filter mixing equals a brute-force
  minimisation of the Frobenius objective (App. B.4); with filters shared across a head's channels and no SiLU
  between convolution and recurrence the pruned model equals the exact rotated computation (App. B.5, Lemma B.2);
* a pca selection of a real tiny model's calibration activations prunes into a checkpoint that reloads in a fresh
  process with identical logits.
"""

from __future__ import annotations

import importlib
import json

import numpy as np
import pytest
import _fresh as fresh
import torch
from _models import random_keep, tiny_model

from statereduce.core.artifacts import ArtifactError
from statereduce.stages.prune import mix_filters, prune_model, save_pruned
from statereduce.stages.select import read_selection, write_selection
from statereduce.selectors import HeadData, get_selector, select_heads
from statereduce.selectors.registry import HeadSelection


def call(name: str, data: HeadData, n_keep: int, variant: str = "kq") -> HeadSelection:
    return get_selector(name)(data, n_keep, variant=variant, rng=np.random.default_rng(0))


def anisotropic(rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    """Rows with a decaying spectrum in a random basis."""
    basis = np.linalg.qr(rng.standard_normal((d, d)))[0]
    return (rng.standard_normal((n, d)) * np.geomspace(3.0, 0.05, d)) @ basis.T


def utilization(m: np.ndarray) -> float:
    """Rank utilization u = er / d with er = ||M||_F^2 / ||M||_2^2 (paper Sec. 2.2) over the columns of M."""
    s = np.linalg.svd(m, compute_uv=False)
    return float((s**2).sum() / s[0] ** 2 / m.shape[1])


# -- selectors ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["kq", "k", "q"])
def test_pca_keeps_top_and_pca_adv_bottom_eigenvectors(variant):
    rng = np.random.default_rng(0)
    K, Q = anisotropic(rng, 400, 16), anisotropic(rng, 400, 16)
    c = {"kq": K.T @ K + Q.T @ Q, "k": K.T @ K, "q": Q.T @ Q}[variant]
    vals, vecs = np.linalg.eigh(c)
    for name, expect in (("pca", vecs[:, ::-1][:, :5]), ("pca-adv", vecs[:, :5])):
        sel = call(name, HeadData(K=K, Q=Q), 5, variant)
        assert sel.keep is None and sel.transform.shape == (5, 16)
        np.testing.assert_allclose(sel.transform @ sel.transform.T, np.eye(5), atol=1e-12)
        np.testing.assert_allclose(np.abs(sel.transform @ expect), np.eye(5), atol=1e-8)  # same directions
        np.testing.assert_allclose(sel.scores, (vals[::-1] if name == "pca" else vals)[:5], rtol=1e-10)
    other = {"k": HeadData(K=K, Q=anisotropic(rng, 400, 16)), "q": HeadData(K=anisotropic(rng, 400, 16), Q=Q)}
    if variant in other:  # the other side's data changes nothing
        np.testing.assert_array_equal(call("pca", other[variant], 5, variant).transform,
                                      call("pca", HeadData(K=K, Q=Q), 5, variant).transform)


@pytest.mark.parametrize("seed", range(5))
def test_pca_does_not_lower_key_rank_utilization(seed):
    """App. F.2: u(K') >= u(K) for K' = K T^T with T the top principal directions of K (the -k variant)."""
    rng = np.random.default_rng(seed)
    K = anisotropic(rng, 300, 32)
    for n_keep in (4, 8, 16, 31):
        t = call("pca", HeadData(K=K), n_keep, "k").transform
        assert utilization(K @ t.T) >= utilization(K) - 1e-12
    t_adv = call("pca-adv", HeadData(K=K), 8, "k").transform
    assert utilization(K @ t_adv.T) > utilization(K)  # the bottom directions are near-isotropic too: no contrast
    # ... but the adversarial directions carry a fraction of the energy
    assert np.linalg.norm(K @ t_adv.T) < 0.05 * np.linalg.norm(K @ call("pca", HeadData(K=K), 8, "k").transform.T)


def test_pca_is_deterministic_and_needs_activations():
    rng = np.random.default_rng(1)
    heads = [(0, h, HeadData(K=anisotropic(rng, 100, 8), Q=anisotropic(rng, 100, 8))) for h in range(3)]
    a = select_heads("pca", heads, 4, progress=False)
    b = select_heads("pca", heads[::-1], 4, progress=False, workers=2)
    by = {(lay, h): s for lay, h, s in b}
    for lay, h, s in a:
        np.testing.assert_array_equal(s.transform, by[lay, h].transform)
    with pytest.raises(ValueError, match="needs HeadData.K"):
        call("pca", HeadData(Q=anisotropic(rng, 50, 8)), 4, "k")


# -- selection files ------------------------------------------------------------------------------------


def _rows(n_layers=2, n_heads=2, d=8, n_keep=3):
    rng = np.random.default_rng(2)
    return [(lay, h, call("pca", HeadData(K=anisotropic(rng, 60, d), Q=anisotropic(rng, 60, d)), n_keep))
            for lay in range(n_layers) for h in range(n_heads)]


def _meta(kind="transform", **kw):
    return {"format": 2, "kind": kind, "model": "m", "family": "delta_net", "method": "pca", "pct": 62.5,
            "d_k": 8, "d_k_new": 3, "num_heads": 2, **kw}


def test_transform_selection_round_trips(tmp_path):
    rows = _rows()
    path = write_selection(tmp_path / "pca_62.5.parquet", rows, _meta())
    sel, meta = read_selection(path, expect={"model": "m", "method": "pca", "pct": 62.5})
    assert meta["kind"] == "transform" and sel.kind == "transform" and sorted(sel.keys) == [0, 1]
    for lay, h, s in rows:
        np.testing.assert_array_equal(sel.keys[lay][h], s.transform)


def test_corrupted_transform_selection_fails_in_one_line(tmp_path):
    rows = _rows()
    rows[1][2].transform[0] *= 2.0  # no longer orthonormal
    path = write_selection(tmp_path / "pca_62.5.parquet", rows, _meta())
    with pytest.raises(ArtifactError) as err:
        read_selection(path)
    msg = str(err.value)
    assert "\n" not in msg and "not orthonormal" in msg and "head 1" in msg and str(path) in msg
    path = write_selection(tmp_path / "bad.parquet", _rows(), _meta(d_k_new=4))
    with pytest.raises(ArtifactError, match="cannot reshape|shape"):
        read_selection(path)


def test_index_files_of_format_1_still_read(tmp_path):
    rows = [(0, h, HeadSelection(keep=np.array([0, 2, 5]), scores=None)) for h in range(2)]
    meta = {k: v for k, v in _meta(kind="index", method="l1").items() if k not in ("format", "kind")}
    path = write_selection(tmp_path / "l1.parquet", rows, meta)
    sel, got = read_selection(path)
    assert got["format"] == 1 and got["kind"] == "index" and sel.keys == {0: [[0, 2, 5], [0, 2, 5]]}
    bad = [(0, h, HeadSelection(keep=np.array([5, 2, 0]))) for h in range(2)]
    with pytest.raises(ArtifactError, match="sorted"):
        read_selection(write_selection(tmp_path / "unsorted.parquet", bad, meta))


# -- pruning with a transform ---------------------------------------------------------------------------


def _orthonormal_rows(rng: np.random.Generator, h: int, d_new: int, d: int) -> torch.Tensor:
    return torch.from_numpy(np.stack([np.linalg.qr(rng.standard_normal((d, d)))[0][:d_new] for _ in range(h)]))


@pytest.mark.parametrize("family", ["delta_net", "gated_deltanet", "mamba2", "qwen3_5"])
def test_identity_rows_reproduce_index_pruning_bit_for_bit(family):
    a = tiny_model(family)
    b = tiny_model(family)
    b.load_state_dict(a.state_dict())
    keep = random_keep(a, 16, seed=3)
    transforms = {layer: torch.eye(32, dtype=torch.float64)[idx] for layer, idx in keep.items()}
    prune_model(a, keep, {"method": "rand", "pct": 50})
    record = prune_model(b, transforms, {"method": "pca", "pct": 50})
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert record.keep == {} and len(record.transform["sha256"]) == 64
    x = torch.randint(0, 300, (1, 40))
    with torch.no_grad():
        assert torch.equal(a(x).logits, b(x).logits)


def test_filter_mixing_is_the_frobenius_optimum():
    """App. B.4: the mixed filters minimise sum_j ||diag(w'_j) - T diag(w_j) T^T||_F^2 (brute force: L-BFGS)."""
    from scipy.optimize import minimize

    rng = np.random.default_rng(5)
    d, d_new, lags = 6, 4, 3
    w = rng.standard_normal((d, 1, lags))
    t = np.linalg.qr(rng.standard_normal((d, d)))[0][:d_new]
    rotated = [t @ np.diag(w[:, 0, j]) @ t.T for j in range(lags)]

    def objective(flat):
        wp = flat.reshape(d_new, lags)
        return sum(np.sum((np.diag(wp[:, j]) - rotated[j]) ** 2) for j in range(lags))

    brute = minimize(objective, np.zeros(d_new * lags), method="L-BFGS-B", options={"gtol": 1e-12}).x
    mixed = mix_filters(torch.from_numpy(w), torch.from_numpy(t)).numpy()[:, 0, :]
    np.testing.assert_allclose(mixed, brute.reshape(d_new, lags), atol=1e-6)
    assert objective(mixed.ravel()) <= objective(brute) + 1e-12
    shared = torch.from_numpy(np.repeat(w[:1], d, axis=0))  # one filter for the head: carried over exactly
    assert torch.equal(mix_filters(shared, torch.from_numpy(t)), shared[:d_new])


def _share_filters(model) -> None:
    """Tie every head's q/k conv filters to the head's first channel (a shared convolution, App. B.5)."""
    from statereduce.adapters import get_adapter

    adapter = get_adapter(model)
    h, d = adapter.num_heads, adapter.head_k_dim
    with torch.no_grad():
        for _, mixer in adapter.mixer_layers():
            for conv in (mixer.q_conv1d, mixer.k_conv1d):
                w = conv.weight.view(h, d, *conv.weight.shape[1:])
                w.copy_(w[:, :1].expand_as(w))


def test_shared_filters_without_silu_give_the_exact_rotated_model():
    """With shared q/k filters and no activation between convolution and recurrence, pruning with T equals the
    unpruned model whose kernel receives T q and T k (Proposition 3.1 with Lemma B.2); with per-channel filters
    (mixed) it does not."""
    rng = np.random.default_rng(6)
    for shared, exact in ((True, True), (False, False)):
        torch.manual_seed(0)
        base = tiny_model("delta_net", qk_activation="identity")
        if shared:
            _share_filters(base)
        pruned = tiny_model("delta_net", qk_activation="identity")
        pruned.load_state_dict(base.state_dict())
        transforms = {layer: _orthonormal_rows(rng, 2, 12, 32) for layer in (0, 1)}
        record = prune_model(pruned, transforms, {"method": "pca", "pct": 62.5}, norm_eps="stock")
        assert record.transform["conv_heads_shared" if shared else "conv_heads_mixed"] == 2 * 2 * 2
        x = torch.randint(0, 300, (2, 90))
        module = importlib.import_module("fla.layers.delta_net")
        original = module.chunk_delta_rule
        layer_of = {id(m): i for i, m in enumerate(base.model.layers)}
        current = {}

        def rotated(q, k, *args, **kwargs):
            t = transforms[current["layer"]].to(q.dtype)
            return original(torch.einsum("bthd,hed->bthe", q, t), torch.einsum("bthd,hed->bthe", k, t),
                            *args, **kwargs)

        hooks = [blk.register_forward_pre_hook(lambda m, a: current.update(layer=layer_of[id(m)]))
                 for blk in base.model.layers]
        module.chunk_delta_rule = rotated
        try:
            with torch.no_grad():
                ref = base(x).logits
        finally:
            module.chunk_delta_rule = original
            for hk in hooks:
                hk.remove()
        with torch.no_grad():
            got = pruned(x).logits
        err = float((got - ref).norm() / ref.norm())
        assert (err < 1e-5) == exact, (shared, err)


def test_pca_selection_prunes_a_real_model_that_reloads(tmp_path):
    """Calibration activations of a tiny DeltaNet -> pca selection file -> pruned checkpoint -> a fresh process
    loads it (stock classes) with the same logits."""
    from statereduce.stages.capture import capture_activations, export_qk_weights
    from statereduce.stages.select import select_channels
    from statereduce.core.tokenizer import byte_level_tokenizer

    model = tiny_model("delta_net")
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    info = {"model": "tiny", "family": "delta_net", "calibration": "default"}
    acts = capture_activations(model, ids, tmp_path / "activations.h5", rows_per_head=200, attrs=info)
    qk = export_qk_weights(model, tmp_path / "qk.h5", attrs={"model": "tiny"})
    rows, meta = select_channels(qk, "pca", 50, activations=acts, expect={"model": "tiny", "family": "delta_net"})
    assert meta["kind"] == "transform" and meta["format"] == 2
    sel, meta = read_selection(write_selection(tmp_path / "pca_50.parquet", rows, meta),
                               expect={"model": "tiny", "method": "pca", "pct": 50})
    record = prune_model(model, sel, meta)
    assert record.transform["conv_heads_mixed"] == 2 * 2 * 2 and record.extra["selection_format"] == 2
    save_pruned(model, byte_level_tokenizer(), record, tmp_path / "ckpt")
    x = ids[:1, :50]
    with torch.no_grad():
        expected = model(x).logits
    torch.save(x, tmp_path / "x.pt")
    code = ("import sys, torch; from statereduce.core.models import load_model; m, _ = load_model(sys.argv[1]); "
            "torch.save(m(torch.load(sys.argv[2])).logits.detach(), sys.argv[3])")
    fresh.run(["-c", code, str(tmp_path / "ckpt"), str(tmp_path / "x.pt"), str(tmp_path / "y.pt")], check=True,
              preload=fresh.TORCH)
    assert torch.equal(torch.load(tmp_path / "y.pt"), expected)
    saved = json.loads((tmp_path / "ckpt" / "prune_record.json").read_text())
    assert saved["keep"] == {} and saved["transform"]["sha256"] == record.transform["sha256"]


def test_conditioning_of_a_transform_selection():
    """Rank analysis's [Q; K] conditioning (paper Table 6) takes a transform selection: the identity's rows give the
    index selection's numbers, and a rotation of all channels leaves the singular values unchanged."""
    from statereduce.stages.rank import selected_conditioning

    rng = np.random.default_rng(7)
    K, Q = rng.standard_normal((2, 50, 8)), rng.standard_normal((2, 50, 8))
    keep = [[0, 3, 5], [1, 2, 7]]
    by_index = selected_conditioning(K, Q, keep)
    by_rows = selected_conditioning(K, Q, np.stack([np.eye(8)[k] for k in keep]))
    assert by_index["per_head"] == by_rows["per_head"]
    rotation = np.stack([np.linalg.qr(rng.standard_normal((8, 8)))[0] for _ in range(2)])
    full, rotated = selected_conditioning(K, Q), selected_conditioning(K, Q, rotation)
    for head in full["per_head"]:
        assert rotated["per_head"][head]["kappa"] == pytest.approx(full["per_head"][head]["kappa"], rel=1e-10)
