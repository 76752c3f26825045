"""Memory timeline: simulated memory over node order, stacked by category, with the budget as a draggable line.

Curves are created once per profile and updated with ``setData`` on every plan change; pyqtgraph's peak
downsampling and clip-to-view keep a 13k-node iteration cheap to repaint. The plan's stacked categories are
drawn as cumulative curves, each filled down to zero, top category first so the lower ones paint over it.
"""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPointF, Signal
from PySide6.QtGui import QBrush, QColor, QTransform
from PySide6.QtWidgets import QGraphicsItem, QGraphicsSimpleTextItem, QVBoxLayout, QWidget

from acstudio.plan.budget import format_bytes
from acstudio.profile.model import Profile
from acstudio.simulate import TIMELINE_CATEGORIES

GIB = float(2**30)
MAX_POINTS = 1600  # points drawn per curve: about one per pixel column; more only slows the fill down
CATEGORY_COLOURS = {
    "parameter": (120, 120, 130),
    "gradient": (230, 160, 60),
    "optimizer_state": (150, 110, 190),
    "retained_activations": (70, 130, 220),
    "recompute_transients": (220, 70, 70),
    "other": (170, 200, 170),
}
REGION_BANDS = {"forward": (90, 150, 230, 28), "loss": (240, 200, 90, 40), "backward": (90, 200, 130, 28),
                "optimizer": (180, 130, 220, 28)}


