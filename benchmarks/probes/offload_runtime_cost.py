"""The host cost of the offload runtime's calls before and after they were made cheap (events made once per slot,
copy streams entered with ``set_stream``), the exact-size page-locked pool (``cudaHostRegister``) on this torch, and
bitwise round trips under side-stream copies. Sections, each failing on its own with one line:

1. host µs per call of the torch primitives the runtime is made of, with the GPU spinning (so nothing waits);
2. the rewritten step's ``OffloadRuntime``: its four calls, host µs each, 4 KiB and 2 MiB slots, old and new;
3. the SAC form's ``SacOffload``: copy out, copy back and wait per offloaded storage, old and new;
4. the profiler's ``_copy_costs_us`` (which times the runtime's own calls), old and new;
5. a 600 MiB pool made with ``pin_memory=True`` and as ``PageLocked``: RSS it takes, copy rates, async copies, and
   the pages unlocked when it is freed;
6. bitwise round trips through the new runtime (and the SAC form) with the released device memory overwritten at
   once, all queued behind a GPU spin, so any missing stream order would show as wrong bytes;
7. ResNet-152 bs64 (the bundled H200 sample profile, its link measured now): one step of the recompute plan and of
   the offload plan with the old and the new runtime from the same state (bitwise), then their step times.

The old code is main's before the change (commit ``OLD`` below, taken with ``git show``); the new is this
checkout's. The recorded output ran the same sections with the new code copied beside the probe, before it was
merged.

Run: cd <repo> && PYTHONPATH=. python3 benchmarks/probes/offload_runtime_cost.py \\
         > results/probes/offload_runtime_cost.txt 2>&1
Needs one CUDA GPU and the repository's git history (under a minute).
"""
import copy
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from _timing import runtime_call_rounds

from acstudio import hostcopy
from acstudio import profiler as profiler_new
from acstudio.export import apply as apply_new

OLD = "3219d9c"  # main before the runtime was made cheap
_OLD_DIR = Path(tempfile.mkdtemp(prefix="offload_old_"))
for _name, _path in (("offload_old", "acstudio/rewrite/offload.py"), ("apply_old", "acstudio/export/apply.py"),
                     ("profiler_old", "acstudio/profiler.py")):
    _text = subprocess.run(["git", "show", f"{OLD}:{_path}"], capture_output=True, text=True, check=True).stdout
    _text = _text.replace("from acstudio.rewrite.offload import", "from offload_old import")
    (_OLD_DIR / f"{_name}.py").write_text(_text)
sys.path.insert(0, str(_OLD_DIR))
import apply_old  # noqa: E402
import offload_old  # noqa: E402
import profiler_old  # noqa: E402

T0 = time.perf_counter()
dev = torch.device("cuda", 0)


