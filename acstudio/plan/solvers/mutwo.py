"""μ-TWO's recompute-only activation checkpointing (recompute branch of its Algorithm B, with Alg D/E/F).

Greedy: repeatedly recompute the candidate with the best recompute ratio, ``bytes / total recompute time``,
where the total counts the candidate's replay once for itself and once more for every already-recomputed
activation that reads it and would have to replay it too (Alg D/F's ``recomp_cnt``). After each pick the
sources, replays and times of everything that read the picked activation are updated (Alg E/F; see
:mod:`acstudio.simulate.replay` for the deduplicated, residency-checked form) and the whole iteration is
re-simulated. Ties go to the larger inactive time, then the earlier first backward use, then the id.

Instead of stopping at one budget, :func:`mutwo_trajectory` runs the greedy until no candidate is left (or the
peak sits where no remaining candidate can lower it) and keeps every step, so a budget slider only looks the
answer up. A pick can raise the simulated peak (a long replay's transient, or a source kept alive longer);
the greedy keeps such picks, as μ-TWO does, and the trajectory reports the running minimum of the peak, so
its peaks never increase. A budget is met by the first prefix whose own peak fits, which is also the first
step whose reported peak fits.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from acstudio.jobs import CancelToken, ProgressFn, check, report
from acstudio.plan.baselines import per_module
from acstudio.plan.model import Plan, ScheduleEntry
from acstudio.plan.schedule import PlanContext
from acstudio.plan.solvers.registry import CurvePoint, best_of, solver
from acstudio.profile.model import Profile
from acstudio.simulate.modes import get_mode
from acstudio.simulate.offload import offload_schedule
from acstudio.simulate.replay import Replay, ReplayGraph
from acstudio.simulate.simulator import SimState, Simulator
from acstudio.units import format_bytes

BUDGET_MET = "budget met"
BASELINE_FITS = "nothing to do: baseline fits"
EXHAUSTED = "candidates exhausted (budget below floor)"


def candidates(profile: Profile, simulator: Simulator | None = None) -> list[str]:
    """Activation ids μ-TWO may free and recompute; ``Plan.excluded`` / the simulator's replay graph say why
    the others may not (random op, mutation of graph state, no inactive interval, ...)."""
    rg = simulator.replay if simulator is not None else ReplayGraph(profile)
    return [rg.act_ids[k] for k in rg.candidates]


@dataclass
class TrajectoryStep:
    """State after recomputing ``activation`` and everything picked before it (step 0: nothing recomputed).

    ``predicted_peak_bytes`` is the lowest peak of this or any earlier step (see the module docstring),
    ``simulated_peak_bytes`` this step's own; ``extra_ms`` is this step's total recompute time.
    """

    activation: str
    predicted_peak_bytes: int
    predicted_peak_node: str
    extra_ms: float
    simulated_peak_bytes: int = 0


class _Greedy:
    """The greedy's state; :meth:`pick` makes one choice and returns it with its ratio, :meth:`peak` simulates."""

    def __init__(self, ctx: PlanContext) -> None:
        rg = self.rg = ctx.rg
        self.state = SimState(ctx.sim)
        self.mask = self.state.mask
        self.chain: dict[int, list[int]] = {k: [k] for k in rg.candidates}
        self.sources: dict[int, list[int]] = {k: list(rg.stops[k]) for k in rg.candidates}
        self.nodes: dict[int, np.ndarray] = {k: rg.own[k] for k in rg.candidates}
        self.time = rg.own_time.copy()
        self.n_dep = np.zeros(len(rg.bytes), dtype=np.int64)
        self.readers: dict[int, set[int]] = defaultdict(set)  # activation -> candidates whose sources include it
        for k in rg.candidates:
            for s in self.sources[k]:
                self.readers[s].add(k)
        inactive = {a.id: a.inactive_time_ms for a in ctx.profile.activations}
        self.order = sorted(rg.candidates, key=lambda k: (-inactive[rg.act_ids[k]], rg.first_bw[k], rg.act_ids[k]))
        self.slot = {k: i for i, k in enumerate(self.order)}
        self.ratio = np.zeros(len(self.order))
        for k in self.order:
            self._rate(k)
        self.extra_ms = 0.0
        self.pick_ratio: dict[int, float] = {}
        # Per recomputed activation: (step, schedule entry) each time its replay changed.
        self.history: dict[int, list[tuple[int, ScheduleEntry]]] = {}
        self.steps = 0
        self.ctx = ctx
        self._cand = np.array(self.order, dtype=np.int64)

    def _extend(self, k: int, t: int) -> tuple[list[int], list[int]]:
        """Make ``k`` replay recomputed ``t`` instead of reading it; returns (old, new) sources."""
        rg = self.rg
        old_chain, old = self.chain[k], self.sources[k]
        chain, sources = rg.extend_chain(k, old_chain, old, t, self.mask)
        for s in set(old) - set(sources):
            self.readers[s].discard(k)
        for s in set(sources) - set(old):
            self.readers[s].add(k)
        self.chain[k], self.sources[k] = chain, sources
        self.nodes[k] = np.unique(np.concatenate([self.nodes[k], *(rg.own[c] for c in chain[len(old_chain):])]))
        self.time[k] = rg.run_ms[self.nodes[k]].sum()
        return old, sources

    def _rate(self, k: int) -> None:
        total = self.time[k] * (1 + self.n_dep[k])
        self.ratio[self.slot[k]] = self.rg.bytes[k] / max(total, 1e-12)

    def _read_by(self, reader: int, sources: list[int], sign: int, touched: set[int]) -> None:
        """Account for recomputed ``reader`` starting (+1) or stopping (-1) to read ``sources``: the replays a
        later pick of a source would add (``n_dep``), and how long retained sources must stay."""
        rg = self.rg
        f = rg.first_bw[reader]
        for s in sources:
            if self.mask[s]:
                continue
            if rg.is_candidate[s] and not rg.resident(s, f):
                self.n_dep[s] += sign
                touched.add(s)
            until = max((rg.first_bw[r] for r in self.readers[s] if self.mask[r]), default=-1)
            if until != self.state.keep_until[s]:
                self.state.keep(s, until)

    def pick(self) -> tuple[int, float] | None:
        i = int(np.argmax(self.ratio)) if self.ratio.size else -1
        if i < 0 or self.ratio[i] == -np.inf:
            return None
        rg = self.rg
        t, ratio = self.order[i], float(self.ratio[i])
        self.ratio[i] = -np.inf
        self.pick_ratio[t] = ratio
        self.state.recompute(t)
        self.steps += 1
        touched: set[int] = set()
        self._read_by(t, self.sources[t], +1, touched)
        self.extra_ms += self.time[t]
        changed = [t]
        for k in [k for k in self.readers[t] if not rg.resident(t, rg.first_bw[k])]:
            was_time = self.time[k]
            old, new = self._extend(k, t)
            if self.mask[k]:
                self._read_by(k, [s for s in old if s not in new], -1, touched)
                self._read_by(k, [s for s in new if s not in old], +1, touched)
                self.extra_ms += self.time[k] - was_time
                changed.append(k)
            else:
                touched.add(k)
        for k in changed:
            self.state.transient[k] = rg.transient_bytes(k, self.nodes[k])
            params = sorted({p for c in self.chain[k] for p in rg.params[c]})
            entry = self.ctx.entry(k, self.sources[k], params, self.nodes[k], self.time[k], self.pick_ratio[k])
            self.history.setdefault(k, []).append((self.steps, entry))
        for s in touched:
            if not self.mask[s]:
                self._rate(s)
        return t, ratio

    def peak(self) -> tuple[int, int, bool]:
        return self.state.peak()

    def out_of_reach(self, pos: int) -> bool:
        """True when candidates remain but none is in memory at node ``pos`` (so none can lower its memory)."""
        rg, c = self.rg, self._cand
        left = ~self.mask[c]
        in_gap = (rg.last_fw[c] < pos) & (pos < rg.first_bw[c])
        kept_for_reader = (rg.last_bw[c] < pos) & (pos < self.state.keep_until[c])
        return bool(left.any()) and not np.any(left & (in_gap | kept_for_reader))


