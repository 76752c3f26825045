"""The activation table: one row per activation, its plan columns following the session's plan, filtered by a
text box and by the timeline's span, its selection shared with the graph and the timeline.

Bound to the :class:`~acstudio.views.session.Session`: a row the user picks selects its activation in the
session; the session's selection selects the row without saying it back.
"""

from __future__ import annotations

from PySide6.QtCore import QSignalBlocker, Qt, QTimer, Signal
from PySide6.QtWidgets import QAbstractItemView, QHeaderView, QLineEdit, QStyle, QTableView, QVBoxLayout, QWidget

from acstudio.gui.graph_view import DECISION_COLOURS
from acstudio.gui.models import ID_ROLE, DataFrameModel, FilterProxy, fmt_bytes, fmt_int, fmt_ms, fmt_ratio
from acstudio.units import format_bytes
from acstudio.views.session import PlanState, Session

MAX_COLUMN_PX = 280
SIZE_SAMPLE_ROWS = 60  # sizing columns on all of ResNet-152's 2000 rows would take seconds
TABLE_FORMATS = {"bytes": fmt_bytes, "inactive_ms": fmt_ms, "recompute_ms": fmt_ms, "ratio": fmt_ratio,
                 "step": fmt_int, "replay_nodes": fmt_int}
TABLE_HEADERS = {"inactive_ms": "inactive (ms)", "recompute_ms": "recompute (ms)", "ratio": "ratio (MiB/ms)",
                 "lifetime": "lifetime (nodes)", "first_bw_use": "first backward use", "replay_nodes": "replays",
                 "step": "μ-TWO step"}


class ActivationTable(QWidget):
    statusMessage = Signal(str)  # what the table shows, when it shows less than every activation

    def __init__(self, session: Session, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.session = session
        self.model = DataFrameModel(formats=TABLE_FORMATS, headers=TABLE_HEADERS,
                                    colours={"decision": DECISION_COLOURS}, parent=self)
        self.proxy = FilterProxy(self)
        self.proxy.setSourceModel(self.model)
        self.view = QTableView()
        self.view.setModel(self.proxy)
        self.view.setSortingEnabled(True)
        self.view.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.view.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.view.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Interactive)
        self.view.setTextElideMode(Qt.TextElideMode.ElideRight)  # a cut cell ends in "…"; its tooltip has it all
        self.view.horizontalHeader().setResizeContentsPrecision(SIZE_SAMPLE_ROWS)
        self.view.verticalHeader().setVisible(False)
        self.view.verticalHeader().setDefaultSectionSize(self.view.fontMetrics().height() + 6)
        self.view.selectionModel().currentRowChanged.connect(self._on_row)
        self.filter = QLineEdit(placeholderText="Filter activations (any column)")
        self.filter.textChanged.connect(self.proxy.setFilterFixedString)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.filter)
        layout.addWidget(self.view)
        self._unsized = False  # a profile opened and its columns wait for the first complete plan
        session.events.loaded.connect(self._on_loaded)
        session.events.plan.connect(self._on_plan)
        session.events.selection.connect(lambda _node: self._show_selection())
        session.events.span.connect(lambda _nodes: self._show_span())

    def _on_loaded(self, loaded) -> None:
        self.model.set_frame(loaded.table)
        self.proxy.sort(-1)  # graph order until the user sorts
        self.view.horizontalHeader().setSortIndicator(-1, Qt.SortOrder.AscendingOrder)
        self._unsized = True

    def _on_plan(self, state: PlanState) -> None:
        self.model.set_columns(self.session.table_columns(state))
        if state.complete and self._unsized:
            self._unsized = False
            QTimer.singleShot(0, self.size_columns)

    def _show_selection(self) -> None:
        if not self.session.selected_activation:
            return
        row = self.model.row_of(self.session.selected_activation)
        proxy_index = self.proxy.mapFromSource(self.model.index(row, 0))
        if proxy_index.isValid():
            with QSignalBlocker(self.view.selectionModel()):
                self.view.selectRow(proxy_index.row())
            self.view.scrollTo(proxy_index)

    def _show_span(self) -> None:
        """A timeline span selects the activations alive in it: the table shows only those."""
        alive = self.session.span_activations
        self.proxy.set_only(set(self.session.loaded.table.index[alive]) if alive.any() else None)
        if alive.any():
            self.statusMessage.emit(f"{int(alive.sum())} activations alive in the selected span "
                                    f"({format_bytes(int(self.session.loaded.acts.bytes[alive].sum()))}); the table "
                                    "shows only them until the span is switched off")

    def _on_row(self, current, _previous) -> None:
        act_id = current.data(ID_ROLE)
        if act_id and self.session.loaded is not None:
            act = self.session.loaded.profile.activation_by_id.get(act_id)
            if act is not None:
                self.session.select(act.created_at, act_id)

    def size_columns(self) -> None:
        """Every column as wide as its content (judged on the first :data:`SIZE_SAMPLE_ROWS` rows) and its header,
        up to :data:`MAX_COLUMN_PX` (longer cells end in "…" and show in full as a tooltip).

        Measured here from the formatted texts, as Qt's item delegate pads them: ``resizeColumnsToContents`` asks
        the model for eight roles of every sampled cell, a tenth of a second of Python calls on the GUI thread."""
        model, metrics = self.model, self.view.fontMetrics()
        margin = self.view.style().pixelMetric(QStyle.PixelMetric.PM_FocusFrameHMargin) + 1
        padding = 2 * margin + 2  # the delegate's text margins, and the grid line
        rows = range(min(SIZE_SAMPLE_ROWS, model.rowCount()))
        header = self.view.horizontalHeader()
        for c in range(model.columnCount()):
            text = max((metrics.horizontalAdvance(model.text(r, c)) for r in rows), default=0)
            self.view.setColumnWidth(c, min(max(text + padding, header.sectionSizeHint(c)), MAX_COLUMN_PX))
