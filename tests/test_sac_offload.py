"""A plan's offload carried by the SAC policy: decided per op, priced with the offload schedule, run through
saved-tensors hooks where torch passes SAC's cache through them, refused in one line where it does not."""

import copy
import dataclasses
import functools
import gc
import json
import weakref

import numpy as np
import pytest
import test_sac
import torch
from test_sac import LiveStorages, captured, dropout_free_gpt2, held_at_backward, train
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from acstudio.errors import ACStudioError, ProfileFileError
from acstudio.export import ExportError, export, sac
from acstudio.export import apply as apply_module
from acstudio.export.apply import CompiledOffloadWarning, SacOffload, apply_plan
from acstudio.fileio import write_document
from acstudio.hostcopy import CpuOffloadWarning
from acstudio.plan.schedule import PlanContext
from acstudio.profile.model import HostLink
from acstudio.simulate.modes import simulate_plan
from acstudio.simulate.offload import offload_schedule
from acstudio.simulate.sac import OFFLOAD, SAC_MODE, sac_blocks, simulate_sac
from acstudio.simulate.sharding import per_rank_profile
from acstudio.simulate.simulator import Simulator

needs_hooks = pytest.mark.skipif(bool(sac.offload_unsupported()), reason="this torch's SAC cannot offload")


@functools.cache
def offload_plans(model):
    """(profile, a plan recomputing every third candidate and offloading every other offloadable activation, the
    same plan without offload, the activations its SAC form can offload)."""
    _, profile = captured(model)
    # copies priced by their bytes only: the tiny models' node times are too short to carry a copy's fixed costs
    profile = dataclasses.replace(profile, host_link=HostLink(copy_latency_us=0.0, offload_issue_us=0.0))
    ctx = PlanContext(profile)
    rc = [int(k) for k in ctx.rg.candidates[1::3]]
    off = [k for k in np.flatnonzero(ctx.sim.offload_facts.offloadable).tolist() if k not in rc]
    carried = np.flatnonzero(sac_blocks(ctx.sim).offloadable(rc)).tolist()
    return (profile, ctx.plan_for_set("mutwo", profile.peak_bytes, rc, offloaded=off),
            ctx.plan_for_set("mutwo", profile.peak_bytes, rc), carried)


@pytest.mark.parametrize("model", ["gpt2", "bert"])
def test_sac_mode_offloads_what_its_ops_can_and_prices_it_with_the_offload_schedule(model):
    profile, plan, _, carried = offload_plans(model)
    sim = Simulator(profile)
    with_offload = simulate_plan(sim, plan.recomputed, "sac", plan.offloaded)
    without = simulate_plan(sim, plan.recomputed, "sac")
    moved = with_offload.offload.offloaded.tolist()
    assert moved and set(moved) <= set(carried) < set(sim.indices(plan.offloaded))  # the rest stays on the device
    assert with_offload.peak_bytes < without.peak_bytes
    replays = SAC_MODE.schedule(sim, sim.indices(plan.recomputed)).replays
    same = offload_schedule(sim, moved, replays)
    assert np.array_equal(same.h2d, with_offload.offload.h2d) and same.stall_ms == with_offload.offload.stall_ms
    assert with_offload.extra_ms == pytest.approx(without.extra_ms + same.extra_ms)
    form = simulate_sac(profile, plan.recomputed, plan.offloaded)
    offload_ops = {i for ops in form.decisions.values() for i, how in ops if how == OFFLOAD}
    assert offload_ops == {profile.nodes[sim.replay.created[k]].id for k in moved}
    assert form.result.peak_bytes == with_offload.peak_bytes


def test_a_policy_is_written_at_the_lowest_version_that_holds_its_decisions(tmp_path):
    """Offload decisions need version 2, save-eager ones (the tiny GPT-2's random ops, saved together in eager)
    version 3; a policy with neither stays version 1, which older readers read. Each reads back as written."""
    profile, plan, plain, _ = offload_plans("gpt2")
    policy = sac.SacPolicy.from_plan(profile, plan.recomputed, plan.offloaded)
    without = sac.SacPolicy.from_plan(profile, plain.recomputed)
    assert policy.offloads and not without.offloads
    assert policy.offload_bytes == simulate_sac(profile, plan.recomputed, plan.offloaded).result.offload.moved_bytes
    assert [d.save for ops in policy.blocks.values() for d in ops] == \
        [d.save for ops in without.blocks.values() for d in ops]  # offloaded ops are saved ops, moved
    plain_ops = {b: [dataclasses.replace(d, eager_only=False) for d in ops] for b, ops in without.blocks.items()}
    oldest = dataclasses.replace(without, blocks=plain_ops)
    offload_only = dataclasses.replace(policy, blocks={b: [dataclasses.replace(d, eager_only=False) for d in ops]
                                                       for b, ops in policy.blocks.items()})
    for name, p, version in (("off", offload_only, 2), ("plain", oldest, 1), ("both", policy, 3)):
        (tmp_path / name).mkdir()
        p.save(tmp_path / name)
        doc = json.loads((tmp_path / name / sac.POLICY_FILE).read_text())
        decisions = {how for ops in doc["blocks"].values() for _, _, how in ops}
        assert doc["version"] == version and ("offload_bytes" in doc) == p.offloads
        assert ("offload" in decisions) == p.offloads and ("save-eager" in decisions) == (version == 3)
        assert sac.SacPolicy.load(tmp_path / name) == p
    (tmp_path / "later").mkdir()
    write_document(tmp_path / "later" / sac.POLICY_FILE, sac.POLICY_SCHEMA, 6, policy.to_dict())
    with pytest.raises(ProfileFileError, match=r"version 6 is not supported .*reads version 5"):
        sac.SacPolicy.load(tmp_path / "later")


