"""Rule and API ``export`` (statereduce.stages.export): an upload-ready folder of a pruned or fine-tuned checkpoint
with its model card, which loads in an environment without statereduce, also for checkpoints saved before they
carried their modeling code; RFT's adapter goes with it."""

from __future__ import annotations

import json
import re

import pytest
import torch
from _models import tiny_inputs, tiny_model
from _venv import load_there, without_statereduce
from test_portable import _pruned

from statereduce import api
from statereduce.core.checkpoints import ADAPTER_DIR
from statereduce.core.models import load_model
from statereduce.core.portable import LAYOUT_FIELD, MODELING_FILE, is_portable
from statereduce.core.runtime import read_json, write_json
from statereduce.core.tokenizer import byte_level_tokenizer
from statereduce.stages.export import base_description, export_checkpoint, metrics_table
from statereduce.stages.prune import save_pruned


def _eval(loss: float, acc: float) -> dict:
    return {"metrics": {"heldout": {"bits_per_byte": loss}, "recall_mqar_4": {"acc": acc, "acc_stderr": 0.03}},
            "settings": {"device": "cpu"}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A base folder with ``source.json``, and per family a per-layer cut's ``pruned/`` with eval.json files."""
    root = tmp_path_factory.mktemp("export")
    base = root / "base"
    base.mkdir()
    write_json(base / "source.json", {"hub_id": "fla-hub/gla-1.3B-100B", "revision": "0123abc"})
    write_json(root / "base_eval.json", _eval(0.90, 0.60))
    out = {}
    for family in ("delta_net", "mamba2"):
        model, record = _pruned(family, "keys_per_layer")
        folder = save_pruned(model, byte_level_tokenizer(), record, root / family / "pruned")
        write_json(folder / "eval.json", _eval(1.10, 0.45))
        out[family] = folder
    return root, out


def _export(root, pruned, name="tiny", **kw):
    evals = {"base": root / "base_eval.json", "pruned": pruned / "eval.json", **kw.pop("evals", {})}
    return export_checkpoint(pruned, root / "exports" / name, model_name="tiny-test", evals=evals,
                             base=base_description(root / "base"), calibration={"corpus": "wikitext", "n_samples": 64},
                             command="snakemake --cores all results/tiny/x/export/pruned/README.md", **kw)


def test_the_export_holds_what_loading_needs_and_a_model_card(checkpoints):
    root, pruned = checkpoints
    out = _export(root, pruned["delta_net"])
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", MODELING_FILE,
            "prune_record.json", "eval.json", "README.md"} <= names
    card = (out / "README.md").read_text()
    front = card.split("---")[1]
    assert "library_name: transformers" in front and "base_model: fla-hub/gla-1.3B-100B" in front
    assert "- custom_code" in front and "- delta_net" in front
    assert "at revision `0123abc`" in card and "trust_remote_code=True" in card
    assert "snakemake --cores all results/tiny/x/export/pruned/README.md" in card
    assert "corpus wikitext, n_samples 64" in card
    rows = [line for line in card.splitlines() if re.match(r"^\| \d+ \|", line)]
    widths = json.loads((out / "config.json").read_text())["statereduce_key_dims"]
    assert [int(r.split("|")[3].split("→")[1]) for r in rows] == [w for w in widths if w is not None]
    assert "| heldout | bits_per_byte | 0.9 | 1.1 |" in card
    assert "| recall_mqar_4 | acc | 0.6 ± 0.03 | 0.45 ± 0.03 |" in card


