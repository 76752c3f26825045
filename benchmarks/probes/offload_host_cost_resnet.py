"""Where does the time of an offloading rewritten step go? ResNet-152 bs64, Adam, on one GPU.

A step that offloads can be slower than the plan predicts without any copy being late: the simulator prices a
copy by its bytes over the link, but each offloaded activation also costs host time (the runtime's four calls:
copy out, release, copy back, wait) and each copy a fixed latency. On a step whose host barely keeps ahead of
the GPU (ResNet-152's thousands of small kernels), host time is step time. Sections, each failing on its own
with one line:

1. per-copy cost with the runtime's pattern (pinned pool, side streams, events), copies of 1 KiB to 64 MiB queued
   behind a GPU spin: GPU time and host issue time per copy, and a fit latency + bytes / rate per direction;
2. the host cost of the real ``OffloadRuntime``'s four calls, 2 MiB slots, with the GPU kept busy;
3. the model: profile (or the bundled sample profile), plan with and without offload at the peak HF gradient
   checkpointing measured (results/offload/; elsewhere 45% of the profile's peak), and the offload plan's
   recompute set with no copies and with only its copies of 4 MiB or more; per variant the step's host issue
   time (``run()`` returned) against its wall time and its peak, and the time one offload step spends inside the
   runtime's methods;
4. torch.profiler over 2 steps of the recompute and the offload plan: copy streams, copy sizes and fitted
   latency, compute-stream idle split into host-late and device-side waits, the CUDA runtime calls.

The committed result was recorded with section 2 passing an index-less device to the runtime, which refused it
(its one-line failure is in the file); ``offload_link_costs.py`` measures the same four calls.

Run: cd <repo> && PROBE_PROFILE=sample PYTHONPATH=. python3 benchmarks/probes/offload_host_cost_resnet.py \\
         > results/probes/offload_host_cost_resnet.txt 2>&1
Needs one CUDA GPU (under a minute). Env: PROBE_PROFILE=sample (the bundled
sample_profiles/h200_resnet152_bs64_adam.json.gz with a freshly measured link, in place of profiling),
PROBE_MODEL (default resnet152), PROBE_BS (default 64), OUT=<dir> (a fresh profile is saved there).
PROBE_DEVICE=cpu runs only section 3's build and step timing, as a smoke run without a GPU (use a small model:
PROBE_MODEL=resnet18 PROBE_BS=2).
"""

import collections
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
import traceback

import numpy as np
import torch
from _timing import host_and_wall_ms

T0 = time.perf_counter()
dev = torch.device(os.environ.get("PROBE_DEVICE", "cuda"))  # cpu: a dry run of build/timing only


