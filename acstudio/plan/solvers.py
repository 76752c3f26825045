"""Every planner in one registry, and the one entry point that the CLI, the GUI and bench call.

A solver is ``solve_<name>(ctx, budget, *, cancel) -> Plan`` (Checkmate's style), registered with
:func:`solver`; :func:`plan` looks it up. ``ctx`` (:class:`~acstudio.plan.schedule.PlanContext`) holds the
profile's simulator and caches what several solvers share (μ-TWO's trajectory).

``auto``, the default, asks every solver it knows for its plan at the budget and returns the predicted-fastest
one that fits (or, if none fits, the lowest peak): by construction no plan it knows beats it. Each fixed
baseline is priced in the replay mode its real counterpart runs in (per-module and √n as ``torch.utils.checkpoint``
on segments: shared chains; recompute-all in whichever mode is faster).

``plan(..., mode=M)`` plans *for* replay mode ``M`` instead (:func:`plan_for_mode`): the solvers still choose in
their own modes, so their sets are searched over lower target budgets and each is priced in ``M``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Collection
from dataclasses import dataclass

import numpy as np
import pandas as pd

from acstudio.errors import ACStudioError
from acstudio.jobs import CancelToken, ProgressFn, check
from acstudio.plan import baselines
from acstudio.plan.model import Plan
from acstudio.plan.mutwo import BASELINE_FITS, BUDGET_MET, EXHAUSTED, Trajectory, offload_plan, run_trajectory
from acstudio.plan.schedule import PlanContext
from acstudio.profile.model import Profile
from acstudio.simulate.modes import get_mode
from acstudio.simulate.simulator import Simulator
from acstudio.units import format_bytes


@dataclass(frozen=True)
class Solver:
    name: str
    summary: str
    solve: Callable[..., Plan]


SOLVERS: dict[str, Solver] = {}


def solver(name: str, summary: str) -> Callable[[Callable[..., Plan]], Callable[..., Plan]]:
    """Register ``solve(ctx, budget, *, cancel=None) -> Plan`` under ``name``."""
    def register(solve: Callable[..., Plan]) -> Callable[..., Plan]:
        SOLVERS[name] = Solver(name, summary, solve)
        return solve
    return register


def trajectory(ctx: PlanContext, progress: ProgressFn | None = None, cancel: CancelToken | None = None
               ) -> Trajectory:
    """μ-TWO's whole greedy run for ``ctx``, computed once and cached on it."""
    if "mutwo" not in ctx.cache:
        ctx.cache["mutwo"] = run_trajectory(ctx, progress=progress, cancel=cancel)
    return ctx.cache["mutwo"]


def best_of(plans: Collection[Plan]) -> Plan:
    """The predicted-fastest plan that fits its budget (of equally fast ones, to a nanosecond, the lowest peak: sums
    of the same replays in another order differ in the last bits), or, if none fits, the one with the lowest peak."""
    fitting = [p for p in plans if p.feasible]
    if fitting:
        return min(fitting, key=lambda p: (round(p.predicted_extra_ms, 6), p.predicted_peak_bytes))
    return min(plans, key=lambda p: (p.predicted_peak_bytes, p.predicted_extra_ms))


# -- μ-TWO and the exact program -----------------------------------------------------------------------------

@solver("mutwo", "μ-TWO's greedy, replaying chains again or as shared chains, whichever is faster, and offloading "
                 "to host memory where that is cheaper")
def solve_mutwo(ctx: PlanContext, budget: int, *, cancel: CancelToken | None = None) -> Plan:
    if ctx.sim.baseline_peak <= budget:
        return ctx.plan_for_set("mutwo", budget, [], BASELINE_FITS)
    recompute_only = trajectory(ctx, cancel=cancel).best_plan_for_budget(budget)
    with_offload = offload_plan(ctx, budget, cancel)
    return recompute_only if with_offload is None else best_of([recompute_only, with_offload])


# Time limits of the programs: a plan asked for on its own, and each point of a sweep. Sweeps (the GUI's Pareto
# chart runs one in the background) and auto leave the programs out past BERT-size graphs: ResNet-152 takes
# minutes.
MILP_TIME_LIMIT_S = 60.0
SWEEP_MILP_TIME_LIMIT_S = 20.0
PROGRAM_MAX_CANDIDATES = 400


