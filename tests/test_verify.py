"""verify() runs the captured and the rewritten step from identical state and reports every difference."""

import dataclasses
import json

import pytest
import torch
from conftest import gpu, tiny_spec
from test_rewrite import captured, pick

from acstudio.errors import Cancelled, PlanMismatchError
from acstudio.jobs import CancelToken
from acstudio.plan import plan as make_plan
from acstudio.rewrite import batchnorm
from acstudio.rewrite.verify import KINDS, compare, verify


@pytest.fixture(scope="module", params=["resnet18", "bert", "gpt2"])
def profile(request):
    return captured(request.param)[-1]


@pytest.mark.parametrize("fraction", [0.25, 1])
def test_rewrite_passes_bitwise_on_cpu(profile, fraction):
    chosen = pick(profile, fraction)
    calls = []
    mode = "shared" if fraction == 1 else "again"
    result = verify(profile, chosen, progress=lambda *a: calls.append(a), replay_mode=mode)
    assert result.passed and result.exact, result.summary()
    assert [c.kind for c in result.comparisons] == list(KINDS)
    for c in result.comparisons:
        assert c.max_abs == 0.0 and c.max_rel == 0.0 and (c.tensors > 0 or c.kind == "buffers")
    assert result.recomputed == len(chosen) and result.replayed_nodes > 0
    assert result.measured_peak_bytes is None  # CPU: no allocator statistics
    assert result.accounted_peak_bytes <= result.accounted_baseline_peak_bytes
    assert calls[-1][0] == calls[-1][1] and [c[0] for c in calls] == sorted(c[0] for c in calls)
    assert "PASSED" in result.summary()
    assert json.loads(json.dumps(result.to_dict()))["passed"] is True


def test_plan_prediction_is_reported_and_checked():
    profile = captured("bert")[-1]
    plan = make_plan(profile, int(profile.peak_bytes * 0.9))
    result = verify(profile, plan)
    assert result.passed
    assert result.predicted_peak_bytes == plan.predicted_peak_bytes == result.accounted_peak_bytes
    assert result.accounted_peak_bytes < result.accounted_baseline_peak_bytes
    with pytest.raises(PlanMismatchError):
        verify(profile, dataclasses.replace(plan, profile_fingerprint="0" * 16))


def test_catches_a_wrong_rewrite(monkeypatch):
    """A replay that updates BatchNorm running statistics a second time must fail verification on buffers."""
    profile = captured("resnet18")[-1]
    monkeypatch.setattr(batchnorm, "drop_running_stats", lambda node: None)
    result = verify(profile, pick(profile, 0.5))
    failed = {c.kind for c in result.comparisons if not c.passed}
    assert not result.passed and failed == {"buffers"}
    buffers = next(c for c in result.comparisons if c.kind == "buffers")
    assert buffers.max_abs > 0 and any("running_" in name for name in buffers.mismatched)
    assert "FAILED" in result.summary()


def test_cancel():
    profile = captured("gpt2")[-1]
    token = CancelToken()
    token.cancel()
    with pytest.raises(Cancelled):
        verify(profile, pick(profile, 0.5), cancel=token)


def test_compare_tolerances():
    a = {"x": torch.tensor([1.0, 2.0, float("nan")]), "n": torch.tensor(3)}
    same = compare("k", a, {k: v.clone() for k, v in a.items()}, 0.0, 0.0)
    assert same.passed and same.max_abs == 0.0
    off = {"x": torch.tensor([1.0, 2.0 + 1e-6, float("nan")]), "n": torch.tensor(3)}
    exact = compare("k", a, off, 0.0, 0.0)
    assert exact.mismatched == ["x"] and exact.worst == "x" and exact.max_abs == pytest.approx(1e-6, rel=0.1)
    assert exact.max_rel == pytest.approx(5e-7, rel=0.1)
    assert compare("k", a, off, 1e-4, 1e-5).passed
    assert compare("k", a, {"x": a["x"]}, 0.0, 0.0).mismatched == ["n"]
    assert compare("k", a, {**a, "x": torch.zeros(2)}, 1.0, 1.0).mismatched == ["x"]


def test_a_noise_floor_lets_every_tensor_differ_up_to_it():
    """On a nondeterministic device a tensor may differ by up to the kind's noise floor (twice the largest
    run-to-run difference of the kind), even a tensor that matched itself exactly; more than that fails."""
    ref = {"a": torch.zeros(3), "b": torch.zeros(3)}
    assert compare("k", ref, {"a": torch.zeros(3), "b": torch.tensor([0.0, 0.0, 1.9e-3])}, 0.0, 0.0, 2e-3).passed
    beyond = {"a": torch.zeros(3), "b": torch.tensor([0.0, 0.0, 2.1e-3])}
    assert compare("k", ref, beyond, 0.0, 0.0, 2e-3).mismatched == ["b"]


@gpu
def test_cuda_peak_is_measured_and_lower():
    from acstudio.profiler import profile_workload

    profile = profile_workload(tiny_spec("gpt2", batch_size=8, seq_len=64), "cuda")
    plan = make_plan(profile, int(profile.peak_bytes * 0.85))
    result = verify(profile, plan, device="cuda")
    assert result.passed, result.summary()
    assert result.measured_peak_bytes < result.measured_baseline_peak_bytes
    # the prediction is within 1% of the measurement (the allocator rounds, the planner does not)
    assert abs(result.measured_peak_bytes - plan.predicted_peak_bytes) < 0.01 * plan.predicted_peak_bytes
