"""Replay modes: how a plan's recomputations run, one registered object per mode, each simulated exactly.

A plan names its mode (``Plan.replay_mode``); the simulator, the planner, the rewriter and the exports look the
mode up here instead of branching on it. A mode turns a recompute set into the replays it runs
(:meth:`ReplayMode.schedule`) and evaluates their memory (:meth:`ReplayMode.evaluate`); a mode whose step can also
offload activations prices their copies beside its replays (:mod:`acstudio.simulate.offload`). New modes (for example
how selective activation checkpointing replays a block) register themselves with :func:`register_mode`.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from acstudio.errors import ACStudioError
from acstudio.simulate.offload import OffloadSchedule, offload_schedule
from acstudio.simulate.replay import Replay
from acstudio.simulate.shared import SharedSchedule, evaluate_shared, shared_schedule
from acstudio.simulate.simulator import SimResult, Simulator

# How many times an offload schedule holds copies back past the step's peak node, each time the new peak's: the
# loss's backward spans a few nodes, each a peak in turn once the copies are held past the one before.
PEAK_HOLDS = 4


class ReplayMode:
    """How recomputations are replayed. Subclasses set the class attributes and implement the two methods."""

    name: ClassVar[str]
    summary: ClassVar[str]  # what a user reads next to a plan in this mode
    shares_chains: ClassVar[bool]  # whether the rewriter lets one replay produce the recomputed tensors it passes
    # Whether the step this mode prices can also offload activations (the rewritten step can, the eager SAC form
    # some ops' outputs, the compiled form none: see acstudio.simulate.sac and acstudio.plan.compiled).
    supports_offload: ClassVar[bool] = False
    # Whether a plan in this mode offloads what whole blocks save, each block compiled alone (a policy's regions)
    offloads_by_region: ClassVar[bool] = False

    def schedule(self, sim: Simulator, recomputed: Sequence[int]) -> Any:
        """The replays of activation indices ``recomputed``: an object with ``replays`` (list of
        :class:`~acstudio.simulate.replay.Replay` in the order they run) and ``extra_ms``."""
        raise NotImplementedError

    def evaluate(self, sim: Simulator, schedule: Any, timeline: bool = False):
        """(peak bytes, peak node position, whether during a replay[, per-node category table]); a mode that
        supports offload also takes ``extra``: bytes to add to the activations (:meth:`OffloadSchedule.memory`)."""
        raise NotImplementedError

    def offload(self, sim: Simulator, schedule: Any, offloaded: Collection[int]) -> OffloadSchedule | None:
        """The copies of activation indices ``offloaded`` beside ``schedule``'s replays (None: nothing offloaded)."""
        if not len(offloaded):
            return None
        if not self.supports_offload:
            raise ACStudioError(f"replay mode {self.name!r} cannot offload activations; choose one of "
                                f"{', '.join(n for n, m in REPLAY_MODES.items() if m.supports_offload)}")
        return self._held_at_peak(sim, schedule, offloaded)

    def _held_at_peak(self, sim: Simulator, schedule: Any, offloaded: Collection[int]) -> OffloadSchedule:
        """The copies of ``offloaded``, with those whose copy back would land during the step's peak node held
        back until after it, as long as that lowers the peak (at most :data:`PEAK_HOLDS` times).

        Copies back are issued as late as lets them land on time, which near the end of forward means during the
        loss's backward: the largest temporaries of the step (GPT-2's logits gradient). An activation allocated
        there raises a peak that nothing else can lower, so a plan near the floor could only recompute it; held
        back, it is allocated after that node and the step waits for its copy (a stall the schedule prices).
        The rule depends on nothing but the plan, so the planner, the simulator and the rewriter, which all get
        their schedule here, agree on it."""
        copies = offload_schedule(sim, offloaded, schedule.replays)
        peak, pos, before = self.evaluate(sim, schedule, extra=copies.memory(sim))
        not_before = None
        for _ in range(PEAK_HOLDS):
            early = (copies.release <= pos) & (copies.prefetch <= pos) & (pos < copies.needed)
            if not early.any():
                break
            held = np.zeros(len(sim.replay.bytes), dtype=np.int64) if not_before is None else not_before.copy()
            held[copies.offloaded[early]] = pos + 1
            trial = offload_schedule(sim, offloaded, schedule.replays, held)
            result = self.evaluate(sim, schedule, extra=trial.memory(sim))
            if result[0] >= peak:
                break
            copies, not_before, (peak, pos, before) = trial, held, result
        copies.evaluated = (schedule, (peak, pos, before))
        return copies

    def evaluate_with(self, sim: Simulator, schedule: Any, offload: OffloadSchedule | None, timeline: bool = False):
        """:meth:`evaluate` with the offloaded activations' memory taken out."""
        if offload is None:
            return self.evaluate(sim, schedule, timeline)
        if not timeline and offload.evaluated is not None and offload.evaluated[0] is schedule:
            return offload.evaluated[1]  # evaluated while holding copies back (_held_at_peak)
        return self.evaluate(sim, schedule, timeline, extra=offload.memory(sim))

    def may_keep_back(self, sim: Simulator, recomputed: Sequence[int], k: int) -> bool:
        """Whether the planner may keep activation ``k`` back from ``recomputed`` on the simulated time alone (a
        mode says no where keeping it would add a cost the simulator does not price)."""
        return True

    def peak(self, sim: Simulator, recomputed: Sequence[int], offloaded: Collection[int] = ()
             ) -> tuple[int, int, float]:
        """(peak bytes, peak node position, extra ms) of activation indices ``recomputed`` (and ``offloaded``:
        their stalls and issue time count in the extra time)."""
        schedule = self.schedule(sim, recomputed)
        offload = self.offload(sim, schedule, offloaded)
        peak, pos, _ = self.evaluate_with(sim, schedule, offload)
        return peak, pos, schedule.extra_ms + (offload.extra_ms if offload else 0.0)

    def simulate(self, sim: Simulator, recomputed: Collection[str], offloaded: Collection[str] = ()) -> SimResult:
        """Peak, extra time, per-node timeline and per-activation replay time of activation ids ``recomputed``
        (and ``offloaded``); a replay's time goes to its owner (its first output), 0 to what it produces on the
        way."""
        schedule = self.schedule(sim, sim.indices(recomputed))
        offload = self.offload(sim, schedule, offload_indices(sim, offloaded))
        peak, pos, _, table = self.evaluate_with(sim, schedule, offload, timeline=True)
        ids = sim.replay.act_ids
        per = {ids[k]: (r.time_ms if k == r.outputs[0] else 0.0) for r in schedule.replays for k in r.outputs}
        stall = offload.extra_ms if offload else 0.0
        clock = sim.clock([r.at for r in schedule.replays], [r.time_ms for r in schedule.replays],
                          offload.waits if offload else None)
        return SimResult(peak_bytes=peak, peak_node=sim.node_ids[pos], extra_ms=schedule.extra_ms + stall,
                         timeline=table, clock=clock, recompute_ms=per, offload=offload)


