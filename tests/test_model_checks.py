"""``load_step`` and ``apply_plan`` follow, or refuse in one line, what the model decides besides its tensors: which
parameters are frozen, train or eval mode, the module settings a graph bakes in (dropout probabilities) and the
block structure."""

import copy
import functools

import pytest
import torch
from conftest import tiny_spec
from test_capture import eager_step
from test_optimizer_step import make
from test_rewrite import pick, quick_profile
from test_sac import captured, plans
from torch import nn

import acstudio
from acstudio.capture import capture_step
from acstudio.export import ExportMismatchError, export
from acstudio.export.apply import ModelMismatchError, apply_plan
from acstudio.workload import WorkloadSpec, build_workload
from acstudio.workload.spec import make_optimizer


def frozen(batch_size):
    """The tiny MLP with its first layer frozen, as in fine-tuning."""
    model, batch, loss_fn = make(batch_size)
    model[0].requires_grad_(False)
    return model, batch, loss_fn


def with_dropout(batch_size):
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 3))
    batch = {"x": torch.randn(batch_size, 8), "y": torch.randn(batch_size, 3)}
    return model, batch, lambda m, b: nn.functional.mse_loss(m(b["x"]), b["y"])


@functools.cache
def exported(factory, tmp_root):
    """(spec, export folder) of a factory of this module, half its activations recomputed."""
    spec = WorkloadSpec(f"test_model_checks:{factory}", batch_size=4)
    w = build_workload(spec)
    step = capture_step(w.model, w.make_optimizer(), w.batch, w.loss_fn)
    out = f"{tmp_root}/{factory}"
    export(quick_profile(spec, step), pick(quick_profile(spec, step), 0.5), out, formats=["step"])
    return spec, out


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("exports"))


def one_line(info) -> str:
    assert "\n" not in str(info.value)
    return str(info.value)


def test_a_frozen_layer_is_never_updated_and_trains_bitwise_like_eager(tmp_root):
    spec, out = exported("frozen", tmp_root)
    ours, ref = build_workload(spec), build_workload(spec)
    opt, ref_opt = ours.make_optimizer(), ref.make_optimizer()
    step = acstudio.load_step(out, ours.model, opt)
    before = ours.model[0].weight.detach().clone()
    for _ in range(3):
        assert torch.equal(step(ours.batch), eager_step(ref.model, ref_opt, ref.batch, ref.loss_fn))
        for (name, p), q in zip(ours.model.named_parameters(), ref.model.parameters()):
            assert torch.equal(p, q), name
            assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), name
    assert torch.equal(ours.model[0].weight, before) and ours.model[0].weight.grad is None
    assert ours.model[0].weight not in set(opt.state) and len(opt.state) == len(ref_opt.state)


def test_freezing_what_the_step_trains_or_training_what_it_froze_is_refused(tmp_root):
    spec, out = exported("with_dropout", tmp_root)
    w = build_workload(spec)
    w.model[3].weight.requires_grad_(False)
    with pytest.raises(ExportMismatchError) as info:
        acstudio.load_step(out, w.model, w.make_optimizer())
    assert "parameter 3.weight is frozen (requires_grad=False), but the step trains it" in one_line(info)
    w = build_workload(spec)
    step = acstudio.load_step(out, w.model, w.make_optimizer())
    w.model[0].bias.requires_grad_(False)  # after load_step: refused at the next call, nothing updated
    before = [p.detach().clone() for p in w.model.parameters()]
    with pytest.raises(ExportMismatchError, match=r"^the model changed since load_step: parameter 0\.bias is frozen"):
        step(w.batch)
    assert all(torch.equal(p, b) for p, b in zip(w.model.parameters(), before))

    spec, out = exported("frozen", tmp_root)
    w = build_workload(spec)
    w.model[0].requires_grad_(True)
    with pytest.raises(ExportMismatchError) as info:
        acstudio.load_step(out, w.model, w.make_optimizer())
    assert "parameter 0.weight requires grad, but the step was exported with it frozen" in one_line(info)


def test_eval_mode_is_refused_and_training_mode_runs_again(tmp_root):
    spec, out = exported("with_dropout", tmp_root)
    w = build_workload(spec)
    w.model[2].eval()
    with pytest.raises(ExportMismatchError) as info:
        acstudio.load_step(out, w.model, w.make_optimizer())
    assert "module 2 is in eval mode, but the step was exported in training mode" in one_line(info)
    assert "call model.train()" in str(info.value)
    w.model.train()
    step = acstudio.load_step(out, w.model, w.make_optimizer())
    w.model.eval()  # an evaluation between steps, then the step without model.train()
    with pytest.raises(ExportMismatchError, match=r"^the model changed since load_step: module \(the root module\) "
                                                  r"is in eval mode"):
        step(w.batch)
    w.model.train()
    assert torch.isfinite(step(w.batch))


