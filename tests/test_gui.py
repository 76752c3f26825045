"""The desktop app, offscreen: it loads, plans, profiles in the background, survives bad input and exits cleanly."""

import dataclasses
import gzip
import json
import os
import shutil
import sys
import threading
import time
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY_CNN
from PySide6.QtCore import QSettings, QTimer
from PySide6.QtGui import QImage
from PySide6.QtWidgets import QDockWidget

from acstudio.gui.app import default_profile_path, main, parse_args
from acstudio.gui.dialogs import Messages, NewProfileDialog
from acstudio.gui.jobs import JobRunner
from acstudio.gui.main_window import MainWindow
from acstudio.gui.models import DataFrameModel, FilterProxy, fmt_bytes
from acstudio.gui.qtcompat import make_singletons_immortal
from acstudio.jobs import check
from acstudio.plan.loading import load_plan
from acstudio.profile.model import Profile
from acstudio.profile.vocabulary import REGIONS
from acstudio.units import format_bytes
from acstudio.views import graph_layout as gl
from acstudio.views.child import sweep_in_child
from acstudio.views.documents import export_name, prepare
from acstudio.workload import WorkloadSpec

# Background work shares 2 cores with the test itself on CI, so no wait may rely on pytest-qt's 5 s default.
WAIT_MS = 60_000

make_singletons_immortal()  # PySide6 drops references to None/True on Python 3.11 (see acstudio.gui.qtcompat)

class Recorder(Messages):
    """Collects what would have been message boxes."""

    def __init__(self) -> None:
        super().__init__(None)
        self.errors: list[tuple[str, str]] = []
        self.infos: list[tuple[str, str]] = []

    def error(self, title, message, details=""):
        self.errors.append((title, message))

    def info(self, title, message):
        self.infos.append((title, message))


