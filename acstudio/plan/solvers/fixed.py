"""What the fixed baselines share: a rule's recompute set (:mod:`acstudio.plan.baselines`), priced in each
replay mode its real counterpart may run in, the faster one counting."""

from __future__ import annotations

from acstudio.plan.model import Plan
from acstudio.plan.schedule import PlanContext
from acstudio.plan.solvers.mutwo import EXHAUSTED
from acstudio.plan.solvers.registry import SOLVERS, best_of
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
