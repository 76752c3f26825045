"""Exact and bounded plans from mixed-integer programs (SciPy's HiGHS): what μ-TWO and ``auto`` are measured against.

Both programs decide ``x[k]`` = recompute candidate ``k`` (a binary per activation; the exact one, where the plan
may offload, also ``o[s]``: see *The third decision* below).

:func:`exact_recompute_set` (solver ``milp``) finds the cheapest recompute set whose *simulated* peak fits, in
μ-TWO's replay mode (``"again"``). Its objective is exactly the simulator's extra time: ``y[a, s]`` marks that
recomputing ``a`` also replays candidate ``s``'s own chain (``s`` recomputed and not resident when ``a`` is
recomputed, reached through such chains, the same expansion as :class:`~acstudio.simulate.replay.ReplayGraph`),
and ``z[a, v]`` that node ``v`` is in a's replay, so shared nodes are paid once per replay. Its memory rows start
as a relaxation, each node's measured peak less the activations freed across it. Each solution is simulated, and
at every point where it is over budget (a node, or a replay before its node) a *memory cut* is added: a linear
lower bound on that point's memory, valid for every recompute set, with what the relaxation drops —

* sources kept alive until the replays that read them (``q[a, s]``: ``a`` recomputed reads retained ``s``; a
  point between ``s``'s last use and a's replay holds ``s`` if any such ``q`` is set);
* the generator states saved for the random ops a recomputed chain replays;
* at a replay: the recomputations that run before the same node earlier, and the replay's own transient, at
  least that of its own chain and, for each chain ``y`` says it expands into, that of the two chains joined
  (a replay's high-water mark only grows with the nodes it runs: every storage lives at least as long).

Node cuts are exact; a replay cut is a bound only where the replay expands into several chains at once. Only if
the cuts leave the simulated solution in place is that one set cut off (a *no-good*) and the program solved again.

What is exact and what is a bound: the first solution that fits is optimal for the simulator's model (to HiGHS's
relative gap, ``REL_GAP``). Every program solved on the way is a relaxation, so its optimum (or HiGHS's dual
bound when the time limit stops it) is a proven lower bound on the extra time of every plan that fits in this
mode; when the time (or round) limit stops the search first, the answer is the best fitting set known (the
``incumbent`` passed in, e.g. μ-TWO's plan) with that bound. A cancel (or Ctrl-C) takes effect within
:data:`CANCEL_POLL_S`, also while HiGHS solves a program (:func:`interruptible`).

:func:`shared_bound` is a lower bound for shared-chain plans (replay mode ``"shared"``, where ``auto``'s fastest
plans usually come from). Its objective counts each recomputed activation's own chain once (``z[v] >= x[k]`` for
the nodes ``v`` of k's chain, ``sum(run_ms[v] * z[v])``): a shared replay runs every chain at least once, and more
only when a produced activation is gone again before a later replay needs it. Its memory rows are the relaxation
above, and its cuts add what shared chains bring back early: recomputing ``k`` reaches recomputed ``s`` that is
needed later (``P[k, s]``, through recomputed stops), so ``s`` is back in memory by k's first backward use. Each
solution is simulated in that mode, and the program stops when one fits (then it is a plan, at its simulated
time, and the objective a bound), when none can, or at its limits (the bound so far). Solver ``milp-bound`` takes
the smaller of the two programs' bounds, a lower bound on every plan in either mode, and returns the fastest plan
it knows (``auto``'s, ``milp``'s, the shared program's own) with it.

The third decision. Where the context offloads (:attr:`PlanContext.may_offload`), :func:`exact_recompute_set` also
decides ``o[s]`` = offload activation ``s`` to host memory, for every activation that can be offloaded
(:class:`~acstudio.simulate.offload.OffloadFacts`) and whose copies leave it a window off the device, with ``x[s] +
o[s] <= 1`` (:class:`_Copies`). An offloaded activation is absent from the device over a window estimated from the
link rate as if the link were idle: from the first node that starts once its copy out, issued after its last forward
write, has ended, to the last node before which its copy back must be issued to land by its first backward use, or
by the first replay that reads it (``y[a, p]`` of a chain that stops at it). The link is constrained so the copies
hide: the copies out whose windows begin in forward fit, back to back, between their writes and the start of
backward, and the copies back between the start of backward and their uses; their bytes fit the host-memory cap. The
objective is the recompute time plus, per offload, the most its host calls can delay the step (the stall estimate
within those constraints is zero). This is an approximation: copies queue on the link, so a window can be shorter
than estimated. Each solution is simulated exactly with its copies; where it is over budget, the windows learn the
simulated release and prefetch of its copies before the cuts are added (where the cuts change nothing, the solution
is cut off with every one of its recompute set that offloads only some of the same activations: with fewer copies
the memory is higher, exactly so without any). A solution that fits but whose copies add time (they stall, or the
host's calls issuing them delay a step the host limits) is kept at its simulated time and cut off with those of its
recompute set that offload the same and more, and returned unless a cheaper one is found. Its lower bound then holds
for the program's estimate of the copies, and for every recompute-only plan (the program without offload is a
restriction of it, and no cut removes a recompute-only plan that fits). Stopped by a limit, :func:`exact_milp`
answers with the faster of the best solution found and μ-TWO's plans, its offload plan included.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from acstudio.jobs import CancelToken, check
from acstudio.plan.model import Plan
from acstudio.plan.schedule import PlanContext
from acstudio.plan.solvers.mutwo import BASELINE_FITS, BUDGET_MET, offload_plan, trajectory
from acstudio.plan.solvers.registry import best_of, solver
from acstudio.simulate.modes import get_mode
from acstudio.simulate.replay import FORWARD_REGIONS
from acstudio.units import format_bytes

REL_GAP = 1e-6  # HiGHS's relative MIP gap: "optimal" means within this of the program's optimum
POINT_CUTS_PER_ROUND = 8  # over-budget points (of each kind) cut per round, the worst first


@dataclass(frozen=True)
class MilpResult:
    """What a program proved at one budget.

    ``chosen``: the best recompute set known that fits (activation indices; ``None``: none found), with
    ``offloaded`` (activation indices it copies to the host); ``extra_ms``: its extra time in the program's mode,
    copy stalls included; ``lower_bound_ms``: a proven lower bound on the extra time of every plan that fits (of
    plans that offload: under the program's estimate of the copies); ``optimal``: ``chosen`` is the program's
    optimum (to ``REL_GAP``); ``status``: why it stopped, in words; ``rounds``: programs solved."""

    chosen: list[int] | None
    extra_ms: float
    lower_bound_ms: float
    optimal: bool
    status: str
    rounds: int = 1
    offloaded: list[int] = field(default_factory=list)

    @property
    def gap(self) -> float:
        """Upper bound on ``chosen``'s relative distance from the optimum: ``extra / lower bound - 1``."""
        if self.chosen is None:
            return float("inf")
        if self.lower_bound_ms > 1e-12:
            return self.extra_ms / self.lower_bound_ms - 1
        return 0.0 if self.extra_ms <= 1e-12 else float("inf")


class _Program:
    """Columns and rows of a MILP built incrementally; the first ``n_int`` columns are binary, and so is every
    column added with ``binary``."""

    def __init__(self, n_int: int) -> None:
        self.binary = list(range(n_int))
        self.cost: list[float] = [0.0] * n_int
        self.upper: list[float] = [1.0] * n_int
        self.rows: list[tuple[list[int], list[float], float, float]] = []  # (columns, coefficients, lower, upper)

    def var(self, cost: float = 0.0, upper: float = 1.0, binary: bool = False) -> int:
        self.cost.append(cost)
        self.upper.append(upper)
        if binary:
            self.binary.append(len(self.cost) - 1)
        return len(self.cost) - 1

    def row(self, cols: list[int], coefs: list[float], lower: float = -np.inf, upper: float = np.inf) -> None:
        self.rows.append((cols, coefs, lower, upper))

    def solve(self, time_limit_s: float, cancel: CancelToken | None = None):
        from scipy.optimize import Bounds, LinearConstraint, milp  # slow to import: only when a program runs
        from scipy.sparse import coo_matrix

        n = len(self.cost)
        r_idx = [r for r, (cols, _, _, _) in enumerate(self.rows) for _ in cols]
        c_idx = [c for cols, _, _, _ in self.rows for c in cols]
        vals = [v for _, coefs, _, _ in self.rows for v in coefs]
        matrix = coo_matrix((vals, (r_idx, c_idx)), shape=(len(self.rows), n)).tocsr()
        cons = LinearConstraint(matrix, [r[2] for r in self.rows], [r[3] for r in self.rows])
        integrality = np.zeros(n)
        integrality[self.binary] = 1
        return interruptible(partial(milp, np.array(self.cost), constraints=cons, integrality=integrality,
                                     bounds=Bounds(0, np.array(self.upper)),
                                     options={"time_limit": max(time_limit_s, 0.01), "mip_rel_gap": REL_GAP}),
                             cancel)


CANCEL_POLL_S = 0.05  # how often a caller waiting on HiGHS looks at its cancel token (and takes Ctrl-C)
# One program at a time, as when the caller's own thread ran it: a program whose caller was cancelled runs on to its
# time limit, and the next one waits for it (its caller stays cancellable meanwhile).
_ONE_PROGRAM = threading.Lock()


def interruptible(solve: Callable[[], Any], cancel: CancelToken | None):
    """``solve()`` (a HiGHS program) on a daemon thread, while this thread waits on it in short steps.

    HiGHS cannot be interrupted inside one program, and the thread that called it would take neither a cancel nor
    Ctrl-C (Python runs signal handlers between bytecodes) until the program's time limit. HiGHS releases the GIL
    while it solves, so the caller polls ``cancel`` and raises :class:`~acstudio.errors.Cancelled` (or
    ``KeyboardInterrupt``) at once; the abandoned program ends at its own time limit, or with the process."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        with _ONE_PROGRAM:
            if cancel is not None and cancel.cancelled:
                return  # cancelled while an earlier program ran: nobody waits for this one
            try:
                outcome["result"] = solve()
            except BaseException as exc:  # handed to the waiting caller, which raises it
                outcome["error"] = exc

    worker = threading.Thread(target=run, name="HiGHS", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(CANCEL_POLL_S)
        check(cancel)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def _pay_once(prog: _Program, rg, chains: dict[int, int]) -> None:
    """Objective terms for replaying the union of the own chains of ``chains`` (activation -> column that is 1
    when its chain runs): each node once. A node of one chain only is priced on that chain's column; a node that
    several chains share gets a column ``z[v] >= column`` of each."""
    users: dict[int, list[int]] = {}
    for s, column in chains.items():
        for v in rg.own[s]:
            users.setdefault(int(v), []).append(column)
    for v, columns in users.items():
        if len(columns) == 1:
            prog.cost[columns[0]] += float(rg.run_ms[v])
            continue
        z = prog.var(float(rg.run_ms[v]))
        for column in columns:
            prog.row([z, column], [1.0, -1.0], 0.0)


def _relaxed_rows(model: _LazyProgram) -> str | None:
    """Add each over-budget node's row "memory without the extras <= budget" (one per distinct set of activations
    freed or offloaded across it, the tightest kept); returns why no set can fit, if so."""
    ctx, budget, prog, col, copies = model.ctx, model.budget, model.prog, model.col, model.copies
    rg, sim = ctx.rg, ctx.sim
    mem = model.mem_peak
    cands = np.array(rg.candidates, dtype=np.int64)
    need: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
    for i in np.flatnonzero(mem > budget):
        ks = tuple(cands[(rg.last_fw[cands] < i) & (i < rg.first_bw[cands])].tolist())
        away = copies.away(i) if copies is not None else ()
        over = int(mem[i] - budget)
        if int(rg.bytes[list({*ks, *away})].sum()) < over:
            how = "recomputation" if copies is None else "recomputation and offload"
            return f"at node {sim.node_ids[i]} {how} cannot free the {over} bytes needed"
        need[ks, away] = max(need.get((ks, away), 0), over)
    for (ks, away), over in need.items():  # sum(bytes freed) >= over, scaled to 1
        cols = [col[k] for k in ks] + [copies.col[s] for s in away]
        prog.row(cols, [rg.bytes[k] / over for k in (*ks, *away)], 1.0)
    return None


class _LazyProgram:
    """A program over ``x[k]`` (and ``o[s]`` where it offloads) whose memory rows are added where a solution is over
    budget (:func:`_solve_lazily`). Subclasses add their columns and rows, and :meth:`cuts`."""

    def __init__(self, ctx: PlanContext, budget: int) -> None:
        self.ctx, self.budget = ctx, budget
        self.cands = ctx.rg.candidates
        self.col = {k: j for j, k in enumerate(self.cands)}
        self.prog = _Program(len(self.cands))
        self.mem_peak = np.array([nd.mem_peak for nd in ctx.profile.nodes], dtype=np.int64)
        self.cut_nodes: set = set()
        self.copies: _Copies | None = None
        self.stall_ms = 0.0  # what the copies of the solution :meth:`cuts` last found fitting add (stalls, host calls)

    def priced_calls_ms(self, offloaded: list[int]) -> float:
        """The host calls' cost the program's objective holds for ``offloaded`` (the simulation prices them
        exactly)."""
        return self.copies.issue_ms * len(offloaded) if self.copies is not None else 0.0

    def decode(self, x: np.ndarray) -> tuple[list[int], list[int]]:
        """The recomputed and the offloaded activations of a solution."""
        chosen = [k for k in self.cands if x[self.col[k]] > 0.5]
        if self.copies is None:
            return chosen, []
        return chosen, [s for s, o in self.copies.col.items() if x[o] > 0.5]

    def cuts(self, chosen: list[int], offloaded: list[int]) -> list[Callable[[], None]] | None:
        """``None`` if ``chosen`` (with ``offloaded``) fits once simulated, else the memory cuts not added yet at its
        over-budget points, worst first (each adds its rows when called; empty when every such point is cut
        already)."""
        raise NotImplementedError

    def no_good(self, chosen: list[int], offloaded: list[int], over_budget: bool = True) -> None:
        """Cut off this solution and, with the same recompute set, those that offload only some of the same
        activations (``over_budget``: fewer copies free less: without any, exactly as much less as the copies took
        off) or all of them and more (it stalls: more copies queue longer)."""
        inside = set(chosen)
        cols = [self.col[k] for k in self.cands]
        coefs = [-1.0 if k in inside else 1.0 for k in self.cands]
        lower = 1.0 - len(inside)
        moved = set(offloaded)
        for s, o in self.copies.col.items() if self.copies is not None else ():
            if over_budget and s not in moved:
                cols.append(o)
                coefs.append(1.0)
            elif not over_budget and s in moved:
                cols.append(o)
                coefs.append(-1.0)
                lower -= 1.0
        self.prog.row(cols, coefs, lower)


class _Copies:
    """The program's offload decision: a column ``o[s]`` per activation that can be offloaded with a window off the
    device, the windows, and the rows of the link and the host memory (see the module docstring).

    Times are the nodes' run times without replays (replays in backward only lengthen the time a copy back has,
    so a window estimated without them is never longer for that). The windows only shrink, by what simulated
    solutions show (:meth:`learn`)."""

    def __init__(self, ctx: PlanContext, prog: _Program, col: dict[int, int], chain: dict[int, dict[int, int]]) -> None:
        rg, facts = ctx.rg, ctx.sim.offload_facts
        self.rg, self.prog = rg, prog
        run = rg.run_ms
        self.start = np.cumsum(run) - run
        end = self.start + run
        self.took = ctx.profile.link.copy_ms(rg.bytes)  # ms per copy, as the simulator prices it
        ready_end = np.where(facts.ready >= 0, end[np.maximum(facts.ready, 0)], 0.0)
        self.ready_end = ready_end
        self.release = np.clip(np.searchsorted(self.start, ready_end + self.took, side="left"), rg.last_fw + 1,
                               rg.first_bw)
        self.latest = rg.first_bw.copy()  # no prefetch after this node (lowered by learn)
        self.version = 0  # counts the changes of the windows
        # The host's calls that issue an offload's copies and waits, at most what they can delay the step (where
        # the host has a lead over the device they cost less: the simulated solution says how much).
        self.issue_ms = ctx.profile.link.offload_issue_nodes * ctx.profile.node_issue_ms
        self.col = {s: prog.var(cost=self.issue_ms, binary=True) for s in np.flatnonzero(facts.offloadable).tolist()
                    if self.release[s] < self.prefetch(s, int(rg.first_bw[s]))}
        for s, o in self.col.items():
            if s in col:  # kept, recomputed or offloaded
                prog.row([col[s], o], [1.0, 1.0], upper=1.0)
        # Per offloaded s: the replays that may read it before its first backward use ((node, y[a, p]) of a chain
        # member p stopping at s; s is then back before that node).
        self.readers: dict[int, list[tuple[int, int]]] = {}
        for a, var in chain.items():
            at = int(rg.first_bw[a])
            for p, y in var.items():
                for s in rg.stops[p]:
                    if s in self.col and at < rg.first_bw[s] and (s in var or not rg.is_candidate[s]):
                        self.readers.setdefault(s, []).append((at, y))
        self.held: dict[tuple[int, tuple[int, ...]], int] = {}
        self._link_rows(ctx)
        if self.col:  # the host-memory cap
            prog.row(list(self.col.values()), [rg.bytes[s] / max(ctx.host_memory, 1) for s in self.col], upper=1.0)

    def prefetch(self, s: int, needed: int) -> int:
        """The node before which the copy back of ``s`` is issued to land by node ``needed`` on an idle link."""
        node = int(np.searchsorted(self.start, self.start[needed] - self.took[s], side="right")) - 1
        return min(max(node, int(self.release[s])), needed, int(self.latest[s]))

    def away(self, i: int) -> tuple[int, ...]:
        """Activations an offload takes off the device during node ``i`` (and just before it), read by no replay."""
        rg = self.rg
        return tuple(s for s in self.col if self.release[s] <= i < self.prefetch(s, int(rg.first_bw[s])))

    def terms(self, i: int) -> tuple[list[int], list[float]]:
        """Columns and byte coefficients of what offloads change at node ``i`` (and just before it): minus each
        offloaded activation away there, plus it again where a replay before ``i`` read it (``u >= y + o - 1``)."""
        cols, coefs = [], []
        for s in self.away(i):
            o, b = self.col[s], float(self.rg.bytes[s])
            cols.append(o)
            coefs.append(-b)
            back = tuple(sorted({y for at, y in self.readers.get(s, ()) if self.prefetch(s, at) <= i}))
            if back:
                if (s, back) not in self.held:
                    u = self.held[(s, back)] = self.prog.var()
                    for y in back:
                        self.prog.row([u, y, o], [1.0, -1.0, -1.0], -1.0)
                cols.append(self.held[(s, back)])
                coefs.append(b)
        return cols, coefs

    def learn(self, schedule) -> None:
        """Shrink the windows of a simulated solution's copies to where they ran (a queue on the link frees later
        and fetches earlier than an idle link)."""
        before = (self.release.copy(), self.latest.copy())
        for j, s in enumerate(schedule.offloaded.tolist()):
            self.release[s] = max(self.release[s], schedule.release[j])
            if not schedule.by_replay[j]:
                self.latest[s] = min(self.latest[s], schedule.prefetch[j])
        if not (np.array_equal(before[0], self.release) and np.array_equal(before[1], self.latest)):
            self.version += 1

    def _link_rows(self, ctx: PlanContext) -> None:
        """The copies hide: those out whose windows begin in forward run back to back after their writes and end
        by the start of backward; those back whose windows end in backward run from the start of backward and land
        by their first backward use. One running sum per lane, in units of the step's time."""
        rg, prog = self.rg, self.prog
        if not self.col:
            return
        regions = [nd.region for nd in ctx.profile.nodes]
        backward = next((i for i, r in enumerate(regions) if r not in FORWARD_REGIONS and i > rg.created.min()),
                        len(regions))
        t_bw = float(self.start[backward]) if backward < len(regions) else float(self.start[-1])
        unit = max(float(self.start[-1] + rg.run_ms[-1]), 1e-12)
        out = sorted((s for s in self.col if self.release[s] < backward), key=lambda s: -self.ready_end[s])
        back = sorted((s for s in self.col if self.prefetch(s, int(rg.first_bw[s])) >= backward),
                      key=lambda s: self.start[rg.first_bw[s]])
        lanes = (((s, t_bw - self.ready_end[s]) for s in out), ((s, self.start[rg.first_bw[s]] - t_bw) for s in back))
        for lane in lanes:
            total = None
            for s, room in lane:  # total >= the previous total + this copy, <= the time it has
                now = prog.var(upper=max(float(room), 0.0) / unit)
                cols, coefs = [now, self.col[s]], [1.0, -float(self.took[s]) / unit]
                if total is not None:
                    cols.append(total)
                    coefs.append(-1.0)
                prog.row(cols, coefs, 0.0)
                total = now


