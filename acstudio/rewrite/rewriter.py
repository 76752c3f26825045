"""Turn a recompute plan into a rewritten training step: free activations after forward, replay them in backward.

The rewriter works on the captured graph itself (a copy of the same nodes, found by ``meta["ac_id"]``), never on a
re-trace, and takes storages, aliases and replay safety from the profile, so it rewrites exactly what was planned.
It runs the rewrite as passes (:mod:`acstudio.rewrite.passes`), chosen by the replay mode and the plan:

1. :class:`~acstudio.rewrite.replay.InsertReplays` copies, for every recomputed activation, the chain producing it
   right before its first backward use and rewires the backward readers to the copies
   (:mod:`acstudio.rewrite.replay`, :mod:`acstudio.rewrite.rewire`); the mode's ``shares_chains`` says whether one
   replay also produces the recomputed activations it passes through (``"shared"``) or those are replayed again
   before their own use (``"again"``, μ-TWO's model); a plan names the mode it was priced for in
   ``Plan.replay_mode``;
2. unless the plan has ``keep_random`` (random ops are then never replayed, and ``native_dropout`` is replayed from
   its kept mask), :class:`~acstudio.rewrite.rng.RestoreRngState` makes each replayed random op draw with the
   generator state its forward drew with, so the rewritten step stays bitwise identical to the captured one;
3. :class:`~acstudio.rewrite.batchnorm.DropRunningStats` replays training-mode BatchNorm without its running
   statistics (they were updated once, in forward);
4. :class:`~acstudio.rewrite.rewire.CheckFreed` checks that every recomputed activation's originals are now read
   in forward only, so FX's generated code frees them there;
5. with ``Plan.offloaded``, :class:`~acstudio.rewrite.offload.OffloadActivations` adds the copies to the host and
   back where the simulator schedules them beside those replays.
"""

from __future__ import annotations

import copy
from collections.abc import Collection
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from acstudio.capture.step import CapturedStep
from acstudio.errors import PlanMismatchError
from acstudio.profile.model import Profile
from acstudio.rewrite.batchnorm import DropRunningStats
from acstudio.rewrite.facts import GraphFacts
from acstudio.rewrite.offload import RUNTIME_ATTR, Offload, OffloadActivations
from acstudio.rewrite.passes import RewriteContext, RewritePass, run_passes
from acstudio.rewrite.replay import InsertReplays, Recomputation
from acstudio.rewrite.rewire import CheckFreed
from acstudio.rewrite.rng import RestoreRngState
from acstudio.simulate.modes import get_mode


@dataclass
class RewrittenStep(CapturedStep):
    """A captured step whose graph frees and recomputes the planned activations."""

    recomputations: list[Recomputation] = field(default_factory=list)
    offloads: list[Offload] = field(default_factory=list)

    @property
    def replay_ms(self) -> float:
        return sum(r.replay_ms for r in self.recomputations)

    def run(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch) -> torch.Tensor:
        """:meth:`CapturedStep.run`; with offload, the pinned pool is made (or the host's lack of free memory
        reported) before the step starts."""
        if self.offloads:
            device = next(model.parameters()).device
            getattr(self.gm, RUNTIME_ATTR).ensure_pool(device)
        return super().run(model, optimizer, batch)


class PlannedActivations(list):
    """A plan's recomputed activation ids, carrying how the plan replays them (``Plan.replay_mode``,
    ``Plan.keep_random``) and what it offloads (``Plan.offloaded``), so that callers passing them on to
    :func:`rewrite_step` (verify, export) rewrite the step the plan was priced for."""

    replay_mode = "again"
    keep_random = False
    offloaded: tuple[str, ...] = ()


def plan_activations(plan, profile: Profile) -> list[str]:
    """The recomputed activation ids of ``plan`` (a Plan, or a plain collection of ids) after checking its profile."""
    if isinstance(plan, (list, tuple, set, frozenset)):
        return list(plan)
    plan.check_profile(profile)
    ids = PlannedActivations(plan.recomputed)
    ids.replay_mode = plan.replay_mode
    ids.keep_random = bool(getattr(plan, "keep_random", False))
    ids.offloaded = tuple(getattr(plan, "offloaded", ()))
    return ids


def rewrite(step: CapturedStep, profile: Profile, plan) -> RewrittenStep:
    """Apply ``plan`` (refused if made for another profile) to ``step``, replaying as the plan says; see
    :func:`rewrite_step`."""
    return rewrite_step(step, profile, plan_activations(plan, profile))


def rewrite_step(step: CapturedStep, profile: Profile, recomputed: Collection[str], *,
                 replay_mode: str | None = None, keep_random: bool | None = None,
                 offloaded: Collection[str] | None = None) -> RewrittenStep:
    """A copy of ``step`` that frees each activation in ``recomputed`` after forward and replays it in backward,
    and copies each in ``offloaded`` to host memory and back (:mod:`acstudio.rewrite.offload`).

    ``step`` must be the graph ``profile`` was measured on (same nodes in the same order, e.g. from
    ``deserialize_step(profile.graph)``); it is not modified. Replays follow ``replay_mode``, by default the mode
    of the plan ``recomputed`` comes from (:func:`plan_activations`), else ``"again"``; random ops are replayed
    with their forward's generator state unless ``keep_random`` (by default: the plan's) says never to.
    ``offloaded`` defaults to the plan's; the copies go where the simulator schedules them for this plan.
    """
    mode = get_mode(replay_mode or getattr(recomputed, "replay_mode", "again"))
    if keep_random is None:
        keep_random = getattr(recomputed, "keep_random", False)
    if offloaded is None:
        offloaded = getattr(recomputed, "offloaded", ())
    gm = fx.GraphModule(step.gm, copy.deepcopy(step.gm.graph))
    ids = [n.meta.get("ac_id") for n in gm.graph.nodes]
    if ids != [r.id for r in profile.nodes]:
        raise PlanMismatchError("this graph is not the one the profile was measured on (node ids differ)")
    ctx = RewriteContext(profile=profile, recomputed=list(dict.fromkeys(recomputed)), offloaded=list(offloaded),
                         mode=mode, keep_random=keep_random)
    ctx.facts = GraphFacts(gm, profile, keep_random)
    run_passes(gm, ctx, rewrite_passes(ctx))
    return RewrittenStep(gm=gm, inputs=list(step.inputs), grad_params=list(step.grad_params), optimizer=step.optimizer,
                         recomputations=ctx.recomputations, offloads=ctx.offloads)


def rewrite_passes(ctx: RewriteContext) -> list[RewritePass]:
    """The passes that apply ``ctx``'s plan, in order: the replays as its mode shares chains, generator states
    unless it keeps random ops from being replayed, BatchNorm statistics and the freeing check where anything is
    recomputed, then the offload copies if it offloads."""
    passes: list[RewritePass] = []
    if ctx.recomputed:
        passes.append(InsertReplays(ctx.mode.shares_chains, ctx.keep_random))
        if not ctx.keep_random:
            passes.append(RestoreRngState())
        passes += [DropRunningStats(), CheckFreed()]
    if ctx.offloaded:
        passes.append(OffloadActivations())
    return passes
