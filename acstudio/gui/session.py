"""Session: what the window shows (loaded profile, planner state, current plan, selection) and its signals.

Views never call the engine; they listen to the session. A budget change is answered in two steps:

1. at once, from the precomputed μ-TWO trajectory: the recompute set, predicted peak, extra time and the
   decision of every activation (a lookup: microseconds);
2. in the background (newest request wins): the full :class:`~acstudio.plan.model.Plan` with its schedule
   and the simulated per-node timeline, which for a large recompute set takes longer than a slider step
   should. Results are cached per trajectory step, so going back to a budget is instant.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
from PySide6.QtCore import QObject, QTimer, Signal

from acstudio.errors import ACStudioError, WrongSchemaError
from acstudio.gui.jobs import JobRunner
from acstudio.jobs import CancelToken, ProgressFn, check, report
from acstudio.plan.model import Plan
from acstudio.plan.schedule import PlanContext
from acstudio.plan.solvers import DEFAULT_SOLVER, SOLVERS, TRAJECTORY_SOLVER, trajectory
from acstudio.plan.solvers.mutwo import Trajectory
from acstudio.profile.model import Profile
from acstudio.simulate.simulator import SimResult, Simulator
from acstudio.views.graph_layout import DEFAULT_PASS, SHOWN_REGIONS, ModuleTree, laid_out
from acstudio.views.tables import (
    ActivationIndex,
    Decisions,
    activation_table,
    alive_in_span,
    back_in_memory_at,
    graph_decisions,
    table_columns,
)

if TYPE_CHECKING:  # acstudio.bench imports torch (seconds): only a benchmark file the user opens loads it
    from acstudio.bench.results import BenchResults

FASTER_PLAN_DELAY_MS = 300  # budget at rest this long before the shared-chain search runs
SIMULATE_AFTER_MS = 10  # a new plan's timeline is simulated this long after the step, once it is painted
CACHE_PLANS = 64  # simulated timelines kept (one of a 13k-node graph is ~0.6 MB)


@dataclass
class Loaded:
    """Everything derived once per profile, computed in a background job."""

    path: str
    profile: Profile
    simulator: Simulator
    ctx: PlanContext  # caches what the solvers share for this profile
    trajectory: Trajectory
    tree: ModuleTree
    baseline: SimResult
    template: Plan  # the trajectory's step-0 plan: which activations are candidates and why the others are not
    table: pd.DataFrame  # activation table, static columns (plan columns are filled per plan)
    acts: ActivationIndex  # node positions of each activation (table row)
    first_graph: tuple  # the graph's launch view, laid out (see acstudio.views.graph_layout.laid_out)
    floor_note: str = ""  # what sets the AC floor, in a sentence: worked out in the sweep's child process


@dataclass
class PlanState:
    """The current plan, its decision per activation, and its simulated timeline (``None`` until computed)."""

    plan: Plan
    sim: SimResult | None
    decisions: dict[str, str]

    @property
    def complete(self) -> bool:
        return self.sim is not None


def prepare(profile: Profile, path: str, progress: ProgressFn | None = None,
            cancel: CancelToken | None = None, *, cache_dir: str | None = None) -> Loaded:
    """Simulator, μ-TWO trajectory, module tree and tables of ``profile`` (the slow part of opening a file)."""
    report(progress, 0, 3, "simulating the iteration")
    simulator = Simulator(profile)
    baseline = simulator.simulate([])
    check(cancel)
    ctx = PlanContext(profile, simulator)
    traj = trajectory(ctx, progress=progress, cancel=cancel)
    report(progress, 2, 3, "grouping the graph")
    template = traj.plan_for_budget(simulator.baseline_peak)
    tree = ModuleTree(profile)
    # the graph's first picture is made here, off the GUI thread, so it is drawn the moment the file opens
    first_graph = laid_out(tree, tree.default_expansion(), SHOWN_REGIONS[DEFAULT_PASS], cache_dir)
    report(progress, 3, 3, "ready")
    return Loaded(path=path, profile=profile, simulator=simulator, ctx=ctx, trajectory=traj,
                  tree=tree, baseline=baseline, template=template, table=activation_table(profile),
                  acts=ActivationIndex.of(profile), first_graph=first_graph)


def open_document(path: str, current: Loaded | None, progress: ProgressFn | None = None,
                  cancel: CancelToken | None = None, *, cache_dir: str | None = None) -> Loaded | Plan | BenchResults:
    """A profile (prepared; ``cache_dir`` keeps graph layouts) or, if a profile is open, a plan made for it or
    benchmark results of its workload."""
    try:
        profile = Profile.load(path)
    except WrongSchemaError as profile_error:  # another kind of document: its own loader says what is wrong
        try:
            found = Plan.load(path, *((current.profile, current.ctx) if current is not None else ()))
        except WrongSchemaError:
            from acstudio.bench.results import BenchResults  # imports torch: only for a benchmark file

            try:
                found = BenchResults.load(path)
            except WrongSchemaError:
                raise profile_error from None
        what = "a plan" if isinstance(found, Plan) else "a benchmark"
        if current is None:
            raise ACStudioError(f"{path} is {what}; open the profile of its workload first") from None
        if not isinstance(found, Plan):
            check_same_workload(found, current.profile)
        return found
    return prepare(profile, path, progress, cancel, cache_dir=cache_dir)


def check_same_workload(results: BenchResults, profile: Profile) -> None:
    """Measured points belong on a profile's chart only if they ran its workload (any batch size)."""
    def key(spec: dict) -> dict:
        return {k: v for k, v in spec.items() if k not in ("batch_size", "seed")}

    if key(results.meta.get("spec", {})) != key(profile.workload):
        raise ACStudioError(f"this benchmark ran {results.meta.get('spec', {}).get('model')!r} with other settings "
                            f"than the open profile ({profile.workload['model']!r}); open its profile first")


