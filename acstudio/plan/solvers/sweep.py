"""The Pareto table: every solver's operating points under the same simulator."""

from __future__ import annotations

from collections.abc import Collection

import numpy as np
import pandas as pd

from acstudio.jobs import CancelToken, ProgressFn, check
from acstudio.plan.schedule import PlanContext
from acstudio.plan.solvers import milp
from acstudio.plan.solvers.auto import NAME as AUTO
from acstudio.plan.solvers.auto import auto_plan
from acstudio.plan.solvers.blocks import NAME as BLOCKS
from acstudio.plan.solvers.blocks import block_search
from acstudio.plan.solvers.milp_bound import NAME as MILP_BOUND
from acstudio.plan.solvers.milp_bound import bounded_plan
from acstudio.plan.solvers.mutwo import NAME as MUTWO
from acstudio.plan.solvers.mutwo import Trajectory, trajectory
from acstudio.plan.solvers.registry import SOLVERS, get_solver
from acstudio.profile.model import Profile
from acstudio.simulate.simulator import Simulator


def sweep(profile: Profile, solvers: Collection[str] | None = None, simulator: Simulator | None = None,
          milp_points: int = 6, progress: ProgressFn | None = None, cancel: CancelToken | None = None,
          ctx: PlanContext | None = None, milp_time_s: float = milp.SWEEP_MILP_TIME_LIMIT_S) -> pd.DataFrame:
    """Pareto table of every solver under the same simulator: one row per (solver, operating point).

    μ-TWO contributes every trajectory step that lowers the peak (replaying chains again), the block search
    states spread along its sequence (shared chains), the fixed baselines
    one row per replay mode (their budget is their own peak; ``note`` marks the mode their real counterpart runs
    in), ``auto`` the lower envelope of all those points, and at up to ``milp_points`` budgets taken from the μ-TWO
    curve: ``milp``, the exact optimum in μ-TWO's mode (or, past its time limit, μ-TWO's plan and a lower bound),
    with μ-TWO's optimality gap ``gap = mutwo_extra_ms / lower_bound_ms - 1`` (exact where ``optimal``), and
    ``milp-bound``, a lower bound for every replay mode, with ``auto``'s gap at most ``gap_bound``.
    """
    ctx = ctx or PlanContext(profile, simulator)
    solvers = set(SOLVERS if solvers is None else solvers)
    programs = [name for name in solvers if get_solver(name).exact]
    rows = []

    def row(solver: str, peak: int, extra_ms: float, n: int, mode: str, **extra) -> None:
        rows.append({"solver": solver, "budget_bytes": peak, "peak_bytes": peak, "extra_ms": extra_ms,
                     "n_recomputed": n, "replay_mode": mode, **extra})

    traj = trajectory(ctx, progress, cancel) if {MUTWO, AUTO} & solvers or programs else None
    points = []  # (peak, extra_ms, n, mode, solver) of everything auto knows
    best = None
    for j, step in enumerate(traj.steps if traj else ()):
        if best is None or step.simulated_peak_bytes < best:
            best = step.simulated_peak_bytes
            points.append((best, step.extra_ms, j, "again", MUTWO))
    for baseline in SOLVERS.values():
        if baseline.fixed_set is None or not (baseline.name in solvers or (AUTO in solvers and baseline.runs_in_auto)):
            continue
        check(cancel)
        real = baseline.real_modes
        for mode in dict.fromkeys(("again", "shared", *real)):
            p = ctx.plan_for_set(baseline.name, 0, baseline.fixed_set(ctx), mode=mode)
            if baseline.name in solvers:
                row(baseline.name, p.predicted_peak_bytes, p.predicted_extra_ms, len(p.recomputed), mode,
                    note="how its real counterpart runs" if mode in real and len(real) == 1 else "")
            if mode in real and baseline.runs_in_auto:  # auto is their envelope too
                points.append((p.predicted_peak_bytes, p.predicted_extra_ms, len(p.recomputed), mode, baseline.name))
            if not p.recomputed:
                break  # keep-all: the same in every mode
    if {BLOCKS, AUTO} & solvers:
        for pk, ms, n in block_search(ctx, cancel).curve():
            points.append((pk, ms, n, "shared", BLOCKS))
            if BLOCKS in solvers:
                row(BLOCKS, pk, ms, n, "shared")
    if MUTWO in solvers:
        rows[:0] = [{"solver": MUTWO, "budget_bytes": pk, "peak_bytes": pk, "extra_ms": ms, "n_recomputed": n,
                     "replay_mode": mode} for pk, ms, n, mode, src in points if src == MUTWO]
    if AUTO in solvers:
        for pk, ms, n, mode, src in pareto_front(points):
            row(AUTO, pk, ms, n, mode, note=f"{src}'s plan")
    if programs:
        rows.extend(_program_rows(ctx, traj, milp_points, solvers, milp_time_s, cancel))
    return pd.DataFrame(rows)


