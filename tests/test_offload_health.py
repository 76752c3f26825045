"""Offload over many steps: the pinned pool is made once and reused, host and device memory stay flat, and the
step trains bit for bit like the same plan without offload."""

import copy
import os
import re
import warnings

import numpy as np
import pytest
import torch
from conftest import gpu, tiny_spec
from test_rewrite import captured, quick_profile

import acstudio
from acstudio import hostcopy
from acstudio.capture import capture_step
from acstudio.cli import main
from acstudio.export import export
from acstudio.hostcopy import PAGE_BYTES, CpuOffloadWarning, HostMemoryError, OffloadRuntime, pinned_bytes
from acstudio.plan.schedule import PlanContext
from acstudio.rewrite import offload as runtime_module
from acstudio.rewrite import rewrite_step
from acstudio.simulate.simulator import Simulator
from acstudio.workload import build_workload
from acstudio.workload.spec import make_optimizer

STEPS = 50
# Large enough that a pool or host buffer leaked per step (50 of them) would be seen above the allocator's noise.
SMALL_GPT2 = (("n_layer", "2"), ("n_embd", "64"), ("n_head", "2"), ("vocab_size", "120"), ("n_positions", "64"))


def resident_bytes() -> int:
    """This process's resident set size."""
    try:
        import psutil
    except ImportError:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return psutil.Process().memory_info().rss


def offload_and_plain(device: torch.device):
    """A small GPT-2 on ``device``, its step rewritten to offload every activation it can and, for comparison,
    left as captured (no activation is recomputed in either)."""
    spec = tiny_spec("gpt2", batch_size=4, seq_len=64, config=SMALL_GPT2)
    w = build_workload(spec).to(device)
    opt = w.make_optimizer()
    step = capture_step(w.model, opt, w.batch, w.loss_fn)
    profile = quick_profile(spec, step)
    sim = Simulator(profile)
    offloaded = [sim.replay.act_ids[k] for k in np.flatnonzero(sim.offload_facts.offloadable)]
    return spec, w, opt, rewrite_step(step, profile, [], offloaded=offloaded), rewrite_step(step, profile, [])


def fresh_copy(w, opt, spec):
    model = copy.deepcopy(w.model)
    optimizer = make_optimizer(spec.optimizer, model.parameters())
    optimizer.load_state_dict(copy.deepcopy(opt.state_dict()))
    return model, optimizer


class CountedPool:
    """Counts how often ``runtime`` allocates its pool (``ensure_pool`` finding none)."""

    def __init__(self, runtime: OffloadRuntime) -> None:
        self.made = 0
        original = runtime.ensure_pool

        def ensure_pool(device):
            self.made += runtime.pool is None
            original(device)

        runtime.ensure_pool = ensure_pool


def train(step, model, optimizer, batch, after_step=None) -> list[torch.Tensor]:
    losses = []
    for i in range(STEPS):
        torch.manual_seed(i)  # GPT-2's dropout draws the same masks in both runs
        losses.append(step.run(model, optimizer, batch).cpu())  # kept on the device, they would grow its memory
        if after_step is not None:
            after_step(i)
    return losses


def assert_trained_alike(losses, model, plain_losses, plain_model) -> None:
    assert all(torch.equal(a, b) for a, b in zip(losses, plain_losses, strict=True))
    for p, q in zip(model.parameters(), plain_model.parameters(), strict=True):
        assert torch.equal(p, q) and torch.equal(p.grad, q.grad)


