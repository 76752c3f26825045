"""Plan -> selective activation checkpointing: the wrapped model trains like eager and holds what the SAC
replay mode predicts."""

import copy
import dataclasses
import functools
import weakref

import numpy as np
import pytest
import torch
from conftest import tiny_spec
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import CheckpointPolicy

from acstudio.capture import capture_step
from acstudio.errors import ACStudioError
from acstudio.export.apply import BlockPolicy, ModelMismatchError, apply_plan
from acstudio.export.sac import OpDecision
from acstudio.plan import plan as make_plan
from acstudio.plan.model import Plan
from acstudio.plan.schedule import PlanContext
from acstudio.plan.solvers.registry import auto_solvers
from acstudio.profile import blocks as module_blocks
from acstudio.profile.model import Profile
from acstudio.simulate.modes import simulate_plan
from acstudio.simulate.sac import RECOMPUTE, SAVE, SacBlocks, cache_memory, sac_blocks, simulate_sac
from acstudio.simulate.sharding import per_rank_profile
from acstudio.simulate.simulator import Simulator
from acstudio.workload import build_workload
from acstudio.workload.spec import make_optimizer

MODELS = ("resnet18", "bert", "gpt2")


@functools.cache
def captured(model):
    """(workload, profile): a CNN with BatchNorm, an encoder with dropout, a decoder with tied weights."""
    from test_rewrite import quick_profile

    kw = {"batch_size": 4, "image_size": 32} if model == "resnet18" else {}
    spec = tiny_spec(model, optimizer="adam", **kw)
    w = build_workload(spec)
    step = capture_step(w.model, w.make_optimizer(), w.batch, w.loss_fn)
    return w, quick_profile(spec, step)


@functools.cache
def plans(model):
    """Plans (with dummy predictions) from two fixed baselines and μ-TWO at 80% of the peak."""
    _, profile = captured(model)
    sim = Simulator(profile)
    sets = {name: make_plan(profile, profile.peak_bytes, name, simulator=sim).recomputed
            for name in ("recompute-all", "per-module")}
    sets["mutwo@0.8"] = make_plan(profile, int(profile.peak_bytes * 0.8), "mutwo", simulator=sim).recomputed
    return {name: Plan(profile.fingerprint, name, 0, rc, [], 0, "", 0.0, True, "", 0, 0) for name, rc in sets.items()}


def dropout_free_gpt2(*config: tuple[str, str]):
    """(workload, profile) of a tiny GPT-2 without dropout, for torch.compile on a CPU (where CPU dropout runs as
    bernoulli_ in eager but traces as native_dropout), with ``config`` on top."""
    from test_rewrite import quick_profile

    spec = tiny_spec("gpt2", optimizer="adam")
    spec = dataclasses.replace(spec, config=(*spec.config, ("resid_pdrop", "0"), ("embd_pdrop", "0"),
                                             ("attn_pdrop", "0"), *config))
    w = build_workload(spec)
    return w, quick_profile(spec, capture_step(w.model, w.make_optimizer(), w.batch, w.loss_fn))


def train(model, w, steps=2, seed=0):
    """Two Adam steps; returns losses, gradients, parameters and buffers."""
    opt = make_optimizer(w.spec.optimizer, model.parameters())
    torch.manual_seed(seed)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        loss = w.loss_fn(model, w.batch)
        loss.backward()
        out += [loss.detach(), *(p.grad.clone() for p in model.parameters())]
        opt.step()
    return [*out, *model.parameters(), *model.buffers()]


