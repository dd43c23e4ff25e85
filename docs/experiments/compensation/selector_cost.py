"""Seconds of the ghost and drrqr selectors per head at the 1.3B shape (2,500 + 2,500 calibration rows of d_k = 128,
keep 64), on random rows, and the product for a DeltaNet 1.3B's 24 layers x 16 heads. Selection runs on the CPU.

    python docs/experiments/compensation/selector_cost.py
"""

import platform
import time

import numpy as np
import torch

from statereduce.selectors import HeadData, get_selector

rng = np.random.default_rng(0)
data = HeadData(K=rng.standard_normal((2500, 128)).astype(np.float32),
                Q=rng.standard_normal((2500, 128)).astype(np.float32))
print(f"{platform.processor() or 'cpu'}, torch capability {torch.backends.cpu.get_cpu_capability()}")
for name in ("ghost", "drrqr"):
    fn = get_selector(name).fn
    start = time.perf_counter()
    for _ in range(16):
        fn(data, 64, variant="kq", rng=np.random.default_rng(0))
    per_head = (time.perf_counter() - start) / 16
    print(f"{name}: {per_head * 1e3:.2f} ms per head; 24 layers x 16 heads: {per_head * 384:.1f} s")