class _AgainProgram(_LazyProgram):
    """The program of :func:`exact_recompute_set` and its memory cuts."""

    def __init__(self, ctx: PlanContext, budget: int) -> None:
        super().__init__(ctx, budget)
        rg = ctx.rg
        self.chain: dict[int, dict[int, int]] = {}  # a -> candidate s -> column of y[a, s] (x[a] for s = a)
        for a in self.cands:
            self._add_chain(a)
        self.q: dict[tuple[int, int], int] = {}
        self.cut_replays: set[tuple[int, int]] = set()
        # Per activation s: recomputations a that may read it as a retained source after its last use, with the
        # chain members p whose stops include it ((a, [p ...]); p = a for its own chain).
        self.readers: dict[int, list[tuple[int, list[int]]]] = {}
        for a in self.cands:
            at, var = rg.first_bw[a], self.chain[a]
            via: dict[int, list[int]] = {}
            for p in var:
                for s in rg.stops[p]:
                    keepable = s in var or not rg.is_candidate[s]  # else recomputed and resident: no extension
                    if keepable and rg.last_bw[s] < at:
                        via.setdefault(s, []).append(p)
            for s, ps in via.items():
                self.readers.setdefault(s, []).append((a, ps))
        sim = ctx.sim
        none = np.zeros(len(rg.bytes), dtype=bool)
        _, self.acts_between0 = sim.activation_memory(none, np.full(len(rg.bytes), -1, dtype=np.int64))
        if ctx.may_offload:
            self.copies = _Copies(ctx, self.prog, self.col, self.chain)

    def _key(self, point: int) -> tuple[int, int]:
        """A cut's key: its point, and the copy windows it was made with (a cut made with wider ones is looser)."""
        return point, self.copies.version if self.copies is not None else 0

    def _add_chain(self, a: int) -> None:
        rg, prog, col = self.ctx.rg, self.prog, self.col
        at = rg.first_bw[a]
        # Candidates a's replay may expand into: reachable through stops that are non-resident there.
        var = {a: col[a]}
        stack = [a]
        while stack:
            p = stack.pop()
            for s in rg.stops[p]:
                if s in var or not rg.is_candidate[s] or rg.resident(s, at):
                    continue
                var[s] = prog.var()
                stack.append(s)
        for p in var:
            for s in rg.stops[p]:
                if s in var and s != a:  # y[a,s] >= y[a,p] + x[s] - 1
                    prog.row([var[s], var[p], col[s]], [1.0, -1.0, -1.0], -1.0)
        _pay_once(prog, rg, var)  # z[a,v] >= y[a,s]
        self.chain[a] = var

    def _q(self, a: int, s: int, ps: list[int]) -> int:
        """Column of q[a, s] >= "a's replay reads retained s" (y[a, p] for a member p stopping at s, s kept)."""
        if (a, s) not in self.q:
            rg, var = self.ctx.rg, self.chain[a]
            q = self.q[(a, s)] = self.prog.var()
            for p in ps:
                if rg.is_candidate[s]:
                    self.prog.row([q, var[p], self.col[s]], [1.0, -1.0, 1.0], 0.0)
                else:
                    self.prog.row([q, var[p]], [1.0, -1.0], 0.0)
        return self.q[(a, s)]

    def _extras(self, point: int, between: bool) -> tuple[list[int], list[float]]:
        """Columns and byte coefficients of what a point holds besides the relaxation: kept-alive sources and saved
        generator states. ``point`` is a node (during it) or, with ``between``, the moment just before it."""
        rg, prog = self.ctx.rg, self.prog
        cols, coefs = [], []
        for s, readers in self.readers.items():
            if not rg.last_bw[s] < point:
                continue
            # A node holds s up to the node before its latest reader; the moment before a node up to the reader.
            late = [(a, ps) for a, ps in readers if rg.first_bw[a] > point or (between and rg.first_bw[a] == point)]
            if late:
                w = prog.var()
                for a, ps in late:
                    prog.row([w, self._q(a, s, ps)], [1.0, -1.0], 0.0)
                cols.append(w)
                coefs.append(float(rg.bytes[s]))
        for j, r in enumerate(rg.rng_nodes):
            if r > point:
                continue
            owners = [a for a in self.cands if j in rg.rng_owned[a]
                      and (rg.first_bw[a] > point or (between and rg.first_bw[a] == point))]
            if owners:
                g = prog.var()
                for a in owners:
                    prog.row([g, self.col[a]], [1.0, -1.0], 0.0)
                cols.append(g)
                coefs.append(float(rg.rng_state_bytes))
        return cols, coefs

    def cut_node(self, i: int) -> None:
        """Node ``i``'s memory <= budget, exactly (given the chains y selects)."""
        rg = self.ctx.rg
        self.cut_nodes.add(self._key(i))
        ks = [k for k in self.cands if rg.last_fw[k] < i < rg.first_bw[k]]
        cols, coefs = self._extras(i, between=False)
        if self.copies is not None:
            more = self.copies.terms(i)
            cols, coefs = cols + more[0], coefs + more[1]
        cols += [self.col[k] for k in ks]
        coefs += [-float(rg.bytes[k]) for k in ks]
        self.prog.row(cols, [c / self.budget for c in coefs], upper=1.0 - self.mem_peak[i] / self.budget)

    def cut_replay(self, a: int) -> None:
        """If ``a`` is recomputed: memory during its replay <= budget (its transient bounded from below)."""
        rg, sim, prog, B = self.ctx.rg, self.ctx.sim, self.prog, self.budget
        at = int(rg.first_bw[a])
        self.cut_replays.add(self._key(a))
        const = float(sim.between[at] + self.acts_between0[at])
        ks = [k for k in self.cands if rg.last_fw[k] + 1 <= at <= rg.first_bw[k]]
        before = [b for b in self.cands if rg.first_bw[b] == at and (rg.created[b], b) < (rg.created[a], a)]
        cols, coefs = self._extras(at, between=True)
        if self.copies is not None:
            more = self.copies.terms(at)
            cols, coefs = cols + more[0], coefs + more[1]
        cols += [self.col[k] for k in ks] + [self.col[b] for b in before]
        coefs += [-float(rg.bytes[k]) for k in ks] + [float(rg.bytes[b]) for b in before]
        own = rg.own[a]
        lows = {a: rg.transient_bytes(a, own)}
        for s in self.chain[a]:
            if s != a:
                lows[s] = rg.transient_bytes(a, np.union1d(own, rg.own[s]))
        tau = prog.var(upper=max(lows.values()) / B)  # the transient, in budgets
        for s, t in lows.items():
            prog.row([tau, self.chain[a][s]], [1.0, -t / B], 0.0)
        cols.append(tau)
        scaled = [c / B for c in coefs] + [1.0]  # tau is already in budgets
        # Active only when x[a] = 1: sum <= 1 - const/B + M (1 - x[a]), M the most the left side can exceed it.
        most = const / B + sum(c for c in scaled[:-1] if c > 0) + prog.upper[tau]
        big_m = max(0.0, most - 1.0)
        prog.row([*cols, self.col[a]], [*scaled, big_m], upper=1.0 - const / B + big_m)

    def cuts(self, chosen: list[int], offloaded: list[int]) -> list[Callable[[], None]] | None:
        """Cuts at the over-budget nodes and replays (by the recomputed activation) of ``chosen`` with its copies
        (their windows first learn where the copies ran)."""
        rg, sim = self.ctx.rg, self.ctx.sim
        mode = get_mode("again")
        schedule = mode.schedule(sim, chosen)
        acts_node, acts_between = sim.activation_memory(schedule.mask, schedule.keep_until)
        offload = mode.offload(sim, schedule, offloaded)
        if offload is not None:
            away_node, away_between = offload.memory(sim)
            acts_node, acts_between = acts_node + away_node, acts_between + away_between
        node_mem = sim.base + acts_node
        replay_mem = {}
        for at in {int(rg.first_bw[a]) for a in chosen}:
            held = 0
            for a in sorted((a for a in chosen if rg.first_bw[a] == at), key=lambda a: (rg.created[a], a)):
                replay_mem[a] = int(sim.between[at] + acts_between[at] + held + schedule.transient[a])
                held += int(rg.bytes[a])
        nodes = [int(i) for i in np.argsort(-node_mem, kind="stable") if node_mem[i] > self.budget]
        replays = sorted((a for a, m in replay_mem.items() if m > self.budget), key=lambda a: -replay_mem[a])
        if not nodes and not replays:
            self.stall_ms = offload.extra_ms if offload is not None else 0.0
            return None
        if offload is not None:
            self.copies.learn(offload)
        return ([partial(self.cut_node, i) for i in nodes if self._key(i) not in self.cut_nodes][:POINT_CUTS_PER_ROUND]
                + [partial(self.cut_replay, a) for a in replays
                   if self._key(a) not in self.cut_replays][:POINT_CUTS_PER_ROUND])


