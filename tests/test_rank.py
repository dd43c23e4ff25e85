"""Rank analysis: metrics against hand-computed values, summaries against numpy, and states read from the
real (cached, segmented) forward pass against one full forward of the same tiny model."""

from __future__ import annotations

import copy

import json
import math

import numpy as np
import pytest
import torch
from _models import tiny_inputs, tiny_model

from statereduce.adapters import get_adapter
from statereduce.stages.rank import (
    collect_rank_samples,
    iter_states,
    keep_overlap,
    pearson,
    per_head_utilization,
    rank_report,
    selected_conditioning,
    singular_values,
    stable_rank,
    utilization,
    utilization_table,
)


# ---- metrics ----------------------------------------------------------------------------------
def test_stable_rank_of_rank_one_is_one():
    g = torch.Generator().manual_seed(0)
    S = torch.randn(5, 1, generator=g) @ torch.randn(1, 7, generator=g)
    assert stable_rank(S).item() == pytest.approx(1.0, abs=1e-12)
    assert utilization(S).item() == pytest.approx(1 / 5, abs=1e-12)


def test_stable_rank_of_orthogonal_is_d():
    q, _ = np.linalg.qr(np.random.default_rng(0).normal(size=(6, 6)))
    assert stable_rank(q).item() == pytest.approx(6.0, abs=1e-10)
    assert utilization(3.0 * q).item() == pytest.approx(1.0, abs=1e-10)


def test_stable_rank_of_diag():
    S = torch.diag(torch.tensor([1.0, 0.5]))
    assert stable_rank(S).item() == pytest.approx(1.25, abs=1e-12)  # (1 + 0.25) / 1
    assert utilization(S).item() == pytest.approx(0.625, abs=1e-12)
    assert stable_rank(S).dtype == torch.float64


def test_utilization_divides_by_min_side():
    # 2 x 4 with orthonormal rows: er = 2, min(d_v, d_k) = 2
    S = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    assert stable_rank(S).item() == pytest.approx(2.0) and utilization(S).item() == pytest.approx(1.0)
    assert utilization(S.T).item() == pytest.approx(1.0)
    # diag(1, 0.5) padded to 3 x 5: er = 1.25, divided by 3
    T = torch.zeros(3, 5)
    T[0, 0], T[1, 1] = 1.0, 0.5
    assert utilization(T).item() == pytest.approx(1.25 / 3)


def test_metrics_batch_shape_and_zero_and_nonfinite():
    S = torch.zeros(2, 3, 4, 4, dtype=torch.float32)
    S[0, 0] = torch.eye(4)
    S[0, 1] = torch.diag(torch.tensor([1.0, 0.5, 0.0, 0.0]))
    S[1, 2, 0, 0] = float("nan")
    er = stable_rank(S)
    assert er.shape == (2, 3)
    assert er[0, 0].item() == pytest.approx(4.0) and er[0, 1].item() == pytest.approx(1.25)
    assert math.isnan(er[0, 2].item())  # zero matrix
    assert math.isnan(er[1, 2].item())  # non-finite entry
    assert torch.isnan(singular_values(S)[1, 2]).all()
    assert math.isnan(utilization(torch.zeros(3, 3)).item())


def test_metrics_reject_non_matrices():
    with pytest.raises(ValueError, match=r"\[\.\.\., d_v, d_k\], got shape \(3,\)"):
        stable_rank(torch.ones(3))


# ---- summaries --------------------------------------------------------------------------------
def test_utilization_table():
    per_head = {(0, 0): 0.1, (0, 1): 0.3, (1, 0): 0.2, (1, 1): float("nan")}
    table = utilization_table(per_head)
    assert table["mean"] == pytest.approx(0.2) and table["std"] == pytest.approx(math.sqrt(0.02 / 3))
    assert (table["min"], table["max"], table["n_heads"], table["n_nan"]) == (0.1, 0.3, 3, 1)