@dataclass
class Trajectory:
    """The whole greedy run: the memory/time curve and, per step, what each recomputation replays."""

    steps: list[TrajectoryStep]
    stop_reason: str  # why the greedy ended (candidates exhausted, or the peak out of their reach)
    _ctx: PlanContext = field(repr=False)
    _picks: list[int] = field(repr=False)
    _history: dict[int, list[tuple[int, ScheduleEntry]]] = field(repr=False)
    _own_nodes: list[str] = field(repr=False)

    def __post_init__(self) -> None:
        self._own = np.array([s.simulated_peak_bytes for s in self.steps], dtype=np.int64)
        self._min = np.array([s.predicted_peak_bytes for s in self.steps], dtype=np.int64)
        self._picked_at = {k: j + 1 for j, k in enumerate(self._picks)}
        self._run_order = self._ctx.execution_order(self._picks)
        self._version_steps = {k: [step for step, _ in vs] for k, vs in self._history.items()}

    def step_for_budget(self, budget_bytes: int) -> int | None:
        """Index of the first step whose peak fits ``budget_bytes`` (``None`` if none does)."""
        j = int(np.argmax(self._min <= budget_bytes))
        return j if self._min[j] <= budget_bytes else None

    def plan_for_budget(self, budget_bytes: int) -> Plan:
        """The plan for a budget, read off the trajectory; if no step fits, an infeasible plan with the lowest
        peak μ-TWO reached (it reports the floor as well)."""
        j = self.step_for_budget(budget_bytes)
        if j is None:
            return self.plan_at(int(np.argmin(self._own)), budget_bytes, self.stop_reason)
        return self.plan_at(j, budget_bytes, BASELINE_FITS if j == 0 else BUDGET_MET)

    def shared_step_for_budget(self, budget_bytes: int, grid: int = 32, window: int = 2) -> int | None:
        """The step whose picks, replayed with shared chains, fit ``budget_bytes`` at the least extra time
        (``None`` if no evaluated step fits).

        Shared peaks first fall with the prefix length, then rise again (a long shared chain produces, and holds,
        everything it passes through; all candidates shared is one replay of the whole forward). So: a grid of
        ``grid`` prefixes, a binary search for the first fitting prefix below each fitting grid point, and the
        ``window`` steps on either side; only evaluated fits count.
        """
        shared = get_mode("shared")
        cache: dict[int, tuple[int, int, float]] = {0: (int(self._own[0]), 0, 0.0)}

        def fits(j: int) -> bool:
            if j not in cache:
                cache[j] = shared.peak(self._ctx.sim, self._picks[:j])
            return cache[j][0] <= budget_bytes

        points = sorted({round(x) for x in np.linspace(0, len(self._picks), grid + 1)})
        for lo, hi in itertools.pairwise(points):
            if fits(hi) and not fits(lo):
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    lo, hi = (lo, mid) if fits(mid) else (mid, hi)
                for k in range(max(0, hi - window), min(len(self._picks), hi + window) + 1):
                    fits(k)
        ok = [j for j, (peak, _, _) in cache.items() if peak <= budget_bytes]
        return min(ok, key=lambda j: (cache[j][2], j)) if ok else None

    def best_plan_for_budget(self, budget_bytes: int) -> Plan:
        """:meth:`plan_for_budget`, or the shared-chain plan of a trajectory prefix if that fits too and is
        predicted faster (``Plan.replay_mode`` says which). Tens of shared evaluations: for planning one
        budget, not for a slider."""
        again = self.plan_for_budget(budget_bytes)
        j = self.shared_step_for_budget(budget_bytes)
        if j is None or j == 0:
            return again
        shared = self._ctx.plan_for_set("mutwo", budget_bytes, self._picks[:j], BUDGET_MET, mode="shared")
        # A tie (equal up to float rounding) keeps μ-TWO's own replays.
        if again.feasible and again.predicted_extra_ms <= shared.predicted_extra_ms * (1 + 1e-9):
            return again
        return shared

    def plan_at(self, j: int, budget_bytes: int, stop_reason: str) -> Plan:
        """The plan of step ``j`` (its first ``j`` picks) judged against ``budget_bytes``.

        Schedule entries are made once, while the greedy runs, and shared by every plan of this trajectory
        that contains them: treat them as read-only."""
        entries = [self._history[k][bisect.bisect_right(self._version_steps[k], j) - 1][1]
                   for k in self._run_order if self._picked_at[k] <= j]
        return self._ctx.make_plan("mutwo", budget_bytes, self._picks[:j], entries, int(self._own[j]),
                             self._own_nodes[j], self.steps[j].extra_ms, stop_reason)

    def curve(self) -> pd.DataFrame:
        """One row per step: activation, peak (monotone), own simulated peak, peak node, extra ms."""
        return pd.DataFrame([vars(s) for s in self.steps])


