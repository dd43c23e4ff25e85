"""Run a study's table job in-process, as rules/studies.smk's rule does: documents written to files, every output
under one folder."""

from __future__ import annotations

import json
from pathlib import Path


def write_study(tmp_path: Path, name: str, docs: dict[str, list[dict]], params: dict) -> dict:
    """Write ``docs`` (input name -> documents) as JSON files, run study ``name``'s job on them with ``params`` into
    ``tmp_path`` (``<table>.md``, ``.csv``, ``.html``, ``.rst``; ``<figure>.png``); return its frames by table."""
    from statereduce.studies import get_study, outputs, write_outputs

    study = get_study(name)
    inputs = {}
    for key, items in docs.items():
        inputs[key] = []
        for i, doc in enumerate(items):
            path = tmp_path / "inputs" / key / f"{i}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(doc))
            inputs[key].append(str(path))
    paths = {k: str(tmp_path / Path(p).name) for k, p in outputs(study).items()}
    write_outputs(study, inputs, params, paths)
    return {t: df for t, (df, _) in study.frames(inputs, params).items()}
