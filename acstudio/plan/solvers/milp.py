"""Exact and bounded plans from mixed-integer programs (SciPy's HiGHS): what μ-TWO and ``auto`` are measured against.

Both programs decide ``x[k]`` = recompute candidate ``k`` (a binary per activation, see *The decision* below).

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

The decision. Today a plan's decision per activation is binary (recomputed or kept: ``Plan.recomputed``). A
third decision, offload to the CPU, enters here as a second binary ``o[k]`` with ``x[k] + o[k] <= 1``: in the
memory rows it frees the same gap as ``x[k]`` (less the prefetch window before ``first_bw``, a new term like the
kept-alive sources), in the objective it costs the transfer time not hidden by compute (a new row per stream),
and in :class:`~acstudio.plan.model.Plan` it becomes a per-activation enum (keep / recompute / offload) whose
default "recompute" reads today's files unchanged.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from acstudio.jobs import CancelToken, check
from acstudio.plan.model import Plan
from acstudio.plan.schedule import PlanContext
from acstudio.plan.solvers.mutwo import BASELINE_FITS, BUDGET_MET, trajectory
from acstudio.plan.solvers.registry import solver
from acstudio.simulate.modes import get_mode

REL_GAP = 1e-6  # HiGHS's relative MIP gap: "optimal" means within this of the program's optimum
POINT_CUTS_PER_ROUND = 8  # over-budget points (of each kind) cut per round, the worst first


@dataclass(frozen=True)
class MilpResult:
    """What a program proved at one budget.

    ``chosen``: the best recompute set known that fits (activation indices; ``None``: none found);
    ``extra_ms``: its extra time in the program's mode; ``lower_bound_ms``: a proven lower bound on the extra time
    of every plan that fits; ``optimal``: ``chosen`` is the program's optimum (to ``REL_GAP``); ``status``: why it
    stopped, in words; ``rounds``: programs solved."""

    chosen: list[int] | None
    extra_ms: float
    lower_bound_ms: float
    optimal: bool
    status: str
    rounds: int = 1

    @property
    def gap(self) -> float:
        """Upper bound on ``chosen``'s relative distance from the optimum: ``extra / lower bound - 1``."""
        if self.chosen is None:
            return float("inf")
        if self.lower_bound_ms > 1e-12:
            return self.extra_ms / self.lower_bound_ms - 1
        return 0.0 if self.extra_ms <= 1e-12 else float("inf")


class _Program:
    """Columns and rows of a MILP built incrementally; the first ``n_int`` columns are binary."""

    def __init__(self, n_int: int) -> None:
        self.n_int = n_int
        self.cost: list[float] = [0.0] * n_int
        self.upper: list[float] = [1.0] * n_int
        self.rows: list[tuple[list[int], list[float], float, float]] = []  # (columns, coefficients, lower, upper)

    def var(self, cost: float = 0.0, upper: float = 1.0) -> int:
        self.cost.append(cost)
        self.upper.append(upper)
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
        integrality[:self.n_int] = 1
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


def _relaxed_rows(ctx: PlanContext, budget: int, prog: _Program, col: dict[int, int]) -> str | None:
    """Add each over-budget node's row "memory without the extras <= budget" (one per distinct set of activations
    freed across it, the tightest kept); returns why no set can fit, if so."""
    rg, sim = ctx.rg, ctx.sim
    mem = np.array([nd.mem_peak for nd in ctx.profile.nodes], dtype=np.int64)
    cands = np.array(rg.candidates, dtype=np.int64)
    need: dict[tuple[int, ...], int] = {}
    for i in np.flatnonzero(mem > budget):
        ks = tuple(cands[(rg.last_fw[cands] < i) & (i < rg.first_bw[cands])].tolist())
        over = int(mem[i] - budget)
        if int(rg.bytes[list(ks)].sum()) < over:
            return f"at node {sim.node_ids[i]} recomputation cannot free the {over} bytes needed"
        need[ks] = max(need.get(ks, 0), over)
    for ks, over in need.items():  # sum(bytes freed) >= over, scaled to 1
        prog.row([col[k] for k in ks], [rg.bytes[k] / over for k in ks], 1.0)
    return None


