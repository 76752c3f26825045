"""Command line: ``acstudio`` (no arguments: the desktop app) and ``acstudio SUBCOMMAND`` for the engine.

Every subcommand is a thin wrapper over an engine function. It checks its output paths before any work, so a
long measurement is never thrown away for want of a writable folder. Every failure prints one line,
``acstudio: error: <what> — <what to do>``, and exits with status 2 (``--debug`` adds the traceback);
Ctrl-C cancels cleanly with status 130.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import math
import os
import shlex
import signal
import sys
import threading
import traceback
import warnings

from acstudio import __version__
from acstudio.errors import ACStudioError, Cancelled, describe_failure
from acstudio.fileio import (
    BENCH_FOLDER,
    PLAN_FILE,
    PLOT_FOLDER,
    PROFILE_FILE,
    PROFILE_TABLES,
    SCHEDULE_FOLDER,
    SWEEP_TABLE,
    VERIFY_RESULT,
    Outputs,
    check_output,
)
from acstudio.jobs import CancelToken, TerminalProgress


class OneLineParser(argparse.ArgumentParser):
    """argparse with the same one-line error as every other failure (usage stays in ``--help``)."""

    def error(self, message: str):
        self.exit(2, f"acstudio: error: {message} — see `{self.prog} --help`\n")


def _parse_config(items: list[str]) -> tuple[tuple[str, str], ...]:
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ACStudioError(f"--config expects key=value, got {item!r} — e.g. --config num_hidden_layers=2")
        out.append((key.strip(), value.strip()))
    return tuple(out)


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="zoo name (see `acstudio models`) or path/to/file.py:factory")
    p.add_argument("--batch-size", "-b", type=COUNT, required=True)
    p.add_argument("--optimizer", default="adam", choices=["sgd", "adam", "adamw"])
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--image-size", type=int, default=224, help="torchvision models (default 224)")
    p.add_argument("--seq-len", type=int, default=512, help="transformers models (default 512)")
    p.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                   help="override a model config field (repeatable), e.g. --config num_hidden_layers=2")
    _add_optimizer_args(p)


def _in_range(convert, low: float, high: float = math.inf, *, above_low: bool = False):
    """An argparse type: ``convert(text)`` within ``[low, high]`` (``(low, high]`` with ``above_low``); NaN,
    infinities and other absurd values are refused with the valid range."""
    what = "a whole number" if convert is int else "a number"
    bound = f"above {low:g}" if above_low else f"from {low:g}"
    valid = f"{what} {bound}" + (f" to {high:g}" if high != math.inf else " (finite)")

    def parse(text: str):
        try:
            value = convert(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"expected {valid}, got {text!r}") from None
        if not (math.isfinite(value) and (value > low if above_low else value >= low) and value <= high):
            raise argparse.ArgumentTypeError(f"expected {valid}, got {text!r}")
        return value

    parse.__name__ = convert.__name__
    return parse


COUNT = _in_range(int, 1, 2**31 - 1)
WORLD_SIZE = _in_range(int, 1, 65536)
RATE = _in_range(float, 0)


def _betas(text: str) -> tuple[float, float]:
    try:
        beta1, beta2 = (float(b) for b in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected two numbers such as 0.9,0.999, got {text!r}") from None
    if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
        raise argparse.ArgumentTypeError(f"each beta must be from 0 to below 1, got {text!r}")
    return beta1, beta2


def _add_optimizer_args(p: argparse.ArgumentParser) -> None:
    """Optimizer hyperparameters; unset ones keep the defaults the README states."""
    p.add_argument("--lr", type=RATE, help="learning rate (default: sgd 0.01, adam/adamw 0.001)")
    p.add_argument("--weight-decay", type=RATE, help="weight decay (default: adamw 0.01, sgd/adam 0)")
    p.add_argument("--momentum", type=RATE, help="sgd momentum (default 0.9)")
    p.add_argument("--betas", type=_betas, metavar="B1,B2", help="adam/adamw betas (default 0.9,0.999)")


def _spec(args):
    from acstudio.workload import WorkloadSpec

    return WorkloadSpec(args.model, args.batch_size, optimizer=args.optimizer, precision=args.precision,
                        image_size=args.image_size, seq_len=args.seq_len, config=_parse_config(args.config),
                        lr=args.lr, weight_decay=args.weight_decay, momentum=args.momentum, betas=args.betas)


def _model_file(model: str) -> str | None:
    """The Python file of a ``path/to/file.py:factory`` model (an input no output may replace)."""
    module_ref = model.rpartition(":")[0]
    return module_ref if module_ref.endswith(".py") or "/" in module_ref else None


def cmd_models(args) -> int:
    from acstudio.workload import list_models

    for family, names in list_models().items():
        print(f"{family} ({len(names)}):")
        print("  " + "\n  ".join(names))
    print("custom: path/to/file.py:factory or package.module:factory (see README)")
    return 0


def cmd_profile(args) -> int:
    from acstudio.profiler import profile_workload
    from acstudio.units import format_bytes

    spec = _spec(args)
    outputs = Outputs([_model_file(args.model)]).add(args.out, PROFILE_FILE).add(args.csv, PROFILE_TABLES)
    command = "acstudio " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["profile"] else None
    profile = profile_workload(spec, args.device, iterations=args.iterations, progress=TerminalProgress(),
                               cancel=args.cancel, command=command)
    with outputs.writing():
        profile.save(args.out)
        if args.csv:
            profile.export_csv(args.csv)
    node = profile.node_by_id[profile.peak_node]
    print(f"{profile.label}: {len(profile.nodes)} nodes, {len(profile.activations)} activations "
          f"({sum(a.recomputable for a in profile.activations)} recomputable)")
    print(f"measured peak {format_bytes(profile.peak_bytes)} at {node.id} ({node.target}, {node.region}); "
          f"iteration {profile.iteration_ms:.1f} ms")
    print("at the peak: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in profile.peak_breakdown.items() if v))
    print(f"saved {args.out}")
    return 0


def thin_curve(table, solver: str, points: int):
    """Keep ``points`` rows of ``solver``'s curve, evenly spaced in peak memory (for printing)."""
    import numpy as np

    rows = table[table["solver"] == solver]
    if len(rows) <= points:
        return table
    peaks = rows["peak_bytes"].to_numpy()
    targets = np.linspace(peaks.max(), peaks.min(), points)
    keep = sorted({int(np.argmax(peaks <= t)) for t in targets})
    return table.drop(rows.index.difference(rows.index[keep]))