def run_trajectory(ctx: PlanContext, until_bytes: int | None = None, progress: ProgressFn | None = None,
                cancel: CancelToken | None = None) -> Trajectory:
    """Run the greedy to the end, or only until the peak fits ``until_bytes``."""
    sim = ctx.sim
    steps = [TrajectoryStep("", sim.baseline_peak, sim.baseline_peak_node, 0.0, sim.baseline_peak)]
    own_nodes = [sim.baseline_peak_node]
    picks: list[int] = []
    g = _Greedy(ctx)
    best = steps[0]
    stop_reason = EXHAUSTED
    total = len(g.order)
    pos, before = ctx.profile.node_index[sim.baseline_peak_node], False
    while until_bytes is None or best.predicted_peak_bytes > until_bytes:
        check(cancel)
        if not before and g.out_of_reach(pos):
            region = ctx.profile.nodes[pos].region
            stop_reason = (f"peak at {sim.node_ids[pos]} ({region}) is out of reach: no remaining candidate is "
                           "in memory there")
            break
        picked = g.pick()
        if picked is None:
            break
        peak, pos, before = g.peak()
        node = sim.node_ids[pos]
        picks.append(picked[0])
        own_nodes.append(node)
        if peak < best.predicted_peak_bytes:
            best = TrajectoryStep(ctx.rg.act_ids[picked[0]], peak, node, g.extra_ms, peak)
            steps.append(best)
        else:
            steps.append(TrajectoryStep(ctx.rg.act_ids[picked[0]], best.predicted_peak_bytes,
                                        best.predicted_peak_node, g.extra_ms, peak))
        if len(picks) % 16 == 0:
            report(progress, len(picks), total, f"μ-TWO: {len(picks)}/{total} candidates recomputed")
    report(progress, total, total, "μ-TWO: done")
    if until_bytes is None and stop_reason == EXHAUSTED and "floor" not in vars(sim):
        # Every candidate is recomputed in the last step: that is the floor, no need to simulate it again.
        sim.floor = (steps[-1].simulated_peak_bytes, own_nodes[-1])
    _ = ctx.profile.fingerprint, sim.floor_bytes  # what every plan reports: computed here, once, not per lookup
    return Trajectory(steps, stop_reason, ctx, picks, g.history, own_nodes)


