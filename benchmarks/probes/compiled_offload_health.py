"""The compiled offload form (blocks compiled one by one inside :class:`acstudio.export.apply.RegionOffload`'s
hooks, the model compiled around them) over many steps: does it stay healthy, is it bitwise equal to the same step
without the copies, and what do the regions and the copies each cost? Issue 26 asks the first two of every offload
form (``offload_health_50_steps.py`` answered them for the rewritten step); the grid's GPT-2 rows measured the form
slower than predicted, more so at longer sequences (+1.8 ms at seq 512, +4.0 at 1024, +9.3 at 2048).

GPT-2 small (Adam, Inductor) is profiled here and ``acstudio.apply_plan`` runs the plan that keeps every activation
and offloads what the first ``PROBE_BLOCKS`` blocks save. Three models of that plan, each compiled once:
  - whole:    the model compiled whole (the plan keeps everything: nothing to wrap), as ``compile`` runs;
  - regions:  the same blocks compiled one by one inside the hooks, which copy nothing (``REGION_MIN_BYTES`` raised
              above any storage): the graph breaks alone;
  - offload:  the regions with their copies.
Per step of the offload model (``PROBE_STEPS``): the device peak (reset before each step), the memory allocated
after it, the process RSS, torch's pinned host bytes, the step time, the host buffers made so far and the copies
still held; then their spread from step 2 on. Bitwise: losses, gradients and parameters after 3 steps from the
same start, offload against regions and regions against regions (is the compiled step deterministic here at all).

With ``PROBE_PLAN`` (a plan file) and ``PROBE_PROFILE`` (the profile it was made from) it runs that plan instead,
on the profile's workload: ``whole`` is then the plan's recompute set compiled whole, without the regions (the
grid's GPT-2 seq 2048 plan of 2026-11-28: ``results/probes/gpt2-s2048.compiled.plan.json``, made from that run's
profile, ``gpt2-s2048.compiled.profile.json.gz`` beside it, and calibration rows by
``acstudio.plan.compiled.plan_compiled`` as the bench made it).

Run (results/probes/compiled_offload_health_s512_keyerror_h100.txt and compiled_offload_health_s2048_h100.txt; the
first stopped on a bug since fixed; with ``PROBE_PLAN``, compiled_offload_health_s2048_h200.txt, its command there):
  cd <repo> && PYTHONPATH=. PROBE_DETERMINISTIC=1 python3 benchmarks/probes/compiled_offload_health.py
  cd <repo> && PYTHONPATH=. PROBE_SEQ=2048 PROBE_BATCH=8 PROBE_DROPOUT=1 PROBE_STEPS=20 \
      python3 benchmarks/probes/compiled_offload_health.py
Needs one CUDA GPU (2-3 minutes a run on an H100, most of it compiling). Env: PROBE_SEQ (512), PROBE_BATCH (8),
PROBE_BLOCKS (5), PROBE_STEPS (50); PROBE_DROPOUT=1 keeps GPT-2's dropout (else none); PROBE_TRACE=PATH
writes a Chrome trace of one step of the offload model (torch's profiler) to PATH, and one of the regions model
beside it (``X.json`` -> ``X.regions.json``: what the copies add, stretch by stretch); PROBE_DETERMINISTIC=1 runs
SDPA's math kernel under ``torch.use_deterministic_algorithms`` (warn only): the memory-efficient attention
backward and Inductor's atomic scatter-adds differ run to run (``offload_bitwise_control.py``).
PROBE_DEVICE=cpu PROBE_TINY=1 is a smoke run on a 2-layer GPT-2 without a GPU (aot_eager).
"""

import contextlib
import copy
import dataclasses
import gc
import os
import sys
import time

import numpy as np
import torch

from acstudio.bench.steps import autocast
from acstudio.export import apply as apply_module
from acstudio.plan.compiled import TIMED_MODE
from acstudio.plan.model import Plan
from acstudio.plan.schedule import PlanContext
from acstudio.profile.model import Profile
from acstudio.profiler import profile_workload
from acstudio.simulate import sac as sac_module
from acstudio.simulate.sac import sac_blocks
from acstudio.workload import WorkloadSpec, build_workload
from acstudio.workload.spec import make_optimizer

GiB, MiB = 2**30, 2**20
PAGE = os.sysconf("SC_PAGE_SIZE")
SEQ = int(os.environ.get("PROBE_SEQ", "512"))
BATCH = int(os.environ.get("PROBE_BATCH", "8"))
BLOCKS = int(os.environ.get("PROBE_BLOCKS", "5"))
STEPS = int(os.environ.get("PROBE_STEPS", "50"))
DROPOUT = bool(os.environ.get("PROBE_DROPOUT"))
DETERMINISTIC = bool(os.environ.get("PROBE_DETERMINISTIC"))
DEVICE = os.environ.get("PROBE_DEVICE", "cuda")
CUDA = DEVICE == "cuda"
TINY = bool(os.environ.get("PROBE_TINY"))
DROPOUT_FREE = (("resid_pdrop", "0"), ("embd_pdrop", "0"), ("attn_pdrop", "0"))
TINY_CONFIG = (("n_layer", "2"), ("n_embd", "64"), ("n_head", "2"), ("vocab_size", "120"), ("n_positions", "64"))
COMPILE = {"backend": "inductor" if CUDA else "aot_eager"}


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def pinned() -> int | None:
    return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)) if CUDA else None


