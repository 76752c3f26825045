"""Classic checkpointing policies as recompute sets, judged by the same simulator as μ-TWO.

* keep-all: no activation checkpointing;
* recompute-all: every candidate recomputed (the floor);
* per-module: what ``torch.utils.checkpoint`` around every repeated block does (each ResNet stage block,
  transformer layer): everything a block creates is recomputed, except what leaves the block in forward
  (its output, i.e. the next block's input);
* sqrt-n: Chen et al.'s √n rule: keep every k-th articulation point of the forward graph (k = round √#points)
  and recompute every other candidate;
* per-op: torchtitan's op-level selective checkpointing: in every repeated block keep the outputs of attention
  and of every odd-numbered matmul, recompute everything else per-module would.
"""

from __future__ import annotations

import math

import numpy as np

from acstudio.plan.schedule import PlanContext
from acstudio.profile.blocks import repeated_blocks
from acstudio.simulate.replay import ATTENTION_KERNELS, FORWARD_REGIONS, is_attention


def node_blocks(ctx: PlanContext) -> list[str]:
    """Per node: the repeated block its module belongs to (``""`` outside every block, and for non-forward nodes)."""
    nodes = ctx.profile.nodes
    block_of = repeated_blocks(sorted({nd.module for nd in nodes if nd.region in FORWARD_REGIONS}))
    return [block_of.get(nd.module, "") if nd.region in FORWARD_REGIONS else "" for nd in nodes]


def block_members(ctx: PlanContext) -> dict[str, list[int]]:
    """Per repeated block, in forward order: its candidates (creation order) that no forward node outside the
    block reads, i.e. what checkpointing the block frees."""
    rg, nodes = ctx.rg, ctx.profile.nodes
    block = node_blocks(ctx)
    leaves = np.zeros(len(rg.bytes), dtype=bool)
    for r, nd in enumerate(nodes):
        if nd.region not in FORWARD_REGIONS:
            continue
        for u in nd.inputs:
            k = rg.act_index.get(nodes[ctx.profile.node_index[u]].storage)
            if k is not None and block[rg.created[k]] != block[r]:
                leaves[k] = True
    members: dict[str, list[int]] = {}
    for k in sorted(rg.candidates, key=lambda k: (rg.created[k], k)):
        b = block[rg.created[k]]
        if b and not leaves[k]:
            members.setdefault(b, []).append(k)
    return members


def per_module(ctx: PlanContext) -> list[int]:
    """Candidates created inside a repeated block and not read by forward nodes outside that block."""
    return [k for ks in block_members(ctx).values() for k in ks]


def articulation_points(ctx: PlanContext) -> list[int]:
    """Candidates held by a forward node that no forward edge jumps over (every path passes through it)."""
    rg, nodes, index = ctx.rg, ctx.profile.nodes, ctx.profile.node_index
    fw = [i for i, nd in enumerate(nodes) if nd.region in FORWARD_REGIONS]
    reach = np.full(len(nodes) + 1, -1, dtype=np.int64)  # farthest target of an edge leaving node i
    for i in fw:
        for u in nodes[i].inputs:
            j = index[u]
            if nodes[j].op != "placeholder":
                reach[j] = max(reach[j], i)
    jump = np.maximum.accumulate(reach)  # farthest target of any edge leaving node <= i
    points = []
    seen = set()
    for i in fw:
        k = rg.act_index.get(nodes[i].storage)
        if k is not None and k not in seen and rg.is_candidate[k] and jump[i - 1] <= i:
            seen.add(k)
            points.append(k)
    return points


def sqrt_n(ctx: PlanContext) -> list[int]:
    points = articulation_points(ctx)
    k = max(1, round(math.sqrt(len(points))))
    keep = set(points[k - 1::k])
    return [k for k in ctx.rg.candidates if k not in keep]


# The aten ops whose outputs torchtitan's op-level policy saves (its ``_save_list``): matmuls, every second one, and
# attention. acstudio.bench.steps builds the runtime policy of the per-op peer from the same names.
PER_OP_MATMULS = ("mm", "addmm", "bmm")
PER_OP_ATTENTION = ATTENTION_KERNELS
MATMULS = frozenset(f"aten.{name}.default" for name in PER_OP_MATMULS)


def torchtitan_saved(ctx: PlanContext) -> set[int]:
    """The nodes torchtitan's op-level policy saves: attention and the 1st, 3rd, ... matmul of each block call."""
    block = node_blocks(ctx)
    matmuls: dict[str, int] = {}
    saved = set()
    for i, nd in enumerate(ctx.profile.nodes):
        if not block[i]:
            continue
        if nd.target in MATMULS:
            matmuls[block[i]] = matmuls.get(block[i], 0) + 1
            if matmuls[block[i]] % 2:
                saved.add(i)
        elif is_attention(nd.target):
            saved.add(i)
    return saved


def per_op(ctx: PlanContext) -> list[int]:
    """per-module's recompute set less what torchtitan's op-level policy saves (:func:`torchtitan_saved`)."""
    saved = torchtitan_saved(ctx)
    return [k for k in per_module(ctx) if ctx.rg.created[k] not in saved]


def keep_all(ctx: PlanContext) -> list[int]:
    return []


def recompute_all(ctx: PlanContext) -> list[int]:
    return list(ctx.rg.candidates)