@pytest.mark.parametrize("model", MODELS)
def test_sac_wrapped_models_train_bitwise_like_eager(model):
    """On one device, and as one DDP rank, whose SAC form also wraps the modules around the blocks (the ResNet's
    stem, BERT's embeddings and MLM head, GPT-2's embedding dropout, final LayerNorm and tied LM head)."""
    w, profile = captured(model)
    reference = train(copy.deepcopy(w.model), w)
    wrapped_any = False
    for form in (profile, per_rank_profile(profile, 2, "ddp")):
        for name, plan in plans(model).items():
            m = apply_plan(copy.deepcopy(w.model), (form, plan))
            wrapped_any |= any(hasattr(mod, "_acstudio_sac_inner_forward") for mod in m.modules())
            for a, b in zip(train(m, w), reference, strict=True):
                assert torch.equal(a, b), f"{model} {name}"
    assert wrapped_any


class LiveStorages(TorchDispatchMode):
    """Bytes of the storages created by ops (not parameters, buffers or inputs) that are still alive."""

    def __init__(self):
        super().__init__()
        self.refs = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                known = self.refs.get(id(s))
                if known is None or known[0]() is not s:  # ids of dead storages are reused
                    self.refs[id(s)] = (weakref.ref(s), s.nbytes())
        return out

    def live(self):
        return sum(n for r, n in self.refs.values() if r() is not None)


def held_at_backward(model, w):
    """Bytes of op outputs alive when backward starts (what autograd and SAC hold for it, plus the loss)."""
    torch.manual_seed(0)
    with LiveStorages() as mode:
        loss = w.loss_fn(model, w.batch)
    held = mode.live()
    loss.backward()
    return held


@pytest.mark.parametrize("model", MODELS)
def test_sac_mode_predicts_what_the_wrapped_model_holds(model):
    """The SAC replay mode's activation bytes at the start of backward equal what the wrapped model holds, on one
    device and as one DDP rank (whose form also wraps the modules around the blocks)."""
    w, profile = captured(model)
    first_bw = next(i for i, nd in enumerate(profile.nodes) if nd.region == "backward")
    base = held_at_backward(copy.deepcopy(w.model), w)
    for form in (profile, per_rank_profile(profile, 2, "ddp")):
        sim = Simulator(form)
        blocks = sac_blocks(sim)
        _, baseline = sim.activation_memory(*_arrays(sim, []))
        seen = set()
        for name, plan in plans(model).items():
            held = held_at_backward(apply_plan(copy.deepcopy(w.model), (form, plan)), w)
            schedule = blocks.schedule(sim.indices(plan.recomputed))
            _, between = sim.activation_memory(schedule.back >= 0, schedule.keep_until, schedule.back,
                                               rng_states=False)
            saved = int(baseline[first_bw] - between[first_bw] - cache_memory(sim, schedule)[1][first_bw])
            assert base - held == saved, f"{model} {name}"
            seen.add(saved)
        assert len(seen) > 1 and max(seen) > 0, "the plans should free different amounts"


def _arrays(sim, ks):
    import numpy as np

    mask = np.zeros(len(sim.replay.bytes), dtype=bool)
    mask[ks] = True
    return mask, np.full(len(mask), -1, dtype=np.int64)


def test_policy_follows_the_plan_op_by_op():
    """Every op the wrapped model runs in a block gets the decision the SAC form recorded for it, and the
    activations the plan frees are exactly those of recomputed ops."""
    _, profile = captured("gpt2")
    by_id = profile.node_by_id
    decided = []
    for name in ("recompute-all", "mutwo@0.8"):
        recomputed = plans("gpt2")[name].recomputed
        form = simulate_sac(profile, recomputed)
        decided += [how for ops in form.decisions.values() for _, how in ops]
        freed = set(form.freed)
        assert freed <= set(recomputed)
        for ops in form.decisions.values():
            for node_id, how in ops:
                writes = {t.id for t in profile.tensors if t.created_at == node_id} & set(profile.activation_by_id)
                if writes & freed:
                    assert how == RECOMPUTE, by_id[node_id].target
        assert form.result.peak_bytes < profile.peak_bytes
    assert SAVE in decided and RECOMPUTE in decided