@dataclass
class _Outcome:
    chosen: list[int] | None  # the best solution that fits (if "optimal": the program's optimum)
    objective: float  # its simulated extra time, copy stalls included
    lower: float  # proven lower bound on the program's optimum over sets that fit
    rounds: int
    how: str  # "optimal", "infeasible", "time limit (N s)" or "round limit (N)"
    offloaded: list[int] = field(default_factory=list)  # what the solution offloads


def _solve_lazily(model, time_limit_s: float, max_rounds: int, cancel: CancelToken | None) -> _Outcome:
    """Solve ``model``'s program, add its memory cuts where the solution is over budget, and again, until a
    solution fits, none can, or a limit stops it. Every program solved is a relaxation of "fits", so its optimum
    (HiGHS's dual bound when stopped by time) is a lower bound.

    A solution that fits but whose copies stall costs more than its objective: it is kept at its simulated time
    and cut off, and the search goes on until no solution left can be cheaper (the programs' optimum reaches its
    time), so the answer is the cheapest either way. When the time limit stops a program, the best solution HiGHS
    has found is kept too if it fits."""
    start = time.perf_counter()
    lower = 0.0
    known: _Outcome | None = None  # the cheapest solution found that fits, not yet proven optimal

    def stop(rounds: int, how: str) -> _Outcome:
        if known is None:
            return _Outcome(None, 0.0, lower, rounds, how)
        return dataclasses.replace(known, lower=min(lower, known.objective), rounds=rounds, how=how)

    def fitting(res, rounds: int, chosen: list[int], offloaded: list[int]) -> list[Callable[[], None]] | None:
        """The cuts of the program's solution; keeps it in ``known`` if it fits and is the cheapest so far."""
        nonlocal known
        cuts = model.cuts(chosen, offloaded)
        if cuts is None:
            extra = float(res.fun) - model.priced_calls_ms(offloaded) + model.stall_ms
            if known is None or extra < known.objective:
                known = _Outcome(chosen, extra, lower, rounds, "optimal", offloaded)
        return cuts

    for rounds in range(1, max_rounds + 1):
        check(cancel)
        res = model.prog.solve(time_limit_s - (time.perf_counter() - start), cancel)
        if res.status == 2:
            if known is not None:  # nothing else fits: the cheapest that stalled is the optimum
                return stop(rounds, "optimal")
            return _Outcome(None, 0.0, float("inf"), rounds, "infeasible")
        if res.status != 0 or res.x is None:
            bound = getattr(res, "mip_dual_bound", None)
            if bound is not None and np.isfinite(bound):
                lower = max(lower, float(bound))
            if res.x is not None:
                fitting(res, rounds, *model.decode(res.x))
            return stop(rounds, f"time limit ({time_limit_s:.0f} s)")
        bound = getattr(res, "mip_dual_bound", None)  # at most the optimum (equal to REL_GAP)
        lower = max(lower, float(bound) if bound is not None and np.isfinite(bound) else float(res.fun))
        if known is not None and res.fun >= known.objective * (1 - REL_GAP):
            return stop(rounds, "optimal")
        chosen, offloaded = model.decode(res.x)
        cuts = fitting(res, rounds, chosen, offloaded)
        if cuts is None and model.stall_ms <= 0.0:
            return _Outcome(chosen, float(res.fun) - model.priced_calls_ms(offloaded), lower, rounds, "optimal",
                            offloaded)
        for cut in cuts or ():
            cut()
        if not cuts:  # it stalls, or the cuts bound its memory too low: cut the solution itself
            model.no_good(chosen, offloaded, over_budget=cuts is not None)
        if time.perf_counter() - start > time_limit_s:
            return stop(rounds, f"time limit ({time_limit_s:.0f} s)")
    return stop(max_rounds, f"round limit ({max_rounds})")


