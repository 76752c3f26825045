"""Dialogs: new profile, benchmark results, the recent files, and the message sink used for every error the user
sees.

Nothing here blocks the event loop except the dialogs' own ``exec``; the main window never opens a modal
box directly but goes through :class:`Messages`, which tests replace with a recorder.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pyqtgraph as pg
from PySide6.QtCore import QSettings, Qt
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QMessageBox,
    QPushButton,
    QSpinBox,
    QTableView,
    QVBoxLayout,
    QWidget,
)

from acstudio.errors import ACStudioError
from acstudio.gui.models import DataFrameModel, FilterProxy

MAX_RECENT = 8


class Messages:
    """Where the window reports errors and notices: message boxes in the app, a list in tests."""

    def __init__(self, parent: QWidget) -> None:
        self.parent = parent

    def error(self, title: str, message: str, details: str = "") -> None:
        box = QMessageBox(QMessageBox.Icon.Warning, title, message, QMessageBox.StandardButton.Ok, self.parent)
        if details:
            box.setDetailedText(details)
        box.exec()

    def info(self, title: str, message: str) -> None:
        QMessageBox.information(self.parent, title, message)


class RecentFiles:
    """The files opened or saved last, kept in ``settings`` and listed in ``menu`` (a click opens one)."""

    def __init__(self, settings: QSettings, menu: QMenu, open_path: Callable[[str], None]) -> None:
        self.settings, self.menu, self.open_path = settings, menu, open_path
        self._update_menu()

    def paths(self) -> list[str]:
        value = self.settings.value("recent_files", [])
        if isinstance(value, str):  # QSettings returns a bare string for one-element lists
            value = [value]
        return [str(v) for v in value or []]

    def add(self, path: str) -> None:
        recent = [p for p in self.paths() if p != path]
        self.settings.setValue("recent_files", [path, *recent][:MAX_RECENT])
        self.settings.setValue("last_dir", str(Path(path).parent))
        self._update_menu()

    def last_dir(self) -> str:
        return str(self.settings.value("last_dir", ""))

    def _update_menu(self) -> None:
        self.menu.clear()
        for path in self.paths():
            action = self.menu.addAction(path)
            action.triggered.connect(lambda _checked=False, p=path: self.open_path(p))
        self.menu.setEnabled(bool(self.paths()))


def lay_out_form(dialog: QDialog, form: QFormLayout, ok_text: str, *below: QWidget) -> None:
    """The settings dialogs' layout: the form, the widgets ``below`` it, then OK (named ``ok_text``) and Cancel;
    OK calls the dialog's ``_accept``, which validates before closing."""
    buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
    buttons.button(QDialogButtonBox.StandardButton.Ok).setText(ok_text)
    buttons.accepted.connect(dialog._accept)
    buttons.rejected.connect(dialog.reject)
    layout = QVBoxLayout(dialog)
    layout.addLayout(form)
    for widget in below:
        layout.addWidget(widget)
    layout.addWidget(buttons)