def exact_milp(ctx: PlanContext, budget: int, time_limit_s: float = MILP_TIME_LIMIT_S,
               cancel: CancelToken | None = None):
    """:func:`~acstudio.plan.milp.exact_recompute_set` with μ-TWO's plan as the incumbent (what it answers
    with, and a bound on, if the time limit stops it first)."""
    from acstudio.plan.milp import exact_recompute_set  # scipy.optimize: imported only when used

    mu = trajectory(ctx, cancel=cancel).plan_for_budget(budget)
    incumbent = [ctx.rg.act_index[a] for a in mu.recomputed] if mu.feasible else None
    return exact_recompute_set(ctx, budget, time_limit_s=time_limit_s, incumbent=incumbent, cancel=cancel)


@solver("milp", "exact optimum under μ-TWO's replay model; past its time limit μ-TWO's plan with a proven bound")
def solve_milp(ctx: PlanContext, budget: int, *, cancel: CancelToken | None = None) -> Plan:
    return milp_plan(ctx, budget, exact_milp(ctx, budget, cancel=cancel))


def milp_plan(ctx: PlanContext, budget: int, result) -> Plan:
    """The plan of an :class:`~acstudio.plan.milp.MilpResult`; its reason says how it stopped and the bound."""
    if result.chosen is None:
        return ctx.plan_for_set("milp", budget, [], f"no recompute set fits: {result.status}")
    if not result.chosen:
        return ctx.plan_for_set("milp", budget, [], BASELINE_FITS)
    return ctx.plan_for_set("milp", budget, result.chosen,
                            f"{BUDGET_MET} ({result.status}; lower bound {result.lower_bound_ms:.3f} ms)")


@solver("milp-bound", "the fastest plan known (auto's, milp's, the shared-mode bound's own) and a lower bound on "
                      "every plan's time in both replay modes auto plans in")
def solve_milp_bound(ctx: PlanContext, budget: int, *, cancel: CancelToken | None = None) -> Plan:
    return bounded_plan(ctx, budget, cancel)[0]


def bounded_plan(ctx: PlanContext, budget: int, cancel: CancelToken | None = None,
                 time_limit_s: float = MILP_TIME_LIMIT_S, auto: Plan | None = None, exact=None, shared=None
                 ) -> tuple[Plan, float]:
    """``milp-bound``'s plan and the lower bound (ms) on the extra time of every plan that fits ``budget`` in
    replay mode "again" or "shared": the smaller of the two programs' bounds (``auto``: auto's plan, ``exact``:
    :func:`exact_milp`'s and ``shared``: :func:`~acstudio.plan.milp.shared_bound`'s result at ``budget``, if
    the caller has them)."""
    from acstudio.plan.milp import shared_bound

    exact = exact or exact_milp(ctx, budget, time_limit_s, cancel)
    shared = shared or shared_bound(ctx, budget, time_limit_s=time_limit_s, cancel=cancel)
    plans = [auto or auto_plan(ctx, budget, cancel, program=shared)]  # auto's candidates include shared's set
    if exact.chosen:
        plans.append(ctx.plan_for_set("milp-bound", budget, exact.chosen))
    best = best_of(plans)
    lower = min(exact.lower_bound_ms, shared.lower_bound_ms)
    if not best.feasible:
        why = best.stop_reason
    elif lower > 1e-12:
        why = (f"{best.stop_reason}; every plan that fits needs at least {lower:.3f} ms, this one is within "
               f"{best.predicted_extra_ms / lower - 1:.1%} of that")
    else:
        why = best.stop_reason
    return dataclasses.replace(best, solver="milp-bound", stop_reason=why), lower


@solver("blocks", "shared-chain search over the repeated blocks: per-block checkpointing, then keep back what "
                  "saves the most time per byte")
def solve_blocks(ctx: PlanContext, budget: int, *, cancel: CancelToken | None = None) -> Plan:
    from acstudio.plan.blocks import block_search

    if ctx.sim.baseline_peak <= budget:
        return ctx.plan_for_set("blocks", budget, [], BASELINE_FITS)
    return block_search(ctx, cancel).plan_for_budget(budget, cancel)


# -- fixed baselines -------------------------------------------------------------------------------------------

