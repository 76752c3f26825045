"""Node graph view: module groups laid out once per expansion state, recoloured on every plan change.

Click a collapsed group to expand it, click an expanded group's frame to collapse it, click a node to
select it. Layouts are computed by :mod:`acstudio.gui.graph_layout` in a background job; while one runs the
previous drawing stays. Colours come from per-node decision arrays aggregated per visible item with
``numpy.bincount``, so a plan change costs one pass over the nodes and one brush per item.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import numpy as np
from PySide6.QtCore import QPointF, QRectF, Qt, Signal
from PySide6.QtGui import QBrush, QColor, QFont, QPainter, QPainterPath, QPen
from PySide6.QtWidgets import (
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

from acstudio.gui import graph_layout as gl
from acstudio.gui.jobs import JobRunner

RETAINED = QColor(70, 130, 220)
RECOMPUTED = QColor(220, 60, 60)
REPLAYED = QColor(240, 160, 50)
INSERTED = QColor(170, 0, 170)
REGION_FILL = {"input": QColor(225, 225, 225), "forward": QColor(225, 235, 250), "loss": QColor(250, 240, 210),
               "backward": QColor(225, 245, 230), "optimizer": QColor(238, 228, 248), "output": QColor(225, 225, 225)}
MIN_FIT_SCALE = 0.45
KEY_ROLE = 0  # QGraphicsItem.data slot holding the item key ("g:<group>", "n:<node id>" or "c:<cluster>")


@dataclass
class Decisions:
    """Per-node facts of one plan (arrays over profile nodes), the input of :meth:`GraphView.recolour`."""

    recomputed_bytes: np.ndarray  # bytes of activations this node allocates that the plan recomputes
    retained_bytes: np.ndarray  # ... that the plan keeps (candidates and non-candidates alike)
    replayed: np.ndarray  # 1 where the node is re-executed in backward to recompute something
    inserted: np.ndarray  # number of recomputations inserted just before this node


def layout_job(tree: gl.ModuleTree, expanded: frozenset[str], cache_dir: str | None, progress, cancel):
    view = tree.view(expanded)
    return expanded, view, gl.cached_layout(view, tree.profile.fingerprint, expanded, cache_dir)


def _mix(a: QColor, b: QColor, t: float) -> QColor:
    return QColor(round(a.red() + (b.red() - a.red()) * t), round(a.green() + (b.green() - a.green()) * t),
                  round(a.blue() + (b.blue() - a.blue()) * t))


def _plain_pen(item: gl.Item) -> QPen:
    return QPen(QColor(90, 90, 90), 1.2 if item.is_group else 0.6)


class _Canvas(QGraphicsView):
    """Zoom with the wheel (anchored under the mouse), pan by dragging; a press-release without motion clicks."""

    clicked = Signal(str)

    def __init__(self, scene: QGraphicsScene, parent: QWidget | None = None) -> None:
        super().__init__(scene, parent)
        self.setRenderHints(QPainter.RenderHint.Antialiasing | QPainter.RenderHint.TextAntialiasing)
        self.setDragMode(QGraphicsView.DragMode.ScrollHandDrag)
        self.setTransformationAnchor(QGraphicsView.ViewportAnchor.AnchorUnderMouse)
        self.setViewportUpdateMode(QGraphicsView.ViewportUpdateMode.BoundingRectViewportUpdate)
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
    """The graph panel: search bar, legend and the zoomable canvas."""

    nodeSelected = Signal(str)
    status = Signal(str)

    def __init__(self, cache_dir: str | None = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.cache_dir = cache_dir
        self.scene = QGraphicsScene(self)
        self.canvas = _Canvas(self.scene)
        self.canvas.clicked.connect(self._on_clicked)
        self.search = QLineEdit(placeholderText="Search node name, op or module (Enter: next match)")
        self.search.returnPressed.connect(self.next_match)
        self.search.textChanged.connect(self._on_search_changed)
        self.matches_label = QLabel("")
        fit = QPushButton("Fit")
        fit.clicked.connect(self.fit)
        collapse = QPushButton("Collapse all")
        collapse.clicked.connect(self.collapse_all)
        bar = QHBoxLayout()
        bar.addWidget(self.search, 1)
        bar.addWidget(self.matches_label)
        bar.addWidget(fit)
        bar.addWidget(collapse)
        legend = QLabel(
            f'<span style="color:{RETAINED.name()}">■</span> retained '
            f'<span style="color:{RECOMPUTED.name()}">■</span> recomputed '
            f'<span style="color:{REPLAYED.name()}">■</span> replayed in backward '
            f'<span style="color:{INSERTED.name()}">□</span> recomputation inserted before · '
            "shade = activation bytes, width = bytes allocated")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(bar)
        layout.addWidget(legend)
        layout.addWidget(self.canvas, 1)
        self.runner = JobRunner("layout", self)
        self.runner.resultReady.connect(self._on_layout)
        self.runner.failed.connect(lambda msg, _details: self.status.emit(f"Graph layout failed: {msg}"))
        self.tree: gl.ModuleTree | None = None
        self.expanded: frozenset[str] = frozenset()
        self.view: gl.View | None = None
        self.layout: gl.Layout | None = None
        self._boxes: list[QGraphicsRectItem] = []
        self._pens: list[QPen] = []
        self._decisions: Decisions | None = None
        self._selected = ""
        self._matches: list[int] = []
        self._match_pos = -1
        self._focus_after_layout = ""
        self._fit_after_layout = False
        self.message = ""  # the last layout's status line

    # -- profile and layout ----------------------------------------------------------------------------------
    def set_tree(self, tree: gl.ModuleTree) -> None:
        self.tree = tree
        self._selected = ""
        self._matches = []
        self._decisions = None
        self.scene.clear()
        self._boxes = []
        self.view = self.layout = None
        self._fit_after_layout = True
        self.set_expanded(tree.default_expansion())

    def set_expanded(self, expanded: frozenset[str]) -> None:
        if self.tree is None:
            return
        self.status.emit("Laying out the graph…")
        self.runner.submit(partial(layout_job, self.tree, frozenset(expanded), self.cache_dir))

    def _on_layout(self, result) -> None:
        expanded, view, layout = result
        self.expanded, self.view, self.layout = expanded, view, layout
        self._draw()
        if self._decisions is not None:
            self.recolour(self._decisions)
        self._outline()
        if layout.engine == "dot":
            self.message = f"Graph: {len(view.items)} boxes, {len(view.edges)} edges (graphviz dot)"
        else:
            self.message = (f"Graph: graphviz 'dot' not found, using a simple layered layout "
                            f"({len(view.items)} boxes); install graphviz for a better one")
        self.status.emit(self.message)
        if self._fit_after_layout:
            self._fit_after_layout = False
            self.fit()
        if self._focus_after_layout:
            self._center_on_node(self._focus_after_layout)
            self._focus_after_layout = ""

    def _draw(self) -> None:
        self.scene.clear()
        self._boxes = []
        font = QFont()
        font.setPointSizeF(7)
        title_font = QFont()
        title_font.setPointSizeF(8)
        title_font.setBold(True)
        for depth_key, label, (x, y, w, h) in self.layout.clusters:
            frame = self.scene.addRect(QRectF(x, y, w, h), QPen(QColor(150, 150, 150), 1, Qt.PenStyle.DashLine),
                                       QBrush(QColor(0, 0, 0, 10)))
            frame.setZValue(-5 + depth_key.count(gl.SEP) * 0.1)
            frame.setData(KEY_ROLE, f"c:{depth_key}")
            frame.setToolTip(f"{depth_key} (click the frame to collapse)")
            text = QGraphicsSimpleTextItem(label, frame)
            text.setFont(title_font)
            text.setPos(x + 4, y + 2)
        edges = QPainterPath()
        for pts in self.layout.edges:
            if len(pts) >= 4:
                edges.moveTo(*pts[0])
                for k in range(1, len(pts) - 2, 3):
                    edges.cubicTo(QPointF(*pts[k]), QPointF(*pts[k + 1]), QPointF(*pts[k + 2]))
        path_item = QGraphicsPathItem(edges)
        path_item.setPen(QPen(QColor(120, 120, 120, 150), 0.8))
        path_item.setZValue(-1)
        path_item.setCacheMode(QGraphicsItem.CacheMode.DeviceCoordinateCache)  # the edges never change colour
        self.scene.addItem(path_item)
        for item, (x, y, w, h) in zip(self.view.items, self.layout.boxes):
            box = QGraphicsRectItem(QRectF(x, y, w, h))
            box.setBrush(QBrush(REGION_FILL.get(item.region, QColor(230, 230, 230))))
            box.setData(KEY_ROLE, f"g:{item.key}" if item.is_group else f"n:{item.key}")
            box.setToolTip(self._tooltip(item))
            text = QGraphicsSimpleTextItem(item.label, box)
            text.setFont(font)
            text.setPos(x + 3, y + 2)
            self.scene.addItem(box)
            self._boxes.append(box)
        self._pens = [_plain_pen(item) for item in self.view.items]
        self.scene.setSceneRect(self.scene.itemsBoundingRect().adjusted(-20, -20, 20, 20))

    def _tooltip(self, item: gl.Item) -> str:
        from acstudio.plan.budget import format_bytes

        if item.is_group:
            return f"{item.key}\n{len(item.nodes)} nodes, {format_bytes(item.bytes)} allocated\nclick to expand"
        n = self.tree.profile.nodes[item.nodes[0]]
        return f"{n.id} {n.name}\n{n.target}\n{n.module or n.region}\n{n.shape} {n.dtype}"

    # -- colours ---------------------------------------------------------------------------------------------
    def recolour(self, decisions: Decisions) -> None:
        """Colour every box by the plan: retained/recomputed mix, replayed, inserted recomputations."""
        self._decisions = decisions
        if self.view is None or not self._boxes:
            return
        k = len(self.view.items)
        idx = self.view.node_item
        rec = np.bincount(idx, weights=decisions.recomputed_bytes, minlength=k)
        ret = np.bincount(idx, weights=decisions.retained_bytes, minlength=k)
        rep = np.bincount(idx, weights=decisions.replayed, minlength=k)
        ins = np.bincount(idx, weights=decisions.inserted, minlength=k)
        act = rec + ret
        top = math.log1p(float(act.max(initial=0.0)))
        for i, (box, item) in enumerate(zip(self._boxes, self.view.items)):
            if act[i] > 0:
                colour = _mix(RETAINED, RECOMPUTED, rec[i] / act[i])
                colour.setAlpha(70 + round(185 * math.log1p(act[i]) / top) if top else 255)
            elif rep[i] > 0:
                colour = QColor(REPLAYED)
            else:
                colour = REGION_FILL.get(item.region, QColor(230, 230, 230))
            box.setBrush(QBrush(colour))
            self._pens[i] = QPen(INSERTED, 3) if ins[i] > 0 else _plain_pen(item)
        self._outline()

    def box_colour(self, key: str) -> QColor | None:
        """Fill colour of the box with ``key`` (group key or node id), for tests and the benchmark."""
        for box, item in zip(self._boxes, self.view.items if self.view else []):
            if item.key == key:
                return box.brush().color()
        return None

    # -- selection, search, expansion ------------------------------------------------------------------------
    def select_node(self, node_id: str) -> None:
        """Highlight ``node_id``, expanding its groups first if it is hidden inside one."""
        if self.tree is None or node_id not in self.tree.profile.node_index:
            return
        self._selected = node_id
        i = self.tree.profile.node_index[node_id]
        if self.view is not None and self.view.items[self.view.node_item[i]].is_group:
            self._focus_after_layout = node_id
            self.set_expanded(self.expanded | set(self.tree.ancestors(i)))
            return
        self._outline()
        self._center_on_node(node_id)

    def _center_on_node(self, node_id: str) -> None:
        if self.view is None:
            return
        i = self.tree.profile.node_index[node_id]
        box = self._boxes[self.view.node_item[i]]
        self.canvas.centerOn(box)

    def _outline(self) -> None:
        if self.view is None:
            return
        marked = {int(self.view.node_item[i]) for i in self._matches}
        selected = -1
        if self._selected in self.tree.profile.node_index:
            selected = int(self.view.node_item[self.tree.profile.node_index[self._selected]])
        for i, box in enumerate(self._boxes):
            box.setZValue(2 if i == selected else 1 if i in marked else 0)
            if i == selected:
                box.setPen(QPen(QColor(0, 0, 0), 3))
            elif i in marked:
                box.setPen(QPen(QColor(230, 200, 0), 3))
            else:
                box.setPen(self._pens[i])

    def _on_clicked(self, key: str) -> None:
        kind, _, value = key.partition(":")
        if kind == "g":
            self.set_expanded(self.expanded | {value})
        elif kind == "c":
            self.set_expanded(frozenset(k for k in self.expanded if k != value and not k.startswith(value + gl.SEP)))
        elif kind == "n":
            self._selected = value
            self._outline()
            self.nodeSelected.emit(value)

    def collapse_all(self) -> None:
        self.set_expanded(frozenset())

    def _on_search_changed(self, text: str) -> None:
        self._matches = self.tree.search(text) if self.tree is not None else []
        self._match_pos = -1
        self.matches_label.setText(f"{len(self._matches)} matches" if text.strip() else "")
        self._outline()

    def next_match(self) -> None:
        """Go to the next search match (expanding its groups) and select it."""
        if not self._matches:
            return
        self._match_pos = (self._match_pos + 1) % len(self._matches)
        node_id = self.tree.profile.nodes[self._matches[self._match_pos]].id
        self.matches_label.setText(f"{self._match_pos + 1}/{len(self._matches)}")
        self.select_node(node_id)
        self.nodeSelected.emit(node_id)

    def fit(self) -> None:
        rect = self.scene.sceneRect()
        if rect.isEmpty():
            return
        self.canvas.fitInView(rect, Qt.AspectRatioMode.KeepAspectRatio)
        if self.canvas.transform().m11() < MIN_FIT_SCALE:  # keep labels readable: show the start instead
            self.canvas.resetTransform()
            self.canvas.scale(MIN_FIT_SCALE, MIN_FIT_SCALE)
            self.canvas.centerOn(rect.left(), rect.center().y())

    def shutdown(self) -> None:
        self.runner.shutdown()