def test_another_dropout_probability_is_refused_naming_the_module_and_both_values(tmp_root):
    spec, out = exported("with_dropout", tmp_root)
    w = build_workload(spec)
    w.model[2].p = 0.3
    with pytest.raises(ExportMismatchError) as info:
        acstudio.load_step(out, w.model, w.make_optimizer())
    assert ("module 2 has p=0.3, the step was exported with p=0.1 (baked into the graph) — build the model with "
            "p=0.1, or profile and export it with p=0.3") in one_line(info)


def sac_model(model="gpt2"):
    """(workload, a deep copy of its model wrapped by the recompute-all plan, an untouched copy)."""
    w, profile = captured(model)
    ours, ref = copy.deepcopy(w.model), copy.deepcopy(w.model)
    return w, apply_plan(ours, (profile, plans(model)["recompute-all"])), ref


def losses_and_parameters(model, w, steps=2):
    opt = make_optimizer("adam", model.parameters())
    torch.manual_seed(0)
    out = []
    for _ in range(steps):
        out.append(eager_step(model, opt, w.batch, w.loss_fn))
    return out + [p.detach() for p in model.parameters()] + [p.grad for p in model.parameters()]


def assert_bitwise(ours, ref):
    assert len(ours) == len(ref)
    for a, b in zip(ours, ref):
        assert (a is None and b is None) or torch.equal(a, b)


def test_apply_plan_follows_another_dropout_probability_and_a_frozen_layer_exactly():
    w, ours, ref = sac_model()
    for model in (ours, ref):
        for m in model.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.3
        model.transformer.h[1].mlp.c_fc.weight.requires_grad_(False)
    frozen_before = ours.transformer.h[1].mlp.c_fc.weight.detach().clone()
    assert_bitwise(losses_and_parameters(ours, w), losses_and_parameters(ref, w))
    assert torch.equal(ours.transformer.h[1].mlp.c_fc.weight, frozen_before)
    assert ours.transformer.h[1].mlp.c_fc.weight.grad is None


def test_apply_plan_refuses_training_in_eval_mode_and_evaluates_unchanged():
    w, ours, ref = sac_model()
    ours.transformer.h[0].attn.attn_dropout.eval()
    with pytest.raises(ModelMismatchError) as info:
        w.loss_fn(ours, w.batch)
    assert one_line(info).startswith("module transformer.h.0.attn.attn_dropout is in eval mode, but the plan was "
                                     "profiled in training mode — call model.train()")
    ours.eval(), ref.eval()
    with torch.no_grad():
        assert torch.equal(w.loss_fn(ours, w.batch), w.loss_fn(ref, w.batch))


def test_apply_plan_refuses_a_model_with_more_or_fewer_blocks_than_the_profiled_one():
    _, profile = captured("gpt2")  # two layers
    plan = plans("gpt2")["recompute-all"]
    assert apply_plan_error(3, profile, plan) == ("the model has 3 blocks in transformer.h (0, 1, 2), the plan was "
                                                  "made for 2 (0, 1) — profile and plan this model again")
    assert "the model has no module 'transformer.h.1'" in apply_plan_error(1, profile, plan)


def apply_plan_error(layers, profile, plan) -> str:
    config = (("n_layer", str(layers)), ("n_embd", "32"), ("n_head", "2"), ("vocab_size", "120"), ("n_positions", "64"))
    model = build_workload(tiny_spec("gpt2", config=config)).model
    with pytest.raises(ModelMismatchError) as info:
        apply_plan(model, (profile, plan))
    return one_line(info)


def sgd_with_dampening(batch_size):
    return make(batch_size, lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, dampening=0.5))


def test_sgd_dampening_is_refused_for_a_fresh_optimizer_and_followed_after_its_first_step(tmp_root):
    """torch.optim's SGD dampens from its second step on; the graph, traced with momentum buffers in place, always
    dampens."""
    spec, out = exported("sgd_with_dampening", tmp_root)
    ours, ref = build_workload(spec), build_workload(spec)
    opt, ref_opt = ours.make_optimizer(), ref.make_optimizer()
    with pytest.raises(ExportMismatchError) as info:
        acstudio.load_step(out, ours.model, opt)
    assert "param group 0 has momentum with dampening=0.5, which torch.optim's SGD skips on its first step" in \
        one_line(info)
    for w, o in ((ours, opt), (ref, ref_opt)):
        eager_step(w.model, o, w.batch, w.loss_fn)
    step = acstudio.load_step(out, ours.model, opt)
    for _ in range(2):
        assert torch.equal(step(ours.batch), eager_step(ref.model, ref_opt, ref.batch, ref.loss_fn))
        assert all(torch.equal(p, q) for p, q in zip(ours.model.parameters(), ref.model.parameters()))
