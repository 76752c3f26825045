"""Memory timeline: simulated memory over the step (time or execution order), stacked by category, with the
budget as a draggable line, the selected activation's lifetime and a span that selects what is alive in it;
where the profile's device can offload, the copies to the host and back (one lane each) and the host memory they
hold, in two small plots under it that share its x axis.

Bound to the :class:`~acstudio.views.session.Session` (napari's ``QtDims(dims)`` style): it follows the loaded
profile, the budget, the current plan and the selection, and sends clicks, spans and budget-line drags back to the
session. Curves are created once per profile and updated with ``setData`` on every plan change; the plan's stacked
categories are drawn as cumulative curves, each filled down to zero, top category first so the lower ones paint
over it.
"""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPointF, QTimer, Signal
from PySide6.QtGui import QBrush, QColor, QTransform
from PySide6.QtWidgets import (
    QComboBox,
    QGraphicsItem,
    QGraphicsSimpleTextItem,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from acstudio.gui.graph_view import OFFLOADED
from acstudio.profile.model import Profile
from acstudio.simulate import TIMELINE_CATEGORIES, SimResult
from acstudio.units import format_bytes
from acstudio.views.session import Session
from acstudio.views.timeline import (
    AXES,
    COPIED_BACK,
    ON_HOST,
    TimelineAxis,
    copy_spans,
    lifetime_marks,
    node_time_text,
)

GIB = float(2**30)
DRAG_COMMIT_MS = 40  # a budget-line drag is planned for once it pauses this long (as the budget slider is)
MAX_POINTS = 1600  # points drawn per curve: about one per pixel column; more only slows the fill down
CATEGORY_COLOURS = {
    "parameter": (120, 120, 130),
    "gradient": (230, 160, 60),
    "optimizer_state": (150, 110, 190),
    "retained_activations": (70, 130, 220),
    "recompute_transients": (220, 70, 70),
    "other": (170, 200, 170),
}
LIFETIME_COLOUR = (20, 20, 20)
SPAN_BRUSH = (0, 170, 120, 45)
LANES = {"d2h": (1.5, "to host"), "h2d": (0.5, "to device")}  # copy lane -> (its row in the lanes plot, label)
LANES_PX, HOST_PX, LEFT_AXIS_PX = 56, 80, 64  # the link plots' heights; one axis width keeps the three aligned
REGION_BANDS = {"forward": (90, 150, 230, 28), "loss": (240, 200, 90, 40), "backward": (90, 200, 130, 28),
                "optimizer": (180, 130, 220, 28)}


def bin_starts(n: int, max_points: int = MAX_POINTS, first: int = 0) -> np.ndarray:
    """First node index of each bin when nodes ``first..n-1`` are drawn as at most ``max_points`` points."""
    step = max(1, -(-(n - first) // max_points))
    return np.arange(first, n, step)


def peak_binned(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Maximum of each bin along the first axis (rows before ``starts[0]`` are left out), so no peak disappears
    from the drawing."""
    return np.maximum.reduceat(values, starts, axis=0) if len(values) and len(starts) else values[:0]


def legend_html() -> str:
    """The categories' colours as one line of text, drawn above the plot so it never covers the data."""
    swatches = [f'<span style="color:rgb{CATEGORY_COLOURS.get(cat, (160, 160, 160))}">■</span> '
                f'{cat.replace("_", " ")}' for cat in reversed(TIMELINE_CATEGORIES)]
    return ("&nbsp; ".join(swatches) + ' &nbsp; <span style="color:#282828">- - no checkpointing</span>'
            ' &nbsp; <span style="color:#00a0a0">— measured</span>')


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
    """The timeline plot bound to ``session``. ``nodeClicked`` fires for a click on the plot (node id)."""

    nodeClicked = Signal(str)

    def __init__(self, session: Session, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.session = session
        self.plot = pg.PlotWidget(background="w")
        self.axis_choice = QComboBox()
        for mode, label in AXES.items():
            self.axis_choice.addItem(label, mode)
        self.axis_choice.setToolTip("x axis: time from the profile's node times, or execution order "
                                    "(input placeholders left out either way)")
        self.axis_choice.currentIndexChanged.connect(lambda _i: self._redraw())
        self.span_button = QPushButton("Select span")
        self.span_button.setCheckable(True)
        self.span_button.setToolTip("Show a span on the timeline: the graph and the table mark what is alive in it")
        self.span_button.toggled.connect(self._toggle_span)
        legend = QLabel(legend_html())
        legend.setWordWrap(True)
        bar = QHBoxLayout()
        bar.addWidget(QLabel("x axis"))
        bar.addWidget(self.axis_choice)
        bar.addWidget(self.span_button)
        bar.addStretch(1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(bar)
        layout.addWidget(legend)
        layout.addWidget(self.plot, 1)
        self.lanes_plot, self.host_plot = self._link_plots()
        layout.addWidget(self.lanes_plot)
        layout.addWidget(self.host_plot)
        item = self.plot.getPlotItem()
        item.getAxis("left").setWidth(LEFT_AXIS_PX)
        item.setLabel("left", "memory (GiB)")
        item.showGrid(x=False, y=True, alpha=0.3)
        item.setDownsampling(auto=True, mode="peak")
        item.setClipToView(True)
        for axis in ("left", "bottom"):
            item.getAxis(axis).enableAutoSIPrefix(False)
        self.stack: dict[str, pg.PlotDataItem] = {}
        for z, cat in enumerate(reversed(TIMELINE_CATEGORIES)):
            r, g, b = CATEGORY_COLOURS.get(cat, (160, 160, 160))
            curve = item.plot([], [], pen=pg.mkPen((r, g, b), width=1), fillLevel=0, brush=pg.mkBrush(r, g, b, 170))
            curve.setZValue(z)
            self.stack[cat] = curve
        self.baseline = item.plot([], [], pen=pg.mkPen((40, 40, 40), width=1, style=pg.QtCore.Qt.PenStyle.DashLine))
        self.baseline.setZValue(20)
        self.measured = item.plot([], [], pen=pg.mkPen((0, 160, 160), width=1))
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
        self.budget_line.sigPositionChangeFinished.connect(lambda _line: self._commit_budget())
        self._drag_commit = QTimer(self)
        self._drag_commit.setSingleShot(True)
        self._drag_commit.setInterval(DRAG_COMMIT_MS)
        self._drag_commit.timeout.connect(self._commit_budget)
        item.addItem(self.budget_line)
        self.cursor = pg.InfiniteLine(angle=90, movable=False, pen=pg.mkPen((0, 0, 0), width=1))
        self.cursor.setZValue(41)
        self.cursor.hide()
        item.addItem(self.cursor)
        self.span = pg.LinearRegionItem(brush=pg.mkBrush(*SPAN_BRUSH), pen=pg.mkPen((0, 140, 100), width=2))
        self.span.setZValue(35)
        self.span.hide()
        self.span.sigRegionChangeFinished.connect(self._on_span_moved)
        item.addItem(self.span, ignoreBounds=True)
        cache_pixmaps(*(c.curve for c in self.stack.values()), self.baseline.curve, self.measured.curve,
                      item.getAxis("left"), item.getAxis("bottom"))
        self._bands: list[QGraphicsItem] = []
        self._labels: list[tuple[QGraphicsSimpleTextItem, str, int]] = []
        self._lifetime: list[QGraphicsItem] = []
        self._profile: Profile | None = None
        self.axis: TimelineAxis | None = None
        self._baseline_total = np.zeros(0)
        self._floor = 0
        self._x = np.zeros(0)
        self._starts = np.zeros(0, dtype=np.int64)
        self._cum = np.zeros((0, len(TIMELINE_CATEGORIES)))
        self._timeline: tuple[np.ndarray, int, int] | None = None
        self._shown: SimResult | None = None  # the simulated step shown: its copy lanes, the node times on hover
        self.host_bytes = np.zeros(0)  # per node: offloaded bytes held on the host (the host plot bins it)
        self._live: np.ndarray | None = None
        self._hover = pg.SignalProxy(self.plot.scene().sigMouseMoved, rateLimit=30, slot=self._on_hover)
        self.plot.scene().sigMouseClicked.connect(self._on_click)
        self.nodeClicked.connect(session.select)
        session.events.loaded.connect(lambda _loaded: self.show_session())
        session.events.budget.connect(self._show_budget)
        session.events.plan.connect(self._on_plan)
        session.events.selection.connect(lambda _node: self.show_selection())

    def _link_plots(self) -> tuple[pg.PlotWidget, pg.PlotWidget]:
        """The copy lanes (a bar per copy) and the host-memory curve, each a short plot linked to the main x axis."""
        colour = (OFFLOADED.red(), OFFLOADED.green(), OFFLOADED.blue())
        lanes, host = pg.PlotWidget(background="w"), pg.PlotWidget(background="w")
        for plot, height in ((lanes, LANES_PX), (host, HOST_PX)):
            plot.setFixedHeight(height)
            plot.setXLink(self.plot)
            plot.setMouseEnabled(x=False, y=False)
            plot.hideButtons()
            plot.getPlotItem().hideAxis("bottom")
            plot.getPlotItem().getAxis("left").setWidth(LEFT_AXIS_PX)
            plot.getPlotItem().getAxis("left").enableAutoSIPrefix(False)
            plot.hide()
        lanes.getPlotItem().getAxis("left").setTicks([[(y, label) for y, label in LANES.values()]])
        lanes.setYRange(0, 2, padding=0)
        lanes.setToolTip("Copies of offloaded activations, and of what a block compiled alone saves beside them: to "
                         "the host after forward, back before backward (one copy stream each way)")
        self.copy_bars = {lane: pg.BarGraphItem(x0=[], x1=[], y0=[], height=[], brush=pg.mkBrush(*colour),
                                                pen=pg.mkPen("w", width=1)) for lane in LANES}
        for bars in self.copy_bars.values():
            lanes.addItem(bars)
        host.getPlotItem().setLabel("left", "host (GiB)")
        host.getPlotItem().showGrid(x=False, y=True, alpha=0.3)
        host.setToolTip("Host memory held by offloaded activations (the pinned pool holds their sum all step)")
        self.host_curve = host.getPlotItem().plot([], [], pen=pg.mkPen(colour, width=1), fillLevel=0,
                                                  brush=pg.mkBrush(*colour, 120))
        cache_pixmaps(lanes.getPlotItem().getAxis("left"), host.getPlotItem().getAxis("left"), self.host_curve.curve,
                      *self.copy_bars.values())
        return lanes, host

    def show_session(self) -> None:
        """The session's profile, plan and budget (on loading, and again after a live profiling curve)."""
        loaded = self.session.loaded
        if loaded is None:
            return
        self.set_profile(loaded.profile, loaded.baseline.timeline.sum(axis=1), self.session.floor_bytes)
        for plot in (self.lanes_plot, self.host_plot):
            plot.setVisible(loaded.ctx.may_offload)
        if self.session.state is not None:
            self._on_plan(self.session.state)
        self._show_budget(self.session.budget)

    # -- data ------------------------------------------------------------------------------------------------
    def set_profile(self, profile: Profile, baseline_total: np.ndarray, floor_bytes: int) -> None:
        """New profile: bands, measured curve and baseline; the budget line may move from the floor up."""
        self._profile = profile
        self._live = None
        self._baseline_total = np.asarray(baseline_total, dtype=float)
        self._floor = floor_bytes
        self._timeline = self._shown = None
        self._cum = np.zeros((0, len(TIMELINE_CATEGORIES)))
        self.span_button.setChecked(False)
        self._redraw()

    def _redraw(self) -> None:
        """Everything that depends on the x axis: bands, baseline, measured curve, the plan, the marks."""
        profile = self._profile
        if profile is None:
            return
        self.axis = TimelineAxis.of(profile, self.axis_choice.currentData())
        n = len(profile.nodes)
        self._starts = bin_starts(n, first=self.axis.start)
        self._x = self.axis.x(self._starts)
        item = self.plot.getPlotItem()
        item.setLabel("bottom", self.axis.label)
        self._clear_bands()
        width = self.axis.edges[-1] - self.axis.edges[self.axis.start]
        for region, lo, hi in region_spans(profile):
            colour = REGION_BANDS.get(region)
            if colour is None:
                continue
            x0, x1 = self.axis.x(lo), self.axis.x(hi + 1)
            band = pg.LinearRegionItem((x0, x1), movable=False, brush=pg.mkBrush(*colour), pen=pg.mkPen(None))
            band.setZValue(-10)
            cache_pixmaps(band)
            item.addItem(band)
            self._bands.append(band)
            if x1 - x0 > 0.06 * width:  # no room for a label on a sliver (the loss is a handful of nodes)
                label = label_item((90, 90, 90))
                label.setZValue(-9)
                item.addItem(label, ignoreBounds=True)
                self._bands.append(label)
                self._labels.append((label, region, x0))
        self.baseline.setData(self._x, peak_binned(self._baseline_total / GIB, self._starts))
        measured = np.asarray([nd.mem_peak for nd in profile.nodes], dtype=float)
        if measured.any():
            self.measured.setData(self._x, peak_binned(measured / GIB, self._starts))
        else:
            self.measured.setData([], [])
        top = max(float(self._baseline_total.max(initial=0)), float(measured.max(initial=0)))
        self.budget_line.setBounds((self._floor / GIB, top / GIB * 1.05))
        for label, region, x0 in self._labels:
            set_label(label, region, x0, top / GIB * 1.1)
        item.setXRange(self.axis.edges[self.axis.start], self.axis.edges[-1], padding=0.01)
        item.setYRange(0, top / GIB * 1.12, padding=0)
        if self._timeline is not None:
            self.set_timeline(*self._timeline)
        self.set_copies(self._shown)
        self.show_selection()
        if self.span.isVisible():
            self._toggle_span(True)

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
            self._timeline = self._shown = None
            self._cum = np.zeros((0, len(TIMELINE_CATEGORIES)))
            for plot in (self.lanes_plot, self.host_plot):
                plot.hide()
            for curve in (*self.stack.values(), self.baseline):
                curve.setData([], [])
            self.peak.setData([], [])
            self.peak_text.setText("")
            self._clear_bands()
            self._clear_lifetime()
            item.setLabel("bottom", "node (execution order, while measuring)")
            item.setXRange(0, max(n - 1, 1), padding=0.01)
        self._live[start:start + len(peaks)] = peaks
        filled = start + len(peaks)
        values = self._live[:filled] / GIB
        self.measured.setData(np.arange(filled, dtype=float), values)
        item.setYRange(0, max(float(np.nanmax(values, initial=0.0)), 1e-3) * 1.12, padding=0)

    def _on_plan(self, state) -> None:
        if state.sim is not None:
            pos = self.session.loaded.profile.node_index.get(state.sim.peak_node, -1)
            self.set_timeline(state.sim.timeline, pos, state.sim.peak_bytes)
            self.set_copies(state.sim)
        self.show_selection()

    def set_timeline(self, timeline: np.ndarray, peak_index: int, peak_bytes: int) -> None:
        """Show one simulated plan: ``timeline`` is (nodes, categories) bytes, as the simulator returns it."""
        self._timeline = (timeline, peak_index, peak_bytes)
        self._cum = np.cumsum(np.asarray(timeline, dtype=float), axis=1) / GIB
        drawn = peak_binned(self._cum, self._starts)
        for k, cat in enumerate(TIMELINE_CATEGORIES):
            curve = self.stack[cat]
            x, y = curve.getOriginalDataset()
            # model state sits at the bottom of the stack and rarely moves with the plan: a curve whose points
            # are the same keeps its cached drawing (filling a curve is most of a timeline repaint)
            if x is None or not (np.array_equal(x, self._x) and np.array_equal(y, drawn[:, k])):
                curve.setData(self._x, drawn[:, k])
        if self.axis is not None and 0 <= peak_index < len(self._cum):
            x = float(self.axis.x(peak_index))
            self.peak.setData([x], [peak_bytes / GIB])
            set_label(self.peak_text, f"peak {format_bytes(peak_bytes)}", x, peak_bytes / GIB, centred=True)

    def set_copies(self, result: SimResult | None) -> None:
        """Show the copies of the simulated step ``result`` in their lanes and the host memory they hold (none, or
        nothing offloaded: empty lanes, no host memory)."""
        self._shown = result
        offload = result.offload if result is not None else None
        loaded = self.session.loaded
        if offload is None or self.axis is None or loaded is None or loaded.profile is not self._profile:
            self.host_bytes = np.zeros(0)
            for bars in self.copy_bars.values():
                bars.setOpts(x0=[], x1=[], y0=[], height=[])
            self.host_curve.setData([], [])
            return
        for (lane, (row, _label)), spans in zip(LANES.items(), copy_spans(self.axis, result)):
            n = len(spans)
            self.copy_bars[lane].setOpts(x0=spans[:, 0], x1=spans[:, 1], y0=np.full(n, row - 0.35),
                                         height=np.full(n, 0.7))
        self.host_bytes = offload.host_memory(loaded.simulator).astype(float)
        drawn = peak_binned(self.host_bytes, self._starts) / GIB
        self.host_curve.setData(self._x, drawn)
        self.host_plot.setYRange(0, max(float(drawn.max(initial=0.0)), 1e-3) * 1.1, padding=0)

    def stacked_total(self) -> np.ndarray:
        """Top of the shown stack, bytes per node (the drawing is its per-bin maximum)."""
        return self._cum[:, -1] * GIB if len(self._cum) else np.zeros(0)

    def _show_budget(self, budget_bytes: int) -> None:
        # the line announces its move; _on_line_moved sees the session's own budget and says nothing back
        self.budget_line.setValue(budget_bytes / GIB)

    def _line_value(self, budget_bytes: int) -> float:
        """Where the line shows ``budget_bytes``: there, or at its nearer bound."""
        lo, hi = self.budget_line.maxRange
        value = budget_bytes / GIB  # exact: a division by a power of two
        return min(max(value, lo if lo is not None else value), hi if hi is not None else value)

    def set_cursor(self, node_id: str) -> None:
        if self._profile is None or self.axis is None or node_id not in self._profile.node_index:
            self.cursor.hide()
            return
        self.cursor.setValue(float(self.axis.x(self._profile.node_index[node_id])))
        self.cursor.show()

    # -- the selected activation's lifetime -----------------------------------------------------------------
    def show_selection(self) -> None:
        """Cursor at the selected node, and the lifetime of the selected activation (or the node's first)."""
        self._clear_lifetime()
        session = self.session
        if self._profile is None or not session.selected or session.loaded is None \
                or session.loaded.profile is not self._profile:
            self.cursor.hide()
            return
        self.set_cursor(session.selected)
        act = session.selected_activation
        if not act:
            return
        plan = session.state.plan if session.state is not None else None
        offload = session.state.sim.offload if session.state is not None and session.state.sim is not None else None
        marks = lifetime_marks(self._profile, plan, act, offload)
        self.lifetime = marks
        item = self.plot.getPlotItem()
        y = item.vb.viewRange()[1][1] * 0.9  # above the curves, below the region names
        xs = {what: float(self.axis.x(i)) for what, i in marks}
        # in memory: made .. last forward use (recomputed) or until the copy to the host has ended (offloaded),
        # then again from the recomputation or the copy back; or (kept) made .. last use
        if "recomputed" in xs:
            pieces = [(xs["made"], xs["last forward use"]), (xs["recomputed"], xs["last use"])]
        elif ON_HOST in xs:
            pieces = [(xs["made"], xs[ON_HOST]), (xs[COPIED_BACK], xs["last use"])]
        else:
            pieces = [(xs["made"], xs["last use"])]
        for x0, x1 in pieces:
            bar = pg.PlotCurveItem([x0, x1], [y, y], pen=pg.mkPen(LIFETIME_COLOUR, width=5))
            bar.setZValue(45)
            item.addItem(bar, ignoreBounds=True)
            self._lifetime.append(bar)
        for k, (what, x) in enumerate(xs.items()):
            line = pg.InfiniteLine(pos=x, angle=90, movable=False,
                                   pen=pg.mkPen(LIFETIME_COLOUR, width=1, style=pg.QtCore.Qt.PenStyle.DotLine),
                                   label=what, labelOpts={"position": 0.85 - 0.08 * k, "color": LIFETIME_COLOUR})
            line.setZValue(44)
            item.addItem(line, ignoreBounds=True)
            self._lifetime.append(line)

    def _clear_lifetime(self) -> None:
        item = self.plot.getPlotItem()
        for mark in self._lifetime:
            item.removeItem(mark)
        self._lifetime = []
        self.lifetime: list[tuple[str, int]] = []

    # -- span ------------------------------------------------------------------------------------------------
    def _toggle_span(self, on: bool) -> None:
        if not on or self.axis is None:
            self.span.hide()
            self.session.select_span(1, 0)
            return
        x0, x1 = self.plot.getPlotItem().vb.viewRange()[0]
        middle, width = (x0 + x1) / 2, (x1 - x0) * 0.04
        self.span.setRegion((middle - width, middle + width))
        self.span.show()
        self._on_span_moved()

    def _on_span_moved(self, *_args) -> None:
        if self.axis is None or not self.span.isVisible():
            return
        x0, x1 = self.span.getRegion()
        self.session.select_span(*self.axis.nodes_between(x0, x1))

    # -- interaction -----------------------------------------------------------------------------------------
    def _on_line_moved(self, line: pg.InfiniteLine) -> None:
        """A drag shows its budget everywhere at once and plans for it when it pauses; the line showing the
        session's own budget is not a move."""
        if line.value() != self._line_value(self.session.budget):
            self.session.set_budget(round(line.value() * GIB), final=False)
            self._drag_commit.start()

    def _commit_budget(self) -> None:
        self._drag_commit.stop()
        self.session.set_budget(self.session.budget)

    def _node_at(self, scene_pos: QPointF) -> int | None:
        if self._profile is None or self.axis is None or not self.plot.sceneBoundingRect().contains(scene_pos):
            return None
        return self.axis.node_at(self.plot.getPlotItem().vb.mapSceneToView(scene_pos).x())

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
        if self._shown is not None:
            parts.append(node_time_text(self._shown, i))
        self.plot.setToolTip("\n".join(parts))

    def _on_click(self, event) -> None:
        if event.button() != pg.QtCore.Qt.MouseButton.LeftButton:
            return
        i = self._node_at(event.scenePos())
        if i is not None:
            self.nodeClicked.emit(self._profile.nodes[i].id)
