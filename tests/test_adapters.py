"""Adapter contract: every family maps config, modules, capture points and state shapes the same way.

One abstract contract class, one subclass per family/variant (DeltaNet; Gated DeltaNet; GDN with grouped
value heads; GDN without output gate). Tiny random models on CPU (``tests/_models.py``).
"""

from __future__ import annotations

import json
import math

import fla.layers.attn
import fla.layers.delta_net
import fla.layers.gated_deltanet
import numpy as np
import pytest
import torch

from _models import tiny_arch, tiny_inputs, tiny_model
from statereduce.adapters import (
    DeltaNetAdapter,
    GatedDeltaNetAdapter,
    adapter_class,
    adapter_families,
    adapter_for_config,
    get_adapter,
)
from statereduce.models import tiny_config


class AdapterContract:
    """Contract tests; subclasses set the family, config overrides and the kernel globals the layer calls."""

    family: str
    overrides: dict = {}
    adapter_cls: type
    kernel_module = None
    kernel_names: tuple[str, ...] = ()
    expected_dims: tuple[int, int, int, int]  # (H, HV, d_k, d_v) of the tiny config

    @pytest.fixture
    def model(self):
        return tiny_model(self.family, **self.overrides)

    @pytest.fixture
    def config(self):
        return tiny_config(self.family, tiny_arch(self.family, **self.overrides))

    # ---- registry and config-only facts ---------------------------------------------------------
    def test_registry(self, model, config):
        assert self.family in adapter_families()
        assert adapter_class(self.family) is self.adapter_cls
        assert adapter_for_config(config) is self.adapter_cls
        assert type(get_adapter(model)) is self.adapter_cls
        assert isinstance(config, self.adapter_cls.config_class)

    def test_dims_from_config_match_modules(self, model, config):
        h, hv, d_k, d_v = self.adapter_cls.dims(config)
        assert (h, hv, d_k, d_v) == self.expected_dims
        adapter = get_adapter(model)
        assert (adapter.num_heads, adapter.num_v_heads, adapter.head_k_dim, adapter.head_v_dim) == (h, hv, d_k, d_v)
        hidden = config.hidden_size
        for _, mixer in adapter.mixer_layers():
            wq, wk = adapter.qk_weights(mixer)
            assert wq.shape == wk.shape == (h * d_k, hidden)
            assert wq is mixer.q_proj.weight and wk is mixer.k_proj.weight
            assert adapter.q_conv(mixer).weight.shape == adapter.k_conv(mixer).weight.shape == (h * d_k, 1, 4)
            assert mixer.v_proj.out_features == hv * d_v
            assert mixer.o_norm.weight.shape == (d_v,)

    def test_arch_dims_match_config(self, config):
        """``arch_dims`` (config validation, no fla) gives the dims of the built config."""
        arch = {k: getattr(config, k) for k in self.adapter_cls.config_defaults if hasattr(config, k)}
        assert self.adapter_cls.arch_dims(arch) == self.adapter_cls.dims(config) == self.expected_dims

    def test_mixer_layers(self, model, config):
        adapter = get_adapter(model)
        layers = adapter.mixer_layers()
        assert [i for i, _ in layers] == self.adapter_cls.mixer_layer_indices(config) == [0, 1]
        assert all(mixer is model.model.layers[i].attn for i, mixer in layers)
        assert adapter.num_mixer_layers() == 2

    def test_mixer_layers_skip_softmax_attention(self, monkeypatch):
        # fla's Attention refuses to be built without flash-attn; construction is all this test needs
        monkeypatch.setattr(fla.layers.attn, "flash_attn_func", object())
        model = tiny_model(self.family, attn={"layers": [1], "num_heads": 2}, **self.overrides)
        assert type(model.model.layers[1].attn).__name__ == "Attention"
        assert [i for i, _ in get_adapter(model).mixer_layers()] == [0]
        assert self.adapter_cls.mixer_layer_indices(model.config) == [0]

    def test_state_shape_matches_cache(self, model):
        adapter = get_adapter(model)
        shape = adapter.state_shape()
        h, hv, d_k, d_v = self.expected_dims
        assert (shape.num_heads, shape.d_k, shape.d_v) == (hv, d_k, d_v)
        with torch.no_grad():
            cache = model(tiny_inputs(batch=3, length=8), use_cache=True).past_key_values
        for i, _ in adapter.mixer_layers():
            state = cache[i]
            assert state["recurrent_state"].numel() == 3 * shape.recurrent_elems
            convs = state["conv_state"]
            assert sum(c.shape[1] for c in convs) == shape.conv_channels
            assert all(c.shape[0] == 3 and c.shape[2] == shape.conv_width for c in convs)
        assert adapter.state_bytes() == 2 * hv * d_k * d_v * 4

    def test_reduced_config_round_trips_every_d_k(self, config):
        h, hv, d_k, d_v = self.expected_dims
        before = config.to_dict()
        for d_k_new in range(1, d_k + 1):
            new = self.adapter_cls.reduced_config(config, d_k_new)
            reloaded = type(config).from_dict(json.loads(new.to_json_string()))
            assert tuple(self.adapter_cls.dims(new)) == tuple(self.adapter_cls.dims(reloaded)) == (h, hv, d_k_new, d_v)
            changed = {k for k, v in reloaded.to_dict().items() if before.get(k) != v}
            assert changed <= set(self.adapter_cls.config_updates(config, d_k_new)) | {"transformers_version"}
        assert config.to_dict() == before  # the input config is untouched
        assert tuple(self.adapter_cls.dims(self.adapter_cls.reduced_config(config, d_k))) == (h, hv, d_k, d_v)

    def test_reduced_config_accepts_numpy_ints(self, config):
        new = self.adapter_cls.reduced_config(config, np.int64(16))
        assert self.adapter_cls.dims(new).head_k_dim == 16
        json.loads(new.to_json_string())  # plain Python numbers in the config

    @pytest.mark.parametrize("bad", [0, -1, 33, 16.0, True, "16"], ids=lambda b: f"d_k'={b!r}")
    def test_reduced_config_rejects_out_of_range(self, config, bad):
        with pytest.raises(ValueError, match=r"d_k'=.*valid: an integer in \[1, d_k=32\]") as exc:
            self.adapter_cls.reduced_config(config, bad)
        assert "\n" not in str(exc.value)

    def test_instance_conveniences(self, model):
        adapter = get_adapter(model)
        assert tuple(self.adapter_cls.dims(adapter.pruned_config(8)))[2] == 8
        assert adapter.config is model.config

    # ---- capture --------------------------------------------------------------------------------
    def _record_kernel_inputs(self, monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Rebind the kernel globals to a recorder of (q, k) as the kernel receives them (independent of capture)."""
        seen: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name in self.kernel_names:
            fn = getattr(self.kernel_module, name)

            def recorder(*args, _fn=fn, **kwargs):
                seen.append((kwargs["q"].clone(), kwargs["k"].clone()))
                return _fn(*args, **kwargs)

            monkeypatch.setattr(self.kernel_module, name, recorder)
        return seen

    @pytest.mark.parametrize(
        "use_cache,length", [(False, 12), (True, 12), (False, 80)], ids=["no-cache", "cache", "no-cache-chunk"]
    )
    def test_capture_equals_kernel_input(self, model, monkeypatch, use_cache, length):
        adapter = get_adapter(model)
        h, _, d_k, _ = self.expected_dims
        kernel_seen = self._record_kernel_inputs(monkeypatch)
        x_seen, conv_calls = [], []
        for _, mixer in adapter.mixer_layers():
            mixer.q_proj.register_forward_pre_hook(lambda m, args: x_seen.append(args[0].clone()))
            mixer.q_conv1d.register_forward_hook(lambda *a: conv_calls.append(1))
        bound = {name: getattr(self.kernel_module, name) for name in self.kernel_names}
        qk, xs = [], []
        inputs = tiny_inputs(batch=2, length=length)
        with torch.no_grad(), adapter.capture(
            on_qk=lambda i, q, k: qk.append((i, q.clone(), k.clone())), on_x=lambda i, x: xs.append((i, x.clone()))
        ):
            model(inputs, use_cache=use_cache)
        assert {name: getattr(self.kernel_module, name) for name in self.kernel_names} == bound
        assert [i for i, *_ in qk] == [i for i, _ in xs] == [0, 1]
        assert len(kernel_seen) == len(x_seen) == 2
        for (_, q, k), (kq, kk) in zip(qk, kernel_seen):
            assert q.shape == k.shape == (2, length, h, d_k)
            assert torch.equal(q, kq) and torch.equal(k, kk)
        for (_, x), px in zip(xs, x_seen):
            assert x.shape == (2, length, 64) and torch.equal(x, px)
        self.check_conv_path(use_cache, conv_calls)

    def check_conv_path(self, use_cache: bool, conv_calls: list) -> None:
        """Family hook: which conv path ran (GDN fuses the convs without a cache)."""
        assert len(conv_calls) == 2

    def test_capture_restores_globals_on_error(self, model):
        adapter = get_adapter(model)
        bound = {name: getattr(self.kernel_module, name) for name in self.kernel_names}
        with pytest.raises(RuntimeError, match="boom"):
            with adapter.capture(on_qk=lambda *a: None):
                assert all(getattr(self.kernel_module, n) is not bound[n] for n in self.kernel_names)
                raise RuntimeError("boom")
        assert {name: getattr(self.kernel_module, name) for name in self.kernel_names} == bound

    def test_capture_ignores_other_models(self, model):
        """Only the adapter's own mixers report; an untracked model running inside the context is silent."""
        other = tiny_model(self.family, seed=3, **self.overrides)
        seen = []
        capture = get_adapter(model).capture(on_qk=lambda i, q, k: seen.append(i), on_x=lambda i, x: seen.append(-1))
        with torch.no_grad(), capture:
            other(tiny_inputs(length=6), use_cache=False)
            assert seen == []
            model(tiny_inputs(length=6), use_cache=False)
        assert seen == [-1, 0, -1, 1]


class TestDeltaNet(AdapterContract):
    family = "delta_net"
    adapter_cls = DeltaNetAdapter
    kernel_module = fla.layers.delta_net
    kernel_names = ("chunk_delta_rule", "fused_recurrent_delta_rule")
    expected_dims = (2, 2, 32, 32)

    def test_reduced_config_rejects_unrepresentable_expand_k(self):
        # hidden 49, one head of d_k 49: expand_k = 1/49 and int(49 * (1/49)) == 0 != 1
        arch = tiny_arch("delta_net", hidden_size=49, num_heads=1, expand_k=1.0, expand_v=1.0)
        config = tiny_config("delta_net", arch)
        msg = r"d_k'=1: expand_k=0\.02040816326530612 .*hidden_size=49 \* expand_k\)=0 != num_heads \* d_k' = 1"
        with pytest.raises(ValueError, match=msg):
            DeltaNetAdapter.reduced_config(config, 1)

    def test_expand_k_written(self, config):
        assert DeltaNetAdapter.config_updates(config, 16) == {"expand_k": 0.5}
        assert math.isclose(DeltaNetAdapter.reduced_config(config, 24).expand_k, 0.75)

    def test_capture_with_relu_activation(self, monkeypatch):
        """Non-silu q/k activations run after the conv, in the layer: captured after them, as the kernel sees."""
        model = tiny_model("delta_net", qk_activation="relu")
        seen = self._record_kernel_inputs(monkeypatch)
        qk = []
        with torch.no_grad(), get_adapter(model).capture(on_qk=lambda i, q, k: qk.append((q.clone(), k.clone()))):
            model(tiny_inputs(), use_cache=False)
        assert len(qk) == len(seen) == 2
        for (q, k), (kq, kk) in zip(qk, seen):
            assert torch.equal(q, kq) and torch.equal(k, kk) and bool((q >= 0).all()) and bool((q == 0).any())


class TestGatedDeltaNet(AdapterContract):
    family = "gated_deltanet"
    adapter_cls = GatedDeltaNetAdapter
    kernel_module = fla.layers.gated_deltanet
    kernel_names = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule")
    expected_dims = (2, 2, 32, 64)

    def check_conv_path(self, use_cache: bool, conv_calls: list) -> None:
        # without a cache the layer fuses the q/k/v convs: conv-module hooks never fire, capture still works
        assert len(conv_calls) == (2 if use_cache else 0)

    def test_head_dim_and_expand_v_change_together(self, config):
        assert GatedDeltaNetAdapter.config_updates(config, 16) == {"head_dim": 16, "expand_v": 4.0}
        new = GatedDeltaNetAdapter.reduced_config(config, 24)  # 64/24 is not an integer, yet int(24 * (64/24)) == 64
        assert (new.head_dim, int(new.head_dim * new.expand_v)) == (24, 64)

    def test_reduced_config_rejects_truncating_value_dim(self):
        # d_v = 128, d_k' = 49: expand_v = 128/49 and int(49 * (128/49)) == 127
        config = tiny_config("gated_deltanet", tiny_arch("gated_deltanet", head_dim=64, expand_v=2.0))
        with pytest.raises(ValueError, match=r"d_k'=49 with d_v=128.*int\(d_k' \* expand_v\)=127 != d_v=128") as exc:
            GatedDeltaNetAdapter.reduced_config(config, 49)
        assert "\n" not in str(exc.value)
        with pytest.raises(ValueError, match="d_k'=49 with d_v=128"):
            GatedDeltaNetAdapter.check_reduction(64, 128, 49)
        GatedDeltaNetAdapter.check_reduction(64, 128, 48)


class TestGatedDeltaNetGVA(TestGatedDeltaNet):
    overrides = {"num_v_heads": 4}
    expected_dims = (2, 4, 32, 64)


class TestGatedDeltaNetNoGate(TestGatedDeltaNet):
    overrides = {"use_gate": False}
