"""Engine work in a child Python process, and how parent and child talk: the app's background child
(:mod:`acstudio.views.child`) and the benchmark's workers (:mod:`acstudio.bench.worker`) both use it.

A child process frees every byte of GPU memory when it ends, keeps one measurement's allocator, compile caches
and process-wide settings from the next, can be killed when it stops answering, and cannot take its parent down
when the user's model crashes.

Protocol. The parent starts ``python ARGS`` in a session of its own, so that killing its process group also ends
what it started (torch.compile's compile workers, torchrun's ranks). It may write a task as one JSON line on the
child's stdin, and later the line ``cancel``; closing stdin means the parent has gone. The child answers with lines
``@acstudio {json}`` on stdout: any number of messages along the way (``progress``: ``[done, total, text]``, or
its own), then one final message: ``done`` (the result), ``cancelled`` or ``error`` (one line; ``details``: the
traceback of an unexpected exception). Everything else the child prints goes to stderr, its log: the parent keeps
it in a file and quotes its tail when the child ends without a final message.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

from acstudio.errors import ACStudioError, Cancelled
from acstudio.jobs import CancelToken, ProgressFn, report

MARK = "@acstudio "
FINAL = frozenset({"done", "cancelled", "error"})
LOG_TAIL_BYTES = 2000  # how much of a crashed child's log its error quotes
LOG_TAIL_LINES = 20
POLL_S = 0.1  # how often the parent looks at the cancel token and the clock while the child is quiet


class ChildError(Exception):
    """An unexpected error in the child; ``details`` is its traceback there."""

    def __init__(self, message: str, details: str) -> None:
        super().__init__(message)
        self.details = details


class ChildFailed(ACStudioError):
    """The child ended without a final message: it crashed, was killed or exited; ``log_tail`` is the end of what
    it printed."""

    def __init__(self, what: str, exit_code: int, log_tail: str) -> None:
        super().__init__(f"{what} ended unexpectedly (exit code {exit_code})" + (f":\n{log_tail}" if log_tail else ""))
        self.exit_code, self.log_tail = exit_code, log_tail


class ChildTimedOut(ACStudioError):
    """The child ran longer than it was given and was killed."""

    def __init__(self, what: str, timeout_s: float) -> None:
        super().__init__(f"{what} timed out after {timeout_s:g} s")
        self.timeout_s = timeout_s


# -- parent side ------------------------------------------------------------------------------------------------
def run_child(args: Sequence[str], *, task: Any = None, progress: ProgressFn | None = None,
              on_message: Callable[[dict[str, Any]], None] | None = None, cancel: CancelToken | None = None,
              cancel_grace_s: float = 0.0, timeout_s: float | None = None, log: str | os.PathLike | None = None,
              what: str = "the child process") -> Any:
    """Run ``python ARGS`` to its final message and return what it reported as ``done``.

    ``task`` (JSON-ready) goes to the child's stdin; ``progress`` receives its progress messages, ``on_message``
    its other messages along the way. On ``cancel`` the child is asked to stop and killed after ``cancel_grace_s``
    (at once when 0: a child that does not listen), then :class:`~acstudio.errors.Cancelled` is raised; past
    ``timeout_s`` it is killed and :class:`ChildTimedOut` raised. ``log`` keeps the child's stderr in that file
    (else a temporary one). A child that reports an error raises it (:class:`ChildError` with its traceback if it
    was unexpected), one that ends without a final message :class:`ChildFailed`. Whatever happens (Ctrl-C too),
    the child and what it started are not left running.
    """
    with _log_file(log) as log_file:
        proc = subprocess.Popen([sys.executable, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=log_file, text=True, bufsize=1, start_new_session=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
        try:
            if task is not None:
                _tell(proc, json.dumps(task))
            final = _converse(proc, progress, on_message, cancel, cancel_grace_s, timeout_s, what)
            code = proc.wait()
        finally:
            if proc.poll() is None:
                kill_group(proc)
            with contextlib.suppress(OSError):
                proc.stdin.close()
        if final is None:
            raise ChildFailed(what, code, _tail(log_file))
    if "cancelled" in final:
        raise Cancelled("cancelled by the user")
    if "error" in final:
        if final.get("details"):
            raise ChildError(final["error"], final["details"])
        raise ACStudioError(final["error"])
    return final["done"]


def _converse(proc: subprocess.Popen, progress: ProgressFn | None, on_message, cancel: CancelToken | None,
              cancel_grace_s: float, timeout_s: float | None, what: str) -> dict[str, Any] | None:
    """Read the child's messages until its stdout closes; return the final one (None if none came)."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:  # closes stdout itself: a process the child started and left running may hold it open
        with proc.stdout:
            for line in proc.stdout:
                lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    asked: float | None = None
    final = None
    while True:
        now = time.monotonic()
        if cancel is not None and cancel.cancelled and final is None:
            if asked is None and cancel_grace_s > 0:
                asked = now
                _tell(proc, "cancel")
            elif asked is None or now - asked > cancel_grace_s:
                kill_group(proc)
                raise Cancelled(f"cancelled by the user ({what} was stopped)")
        if deadline is not None and now > deadline:
            kill_group(proc)
            raise ChildTimedOut(what, timeout_s)
        try:
            line = lines.get(timeout=POLL_S)
        except queue.Empty:
            continue
        if line is None:
            return final
        if not line.startswith(MARK) or final is not None:
            continue
        message = json.loads(line[len(MARK):])
        if FINAL & message.keys():
            final = message
        elif "progress" in message:
            report(progress, *message["progress"])
        elif on_message is not None:
            on_message(message)