def test_floating_ops_may_come_elsewhere_or_not_at_all():
    """An alias, a lifted constant, a clone or a zero fill is matched where recorded, skipped where it does not
    come, and recomputed where it comes unrecorded (tracers place them differently: compiled BatchNorm on CUDA
    allocates its reserve with new_zeros); any other op out of order is refused."""
    ops = [OpDecision("aten.mm.default", "b", True), OpDecision("aten.alias.default", "b", False),
           OpDecision("aten.relu.default", "b", False)]
    forward = type("Ctx", (), {"is_recompute": False})()

    def run(*names):
        policy = BlockPolicy("b", ops)
        decided = [policy(forward, name) for name in names]
        policy.check(None)
        return decided

    MUST_SAVE, MUST_RECOMPUTE = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.MUST_RECOMPUTE
    assert run("aten.mm.default", "aten.alias.default", "aten.relu.default") == [MUST_SAVE, MUST_RECOMPUTE,
                                                                                 MUST_RECOMPUTE]
    assert run("aten.mm.default", "aten.relu.default") == [MUST_SAVE, MUST_RECOMPUTE]
    assert run("aten.lift_fresh.default", "aten.mm.default", "aten.clone.default", "aten.relu.default") == [
        MUST_RECOMPUTE, MUST_SAVE, MUST_RECOMPUTE, MUST_RECOMPUTE]
    assert run("aten.mm.default", "aten.new_zeros.default", "aten.relu.default") == [MUST_SAVE, MUST_RECOMPUTE,
                                                                                     MUST_RECOMPUTE]
    with pytest.raises(ModelMismatchError, match=r"op #0 ran aten\.relu\.default where the profiled model ran "
                                                 r"aten\.mm\.default"):
        run("aten.relu.default")


@pytest.mark.parametrize("model", ["gpt2", "llama", "bert"])
def test_a_block_that_saves_nothing_runs_a_plain_checkpoint_after_its_first_call(model, monkeypatch):
    """SAC's dispatch mode (the policy, called for every op) runs in a recompute-all block's first call only,
    which checks the model; later calls are plain checkpoints, and training stays bitwise like eager. A decoder
    layer's views of the rotary cos/sin it is given are recomputed, not saved, and so is an encoder layer's closing
    LayerNorm (its output passes through to the next layer), so their blocks qualify too."""
    w, profile = captured(model)
    plan = plans(model)["recompute-all"]
    decisions = simulate_sac(profile, plan.recomputed).decisions
    assert decisions and all(how == RECOMPUTE for ops in decisions.values() for i, how in ops
                             if profile.node_by_id[i].target not in ("aten.alias.default", "aten.clone.default"))
    calls = []
    original = BlockPolicy.__call__
    monkeypatch.setattr(BlockPolicy, "__call__",
                        lambda self, *a, **k: calls.append(self.block) or original(self, *a, **k))

    def step(model):
        w.loss_fn(model, w.batch).backward()
        return len(calls)

    in_first_step = step(apply_plan(copy.deepcopy(w.model), (profile, plan)))
    assert set(calls) == set(decisions)
    calls.clear()
    model = apply_plan(copy.deepcopy(w.model), (profile, plan))
    for a, b in zip(train(model, w), train(copy.deepcopy(w.model), w), strict=True):
        assert torch.equal(a, b)
    assert len(calls) == in_first_step and step(model) == in_first_step


