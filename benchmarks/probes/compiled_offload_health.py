"""Does the compiled offload form (blocks compiled one by one inside :class:`acstudio.export.apply.RegionOffload`'s
hooks, the model compiled around them) stay healthy over many steps, and is it bitwise equal to the same step
without the copies? Issue 26 asks both of every offload form; ``offload_health_50_steps.py`` answered them for the
rewritten step.

A dropout-free GPT-2 small (bs8, seq 512, Adam, Inductor) is profiled here, and ``acstudio.apply_plan`` runs the
plan that keeps every activation and offloads what the first ``PROBE_BLOCKS`` blocks save. The control is the same
plan and the same compiled graphs with no copy made (the hooks keep every storage: ``REGION_MIN_BYTES`` raised
above any), so the two differ only by the copies. Per step it prints the device peak (reset before each step), the
memory allocated after it, the process RSS, torch's pinned host bytes, the step time, the host buffers the runtime
has made so far and the copies it still holds; then the spread of those from step 2 on.

Bitwise: losses, gradients and parameters after 3 steps from the same start, offload against control, and control
against control (whether the compiled step is deterministic at all here). SDPA runs its math kernel and
``torch.use_deterministic_algorithms`` is on (warn only, with ``CUBLAS_WORKSPACE_CONFIG``): the memory-efficient
attention backward and Inductor's atomic scatter-adds differ run to run on the GPU (``offload_bitwise_control.py``).

Run: cd <repo> && PYTHONPATH=. python3 benchmarks/probes/compiled_offload_health.py \
         > results/probes/compiled_offload_health.txt
Needs one CUDA GPU (about 3 minutes on an H100, most of it compiling). Env: PROBE_BLOCKS (default 4),
PROBE_STEPS (default 50); PROBE_DEVICE=cpu PROBE_TINY=1 is a smoke run on a 2-layer GPT-2 without a GPU (aot_eager).
"""

import copy
import os
import sys
import time

import numpy as np
import torch

from acstudio.export import apply as apply_module
from acstudio.plan.compiled import TIMED_MODE
from acstudio.plan.schedule import PlanContext
from acstudio.profiler import profile_workload
from acstudio.simulate import sac as sac_module
from acstudio.simulate.sac import sac_blocks
from acstudio.workload import WorkloadSpec, build_workload
from acstudio.workload.spec import make_optimizer

GiB, MiB = 2**30, 2**20
PAGE = os.sysconf("SC_PAGE_SIZE")
BLOCKS = int(os.environ.get("PROBE_BLOCKS", "4"))
STEPS = int(os.environ.get("PROBE_STEPS", "50"))
DEVICE = os.environ.get("PROBE_DEVICE", "cuda")
CUDA = DEVICE == "cuda"
TINY = bool(os.environ.get("PROBE_TINY"))
DROPOUT_FREE = (("resid_pdrop", "0"), ("embd_pdrop", "0"), ("attn_pdrop", "0"))
TINY_CONFIG = (("n_layer", "2"), ("n_embd", "64"), ("n_head", "2"), ("vocab_size", "120"), ("n_positions", "64"))
COMPILE = {"backend": "inductor" if CUDA else "aot_eager"}


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def pinned() -> int | None:
    if not CUDA:
        return None
    return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))


class Runtimes:
    """Every RegionOffload apply_plan makes, and every host buffer they lock (to see the pool reused)."""

    def __init__(self) -> None:
        self.made: list = []
        self.buffers: list[int] = []
        init, page_locked = apply_module.RegionOffload.__init__, apply_module.PageLocked

        def recording_init(runtime, *args):
            self.made.append(runtime)
            init(runtime, *args)

        def recording_buffer(nbytes, device):
            self.buffers.append(nbytes)
            return page_locked(nbytes, device)

        apply_module.RegionOffload.__init__ = recording_init
        apply_module.PageLocked = recording_buffer


def build(w, profile, plan, copies: bool, runtimes: Runtimes):
    """The model compiled with ``plan``'s regions; without ``copies`` its hooks keep every storage on the device."""
    apply_module.REGION_MIN_BYTES = sac_module.REGION_MIN_BYTES if copies else 2**62
    model = apply_module.apply_plan(copy.deepcopy(w.model), (profile, plan), compile_options=COMPILE)
    return torch.compile(model, **COMPILE), runtimes.made[-1]


def train(model, w, steps: int) -> list[torch.Tensor]:
    """``steps`` Adam steps from seed 0: losses, gradients of the last step, parameters."""
    opt = make_optimizer(w.spec.optimizer, model.parameters())
    torch.manual_seed(0)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = w.loss_fn(model, w.batch)
        loss.backward()
        losses.append(loss.detach().clone())
        opt.step()
    return [*losses, *(p.grad.clone() for p in model.parameters()), *(p.detach().clone() for p in model.parameters())]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> str:
    unequal = sum(not torch.equal(x, y) for x, y in zip(a, b, strict=True))
    worst = max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b, strict=True))
    return "bitwise equal" if not unequal else f"{unequal} of {len(a)} tensors differ (max abs {worst:.3g})"


