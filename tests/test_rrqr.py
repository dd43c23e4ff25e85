"""Strong RRQR (Gu & Eisenstat 1996; paper App. B.2): the guarantees, checked independently of the code.

Every check recomputes the factorisation of ``M[:, perm]`` with numpy's own QR / SVD, so a wrong
permutation (not just a wrong internal R) fails.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import scipy.linalg as sla

from statereduce.selectors.rrqr import DEFAULT_F, _recompute, _swap, _swap_loop, strong_rrqr


def kahan(n: int, c: float, tau: float = 1e-10) -> np.ndarray:
    """Kahan's matrix diag(1, s, .., s^(n-1)) (I - c * strict upper ones), c^2 + s^2 = 1.

    Column j is scaled by (1 - tau)^j so that LAPACK's QRCP keeps the identity order despite rounding
    (checked in :func:`test_kahan_qrcp_alone_is_not_strong`).
    """
    s = math.sqrt(1.0 - c * c)
    K = np.eye(n) - c * np.triu(np.ones((n, n)), 1)
    return (s ** np.arange(n))[:, None] * K * (1.0 - tau) ** np.arange(n)


def strong_rrqr_report(M: np.ndarray, perm: np.ndarray, k: int) -> dict[str, np.ndarray]:
    """A_k, B_k, C_k, rho and singular values of ``M[:, perm]``, from numpy's QR (not from the code under test)."""
    n = M.shape[1]
    Mp = np.asarray(M, dtype=np.float64)[:, perm]
    R = np.linalg.qr(Mp, mode="r")
    if R.shape[0] < n:
        R = np.vstack([R, np.zeros((n - R.shape[0], n))])
    A, B, C = R[:k, :k], R[:k, k:], R[k:, k:]
    Ainv = np.linalg.inv(A)
    U = Ainv @ B
    rho = np.sqrt(U**2 + np.outer(np.linalg.norm(Ainv, axis=1), np.linalg.norm(C, axis=0)) ** 2)
    return {
        "U": U,
        "rho": rho,
        "sA": np.linalg.svd(A, compute_uv=False),
        "sC": np.linalg.svd(C, compute_uv=False) if k < n else np.zeros(0),
        "sM": np.pad(np.linalg.svd(Mp, compute_uv=False), (0, max(0, n - Mp.shape[0]))),  # sigma_i = 0 beyond m
        "omega": 1.0 / np.linalg.norm(Ainv, axis=1),
    }


def assert_strong(M: np.ndarray, res, f: float) -> None:
    """Gu-Eisenstat termination and the singular-value bounds (paper App. B.2) for a result."""
    n = M.shape[1]
    k = res.k
    perm = res.perm
    assert perm.dtype == np.int64 and sorted(perm.tolist()) == list(range(n))
    rep = strong_rrqr_report(M, perm, k)
    cf = math.sqrt(1.0 + f * f * k * (n - k))
    assert res.bound_factor == pytest.approx(cf)
    slack = 1e-9
    assert np.abs(rep["U"]).max(initial=0.0) <= f * (1 + slack)
    assert rep["rho"].max(initial=0.0) <= f * (1 + slack)
    assert res.max_rho == pytest.approx(rep["rho"].max(initial=0.0), rel=1e-6, abs=1e-12)
    sM = rep["sM"]
    tiny = 50 * n * np.finfo(np.float64).eps * sM[0]
    assert np.all(rep["sA"] >= sM[:k] / cf - tiny), (rep["sA"] * cf / sM[:k]).min()
    assert np.all(rep["sC"] <= sM[k : k + rep["sC"].size] * cf + tiny)
    # the returned R is an upper-triangular R factor of M[:, perm]
    Mp = np.asarray(M, dtype=np.float64)[:, perm]
    assert np.array_equal(res.R, np.triu(res.R))
    np.testing.assert_allclose(res.R.T @ res.R, Mp.T @ Mp, rtol=0, atol=1e-9 * sM[0] ** 2)
    np.testing.assert_allclose(res.omega, rep["omega"], rtol=1e-6)


def _gaussian(dtype):
    return np.random.default_rng(0).standard_normal((200, 32)).astype(dtype)


def _decaying_f32():
    rng = np.random.default_rng(1)
    V = np.linalg.qr(rng.standard_normal((40, 40)))[0]
    col_scale = np.exp(rng.standard_normal(40))  # uneven channel energies, as after a projection
    return ((rng.standard_normal((600, 40)) * np.logspace(0, -3, 40)) @ V * col_scale).astype(np.float32)


