"""Run the captured graph node by node on the device and measure time and memory per node.

GPU: CUDA events around every node (median of the measured iterations), ``memory_allocated`` after the node
and ``max_memory_allocated`` during it (peak counter reset before each node). CPU: host clock for time and
storage accounting for memory (the same free-after-last-use rule the GPU run follows), so the whole app works
on any machine. Values are freed after their last use exactly as FX's generated code frees them, so the
measured peak is the peak of the real step.
"""

from __future__ import annotations

import gc
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from datetime import datetime, timezone

import torch
import torch.fx as fx

from acstudio.capture import CapturedStep, capture_step
from acstudio.capture.analysis import GraphAnalysis, analyze
from acstudio.capture.serialize import serialize_step
from acstudio.errors import ACStudioError, Cancelled, DeviceError, OutOfMemoryError
from acstudio.hostcopy import OffloadRuntime, host_available_bytes
from acstudio.jobs import CancelToken, ProgressFn, check, report
from acstudio.profile.model import HostLink, Profile
from acstudio.profile.vocabulary import CATEGORIES
from acstudio.workload import WorkloadSpec
from acstudio.workload.memory import build_fitting

_REPORT_EVERY = 64  # nodes between progress callbacks / cancel checks
MemoryFn = Callable[[int, list[int], int], None]  # (first node index, peak bytes per node, nodes in the graph)


def resolve_device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise DeviceError(f"unknown device {device!r} — use cuda, cuda:N or cpu") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError("--device cuda was requested but no CUDA GPU is available here — use --device cpu")
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise DeviceError(f"{device}: this machine has {torch.cuda.device_count()} CUDA GPU(s) — use cuda:0 .. "
                          f"cuda:{torch.cuda.device_count() - 1}")
    if dev.type not in ("cuda", "cpu"):
        raise DeviceError(f"unsupported device {device!r} — use cuda, cuda:N or cpu")
    return dev


