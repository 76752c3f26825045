"""Random ops are recomputed with the generator state their forward drew with: the rewritten step stays bitwise
identical to the captured one, the generator is left as the captured step leaves it, the simulator prices the
saved states exactly, and ``keep_random`` restores the rule that random ops are never recomputed."""

import copy
import dataclasses

import pytest
import torch
from conftest import TINY_BERT, tiny_spec
from test_capture import eager_step
from test_rewrite import captured, check_accounting, fused_dropout_step, quick_profile, run_from

import acstudio
from acstudio.capture import capture_step
from acstudio.export import export
from acstudio.plan import plan as make_plan
from acstudio.profile.ops import draws_random
from acstudio.profile.replay_rules import RANDOM_OP_NAMES, RANDOM_REASON, replay_rules
from acstudio.rewrite import RewriteError, rewrite, rewrite_step
from acstudio.rewrite.verify import verify
from acstudio.simulate.modes import simulate_plan
from acstudio.simulate.simulator import Simulator
from acstudio.workload import build_workload


def random_outputs(sim: Simulator, recomputed) -> list[str]:
    """The recomputed activations whose own replay runs a random op."""
    rg = sim.replay
    return [a for a in recomputed if rg.rng_owned[rg.act_index[a]].size]


def replayed_draws(step) -> list[torch.fx.Node]:
    return [n for n in step.gm.graph.nodes if n.meta.get("ac_role") == "recompute"
            and isinstance(n.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in n.target.tags]


def run_then_draw(step, w, opt, spec):
    """One iteration's results, then what the generator draws next (a replay must leave it where it was)."""
    out = run_from(step, w.model, opt, spec.optimizer, w.batch)
    return [*out, torch.rand(8)]


@pytest.mark.parametrize("mode", ["again", "shared"])
@pytest.mark.parametrize("model", ["bert", "gpt2"])
def test_recomputed_dropout_is_bitwise_and_priced(model, mode):
    """Encoder and decoder with dropout on every path: at several budgets the plan recomputes dropout outputs
    (masks drawn by ``bernoulli_``), and the rewritten step in either replay mode matches the captured one bit
    for bit (loss, gradients, parameters, optimizer state, and the generator afterwards)."""
    spec, w, opt, step, profile = captured(model)
    sim = Simulator(profile)
    expected = run_then_draw(step, w, opt, spec)
    for fraction in (0.2, 0.0):
        budget = int(sim.floor_bytes + fraction * (sim.baseline_peak - sim.floor_bytes))
        plan = make_plan(profile, budget, simulator=sim)
        assert plan.feasible and not plan.keep_random
        assert random_outputs(sim, plan.recomputed), f"no dropout output recomputed at {fraction}"
        new = rewrite_step(step, profile, plan.recomputed, replay_mode=mode)
        assert replayed_draws(new), "dropout is replayed, not kept"
        got = run_then_draw(new, w, opt, spec)
        assert len(got) == len(expected)
        for a, b in zip(got, expected):
            assert torch.equal(a, b)
        predicted = simulate_plan(sim, plan.recomputed, mode).peak_bytes
        check_accounting(new.gm, profile, predicted, sim.replay)


def test_saved_states_live_from_forward_to_the_last_replay():
    _, _, _, step, profile = captured("bert")
    sim = Simulator(profile)
    masks = random_outputs(sim, [sim.replay.act_ids[k] for k in sim.replay.candidates])
    new = rewrite_step(step, profile, masks)
    saved = [n for n in new.gm.graph.nodes if n.meta.get("ac_sizes")]
    assert len(saved) == len(masks) == sim.replay.rng_nodes.size
    assert all(n.meta["ac_region"] == "forward" and list(n.meta["ac_sizes"].values()) == [5056] for n in saved)
    with_states = sim.simulate(masks).peak_bytes
    # the same recomputations without the saved states' price would predict less
    priced = Simulator(profile)
    priced.replay.rng_state_bytes = 0
    assert with_states > priced.simulate(masks).peak_bytes


def test_native_dropout_is_replayed_with_its_generator_state():
    """CUDA's fused dropout: by default its output and mask are both recomputed by drawing again from the saved
    state; with ``keep_random`` the mask is kept (see test_rewrite)."""
    model, opt, batch, step, profile = fused_dropout_step()
    rules = replay_rules(profile)
    chosen = [a.id for a in profile.activations if not rules.activation[a.id]]
    masks = [a for a in chosen if a != profile.activation_by_id[a].created_at
             and profile.node_by_id[profile.activation_by_id[a].created_at].target == "aten.native_dropout.default"]
    assert len(masks) == 2
    new = rewrite_step(step, profile, chosen)
    assert sum(n.target is torch.ops.aten.native_dropout.default for n in replayed_draws(new)) >= 2
    for a, b in zip(run_from(new, model, opt, "adam", batch), run_from(step, model, opt, "adam", batch)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("model", ["bert", "gpt2"])
def test_keep_random_never_recomputes_random_ops(model):
    _, _, _, step, profile = captured(model)
    sim, kept = Simulator(profile), Simulator(profile, keep_random=True)
    drawn = random_outputs(sim, [sim.replay.act_ids[k] for k in sim.replay.candidates])
    assert drawn
    for a in drawn:
        k = kept.replay.act_index[a]
        assert not kept.replay.is_candidate[k] and "random op" in kept.replay.reason[k]
    assert kept.replay.rng_nodes.size == 0
    plan = make_plan(profile, kept.floor_bytes, simulator=kept)
    assert plan.keep_random and plan.recomputed and not set(plan.recomputed) & set(drawn)
    new = rewrite(step, profile, plan)  # the plan's rule travels to the rewriter
    assert not replayed_draws(new)
    with pytest.raises(RewriteError, match="random op"):
        rewrite(step, profile, dataclasses.replace(plan, recomputed=[drawn[0]]))


def test_ops_that_draw_nothing_are_not_random():
    x = torch.ones(2)
    dropout, sdpa = torch.ops.aten.native_dropout.default, torch.ops.aten.scaled_dot_product_attention.default
    assert draws_random(dropout, (x, 0.1, True), {})
    assert not draws_random(dropout, (x, 0.0, True), {})
    assert not draws_random(dropout, (x, 0.1, False), {})
    assert not draws_random(sdpa, (x, x, x), {})  # dropout_p defaults to 0
    assert draws_random(sdpa, (x, x, x), {"dropout_p": 0.1})
    assert not draws_random(torch.ops.aten.mm.default, (x, x), {})
    assert draws_random(torch.ops.aten.bernoulli_.float, (x, 0.5), {})


def test_every_random_op_of_this_torch_is_named_in_the_torch_free_list():
    """Replay rules judge only ops named in RANDOM_OP_NAMES (so planning needs no torch): none may be missing."""
    tagged = set()
    for full_name in torch._C._dispatch_get_all_op_names():  # every registered op, "aten::name.overload"
        namespace, _, name = full_name.partition("::")
        packet, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, packet), overload or "default", None) if namespace == "aten" else None
        if op is not None and torch.Tag.nondeterministic_seeded in op.tags:
            tagged.add(packet)
    assert {"native_dropout", "scaled_dot_product_attention", "bernoulli_"} <= tagged
    assert tagged <= RANDOM_OP_NAMES, sorted(tagged - RANDOM_OP_NAMES)


