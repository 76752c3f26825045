"""Turn a set of recomputed activations into a :class:`Plan`, the same way for every solver."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from functools import cached_property
from typing import Any

import numpy as np

from acstudio.plan.model import Plan, ScheduleEntry
from acstudio.plan.validation import use_planner
from acstudio.profile.model import Profile
from acstudio.simulate.modes import REPLAY_MODES, get_mode
from acstudio.simulate.simulator import Simulator


class PlanContext:
    """Per-profile facts every plan repeats (fingerprint, activation sizes, exclusions), computed once."""

    def __init__(self, profile: Profile, simulator: Simulator | None = None) -> None:
        self.profile = profile
        self.sim = simulator or Simulator(profile)
        self.rg = self.sim.replay
        self.node_ids = np.array(self.sim.node_ids, dtype=object)
        self.cache: dict[str, Any] = {}  # what several solvers share (see acstudio.plan.solvers)

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
                  replay_mode: str = "again") -> Plan:
        feasible = peak <= budget
        if stop_reason is None:
            if not recomputed and feasible:
                stop_reason = "nothing to do: baseline fits"
            else:
                stop_reason = "budget met" if feasible else "budget not met"
        return Plan(
            profile_fingerprint=self.profile.fingerprint, solver=solver, budget_bytes=int(budget),
            recomputed=[self.rg.act_ids[k] for k in recomputed], schedule=entries, predicted_peak_bytes=int(peak),
            predicted_peak_node=peak_node, predicted_extra_ms=float(extra_ms), feasible=feasible,
            stop_reason=stop_reason, floor_bytes=self.floor_bytes, baseline_peak_bytes=self.sim.baseline_peak,
            activation_bytes=self.activation_bytes, excluded=self.excluded, replay_mode=replay_mode,
            keep_random=self.rg.keep_random)

    def plan_for_set(self, solver: str, budget: int, recomputed: list[int], stop_reason: str | None = None,
                     mode: str = "again", ratios: dict[int, float] | None = None) -> Plan:
        """Simulate ``recomputed`` (activation indices, in choice order) replayed in ``mode`` and wrap it as a
        plan. ``ratios`` (a solver's own recompute ratios) replace ``bytes / replay time`` in the schedule."""
        sched = get_mode(mode).schedule(self.sim, recomputed)
        peak, pos, _ = get_mode(mode).evaluate(self.sim, sched)
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
        return self.make_plan(solver, budget, recomputed, entries, peak, self.sim.node_ids[pos], sched.extra_ms,
                              stop_reason, replay_mode=mode)


# Plan.load re-derives a plan against its profile with this context (see acstudio.plan.validation).
use_planner(lambda profile, keep_random: PlanContext(profile, Simulator(profile, keep_random=keep_random)))
