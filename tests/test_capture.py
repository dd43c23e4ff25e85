"""Calibration artifacts: activations.h5, grad_scores.h5, qk.h5, and selection files built from them.

Each artifact is checked against an independent computation on the same tiny model: K/Q rows are
rows the kernel really received, xnorm equals the projection inputs' column norms, Grad scores equal
|W * dL/dW| summed over inputs from a plain autograd pass, and the reservoir sample is uniform.
"""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch
from _models import tiny_inputs, tiny_model

from statereduce.adapters import get_adapter
from statereduce.stages.capture import BottomKReservoir, capture_activations, export_qk_weights, grad_scores
from statereduce.core.h5files import H5Artifact
from statereduce.stages.select import read_selection, select_channels, write_selection
from statereduce.stages.prune import prune_model

FAMILIES = ["delta_net", "gated_deltanet", "mamba2", "qwen3_5"]


def test_reservoir_is_uniform_and_bounded():
    counts = np.zeros(1000)
    for seed in range(300):
        r = BottomKReservoir(100, np.random.default_rng(seed))
        for start in range(0, 1000, 64):
            r.add(torch.arange(start, min(start + 64, 1000)).float()[:, None])
            assert r.data.shape[0] <= 100  # memory bounded by rows kept
        rows = r.result()[:, 0].astype(int)
        assert len(set(rows)) == 100 and r.seen == 1000
        counts[rows] += 1
    # each item kept with probability 0.1: 30 expected in 300 draws, sd ~5.2
    assert abs(counts.mean() - 30) < 1e-9
    assert counts.std() < 8
    assert abs(counts[:500].mean() - counts[500:].mean()) < 2  # early and late items alike


def test_reservoir_deterministic_given_seed():
    def run(seed):
        r = BottomKReservoir(10, np.random.default_rng(seed))
        r.add(np.arange(100.0)[:, None])
        return r.result()

    assert np.array_equal(run(3), run(3)) and not np.array_equal(run(3), run(4))


@pytest.mark.parametrize("family", FAMILIES)
def test_activations_h5(tmp_path, family):
    model = tiny_model(family)
    adapter = get_adapter(model)
    blocks = tiny_inputs(batch=3, length=20)
    # independent record of what the kernels receive and of the q_proj inputs
    seen_k, seen_q, xs = {}, {}, {}
    with torch.no_grad(), adapter.capture(
        on_qk=lambda i, q, k: (seen_k.setdefault(i, []).append(k.clone()), seen_q.setdefault(i, []).append(q.clone())),
        on_x=lambda i, x: xs.setdefault(i, []).append(x.clone()),
    ):
        model(input_ids=blocks, use_cache=False)
    out = capture_activations(model, blocks, tmp_path / "a.h5", rows_per_head=25, seed=0, batch_size=2,
                              attrs={"model": "tiny", "corpus": "random"})
    art = H5Artifact(out)
    attrs = art.attrs()
    assert attrs["n_tokens"] == 60 and attrs["rows_per_head"] == 25 and attrs["model"] == "tiny"
    assert art.layers() == [i for i, _ in adapter.mixer_layers()]
    for i in art.layers():
        d = art.read(i, ["K", "Q", "xnorm"])
        h, dk = adapter.num_heads, adapter.head_k_dim
        assert d["K"].shape == (h, 25, dk) and d["Q"].shape == (h, 25, dk)
        k_all = torch.cat(seen_k[i]).reshape(-1, h, dk).numpy()  # [tokens, H, d_k]
        q_all = torch.cat(seen_q[i]).reshape(-1, h, dk).numpy()
        for r in range(25):  # every stored row is one token's K (and the same token's Q) in every head
            match = np.flatnonzero(np.all(np.isclose(k_all, d["K"][:, r][None], atol=1e-6), axis=(1, 2)))
            assert match.size == 1
            np.testing.assert_allclose(q_all[match[0]], d["Q"][:, r], atol=1e-6)
        x = torch.cat(xs[i]).reshape(-1, model.config.hidden_size).double()
        np.testing.assert_allclose(d["xnorm"], x.norm(dim=0).numpy(), rtol=1e-6)
    assert not list(tmp_path.glob(".*tmp*"))


