"""The exact program's third decision: keep, recompute or offload, under the budget, the link and the host cap."""

from __future__ import annotations

import dataclasses

import pytest
from test_rewrite import captured
from test_simulator import random_profile

import acstudio.plan.solvers.milp as milp_module
import acstudio.simulate.offload as offload_module
from acstudio.plan import plan as make_plan
from acstudio.plan.model import Plan
from acstudio.plan.schedule import PlanContext
from acstudio.plan.solvers.auto import auto_plan
from acstudio.plan.solvers.milp import _AgainProgram, exact_milp, exact_recompute_set, milp_plan
from acstudio.plan.solvers.milp_bound import bounded_plan
from acstudio.plan.solvers.mutwo import offload_greedy, offload_plan, trajectory
from acstudio.profile.model import HostLink
from acstudio.rewrite import rewrite
from acstudio.rewrite.memory import live_bytes
from acstudio.simulate.modes import simulate_plan


def on_gpu(profile, rate_gb_s: float | None = None, host_bytes: int = 2**30):
    """The profile as if measured on a GPU with a link of ``rate_gb_s`` each way (None: the stated default) whose
    copies cost their bytes only: the tiny models' node times are too short to carry the fixed costs of a copy and
    of the host's calls (those are priced in test_offload_cost)."""
    env = {**profile.environment, "device_type": "cuda"}
    link = (HostLink(rate_gb_s, rate_gb_s, rate_gb_s, host_bytes, copy_latency_us=0.0, offload_issue_us=0.0)
            if rate_gb_s else None)
    return dataclasses.replace(profile, environment=env, host_link=link)


@pytest.fixture
def small_copies(monkeypatch):
    """The synthetic profiles' activations are tens of bytes: let them be offloaded."""
    monkeypatch.setattr(offload_module, "MIN_OFFLOAD_BYTES", 1)


def tight_budgets(ctx: PlanContext, n: int = 3) -> list[int]:
    """The lowest peaks of μ-TWO's recompute-only curve: budgets where recomputation alone is expensive."""
    return sorted({s.predicted_peak_bytes for s in trajectory(ctx.without_offload()).steps})[:n]


def check_simulated(ctx: PlanContext, plan: Plan) -> None:
    """The plan's prediction is the exact simulation of its decisions, and that fits its budget."""
    assert plan.feasible
    result = simulate_plan(ctx.sim, plan.recomputed, plan.replay_mode, plan.offloaded)
    assert result.peak_bytes == plan.predicted_peak_bytes <= plan.budget_bytes
    assert result.extra_ms == pytest.approx(plan.predicted_extra_ms)


@pytest.mark.parametrize("seed", range(100, 112))
def test_with_a_fast_link_the_program_beats_recompute_only_and_the_greedy(seed, small_copies):
    ctx = PlanContext(on_gpu(random_profile(seed, n_forward=10)), offload=True)
    assert ctx.may_offload
    for budget in tight_budgets(ctx):
        plan = milp_plan(ctx, budget, exact_milp(ctx, budget, time_limit_s=20))
        recompute_only = milp_plan(ctx.without_offload(), budget, exact_milp(ctx.without_offload(), budget, 20))
        assert not recompute_only.offloaded
        if not recompute_only.feasible:
            continue
        check_simulated(ctx, plan)
        assert plan.predicted_extra_ms <= recompute_only.predicted_extra_ms + 1e-9
        greedy = offload_greedy(ctx, budget, ctx.host_memory)
        if greedy is not None and greedy.feasible and greedy.copies_hidden:  # the program's space: hidden copies
            assert plan.predicted_extra_ms <= greedy.predicted_extra_ms + 1e-9
        if plan.offloaded:
            assert plan.copies_hidden and "offloaded" in plan.stop_reason
            assert plan.offload_bytes == plan.host_bytes <= ctx.host_memory