def pareto_front(points: list[tuple]) -> list[tuple]:
    """The points (peak first, extra time second) that no other point beats in both, by increasing peak."""
    front = []
    for p in sorted(points, key=lambda p: (p[0], p[1])):
        if not front or p[1] < front[-1][1]:
            front.append(p)
    return front


def _program_rows(ctx: PlanContext, traj: Trajectory, milp_points: int, solvers: Collection[str], time_s: float,
                  cancel: CancelToken | None) -> list[dict]:
    """At ``milp_points`` budgets of μ-TWO's curve: the exact program's answer (``milp``: μ-TWO's gap against it)
    and the bound of both modes (``milp-bound``: ``auto``'s gap is at most ``gap_bound``), each program stopped
    after ``time_s``. Past ``PROGRAM_MAX_CANDIDATES`` a row says how to get them instead."""
    n = len(ctx.rg.candidates)
    if n > milp.PROGRAM_MAX_CANDIDATES:
        return [{"solver": s, "note": f"skipped: {n} candidates (sweeps run the programs up to "
                                      f"{milp.PROGRAM_MAX_CANDIDATES}); plan one budget with --solver {s}"}
                for s in (milp.NAME, MILP_BOUND) if s in solvers]
    rows = []
    peaks = sorted({s.predicted_peak_bytes for s in traj.steps[1:]}, reverse=True)
    picks = [peaks[round(i)] for i in np.linspace(0, len(peaks) - 1, min(milp_points, len(peaks)))]
    for budget in dict.fromkeys(picks):
        check(cancel)
        shared = milp.shared_bound(ctx, budget, time_limit_s=time_s, cancel=cancel)  # auto's and milp-bound's
        auto = auto_plan(ctx, budget, cancel, program=shared)
        base = {"budget_bytes": budget, "auto_extra_ms": auto.predicted_extra_ms}
        exact = milp.exact_milp(ctx, budget, time_s, cancel)
        if milp.NAME in solvers:
            p = milp.milp_plan(ctx, budget, exact)
            mu = traj.plan_for_budget(budget)
            rows.append({**base, "solver": milp.NAME, "peak_bytes": p.predicted_peak_bytes,
                         "extra_ms": p.predicted_extra_ms, "n_recomputed": len(p.recomputed), "replay_mode": "again",
                         "feasible": p.feasible, "note": p.stop_reason, "optimal": exact.optimal,
                         "lower_bound_ms": exact.lower_bound_ms, "mutwo_extra_ms": mu.predicted_extra_ms,
                         "gap": _gap(mu.predicted_extra_ms, exact.lower_bound_ms)})
        if MILP_BOUND in solvers:
            p, lower = bounded_plan(ctx, budget, cancel, time_s, auto, exact, shared)
            rows.append({**base, "solver": MILP_BOUND, "peak_bytes": p.predicted_peak_bytes,
                         "extra_ms": p.predicted_extra_ms, "n_recomputed": len(p.recomputed),
                         "replay_mode": p.replay_mode, "feasible": p.feasible, "note": p.stop_reason,
                         "lower_bound_ms": lower, "gap_bound": _gap(auto.predicted_extra_ms, lower)})
    return rows


def _gap(extra_ms: float, lower_ms: float) -> float:
    """``extra / lower - 1``: how far above a proven lower bound (0 when both are 0)."""
    return extra_ms / lower_ms - 1 if lower_ms > 1e-12 else (0.0 if extra_ms <= 1e-12 else float("inf"))