def say(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def section(fn):
    try:
        fn()
    except Exception as exc:  # the other sections still run
        say(f"SECTION {fn.__name__} FAILED: {type(exc).__name__}: {exc}")
        traceback.print_exc(limit=4)


def per_call_us(f, n=400, repeats=3, spin=True):
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        if spin:
            torch.cuda._sleep(50_000_000)
        t = time.perf_counter()
        for _ in range(n):
            f()
        best = min(best, (time.perf_counter() - t) * 1e6 / n)
    torch.cuda.synchronize()
    return best


def primitives():
    say("== 1. host us per call of the primitives (best of 3 x 400, GPU spinning) ==")
    s, c = torch.cuda.Stream(dev), torch.cuda.current_stream(dev)
    ev = torch.cuda.Event()
    t = torch.empty(1024, device=dev)
    st = t.untyped_storage()
    pinned = torch.empty(4096, dtype=torch.uint8, pin_memory=True)
    locked = hostcopy.PageLocked(4096, dev)
    src = torch.empty(4096, dtype=torch.uint8, device=dev)
    pinned_st, src_st = pinned.untyped_storage(), src.untyped_storage()
    rows = {
        "cuda.current_stream(dev)": lambda: torch.cuda.current_stream(dev),
        "cuda.current_stream()": lambda: torch.cuda.current_stream(),
        "cuda.current_device()": lambda: torch.cuda.current_device(),
        "event.record(stream)": lambda: ev.record(s),
        "stream.wait_event(ev)": lambda: s.wait_event(ev),
        "stream.wait_stream(c)": lambda: s.wait_stream(c),
        "set_stream(s)+set_stream(c)": lambda: (torch.cuda.set_stream(s), torch.cuda.set_stream(c)),
        "with torch.cuda.stream(s)": lambda: torch.cuda.stream(s).__enter__() or None,
        "t.untyped_storage()": lambda: t.untyped_storage(),
        "empty(0).set_(storage)": lambda: torch.empty(0, dtype=torch.uint8, device=dev).set_(st),
        "empty(4096, uint8, cuda)": lambda: torch.empty(4096, dtype=torch.uint8, device=dev),
        "t.record_stream(s)": lambda: t.record_stream(s),
        "d2h copy_ 4KB pin_memory": lambda: pinned.copy_(src, non_blocking=True),
        "d2h copy_ 4KB registered": lambda: locked.data.copy_(src, non_blocking=True),
        "h2d copy_ 4KB pin_memory": lambda: src.copy_(pinned, non_blocking=True),
        "h2d copy_ 4KB registered": lambda: src.copy_(locked.data, non_blocking=True),
        "d2h storage.copy_ 4KB pin_memory": lambda: pinned_st.copy_(src_st, non_blocking=True),
        "UntypedStorage(4096, device)": lambda: torch.UntypedStorage(4096, device=dev),
    }

    def ctx():
        with torch.cuda.stream(s):
            pass
    rows["with torch.cuda.stream(s)"] = ctx
    if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "current_stream"):
        rows["accelerator.current_stream(dev)"] = lambda: torch.accelerator.current_stream(dev)
        rows["accelerator.set_stream x2"] = lambda: (torch.accelerator.set_stream(s), torch.accelerator.set_stream(c))
    for name, f in rows.items():
        try:
            print(f"   {name:34s} {per_call_us(f):7.2f} us")
        except Exception as exc:
            print(f"   {name:34s} FAILED {type(exc).__name__}: {exc}")
    locked.free()


def runtime_calls():
    say("== 2. OffloadRuntime's four calls, host us per call (best of 4 rounds of 200 slots, GPU spinning) ==")
    for size in (4096, 2 * 2**20):
        for label, cls in (("old", offload_old.OffloadRuntime), ("new", hostcopy.OffloadRuntime)):
            rounds = runtime_call_rounds(cls, size, 200, dev, 4)
            b = {name: min(r[name] for r in rounds) * 1e6 / 200 for name in rounds[0]}
            print(f"   {label} {size:>8d} B: " + "  ".join(f"{k} {v:6.2f}" for k, v in b.items()),
                  f"| per offload {sum(b.values()):6.2f} us")


def sac_calls():
    say("== 3. SacOffload per offloaded storage: to_host + fetch + wait, host us (2nd round: pool reused) ==")
    for label, mod in (("old", apply_old), ("new", apply_new)):
        off = mod.SacOffload(64 * 2**21)
        ts = [torch.randn(2**19, device=dev) for _ in range(64)]
        for r in range(3):
            torch.cuda.synchronize()
            torch.cuda._sleep(400_000_000)
            t = time.perf_counter()
            stored = [off.to_host(x) for x in ts]
            t1 = time.perf_counter()
            for s in stored:
                off.fetch(s)
            t2 = time.perf_counter()
            outs = [off.wait(s) for s in stored]
            t3 = time.perf_counter()
            torch.cuda.synchronize()
            ok = all(torch.equal(o, hostcopy.storage_bytes(x)) for o, x in zip(outs, ts))
            for s in stored:
                off.pool.setdefault(s.nbytes, []).append(s.host)
                s.fetched = None
            if r:
                n = len(ts)
                print(f"   {label} round {r}: to_host {(t1 - t) * 1e6 / n:6.2f}  fetch {(t2 - t1) * 1e6 / n:6.2f}  "
                      f"wait {(t3 - t2) * 1e6 / n:6.2f} | per storage {(t3 - t) * 1e6 / n:6.2f} us, bitwise {ok}")