class NewProfileDialog(QDialog):
    """Choose a workload (zoo model or ``file.py:factory``) and a device to profile it on.

    The choices (model names, CUDA devices, optimizers, precisions) come from :meth:`set_environment`, found
    in a child process, so opening the dialog never loads torch into the window's process.
    """

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("New profile")
        self.filter = QLineEdit(placeholderText="Filter models")
        self.models = QListWidget()
        self.models.addItem("looking for models and devices…")
        self._family: dict[str, str] = {}
        self.filter.textChanged.connect(self._apply_filter)
        self.models.currentItemChanged.connect(self._update_enabled)
        self.custom = QLineEdit(placeholderText="or your own: path/to/file.py:factory")
        self.custom.textChanged.connect(self._update_enabled)
        browse = QPushButton("Browse…")
        browse.clicked.connect(self._browse)
        custom_row = QHBoxLayout()
        custom_row.addWidget(self.custom, 1)
        custom_row.addWidget(browse)
        self.batch = QSpinBox(minimum=1, maximum=65536, value=8)
        self.image = QSpinBox(minimum=8, maximum=4096, value=224)
        self.seq = QSpinBox(minimum=1, maximum=1 << 20, value=128)
        self.config = QLineEdit(placeholderText="model config overrides, e.g. num_hidden_layers=4 hidden_size=256")
        self.optimizer = QComboBox()
        self.precision = QComboBox()
        self.device = QComboBox()
        self.error = QLabel("")
        self.error.setStyleSheet("color: #b01010")
        self.error.setWordWrap(True)
        form = QFormLayout()
        form.addRow("Model", self.filter)
        form.addRow("", self.models)
        form.addRow("", custom_row)
        form.addRow("Batch size", self.batch)
        form.addRow("Image size", self.image)
        form.addRow("Sequence length", self.seq)
        form.addRow("Config", self.config)
        form.addRow("Optimizer", self.optimizer)
        form.addRow("Precision", self.precision)
        form.addRow("Device", self.device)
        lay_out_form(self, form, "Profile", self.error)
        self.result_spec: dict | None = None

    def set_environment(self, env: dict) -> None:
        """Fill the choices from :func:`~acstudio.views.child.probe_environment`'s answer."""
        self.models.clear()
        self._family = {}
        for family, names in env["models"].items():
            header = QListWidgetItem(f"— {family} —")
            header.setFlags(Qt.ItemFlag.NoItemFlags)
            self.models.addItem(header)
            for name in names:
                self.models.addItem(name)
                self._family[name] = family
        self.optimizer.clear()
        self.optimizer.addItems(env["optimizers"])
        self.optimizer.setCurrentText("adam")
        self.precision.clear()
        self.precision.addItems(env["precisions"])
        self.device.clear()
        for dev, label in env["devices"]:
            self.device.addItem(label, dev)
        self.device.addItem("cpu", "cpu")
        self._apply_filter(self.filter.text())

    def model_name(self) -> str:
        custom = self.custom.text().strip()
        if custom:
            return custom
        item = self.models.currentItem()
        return item.text() if item is not None and item.text() in self._family else ""

    def select_model(self, name: str) -> None:
        for row in range(self.models.count()):
            if self.models.item(row).text() == name:
                self.models.setCurrentRow(row)
                return
        self.custom.setText(name)

    def _apply_filter(self, text: str) -> None:
        t = text.strip().lower()
        for row in range(self.models.count()):
            item = self.models.item(row)
            name = item.text()
            item.setHidden(bool(t) and name in self._family and t not in name.lower())

    def _update_enabled(self, *_args) -> None:
        family = "custom" if self.custom.text().strip() else self._family.get(self.model_name(), "")
        self.image.setEnabled(family in ("torchvision", "custom"))
        self.seq.setEnabled(family in ("transformers", "custom"))

    def _browse(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Model factory file", "", "Python files (*.py)")
        if path:
            self.custom.setText(f"{path}:make")

    def spec(self) -> dict:
        """The chosen workload as ``WorkloadSpec.to_dict()`` fields (the profiling process validates it)."""
        name = self.model_name()
        if not name:
            raise ACStudioError("choose a model from the list or enter file.py:factory")
        if not self.optimizer.currentText():
            raise ACStudioError("still looking for models and devices; try again in a moment")
        config = []
        for part in self.config.text().replace(",", " ").split():
            key, eq, value = part.partition("=")
            if not eq or not key:
                raise ACStudioError(f"config override {part!r} is not key=value")
            config.append([key, value])
        return {"model": name, "batch_size": self.batch.value(), "optimizer": self.optimizer.currentText(),
                "precision": self.precision.currentText(), "image_size": self.image.value(),
                "seq_len": self.seq.value(), "config": config, "seed": 0}

    def device_string(self) -> str:
        return str(self.device.currentData())

    def _accept(self) -> None:
        try:
            self.result_spec = self.spec()
        except ACStudioError as exc:
            self.error.setText(str(exc))
            return
        self.accept()


class BenchDialog(QDialog):
    """Benchmark settings: batch sizes, configurations, device, iterations and an optional max-batch search."""

    CONFIGS = (("eager", "eager PyTorch"), ("captured", "captured graph, no checkpointing"),
               ("rewritten", "rewritten with the current plan's budget"), ("per-block", "checkpoint every block"),
               ("compile", "torch.compile"))

    def __init__(self, batch_size: int, budget_bytes: int, devices: list[tuple[str, str]],
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Benchmark")
        self.budget_bytes = budget_bytes
        self.batches = QLineEdit(str(batch_size))
        self.checks: dict[str, QCheckBox] = {}
        box = QVBoxLayout()
        for name, label in self.CONFIGS:
            check = QCheckBox(label)
            check.setChecked(name in ("eager", "captured", "rewritten"))
            self.checks[name] = check
            box.addWidget(check)
        self.device = QComboBox()
        self.set_environment({"devices": devices})
        self.warmup = QSpinBox(minimum=1, maximum=1000, value=3)
        self.iters = QSpinBox(minimum=3, maximum=10000, value=10)
        self.fit = QLineEdit(placeholderText="optional, e.g. 16GiB: search the largest batch that fits")
        self.error = QLabel("")
        self.error.setStyleSheet("color: #b01010")
        form = QFormLayout()
        form.addRow("Batch sizes", self.batches)
        form.addRow("Configurations", box)
        form.addRow("Device", self.device)
        form.addRow("Warm-up steps", self.warmup)
        form.addRow("Timed steps", self.iters)
        form.addRow("Max batch within", self.fit)
        note = QLabel("Every configuration runs in its own process; the rewritten one is planned again from a "
                      "profile measured on the chosen device.")
        note.setWordWrap(True)
        lay_out_form(self, form, "Run", note, self.error)
        self.settings: dict | None = None

    def set_environment(self, env: dict) -> None:
        """Offer the CUDA devices found (first) and the CPU."""
        self.device.clear()
        for dev, label in env["devices"]:
            self.device.addItem(label, dev)
        self.device.addItem("cpu (dry run: host times, estimated peaks)", "cpu")

    def values(self) -> dict:
        """Keyword arguments for :func:`acstudio.bench.run_bench` (besides the workload and output folder)."""
        try:
            batches = [int(b) for b in self.batches.text().replace(",", " ").split()]
        except ValueError:
            raise ACStudioError("batch sizes must be whole numbers, e.g. 32, 64") from None
        if not batches or min(batches) < 1:
            raise ACStudioError("give at least one batch size")
        configs = [f"rewritten@{self.budget_bytes}" if n == "rewritten" else n
                   for n, check in self.checks.items() if check.isChecked()]
        if not configs:
            raise ACStudioError("choose at least one configuration")
        return {"batch_sizes": batches, "configs": configs, "device": str(self.device.currentData()),
                "warmup": self.warmup.value(), "iters": self.iters.value(),
                "fit_budget": self.fit.text().strip() or None}

    def _accept(self) -> None:
        try:
            self.settings = self.values()
        except ACStudioError as exc:
            self.error.setText(str(exc))
            return
        self.accept()


class TableDialog(QDialog):
    """A sortable table of a DataFrame with an optional scatter plot (benchmark results)."""

    def __init__(self, title: str, df: pd.DataFrame, plot: tuple[str, str] | None = None,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle(title)
        self.resize(900, 560)
        self.model = DataFrameModel(df, parent=self)
        proxy = FilterProxy(self)
        proxy.setSourceModel(self.model)
        table = QTableView()
        table.setModel(proxy)
        table.setSortingEnabled(True)
        table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        layout = QVBoxLayout(self)
        layout.addWidget(table, 2)
        if plot is not None and all(c in df.columns for c in plot):
            x, y = plot
            chart = pg.PlotWidget(background="w")
            chart.getPlotItem().setLabel("bottom", x)
            chart.getPlotItem().setLabel("left", y)
            data = df[[x, y]].apply(pd.to_numeric, errors="coerce").dropna()
            chart.getPlotItem().plot(data[x].to_numpy(), data[y].to_numpy(), pen=None, symbol="o", symbolSize=8)
            layout.addWidget(chart, 1)
        close = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        close.rejected.connect(self.reject)
        layout.addWidget(close)


BENCH_COLUMNS = ("batch_size", "config", "status", "peak_mib", "time_ms_median", "time_ms_iqr", "overhead_pct",
                 "memory_saving_pct", "message")


def bench_results_dialog(results: pd.DataFrame, parent: QWidget) -> TableDialog:
    """Benchmark results as a table with a plot of peak against time."""
    columns = [c for c in BENCH_COLUMNS if c in results.columns]
    return TableDialog("Benchmark results", results[columns], ("peak_mib", "time_ms_median"), parent)


class EnvironmentProbe:
    """The models and devices the dialogs offer, asked once of a child process (``runner``'s job) and handed to
    every dialog that waits for them."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.environment: dict | None = None
        self._waiting: list[NewProfileDialog | BenchDialog] = []
        runner.resultReady.connect(self._on_environment)

    def devices(self) -> list[tuple[str, str]]:
        return [tuple(d) for d in (self.environment or {}).get("devices", [])]

    def give(self, dialog: NewProfileDialog | BenchDialog) -> None:
        """Give ``dialog`` the models and devices now, or when the (one) probe process answers."""
        if self.environment is not None:
            dialog.set_environment(self.environment)
            return
        self._waiting.append(dialog)
        if not self.runner.busy:
            from acstudio.views.child import probe_environment

            self.runner.submit(probe_environment)

    def _on_environment(self, env: dict) -> None:
        self.environment = env
        for dialog in self._waiting:
            dialog.set_environment(env)
        self._waiting = []