def bin_starts(n: int, max_points: int = MAX_POINTS) -> np.ndarray:
    """First node index of each bin when ``n`` nodes are drawn as at most ``max_points`` points."""
    step = max(1, -(-n // max_points))
    return np.arange(0, n, step)


def peak_binned(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Maximum of each bin along the first axis, so no peak disappears from the drawing."""
    return np.maximum.reduceat(values, starts, axis=0) if len(values) else values


def cache_pixmaps(*items: QGraphicsItem) -> None:
    """Draw ``items`` from a cached pixmap until they change: moving the budget line or the current point then
    repaints a blit instead of every fill, axis label and legend entry (about 4 times cheaper)."""
    for item in items:
        item.setCacheMode(QGraphicsItem.CacheMode.DeviceCoordinateCache)


def label_item(colour: tuple[int, int, int]) -> QGraphicsSimpleTextItem:
    """A text label of constant pixel size at a data position.

    pyqtgraph's ``TextItem`` repaints itself forever with this PySide6 (its paint updates its transform, which
    schedules another paint: 60 repaints a second of an idle window), so plain Qt text items are used.
    """
    item = QGraphicsSimpleTextItem()
    item.setFlag(QGraphicsItem.GraphicsItemFlag.ItemIgnoresTransformations)
    item.setBrush(QBrush(QColor(*colour)))
    return item


def set_label(item: QGraphicsSimpleTextItem, text: str, x: float, y: float, centred: bool = False) -> None:
    """Place ``text`` at data (x, y): its top-left corner there, or centred just above it."""
    item.setText(text)
    item.setPos(x, y)
    rect = item.boundingRect()
    item.setTransform(QTransform.fromTranslate(-rect.width() / 2, -rect.height() - 8) if centred else QTransform())


def region_spans(profile: Profile) -> list[tuple[str, int, int]]:
    """Contiguous runs of one region over node order: (region, first index, last index)."""
    spans: list[tuple[str, int, int]] = []
    for i, n in enumerate(profile.nodes):
        if spans and spans[-1][0] == n.region:
            spans[-1] = (n.region, spans[-1][1], i)
        else:
            spans.append((n.region, i, i))
    return spans


class TimelineView(QWidget):
    """The timeline plot. ``budgetDragged`` fires while the budget line is dragged (bytes)."""

    budgetDragged = Signal(object)  # bytes (may exceed 32 bits)
    nodeClicked = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.plot = pg.PlotWidget(background="w")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.plot)
        item = self.plot.getPlotItem()
        item.setLabel("left", "memory (GiB)")
        item.setLabel("bottom", "node (execution order)")
        item.showGrid(x=False, y=True, alpha=0.3)
        item.setDownsampling(auto=True, mode="peak")
        item.setClipToView(True)
        for axis in ("left", "bottom"):
            item.getAxis(axis).enableAutoSIPrefix(False)
        # top left: before the forward pass only the model state is in memory, so the plot is empty there
        self.legend = item.addLegend(offset=(70, 10), labelTextSize="7pt", colCount=2, labelTextColor=(30, 30, 30),
                                     brush=pg.mkBrush(255, 255, 255, 210), pen=pg.mkPen(200, 200, 200))
        self.stack: dict[str, pg.PlotDataItem] = {}
        for z, cat in enumerate(reversed(TIMELINE_CATEGORIES)):
            r, g, b = CATEGORY_COLOURS.get(cat, (160, 160, 160))
            curve = item.plot([], [], pen=pg.mkPen((r, g, b), width=1), fillLevel=0,
                              brush=pg.mkBrush(r, g, b, 170), name=cat.replace("_", " "))
            curve.setZValue(z)
            self.stack[cat] = curve
        self.baseline = item.plot([], [], pen=pg.mkPen((40, 40, 40), width=1, style=pg.QtCore.Qt.PenStyle.DashLine),
                                  name="no checkpointing")
        self.baseline.setZValue(20)
        self.measured = item.plot([], [], pen=pg.mkPen((0, 160, 160), width=1), name="measured (profile)")
        self.measured.setZValue(21)
        self.peak = pg.ScatterPlotItem(size=10, brush=pg.mkBrush(220, 30, 30), pen=pg.mkPen("k"), symbol="t")
        self.peak.setZValue(30)
        item.addItem(self.peak)
        self.peak_text = label_item((180, 20, 20))
        self.peak_text.setZValue(30)
        item.addItem(self.peak_text, ignoreBounds=True)
        self.budget_line = pg.InfiniteLine(angle=0, movable=True, pen=pg.mkPen((200, 0, 0), width=2),
                                           hoverPen=pg.mkPen((255, 80, 0), width=3),
                                           label="budget {value:.3f} GiB",
                                           labelOpts={"position": 0.9, "color": (200, 0, 0), "movable": True})
        self.budget_line.setZValue(40)
        self.budget_line.sigPositionChanged.connect(self._on_line_moved)
        item.addItem(self.budget_line)
        self.cursor = pg.InfiniteLine(angle=90, movable=False, pen=pg.mkPen((0, 0, 0), width=1))
        self.cursor.setZValue(41)
        self.cursor.hide()
        item.addItem(self.cursor)
        cache_pixmaps(*(c.curve for c in self.stack.values()), self.baseline.curve, self.measured.curve,
                      item.getAxis("left"), item.getAxis("bottom"), self.legend)
        self._bands: list[QGraphicsItem] = []
        self._labels: list[tuple[QGraphicsSimpleTextItem, str, int]] = []
        self._profile: Profile | None = None
        self._x = np.zeros(0)
        self._starts = np.zeros(0, dtype=np.int64)
        self._cum = np.zeros((0, len(TIMELINE_CATEGORIES)))
        self._syncing = False
        self._live: np.ndarray | None = None
        self._hover = pg.SignalProxy(self.plot.scene().sigMouseMoved, rateLimit=30, slot=self._on_hover)
        self.plot.scene().sigMouseClicked.connect(self._on_click)

    # -- data ------------------------------------------------------------------------------------------------
    def set_profile(self, profile: Profile, baseline_total: np.ndarray, floor_bytes: int) -> None:
        """New profile: bands, measured curve and baseline; the budget line may move from the floor up."""
        self._profile = profile
        self._live = None
        n = len(profile.nodes)
        self._starts = bin_starts(n)
        self._x = self._starts.astype(float)
        self._cum = np.zeros((0, len(TIMELINE_CATEGORIES)))
        item = self.plot.getPlotItem()
        self._clear_bands()
        for region, lo, hi in region_spans(profile):
            colour = REGION_BANDS.get(region)
            if colour is None:
                continue
            band = pg.LinearRegionItem((lo - 0.5, hi + 0.5), movable=False, brush=pg.mkBrush(*colour),
                                       pen=pg.mkPen(None))
            band.setZValue(-10)
            cache_pixmaps(band)
            item.addItem(band)
            self._bands.append(band)
            if hi - lo > 0.04 * n:  # no room for a label on a sliver (the loss is a handful of nodes)
                label = label_item((90, 90, 90))
                label.setZValue(-9)
                item.addItem(label, ignoreBounds=True)
                self._bands.append(label)
                self._labels.append((label, region, lo))
        self.baseline.setData(self._x, peak_binned(baseline_total / GIB, self._starts))
        measured = np.asarray([nd.mem_peak for nd in profile.nodes], dtype=float)
        if measured.any():
            self.measured.setData(self._x, peak_binned(measured / GIB, self._starts))
        else:
            self.measured.setData([], [])
        top = max(float(baseline_total.max(initial=0)), float(measured.max(initial=0)))
        self.budget_line.setBounds((floor_bytes / GIB, top / GIB * 1.05))
        for label, region, lo in self._labels:
            set_label(label, region, lo, top / GIB * 1.1)
        item.setXRange(0, max(n - 1, 1), padding=0.01)
        item.setYRange(0, top / GIB * 1.12, padding=0)
        self.cursor.hide()

    def _clear_bands(self) -> None:
        item = self.plot.getPlotItem()
        for band in self._bands:
            item.removeItem(band)
        self._bands = []
        self._labels = []

    def show_live(self, start: int, peaks: list[int], n: int) -> None:
        """Draw the memory curve of a profile while it is being measured (``peaks`` for nodes from ``start``).

        The plan view (stack, baseline, bands) is cleared on the first chunk and comes back when the finished
        profile is loaded with :meth:`set_profile`.
        """
        item = self.plot.getPlotItem()
        if self._live is None or len(self._live) != n or start == 0:
            self._live = np.full(n, np.nan)
            self._profile = None
            self._cum = np.zeros((0, len(TIMELINE_CATEGORIES)))
            for curve in (*self.stack.values(), self.baseline):
                curve.setData([], [])
            self.peak.setData([], [])
            self.peak_text.setText("")
            self._clear_bands()
            item.setXRange(0, max(n - 1, 1), padding=0.01)
        self._live[start:start + len(peaks)] = peaks
        filled = start + len(peaks)
        values = self._live[:filled] / GIB
        self.measured.setData(np.arange(filled, dtype=float), values)
        item.setYRange(0, max(float(np.nanmax(values, initial=0.0)), 1e-3) * 1.12, padding=0)

    def set_timeline(self, timeline: np.ndarray, peak_index: int, peak_bytes: int) -> None:
        """Show one simulated plan: ``timeline`` is (nodes, categories) bytes, as the simulator returns it."""
        self._cum = np.cumsum(np.asarray(timeline, dtype=float), axis=1) / GIB
        drawn = peak_binned(self._cum, self._starts)
        for k, cat in enumerate(TIMELINE_CATEGORIES):
            self.stack[cat].setData(self._x, drawn[:, k])
        if 0 <= peak_index < len(self._x):
            self.peak.setData([float(peak_index)], [peak_bytes / GIB])
            set_label(self.peak_text, f"peak {format_bytes(peak_bytes)}", float(peak_index), peak_bytes / GIB,
                      centred=True)

    def stacked_total(self) -> np.ndarray:
        """Top of the shown stack, bytes per node (the drawing is its per-bin maximum)."""
        return self._cum[:, -1] * GIB if len(self._cum) else np.zeros(0)

    def set_budget(self, budget_bytes: int) -> None:
        self._syncing = True
        try:
            self.budget_line.setValue(budget_bytes / GIB)
        finally:
            self._syncing = False

    def set_cursor(self, node_id: str) -> None:
        if self._profile is None or node_id not in self._profile.node_index:
            self.cursor.hide()
            return
        self.cursor.setValue(self._profile.node_index[node_id])
        self.cursor.show()

    # -- interaction -----------------------------------------------------------------------------------------
    def _on_line_moved(self, line: pg.InfiniteLine) -> None:
        if not self._syncing:
            self.budgetDragged.emit(round(line.value() * GIB))

    def _node_at(self, scene_pos: QPointF) -> int | None:
        if self._profile is None or not self.plot.sceneBoundingRect().contains(scene_pos):
            return None
        x = self.plot.getPlotItem().vb.mapSceneToView(scene_pos).x()
        i = round(x)
        return i if 0 <= i < len(self._profile.nodes) else None

    def _on_hover(self, args) -> None:
        i = self._node_at(args[0])
        if i is None:
            self.plot.setToolTip("")
            return
        n = self._profile.nodes[i]
        parts = [f"{n.id} {n.name} ({n.target})", f"{n.region} · {n.module or '-'}"]
        if i < len(self._cum):
            for k, cat in enumerate(TIMELINE_CATEGORIES):
                parts.append(f"up to {cat.replace('_', ' ')}: {format_bytes(int(self._cum[i, k] * GIB))}")
        if n.mem_peak:
            parts.append(f"measured peak: {format_bytes(n.mem_peak)}")
        self.plot.setToolTip("\n".join(parts))

    def _on_click(self, event) -> None:
        if event.button() != pg.QtCore.Qt.MouseButton.LeftButton:
            return
        i = self._node_at(event.scenePos())
        if i is not None:
            self.nodeClicked.emit(self._profile.nodes[i].id)

