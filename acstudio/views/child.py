"""Long engine calls in child processes, driven from GUI worker threads: profiling, the environment probe, and
the other solvers' sweep.

Building, tracing and measuring a model holds the GIL for long stretches (loading torch's libraries,
``make_fx`` tracing: ~0.2 s at a time), and so does a pure-Python planner; in a thread of the GUI process
either would stall the window. A child process runs on another core, frees every byte of GPU memory when it
ends, can be killed if it stops answering a cancel, and cannot take the window down if the model crashes.

Protocol: ``python -m acstudio.views.child COMMAND ARGS``; for ``profile`` the parent writes the workload spec as
one JSON line on stdin, then ``cancel`` to cancel. The child answers with lines ``@acstudio {json}`` on stdout
(``progress``, then one of ``done``, ``cancelled``, ``error``); any other output (the user's model may print)
is ignored. No Qt in here.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

from acstudio.errors import ACStudioError, Cancelled
from acstudio.jobs import CancelToken, ProgressFn, report

MARK = "@acstudio "
CANCEL_GRACE_S = 2.0  # how long a cancelled child may take to stop (it checks every few nodes) before it is killed


class ChildError(Exception):
    """An unexpected error in the child; ``details`` is its traceback there."""

    def __init__(self, message: str, details: str) -> None:
        super().__init__(message)
        self.details = details


def cuda_devices() -> list[tuple[str, str]]:
    """(device string, label) for every visible CUDA device."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [(f"cuda:{i}", f"cuda:{i} – {torch.cuda.get_device_name(i)}") for i in range(torch.cuda.device_count())]


def _emit(message: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(message) + "\n")
    sys.stdout.flush()


def _watch_stdin(token: CancelToken) -> None:
    """Cancel when the parent says so, or when it goes away (stdin closed)."""
    for line in sys.stdin:
        if line.strip() == "cancel":
            break
    token.cancel()


def child_main(argv: list[str]) -> int:
    """``profile DEVICE OUT`` (spec on stdin), ``list`` or ``sweep PROFILE``."""
    command, args = argv[0], argv[1:]
    if command == "sweep":
        return _run(lambda: {"rows": _sweep_rows(args[0])})  # what sets the floor comes first, as its own line
    if command == "list":
        return _run(_environment)
    device, out = args
    from acstudio.profiler import profile_workload
    from acstudio.workload import WorkloadSpec

    token = CancelToken()
    spec = WorkloadSpec.from_dict(json.loads(sys.stdin.readline()))
    threading.Thread(target=_watch_stdin, args=(token,), daemon=True).start()
    try:
        profile = profile_workload(spec, device=device, cancel=token,
                                   progress=lambda d, t, m: _emit({"progress": [d, t, m]}),
                                   on_memory=lambda start, peaks, n: _emit({"memory": [start, peaks, n]}))
        profile.save(out)
    except Cancelled:
        _emit({"cancelled": True})
        return 3
    except ACStudioError as exc:
        _emit({"error": str(exc)})
        return 2
    except Exception as exc:  # reported to the window with its traceback, never a silent exit
        _emit({"error": f"{type(exc).__name__}: {exc}", "details": traceback.format_exc()})
        return 1
    _emit({"done": out})
    return 0


def _environment() -> dict[str, Any]:
    from acstudio.workload import list_models
    from acstudio.workload.spec import OPTIMIZERS, PRECISIONS

    return {"models": list_models(), "devices": cuda_devices(), "optimizers": list(OPTIMIZERS),
            "precisions": list(PRECISIONS)}


def _sweep_rows(profile_path: str) -> list[dict[str, Any]]:
    """Every solver but μ-TWO (whose curve the window already has), as JSON-ready rows. Emitted on their own
    before that: what sets the floor, in a sentence, then the curves and baselines (well under a second), so the
    chart does not wait for the exact programs' tens of seconds (solved at a few budgets, seconds each on a
    transformer)."""
    import math

    from acstudio.plan.peak import floor_sentence
    from acstudio.plan.schedule import PlanContext
    from acstudio.plan.solvers import SOLVERS, TRAJECTORY_SOLVER, sweep
    from acstudio.profile.model import Profile

    def rows(solvers: list[str]) -> list[dict[str, Any]]:
        df = sweep(profile, solvers, ctx=ctx)  # the context caches μ-TWO's trajectory for the second call
        return [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
                for row in df.to_dict(orient="records")]

    profile = Profile.load(profile_path)
    ctx = PlanContext(profile)
    _emit({"floor": floor_sentence(ctx)})
    curves = rows([s for s in SOLVERS if s != TRAJECTORY_SOLVER and not SOLVERS[s].exact])
    _emit({"rows": curves})
    return curves + rows([s for s in SOLVERS if SOLVERS[s].exact])