def mutwo_trajectory(profile: Profile, simulator: Simulator | None = None, progress: ProgressFn | None = None,
                     cancel: CancelToken | None = None) -> Trajectory:
    """The complete μ-TWO greedy run for ``profile`` (the memory/time Pareto curve)."""
    return run_trajectory(PlanContext(profile, simulator), progress=progress, cancel=cancel)


# -- the third choice: offload ---------------------------------------------------------------------------------

# Host-memory caps offload_plan tries below the context's, each half the bytes the previous plan moved, while that
# plan stalls: the greedy compares one step's stall with one recompute, and a plan that moves less can be faster.
OFFLOAD_CAP_HALVINGS = 2
# Where offload_onto starts: the recompute-only trajectory's plan for a budget this share of the way from the budget
# up to the baseline peak. How much offload can take off the peak depends on how long forward runs against the
# link, which no single share captures; the first step that recomputes nothing ends the ladder, and the last share
# (the baseline peak) is that step: offload alone, which the slider's preview also starts from.
OFFLOAD_START_SHARES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 1.0)


def offload_plan(ctx: PlanContext, budget: int, cancel: CancelToken | None = None) -> Plan | None:
    """The fastest of :func:`offload_greedy`'s plans, with and without ``covering``, under the context's host-memory
    cap and, while a plan stalls, under :data:`OFFLOAD_CAP_HALVINGS` smaller caps, and of :func:`offload_onto`'s
    from each of :data:`OFFLOAD_START_SHARES` and from block checkpointing's set (:func:`_onto_blocks`); None when
    the context does not offload (:attr:`PlanContext.may_offload`), the baseline fits, or no plan offloads.

    Neither swap rule wins everywhere: a swap that does not lower the current peak can still make room that a
    later pick needs, or just move bytes; and weighing one swap against one recompute at a time misses plans
    that recompute some blocks whole and offload what the others' replays read (block checkpointing with its
    inputs on the host), which offload_onto finds."""
    if not ctx.may_offload or ctx.sim.baseline_peak <= budget:
        return None
    plans: list[Plan] = []
    path = trajectory(ctx, cancel=cancel)
    starts = []
    for share in OFFLOAD_START_SHARES:
        j = path.step_for_budget(int(budget + share * (ctx.sim.baseline_peak - budget)))
        j = len(path._picks) if j is None else j
        if j not in starts:
            starts.append(j)
        if j == 0:
            break
    for j in starts:
        plans += offload_onto(ctx, [budget], ctx.host_memory, path._picks[:j], path._picks[j:], cancel)
    plans += _onto_blocks(ctx, [budget], path, cancel)
    for covering in (False, True):
        cap = ctx.host_memory
        for _ in range(OFFLOAD_CAP_HALVINGS + 1):
            found = offload_greedy(ctx, budget, cap, cancel, covering)
            if found is None:
                break
            plans.append(found)
            if found.copies_hidden or not found.feasible:
                break
            cap = found.offload_bytes // 2
    if not plans:
        return None
    fitting = [p for p in plans if p.feasible]
    return (min(fitting, key=lambda p: (round(p.predicted_extra_ms, 6), p.offload_bytes)) if fitting
            else min(plans, key=lambda p: p.predicted_peak_bytes))


