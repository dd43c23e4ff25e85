"""Speed benchmarks without a GPU: settings, shapes, byte floors, ratios, tables, and the one-line no-CUDA error.

The measurements themselves run on a GPU (scripts/check_decode_gpu.py, python -m statereduce.speed; results
in docs/speed.md).
"""

import contextlib

import pytest
import _fresh as fresh
import torch
from _models import tiny_arch
from _paths import ROOT

from statereduce.analysis.tables import speed_markdown
from statereduce.common.settings import PrefillSettings
from statereduce.speed import bench as speed

DN = tiny_arch("delta_net", vocab_size=97)
GDN = tiny_arch("gated_deltanet", vocab_size=97)


def test_settings_defaults_are_the_papers_protocol():
    s = speed.speed_settings()
    assert s.decode.batches == [1, 2, 4, 8, 16, 32, 64]
    assert (s.decode.prompt, s.decode.warmup, s.decode.steps, s.decode.trials) == (512, 10, 100, 3)
    assert s.prefill.lengths == [2048, 8192, 16384] and s.mixer.seq_len == 2048
    assert speed.speed_settings({"decode": {"batches": [64]}}).decode.steps == 100  # merged key by key


@pytest.mark.parametrize("over,msg", [
    ({"decod": {}}, "unknown speed setting 'decod'; valid: pcts, dtype, blas, pdl, decode, prefill, mixer, profile"),
    ({"pdl": "yes"}, "speed pdl must be true or false; got 'yes'"),
    ({"blas": "cuBLAS"}, "unknown speed blas 'cuBLAS'; valid: cublas, cublaslt, or null for torch's default"),
    ({"decode": {"batch": [1]}}, r"unknown speed.decode setting\(s\) \['batch'\]"),
    ({"pcts": [100]}, r"speed pct 100 is outside \[0, 100\)"),
    ({"decode": {"kernels": ["cuda"]}}, r"unknown decode kernel 'cuda'; valid: fla, statereduce, fla_copy, fla\+fused"),
])
def test_bad_settings_fail_with_one_line(over, msg):
    with pytest.raises(ValueError, match=msg):
        speed.speed_settings(over)