def fixed_plans(ctx: PlanContext, name: str, budget: int) -> list[Plan]:
    """Baseline ``name``'s recompute set priced in each mode its real counterpart may run in."""
    chosen = baselines.FIXED[name](ctx)
    plans = [ctx.plan_for_set(name, budget, chosen, mode=mode) for mode in baselines.REAL_MODES[name]]
    for p in plans:
        if not p.feasible:
            p.stop_reason = (EXHAUSTED if name == "recompute-all" else
                             f"budget not met: {name} reaches {format_bytes(p.predicted_peak_bytes)}")
    return plans


def _register_fixed(name: str, summary: str) -> None:
    def solve(ctx: PlanContext, budget: int, *, cancel: CancelToken | None = None) -> Plan:
        return best_of(fixed_plans(ctx, name, budget))
    solve.__name__ = "solve_" + name.replace("-", "_")
    solver(name, summary)(solve)


for _name, _summary in baselines.SUMMARIES.items():
    _register_fixed(_name, _summary)


# -- the default -------------------------------------------------------------------------------------------------

KNOWN = ("mutwo", "blocks", "per-module", "sqrt-n", "recompute-all", "keep-all")
# Selective-checkpoint policies as sets: auto knows them when it plans for a replay mode (plan_for_mode prices every
# set in that mode), not for the rewritten step, which would replay their sets as chains, not as the policy runs.
POLICIES = ("per-op",)
FILL_STARTS = 3  # plan_for_mode fills this many solvers' sets (fill_budget), the fastest first


# auto also asks the shared-mode program (acstudio.plan.milp.shared_bound) for its set on graphs up to
# PROGRAM_MAX_CANDIDATES, within ACSTUDIO_AUTO_MILP_SECONDS (default 10; 0 never asks): on the transformer samples
# it answers in 0-3 s and often finds a faster plan than the others.
AUTO_PROGRAM_TIME_ENV = "ACSTUDIO_AUTO_MILP_SECONDS"


def auto_program_seconds() -> float:
    """The time ``auto`` gives the shared-mode program per budget (environment ``ACSTUDIO_AUTO_MILP_SECONDS``)."""
    text = os.environ.get(AUTO_PROGRAM_TIME_ENV, "10")
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise ACStudioError(f"{AUTO_PROGRAM_TIME_ENV}={text!r} is not a number of seconds — give e.g. 10, or 0 to "
                            "plan without the shared-chain program")
    return seconds


@solver("auto", "the fastest plan of every solver above that fits (never beaten by a plan it knows)")
def solve_auto(ctx: PlanContext, budget: int, *, cancel: CancelToken | None = None) -> Plan:
    return auto_plan(ctx, budget, cancel)


def auto_plan(ctx: PlanContext, budget: int, cancel: CancelToken | None = None, program=None) -> Plan:
    """``auto``'s plan; ``program``: the shared-mode program's result at ``budget`` if the caller has it (else it
    is solved here, for at most :func:`auto_program_seconds`)."""
    plans = []
    for name in KNOWN:
        check(cancel)
        plans.append(SOLVERS[name].solve(ctx, budget, cancel=cancel))
    seconds = auto_program_seconds()
    if (program is None and seconds > 0 and len(ctx.rg.candidates) <= PROGRAM_MAX_CANDIDATES
            and ctx.sim.baseline_peak > budget):
        from acstudio.plan.milp import shared_bound  # scipy.optimize: imported only when used

        program = shared_bound(ctx, budget, time_limit_s=seconds, cancel=cancel)
    if program is not None and program.chosen:
        plans.append(ctx.plan_for_set("milp-bound", budget, program.chosen, mode="shared"))
    best = best_of(plans)
    why = f"{best.stop_reason} ({best.solver}'s plan)" if best.recomputed else best.stop_reason
    return dataclasses.replace(best, solver="auto", stop_reason=why)


# Bisection steps on the target budget per solver in plan_for_mode: the last step is (budget - floor) / 2**8.
TARGET_SEARCH_STEPS = 8


