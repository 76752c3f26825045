"""Long engine calls in child processes, driven from GUI worker threads: profiling, the environment probe, and
the other solvers' sweep.

Building, tracing and measuring a model holds the GIL for long stretches (loading torch's libraries,
``make_fx`` tracing: ~0.2 s at a time), and so does a pure-Python planner; in a thread of the GUI process
either would stall the window. A child process runs on another core, frees every byte of GPU memory when it
ends, can be killed if it stops answering a cancel, and cannot take the window down if the model crashes.

Each runs as ``python -m acstudio.views.child COMMAND ARGS`` and talks to the window's worker thread through
:mod:`acstudio.child_process`; for ``profile`` the workload spec is the task on stdin. No Qt in here.
"""

from __future__ import annotations

import sys
from typing import Any

from acstudio.child_process import cancel_on_request, emit, read_task, run_child, send_progress, serve
from acstudio.jobs import CancelToken, ProgressFn

CANCEL_GRACE_S = 2.0  # how long a cancelled child may take to stop (it checks every few nodes) before it is killed


def cuda_devices() -> list[tuple[str, str]]:
    """(device string, label) for every visible CUDA device."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [(f"cuda:{i}", f"cuda:{i} – {torch.cuda.get_device_name(i)}") for i in range(torch.cuda.device_count())]


def child_main(argv: list[str]) -> int:
    """``profile DEVICE OUT`` (spec on stdin), ``list`` or ``sweep PROFILE``."""
    command, args = argv[0], argv[1:]
    if command == "sweep":
        return serve(lambda: {"rows": _sweep_rows(args[0])})  # what sets the floor comes first, as its own line
    if command == "list":
        return serve(_environment)
    device, out = args
    return serve(lambda: _profile(read_task(), device, out))


def _profile(spec: dict[str, Any], device: str, out: str) -> str:
    from acstudio.profiler import profile_workload
    from acstudio.workload import WorkloadSpec

    token = CancelToken()
    cancel_on_request(token)
    profile = profile_workload(WorkloadSpec.from_dict(spec), device=device, cancel=token, progress=send_progress,
                               on_memory=lambda start, peaks, n: emit({"memory": [start, peaks, n]}))
    profile.save(out)
    return out


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
    emit({"floor": floor_sentence(ctx)})
    curves = rows([s for s in SOLVERS if s != TRAJECTORY_SOLVER and not SOLVERS[s].exact])
    emit({"rows": curves})
    return curves + rows([s for s in SOLVERS if SOLVERS[s].exact])


def profile_in_child(spec: dict[str, Any], device: str, out: str, progress: ProgressFn | None = None,
                     cancel: CancelToken | None = None, on_memory=None) -> None:
    """Profile the workload ``spec`` (``WorkloadSpec.to_dict()``) on ``device`` in a child process that saves
    the profile to ``out``; ``on_memory(start, peaks, n_nodes)`` receives the memory curve as it is measured."""
    def forward(message: dict[str, Any]) -> None:
        if "memory" in message and on_memory is not None:
            on_memory(*message["memory"])

    run_child(["-m", "acstudio.views.child", "profile", device, out], task=spec, progress=progress,
              on_message=forward, cancel=cancel, cancel_grace_s=CANCEL_GRACE_S, what="the profiling process")


def probe_environment(progress: ProgressFn | None = None, cancel: CancelToken | None = None) -> dict[str, Any]:
    """Model names, CUDA devices, optimizers and precisions, found in a child process so that the window never
    loads torch itself."""
    return run_child(["-m", "acstudio.views.child", "list"], cancel=cancel, what="the environment probe")


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

    return run_child(["-m", "acstudio.views.child", "sweep", str(profile_path)], on_message=forward, cancel=cancel,
                     what="the sweep process")["rows"]


if __name__ == "__main__":
    raise SystemExit(child_main(sys.argv[1:]))