@pytest.mark.parametrize("seed", range(100, 106))
def test_with_a_slow_link_every_plan_fits_once_simulated_and_prices_its_stalls(seed, small_copies):
    """Copies of ~100 bytes at 30 kB/s take milliseconds: queued on the link, they free later and fetch earlier
    than the program estimates, and may stall; the plan is still simulated exactly and fits."""
    ctx = PlanContext(on_gpu(random_profile(seed, n_forward=10), rate_gb_s=3e-5), offload=True)
    for budget in tight_budgets(ctx):
        result = exact_milp(ctx, budget, time_limit_s=20)
        plan = milp_plan(ctx, budget, result)
        if result.chosen is None:
            continue
        check_simulated(ctx, plan)
        assert plan.predicted_extra_ms == pytest.approx(result.extra_ms)
        assert result.lower_bound_ms <= result.extra_ms + 1e-9


def test_a_slow_link_converges_where_only_the_recompute_set_fits(small_copies):
    """Most offloads the program tries with the recompute set that fits are over budget once simulated: cutting off
    each with the solutions that offload fewer lets it end, proven, at no more than the recompute-only optimum, not
    at its round limit (the copies it keeps are those held past the peak, which land late but fit)."""
    ctx = PlanContext(on_gpu(random_profile(303, n_forward=14), rate_gb_s=1e-4), offload=True)
    result = exact_milp(ctx, 531, time_limit_s=20)
    recompute_only = exact_milp(ctx.without_offload(), 531)
    assert result.optimal and result.extra_ms <= recompute_only.extra_ms + 1e-9
    check_simulated(ctx, milp_plan(ctx, 531, result))


def test_without_offload_the_program_is_the_recompute_only_one(small_copies):
    profile = random_profile(121, n_forward=10)
    gpu = on_gpu(profile)
    for budget in tight_budgets(PlanContext(gpu)):
        off = PlanContext(gpu, offload=False)
        assert _AgainProgram(off, budget).copies is None
        assert _AgainProgram(PlanContext(gpu, offload=True), budget).copies is not None
        assert _AgainProgram(PlanContext(profile, offload=True), budget).copies is None  # a CPU has no link
        without = exact_milp(off, budget)
        assert without == exact_milp(PlanContext(profile), budget)
        assert not without.offloaded and "copies" not in without.status
        assert make_plan(gpu, budget, "milp", offload=False).to_dict() == make_plan(profile, budget, "milp").to_dict()


def test_the_host_cap_bounds_what_the_program_offloads(small_copies):
    gpu = on_gpu(random_profile(124, n_forward=10))
    budget = tight_budgets(PlanContext(gpu))[0]
    free = make_plan(gpu, budget, "milp")
    assert free.offloaded and free.feasible
    assert not make_plan(gpu, budget, "milp", host_memory=0).offloaded
    cap = free.host_bytes // 2
    capped = make_plan(gpu, budget, "milp", host_memory=cap)
    assert capped.host_bytes <= cap
    assert capped.predicted_extra_ms >= free.predicted_extra_ms - 1e-9
    assert not capped.feasible or capped.predicted_peak_bytes <= budget


def test_a_round_limit_answers_with_the_cheaper_of_what_it_found_and_the_incumbent(small_copies):
    ctx = PlanContext(on_gpu(random_profile(109, n_forward=10), rate_gb_s=3e-5), offload=True)
    budget = tight_budgets(ctx)[0]
    best = exact_milp(ctx, budget)
    mu = trajectory(ctx).plan_for_budget(budget)
    incumbent = [ctx.rg.act_index[a] for a in mu.recomputed]
    early = exact_recompute_set(ctx, budget, max_rounds=1, incumbent=incumbent)
    assert early.chosen is not None and early.extra_ms <= mu.predicted_extra_ms + 1e-9
    assert early.lower_bound_ms <= best.extra_ms + 1e-9 <= early.extra_ms + 2e-9
    check_simulated(ctx, milp_plan(ctx, budget, early))