def per_rank(profile, args):
    """The profile as one rank of ``--fsdp N`` or ``--ddp N`` sees it (unchanged without either)."""
    from acstudio.simulate.sharding import per_rank_profile

    fsdp, ddp = getattr(args, "fsdp", None), getattr(args, "ddp", None)  # `verify` takes neither
    if fsdp is not None and ddp is not None:
        raise ACStudioError("--fsdp and --ddp were both given — give one of them")
    kind = "fsdp" if fsdp is not None else "ddp" if ddp is not None else None
    if kind is None:
        return profile
    world = getattr(args, kind)
    print(f"predicting one of {world} ranks under {kind} (the profile is of one rank's batch)")
    return per_rank_profile(profile, world, kind)


def cmd_plan(args) -> int:
    import pandas as pd

    from acstudio.plan.peak import explain_peak, floor_sentence
    from acstudio.plan.schedule import PlanContext
    from acstudio.plan.solvers import TRAJECTORY_SOLVER, plan, sweep
    from acstudio.profile.model import Profile
    from acstudio.simulate.modes import get_mode
    from acstudio.simulate.simulator import Simulator
    from acstudio.units import format_bytes, parse_budget

    outputs = Outputs([args.profile]).add(args.out, SWEEP_TABLE if args.sweep else PLAN_FILE)
    outputs.add(args.schedule, SCHEDULE_FOLDER)
    profile = per_rank(Profile.load(args.profile), args)
    sim = Simulator(profile, keep_random=args.keep_random)
    host_memory = parse_budget(args.host_memory, profile.link.host_bytes) if args.host_memory else None
    ctx = PlanContext(profile, sim, offload=not args.no_offload, host_memory=host_memory)
    # Files are written before anything is printed, so a reader closing stdout early (`| head`) costs no file.
    header = (f"{profile.label}: baseline peak {format_bytes(sim.baseline_peak)} (measured "
              f"{format_bytes(profile.peak_bytes)}), AC floor {format_bytes(ctx.floor_bytes)}")
    if args.sweep:
        table = sweep(profile, progress=TerminalProgress(), cancel=args.cancel, ctx=ctx)
        if args.out:
            from acstudio.fileio import write_text

            with outputs.writing():
                write_text(args.out, table.to_csv(index=False))
        if not args.all_rows:
            table = thin_curve(table, TRAJECTORY_SOLVER, points=12)
        print(header)
        table = table.copy()
        for col in ("budget_bytes", "peak_bytes"):
            if col in table:
                table[col] = table[col].map(lambda v: "" if pd.isna(v) else format_bytes(int(v)))
        with pd.option_context("display.max_rows", None, "display.width", 160):
            print(table.to_string(index=False))
        if not args.all_rows:
            print("(μ-TWO curve thinned to 12 evenly spaced peaks; --all-rows prints every step"
                  + (f"; all rows in {args.out})" if args.out else ")"))
        return 0
    if not args.budget:
        raise ACStudioError("no budget to plan for — give --budget (e.g. 6GiB, 5000MiB or 60%) or --sweep")
    budget = parse_budget(args.budget, sim.baseline_peak)
    if args.compiled_per_block_peak:
        from acstudio.plan.compiled import COMPILED_MODE, CompiledTimes, plan_compiled

        if args.mode not in (None, COMPILED_MODE):
            raise ACStudioError(f"--compiled-per-block-peak plans for torch.compile, which runs the plan in the "
                                f"{COMPILED_MODE} mode — leave out --mode {args.mode}")
        measured = parse_budget(args.compiled_per_block_peak, sim.baseline_peak)
        if measured > sim.baseline_peak:
            raise ACStudioError(f"--compiled-per-block-peak {args.compiled_per_block_peak} is above this profile's "
                                f"peak without checkpointing ({format_bytes(sim.baseline_peak)}), which "
                                "checkpointing every block only lowers — give the peak that `acstudio bench "
                                "--configs compile+per-block` measured for this workload")
        times = CompiledTimes.parse(args.compiled_step_ms) if args.compiled_step_ms else None
        per_op = parse_budget(args.compiled_per_op_peak, sim.baseline_peak) if args.compiled_per_op_peak else None
        if per_op is not None and per_op < measured:
            raise ACStudioError(f"--compiled-per-op-peak {args.compiled_per_op_peak} is below "
                                f"--compiled-per-block-peak {args.compiled_per_block_peak}: torchtitan's policy saves "
                                "more than checkpointing every block — give the peaks `acstudio bench --configs "
                                "compile+per-block,compile+per-op` measured")
        result = plan_compiled(ctx, budget, measured, args.solver, cancel=args.cancel, times=times,
                               measured_per_op_peak=per_op, progress=TerminalProgress())
    elif args.compiled_step_ms or args.compiled_per_op_peak:
        flag = "--compiled-step-ms" if args.compiled_step_ms else "--compiled-per-op-peak"
        raise ACStudioError(f"{flag} calibrates a plan for torch.compile — give --compiled-per-block-peak too")
    else:
        result = plan(profile, budget, args.solver, cancel=args.cancel, ctx=ctx, mode=args.mode)
    written = []
    with outputs.writing():
        if args.out:
            result.save(args.out)
            written.append(f"saved {args.out}")
        if args.schedule:
            written += [f"wrote {path}" for path in result.export_schedule(args.schedule)]
    state = "fits" if result.feasible else "INFEASIBLE"
    print(header)
    print(f"{args.solver} at budget {format_bytes(budget)}: {state}; predicted peak "
          f"{format_bytes(result.run_peak_bytes)} at {result.predicted_peak_node}, "
          f"+{result.predicted_extra_ms:.2f} ms per iteration ({len(result.recomputed)} activations recomputed, "
          f"{get_mode(result.replay_mode).summary})")
    print(f"stopped: {result.stop_reason}")
    if result.offloaded:
        link = "measured" if profile.link.measured else "not measured: priced at the default link"
        print(f"offload: {len(result.offloaded)} activations, {format_bytes(result.offload_bytes)} each way over the "
              f"host link ({link}), {format_bytes(result.host_bytes)} pinned host memory; "
              + ("copies hidden behind compute" if result.copies_hidden
                 else f"copies stall {result.offload_stall_ms:.2f} ms"))
    if result.compiled_peak_bytes is not None:
        print(f"under torch.compile: the {result.replay_mode} mode's eager prediction "
              f"{format_bytes(result.predicted_peak_bytes)} less {format_bytes(result.compiled_offset_bytes)} "
              "(calibrated on compile+per-block)")
    if result.compiled_extra_ms is not None:
        print(f"under torch.compile: +{result.compiled_extra_ms:.2f} ms per iteration over plain compile")
    print(explain_peak(ctx, result).summary())
    if not result.feasible:
        print(floor_sentence(ctx))
    for line in written:
        print(line)
    return 0 if result.feasible else 1


