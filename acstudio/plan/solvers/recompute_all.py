"""``recompute-all``: every candidate recomputed, the floor. It has no real counterpart, so it is priced in
both chain modes and the faster one counts."""

from __future__ import annotations

from acstudio.jobs import CancelToken
from acstudio.plan.baselines import recompute_all
from acstudio.plan.model import Plan
from acstudio.plan.schedule import PlanContext
from acstudio.plan.solvers.fixed import fixed_curve, fixed_plan
from acstudio.plan.solvers.registry import solver

NAME = "recompute-all"


@solver(NAME, "every candidate recomputed (the floor)", fixed_set=recompute_all, curve=fixed_curve(NAME),
        real_modes=("again", "shared"), sets_floor=True, auto_order=4)
def solve_recompute_all(ctx: PlanContext, budget: int, *, cancel: CancelToken | None = None) -> Plan:
    return fixed_plan(ctx, NAME, budget)
