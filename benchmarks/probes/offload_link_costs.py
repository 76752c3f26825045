"""The fixed costs of offloading one activation, beside its bytes over the link, and how far the host runs ahead
of the GPU on two sample profiles' captured steps.

The simulator prices an offload copy by bytes / GB/s. Two other costs can decide a plan: each copy's fixed
latency on its stream, and the host time of issuing one offloaded activation's calls (copy out, release, copy
back, wait), which lengthens the step wherever the host, not the GPU, sets its pace. Three parts, each failing on
its own with one line:

1. the profiler's ``_copy_costs_us`` (the recorded output ran a stand-alone copy of it, before it measured one
   small op too): both for small (4 KiB) pinned copies, issued with the torch calls the rewritten step makes and
   queued behind a GPU spin: (the slower direction's per-copy latency in µs, the host µs to issue one offload both
   ways, the host µs to issue one small op);
2. the real ``OffloadRuntime``'s four calls on cuda:0 with 4 KiB and 2 MiB slots, host µs per call;
3. for the H200 sample profiles' captured steps (ResNet-152 bs64, BERT bs16): the host issue time (``run()``
   returned) against the wall time, median of 8 after 3 warm-up steps; the difference is how far the host leads.

Run: cd <repo> && PYTHONPATH=. python3 benchmarks/probes/offload_link_costs.py > results/probes/offload_link_costs.txt
Needs one CUDA GPU (under a minute).
"""
import statistics
import time

import torch
from _timing import host_and_wall_ms, runtime_call_rounds

from acstudio.profiler import _copy_costs_us

dev = torch.device("cuda", 0)
T0 = time.perf_counter()


def say(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def runtime_call_costs(size: int, n: int = 200) -> None:
    """Host time of the runtime's four calls for ``n`` slots of ``size`` bytes, issued while the GPU spins (the
    second of two repeats)."""
    from acstudio.rewrite.offload import OffloadRuntime
    cost = runtime_call_rounds(OffloadRuntime, size, n, dev, 2)[-1]
    say(f"OffloadRuntime, {size} B slots: " + "  ".join(f"{k} {v * 1e6 / n:.1f}us" for k, v in cost.items()),
        f"| per offload {sum(cost.values()) * 1e6 / n:.1f}us")


def runtime_calls():
    for size in (4096, 2 * 2**20):
        runtime_call_costs(size)


def captured_lead():
    from acstudio.capture.serialize import deserialize_step
    from acstudio.capture.step import prepare_optimizer
    from acstudio.profile.model import Profile
    from acstudio.workload import WorkloadSpec, build_workload
    for name in ("h200_resnet152_bs64_adam", "h200_bert_bs16_adam"):
        prof = Profile.load(f"sample_profiles/{name}.json.gz")
        spec = WorkloadSpec.from_dict(prof.workload)
        w = build_workload(spec).to(dev)
        opt = w.make_optimizer()
        prepare_optimizer(w.model, opt)
        step = deserialize_step(prof.graph, device="cuda")
        for _ in range(3):
            step.run(w.model, opt, w.batch)
        host, total = host_and_wall_ms(lambda step=step, w=w, opt=opt: step.run(w.model, opt, w.batch), 8)
        h, tt = statistics.median(host), statistics.median(total)
        say(f"{name}: {len(prof.nodes)} nodes, wall {tt:.2f} ms, host issue {h:.2f} ms, lead {tt - h:.2f} ms "
            f"(profile iteration_ms {prof.iteration_ms:.2f})")
        del w, opt, step
        torch.cuda.empty_cache()


def main():
    say(torch.__version__, torch.cuda.get_device_name())
    costs = "profiler _copy_costs_us (latency_us, offload_issue_us, op_issue_us):"
    for f in (lambda: say(costs, _copy_costs_us(dev, 4096, 64)), runtime_calls, captured_lead):
        try:
            f()
        except Exception as exc:  # a probe: the other parts still run
            say("FAILED:", type(exc).__name__, exc)
    say("done")


if __name__ == "__main__":
    main()
