"""Qt table model over a pandas DataFrame, with a sort/filter proxy.

Cells are formatted when they are shown (a plan change costs nothing for the rows and columns out of view),
and sorting uses the raw values through :data:`SORT_ROLE`, so a 2000-row activation table sorts numerically
and follows the slider cheaply. A plan change replaces only the plan columns with
:meth:`DataFrameModel.set_columns`, which announces only the cells whose value changed: the view then repaints,
and the sort/filter proxy re-examines, a few rows per slider step instead of all of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd
from PySide6.QtCore import QAbstractTableModel, QModelIndex, QPersistentModelIndex, QSortFilterProxyModel, Qt
from PySide6.QtGui import QColor

from acstudio.units import format_bytes

SORT_ROLE = Qt.ItemDataRole.UserRole
ID_ROLE = Qt.ItemDataRole.UserRole + 1  # the row's index value (node or activation id)
Index = QModelIndex | QPersistentModelIndex


def missing(v: Any) -> bool:
    """Empty cell: ``None``, ``NaN`` or ``""`` (plan columns before a plan exists)."""
    return v is None or v == "" or (isinstance(v, float) and math.isnan(v))


def fmt_ms(v: Any) -> str:
    return "" if missing(v) else f"{v:.3f}"


def fmt_ratio(v: Any) -> str:
    """Recompute ratio in bytes freed per ms of recomputation, shown in MiB/ms."""
    return "" if missing(v) else f"{v / 2**20:.2f}"


def fmt_bytes(v: Any) -> str:
    return "" if missing(v) else format_bytes(int(v))


def fmt_int(v: Any) -> str:
    return "" if missing(v) else str(int(v))


def cells_differ(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Per row: does the cell change? Empty cells (NaN, ``None``, ``""``) equal each other."""
    if old.dtype.kind == "f" and new.dtype.kind == "f":
        return ~((old == new) | (np.isnan(old) & np.isnan(new)))
    differ = old != new
    if differ.any():  # NaN != NaN: look at those rows one by one
        rows = np.flatnonzero(differ)
        differ[rows] = [not (missing(a) and missing(b)) for a, b in zip(old[rows], new[rows])]
    return differ


def row_runs(rows: np.ndarray) -> list[tuple[int, int]]:
    """(first, last) of every run of consecutive ``True`` rows."""
    edges = np.diff(np.concatenate([[0], rows.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1).tolist(), (np.flatnonzero(edges == -1) - 1).tolist()))