class _LazyProgram:
    """A program over ``x[k]`` whose memory rows are added where a solution is over budget (:func:`_solve_lazily`).
    Subclasses add their columns and rows, and :meth:`cuts`."""

    def __init__(self, ctx: PlanContext, budget: int) -> None:
        self.ctx, self.budget = ctx, budget
        self.cands = ctx.rg.candidates
        self.col = {k: j for j, k in enumerate(self.cands)}
        self.prog = _Program(len(self.cands))
        self.mem_peak = np.array([nd.mem_peak for nd in ctx.profile.nodes], dtype=np.int64)
        self.cut_nodes: set[int] = set()

    def cuts(self, chosen: list[int]) -> list[Callable[[], None]] | None:
        """``None`` if ``chosen`` fits once simulated, else the memory cuts not added yet at its over-budget points,
        worst first (each adds its rows when called; empty when every such point is cut already)."""
        raise NotImplementedError

    def no_good(self, chosen: list[int]) -> None:
        """Cut off exactly this set."""
        inside = set(chosen)
        self.prog.row([self.col[k] for k in self.cands], [-1.0 if k in inside else 1.0 for k in self.cands],
                      1.0 - len(inside))


class _AgainProgram(_LazyProgram):
    """The program of :func:`exact_recompute_set` and its memory cuts."""

    def __init__(self, ctx: PlanContext, budget: int) -> None:
        super().__init__(ctx, budget)
        rg = ctx.rg
        self.chain: dict[int, dict[int, int]] = {}  # a -> candidate s -> column of y[a, s] (x[a] for s = a)
        for a in self.cands:
            self._add_chain(a)
        self.q: dict[tuple[int, int], int] = {}
        self.cut_replays: set[int] = set()
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
        self.cut_nodes.add(i)
        ks = [k for k in self.cands if rg.last_fw[k] < i < rg.first_bw[k]]
        cols, coefs = self._extras(i, between=False)
        cols += [self.col[k] for k in ks]
        coefs += [-float(rg.bytes[k]) for k in ks]
        self.prog.row(cols, [c / self.budget for c in coefs], upper=1.0 - self.mem_peak[i] / self.budget)

    def cut_replay(self, a: int) -> None:
        """If ``a`` is recomputed: memory during its replay <= budget (its transient bounded from below)."""
        rg, sim, prog, B = self.ctx.rg, self.ctx.sim, self.prog, self.budget
        self.cut_replays.add(a)
        at = int(rg.first_bw[a])
        const = float(sim.between[at] + self.acts_between0[at])
        ks = [k for k in self.cands if rg.last_fw[k] + 1 <= at <= rg.first_bw[k]]
        before = [b for b in self.cands if rg.first_bw[b] == at and (rg.created[b], b) < (rg.created[a], a)]
        cols, coefs = self._extras(at, between=True)
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

    def cuts(self, chosen: list[int]) -> list[Callable[[], None]] | None:
        """Cuts at the over-budget nodes and replays (by the recomputed activation) of ``chosen``."""
        rg, sim = self.ctx.rg, self.ctx.sim
        _, keep_until, transient = sim.schedule_facts(chosen)
        mask = np.zeros(len(rg.bytes), dtype=bool)
        mask[chosen] = True
        acts_node, acts_between = sim.activation_memory(mask, keep_until)
        node_mem = sim.base + acts_node
        replay_mem = {}
        for at in {int(rg.first_bw[a]) for a in chosen}:
            held = 0
            for a in sorted((a for a in chosen if rg.first_bw[a] == at), key=lambda a: (rg.created[a], a)):
                replay_mem[a] = int(sim.between[at] + acts_between[at] + held + transient[a])
                held += int(rg.bytes[a])
        nodes = [int(i) for i in np.argsort(-node_mem, kind="stable") if node_mem[i] > self.budget]
        replays = sorted((a for a, m in replay_mem.items() if m > self.budget), key=lambda a: -replay_mem[a])
        if not nodes and not replays:
            return None
        return ([partial(self.cut_node, i) for i in nodes if i not in self.cut_nodes][:POINT_CUTS_PER_ROUND]
                + [partial(self.cut_replay, a) for a in replays if a not in self.cut_replays][:POINT_CUTS_PER_ROUND])


@dataclass
class _Outcome:
    chosen: list[int] | None  # the last program's solution, if it fits (then it is the program's optimum)
    objective: float
    lower: float  # proven lower bound on the program's optimum over sets that fit
    rounds: int
    how: str  # "optimal", "infeasible", "time limit (N s)" or "round limit (N)"