@contextlib.contextmanager
def copies(enabled: bool):
    """The regions' hooks copy storages of ``REGION_MIN_BYTES`` or more (read when they run), or none."""
    saved = apply_module.REGION_MIN_BYTES
    apply_module.REGION_MIN_BYTES = sac_module.REGION_MIN_BYTES if enabled else 2**62
    try:
        yield
    finally:
        apply_module.REGION_MIN_BYTES = saved


def record_host_buffers() -> list[int]:
    """The sizes of the host buffers the offload runtimes lock from now on (to see the pool reused)."""
    buffers: list[int] = []
    page_locked = apply_module.PageLocked

    def recording(nbytes, device):
        buffers.append(nbytes)
        return page_locked(nbytes, device)

    apply_module.PageLocked = recording
    return buffers


class Trainer:
    """One compiled model of the plan, its optimizer, and the state both started from."""

    def __init__(self, w, model: torch.nn.Module) -> None:
        self.w = w
        self.plain = model
        self.model = torch.compile(model, **COMPILE)
        self.start = copy.deepcopy(model.state_dict())
        self.opt = make_optimizer(w.spec.optimizer, model.parameters())

    def restart(self) -> None:
        self.plain.load_state_dict(self.start)  # in place: the compiled graphs keep the same parameters
        self.opt = make_optimizer(self.w.spec.optimizer, self.model.parameters())
        torch.manual_seed(0)

    def step(self) -> tuple[float, torch.Tensor]:
        """One step: (milliseconds, loss)."""
        if CUDA:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        self.opt.zero_grad()
        with autocast(self.w.spec, torch.device(DEVICE)):  # a bf16 workload's forward and loss, as bench runs them
            loss = self.w.loss_fn(self.model, self.w.batch)
        loss.backward()
        self.opt.step()
        if CUDA:
            torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3, loss.detach()

    def three_steps(self) -> list[torch.Tensor]:
        """Losses, last gradients and parameters after 3 steps from the start (on the host: held on the device, they
        would count in the next model's peak)."""
        self.restart()
        losses = [self.step()[1] for _ in range(3)]
        params = list(self.model.parameters())
        return [t.detach().cpu() for t in (*losses, *(p.grad for p in params), *params)]

    def timed(self, steps: int) -> tuple[float, float, int]:
        """(median ms from step 2 on, IQR, the highest device peak) of ``steps`` steps from the start."""
        self.restart()
        times, peak = [], 0
        for _ in range(steps):
            times.append(self.step()[0])
            peak = max(peak, torch.cuda.max_memory_allocated() if CUDA else 0)
        q1, med, q3 = np.percentile(times[2:], [25, 50, 75])
        return float(med), float(q3 - q1), peak


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> str:
    unequal = sum(not torch.equal(x, y) for x, y in zip(a, b, strict=True))
    worst = max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b, strict=True))
    return "bitwise equal" if not unequal else f"{unequal} of {len(a)} tensors differ (max abs {worst:.3g})"


def health(trainer: Trainer, buffers: list[int]) -> None:
    runtime = apply_module.offload_of(trainer.plain)
    trainer.restart()
    rows = []
    print(" step   peak_GiB  alloc_GiB   rss_MiB     pinned_MiB     ms  buffers  held_copies", flush=True)
    for i in range(STEPS):
        ms, _ = trainer.step()
        peak, alloc = (torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()) if CUDA else (0, 0)
        r, p = rss(), pinned()
        rows.append((peak, alloc, r, ms, len(buffers), len(runtime.stored)))
        if i < 5 or i % 5 == 4:
            print(f"{i:5d} {peak / GiB:10.4f} {alloc / GiB:10.4f} {r / MiB:9.1f} "
                  f"{'-' if p is None else f'{p / MiB:.1f}':>14} {ms:6.1f} {len(buffers):8d} "
                  f"{len(runtime.stored):12d}", flush=True)
    peaks, allocs, rsss, _, made, held = (np.array(c) for c in zip(*rows))
    print(f"from step 2: peak spread {int(peaks[2:].max() - peaks[2:].min())} B, allocated-after spread "
          f"{int(allocs[2:].max() - allocs[2:].min())} B, RSS {rsss[2] / MiB:.1f} -> {rsss[-1] / MiB:.1f} MiB "
          f"(growth {(rsss[-1] - rsss[2]) / MiB:.1f}), host buffers made after step 1: {int(made[-1] - made[0])}, "
          f"copies held after a step: max {int(held.max())}", flush=True)