def _low_rank_plus_noise():
    rng = np.random.default_rng(2)
    return rng.standard_normal((300, 10)) @ rng.standard_normal((10, 36)) + 1e-3 * rng.standard_normal((300, 36))


MATRICES = {
    "gauss64": lambda: _gaussian(np.float64),
    "gauss32-gram": lambda: _gaussian(np.float32),
    "decay32-gram": _decaying_f32,
    "lowrank+noise": _low_rank_plus_noise,
    "kahan64": lambda: kahan(64, 0.2),
    "kahan90": lambda: kahan(90, 0.285),
}


@pytest.mark.parametrize("f", [1.05, DEFAULT_F], ids=lambda f: f"f{f}")
@pytest.mark.parametrize("kfrac", [0.0, 0.25, 0.5, 0.9, 1.0], ids=lambda x: f"k{x}")
@pytest.mark.parametrize("name", list(MATRICES))
def test_strong_rrqr_bounds(name, kfrac, f):
    M = MATRICES[name]()
    n = M.shape[1]
    k = min(n, max(1, round(kfrac * n) if kfrac < 1 else n))
    if kfrac == 0.9:
        k = n - 1
    res = strong_rrqr(M, k, f)
    assert res.reduction == ("gram" if M.dtype == np.float32 else "qr")
    assert res.rank == n
    assert_strong(M, res, f)


@pytest.mark.parametrize("reduction", ["gram", "qr"])
def test_both_reductions_on_kahan_and_agree_on_gaussian(reduction):
    K = kahan(64, 0.2)  # sigma_min ~ 5e-6: resolvable by the Gram route
    for k in (16, 32, 63):
        assert_strong(K, strong_rrqr(K, k, reduction=reduction), DEFAULT_F)
    G = np.random.default_rng(3).standard_normal((500, 40))
    ref = strong_rrqr(G, 20, reduction="qr")
    res = strong_rrqr(G, 20, reduction=reduction)
    assert set(res.selected.tolist()) == set(ref.selected.tolist())


@pytest.mark.parametrize("n,c", [(64, 0.2), (90, 0.285)])
def test_kahan_qrcp_alone_is_not_strong(n, c):
    """On Kahan's matrix QRCP does no pivoting and |A^-1 B| exceeds f by orders of magnitude; the swaps fix it."""
    K = kahan(n, c)
    _, piv = sla.qr(K, mode="r", pivoting=True)
    assert np.array_equal(piv, np.arange(n)), "perturbed Kahan matrix should keep QRCP's identity order"
    k = n - 1
    qrcp = strong_rrqr_report(K, piv, k)
    assert np.abs(qrcp["U"]).max() > 1e3 * DEFAULT_F
    # QRCP's trailing R entry overestimates sigma_n by orders of magnitude (not rank revealing)
    assert qrcp["sC"][0] > 1e3 * qrcp["sM"][-1] * math.sqrt(1 + DEFAULT_F**2 * k)
    res = strong_rrqr(K, k)
    assert res.n_swaps >= 1
    assert_strong(K, res, DEFAULT_F)


def test_swaps_stop_exactly_at_the_tolerance():
    """The swap loop runs while max rho_ij > f and no longer: a start whose max rho lies just under f is kept as it
    is, one just over f is swapped until max rho <= f."""
    K = kahan(64, 0.2)
    start = strong_rrqr(K, 63, f=1e12)  # no swap: QRCP's own max rho
    assert start.n_swaps == 0 and start.max_rho > 10
    kept = strong_rrqr(K, 63, f=start.max_rho * (1 + 1e-9))
    assert kept.n_swaps == 0 and kept.max_rho == start.max_rho
    swapped = strong_rrqr(K, 63, f=start.max_rho * 0.99)
    assert swapped.n_swaps >= 1 and swapped.max_rho <= start.max_rho * 0.99


