"""The app's one model, without Qt, and each view bound to it (napari's way: change the model, check the widget).

The session runs its jobs inline here, so every budget change is answered before the call returns and the
solver calls can be counted.
"""

import dataclasses
import itertools
from pathlib import Path

import numpy as np
import pytest

from acstudio.plan import schedule, solvers
from acstudio.plan.solvers.mutwo import Trajectory
from acstudio.profile.model import HostLink, Profile
from acstudio.views.documents import prepare
from acstudio.views.session import InlineJobs, Session

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


def test_the_inspector_shows_a_nodes_device_time_where_the_profile_measured_it(qtbot, session, loaded):
    from acstudio.gui.inspector import Inspector

    inspector = Inspector(session)
    qtbot.addWidget(inspector)
    session.set_loaded(loaded)
    node = max(loaded.profile.nodes, key=lambda n: n.run_time_ms)
    session.select(node.id)
    assert "run time" in inspector.toPlainText() and "device time" not in inspector.toPlainText()
    times = [0.25 * n.run_time_ms for n in loaded.profile.nodes]
    session.set_loaded(prepare(dataclasses.replace(loaded.profile, node_device_ms=times), "gpu.json.gz"))
    session.select(node.id)
    assert f"device time {0.25 * node.run_time_ms:.3f} ms" in " ".join(inspector.toPlainText().split())


# -- offload: a third decision where the profile's device has a host link ------------------------------------

def on_gpu(profile: Profile, link: HostLink | None) -> Profile:
    """The profile as if measured on a GPU with ``link`` (a CPU profile plans no offload: its device memory is the
    host's)."""
    return dataclasses.replace(profile, environment={**profile.environment, "device_type": "cuda"}, host_link=link)


MEASURED_LINK = HostLink(d2h_gb_s=55.0, h2d_gb_s=54.0, duplex_gb_s=49.0, host_free_bytes=64 * 2**30)


@pytest.fixture(scope="module")
def gpu_loaded():
    return prepare(on_gpu(Profile.load(SAMPLE), MEASURED_LINK), "gpu.json.gz")


def test_the_resting_plan_offloads_on_a_gpu_and_never_on_a_cpu(loaded, gpu_loaded):
    gpu, cpu = Session(), Session()
    seen = recorder(gpu)
    gpu.set_loaded(gpu_loaded)
    cpu.set_loaded(loaded)
    assert gpu.budget == cpu.budget  # the same graph and budget: only the device differs
    # the slider's preview is a lookup among plans made once: at opening μ-TWO's trajectory, which recomputes only
    # (the plans that offload are made once the first plan is on show); the resting plan weighs offload for this
    # very budget
    preview, rested = seen["plan"]
    assert not preview.complete and not preview.plan.offloaded and preview.plan.predicted_peak_bytes <= gpu.budget
    assert gpu.offload_preview.plans and cpu.offload_preview is None
    plan, sim = rested.plan, rested.sim
    assert plan.predicted_extra_ms <= preview.plan.predicted_extra_ms
    assert plan.offloaded and plan.feasible and plan.copies_hidden
    recompute_only = gpu_loaded.trajectory.best_plan_for_budget(gpu.budget)
    assert plan.predicted_extra_ms < recompute_only.predicted_extra_ms  # the offload plan won: faster, and fits
    # the simulated step is the plan's: its copies move what the plan says
    ids = [a.id for a in gpu_loaded.profile.activations]
    assert sorted(plan.offloaded) == sorted(ids[k] for k in sim.offload.offloaded)
    assert sim.offload.moved_bytes == plan.offload_bytes and sim.peak_bytes == plan.predicted_peak_bytes
    assert not cpu.state.plan.offloaded and cpu.state.sim.offload is None
    # a span shows an offloaded activation as gone from the device between the end of its copy out and the copy back
    j = int(np.argmax(sim.offload.prefetch - sim.offload.release))
    gone, back = int(sim.offload.release[j]), int(sim.offload.prefetch[j])
    gpu.select_span(gone, back - 1)
    assert not gpu.span_activations[sim.offload.offloaded[j]]
    gpu.select_span(back, back)
    assert gpu.span_activations[sim.offload.offloaded[j]]


