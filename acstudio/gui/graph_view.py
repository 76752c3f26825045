"""Node graph view: modules top to bottom, expanded in place, coloured by what the plan does to them.

Bound to the :class:`~acstudio.views.session.Session` like napari's ``QtDims(dims)``: it draws the session's
module tree when a profile loads, recolours on every plan, outlines the session's selection and the timeline
span, and tells the session what the user clicked. Click a module to expand it, click an expanded module's
frame to collapse it, click an op to select it.

Layouts come from :mod:`acstudio.views.graph_layout` in a background job and are kept per expansion state, so
going back to a state redraws at once. Colours come from per-node arrays aggregated per box with
``numpy.bincount``: a plan change costs one pass over the nodes and one brush per box.
"""

from __future__ import annotations

import math
from functools import partial

import numpy as np
from PySide6.QtCore import QPointF, QRectF, Qt, Signal
from PySide6.QtGui import QBrush, QColor, QFont, QFontMetricsF, QPainter, QPainterPath, QPen
from PySide6.QtWidgets import (
    QComboBox,
    QGraphicsItem,
    QGraphicsPathItem,
    QGraphicsRectItem,
    QGraphicsScene,
    QGraphicsSimpleTextItem,
    QGraphicsView,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from acstudio.gui.jobs import JobRunner
from acstudio.jobs import check
from acstudio.views import graph_layout as gl
from acstudio.views.tables import Decisions

RETAINED = QColor(70, 130, 220)
RECOMPUTED = QColor(220, 60, 60)
OFFLOADED = QColor(40, 160, 70)
DECISION_COLOURS = {"retain": RETAINED, "recompute": RECOMPUTED, "offload": OFFLOADED}  # the table's, the legend's
REPLAYED = QColor(240, 160, 50)
INSERTED = QColor(170, 0, 170)
SPAN = QColor(0, 170, 120)
REGION_FILL = {"input": QColor(225, 225, 225), "forward": QColor(232, 238, 248), "loss": QColor(250, 240, 210),
               "backward": QColor(232, 245, 235), "optimizer": QColor(240, 232, 248), "output": QColor(225, 225, 225)}
READABLE_PT = 9.0  # smallest label size, in points on screen, that counts as readable
LAUNCH_MAX_SCALE = 1.4  # a small graph is shown a little larger, never huge
KEY_ROLE = 0  # QGraphicsItem.data slot holding the item key ("g:<group>", "n:<node id>" or "c:<cluster>")
CACHE_LAYOUTS = 32


def layout_job(tree: gl.ModuleTree, expanded: frozenset[str], regions: tuple[str, ...], cache_dir: str | None,
               progress, cancel):
    return gl.laid_out(tree, expanded, regions, cache_dir)


def prefetch_job(tree: gl.ModuleTree, states: list[frozenset[str]], regions: tuple[str, ...], cache_dir: str | None,
                 progress, cancel) -> list:
    """Lay out the states one click away (each shown module opened), so that a click draws at once."""
    done = []
    for expanded in states:
        check(cancel)
        done.append(layout_job(tree, expanded, regions, cache_dir, progress, cancel))
    return done


def _mix(a: QColor, b: QColor, t: float) -> QColor:
    return QColor(*_mix_rgb(np.array(_rgb(a)), np.array(_rgb(b)), np.array([t]))[0].tolist())


def _rgb(colour: QColor) -> tuple[int, int, int]:
    return colour.red(), colour.green(), colour.blue()


def _mix_rgb(a: np.ndarray, b: np.ndarray, t: np.ndarray) -> np.ndarray:
    """:func:`_mix` of rows of colours (int arrays (k, 3) or (3,)) by per-row fractions ``t``."""
    return np.round(a + (b - a) * t[:, None]).astype(np.int64)


def box_fills(rec: np.ndarray, ret: np.ndarray, rep: np.ndarray, region_rgb: np.ndarray,
              off: np.ndarray | None = None) -> np.ndarray:
    """Fill (k, 3 rgb) of each box from the bytes it recomputes, offloads and keeps and the nodes it re-runs: the
    mix of kept blue, recomputed red and offloaded green by bytes, lighter for fewer bytes (never so light that the
    colour is lost), orange when it only re-runs, its region's colour otherwise."""
    off = np.zeros_like(rec) if off is None else off
    act = rec + ret + off
    has = act > 0
    top = math.log1p(float(act.max(initial=0.0)))
    share = np.column_stack([ret, rec, off]) / np.where(has, act, 1.0)[:, None]
    mixed = share @ np.array([_rgb(RETAINED), _rgb(RECOMPUTED), _rgb(OFFLOADED)], dtype=float)
    mixed = np.where(has[:, None], mixed, 0.0)
    strength = 0.35 + 0.65 * np.log1p(act) / top if top else np.ones_like(act)
    fills = np.where(has[:, None], _mix_rgb(np.array([255, 255, 255]), mixed, strength), region_rgb)
    fills[~has & (rep > 0)] = _rgb(REPLAYED)
    return fills


def _label_brush(fill: QColor) -> QBrush:
    """Dark text on a light box, white on a dark one."""
    return QBrush(QColor(20, 20, 20) if fill.lightnessF() > 0.55 else QColor(255, 255, 255))


def _plain_pen(item: gl.Item) -> QPen:
    return QPen(QColor(90, 90, 90), 1.2 if item.is_group else 0.8)


def label_fonts() -> tuple[QFont, QFont]:
    """Title and detail fonts of a box (point sizes in scene units: at zoom 1 they read at that size)."""
    title = QFont()
    title.setPointSizeF(gl.FONT_PT)
    title.setBold(True)
    detail = QFont()
    detail.setPointSizeF(gl.FONT_PT - 1)
    return title, detail


class _Canvas(QGraphicsView):
    """Zoom with the wheel (anchored under the mouse), pan by dragging; a press-release without motion clicks."""

    clicked = Signal(str)

    def __init__(self, scene: QGraphicsScene, parent: QWidget | None = None) -> None:
        super().__init__(scene, parent)
        self.setRenderHints(QPainter.RenderHint.Antialiasing | QPainter.RenderHint.TextAntialiasing)
        self.setDragMode(QGraphicsView.DragMode.ScrollHandDrag)
        self.setTransformationAnchor(QGraphicsView.ViewportAnchor.AnchorUnderMouse)
        self.setViewportUpdateMode(QGraphicsView.ViewportUpdateMode.BoundingRectViewportUpdate)
        self.setBackgroundBrush(QBrush(QColor(252, 252, 252)))
        self._press: QPointF | None = None

    def wheelEvent(self, event) -> None:
        factor = 1.15 ** (event.angleDelta().y() / 120)
        scale = self.transform().m11() * factor
        if 0.02 < scale < 8:
            self.scale(factor, factor)

    def mousePressEvent(self, event) -> None:
        self._press = event.position()
        super().mousePressEvent(event)

    def mouseReleaseEvent(self, event) -> None:
        super().mouseReleaseEvent(event)
        if self._press is not None and (event.position() - self._press).manhattanLength() < 4:
            key = self.key_at(event.position().toPoint())
            if key:
                self.clicked.emit(key)
        self._press = None

    def key_at(self, pos) -> str:
        for item in self.items(pos):
            key = item.data(KEY_ROLE)
            if key:
                return key
        return ""


class GraphView(QWidget):
    """The graph panel: direction, search, Fit, the legend and the zoomable canvas, bound to ``session``."""

    noticeChanged = Signal(str)  # a lasting note about the graph ("" when none applies)

    def __init__(self, session, cache_dir: str | None = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.session = session
        self.cache_dir = cache_dir
        self.scene = QGraphicsScene(self)
        self.canvas = _Canvas(self.scene)
        self.canvas.clicked.connect(self._on_clicked)
        self.direction = QComboBox()
        self.direction.addItems(list(gl.SHOWN_REGIONS))
        self.direction.setCurrentText(gl.DEFAULT_PASS)
        self.direction.setToolTip("Which pass the graph shows: forward (with the loss), backward (with the "
                                  "optimizer update) or the whole iteration")
        self.direction.currentTextChanged.connect(lambda _text: self.set_expanded(self.expanded))
        self.search = QLineEdit(placeholderText="Find a module, op or node (Enter: next match)")
        self.search.returnPressed.connect(self.next_match)
        self.search.textChanged.connect(self._on_search_changed)
        self.matches_label = QLabel("")
        fit = QPushButton("Fit")
        fit.setToolTip("Zoom to show the whole graph as it is expanded now")
        fit.clicked.connect(self.fit)
        collapse = QPushButton("Collapse all")
        collapse.clicked.connect(self.collapse_all)
        bar = QHBoxLayout()
        bar.addWidget(QLabel("Show"))
        bar.addWidget(self.direction)
        bar.addStretch(1)
        bar.addWidget(fit)
        bar.addWidget(collapse)
        find = QHBoxLayout()
        find.addWidget(self.search, 1)
        find.addWidget(self.matches_label)
        legend = QLabel(
            f'<span style="color:{RETAINED.name()}">■</span> kept '
            f'<span style="color:{RECOMPUTED.name()}">■</span> recomputed '
            f'<span style="color:{OFFLOADED.name()}">■</span> offloaded to host, mixed by bytes '
            f'<span style="color:{_mix(RETAINED, RECOMPUTED, 0.5).name()}">■</span>'
            f'<span style="color:{_mix(_mix(RETAINED, RECOMPUTED, 0.5), OFFLOADED, 1 / 3).name()}">■</span> '
            f'<span style="color:{REPLAYED.name()}">■</span> re-run in backward '
            f'<span style="color:{INSERTED.name()}">□</span> recomputation inserted before')
        legend.setWordWrap(True)
        legend.setToolTip("Click a module to open it, click its frame to close it, click an op to select it")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(bar)
        layout.addLayout(find)
        layout.addWidget(legend)
        layout.addWidget(self.canvas, 1)
        self.runner = JobRunner("layout", self)
        self.runner.resultReady.connect(self._on_layout)
        self.runner.failed.connect(lambda msg, _details: self._set_notice(f"Graph layout failed: {msg}"))
        # graphviz takes a few hundred ms per layout: the states one click away are laid out ahead, quietly
        self.prefetcher = JobRunner("layout prefetch", self)
        self.prefetcher.resultReady.connect(self._on_prefetched)
        self.tree: gl.ModuleTree | None = None
        self.expanded: frozenset[str] = frozenset()
        self.view: gl.View | None = None
        self.layout: gl.Layout | None = None
        self._layouts: dict[tuple[frozenset[str], tuple[str, ...]], tuple[gl.View, gl.Layout]] = {}
        self._boxes: list[QGraphicsRectItem] = []
        self._frames: dict[str, QGraphicsRectItem] = {}
        self._pens: list[QPen] = []
        self._decisions: Decisions | None = None
        self._selected = ""
        self._span_nodes = np.zeros(0, dtype=np.int64)
        self._matches: list[int] = []  # nodes whose name, op or module contains the search text
        self._module_matches: list[str] = []  # modules the search text names
        self._index_of_group: dict[str, int] = {}
        self._match_pos = -1
        self._focus_after_layout = ""
        self._anchor: tuple[str, QPointF] | None = None  # keep this group where it was on screen
        self._launch_zoom = False
        self._prefetch_allowed = False  # at launch, layouts one click away wait until the window is interactive
        # each box's fill (packed rgb) and outline, so that a plan change touches only the boxes it changes
        self._region_rgb = np.zeros((0, 3), dtype=np.int64)
        self._colours = np.zeros(0, dtype=np.int64)
        self._inserted = np.zeros(0, dtype=bool)
        self.notice = ""
        session.events.loaded.connect(lambda loaded: self.set_tree(loaded.tree, loaded.first_graph))
        session.events.plan.connect(lambda state: self.recolour(session.graph_decisions(state)))
        session.events.selection.connect(self.select_node)
        session.events.span.connect(self.show_span)

    @property
    def regions(self) -> tuple[str, ...]:
        return gl.SHOWN_REGIONS[self.direction.currentText()]

    # -- profile and layout ----------------------------------------------------------------------------------
    def set_tree(self, tree: gl.ModuleTree, first: tuple | None = None) -> None:
        """A new profile's graph; ``first`` (a :func:`~acstudio.views.graph_layout.laid_out` result made while
        the profile loaded) is drawn at once when it shows what the view is set to show."""
        self.prefetcher.cancel()
        self.tree = tree
        self._selected = ""
        self._matches = []
        self._module_matches = []
        self._span_nodes = np.zeros(0, dtype=np.int64)
        self._decisions = None
        self._layouts = {}
        self.scene.clear()
        self._boxes = []
        self._frames = {}
        self.view = self.layout = None
        self._launch_zoom = True
        self._prefetch_allowed = False
        if first is not None and first[1] == self.regions:
            self._on_layout(first)
        else:
            self.set_expanded(tree.default_expansion())

    def set_expanded(self, expanded: frozenset[str]) -> None:
        """Show ``expanded``: at once if laid out before, else when the background layout arrives."""
        if self.tree is None:
            return
        key = (frozenset(expanded), self.regions)
        if key in self._layouts:
            self.runner.cancel()
            self._show(key[0], key[1], *self._layouts[key])
            return
        self.runner.submit(partial(layout_job, self.tree, key[0], key[1], self.cache_dir))

    def _on_layout(self, result) -> None:
        expanded, regions, view, layout = result
        self._layouts[(expanded, regions)] = (view, layout)
        while len(self._layouts) > CACHE_LAYOUTS:
            self._layouts.pop(next(iter(self._layouts)))
        if regions == self.regions:
            self._show(expanded, regions, view, layout)

    def _on_prefetched(self, results: list) -> None:
        for expanded, regions, view, layout in results:
            self._layouts.setdefault((expanded, regions), (view, layout))
        while len(self._layouts) > CACHE_LAYOUTS:
            self._layouts.pop(next(iter(self._layouts)))

    def allow_prefetch(self) -> None:
        """The window is interactive: lay out ahead from now on (the layouts one click away are not needed for
        the first paint, and computing them then would delay it)."""
        self._prefetch_allowed = True
        self._prefetch()

    def _prefetch(self) -> None:
        """After a dot layout, lay out ahead what opening each shown module would show."""
        if not self._prefetch_allowed or self.layout is None or self.layout.engine != "dot":
            return
        regions = self.regions
        groups = sorted((it for it in self.view.items if it.is_group), key=lambda it: -len(it.nodes))  # likeliest
        ahead = [self.expanded | {it.key} for it in groups]
        ahead = [e for e in ahead if (e, regions) not in self._layouts][:CACHE_LAYOUTS // 2]
        if ahead:
            self.prefetcher.submit(partial(prefetch_job, self.tree, ahead, regions, self.cache_dir))

    def _show(self, expanded: frozenset[str], regions: tuple[str, ...], view: gl.View, layout: gl.Layout) -> None:
        self.expanded, self.view, self.layout = expanded, view, layout
        self._draw()
        if self._decisions is not None:
            self.recolour(self._decisions)
        self._outline()
        if layout.engine == "dot":
            self._set_notice("")
        else:
            self._set_notice("Graph: graphviz 'dot' not found, using the built-in layout (apt-get install graphviz "
                             "for a tidier one)")
        if self._launch_zoom:
            self._launch_zoom = False
            self.fit_readable()
        elif self._anchor is not None and self._anchor[0] in self._frames:
            key, at = self._anchor
            frame = self._frames[key].rect()
            # scroll so that the opened module's top-left stays under the same viewport point
            here = self.canvas.mapFromScene(frame.topLeft())
            bar_h, bar_v = self.canvas.horizontalScrollBar(), self.canvas.verticalScrollBar()
            bar_h.setValue(bar_h.value() + round(here.x() - at.x()))
            bar_v.setValue(bar_v.value() + round(here.y() - at.y()))
        self._anchor = None
        if self._focus_after_layout:
            self._center_on(self._focus_after_layout)
            self._focus_after_layout = ""
        self._prefetch()

    def _set_notice(self, text: str) -> None:
        if text != self.notice:
            self.notice = text
            self.noticeChanged.emit(text)

    def _draw(self) -> None:
        self.scene.clear()
        self._boxes = []
        self._frames = {}
        title_font, detail_font = label_fonts()
        title_metrics, detail_metrics = QFontMetricsF(title_font), QFontMetricsF(detail_font)
        for key, label, (x, y, w, h) in self.layout.clusters:
            frame = self.scene.addRect(QRectF(x, y, w, h), QPen(QColor(140, 140, 140), 1, Qt.PenStyle.DashLine),
                                       QBrush(QColor(0, 0, 0, 8)))
            frame.setZValue(-5 + key.count(gl.SEP) * 0.1)
            frame.setData(KEY_ROLE, f"c:{key}")
            frame.setToolTip(f"{key.partition(gl.SEP)[2]} (click the frame to close it)")
            text = QGraphicsSimpleTextItem(title_metrics.elidedText(label, Qt.TextElideMode.ElideRight, w - 8), frame)
            text.setFont(title_font)
            text.setPos(x + 4, y + 3)
            self._frames[key] = frame
        edges = QPainterPath()
        for pts in self.layout.edges:
            if len(pts) >= 4:
                edges.moveTo(*pts[0])
                for k in range(1, len(pts) - 2, 3):
                    edges.cubicTo(QPointF(*pts[k]), QPointF(*pts[k + 1]), QPointF(*pts[k + 2]))
        path_item = QGraphicsPathItem(edges)
        path_item.setPen(QPen(QColor(110, 110, 110, 170), 1.0))
        path_item.setZValue(-1)
        path_item.setCacheMode(QGraphicsItem.CacheMode.DeviceCoordinateCache)  # the edges never change colour
        self.scene.addItem(path_item)
        for item, (x, y, w, h) in zip(self.view.items, self.layout.boxes):
            box = QGraphicsRectItem(QRectF(x, y, w, h))
            fill = REGION_FILL.get(item.region, QColor(230, 230, 230))
            box.setBrush(QBrush(fill))
            box.setData(KEY_ROLE, f"g:{item.key}" if item.is_group else f"n:{item.key}")
            box.setToolTip(self._tooltip(item))
            title, _, detail = item.label.partition("\n")
            for k, (text, font, metrics) in enumerate(((title, title_font, title_metrics),
                                                       (detail, detail_font, detail_metrics))):
                label = QGraphicsSimpleTextItem(metrics.elidedText(text, Qt.TextElideMode.ElideRight, w - 8), box)
                label.setFont(font)
                label.setBrush(_label_brush(fill))
                label.setPos(x + (w - label.boundingRect().width()) / 2, y + 3 + k * gl.LINE_PT)
            self.scene.addItem(box)
            self._boxes.append(box)
        self._pens = [_plain_pen(item) for item in self.view.items]
        self._region_rgb = np.array([_rgb(REGION_FILL.get(it.region, QColor(230, 230, 230))) for it in self.view.items],
                                    dtype=np.int64).reshape(-1, 3)
        self._colours = (self._region_rgb[:, 0] << 16) | (self._region_rgb[:, 1] << 8) | self._region_rgb[:, 2]
        self._inserted = np.zeros(len(self.view.items), dtype=bool)
        self._index_of_group = {item.key: k for k, item in enumerate(self.view.items) if item.is_group}
        rects = [QRectF(*b) for b in self.layout.boxes] + [QRectF(*r) for _k, _l, r in self.layout.clusters]
        shown = QRectF()
        for r in rects:
            shown = shown.united(r)
        self.scene.setSceneRect(shown.adjusted(-16, -16, 16, 16))

    def _tooltip(self, item: gl.Item) -> str:
        from acstudio.units import format_bytes

        if item.is_group:
            where = item.key.partition(gl.SEP)[2].replace(gl.SEP, ".") or item.key
            return (f"{where} ({item.region})\n{len(item.nodes)} ops, {format_bytes(item.bytes)} allocated\n"
                    "click to open")
        n = self.tree.profile.nodes[item.nodes[0]]
        return f"{n.id} {n.name}\n{n.target}\n{n.module or n.region}\n{n.shape} {n.dtype}"

    # -- colours ---------------------------------------------------------------------------------------------
    def recolour(self, decisions: Decisions) -> None:
        """Colour every box by the plan: kept/recomputed/offloaded mix by bytes, re-run in backward, inserted
        recomputations.

        Colours are computed for all boxes at once; only the boxes whose fill or outline changes are touched, so a
        slider step repaints those and nothing else."""
        self._decisions = decisions
        if self.view is None or not self._boxes:
            return
        k = len(self.view.items)
        idx = self.view.node_item
        shown = idx >= 0
        idx = idx[shown]
        rec = np.bincount(idx, weights=decisions.recomputed_bytes[shown], minlength=k)
        ret = np.bincount(idx, weights=decisions.retained_bytes[shown], minlength=k)
        off = np.bincount(idx, weights=decisions.offloaded_bytes[shown], minlength=k)
        rep = np.bincount(idx, weights=decisions.replayed[shown], minlength=k)
        inserted = np.bincount(idx, weights=decisions.inserted[shown], minlength=k) > 0
        fills = box_fills(rec, ret, rep, self._region_rgb, off)
        packed = (fills[:, 0] << 16) | (fills[:, 1] << 8) | fills[:, 2]
        for i in np.flatnonzero((packed != self._colours) | (inserted != self._inserted)).tolist():
            box, item = self._boxes[i], self.view.items[i]
            colour = QColor(*fills[i].tolist())
            box.setBrush(QBrush(colour))
            self._pens[i] = QPen(INSERTED, 3) if inserted[i] else _plain_pen(item)
            for label in box.childItems():
                label.setBrush(_label_brush(colour))
        self._colours, self._inserted = packed, inserted
        self._outline()

    def box_colour(self, key: str) -> QColor | None:
        """Fill colour of the box with ``key`` (group key or node id), for tests and the benchmark."""
        for box, item in zip(self._boxes, self.view.items if self.view else []):
            if item.key == key:
                return box.brush().color()
        return None

    # -- what is on screen -----------------------------------------------------------------------------------
    def readable_boxes(self) -> list[str]:
        """Keys of the boxes wholly inside the viewport whose labels read at :data:`READABLE_PT` or more."""
        if self.view is None or gl.FONT_PT * self.canvas.transform().m11() < READABLE_PT:
            return []
        visible = self.canvas.mapToScene(self.canvas.viewport().rect()).boundingRect()
        return [item.key for item, box in zip(self.view.items, self._boxes) if visible.contains(box.rect())]

    def fit(self) -> None:
        """Zoom to show everything the graph shows now."""
        rect = self.scene.sceneRect()
        if not rect.isEmpty():
            self.canvas.fitInView(rect, Qt.AspectRatioMode.KeepAspectRatio)

    def fit_readable(self) -> None:
        """Fit, but never so small that labels stop being readable: a tall graph then shows its top, and a wide
        one the column where most of its ops are (GPT-2: its blocks, not the mask's edges fanning out beside
        them)."""
        rect = self.scene.sceneRect()
        if rect.isEmpty():
            return
        view = self.canvas.viewport().rect()
        scale = min(view.width() / rect.width(), view.height() / rect.height(), LAUNCH_MAX_SCALE)
        scale = max(scale, 1.0)
        self.canvas.resetTransform()
        self.canvas.scale(scale, scale)
        ops = [len(item.nodes) for item in self.view.items] if self.view is not None else []
        x = rect.center().x()
        if sum(ops):
            x = sum(n * box.rect().center().x() for n, box in zip(ops, self._boxes)) / sum(ops)
        self.canvas.centerOn(QPointF(x, rect.top() + view.height() / scale / 2))

    # -- selection, search, expansion ------------------------------------------------------------------------
    def select_node(self, node_id: str) -> None:
        """Highlight ``node_id``, expanding its groups (and switching pass) if it is hidden."""
        if self.tree is None or node_id not in self.tree.profile.node_index:
            return
        i = self.tree.profile.node_index[node_id]
        self._reveal(node_id, self.tree.profile.nodes[i].region, self.tree.ancestors(i))

    def select_module(self, key: str) -> None:
        """Highlight module ``key`` (a group key such as ``forward/layer3``), opening its parents if needed."""
        path = tuple(key.split(gl.SEP))
        self._reveal(key, path[0], [gl.key_of(path[:d]) for d in range(1, len(path))])

    def _reveal(self, key: str, region: str, parents: list[str]) -> None:
        """Select ``key`` (node id or group key) and centre it, after switching pass and opening ``parents``."""
        self._selected = key
        if region not in self.regions:  # switch to the pass that shows it (inputs are shown by none)
            name = next((k for k, v in gl.SHOWN_REGIONS.items() if region in v), "")
            if name:
                self.direction.blockSignals(True)
                self.direction.setCurrentText(name)
                self.direction.blockSignals(False)
        k = self._item_index(key)
        if k < 0 or (self.view.items[k].is_group and self.view.items[k].key != key):
            self._focus_after_layout = key
            self.set_expanded(self.expanded | set(parents))
            return
        self._outline()
        self._center_on(key)

    def _item_index(self, key: str) -> int:
        """The box showing ``key`` (a node id: the box it is drawn in; a group key: its own box), or -1."""
        if self.view is None:
            return -1
        if key in self.tree.profile.node_index:
            return int(self.view.node_item[self.tree.profile.node_index[key]])
        return self._index_of_group.get(key, -1)

    def _center_on(self, key: str) -> None:
        k = self._item_index(key)
        if k >= 0:
            self.canvas.centerOn(self._boxes[k])

    def show_span(self, nodes: np.ndarray) -> None:
        """Outline the boxes holding ``nodes`` (the activations alive in the timeline's selected span)."""
        self._span_nodes = np.asarray(nodes, dtype=np.int64)
        self._outline()

    def _outline(self) -> None:
        if self.view is None:
            return
        items = self.view.node_item
        marked = {int(items[i]) for i in self._matches} - {-1}
        spanned = set(np.unique(items[self._span_nodes]).tolist()) - {-1} if len(self._span_nodes) else set()
        selected = self._item_index(self._selected) if self._selected else -1
        for i, box in enumerate(self._boxes):
            box.setZValue(3 if i == selected else 2 if i in marked else 1 if i in spanned else 0)
            if i == selected:
                box.setPen(QPen(QColor(0, 0, 0), 3))
            elif i in marked:
                box.setPen(QPen(QColor(230, 200, 0), 3))
            elif i in spanned:
                box.setPen(QPen(SPAN, 3))
            else:
                box.setPen(self._pens[i])

    def _on_clicked(self, key: str) -> None:
        kind, _, value = key.partition(":")
        if kind == "g":
            self._anchor_on(value)
            self.set_expanded(self.expanded | {value})
        elif kind == "c":
            self._anchor = None
            self.set_expanded(frozenset(k for k in self.expanded if k != value and not k.startswith(value + gl.SEP)))
        elif kind == "n":
            self._selected = value
            self._outline()
            self.session.select(value)

    def expand(self, key: str) -> None:
        """Open group ``key`` in place (what a click on its box does)."""
        self._on_clicked(f"g:{key}")

    def _anchor_on(self, key: str) -> None:
        box = next((b for b, it in zip(self._boxes, self.view.items) if it.key == key), None) if self.view else None
        if box is not None:
            self._anchor = (key, QPointF(self.canvas.mapFromScene(box.rect().topLeft())))

    def collapse_all(self) -> None:
        self.set_expanded(frozenset(r for r in self.regions if r in ("forward", "backward")))

    def _on_search_changed(self, text: str) -> None:
        self._module_matches = self.tree.find_modules(text) if self.tree is not None else []
        self._matches = self.tree.search(text) if self.tree is not None else []
        self._match_pos = -1
        count = len(self._module_matches) + len(self._matches)
        self.matches_label.setText(f"{count} matches" if text.strip() else "")
        self._outline()

    def next_match(self) -> None:
        """Go to the next search match, modules named so first, then ops: open what hides it, select and centre it."""
        targets = len(self._module_matches) + len(self._matches)
        if not targets:
            return
        self._match_pos = (self._match_pos + 1) % targets
        self.matches_label.setText(f"{self._match_pos + 1}/{targets}")
        if self._match_pos < len(self._module_matches):
            self.select_module(self._module_matches[self._match_pos])
            return
        node_id = self.tree.profile.nodes[self._matches[self._match_pos - len(self._module_matches)]].id
        self.session.select(node_id)
        if self.session.selected == node_id:  # already selected: the session does not repeat itself
            self.select_node(node_id)

    def shutdown(self) -> None:
        self.prefetcher.shutdown()
        self.runner.shutdown()
