"""One rank's memory under FSDP2 or DDP, predicted from the single-device profile of that rank's batch.

:func:`per_rank_profile` returns a :class:`~acstudio.profile.model.Profile` whose node memory and tensor sizes
are those of one of ``world`` ranks, so the simulator and every solver run on it unchanged. Activations,
the batch and the loss's temporaries are the same as on one device (the profile is of one rank's batch).

FSDP2 (``fully_shard`` on every repeated block, then on the root; torch's defaults):

* parameters, gradients and optimizer state are sharded on dim 0: each rank keeps ``ceil(d0 / N)`` rows;
  0-d tensors (Adam's ``step``) stay whole;
* in a block's forward its parameters are all-gathered (unsharded) and so are the next block's (the
  prefetched all-gather), and freed after it (``reshard_after_forward``); the same in backward with the block
  before it as the prefetched one;
* a block's gradients exist unsharded from their creation to the end of the block's backward; then a
  reduce-scatter input of that size lives until the next block's backward has finished (one reduce-scatter
  in flight);
* the root's own parameters (embeddings, heads) stay unsharded from the first forward node to the end of
  backward (the root is not resharded after forward), and its gradients until the end of backward. Like a
  block's, the unsharded parameters are all-gathered copies that live beside the rank's shards.

DDP (``DistributedDataParallel``, ``gradient_as_bucket_view=False``, its default): everything of one device,
plus the reducer's flat gradient buckets (25 MiB each by default, together one full copy of the gradients),
allocated when DDP wraps the model and kept for its lifetime.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import numpy as np

from acstudio.errors import ACStudioError
from acstudio.profile.model import Profile, TensorRecord

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "uint8": 1,
             "bool": 1, "int8": 1, "int16": 2}
_STATE = ("parameter", "gradient", "optimizer_state")


def per_rank_profile(profile: Profile, world: int, kind: str) -> Profile:
    """``profile`` as one of ``world`` ranks sees it under ``kind`` (``"fsdp"`` or ``"ddp"``)."""
    if kind not in SHARDINGS:
        raise ACStudioError(f"unknown sharding {kind!r}; choose from {', '.join(SHARDINGS)}")
    if world < 1:
        raise ACStudioError(f"the world size must be at least 1, not {world} — give the number of ranks, e.g. 2")
    if world == 1:
        return profile
    out = copy.deepcopy(profile)
    delta = SHARDINGS[kind](out, world)
    for node, d in zip(out.nodes, delta.tolist()):
        node.mem_peak += d
        node.mem_after += d
    pos = int(np.argmax([n.mem_peak for n in out.nodes]))
    out.peak_bytes, out.peak_node = out.nodes[pos].mem_peak, out.nodes[pos].id
    out.peak_breakdown = _breakdown_at(out, pos)
    out.environment = {**out.environment, "sharding": {"kind": kind, "world": world}}
    return out


def static_bytes(profile: Profile) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state (what sharding divides), per category."""
    out = dict.fromkeys(_STATE, 0)
    for t in profile.tensors:
        if t.category in out:
            out[t.category] += t.bytes
    return out


# -- FSDP2 -----------------------------------------------------------------------------------------------------
def fsdp_delta(profile: Profile, world: int) -> np.ndarray:
    """Shrink the sharded tensors in place; return the per-node change of allocated bytes."""
    index = profile.node_index
    n = len(profile.nodes)
    delta = np.zeros(n + 1, dtype=np.int64)

    def add(start: int, end: int, nbytes: int) -> None:
        if nbytes and start <= end:
            delta[start] += nbytes
            delta[end + 1] -= nbytes

    blocks = _Blocks(profile)
    full_grads: dict[str, int] = {}
    for t in profile.tensors:
        if t.category not in _STATE:
            continue
        start, end = index[t.created_at], index[t.freed_after] if t.freed_after else n - 1
        shard = _shard_bytes(profile, t, world)
        add(start, end, shard - t.bytes)
        if t.category == "gradient":
            block = blocks.of_node(start)
            full_grads[block] = full_grads.get(block, 0) + t.bytes
            # unsharded from its creation to the end of its block's backward (the root's: of the backward)
            add(start, blocks.backward_end(block), t.bytes - shard)
        t.bytes = shard
    params = blocks.parameter_bytes()
    add(blocks.first_forward, blocks.last_backward, params.get("", 0))  # unsharded, beside its shards
    order = blocks.order
    for k, block in enumerate(order):
        nxt = order[k + 1] if k + 1 < len(order) else None
        prev = order[k - 1] if k > 0 else None
        s, e = blocks.forward_span[block]
        add(s, e, params[block] + (params[nxt] if nxt else 0))
        s, e = blocks.backward_span[block]
        add(s, e, params[block] + (params[prev] if prev else 0))
        # reduce-scatter input of this block, until the next block's backward (the previous one's) finishes
        end = blocks.backward_span[prev][1] if prev else blocks.last_backward
        add(e, end, full_grads.get(block, 0))
    return np.cumsum(delta[:n])