def profiler_costs():
    say("== 4. the profiler's _copy_costs_us (latency_us, offload_issue_us, op_issue_us), 4 KiB x 64 ==")
    for label, mod in (("old", profiler_old), ("new", profiler_new)):
        r = [mod._copy_costs_us(dev, 4096, 64) for _ in range(3)]
        print(f"   {label}: " + " | ".join("(" + ", ".join(f"{v:.2f}" for v in x) + ")" for x in r))


def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024


def pools():
    say("== 5. exact-size page-locked pool (cudaHostRegister) vs pin_memory=True ==")
    n = 600 * 2**20 + 12345
    dsrc = torch.randint(0, 255, (n,), dtype=torch.uint8, device=dev)
    for label, make in (("pin_memory", lambda: torch.empty(n, dtype=torch.uint8, pin_memory=True)),
                        ("PageLocked", lambda: hostcopy.PageLocked(n, dev))):
        r0 = rss()
        t = time.perf_counter()
        obj = make()
        made = time.perf_counter() - t
        data = obj if isinstance(obj, torch.Tensor) else obj.data
        r1 = rss()
        stats = {k: v for k, v in torch.cuda.host_memory_stats().items()
                 if k in ("allocated_bytes.current", "reserved_bytes.current")} \
            if hasattr(torch.cuda, "host_memory_stats") else {}
        torch.cuda.synchronize()
        t = time.perf_counter()
        data.copy_(dsrc, non_blocking=True)
        ret = time.perf_counter() - t
        torch.cuda.synchronize()
        d2h = n / (time.perf_counter() - t) / 1e9
        back = torch.empty_like(dsrc)
        t = time.perf_counter()
        back.copy_(data, non_blocking=True)
        torch.cuda.synchronize()
        h2d = n / (time.perf_counter() - t) / 1e9
        extra = (f", locked_bytes {obj.locked_bytes} (= pinned_bytes {hostcopy.pinned_bytes(n)}, asked {n})"
                 if not isinstance(obj, torch.Tensor) else "")
        print(f"   {label:10s}: made in {made:.3f}s, rss +{(r1 - r0) / 2**20:.1f} MiB for {n / 2**20:.1f} MiB, "
              f"host stats {stats}, d2h copy_ returned after {ret * 1e3:.3f} ms, d2h {d2h:.1f} GB/s, h2d "
              f"{h2d:.1f} GB/s, round trip bitwise {torch.equal(back, dsrc)}{extra}")
        if not isinstance(obj, torch.Tensor):
            t = time.perf_counter()
            obj.free()
            print(f"   PageLocked.free (sync + cudaHostUnregister) {time.perf_counter() - t:.3f}s; register the "
                  f"same pages again: {torch.cuda.cudart().cudaHostRegister(data.data_ptr(), n, 0)}, then "
                  f"unregister {torch.cuda.cudart().cudaHostUnregister(data.data_ptr())}")
            del obj
        del data
    torch.cuda.empty_cache()


