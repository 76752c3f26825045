"""Background jobs for the GUI: one worker thread per kind of job, where the newest request wins, and the status
bar's progress and Cancel for the jobs the user started.

A job is any callable ``fn(progress, cancel)`` (engine calls bound with :func:`functools.partial`). Each
:meth:`JobRunner.submit` cancels the previous job's token and bumps a job id; results, progress and errors
of any job that is not the newest are dropped (napari's slicer does the same). Cancellation is cooperative:
a job stops at its next ``acstudio.jobs.check(cancel)``; one that never checks runs to completion and its
result is then discarded.
"""

from __future__ import annotations

import gc
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from typing import Any

from pyqtgraph.util.garbage_collector import GarbageCollector
from PySide6.QtCore import QObject, QThread, QTimer, Signal, Slot
from PySide6.QtWidgets import QProgressBar, QPushButton, QStatusBar

from acstudio.errors import ACStudioError, Cancelled
from acstudio.jobs import CancelToken

GIL_SWITCH_S = 0.001
Job = Callable[[Callable[[int, int, str], None], CancelToken], Any]
PROGRESS_INTERVAL_S = 0.05  # at most ~20 progress repaints a second, whatever the engine reports


def describe_error(exc: BaseException) -> tuple[str, str]:
    """A message for the user and, for unexpected errors, the traceback as details."""
    if isinstance(exc, ACStudioError):
        return str(exc), ""
    if getattr(exc, "details", ""):  # raised in a child process: its own traceback is the useful one
        return str(exc), exc.details
    name = type(exc).__name__
    if "OutOfMemory" in name or "out of memory" in str(exc).lower():
        return f"Out of memory: {str(exc).splitlines()[0] if str(exc) else name}", ""
    details = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return f"{name}: {exc}", details


def share_interpreter_with_jobs() -> GarbageCollector:
    """Make Python threads (the planning and layout jobs) share the interpreter well with the GUI thread; keep
    the returned collector while the window lives.

    A job hands the interpreter back within a millisecond (Python's default is 5 ms, several of which add up to a
    visible stall in a repaint). And Python collects reference cycles in whichever thread happens to allocate: a
    planning thread that drops the last reference to a Qt wrapper crashes Qt (a segfault in the tests), so
    pyqtgraph's collector turns automatic collection off and collects on a timer in the GUI thread.
    """
    sys.setswitchinterval(GIL_SWITCH_S)
    return GarbageCollector(interval=0.5)


def stop_sharing_interpreter(collector: GarbageCollector) -> None:
    """The worker threads are gone: automatic collection again, and one collection now, in the GUI thread."""
    collector.timer.stop()
    gc.enable()
    gc.collect()


class _Worker(QObject):
    """Lives in the runner's thread; reports back only through (queued) signals."""

    progressed = Signal(int, int, int, str)
    succeeded = Signal(int, object)
    failed = Signal(int, str, str)
    cancelled = Signal(int)

    @Slot(int, object, object)
    def run(self, job_id: int, fn: Job, token: CancelToken) -> None:
        if token.cancelled:  # superseded while queued: do not start
            self.cancelled.emit(job_id)
            return
        last = [0.0]

        def progress(done: int, total: int, message: str) -> None:
            now = time.monotonic()
            if (total and done >= total) or now - last[0] >= PROGRESS_INTERVAL_S:
                last[0] = now
                self.progressed.emit(job_id, int(done), int(total), str(message))

        try:
            result = fn(progress, token)
        except Cancelled:
            self.cancelled.emit(job_id)
        except Exception as exc:  # every error must come back as a signal, never cross the thread
            message, details = describe_error(exc)
            self.failed.emit(job_id, message, details)
        else:
            if token.cancelled:
                self.cancelled.emit(job_id)
            else:
                self.succeeded.emit(job_id, result)


