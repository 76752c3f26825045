"""Where a compiled step's GPU time goes: the CUDA kernels of a few steps of a compiled model, grouped by kind.

    PYTHONPATH=. python3 benchmarks/compiled_kernels.py resnet152 -b 64 [--per-block | --plan PLAN_DIR]

Prints per step: the step time (CUDA events, no profiler), the number of kernels, their total time, and the time
of each kind (convolution, matmul, Triton-fused, copy, other), with the ten longest kernels.
It explains a bench row, it does not replace it.
"""

import argparse
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

import acstudio
from acstudio.bench.steps import checkpoint_forward, eager_step, find_blocks
from acstudio.workload import WorkloadSpec, build_workload

KINDS = (("convolution", ("conv", "cudnn", "implicit_gemm", "wgrad", "dgrad", "xmma")), ("matmul", ("gemm", "cutlass")),
         ("copy", ("copy", "memcpy", "memset", "fill")), ("triton", ("triton",)))


def kind(name: str) -> str:
    low = name.lower()
    return next((k for k, keys in KINDS if any(key in low for key in keys)), "other")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("-b", "--batch-size", type=int, default=64)
    ap.add_argument("--optimizer", default="adam")
    ap.add_argument("--per-block", action="store_true")
    ap.add_argument("--plan")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    w = build_workload(WorkloadSpec(model=args.model, batch_size=args.batch_size, optimizer=args.optimizer))
    if args.per_block:
        for block in find_blocks(w):
            checkpoint_forward(block)
    if args.plan:
        acstudio.apply_plan(w.model, args.plan)
    w.to("cuda")
    model = torch.compile(w.model)
    step = eager_step(w.spec, torch.device("cuda"), model, w.make_optimizer(), w.batch, w.loss_fn)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.steps):
        step()
    end.record()
    torch.cuda.synchronize()
    wall_ms = start.elapsed_time(end) / args.steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per_kind, count = Counter(), Counter()
    by_name = Counter()
    for e in events:
        per_kind[kind(e.name)] += e.device_time_total / 1000 / args.steps
        count[kind(e.name)] += 1 / args.steps
        by_name[e.name[:90]] += e.device_time_total / 1000 / args.steps
    label = "per-block" if args.per_block else args.plan or "no checkpointing"
    kernels = len(events) / args.steps
    print(f"{label}: {wall_ms:.1f} ms per step; {kernels:.0f} kernels, {sum(per_kind.values()):.1f} ms in kernels")
    for k, ms in per_kind.most_common():
        print(f"  {k:12s} {ms:7.2f} ms  {count[k]:6.0f} kernels")
    for name, ms in by_name.most_common(10):
        print(f"    {ms:6.2f} ms  {name}")


if __name__ == "__main__":
    main()
