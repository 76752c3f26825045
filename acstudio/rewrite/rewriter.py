"""Turn a recompute plan into a rewritten training step: free activations after forward, replay them in backward.

The rewriter works on the captured graph itself (a copy of the same nodes, found by ``meta["ac_id"]``), never on a
re-trace, and takes storages, aliases and replay safety from the profile, so it rewrites exactly what was planned.
For every recomputed activation, in order of first backward use:

1. its *replay* is the backward slice from the activation's alias nodes down to resident sources: graph inputs,
   retained activations, and recomputed activations whose replayed copy is still alive at that point;
2. a storage on the way that is not resident is *rematerialised*: its creator and every in-place writer are
   replayed in their original order, so each copied node reads exactly the tensor version the original read (a
   resident storage updated in place after the original read is rematerialised too);
3. the copies go right before the first backward user, and only users at or after that point are rewired, so
   the original storage's last use moves into forward and FX's generated code frees it there.

A recomputed activation met on another's replay while it is not resident is, by default, replayed there as a
transient and recomputed again before its own first use: μ-TWO's Alg E/F model, which the planner's simulator
predicts exactly (replay mode ``"again"``). A mode whose ``shares_chains`` is set (``"shared"``) instead makes that
one replay also produce it (dodrio's ``rcomp_outs``): fewer replayed ops, but it is then held from the earlier
insertion point (:mod:`acstudio.simulate.shared` predicts that exactly; a plan names the mode it was priced for in
``Plan.replay_mode``).
Training-mode BatchNorm is replayed without its running statistics (they were updated once, in forward).
Activations the plan offloads (``Plan.offloaded``) get their copy nodes once the replays are in place, where the
simulator schedules them beside those replays (:mod:`acstudio.rewrite.offload`).

Random ops (dropout, ``native_dropout``, ``bernoulli_``, SDPA with dropout, ``rand*``) are replayed with the
generator state their forward drew with, so a replay draws the very same numbers and the rewritten step stays
bitwise identical to the captured one. Right before such an op in forward the rewriter inserts nodes that save
the CPU generator state and the states of the devices of the op's tensor inputs (``torch.get_rng_state`` and
``torch.utils.checkpoint.get_device_states``: CUDA's Philox seed and offset); each replayed copy is bracketed by
nodes that save the current states, set the saved ones, and restore the current ones right after the op, so
whatever draws later in the step is unaffected. This is what ``torch.utils.checkpoint(preserve_rng_state=True)``
does for a whole region, done per op. It was chosen over the ``run_and_save_rng_state`` / ``run_with_rng_state``
higher-order ops (torch/_prims/rng_prims.py, what AOTAutograd's RNG functionalization inserts) because those
replace the forward op by a HOP returning ``(state, output)``: the captured node would change its output, and
every consumer and storage keyed by its id with it, while the get/set nodes leave every captured node as it is
(one graph, stable ids, original kernels and masks) and generate plain torch calls, so exported steps still need
torch alone; the HOPs are also private API that moved between torch releases. With ``keep_random`` random ops
are never replayed (no random draw is repeated) and ``native_dropout`` (CUDA's fused dropout) is replayed as
``native_dropout_backward`` on the mask it drew in forward, which is kept: the same masked scale, no second draw.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.utils.checkpoint import get_device_states, set_device_states

from acstudio.capture.analysis import written_args
from acstudio.capture.step import CapturedStep
from acstudio.errors import ACStudioError, PlanMismatchError, RewriteError
from acstudio.profile.model import Profile
from acstudio.profile.ops import target_name
from acstudio.profile.replay_rules import BATCH_NORM_OPS, replay_rules
from acstudio.rewrite.offload import RUNTIME_ATTR, Offload, insert_offload
from acstudio.simulate.modes import get_mode
from acstudio.simulate.replay import RNG_STATE_BYTES

RESIDENT_CATEGORIES = {"parameter", "buffer", "optimizer_state", "input"}
FORWARD_REGIONS = ("forward", "loss")


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
class RewrittenStep(CapturedStep):
    """A captured step whose graph frees and recomputes the planned activations."""

    recomputations: list[Recomputation] = field(default_factory=list)
    offloads: list[Offload] = field(default_factory=list)

    @property
    def replay_ms(self) -> float:
        return sum(r.replay_ms for r in self.recomputations)

    def run(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch) -> torch.Tensor:
        """:meth:`CapturedStep.run`; with offload, the pinned pool is made (or the host's lack of free memory
        reported) before the step starts."""
        if self.offloads:
            device = next(model.parameters()).device
            getattr(self.gm, RUNTIME_ATTR).ensure_pool(device)
        return super().run(model, optimizer, batch)


class PlannedActivations(list):
    """A plan's recomputed activation ids, carrying how the plan replays them (``Plan.replay_mode``,
    ``Plan.keep_random``) and what it offloads (``Plan.offloaded``), so that callers passing them on to
    :func:`rewrite_step` (verify, export) rewrite the step the plan was priced for."""

    replay_mode = "again"
    keep_random = False
    offloaded: tuple[str, ...] = ()


def plan_activations(plan, profile: Profile) -> list[str]:
    """The recomputed activation ids of ``plan`` (a Plan, or a plain collection of ids) after checking its profile."""
    if isinstance(plan, (list, tuple, set, frozenset)):
        return list(plan)
    plan.check_profile(profile)
    ids = PlannedActivations(plan.recomputed)
    ids.replay_mode = plan.replay_mode
    ids.keep_random = bool(getattr(plan, "keep_random", False))
    ids.offloaded = tuple(getattr(plan, "offloaded", ()))
    return ids


def rewrite(step: CapturedStep, profile: Profile, plan) -> RewrittenStep:
    """Apply ``plan`` (refused if made for another profile) to ``step``, replaying as the plan says; see
    :func:`rewrite_step`."""
    return rewrite_step(step, profile, plan_activations(plan, profile))


def rewrite_step(step: CapturedStep, profile: Profile, recomputed: Collection[str], *,
                 replay_mode: str | None = None, keep_random: bool | None = None,
                 offloaded: Collection[str] | None = None) -> RewrittenStep:
    """A copy of ``step`` that frees each activation in ``recomputed`` after forward and replays it in backward,
    and copies each in ``offloaded`` to host memory and back (:mod:`acstudio.rewrite.offload`).

    ``step`` must be the graph ``profile`` was measured on (same nodes in the same order, e.g. from
    ``deserialize_step(profile.graph)``); it is not modified. Replays follow ``replay_mode``, by default the mode
    of the plan ``recomputed`` comes from (:func:`plan_activations`), else ``"again"``; random ops are replayed
    with their forward's generator state unless ``keep_random`` (by default: the plan's) says never to.
    ``offloaded`` defaults to the plan's; the copies go where the simulator schedules them for this plan.
    """
    mode = get_mode(replay_mode or getattr(recomputed, "replay_mode", "again"))
    if keep_random is None:
        keep_random = getattr(recomputed, "keep_random", False)
    if offloaded is None:
        offloaded = getattr(recomputed, "offloaded", ())
    gm = fx.GraphModule(step.gm, copy.deepcopy(step.gm.graph))
    ids = [n.meta.get("ac_id") for n in gm.graph.nodes]
    if ids != [r.id for r in profile.nodes]:
        raise PlanMismatchError("this graph is not the one the profile was measured on (node ids differ)")
    recs = _Rewriter(gm, profile, mode.shares_chains, keep_random).apply(recomputed)
    offloads = _offload(gm, profile, mode, list(dict.fromkeys(recomputed)), list(offloaded), keep_random)
    gm.graph.lint()
    gm.recompile()
    return RewrittenStep(gm=gm, inputs=list(step.inputs), grad_params=list(step.grad_params), optimizer=step.optimizer,
                         recomputations=recs, offloads=offloads)


def _offload(gm: fx.GraphModule, profile: Profile, mode, recomputed: list[str], offloaded: list[str],
             keep_random: bool) -> list[Offload]:
    """Insert the copies of ``offloaded`` where the simulator schedules them beside the plan's replays."""
    if not offloaded:
        return []
    from acstudio.simulate.modes import offload_indices
    from acstudio.simulate.simulator import Simulator

    sim = Simulator(profile, keep_random=keep_random)
    try:
        ks = offload_indices(sim, offloaded)
        schedule = mode.offload(sim, mode.schedule(sim, sim.indices(recomputed)), ks)
    except ACStudioError as exc:
        raise RewriteError(str(exc)) from None
    dropped = [sim.replay.act_ids[k] for k in sorted(set(ks) - set(schedule.offloaded.tolist()))]
    if dropped:
        raise RewriteError(f"activation {dropped[0]} cannot be offloaded in this plan: it is recomputed")
    return insert_offload(gm, profile, schedule, sim.offload_facts)