class JobRunner(QObject):
    """A worker thread running one job at a time; only the newest submitted job reports back."""

    resultReady = Signal(object)
    failed = Signal(str, str)  # message, details (traceback for unexpected errors, else "")
    progress = Signal(int, int, str)
    cancelled = Signal()
    busyChanged = Signal(bool)
    _dispatch = Signal(int, object, object)

    def __init__(self, name: str, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.name = name
        self._thread = QThread(self)
        self._thread.setObjectName(f"acstudio-{name}")
        self._worker = _Worker()
        self._worker.moveToThread(self._thread)
        self._thread.finished.connect(self._worker.deleteLater)
        self._dispatch.connect(self._worker.run)
        self._worker.succeeded.connect(self._on_succeeded)
        self._worker.failed.connect(self._on_failed)
        self._worker.cancelled.connect(self._on_cancelled)
        self._worker.progressed.connect(self._on_progress)
        self._job = 0
        self._token: CancelToken | None = None
        self._running = False
        self._thread.start()

    @property
    def busy(self) -> bool:
        return self._running

    def submit(self, fn: Job) -> int:
        """Run ``fn(progress, cancel)`` in the worker thread after cancelling whatever ran before."""
        if self._token is not None:
            self._token.cancel()
        self._job += 1
        self._token = CancelToken()
        self._set_running(True)
        self._dispatch.emit(self._job, fn, self._token)
        return self._job

    def cancel(self) -> None:
        """Ask the current job to stop; ``cancelled`` is emitted when it has."""
        if self._token is not None:
            self._token.cancel()

    def shutdown(self, timeout_ms: int = 15000) -> bool:
        """Cancel, stop the thread and wait for it; ``False`` if a job did not stop in time."""
        self.cancel()
        self._job += 1  # nothing reports back any more
        self._thread.quit()
        return self._thread.wait(timeout_ms)

    def _set_running(self, running: bool) -> None:
        if running != self._running:
            self._running = running
            self.busyChanged.emit(running)

    def _on_succeeded(self, job_id: int, result: object) -> None:
        if job_id == self._job:
            self._set_running(False)
            self.resultReady.emit(result)

    def _on_failed(self, job_id: int, message: str, details: str) -> None:
        if job_id == self._job:
            self._set_running(False)
            self.failed.emit(message, details)

    def _on_cancelled(self, job_id: int) -> None:
        if job_id == self._job:
            self._set_running(False)
            self.cancelled.emit()

    def _on_progress(self, job_id: int, done: int, total: int, message: str) -> None:
        if job_id == self._job:
            self.progress.emit(done, total, message)


class QtJobs(QObject):
    """The Qt side of a Qt-free model's :class:`~acstudio.views.session.Jobs`: a :class:`JobRunner` per job name,
    with results delivered on the GUI thread. A delayed job waits on a single-shot timer that a newer job of the
    same name restarts, so a burst of requests runs once, for the last of them."""

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._runners: dict[str, JobRunner] = {}
        self._timers: dict[str, QTimer] = {}
        self._pending: dict[str, tuple[Job, Callable[[Any], None], Callable[[str, str], None]]] = {}
        self._callbacks: dict[str, tuple[Callable[[Any], None], Callable[[str, str], None]]] = {}

    @property
    def busy(self) -> bool:
        return any(r.busy for r in self._runners.values()) or any(t.isActive() for t in self._timers.values())

    def submit(self, name: str, fn: Job, on_result: Callable[[Any], None], on_error: Callable[[str, str], None],
               delay_ms: int = 0) -> None:
        self.cancel(name)
        self._pending[name] = (fn, on_result, on_error)
        timer = self._timers.get(name)
        if timer is None:
            timer = self._timers[name] = QTimer(self)
            timer.setSingleShot(True)
            timer.timeout.connect(lambda: self._start(name))
        timer.start(delay_ms)

    def cancel(self, name: str) -> None:
        if name in self._timers:
            self._timers[name].stop()
        self._pending.pop(name, None)
        if name in self._runners:
            self._runners[name].cancel()

    def shutdown(self) -> None:
        for timer in self._timers.values():
            timer.stop()
        for runner in self._runners.values():
            runner.shutdown()

    def _start(self, name: str) -> None:
        fn, on_result, on_error = self._pending.pop(name)
        runner = self._runners.get(name)
        if runner is None:
            runner = self._runners[name] = JobRunner(name, self)
            runner.resultReady.connect(lambda result: self._callbacks[name][0](result))
            runner.failed.connect(lambda message, details: self._callbacks[name][1](message, details))
        self._callbacks[name] = (on_result, on_error)
        runner.submit(fn)


class WindowJobs(QObject):
    """A window's own jobs, one :class:`JobRunner` per name. While one that the user started runs (``shown``), the
    status bar shows a progress bar and a Cancel button; the background look-ups stay quiet. ``progressed`` says
    which of those reported what; ``failed`` says which job failed and why."""

    progressed = Signal(str, str)  # (job name, message)
    failed = Signal(str, str, str)  # (job name, message, details)

    def __init__(self, names: tuple[str, ...], shown: tuple[str, ...], status_bar: QStatusBar) -> None:
        super().__init__(status_bar)
        self.shown = shown
        self.runners = {name: JobRunner(name, self) for name in names}
        self.progress = QProgressBar()
        self.progress.setMaximumWidth(260)
        self.progress.hide()
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.hide()
        self.cancel_button.clicked.connect(self.cancel_shown)
        status_bar.addPermanentWidget(self.progress)
        status_bar.addPermanentWidget(self.cancel_button)
        for name, runner in self.runners.items():
            runner.busyChanged.connect(self._update_busy)
            runner.failed.connect(partial(self.failed.emit, name))
            if name in shown:
                runner.progress.connect(partial(self._on_progress, name))

    def __getitem__(self, name: str) -> JobRunner:
        return self.runners[name]

    @property
    def busy(self) -> bool:
        return any(runner.busy for runner in self.runners.values())

    def cancel_shown(self) -> None:
        for name in self.shown:
            self.runners[name].cancel()

    def shutdown(self) -> None:
        for runner in self.runners.values():
            runner.shutdown()

    def _on_progress(self, name: str, done: int, total: int, message: str) -> None:
        self.progress.setRange(0, max(total, 1))
        self.progress.setValue(min(done, max(total, 1)))
        self.progressed.emit(name, message)

    def _update_busy(self, _busy: bool = False) -> None:
        busy = any(self.runners[name].busy for name in self.shown)
        self.progress.setVisible(busy)
        self.cancel_button.setVisible(busy)
        if busy:
            self.progress.setRange(0, 0)