def _load_profile_and_plan(args):
    from acstudio.plan.loading import load_plan
    from acstudio.profile.model import Profile

    profile = per_rank(Profile.load(args.profile), args)
    plan = load_plan(args.plan, profile=profile)
    if not plan.feasible:
        from acstudio.units import format_bytes

        print(f"acstudio: warning: {args.plan} is INFEASIBLE: predicted peak {format_bytes(plan.predicted_peak_bytes)} "
              f"exceeds its budget {format_bytes(plan.budget_bytes)} (AC floor {format_bytes(plan.floor_bytes)}); "
              "going on, but the step will not fit that budget", file=sys.stderr)
    return profile, plan


def cmd_verify(args) -> int:
    import json

    from acstudio.fileio import write_text
    from acstudio.rewrite.verify import verify

    outputs = Outputs([args.profile, args.plan]).add(args.json, VERIFY_RESULT)
    profile, plan = _load_profile_and_plan(args)
    result = verify(profile, plan, args.device, progress=TerminalProgress(), cancel=args.cancel)
    print(result.summary())
    if args.json:
        with outputs.writing():
            write_text(args.json, json.dumps(result.to_dict(), indent=1))
    return 0 if result.passed else 1


def cmd_export(args) -> int:
    from acstudio.export.exporter import EXPORT_FOLDER, FORMATS, export
    from acstudio.export.sac import offload_refusal, offloads_by_region

    formats = None if args.format is None else [f.strip() for f in args.format.split(",") if f.strip()]
    unknown = [f for f in formats or () if f not in FORMATS]
    if formats == [] or unknown:
        given = f"unknown format {unknown[0]!r}" if unknown else f"no format in {args.format!r}"
        raise ACStudioError(f"--format: {given} — choose from {', '.join(FORMATS)}, comma-separated")
    inputs = (args.profile, args.plan)
    check_output(args.out, EXPORT_FOLDER, inputs=inputs, force=args.force)
    profile, plan = _load_profile_and_plan(args)
    paths = export(profile, plan, args.out, formats=formats, progress=TerminalProgress(), force=args.force,
                   inputs=inputs)
    for path in paths:
        print(f"wrote {path}")
    names = {os.path.basename(p) for p in paths}
    if "step.py" in names:
        print(f"use it: step = acstudio.load_step({args.out!r}, model, optimizer); loss = step(batch)")
    if "sac_policy.json" in names and getattr(plan, "offloaded", None) and offloads_by_region(plan.replay_mode):
        print(f"use it: model = torch.compile(acstudio.apply_plan(model, {args.out!r}, compile_options={{}}))  "
              "# its first blocks compiled one by one (with compile_options), what they save offloaded")
    elif "sac_policy.json" in names:
        print(f"or: model = acstudio.apply_plan(model, {args.out!r})  # torch's selective checkpointing")
    elif formats is None and getattr(plan, "offloaded", None) and offload_refusal():
        print(f"no sac_policy.json: {offload_refusal()}")
    return 0


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ACStudioError(f"expected comma-separated whole numbers, got {text!r} — e.g. 32,64,128") from None
    if not values:
        raise ACStudioError("no batch size given — give at least one, e.g. -b 32")
    return values