class DataFrameModel(QAbstractTableModel):
    """Read-only table of ``df`` (its index is the row id); ``formats`` maps column -> formatter."""

    def __init__(self, df: pd.DataFrame | None = None, formats: dict[str, Callable[[Any], str]] | None = None,
                 headers: dict[str, str] | None = None, colours: dict[str, dict[Any, QColor]] | None = None,
                 parent=None) -> None:
        """``colours`` maps column -> cell value -> text colour (the activation table's decisions)."""
        super().__init__(parent)
        self._formats = formats or {}
        self._headers = headers or {}
        self._colours = colours or {}
        self._ids: list[str] = []
        self._columns: list[str] = []
        self._raw: list[list[Any]] = []
        self._arrays: dict[int, np.ndarray] = {}  # the last array each column was set from, to compare against
        self.set_frame(df if df is not None else pd.DataFrame())

    @property
    def columns(self) -> list[str]:
        return list(self._columns)

    def set_frame(self, df: pd.DataFrame) -> None:
        self.beginResetModel()
        self._ids = [str(i) for i in df.index]
        self._columns = [str(c) for c in df.columns]
        self._raw = [df[c].tolist() for c in df.columns]
        self._arrays = {}
        self.endResetModel()

    def set_columns(self, values: dict[str, Sequence[Any] | np.ndarray]) -> None:
        """Replace whole columns (same row order); ``dataChanged`` covers only the runs of rows that changed."""
        changed_rows = np.zeros(len(self._ids), dtype=bool)
        changed_cols = []
        for name, col in values.items():
            c = self._columns.index(name)
            new = col if isinstance(col, np.ndarray) else np.asarray(col, dtype=object)
            old = self._arrays.get(c)
            if old is None or old.dtype != new.dtype:  # compare cell by cell as Python values
                diff = cells_differ(np.asarray(self._raw[c], dtype=object), new.astype(object))
            else:
                diff = cells_differ(old, new)
            self._arrays[c] = new
            if not diff.any():
                continue
            self._raw[c] = new.tolist()
            changed_rows |= diff
            changed_cols.append(c)
        if not changed_cols:
            return
        first, last = min(changed_cols), max(changed_cols)
        for top, bottom in row_runs(changed_rows):
            self.dataChanged.emit(self.index(top, first), self.index(bottom, last))

    def text(self, row: int, column: int) -> str:
        """Cell ``(row, column)`` as shown."""
        v = self._raw[column][row]
        fmt = self._formats.get(self._columns[column])
        if fmt is not None:
            return fmt(v)
        return "" if missing(v) else str(v)

    def row_of(self, row_id: str) -> int:
        try:
            return self._ids.index(row_id)
        except ValueError:
            return -1

    def value(self, row: int, column: str) -> Any:
        return self._raw[self._columns.index(column)][row]

    # -- QAbstractTableModel -------------------------------------------------------------------------------
    def rowCount(self, parent: Index = QModelIndex()) -> int:  # noqa: B008 - Qt's own default
        return 0 if parent.isValid() else len(self._ids)

    def columnCount(self, parent: Index = QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(self._columns)

    def data(self, index: Index, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid():
            return None
        r, c = index.row(), index.column()
        if role == Qt.ItemDataRole.DisplayRole:
            return self.text(r, c)
        if role == Qt.ItemDataRole.ToolTipRole:  # the whole text of a cell its column elides
            return self.text(r, c) or None
        if role == SORT_ROLE:
            v = self._raw[c][r]
            if isinstance(v, float) and math.isnan(v):
                return -math.inf
            return v if isinstance(v, (int, float, str)) else str(v)
        if role == ID_ROLE:
            return self._ids[r]
        if role == Qt.ItemDataRole.ForegroundRole:
            colours = self._colours.get(self._columns[c])
            return colours.get(self._raw[c][r]) if colours else None
        if role == Qt.ItemDataRole.TextAlignmentRole and isinstance(self._raw[c][r], (int, float)):
            return int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        return None

    def headerData(self, section: int, orientation: Qt.Orientation, role: int = Qt.ItemDataRole.DisplayRole):
        if role != Qt.ItemDataRole.DisplayRole:
            return None
        if orientation == Qt.Orientation.Horizontal:
            name = self._columns[section]
            return self._headers.get(name, name)
        return self._ids[section]


class FilterProxy(QSortFilterProxyModel):
    """Sorts on raw values and keeps rows where any column contains the filter text (case-insensitive)."""

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        self._only: set[str] | None = None
        self.setSortRole(SORT_ROLE)
        self.setFilterKeyColumn(-1)
        self.setFilterCaseSensitivity(Qt.CaseSensitivity.CaseInsensitive)

    def set_only(self, ids: set[str] | None) -> None:
        """Show only the rows with these ids (``None``: all), on top of the text filter."""
        self.beginFilterChange()
        self._only = ids
        self.endFilterChange()

    def filterAcceptsRow(self, source_row: int, source_parent: Index) -> bool:
        if self._only is not None:
            row_id = self.sourceModel().index(source_row, 0, source_parent).data(ID_ROLE)
            if row_id not in self._only:
                return False
        return super().filterAcceptsRow(source_row, source_parent)

    def lessThan(self, left: Index, right: Index) -> bool:
        a, b = left.data(SORT_ROLE), right.data(SORT_ROLE)
        if type(a) is not type(b) and not (isinstance(a, (int, float)) and isinstance(b, (int, float))):
            return str(a) < str(b)
        return a < b