def offload_greedy(ctx: PlanContext, budget: int, host_cap: int, cancel: CancelToken | None = None,
                   covering: bool = False) -> Plan | None:
    """μ-TWO's Algorithm B with both branches: keep, recompute or offload, under ``budget`` and ``host_cap`` bytes
    of host memory (None if it offloads nothing).

    Each step compares the best swap candidate with the best recompute candidate and takes the cheaper; ties go
    to the swap, which costs no compute. The swap candidate is the activation with the largest inactive time
    among those whose time between last forward and first backward use spans the current peak (others cannot
    lower it) and whose bytes fit the host memory left; with ``covering``, only those whose copies, as
    scheduled, take it off the device at the peak (a slow link, or a replay that reads it early, narrows that
    window). It is priced at the time it adds to the simulated step, its stalls and the host's calls issuing it
    (:mod:`acstudio.simulate.offload`). The recompute candidate is the largest recompute ratio, priced at its
    total recompute time (Alg D); picks keep Alg E/F's bookkeeping (:class:`_Greedy`). A replay may read an
    offloaded activation: it is brought back before that replay (how block checkpointing with offloaded inputs
    runs). The loop stops when the peak fits or neither branch has a candidate. The plan is then priced in both
    replay modes that can offload, and the faster that fits is kept.
    """
    sim, rg = ctx.sim, ctx.rg
    g = _Greedy(ctx)
    inactive = np.array([a.inactive_time_ms for a in ctx.profile.activations])
    swaps = sorted(np.flatnonzero(sim.offload_facts.offloadable).tolist(),
                   key=lambda k: (-inactive[k], -rg.bytes[k], k))
    offloaded: list[int] = []
    tried: set[int] = set()
    host_left = host_cap
    peak, pos, _, schedule = _with_offload(g, offloaded)
    while peak > budget:
        check(cancel)
        swap = next((k for k in swaps if k not in tried and not g.mask[k] and rg.bytes[k] <= host_left
                     and rg.last_fw[k] < pos < rg.first_bw[k]), None)
        recompute = _best_recompute(g)
        if swap is None and recompute is None:
            break
        swap_cost = np.inf
        if swap is not None:
            trial = _with_offload(g, [*offloaded, swap])
            if covering and not _off_device_at(trial[3], swap, pos):  # as its copies are scheduled, still there
                tried.add(swap)
                continue
            swap_cost = trial[3].extra_ms - schedule.extra_ms
        if recompute is None or swap_cost <= g.time[recompute] * (1 + g.n_dep[recompute]):
            offloaded.append(swap)
            tried.add(swap)
            host_left -= int(rg.bytes[swap])
            if swap in g.slot:  # an offloaded activation is no longer a recompute candidate
                g.ratio[g.slot[swap]] = -np.inf
            peak, pos, _, schedule = trial
            continue
        g.pick()
        peak, pos, _, schedule = _with_offload(g, offloaded)
    if not offloaded:
        return None
    return _priced(ctx, [budget], list(g.pick_ratio), offloaded, g.pick_ratio)[0]


