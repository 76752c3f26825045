"""Baseline policies and the exact MILP, under the same simulator as μ-TWO."""

from __future__ import annotations

import itertools

import pytest
from test_simulator import build_profile, chain_profile, random_profile

from acstudio.errors import ACStudioError
from acstudio.plan import mutwo_trajectory, plan, sweep
from acstudio.plan.baselines import articulation_points, per_module, repeated_blocks, sqrt_n
from acstudio.plan.milp import exact_recompute_set
from acstudio.plan.schedule import PlanContext
from acstudio.simulate import Simulator


def two_block_profile():
    """stem -> block0 (h0 -> o0, skip from the block input) -> block1 (h1 -> o1) -> head, with backward."""
    specs = [
        ("x", "input", [], 8, 0, "batch"), ("w", "input", [], 4, 0, "param"),
        ("stem", "forward", ["x", "w"], 64, 1, "new"),
        ("h0", "forward", ["stem", "w"], 64, 1, "new"), ("o0", "forward", ["h0", "stem"], 64, 1, "new"),
        ("h1", "forward", ["o0", "w"], 64, 1, "new"), ("o1", "forward", ["h1", "o0"], 64, 1, "new"),
        ("head", "forward", ["o1", "w"], 16, 1, "new"), ("loss", "loss", ["head"], 4, 1, "new"),
        ("g_head", "backward", ["loss", "o1"], 64, 1, "new"),
        ("g_o1", "backward", ["g_head", "h1", "o0"], 64, 1, "new"),
        ("g_h1", "backward", ["g_o1", "o0"], 64, 1, "new"), ("g_o0", "backward", ["g_h1", "h0", "stem"], 64, 1, "new"),
        ("g_h0", "backward", ["g_o0", "stem"], 64, 1, "new"), ("gw", "backward", ["g_h0", "x"], 4, 1, "new"),
        ("out", "output", ["loss", "gw"], 0, 0, "output"),
    ]
    modules = {"stem": "stem", "h0": "layers.0.conv", "o0": "layers.0", "h1": "layers.1.conv", "o1": "layers.1",
               "head": "fc"}
    return build_profile(specs, modules=modules, name="blocks")


def test_repeated_blocks():
    mods = ["conv1", "layer1.0.conv1", "layer1.0.downsample.0", "layer1.0.downsample.1", "layer1.1.bn2",
            "bert.encoder.layer.3.attention.self", "bert.encoder.layer.0.output", "transformer.h.5.attn",
            "transformer.h.0.mlp", "features.7"]
    blocks = repeated_blocks(mods)
    assert blocks["layer1.0.downsample.1"] == "layer1.0"  # the outermost repeated container wins
    assert blocks["layer1.1.bn2"] == "layer1.1"
    assert blocks["bert.encoder.layer.3.attention.self"] == "bert.encoder.layer.3"
    assert blocks["transformer.h.0.mlp"] == "transformer.h.0"
    assert "conv1" not in blocks and "features.7" not in blocks  # a single numbered child is no repetition


def test_per_module_keeps_block_inputs_and_outputs():
    ctx = PlanContext(two_block_profile())
    # h0 and h1 live inside their blocks; o0 leaves block 0 (it is block 1's input) and is kept; o1 feeds
    # the head outside the blocks; the stem is in no block.
    assert sorted(ctx.rg.act_ids[k] for k in per_module(ctx)) == ["h0", "h1"]


def test_articulation_points_and_sqrt_n():
    ctx = PlanContext(two_block_profile())
    # h0 is jumped over by the skip stem -> o0, h1 by o0 -> o1; head is no activation (backward never reads it).
    assert [ctx.rg.act_ids[k] for k in articulation_points(ctx)] == ["stem", "o0", "o1"]
    # Three points: keep every round(sqrt(3)) = 2nd one (o0) and recompute every other candidate.
    assert sorted(ctx.rg.act_ids[k] for k in sqrt_n(ctx)) == ["h0", "h1", "o1", "stem"]


