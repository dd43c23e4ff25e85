"""The ``generate()`` benchmark (:mod:`statereduce.speed.generate`) on CPU with tiny random models: ``generate``
against greedy decoding by full forwards (fla's models need the cache alias), the prefill in sub-batches against one
``generate`` call, the byte counts against the cache tensors and the config, the largest-batch arithmetic, the
scaled allocation, the document's schema and ratios (a whole run on CPU) and bad input. ``-m gpu`` runs a tiny
model's cells on CUDA with fla's kernels."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
import yaml
from _models import tiny_arch
from _paths import ROOT

from statereduce.adapters import adapter_class
from statereduce.speed import bench
from statereduce.speed import generate as gen

FAMILIES = ["delta_net", "gated_deltanet", "qwen3_5"]


def _model(family, pct=0, device="cpu", dtype=torch.float32, **arch):
    config = bench.model_config(family, tiny_arch(family, **arch), pct)
    model = bench.build_model(config, dtype, device)
    gen.install_cache_alias(model)
    return model, config


def _greedy(model, ids, steps):
    seq = ids
    with torch.no_grad():
        for _ in range(steps):
            seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return seq


def _tensors_by_kind(cache):
    """The cache's tensors read straight from its layers (fla's state dicts, transformers' keys/values and state
    dicts), independently of the module's slots."""
    out = {"recurrent": [], "conv": [], "attention": []}
    for layer in cache.layers:
        state = getattr(layer, "state", None)
        if isinstance(state, dict):
            for key, kind in (("recurrent_state", "recurrent"), ("conv_state", "conv"), ("attn_state", "attention")):
                value = state.get(key)
                out[kind] += [value] if isinstance(value, torch.Tensor) else list(value or [])
            continue
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor) and t.numel():
                out["attention"].append(t)
        out["conv"] += [t for t in getattr(layer, "conv_states", {}).values() if t is not None]
        out["recurrent"] += [t for t in getattr(layer, "recurrent_states", {}).values() if t is not None]
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_matches_greedy_decoding_and_the_prefill_in_sub_batches(family):
    """With the cache alias ``generate`` continues from the prompt's state (without it fla's models restart from an
    empty state at each step); prefilling 2 sequences a forward gives the same tokens as one call."""
    model, _ = _model(family, pct=50)
    ids = torch.randint(300, (3, 70), generator=torch.Generator().manual_seed(1))  # past fla's 64-token chunk switch
    ref = _greedy(model, ids, 5)
    whole = gen.time_generate(model, 3, 70, 5, seed=0)
    assert whole["sequences"].shape == (3, 75)
    gen_ids = whole["sequences"][:, :70]
    torch.testing.assert_close(whole["sequences"], _greedy(model, gen_ids, 5), rtol=0, atol=0)
    chunked = gen.time_generate(model, 3, 70, 5, per_chunk=2, seed=0)
    assert torch.equal(chunked["sequences"], whole["sequences"])
    assert chunked["cache_bytes"] == whole["cache_bytes"]
    assert 0 < chunked["ttft_s"] <= chunked["total_s"]
    assert ref.shape == (3, 75)
    assert gen.install_cache_alias(model) is False  # once is enough


def test_without_the_alias_fla_generate_loses_the_state():
    config = bench.model_config("delta_net", tiny_arch("delta_net"))
    model = bench.build_model(config, torch.float32, "cpu")
    ids = torch.randint(300, (2, 70), generator=torch.Generator().manual_seed(2))
    kwargs = gen._generate_kwargs(model, 4)
    with torch.no_grad():
        stock = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    if "cache" in __import__("inspect").signature(model.forward).parameters:
        pytest.skip("this fla takes cache= itself")
    assert gen.output_cache(stock).get_seq_length() == 1  # each step starts a new cache
    assert gen.install_cache_alias(model)
    with torch.no_grad():
        fixed = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    assert gen.output_cache(fixed).get_seq_length() == 73 and torch.equal(fixed.sequences, _greedy(model, ids, 4))


