"""The solver registry: one record per planner, with the traits the CLI, the app and the sweep look up.

A solver is ``solve_<name>(ctx, budget, *, cancel) -> Plan`` (Checkmate's style) in a file of its own in this
package, registered with :func:`solver`. Code outside this package never tests a solver's name: it asks the
record (does it answer instantly, is it an exact program, does ``auto`` ask it, how is it drawn).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from dataclasses import dataclass

from acstudio.errors import ACStudioError
from acstudio.jobs import CancelToken, ProgressFn
from acstudio.plan.model import Plan
from acstudio.plan.schedule import PlanContext


@dataclass(frozen=True)
class Look:
    """How a solver is drawn on the Pareto chart: a line in ``colour``, or markers of ``symbol`` in it."""

    colour: tuple[int, int, int]
    symbol: str  # a pyqtgraph symbol name


# One fixed look per solver, keyed by name, so a solver looks the same whatever order its rows arrive in. No two
# share a colour or a symbol, nor the chart's measured points (teal squares) and current plan (a red circle).
LOOKS: dict[str, Look] = {
    "mutwo": Look((70, 130, 220), "o"),
    "milp": Look((90, 90, 220), "x"),
    "milp-bound": Look((200, 60, 140), "t1"),
    "blocks": Look((40, 160, 60), "d"),
    "keep-all": Look((120, 120, 120), "star"),
    "recompute-all": Look((230, 140, 30), "s"),
    "per-module": Look((150, 80, 200), "t"),
    "sqrt-n": Look((190, 170, 0), "p"),
    "per-op": Look((170, 110, 60), "h"),
    "auto": Look((20, 20, 20), "+"),
}


@dataclass(frozen=True)
class CurvePoint:
    """One operating point of a solver in a sweep: its plan's peak and extra time, priced in ``replay_mode``."""

    peak_bytes: int
    extra_ms: float
    n_recomputed: int
    replay_mode: str
    in_auto: bool = True  # auto's envelope counts it (a baseline's point in a mode its counterpart never runs: no)
    note: str = ""


CurveFn = Callable[[PlanContext, ProgressFn | None, CancelToken | None], list[CurvePoint]]


@dataclass(frozen=True)
class Solver:
    """A registered planner and its traits."""

    name: str
    summary: str
    solve: Callable[..., Plan]
    curve: CurveFn | None = None  # its operating points in a sweep, all at once (a program's come budget by budget)
    instant: bool = False  # the app answers a slider step at once off μ-TWO's trajectory, its own plan following
    exact: bool = False  # a mathematical program: seconds per budget, so a sweep solves it at a few budgets, last
    auto_order: int | None = None  # auto asks it, in this order (of equally good plans the first counts)
    policy: bool = False  # a selective-checkpoint policy's set: auto knows it only when planning for a replay mode
    fixed_set: Callable[..., list[int]] | None = None  # a fixed baseline's rule: the recompute set of a context
    real_modes: tuple[str, ...] = ()  # the replay modes a fixed baseline's real counterpart may run in
    sets_floor: bool = False  # its set is every candidate: its plan's peak is the lowest checkpointing reaches
    kept_reason: str = "kept"  # why an activation it leaves in memory is kept, in the app's table

    @property
    def runs_in_auto(self) -> bool:
        return self.auto_order is not None

    @property
    def look(self) -> Look:
        return LOOKS[self.name]


SOLVERS: dict[str, Solver] = {}


def solver(name: str, summary: str, **traits) -> Callable[[Callable[..., Plan]], Callable[..., Plan]]:
    """Register ``solve(ctx, budget, *, cancel=None) -> Plan`` under ``name`` with the :class:`Solver` traits."""
    if name not in LOOKS:
        raise ValueError(f"solver {name!r} has no look in LOOKS: give it a colour and symbol no other solver has")

    def register(solve: Callable[..., Plan]) -> Callable[..., Plan]:
        SOLVERS[name] = Solver(name, summary, solve, **traits)
        return solve
    return register


def get_solver(name: str) -> Solver:
    """The record of solver ``name``, or a one-line error naming the valid ones."""
    if name not in SOLVERS:
        raise ACStudioError(f"unknown solver {name!r}; choose one of {', '.join(SOLVERS)}")
    return SOLVERS[name]


def kept_reason(name: str) -> str:
    """Why a plan by solver ``name`` keeps an activation (``"kept"`` for a name no longer registered)."""
    found = SOLVERS.get(name)
    return found.kept_reason if found else "kept"


def floor_solver() -> str:
    """The solver whose plan sits at the checkpointing floor (every candidate recomputed)."""
    return next(s.name for s in SOLVERS.values() if s.sets_floor)


def auto_solvers(policies: bool = False) -> tuple[str, ...]:
    """The solvers ``auto`` asks, in its order; with ``policies`` also the policies it knows for a replay mode."""
    known = sorted((s for s in SOLVERS.values() if s.runs_in_auto), key=lambda s: s.auto_order)
    return tuple(s.name for s in known) + (tuple(s.name for s in SOLVERS.values() if s.policy) if policies else ())


def best_of(plans: Collection[Plan]) -> Plan:
    """The predicted-fastest plan that fits its budget (of equally fast ones, to a nanosecond, the lowest peak: sums
    of the same replays in another order differ in the last bits), or, if none fits, the one with the lowest peak."""
    fitting = [p for p in plans if p.feasible]
    if fitting:
        return min(fitting, key=lambda p: (round(p.predicted_extra_ms, 6), p.predicted_peak_bytes))
    return min(plans, key=lambda p: (p.predicted_peak_bytes, p.predicted_extra_ms))


def faster_at_lowest_peak(found: Plan, lowest: Plan, budget: int) -> Plan:
    """Of ``found``, a plan that does not fit ``budget``, and ``lowest``, planned at the peak ``found`` reached,
    the faster one, still marked as not meeting ``budget``.

    Where a budget lies below the lowest peak any plan reaches (the floor), the solvers hand back what they reached
    on their way down, usually everything recomputed; planned at that peak instead they use the memory beneath it
    (on the bf16 decoder sample 21 MiB under the floor: +559 ms predicted, against +17 ms at the floor)."""
    if not lowest.feasible or lowest.predicted_extra_ms >= found.predicted_extra_ms:
        return found  # planned at found's peak, a feasible lowest peaks no higher
    return dataclasses.replace(lowest, budget_bytes=budget, feasible=False,
                               stop_reason="budget not met: the fastest plan at the lowest peak reached, "
                                           f"{lowest.stop_reason.removeprefix('budget met').lstrip(':; ')}")