def test_table_and_graph_colour_offloaded_activations(qtbot, gpu_loaded):
    from PySide6.QtCore import Qt
    from PySide6.QtWidgets import QLabel

    from acstudio.gui.activation_table import ActivationTable
    from acstudio.gui.graph_view import OFFLOADED, GraphView

    session = Session()
    table, graph = ActivationTable(session), GraphView(session)
    qtbot.addWidget(table)
    qtbot.addWidget(graph)
    session.set_loaded(gpu_loaded)
    plan = session.state.plan
    column = table.model.columns.index("decision")
    for act in plan.offloaded:
        row = table.model.row_of(act)
        assert table.model.value(row, "decision") == "offload"
        assert table.model.data(table.model.index(row, column), Qt.ItemDataRole.ForegroundRole) == OFFLOADED
    assert sum(table.model.value(r, "decision") == "offload" for r in range(table.model.rowCount())) \
        == len(plan.offloaded)
    assert any("offloaded to host" in label.text() for label in graph.findChildren(QLabel))  # the legend
    # the op that makes the largest offloaded activation, opened in place: its box is the offload colour
    biggest = max(plan.offloaded, key=lambda a: plan.activation_bytes[a])
    node = gpu_loaded.profile.activation_by_id[biggest].created_at
    session.select(node, biggest)
    qtbot.waitUntil(lambda: graph._item_index(node) >= 0 and graph.view.items[graph._item_index(node)].key == node,
                    timeout=10_000)
    colour = graph.box_colour(node)
    assert colour.green() > colour.red() and colour.green() > colour.blue()
    graph.shutdown()


def test_box_fills_mix_kept_recomputed_and_offloaded_by_bytes():
    from acstudio.gui.graph_view import OFFLOADED, RECOMPUTED, RETAINED, box_fills

    # as many bytes in every box that has some (fewer would be drawn lighter)
    rec, ret, off = (np.array(v, dtype=float) for v in ([0, 0, 0, 1], [2, 0, 0, 1], [0, 0, 2, 0]))
    fills = box_fills(rec, ret, np.zeros(4), np.full((4, 3), 200), off)
    rgb = [(c.red(), c.green(), c.blue()) for c in (RETAINED, RECOMPUTED, OFFLOADED)]
    assert fills[0].tolist() == list(rgb[0]) and fills[2].tolist() == list(rgb[2])  # all bytes one way: full colour
    assert fills[1].tolist() == [200, 200, 200]  # nothing there: its region's colour
    assert fills[3].tolist() == [round((a + b) / 2) for a, b in zip(rgb[0], rgb[1])]  # half kept, half recomputed


