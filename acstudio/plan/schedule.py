"""Turn a set of recomputed activations into a :class:`Plan`, the same way for every solver."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable, Sequence
from functools import cached_property
from typing import Any

import numpy as np

from acstudio.plan.model import Plan, ScheduleEntry
from acstudio.profile.model import Profile
from acstudio.simulate.modes import REPLAY_MODES, get_mode, simulate_plan
from acstudio.simulate.offload import OffloadSchedule
from acstudio.simulate.simulator import SimResult, Simulator

# Share of the host's free memory a plan may offload into when no cap is given: the rest stays for the data loader,
# the page cache and whatever else the training process keeps on the host.
HOST_MEMORY_SHARE = 0.5


class PlanContext:
    """Per-profile facts every plan repeats (fingerprint, activation sizes, exclusions), computed once, and what
    the solvers may do besides recomputing: offload activations to host memory (``offload``), within
    ``host_memory`` bytes (default: :data:`HOST_MEMORY_SHARE` of the free host memory the profile recorded).

    A context offloads only when asked, so that a caller that shows or runs plans as recompute sets gets no plan
    it cannot show; :func:`acstudio.plan.solvers.plan` and ``acstudio plan`` ask by default."""

    def __init__(self, profile: Profile, simulator: Simulator | None = None, *, offload: bool = False,
                 host_memory: int | None = None) -> None:
        self.profile = profile
        self.sim = simulator or Simulator(profile)
        self.rg = self.sim.replay
        self.node_ids = np.array(self.sim.node_ids, dtype=object)
        self.cache: dict[str, Any] = {}  # what several solvers share (see acstudio.plan.solvers.registry)
        self.offload = offload
        self.host_memory = (int(HOST_MEMORY_SHARE * profile.link.host_bytes) if host_memory is None
                            else int(host_memory))

    @property
    def may_offload(self) -> bool:
        """Whether solvers consider offload: asked for, with host memory to offload into, and on a GPU (on a CPU
        device the host memory is the device memory: a copy frees nothing)."""
        return (self.offload and self.host_memory > 0
                and self.profile.environment.get("device_type", "cpu") != "cpu")

    def without_offload(self) -> PlanContext:
        """This context (same simulator and cache) with offload turned off."""
        ctx = copy.copy(self)
        ctx.offload = False
        return ctx

    @cached_property
    def activation_bytes(self) -> dict[str, int]:
        return {a: int(b) for a, b in zip(self.rg.act_ids, self.rg.bytes)}

    @cached_property
    def excluded(self) -> dict[str, str]:
        return {a: why for a, why in zip(self.rg.act_ids, self.rg.reason) if why}

    @cached_property
    def floor_bytes(self) -> int:
        """The lowest peak activation checkpointing reaches: every candidate recomputed, in the best replay mode."""
        every = self.rg.candidates
        return min([self.sim.floor_bytes] + [m.peak(self.sim, every)[0] for name, m in REPLAY_MODES.items()
                                             if name != "again"])

    def entry(self, k: int, sources: Iterable[int], params: Iterable[str], nodes: np.ndarray, time_ms: float,
              ratio: float) -> ScheduleEntry:
        rg, ids = self.rg, self.sim.node_ids
        return ScheduleEntry(
            activation=rg.act_ids[k], bytes=int(rg.bytes[k]), freed_after=ids[rg.last_fw[k]],
            recompute_before=ids[rg.first_bw[k]], sources=[rg.act_ids[s] for s in sources] + list(params),
            replay=self.node_ids[nodes].tolist(), recompute_ms=float(time_ms), ratio=float(ratio))

    def execution_order(self, ks: Iterable[int]) -> list[int]:
        rg = self.rg
        return sorted(ks, key=lambda k: (rg.first_bw[k], rg.created[k], k))

    def make_plan(self, solver: str, budget: int, recomputed: list[int], entries: list[ScheduleEntry],
                  peak: int, peak_node: str, extra_ms: float, stop_reason: str | None = None,
                  replay_mode: str = "again", offload: OffloadSchedule | None = None) -> Plan:
        feasible = peak <= budget
        if stop_reason is None:
            if not recomputed and offload is None and feasible:
                stop_reason = "nothing to do: baseline fits"
            else:
                stop_reason = "budget met" if feasible else "budget not met"
        return Plan(
            profile_fingerprint=self.profile.fingerprint, solver=solver, budget_bytes=int(budget),
            recomputed=[self.rg.act_ids[k] for k in recomputed], schedule=entries, predicted_peak_bytes=int(peak),
            predicted_peak_node=peak_node, predicted_extra_ms=float(extra_ms), feasible=feasible,
            stop_reason=stop_reason, floor_bytes=self.floor_bytes, baseline_peak_bytes=self.sim.baseline_peak,
            activation_bytes=self.activation_bytes, excluded=self.excluded, replay_mode=replay_mode,
            keep_random=self.rg.keep_random, **offload_fields(self.rg, offload))

    def plan_for_set(self, solver: str, budget: int, recomputed: list[int], stop_reason: str | None = None,
                     mode: str = "again", ratios: dict[int, float] | None = None, offloaded: Sequence[int] = ()
                     ) -> Plan:
        """Simulate ``recomputed`` (activation indices, in choice order) replayed in ``mode``, and ``offloaded``
        copied to the host and back, and wrap it as a plan. ``ratios`` (a solver's own recompute ratios) replace
        ``bytes / replay time`` in the schedule."""
        replay = get_mode(mode)
        sched = replay.schedule(self.sim, recomputed)
        offload = replay.offload(self.sim, sched, offloaded)
        if offload is not None and not offload.offloaded.size:
            offload = None  # none of them could be offloaded beside these replays
        peak, pos, _ = replay.evaluate_with(self.sim, sched, offload)
        made = {k: r for r in sched.replays for k in r.outputs}
        recomputed = [k for k in recomputed if k in made]  # a mode may free less than asked ("sac": whole ops)
        entries = []
        for k in self.execution_order(recomputed):
            r = made[k]
            if k == r.outputs[0]:
                ratio = ratios[k] if ratios else self.rg.bytes[k] / max(r.time_ms, 1e-9)
                entries.append(self.entry(k, r.sources, r.params, r.nodes, r.time_ms, ratio))
            else:  # produced by an earlier replay on its way
                entries.append(dataclasses.replace(self.entry(k, (), (), r.nodes[:0], 0.0, 0.0),
                                                   recompute_before=self.sim.node_ids[r.at]))
        stall = offload.extra_ms if offload is not None else 0.0
        return self.make_plan(solver, budget, recomputed, entries, peak, self.sim.node_ids[pos], sched.extra_ms + stall,
                              stop_reason, replay_mode=mode, offload=offload)

    def simulation(self, plan: Plan) -> SimResult:
        """``plan``'s simulated step in its replay mode (timeline included), simulated once and kept on the plan."""
        if plan.simulation is None:
            plan.simulation = simulate_plan(self.sim, plan.recomputed, plan.replay_mode, plan.offloaded)
        return plan.simulation


def offload_fields(rg, offload: OffloadSchedule | None) -> dict[str, Any]:
    """The plan fields that say what a plan offloads (by first backward use) and what that costs."""
    if offload is None:
        return {}
    order = sorted(offload.offloaded.tolist(), key=lambda k: (rg.first_bw[k], rg.created[k], k))
    return {"offloaded": [rg.act_ids[k] for k in order], "offload_bytes": offload.moved_bytes,
            "offload_stall_ms": offload.stall_ms, "host_bytes": offload.host_bytes}