def test_fixed_baselines_use_the_same_simulator():
    p = two_block_profile()
    sim = Simulator(p)
    keep = plan(p, 10**9, "keep-all", sim)
    assert keep.recomputed == [] and keep.predicted_peak_bytes == sim.baseline_peak
    every = plan(p, 1, "recompute-all", sim)
    assert every.predicted_peak_bytes == every.floor_bytes <= sim.floor_bytes and not every.feasible
    assert every.stop_reason.startswith("candidates exhausted")
    blocks = plan(p, 1, "per-module", sim)
    assert sorted(blocks.recomputed) == ["h0", "h1"] and blocks.stop_reason.startswith("budget not met: per-module")
    assert sim.simulate(blocks.recomputed).peak_bytes == blocks.predicted_peak_bytes
    fits = plan(p, blocks.predicted_peak_bytes, "per-module", sim)
    assert fits.feasible and fits.stop_reason == "budget met"


def test_milp_on_the_chain_by_hand():
    p = chain_profile()
    ctx = PlanContext(p)
    a, b = ctx.rg.act_index["a"], ctx.rg.act_index["b"]
    assert exact_recompute_set(ctx, 816) == ([a], "optimal")  # a (1 ms) rather than b (2 ms)
    assert exact_recompute_set(ctx, 716) == ([a, b], "optimal")
    chosen, why = exact_recompute_set(ctx, 700)
    assert chosen is None and "cannot free" in why
    assert plan(p, 700, "milp").stop_reason.startswith("no recompute set fits")


def brute_force_optimum(ctx: PlanContext, budget: int) -> float | None:
    best = None
    cands = ctx.rg.candidates
    for n in range(len(cands) + 1):
        for subset in itertools.combinations(cands, n):
            if ctx.sim.peak(subset, by_index=True)[0] <= budget:
                extra = sum(ctx.rg.expand(k, list(subset)).time_ms for k in subset)
                best = extra if best is None else min(best, extra)
    return best


# Seeds 121, 134 and 139 have budgets where the first MILP solution does not fit once simulated (transients).
@pytest.mark.parametrize("seed", [*range(100, 112), 121, 134, 139])
def test_milp_is_the_exact_optimum_and_never_worse_than_mutwo(seed):
    p = random_profile(seed, n_forward=7)
    ctx = PlanContext(p)
    if not 0 < len(ctx.rg.candidates) <= 9:
        pytest.skip("enumeration wants 1..9 candidates")
    traj = mutwo_trajectory(p, ctx.sim)
    budgets = sorted({s.predicted_peak_bytes for s in traj.steps} | {ctx.sim.floor_bytes - 1})
    for budget in budgets:
        exact = plan(p, budget, "milp", ctx.sim)
        optimum = brute_force_optimum(ctx, budget)
        assert exact.feasible == (optimum is not None)
        if optimum is None:
            continue
        assert exact.predicted_extra_ms == pytest.approx(optimum)
        assert exact.predicted_peak_bytes <= budget
        mu = traj.plan_for_budget(budget)
        if mu.feasible:
            assert exact.predicted_extra_ms <= mu.predicted_extra_ms + 1e-9


def test_sweep_and_milp_size_limit(monkeypatch):
    p = random_profile(5, n_forward=12)
    table = sweep(p, milp_points=3)
    assert set(table.solver) == {"auto", "mutwo", "blocks", "keep-all", "recompute-all", "per-module", "sqrt-n", "milp"}
    mutwo = table[table.solver == "mutwo"]
    assert mutwo.peak_bytes.is_monotonic_decreasing and mutwo.extra_ms.is_monotonic_increasing
    assert (table[table.solver == "milp"].gap >= -1e-9).all()
    monkeypatch.setattr("acstudio.plan.milp.MAX_CANDIDATES", 1)
    with pytest.raises(ACStudioError, match="at most 1 candidates"):
        plan(p, 1, "milp")
    assert "skipped" in sweep(p, ["milp"]).note.iloc[0]
