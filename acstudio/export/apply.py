"""``acstudio.apply_plan``: run a plan with torch's own selective activation checkpointing (SAC).

Every block the plan frees something in is wrapped in a non-reentrant ``torch.utils.checkpoint`` whose
``context_fn`` builds ``create_selective_checkpoint_contexts`` around a :class:`BlockPolicy`: ``MUST_SAVE`` for the
ops whose outputs the plan keeps, ``MUST_RECOMPUTE`` for those it frees. ``MUST_*`` decisions are binding for
``torch.compile``'s partitioner too, so a compiled model follows the plan instead of solving again. The RNG state
is preserved (non-reentrant checkpoint's ``preserve_rng_state``; under compile, Inductor's RNG functionalization),
and a block's random ops are all saved or all recomputed, so a replay draws exactly what forward drew. A replay
leaves the block's buffers as forward left them, so training-mode BatchNorm is recomputed without a second update.

The wrapper changes no parameter, buffer or name: ``state_dict``, optimizers, FSDP2's ``fully_shard`` and DDP see
the same model.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils.checkpoint import (
    SAC_IGNORED_OPS,
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from acstudio.errors import ACStudioError, PlanMismatchError
from acstudio.export.sac import OFFLOAD_NOT_CARRIED, POLICY_FILE, OpDecision, SacPolicy
from acstudio.profile.replay_rules import BATCH_NORM_OPS

_IGNORED = {str(op) for op in SAC_IGNORED_OPS}  # ops SAC never shows its policy
# Overloads that stand for the same computation in make_fx's capture, eager and torch.compile's trace
# (``torch.tensor`` in a forward: lift_fresh; ``matmul``'s reshape: _unsafe_view in eager, view when compiled).
# Training-mode BatchNorm is one op under as many names as backends: make_fx on CPU records native_batch_norm,
# eager CUDA runs cudnn_batch_norm, and torch.compile traces _native_batch_norm_legit(_functional).
_BATCH_NORM = "batch_norm (training)"
_SAME_AS = {"aten.lift_fresh_copy.default": "aten.lift_fresh.default", "aten._unsafe_view.default": "aten.view.default",
            **dict.fromkeys([*BATCH_NORM_OPS, "aten._native_batch_norm_legit_functional.default"], _BATCH_NORM)}


def canonical(op: str) -> str:
    return _SAME_AS.get(op, op)


@functools.cache
def _name(func) -> str:
    """An overload's canonical name, once per overload: the policy runs for every op of every block call."""
    return canonical(str(func))


# Ops that tracers place differently: make_fx records ``detach`` (which SAC hides from its policy) as ``alias``, so
# a recorded alias may not be seen; a constant (``torch.tensor`` in a forward) is lifted where each tracer chooses;
# torch 2.11's compile traces ``dropout(p=0)`` as a clone that the capture did not record, and training-mode
# BatchNorm allocates a reserve buffer where its backend wants one (compiled on CUDA ``new_zeros``, eager on the CPU
# ``empty``). They are matched when they come where recorded, skipped when they do not come, and recomputed when
# they come unrecorded: a view, a constant, a copy or an allocation is cheap to redo, and holding it would put
# memory on top of the prediction.
_FLOATING = {"aten.alias.default", "aten.lift_fresh.default", "aten.clone.default", "aten.new_zeros.default",
             "aten.empty.memory_format"}
_INNER = "_acstudio_sac_inner_forward"


class ModelMismatchError(PlanMismatchError):
    """The model runs other ops than the captured one did, so the plan's decisions cannot be matched to them."""