def test_swap_updates_match_recomputation():
    """Gu-Eisenstat's rank-one updates of A^-1 B and omega (and the kept gamma) equal a fresh recomputation."""
    rng = np.random.default_rng(4)
    n, k = 24, 9
    M = rng.standard_normal((40, n)) * np.logspace(0, -2, n)
    R = np.triu(sla.qr(M, mode="r")[0][:n])
    perm = np.arange(n)
    U, w2, gamma2 = _recompute(R, k)
    for step in range(120):
        i, j = int(rng.integers(k)), int(rng.integers(n - k))
        gamma2 = _swap(R, perm, U, w2, i, j, k)
        U_ref, w2_ref, g2_ref = _recompute(R, k)
        np.testing.assert_allclose(U, U_ref, rtol=1e-9, atol=1e-9 * np.abs(U_ref).max(), err_msg=f"step {step}")
        np.testing.assert_allclose(w2, w2_ref, rtol=1e-9, err_msg=f"step {step}")
        np.testing.assert_allclose(gamma2, g2_ref, rtol=1e-9, atol=1e-12, err_msg=f"step {step}")
        assert np.array_equal(np.tril(R[:k, :k], -1), np.zeros((k, k))) and not R[k:, :k].any()
        Mp = M[:, perm]
        np.testing.assert_allclose(R.T @ R, Mp.T @ Mp, atol=1e-10)
    assert sorted(perm.tolist()) == list(range(n))


def test_block_kahan_needs_one_swap_per_block():
    """Block-diagonal Kahan matrices: QRCP keeps each block's bad last column; one swap per block repairs it."""
    blocks = 4
    M = sla.block_diag(*[kahan(24, 0.35) * (1 + 0.01 * b) for b in range(blocks)])
    k = M.shape[1] - blocks
    res = strong_rrqr(M, k)
    assert res.n_swaps >= blocks
    assert_strong(M, res, DEFAULT_F)


def test_swap_loop_from_a_bad_start():
    """The swap loop alone, started from a poor selection (first 12 columns nearly parallel), converges to a
    strong RRQR in many swaps."""
    rng = np.random.default_rng(5)
    big = 10 * rng.standard_normal((300, 1)) + 0.05 * rng.standard_normal((300, 12))
    small = np.linalg.qr(rng.standard_normal((300, 12)))[0] * 2.0
    M = np.hstack([big, small])
    n, k, f = M.shape[1], 12, 1.05
    R = np.triu(sla.qr(M, mode="r")[0][:n])
    perm = np.arange(n)
    n_swaps, max_rho, _ = _swap_loop(R, perm, k, f * f, 10_000)
    assert n_swaps >= 8
    rep = strong_rrqr_report(M, perm, k)
    assert rep["rho"].max() <= f * (1 + 1e-9) and max_rho == pytest.approx(rep["rho"].max(), rel=1e-6)
    cf = math.sqrt(1 + f * f * k * (n - k))
    assert np.all(rep["sA"] >= rep["sM"][:k] / cf) and np.all(rep["sC"] <= rep["sM"][k:] * cf)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_planted_dependent_columns_never_chosen(dtype):
    """8 independent channels (norms 0.2..1) and 8 exact dependents (duplicates / combinations) with larger norms
    than the weak independents: keeping 8 must return exactly the independent channels."""
    rng = np.random.default_rng(6)
    N, d = 400, 16
    X = np.linalg.qr(rng.standard_normal((N, 8)))[0] * np.linspace(1.0, 0.2, 8)
    D = np.column_stack(
        [0.9 * X[:, 0], -0.85 * X[:, 1], 0.8 * X[:, 2], 0.6 * X[:, 0] + 0.5 * X[:, 1]]
        + [0.55 * X[:, i] + 0.4 * X[:, i + 1] for i in range(4)]
    )
    cols = rng.permutation(d)
    M = np.empty((N, d))
    M[:, cols[:8]] = X
    M[:, cols[8:]] = D
    M = M.astype(dtype)
    norms = np.linalg.norm(M, axis=0)
    assert not set(np.argsort(-norms)[:8].tolist()) <= set(cols[:8].tolist()), "planted case must defeat norms"
    res = strong_rrqr(M, 8)
    assert set(res.selected.tolist()) == set(cols[:8].tolist())
    assert res.rank == 8


