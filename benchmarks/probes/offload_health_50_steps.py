"""Does an offloading rewritten step stay healthy over many steps? 50 steps of GPT-2 small (bs8, seq 512, Adam)
rewritten to offload about 1 GiB of activations, the largest offloadable ones first.

An offload plan keeps a pinned host pool and two copy streams alive across steps; a leak there (a pool made
again, buffers kept by the copy streams, pinned memory growing) would not show in one verified step. Per step it
prints the device peak (``max_memory_allocated``, reset before each step), the memory still allocated after it,
the process RSS, torch's pinned host bytes where it reports them, the step time and the pool's address; then the
spread of those from step 2 on. For scale, 10 steps of the same graph without offload (its peak and time) and
whether the first 3 steps of both are bitwise equal from the same start (on CUDA, see
``offload_bitwise_control.py`` for why they need not be).

Run: cd <repo> && PYTHONPATH=. python3 benchmarks/probes/offload_health_50_steps.py \
         > results/probes/offload_health_50_steps.txt
Needs one CUDA GPU (under a minute on an H200). Env: PROBE_OFFLOAD_GIB (default 1.0), PROBE_STEPS (default 50);
PROBE_DEVICE=cpu PROBE_TINY=1 is a smoke run of the script on a 2-layer GPT-2 without a GPU.
"""

import copy
import os
import sys
import time

import numpy as np
import torch

from acstudio.capture.serialize import deserialize_step
from acstudio.capture.step import prepare_optimizer
from acstudio.plan.schedule import PlanContext
from acstudio.profiler import profile_workload
from acstudio.rewrite import offload as offload_module
from acstudio.rewrite.rewriter import rewrite, rewrite_step
from acstudio.workload import WorkloadSpec, build_workload
from acstudio.workload.spec import make_optimizer

GiB = 2**30
PAGE = os.sysconf("SC_PAGE_SIZE")
TARGET = float(os.environ.get("PROBE_OFFLOAD_GIB", "1.0")) * GiB
STEPS = int(os.environ.get("PROBE_STEPS", "50"))
DEVICE = os.environ.get("PROBE_DEVICE", "cuda")
TINY_CONFIG = (("n_layer", "2"), ("n_embd", "32"), ("n_head", "2"), ("vocab_size", "120"), ("n_positions", "64"))
CUDA = DEVICE == "cuda"


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_alloc() -> tuple[int, int]:
    return (torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()) if CUDA else (0, 0)


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def pinned() -> int | None:
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        return None
    try:
        s = stats()
    except Exception:
        return None
    for key in ("allocated_bytes.current", "reserved_bytes.current", "allocations.current"):
        if key in s:
            return int(s[key])
    return None