def offload_onto(ctx: PlanContext, budgets: list[int], host_cap: int, recomputed: list[int], later: list[int],
                 cancel: CancelToken | None = None, mode: str = "again") -> list[Plan]:
    """Offload on top of a recompute plan, for each of ``budgets``: start from activation indices ``recomputed`` (a
    prefix of the trajectory's picks) and take swaps until the peak fits the budget; where no swap is left at the
    peak, recompute the first of ``later`` (the trajectory's next picks) that is in memory there, and go on. The
    plans of the budgets where it offloads something, loosest first (a budget it never fits gets the plan of the
    lowest peak it reached: a recomputation can raise the peak).

    One pass serves every budget: no step depends on the budget, so the pass for the tightest one goes through
    each looser budget's answer, the state where the peak first fits it.

    A swap candidate is, by largest inactive time, an activation not recomputed whose bytes fit the host memory
    left, and whose copies, as scheduled, take it off the device at the current peak; replays may read it (it is
    brought back before them). Replays run in ``mode`` while planning (μ-TWO's by default; block checkpointing's
    set plans in the shared mode it runs in); the result is priced in both replay modes that can offload and the
    faster that fits is kept."""
    sim, rg = ctx.sim, ctx.rg
    mode = get_mode(mode)
    recomputed, later = list(recomputed), list(later)
    inactive = np.array([a.inactive_time_ms for a in ctx.profile.activations])
    swaps = sorted(np.flatnonzero(sim.offload_facts.offloadable).tolist(),
                   key=lambda k: (-inactive[k], -rg.bytes[k], k))

    def evaluate(offloaded: list[int]):
        offload = mode.offload(sim, replayed, offloaded)
        return (*mode.evaluate_with(sim, replayed, offload)[:2], offload)

    replayed = mode.schedule(sim, recomputed)
    offloaded: list[int] = []
    peak, pos, _ = evaluate(offloaded)
    tried = set(recomputed)
    host_left = host_cap
    pending = sorted({int(b) for b in budgets}, reverse=True)
    answers: list[tuple[list[int], list[int], list[int]]] = []  # (the budgets it answers, recomputed, offloaded)
    lowest = (peak, [], [])  # the lowest peak reached with something offloaded, and how
    while pending:
        if offloaded and peak < lowest[0]:
            lowest = (peak, list(recomputed), list(offloaded))
        fits = [b for b in pending if peak <= b]  # the loosest ones: budgets fall
        if fits:
            del pending[:len(fits)]
            if offloaded:
                answers.append((fits, list(recomputed), list(offloaded)))
            continue
        check(cancel)
        swap = next((k for k in swaps if k not in tried and rg.bytes[k] <= host_left
                     and rg.last_fw[k] < pos < rg.first_bw[k]), None)
        if swap is not None:
            tried.add(swap)
            trial = evaluate([*offloaded, swap])
            if _off_device_at(trial[2], swap, pos):
                offloaded.append(swap)
                host_left -= int(rg.bytes[swap])
                peak, pos, _ = trial
            continue
        more = next((k for k in later if k not in offloaded and rg.last_fw[k] < pos < rg.first_bw[k]), None)
        if more is None:
            if lowest[2]:
                answers.append((pending, *lowest[1:]))
            break
        later.remove(more)
        recomputed.append(more)
        tried.add(more)
        replayed = mode.schedule(sim, recomputed)
        peak, pos, _ = evaluate(offloaded)
    return [plan for answered, rec, off in answers for plan in _priced(ctx, answered, rec, off)]


# The offload preview: the budgets it plans for, evenly from the baseline peak down to the floor, and how many of the
# recompute-only trajectory's plans offload_onto starts from, at budgets evenly from the baseline peak (no
# recomputation) towards the floor: a cheaper pass than offload_plan's, which the resting plan still makes. Each
# start answers every budget below its own peak in one pass. Starts near the baseline matter most near the floor,
# where offloading what replays read wins.
OFFLOAD_PREVIEW_BUDGETS = 32
OFFLOAD_PREVIEW_STARTS = 9