def test_blocks_that_save_only_batchnorm_counters_run_plain_checkpoints():
    """ResNet-152 as profiled on the H200: at recompute-all every bottleneck saves only its BatchNorm counter
    updates (``update`` in the policy). Such a block runs its first call under the policy and later ones as plain
    checkpoints that put the buffers back, so a CPU ResNet-152 trains bitwise like eager, counters included."""
    from acstudio.export.sac import SacPolicy
    from acstudio.plan.baselines import recompute_all

    profile = Profile.load("sample_profiles/h200_resnet152_bs64_adam.json.gz")
    ctx = PlanContext(profile)
    plan = ctx.plan_for_set("recompute-all", 0, recompute_all(ctx), mode="sac")
    policy = SacPolicy.from_plan(profile, plan.recomputed)
    assert len(policy.blocks) == 50
    assert all(d.updates_state for ops in policy.blocks.values() for d in ops if d.save
               and d.op != "aten.alias.default")
    assert SacPolicy.from_dict(policy.to_dict()) == policy  # "update" survives the file
    w = build_workload(tiny_spec("resnet152", optimizer="adam", batch_size=2, image_size=32))
    calls = []
    original = BlockPolicy.__call__
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(BlockPolicy, "__call__", lambda self, *a, **k: calls.append(self.block) or original(self, *a, **k))
        wrapped = apply_plan(copy.deepcopy(w.model), (profile, plan))
        w.loss_fn(wrapped, w.batch).backward()
        assert set(calls) == set(policy.blocks)
        calls.clear()
        wrapped = apply_plan(copy.deepcopy(w.model), (profile, plan))
        for a, b in zip(train(wrapped, w), train(copy.deepcopy(w.model), w), strict=True):
            assert torch.equal(a, b)
        first_step = len(calls)
        w.loss_fn(wrapped, w.batch).backward()
        assert len(calls) == first_step  # no policy after the first call


def test_one_rank_wraps_the_modules_around_the_blocks_that_run_once():
    """One device's SAC form wraps the repeated blocks. One rank under FSDP2/DDP runs the modules around them eager,
    so there SAC also wraps each outermost module that holds no layer; never the root, the module holding the layers,
    the capture's pseudo modules, or a module called twice (its ops run in two stretches)."""
    decoder = ["model.embed_tokens", "model", "model.layers.0.attn", "model.layers.0", "model.layers.1.mlp",
               "model.norm", "lm_head", "", "(loss)"]
    layers = {"model.layers.0.attn": "model.layers.0", "model.layers.0": "model.layers.0",
              "model.layers.1.mlp": "model.layers.1"}
    assert module_blocks.sac_blocks(decoder, around=False) == layers
    assert module_blocks.sac_blocks(decoder, around=True) == {
        **layers, "model.embed_tokens": "model.embed_tokens", "model.norm": "model.norm", "lm_head": "lm_head"}
    mlm_head = ["enc.layer.0", "enc.layer.1", "cls.transform.dense", "cls.transform.act", "cls.decoder"]
    assert {module_blocks.sac_blocks(mlm_head, around=True)[m] for m in mlm_head[2:]} == {"cls"}  # the whole head
    called_twice = ["norm", "layers.0", "layers.1", "norm", "head"]
    assert module_blocks.sac_blocks(called_twice, around=True) == {"layers.0": "layers.0", "layers.1": "layers.1",
                                                                    "head": "head"}
    _, profile = captured("bert")
    everything = plans("bert")["recompute-all"].recomputed
    assert "cls" not in simulate_sac(profile, everything).decisions
    assert {"cls", "bert.embeddings"} <= simulate_sac(per_rank_profile(profile, 2, "ddp"), everything).decisions.keys()


def test_a_model_that_differs_is_refused_naming_the_op():
    w, profile = captured("gpt2")
    plan = plans("gpt2")["recompute-all"]
    other = copy.deepcopy(w.model)
    other.transformer.h[0].mlp.act = torch.nn.ReLU()
    apply_plan(other, (profile, plan))
    with pytest.raises(ModelMismatchError, match=r"block transformer\.h\.0's op #\d+ ran aten\.relu\.default where "
                                                 r"the profiled model ran aten\.\w+\.\w+ \(in transformer\.h\.0\.mlp"):
        w.loss_fn(other, w.batch)
    with pytest.raises(ACStudioError, match=r"no sac_policy\.json"):
        apply_plan(copy.deepcopy(w.model), "/nonexistent")


