"""``per-module``: what ``torch.utils.checkpoint`` around every repeated block does, priced as it runs (each
block's forward replayed once: shared chains)."""

from __future__ import annotations

from acstudio.jobs import CancelToken
from acstudio.plan.baselines import per_module
from acstudio.plan.model import Plan
from acstudio.plan.schedule import PlanContext
from acstudio.plan.solvers.fixed import fixed_curve, fixed_plan
from acstudio.plan.solvers.registry import solver

NAME = "per-module"


@solver(NAME, "torch.utils.checkpoint around every repeated block (HF gradient checkpointing)", fixed_set=per_module,
        curve=fixed_curve(NAME), real_modes=("shared",), auto_order=2)
def solve_per_module(ctx: PlanContext, budget: int, *, cancel: CancelToken | None = None) -> Plan:
    return fixed_plan(ctx, NAME, budget)
