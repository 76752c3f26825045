"""``per-op``: torchtitan's op-level selective checkpointing, priced as the selective-checkpoint policy it is
(replay mode ``sac``)."""

from __future__ import annotations

from acstudio.jobs import CancelToken
from acstudio.plan.baselines import per_op
from acstudio.plan.model import Plan
from acstudio.plan.schedule import PlanContext
from acstudio.plan.solvers.fixed import fixed_curve, fixed_plan
from acstudio.plan.solvers.registry import solver

NAME = "per-op"


@solver(NAME, "torchtitan's op-level selective checkpointing (saves attention and every second matmul per block)",
        fixed_set=per_op, curve=fixed_curve(NAME), real_modes=("sac",), policy=True)
def solve_per_op(ctx: PlanContext, budget: int, *, cancel: CancelToken | None = None) -> Plan:
    return fixed_plan(ctx, NAME, budget)