@dataclass
class _Replayed:
    """A storage whose replayed copy exists: its copied alias nodes and the interval it is alive in."""

    copies: dict[fx.Node, fx.Node]
    start: int  # position of the node the replay was inserted before
    end: int  # position of its last backward reader


class _Rewriter:
    def __init__(self, gm: fx.GraphModule, profile: Profile, shares_chains: bool, keep_random: bool) -> None:
        self.gm = gm
        self.profile = profile
        self.shares_chains = shares_chains
        self.keep_random = keep_random
        self.nodes = list(gm.graph.nodes)
        self.pos = {n: i for i, n in enumerate(self.nodes)}
        self.rec = dict(zip(self.nodes, profile.nodes))
        self.rules = replay_rules(profile, keep_random)
        self.verdict = dict(zip(self.nodes, self.rules.node))
        self.draws = {n for n, d in zip(self.nodes, self.rules.draws) if d}
        self.saved_rng: dict[fx.Node, tuple[fx.Node, fx.Node, fx.Node]] = {}
        self.rng_state_bytes = RNG_STATE_BYTES.get(profile.environment.get("device_type", "cpu"), 16)
        by_id = {n.meta["ac_id"]: n for n in self.nodes}
        self.storages: dict[fx.Node, list[str]] = {n: [] for n in self.nodes}
        self.holders: dict[str, list[fx.Node]] = {}
        self.category: dict[str, str] = {}
        for t in profile.tensors:
            self.category[t.id] = t.category
            self.holders[t.id] = [by_id[h] for h in (t.created_at, *t.aliases)]
            for h in self.holders[t.id]:
                self.storages[h].append(t.id)
        self.writers: dict[str, list[int]] = {}
        for n in self.nodes:
            for s in self.written_storages(n):
                self.writers.setdefault(s, []).append(self.pos[n])
        self.wanted: set[str] = set()
        self.replayed: dict[str, _Replayed] = {}
        self.copy_count: dict[str, int] = {}

    # -- facts about the original graph -------------------------------------------------------------------
    def region(self, n: fx.Node) -> str:
        return n.meta["ac_region"]

    def written_storages(self, n: fx.Node) -> list[str]:
        """Storages ``n`` mutates, leaving out BatchNorm running statistics (a replay does not update them)."""
        args = written_args(n)
        if is_batch_norm(n):
            stats = {_arg(n, "running_mean"), _arg(n, "running_var")}
            args = [a for a in args if a not in stats]
        return [s for a in args for s in self.storages[a]]

    def forward_holders(self, sid: str) -> list[fx.Node]:
        return [h for h in self.holders[sid] if self.region(h) in FORWARD_REGIONS]

    def backward_readers(self, sid: str) -> list[fx.Node]:
        """Original nodes outside forward that read one of the storage's forward alias nodes."""
        return sorted({u for h in self.forward_holders(sid) for u in h.users
                       if u in self.pos and self.region(u) not in FORWARD_REGIONS}, key=self.pos.__getitem__)

    def resident(self, sid: str, at: int) -> bool:
        """Whether storage ``sid`` holds its final forward value at position ``at`` without being replayed."""
        if sid in self.replayed:
            r = self.replayed[sid]
            return r.start <= at <= r.end
        if sid in self.profile.activation_by_id:
            return sid not in self.wanted
        return self.category[sid] in RESIDENT_CATEGORIES

    def describe(self, n: fx.Node) -> str:
        rec = self.rec[n]
        where = f" in {rec.module}" if rec.module else ""
        return f"{rec.id} ({rec.target}{where})"

    # -- the rewrite --------------------------------------------------------------------------------------
    def apply(self, recomputed: Collection[str]) -> list[Recomputation]:
        todo = list(dict.fromkeys(recomputed))
        for sid in todo:
            act = self.profile.activation_by_id.get(sid)
            if act is None:
                raise RewriteError(f"{sid} is not an activation of this profile (nothing to recompute)")
            if self.rules.activation[sid]:
                raise RewriteError(f"activation {sid} cannot be recomputed: {self.rules.activation[sid]}")
        first_use = {sid: self.pos[self.backward_readers(sid)[0]] for sid in todo}
        todo.sort(key=lambda s: (first_use[s], self.pos[self.holders[s][0]]))
        self.wanted = set(todo)
        out: dict[str, Recomputation] = {}
        for sid in todo:
            if sid not in self.replayed:
                for r in self.replay_group(sid, first_use[sid]):
                    out[r.activation] = r
        self.check_freed(todo)
        return [out[s] for s in todo]

    def replay_group(self, owner: str, at: int) -> list[Recomputation]:
        """Insert one replay producing ``owner`` (and the recomputed activations it passes through) before ``at``."""
        forced: set[str] = set()
        while True:
            plan = self.slice(owner, at, forced)
            stale = self.stale_sources(plan, at)
            if not stale:
                break
            forced |= stale
        order = sorted(plan.replay, key=self.pos.__getitem__)
        anchor = self.nodes[at]
        env: dict[fx.Node, fx.Node] = {}
        with self.gm.graph.inserting_before(anchor):
            for n in order:
                if is_getitem(n, 0) and self.from_mask(n.args[0]):  # the replayed node already is the output
                    env[n] = env[n.args[0]]
                    continue
                arg_map = lambda x: env[x] if x in env else plan.sources[x]  # noqa: E731
                env[n] = self.copy_random(n, arg_map, owner) if n in self.draws else self.copy_node(n, arg_map, owner)
                kept = self.storages[self.dropout_mask(n)] if self.from_mask(n) else []  # read, not held by the copy
                env[n].meta["ac_storages"] = [f"{s}@{owner}" if s in plan.remat else s for s in self.storages[n]
                                              if s not in kept]
        for sid in plan.group:
            readers = self.backward_readers(sid)
            for h in self.forward_holders(sid):
                for u in list(h.users):
                    if self.pos.get(u, -1) >= at:
                        u.replace_input_with(h, env[h])
            for h in self.holders[sid]:  # backward views of the activation now alias its replayed copy
                if self.region(h) not in FORWARD_REGIONS:
                    h.meta["ac_storages"] = [f"{s}@{owner}" if s == sid else s for s in self.storages[h]]
            self.replayed[sid] = _Replayed(copies={h: env[h] for h in self.holders[sid] if h in env},
                                           start=at, end=self.pos[readers[-1]])
        out = []
        for sid in plan.group:
            act = self.profile.activation_by_id[sid]
            own = sid == owner
            out.append(Recomputation(
                activation=sid, bytes=act.bytes, module=self.rec[self.holders[sid][0]].module,
                freed_after=act.last_fw_use, recompute_before=anchor.meta["ac_id"], replayed_by=owner,
                replay_nodes=[n.meta["ac_id"] for n in order] if own else [],
                replay_ms=sum(self.rec[n].run_time_ms for n in order) * self.profile.time_scale if own else 0.0))
        return out

    def slice(self, owner: str, at: int, forced: set[str]) -> _Slice:
        """The original nodes to replay for ``owner`` before position ``at``, and what they read instead of the rest.

        ``forced`` storages are treated as not resident (an earlier pass found them updated after being read).
        """
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
            if self.category[sid] in RESIDENT_CATEGORIES:
                raise RewriteError(
                    f"recomputing {owner} needs {self.describe(node)} as it was before a later in-place update of "
                    f"graph input {sid}; that version no longer exists in backward")
            plan.remat.add(sid)
            push(self.nodes[i] for i in self.writers.get(sid, []) if i < at)
            if sid in self.wanted and sid not in self.replayed and (sid == owner or self.shares_chains):
                plan.group.append(sid)
                push(h for h in self.forward_holders(sid) if any(self.pos.get(u, -1) >= at for u in h.users))

        rematerialise(owner, self.holders[owner][0])
        while stack:
            n = stack.pop()
            reason = self.verdict[n]
            if reason != "ok" or self.region(n) not in FORWARD_REGIONS:
                raise RewriteError(f"recomputing {owner} would replay {self.describe(n)}, which must not run twice "
                                   f"({reason})")
            kept = []
            if self.from_mask(n):  # replayed from its kept mask, which is read, never drawn again
                mask = self.dropout_mask(n, at, forced)
                plan.sources[mask] = mask
                plan.readers.setdefault(mask, []).append(n)
                kept = self.storages[mask]
            for s in self.storages[n]:
                if s not in kept and (n is self.holders[s][0] or s in self.written_storages(n)):
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
        if len(self.storages[x]) != 1:  # a multi-output (or tensor-less) node is replayed, never held
            return None
        (sid,) = self.storages[x]
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
                                                   for s in self.storages[mask])):
            raise RewriteError(f"{self.describe(n)} cannot be replayed: its dropout mask is not kept for backward")
        return mask

    def stale_sources(self, plan: _Slice, at: int) -> set[str]:
        """Storages the replay reads as resident although they are replayed too, or were updated after the read."""
        stale = set()
        for x, readers in plan.readers.items():
            first_read = min(self.pos[r] for r in readers)
            for sid in self.storages[x]:
                if sid in plan.remat:
                    stale.add(sid)
                elif any(first_read < w < at for w in self.writers.get(sid, [])):
                    if x.op == "placeholder" or self.category[sid] in RESIDENT_CATEGORIES:
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
            p, train = _arg(n, "p"), _arg(n, "train")
            scale = (1.0 / (1.0 - p) if p < 1 else 0.0) if train is not False else 1.0
            target, args, kwargs = torch.ops.aten.native_dropout_backward.default, (args[0], self.dropout_mask(n),
                                                                                    scale), {}
            if isinstance(meta.get("val"), tuple):
                meta["val"] = meta["val"][0]
        new = self.gm.graph.create_node(n.op, target, args, kwargs, name=f"{n.name}_rc{k}", type_expr=n.type)
        new.meta = {**meta, "ac_id": f"{orig}@rc{k}", "ac_role": "recompute", "ac_of": owner, "ac_region": "backward"}
        if is_batch_norm(n) and _training(n):
            drop_running_stats(new)
        for w in written_args(new):
            if w.meta.get("ac_role") != "recompute" or w.meta.get("ac_of") != owner:
                raise RewriteError(f"replaying {self.describe(n)} would update {w.meta['ac_id']} in place, a tensor "
                                   "this replay did not create")
        return new

    # -- random ops: replayed with the generator state their forward drew with (see the module docstring) --------
    def copy_random(self, n: fx.Node, arg_map, owner: str) -> fx.Node:
        """A copy of random op ``n`` that draws with ``n``'s saved generator states, then puts the current back."""
        cpu, devices, states = self.saved_state(n)
        base = f"{n.meta['ac_id']}@rc{self.copy_count.get(n.meta['ac_id'], 0)}"
        now_cpu, now_devices, now_states = self.state_nodes(arg_map(n.all_input_nodes[0]), f"{base}.rng_now", owner)
        self.rng_node(torch.set_rng_state, (cpu,), f"{base}.rng_set", owner)
        self.rng_node(set_device_states, (devices, states), f"{base}.rng_set_devices", owner)
        new = self.copy_node(n, arg_map, owner)
        self.rng_node(torch.set_rng_state, (now_cpu,), f"{base}.rng_restore", owner)
        self.rng_node(set_device_states, (now_devices, now_states), f"{base}.rng_restore_devices", owner)
        return new

    def saved_state(self, n: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node]:
        """The nodes holding the generator states random op ``n`` drew with, saved right before it in forward
        (once, however often it is replayed); the CPU state carries the saved state's bytes for the accounting."""
        if n not in self.saved_rng:
            orig = n.meta["ac_id"]
            with self.gm.graph.inserting_before(n):
                saved = self.state_nodes(n.all_input_nodes[0], f"{orig}@rng", None)
            saved[0].meta.update(ac_storages=[f"{orig}@rng"], ac_sizes={f"{orig}@rng": self.rng_state_bytes})
            self.saved_rng[n] = saved
        return self.saved_rng[n]

    def state_nodes(self, like: fx.Node, name: str, owner: str | None) -> tuple[fx.Node, fx.Node, fx.Node]:
        """Nodes reading the CPU generator state and (device ids, states) of the devices ``like`` lives on."""
        cpu = self.rng_node(torch.get_rng_state, (), f"{name}.cpu", owner)
        devices = self.rng_node(get_device_states, (like,), f"{name}.devices", owner)
        return (cpu, self.rng_node(operator.getitem, (devices, 0), f"{name}.ids", owner),
                self.rng_node(operator.getitem, (devices, 1), f"{name}.states", owner))

    def rng_node(self, target, args: tuple, ac_id: str, owner: str | None) -> fx.Node:
        """A generator-state node: in forward (``owner`` None: a saved state) or in ``owner``'s replay."""
        node = self.gm.graph.call_function(target, args)
        node.meta.update(ac_id=ac_id, ac_role="rng", ac_region="forward" if owner is None else "backward",
                         ac_storages=[], ac_shape="", ac_dtype="")
        if owner is not None:
            node.meta["ac_of"] = owner
        return node

    def check_freed(self, recomputed: Iterable[str]) -> None:
        """After rewiring, the original alias nodes of a recomputed storage may only be read in forward."""
        for sid in recomputed:
            for h in self.forward_holders(sid):
                late = [u for u in h.users if self.region(u) not in FORWARD_REGIONS]
                if late:
                    raise AssertionError(f"{sid}: {h.meta['ac_id']} is still read by {late[0].meta['ac_id']}")


