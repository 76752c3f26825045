"""``CapturedStep``: the traced whole-iteration graph plus how to feed it from a model and an optimizer.

The graph is a pure function of flat tensors (parameters, buffers, optimizer state, batch) that *mutates*
its parameter, buffer and optimizer-state inputs in place, exactly as ``optimizer.step()`` and BatchNorm do
eagerly, and returns ``[loss, *gradients]``. Every node carries ``meta["ac_id"]`` (stable id) and
``meta["ac_region"]`` (forward, loss, backward, optimizer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from acstudio.errors import ACStudioError


@dataclass(frozen=True)
class InputSlot:
    """What a graph placeholder stands for: ``kind`` is param, buffer, opt_state or batch."""

    kind: str
    key: str  # parameter/buffer FQN, "FQN/state_name" for optimizer state, leaf index for the batch


@dataclass
class CapturedStep:
    gm: fx.GraphModule
    inputs: list[InputSlot]
    grad_params: list[str]  # FQNs of the parameters whose gradients the graph returns, in output order

    def nodes_by_id(self) -> dict[str, fx.Node]:
        return {n.meta["ac_id"]: n for n in self.gm.graph.nodes}

    def flat_inputs(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Any) -> list:
        """The graph's inputs taken from live objects (no copies: the step updates them in place)."""
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
            else:  # pragma: no cover - slots are only made by the tracer
                raise ACStudioError(f"unknown input slot {slot}")
        return flat

    def run(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        """One training iteration through the graph; sets ``.grad`` like eager backward and returns the loss.

        Old gradients are dropped first, as ``optimizer.zero_grad(set_to_none=True)`` would, so they do not
        occupy memory while the next step runs.
        """
        for p in model.parameters():
            p.grad = None
        with torch.no_grad():
            loss, *grads = self.gm(*self.flat_inputs(model, optimizer, batch))
        params = dict(model.named_parameters())
        for fqn, g in zip(self.grad_params, grads):
            params[fqn].grad = g
        return loss
