"""The memory timeline's x axis and the lifetime marks of one activation. No Qt in here.

The graph's input placeholders (parameters, optimizer state, the batch: about 2300 of ResNet-152's nodes)
come first in node order but take no time and allocate nothing while the step runs, so the axis starts after
them: either at execution order 0 or at 0 ms.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from acstudio.plan.model import Plan
from acstudio.profile.model import Profile
from acstudio.simulate.offload import OffloadSchedule
from acstudio.simulate.simulator import SimResult

AXES = {"time": "time (ms)", "order": "execution order (ops)"}
ON_HOST = "freed, on the host"  # an offloaded activation's device memory is freed (its copy to the host ended)
COPIED_BACK = "copied back"  # the copy back to the device is issued (and its memory allocated again)


@dataclass(frozen=True)
class TimelineAxis:
    """Where each node sits on the x axis: node ``i`` spans ``edges[i] .. edges[i + 1]``; nodes before
    ``start`` (the input placeholders) have zero width at 0."""

    mode: str
    start: int
    edges: np.ndarray  # len(nodes) + 1, non-decreasing

    @classmethod
    def of(cls, profile: Profile, mode: str) -> TimelineAxis:
        n = len(profile.nodes)
        start = next((i for i, node in enumerate(profile.nodes) if node.region != "input"), n)
        if mode == "time":
            width = profile.node_step_ms.copy()
        elif mode == "order":
            width = np.ones(n)
        else:
            raise ValueError(f"unknown timeline axis {mode!r}; choose one of {', '.join(AXES)}")
        width[:start] = 0.0
        return cls(mode=mode, start=start, edges=np.concatenate([[0.0], np.cumsum(width)]))

    @property
    def label(self) -> str:
        return AXES[self.mode]

    def x(self, i: int | np.ndarray) -> float | np.ndarray:
        """Left edge of node ``i`` on the axis."""
        return self.edges[i]

    def node_at(self, x: float) -> int | None:
        """The node drawn at ``x`` (``None`` outside the step)."""
        if not self.edges[self.start] <= x < self.edges[-1]:
            return None
        return int(np.searchsorted(self.edges, x, side="right")) - 1

    def nodes_between(self, x0: float, x1: float) -> tuple[int, int]:
        """First and last node drawn between ``x0`` and ``x1`` (last < first when none is)."""
        lo = max(int(np.searchsorted(self.edges, x0, side="right")) - 1, self.start)
        hi = min(int(np.searchsorted(self.edges, x1, side="left")) - 1, len(self.edges) - 2)
        return lo, hi


def lifetime_marks(profile: Profile, plan: Plan | None, activation_id: str,
                   offload: OffloadSchedule | None = None) -> list[tuple[str, int]]:
    """The moments of an activation's life, as (what, node index): made, last forward use, first backward use,
    and, when the plan recomputes it, where the recomputation is inserted, or, when the plan's simulated
    ``offload`` copies it to the host, where its device memory is freed and where the copy back is issued;
    then its last use."""
    act = profile.activation_by_id[activation_id]
    index = profile.node_index
    marks = [("made", index[act.created_at]), ("last forward use", index[act.last_fw_use])]
    entry = next((e for e in plan.schedule if e.activation == activation_id), None) if plan is not None else None
    if entry is not None:
        marks.append(("recomputed", index[entry.recompute_before]))
    elif offload is not None:
        k = profile.activations.index(act)
        at = np.flatnonzero(offload.offloaded == k)
        if at.size:
            marks += [(ON_HOST, int(offload.release[at[0]])), (COPIED_BACK, int(offload.prefetch[at[0]]))]
    marks += [("first backward use", index[act.first_bw_use]), ("last use", index[act.last_bw_use])]
    return marks


def copy_spans(axis: TimelineAxis, result: SimResult) -> tuple[np.ndarray, np.ndarray]:
    """The device-to-host and the host-to-device copies of the simulated step ``result`` (one that offloads) as
    (copies, 2) spans on ``axis``, the offloaded activations' first and then the other storages a region runtime
    copies (they share the lanes): a time in the step is drawn at the node running then, on the simulator's clock
    (the recomputations before a node, and the waits for late copies there, at its left edge)."""
    clock, offload = result.clock, result.offload
    times = np.append(np.column_stack([clock.issue, clock.start]).ravel(), clock.step_ms)
    xs = np.append(np.repeat(axis.edges[:-1], 2), axis.edges[-1])
    return (np.interp(np.concatenate([offload.d2h, offload.saved_d2h]), times, xs),
            np.interp(np.concatenate([offload.h2d, offload.saved_h2d]), times, xs))


def node_time_text(result: SimResult, i: int) -> str:
    """When node ``i`` runs in the simulated step ``result``, and what the step does right before it (the
    recomputations inserted there, the waits for late copies), in a line."""
    clock = result.clock
    waits = float(result.offload.waits[i]) if result.offload is not None else 0.0
    replays = float(clock.start[i] - clock.issue[i]) - waits
    before = [f"{ms:.2f} ms {what}" for ms, what in ((replays, "recomputing"), (waits, "waiting for copies"))
              if ms > 0.005]
    text = f"runs {clock.start[i]:.2f}–{clock.end[i]:.2f} ms into the {clock.step_ms:.2f} ms step (simulated)"
    return text + (f", after {' and '.join(before)}" if before else "")
