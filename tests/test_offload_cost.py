"""What a copy to the host and back costs: its bytes at the link's rate plus a fixed time per copy, in the profile,
in the simulated schedule and in the planner's choice between offloading and recomputing."""

import dataclasses
import gzip
import json

import numpy as np
import pytest
import torch
from test_offload import BYTES_ONLY, offloadable, on_gpu
from test_rewrite import captured

from acstudio.errors import CorruptFileError
from acstudio.plan import plan as make_plan
from acstudio.profile.model import (
    DEFAULT_COPY_LATENCY_US,
    DEFAULT_NODE_ISSUE_US,
    DEFAULT_OFFLOAD_ISSUE_US,
    DEFAULT_OP_ISSUE_US,
    UNISSUED_OPS,
    HostLink,
    Profile,
)
from acstudio.simulate.modes import simulate_plan
from acstudio.simulate.offload import host_delay
from acstudio.simulate.simulator import Simulator


def test_the_copy_latency_round_trips_and_older_files_get_the_stated_default(tmp_path):
    *_, profile = captured("gpt2")
    measured = dataclasses.replace(profile, host_link=HostLink(55.0, 54.0, 48.5, 3 * 2**30, copy_latency_us=7.5))
    measured.save(tmp_path / "new.json")
    back = Profile.load(tmp_path / "new.json")
    assert back.host_link == measured.host_link and back.link.copy_latency_ms == pytest.approx(0.0075)

    doc = measured.to_dict()  # a file from before the copy latency was measured: the key is absent
    del doc["host_link"]["copy_latency_us"]
    with gzip.open(tmp_path / "old.json.gz", "wt") as f:
        json.dump({"schema": "acstudio.profile", "version": 1, **doc}, f)
    old = Profile.load(tmp_path / "old.json.gz")
    assert old.host_link.copy_latency_us is None and old.link.measured  # the bandwidths still count as measured
    assert old.link.copy_latency_ms == DEFAULT_COPY_LATENCY_US / 1e3
    assert old.link.copy_ms(48.5e6) == pytest.approx(DEFAULT_COPY_LATENCY_US / 1e3 + 1.0)

    doc["host_link"]["copy_latency_us"] = -1.0
    with open(tmp_path / "bad.json", "w") as f:
        json.dump({"schema": "acstudio.profile", "version": 1, **doc}, f)
    with pytest.raises(CorruptFileError, match="copy_latency_us"):
        Profile.load(tmp_path / "bad.json")


def test_every_copy_takes_the_fixed_time_beside_its_bytes():
    *_, profile = captured("gpt2")
    link = HostLink(20.0, 20.0, 10.0, 2**30, copy_latency_us=40.0, offload_issue_us=0.0)
    sim = Simulator(dataclasses.replace(profile, host_link=link))
    schedule = simulate_plan(sim, [], "again", offloadable(sim)).offload
    took = 0.040 + schedule.bytes / 10.0e6
    assert np.allclose(schedule.d2h[:, 1] - schedule.d2h[:, 0], took)
    assert np.allclose(schedule.h2d[:, 1] - schedule.h2d[:, 0], took)
    # The lane is serial: n copies hold it for n fixed times plus their bytes, more than one copy of those bytes.
    lane = (schedule.d2h[:, 1] - schedule.d2h[:, 0]).sum()
    assert len(schedule.bytes) > 1 and lane == pytest.approx(len(schedule.bytes) * 0.040 + schedule.moved_bytes / 1e7)
    assert lane > link.copy_ms(schedule.moved_bytes)