@pytest.mark.parametrize("family", FAMILIES)
def test_byte_counts_are_the_cache_tensors_and_the_config(family):
    model, config = _model(family, pct=50)
    out = gen.time_generate(model, 3, 70, 4)
    with torch.no_grad():
        cache = gen.output_cache(model.generate(out["sequences"][:, :70], attention_mask=torch.ones(3, 70).long(),
                                                **gen._generate_kwargs(model, 4)))
    counted = gen.cache_bytes(cache)
    tensors = _tensors_by_kind(cache)
    for kind, ts in tensors.items():
        assert counted[kind] == sum(t.numel() * t.element_size() for t in ts), kind
    assert counted["batch"] == 3 and counted == out["cache_bytes"]
    held = counted["attention_tokens"]
    assert held == (73 if family == "qwen3_5" else 0)  # the last token is not fed back
    from_config = gen.config_cache_bytes(family, config, held, torch.float32)
    assert {k: 3 * from_config[k] for k in ("recurrent", "conv", "attention")} == {
        k: counted[k] for k in ("recurrent", "conv", "attention")}
    assert from_config["recurrent"] == adapter_class(family).config_state_bytes(config)
    per = gen.per_sequence(counted)
    assert per["state"] == (counted["recurrent"] + counted["conv"]) / 3
    assert per["attention_per_token"] == (counted["attention"] / 3 / 73 if family == "qwen3_5" else 0)


def test_pure_linear_state_does_not_grow_with_context_and_attention_does():
    for family in ("delta_net", "qwen3_5"):
        model, _ = _model(family)
        sizes = []
        for length in (20, 90):
            with torch.no_grad():
                sizes.append(gen.cache_bytes(gen.output_cache(model(torch.ones(1, length).long(), use_cache=True))))
        assert sizes[0]["recurrent"] + sizes[0]["conv"] == sizes[1]["recurrent"] + sizes[1]["conv"]
        if family == "qwen3_5":
            assert sizes[1]["attention"] == sizes[0]["attention"] * 90 // 20 and sizes[1]["attention_tokens"] == 90
        else:
            assert sizes[0]["attention"] == sizes[1]["attention"] == 0


def test_a_cell_that_does_not_fit_prefills_in_halving_sub_batches_or_is_skipped(monkeypatch):
    model, _ = _model("delta_net")
    real, tried = gen.time_generate, []

    def fits_at(limit):
        def fake(model, batch, prompt, new_tokens, *, per_chunk=None, seed=0):
            tried.append(per_chunk)
            if per_chunk is None or per_chunk > limit:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 9 GiB")
            return real(model, batch, prompt, new_tokens, per_chunk=per_chunk, seed=seed)
        return fake

    monkeypatch.setattr(gen, "time_generate", fits_at(2))
    cell = gen.measure_cell(model, 5, 12, 2, trials=1, per_chunk=None, prefill_tokens=48)
    # each plan first warms up at its own shapes (where it runs out of memory), then the plan that fits is timed
    assert tried == [None, 3, 1, 1] and (cell["prefill_chunks"], cell["sequences_per_prefill"]) == (5, 1)
    assert cell["warmup_s"] >= 0
    assert [n.split(" (")[0] for n in cell["fallback"]] == ["out of memory with one generate call",
                                                             "out of memory with 3 sequences a prefill forward"]
    tried.clear()
    monkeypatch.setattr(gen, "time_generate", fits_at(0))
    cell = gen.measure_cell(model, 4, 12, 2, trials=1, per_chunk=2, prefill_tokens=48, warmup=False)
    assert tried == [2, 1] and cell["skipped"].startswith("out of memory with 2 sequences a prefill forward")
    assert "total_s" not in cell


def test_max_batch_arithmetic():
    assert gen.max_batch(100, 20, 8) == 10
    assert gen.max_batch(100, 20, 8, multiple=4) == 8
    assert gen.max_batch(100, 20, 81) == 0
    assert gen.max_batch(100, 120, 1) == 0
    assert gen.max_batch(40 * gen.GIB, 2.8e9, 26.4e6, 16) == (40 * gen.GIB - 2.8e9) // 26.4e6 // 16 * 16
    with pytest.raises(ValueError, match="per-sequence bytes must be positive"):
        gen.max_batch(1, 0, 0)


