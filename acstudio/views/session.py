"""The session: what the app shows (the loaded profile, budget, solver, current plan, selection and span), as one
Qt-free model that raises plain events (napari's ``EventedModel`` idea, without pydantic).

Every view takes the session, draws itself from its state, follows its events, and writes what the user does
back to it, never to another view. The session never learns about Qt: background work goes through the
:class:`Jobs` it is given (a thread per job name in the app, :class:`InlineJobs` in scripts and tests).

A budget is answered in two moves, each made once:

1. at once, a *preview* read off μ-TWO's precomputed trajectory when the solver answers instantly: the recompute
   set, predicted peak, extra time and the decision of every activation (a lookup, microseconds, neither a solve
   nor a simulation), so a slider step costs one repaint. The trajectory only recomputes: planning offload takes
   hundreds of simulations, too slow for a slider step, so where the resting plan may offload, plans that offload
   are made once per profile in a background job (:func:`offload_preview`, at a grid of budgets, started once the
   profile's first plan is on show, so as not to delay it) and the preview is the fastest of the trajectory's
   plan, those, and the plans made before, whose predicted peak fits this budget (a plan for a tighter budget fits
   a looser one); it says which it is (:attr:`PlanState.note`);
2. when the budget rests, *one* background job makes the plan and simulates its timeline: for a solver that
   answers instantly, μ-TWO's best plan for the budget (the preview, or its shared-chain form where that is
   faster: tens of simulations, a tenth of a second, too slow for every slider step; on a GPU also its plan
   that offloads activations to host memory, where that is faster still); for another solver, its own plan.
   A newer budget supersedes the job (newest wins), so a drag costs one plan, for where it stops.
   Complete plans are cached per solver and budget, so going back to a budget is instant.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from functools import partial
from typing import Any, Protocol

import numpy as np
import pandas as pd

from acstudio.errors import ACStudioError, Cancelled
from acstudio.jobs import CancelToken, Precedence, check
from acstudio.plan.model import Plan
from acstudio.plan.solvers import DEFAULT_SOLVER, SOLVERS, best_of
from acstudio.plan.solvers.mutwo import OffloadPreview, offload_plan, offload_preview
from acstudio.simulate.simulator import SimResult
from acstudio.units import format_bytes
from acstudio.views.documents import Loaded
from acstudio.views.pareto import measured_points
from acstudio.views.tables import (
    Decisions,
    alive_in_span,
    back_in_memory_at,
    forward_until,
    graph_decisions,
    table_columns,
)

PLAN_JOB = "plan"
OFFLOAD_PREVIEW_JOB = "offload preview"
PLAN_AT_REST_MS = 150  # a previewed budget is solved once it rests this long: a drag does not solve every pause
SIMULATE_AFTER_MS = 10  # a plan without a preview is solved this long after the step, once it is painted
CACHE_PLANS = 64  # complete plans kept (the timeline of a 13k-node graph is ~0.6 MB)
PLAN_FOLLOWS = "the plan weighing offload too follows at rest"
PREVIEW_RECOMPUTE_ONLY = f"preview: recompute only; {PLAN_FOLLOWS}"


class Event:
    """One kind of change: the callbacks connected to it are called in order with what changed."""

    def __init__(self) -> None:
        self._callbacks: list[Callable[..., Any]] = []

    def connect(self, callback: Callable[..., Any]) -> None:
        self._callbacks.append(callback)

    def disconnect(self, callback: Callable[..., Any]) -> None:
        self._callbacks.remove(callback)

    def emit(self, *args: Any) -> None:
        for callback in list(self._callbacks):
            callback(*args)

    def clear(self) -> None:
        self._callbacks.clear()


@dataclass
class SessionEvents:
    """The session's events, one per thing that changes (napari: one per field)."""

    loaded: Event = field(default_factory=Event)  # Loaded: a new profile (views reset)
    budget: Event = field(default_factory=Event)  # bytes: the budget the views show (while dragging, too)
    solver: Event = field(default_factory=Event)  # name
    plan: Event = field(default_factory=Event)  # PlanState: a new current plan (``complete`` once simulated)
    planning: Event = field(default_factory=Event)  # (solver, budget): a plan without a preview is being made
    selection: Event = field(default_factory=Event)  # node id
    span: Event = field(default_factory=Event)  # node indices holding the activations alive in the span
    floor_note: Event = field(default_factory=Event)  # what sets the floor, in a sentence
    other_solvers: Event = field(default_factory=Event)  # the sweep's rows: other solvers' operating points
    measured: Event = field(default_factory=Event)  # (extra ms, peak bytes) of benchmarked plans
    failed: Event = field(default_factory=Event)  # (message, details): planning failed

    def disconnect_all(self) -> None:
        for f in fields(self):
            getattr(self, f.name).clear()


