"""Background jobs for the GUI: one worker thread per kind of job, where the newest request wins.

A job is any callable ``fn(progress, cancel)`` (engine calls bound with :func:`functools.partial`). Each
:meth:`JobRunner.submit` cancels the previous job's token and bumps a job id; results, progress and errors
of any job that is not the newest are dropped (napari's slicer does the same). Cancellation is cooperative:
a job stops at its next ``acstudio.jobs.check(cancel)``; one that never checks runs to completion and its
result is then discarded.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from typing import Any

from PySide6.QtCore import QObject, QThread, Signal, Slot

from acstudio.errors import ACStudioError, Cancelled
from acstudio.jobs import CancelToken

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
