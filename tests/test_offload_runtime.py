"""The offload runtime's calls: what the profiler times is what the step runs, the host pool is page-locked at its
exact size, and the copies come back bit for bit with the events made once."""

import warnings

import pytest
import torch
from conftest import gpu

from acstudio.errors import ACStudioError
from acstudio.hostcopy import PAGE_BYTES, CpuOffloadWarning, OffloadRuntime, PageLocked, pinned_bytes, storage_bytes
from acstudio.profiler import offload_calls


class NotingRuntime(OffloadRuntime):
    """Notes every call of the four methods the step's nodes make, in order."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.calls: list[tuple[str, int]] = []

    def to_host(self, slot, tensor):
        self.calls.append(("to_host", slot))
        return super().to_host(slot, tensor)

    def release(self, slot, tensors):
        self.calls.append(("release", slot))
        return super().release(slot, tensors)

    def prefetch(self, slot):
        self.calls.append(("prefetch", slot))
        return super().prefetch(slot)

    def wait(self, slot, buffer):
        self.calls.append(("wait", slot))
        return super().wait(slot, buffer)


def cpu_runtime(cls, tensors):
    runtime = cls([f"a{j}" for j in range(len(tensors))], [t.untyped_storage().nbytes() for t in tensors])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CpuOffloadWarning)
        runtime.ensure_pool(tensors[0].device)
    return runtime


def test_the_profiler_times_the_runtimes_own_calls_in_the_steps_order():
    base = torch.arange(40, dtype=torch.float64)
    tensors = [torch.randn(5, 7), base[3:].view(37)[::2], torch.randint(0, 9, (3, 4), dtype=torch.int16).t()]
    runtime = cpu_runtime(NotingRuntime, tensors)
    copy_out, copy_back = offload_calls(runtime, tensors)
    for j in range(len(tensors)):
        copy_out(j)
    back = [copy_back(j) for j in range(len(tensors))]
    assert runtime.calls == [(m, j) for j in range(3) for m in ("to_host", "release")] + \
        [(m, j) for j in range(3) for m in ("prefetch", "wait")]
    for b, t in zip(back, tensors, strict=True):
        assert torch.equal(b, t) and b.stride() == t.stride() and b.storage_offset() == t.storage_offset()
        assert b.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()  # a copy, not the original


def test_a_cpu_pool_takes_its_exact_bytes_and_locks_none():
    pool = PageLocked(PAGE_BYTES + 3, torch.device("cpu"))
    assert pool.data.numel() == PAGE_BYTES + 3 and pool.locked_bytes == 0


def test_a_step_that_holds_fewer_bytes_than_profiled_copies_those_and_one_that_holds_more_is_refused():
    small = torch.randn(10)
    runtime = cpu_runtime(OffloadRuntime, [torch.empty(16)])
    runtime.to_host(0, small)
    runtime.release(0, (small,))
    assert runtime.nbytes == [40] and torch.equal(runtime.wait(0, runtime.prefetch(0))[0], small)
    with pytest.raises(ACStudioError, match="holds 80 bytes, more than the 64 its profile measured"):
        runtime.to_host(0, torch.randn(20))


@gpu
def test_a_cuda_pool_is_page_locked_at_its_exact_size_and_unlocked_when_freed():
    nbytes = 3 * PAGE_BYTES + 5
    pool = PageLocked(nbytes, torch.device("cuda"))
    assert pool.data.numel() == nbytes and pool.data.data_ptr() % PAGE_BYTES == 0
    assert pool.locked_bytes == pinned_bytes(nbytes) == 4 * PAGE_BYTES
    source = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    pool.data.copy_(source, non_blocking=True)
    back = torch.empty_like(source)
    back.copy_(pool.data, non_blocking=True)
    assert torch.equal(back, source)
    ptr = pool.data.data_ptr()
    pool.free()
    cudart = torch.cuda.cudart()
    assert int(cudart.cudaHostRegister(ptr, nbytes, 0)) == 0, "the pages were unlocked"
    assert int(cudart.cudaHostUnregister(ptr)) == 0


@gpu
def test_cuda_copies_come_back_bitwise_while_the_released_memory_is_reused_and_make_no_events(monkeypatch):
    dev = torch.device("cuda", torch.cuda.current_device())
    shapes = [(257, 129), (8 * 2**20,), (33, 17)]
    runtime = OffloadRuntime([f"a{j}" for j in range(3)], [4 * s[0] * (s[1] if len(s) > 1 else 1) for s in shapes])
    runtime.ensure_pool(dev)
    made = []
    event = torch.cuda.Event
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: made.append(1) or event(*a, **k))
    for step in range(3):
        torch.cuda._sleep(50_000_000)  # what follows queues behind the compute stream
        tensors = [torch.randn(s, device=dev) + step for s in shapes]
        views = [tensors[0], tensors[1][7:], tensors[2].t()]
        expected = [storage_bytes(t).clone() for t in tensors]
        for j, (t, v) in enumerate(zip(tensors, views)):
            runtime.to_host(j, t)
            runtime.release(j, (v,))
        sizes = [t.untyped_storage().nbytes() for t in tensors]
        del tensors, views, t, v
        junk = [torch.full((n,), 0xA5, dtype=torch.uint8, device=dev) for n in sizes]  # takes the freed blocks
        back = [runtime.wait(j, runtime.prefetch(j))[0] for j in range(3)]
        assert [torch.equal(storage_bytes(b), e) for b, e in zip(back, expected)] == [True] * 3
        assert back[2].stride() == (1, 17) and back[1].storage_offset() == 7
        del junk
    assert not made, "the events are made once, with the pool"
