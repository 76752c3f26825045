"""How fast the planner answers: simulator setup, the full μ-TWO trajectory, budget lookups, and ``auto``.

Usage: python benchmarks/planner_speed.py PROFILE [--lookups N]

Targets (2-core CPU): ResNet-152 bs64 trajectory <= 0.5 s, ``plan_for_budget`` <= 5 ms; BERT bs16 the whole
``auto`` curve (the Pareto front of every solver) <= 1 s.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from acstudio.plan.schedule import PlanContext
from acstudio.plan.solvers import plan, sweep
from acstudio.plan.solvers.mutwo import mutwo_trajectory
from acstudio.profile.model import Profile
from acstudio.simulate.simulator import Simulator
from acstudio.units import format_bytes


def timed(fn):
    """Result, wall seconds and CPU seconds of this process (the CPU figure is robust to a busy machine)."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile")
    parser.add_argument("--lookups", type=int, default=200, help="budgets to look up (default 200)")
    args = parser.parse_args()

    profile = Profile.load(args.profile)
    _, t_hash, _ = timed(lambda: (profile.fingerprint, profile.node_index))  # once per Profile object
    sim, t_sim, _ = timed(lambda: Simulator(profile))
    _, t_floor, _ = timed(lambda: sim.floor_bytes)
    print(f"{profile.label}: {len(profile.nodes)} nodes, {len(profile.activations)} activations, "
          f"{len(sim.replay.candidates)} candidates; profile fingerprint {t_hash * 1e3:.1f} ms")
    print(f"simulator setup      {t_sim * 1e3:8.1f} ms   (+ floor on its own {t_floor * 1e3:.1f} ms: "
          f"{format_bytes(sim.floor_bytes)}, baseline {format_bytes(sim.baseline_peak)})")

    # Each run on a fresh simulator: the trajectory also settles the floor every plan reports.
    runs = []
    for _ in range(3):
        fresh = Simulator(profile)
        runs.append(timed(lambda fresh=fresh: mutwo_trajectory(profile, fresh)))
    traj = runs[-1][0]
    t_traj = statistics.median(t for _, t, _ in runs)
    c_traj = statistics.median(c for _, _, c in runs)
    last = traj.steps[-1]
    print(f"mu-TWO trajectory    {t_traj * 1e3:8.1f} ms   (median of 3, CPU {c_traj * 1e3:.1f} ms; "
          f"{len(traj.steps) - 1} picks, down to {format_bytes(last.predicted_peak_bytes)}, extra "
          f"{last.extra_ms:.1f} ms; {traj.stop_reason})")

    lo, hi = last.predicted_peak_bytes, sim.baseline_peak
    budgets = np.linspace(lo * 0.95, hi * 1.02, args.lookups).astype(np.int64)
    np.random.default_rng(0).shuffle(budgets)  # slider jumps, not only neighbouring steps
    first = [timed(lambda b=b: traj.plan_for_budget(int(b)))[1] for b in budgets]
    again = [timed(lambda b=b: traj.plan_for_budget(int(b)))[1] for b in budgets]
    print(f"plan_for_budget      {statistics.median(first) * 1e3:8.2f} ms   median over {len(budgets)} budgets "
          f"(max {max(first) * 1e3:.2f} ms; repeated: median {statistics.median(again) * 1e3:.2f} ms, "
          f"max {max(again) * 1e3:.2f} ms)")
    _, t_sim_full, _ = timed(lambda: sim.simulate(traj.plan_for_budget((lo + hi) // 2).recomputed))
    print(f"simulate (timeline)  {t_sim_full * 1e3:8.1f} ms   for the mid-budget plan")

    front, t_front, c_front = timed(lambda: sweep(profile, ["auto"]))
    print(f"auto curve           {t_front * 1e3:8.1f} ms   (CPU {c_front * 1e3:.1f} ms; {len(front)} points on a fresh "
          "context: trajectory, block search, baselines)")
    ctx = PlanContext(profile)
    sweep(profile, ["auto"], ctx=ctx)
    auto = [timed(lambda b=b: plan(profile, int(b), ctx=ctx))[1] for b in budgets[:8]]
    print(f"auto plan            {statistics.median(auto) * 1e3:8.1f} ms   median over 8 budgets (what the slider "
          "refines to in the background)")


if __name__ == "__main__":
    main()
