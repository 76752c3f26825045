"""``auto``, the default: every solver that runs in auto (:attr:`Solver.auto_order`) is asked for its plan at the
budget, and the predicted-fastest one that fits is returned (or, if none fits, the fastest at the lowest peak
reached, planned again at that peak): by construction no plan it knows beats it. Each fixed baseline is priced in
the replay mode its real counterpart runs in (per-module and √n as ``torch.utils.checkpoint`` on segments: shared
chains; recompute-all in whichever mode is faster).
"""

from __future__ import annotations

import dataclasses
import os

from acstudio.errors import ACStudioError
from acstudio.jobs import CancelToken, check
from acstudio.plan.model import Plan
from acstudio.plan.schedule import PlanContext
from acstudio.plan.solvers import milp
from acstudio.plan.solvers.registry import SOLVERS, auto_solvers, best_of, faster_at_lowest_peak, solver

NAME = "auto"
DEFAULT_SOLVER = NAME  # what the CLI and the app plan with unless told otherwise
# auto also asks the shared-mode program (acstudio.plan.solvers.milp.shared_bound) for its set on graphs up to
# milp.PROGRAM_MAX_CANDIDATES, within ACSTUDIO_AUTO_MILP_SECONDS (default 10; 0 never asks): on the transformer
# samples it answers within seconds and often finds a faster plan than the others.
AUTO_PROGRAM_TIME_ENV = "ACSTUDIO_AUTO_MILP_SECONDS"


def auto_program_seconds() -> float:
    """The time ``auto`` gives the shared-mode program per budget (environment ``ACSTUDIO_AUTO_MILP_SECONDS``)."""
    text = os.environ.get(AUTO_PROGRAM_TIME_ENV, "10")
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise ACStudioError(f"{AUTO_PROGRAM_TIME_ENV}={text!r} is not a number of seconds — give e.g. 10, or 0 to "
                            "plan without the shared-chain program")
    return seconds


@solver(NAME, "the fastest plan of every solver above that fits (never beaten by a plan it knows)", instant=True)
def solve_auto(ctx: PlanContext, budget: int, *, cancel: CancelToken | None = None) -> Plan:
    return auto_plan(ctx, budget, cancel)


def auto_plan(ctx: PlanContext, budget: int, cancel: CancelToken | None = None,
              program: milp.MilpResult | None = None, replan: bool = True) -> Plan:
    """``auto``'s plan; ``program``: the shared-mode program's result at ``budget`` if the caller has it (else it
    is solved here, for at most :func:`auto_program_seconds`). ``replan``: where none fits, plan once more at the
    lowest peak reached (the one level of that search, never a chain of them)."""
    plans = []
    for name in auto_solvers():
        check(cancel)
        plans.append(SOLVERS[name].solve(ctx, budget, cancel=cancel))
    seconds = auto_program_seconds()
    if (program is None and seconds > 0 and len(ctx.rg.candidates) <= milp.PROGRAM_MAX_CANDIDATES
            and ctx.sim.baseline_peak > budget):
        program = milp.shared_bound(ctx, budget, time_limit_s=seconds, cancel=cancel)
    if program is not None and program.chosen:
        plans.append(ctx.plan_for_set("milp-bound", budget, program.chosen, mode="shared"))
    best = best_of(plans)
    why = f"{best.stop_reason} ({best.solver}'s plan)" if best.recomputed else best.stop_reason
    best = dataclasses.replace(best, solver=NAME, stop_reason=why)
    if replan and not best.feasible and best.predicted_peak_bytes < ctx.sim.baseline_peak:
        best = faster_at_lowest_peak(best, auto_plan(ctx, best.predicted_peak_bytes, cancel, replan=False), budget)
    return best
