"""Offload: an activation copied to host memory after forward and back before backward, simulated exactly.

μ-TWO's third decision besides keeping and recomputing (its swap). For an offloaded activation ``k``:

* the device-to-host copy is issued on its own stream right after ``k``'s last forward write (its creator, or
  the last in-place op on its storage), and copies run one after another on that stream;
* the device memory is freed before the first node ``release[k]`` after its last forward use that starts once
  the copy has ended (the rewritten step makes the compute stream wait for the copy there, then drops the
  tensor); if no node starts after it before ``k`` is needed again, the step waits for the copy there. Where the
  copies fill the link, that wait makes the step as slow as the link: so ``release`` (and ``prefetch``, below)
  are placed as if every copy took :data:`LINK_SLACK` longer than priced, and the step is priced at the link's
  measured rate;
* ``k`` is needed again before node ``needed[k]``: its first backward use, or, if earlier, the first replay
  (recomputation) that reads it as a source, which then waits for the copy before the replays inserted there
  run (``by_replay[k]``);
* the host-to-device copy is issued on a second copy stream before node ``prefetch[k]``, which allocates ``k``
  again, as late as lets it land by the time it is needed: the copies are laid back to back, latest first,
  each ending when it is needed or by the start of the copy after it (the lane is serial); a caller may hold a
  copy back past a node (``not_before``), where landing in time would allocate it during the step's peak (the
  loss's backward, when the activations the last block's backward reads come back): the step then waits for it;
* where a copy is not done when the compute stream needs it, the step waits: a stall, added to its time;
* the four calls that issue an activation's copies and waits (after ``ready[k]``, before ``release[k]``,
  ``prefetch[k]`` and ``needed[k]``) take host time: together as much as issuing the link's
  ``offload_issue_nodes`` nodes of the step (the profile's host time per node). The host issues the step's nodes
  one after another while the device runs them and never waits for it: where it is ahead, the calls use up its
  lead; where it is what limits the step (many small kernels), they delay every node after them
  (:func:`host_delay`), and lengthen the step (``issue_ms``).

Times come from the nodes' run times (scaled as for recomputation) plus the replays a plan inserts; both lanes
run at the rate the link reaches with both directions copying (they overlap around the loss; elsewhere that rate
is conservative), and every copy also takes the link's fixed per-copy time, so many small copies cost more lane
time than one copy of the same bytes.
Memory is the replay mode's with ``k`` kept, minus ``k``'s bytes from ``release[k]`` up to
the node before ``prefetch[k]``. Host memory is one pinned buffer per offloaded activation, held all step (the
rewritten step allocates the pool once and reuses it). An activation the plan recomputes is not offloaded (it is
freed after forward anyway); one a replay reads comes back before that replay and stays as long as it would
have without offload.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import numpy as np

from acstudio.profile.model import UNISSUED_OPS
from acstudio.simulate.replay import FORWARD_REGIONS, is_inplace

# Smaller activations are not offloaded: a copy's launch costs more than the bytes it frees (torchtune's
# min_offload_size).
MIN_OFFLOAD_BYTES = 1024
# How much slower than measured the link may run before a planned copy holds up the step. The planner lays copies
# out to the end of the forward with nothing to spare: the 953M decoder at seq 1024 (H200, 2026-11-28) freed each
# activation 0.02 ms (median) after its copy was priced to end, and its three offloading rows ran 3.7-6.4 ms over
# their prediction, what a link 5% slower than profiled costs those plans; planned with this slack, the plans at
# seq 1024 and 2048 run no slower on a link up to 10% slower, for 0.5-1.4 ms more predicted (tests/test_offload.py).
# Measured (same H200 kind, the next session): seq 1024's rows 0.7-1.6 ms over their prediction, and 2.3-4.6 ms a
# step faster than the plans without it (results/superseded/grid-decoder1b-s1024.eager-h200-before-slack.json).
# The grid's profiles measured the link both ways at 43.5-50.6 GB/s (the best of 3 repeats each; seq 1024's 49.8,
# seq 2048's 45.7 on the same H200). Copies of regions (a compiled block's saved tensors) keep no slack: their
# runtime hands each storage back with ``record_stream``, so a late copy delays when its memory is reused, never
# compute.
LINK_SLACK = 0.10


class OffloadFacts:
    """Per activation of a simulator's profile: whether it can be offloaded (``reason`` empty) and the node after
    which its copy to the host is issued (``ready``: its last forward write)."""

    def __init__(self, sim) -> None:
        profile, rg = sim.profile, sim.replay
        nodes, index = profile.nodes, profile.node_index
        held = np.zeros(len(nodes), dtype=np.int64)
        holders: dict[str, list[int]] = {}
        for t in profile.tensors:
            hs = [index[h] for h in (t.created_at, *t.aliases)]
            holders[t.id] = hs
            held[hs] += 1
        n_act = len(rg.bytes)
        self.ready = np.full(n_act, -1, dtype=np.int64)
        self.source = np.full(n_act, -1, dtype=np.int64)  # the forward node whose tensor the copy reads
        self.reason: list[str] = []
        for k, a in enumerate(profile.activations):
            forward = [h for h in holders.get(a.id, []) if nodes[h].region in FORWARD_REGIONS]
            alone = [h for h in forward if held[h] == 1 and nodes[h].storage == a.id]
            writers = [h for h in forward if is_inplace(nodes[h].target)]
            if alone:
                self.source[k] = alone[0]
                self.ready[k] = max([alone[0], *writers])
            if not alone:
                why = "no forward node holds it alone (a multi-output op's storage)"
            elif nodes[rg.last_bw[k]].op == "output":
                why = "the step returns it"
            elif rg.first_bw[k] <= rg.last_fw[k] + 1:
                why = "no node runs between its last forward and first backward use"
            elif a.bytes < MIN_OFFLOAD_BYTES:
                why = f"smaller than {MIN_OFFLOAD_BYTES} bytes: a copy costs more than it frees"
            else:
                why = ""
            self.reason.append(why)
        self.offloadable = np.array([not r for r in self.reason], dtype=bool)
        self.issued = np.array([nd.op not in UNISSUED_OPS for nd in nodes], dtype=np.float64)  # 1: a call to issue


@dataclass
class SavedCopies:
    """Storages a region runtime copies besides activations (see :meth:`SacBlocks.region_saved
    <acstudio.simulate.sac.SacBlocks.region_saved>`): per storage its ``bytes``, the node after which its copy out
    is issued (``ready``) and the node it must be back before (``needed``). The schedule already holds each on the
    device from before ``ready`` to ``needed``; its copies take it off in between, as an activation's do."""

    bytes: np.ndarray
    ready: np.ndarray
    needed: np.ndarray


