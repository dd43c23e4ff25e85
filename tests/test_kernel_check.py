"""The run-time kernel check (statereduce.kernels.check) against planted kernel faults.

The check runs on CUDA in jobs; here it runs on the CPU against a planted DeltaNet kernel (tests/_planted_kernel.py)
that the check's child process imports too: wrong by half at d_k 16, a dying process at d_k 24, right otherwise.
The reference is statereduce.kernels.fla_fallback, which is also what the CPU binding calls, so a route that the
check sends to PyTorch must give exactly the unplanted model's logits. scripts/check_kernels_gpu.py runs it on a GPU
against fla's own kernels (docs/gpu_checks.md, "The kernel check at run time").
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

import _planted_kernel as planted
from _models import tiny_model
from statereduce.adapters import get_adapter
from statereduce.core.models import check_kernels, kernel_check_record
from statereduce.kernels import check

TESTS = Path(__file__).resolve().parent
PLANT = "_planted_kernel:PlantDeltaNet"


@pytest.fixture(autouse=True)
def _clean(monkeypatch, tmp_path):
    """The child imports the plant from tests/; every test starts with no route sent to PyTorch and its own cache."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv(check.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(check.POLICY_ENV, raising=False)
    yield
    check.unroute()
    planted.PlantDeltaNet.remove()


def _route(d_k: int, pass_: str = "forward", **kw) -> check.Route:
    return check.Route(planted.LAYER_MODULE, planted.KERNEL, "chunk_delta_rule", pass_, 2, 2, d_k, 32, setup=PLANT, **kw)


def test_compare_finds_the_planted_error_in_both_passes():
    right = check.compare(_route(32), "cpu")
    assert right["outcome"] == "right" and right["error"] == 0.0
    for p in check.PASSES:
        wrong = check.compare(_route(planted.WRONG_D_K, p), "cpu")
        assert wrong["outcome"] == "wrong" and wrong["error"] == pytest.approx(0.5, abs=1e-3), wrong


def test_fallback_gives_the_unplanted_models_logits():
    """A tiny DeltaNet of d_k 16 on the planted kernel: wrong logits; after the check (policy fallback) the chunk
    route runs in PyTorch and the logits are the unplanted model's exactly."""
    model = tiny_model("delta_net", expand_k=0.5)  # d_k = 64 * 0.5 / 2 = 16
    ids = torch.randint(0, 300, (2, 80), generator=torch.Generator().manual_seed(0))  # > 64 tokens: chunk kernel
    with torch.no_grad():
        clean = model(ids).logits
        planted.PlantDeltaNet.install_fallbacks()
        bad = model(ids).logits
    assert (bad - clean).abs().max() > 1e-2
    routes = [dataclasses.replace(r, setup=PLANT) for r in get_adapter(model).kernel_routes(backward=True)]
    with pytest.warns(RuntimeWarning, match=r"chunk_delta_rule forward at H=2, HV=2, d_k=16, d_v=32 is wrong"):
        record = check.check_routes(routes, "cpu")
    got = {(e["kernel"], e["pass"]): (e["outcome"], e["path"]) for e in record}
    assert got == {("chunk_delta_rule", "forward"): ("wrong", "torch"),
                   ("chunk_delta_rule", "backward"): ("wrong", "torch"),
                   ("fused_recurrent_delta_rule", "forward"): ("right", "fla")}
    assert check.torch_routed(planted.LAYER_MODULE, planted.KERNEL) == {("cpu", (2, 2, 16, 32)): {"forward",
                                                                                                    "backward"}}
    with torch.no_grad():
        assert torch.equal(model(ids).logits, clean)


@pytest.mark.slow  # default tier under 3 min: a child process or a whole run; .ci/run runs it
def test_stop_names_kernel_shape_versions_and_error_in_one_line():
    with pytest.raises(RuntimeError) as info:
        check.check_routes([_route(planted.WRONG_D_K)], "cpu", "stop")
    line = str(info.value)
    assert "\n" not in line
    for part in ("chunk_delta_rule forward", "d_k=16", "d_v=32", "is wrong", "torch ", "triton ", "fla ",
                 "largest relative error 0.5", check.POLICY_ENV):
        assert part in line, (part, line)
    assert check.torch_routed(planted.LAYER_MODULE, planted.KERNEL) == {}


@pytest.mark.slow  # default tier under 3 min: a child process or a whole run; .ci/run runs it
def test_a_fault_ends_its_child_and_the_next_route_is_still_checked():
    record = check.check_routes([_route(planted.FAULT_D_K), _route(planted.WRONG_D_K), _route(32)], "cpu")
    assert [e["outcome"] for e in record] == ["fault", "wrong", "right"]
    assert "ended with 134" in record[0]["detail"]
    assert [e["path"] for e in record] == ["torch", "torch", "fla"]


