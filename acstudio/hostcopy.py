"""Copies of offloaded activations between the device and page-locked host memory, on side streams.

Both forms of offload copy through this module: the rewritten step's :class:`OffloadRuntime` (its graph nodes call
its four methods, :mod:`acstudio.rewrite.offload`) and the SAC export's saved-tensors hooks
(:mod:`acstudio.export.apply`); the profiler times :class:`OffloadRuntime`'s calls to price them
(:func:`acstudio.profiler.measure_host_link`).

The calls run on the host between the step's kernels, and many steps are host-bound (issuing the kernels takes as
long as running them), where every microsecond a call spends is a microsecond of step time. So each call makes as
few torch calls as it can: the events are made once per slot and recorded again every step (a stream's
``wait_stream`` would make and destroy one per call), the copy streams are entered with ``torch.cuda.set_stream``
and left the same way (``torch.cuda.stream``'s context manager costs several times that), and the per-slot state
sits in lists indexed by slot.

The host memory is page-locked at its exact size: torch's pinned allocator (``pin_memory=True``) rounds every
buffer up to a power of two and keeps all of it locked, up to twice what the copies use. Plain host memory is
registered with the driver instead (``cudaHostRegister``), page-aligned, and unregistered when it is freed.
"""

from __future__ import annotations

import os
import warnings
import weakref
from pathlib import Path

import torch

from acstudio.errors import ACStudioError

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class HostMemoryError(ACStudioError):
    """The host has not enough free memory for the pinned pool a plan's offload needs."""


class CpuOffloadWarning(UserWarning):
    """A plan with offload runs on a CPU device, where the copies save no memory."""


