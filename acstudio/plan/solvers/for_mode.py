"""Planning *for* a replay mode: the solvers still choose in their own modes, so their sets are searched over
lower target budgets, each is priced in the mode asked for, and the fastest few are filled up to the budget; a
set chosen for what it is (a peer's policy) is tightened to the budget instead when it is a little over."""

from __future__ import annotations

import dataclasses

import numpy as np

from acstudio.jobs import CancelToken, check
from acstudio.plan.model import Plan
from acstudio.plan.schedule import PlanContext
from acstudio.plan.solvers.auto import DEFAULT_SOLVER
from acstudio.plan.solvers.registry import SOLVERS, auto_solvers, best_of
from acstudio.simulate.modes import get_mode

FILL_STARTS = 3  # plan_for_mode fills this many solvers' sets (fill_budget), the fastest first

TIGHTEN_ROUNDS = 8  # tighten_to_budget frees at most this many activations, one pass over the candidates each

# Bisection steps on the target budget per solver in plan_for_mode: the last step is (budget - floor) / 2**8.
TARGET_SEARCH_STEPS = 8


def plan_for_mode(ctx: PlanContext, budget: int, mode: str, solver: str = DEFAULT_SOLVER,
                  cancel: CancelToken | None = None) -> Plan:
    """The predicted-fastest plan whose peak *replayed in* ``mode`` fits ``budget`` (or, if none fits, the lowest
    peak in ``mode``), among the sets ``solver`` (``auto``: every solver it knows and every selective-checkpoint
    policy) chooses at ``budget`` and at lower target budgets.

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
    for name in auto_solvers(policies=True) if solver == DEFAULT_SOLVER else (solver,):
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
    no larger than the memory left while it would be held (:func:`room_to_keep`) is tried alone once, and those
    that pay are kept back greedily, the most replay time saved per byte first. The
    saving is measured, not read off the creating op: compiled, keeping a cheap rotary output saves the replay of
    the matmul before it. A mode may refuse a candidate whose cost it does not price (:meth:`ReplayMode.may_keep_back`:
    eager SAC's dispatch in a block that ran a plain checkpoint)."""
    rg, replay = ctx.rg, get_mode(mode)
    current = ctx.sim.indices(chosen.recomputed)
    fastest = chosen.predicted_extra_ms
    room = room_to_keep(ctx, mode, current, budget)
    saving: dict[int, float] = {}
    for k in current:
        if rg.bytes[k] > room[k] or not replay.may_keep_back(ctx.sim, current, k):
            continue
        check(cancel)
        trial_peak, _, ms = replay.peak(ctx.sim, [j for j in current if j != k])
        if trial_peak <= budget and ms < fastest - 1e-9:
            saving[k] = (fastest - ms) / max(int(rg.bytes[k]), 1)
    kept = 0
    for k in sorted(saving, key=lambda k: -saving[k]):
        if rg.bytes[k] > room[k] or not replay.may_keep_back(ctx.sim, current, k):
            continue
        check(cancel)
        trial = [j for j in current if j != k]
        trial_peak, _, ms = replay.peak(ctx.sim, trial)
        if trial_peak <= budget and ms < fastest - 1e-9:
            current, fastest, kept = trial, ms, kept + 1
            room = room_to_keep(ctx, mode, current, budget)
    if not kept:
        return chosen, 0
    return ctx.plan_for_set(chosen.solver, budget, current, mode=mode), kept


def tighten_to_budget(ctx: PlanContext, chosen: Plan, budget: int, mode: str, cancel: CancelToken | None = None,
                      rounds: int = TIGHTEN_ROUNDS) -> tuple[Plan, int]:
    """``chosen``, over ``budget`` in ``mode``, with more activations recomputed until it fits: each round frees
    the cheapest candidate that makes it fit, or else the one that lowers the peak most per millisecond it adds;
    returns the plan (infeasible still if ``rounds`` did not suffice) and how many it freed.

    The counterpart of :func:`fill_budget` for a set chosen for what it is rather than found at this budget: a
    peer's policy, predicted a few MiB over that peer's own measured peak (compiled, torchtitan's set on GPT-2),
    is one or two cheap replays from the fastest plan that fits."""
    replay = get_mode(mode)
    current = ctx.sim.indices(chosen.recomputed)
    peak, ms = chosen.predicted_peak_bytes, chosen.predicted_extra_ms
    freed = 0
    for _ in range(rounds):
        if peak <= budget:
            break
        chosen_set = set(current)
        best, best_key = None, None
        for k in ctx.rg.candidates:
            if k in chosen_set:
                continue
            check(cancel)
            trial_peak, _, trial_ms = replay.peak(ctx.sim, [*current, k])
            if trial_peak >= peak:
                continue
            added = max(trial_ms - ms, 1e-9)
            key = (0, added) if trial_peak <= budget else (1, -(peak - trial_peak) / added)
            if best_key is None or key < best_key:
                best, best_key = (k, trial_peak, trial_ms), key
        if best is None:
            break
        k, peak, ms = best
        current, freed = [*current, k], freed + 1
    if not freed:
        return chosen, 0
    return ctx.plan_for_set(chosen.solver, budget, current, mode=mode), freed


def room_to_keep(ctx: PlanContext, mode: str, recomputed: list[int], budget: int) -> np.ndarray:
    """Per activation, ``budget`` less the highest memory of the step ``recomputed`` replayed in ``mode`` while
    that activation is out of memory (after its last forward use, before its first backward use): kept back, it
    adds its bytes there, so one larger than that cannot fit.

    The span matters where the step's peak is at a node no activation is live for: a decoder's AdamW step over
    fp32 states sets the peak of every plan, and the memory beneath it during forward and backward is still room
    (measured against the peak, a policy's set planned at that peak could keep nothing back)."""
    replay, rg = get_mode(mode), ctx.rg
    memory = replay.evaluate(ctx.sim, replay.schedule(ctx.sim, recomputed), timeline=True)[3].sum(axis=1)
    room = np.full(len(rg.bytes), budget, dtype=np.int64)
    for k in recomputed:
        start, end = rg.last_fw[k] + 1, rg.first_bw[k]
        if start < end:
            room[k] = budget - int(memory[start:end].max())
    return room
