"""Block search: plan in shared-chain mode (how checkpointed blocks really replay) using the block structure.

μ-TWO's greedy prices each recomputation as its own chain replay, so near per-block checkpointing's memory it
recomputes long runs of consecutive activations and replays them quadratically. Checkpointing blocks instead
replays each block's forward once. This search starts where per-block checkpointing is (every candidate a
repeated block frees is recomputed, and so is every candidate outside the blocks) and *keeps back* what saves
the most replay time per byte:

1. Per block type (blocks whose forward runs the same ops: identical layers), a small exact problem on one
   representative: greedily keep back the member whose retention cuts the block's shared replay time the most per
   byte, each replay time from :func:`~acstudio.simulate.shared.shared_schedule` of that block alone. The levels
   ``0 .. m`` (members kept) give the block's memory/time curve; its lower convex hull is what a knapsack wants.
2. A knapsack over blocks with identical-layer reuse (as torchtitan's ILP does): every hull segment of every
   block instance, and every candidate outside the blocks, is a move (bytes kept, time saved); moves sorted by
   time saved per byte give a sequence of states from per-block checkpointing to keeping everything. Equal
   slopes keep later layers first: their activations are freed earliest in backward.
3. Each state is a recompute set; the shared-chain simulator prices it exactly. For a budget the search
   evaluates a grid of states, bisects for the last fitting one (peaks grow along the sequence, nearly
   monotonically) and returns the fastest fitting state it evaluated.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from acstudio.jobs import CancelToken, ProgressFn, check
from acstudio.plan import baselines
from acstudio.plan.model import Plan
from acstudio.plan.schedule import PlanContext
from acstudio.plan.solvers.mutwo import BASELINE_FITS
from acstudio.plan.solvers.registry import CurvePoint, solver
from acstudio.simulate.modes import get_mode
from acstudio.simulate.replay import FORWARD_REGIONS
from acstudio.simulate.shared import shared_schedule

NAME = "blocks"
MODE = "shared"


@dataclass(frozen=True)
class Move:
    """Keep ``keep`` (activation indices) back instead of recomputing them: ``bytes`` more memory, ``saves_ms``."""

    keep: tuple[int, ...]
    bytes: int
    saves_ms: float
    order: int  # tie-break: later layers first


def _levels(ctx: PlanContext, members: list[int]) -> list[tuple[int, ...]]:
    """Positions (into ``members``) kept back at each level 0..m, by the best time saved per byte."""
    rg = ctx.rg
    recomputed = list(range(len(members)))
    kept: list[int] = []
    levels: list[tuple[int, ...]] = [()]
    now = _replay_ms(ctx, members, ())
    while recomputed:
        best = None
        for j in recomputed:
            t = _replay_ms(ctx, members, (*kept, j))
            gain = (now - t) / max(int(rg.bytes[members[j]]), 1)
            if best is None or gain > best[0]:
                best = (gain, j, t)
        _, j, now = best
        recomputed.remove(j)
        kept.append(j)
        levels.append(tuple(kept))
    return levels


def _hull(points: list[tuple[int, float]]) -> list[int]:
    """Indices of the lower convex hull of (bytes kept, replay ms) points, from fewest bytes kept on."""
    hull: list[int] = []
    for i in sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1])):
        if hull and points[i][1] >= points[hull[-1]][1]:
            continue  # keeps more and saves nothing
        while len(hull) >= 2:
            (x0, y0), (x1, y1), (x2, y2) = points[hull[-2]], points[hull[-1]], points[i]
            if (y1 - y0) * (x2 - x0) >= (y2 - y0) * (x1 - x0):  # hull[-1] lies on or above the chord
                hull.pop()
            else:
                break
        hull.append(i)
    return hull


class BlockSearch:
    """The move sequence of one profile and the exact shared-chain price of the states it visits."""

    def __init__(self, ctx: PlanContext, cancel: CancelToken | None = None) -> None:
        self.ctx = ctx
        rg, nodes = ctx.rg, ctx.profile.nodes
        members = baselines.block_members(ctx)
        node_block = baselines.node_blocks(ctx)
        signature: dict[str, tuple[str, ...]] = {}
        for i, b in enumerate(node_block):
            if b:
                signature[b] = (*signature.get(b, ()), nodes[i].target)
        block_rank = {b: r for r, b in enumerate(members)}
        curves: dict[tuple, tuple] = {}  # block type -> (levels, hull, points)
        moves: list[Move] = []
        for b, ks in members.items():
            check(cancel)
            kind = (signature[b], len(ks))
            if kind not in curves:  # solved once per block type, on its first instance
                levels = _levels(ctx, ks)
                points = [(int(rg.bytes[[ks[j] for j in level]].sum()), _replay_ms(ctx, ks, level))
                          for level in levels]
                hull = _hull(points)
                curves[kind] = (levels, hull, points)
            levels, hull, points = curves[kind]
            for a, c in itertools.pairwise(hull):
                keep = tuple(ks[j] for j in levels[c] if j not in levels[a])
                moves.append(Move(keep, points[c][0] - points[a][0], points[a][1] - points[c][1], -block_rank[b]))
        in_block = {k for ks in members.values() for k in ks}
        block_of_node = np.array([bool(b) for b in node_block])
        self.outside = [k for k in rg.candidates if k not in in_block and not block_of_node[rg.created[k]]
                        and nodes[rg.created[k]].region in FORWARD_REGIONS]
        for k in self.outside:
            moves.append(Move((k,), int(rg.bytes[k]), shared_schedule(ctx.sim, [k]).extra_ms, len(members)))
        moves.sort(key=lambda m: (-m.saves_ms / max(m.bytes, 1), m.order))
        self.moves = moves
        self.start = sorted(in_block | set(self.outside))
        self._cache: dict[int, tuple[int, int, float]] = {}

    def recomputed(self, j: int) -> list[int]:
        """The recompute set after the first ``j`` moves."""
        kept = {k for m in self.moves[:j] for k in m.keep}
        return [k for k in self.start if k not in kept]

    def evaluate(self, j: int) -> tuple[int, int, float]:
        """(peak bytes, peak node position, extra ms) of state ``j``, exact in shared-chain mode."""
        if j not in self._cache:
            self._cache[j] = get_mode(MODE).peak(self.ctx.sim, self.recomputed(j))
        return self._cache[j]

    def state_for_budget(self, budget: int, grid: int = 12, window: int = 2,
                         cancel: CancelToken | None = None) -> int | None:
        """The fastest evaluated state that fits ``budget`` (``None`` if none does). Peaks grow along the sequence
        but not strictly (a kept tensor can shorten a replay's transient), so: a grid of states, a binary search
        for the last fitting state after each fitting grid point, and the ``window`` states around it."""
        n = len(self.moves)
        self.evaluate(0)  # a graph without repeated blocks or candidates outside them has no moves: state 0 only

        def fits(j: int) -> bool:
            return self.evaluate(j)[0] <= budget

        points = sorted({round(x) for x in np.linspace(0, n, grid + 1)})
        for lo, hi in itertools.pairwise(points):
            check(cancel)
            if fits(lo) and not fits(hi):
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    lo, hi = (mid, hi) if fits(mid) else (lo, mid)
                for j in range(max(0, lo - window), min(n, lo + window) + 1):
                    self.evaluate(j)
        ok = [j for j, (peak, _, _) in self._cache.items() if peak <= budget]
        return min(ok, key=lambda j: (self._cache[j][2], -j)) if ok else None

    def plan_for_budget(self, budget: int, cancel: CancelToken | None = None) -> Plan:
        j = self.state_for_budget(budget, cancel=cancel)
        if j is None:  # nothing fits: the lowest peak the search reached
            j = min(self._cache, key=lambda j: self._cache[j][0])
        ks = self.recomputed(j)
        return self.ctx.plan_for_set(NAME, budget, ks, mode=MODE)

    def curve(self, points: int = 24) -> list[tuple[int, float, int]]:
        """(peak, extra ms, number recomputed) at ``points`` states spread along the sequence."""
        js = sorted({round(x) for x in np.linspace(0, len(self.moves), points)})
        return [(self.evaluate(j)[0], self.evaluate(j)[2], len(self.recomputed(j))) for j in js]


def _replay_ms(ctx: PlanContext, members: list[int], kept: tuple[int, ...]) -> float:
    """Shared replay time of a block whose ``members`` are recomputed except the positions ``kept``."""
    rest = [k for j, k in enumerate(members) if j not in kept]
    return shared_schedule(ctx.sim, rest).extra_ms if rest else 0.0


def block_search(ctx: PlanContext, cancel: CancelToken | None = None) -> BlockSearch:
    """The block search of ``ctx``, built once and cached on it."""
    if NAME not in ctx.cache:
        ctx.cache[NAME] = BlockSearch(ctx, cancel)
    return ctx.cache[NAME]


def blocks_curve(ctx: PlanContext, progress: ProgressFn | None = None, cancel: CancelToken | None = None
                 ) -> list[CurvePoint]:
    """The search's states spread along its sequence, in shared chains."""
    return [CurvePoint(peak, ms, n, MODE) for peak, ms, n in block_search(ctx, cancel).curve()]


@solver(NAME, "shared-chain search over the repeated blocks: per-block checkpointing, then keep back what saves the "
              "most time per byte", curve=blocks_curve, auto_order=1)
def solve_blocks(ctx: PlanContext, budget: int, *, cancel: CancelToken | None = None) -> Plan:
    if ctx.sim.baseline_peak <= budget:
        return ctx.plan_for_set(NAME, budget, [], BASELINE_FITS)
    return block_search(ctx, cancel).plan_for_budget(budget, cancel)

