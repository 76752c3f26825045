"""Profiler invariants, the Profile file format and the errors a user can run into."""

import dataclasses
import gzip
import json

import pytest
import torch
from conftest import gpu, tiny_spec

from acstudio.errors import Cancelled, DeviceError, ProfileFileError, UnknownModelError
from acstudio.jobs import CancelToken
from acstudio.profile.model import Profile
from acstudio.profile.replay_rules import replay_rules
from acstudio.profile.vocabulary import CATEGORIES
from acstudio.profiler import profile_workload
from acstudio.workload import WorkloadSpec, build_workload


@pytest.fixture(scope="module")
def bert_profile():
    return profile_workload(tiny_spec("bert"), "cpu")


def test_profile_invariants(bert_profile):
    p = bert_profile
    idx = p.node_index
    assert p.peak_bytes == max(n.mem_peak for n in p.nodes)
    assert p.node_by_id[p.peak_node].mem_peak == p.peak_bytes
    assert all(n.mem_peak >= n.mem_after for n in p.nodes)
    assert {t.category for t in p.tensors} <= set(CATEGORIES)
    # every activation is made in forward, read in backward, and its lifetime is ordered
    for a in p.activations:
        assert p.node_by_id[a.created_at].region in ("forward", "loss")
        assert p.node_by_id[a.first_bw_use].region == "backward"
        assert idx[a.created_at] <= idx[a.last_fw_use] < idx[a.first_bw_use] <= idx[a.last_bw_use]
        assert a.inactive_time_ms >= 0
    # dropout masks (written by a random op: native_dropout on GPU, bernoulli_ on CPU) are recomputable by default
    # (replayed with their forward's generator state); under --keep-random they are not, and the reason names
    # the random node
    kept = replay_rules(p, keep_random=True).activation
    masks = [a for a, why in kept.items() if "random" in why]
    assert len(masks) >= 2 and not any(replay_rules(p).activation[a] for a in masks)
    for a in masks:
        target = p.node_by_id[kept[a].split(":")[0]].target
        assert "dropout" in target or "bernoulli" in target
    # storage accounting: parameters + gradients + optimizer state are what the model says
    params = build_workload(tiny_spec("bert")).model.parameters()
    param_bytes = sum(q.numel() * q.element_size() for q in params)
    by_cat = p.category_bytes()
    assert by_cat["parameter"] == param_bytes
    assert by_cat["gradient"] == param_bytes
    assert by_cat["optimizer_state"] >= 2 * param_bytes  # Adam: two moments (+ step counters)
    assert sum(p.peak_breakdown.values()) == p.peak_bytes


def test_profile_round_trip_and_tables(bert_profile, tmp_path):
    path = tmp_path / "p.json.gz"
    bert_profile.save(path)
    loaded = Profile.load(path)
    assert loaded.fingerprint == bert_profile.fingerprint
    assert loaded.nodes == bert_profile.nodes and loaded.activations == bert_profile.activations
    df = loaded.activations_df()
    assert len(df) == len(loaded.activations) and {"bytes", "first_bw_use", "recomputable"} <= set(df.columns)
    written = loaded.export_csv(tmp_path)
    assert sorted(p.rsplit("/", 1)[-1] for p in written) == ["activations.csv", "nodes.csv"]
    assert (tmp_path / "nodes.csv").read_text().count("\n") == len(loaded.nodes) + 1


def test_device_times_round_trip_one_per_node(bert_profile, tmp_path):
    """A CPU profile has no device times (and writes none); a GPU profile's, one per node, come back as written,
    and a file with another number of them is refused in one line."""
    assert bert_profile.node_device_ms is None and "node_device_ms" not in bert_profile.to_dict()
    times = [0.001 * i for i in range(len(bert_profile.nodes))]
    measured = dataclasses.replace(bert_profile, node_device_ms=times)
    measured.save(tmp_path / "gpu.json")
    assert Profile.load(tmp_path / "gpu.json").node_device_ms == times
    assert measured.nodes_df()["device_time_ms"].tolist() == times  # beside run_time_ms in nodes.csv
    doc = json.loads((tmp_path / "gpu.json").read_text())
    doc["node_device_ms"] = times[:-1]
    (tmp_path / "short.json").write_text(json.dumps(doc))
    with pytest.raises(ProfileFileError, match=f"{len(times) - 1} times for {len(times)} nodes") as err:
        Profile.load(tmp_path / "short.json")
    assert "\n" not in str(err.value)


