"""Static analysis of the captured graph: storages, tensor categories, activation lifetimes, replay safety.

Works on the fake values recorded while tracing (``node.meta["val"]``), so it costs no device memory. Tensors
are grouped by *storage*: a view, a ``getitem`` of a multi-output op or an in-place op's result is an alias of
the storage it lives in and never counted twice. A storage is named after the node that allocated it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from acstudio.capture.step import CapturedStep
from acstudio.profile.model import ActivationRecord, NodeRecord, TensorRecord
from acstudio.profile.ops import target_name
from acstudio.profile.replay_rules import BATCH_NORM_OPS, blocked_reason, random_verdict

SLOT_CATEGORY = {"param": "parameter", "buffer": "buffer", "opt_state": "optimizer_state", "batch": "input"}
HOST_SYNC_OPS = {"aten._local_scalar_dense.default", "aten.item.default"}


def allocation_bytes(nbytes: int, device_type: str) -> int:
    """Bytes the allocator really charges: the CUDA caching allocator rounds every block up to 512 B."""
    if device_type == "cuda":
        return max(512, (nbytes + 511) // 512 * 512) if nbytes else 0
    return nbytes


def tensor_outputs(val) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [v for v in val if isinstance(v, torch.Tensor)]
    return []


def written_args(node: fx.Node) -> list[fx.Node]:
    """Input nodes that ``node`` mutates in place, from the op schema's alias annotations."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return []
    out = []
    for i, arg in enumerate(target._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        values = value if isinstance(value, (list, tuple)) else [value]
        out += [v for v in values if isinstance(v, fx.Node)]
    return out


@dataclass
class GraphAnalysis:
    """The static part of a profile; the profiler adds measurements to ``nodes`` and inactive times."""

    nodes: list[NodeRecord]
    tensors: list[TensorRecord]
    activations: list[ActivationRecord]
    # storage id -> indices of the nodes whose outputs alias it
    alias_nodes: dict[str, list[int]] = field(default_factory=dict)
    # storage id -> (created index, last-needed index or None if it lives to the end)
    live_range: dict[str, tuple[int, int | None]] = field(default_factory=dict)

    def live_bytes_after(self) -> list[int]:
        """Bytes of storages alive after each node, by the same free-after-last-use rule as FX codegen."""
        size = {t.id: t.bytes for t in self.tensors}
        return bytes_alive(((start, end, size[sid]) for sid, (start, end) in self.live_range.items()),
                           len(self.nodes))


def bytes_alive(spans, n: int) -> list[int]:
    """Bytes alive at each of ``n`` positions for ``(start, last, nbytes)`` spans (``last`` None: to the end)."""
    delta = [0] * (n + 1)
    for start, last, nbytes in spans:
        delta[start] += nbytes
        if last is not None:
            delta[last + 1] -= nbytes
    out, running = [], 0
    for i in range(n):
        running += delta[i]
        out.append(running)
    return out


def analyze(step: CapturedStep, device_type: str) -> GraphAnalysis:
    graph_nodes = list(step.gm.graph.nodes)
    index = {node: i for i, node in enumerate(graph_nodes)}
    ids = [node.meta["ac_id"] for node in graph_nodes]
    regions = [node.meta["ac_region"] for node in graph_nodes]
    placeholders = [n for n in graph_nodes if n.op == "placeholder"]
    slot_of = dict(zip(placeholders, step.inputs))

    storage_key_to_id: dict[StorageWeakRef, str] = {}
    storage_bytes: dict[str, int] = {}
    node_storages: list[list[str]] = []
    new_bytes: list[int] = []
    for i, node in enumerate(graph_nodes):
        sids, fresh = [], 0
        for t in tensor_outputs(node.meta.get("val")):
            key = StorageWeakRef(t.untyped_storage())
            sid = storage_key_to_id.get(key)
            if sid is None:
                sid = storage_key_to_id[key] = ids[i]
                nbytes = allocation_bytes(t.untyped_storage().nbytes(), device_type)
                # A multi-output op allocates several storages; they are told apart by position.
                if sid in storage_bytes:
                    sid = storage_key_to_id[key] = f"{ids[i]}.{len(sids)}"
                storage_bytes[sid] = nbytes
                fresh += nbytes
            sids.append(sid)
        node_storages.append(sids)
        new_bytes.append(fresh)

    alias_nodes: dict[str, list[int]] = {}
    for i, sids in enumerate(node_storages):
        for sid in dict.fromkeys(sids):
            alias_nodes.setdefault(sid, []).append(i)

    output_node = graph_nodes[-1]
    output_storages = {sid for a in output_node.all_input_nodes for sid in node_storages[index[a]]}
    loss_storages = set(node_storages[index[output_node.args[0][0]]]) if output_node.args[0] else set()

    def users_of(i: int) -> list[int]:
        return [index[u] for u in graph_nodes[i].users if u.op != "output"]

    tensors: list[TensorRecord] = []
    live_range: dict[str, tuple[int, int | None]] = {}
    uses: dict[str, list[int]] = {}
    for sid, holders in alias_nodes.items():
        created = holders[0]
        u = sorted({j for h in holders for j in [h, *users_of(h)]})
        uses[sid] = u
        creator = graph_nodes[created]
        if creator.op == "placeholder":
            category = SLOT_CATEGORY[slot_of[creator].kind]
            end = None
        elif creator.op == "get_attr":  # a constant the graph module holds
            category = "buffer"
            end = None
        elif sid in output_storages:
            category = "temporary" if sid in loss_storages else "gradient"
            end = None
        else:
            in_fw = regions[created] in ("forward", "loss")
            used_in_bw = any(regions[j] == "backward" for j in u)
            category = "activation" if in_fw and used_in_bw else "temporary"
            end = u[-1]
        live_range[sid] = (created, end)
        tensors.append(TensorRecord(
            id=sid, bytes=storage_bytes[sid], category=category, created_at=ids[created],
            freed_after="" if end is None else ids[end], aliases=[ids[h] for h in holders[1:]]))

    state_storages = {sid for p in placeholders for sid in node_storages[index[p]]}
    replay = [replay_reason(node, regions[i], state_storages, node_storages, index)
              for i, node in enumerate(graph_nodes)]

    nodes = []
    for i, node in enumerate(graph_nodes):
        nodes.append(NodeRecord(
            id=ids[i], name=node.name, op=node.op, target=target_name(node.target), region=regions[i],
            module=node.meta.get("ac_module", ""), inputs=[a.meta["ac_id"] for a in node.all_input_nodes],
            shape=node.meta["ac_shape"], dtype=node.meta["ac_dtype"],
            storage=node_storages[i][0] if node_storages[i] else "",
            new_bytes=new_bytes[i], replay=replay[i]))

    activations = []
    for t in tensors:
        if t.category != "activation":
            continue
        u = uses[t.id]
        fw = [j for j in u if regions[j] in ("forward", "loss")]
        bw = [j for j in u if regions[j] == "backward"]
        holders = alias_nodes[t.id]
        reason = blocked_reason(t.id, [(ids[h], regions[h], replay[h]) for h in holders],
                                target_name(graph_nodes[holders[0]].target), keep_random=False)
        activations.append(ActivationRecord(
            id=t.id, bytes=t.bytes, created_at=t.created_at, last_fw_use=ids[fw[-1]],
            first_bw_use=ids[bw[0]], last_bw_use=ids[bw[-1]], inactive_time_ms=0.0,
            recomputable=not reason, reason=reason))
    return GraphAnalysis(nodes=nodes, tensors=tensors, activations=activations, alias_nodes=alias_nodes,
                         live_range=live_range)


def replay_reason(node: fx.Node, region: str, state_storages: set[str], node_storages, index) -> str:
    """``"ok"`` if re-executing ``node`` in backward is safe, else why not (random ops by the default rule: see
    :func:`replay_rules` for ``keep_random``)."""
    if node.op == "placeholder":
        return "placeholder (always resident)"
    if node.op == "get_attr":
        return "ok"  # a constant held by the graph module: re-reading it is free

    if node.op != "call_function":
        return node.op
    if region not in ("forward", "loss"):
        return f"{region} op"
    name = target_name(node.target)
    random = random_verdict(node.target, node.args, node.kwargs, bool(node.all_input_nodes), keep_random=False)
    if random is not None and random != "ok":
        return random
    if name in HOST_SYNC_OPS:
        return "host synchronisation"
    for arg in written_args(node):
        if any(s in state_storages for s in node_storages[index[arg]]):
            if name in BATCH_NORM_OPS:
                continue  # replayed without updating running statistics
            return "mutates graph state (parameter, buffer or input)"
    return "ok"