def test_attention_without_dropout_is_an_ordinary_candidate():
    """SDPA is tagged ``nondeterministic_seeded`` even at ``dropout_p == 0``: it must still be recomputable, under
    either rule, also in a profile recorded when every tagged op was kept (judged again from the stored graph)."""
    config = (*TINY_BERT, "hidden_dropout_prob=0", "attention_probs_dropout_prob=0")
    spec = tiny_spec("bert", config=tuple(tuple(c.split("=", 1)) for c in config))
    w = build_workload(spec)
    opt = w.make_optimizer()
    step = capture_step(w.model, opt, w.batch, w.loss_fn)
    profile = quick_profile(spec, step)
    attention = [n for n in profile.nodes if "scaled_dot_product" in n.target and n.region == "forward"]
    assert attention and all(n.replay == "ok" for n in attention)
    outputs = [a.id for a in profile.activations if a.created_at in {n.id for n in attention}]
    assert outputs
    old = copy.deepcopy(profile)  # as a file that never replayed random ops records it
    for n in old.nodes:
        if "scaled_dot_product" in n.target:
            n.replay = RANDOM_REASON
    for a in old.activations:
        if a.id in outputs:
            a.recomputable, a.reason = False, f"{a.created_at}: {RANDOM_REASON}"
    for p in (profile, old):
        for keep_random in (False, True):
            rg = Simulator(p, keep_random=keep_random).replay
            assert all(rg.is_candidate[rg.act_index[a]] for a in outputs)
            assert rg.rng_nodes.size == 0
    new = rewrite_step(step, old, outputs)
    for a, b in zip(run_from(new, w.model, opt, spec.optimizer, w.batch),
                    run_from(step, w.model, opt, spec.optimizer, w.batch)):
        assert torch.equal(a, b)


def test_verify_and_exported_step_with_random_replays(tmp_path):
    spec, _, _, _, profile = captured("gpt2", "adamw")
    sim = Simulator(profile)
    plan = make_plan(profile, sim.floor_bytes, simulator=sim)
    assert random_outputs(sim, plan.recomputed)
    result = verify(profile, plan, "cpu")
    assert result.passed, result.summary()

    export(profile, plan, tmp_path / "out")
    assert "get_rng_state" in (tmp_path / "out" / "step.py").read_text()
    ours, ref = build_workload(spec), build_workload(spec)
    ours_opt, ref_opt = ours.make_optimizer(), ref.make_optimizer()
    step = acstudio.load_step(tmp_path / "out", ours.model, ours_opt)
    for it in range(2):
        torch.manual_seed(it)
        loss = step(ours.batch)
        after = torch.rand(4)
        torch.manual_seed(it)
        ref_loss = eager_step(ref.model, ref_opt, ref.batch, ref.loss_fn)
        torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
        assert torch.equal(after, torch.rand(4)), "the exported step leaves the generator as eager does"
        for p, q in zip(ours.model.parameters(), ref.model.parameters()):
            torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5)
