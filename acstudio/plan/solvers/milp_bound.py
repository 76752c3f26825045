"""``milp-bound``: the fastest plan known and a proven lower bound on every plan's time, in both replay modes
``auto`` plans in (the smaller of the exact program's bound and the shared-mode program's).

Where the context offloads, the plans known include those that offload (auto's, the exact program's), and the
bound is proven for every recompute-only plan; for plans that offload it holds as far as the exact program's
estimate of the copies does (:mod:`~acstudio.plan.solvers.milp`), and the reason says so."""

from __future__ import annotations

import dataclasses

from acstudio.jobs import CancelToken
from acstudio.plan.model import Plan
from acstudio.plan.schedule import PlanContext
from acstudio.plan.solvers.milp import MILP_TIME_LIMIT_S, MilpResult, exact_milp, shared_bound
from acstudio.plan.solvers.registry import best_of, solver

NAME = "milp-bound"


@solver(NAME, "the fastest plan known (auto's, milp's, the shared-mode bound's own; with offload where they offload) "
              "and a lower bound on every plan's time in both replay modes auto plans in", exact=True)
def solve_milp_bound(ctx: PlanContext, budget: int, *, cancel: CancelToken | None = None) -> Plan:
    return bounded_plan(ctx, budget, cancel)[0]


def bounded_plan(ctx: PlanContext, budget: int, cancel: CancelToken | None = None,
                 time_limit_s: float = MILP_TIME_LIMIT_S, auto: Plan | None = None, exact: MilpResult | None = None,
                 shared: MilpResult | None = None) -> tuple[Plan, float]:
    """``milp-bound``'s plan and the lower bound (ms) on the extra time of every plan that fits ``budget`` in
    replay mode "again" or "shared": the smaller of the two programs' bounds (``auto``: auto's plan, ``exact``:
    :func:`exact_milp`'s and ``shared``: :func:`~acstudio.plan.solvers.milp.shared_bound`'s result at ``budget``,
    if the caller has them)."""
    from acstudio.plan.solvers.auto import auto_plan  # auto registers last, after every solver it may ask

    exact = exact or exact_milp(ctx, budget, time_limit_s, cancel)
    shared = shared or shared_bound(ctx, budget, time_limit_s=time_limit_s, cancel=cancel)
    plans = [auto or auto_plan(ctx, budget, cancel, program=shared)]  # auto's candidates include shared's set
    if exact.chosen or exact.offloaded:  # solved in μ-TWO's mode; shared chains may run the same set faster
        plans += [ctx.plan_for_set(NAME, budget, exact.chosen, mode=mode, offloaded=exact.offloaded)
                  for mode in ("again", "shared")]
    best = best_of(plans)
    lower = min(exact.lower_bound_ms, shared.lower_bound_ms)
    if not best.feasible:
        why = best.stop_reason
    elif lower > 1e-12:
        proof = " (proven for plans without offload; with offload, as the program estimates the copies)" \
            if ctx.may_offload else ""
        why = (f"{best.stop_reason}; every plan that fits needs at least {lower:.3f} ms{proof}, this one is within "
               f"{best.predicted_extra_ms / lower - 1:.1%} of that")
    else:
        why = best.stop_reason
    return dataclasses.replace(best, solver=NAME, stop_reason=why), lower
