"""Reading a plan for a profile: the plan file's own checks, then every id it names must exist in the profile and
its schedule and predictions must be what simulating its recompute set on that profile gives.

This sits above the planner (:mod:`acstudio.plan.schedule`), which builds ``Plan`` objects, so that the plan model
can stay beneath it.
"""

from __future__ import annotations

import math
import os

from acstudio.plan.compiled import with_compiled_frees
from acstudio.plan.model import Plan
from acstudio.plan.schedule import PlanContext
from acstudio.plan.validation import check_plan_against
from acstudio.profile.model import Profile
from acstudio.profile.schema import _Checker, _short
from acstudio.simulate.simulator import Simulator


def load_plan(path: str | os.PathLike, profile: Profile | None = None, context: PlanContext | None = None) -> Plan:
    """Read a plan; with ``profile``, refuse it unless it was made for that profile's graph, every id it names
    exists there and its schedule and predictions are what that profile gives (``context``: the profile's plan
    context, if one is at hand, saves simulating it again)."""
    plan = Plan.load(path)
    if profile is not None:
        plan.check_profile(profile)
        check_plan_against(plan, profile, path)
        check_plan_derivation(plan, profile, path, context)
    return plan


# Fields a plan reports that follow from its profile, recompute set, offload set and replay mode (the solver's name,
# its stop reason and its per-entry ``ratio``, the score it chose by, do not).
DERIVED = ("predicted_peak_bytes", "predicted_peak_node", "floor_bytes", "baseline_peak_bytes", "excluded", "offloaded",
           "offload_bytes", "host_bytes")
ENTRY_DERIVED = ("bytes", "freed_after", "recompute_before", "sources", "replay")


def check_plan_derivation(plan: Plan, profile: Profile, source: str | os.PathLike, context: PlanContext | None = None
                          ) -> None:
    """Simulate the plan's recompute set again: its schedule and predictions must be what the file says.

    The rewriter reads only the recompute set and the replay mode; reports read the rest. Re-deriving the rest
    (milliseconds even on a large graph, plus the AC floor unless ``context``, the profile's
    :class:`~acstudio.plan.schedule.PlanContext`, has it already) means a file edited by hand cannot report one
    thing and run another.
    """
    c = _Checker(str(source), "plan")
    ctx = context
    if ctx is None or ctx.rg.keep_random != plan.keep_random:  # candidates depend on the random-op rule
        ctx = PlanContext(profile, Simulator(profile, keep_random=plan.keep_random))
    offloaded = [ctx.rg.act_index[a] for a in plan.offloaded]
    expected = ctx.plan_for_set(plan.solver, plan.budget_bytes, ctx.sim.indices(plan.recomputed),
                                mode=plan.replay_mode, offloaded=offloaded)
    if plan.compiled_offset_bytes is not None:  # a plan for torch.compile also frees what only compile frees
        expected = with_compiled_frees(ctx, expected, plan.recomputed)
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