def say(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def section(fn):
    try:
        fn()
    except Exception as exc:  # a probe: the other sections still run
        say(f"SECTION {fn.__name__} FAILED: {type(exc).__name__}: {exc}")
        traceback.print_exc(limit=3)


# --------------------------------------------------------------------------------------------------------------
# 1-2. The copies and the runtime's calls alone: per-copy cost with the runtime's pattern (side stream,
# wait_stream, copy, record event, wait_event), and the host cost of the real OffloadRuntime's calls
# --------------------------------------------------------------------------------------------------------------
def copy_latency():
    say("== per-copy cost, runtime pattern (pinned, side stream, events), copies queued behind a spin ==")
    cur = torch.cuda.current_stream()
    out_s, in_s = torch.cuda.Stream(), torch.cuda.Stream()
    rows = []
    for size, n in [(1024, 400), (16 * 1024, 400), (256 * 1024, 300), (2**20, 200), (4 * 2**20, 100),
                    (16 * 2**20, 40), (64 * 2**20, 12)]:
        src = [torch.empty(size, dtype=torch.uint8, device=dev) for _ in range(n)]
        host = torch.empty(size * n, dtype=torch.uint8, pin_memory=True)
        slots = [host[j * size:(j + 1) * size] for j in range(n)]
        back = [torch.empty(size, dtype=torch.uint8, device=dev) for _ in range(n)]
        evs = [torch.cuda.Event() for _ in range(n)]
        for _ in range(2):  # the second repetition is the one measured
            torch.cuda.synchronize()
            start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            # the compute stream spins (~0.1 s) while everything is issued: GPU times below have no launch gaps,
            # host times no waiting
            torch.cuda._sleep(200_000_000)
            start.record(cur)
            t0 = time.perf_counter()
            for j in range(n):  # d2h as OffloadRuntime.to_host + release
                out_s.wait_stream(cur)
                with torch.cuda.stream(out_s):
                    slots[j].copy_(src[j], non_blocking=True)
                evs[j].record(out_s)
                cur.wait_event(evs[j])
            mid.record(out_s)
            t1 = time.perf_counter()
            in_s.wait_stream(cur)
            for j in range(n):  # h2d as prefetch + wait
                in_s.wait_stream(cur)
                in_s.wait_event(evs[j])
                with torch.cuda.stream(in_s):
                    back[j].copy_(slots[j], non_blocking=True)
                evs[j].record(in_s)
                cur.wait_event(evs[j])
            end.record(in_s)
            t2 = time.perf_counter()
            torch.cuda.synchronize()
        d2h_ms, h2d_ms = start.elapsed_time(mid), mid.elapsed_time(end)
        rows.append((size, n, d2h_ms, h2d_ms, (t1 - t0) * 1e6 / n, (t2 - t1) * 1e6 / n))
        del src, host, slots, back
    print("   size_B      n   d2h_us/copy  h2d_us/copy  d2h_GB/s  h2d_GB/s  host_us/issue(d2h)  host_us/issue(h2d)")
    for size, n, d, h, hd, hh in rows:
        print(f"{size:9d} {n:6d} {d * 1e3 / n:12.2f} {h * 1e3 / n:12.2f} {size * n / d / 1e6:9.2f} "
              f"{size * n / h / 1e6:9.2f} {hd:18.2f} {hh:18.2f}")
    # fit us/copy = latency + bytes / rate over all sizes
    for label, col in (("d2h", 2), ("h2d", 3)):
        x = np.array([r[0] for r in rows], dtype=float)
        y = np.array([r[col] * 1e3 / r[1] for r in rows])
        A = np.vstack([np.ones_like(x), x]).T
        (lat, inv), *_ = np.linalg.lstsq(A, y, rcond=None)
        print(f"   fit {label}: latency {lat:.2f} us + bytes at {1 / inv / 1e3:.2f} GB/s")
    # single-copy latency: one 1KB copy, synchronized, GPU time from events
    ts = []
    s = torch.empty(1024, dtype=torch.uint8, device=dev)
    h = torch.empty(1024, dtype=torch.uint8, pin_memory=True)
    for _ in range(50):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        e0.record(out_s)
        with torch.cuda.stream(out_s):
            h.copy_(s, non_blocking=True)
        e1.record(out_s)
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3)
    print(f"   isolated 1KB d2h copy: median {statistics.median(ts):.2f} us (events on the copy stream)")