def test_a_torch_whose_sac_cannot_offload_is_refused_in_one_line_naming_the_step_format(tmp_path, monkeypatch):
    why = "torch 2.11's selective checkpointing keeps what it saves on the device"
    monkeypatch.setattr(sac, "offload_unsupported", lambda: why)
    w, _ = captured("gpt2")
    profile, plan, plain, _ = offload_plans("gpt2")
    expected = (f"the plan offloads activations to host memory, but {why} — export the step format and run it with "
                "acstudio.load_step")
    with pytest.raises(ExportError) as refused:
        export(profile, plan, tmp_path / "sac", formats=["sac"])
    assert str(refused.value) == f"cannot export the sac format: {expected}"
    with pytest.raises(ACStudioError) as refused:
        apply_plan(copy.deepcopy(w.model), (profile, plan))
    assert str(refused.value) == f"apply_plan cannot run this plan: {expected}"
    export(profile, plain, tmp_path / "plain", formats=["sac"])  # a plan without offload is not refused


class OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.sin = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.sin += func is torch.ops.aten.sin.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("policy", "runs"), [(CheckpointPolicy.MUST_SAVE, 1), (CheckpointPolicy.MUST_CPU_OFFLOAD, 2)])
def test_torchs_eager_sac_recomputes_a_must_cpu_offload_op(policy, runs):
    """Why apply_plan does not return MUST_CPU_OFFLOAD: eager SAC caches MUST_SAVE outputs only and replays the op
    of any other policy (a change of torch here changes what offload_unsupported may find)."""
    x = torch.randn(4, requires_grad=True)
    contexts = functools.partial(create_selective_checkpoint_contexts, lambda *args, **kwargs: policy)
    with OpCount() as count:
        checkpoint(lambda t: t.sin().exp(), x, use_reentrant=False, context_fn=contexts).sum().backward()
    assert count.sin == runs


def test_the_capability_check_tries_sac_under_a_hook(monkeypatch):
    real = apply_module.checkpoint

    def bypassing(fn, *args, respect_saved_tensors_hooks=None, **kwargs):  # SAC's cache never reaches the hooks
        return real(fn, *args, respect_saved_tensors_hooks=False, **kwargs)

    def older(fn, *args, **kwargs):
        if "respect_saved_tensors_hooks" in kwargs:
            raise TypeError("checkpoint() got an unexpected keyword argument 'respect_saved_tensors_hooks'")
        return real(fn, *args, **kwargs)

    try:
        for fake in (bypassing, older):
            monkeypatch.setattr(sac, "checkpoint", fake)
            sac.offload_unsupported.cache_clear()
            why = sac.offload_unsupported()
            assert torch.__version__ in why and "MUST_CPU_OFFLOAD" in why and "\n" not in why
    finally:
        monkeypatch.undo()
        sac.offload_unsupported.cache_clear()


@needs_hooks
@pytest.mark.parametrize("model", ["gpt2", "bert"])
def test_offloading_sac_trains_bitwise_like_the_plan_without_offload_and_reuses_its_host_buffers(model,
                                                                                                  monkeypatch):
    w, _ = captured(model)
    profile, plan, plain, _ = offload_plans(model)
    policy = sac.SacPolicy.from_plan(profile, plan.recomputed, plan.offloaded)
    copied, made, runtimes = [], [], []
    to_host, buffer, init = SacOffload.to_host, SacOffload._buffer, SacOffload.__init__

    def noting_init(self, planned_bytes):
        runtimes.append(self)
        init(self, planned_bytes)

    def noting_to_host(self, t):
        copied.append(t.untyped_storage().nbytes())
        return to_host(self, t)

    def noting_buffer(self, nbytes, device):
        if not self.pool.get(nbytes):
            made.append(nbytes)
        return buffer(self, nbytes, device)

    monkeypatch.setattr(SacOffload, "__init__", noting_init)
    monkeypatch.setattr(SacOffload, "to_host", noting_to_host)
    monkeypatch.setattr(SacOffload, "_buffer", noting_buffer)
    reference = train(apply_plan(copy.deepcopy(w.model), (profile, plain)), w)
    with pytest.warns(CpuOffloadWarning):
        ours = train(apply_plan(copy.deepcopy(w.model), (profile, plan)), w)
    for a, b in zip(ours, reference, strict=True):
        assert torch.equal(a, b)
    copies, buffers_made = list(copied), list(made)  # the single-device model's
    rank = per_rank_profile(profile, 2, "ddp")  # one DDP rank: the modules around the blocks are wrapped too
    assert sac.SacPolicy.from_plan(rank, plan.recomputed, plan.offloaded).offloads
    with pytest.warns(CpuOffloadWarning):
        for a, b in zip(train(apply_plan(copy.deepcopy(w.model), (rank, plan)), w), reference, strict=True):
            assert torch.equal(a, b)
    n_ops = sum(d.offload for ops in policy.blocks.values() for d in ops)
    assert len(copies) == 2 * n_ops and sum(copies) <= 2 * policy.offload_bytes  # each offloaded op, each step
    assert len(buffers_made) == n_ops  # the first step fills the pool, the second reuses it
    assert sum(len(b) for b in runtimes[0].pool.values()) == n_ops and not runtimes[0].pending