@dataclass
class HeldStorages:
    """Storages a region runtime holds on the device that the schedule does not (SDPA's bias of an attention
    mask, made once for all blocks: :meth:`SacBlocks.mask_bias_held
    <acstudio.simulate.sac.SacBlocks.mask_bias_held>`): per storage its ``bytes``, held from before node ``since``
    to after node ``until``."""

    bytes: np.ndarray
    since: np.ndarray
    until: np.ndarray


@dataclass
class OffloadSchedule:
    """Where and when the copies of a plan's offloaded activations (indices, by copy order) run, and their cost.

    Node indices: ``ready`` (the copy out is issued after it), ``release`` (its device memory is freed before it),
    ``prefetch`` (the copy back is issued, and the memory allocated, before it), ``first_bw``, ``needed`` (it must
    be back before this node, or before the replays inserted there where ``by_replay``); times in ms from the
    step's start: ``d2h`` and ``h2d`` (start, end) per copy. ``stall_ms``: the time the step waits for copies;
    ``waits``: per node, how much of it is spent right before that node (around its replays), which the step's
    clock adds (:meth:`Simulator.clock <acstudio.simulate.simulator.Simulator.clock>`; the copies' times are on
    that clock, so it leaves out ``issue_ms``, which moves nodes and copies alike).
    ``issue_ms``: the time the host's calls issuing them add to the step (0 where the host is ahead).
    """

    offloaded: np.ndarray
    bytes: np.ndarray
    ready: np.ndarray
    release: np.ndarray
    prefetch: np.ndarray
    first_bw: np.ndarray
    needed: np.ndarray
    by_replay: np.ndarray
    d2h: np.ndarray
    h2d: np.ndarray
    stall_ms: float
    waits: np.ndarray
    issue_ms: float = 0.0
    # the copies of storages that are no activation (SavedCopies), each with its release and prefetch node and
    # its copies' times
    saved_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    saved_release: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    saved_prefetch: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    saved_ready: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    saved_needed: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    saved_d2h: np.ndarray = field(default_factory=lambda: np.zeros((0, 2)))
    saved_h2d: np.ndarray = field(default_factory=lambda: np.zeros((0, 2)))
    held: HeldStorages | None = None  # what the runtime holds besides (with regions only)
    # (replay schedule, its (peak, position, during a replay)) where the mode evaluated these copies beside it
    evaluated: tuple | None = field(default=None, repr=False, compare=False)

    @property
    def moved_bytes(self) -> int:
        """Bytes crossing the link each way (activations and other saved storages)."""
        return int(self.bytes.sum() + self.saved_bytes.sum())

    @property
    def host_bytes(self) -> int:
        """Pinned host memory the step holds for the copies (one buffer per copied storage)."""
        return self.moved_bytes

    @property
    def hidden(self) -> bool:
        return self.stall_ms <= 0.0

    @property
    def extra_ms(self) -> float:
        """Time offload adds to the step: its stalls and what the host's calls issuing its copies and waits add."""
        return self.stall_ms + self.issue_ms

    def host_memory(self, sim) -> np.ndarray:
        """Bytes of offloaded activations held on the host at each node: from the node after which the copy out
        is issued to the node before they are needed again (a curve inside the pool, which is held all step)."""
        return (sim._span(self.ready + 1, self.needed - 1, self.bytes)
                + sim._span(self.saved_ready + 1, self.saved_needed - 1, self.saved_bytes))

    def memory(self, sim) -> tuple[np.ndarray, np.ndarray]:
        """Bytes to add to the activation memory during and just before each node: minus each offloaded
        activation from its release to the node before its prefetch, plus what the runtime holds besides."""
        gap = (sim._span(self.release, self.prefetch - 1, -self.bytes)
               + sim._span(self.saved_release, self.saved_prefetch - 1, -self.saved_bytes))
        if self.held is not None:
            gap = gap + sim._span(self.held.since, self.held.until, self.held.bytes)
        return gap, gap.copy()