def test_many_small_copies_stall_where_the_same_bytes_in_one_copy_would_not():
    *_, profile = captured("gpt2")
    sim = Simulator(dataclasses.replace(profile, host_link=HostLink(**BYTES_ONLY)))
    acts = offloadable(sim)
    free = simulate_plan(sim, [], "again", acts)
    assert free.offload.hidden
    # A fixed cost per copy of one node's run time: the same bytes now stall the step, and more copies stall more.
    node_ms = float(np.median(sim.replay.run_ms))
    costly = Simulator(dataclasses.replace(profile, host_link=HostLink(copy_latency_us=1e3 * node_ms,
                                                                        offload_issue_us=0.0)))
    few, many = (simulate_plan(costly, [], "again", acts[:n]) for n in (len(acts) // 4, len(acts)))
    assert many.offload.stall_ms > few.offload.stall_ms >= 0 and many.extra_ms > free.extra_ms


def test_host_calls_delay_the_device_only_where_the_host_limits_the_step():
    device = np.full(10, 1.0)
    calls_at = np.array([2, 5])
    host_bound = host_delay(device, np.full(10, 1.0), calls_at, 0.5)
    assert host_bound.tolist() == [0, 0, 0.5, 0.5, 0.5, 1, 1, 1, 1, 1, 1]  # every node after a call starts later
    assert not host_delay(device, np.full(10, 0.1), calls_at, 0.5).any()  # the host's lead absorbs them
    # Node 1 could start at 4 (node 0, issued at 1, runs 3 on the device) and was issued at 2: of a call of 5
    # before it, the host's lead of 2 absorbs 2, and it and every node after it start 3 later.
    mixed = host_delay(np.array([3.0, 3.0, 0.1, 0.1]), np.full(4, 1.0), np.array([1]), 5.0)
    assert mixed.tolist() == [0, 3, 3, 3, 3]


@pytest.mark.parametrize("host_bound", [True, False])
def test_each_offload_adds_its_calls_host_time_where_the_host_limits_the_step(host_bound):
    *_, profile = captured("gpt2")
    sim = Simulator(profile)
    acts = offloadable(sim)
    device_ms = float(sim.replay.run_ms.sum())
    # The host issues the step in ten times its device time, or a millionth of it; an offload's calls cost as much
    # as issuing 4 nodes.
    issue_ms = device_ms * (10 if host_bound else 1e-6)
    link = HostLink(copy_latency_us=0.0, offload_issue_us=20.0, op_issue_us=5.0)
    sim = Simulator(dataclasses.replace(profile, host_link=link, host_issue_ms=issue_ms))
    per_offload_ms = 4 * sim.profile.node_issue_ms
    for n in (1, len(acts)):
        result = simulate_plan(sim, [], "again", acts[:n])
        assert result.offload.issue_ms == pytest.approx(per_offload_ms * n if host_bound else 0.0)
        assert result.extra_ms == pytest.approx(result.offload.stall_ms + result.offload.issue_ms)
    assert result.offload.hidden  # the calls take host time: the copies still hide


def test_the_host_issue_time_round_trips_and_older_files_get_the_stated_default(tmp_path):
    *_, profile = captured("gpt2")
    measured = dataclasses.replace(profile, host_issue_ms=0.25 * profile.iteration_ms,
                                   host_link=HostLink(op_issue_us=4.0, offload_issue_us=60.0))
    measured.save(tmp_path / "p.json")
    back = Profile.load(tmp_path / "p.json")
    assert back.host_issue_ms == measured.host_issue_ms and back.link.offload_issue_nodes == 15.0
    executed = sum(n.op not in UNISSUED_OPS for n in profile.nodes)
    assert 0 < executed < len(profile.nodes) and back.node_issue_ms == pytest.approx(back.host_issue_ms / executed)
    assert profile.host_issue_ms is None and profile.node_issue_ms == DEFAULT_NODE_ISSUE_US / 1e3
    assert profile.link.offload_issue_nodes == DEFAULT_OFFLOAD_ISSUE_US / DEFAULT_OP_ISSUE_US
    assert "host_issue_ms" not in profile.to_dict()  # a profile without it writes what older files hold


@pytest.mark.parametrize("fixed_cost", ["copy_latency_us", "offload_issue_us"])
def test_the_planner_recomputes_where_an_offload_costs_more_than_the_replay(fixed_cost):
    *_, profile = captured("gpt2")
    budget = int(profile.peak_bytes * 0.9)
    fast = on_gpu(profile, **BYTES_ONLY)
    recompute_only = make_plan(fast, budget, offload=False)
    cheap = make_plan(fast, budget)
    assert cheap.offloaded and cheap.predicted_extra_ms < recompute_only.predicted_extra_ms
    # The same link, but each copy, or each offload's calls, take longer than the whole step: no offload is cheaper
    # than a replay.
    step_ms = float(Simulator(fast).replay.run_ms.sum())
    costly = make_plan(on_gpu(profile, **{**BYTES_ONLY, fixed_cost: 1e3 * step_ms, "op_issue_us": 1e-3}), budget)
    assert not costly.offloaded and costly.feasible
    assert costly.predicted_extra_ms == pytest.approx(recompute_only.predicted_extra_ms)


def test_a_link_whose_copy_costs_cannot_be_timed_keeps_its_rates_and_states_the_defaults(monkeypatch):
    """The fixed copy costs are timed with CUDA events; a driver that refuses that timing must not cost the
    user the profile: the rates stay measured, the costs fall back to the stated defaults, with a warning."""
    import acstudio.profiler as profiler

    def refused(*_args):
        raise RuntimeError("Both events must be completed before calculating elapsed time.")

    monkeypatch.setattr(profiler, "_link_rates", lambda *_args: (50.0, 51.0, 45.0))
    monkeypatch.setattr(profiler, "_copy_costs_us", refused)
    monkeypatch.setattr(profiler, "free_device_memory", lambda: None)
    with pytest.warns(UserWarning, match="stated defaults"):
        link = profiler.measure_host_link(torch.device("cuda"))
    assert (link.d2h_gb_s, link.h2d_gb_s, link.duplex_gb_s) == (50.0, 51.0, 45.0) and link.measured
    assert link.copy_latency_us is None and link.offload_issue_us is None and link.op_issue_us is None