def test_fifty_cpu_steps_reuse_one_pool_and_keep_host_memory_flat():
    spec, w, opt, step, plain = offload_and_plain(torch.device("cpu"))
    runtime = getattr(step.gm, runtime_module.RUNTIME_ATTR)
    pool = CountedPool(runtime)
    model, optimizer = fresh_copy(w, opt, spec)
    seen, rss = [], []

    def after_step(i):
        seen.append((id(runtime.pool), tuple(s.data_ptr() for s in runtime.slots), len(runtime.layouts)))
        rss.append(resident_bytes())

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CpuOffloadWarning)
        losses = train(step, model, optimizer, w.batch, after_step)
    assert [type(c.message) for c in caught] == [CpuOffloadWarning], "warned once, when the pool was made"
    assert "run it on a GPU" in str(caught[0].message)
    assert pool.made == 1 and len(set(seen)) == 1 and seen[0][2] == len(step.offloads)
    assert runtime.pool_bytes == sum(o.bytes for o in step.offloads) > 2**20
    # a pool (or the copies' host buffers) leaked by every step would add 48 pools after the second step
    assert rss[-1] - rss[1] < 4 * runtime.pool_bytes, [r // 2**20 for r in rss[::10]]
    plain_model, plain_optimizer = fresh_copy(w, opt, spec)
    assert_trained_alike(losses, model, train(plain, plain_model, plain_optimizer, w.batch), plain_model)


@gpu
def test_fifty_cuda_steps_keep_the_device_peak_and_host_memory_flat():
    dev = torch.device("cuda")
    spec, w, opt, step, plain = offload_and_plain(dev)
    runtime = getattr(step.gm, runtime_module.RUNTIME_ATTR)
    pool = CountedPool(runtime)
    model, optimizer = fresh_copy(w, opt, spec)
    peaks, allocated, rss = [], [], []

    def after_step(i):
        torch.cuda.synchronize(dev)
        peaks.append(torch.cuda.max_memory_allocated(dev))
        allocated.append(torch.cuda.memory_allocated(dev))
        rss.append(resident_bytes())
        torch.cuda.reset_peak_memory_stats(dev)

    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    losses = train(step, model, optimizer, w.batch, after_step)
    assert pool.made == 1 and runtime.pool.locked_bytes == pinned_bytes(runtime.pool_bytes)
    assert len(set(peaks[2:])) == 1, f"device peak moved after step 2: {sorted(set(peaks[2:]))}"
    assert len(set(allocated[2:])) == 1, f"memory left allocated grew: {sorted(set(allocated[2:]))}"
    assert rss[-1] - rss[1] < 64 * 2**20, [r // 2**20 for r in rss[::10]]
    plain_model, plain_optimizer = fresh_copy(w, opt, spec)
    torch.cuda.reset_peak_memory_stats(dev)
    plain_losses = train(plain, plain_model, plain_optimizer, w.batch)
    assert_trained_alike(losses, model, plain_losses, plain_model)


TOO_LITTLE_HOST_MEMORY = r"the plan offloads .+ of activations.* but the host has only .+ free — .*--no-offload"


def offload_plan_files(tmp_path):
    """A tiny GPT-2's profile and a plan that offloads half of what it can (and recomputes two activations)."""
    *_, profile = captured("gpt2")
    ctx = PlanContext(profile)
    offloadable = np.flatnonzero(ctx.sim.offload_facts.offloadable)
    plan = ctx.plan_for_set("mutwo", profile.peak_bytes, ctx.rg.candidates[:2], offloaded=offloadable[::2])
    assert plan.offloaded
    profile.save(tmp_path / "profile.json")
    plan.save(tmp_path / "plan.json")
    return profile, plan


def test_cli_on_a_host_without_the_free_memory_says_so_in_one_line(tmp_path, capsys, monkeypatch):
    offload_plan_files(tmp_path)
    monkeypatch.setattr(hostcopy, "host_available_bytes", lambda: 1024)
    assert main(["verify", str(tmp_path / "profile.json"), "--plan", str(tmp_path / "plan.json")]) == 2
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert re.fullmatch(f"acstudio: error: {TOO_LITTLE_HOST_MEMORY}", lines[-1])
    assert not out.startswith(("PASSED", "FAILED"))
    assert not [line for line in lines if "Traceback" in line or "HostMemoryError" in line or "offloads activations"
                in line], "no traceback, and no CPU warning: the pool is checked before it is made"


def test_load_step_on_a_host_without_the_free_memory_refuses_before_the_first_step(tmp_path, monkeypatch):
    profile, plan = offload_plan_files(tmp_path)
    export(profile, plan, tmp_path / "out")
    monkeypatch.setattr(hostcopy, "host_available_bytes", lambda: 1024)
    w = build_workload(tiny_spec("gpt2"))
    before = [p.detach().clone() for p in w.model.parameters()]
    with pytest.raises(HostMemoryError, match=f"^{TOO_LITTLE_HOST_MEMORY}$"):
        acstudio.load_step(tmp_path / "out", w.model, w.make_optimizer())
    assert all(torch.equal(a, b) for a, b in zip(before, w.model.parameters()))


def test_pinned_pool_is_checked_at_the_pages_it_locks():
    page = PAGE_BYTES
    assert [pinned_bytes(n) for n in (1, page - 1, page, page + 1, 2**30 + 1)] == [page, page, page, 2 * page,
                                                                                  2**30 + page]


def pool_made_with_free_bytes(step, w, opt, spec, free: int, monkeypatch) -> OffloadRuntime:
    """Run one step of ``step`` with the host reporting ``free`` bytes available; returns its runtime."""
    monkeypatch.setattr(hostcopy, "host_available_bytes", lambda: free)
    model, optimizer = fresh_copy(w, opt, spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CpuOffloadWarning)
        step.run(model, optimizer, w.batch)
    return getattr(step.gm, runtime_module.RUNTIME_ATTR)


def test_a_cpu_pool_takes_exactly_its_bytes(monkeypatch):
    spec, w, opt, step, _ = offload_and_plain(torch.device("cpu"))
    needed = getattr(step.gm, runtime_module.RUNTIME_ATTR).pool_bytes
    with pytest.raises(HostMemoryError, match=f"^{TOO_LITTLE_HOST_MEMORY}$"):
        pool_made_with_free_bytes(step, w, opt, spec, needed - 1, monkeypatch)
    assert pool_made_with_free_bytes(step, w, opt, spec, needed, monkeypatch).pool.data.numel() == needed


@gpu
def test_a_cuda_pool_needs_and_locks_the_pages_it_spans(monkeypatch):
    spec, w, opt, step, _ = offload_and_plain(torch.device("cuda"))
    pool_bytes = getattr(step.gm, runtime_module.RUNTIME_ATTR).pool_bytes
    needed = pinned_bytes(pool_bytes)
    with pytest.raises(HostMemoryError, match=f"^{TOO_LITTLE_HOST_MEMORY}$"):
        pool_made_with_free_bytes(step, w, opt, spec, needed - 1, monkeypatch)
    assert pool_made_with_free_bytes(step, w, opt, spec, needed, monkeypatch).pool.locked_bytes == needed


@pytest.mark.parametrize("files, expected_room", [
    ({"memory.max": "4096\n", "memory.current": "1024\n"}, 3072),
    ({"memory.max": "max\n", "memory.current": "1024\n"}, None),
    ({"memory/memory.limit_in_bytes": "8192\n", "memory/memory.usage_in_bytes": "10000\n"}, 0),
    ({"memory/memory.limit_in_bytes": str(2**63 - 4096), "memory/memory.usage_in_bytes": "1"}, None),
    ({}, None),
])
def test_host_memory_counts_the_container_limit(tmp_path, files, expected_room, monkeypatch):
    """Inside a container the kernel kills a process at its cgroup's limit, whatever the host has free: the free
    memory the pool is checked against is never above the room left under that limit. (The host's free memory is
    fixed here: read twice from the live system, it moved between the reads when other processes ran.)"""
    from acstudio.hostcopy import cgroup_room_bytes, host_available_bytes

    assert hostcopy.free_host_bytes() > 0  # read from the live system (Linux: MemAvailable)
    unlimited = 5000
    monkeypatch.setattr(hostcopy, "free_host_bytes", lambda: unlimited)
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_room_bytes(tmp_path) == expected_room
    assert host_available_bytes(tmp_path / "absent") == unlimited
    assert host_available_bytes(tmp_path) == (unlimited if expected_room is None else min(unlimited, expected_room))
