"""Benchmark DRRQR channel selection: reduce-then-swap strong RRQR vs. a naive full-matrix routine.

Times :func:`statereduce.selectors.rrqr.strong_rrqr` over a model's worth of heads (default 24 layers x 16 heads,
M = [K; Q] of 5,000 x 128 float32 per head, as DRRQR sees them with 2,500 + 2,500 calibration rows),
at k = 64 and k = 32, and side by side a naive routine that runs QRCP on the full M and re-factorises
the full permuted M after every swap. Prints both totals, their ratio, the per-head mean number of
swaps and how often both routines keep the same channel set. DRRQR is timed twice: a plain loop of
``strong_rrqr`` calls, and the workflow's driver ``select_heads("drrqr", ..., workers=N)`` (a thread
pool with single-threaded BLAS per worker). Data generation is not timed; CPU load from other processes
is printed because it changes the timings by large factors.

Usage: ``.venv/bin/python scripts/bench_drrqr.py [--layers 24 --heads 16 --rows 5000 --dk 128 --workers 2]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import scipy.linalg as sla

from statereduce.selectors.rrqr import DEFAULT_F, strong_rrqr
from statereduce.selectors import HeadData, select_heads


def make_mats(n: int, rows: int, d_k: int, seed: int, kind: str) -> list[np.ndarray]:
    """``n`` float32 [rows, d_k] matrices. "decay": a decaying spectrum (1 .. 1e-3), a random rotation and
    uneven channel energies, like post-activation keys/queries; "gaussian": i.i.d. N(0, 1)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        if kind == "gaussian":
            out.append(rng.standard_normal((rows, d_k), dtype=np.float32))
            continue
        V = np.linalg.qr(rng.standard_normal((d_k, d_k)))[0]
        spec = np.logspace(0, -3, d_k) * np.exp(0.3 * rng.standard_normal(d_k))
        scale = np.exp(0.7 * rng.standard_normal(d_k))
        Z = rng.standard_normal((rows, d_k), dtype=np.float32)
        out.append(((Z * spec.astype(np.float32)) @ (V * scale).astype(np.float32)).astype(np.float32))
    return out


def naive_strong_rrqr(M: np.ndarray, k: int, f: float) -> tuple[np.ndarray, int]:
    """Strong RRQR without the reduction: QRCP of the full M, then a full QR of ``M[:, perm]`` after each swap."""
    n = M.shape[1]
    R, perm = sla.qr(M, mode="r", pivoting=True, check_finite=False)
    perm = perm.copy()
    swaps = 0
    while k < n:
        R = R[:n]
        A, B, C = R[:k, :k], R[:k, k:], R[k:n, k:]
        Ainv = sla.solve_triangular(A, np.eye(k, dtype=A.dtype), check_finite=False)
        U = Ainv @ B
        rho2 = U * U + np.outer((Ainv * Ainv).sum(1), (C * C).sum(0))
        flat = int(np.argmax(rho2))
        if rho2.flat[flat] <= f * f:
            break
        i, j = divmod(flat, n - k)
        perm[[i, k + j]] = perm[[k + j, i]]
        R = sla.qr(M[:, perm], mode="r", check_finite=False)[0]
        swaps += 1
    return perm, swaps