@pytest.mark.slow  # default tier under 3 min: a child process or a whole run; .ci/run runs it
def test_outcomes_are_cached_per_stack(monkeypatch, tmp_path):
    routes = [_route(planted.WRONG_D_K), _route(32)]
    first = check.check_routes(routes, "cpu")
    assert not any(e["cached"] for e in first)

    def no_child(*args, **kwargs):
        raise AssertionError("a cached route started a child")

    monkeypatch.setattr(check, "run_children", no_child)
    again = check.check_routes(routes, "cpu")
    assert all(e["cached"] and e["seconds"] == 0.0 for e in again)
    assert [(e["outcome"], e["path"]) for e in again] == [(e["outcome"], e["path"]) for e in first]
    on = check.stack("cpu")
    other = {**on, "triton": "0.0.0"}
    assert check.route_key(routes[0], on) != check.route_key(routes[0], other)
    assert check.route_key(routes[0], on) != check.route_key(routes[1], on)
    assert len(list((tmp_path / "cache").glob("*.json"))) == 2


def test_a_failed_backward_routes_only_differentiated_calls(monkeypatch):
    """A route wrong in the backward alone: calls under no_grad keep the kernel, differentiated calls go to
    PyTorch."""
    planted.PlantDeltaNet.install_fallbacks()
    check.route_to_torch(_route(planted.WRONG_D_K, "backward"), "cpu")
    kernel = getattr(__import__(planted.LAYER_MODULE, fromlist=["x"]), planted.KERNEL)
    args, kwargs = check._inputs(_route(planted.WRONG_D_K), torch.device("cpu"))
    ref = check.reference_kernel(_route(planted.WRONG_D_K))
    with torch.no_grad():
        want = ref(*args, **kwargs)[0]
        assert not torch.equal(kernel(*args, **kwargs)[0], want)
    q = args[0].clone().requires_grad_(True)
    assert torch.equal(kernel(q, *args[1:], **kwargs)[0].detach(), want)


def test_policy_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(check.POLICY_ENV, "skip")
    with pytest.raises(ValueError, match=r"^kernel check policy 'skip' \(environment variable "
                                         r"STATEREDUCE_KERNEL_CHECK\) is invalid; valid: fallback, stop, off$"):
        check.check_routes([_route(32)], "cpu")
    monkeypatch.setenv(check.POLICY_ENV, "off")
    monkeypatch.setattr(check, "run_children", lambda *a, **k: pytest.fail("policy off started a child"))
    assert check.check_routes([_route(planted.WRONG_D_K)], "cpu") == []


@pytest.mark.parametrize("family", ["delta_net", "gated_deltanet", "qwen3_5", "mamba2"])
def test_each_family_names_its_routes(family):
    adapter = get_adapter(tiny_model(family))
    forward, both = adapter.kernel_routes(), adapter.kernel_routes(backward=True)
    if family == "mamba2":  # transformers' Mamba-2 calls no fla kernel
        assert forward == both == []
        return
    refs = {r.kernel: r.reference for r in forward}
    assert set(refs.values()) == {"chunk_" + ("gated_" if family != "delta_net" else "") + "delta_rule",
                                  "fused_recurrent_" + ("gated_" if family != "delta_net" else "") + "delta_rule"}
    for r in forward:
        assert r.pass_ == "forward" and callable(check.bound_kernel(r)) and callable(check.reference_kernel(r))
    shapes = {r.shape for r in forward}
    want = {(adapter.num_heads, s.num_heads, s.d_k, s.d_v) for s in adapter.layer_state_shapes().values()}
    assert shapes == want
    backward = [r for r in both if r.pass_ == "backward"]
    assert {r.reference for r in backward} <= check.BACKWARD and len(backward) == len(shapes)
    if family == "gated_deltanet":  # called as fla's GatedDeltaNet calls them
        assert dict(forward[0].flags) == {"state_v_first": True, "use_gate_in_kernel": True,
                                          "use_beta_sigmoid_in_kernel": True}


def test_the_families_routes_are_right_on_cpu(tmp_path):
    """Every family's routes through the check's whole path (child, comparison, cache) on the CPU bindings, which
    are the references themselves (Qwen3.5's are transformers' own PyTorch kernels: agreement to bf16 rounding)."""
    routes = [r for family in ("delta_net", "gated_deltanet", "qwen3_5")
              for r in get_adapter(tiny_model(family)).kernel_routes(backward=True)]
    record = check.check_routes(routes, "cpu", folder=tmp_path)  # one child process for all of them
    assert len(record) == 9 and {e["outcome"] for e in record} == {"right"}, record
    assert max(e["error"] for e in record) < 1e-2  # bf16 gradients


def test_nothing_is_checked_on_cpu():
    model = tiny_model("delta_net")
    assert check_kernels(model, backward=True) == [] and kernel_check_record(model) == []