class Jobs(Protocol):
    """Runs a named background job ``fn(progress, cancel)``; a newer job of the same name supersedes it, and only
    the newest one's ``on_result`` or ``on_error(message, details)`` is called, in the session's thread."""

    busy: bool

    def submit(self, name: str, fn: Callable, on_result: Callable[[Any], None],
               on_error: Callable[[str, str], None], delay_ms: int = 0) -> None: ...

    def cancel(self, name: str) -> None: ...

    def shutdown(self) -> None: ...


class InlineJobs:
    """Runs every job at once in the caller's thread: the session without an event loop (scripts, tests)."""

    busy = False

    def submit(self, name: str, fn: Callable, on_result: Callable[[Any], None],
               on_error: Callable[[str, str], None], delay_ms: int = 0) -> None:
        try:
            result = fn(None, CancelToken())
        except Cancelled:
            return
        except ACStudioError as exc:
            on_error(str(exc), "")
            return
        on_result(result)

    def cancel(self, name: str) -> None:
        """Nothing runs in the background: there is nothing to cancel."""

    def shutdown(self) -> None:
        """Nothing runs in the background: there is nothing to stop."""


@dataclass
class PlanState:
    """The current plan, its decision per activation, and its simulated timeline (``None`` for a preview);
    ``note``: what a preview is, where it may differ from the plan the budget gets once it rests."""

    plan: Plan
    sim: SimResult | None
    decisions: dict[str, str]
    note: str = ""

    @property
    def complete(self) -> bool:
        return self.sim is not None


def solve_and_simulate(loaded: Loaded, budget: int, solver: str, progress=None, cancel=None
                       ) -> tuple[Plan, SimResult]:
    """The plan job of a solver without a preview: its plan for ``budget`` and its timeline, each made once."""
    plan = SOLVERS[solver].solve(loaded.ctx, budget, cancel=cancel)
    check(cancel)
    return plan, loaded.ctx.simulation(plan)


def refine_and_simulate(loaded: Loaded, budget: int, progress=None, cancel=None) -> tuple[Plan, SimResult]:
    """The plan job after a preview: μ-TWO's best plan for ``budget`` (the preview's steps, or a prefix of them
    replayed as shared chains where that is faster, or, where the profile's device can offload, its plan that
    copies activations to host memory where that is faster still) and its timeline, each made once."""
    plans = [loaded.trajectory.best_plan_for_budget(budget)]
    check(cancel)
    offloading = offload_plan(loaded.ctx, budget, cancel)
    if offloading is not None:
        plans.append(offloading)
    plan = best_of(plans)
    check(cancel)
    return plan, loaded.ctx.simulation(plan)


def simulate(loaded: Loaded, plan: Plan, progress=None, cancel=None) -> tuple[Plan, SimResult]:
    """The job for a plan opened from a file: its timeline."""
    return plan, loaded.ctx.simulation(plan)


