"""The exported step follows the user's optimizer: hyperparameters are graph inputs read at every call, so an LR
scheduler drives ``load_step`` exactly as it drives ``optimizer.step()``; only what the graph cannot follow (type,
parameters, switches, branches torch.optim took) is refused, in one line."""

import functools

import pytest
import torch
from test_capture import eager_step
from test_rewrite import pick, quick_profile
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import acstudio
from acstudio.capture import capture_step
from acstudio.capture.serialize import deserialize_step, serialize_step
from acstudio.capture.step import group_value, hyper_key, prepare_optimizer
from acstudio.capture.tracer import SymbolicHyperparameters, _optimizer_on, hyperparameter_slots
from acstudio.cli import build_parser
from acstudio.errors import ACStudioError
from acstudio.export import ExportMismatchError, export
from acstudio.profile.model import Profile
from acstudio.workload import WorkloadSpec, build_workload

FACTORY = "test_optimizer_step:make"
CAPTURED_LR = 0.3  # the profile is made at this lr; the training loops below never use it
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.02, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.02),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.02, weight_decay=0.05),
}
SCHEDULERS = {
    "StepLR": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    # cycles momentum (SGD) or beta1 (Adam, AdamW) along with the learning rate
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=6),
}


def make(batch_size, optimizer=None):
    """A tiny regression MLP (no random ops, so eager and graph draw nothing); optionally its own optimizer."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.LayerNorm(16), nn.Linear(16, 16), nn.GELU(),
                          nn.Linear(16, 3))
    batch = {"x": torch.randn(batch_size, 8), "y": torch.randn(batch_size, 3)}

    def loss_fn(model, batch):
        return nn.functional.mse_loss(model(batch["x"]), batch["y"])

    if optimizer is None:
        return model, batch, loss_fn
    return model, batch, loss_fn, optimizer(model)


def two_groups(batch_size):
    """A factory returning its own optimizer: SGD with a second param group at another lr, no momentum."""
    return make(batch_size, lambda m: torch.optim.SGD(
        [{"params": m[0].parameters(), "lr": 0.1}, {"params": [p for layer in m[1:] for p in layer.parameters()]}],
        lr=0.05, momentum=0.0, nesterov=False))


def rmsprop(batch_size):
    return make(batch_size, lambda m: torch.optim.RMSprop(m.parameters()))


@functools.cache
def exported(optimizer, tmp_root):
    """(spec, export folder): profiled once per optimizer at CAPTURED_LR, half its activations recomputed."""
    spec = WorkloadSpec(FACTORY, batch_size=4, optimizer=optimizer, lr=CAPTURED_LR)
    w = build_workload(spec)
    step = capture_step(w.model, w.make_optimizer(), w.batch, w.loss_fn)
    profile = quick_profile(spec, step)
    out = f"{tmp_root}/{optimizer}"
    export(profile, pick(profile, 0.5), out)
    return spec, out


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("exports"))


def assert_bitwise_equal(ours, ours_opt, ref, ref_opt):
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), f"parameter {name}"
        assert torch.equal(p.grad, q.grad), f"gradient {name}"
        assert ref_opt.state[q].keys() == ours_opt.state[p].keys()
        for key, value in ref_opt.state[q].items():
            assert torch.equal(ours_opt.state[p][key], value), f"{key} of {name}"


@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_load_step_trains_like_the_eager_loop_under_a_scheduler(tmp_root, optimizer, scheduler):
    spec, out = exported(optimizer, tmp_root)
    ours, ref = build_workload(spec), build_workload(spec)  # identically seeded copies
    ours_opt, ref_opt = OPTIMIZERS[optimizer](ours.model.parameters()), OPTIMIZERS[optimizer](ref.model.parameters())
    ours_sched, ref_sched = SCHEDULERS[scheduler](ours_opt), SCHEDULERS[scheduler](ref_opt)
    step = acstudio.load_step(out, ours.model, ours_opt)
    rates = set()
    for _ in range(5):
        loss = step(ours.batch)
        ref_loss = eager_step(ref.model, ref_opt, ref.batch, ref.loss_fn)
        assert not loss.requires_grad and loss.grad_fn is None
        assert torch.equal(loss, ref_loss)
        assert_bitwise_equal(ours.model, ours_opt, ref.model, ref_opt)
        rates.add(ours_opt.param_groups[0]["lr"])
        ours_sched.step()
        ref_sched.step()
    assert len(rates) >= 3 and CAPTURED_LR not in rates  # the scheduler really moved the lr


def scheduled_hyperparameters(optimizer):
    """Five (lr, beta1 or momentum) settings, as OneCycleLR would move them: never the captured values."""
    second = "momentum" if isinstance(optimizer, torch.optim.SGD) else "betas"
    for lr, b1 in ((0.02, 0.95), (0.05, 0.85), (0.01, 0.9), (0.002, 0.93), (0.02, 0.95)):
        for group in optimizer.param_groups:
            group["lr"] = lr
            group[second] = b1 if second == "momentum" else (b1, group["betas"][1])
        yield


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_the_multi_tensor_update_cuda_runs_is_bitwise_the_eager_one_at_every_setting(optimizer):
    """On CUDA torch.optim runs its foreach update; the graph traces that same code (not Adam's capturable
    formulas, which round differently and drift visibly within a few Adam steps), so it stays bitwise."""
    spec = WorkloadSpec(FACTORY, batch_size=4, optimizer=optimizer, lr=CAPTURED_LR)
    w, ref = build_workload(spec), build_workload(spec)
    opt, ref_opt = w.make_optimizer(), ref.make_optimizer()
    for group, ref_group in zip(opt.param_groups, ref_opt.param_groups):
        group["foreach"] = ref_group["foreach"] = True
    prepare_optimizer(w.model, opt)  # the state of a fresh optimizer, as ref_opt's first step makes it
    step = capture_step(w.model, opt, w.batch, w.loss_fn)
    assert [g["capturable"] for g in step.optimizer.groups] == [False]
    assert not any("_foreach_pow" in str(n.target) for n in step.gm.graph.nodes)
    for _ in zip(scheduled_hyperparameters(opt), scheduled_hyperparameters(ref_opt)):
        loss = step.run(w.model, opt, w.batch)
        assert torch.equal(loss, eager_step(ref.model, ref_opt, ref.batch, ref.loss_fn))
        assert_bitwise_equal(w.model, opt, ref.model, ref_opt)


@pytest.mark.parametrize("kind", ["Adam", "AdamW"])
def test_the_update_traced_with_cuda_parameters_follows_lr_and_betas_bitwise(kind):
    """torch.optim's update traced as capture_step traces it on a GPU (fake CUDA parameters and moments, the
    default CPU step counters), then run on the CPU: bitwise the eager foreach update at every setting, and
    every hyperparameter is a graph input, not a constant."""
    params = [nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(4))]
    opt = getattr(torch.optim, kind)(params, lr=CAPTURED_LR, foreach=True, weight_decay=0.05)
    ref = [nn.Parameter(p.detach().clone()) for p in params]
    ref_opt = getattr(torch.optim, kind)(ref, lr=CAPTURED_LR, foreach=True, weight_decay=0.05)
    prepare_optimizer(nn.ParameterList(params), opt)
    prepare_optimizer(nn.ParameterList(ref), ref_opt)
    state = [opt.state[p][k] for p in params for k in ("step", "exp_avg", "exp_avg_sq")]
    slots = hyperparameter_slots(opt)
    traced = SymbolicHyperparameters()

    def on_cuda(t):
        with traced.fake_mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu" if t.dim() == 0 else "cuda")

    def update(flat):
        ps, grads, moments, hyper = flat[:2], flat[2:4], flat[4:10], flat[10:]
        for p, g in zip(ps, grads):
            p.grad = g
        lifted = {p: dict(zip(("step", "exp_avg", "exp_avg_sq"), moments[3 * i:3 * i + 3])) for i, p in enumerate(ps)}
        with _optimizer_on(opt, ps, lifted, {hyper_key(s.key): v for s, v in zip(slots, hyper)}):
            opt.step()
        return ps

    flat = [on_cuda(t) for t in [*params, *params, *state]]
    flat += [traced.symbol(s.key, group_value(opt.param_groups[0], hyper_key(s.key)[1])) for s in slots]
    gm = make_fx(update, tracing_mode="fake")(flat)
    assert not any("_foreach_pow" in str(n.target) for n in gm.graph.nodes)  # not the capturable formulas
    assert traced.conditions() == [("0/weight_decay", "!=", 0.0), ("0/beta1", ">=", 0.0), ("0/beta2", ">=", 0.0)]
    for _ in zip(scheduled_hyperparameters(opt), scheduled_hyperparameters(ref_opt)):
        grads = [torch.randn_like(p) for p in params]
        with torch.no_grad():
            gm([p.detach() for p in params] + grads + state
               + [group_value(opt.param_groups[0], hyper_key(s.key)[1]) for s in slots])
        for q, g in zip(ref, grads):
            q.grad = g
        ref_opt.step()
        for p, q in zip(params, ref):
            assert torch.equal(p, q)


def test_a_cuda_optimizer_keeps_the_state_layout_it_runs_eagerly():
    """Preparing a CUDA Adam for capture or load_step leaves it non-capturable with CPU step counters, so the
    graph is traced from, and fed like, the update the user's optimizer runs (fake CUDA tensors: no GPU here)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        model = nn.Linear(4, 3, device="cuda")
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        prepare_optimizer(model, opt)
    assert opt.param_groups[0]["capturable"] is False
    assert {s["step"].device.type for s in opt.state.values()} == {"cpu"}


