"""One registry of solvers and one of replay modes; ``auto`` is never beaten by a plan it knows."""

from __future__ import annotations

import numpy as np
import pytest
from test_simulator import random_profile

from acstudio.errors import ACStudioError
from acstudio.plan.schedule import PlanContext
from acstudio.plan.solvers import SOLVERS, plan, sweep
from acstudio.plan.solvers.registry import auto_solvers
from acstudio.simulate.modes import REPLAY_MODES, get_mode, simulate_plan


def test_registries_name_every_solver_and_mode():
    assert {"auto", "mutwo", "milp", "keep-all", "recompute-all", "per-module", "sqrt-n"} <= set(SOLVERS)
    for name, s in SOLVERS.items():
        assert s.solve.__name__ == "solve_" + name.replace("-", "_") and s.summary
    assert {"again", "shared"} <= set(REPLAY_MODES)
    with pytest.raises(ACStudioError, match="unknown replay mode 'nope'"):
        get_mode("nope")
    with pytest.raises(ACStudioError, match="unknown solver 'nope'"):
        plan(random_profile(1), 1, "nope")


@pytest.mark.parametrize("seed", range(12))
def test_auto_is_never_dominated(seed):
    p = random_profile(seed, n_forward=10 + seed % 5)
    ctx = PlanContext(p)
    lo, hi = ctx.floor_bytes, ctx.sim.baseline_peak
    for budget in np.linspace(lo * 0.95, hi * 1.02, 8).astype(int):
        best = plan(p, int(budget), ctx=ctx)
        assert best.solver == "auto" and best.floor_bytes == ctx.floor_bytes
        # What auto returns is what its mode really costs.
        sim = simulate_plan(ctx.sim, best.recomputed, best.replay_mode)
        assert (sim.peak_bytes, sim.extra_ms) == (best.predicted_peak_bytes, pytest.approx(best.predicted_extra_ms))
        for name in auto_solvers():
            other = plan(p, int(budget), name, ctx=ctx)
            assert other.floor_bytes >= best.floor_bytes
            if other.feasible:
                assert best.feasible and best.predicted_extra_ms <= other.predicted_extra_ms + 1e-9, name
            elif not best.feasible:
                assert best.predicted_peak_bytes <= other.predicted_peak_bytes, name


def test_sweep_auto_is_the_lower_envelope():
    table = sweep(random_profile(4, n_forward=14), milp_points=2)
    auto = table[table.solver == "auto"]
    assert auto.peak_bytes.is_monotonic_increasing and auto.extra_ms.is_monotonic_decreasing
    others = table[table.solver.isin(["mutwo", "per-module", "sqrt-n", "recompute-all", "keep-all"])]
    for _, row in others.iterrows():  # every point auto knows has an auto point at or below it
        if row.solver == "mutwo" or row.replay_mode in SOLVERS[row.solver].real_modes:
            below = auto[auto.peak_bytes <= row.peak_bytes]
            assert len(below) and below.extra_ms.min() <= row.extra_ms + 1e-9


