"""Budget panel: slider and spin box in GiB, solver choice, live prediction, and the Pareto chart.

Bound to the :class:`~acstudio.views.session.Session`: it draws the session's budget, solver and plan, and writes
the user's moves back to it. Every slider tick shows its budget at once (``final=False``: the timeline's line
follows, nothing is planned); the budget is committed, and planned, once dragging pauses for :data:`DEBOUNCE_MS`
or the slider is released (superqt's ``qdebounced`` idea), so a fast drag costs a handful of plan look-ups, not one
per pixel.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyqtgraph as pg
from PySide6.QtCore import QSignalBlocker, Qt, QTimer
from PySide6.QtWidgets import (
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QSlider,
    QVBoxLayout,
    QWidget,
)

from acstudio.gui.timeline import cache_pixmaps
from acstudio.plan.solvers import LOOKS, TRAJECTORY_SOLVER
from acstudio.simulate.modes import get_mode
from acstudio.units import format_bytes
from acstudio.views.pareto import pareto_shape
from acstudio.views.session import PlanState, Session

GIB = float(2**30)
STEPS = 1000  # slider resolution between the floor and the baseline peak
DEBOUNCE_MS = 40


class BudgetPanel(QWidget):
    """The budget and solver controls and the Pareto chart, bound to ``session``."""

    def __init__(self, session: Session, solvers: tuple[str, ...], parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.session = session
        self._floor, self._top = 0, 1
        self.slider = QSlider(Qt.Orientation.Horizontal)
        self.slider.setRange(0, STEPS)
        self.slider.setToolTip("Memory budget, from the checkpointing floor (left) to the peak without it (right)")
        self.spin = QDoubleSpinBox()
        self.spin.setDecimals(3)
        self.spin.setSuffix(" GiB")
        self.spin.setKeyboardTracking(False)
        self.spin.setSingleStep(0.1)
        self.solver = QComboBox()
        self.solver.addItems(list(solvers))
        self.solver.currentTextChanged.connect(session.set_solver)
        self.range_label = QLabel("")
        self.peak_label = QLabel("–")
        self.extra_label = QLabel("–")
        self.status_label = QLabel("–")
        self.status_label.setWordWrap(True)
        self.count_label = QLabel("–")
        # what a slider step's instant answer is while the plan for its budget is made (empty once it is)
        self.preview_label = QLabel("")
        self.preview_label.setWordWrap(True)
        self.preview_label.setStyleSheet("color: #806000; font-style: italic")
        # Room kept for the longest status and note, even when shorter or empty: a slider step that sets or clears
        # the note, or rewords the status, would otherwise resize the chart below them, which then redraws whole
        # (twice a step, most of the step's time).
        lines = self.preview_label.fontMetrics().lineSpacing()
        self.preview_label.setMinimumHeight(4 * lines)
        self.status_label.setMinimumHeight(3 * lines)
        row = QHBoxLayout()
        row.addWidget(self.slider, 1)
        row.addWidget(self.spin)
        form = QFormLayout()
        form.addRow("Budget", row)
        form.addRow("", self.range_label)
        form.addRow("Solver", self.solver)
        form.addRow("Predicted peak", self.peak_label)
        form.addRow("Extra time", self.extra_label)
        form.addRow("Recomputed", self.count_label)
        form.addRow("Status", self.status_label)
        form.addRow("", self.preview_label)
        self.pareto = pg.PlotWidget(background="w")
        self.pareto.setMinimumHeight(160)
        item = self.pareto.getPlotItem()
        item.setLabel("bottom", "extra time per iteration (ms)")
        item.setLabel("left", "peak (GiB)")
        item.showGrid(x=True, y=True, alpha=0.3)
        for axis in ("left", "bottom"):
            item.getAxis(axis).enableAutoSIPrefix(False)
        legend = item.addLegend(offset=(-10, 10), labelTextSize="7pt", labelTextColor=(30, 30, 30))
        self.curve = item.plot([], [], pen=pg.mkPen(LOOKS[TRAJECTORY_SOLVER].colour, width=2), name="μ-TWO",
                               stepMode=None)
        self.others: dict[str, pg.PlotDataItem] = {}
        self.measured = pg.ScatterPlotItem(size=9, symbol="s", brush=pg.mkBrush(0, 160, 160),
                                           pen=pg.mkPen("k"), name="measured")
        item.addItem(self.measured)
        self.current = pg.ScatterPlotItem(size=13, symbol="o", brush=pg.mkBrush(220, 30, 30), pen=pg.mkPen("k"))
        self.current.setZValue(10)
        item.addItem(self.current)
        cache_pixmaps(self.curve.curve, self.measured, item.getAxis("left"), item.getAxis("bottom"), legend)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(self.pareto, 1)
        self._debounce = QTimer(self)
        self._debounce.setSingleShot(True)
        self._debounce.setInterval(DEBOUNCE_MS)
        self._debounce.timeout.connect(self._commit)
        self.slider.valueChanged.connect(self._on_slider)
        self.slider.sliderReleased.connect(self._commit)
        self.spin.valueChanged.connect(self._on_spin)
        self.setEnabled(False)
        session.events.loaded.connect(self._on_loaded)
        session.events.budget.connect(self._show_budget)
        session.events.solver.connect(self._show_solver)
        session.events.plan.connect(self._on_plan)
        session.events.other_solvers.connect(self._on_other_solvers)
        session.events.measured.connect(self.set_measured)

    # -- following the session -------------------------------------------------------------------------------
    def _on_loaded(self, loaded) -> None:
        self._floor, self._top = self.session.floor_bytes, max(self.session.baseline_bytes,
                                                               self.session.floor_bytes + 1)
        with QSignalBlocker(self.spin):
            self.spin.setRange(self._floor / GIB, self._top / GIB)
            self.spin.setSingleStep(max((self._top - self._floor) / GIB / 50, 0.001))
        self.range_label.setText(f"floor {format_bytes(self._floor)} · no checkpointing {format_bytes(self._top)}")
        curve = loaded.trajectory.curve()
        self.set_curve(curve["extra_ms"].to_numpy(), curve["predicted_peak_bytes"].to_numpy())
        self.clear_others()
        self.setEnabled(True)

    def _show_budget(self, budget_bytes: int) -> None:
        """Slider and spin box at the session's budget (they say nothing back: it came from the session)."""
        frac = (budget_bytes - self._floor) / (self._top - self._floor)
        with QSignalBlocker(self.slider), QSignalBlocker(self.spin):
            self.slider.setValue(round(min(max(frac, 0.0), 1.0) * STEPS))
            self.spin.setValue(budget_bytes / GIB)

    def _show_solver(self, solver: str) -> None:
        with QSignalBlocker(self.solver):
            self.solver.setCurrentText(solver)

    def _on_plan(self, state: PlanState) -> None:
        loaded, plan = self.session.loaded, state.plan
        candidates = len(loaded.profile.activations) - len(loaded.template.excluded)
        how = f"{plan.stop_reason}; {get_mode(plan.replay_mode).summary}"
        self.show_prediction(plan.predicted_peak_bytes, plan.predicted_extra_ms, loaded.profile.iteration_ms,
                             len(plan.recomputed), candidates, plan.feasible, how, len(plan.offloaded))
        self.current.setData([float(plan.predicted_extra_ms)], [plan.predicted_peak_bytes / GIB])
        if self.preview_label.text() != state.note:
            self.preview_label.setText(state.note)

    # -- the user's moves ------------------------------------------------------------------------------------
    def budget_bytes(self) -> int:
        return self.session.budget

    def slider_bytes(self, value: int | None = None) -> int:
        """The budget at slider position ``value`` (default: where the slider is)."""
        value = self.slider.value() if value is None else value
        return round(self._floor + (self._top - self._floor) * value / STEPS)

    def _on_slider(self, _value: int) -> None:
        self.session.set_budget(self.slider_bytes(), final=False)
        self._debounce.start()

    def _commit(self) -> None:
        self._debounce.stop()
        self.session.set_budget(self.session.budget)

    def _on_spin(self, gib: float) -> None:
        self.session.set_budget(round(gib * GIB))

    # -- prediction and Pareto chart -------------------------------------------------------------------------
    def show_prediction(self, peak_bytes: int, extra_ms: float, iteration_ms: float, recomputed: int,
                        candidates: int, feasible: bool, reason: str, offloaded: int = 0) -> None:
        self.peak_label.setText(format_bytes(peak_bytes))
        pct = f" ({100 * extra_ms / iteration_ms:.1f}% of {iteration_ms:.1f} ms)" if iteration_ms > 0 else ""
        self.extra_label.setText(f"{extra_ms:.2f} ms{pct}")
        moved = f"; {offloaded} offloaded to host" if offloaded else ""
        self.count_label.setText(f"{recomputed} of {candidates} activations{moved}")
        colour = "#207020" if feasible else "#b01010"
        text = "fits the budget" if feasible else "does not fit"
        # the headline already says whether the budget is met: keep only what the reason adds
        for said in ("budget met", "budget not met"):
            reason = reason.removeprefix(said).lstrip(";:, ")
        # what followed it in parentheses ("budget met (mutwo's plan)") goes in the one pair around the detail
        aside, close, rest = reason.partition(")")
        if reason.startswith("(") and close:
            reason = aside[1:] + rest
        detail = f" ({reason})" if reason else ""
        self.status_label.setText(f'<span style="color:{colour}"><b>{text}</b></span>{detail}')

    def set_curve(self, extra_ms: np.ndarray, peak_bytes: np.ndarray) -> None:
        """The μ-TWO curve; the view spans it up to where it reaches its floor (the long flat tail is off-screen)."""
        x = np.asarray(extra_ms, dtype=float)
        y = np.asarray(peak_bytes, dtype=float)
        self.curve.setData(x, y / GIB)
        if len(y):
            knee = int(np.argmax(y <= y.min() * 1.01))
            item = self.pareto.getPlotItem()
            item.setXRange(0, max(x[knee] * 1.3, 1e-3), padding=0.02)
            item.setYRange(y.min() / GIB, y.max() / GIB, padding=0.05)

    def set_other(self, solver: str, extra_ms: np.ndarray, peak_bytes: np.ndarray) -> None:
        """Another solver's operating points, drawn as what they are (see :func:`pareto_shape`): a line when
        its sweep traces a curve, markers when it has only a few distinct plans (recompute-all is one point
        per replay mode, not a line across the chart)."""
        old = self.others.pop(solver, None)
        if old is not None:
            self.pareto.getPlotItem().removeItem(old)
            self.pareto.getPlotItem().legend.removeItem(old)
        x, y, as_curve = pareto_shape(extra_ms, peak_bytes)
        look = LOOKS[solver]  # fixed per solver: the same whatever order the rows arrive in
        if as_curve:
            curve = self.pareto.getPlotItem().plot(x, y / GIB, pen=pg.mkPen(look.colour, width=2), name=solver)
        else:
            curve = self.pareto.getPlotItem().plot(x, y / GIB, pen=None, symbol=look.symbol, symbolSize=9,
                                                   symbolBrush=look.colour, symbolPen=pg.mkPen("k"), name=solver)
            curve.setZValue(5)  # baseline points sit on top of any curve
        cache_pixmaps(curve.curve, curve.scatter)
        self.others[solver] = curve

    def _on_other_solvers(self, rows: list[dict]) -> None:
        """Other solvers' operating points. Rows without a peak are notes for the curious (a solver that was
        skipped, and why): they go to the chart's tooltip."""
        df = pd.DataFrame(rows)
        if "peak_bytes" not in df.columns:
            return
        for solver, points in df.dropna(subset=["peak_bytes", "extra_ms"]).groupby("solver"):
            self.set_other(str(solver), points["extra_ms"].to_numpy(), points["peak_bytes"].to_numpy())
        notes = df[df["peak_bytes"].isna()] if "note" in df.columns else df.iloc[:0]
        self.set_notes([f"{row['solver']}: {row['note']}" for _, row in notes.iterrows()])

    def set_notes(self, notes: list[str]) -> None:
        """Remarks about the chart (solvers left out, and why), shown as its tooltip."""
        self.pareto.setToolTip("\n".join(notes))

    def clear_others(self) -> None:
        for curve in self.others.values():
            self.pareto.getPlotItem().removeItem(curve)
            self.pareto.getPlotItem().legend.removeItem(curve)
        self.others = {}
        self.measured.setData([], [])

    def set_measured(self, extra_ms: np.ndarray, peak_bytes: np.ndarray) -> None:
        self.measured.setData(np.asarray(extra_ms, dtype=float), np.asarray(peak_bytes, dtype=float) / GIB)