def _shard_bytes(profile: Profile, t: TensorRecord, world: int) -> int:
    """One rank's share of a dim-0-sharded tensor: for graph inputs (parameters, optimizer state) from their
    shape, rows padded up to a multiple of ``world`` and 0-d tensors whole; for gradients, made inside the
    graph in whatever shape the backward op had, ``ceil(bytes / world)`` (the same when rows divide evenly)."""
    node = profile.node_by_id.get(t.id)
    if node is None or node.op != "placeholder" or node.dtype not in _ITEMSIZE or node.new_bytes != t.bytes:
        return math.ceil(t.bytes / world)
    if node.shape == "scalar":
        return t.bytes
    dims = [int(d) for d in node.shape.split("x")]
    return math.ceil(dims[0] / world) * math.prod(dims[1:]) * _ITEMSIZE[node.dtype]


class _Blocks:
    """The repeated blocks that ``fully_shard`` wraps, in forward order, with their node spans and parameters.

    ``""`` is the root: every node and parameter outside the blocks.
    """

    def __init__(self, profile: Profile) -> None:
        from acstudio.profile.blocks import repeated_blocks

        self.profile = profile
        nodes = profile.nodes
        block_of = repeated_blocks(sorted({nd.module for nd in nodes if nd.module}))
        self.block = [block_of.get(nd.module, "") for nd in nodes]
        self.forward_span: dict[str, tuple[int, int]] = {}
        self.backward_span: dict[str, tuple[int, int]] = {}
        for i, nd in enumerate(nodes):
            span = {"forward": self.forward_span, "backward": self.backward_span}.get(nd.region)
            if span is not None and self.block[i]:
                lo, _ = span.get(self.block[i], (i, i))
                span[self.block[i]] = (lo, i)
        self.order = sorted(self.forward_span, key=lambda b: self.forward_span[b][0])
        regions = [nd.region for nd in nodes]
        self.first_forward = regions.index("forward") if "forward" in regions else 0
        self.last_backward = len(regions) - 1 - regions[::-1].index("backward") if "backward" in regions else 0

    def of_node(self, i: int) -> str:
        return self.block[i] if self.block[i] in self.backward_span else ""

    def backward_end(self, block: str) -> int:
        return self.backward_span[block][1] if block else self.last_backward

    def parameter_bytes(self) -> dict[str, int]:
        """Unsharded parameter bytes per block (and ``""`` for the root's), by the parameters' names."""
        names = [name for kind, name in self.profile.graph["inputs"]]
        kinds = [kind for kind, name in self.profile.graph["inputs"]]
        placeholders = [nd for nd in self.profile.nodes if nd.op == "placeholder"]
        out = dict.fromkeys(["", *self.order], 0)
        for nd, kind, name in zip(placeholders, kinds, names):
            if kind == "param":
                block = next((b for b in self.order if name.startswith(b + ".")), "")
                out[block] += nd.new_bytes
        return out


# -- DDP -------------------------------------------------------------------------------------------------------
def ddp_delta(profile: Profile, world: int) -> np.ndarray:
    """The gradient buckets: one more copy of every gradient, for the whole iteration."""
    buckets = static_bytes(profile)["gradient"]
    return np.full(len(profile.nodes), buckets, dtype=np.int64)


SHARDINGS: dict[str, Callable[[Profile, int], np.ndarray]] = {"fsdp": fsdp_delta, "ddp": ddp_delta}


def _breakdown_at(profile: Profile, pos: int) -> dict[str, int]:
    """Bytes alive at node ``pos`` per storage category; what no storage explains is ``other`` (unsharded
    parameters, reduce-scatter and bucket buffers, allocator workspaces)."""
    index, n = profile.node_index, len(profile.nodes)
    out = dict.fromkeys(profile.peak_breakdown, 0) | {"other": 0}
    for t in profile.tensors:
        if index[t.created_at] <= pos <= (index[t.freed_after] if t.freed_after else n - 1):
            out[t.category] = out.get(t.category, 0) + t.bytes
    out["other"] = max(0, profile.peak_bytes - sum(out.values()))
    return out