class BlockPolicy:
    """SAC policy of one call of one block.

    An op is matched to its decision by (overload, occurrence of that overload in the block's forward), both
    recorded from the captured graph. In forward the ops must also come in the recorded order; the first op that
    differs raises :class:`ModelMismatchError` naming it.
    """

    def __init__(self, block: str, ops: list[OpDecision]) -> None:
        self.block = block
        self.ops = ops
        self.decisions: dict[tuple[str, int], bool] = {}
        seen: Counter[str] = Counter()
        for d in ops:
            self.decisions[(d.op, seen[d.op])] = d.save
            seen[d.op] += 1
        self.calls = {False: Counter(), True: Counter()}
        self.position = 0

    def __call__(self, ctx, func, *args, **kwargs) -> CheckpointPolicy:
        op = _name(func)
        if not ctx.is_recompute:
            self.check(op)
        calls = self.calls[ctx.is_recompute]
        save = self.decisions.get((op, calls[op]))
        calls[op] += 1
        if save is None and op in _FLOATING:
            return CheckpointPolicy.MUST_RECOMPUTE
        if save is None:
            raise ModelMismatchError(f"block {self.block} ran {op} more often than the profiled model "
                                     "— profile and plan this model again")
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.MUST_RECOMPUTE

    def check(self, op: str | None) -> None:
        """Refuse the op the block runs at the current position (``None``: its forward ended) unless recorded."""
        i = self.position
        if op in _FLOATING and (i >= len(self.ops) or self.ops[i].op != op):
            return  # a floating op that was not recorded here: take it as it comes
        while i < len(self.ops) and self.ops[i].op in _FLOATING and op != self.ops[i].op:
            self.calls[False][self.ops[i].op] += 1  # the recorded one did not come: skip it
            i += 1
        self.position = i
        expected = self.ops[i] if i < len(self.ops) else None
        if op is None and expected is None:
            return
        if expected is None or op != expected.op:
            ran = f"ran {op}" if op else "ended"
            wanted = f"{expected.op} (in {expected.module or 'the root module'})" if expected else "its end"
            raise ModelMismatchError(
                f"the model does not match the plan: block {self.block}'s op #{i} {ran} where the profiled "
                f"model ran {wanted} — profile and plan this model again")
        self.position += 1


@contextmanager
def _buffers_restored(module: torch.nn.Module, recompute_context):
    """SAC's recompute context, after which the block's buffers hold what forward left in them.

    A replayed training-mode BatchNorm updates its running statistics a second time (torch.utils.checkpoint
    leaves that to the user); its output does not depend on them, so putting them back makes the replay exact.
    """
    buffers = [b for b in module.buffers() if b is not None]
    saved = [b.clone() for b in buffers]
    try:
        with recompute_context:
            yield
    finally:  # also when the replay stops early, as non-reentrant checkpoint does once it has what it needs
        with torch.no_grad():
            for b, s in zip(buffers, saved, strict=True):
                b.copy_(s)


def _under_compile() -> bool:
    """Whether torch.compile is tracing: Dynamo's frame, or AOTAutograd tracing the checkpoint's body for it
    (where ``is_compiling()`` is False but Dynamo's tracing context is still set)."""
    return torch.compiler.is_compiling() or torch._guards.TracingContext.try_get() is not None


def _contexts(block: str, module: torch.nn.Module, ops: list[OpDecision], policies: list[BlockPolicy]):
    """``context_fn`` of one checkpoint call: a fresh policy (its own counters) in SAC's two contexts.

    Under torch.compile the partitioner recomputes the functional ops only and mutates buffers once, in forward,
    so the buffers are restored in eager only (torch 2.11 also refuses any recompute context but SAC's own)."""
    policy = BlockPolicy(block, ops)
    policies.append(policy)
    forward_context, recompute_context = create_selective_checkpoint_contexts(policy, allow_cache_entry_mutation=True)
    if _under_compile():
        return forward_context, recompute_context
    return forward_context, _buffers_restored(module, recompute_context)


def _recompute_all_context(module: torch.nn.Module):
    """``context_fn`` of a block that saves nothing: no policy (no dispatch mode), the buffers restored after
    the replay."""
    return contextlib.nullcontext(), _buffers_restored(module, contextlib.nullcontext())


def wrap_block(module: torch.nn.Module, block: str, ops: list[OpDecision]) -> None:
    """Make ``module``'s forward run under a checkpoint with the SAC policy ``ops`` (rewrapping replaces).

    A block whose ops are all recomputed (floating ones aside, and updates of module state, whose buffers the plain
    checkpoint puts back after its replay) runs its first eager call under the policy, which checks that the model
    matches, and every later one under a plain non-reentrant checkpoint, as per-block checkpointing does: SAC's
    dispatch mode runs Python for every op, twice, which makes an eager step host-bound, even for blocks that save
    only their BatchNorm counters (docs/results.md measures it)."""
    inner = getattr(module, _INNER, module.forward)
    ops = [OpDecision(canonical(d.op), d.module, d.save, d.updates_state) for d in ops if d.op not in _IGNORED]
    policies: list[BlockPolicy] = []
    plain = not any(d.save and not d.updates_state for d in ops if d.op not in _FLOATING)
    checked = False
    submodules = list(module.named_modules())

    def context_fn():  # a plain function: torch.compile keeps it as a constant and calls it when tracing
        return _contexts(block, module, ops, policies)

    def forward(*args, **kwargs):
        nonlocal checked
        if not torch.is_grad_enabled():  # nothing is saved for backward: nothing to checkpoint (evaluation)
            return inner(*args, **kwargs)
        check_training(block, submodules)
        if plain and _under_compile():  # the partitioner recomputes the block, as compile+per-block's does
            return checkpoint(inner, *args, use_reentrant=False, **kwargs)
        if plain and checked:
            return checkpoint(inner, *args, use_reentrant=False,
                              context_fn=functools.partial(_recompute_all_context, module), **kwargs)
        out = checkpoint(inner, *args, use_reentrant=False, context_fn=context_fn, **kwargs)
        if policies and not _under_compile():
            policies.pop().check(None)  # eager: the block ran all the recorded ops
            policies.clear()
            checked = True
        return out

    setattr(module, _INNER, inner)
    module.forward = forward