def test_pearson_matches_numpy():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=8), rng.normal(size=8)
    keys = [(layer, head) for layer in range(2) for head in range(4)]
    base = dict(zip(keys, a))
    method = dict(zip(keys, b))
    assert pearson(base, method) == pytest.approx(np.corrcoef(a, b)[0, 1], abs=1e-12)
    assert pearson(base, base) == pytest.approx(1.0)
    # only common keys count; NaN values are left out
    method_extra = {**dict(zip(keys[:6], b[:6])), (5, 0): 9.0, keys[5]: float("nan")}
    assert pearson(base, method_extra) == pytest.approx(np.corrcoef(a[:5], b[:5])[0, 1], abs=1e-12)
    assert math.isnan(pearson({(0, 0): 1.0}, {(0, 0): 2.0}))
    assert math.isnan(pearson(base, dict.fromkeys(keys, 1.0)))  # constant side


def test_selected_conditioning_matches_svd():
    rng = np.random.default_rng(1)
    K = rng.normal(size=(2, 10, 6)).astype(np.float32)
    Q = rng.normal(size=(2, 10, 6)).astype(np.float32)
    K[1, :, 3] *= 50.0  # a high-energy channel in head 1
    keep = [[0, 2, 5], [1, 3, 4]]
    res = selected_conditioning(K, Q, keep)
    kappas = []
    for head in range(2):
        s = np.linalg.svd(np.vstack([Q[head], K[head]])[:, keep[head]].astype(np.float64), compute_uv=False)
        got = res["per_head"][(0, head)]
        assert got["sigma_max"] == pytest.approx(s[0]) and got["sigma_min"] == pytest.approx(s[-1])
        assert got["kappa"] == pytest.approx(s[0] / s[-1])
        kappas.append(s[0] / s[-1])
    assert res["median"]["kappa"] == pytest.approx(np.median(kappas)) and res["n_heads"] == 2
    # baseline (all channels) and the {layer: ...} form of read_selection
    base = selected_conditioning({3: K}, {3: Q}, None)
    s = np.linalg.svd(np.vstack([Q[1], K[1]]).astype(np.float64), compute_uv=False)
    assert base["per_head"][(3, 1)]["sigma_max"] == pytest.approx(s[0])
    assert base["per_head"][(3, 1)]["sigma_min"] == pytest.approx(s[-1])
    # fewer rows than kept columns: sigma_min = 0, kappa = inf
    short = selected_conditioning(K[:, :1], Q[:, :1], [[0, 1, 2], [0, 1, 2]])
    assert short["per_head"][(0, 0)]["sigma_min"] == 0.0 and short["per_head"][(0, 0)]["kappa"] == math.inf


def test_selected_conditioning_rejects_bad_keep():
    K = np.ones((2, 4, 3))
    with pytest.raises(ValueError, match=r"head 1: keep=\[0, 3\] is invalid; valid: distinct indices in \[0, d_k=3\)"):
        selected_conditioning(K, K, [[0, 1], [0, 3]])
    with pytest.raises(ValueError, match="keep has 1 heads, the activations have H=2"):
        selected_conditioning(K, K, [[0, 1]])


def test_keep_overlap_hand_made():
    a = {0: [[0, 1, 2, 3], [4, 5, 6, 7]], 1: [[0, 2, 4, 6], [1, 3, 5, 7]]}
    b = {0: [[0, 1, 2, 3], [0, 1, 2, 3]], 1: [[0, 2, 5, 7], [3, 1, 9, 8]]}
    res = keep_overlap(a, b, d_k=16)
    shared = {key: v["shared"] for key, v in res["per_head"].items()}
    assert shared == {(0, 0): 4, (0, 1): 0, (1, 0): 2, (1, 1): 2}
    assert res["per_head"][(1, 0)]["fraction"] == 0.5
    assert res["median_shared"] == 2.0 and res["median_fraction"] == 0.5
    assert res["random_shared"] == 1.0 and res["random_fraction"] == 0.25  # 4^2 / 16, 4 / 16
    assert (res["d_k"], res["d_k_new"], res["n_heads"]) == (16, 4, 4)
    # paper App. C.2: 32 of 128 kept, random selections share 8
    one = keep_overlap([list(range(32))], [list(range(32))], d_k=128)
    assert one["random_shared"] == 8.0 and one["median_shared"] == 32.0