def test_timeline_draws_the_copy_lanes_and_host_memory_of_the_simulated_step(qtbot, loaded, gpu_loaded):
    from acstudio.gui.timeline import GIB, TimelineView
    from acstudio.views.timeline import COPIED_BACK, ON_HOST, copy_spans

    session = Session()
    timeline = TimelineView(session)
    qtbot.addWidget(timeline)
    session.set_loaded(gpu_loaded)
    assert timeline.lanes_plot.isVisibleTo(timeline) and timeline.host_plot.isVisibleTo(timeline)
    offload, sim = session.state.sim.offload, gpu_loaded.simulator
    d2h, h2d = copy_spans(timeline.axis, session.state.sim)
    for lane, spans in (("d2h", d2h), ("h2d", h2d)):
        bars = timeline.copy_bars[lane].opts
        assert len(bars["x0"]) == len(offload.offloaded)
        assert np.array_equal(bars["x0"], spans[:, 0]) and np.array_equal(bars["x1"], spans[:, 1])
    edges = timeline.axis.edges
    # a copy out starts once its activation is written; a copy back lands by its first backward use (they hide)
    assert (d2h[:, 0] >= edges[offload.ready + 1] - 1e-9).all() and (d2h[:, 1] > d2h[:, 0]).all()
    assert (h2d[:, 1] <= edges[offload.first_bw] + 1e-9).all() and (h2d[:, 0] >= d2h[:, 1] - 1e-9).all()
    assert np.array_equal(timeline.host_bytes, offload.host_memory(sim))
    assert 0 < timeline.host_bytes.max() <= offload.host_bytes
    _x, y = timeline.host_curve.getOriginalDataset()
    assert y.max() == pytest.approx(timeline.host_bytes.max() / GIB)
    # an offloaded activation's lifetime: gone from the device once its copy out ends, back from the copy back
    j = int(np.argmax(offload.bytes))
    act = gpu_loaded.profile.activations[offload.offloaded[j]]
    session.select(act.created_at, act.id)
    marks = dict(timeline.lifetime)
    assert marks[ON_HOST] == offload.release[j] and marks[COPIED_BACK] == offload.prefetch[j]
    # hovering a node names when it runs in the simulated step
    from PySide6.QtCore import QPointF

    from acstudio.views.timeline import node_time_text

    i = int(offload.first_bw[j])
    x = (timeline.axis.edges[i] + timeline.axis.edges[i + 1]) / 2
    timeline._on_hover((timeline.plot.getPlotItem().vb.mapViewToScene(QPointF(x, 0.0)),))
    assert timeline.plot.toolTip().endswith(node_time_text(session.state.sim, i))
    # the other axis draws the same copies there
    timeline.axis_choice.setCurrentIndex(1 - timeline.axis_choice.currentIndex())
    assert np.array_equal(timeline.copy_bars["d2h"].opts["x0"],
                          copy_spans(timeline.axis, session.state.sim)[0][:, 0])
    # a plan that offloads nothing empties the lanes; a CPU profile has none
    session.set_budget(session.baseline_bytes)
    assert len(timeline.copy_bars["d2h"].opts["x0"]) == 0 and not timeline.host_bytes.size
    session.set_loaded(loaded)
    assert not timeline.lanes_plot.isVisibleTo(timeline) and not timeline.host_plot.isVisibleTo(timeline)


def test_inspector_names_the_bytes_moved_whether_copies_hide_and_the_link(qtbot, gpu_loaded):
    from acstudio.gui.inspector import Inspector
    from acstudio.units import format_bytes
    from acstudio.views.offload import link_note, plan_offload_text

    session = Session()
    inspector = Inspector(session)
    qtbot.addWidget(inspector)
    session.set_loaded(gpu_loaded)
    plan = session.state.plan
    qtbot.waitUntil(lambda: "This plan" in inspector.toPlainText(), timeout=5_000)
    text = inspector.toPlainText()
    assert f"{format_bytes(plan.offload_bytes)} cross the link each way" in text
    assert "copies hide behind compute" in text
    assert "55.0 GB/s" in text and "54.0 GB/s" in text and "49.0 GB/s" in text and "64.00 GiB" in text
    assert "default" not in text
    stalled = dataclasses.replace(plan, offload_stall_ms=1.5)
    assert plan_offload_text(stalled).endswith("the copies stall the step by 1.50 ms")
    # an offloaded activation's node says when its copies run
    act = gpu_loaded.profile.activation_by_id[plan.offloaded[0]]
    session.select(act.created_at, act.id)
    assert "to the host" in inspector.toPlainText() and "back to the device" in inspector.toPlainText()
    # a GPU profile without a measured link (the bundled samples) is priced with the stated default, and says so
    unmeasured = prepare(on_gpu(gpu_loaded.profile, None), "unmeasured.json.gz")
    session.set_loaded(unmeasured)
    text = inspector.toPlainText()
    assert "(default)" in text and link_note(unmeasured.profile)[1:40] in text


class HeldJobs(InlineJobs):
    """Jobs that wait until the test lets them run: the session's preview stays on show until then."""

    def __init__(self) -> None:
        self.held: list = []

    def submit(self, name, fn, on_result, on_error, delay_ms=0) -> None:
        self.held = [(fn, on_result, on_error)]  # a newer job supersedes the one waiting

    def run(self) -> None:
        held, self.held = self.held, []
        for fn, on_result, on_error in held:
            super().submit("", fn, on_result, on_error)


