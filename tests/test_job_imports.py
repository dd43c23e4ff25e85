"""What a workflow job imports before its first real work (docs/testing.md, "Job start-up").

Each rule script's import phase (Snakemake's job runs it first: its imports and ``runtime.start``; the same cut
``dev/job_startup.py`` measures) runs in a fresh interpreter with a stand-in ``snakemake`` object, and the modules it
loaded are checked against :data:`NOT_LOADED`: a stage that needs no model loads no torch and no model library, and
no import phase loads fla (imported where a model is loaded), peft or accelerate (RFT's work imports them) or
lm-eval (imported where an evaluation runs). ``runtime.start`` pins torch's threads when torch is imported, without
importing it; a Mamba-2 checkpoint loads without fla, the other families' with it. The job start-up record of
docs/results/ is the Markdown its JSON renders to.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import _fresh as fresh
import pytest
from _paths import ROOT

SCRIPTS = ROOT / "workflow_scripts"
MODEL_LIBRARIES = ("transformers", "fla", "peft", "accelerate", "lm_eval")
"""Loaded by jobs that load a model (transformers, fla), fine-tune it (peft, accelerate) or evaluate it (lm-eval)."""
OTHER_STAGES = ("fla", "peft", "accelerate", "lm_eval")
"""What no import phase loads: fla comes with the model (``load_model``), peft and accelerate with RFT's work,
lm-eval with an evaluation."""
MODEL_FREE = ("torch", *MODEL_LIBRARIES)
NOT_LOADED = {
    # stages that read artifacts and write documents, tables or figures (split and budget_values load a model in
    # their work for the policies that measure a calibration loss)
    "allocate": MODEL_FREE,
    "base_source": MODEL_FREE,
    "budget_values": MODEL_FREE,
    "comparison_table": (*MODEL_FREE, "matplotlib"),
    "figures": MODEL_FREE,
    "rank_tables": (*MODEL_FREE, "matplotlib"),
    "select_channels": MODEL_FREE,
    "speed_table": MODEL_FREE,
    "split": MODEL_FREE,
    "study": MODEL_FREE,
    "summarize": MODEL_FREE,
    # stages that load a model: torch, and the rest where the work needs it
    "calibrate": OTHER_STAGES,
    "eval_baseline": OTHER_STAGES,
    "export": OTHER_STAGES,
    "fit": OTHER_STAGES,
    "grad_scores": OTHER_STAGES,
    "init_random": OTHER_STAGES,
    "pretrain": OTHER_STAGES,
    "prune": OTHER_STAGES,
    "prune_fit": OTHER_STAGES,
    "qk_weights": OTHER_STAGES,
    "rank": OTHER_STAGES,
    "rank_baseline": OTHER_STAGES,
    "rft": OTHER_STAGES,
    "speed": OTHER_STAGES,
    "speed_generate": OTHER_STAGES,
}
WATCHED = sorted({m for mods in NOT_LOADED.values() for m in mods})
GROUPS = {"model-free": MODEL_FREE, "model-free-tables": (*MODEL_FREE, "matplotlib"), "model-loading": OTHER_STAGES}


def _job_startup():
    spec = importlib.util.spec_from_file_location("job_startup", ROOT / "dev" / "job_startup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


job_startup = _job_startup()


def _loaded(code: str, preload: tuple[str, ...] = ()) -> list[str]:
    """The :data:`WATCHED` packages in ``sys.modules`` after ``code`` ran in a fresh interpreter (a child of the fork
    server that preloaded ``preload``, :mod:`_fresh`: for checks of the packages it leaves out)."""
    probe = (f"\nimport json, sys\nprint(json.dumps([m for m in {WATCHED!r} if m in sys.modules]), "
             "file=sys.__stdout__, flush=True)\n")
    out = fresh.run(["-c", code + probe], preload=preload, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_rule_script_is_classified():
    assert sorted(p.stem for p in SCRIPTS.glob("*.py")) == sorted(NOT_LOADED)
    assert set(NOT_LOADED.values()) == set(GROUPS.values())


@pytest.mark.parametrize("group", GROUPS)
def test_the_import_phase_loads_only_what_the_stage_uses(group, tmp_path):
    """The import phases of one group's scripts, one after the other in one fresh interpreter: ``sys.modules`` only
    grows, so what it holds new after a script's phase is what that script loaded (none of its group's
    :data:`NOT_LOADED`, or an earlier script of the group loaded it first and failed)."""
    scripts = [s for s, mods in NOT_LOADED.items() if mods == GROUPS[group]]
    phases = {s: job_startup.stand_in(SCRIPTS / f"{s}.py", tmp_path / f"{s}.log") for s in scripts}
    code = ("import json, sys\nloaded = {}\n"
            f"for script, phase in {phases!r}.items():\n"
            "    exec(compile(phase, f'workflow_scripts/{script}.py', 'exec'), {'__name__': '__main__'})\n"
            f"    loaded[script] = [m for m in {WATCHED!r} if m in sys.modules]\n"
            "print(json.dumps(loaded), file=sys.__stdout__)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    wrong = {s: sorted(set(mods) & set(GROUPS[group])) for s, mods in json.loads(out.stdout.splitlines()[-1]).items()}
    first = next(((s, mods) for s, mods in wrong.items() if mods), None)
    assert first is None, (f"workflow_scripts/{first[0]}.py loads {first[1]} before its work (its stage does not use "
                           "them there)")


def test_the_import_phase_is_the_imports_and_start():
    source = '"""doc."""\nimport os\n\nfrom a import start\n\nlog = start(1)\nfrom b import c  # noqa: E402\n' \
             "x = c()\nimport d\n"
    assert job_startup.import_phase(source) == 7
    assert job_startup.import_phase('"""doc."""\nx = 1\nimport os\n') == 1


def test_start_pins_torch_threads_when_torch_is_imported():
    """``start`` loads no torch; the job's first ``import torch`` gets the rule's threads, and torch keeps its own
    loader. With torch already loaded the threads are pinned at once."""
    code = ("import sys\nfrom statereduce.core.runtime import start\nstart(None, 1)\n"
            "assert 'torch' not in sys.modules\n"
            "import torch.nn\nassert torch.get_num_threads() == 1, torch.get_num_threads()\n"
            "assert type(torch.__loader__).__name__ == 'SourceFileLoader', torch.__loader__\n"
            "assert torch.__spec__.loader is torch.__loader__\n"
            "start(None, 2)\nassert torch.get_num_threads() == 2\n")
    assert "torch" in _loaded(code)


def test_a_job_without_torch_loads_none_at_exit(tmp_path):
    """The exit hook that logs the peak GPU memory reads torch only where the job loaded it."""
    code = ("import atexit, json, sys\n"  # exit hooks run last first: this one after start's
            "atexit.register(lambda: print(json.dumps('torch' in sys.modules), file=sys.__stdout__))\n"
            f"from statereduce.core.runtime import start\nstart({str(tmp_path / 'job.log')!r}, 1)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "false", out.stdout + out.stderr


def test_a_mamba2_checkpoint_is_built_and_loaded_without_fla(tmp_path):
    """Mamba-2 is transformers' model (its PyTorch path on CPU): building, saving and loading it never imports fla."""
    code = ("from statereduce.core.models import build_random, load_model, save_checkpoint\n"
            "from statereduce.core.tokenizer import byte_level_tokenizer\n"
            f"m = build_random('mamba2', {_MAMBA2!r})\nsave_checkpoint(m, byte_level_tokenizer(), {str(tmp_path)!r})\n"
            f"model, tok = load_model({str(tmp_path)!r})\nassert type(model).__name__ == 'Mamba2ForCausalLM'\n")
    assert "fla" not in _loaded(code, preload=fresh.TORCH)