def test_keep_overlap_of_per_layer_widths():
    """Layer 0 keeps 2 of 8 channels per head, layer 1 keeps 4 in A and 6 in B: each head's random expectation is
    k_a k_b / d_k (hypergeometric mean) and its fraction is of min(k_a, k_b)."""
    a = {0: [[0, 1], [2, 3]], 1: [[0, 1, 2, 3], [4, 5, 6, 7]]}
    b = {0: [[0, 1], [4, 5]], 1: [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]]}
    res = keep_overlap(a, b, d_k=8)
    assert {key: v["shared"] for key, v in res["per_head"].items()} == {(0, 0): 2, (0, 1): 0, (1, 0): 4, (1, 1): 2}
    assert [res["per_head"][(0, h)]["random_shared"] for h in (0, 1)] == [0.5, 0.5]  # 2 * 2 / 8
    assert [res["per_head"][(1, h)]["random_shared"] for h in (0, 1)] == [3.0, 3.0]  # 4 * 6 / 8
    assert res["per_head"][(1, 1)]["fraction"] == 0.5 and res["per_head"][(1, 1)]["random_fraction"] == 0.75
    assert res["per_layer"][0] == {"d_k_new": 2, "median_shared": 1.0, "median_fraction": 0.5, "random_shared": 0.5,
                                   "random_fraction": 0.25, "n_heads": 2}
    assert res["per_layer"][1]["d_k_new"] == [4, 6] and res["per_layer"][1]["random_shared"] == 3.0
    assert res["d_k_new"] == {"0": 2, "1": [4, 6]} and res["n_heads"] == 4
    assert res["random_shared"] == 1.75 and res["median_shared"] == 2.0  # medians over the four heads
    same = keep_overlap({0: a[0], 1: a[1]}, {0: a[0], 1: a[1]}, d_k=8)
    assert same["d_k_new"] == {"0": 2, "1": 4} and same["median_fraction"] == 1.0


def test_keep_overlap_rejects_mismatch():
    with pytest.raises(ValueError, match=r"keep_a layer 0 keeps different numbers of channels across heads: \[1, 2\]"):
        keep_overlap([[0, 1], [2]], [[0, 1], [2, 3]], d_k=4)
    with pytest.raises(ValueError, match="layer 0: keep_a has 1 heads, keep_b 2"):
        keep_overlap([[0, 1]], [[0, 1], [2, 3]], d_k=4)
    with pytest.raises(ValueError, match="cover different layers"):
        keep_overlap({0: [[0]]}, {1: [[0]]}, d_k=4)


def test_selected_conditioning_of_per_layer_widths():
    rng = np.random.default_rng(2)
    K = {0: rng.normal(size=(2, 10, 6)), 1: rng.normal(size=(2, 10, 6))}
    Q = {0: rng.normal(size=(2, 10, 6)), 1: rng.normal(size=(2, 10, 6))}
    keep = {0: [[0, 5], [1, 2]], 1: [[0, 1, 3, 4], [2, 3, 4, 5]]}
    res = selected_conditioning(K, Q, keep)
    assert res["key_dims"] == {0: 2, 1: 4} and res["n_heads"] == 4
    for (layer, head), got in res["per_head"].items():
        s = np.linalg.svd(np.vstack([Q[layer][head], K[layer][head]])[:, keep[layer][head]], compute_uv=False)
        assert s.size == len(keep[layer][0])
        assert got["sigma_max"] == pytest.approx(s[0]) and got["sigma_min"] == pytest.approx(s[-1])
    with pytest.raises(ValueError, match=r"layer 1: the heads keep different numbers of channels \[3, 4\]"):
        selected_conditioning(K, Q, {0: keep[0], 1: [[0, 1, 3], [2, 3, 4, 5]]})


