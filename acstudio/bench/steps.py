"""One training step per benchmark configuration, built on the device and ready to be timed.

Every builder returns a :class:`Prepared` whose ``step()`` runs one full iteration (forward, loss, backward,
optimizer update) of the same workload. Only the way activations are kept differs between configurations.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from acstudio.bench.configs import BenchConfig
from acstudio.errors import ACStudioError
from acstudio.plan import baselines
from acstudio.workload import Workload, WorkloadSpec, build_workload


@dataclass
class Prepared:
    """A ready step and what :mod:`acstudio.bench.measure` needs to account for the memory it finds resident."""

    step: Callable[[], torch.Tensor]
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    batch: Any
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Request:
    """What a worker asks for: the configuration, the workload, the device and where the plans come from.

    ``budget`` is a planned configuration's budget as the runner resolved it (``rewritten@per-block`` becomes
    per-block's measured peak in bytes); ``dist`` is set when the worker is one rank of a ``torchrun`` job, and
    then ``spec`` is the global batch, of which each rank trains its slice.
    """

    config: BenchConfig
    spec: WorkloadSpec
    dev: torch.device
    profile_path: str | None = None
    compile_backend: str = "inductor"
    budget: str | None = None
    compiled_per_block_peak: str | None = None  # compile+per-block's measured peak, for sac+compile's prediction
    compiled_per_op_peak: str | None = None  # compile+per-op's: its second calibration point
    compiled_step_ms: str | None = None  # compile's, compile+per-block's (compile+per-op's, +regions'): its planner
    regions_bias: bool = False  # compile+per-op+regions ran its blocks handed the mask's bias (CompiledTimes)
    compile_host_ms: float | None = None  # the host's time to issue compile's step, where measured (CompiledTimes)
    dist: Any = None  # acstudio.bench.distributed.Ranks
    nproc: int = 1  # ranks of an fsdp+/ddp+ configuration (its planning process runs alone)


def load(spec: WorkloadSpec, dev: torch.device) -> tuple[Workload, torch.optim.Optimizer]:
    workload = build_workload(spec).to(dev)
    return workload, ready_optimizer(workload)


def ready_optimizer(workload: Workload) -> torch.optim.Optimizer:
    """The workload's optimizer, its state made now, before any step, as a captured or rewritten step needs it
    (:func:`acstudio.capture.step.prepare_optimizer`), so that every row makes it alike: on an allocator that
    holds the parameters only. Made in the first step instead, the state's blocks are cut from whatever that step
    left cached, and the allocator's rounding of them moved one configuration's measured peak by 6.7 MiB from one
    process to the next (GPT-2 seq 512, Adam's moments; ``benchmarks/probes/compiled_form_peak.py``): as much as
    the planning headroom, and more than two forms of one plan differ by."""
    from acstudio.capture.step import prepare_optimizer

    optimizer = workload.make_optimizer()
    prepare_optimizer(workload.model, optimizer)
    return optimizer


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


def prepare_eager(req: Request) -> Prepared:
    """A model step: the plain model, or (per the configuration) checkpointed, parallelized and compiled."""
    return model_step(req, lambda workload: None)


def prepare_per_block(req: Request) -> Prepared:
    return model_step(req, lambda workload: {
        "checkpointed_blocks": enable_per_block(workload, in_forward=blocks_compiled_alone(req))})


def prepare_per_op(req: Request) -> Prepared:
    return model_step(req, lambda workload: {
        "checkpointed_blocks": enable_per_block(workload, per_op_context, in_forward=blocks_compiled_alone(req))})


def blocks_compiled_alone(req: Request) -> bool:
    """Whether :func:`model_step` compiles each block on its own (compiled, under FSDP2/DDP), so that the block's
    checkpoint must sit in its forward to compile with it."""
    return req.dist is not None and req.config.spec.compiled


def prepare_per_op_regions(req: Request) -> Prepared:
    """compile+per-op in the form a compiled plan that offloads runs in (:func:`per_op_as_regions`)."""

    def apply(workload: Workload) -> dict[str, Any]:
        checkpointed, form, bias = per_op_as_regions(workload, req.compile_backend)
        return {"checkpointed_blocks": checkpointed, "compiled": form, "mask_bias": bias}

    return model_step(req, apply)


def per_op_as_regions(workload: Workload, compile_backend: str | Callable) -> tuple[int, str, bool]:
    """torchtitan's policy on every block, the first block run as a region
    (:func:`acstudio.export.apply.run_as_region`): compiled on its own inside the offload hooks, which copy nothing
    here. Dynamo cannot resume inside the model's loop over its blocks, so compiled around it the loop runs eager
    and every other block compiles alone too, each handed the attention mask's bias made once
    (:func:`acstudio.export.apply.hand_blocks_mask_bias`) where the model takes it, as :func:`acstudio.apply_plan`
    hands it to a plan made on these times (:attr:`acstudio.plan.compiled.CompiledTimes.regions_bias`). Returns how
    many blocks are checkpointed, what was done and whether the blocks were handed the bias.

    Each block's checkpoint goes inside its forward (``enable_per_block(in_forward=True)``), where
    :func:`acstudio.apply_plan` puts a plan's, so that it compiles with the block. With Hugging Face's own placement
    on transformers 5.17 each block ran its checkpoint eagerly, SAC's dispatch mode around the compiled graph, a
    form no plan runs in (on the H200, GPT-2 seq 2048: 53 ms slower than compile+per-op, against 6.6 ms with the
    checkpoint compiled; results/superseded/grid-gpt2-s2048.compiled-regions-checkpoint-eager.json)."""
    from acstudio.export.apply import RegionOffload, hand_blocks_mask_bias, run_as_region

    checkpointed = enable_per_block(workload, per_op_context, in_forward=True)
    blocks = find_blocks(workload)
    name = next(n for n, m in workload.model.named_modules() if m is blocks[0])
    run_as_region(blocks[0], name, RegionOffload(0, {}), {"backend": compile_backend})
    bias = hand_blocks_mask_bias(workload.model, blocks)
    return checkpointed, f"{name} alone, the loop eager" + (", the mask's bias made once" if bias else ""), bias


def prepare_per_block_offload(req: Request) -> Prepared:
    """Hugging Face gradient checkpointing with the checkpoints' inputs on the host: the classic checkpoint-wrapper
    offload, ``save_on_cpu`` around the checkpointed model (pinned buffers on a GPU)."""
    pinned = req.dev.type == "cuda"

    def apply(workload: Workload) -> dict[str, Any]:
        blocks = enable_per_block(workload)
        on_host_in_forward(workload.model, lambda: torch.autograd.graph.save_on_cpu(pin_memory=pinned))
        return {"checkpointed_blocks": blocks, "saved_on": "host (save_on_cpu)"}

    return model_step(req, apply)


def prepare_offload(req: Request) -> Prepared:
    """No checkpointing; every tensor autograd saves in the model's forward goes to pinned host memory on a side
    stream and comes back on it when backward reads it (:class:`SideStreamOffload`)."""

    def apply(workload: Workload) -> dict[str, Any]:
        on_host_in_forward(workload.model, lambda: SideStreamOffload(req.dev))
        return {"saved_on": "host (saved_tensors_hooks, side stream)"}

    return model_step(req, apply)


def on_host_in_forward(module: torch.nn.Module, hooks: Callable[[], contextlib.AbstractContextManager]) -> None:
    """Run ``module``'s forward inside ``hooks()`` (saved-tensor hooks): what it saves for backward goes to the
    host; the loss computed after it does not."""
    forward = module.forward

    @functools.wraps(forward)
    def forward_on_host(*args, **kwargs):
        with hooks():
            return forward(*args, **kwargs)

    module.forward = forward_on_host


class SideStreamOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that keep what autograd saves on the host: pack copies a CUDA tensor into pinned memory
    on a side stream (the device block is reused once that copy is done: ``record_stream``), unpack copies it back
    on that stream and makes the compute stream wait for it. Parameters and tensors under
    :data:`OFFLOAD_MIN_BYTES` stay on the device, as torchtune's ``OffloadActivations`` keeps them."""

    def __init__(self, dev: torch.device) -> None:
        self.stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        super().__init__(self.pack, self.unpack)

    def pack(self, tensor: torch.Tensor):
        if (self.stream is None or tensor.device.type != "cuda" or isinstance(tensor, torch.nn.Parameter)
                or tensor.numel() * tensor.element_size() < OFFLOAD_MIN_BYTES):
            return tensor
        host = torch.empty_like(tensor, device="cpu", pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(self.stream):
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(self.stream)
        return host, tensor.device

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        host, device = packed
        with torch.cuda.stream(self.stream):
            tensor = host.to(device, non_blocking=True)
        torch.cuda.current_stream(device).wait_stream(self.stream)
        tensor.record_stream(torch.cuda.current_stream(device))
        return tensor


# torchtune's min_offload_size: smaller saved tensors cost more to copy than they free.
OFFLOAD_MIN_BYTES = 1024


def prepare_compile(req: Request) -> Prepared:
    """``torch.compile`` of the model (forward and backward); the optimizer step stays eager, as users run it.

    The memory ratio is a process-wide functorch setting, which is one reason every configuration gets its
    own process.
    """
    import torch._functorch.config as functorch_config

    if req.config.memory_ratio is not None:
        functorch_config.activation_memory_budget = req.config.memory_ratio
    prepared = prepare_eager(req)
    prepared.info["activation_memory_budget"] = functorch_config.activation_memory_budget
    return prepared


def model_step(req: Request, apply_checkpointing: Callable[[Workload], dict[str, Any] | None]) -> Prepared:
    """Build the workload, checkpoint it, spread it over the ranks (FSDP2/DDP) and compile it, as configured.

    On one device the whole model is compiled. Under FSDP2/DDP each block is compiled in place after
    checkpointing and before sharding, as torchtitan does (regional compilation: the all-gathers and reduce-scatters
    stay between the compiled blocks; embeddings, head and loss run eager). The optimizer is made last, over the
    parameters as the parallel wrapper left them (FSDP2 shards them).
    """
    w = build_workload(req.spec)
    info = apply_checkpointing(w) or {}
    model = w.model
    compiled = req.config.spec.compiled
    if compiled:
        info["compile_backend"] = req.compile_backend
    if req.dist is not None:
        blocks = find_blocks(w)
        if compiled:
            for block in blocks:
                block.compile(backend=req.compile_backend)
            info["compiled"] = "per block"
        model = req.dist.wrap(w, blocks)
    else:
        w.to(req.dev)
        if compiled:
            model = torch.compile(model, backend=req.compile_backend)
    opt = ready_optimizer(w)
    return Prepared(eager_step(req.spec, req.dev, model, opt, w.batch, w.loss_fn), w.model, opt, w.batch, info)


def prepare_captured(req: Request) -> Prepared:
    from acstudio.capture import capture_step

    spec = req.spec
    w, opt = load(spec, req.dev)
    step = capture_step(w.model, opt, w.batch, w.loss_fn,
                        autocast_dtype=torch.bfloat16 if spec.precision == "bf16" else None)
    return Prepared(lambda: step.run(w.model, opt, w.batch), w.model, opt, w.batch,
                    {"graph_nodes": len(step.gm.graph.nodes)})


def prepare_rewritten(req: Request) -> Prepared:
    """The captured step rewritten by a mu-TWO plan at ``budget`` (e.g. ``60%`` or ``8GiB``).

    The whole profile -> plan -> rewrite pipeline lives here so that API changes touch one function. The
    profile comes from ``profile_path``, where the planning worker (:func:`profile_once`) measured and cached it
    for every budget at the same batch size. The rewritten graph is rebuilt from the profile's own serialized graph, so
    its node ids are the ones the plan refers to.
    """
    from acstudio.capture.serialize import deserialize_step
    from acstudio.plan.solvers import plan as plan_budget
    from acstudio.rewrite.rewriter import rewrite
    from acstudio.units import parse_budget

    spec, dev = req.spec, req.dev
    profile = cached_profile(spec, dev, req.profile_path)
    budget_bytes = parse_budget(req.budget or req.config.arg or "", profile.peak_bytes)
    plan = plan_budget(profile, with_headroom(budget_bytes))
    step = rewrite(deserialize_step(profile.graph, device=str(dev)), profile, plan)
    w, opt = load(spec, dev)
    info = {"budget_bytes": int(budget_bytes), "profile_peak_bytes": profile.peak_bytes,
            "profile_iteration_ms": profile.iteration_ms, "graph_nodes": len(step.gm.graph.nodes),
            "plan": scalar_fields(plan), "recomputed_activations": len(getattr(plan, "recomputed", ()))}
    return Prepared(lambda: step.run(w.model, opt, w.batch), w.model, opt, w.batch, info)


# A planned row must fit under its budget, measured. The simulator predicts the peak to within a small fraction of
# it; what it cannot see (a library workspace, allocator rounding the profile did not record) comes on top, so the
# plan aims that much below the budget.
HEADROOM = 0.0005
# A compiled plan's peak is calibrated on two measured compiled steps (acstudio.plan.compiled); between them the
# partitioner's own choices move it by more: on BERT seq 2048 two recompute sets predicted at the same peak, three
# 384 MiB MLP outputs against twelve 96 MiB attention projections, measured 88 MiB (0.4%) apart, and the second
# went 37 MiB over a budget planned with HEADROOM (results/superseded/grid-bert-s2048.compiled-eager-headroom.json).
COMPILED_HEADROOM = 0.005


def with_headroom(budget_bytes: int, share: float = HEADROOM) -> int:
    """The budget a bench row plans for: ``share`` of it below the budget it must fit."""
    return int(budget_bytes * (1 - share))


def cached_profile(spec: WorkloadSpec, dev: torch.device, path: str | None):
    """Profile ``spec`` on ``dev``, or reuse a profile file of exactly this workload and device type."""
    from acstudio.profile.model import Profile
    from acstudio.profiler import free_device_memory, profile_workload

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


def checkpoint_forward(module: torch.nn.Module, context_fn: Callable | None = None) -> None:
    """Run ``module`` under non-reentrant ``torch.utils.checkpoint`` (selective with ``context_fn``); its
    parameter names stay unchanged."""
    forward = module.forward
    extra = {} if context_fn is None else {"context_fn": context_fn}

    def checkpointed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)

    module.forward = checkpointed


def find_blocks(workload: Workload) -> list[torch.nn.Module]:
    """The repeated blocks practitioners checkpoint and shard one by one.

    Hugging Face models: their gradient-checkpointing layers (the transformer layers). torchvision ResNets:
    every BasicBlock/Bottleneck of layer1..layer4; other torchvision models: every child of the main
    ``features`` or ``encoder.layers`` Sequential.
    """
    model = workload.model
    if workload.family == "transformers":
        from transformers.modeling_layers import GradientCheckpointingLayer

        blocks = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
        if not blocks:
            raise ACStudioError(f"{workload.spec.model} has no gradient-checkpointing layers to treat as blocks")
        return blocks
    if workload.family != "torchvision":
        raise ACStudioError("per-block checkpointing and sharding need a torchvision or transformers model, "
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
    return blocks


def enable_per_block(workload: Workload, context_fn: Callable | None = None, in_forward: bool = False) -> int:
    """Checkpoint every block the way practitioners do (Hugging Face: its own ``activation_checkpointing_enable``,
    ``gradient_checkpointing_enable`` in older releases); with ``context_fn`` as selective
    checkpointing. Returns how many blocks are checkpointed.

    ``in_forward``: checkpoint each block's forward here, for a block compiled on its own. Transformers 5.24 puts
    the checkpoint there, and torchtitan compiles a block after wrapping it, both so that the checkpoint compiles
    with the block. Transformers 5.17 (the H200 image's) checkpoints a layer's ``__call__``, which a block compiled
    alone (``block.compile()``, or Dynamo under a model whose loop runs eager) leaves out: the checkpoint then runs
    eagerly around the compiled graph."""
    blocks = find_blocks(workload)
    if workload.family == "transformers" and not in_forward:
        kwargs = {"use_reentrant": False} | ({} if context_fn is None else {"context_fn": context_fn})
        model = workload.model
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        for block in blocks:
            checkpoint_forward(block, context_fn)
    return len(blocks)


def _aten_ops(*names: str) -> frozenset:
    """The default overloads of the named aten ops this torch build has (the SDPA variants vary by version)."""
    return frozenset(getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n))


# torchtitan's op-level policy: matmul outputs (every second one recomputed) and attention outputs are saved; the
# planner's per-op set names the same ops.
PER_OP_MATMULS = _aten_ops(*baselines.PER_OP_MATMULS)
PER_OP_ATTENTION = _aten_ops(*baselines.PER_OP_ATTENTION)


def per_op_policy() -> Callable:
    """torchtitan's selective-checkpoint policy for one checkpointed block call.

    MUST_SAVE the attention outputs and every odd-numbered matmul (mm/addmm/bmm, counted separately in the
    forward and in the recomputation, so both agree), PREFER_RECOMPUTE everything else.
    """
    from torch.utils.checkpoint import CheckpointPolicy

    counts = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs):
        if func in PER_OP_MATMULS:
            mode = "recompute" if ctx.is_recompute else "forward"
            counts[mode] += 1
            return CheckpointPolicy.MUST_SAVE if counts[mode] % 2 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in PER_OP_ATTENTION else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def per_op_context():
    """``context_fn`` of a per-op checkpoint: a fresh policy (fresh matmul counts) for every block call."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(per_op_policy())


def prepare_sac(req: Request) -> Prepared:
    """Our plan, exported as selective-checkpoint policies by :func:`export_sac_plan` in a process of its own,
    applied to the model (:func:`acstudio.apply_plan`) and run like any model step: eager or compiled, on one
    device or sharded (every rank applies the same export)."""
    import acstudio

    plan_dir = sac_plan_dir(req)
    try:
        info = json.loads((plan_dir / PLAN_SUMMARY).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise ACStudioError(f"{plan_dir} holds no exported plan — a sac configuration is planned first "
                            "(`acstudio bench` runs the worker with task \"plan\")") from None

    def apply(workload: Workload) -> dict[str, Any]:
        workload.model = acstudio.apply_plan(workload.model, plan_dir, compile_options={"backend": req.compile_backend})
        return info

    return model_step(req, apply)


PLAN_SUMMARY = "bench_plan.json"  # the plan's summary for the result row, beside the exported policy


def sac_plan_dir(req: Request) -> Path:
    """Where a sac configuration's plan is exported: beside the cached profile, named by budget, parallelism and
    whether it is planned for torch.compile (an eager and a compiled row of one budget plan differently), so the
    planning process and every rank find the same folder."""
    if not req.profile_path:
        raise ACStudioError("a sac configuration needs a profile path (the plan is exported beside it)")
    path = Path(req.profile_path)
    parallel = f"{req.config.parallel}{req.nproc}" if req.config.parallel else "single"
    form = "_compiled" if req.config.spec.compiled else ""
    slug = "".join(c if c.isalnum() or c == "." else "_" for c in f"{req.budget or req.config.arg}_{parallel}{form}")
    return path.parent / f"{path.name.partition('.')[0]}_sac_{slug}"


def profile_once(req: Request) -> dict[str, Any]:
    """Planning step of a rewritten configuration: the profile, measured here and cached for the measuring
    process."""
    cached_profile(req.spec, req.dev, req.profile_path)
    return {}


def export_sac_plan(req: Request) -> dict[str, Any]:
    """Planning step of a sac configuration: profile (cached), plan for SAC's replay mode at the resolved budget
    and export the policy (``--format sac``) and the plan's summary into :func:`sac_plan_dir`.

    Under FSDP2/DDP ``req.spec`` is one rank's batch, whose single-device profile is turned into each rank's
    (:func:`acstudio.simulate.sharding.per_rank_profile`).
    """
    from acstudio.export import export
    from acstudio.fileio import write_text
    from acstudio.plan import plan as make_plan
    from acstudio.units import parse_budget

    profile = cached_profile(req.spec, req.dev, req.profile_path)
    if req.config.parallel is not None:
        from acstudio.simulate.sharding import per_rank_profile

        profile = per_rank_profile(profile, req.nproc, req.config.parallel)
    budget_bytes = parse_budget(req.budget or req.config.arg or "", profile.peak_bytes)
    summary: dict[str, Any] = {}
    if req.config.spec.compiled and req.compiled_per_block_peak:
        from acstudio.plan.compiled import CompiledTimes

        measured = parse_budget(req.compiled_per_block_peak, profile.peak_bytes)
        times = CompiledTimes.parse(req.compiled_step_ms) if req.compiled_step_ms else None
        if times is not None:
            times = dataclasses.replace(times, regions_bias=req.regions_bias, compile_host_ms=req.compile_host_ms)
        per_op = parse_budget(req.compiled_per_op_peak, profile.peak_bytes) if req.compiled_per_op_peak else None
        plan = compiled_plan(profile, budget_bytes, measured, per_op, times, one_device=req.config.parallel is None)
        summary["compiled_peak_bytes"] = plan.compiled_peak_bytes
        if plan.region_fetches:
            summary["region_fetches"] = plan.region_fetches
    else:  # eager, or compiled without a calibration: the eager prediction (compile keeps less)
        plan = make_plan(profile, with_headroom(budget_bytes), mode="sac")
    plan_dir = sac_plan_dir(req)
    export(profile, plan, plan_dir, formats=["sac"])
    info = {"budget_bytes": int(budget_bytes), "profile_peak_bytes": profile.peak_bytes,
            "profile_iteration_ms": profile.iteration_ms, "plan": scalar_fields(plan) | summary,
            "recomputed_activations": len(plan.recomputed)}
    write_text(plan_dir / PLAN_SUMMARY, json.dumps(info))
    return info


def compiled_plan(profile, budget_bytes: int, per_block_peak: int, per_op_peak: int | None, times,
                  one_device: bool):
    """The plan a ``sac+compile`` row runs at ``budget_bytes``: calibrated on compile+per-block's measured peak
    (and compile+per-op's, and their step times against compile's: a
    :class:`~acstudio.plan.compiled.CompiledTimes`), planned :data:`COMPILED_HEADROOM` below the budget. On one
    device its blocks may run compiled one by one and offload what they save (``acstudio.apply_plan``)."""
    from acstudio.plan.compiled import plan_compiled
    from acstudio.plan.schedule import PlanContext

    return plan_compiled(PlanContext(profile, offload=one_device), with_headroom(budget_bytes, COMPILED_HEADROOM),
                         per_block_peak, times=times, measured_per_op_peak=per_op_peak, measured_budget=budget_bytes)


def prepare(req: Request) -> Prepared:
    """Build ``req.config`` with its registered builder (:data:`acstudio.bench.configs.KINDS`)."""
    return globals()[req.config.spec.builder](req)


def plan_ahead(req: Request) -> dict[str, Any]:
    """Run ``req.config``'s planning step (:attr:`acstudio.bench.configs.Kind.planner`); returns its summary."""
    return globals()[req.config.spec.planner](req)
