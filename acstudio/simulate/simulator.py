"""Whole-iteration memory simulator (forward, backward, optimizer) for a set of recomputed activations.

The measured profile is split once into what activation checkpointing can change and what it cannot:

* ``base[i] = mem_peak[i] - bytes of the activations alive during node i`` (alive from the node that creates
  them to their last use, both inclusive): everything else the step holds during node i;
* ``between[i]``: the same for the moment just before node i, taken from ``mem_after[i-1]`` minus the
  storages that die after node i-1, minus the activations alive across that boundary.

A recomputed activation is alive from creation to its last forward use and again from just before its first
backward use to its last backward use. It is recomputed right before its first backward use, in forward
creation order when several share that node; while it is replayed the memory is ``between`` plus the
activations alive then (retained ones, earlier re-materialised ones, sources kept alive for it) plus the
high-water mark of the replay's own allocations (see :meth:`ReplayGraph.transient_bytes`; μ-TWO's Alg G
leaves this out). A replayed random op's saved generator state counts from that op in forward to its last
replay has run (:meth:`ReplayGraph.rng_spans`): conservative, as the graph frees it inside that replay once set;
the current state a replay holds while it runs the op is not counted.
A retained activation that a recomputation reads after its normal last use stays alive
until that recomputation has finished (conservative: FX would free it inside the replay, after its last read).

With nothing recomputed the simulated node memory is exactly ``mem_peak``, so the simulated peak is the
measured one. Everything is numpy over node and activation indices, so one evaluation is a few bincounts and
cumulative sums; the greedy planner goes further and updates the activation arrays in place per pick
(:class:`SimState`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from acstudio.errors import ACStudioError
from acstudio.profile.model import Profile
from acstudio.simulate.offload import OffloadFacts, OffloadSchedule
from acstudio.simulate.replay import Expansion, ReplayGraph

TIMELINE_CATEGORIES = (
    "parameter", "gradient", "optimizer_state", "retained_activations", "recompute_transients", "other")
# Storage categories shown in their own timeline column; buffers count as model state ("parameter"), the batch
# and temporaries as "other", together with whatever else the allocator holds (workspaces, fragmentation).
_STATIC = {"parameter": "parameter", "buffer": "parameter", "gradient": "gradient",
           "optimizer_state": "optimizer_state"}


@dataclass(frozen=True)
class StepClock:
    """When the simulated step runs each node, in ms from its start: node ``i`` runs from ``start[i]`` to
    ``end[i]``; ``issue[i]`` is where the step reaches the point before it (the previous node's end), where the
    recomputations inserted before node ``i`` run and the compute stream waits for late copies, so ``start[i] -
    issue[i]`` is that node's replays and waits. One clock for every view of the step (the timeline, the copies),
    so the last node ends at the simulated step time: the nodes' run times plus the extra time."""

    issue: np.ndarray
    start: np.ndarray
    end: np.ndarray

    @property
    def step_ms(self) -> float:
        return float(self.end[-1]) if len(self.end) else 0.0


@dataclass
class SimResult:
    """Simulated memory of one recompute set.

    ``timeline[i]`` splits the memory at node ``i`` by :data:`TIMELINE_CATEGORIES`; its sum is the highest of
    the memory during node ``i`` and during the recomputations inserted before node ``i``.
    ``parameter`` holds parameters and buffers; ``other`` the batch, temporaries, the loss and whatever else the
    measured memory contains (allocator workspaces). ``retained_activations`` counts every activation in
    memory (retained or already re-materialised), ``recompute_transients`` what a running replay holds (its
    target included). ``peak_node`` is the node where the peak occurs, or before which the peaking
    recomputation runs. ``clock``: when each node runs, its replays and the waits for copies included.
    """

    peak_bytes: int
    peak_node: str
    extra_ms: float
    timeline: np.ndarray
    clock: StepClock
    recompute_ms: dict[str, float] = field(default_factory=dict)  # per recomputed activation id
    offload: OffloadSchedule | None = None  # the copies of offloaded activations (their stalls are in extra_ms)


class Simulator:
    """Precomputes a profile's memory arrays once; :meth:`peak` and :meth:`simulate` evaluate recompute sets."""

    def __init__(self, profile: Profile, replay: ReplayGraph | None = None, *, keep_random: bool = False) -> None:
        """``keep_random`` (when no ``replay`` is given): never recompute random ops (``--keep-random``)."""
        self.profile = profile
        self.replay = replay or ReplayGraph(profile, keep_random)
        rg = self.replay
        nodes = profile.nodes
        index = profile.node_index
        n = self.n = len(nodes)
        self.node_ids = [nd.id for nd in nodes]
        mem_peak = np.array([nd.mem_peak for nd in nodes], dtype=np.int64)
        mem_after = np.array([nd.mem_after for nd in nodes], dtype=np.int64)

        live = self._span(rg.created, rg.last_bw, rg.bytes)
        self.base = mem_peak - live
        tensors = profile.tensors
        t_start = np.array([index[t.created_at] for t in tensors], dtype=np.int64)
        t_end = np.array([index[t.freed_after] if t.freed_after else n - 1 for t in tensors], dtype=np.int64)
        t_bytes = np.array([t.bytes for t in tensors], dtype=np.int64)
        freed = np.array([bool(t.freed_after) for t in tensors], dtype=bool)
        dying = self._span(t_end[freed], t_end[freed], t_bytes[freed])
        t_col = np.array([_STATIC.get(t.category, "") for t in tensors])
        static = [t_col == name for name in TIMELINE_CATEGORIES[:3]]
        self._static_node = np.stack([self._span(t_start[m], t_end[m], t_bytes[m]) for m in static], axis=1)
        self._static_between = np.stack([self._span(t_start[m] + 1, t_end[m], t_bytes[m]) for m in static], axis=1)
        across = self._span(rg.created + 1, rg.last_bw, rg.bytes)
        self.between = np.zeros(n, dtype=np.int64)
        self.between[1:] = mem_after[:-1] - dying[:n - 1] - across[1:]

        # Recomputations before the same node run in creation order: static sort key and group starts.
        self._order = np.lexsort((np.arange(len(rg.bytes)), rg.created, rg.first_bw))
        fb = rg.first_bw[self._order]
        self._group_start = np.searchsorted(fb, fb, side="left")

        pos = int(np.argmax(mem_peak))
        self.baseline_peak = int(mem_peak[pos])
        self.baseline_peak_node = self.node_ids[pos]
        # Only nodes between the first activation's creation and the last backward use can change; the
        # rest (parameters loading, most of the optimizer) contribute one constant peak.
        self._lo = int(rg.created.min()) if len(rg.bytes) else 0
        self._hi = int(rg.last_bw.max()) if len(rg.bytes) else n - 1
        outside = np.r_[mem_peak[:self._lo], np.full(self._hi - self._lo + 1, -1), mem_peak[self._hi + 1:]]
        self._outside_pos = int(np.argmax(outside))
        self._outside_peak = int(outside[self._outside_pos])

    @cached_property
    def floor(self) -> tuple[int, str]:
        """Simulated peak and its node with every candidate recomputed (what AC alone can reach)."""
        return self.peak(self.replay.candidates, by_index=True)

    @property
    def floor_bytes(self) -> int:
        return self.floor[0]

    @cached_property
    def offload_facts(self) -> OffloadFacts:
        """Which activations can be offloaded, and after which node their copy to the host is issued."""
        return OffloadFacts(self)

    def clock(self, at: Sequence[int] = (), replay_ms: Sequence[float] = (), waits: np.ndarray | None = None
              ) -> StepClock:
        """The step's clock with replays taking ``replay_ms`` before nodes ``at`` and, where the step offloads, its
        ``waits`` for copies (:attr:`OffloadSchedule.waits`: per node, ms the compute stream waits before it)."""
        run = self.replay.run_ms
        before = np.bincount(np.asarray(at, dtype=np.int64), weights=np.asarray(replay_ms, dtype=np.float64),
                             minlength=self.n) if len(at) else np.zeros(self.n)
        if waits is not None:
            before = before + waits
        start = np.cumsum(before + run) - run
        return StepClock(issue=start - before, start=start, end=start + run)

    # -- helpers ------------------------------------------------------------------------------------------
    def _span(self, start: np.ndarray, end: np.ndarray, weight: np.ndarray, n: int | None = None) -> np.ndarray:
        """Sum of ``weight`` over the inclusive index ranges ``[start, end]`` (empty when end < start), for
        indices ``0 .. n-1`` (default: every node)."""
        n = self.n if n is None else n
        keep = end >= start
        d = np.bincount(start[keep], weights=weight[keep], minlength=n + 1)
        d -= np.bincount(end[keep] + 1, weights=weight[keep], minlength=n + 1)
        return np.rint(np.cumsum(d[:n])).astype(np.int64)

    def indices(self, recomputed: Collection[str]) -> list[int]:
        """Activation indices of ``recomputed`` ids; non-candidates are refused with the reason."""
        rg = self.replay
        out = []
        for a in recomputed:
            k = rg.act_index.get(a)
            if k is None:
                raise ACStudioError(f"{a} is not an activation of this profile")
            if not rg.is_candidate[k]:
                raise ACStudioError(f"{a} cannot be recomputed: {rg.reason[k]}")
            out.append(k)
        return out

    def schedule_facts(self, recomputed: list[int]) -> tuple[dict[int, Expansion], np.ndarray, np.ndarray]:
        """Expansion of every recomputed activation, plus the arrays :meth:`evaluate` takes."""
        rg = self.replay
        mask = np.zeros(len(rg.bytes), dtype=bool)
        mask[recomputed] = True
        exps = {k: rg.expand(k, mask) for k in recomputed}
        keep_until = np.full(len(rg.bytes), -1, dtype=np.int64)
        transient = np.zeros(len(rg.bytes), dtype=np.int64)
        for k, e in exps.items():
            transient[k] = rg.transient_bytes(k, e.nodes)
            for s in e.sources:
                if not mask[s]:
                    keep_until[s] = max(keep_until[s], rg.first_bw[k])
        return exps, keep_until, transient

    # -- evaluation -----------------------------------------------------------------------------------------
    def activation_memory(self, mask: np.ndarray, keep_until: np.ndarray, back: np.ndarray | None = None,
                          rng_states: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Bytes of activations in memory during each node and just before it, for a recompute set.

        ``mask``: recomputed activations; ``keep_until``: for retained activations read by a recomputation,
        the latest node before which such a recomputation runs (-1: none); ``back``: the node before which each
        recomputed activation is back in memory (default: its first backward use; earlier for an activation a
        shared chain produces, see :mod:`acstudio.simulate.shared`). ``rng_states``: count the generator state
        the rewritten graph saves before each replayed random op.
        """
        rg = self.replay
        ret = ~mask
        c, l_fw, e, b = rg.created, rg.last_fw, rg.last_bw, rg.bytes
        f_bw = rg.first_bw if back is None else back
        node_end = np.where(ret, np.maximum(e, keep_until - 1), l_fw)
        bnd_end = np.where(ret, np.maximum(e, keep_until), l_fw)
        rc = np.flatnonzero(mask)
        lo, width = self._lo, self._hi - self._lo + 1
        starts = np.concatenate([c, f_bw[rc]]) - lo
        weights = np.concatenate([b, b[rc]])
        acts_node = np.zeros(self.n, dtype=np.int64)
        acts_between = np.zeros(self.n, dtype=np.int64)
        acts_node[lo:lo + width] = self._span(starts, np.concatenate([node_end, e[rc]]) - lo, weights, width)
        acts_between[lo:lo + width] = self._span(starts + 1, np.concatenate([bnd_end, e[rc]]) - lo, weights, width)
        if rng_states and rc.size and rg.rng_nodes.size:
            # Generator states saved in forward for replayed random ops, kept until their last replay has run.
            r, end = rg.rng_spans(mask, f_bw)
            state = np.full(len(r), rg.rng_state_bytes, dtype=np.int64)
            acts_node += self._span(r, end - 1, state)
            acts_between += self._span(r, end, state)
        return acts_node, acts_between

    def evaluate(self, mask: np.ndarray, keep_until: np.ndarray, transient: np.ndarray, timeline: bool = False,
                 extra: tuple[np.ndarray, np.ndarray] | None = None):
        """Peak (bytes, node position, whether it is during a recomputation before that node) of a recompute
        set given as arrays over activations (see :meth:`activation_memory`; ``transient``: each recomputed
        activation's replay high-water mark). With ``timeline`` also returns the per-node category table.
        ``extra``: bytes to add to the activations during and just before each node (offload's, negative)."""
        acts_node, acts_between = self.activation_memory(mask, keep_until)
        if extra is not None:
            acts_node, acts_between = acts_node + extra[0], acts_between + extra[1]
        return self.peak_of(acts_node, acts_between, mask, transient, timeline)

    def peak_of(self, acts_node: np.ndarray, acts_between: np.ndarray, mask: np.ndarray, transient: np.ndarray,
                timeline: bool = False):
        """:meth:`evaluate` from activation memory arrays already computed (or kept up to date by a caller)."""
        rg = self.replay
        rc = np.flatnonzero(mask)
        pre = np.zeros(len(rg.bytes), dtype=np.int64)
        if rc.size:
            # Bytes brought back by the recomputations that run earlier before the same node.
            sorted_b = np.where(mask[self._order], rg.bytes[self._order], 0)
            csum = np.concatenate([[0], np.cumsum(sorted_b)])
            pre[self._order] = csum[:-1] - csum[self._group_start]
        return self.peak_with_replays(acts_node, acts_between, rg.first_bw[rc], pre[rc], transient[rc], timeline)

    def peak_with_replays(self, acts_node: np.ndarray, acts_between: np.ndarray, at: np.ndarray, held: np.ndarray,
                          transient: np.ndarray, timeline: bool = False):
        """Peak (and optionally the timeline, see :meth:`evaluate`) given the activation memory arrays and the
        replays: replay ``j`` runs before node ``at[j]`` while the replays before it at the same node hold
        ``held[j]`` bytes, and its own allocations reach ``transient[j]``."""
        lo, hi = self._lo, self._hi + 1
        mem = self.base[lo:hi] + acts_node[lo:hi]
        pos = int(np.argmax(mem))
        peak, pos, before = int(mem[pos]), pos + lo, False
        if (self._outside_peak, -self._outside_pos) > (peak, -pos):
            peak, pos = self._outside_peak, self._outside_pos
        rc_mem = None
        if at.size:
            rc_mem = self.between[at] + acts_between[at] + held + transient
            j = int(np.argmax(rc_mem))
            if rc_mem[j] > peak:
                peak, pos, before = int(rc_mem[j]), int(at[j]), True
        if not timeline:
            return peak, pos, before
        mem = self.base + acts_node
        table = np.zeros((self.n, len(TIMELINE_CATEGORIES)), dtype=np.int64)
        table[:, :3] = self._static_node
        table[:, 3] = acts_node
        table[:, 5] = self.base - self._static_node.sum(axis=1)
        if rc_mem is not None:
            # Per node, the replay with the highest memory, shown if it exceeds the node's own.
            order = np.lexsort((rc_mem, at))
            last = order[np.flatnonzero(np.append(at[order][1:] != at[order][:-1], True))]
            win = rc_mem[last] > mem[at[last]]
            w, j = at[last][win], last[win]
            table[w, :3] = self._static_between[w]
            table[w, 3] = acts_between[w] + held[j]
            table[w, 4] = transient[j]
            table[w, 5] = self.between[w] - self._static_between[w].sum(axis=1)
        return peak, pos, before, table

    def peak(self, recomputed: Collection[str] | Collection[int], *, by_index: bool = False) -> tuple[int, str]:
        """Simulated peak bytes and its node for the activation ids in ``recomputed`` (no timeline)."""
        ks = list(recomputed) if by_index else self.indices(recomputed)
        if not ks:
            return self.baseline_peak, self.baseline_peak_node
        _, keep_until, transient = self.schedule_facts(ks)
        mask = np.zeros(len(self.replay.bytes), dtype=bool)
        mask[ks] = True
        peak, pos, _ = self.evaluate(mask, keep_until, transient)
        return peak, self.node_ids[pos]

    def simulate(self, recomputed: Collection[str]) -> SimResult:
        """Peak, extra time and per-node timeline for the activation ids in ``recomputed``."""
        ks = self.indices(recomputed)
        exps, keep_until, transient = self.schedule_facts(ks)
        mask = np.zeros(len(self.replay.bytes), dtype=bool)
        mask[ks] = True
        peak, pos, _, table = self.evaluate(mask, keep_until, transient, timeline=True)
        per = {self.replay.act_ids[k]: e.time_ms for k, e in exps.items()}
        clock = self.clock(self.replay.first_bw[ks], [exps[k].time_ms for k in ks])
        return SimResult(peak_bytes=peak, peak_node=self.node_ids[pos], extra_ms=float(sum(per.values())),
                         timeline=table, clock=clock, recompute_ms=per)


class SimState:
    """A recompute set that changes one activation at a time (the greedy planner's loop), its activation
    memory arrays updated in place instead of rebuilt; :meth:`peak` equals :meth:`Simulator.evaluate` on the
    same ``mask``, ``keep_until`` and ``transient``."""

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        n_act = len(sim.replay.bytes)
        self.mask = np.zeros(n_act, dtype=bool)
        self.keep_until = np.full(n_act, -1, dtype=np.int64)
        self.transient = np.zeros(n_act, dtype=np.int64)
        self.acts_node, self.acts_between = sim.activation_memory(self.mask, self.keep_until)
        self.rng_end = np.full(len(sim.replay.rng_nodes), -1, dtype=np.int64)  # see ReplayGraph.rng_spans

    @staticmethod
    def _add(arr: np.ndarray, start: int, end: int, value: int) -> None:
        if end >= start:
            arr[start:end + 1] += value

    def recompute(self, k: int) -> None:
        """Free retained ``k`` after its last forward use and bring it back before its first backward use."""
        rg = self.sim.replay
        l_fw, f_bw, e, b = rg.last_fw[k], rg.first_bw[k], rg.last_bw[k], int(rg.bytes[k])
        ku = self.keep_until[k]
        self._add(self.acts_node, l_fw + 1, max(e, ku - 1), -b)
        self._add(self.acts_node, f_bw, e, b)
        self._add(self.acts_between, l_fw + 1, max(e, ku), -b)
        self._add(self.acts_between, f_bw + 1, e, b)
        self.mask[k] = True
        for j in rg.rng_owned[k]:  # the saved generator states of its random ops now live until f_bw at least
            old = self.rng_end[j]
            if f_bw > old:
                r = rg.rng_nodes[j]
                self._add(self.acts_node, r if old < 0 else old, f_bw - 1, rg.rng_state_bytes)
                self._add(self.acts_between, r if old < 0 else old + 1, f_bw, rg.rng_state_bytes)
                self.rng_end[j] = f_bw

    def keep(self, s: int, until: int) -> None:
        """Keep retained ``s`` alive for recomputations up to the one before node ``until`` (-1: none)."""
        rg = self.sim.replay
        e, b, old = rg.last_bw[s], int(rg.bytes[s]), self.keep_until[s]
        for arr, shift in ((self.acts_node, -1), (self.acts_between, 0)):
            was, now = max(e, old + shift), max(e, until + shift)
            self._add(arr, was + 1, now, b)
            self._add(arr, now + 1, was, -b)
        self.keep_until[s] = until

    def peak(self) -> tuple[int, int, bool]:
        return self.sim.peak_of(self.acts_node, self.acts_between, self.mask, self.transient)