def simulated(loaded: Loaded, plan: Plan, progress=None, cancel=None) -> tuple[Plan, SimResult]:
    return plan, loaded.ctx.simulation(plan)


def solver_plan(loaded: Loaded, budget: int, solver: str, progress=None, cancel=None) -> tuple[Plan, SimResult]:
    result = SOLVERS[solver].solve(loaded.ctx, budget, cancel=cancel)
    check(cancel)
    return result, loaded.ctx.simulation(result)


def faster_plan(loaded: Loaded, budget: int, solver: str, progress=None, cancel=None
                ) -> tuple[Plan, SimResult] | None:
    """``solver``'s own plan when it is predicted faster than the slider's quick answer read off μ-TWO's trajectory
    (tens of simulations, ~0.1 s: too slow for every slider step, so it follows in the background)."""
    best = SOLVERS[solver].solve(loaded.ctx, budget, cancel=cancel)
    check(cancel)
    quick = loaded.trajectory.plan_for_budget(budget)
    if best.recomputed == quick.recomputed and best.replay_mode == quick.replay_mode:
        return None
    return best, loaded.ctx.simulation(best)


class Session(QObject):
    """Current profile and plan. ``planChanged`` fires on the quick answer and again when it is complete."""

    loadedChanged = Signal(object)  # Loaded
    planChanged = Signal(object)  # PlanState: a new current plan (with its timeline if cached)
    simulated = Signal(object)  # PlanState: the current plan's timeline has arrived
    selectionChanged = Signal(str)  # node id
    spanChanged = Signal(object)  # node indices holding the activations alive in the selected timeline span
    failed = Signal(str, str)

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.loaded: Loaded | None = None
        self.state: PlanState | None = None
        self.solver = DEFAULT_SOLVER
        self.selected = ""
        self.selected_activation = ""
        self.span_activations = np.zeros(0, dtype=bool)  # per activation: alive in the selected span
        self.plan_runner = JobRunner("plan", self)
        self.plan_runner.resultReady.connect(self._on_simulated)
        self.plan_runner.failed.connect(self.failed)
        self.faster_runner = JobRunner("faster plan", self)
        self.faster_runner.resultReady.connect(self._on_faster)
        self.faster_runner.failed.connect(self.failed)
        # The shared-chain search (~0.1 s of Python) waits until the budget rests, so it never competes with
        # a slider drag for the interpreter.
        self._faster_timer = QTimer(self)
        self._faster_timer.setSingleShot(True)
        self._faster_timer.setInterval(FASTER_PLAN_DELAY_MS)
        self._faster_timer.timeout.connect(self._search_faster)
        self._cache: OrderedDict[tuple[str, tuple[str, ...], bool], SimResult] = OrderedDict()
        # A new plan's timeline is simulated in the background once the step is painted: a worker thread that
        # started at once would take the interpreter from the repaint (Python callbacks in the table and the plots),
        # and a zero timer may fire before the repaint.
        self._unsimulated: Plan | None = None
        self._simulate_soon = QTimer(self)
        self._simulate_soon.setSingleShot(True)
        self._simulate_soon.setInterval(SIMULATE_AFTER_MS)
        self._simulate_soon.timeout.connect(self._simulate_pending)

    # -- profile ---------------------------------------------------------------------------------------------
    def set_loaded(self, loaded: Loaded) -> None:
        self.plan_runner.cancel()
        self._unsimulated = None
        self._faster_timer.stop()
        self.faster_runner.cancel()
        self.loaded = loaded
        self.state = None
        self.selected = ""
        self.selected_activation = ""
        self.span_activations = np.zeros(len(loaded.acts.bytes), dtype=bool)
        self._cache.clear()
        self.loadedChanged.emit(loaded)

    @property
    def floor_bytes(self) -> int:
        return self.loaded.ctx.floor_bytes

    @property
    def baseline_bytes(self) -> int:
        return self.loaded.simulator.baseline_peak

    # -- plans -----------------------------------------------------------------------------------------------
    def set_budget(self, budget: int) -> PlanState | None:
        """Plan for ``budget``: for an instant solver (``Solver.instant``) μ-TWO's plan is read off the trajectory
        at once (its timeline follows through a second ``planChanged``) and the solver's own plan replaces it when
        the budget rests; other solvers plan from scratch in the background and report only then."""
        loaded = self.loaded
        if not SOLVERS[self.solver].instant:
            self._faster_timer.stop()
            self.faster_runner.cancel()
            self.plan_runner.submit(partial(solver_plan, loaded, budget, self.solver))
            return None
        self.show(loaded.trajectory.plan_for_budget(budget))
        self.faster_runner.cancel()
        self._faster_timer.start()
        return self.state

    def _search_faster(self) -> None:
        if self.loaded is not None and self.state is not None and self.state.plan.solver == TRAJECTORY_SOLVER:
            self.faster_runner.submit(partial(faster_plan, self.loaded, self.state.plan.budget_bytes, self.solver))

    def _on_faster(self, result: tuple[Plan, SimResult] | None) -> None:
        """Replace the quick answer by the solver's own plan if the user is still at that budget."""
        current = self.state.plan if self.state is not None else None
        if result is None or current is None or current.solver != TRAJECTORY_SOLVER:
            return
        plan, sim = result
        if plan.budget_bytes != current.budget_bytes or (plan.feasible, -plan.predicted_extra_ms) <= (
                current.feasible, -current.predicted_extra_ms):
            return
        self._cache[self._key(plan)] = sim
        self.show(plan)

    def show(self, plan: Plan) -> None:
        """Make ``plan`` the current one; its simulated timeline comes from the cache or a background job."""
        plan.check_profile(self.loaded.profile)
        self.solver = plan.solver
        key = self._key(plan)
        sim = self._cache.get(key)
        self.state = PlanState(plan=plan, sim=sim, decisions=plan.decisions(self.loaded.profile))
        self.plan_runner.cancel()
        if sim is not None:
            self._cache.move_to_end(key)
            self._unsimulated = None
        else:
            self._unsimulated = plan
            self._simulate_soon.start()
        self.planChanged.emit(self.state)

    @property
    def busy(self) -> bool:
        """A plan is being made or simulated, or is about to be."""
        return self.plan_runner.busy or self.faster_runner.busy or self._simulate_soon.isActive()

    def _simulate_pending(self) -> None:
        if self._unsimulated is not None and self.loaded is not None:
            self.plan_runner.submit(partial(simulated, self.loaded, self._unsimulated))
        self._unsimulated = None

    @staticmethod
    def _key(plan: Plan) -> tuple[str, tuple[str, ...], bool]:
        return plan.solver, tuple(plan.recomputed), plan.replay_mode

    def _on_simulated(self, result: tuple[Plan, SimResult]) -> None:
        plan, sim = result
        self._cache[self._key(plan)] = sim
        while len(self._cache) > CACHE_PLANS:
            self._cache.popitem(last=False)
        if self.state is None or self.state.plan is not plan:  # another solver's plan: new, complete
            self.state = PlanState(plan=plan, sim=sim, decisions=plan.decisions(self.loaded.profile))
            self.planChanged.emit(self.state)
        else:
            self.state.sim = sim
            self.simulated.emit(self.state)

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
        self.selectionChanged.emit(node_id)

    def select_span(self, first: int, last: int) -> None:
        """Select the nodes ``first..last`` of the timeline: the activations alive there under the current plan
        (an empty span clears the selection)."""
        if self.loaded is None or self.state is None:
            return
        acts = self.loaded.acts
        if last < first:
            self.span_activations = np.zeros(len(acts.bytes), dtype=bool)
        else:
            back = back_in_memory_at(self.loaded.profile, acts, self.state.plan)
            self.span_activations = alive_in_span(acts, back, first, last)
        alive = self.span_activations
        self.spanChanged.emit(np.concatenate([acts.created[alive], acts.first_bw[alive]]))

    # -- derived views ---------------------------------------------------------------------------------------
    def graph_decisions(self, state: PlanState) -> Decisions:
        """Per-node arrays for the graph colours."""
        return graph_decisions(self.loaded.profile, self.loaded.acts, state.plan)

    def table_columns(self, state: PlanState) -> dict[str, np.ndarray]:
        """The activation table's plan columns for ``state``."""
        return table_columns(self.loaded.acts, state.plan)

    def shutdown(self) -> None:
        self._faster_timer.stop()
        self._simulate_soon.stop()
        self.faster_runner.shutdown()
        self.plan_runner.shutdown()
