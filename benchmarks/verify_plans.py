"""Verify μ-TWO plans at several budgets on one device: equality with the captured step and measured vs predicted peak.

Usage: python benchmarks/verify_plans.py OUT.json PROFILE [PROFILE ...] [--device cuda] [--budgets 90%,75%,...]
For each profile and budget the planner's plan (`best_plan_for_budget`, as `acstudio plan` and `bench` pick it)
goes through `acstudio.rewrite.verify.verify`: the original and the rewritten step from identical state, loss,
gradients, parameters, buffers and optimizer state compared, and on CUDA the rewritten step's
`max_memory_allocated` beside the plan's predicted peak (the target: within 3% on every plan). The budget
`floor` is the lowest peak μ-TWO reaches. Results are written after every plan, so an interrupted run keeps them.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from acstudio.fileio import write_text
from acstudio.plan.solvers.mutwo import mutwo_trajectory
from acstudio.profile.model import Profile
from acstudio.rewrite.verify import verify
from acstudio.units import parse_budget

MiB = 2**20
DEFAULT_BUDGETS = "90%,75%,60%,50%,40%,floor"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="JSON file to write")
    parser.add_argument("profiles", nargs="+")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--budgets", default=DEFAULT_BUDGETS, help=f"comma-separated (default {DEFAULT_BUDGETS})")
    args = parser.parse_args(argv)
    rows = []
    for path in args.profiles:
        profile = Profile.load(path)
        trajectory = mutwo_trajectory(profile)
        for budget in args.budgets.split(","):
            nbytes = min(s.predicted_peak_bytes for s in trajectory.steps) if budget == "floor" else \
                parse_budget(budget, profile.peak_bytes)
            plan = trajectory.best_plan_for_budget(nbytes)
            t0 = time.perf_counter()
            result = verify(profile, plan, args.device)
            measured = result.measured_peak_bytes
            row = {"profile": Path(path).name, "budget": budget, "budget_mib": nbytes / MiB,
                   "replay_mode": plan.replay_mode, "recomputed": result.recomputed,
                   "predicted_extra_ms": plan.predicted_extra_ms, "passed": result.passed, "exact": result.exact,
                   "predicted_peak_mib": plan.predicted_peak_bytes / MiB,
                   "accounted_peak_mib": result.accounted_peak_bytes / MiB,
                   "measured_peak_mib": None if measured is None else measured / MiB,
                   "measured_baseline_peak_mib": None if measured is None else
                   result.measured_baseline_peak_bytes / MiB,
                   "peak_error_pct": None if measured is None else
                   100.0 * (measured / plan.predicted_peak_bytes - 1.0),
                   "max_abs": {c.kind: c.max_abs for c in result.comparisons}, "wall_s": time.perf_counter() - t0}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "max_abs"}), flush=True)
            write_text(args.out, json.dumps({"device": args.device, "rows": rows}, indent=1))
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
