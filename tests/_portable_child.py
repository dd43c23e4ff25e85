"""Run by tests/test_portable.py in a virtual environment without statereduce: load each checkpoint of a manifest as a
user would (``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``) and save what the test
compares with ``load_model``'s model.

    python _portable_child.py MANIFEST.json

The manifest: ``{"cases": [{"name", "folder", "out", "import_fla", "forward"}]}``. Per case it writes ``out`` (a
torch file): the model's class, every module's class and plain attributes, every parameter and buffer, and with
``forward`` the logits of the saved ``ids`` and four greedily generated tokens (fla's Triton kernels do not run on a
CPU, so the fla families are compared by structure and weights). It imports nothing of the test suite.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import torch

SIMPLE = (bool, int, float, str, type(None))


def plain(value):
    if isinstance(value, (tuple, list)):
        return [plain(v) for v in value] if all(isinstance(v, SIMPLE + (tuple, list)) for v in value) else None
    return value if isinstance(value, SIMPLE) else None


def structure(model):
    modules = {}
    for path, module in model.named_modules():
        attrs = {k: plain(v) for k, v in vars(module).items()
                 if not k.startswith("_") and k != "training" and plain(v) is not None}
        modules[path] = {"class": type(module).__name__, "attributes": attrs}
    tensors = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return modules, tensors


def main(manifest: str) -> None:
    if importlib.util.find_spec("statereduce") is not None:
        raise SystemExit("statereduce is importable here: this environment must not have it")
    cases = json.loads(open(manifest).read())["cases"]
    for case in cases:
        if case["import_fla"]:
            import fla  # noqa: F401  (a stock fla checkpoint needs fla's Auto registration, as on the hub)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(case["folder"], trust_remote_code=True, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(case["folder"], trust_remote_code=True)
        model.eval()
        modules, tensors = structure(model)
        result = {"class": [c.__name__ for c in type(model).__mro__], "modules": modules, "tensors": tensors,
                  "tokenizer": type(tokenizer).__name__, "vocab": len(tokenizer)}
        if case["forward"]:
            ids = torch.load(case["ids"])
            with torch.no_grad():
                result["logits"] = model(ids).logits
                result["generated"] = model.generate(ids[:, :8], max_new_tokens=4, min_new_tokens=4, do_sample=False,
                                                     attention_mask=torch.ones_like(ids[:, :8]))
        torch.save(result, case["out"])
    if "statereduce" in sys.modules:
        raise SystemExit("loading imported statereduce")
    print(f"loaded {len(cases)} checkpoints")


if __name__ == "__main__":
    main(sys.argv[1])
