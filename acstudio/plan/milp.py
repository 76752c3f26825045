"""Exact optimum for small graphs: the cheapest recompute set whose *simulated* peak fits the budget.

A mixed-integer program (SciPy's HiGHS) chooses ``x[k]`` = recompute candidate ``k``. Its objective is
exactly the simulator's extra time: ``y[a, s]`` marks that recomputing ``a`` also replays candidate ``s``'s
own chain (``s`` recomputed and not resident when ``a`` is recomputed, reached through such chains, the same
expansion as :class:`~acstudio.simulate.replay.ReplayGraph`), and ``z[a, v]`` that node ``v`` is in a's
replay, so shared nodes are paid once per replay. Its memory constraints are the node peaks without the
extras that only add memory (replay transients, sources kept alive longer): a relaxation. So each solution
is simulated; one that does not fit is cut off (``no-good`` cut) and the program solved again. The first
solution that fits is optimal for the simulator's model.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from acstudio.errors import ACStudioError
from acstudio.jobs import CancelToken, check
from acstudio.plan.schedule import PlanContext

MAX_CANDIDATES = 200


def exact_recompute_set(ctx: PlanContext, budget: int, *, time_limit_s: float = 60.0, max_rounds: int = 200,
                        cancel: CancelToken | None = None) -> tuple[list[int] | None, str]:
    """Optimal recompute set for ``budget`` (activation indices), or ``None`` with the reason."""
    rg, sim = ctx.rg, ctx.sim
    cands = rg.candidates
    if len(cands) > MAX_CANDIDATES:
        raise ACStudioError(f"the exact (MILP) solver handles at most {MAX_CANDIDATES} candidates; this profile "
                            f"has {len(cands)} (use it on tiny profiles, to measure μ-TWO's optimality gap)")
    col = {k: j for j, k in enumerate(cands)}
    nx = len(cands)
    rows: list[tuple[list[int], list[float], float, float]] = []  # (columns, coefficients, lower, upper)
    cost: list[float] = [0.0] * nx
    n_vars = nx

    def new_var(c: float) -> int:
        nonlocal n_vars
        cost.append(c)
        n_vars += 1
        return n_vars - 1

    for a in cands:
        at = rg.first_bw[a]
        # Candidates a's replay may expand into: reachable through stops that are non-resident there.
        var = {a: col[a]}
        stack = [a]
        while stack:
            p = stack.pop()
            for s in rg.stops[p]:
                if s in var or not rg.is_candidate[s] or rg.resident(s, at):
                    continue
                var[s] = new_var(0.0)
                stack.append(s)
        for p in var:
            for s in rg.stops[p]:
                if s in var and s != a:  # y[a,s] >= y[a,p] + x[s] - 1
                    rows.append(([var[s], var[p], col[s]], [1.0, -1.0, -1.0], -1.0, np.inf))
        node_var: dict[int, int] = {}
        for s, ys in var.items():
            for v in rg.own[s]:
                v = int(v)
                if v not in node_var:
                    node_var[v] = new_var(float(rg.run_ms[v]))
                rows.append(([node_var[v], ys], [1.0, -1.0], 0.0, np.inf))  # z[a,v] >= y[a,s]

    # Node memory without transients and kept-alive sources: peak[i] - sum of freed gaps covering i <= budget.
    # (With nothing recomputed the simulated node memory is the measured mem_peak.)
    mem = np.array([nd.mem_peak for nd in ctx.profile.nodes], dtype=np.int64)
    for i in np.flatnonzero(mem > budget):
        ks = [k for k in cands if rg.last_fw[k] < i < rg.first_bw[k]]
        need = float(mem[i] - budget)
        if sum(rg.bytes[k] for k in ks) < need:
            return None, f"at node {sim.node_ids[i]} recomputation cannot free the {int(need)} bytes needed"
        rows.append(([col[k] for k in ks], [rg.bytes[k] / need for k in ks], 1.0, np.inf))  # scaled to 1

    integrality = np.zeros(n_vars)
    integrality[:nx] = 1
    for _ in range(max_rounds):
        check(cancel)
        r_idx, c_idx, vals = [], [], []
        for r, (cols, coefs, _, _) in enumerate(rows):
            r_idx += [r] * len(cols)
            c_idx += cols
            vals += coefs
        matrix = coo_matrix((vals, (r_idx, c_idx)), shape=(len(rows), n_vars)).tocsr()
        cons = LinearConstraint(matrix, [r[2] for r in rows], [r[3] for r in rows])
        res = milp(np.array(cost), constraints=cons, integrality=integrality, bounds=Bounds(0, 1),
                   options={"time_limit": time_limit_s, "mip_rel_gap": 1e-9})
        if res.status != 0 or res.x is None:
            return None, f"MILP {'infeasible' if res.status == 2 else 'not solved'}: {res.message}"
        chosen = [k for k in cands if res.x[col[k]] > 0.5]
        peak, _ = sim.peak(chosen, by_index=True)
        if peak <= budget:
            return chosen, "optimal"
        # No-good cut: any other choice of x.
        inside = set(chosen)
        rows.append(([col[k] for k in cands], [-1.0 if k in inside else 1.0 for k in cands],
                     1.0 - len(inside), np.inf))
    return None, f"no simulated-feasible solution within {max_rounds} rounds"