def roundtrip():
    say("== 6. bitwise round trips, new runtime: device memory reused right after release, GPU spinning ==")
    # (a base tensor, the view of it that backward reads)
    cases = [((257, 129), torch.float32, lambda b: b), ((64, 3, 33, 33), torch.bfloat16, lambda b: b),
             ((4097,), torch.int32, lambda b: b), ((512, 512), torch.float16, lambda b: b.t()[3:, 5:]),
             ((8 * 2**20,), torch.float32, lambda b: b[7:])]
    bases = [torch.randn(s, device=dev).to(d) if d != torch.int32 else
             torch.randint(-2**31, 2**31 - 1, s, dtype=d, device=dev) for s, d, _ in cases]
    n = len(cases)
    rt = hostcopy.OffloadRuntime([f"a{j}" for j in range(n)], [b.untyped_storage().nbytes() for b in bases])
    rt.ensure_pool(dev)
    for it in range(3):
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # everything below queues behind this
        made = [b + it if b.dtype != torch.int32 else b ^ it for b in bases]  # produced after the spin
        views = [f(m) for m, (_, _, f) in zip(made, cases)]
        refs = [v.clone() for v in views]
        raw = [hostcopy.storage_bytes(m).clone() for m in made]
        for j, m in enumerate(made):
            rt.to_host(j, m)
        for j, v in enumerate(views):
            rt.release(j, (v,))
        sizes = [m.untyped_storage().nbytes() for m in made]
        del made, views, m, v
        junk = [torch.full((s,), 0xA5, dtype=torch.uint8, device=dev) for s in sizes]  # reuses the freed blocks
        bufs = [rt.prefetch(j) for j in range(n)]
        del junk
        junk = [torch.full((s,), 0x5A, dtype=torch.uint8, device=dev) for s in sizes]
        back = [rt.wait(j, bufs[j])[0] for j in range(n)]
        ok = [torch.equal(b, r) and torch.equal(hostcopy.storage_bytes(b), q) for b, r, q in zip(back, refs, raw)]
        layout = [b.shape == r.shape and b.stride() == r.stride() for b, r in zip(back, refs)]
        torch.cuda.synchronize()
        print(f"   step {it}: bitwise per slot {ok}, layouts {layout}")
        del junk, bufs, back
    say("   SAC new: to_host with record_stream, the tensor dropped at once, memory refilled, fetch, wait")
    off = apply_new.SacOffload(2**26)
    for it in range(3):
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)
        made = [b + it if b.dtype != torch.int32 else b ^ it for b in bases]
        raw = [hostcopy.storage_bytes(m).clone() for m in made]
        stored = [off.to_host(m) for m in made]
        sizes = [m.untyped_storage().nbytes() for m in made]
        del made
        junk = [torch.full((s,), 0xA5, dtype=torch.uint8, device=dev) for s in sizes]
        outs = [off.wait(s) for s in stored]
        ok = [torch.equal(o, r) for o, r in zip(outs, raw)]
        torch.cuda.synchronize()
        for s in stored:
            off.pool.setdefault(s.nbytes, []).append(s.host)
            s.fetched = None
        print(f"   SAC step {it}: bitwise {ok}")
        del junk, outs


STATE = {}


