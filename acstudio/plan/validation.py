"""Plan files checked on load: the document against its schema and itself, then every id it names against its
profile.

The schema and the checking helpers are :mod:`acstudio.profile.schema`'s; what needs the replay modes lives here,
above them. Re-deriving a plan from its recompute set needs the planner, which builds ``Plan`` objects from
:mod:`acstudio.plan.model`, which uses this module: that check lives above both, in :mod:`acstudio.plan.loading`.
"""

from __future__ import annotations

import os
from typing import Any

from acstudio.profile.schema import _PLAN, PlanDoc, _Checker, corrupt, validate_document
from acstudio.simulate.modes import REPLAY_MODES


def module_and_parents(module: str) -> list[str]:
    """``a.b.c``, ``a.b`` and ``a``: the modules a node of ``module`` runs inside."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)] if module else []


def validate_plan(doc: dict[str, Any], source: str | os.PathLike) -> PlanDoc:
    """Type-check a plan document and check that it agrees with itself (no profile needed)."""
    source = str(source)
    parsed = validate_document(_PLAN, doc, source, "plan")
    c = _Checker(source, "plan")
    if parsed.replay_mode not in REPLAY_MODES:
        raise c.fail("replay_mode", parsed.replay_mode, f"is not a replay mode ({', '.join(REPLAY_MODES)})")
    chosen = c.unique("recomputed", parsed.recomputed, column="")
    entries = c.unique("schedule", (row[0] for row in parsed.schedule), column=".activation")
    for i, row in enumerate(parsed.schedule):
        c.exists(f"schedule[{i}].activation", row[0], chosen, "recomputed activation")
    for i, act in enumerate(parsed.recomputed):
        c.exists(f"recomputed[{i}]", act, entries, "schedule entry")
    c.unique("offloaded", parsed.offloaded, column="")
    for i, act in enumerate(parsed.offloaded):
        if act in chosen:
            raise c.fail(f"offloaded[{i}]", act, "is recomputed too: an activation is kept, recomputed or offloaded")
    offset = parsed.compiled_offset_bytes
    if offset is not None and not abs(offset) < parsed.predicted_peak_bytes:
        raise c.fail("compiled_offset_bytes", offset, f"is not smaller than the predicted peak "
                     f"({parsed.predicted_peak_bytes}): a compiled step keeps more than nothing and less than twice it")
    return parsed


def check_plan_against(plan, profile, source: str | os.PathLike) -> None:
    """Every id the plan names exists in ``profile`` (whose fingerprint it already matches)."""
    c = _Checker(str(source), "plan")
    nodes = profile.node_index
    acts = profile.activation_by_id
    storages = {t.id for t in profile.tensors}
    for i, act in enumerate(plan.recomputed):
        c.exists(f"recomputed[{i}]", act, acts, "activation")
        if act in plan.excluded:
            raise c.fail(f"recomputed[{i}]", act, "is not a recompute candidate")
    for i, act in enumerate(plan.offloaded):
        c.exists(f"offloaded[{i}]", act, acts, "activation")
    for i, e in enumerate(plan.schedule):
        for name in ("freed_after", "recompute_before"):
            c.exists(f"schedule[{i}].{name}", getattr(e, name), nodes, "node")
        previous = -1
        for j, node in enumerate(e.replay):
            c.exists(f"schedule[{i}].replay[{j}]", node, nodes, "node")
            if nodes[node] <= previous:
                raise c.fail(f"schedule[{i}].replay[{j}]", node, "is out of topological order")
            previous = nodes[node]
        for j, src in enumerate(e.sources):
            c.exists(f"schedule[{i}].sources[{j}]", src, storages, "tensor")
    c.exists("predicted_peak_node", plan.predicted_peak_node, nodes, "node")
    if plan.activation_bytes and plan.activation_bytes != {a.id: a.bytes for a in profile.activations}:
        raise corrupt(c.source, c.kind, "activation_bytes", "does not list the profile's activations and their sizes")
    for act in plan.excluded:
        c.exists("excluded", act, acts, "activation")
    modules = {m for nd in profile.nodes for m in module_and_parents(nd.module)}
    for block, at in plan.region_fetches.items():
        c.exists("region_fetches", block, modules, "module")
        c.exists(f"region_fetches.{block}", at, modules, "module")
