"""How much memory a workload needs at least, found before anything real is allocated.

The model and batch are built on the ``meta`` device (shapes, no storage) and one forward pass runs there
under :func:`torch.autograd.graph.saved_tensors_hooks`, which sees every tensor autograd keeps for the backward
pass. With parameters, gradients, optimizer state and the batch that is a lower bound of the step's peak, so a
workload refused here would have failed (or, on the CPU, been killed by the kernel) anyway.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from acstudio.errors import OutOfMemoryError
from acstudio.units import format_bytes
from acstudio.workload.build import build_workload
from acstudio.workload.spec import Workload, WorkloadSpec

# Tensors of optimizer state per trainable parameter, as torch.optim keeps them.
STATE_PER_PARAMETER = {"sgd": 1, "adam": 2, "adamw": 2}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a training step holds at least; ``activations`` are those saved by the forward pass."""

    parameters: int
    gradients: int
    optimizer_state: int
    batch: int
    activations: int

    @property
    def total(self) -> int:
        # Gradients appear as activations are freed, so at least the larger of the two is alive at once.
        return self.parameters + self.optimizer_state + self.batch + max(self.gradients, self.activations)

    def describe(self) -> str:
        parts = (("parameters", self.parameters), ("gradients", self.gradients),
                 ("optimizer state", self.optimizer_state), ("batch", self.batch),
                 ("saved activations", self.activations))
        return ", ".join(f"{name} {format_bytes(n)}" for name, n in parts if n)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def estimate_memory(workload: Workload) -> MemoryEstimate:
    """Count ``workload`` (on ``meta`` for a cheap estimate; saved activations are counted only there)."""
    trainable = [p for p in workload.model.parameters() if p.requires_grad]
    tensors = [*workload.model.parameters(), *workload.model.buffers()]
    weights = sum(_nbytes(t) for t in tensors)
    grads = sum(_nbytes(p) for p in trainable)
    leaves = [t for t in torch.utils._pytree.tree_leaves(workload.batch) if isinstance(t, torch.Tensor)]
    activations = saved_activation_bytes(workload) if all(t.is_meta for t in tensors) else 0
    return MemoryEstimate(parameters=weights, gradients=grads,
                          optimizer_state=STATE_PER_PARAMETER.get(workload.spec.optimizer, 2) * grads,
                          batch=sum(_nbytes(t) for t in leaves), activations=activations)


class _FusedAttention(torch.autograd.Function):
    """What a fused attention kernel keeps for backward: q, k, v and the output (no score matrix)."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        ctx.save_for_backward(q, k, v, out)
        return out

    @staticmethod
    def backward(ctx, grad):  # never run: the estimate needs the forward pass only
        raise NotImplementedError


class _MetaForward(TorchFunctionMode):
    """What a meta forward pass cannot do by itself. Every attention runs its math form there, which saves the
    whole score matrix where a GPU runs a fused kernel: count the fused kernel's tensors, so the estimate stays
    a lower bound. And tensors have no values: a test of one (transformers asks "is the mask all ones?",
    "is the batch packed?") is answered yes, the common case, which does not change what is saved."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            named = [kwargs[k] for k in ("query", "key", "value") if k in (kwargs or {})]
            return _FusedAttention.apply(*[*args, *named][:3])
        if func is torch.Tensor.__bool__ and args[0].is_meta:
            return True
        return func(*args, **(kwargs or {}))


def saved_activation_bytes(workload: Workload) -> int:
    """Bytes of the distinct tensors, other than parameters, that the forward pass saves for backward."""
    params = {t.untyped_storage()._cdata for t in (*workload.model.parameters(), *workload.model.buffers())}
    # Autocast does not act on meta tensors: under bf16 count every float at 2 bytes, the least it can take.
    bf16 = workload.spec.precision == "bf16"
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage()._cdata
        if key not in params:
            nbytes = t.numel() * 2 if bf16 and t.is_floating_point() else _nbytes(t)
            seen[key] = max(seen.get(key, 0), nbytes)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _MetaForward():
        workload.loss_fn(workload.model, workload.batch)
    return sum(seen.values())


def meta_estimate(spec: WorkloadSpec) -> MemoryEstimate | None:
    """The estimate from a ``meta`` build; None for a custom factory or a model whose code cannot run there."""
    if ":" in spec.model:  # the user's factory may load data or call .item(): do not run it twice
        return None
    try:
        with torch.device("meta"):
            workload = build_workload(spec)
        return estimate_memory(workload)
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return None  # code that reads tensor values (regnet's widths) or an op without a meta kernel


def available_bytes(dev: torch.device) -> tuple[int, str] | None:
    """Free memory on ``dev`` and how it is called; None where the platform does not say."""
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return free, f"free on {torch.cuda.get_device_name(dev)}"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "available RAM"
    except OSError:
        pass
    return None


def require_fits(spec: WorkloadSpec, dev: torch.device, estimate: MemoryEstimate) -> None:
    """Refuse, with the numbers, a workload whose lower-bound memory exceeds what ``dev`` has free."""
    have = available_bytes(dev)
    if have is None or estimate.total <= have[0]:
        return
    free, where = have
    fixed = estimate.parameters + estimate.optimizer_state + estimate.gradients
    per_sample = (estimate.batch + estimate.activations) / spec.batch_size
    fits = math.floor((free - fixed) / per_sample) if per_sample and free > fixed else 0
    hint = (f"at most --batch-size {fits} might fit; try that or less" if fits >= 1 else
            "the parameters alone do not fit: choose a smaller model or another device")
    raise OutOfMemoryError(f"{spec.label} needs at least {format_bytes(estimate.total)} ({estimate.describe()}) but "
                           f"{dev.type} has {format_bytes(free)} {where} — {hint}")


def build_fitting(spec: WorkloadSpec, dev: torch.device) -> Workload:
    """Build ``spec`` on the CPU once it is known to fit ``dev``: from a ``meta`` build before anything real
    exists where the model runs there, else (a custom factory, regnet) from the built model's own tensors,
    before it moves or trains."""
    estimate = meta_estimate(spec)
    if estimate is not None:
        require_fits(spec, dev, estimate)
    workload = build_workload(spec)
    if estimate is None:
        require_fits(spec, dev, estimate_memory(workload))
    return workload