@gpu
def test_device_times_leave_out_the_hosts_launch():
    """Node by node on an idle device a node's events also time its launch; with the device kept ahead they time
    its kernels alone: never more than the node-by-node time (beyond noise), and well below it in sum on a small
    model, whose nodes are mostly launch."""
    profile = profile_workload(tiny_spec("gpt2"), "cuda")
    device, run = profile.node_device_ms, [n.run_time_ms for n in profile.nodes]
    assert device is not None and len(device) == len(run)
    assert all(d <= r + 0.05 for d, r in zip(device, run))
    assert 0 < sum(device) < 0.7 * sum(run)


def test_corrupt_and_wrong_version_files(bert_profile, tmp_path):
    bad = tmp_path / "bad.json.gz"
    bad.write_bytes(b"\x1f\x8bnot really gzip")
    with pytest.raises(ProfileFileError, match="not a readable"):
        Profile.load(bad)
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"schema": "acstudio.profile", "version": 99}))
    with pytest.raises(ProfileFileError, match="version 99"):
        Profile.load(old)
    other = tmp_path / "plan.json.gz"
    other.write_bytes(gzip.compress(json.dumps({"schema": "acstudio.plan", "version": 1}).encode()))
    with pytest.raises(ProfileFileError, match=r"expected a acstudio\.profile"):
        Profile.load(other)
    truncated = tmp_path / "trunc.json"
    truncated.write_text(json.dumps({"schema": "acstudio.profile", "version": 1, "nodes": []}))
    with pytest.raises(ProfileFileError, match="corrupt"):
        Profile.load(truncated)


def test_failed_save_keeps_the_old_file(bert_profile, tmp_path, monkeypatch):
    path = tmp_path / "p.json"
    path.write_text("previous")
    monkeypatch.setattr(Profile, "to_dict", lambda self: {"bad": object()})
    with pytest.raises(TypeError):
        bert_profile.save(path)
    assert path.read_text() == "previous"
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]


def test_cancel_and_bad_input():
    token = CancelToken()
    calls = []

    def progress(done, total, message):
        calls.append(message)
        if "warm-up" in message:
            token.cancel()

    with pytest.raises(Cancelled):
        profile_workload(tiny_spec("resnet18"), "cpu", progress=progress, cancel=token)
    assert calls
    with pytest.raises(UnknownModelError, match="resnet50"):
        build_workload(WorkloadSpec("resnet5o", 2))
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="no CUDA GPU"):
            profile_workload(tiny_spec("resnet18"), "cuda")


def test_data_dependent_control_flow_names_the_user_line(tmp_path):
    from acstudio.errors import CaptureError

    src = tmp_path / "branchy.py"
    src.write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = torch.nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        y = self.lin(x)\n"
        "        if y.sum() > 0:\n"
        "            return y * 2\n"
        "        return y\n"
        "def make(bs):\n"
        "    return M(), torch.randn(bs, 4), lambda m, b: m(b).pow(2).mean()\n")
    with pytest.raises(CaptureError, match=r"branchy.py:8"):
        profile_workload(WorkloadSpec(f"{src}:make", 2), "cpu")


def test_memory_curve_is_streamed_while_measuring():
    chunks = []
    profile = profile_workload(tiny_spec("resnet18"), "cpu", on_memory=lambda s, p, n: chunks.append((s, list(p), n)))
    n = len(profile.nodes)
    assert chunks and chunks[0][0] == 0 and all(total == n for _, _, total in chunks)
    streamed = [v for _, peaks, _ in chunks for v in peaks]
    # the streamed curve is the profile's (the output node, which runs nothing, is settled afterwards)
    assert streamed[:-1] == [node.mem_peak for node in profile.nodes][:-1]


def test_time_scale_prices_recomputation_like_the_h200_measured_it():
    """Node-by-node GPU times include launch gaps; scaled to the whole step they predict the measured cost."""
    from pathlib import Path

    from acstudio.plan.solvers.mutwo import mutwo_trajectory

    root = Path(__file__).resolve().parent.parent
    profile = Profile.load(root / "sample_profiles" / "h200_resnet152_bs64_adam.json.gz")
    raw = sum(n.run_time_ms for n in profile.nodes)
    assert 0 < profile.time_scale < 1 and profile.time_scale == pytest.approx(profile.iteration_ms / raw)
    bench = json.loads((root / "results" / "bench" / "resnet152" / "bs64_first_run.json").read_text())
    rows = {r["config"]: r for r in bench["rows"]}
    measured = rows["rewritten@4811MiB"]["time_ms_median"] - rows["captured"]["time_ms_median"]
    predicted = mutwo_trajectory(profile).plan_for_budget(4811 * 2**20).predicted_extra_ms
    assert predicted == pytest.approx(measured, rel=0.25)  # unscaled node times predicted 2.2x the measured cost
