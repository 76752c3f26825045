"""Random ops under torch.compile: eager SAC saves or recomputes a block's draws together, the compiled step decides
each alone (RNG functionalization), and a compiled plan, its policy file and the wrapped model follow that
(GPT-2's H200 profile: memory-efficient attention draws its dropout, and every layer has two dropouts)."""

import functools
from types import SimpleNamespace

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from acstudio.export.apply import BlockPolicy
from acstudio.export.sac import OpDecision, SacPolicy
from acstudio.plan.baselines import per_module
from acstudio.plan.compiled import TIMED_MODE, compiled_offset, plan_compiled, torchtitan_held
from acstudio.plan.loading import load_plan
from acstudio.plan.schedule import PlanContext
from acstudio.profile.model import Profile
from acstudio.simulate.modes import get_mode
from acstudio.simulate.sac import MASK_FROM_SHAPE, RECOMPUTE, SAVE, sac_blocks, simulate_sac

GPT2 = "sample_profiles/h200_gpt2_bs16_adam.json.gz"


@functools.cache
def gpt2() -> PlanContext:
    return PlanContext(Profile.load(GPT2))


def dropouts(ctx: PlanContext) -> list[int]:
    return [i for i in ctx.rg.rng_nodes.tolist() if ctx.profile.nodes[i].target in MASK_FROM_SHAPE]


def test_compiled_a_blocks_random_ops_are_decided_one_by_one():
    """torchtitan's set saves attention, which draws: eager SAC then saves the block's dropouts too (its replay
    draws from the block's starting generator state), the compiled form recomputes them, as torchtitan's compiled
    step does, and holds less for it."""
    ctx = gpt2()
    blocks, held = sac_blocks(ctx.sim), torchtitan_held(ctx)
    eager, _ = blocks.decide(held)
    compiled, freed = blocks.decide(held, compiled=True)
    in_blocks = [i for i in dropouts(ctx) if blocks.block[i]]  # not the embeddings' dropout
    assert len(in_blocks) == 24  # two a layer
    assert all((eager[i], compiled[i]) == (SAVE, RECOMPUTE) for i in in_blocks)
    attention = [i for i in ctx.rg.rng_nodes.tolist() if i not in dropouts(ctx)]
    assert attention and all(eager[i] == compiled[i] == SAVE for i in attention)
    eager_peak = get_mode("sac").peak(ctx.sim, held)[0]
    assert get_mode(TIMED_MODE).peak(ctx.sim, held)[0] < eager_peak
    assert freed.sum() > blocks.decide(held)[1].sum()


def test_compiled_a_dropouts_mask_replays_nothing_before_it():
    """Compiled, a dropout draws its mask from its input's shape, so a replay whose only output is a mask reruns
    the dropout alone, not the matmul before it that eager's replay reruns."""
    ctx = gpt2()
    blocks, rg = sac_blocks(ctx.sim), ctx.rg
    b = blocks.blocks[3]
    masks = [k for i in dropouts(ctx) if blocks.block[i] == b for k in blocks.writes[i] if blocks.freeable[k]]
    assert len(masks) == 2 and all(rg.bytes[k] == rg.bytes[masks[0]] for k in masks)
    replay = get_mode(TIMED_MODE).schedule(ctx.sim, masks).replays[0]
    needed = {ctx.profile.nodes[i].target for i in blocks.needed(replay)}
    assert "aten.native_dropout.default" in needed
    assert not any("mm" in t for t in needed)
    assert any("mm" in ctx.profile.nodes[i].target for i in replay.nodes)  # eager reruns the block up to them


def test_a_compiled_plan_carries_what_only_the_compiled_step_frees_and_its_policy_says_so(tmp_path):
    """The plan lists the dropouts' outputs the compiled step recomputes although eager SAC saves them; its policy
    marks those ops ``save-eager`` (version 3, read back as written), and the wrapped block's policy recomputes
    them under torch.compile only. The plan file loads against its profile, which derives the same schedule."""
    ctx = gpt2()
    mode = get_mode(TIMED_MODE)
    measured = mode.peak(ctx.sim, per_module(ctx))[0] - 2**30  # compile+per-block as if measured 1 GiB lower
    offset = compiled_offset(ctx, measured)
    budget = int(0.97 * (mode.peak(ctx.sim, torchtitan_held(ctx))[0] - offset))  # a little under torchtitan's
    plan = plan_compiled(ctx, budget, measured)
    assert plan.feasible
    assert mode.peak(ctx.sim, ctx.sim.indices(plan.recomputed))[0] - offset == plan.compiled_peak_bytes <= budget
    plan.save(tmp_path / "plan.json")
    loaded = load_plan(tmp_path / "plan.json", ctx.profile, ctx)
    assert (loaded.recomputed, loaded.schedule) == (plan.recomputed, plan.schedule)
    policy = SacPolicy.from_plan(ctx.profile, plan.recomputed)
    eager_only = [d for ops in policy.blocks.values() for d in ops if d.eager_only]
    assert eager_only and all(d.save and d.op == "aten.native_dropout.default" for d in eager_only)
    policy.save(tmp_path)
    assert policy.version == 3 and SacPolicy.load(tmp_path) == policy
    block, ops = next((b, ops) for b, ops in policy.blocks.items() if any(d.eager_only for d in ops))
    decide = {compiled: BlockPolicy(block, ops, compiled=compiled).decisions for compiled in (False, True)}
    changed = {key for key in decide[False] if decide[False][key] != decide[True][key]}
    assert changed and all(key[0] == "aten.native_dropout.default" and decide[False][key] for key in changed)


@pytest.mark.parametrize("compiled", [False, True])
def test_the_block_policy_answers_a_save_eager_op_by_where_it_runs(compiled):
    ops = [OpDecision("aten.mm.default", "attn", True),
           OpDecision("aten.native_dropout.default", "drop", True, eager_only=True)]
    policy = BlockPolicy("h.0", ops, compiled=compiled)
    forward = SimpleNamespace(is_recompute=False)
    answers = [policy(forward, torch.ops.aten.mm.default), policy(forward, torch.ops.aten.native_dropout.default)]
    dropout = CheckpointPolicy.MUST_RECOMPUTE if compiled else CheckpointPolicy.MUST_SAVE
    assert answers == [CheckpointPolicy.MUST_SAVE, dropout]


def test_a_block_that_frees_only_its_masks_compiled_is_still_wrapped():
    """A plan that frees only a block's dropout masks frees nothing in eager (its saved attention keeps the
    dropouts saved), but compiled it does: the block is wrapped all the same, its dropouts marked save-eager, or
    compile would keep the masks the compiled plan priced as freed."""
    ctx = gpt2()
    blocks = sac_blocks(ctx.sim)
    b = blocks.blocks[3]
    masks = [k for i in dropouts(ctx) if blocks.block[i] == b for k in blocks.writes[i] if blocks.freeable[k]]
    assert not blocks.decide(masks)[1].any() and blocks.decide(masks, compiled=True)[1].sum() == len(masks)
    asked = [ctx.rg.act_ids[k] for k in masks]
    form = simulate_sac(ctx.sim, asked)
    assert list(form.decisions) == [b] and not form.freed
    policy = SacPolicy.from_plan(ctx.profile, asked)
    assert [d.module for d in policy.blocks[b] if d.eager_only] == [ctx.profile.nodes[i].module for i in dropouts(ctx)
                                                                  if blocks.block[i] == b]