@pytest.mark.parametrize("seed", [109, 121, 124])
def test_milp_bound_knows_the_offload_plans_and_says_what_its_bound_covers(seed, small_copies):
    ctx = PlanContext(on_gpu(random_profile(seed, n_forward=10)), offload=True)
    budget = tight_budgets(ctx)[0]
    plan, lower = bounded_plan(ctx, budget)
    exact = milp_plan(ctx, budget, exact_milp(ctx, budget))
    recompute_only = exact_milp(ctx.without_offload(), budget)
    check_simulated(ctx, plan)
    assert plan.predicted_extra_ms <= min(auto_plan(ctx, budget).predicted_extra_ms, exact.predicted_extra_ms) + 1e-9
    assert lower <= recompute_only.extra_ms + 1e-9  # proven for recompute-only plans
    if lower > 0:
        assert "proven for plans without offload" in plan.stop_reason


def test_stopped_before_any_solution_it_answers_with_mutwos_faster_plan(small_copies, monkeypatch):
    ctx = PlanContext(on_gpu(random_profile(114, n_forward=10)), offload=True)
    budget = tight_budgets(ctx)[0]
    recompute_only = trajectory(ctx).plan_for_budget(budget)
    moved = offload_plan(ctx, budget)
    assert moved.feasible and moved.replay_mode == "again"
    assert moved.predicted_extra_ms < recompute_only.predicted_extra_ms
    bound = moved.predicted_extra_ms / 2  # what the stopped search proved
    stop = milp_module._Outcome(None, 0.0, bound, 1, "time limit")
    monkeypatch.setattr(milp_module, "_solve_lazily", lambda *_: stop)
    stopped = exact_milp(ctx, budget)
    assert not stopped.optimal and stopped.status.startswith("time limit: the incumbent is within")
    assert stopped.extra_ms == pytest.approx(moved.predicted_extra_ms) and stopped.lower_bound_ms == bound
    assert sorted(ctx.rg.act_ids[k] for k in stopped.offloaded) == sorted(moved.offloaded)
    check_simulated(ctx, milp_plan(ctx, budget, stopped))


def test_on_a_real_model_the_plan_offloads_rewrites_as_predicted_and_beats_the_greedy():
    *_, step, profile = captured("gpt2")
    gpu = on_gpu(profile, rate_gb_s=0.25)  # copies several times longer than the nodes they run beside
    budget = int(profile.peak_bytes * 0.8)
    ctx = PlanContext(gpu, offload=True)
    plan = make_plan(gpu, budget, "milp", ctx=ctx)
    assert plan.offloaded and plan.recomputed  # its copies may wait where one is held past the peak: priced
    check_simulated(ctx, plan)
    assert max(live_bytes(rewrite(step, gpu, plan).gm, gpu)) == plan.predicted_peak_bytes
    recompute_only = make_plan(gpu, budget, "milp", offload=False)
    assert recompute_only.feasible and plan.predicted_extra_ms < recompute_only.predicted_extra_ms
    assert plan.predicted_extra_ms <= offload_plan(ctx, budget).predicted_extra_ms + 1e-9


def test_with_the_host_calls_priced_offload_never_makes_the_program_slower_than_without():
    """On a step the host limits, each offload's calls cost step time: the program prices them, so a plan that
    may offload is never slower than the program's plan without offload."""
    *_, profile = captured("gpt2")
    env = {**profile.environment, "device_type": "cuda"}
    gpu = dataclasses.replace(profile, environment=env, host_link=HostLink(0.5, 0.5, 0.5, 2**30))  # default costs
    budget = int(profile.peak_bytes * 0.8)
    may_offload = make_plan(gpu, budget, "milp", ctx=PlanContext(gpu, offload=True))
    without = make_plan(gpu, budget, "milp", offload=False)
    assert may_offload.feasible and without.feasible
    assert may_offload.predicted_extra_ms <= without.predicted_extra_ms + 1e-9
    check_simulated(PlanContext(gpu, offload=True), may_offload)
