"""How far bf16 alone moves the logits of check_rft_gpu.py's random models, against float64, on the CPU.

    python dev/bf16_noise.py qwen3_5 gated_deltanet [--hidden-size 1024 --layers 8 --heads 8 --expand-k 1.0 --keep 64]

Builds each family's model the way ``scripts/check_rft_gpu.py`` does (same seed, conv filters N(0, 0.3), random
pruning to ``--keep`` channels), runs one 2 x 512 batch through the torch kernels in float64, float32 and bfloat16,
and prints the relative Frobenius difference of each against float64: the scale of rounding noise that the GPU
reload check's comparison between two bf16 implementations has to be read against (docs/records/gpu_checks.md).
"""

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts"), str(ROOT / "tests")]

from _models import random_keep  # noqa: E402
from check_rft_gpu import family_arch  # noqa: E402

from statereduce.adapters import adapter_class, get_adapter  # noqa: E402
from statereduce.core.models import tiny_config  # noqa: E402
from statereduce.stages.prune import prune_model  # noqa: E402

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("families", nargs="+")
p.add_argument("--hidden-size", type=int, default=1024)
p.add_argument("--layers", type=int, default=8)
p.add_argument("--heads", type=int, default=8)
p.add_argument("--expand-k", type=float, default=1.0)
p.add_argument("--keep", type=int, default=64)
args = p.parse_args()
for family in args.families:
    torch.manual_seed(0)
    model = adapter_class(family).build(
        tiny_config(family, family_arch(family, args.hidden_size, args.layers, args.heads, args.expand_k)))
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if "conv1d" in name:
                prm.normal_(0.0, 0.3)
    adapter = get_adapter(model)
    pct = 100 * (1 - args.keep / adapter.head_k_dim)
    prune_model(model, random_keep(model, args.keep, seed=1), {"source": "random", "method": "rand", "pct": pct},
                norm_eps="stock")
    adapter.install_fallbacks(("cpu",))
    x = torch.randint(0, 256, (2, 512), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model.double()(input_ids=x).logits
        out = {dt: model.to(dt)(input_ids=x).logits.double() for dt in (torch.float32, torch.bfloat16)}
    rel = {str(dt).removeprefix("torch."): f"{float((o - ref).norm() / ref.norm()):.2e}" for dt, o in out.items()}
    print(family, "relative difference to float64:", rel, f"max |logit| {float(ref.abs().max()):.2f}")
