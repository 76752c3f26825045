"""``run_bench``: every (batch size, configuration) in a fresh worker process, then max-batch searches.

A fresh process per measurement keeps the caching allocator, compiled kernels and process-wide settings of
one configuration from leaking into the next. Each worker's config file and log are kept
under ``OUT/workers/`` so a single measurement can be re-run by hand, and results are saved after every
measurement so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from acstudio import __version__
from acstudio.bench.configs import BenchConfig, expand_configs
from acstudio.bench.results import BenchResults, base_row, parse_size
from acstudio.child_process import ChildFailed, ChildTimedOut, run_child
from acstudio.errors import ACStudioError, DeviceError
from acstudio.fileio import write_text
from acstudio.jobs import CancelToken, ProgressFn, check, report
from acstudio.workload import WorkloadSpec

# The configurations whose largest batch within a memory budget is searched (when they are benchmarked).
FIT_KINDS = ("eager", "per-block", "rewritten")


def search_max_batch(fits: Callable[[int], bool], start: int, limit: int) -> int:
    """Largest batch size in [1, limit] for which ``fits`` holds, assuming that fitting is monotone.

    Doubles from ``start`` until a size does not fit (or ``limit`` is reached), then bisects between the last
    fitting and the first failing size; starts bisecting below ``start`` when that does not fit. 0 means that
    not even batch size 1 fits.
    """
    if limit < 1:
        raise ACStudioError("the batch-size search limit must be at least 1")
    lo, hi = 0, min(max(start, 1), limit)
    while lo < hi and fits(hi):
        lo, hi = hi, min(hi * 2, limit)
    if lo == hi:  # ``limit`` fits
        return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def bench_args(spec: WorkloadSpec, batch_sizes: list[int], configs: list[str], *, device: str, out_dir: str,
               warmup: int, iters: int, compile_backend: str, budgets: list[str] = (),
               fit_budget: str | None = None, max_batch: int | None = None, nproc: int = 1) -> str:
    """The ``acstudio bench`` command line that repeats a run (or, with one batch and config, one row)."""
    args = shlex.split(spec.cli_args())
    args[args.index("--batch-size") + 1] = ",".join(str(b) for b in batch_sizes)
    if spec.seed:
        args += ["--seed", str(spec.seed)]
    args += ["--configs", ",".join(configs)]
    if budgets:
        args += ["--budgets", ",".join(budgets)]
    args += ["--device", device, "--warmup", str(warmup), "--iters", str(iters), "--out", str(out_dir)]
    if compile_backend != "inductor":
        args += ["--compile-backend", compile_backend]
    if nproc != 1:
        args += ["--nproc", str(nproc)]
    if fit_budget:
        args += ["--fit-budget", fit_budget]
        if max_batch is not None:
            args += ["--max-batch", str(max_batch)]
    return "acstudio bench " + shlex.join(args)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "_", text).strip("_")


def run_worker(cfg: dict[str, Any], stem: Path, *, timeout_s: float, cancel: CancelToken | None = None
               ) -> dict[str, Any]:
    """Run one worker on ``cfg``, keeping ``STEM.json`` (its input) and ``STEM.log`` (its stderr).

    A worker that crashes, hangs past ``timeout_s`` or reports no result still yields an error row. The
    process is killed on cancellation (:class:`~acstudio.errors.Cancelled` raised) and on Ctrl-C.
    """
    stem.parent.mkdir(parents=True, exist_ok=True)
    cfg_path, log_path = stem.parent / f"{stem.name}.json", stem.parent / f"{stem.name}.log"
    write_text(cfg_path, json.dumps(cfg, indent=1))
    try:
        row = run_child(worker_command(cfg, cfg_path), cancel=cancel, timeout_s=timeout_s, log=log_path,
                        what="the worker")
    except ChildTimedOut:
        return base_row(cfg) | {"status": "error", "message": f"timed out after {timeout_s:g} s", "log": str(log_path)}
    except ChildFailed as exc:
        return base_row(cfg) | {"status": "error", "log": str(log_path),
                                "message": f"worker exited with status {exc.exit_code} and no result: {exc.log_tail}"}
    row["log"] = str(log_path)
    return row


def worker_command(cfg: dict[str, Any], cfg_path: Path) -> list[str]:
    """The worker's Python arguments: one process, or ``torchrun`` with ``nproc`` ranks on this host to measure
    an ``fsdp+``/``ddp+`` configuration."""
    worker = ["-m", "acstudio.bench.worker", str(cfg_path)]
    if BenchConfig.parse(cfg["config"]).parallel is None or cfg.get("task") == "plan":
        return worker
    return ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(cfg.get("nproc", 1)), *worker]


class _Bench:
    """State of one ``run_bench`` call: the measurements so far, keyed by (config name, batch size)."""

    def __init__(self, spec: WorkloadSpec, out: Path, device: str, warmup: int, iters: int, compile_backend: str,
                 timeout_s: float, results: BenchResults, progress: ProgressFn | None,
                 cancel: CancelToken | None, nproc: int = 1) -> None:
        self.nproc = nproc
        self.spec, self.out, self.device = spec, out, device
        self.warmup, self.iters, self.compile_backend, self.timeout_s = warmup, iters, compile_backend, timeout_s
        self.results, self.progress, self.cancel = results, progress, cancel
        self.measured: dict[tuple[str, int], dict[str, Any]] = {}
        self.done = 0

    def measure(self, config: BenchConfig, batch_size: int, phase: str, total: int) -> dict[str, Any]:
        key = (config.name, batch_size)
        if key in self.measured:
            return self.measured[key]
        check(self.cancel)
        spec = self.spec.with_batch_size(batch_size)
        report(self.progress, self.done, total, f"{config.name} at batch size {batch_size}")
        cfg = {
            "spec": spec.to_dict(), "config": config.name, "device": self.device, "warmup": self.warmup,
            "iters": self.iters, "compile_backend": self.compile_backend, "nproc": self.nproc,
            "profile_path": str(self.out / "profiles" / f"{profile_key(spec, self.device)}.json.gz"),
            "command": bench_args(spec, [batch_size], [config.name], device=self.device, out_dir=str(self.out),
                                  warmup=self.warmup, iters=self.iters, compile_backend=self.compile_backend,
                                  nproc=self.nproc if config.parallel else 1),
        }
        reference = config.budget_reference
        if reference is not None:
            ref_row = self.measure(reference.config, batch_size, phase, total)
            if ref_row["status"] != "ok" or not ref_row.get("peak_bytes"):
                row = base_row(cfg) | {"status": "skipped", "phase": phase,
                                       "message": f"no budget: {reference.config.name} has no measured peak at "
                                                  f"batch size {batch_size} ({ref_row['status']})"}
                return self._record(key, row)
            cfg["budget"] = f"{int(ref_row['peak_bytes'] * reference.factor)}B"
        if config.kind == "sac+compile":
            # the compiled prediction is calibrated on compile+per-block's and compile+per-op's measured peaks,
            # the compiled replay times on their step times against compile's, and an offloading plan's form on
            # compile+per-op+regions' against compile+per-op's (acstudio.plan.compiled); one rank under FSDP2/DDP
            # calibrates on compile+per-block only
            per_block = self.measure(BenchConfig("compile+per-block", None, config.parallel), batch_size, phase, total)
            plain = self.measure(BenchConfig("compile", None, config.parallel), batch_size, phase, total)
            per_op, regions = ((self.measure(BenchConfig("compile+per-op", None, None), batch_size, phase, total),
                                self.measure(BenchConfig("compile+per-op+regions", None, None), batch_size, phase,
                                             total))
                               if config.parallel is None else ({}, {}))
            if per_block["status"] == "ok" and per_block.get("peak_bytes"):
                cfg["compiled_per_block_peak"] = f"{int(per_block['peak_bytes'])}B"
                if per_op.get("status") == "ok" and per_op.get("peak_bytes", 0) > per_block["peak_bytes"]:
                    cfg["compiled_per_op_peak"] = f"{int(per_op['peak_bytes'])}B"
                if plain["status"] == "ok" and plain.get("time_ms_median"):
                    times = [plain["time_ms_median"], per_block["time_ms_median"]]
                    if plain.get("details", {}).get("host_issue_ms"):
                        cfg["compile_host_ms"] = plain["details"]["host_issue_ms"]
                    if per_op.get("status") == "ok" and per_op.get("time_ms_median"):
                        times.append(per_op["time_ms_median"])
                        if regions.get("status") == "ok" and regions.get("time_ms_median"):
                            times.append(regions["time_ms_median"])
                            cfg["regions_bias"] = bool(regions.get("details", {}).get("mask_bias"))
                    cfg["compiled_step_ms"] = ",".join(repr(t) for t in times)
        stem = self.out / "workers" / f"{len(self.results.rows):03d}_{_slug(config.name)}_bs{batch_size}"
        if config.spec.planner is not None:  # profile and plan in a process of their own (Kind.planner)
            planned = run_worker(cfg | {"task": "plan"}, stem.with_name(f"{stem.name}_plan"), timeout_s=self.timeout_s,
                                 cancel=self.cancel)
            if planned["status"] != "ok":
                return self._record(key, planned | {"phase": phase})
        row = run_worker(cfg, stem, timeout_s=self.timeout_s, cancel=self.cancel)
        row["phase"] = phase
        return self._record(key, row)

    def _record(self, key: tuple[str, int], row: dict[str, Any]) -> dict[str, Any]:
        self.measured[key] = row
        self.results.rows.append(row)
        self.results.save(self.out)
        self.done += 1
        return row


def profile_key(spec: WorkloadSpec, device: str) -> str:
    """File name of the cached profile of one workload: readable, and unique per spec and device type."""
    digest = hashlib.sha1(json.dumps([spec.to_dict(), torch.device(device).type], sort_keys=True).encode())
    return f"{_slug(spec.model)}_bs{spec.batch_size}_{digest.hexdigest()[:10]}"


def run_bench(spec_base: WorkloadSpec, batch_sizes: list[int], configs: list[str], budgets: list[str] = (),
              device: str = "cuda", out_dir: str | os.PathLike = "bench_results",
              progress: ProgressFn | None = None, cancel: CancelToken | None = None,
              fit_budget: str | None = None, *, warmup: int = 10, iters: int = 20, max_batch: int = 4096,
              timeout_s: float = 1800.0, compile_backend: str = "inductor", nproc: int = 1) -> BenchResults:
    """Measure every configuration at every batch size, each in its own process; save and return the results.

    ``configs``: names as in :mod:`acstudio.bench.configs`; a bare ``rewritten`` means one ``rewritten@B``
    per entry of ``budgets``. With ``fit_budget`` (an absolute size such as ``16GiB``), the largest batch
    size whose measured peak stays within it is then searched (doubling, then bisection, up to
    ``max_batch``) for those of eager, per-block and rewritten that are benchmarked; rewritten is planned
    for that same budget. ``fsdp+``/``ddp+`` configurations run under ``torchrun`` with ``nproc`` ranks, each
    training a batch of the given size (the global batch is ``nproc`` times that); the others in one process.
    Out-of-memory and failing configurations are recorded, never raised.
    """
    expanded = expand_configs(list(configs), list(budgets))
    if not batch_sizes or min(batch_sizes) < 1:
        raise ACStudioError("give at least one batch size, each at least 1")
    if iters < 3 or warmup < 1:
        raise ACStudioError("a benchmark needs at least 1 warm-up and 3 timed iterations (for median and IQR)")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError("acstudio bench measures GPU time and memory, but no CUDA GPU is available here; "
                          "pass --device cpu for a CPU dry run (host-clock times, estimated peaks)")
    if dev.type not in ("cuda", "cpu"):
        raise DeviceError(f"unsupported device {device!r}; use cuda or cpu")
    if nproc < 1:
        raise ACStudioError(f"--nproc must be at least 1, not {nproc}")
    if nproc > 1 and not any(c.parallel for c in expanded):
        raise ACStudioError("--nproc runs fsdp+/ddp+ configurations (e.g. fsdp,fsdp+per-block); none was given")
    if dev.type == "cuda" and nproc > torch.cuda.device_count():
        raise DeviceError(f"--nproc {nproc} needs {nproc} GPUs; this machine has {torch.cuda.device_count()}")
    fit_bytes = parse_size(fit_budget) if fit_budget else None
    out = Path(out_dir)
    names = [c.name for c in expanded]
    meta = {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "acstudio": __version__,
        "spec": spec_base.to_dict(), "batch_sizes": list(batch_sizes), "configs": names,
        "budgets": list(budgets), "device": device, "warmup": warmup, "iters": iters,
        "compile_backend": compile_backend, "fit_budget": fit_budget, "fit_budget_bytes": fit_bytes,
        "max_batch": max_batch, "nproc": nproc,
        "command": bench_args(spec_base, list(batch_sizes), [str(c) for c in configs], budgets=list(budgets),
                              device=device, out_dir=str(out), warmup=warmup, iters=iters,
                              compile_backend=compile_backend, fit_budget=fit_budget, max_batch=max_batch,
                              nproc=nproc),
    }
    results = BenchResults(meta=meta)
    bench = _Bench(spec_base, out, device, warmup, iters, compile_backend, timeout_s, results, progress, cancel,
                   nproc)
    total = len(batch_sizes) * len(expanded)
    for bs in batch_sizes:
        for config in expanded:
            bench.measure(config, bs, "sweep", total)
    if fit_bytes is not None:
        kinds = {c.kind for c in expanded}
        for kind in (k for k in FIT_KINDS if k in kinds):
            config = BenchConfig(kind, fit_budget if kind == "rewritten" else None)
            results.fits.append(search_fit(bench, config, fit_bytes, fit_budget, min(batch_sizes), max_batch))
            results.save(out)
    results.save(out)
    report(progress, bench.done, bench.done, "done")
    return results


def search_fit(bench: _Bench, config: BenchConfig, budget_bytes: int, budget: str, start: int, limit: int
               ) -> dict[str, Any]:
    """Largest batch of ``config`` that runs with a measured peak within ``budget_bytes``."""
    probes: list[dict[str, Any]] = []

    def fits(batch_size: int) -> bool:
        row = bench.measure(config, batch_size, "fit", bench.done + 1)
        ok = row["status"] == "ok" and row.get("peak_bytes") is not None and row["peak_bytes"] <= budget_bytes
        probes.append({"batch_size": batch_size, "fits": ok, "status": row["status"],
                       "peak_bytes": row.get("peak_bytes")})
        return ok

    best = search_max_batch(fits, start, limit)
    return {"config": config.name, "budget": budget, "budget_bytes": budget_bytes, "max_batch": best,
            "capped": best == limit, "limit": limit, "probes": probes}
