"""Budget panel: slider and spin box in GiB, solver choice, live prediction, and the Pareto chart.

The slider emits ``budgetPreview`` on every tick (cheap consumers only: the timeline's budget line) and
``budgetChanged`` once dragging pauses for :data:`DEBOUNCE_MS` or the slider is released (superqt's
``qdebounced`` idea), so a fast drag costs a handful of plan look-ups, not one per pixel.
"""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer, Signal
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
from acstudio.units import format_bytes
from acstudio.views.pareto import pareto_shape

GIB = float(2**30)
STEPS = 1000  # slider resolution between the floor and the baseline peak
DEBOUNCE_MS = 40


class BudgetPanel(QWidget):
    budgetChanged = Signal(object)  # bytes (may exceed 32 bits)
    budgetPreview = Signal(object)
    solverChanged = Signal(str)

    def __init__(self, solvers: tuple[str, ...], parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._floor, self._top = 0, 1
        self._budget = 0  # bytes, exact: the slider shows it at its resolution, a line drag sets it to the byte
        self._syncing = False
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
        self.solver.currentTextChanged.connect(self.solverChanged)
        self.range_label = QLabel("")
        self.peak_label = QLabel("–")
        self.extra_label = QLabel("–")
        self.status_label = QLabel("–")
        self.status_label.setWordWrap(True)
        self.count_label = QLabel("–")
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

    # -- range and value -------------------------------------------------------------------------------------
    def set_range(self, floor_bytes: int, top_bytes: int) -> None:
        self._floor, self._top = int(floor_bytes), max(int(top_bytes), int(floor_bytes) + 1)
        self._syncing = True
        try:
            self.spin.setRange(self._floor / GIB, self._top / GIB)
            self.spin.setSingleStep(max((self._top - self._floor) / GIB / 50, 0.001))
        finally:
            self._syncing = False
        self.range_label.setText(f"floor {format_bytes(self._floor)} · no checkpointing {format_bytes(self._top)}")

    def budget_bytes(self) -> int:
        return self._budget

    def slider_bytes(self, value: int | None = None) -> int:
        """The budget at slider position ``value`` (default: where the slider is)."""
        value = self.slider.value() if value is None else value
        return round(self._floor + (self._top - self._floor) * value / STEPS)

    def set_budget(self, budget_bytes: int) -> None:
        """Move slider and spin box to ``budget_bytes`` without emitting anything."""
        self._budget = int(budget_bytes)
        self._syncing = True
        try:
            frac = (budget_bytes - self._floor) / (self._top - self._floor)
            self.slider.setValue(round(min(max(frac, 0.0), 1.0) * STEPS))
            self.spin.setValue(budget_bytes / GIB)
        finally:
            self._syncing = False

    def drag_to(self, budget_bytes: int) -> None:
        """Follow a drag elsewhere (the timeline's budget line): preview now, commit when it pauses."""
        self.set_budget(budget_bytes)
        self._debounce.start()

    def _on_slider(self, _value: int) -> None:
        if self._syncing:
            return
        budget = self._budget = self.slider_bytes()
        self._syncing = True
        try:
            self.spin.setValue(budget / GIB)
        finally:
            self._syncing = False
        self.budgetPreview.emit(budget)
        self._debounce.start()

    def _commit(self) -> None:
        self._debounce.stop()
        if not self._syncing:
            self.budgetChanged.emit(self.budget_bytes())

    def _on_spin(self, gib: float) -> None:
        if self._syncing:
            return
        budget = round(gib * GIB)
        self.set_budget(budget)
        self.budgetPreview.emit(budget)
        self.budgetChanged.emit(budget)

    # -- prediction and Pareto chart -------------------------------------------------------------------------
    def show_prediction(self, peak_bytes: int, extra_ms: float, iteration_ms: float, recomputed: int,
                        candidates: int, feasible: bool, reason: str) -> None:
        self.peak_label.setText(format_bytes(peak_bytes))
        pct = f" ({100 * extra_ms / iteration_ms:.1f}% of {iteration_ms:.1f} ms)" if iteration_ms > 0 else ""
        self.extra_label.setText(f"{extra_ms:.2f} ms{pct}")
        self.count_label.setText(f"{recomputed} of {candidates} activations")
        colour = "#207020" if feasible else "#b01010"
        text = "fits the budget" if feasible else "does not fit"
        # the headline already says whether the budget is met: keep only what the reason adds
        for said in ("budget met", "budget not met"):
            reason = reason.removeprefix(said).lstrip(";, ")
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

    def set_current(self, extra_ms: float, peak_bytes: int) -> None:
        self.current.setData([float(extra_ms)], [peak_bytes / GIB])