def test_the_preview_says_it_is_recompute_only_or_reuses_a_plan_that_offloads(qtbot, loaded, gpu_loaded):
    from acstudio.gui.budget_panel import BudgetPanel
    from acstudio.views.session import PREVIEW_RECOMPUTE_ONLY

    jobs = HeldJobs()
    session = Session(jobs)
    panel = BudgetPanel(session, ("auto", "mutwo"))
    qtbot.addWidget(panel)
    session.set_loaded(gpu_loaded)
    # the slider's instant answer is the trajectory's, which recomputes only: the panel says so
    preview = session.state
    assert not preview.complete and not preview.plan.offloaded and preview.note == PREVIEW_RECOMPUTE_ONLY
    assert panel.preview_label.text() == PREVIEW_RECOMPUTE_ONLY
    jobs.run()
    rested = session.state
    assert rested.complete and rested.plan.offloaded and rested.note == "" and panel.preview_label.text() == ""
    assert rested.plan.predicted_extra_ms < preview.plan.predicted_extra_ms
    # a looser budget: the plan made for the tighter one fits it too and beats the trajectory's, so it is the
    # preview (offload included), named as such, until this budget's own plan is made
    looser = (rested.plan.predicted_peak_bytes + session.baseline_bytes) // 2
    trajectory_plan = gpu_loaded.trajectory.plan_for_budget(looser)
    assert trajectory_plan.predicted_extra_ms > rested.plan.predicted_extra_ms
    session.set_budget(looser)
    reused = session.state
    assert not reused.complete and reused.plan.offloaded == rested.plan.offloaded
    assert reused.plan.budget_bytes == looser and reused.plan.predicted_peak_bytes <= looser
    assert reused.plan.predicted_extra_ms == rested.plan.predicted_extra_ms
    assert reused.decisions == rested.decisions
    assert reused.note.startswith("preview: the plan made for") and panel.preview_label.text() == reused.note
    assert panel.extra_label.text().startswith(f"{rested.plan.predicted_extra_ms:.2f} ms")
    jobs.run()
    assert session.state.complete and panel.preview_label.text() == ""
    assert session.state.plan.predicted_extra_ms <= rested.plan.predicted_extra_ms
    # a tighter budget than any plan made so far: back to the trajectory's, recompute only
    session.set_budget(session.floor_bytes + (rested.plan.budget_bytes - session.floor_bytes) // 2)
    assert not session.state.plan.offloaded and panel.preview_label.text() == PREVIEW_RECOMPUTE_ONLY
    # nothing to say where the plan will not offload: the baseline fits, or the profile cannot offload
    session.set_budget(session.baseline_bytes)
    assert not session.state.complete and session.state.note == "" and panel.preview_label.text() == ""
    session.set_loaded(loaded)
    assert not session.state.complete and session.state.note == "" and panel.preview_label.text() == ""


class PreviewFirstJobs(HeldJobs):
    """Held jobs, but the offload preview (made once per profile, in the background in the app) runs at once."""

    def submit(self, name, fn, on_result, on_error, delay_ms=0) -> None:
        from acstudio.views.session import OFFLOAD_PREVIEW_JOB

        if name == OFFLOAD_PREVIEW_JOB:
            InlineJobs.submit(self, name, fn, on_result, on_error)
        else:
            super().submit(name, fn, on_result, on_error, delay_ms)


def test_a_slider_step_previews_offload_by_lookup_where_the_resting_plan_offloads(qtbot, monkeypatch, gpu_loaded,
                                                                                  counted):
    from acstudio.gui.budget_panel import BudgetPanel
    from acstudio.plan.solvers import mutwo
    from acstudio.views import session as session_module

    jobs = PreviewFirstJobs()
    session = Session(jobs)
    panel = BudgetPanel(session, ("auto", "mutwo"))
    qtbot.addWidget(panel)
    session.set_loaded(gpu_loaded)
    assert session.offload_preview is None  # made once the first plan is on show
    jobs.run()
    front = session.offload_preview.plans
    assert front and all(plan.offloaded for plan in front)
    # a Pareto front: each looser plan is faster, so the fastest plan that fits a budget is the loosest that fits
    assert all(a.predicted_peak_bytes < b.predicted_peak_bytes and a.predicted_extra_ms > b.predicted_extra_ms
               for a, b in itertools.pairwise(front))
    # from here on, count every planning call: a slider step makes none
    def counting(name, make):
        def made(*args, **kwargs):
            counted.append(name)
            return make(*args, **kwargs)
        return made

    for name in ("offload_plan", "offload_onto", "offload_greedy", "offload_preview", "run_trajectory"):
        for module in (mutwo, session_module):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, counting(name, getattr(module, name)))
    floor, top = session.floor_bytes, session.baseline_bytes
    offloading = 0
    for budget in np.linspace(floor, top, 9)[1:-1].astype(int) + 1:  # budgets not planned yet
        counted.clear()
        session.set_budget(int(budget))
        preview = session.state
        assert counted == [] and not preview.complete  # a lookup: nothing planned or simulated
        recompute_only = gpu_loaded.trajectory.plan_for_budget(int(budget))
        assert preview.plan.predicted_extra_ms <= recompute_only.predicted_extra_ms  # never slower
        assert preview.plan.budget_bytes == budget
        jobs.run()
        rested = session.state
        assert rested.complete and panel.preview_label.text() == ""
        if rested.plan.offloaded and not preview.note.startswith("preview: the plan made for"):
            offloading += 1
            assert preview.plan.offloaded and preview.plan.feasible
            assert preview.plan.predicted_peak_bytes <= budget
            assert preview.note.startswith("preview: a precomputed plan that peaks at")
            assert f"offloads {len(preview.plan.offloaded)} activations" in preview.note
            assert rested.plan.predicted_extra_ms <= preview.plan.predicted_extra_ms
    assert offloading  # the profile's resting plans offload, and so did their previews