# ---- states from the forward pass -------------------------------------------------------------
CASES = {
    "delta_net": ("delta_net", {}),
    "delta_net-dv64": ("delta_net", {"expand_v": 2.0}),
    "gated_deltanet": ("gated_deltanet", {}),
    "gated_deltanet-gva": ("gated_deltanet", {"num_v_heads": 4}),
    "mamba2": ("mamba2", {}),
    "qwen3_5": ("qwen3_5", {}),
}


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def model(request):
    family, overrides = CASES[request.param]
    return tiny_model(family, **overrides)


def _full_states(model, ids):
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
    return get_adapter(model).recurrent_states(cache)


def test_recurrent_states_layout(model):
    """S is [B, HV, d_v, d_k] and its rows lie in the span of the keys seen so far (paper Sec. 2.2)."""
    adapter = get_adapter(model)
    h, hv, d_k, d_v = adapter.dims(model.config)
    ids = tiny_inputs(batch=2, length=5)
    keys = {}
    with adapter.capture(on_qk=lambda layer, q, k: keys.setdefault(layer, k.detach().double())):
        states = _full_states(model, ids)
    assert sorted(states) == [layer for layer, _ in adapter.mixer_layers()]
    for layer, S in states.items():
        assert S.shape == (2, hv, d_v, d_k)
        for b in range(2):
            for head in range(hv):
                k = keys[layer][b, :, head // (hv // h)]  # [T, d_k]; GVA: value head i reads key head i // r
                u, s, _ = torch.linalg.svd(k.T, full_matrices=True)
                perp = u[:, (s > 1e-8 * s[0]).sum() :]  # orthogonal complement of span(k_1..k_T) in R^d_k
                s_bh = S[b, head].double()
                assert (s_bh @ perp).norm() < 1e-5 * s_bh.norm()
                if d_k == d_v:  # the transposed reading would fail the check
                    assert (s_bh.T @ perp).norm() > 1e-2 * s_bh.norm()


def test_last_state_equals_full_forward(model):
    ids = tiny_inputs(batch=2, length=70)  # > 64 tokens: the full forward takes the chunked kernel path
    full = _full_states(model, ids)
    steps = [(pos, {k: v.clone() for k, v in s.items()}) for pos, s in iter_states(model, ids, stride=16)]
    assert [pos for pos, _ in steps] == [15, 31, 47, 63, 69]
    last = steps[-1][1]
    for layer, S in full.items():
        torch.testing.assert_close(last[layer], S, rtol=1e-4, atol=1e-5)


def test_stride_one_matches_stride_four(model):
    ids = tiny_inputs(batch=2, length=16)
    one = {pos: {k: v.clone() for k, v in s.items()} for pos, s in iter_states(model, ids, stride=1, skip=2)}
    four = {pos: {k: v.clone() for k, v in s.items()} for pos, s in iter_states(model, ids, stride=4, skip=2)}
    assert sorted(one) == list(range(2, 16)) and sorted(four) == [3, 7, 11, 15]
    for pos, states in four.items():
        for layer, S in states.items():
            torch.testing.assert_close(one[pos][layer], S, rtol=1e-4, atol=1e-5)


def test_collect_rank_samples(model):
    adapter = get_adapter(model)
    _, hv, d_k, d_v = adapter.dims(model.config)
    ids = tiny_inputs(batch=2, length=20)
    samples = collect_rank_samples(model, ids, skip=8, stride=4, spectrum_head=(1, hv - 1))
    assert samples.positions.tolist() == [11, 15, 19]
    assert sorted(samples.u) == [(layer, head) for layer in (0, 1) for head in range(hv)]
    last = {pos: s for pos, s in iter_states(model, ids, stride=4, skip=19)}[19]
    for (layer, head), er in samples.er.items():
        assert er.shape == (2, 3)
        np.testing.assert_allclose(er[:, -1], stable_rank(last[layer][:, head]).numpy(), rtol=1e-6)
        np.testing.assert_allclose(samples.u[(layer, head)], er / min(d_k, d_v))
        assert ((er >= 1 - 1e-9) & (er <= min(d_k, d_v) + 1e-9)).all()
    assert samples.spectrum.shape == (2, 3, min(d_k, d_v))
    # the two runs feed the tokens in different segments, so the states agree to float32 rounding; singular values
    # far below the largest are that rounding's noise (float32 SVD resolves ~1e-7 of the top one)
    want = singular_values(last[1][:, hv - 1]).numpy()
    np.testing.assert_allclose(samples.spectrum[:, -1], want, rtol=1e-6, atol=1e-6 * want.max())
    with pytest.raises(ValueError, match=r"no state to score: skip=20 >= sequence length T=20"):
        collect_rank_samples(model, ids, skip=20, stride=4)
    with pytest.raises(ValueError, match=r"spectrum_head=\(5, 0\) is not a state head"):
        collect_rank_samples(model, ids, skip=8, stride=4, spectrum_head=(5, 0))


def test_a_value_or_joint_cut_divides_by_the_kept_widths(model):
    """States of a checkpoint with value channels cut (and keys, for the joint cut) are [d_v', d_k']: u divides each
    stable rank by min(d_v', d_k'), and the report's sizes are the kept ones."""
    from statereduce.stages.prune import prune_model

    adapter = get_adapter(model)
    h, hv, d_k, d_v = adapter.dims(model.config)
    gen = torch.Generator().manual_seed(0)
    layers = [layer for layer, _ in adapter.mixer_layers()]
    values = {layer: torch.stack([torch.randperm(d_v, generator=gen)[:d_v // 4].sort().values for _ in range(hv)])
              for layer in layers}
    for keys in (None, {layer: torch.stack([torch.randperm(d_k, generator=gen)[:d_k // 2].sort().values
                                            for _ in range(h)]) for layer in layers}):
        pruned = copy.deepcopy(model)
        prune_model(pruned, keys, {"method": "test"}, values=values)
        k_new = d_k if keys is None else d_k // 2
        samples = collect_rank_samples(pruned, tiny_inputs(batch=2, length=20), skip=8, stride=4)
        assert (samples.d_k, samples.d_v) == (k_new, d_v // 4)
        for key, er in samples.er.items():
            np.testing.assert_allclose(samples.u[key], er / min(k_new, d_v // 4))
            assert (er <= min(k_new, d_v // 4) + 1e-9).all()
        doc = rank_report(pruned, tiny_inputs(batch=2, length=12), skip=4, stride=4)
        assert (doc["model"]["d_k"], doc["model"]["d_v"]) == (k_new, d_v // 4)


def test_rank_report_is_json(model):
    ids = tiny_inputs(batch=2, length=12)
    report = rank_report(model, ids, skip=4, stride=4, spectrum_head=(0, 0))
    again = rank_report(model, ids, skip=4, stride=4, baseline=json.loads(json.dumps(report)))
    doc = json.loads(json.dumps(again, allow_nan=False))
    adapter = get_adapter(model)
    hv = adapter.dims(adapter.config).num_v_heads
    assert len(doc["per_head"]) == 2 * hv and doc["settings"]["positions"] == [7, 11]
    assert doc["pearson_u"] == pytest.approx(1.0)
    u = per_head_utilization(doc)
    assert doc["summary"]["u"]["mean"] == pytest.approx(np.mean(list(u.values())))
    assert len(report["spectrum"]["mean"]) == min(doc["model"]["d_k"], doc["model"]["d_v"])
    assert report["spectrum"]["n_samples"] == 4


def test_iter_states_rejects_bad_arguments(model):
    with pytest.raises(ValueError, match="stride=0 is invalid; valid: an integer >= 1"):
        next(iter_states(model, tiny_inputs(), stride=0))
    with pytest.raises(ValueError, match=r"input_ids must be a LongTensor \[B, T\]"):
        next(iter_states(model, torch.zeros(3, dtype=torch.long)))
