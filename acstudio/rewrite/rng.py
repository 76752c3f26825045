"""Random ops in replays: each replayed copy draws with the generator state its forward drew with.

Right before such an op in forward the pass inserts nodes that save the CPU generator state and the states of the
devices of the op's tensor inputs (``torch.get_rng_state`` and ``torch.utils.checkpoint.get_device_states``:
CUDA's Philox seed and offset); each replayed copy is bracketed by nodes that save the current states, set the
saved ones, and restore the current ones right after the op, so whatever draws later in the step is unaffected.
This is what ``torch.utils.checkpoint(preserve_rng_state=True)`` does for a whole region, done per op. It was
chosen over the ``run_and_save_rng_state`` / ``run_with_rng_state`` higher-order ops (torch/_prims/rng_prims.py,
what AOTAutograd's RNG functionalization inserts) because those replace the forward op by a HOP returning
``(state, output)``: the captured node would change its output, and every consumer and storage keyed by its id
with it, while the get/set nodes leave every captured node as it is (one graph, stable ids, original kernels and
masks) and generate plain torch calls, so exported steps still need torch alone; the HOPs are also private API
that moved between torch releases.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.utils.checkpoint import get_device_states, set_device_states

from acstudio.rewrite.passes import RewriteContext
from acstudio.simulate.replay import RNG_STATE_BYTES


class RestoreRngState:
    """Brackets every replayed random op (in the order the replays made them) with its forward's generator state."""

    name = "restore_rng_state"

    def __init__(self) -> None:
        self.saved: dict[fx.Node, tuple[fx.Node, fx.Node, fx.Node]] = {}

    def requires(self, gm: fx.GraphModule, ctx: RewriteContext) -> None:
        pass

    def call(self, gm: fx.GraphModule, ctx: RewriteContext) -> bool:
        state_bytes = RNG_STATE_BYTES.get(ctx.profile.environment.get("device_type", "cpu"), 16)
        for original, copy, like in ctx.random_copies:
            self.bracket(gm.graph, original, copy, like, state_bytes)
        return bool(ctx.random_copies)

    def ensures(self, gm: fx.GraphModule, ctx: RewriteContext) -> None:
        for original, copy, _ in ctx.random_copies:
            if copy.prev.target is not set_device_states or copy.next.target is not torch.set_rng_state:
                raise AssertionError(f"replayed random op {copy.meta['ac_id']} does not draw with the state "
                                     f"{original.meta['ac_id']} drew with")

    def bracket(self, graph: fx.Graph, original: fx.Node, copy: fx.Node, like: fx.Node, state_bytes: int) -> None:
        """Make ``copy`` (reading ``like`` as the original's first input) draw with ``original``'s saved states,
        then put the current ones back."""
        cpu, devices, states = self.saved_state(graph, original, state_bytes)
        base = copy.meta["ac_id"]
        owner = copy.meta["ac_of"]
        with graph.inserting_before(copy):
            now_cpu, now_devices, now_states = state_nodes(graph, like, f"{base}.rng_now", owner)
            rng_node(graph, torch.set_rng_state, (cpu,), f"{base}.rng_set", owner)
            rng_node(graph, set_device_states, (devices, states), f"{base}.rng_set_devices", owner)
        with graph.inserting_before(copy.next):
            rng_node(graph, torch.set_rng_state, (now_cpu,), f"{base}.rng_restore", owner)
            rng_node(graph, set_device_states, (now_devices, now_states), f"{base}.rng_restore_devices", owner)

    def saved_state(self, graph: fx.Graph, n: fx.Node, state_bytes: int) -> tuple[fx.Node, fx.Node, fx.Node]:
        """The nodes holding the generator states random op ``n`` drew with, saved right before it in forward
        (once, however often it is replayed); the CPU state carries the saved state's bytes for the accounting."""
        if n not in self.saved:
            orig = n.meta["ac_id"]
            with graph.inserting_before(n):
                saved = state_nodes(graph, n.all_input_nodes[0], f"{orig}@rng", None)
            saved[0].meta.update(ac_storages=[f"{orig}@rng"], ac_sizes={f"{orig}@rng": state_bytes})
            self.saved[n] = saved
        return self.saved[n]


def state_nodes(graph: fx.Graph, like: fx.Node, name: str, owner: str | None) -> tuple[fx.Node, fx.Node, fx.Node]:
    """Nodes reading the CPU generator state and (device ids, states) of the devices ``like`` lives on."""
    cpu = rng_node(graph, torch.get_rng_state, (), f"{name}.cpu", owner)
    devices = rng_node(graph, get_device_states, (like,), f"{name}.devices", owner)
    return (cpu, rng_node(graph, operator.getitem, (devices, 0), f"{name}.ids", owner),
            rng_node(graph, operator.getitem, (devices, 1), f"{name}.states", owner))


def rng_node(graph: fx.Graph, target, args: tuple, ac_id: str, owner: str | None) -> fx.Node:
    """A generator-state node: in forward (``owner`` None: a saved state) or in ``owner``'s replay."""
    node = graph.call_function(target, args)
    node.meta.update(ac_id=ac_id, ac_role="rng", ac_region="forward" if owner is None else "backward",
                     ac_storages=[], ac_shape="", ac_dtype="")
    if owner is not None:
        node.meta["ac_of"] = owner
    return node