def exact_recompute_set(ctx: PlanContext, budget: int, *, time_limit_s: float = 60.0, max_rounds: int = 200,
                        incumbent: list[int] | None = None, incumbent_offloaded: list[int] | None = None,
                        cancel: CancelToken | None = None) -> MilpResult:
    """The optimal recompute set for ``budget`` in replay mode "again" (where the context offloads, with what to
    offload: see the module docstring), or, when ``time_limit_s`` or ``max_rounds`` stops the search, the cheaper
    of the best solution found and ``incumbent`` (a recompute set that fits, if any, with the activations
    ``incumbent_offloaded`` it offloads) with a proven lower bound."""
    sim = ctx.sim
    model = _AgainProgram(ctx, budget)
    why = _relaxed_rows(model)
    if why is not None:
        return MilpResult(None, 0.0, float("inf"), False, why, 0)
    out = _solve_lazily(model, time_limit_s, max_rounds, cancel)
    estimated = "" if model.copies is None else ", copies as estimated"
    if out.how == "optimal":
        offloaded, extra = _fewest_copies(ctx, budget, out.chosen, out.offloaded, out.objective)
        return MilpResult(out.chosen, extra, out.lower, True, f"optimal{estimated}", out.rounds, offloaded)
    if out.how == "infeasible":
        what = "recompute set" if model.copies is None else "recompute set, with or without offload,"
        return MilpResult(None, 0.0, float("inf"), False, f"MILP infeasible: no {what} fits", out.rounds)
    known = []  # (extra ms, recomputed, offloaded) of the solutions that fit
    if out.chosen is not None:
        offloaded, extra = _fewest_copies(ctx, budget, out.chosen, out.offloaded, out.objective)
        known.append((extra, out.chosen, offloaded))
    if incumbent is not None:
        peak, _, extra = get_mode("again").peak(sim, incumbent, incumbent_offloaded or [])
        if peak <= budget:
            known.append((extra, incumbent, list(incumbent_offloaded or [])))
    if not known:
        return MilpResult(None, 0.0, out.lower, False, f"{out.how}: no fitting set found", out.rounds)
    extra, chosen, offloaded = min(known, key=lambda t: t[0])
    status = (f"{out.how}: the {'incumbent' if chosen is incumbent else 'best solution'} is within "
              f"{extra / out.lower - 1:.1%} of the optimum{estimated}") if out.lower else out.how
    return MilpResult(chosen, extra, out.lower, extra <= out.lower * (1 + REL_GAP), status, out.rounds, offloaded)