def test_a_budget_cell_adds_the_attention_of_context_plus_new_tokens():
    record = {"weights_bytes": 1000, "cache": {"100": {"measured": {
        "recurrent": 64, "conv": 16, "attention": 200, "other": 0, "batch": 1, "attention_tokens": 100}}}}
    settings = gen.GenerateSettings.from_dict({"budget_gib": 4000 / gen.GIB, "budget_new_tokens": 20,
                                               "budget_multiple": 2, "contexts": [100], "budget_max_batch": 4})
    cell = gen._budget_cell(None, "base", record, 100, settings, 4000)
    assert cell["per_sequence_bytes"] == 80 + 2 * 120 and cell["tokens_held"] == 120
    assert cell["max_batch"] == (4000 - 1000) // 320 // 2 * 2 == 8
    assert (cell["batch"], cell["capped"]) == (4, True)
    assert cell["predicted_resident_bytes"] == 1000 + 4 * 320


def _shipped(name):
    cfg = yaml.safe_load((ROOT / "config.yaml").read_text())
    return gen.generate_plan(cfg["models"][name], cfg.get("speed"), name=name)


def test_scaled_allocation_keeps_the_uniform_total_and_the_blocks():
    dn = _shipped("dn1.3b")
    out = gen.scale_allocation({"allocation": {"widths": [32, 56, 16, 24]}, "d_k": 64, "pct": 50}, dn["family"],
                               dn["arch"])
    assert out["widths"] == [64] * 6 + [112] * 6 + [32] * 6 + [48] * 6  # exact: d_k 128 / 64 = 2
    assert (out["source_widths"], out["source_d_k"], out["pct"]) == ([32, 56, 16, 24], 64, 50.0)
    gdn = _shipped("gdn1.3b")  # 21 layers in blocks of 5, 5, 5, 6; d_k 256
    out = gen.scale_allocation({"widths": [40, 32, 32, 24], "d_k": 64, "pct": 50}, gdn["family"], gdn["arch"])
    w = out["widths"]
    assert sum(w) == 21 * 128 and all(x % 16 == 0 for x in w)
    # 160, 128, 128, 96 per block sum to 2656: the two layers that lost most to rounding... all lost nothing, so the
    # lowest layers take the missing 32
    assert w == [176, 176, 160, 160, 160] + [128] * 10 + [96] * 6
    with pytest.raises(ValueError, match="needs its widths"):
        gen.scale_allocation({"d_k": 64}, dn["family"], dn["arch"])


def test_plan_of_the_shipped_models_and_the_paper_scale_hybrid():
    assert _shipped("dn1.3b") == {"family": "delta_net", "arch": {
        "expand_k": 1.0, "expand_v": 1.0, "hidden_size": 2048, "num_heads": 16, "num_hidden_layers": 24,
        "vocab_size": 32000}, "pcts": [50, 75], "dtype": "bfloat16"}
    plan = gen.workflow_plan("qwen35-9b-init", [ROOT / "config.yaml", ROOT / "configs" / "gpu_paper_scale.yaml"])
    assert (plan["family"], plan["arch"], plan["pcts"]) == ("qwen3_5", {"vocab_size": 248320}, [50])
    with pytest.raises(ValueError, match="has no architecture for speed runs"):
        gen.generate_plan({"family": "qwen3_5", "hub": {"id": "x"}}, name="qwen35-9b")


SMALL = {"prompt": 70, "new_tokens": 3, "batches": [1, 2], "warmup_prompt": 8, "warmup_tokens": 2,
         "warmup_batches": [1], "contexts": [16, 40], "timed_contexts": [16], "budget_new_tokens": 2,
         "budget_multiple": 1, "budget_max_batch": 3, "prefill_tokens": 32, "dtype": "float32"}


@pytest.fixture(scope="module")
def hybrid_doc(tmp_path_factory):
    arch = tiny_arch("qwen3_5")
    budget = 1.5 * (gen.weight_bytes(_model("qwen3_5")[0]))  # room for some sequences beside the weights
    settings = gen.GenerateSettings.from_dict({**SMALL, "budget_gib": budget / gen.GIB, "pcts": [50]})
    path = tmp_path_factory.mktemp("gen") / "generate.json"
    doc = gen.run_generate("qwen3_5", arch, settings, path, model_name="tiny", device="cpu")
    return doc, path