def test_peak_report_adds_up_to_the_predicted_peak():
    from acstudio.plan.peak import explain_peak, floor_sentence

    p = random_profile(7, n_forward=12)
    ctx = PlanContext(p)
    for budget in (ctx.floor_bytes, (ctx.floor_bytes + ctx.sim.baseline_peak) // 2, ctx.sim.baseline_peak):
        chosen = plan(p, budget, ctx=ctx)
        report = explain_peak(ctx, chosen)
        assert report.node == chosen.predicted_peak_node and report.total == chosen.predicted_peak_bytes
        assert report.freeable + report.fixed_activations + sum(report.parts.values()) == report.total
        assert report.summary().startswith("peak ")
    assert floor_sentence(ctx).startswith("the floor is ")


def test_auto_takes_the_shared_chain_programs_set_when_it_is_faster(monkeypatch):
    """With its program on, auto is never slower than without it nor than the program's own set, and somewhere
    the program finds a plan every other solver misses."""
    from acstudio.plan.solvers.milp import shared_bound

    wins = 0
    for seed in range(6):
        p = random_profile(seed, n_forward=12)
        ctx = PlanContext(p)
        for budget in np.linspace(ctx.floor_bytes, ctx.sim.baseline_peak, 6)[1:-1].astype(int):
            monkeypatch.setenv("ACSTUDIO_AUTO_MILP_SECONDS", "0")
            without = plan(p, int(budget), ctx=ctx)
            monkeypatch.setenv("ACSTUDIO_AUTO_MILP_SECONDS", "10")
            best = plan(p, int(budget), ctx=ctx)
            program = shared_bound(ctx, int(budget), time_limit_s=10)
            if without.feasible:
                assert best.feasible and best.predicted_extra_ms <= without.predicted_extra_ms + 1e-9
            if program.chosen:
                assert best.predicted_extra_ms <= program.extra_ms + 1e-9
            wins += best.predicted_extra_ms < without.predicted_extra_ms - 1e-9
    assert wins


def test_a_bad_program_time_is_one_line(monkeypatch):
    monkeypatch.setenv("ACSTUDIO_AUTO_MILP_SECONDS", "ten")
    p = random_profile(0, n_forward=10)
    with pytest.raises(ACStudioError, match="ACSTUDIO_AUTO_MILP_SECONDS='ten' is not a number of seconds"):
        plan(p, int(p.peak_bytes * 0.9))


def test_every_solver_has_a_look_of_its_own_whatever_the_order():
    """The Pareto chart draws each solver in its own colour and symbol, looked up by name (never by the order
    rows arrive in), distinct from every other solver's."""
    looks = [SOLVERS[name].look for name in SOLVERS]
    assert len({look.colour for look in looks}) == len(looks) and len({look.symbol for look in looks}) == len(looks)
    shuffled = list(SOLVERS)
    np.random.default_rng(0).shuffle(shuffled)
    assert {name: SOLVERS[name].look for name in shuffled} == {name: SOLVERS[name].look for name in SOLVERS}
    from acstudio.plan.solvers.registry import solver

    with pytest.raises(ValueError, match="no look"):
        solver("unlooked", "a solver nobody gave a look")


# Strings that are a solver's name by coincidence, in another namespace: the benchmark's configuration of the peer
# the per-op set models, and the SAC policy file's field of per-block decisions.
OTHER_NAMESPACES = {("acstudio/bench/configs.py", "per-op"), ("acstudio/export/sac.py", "blocks")}


def test_no_solver_name_is_written_outside_its_package():
    """Code outside ``acstudio/plan/solvers/`` asks a solver's record for its traits, never tests its name."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    found = []
    for path in sorted((root / "acstudio").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("acstudio/plan/solvers/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in SOLVERS and (rel, node.value) not in OTHER_NAMESPACES:
                found.append(f"{rel}:{node.lineno}: {node.value!r}")
    assert not found, found


def test_a_plan_carries_its_simulation_and_is_simulated_once(monkeypatch, tmp_path):
    import acstudio.plan.schedule as schedule
    from acstudio.plan import load_plan
    from acstudio.plan.peak import explain_peak

    p = random_profile(3, n_forward=12)
    ctx = PlanContext(p)
    best = plan(p, (ctx.floor_bytes + ctx.sim.baseline_peak) // 2, ctx=ctx)
    calls = []
    simulate = schedule.simulate_plan
    monkeypatch.setattr(schedule, "simulate_plan", lambda *a: calls.append(a) or simulate(*a))
    first = ctx.simulation(best)
    assert ctx.simulation(best) is first and best.simulation is first
    explain_peak(ctx, best)
    assert len(calls) == 1
    assert (first.peak_bytes, first.extra_ms) == (best.predicted_peak_bytes, pytest.approx(best.predicted_extra_ms))
    # never saved: the file reads back as the plan without it
    assert "simulation" not in best.to_dict()
    best.save(tmp_path / "plan.json")
    again = load_plan(tmp_path / "plan.json", p)
    assert again == best and again.simulation is None


def test_a_cancel_or_ctrl_c_stops_a_program_at_once():
    """HiGHS cannot be interrupted inside a program; the caller waits on it in short steps, so a cancel token or
    Ctrl-C ends the wait within a fraction of a second, not at the program's time limit."""
    import _thread
    import threading
    import time

    from acstudio.errors import Cancelled
    from acstudio.jobs import CancelToken
    from acstudio.plan.solvers.milp import interruptible

    finish = threading.Event()
    cancel = CancelToken()
    late = []

    def cancelled_while_solving():  # waits without the GIL, as HiGHS solves, while its caller is cancelled
        cancel.cancel()
        finish.wait(10)

    def interrupted_while_solving():  # the same with Ctrl-C
        _thread.interrupt_main()
        finish.wait(10)

    def finish_programs() -> None:
        finish.set()
        for worker in threading.enumerate():
            if worker.name == "HiGHS":
                worker.join(10)
        finish.clear()

    assert interruptible(lambda: "solved", None) == "solved"
    start = time.perf_counter()
    with pytest.raises(Cancelled):
        interruptible(cancelled_while_solving, cancel)
    with pytest.raises(Cancelled):  # cancelled while the abandoned program still runs: it never runs
        interruptible(lambda: late.append("ran"), cancel)
    assert time.perf_counter() - start < 1.0
    finish_programs()
    assert not late
    start = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        interruptible(interrupted_while_solving, None)
    assert time.perf_counter() - start < 1.0
    finish_programs()
    with pytest.raises(ZeroDivisionError):  # what the program raises reaches the caller
        interruptible(lambda: 1 / 0, None)


def test_every_solver_plans_a_model_without_repeated_blocks(tmp_path):
    """A two-layer MLP has no blocks to search over: every solver still answers with a plan (the block search
    with its starting state), and auto picks one that fits a budget between the floor and the peak."""
    from acstudio.cli import main
    from acstudio.profile.model import Profile

    (tmp_path / "mlp.py").write_text(
        "import torch\n\n"
        "def make(batch_size):\n"
        "    torch.manual_seed(0)\n"
        "    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))\n"
        "    return model, torch.randn(batch_size, 8), lambda m, b: m(b).square().mean()\n")
    assert main(["profile", f"{tmp_path / 'mlp.py'}:make", "-b", "4", "--device", "cpu",
                 "--out", str(tmp_path / "mlp.json")]) == 0
    profile = Profile.load(tmp_path / "mlp.json")
    for name in SOLVERS:
        got = plan(profile, profile.peak_bytes, name)
        assert got.feasible and got.predicted_peak_bytes <= profile.peak_bytes, name


# Seeds whose solvers, asked below the floor, handed back a slower plan than auto finds at the same peak.
@pytest.mark.parametrize("seed", [100, 106])
def test_below_the_floor_auto_plans_the_fastest_way_to_its_lowest_peak(seed):
    p = random_profile(seed, n_forward=12)
    ctx = PlanContext(p)
    below = plan(p, ctx.floor_bytes - 1, ctx=ctx)
    at_peak = plan(p, below.predicted_peak_bytes, ctx=ctx)
    assert not below.feasible and below.budget_bytes == ctx.floor_bytes - 1
    assert at_peak.feasible and at_peak.predicted_peak_bytes == below.predicted_peak_bytes
    assert below.predicted_extra_ms <= at_peak.predicted_extra_ms + 1e-9
    simulated = simulate_plan(ctx.sim, below.recomputed, below.replay_mode, below.offloaded)
    assert simulated.peak_bytes == below.predicted_peak_bytes
    assert below.stop_reason.startswith("budget not met: the fastest plan at the lowest peak reached")