def test_a_capturable_optimizer_must_match_the_capture(tmp_root):
    """Capturable formulas are another update (they round differently): refused both ways, in one line."""
    spec, out = exported("adam", tmp_root)
    w = build_workload(spec)
    with pytest.raises(ExportMismatchError, match=r"param group 0 has capturable=True, the step was captured "
                                                  r"with capturable=False \(another update formula\)") as info:
        acstudio.load_step(out, w.model, torch.optim.Adam(w.model.parameters(), capturable=True))
    assert "\n" not in str(info.value)


def test_a_different_optimizer_type_or_broken_branch_is_refused_in_one_line(tmp_root):
    spec, out = exported("adam", tmp_root)
    w = build_workload(spec)
    with pytest.raises(ExportMismatchError) as info:
        acstudio.load_step(out, w.model, torch.optim.SGD(w.model.parameters(), lr=0.1))
    assert str(info.value) == "this step was exported for torch.optim.Adam, got SGD"
    with pytest.raises(ExportMismatchError, match=r"param group 0 does not update parameter 0\.weight"):
        acstudio.load_step(out, w.model, torch.optim.Adam(list(w.model.parameters())[2:]))
    # Adam was captured without weight decay, so the graph has no decay term: refused at load and at every call
    with pytest.raises(ExportMismatchError, match=r"weight_decay=0\.1, .* traced for weight_decay == 0\.0") as info:
        acstudio.load_step(out, w.model, torch.optim.Adam(w.model.parameters(), weight_decay=0.1))
    assert "\n" not in str(info.value)
    opt = torch.optim.Adam(w.model.parameters(), lr=1e-4, betas=(0.5, 0.9), eps=1e-6)  # any values otherwise
    step = acstudio.load_step(out, w.model, opt)
    step(w.batch)
    opt.param_groups[0]["weight_decay"] = 0.1
    with pytest.raises(ExportMismatchError, match="changed since load_step"):
        step(w.batch)


