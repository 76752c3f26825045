"""The main window: docks, menus, the status bar and the background jobs the user starts.

The window holds the one :class:`~acstudio.views.session.Session`; every view takes it and follows it, so nothing
here passes plans, budgets or selections between views. Every long call runs in a job; every error the user can
cause ends in :class:`~acstudio.gui.dialogs.Messages` and leaves what is loaded untouched.
"""

from __future__ import annotations

import os
import time
from datetime import datetime
from functools import partial
from pathlib import Path

from PySide6.QtCore import QSettings, QStandardPaths, Qt, Signal
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import QApplication, QDockWidget, QFileDialog, QLabel, QMainWindow, QSplitter

from acstudio.gui.activation_table import ActivationTable
from acstudio.gui.budget_panel import BudgetPanel
from acstudio.gui.dialogs import (
    BenchDialog,
    EnvironmentProbe,
    Messages,
    NewProfileDialog,
    RecentFiles,
    bench_results_dialog,
)
from acstudio.gui.graph_view import GraphView
from acstudio.gui.inspector import Inspector
from acstudio.gui.jobs import QtJobs, WindowJobs, share_interpreter_with_jobs, stop_sharing_interpreter
from acstudio.gui.qtcompat import make_singletons_immortal
from acstudio.gui.timeline import TimelineView
from acstudio.plan.model import Plan
from acstudio.plan.solvers import SOLVERS
from acstudio.units import format_bytes
from acstudio.views import documents
from acstudio.views.child import sweep_in_child
from acstudio.views.documents import Loaded, open_document
from acstudio.views.session import Session

USER_JOBS = ("load", "profile", "export", "bench")  # shown with a progress bar and Cancel
JOB_TITLES = {"load": "Cannot open the file", "profile": "Profiling failed", "export": "Export failed",
              "bench": "Benchmark failed", "probe": "Cannot list models and devices"}
FILE_FILTER = "AC Studio files (*.json.gz *.json);;All files (*)"
FOLDERS = QStandardPaths.StandardLocation


def user_folder(location: QStandardPaths.StandardLocation, *parts: str) -> str:
    """Where this platform keeps the user's files of the kind ``location`` names (and ``parts`` under it)."""
    return os.path.join(QStandardPaths.writableLocation(location), *parts)


