"""Offload in the rewritten step: activations copied to a page-locked host pool after forward and back before backward.

:func:`insert_offload` adds, for each offloaded activation, the nodes the simulator's schedule places
(:mod:`acstudio.simulate.offload`): a copy to the host right after its last forward write, a release before the
node where the copy is predicted done, a copy back (which allocates the device tensor) where the prefetch is
issued, and a wait right before it is needed again (its first backward use, or before the replays that read it
as a source, when one of them comes first) that returns the tensors backward and those replays read, rebuilt
over the fetched storage with their original sizes, strides and offsets. Whole storages are copied as bytes, so every
value comes back bit for bit.

The nodes call the four methods of one :class:`~acstudio.hostcopy.OffloadRuntime` (a submodule of the step), which
says how the copies are ordered on CUDA with events only (no host synchronisation on the hot path) and keeps the
pool, allocated once on the first step after checking that the host has the memory, and reused by every step
after. On a CPU device the same nodes copy into a preallocated host buffer and back, synchronously: the step runs
the offload logic, but device and host memory are the same memory."""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from acstudio.errors import ACStudioError, RewriteError
from acstudio.hostcopy import OffloadRuntime
from acstudio.rewrite.facts import FORWARD_REGIONS
from acstudio.rewrite.passes import RewriteContext

RUNTIME_ATTR = "acstudio_offload"


# Graph targets: plain functions, so FX's generated code calls them by name.
def offload_to_host(runtime: OffloadRuntime, slot: int, tensor: torch.Tensor) -> None:
    runtime.to_host(slot, tensor)


def offload_release(runtime: OffloadRuntime, slot: int, source: torch.Tensor, *tensors: torch.Tensor) -> None:
    """Free ``source``'s storage once its copy is done (``source`` is passed so that FX keeps it until here);
    ``tensors`` are the views of it backward reads, rebuilt by :func:`offload_wait`."""
    runtime.release(slot, tensors)


def offload_prefetch(runtime: OffloadRuntime, slot: int) -> torch.Tensor:
    return runtime.prefetch(slot)