def model_steps_impl():
    say("== 7. ResNet-152 bs64 (sample profile): recompute plan, offload plan with the old / new runtime ==")
    from acstudio.bench.steps import with_headroom
    from acstudio.capture.serialize import deserialize_step
    from acstudio.capture.step import prepare_optimizer
    from acstudio.plan import plan
    from acstudio.profile.model import Profile
    from acstudio.rewrite import offload as offload_module
    from acstudio.rewrite.rewriter import rewrite
    from acstudio.workload import WorkloadSpec, build_workload

    prof = Profile.load("sample_profiles/h200_resnet152_bs64_adam.json.gz")
    prof.host_link = profiler_new.measure_host_link(dev)
    say(f"link (new profiler): {prof.host_link}")
    budget = with_headroom(int(0.45 * prof.peak_bytes))
    path = os.path.join("results", "offload", "resnet152_bs64.json")
    if os.path.exists(path):
        import json
        with open(path) as f:
            rows = json.load(f)["rows"]
        peak = next((r["peak_bytes"] for r in rows if r["config"] == "per-block" and r["batch_size"] == 64
                     and r["status"] == "ok"), None)
        if peak:
            budget = with_headroom(peak)
    plans = {}
    for name, off in (("recompute", False), ("offload", True)):
        p = plans[name] = plan(prof, budget, offload=off)
        say(f"plan {name}: extra {p.predicted_extra_ms:.2f} ms, offloaded {len(p.offloaded)} "
            f"({(p.offload_bytes or 0) / 2**20:.0f} MiB), stall {p.offload_stall_ms}")
    spec = WorkloadSpec(model="resnet152", batch_size=64, optimizer="adam")
    w = build_workload(spec).to(dev)
    opt = w.make_optimizer()
    prepare_optimizer(w.model, opt)
    steps = {"recompute": rewrite(deserialize_step(prof.graph, device="cuda"), prof, plans["recompute"])}
    original = offload_module.OffloadRuntime
    try:
        for label, cls in (("offload old", offload_old.OffloadRuntime), ("offload new", hostcopy.OffloadRuntime)):
            offload_module.OffloadRuntime = cls
            steps[label] = rewrite(deserialize_step(prof.graph, device="cuda"), prof, plans["offload"])
    finally:
        offload_module.OffloadRuntime = original
    for label, st in steps.items():
        rt = getattr(st.gm, offload_module.RUNTIME_ATTR, None)
        say(f"graph {label}: runtime {type(rt).__module__ if rt is not None else None}")

    # bitwise: one step each from the same state, deterministic cuDNN
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    state = (copy.deepcopy(w.model.state_dict()), copy.deepcopy(opt.state_dict()))

    def one(st):
        w.model.load_state_dict(state[0])
        opt.load_state_dict(state[1])
        loss = st.run(w.model, opt, w.batch)
        torch.cuda.synchronize()
        return (loss.detach().clone(), [p.grad.clone() for p in w.model.parameters() if p.grad is not None],
                [p.detach().clone() for p in w.model.parameters()])

    ref = one(steps["recompute"])
    runs = {k: one(steps[k]) for k in ("recompute", "offload old", "offload new")}

    def same(a, b):
        return (torch.equal(a[0], b[0]), all(torch.equal(x, y) for x, y in zip(a[1], b[1])),
                all(torch.equal(x, y) for x, y in zip(a[2], b[2])))
    for k in ("recompute", "offload old", "offload new"):
        print(f"   bitwise (loss, grads, params) {k} vs recompute: {same(runs[k], ref)}")
    del runs, ref
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = False, False
    w.model.load_state_dict(state[0])
    opt.load_state_dict(state[1])
    state = None
    torch.cuda.empty_cache()

    say("   step times, 3 interleaved rounds x 8 steps after 3 warm-up: median host issue / wall ms, peak")
    res = {k: ([], []) for k in steps}
    for st in steps.values():
        for _ in range(3):
            st.run(w.model, opt, w.batch)
    for _ in range(3):
        for k, st in steps.items():
            for _ in range(8):
                torch.cuda.synchronize()
                t = time.perf_counter()
                st.run(w.model, opt, w.batch)
                res[k][0].append((time.perf_counter() - t) * 1e3)
                torch.cuda.synchronize()
                res[k][1].append((time.perf_counter() - t) * 1e3)
    for k, (h, wall) in res.items():
        torch.cuda.reset_peak_memory_stats()
        steps[k].run(w.model, opt, w.batch)
        torch.cuda.synchronize()
        print(f"   {k:12s} host {statistics.median(h):7.2f}  wall {statistics.median(wall):7.2f} "
              f"(min {min(wall):.2f})  peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")


def main():
    say(torch.__version__, torch.cuda.get_device_name(), "python", sys.version.split()[0])
    for fn in (primitives, runtime_calls, sac_calls, profiler_costs, pools, roundtrip, model_steps_impl):
        section(fn)
    say("done")


if __name__ == "__main__":
    main()