def offload_schedule(sim, offloaded: Collection[int], replays: Sequence = (),
                     not_before: np.ndarray | None = None, regions: RegionCopies | None = None,
                     saved: SavedCopies | None = None, held: HeldStorages | None = None) -> OffloadSchedule:
    """Schedule and price the copies of activation indices ``offloaded`` (see the module docstring) beside the
    ``replays`` a plan runs (:class:`~acstudio.simulate.replay.Replay`: inserted before node ``at``, taking
    ``time_ms``, reading ``sources``). Activations a replay produces (recomputed ones) stay on the device, and
    so do those that cannot be offloaded. ``not_before``: per activation, the earliest node its copy back may be
    issued before (it is still issued by the node that needs it). ``regions``: where a runtime that copies whole
    regions issues each copy and needs it back, in place of the per-activation nodes; ``saved``: what such a
    runtime copies besides activations, on the same lanes (with ``regions`` only); ``held``: what it holds on
    the device besides (with ``regions`` only)."""
    rg, facts, link = sim.replay, sim.offload_facts, sim.profile.link
    chosen = np.zeros(len(rg.bytes), dtype=bool)
    chosen[np.asarray(list(offloaded), dtype=np.int64)] = True
    chosen[[k for r in replays for k in r.outputs]] = False
    chosen &= facts.offloadable
    ks_arr = np.flatnonzero(chosen)
    ks_arr = ks_arr[np.lexsort((ks_arr, rg.created[ks_arr], facts.ready[ks_arr]))]
    ks = ks_arr.tolist()
    nbytes = rg.bytes[ks_arr]
    duration = link.copy_ms(nbytes)
    at = np.array([r.at for r in replays], dtype=np.int64)
    clock = sim.clock(at, [r.time_ms for r in replays])  # the step as planned, no waits yet
    # issue[i]: the point before node i where copies are issued and memory released; start[i]: its replays have run
    issue, start, end = clock.issue, clock.start, clock.end
    ready, last_fw, first_bw = facts.ready[ks_arr], rg.last_fw[ks_arr], rg.first_bw[ks_arr]
    if regions is not None:
        ready, last_fw, first_bw = regions.ready[ks_arr], regions.ready[ks_arr], regions.needed[ks_arr]
    first_read = np.full(len(rg.bytes), sim.n, dtype=np.int64)  # per activation, the first replay reading it
    read = [(s, r.at) for r in replays for s in r.sources]
    if read:
        np.minimum.at(first_read, *np.array(read, dtype=np.int64).T)
    by_replay = first_read[ks_arr] <= first_bw
    needed = np.where(by_replay, first_read[ks_arr], first_bw)
    made = rg.created[ks_arr]
    if saved is not None and regions is not None:  # the other storages join the lanes, in order of their copy out
        ks_arr = np.concatenate([ks_arr, np.full(len(saved.bytes), -1, dtype=np.int64)])
        made = np.concatenate([made, saved.ready])
        ready, last_fw = np.concatenate([ready, saved.ready]), np.concatenate([last_fw, saved.ready])
        first_bw, needed = np.concatenate([first_bw, saved.needed]), np.concatenate([needed, saved.needed])
        by_replay = np.concatenate([by_replay, np.zeros(len(saved.bytes), dtype=bool)])
        nbytes = np.concatenate([nbytes, saved.bytes])
        order = np.argsort(ready, kind="stable")
        ks_arr, made, ready, last_fw, first_bw, needed, by_replay, nbytes = (
            a[order] for a in (ks_arr, made, ready, last_fw, first_bw, needed, by_replay, nbytes))
        duration = link.copy_ms(nbytes)
        ks = ks_arr.tolist()
    need_ms = np.where(by_replay, issue[needed], start[needed])

    # Planned out-copies (no stalls, each LINK_SLACK longer), then the first node after each that starts once it
    # has ended.
    m = len(ks)
    took = duration.tolist()
    planned_ms = took if regions is not None else (duration * (1 + LINK_SLACK)).tolist()
    d2h_end = [0.0] * m
    lane = 0.0
    for j, ready_end in enumerate(end[ready].tolist()):
        lane = d2h_end[j] = max(ready_end, lane) + planned_ms[j]
    release = np.clip(np.searchsorted(issue, d2h_end, side="left"), last_fw + 1, needed)
    # In-copies laid back to back from the end, each landing by the time it is needed.
    h2d_begin = [0.0] * m
    lane = np.inf
    need = need_ms.tolist()
    for j in np.lexsort((ks_arr, made, need_ms))[::-1].tolist():
        lane = h2d_begin[j] = min(need[j], lane) - planned_ms[j]
    prefetch = np.clip(np.searchsorted(issue, h2d_begin, side="right") - 1, release, needed)
    if regions is not None:
        prefetch = np.clip(regions.snap(prefetch, first_bw), release, needed)
    if not_before is not None:
        prefetch = np.minimum(np.maximum(prefetch, not_before[ks_arr]), needed)

    # The step as it runs: the compute stream waits where a copy is late. At one node: releases, prefetches and
    # waits before its replays, then waits after them (before the node itself); copies out after the node.
    # Copies back issued before one node go in their planned order (a long one needed later must not hold up one
    # needed sooner); the others in copy order.
    slot = np.tile(np.arange(m), 4)
    planned = np.empty(m, dtype=np.int64)
    planned[np.lexsort((np.arange(m), h2d_begin))] = np.arange(m)
    turn = np.concatenate([np.arange(m), np.arange(m), planned, np.arange(m)])
    node = np.concatenate([ready, release, prefetch, needed])
    phase = np.concatenate([np.full(m, 4), np.zeros(m, dtype=np.int64), np.ones(m, dtype=np.int64),
                            3 - by_replay.astype(np.int64)])
    order = np.lexsort((turn, phase, node))
    at_ms = np.select([phase == 4, phase == 3], [end[node], start[node]], issue[node])  # when the event is reached
    d2h = [[0.0, 0.0] for _ in range(m)]
    h2d = [[0.0, 0.0] for _ in range(m)]
    delay, out_lane, in_lane = 0.0, 0.0, 0.0
    waits = np.zeros(sim.n)
    for t, p, j, i in zip(at_ms[order].tolist(), phase[order].tolist(), slot[order].tolist(), node[order].tolist()):
        if p == 4:  # the copy out, after its ready node
            begin = max(t + delay, out_lane)
            out_lane = begin + took[j]
            d2h[j] = [begin, out_lane]
        elif p == 0:  # the compute stream waits for the copy out, then frees the device memory
            wait = max(0.0, d2h[j][1] - (t + delay))
            waits[i] += wait
            delay += wait
        elif p == 1:  # the copy back is issued once the copy out has ended and the lane is free
            begin = max(t + delay, in_lane, d2h[j][1])
            in_lane = begin + took[j]
            h2d[j] = [begin, in_lane]
        else:  # the first use waits for it: a replay reading it (phase 2), else its first backward use (3)
            wait = max(0.0, h2d[j][1] - (t + delay))
            waits[i] += wait
            delay += wait
    d2h, h2d = np.array(d2h).reshape(m, 2), np.array(h2d).reshape(m, 2)
    # The host's calls, by the node they are issued before (the copy out's: the node after its ready node).
    node_ms = sim.profile.node_issue_ms
    replayed = (np.bincount(at, weights=[len(r.nodes) for r in replays], minlength=sim.n) if len(at)
                else np.zeros(sim.n))
    host = (sim.offload_facts.issued + replayed) * node_ms
    later = host_delay(end - issue, host, np.concatenate([ready + 1, release, prefetch, needed]),
                       link.offload_issue_nodes * node_ms / 4)
    act, other = ks_arr >= 0, ks_arr < 0
    return OffloadSchedule(ks_arr[act], nbytes[act], ready[act], release[act], prefetch[act], first_bw[act],
                           needed[act], by_replay[act], d2h[act], h2d[act], float(delay), waits, float(later[-1]),
                           nbytes[other], release[other], prefetch[other], ready[other], needed[other], d2h[other],
                           h2d[other], held if regions is not None else None)


