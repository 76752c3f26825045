"""Every planner, one file each, in one registry, and the entry point that the CLI, the app and bench call.

A solver is ``solve_<name>(ctx, budget, *, cancel) -> Plan`` (Checkmate's style) in its own module here,
registered with its traits (:mod:`~acstudio.plan.solvers.registry`); :func:`plan` looks it up. ``ctx``
(:class:`~acstudio.plan.schedule.PlanContext`) holds the profile's simulator and caches what several solvers
share (μ-TWO's trajectory, the block search).

``plan(..., mode=M)`` plans *for* replay mode ``M`` instead (:mod:`~acstudio.plan.solvers.for_mode`): the solvers
still choose in their own modes, so their sets are searched over lower target budgets and each is priced in ``M``.

To add a solver: a module here with its ``solve_<name>``, registered with :func:`~acstudio.plan.solvers.registry.solver`
and its traits, a look in :data:`~acstudio.plan.solvers.registry.LOOKS`, and an import below.
"""

from __future__ import annotations

from acstudio.jobs import CancelToken
from acstudio.plan.model import Plan
from acstudio.plan.schedule import PlanContext

# isort: off
# Each module registers its solver on import, in this order: the order the CLI and the app list them in.
from acstudio.plan.solvers import mutwo, milp, milp_bound, blocks  # noqa: F401
from acstudio.plan.solvers import keep_all, recompute_all, per_module, sqrt_n, per_op  # noqa: F401
from acstudio.plan.solvers import auto  # noqa: F401
# isort: on
from acstudio.plan.solvers.auto import DEFAULT_SOLVER
from acstudio.plan.solvers.for_mode import fill_budget, plan_for_mode, tighten_to_budget
from acstudio.plan.solvers.mutwo import NAME as TRAJECTORY_SOLVER
from acstudio.plan.solvers.mutwo import trajectory
from acstudio.plan.solvers.registry import (
    LOOKS,
    SOLVERS,
    Look,
    Solver,
    best_of,
    faster_at_lowest_peak,
    floor_solver,
    get_solver,
    kept_reason,
)
from acstudio.plan.solvers.sweep import sweep
from acstudio.profile.model import Profile
from acstudio.simulate.simulator import Simulator

__all__ = ["DEFAULT_SOLVER", "LOOKS", "SOLVERS", "TRAJECTORY_SOLVER", "Look", "Solver", "best_of",
           "faster_at_lowest_peak", "fill_budget", "floor_solver", "get_solver", "kept_reason", "plan", "plan_for_mode",
           "sweep", "tighten_to_budget", "trajectory"]


def plan(profile: Profile, budget_bytes: int, solver: str = DEFAULT_SOLVER, simulator: Simulator | None = None,
         cancel: CancelToken | None = None, ctx: PlanContext | None = None, mode: str | None = None,
         offload: bool = True, host_memory: int | None = None) -> Plan:
    """Plan one budget with ``solver`` (a name in :data:`SOLVERS`); pass ``ctx`` to reuse what earlier calls
    computed for the same profile (it then says whether to offload). ``mode`` (a replay mode) plans for that mode:
    the plan's peak in it fits (:func:`plan_for_mode`; ``auto`` searches every solver it knows); without it each
    solver picks its modes. ``offload``, ``host_memory``: see :class:`~acstudio.plan.schedule.PlanContext`."""
    chosen = get_solver(solver)
    ctx = ctx or PlanContext(profile, simulator, offload=offload, host_memory=host_memory)
    if mode is not None:
        return plan_for_mode(ctx, budget_bytes, mode, solver, cancel)
    return chosen.solve(ctx, budget_bytes, cancel=cancel)