def cmd_bench(args) -> int:
    from acstudio.bench import run_bench
    from acstudio.profiler import resolve_device
    from acstudio.workload.build import check_model_reference

    args.batch_size = 1
    spec = dataclasses.replace(_spec(args), seed=args.seed)
    resolve_device(args.device)  # here, not in every configuration's process
    check_model_reference(args.model)  # and the model: a misspelt name is not a folder of failed rows
    outputs = Outputs([_model_file(args.model)]).add(args.out, BENCH_FOLDER)
    stopped = None
    with outputs.writing():
        try:
            results = run_bench(spec, _int_list(args.batch_sizes), args.configs.split(","),
                                [b for b in args.budgets.split(",") if b], device=args.device, out_dir=args.out,
                                progress=TerminalProgress(), cancel=args.cancel, fit_budget=args.fit_budget,
                                warmup=args.warmup, iters=args.iters, max_batch=args.max_batch,
                                timeout_s=args.timeout, compile_backend=args.compile_backend, nproc=args.nproc)
        except (Cancelled, KeyboardInterrupt) as exc:
            # a long bench stopped by `timeout` or Ctrl-C keeps the rows it measured (saved after each one):
            # minutes of GPU time are not thrown away with the row that was running
            args.cancel.cancel()
            results = _measured_so_far(args.out)
            if results is None:
                raise
            stopped = exc
    print(results.summary())
    if stopped is not None:
        raise Cancelled(f"bench stopped; the {len(results.rows)} rows it measured are kept in {args.out}")
    print(f"results in {args.out} (bench.json, bench.csv, summary.md); plots: acstudio bench-plot {args.out}")
    return 0


