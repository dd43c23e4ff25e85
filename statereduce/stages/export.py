"""Rule ``export``: a pruned or fine-tuned checkpoint as a folder ready to upload to a model hub.

``export_checkpoint`` copies what loading needs (weights, config, tokenizer, the modeling code of a checkpoint whose
layers keep different widths: :mod:`statereduce.core.portable`), the records that say how it was made
(``prune_record.json``, ``rft_record.json``, ``eval.json``), RFT's LoRA adapter in peft's format (``adapter/``), and
writes a model card (``README.md``, Hugging Face's format: YAML metadata, then Markdown) naming the base model and
revision, the method and the widths of every layer, the calibration, the metrics of the base, the pruned and the
fine-tuned model, and the command that made it. Everything is written into a temporary sibling that is renamed into
place, so a half-written export never looks finished.

::

    from statereduce.stages.export import export_checkpoint
    export_checkpoint("results/gdn1.3b/drrqr@sens_50/rft", "export/", model_name="gdn1.3b",
                      evals={"base": "results/gdn1.3b/baseline/eval.json", ...}, command="snakemake ...")
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from statereduce.core.checkpoints import ADAPTER_DIR
from statereduce.core.models import checkpoint_widths, shaped_model
from statereduce.core.portable import LAYOUT_FIELD, MODELING_FILE, write_portable
from statereduce.core.runtime import atomic_dir, read_json, write_json
from statereduce.core.engines import Verdict, card_section, support_record

CARD = "README.md"
SERVING = "serving.json"
"""Which serving engines take the exported checkpoint, and with which flags (:mod:`statereduce.core.engines`)."""
STAGES = ("pruned", "rft")
"""The checkpoints an export takes: the pruned one, or the one recovery fine-tuning made of it."""
_LOAD_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")
_RECORDS = ("prune_record.json", "rft_record.json", "eval.json")
_METRIC_COLUMNS = (("base", "base"), ("pruned", "pruned"), ("rft", "after RFT"))


def export_checkpoint(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, *, model_name: str,
                      evals: Mapping[str, str | os.PathLike | None], base: Mapping[str, Any] | None = None,
                      calibration: Mapping[str, Any] | None = None, command: str | None = None,
                      pruned_repo: str | None = None) -> Path:
    """Write the upload-ready folder of ``checkpoint`` (a ``pruned/`` or ``rft/`` folder of the workflow).

    Args:
        checkpoint: the checkpoint folder; its ``prune_record.json`` says what was cut.
        out_dir: the folder to write (replaced when it exists).
        model_name: the workflow's model name (the card's title).
        evals: ``{"base", "pruned", "rft"}``: the ``eval.json`` of each, None or missing where there is none; the
            card's metrics table has a column per one given.
        base: the base model: ``{"hub_id", "revision"}`` of a hub model (``source.json``), else a description of the
            local checkpoint (e.g. ``{"checkpoint": ..., "trained_by": "statereduce pretrain"}``).
        calibration: the calibration settings the selection used (the config's block), for the card.
        command: the command that made the export, for the card.
        pruned_repo: where the pruned checkpoint is published (a hub id); an RFT export's adapter names it as its
            base model. None keeps the pruned folder's path there.

    Returns:
        ``out_dir``.

    Raises:
        ValueError: one line, for a folder that is not a checkpoint of the workflow (no ``config.json``,
            ``model.safetensors`` or ``prune_record.json``).
    """
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    missing = [n for n in ("config.json", "model.safetensors", "prune_record.json") if not (checkpoint / n).is_file()]
    if missing:
        raise ValueError(f"{checkpoint} is not a pruned or fine-tuned checkpoint of the workflow: it lacks "
                         f"{', '.join(missing)}")
    record = read_json(checkpoint / "prune_record.json")
    metrics = {name: read_json(Path(path)) for name, path in evals.items() if path and Path(path).is_file()}
    with atomic_dir(out_dir) as tmp:
        for name in (*_LOAD_FILES, *_RECORDS):
            if (checkpoint / name).is_file():
                _link_or_copy(checkpoint / name, tmp / name)
        layout = ensure_portable(checkpoint, tmp)
        adapter = _copy_adapter(checkpoint, tmp, pruned_repo)
        widths = checkpoint_widths(tmp, checkpoint_base(record, base))
        serving = support_record(read_json(tmp / "config.json"), record.get("family"), widths)
        write_json(tmp / SERVING, serving)
        card = model_card(model_name=model_name, record=record, widths=widths, metrics=metrics, base=base,
                          calibration=calibration, command=command, portable=layout is not None,
                          adapter=adapter, pruned_repo=pruned_repo,
                          engines=[Verdict(**v) for v in serving["engines"]])
        (tmp / CARD).write_text(card)
    return out_dir


def base_description(base_dir: str | os.PathLike) -> dict[str, Any]:
    """What the model card says of the unpruned model, from the workflow's base artifact ``results/{model}/base``:
    a hub model's ``{"hub_id", "revision"}`` (``source.json``), else the checkpoint and how the workflow made it
    (``pretrain.json``: trained from scratch; ``init.json``: random weights at a model's shape)."""
    base_dir = Path(base_dir)
    if (base_dir / "source.json").is_file():
        src = read_json(base_dir / "source.json")
        return {"hub_id": src.get("hub_id"), "revision": src.get("revision")}
    if (base_dir / "pretrain.json").is_file():
        return {"checkpoint": str(base_dir), "description": "a tiny model trained from scratch by statereduce pretrain"}
    if (base_dir / "init.json").is_file():
        return {"checkpoint": str(base_dir), "description": "random weights at the model's shape (statereduce init)"}
    return {"checkpoint": str(base_dir)}


def ensure_portable(checkpoint: Path, folder: Path) -> dict[str, Any] | None:
    """Give ``folder`` (a copy of ``checkpoint``) the modeling code its widths need: the checkpoint's own when it has
    it, else written here from the model :func:`statereduce.core.models.load_model` would build (on the meta device:
    no weights are read), for a checkpoint saved before checkpoints carried it. Returns the layout, or None for a
    checkpoint the stock class holds."""
    config = read_json(folder / "config.json")
    if (checkpoint / MODELING_FILE).is_file() and config.get(LAYOUT_FIELD):
        _link_or_copy(checkpoint / MODELING_FILE, folder / MODELING_FILE)
        return config[LAYOUT_FIELD]
    (folder / "config.json").unlink()  # a copy of its own: the hard link would change the checkpoint's file
    write_json(folder / "config.json", config)
    return write_portable(shaped_model(checkpoint, device="meta"), folder)


def checkpoint_base(record: Mapping[str, Any], base: Mapping[str, Any] | None) -> Path | None:
    """The unpruned model's folder where the record names one that exists (the workflow's ``results/{model}/base``)."""
    source = record.get("source_model")
    path = Path(source) if source else None
    return path if path is not None and (path / "config.json").is_file() else None


def model_card(*, model_name: str, record: Mapping[str, Any], widths: list[dict[str, Any]],
               metrics: Mapping[str, Mapping[str, Any]], base: Mapping[str, Any] | None,
               calibration: Mapping[str, Any] | None, command: str | None, portable: bool, adapter: bool,
               pruned_repo: str | None = None, engines: list[Verdict] | None = None) -> str:
    """The model card (``README.md``): Hugging Face's YAML metadata, then what the model is, how to load it, what
    was cut in each layer, its metrics, how it was made."""
    extra = record.get("extra") or {}
    family, method, pct = record.get("family"), record.get("method"), record.get("pct")
    rft = record.get("rft")
    hub = (base or {}).get("hub_id")
    tags = ["statereduce", "linear-attention", "state-reduction", str(family)]
    if portable:
        tags.append("custom_code")
    meta = ["---", "library_name: transformers", "pipeline_tag: text-generation"]
    if hub:
        meta.append(f"base_model: {hub}")
    meta.append("tags:")
    meta += [f"- {t}" for t in tags]
    meta.append("---")
    stage = ", fine-tuned" if rft else ""
    out = [*meta, "", f"# {model_name}: `{method}`, {_pct(pct)} % of key channels removed{stage}", ""]
    base_line = _base_line(base, record)
    total_after = sum(w["state_bytes"] for w in widths)
    total_before = sum(w.get("base_state_bytes", 0) for w in widths)
    state = f"{_bytes(total_after)} of recurrent state per sequence (float32)"
    if total_before:
        state += f", {total_after / total_before:.1%} of the base's {_bytes(total_before)}"
    out += [f"{base_line}, with its linear-attention state reduced by statereduce, which reproduces and extends "
            "[On State Reduction in Linear Attention](https://arxiv.org/abs/2602.04852) (Nazari & Rusch, 2026): each "
            "head keeps fewer key/query (and value) channels, sliced out of the weights, so the model's own kernels "
            f"run on a smaller state: {state}.", ""]
    out += ["## Use", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", ""]
    if family in ("delta_net", "gated_deltanet") and not portable:
        out += ["import fla  # flash-linear-attention registers its models with transformers", ""]
    trust = ", trust_remote_code=True" if portable else ""
    out += [f'model = AutoModelForCausalLM.from_pretrained("PATH_OR_REPO"{trust})',
            f'tokenizer = AutoTokenizer.from_pretrained("PATH_OR_REPO"{trust})', "```", ""]
    if portable:
        out += ["The layers keep different widths, which the stock model class cannot hold, so the folder carries "
                "`modeling_statereduce.py` (torch and transformers only"
                f"{', plus fla' if family in ('delta_net', 'gated_deltanet') else ''}; not statereduce): it builds "
                "the stock model and gives each listed module its pruned shape before the weights load "
                "(`statereduce_layout` in `config.json`).", ""]
    elif family in ("delta_net", "gated_deltanet"):
        out += ["Needs `flash-linear-attention` (fla), as the base model does. With fla 0.6.0 and transformers 5.24, "
                "`generate()` passes the cache as `cache=` while fla's model reads `past_key_values=`, and decodes "
                "without its state: map one onto the other (`statereduce.speed.generate.install_cache_alias` "
                "does).", ""]
    if engines:
        out += card_section(engines)
    out += ["## What was cut", "", f"- Base model: {base_line}."]
    out.append(f"- Method: `{method}` (selector `{extra.get('selector', method)}`"
               + (f", per-layer budget `{extra['budget']}`" if extra.get("budget") else "")
               + f"), {_pct(pct)} % of the key channels removed"
               + (f"; fitted output projections (`+{record['fit']['name']}`)" if isinstance(record.get("fit"), dict)
                  else "") + ".")
    scale = (record.get("kernel_scale") or {}).get("norm_eps") or {}
    if scale.get("choice") == "exact":
        out.append("- Kernel scale: `norm_eps: exact` (each cut layer's output-norm eps scaled with its kept width, so "
                   "the cut equals zeroing the dropped channels).")
    elif scale.get("choice"):
        out.append(f"- Kernel scale: `norm_eps: {scale['choice']}` (the config's eps, as the paper's checkpoints).")
    if calibration:
        out.append(f"- Calibration (`{extra.get('calibration', 'default')}`): "
                   + ", ".join(f"{k} {_fmt(v)}" for k, v in calibration.items()) + ".")
    elif extra.get("calibration"):
        out.append(f"- Calibration: `{extra['calibration']}`.")
    out += ["", "| layer | heads | d_k (base → kept) | d_v (base → kept) | state per sequence |",
            "| ---: | ---: | --- | --- | ---: |"]
    for w in widths:
        out.append(f"| {w['layer']} | {w['heads']} | {w.get('base_d_k', w['d_k'])} → {w['d_k']} | "
                   f"{w.get('base_d_v', w['d_v'])} → {w['d_v']} | {_bytes(w['state_bytes'])} |")
    out += ["", *metrics_table(metrics)]
    if rft:
        settings = rft.get("settings") or {}
        lora = settings.get("lora") or {}
        out += ["## Recovery fine-tuning", "",
                f"LoRA (rank {lora.get('rank')}, alpha {lora.get('alpha')}) and distillation from the base model "
                f"({settings.get('n_samples')} sequences of {settings.get('seq_len')} tokens, learning rate "
                f"{settings.get('lr')}), merged into these weights"
                + (f"; {rft['steps']} optimizer steps" if rft.get("steps") else "") + "."]
        if adapter:
            where = f"`{pruned_repo}`" if pruned_repo else "the pruned checkpoint"
            out += ["", f"The adapter alone is in `adapter/` (peft's format), for {where}:", "", "```python",
                    "from peft import PeftModel",
                    f"base = AutoModelForCausalLM.from_pretrained(\"{pruned_repo or 'PRUNED'}\"{trust}"
                    + (", fuse_swiglu=False" if family in ("delta_net", "gated_deltanet") else "")
                    + ")", "model = PeftModel.from_pretrained(base, \"PATH_OR_REPO\", subfolder=\"adapter\")",
                    "```"]
            if family in ("delta_net", "gated_deltanet"):
                out += ["", "(`fuse_swiglu=False`: fla's fused MLP kernel would skip the adapter's `down_proj` "
                        "update; `model.merge_and_unload()` gives these weights either way.)"]
        out.append("")
    versions = record.get("versions") or {}
    out += ["## How it was made", ""]
    if command:
        out += ["```bash", command, "```", ""]
    out.append("Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items() if k != "cpu")
               + (f"; CPU {versions['cpu']}" if versions.get("cpu") else "") + ".")
    out += ["`prune_record.json` holds every kept channel and the settings"
            + (", `rft_record.json` the fine-tuning" if rft else "") + ", `eval.json` the evaluation.", "",
            "## Citation", "", "```bibtex", "@article{nazari2026state,",
            "  title={On State Reduction in Linear Attention},",
            "  author={Nazari, Philipp and Rusch, T. Konstantin},", "  journal={arXiv preprint arXiv:2602.04852},",
            "  year={2026}", "}", "```", ""]
    return "\n".join(out)


def metrics_table(metrics: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The card's metrics: one row per task metric, a column per evaluated model (base, pruned, after RFT)."""
    columns = [(key, label) for key, label in _METRIC_COLUMNS if key in metrics]
    if not columns:
        return []
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for key, _ in columns:
        for task, values in (metrics[key].get("metrics") or {}).items():
            for name, value in values.items():
                if not name.endswith("_stderr") and isinstance(value, (int, float)):
                    rows.setdefault((task, name), {})[key] = (value, values.get(f"{name}_stderr"))
    out = ["## Metrics", "", "| task | metric | " + " | ".join(label for _, label in columns) + " |",
           "| --- | --- | " + " | ".join("---:" for _ in columns) + " |"]
    for (task, name), cells in rows.items():
        shown = []
        for key, _ in columns:
            value, se = cells.get(key, (None, None))
            shown.append("" if value is None else f"{value:.4g}" + (f" ± {se:.2g}" if se is not None else ""))
        out.append(f"| {task} | {name} | " + " | ".join(shown) + " |")
    device = next((m.get("settings", {}).get("device") for m in metrics.values() if m.get("settings")), None)
    out += ["", "Evaluated with lm-eval by the workflow" + (f" on {device}" if device else "") + ".", ""]
    return out


def _copy_adapter(checkpoint: Path, folder: Path, pruned_repo: str | None) -> bool:
    source = checkpoint / ADAPTER_DIR
    if not (source / "adapter_config.json").is_file():
        return False
    shutil.copytree(source, folder / ADAPTER_DIR)
    config = read_json(folder / ADAPTER_DIR / "adapter_config.json")
    if pruned_repo:
        config["base_model_name_or_path"] = pruned_repo
    write_json(folder / ADAPTER_DIR / "adapter_config.json", config)
    return True


def _link_or_copy(src: Path, dst: Path) -> None:
    """A hard link where the filesystem allows (a 9B model's weights are not copied), else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _base_line(base: Mapping[str, Any] | None, record: Mapping[str, Any]) -> str:
    base = dict(base or {})
    if base.get("hub_id"):
        rev = base.get("revision")
        return f"[`{base['hub_id']}`](https://huggingface.co/{base['hub_id']})" + (f" at revision `{rev}`" if rev
                                                                                      else "")
    if base.get("checkpoint"):
        return f"`{base['checkpoint']}`" + (f" ({base['description']})" if base.get("description") else "")
    return f"`{record.get('source_model', 'the base model')}`"


def _pct(pct: Any) -> str:
    return f"{float(pct):g}" if pct is not None else "?"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _fmt(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)