def test_sac_wrapped_model_compiles_unchanged_and_trains_like_eager():
    """torch.compile (AOTAutograd, CPU) traces the blocks with the SAC policy's tags, and training is bitwise like
    eager. (CPU dropout runs as bernoulli_ in eager but traces as native_dropout, so the decoder here has no
    dropout; CUDA eager already runs native_dropout.)"""
    w, profile = dropout_free_gpt2()
    plan = make_plan(profile, profile.peak_bytes, "recompute-all")
    wrapped = apply_plan(copy.deepcopy(w.model), (profile, plan))
    reference = train(copy.deepcopy(w.model), w)
    torch._dynamo.reset()
    for a, b in zip(train(torch.compile(wrapped, backend="aot_eager"), w), reference, strict=True):
        assert torch.equal(a, b)


def test_blocks_compiled_one_by_one_each_trace_their_own_policy(monkeypatch):
    """Compiled block by block (``block.compile()``, as FSDP2/DDP runs compile), every wrapped block gets a graph
    of its own, traced with its own policy, also past Dynamo's default recompile limit of 8 (this decoder has 10
    blocks, each freeing another share of its activations), and training is bitwise like eager; so does a second
    model the plan is applied to in the same process, whose blocks add their entries to the same code's cache.
    Dynamo does not guard on checkpoint's ``context_fn``: unguarded, later blocks reused the first block's graph,
    and past the limit they ran eager (a probe's second and third models did, 2026-11-29)."""
    from acstudio.bench.steps import find_blocks
    from acstudio.export import apply as apply_module

    w, profile = dropout_free_gpt2(("n_layer", "10"))
    ctx = PlanContext(profile)
    blocks = sac_blocks(ctx.sim)
    block_of = [blocks.block[ctx.rg.created[k]] for k in range(len(ctx.rg.bytes))]
    rc = [int(k) for k in ctx.rg.candidates
          if block_of[k] in blocks.blocks and int(k) % 3 == blocks.blocks.index(block_of[k]) % 3]
    plan = ctx.plan_for_set("mutwo", profile.peak_bytes, rc)
    reference = train(copy.deepcopy(w.model), w)
    torch._dynamo.reset()
    traced, graphs = [], []
    contexts = apply_module._contexts
    monkeypatch.setattr(apply_module, "_contexts", lambda block, *a: (traced.append(block), contexts(block, *a))[1])

    def counting(graph, example_inputs):
        graphs.append(graph)
        return torch._dynamo.backends.debugging.aot_eager(graph, example_inputs)

    with torch._dynamo.config.patch(recompile_limit=8):  # the default, whatever earlier tests raised it to
        for models in (1, 2):
            model = apply_plan(copy.deepcopy(w.model), (profile, plan))
            wrapped = [name for name, m in model.named_modules() if hasattr(m, "_acstudio_sac_inner_forward")]
            assert len(wrapped) == 10
            for block in find_blocks(dataclasses.replace(w, model=model)):
                block.compile(backend=counting)
            for a, b in zip(train(model, w), reference, strict=True):
                assert torch.equal(a, b)
            assert len(graphs) == 10 * models and sorted(set(traced)) == sorted(wrapped)


def test_batch_norm_is_recomputed_and_its_running_statistics_updated_once():
    """Recompute-all on a CNN recomputes BatchNorm (the replay puts the block's buffers back), eager and under
    torch.compile, where BatchNorm is traced under another overload name; both train bitwise like eager,
    running statistics included."""
    w, profile = captured("resnet18")
    plan = plans("resnet18")["recompute-all"]
    form = simulate_sac(profile, plan.recomputed)
    by_id = profile.node_by_id
    bn = [how for ops in form.decisions.values() for i, how in ops if "batch_norm" in by_id[i].target]
    assert bn and bn.count(RECOMPUTE) > bn.count(SAVE)  # saved only where the block's output is the caller's
    reference = train(copy.deepcopy(w.model), w)
    torch._dynamo.reset()
    compiled = torch.compile(apply_plan(copy.deepcopy(w.model), (profile, plan)), backend="aot_eager")
    for a, b in zip(train(compiled, w), reference, strict=True):
        assert torch.equal(a, b)


