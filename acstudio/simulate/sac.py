"""Selective activation checkpointing (SAC) replays: how a plan runs once exported with ``--format sac``.

``acstudio.apply_plan`` wraps each block that frees something in a non-reentrant ``torch.utils.checkpoint`` whose
policy saves or recomputes whole *ops*. The blocks are the repeated ones (``layer1.0``, ``transformer.h.3``) and, for
one rank under FSDP2/DDP, the modules around them (:func:`~acstudio.profile.blocks.sac_blocks`): a decoder's final
norm and LM head hold activations at the loss, where its peak is. That form differs from the
rewritten graph's in four ways, all simulated here:

* **Decisions are per op, not per storage.** An op is saved (``MUST_SAVE``: SAC caches all its outputs) when any
  storage it writes is kept, and always when it updates module state in place (``num_batches_tracked += 1``) or
  reads a value that an in-place op overwrites later in forward and that the replay does not recompute (it would
  read the new value); in eager a block's random ops are all saved or all recomputed (the replay draws from the
  generator state the block started with), under torch.compile each is decided alone (each recomputed random op
  keeps its own generator state), and the policy file marks the ops eager saves only for that rule
  (:mod:`acstudio.export.sac`). Everything else is recomputed (``MUST_RECOMPUTE``), training-mode BatchNorm
  included: its output does not depend on the running statistics, and ``apply_plan`` puts the block's buffers back
  after each replay, so they are updated once, as in eager. So an activation the plan frees stays in memory when its
  op also writes a kept storage, and activations that leave their block (the next block's input) are always kept:
  the checkpoint's caller holds them.
* **One replay per block, at the first backward use of anything the block saved**, i.e. the first backward node
  that reads a forward value of the block. It reruns the block's forward up to the last value backward reads
  (non-reentrant checkpoint's early stop), serving saved ops from the cache, and produces *every* activation
  the block frees; each stays until its last backward use (as in shared chains).
* **Blocks that free nothing are not wrapped** and run as in eager.
* **Offload is per op too.** A saved op whose output is one activation, written by it alone and offloadable, may
  be offloaded: ``acstudio.apply_plan`` routes SAC's cache of its output through saved-tensors hooks that copy it
  to pinned host memory on a side stream and back. The copies are priced by
  :func:`~acstudio.simulate.offload.offload_schedule` beside the blocks' replays: the copy out is issued right after
  the op (SAC caches its output there, as the schedule assumes), and one that the replay reads is back before the
  replay. The schedule issues each copy back as late as lets it land in time; ``apply_plan`` issues a block's
  copies back when its own replay starts and when the replay of the block after it (in forward order) starts, so
  they are usually back earlier than predicted (a block's offloaded bytes sooner on the device) and stall where the
  schedule would have issued them before that block's replay. Activations that leave their block, outputs of
  ops with more than one, and what runs outside the wrapped blocks stay on the device (the rewritten step offloads
  those). Under torch.compile ("sac-compiled") offload is per block instead: a block compiled on its own hands
  everything it saves to the hooks when its forward ends (:meth:`ReplaySacCompiled.offload`).

Memory is then the simulator's with each freed activation back from its block's replay and each replay's
high-water mark (:meth:`~acstudio.simulate.replay.ReplayGraph.transient_bytes`) counting the activations it
keeps, plus the outputs of saved ops that backward never reads (SAC's cache holds them until the replay: the
residual branch's BatchNorm output in a ResNet block) and the block's arguments, which the checkpoint keeps
until the block's backward has run (BERT's attention mask).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from acstudio.profile.model import Profile
from acstudio.profile.replay_rules import BATCH_NORM_OPS
from acstudio.simulate.modes import ReplayMode, register_mode
from acstudio.simulate.offload import (
    HeldStorages,
    OffloadSchedule,
    RegionCopies,
    SavedCopies,
    offload_schedule,
)
from acstudio.simulate.replay import FORWARD_REGIONS, Replay, is_attention, is_inplace
from acstudio.simulate.shared import SharedSchedule, evaluate_shared
from acstudio.simulate.simulator import SimResult, Simulator

# What a compiled region's hooks leave on the device: a copy of a smaller tensor costs more than it frees
# (the runtime's threshold too, acstudio.export.apply.REGION_MIN_BYTES)
REGION_MIN_BYTES = 2**20
SAVE = "save"
RECOMPUTE = "recompute"
OFFLOAD = "offload"  # saved, its output copied to host memory and back (see the module)
MASK_FROM_SHAPE = {"aten.native_dropout.default"}  # its second output, the mask, reads only the input's shape
LAYER_NORM_OPS = {"aten.native_layer_norm.default"}  # compiled, saved, their backward reads the normalized input
NORM_BACKWARD = "aten.native_layer_norm_backward.default"  # inputs: gradient, input, mean, rstd, weight, bias
UPDATES_STATE = "updates module state"  # why an op is saved whatever the plan (BatchNorm's num_batches_tracked += 1)


def is_op(node) -> bool:
    """A node the SAC policy sees: an operator call (not ``getitem`` on a multi-output op, not a constant)."""
    return node.op == "call_function" and node.target != "operator.getitem"


# Host time of one call of SAC's policy in eager (its dispatch mode runs Python for every op of a block that runs the
# policy, in forward and in the replay): the step time every block under the policy adds over plain checkpoints,
# divided by the policy calls, measured on a decoder and on a CNN on the GPU (docs/results.md); this is the lower of
# the two, so the planner never overprices a policy.
SAC_DISPATCH_MS = 0.0207


@dataclass
class SacSchedule(SharedSchedule):
    """A shared schedule plus the non-activation storages SAC keeps beyond their eager lifetime: rows (first,
    last node they are now alive during, bytes); and the host time of SAC's dispatch mode in eager."""

    cached: np.ndarray
    dispatch_ms: float = 0.0
    recomputed: Sequence[int] = ()  # the activation indices it replays (what the SAC form can offload follows)
    # compiled: per block, the rows of ``cached`` its compiled step saves (outputs of saved ops that its pruned
    # replay reads), which a block compiled alone hands to saved-tensors hooks with its activations
    saved_rows: dict[str, list[int]] = field(default_factory=dict)
    # compiled: per block, the outputs it recomputes at their first backward use (SacBlocks.recomputed_at_first_use)
    late: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def extra_ms(self) -> float:
        return super().extra_ms + self.dispatch_ms


