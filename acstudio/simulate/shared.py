"""Shared-chain replays: what the rewriter executes in replay mode ``"shared"``, simulated exactly.

μ-TWO's model (:mod:`acstudio.simulate.simulator`) replays each recomputed activation's chain back to the nearest
resident tensor, so a layer whose consecutive activations are all recomputed replays its chain once per
activation, in reverse order: quadratic time. With shared chains a replay that passes through another recomputed
activation that has not been brought back yet *produces it too* and keeps it until its last backward use (what
block checkpointing does; dodrio's ``rcomp_outs``): each chain runs once, but what it produces is held earlier.

The procedure is the rewriter's: recomputed activations are taken in first-backward-use order (then forward
creation order); one not yet produced gets a replay right before its first backward use. The replay walks back
over the stop graph (:class:`~acstudio.simulate.replay.ReplayGraph`) and stops at retained activations and at
recomputed activations resident at that point; a recomputed activation met on the way that was never produced
joins the replay's outputs (it is back in memory from this insertion point to its last backward use), one that
was produced earlier but is gone again is replayed as a transient. Memory is then the simulator's, with each
produced activation back from its replay's insertion point and each replay's high-water mark counting all the
outputs it keeps.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from acstudio.simulate.replay import Replay
from acstudio.simulate.simulator import Simulator


@dataclass
class SharedSchedule:
    replays: list[Replay]
    back: np.ndarray  # per activation: node before which a recomputed one is back in memory (-1: not recomputed)
    keep_until: np.ndarray  # per retained activation: the latest replay reading it (-1: none)

    @property
    def extra_ms(self) -> float:
        return float(sum(r.time_ms for r in self.replays))


def shared_schedule(sim: Simulator, recomputed: Collection[int]) -> SharedSchedule:
    """The replays of the activation indices ``recomputed`` under shared chains, in the order they run."""
    rg = sim.replay
    n_act = len(rg.bytes)
    mask = np.zeros(n_act, dtype=bool)
    mask[list(recomputed)] = True
    back = np.full(n_act, -1, dtype=np.int64)
    keep_until = np.full(n_act, -1, dtype=np.int64)
    # Recomputed activations by creating node: a replay that runs a creator produces what it creates (the other
    # outputs of a multi-output node, which no stop reaches, included).
    made_by: dict[int, list[int]] = {}
    for k in np.flatnonzero(mask):
        made_by.setdefault(int(rg.created[k]), []).append(int(k))
    creators = np.array(sorted(made_by), dtype=np.int64)
    replays = []
    for a in sorted(recomputed, key=lambda k: (rg.first_bw[k], rg.created[k], k)):
        if back[a] >= 0:
            continue
        at = int(rg.first_bw[a])
        chain, outputs, sources = [a], [a], set()
        seen, stack = {a}, [a]
        while stack:
            while stack:
                for s in rg.stops[stack.pop()]:
                    if s in seen:
                        continue
                    seen.add(s)
                    if mask[s] and not (0 <= back[s] <= at <= rg.last_bw[s]):
                        chain.append(s)
                        stack.append(s)
                        if back[s] < 0:
                            outputs.append(s)
                    else:
                        sources.add(s)
            nodes = rg.chain_nodes(chain)
            for i in np.intersect1d(nodes, creators, assume_unique=True):
                for s in made_by[int(i)]:
                    if s not in seen and back[s] < 0:
                        seen.add(s)
                        chain.append(s)
                        outputs.append(s)
                        stack.append(s)
        back[outputs] = at
        for s in sources:
            if not mask[s]:
                keep_until[s] = at
        params = tuple(sorted({p for c in chain for p in rg.params[c]}))
        replays.append(Replay(at, tuple(outputs), tuple(chain), tuple(sorted(sources)), params, nodes,
                                    float(rg.run_ms[nodes].sum()), rg.transient_bytes(outputs, nodes)))
    return SharedSchedule(replays, back, keep_until)


def evaluate_shared(sim: Simulator, schedule: SharedSchedule, timeline: bool = False,
                    extra: tuple[np.ndarray, np.ndarray] | None = None, rng_states: bool = True):
    """Peak (bytes, node position, whether during a replay before that node) of a shared schedule, and with
    ``timeline`` the per-node category table (as :meth:`Simulator.evaluate`). ``extra``: bytes held during and
    just before each node besides the activations (counted as activations); ``rng_states``: see
    :meth:`Simulator.activation_memory`."""
    rg = sim.replay
    mask = schedule.back >= 0
    acts_node, acts_between = sim.activation_memory(mask, schedule.keep_until, schedule.back, rng_states)
    if extra is not None:
        acts_node, acts_between = acts_node + extra[0], acts_between + extra[1]
    at = np.array([r.at for r in schedule.replays], dtype=np.int64)
    out_bytes = np.array([int(rg.bytes[list(r.outputs)].sum()) for r in schedule.replays], dtype=np.int64)
    # Replays before the same node run one after the other; the outputs of the earlier ones stay.
    held = np.zeros(len(at), dtype=np.int64)
    for j in range(1, len(at)):
        if at[j] == at[j - 1]:
            held[j] = held[j - 1] + out_bytes[j - 1]
    transient = np.array([r.transient for r in schedule.replays], dtype=np.int64)
    return sim.peak_with_replays(acts_node, acts_between, at, held, transient, timeline)
