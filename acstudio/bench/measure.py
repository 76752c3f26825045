"""Time a training step and take its memory high-water mark, on a GPU or (for tests) on the CPU.

GPU: one CUDA event pair per step and ``max_memory_allocated`` over one full step after
``reset_peak_memory_stats`` (the method of shared/anchors, so numbers are comparable). CPU: host clock, and a
storage-accounting estimate of the peak (:class:`StorageTracker`), because the CPU allocator keeps no
statistics.
"""

from __future__ import annotations

import gc
import platform
import statistics
import sys
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from acstudio.errors import OutOfMemoryError

# Allocation failures that mean "does not fit" rather than a bug: the caching allocator's own error, and
# library workspace allocations that fail with a status code instead.
_OOM_TEXT = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED")


def is_out_of_memory(exc: BaseException) -> bool:
    """True for device OOM, also when torch.compile or our own profiler wrapped it in another exception."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (torch.OutOfMemoryError, OutOfMemoryError)):
            return True
        if any(text in str(e) for text in _OOM_TEXT):
            return True
        e = e.__cause__ or e.__context__
    return False


def summarize_ms(times: list[float]) -> dict[str, float]:
    """Median and inter-quartile range: robust to the odd slow step (GC, clock boost, another process)."""
    q1, q2, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return {"time_ms_median": q2, "time_ms_q1": q1, "time_ms_q3": q3, "time_ms_iqr": q3 - q1}


def time_steps(step: Callable[[], Any], iters: int, dev: torch.device, issued: list[float] | None = None
               ) -> list[float]:
    """Wall time of each of ``iters`` steps in ms; on CUDA measured between events on the current stream, and,
    into ``issued`` where given, the host's time to issue each step (until the step returns, before the device is
    done): well below the step's time where the device limits it, close to it where the host does."""
    times = []
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            step()
            if issued is not None:
                issued.append((time.perf_counter() - t0) * 1e3)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


ALLOCATOR_COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries")


def allocator_counters(dev: torch.device) -> dict[str, int]:
    """The caching allocator's cudaMalloc/cudaFree/retry counts (empty off CUDA): their growth over timed steps
    shows a step that does not fit the allocator's cache and pays for device allocations every iteration."""
    if dev.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(dev)
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR_COUNTERS}


class StorageTracker(TorchDispatchMode):
    """Live bytes of every storage an op creates, plus the storages registered up front, and their maximum.

    A storage counts from its first appearance as an op output until its Python object dies (torch keeps one
    Python object per storage, so a weak reference to it expires exactly when the memory is freed). Views and
    in-place results share their base's storage and are counted once. This matches what the CUDA caching
    allocator reports up to its 512-byte rounding, but only sees tensors made through the dispatcher.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, weakref.ref] = {}

    def track(self, tensors: Iterable[Any]) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._add(t.untyped_storage())

    def _add(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self._refs:
            return
        nbytes = storage.nbytes()
        self.live += nbytes
        self.peak = max(self.peak, self.live)

        def freed(_ref, key=key, nbytes=nbytes) -> None:
            self.live -= nbytes
            self._refs.pop(key, None)

        self._refs[key] = weakref.ref(storage, freed)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.track(tree_leaves(out))
        return out


def resident_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Any) -> list[torch.Tensor]:
    """Everything a step finds already allocated: parameters, their gradients, buffers, optimizer state, batch."""
    out: list[torch.Tensor] = []
    for p in model.parameters():
        out.append(p)
        if p.grad is not None:
            out.append(p.grad)
    out += list(model.buffers())
    for state in optimizer.state.values():
        out += [v for v in state.values() if isinstance(v, torch.Tensor)]
    out += [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]
    return out


def step_peak_bytes(step: Callable[[], torch.Tensor], dev: torch.device,
                    resident: Callable[[], list[torch.Tensor]]) -> tuple[int, int, torch.Tensor]:
    """Run one full step; return its high-water mark of allocated bytes, the bytes resident before it, its loss.

    The peak includes what was resident before the step (parameters, optimizer state, batch, last step's
    gradients), as ``max_memory_allocated`` does.
    """
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        loss = step()
        torch.cuda.synchronize(dev)
        return int(torch.cuda.max_memory_allocated(dev)), int(before), loss
    tracker = StorageTracker()
    tracker.track(resident())
    before = tracker.live
    with tracker:
        loss = step()
    return tracker.peak, before, loss


def environment(dev: torch.device) -> dict[str, Any]:
    """What a reader needs to compare numbers across machines."""
    env: dict[str, Any] = {
        "device_type": dev.type,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
    }
    if dev.type == "cuda" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(dev)
        env["gpu_memory_bytes"] = torch.cuda.get_device_properties(dev).total_memory
        env["cudnn"] = torch.backends.cudnn.version()
        env["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
    else:
        env["gpu"] = None
        env["cpu"] = platform.processor() or platform.machine()
        env["threads"] = torch.get_num_threads()
    for lib in ("torchvision", "transformers"):
        module = sys.modules.get(lib)
        env[lib] = getattr(module, "__version__", None) if module else None
    return env