def test_offload_plans_of_a_profile_no_longer_open_are_dropped(loaded, gpu_loaded):
    from acstudio.views.session import OFFLOAD_PREVIEW_JOB

    session = Session(HeldJobs())
    asked: list[tuple[str, object]] = []  # (job name, what takes its answer)
    session.jobs.submit = lambda name, fn, on_result, on_error, delay_ms=0: asked.append((name, on_result))
    session.set_loaded(loaded)  # a CPU profile: nothing offloads, so no offload plans are asked for
    asked[0][1]((loaded.trajectory.plan_for_budget(session.budget), None))  # not even once its first plan is in
    assert [name for name, _ in asked] == ["plan"]
    session.set_loaded(gpu_loaded)
    assert [name for name, _ in asked[1:]] == ["plan"]  # the offload plans wait for the first plan
    asked[1][1]((gpu_loaded.trajectory.plan_for_budget(session.budget), None))
    assert [name for name, _ in asked[1:]] == ["plan", OFFLOAD_PREVIEW_JOB]
    session.set_loaded(loaded)
    asked[2][1](object())  # the GPU profile's offload plans arrive after another profile opened: dropped
    assert session.offload_preview is None


def test_the_offload_preview_starts_after_the_first_plan_and_is_then_looked_up(qtbot, gpu_loaded):
    """In the app the jobs run in threads: the plans that offload are made only once the profile's first plan is on
    show (beside it, they would share the cores and that plan would come late); until then a slider step previews
    recompute-only and says so, and once they arrive the preview on show is looked up again, with them."""
    import threading

    from acstudio.gui.budget_panel import BudgetPanel
    from acstudio.gui.jobs import QtJobs
    from acstudio.views.session import OFFLOAD_PREVIEW_JOB, PREVIEW_RECOMPUTE_ONLY

    log: list[tuple[str, str]] = []  # ("submit" | "start" | "end", job name), and ("shown", "complete plan")
    # the offload preview, and every plan after the first, wait until the test lets them run
    gates = {OFFLOAD_PREVIEW_JOB: threading.Event(), "plan": threading.Event()}

    class LoggedJobs(QtJobs):
        def submit(self, name, fn, on_result, on_error, delay_ms=0):
            gate = gates[name] if name == OFFLOAD_PREVIEW_JOB or ("submit", name) in log else None

            def logged(progress, cancel):
                log.append(("start", name))
                if gate is not None:
                    gate.wait(30)
                try:
                    return fn(progress, cancel)
                finally:
                    log.append(("end", name))

            log.append(("submit", name))
            super().submit(name, logged, on_result, on_error, delay_ms)

    session = Session(LoggedJobs())
    panel = BudgetPanel(session, ("auto", "mutwo"))
    qtbot.addWidget(panel)
    session.events.plan.connect(lambda state: state.complete and log.append(("shown", "complete plan")))
    try:
        session.set_loaded(gpu_loaded)
        qtbot.waitUntil(lambda: ("start", OFFLOAD_PREVIEW_JOB) in log, timeout=30_000)
        # the first plan was made alone and shown before the offload preview was even asked for
        assert log == [("submit", "plan"), ("start", "plan"), ("end", "plan"), ("shown", "complete plan"),
                       ("submit", OFFLOAD_PREVIEW_JOB), ("start", OFFLOAD_PREVIEW_JOB)]
        assert session.state.plan.offloaded  # the resting plan weighed offload all the same
        # while the offload plans are being made, a slider step previews the trajectory's plan and says so
        near_floor = session.floor_bytes + 1
        session.set_budget(near_floor)
        recompute_only = session.state
        assert not recompute_only.plan.offloaded and recompute_only.note == PREVIEW_RECOMPUTE_ONLY
        assert panel.preview_label.text() == PREVIEW_RECOMPUTE_ONLY
        qtbot.waitUntil(lambda: log.count(("start", "plan")) == 2, timeout=30_000)  # this budget's plan waits
        gates[OFFLOAD_PREVIEW_JOB].set()
        qtbot.waitUntil(lambda: session.offload_preview is not None, timeout=30_000)
        # the preview on show is looked up again: a precomputed plan that offloads, fits and is faster
        looked_up = session.state
        assert not looked_up.complete and looked_up.plan.offloaded
        assert looked_up.plan.predicted_peak_bytes <= near_floor
        assert looked_up.plan.predicted_extra_ms < recompute_only.plan.predicted_extra_ms
        assert looked_up.note.startswith("preview: a precomputed plan") and panel.preview_label.text() == looked_up.note
        gates["plan"].set()
        qtbot.waitUntil(lambda: session.state.complete, timeout=30_000)
        assert session.state.plan.predicted_extra_ms <= looked_up.plan.predicted_extra_ms
        assert panel.preview_label.text() == ""
    finally:
        for gate in gates.values():
            gate.set()
        session.shutdown()


