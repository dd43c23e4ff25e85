"""The speed benchmark's flow without a GPU: its measurements replaced by a fake that reports each decode step's
bytes as its time (``statereduce.speed.bench.run_speed`` then runs on CPU)."""

from __future__ import annotations

import torch

from statereduce.speed import bench as speed


def fake_gpu(monkeypatch) -> list:
    """Patch the benchmark's GPU parts; return the list that collects the config of every model it builds."""
    import statereduce.kernels.recurrent as recurrent

    built = []

    def decode_cells(model, config, family, settings, bandwidth, on_cell):
        for batch in settings.batches:
            for kernel in settings.kernels:
                b = speed.step_bytes(model, config, family, batch)
                on_cell({"batch": batch, "kernel": kernel, "ms": b["total"] / 1e6, "bytes": b, "floor_fraction": 1})

    monkeypatch.setattr(speed, "require_cuda", lambda: None)
    monkeypatch.setattr(speed, "capture_stream", lambda: None)
    monkeypatch.setattr(speed, "copy_bandwidth", lambda: 4e12)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "none")
    monkeypatch.setattr(recurrent, "pdl_supported", lambda device: False)
    monkeypatch.setattr(speed, "decode_cells", decode_cells)
    monkeypatch.setattr(speed, "mixer_cells", lambda config, s, dtype, on_cell: on_cell({"batch": 1, "seq_len": 8,
                                                                                           "ms": 1.0}))
    build = speed.build_model
    monkeypatch.setattr(speed, "build_model", lambda config, dtype: built.append(config) or build(config, dtype, "cpu"))
    return built