def _measured_so_far(out: str):
    """The results a stopped bench saved in ``out``, or None where it measured nothing."""
    from acstudio.bench import BenchResults
    from acstudio.bench.results import JSON_NAME

    if not os.path.isfile(os.path.join(out, JSON_NAME)):
        return None
    results = BenchResults.load(out)
    return results if results.rows else None


def cmd_bench_plot(args) -> int:
    from acstudio.bench import plot_results

    outputs = Outputs([args.results]).add(args.out, PLOT_FOLDER)
    with outputs.writing():
        paths = plot_results(args.results, args.out)
    for path in paths:
        print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="acstudio",
        description="Measure a whole PyTorch training step, plan activation checkpointing (mu-TWO), rewrite it. "
                    "Without a subcommand: open the desktop app (optionally on FILE).")
    parser.add_argument("--version", action="version", version=f"acstudio {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of a failure (for bug reports)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # --debug is accepted after the subcommand too; SUPPRESS keeps a subcommand from resetting it to False.
    debug = OneLineParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    sub.add_parser = functools.partial(sub.add_parser, parents=[debug])

    p = sub.add_parser("models", help="list the models that can be loaded")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("profile", help="capture and profile one training iteration")
    _add_workload_args(p)
    p.add_argument("--device", default="cuda", help="cuda or cpu (default cuda)")
    p.add_argument("--iterations", type=_in_range(int, 1, 1_000_000), default=3,
                   help="measured iterations, median kept (default 3)")
    p.add_argument("--out", "-o", required=True, help="profile file (.json or .json.gz)")
    p.add_argument("--csv", metavar="DIR", help="also write nodes.csv and activations.csv into DIR")
    p.set_defaults(func=cmd_profile)

    from acstudio.plan.solvers import DEFAULT_SOLVER, SOLVERS
    from acstudio.simulate.modes import REPLAY_MODES

    p = sub.add_parser("plan", help="choose activations to recompute under a memory budget")
    p.add_argument("profile", help="profile file from `acstudio profile`")
    p.add_argument("--budget", help="bytes with a unit (6GiB, 5000MiB) or a percentage of the baseline peak (60%%)")
    p.add_argument("--solver", default=DEFAULT_SOLVER, choices=list(SOLVERS),
                   help=f"default {DEFAULT_SOLVER}: the fastest plan of every solver that fits")
    p.add_argument("--mode", choices=list(REPLAY_MODES), help="plan for this replay mode: its peak in it fits "
                   "(sac: how `export --format sac` runs); default: each solver's own modes")
    p.add_argument("--sweep", action="store_true", help="print the memory/time Pareto table of every solver")
    p.add_argument("--all-rows", action="store_true", help="with --sweep: print every row")
    p.add_argument("--out", "-o", help="plan file (.json/.json.gz); with --sweep: CSV of the table")
    p.add_argument("--schedule", metavar="DIR", help="also write schedule.json and schedule.csv into DIR")
    p.add_argument("--keep-random", action="store_true", help="never recompute random ops (dropout, attention "
                   "with dropout); by default they are replayed with the RNG state their forward used")
    p.add_argument("--fsdp", type=WORLD_SIZE, metavar="N", help="plan for one of N ranks under FSDP2 (fully_shard "
                   "per block)")
    p.add_argument("--ddp", type=WORLD_SIZE, metavar="N", help="plan for one of N ranks under DDP")
    p.add_argument("--no-offload", action="store_true", help="only keep or recompute: never offload activations to "
                   "host memory (by default a GPU profile's plan may, where that is cheaper than recomputing)")
    p.add_argument("--host-memory", metavar="SIZE", help="host memory a plan may offload into: bytes with a unit "
                   "(16GiB) or a percentage of the free host memory the profile recorded (default 50%%)")
    p.add_argument("--compiled-per-block-peak", metavar="PEAK",
                   help="plan for torch.compile (exported with --format sac): the measured peak of the compiled model "
                        "with every block checkpointed (`acstudio bench ... --configs compile+per-block`), which "
                        "calibrates the compiled prediction; --budget is then the compiled step's")
    p.add_argument("--compiled-step-ms", metavar="COMPILE,PER_BLOCK[,PER_OP[,REGIONS]]",
                   help="with --compiled-per-block-peak: the measured median step times (ms) of compile and "
                        "compile+per-block (and compile+per-op, which prices the fused ops a replay reruns, and "
                        "compile+per-op+regions, which prices the form an offloading plan runs in), which "
                        "calibrate the compiled times the planner prices plans at")
    p.add_argument("--compiled-per-op-peak", metavar="PEAK",
                   help="with --compiled-per-block-peak: the measured peak of compile+per-op (torchtitan's policy), "
                        "a second calibration point for the compiled prediction, which is then exact at both")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("verify", help="check that the rewritten step computes what the captured step does")
    p.add_argument("profile")
    p.add_argument("--plan", required=True)
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu); on cuda also measures peaks")
    p.add_argument("--json", metavar="FILE", help="also write the full result as JSON")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("export", help="write the plan as a drop-in step, a schedule and a SAC policy")
    p.add_argument("profile")
    p.add_argument("--plan", required=True)
    p.add_argument("--out", "-o", required=True,
                   help="output folder, replaced as a whole: a new folder or an earlier export")
    p.add_argument("--force", action="store_true", help="replace an earlier export at --out even if files were added "
                   "to it (never a folder AC Studio did not write, nor one holding the inputs)")
    p.add_argument("--format", metavar="step,schedule,sac",
                   help="formats to write, comma-separated (default: every one that applies)")
    p.add_argument("--fsdp", type=WORLD_SIZE, metavar="N", help="the plan is for one of N ranks under FSDP2 "
                   "(`acstudio plan --fsdp N`): SAC also wraps the modules around the blocks, which each rank runs "
                   "eager")
    p.add_argument("--ddp", type=WORLD_SIZE, metavar="N", help="the plan is for one of N ranks under DDP (as --fsdp)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("bench", help="benchmark eager, per-block checkpointing, compile and the rewritten step")
    p.add_argument("model", help="zoo name or path/to/file.py:factory")
    p.add_argument("--batch-size", "-b", dest="batch_sizes", required=True, help="comma-separated, e.g. 32,64,128")
    p.add_argument("--optimizer", default="adam", choices=["sgd", "adam", "adamw"])
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--config", action="append", default=[], metavar="KEY=VALUE")
    _add_optimizer_args(p)
    p.add_argument("--configs", default="eager,per-block,captured,rewritten",
                   help="comma-separated: eager, captured, per-block, per-op, compile, compile@R, compile+per-block, "
                        "compile+per-op, compile+per-op+regions, rewritten, rewritten@B, sac@B, sac+compile@B, "
                        "per-block+offload, offload, and fsdp+/ddp+ before any "
                        "of eager, per-block, per-op, sac@B (with --nproc) (B: a budget such as 6GiB or 60%%, or "
                        "another configuration, e.g. rewritten@per-block plans for per-block's measured peak at "
                        "the same batch size; per-block*1.15 for 1.15 times it)")
    p.add_argument("--budgets", default="60%", help="budgets for a bare `rewritten` (comma-separated)")
    p.add_argument("--fit-budget", help="also search the largest batch whose peak fits this size (e.g. 6GiB)")
    p.add_argument("--max-batch", type=COUNT, default=4096)
    p.add_argument("--device", default="cuda")
    p.add_argument("--warmup", type=_in_range(int, 1, 1_000_000), default=10)
    p.add_argument("--iters", type=_in_range(int, 3, 1_000_000), default=20)
    p.add_argument("--timeout", type=_in_range(float, 0, 7 * 24 * 3600, above_low=True), default=1800.0,
                   help="seconds per configuration process")
    p.add_argument("--seed", type=_in_range(int, 0, 2**63 - 1), default=0)
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--nproc", type=_in_range(int, 1, 1024), default=1,
                   help="ranks (GPUs) for fsdp+/ddp+ configurations, run under torchrun; -b is per rank")
    p.add_argument("--out", "-o", default="bench_results")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("bench-plot", help="plot bench results (peak/time vs batch, memory vs overhead)")
    p.add_argument("results", help="bench.json or the folder holding it")
    p.add_argument("--out", "-o", required=True)
    p.set_defaults(func=cmd_bench_plot)
    return parser


