"""What the fixed baselines share: a rule's recompute set (:mod:`acstudio.plan.baselines`), priced in each
replay mode its real counterpart may run in, the faster one counting."""

from __future__ import annotations

from acstudio.jobs import CancelToken, ProgressFn, check
from acstudio.plan.model import Plan
from acstudio.plan.schedule import PlanContext
from acstudio.plan.solvers.mutwo import EXHAUSTED
from acstudio.plan.solvers.registry import SOLVERS, CurveFn, CurvePoint, best_of
from acstudio.units import format_bytes


def fixed_plans(ctx: PlanContext, name: str, budget: int) -> list[Plan]:
    """Baseline ``name``'s recompute set priced in each mode its real counterpart may run in."""
    baseline = SOLVERS[name]
    chosen = baseline.fixed_set(ctx)
    plans = [ctx.plan_for_set(name, budget, chosen, mode=mode) for mode in baseline.real_modes]
    for p in plans:
        if not p.feasible:
            p.stop_reason = (EXHAUSTED if baseline.sets_floor else
                             f"budget not met: {name} reaches {format_bytes(p.predicted_peak_bytes)}")
    return plans


def fixed_plan(ctx: PlanContext, name: str, budget: int) -> Plan:
    """Baseline ``name``'s plan: its set in the fastest of its modes that fits (or the lowest peak)."""
    return best_of(fixed_plans(ctx, name, budget))


def fixed_curve(name: str) -> CurveFn:
    """Baseline ``name``'s sweep points: its set priced in both chain modes and in each mode its real counterpart
    runs in (one point if it recomputes nothing); auto's envelope counts only the counterpart's modes."""
    def curve(ctx: PlanContext, progress: ProgressFn | None = None, cancel: CancelToken | None = None
              ) -> list[CurvePoint]:
        check(cancel)
        baseline = SOLVERS[name]
        real, chosen = baseline.real_modes, baseline.fixed_set(ctx)
        points = []
        for mode in dict.fromkeys(("again", "shared", *real)):
            p = ctx.plan_for_set(name, 0, chosen, mode=mode)
            points.append(CurvePoint(p.predicted_peak_bytes, p.predicted_extra_ms, len(p.recomputed), mode,
                                     in_auto=mode in real,
                                     note="how its real counterpart runs" if mode in real and len(real) == 1 else ""))
            if not p.recomputed:
                break  # keep-all: the same in every mode
        return points
    return curve
