"""The app's one model, without Qt, and each view bound to it (napari's way: change the model, check the widget).

The session runs its jobs inline here, so every budget change is answered before the call returns and the
solver calls can be counted.
"""

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from acstudio.plan import schedule, solvers
from acstudio.plan.solvers.mutwo import Trajectory
from acstudio.profile.model import Profile
from acstudio.views.documents import prepare
from acstudio.views.session import Session

SAMPLE = Path(__file__).resolve().parents[1] / "sample_profiles" / "cpu_resnet18_bs16_sgd.json.gz"


@pytest.fixture(scope="module")
def loaded():
    return prepare(Profile.load(SAMPLE), str(SAMPLE))


@pytest.fixture
def counted(monkeypatch):
    """The plans the session makes: a solver's by its name (not the plans ``auto`` asks of the others), μ-TWO's
    best plan for a budget as ``"mutwo-best"``; and its simulations, as ``"simulate"``."""
    calls: list[str] = []
    depth = [0]

    def counting(name, make):
        def made(*args, **kwargs):
            if not depth[0]:
                calls.append(name)
            depth[0] += 1
            try:
                return make(*args, **kwargs)
            finally:
                depth[0] -= 1
        return made

    for name, record in list(solvers.SOLVERS.items()):
        monkeypatch.setitem(solvers.SOLVERS, name, dataclasses.replace(record, solve=counting(name, record.solve)))
    monkeypatch.setattr(Trajectory, "best_plan_for_budget", counting("mutwo-best", Trajectory.best_plan_for_budget))

    def simulate_plan(*args, _simulate=schedule.simulate_plan):
        calls.append("simulate")
        return _simulate(*args)

    monkeypatch.setattr(schedule, "simulate_plan", simulate_plan)
    return calls


def recorder(session: Session) -> dict[str, list]:
    seen: dict[str, list] = {"budget": [], "solver": [], "plan": [], "loaded": [], "selection": [], "span": []}
    for name, got in seen.items():
        getattr(session.events, name).connect(lambda *args, _got=got: _got.append(args[0] if len(args) == 1 else args))
    return seen


def test_a_budget_change_plans_once_and_raises_plain_events(loaded, counted):
    session = Session()
    seen = recorder(session)
    session.set_loaded(loaded)
    assert seen["loaded"] == [loaded] and seen["solver"] == ["auto"]
    mid = (session.floor_bytes + session.baseline_bytes) // 2
    assert seen["budget"] == [mid] and counted == ["mutwo-best", "simulate"]
    # the preview (read off μ-TWO's trajectory, not solved) and then the one complete plan, simulated: μ-TWO's best
    # (auto's own answer runs programs for seconds: the chart's auto curve comes from the sweep)
    assert [s.complete for s in seen["plan"]] == [False, True]
    assert session.state.complete and session.state.plan.budget_bytes == mid
    assert session.state.sim.peak_bytes == session.state.plan.predicted_peak_bytes

    counted.clear()
    seen["plan"].clear()
    session.set_budget(session.floor_bytes)
    assert counted == ["mutwo-best", "simulate"]  # planned and simulated once, not again later
    assert [s.complete for s in seen["plan"]] == [False, True]
    # a drag shows its budgets without planning; where it stops is planned once
    counted.clear()
    for budget in np.linspace(session.floor_bytes, session.baseline_bytes, 5).astype(int)[1:]:
        session.set_budget(int(budget), final=False)
    assert counted == [] and session.budget == session.baseline_bytes
    session.set_budget(session.budget)
    session.set_budget(session.budget)  # committing the same budget again is not news
    assert counted == ["mutwo-best", "simulate"]
    # a budget already planned comes back from the cache, complete and without a solver call
    counted.clear()
    seen["plan"].clear()
    session.set_budget(session.floor_bytes)
    assert counted == [] and [s.complete for s in seen["plan"]] == [True]


def test_a_solver_without_a_quick_answer_plans_once_in_the_background(loaded, counted):
    session = Session()
    session.set_loaded(loaded)
    seen = recorder(session)
    planning = []
    session.events.planning.connect(lambda solver, budget: planning.append((solver, budget)))
    counted.clear()
    assert not solvers.SOLVERS["recompute-all"].instant
    session.set_solver("recompute-all")
    assert seen["solver"] == ["recompute-all"] and counted == ["recompute-all", "simulate"]
    assert planning == [("recompute-all", session.budget)]
    assert [s.complete for s in seen["plan"]] == [True]  # no preview: the one plan, complete
    assert session.state.plan.solver == "recompute-all"