def test_branches_on_hyperparameters_become_conditions_and_anything_else_pins_the_values():
    traced = SymbolicHyperparameters()
    lr, wd, momentum = (traced.symbol(k, v) for k, v in (("0/lr", 0.1), ("0/weight_decay", 0.0), ("1/momentum", 0.9)))
    assert not bool(wd != 0)  # how torch.optim asks
    assert bool(1 > momentum) and bool(0 <= momentum)  # a number on either side
    assert bool(lr * momentum > 0.01)  # not of the form "setting op number": both values pinned
    assert traced.conditions() == [("0/weight_decay", "==", 0.0), ("1/momentum", "<", 1.0),
                                   ("1/momentum", ">=", 0.0), ("0/lr", "==", 0.1), ("1/momentum", "==", 0.9)]


def test_factory_optimizer_with_two_param_groups_drives_the_captured_step():
    spec = WorkloadSpec("test_optimizer_step:two_groups", batch_size=4)
    w = build_workload(spec)
    assert w.spec.optimizer == "sgd"  # named after the factory's optimizer, not the --optimizer default
    opt = w.make_optimizer()
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.05] and opt is not w.optimizer
    step = capture_step(w.model, opt, w.batch, w.loss_fn)
    hyper = [s.key for s in step.inputs if s.kind == "hyper"]
    assert hyper == [f"{g}/{n}" for g in (0, 1) for n in ("lr", "momentum", "dampening", "weight_decay")]
    assert [len(g["params"]) for g in step.optimizer.groups] == [2, 6]
    # the profile round trip keeps which inputs are hyperparameters and what the optimizer must look like
    rebuilt = deserialize_step(serialize_step(step))
    assert rebuilt.inputs == step.inputs and rebuilt.optimizer == step.optimizer

    ref = build_workload(spec)
    ref_opt = ref.make_optimizer()
    for lr in (0.2, 0.01):  # a changed lr in the second group only
        opt.param_groups[1]["lr"] = ref_opt.param_groups[1]["lr"] = lr
        loss = rebuilt.run(w.model, opt, w.batch)
        assert torch.equal(loss, eager_step(ref.model, ref_opt, ref.batch, ref.loss_fn))
        assert_bitwise_equal(w.model, opt, ref.model, ref_opt)
    one_group = torch.optim.SGD(w.model.parameters(), lr=0.1)
    assert step.optimizer.problems(w.model, one_group) == [
        "the step was captured with 2 param group(s), the optimizer has 1"]