def test_the_preview_says_recompute_only_exactly_where_no_plan_that_offloads_fits_and_is_faster(qtbot, gpu_loaded):
    """Below the first budget the offload preview planned for, its plan for that budget (which peaks lower) still
    answers; the label says "recompute only" only where no plan that offloads (precomputed, or made before) fits
    and beats the trajectory's: on the transformer samples, below the preview's lowest peak, some way above the
    floor (here: the same preview without its lowest plan)."""
    from acstudio.gui.budget_panel import BudgetPanel
    from acstudio.plan.solvers.mutwo import OffloadPreview
    from acstudio.views.session import PREVIEW_RECOMPUTE_ONLY

    jobs = HeldJobs()
    session = Session(jobs)
    panel = BudgetPanel(session, ("auto", "mutwo"))
    qtbot.addWidget(panel)
    session.set_loaded(gpu_loaded)
    jobs.run()  # the first plan, which asks for the offload preview
    rested = session.state.plan
    jobs.run()
    front = session.offload_preview.plans
    floor, top = session.floor_bytes, session.baseline_bytes
    first = min(plan.budget_bytes for plan in front)
    assert floor <= first and front[0].predicted_peak_bytes <= first  # the lowest target is the floor itself
    budgets = [(floor + first) // 2, *np.linspace(floor, top, 24).astype(int)[:-1].tolist()]
    recompute_only = []
    for precomputed in (front, front[1:]):
        session.offload_preview = OffloadPreview(precomputed)
        for budget in budgets:
            session.set_budget(budget)
            state, trajectory_plan = session.state, gpu_loaded.trajectory.plan_for_budget(budget)
            assert not state.complete and panel.preview_label.text() == state.note
            fitting = [plan for plan in (rested, *precomputed)  # the plan made before wins a tie, as in the session
                       if plan.predicted_peak_bytes <= budget
                       and plan.predicted_extra_ms < trajectory_plan.predicted_extra_ms]
            if not fitting:
                assert state.note == PREVIEW_RECOMPUTE_ONLY and state.plan == trajectory_plan
                recompute_only.append(budget)
                continue
            fastest = min(fitting, key=lambda plan: plan.predicted_extra_ms)
            made = "the plan made for" if fastest is rested else "a precomputed plan"
            assert state.note.startswith(f"preview: {made}") and state.plan.offloaded == fastest.offloaded
            assert state.plan.predicted_extra_ms == fastest.predicted_extra_ms and state.plan.budget_bytes == budget
        if precomputed is front:  # below the first precomputed budget, its plan answers
            assert not recompute_only
    assert recompute_only and max(recompute_only) < front[1].predicted_peak_bytes


def test_a_job_that_gives_way_waits_while_an_urgent_one_runs_and_still_stops_when_cancelled():
    """The session's offload preview gives way to its plan jobs: threads share one interpreter, and beside it the
    plan the user waits for took up to twice as long (results/gui/offload_preview_cpu.txt)."""
    import threading

    from acstudio.errors import Cancelled
    from acstudio.jobs import CancelToken, Precedence, check

    precedence = Precedence()
    urgent_runs, release, steps = threading.Event(), threading.Event(), []

    def urgent(progress, cancel):
        urgent_runs.set()
        release.wait(10)
        steps.append("urgent done")

    def background(progress, cancel):
        for i in range(3):
            check(cancel)
            steps.append(f"background {i}")
        return "made"

    def in_thread(fn, cancel=None):
        results: list = []

        def run():
            try:
                results.append(fn(None, cancel))
            except Cancelled as exc:
                results.append(exc)
        thread = threading.Thread(target=run)
        thread.start()
        return thread, results

    waited, _ = in_thread(precedence.urgent(urgent))
    assert urgent_runs.wait(10)
    gives_way, made = in_thread(precedence.giving_way(background))
    gives_way.join(0.5)
    assert gives_way.is_alive() and steps == []  # waiting at its first check
    release.set()
    waited.join(10)
    gives_way.join(10)
    assert steps == ["urgent done", "background 0", "background 1", "background 2"] and made == ["made"]
    # alone it does not wait; cancelled while it waits, it stops
    assert in_thread(precedence.giving_way(background))[0].join(10) is None and steps.count("background 0") == 2
    urgent_runs.clear()
    release.clear()
    waited, _ = in_thread(precedence.urgent(urgent))
    assert urgent_runs.wait(10)
    token = CancelToken()
    gives_way, made = in_thread(precedence.giving_way(background), token)
    token.cancel()
    gives_way.join(10)
    assert not gives_way.is_alive() and isinstance(made[0], Cancelled) and steps.count("background 0") == 2
    release.set()
    waited.join(10)


def test_slider_steps_that_set_and_clear_the_notes_do_not_resize_the_chart(qtbot, gpu_loaded):
    """Each slider step shows a preview with a note, then the resting plan without one; the status rewords itself.
    The chart below them keeps its size (a resized chart redraws whole: most of a step's time)."""
    from PySide6.QtWidgets import QApplication

    from acstudio.gui.budget_panel import BudgetPanel
    from acstudio.plan.solvers.mutwo import offload_preview

    jobs = HeldJobs()
    session = Session(jobs)
    panel = BudgetPanel(session, ("auto", "mutwo"))
    qtbot.addWidget(panel)
    panel.resize(400, 1000)  # the app's panel width
    panel.show()
    session.set_loaded(gpu_loaded)
    jobs.run()
    session.offload_preview = offload_preview(gpu_loaded.ctx)  # the long note: a precomputed plan that offloads
    QApplication.processEvents()
    height, notes, statuses = panel.pareto.height(), set(), set()
    floor, top = session.floor_bytes, session.baseline_bytes
    for budget in np.linspace(floor, top, 8)[1:-1].astype(int):
        session.set_budget(int(budget))
        QApplication.processEvents()
        notes.add(panel.preview_label.text())
        assert panel.pareto.height() == height
        jobs.run()
        QApplication.processEvents()
        assert panel.preview_label.text() == "" and panel.pareto.height() == height
        statuses.add(panel.status_label.text())
    assert any(note.startswith("preview: a precomputed plan") for note in notes) and len(statuses) > 2
