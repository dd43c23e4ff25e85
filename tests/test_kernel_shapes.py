"""The routing of head shapes that stock fla mishandles on CUDA (statereduce.kernels.shapes).

* the rule in ``FAULTY`` agrees with every case of the recorded GPU sweep (docs/results/fla_shapes_h200.json):
  faulty exactly where stock fla was wrong or faulted, and the padded calls the sweep ran were right;
* the zero-padded call equals the unpadded one (output, final state, every gradient) for all four delta-rule kernels,
  and the float64 per-step recurrence (statereduce.kernels.reference, as in the sweep script), with q and k padded,
  v padded, or both (grouped value heads and the value-first state layout too);
* the sweep script's values grid (value cuts of the ratio grid and the joint cuts), its padding specs, its padded
  follow-up cases and its status of fla's refusals, and one case of each kind run on the torch kernels;
* the guard sends faulty shapes (and only those) through the padded call, leaves calls that fla_fallback routes to
  torch alone, and the DeltaNet / Gated DeltaNet adapters install it when a model is loaded;
* prune_record.json says whether the pruned shape is one stock fla mishandles.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import json

import pytest
import torch
import torch.nn.functional as F
from _paths import ROOT

from statereduce.kernels import fla_fallback, shapes
from statereduce.kernels.reference import delta_rule

SWEEP = ROOT / "docs" / "results" / "fla_shapes_h200.json"
ROUTED = ROOT / "docs" / "results" / "shapes_routed_h200.json"
_spec = importlib.util.spec_from_file_location("sweep_fla_shapes", ROOT / "scripts" / "sweep_fla_shapes.py")
sweep_fla_shapes = importlib.util.module_from_spec(_spec)  # the sweep script: its kernels and its grid of key widths
_spec.loader.exec_module(sweep_fla_shapes)

KERNEL_OF = {(f, k): name for (f, k), name in sweep_fla_shapes.KERNELS.items()}


def _sweep() -> dict:
    return json.loads(SWEEP.read_text())


def test_sweep_covers_the_ratio_grid():
    doc = _sweep()
    widths = sweep_fla_shapes.key_widths([64, 128, 256], [25, 50, 75, 87.5])
    assert tuple(widths) == shapes.SWEPT_D_K == tuple(doc["key_widths"])
    assert tuple(doc["d_v"]) == shapes.SWEPT_D_V
    stock = {(c["family"], c["kernel"], c["d_k"], c["d_v"]) for c in doc["cases"] if not c["padded"]}
    assert stock == {(f, k, dk, dv) for (f, k) in KERNEL_OF for dk in widths for dv in doc["d_v"]}
    # the script's default (keys) grid is the recorded one: its stock and padded cases
    meta, cases, padded = sweep_fla_shapes.keys_grid_cases(sweep_fla_shapes.parser().parse_args(["out.json"]))
    assert meta == {k: doc[k] for k in ("d_k", "pcts", "key_widths", "d_v")}
    assert {c[:4] for c in cases} == stock and not any(c[4] for c in cases)
    assert {c[:4] for c in padded} == {c[:4] for c in _recorded(doc, padded=True)} and all(c[4] for c in padded)


def _recorded(doc: dict, padded: bool) -> list[tuple]:
    return [(c["family"], c["kernel"], c["d_k"], c["d_v"]) for c in doc["cases"] if c["padded"] == padded]


def _failed(c: dict, tol: float) -> set[str]:
    """The passes in which stock fla failed in sweep case ``c`` (wrong beyond ``tol``, raised other than by one of its
    refusals, or the process died)."""
    if c["status"] == "crash":
        return {"forward", "backward"}
    out = set()
    if max(c["forward"].values()) > tol:
        out.add("forward")
    if max(c.get("backward", {}).values(), default=0) > tol or (c["status"] == "error" and c["stage"] == "backward"):
        out.add("backward")
    return out


def test_faulty_rule_matches_the_sweep():
    """The rule covers every failure of the sweep in its pass and flags no swept shape that never failed; the Gated
    DeltaNet backwards (refused by fla there) are unchecked and stay out of the rule."""
    doc = _sweep()
    missed, extra = [], []
    for c in doc["cases"]:
        if c["padded"]:
            continue
        name = KERNEL_OF[c["family"], c["kernel"]]
        failed = _failed(c, doc["tol"])
        if c["family"] == "gated_deltanet":  # refused backward, right forward (recorded before the status "refused")
            assert failed <= {"backward"} and c["status"] in ("error", "refused"), c
            assert sweep_fla_shapes.refused(c["message"]), c
            failed = set()
        rule = shapes.FAULTY.get(name)
        ruled = set(rule(c["d_k"], c["d_v"])) if rule else set()
        if not failed <= ruled:
            missed.append((name, c["d_k"], c["d_v"], sorted(failed), sorted(ruled)))
        if ruled and not failed:
            extra.append((name, c["d_k"], c["d_v"]))
    assert not missed, f"the rule misses failures of the sweep: {missed}"
    assert not extra, f"the rule flags shapes that never failed in the sweep: {extra}"


def test_padded_calls_of_the_sweep_were_right():
    doc = _sweep()
    padded = [c for c in doc["cases"] if c["padded"] and c["family"] == "delta_net"]
    assert {(c["d_k"], c["d_v"]) for c in padded} >= {(dk, dv) for dk in (8, 16, 32) for dv in (64, 128)}
    assert all(c["status"] == "ok" and c["max_rel_error"] < doc["tol"] for c in padded)
    for dk in (8, 16, 24, 32, 40, 48, 63):  # unswept widths too: padded to PAD_TO where the rule says faulty
        for dv in (48, 64, 96, 128, 192, 256):
            width = shapes.padded_width("chunk_delta_rule", dk, dv, backward=True)
            assert width == (shapes.PAD_TO if dk <= 32 and dv <= 128 else None)
            inference = shapes.padded_width("chunk_delta_rule", dk, dv, backward=False)
            assert inference == (shapes.PAD_TO if dk <= 32 and dv <= 64 else None)


VALUES_SMALL = ROOT / "docs" / "results" / "fla_value_shapes_h100_dn_chunk_small.json"
VALUES_WIDE = ROOT / "docs" / "results" / "fla_value_shapes_h100.json"
VALUES_ALL = ROOT / "docs" / "results" / "fla_value_shapes_h100_all.json"  # the whole grid, from the runs resumed


def _measured_right() -> set[tuple[str, int, int, str]]:
    """(kernel, d_k, d_v, pass) a kernel saw run right at, stock or padded (a padded call runs the kernel at the
    padded shape), in every recorded sweep."""
    out = set()
    for path in (SWEEP, VALUES_ALL):
        doc = json.loads(path.read_text())
        for c in doc["cases"]:
            if c["status"] == "crash":
                continue
            name = KERNEL_OF[c["family"], c["kernel"]]
            dk = c.get("pad_k") or (shapes.PAD_TO if c["padded"] is True and c["d_k"] < shapes.PAD_TO else c["d_k"])
            dv = c.get("pad_v") or c["d_v"]
            for p in ({"forward", "backward"} - _failed(c, doc["tol"])):
                if p == "backward" and not c.get("backward"):
                    continue  # refused or not reached: the backward is unmeasured
                out.add((name, dk, dv, p))
    return out


def _values_sweep() -> dict:
    return json.loads(VALUES_ALL.read_text())


def test_the_values_sweep_holds_the_whole_grid():
    """The recorded values sweep has a record of every stock case of the grid, each once; one Gated DeltaNet fused
    recurrent case has only a crashed process (64 x 16; it ran to fla's refusal with a right forward in
    fla_value_shapes_h100_rest_gdn.log, whose document was written before it)."""
    doc = _values_sweep()
    _, stock = sweep_fla_shapes.values_grid_cases(sweep_fla_shapes.parser().parse_args(["out.json", "--grid", "values"]))
    keys = [sweep_fla_shapes.record_key(c) for c in doc["cases"]]
    assert len(keys) == len(set(keys)) and set(stock) <= set(keys)
    crashed = [sweep_fla_shapes.record_key(c) for c in doc["cases"] if c["status"] == "crash"]
    assert crashed == [("gated_deltanet", "fused_recurrent", 64, 16, "0")]
    assert sweep_fla_shapes.resumed(doc, stock)[1] == [("gated_deltanet", "fused_recurrent", 64, 16, "0")]


def test_prune_record_notes_name_the_values_sweep():
    """The values sweep's shapes count as swept in prune_record.json's note, which names where they were measured:
    128 x 32 as faulty there (padded), 256 x 32 as measured right; a shape neither sweep ran stays unchecked."""
    assert shapes.SWEPT_VALUE_SHAPES == {tuple(s) for s in _values_sweep()["shapes"]}
    kernels = ("chunk_delta_rule", "fused_recurrent_delta_rule")
    note = shapes.record_note(kernels, 128, 32)
    assert note["swept"] and note["values_measured_on"] == shapes.VALUES_MEASURED_ON
    assert note["faulty"] == {"chunk_delta_rule": {"passes": ["backward"], "padded_to": None, "values_padded_to": 64}}
    assert " is wrong or faults " in note["note"]
    note = shapes.record_note(kernels, 256, 32)
    assert note["swept"] and not note["faulty"] and "measured right" in note["note"] and "values_measured_on" in note
    note = shapes.record_note(kernels, 128, 40)
    assert not note["swept"] and "unchecked" in note["note"] and "values_measured_on" not in note


def test_value_rule_matches_the_values_sweep():
    """Every failure of the chunk DeltaNet kernel in the values sweep lies in a pass the two rules flag; the rules
    flag no measured shape that never failed, except in the region of value tiles of at most 32 with key tiles of at
    most 32, where stock calls were erratic (right at 16 x 8, wrong at 16 x 32) and the whole region is guarded; and
    every call the guard makes there runs the kernel at a shape (padded) that was measured right in that pass. The
    fused recurrent DeltaNet kernel was right at every shape."""
    doc = _values_sweep()
    right = _measured_right()
    for c in doc["cases"]:
        if c["family"] != "delta_net" or c["padded"]:
            continue
        dk, dv = c["d_k"], c["d_v"]
        failed = _failed(c, doc["tol"])
        if c["kernel"] == "fused_recurrent":
            assert c["status"] == "ok" and not failed, c
            continue
        ruled = set(shapes.FAULTY["chunk_delta_rule"](dk, dv)) | set(shapes.VALUE_FAULTY["chunk_delta_rule"](dk, dv))
        assert failed <= ruled, (dk, dv, failed, ruled)
        if ruled and not failed:
            assert dk <= 32 and dv <= 32, (dk, dv)
        for backward, p in ((True, "backward"), (False, "forward")):
            wk, wv = shapes.padded_widths("chunk_delta_rule", dk, dv, backward=backward)
            assert ("chunk_delta_rule", wk or dk, wv or dv, p) in right, (dk, dv, p, wk, wv)
    # v is padded exactly where the value tile is at most 32 at key tiles up to 128, for the backward
    assert shapes.padded_widths("chunk_delta_rule", 48, 16) == (None, 64)
    assert shapes.padded_widths("chunk_delta_rule", 48, 16, backward=False) == (None, None)
    assert shapes.padded_widths("chunk_delta_rule", 16, 8) == (64, 64)
    assert shapes.padded_widths("chunk_delta_rule", 16, 8, backward=False) == (64, None)
    assert shapes.padded_widths("chunk_delta_rule", 128, 32) == (None, 64)  # the DeltaNet 1.3B value cut at 75 %
    assert shapes.padded_widths("chunk_delta_rule", 128, 32, backward=False) == (None, None)
    assert shapes.padded_widths("chunk_delta_rule", 256, 8) == (None, None)
    assert shapes.padded_widths("chunk_delta_rule", 512, 32, backward=False) == (None, 64)  # unswept: guarded
    assert shapes.padded_widths("chunk_delta_rule", 64, 48) == (None, None)
    assert shapes.padded_widths("fused_recurrent_delta_rule", 16, 8) == (None, None)


def test_gated_value_rule_matches_the_values_sweep():
    """The Gated DeltaNet forwards were right at every shape of the values grid; the chunk backward faulted (an
    illegal memory access before fla's refusal) only where the value rule pads v, and with v padded to 64 each of
    those reached the refusal; the rule stays within value tiles of 16 at key tiles of at most 64."""
    doc = _values_sweep()
    gated = [c for c in doc["cases"] if c["family"] == "gated_deltanet" and c["status"] != "crash"]
    assert len(gated) == 98 and all(max(c["forward"].values()) < 5e-3 for c in gated)
    faulted = set()
    for c in gated:
        if c["padded"]:
            assert c["status"] == "refused" and c["pad_v"] == 64 and not c.get("pad_k"), c
            continue
        assert c["status"] in ("refused", "error"), c
        name = KERNEL_OF[c["family"], c["kernel"]]
        ruled = shapes.VALUE_FAULTY.get(name, lambda *_: frozenset())(c["d_k"], c["d_v"])
        if c["status"] == "error":
            assert c["stage"] == "backward" and "illegal memory access" in c["message"] and ruled == {"backward"}, c
            faulted.add((c["d_k"], c["d_v"]))
        else:
            assert sweep_fla_shapes.refused(c["message"]), c
        if ruled:
            assert c["d_k"] <= 64 and c["d_v"] <= 16, c
    assert faulted == {(32, 8), (32, 16), (48, 16)}
    assert faulted == {(c["d_k"], c["d_v"]) for c in gated if c["padded"]}
    assert shapes.padded_widths("chunk_gated_delta_rule", 32, 8) == (None, 64)
    assert shapes.padded_widths("chunk_gated_delta_rule", 32, 8, backward=False) == (None, None)
    assert shapes.padded_widths("chunk_gated_delta_rule", 128, 8) == (None, None)
    assert shapes.padded_widths("fused_recurrent_gated_delta_rule", 32, 8) == (None, None)


def test_the_sweep_calls_the_recorded_refusals_refused():
    """fla's refusals by design (the Gated DeltaNet chunk backward on Hopper with this Triton, the fused-recurrent
    Gated DeltaNet backward) are status ``refused``; the DeltaNet illegal memory access stays an error."""
    doc = _sweep()
    seen = set()
    for c in doc["cases"]:
        if c["status"] != "error":
            continue
        got = sweep_fla_shapes.classify(dict(c), doc["tol"])["status"]
        seen.add((c["family"], got))
        assert got == ("refused" if c["family"] == "gated_deltanet" else "error"), c
    assert seen == {("gated_deltanet", "refused"), ("delta_net", "error")}
    fresh = {"family": "gated_deltanet", "forward": {"o": 4e-3}, "backward_error": "NotImplementedError: Backward"}
    assert sweep_fla_shapes.classify(fresh, 0.05)["status"] == "refused"
    wrong = {"forward": {"o": 3.0}, "backward_error": "NotImplementedError: Backward"}
    assert sweep_fla_shapes.classify(wrong, 0.05)["status"] == "wrong"  # a wrong forward is wrong, refused or not


def test_values_grid_covers_the_value_cuts_and_the_joint_cuts():
    widths, grid = sweep_fla_shapes.value_grid_shapes([64, 128, 256, 512], [25, 50, 75, 87.5],
                                                      list(sweep_fla_shapes.VALUE_GRID_KEY_WIDTHS),
                                                      list(sweep_fla_shapes.JOINT))
    # every d_v' that removing 25-87.5 % of d_v in {64, ..., 512} gives, less the d_v the keys grid ran
    assert widths == [8, 16, 32, 48, 96, 192, 384]
    assert set(widths) | set(shapes.SWEPT_D_V) == set(sweep_fla_shapes.value_widths([64, 128, 256, 512],
                                                                                     [25, 50, 75, 87.5]))
    assert {(dk, dv) for dk in (64, 128, 256) for dv in widths} <= set(grid)  # value-only cuts of every d_k
    assert {(16, 16), (32, 32), (48, 48)} <= set(grid)  # joint cuts at 75 % and the small tiles
    for dk, dv in sweep_fla_shapes.JOINT:  # about half the state with both sides cut, in multiples of 8
        full = 256 * 512 if dv > 256 else min(d for d in (64, 128, 256) if d >= dk) ** 2
        assert dk % 8 == 0 and dv % 8 == 0 and 0.47 < dk * dv / full < 0.57 and (dk, dv) in grid
    assert len(grid) == len(set(grid)) == 6 * 7 + 6


@pytest.mark.parametrize("spec,want", [("0", (None, None)), ("1", (64, None)), ("k64", (64, None)),
                                       ("v64", (None, 64)), ("k64v128", (64, 128))])
def test_padding_specs_round_trip(spec, want):
    assert sweep_fla_shapes.parse_pad(spec, 16) == want
    if spec not in ("0", "1"):
        assert sweep_fla_shapes.pad_spec(*want) == spec
    with pytest.raises(ValueError, match="give 0, 1, k<W>, v<W> or k<W>v<W>"):
        sweep_fla_shapes.parse_pad("x64", 16)


def test_padded_followups_pad_keys_where_the_rule_does_and_values_where_stock_failed():
    def case(family, kernel, dk, dv, status):
        return {"family": family, "kernel": kernel, "d_k": dk, "d_v": dv, "padded": False, "status": status}

    results = [case("delta_net", "chunk", 16, 48, "ok"), case("delta_net", "chunk", 16, 32, "crash"),
               case("delta_net", "chunk", 64, 48, "wrong"), case("delta_net", "chunk", 64, 96, "error"),
               case("delta_net", "chunk", 128, 32, "ok"), case("delta_net", "fused_recurrent", 64, 48, "wrong"),
               case("gated_deltanet", "chunk", 64, 48, "refused"), case("gated_deltanet", "chunk", 64, 32, "wrong")]
    assert sweep_fla_shapes.padded_followups(results) == [
        ("delta_net", "chunk", 16, 48, "k64"),  # the rule pads keys there: is that still right at this d_v'?
        ("delta_net", "chunk", 16, 32, "k64"), ("delta_net", "chunk", 16, 32, "k64v64"),
        ("delta_net", "chunk", 64, 48, "v64"),
        ("delta_net", "chunk", 64, 96, "v128"),
        ("gated_deltanet", "chunk", 64, 32, "v64"),
    ]


@pytest.mark.parametrize("case", ["delta_net,chunk,16,24,0", "delta_net,chunk,16,24,k64v64",
                                  "gated_deltanet,chunk,48,40,v64", "gated_deltanet,fused_recurrent,24,8,k32v16"])
def test_sweep_case_runs_on_the_torch_kernels(case):
    """One case of the sweep end to end on the CPU (``--device cpu``: fla_fallback's kernels instead of fla's):
    the record names its padding, and padded and unpadded calls agree with the float64 recurrence alike."""
    family, kernel, dk, dv, pad = case.split(",")
    doc = sweep_fla_shapes.classify(sweep_fla_shapes.run_case(family, kernel, int(dk), int(dv), pad, T=40,
                                                              device="cpu"), 0.05)
    assert doc["status"] == "ok" and doc["max_rel_error"] < 1e-2, doc
    assert doc["padded"] == (pad != "0")
    if pad != "0":
        assert (doc["pad_k"], doc["pad_v"]) == sweep_fla_shapes.parse_pad(pad, int(dk))
    else:
        assert "pad_v" not in doc
    names = {"dq", "dk", "dv", "dbeta", "dh0"} | ({"dg"} if family == "gated_deltanet" else set())
    assert set(doc["backward"]) == names


def test_routed_models_recorded_right_and_stock_faulting():
    """The GPU check of pruned checkpoints through load_model (ours) and plain from_pretrained (stock)."""
    doc = json.loads(ROUTED.read_text())
    assert doc["cases"]
    for c in doc["cases"]:
        assert shapes.padded_width("chunk_delta_rule", c["d_k_pruned"], c["d_v"]) == shapes.PAD_TO
        assert c["ours"]["logits_rel_error"] < 0.05 and c["ours"]["grad_max_rel_error"] < 0.05
        assert "error" in c["stock"] or c["stock"]["grad_max_rel_error"] > 0.5


def _inputs(family: str, d_k: int, d_v: int, T: int = 70, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    x = {
        "q": torch.randn(2, T, 2, d_k, generator=g, dtype=torch.float64),
        "k": torch.randn(2, T, 2, d_k, generator=g, dtype=torch.float64),
        "v": torch.randn(2, T, 2, d_v, generator=g, dtype=torch.float64),
        "beta": torch.rand(2, T, 2, generator=g, dtype=torch.float64),
        "initial_state": 0.1 * torch.randn(2, 2, d_k, d_v, generator=g, dtype=torch.float64),
    }
    if family == "gated_deltanet":
        x["g"] = F.logsigmoid(torch.randn(2, T, 2, generator=g, dtype=torch.float64) + 3)
    return {n: t.requires_grad_() for n, t in x.items()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("name", sorted(sweep_fla_shapes.KERNELS.values()))
@pytest.mark.parametrize("d_k", [8, 16, 24])
def test_padded_call_equals_unpadded_and_reference(name, d_k):
    family = "gated_deltanet" if "gated" in name else "delta_net"
    fn = getattr(fla_fallback, name)  # the torch kernels, fla's signatures
    kw = {"output_final_state": True, "use_qk_l2norm_in_kernel": True}
    runs = []
    for padded in (False, True):
        x = _inputs(family, d_k, 32)
        call = (lambda *a, **k: shapes.call_padded(fn, shapes.PAD_TO, *a, **k)) if padded else fn
        o, s = call(**x, **kw)
        assert s.shape == x["initial_state"].shape and s.is_contiguous()
        ((o * o.detach().sin()).sum() + (s * s.detach().cos()).sum()).backward()
        runs.append((o.detach(), s.detach(), {n: t.grad for n, t in x.items()}))
    (o0, s0, g0), (o1, s1, g1) = runs
    # the torch kernels compute in float32: padded and unpadded agree to its rounding (about 1e-6), not to the bit
    for what, a, b in [("o", o1, o0), ("final state", s1, s0), *((f"d{n}", g1[n], g0[n]) for n in g0)]:
        assert _rel(a, b) < 1e-5, f"{what}: padded vs unpadded relative error {_rel(a, b):.2e}"
    x = _inputs(family, d_k, 32)
    o_ref, s_ref = delta_rule(F.normalize(x["q"], dim=-1), F.normalize(x["k"], dim=-1), x["v"], x["beta"], x.get("g"),
                              scale=d_k**-0.5, initial_state=x["initial_state"])
    assert _rel(o1, o_ref.detach()) < 1e-5 and _rel(s1, s_ref.detach()) < 1e-5


@pytest.mark.parametrize("name", sorted(sweep_fla_shapes.KERNELS.values()))
@pytest.mark.parametrize("d_k,d_v,width,value_width", [(48, 24, None, 64), (16, 40, 64, 64), (32, 8, 64, 16)],
                         ids=["values", "both", "both-narrow"])
def test_value_padded_call_equals_unpadded_and_reference(name, d_k, d_v, width, value_width):
    """v zero-padded (and q, k too): a zero value channel is a zero row of the state and a zero output channel, and
    takes no part in the other rows or any gradient; the Gated DeltaNet kernels with grouped value heads (HV = 2H)."""
    family = "gated_deltanet" if "gated" in name else "delta_net"
    fn = getattr(fla_fallback, name)
    kw = {"output_final_state": True, "use_qk_l2norm_in_kernel": True}
    hv = 4 if family == "gated_deltanet" else 2

    def inputs():
        x = _inputs(family, d_k, d_v, seed=3)
        if hv != 2:  # grouped value heads: v, beta, g and the state per value head
            g = torch.Generator().manual_seed(5)
            x["v"] = torch.randn(2, 70, hv, d_v, generator=g, dtype=torch.float64)
            x["beta"] = torch.rand(2, 70, hv, generator=g, dtype=torch.float64)
            x["g"] = F.logsigmoid(torch.randn(2, 70, hv, generator=g, dtype=torch.float64) + 3)
            x["initial_state"] = 0.1 * torch.randn(2, hv, d_k, d_v, generator=g, dtype=torch.float64)
            x = {n: t.requires_grad_() for n, t in x.items()}
        return x

    runs = []
    for padded in (False, True):
        x = inputs()
        if padded:
            o, s = shapes.call_padded(fn, width, **x, value_width=value_width, **kw)
        else:
            o, s = fn(**x, **kw)
        assert o.shape == x["v"].shape and s.shape == x["initial_state"].shape
        # contiguous as fla's kernels return them: the in-place decode steps refuse a strided cached state
        assert s.is_contiguous() and (o.is_contiguous() or not padded)
        ((o * o.detach().sin()).sum() + (s * s.detach().cos()).sum()).backward()
        runs.append((o.detach(), s.detach(), {n: t.grad for n, t in x.items()}))
    (o0, s0, g0), (o1, s1, g1) = runs
    for what, a, b in [("o", o1, o0), ("final state", s1, s0), *((f"d{n}", g1[n], g0[n]) for n in g0)]:
        assert _rel(a, b) < 1e-5, f"{what}: padded vs unpadded relative error {_rel(a, b):.2e}"
    x = inputs()
    o_ref, s_ref = delta_rule(F.normalize(x["q"], dim=-1), F.normalize(x["k"], dim=-1), x["v"], x["beta"], x.get("g"),
                              scale=d_k**-0.5, initial_state=x["initial_state"])
    assert _rel(o1, o_ref.detach()) < 1e-5 and _rel(s1, s_ref.detach()) < 1e-5


def test_value_padded_call_with_value_first_state_and_channel_beta():
    """The value-first state layout ([N, HV, V, K]) and a beta per value channel ([B, T, HV, V]) are padded on their
    value axes (the torch fused-recurrent Gated DeltaNet kernel takes both)."""
    fn = fla_fallback.fused_recurrent_gated_delta_rule
    x = _inputs("gated_deltanet", 16, 24)
    x["initial_state"] = x["initial_state"].detach().transpose(-1, -2).contiguous().requires_grad_()
    # seeded, and q and k L2-normalised as the layers call the kernel: with raw keys (|k|^2 about d_k) the recurrence
    # grows without bound, and values of 1e10 differ in summation order by more than the comparison's tolerance
    x["beta"] = torch.rand(2, 70, 2, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x["beta"].requires_grad_()
    kw = {"output_final_state": True, "state_v_first": True, "use_qk_l2norm_in_kernel": True}
    ref = fn(**x, **kw)
    for width in (None, 64):
        got = shapes.call_padded(fn, width, **x, value_width=64, **kw)
        assert got[0].shape == ref[0].shape and got[1].shape == x["initial_state"].shape
        assert got[0].is_contiguous() and got[1].is_contiguous()
        torch.testing.assert_close(got[0], ref[0])
        torch.testing.assert_close(got[1], ref[1])


@pytest.mark.parametrize("state_v_first", [False, True], ids=["state-kv", "state-vk"])
def test_padded_call_with_key_gate_and_value_first_state(state_v_first):
    """fused_recurrent_gated_delta_rule's key gate ``gk`` and the ``state_v_first`` layout are padded right (the torch
    version takes both: an error there is a failure)."""
    fn = fla_fallback.fused_recurrent_gated_delta_rule
    x = _inputs("gated_deltanet", 16, 32)
    x.pop("g")
    x["gk"] = F.logsigmoid(torch.randn(2, 70, 2, 16, dtype=torch.float64) + 3).requires_grad_()
    if state_v_first:
        x["initial_state"] = x["initial_state"].detach().transpose(-1, -2).contiguous().requires_grad_()
    ref = fn(**x, output_final_state=True, state_v_first=state_v_first)
    got = shapes.call_padded(fn, 64, **x, output_final_state=True, state_v_first=state_v_first)
    assert got[1].shape == x["initial_state"].shape and got[1].is_contiguous()
    torch.testing.assert_close(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1])


class _Spy:
    """A kernel with fla's chunk_delta_rule signature that records the key and value widths it was called with."""

    def __init__(self):
        self.widths, self.value_widths = [], []

    def __call__(self, q, k, v, beta, scale=None, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        self.widths.append(q.shape[-1])
        self.value_widths.append(v.shape[-1])
        return fla_fallback.chunk_delta_rule(q, k, v, beta, scale=scale, initial_state=initial_state,
                                             output_final_state=output_final_state,
                                             use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def test_guard_pads_only_faulty_shapes(monkeypatch):
    monkeypatch.setattr(fla_fallback, "_TORCH_DEVICE_TYPES", set())  # nothing routed to torch: CPU plays CUDA
    spy = _Spy()
    guarded = shapes.guard(spy, "chunk_delta_rule", device_types=("cpu",))
    for d_k, d_v, grad, width, width_v in [
            (16, 64, True, 64, 64), (16, 64, False, 64, 64), (32, 128, True, 64, 128), (32, 128, False, 32, 128),
            (48, 64, True, 48, 64), (16, 256, True, 16, 256),
            (48, 16, True, 48, 64), (48, 16, False, 48, 16), (16, 8, True, 64, 64), (16, 8, False, 64, 8)]:
        x = _inputs("delta_net", d_k, d_v)
        with torch.set_grad_enabled(grad):  # 32 x 128 faults only in the backward: padded only when one follows
            o, s = guarded(x["q"], x["k"], v=x["v"], beta=x["beta"], initial_state=x["initial_state"],
                           output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert (spy.widths[-1], spy.value_widths[-1]) == (width, width_v), (d_k, d_v, grad)
        ref = fla_fallback.chunk_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(o, ref[0], rtol=1e-5, atol=1e-6)  # padded products round in another order
        torch.testing.assert_close(s, ref[1], rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(fla_fallback, "_TORCH_DEVICE_TYPES", {"cpu"})  # routed to torch: any shape, no padding
    x = _inputs("delta_net", 16, 64)
    guarded(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert spy.widths[-1] == 16


def test_guard_pads_the_gated_values_where_the_backward_faulted(monkeypatch):
    """The chunk Gated DeltaNet kernel gets v padded to 64 at 32 x 8 when a backward follows, not otherwise, nor at
    128 x 8; the padded call's output and gradients equal the unpadded ones."""
    monkeypatch.setattr(fla_fallback, "_TORCH_DEVICE_TYPES", set())  # nothing routed to torch: CPU plays CUDA
    seen = []

    @functools.wraps(fla_fallback.chunk_gated_delta_rule)  # call_padded binds the kernel's signature
    def spy(*args, **kwargs):
        bound = inspect.signature(fla_fallback.chunk_gated_delta_rule).bind(*args, **kwargs)
        seen.append((bound.arguments["q"].shape[-1], bound.arguments["v"].shape[-1]))
        return fla_fallback.chunk_gated_delta_rule(*args, **kwargs)

    guarded = shapes.guard(spy, "chunk_gated_delta_rule", device_types=("cpu",))
    for d_k, d_v, grad, want in [(32, 8, True, (32, 64)), (32, 8, False, (32, 8)), (128, 8, True, (128, 8))]:
        x = _inputs("gated_deltanet", d_k, d_v)
        with torch.set_grad_enabled(grad):
            o, s = guarded(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], initial_state=x["initial_state"],
                           output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert seen[-1] == want, (d_k, d_v, grad)
        if grad:
            (o.sum() + s.square().sum()).backward()
        y = _inputs("gated_deltanet", d_k, d_v)
        ref = fla_fallback.chunk_gated_delta_rule(**y, output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(o, ref[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(s, ref[1], rtol=1e-5, atol=1e-6)
        if grad:
            (ref[0].sum() + ref[1].square().sum()).backward()
            for n in x:
                torch.testing.assert_close(x[n].grad, y[n].grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["delta_net", "gated_deltanet"])
def test_load_model_installs_the_guard_and_records_the_shape(family, tmp_path):
    from _models import random_keep, tiny_model

    from statereduce.adapters import adapter_class
    from statereduce.core.models import load_model
    from statereduce.stages.prune import load_prune_record, prune_model, save_pruned
    from statereduce.core.tokenizer import byte_level_tokenizer

    kw = {"expand_k": 2.0, "expand_v": 2.0} if family == "delta_net" else {"head_dim": 64, "expand_v": 1.0}
    model = tiny_model(family, **kw)  # d_k 64, d_v 64
    x = torch.randint(0, 256, (1, 80))
    for keep, faulty in ((16, family == "delta_net"), (48, False)):
        pruned = tiny_model(family, **kw)
        pruned.load_state_dict(model.state_dict())
        record = prune_model(pruned, random_keep(pruned, keep), {"source": "random", "method": "rand",
                                                                 "pct": 100 * (1 - keep / 64)})
        save_pruned(pruned, byte_level_tokenizer(), record, tmp_path / str(keep))
        note = load_prune_record(tmp_path / str(keep)).fla_kernel_shapes
        assert note["faulty"] == ({"chunk_delta_rule": {"passes": ["backward", "forward"], "padded_to": 64}}
                                  if faulty else {})
        assert note["swept"] and (" faults " in note["note"]) == faulty
        loaded, _ = load_model(tmp_path / str(keep))
        adapter = adapter_class(family)
        assert all(shapes.is_guarded(adapter.layer_module, k) for k in adapter.padded_kernels)
        with torch.no_grad():
            torch.testing.assert_close(loaded(x).logits, pruned(x).logits)
    mod = importlib.import_module(adapter_class(family).layer_module)
    assert getattr(mod, adapter_class(family).padded_kernels[0])._statereduce_guard


def test_transformers_families_record_no_fla_shapes(tmp_path):
    from _models import random_keep, tiny_model

    from statereduce.stages.prune import prune_model

    model = tiny_model("mamba2")
    record = prune_model(model, random_keep(model, 16), {"source": "random", "method": "rand", "pct": 50})
    assert record.fla_kernel_shapes == {}


def test_a_resumed_sweep_runs_only_what_the_earlier_run_lacks():
    """``--resume``: the records of the H100 values run that finished (not the crashed or timed-out ones) are kept;
    every other case of the grid, and the padded follow-ups the kept stock records call for, remain to run."""
    doc = json.loads(VALUES_WIDE.read_text())
    _, stock = sweep_fla_shapes.values_grid_cases(sweep_fla_shapes.parser().parse_args(["out.json", "--grid", "values"]))
    kept, todo = sweep_fla_shapes.resumed(doc, stock)
    crashed = [c for c in doc["cases"] if c["status"] == "crash"]
    assert len(doc["cases"]) == 70 and len(crashed) == 20 and len(kept) == 50
    assert len(todo) == len(stock) - len(kept) == 142
    assert {sweep_fla_shapes.record_key(c) for c in crashed} <= set(todo)
    assert not {sweep_fla_shapes.record_key(c) for c in kept} & set(todo)
    follow = sweep_fla_shapes.padded_followups([c for c in kept if not c["padded"]])
    assert sweep_fla_shapes.resumed({"cases": kept}, follow)[1] == follow  # none of them ran yet


def test_a_sweep_resumed_from_several_runs_keeps_each_case_once():
    """``--resume A B``: the wide H100 run and the small-shape DeltaNet chunk run together leave only the stock cases
    neither has; a case crashed in one run and finished in another keeps the finished record."""
    wide, small = json.loads(VALUES_WIDE.read_text()), json.loads(VALUES_SMALL.read_text())
    _, stock = sweep_fla_shapes.values_grid_cases(sweep_fla_shapes.parser().parse_args(["out.json", "--grid", "values"]))
    merged = sweep_fla_shapes.merged_runs([wide, small])
    keys = [sweep_fla_shapes.record_key(c) for c in merged["cases"]]
    assert len(keys) == len(set(keys)) == len({sweep_fla_shapes.record_key(c) for c in wide["cases"] + small["cases"]})
    kept, todo = sweep_fla_shapes.resumed(merged, stock)
    small_keys = {sweep_fla_shapes.record_key(c) for c in small["cases"]}
    assert not small_keys & set(todo) and len(todo) == 119
    assert ("delta_net", "chunk", 16, 8, "0") in small_keys and ("delta_net", "chunk", 128, 32, "0") in todo
    crashed = next(c for c in wide["cases"] if c["status"] == "crash")
    redone = {**crashed, "status": "ok", "max_rel_error": 1e-3}
    merged = sweep_fla_shapes.merged_runs([wide, {"cases": [redone]}])
    assert next(c for c in merged["cases"] if sweep_fla_shapes.record_key(c) == sweep_fla_shapes.record_key(crashed)) \
        is redone
    args = sweep_fla_shapes.parser().parse_args(["out.json", "--resume", str(VALUES_WIDE), str(VALUES_SMALL)])
    assert args.resume == [VALUES_WIDE, VALUES_SMALL]
