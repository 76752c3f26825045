"""Session: what the window shows (loaded profile, planner state, current plan, selection) and its signals.

Views never call the engine; they listen to the session. A budget change is answered in two steps:

1. at once, from the precomputed μ-TWO trajectory: the recompute set, predicted peak, extra time and the
   decision of every activation (a lookup: microseconds);
2. in the background (newest request wins): the full :class:`~acstudio.plan.model.Plan` with its schedule
   and the simulated per-node timeline, which for a large recompute set takes longer than a slider step
   should. Results are cached per trajectory step, so going back to a budget is instant.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import pandas as pd
from PySide6.QtCore import QObject, Signal

from acstudio.errors import ACStudioError, ProfileFileError
from acstudio.gui.graph_layout import ModuleTree
from acstudio.gui.graph_view import Decisions
from acstudio.gui.jobs import JobRunner
from acstudio.jobs import CancelToken, ProgressFn, check, report
from acstudio.plan.model import Plan
from acstudio.plan.mutwo import BASELINE_FITS, BUDGET_MET, SOLVERS, Trajectory, mutwo_trajectory, plan, sweep
from acstudio.profile.model import Profile
from acstudio.simulate.simulator import SimResult, Simulator

CACHE_STEPS = 64  # full plans + timelines kept (one timeline of a 13k-node graph is ~0.6 MB)
TABLE_PLAN_COLUMNS = ("decision", "why", "step", "sources", "replay_nodes", "recompute_ms", "ratio")


@dataclass
class Loaded:
    """Everything derived once per profile, computed in a background job."""

    path: str
    profile: Profile
    simulator: Simulator
    trajectory: Trajectory
    tree: ModuleTree
    baseline: SimResult
    template: Plan  # the trajectory's step-0 plan: which activations are candidates and why the others are not
    table: pd.DataFrame  # activation table, static columns (plan columns are filled per plan)
    act_node: np.ndarray  # activation (table row) -> index of the node that allocates it
    act_bytes: np.ndarray


@dataclass
class PlanState:
    """The current plan. ``plan`` and ``sim`` are ``None`` until the background job has produced them."""

    solver: str
    budget: int
    step: int | None
    recomputed: list[str]
    peak_bytes: int
    peak_node: str
    extra_ms: float
    feasible: bool
    stop_reason: str
    plan: Plan | None = None
    sim: SimResult | None = None
    decisions: dict[str, str] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return self.plan is not None and self.sim is not None


def activation_table(profile: Profile) -> pd.DataFrame:
    """Static facts per activation: where it is made, its size, how long it lives and waits."""
    index = profile.node_index
    by_id = profile.node_by_id
    rows = []
    for a in profile.activations:
        made = by_id[a.created_at]
        rows.append({
            "activation": a.id, "node": made.name, "op": made.target.removeprefix("aten."), "module": made.module,
            "shape": made.shape, "bytes": a.bytes,
            "lifetime": index[a.last_bw_use] - index[a.created_at],
            "inactive_ms": a.inactive_time_ms, "first_bw_use": by_id[a.first_bw_use].name,
        })
    cols = ["activation", "node", "op", "module", "shape", "bytes", "lifetime", "inactive_ms", "first_bw_use"]
    df = pd.DataFrame(rows, columns=cols).set_index("activation", drop=False)
    df = df.rename(columns={"activation": "id"})
    for c in TABLE_PLAN_COLUMNS:
        df[c] = ""
    return df


def prepare(profile: Profile, path: str, progress: ProgressFn | None = None,
            cancel: CancelToken | None = None) -> Loaded:
    """Simulator, μ-TWO trajectory, module tree and tables of ``profile`` (the slow part of opening a file)."""
    report(progress, 0, 3, "simulating the iteration")
    simulator = Simulator(profile)
    baseline = simulator.simulate([])
    check(cancel)
    trajectory = mutwo_trajectory(profile, simulator, progress=progress, cancel=cancel)
    report(progress, 2, 3, "grouping the graph")
    template = trajectory.plan_at(0, simulator.baseline_peak, BASELINE_FITS)
    trajectory.plan_at(len(trajectory.steps) - 1, simulator.baseline_peak, BUDGET_MET)  # warms the planner's caches
    tree = ModuleTree(profile)
    index = profile.node_index
    act_node = np.array([index[a.created_at] for a in profile.activations], dtype=np.int64)
    act_bytes = np.array([a.bytes for a in profile.activations], dtype=np.int64)
    report(progress, 3, 3, "ready")
    return Loaded(path=path, profile=profile, simulator=simulator, trajectory=trajectory, tree=tree,
                  baseline=baseline, template=template, table=activation_table(profile), act_node=act_node,
                  act_bytes=act_bytes)


def open_document(path: str, current: Loaded | None, progress: ProgressFn | None = None,
                  cancel: CancelToken | None = None) -> Loaded | Plan:
    """A profile (prepared) or, if a profile is open, a plan made for it."""
    try:
        profile = Profile.load(path)
    except ProfileFileError as profile_error:
        try:
            plan = Plan.load(path, current.profile if current is not None else None)
        except ProfileFileError:
            raise profile_error from None
        if current is None:
            raise ACStudioError(f"{path} is a plan; open the profile it was made for first") from None
        return plan
    return prepare(profile, path, progress, cancel)


def full_plan(loaded: Loaded, budget: int, progress=None, cancel=None) -> tuple[Plan, SimResult]:
    plan = loaded.trajectory.plan_for_budget(budget)
    check(cancel)
    return plan, loaded.simulator.simulate(plan.recomputed)


def simulate_plan(loaded: Loaded, plan: Plan, progress=None, cancel=None) -> tuple[Plan, SimResult]:
    return plan, loaded.simulator.simulate(plan.recomputed)


def solver_plan(loaded: Loaded, budget: int, solver: str, progress=None, cancel=None) -> tuple[Plan, SimResult]:
    result = plan(loaded.profile, budget, solver, loaded.simulator, cancel)
    check(cancel)
    return result, loaded.simulator.simulate(result.recomputed)


def other_solvers(profile: Profile, progress=None, cancel=None) -> pd.DataFrame:
    """Operating points of every solver but μ-TWO (whose curve the trajectory already is), for the Pareto chart.

    Runs on its own simulator: the session's one is in use by the plan thread at the same time.
    """
    return sweep(profile, [s for s in SOLVERS if s != "mutwo"], progress=progress, cancel=cancel)


class Session(QObject):
    """Current profile and plan. ``planChanged`` fires on the quick answer and again when it is complete."""

    loadedChanged = Signal(object)  # Loaded
    planChanged = Signal(object)  # PlanState
    selectionChanged = Signal(str)  # node id
    failed = Signal(str, str)

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.loaded: Loaded | None = None
        self.state: PlanState | None = None
        self.solver = "mutwo"
        self.selected = ""
        self.plan_runner = JobRunner("plan", self)
        self.plan_runner.resultReady.connect(self._on_full_plan)
        self.plan_runner.failed.connect(self.failed)
        self._cache: OrderedDict[int, tuple[Plan, SimResult]] = OrderedDict()
        self._pending_step: int | None = None

    # -- profile ---------------------------------------------------------------------------------------------
    def set_loaded(self, loaded: Loaded) -> None:
        self.plan_runner.cancel()
        self.loaded = loaded
        self.state = None
        self.selected = ""
        self._cache.clear()
        self.loadedChanged.emit(loaded)

    @property
    def floor_bytes(self) -> int:
        return self.loaded.simulator.floor_bytes

    @property
    def baseline_bytes(self) -> int:
        return self.loaded.simulator.baseline_peak

    # -- plans -----------------------------------------------------------------------------------------------
    def set_budget(self, budget: int) -> PlanState | None:
        """Quick plan for ``budget`` from the trajectory now; the full plan follows through ``planChanged``.

        Other solvers than μ-TWO plan from scratch in the background; their plan arrives only there.
        """
        loaded = self.loaded
        if self.solver != "mutwo":
            self._pending_step = None
            self.plan_runner.submit(partial(solver_plan, loaded, budget, self.solver))
            return None
        traj = loaded.trajectory
        j = traj.step_for_budget(budget)
        feasible = j is not None
        if j is None:
            j = int(np.argmin([s.simulated_peak_bytes for s in traj.steps]))
        step = traj.steps[j]
        recomputed = [s.activation for s in traj.steps[1:j + 1]]
        reason = (BASELINE_FITS if j == 0 else BUDGET_MET) if feasible else traj.stop_reason
        quick = dataclasses.replace(loaded.template, recomputed=recomputed, budget_bytes=budget)
        state = PlanState(solver="mutwo", budget=budget, step=j, recomputed=recomputed,
                          peak_bytes=step.simulated_peak_bytes, peak_node=step.predicted_peak_node,
                          extra_ms=step.extra_ms, feasible=feasible, stop_reason=reason,
                          decisions=quick.decisions(loaded.profile))
        hit = self._cache.get(j)
        if hit is not None:
            self._cache.move_to_end(j)
            self._complete(state, *hit)
            self.plan_runner.cancel()
        else:
            self._pending_step = j
            self.plan_runner.submit(partial(full_plan, loaded, budget))
        self.state = state
        self.planChanged.emit(state)
        return state

    def set_plan(self, plan: Plan) -> None:
        """Show a plan from a file (or another solver); its timeline is simulated in the background."""
        plan.check_profile(self.loaded.profile)
        self.solver = plan.solver
        self.state = self._state_of(plan)
        self._pending_step = None
        self.plan_runner.submit(partial(simulate_plan, self.loaded, plan))
        self.planChanged.emit(self.state)

    def _state_of(self, plan: Plan) -> PlanState:
        return PlanState(solver=plan.solver, budget=plan.budget_bytes, step=None, recomputed=list(plan.recomputed),
                         peak_bytes=plan.predicted_peak_bytes, peak_node=plan.predicted_peak_node,
                         extra_ms=plan.predicted_extra_ms, feasible=plan.feasible, stop_reason=plan.stop_reason,
                         plan=plan, decisions=plan.decisions(self.loaded.profile))

    def _complete(self, state: PlanState, plan: Plan, sim: SimResult) -> None:
        state.plan, state.sim = plan, sim
        state.peak_bytes, state.peak_node = plan.predicted_peak_bytes, plan.predicted_peak_node
        state.extra_ms, state.feasible, state.stop_reason = plan.predicted_extra_ms, plan.feasible, plan.stop_reason

    def _on_full_plan(self, result: tuple[Plan, SimResult]) -> None:
        plan, sim = result
        if self._pending_step is not None:
            self._cache[self._pending_step] = (plan, sim)
            while len(self._cache) > CACHE_STEPS:
                self._cache.popitem(last=False)
        state = self.state
        if state is None or state.solver != plan.solver or state.recomputed != list(plan.recomputed):
            state = self.state = self._state_of(plan)
        self._complete(state, plan, sim)
        self.planChanged.emit(state)

    # -- selection -------------------------------------------------------------------------------------------
    def select(self, node_id: str) -> None:
        if self.loaded is None or node_id not in self.loaded.profile.node_index or node_id == self.selected:
            return
        self.selected = node_id
        self.selectionChanged.emit(node_id)

    # -- derived views ---------------------------------------------------------------------------------------
    def graph_decisions(self, state: PlanState) -> Decisions:
        """Per-node arrays for the graph colours (replay marks only once the full plan is there)."""
        loaded = self.loaded
        n = len(loaded.profile.nodes)
        index = loaded.profile.node_index
        act_ids = list(loaded.table.index)
        recomputed = np.array([state.decisions.get(a) == "recompute" for a in act_ids], dtype=bool)
        rec = np.bincount(loaded.act_node[recomputed], weights=loaded.act_bytes[recomputed], minlength=n)
        ret = np.bincount(loaded.act_node[~recomputed], weights=loaded.act_bytes[~recomputed], minlength=n)
        replayed = np.zeros(n)
        inserted = np.zeros(n)
        if state.plan is not None:
            for e in state.plan.schedule:
                replayed[[index[r] for r in e.replay]] = 1
                inserted[index[e.recompute_before]] += 1
        return Decisions(recomputed_bytes=rec, retained_bytes=ret, replayed=replayed, inserted=inserted)

    def table_columns(self, state: PlanState) -> dict[str, list]:
        """The activation table's plan columns for ``state``."""
        order = {a: k + 1 for k, a in enumerate(state.recomputed)}
        entries = {e.activation: e for e in state.plan.schedule} if state.plan is not None else {}
        cols: dict[str, list] = {c: [] for c in TABLE_PLAN_COLUMNS}
        for a in self.loaded.table.index:
            decision, _, why = state.decisions.get(a, "").partition(": ")
            e = entries.get(a)
            if decision == "recompute":
                why = "freed after forward, recomputed before its first backward use"
            elif decision == "retain":
                why = "kept: the budget was met before μ-TWO reached it" if state.solver == "mutwo" else "kept"
            cols["decision"].append(decision)
            cols["why"].append(why)
            cols["step"].append(order.get(a, float("nan")))
            cols["sources"].append(" ".join(e.sources) if e else "")
            cols["replay_nodes"].append(len(e.replay) if e else float("nan"))
            cols["recompute_ms"].append(e.recompute_ms if e else float("nan"))
            cols["ratio"].append(e.ratio if e else float("nan"))
        return cols

    def shutdown(self) -> None:
        self.plan_runner.shutdown()
