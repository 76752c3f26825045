"""Shared-chain replays: the evaluator predicts the rewritten graph exactly, and the planner chooses them."""

import functools
import json
import random
import time

import pytest
import torch
from conftest import tiny_spec
from test_rewrite import captured, check_accounting, quick_profile, run_from

from acstudio.capture import capture_step
from acstudio.plan import Plan, load_plan, mutwo_trajectory, plan
from acstudio.rewrite import rewrite, rewrite_step
from acstudio.rewrite.memory import live_bytes
from acstudio.simulate.modes import simulate_plan
from acstudio.simulate.simulator import Simulator
from acstudio.workload import build_workload


@functools.cache
def larger_resnet():
    """ResNet-18 with activations large enough to set the peak (the tiny one's peak is model state)."""
    spec = tiny_spec("resnet18", batch_size=8, image_size=64, optimizer="sgd")
    w = build_workload(spec)
    step = capture_step(w.model, w.make_optimizer(), w.batch, w.loss_fn)
    return step, quick_profile(spec, step)


def workloads():
    for model in ("bert", "gpt2"):
        _, _, _, step, profile = captured(model)
        yield model, step, profile
    yield ("resnet18", *larger_resnet())


def test_evaluator_equals_rewritten_graph_accounting():
    for model, step, profile in workloads():
        sim = Simulator(profile)
        cands = [sim.replay.act_ids[k] for k in sim.replay.candidates]
        rnd = random.Random(model)
        peaks = set()
        for chosen in [cands] + [rnd.sample(cands, rnd.randint(1, len(cands))) for _ in range(4)]:
            predicted = simulate_plan(sim, chosen, "shared")
            new = rewrite_step(step, profile, chosen, replay_mode="shared")
            check_accounting(new.gm, profile, predicted.peak_bytes, sim.replay)
            assert predicted.extra_ms == pytest.approx(new.replay_ms), model
            assert predicted.extra_ms == pytest.approx(sum(predicted.recompute_ms.values()))
            assert predicted.timeline.sum(axis=1).max() == predicted.peak_bytes
            peaks.add(predicted.peak_bytes)
        assert len(peaks) > 1, f"{model}: the plans should not all peak alike"


@pytest.mark.parametrize("model", ["resnet18", "bert", "gpt2"])
def test_shared_plan_steps_are_bitwise_identical(model):
    spec, w, opt, step, profile = captured(model)
    sim = Simulator(profile)
    chosen = [sim.replay.act_ids[k] for k in sim.replay.candidates]
    shared = Plan(**{**plan(profile, profile.peak_bytes, "recompute-all").to_dict(), "schedule": [],
                     "replay_mode": "shared"})
    new = rewrite(step, profile, shared)
    assert sorted(r.activation for r in new.recomputations) == sorted(chosen)
    assert any(r.replayed_by != r.activation for r in new.recomputations), "chains are shared"
    for a, b in zip(run_from(new, w.model, opt, spec.optimizer, w.batch),
                    run_from(step, w.model, opt, spec.optimizer, w.batch)):
        assert torch.equal(a, b)


def test_planner_picks_the_cheaper_mode_and_it_fits():
    for model, step, profile in workloads():
        traj = mutwo_trajectory(profile)
        floor = min(s.predicted_peak_bytes for s in traj.steps)
        modes = set()
        for frac in (0.0, 0.25, 0.5, 0.75, 1.0):
            budget = int(floor + frac * (profile.peak_bytes - floor))
            again = traj.plan_for_budget(budget)
            best = plan(profile, budget, "mutwo")
            assert best.to_dict() == traj.best_plan_for_budget(budget).to_dict()
            modes.add(best.replay_mode)
            if again.feasible:
                assert best.feasible and best.predicted_peak_bytes <= budget
                assert best.predicted_extra_ms <= again.predicted_extra_ms
            if best.replay_mode == "shared":
                new = rewrite(step, profile, best)
                assert max(live_bytes(new.gm, profile)) == best.predicted_peak_bytes
                assert new.replay_ms == pytest.approx(best.predicted_extra_ms)
        if model != "resnet18":  # its synthetic timings cost the same in both modes; ties keep μ-TWO's own
            assert "shared" in modes, f"{model}: shared chains never chosen"


def test_replay_mode_is_saved_and_old_files_load(tmp_path):
    from acstudio.plan.schedule import PlanContext

    _, _, _, _, profile = captured("bert")
    budget = int(profile.peak_bytes * 0.8)
    ctx = PlanContext(profile)
    chosen = ctx.sim.indices(plan(profile, budget).recomputed)
    for mode, legacy in (("shared", True), ("again", False)):
        ctx.plan_for_set("mutwo", budget, chosen, mode=mode).save(tmp_path / "p.json")  # loading re-derives it
        assert load_plan(tmp_path / "p.json", profile).replay_mode == mode
        doc = json.loads((tmp_path / "p.json").read_text())
        del doc["replay_mode"]
        doc["share_chains"] = legacy  # files from before replay modes had names
        (tmp_path / "old.json").write_text(json.dumps(doc))
        assert load_plan(tmp_path / "old.json", profile).replay_mode == mode
    del doc["share_chains"]
    (tmp_path / "older.json").write_text(json.dumps(doc))
    assert load_plan(tmp_path / "older.json", profile).replay_mode == "again"


def test_fast_on_the_resnet152_sample():
    from acstudio.profile.model import Profile

    profile = Profile.load("sample_profiles/h200_resnet152_bs64_adam.json.gz")
    sim = Simulator(profile)
    chosen = [sim.replay.act_ids[k] for k in sim.replay.candidates]
    simulate_plan(sim, chosen, "shared")
    start = time.process_time()
    simulate_plan(sim, chosen, "shared")
    assert time.process_time() - start < 0.15  # about 50 ms on an unloaded core
