"""The offload peers in the bench: saved tensors on the host, with or without per-block checkpointing."""

import math

import pytest
import torch
from conftest import gpu, tiny_spec

from acstudio.bench.configs import BenchConfig
from acstudio.bench.steps import SideStreamOffload, on_host_in_forward
from acstudio.bench.worker import run_config
from acstudio.errors import ACStudioError
from acstudio.workload import build_workload


def test_offload_peers_are_registered_single_device_eager_baselined():
    for name in ("per-block+offload", "offload"):
        config = BenchConfig.parse(name)
        assert config.name == name and config.baseline == "eager" and config.parallel is None
        with pytest.raises(ACStudioError, match="single-device"):
            BenchConfig.parse(f"fsdp+{name}")


@pytest.mark.parametrize("config", ["per-block+offload", "offload"])
def test_offload_peers_train_like_eager_on_cpu(config):
    spec = tiny_spec("gpt2", batch_size=2)
    rows = {c: run_config({"spec": spec.to_dict(), "config": c, "device": "cpu", "warmup": 1, "iters": 2})
            for c in ("eager", config)}
    for r in rows.values():
        assert r["status"] == "ok", r["message"]
    assert math.isfinite(rows[config]["loss"]) and rows[config]["loss"] == pytest.approx(rows["eager"]["loss"])
    assert "host" in rows[config]["details"]["saved_on"]


def test_saved_on_cpu_around_the_forward_keeps_gradients():
    spec = tiny_spec("resnet18", batch_size=2)
    plain, on_host = build_workload(spec), build_workload(spec)
    on_host_in_forward(on_host.model, lambda: torch.autograd.graph.save_on_cpu(pin_memory=False))
    for w in (plain, on_host):
        w.loss_fn(w.model, w.batch).backward()
    for (name, p), q in zip(plain.model.named_parameters(), on_host.model.parameters()):
        assert torch.equal(p.grad, q.grad), name


@gpu
def test_side_stream_offload_moves_saved_tensors_to_pinned_memory_and_back():
    x = torch.randn(256, 256, device="cuda", requires_grad=True)
    hooks = SideStreamOffload(torch.device("cuda"))
    packed = hooks.pack(x.detach() * 2)
    assert packed[0].is_pinned() and packed[0].device.type == "cpu"
    assert torch.equal(hooks.unpack(packed), x.detach() * 2)
    with hooks:
        y = (x * 3).sin().sum()
    y.backward()
    assert torch.allclose(x.grad, 3 * (x.detach() * 3).cos())