def test_the_document_schema_and_its_ratios(hybrid_doc):
    doc, path = hybrid_doc
    assert json.loads(path.read_text()) == json.loads(json.dumps(doc))
    assert doc["kind"] == "generate" and doc["parts"] == ["table", "budget"] and doc["device"] == "cpu"
    assert list(doc["variants"]) == ["base", "50"]
    assert doc["variants"]["50"]["d_k"] == 16 and doc["variants"]["base"]["d_k"] == 32
    for v in doc["variants"].values():
        assert v["weights_bytes"] > 0 and set(v["cache"]) == {"16", "40"}
        assert all(c["matches_config"] for c in v["cache"].values())
    assert [(c["variant"], c["batch"]) for c in doc["table"]] == [("base", 1), ("base", 2), ("50", 1), ("50", 2)]
    for c in doc["table"]:
        assert c["prefill_chunks"] == 1 and c["total_s"] >= c["ttft_s"] > 0
        assert c["tokens_per_s"] == pytest.approx(c["batch"] * 3 / c["total_s"])
        assert c["decode_tokens_per_s"] == pytest.approx(c["batch"] * 2 / c["decode_s"])
        assert "peak_mem_bytes" not in c  # no CUDA memory figures on CPU
    base = {c["batch"]: c for c in doc["table"] if c["variant"] == "base"}
    for r in doc["ratios"]["table"]:
        cell = next(c for c in doc["table"] if (c["variant"], c["batch"]) == (r["variant"], r["batch"]))
        assert r["speedup"] == pytest.approx(base[r["batch"]]["total_s"] / cell["total_s"])
    budget = {(c["variant"], c["context"]): c for c in doc["budget"]}
    assert set(budget) == {(v, c) for v in ("base", "50") for c in (16, 40)}
    for (v, context), c in budget.items():
        measured = doc["variants"][v]["cache"][str(context)]["measured"]
        per_token = measured["attention"] / measured["attention_tokens"]
        assert c["per_sequence_bytes"] == pytest.approx(measured["recurrent"] + measured["conv"]
                                                        + per_token * (context + 2))
        assert c["max_batch"] == gen.max_batch(doc["budget_bytes"], c["weights_bytes"], c["per_sequence_bytes"])
        assert ("tokens_per_s" in c) == (context == 16 and c["max_batch"] > 0)
    assert budget[("50", 16)]["max_batch"] >= budget[("base", 16)]["max_batch"]  # a smaller state, more sequences
    timed = [c for c in doc["budget"] if "tokens_per_s" in c]
    assert timed and all(c["batch"] == min(3, c["max_batch"]) for c in timed)
    assert all(c["prefill_chunks"] == -(-c["batch"] // 2) for c in timed)  # 32 tokens a forward: 2 of 16
    rows = {r["context"]: r for r in doc["ratios"]["budget"]}
    assert rows[16]["batch_ratio"] == budget[("50", 16)]["max_batch"] / budget[("base", 16)]["max_batch"]


def test_the_byte_budget_from_the_config_equals_the_measured_one(hybrid_doc, tmp_path, capsys, monkeypatch):
    """``--bytes-only`` (no GPU): weights from a model on the meta device and cache bytes from the config give the
    measured run's largest batches."""
    doc, _ = hybrid_doc
    settings = gen.GenerateSettings.from_dict(doc["settings"])
    from_config = gen.budget_from_config("qwen3_5", tiny_arch("qwen3_5"), settings, model_name="tiny")
    pick = ("variant", "context", "weights_bytes", "per_sequence_bytes", "max_batch", "batch")
    assert [{k: c[k] for k in pick} for c in from_config["budget"]] == [{k: c[k] for k in pick} for c in doc["budget"]]
    assert from_config["device"] == "none" and "tokens_per_s" not in str(from_config["budget"])
    monkeypatch.chdir(ROOT)
    out = tmp_path / "bytes.json"
    assert gen.main([str(out), "--model", "tiny-qwen35", "--bytes-only", "--settings", '{"dtype": "float32"}']) == 0
    text = capsys.readouterr().out
    assert "byte counts of the config, nothing timed" in text
    assert "| largest batch | batch × | predicted GiB |\n" in text
    assert [c["context"] for c in json.loads(out.read_text())["budget"]] == [2048, 16384] * 3


def test_a_shorter_budget_prompt_for_a_pure_linear_model_only(tmp_path):
    """The timed budget cells of a model without attention KV may use a shorter prompt (its decode step does not
    depend on the prompt's length); a hybrid's are refused before anything is built."""
    arch = tiny_arch("delta_net")
    settings = gen.GenerateSettings.from_dict({**SMALL, "budget_gib": 0.01, "pcts": [], "budget_prompt": 8,
                                               "contexts": [16, 40], "timed_contexts": [40]})
    doc = gen.run_generate("delta_net", arch, settings, tmp_path / "g.json", parts=["budget"], device="cpu")
    timed = [c for c in doc["budget"] if "tokens_per_s" in c]
    assert [(c["context"], c["prompt"], c["batch"]) for c in timed] == [(40, 8, 3)] and not doc["table"]
    assert "(prompt 8)" in gen.budget_markdown(doc)
    with pytest.raises(ValueError, match="exact only for models whose cache holds no attention KV; tiny's grows"):
        gen.run_generate("qwen3_5", tiny_arch("qwen3_5"), settings, tmp_path / "q.json", device="cpu",
                         model_name="tiny")
    assert not (tmp_path / "q.json").exists()


def test_the_markdown_tables(hybrid_doc, capsys, tmp_path):
    doc, path = hybrid_doc
    assert all(c["warmup_s"] >= 0 for c in doc["table"])  # every cell warmed up at its own shapes first
    assert gen.main(["--tables", str(path)]) == 0
    text = capsys.readouterr().out
    assert "†" not in text
    old = json.loads(path.read_text())  # a document from before the per-cell warm-up: its first calls are marked
    del old["settings"]["cell_warmup"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    marked = gen.documents_markdown([tmp_path / "old.json"])
    assert marked.rstrip().endswith(gen.FIRST_USE_NOTE) and "| 1 | base |" in marked and "†" in marked
    assert "#### tiny: `generate()`, prompt 70, 3 new tokens (cpu, generate.json)" in text
    assert "| 1 | base |" in text and "| 2 | 50 % (d_k' 16) |" in text
    assert "#### tiny: largest batch at" in text and "| 40 | base |" in text and "not timed" in text


def test_ratios_of_a_planted_document():
    def cell(v, b, total, ttft, peak, chunks=1):
        return {"variant": v, "batch": b, "total_s": total, "ttft_s": ttft, "decode_tokens_per_s": b / (total - ttft),
                "peak_mem_bytes": peak, "prefill_chunks": chunks}

    doc = {"table": [cell("base", 4, 10.0, 2.0, 100), cell("50", 4, 5.0, 1.0, 50, chunks=2), cell("75", 8, 2, 1, 1)],
           "budget": [{"variant": "base", "context": 2048, "max_batch": 10, "tokens_per_s": 100.0},
                      {"variant": "50", "context": 2048, "max_batch": 25, "tokens_per_s": 150.0}]}
    ratios = gen.generate_ratios(doc)
    assert ratios["table"] == [pytest.approx({"variant": "50", "batch": 4, "speedup": 2.0, "ttft_speedup": 2.0,
                                              "decode_speedup": 2.0, "memory_ratio": 0.5, "prefill_differs": True})]
    assert ratios["budget"] == [{"variant": "50", "context": 2048, "batch_ratio": 2.5, "throughput_ratio": 1.5}]


def test_a_killed_run_resumes_with_the_missing_cells_only(tmp_path, monkeypatch):
    arch = tiny_arch("delta_net")
    budget = 1.5 * gen.weight_bytes(_model("delta_net")[0])
    settings = gen.GenerateSettings.from_dict({**SMALL, "budget_gib": budget / gen.GIB, "pcts": [50]})
    path = tmp_path / "generate.json"
    measured = []
    real = gen.measure_cell

    def measure(model, batch, prompt, *args, **kwargs):
        if stop_after is not None and len(measured) == stop_after:
            raise KeyboardInterrupt  # the call's time limit
        measured.append((sum(p.numel() for p in model.parameters()), batch, prompt))
        return real(model, batch, prompt, *args, **kwargs)

    monkeypatch.setattr(gen, "measure_cell", measure)
    stop_after = 4  # base's two table cells and its budget cell, then the pruned model's first table cell
    with pytest.raises(KeyboardInterrupt):
        gen.run_generate("delta_net", arch, settings, path, model_name="tiny", device="cpu")
    killed = json.loads(path.read_text())
    assert [(c["variant"], c["batch"]) for c in killed["table"]] == [("base", 1), ("base", 2), ("50", 1)]
    assert [c["variant"] for c in killed["budget"]] == ["base", "base"]  # 16 timed, 40 counted only
    stop_after, first = None, list(measured)
    doc = gen.run_generate("delta_net", arch, settings, path, model_name="tiny", device="cpu", resume=True)
    pruned = next(c for c in doc["budget"] if c["variant"] == "50" and c["context"] == 16)
    assert measured[len(first):] == [(first[3][0], 2, 70), (first[3][0], pruned["batch"], 16)]  # the 50 % model's
    assert doc["runs"] == 2 and json.loads(path.read_text())["runs"] == 2
    assert sorted((c["variant"], c["batch"]) for c in doc["table"]) == [("50", 1), ("50", 2), ("base", 1), ("base", 2)]
    assert sorted((c["variant"], c["context"]) for c in doc["budget"]) == [("50", 16), ("50", 40), ("base", 16),
                                                                          ("base", 40)]
    assert doc["table"][:3] == killed["table"] and {r["batch"] for r in doc["ratios"]["table"]} == {1, 2}
    assert gen.run_generate("delta_net", arch, settings, path, model_name="tiny", device="cpu",
                            resume=True)["runs"] == 3 and len(measured) == 6  # nothing left to measure
    other = gen.GenerateSettings.from_dict({**settings.to_dict(), "new_tokens": 4})
    with pytest.raises(ValueError, match=r"^--resume: .*generate.json was measured with another settings .*mix two"):
        gen.run_generate("delta_net", arch, other, path, model_name="tiny", device="cpu", resume=True)
    monkeypatch.setattr(gen, "machine_id", lambda device: "elsewhere/cpu")
    with pytest.raises(ValueError, match=r"another machine \('.*/cpu'; this run: 'elsewhere/cpu'\)"):
        gen.run_generate("delta_net", arch, settings, path, model_name="tiny", device="cpu", resume=True)
    assert json.loads(path.read_text())["runs"] == 3  # a refused resume leaves the document as it was


def test_the_summary_over_a_timed_table_and_an_untimed_budget(hybrid_doc, tmp_path):
    doc, path = hybrid_doc
    table_only = {**doc, "budget": [], "model": "m"}
    budget_only = {**doc, "table": [], "device": "none", "model": "m",
                   "budget": [{k: v for k, v in c.items() if k not in ("tokens_per_s", "decode_tokens_per_s")}
                              for c in doc["budget"]]}
    (tmp_path / "t.json").write_text(json.dumps(table_only))
    (tmp_path / "b.json").write_text(json.dumps(budget_only))
    text = gen.summary_markdown([tmp_path / "t.json", tmp_path / "b.json"])
    ratios = {(r["variant"], r["batch"]): r for r in gen.generate_ratios(doc)["table"]}
    batches = sorted({c["batch"] for c in doc["table"]})
    budget = {(c["variant"], c["context"]): c for c in doc["budget"]}
    contexts = sorted({c["context"] for c in doc["budget"]})
    rows = [line for line in text.splitlines() if line.startswith("| m |")]
    assert [r.split(" | ")[1] for r in rows] == [gen._variant_label(doc, v) for v in doc["variants"]]
    row = rows[1].strip("| ").split(" | ")  # the first pruned variant: one model row from two documents
    name = list(doc["variants"])[1]
    assert row[2:2 + len(batches)] == [f"{ratios[(name, b)]['speedup']:.2f}×" for b in batches]
    base_batch = budget[("base", contexts[0])]["max_batch"]
    assert row[4 + len(batches)] == (f"{budget[(name, contexts[0])]['max_batch']:,} "
                                     f"({budget[(name, contexts[0])]['max_batch'] / base_batch:.2f}×)")
    assert row[-1] == "not timed"  # the budget came from the untimed document
    assert "Sources: m: table t.json (cpu); budget b.json (byte counts, untimed)." in text and "†" not in text


def test_the_summary_takes_a_models_variants_from_several_table_documents(hybrid_doc, tmp_path):
    doc, _ = hybrid_doc
    base_total = {c["batch"]: c["total_s"] for c in doc["table"] if c["variant"] == "base"}
    pruned_total = {c["batch"]: c["total_s"] for c in doc["table"] if c["variant"] == "50"}
    partial = {**doc, "budget": [], "table": [c for c in doc["table"] if c["batch"] == 1]}  # 50 % at B = 1 only
    slower_base = {**doc, "table": [dict(c, total_s=c["total_s"] * (3 if c["variant"] == "base" else 1))
                                    for c in doc["table"]]}  # another run, its own base
    renamed = {**doc, "budget": [], "variants": {"base": doc["variants"]["base"],
                                                 "75": {**doc["variants"]["50"], "d_k": 8}},
               "table": [dict(c, variant="75" if c["variant"] == "50" else "base") for c in doc["table"]]}
    for name, d in (("a.json", partial), ("b.json", slower_base), ("c.json", renamed)):
        (tmp_path / name).write_text(json.dumps({**d, "model": "m"}))
    text = gen.summary_markdown([tmp_path / n for n in ("a.json", "b.json", "c.json")])
    rows = {r.split(" | ")[1]: r.strip("| ").split(" | ") for r in text.splitlines() if r.startswith("| m |")}
    assert list(rows) == ["base", "50 % (d_k' 16)", "75 % (d_k' 8)"]
    assert rows["base"][2:4] == ["1.00×", "1.00×"]
    # 50 %: the document with both of its cells, against that run's (slower) base; 75 %: its own run's base
    assert rows["50 % (d_k' 16)"][2:4] == [f"{3 * base_total[b] / pruned_total[b]:.2f}×" for b in (1, 2)]
    assert rows["75 % (d_k' 8)"][2:4] == [f"{base_total[b] / pruned_total[b]:.2f}×" for b in (1, 2)]
    assert rows["50 % (d_k' 16)"][6] != "–" and rows["75 % (d_k' 8)"][6] == "–"  # the budget of b.json only
    assert "Sources: m: table a.json (cpu); table b.json (cpu); table c.json (cpu); budget b.json (cpu)." in text
    (tmp_path / "d.json").write_text(json.dumps({**renamed, "model": "m", "variants": {
        **doc["variants"], "50": {**doc["variants"]["50"], "d_k": 8}}}))
    with pytest.raises(ValueError, match=r"^--summary: variant '50' of m has other widths in b.json, d.json; "):
        gen.summary_markdown([tmp_path / "b.json", tmp_path / "d.json"])


def test_the_generated_doc_blocks_are_what_their_commands_print(tmp_path):
    blocks = _dev_module("doc_blocks")
    assert blocks.pages(), "no docs page holds a generated block"
    assert blocks.main(["--check"]) == 0  # every committed page
    page = next(p for p in blocks.pages() if "--summary" in p.read_text())
    text = page.read_text()
    planted = tmp_path / page.name
    first = next(line for line in text.splitlines() if line.startswith("| ") and "×" in line)
    planted.write_text(text.replace(first, first.replace("×", "x", 1), 1))
    assert blocks.rewrite(planted)[0] == text and blocks.rewrite(planted)[1] == []
    bad = tmp_path / "bad.md"
    bad.write_text("<!-- generated: rm -rf / -->\nkept\n<!-- /generated -->\n<!-- generated: python -m "
                   "statereduce.speed.generate --summary nowhere.json -->\nkept\n<!-- /generated -->\n"
                   "<!-- generated: python -m statereduce.serve check a=b -->\nkept\n<!-- /generated -->\n"
                   "<!-- generated: python -m statereduce.serve tables nowhere.json -->\nkept\n<!-- /generated -->\n")
    out, problems = blocks.rewrite(bad)
    assert out == bad.read_text() and len(problems) == 4
    assert "is neither `python -m statereduce.speed.generate" in problems[0]
    assert "nowhere.json not found" in problems[1] and "nowhere.json not found" in problems[3]
    assert "is not `python -m statereduce.serve tables DOC.json`" in problems[2]
    serving = next(p for p in blocks.pages() if "<!-- generated: python -m statereduce.serve tables" in p.read_text())
    text = serving.read_text()
    served = next(line for line in text.splitlines() if line.startswith("| ") and " of 8 |" in line)
    planted = tmp_path / serving.name
    planted.write_text(text.replace(served, served.replace(" of 8 |", " of 9 |", 1), 1))
    assert blocks.rewrite(planted) == (text, [])


def _dev_module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "dev" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("args, message", [
    (["o.json", "--model", "dn1.3b", "--batches", "0,16"], "--batches '0,16': '0' is not a positive integer"),
    (["o.json", "--model", "dn1.3b", "--batches", "x"], "--batches 'x': 'x' is not a positive integer"),
    (["o.json", "--model", "dn1.3b", "--settings", '{"batches": [1, 2.5]}'],
     "generate batches: 2.5 is not a positive integer"),
    (["o.json", "--model", "dn1.3b", "--settings", '{"trials": 0}'], "generate trials=0 must be a positive integer"),
    (["o.json", "--model", "dn1.3b", "--settings", '{"budget_gib": -1}'], "generate budget_gib=-1 must be a positive"),
    (["o.json", "--model", "dn1.3b", "--settings", '{"batch": [1]}'], "unknown generate setting(s) ['batch']"),
    (["o.json", "--model", "nope"], "unknown model 'nope' in config.yaml; valid: codestral7b, dn1.3b,"),
    (["o.json", "--model", "dn1.3b", "--parts", "table,decode"], "unknown --parts ['decode']; valid: table, budget"),
    (["o.json", "--model", "dn1.3b", "--recipe", "r=missing.json"], "--recipe file 'missing.json' not found"),
    (["o.json", "--model", "dn1.3b", "--key-dims", "w=8,8"], "key_dims has 2 widths; the delta_net model has 24"),
    (["o.json"], "give --model NAME (a model of the workflow config) or --family with --arch"),
    (["--tables", "missing.json"], "--tables: 'missing.json' not found"),
    (["--summary", "missing.json"], "--summary: 'missing.json' not found"),
    (["o.json", "--model", "dn1.3b"], "speed benchmarks need a CUDA GPU and this machine has none"),
], ids=["zero-batch", "word-batch", "float-batch", "trials", "budget", "unknown-setting", "unknown-model", "part",
        "recipe-file", "key-dims", "no-model", "tables", "summary", "no-cuda"])
def test_bad_input_fails_in_one_line(args, message, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gen.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and message in err[-1], err[-1]


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_generate_cells_on_gpu(family, tmp_path):
    """A tiny model's table and budget cells on CUDA with fla's kernels (bf16): the prefill in sub-batches gives the
    first token one ``generate`` call gives, and every cell records peak memory."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model, _ = _model(family, device="cuda", dtype=torch.bfloat16)
    one = gen.time_generate(model, 4, 96, 3)
    chunked = gen.time_generate(model, 4, 96, 3, per_chunk=2)
    assert torch.equal(one["sequences"][:, :97], chunked["sequences"][:, :97])
    settings = gen.GenerateSettings.from_dict({**SMALL, "dtype": "bfloat16", "budget_gib": 0.05, "pcts": [50]})
    doc = gen.run_generate(family, tiny_arch(family), settings, tmp_path / "g.json")
    assert all("peak_mem_bytes" in c for c in doc["table"])