def trace(trainer: Trainer, path: str) -> None:
    """One step of ``trainer`` under torch's profiler, as a Chrome trace at ``path``: where the compute stream
    waits for the copies, and where the copies run."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        trainer.step()
    prof.export_chrome_trace(path)
    print(f"trace of one step in {path}", flush=True)


def regions_trace(path: str) -> str:
    """Where the regions model's trace goes, beside the offload model's at ``path``: ``step.json`` ->
    ``step.regions.json``."""
    stem, dot, suffix = path.rpartition(".")
    return f"{stem}.regions.{suffix}" if dot else f"{path}.regions"


def forget_compiled() -> None:
    """Free the model just measured: Dynamo's caches hold it (its guards), with its gradients and optimizer state,
    which would count in the next model's peak (a first H200 run's did: 2 GiB a model)."""
    torch._dynamo.reset()
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()


def main() -> int:
    t0 = time.time()
    if DETERMINISTIC:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts: before CUDA work
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.use_deterministic_algorithms(True, warn_only=True)  # an op without a deterministic kernel warns
    print(f"torch {torch.__version__} device {torch.cuda.get_device_name() if CUDA else DEVICE}; deterministic "
          f"{DETERMINISTIC}", flush=True)
    config = () if DROPOUT else DROPOUT_FREE
    if TINY:
        sac_module.REGION_MIN_BYTES = 4096
    if os.environ.get("PROBE_PLAN"):
        profile, plan = Profile.load(os.environ["PROBE_PROFILE"]), Plan.load(os.environ["PROBE_PLAN"])
        spec = WorkloadSpec.from_dict(profile.workload)
        print(f"the profile's workload: {spec.label} seq {spec.seq_len}", flush=True)
        print(f"plan {os.environ['PROBE_PLAN']}: {len(plan.recomputed)} activations recomputed, "
              f"{len(plan.offloaded)} offloaded ({plan.offload_bytes / GiB:.3f} GiB each way)", flush=True)
    else:
        if TINY:
            spec = WorkloadSpec("gpt2", batch_size=2, seq_len=64, optimizer="adam", config=(*TINY_CONFIG, *config))
        else:
            spec = WorkloadSpec("gpt2", batch_size=BATCH, seq_len=SEQ, optimizer="adam",
                                config=(*config, ("n_positions", str(max(SEQ, 1024)))))
        print(f"seq {SEQ} batch {BATCH} dropout {DROPOUT}", flush=True)
        profile = profile_workload(spec, DEVICE)
        ctx = PlanContext(profile)
        blocks = sac_blocks(ctx.sim)
        held = blocks.region_held([], blocks.blocks[:BLOCKS])
        plan = ctx.plan_for_set("mutwo", profile.peak_bytes, [], mode=TIMED_MODE, offloaded=held)
        print(f"profiled in {time.time() - t0:.0f}s: peak {profile.peak_bytes / GiB:.3f} GiB; plan: keep everything, "
              f"offload what the first {min(BLOCKS, len(blocks.blocks))} blocks save: {len(plan.offloaded)} "
              f"activations, {plan.offload_bytes / GiB:.3f} GiB each way, predicted stall "
              f"{plan.offload_stall_ms:.2f} ms", flush=True)

    w = build_workload(spec).to(torch.device(DEVICE))
    buffers = record_host_buffers()
    results, timings = {}, {}
    with copies(True):
        offload = Trainer(w, apply_module.apply_plan(copy.deepcopy(w.model), (profile, plan), COMPILE))
        results["offload"] = offload.three_steps()
        health(offload, buffers)
        timings["offload"] = offload.timed(12)
        if os.environ.get("PROBE_TRACE"):
            trace(offload, os.environ["PROBE_TRACE"])
    del offload
    forget_compiled()
    with copies(False):
        regions = Trainer(w, apply_module.apply_plan(copy.deepcopy(w.model), (profile, plan), COMPILE))
        results["regions"] = regions.three_steps()
        results["regions again"] = regions.three_steps()
        timings["regions"] = regions.timed(12)
        if os.environ.get("PROBE_TRACE"):
            trace(regions, regions_trace(os.environ["PROBE_TRACE"]))
    del regions
    forget_compiled()
    # the plan's recompute set compiled whole (keeping everything: the model as compile runs it)
    whole = apply_module.apply_plan(copy.deepcopy(w.model), (profile, dataclasses.replace(plan, offloaded=[])))
    timings["whole"] = Trainer(w, whole).timed(12)

    whole = timings["whole"][0]
    for name in ("whole", "regions", "offload"):
        ms, iqr, peak = timings[name]
        print(f"{name:8s} step {ms:7.1f} ms (IQR {iqr:.1f}), {ms - whole:+6.1f} ms over whole, peak "
              f"{peak / GiB:.3f} GiB", flush=True)
    print(f"the copies take {(timings['regions'][2] - timings['offload'][2]) / GiB:.3f} GiB off the peak "
          f"(planned {plan.offload_bytes / GiB:.3f} off the device)", flush=True)
    print(f"3 steps from the same start: offload against regions: {same(results['offload'], results['regions'])}; "
          f"regions against regions: {same(results['regions again'], results['regions'])}", flush=True)
    print(f"total {time.time() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
