"""The plan's floor and fill: per-block checkpointing's own policy is in the planner's space and priced at no more
than it measures, and a compiled plan uses the budget it is given."""

import pytest
import torch
from conftest import tiny_spec

from acstudio.bench.worker import measure
from acstudio.plan.baselines import per_module, per_op
from acstudio.plan.compiled import plan_compiled
from acstudio.plan.schedule import PlanContext
from acstudio.plan.solvers import plan
from acstudio.plan.solvers.registry import auto_solvers
from acstudio.profile.model import Profile
from acstudio.profiler import profile_workload
from acstudio.simulate.modes import get_mode
from acstudio.simulate.sac import sac_blocks

GPT2 = "sample_profiles/h200_gpt2_bs16_adam.json.gz"  # fp32, dropout 0.1, seq 512
BERT = "sample_profiles/h200_bert_bs16_adam.json.gz"
HIDDEN_STATE = 16 * 512 * 768 * 4  # one fp32 hidden state of either sample


@pytest.fixture(scope="module")
def gpt2():
    return PlanContext(Profile.load(GPT2))


def compiled_memory_saving(ctx, recomputed) -> int:
    """What the compiled memory holds less than eager SAC's for the same recompute set."""
    return get_mode("sac").peak(ctx.sim, recomputed)[0] - get_mode("sac-compiled").peak(ctx.sim, recomputed)[0]


def with_dropouts_saved(ctx, recomputed) -> list[int]:
    """``recomputed`` less what the random ops write: their masks kept, the dropouts are saved compiled too."""
    draws = set(ctx.rg.rng_nodes.tolist())
    return [k for k in recomputed if int(ctx.rg.created[k]) not in draws]


def test_compiled_memory_holds_a_saved_ops_outputs_only_where_a_recompute_reads_them(gpt2):
    """Saving a dropout keeps its mask; eager SAC's cache also holds its output until the replay, the compiled step
    only where the recomputed ops read it. GPT-2's MLP dropout feeds the block's output add, which backward does not
    need: 12 hidden states less compiled. BERT's dropouts feed the add under a recomputed LayerNorm: all held. Per-
    module, the calibration point, saves no op: the same in both, but for the last layer's output, which the
    compiled step recomputes when the head's backward reads it (one hidden state less, in every set here)."""
    bert = PlanContext(Profile.load(BERT))
    for ctx in (gpt2, bert):
        assert compiled_memory_saving(ctx, per_module(ctx)) == HIDDEN_STATE
        blocks = sac_blocks(ctx.sim)
        saved = with_dropouts_saved(ctx, per_op(ctx))
        for compiled in (False, True):
            forms = [blocks._block(b, asked, compiled) for b, asked in blocks._asked(saved).items()]
            assert sum(len(f.saved_scratch) for f in forms) == 24  # two saved dropouts per layer, 12 layers
    assert compiled_memory_saving(gpt2, with_dropouts_saved(gpt2, per_op(gpt2))) == 13 * HIDDEN_STATE
    assert compiled_memory_saving(bert, with_dropouts_saved(bert, per_op(bert))) == HIDDEN_STATE


def test_compiled_a_saved_attention_leaves_the_dropouts_recomputed(gpt2):
    """torchtitan's per-op set saves attention, which draws: eager SAC saves the block's dropouts with it, the
    compiled step recomputes them, each under its own generator state, so it holds each layer's two dropout outputs
    and two masks (a quarter of a hidden state each, bool) less, and the last layer's output."""
    saving = 12 * (2 * HIDDEN_STATE + 2 * HIDDEN_STATE // 4) + HIDDEN_STATE
    assert compiled_memory_saving(gpt2, per_op(gpt2)) == saving


@pytest.mark.parametrize("factor", [1.1, 1.4, 1.7])
def test_a_compiled_plan_fills_its_budget(gpt2, factor):
    """Between per-block's compiled peak and plain compile's, the plan's compiled peak is within 2% below the
    budget: a plan predicted high recomputes more than it needs (compiled, a dropout's output that only eager SAC
    holds would overstate the peak by a hidden state per saved dropout)."""
    per_block = get_mode("sac-compiled").peak(gpt2.sim, per_module(gpt2))[0] - 1580 * 2**20  # a logits-sized offset
    budget = int(per_block * factor)
    plan = plan_compiled(gpt2, budget, per_block)
    assert plan.feasible and plan.recomputed
    assert 0.98 * budget <= plan.compiled_peak_bytes <= budget
    saving = compiled_memory_saving(gpt2, gpt2.sim.indices(plan.recomputed))
    assert plan.compiled_offset_bytes == plan.predicted_peak_bytes - plan.compiled_peak_bytes
    assert plan.compiled_offset_bytes - saving == get_mode("sac-compiled").peak(gpt2.sim, per_module(gpt2))[0] \
        - per_block


@pytest.mark.parametrize("model, precision", [("llama", "bf16"), ("llama", "fp32"), ("gpt2", "fp32")])
def test_per_blocks_own_policy_is_planned_and_fits_under_per_blocks_measured_peak(model, precision):
    """HF gradient checkpointing (every block under a non-reentrant checkpoint, measured on the CPU by storage
    accounting, as bench's per-block row runs it) frees every activation a block makes but its output, autocast's
    weight casts included. Per-module is that set; ``auto`` tries it, priced as the rewritten step replays it, at no
    more than per-block measures; so at per-block's measured peak there is a plan that fits."""
    spec = tiny_spec(model, precision=precision, seq_len=32)
    torch.manual_seed(0)
    measured = measure({"spec": spec.to_dict(), "config": "per-block", "warmup": 1, "iters": 2, "device": "cpu"})
    ctx = PlanContext(profile_workload(spec, "cpu"))
    assert "per-module" in auto_solvers()
    blocks = ctx.plan_for_set("per-module", measured["peak_bytes"], per_module(ctx), mode="shared")
    assert blocks.feasible and blocks.predicted_peak_bytes <= measured["peak_bytes"]
    # the layers' casts to bf16 are in the set: recomputed, as HF GC's replay makes them again
    casts = [k for k in per_module(ctx) if ctx.profile.nodes[ctx.rg.created[k]].target == "aten._to_copy.default"]
    assert bool(casts) == (precision == "bf16")
    fitted = plan(ctx.profile, measured["peak_bytes"], ctx=ctx)
    assert fitted.feasible and fitted.run_peak_bytes <= measured["peak_bytes"]