def test_loading_an_fla_checkpoint_imports_fla(tmp_path):
    """A DeltaNet checkpoint loads in a fresh interpreter: ``load_model`` imports fla, which registers its classes
    with transformers' Auto classes."""
    from statereduce.core.models import build_random, save_checkpoint
    from statereduce.core.tokenizer import byte_level_tokenizer

    arch = {"hidden_size": 32, "num_hidden_layers": 1, "num_heads": 2, "expand_k": 1.0, "expand_v": 1.0}
    save_checkpoint(build_random("delta_net", arch), byte_level_tokenizer(), tmp_path)
    assert "fla" in _loaded(f"from statereduce.core.models import load_model\nload_model({str(tmp_path)!r})\n",
                            preload=fresh.TORCH)


_MAMBA2 = {"hidden_size": 32, "num_hidden_layers": 1, "num_heads": 2, "head_dim": 32, "expand": 2, "n_groups": 1,
           "state_size": 8, "chunk_size": 16}


@pytest.mark.parametrize("record", sorted((ROOT / "docs" / "results").glob("job_startup_*.json")),
                         ids=lambda p: p.name)
def test_the_start_up_record_is_what_its_document_renders(record):
    md = record.with_suffix(".md")
    assert md.is_file() and md.read_text() == job_startup.markdown(json.loads(record.read_text())), \
        f"{md.name} differs from its JSON: rerun {json.loads(record.read_text())['command']}"