def test_a_neighbours_read_of_a_blocks_output_does_not_replay_the_block():
    """The checkpoint replays a block when one of its own saved tensors is unpacked. In a ResNet the next block's
    downsample convolution reads this block's output in backward first (the next checkpoint holds it as its
    argument): the SAC mode's replay waits for the block's own unpack, an alias of a saved output or a value that
    stays inside the block."""
    _, profile = captured("resnet18")
    blocks = sac_blocks(Simulator(profile))
    nodes, inputs = profile.nodes, blocks.inputs

    def own_unpack(u):
        writes = blocks.writes.get(u, [])
        return not writes or not blocks.leaves[writes].all() or nodes[u].target == "aten.alias.default"

    early = 0
    for b, at in blocks.replay_at.items():
        assert any(blocks.block[u] == b and own_unpack(u) for u in inputs[at]), b
        early += any(blocks.block[u] == b and not own_unpack(u)
                     for j in range(at) if nodes[j].region == "backward" for u in inputs[j])
    assert early  # some block's output is read by its neighbour before the block's own replay


@pytest.mark.parametrize("model", ["bert", "gpt2"])
def test_a_blocks_random_ops_are_all_saved_or_all_recomputed(model):
    """The checkpoint replays from the generator state its block started with: one saved draw would shift the
    others, so a block's draws share one decision, whatever the plan."""
    _, profile = captured(model)
    blocks = sac_blocks(Simulator(profile))
    assert any(blocks.random_ops.values())
    for plan in plans(model).values():
        decision, _ = blocks.decide(blocks.sim.indices(plan.recomputed))
        for ops in blocks.random_ops.values():
            assert len({decision[i] for i in ops}) <= 1


def test_planning_for_sac_fits_where_repricing_overshoots():
    """``plan(..., mode="sac")`` fits in SAC's replay mode whenever a known solver's set does, is never slower
    than auto's plan re-priced in SAC, and predicts what the SAC mode simulates."""
    _, profile = captured("bert")
    ctx = PlanContext(profile)
    overshoots = 0
    for fraction in (0.8, 0.86, 0.9, 0.95, 1.0):
        budget = int(ctx.sim.baseline_peak * fraction)
        target = make_plan(profile, budget, ctx=ctx, mode="sac")
        assert target.replay_mode == "sac" and target.solver == "auto"
        sim = simulate_plan(ctx.sim, target.recomputed, "sac")
        assert (sim.peak_bytes, sim.extra_ms) == (target.predicted_peak_bytes,
                                                  pytest.approx(target.predicted_extra_ms))
        auto = make_plan(profile, budget, ctx=ctx)
        others = [(n, make_plan(profile, budget, n, ctx=ctx)) for n in auto_solvers(policies=True)]
        for name, chosen in [("auto", auto), *others]:
            repriced = ctx.plan_for_set(name, budget, ctx.sim.indices(chosen.recomputed), mode="sac")
            if repriced.feasible:
                assert target.feasible and target.predicted_extra_ms <= repriced.predicted_extra_ms + 1e-9, name
            elif not target.feasible:
                assert target.predicted_peak_bytes <= repriced.predicted_peak_bytes, name
            overshoots += name == "auto" and not repriced.feasible and target.feasible
    assert overshoots, "some budget should need a lower target than auto's plan"
    one = make_plan(profile, int(ctx.sim.baseline_peak * 0.9), "blocks", ctx=ctx, mode="sac")
    assert one.solver == "blocks" and one.replay_mode == "sac"


