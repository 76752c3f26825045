"""What the graph colours and the activation table show for a plan, as plain arrays and columns. No Qt in here."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from acstudio.plan.model import Plan
from acstudio.plan.solvers import kept_reason
from acstudio.profile.model import Profile
from acstudio.simulate.offload import OffloadSchedule

TABLE_PLAN_COLUMNS = ("decision", "why", "step", "sources", "replay_nodes", "recompute_ms", "ratio")


@dataclass
class Decisions:
    """Per-node facts of one plan (arrays over profile nodes), what the graph colours its boxes by.

    An activation's bytes count at the node that makes it (forward) and at its first backward use (where a
    recomputed or offloaded one is brought back), so forward and backward boxes of a module read the same way.
    """

    recomputed_bytes: np.ndarray
    retained_bytes: np.ndarray
    offloaded_bytes: np.ndarray
    replayed: np.ndarray  # 1 where the node is re-executed in backward to recompute something
    inserted: np.ndarray  # number of recomputations inserted just before this node


@dataclass(frozen=True)
class ActivationIndex:
    """Node positions of every activation (table row): made, last forward use, first and last backward use."""

    created: np.ndarray
    last_fw: np.ndarray
    first_bw: np.ndarray
    last_bw: np.ndarray
    bytes: np.ndarray
    row: dict[str, int] = field(default_factory=dict)  # activation id -> its table row

    @classmethod
    def of(cls, profile: Profile) -> ActivationIndex:
        index = profile.node_index

        def column(attr: str) -> np.ndarray:
            return np.array([index[getattr(a, attr)] for a in profile.activations], dtype=np.int64)

        return cls(created=column("created_at"), last_fw=column("last_fw_use"), first_bw=column("first_bw_use"),
                   last_bw=column("last_bw_use"),
                   bytes=np.array([a.bytes for a in profile.activations], dtype=np.int64),
                   row={a.id: k for k, a in enumerate(profile.activations)})


def activation_table(profile: Profile) -> pd.DataFrame:
    """Static facts per activation: where it is made, its size, how long it lives and waits."""
    index = profile.node_index
    by_id = profile.node_by_id
    rows = []
    for a in profile.activations:
        made = by_id[a.created_at]
        rows.append({
            "activation": a.id, "node": made.name, "op": made.target.removeprefix("aten."), "module": made.module,
            "shape": made.shape, "bytes": a.bytes,
            "lifetime": index[a.last_bw_use] - index[a.created_at],
            "inactive_ms": a.inactive_time_ms, "first_bw_use": by_id[a.first_bw_use].name,
        })
    cols = ["activation", "node", "op", "module", "shape", "bytes", "lifetime", "inactive_ms", "first_bw_use"]
    df = pd.DataFrame(rows, columns=cols).set_index("activation", drop=False)
    df = df.rename(columns={"activation": "id"})
    for c in TABLE_PLAN_COLUMNS:
        df[c] = ""
    return df


def chosen_mask(acts: ActivationIndex, ids: list[str]) -> np.ndarray:
    """Per activation (table row): is it one of ``ids`` (a plan's recomputed or offloaded ones)?"""
    mask = np.zeros(len(acts.bytes), dtype=bool)
    mask[[acts.row[a] for a in ids]] = True
    return mask


def back_in_memory_at(profile: Profile, acts: ActivationIndex, plan: Plan,
                      offload: OffloadSchedule | None = None) -> np.ndarray:
    """Per activation: the node before which the plan brings it back (its recomputation; in a shared replay
    that can be before its first backward use; or, with the plan's simulated ``offload``, the copy back), or -1
    when the plan keeps it."""
    back = np.full(len(acts.bytes), -1, dtype=np.int64)
    for e in plan.schedule:
        back[acts.row[e.activation]] = profile.node_index[e.recompute_before]
    if offload is not None:
        back[offload.offloaded] = offload.prefetch
    return back


def forward_until(acts: ActivationIndex, offload: OffloadSchedule | None = None) -> np.ndarray:
    """Per activation: the last node of its forward stay in memory: its last forward use, or for an offloaded
    one the node before its device memory is freed (once the copy to the host has ended)."""
    until = acts.last_fw.copy()
    if offload is not None:
        until[offload.offloaded] = offload.release - 1
    return until


def alive_in_span(acts: ActivationIndex, back_at: np.ndarray, first: int, last: int,
                  until: np.ndarray | None = None) -> np.ndarray:
    """Per activation: is it in memory somewhere in nodes ``first..last``? A kept activation (``back_at`` -1)
    lives from the node that makes it to its last backward use; a recomputed or offloaded one until the end of
    its forward stay (``until``, default: its last forward use), then again from ``back_at`` to its last use."""
    made = acts.created <= last
    kept_span = made & (acts.last_bw >= first)
    forward_part = made & ((acts.last_fw if until is None else until) >= first)
    backward_part = (back_at <= last) & (acts.last_bw >= first)
    return np.where(back_at < 0, kept_span, forward_part | backward_part)


def graph_decisions(profile: Profile, acts: ActivationIndex, plan: Plan) -> Decisions:
    """Per-node arrays for the graph colours of ``plan``."""
    n = len(profile.nodes)
    index = profile.node_index
    nodes = np.concatenate([acts.created, acts.first_bw])
    weights = np.concatenate([acts.bytes, acts.bytes]).astype(float)
    rec2 = np.tile(chosen_mask(acts, plan.recomputed), 2)
    off2 = np.tile(chosen_mask(acts, plan.offloaded), 2)
    ret2 = ~(rec2 | off2)
    rec, off, ret = (np.bincount(nodes[m], weights=weights[m], minlength=n) for m in (rec2, off2, ret2))
    replayed = np.zeros(n)
    replayed[[index[r] for e in plan.schedule for r in e.replay]] = 1
    inserted = np.bincount([index[e.recompute_before] for e in plan.schedule], minlength=n).astype(float)
    return Decisions(recomputed_bytes=rec, retained_bytes=ret, offloaded_bytes=off, replayed=replayed,
                     inserted=inserted)


def table_columns(acts: ActivationIndex, plan: Plan) -> dict[str, np.ndarray]:
    """The activation table's plan columns, one array per column in table row order: decision (retain,
    recompute, offload or not a candidate), why in words, and the schedule entry if recomputed. Built with array
    assignments, not a loop over the rows: it runs on every slider step."""
    n = len(acts.bytes)
    rows = acts.row
    kept = kept_reason(plan.solver)
    decision = np.full(n, "retain", dtype=object)
    why = np.full(n, kept, dtype=object)
    excluded = [rows[a] for a in plan.excluded]
    decision[excluded] = "not a candidate"
    why[excluded] = np.array(list(plan.excluded.values()), dtype=object)
    recomputed = [rows[a] for a in plan.recomputed]
    decision[recomputed] = "recompute"
    why[recomputed] = "freed after forward, recomputed before its first backward use"
    offloaded = [rows[a] for a in plan.offloaded]
    decision[offloaded] = "offload"
    why[offloaded] = "copied to host memory after forward, copied back before its first backward use"
    step = np.full(n, np.nan)
    step[recomputed] = np.arange(1, len(recomputed) + 1)
    entries = plan.schedule
    at = [rows[e.activation] for e in entries]
    sources = np.full(n, "", dtype=object)
    sources[at] = np.array([" ".join(e.sources) for e in entries], dtype=object)
    numbers = {"replay_nodes": [len(e.replay) for e in entries], "recompute_ms": [e.recompute_ms for e in entries],
               "ratio": [e.ratio for e in entries]}
    cols = {"decision": decision, "why": why, "step": step, "sources": sources}
    for name, values in numbers.items():
        cols[name] = np.full(n, np.nan)
        cols[name][at] = values
    return cols