def runtime_calls():
    say("== host cost of the OffloadRuntime's four calls (real class, 2MB slots) ==")
    from acstudio.rewrite.offload import OffloadRuntime
    n, size = 200, 2 * 2**20
    rt = OffloadRuntime([f"a{j}" for j in range(n)], [size] * n)
    ts = [torch.empty(size // 4, device=dev) for _ in range(n)]
    rt.ensure_pool(ts[0].device)
    torch.cuda.synchronize()
    for _ in range(2):
        a = torch.randn(8192, 8192, device=dev)
        for _ in range(4):
            a = a @ a  # keep the GPU busy so that host times are pure issue cost
        cost = collections.defaultdict(float)
        bufs = []
        t = time.perf_counter()
        for j in range(n):
            rt.to_host(j, ts[j])
        cost["to_host"] = time.perf_counter() - t
        t = time.perf_counter()
        for j in range(n):
            rt.release(j, (ts[j],))
        cost["release"] = time.perf_counter() - t
        t = time.perf_counter()
        for j in range(n):
            bufs.append(rt.prefetch(j))
        cost["prefetch"] = time.perf_counter() - t
        t = time.perf_counter()
        for j in range(n):
            rt.wait(j, bufs[j])
        cost["wait"] = time.perf_counter() - t
        torch.cuda.synchronize()
    print("   " + "  ".join(f"{k} {v * 1e6 / n:.1f}us" for k, v in cost.items()),
          f" total per offload {sum(cost.values()) * 1e6 / n:.1f}us")
    # a plain aten op's host cost for scale
    x = torch.empty(1024, device=dev)
    t = time.perf_counter()
    for _ in range(2000):
        torch.ops.aten.relu.default(x)
    print(f"   for scale: one aten.relu host cost {(time.perf_counter() - t) * 1e6 / 2000:.1f}us")


# --------------------------------------------------------------------------------------------------------------
# 3-4. The model: profile, plan with and without offload, rewrite, time, torch.profiler
# --------------------------------------------------------------------------------------------------------------
STATE = {}


def per_block_peak(model, batch_size):
    """The peak that HF gradient checkpointing (bench's ``per-block`` row) measured for this model and batch size
    in results/offload/, or None where that file has no such row."""
    path = os.path.join("results", "offload", f"{model}_bs{batch_size}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        rows = json.load(f)["rows"]
    return next((r["peak_bytes"] for r in rows if r["config"] == "per-block" and r["batch_size"] == batch_size
                 and r["status"] == "ok"), None)


def build():
    from acstudio.bench.steps import with_headroom
    from acstudio.capture.serialize import deserialize_step
    from acstudio.capture.step import prepare_optimizer
    from acstudio.plan import plan
    from acstudio.profile.model import Profile
    from acstudio.profiler import measure_host_link, profile_workload
    from acstudio.rewrite.rewriter import plan_activations, rewrite, rewrite_step
    from acstudio.workload import WorkloadSpec, build_workload

    model = os.environ.get("PROBE_MODEL", "resnet152")
    batch_size = int(os.environ.get("PROBE_BS", 64))
    spec = WorkloadSpec(model=model, batch_size=batch_size, optimizer="adam")
    if os.environ.get("PROBE_PROFILE") == "sample" and (model, batch_size) == ("resnet152", 64):
        prof = Profile.load("sample_profiles/h200_resnet152_bs64_adam.json.gz")
        prof.host_link = measure_host_link(dev)
        say("profile: the bundled sample, link measured now")
    else:
        say(f"profiling {model} bs{batch_size} ...")
        prof = profile_workload(spec, dev.type)
        if os.environ.get("OUT"):
            prof.save(os.path.join(os.environ["OUT"], f"{model}_bs{batch_size}.json.gz"))
    torch.cuda.empty_cache()
    run_sum = sum(n.run_time_ms for n in prof.nodes)
    say(f"profile: {len(prof.nodes)} nodes, {len(prof.activations)} acts, iteration_ms {prof.iteration_ms:.2f}, "
        f"sum node run_ms {run_sum:.1f} (time_scale {prof.time_scale:.3f}), peak {prof.peak_bytes / 2**30:.2f} GiB")
    say(f"link: {prof.host_link}")
    budget = with_headroom(per_block_peak(model, batch_size) or int(0.45 * prof.peak_bytes))
    plans = {}
    for name, off in (("recompute", False), ("offload", True)):
        t = time.perf_counter()
        p = plan(prof, budget, offload=off)
        plans[name] = p
        say(f"plan {name}: {p.stop_reason} | extra {p.predicted_extra_ms:.2f} ms, peak "
            f"{p.predicted_peak_bytes / 2**30:.3f} GiB, recomputed {len(p.recomputed)}, offloaded "
            f"{len(p.offloaded)} ({(p.offload_bytes or 0) / 2**20:.0f} MiB), stall {p.offload_stall_ms} "
            f"[{time.perf_counter() - t:.1f}s]")
    sizes = {a.id: a.bytes for a in prof.activations}
    s = np.array(sorted(sizes[k] for k in plans["offload"].offloaded))
    if len(s):
        print("   offloaded sizes: n", len(s), "min", s.min(), "median", int(np.median(s)), "max", s.max(),
              "| count <64KB", int((s < 65536).sum()), "<1MB", int((s < 2**20).sum()), "<4MB",
              int((s < 4 * 2**20).sum()), "| bytes in <4MB", int(s[s < 4 * 2**20].sum()))
    w = build_workload(spec).to(dev)
    opt = w.make_optimizer()
    prepare_optimizer(w.model, opt)
    steps = {"captured": deserialize_step(prof.graph, device=dev.type)}
    for name, p in plans.items():
        steps[name] = rewrite(deserialize_step(prof.graph, device=dev.type), prof, p)
    # the offload plan's recompute set alone, and with only its large offloads: isolates the small copies' cost
    po = plans["offload"]
    ids = plan_activations(po, prof)
    big = [k for k in po.offloaded if sizes[k] >= 4 * 2**20]
    steps["off-plan,no-copies"] = rewrite_step(deserialize_step(prof.graph, device=dev.type), prof, ids, offloaded=[])
    if len(big) < len(po.offloaded):
        steps["off-plan,>=4MiB-copies"] = rewrite_step(deserialize_step(prof.graph, device=dev.type), prof, ids,
                                                      offloaded=big)
    STATE.update(prof=prof, plans=plans, steps=steps, w=w, opt=opt)
    for name, st in steps.items():
        say(f"graph {name}: {len(st.gm.graph.nodes)} nodes, offload nodes "
            f"{sum(1 for n in st.gm.graph.nodes if n.meta.get('ac_role') == 'offload')}")


def timed_runs():
    say("== step times (median of 10 after 3 warmup): host issue ms (run() returned) vs total ms (synced) ==")
    w, opt = STATE["w"], STATE["opt"]
    for name, st in STATE["steps"].items():
        for _ in range(3):
            st.run(w.model, opt, w.batch)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        host, total = host_and_wall_ms(lambda st=st: st.run(w.model, opt, w.batch), 10)
        say(f"{name:22s} total {statistics.median(total):7.2f} ms (min {min(total):.2f} max {max(total):.2f}) "
            f"host issue {statistics.median(host):7.2f} ms  peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    # host time inside the offload runtime's methods, one step
    from acstudio.rewrite import offload as off
    cls = off.OffloadRuntime
    acc = collections.defaultdict(lambda: [0, 0.0])
    orig = {m: getattr(cls, m) for m in ("to_host", "release", "prefetch", "wait")}

    def wrap(m, f):
        def g(self, *a):
            t = time.perf_counter()
            r = f(self, *a)
            acc[m][0] += 1
            acc[m][1] += time.perf_counter() - t
            return r
        return g

    for m, f in orig.items():
        setattr(cls, m, wrap(m, f))
    try:
        st = STATE["steps"]["offload"]
        torch.cuda.synchronize()
        t = time.perf_counter()
        st.run(w.model, opt, w.batch)
        h = (time.perf_counter() - t) * 1e3
        torch.cuda.synchronize()
        tot = (time.perf_counter() - t) * 1e3
    finally:
        for m, f in orig.items():
            setattr(cls, m, f)
    print(f"   offload step with method timers: host {h:.2f} ms, total {tot:.2f} ms; in runtime: " +
          ", ".join(f"{m} {c}x {s * 1e3:.2f}ms" for m, (c, s) in acc.items()))


def trace_summary():
    from torch.profiler import ProfilerActivity, profile
    w, opt = STATE["w"], STATE["opt"]
    for name in ("recompute", "offload"):
        st = STATE["steps"][name]
        st.run(w.model, opt, w.batch)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                st.run(w.model, opt, w.batch)
            torch.cuda.synchronize()
        path = os.path.join(tempfile.gettempdir(), f"hostcost_{name}.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
        os.unlink(path)
        summarize(name, [e for e in trace["traceEvents"] if e.get("ph") == "X"])


def merged(intervals):
    total, end = 0.0, -1e30
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarize(name, ev):
    say(f"== torch.profiler, 2 steps of '{name}' ==")
    gpu = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        print("   no GPU events")
        return
    t0, t1 = min(e["ts"] for e in gpu), max(e["ts"] + e["dur"] for e in gpu)
    print(f"   GPU span {(t1 - t0) / 2e3:.2f} ms/step")
    by_stream = collections.defaultdict(list)
    for e in gpu:
        by_stream[e.get("args", {}).get("stream")].append(e)
    compute = max(by_stream, key=lambda s: sum(e["dur"] for e in by_stream[s] if e["cat"] == "kernel"))
    for s, es in sorted(by_stream.items(), key=lambda kv: -len(kv[1])):
        cats = collections.Counter(e["cat"] for e in es)
        print(f"   stream {s}{' (compute)' if s == compute else ''}: {dict(cats)}, busy "
              f"{merged([(e['ts'], e['ts'] + e['dur']) for e in es]) / 2e3:.2f} ms/step")
    # copies
    cp = [e for e in gpu if e["cat"] == "gpu_memcpy"]
    kinds = collections.defaultdict(list)
    for e in cp:
        kinds[e["name"]].append(e)
    for k, es in kinds.items():
        b = np.array([e.get("args", {}).get("bytes", 0) for e in es], dtype=float)
        d = np.array([e["dur"] for e in es], dtype=float)
        line = (f"   {k}: {len(es) / 2:.0f}/step, {b.sum() / 2 / 2**20:.0f} MiB/step, {d.sum() / 2e3:.2f} ms/step")
        if len(es) > 3 and b.std() > 0:
            A = np.vstack([np.ones_like(b), b]).T
            (lat, inv), *_ = np.linalg.lstsq(A, d, rcond=None)
            line += f"; fit dur = {lat:.2f}us + bytes at {1 / inv / 1e3 if inv > 0 else float('nan'):.1f} GB/s"
        small = d[b < 2**20]
        if len(small):
            line += f"; <1MB copies: {len(small) / 2:.0f}/step, median {np.median(small):.2f}us"
        print(line)
    # compute-stream gaps: host-late (launch after the previous kernel ended) vs device-side wait
    launches = {}
    for e in ev:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = e["ts"] + e["dur"]
    ks = sorted(by_stream[compute], key=lambda e: e["ts"])
    host_late = dev_wait = 0.0
    gaps = []
    for prev, k in itertools.pairwise(ks):
        end = prev["ts"] + prev["dur"]
        idle = k["ts"] - end
        if idle <= 0:
            continue
        launched = launches.get(k.get("args", {}).get("correlation"))
        late = 0.0 if launched is None else min(idle, max(0.0, launched - end))
        host_late += late
        dev_wait += idle - late
        gaps.append((idle, late, k["name"][:60]))
    gaps.sort(reverse=True)
    print(f"   compute-stream idle {sum(g[0] for g in gaps) / 2e3:.2f} ms/step: host-late {host_late / 2e3:.2f}, "
          f"device-side wait (events) {dev_wait / 2e3:.2f}; gaps>50us: {sum(g[0] > 50 for g in gaps) / 2:.0f}/step")
    for idle, late, kname in gaps[:5]:
        print(f"     gap {idle:8.1f}us (host-late {late:7.1f}) before {kname}")
    # host side
    cpu = [e for e in ev if e.get("cat") == "cuda_runtime"]
    calls = collections.defaultdict(lambda: [0, 0.0])
    for e in cpu:
        calls[e["name"]][0] += 1
        calls[e["name"]][1] += e["dur"]
    top = sorted(calls.items(), key=lambda kv: -kv[1][1])[:8]
    print("   CUDA runtime calls/step: " + ", ".join(f"{k} {c / 2:.0f}x {s / 2e3:.2f}ms" for k, (c, s) in top))
    ops = [e for e in ev if e.get("cat") == "cpu_op"]
    if ops:
        c0, c1 = min(e["ts"] for e in ops), max(e["ts"] + e["dur"] for e in ops)
        print(f"   CPU ops span {(c1 - c0) / 2e3:.2f} ms/step (host under profiler, inflated), GPU span "
              f"{(t1 - t0) / 2e3:.2f} ms/step")


def main():
    if dev.type != "cuda":  # dry run
        for f in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
            setattr(torch.cuda, f, lambda *a: None)
        torch.cuda.max_memory_allocated = lambda *a: 0
        build()
        timed_runs()
        return
    say(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    section(copy_latency)
    section(runtime_calls)
    section(build)
    if STATE:
        section(timed_runs)
        section(trace_summary)
    say("done")


if __name__ == "__main__":
    sys.exit(main())
