"""The main window: docks, menus, status bar and the wiring between session, views and background jobs.

No engine logic lives here. Every long call runs in a :class:`~acstudio.gui.jobs.JobRunner`; every error the
user can cause ends in :class:`~acstudio.gui.dialogs.Messages` and leaves what is loaded untouched.
"""

from __future__ import annotations

import gc
import html
import os
import re
import sys
import time
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
from pyqtgraph.util.garbage_collector import GarbageCollector
from PySide6.QtCore import QSettings, QStandardPaths, Qt, QTimer, Signal
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (
    QAbstractItemView,
    QDockWidget,
    QFileDialog,
    QHeaderView,
    QLabel,
    QLineEdit,
    QMainWindow,
    QProgressBar,
    QPushButton,
    QSplitter,
    QStyle,
    QTableView,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from acstudio.gui.budget_panel import BudgetPanel
from acstudio.gui.dialogs import BenchDialog, Messages, NewProfileDialog, TableDialog
from acstudio.gui.graph_view import GraphView
from acstudio.gui.jobs import JobRunner
from acstudio.gui.models import ID_ROLE, DataFrameModel, FilterProxy, fmt_bytes, fmt_int, fmt_ms, fmt_ratio
from acstudio.gui.qtcompat import make_singletons_immortal
from acstudio.gui.session import Loaded, PlanState, Session, open_document, prepare
from acstudio.gui.timeline import TimelineView
from acstudio.plan.model import Plan
from acstudio.plan.peak import explain_peak
from acstudio.plan.solvers import DEFAULT_SOLVER, SOLVERS
from acstudio.profile.model import Profile
from acstudio.simulate.modes import get_mode
from acstudio.units import format_bytes
from acstudio.views.child import probe_environment, profile_in_child, sweep_in_child

if TYPE_CHECKING:  # acstudio.bench imports torch (seconds): only a benchmark file the user opens loads it
    from acstudio.bench.results import BenchResults

MAX_RECENT = 8
MAX_COLUMN_PX = 280
GIL_SWITCH_S = 0.001
INSPECTOR_DELAY_MS = 150  # the inspector follows a plan once the budget rests this long (its layout costs a step)
SIZE_SAMPLE_ROWS = 60  # sizing columns on all of ResNet-152's 2000 rows would take seconds
USER_JOBS = ("load", "profile", "export", "bench")  # shown with a progress bar and Cancel
FILE_FILTER = "AC Studio files (*.json.gz *.json);;All files (*)"
TABLE_FORMATS = {"bytes": fmt_bytes, "inactive_ms": fmt_ms, "recompute_ms": fmt_ms, "ratio": fmt_ratio,
                 "step": fmt_int, "replay_nodes": fmt_int}
TABLE_HEADERS = {"inactive_ms": "inactive (ms)", "recompute_ms": "recompute (ms)", "ratio": "ratio (MiB/ms)",
                 "lifetime": "lifetime (nodes)", "first_bw_use": "first backward use", "replay_nodes": "replays",
                 "step": "μ-TWO step"}


def default_cache_dir() -> str:
    return os.path.join(QStandardPaths.writableLocation(QStandardPaths.StandardLocation.CacheLocation), "layouts")


def default_data_dir() -> str:
    return QStandardPaths.writableLocation(QStandardPaths.StandardLocation.AppDataLocation)


class MainWindow(QMainWindow):
    liveMemory = Signal(int, object, int)  # (first node, peak bytes per node, nodes): a profile being measured
    floorExplained = Signal(str, str)  # (profile path, what sets its AC floor), from the sweep's child process
    sweepRowsReady = Signal(str, list)  # (profile path, the sweep's rows but the programs'), before it ends

    def __init__(self, settings: QSettings | None = None, cache_dir: str | None = None,
                 messages: Messages | None = None, data_dir: str | None = None) -> None:
        """``cache_dir`` holds graph layouts, ``data_dir`` new profiles and benchmark results."""
        make_singletons_immortal()
        # Planning and layout jobs are Python threads: make them hand the interpreter back to the GUI thread
        # within a millisecond (Python's default is 5 ms, several of which add up to a visible stall in a repaint).
        sys.setswitchinterval(GIL_SWITCH_S)
        # Python collects reference cycles in whichever thread happens to allocate: a planning thread that drops
        # the last reference to a Qt wrapper crashes Qt (a segfault in the tests). pyqtgraph's collector turns
        # automatic collection off and collects on a timer in this, the GUI, thread; closeEvent turns it back on.
        self._garbage = GarbageCollector(interval=0.5)
        super().__init__()
        self.data_dir = Path(data_dir if data_dir is not None else default_data_dir())
        self.setWindowTitle("AC Studio")
        self.setAcceptDrops(True)
        screen = self.screen().availableGeometry()
        self.resize(min(1600, screen.width()), min(1000, screen.height()))
        self.settings = settings if settings is not None else QSettings("AC Studio", "acstudio")
        self.messages = messages or Messages(self)
        self.session = Session(self)
        self.session.loadedChanged.connect(self._on_loaded)
        self.session.planChanged.connect(self._on_plan)
        self.session.simulated.connect(self._on_simulated)
        self.session.spanChanged.connect(self._on_span)
        self.session.selectionChanged.connect(self._on_selection)
        self.session.failed.connect(lambda msg, details: self._error("Planning failed", msg, details))

        self.graph = GraphView(self.session, cache_dir if cache_dir is not None else default_cache_dir())
        self.timeline = TimelineView(self.session)
        self.timeline.budgetDragged.connect(self._on_line_dragged)
        self.liveMemory.connect(self.timeline.show_live)

        self.budget = BudgetPanel(tuple(SOLVERS))
        self.budget.budgetChanged.connect(self.set_budget)
        self.budget.budgetPreview.connect(self.timeline.set_budget)
        self.budget.solverChanged.connect(self._on_solver)
        self.budget.setEnabled(False)
        self.inspector = QTextBrowser()
        self.table_model = DataFrameModel(formats=TABLE_FORMATS, headers=TABLE_HEADERS, parent=self)
        self.table_proxy = FilterProxy(self)
        self.table_proxy.setSourceModel(self.table_model)
        self.table = QTableView()
        self.table.setModel(self.table_proxy)
        self.table.setSortingEnabled(True)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Interactive)
        self.table.setTextElideMode(Qt.TextElideMode.ElideRight)  # a cut cell ends in "…"; its tooltip has it all
        self.table.horizontalHeader().setResizeContentsPrecision(SIZE_SAMPLE_ROWS)
        self.table.verticalHeader().setVisible(False)
        self.table.verticalHeader().setDefaultSectionSize(self.table.fontMetrics().height() + 6)
        self.table.selectionModel().currentRowChanged.connect(self._on_table_row)
        self.table_filter = QLineEdit(placeholderText="Filter activations (any column)")
        self.table_filter.textChanged.connect(self.table_proxy.setFilterFixedString)
        table_box = QWidget()
        box_layout = QVBoxLayout(table_box)
        box_layout.setContentsMargins(0, 0, 0, 0)
        box_layout.addWidget(self.table_filter)
        box_layout.addWidget(self.table)
        # The graph runs top to bottom, so it gets the window's height; the timeline and the table share the
        # middle; the budget and the inspector sit on the right.
        right = QSplitter(Qt.Orientation.Vertical)
        right.addWidget(self.timeline)
        right.addWidget(table_box)
        right.setSizes([480, 400])
        splitter = QSplitter(Qt.Orientation.Horizontal)
        splitter.addWidget(self.graph)
        splitter.addWidget(right)
        splitter.setSizes([430, 770])
        self.setCentralWidget(splitter)
        budget_dock = self._dock("Budget", "budget_dock", self.budget, Qt.DockWidgetArea.RightDockWidgetArea)
        inspector_dock = self._dock("Inspector", "inspector_dock", self.inspector,
                                    Qt.DockWidgetArea.RightDockWidgetArea)
        self.inspector.setMinimumHeight(220)
        self.resizeDocks([budget_dock, inspector_dock], [560, 320], Qt.Orientation.Vertical)
        self.resizeDocks([budget_dock], [400], Qt.Orientation.Horizontal)

        self.progress = QProgressBar()
        self.progress.setMaximumWidth(260)
        self.progress.hide()
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.hide()
        self.cancel_button.clicked.connect(self.cancel_jobs)
        self.status_label = QLabel("")
        self.statusBar().addWidget(self.status_label, 1)
        # lasting notes (graphviz missing) stay on the right while they apply; events come and go on the left
        self.notice_label = QLabel("")
        self.statusBar().addPermanentWidget(self.notice_label)
        self.graph.noticeChanged.connect(self.notice_label.setText)
        self.statusBar().addPermanentWidget(self.progress)
        self.statusBar().addPermanentWidget(self.cancel_button)

        self.runners: dict[str, JobRunner] = {}
        for name in ("load", "profile", "probe", "sweep", "export", "bench"):
            runner = JobRunner(name, self)
            runner.progress.connect(partial(self._on_progress, name))
            runner.busyChanged.connect(self._update_busy)
            runner.failed.connect(partial(self._on_job_failed, name))
            runner.cancelled.connect(partial(self.show_status, f"{name}: cancelled"))
            self.runners[name] = runner
        self.runners["profile"].failed.connect(self._restore_timeline)
        self.runners["profile"].cancelled.connect(self._restore_timeline)
        self.runners["load"].resultReady.connect(self._on_opened)
        self.runners["profile"].resultReady.connect(self._on_profiled)
        self.runners["sweep"].resultReady.connect(self._on_sweep)
        self.floorExplained.connect(self._on_floor_note)
        self.sweepRowsReady.connect(self._on_sweep_rows)
        self.runners["probe"].resultReady.connect(self._on_environment)
        self._environment: dict | None = None
        self._env_dialogs: list[NewProfileDialog | BenchDialog] = []
        self.bench_results = None  # the last BenchResults, and the window showing them
        self.bench_window: TableDialog | None = None
        self.runners["export"].resultReady.connect(self._on_exported)
        self.runners["bench"].resultReady.connect(self._on_bench)
        self._opening = ""
        self._waiting_first_plan = False  # a profile opened and its first plan is not complete yet
        self._inspector_html = ""
        self._inspector_timer = QTimer(self)
        self._inspector_timer.setSingleShot(True)
        self._inspector_timer.setInterval(INSPECTOR_DELAY_MS)
        self._inspector_timer.timeout.connect(self._refresh_inspector)
        self._build_menus()
        self._restore_layout()

    def _dock(self, title: str, name: str, widget: QWidget, area: Qt.DockWidgetArea) -> QDockWidget:
        dock = QDockWidget(title, self)
        dock.setObjectName(name)  # saveState needs names
        dock.setWidget(widget)
        self.addDockWidget(area, dock)
        return dock

    # -- menus -----------------------------------------------------------------------------------------------
    def _build_menus(self) -> None:
        file_menu = self.menuBar().addMenu("&File")
        self._action(file_menu, "&New profile…", self.new_profile_dialog, QKeySequence.StandardKey.New)
        self._action(file_menu, "&Open…", self.open_dialog, QKeySequence.StandardKey.Open)
        self.recent_menu = file_menu.addMenu("Open &recent")
        file_menu.addSeparator()
        self.save_plan_action = self._action(file_menu, "&Save plan…", self.save_plan_dialog,
                                             QKeySequence.StandardKey.Save)
        self.export_action = self._action(file_menu, "&Export…", self.export_dialog, "Ctrl+E")
        self.bench_action = self._action(file_menu, "&Benchmark…", self.bench_dialog, "Ctrl+B")
        file_menu.addSeparator()
        self._action(file_menu, "&Quit", self.close, QKeySequence.StandardKey.Quit)
        view_menu = self.menuBar().addMenu("&View")
        for dock in self.findChildren(QDockWidget):
            view_menu.addAction(dock.toggleViewAction())
        self._action(view_menu, "Fit graph", self.graph.fit, "Ctrl+0")
        self._update_recent_menu()
        self._update_actions()

    def _action(self, menu, text: str, slot, shortcut=None) -> QAction:
        action = QAction(text, self)
        if shortcut is not None:
            action.setShortcut(QKeySequence(shortcut))
        action.triggered.connect(lambda _checked=False: slot())
        menu.addAction(action)
        return action

    def _update_actions(self) -> None:
        has_plan = self.session.state is not None
        for action in (self.save_plan_action, self.export_action):
            action.setEnabled(has_plan)
        self.bench_action.setEnabled(self.session.loaded is not None)

    # -- files -----------------------------------------------------------------------------------------------
    def open_dialog(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open profile, plan or benchmark results", self._last_dir(),
                                              FILE_FILTER)
        if path:
            self.open_path(path)

    def open_path(self, path: str) -> None:
        """Open a profile (or a plan or benchmark results for the open profile) in the background; errors keep the
        current one."""
        self._opening = str(path)
        self.show_status(f"Opening {path}…")
        self.runners["load"].submit(partial(open_document, str(path), self.session.loaded,
                                            cache_dir=self.graph.cache_dir))

    def _on_opened(self, result: Loaded | Plan | BenchResults) -> None:
        self._remember(self._opening)
        if isinstance(result, Loaded):
            self.session.set_loaded(result)
        elif isinstance(result, Plan):
            self.session.show(result)
            self.budget.solver.blockSignals(True)
            self.budget.solver.setCurrentText(result.solver)
            self.budget.solver.blockSignals(False)
            self.budget.set_budget(result.budget_bytes)
            self.timeline.set_budget(result.budget_bytes)
            self.show_status(f"Plan {Path(self._opening).name}: {result.solver}, "
                             f"budget {format_bytes(result.budget_bytes)}")
        else:
            self._on_bench(result)

    def _remember(self, path: str) -> None:
        recent = [p for p in self._recent() if p != path]
        self.settings.setValue("recent_files", [path, *recent][:MAX_RECENT])
        self.settings.setValue("last_dir", str(Path(path).parent))
        self._update_recent_menu()

    def _recent(self) -> list[str]:
        value = self.settings.value("recent_files", [])
        if isinstance(value, str):  # QSettings returns a bare string for one-element lists
            value = [value]
        return [str(v) for v in value or []]

    def _last_dir(self) -> str:
        return str(self.settings.value("last_dir", ""))

    def _update_recent_menu(self) -> None:
        self.recent_menu.clear()
        for path in self._recent():
            action = self.recent_menu.addAction(path)
            action.triggered.connect(lambda _checked=False, p=path: self.open_path(p))
        self.recent_menu.setEnabled(bool(self._recent()))

    def dragEnterEvent(self, event) -> None:
        if event.mimeData().hasUrls() and any(u.isLocalFile() for u in event.mimeData().urls()):
            event.acceptProposedAction()

    def dropEvent(self, event) -> None:
        files = [u.toLocalFile() for u in event.mimeData().urls() if u.isLocalFile()]
        if files:
            self.open_path(files[0])
            event.acceptProposedAction()

    # -- new profile -----------------------------------------------------------------------------------------
    def new_profile_dialog(self) -> NewProfileDialog:
        """Open the (window-modal, non-blocking) new-profile dialog; its choices arrive from a child process."""
        dialog = NewProfileDialog(self)
        self._wants_environment(dialog)
        dialog.accepted.connect(lambda: self.start_profile(dialog.result_spec, dialog.device_string()))
        dialog.open()
        return dialog

    def _wants_environment(self, dialog: NewProfileDialog | BenchDialog) -> None:
        """Give ``dialog`` the models and devices now, or when the (one) probe process answers."""
        if self._environment is not None:
            dialog.set_environment(self._environment)
            return
        self._env_dialogs.append(dialog)
        if not self.runners["probe"].busy:
            self.runners["probe"].submit(probe_environment)

    def _on_environment(self, env: dict) -> None:
        self._environment = env
        for dialog in self._env_dialogs:
            dialog.set_environment(env)
        self._env_dialogs = []

    def start_profile(self, spec: dict, device: str) -> None:
        """Profile ``spec`` (``WorkloadSpec.to_dict()``) on ``device`` in a child process, then open it.

        The profile is saved under the data folder, so it can be reopened from the recent files.
        """
        out_dir = self.data_dir / "profiles"
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        label = f"{Path(spec['model'].rpartition(':')[0] or spec['model']).stem}_bs{spec['batch_size']}"
        path = out_dir / f"{label}_{spec['optimizer']}_{spec['precision']}-{device.replace(':', '')}-{stamp}.json.gz"
        self.show_status(f"Profiling {spec['model']} (batch {spec['batch_size']}) on {device}…")
        # The child streams the measured memory curve; the signal carries it to the timeline on the GUI thread.
        self.runners["profile"].submit(partial(profile_and_prepare, spec, device, str(path),
                                               on_memory=self.liveMemory.emit))

    def _on_profiled(self, loaded: Loaded) -> None:
        self._remember(loaded.path)
        self.session.set_loaded(loaded)
        self.show_status(f"Profiled {loaded.profile.label}; saved to {loaded.path}")

    # -- session updates -------------------------------------------------------------------------------------
    def _on_loaded(self, loaded: Loaded) -> None:
        profile = loaded.profile
        self.setWindowTitle(f"AC Studio – {profile.label} – {Path(loaded.path).name}")
        self.table_model.set_frame(loaded.table)
        self.table_proxy.sort(-1)  # graph order until the user sorts
        self.table.horizontalHeader().setSortIndicator(-1, Qt.SortOrder.AscendingOrder)
        self._waiting_first_plan = True
        self.runners["sweep"].cancel()
        floor, top = self.session.floor_bytes, self.session.baseline_bytes
        self.budget.set_range(floor, top)
        curve = loaded.trajectory.curve()
        self.budget.set_curve(curve["extra_ms"].to_numpy(), curve["predicted_peak_bytes"].to_numpy())
        self.budget.clear_others()
        self.budget.setEnabled(True)
        self.budget.solver.blockSignals(True)  # one plan for the opening budget, not one for the solver too
        self.budget.solver.setCurrentText(DEFAULT_SOLVER)
        self.budget.solver.blockSignals(False)
        self.session.solver = DEFAULT_SOLVER
        self._show_html(self._profile_html(loaded))
        self.set_budget(top if floor >= top else (floor + top) // 2)
        self._update_actions()
        self.show_status(f"Loaded {profile.label}: {len(profile.nodes)} nodes, {len(profile.activations)} "
                         f"activations; peak {format_bytes(top)}, floor {format_bytes(floor)}")

    def _after_first_plan(self) -> None:
        """What the first paint does not need starts once the opened profile's first plan is complete: the other
        solvers' sweep and what sets the floor (a child process), the graph's layouts one click away, and the
        table's column widths (its plan columns are filled now)."""
        if not self._waiting_first_plan:
            return
        self._waiting_first_plan = False
        path = self.session.loaded.path
        self.runners["sweep"].submit(partial(sweep_in_child, path,
                                             on_floor=lambda note: self.floorExplained.emit(path, note),
                                             on_rows=lambda rows: self.sweepRowsReady.emit(path, rows)))
        self.graph.allow_prefetch()
        QTimer.singleShot(0, self._size_table_columns)

    def _on_floor_note(self, path: str, note: str) -> None:
        loaded = self.session.loaded
        if loaded is not None and loaded.path == path:
            loaded.floor_note = note
            self._refresh_inspector()

    def _size_table_columns(self) -> None:
        """Every column as wide as its content (judged on the first :data:`SIZE_SAMPLE_ROWS` rows) and its header,
        up to :data:`MAX_COLUMN_PX` (longer cells end in "…" and show in full as a tooltip).

        Measured here from the formatted texts, as Qt's item delegate pads them: ``resizeColumnsToContents`` asks
        the model for eight roles of every sampled cell, a tenth of a second of Python calls on the GUI thread."""
        model, metrics = self.table_model, self.table.fontMetrics()
        margin = self.table.style().pixelMetric(QStyle.PixelMetric.PM_FocusFrameHMargin) + 1
        padding = 2 * margin + 2  # the delegate's text margins, and the grid line
        rows = range(min(SIZE_SAMPLE_ROWS, model.rowCount()))
        header = self.table.horizontalHeader()
        for c in range(model.columnCount()):
            text = max((metrics.horizontalAdvance(model.text(r, c)) for r in rows), default=0)
            self.table.setColumnWidth(c, min(max(text + padding, header.sectionSizeHint(c)), MAX_COLUMN_PX))

    def set_budget(self, budget: int) -> None:
        """Budget from any control: all controls follow, the session plans (quickly, then fully)."""
        if self.session.loaded is None:
            return
        self.budget.set_budget(budget)
        self.timeline.set_budget(budget)
        if self.session.set_budget(budget) is None:
            self.show_status(f"Planning with {self.session.solver} for {format_bytes(budget)}…")

    def _on_line_dragged(self, budget: int) -> None:
        self.budget.drag_to(budget)

    def _on_solver(self, solver: str) -> None:
        self.session.solver = solver
        if self.session.loaded is not None:
            self.set_budget(self.budget.budget_bytes())

    def _on_sweep_rows(self, path: str, rows: list[dict]) -> None:
        loaded = self.session.loaded
        if loaded is not None and loaded.path == path:
            self._on_sweep(rows)

    def _on_sweep(self, rows: list[dict]) -> None:
        """Other solvers' operating points on the Pareto chart. Rows without a peak are notes for the curious (a
        solver that was skipped, and why): they go to the chart's tooltip, not the status bar."""
        df = pd.DataFrame(rows)
        if "peak_bytes" not in df.columns:
            return
        for solver, rows in df.dropna(subset=["peak_bytes", "extra_ms"]).groupby("solver"):
            self.budget.set_other(str(solver), rows["extra_ms"].to_numpy(), rows["peak_bytes"].to_numpy())
        notes = df[df["peak_bytes"].isna()] if "note" in df.columns else df.iloc[:0]
        self.budget.set_notes([f"{row['solver']}: {row['note']}" for _, row in notes.iterrows()])

    def _on_plan(self, state: PlanState) -> None:
        loaded = self.session.loaded
        candidates = len(loaded.profile.activations) - len(loaded.template.excluded)
        plan = state.plan
        how = f"{plan.stop_reason}; {get_mode(plan.replay_mode).summary}"
        self.budget.show_prediction(plan.predicted_peak_bytes, plan.predicted_extra_ms, loaded.profile.iteration_ms,
                                    len(plan.recomputed), candidates, plan.feasible, how)
        self.budget.set_current(plan.predicted_extra_ms, plan.predicted_peak_bytes)
        self.table_model.set_columns(self.session.table_columns(state))
        self._inspector_timer.start()
        self._update_actions()
        if state.complete:
            self._after_first_plan()

    def _on_simulated(self, _state: PlanState) -> None:
        self._inspector_timer.start()
        self._after_first_plan()

    def _refresh_inspector(self) -> None:
        """The selected node, or the profile and what sets the current plan's peak (once its timeline is here:
        until then the inspector keeps what it shows, rather than blinking on every slider step)."""
        state = self.session.state
        if self.session.selected:
            self._show_html(self._node_html(self.session.selected))
        elif state is not None and state.complete:
            self._show_html(self._profile_html(self.session.loaded))

    def _show_html(self, text: str) -> None:
        self._inspector_timer.stop()
        if text != self._inspector_html:  # setHtml lays the whole document out again: a few ms
            self._inspector_html = text
            self.inspector.setHtml(text)

    def _restore_timeline(self, *_args) -> None:
        """A profiling run that drew its live curve ended without a profile: show the loaded one again."""
        loaded = self.session.loaded
        if loaded is None:
            return
        self.timeline.set_profile(loaded.profile, loaded.baseline.timeline.sum(axis=1), self.session.floor_bytes)
        self.set_budget(self.budget.budget_bytes())

    def _on_selection(self, node_id: str) -> None:
        self._show_html(self._node_html(node_id))
        if self.session.selected_activation:
            row = self.table_model.row_of(self.session.selected_activation)
            proxy_index = self.table_proxy.mapFromSource(self.table_model.index(row, 0))
            if proxy_index.isValid():
                self.table.selectionModel().blockSignals(True)
                self.table.selectRow(proxy_index.row())
                self.table.selectionModel().blockSignals(False)
                self.table.scrollTo(proxy_index)

    def _on_table_row(self, current, _previous) -> None:
        act_id = current.data(ID_ROLE)
        if act_id and self.session.loaded is not None:
            act = self.session.loaded.profile.activation_by_id.get(act_id)
            if act is not None:
                self.session.select(act.created_at, act_id)

    def _on_span(self, _nodes) -> None:
        """A timeline span selects the activations alive in it: the table shows only those."""
        alive = self.session.span_activations
        if not alive.any():
            self.table_proxy.set_only(None)
            return
        ids = set(self.session.loaded.table.index[alive])
        self.table_proxy.set_only(ids)
        total = int(self.session.loaded.acts.bytes[alive].sum())
        self.show_status(f"{len(ids)} activations alive in the selected span ({format_bytes(total)}); the table "
                         "shows only them until the span is switched off")

    # -- inspector -------------------------------------------------------------------------------------------
    def _profile_html(self, loaded: Loaded) -> str:
        p = loaded.profile
        env = p.environment
        cats = "".join(f"<tr><td>{k}</td><td align=right>{format_bytes(v)}</td></tr>"
                       for k, v in p.peak_breakdown.items() if v)
        return (f"<h3>{p.label}</h3><p>{len(p.nodes)} nodes · {len(p.activations)} activations · "
                f"iteration {p.iteration_ms:.1f} ms<br>device {env.get('device', '?')} · torch "
                f"{env.get('torch', '?')}</p><p>measured peak {format_bytes(p.peak_bytes)} at {p.peak_node}<br>"
                f"checkpointing floor {format_bytes(self.session.floor_bytes)}</p>"
                f"<table><tr><th align=left>at the peak</th><th></th></tr>{cats}</table>"
                f"{self._floor_html(loaded)}{self._plan_peak_html()}"
                "<p>Click a node in the graph, the timeline or the table.</p>")

    @staticmethod
    def _floor_html(loaded: Loaded) -> str:
        note = loaded.floor_note
        return f"<p>{html.escape(note[:1].upper() + note[1:])}.</p>" if note else ""

    def _plan_peak_html(self) -> str:
        """What sets the current plan's peak (once its timeline is simulated)."""
        state, loaded = self.session.state, self.session.loaded
        if state is None or not state.complete:
            return ""
        return f"<p><b>This plan:</b> {html.escape(explain_peak(loaded.ctx, state.plan, state.sim).summary())}</p>"

    def _node_html(self, node_id: str) -> str:
        loaded = self.session.loaded
        n = loaded.profile.node_by_id[node_id]
        rows = [("op", n.target), ("module", n.module or "–"), ("region", n.region), ("shape", f"{n.shape} {n.dtype}"),
                ("allocates", format_bytes(n.new_bytes)), ("run time", f"{n.run_time_ms:.3f} ms"),
                ("memory after", format_bytes(n.mem_after)), ("memory peak", format_bytes(n.mem_peak)),
                ("replay", n.replay)]
        state = self.session.state
        entries = {e.activation: e for e in state.plan.schedule} if state else {}
        for a in loaded.profile.activations:
            if a.created_at != node_id:
                continue
            decision = state.decisions.get(a.id, "") if state else ""
            rows += [("activation", f"{a.id}: {format_bytes(a.bytes)}"), ("decision", decision),
                     ("last forward use", a.last_fw_use), ("first backward use", a.first_bw_use),
                     ("inactive", f"{a.inactive_time_ms:.3f} ms")]
            entry = entries.get(a.id)
            if entry is not None:
                rows += [("recomputed before", entry.recompute_before), ("sources", " ".join(entry.sources) or "–"),
                         ("replays", f"{len(entry.replay)} nodes, {entry.recompute_ms:.3f} ms"),
                         ("ratio", f"{entry.ratio / 2**20:.2f} MiB/ms")]
        if state:
            inserted = [e.activation for e in state.plan.schedule if e.recompute_before == node_id]
            if inserted:
                rows.append(("recomputes before it", " ".join(inserted)))
        body = "".join(f"<tr><td><b>{k}</b></td><td>{v}</td></tr>" for k, v in rows)
        return f"<h3>{n.id} · {n.name}</h3><table cellspacing=3>{body}</table>"

    # -- plan files, export, benchmark -----------------------------------------------------------------------
    def save_plan_dialog(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Save plan", self._last_dir(), FILE_FILTER)
        if path:
            self.save_plan(path)

    def save_plan(self, path: str) -> None:
        try:
            self.session.state.plan.save(path)
        except (OSError, ValueError) as exc:
            self._error("Cannot save the plan", str(exc))
            return
        self._remember(path)
        self.show_status(f"Plan saved to {path}")

    def export_dialog(self) -> None:
        from acstudio.export.exporter import export_folder_in

        path = QFileDialog.getExistingDirectory(self, "Export into folder", self._last_dir())
        if path:
            self.export_to(str(export_folder_in(path, self.export_name())))

    def export_name(self) -> str:
        """A folder name for the current plan, e.g. ``bert_bs16_plan_4603MiB``."""
        workload = self.session.loaded.profile.workload
        model = re.sub(r"[^\w.-]+", "_", str(workload["model"]).rpartition(":")[2] or "model")
        return f"{model}_bs{workload['batch_size']}_plan_{self.session.state.plan.budget_bytes // 2**20}MiB"

    def export_to(self, out_dir: str) -> None:
        """Schedule, rewritten module and report for the current plan, written in the background."""
        from acstudio.export.exporter import export

        state = self.session.state
        self.show_status(f"Exporting to {out_dir}…")
        self.runners["export"].submit(
            lambda progress, cancel: export(self.session.loaded.profile, state.plan, out_dir, progress=progress))

    def _on_exported(self, paths: list[str]) -> None:
        self.show_status(f"Exported {len(paths)} files")
        self.messages.info("Export finished", "Wrote:\n" + "\n".join(str(p) for p in paths))

    def bench_dialog(self) -> BenchDialog:
        """Benchmark settings (window-modal, non-blocking); the run starts when the dialog is accepted."""
        loaded = self.session.loaded
        devices = [tuple(d) for d in (self._environment or {}).get("devices", [])]
        dialog = BenchDialog(loaded.profile.workload["batch_size"], self.budget.budget_bytes(), devices, self)
        self._wants_environment(dialog)
        dialog.accepted.connect(lambda: self.start_bench(dialog.settings))
        dialog.open()
        return dialog

    def start_bench(self, settings: dict) -> None:
        """Run :func:`acstudio.bench.run_bench` on the open profile's workload in the background."""
        out = self.data_dir / "bench" / datetime.now().strftime("%Y%m%d-%H%M%S")
        workload = dict(self.session.loaded.profile.workload)
        self.show_status(f"Benchmarking {', '.join(settings['configs'])} into {out}…")
        self.runners["bench"].submit(partial(run_benchmark, workload, str(out), settings))

    def _on_bench(self, results) -> None:
        """Results table and plot; measured points (same batch as the profile) go on the Pareto chart."""
        df = results.to_frame()
        self.bench_results = results
        self.show_status(f"Benchmark: {len(df)} measurements")
        ok = df[(df["status"] == "ok") & (df["batch_size"] == self.session.loaded.profile.workload["batch_size"])]
        captured = ok[ok["config"] == "captured"]
        rewritten = ok[ok["kind"] == "rewritten"]
        if len(captured) and len(rewritten):
            base = float(captured["time_ms_median"].iloc[0])
            extra = np.concatenate([[0.0], rewritten["time_ms_median"].to_numpy(float) - base])
            peaks = np.concatenate([captured["peak_bytes"].to_numpy(float), rewritten["peak_bytes"].to_numpy(float)])
            self.budget.set_measured(extra, peaks)
        columns = [c for c in ("batch_size", "config", "status", "peak_mib", "time_ms_median", "time_ms_iqr",
                               "overhead_pct", "memory_saving_pct", "message") if c in df.columns]
        self.bench_window = TableDialog("Benchmark results", df[columns], ("peak_mib", "time_ms_median"), self)
        self.bench_window.show()

    # -- jobs and status -------------------------------------------------------------------------------------
    def cancel_jobs(self) -> None:
        for name in USER_JOBS:
            self.runners[name].cancel()

    def _on_progress(self, name: str, done: int, total: int, message: str) -> None:
        if name not in USER_JOBS:
            return
        self.progress.setRange(0, max(total, 1))
        self.progress.setValue(min(done, max(total, 1)))
        # opening a file is one step to the user; the planner's inner steps stay behind the progress bar
        self.show_status(f"Opening {Path(self._opening).name}…" if name == "load" else f"{name}: {message}")

    def _update_busy(self, _busy: bool = False) -> None:
        """Progress bar and Cancel for the jobs the user started; the background look-ups stay quiet."""
        busy = any(self.runners[name].busy for name in USER_JOBS)
        self.progress.setVisible(busy)
        self.cancel_button.setVisible(busy)
        if busy:
            self.progress.setRange(0, 0)

    def _on_job_failed(self, name: str, message: str, details: str) -> None:
        if name == "sweep":  # the chart just lacks the other solvers' points: not worth a dialog
            self.show_status(f"Other solvers' curves unavailable: {message}")
            return
        titles = {"load": "Cannot open the file", "profile": "Profiling failed", "export": "Export failed",
                  "bench": "Benchmark failed", "probe": "Cannot list models and devices"}
        self._error(titles.get(name, name), message, details)

    def _error(self, title: str, message: str, details: str = "") -> None:
        self.show_status(f"{title}: {message}")
        self.messages.error(title, message, details)

    def show_status(self, text: str) -> None:
        self.status_label.setText(text)

    # -- layout persistence and shutdown ---------------------------------------------------------------------
    def _restore_layout(self) -> None:
        geometry = self.settings.value("geometry")
        state = self.settings.value("window_state")
        if geometry is not None:
            self.restoreGeometry(geometry)
        if state is not None:
            self.restoreState(state)

    def closeEvent(self, event) -> None:
        """Save the layout, cancel every job and wait for the worker threads, so nothing outlives the window."""
        self.settings.setValue("geometry", self.saveGeometry())
        self.settings.setValue("window_state", self.saveState())
        self.settings.sync()
        for runner in self.runners.values():
            runner.shutdown()
        self.session.shutdown()
        self.graph.shutdown()
        self._garbage.timer.stop()
        gc.enable()
        gc.collect()  # the worker threads are gone: collect here, in the GUI thread
        super().closeEvent(event)

    def wait_idle(self, timeout_s: float = 60.0) -> bool:
        """Process events until no job is running and the inspector shows the current plan (``--screenshot``
        and tests)."""
        from PySide6.QtWidgets import QApplication

        deadline = time.monotonic() + timeout_s
        runners = [*self.runners.values(), self.session, self.graph.runner]
        while time.monotonic() < deadline:
            QApplication.processEvents()
            if not any(r.busy for r in runners) and not self._inspector_timer.isActive():
                QApplication.processEvents()
                return True
            time.sleep(0.005)
        return False


def run_benchmark(workload: dict, out_dir: str, settings: dict, progress=None, cancel=None):
    """The benchmark job: every configuration in its own process (see :mod:`acstudio.bench`)."""
    from acstudio.bench import run_bench
    from acstudio.workload import WorkloadSpec

    return run_bench(WorkloadSpec.from_dict(workload), settings["batch_sizes"], settings["configs"],
                     device=settings["device"], out_dir=out_dir, progress=progress, cancel=cancel,
                     fit_budget=settings["fit_budget"], warmup=settings["warmup"], iters=settings["iters"])


def profile_and_prepare(spec: dict, device: str, path: str, progress=None, cancel=None, on_memory=None) -> Loaded:
    """Profile in a child process (saving the profile to ``path``), then prepare it for display."""
    profile_in_child(spec, device, path, progress, cancel, on_memory)
    return prepare(Profile.load(path), path, progress, cancel)