class Session:
    """The app's one model. Read its attributes; change it through its methods; follow it through ``events``."""

    def __init__(self, jobs: Jobs | None = None) -> None:
        self.events = SessionEvents()
        self.jobs: Jobs = jobs if jobs is not None else InlineJobs()
        self.loaded: Loaded | None = None
        self.state: PlanState | None = None
        self.solver = DEFAULT_SOLVER
        self.budget = 0  # bytes, exact: the slider shows it at its resolution, a line drag sets it to the byte
        self.selected = ""
        self.selected_activation = ""
        self.span_activations = np.zeros(0, dtype=bool)  # per activation: alive in the selected span
        self._request: tuple[str, int] | None = None  # (solver, budget) the current plan answers
        self._plans: OrderedDict[tuple[str, int], tuple[Plan, SimResult]] = OrderedDict()
        self.offload_preview: OffloadPreview | None = None  # plans that offload, for the preview to look up
        self._offload_preview_waits = False  # they are made once the profile's first plan is on show
        self._precedence = Precedence()  # and they wait while a plan is being made, which the user waits for

    # -- profile ---------------------------------------------------------------------------------------------
    def set_loaded(self, loaded: Loaded) -> None:
        """Show a new profile, planned with the default solver for a budget halfway between floor and peak."""
        self.jobs.cancel(PLAN_JOB)
        self.loaded = loaded
        self.state = None
        self.offload_preview = None
        self.budget = 0  # the opening budget is news to every view, even if the last profile had it too
        self._request = None
        self._plans.clear()
        self.selected = self.selected_activation = ""
        self.span_activations = np.zeros(len(loaded.acts.bytes), dtype=bool)
        self.events.loaded.emit(loaded)
        floor, top = self.floor_bytes, self.baseline_bytes
        self.solver = DEFAULT_SOLVER
        self.events.solver.emit(self.solver)
        self.jobs.cancel(OFFLOAD_PREVIEW_JOB)
        self._offload_preview_waits = loaded.ctx.may_offload
        self.set_budget(top if floor >= top else (floor + top) // 2)

    def _start_offload_preview(self) -> None:
        """Make the plans that offload for the preview to look up, once the profile's first plan is on show, and
        pausing while a later plan is made: made beside it, they would share the cores and the interpreter with it,
        and the plan the user waits for would take up to twice as long; until they are made, the preview
        recomputes only and says so."""
        if not self._offload_preview_waits:
            return
        self._offload_preview_waits = False
        job = self._precedence.giving_way(partial(offload_preview, self.loaded.ctx))
        self.jobs.submit(OFFLOAD_PREVIEW_JOB, job, partial(self._on_offload_preview, self.loaded),
                         self.events.failed.emit)

    def _on_offload_preview(self, loaded: Loaded, preview: OffloadPreview) -> None:
        """The offload plans for ``loaded`` are made: a preview on show is looked up again, with them."""
        if loaded is not self.loaded:
            return
        self.offload_preview = preview
        if self.state is not None and self.state.note:  # only a preview has a note
            self._show(*self._preview())

    @property
    def floor_bytes(self) -> int:
        return self.loaded.ctx.floor_bytes

    @property
    def baseline_bytes(self) -> int:
        return self.loaded.simulator.baseline_peak

    def set_floor_note(self, path: str, note: str) -> None:
        """What sets the floor of the profile at ``path`` (worked out in a child process, after opening)."""
        if self.loaded is not None and self.loaded.path == path:
            self.loaded.floor_note = note
            self.events.floor_note.emit(note)

    def show_other_solvers(self, path: str, rows: list[dict]) -> None:
        """The sweep's rows for the profile at ``path``: other solvers' operating points on the Pareto chart."""
        if self.loaded is not None and self.loaded.path == path:
            self.events.other_solvers.emit(rows)

    def show_measured(self, results: pd.DataFrame) -> None:
        """Benchmark ``results`` of the open profile's workload: those of its batch size are operating points."""
        points = measured_points(results, self.loaded.profile.workload["batch_size"])
        if points is not None:
            self.events.measured.emit(*points)

    # -- budget, solver, plans -------------------------------------------------------------------------------
    def set_budget(self, budget: int, *, final: bool = True) -> None:
        """Show ``budget``; plan for it unless the user is still moving it (``final=False``)."""
        if self.loaded is None:
            return
        budget = int(budget)
        if budget != self.budget:
            self.budget = budget
            self.events.budget.emit(budget)
        if final:
            self._plan()

    def set_solver(self, solver: str) -> None:
        if solver == self.solver:
            return
        self.solver = solver
        self.events.solver.emit(solver)
        if self.loaded is not None:
            self._plan()

    def _plan(self) -> None:
        """Plan once for the current solver and budget: from the cache, or a preview now and one job later."""
        request = (self.solver, self.budget)
        if request == self._request:
            return
        self._request = request
        self.jobs.cancel(PLAN_JOB)
        cached = self._plans.get(request)
        if cached is not None:
            self._plans.move_to_end(request)
            self._show(*cached)
            return
        # An instant solver's answer is read off μ-TWO's trajectory while the slider moves, and is μ-TWO's best
        # plan when it rests (auto's full answer also runs the shared-mode program, seconds per budget on BERT-size
        # graphs: the chart's auto curve comes from the sweep's child process instead).
        if SOLVERS[self.solver].instant:
            self._show(*self._preview())
            job, delay = partial(refine_and_simulate, self.loaded, self.budget), PLAN_AT_REST_MS
        else:
            self.events.planning.emit(self.solver, self.budget)
            job, delay = partial(solve_and_simulate, self.loaded, self.budget, self.solver), SIMULATE_AFTER_MS
        self.jobs.submit(PLAN_JOB, self._precedence.urgent(job), partial(self._on_planned, request),
                         self.events.failed.emit, delay_ms=delay)

    def _preview(self) -> tuple[Plan, None, str]:
        """The instant answer for the current budget, and what it is where the resting plan may offload: the
        trajectory's recompute-only plan, or, where one is faster, the fastest whose predicted peak fits this
        budget of the precomputed offload plans and the plans made before for this solver (lookups: no planning)."""
        preview = self.loaded.trajectory.plan_for_budget(self.budget)
        if not self.loaded.ctx.may_offload or self.budget >= self.baseline_bytes:  # its plan will not offload
            return preview, None, ""
        fitting = [plan for (solver, _), (plan, _sim) in self._plans.items()
                   if solver == self.solver and plan.feasible and plan.predicted_peak_bytes <= self.budget]
        earlier = min(fitting, key=lambda plan: plan.predicted_extra_ms, default=None)
        precomputed = self.offload_preview.plan_for_budget(self.budget) if self.offload_preview else None
        faster = [plan for plan in (earlier, precomputed) if plan is not None
                  and not (preview.feasible and preview.predicted_extra_ms <= plan.predicted_extra_ms)]
        best = min(faster, key=lambda plan: plan.predicted_extra_ms, default=None)
        if best is None:
            return preview, None, PREVIEW_RECOMPUTE_ONLY
        if best is earlier:
            note = f"preview: the plan made for {format_bytes(earlier.budget_bytes)} (it fits here too); {PLAN_FOLLOWS}"
            return replace(earlier, budget_bytes=self.budget), None, note
        note = (f"preview: a precomputed plan that peaks at {format_bytes(best.predicted_peak_bytes)} and offloads "
                f"{len(best.offloaded)} activations; {PLAN_FOLLOWS}")
        return best, None, note

    def _on_planned(self, request: tuple[str, int], result: tuple[Plan, SimResult]) -> None:
        self._plans[request] = result
        while len(self._plans) > CACHE_PLANS:
            self._plans.popitem(last=False)
        self._show(*result)
        self._start_offload_preview()

    def show_plan(self, plan: Plan) -> None:
        """Make ``plan`` (opened from a file) the current one: its solver and budget follow, its timeline is
        simulated in the background."""
        plan.check_profile(self.loaded.profile)
        self.jobs.cancel(PLAN_JOB)
        if plan.solver != self.solver:
            self.solver = plan.solver
            self.events.solver.emit(plan.solver)
        self.set_budget(plan.budget_bytes, final=False)
        self._request = (plan.solver, plan.budget_bytes)
        self._show(plan, None)
        self.jobs.submit(PLAN_JOB, self._precedence.urgent(partial(simulate, self.loaded, plan)), self._on_simulated,
                         self.events.failed.emit, delay_ms=SIMULATE_AFTER_MS)

    def _on_simulated(self, result: tuple[Plan, SimResult]) -> None:
        self._show(*result)
        self._start_offload_preview()

    def _show(self, plan: Plan, sim: SimResult | None, note: str = "") -> None:
        self.state = PlanState(plan=plan, sim=sim, decisions=plan.decisions(self.loaded.profile), note=note)
        self.events.plan.emit(self.state)

    @property
    def busy(self) -> bool:
        """A plan is being made or simulated, or is about to be (or the offload plans the preview looks up)."""
        return self.jobs.busy

    # -- selection -------------------------------------------------------------------------------------------
    def select(self, node_id: str, activation: str = "") -> None:
        """Select a node and one of its activations (by default the first it makes, if any)."""
        if self.loaded is None or node_id not in self.loaded.profile.node_index:
            return
        if not activation:
            activation = next((a.id for a in self.loaded.profile.activations if a.created_at == node_id), "")
        if (node_id, activation) == (self.selected, self.selected_activation):
            return
        self.selected, self.selected_activation = node_id, activation
        self.events.selection.emit(node_id)

    def select_span(self, first: int, last: int) -> None:
        """Select the nodes ``first..last`` of the timeline: the activations alive there under the current plan
        (an empty span clears the selection)."""
        if self.loaded is None or self.state is None:
            return
        acts = self.loaded.acts
        if last < first:
            self.span_activations = np.zeros(len(acts.bytes), dtype=bool)
        else:
            offload = self.state.sim.offload if self.state.sim is not None else None
            back = back_in_memory_at(self.loaded.profile, acts, self.state.plan, offload)
            self.span_activations = alive_in_span(acts, back, first, last, forward_until(acts, offload))
        alive = self.span_activations
        self.events.span.emit(np.concatenate([acts.created[alive], acts.first_bw[alive]]))

    # -- derived views ---------------------------------------------------------------------------------------
    def graph_decisions(self, state: PlanState) -> Decisions:
        """Per-node arrays for the graph colours."""
        return graph_decisions(self.loaded.profile, self.loaded.acts, state.plan)

    def table_columns(self, state: PlanState) -> dict[str, np.ndarray]:
        """The activation table's plan columns for ``state``."""
        return table_columns(self.loaded.acts, state.plan)

    def shutdown(self) -> None:
        """Stop the background jobs and forget the views (the window is closing)."""
        self.jobs.shutdown()
        self.events.disconnect_all()