def offload_indices(sim: Simulator, offloaded: Collection[str]) -> list[int]:
    """Activation indices of ids ``offloaded``; an id that names no activation, or one that cannot be offloaded,
    is refused with the reason."""
    out = []
    for a in offloaded:
        k = sim.replay.act_index.get(a)
        if k is None:
            raise ACStudioError(f"{a} is not an activation of this profile")
        why = sim.offload_facts.reason[k]
        if why:
            raise ACStudioError(f"{a} cannot be offloaded: {why}")
        out.append(k)
    return out


REPLAY_MODES: dict[str, ReplayMode] = {}


def register_mode(mode: ReplayMode) -> ReplayMode:
    REPLAY_MODES[mode.name] = mode
    return mode


def get_mode(name: str) -> ReplayMode:
    try:
        return REPLAY_MODES[name]
    except KeyError:
        raise ACStudioError(f"unknown replay mode {name!r}; choose one of {', '.join(REPLAY_MODES)}") from None


def simulate_plan(sim: Simulator, recomputed: Collection[str], mode: str, offloaded: Collection[str] = ()
                  ) -> SimResult:
    """The simulated step for activation ids ``recomputed`` replayed in ``mode``, ``offloaded`` copied to the host
    and back."""
    return get_mode(mode).simulate(sim, recomputed, offloaded)


@dataclass
class AgainSchedule:
    replays: list[Replay]
    mask: np.ndarray
    keep_until: np.ndarray
    transient: np.ndarray

    @property
    def extra_ms(self) -> float:
        return float(sum(r.time_ms for r in self.replays))


class ReplayAgain(ReplayMode):
    """μ-TWO's model: every recomputation replays its own chain back to resident tensors, right before its first
    backward use (a recomputed tensor met on the way is replayed as a transient, again)."""

    name = "again"
    summary = "each recomputation replays its chain from kept tensors"
    shares_chains = False
    supports_offload = True

    def schedule(self, sim: Simulator, recomputed: Sequence[int]) -> AgainSchedule:
        rg = sim.replay
        exps, keep_until, transient = sim.schedule_facts(list(recomputed))
        mask = np.zeros(len(rg.bytes), dtype=bool)
        mask[list(recomputed)] = True
        order = sorted(recomputed, key=lambda k: (rg.first_bw[k], rg.created[k], k))
        replays = [Replay(int(rg.first_bw[k]), (k,), exps[k].chain, exps[k].sources, exps[k].params, exps[k].nodes,
                          exps[k].time_ms, int(transient[k])) for k in order]
        return AgainSchedule(replays, mask, keep_until, transient)

    def evaluate(self, sim: Simulator, schedule: AgainSchedule, timeline: bool = False, extra=None):
        return sim.evaluate(schedule.mask, schedule.keep_until, schedule.transient, timeline, extra)

    def simulate(self, sim: Simulator, recomputed: Collection[str], offloaded: Collection[str] = ()) -> SimResult:
        return super().simulate(sim, recomputed, offloaded) if offloaded else sim.simulate(recomputed)


class ReplayShared(ReplayMode):
    """One replay also produces the recomputed tensors it passes and keeps them until their last backward use:
    how ``torch.utils.checkpoint`` around blocks runs (see :mod:`acstudio.simulate.shared`)."""

    name = "shared"
    summary = "shared-chain replays (each block's forward replayed once)"
    shares_chains = True
    supports_offload = True

    def schedule(self, sim: Simulator, recomputed: Sequence[int]) -> SharedSchedule:
        return shared_schedule(sim, recomputed)

    def evaluate(self, sim: Simulator, schedule: SharedSchedule, timeline: bool = False, extra=None):
        return evaluate_shared(sim, schedule, timeline, extra)


register_mode(ReplayAgain())
register_mode(ReplayShared())
