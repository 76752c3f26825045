"""Several ranks: FSDP2 and DDP under torchrun with gloo on the CPU, and the per-rank memory prediction."""

import math

import numpy as np
import pytest
from conftest import tiny_spec

from acstudio.bench import run_bench
from acstudio.bench.runner import profile_key
from acstudio.bench.worker import run_config
from acstudio.errors import ACStudioError
from acstudio.profile.model import Profile
from acstudio.simulate.sharding import per_rank_profile, static_bytes
from acstudio.simulate.simulator import Simulator
from acstudio.units import parse_budget

NO_DROPOUT = (("resid_pdrop", "0"), ("embd_pdrop", "0"), ("attn_pdrop", "0"))


SAC = "fsdp+sac+compile@60%"
PEER = "ddp+compile+per-op"  # torchtitan's policy, each block compiled with its checkpoint, under DDP


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Tiny GPT-2 (tied weights) under FSDP2 and DDP on 2 gloo ranks of batch 2 (and our plan with its blocks
    compiled, backend aot_eager, under FSDP2), and one process of batch 4 (this one: the bench worker's own
    function), and the profile of batch 2 that the plan's worker measured."""
    out = tmp_path_factory.mktemp("dist")
    spec = tiny_spec("gpt2", config=(*tiny_spec("gpt2").config, *NO_DROPOUT))
    ranks = run_bench(spec, [2], ["fsdp", "ddp", SAC, PEER], device="cpu", out_dir=out / "ranks", warmup=1, iters=3,
                      nproc=2, compile_backend="aot_eager")
    single = run_config({"spec": spec.with_batch_size(4).to_dict(), "config": "eager", "device": "cpu",
                         "warmup": 1, "iters": 3})
    profile = Profile.load(out / "ranks" / "profiles" / f"{profile_key(spec.with_batch_size(2), 'cpu')}.json.gz")
    return profile, {r["config"]: r for r in [*ranks.rows, single]}


def test_fsdp_and_ddp_train_like_one_process_on_the_global_batch(two_ranks):
    """The SAC-wrapped blocks are compiled in place, then sharded (torchtitan's order); so are the peer's, each
    block's checkpoint in its forward (``enable_per_block(in_forward=True)``), compiled with it."""
    _, rows = two_ranks
    eager = rows["eager"]
    for config in ("fsdp", "ddp", SAC, PEER):
        row = rows[config]
        assert row["status"] == "ok", row["message"]
        assert row["nproc"] == 2 and row["parallel"] == config.split("+")[0]
        assert row["baseline"] in (None, "fsdp", "ddp")
        assert len(row["rank_peak_bytes"]) == 2 and "--nproc 2" in row["command"]
        # 5 steps (warm-up, peak step, 3 timed; a compiled row warms up longer): the later ones depend on the
        # averaged gradients
        assert len(eager["losses"]) == 5 and len(row["losses"]) >= 5
        np.testing.assert_allclose(row["losses"][:5], eager["losses"], rtol=1e-5)
    assert rows[SAC]["details"]["compiled"] == rows[PEER]["details"]["compiled"] == "per block"


def test_measured_rank_state_matches_the_per_rank_prediction(two_ranks):
    profile, rows = two_ranks
    single = static_bytes(profile)
    for config in ("fsdp", "ddp"):
        predicted = static_bytes(per_rank_profile(profile, 2, config))
        for measured in rows[config]["rank_state_bytes"]:
            assert measured == predicted, config
    fsdp = static_bytes(per_rank_profile(profile, 2, "fsdp"))
    assert fsdp["parameter"] == single["parameter"] // 2  # every tiny GPT-2 weight has an even first dimension
    # sac under FSDP2 plans on one rank's predicted memory, priced as SAC replays it
    sac = rows[SAC]["details"]
    rank_peak = per_rank_profile(profile, 2, "fsdp").peak_bytes
    assert sac["profile_peak_bytes"] == rank_peak < profile.peak_bytes
    assert sac["budget_bytes"] == parse_budget("60%", rank_peak) and sac["plan"]["replay_mode"] == "sac"


@pytest.fixture(scope="module")
def resnet():
    return Profile.load("sample_profiles/cpu_resnet18_bs16_sgd.json.gz")


def test_one_rank_is_the_profile_itself(resnet):
    assert per_rank_profile(resnet, 1, "fsdp") is resnet and per_rank_profile(resnet, 1, "ddp") is resnet
    with pytest.raises(ACStudioError, match="sharding"):
        per_rank_profile(resnet, 2, "zero3")


@pytest.mark.parametrize("world", [2, 4, 8])
def test_fsdp_shards_state_and_keeps_activations(resnet, world):
    rank = per_rank_profile(resnet, world, "fsdp")
    full, sharded = static_bytes(resnet), static_bytes(rank)
    for category, nbytes in full.items():
        assert nbytes / world <= sharded[category] <= math.ceil(nbytes / world) + 64 * 2**10 * world
    assert [a.bytes for a in rank.activations] == [a.bytes for a in resnet.activations]
    assert rank.fingerprint == resnet.fingerprint  # plans made on it apply to the same graph
    assert rank.environment["sharding"] == {"kind": "fsdp", "world": world}
    assert static_bytes(resnet) == full  # the input profile is untouched
    # the state it no longer holds comes off the peak; unsharded blocks and buffers add less than that back
    saved = sum(full.values()) - sum(sharded.values())
    assert resnet.peak_bytes - saved < rank.peak_bytes < resnet.peak_bytes
    sim = Simulator(rank)
    assert sim.baseline_peak == rank.peak_bytes and sim.floor_bytes < rank.peak_bytes


def test_fsdp_holds_the_roots_parameters_unsharded_beside_their_shards(resnet):
    """At the first forward node (the stem, outside every block) a rank holds its shards of the state alive
    there plus the root's whole parameters (fails where the unsharded copy replaced the shards)."""
    from acstudio.simulate.sharding import _Blocks

    rank = per_rank_profile(resnet, 2, "fsdp")
    blocks = _Blocks(resnet)
    params = blocks.parameter_bytes()
    i = blocks.first_forward
    shrink = sum(a.bytes - b.bytes for a, b in zip(resnet.tensors, rank.tensors, strict=True)
                 if resnet.node_index[a.created_at] <= i)
    assert blocks.forward_span[blocks.order[0]][0] > i
    assert rank.nodes[i].mem_after - resnet.nodes[i].mem_after == params[""] - shrink


def test_ddp_adds_one_gradient_copy_everywhere(resnet):
    rank = per_rank_profile(resnet, 2, "ddp")
    grads = static_bytes(resnet)["gradient"]
    assert static_bytes(rank) == static_bytes(resnet)
    assert [b.mem_peak - a.mem_peak for a, b in zip(resnet.nodes, rank.nodes)] == [grads] * len(resnet.nodes)
    assert rank.peak_bytes == resnet.peak_bytes + grads
