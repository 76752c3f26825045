"""What sets a plan's peak: the node that holds it and how its bytes split between what activation
checkpointing can free and what it cannot (model state, optimizer state, the loss's temporaries).

On language models the floor usually sits in the loss head (BERT: ``_log_softmax_backward_data`` with gigabytes of
logits gradients), where no checkpointing plan can go lower; users should read that, not guess it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from acstudio.plan.model import Plan
from acstudio.plan.schedule import PlanContext
from acstudio.simulate.replay import FORWARD_REGIONS
from acstudio.simulate.simulator import TIMELINE_CATEGORIES, SimResult
from acstudio.units import format_bytes

_WORDS = {"parameter": "parameters and buffers", "gradient": "gradients", "optimizer_state": "optimizer state",
          "recompute_transients": "replay temporaries", "other": "temporaries, batch and workspace"}


@dataclass
class PeakReport:
    node: str
    target: str
    module: str
    region: str
    total: int
    freeable: int  # activations in memory there that checkpointing could still free
    fixed_activations: int  # activations there that are no candidates (random ops, in-place targets, ...)
    parts: dict[str, int]  # the rest, by timeline category

    @property
    def where(self) -> str:
        op = self.target.removeprefix("aten.").removesuffix(".default")
        return f"{self.module or self.region} ({op}, {self.region})"

    def summary(self) -> str:
        """One line: where the peak is and what it is made of, largest part first."""
        parts = sorted(((v, _WORDS[k]) for k, v in self.parts.items() if v > 0), reverse=True)
        fixed = ", ".join(f"{format_bytes(v)} {w}" for v, w in parts)
        acts = f"{format_bytes(self.freeable)} activations checkpointing can free"
        if self.fixed_activations:
            acts += f", {format_bytes(self.fixed_activations)} activations it cannot"
        return f"peak {format_bytes(self.total)} at {self.node} in {self.where}: {acts}; {fixed}"


def explain_peak(ctx: PlanContext, plan: Plan, result: SimResult | None = None) -> PeakReport:
    """Split ``plan``'s predicted peak at its peak node; ``result``: the plan already simulated in its replay mode
    (else the simulation the plan carries, simulated now if it has none)."""
    rg, profile = ctx.rg, ctx.profile
    result = result or ctx.simulation(plan)
    pos = profile.node_index[result.peak_node]
    row = dict(zip(TIMELINE_CATEGORIES, result.timeline[pos].tolist()))
    alive, on_host = activations_at(ctx, plan, result, pos)
    recomputed = np.zeros(len(rg.bytes), dtype=bool)
    recomputed[ctx.sim.indices(plan.recomputed)] = True
    freeable = int(rg.bytes[alive & ~on_host & rg.is_candidate & ~recomputed].sum())
    acts = row.pop("retained_activations")
    nd = profile.nodes[pos]
    return PeakReport(node=nd.id, target=nd.target, module=_module_of(profile, pos), region=nd.region,
                      total=int(sum(row.values()) + acts), freeable=freeable,
                      fixed_activations=max(0, acts - freeable), parts=row)


def activations_at(ctx: PlanContext, plan: Plan, result: SimResult, pos: int) -> tuple[np.ndarray, np.ndarray]:
    """(in memory, on the host): which activations ``plan`` holds at node position ``pos``, by activation index,
    ``result`` being its simulation. A recomputed activation is out of memory between its last forward use and its
    first backward one; an offloaded one is on the host from its release to its prefetch."""
    rg = ctx.rg
    recomputed = np.zeros(len(rg.bytes), dtype=bool)
    recomputed[ctx.sim.indices(plan.recomputed)] = True
    alive = (rg.created <= pos) & (pos <= rg.last_bw) & ~(recomputed & (rg.last_fw < pos) & (pos < rg.first_bw))
    on_host = np.zeros_like(alive)
    if result.offload is not None:
        off = result.offload
        on_host[off.offloaded[(off.release <= pos) & (pos < off.prefetch)]] = True
    return alive, on_host & alive


def _module_of(profile, pos: int) -> str:
    """The node's module; for a backward node, which records none, the module of the nearest forward value it
    reads (walking back over backward nodes), or ``"the loss"`` when that value belongs to the loss."""
    seen, frontier = set(), [pos]
    while frontier:
        nd = profile.nodes[frontier.pop(0)]
        if nd.module or nd.region in FORWARD_REGIONS:
            return nd.module or "the loss"
        for u in nd.inputs:
            j = profile.node_index[u]
            if j not in seen and profile.nodes[j].op != "placeholder":
                seen.add(j)
                frontier.append(j)
    return ""


def floor_sentence(ctx: PlanContext) -> str:
    """"the floor is <where>: <its largest part>" for the recompute-all plan, the lowest peak checkpointing reaches."""
    from acstudio.plan.solvers import floor_solver, get_solver

    report = explain_peak(ctx, get_solver(floor_solver()).solve(ctx, 0))
    largest = max(report.parts, key=report.parts.get)
    return (f"the floor is {report.where}: {format_bytes(report.parts[largest])} of {_WORDS[largest]} "
            f"(of {format_bytes(report.total)}); checkpointing cannot go below it")