@pytest.fixture(scope="session")
def factory_ref(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny_cnn.py"
    path.write_text(TINY_CNN)
    return f"{path}:make"


@pytest.fixture(scope="session")
def tiny_profile_path(tmp_path_factory, factory_ref):
    from acstudio.profiler import profile_workload

    profile = profile_workload(WorkloadSpec(factory_ref, batch_size=16, optimizer="sgd"), device="cpu")
    path = tmp_path_factory.mktemp("profiles") / "tiny.json.gz"
    profile.save(path)
    return path


@pytest.fixture
def window(qtbot, tmp_path):
    settings = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
    w = MainWindow(settings=settings, cache_dir=str(tmp_path / "cache"), messages=Recorder(),
                   data_dir=str(tmp_path / "data"))
    qtbot.addWidget(w)
    w.show()
    return w


def wait_loaded(qtbot, w, before, timeout=60_000):
    """Wait until the session holds a profile other than ``before``."""
    qtbot.waitUntil(lambda: w.session.loaded is not None and w.session.loaded is not before, timeout=timeout)


def open_and_wait(qtbot, w, path, timeout=60_000):
    before = w.session.loaded
    w.open_path(str(path))
    wait_loaded(qtbot, w, before, timeout)
    wait_plan(qtbot, w)
    qtbot.waitUntil(lambda: w.graph.view is not None and not w.graph.runner.busy, timeout=timeout)


def wait_plan(qtbot, w, timeout=30_000):
    qtbot.waitUntil(lambda: w.session.state is not None and w.session.state.complete, timeout=timeout)


def slide_to_floor(qtbot, w):
    w.budget.slider.setValue(0)
    qtbot.waitUntil(lambda: w.session.state.plan.budget_bytes == w.session.floor_bytes and w.session.state.complete,
                    timeout=WAIT_MS)


def test_app_starts_on_the_bundled_gpu_sample(qtbot, window):
    path = default_profile_path()
    if path is None:
        pytest.skip("no sample profiles bundled")
    assert path.name.startswith("h200_resnet152_bs64")
    open_and_wait(qtbot, window, path)
    loaded = window.session.loaded
    assert loaded.profile.environment["device_type"] == "cuda"
    # the window opens on a mid budget: between floor and baseline, and the plan meets it
    state = window.session.state
    assert window.session.floor_bytes < state.plan.budget_bytes < window.session.baseline_bytes
    assert state.plan.feasible and state.plan.predicted_peak_bytes <= state.plan.budget_bytes
    # ~7k nodes collapse into a navigable number of boxes: the top-level modules, all readable in the viewport
    graph = window.graph
    assert 10 <= len(graph.view.items) <= 80
    assert window.windowTitle().startswith("AC Studio – resnet152 bs64")
    window.resize(1600, 1000)
    graph.fit_readable()
    assert {"forward/layer1", "forward/layer3", "forward/fc"} <= set(graph.readable_boxes())
    # search names a module: it is selected and centred (as far as the scroll range goes)
    graph.search.setText("layer3")
    graph.search.returnPressed.emit()
    box = graph._boxes[graph._item_index("forward/layer3")]
    viewport = graph.canvas.viewport().rect()
    assert graph._selected == "forward/layer3"
    assert viewport.contains(graph.canvas.mapFromScene(box.rect()).boundingRect())
    assert box.pen().width() == 3
    # a click opens it in place: its 36 blocks inside its frame, which sits where the box was
    graph.canvas.clicked.emit("g:forward/layer3")
    qtbot.waitUntil(lambda: "forward/layer3" in graph.expanded and not graph.runner.busy, timeout=WAIT_MS)
    assert sum(it.key.startswith("forward/layer3/") for it in graph.view.items) == 36
    frame = graph._frames["forward/layer3"].rect()
    assert viewport.contains(graph.canvas.mapFromScene(frame.topLeft()))
    # Fit shows everything there is, and nothing else
    graph.fit()
    shown = graph.canvas.mapToScene(viewport).boundingRect()
    assert shown.contains(graph.scene.itemsBoundingRect().adjusted(1, 1, -1, -1))
    scene = graph.scene.sceneRect()
    assert shown.width() < scene.width() * 1.05 or shown.height() < scene.height() * 1.05
    # the backward pass mirrors it, coloured by the activations its modules use
    graph.direction.setCurrentText("backward")
    qtbot.waitUntil(lambda: graph.regions == ("loss", "backward", "optimizer") and not graph.runner.busy
                    and graph.view.items[0].region in graph.regions, timeout=WAIT_MS)
    assert "backward/layer3" in {it.key for it in graph.view.items}


def test_a_decoder_opens_on_its_blocks_not_on_the_edges_beside_them(qtbot, window):
    """GPT-2's mask feeds every block from a box beside their column, so laid out by graphviz the graph is wider
    than its panel: the launch view shows the column where most ops are, its blocks readable (it showed the mask's
    box alone). The built-in layout, without ``dot``, puts the box in the column: its blocks are readable too."""
    window.resize(1600, 1000)
    samples = Path(__file__).resolve().parents[1] / "sample_profiles"
    open_and_wait(qtbot, window, samples / "h200_gpt2_bs16_adam.json.gz")
    graph = window.graph
    qtbot.waitUntil(lambda: graph.view is not None and not graph.runner.busy, timeout=WAIT_MS)
    graph.fit_readable()
    if graph.layout.engine == "dot":
        assert graph.scene.sceneRect().width() * graph.canvas.transform().m11() > graph.canvas.viewport().width()
    assert {f"forward/transformer/h/{k}" for k in range(4)} <= set(graph.readable_boxes())


def test_main_parses_arguments_and_renders_a_screenshot(qtbot, tmp_path, tiny_profile_path):
    assert parse_args([]) == (None, None)
    assert parse_args(["f.json.gz"]) == (None, "f.json.gz")
    assert parse_args(["--screenshot", "o.png", "f"]) == ("o.png", "f")
    with pytest.raises(ValueError, match="usage"):
        parse_args(["--bogus"])
    out = tmp_path / "shot.png"
    assert main(["--screenshot", str(out), str(tiny_profile_path)]) == 0
    image = QImage(str(out))
    assert (image.width(), image.height()) == (1600, 1000)


def test_slider_changes_plan_timeline_graph_and_table(qtbot, window, tiny_profile_path):
    open_and_wait(qtbot, window, tiny_profile_path)
    session, profile = window.session, window.session.loaded.profile
    assert session.floor_bytes < session.baseline_bytes, "the test model must leave room for checkpointing"

    window.budget.slider.setValue(window.budget.slider.maximum())
    qtbot.waitUntil(lambda: session.state.plan.budget_bytes == session.baseline_bytes and session.state.complete,
                    timeout=WAIT_MS)
    # no checkpointing: the simulated timeline is the measured one and nothing is recomputed
    total = window.timeline.stacked_total()
    np.testing.assert_allclose(total, [n.mem_peak for n in profile.nodes], rtol=1e-9)
    assert session.state.plan.recomputed == []
    keep_colour = {it.key: window.graph.box_colour(it.key).name() for it in window.graph.view.items}

    window.budget.slider.setValue(0)  # down to the floor
    qtbot.waitUntil(lambda: session.state.plan.budget_bytes == session.floor_bytes and session.state.complete,
                    timeout=WAIT_MS)
    state = session.state
    assert state.plan.recomputed and state.plan.feasible
    assert state.plan.predicted_peak_bytes == state.sim.peak_bytes
    # the timeline shows the new plan: its top is the simulated peak, below the baseline
    total = window.timeline.stacked_total()
    assert total.max() == pytest.approx(state.sim.peak_bytes, rel=1e-9)
    assert total.max() < session.baseline_bytes
    # the table's decision column is the plan's decision for each activation
    col = window.table_model.columns.index("decision")
    shown = {window.table_model.data(window.table_model.index(r, 0)): window.table_model.data(
        window.table_model.index(r, col)) for r in range(window.table_model.rowCount())}
    expected = {a: d.partition(":")[0] for a, d in state.plan.decisions(profile).items()}
    assert shown == expected
    # some box changed colour, and the budget labels follow the plan
    assert any(window.graph.box_colour(k).name() != c for k, c in keep_colour.items())
    assert window.budget.peak_label.text() == fmt_bytes(state.plan.predicted_peak_bytes)
    assert window.timeline.budget_line.value() == pytest.approx(session.floor_bytes / 2**30)


def test_budget_line_drag_moves_slider_and_plans_for_the_exact_bytes(qtbot, window, tiny_profile_path):
    open_and_wait(qtbot, window, tiny_profile_path)
    session = window.session
    target = (session.floor_bytes * 3 + session.baseline_bytes) // 4 + 12345  # between two slider steps
    window.timeline.budget_line.setValue(target / 2**30)  # what a drag does
    exact = round(target / 2**30 * 2**30)
    qtbot.waitUntil(lambda: session.state.plan.budget_bytes == exact, timeout=WAIT_MS)
    # no snapping to the slider's steps: the plan, the panel and the line keep the dragged budget
    assert window.budget.budget_bytes() == exact
    assert window.timeline.budget_line.value() == pytest.approx(target / 2**30, abs=1e-12)
    assert window.budget.slider.value() == round((exact - session.floor_bytes) * 1000
                                                 / (session.baseline_bytes - session.floor_bytes))


def test_solver_choice_plans_in_background(qtbot, window, tiny_profile_path):
    open_and_wait(qtbot, window, tiny_profile_path)
    window.budget.solver.setCurrentText("recompute-all")
    qtbot.waitUntil(lambda: window.session.state.plan.solver == "recompute-all" and window.session.state.complete,
                    timeout=WAIT_MS)
    state = window.session.state
    candidates = len(window.session.loaded.profile.activations) - len(window.session.loaded.template.excluded)
    assert len(state.plan.recomputed) == candidates
    qtbot.waitUntil(lambda: "recompute-all" in window.budget.others, timeout=30_000)
    # per-module checkpointing runs with shared-chain replays; its timeline is simulated the same way
    window.budget.solver.setCurrentText("per-module")
    qtbot.waitUntil(lambda: window.session.state.plan.solver == "per-module" and window.session.state.complete,
                    timeout=WAIT_MS)
    state = window.session.state
    assert state.plan.replay_mode == "shared"
    assert state.sim.peak_bytes == state.plan.predicted_peak_bytes


def test_selection_is_shared_by_timeline_graph_and_table(qtbot, window, tiny_profile_path):
    open_and_wait(qtbot, window, tiny_profile_path)
    profile = window.session.loaded.profile
    act = max(profile.activations, key=lambda a: a.bytes)
    window.timeline.nodeClicked.emit(act.created_at)
    qtbot.waitUntil(lambda: not window.graph.runner.busy, timeout=WAIT_MS)
    # the graph reveals the node itself (expanding its groups), the table selects its activation
    view = window.graph.view
    item = view.items[view.node_item[profile.node_index[act.created_at]]]
    assert not item.is_group and item.key == act.created_at
    row = window.table.selectionModel().selectedRows()[0]
    assert row.data() == act.id
    assert act.created_at in window.inspector.toPlainText()


def test_table_selection_marks_the_lifetime_and_a_span_selects_what_is_alive(qtbot, window, tiny_profile_path):
    from acstudio.views.tables import alive_in_span, back_in_memory_at

    open_and_wait(qtbot, window, tiny_profile_path)
    slide_to_floor(qtbot, window)
    session, profile = window.session, window.session.loaded.profile
    plan = session.state.plan
    entry = plan.schedule[0]
    row = window.table_model.row_of(entry.activation)
    window.table.selectRow(window.table_proxy.mapFromSource(window.table_model.index(row, 0)).row())
    assert session.selected_activation == entry.activation
    index, act = profile.node_index, profile.activation_by_id[entry.activation]
    # created, last forward use, the recomputation, first backward use: each a line at its node's x
    marks = dict(window.timeline.lifetime)
    assert marks == {"made": index[act.created_at], "last forward use": index[act.last_fw_use],
                     "recomputed": index[entry.recompute_before], "first backward use": index[act.first_bw_use],
                     "last use": index[act.last_bw_use]}
    # a span in the middle of the step: the table keeps only the activations alive there, the graph marks them
    window.timeline.span_button.setChecked(True)
    axis = window.timeline.axis
    middle = (axis.edges[axis.start] + axis.edges[-1]) / 2
    window.timeline.span.setRegion((middle - 0.001, middle + 0.001))
    window.timeline._on_span_moved()
    first, last = axis.nodes_between(middle - 0.001, middle + 0.001)
    alive = alive_in_span(session.loaded.acts, back_in_memory_at(profile, session.loaded.acts, plan), first, last)
    assert alive.any() and (session.span_activations == alive).all()
    assert window.table_proxy.rowCount() == int(alive.sum())
    assert len(window.graph._span_nodes) == 2 * int(alive.sum())
    window.timeline.span_button.setChecked(False)
    assert window.table_proxy.rowCount() == window.table_model.rowCount()


def test_status_speaks_to_users_and_pareto_draws_baselines_as_points(qtbot, window, tiny_profile_path):
    open_and_wait(qtbot, window, tiny_profile_path)
    qtbot.waitUntil(lambda: "recompute-all" in window.budget.others, timeout=60_000)
    status = window.status_label.text().lower()
    assert "milp" not in status and "skipped" not in status
    words = window.budget.status_label.text().replace("<", " <").replace(">", "> ").split()
    assert not any(a == b for a, b in pairwise(words) if not a.startswith("<"))  # "budget budget"
    # recompute-all is the point(s) it is, markers without a line; μ-TWO stays a curve
    rows = window.budget.others["recompute-all"]
    x, _y = rows.getData()
    assert rows.opts["pen"] is None and 1 <= len(x) <= 2
    # the sweep's early rows and its final rows draw every solver twice: each keeps its own colour and symbol
    qtbot.waitUntil(lambda: not window.runners["sweep"].busy, timeout=WAIT_MS)
    looks = {name: (c.opts["pen"].color().getRgb()[:3] if c.opts["pen"] is not None else c.opts["symbolBrush"],
                    c.opts["symbol"]) for name, c in window.budget.others.items()}
    assert len(set(looks.values())) == len(looks), looks


def test_pareto_looks_are_fixed_per_solver_whatever_order_the_rows_arrive_in(qtbot):
    """Every registered solver keeps one colour and symbol, no two alike, in whatever order its rows arrive."""
    import pyqtgraph as pg

    from acstudio.gui.budget_panel import BudgetPanel
    from acstudio.plan.solvers import SOLVERS
    from acstudio.views.session import Session

    def looks(order: list[str], points: int) -> dict[str, tuple]:
        panel = BudgetPanel(Session(), tuple(SOLVERS))
        qtbot.addWidget(panel)
        for name in order:  # a few points draw markers, many a curve
            panel.set_other(name, np.arange(points, dtype=float), np.arange(points, 0, -1, dtype=float) * 2**30)
        return {name: (pg.mkColor(item.opts["symbolBrush"]).getRgb() if item.opts["pen"] is None
                       else item.opts["pen"].color().getRgb(), item.opts["symbol"])
                for name, item in panel.others.items()}

    names = list(SOLVERS)
    for points in (2, 8):
        looks_forward, looks_backward = looks(names, points), looks(names[::-1], points)
        assert looks_forward == looks_backward and set(looks_forward) == set(SOLVERS)
        assert len(set(looks_forward.values())) == len(SOLVERS)
        assert len({colour for colour, _ in looks_forward.values()}) == len(SOLVERS)


def test_the_sweep_child_sends_the_curves_before_the_programs(tiny_profile_path):
    """The Pareto chart's curves and baselines arrive before the exact programs are solved; the final answer
    holds both."""
    early = []
    rows = sweep_in_child(str(tiny_profile_path), on_rows=early.append)
    assert len(early) == 1 and {r["solver"] for r in early[0]} >= {"auto", "blocks", "recompute-all"}
    assert not {"milp", "milp-bound"} & {r["solver"] for r in early[0]}
    assert rows[:len(early[0])] == early[0] and {"milp", "milp-bound"} <= {r["solver"] for r in rows}


def test_plan_files_round_trip_through_save_and_open(qtbot, window, tiny_profile_path, tmp_path):
    open_and_wait(qtbot, window, tiny_profile_path)
    slide_to_floor(qtbot, window)
    saved = window.session.state.plan
    path = tmp_path / "plan.json.gz"
    window.save_plan(str(path))
    loaded = load_plan(path, window.session.loaded.profile)
    assert loaded.recomputed == saved.recomputed and loaded.predicted_peak_bytes == saved.predicted_peak_bytes
    # back to the top, then open the plan file: the window shows that plan again
    window.budget.slider.setValue(window.budget.slider.maximum())
    qtbot.waitUntil(lambda: window.session.state.plan.recomputed == [] and window.session.state.complete,
                    timeout=WAIT_MS)
    window.open_path(str(path))
    qtbot.waitUntil(lambda: window.session.state.plan.recomputed == saved.recomputed and window.session.state.complete,
                    timeout=WAIT_MS)
    assert window.budget.budget_bytes() == pytest.approx(saved.budget_bytes, abs=window.session.baseline_bytes / 500)
    assert str(path) in window.recent.paths()


def test_export_writes_files_that_load_back(qtbot, window, tiny_profile_path, tmp_path):
    import copy

    import torch

    from acstudio import load_step
    from acstudio.workload import build_workload
    from acstudio.workload.spec import make_optimizer

    open_and_wait(qtbot, window, tiny_profile_path)
    slide_to_floor(qtbot, window)
    plan = window.session.state.plan
    out = tmp_path / "export"
    with qtbot.waitSignal(window.runners["export"].resultReady, timeout=60_000) as blocker:
        window.export_to(str(out))
    paths = [Path(p) for p in blocker.args[0]]
    assert {"schedule.json", "schedule.csv", "step.py", "manifest.json", "report.md"} <= {p.name for p in paths}
    assert all(p.is_file() for p in paths)
    assert json.loads((out / "schedule.json").read_text())["recomputed"] == plan.recomputed
    assert window.messages.infos[-1][0] == "Export finished"
    # the exported step, loaded back into a fresh model, trains exactly like the eager step
    w = build_workload(WorkloadSpec.from_dict(window.session.loaded.profile.workload))
    ref_model = copy.deepcopy(w.model)
    ref_opt = make_optimizer(w.spec.optimizer, ref_model.parameters())
    loss = load_step(out, w.model, w.make_optimizer())(w.batch)
    ref_opt.zero_grad()
    ref_loss = w.loss_fn(ref_model, w.batch)
    ref_loss.backward()
    ref_opt.step()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    for p, q in zip(w.model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_exporting_into_a_folder_of_other_files_makes_a_new_folder_inside(qtbot, window, tiny_profile_path,
                                                                          tmp_path, monkeypatch):
    from PySide6.QtWidgets import QFileDialog

    open_and_wait(qtbot, window, tiny_profile_path)
    picked = tmp_path / "projects"
    picked.mkdir()
    (picked / "notes.txt").write_text("mine")
    monkeypatch.setattr(QFileDialog, "getExistingDirectory", lambda *args: str(picked))
    for _ in range(2):  # the second export of the same plan replaces the first one's folder, nothing else
        with qtbot.waitSignal(window.runners["export"].resultReady, timeout=60_000) as blocker:
            window.export_dialog()
    folder = picked / export_name(window.session.loaded.profile, window.session.state.plan)
    assert {Path(p).parent for p in blocker.args[0]} == {folder} and (folder / "manifest.json").is_file()
    assert sorted(p.name for p in picked.iterdir()) == sorted(["notes.txt", folder.name])
    assert (picked / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("kind", ["garbage", "wrong_version", "plan_without_profile"])
def test_bad_files_show_an_error_and_keep_what_is_loaded(qtbot, window, tiny_profile_path, tmp_path, kind):
    if kind != "plan_without_profile":
        open_and_wait(qtbot, window, tiny_profile_path)
    before = window.session.loaded
    bad = tmp_path / "bad.json.gz"
    if kind == "garbage":
        bad.write_bytes(gzip.compress(b"{ not json"))
        expected = "not a readable"
    elif kind == "wrong_version":
        doc = json.loads(gzip.decompress(tiny_profile_path.read_bytes()))
        doc["version"] = 99
        bad.write_bytes(gzip.compress(json.dumps(doc).encode()))
        expected = "version 99 is not supported"
    else:
        profile = Profile.load(tiny_profile_path)
        prepare(profile, str(tiny_profile_path)).trajectory.plan_for_budget(profile.peak_bytes).save(bad)
        expected = "is a plan; open the profile of its workload first"
    with qtbot.waitSignal(window.runners["load"].failed, timeout=30_000):
        window.open_path(str(bad))
    title, message = window.messages.errors[-1]
    assert title == "Cannot open the file" and expected in message
    assert window.session.loaded is before
    if before is not None:  # still usable: the slider still plans
        window.budget.slider.setValue(0)
        qtbot.waitUntil(lambda: window.session.state.plan.budget_bytes == window.session.floor_bytes, timeout=WAIT_MS)


def test_new_profile_runs_in_background_stays_responsive_and_opens(qtbot, window, factory_ref):
    gaps, last = [], [time.monotonic()]

    def tick():
        now = time.monotonic()
        gaps.append(now - last[0])
        last[0] = now

    timer = QTimer()
    timer.timeout.connect(tick)
    timer.start(10)
    live = []
    window.liveMemory.connect(lambda start, peaks, n: live.append((start, len(peaks), n)))
    window.start_profile(WorkloadSpec(factory_ref, batch_size=8, optimizer="adam").to_dict(), "cpu")
    assert window.progress.isVisible() and window.cancel_button.isVisible()
    wait_loaded(qtbot, window, None, 120_000)
    timer.stop()
    loaded = window.session.loaded
    assert loaded.profile.workload["model"] == factory_ref
    # the new profile was saved and reopens to the same graph
    assert Profile.load(loaded.path).fingerprint == loaded.profile.fingerprint
    assert loaded.path in window.recent.paths()
    # the memory curve was streamed to the timeline while measuring: every node once, in order
    n = len(loaded.profile.nodes)
    assert live and all(total == n for _, _, total in live)
    assert [start for start, _, _ in live] == list(np.cumsum([0] + [k for _, k, _ in live[:-1]]))
    assert sum(k for _, k, _ in live) == n
    # the event loop kept running while the worker thread profiled (GIL shared with capture/tracing)
    assert max(gaps) < 0.5, f"UI stalled for {max(gaps) * 1e3:.0f} ms"


def test_profiling_can_be_cancelled_without_losing_the_open_profile(qtbot, window, tiny_profile_path, factory_ref):
    open_and_wait(qtbot, window, tiny_profile_path)
    before = window.session.loaded
    runner = window.runners["profile"]
    with qtbot.waitSignal(runner.progress, timeout=60_000):
        window.start_profile(WorkloadSpec(factory_ref, batch_size=8).to_dict(), "cpu")
    with qtbot.waitSignal(runner.cancelled, timeout=60_000):
        window.cancel_button.click()
    assert window.session.loaded is before
    assert window.timeline._profile is before.profile  # the live curve gave way to the open profile again
    assert "cancelled" in window.status_label.text()
    assert not window.messages.errors
    qtbot.waitUntil(lambda: not window.progress.isVisible(), timeout=WAIT_MS)


def test_closing_while_profiling_cancels_and_joins_the_worker(qtbot, window, factory_ref):
    runner = window.runners["profile"]
    window.start_profile(WorkloadSpec(factory_ref, batch_size=8).to_dict(), "cpu")
    qtbot.waitUntil(lambda: bool(child_processes("acstudio.views.child")), timeout=10_000)
    t0 = time.monotonic()
    window.close()
    assert time.monotonic() - t0 < 15
    assert runner._thread.isFinished()
    assert not child_processes("acstudio.views.child")


def child_processes(text: str) -> list[int]:
    """Live child processes of this one whose command line contains ``text`` (Linux /proc)."""
    proc = Path("/proc")
    if not proc.is_dir():
        pytest.skip("needs /proc")
    found = []
    for entry in proc.iterdir():
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, ValueError):
            continue
        fields = stat.rpartition(")")[2].split()
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and text in cmdline:
            found.append(int(entry.name))
    return found


def test_benchmark_runs_in_background_and_shows_measurements(qtbot, window, tiny_profile_path):
    from acstudio.bench import BenchResults

    open_and_wait(qtbot, window, tiny_profile_path)
    dialog = window.bench_dialog()
    dialog.batches.setText("16, 32")
    assert dialog.values()["configs"] == ["eager", "captured", f"rewritten@{window.budget.budget_bytes()}"]
    dialog.reject()
    settings = {"batch_sizes": [16], "configs": ["captured"], "device": "cpu", "warmup": 1, "iters": 3,
                "fit_budget": None}
    with qtbot.waitSignal(window.runners["bench"].resultReady, timeout=120_000):
        window.start_bench(settings)
    model = window.bench_window.model
    assert model.rowCount() == 1
    assert model.value(0, "status") == "ok" and model.value(0, "peak_mib") > 0
    saved = BenchResults.load(next((window.data_dir / "bench").iterdir()))
    assert saved.rows[0]["peak_bytes"] == window.bench_results.rows[0]["peak_bytes"]


def test_a_cancelled_benchmark_leaves_no_results_folder(qtbot, window, tiny_profile_path):
    open_and_wait(qtbot, window, tiny_profile_path)
    settings = {"batch_sizes": [16], "configs": ["eager", "captured"], "device": "cpu", "warmup": 1, "iters": 3,
                "fit_budget": None}
    window.start_bench(settings)
    bench = window.data_dir / "bench"
    qtbot.waitUntil(lambda: any(bench.rglob("*.log")), timeout=60_000)  # a worker runs: the folder is written
    with qtbot.waitSignal(window.runners["bench"].cancelled, timeout=60_000):
        window.cancel_button.click()
    assert not bench.exists()  # nor the data folder, which the run created too
    assert not window.data_dir.exists()
    assert window.status_label.text() == "bench: cancelled" and window.bench_results is None


def test_committed_h200_benchmark_opens_as_measured_points_on_its_profile(qtbot, window, tmp_path):
    root = Path(__file__).resolve().parents[1]
    open_and_wait(qtbot, window, root / "sample_profiles" / "h200_resnet152_bs64_adam.json.gz")
    with qtbot.waitSignal(window.runners["load"].resultReady, timeout=30_000):
        window.open_path(str(root / "results" / "bench" / "resnet152" / "bs64_vs_compile.json"))
    rows = [r for r in window.bench_results.rows if r["status"] == "ok" and r["batch_size"] == 64]
    captured = next(r for r in rows if r["config"] == "captured")
    rewritten = [r for r in rows if r["kind"] == "rewritten"]
    x, y = window.budget.measured.getData()
    assert len(x) == 1 + len(rewritten) == 7 and x[0] == 0.0
    assert x[1:] == pytest.approx([r["time_ms_median"] - captured["time_ms_median"] for r in rewritten])
    assert y[0] * 2**30 == pytest.approx(captured["peak_bytes"])
    assert window.bench_window.model.rowCount() == len(window.bench_results.rows)

    with qtbot.waitSignal(window.runners["load"].failed, timeout=30_000):
        window.open_path(str(root / "results" / "superseded" / "bert_batches_random_ops_kept.json"))
    assert "this benchmark ran 'bert'" in window.messages.errors[-1][1]


def test_window_layout_and_recent_files_persist(qtbot, tmp_path, tiny_profile_path, window):
    open_and_wait(qtbot, window, tiny_profile_path)
    window.findChild(QDockWidget, "inspector_dock").hide()
    window.close()
    again = MainWindow(settings=window.settings, cache_dir=str(tmp_path / "cache"), messages=Recorder(),
                       data_dir=str(tmp_path / "data"))
    qtbot.addWidget(again)
    assert [a.text() for a in again.recent.menu.actions()] == [str(tiny_profile_path)]
    assert again.findChild(QDockWidget, "inspector_dock").isHidden()


def test_job_runner_newest_request_wins(qtbot):
    runner = JobRunner("test")
    started = threading.Event()

    def slow(progress, cancel):
        started.set()
        for _ in range(500):
            check(cancel)
            time.sleep(0.01)
        return "slow"

    results, cancels = [], []
    runner.resultReady.connect(results.append)
    runner.cancelled.connect(lambda: cancels.append(1))
    runner.submit(slow)
    assert started.wait(5)
    with qtbot.waitSignal(runner.resultReady, timeout=5000):
        runner.submit(lambda progress, cancel: "fast")
    assert results == ["fast"] and not runner.busy
    assert runner.shutdown(5000)


def test_job_runner_reports_errors_as_signals(qtbot):
    from acstudio.errors import ProfileFileError

    runner = JobRunner("test")
    with qtbot.waitSignal(runner.failed, timeout=WAIT_MS) as blocker:
        runner.submit(lambda progress, cancel: (_ for _ in ()).throw(ProfileFileError("x: corrupt profile")))
    assert blocker.args == ["x: corrupt profile", ""]
    with qtbot.waitSignal(runner.failed, timeout=WAIT_MS) as blocker:
        runner.submit(lambda progress, cancel: 1 / 0)
    assert blocker.args[0].startswith("ZeroDivisionError") and "Traceback" in blocker.args[1]
    assert runner.shutdown(5000)


def test_module_tree_partitions_nodes_and_expands(tiny_profile_path):
    profile = Profile.load(tiny_profile_path)
    tree = gl.ModuleTree(profile)
    collapsed = tree.view(frozenset(), REGIONS)
    assert sorted(i for it in collapsed.items for i in it.nodes) == list(range(len(profile.nodes)))
    assert all(collapsed.node_item[i] == k for k, it in enumerate(collapsed.items) for i in it.nodes)
    assert {it.region for it in collapsed.items} <= {"input", "forward", "loss", "backward", "optimizer", "output"}
    default = tree.view(tree.default_expansion(), REGIONS)
    assert len(default.items) > len(collapsed.items)
    everything = frozenset(k for i in range(len(profile.nodes)) for k in tree.ancestors(i))
    full = tree.view(everything, REGIONS)
    assert all(not it.is_group for it in full.items) and len(full.items) == len(profile.nodes)
    # edges join distinct items, never touch inputs/outputs, and are unique
    regions = [it.region for it in full.items]
    assert all(a != b and regions[a] not in gl.NO_EDGE_REGIONS for a, b in full.edges)
    assert len(set(full.edges)) == len(full.edges)
    assert tree.search("convolution") and all("convolution" in profile.nodes[i].target
                                                or "convolution" in profile.nodes[i].name
                                                for i in tree.search("convolution"))


def test_chunking_bounds_the_children_of_any_group():
    paths = [("optimizer",)] * 5000 + [("forward", "a")] * 3 + [("forward",)] * 20
    out = gl._chunked(paths)
    # ops next to sub-modules are bundled, a small module keeps its ops
    assert out[-1] == ("forward", gl.OWN_OPS) and out[5000] == ("forward", "a")
    children: dict[tuple, set] = {}
    for i, path in enumerate(out):
        full = (*path, i)  # a node is a child of its innermost group
        for d in range(1, len(full)):
            children.setdefault(full[:d], set()).add(full[d])
    assert max(len(c) for c in children.values()) <= gl.CHUNK


def test_a_modules_own_ops_are_one_box_per_run_between_its_sub_modules():
    """Ops before and after a sub-module's many ops are two boxes (one would close a loop through it); a one-op
    sub-module in between (an embedding lookup) does not cut the run."""
    paths = [("forward",)] * 4 + [("forward", "wte")] + [("forward",)] * 4 + [("forward", "h")] * 20 + \
        [("forward",)] * 8
    out = gl._chunked(paths)
    assert set(out[:9]) - {("forward", "wte")} == {("forward", gl.OWN_OPS)} and out[4] == ("forward", "wte")
    assert set(out[29:]) == {("forward", gl.own_ops(1))}
    assert gl.group_label(("forward", "transformer", gl.own_ops(1))) == "transformer ops 2"
    assert gl.module_name(("forward", "transformer", gl.own_ops(1))) == "transformer"


def test_layout_uses_dot_and_caches_it_on_disk(tiny_profile_path, tmp_path):
    if shutil.which("dot") is None:
        pytest.skip("graphviz dot is not installed")
    profile = Profile.load(tiny_profile_path)
    tree = gl.ModuleTree(profile)
    expanded = tree.default_expansion()
    view = tree.view(expanded)
    layout = gl.cached_layout(view, profile.fingerprint, expanded, tmp_path)
    assert layout.engine == "dot" and len(layout.boxes) == len(view.items)
    cache = gl.cache_file(tmp_path, profile.fingerprint, expanded)
    assert cache.is_file()
    again = gl.cached_layout(view, profile.fingerprint, expanded, tmp_path)
    assert again.boxes == layout.boxes and again.clusters == layout.clusters
    # the same expansion grouped otherwise (as many boxes, other ones) is laid out anew, not served the cached one
    renamed = dataclasses.replace(view, items=[dataclasses.replace(view.items[0], key="renamed"), *view.items[1:]])
    gl.cached_layout(renamed, profile.fingerprint, expanded, tmp_path)
    assert json.loads(cache.read_text())["items"][0] == "renamed"
    cache.write_text("[1, 2]")  # valid JSON, not a layout: laid out anew
    assert gl.cached_layout(view, profile.fingerprint, expanded, tmp_path).boxes == layout.boxes
    # the geometry of both layouts is checked in tests/test_gui_views.py


def test_missing_dot_falls_back_to_layered_layout(qtbot, window, tiny_profile_path, tmp_path, monkeypatch):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert not gl.dot_available()
    open_and_wait(qtbot, window, tiny_profile_path)
    assert window.graph.layout.engine == "layered"
    assert "'dot' not found" in window.graph.notice
    # the notice stays in the status bar while it applies, whatever else is said meanwhile
    window.show_status("something else")
    slide_to_floor(qtbot, window)
    assert "'dot' not found" in window.notice_label.text() and window.notice_label.isVisible()
    assert len(window.graph.layout.boxes) == len(window.graph.view.items)
    # and nothing was cached: installing graphviz later gives the real layout
    assert not list((tmp_path / "cache").glob("*.json"))


def test_timeline_drawing_keeps_every_peak():
    from acstudio.gui.timeline import bin_starts, peak_binned

    rng = np.random.default_rng(0)
    values = rng.random((10_001, 3)).cumsum(axis=1)
    starts = bin_starts(len(values), 1600)
    drawn = peak_binned(values, starts)
    assert len(drawn) <= 1600 and starts[0] == 0
    np.testing.assert_array_equal(drawn.max(axis=0), values.max(axis=0))
    assert (np.diff(drawn, axis=1) >= 0).all()  # still a stack: each level above the one below
    assert (peak_binned(values[:50], bin_starts(50, 1600)) == values[:50]).all()


def test_drop_opens_the_file_and_hover_names_the_node(qtbot, window, tiny_profile_path):
    from PySide6.QtCore import QMimeData, QPointF, Qt, QUrl
    from PySide6.QtGui import QDropEvent

    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(tiny_profile_path))])
    event = QDropEvent(QPointF(10, 10), Qt.DropAction.CopyAction, mime, Qt.MouseButton.NoButton,
                       Qt.KeyboardModifier.NoModifier)
    window.dropEvent(event)
    wait_loaded(qtbot, window, None)
    wait_plan(qtbot, window)
    profile = window.session.loaded.profile
    node = profile.nodes[len(profile.nodes) // 2]
    vb = window.timeline.plot.getPlotItem().vb
    window.timeline.axis_choice.setCurrentIndex(window.timeline.axis_choice.findData("order"))
    x = window.timeline.axis.x(profile.node_index[node.id]) + 0.5
    window.timeline._on_hover((vb.mapViewToScene(QPointF(x, 0.0)),))
    tip = window.timeline.plot.toolTip()
    assert tip.startswith(f"{node.id} {node.name}") and "retained activations" in tip


def test_table_model_sorts_numerically_and_filters(qtbot):
    import pandas as pd

    df = pd.DataFrame({"id": ["a", "b", "c"], "bytes": [2048, 10, 2**30], "op": ["conv", "relu", "conv_t"]},
                      index=["a", "b", "c"])
    model = DataFrameModel(df, formats={"bytes": fmt_bytes})
    proxy = FilterProxy()
    proxy.setSourceModel(model)
    proxy.sort(1)
    assert [proxy.index(r, 0).data() for r in range(3)] == ["b", "a", "c"]
    assert proxy.index(2, 1).data() == "1.00 GiB"
    proxy.setFilterFixedString("CONV")
    assert proxy.rowCount() == 2
    model.set_columns({"op": ["x", "y", "z"]})
    assert proxy.rowCount() == 0


def test_new_profile_dialog_builds_a_spec(qtbot):
    dialog = NewProfileDialog()
    qtbot.addWidget(dialog)
    dialog.set_environment({"models": {"torchvision": ["resnet18", "resnet152"], "transformers": ["bert", "gpt2"]},
                            "devices": [["cuda:0", "cuda:0 – GPU"]], "optimizers": ["sgd", "adam", "adamw"],
                            "precisions": ["fp32", "bf16"]})
    dialog.filter.setText("res")
    visible = [dialog.models.item(r).text() for r in range(dialog.models.count())
               if not dialog.models.item(r).isHidden() and dialog.models.item(r).text() in dialog._family]
    assert visible == ["resnet18", "resnet152"]
    dialog.select_model("bert")
    dialog.batch.setValue(4)
    dialog.seq.setValue(64)
    dialog.config.setText("num_hidden_layers=2 hidden_size=32")
    spec = WorkloadSpec.from_dict(dialog.spec())  # what the profiling process will rebuild
    assert (spec.model, spec.batch_size, spec.seq_len, spec.optimizer) == ("bert", 4, 64, "adam")
    assert spec.config == (("num_hidden_layers", "2"), ("hidden_size", "32"))
    assert dialog.device_string() == "cuda:0" and dialog.seq.isEnabled() and not dialog.image.isEnabled()
    dialog.config.setText("oops")
    dialog._accept()
    assert "key=value" in dialog.error.text() and dialog.result_spec is None


def test_new_profile_dialog_gets_models_and_devices_from_a_child_process(qtbot, window, monkeypatch):
    started = []
    monkeypatch.setattr(window, "start_profile", lambda spec, device: started.append((spec, device)))
    with qtbot.waitSignal(window.runners["probe"].resultReady, timeout=60_000):
        dialog = window.new_profile_dialog()
    assert "resnet152" in dialog._family and dialog._family["bert"] == "transformers"
    assert dialog.device.itemData(dialog.device.count() - 1) == "cpu"
    dialog.select_model("resnet152")
    dialog._accept()
    assert started and started[0][0]["model"] == "resnet152" and started[0][1] == dialog.device_string()


def test_pyside_calls_cannot_exhaust_references_to_singletons(qtbot):
    # whatever the installed PySide6 drops per call, a long session cannot bring these counts near zero
    timer = QTimer()
    for _ in range(10_000):
        timer.setInterval(5)  # a void call
        timer.timeout.emit()
    assert min(sys.getrefcount(None), sys.getrefcount(True), sys.getrefcount(False)) > 2**30


def test_slider_answer_is_replaced_by_a_faster_shared_chain_plan(qtbot, window):
    sample = Path(__file__).resolve().parent.parent / "sample_profiles" / "h200_resnet152_bs64_adam.json.gz"
    open_and_wait(qtbot, window, str(sample))
    window.session.set_budget(4811 * 2**20)
    quick = window.session.state.plan
    assert quick.replay_mode == "again"  # the instant answer is read off the trajectory
    qtbot.waitUntil(lambda: window.session.state.plan.replay_mode == "shared" and window.session.state.complete,
                    timeout=30_000)
    state = window.session.state
    assert state.plan.predicted_extra_ms < quick.predicted_extra_ms
    assert state.plan.predicted_peak_bytes <= 4811 * 2**20
    assert state.sim.peak_bytes == state.plan.predicted_peak_bytes
    assert "shared-chain" in window.budget.status_label.text()


def test_inspector_says_what_sets_the_floor_and_the_plan_peak(qtbot, window, tiny_profile_path):
    open_and_wait(qtbot, window, tiny_profile_path)
    window.session.select("")
    qtbot.waitUntil(lambda: window.session.state is not None and window.session.state.complete, timeout=30_000)
    # the floor is worked out once the window is interactive, and the inspector then says it
    qtbot.waitUntil(lambda: "The floor is " in window.inspector.toPlainText(), timeout=WAIT_MS)
    # the plan's part follows the plan once the budget rests
    window.session.set_budget(window.session.floor_bytes)
    qtbot.waitUntil(lambda: window.session.state.complete and "This plan: peak "
                    f"{format_bytes(window.session.state.plan.predicted_peak_bytes)}" in window.inspector.toPlainText(),
                    timeout=WAIT_MS)
    text = window.inspector.toPlainText()
    assert "The floor is " in text and "checkpointing cannot go below it" in text
    assert f"This plan: peak {format_bytes(window.session.state.plan.predicted_peak_bytes)}" in text


def test_table_model_announces_only_the_cells_that_change(qtbot):
    import pandas as pd

    df = pd.DataFrame({"id": list("abcdef"), "decision": ["retain"] * 6, "ms": [np.nan] * 6}, index=list("abcdef"))
    model = DataFrameModel(df)
    changed = []
    model.dataChanged.connect(lambda tl, br: changed.append((tl.row(), br.row(), tl.column(), br.column())))
    decision = np.array(["retain", "recompute", "recompute", "retain", "retain", "recompute"], dtype=object)
    ms = np.array([np.nan, 1.5, 2.0, np.nan, np.nan, 0.5])
    model.set_columns({"decision": decision, "ms": ms})
    assert changed == [(1, 2, 1, 2), (5, 5, 1, 2)]  # one announcement per run of changed rows
    assert [model.text(r, 1) for r in range(6)] == decision.tolist()
    changed.clear()
    model.set_columns({"decision": decision.copy(), "ms": ms.copy()})  # the same values (NaN included)
    assert changed == []
    decision[3] = "recompute"
    model.set_columns({"decision": decision, "ms": ms})
    assert changed == [(3, 3, 1, 1)]  # only the cell that changed


def test_a_slider_step_touches_only_the_activations_whose_plan_facts_change(qtbot, window, tiny_profile_path):
    open_and_wait(qtbot, window, tiny_profile_path)
    session, model = window.session, window.table_model
    profile = session.loaded.profile

    def facts(plan):
        """Per activation: its decision, its μ-TWO step and its schedule entry (what the plan columns show)."""
        entries = {e.activation: (e.sources, len(e.replay), e.recompute_ms, e.ratio) for e in plan.schedule}
        steps = {a: k for k, a in enumerate(plan.recomputed)}
        return {a: (d, steps.get(a), entries.get(a)) for a, d in plan.decisions(profile).items()}

    before = facts(session.state.plan)
    rows = []
    model.dataChanged.connect(lambda tl, br: rows.extend(range(tl.row(), br.row() + 1)))
    window.session.set_budget(session.floor_bytes)
    after = facts(session.state.plan)
    ids = [model.data(model.index(r, 0)) for r in range(model.rowCount())]
    assert rows and sorted(rows) == [r for r, a in enumerate(ids) if before[a] != after[a]]
    # and the table shows the new plan's decisions
    assert {a: model.value(r, "decision") for r, a in enumerate(ids)} == {
        a: d.partition(":")[0] for a, d in session.state.plan.decisions(profile).items()}


OPEN_WITHOUT_TORCH = """
import os, sys, time
os.environ["QT_QPA_PLATFORM"] = "offscreen"
from PySide6.QtCore import QSettings
from PySide6.QtWidgets import QApplication
from acstudio.gui.main_window import MainWindow
app = QApplication([])
settings = QSettings(os.path.join(sys.argv[2], "settings.ini"), QSettings.Format.IniFormat)
window = MainWindow(settings=settings, cache_dir=sys.argv[2], data_dir=sys.argv[2])
window.open_path(sys.argv[1])
deadline = time.monotonic() + 120
while not (window.session.state is not None and window.session.state.complete) and time.monotonic() < deadline:
    app.processEvents()
    time.sleep(0.01)
assert window.session.state.complete
print("torch imported:", "torch" in sys.modules)
window.close()  # joins the worker threads
"""


def test_opening_a_profile_without_random_ops_never_imports_torch(tmp_path):
    # importing torch takes seconds on a small machine: the window opens and plans without it
    import subprocess

    sample = Path(__file__).resolve().parents[1] / "sample_profiles" / "cpu_resnet18_bs4.json.gz"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", OPEN_WITHOUT_TORCH, str(sample), str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "torch imported: False" in out.stdout