def plan_for_mode(ctx: PlanContext, budget: int, mode: str, solver: str = "auto",
                  cancel: CancelToken | None = None) -> Plan:
    """The predicted-fastest plan whose peak *replayed in* ``mode`` fits ``budget`` (or, if none fits, the lowest
    peak in ``mode``), among the sets ``solver`` (``auto``: every solver it knows and every policy in
    :data:`POLICIES`) chooses at ``budget`` and at lower target budgets.

    A solver's set is priced in its own mode, and another mode usually holds more (SAC saves or recomputes whole
    ops), so each solver's target is bisected between the AC floor and ``budget`` for the highest target whose
    set fits in ``mode``. Sets are priced once each; a solver whose set does not change down to the floor is
    asked twice only."""
    get_mode(mode)  # a clear error for an unknown mode before any search
    ctx = ctx.without_offload()  # sets are priced in the mode, which may not offload
    priced: dict[tuple[int, ...], Plan] = {}

    def price(name: str, target: int) -> Plan:
        check(cancel)
        chosen = SOLVERS[name].solve(ctx, target, cancel=cancel)
        ks = tuple(ctx.rg.act_index[a] for a in chosen.recomputed)
        if ks not in priced:
            priced[ks] = ctx.plan_for_set(name, budget, list(ks), mode=mode)
        return priced[ks]

    floor = min(ctx.floor_bytes, budget)
    for name in (*KNOWN, *POLICIES) if solver == "auto" else (solver,):
        top = price(name, budget)
        if top.feasible:
            continue  # the largest target fits: the fastest this solver offers
        bottom = price(name, floor)
        if bottom is top or not bottom.feasible:
            continue  # the set does not change, or even the solver's smallest does not fit
        lo, hi = floor, budget  # the set for lo fits, for hi does not
        for _ in range(TARGET_SEARCH_STEPS):
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if price(name, mid).feasible else (lo, mid)
    # The FILL_STARTS fastest fitting sets of different solvers, filled: a slower set may leave the memory that
    # makes it the fastest (compiled, torchtitan's set with the decoder's rotary query kept back).
    fitting = [p for p in priced.values() if p.feasible and p.recomputed]
    fastest_per_solver = {p.solver: p for p in sorted(fitting, key=lambda p: -p.predicted_extra_ms)}
    starts = dict(sorted(fastest_per_solver.items(), key=lambda kv: kv[1].predicted_extra_ms)[:FILL_STARTS])
    filled = {id(p): fill_budget(ctx, p, budget, mode, cancel) for p in starts.values()}
    best = best_of([*priced.values(), *(plan for plan, _ in filled.values())])
    start = next((p for p in starts.values() if filled[id(p)][0] is best), best)
    kept = filled[id(start)][1] if id(start) in filled else 0
    why = f"{start.stop_reason} in {mode} mode ({start.solver}'s plan)" if start.recomputed else start.stop_reason
    why += f", then {kept} activations kept back in the memory left" if kept else ""
    return dataclasses.replace(best, solver=solver, stop_reason=why)


def fill_budget(ctx: PlanContext, chosen: Plan, budget: int, mode: str, cancel: CancelToken | None = None
                ) -> tuple[Plan, int]:
    """``chosen`` with recomputed activations kept back while it still fits ``budget`` in ``mode`` and gets
    faster; returns the plan and how many were kept back.

    A solver's set found for a lower target, or a policy's, often leaves memory unused in ``mode``. Each candidate
    no larger than the memory left (where the peak holds every saved activation, keeping one adds its bytes there)
    is tried alone once, and those that pay are kept back greedily, the most replay time saved per byte first. The
    saving is measured, not read off the creating op: compiled, keeping a cheap rotary output saves the replay of
    the matmul before it. A mode may refuse a candidate whose cost it does not price (:meth:`ReplayMode.may_keep_back`:
    eager SAC's dispatch in a block that ran a plain checkpoint)."""
    rg, replay = ctx.rg, get_mode(mode)
    current = ctx.sim.indices(chosen.recomputed)
    peak, fastest = chosen.predicted_peak_bytes, chosen.predicted_extra_ms
    saving: dict[int, float] = {}
    for k in current:
        if rg.bytes[k] > budget - peak or not replay.may_keep_back(ctx.sim, current, k):
            continue
        check(cancel)
        trial_peak, _, ms = replay.peak(ctx.sim, [j for j in current if j != k])
        if trial_peak <= budget and ms < fastest - 1e-9:
            saving[k] = (fastest - ms) / max(int(rg.bytes[k]), 1)
    kept = 0
    for k in sorted(saving, key=lambda k: -saving[k]):
        if rg.bytes[k] > budget - peak or not replay.may_keep_back(ctx.sim, current, k):
            continue
        check(cancel)
        trial = [j for j in current if j != k]
        trial_peak, _, ms = replay.peak(ctx.sim, trial)
        if trial_peak <= budget and ms < fastest - 1e-9:
            current, peak, fastest, kept = trial, trial_peak, ms, kept + 1
    if not kept:
        return chosen, 0
    return ctx.plan_for_set(chosen.solver, budget, current, mode=mode), kept