@dataclass
class RegionCopies:
    """Where a runtime that copies what whole regions save (a block compiled on its own, its saved tensors passed
    through saved-tensors hooks when its forward ends) issues and needs each activation's copies: per activation,
    ``ready`` (the copy out is issued after this node: the end of the region's forward) and ``needed`` (the
    region's backward unpacks everything it saved before this node, its first); the copy back can be issued only
    where a region's backward starts (``starts``: those nodes, ascending), so a planned prefetch is moved to the
    last of them at or before it."""

    ready: np.ndarray
    needed: np.ndarray
    starts: np.ndarray

    def snap(self, prefetch: np.ndarray, needed: np.ndarray) -> np.ndarray:
        """``prefetch`` (nodes, of copies needed back before the nodes ``needed``: ``self.needed`` of their
        activations) moved back to a region's backward start, the copies needed at one node together (the runtime
        fetches a region's copies at once): the earliest any of them needs."""
        at = np.searchsorted(self.starts, prefetch, side="right") - 1
        snapped = self.starts[np.maximum(at, 0)]  # none before the first: the first backward start
        earliest: dict[int, int] = {}
        for n, s in zip(needed.tolist(), snapped.tolist()):
            earliest[n] = min(earliest.get(n, s), s)
        return np.array([earliest[n] for n in needed.tolist()], dtype=np.int64)


def host_delay(device_ms: np.ndarray, host_ms: np.ndarray, calls_at: np.ndarray, call_ms: float) -> np.ndarray:
    """How much later each node starts on the device (and, last, the step ends) when the host also makes calls
    of ``call_ms`` each before the nodes ``calls_at``; ``device_ms`` and ``host_ms``: per node, its time on the
    device and the host's time to issue it.

    The host issues the nodes one after another and the device runs each once it is issued and the node before it
    is done: node i starts at ``max(start[i-1] + device_ms[i-1], issued[i])``, which unrolls to
    ``device[i] + max over k <= i of (issued[k] - device[k])``, ``device`` being the device's own prefix times. The
    calls only move ``issued``: a lead the host has over the device absorbs them, and where it has none they delay
    everything after them."""
    n = len(device_ms)
    device = np.concatenate([[0.0], np.cumsum(device_ms)])
    issued = np.cumsum(np.append(host_ms, 0.0))  # node i can start once the host has issued it (the end: all)
    calls = np.cumsum(np.bincount(np.minimum(calls_at, n), minlength=n + 1)) * call_ms
    return np.maximum.accumulate(issued + calls - device) - np.maximum.accumulate(issued - device)