def test_unsupported_factory_optimizer_and_misplaced_options_are_one_line_errors():
    with pytest.raises(ACStudioError, match=r"optimizer is RMSprop; AC Studio captures torch\.optim\.SGD, "
                                            r"torch\.optim\.Adam, torch\.optim\.AdamW"):
        build_workload(WorkloadSpec("test_optimizer_step:rmsprop", batch_size=2))
    with pytest.raises(ACStudioError, match="returns its own optimizer, so --lr would be ignored"):
        build_workload(WorkloadSpec("test_optimizer_step:two_groups", batch_size=2, lr=0.1))
    with pytest.raises(ACStudioError, match="--momentum does not apply to adam — use it with --optimizer sgd"):
        WorkloadSpec(FACTORY, batch_size=2, optimizer="adam", momentum=0.5)
    with pytest.raises(ACStudioError, match="Invalid learning rate"):
        WorkloadSpec(FACTORY, batch_size=2, lr=-1.0)


def test_options_reach_the_optimizer_and_the_reproducing_command():
    args = build_parser().parse_args(["profile", FACTORY, "-b", "2", "--optimizer", "adamw", "--lr", "0.004",
                                      "--weight-decay", "0.2", "--betas", "0.8,0.95", "--out", "x.json"])
    from acstudio.cli import _spec

    spec = _spec(args)
    opt = build_workload(spec).make_optimizer()
    assert (opt.defaults["lr"], opt.defaults["weight_decay"], opt.defaults["betas"]) == (0.004, 0.2, (0.8, 0.95))
    again = _spec(build_parser().parse_args(["profile", *spec.cli_args().split(), "--out", "x.json"]))
    assert again == spec and WorkloadSpec.from_dict(spec.to_dict()) == spec
    defaults = build_workload(WorkloadSpec(FACTORY, batch_size=2, optimizer="sgd")).make_optimizer().defaults
    assert (defaults["lr"], defaults["momentum"], defaults["weight_decay"]) == (0.01, 0.9, 0.0)


def test_a_profile_with_constant_hyperparameters_still_plans_exports_and_refuses_another_lr(tmp_path):
    profile = Profile.load("sample_profiles/cpu_resnet18_bs16_sgd.json.gz")
    assert not any(kind == "hyper" for kind, _ in profile.graph["inputs"])
    assert deserialize_step(profile.graph).optimizer is None
    from acstudio.plan import plan as make_plan

    plan = make_plan(profile, int(profile.peak_bytes * 0.85))
    export(profile, plan, tmp_path / "out")
    w = build_workload(WorkloadSpec.from_dict(profile.workload))
    with pytest.raises(ExportMismatchError, match=r"param group 0 has lr=0\.1, the step was captured with lr=0\.01"):
        acstudio.load_step(tmp_path / "out", w.model, torch.optim.SGD(w.model.parameters(), lr=0.1, momentum=0.9))
    step = acstudio.load_step(tmp_path / "out", w.model, w.make_optimizer())
    step.optimizer.param_groups[0]["lr"] = 0.5
    with pytest.raises(ExportMismatchError, match="bakes its hyperparameters in"):
        step(w.batch)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_a_step_captured_from_a_fresh_optimizer_trains_like_it_from_the_first_step(optimizer):
    """Capturing prepares the optimizer the one way every feeder of a graph does: its state is a fresh optimizer's
    (Adam's step counters back at zero, so the first update's bias correction is eager's), and a frozen parameter
    gets none."""
    spec = WorkloadSpec(FACTORY, batch_size=4, optimizer=optimizer)
    w, ref = build_workload(spec), build_workload(spec)
    for model in (w.model, ref.model):
        model[3].weight.requires_grad_(False)
    opt, ref_opt = w.make_optimizer(), ref.make_optimizer()
    step = capture_step(w.model, opt, w.batch, w.loss_fn)
    assert all(not torch.is_tensor(s.get("step")) or s["step"].item() == 0 for s in opt.state.values())
    ours_fqn = {id(p): n for n, p in w.model.named_parameters()}
    ref_fqn = {id(p): n for n, p in ref.model.named_parameters()}
    assert "3.weight" not in {ours_fqn[id(p)] for p in opt.state}
    for _ in range(3):
        assert torch.equal(step.run(w.model, opt, w.batch), eager_step(ref.model, ref_opt, ref.batch, ref.loss_fn))
        for (name, p), q in zip(w.model.named_parameters(), ref.model.parameters()):
            assert torch.equal(p, q), name
            assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), name
        assert {ours_fqn[id(p)] for p in opt.state} == {ref_fqn[id(p)] for p in ref_opt.state}
