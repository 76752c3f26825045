"""μ-TWO planner: hand-checked greedy, plan invariants on random graphs, plan files, budgets, a real profile."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from test_simulator import build_profile, chain_profile, random_profile, tiny_real_profile

from acstudio.errors import ACStudioError, Cancelled, PlanMismatchError, ProfileFileError
from acstudio.jobs import CancelToken
from acstudio.plan import Plan, candidates, format_bytes, load_plan, mutwo_trajectory, parse_budget, plan, sweep
from acstudio.plan.schedule import PlanContext
from acstudio.plan.solvers.mutwo import BASELINE_FITS, BUDGET_MET, EXHAUSTED
from acstudio.simulate import Simulator


def test_chain_greedy_by_hand():
    """Both a (100 B / 1 ms) and b (200 B / 2 ms) have ratio 100; a waits longer, so it goes first. Then b must
    replay a as well (a is not back before b's first backward use): 200 B / 3 ms."""
    p = chain_profile()
    traj = mutwo_trajectory(p)
    assert [(s.activation, s.predicted_peak_bytes, s.predicted_peak_node, s.extra_ms) for s in traj.steps] == [
        ("", 916, "gc", 0.0), ("a", 816, "gc", 1.0), ("b", 716, "gb", 4.0)]
    assert traj.stop_reason == EXHAUSTED
    assert candidates(p) == ["a", "b"]

    fits = traj.plan_for_budget(916)
    assert fits.recomputed == [] and fits.feasible and fits.stop_reason == BASELINE_FITS
    one = traj.plan_for_budget(900)
    assert (one.recomputed, one.predicted_peak_bytes, one.predicted_extra_ms, one.stop_reason) == (
        ["a"], 816, 1.0, BUDGET_MET)
    both = traj.plan_for_budget(800)
    assert both.recomputed == ["a", "b"] and both.predicted_peak_bytes == 716
    # Schedule in execution order: b (before gb), then a (before ga).
    b, a = both.schedule
    assert (b.activation, b.freed_after, b.recompute_before, b.replay, b.sources, b.recompute_ms) == (
        "b", "c", "gb", ["a", "b"], ["w", "x"], 3.0)
    assert b.ratio == pytest.approx(200 / 3)
    assert (a.activation, a.replay, a.sources, a.ratio) == ("a", ["a"], ["w", "x"], 100.0)

    low = traj.plan_for_budget(700)
    assert not low.feasible and low.stop_reason == EXHAUSTED
    assert low.floor_bytes == 716 and low.predicted_peak_bytes == 716 and low.baseline_peak_bytes == 916
    assert plan(p, 700).recomputed == ["a", "b"]
    assert plan(p, 10_000).stop_reason == BASELINE_FITS


def _check_plan(p, sim: Simulator, pl: Plan, budget: int) -> None:
    assert pl.budget_bytes == budget
    assert pl.feasible == (pl.predicted_peak_bytes <= budget)
    if budget >= sim.baseline_peak:
        assert pl.recomputed == [] and pl.feasible
    if budget < sim.floor_bytes and budget < pl.predicted_peak_bytes:
        assert not pl.feasible and pl.floor_bytes <= sim.floor_bytes  # the floor over every replay mode
    r = sim.simulate(pl.recomputed)
    assert (r.peak_bytes, r.peak_node) == (pl.predicted_peak_bytes, pl.predicted_peak_node)
    assert r.extra_ms == pytest.approx(pl.predicted_extra_ms)
    assert sorted(e.activation for e in pl.schedule) == sorted(pl.recomputed)
    assert sum(e.recompute_ms for e in pl.schedule) == pytest.approx(pl.predicted_extra_ms)
    order = [(p.node_index[e.recompute_before], p.node_index[e.freed_after]) for e in pl.schedule]
    assert order == sorted(order, key=lambda x: x[0])
    for e in pl.schedule:
        replay_idx = [p.node_index[v] for v in e.replay]
        assert replay_idx == sorted(replay_idx) and all(p.nodes[i].replay == "ok" for i in replay_idx)


@pytest.mark.parametrize("seed", range(25))
def test_invariants_on_random_graphs(seed):
    p = random_profile(seed, n_forward=8 + seed % 7)
    sim = Simulator(p)
    traj = mutwo_trajectory(p, sim)
    assert sim.floor == Simulator(p).floor  # an exhausted trajectory's last step stands in for the floor
    peaks = [s.predicted_peak_bytes for s in traj.steps]
    own = [s.simulated_peak_bytes for s in traj.steps]
    assert peaks == np.minimum.accumulate(own).tolist()  # monotone: the running minimum
    assert [s.extra_ms for s in traj.steps] == sorted(s.extra_ms for s in traj.steps)
    ctx = PlanContext(p, sim)
    for j in range(len(traj.steps)):
        # The incrementally kept replays equal a from-scratch schedule of the same prefix.
        got = traj.plan_at(j, 0, "")
        ref = ctx.plan_for_set("mutwo", 0, [sim.replay.act_index[a] for a in got.recomputed])
        assert got.predicted_peak_bytes == own[j] == ref.predicted_peak_bytes
        assert [(e.activation, e.sources, e.replay) for e in got.schedule] == [
            (e.activation, e.sources, e.replay) for e in ref.schedule]
    lo = min(sim.floor_bytes, min(own))
    for budget in {*np.linspace(lo * 0.9, sim.baseline_peak * 1.05, 9).astype(int).tolist(), *own}:
        pl = traj.plan_for_budget(budget)
        _check_plan(p, sim, pl, budget)
        # plan() answers with the cheaper of that plan and a shared-chain prefix that fits too.
        scratch, best = plan(p, budget, "mutwo", simulator=sim), traj.best_plan_for_budget(budget)
        assert scratch.to_dict() == best.to_dict()
        assert best.feasible >= pl.feasible
        if pl.feasible:
            assert best.predicted_peak_bytes <= budget and best.predicted_extra_ms <= pl.predicted_extra_ms
        if best.replay_mode == "again":
            assert (best.recomputed, best.predicted_peak_bytes) == (pl.recomputed, pl.predicted_peak_bytes)


def test_plan_file_round_trip_and_mismatch(tmp_path):
    p = chain_profile()
    pl = plan(p, 800)
    for name in ("plan.json", "plan.json.gz"):
        pl.save(tmp_path / name)
        back = load_plan(tmp_path / name, profile=p)
        assert back == pl
    other = random_profile(3)
    with pytest.raises(PlanMismatchError, match="made for graph"):
        load_plan(tmp_path / "plan.json", profile=other)
    with pytest.raises(PlanMismatchError):
        pl.decisions(other)
    p.save(tmp_path / "profile.json.gz")
    with pytest.raises(ProfileFileError, match=r"expected a acstudio\.plan file"):
        Plan.load(tmp_path / "profile.json.gz")
    (tmp_path / "broken.json").write_text(json.dumps({"schema": "acstudio.plan", "version": 1}))
    with pytest.raises(ProfileFileError, match="corrupt plan"):
        Plan.load(tmp_path / "broken.json")


def test_decisions_and_schedule_export(tmp_path):
    p = chain_profile()
    pl = plan(p, 900)
    assert pl.decisions(p) == {"a": "recompute", "b": "retain",
                               "c": "not a candidate: no node runs between its last forward and first backward use"}
    paths = pl.export_schedule(tmp_path / "out")
    assert [path.rsplit("/", 1)[1] for path in paths] == ["schedule.json", "schedule.csv"]
    df = pd.read_csv(paths[1], index_col="activation")
    assert df.loc["a", "decision"] == "recompute" and df.loc["a", "recompute_before"] == "ga"
    assert df.loc["b", "decision"] == "retain" and df.loc["b", "bytes"] == 200
    assert df.loc["c", "decision"].startswith("not a candidate")
    doc = json.loads(open(paths[0]).read())
    assert doc["recomputed"] == ["a"] and doc["schedule"][0]["replay"] == ["a"]
    assert doc["profile_fingerprint"] == p.fingerprint


def test_budget_parsing_and_formatting():
    base = 8 * 2**30
    assert parse_budget("6GiB", base) == 6 * 2**30
    assert parse_budget("5000MiB", base) == 5000 * 2**20
    assert parse_budget("1.5GB", base) == 1_500_000_000
    assert parse_budget("123456B", base) == 123456
    assert parse_budget(" 60% ", base) == round(0.6 * base)
    assert parse_budget("2g", base) == 2 * 2**30
    for bad in ("", "six GiB", "6 GiBs", "-1GiB", "0", "85", "5 parsecs", "%"):
        with pytest.raises(ACStudioError, match="budget"):
            parse_budget(bad, base)
    assert format_bytes(int(5.91 * 2**30)) == "5.91 GiB"
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(3 * 2**40) == "3.00 TiB"


def test_progress_cancel_and_unknown_solver():
    p = random_profile(11, n_forward=14)
    calls = []
    mutwo_trajectory(p, progress=lambda done, total, msg: calls.append((done, total)))
    assert calls and calls[-1][0] == calls[-1][1]
    token = CancelToken()
    token.cancel()
    with pytest.raises(Cancelled):
        mutwo_trajectory(p, cancel=token)
    with pytest.raises(ACStudioError, match="unknown solver"):
        plan(p, 1, "magic")


def test_peak_out_of_reach_stops_early():
    """A peak in the optimizer (no activation alive) ends the trajectory at once and says why."""
    specs = [("x", "input", [], 8, 0, "batch"), ("w", "input", [], 4, 0, "param"),
             ("a", "forward", ["x", "w"], 100, 1, "new"), ("b", "forward", ["a"], 100, 1, "new"),
             ("loss", "loss", ["b"], 4, 1, "new"), ("gb", "backward", ["loss", "b"], 100, 1, "new"),
             ("ga", "backward", ["gb", "a"], 100, 1, "new"), ("gw", "backward", ["ga", "x"], 4, 1, "new"),
             ("opt", "optimizer", ["gw"], 5000, 1, "new"), ("upd", "optimizer", ["w", "opt"], 0, 1, "inplace"),
             ("out", "output", ["loss", "gw"], 0, 0, "output")]
    p = build_profile(specs)
    traj = mutwo_trajectory(p)
    assert len(traj.steps) == 1 and "out of reach" in traj.stop_reason and "opt (optimizer)" in traj.stop_reason
    pl = plan(p, p.peak_bytes - 1)
    assert not pl.feasible and pl.recomputed == [] and "out of reach" in pl.stop_reason


def test_real_profile_end_to_end(tmp_path):
    """Tiny BERT profiled on the CPU: trajectory, budget lookups, every solver, plan file against the profile."""
    p = tiny_real_profile()
    sim = Simulator(p)
    traj = mutwo_trajectory(p, sim)
    assert len(traj.steps) > 5 and traj.steps[-1].predicted_peak_bytes < sim.baseline_peak
    budget = (traj.steps[-1].predicted_peak_bytes + sim.baseline_peak) // 2
    pl = traj.plan_for_budget(budget)
    _check_plan(p, sim, pl, budget)
    assert pl.feasible and pl.recomputed
    kept = mutwo_trajectory(p, Simulator(p, keep_random=True)).plan_for_budget(budget)  # --keep-random
    assert kept.keep_random and not pl.keep_random
    assert any(d.startswith("not a candidate: ") and "random" in d for d in kept.decisions(p).values())
    pl.save(tmp_path / "plan.json")
    assert load_plan(tmp_path / "plan.json", profile=p).recomputed == pl.recomputed
    table = sweep(p, simulator=sim, milp_points=3, milp_time_s=3)  # both programs, top, middle and floor
    assert set(table.solver) == {"auto", "mutwo", "blocks", "keep-all", "recompute-all", "per-module", "sqrt-n",
                                 "per-op", "milp", "milp-bound"}
    milp = table[table.solver == "milp"]
    assert len(milp) == 3 and milp.optimal.all()
    assert (milp.extra_ms <= milp.mutwo_extra_ms + 1e-9).all() and (milp.gap >= -1e-9).all()


def test_profile_without_activations():
    """Nothing saved for backward: every solver answers with the baseline, budgets below it are infeasible."""
    specs = [("x", "input", [], 8, 0, "batch"), ("w", "input", [], 4, 0, "param"),
             ("a", "forward", ["x", "w"], 100, 1, "new"), ("loss", "loss", ["a"], 4, 1, "new"),
             ("g", "backward", ["loss", "x"], 4, 1, "new"), ("out", "output", ["loss", "g"], 0, 0, "output")]
    p = build_profile(specs)
    traj = mutwo_trajectory(p)
    assert len(traj.steps) == 1 and traj.plan_for_budget(10**6).stop_reason == BASELINE_FITS
    for solver in ("mutwo", "recompute-all", "milp"):
        pl = plan(p, 10, solver)
        assert not pl.feasible and pl.recomputed == [] and pl.predicted_peak_bytes == p.peak_bytes == pl.floor_bytes