def cache_memory(sim: Simulator, schedule: SacSchedule) -> tuple[np.ndarray, np.ndarray]:
    """Bytes of non-activation storages SAC keeps longer than eager, during and just before each node."""
    c = schedule.cached
    return sim._span(c[:, 0], c[:, 1], c[:, 2]), sim._span(c[:, 0], c[:, 1] + 1, c[:, 2])


def evaluate_sac(sim: Simulator, schedule: SacSchedule, timeline: bool = False, extra=None):
    """:func:`~acstudio.simulate.shared.evaluate_shared` with the cached non-activation outputs added (and
    ``extra``: offloaded activations' memory taken out), and no generator state per random op: the checkpoint keeps
    one per block (16 bytes on CUDA), not counted."""
    cached = cache_memory(sim, schedule)
    if extra is not None:
        cached = (cached[0] + extra[0], cached[1] + extra[1])
    return evaluate_shared(sim, schedule, timeline, extra=cached, rng_states=False)


class SacBlocks:
    """Static SAC facts of a profile: each forward node's block, what it writes and reads, when blocks replay."""

    def __init__(self, sim: Simulator) -> None:
        from acstudio.profile.blocks import sac_blocks

        self.sim = sim
        profile, rg = sim.profile, sim.replay
        nodes, index = profile.nodes, profile.node_index
        fw = [i for i, nd in enumerate(nodes) if nd.region in FORWARD_REGIONS]
        # One rank under FSDP2/DDP compiles each block alone (torchtitan's regional compilation, as `acstudio bench`
        # runs it) and the modules around the blocks eager, where the SAC form is exact: it wraps them too. On one
        # device the whole model may be compiled, and the compiled prediction is calibrated on compile+per-block,
        # which wraps the repeated blocks only (see acstudio.plan.compiled).
        self.regional = "sharding" in profile.environment  # each block compiled alone (see recomputed_at_first_use)
        block_of = sac_blocks([nodes[i].module for i in fw], around=self.regional)
        self.block = [""] * len(nodes)
        for i in fw:
            self.block[i] = block_of.get(nodes[i].module, "")
        self.blocks = sorted({b for b in self.block if b}, key=lambda b: self.block.index(b))
        self.fw_nodes = {b: [i for i in fw if self.block[i] == b and nodes[i].op == "call_function"]
                         for b in self.blocks}
        created: dict[int, list[str]] = {}
        # Forward storages that are not activations: (bytes, last node that needs them) by storage id, and by
        # creating node. SAC holds a saved op's ones until the replay, and a block's arguments until its backward.
        self.scratch: dict[str, tuple[int, int]] = {}
        self.scratch_made: dict[int, list[str]] = {}
        self.node_storage = [nd.storage for nd in nodes]  # the storage each node writes
        for t in profile.tensors:
            i = index[t.created_at]
            created.setdefault(i, []).append(t.id)
            if t.id not in rg.act_index and t.bytes and nodes[i].region in FORWARD_REGIONS and t.freed_after:
                self.scratch[t.id] = (t.bytes, index[t.freed_after])
                self.scratch_made.setdefault(i, []).append(t.id)
        # Activation indices each forward node writes (allocates, aliases or updates in place).
        self.writes = {i: sorted({rg.act_index[s] for s in [*created.get(i, []), nodes[i].storage]
                                  if s in rg.act_index}) for i in fw}
        self.writers: dict[int, list[int]] = {}  # activation -> forward nodes that write it
        for i, ks in self.writes.items():
            for k in ks:
                self.writers.setdefault(k, []).append(i)
        inputs = [[index[u] for u in nd.inputs] for nd in nodes]
        self.forced = {i: self._forced_reason(rg._verdict[i]) for i in fw}
        draws = set(rg.rng_nodes.tolist())
        self.random_ops = {b: [i for i in ops if i in draws] for b, ops in self.fw_nodes.items()}
        # Inputs each forward op reads that an in-place op overwrites later in forward. A replay reads them right
        # only if it recomputes them too (see decide). BatchNorm reads the running statistics it updates only to
        # update them, so it may read them updated.
        self.stale_reads = {i: [u for u in inputs[i] if rg._stale[u]] if nodes[i].target not in BATCH_NORM_OPS
                            else [] for i in fw}
        # Activations that leave their block in forward: the caller holds them, SAC cannot free them.
        self.leaves = np.zeros(len(rg.bytes), dtype=bool)
        for i in fw:
            for u in inputs[i]:
                if self.block[u] != self.block[i]:
                    own = [k for k in self.writes.get(u, []) if self.block[rg.created[k]] == self.block[u]]
                    self.leaves[own] = True
        # First backward node that unpacks a value the block saved (the checkpoint's replay), last forward node
        # such an unpack reads (its early stop), last backward node reading any of its values. A leaving value
        # read in backward through a node other than its saved-output alias is a neighbour's read (the next block's
        # checkpoint holds it as its argument): it does not replay this block.
        self.replay_at: dict[str, int] = {}
        self.stop: dict[str, int] = {}
        self.backward_end: dict[str, int] = {}
        for j, nd in enumerate(nodes):
            if nd.region != "backward":
                continue
            for u in inputs[j]:
                b = self.block[u]
                if not b:
                    continue
                self.backward_end[b] = j
                writes = self.writes.get(u, [])
                if writes and self.leaves[writes].all() and nodes[u].target != "aten.alias.default":
                    continue
                self.replay_at.setdefault(b, j)
                self.stop[b] = max(self.stop.get(b, -1), u)
        # Leaving activations that their own block neither reads nor saves: the block's replay never makes them
        # again, so only the caller holds them, and their op need not be saved (compiled, that would force the
        # partitioner to save them: the last decoder layer's output, which only the final norm reads). Backward
        # nodes carry no reliable block, so "saves" is read from forward: make_fx records autograd saving an op's
        # own output as an ``alias`` of it (a ResNet block's ReLU output, which its backward reads). A ``getitem`` on
        # a multi-output op reads nothing, and the next block reading a value through its own view of it is not
        # this block's read (BERT's closing LayerNorm: its output passes through, its statistics do not).
        own_reads = np.zeros(len(rg.bytes), dtype=bool)
        for i in fw:
            if nodes[i].target == "operator.getitem":  # picks an output of a multi-output op; reads nothing
                continue
            writes = {k for k in self.writes[i] if self.block[rg.created[k]] == self.block[i]}
            read = {k for u in inputs[i] if self.block[u] == self.block[i] for k in self.writes.get(u, [])
                    if self.block[rg.created[k]] == self.block[i]}
            if nodes[i].target == "aten.alias.default":
                own_reads[list(writes)] = True
            own_reads[list(read - writes)] = True
        self.passes_through = self.leaves & ~own_reads
        # Forward nodes of other blocks or of no block that read each leaving activation.
        self.outside_readers: dict[int, list[int]] = {}
        for i in fw:
            for u in inputs[i]:
                for k in self.writes.get(u, []):
                    if self.leaves[k] and self.block[i] != self.act_block[k]:
                        self.outside_readers.setdefault(k, []).append(i)
        self._moved: dict[tuple[int, int, tuple[int, ...]], tuple[Replay, Replay]] = {}
        self._forms: dict[tuple[str, frozenset[int], bool], _BlockForm] = {}
        self.pruned: dict[int, Replay] = {}  # id of a replay in _forms -> it with sac-compiled's time
        self._needed_of: dict[int, tuple[Replay, dict[int, bool]]] = {}  # id of a replay -> it, what it needs
        self.inputs = inputs
        # Backward nodes reading each activation, and each layer norm's backward's forward norm (by its statistics)
        self.backward_readers: dict[int, list[int]] = {}
        self.norm_of_backward: dict[int, int] = {}
        for j, nd in enumerate(nodes):
            if nd.region != "backward":
                continue
            for u in inputs[j]:
                for k in self.writes.get(u, ()):
                    self.backward_readers.setdefault(k, []).append(j)
            if nd.target == NORM_BACKWARD and len(inputs[j]) > 2:
                norm = index.get(nodes[inputs[j][2]].storage.split(".")[0])
                if norm is not None and nodes[norm].target in LAYER_NORM_OPS:
                    self.norm_of_backward[j] = norm
        # Views of values from outside the block (the rotary cos/sin that a decoder layer unsqueezes): replaying one
        # costs nothing and holds nothing new, so it is recomputed; saving it would make a block that recomputes
        # everything else run SAC's per-op dispatch in eager instead of a plain checkpoint.
        self.outside_views = {i for i in fw if not created.get(i) and not nodes[i].target.split(".")[1].endswith("_")
                              and self.writes[i] and all(self.block[rg.created[k]] != self.block[i]
                                                         for k in self.writes[i])}

    @staticmethod
    def _forced_reason(verdict: str) -> str:
        if verdict.startswith("random"):  # a draw that may not be repeated (--keep-random)
            return "draws random numbers"
        if verdict.startswith("mutates"):
            return UPDATES_STATE
        return ""

    @cached_property
    def freeable(self) -> np.ndarray:
        """Activations SAC can free at all: candidates created by an op of a block that do not leave it and
        that no op with a forced save writes."""
        rg = self.sim.replay
        ok = rg.is_candidate & ~self.leaves
        ok &= np.array([bool(self.block[c]) for c in rg.created], dtype=bool)
        for i, why in self.forced.items():
            if why:
                ok[self.writes[i]] = False
        return ok

    def decide(self, recomputed: Collection[int], compiled: bool = False) -> tuple[dict[int, str], np.ndarray]:
        """(decision per forward op of a block, mask of the activations the SAC form really frees); ``compiled``:
        as the form runs under torch.compile, random ops decided one by one (see :meth:`_block`).

        Each block decides alone (:meth:`_block`): what an op of one block writes or reads in another block is
        never freeable (it leaves its block)."""
        decision: dict[int, str] = {}
        freed = np.zeros(len(self.sim.replay.bytes), dtype=bool)
        for b, asked in self._asked(recomputed).items():
            part = self._block(b, asked, compiled)
            decision.update(part.decision)
            freed[list(part.freed)] = True
        return decision, freed

    def offloadable(self, recomputed: Collection[int]) -> np.ndarray:
        """Per activation, whether the SAC form of ``recomputed`` can offload it: the output of a saved op of a
        block (not one saved because it updates module state or draws random numbers) that writes nothing else,
        kept there and not leaving the block, that no later op updates in place (the copy is taken when the op has
        run), and offloadable at all (:class:`~acstudio.simulate.offload.OffloadFacts`). Saved views of it are
        cached as views of the one copy (``apply_plan`` offloads by storage), so they hold nothing on the device."""
        decision, freed = self.decide(recomputed)
        sim, nodes = self.sim, self.sim.profile.nodes
        ok = sim.offload_facts.offloadable & ~freed & ~self.leaves
        for k in np.flatnonzero(ok):
            i = int(sim.replay.created[k])
            ok[k] = (decision.get(i) == SAVE and not self.forced[i] and is_op(nodes[i]) and i not in self.outside_views
                     and self.writes[i] == [k] and not self.scratch_made.get(i)
                     and not any(is_inplace(nodes[j].target) for j in self.writers[k] if j != i))
        return ok

    def _asked(self, recomputed: Collection[int]) -> dict[str, frozenset[int]]:
        """Per block, the freeable activations of ``recomputed`` it created."""
        asked: dict[str, set[int]] = {b: set() for b in self.blocks}
        for k in recomputed:
            if self.freeable[k]:
                asked[self.act_block[k]].add(int(k))
        return {b: frozenset(ks) for b, ks in asked.items()}

    @cached_property
    def act_block(self) -> list[str]:
        """Per activation: the block of the node that created it."""
        return [self.block[c] for c in self.sim.replay.created]

    def _block(self, b: str, asked: frozenset[int], compiled: bool = False) -> _BlockForm:
        """Block ``b``'s decisions, frees and replay when the plan frees ``asked`` there (memoized: a planner's
        trial changes one block, so the others are looked up).

        Fixed point: an op that writes a kept activation is saved, which keeps everything else it writes. An op
        that reads a value overwritten in place later in forward is saved unless the replay recomputes that value
        too (SAC would serve the overwritten one from its cache, or the caller holds it). In eager a block's random
        ops are all saved or all recomputed: the checkpoint replays from the generator state the block started
        with, so the replay draws what forward drew only if it runs every draw forward ran. ``compiled``: each is
        decided alone, as the partitioner gives every recomputed random op its own saved generator state (RNG
        functionalization), so a block that saves attention's dropout may still recompute its other dropouts.
        """
        key = (b, asked, compiled)
        if key in self._forms:
            return self._forms[key]
        freed = set(asked)
        random_saved = False  # eager: the block's random ops are all saved
        passes = self.passes_through  # only the caller holds them: saving their op would just force a compiled save
        views = self.outside_views
        while True:
            save: dict[int, bool] = {}
            for i in self.fw_nodes[b]:  # forward order: what i reads is decided before i
                writes_kept = i not in views and any(not (k in freed or passes[k]) for k in self.writes[i])
                save[i] = (bool(self.forced[i]) or writes_kept
                           or any(self.block[u] != b or save.get(u, True) for u in self.stale_reads[i])
                           or (random_saved and i in self.random_ops[b]))
            newly = not compiled and not random_saved and any(save[i] for i in self.random_ops[b])
            kept = {k for i, s in save.items() if s for k in self.writes[i] if k in freed}
            if not kept and not newly:
                break
            random_saved |= newly
            freed -= kept
        decision = {i: SAVE if s else RECOMPUTE for i, s in save.items()}
        replay, *rest = self._replay(b, decision, freed)
        runs_policy = any(d == SAVE and self.forced[i] != UPDATES_STATE for i, d in decision.items())
        calls = self.op_count[b] + (len(replay.nodes) if replay is not None else 0) if runs_policy else 0
        form = self._forms[key] = _BlockForm(decision, tuple(sorted(freed)), replay, *rest, runs_policy, calls)
        return form

    @cached_property
    def op_count(self) -> dict[str, int]:
        """Per block, the ops of its forward that SAC's policy sees."""
        nodes = self.sim.profile.nodes
        return {b: sum(is_op(nodes[i]) for i in ops) for b, ops in self.fw_nodes.items()}

    def _replay(self, b: str, decision: dict[int, str], freed: set[int]):
        """Block ``b``'s replay (None when it frees nothing), the scratch storages its saved ops keep until it, its
        arguments' scratch storages, and the kept activations it reads."""
        if not freed:
            return None, {}, set(), ()
        rg, storage = self.sim.replay, self.node_storage
        at, stop = self.replay_at[b], self.stop[b]
        saved_scratch = {t: at for i in self.fw_nodes[b] if decision[i] == SAVE for t in self.scratch_made.get(i, [])}
        args = {storage[u] for i in self.fw_nodes[b] for u in self.inputs[i] if self.block[u] != b}
        nodes = np.array([i for i in self.fw_nodes[b] if i <= stop and decision[i] == RECOMPUTE], dtype=np.int64)
        made = {k for i in nodes for k in self.writes[i]}
        sources = sorted({k for i in nodes for u in self.inputs[i] for k in self.writes.get(u, []) if k not in made})
        outputs = tuple(sorted(freed))
        replay = Replay(at, outputs, outputs, tuple(sources), (), nodes, float(rg.run_ms[nodes].sum()),
                        rg.transient_bytes(list(outputs), nodes))
        return replay, saved_scratch, args & self.scratch.keys(), tuple(s for s in sources if s not in freed)

    def dispatch_ms(self, recomputed: Collection[int]) -> float:
        """Eager host time of SAC's dispatch mode: a policy call per forward op and per replayed op of each block
        that runs the policy (:data:`SAC_DISPATCH_MS` each)."""
        return SAC_DISPATCH_MS * sum(self._block(b, asked).policy_calls for b, asked in self._asked(recomputed).items())

    def runs_policy(self, recomputed: Collection[int]) -> set[str]:
        """Blocks whose SAC form saves an op other than a module-state update: eager runs them under SAC's dispatch
        mode; a block that frees something and saves nothing else runs a plain checkpoint (acstudio.apply_plan)."""
        return {b for b, asked in self._asked(recomputed).items() if self._block(b, asked).runs_policy}

    def needed(self, replay: Replay) -> list[int]:
        """The replayed nodes the replay's outputs depend on (what the compiled step recomputes)."""
        return sorted(self._needed(replay))

    def _needed(self, replay: Replay) -> dict[int, bool]:
        """The replayed nodes the replay's outputs depend on, each with whether what is needed of it needs its
        inputs: not where only a dropout's mask is (compiled, a dropout draws its mask from its input's shape,
        ``rand_like`` decomposed to ``rand``, so recomputing the mask reruns nothing before it). Once per replay:
        the replays are the block forms' (kept in ``_forms`` and ``_moved``), so their identity is stable."""
        known = self._needed_of.get(id(replay))
        if known is None or known[0] is not replay:
            known = self._needed_of[id(replay)] = (replay, self._walk_needed(replay))
        return known[1]

    def _walk_needed(self, replay: Replay) -> dict[int, bool]:
        nodes, act_ids = self.sim.profile.nodes, self.sim.replay.act_ids
        replayed = set(replay.nodes.tolist())

        def reads_inputs(i: int, storage: str) -> bool:
            return nodes[i].target not in MASK_FROM_SHAPE or storage == nodes[i].storage

        todo = [(i, reads_inputs(i, act_ids[k])) for k in replay.outputs if not self.read_by_saved_norms(k, replayed)
                for i in self.writers[k] if i in replayed]
        whole: dict[int, bool] = {}
        while todo:
            i, reads = todo.pop()
            if whole.get(i, False) or (i in whole and not reads):
                continue
            whole[i] = reads
            if reads:
                picked = nodes[i].storage if nodes[i].target == "operator.getitem" else None
                todo.extend((u, reads_inputs(u, picked or nodes[u].storage)) for u in self.inputs[i] if u in replayed)
        return whole

    def read_by_saved_norms(self, k: int, replayed: Collection[int]) -> bool:
        """Whether backward reads activation ``k`` only as the input of layer norms that the replay (of nodes
        ``replayed``) does not recompute, i.e. saved ones: compiled, their backward reads the normalized input
        saved in forward instead (:meth:`compiled_normalized`), so nothing recomputes ``k`` for them."""
        readers = self.backward_readers.get(k)
        return bool(readers) and all(j in self.norm_of_backward and self.norm_of_backward[j] not in replayed
                                     and k in self.writes.get(self.inputs[j][1], ()) for j in readers)

    def compiled_scratch(self, form: _BlockForm) -> dict[str, int]:
        """The part of ``form.saved_scratch`` the compiled step saves: outputs of saved ops that its pruned replay
        reads (a saved dropout's output that the recomputed residual add reads); the partitioner saves no other."""
        if form.replay is None or not form.saved_scratch:
            return {}
        read = self._pruned_reads(form.replay)
        return {t: at for t, at in form.saved_scratch.items() if t in read}

    def _pruned_reads(self, replay: Replay) -> set[str]:
        """The storages that the nodes the compiled step replays of ``replay`` (:meth:`_needed`) read."""
        storage = self.node_storage
        return {storage[u] for i, reads in self._needed(replay).items() if reads for u in self.inputs[i]}

    def compiled_normalized(self, form: _BlockForm) -> list[tuple[int, int]]:
        """The saved layer norms of a block whose compiled step holds their normalized input as well as what the
        plan simulates, each as (its node, the normalized input's bytes). Inductor computes a saved layer norm's
        normalized input in forward and saves it for the norm's backward, which then reads neither the input
        (:meth:`read_by_saved_norms`) nor a recomputation of it. Where the plan keeps the input and nothing else
        needs it, the normalized input is held in its place, the same bytes; it is held as well where the input is
        one the plan frees (GPT-2's ``ln_2`` kept, its residual add recomputed: the replay no longer makes it, the
        forward holds its normalized form) or one the pruned replay reads (GPT-2's ``ln_1`` kept, the residual add
        after the attention recomputed from the block's input). Measured on GPT-2 (H200): seq 2048's first plan in
        the bias form peaked 2.2% over its prediction, one hidden state per block so planned, and its regions copied
        them too (``results/probes/compiled_form_peak_gpt2-s2048_bias_h200.txt``); counted, the plans that ran at
        seq 1024 and 2048 copy what was measured, to the byte, and peak within 0.1% of it
        (``tests/test_compiled_offload.py``)."""
        nodes = self.sim.profile.nodes
        norms = [i for i, how in form.decision.items() if how == SAVE and nodes[i].target in LAYER_NORM_OPS
                 and self.inputs[i]]
        if form.replay is None or not norms:
            return []
        storage = self.node_storage
        read = self._pruned_reads(form.replay) | {self.sim.replay.act_ids[k] for k in form.freed}
        return [(i, self.sim.profile.tensor_bytes[storage[i]]) for i in norms if storage[self.inputs[i][0]] in read]

    def schedule(self, recomputed: Collection[int], compiled: bool = False, blocks_alone: bool = False
                 ) -> SharedSchedule:
        """One replay per block that frees something, in the order they run. ``compiled``: the form as it runs
        under torch.compile, random ops decided one by one (:meth:`_block`), and the saved ops' outputs held until
        the replay only those the compiled step saves (:meth:`compiled_scratch`); eager SAC's cache holds every
        output of a saved op. ``blocks_alone``: every block compiled alone (:meth:`recomputed_at_first_use`)."""
        n_act = len(self.sim.replay.bytes)
        back = np.full(n_act, -1, dtype=np.int64)
        keep_until = np.full(n_act, -1, dtype=np.int64)
        replays, held, saved_by, normalized = [], {}, {}, []
        forms = {b: self._block(b, asked, compiled) for b, asked in self._asked(recomputed).items()}
        late = self.recomputed_at_first_use(forms, blocks_alone) if compiled else {}
        for b, form in forms.items():
            if form.replay is None:
                continue
            replay = self._moved_replay(form.replay, late[b]) if b in late else form.replay
            at = replay.at
            scratch = self.compiled_scratch(form) if compiled else form.saved_scratch
            held.update({t: min(until, at) for t, until in scratch.items()})
            if compiled:
                saved_by.update(dict.fromkeys(scratch, b))
                normalized += [(b, i, nbytes) for i, nbytes in self.compiled_normalized(form)]
            for t in form.arg_scratch:
                held[t] = max(held.get(t, -1), self.backward_end[b] + 1)
            for s in form.kept_sources:
                keep_until[s] = max(keep_until[s], at)
            back[list(replay.outputs)] = at
            replays.append(replay)
        replays.sort(key=lambda r: r.at)
        cached = [(self.scratch[t][1] + 1, until - 1, self.scratch[t][0]) for t, until in held.items()]
        saved_rows: dict[str, list[int]] = {}
        for row, t in enumerate(held):
            if t in saved_by:
                saved_rows.setdefault(saved_by[t], []).append(row)
        for b, i, nbytes in normalized:  # from the norm's forward to its block's backward end
            saved_rows.setdefault(b, []).append(len(cached))
            cached.append((i, self.backward_end[b], nbytes))
        return SacSchedule(replays, back, keep_until, np.array(cached, dtype=np.int64).reshape(-1, 3),
                           recomputed=recomputed, saved_rows=saved_rows, late=late)


    def recomputed_at_first_use(self, forms: dict[str, _BlockForm], blocks_alone: bool = False
                                ) -> dict[str, tuple[int, ...]]:
        """Per wrapped block, the activations leaving it that the compiled step does not hold from forward: written
        by recomputed ops only and read outside the block by no recomputed op of another wrapped block (the last
        layer's output, which only the loss head reads). The partitioner saves a checkpointed region's output only
        for a later region that recomputes from it (``cleanup_recompute_tags``), so this one is recomputed in
        backward, at its first use, from what its block saved; eager, the checkpoint's caller holds it. Not under
        FSDP2/DDP, where each block is compiled alone: its output leaves the compiled graph, and the caller holds
        it; nor with ``blocks_alone``, every block compiled alone because one is for offload
        (:meth:`ReplaySacCompiled.offload`), where the next block saves its input (measured on the CPU:
        ``tests/test_compiled_offload.py``, the runtime's count of its copies).

        Nor where a saved layer norm of a wrapped block reads it (GPT-2's next ``ln_1``, kept): compiled, that norm's
        backward reads its normalized input, which Inductor computes in forward and saves, the same bytes held in
        its place. Measured on GPT-2 (seq 512, H200; ``results/probes/compiled_saved_bytes_gpt2-s512_offload-set_h200
        .txt``): a plan keeping every ``ln_1`` saved one hidden state per layer more than the model held then, and
        peaked 525 MiB over its prediction."""
        if self.regional or blocks_alone:
            return {}
        wrapped = {b for b, form in forms.items() if form.replay is not None}
        nodes = self.sim.profile.nodes

        def recomputed_in_wrapped(i: int) -> bool:
            return self.block[i] in wrapped and forms[self.block[i]].decision.get(i) == RECOMPUTE

        def saved_norm(i: int) -> bool:
            return (nodes[i].target in LAYER_NORM_OPS and self.block[i] in wrapped
                    and forms[self.block[i]].decision.get(i) == SAVE)

        late: dict[str, list[int]] = {}
        for k, readers in self.outside_readers.items():
            b = self.act_block[k]
            if b not in wrapped or not self.passes_through[k]:
                continue
            writers = [j for j in self.writers[k] if self.block[j] == b]
            if (all(forms[b].decision[j] == RECOMPUTE for j in writers)
                    and not any(recomputed_in_wrapped(i) or saved_norm(i) for i in readers)):
                late.setdefault(b, []).append(k)
        return {b: tuple(sorted(ks)) for b, ks in late.items()}

    def holders(self, k: int) -> list[str]:
        """The blocks whose forward holds activation ``k`` (its own and those that read it; "" for code outside
        every block): a block compiled on its own saves what it made and its arguments, so each may save it. Its
        maker does not where ``k`` only passes through it (neither read nor saved there): the embeddings' output,
        which only the first block reads, is held by that block alone (measured: the runtime offloads it with
        the first region; results/superseded/grid-bert-s512.compiled-h100-uncounted-copies.json)."""
        readers = [self.block[i] for i in self.outside_readers.get(k, ())]
        maker = [] if self.passes_through[k] and readers else [self.act_block[k]]
        return list(dict.fromkeys([*maker, *readers]))

    @cached_property
    def region_copies(self) -> RegionCopies:
        """Where a runtime that offloads what whole blocks save (each compiled alone inside saved-tensors hooks)
        issues an activation's copies: out when the last block holding it ends its forward, back by the first
        node of the first of those blocks' backwards, and issued where a block's backward starts (its
        ``replay_at``: the first backward node that reads what it saved). -1 / n where a holder is no block."""
        rg, n = self.sim.replay, self.sim.n
        last_fw = {b: max(ns) for b, ns in self.fw_nodes.items() if ns}
        ready = np.full(len(rg.bytes), -1, dtype=np.int64)
        needed = np.full(len(rg.bytes), n, dtype=np.int64)
        for k in range(len(rg.bytes)):
            hs = self.holders(k)
            if all(b in last_fw and b in self.replay_at for b in hs):
                ready[k] = max(last_fw[b] for b in hs)
                needed[k] = min(self.replay_at[b] for b in hs)
        return RegionCopies(ready, needed, np.array(sorted(set(self.replay_at.values())), dtype=np.int64))

    @cached_property
    def mask_biases(self) -> dict[int, list[int]]:
        """Per boolean attention mask made before the blocks and handed to them (its node), the activations inside
        the blocks that are SDPA's additive bias of it: a ``where`` of the mask (batch x 1 x query x key) between
        two scalars that an attention op reads, directly or through an ``expand``. With regions, the runtime makes
        that bias once before the blocks and hands it to each of them in place of the mask
        (:func:`acstudio.export.apply.hand_blocks_mask_bias`): no block makes, saves or copies its own."""
        nodes, index, rg = self.sim.profile.nodes, self.sim.profile.node_index, self.sim.replay
        users: dict[int, list[int]] = {}
        for i, nd in enumerate(nodes):
            for u in nd.inputs:
                users.setdefault(index[u], []).append(i)

        def attends(i: int) -> bool:
            return any(is_attention(nodes[j].target) or (nodes[j].target == "aten.expand.default"
                                                         and any(is_attention(nodes[a].target)
                                                                 for a in users.get(j, ())))
                       for j in users.get(i, ()))

        biases: dict[int, list[int]] = {}
        for i, nd in enumerate(nodes):
            if nd.target != "aten.where.self" or not self.block[i] or not nd.inputs or not attends(i):
                continue
            m = index[nd.inputs[0]]
            dims = nodes[m].shape.split("x")
            if nodes[m].dtype == "bool" and len(dims) == 4 and dims[1] == "1" and not self.block[m]:
                biases.setdefault(m, []).extend(k for k in self.writes.get(i, []) if rg.bytes[k])
        return {m: ks for m, ks in biases.items() if ks}

    def mask_bias_held(self, recomputed: Collection[int]) -> HeldStorages | None:
        """The biases the runtime makes of the masks (:attr:`mask_biases`) where a plan runs regions: one per
        mask, as large as a block's, held from the first block's ``where`` (where the runtime makes it) to the
        last backward read of any block's (every block's saved tensors hold it). A block's own bias that the
        plan of ``recomputed`` keeps is that same storage, which the schedule already holds over the block's span:
        it is taken off again there (an entry of negative bytes), so that the one bias counts once. Counted twice,
        BERT seq 2048's plan that kept layer 1's peaked 300 MiB under its prediction (H200, 2026-11-29)."""
        if not self.mask_biases:
            return None
        rg = self.sim.replay
        _, freed = self.decide(recomputed, compiled=True)
        held = []
        for ks in map(np.asarray, self.mask_biases.values()):
            held.append((int(rg.bytes[ks].max()), int(rg.created[ks].min()), int(rg.last_bw[ks].max())))
            held += [(-int(rg.bytes[k]), int(rg.created[k]), int(rg.last_bw[k])) for k in ks if not freed[k]]
        return HeldStorages(*(np.array(c, dtype=np.int64) for c in zip(*held)))

    def region_held(self, recomputed: Collection[int], regions: Collection[str], mask_bias: bool = False
                    ) -> list[int]:
        """The activations that ``regions`` (blocks, each compiled alone, their saved tensors offloaded) copy to
        the host under the compiled form of ``recomputed``: kept, read in backward, of at least
        :data:`REGION_MIN_BYTES`, held by those blocks only (an output that an offloaded block passes to one that
        keeps, or to the loss head, stays) and offloadable at all (:class:`~acstudio.simulate.offload.OffloadFacts`).
        With ``mask_bias`` (the blocks are handed SDPA's bias of their mask), not the blocks' own biases."""
        rg, facts, copies = self.sim.replay, self.sim.offload_facts, self.region_copies
        _, freed = self.decide(recomputed, compiled=True)
        regions = set(regions)
        biases = {k for ks in self.mask_biases.values() for k in ks} if mask_bias else set()  # handed in
        return [k for k in range(len(rg.bytes))
                if not freed[k] and rg.bytes[k] >= REGION_MIN_BYTES and rg.first_bw[k] < self.sim.n
                and facts.offloadable[k] and copies.ready[k] >= 0 and set(self.holders(k)) <= regions
                and k not in biases]

    def region_saved(self, schedule: SacSchedule, regions: Collection[str]) -> SavedCopies | None:
        """What ``regions`` (blocks compiled alone inside saved-tensors hooks) copy besides activations: the
        outputs of saved ops their compiled step saves for the pruned replay (``schedule.saved_rows``: a saved
        dropout's output, which the recomputed residual add reads) of at least :data:`REGION_MIN_BYTES`. Copied
        out when the block's forward ends, needed back when its backward starts. Measured on BERT: two such
        outputs per layer, 1152 MiB over six offloaded layers that the plan had not counted
        (results/superseded/grid-bert-s512.compiled-h100-uncounted-copies.json, ``offload_bytes_measured``); counted,
        the H200 reruns copied exactly the planned bytes (results/grid/bert-s*.compiled.json)."""
        copies = [(r, max(self.fw_nodes[b]), self.replay_at[b]) for b in regions if b in self.replay_at
                  for r in schedule.saved_rows.get(b, ()) if schedule.cached[r, 2] >= REGION_MIN_BYTES]
        if not copies:
            return None
        rows, ready, needed = (np.array(c, dtype=np.int64) for c in zip(*copies))
        return SavedCopies(schedule.cached[rows, 2].astype(np.int64), ready, needed)

    def fetched_by(self, copies: OffloadSchedule) -> dict[str, str]:
        """Per block whose saves ``copies`` (the compiled mode's :meth:`ReplaySacCompiled.offload`) offload, in
        forward order, the block at whose backward start they are fetched: the last backward start at or before
        the earliest copy back of its activations. (A copy back waits for its copy out, so where that ends inside
        the backward the simulated copy back starts after the backward start that issues it.)"""
        at_node = {n: b for b, n in self.replay_at.items()}
        starts = sorted(at_node)
        fetch: dict[str, int] = {}
        for k, node in zip(copies.offloaded.tolist(), copies.prefetch.tolist()):
            for b in self.holders(k):
                fetch[b] = min(fetch.get(b, node), node)
        return {b: at_node[starts[max(bisect.bisect_right(starts, fetch[b]) - 1, 0)]]
                for b in self.blocks if b in fetch}

    def _moved_replay(self, replay: Replay, outputs: tuple[int, ...]) -> Replay:
        """``replay`` with ``outputs`` added, run at the first backward use of any of them if that comes first
        (what the compiled step recomputes for them runs the block's forward there), one object per combination
        (the compiled mode prices replays by identity)."""
        at = min(replay.at, *(int(self.sim.replay.first_bw[k]) for k in outputs))
        key = (id(replay), at, outputs)
        if key not in self._moved:
            self._moved[key] = (replay, dataclasses.replace(replay, at=at, outputs=(*replay.outputs, *outputs)))
        return self._moved[key][1]