def offload_wait(runtime: OffloadRuntime, slot: int, buffer: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return runtime.wait(slot, buffer)


@dataclass
class Offload:
    """Where one offloaded activation's copies run in the rewritten step (ids of original nodes)."""

    activation: str
    bytes: int
    copied_after: str
    released_before: str
    prefetched_before: str
    first_bw_use: str
    needed_before: str  # the node before which (before the replays inserted there, if one reads it) it is back


def insert_offload(gm: fx.GraphModule, profile, schedule, facts) -> list[Offload]:
    """Add the offload nodes of ``schedule`` (an :class:`~acstudio.simulate.offload.OffloadSchedule` of
    ``profile``; ``facts``: its :class:`~acstudio.simulate.offload.OffloadFacts`) to ``gm``, a rewrite of the
    graph ``profile`` measured whose original nodes keep their ``ac_id``."""
    graph = gm.graph
    by_id = {n.meta["ac_id"]: n for n in graph.nodes}
    original = [by_id[r.id] for r in profile.nodes]
    tensors = {t.id: t for t in profile.tensors}
    held: dict[str, list[str]] = {}  # original node id -> storages it holds
    for t in profile.tensors:
        for h in (t.created_at, *t.aliases):
            held.setdefault(h, []).append(t.id)
    act_ids = [a.id for a in profile.activations]
    ks = schedule.offloaded.tolist()
    runtime = OffloadRuntime([act_ids[k] for k in ks], [int(b) for b in schedule.bytes])
    gm.add_submodule(RUNTIME_ATTR, runtime)
    first = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first):
        rt = graph.get_attr(RUNTIME_ATTR)
    _label(rt, "offload.runtime", "forward", [])

    def first_replay_node(i: int) -> fx.Node:
        """The first node of the replays inserted before original node ``i`` (or ``i`` itself)."""
        anchor = original[i]
        while anchor.prev.meta.get("ac_role") in ("recompute", "rng") and "ac_of" in anchor.prev.meta:
            anchor = anchor.prev
        return anchor

    # Anchors taken before any offload node goes in: nodes inserted before one anchor keep their insertion order.
    before_replays = {i: first_replay_node(i) for i in {*schedule.release.tolist(), *schedule.prefetch.tolist(),
                                                        *schedule.needed[schedule.by_replay].tolist()}}
    after_ready = {int(i): original[i].next for i in set(schedule.ready.tolist())}
    placed = []
    for slot, k in enumerate(ks):
        sid = act_ids[k]
        t = tensors[sid]
        holders = [by_id[h] for h in (t.created_at, *t.aliases)]
        forward = [h for h in holders if h.meta["ac_region"] in FORWARD_REGIONS]
        source = original[facts.source[k]]
        wanted = [h for h in forward if any(u.meta["ac_region"] not in FORWARD_REGIONS for u in h.users)]
        with graph.inserting_before(after_ready[int(schedule.ready[slot])]):
            node = graph.call_function(offload_to_host, (rt, slot, source))
        _label(node, f"{sid}@d2h", "forward", [])
        with graph.inserting_before(before_replays[int(schedule.release[slot])]):
            release = graph.call_function(offload_release, (rt, slot, source, *wanted))
        _label(release, f"{sid}@release", "forward", [])
        placed.append((slot, sid, holders, wanted, release))
    fetched = {}
    # After every release (a release and a prefetch may share a node), in the order the schedule issues them.
    for slot, sid, *_ in sorted(placed, key=lambda p: schedule.h2d[p[0], 0]):
        with graph.inserting_before(before_replays[int(schedule.prefetch[slot])]):
            fetched[slot] = graph.call_function(offload_prefetch, (rt, slot))
        _label(fetched[slot], f"{sid}@h2d", "backward", [f"{sid}@h2d"])
    records = []
    for slot, sid, holders, wanted, release in placed:
        needed = int(schedule.needed[slot])
        anchor = before_replays[needed] if schedule.by_replay[slot] else original[needed]
        with graph.inserting_before(anchor):
            views = graph.call_function(offload_wait, (rt, slot, fetched[slot]))
            copies = [graph.call_function(operator.getitem, (views, j)) for j in range(len(wanted))]
        _label(views, f"{sid}@wait", "backward", [f"{sid}@h2d"])
        position = {n: i for i, n in enumerate(graph.nodes)}
        for j, (h, copy) in enumerate(zip(wanted, copies)):
            _label(copy, f"{sid}@wait.{j}", "backward", [f"{sid}@h2d"])
            copy.meta.update({key: h.meta[key] for key in ("ac_shape", "ac_dtype", "val") if key in h.meta})
            for u in list(h.users):
                if position[u] > position[copy]:
                    u.replace_input_with(h, copy)
        for h in holders:  # backward views of the activation now alias the fetched storage
            if h.meta["ac_region"] not in FORWARD_REGIONS:
                storages = h.meta.get("ac_storages", held.get(h.meta["ac_id"], []))
                h.meta["ac_storages"] = [f"{sid}@h2d" if s == sid else s for s in storages]
        if position[fetched[slot]] < position[release]:  # the copy back is ordered after the copy out through it
            raise RewriteError(f"offloaded activation {sid} would be fetched back before its device memory is "
                               "released")
        for h in holders:
            if h.meta["ac_region"] in FORWARD_REGIONS:
                late = [u for u in h.users if position[u] > position[release]]
                if late:
                    raise RewriteError(f"offloaded activation {sid} is still read by {late[0].meta['ac_id']} after "
                                       "its device memory is released")
        records.append(Offload(sid, int(schedule.bytes[slot]), profile.nodes[int(schedule.ready[slot])].id,
                               profile.nodes[int(schedule.release[slot])].id,
                               profile.nodes[int(schedule.prefetch[slot])].id,
                               profile.nodes[int(schedule.first_bw[slot])].id, profile.nodes[needed].id))
    return records


class OffloadActivations:
    """Inserts the copies of the plan's offloaded activations where the simulator schedules them beside the plan's
    replays (so it runs after the replays are in place)."""

    name = "offload"

    def requires(self, gm: fx.GraphModule, ctx: RewriteContext) -> None:
        pass

    def call(self, gm: fx.GraphModule, ctx: RewriteContext) -> bool:
        from acstudio.simulate.modes import offload_indices
        from acstudio.simulate.simulator import Simulator

        sim = Simulator(ctx.profile, keep_random=ctx.keep_random)
        try:
            ks = offload_indices(sim, ctx.offloaded)
            schedule = ctx.mode.offload(sim, ctx.mode.schedule(sim, sim.indices(ctx.recomputed)), ks)
        except ACStudioError as exc:
            raise RewriteError(str(exc)) from None
        dropped = [sim.replay.act_ids[k] for k in sorted(set(ks) - set(schedule.offloaded.tolist()))]
        if dropped:
            raise RewriteError(f"activation {dropped[0]} cannot be offloaded in this plan: it is recomputed")
        ctx.offloads = insert_offload(gm, ctx.profile, schedule, sim.offload_facts)
        return True

    def ensures(self, gm: fx.GraphModule, ctx: RewriteContext) -> None:
        placed = [o.activation for o in ctx.offloads]
        if set(placed) != set(ctx.offloaded):
            raise AssertionError(f"offloaded {placed}, planned {ctx.offloaded}")


def _label(node: fx.Node, ac_id: str, region: str, storages: list[str]) -> None:
    node.meta.update(ac_id=ac_id, ac_role="offload", ac_region=region, ac_storages=storages, ac_shape="",
                     ac_dtype="")