def test_an_exported_per_layer_cut_loads_without_statereduce(checkpoints, tmp_path):
    root, pruned = checkpoints
    out = _export(root, pruned["mamba2"], name="mamba2")
    ids = tiny_inputs(batch=2, length=12)
    torch.save(ids, tmp_path / "ids.pt")
    env = without_statereduce(tmp_path, fla=False)
    case = {"name": "mamba2", "folder": str(out), "out": str(tmp_path / "got.pt"), "ids": str(tmp_path / "ids.pt"),
            "import_fla": False, "forward": True}
    done = load_there(env, [case], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    model, _ = load_model(pruned["mamba2"])
    with torch.no_grad():
        assert torch.equal(torch.load(tmp_path / "got.pt")["logits"], model(ids).logits)


def test_a_checkpoint_saved_without_its_modeling_code_gets_it_in_the_export(checkpoints, tmp_path):
    """A per-layer checkpoint of an earlier version (no modeling file, the stock model type): the export writes the
    code from the model load_model builds, on the meta device, and the export loads as the new checkpoints do."""
    root, pruned = checkpoints
    old = tmp_path / "old"
    old.mkdir()
    for f in pruned["delta_net"].iterdir():
        if f.name != MODELING_FILE:
            (old / f.name).write_bytes(f.read_bytes())
    config = read_json(old / "config.json")
    config.pop(LAYOUT_FIELD), config.pop("auto_map")
    config["model_type"] = "delta_net"
    write_json(old / "config.json", config)
    out = _export(root, old, name="old")
    new = read_json(pruned["delta_net"] / "config.json")
    assert read_json(out / "config.json")[LAYOUT_FIELD] == new[LAYOUT_FIELD]
    assert is_portable(read_json(out / "config.json")) and not is_portable(read_json(old / "config.json"))
    assert (out / MODELING_FILE).read_text() == (pruned["delta_net"] / MODELING_FILE).read_text()


def test_an_rft_export_carries_the_adapter_and_names_the_pruned_repo(checkpoints, tmp_path):
    from peft import LoraConfig, get_peft_model

    root, pruned = checkpoints
    rft = tmp_path / "rft"
    rft.mkdir()
    for f in pruned["delta_net"].iterdir():
        (rft / f.name).write_bytes(f.read_bytes())
    record = read_json(rft / "prune_record.json")
    record["rft"] = {"settings": {"lora": {"rank": 8, "alpha": 16}, "n_samples": 32, "seq_len": 64, "lr": 1e-3}}
    write_json(rft / "prune_record.json", record)
    model, _ = load_model(pruned["delta_net"])
    get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj"])).save_pretrained(rft / ADAPTER_DIR)
    write_json(rft / "eval.json", _eval(0.95, 0.55))
    out = _export(root, rft, name="rft", evals={"pruned": pruned["delta_net"] / "eval.json", "rft": rft / "eval.json"},
                  pruned_repo="me/tiny-dn-pruned")
    assert read_json(out / ADAPTER_DIR / "adapter_config.json")["base_model_name_or_path"] == "me/tiny-dn-pruned"
    card = (out / "README.md").read_text()
    assert "## Recovery fine-tuning" in card and "LoRA (rank 8, alpha 16)" in card
    assert 'subfolder="adapter"' in card and "fuse_swiglu=False" in card
    assert "| heldout | bits_per_byte | 0.9 | 1.1 | 0.95 |" in card


def test_the_api_exports_a_saved_checkpoint(tmp_path):
    model = tiny_model("qwen3_5")
    pruned = api.prune(model, {layer: torch.arange(8).expand(2, -1) for layer in (0, 1)})
    folder = api.save(pruned, tmp_path / "p", byte_level_tokenizer())
    out = api.export(folder, tmp_path / "up", model_name="mine")
    card = (out / "README.md").read_text()
    assert "# mine: " in card and "custom_code" not in front_matter(card)
    assert MODELING_FILE not in {p.name for p in out.iterdir()}  # one width in every layer: the stock class holds it
    assert "## Metrics" not in card  # nothing evaluated


def front_matter(card: str) -> str:
    return card.split("---")[1]


def test_exporting_a_folder_that_is_no_checkpoint_fails_in_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"^.* is not a pruned or fine-tuned checkpoint of the workflow: it lacks "
                                         r"config.json, model.safetensors, prune_record.json$"):
        export_checkpoint(tmp_path, tmp_path / "out", model_name="x", evals={})
    assert not (tmp_path / "out").exists()


def test_the_metrics_table_has_a_column_per_evaluated_model():
    assert metrics_table({}) == []
    table = metrics_table({"pruned": _eval(1.0, 0.5), "rft": _eval(0.9, 0.6)})
    assert table[2] == "| task | metric | pruned | after RFT |"
