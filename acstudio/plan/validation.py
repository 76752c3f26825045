"""Plan files checked on load: the document against its schema and itself, then against its profile.

The schema and the checking helpers are :mod:`acstudio.profile.schema`'s; what needs the replay modes and the
planner (re-deriving a plan from its recompute set) lives here, above them.

Re-deriving takes the planner's per-profile context (:class:`~acstudio.plan.schedule.PlanContext`). It builds
``Plan`` objects, so it imports the plan model, which imports this module to check what it loads; the planner
therefore hands itself in with :func:`use_planner` when it is imported (the ``acstudio.plan`` package imports it,
so it is in place before any plan can be read).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

from acstudio.profile.schema import _PLAN, PlanDoc, _Checker, _short, corrupt, validate_document
from acstudio.simulate.modes import REPLAY_MODES

# (profile, keep_random) -> the planner's context of that profile under that random-op rule
_planner_context: Callable[[Any, bool], Any] | None = None


def use_planner(make_context: Callable[[Any, bool], Any]) -> None:
    """Re-derive plans with ``make_context(profile, keep_random)``, the planner's context of a profile."""
    global _planner_context
    _planner_context = make_context


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


# Fields a plan reports that follow from its profile, recompute set, offload set and replay mode (the solver's name,
# its stop reason and its per-entry ``ratio``, the score it chose by, do not).
DERIVED = ("predicted_peak_bytes", "predicted_peak_node", "floor_bytes", "baseline_peak_bytes", "excluded", "offloaded",
           "offload_bytes", "host_bytes")
ENTRY_DERIVED = ("bytes", "freed_after", "recompute_before", "sources", "replay")


def check_plan_derivation(plan, profile, source: str | os.PathLike, context=None) -> None:
    """Simulate the plan's recompute set again: its schedule and predictions must be what the file says.

    The rewriter reads only the recompute set and the replay mode; reports read the rest. Re-deriving the rest
    (milliseconds even on a large graph, plus the AC floor unless ``context``, the profile's
    :class:`~acstudio.plan.schedule.PlanContext`, has it already) means a file edited by hand cannot report one
    thing and run another.
    """
    c = _Checker(str(source), "plan")
    ctx = context
    if ctx is None or ctx.rg.keep_random != plan.keep_random:  # candidates depend on the random-op rule
        ctx = _planner_context(profile, plan.keep_random)
    offloaded = [ctx.rg.act_index[a] for a in plan.offloaded]
    expected = ctx.plan_for_set(plan.solver, plan.budget_bytes, ctx.sim.indices(plan.recomputed),
                                mode=plan.replay_mode, offloaded=offloaded)
    if plan.baseline_peak_bytes != expected.baseline_peak_bytes:  # first: one rank's profile differs here
        raise c.fail("baseline_peak_bytes", plan.baseline_peak_bytes,
                     f"but the profile gives {expected.baseline_peak_bytes} (a plan for one rank, made with --fsdp N "
                     "or --ddp N, is read with the same option)")
    for name in DERIVED:
        if getattr(plan, name) != getattr(expected, name):
            raise c.fail(name, getattr(plan, name), f"but the profile gives {_short(getattr(expected, name))}")
    for name in ("predicted_extra_ms", "offload_stall_ms"):
        if not math.isclose(getattr(plan, name), getattr(expected, name), rel_tol=1e-9, abs_tol=1e-9):
            raise c.fail(name, getattr(plan, name), f"but the profile gives {getattr(expected, name)!r}")
    if plan.feasible != (plan.run_peak_bytes <= plan.budget_bytes):
        raise c.fail("feasible", plan.feasible, f"but the predicted peak is {plan.run_peak_bytes} bytes for a "
                     f"budget of {plan.budget_bytes}")
    if len(plan.schedule) != len(expected.schedule):
        raise c.fail("schedule", f"{len(plan.schedule)} entries", f"but the profile gives {len(expected.schedule)}")
    for i, (got, want) in enumerate(zip(plan.schedule, expected.schedule)):
        for name in ("activation", *ENTRY_DERIVED):
            if getattr(got, name) != getattr(want, name):
                raise c.fail(f"schedule[{i}].{name}", getattr(got, name),
                             f"but the profile gives {_short(getattr(want, name))}")
        if not math.isclose(got.recompute_ms, want.recompute_ms, rel_tol=1e-9, abs_tol=1e-9):
            raise c.fail(f"schedule[{i}].recompute_ms", got.recompute_ms,
                         f"but the profile gives {want.recompute_ms!r}")