def device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"CPU ({platform.machine()})"


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def free_schedule(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """For each node position, the values whose last use it is (deleted right after, like FX codegen)."""
    nodes = list(gm.graph.nodes)
    last: dict[fx.Node, int] = {}
    for i, node in enumerate(nodes):
        last.setdefault(node, i)  # unused values die where they are made
        for a in node.all_input_nodes:
            last[a] = i
    schedule: list[list[fx.Node]] = [[] for _ in nodes]
    for node, i in last.items():
        if nodes[i].op != "output":
            schedule[i].append(node)
    return schedule


class NodeTimer:
    """Per-node timing and memory readings for one device; CUDA events on GPU, perf_counter on CPU."""

    def __init__(self, dev: torch.device, n: int) -> None:
        self.cuda = dev.type == "cuda"
        self.n = n
        if self.cuda:
            self.starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
            self.ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
            self.mem_after = [0] * n
            self.mem_peak = [0] * n
        self.host_ms = [0.0] * n
        self._t0 = 0.0

    def before(self, i: int) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self.starts[i].record()
        else:
            self._t0 = time.perf_counter()

    def after(self, i: int) -> None:
        if self.cuda:
            self.ends[i].record()
            self.mem_after[i] = torch.cuda.memory_allocated()
            self.mem_peak[i] = torch.cuda.max_memory_allocated()
        else:
            self.host_ms[i] = (time.perf_counter() - self._t0) * 1e3

    def times_ms(self, active: list[bool]) -> list[float]:
        if not self.cuda:
            return list(self.host_ms)
        torch.cuda.synchronize()
        return [self.starts[i].elapsed_time(self.ends[i]) if active[i] else 0.0 for i in range(self.n)]


class DeviceTimer(NodeTimer):
    """Per-node device time: each node's kernels timed by CUDA events while the device runs ahead of the host.

    :class:`NodeTimer` records its start event on an idle device, so a node's time also holds the host's time to
    launch it, where the compiled step hides that behind the device's work. Here a sleep kernel is queued before
    each node's start event, longer than the host takes to issue the node (twice that node's node-by-node time,
    at least ``MIN_SLEEP_MS``, at most ``MAX_SLEEP_MS``): the node's kernels are all queued before its start event
    runs, and the events time only them."""

    MIN_SLEEP_MS = 0.05
    MAX_SLEEP_MS = 2.0

    def __init__(self, dev: torch.device, n: int, node_ms: list[float]) -> None:
        super().__init__(dev, n)
        cycles_per_ms = sleep_cycles_per_ms(dev)
        self.cycles = [int(cycles_per_ms * min(max(2 * t, self.MIN_SLEEP_MS), self.MAX_SLEEP_MS)) for t in node_ms]

    def before(self, i: int) -> None:
        torch.cuda._sleep(self.cycles[i])
        self.starts[i].record()

    def after(self, i: int) -> None:
        self.ends[i].record()


def sleep_cycles_per_ms(dev: torch.device) -> float:
    """Clock cycles ``torch.cuda._sleep`` spins per millisecond on ``dev``, measured."""
    with torch.cuda.device(dev):
        cycles = 10_000_000
        torch.cuda._sleep(cycles)  # first call: load the kernel
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return cycles / max(start.elapsed_time(end), 1e-3)


def fetch_attr(module: torch.nn.Module, target: str):
    for name in target.split("."):
        module = getattr(module, name)
    return module


def run_node_by_node(step: CapturedStep, flat: list, timer: NodeTimer,
                     on_node: Callable[[int], None] | None = None) -> None:
    """Interpret the graph, freeing each value after its last use; ``timer`` records every node."""
    nodes = list(step.gm.graph.nodes)
    schedule = free_schedule(step.gm)
    env: dict[fx.Node, object] = {}
    inputs = iter(flat)
    try:
        for i, node in enumerate(nodes):
            if node.op == "placeholder":
                env[node] = next(inputs)
            elif node.op == "get_attr":
                env[node] = fetch_attr(step.gm, node.target)
            elif node.op == "call_function":
                args = fx.node.map_arg(node.args, env.__getitem__)
                kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
                timer.before(i)
                env[node] = node.target(*args, **kwargs)
                timer.after(i)
            for dead in schedule[i]:
                env.pop(dead, None)
            if on_node is not None and i % _REPORT_EVERY == 0:
                on_node(i)
    finally:
        env.clear()


def storage_accounted_memory(analysis: GraphAnalysis) -> tuple[list[int], list[int]]:
    """CPU memory per node from storage accounting: (allocated after the node, peak during it)."""
    n = len(analysis.nodes)
    mem_after = analysis.live_bytes_after()
    dying = [0] * n
    size = {t.id: t.bytes for t in analysis.tensors}
    for sid, (_, end) in analysis.live_range.items():
        if end is not None:
            dying[end] += size[sid]
    # During node i: what survived node i-1 plus what node i allocates.
    mem_peak = [(mem_after[i - 1] - dying[i - 1] if i else 0) + rec.new_bytes for i, rec in enumerate(analysis.nodes)]
    return mem_after, mem_peak


def profile_step(step: CapturedStep, flat: list, dev: torch.device, *, warmup: int = 1, iterations: int = 3,
                 progress: ProgressFn | None = None, cancel: CancelToken | None = None,
                 analysis: GraphAnalysis | None = None, on_memory: MemoryFn | None = None
                 ) -> tuple[GraphAnalysis, dict]:
    """Measure ``step`` on ``flat`` inputs (updated in place, like real training) and fill the analysis in.

    ``on_memory(start, peaks, n_nodes)`` streams per-node peak memory while the first pass runs, so a viewer
    can draw the timeline as it is measured (on the CPU the accounted curve is known before the first node).
    """
    analysis = analysis or analyze(step, dev.type)
    nodes = list(step.gm.graph.nodes)
    n = len(nodes)
    active = [node.op == "call_function" for node in nodes]
    total = (warmup + iterations) * n
    samples: list[list[float]] = []
    peaks: list[tuple[list[int], list[int]]] = []
    if dev.type != "cuda":
        cpu_memory = storage_accounted_memory(analysis)
        if on_memory is not None:
            on_memory(0, cpu_memory[1], n)
    streamed = [0]  # nodes already sent to on_memory

    def stream(timer: NodeTimer, upto: int) -> None:
        if on_memory is not None and timer.cuda and upto > streamed[0]:
            on_memory(streamed[0], timer.mem_peak[streamed[0]:upto], n)
            streamed[0] = upto

    for it in range(warmup + iterations):
        timer = NodeTimer(dev, n)
        phase = "warm-up" if it < warmup else f"iteration {it - warmup + 1}/{iterations}"

        def on_node(i: int, it=it, phase=phase, timer=timer) -> None:
            check(cancel)
            report(progress, it * n + i, total, f"{phase}: node {i}/{n}")
            if it == 0:
                stream(timer, i + 1)

        run_node_by_node(step, flat, timer, on_node)
        if it == 0:
            stream(timer, n)
        if it >= warmup:
            samples.append(timer.times_ms(active))
            if timer.cuda:
                peaks.append((timer.mem_after, timer.mem_peak))
    report(progress, total, total, "measured")
    run_ms = [statistics.median(s[i] for s in samples) for i in range(n)]

    if dev.type == "cuda":
        mem_after, mem_peak = peaks[-1]
        # Placeholders are resident before the first node runs: give them the first op's starting level.
        first = next(i for i in range(n) if active[i])
        base = mem_peak[first] if first < n else 0
        for i in range(first):
            mem_after[i] = mem_peak[i] = min(base, mem_after[first])
    else:
        mem_after, mem_peak = cpu_memory
    if nodes[-1].op == "output" and n > 1:  # the output node runs nothing: it holds the previous level
        mem_after[-1] = mem_after[-2]
        mem_peak[-1] = min(mem_peak[-2], mem_after[-2])
    for rec, t, a, p in zip(analysis.nodes, run_ms, mem_after, mem_peak):
        rec.run_time_ms, rec.mem_after, rec.mem_peak = float(t), int(a), int(p)
    index = {rec.id: i for i, rec in enumerate(analysis.nodes)}
    prefix = [0.0]
    for t in run_ms:
        prefix.append(prefix[-1] + t)
    for act in analysis.activations:
        lo, hi = index[act.last_fw_use], index[act.first_bw_use]
        act.inactive_time_ms = float(prefix[hi] - prefix[lo + 1]) if hi > lo + 1 else 0.0
    return analysis, {"warmup": warmup, "iterations": iterations}


def device_times(step: CapturedStep, flat: list, dev: torch.device, analysis: GraphAnalysis, *,
                 progress: ProgressFn | None = None, cancel: CancelToken | None = None) -> list[float] | None:
    """Each node's device time (:class:`DeviceTimer`), one more node-by-node iteration; None off CUDA.

    Beside ``run_time_ms`` it says how much of a node's node-by-node time is the host launching it, which the
    compiled step hides where the device is the bottleneck."""
    if dev.type != "cuda":
        return None
    nodes = list(step.gm.graph.nodes)
    n = len(nodes)
    timer = DeviceTimer(dev, n, [rec.run_time_ms for rec in analysis.nodes])

    def on_node(i: int) -> None:
        check(cancel)
        report(progress, i, n, f"device time: node {i}/{n}")

    run_node_by_node(step, flat, timer, on_node)
    return timer.times_ms([node.op == "call_function" for node in nodes])


def time_whole_step(step: CapturedStep, flat: list, dev: torch.device, repeats: int = 3
                    ) -> tuple[float, int, float]:
    """Median wall time of the compiled-to-Python graph (no per-node hooks), its peak allocation, and the median
    time the host takes to issue it (until the graph returns, before the device is done): close to the wall time
    where the host is what limits the step, well below it where the device is."""
    times, issued = [], []
    peak = 0
    for _ in range(repeats):
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = step.gm(*flat)
        issued.append((time.perf_counter() - t0) * 1e3)
        if dev.type == "cuda":
            torch.cuda.synchronize()
            peak = max(peak, torch.cuda.max_memory_allocated())
        times.append((time.perf_counter() - t0) * 1e3)
        del out
    return statistics.median(times), peak, statistics.median(issued)


def peak_breakdown(analysis: GraphAnalysis, peak_index: int, peak_bytes: int) -> dict[str, int]:
    """Bytes per category alive at the peak node; ``other`` is what the allocator holds beyond our storages."""
    out = dict.fromkeys(CATEGORIES, 0)
    size = {t.id: (t.bytes, t.category) for t in analysis.tensors}
    for sid, (start, end) in analysis.live_range.items():
        if start <= peak_index and (end is None or end >= peak_index):
            nbytes, cat = size[sid]
            out[cat] += nbytes
    out["other"] = peak_bytes - sum(out.values())
    return out


# Bytes each way per link measurement: large enough that a copy runs far longer than its launch (tens of
# milliseconds on PCIe), small enough to fit beside any profiled step.
LINK_PROBE_BYTES = 256 * 2**20
LINK_PROBE_REPEATS = 3
# The fixed costs of one copy are timed on this many copies of LATENCY_PROBE_BYTES each, issued as the rewritten
# step issues its copies: small enough that their bytes take a negligible share of the time, many enough to average.
LATENCY_PROBE_COPIES = 64
LATENCY_PROBE_BYTES = 4096
LATENCY_PROBE_HOLD_CYCLES = 20_000_000  # GPU clock cycles the compute stream spins while the copies are issued


def measure_host_link(dev: torch.device) -> HostLink:
    """Bandwidth of pinned copies between ``dev`` and the host, each direction alone and both at once on two
    streams (the best of a few repeats, timed with CUDA events), the fixed costs of one copy on the device and on
    the host, and the host memory available.

    On a CPU device there is no link: the link's numbers stay None and a plan is priced with the defaults."""
    host_free = host_available_bytes()
    if dev.type != "cuda":
        return HostLink(host_free_bytes=host_free)
    try:
        d2h, h2d, duplex = _link_rates(dev, LINK_PROBE_BYTES)
        try:
            costs = [round(us, 3) for us in _copy_costs_us(dev, LATENCY_PROBE_BYTES, LATENCY_PROBE_COPIES)]
        except RuntimeError as e:  # a driver that refuses the timing: the profile is still worth having
            warnings.warn(f"the fixed cost of a copy could not be measured ({e}); plans price it with the stated "
                          "defaults", stacklevel=2)
            costs = [None, None, None]
    finally:
        free_device_memory()
    latency_us, issue_us, op_us = costs
    return HostLink(d2h_gb_s=round(d2h, 3), h2d_gb_s=round(h2d, 3), duplex_gb_s=round(duplex, 3),
                    host_free_bytes=host_free, copy_latency_us=latency_us, offload_issue_us=issue_us,
                    op_issue_us=op_us)


def _copy_costs_us(dev: torch.device, nbytes: int, copies: int) -> tuple[float, float, float]:
    """Microseconds of one small pinned copy's fixed costs: (the time it holds its stream, the slower direction;
    the host time to issue one offloaded activation's calls, both directions; for scale, the host time to issue
    one small op). Issued by the rewritten step's own :class:`~acstudio.hostcopy.OffloadRuntime`, its four calls
    as the step's nodes make them: the copy out and the release, then the copy back and the wait. The copies queue
    behind the compute stream spinning, so that neither measurement waits for the other; the best of a few
    repeats."""
    runtime = OffloadRuntime([f"probe{j}" for j in range(copies)], [nbytes] * copies)
    runtime.ensure_pool(dev)
    device = [torch.empty(nbytes // 4, dtype=torch.float32, device=dev) for _ in range(copies)]
    copy_out, copy_back = offload_calls(runtime, device)

    def timed(issue) -> tuple[float, float]:
        on_device = on_host = float("inf")
        for _ in range(LINK_PROBE_REPEATS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(dev)
            torch.cuda._sleep(LATENCY_PROBE_HOLD_CYCLES)
            start.record()
            t0 = time.perf_counter()
            for j in range(copies):
                issue(j)
            on_host = min(on_host, (time.perf_counter() - t0) * 1e6 / copies)
            end.record()  # the compute stream has waited for every copy
            end.synchronize()
            on_device = min(on_device, start.elapsed_time(end) * 1e3 / copies)
        return on_device, on_host

    (out_device, out_host), (in_device, in_host) = timed(copy_out), timed(copy_back)
    small = device[0][:1]
    _, op_host = timed(lambda j: torch.ops.aten.add.Tensor(small, small))  # one small op as the step's code calls it
    runtime.free_pool()
    return max(out_device, in_device), out_host + in_host, op_host


def offload_calls(runtime: OffloadRuntime, tensors: list[torch.Tensor]
                  ) -> tuple[Callable[[int], None], Callable[[int], torch.Tensor]]:
    """The calls of the offloaded activation in slot ``j`` of ``runtime`` (holding ``tensors[j]``), as the
    rewritten step's nodes make them (each node a plain function that calls one method): the copy out with its
    release, and the copy back with its wait, which returns the tensor rebuilt over the fetched bytes."""

    def copy_out(j: int) -> None:
        runtime.to_host(j, tensors[j])
        runtime.release(j, (tensors[j],))

    def copy_back(j: int) -> torch.Tensor:
        return runtime.wait(j, runtime.prefetch(j))[0]

    return copy_out, copy_back


def _link_rates(dev: torch.device, nbytes: int) -> tuple[float, float, float]:
    """GB/s of pinned copies of ``nbytes``: device to host alone, host to device alone, each way both at once."""
    host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    device = [torch.empty(nbytes, dtype=torch.uint8, device=dev) for _ in range(2)]
    streams = [torch.cuda.Stream(dev) for _ in range(2)]

    def timed(copies: list[tuple[int, bool]]) -> float:
        """Seconds for the given (buffer, to_host) copies, each on its own stream, started together."""
        best = float("inf")
        for _ in range(LINK_PROBE_REPEATS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(dev)
            start.record()
            for (j, to_host), stream in zip(copies, streams):
                stream.wait_event(start)
                with torch.cuda.stream(stream):
                    (host[j] if to_host else device[j]).copy_(device[j] if to_host else host[j], non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
                torch.cuda.current_stream(dev).wait_event(done)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        return best

    return (nbytes / timed([(0, True)]) / 1e9, nbytes / timed([(0, False)]) / 1e9,
            nbytes / timed([(0, True), (1, False)]) / 1e9)


def profile_workload(spec: WorkloadSpec, device: str = "cpu", *, warmup: int = 1, iterations: int = 3,
                     progress: ProgressFn | None = None, cancel: CancelToken | None = None,
                     command: str | None = None, on_memory: MemoryFn | None = None) -> Profile:
    """Build, capture and measure one training iteration of ``spec`` on ``device``; return its ``Profile``."""
    if iterations < 3:
        raise ACStudioError(f"{iterations} measured iterations give no median — give --iterations 3 or more")
    dev = resolve_device(device)
    stage = "building the model"
    workload = step = flat = None
    try:
        report(progress, 0, 1, stage)
        workload = build_fitting(spec, dev).to(dev)
        spec = workload.spec  # a custom factory's own optimizer names the optimizer
        optimizer = workload.make_optimizer()
        check(cancel)
        stage = "capturing the training step"
        t0 = time.perf_counter()
        step = capture_step(workload.model, optimizer, workload.batch, workload.loss_fn,
                            autocast_dtype=torch.bfloat16 if spec.precision == "bf16" else None,
                            progress=progress, cancel=cancel)
        capture_s = time.perf_counter() - t0
        flat = step.flat_inputs(workload.model, optimizer, workload.batch)
        stage = "measuring"
        analysis, iters = profile_step(step, flat, dev, warmup=warmup, iterations=iterations,
                                       progress=progress, cancel=cancel, on_memory=on_memory)
        stage = "timing the device's work per node"
        node_device_ms = device_times(step, flat, dev, analysis, progress=progress, cancel=cancel)
        stage = "timing the whole step"
        iteration_ms, step_peak, issue_ms = time_whole_step(step, flat, dev)
        graph = serialize_step(step)
        stage = "measuring the host link"
        link = measure_host_link(dev)
    except torch.OutOfMemoryError as exc:
        raise OutOfMemoryError(
            f"CUDA out of memory while {stage} for {spec.label} (batch size {spec.batch_size}); "
            f"GPU memory has been released — try a smaller batch size") from exc
    except Cancelled:
        raise
    finally:
        del workload, step, flat
        free_device_memory()

    peaks = [rec.mem_peak for rec in analysis.nodes]
    peak_index = max(range(len(peaks)), key=peaks.__getitem__)
    env = {
        "device": device_name(dev),
        "device_type": dev.type,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command or f"acstudio profile {spec.cli_args()} --device {dev.type}",
        "capture_s": round(capture_s, 3),
        "step_peak_bytes": step_peak if dev.type == "cuda" else peaks[peak_index],
    }
    return Profile(
        workload=spec.to_dict(), environment=env, graph=graph, nodes=analysis.nodes, tensors=analysis.tensors,
        activations=analysis.activations, peak_bytes=int(peaks[peak_index]),
        peak_node=analysis.nodes[peak_index].id,
        peak_breakdown=peak_breakdown(analysis, peak_index, int(peaks[peak_index])),
        iteration_ms=float(iteration_ms), iterations=iters, host_link=link,
        host_issue_ms=float(issue_ms) if dev.type == "cuda" else None, node_device_ms=node_device_ms)
