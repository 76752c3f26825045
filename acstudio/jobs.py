"""Progress reporting and cancellation for long engine calls, shared by the CLI (tqdm-like bar) and the GUI.

Engine functions take ``progress: ProgressFn | None`` and ``cancel: CancelToken | None``. They call
``progress(done, total, message)`` now and then and ``cancel.raise_if_cancelled()`` between units of work;
a cancelled call raises :class:`~acstudio.errors.Cancelled` after releasing what it holds.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

from acstudio.errors import Cancelled

ProgressFn = Callable[[int, int, str], None]


class CancelToken:
    """Thread-safe flag that a worker polls; set from another thread (GUI Cancel, Ctrl-C, app close)."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def cancel(self) -> None:
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def raise_if_cancelled(self) -> None:
        if self._event.is_set():
            raise Cancelled("cancelled by the user")


class Precedence:
    """Background jobs that give way to one kind of urgent job. Python threads share one interpreter lock, so a
    long job beside the urgent one slows it several times over; wrapped with :meth:`giving_way`, a job's
    cancellation checks (between its units of work) also wait while a job wrapped with :meth:`urgent` runs."""

    POLL_S = 0.05  # how often a job that gives way looks at its own cancel token while it waits

    def __init__(self) -> None:
        self._idle = threading.Event()
        self._idle.set()

    def urgent(self, fn: Callable) -> Callable:
        """``fn(progress, cancel)``, during which the jobs that give way wait."""
        def run(progress: ProgressFn | None, cancel: CancelToken | None):
            self._idle.clear()
            try:
                return fn(progress, cancel)
            finally:
                self._idle.set()
        return run

    def giving_way(self, fn: Callable) -> Callable:
        """``fn(progress, cancel)`` with a cancel token whose checks wait while an urgent job runs."""
        def run(progress: ProgressFn | None, cancel: CancelToken | None):
            return fn(progress, _GivingWay(cancel if cancel is not None else CancelToken(), self._idle))
        return run


class _GivingWay(CancelToken):
    """A job's own cancel token (the same flag), whose checks also wait until ``idle`` is set."""

    def __init__(self, token: CancelToken, idle: threading.Event) -> None:
        self._event, self._idle = token._event, idle

    def raise_if_cancelled(self) -> None:
        while not self._idle.wait(Precedence.POLL_S):
            super().raise_if_cancelled()
        super().raise_if_cancelled()


def check(cancel: CancelToken | None) -> None:
    """Raise :class:`Cancelled` if ``cancel`` is set; accepts ``None`` for callers that cannot cancel."""
    if cancel is not None:
        cancel.raise_if_cancelled()


def report(progress: ProgressFn | None, done: int, total: int, message: str) -> None:
    if progress is not None:
        progress(done, total, message)


class TerminalProgress:
    """A single-line progress bar on stderr for the CLI; redraws at most 10 times a second."""

    def __init__(self, stream=sys.stderr, width: int = 30) -> None:
        self.stream = stream
        self.width = width
        self._last_draw = 0.0
        self._last_message = ""

    def __call__(self, done: int, total: int, message: str) -> None:
        now = time.monotonic()
        final = total > 0 and done >= total
        if not final and now - self._last_draw < 0.1:
            return
        self._last_draw, self._last_message = now, message
        frac = min(1.0, done / total) if total else 0.0
        filled = int(frac * self.width)
        bar = "#" * filled + "-" * (self.width - filled)
        self.stream.write(f"\r[{bar}] {frac * 100:5.1f}% {message[:60]:<60}")
        if final:
            self.stream.write("\n")
        self.stream.flush()
