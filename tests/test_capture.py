"""The captured whole-iteration graph computes exactly what the eager step (model + torch.optim) computes."""

import copy

import pytest
import torch
from conftest import tiny_spec

from acstudio.capture import capture_step
from acstudio.capture.serialize import deserialize_step, serialize_step
from acstudio.workload import build_workload
from acstudio.workload.spec import make_optimizer


def clone_training_state(model, optimizer, name):
    """Independent copies (``load_state_dict`` alone would share the step and momentum tensors)."""
    model2 = copy.deepcopy(model)
    opt2 = make_optimizer(name, model2.parameters())
    opt2.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    return model2, opt2


def eager_step(model, optimizer, batch, loss_fn):
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch)
    loss.backward()
    optimizer.step()
    return loss.detach()


def assert_same_state(m1, o1, m2, o2, atol=0.0):
    for (n, p1), (_, p2) in zip(m1.named_parameters(), m2.named_parameters()):
        torch.testing.assert_close(p1, p2, atol=atol, rtol=atol, msg=f"parameter {n}")
        torch.testing.assert_close(p1.grad, p2.grad, atol=atol, rtol=atol, msg=f"grad {n}")
    for (n, b1), (_, b2) in zip(m1.named_buffers(), m2.named_buffers()):
        torch.testing.assert_close(b1, b2, atol=atol, rtol=atol, msg=f"buffer {n}")
    ps1 = list(m1.parameters())
    ps2 = list(m2.parameters())
    for p1, p2 in zip(ps1, ps2):
        for key, v in o1.state[p1].items():
            torch.testing.assert_close(v, o2.state[p2][key], atol=atol, rtol=atol, msg=f"state {key}")


@pytest.mark.parametrize(
    ("model", "optimizer"),
    [("resnet18", "adam"), ("resnet18", "sgd"), ("bert", "adamw"), ("gpt2", "adam"), ("bert-cls", "sgd")],
)
def test_captured_step_matches_eager(model, optimizer):
    w = build_workload(tiny_spec(model, optimizer=optimizer, image_size=64, batch_size=4))
    opt = w.make_optimizer()
    step = capture_step(w.model, opt, w.batch, w.loss_fn)

    # Two iterations: the second reads the state the first one wrote. torch.optim's compiled-mode formulas
    # round differently from its eager ones (~1e-7), which tiny-batch BatchNorm amplifies into percents within
    # one more step, so the eager reference restarts from the captured step's state each iteration.
    tol = 1e-5
    for _ in range(2):
        ref_model, ref_opt = clone_training_state(w.model, opt, optimizer)
        torch.manual_seed(7)
        loss = step.run(w.model, opt, w.batch)
        torch.manual_seed(7)
        ref_loss = eager_step(ref_model, ref_opt, w.batch, w.loss_fn)
        torch.testing.assert_close(loss, ref_loss, atol=tol, rtol=tol)
        assert_same_state(w.model, opt, ref_model, ref_opt, atol=tol)


def test_regions_ids_and_tied_weights():
    w = build_workload(tiny_spec("gpt2"))
    step = capture_step(w.model, w.make_optimizer(), w.batch, w.loss_fn)
    nodes = list(step.gm.graph.nodes)
    ids = [n.meta["ac_id"] for n in nodes]
    assert len(set(ids)) == len(ids)
    regions = [n.meta["ac_region"] for n in nodes]
    order = ["input", "forward", "backward", "optimizer", "output"]
    assert [r for i, r in enumerate(regions) if i == 0 or regions[i - 1] != r] == order
    # GPT-2 ties lm_head.weight to wte.weight: one parameter input, one gradient
    params = [s.key for s in step.inputs if s.kind == "param"]
    assert "transformer.wte.weight" in params and "lm_head.weight" not in params
    assert any(n.meta["ac_module"].startswith("transformer.h.0") for n in nodes)


def test_serialized_graph_rebuilds_same_nodes_and_runs():
    w = build_workload(tiny_spec("resnet18"))
    opt = w.make_optimizer()
    step = capture_step(w.model, opt, w.batch, w.loss_fn)
    data = serialize_step(step)
    rebuilt = deserialize_step(data)
    assert [n.meta["ac_id"] for n in rebuilt.gm.graph.nodes] == [n.meta["ac_id"] for n in step.gm.graph.nodes]
    assert serialize_step(rebuilt) == data
    m2, o2 = clone_training_state(w.model, opt, "adam")
    torch.testing.assert_close(step.run(w.model, opt, w.batch), rebuilt.run(m2, o2, w.batch))


def test_custom_factory_with_graph_constant_round_trips():
    from acstudio.workload import WorkloadSpec

    w = build_workload(WorkloadSpec("resources/custom_model_example.py:make", batch_size=4))
    assert w.family == "custom"
    opt = w.make_optimizer()
    step = capture_step(w.model, opt, w.batch, w.loss_fn)
    assert any(n.op == "get_attr" for n in step.gm.graph.nodes)
    rebuilt = deserialize_step(serialize_step(step))
    m2, o2 = clone_training_state(w.model, opt, "adam")
    torch.manual_seed(0)
    loss = step.run(w.model, opt, w.batch)
    torch.manual_seed(0)
    torch.testing.assert_close(loss, rebuilt.run(m2, o2, w.batch))
    torch.testing.assert_close(w.model.head.weight, m2.head.weight)


def test_bf16_autocast_step_matches_eager_autocast():
    w = build_workload(tiny_spec("bert", precision="bf16"))
    opt = w.make_optimizer()
    step = capture_step(w.model, opt, w.batch, w.loss_fn, autocast_dtype=torch.bfloat16)
    assert any(n.meta["ac_dtype"] == "bfloat16" for n in step.gm.graph.nodes)
    ref_model, ref_opt = clone_training_state(w.model, opt, "adam")
    torch.manual_seed(3)
    loss = step.run(w.model, opt, w.batch)
    torch.manual_seed(3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss = w.loss_fn(ref_model, w.batch)
    ref_loss.backward()
    ref_opt.step()
    torch.testing.assert_close(loss, ref_loss.detach(), atol=1e-5, rtol=1e-5)
    assert_same_state(w.model, opt, ref_model, ref_opt, atol=1e-5)