@pytest.mark.parametrize("family", FAMILIES)
def test_grad_scores_match_autograd(tmp_path, family):
    model = tiny_model(family)
    adapter = get_adapter(model)
    blocks = tiny_inputs(batch=4, length=16)
    out = grad_scores(model, blocks, tmp_path / "g.h5", batch_size=3)
    # independent: one full-batch backward of the mean loss
    ref = tiny_model(family)
    ref.zero_grad()
    logits = ref(input_ids=blocks, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), blocks[:, 1:].reshape(-1))
    loss.backward()
    art = H5Artifact(out)
    h, dk = adapter.num_heads, adapter.head_k_dim
    for (i, mixer), (_, ref_mixer) in zip(adapter.mixer_layers(), get_adapter(ref).mixer_layers()):
        got = art.read(i, ["grad_q", "grad_k"])
        for name, (w, rows) in zip(("grad_q", "grad_k"), get_adapter(ref).layout(ref_mixer).qk_weight_rows()):
            flat = rows.reshape(-1)  # fused projections (Mamba-2, Qwen3.5): the q or k rows of the shared weight
            expect = (w.detach()[flat].double() * w.grad[flat].double()).abs().sum(1).reshape(h, dk).numpy()
            np.testing.assert_allclose(got[name], expect, rtol=1e-4, atol=1e-10)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("family", FAMILIES)
def test_grad_scores_with_recomputed_layers_equal_the_plain_backward(family, monkeypatch):
    """Recomputing each layer in the backward (what CUDA runs use to fit the 9B shape) runs every layer through
    torch.utils.checkpoint, gives the same scores and leaves the layers' forward as it was."""
    import torch.utils.checkpoint

    from statereduce.adapters.base import decoder_layers
    from statereduce.stages.capture import grad_score_arrays

    calls = []
    stock = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", lambda *a, **k: calls.append(1) or stock(*a, **k))
    blocks = tiny_inputs(batch=4, length=16)
    plain = grad_score_arrays(tiny_model(family), blocks, batch_size=2, recompute=False)
    assert not calls
    model = tiny_model(family)
    recomputed = grad_score_arrays(model, blocks, batch_size=2, recompute=True)
    assert len(calls) == 2 * len(decoder_layers(model))  # two batches
    assert plain.keys() == recomputed.keys()
    for i in plain:
        for name in ("grad_q", "grad_k"):
            np.testing.assert_allclose(recomputed[i][name], plain[i][name], rtol=1e-6, atol=1e-12)
    assert all("forward" not in layer.__dict__ for layer in decoder_layers(model))


@pytest.mark.parametrize("family", FAMILIES)
def test_selection_from_artifacts_prunes_the_model(tmp_path, family):
    model = tiny_model(family)
    adapter = get_adapter(model)
    blocks = tiny_inputs(batch=2, length=32)
    wpath = export_qk_weights(model, tmp_path / "qk.h5")
    wq, wk = adapter.layouts()[0].qk_weights()
    with h5py.File(wpath) as f:
        np.testing.assert_array_equal(f["layer_000/W_q"][()].reshape(wq.shape), wq.detach().numpy())
        np.testing.assert_array_equal(f["layer_000/W_k"][()].reshape(wk.shape), wk.detach().numpy())
    acts = capture_activations(model, blocks, tmp_path / "a.h5", rows_per_head=40)
    for method in ("drrqr", "l1-q", "swanda", "rand"):
        rows, meta = select_channels(wpath, method, 50, activations=acts, seed=0)
        assert meta["d_k_new"] == adapter.head_k_dim // 2
        sel = write_selection(tmp_path / f"{method}.parquet", rows, meta)
        keep, meta2 = read_selection(sel)
        assert meta2 == meta
        assert set(keep.keys) == {i for i, _ in adapter.mixer_layers()} == set(keep.cut.key_widths)
        assert all(len(k) == meta["d_k_new"] and k == sorted(k) for heads in keep.keys.values() for k in heads)
    pruned = tiny_model(family)
    record = prune_model(pruned, keep, meta)
    assert get_adapter(pruned).head_k_dim == adapter.head_k_dim // 2 and record.d_k_new == meta["d_k_new"]
    assert torch.isfinite(pruned(input_ids=blocks).logits).all()


def test_selection_needs_its_artifacts(tmp_path):
    model = tiny_model("delta_net")
    wpath = export_qk_weights(model, tmp_path / "qk.h5")
    with pytest.raises(ValueError, match="drrqr.*activations"):
        select_channels(wpath, "drrqr", 50)
    with pytest.raises(ValueError, match="grad.*grad_scores"):
        select_channels(wpath, "grad", 50)