@pytest.mark.parametrize("family,arch,d_k", [("delta_net", DN, 32), ("gated_deltanet", GDN, 32)])
def test_model_config_reduces_d_k_only(family, arch, d_k):
    from statereduce.adapters import adapter_class

    a = adapter_class(family)
    base, half, quarter = (speed.model_config(family, arch, p) for p in (0, 50, 75))
    assert [a.dims(c).head_k_dim for c in (base, half, quarter)] == [d_k, d_k // 2, d_k // 4]
    assert a.dims(half).head_v_dim == a.dims(base).head_v_dim
    with pytest.raises(ValueError, match="unknown arch key"):
        speed.model_config(family, {**arch, "hidden": 3})


def test_step_bytes_by_hand():
    config = speed.model_config("delta_net", DN, 50)
    model = speed.build_model(config, torch.float32, device="cpu")
    got = speed.step_bytes(model, config, "delta_net", batch=3)
    params = sum(p.numel() for p in model.parameters())
    emb = 97 * 64
    assert got["weights"] == 4 * (params - emb + 3 * 64)  # untied: the lm head is read whole, the embedding by row
    # per layer and sequence: state H * d_k' * d_v floats, conv caches (q, k, v channels) x width 4, read + written
    state, conv = 2 * 16 * 32, (2 * 16 + 2 * 16 + 2 * 32) * 4
    assert got["state"] == 2 * 3 * 2 * (state * 4 + conv * 4)
    assert got["logits"] == 3 * 97 * 4
    assert got["total"] == got["weights"] + got["state"] + got["logits"]


def _doc():
    def dec(pct, b, kernel, ms, total):
        return {"pct": pct, "batch": b, "kernel": kernel, "ms": ms, "floor_fraction": 0.5, "bytes": {"total": total},
                "peak_mem_bytes": 100, "peak_mem_delta_bytes": 10}

    return {"model": "m", "device": "GPU", "copy_bandwidth_Bps": 4e12, "settings": {"decode": {"prompt": 512}},
            "decode": [dec(0, 1, "fla", 2.0, 10), dec(0, 1, "statereduce", 1.8, 10), dec(50, 1, "fla", 1.0, 5),
                       dec(0, 64, "fla", 4.0, 40)],  # pct 50 at B=64 and 'ours' at pct 50 never measured
            "prefill": [{"pct": 0, "batch": 1, "length": 2048, "ms": 3.0, "peak_mem_bytes": 4,
                         "peak_mem_delta_bytes": 2},
                        {"pct": 50, "batch": 1, "length": 2048, "skipped": "out of memory"}],
            "mixer": []}


def test_ratios_and_table_show_missing_cells_as_missing():
    doc = _doc()
    doc["ratios"] = speed.speed_ratios(doc)
    (r,) = doc["ratios"]["decode"]
    assert (r["batch"], r["kernel"], r["speedup"], r["ideal_speedup"], r["speedup_vs_fla_baseline"]) == (1, "fla", 2.0,
                                                                                                        2.0, 2.0)
    assert doc["ratios"]["prefill"] == []  # the pruned cell was skipped: no ratio invented
    md = speed_markdown([doc])
    assert "| 1 | 2.000 | 50 | 2.00× | – | – | 2.00× | – |" in md
    assert "| 64 | 4.000 | 50 | – | – | – | – | – |" in md
    assert "| 1 × 2048 | 3.000 | – |" in md


def test_table_adds_fla_copy_columns_when_measured():
    doc = _doc()
    doc["decode"] += [{**doc["decode"][0], "kernel": "fla_copy", "ms": 3.0},
                      {**doc["decode"][2], "kernel": "fla_copy", "ms": 1.2}]
    doc["ratios"] = speed.speed_ratios(doc)
    md = speed_markdown([doc])
    assert "| B | base ms (fla) | base floor % | base ms (fla copy) | 50% fla copy | 50% fla | 50% ours |" in md
    assert "| 1 | 2.000 | 50 | 3.000 | 2.50× | 2.00× | – | – | 2.00× | – |" in md
    assert "| 64 | 4.000 | 50 | – | – | – | – | – | – | – |" in md
    assert "| 1 | 2.000 | 50 | 2.00× |" in speed_markdown([_doc() | {"ratios": speed.speed_ratios(_doc())}])


def test_fused_kernels_get_their_own_table_against_the_fused_fla_baseline():
    doc = _doc()
    doc["decode"] += [{**doc["decode"][0], "kernel": "fla+fused", "ms": 1.6},
                      {**doc["decode"][0], "kernel": "statereduce+fused", "ms": 1.5},
                      {**doc["decode"][2], "kernel": "statereduce+fused", "ms": 0.8}]
    doc["ratios"] = speed.speed_ratios(doc)
    (fused,) = [r for r in doc["ratios"]["decode"] if r["kernel"] == "statereduce+fused"]
    # against the fused baseline with fla's kernel (1.6 ms), not the stock one (2.0 ms)
    assert (fused["speedup"], fused["speedup_vs_fla_baseline"]) == (1.5 / 0.8, 2.0)
    md = speed_markdown([doc])
    assert "| 1 | 2.000 | 50 | 2.00× | – | – | 2.00× | – |" in md  # the stock table is unchanged
    assert "| B | base ms (fla fused) | base floor % | 50% fla fused | 50% ours fused |" in md
    assert "| 1 | 1.600 | 50 | – | 1.88× | 2.00× | 2.00× | 50 |" in md


def test_prefill_table_adds_device_columns_when_profiled():
    doc = _doc()
    doc["prefill"] = [{"pct": 0, "batch": 8, "length": 2048, "ms": 4.0, "device_ms": 3.0},
                      {"pct": 50, "batch": 8, "length": 2048, "ms": 2.0, "device_ms": 2.0},
                      {"pct": 0, "batch": 1, "length": 2048, "ms": 3.0}]
    doc["ratios"] = speed.speed_ratios(doc)
    md = speed_markdown([doc])
    assert "| B × T | base ms | base device ms | 50% | 50% device |" in md
    assert "| 8 × 2048 | 4.000 | 3.000 | 2.00× | 1.50× |" in md
    assert "| 1 × 2048 | 3.000 | – | – | – |" in md  # never profiled, never invented


def test_time_call_measures_memory_eagerly_before_the_graph(monkeypatch):
    events = []

    @contextlib.contextmanager
    def peak(cell):
        events.append("mem+")
        yield
        events.append("mem-")
        cell["peak_mem_bytes"] = 1

    def graphed(fn):
        events.append("capture")
        return lambda: events.append("replay")

    def time_ms(call, *, warmup, steps, trials):
        call()
        return [1.0, 2.0, 3.0]

    monkeypatch.setattr(speed, "_peak_memory", peak)
    monkeypatch.setattr(speed, "graphed", graphed)
    monkeypatch.setattr(speed, "time_ms", time_ms)
    monkeypatch.setattr(speed, "device_ms", lambda fn: 0.5)
    settings = PrefillSettings(warmup=1, steps=2, trials=3, graph=True, profile=True)
    cell = {}
    speed._time_call(lambda: events.append("eager"), settings, cell)
    # two warm-ups (autotuning), one eager call under the memory probe, then the graph is captured and replayed
    assert events == ["eager", "eager", "mem+", "eager", "mem-", "capture", "replay"]
    assert cell == {"peak_mem_bytes": 1, "graph": True, "ms": 2.0, "trials_ms": [1.0, 2.0, 3.0], "device_ms": 0.5}

    def refuses(fn):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    monkeypatch.setattr(speed, "graphed", refuses)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    events.clear()
    cell = {}
    speed._time_call(lambda: events.append("eager"), settings.replace(profile=False), cell)
    assert events[-1] == "eager" and cell["graph"] is False  # timed eagerly, and the cell says why
    assert cell["graph_error"] == "operation not permitted when stream is capturing" and "device_ms" not in cell


def test_cli_without_cuda_fails_with_one_line(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = fresh.run(["-m", "statereduce.speed.bench", str(tmp_path / "s.json"), "--family", "delta_net"],
                    preload=fresh.TORCH)
    assert out.returncode == 2
    err = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert err == [("error: speed benchmarks need a CUDA GPU and this machine has none (torch.cuda.is_available() is "
                    "False); run them on a GPU node (resources: gpu=1), e.g. python -m statereduce.speed ...")]
    assert not (tmp_path / "s.json").exists()


def test_cli_reads_the_config_of_the_current_directory_or_of_config(tmp_path):
    """``--model`` names come from ``config.yaml`` in the current directory, or the file ``--config`` names; a
    missing file or an unknown model fails with one line before any GPU is needed."""
    import shutil

    repo_config = ROOT / "config.yaml"
    cli = ["-m", "statereduce.speed", str(tmp_path / "s.json"), "--model", "tiny-dn"]

    def errors(*extra):
        out = fresh.run([*cli, *extra], cwd=tmp_path, preload=fresh.TORCH)
        assert out.returncode == 2
        return [line for line in out.stderr.splitlines() if line.startswith("error:")]

    assert errors() == ["error: workflow config 'config.yaml' not found; pass the workflow's config.yaml as "
                        "--config PATH"]
    assert errors("--config", "nowhere.yaml") == ["error: workflow config 'nowhere.yaml' not found; pass the "
                                                  "workflow's config.yaml as --config PATH"]
    shutil.copy(repo_config, tmp_path / "config.yaml")
    bad = errors("--model", "tiny-xx")[0]
    assert bad.startswith("error: unknown model 'tiny-xx' in 'config.yaml'; valid: ") and "tiny-dn" in bad
    if not torch.cuda.is_available():  # the config was read: the next thing missing is the GPU
        assert errors() == errors("--config", str(repo_config)) != []
        assert "CUDA" in errors()[0]
    family, arch, settings = speed.workflow_model("tiny-dn", repo_config, {"pcts": [50]})
    assert family == "delta_net" and arch["hidden_size"] > 0 and settings.pcts == [50]


def test_speedup_figure_writes_png(tmp_path):
    from statereduce.analysis.figures import speedup_figure

    doc = _doc()
    doc["ratios"] = speed.speed_ratios(doc)
    out = speedup_figure([doc], tmp_path / "f.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc["prefill"][1] = {"pct": 50, "batch": 1, "length": 2048, "ms": 2.0, "peak_mem_bytes": 4,
                         "peak_mem_delta_bytes": 2}
    doc["ratios"] = speed.speed_ratios(doc)
    both = speedup_figure([doc], tmp_path / "g.png")
    import matplotlib.image

    # the prefill panel appears only when a prefill ratio exists
    assert matplotlib.image.imread(both).shape[1] > 1.5 * matplotlib.image.imread(out).shape[1]


def test_prune_triton_cache_keeps_loadable_kernels_and_drops_broken_groups(tmp_path):
    import importlib.util
    import json

    path = ROOT / "dev" / "prune_triton_cache.py"
    spec = importlib.util.spec_from_file_location("prune_triton_cache", path)
    prune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prune)

    def kernel(name, files):
        d = tmp_path / name
        d.mkdir()
        for f in files:
            (d / f).write_text("x")
        group = {f"k.{ext}": str(d / f"k.{ext}") for ext in ("source", "ttir", "llir", "ptx", "cubin", "json")}
        (d / "__grp__k.json").write_text(json.dumps({"child_paths": group}))
        return d

    whole = kernel("A", ["k.source", "k.ttir", "k.llir", "k.ptx", "k.cubin", "k.json", "k.autotune.json"])
    broken = kernel("B", ["k.source", "k.json"])  # its cubin was lost: the group must not claim a cache hit
    assert prune.prune(tmp_path) == (1, 1)
    assert sorted(p.name for p in whole.iterdir()) == ["__grp__k.json", "k.autotune.json", "k.cubin", "k.json"]
    assert sorted(p.name for p in broken.iterdir()) == ["k.json"]


def test_interleaved_prefill_rotates_the_order_and_takes_per_round_ratios():
    """scripts/prefill_interleaved.py: every round times each model once, the order rotated every round, and
    the speedup is the median of per-round ratios, so a drift that slows every model alike cancels."""
    import importlib.util

    path = ROOT / "scripts" / "prefill_interleaved.py"
    spec = importlib.util.spec_from_file_location("prefill_interleaved", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    order, clock = [], iter(range(100))
    cost = {0: 2.0, 50: 1.6, 75: 1.25}

    def timer(fn, *, warmup, steps, trials):
        order.append(fn())
        return [cost[order[-1]] * (1 + next(clock) / 10)]  # the device slows down call after call

    ms = mod.rounds_of({p: (lambda p=p: p) for p in cost}, rounds=6, steps=5, timer=timer)
    assert order[:9] == [0, 50, 75, 50, 75, 0, 75, 0, 50]
    assert all(len(v) == 6 for v in ms.values())
    got = mod.speedups(ms, 0)
    assert set(got) == {50, 75}
    # a drift of 10 % per call: per-round ratios stay within the drift of two neighbouring calls of the true
    # 1.25 and 1.6, and their median is closer than the sequential order's (all baseline calls first) would be
    assert abs(got[50]["speedup"] - 1.25) < 0.1 and abs(got[75]["speedup"] - 1.6) < 0.16
    sequential = mod.speedups({p: [cost[p] * (1 + (i * 6 + r) / 10) for r in range(6)]
                               for i, p in enumerate(cost)}, 0)
    assert sequential[75]["speedup"] < got[75]["speedup"] - 0.3


def test_interleaved_prefill_reads_the_config_it_is_given(tmp_path, capsys):
    """scripts/prefill_interleaved.py looks its models up in ``--config`` and fails with one line without it."""
    import importlib.util

    path = ROOT / "scripts" / "prefill_interleaved.py"
    spec = importlib.util.spec_from_file_location("prefill_interleaved", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    missing = tmp_path / "none.yaml"
    assert mod.main([str(tmp_path / "p.json"), "tiny-dn", "--config", str(missing)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert err == [f"error: workflow config {str(missing)!r} not found; pass the workflow's config.yaml as "
                   "--config PATH"]
    assert not (tmp_path / "p.json").exists()


def test_every_family_declares_its_decode_route_and_an_undeclared_one_is_refused():
    """Decode routes are per-family facts: each registered family names its route (fla's in-place ones, or
    StockDecode), and a family without one fails in one line instead of decoding unrouted."""
    from statereduce.families import family_names
    from statereduce.speed import inplace  # noqa: F401  (imports the modules that register routes)
    from statereduce.speed.fla_decode import FlaRoute
    from statereduce.speed.routes import StockDecode, registered_route

    routes = {family: type(registered_route(family)) for family in family_names()}
    assert routes["mamba2"] is routes["qwen3_5"] is StockDecode
    assert all(issubclass(routes[f], FlaRoute) for f in ("delta_net", "gated_deltanet")), routes
    with pytest.raises(ValueError, match=r"^family 'rwkv7' declares no decode route; routed: delta_net, "):
        registered_route("rwkv7")