@dataclass
class _Slice:
    replay: set[fx.Node] = field(default_factory=set)
    sources: dict[fx.Node, fx.Node] = field(default_factory=dict)  # original input -> what the replay reads
    readers: dict[fx.Node, list[fx.Node]] = field(default_factory=dict)  # source -> replayed nodes reading it
    remat: set[str] = field(default_factory=set)  # storages replayed into fresh tensors
    group: list[str] = field(default_factory=list)  # recomputed activations this replay produces


def is_dropout(n: fx.Node) -> bool:
    """``native_dropout`` (the fused CUDA form; CPU captures draw with ``bernoulli_`` instead)."""
    return n.op == "call_function" and n.target is torch.ops.aten.native_dropout.default


def is_getitem(n: fx.Node, index: int) -> bool:
    return n.op == "call_function" and n.target is operator.getitem and n.args[1] == index


# -- BatchNorm -------------------------------------------------------------------------------------------
def is_batch_norm(n: fx.Node) -> bool:
    return n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) \
        and target_name(n.target) in BATCH_NORM_OPS


def _arg_index(target: torch._ops.OpOverload, name: str) -> int | None:
    for i, a in enumerate(target._schema.arguments):
        if a.name == name:
            return i
    return None


def _arg(n: fx.Node, name: str):
    i = _arg_index(n.target, name)
    if i is None:
        return None
    return n.args[i] if i < len(n.args) else n.kwargs.get(name)