def _tell(proc: subprocess.Popen, line: str) -> None:
    """Write one line to the child; a child that has gone already is reported by how it ended."""
    with contextlib.suppress(OSError, ValueError):
        proc.stdin.write(line + "\n")
        proc.stdin.flush()


def kill_group(proc: subprocess.Popen) -> None:
    """Kill the child and whatever it started (they share its process group), and reap it."""
    try:
        if hasattr(os, "killpg"):
            os.killpg(proc.pid, signal.SIGKILL)
        else:  # pragma: no cover - Windows
            proc.kill()
    except ProcessLookupError:
        pass
    proc.wait()


@contextlib.contextmanager
def _log_file(path: str | os.PathLike | None) -> Iterator[IO[bytes]]:
    with (open(path, "w+b") if path is not None else tempfile.TemporaryFile("w+b")) as f:
        yield f


def _tail(log_file: IO[bytes]) -> str:
    size = os.fstat(log_file.fileno()).st_size
    log_file.seek(max(0, size - LOG_TAIL_BYTES))
    text = log_file.read().decode("utf-8", errors="replace")
    return "\n".join(text.strip().splitlines()[-LOG_TAIL_LINES:])


# -- child side -------------------------------------------------------------------------------------------------
_channel: IO[str] | None = None  # the real stdout while stdout_for_messages() routes fd 1 to stderr


def emit(message: dict[str, Any]) -> None:
    """Send one message to the parent."""
    stream = _channel or sys.stdout
    stream.write(MARK + json.dumps(message) + "\n")
    stream.flush()


def send_progress(done: int, total: int, text: str) -> None:
    """A :data:`~acstudio.jobs.ProgressFn` that reports to the parent."""
    emit({"progress": [done, total, text]})


@contextlib.contextmanager
def stdout_for_messages() -> Iterator[None]:
    """Route everything printed meanwhile, by Python or by C++ code, to stderr; :func:`emit` keeps the real
    stdout, which so carries nothing but messages."""
    global _channel
    sys.stdout.flush()
    _channel = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(_channel.fileno(), 1)
        _channel.close()
        _channel = None


def read_task() -> Any:
    """The task the parent wrote on stdin."""
    return json.loads(sys.stdin.readline())


def cancel_on_request(token: CancelToken) -> None:
    """Cancel ``token`` when the parent says so, or when it goes away (stdin closed)."""
    def watch() -> None:
        for line in sys.stdin:
            if line.strip() == "cancel":
                break
        token.cancel()

    threading.Thread(target=watch, daemon=True).start()


def serve(work: Callable[[], Any]) -> int:
    """Run ``work`` and send its final message: ``done`` with what it returns, ``cancelled``, or the error (an
    :class:`~acstudio.errors.ACStudioError`'s one line, anything else with its traceback, never a silent exit).
    Returns the exit status."""
    with stdout_for_messages():
        try:
            result = work()
        except Cancelled:
            emit({"cancelled": True})
            return 3
        except ACStudioError as exc:
            emit({"error": str(exc)})
            return 2
        except Exception as exc:
            emit({"error": f"{type(exc).__name__}: {exc}", "details": traceback.format_exc()})
            return 1
        emit({"done": result})
        return 0
