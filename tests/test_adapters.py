"""Adapter contract: every family maps config, modules, capture points and state shapes the same way.

One abstract contract class, one subclass per family/variant (DeltaNet; Gated DeltaNet; GDN with grouped
value heads; GDN without output gate; Mamba-2; Qwen3.5). Tiny random models on CPU (``tests/_models.py``).
Each subclass names, independently of the adapter, where its layer's q/k channels and kernel calls are.
"""

from __future__ import annotations

import json
import math

import fla.layers.attn
import fla.layers.delta_net
import fla.layers.gated_deltanet
import numpy as np
import transformers.models.mamba2.modeling_mamba2 as mamba2_modeling
import transformers.models.qwen3_5.modeling_qwen3_5 as qwen_modeling
import pytest
import torch

from _models import tiny_arch, tiny_inputs, tiny_model
from statereduce.adapters import (
    DeltaNetAdapter,
    GatedDeltaNetAdapter,
    Mamba2Adapter,
    LinearAttentionAdapter,
    Qwen35Adapter,
    adapter_class,
    adapter_families,
    adapter_for_config,
    get_adapter,
)
from statereduce.families import FamilySpec
from statereduce.core.models import tiny_config


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

    def test_gives_every_member_its_spec_and_adapter_declare(self):
        """What a family must give: the abstract methods (ABC refuses the class without them) and the class attributes
        that FamilySpec and LinearAttentionAdapter declare without a value; the spec registered for the family is
        the adapter's base, and the q/k conv-sharing fact agrees with the layout's own q/k convs."""
        from statereduce.families import family_spec

        cls = self.adapter_cls
        assert not cls.__abstractmethods__
        declared = {name for base in (FamilySpec, LinearAttentionAdapter) for name in base.__annotations__
                    if name not in vars(base)}
        missing = sorted(name for name in declared if not hasattr(cls, name))
        assert not missing, f"{cls.__name__} lacks {missing}"
        assert issubclass(cls, family_spec(self.family)) and family_spec(self.family).family == self.family
        from statereduce.adapters.mixer_layout import MixerLayout

        assert issubclass(cls.mixer_layout, MixerLayout)
        assert cls.qk_conv_modules == (cls.mixer_layout.qk_convs is not MixerLayout.qk_convs)

    def test_sized_arch_has_the_head_sizes_asked_for(self):
        arch = self.adapter_cls.sized_arch(128, 3, 2, 16, 32)
        dims = self.adapter_cls.dims(tiny_config(self.family, arch))
        assert (dims.num_heads, dims.head_k_dim, dims.head_v_dim) == (2, 16, 32)
        assert len(self.adapter_cls.mixer_layer_indices(tiny_config(self.family, arch))) >= 2

    def test_dims_from_config_match_modules(self, model, config):
        h, hv, d_k, d_v = self.adapter_cls.dims(config)
        assert (h, hv, d_k, d_v) == self.expected_dims
        adapter = get_adapter(model)
        assert (adapter.num_heads, adapter.head_k_dim) == (h, d_k)
        for layout in adapter.layouts():
            mixer = layout.mixer
            assert layout.key_dim == d_k and adapter.layout(mixer).layer == layout.layer
            wq, wk = layout.qk_weights()
            assert wq.shape == wk.shape == (h * d_k, config.hidden_size)
            ref_q, ref_k = self.reference_qk_weights(mixer)
            assert torch.equal(wq, ref_q) and torch.equal(wk, ref_k)
            self.check_modules(mixer, (h, hv, d_k, d_v))

    def reference_qk_weights(self, mixer) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_q, W_k) [H*d_k, hidden] read from the layer by hand (the family's documented layout)."""
        return mixer.q_proj.weight, mixer.k_proj.weight

    def check_modules(self, mixer, dims) -> None:
        h, hv, d_k, d_v = dims
        assert mixer.q_conv1d.weight.shape == mixer.k_conv1d.weight.shape == (h * d_k, 1, 4)
        assert mixer.v_proj.out_features == hv * d_v
        assert mixer.o_norm.weight.shape == (d_v,)

    def block_mixer(self, model, i):
        """The mixer of decoder layer i, found by hand."""
        return model.model.layers[i].attn

    def test_arch_dims_match_config(self, config):
        """``arch_dims`` (config validation, no fla) gives the dims of the built config."""
        arch = {k: getattr(config, k) for k in self.adapter_cls.config_defaults if hasattr(config, k)}
        assert self.adapter_cls.arch_dims(arch) == self.adapter_cls.dims(config) == self.expected_dims

    def test_mixer_layers(self, model, config):
        adapter = get_adapter(model)
        layers = adapter.mixer_layers()
        assert [i for i, _ in layers] == self.adapter_cls.mixer_layer_indices(config) == [0, 1]
        assert all(mixer is self.block_mixer(model, i) for i, mixer in layers)
        assert [lay.layer for lay in adapter.layouts()] == [0, 1]
        with pytest.raises(ValueError, match="is not a linear-attention mixer of this"):
            adapter.layout(model.get_input_embeddings())

    def test_state_shape_matches_cache(self, model):
        adapter = get_adapter(model)
        shape = adapter.state_shape()
        h, hv, d_k, d_v = self.expected_dims
        assert (shape.num_heads, shape.d_k, shape.d_v) == (hv, d_k, d_v)
        with torch.no_grad():
            out = model(tiny_inputs(batch=3, length=8), use_cache=True)
        cache = out.past_key_values if getattr(out, "cache", None) is None else out.cache
        for i, _ in adapter.mixer_layers():
            state, convs = self.cached_layer_state(cache, i)
            assert state.numel() == 3 * shape.recurrent_elems
            assert sum(c.shape[1] for c in convs) == shape.conv_channels
            assert all(c.shape[0] == 3 and c.shape[2] == shape.conv_width for c in convs)
        states = adapter.recurrent_states(cache)
        assert sorted(states) == [i for i, _ in adapter.mixer_layers()]
        assert all(s.shape == (3, hv, d_v, d_k) for s in states.values())
        assert adapter.state_bytes() == 2 * hv * d_k * d_v * 4

    def cached_layer_state(self, cache, i) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(recurrent state, conv states) of layer i in the model's cache, read by hand."""
        return cache[i]["recurrent_state"], list(cache[i]["conv_state"])

    def test_reduced_config_round_trips_every_d_k(self, config, tmp_path):
        h, hv, d_k, d_v = self.expected_dims
        before = config.to_dict()
        for d_k_new in range(1, d_k + 1):
            new = self.adapter_cls.reduced_config(config, d_k_new)
            new.to_json_file(tmp_path / "config.json")  # as save_pretrained writes it (Mamba-2's inf limit included)
            reloaded = type(config).from_json_file(tmp_path / "config.json")
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
        assert tuple(self.adapter_cls.dims(adapter.reduced_config(adapter.config, 8)))[2] == 8
        assert adapter.config is model.config

    # ---- capture --------------------------------------------------------------------------------
    def _record_kernel_inputs(self, monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Rebind the kernel globals to a recorder of (q, k) as the kernel receives them (independent of capture)."""
        seen: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name in self.kernel_names:
            fn = getattr(self.kernel_module, name)

            def recorder(*args, _fn=fn, _name=name, **kwargs):
                q, k = self.kernel_qk(_name, args, kwargs)
                seen.append((q.clone(), k.clone()))
                return _fn(*args, **kwargs)

            monkeypatch.setattr(self.kernel_module, name, recorder)
        return seen

    def kernel_qk(self, name: str, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, k) [B, T, H, d_k] of a call of kernel ``name``: fla's layers pass them as keywords."""
        return kwargs["q"], kwargs["k"]

    def x_module(self, mixer):
        """The projection whose input is x, found by hand."""
        return mixer.q_proj

    def conv_module(self, mixer):
        return mixer.q_conv1d

    @pytest.mark.parametrize(
        "use_cache,length", [(False, 12), (True, 12), (False, 80)], ids=["no-cache", "cache", "no-cache-chunk"]
    )
    def test_capture_equals_kernel_input(self, model, monkeypatch, use_cache, length):
        adapter = get_adapter(model)
        h, _, d_k, _ = self.expected_dims
        kernel_seen = self._record_kernel_inputs(monkeypatch)
        x_seen, conv_calls = [], []
        for _, mixer in adapter.mixer_layers():
            self.x_module(mixer).register_forward_pre_hook(lambda m, args: x_seen.append(args[0].clone()))
            self.conv_module(mixer).register_forward_hook(lambda *a: conv_calls.append(1))
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

    def test_capture_in_cached_decode_steps(self, model, monkeypatch):
        """A prefill with a cache, then one-token steps: every step's kernel call is captured with T = 1."""
        adapter = get_adapter(model)
        h, _, d_k, _ = self.expected_dims
        inputs = tiny_inputs(batch=2, length=9)
        with torch.no_grad():
            out = model(inputs[:, :6], use_cache=True)
        cache = out.past_key_values if getattr(out, "cache", None) is None else out.cache
        kernel_seen = self._record_kernel_inputs(monkeypatch)
        qk = []
        with torch.no_grad(), adapter.capture(on_qk=lambda i, q, k: qk.append((i, q.clone(), k.clone()))):
            for t in range(6, 9):
                out = model(inputs[:, t : t + 1], **{adapter.cache_argument: cache}, use_cache=True)
                cache = out.past_key_values if getattr(out, "cache", None) is None else out.cache
        assert [i for i, *_ in qk] == [0, 1] * 3 and len(kernel_seen) == 6
        for (_, q, k), (kq, kk) in zip(qk, kernel_seen):
            assert q.shape == k.shape == (2, 1, h, d_k)
            assert torch.equal(q, kq) and torch.equal(k, kk)

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


class FlaContract(AdapterContract):
    """The fla families: hybrids through fla's ``attn`` config field."""

    def test_mixer_layers_skip_softmax_attention(self, monkeypatch):
        # fla's Attention refuses to be built without flash-attn; construction is all this test needs
        monkeypatch.setattr(fla.layers.attn, "flash_attn_func", object())
        model = tiny_model(self.family, attn={"layers": [1], "num_heads": 2}, **self.overrides)
        assert type(model.model.layers[1].attn).__name__ == "Attention"
        assert [i for i, _ in get_adapter(model).mixer_layers()] == [0]
        assert self.adapter_cls.mixer_layer_indices(model.config) == [0]


class TestDeltaNet(FlaContract):
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


class TestGatedDeltaNet(FlaContract):
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


class TestMamba2(AdapterContract):
    """B and C per group in the fused in_proj [z | x | B | C | dt] and conv1d [x | B | C] (I = 128, G = 2, N = 32)."""

    family = "mamba2"
    adapter_cls = Mamba2Adapter
    kernel_module = mamba2_modeling
    kernel_names = ("mamba2_chunk_scan", "mamba2_selective_state_update")
    expected_dims = (2, 8, 32, 16)

    def reference_qk_weights(self, mixer):
        w = mixer.in_proj.weight  # [z 128 | x 128 | B 64 | C 64 | dt 8]
        return w[320:384], w[256:320]

    def check_modules(self, mixer, dims):
        assert mixer.in_proj.out_features == 2 * 128 + 2 * 2 * 32 + 8
        assert mixer.conv1d.weight.shape == (128 + 2 * 2 * 32, 1, 4) and mixer.conv1d.bias is not None

    def block_mixer(self, model, i):
        return model.backbone.layers[i].mixer

    def cached_layer_state(self, cache, i):
        return cache.get_recurrent_state(i, state_idx=0), [cache.get_conv_state(i, state_idx=0)]

    def kernel_qk(self, name, args, kwargs):
        if name == "mamba2_chunk_scan":  # (hidden_states, dt, A, B, C, ...)
            return args[4], args[3]
        return args[5].unsqueeze(1), args[4].unsqueeze(1)  # (state, hidden_states, dt, A, B, C, ...)

    def x_module(self, mixer):
        return mixer.in_proj

    def conv_module(self, mixer):
        return mixer.conv1d

    def check_conv_path(self, use_cache, conv_calls):
        assert conv_calls == []  # the conv weight is used functionally: module hooks never fire

    def test_state_size_written(self, config):
        assert Mamba2Adapter.config_updates(config, 16) == {"state_size": 16}
        assert type(Mamba2Adapter.reduced_config(config, 16).state_size) is int

    def test_loads_through_transformers_class_not_flas(self, tmp_path):
        """fla's ``mamba2`` registration overrides the Auto mapping; load_model uses transformers' class."""
        from transformers import AutoConfig, Mamba2ForCausalLM

        from statereduce.core.models import load_model
        from statereduce.core.tokenizer import byte_level_tokenizer

        model = tiny_model("mamba2")
        model.save_pretrained(tmp_path)
        byte_level_tokenizer().save_pretrained(tmp_path)
        auto_config = AutoConfig.from_pretrained(tmp_path)
        assert type(auto_config).__module__.startswith("fla.")  # what AutoModelForCausalLM would build
        loaded, _ = load_model(tmp_path)
        assert type(loaded) is Mamba2ForCausalLM
        inputs = tiny_inputs()
        with torch.no_grad():
            assert torch.equal(loaded(inputs).logits, model(inputs).logits)

    def test_past_key_values_is_ignored_but_cache_continues(self, model):
        """The trap the adapter's ``cache_argument`` avoids: ``past_key_values=`` silently starts afresh."""
        inputs = tiny_inputs(length=10)
        with torch.no_grad():
            full = model(inputs).logits[:, -1]
            first = model(inputs[:, :9], use_cache=True).cache
            ignored = model(inputs[:, 9:], past_key_values=first, use_cache=True).logits[:, -1]
            first = model(inputs[:, :9], use_cache=True).cache
            kept = model(inputs[:, 9:], **{Mamba2Adapter.cache_argument: first}, use_cache=True).logits[:, -1]
        assert (ignored - full).abs().max() > 1e-3
        assert torch.allclose(kept, full, atol=1e-5)


class TestQwen35(AdapterContract):
    """Gated DeltaNet layers 0 and 1 (in_proj_qkv [q | k | v], conv1d the same), softmax attention in layer 2."""

    family = "qwen3_5"
    adapter_cls = Qwen35Adapter
    kernel_module = qwen_modeling
    kernel_names = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
    expected_dims = (2, 4, 32, 16)

    def reference_qk_weights(self, mixer):
        w = mixer.in_proj_qkv.weight  # [q 64 | k 64 | v 64]
        return w[:64], w[64:128]

    def check_modules(self, mixer, dims):
        assert mixer.in_proj_qkv.out_features == 64 + 64 + 4 * 16
        assert mixer.conv1d.weight.shape == (192, 1, 4) and mixer.conv1d.bias is None
        assert mixer.in_proj_z.out_features == 4 * 16 and mixer.norm.weight.shape == (16,)

    def block_mixer(self, model, i):
        return model.model.layers[i].linear_attn

    def cached_layer_state(self, cache, i):
        state = cache.get_recurrent_state(i, state_idx=0)  # [B, HV, d_k, d_v]
        return state, [cache.get_conv_state(i, state_idx=0)]

    def kernel_qk(self, name, args, kwargs):
        return args[0], args[1]  # (query, key, value, ...)

    def x_module(self, mixer):
        return mixer.in_proj_qkv

    def conv_module(self, mixer):
        return mixer.conv1d

    def check_conv_path(self, use_cache, conv_calls):
        assert conv_calls == []

    def test_softmax_layer_is_not_a_mixer(self, model):
        assert type(model.model.layers[2].self_attn).__name__ == "Qwen3_5Attention"
        assert [i for i, _ in get_adapter(model).mixer_layers()] == [0, 1]

    def test_key_head_dim_written(self, config):
        assert Qwen35Adapter.config_updates(config, 16) == {"linear_key_head_dim": 16}

    def test_cpu_fallback_dispatches_by_device(self):
        """With fla installed transformers binds fla's Triton kernel; CPU tensors go to transformers' torch one: the
        installed function gives on CPU exactly what the torch implementation gives, and the dispatcher sends
        tensors of other devices to the stock function."""
        from statereduce.adapters.qwen3_5 import _device_dispatch

        Qwen35Adapter.install_fallbacks()
        Qwen35Adapter.install_fallbacks()  # idempotent
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 8, 2, 16, generator=g) for _ in range(3))
        gate, beta = -torch.rand(1, 8, 2, generator=g), torch.rand(1, 8, 2, generator=g)
        for name in self.kernel_names:
            fn = getattr(qwen_modeling, name)
            stock = fn._statereduce_stock
            assert getattr(stock, "_statereduce_stock", None) is None
            assert fn.__wrapped__ is stock
            reference = getattr(stock, "__wrapped__", stock)  # transformers' own torch implementation
            got, state = fn(q, k, v, gate, beta, output_final_state=True)
            want, want_state = reference(q, k, v, gate, beta, output_final_state=True)
            assert torch.equal(got, want) and torch.equal(state, want_state)
        routed = _device_dispatch(lambda *a, **kw: "stock", lambda *a, **kw: "reference", ("cpu",))
        assert routed(q) == "reference" and routed(q.to("meta")) == "stock"

    def test_vision_language_checkpoint_loads_as_its_text_model(self, tmp_path):
        """Qwen3.5 hub checkpoints are vision-language models: ``load_model`` gives the text model (same logits),
        and its pruned checkpoint is a text-model checkpoint that reloads."""
        from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration

        from statereduce.core.models import load_model
        from statereduce.stages.prune import prune_model, save_pruned
        from statereduce.core.tokenizer import byte_level_tokenizer

        vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}
        torch.manual_seed(0)
        vlm = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=tiny_arch("qwen3_5"), vision_config=vision))
        vlm.eval().save_pretrained(tmp_path / "vlm")
        byte_level_tokenizer().save_pretrained(tmp_path / "vlm")
        model, tokenizer = load_model(tmp_path / "vlm")
        assert type(model).__name__ == "Qwen3_5ForCausalLM" and model.config.model_type == "qwen3_5_text"
        inputs = tiny_inputs(length=12)
        with torch.no_grad():
            assert torch.equal(model(inputs).logits, vlm(input_ids=inputs).logits)
        keep = {i: torch.arange(16).repeat(2, 1) for i in (0, 1)}
        save_pruned(model, tokenizer, prune_model(model, keep, {"method": "first", "pct": 50}), tmp_path / "pruned")
        reloaded, _ = load_model(tmp_path / "pruned")
        assert reloaded.config.linear_key_head_dim == 16
        with torch.no_grad():
            assert torch.equal(reloaded(inputs).logits, model(inputs).logits)


# ---- one registry of families -------------------------------------------------------------------------------------
def test_one_registry_holds_each_familys_spec_and_adapter():
    from statereduce.families import family_names, family_spec
    from statereduce.families.base import registered

    for family in family_names():
        entry = registered(family)
        assert entry.spec is family_spec(family) and entry.adapter is adapter_class(family)
        assert issubclass(entry.adapter, entry.spec)


def test_an_adapter_registered_twice_or_outside_its_spec_is_refused():
    from statereduce.adapters import register_adapter
    from statereduce.adapters.deltanet import DeltaNetAdapter
    from statereduce.adapters.mamba2 import Mamba2Adapter

    with pytest.raises(ValueError, match=r"^adapter family 'delta_net' registered twice$"):
        register_adapter(type("Again", (DeltaNetAdapter,), {}))
    with pytest.raises(TypeError, match=r"^adapter Stray does not subclass the spec of family 'delta_net'$"):
        register_adapter(type("Stray", (Mamba2Adapter,), {"family": "delta_net"}))
    with pytest.raises(ValueError, match=r"^unknown model family 'rwkv'; valid: "):
        adapter_class("rwkv")