def main() -> int:
    t0 = time.time()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts: before any CUDA work
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.use_deterministic_algorithms(True, warn_only=True)  # an op without a deterministic kernel warns
    print(f"torch {torch.__version__} device {torch.cuda.get_device_name() if CUDA else DEVICE}", flush=True)
    if TINY:
        spec = WorkloadSpec("gpt2", batch_size=4, seq_len=64, optimizer="adam", config=(*TINY_CONFIG, *DROPOUT_FREE))
        sac_module.REGION_MIN_BYTES = apply_module.REGION_MIN_BYTES = 4096
    else:
        spec = WorkloadSpec("gpt2", batch_size=8, seq_len=512, optimizer="adam", config=DROPOUT_FREE)
    profile = profile_workload(spec, DEVICE)
    ctx = PlanContext(profile)
    blocks = sac_blocks(ctx.sim)
    held = blocks.region_held([], blocks.blocks[:BLOCKS])
    plan = ctx.plan_for_set("mutwo", profile.peak_bytes, [], mode=TIMED_MODE, offloaded=held)
    print(f"profiled in {time.time() - t0:.0f}s: peak {profile.peak_bytes / GiB:.3f} GiB; plan: keep everything, "
          f"offload what blocks {blocks.blocks[:BLOCKS]} save: {len(plan.offloaded)} activations, "
          f"{plan.offload_bytes / GiB:.3f} GiB each way, hidden {plan.copies_hidden}", flush=True)

    w = build_workload(spec).to(torch.device(DEVICE))
    runtimes = Runtimes()
    model, runtime = build(w, profile, plan, True, runtimes)
    opt = make_optimizer(spec.optimizer, model.parameters())
    rows = []
    print(" step   peak_GiB  alloc_GiB   rss_MiB     pinned_MiB     ms  buffers  held_copies", flush=True)
    for i in range(STEPS):
        sync()
        t = time.perf_counter()
        opt.zero_grad()
        loss = w.loss_fn(model, w.batch)
        loss.backward()
        opt.step()
        if CUDA:
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t) * 1e3
        peak, alloc = (torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()) if CUDA else (0, 0)
        r, p = rss(), pinned()
        rows.append((peak, alloc, r, ms, len(runtimes.buffers), len(runtime.stored)))
        if i < 5 or i % 5 == 4:
            print(f"{i:5d} {peak / GiB:10.4f} {alloc / GiB:10.4f} {r / MiB:9.1f} "
                  f"{'-' if p is None else f'{p / MiB:.1f}':>14} {ms:6.1f} {len(runtimes.buffers):8d} "
                  f"{len(runtime.stored):12d}", flush=True)
    peaks, allocs, rsss, times, made, held_copies = (np.array(c) for c in zip(*rows))
    print(f"from step 2: peak spread {int(peaks[2:].max() - peaks[2:].min())} B, allocated-after spread "
          f"{int(allocs[2:].max() - allocs[2:].min())} B, RSS {rsss[2] / MiB:.1f} -> {rsss[-1] / MiB:.1f} MiB "
          f"(growth {(rsss[-1] - rsss[2]) / MiB:.1f}), host buffers made after step 1: {int(made[-1] - made[0])}, "
          f"copies held after a step: max {int(held_copies.max())}; step ms median {np.median(times[2:]):.1f} "
          f"(min {times[2:].min():.1f} max {times[2:].max():.1f})", flush=True)
    del model, opt, runtime
    torch._dynamo.reset()

    control, _ = build(w, profile, plan, False, runtimes)
    opt = make_optimizer(spec.optimizer, control.parameters())
    control_peaks, control_times = [], []
    for _ in range(10):
        sync()
        t = time.perf_counter()
        opt.zero_grad()
        w.loss_fn(control, w.batch).backward()
        opt.step()
        if CUDA:
            torch.cuda.synchronize()
        control_times.append((time.perf_counter() - t) * 1e3)
        control_peaks.append(torch.cuda.max_memory_allocated() if CUDA else 0)
    saved = max(control_peaks[2:]) - peaks[2:].max()
    print(f"control (same graphs, no copies): peak {max(control_peaks[2:]) / GiB:.4f} GiB, step ms median "
          f"{np.median(control_times[2:]):.1f}; the copies save {saved / GiB:.4f} GiB of peak "
          f"(planned {plan.offload_bytes / GiB:.4f} off the device)", flush=True)
    del control, opt
    torch._dynamo.reset()

    results = {}
    for name, copies in (("offload", True), ("control", False), ("control again", False)):
        model, _ = build(w, profile, plan, copies, runtimes)
        results[name] = train(model, w, 3)
        del model
        torch._dynamo.reset()
    print(f"3 steps from the same start: offload against control: {same(results['offload'], results['control'])}; "
          f"control against control: {same(results['control again'], results['control'])}", flush=True)
    print(f"total {time.time() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