def _fewest_copies(ctx: PlanContext, budget: int, chosen: list[int], offloaded: list[int], extra: float
                   ) -> tuple[list[int], float]:
    """``offloaded`` less every copy the plan does without (largest first: a copy that saves nothing only uses
    the link and the host), and the plan's simulated extra time. A column that frees no over-budget point costs
    the program nothing, so its solver may set it."""
    if not offloaded:
        return [], extra
    mode, sim = get_mode("again"), ctx.sim
    schedule = mode.schedule(sim, chosen)

    def priced(off: list[int]) -> tuple[int, float]:
        copies = mode.offload(sim, schedule, off)
        return mode.evaluate_with(sim, schedule, copies)[0], schedule.extra_ms + (copies.stall_ms if copies else 0.0)

    kept = list(offloaded)
    extra = priced(kept)[1]
    for s in sorted(offloaded, key=lambda s: (-ctx.rg.bytes[s], s)):
        trial = [k for k in kept if k != s]
        peak, trial_extra = priced(trial)
        if peak <= budget and trial_extra <= extra + 1e-9:
            kept, extra = trial, trial_extra
    return kept, extra


class _SharedBound(_LazyProgram):
    """The program of :func:`shared_bound`."""

    def __init__(self, ctx: PlanContext, budget: int) -> None:
        super().__init__(ctx, budget)
        _pay_once(self.prog, ctx.rg, self.col)  # z[v] >= x[k]
        self.early: dict[int, dict[int, int]] = {}  # k -> s -> column of "s is back by k's first backward use"

    def _early(self, k: int) -> dict[int, int]:
        """P[k, s] >= "recomputing k reaches recomputed s, needed later, through recomputed stops" (then s is
        back in memory by k's first backward use: produced by that replay or an earlier one)."""
        if k not in self.early:
            rg, prog, col = self.ctx.rg, self.prog, self.col
            reach = {k: col[k]}
            stack = [k]
            while stack:
                p = stack.pop()
                for s in rg.stops[p]:
                    if not rg.is_candidate[s] or rg.first_bw[s] <= rg.first_bw[k]:
                        continue
                    if s not in reach:
                        reach[s] = prog.var()
                        stack.append(s)
                    prog.row([reach[s], reach[p], col[s]], [1.0, -1.0, -1.0], -1.0)  # P[k,s] >= P[k,p] + x[s] - 1
            del reach[k]
            self.early[k] = reach
        return self.early[k]

    def cut_node(self, i: int) -> None:
        """Node ``i``'s memory <= budget, with the recomputed activations shared chains bring back early."""
        rg, prog = self.ctx.rg, self.prog
        self.cut_nodes.add(i)
        cols, coefs = [], []
        for k in self.cands:
            if rg.last_fw[k] < i < rg.first_bw[k]:
                cols.append(self.col[k])
                coefs.append(-float(rg.bytes[k]))
        held: dict[int, list[int]] = {}
        for k in self.cands:
            if rg.first_bw[k] <= i:
                for s, p in self._early(k).items():
                    if rg.last_fw[s] < i < rg.first_bw[s]:
                        held.setdefault(s, []).append(p)
        for s, ps in held.items():
            w = prog.var()
            for p in ps:
                prog.row([w, p], [1.0, -1.0], 0.0)
            cols.append(w)
            coefs.append(float(rg.bytes[s]))
        prog.row(cols, [c / self.budget for c in coefs], upper=1.0 - self.mem_peak[i] / self.budget)

    def cuts(self, chosen: list[int], offloaded: list[int]) -> list[Callable[[], None]] | None:
        sim = self.ctx.sim
        mode = get_mode("shared")
        schedule = mode.schedule(sim, chosen)
        if mode.evaluate(sim, schedule)[0] <= self.budget:
            return None
        acts_node, _ = sim.activation_memory(schedule.back >= 0, schedule.keep_until, schedule.back)
        node_mem = sim.base + acts_node
        over = [int(i) for i in np.argsort(-node_mem, kind="stable") if node_mem[i] > self.budget]
        return [partial(self.cut_node, i) for i in over if i not in self.cut_nodes][:POINT_CUTS_PER_ROUND]