@dataclass(frozen=True)
class _BlockForm:
    """One block's part of a SAC form (see :meth:`SacBlocks._block`)."""

    decision: dict[int, str]
    freed: tuple[int, ...]
    replay: Replay | None
    saved_scratch: dict[str, int]  # scratch storage -> replay node: SAC's cache holds a saved op's outputs until it
    arg_scratch: set[str]  # the block's arguments that are scratch storages: held until its backward has run
    kept_sources: tuple[int, ...]  # kept activations the replay reads
    runs_policy: bool  # saves an op other than a module-state update (see SacBlocks.runs_policy)
    policy_calls: int  # eager calls of SAC's policy, forward and replay, when it runs the policy (else 0)


def sac_blocks(sim: Simulator) -> SacBlocks:
    """The simulator's :class:`SacBlocks`, built once."""
    cached = getattr(sim, "_sac_blocks", None)
    if cached is None:
        cached = sim._sac_blocks = SacBlocks(sim)
    return cached


class ReplaySac(ReplayMode):
    """Selective activation checkpointing around blocks, as :func:`acstudio.apply_plan` runs a plan."""

    name = "sac"
    summary = "selective checkpointing per block (acstudio.apply_plan; runs under torch.compile, FSDP2, DDP)"
    shares_chains = True  # the closest the rewriter comes; a SAC plan is exported as a policy, not a step
    supports_offload = True  # the saved outputs of some ops (see the module)

    def schedule(self, sim: Simulator, recomputed: Sequence[int]) -> SacSchedule:
        blocks = sac_blocks(sim)
        schedule = blocks.schedule(recomputed)
        schedule.dispatch_ms = blocks.dispatch_ms(recomputed)
        schedule.recomputed = recomputed
        return schedule

    def offload(self, sim: Simulator, schedule: SacSchedule, offloaded: Collection[int]) -> OffloadSchedule | None:
        """The copies of those of ``offloaded`` that the SAC form can offload (:meth:`SacBlocks.offloadable`); the
        others stay on the device, as SAC or the checkpoint's caller holds them."""
        if not self.supports_offload:
            return super().offload(sim, schedule, offloaded)
        if not len(offloaded):
            return None
        can = sac_blocks(sim).offloadable(schedule.recomputed)
        carried = [k for k in offloaded if can[k]]
        return super().offload(sim, schedule, carried) if carried else None

    def evaluate(self, sim: Simulator, schedule: SacSchedule, timeline: bool = False, extra=None):
        return evaluate_sac(sim, schedule, timeline, extra)

    def may_keep_back(self, sim: Simulator, recomputed: Sequence[int], k: int) -> bool:
        """Not in a block that runs a plain checkpoint: saving any op there makes eager run SAC's dispatch mode for
        every op of the block, twice, which makes the step host-bound (docs/results.md measures it). That is priced
        (:meth:`SacBlocks.dispatch_ms`) at more than one activation's replay saves, so the fill does not try it one
        activation at a time."""
        blocks = sac_blocks(sim)
        b = blocks.act_block[k]
        return b in blocks.runs_policy(recomputed)