def _blas_info() -> str:
    try:
        from threadpoolctl import threadpool_info

        return ", ".join(f"{p.get('internal_api')} x{p.get('num_threads')}" for p in threadpool_info()) or "unknown"
    except ImportError:
        return "unknown (threadpoolctl missing)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--rows", type=int, default=5000, help="rows of M = [K; Q] per head")
    ap.add_argument("--dk", type=int, default=128)
    ap.add_argument("--k", type=int, nargs="+", default=[64, 32], help="the first k is also run by the naive routine")
    ap.add_argument("--f", type=float, default=DEFAULT_F)
    ap.add_argument("--data", choices=["decay", "gaussian"], default="decay")
    ap.add_argument("--repeats", type=int, default=3, help="timed passes of the fast routine (min and median)")
    ap.add_argument(
        "--naive-dtype",
        choices=["float64", "float32"],
        default="float64",
        help="precision of the naive routine (DRRQR computes in float64)",
    )
    ap.add_argument("--naive-heads", type=int, default=None, help="run the naive routine on this many heads only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2, help="select_heads thread-pool workers (BLAS 1 thread each)")
    ap.add_argument("--blas-threads", type=int, default=None, help="limit BLAS threads (threadpoolctl)")
    args = ap.parse_args()

    if args.blas_threads is not None:
        from threadpoolctl import threadpool_limits

        threadpool_limits(args.blas_threads)
    n_heads = args.layers * args.heads
    print(f"cpu: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; BLAS: {_blas_info()}")
    shape = f"{args.rows} x {args.dk} float32"
    print(f"data: {n_heads} heads ({args.layers} layers x {args.heads}) of {shape}, '{args.data}'")
    t0 = time.perf_counter()
    mats = make_mats(n_heads, args.rows, args.dk, args.seed, args.data)
    print(f"generated in {time.perf_counter() - t0:.1f} s (not timed)")

    fast_sel: dict[int, list[frozenset[int]]] = {}
    fast_total: dict[int, float] = {}
    driver_total: dict[int, float] = {}
    half = args.rows // 2
    heads = [(i // args.heads, i % args.heads, HeadData(K=M[:half], Q=M[half:])) for i, M in enumerate(mats)]
    for k in args.k:
        totals, cpu = [], []
        for _ in range(args.repeats):
            sels, swaps = [], []
            t0, c0 = time.perf_counter(), time.process_time()
            for M in mats:
                res = strong_rrqr(M, k, args.f)
                sels.append(frozenset(res.selected.tolist()))
                swaps.append(res.n_swaps)
            totals.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        fast_sel[k], fast_total[k] = sels, min(totals)
        print(
            f"DRRQR k={k:>3}: {min(totals):.3f} s total "
            f"(min of {args.repeats}; median {statistics.median(totals):.3f} s; CPU {min(cpu):.3f} s), "
            f"{1e3 * min(totals) / n_heads:.2f} ms/head, mean swaps/head {np.mean(swaps):.2f} (max {max(swaps)}), "
            f"reduction {res.reduction}"
        )
        driver = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = select_heads("drrqr", heads, k, options={"f": args.f}, progress=False, workers=args.workers)
            driver.append(time.perf_counter() - t0)
        driver_total[k] = min(driver)
        same = sum(frozenset(h.keep.tolist()) == f for (_, _, h), f in zip(out, sels))
        print(
            f"  select_heads('drrqr', workers={args.workers}) k={k:>3}: {min(driver):.3f} s total "
            f"(min of {args.repeats}; median {statistics.median(driver):.3f} s), same sets {same}/{n_heads}"
        )

    k = args.k[0]
    m = n_heads if args.naive_heads is None else min(args.naive_heads, n_heads)
    t0 = time.perf_counter()
    naive_sel, naive_swaps = [], []
    for M in mats[:m]:
        perm, s = naive_strong_rrqr(M.astype(args.naive_dtype, copy=False), k, args.f)
        naive_sel.append(frozenset(perm[:k].tolist()))
        naive_swaps.append(s)
    naive = time.perf_counter() - t0
    naive_all = naive * n_heads / m
    agree = sum(a == b for a, b in zip(fast_sel[k], naive_sel))
    extrap = "" if m == n_heads else f" (measured on {m} heads, scaled to {n_heads})"
    print(
        f"naive ({args.naive_dtype}) k={k:>3}: {naive_all:.3f} s total{extrap}, {1e3 * naive / m:.2f} ms/head, "
        f"mean swaps/head {np.mean(naive_swaps):.2f}"
    )
    print(f"speed-up naive / DRRQR (direct loop) at k={k}: {naive_all / fast_total[k]:.1f}x")
    print(f"same kept set as naive: {agree}/{m} heads")
    target = 1.0
    for name, t in (("direct loop", fast_total[k]), (f"select_heads workers={args.workers}", driver_total[k])):
        verdict = "meets" if t <= target else "misses"
        print(f"target <= {target:.0f} s for {n_heads} heads at k={k} ({name}): {verdict} ({t:.3f} s)")


if __name__ == "__main__":
    main()