def plan(profile: Profile, budget_bytes: int, solver: str = "auto", simulator: Simulator | None = None,
         cancel: CancelToken | None = None, ctx: PlanContext | None = None, mode: str | None = None,
         offload: bool = True, host_memory: int | None = None) -> Plan:
    """Plan one budget with ``solver`` (a name in :data:`SOLVERS`); pass ``ctx`` to reuse what earlier calls
    computed for the same profile (it then says whether to offload). ``mode`` (a replay mode) plans for that mode:
    the plan's peak in it fits (:func:`plan_for_mode`; ``auto`` searches every solver it knows); without it each
    solver picks its modes. ``offload``, ``host_memory``: see :class:`~acstudio.plan.schedule.PlanContext`."""
    if solver not in SOLVERS:
        raise ACStudioError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    ctx = ctx or PlanContext(profile, simulator, offload=offload, host_memory=host_memory)
    if mode is not None:
        return plan_for_mode(ctx, budget_bytes, mode, solver, cancel)
    return SOLVERS[solver].solve(ctx, budget_bytes, cancel=cancel)


# -- the Pareto table ----------------------------------------------------------------------------------------------

def sweep(profile: Profile, solvers: Collection[str] | None = None, simulator: Simulator | None = None,
          milp_points: int = 6, progress: ProgressFn | None = None, cancel: CancelToken | None = None,
          ctx: PlanContext | None = None, milp_time_s: float = SWEEP_MILP_TIME_LIMIT_S) -> pd.DataFrame:
    """Pareto table of every solver under the same simulator: one row per (solver, operating point).

    μ-TWO contributes every trajectory step that lowers the peak (replaying chains again), the block search
    states spread along its sequence (shared chains), the fixed baselines
    one row per replay mode (their budget is their own peak; ``note`` marks the mode their real counterpart runs
    in), ``auto`` the lower envelope of all those points, and at up to ``milp_points`` budgets taken from the μ-TWO
    curve: ``milp``, the exact optimum in μ-TWO's mode (or, past its time limit, μ-TWO's plan and a lower bound),
    with μ-TWO's optimality gap ``gap = mutwo_extra_ms / lower_bound_ms - 1`` (exact where ``optimal``), and
    ``milp-bound``, a lower bound for every replay mode, with ``auto``'s gap at most ``gap_bound``.
    """
    ctx = ctx or PlanContext(profile, simulator)
    solvers = set(SOLVERS if solvers is None else solvers)
    rows = []

    def row(solver: str, peak: int, extra_ms: float, n: int, mode: str, **extra) -> None:
        rows.append({"solver": solver, "budget_bytes": peak, "peak_bytes": peak, "extra_ms": extra_ms,
                     "n_recomputed": n, "replay_mode": mode, **extra})

    traj = trajectory(ctx, progress, cancel) if {"mutwo", "milp", "milp-bound", "auto"} & solvers else None
    points = []  # (peak, extra_ms, n, mode, solver) of everything auto knows
    best = None
    for j, step in enumerate(traj.steps if traj else ()):
        if best is None or step.simulated_peak_bytes < best:
            best = step.simulated_peak_bytes
            points.append((best, step.extra_ms, j, "again", "mutwo"))
    for name in [n for n in baselines.FIXED if n in solvers or ("auto" in solvers and n in KNOWN)]:
        check(cancel)
        real = baselines.REAL_MODES[name]
        for mode in dict.fromkeys(("again", "shared", *real)):
            p = ctx.plan_for_set(name, 0, baselines.FIXED[name](ctx), mode=mode)
            if name in solvers:
                row(name, p.predicted_peak_bytes, p.predicted_extra_ms, len(p.recomputed), mode,
                    note="how its real counterpart runs" if mode in real and len(real) == 1 else "")
            if mode in real and name in KNOWN:  # auto is their envelope too
                points.append((p.predicted_peak_bytes, p.predicted_extra_ms, len(p.recomputed), mode, name))
            if not p.recomputed:
                break  # keep-all: the same in every mode
    if {"blocks", "auto"} & solvers:
        from acstudio.plan.blocks import block_search

        for pk, ms, n in block_search(ctx, cancel).curve():
            points.append((pk, ms, n, "shared", "blocks"))
            if "blocks" in solvers:
                row("blocks", pk, ms, n, "shared")
    if "mutwo" in solvers:
        rows[:0] = [{"solver": "mutwo", "budget_bytes": pk, "peak_bytes": pk, "extra_ms": ms, "n_recomputed": n,
                     "replay_mode": mode} for pk, ms, n, mode, src in points if src == "mutwo"]
    if "auto" in solvers:
        for pk, ms, n, mode, src in pareto_front(points):
            row("auto", pk, ms, n, mode, note=f"{src}'s plan")
    if {"milp", "milp-bound"} & solvers:
        rows.extend(_milp_rows(ctx, traj, milp_points, solvers, milp_time_s, cancel))
    return pd.DataFrame(rows)


