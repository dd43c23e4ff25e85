"""Per-layer key budgets (statereduce.core.budgets): allowed widths, the exact knapsack allocator and its tie-break,
the policy value builders and the recorded Allocation."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time

import numpy as np
import pytest

from statereduce.core.budgets import (
    TIE_RTOL,
    Allocation,
    allocate,
    candidate_widths,
    greedy_values,
    sensitivity_values,
    spectrum_values,
    uniform_total,
)
from statereduce.selectors import n_keep_for


def brute_force(values, total, heads=None):
    """Every allocation by enumeration: the optimum, then the smallest spread, then the lexicographically smallest."""
    heads = heads or [1] * len(values)
    feasible = [
        (sum(v[w] for v, w in zip(values, ws)), ws)
        for ws in itertools.product(*(sorted(v) for v in values))
        if sum(h * w for h, w in zip(heads, ws)) == total
    ]
    best = max(val for val, _ in feasible)
    scale = sum(max(abs(x) for x in v.values()) for v in values)
    tied = [ws for val, ws in feasible if val >= best - TIE_RTOL * scale]
    return best, list(min(tied, key=lambda ws: (max(ws) - min(ws), ws)))


def reachable_totals(values, heads):
    return sorted({sum(h * w for h, w in zip(heads, ws)) for ws in itertools.product(*(sorted(v) for v in values))})


def value_of(values, widths):
    return sum(v[w] for v, w in zip(values, widths))


# -- allowed widths and the uniform total ----------------------------------------------------------------


def test_candidate_widths_grid_floor_and_full_width():
    assert candidate_widths(128, 1, 8) == list(range(8, 129, 8))
    assert candidate_widths(128, 32, 16) == [32, 48, 64, 80, 96, 112, 128]
    assert candidate_widths(128, 20, 16) == [32, 48, 64, 80, 96, 112, 128]  # floor rounded up to the grid
    assert candidate_widths(100, 8, 16) == [16, 32, 48, 64, 80, 96, 100]  # d_k always allowed
    assert candidate_widths(12, 12, 8) == [12]
    assert candidate_widths(5, 1, 1) == [1, 2, 3, 4, 5]
    for d_k, floor, multiple, match in [
        (128, 0, 8, "floor=0 must be an integer in \\[1, d_k=128\\]"),
        (128, 129, 8, "floor=129"),
        (128, 8, 0, "multiple=0 must be a positive integer"),
        (0, 1, 8, "d_k=0 must be a positive integer"),
        (128, 8.0, 8, "floor=8.0"),
    ]:
        with pytest.raises(ValueError, match=match) as err:
            candidate_widths(d_k, floor, multiple)
        assert "\n" not in str(err.value)


def test_uniform_total_matches_n_keep_for_and_weights_heads():
    assert uniform_total(128, 64, 50) == 64 * 64
    assert uniform_total(128, 3, 30) == 3 * n_keep_for(128, 30) == 3 * 90
    assert uniform_total(64, 3, 25, heads=[4, 4, 2]) == 10 * 48
    with pytest.raises(ValueError, match="heads has 2 entries for 3 layers"):
        uniform_total(64, 3, 25, heads=[4, 4])
    with pytest.raises(ValueError, match="heads\\[1\\]=0 must be a positive integer"):
        uniform_total(64, 2, 25, heads=[4, 0])
    with pytest.raises(ValueError, match="n_layers=0"):
        uniform_total(64, 0, 25)
    with pytest.raises(ValueError, match="pct=100"):
        uniform_total(64, 2, 100)


# -- the allocator ---------------------------------------------------------------------------------------


def test_allocate_is_optimal_against_brute_force():
    """Random small cases (3-4 layers, random candidate sets, values, heads and reachable totals): same optimum
    and the same allocation as enumeration."""
    rng = np.random.default_rng(1)
    for case in range(150):
        n = int(rng.integers(3, 5))
        d_k = int(rng.choice([16, 24, 32]))
        values = []
        for _ in range(n):
            widths = candidate_widths(d_k, int(rng.integers(1, d_k + 1)), int(rng.choice([1, 4, 8])))
            widths = sorted(set(rng.choice(widths, size=min(len(widths), 6), replace=False).tolist()))
            values.append({w: float(x) for w, x in zip(widths, rng.normal(size=len(widths)))})
        heads = rng.integers(1, 4, size=n).tolist() if case % 2 else None
        total = int(rng.choice(reachable_totals(values, heads or [1] * n)))
        got = allocate(values, total, heads=heads)
        best, expected = brute_force(values, total, heads)
        assert value_of(values, got) == pytest.approx(best, rel=1e-12, abs=1e-12), (case, got, expected)
        assert got == expected, case
        assert all(type(w) is int for w in got)


def test_allocate_ties_go_to_the_most_uniform_allocation():
    """Small integer values (many exact ties): the smallest spread, then the lexicographically smallest, as in
    enumeration; ties among all allocations (linear values) give the uniform or nearest-uniform one."""
    rng = np.random.default_rng(2)
    for case in range(150):
        n = int(rng.integers(3, 5))
        values = []
        for _ in range(n):
            widths = sorted(set(rng.choice(range(8, 65, 8), size=int(rng.integers(2, 6)), replace=False).tolist()))
            values.append({w: float(x) for w, x in zip(widths, rng.integers(0, 3, size=len(widths)))})
        heads = [1, 2, 1, 2][:n] if case % 3 == 0 else None
        total = int(rng.choice(reachable_totals(values, heads or [1] * n)))
        assert allocate(values, total, heads=heads) == brute_force(values, total, heads)[1], case
    linear = [{w: float(w) for w in range(8, 65, 8)}] * 4
    assert allocate(linear, 4 * 32) == [32, 32, 32, 32]
    assert allocate(linear, 4 * 32 + 8) == [32, 32, 32, 40]  # spread 8, lexicographically smallest
    assert allocate(linear, 4 * 32 - 16) == [24, 24, 32, 32]
    flat = [{w: 0.0 for w in range(8, 65, 8)}] * 3
    assert allocate(flat, 3 * 40) == [40, 40, 40]


def test_allocate_meets_total_with_allowed_widths_in_many_random_cases():
    """Up to 24 layers with candidate_widths grids and random reachable totals: the total is met exactly and every
    width is an allowed one (>= floor, a multiple or d_k, <= d_k)."""
    rng = np.random.default_rng(3)
    for case in range(60):
        n = int(rng.integers(1, 25))
        d_k = int(rng.choice([32, 64, 100, 128]))
        multiple = int(rng.choice([8, 16]))
        floor = int(rng.integers(1, d_k // 2 + 1))
        widths = candidate_widths(d_k, floor, multiple)
        heads = rng.integers(1, 5, size=n).tolist() if case % 2 else [1] * n
        values = [{w: float(x) for w, x in zip(widths, np.cumsum(rng.random(len(widths))))} for _ in range(n)]
        total = sum(h * int(rng.choice(widths)) for h in heads)  # reachable by construction
        got = allocate(values, total, heads=heads if case % 2 else None)
        assert len(got) == n
        assert sum(h * w for h, w in zip(heads, got)) == total, case
        for w in got:
            assert floor <= w <= d_k and (w % multiple == 0 or w == d_k), (case, w)


def test_identical_concave_values_give_the_uniform_allocation():
    """Every layer with the same concave values (energy of one spectrum) and the uniform width a candidate: each
    layer keeps the uniform width, with or without (equal) heads weighting."""
    rng = np.random.default_rng(4)
    widths = candidate_widths(128, 16, 16)
    for _ in range(10):
        eigs = rng.gamma(0.5, size=128)
        values = spectrum_values([eigs] * 12, widths)
        for pct in (25, 50, 75):
            u = n_keep_for(128, pct)
            assert allocate(values, uniform_total(128, 12, pct)) == [u] * 12
            assert allocate(values, uniform_total(128, 12, pct, heads=[4] * 12), heads=[4] * 12) == [u] * 12


def test_heads_weighting():
    """The total counts heads[i] * w_i: a layer with more heads costs more per width step."""
    values = [{8: 0.0, 16: 1.0, 24: 1.5}, {8: 0.0, 16: 1.0, 24: 1.5}]
    assert allocate(values, 32) == [16, 16]
    assert allocate(values, 40, heads=[1, 2]) == [24, 8]  # 24 + 2 * 8; [8, 16] is worth less
    assert allocate(values, 48, heads=[2, 1]) == [16, 16]  # 2 * 16 + 16 beats 2 * 8 + 32 (not a width)
    got = allocate(values, 56, heads=[1, 2])
    assert got == [24, 16] and 24 + 2 * 16 == 56
    with pytest.raises(ValueError, match="heads has 3 entries for 2 layers"):
        allocate(values, 32, heads=[1, 1, 1])
    with pytest.raises(ValueError, match=r"total=33 is not reachable.*\[24, 72\]"):
        allocate(values, 33, heads=[1, 2])


def test_infeasible_totals_raise_one_line_errors_with_the_reachable_range():
    values = [{8: 0.0, 64: 1.0}, {8: 0.0, 64: 1.0}]  # reachable: 16, 72, 128
    for total, nearest in [(40, "16, 72"), (300, "128"), (3, "16"), (71, "16, 72"), (127, "72, 128")]:
        with pytest.raises(ValueError) as err:
            allocate(values, total)
        msg = str(err.value)
        assert "\n" not in msg
        assert f"total={total} is not reachable" in msg and "[16, 128]" in msg, msg
        assert msg.endswith(f"nearest reachable total(s): {nearest}"), msg
    for bad, match in [
        ([], "values must be a non-empty sequence"),
        ({8: 1.0}, "values must be a non-empty sequence"),
        ([{8: 1.0}, {}], "values\\[1\\] must be a non-empty"),
        ([{0: 1.0}], "values\\[0\\] has width 0"),
        ([{8.0: 1.0}], "values\\[0\\] has width 8.0"),
        ([{8: float("nan")}], "values\\[0\\]\\[8\\]=nan is not finite"),
    ]:
        with pytest.raises(ValueError, match=match) as err:
            allocate(bad, 8)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="total=16.0 must be an integer"):
        allocate(values, 16.0)


def test_allocate_is_fast_for_64_layers():
    """64 layers x 17 candidates x a total of 64 * 64: well under a second (a generous sanity bound of 5 s)."""
    rng = np.random.default_rng(5)
    widths = candidate_widths(132, 4, 8)  # 8..128 and 132: 17 candidates, common divisor 4
    assert len(widths) == 17
    values = [{w: float(x) for w, x in zip(widths, np.cumsum(rng.random(17)))} for _ in range(64)]
    values[0] = {w: v for w, v in values[0].items()} | {131: 0.0}  # common divisor 1: the full 4096 states
    start = time.perf_counter()
    got = allocate(values, 64 * 64)
    assert time.perf_counter() - start < 5.0
    assert sum(got) == 64 * 64


# -- policies --------------------------------------------------------------------------------------------


def test_spectrum_energy_values_are_monotone_and_reach_one():
    rng = np.random.default_rng(6)
    eigs = [rng.permutation(rng.gamma(0.3, size=64)) for _ in range(3)]
    eigs[1][5] = -1e-14  # rounding noise counts as zero
    widths = candidate_widths(64, 1, 4)
    values = spectrum_values(eigs, widths)
    for lam, v in zip(eigs, values):
        assert sorted(v) == widths
        seq = [v[w] for w in widths]
        assert all(a <= b for a, b in zip(seq, seq[1:]))
        assert v[64] == 1.0
        top = np.sort(np.clip(lam, 0, None))[::-1]
        assert v[16] == pytest.approx(top[:16].sum() / top.sum(), rel=1e-12)
    # a concentrated spectrum needs fewer channels than a flat one
    concentrated = np.r_[np.full(8, 100.0), np.full(56, 0.01)]
    flat = np.ones(64)
    got = allocate(spectrum_values([concentrated, flat], widths), 64)
    assert got[0] < got[1] and sum(got) == 64
    with pytest.raises(ValueError, match="mode='rank' is unknown; valid: energy, effective_rank"):
        spectrum_values(eigs, widths, mode="rank")
    with pytest.raises(ValueError, match="width 65 is invalid for eigenvalues\\[0\\] of length 64"):
        spectrum_values(eigs, [8, 65])
    with pytest.raises(ValueError, match="eigenvalues\\[0\\] has -1 < 0"):
        spectrum_values([np.r_[1.0, -1.0]], [1])
    with pytest.raises(ValueError, match="eigenvalues\\[0\\] are all zero"):
        spectrum_values([np.zeros(4)], [1])


def test_spectrum_effective_rank_values():
    """erank = exp(entropy): n for a flat spectrum, 1 for rank one, 4 for four equal eigenvalues; value
    min(w, erank) / n, saturating at the effective rank."""
    n = 32
    widths = [1, 2, 4, 8, 16, 32]
    flat, one, four = np.ones(n), np.r_[1.0, np.zeros(n - 1)], np.r_[np.ones(4), np.zeros(n - 4)]
    v_flat, v_one, v_four = spectrum_values([flat, one, four], widths, mode="effective_rank")
    assert v_flat == {w: pytest.approx(w / n) for w in widths}
    assert v_one == {w: pytest.approx(1 / n) for w in widths}
    assert v_four == {w: pytest.approx(min(w, 4) / n) for w in widths}
    # the allocator gives the rank-four layer its effective rank and the rest to the flat layer
    values = spectrum_values([four, flat], [4, 8, 12, 16, 20, 24, 28, 32], mode="effective_rank")
    assert allocate(values, 32) == [4, 28]


def test_greedy_values_normalization():
    rng = np.random.default_rng(7)
    gains = [np.sort(rng.random(16))[::-1] for _ in range(2)]
    widths = [4, 8, 16]
    norm = greedy_values(gains, widths)
    raw = greedy_values(gains, widths, normalize=False)
    for g, v, r in zip(gains, norm, raw):
        assert v[16] == 1.0
        assert r == {w: pytest.approx(g[:w].sum()) for w in widths}
        assert v == {w: pytest.approx(g[:w].sum() / g.sum()) for w in widths}
    assert greedy_values([gains[0] * 1e3], widths) == [pytest.approx(norm[0])]  # scale-free per layer
    assert greedy_values([gains[0] * 1e3], widths, normalize=False)[0][16] == pytest.approx(1e3 * gains[0].sum())
    # keep order matters: the first w gains, not the w largest
    assert greedy_values([np.r_[0.0, 0.0, 1.0, 1.0]], [2, 4])[0] == {2: 0.0, 4: 1.0}
    with pytest.raises(ValueError, match="marginal_gains\\[0\\] sum to 0; normalize=True needs a positive total"):
        greedy_values([np.zeros(4)], [2])
    assert greedy_values([np.zeros(4)], [2], normalize=False) == [{2: 0.0}]
    with pytest.raises(ValueError, match="marginal_gains\\[0\\] must be a non-empty 1-D array"):
        greedy_values([np.ones((2, 2))], [2])


def test_sensitivity_values_sign():
    """value = -(loss[w] - loss[d_k]): 0 at full width, negative where cutting raises the loss; the allocator
    cuts the insensitive layer."""
    robust = {16: 2.01, 32: 2.005, 48: 2.001, 64: 2.0}
    fragile = {16: 3.0, 32: 2.4, 48: 2.1, 64: 2.0}
    v_robust, v_fragile = sensitivity_values([robust, fragile])
    assert v_fragile[64] == 0.0 and v_robust[64] == 0.0
    assert v_fragile[16] == pytest.approx(-1.0) and v_robust[16] == pytest.approx(-0.01)
    assert all(v_fragile[w] < 0 for w in (16, 32, 48))
    assert allocate([v_robust, v_fragile], 64) == [16, 48]
    assert sensitivity_values([{8: 1.5, 16: 1.0, 32: 1.2}], d_k=16) == [{8: -0.5, 16: 0.0, 32: pytest.approx(-0.2)}]
    with pytest.raises(ValueError, match="losses\\[0\\] lacks the full width d_k=64; measured widths: \\[16, 32\\]"):
        sensitivity_values([{16: 1.0, 32: 1.0}], d_k=64)


# -- the recorded allocation -----------------------------------------------------------------------------


def test_allocation_record_round_trips_through_json():
    values = spectrum_values([np.arange(1.0, 17.0), np.ones(16)], [4, 8, 12, 16])
    rec = Allocation.solve(values, 16, "energy")
    assert rec.widths == tuple(allocate(values, 16)) and rec.total == 16 and rec.policy == "energy"
    assert rec.candidates == ((4, 8, 12, 16), (4, 8, 12, 16))
    assert rec.values[0] == tuple(values[0][w] for w in (4, 8, 12, 16))
    again = Allocation.from_dict(json.loads(json.dumps(rec.to_dict())))
    assert again == rec
    plain = Allocation(widths=(64, 64), total=128, policy="uniform", values=None)
    assert plain.to_dict() == {"widths": [64, 64], "total": 128, "policy": "uniform", "values": None,
                               "candidates": None}
    with pytest.raises(Exception):
        plain.total = 3  # frozen
    with pytest.raises(ValueError, match="values has 1 layers, widths has 2"):
        Allocation(widths=(8, 8), total=16, policy="energy", values=((1.0,),))
    with pytest.raises(ValueError, match="widths\\[1\\]=8 is not among candidates\\[1\\]"):
        Allocation(widths=(8, 8), total=16, policy="energy", candidates=((8,), (16,)))
    with pytest.raises(ValueError, match="policy='' must be a non-empty string"):
        Allocation(widths=(8,), total=8, policy="")


def test_module_imports_neither_torch_nor_snakemake():
    code = "import sys, statereduce.core.budgets; print(sorted({'torch', 'snakemake'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