def _solve_lazily(model, time_limit_s: float, max_rounds: int, cancel: CancelToken | None) -> _Outcome:
    """Solve ``model``'s program, add its memory cuts where the solution is over budget, and again, until a
    solution fits, none can, or a limit stops it. Every program solved is a relaxation of "fits", so its optimum
    (HiGHS's dual bound when stopped by time) is a lower bound."""
    start = time.perf_counter()
    lower = 0.0
    for rounds in range(1, max_rounds + 1):
        check(cancel)
        res = model.prog.solve(time_limit_s - (time.perf_counter() - start), cancel)
        if res.status == 2:
            return _Outcome(None, 0.0, float("inf"), rounds, "infeasible")
        if res.status != 0 or res.x is None:
            bound = getattr(res, "mip_dual_bound", None)
            if bound is not None and np.isfinite(bound):
                lower = max(lower, float(bound))
            return _Outcome(None, 0.0, lower, rounds, f"time limit ({time_limit_s:.0f} s)")
        bound = getattr(res, "mip_dual_bound", None)  # at most the optimum (equal to REL_GAP)
        lower = max(lower, float(bound) if bound is not None and np.isfinite(bound) else float(res.fun))
        chosen = [k for k in model.cands if res.x[model.col[k]] > 0.5]
        cuts = model.cuts(chosen)
        if cuts is None:
            return _Outcome(chosen, float(res.fun), lower, rounds, "optimal")
        for cut in cuts:
            cut()
        if not cuts:  # the cuts bound this set's memory too low: cut the set itself
            model.no_good(chosen)
        if time.perf_counter() - start > time_limit_s:
            return _Outcome(None, 0.0, lower, rounds, f"time limit ({time_limit_s:.0f} s)")
    return _Outcome(None, 0.0, lower, max_rounds, f"round limit ({max_rounds})")


def exact_recompute_set(ctx: PlanContext, budget: int, *, time_limit_s: float = 60.0, max_rounds: int = 200,
                        incumbent: list[int] | None = None, cancel: CancelToken | None = None) -> MilpResult:
    """The optimal recompute set for ``budget`` in replay mode "again", or, when ``time_limit_s`` or
    ``max_rounds`` stops the search, ``incumbent`` (a set that fits, if any) with a proven lower bound."""
    rg, sim = ctx.rg, ctx.sim
    model = _AgainProgram(ctx, budget)
    why = _relaxed_rows(ctx, budget, model.prog, model.col)
    if why is not None:
        return MilpResult(None, 0.0, float("inf"), False, why, 0)
    out = _solve_lazily(model, time_limit_s, max_rounds, cancel)
    if out.chosen is not None:
        return MilpResult(out.chosen, out.objective, out.lower, True, "optimal", out.rounds)
    if out.how == "infeasible":
        return MilpResult(None, 0.0, float("inf"), False, "MILP infeasible: no recompute set fits", out.rounds)
    if incumbent is None or sim.peak(incumbent, by_index=True)[0] > budget:
        return MilpResult(None, 0.0, out.lower, False, f"{out.how}: no fitting set found", out.rounds)
    known = sim.simulate([rg.act_ids[k] for k in incumbent]).extra_ms
    status = f"{out.how}: the incumbent is within {known / out.lower - 1:.1%} of the optimum" if out.lower else out.how
    return MilpResult(incumbent, known, out.lower, known <= out.lower * (1 + REL_GAP), status, out.rounds)


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

    def cuts(self, chosen: list[int]) -> list[Callable[[], None]] | None:
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
    why = _relaxed_rows(ctx, budget, model.prog, model.col)
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
    the time limit stops it first)."""
    mu = trajectory(ctx, cancel=cancel).plan_for_budget(budget)
    incumbent = [ctx.rg.act_index[a] for a in mu.recomputed] if mu.feasible else None
    return exact_recompute_set(ctx, budget, time_limit_s=time_limit_s, incumbent=incumbent, cancel=cancel)


@solver(NAME, "exact optimum under μ-TWO's replay model; past its time limit μ-TWO's plan with a proven bound",
        exact=True)
def solve_milp(ctx: PlanContext, budget: int, *, cancel: CancelToken | None = None) -> Plan:
    return milp_plan(ctx, budget, exact_milp(ctx, budget, cancel=cancel))


def milp_plan(ctx: PlanContext, budget: int, result: MilpResult) -> Plan:
    """The plan of a :class:`MilpResult`; its reason says how it stopped and the bound."""
    if result.chosen is None:
        return ctx.plan_for_set(NAME, budget, [], f"no recompute set fits: {result.status}")
    if not result.chosen:
        return ctx.plan_for_set(NAME, budget, [], BASELINE_FITS)
    return ctx.plan_for_set(NAME, budget, result.chosen,
                            f"{BUDGET_MET} ({result.status}; lower bound {result.lower_bound_ms:.3f} ms)")