def pareto_front(points: list[tuple]) -> list[tuple]:
    """The points (peak first, extra time second) that no other point beats in both, by increasing peak."""
    front = []
    for p in sorted(points, key=lambda p: (p[0], p[1])):
        if not front or p[1] < front[-1][1]:
            front.append(p)
    return front


def _milp_rows(ctx: PlanContext, traj: Trajectory, milp_points: int, solvers: Collection[str], time_s: float,
               cancel: CancelToken | None) -> list[dict]:
    """At ``milp_points`` budgets of μ-TWO's curve: the exact program's answer (``milp``: μ-TWO's gap against it)
    and the bound of both modes (``milp-bound``: ``auto``'s gap is at most ``gap_bound``), each program stopped
    after ``time_s``. Past ``PROGRAM_MAX_CANDIDATES`` a row says how to get them instead."""
    n = len(ctx.rg.candidates)
    if n > PROGRAM_MAX_CANDIDATES:
        return [{"solver": s, "note": f"skipped: {n} candidates (sweeps run the programs up to "
                                      f"{PROGRAM_MAX_CANDIDATES}); plan one budget with --solver {s}"}
                for s in ("milp", "milp-bound") if s in solvers]
    rows = []
    peaks = sorted({s.predicted_peak_bytes for s in traj.steps[1:]}, reverse=True)
    picks = [peaks[round(i)] for i in np.linspace(0, len(peaks) - 1, min(milp_points, len(peaks)))]
    for budget in dict.fromkeys(picks):
        check(cancel)
        from acstudio.plan.milp import shared_bound

        shared = shared_bound(ctx, budget, time_limit_s=time_s, cancel=cancel)  # auto's and milp-bound's
        auto = auto_plan(ctx, budget, cancel, program=shared)
        base = {"budget_bytes": budget, "auto_extra_ms": auto.predicted_extra_ms}
        exact = exact_milp(ctx, budget, time_s, cancel)
        if "milp" in solvers:
            p = milp_plan(ctx, budget, exact)
            mu = traj.plan_for_budget(budget)
            rows.append({**base, "solver": "milp", "peak_bytes": p.predicted_peak_bytes,
                         "extra_ms": p.predicted_extra_ms, "n_recomputed": len(p.recomputed), "replay_mode": "again",
                         "feasible": p.feasible, "note": p.stop_reason, "optimal": exact.optimal,
                         "lower_bound_ms": exact.lower_bound_ms, "mutwo_extra_ms": mu.predicted_extra_ms,
                         "gap": _gap(mu.predicted_extra_ms, exact.lower_bound_ms)})
        if "milp-bound" in solvers:
            p, lower = bounded_plan(ctx, budget, cancel, time_s, auto, exact, shared)
            rows.append({**base, "solver": "milp-bound", "peak_bytes": p.predicted_peak_bytes,
                         "extra_ms": p.predicted_extra_ms, "n_recomputed": len(p.recomputed),
                         "replay_mode": p.replay_mode, "feasible": p.feasible, "note": p.stop_reason,
                         "lower_bound_ms": lower, "gap_bound": _gap(auto.predicted_extra_ms, lower)})
    return rows


def _gap(extra_ms: float, lower_ms: float) -> float:
    """``extra / lower - 1``: how far above a proven lower bound (0 when both are 0)."""
    return extra_ms / lower_ms - 1 if lower_ms > 1e-12 else (0.0 if extra_ms <= 1e-12 else float("inf"))
