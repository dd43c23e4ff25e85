"""Shrink a Triton cache folder to what loading compiled kernels needs, so it can travel between GPU calls.

Kept: each kernel's metadata (``*.json``, which includes the ``__grp__`` group files and fla's ``*.autotune.json``
results), its ``*.cubin`` and the compiled launchers (``*.so``). Dropped: the intermediate IR (``.source``, ``.ttir``,
``.ttgir``, ``.llir``, ``.ptx``), about 75 % of the bytes; Triton's ``get_group`` skips missing children and a cache
hit loads only the cubin. A group whose metadata or cubin is missing (say, a truncated transfer) is removed so that
its kernel is recompiled instead of failing to load.

    python3 dev/prune_triton_cache.py .triton_cache
"""

import json
import sys
from pathlib import Path

IR = {".source", ".ttir", ".ttgir", ".llir", ".ptx"}


def prune(root: Path) -> tuple[int, int]:
    kept = dropped = 0
    for path in root.rglob("*"):
        if path.is_file() and path.suffix in IR:
            path.unlink()
    for group in root.rglob("__grp__*"):
        names = [Path(p).name for p in json.loads(group.read_text())["child_paths"].values()]
        needed = [n for n in names if n.endswith((".json", ".cubin"))]
        if any(n.endswith(".cubin") for n in needed) and all((group.parent / n).exists() for n in needed):
            kept += 1
        else:
            group.unlink()
            dropped += 1
    return kept, dropped


if __name__ == "__main__":
    kept, dropped = prune(Path(sys.argv[1]))
    print(f"Triton cache pruned: {kept} kernels kept, {dropped} incomplete dropped")