SAC_MODE = register_mode(ReplaySac())


class ReplaySacCompiled(ReplaySac):
    """The SAC form under torch.compile: AOTAutograd's partitioner saves and recomputes only what backward needs.
    For time, it recomputes only the ops that what backward reads depends on, where eager's replay reruns the
    block's forward up to the last of them. For memory, a saved op keeps only the outputs that backward or that
    pruned recomputation reads: eager SAC's cache holds all of them until the replay (a dropout's output beside
    the mask its backward reads, where the residual add after it is kept), the compiled step frees the others
    after their last forward use. And a block's output that only code outside the wrapped blocks reads (the last
    layer's, read by the loss head), written by recomputed ops, is recomputed at its first backward use
    (:meth:`SacBlocks.recomputed_at_first_use`) where eager's caller holds it; one a kept layer norm reads stays,
    its normalized input saved in its place. A kept layer norm's backward reads that normalized input, not its
    input, which the replay then need not recompute for it; the normalized input is held beside the input where
    the plan frees the input or the replay reads it (:meth:`SacBlocks.compiled_normalized`). Otherwise memory is
    the "sac" mode's; from it :mod:`acstudio.plan.compiled` calibrates the compiled peak."""

    name = "sac-compiled"
    summary = "selective checkpointing per block under torch.compile (replays pruned to what backward reads)"
    supports_offload = True  # what whole blocks save, each compiled alone (see offload)
    offloads_by_region = True
    hands_mask_bias = False  # whether the blocks are handed SDPA's bias of their mask (ReplaySacCompiledBias)

    def may_keep_back(self, sim: Simulator, recomputed: Sequence[int], k: int) -> bool:
        return True  # compiled, the policy runs while tracing only

    def schedule(self, sim: Simulator, recomputed: Sequence[int], blocks_alone: bool = False) -> SacSchedule:
        blocks = sac_blocks(sim)
        schedule = blocks.schedule(recomputed, compiled=True, blocks_alone=blocks_alone)
        for r in schedule.replays:
            if id(r) not in blocks.pruned:
                pruned_ms = float(sim.replay.run_ms[self.needed(sim, r)].sum())
                blocks.pruned[id(r)] = dataclasses.replace(r, time_ms=pruned_ms)
        schedule.replays = [blocks.pruned[id(r)] for r in schedule.replays]
        return schedule

    @staticmethod
    def needed(sim: Simulator, replay: Replay) -> list[int]:
        """The replayed nodes the replay's outputs depend on."""
        return sac_blocks(sim).needed(replay)

    def offload(self, sim: Simulator, schedule: SacSchedule, offloaded: Collection[int]) -> OffloadSchedule | None:
        """The copies of ``offloaded`` as a compiled step makes them: a model compiled whole saves for backward only
        once its whole forward has run, so what its blocks save cannot leave before the peak; a block compiled on
        its own inside saved-tensors hooks hands what it saves to them when its forward ends, and unpacks all of
        it when its backward starts (:func:`acstudio.apply_plan` runs the blocks of ``SacBlocks.region_held`` so).
        The copies go out after the last block holding each activation, come back issued at a block's backward
        start (:class:`~acstudio.simulate.offload.RegionCopies`), and are needed by the first holder's backward.
        The blocks holding ``offloaded`` also copy the outputs of saved ops they keep for their replay
        (:meth:`SacBlocks.region_saved`), on the same lanes. With a region, every block runs compiled alone: Dynamo
        cannot resume inside the model's loop over its blocks, so the loop runs eagerly and each other block is a
        graph of its own (``tests/test_compiled_offload.py`` counts the graphs). So no block recomputes its output
        at its first backward use: ``schedule`` is made again so (in place: the plan's replays are those the step
        runs). Measured on GPT-2 (H200): one hidden state (48 MiB) of the 55-74 MiB its offloading plans peaked over
        the prediction when only the offloaded blocks were taken to run alone
        (``results/probes/compiled_offload_margin_1pct_gpt2_h200.txt``)."""
        if not len(offloaded):
            return None
        blocks = sac_blocks(sim)
        if schedule.late:  # every block runs compiled alone: its output is held, not recomputed
            fresh = self.schedule(sim, schedule.recomputed, blocks_alone=True)
            for f in dataclasses.fields(fresh):
                setattr(schedule, f.name, getattr(fresh, f.name))
        regions = {b for k in offloaded for b in blocks.holders(int(k))}
        held = blocks.mask_bias_held(schedule.recomputed) if self.hands_mask_bias else None
        return offload_schedule(sim, offloaded, schedule.replays, regions=blocks.region_copies,
                                saved=blocks.region_saved(schedule, regions), held=held)