GUI_FLAGS = ("--screenshot",)


def show_warning(python_way, message, category, filename, lineno, file=None, line=None) -> None:
    """AC Studio's own warnings as one line, like its errors (Python's format adds the file and the source line
    that warned); other warnings as Python shows them."""
    if category.__module__.split(".")[0] == "acstudio":
        print(f"acstudio: warning: {message}", file=sys.stderr if file is None else file)
    else:
        python_way(message, category, filename, lineno, file, line)


def interrupt_on_sigterm(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    commands = set(parser._subparsers._group_actions[0].choices)
    if not argv or (argv[0] not in commands and argv[0] not in ("-h", "--help", "--version", "--debug")):
        if argv and argv[0].startswith("-") and argv[0] not in GUI_FLAGS:
            parser.error(f"unknown option {argv[0]}")
        from acstudio.gui.app import main as gui_main

        return gui_main(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.error("--debug needs a command, e.g. acstudio --debug profile ...")
    args.cancel = CancelToken()
    if threading.current_thread() is threading.main_thread():
        # `timeout` and job schedulers stop a command with SIGTERM: end as on Ctrl-C, so that the cleanup that
        # kills workers and removes partial outputs runs (Python's default would exit without it).
        signal.signal(signal.SIGTERM, interrupt_on_sigterm)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = functools.partial(show_warning, warnings.showwarning)
            return args.func(args)
    except KeyboardInterrupt:
        args.cancel.cancel()
        print("\ncancelled", file=sys.stderr)
        gc.freeze()  # exit at once: the interpreter's last collection would walk every object a large plan made
        return 130
    except Cancelled as exc:
        print(f"acstudio: {exc}", file=sys.stderr)
        return 130
    except SystemExit as exc:  # raised by the user's model code; argparse's own exits happen before
        if args.debug:
            traceback.print_exc()
        model = getattr(args, "model", None) or "the model"
        print(f"\nacstudio: error: {model}: the model's code called sys.exit({exc.code!r}) — a model file must "
              "not exit; put its script part under `if __name__ == '__main__':`", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader (`acstudio plan ... | head`) has what it wanted; files were written before printing.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit flush cannot fail again
        return 0
    except Exception as exc:
        if args.debug:
            traceback.print_exc()
        print(f"\nacstudio: error: {describe_failure(exc)}", file=sys.stderr)
        return 2


