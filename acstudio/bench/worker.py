"""Measure ONE benchmark configuration in this process and print one JSON result line.

Usage: ``python -m acstudio.bench.worker [CONFIG.json | '{...}']`` (or the JSON on stdin); it reports the row
as the ``done`` message of :mod:`acstudio.child_process`. The config holds
``spec`` (a WorkloadSpec dict), ``config`` (e.g. ``"per-block"``), ``device``, ``warmup``, ``iters`` and
optionally ``profile_path``, ``compile_backend``, ``budget`` (a planned step's resolved budget),
``compiled_per_block_peak`` and ``compiled_per_op_peak`` (compile+per-block's and compile+per-op's measured
peaks, which calibrate a compiled plan),
``compiled_step_ms`` (compile's, compile+per-block's, compile+per-op's and compile+per-op+regions' step times,
which calibrate its replay times and the form an offloading plan runs in), ``regions_bias`` (whether that form ran
with the blocks handed the mask's bias) and ``command`` (the ``acstudio bench`` line that reproduces it). A fresh
process per configuration means no allocator cache, compile cache, functorch setting or fragmentation carries over
from another configuration.
With ``"task": "plan"`` it runs a planned configuration's profiling and planning instead
(:func:`acstudio.bench.steps.plan_ahead`), in a process before the measuring one.

Running out of memory is a result (``"status": "oom"``), any other failure is ``"status": "error"`` with
the message; either way the row is reported and the exit status is 0. Everything else the libraries print
goes to stderr, so stdout carries exactly the one message.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
import traceback
from typing import Any

import torch

from acstudio.bench.configs import BenchConfig
from acstudio.bench.distributed import Ranks, local_state_bytes
from acstudio.bench.measure import (
    allocator_counters,
    environment,
    is_out_of_memory,
    resident_tensors,
    step_peak_bytes,
    summarize_ms,
    time_steps,
)
from acstudio.bench.results import base_row
from acstudio.bench.steps import Request, plan_ahead, prepare
from acstudio.child_process import emit, stdout_for_messages
from acstudio.errors import DeviceError
from acstudio.export.apply import offload_of
from acstudio.workload import WorkloadSpec

# torch.compile compiles forward and backward on the first calls and may recompile once more after that.
COMPILE_EXTRA_WARMUP = 5


def worker_device(cfg: dict[str, Any]) -> torch.device:
    dev = torch.device(cfg["device"])
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError("this worker was asked for CUDA but no CUDA GPU is available")
    return dev


def measure(cfg: dict[str, Any]) -> dict[str, Any]:
    """Build the configuration, warm it up, take the peak of one full step, then time ``iters`` steps.

    Under torchrun (an ``fsdp+``/``ddp+`` configuration) every rank measures itself and the row holds every
    rank's peak (``rank_peak_bytes``; ``peak_bytes`` is the largest), rank 0's step times, and the losses
    averaged over the ranks.
    """
    dev = worker_device(cfg)
    torch.backends.cudnn.benchmark = False
    spec = WorkloadSpec.from_dict(cfg["spec"])
    config = BenchConfig.parse(cfg["config"])
    ranks = Ranks.start(config.parallel, dev.type) if config.parallel else None
    if ranks is not None:
        dev, spec = ranks.device, ranks.global_spec(spec)
    t0 = time.perf_counter()
    prepared = prepare(request(cfg, spec, dev, ranks))
    setup_s = time.perf_counter() - t0
    losses: list[torch.Tensor] = []

    def step() -> torch.Tensor:
        loss = prepared.step()
        losses.append(loss)
        return loss

    # The same random stream for every configuration, so dropout masks (and so losses) agree step by step.
    torch.manual_seed(spec.seed + 1)
    warmup = int(cfg["warmup"]) + (COMPILE_EXTRA_WARMUP if config.spec.compiled else 0)
    for _ in range(warmup):
        step()
    out: dict[str, Any] = {"setup_s": round(setup_s, 3), "warmup": warmup, "details": prepared.info}
    if dev.type == "cpu" and (config.spec.compiled or ranks is not None):
        # Compiled kernels allocate outside the dispatcher, and sharded tensors hide their storage from it:
        # storage accounting cannot see either.
        peak = resident = None
        loss = step()
    else:
        peak, resident, loss = step_peak_bytes(
            step, dev, lambda: resident_tensors(prepared.model, prepared.optimizer, prepared.batch))
    before = allocator_counters(dev)
    offload = offload_of(prepared.model)  # a SAC plan that offloads: what its copies moved, against the plan's
    moved = offload.moved_bytes if offload is not None else 0
    issued: list[float] = []
    times = time_steps(step, int(cfg["iters"]), dev, issued)
    if issued:  # the host's time to issue a step (CUDA only): what host calls cost compiled (CompiledTimes)
        out["details"]["host_issue_ms"] = statistics.median(issued)
    if before:
        out["details"]["allocator_during_timing"] = {k: v - before[k] for k, v in allocator_counters(dev).items()}
    if offload is not None:
        out["details"]["offload_bytes_measured"] = (offload.moved_bytes - moved) // int(cfg["iters"])
    out.update(peak_bytes=peak, resident_bytes=resident, loss=float(loss), times_ms=times, **summarize_ms(times),
               losses=[float(v) for v in losses])
    if ranks is not None:
        out.update(across_ranks(ranks, out, local_state_bytes(prepared.model, prepared.optimizer)))
    return out


def request(cfg: dict[str, Any], spec: WorkloadSpec, dev: torch.device, ranks: Ranks | None = None) -> Request:
    return Request(BenchConfig.parse(cfg["config"]), spec, dev, profile_path=cfg.get("profile_path"),
                   compile_backend=cfg.get("compile_backend", "inductor"), budget=cfg.get("budget"),
                   compiled_per_block_peak=cfg.get("compiled_per_block_peak"),
                   compiled_per_op_peak=cfg.get("compiled_per_op_peak"),
                   compiled_step_ms=cfg.get("compiled_step_ms"), regions_bias=bool(cfg.get("regions_bias")),
                   compile_host_ms=cfg.get("compile_host_ms"),
                   dist=ranks, nproc=int(cfg.get("nproc", 1)))


def plan_ahead_of(cfg: dict[str, Any]) -> dict[str, Any]:
    """Task ``"plan"``: a planned configuration's profiling and planning, alone in this process (one device,
    also for an ``fsdp+``/``ddp+`` configuration, whose ``spec`` is then one rank's batch)."""
    dev = worker_device(cfg)
    t0 = time.perf_counter()
    info = plan_ahead(request(cfg, WorkloadSpec.from_dict(cfg["spec"]), dev))
    return {"setup_s": round(time.perf_counter() - t0, 3), "details": info}