def shared_bound(ctx: PlanContext, budget: int, *, time_limit_s: float = 30.0, max_rounds: int = 30,
                 cancel: CancelToken | None = None) -> MilpResult:
    """A lower bound on the extra time of every plan that fits ``budget`` in replay mode "shared", and the set
    that attains it once it fits there (``chosen``, priced in that mode; ``None`` if stopped first)."""
    model = _SharedBound(ctx, budget)
    why = _relaxed_rows(model)
    if why is not None:
        return MilpResult(None, 0.0, float("inf"), False, why, 0)
    out = _solve_lazily(model, time_limit_s, max_rounds, cancel)
    if out.chosen is None:
        return MilpResult(None, 0.0, out.lower, False, out.how, out.rounds)
    extra = get_mode("shared").peak(ctx.sim, out.chosen)[2]
    return MilpResult(out.chosen, extra, out.lower, extra <= out.lower * (1 + REL_GAP), out.how, out.rounds)


# -- the solver --------------------------------------------------------------------------------------------------

NAME = "milp"
# Time limits of the programs: a plan asked for on its own, and each point of a sweep. Sweeps (the app's Pareto
# chart runs one in the background) and auto leave the programs out past BERT-size graphs: ResNet-152 takes
# minutes.
MILP_TIME_LIMIT_S = 60.0
SWEEP_MILP_TIME_LIMIT_S = 20.0
PROGRAM_MAX_CANDIDATES = 400


