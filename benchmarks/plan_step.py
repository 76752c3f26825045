"""Measure one solver's plan on the device: the profile's own graph rewritten by it, peak and step time.

Usage: python benchmarks/plan_step.py PROFILE --budget B [--solver NAME] [--device cuda] [--warmup N] [--iters N]

``acstudio bench`` plans with ``auto``; this runs any registered solver's plan (e.g. ``milp-bound``) the way
``bench``'s ``rewritten@B`` does, with its measurement functions (warm-up, ``max_memory_allocated`` over one
full step, median step time): the workload is rebuilt from the profile's record and its stored graph is rewritten,
so node ids match the plan. Run one plan per process, like ``bench``; prints one JSON line.
"""

from __future__ import annotations

import argparse
import json

import torch

from acstudio.bench.measure import resident_tensors, step_peak_bytes, summarize_ms, time_steps
from acstudio.bench.steps import load
from acstudio.capture.serialize import deserialize_step
from acstudio.capture.tracer import prepare_optimizer
from acstudio.plan.solvers import plan
from acstudio.profile.model import Profile
from acstudio.rewrite.rewriter import rewrite
from acstudio.units import parse_budget
from acstudio.workload.spec import WorkloadSpec

MiB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile")
    parser.add_argument("--budget", required=True, help="bytes with a unit or a percentage (e.g. 4603MiB, 50%%)")
    parser.add_argument("--solver", default="auto")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=8)
    args = parser.parse_args()

    profile = Profile.load(args.profile)
    budget = parse_budget(args.budget, profile.peak_bytes)
    chosen = plan(profile, budget, args.solver)
    dev = torch.device(args.device)
    spec = WorkloadSpec.from_dict(profile.workload)
    step = rewrite(deserialize_step(profile.graph, device=str(dev)), profile, chosen)
    w, opt = load(spec, dev)
    prepare_optimizer(w.model, opt)  # the optimizer as the traced step expects it

    def run() -> torch.Tensor:
        return step.run(w.model, opt, w.batch)

    torch.manual_seed(spec.seed + 1)
    for _ in range(args.warmup):
        run()
    peak, _, _ = step_peak_bytes(run, dev, lambda: resident_tensors(w.model, opt, w.batch))
    times = time_steps(run, args.iters, dev)
    print(json.dumps({"profile": args.profile, "solver": args.solver, "budget_mib": budget / MiB,
                      "replay_mode": chosen.replay_mode, "recomputed": len(chosen.recomputed),
                      "predicted_peak_mib": chosen.predicted_peak_bytes / MiB,
                      "predicted_extra_ms": chosen.predicted_extra_ms, "peak_mib": peak / MiB,
                      **summarize_ms(times), "stop_reason": chosen.stop_reason}))


if __name__ == "__main__":
    main()