def host_available_bytes(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Host memory available to a new allocation without swapping (:func:`free_host_bytes`), or None where it
    cannot be read; inside a container with a memory limit, no more than the room left under that limit, since the
    kernel kills a process there before the host runs short."""
    free = free_host_bytes()
    room = cgroup_room_bytes(cgroup_root)
    if room is None:
        return free
    return room if free is None else min(free, room)


def free_host_bytes() -> int | None:
    """Linux ``MemAvailable``; elsewhere the free physical pages; None where neither can be read."""
    free = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if free is None:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):
            pass
    return free


def cgroup_room_bytes(root: Path) -> int | None:
    """The memory left under this process's cgroup limit (cgroup v2 ``memory.max`` less ``memory.current``, or
    v1's ``memory.limit_in_bytes`` less ``memory.usage_in_bytes``); None without a limit or where unreadable."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            limit = (root / limit_file).read_text().strip()
            usage = int((root / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2**60:  # "max" (v2) or a page-rounded huge number (v1): no limit
            return max(0, int(limit) - usage)
    return None


def pinned_bytes(nbytes: int) -> int:
    """Host memory that :class:`PageLocked` locks for ``nbytes``: the whole pages they span."""
    return -(-nbytes // PAGE_BYTES) * PAGE_BYTES


def check_host_memory(offloaded: int, device: torch.device) -> None:
    """Refuse a host without the free memory that ``offloaded`` bytes of host copies lock (one line, before the
    first step rather than a kernel OOM kill during it); on a CPU device say that the copies save nothing."""
    cuda = device.type == "cuda"
    needed = pinned_bytes(offloaded) if cuda else offloaded
    free = host_available_bytes()
    if free is not None and needed > free:
        raise HostMemoryError(f"the plan offloads {offloaded / 2**30:.2f} GiB of activations but the host has only "
                              f"{free / 2**30:.2f} GiB free — plan with a lower --host-memory, or with --no-offload")
    if not cuda:
        warnings.warn("this plan offloads activations but runs on a CPU device: they are copied into a host buffer "
                      "and back, which saves no memory — run it on a GPU for the savings", CpuOffloadWarning,
                      stacklevel=4)


class PageLocked:
    """``nbytes`` of host memory (``data``, uint8), page-locked for asynchronous copies with ``device`` where it is
    a GPU; unlocked once this object is freed (or :meth:`free` is called), after the device's copies are done."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        if device.type != "cuda":
            self.data = torch.empty(nbytes, dtype=torch.uint8)
            self._unlock = None
            return
        base = torch.empty(nbytes + PAGE_BYTES, dtype=torch.uint8)
        start = -base.data_ptr() % PAGE_BYTES  # pages of its own: a page locked twice is refused
        self.data = base[start:start + nbytes]
        cudart = torch.cuda.cudart()
        error = cudart.cudaHostRegister(self.data.data_ptr(), max(nbytes, 1), 0)
        if int(error):  # cudaSuccess is 0
            raise HostMemoryError(f"the host refused to page-lock {nbytes / 2**30:.2f} GiB for the offloaded "
                                  f"activations ({cudart.cudaGetErrorString(error)}) — plan with --no-offload")
        self._unlock = weakref.finalize(self, _unregister, base, self.data.data_ptr(), device)
        self._unlock.atexit = False  # the process is ending: the driver unlocks its memory itself

    @property
    def locked_bytes(self) -> int:
        return pinned_bytes(self.data.numel()) if self._unlock is not None else 0

    def free(self) -> None:
        if self._unlock is not None:
            self._unlock()


def _unregister(base: torch.Tensor, ptr: int, device: torch.device) -> None:
    """Unlock ``base``'s pages (held alive until here) once the copies in flight on ``device`` have read them."""
    torch.cuda.synchronize(device)
    torch.cuda.cudart().cudaHostUnregister(ptr)


def storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``tensor`` as a flat uint8 tensor (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


class CopyStreams:
    """The two copy streams of one device (out to the host, back to the device); ``issued``, an event recorded on
    the compute stream right before a copy is queued and waited for by its copy stream at once (a stream waits for
    an event as last recorded when it is told to, so one event serves every copy); and ``compute``, the stream the
    step runs on, as the last copy out read it.

    A copy is queued on its stream by making that stream current and the compute stream current again after it;
    that leaves the copies' device current, which it is already where a step runs (``load_step`` makes it so, and
    one process drives one GPU under DDP or FSDP)."""

    def __init__(self, device: torch.device) -> None:
        self.out_stream = torch.cuda.Stream(device)
        self.in_stream = torch.cuda.Stream(device)
        self.issued = torch.cuda.Event()
        self.compute: torch.cuda.Stream | None = None

    def copy(self, stream: torch.cuda.Stream, compute: torch.cuda.Stream, dst: torch.Tensor, src: torch.Tensor,
             done: torch.cuda.Event, after: torch.cuda.Event | None = None) -> None:
        """Queue ``dst.copy_(src)`` on ``stream`` (one of the two copy streams) behind the work queued on
        ``compute`` so far and, if given, the event ``after``; record ``done`` on ``stream`` once it is queued."""
        self.issued.record(compute)
        stream.wait_event(self.issued)
        if after is not None:
            stream.wait_event(after)
        torch.cuda.set_stream(stream)
        dst.copy_(src, non_blocking=True)
        torch.cuda.set_stream(compute)
        done.record(stream)


class OffloadRuntime(torch.nn.Module):
    """The state the offload nodes of one rewritten step share: per slot (offloaded activation) its size, its part
    of the page-locked pool and its two events, the copy streams, and the layout of the tensors backward reads. A
    module (with no parameters or buffers) so that the graph reaches it as a submodule.

    The nodes of one slot run in the order to_host, release, prefetch, wait within one step, and the step runs on
    one compute stream; the copies are ordered by events only (nothing waits on the host):

    - the copy out waits for the compute stream (the producer, and the last step's wait for this slot's copy back,
      so the host bytes are free);
    - the release makes the compute stream wait for the copy out before the tensor is dropped, so the allocator
      reuses its memory only after the copy has read it;
    - the copy back allocates its buffer on the compute stream and waits for it (the buffer's memory is free there,
      and the compute stream is already past the release, so past the copy out);
    - the wait makes the compute stream wait for the copy back before backward reads it.
    """

    def __init__(self, activations: list[str], sizes: list[int]) -> None:
        super().__init__()
        self.activations = activations
        self.sizes = sizes  # bytes of each slot (the profile's storage size: at least the storage's own)
        self.pool: PageLocked | None = None
        self.slots: list[torch.Tensor] = []  # each slot's host bytes, cut to what it holds
        self.nbytes: list[int] = []
        self.layouts: list[list[tuple]] = []
        self.device: torch.device | None = None
        self.copies: CopyStreams | None = None  # None on a CPU device
        self.out_done: list[torch.cuda.Event] = []
        self.in_done: list[torch.cuda.Event] = []

    @property
    def pool_bytes(self) -> int:
        return sum(self.sizes)

    def ensure_pool(self, device: torch.device) -> None:
        """Allocate the page-locked pool once (checking the host's free memory first) and the CUDA streams and
        events."""
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if self.pool is not None:
            if device != self.device:
                raise ACStudioError(f"this rewritten step offloads from {self.device}; it cannot run on {device}")
            return
        check_host_memory(self.pool_bytes, device)
        self.pool = PageLocked(self.pool_bytes, device)
        offsets = [sum(self.sizes[:j]) for j in range(len(self.sizes))]
        self.slots = [self.pool.data[o:o + n] for o, n in zip(offsets, self.sizes)]
        self.nbytes = list(self.sizes)
        self.layouts = [[] for _ in self.sizes]
        self.device = device
        if device.type == "cuda":
            self.copies = CopyStreams(device)
            self.out_done = [torch.cuda.Event() for _ in self.sizes]
            self.in_done = [torch.cuda.Event() for _ in self.sizes]

    def free_pool(self) -> None:
        """Give the pool's memory back (a later step allocates it again)."""
        if self.pool is not None:
            self.pool.free()
        self.pool = None
        self.slots = []

    # -- the four steps of one offloaded activation ------------------------------------------------------------
    def to_host(self, slot: int, tensor: torch.Tensor) -> None:
        if self.pool is None or tensor.device != self.device:
            self.ensure_pool(tensor.device)
        storage = tensor.untyped_storage()
        n = storage.nbytes()
        if n != self.nbytes[slot]:
            self._resize(slot, n)
        data = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)
        copies = self.copies
        if copies is None:
            self.slots[slot].copy_(data)
            return
        compute = copies.compute = torch.cuda.current_stream(self.device)
        copies.copy(copies.out_stream, compute, self.slots[slot], data, self.out_done[slot])

    def release(self, slot: int, tensors: tuple[torch.Tensor, ...]) -> None:
        self.layouts[slot] = [(t.dtype, t.size(), t.stride(), t.storage_offset()) for t in tensors]
        if self.copies is not None:
            self.copies.compute.wait_event(self.out_done[slot])

    def prefetch(self, slot: int) -> torch.Tensor:
        buffer = torch.empty(self.nbytes[slot], dtype=torch.uint8, device=self.device)
        copies = self.copies
        if copies is None:
            buffer.copy_(self.slots[slot])
            return buffer
        copies.copy(copies.in_stream, copies.compute, buffer, self.slots[slot], self.in_done[slot])
        return buffer

    def wait(self, slot: int, buffer: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.copies is not None:
            self.copies.compute.wait_event(self.in_done[slot])
        storage = buffer.untyped_storage()
        return tuple(torch.empty(0, dtype=dtype, device=self.device).set_(storage, offset, size, stride)
                     for dtype, size, stride, offset in self.layouts[slot])

    def _resize(self, slot: int, n: int) -> None:
        """Cut ``slot``'s host bytes to a storage of ``n`` bytes (the profile may have measured more)."""
        if n > self.sizes[slot]:
            raise ACStudioError(f"offloaded activation {self.activations[slot]} holds {n} bytes, more than the "
                                f"{self.sizes[slot]} its profile measured — profile the model again")
        start = sum(self.sizes[:slot])
        self.slots[slot] = self.pool.data[start:start + n]
        self.nbytes[slot] = n