def _training(n: fx.Node) -> bool:
    """``_batch_norm_with_update`` has no flag: it always trains."""
    return _arg_index(n.target, "training") is None or bool(_arg(n, "training"))


def drop_running_stats(n: fx.Node) -> None:
    """Make a replayed training-mode BatchNorm leave running statistics alone (same output, no second update).

    Ops whose schema allows it get ``None``; ``_native_batch_norm_legit`` switches to its ``no_stats`` overload;
    ``_batch_norm_with_update`` (no optional form) updates throw-away clones.
    """
    schema = n.target._schema.arguments
    args = [n.args[i] if i < len(n.args) else n.kwargs.get(a.name, a.default_value) for i, a in enumerate(schema)]
    stats = [_arg_index(n.target, "running_mean"), _arg_index(n.target, "running_var")]
    if n.target is torch.ops.aten._native_batch_norm_legit.default:
        n.target = torch.ops.aten._native_batch_norm_legit.no_stats
        n.args, n.kwargs = tuple(a for i, a in enumerate(args) if i not in stats), {}
        return
    for j, i in enumerate(stats):
        if schema[i].type.kind() == "OptionalType":
            args[i] = None
            continue
        with n.graph.inserting_before(n):
            clone = n.graph.call_function(torch.ops.aten.clone.default, (args[i],))
        clone.meta.update({k: v for k, v in args[i].meta.items() if k in ("ac_shape", "ac_dtype", "val")})
        clone.meta.update(ac_id=f"{n.meta['ac_id']}.stats{j}", ac_role="recompute", ac_of=n.meta["ac_of"],
                          ac_region="backward", ac_module=n.meta.get("ac_module", ""))
        args[i] = clone
    n.args, n.kwargs = tuple(args), {}