HOST_BUFFERS: set[int] = set()  # data pointers of the offload's host buffers


class DeviceStorages(LiveStorages):
    """Live op-made storages less the offload's host buffers (on a CPU device both are in the same memory)."""

    def live(self):
        return sum(n for r, n in self.refs.values() if r() is not None and r().data_ptr() not in HOST_BUFFERS)


@needs_hooks
@pytest.mark.parametrize("model", ["gpt2", "bert"])
def test_sac_mode_predicts_what_offloading_takes_off_the_device_at_backward(model, monkeypatch):
    """The offload schedule's saving at the first backward node equals the bytes the offloading model holds less
    than the same plan without offload when backward starts."""
    w, _ = captured(model)
    profile, plan, plain, _ = offload_plans(model)
    buffer = SacOffload._buffer
    HOST_BUFFERS.clear()  # an earlier test's buffers are gone; a device tensor may now sit at one's address

    def noting_buffer(self, nbytes, device):
        made = buffer(self, nbytes, device)
        HOST_BUFFERS.add(made.data.untyped_storage().data_ptr())
        return made

    monkeypatch.setattr(SacOffload, "_buffer", noting_buffer)
    monkeypatch.setattr(test_sac, "LiveStorages", DeviceStorages)
    held = held_at_backward(apply_plan(copy.deepcopy(w.model), (profile, plain)), w)
    with pytest.warns(CpuOffloadWarning):
        held_offloading = held_at_backward(apply_plan(copy.deepcopy(w.model), (profile, plan)), w)
    sim = Simulator(profile)
    schedule = SAC_MODE.schedule(sim, sim.indices(plan.recomputed))
    offload = SAC_MODE.offload(sim, schedule, sim.indices(plan.offloaded))
    first_bw = next(i for i, nd in enumerate(profile.nodes) if nd.region == "backward")
    _, between = offload.memory(sim)
    assert held - held_offloading == -between[first_bw] > 0


@needs_hooks
def test_offloaded_outputs_are_off_the_device_when_backward_starts(monkeypatch):
    """What SAC's cache holds for an offloaded op is the host copy: the device storage is gone once forward
    ends."""
    w, _ = captured("gpt2")
    profile, plan, _, _ = offload_plans("gpt2")
    noted: list[weakref.ref] = []
    offload = apply_module.BlockPolicy.offload

    def noting(self, output):
        noted.extend(weakref.ref(t.untyped_storage()) for t in torch.utils._pytree.tree_flatten(output)[0])
        offload(self, output)

    monkeypatch.setattr(apply_module.BlockPolicy, "offload", noting)
    model = apply_plan(copy.deepcopy(w.model), (profile, plan))
    with pytest.warns(CpuOffloadWarning):
        loss = w.loss_fn(model, w.batch)
    gc.collect()
    assert noted and all(r() is None for r in noted)
    loss.backward()


@needs_hooks  # a torch whose SAC cannot offload refuses the plan in apply_plan (test_offload.py)
def test_compiled_blocks_say_they_keep_offloaded_outputs_on_the_device():
    """Under torch.compile the hooks do not run: the offloaded ops are saved on the device, with a warning, and
    training is as without offload (CPU dropout traces differently from eager, so the decoder has none)."""
    w, profile = dropout_free_gpt2()
    ctx = PlanContext(profile)
    rc = [int(k) for k in ctx.rg.candidates[1::3]]
    off = np.flatnonzero(sac_blocks(ctx.sim).offloadable(rc)).tolist()
    plan = ctx.plan_for_set("mutwo", profile.peak_bytes, rc, offloaded=off)
    assert sac.SacPolicy.from_plan(profile, plan.recomputed, plan.offloaded).offloads
    reference = train(copy.deepcopy(w.model), w)
    torch._dynamo.reset()
    model = torch.compile(apply_plan(copy.deepcopy(w.model), (profile, plan)), backend="aot_eager")
    with pytest.warns(CompiledOffloadWarning, match="run the model eager for the offload"):
        ours = train(model, w)
    for a, b in zip(ours, reference, strict=True):
        assert torch.equal(a, b)
