"""How far μ-TWO and ``auto`` are from optimal, and how fast the programs answer, at budgets along μ-TWO's curve.

Usage: python benchmarks/milp_gap.py PROFILE [PROFILE ...] [--points N] [--time-limit S]

Per budget (the ``--points`` budgets ``sweep(..., milp_points=N)`` takes): the exact program in μ-TWO's replay
mode (``milp``: its time, whether it proved optimality, its lower bound), the bound for every replay mode
(the shared-mode program's time and bound; ``both lower``: the smaller bound, below every plan that fits in
either mode), the extra time of μ-TWO and ``auto``, and ``milp-bound``'s plan (``best``: the fastest of auto's,
milp's and the shared program's own set). ``mutwo gap`` is μ-TWO's distance from the optimum of its mode (exact
when ``milp`` is optimal, else an upper bound); ``auto/milp`` compares ``auto`` (best of both modes) with that
optimum; ``auto gap <=`` and ``best gap <=`` bound the distance from the best plan of either mode.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import datetime, timezone

import numpy as np

from acstudio.plan.schedule import PlanContext
from acstudio.plan.solvers.auto import solve_auto
from acstudio.plan.solvers.milp import exact_milp, shared_bound
from acstudio.plan.solvers.milp_bound import bounded_plan
from acstudio.plan.solvers.mutwo import trajectory
from acstudio.profile.model import Profile
from acstudio.units import format_bytes


def timed(fn):
    """Result and CPU seconds of this process (robust to a machine shared with other jobs)."""
    c0 = time.process_time()
    out = fn()
    return out, time.process_time() - c0


def gap(extra_ms: float, lower_ms: float) -> str:
    return f"{extra_ms / lower_ms - 1:+.1%}" if lower_ms > 1e-9 else "0" if extra_ms <= 1e-9 else "inf"


def report(path: str, points: int, time_limit_s: float) -> None:
    profile = Profile.load(path)
    ctx = PlanContext(profile)
    traj = trajectory(ctx)
    peaks = sorted({s.predicted_peak_bytes for s in traj.steps[1:]}, reverse=True)
    budgets = dict.fromkeys(peaks[round(i)] for i in np.linspace(0, len(peaks) - 1, min(points, len(peaks))))
    print(f"\n{profile.label}: {len(profile.nodes)} nodes, {len(ctx.rg.candidates)} candidates, baseline "
          f"{format_bytes(ctx.sim.baseline_peak)}, floor {format_bytes(ctx.floor_bytes)}")
    print(f"{'budget':>12} | {'milp s':>6} {'milp ms':>9} {'lower ms':>9} {'status':<9} | {'shared s':>8} "
          f"{'lower ms':>9} {'both lower':>10} | {'mutwo ms':>9} {'mutwo gap':>9} | {'auto ms':>8} {'auto/milp':>9} "
          f"{'auto gap <=':>11} | {'best ms':>8} {'best gap <=':>11}")
    for budget in budgets:
        exact, t_exact = timed(lambda b=budget: exact_milp(ctx, b, time_limit_s))
        shared, t_shared = timed(lambda b=budget: shared_bound(ctx, b, time_limit_s=time_limit_s))
        lower_any = min(exact.lower_bound_ms, shared.lower_bound_ms)
        auto = solve_auto(ctx, budget)
        best, _ = bounded_plan(ctx, budget, auto=auto, exact=exact)  # the shared program is solved again here
        mu = traj.plan_for_budget(budget).predicted_extra_ms
        status = "optimal" if exact.optimal else "stopped" if exact.chosen is not None else "none"
        print(f"{format_bytes(budget):>12} | {t_exact:6.1f} {exact.extra_ms:9.2f} {exact.lower_bound_ms:9.2f} "
              f"{status:<9} | {t_shared:8.1f} {shared.lower_bound_ms:9.2f} {lower_any:10.2f} | "
              f"{mu:9.2f} {gap(mu, exact.lower_bound_ms):>9} | "
              f"{auto.predicted_extra_ms:8.2f} {gap(auto.predicted_extra_ms, exact.extra_ms):>9} "
              f"{gap(auto.predicted_extra_ms, lower_any):>11} | {best.predicted_extra_ms:8.2f} "
              f"{gap(best.predicted_extra_ms, lower_any):>11}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profiles", nargs="+")
    parser.add_argument("--points", type=int, default=5, help="budgets per profile (default 5)")
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds per program (default 60)")
    args = parser.parse_args()
    print(f"# {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, load average {os.getloadavg()[0]:.1f} "
          f"({os.cpu_count()} CPUs); times are CPU seconds of this process")
    print(f"# python {' '.join(sys.argv)}")
    for path in args.profiles:
        report(path, args.points, args.time_limit)


if __name__ == "__main__":
    main()