def test_the_sac_form_memoized_per_block_equals_a_fresh_one():
    """A planner's trials reuse each block's form; whatever sets came before, a set's schedule is a fresh one's."""
    sim = Simulator(Profile.load("sample_profiles/h200_llama_bs8_bf16_adamw.json.gz"))
    rng = np.random.default_rng(0)
    candidates = sim.replay.candidates
    sets = [sorted(rng.choice(candidates, size=len(candidates) // 2, replace=False).tolist()) for _ in range(4)]
    warm = SacBlocks(sim)
    for ks in sets:
        warm.schedule(ks)
    for ks in sets:
        fresh = SacBlocks(sim)
        a, b = warm.schedule(ks), fresh.schedule(ks)
        assert warm.decide(ks)[0] == fresh.decide(ks)[0]
        assert np.array_equal(warm.decide(ks)[1], fresh.decide(ks)[1])
        assert [(r.at, r.outputs, r.sources, r.nodes.tolist(), r.time_ms, r.transient) for r in a.replays] == \
               [(r.at, r.outputs, r.sources, r.nodes.tolist(), r.time_ms, r.transient) for r in b.replays]
        assert np.array_equal(a.back, b.back) and np.array_equal(a.keep_until, b.keep_until)
        assert sorted(map(tuple, a.cached.tolist())) == sorted(map(tuple, b.cached.tolist()))


def test_filling_never_turns_an_eager_plain_checkpoint_into_sac_dispatch():
    """Eager, keeping one activation back in a block that recomputes everything else would run SAC's per-op dispatch
    for the whole block: the fill leaves such blocks alone. Compiled, the policy only runs while tracing, so the
    same memory buys kept activations."""
    from acstudio.plan.baselines import recompute_all
    from acstudio.plan.solvers import fill_budget

    ctx = PlanContext(Profile.load("sample_profiles/h200_llama_bs8_bf16_adamw.json.gz"))
    everything = recompute_all(ctx)
    assert not sac_blocks(ctx.sim).runs_policy(everything)
    for mode, keeps in (("sac", False), ("sac-compiled", True)):
        start = ctx.plan_for_set("recompute-all", 0, everything, mode=mode)
        budget = start.predicted_peak_bytes + 200 * 2**20
        filled, kept = fill_budget(ctx, dataclasses.replace(start, budget_bytes=budget), budget, mode)
        assert (kept > 0) == keeps
        assert filled.predicted_peak_bytes <= budget


def test_eager_sac_prices_the_dispatch_of_blocks_that_run_the_policy():
    """A block that saves an op runs SAC's dispatch mode in eager: one policy call per forward op and per replayed op,
    each SAC_DISPATCH_MS of host time. Plain checkpoints and compiled steps pay none."""
    from acstudio.plan.baselines import per_module, per_op
    from acstudio.simulate.modes import get_mode
    from acstudio.simulate.sac import SAC_DISPATCH_MS, is_op

    ctx = PlanContext(Profile.load("sample_profiles/h200_llama_bs8_bf16_adamw.json.gz"))
    blocks, nodes = sac_blocks(ctx.sim), ctx.profile.nodes
    plain, titan = per_module(ctx), per_op(ctx)
    assert blocks.dispatch_ms(plain) == 0
    layers = blocks.runs_policy(titan)
    assert len(layers) == 8
    asked = blocks._asked(titan)
    calls = sum(sum(is_op(nodes[i]) for i in blocks.fw_nodes[b]) + len(blocks._block(b, asked[b]).replay.nodes)
                for b in layers)
    assert blocks.dispatch_ms(titan) == pytest.approx(calls * SAC_DISPATCH_MS) and calls > 8 * 100
    eager, compiled = get_mode("sac").schedule(ctx.sim, titan), get_mode("sac-compiled").schedule(ctx.sim, titan)
    assert eager.extra_ms == pytest.approx(sum(r.time_ms for r in eager.replays) + blocks.dispatch_ms(titan))
    assert compiled.dispatch_ms == 0