def across_ranks(ranks: Ranks, mine: dict[str, Any], state_bytes: dict[str, int]) -> dict[str, Any]:
    """Every rank's peak and state bytes; the losses (and the loss) averaged over ranks, which is the loss of
    the global batch when every rank's slice counts as many targets."""
    gathered = ranks.gather({"peak_bytes": mine["peak_bytes"], "resident_bytes": mine["resident_bytes"],
                             "losses": mine["losses"], "state_bytes": state_bytes})
    peaks = [g["peak_bytes"] for g in gathered]
    losses = [sum(step) / ranks.world for step in zip(*(g["losses"] for g in gathered))]
    return {"nproc": ranks.world, "rank_peak_bytes": peaks, "peak_bytes": None if None in peaks else max(peaks),
            "rank_resident_bytes": [g["resident_bytes"] for g in gathered], "losses": losses,
            "loss": losses[-1], "rank_state_bytes": [g["state_bytes"] for g in gathered]}


def run_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """One result row; never raises for an out-of-memory or a failing configuration."""
    row = base_row(cfg)
    t0 = time.perf_counter()
    try:
        if cfg.get("task") == "plan":
            row.update(plan_ahead_of(cfg))
        else:
            row.update(measure(cfg))
        if "loss" in row and not math.isfinite(row["loss"]):
            row.update(status="error", message=f"the loss is {row['loss']}")
    except Exception as exc:
        if is_out_of_memory(exc):
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            row.update(status="oom", message=f"does not fit: {first}")
        else:
            row.update(status="error", message=f"{type(exc).__name__}: {exc}".strip(),
                       traceback=traceback.format_exc(limit=8))
    row["wall_s"] = round(time.perf_counter() - t0, 3)
    row["environment"] = environment(torch.device(cfg["device"]))
    return row


def read_config(argv: list[str]) -> dict[str, Any]:
    if not argv:
        return json.loads(sys.stdin.read())
    text = argv[0]
    if not text.lstrip().startswith("{"):
        with open(text, encoding="utf-8") as f:
            text = f.read()
    return json.loads(text)


def main(argv: list[str] | None = None) -> int:
    """Report the row (under torchrun: rank 0 reports it; a failing rank exits 1 so torchrun stops the job)."""
    cfg = read_config(list(sys.argv[1:] if argv is None else argv))
    rank = int(os.environ.get("RANK", "0"))
    with stdout_for_messages():  # what the libraries print while measuring (also from C++) goes to stderr
        row = run_config(cfg)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        if rank == 0:
            emit({"done": row})
    return 0 if row["status"] == "ok" or "RANK" not in os.environ else 1


if __name__ == "__main__":
    raise SystemExit(main())