@pytest.mark.parametrize("reduction", ["gram", "qr"])
def test_rank_deficient(reduction):
    """Zero and duplicated columns, k above the rank: the rank is found, the kept set spans M, nothing is NaN."""
    rng = np.random.default_rng(7)
    base = rng.standard_normal((100, 5))
    M = np.column_stack([base, np.zeros(100), base[:, :3] * 2.0, base @ rng.standard_normal((5, 4)), np.zeros(100)])
    n = M.shape[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = strong_rrqr(M, 8, reduction=reduction)
    assert res.rank == 5
    kept = M[:, res.selected]
    s_kept = np.linalg.svd(kept, compute_uv=False)
    s_M = np.linalg.svd(M, compute_uv=False)
    assert s_kept[4] >= s_M[4] / res.bound_factor
    assert np.isfinite(res.omega).all() and (res.omega >= 0).all()
    # the k - rank filler channels are numerically dependent: tiny omega
    assert np.sort(res.omega)[: 8 - 5].max() < 1e-6 * s_M[0]
    assert np.array_equal(res.R, np.triu(res.R)) and sorted(res.perm.tolist()) == list(range(n))
    Mp = M[:, res.perm]
    np.testing.assert_allclose(res.R.T @ res.R, Mp.T @ Mp, rtol=0, atol=1e-9 * s_M[0] ** 2)
    # the first rank(M) pivots satisfy the strong-RRQR condition against all other columns
    rep = strong_rrqr_report(M, res.perm, 5)
    assert rep["rho"].max() <= DEFAULT_F * (1 + 1e-9)
    assert np.all(rep["sA"] >= rep["sM"][:5] / math.sqrt(1 + DEFAULT_F**2 * 5 * (n - 5)))


@pytest.mark.parametrize("reduction", ["gram", "qr"])
def test_zero_and_wide_matrices(reduction):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = strong_rrqr(np.zeros((10, 6)), 3, reduction=reduction)
    assert res.rank == 0 and sorted(res.perm.tolist()) == list(range(6)) and np.isfinite(res.omega).all()
    W = np.random.default_rng(8).standard_normal((5, 10))  # m < n: rank 5
    res = strong_rrqr(W, 3, reduction=reduction)
    assert res.rank == 5
    assert_strong(W, res, DEFAULT_F)
    res = strong_rrqr(W, 8, reduction=reduction)
    assert res.rank == 5 and np.linalg.matrix_rank(W[:, res.selected]) == 5


def test_k_equals_1_and_n():
    M = np.random.default_rng(9).standard_normal((50, 12)) * np.arange(1, 13)
    res = strong_rrqr(M, 1)
    assert res.selected.tolist() == [int(np.argmax(np.linalg.norm(M, axis=0)))]
    assert res.n_swaps == 0
    res = strong_rrqr(M, 12)
    assert sorted(res.selected.tolist()) == list(range(12)) and res.max_rho == 0.0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"k": 0}, "k=0"),
        ({"k": 7}, "k=7"),
        ({"k": 2, "f": 1.0}, "f=1.0"),
        ({"k": 2, "f": float("nan")}, "f=nan"),
        ({"k": 2, "reduction": "svd"}, "reduction='svd'"),
        ({"k": 2, "rtol": 2.0}, "rtol=2.0"),
    ],
)
def test_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        strong_rrqr(np.ones((4, 6)), **kwargs)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_row_blocks_equal_stacked_matrix(dtype):
    rng = np.random.default_rng(10)
    K = (rng.standard_normal((3000, 48)) * np.exp(rng.standard_normal(48))).astype(dtype)  # > one cast chunk
    Q = (rng.standard_normal((700, 48)) @ rng.standard_normal((48, 48))).astype(dtype)
    whole = strong_rrqr(np.vstack([K, Q]), 20)
    split = strong_rrqr([K, Q], 20)
    assert split.reduction == whole.reduction and split.selected.tolist() == whole.selected.tolist()
    np.testing.assert_allclose(split.R, whole.R, rtol=1e-9, atol=1e-9 * abs(whole.R[0, 0]))
    assert_strong(np.vstack([K, Q]), split, DEFAULT_F)


def test_input_errors():
    with pytest.raises(ValueError, match="2-D"):
        strong_rrqr(np.ones(5), 1)
    with pytest.raises(ValueError, match="equal columns"):
        strong_rrqr([np.ones((4, 3)), np.ones((4, 2))], 1)
    with pytest.raises(ValueError, match="non-empty"):
        strong_rrqr(np.ones((0, 3)), 1)
    M = np.ones((8, 4))
    M[3, 2] = np.nan
    for reduction in ("gram", "qr"):
        with pytest.raises(ValueError, match="NaN"):
            strong_rrqr(M, 2, reduction=reduction)