def test_selection_and_span_are_events_of_the_session(loaded):
    session = Session()
    session.set_loaded(loaded)
    seen = recorder(session)
    act = max(loaded.profile.activations, key=lambda a: a.bytes)
    session.select(act.created_at)
    session.select(act.created_at)  # the same selection is not news
    assert seen["selection"] == [act.created_at] and session.selected_activation == act.id
    session.select("no such node")
    assert session.selected == act.created_at
    n = len(loaded.profile.nodes)
    session.select_span(n // 3, n // 2)
    assert session.span_activations.any() and len(seen["span"][0]) == 2 * int(session.span_activations.sum())
    session.select_span(1, 0)
    assert not session.span_activations.any()


# -- each view follows the session ---------------------------------------------------------------------------

@pytest.fixture
def session(loaded, qtbot):
    session = Session()
    yield session
    session.shutdown()


def test_budget_panel_follows_the_session_and_writes_the_user_s_moves_to_it(qtbot, session, loaded):
    from acstudio.gui.budget_panel import BudgetPanel
    from acstudio.gui.models import fmt_bytes

    panel = BudgetPanel(session, tuple(solvers.SOLVERS))
    qtbot.addWidget(panel)
    assert not panel.isEnabled()
    session.set_loaded(loaded)
    assert panel.isEnabled() and panel.solver.currentText() == "auto"
    session.set_budget(session.floor_bytes)
    assert panel.slider.value() == 0
    assert panel.peak_label.text() == fmt_bytes(session.state.plan.predicted_peak_bytes)
    session.set_solver("recompute-all")
    assert panel.solver.currentText() == "recompute-all"
    # the user's moves go to the session, never to another view
    panel.solver.setCurrentText("auto")
    assert session.solver == "auto"
    panel.slider.setValue(panel.slider.maximum())
    assert session.budget == session.baseline_bytes  # shown at once ...
    qtbot.waitUntil(lambda: session.state.plan.budget_bytes == session.baseline_bytes, timeout=5_000)  # planned


def test_timeline_follows_budget_plan_and_selection(qtbot, session, loaded):
    from acstudio.gui.timeline import TimelineView

    timeline = TimelineView(session)
    qtbot.addWidget(timeline)
    session.set_loaded(loaded)
    assert timeline.budget_line.value() == pytest.approx(session.budget / 2**30)
    session.set_budget(session.floor_bytes)
    assert timeline.stacked_total().max() == pytest.approx(session.state.sim.peak_bytes, rel=1e-9)
    assert timeline.budget_line.value() == pytest.approx(session.floor_bytes / 2**30)
    act = max(loaded.profile.activations, key=lambda a: a.bytes)
    session.select(act.created_at)
    assert timeline.cursor.isVisible() and dict(timeline.lifetime)["made"] == loaded.profile.node_index[act.created_at]
    # a budget below what the line can show (a plan file's) leaves the line at its bound and the session as it is
    session.set_budget(session.floor_bytes // 2, final=False)
    assert timeline.budget_line.value() == pytest.approx(session.floor_bytes / 2**30)
    assert session.budget == session.floor_bytes // 2
    # a drag of the budget line moves the session's budget to the byte
    target = (session.floor_bytes + session.baseline_bytes) // 2 + 12345
    timeline.budget_line.setValue(target / 2**30)
    assert session.budget == target
    qtbot.waitUntil(lambda: session.state.plan.budget_bytes == target, timeout=5_000)


def test_table_and_inspector_follow_plan_selection_and_span(qtbot, session, loaded):
    from acstudio.gui.activation_table import ActivationTable
    from acstudio.gui.inspector import Inspector

    table, inspector = ActivationTable(session), Inspector(session)
    qtbot.addWidget(table)
    qtbot.addWidget(inspector)
    session.set_loaded(loaded)
    assert table.model.rowCount() == len(loaded.profile.activations)
    assert loaded.profile.label in inspector.toPlainText()
    session.set_budget(session.floor_bytes)
    decisions = {table.model.value(r, "decision") for r in range(table.model.rowCount())}
    assert "recompute" in decisions
    qtbot.waitUntil(lambda: "This plan: peak" in inspector.toPlainText(), timeout=5_000)
    act = max(loaded.profile.activations, key=lambda a: a.bytes)
    session.select(act.created_at)
    assert table.view.selectionModel().selectedRows()[0].data() == act.id
    assert act.created_at in inspector.toPlainText()
    n = len(loaded.profile.nodes)
    session.select_span(n // 3, n // 2)
    assert table.proxy.rowCount() == int(session.span_activations.sum())
    # a row the user picks selects its activation in the session
    other = min(loaded.profile.activations, key=lambda a: a.bytes)
    session.select_span(1, 0)
    table.view.selectRow(table.proxy.mapFromSource(table.model.index(table.model.row_of(other.id), 0)).row())
    assert session.selected_activation == other.id
