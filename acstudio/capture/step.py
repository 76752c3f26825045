"""``CapturedStep``: the traced whole-iteration graph plus how to feed it from a model and an optimizer.

The graph is a pure function of flat inputs (parameters, buffers, optimizer state, batch, optimizer
hyperparameters) that *mutates* its parameter, buffer and optimizer-state inputs in place, exactly as
``optimizer.step()`` and BatchNorm do eagerly, and returns ``[loss, *gradients]``. Every node carries
``meta["ac_id"]`` (stable id) and ``meta["ac_region"]`` (forward, loss, backward, optimizer).

The optimizer's numeric hyperparameters (learning rate, betas, eps, momentum, dampening, weight decay) are graph
inputs, read from ``optimizer.param_groups`` every time the step runs (:meth:`CapturedStep.flat_inputs`), so an
LR scheduler drives the captured step as it drives ``optimizer.step()``. What the graph cannot follow is
recorded in :class:`OptimizerRecord`: the optimizer type, which parameters each group holds, the boolean
switches (nesterov, amsgrad, maximize, ...) and the branches torch.optim took on the values (e.g. "weight decay
is zero", so the decay term is not in the graph).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from acstudio.errors import ACStudioError

# The numeric settings each supported optimizer's update reads at every step; they become graph inputs.
HYPERPARAMETERS = {
    "SGD": ("lr", "momentum", "dampening", "weight_decay"),
    "Adam": ("lr", "beta1", "beta2", "eps", "weight_decay"),
    "AdamW": ("lr", "beta1", "beta2", "eps", "weight_decay"),
}
# Settings that choose an implementation, not the update rule the graph computes: never compared.
IMPLEMENTATION_FLAGS = {"foreach", "fused", "capturable", "differentiable"}
# How a traced branch on a hyperparameter is written down, and how it is checked.
CONDITION_OPS = {"==": operator.eq, "!=": operator.ne, ">=": operator.ge, ">": operator.gt,
                 "<=": operator.le, "<": operator.lt}


def hyper_key(key: str) -> tuple[int, str]:
    """``"0/lr"`` -> ``(0, "lr")``: the param group index and hyperparameter name of a ``hyper`` input."""
    g, _, name = key.partition("/")
    return int(g), name


def group_value(group: dict, name: str) -> float:
    """Hyperparameter ``name`` of a param group as a Python number (``beta1``/``beta2`` live in ``betas``)."""
    if name in ("beta1", "beta2"):
        return float(group["betas"][name == "beta2"])
    return float(group[name])


def set_group_value(group: dict, name: str, value: Any) -> None:
    if name in ("beta1", "beta2"):
        betas = list(group["betas"])
        betas[name == "beta2"] = value
        group["betas"] = tuple(betas)
    else:
        group[name] = value


def prepare_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Give a live optimizer the state a captured graph reads, equal to what a fresh optimizer starts from.

    The one way to get an optimizer ready for a captured, rewritten or exported graph (:func:`capture_step`,
    :func:`acstudio.load_step`, ``acstudio verify`` and the bench all call it). The graph takes the optimizer's
    state as inputs, and torch.optim makes that state lazily in its first ``step()``. A zero-gradient step makes
    it with the optimizer's own code (moments and momentum buffers zero, parameters restored afterwards because
    decoupled weight decay would still move them); the step counters it advanced are set back to zero, so the
    graph's first update uses the bias correction of a fresh optimizer's first ``step()``. Frozen parameters
    (``requires_grad=False``) get no state, as eagerly. An optimizer that has already stepped is left as it is.
    """
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    filled = [bool(optimizer.state.get(p)) for p in params]
    if all(filled):
        return
    if any(filled):
        raise ACStudioError("the optimizer has state for some parameters only; pass a fresh optimizer or one that "
                            "has already stepped all of its trainable parameters")
    every = [p for g in optimizer.param_groups for p in g["params"]]
    saved = [p.detach().clone() for p in params]
    old_grads = [p.grad for p in every]
    for p in every:
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    try:
        optimizer.step()
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
            for p, g in zip(every, old_grads):
                p.grad = g
            for p in params:
                step = optimizer.state.get(p, {}).get("step")
                if isinstance(step, torch.Tensor):
                    step.zero_()


def switches(group: dict) -> dict[str, bool]:
    """The boolean settings of a param group that change the update rule (nesterov, amsgrad, maximize, ...)."""
    return {k: v for k, v in group.items() if isinstance(v, bool) and k not in IMPLEMENTATION_FLAGS}