def check_training(block: str, submodules: list[tuple[str, torch.nn.Module]]) -> None:
    """Refuse to train a block with a module in eval mode: the plan decides over the ops of training mode (dropout
    draws, BatchNorm's batch statistics), which eval mode does not run."""
    for name, m in submodules:
        if not m.training:
            where = f"{block}.{name}" if name else block
            raise ModelMismatchError(f"module {where} is in eval mode, but the plan was profiled in training mode "
                                     "— call model.train() before training (under torch.no_grad() an evaluation "
                                     "runs the model unchanged)")


def check_containers(policy: SacPolicy, modules: dict[str, torch.nn.Module]) -> None:
    """Refuse a model with more or fewer blocks beside the plan's than the profiled one (a 3-layer model for a
    plan of a 2-layer one), which the plan's own blocks alone would not reveal."""
    for parent, profiled in policy.containers.items():
        live = [name for name, _ in modules[parent].named_children() if name.isdigit()] if parent in modules else []
        if set(live) != set(profiled):
            raise ModelMismatchError(
                f"the model has {len(live)} blocks in {parent or 'the root module'} ({_names(live)}), the plan was "
                f"made for {len(profiled)} ({_names(profiled)}) — profile and plan this model again")


def _names(names: list[str]) -> str:
    return ", ".join(names) if len(names) <= 4 else f"{', '.join(names[:2])}, ..., {names[-1]}"


def load_policy(plan) -> SacPolicy:
    """A :class:`SacPolicy` from an export folder, or from a ``(profile, plan)`` pair."""
    if isinstance(plan, (str, os.PathLike)):
        if not (Path(plan) / POLICY_FILE).is_file():
            raise ACStudioError(f"{plan} has no {POLICY_FILE} — write it with `acstudio export PROFILE --plan PLAN "
                                f"--format sac --out {plan}`")
        return SacPolicy.load(plan)
    if isinstance(plan, tuple) and len(plan) == 2:
        profile, p = plan
        p.check_profile(profile)
        if getattr(p, "offloaded", ()):
            raise ACStudioError(f"apply_plan cannot run this plan: {OFFLOAD_NOT_CARRIED}")
        return SacPolicy.from_plan(profile, p.recomputed)
    raise ACStudioError(f"apply_plan takes an export folder or a (profile, plan) pair, not {type(plan).__name__}")


def apply_plan(model: torch.nn.Module, plan) -> torch.nn.Module:
    """Wrap ``model``'s blocks in place in SAC checkpoints that follow ``plan``; returns ``model``.

    ``plan`` is a folder written by ``acstudio export ... --format sac`` or a ``(Profile, Plan)`` pair. Blocks
    are module paths recorded in the profile (``layer1.0``, ``transformer.h.3``); a block whose activations the
    plan all keeps is left as it is. Call it before ``torch.compile``, ``fully_shard`` or DDP. A model with other
    blocks than the profiled one is refused here; the first forward raises :class:`ModelMismatchError` if the model
    runs other ops than the profiled one, and a training forward with a module of a wrapped block in eval mode
    is refused. What the eager model decides for itself is followed exactly: its dropout probabilities (a block's
    random ops are saved or replayed with the random state they drew from), frozen parameters (no gradient, no
    update) and evaluation under ``torch.no_grad()`` (the blocks run unwrapped).
    """
    policy = load_policy(plan)
    if getattr(getattr(model, "config", None), "use_cache", False):
        raise ACStudioError("the model keeps a KV cache (config.use_cache=True), which a replayed block would "
                            "update twice — set model.config.use_cache = False for training, and profile it so")
    modules = dict(model.named_modules())
    for block in policy.blocks:
        if block not in modules:
            raise ModelMismatchError(f"the model has no module {block!r}, a block of the plan "
                                     "— profile and plan this model again")
    check_containers(policy, modules)
    for block, ops in policy.blocks.items():
        wrap_block(modules[block], block, ops)
    return model
