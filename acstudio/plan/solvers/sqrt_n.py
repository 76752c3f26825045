"""``sqrt-n``: Chen et al.'s √n segments, priced as checkpointed segments run (shared chains)."""

from __future__ import annotations

from acstudio.jobs import CancelToken
from acstudio.plan.baselines import sqrt_n
from acstudio.plan.model import Plan
from acstudio.plan.schedule import PlanContext
from acstudio.plan.solvers.fixed import fixed_curve, fixed_plan
from acstudio.plan.solvers.registry import solver

NAME = "sqrt-n"


@solver(NAME, "Chen et al.'s √n segments", fixed_set=sqrt_n, curve=fixed_curve(NAME), real_modes=("shared",),
        auto_order=3)
def solve_sqrt_n(ctx: PlanContext, budget: int, *, cancel: CancelToken | None = None) -> Plan:
    return fixed_plan(ctx, NAME, budget)
