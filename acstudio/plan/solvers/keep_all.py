"""``keep-all``: no activation checkpointing (the top of every chart)."""

from __future__ import annotations

from acstudio.jobs import CancelToken
from acstudio.plan.baselines import keep_all
from acstudio.plan.model import Plan
from acstudio.plan.schedule import PlanContext
from acstudio.plan.solvers.fixed import fixed_curve, fixed_plan
from acstudio.plan.solvers.registry import solver

NAME = "keep-all"


@solver(NAME, "no activation checkpointing", fixed_set=keep_all, curve=fixed_curve(NAME), real_modes=("again",),
        auto_order=5)
def solve_keep_all(ctx: PlanContext, budget: int, *, cancel: CancelToken | None = None) -> Plan:
    return fixed_plan(ctx, NAME, budget)