def exact_milp(ctx: PlanContext, budget: int, time_limit_s: float = MILP_TIME_LIMIT_S,
               cancel: CancelToken | None = None) -> MilpResult:
    """:func:`exact_recompute_set` with μ-TWO's plan as the incumbent (what it answers with, and a bound on, if
    the time limit stops it first): its recompute-only plan, or where the context offloads the faster of that and
    its offload plan run in μ-TWO's replay mode."""
    known = [trajectory(ctx, cancel=cancel).plan_for_budget(budget)]
    moved = offload_plan(ctx, budget, cancel)
    if moved is not None:
        known.append(ctx.plan_for_set(NAME, budget, ctx.sim.indices(moved.recomputed),
                                      offloaded=[ctx.rg.act_index[a] for a in moved.offloaded]))
    mu = best_of(known)
    incumbent = [ctx.rg.act_index[a] for a in mu.recomputed] if mu.feasible else None
    return exact_recompute_set(ctx, budget, time_limit_s=time_limit_s, incumbent=incumbent,
                               incumbent_offloaded=[ctx.rg.act_index[a] for a in mu.offloaded], cancel=cancel)


@solver(NAME, "exact optimum under μ-TWO's replay model, keeping, recomputing or offloading to host memory; past its "
              "time limit the best plan found or μ-TWO's, with a proven bound", exact=True)