@dataclass
class OffloadPreview:
    """Plans that offload, made once per profile, so that a budget slider looks the fastest one that fits up
    instead of planning: a plan's predicted peak is all a budget asks of it, so a plan made for a tighter budget
    answers every looser one."""

    plans: list[Plan]  # the Pareto front: peaks rising, extra time falling

    def __post_init__(self) -> None:
        self._peaks = [p.predicted_peak_bytes for p in self.plans]  # a slider step only bisects them

    def plan_for_budget(self, budget_bytes: int) -> Plan | None:
        """The fastest plan whose predicted peak fits ``budget_bytes``, judged against it (None if none fits)."""
        i = bisect.bisect_right(self._peaks, budget_bytes)
        return _judged(self.plans[i - 1], budget_bytes) if i else None


def offload_preview(ctx: PlanContext, progress: ProgressFn | None = None, cancel: CancelToken | None = None,
                    budgets: int = OFFLOAD_PREVIEW_BUDGETS, starts: int = OFFLOAD_PREVIEW_STARTS
                    ) -> OffloadPreview | None:
    """Plans that offload at ``budgets`` budgets from the baseline peak down to the floor (None where the context
    does not offload): :func:`offload_onto` from ``starts`` of the recompute-only trajectory's plans, each pass
    answering every budget below its start's peak, each plan priced exactly; the Pareto front of all of them, by
    their own peaks (a plan that misses its budget still answers a looser one). :func:`offload_greedy`'s plans are
    left out: on the bundled transformer samples they never joined that front, and they cost as much again."""
    if not ctx.may_offload:
        return None
    path = trajectory(ctx, cancel=cancel)
    floor, top = ctx.floor_bytes, ctx.sim.baseline_peak
    # the floor itself is a budget: below the lowest one planned, the preview has nothing but recompute-only plans
    targets = np.linspace(top, floor, budgets)[1:].astype(np.int64).tolist()
    steps = {path.step_for_budget(int(b)) for b in np.linspace(top, floor, starts)}
    steps = sorted(len(path._picks) if j is None else j for j in steps)
    found: list[Plan] = []
    for i, j in enumerate(steps):
        check(cancel)
        report(progress, i, len(steps) + 1, f"offload preview: offloading onto {j} recomputations")
        found += offload_onto(ctx, targets, ctx.host_memory, path._picks[:j], path._picks[j:], cancel)
    found += _onto_blocks(ctx, targets, path, cancel)
    report(progress, len(steps) + 1, len(steps) + 1, "offload preview: done")
    return OffloadPreview(pareto_front(found, key=lambda p: (p.predicted_peak_bytes, p.predicted_extra_ms)))


def _onto_blocks(ctx: PlanContext, budgets: list[int], path: Trajectory, cancel: CancelToken | None) -> list[Plan]:
    """:func:`offload_onto` from block checkpointing's set, planned as it runs (each block replayed once): block
    checkpointing with its inputs on the host, which fits where the loss's backward sets the floor (GPT-2's
    logits) and μ-TWO's starts only fit by replaying chains over and over."""
    blocks = per_module(ctx)
    if not blocks:
        return []
    chosen = set(blocks)
    return offload_onto(ctx, budgets, ctx.host_memory, blocks, [k for k in path._picks if k not in chosen], cancel,
                        mode="shared")


def pareto_front(points: list, key=lambda p: (p[0], p[1])) -> list:
    """The points that no other point beats in both peak and extra time (``key``: a point's (peak, extra time)),
    by increasing peak."""
    front = []
    for p in sorted(points, key=key):
        if not front or key(p)[1] < key(front[-1])[1]:
            front.append(p)
    return front


def _priced(ctx: PlanContext, budgets: list[int], recomputed: list[int], offloaded: list[int],
            ratios: dict[int, float] | None = None) -> list[Plan]:
    """The plan of ``recomputed`` and ``offloaded`` for each of ``budgets``, in the faster replay mode that fits it
    (else the lower peak); each mode is simulated once, whatever the budgets."""
    modes = [ctx.plan_for_set(NAME, budgets[0], recomputed, mode=mode, ratios=ratios, offloaded=offloaded)
             for mode in ("again", "shared")]
    priced = []
    for budget in budgets:
        plans = [_judged(p, budget) for p in modes]
        fitting = [p for p in plans if p.feasible]
        priced.append(min(fitting, key=lambda p: p.predicted_extra_ms) if fitting
                      else min(plans, key=lambda p: p.predicted_peak_bytes))
    return priced


