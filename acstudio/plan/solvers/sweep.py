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
from acstudio.plan.solvers.milp_bound import NAME as MILP_BOUND
from acstudio.plan.solvers.milp_bound import bounded_plan
from acstudio.plan.solvers.mutwo import Trajectory, pareto_front, trajectory
from acstudio.plan.solvers.registry import SOLVERS, get_solver
from acstudio.profile.model import Profile
from acstudio.simulate.simulator import Simulator


def sweep(profile: Profile, solvers: Collection[str] | None = None, simulator: Simulator | None = None,
          milp_points: int = 6, progress: ProgressFn | None = None, cancel: CancelToken | None = None,
          ctx: PlanContext | None = None, milp_time_s: float = milp.SWEEP_MILP_TIME_LIMIT_S) -> pd.DataFrame:
    """Pareto table of every solver under the same simulator: one row per (solver, operating point).

    Every solver with a :attr:`~acstudio.plan.solvers.registry.Solver.curve` contributes its points (μ-TWO every
    trajectory step that lowers the peak, the block search states spread along its sequence, a fixed baseline one
    row per replay mode: their budget is their own peak, ``note`` marks the mode their real counterpart runs in),
    ``auto`` the lower envelope of the points of every solver it asks, and the exact programs theirs at up to
    ``milp_points`` budgets taken from the μ-TWO curve: ``milp``, the exact optimum in μ-TWO's mode (or, past its
    time limit, μ-TWO's plan and a lower bound), with μ-TWO's optimality gap
    ``gap = mutwo_extra_ms / lower_bound_ms - 1`` (exact where ``optimal``), and ``milp-bound``, a lower bound for
    every replay mode, with ``auto``'s gap at most ``gap_bound``.
    """
    ctx = ctx or PlanContext(profile, simulator)
    solvers = set(SOLVERS if solvers is None else solvers)
    programs = [name for name in solvers if get_solver(name).exact]
    rows = []
    envelope = []  # (peak, extra_ms, n, mode, solver) of every point auto knows
    for s in SOLVERS.values():
        if s.curve is None or not (s.name in solvers or (AUTO in solvers and s.runs_in_auto)):
            continue
        check(cancel)
        points = s.curve(ctx, progress, cancel)
        if s.name in solvers:
            rows += [{"solver": s.name, "budget_bytes": p.peak_bytes, "peak_bytes": p.peak_bytes,
                      "extra_ms": p.extra_ms, "n_recomputed": p.n_recomputed, "replay_mode": p.replay_mode,
                      "note": p.note} for p in points]
        if s.runs_in_auto:
            envelope += [(p.peak_bytes, p.extra_ms, p.n_recomputed, p.replay_mode, s.name) for p in points if p.in_auto]
    if AUTO in solvers:
        rows += [{"solver": AUTO, "budget_bytes": pk, "peak_bytes": pk, "extra_ms": ms, "n_recomputed": n,
                  "replay_mode": mode, "note": f"{src}'s plan"} for pk, ms, n, mode, src in pareto_front(envelope)]
    if programs:
        rows.extend(_program_rows(ctx, trajectory(ctx, progress, cancel), milp_points, solvers, milp_time_s, cancel))
    return pd.DataFrame(rows)


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