def main() -> int:
    t0 = time.time()
    print(f"torch {torch.__version__} device {torch.cuda.get_device_name() if CUDA else DEVICE}", flush=True)
    if os.environ.get("PROBE_TINY"):
        spec = WorkloadSpec("gpt2", batch_size=2, seq_len=16, config=TINY_CONFIG)
    else:
        spec = WorkloadSpec("gpt2", batch_size=8, seq_len=512)
    profile = profile_workload(spec, DEVICE)
    print(f"profiled in {time.time() - t0:.0f}s: peak {profile.peak_bytes / GiB:.3f} GiB, iteration "
          f"{profile.iteration_ms:.1f} ms, link {profile.host_link}", flush=True)
    ctx = PlanContext(profile, offload=True)
    sim = ctx.sim
    offloadable = np.flatnonzero(sim.offload_facts.offloadable)
    order = sorted(offloadable.tolist(), key=lambda k: -int(sim.replay.bytes[k]))
    chosen, total = [], 0
    for k in order:
        if total >= TARGET:
            break
        chosen.append(int(k))
        total += int(sim.replay.bytes[k])
    plan = ctx.plan_for_set("mutwo", profile.peak_bytes, [], offloaded=chosen)
    print(f"plan: {len(plan.offloaded)} offloaded, {plan.offload_bytes / GiB:.3f} GiB each way, predicted peak "
          f"{plan.predicted_peak_bytes / GiB:.3f} GiB (profile {profile.peak_bytes / GiB:.3f}), extra "
          f"{plan.predicted_extra_ms:.2f} ms, stall {plan.offload_stall_ms:.2f} ms, hidden {plan.copies_hidden}",
          flush=True)
    dev = torch.device(DEVICE)
    graph = deserialize_step(profile.graph, device=DEVICE)
    step = rewrite(graph, profile, plan)
    plain = rewrite_step(graph, profile, [], offloaded=[])
    runtime = getattr(step.gm, offload_module.RUNTIME_ATTR)

    w = build_workload(spec).to(dev)
    opt = w.make_optimizer()
    prepare_optimizer(w.model, opt)
    ref_model = copy.deepcopy(w.model)
    ref_opt = make_optimizer(spec.optimizer, ref_model.parameters())
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))

    rows = []
    print(" step   peak_GiB  alloc_GiB   rss_MiB  pinned     ms  pool_ptr", flush=True)
    for i in range(STEPS):
        sync()
        t = time.perf_counter()
        torch.manual_seed(i)
        loss = step.run(w.model, opt, w.batch)
        if CUDA:
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t) * 1e3
        (peak, alloc), r, p = peak_alloc(), rss(), pinned() if CUDA else None
        rows.append((peak, alloc, r, ms, float(loss)))
        ptr = runtime.pool.data_ptr() if runtime.pool is not None else 0
        if i < 5 or i % 5 == 4:
            print(f"{i:5d} {peak / GiB:10.4f} {alloc / GiB:10.4f} {r / 2**20:9.1f} {p!s:>7} {ms:6.1f} {ptr:#x}",
                  flush=True)
    peaks = np.array([r[0] for r in rows])
    allocs = np.array([r[1] for r in rows])
    print(f"allocated after each step from step 2: spread {int(allocs[2:].max() - allocs[2:].min())} B; "
          f"distinct peaks from step 2: {len(set(peaks[2:].tolist()))}", flush=True)
    rsss = np.array([r[2] for r in rows])
    times = np.array([r[3] for r in rows])
    print(f"offload: peak after step 2 min {peaks[2:].min() / GiB:.4f} max {peaks[2:].max() / GiB:.4f} GiB "
          f"(spread {int(peaks[2:].max() - peaks[2:].min())} B); rss step2 {rsss[2] / 2**20:.1f} MiB -> last "
          f"{rsss[-1] / 2**20:.1f} MiB (growth {(rsss[-1] - rsss[2]) / 2**20:.1f} MiB); step ms median "
          f"{np.median(times[2:]):.1f} (min {times[2:].min():.1f} max {times[2:].max():.1f}); pool "
          f"{runtime.pool_bytes / GiB:.3f} GiB pinned={runtime.pool.is_pinned()}", flush=True)
    print(f"loss step0 {rows[0][4]:.4f} step{STEPS - 1} {rows[-1][4]:.4f}", flush=True)

    # The same plan without offload: its peak and time, and bitwise equality from the same start.
    eq_model = copy.deepcopy(ref_model)
    eq_opt = make_optimizer(spec.optimizer, eq_model.parameters())
    eq_opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    plain_peaks, plain_times, equal = [], [], True
    for i in range(10):
        sync()
        t = time.perf_counter()
        torch.manual_seed(i)
        a = plain.run(ref_model, ref_opt, w.batch)
        if CUDA:
            torch.cuda.synchronize()
        plain_times.append((time.perf_counter() - t) * 1e3)
        plain_peaks.append(peak_alloc()[0])
        if i < 3:
            torch.manual_seed(i)
            b = step.run(eq_model, eq_opt, w.batch)
            equal &= torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(ref_model.parameters(),
                                                                                    eq_model.parameters()))
    print(f"no offload: peak {max(plain_peaks[2:]) / GiB:.4f} GiB, step ms median {np.median(plain_times[2:]):.1f}; "
          f"offload saves {(max(plain_peaks[2:]) - peaks[2:].max()) / GiB:.4f} GiB "
          f"(planned {(profile.peak_bytes - plan.predicted_peak_bytes) / GiB:.4f}); first 3 steps bitwise equal: "
          f"{equal}", flush=True)
    print(f"total {time.time() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