def module_settings(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """What a captured graph bakes in from each module besides its tensors: the training flag (dropout draws or not,
    BatchNorm normalizes with batch or running statistics) and the float settings that become graph constants
    (dropout ``p``, an attention module's dropout probability and scaling, normalization ``eps`` and ``momentum``).
    Keyed by module path (``""`` is the root)."""
    return {name: {"training": m.training} | {k: v for k, v in vars(m).items()
                                              if isinstance(v, float) and math.isfinite(v) and not k.startswith("_")}
            for name, m in model.named_modules()}


@dataclass
class OptimizerRecord:
    """What a captured step needs from the optimizer that drives it, beyond the hyperparameter values it reads.

    ``groups[g]`` holds the parameters (FQNs) of param group ``g``, its switches, whether it was capturable
    (torch.optim's capturable formulas round differently; absent in exports made before it was recorded) and the
    hyperparameter values at capture (for reports only). ``conditions`` are ``(input key, op, value)`` triples such as
    ``("0/weight_decay", "==", 0.0)``: the branches torch.optim's code took on hyperparameter values while it
    was traced; other values would need another graph.
    """

    type: str
    groups: list[dict[str, Any]]
    conditions: list[tuple[str, str, float]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "groups": self.groups, "conditions": [list(c) for c in self.conditions]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OptimizerRecord:
        return cls(type=d["type"], groups=list(d["groups"]),
                   conditions=[(str(k), str(op), float(v)) for k, op, v in d.get("conditions", ())])

    def problems(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
        """Why an optimizer of type ``self.type`` cannot drive this step (empty if it can): its param groups,
        switches or hyperparameter values outside the traced branches."""
        if len(optimizer.param_groups) != len(self.groups):
            return [f"the step was captured with {len(self.groups)} param group(s), the optimizer has "
                    f"{len(optimizer.param_groups)}"]
        fqn_of = {id(p): n for n, p in model.named_parameters()}
        out = []
        for g, (group, recorded) in enumerate(zip(optimizer.param_groups, self.groups)):
            held = {fqn_of.get(id(p), "(a tensor that is not a model parameter)") for p in group["params"]}
            missing = [n for n in recorded["params"] if n not in held]
            extra = sorted(held - set(recorded["params"]))
            if missing:
                out.append(f"param group {g} does not update parameter {missing[0]}")
            if extra:
                out.append(f"param group {g} updates {extra[0]}, which the step does not")
            out += [f"param group {g} has {k}={group.get(k)!r}, the step was captured with {k}={v!r}"
                    for k, v in recorded["switches"].items() if group.get(k) != v]
            if "capturable" in recorded and bool(group.get("capturable")) != recorded["capturable"]:
                out.append(f"param group {g} has capturable={bool(group.get('capturable'))!r}, the step was "
                           f"captured with capturable={recorded['capturable']!r} (another update formula); "
                           "profile again with this optimizer")
        if not out:
            out += self.violated(optimizer)
        return out

    def violated(self, optimizer: torch.optim.Optimizer) -> list[str]:
        """The recorded branch conditions that the optimizer's current hyperparameters break."""
        out = []
        for key, op, value in self.conditions:
            g, name = hyper_key(key)
            now = group_value(optimizer.param_groups[g], name)
            if not CONDITION_OPS[op](now, value):
                out.append(f"param group {g} has {name}={now!r}, but torch.optim's update was traced for "
                           f"{name} {op} {value!r} and takes another branch otherwise; profile and export again "
                           f"with {name}={now!r}")
        return out


@dataclass(frozen=True)
class InputSlot:
    """What a graph placeholder stands for: ``kind`` is param, buffer, opt_state, batch or hyper."""

    kind: str
    # parameter/buffer FQN, "FQN/state_name" for optimizer state, leaf index for the batch, "GROUP/NAME" for a
    # hyperparameter (e.g. "0/lr", "0/beta1")
    key: str


@dataclass
class CapturedStep:
    gm: fx.GraphModule
    inputs: list[InputSlot]
    grad_params: list[str]  # FQNs of the parameters whose gradients the graph returns, in output order
    # None for steps captured before hyperparameters were graph inputs: their values are constants in the graph
    optimizer: OptimizerRecord | None = None

    def flat_inputs(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Any) -> list:
        """The graph's inputs taken from live objects (no copies: the step updates them in place).

        This is the one place that feeds a captured, rewritten or exported graph: hyperparameters are read from
        ``optimizer.param_groups`` now, so every call follows the optimizer's current settings.
        """
        params = dict(model.named_parameters())
        buffers = dict(model.named_buffers())
        leaves = pytree.tree_leaves(batch)
        flat = []
        for slot in self.inputs:
            if slot.kind == "param":
                flat.append(params[slot.key].detach())
            elif slot.kind == "buffer":
                flat.append(buffers[slot.key])
            elif slot.kind == "opt_state":
                fqn, _, name = slot.key.rpartition("/")
                flat.append(optimizer.state[params[fqn]][name])
            elif slot.kind == "batch":
                flat.append(leaves[int(slot.key)])
            elif slot.kind == "hyper":
                g, name = hyper_key(slot.key)
                flat.append(group_value(optimizer.param_groups[g], name))
            else:  # pragma: no cover - slots are only made by the tracer
                raise ACStudioError(f"unknown input slot {slot}")
        return flat

    def run(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        """One training iteration through the graph; sets ``.grad`` like eager backward and returns the loss.

        Old gradients are dropped first, as ``optimizer.zero_grad(set_to_none=True)`` would, so they do not
        occupy memory while the next step runs. The loss is returned detached, as the graph computed it.
        """
        for p in model.parameters():
            p.grad = None
        with torch.no_grad():
            loss, *grads = self.gm(*self.flat_inputs(model, optimizer, batch))
        params = dict(model.named_parameters())
        for fqn, g in zip(self.grad_params, grads):
            params[fqn].grad = g
        return loss