SAC_COMPILED_MODE = register_mode(ReplaySacCompiled())


class ReplaySacCompiledBias(ReplaySacCompiled):
    """The compiled SAC form whose blocks, run one by one for their offload, are handed SDPA's additive bias of
    their boolean attention mask, made once before them (:func:`acstudio.export.apply.hand_blocks_mask_bias`), in
    place of the mask: no block makes, saves or copies its own bias (:meth:`SacBlocks.region_held`), and the one
    bias is held from the first block's forward to the last backward that reads it
    (:meth:`SacBlocks.mask_bias_held`). Without offload it is the compiled form itself. The plans of runs whose
    blocks each made their own (before 2026-11-29's eighteenth session) are in ``sac-compiled``."""

    name = "sac-compiled-bias"
    summary = "selective checkpointing under torch.compile, blocks run one by one handed the mask's bias"
    hands_mask_bias = True


SAC_COMPILED_BIAS_MODE = register_mode(ReplaySacCompiledBias())


@dataclass
class SacForm:
    """The SAC form of a recompute set: per wrapped block its forward ops with their decisions, the activation
    ids it frees (a subset of the plan's), and its simulated memory and time."""

    decisions: dict[str, list[tuple[str, str]]]  # wrapped block -> (node id, SAVE | RECOMPUTE | OFFLOAD), in order
    freed: list[str]
    result: SimResult
    state_updates: set[str] = dataclasses.field(default_factory=set)  # saved ops that update module state
    eager_only: set[str] = dataclasses.field(default_factory=set)  # saved ops that torch.compile recomputes