def solve_milp(ctx: PlanContext, budget: int, *, cancel: CancelToken | None = None) -> Plan:
    return milp_plan(ctx, budget, exact_milp(ctx, budget, cancel=cancel))


def milp_plan(ctx: PlanContext, budget: int, result: MilpResult) -> Plan:
    """The plan of a :class:`MilpResult`; its reason says how it stopped and the bound, and what it offloads."""
    if result.chosen is None:
        return ctx.plan_for_set(NAME, budget, [], f"no recompute set fits: {result.status}")
    if not result.chosen and not result.offloaded:
        return ctx.plan_for_set(NAME, budget, [], BASELINE_FITS)
    plan = ctx.plan_for_set(NAME, budget, result.chosen, offloaded=result.offloaded)
    reason = f"{BUDGET_MET if plan.feasible else 'budget not met'} ({result.status}; lower bound " \
             f"{result.lower_bound_ms:.3f} ms)"
    if plan.offloaded:
        hidden = "copies hidden" if plan.copies_hidden else f"copies stall {plan.offload_stall_ms:.2f} ms"
        reason += (f": {len(plan.offloaded)} activations offloaded ({format_bytes(plan.offload_bytes)} each way, "
                   f"{hidden})")
    return dataclasses.replace(plan, stop_reason=reason)
