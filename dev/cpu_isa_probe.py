"""Do the CPU kernels give the same numbers on this CPU as on another, with and without capping them at AVX2?

    python dev/cpu_isa_probe.py OUT.json [--steps 60]

Trains the embedded default's tiny DeltaNet shape (``config.yaml``: ``tiny-dn``; 4 layers, hidden 128, d_k 64) for
``--steps`` steps on one thread, on a corpus that is the same on every machine and every Python (200 kB of words
drawn by Python's seeded ``random``; not the interpreter's standard library, nor files of a working tree), then runs DRRQR's strong RRQR (scipy's LAPACK) on its calibration
activations. ``native`` runs as the libraries choose; ``avx2`` sets the variables of :data:`AVX2_ENV`, each library's
documented cap of its CPU kernels. Each runs in a fresh process, since the libraries read the variables when they
load. OUT.json gets, per ISA: torch's CPU capability, the final
losses as exact hex floats, the SHA-256 of the trained weights and of the selection, and the wall time; and the CPU
model and library versions. Two machines with the same versions would give equal ``avx2`` hashes if the cap made
the numbers independent of the CPU; docs/results.md ("Why the CPU matters") says what it found.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AVX2_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",  # torch's own vectorized kernels
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",  # MKL: torch's BLAS and LAPACK
    "MKL_CBWR": "AVX2",  # MKL's conditional numerical reproducibility
    "ONEDNN_MAX_CPU_ISA": "AVX2",  # oneDNN: torch's mkldnn kernels
    "OPENBLAS_CORETYPE": "Haswell",  # OpenBLAS of numpy and scipy
    "NPY_DISABLE_CPU_FEATURES": "X86_V4 AVX512_ICL AVX512_SPR",  # numpy's dispatched AVX-512 loops
}
ARCH = {"hidden_size": 128, "num_hidden_layers": 4, "num_heads": 2, "expand_k": 1.0, "expand_v": 1.0}


def child(isa: str, steps: int) -> dict:
    sys.path.insert(0, str(ROOT))
    if isa == "avx2":
        os.environ.update(AVX2_ENV)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import numpy as np
    import torch
    from safetensors.torch import load_file

    from statereduce.stages.pretrain import pretrain
    from statereduce.selectors.rrqr import strong_rrqr
    from statereduce.common.settings import TrainSettings

    import random

    rng = random.Random(0)
    vocab = ["".join(rng.choice("etaoinshrdlucmfwyp") for _ in range(rng.randint(1, 9))) for _ in range(2000)]
    text = "\n\n".join(" ".join(rng.choice(vocab) for _ in range(rng.randint(20, 200))) + "." for _ in range(400))
    train = {"steps": steps, "batch_size": 4, "seq_len": 128, "lr": 3.0e-3, "warmup": 10, "seed": 0, "threads": 1,
             "log_every": steps}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "corpus.txt").write_text(text)
        corpus = {"source": "files", "paths": [str(Path(tmp) / "corpus.txt")]}
        rec = pretrain("delta_net", ARCH, corpus, TrainSettings.from_dict(train), Path(tmp) / "ckpt")
        weights = load_file(str(Path(tmp) / "ckpt" / "model.safetensors"))
    seconds = time.perf_counter() - t0
    digest = hashlib.sha256()
    for name in sorted(weights):
        digest.update(name.encode())
        digest.update(weights[name].float().numpy().tobytes())
    # strong RRQR (scipy's pivoted QR, then swaps) on a matrix made from the trained weights: LAPACK's kernels
    w = weights[sorted(k for k in weights if k.endswith("k_proj.weight"))[0]].double().numpy()
    a = np.tanh(np.random.default_rng(0).standard_normal((2500, w.shape[1])) @ w.T)
    t1 = time.perf_counter()
    res = strong_rrqr(a, a.shape[1] // 2)
    rrqr_seconds = time.perf_counter() - t1
    return {
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "env": {k: os.environ[k] for k in AVX2_ENV if k in os.environ},
        "losses": {k: float(v).hex() for k, v in rec.items() if k.endswith("loss") and isinstance(v, float)},
        "weights_sha256": digest.hexdigest(),
        "rrqr": {"sha256": hashlib.sha256(res.perm.tobytes() + res.R.tobytes()).hexdigest(), "seconds": rrqr_seconds},
        "train_seconds": seconds,
    }


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--child", choices=["native", "avx2"])
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.steps)))
        return
    import importlib.metadata as md

    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    doc = {"cpu": cpu_model(), "avx512f": " avx512f" in flags, "python": platform.python_version(),
           "versions": {p: md.version(p) for p in ("torch", "numpy", "scipy", "transformers", "fla-core")},
           "steps": args.steps, "runs": {}}
    env = {k: v for k, v in os.environ.items() if k not in AVX2_ENV}
    for isa in ("native", "avx2"):
        p = subprocess.run([sys.executable, __file__, "--child", isa, "--steps", str(args.steps)], env=env,
                           capture_output=True, text=True, check=False)
        if p.returncode:
            doc["runs"][isa] = {"error": p.stderr[-3000:]}
        else:
            doc["runs"][isa] = json.loads(p.stdout.strip().splitlines()[-1])
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