def simulate_sac(profile_or_simulator: Profile | Simulator, recomputed: Collection[str],
                 offloaded: Collection[str] = ()) -> SacForm:
    """Decisions, freed activations, peak, extra time and timeline of the SAC form of ``recomputed`` (ids), with
    the part of ``offloaded`` (ids) it can offload copied to the host and back (``result.offload``)."""
    sim = profile_or_simulator if isinstance(profile_or_simulator, Simulator) else Simulator(profile_or_simulator)
    blocks = sac_blocks(sim)
    decision, freed = blocks.decide(sim.indices(recomputed))
    compiled, freed_compiled = blocks.decide(sim.indices(recomputed), compiled=True)
    result = SAC_MODE.simulate(sim, recomputed, offloaded)
    nodes, created = sim.profile.nodes, sim.replay.created
    if result.offload is not None:
        decision = {**decision, **{int(created[k]): OFFLOAD for k in result.offload.offloaded.tolist()}}
    # and a block that frees something only compiled (its random ops' outputs): wrapped too, or compile keeps them
    wrapped = {blocks.block[created[k]] for k in np.flatnonzero(freed | freed_compiled)}
    decisions = {b: [(nodes[i].id, decision[i]) for i in blocks.fw_nodes[b]] for b in blocks.blocks if b in wrapped}
    state = {nodes[i].id for i, why in blocks.forced.items() if why == UPDATES_STATE}
    eager_only = {nodes[i].id for i, how in decision.items() if how != RECOMPUTE and compiled[i] == RECOMPUTE}
    return SacForm(decisions=decisions, freed=[sim.replay.act_ids[k] for k in np.flatnonzero(freed)], result=result,
                   state_updates=state, eager_only=eager_only)