def _judged(plan: Plan, budget: int) -> Plan:
    """``plan``, which offloads, judged against ``budget``: whether it fits, and a stop reason saying what it
    moves."""
    feasible = plan.predicted_peak_bytes <= budget
    hidden = "copies hidden" if plan.copies_hidden else f"copies stall {plan.offload_stall_ms:.2f} ms"
    reason = BUDGET_MET if feasible else "budget not met"
    return dataclasses.replace(plan, budget_bytes=int(budget), feasible=feasible,
                               stop_reason=f"{reason}: {len(plan.offloaded)} activations offloaded "
                                           f"({format_bytes(plan.offload_bytes)} each way, {hidden})")


def _best_recompute(g: _Greedy) -> int | None:
    """The recompute candidate μ-TWO picks next (the one :meth:`_Greedy.pick` takes)."""
    i = int(np.argmax(g.ratio)) if g.ratio.size else -1
    return None if i < 0 or g.ratio[i] == -np.inf else g.order[i]


def _off_device_at(schedule, k: int, pos: int) -> bool:
    """Whether offloaded activation ``k`` is off the device at node ``pos`` in ``schedule``."""
    j = np.flatnonzero(schedule.offloaded == k)
    return bool(j.size) and bool(schedule.release[j[0]] <= pos < schedule.prefetch[j[0]])


def _with_offload(g: _Greedy, offloaded: list[int]):
    """(peak, position, during a replay, offload schedule) of the greedy's recompute set with ``offloaded``."""
    sim, rg = g.ctx.sim, g.rg
    replays = [Replay(int(rg.first_bw[k]), (int(k),), (), tuple(g.sources[k]), (), g.nodes[k], float(g.time[k]), 0)
               for k in np.flatnonzero(g.mask)]
    schedule = offload_schedule(sim, offloaded, replays)
    node, between = schedule.memory(sim)
    peak, pos, before = sim.peak_of(g.state.acts_node + node, g.state.acts_between + between, g.mask,
                                    g.state.transient)
    return peak, pos, before, schedule


# -- the solver --------------------------------------------------------------------------------------------------

NAME = "mutwo"  # the app's quick answer and main curve are this solver's plans, read off its trajectory


def trajectory(ctx: PlanContext, progress: ProgressFn | None = None, cancel: CancelToken | None = None
               ) -> Trajectory:
    """μ-TWO's whole greedy run for ``ctx``, computed once and cached on it."""
    if NAME not in ctx.cache:
        ctx.cache[NAME] = run_trajectory(ctx, progress=progress, cancel=cancel)
    return ctx.cache[NAME]


def mutwo_curve(ctx: PlanContext, progress: ProgressFn | None = None, cancel: CancelToken | None = None
                ) -> list[CurvePoint]:
    """Every step of the trajectory that lowers the peak, replaying chains again."""
    points: list[CurvePoint] = []
    for j, step in enumerate(trajectory(ctx, progress, cancel).steps):
        if not points or step.simulated_peak_bytes < points[-1].peak_bytes:
            points.append(CurvePoint(step.simulated_peak_bytes, step.extra_ms, j, "again"))
    return points


@solver(NAME, "μ-TWO's greedy, replaying chains again or as shared chains, whichever is faster, and offloading "
              "to host memory where that is cheaper", curve=mutwo_curve, instant=True, auto_order=0,
        kept_reason="kept: the budget was met before μ-TWO reached it")
def solve_mutwo(ctx: PlanContext, budget: int, *, cancel: CancelToken | None = None) -> Plan:
    if ctx.sim.baseline_peak <= budget:
        return ctx.plan_for_set(NAME, budget, [], BASELINE_FITS)
    recompute_only = trajectory(ctx, cancel=cancel).best_plan_for_budget(budget)
    with_offload = offload_plan(ctx, budget, cancel)
    return recompute_only if with_offload is None else best_of([recompute_only, with_offload])
