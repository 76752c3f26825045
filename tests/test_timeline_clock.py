"""The simulated step's clock: one set of node times, replays and waits for late copies included, that the
simulator returns and the timeline draws the copies on."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from acstudio.plan.schedule import PlanContext
from acstudio.profile.model import HostLink, Profile
from acstudio.simulate.modes import get_mode
from acstudio.views.timeline import TimelineAxis, copy_spans, node_time_text

SAMPLE = Path(__file__).resolve().parents[1] / "sample_profiles" / "cpu_resnet18_bs4.json.gz"
SLOW_LINK = HostLink(d2h_gb_s=0.1, h2d_gb_s=0.1, duplex_gb_s=0.1, host_free_bytes=16 * 2**30)


@pytest.fixture(scope="module")
def ctx():
    """A profile whose host link is too slow for its copies to hide: the step waits for them."""
    return PlanContext(dataclasses.replace(Profile.load(SAMPLE), host_link=SLOW_LINK))


def stalling_plan(ctx: PlanContext, mode: str):
    """A plan that recomputes every third candidate and offloads half of the rest, and its simulated step."""
    rg, sim = ctx.rg, ctx.sim
    recomputed = list(rg.candidates[::3])
    offloaded = [int(k) for k in np.flatnonzero(sim.offload_facts.offloadable) if k not in recomputed][::2]
    plan = ctx.plan_for_set("mutwo", ctx.sim.baseline_peak, recomputed, mode=mode, offloaded=offloaded)
    return plan, ctx.simulation(plan)


@pytest.mark.parametrize("mode", ["again", "shared"])
def test_the_clock_holds_replays_and_waits_and_ends_at_the_predicted_step_time(ctx, mode):
    plan, result = stalling_plan(ctx, mode)
    clock, offload, run = result.clock, result.offload, ctx.rg.run_ms
    assert offload.stall_ms > 0 and offload.by_replay.any(), "the case needs stalls and replays reading copies"
    assert plan.predicted_extra_ms == pytest.approx(result.extra_ms)
    # the last node ends at the iteration plus the plan's extra time (its replays and its stalls)
    assert ctx.profile.time_scale < 1  # the nodes' run times add up to the iteration
    # (less the host's calls' delay, which moves nodes and copies alike and is not drawn)
    assert clock.step_ms == pytest.approx(ctx.profile.iteration_ms + plan.predicted_extra_ms - offload.issue_ms)
    replays = get_mode(mode).schedule(ctx.sim, ctx.sim.indices(plan.recomputed)).replays
    before = np.bincount([r.at for r in replays], weights=[r.time_ms for r in replays], minlength=len(run))
    assert np.allclose(clock.end - clock.start, run)
    assert np.allclose(clock.start - clock.issue, before + offload.waits)
    assert np.allclose(clock.issue[1:], clock.end[:-1]) and clock.issue[0] == 0
    assert offload.waits.sum() == pytest.approx(offload.stall_ms) and (offload.waits >= 0).all()
    # on this clock no activation is read before its copy back has landed, and the stalled ones land just then
    needed = clock.start[offload.needed]
    assert (offload.h2d[:, 1] <= needed + 1e-9).all()
    assert (np.isclose(offload.h2d[:, 1], needed) & (offload.waits[offload.needed] > 0)).any()
    # the planned clock, without the waits, has the step read some copies before they land
    planned = ctx.sim.clock([r.at for r in replays], [r.time_ms for r in replays])
    assert (offload.h2d[:, 1] > planned.start[offload.needed] + 1e-6).any()


def test_recompute_only_results_carry_the_clock_of_their_replays(ctx):
    sim = ctx.sim
    recomputed = [sim.replay.act_ids[k] for k in ctx.rg.candidates[::3]]
    result = sim.simulate(recomputed)
    assert result.offload is None
    assert result.clock.step_ms == pytest.approx(ctx.profile.iteration_ms + result.extra_ms)
    same = get_mode("again").simulate(sim, recomputed, ())
    assert np.array_equal(same.clock.start, result.clock.start)


@pytest.mark.parametrize("axis_mode", ["time", "order"])
def test_the_timeline_draws_copies_on_the_simulators_clock(ctx, axis_mode):
    _plan, result = stalling_plan(ctx, "again")
    clock, offload = result.clock, result.offload
    axis = TimelineAxis.of(ctx.profile, axis_mode)
    d2h, h2d = copy_spans(axis, result)
    # a copy is drawn at the node running while it runs, on the simulator's clock; where the step runs replays or
    # waits for copies before a node, at that node's left edge
    edges = axis.edges
    for spans, times in ((d2h, offload.d2h), (h2d, offload.h2d)):
        for x, t in zip(spans.ravel(), times.ravel()):
            i = int(np.searchsorted(clock.start, t, side="right")) - 1  # the last node started by then
            if t < clock.end[i]:
                assert edges[i] - 1e-9 <= x <= edges[i + 1] + 1e-9
            else:
                assert x == pytest.approx(edges[i + 1])
    # a copy back the step waits for ends at the left edge of the node that waits for it
    lands = np.isclose(offload.h2d[:, 1], clock.start[offload.needed]) & (offload.waits[offload.needed] > 0)
    assert lands.any()
    assert np.allclose(h2d[lands, 1], edges[offload.needed[lands]])
    assert (h2d[:, 1] <= edges[offload.needed] + 1e-9).all()


def test_a_node_names_when_it_runs_and_what_the_step_does_before_it(ctx):
    _plan, result = stalling_plan(ctx, "again")
    clock, offload = result.clock, result.offload
    i = int(np.argmax(offload.waits))
    text = node_time_text(result, i)
    assert text.startswith(f"runs {clock.start[i]:.2f}–{clock.end[i]:.2f} ms into the {clock.step_ms:.2f} ms step")
    assert f"{offload.waits[i]:.2f} ms waiting for copies" in text
    plain = int(np.flatnonzero((clock.start == clock.issue) & (ctx.rg.run_ms > 0))[-1])
    assert node_time_text(result, plain).endswith("(simulated)")
    recomputed = ctx.sim.simulate([ctx.rg.act_ids[k] for k in ctx.rg.candidates[:1]])
    at = int(ctx.rg.first_bw[ctx.rg.candidates[0]])
    assert node_time_text(recomputed, at).endswith(f"after {recomputed.extra_ms:.2f} ms recomputing")