def _run(fn) -> int:
    """Emit ``{"done": fn()}`` or the error, for the commands without progress or cancel."""
    try:
        result = fn()
    except ACStudioError as exc:
        _emit({"error": str(exc)})
        return 2
    except Exception as exc:
        _emit({"error": f"{type(exc).__name__}: {exc}", "details": traceback.format_exc()})
        return 1
    _emit({"done": result})
    return 0


def _start(args: list[str]) -> tuple[subprocess.Popen, queue.Queue]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "acstudio.views.child", *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1)
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return proc, lines


def _messages(proc: subprocess.Popen, lines: queue.Queue, cancel: CancelToken | None, log: list[str]):
    """Yield the child's messages; on cancel, ask it to stop, then kill it if it does not."""
    asked = None
    while True:
        if cancel is not None and cancel.cancelled and asked is None:
            asked = time.monotonic()
            try:
                proc.stdin.write("cancel\n")
                proc.stdin.flush()
            except OSError:
                pass
        if asked is not None and time.monotonic() - asked > CANCEL_GRACE_S:
            proc.kill()
            proc.wait()
            raise Cancelled("cancelled by the user (the profiling process was stopped)")
        try:
            line = lines.get(timeout=0.1)
        except queue.Empty:
            continue
        if line is None:
            return
        if line.startswith(MARK):
            yield json.loads(line[len(MARK):])
        else:
            log.append(line)
            del log[:-200]


def _finish(proc: subprocess.Popen, messages: list[dict[str, Any]], log: list[str]) -> dict[str, Any]:
    code = proc.wait()
    last = messages[-1] if messages else {}
    if "cancelled" in last:
        raise Cancelled("cancelled by the user")
    if "error" in last:
        if last.get("details"):
            raise ChildError(last["error"], last["details"])
        raise ACStudioError(last["error"])
    if code != 0 or not last:
        tail = "".join(log[-20:]).strip()
        raise ACStudioError(f"the profiling process ended unexpectedly (exit code {code})"
                            + (f":\n{tail}" if tail else ""))
    return last


def profile_in_child(spec: dict[str, Any], device: str, out: str, progress: ProgressFn | None = None,
                     cancel: CancelToken | None = None, on_memory=None) -> None:
    """Profile the workload ``spec`` (``WorkloadSpec.to_dict()``) on ``device`` in a child process that saves
    the profile to ``out``; ``on_memory(start, peaks, n_nodes)`` receives the memory curve as it is measured."""
    proc, lines = _start(["profile", device, out])
    log: list[str] = []
    received: list[dict[str, Any]] = []
    try:
        proc.stdin.write(json.dumps(spec) + "\n")
        proc.stdin.flush()
        for message in _messages(proc, lines, cancel, log):
            if "progress" in message:
                report(progress, *message["progress"])
            elif "memory" in message:
                if on_memory is not None:
                    on_memory(*message["memory"])
            else:
                received.append(message)
        _finish(proc, received, log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _call(args: list[str], cancel: CancelToken | None, on_message=None) -> Any:
    """Run a child command that needs no input; return what it reported as done. ``on_message`` receives the
    messages before that (not progress, not the end)."""
    proc, lines = _start(args)
    log: list[str] = []
    received: list[dict[str, Any]] = []
    try:
        proc.stdin.close()
        for message in _messages(proc, lines, cancel, log):
            if on_message is not None and not {"done", "error", "cancelled"} & message.keys():
                on_message(message)
            else:
                received.append(message)
        return _finish(proc, received, log)["done"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def probe_environment(progress: ProgressFn | None = None, cancel: CancelToken | None = None) -> dict[str, Any]:
    """Model names, CUDA devices, optimizers and precisions, found in a child process so that the window never
    loads torch itself."""
    return _call(["list"], cancel)


def sweep_in_child(profile_path: str, progress: ProgressFn | None = None, cancel: CancelToken | None = None,
                   on_floor=None, on_rows=None) -> list[dict[str, Any]]:
    """The other solvers' operating points (rows of :func:`acstudio.plan.sweep`), computed in a child process;
    ``on_floor(sentence)`` receives what sets the AC floor (:func:`acstudio.plan.peak.floor_sentence`) as soon as
    the child has it, ``on_rows(rows)`` the rows of every solver but the programs before those are solved. All of
    it is pure Python, half a second to tens of seconds: in a thread it would stall the window."""
    def forward(message: dict[str, Any]) -> None:
        if "floor" in message and on_floor is not None:
            on_floor(message["floor"])
        if "rows" in message and on_rows is not None:
            on_rows(message["rows"])

    return _call(["sweep", str(profile_path)], cancel, forward)["rows"]


if __name__ == "__main__":
    raise SystemExit(child_main(sys.argv[1:]))

