"""Offload under data parallelism: two gloo ranks on the CPU each plan with offload on their own rank's memory
(the single-device profile as a DDP rank sees it), save and load that plan, and train with the rewritten step.

This file is also each rank's program: the test starts it under torchrun, every rank writes what it trained to
a file, and the test compares the ranks and the runs.
"""

import copy
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

WORLD = 2
STEPS = 3
NO_DROPOUT = (("resid_pdrop", "0"), ("embd_pdrop", "0"), ("attn_pdrop", "0"))
# Copies priced by their bytes only: the tiny model's node times are too short to carry the fixed costs of a copy
# and of the host's calls, which would make every offload cost more than recomputing.
FAST_LINK = {"d2h_gb_s": 55.0, "h2d_gb_s": 55.0, "duplex_gb_s": 49.0, "host_free_bytes": 64 * 2**30,
             "copy_latency_us": 0.0, "offload_issue_us": 0.0}


def data_parallel_step(step, model, optimizer, batch, world: int) -> torch.Tensor:
    """One DDP iteration through a rewritten step.

    The step's graph ends with the optimizer's update, out of reach of DDP's reducer (it hooks eager autograd).
    So the graph runs at learning rate 0, where SGD without momentum or weight decay leaves every parameter as it
    was, and leaves this rank's gradients in ``.grad``; they are averaged over the ranks as DDP's default
    communication hook does (divided by the world size, then all-reduced), and the optimizer steps eagerly.
    """
    rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    loss = step.run(model, optimizer, batch)
    for group, lr in zip(optimizer.param_groups, rates):
        group["lr"] = lr
    for p in model.parameters():
        p.grad.div_(world)
        dist.all_reduce(p.grad)
    optimizer.step()
    return loss


def trained(model) -> dict[str, list[torch.Tensor]]:
    return {"params": [p.detach().clone() for p in model.parameters()],
            "grads": [p.grad.detach().clone() for p in model.parameters()]}


def rank_main(out: Path) -> None:
    """One rank: capture its slice of the global batch, plan its own memory with offload, and train three steps
    three ways from the same start: the plan, the same plan without offload, and eager DDP."""
    from conftest import tiny_spec
    from test_offload import on_gpu
    from test_rewrite import quick_profile

    from acstudio.bench.distributed import Ranks
    from acstudio.capture import capture_step
    from acstudio.capture.step import prepare_optimizer
    from acstudio.hostcopy import CpuOffloadWarning
    from acstudio.plan import plan as make_plan
    from acstudio.plan.loading import load_plan
    from acstudio.rewrite import offload as runtime_module
    from acstudio.rewrite import rewrite, rewrite_step
    from acstudio.simulate.sharding import per_rank_profile
    from acstudio.workload import build_workload

    ranks = Ranks.start("ddp", "cpu")
    spec = tiny_spec("gpt2", optimizer="sgd", momentum=0.0, config=(*tiny_spec("gpt2").config, *NO_DROPOUT))
    w = build_workload(ranks.global_spec(spec))  # the same model and global batch on every rank
    w.batch = ranks.local_batch(w.batch)
    start = copy.deepcopy(w.model)
    step = capture_step(w.model, w.make_optimizer(), w.batch, w.loss_fn)
    single = quick_profile(spec, step)
    # the rank's memory as DDP holds it, on a GPU with a fast link (a CPU profile plans no offload)
    profile = on_gpu(per_rank_profile(single, ranks.world, "ddp"), **FAST_LINK)
    budget = int(profile.peak_bytes * 0.8)
    made = make_plan(profile, budget)
    made.save(out / f"plan{ranks.rank}.json")
    plan = load_plan(out / f"plan{ranks.rank}.json", profile)
    offloading = rewrite(step, profile, plan)
    plain = rewrite_step(step, profile, plan.recomputed, replay_mode=plan.replay_mode, offloaded=[])
    runs = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CpuOffloadWarning)
        for name, rewritten in (("offload", offloading), ("plain", plain)):
            model = copy.deepcopy(start)
            optimizer = w.make_optimizer(model)
            prepare_optimizer(model, optimizer)
            runs[name] = []
            for _ in range(STEPS):
                loss = data_parallel_step(rewritten, model, optimizer, w.batch, ranks.world)
                runs[name].append({"loss": loss.clone(), **trained(model)})
    from torch.nn.parallel import DistributedDataParallel

    model = copy.deepcopy(start)
    ddp, optimizer = DistributedDataParallel(model), w.make_optimizer(model)
    runs["ddp"] = []
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        loss = w.loss_fn(ddp, w.batch)
        loss.backward()
        optimizer.step()
        runs["ddp"].append({"loss": loss.detach().clone(), **trained(model)})
    runtime = getattr(offloading.gm, runtime_module.RUNTIME_ATTR)
    torch.save({"runs": runs, "offloaded": plan.offloaded, "recomputed": plan.recomputed,
                "offload_bytes": plan.offload_bytes, "predicted_peak": plan.predicted_peak_bytes, "budget": budget,
                "rank_peak": profile.peak_bytes, "single_peak": single.peak_bytes,
                "sharding": profile.environment["sharding"], "pool_bytes": runtime.pool_bytes,
                "placed": [o.activation for o in offloading.offloads],
                "warnings": [str(c.message) for c in caught if issubclass(c.category, CpuOffloadWarning)]},
               out / f"rank{ranks.rank}.pt")
    ranks.stop()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("gloo")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
               __file__, str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


def test_each_rank_plans_its_own_memory_with_offload(ranks):
    for rank in ranks:
        assert rank["sharding"] == {"kind": "ddp", "world": WORLD}
        assert rank["rank_peak"] > rank["single_peak"], "a DDP rank holds a second copy of the gradients"
        assert rank["offloaded"] and rank["predicted_peak"] <= rank["budget"] < rank["rank_peak"]
        assert sorted(rank["placed"]) == sorted(rank["offloaded"]) and rank["pool_bytes"] == rank["offload_bytes"]
        assert len(rank["warnings"]) == 1 and "run it on a GPU" in rank["warnings"][0]
    assert ranks[0]["offloaded"] == ranks[1]["offloaded"] and ranks[0]["recomputed"] == ranks[1]["recomputed"]


def test_offload_trains_bitwise_like_the_plan_without_it_and_the_ranks_agree(ranks):
    for rank in ranks:
        for ours, theirs in zip(rank["runs"]["offload"], rank["runs"]["plain"], strict=True):
            assert torch.equal(ours["loss"], theirs["loss"])
            for key in ("grads", "params"):
                assert all(torch.equal(a, b) for a, b in zip(ours[key], theirs[key], strict=True)), key
    first, second = (rank["runs"]["offload"] for rank in ranks)
    for a, b in zip(first, second):
        assert not torch.equal(a["loss"], b["loss"]), "each rank trains its own slice of the batch"
        for key in ("grads", "params"):  # DDP's invariant: averaged gradients, so the same parameters everywhere
            assert all(torch.equal(x, y) for x, y in zip(a[key], b[key], strict=True)), key


def test_the_ranks_train_like_eager_ddp(ranks):
    for rank in ranks:
        for ours, ddp in zip(rank["runs"]["offload"], rank["runs"]["ddp"], strict=True):
            np.testing.assert_allclose(ours["loss"].item(), ddp["loss"].item(), rtol=1e-5)
            for a, b in zip(ours["params"], ddp["params"], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
    rank_main(Path(sys.argv[1]))
