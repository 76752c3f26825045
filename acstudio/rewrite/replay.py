"""Replay insertion: for every recomputed activation, in order of first backward use, a copy of the chain that
produces it goes right before its first backward user.

1. its *replay* is the backward slice from the activation's alias nodes down to resident sources: graph inputs,
   retained activations, and recomputed activations whose replayed copy is still alive at that point;
2. a storage on the way that is not resident is *rematerialised*: its creator and every in-place writer are
   replayed in their original order, so each copied node reads exactly the tensor version the original read (a
   resident storage updated in place after the original read is rematerialised too);
3. the copies go right before the first backward user, and only users at or after that point are rewired
   (:mod:`acstudio.rewrite.rewire`). Rewiring follows each replay at once, because the next replay's slice reads
   the rewired graph.

Random ops are copied plainly here and listed for :mod:`acstudio.rewrite.rng`; replayed BatchNorm copies are
listed for :mod:`acstudio.rewrite.batchnorm`. With ``keep_random`` ``native_dropout`` (CUDA's fused dropout) is
replayed as ``native_dropout_backward`` on the mask it drew in forward, which is kept: the same masked scale, no
second draw.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from acstudio.capture.analysis import written_args
from acstudio.errors import RewriteError
from acstudio.rewrite.batchnorm import op_arg, running_stats, updates_running_stats
from acstudio.rewrite.facts import FORWARD_REGIONS, RESIDENT_CATEGORIES
from acstudio.rewrite.passes import RewriteContext
from acstudio.rewrite.rewire import rewire_readers


@dataclass
class Recomputation:
    """Where one recomputed activation is freed and rematerialised in the rewritten step (ids of original nodes)."""

    activation: str
    bytes: int
    module: str
    freed_after: str  # its last forward use: the storage is released right after this node
    recompute_before: str  # the node its replay is inserted before
    replayed_by: str  # the activation whose replay produces it (itself, unless a shared chain produced it)
    replay_nodes: list[str] = field(default_factory=list)  # original ids re-executed (empty if merged)
    replay_ms: float = 0.0  # measured run time of those nodes


@dataclass
class _Replayed:
    """A storage whose replayed copy exists: its copied alias nodes and the interval it is alive in."""

    copies: dict[fx.Node, fx.Node]
    start: int  # position of the node the replay was inserted before
    end: int  # position of its last backward reader


@dataclass
class _Slice:
    replay: set[fx.Node] = field(default_factory=set)
    sources: dict[fx.Node, fx.Node] = field(default_factory=dict)  # original input -> what the replay reads
    readers: dict[fx.Node, list[fx.Node]] = field(default_factory=dict)  # source -> replayed nodes reading it
    remat: set[str] = field(default_factory=set)  # storages replayed into fresh tensors
    group: list[str] = field(default_factory=list)  # recomputed activations this replay produces


class InsertReplays:
    """Inserts and wires the replays of the plan's recomputed activations.

    A recomputed activation met on another's replay while it is not resident is, by default, replayed there as a
    transient and recomputed again before its own first use: μ-TWO's Alg E/F model (replay mode ``"again"``). With
    ``shares_chains`` (mode ``"shared"``) that one replay also produces it (dodrio's ``rcomp_outs``): fewer
    replayed ops, but it is then held from the earlier insertion point.
    """

    name = "insert_replays"

    def __init__(self, shares_chains: bool, keep_random: bool) -> None:
        self.shares_chains = shares_chains
        self.keep_random = keep_random
        self.wanted: set[str] = set()
        self.replayed: dict[str, _Replayed] = {}
        self.copy_count: dict[str, int] = {}

    def requires(self, gm: fx.GraphModule, ctx: RewriteContext) -> None:
        """Every planned id is an activation of the profile that may be recomputed."""
        rules = ctx.facts.rules
        for sid in ctx.recomputed:
            if ctx.profile.activation_by_id.get(sid) is None:
                raise RewriteError(f"{sid} is not an activation of this profile (nothing to recompute)")
            if rules.activation[sid]:
                raise RewriteError(f"activation {sid} cannot be recomputed: {rules.activation[sid]}")

    def call(self, gm: fx.GraphModule, ctx: RewriteContext) -> bool:
        self.gm, self.ctx, self.facts, self.profile = gm, ctx, ctx.facts, ctx.profile
        facts = self.facts
        todo = list(ctx.recomputed)
        first_use = {sid: facts.pos[facts.backward_readers(sid)[0]] for sid in todo}
        todo.sort(key=lambda s: (first_use[s], facts.pos[facts.holders[s][0]]))
        self.wanted = set(todo)
        out: dict[str, Recomputation] = {}
        for sid in todo:
            if sid not in self.replayed:
                for r in self.replay_group(sid, first_use[sid]):
                    out[r.activation] = r
        ctx.recomputations = [out[s] for s in todo]
        return bool(todo)

    def ensures(self, gm: fx.GraphModule, ctx: RewriteContext) -> None:
        missing = [s for s in ctx.recomputed if s not in self.replayed]
        if missing:
            raise AssertionError(f"no replay produces {missing[0]}")

    def resident(self, sid: str, at: int) -> bool:
        """Whether storage ``sid`` holds its final forward value at position ``at`` without being replayed."""
        if sid in self.replayed:
            r = self.replayed[sid]
            return r.start <= at <= r.end
        if sid in self.profile.activation_by_id:
            return sid not in self.wanted
        return self.facts.category[sid] in RESIDENT_CATEGORIES

    def replay_group(self, owner: str, at: int) -> list[Recomputation]:
        """Insert one replay producing ``owner`` (and the recomputed activations it passes through) before ``at``."""
        facts = self.facts
        forced: set[str] = set()
        while True:
            plan = self.slice(owner, at, forced)
            stale = self.stale_sources(plan, at)
            if not stale:
                break
            forced |= stale
        order = sorted(plan.replay, key=facts.pos.__getitem__)
        anchor = facts.nodes[at]
        env: dict[fx.Node, fx.Node] = {}
        with self.gm.graph.inserting_before(anchor):
            for n in order:
                if is_getitem(n, 0) and self.from_mask(n.args[0]):  # the replayed node already is the output
                    env[n] = env[n.args[0]]
                    continue
                arg_map = lambda x: env[x] if x in env else plan.sources[x]  # noqa: E731
                env[n] = self.copy_node(n, arg_map, owner)
                if n in facts.draws:
                    self.ctx.random_copies.append((n, env[n], arg_map(n.all_input_nodes[0])))
                kept = facts.storages[self.dropout_mask(n)] if self.from_mask(n) else []  # read, not held by the copy
                env[n].meta["ac_storages"] = [f"{s}@{owner}" if s in plan.remat else s for s in facts.storages[n]
                                              if s not in kept]
        for sid in plan.group:
            readers = facts.backward_readers(sid)
            rewire_readers(facts, sid, at, env, owner)
            self.replayed[sid] = _Replayed(copies={h: env[h] for h in facts.holders[sid] if h in env},
                                           start=at, end=facts.pos[readers[-1]])
        out = []
        for sid in plan.group:
            act = self.profile.activation_by_id[sid]
            own = sid == owner
            out.append(Recomputation(
                activation=sid, bytes=act.bytes, module=facts.rec[facts.holders[sid][0]].module,
                freed_after=act.last_fw_use, recompute_before=anchor.meta["ac_id"], replayed_by=owner,
                replay_nodes=[n.meta["ac_id"] for n in order] if own else [],
                replay_ms=float(sum(self.profile.node_step_ms[self.profile.node_index[facts.rec[n].id]] for n in order))
                if own else 0.0))
        return out

    def slice(self, owner: str, at: int, forced: set[str]) -> _Slice:
        """The original nodes to replay for ``owner`` before position ``at``, and what they read instead of the rest.

        ``forced`` storages are treated as not resident (an earlier pass found them updated after being read).
        """
        facts = self.facts
        plan = _Slice()
        stack: list[fx.Node] = []

        def push(nodes: Iterable[fx.Node]) -> None:
            for n in nodes:
                if n not in plan.replay:
                    plan.replay.add(n)
                    stack.append(n)

        def rematerialise(sid: str, node: fx.Node) -> None:
            """Replay storage ``sid`` into a fresh tensor: its creator (reached by the walk) and all its writers."""
            if sid in plan.remat:
                return
            if facts.category[sid] in RESIDENT_CATEGORIES:
                raise RewriteError(
                    f"recomputing {owner} needs {facts.describe(node)} as it was before a later in-place update of "
                    f"graph input {sid}; that version no longer exists in backward")
            plan.remat.add(sid)
            push(facts.nodes[i] for i in facts.writers.get(sid, []) if i < at)
            if sid in self.wanted and sid not in self.replayed and (sid == owner or self.shares_chains):
                plan.group.append(sid)
                push(h for h in facts.forward_holders(sid) if any(facts.pos.get(u, -1) >= at for u in h.users))

        rematerialise(owner, facts.holders[owner][0])
        while stack:
            n = stack.pop()
            reason = facts.verdict[n]
            if reason != "ok" or facts.region(n) not in FORWARD_REGIONS:
                raise RewriteError(f"recomputing {owner} would replay {facts.describe(n)}, which must not run twice "
                                   f"({reason})")
            kept = []
            if self.from_mask(n):  # replayed from its kept mask, which is read, never drawn again
                mask = self.dropout_mask(n, at, forced)
                plan.sources[mask] = mask
                plan.readers.setdefault(mask, []).append(n)
                kept = facts.storages[mask]
            for s in facts.storages[n]:
                if s not in kept and (n is facts.holders[s][0] or s in facts.written_storages(n)):
                    rematerialise(s, n)
            for x in n.all_input_nodes:
                if x in plan.replay:
                    continue
                src = self.source(x, at, forced)
                if src is None:
                    push([x])
                else:
                    plan.sources[x] = src
                    plan.readers.setdefault(x, []).append(n)
        return plan

    def source(self, x: fx.Node, at: int, forced: set[str]) -> fx.Node | None:
        """What a replayed node reads in place of original input ``x``, or None if ``x`` must be replayed too."""
        if x.op in ("placeholder", "get_attr"):
            return x
        if len(self.facts.storages[x]) != 1:  # a multi-output (or tensor-less) node is replayed, never held
            return None
        (sid,) = self.facts.storages[x]
        if sid in forced or not self.resident(sid, at):
            return None
        if sid in self.replayed:
            return self.replayed[sid].copies.get(x)  # a view not copied then is re-derived from the copies
        return x

    def from_mask(self, n) -> bool:
        """Whether ``n`` is a native_dropout replayed from its kept mask (only under ``keep_random``)."""
        return self.keep_random and isinstance(n, fx.Node) and is_dropout(n)

    def dropout_mask(self, n: fx.Node, at: int | None = None, forced: set[str] = frozenset()) -> fx.Node:
        """The kept mask of dropout node ``n`` (its ``getitem(n, 1)``), checked resident at ``at`` if given."""
        mask = next((u for u in n.users if is_getitem(u, 1)), None)
        if mask is None or (at is not None and any(s in forced or not self.resident(s, at)
                                                   for s in self.facts.storages[mask])):
            raise RewriteError(f"{self.facts.describe(n)} cannot be replayed: its dropout mask is not kept for "
                               "backward")
        return mask

    def stale_sources(self, plan: _Slice, at: int) -> set[str]:
        """Storages the replay reads as resident although they are replayed too, or were updated after the read."""
        facts = self.facts
        stale = set()
        for x, readers in plan.readers.items():
            first_read = min(facts.pos[r] for r in readers)
            for sid in facts.storages[x]:
                if sid in plan.remat:
                    stale.add(sid)
                elif any(first_read < w < at for w in facts.writers.get(sid, [])):
                    if x.op == "placeholder" or facts.category[sid] in RESIDENT_CATEGORIES:
                        raise RewriteError(f"recomputing would read graph input {sid} after it was updated in place; "
                                           "the value it had in forward no longer exists")
                    stale.add(sid)
        return stale

    def copy_node(self, n: fx.Node, arg_map, owner: str) -> fx.Node:
        orig = n.meta["ac_id"]
        k = self.copy_count.get(orig, 0)
        self.copy_count[orig] = k + 1
        target, args, kwargs = n.target, fx.node.map_arg(n.args, arg_map), fx.node.map_arg(n.kwargs, arg_map)
        meta = dict(n.meta)
        if self.from_mask(n):  # the same masked scale, with the mask drawn in forward
            p, train = op_arg(n, "p"), op_arg(n, "train")
            scale = (1.0 / (1.0 - p) if p < 1 else 0.0) if train is not False else 1.0
            target, args, kwargs = torch.ops.aten.native_dropout_backward.default, (args[0], self.dropout_mask(n),
                                                                                    scale), {}
            if isinstance(meta.get("val"), tuple):
                meta["val"] = meta["val"][0]
        new = self.gm.graph.create_node(n.op, target, args, kwargs, name=f"{n.name}_rc{k}", type_expr=n.type)
        new.meta = {**meta, "ac_id": f"{orig}@rc{k}", "ac_role": "recompute", "ac_of": owner, "ac_region": "backward"}
        self.ctx.copies.append(new)
        dropped = running_stats(new) if updates_running_stats(n) else set()  # left alone by DropRunningStats
        for w in written_args(new):
            if w not in dropped and (w.meta.get("ac_role") != "recompute" or w.meta.get("ac_of") != owner):
                raise RewriteError(f"replaying {self.facts.describe(n)} would update {w.meta['ac_id']} in place, a "
                                   "tensor this replay did not create")
        return new


def is_dropout(n: fx.Node) -> bool:
    """``native_dropout`` (the fused CUDA form; CPU captures draw with ``bernoulli_`` instead)."""
    return n.op == "call_function" and n.target is torch.ops.aten.native_dropout.default


def is_getitem(n: fx.Node, index: int) -> bool:
    return n.op == "call_function" and n.target is operator.getitem and n.args[1] == index
