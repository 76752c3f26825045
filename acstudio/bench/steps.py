"""One training step per benchmark configuration, built on the device and ready to be timed.

Every builder returns a :class:`Prepared` whose ``step()`` runs one full iteration (forward, loss, backward,
optimizer update) of the same workload. Only the way activations are kept differs between configurations.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from acstudio.bench.configs import BenchConfig
from acstudio.errors import ACStudioError
from acstudio.workload import Workload, WorkloadSpec, build_workload


@dataclass
class Prepared:
    """A ready step and what :mod:`acstudio.bench.measure` needs to account for the memory it finds resident."""

    step: Callable[[], torch.Tensor]
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    batch: Any
    info: dict[str, Any] = field(default_factory=dict)


def load(spec: WorkloadSpec, dev: torch.device) -> tuple[Workload, torch.optim.Optimizer]:
    workload = build_workload(spec).to(dev)
    return workload, workload.make_optimizer()


def autocast(spec: WorkloadSpec, dev: torch.device) -> contextlib.AbstractContextManager:
    """bf16 means autocast around forward and loss, the same mixed precision the captured step uses."""
    if spec.precision == "bf16":
        return torch.autocast(dev.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def eager_step(spec: WorkloadSpec, dev: torch.device, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               batch: Any, loss_fn) -> Callable[[], torch.Tensor]:
    """The loop users write: ``model`` may be the plain, block-checkpointed or ``torch.compile``-d module."""

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        with autocast(spec, dev):
            loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def prepare_eager(spec: WorkloadSpec, dev: torch.device) -> Prepared:
    w, opt = load(spec, dev)
    return Prepared(eager_step(spec, dev, w.model, opt, w.batch, w.loss_fn), w.model, opt, w.batch)


def prepare_per_block(spec: WorkloadSpec, dev: torch.device) -> Prepared:
    w, opt = load(spec, dev)
    blocks = enable_per_block(w)
    return Prepared(eager_step(spec, dev, w.model, opt, w.batch, w.loss_fn), w.model, opt, w.batch,
                    {"checkpointed_blocks": blocks})


def prepare_compile(spec: WorkloadSpec, dev: torch.device, ratio: float | None, backend: str) -> Prepared:
    """``torch.compile`` of the model (forward and backward); the optimizer step stays eager, as users run it.

    The memory ratio is a process-wide functorch setting, which is one reason every configuration gets its
    own process.
    """
    import torch._functorch.config as functorch_config

    if ratio is not None:
        functorch_config.activation_memory_budget = ratio
    w, opt = load(spec, dev)
    compiled = torch.compile(w.model, backend=backend)
    return Prepared(eager_step(spec, dev, compiled, opt, w.batch, w.loss_fn), w.model, opt, w.batch,
                    {"compile_backend": backend, "activation_memory_budget": functorch_config.activation_memory_budget})


def prepare_captured(spec: WorkloadSpec, dev: torch.device) -> Prepared:
    from acstudio.capture import capture_step

    w, opt = load(spec, dev)
    step = capture_step(w.model, opt, w.batch, w.loss_fn,
                        autocast_dtype=torch.bfloat16 if spec.precision == "bf16" else None)
    return Prepared(lambda: step.run(w.model, opt, w.batch), w.model, opt, w.batch,
                    {"graph_nodes": len(step.gm.graph.nodes)})


def prepare_rewritten(spec: WorkloadSpec, dev: torch.device, budget: str, profile_path: str | None) -> Prepared:
    """The captured step rewritten by a mu-TWO plan at ``budget`` (e.g. ``60%`` or ``8GiB``).

    The whole profile -> plan -> rewrite pipeline lives here so that API changes touch one function. The
    profile is measured first, while the device is still empty, and cached in ``profile_path`` for the next
    budget at the same batch size. The rewritten graph is rebuilt from the profile's own serialized graph, so
    its node ids are the ones the plan refers to.
    """
    from acstudio.capture.serialize import deserialize_step
    from acstudio.capture.tracer import prepare_optimizer
    from acstudio.plan.budget import parse_budget
    from acstudio.plan.solvers import plan as plan_budget
    from acstudio.rewrite.rewriter import rewrite

    profile = cached_profile(spec, dev, profile_path)
    budget_bytes = parse_budget(budget, profile.peak_bytes)
    plan = plan_budget(profile, budget_bytes)
    step = rewrite(deserialize_step(profile.graph, device=str(dev)), profile, plan)
    w, opt = load(spec, dev)
    # The optimizer as capture_step left it when the graph was traced: state created, CUDA Adam capturable.
    prepare_optimizer(w.model, opt)
    info = {"budget_bytes": int(budget_bytes), "profile_peak_bytes": profile.peak_bytes,
            "profile_iteration_ms": profile.iteration_ms, "graph_nodes": len(step.gm.graph.nodes),
            "plan": scalar_fields(plan), "recomputed_activations": len(getattr(plan, "recomputed", ()))}
    return Prepared(lambda: step.run(w.model, opt, w.batch), w.model, opt, w.batch, info)


def cached_profile(spec: WorkloadSpec, dev: torch.device, path: str | None):
    """Profile ``spec`` on ``dev``, or reuse a profile file of exactly this workload and device type."""
    from acstudio.profile.model import Profile
    from acstudio.profile.profiler import free_device_memory, profile_workload

    if path and Path(path).is_file():
        profile = Profile.load(path)
        if profile.workload == spec.to_dict() and profile.environment.get("device_type") == dev.type:
            return profile
    profile = profile_workload(spec, str(dev))
    free_device_memory()
    if path:
        profile.save(path)
    return profile


def scalar_fields(obj: Any) -> dict[str, Any]:
    """The plain-number/text fields of a plan (its summary), whatever else the planner puts in it."""
    if dataclasses.is_dataclass(obj):
        items = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    else:
        items = dict(vars(obj))
    return {k: v for k, v in items.items() if isinstance(v, (bool, int, float, str)) or v is None}


def checkpoint_forward(module: torch.nn.Module) -> None:
    """Run ``module`` under non-reentrant ``torch.utils.checkpoint``; its parameter names stay unchanged."""
    forward = module.forward

    def checkpointed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed


def enable_per_block(workload: Workload) -> int | None:
    """Checkpoint every block the way practitioners do; returns how many blocks are checkpointed (if known).

    torchvision ResNets: every BasicBlock/Bottleneck of layer1..layer4. Other torchvision models: every child
    of the main ``features`` or ``encoder.layers`` Sequential. Hugging Face models: their own
    ``gradient_checkpointing_enable``.
    """
    model = workload.model
    if workload.family == "transformers":
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise ACStudioError(f"{workload.spec.model} does not support gradient checkpointing")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        try:
            from transformers.modeling_layers import GradientCheckpointingLayer
        except ImportError:  # transformers < 4.52 checkpoints inside each model's layer loop: nothing to count
            return None
        return sum(isinstance(m, GradientCheckpointingLayer) for m in model.modules())
    if workload.family != "torchvision":
        raise ACStudioError("per-block checkpointing needs a torchvision or transformers model, "
                            f"not {workload.spec.model}")
    from torchvision.models.resnet import BasicBlock, Bottleneck

    blocks = [b for name in ("layer1", "layer2", "layer3", "layer4")
              for b in getattr(model, name, ()) if isinstance(b, (BasicBlock, Bottleneck))]
    if not blocks:
        encoder = getattr(getattr(model, "encoder", None), "layers", None)
        main = getattr(model, "features", None)
        main = main if isinstance(main, torch.nn.Sequential) else encoder
        if not isinstance(main, torch.nn.Sequential):
            raise ACStudioError(f"{workload.spec.model}: no layer1..4, features or encoder.layers blocks to checkpoint")
        blocks = list(main.children())
    for block in blocks:
        checkpoint_forward(block)
    return len(blocks)


def prepare(config: BenchConfig, spec: WorkloadSpec, dev: torch.device, *, profile_path: str | None = None,
            compile_backend: str = "inductor", budget: str | None = None) -> Prepared:
    """Build ``config``; ``budget`` overrides a rewritten step's own argument (the runner resolves
    ``rewritten@per-block`` to the per-block peak it measured)."""
    if config.kind == "eager":
        return prepare_eager(spec, dev)
    if config.kind == "per-block":
        return prepare_per_block(spec, dev)
    if config.kind == "compile":
        return prepare_compile(spec, dev, config.memory_ratio, compile_backend)
    if config.kind == "captured":
        return prepare_captured(spec, dev)
    if config.kind == "rewritten":
        return prepare_rewritten(spec, dev, budget or config.arg or "", profile_path)
    raise ACStudioError(f"unknown configuration {config.name}")