class MainWindow(QMainWindow):
    liveMemory = Signal(int, object, int)  # (first node, peak bytes per node, nodes): a profile being measured
    floorExplained = Signal(str, str)  # (profile path, what sets its AC floor), from the sweep's child process
    sweepRowsReady = Signal(str, list)  # (profile path, the sweep's rows but the programs'), before it ends

    def __init__(self, settings: QSettings | None = None, cache_dir: str | None = None,
                 messages: Messages | None = None, data_dir: str | None = None) -> None:
        """``cache_dir`` holds graph layouts, ``data_dir`` new profiles and benchmark results."""
        make_singletons_immortal()
        self._garbage = share_interpreter_with_jobs()  # closeEvent stops it
        super().__init__()
        self.data_dir = Path(data_dir or user_folder(FOLDERS.AppDataLocation))
        self.setWindowTitle("AC Studio")
        self.setAcceptDrops(True)
        screen = self.screen().availableGeometry()
        self.resize(min(1600, screen.width()), min(1000, screen.height()))
        self.settings = settings if settings is not None else QSettings("AC Studio", "acstudio")
        self.messages = messages or Messages(self)
        self.session = session = Session(QtJobs(self))
        self.graph = GraphView(session, cache_dir or user_folder(FOLDERS.CacheLocation, "layouts"))
        self.timeline = TimelineView(session)
        self.liveMemory.connect(self.timeline.show_live)
        self.budget = BudgetPanel(session, tuple(SOLVERS))
        self.inspector = Inspector(session)
        self.activations = ActivationTable(session)
        self.table, self.table_model, self.table_proxy = (self.activations.view, self.activations.model,
                                                          self.activations.proxy)
        # The graph runs top to bottom, so it gets the window's height; the timeline and the table share the
        # middle; the budget and the inspector sit on the right.
        right = QSplitter(Qt.Orientation.Vertical)
        right.addWidget(self.timeline)
        right.addWidget(self.activations)
        right.setSizes([480, 400])
        splitter = QSplitter(Qt.Orientation.Horizontal)
        splitter.addWidget(self.graph)
        splitter.addWidget(right)
        splitter.setSizes([430, 770])
        self.setCentralWidget(splitter)
        docks = [QDockWidget(title, self, objectName=name, widget=widget) for title, name, widget in
                 (("Budget", "budget_dock", self.budget), ("Inspector", "inspector_dock", self.inspector))]
        for dock in docks:  # saveState needs their names
            self.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, dock)
        self.resizeDocks(docks, [560, 320], Qt.Orientation.Vertical)
        self.resizeDocks(docks[:1], [400], Qt.Orientation.Horizontal)

        self.status_label = QLabel("")
        self.statusBar().addWidget(self.status_label, 1)
        # lasting notes (graphviz missing) stay on the right while they apply; events come and go on the left
        self.notice_label = QLabel("")
        self.statusBar().addPermanentWidget(self.notice_label)
        self.graph.noticeChanged.connect(self.notice_label.setText)
        self.runners = WindowJobs(("load", "profile", "probe", "sweep", "export", "bench"), USER_JOBS,
                                  self.statusBar())
        self.progress, self.cancel_button = self.runners.progress, self.runners.cancel_button
        self.runners.progressed.connect(self._on_progress)
        self.runners.failed.connect(self._on_job_failed)
        for name, runner in self.runners.runners.items():
            runner.cancelled.connect(partial(self.show_status, f"{name}: cancelled"))
        self.runners["profile"].failed.connect(lambda *_: self.timeline.show_session())
        self.runners["profile"].cancelled.connect(self.timeline.show_session)
        for name, on_result in (("load", self._on_opened), ("profile", self._on_profiled),
                                ("sweep", lambda rows: session.show_other_solvers(session.loaded.path, rows)),
                                ("export", self._on_exported), ("bench", self._on_bench)):
            self.runners[name].resultReady.connect(on_result)
        self.floorExplained.connect(session.set_floor_note)
        self.sweepRowsReady.connect(session.show_other_solvers)
        session.events.loaded.connect(self._on_loaded)
        session.events.plan.connect(self._on_plan)
        session.events.planning.connect(
            lambda solver, budget: self.show_status(f"Planning with {solver} for {format_bytes(budget)}…"))
        self.activations.statusMessage.connect(self.show_status)
        session.events.failed.connect(lambda message, details: self._error("Planning failed", message, details))
        self.environment = EnvironmentProbe(self.runners["probe"])
        self.bench_results = self.bench_window = None  # the last BenchResults, and the window showing them
        self._opening = ""
        self._waiting_first_plan = False  # a profile opened and its first plan is not complete yet
        self._build_menus()
        for value, restore in ((self.settings.value("geometry"), self.restoreGeometry),
                               (self.settings.value("window_state"), self.restoreState)):
            if value is not None:
                restore(value)

    # -- menus -----------------------------------------------------------------------------------------------
    def _build_menus(self) -> None:
        file_menu = self.menuBar().addMenu("&File")
        self._action(file_menu, "&New profile…", self.new_profile_dialog, QKeySequence.StandardKey.New)
        self._action(file_menu, "&Open…", self.open_dialog, QKeySequence.StandardKey.Open)
        self.recent = RecentFiles(self.settings, file_menu.addMenu("Open &recent"), self.open_path)
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
        self._update_actions()

    def _action(self, menu, text: str, slot, shortcut=None) -> QAction:
        action = menu.addAction(text)
        if shortcut is not None:
            action.setShortcut(QKeySequence(shortcut))
        action.triggered.connect(lambda _checked=False: slot())
        return action

    def _update_actions(self) -> None:
        for action in (self.save_plan_action, self.export_action):
            action.setEnabled(self.session.state is not None)
        self.bench_action.setEnabled(self.session.loaded is not None)

    # -- files -----------------------------------------------------------------------------------------------
    def open_dialog(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open profile, plan or benchmark results", self.recent.last_dir(),
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

    def _on_opened(self, result) -> None:
        self.recent.add(self._opening)
        if isinstance(result, Loaded):
            self.session.set_loaded(result)
        elif isinstance(result, Plan):
            self.session.show_plan(result)
            self.show_status(f"Plan {Path(self._opening).name}: {result.solver}, "
                             f"budget {format_bytes(result.budget_bytes)}")
        else:
            self._on_bench(result)

    def dragEnterEvent(self, event) -> None:
        if any(u.isLocalFile() for u in event.mimeData().urls()):
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
        self.environment.give(dialog)
        dialog.accepted.connect(lambda: self.start_profile(dialog.result_spec, dialog.device_string()))
        dialog.open()
        return dialog

    def start_profile(self, spec: dict, device: str) -> None:
        """Profile ``spec`` (``WorkloadSpec.to_dict()``) on ``device`` in a child process, saving the profile under the
        data folder (so that it can be reopened from the recent files), then open it. The child streams the measured
        memory curve: ``liveMemory`` carries it to the timeline on the GUI thread."""
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        path = self.data_dir / "profiles" / documents.new_profile_name(spec, device, stamp)
        self.show_status(f"Profiling {spec['model']} (batch {spec['batch_size']}) on {device}…")
        self.runners["profile"].submit(partial(documents.profile_and_prepare, spec, device, str(path),
                                               on_memory=self.liveMemory.emit))

    def _on_profiled(self, loaded: Loaded) -> None:
        self.recent.add(loaded.path)
        self.session.set_loaded(loaded)
        self.show_status(f"Profiled {loaded.profile.label}; saved to {loaded.path}")

    # -- following the session: title, status, actions and the jobs a new profile starts ---------------------
    def _on_loaded(self, loaded: Loaded) -> None:
        profile = loaded.profile
        self.setWindowTitle(f"AC Studio – {profile.label} – {Path(loaded.path).name}")
        self._waiting_first_plan = True
        self.runners["sweep"].cancel()
        self._update_actions()
        self.show_status(documents.loaded_message(loaded, self.session.floor_bytes))

    def _on_plan(self, state) -> None:
        """What the first paint does not need starts once the opened profile's first plan is complete: the other
        solvers' sweep and what sets the floor (a child process), and the graph's layouts one click away."""
        self._update_actions()
        if not (state.complete and self._waiting_first_plan):
            return
        self._waiting_first_plan = False
        path = self.session.loaded.path
        self.runners["sweep"].submit(partial(sweep_in_child, path,
                                             on_floor=lambda note: self.floorExplained.emit(path, note),
                                             on_rows=lambda rows: self.sweepRowsReady.emit(path, rows)))
        self.graph.allow_prefetch()

    # -- plan files, export, benchmark -----------------------------------------------------------------------
    def save_plan_dialog(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Save plan", self.recent.last_dir(), FILE_FILTER)
        if path:
            self.save_plan(path)

    def save_plan(self, path: str) -> None:
        try:
            self.session.state.plan.save(path)
        except (OSError, ValueError) as exc:
            self._error("Cannot save the plan", str(exc))
            return
        self.recent.add(path)
        self.show_status(f"Plan saved to {path}")

    def export_dialog(self) -> None:
        from acstudio.export.exporter import export_folder_in

        path = QFileDialog.getExistingDirectory(self, "Export into folder", self.recent.last_dir())
        if path:
            name = documents.export_name(self.session.loaded.profile, self.session.state.plan)
            self.export_to(str(export_folder_in(path, name)))

    def export_to(self, out_dir: str) -> None:
        """Schedule, rewritten module and report for the current plan, written in the background."""
        from acstudio.export.exporter import export

        profile, plan = self.session.loaded.profile, self.session.state.plan
        self.show_status(f"Exporting to {out_dir}…")
        self.runners["export"].submit(lambda progress, cancel: export(profile, plan, out_dir, progress=progress))

    def _on_exported(self, paths: list[str]) -> None:
        self.show_status(f"Exported {len(paths)} files")
        self.messages.info("Export finished", "Wrote:\n" + "\n".join(str(p) for p in paths))

    def bench_dialog(self) -> BenchDialog:
        """Benchmark settings (window-modal, non-blocking); the run starts when the dialog is accepted."""
        dialog = BenchDialog(self.session.loaded.profile.workload["batch_size"], self.session.budget,
                             self.environment.devices(), self)
        self.environment.give(dialog)
        dialog.accepted.connect(lambda: self.start_bench(dialog.settings))
        dialog.open()
        return dialog

    def start_bench(self, settings: dict) -> None:
        """Run :func:`acstudio.bench.run_bench` on the open profile's workload in the background."""
        out = self.data_dir / "bench" / datetime.now().strftime("%Y%m%d-%H%M%S")
        self.show_status(f"Benchmarking {', '.join(settings['configs'])} into {out}…")
        self.runners["bench"].submit(partial(documents.run_benchmark, dict(self.session.loaded.profile.workload),
                                             str(out), settings))

    def _on_bench(self, results) -> None:
        """Results table and plot; measured points (same batch as the profile) go on the Pareto chart."""
        df = results.to_frame()
        self.bench_results = results
        self.show_status(f"Benchmark: {len(df)} measurements")
        self.session.show_measured(df)
        self.bench_window = bench_results_dialog(df, self)
        self.bench_window.show()

    # -- jobs, status and shutdown ---------------------------------------------------------------------------
    def _on_progress(self, name: str, message: str) -> None:
        # opening a file is one step to the user; the planner's inner steps stay behind the progress bar
        self.show_status(f"Opening {Path(self._opening).name}…" if name == "load" else f"{name}: {message}")

    def _on_job_failed(self, name: str, message: str, details: str) -> None:
        if name == "sweep":  # the chart just lacks the other solvers' points: not worth a dialog
            self.show_status(f"Other solvers' curves unavailable: {message}")
            return
        self._error(JOB_TITLES.get(name, name), message, details)

    def _error(self, title: str, message: str, details: str = "") -> None:
        self.show_status(f"{title}: {message}")
        self.messages.error(title, message, details)

    def show_status(self, text: str) -> None:
        self.status_label.setText(text)

    def closeEvent(self, event) -> None:
        """Save the layout, cancel every job and wait for the worker threads, so nothing outlives the window."""
        self.settings.setValue("geometry", self.saveGeometry())
        self.settings.setValue("window_state", self.saveState())
        self.settings.sync()
        self.runners.shutdown()
        self.session.shutdown()
        self.graph.shutdown()
        stop_sharing_interpreter(self._garbage)
        super().closeEvent(event)

    def wait_idle(self, timeout_s: float = 60.0) -> bool:
        """Process events until no job runs and the inspector shows the current plan (``--screenshot``, tests)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            QApplication.processEvents()
            if not any(r.busy for r in (self.runners, self.session, self.graph.runner)) and not self.inspector.pending:
                QApplication.processEvents()
                return True
            time.sleep(0.005)
        return False
