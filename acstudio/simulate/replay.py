"""What recomputing an activation replays, and from which resident tensors (μ-TWO's ``recomp_srcs``).

Built once per profile. For every activation ``a`` the *own chain* is found by walking back over node inputs
from a's forward holders (the node that allocated its storage, its views and the in-place ops on it):

* a placeholder, or a view of one, is a parameter source (always resident);
* a node whose storage is another activation is a *stop* (an activation source), unless its content is stale
  (an in-place op rewrites that storage later in forward, so the resident tensor no longer holds the value
  this reader saw) or it is read through ``getitem`` (the reader takes one element of a multi-output node, so
  the node itself must run again);
* anything else (temporaries, views, the tuple-producing node) is replayed, and the walk continues;
* a replayed node that creates a storage brings the forward in-place writers of that storage with it (the
  rewriter rematerialises a storage whole: its creator and every writer, e.g. ResNet's ``relu_`` on a
  BatchNorm output when the BatchNorm is replayed for its saved statistics).

Stops make a small "stop graph" over activations. Under a set R of recomputed activations, the replay of
``a`` expands every stop ``s`` that is recomputed and *not resident* when ``a`` is recomputed (before
``a.first_bw_use``): its own chain joins a's replay and its stops are examined in turn. This is the fixed
point of μ-TWO's Alg E/F source updates (``srcs -= {t}; srcs |= t.srcs``), computed with diamonds
deduplicated and with residency checked for recomputed sources only: a *retained* stop is always a source,
kept alive up to the recomputation if its last use comes earlier (the simulator charges that extension).

An activation is a recompute candidate when it is recomputable, its own chain replays only nodes whose replay
verdict is ``"ok"``, and there is at least one node between its last forward and first backward use. Verdicts
come from :func:`~acstudio.profile.replay_rules.replay_rules` under the graph's random-op rule (``keep_random``):
by default a random op is replayed with the generator state its forward drew with, which the rewriter saves
right before that op in forward and keeps until its last replay (``rng_state_bytes`` each, see
:meth:`rng_spans`).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from acstudio.profile.model import Profile
from acstudio.profile.replay_rules import replay_rules

FORWARD_REGIONS = ("forward", "loss")
# The fused attention kernels SDPA dispatches to (aten packet names): torchtitan's op-level policy saves their
# outputs, and a block's ``where`` read by one is SDPA's bias of a boolean mask.
ATTENTION_KERNELS = ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
                     "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
                     "_scaled_dot_product_attention_math", "_scaled_dot_product_attention_math_for_mps")
_ATTENTION = frozenset(f"aten.{name}.default" for name in ATTENTION_KERNELS)


def is_attention(target: str) -> bool:
    """A fused attention kernel (``aten._scaled_dot_product_{flash,efficient,cudnn}_attention`` ...)."""
    return target in _ATTENTION

# Bytes of one saved generator state: the CPU's Mersenne Twister state, or a CUDA Philox seed and offset (a
# host tensor: it takes no device memory, counted anyway as the price of a state kept for a replay).
RNG_STATE_BYTES = {"cpu": 5056, "cuda": 16}
# Transients remembered per replay graph. A planner asks for the same few thousand (activation, replay) pairs over
# and over (the 953M decoder's compiled plan: 175k asks, 8k distinct); past this many, they are forgotten at once
# (a key holds its replay's node indices: a few KiB where chains merge, so at most tens of MiB in all).
TRANSIENT_MEMO_ENTRIES = 1 << 14


def is_inplace(target: str) -> bool:
    """``aten.relu_.default`` style names: by PyTorch convention a trailing ``_`` marks an in-place op."""
    parts = target.split(".")
    return len(parts) == 3 and parts[0] == "aten" and parts[1].endswith("_")


@dataclass(frozen=True)
class Expansion:
    """The recomputation of one activation under a given recompute set."""

    chain: tuple[int, ...]  # activations whose own chains are replayed (the target first)
    sources: tuple[int, ...]  # activations read from memory, sorted
    params: tuple[str, ...]  # parameter/buffer/input storages read, sorted
    nodes: np.ndarray  # replayed node indices, topological order
    time_ms: float


@dataclass(frozen=True)
class Replay:
    """One replay as a replay mode schedules it: inserted before node ``at``, it brings back ``outputs`` (its
    owner first; more than one when it produces the recomputed tensors it passes)."""

    at: int
    outputs: tuple[int, ...]
    chain: tuple[int, ...]  # activations whose own chains are replayed (outputs and transient ones)
    sources: tuple[int, ...]  # activations read from memory, sorted
    params: tuple[str, ...]  # parameter/buffer/input storages read, sorted
    nodes: np.ndarray  # replayed node indices, topological order
    time_ms: float
    transient: int  # high-water mark of its allocations, the outputs it keeps included


class ReplayGraph:
    """Static recompute structure of a profile; activations are addressed by index into ``profile.activations``."""

    def __init__(self, profile: Profile, keep_random: bool = False, node_ms: np.ndarray | None = None) -> None:
        """``node_ms``: per node, the time a replay of it costs, in place of the profile's (a compiled step's
        estimate: :mod:`acstudio.plan.compiled`)."""
        self.profile = profile
        self.keep_random = keep_random
        rules = replay_rules(profile, keep_random)
        self._verdict = rules.node
        nodes = profile.nodes
        index = profile.node_index
        n = len(nodes)
        self.n_nodes = n
        self.run_ms = profile.node_step_ms if node_ms is None else np.asarray(node_ms, dtype=np.float64)

        acts = profile.activations
        self.act_ids = [a.id for a in acts]
        self.act_index = {a.id: k for k, a in enumerate(acts)}
        self.bytes = np.array([a.bytes for a in acts], dtype=np.int64)
        self.created = np.array([index[a.created_at] for a in acts], dtype=np.int64)
        self.last_fw = np.array([index[a.last_fw_use] for a in acts], dtype=np.int64)
        self.first_bw = np.array([index[a.first_bw_use] for a in acts], dtype=np.int64)
        self.last_bw = np.array([index[a.last_bw_use] for a in acts], dtype=np.int64)

        self._placeholder_storages = {t.id for t in profile.tensors if nodes[index[t.created_at]].op == "placeholder"}
        holders: dict[str, list[int]] = {}
        for i, nd in enumerate(nodes):
            if nd.storage:
                holders.setdefault(nd.storage, []).append(i)
        self._inputs = [[index[u] for u in nd.inputs] for nd in nodes]
        self._stale = self._stale_nodes(holders)
        self._writers: dict[int, list[int]] = {}  # creating node -> forward in-place writers of its storages
        for t in profile.tensors:
            writers = [h for h in holders.get(t.id, []) if nodes[h].region in FORWARD_REGIONS
                       and is_inplace(nodes[h].target)]
            if writers:
                self._writers.setdefault(index[t.created_at], []).extend(writers)
        # Per node: inputs, storages held (allocated or aliased), storages allocated; for the transient.
        sidx = {t.id: j for j, t in enumerate(profile.tensors)}
        self._storage_bytes = np.array([t.bytes for t in profile.tensors], dtype=np.int64)
        self._act_storage = np.array([sidx[a.id] for a in profile.activations], dtype=np.int64)
        fresh = [[] for _ in nodes]
        for t in profile.tensors:
            fresh[index[t.created_at]].append(sidx[t.id])
        held = [sorted({*f, sidx[nd.storage]} if nd.storage else set(f)) for f, nd in zip(fresh, nodes)]
        # Only forward nodes are ever replayed: their rows, padded with -1, make the transient a few gathers.
        fw = [i for i, nd in enumerate(nodes) if nd.region in FORWARD_REGIONS]
        self._in_pad = _padded(self._inputs, fw, n)
        self._hold_pad = _padded(held, fw, n)
        self._fresh_pad = _padded(fresh, fw, n)
        self._transients: dict[tuple, int] = {}

        self.own: list[np.ndarray] = []
        self.own_time = np.zeros(len(acts))
        self.stops: list[tuple[int, ...]] = []
        self.params: list[tuple[str, ...]] = []
        self.reason: list[str] = []
        for k, a in enumerate(acts):
            start = [h for h in holders.get(a.id, []) if nodes[h].region in FORWARD_REGIONS]
            own, stops, params, blocked = self._walk(a.id, start)
            self.own.append(np.array(sorted(own), dtype=np.int64))
            self.own_time[k] = self.run_ms[self.own[-1]].sum()
            self.stops.append(tuple(sorted(stops)))
            self.params.append(tuple(sorted(params)))
            if rules.activation[a.id]:
                why = rules.activation[a.id]
            elif blocked:
                why = blocked
            elif self.first_bw[k] <= self.last_fw[k] + 1:
                why = "no node runs between its last forward and first backward use"
            else:
                why = ""
            self.reason.append(why)
        self.is_candidate = np.array([not r for r in self.reason], dtype=bool)
        self.candidates = [k for k in range(len(acts)) if self.is_candidate[k]]

        # Random ops replayed with a saved generator state, and per activation those its own chain runs.
        self.rng_nodes = np.flatnonzero(rules.draws)
        rng_slot = {int(i): j for j, i in enumerate(self.rng_nodes)}
        self.rng_owned = [np.array([rng_slot[i] for i in own if i in rng_slot], dtype=np.int64) for own in self.own]
        self.rng_state_bytes = RNG_STATE_BYTES.get(profile.environment.get("device_type", "cpu"), 16)
        self._rng_pair_act = np.repeat(np.arange(len(acts)), [len(o) for o in self.rng_owned])
        self._rng_pair_slot = np.concatenate([*self.rng_owned, np.zeros(0, dtype=np.int64)])

    def rng_spans(self, mask: np.ndarray, back: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Saved generator states of a recompute set: (random node, node before which its last replay runs).

        The state of random op ``r`` is saved right before ``r`` runs in forward and kept until the replay of the
        last recomputed activation whose own chain runs ``r`` (``back[a]``: where ``a`` is brought back). A chain
        replayed again after that activation's last backward use (rare: an activation read in backward only
        before the values derived from it) would keep it longer. The rewritten graph frees it inside its last
        replay, right after setting it, so this overstates that replay's memory by at most the states it frees
        (16 bytes each on CUDA, 5056 on the CPU); the tests bound the difference by that."""
        pairs = mask[self._rng_pair_act]
        end = np.full(len(self.rng_nodes), -1, dtype=np.int64)
        np.maximum.at(end, self._rng_pair_slot[pairs], back[self._rng_pair_act[pairs]])
        used = end >= 0
        return self.rng_nodes[used], end[used]

    # -- static walk ----------------------------------------------------------------------------------
    def _stale_nodes(self, holders: dict[str, list[int]]) -> np.ndarray:
        """Forward nodes whose storage is rewritten in place later in forward (their value is not resident)."""
        nodes = self.profile.nodes
        stale = np.zeros(self.n_nodes, dtype=bool)
        for hs in holders.values():
            writers = [h for h in hs if nodes[h].region in FORWARD_REGIONS and is_inplace(nodes[h].target)]
            if writers:
                stale[[h for h in hs if h < writers[-1]]] = True
        return stale

    def _walk(self, target: str, start: list[int]) -> tuple[set[int], set[int], set[str], str]:
        nodes = self.profile.nodes
        own = set(start)
        stops: set[int] = set()
        params: set[str] = set()
        stack = list(start)
        while stack:
            r = stack.pop()
            for w in self._writers.get(r, ()):
                if w not in own:
                    if self._verdict[w] != "ok":
                        return own, stops, params, (f"recomputing it would replay {nodes[w].id} "
                                                    f"({nodes[w].target}): {self._verdict[w]}")
                    own.add(w)
                    stack.append(w)
            via_getitem = nodes[r].target == "operator.getitem"
            for u in self._inputs[r]:
                if u in own:
                    continue
                nd = nodes[u]
                s = nd.storage
                if nd.op in ("placeholder", "get_attr") or (s in self._placeholder_storages and not via_getitem):
                    params.add(s or nd.id)
                    continue
                if not via_getitem and s != target and s in self.act_index and not self._stale[u]:
                    stops.add(self.act_index[s])
                    continue
                if self._verdict[u] != "ok":
                    return own, stops, params, (f"recomputing it would replay {nd.id} ({nd.target}): "
                                                f"{self._verdict[u]}")
                own.add(u)
                stack.append(u)
        return own, stops, params, ""

    # -- dynamic expansion ----------------------------------------------------------------------------
    def resident(self, s: int, at: int) -> bool:
        """Whether recomputed activation ``s`` is in memory when a recomputation runs before node ``at``."""
        return bool(self.first_bw[s] <= at <= self.last_bw[s])

    def expand_chain(self, a: int, recomputed: Collection[int] | np.ndarray) -> tuple[list[int], list[int]]:
        """Activations replayed to recompute ``a`` (``a`` first) and the activations it reads, for a recompute set.

        ``recomputed`` is a boolean mask over activations or a collection of indices.
        """
        is_rc = recomputed.__getitem__ if isinstance(recomputed, np.ndarray) else recomputed.__contains__
        chain, sources = [a], set()
        self._walk_stops(a, [a], {a}, is_rc, chain, sources)
        return chain, sorted(sources)

    def extend_chain(self, a: int, chain: list[int], sources: list[int], t: int,
                     recomputed: np.ndarray) -> tuple[list[int], list[int]]:
        """``expand_chain`` after source ``t`` of ``a`` became recomputed and is not resident for ``a``: only
        t's side is walked (Alg F's ``srcs -= {t}; srcs |= t.srcs``, deduplicated). Returns new lists."""
        new_chain, found = [*chain, t], set()
        self._walk_stops(a, [t], {*chain, *sources}, recomputed.__getitem__, new_chain, found)
        return new_chain, sorted(found.union(sources).difference((t,)))

    def _walk_stops(self, a: int, stack: list[int], seen: set[int], is_rc, chain: list[int], sources: set[int]
                    ) -> None:
        """Walk the stop graph from ``stack``: recomputed activations not resident at ``a``'s first backward use
        join ``chain`` (and are walked through), everything else met is a source of ``a``."""
        at = self.first_bw[a]
        while stack:
            for s in self.stops[stack.pop()]:
                if s in seen:
                    continue
                seen.add(s)
                if is_rc(s) and not (self.first_bw[s] <= at <= self.last_bw[s]):
                    chain.append(s)
                    stack.append(s)
                else:
                    sources.add(s)

    def chain_nodes(self, chain: list[int]) -> np.ndarray:
        if len(chain) == 1:
            return self.own[chain[0]]
        return np.unique(np.concatenate([self.own[c] for c in chain]))

    def expand(self, a: int, recomputed: Collection[int] | np.ndarray) -> Expansion:
        chain, sources = self.expand_chain(a, recomputed)
        nodes = self.chain_nodes(chain)
        params = sorted({p for c in chain for p in self.params[c]})
        return Expansion(tuple(chain), tuple(sources), tuple(params), nodes, float(self.run_ms[nodes].sum()))

    def transient_bytes(self, a: int | list[int], replay: np.ndarray) -> int:
        """High-water mark of the storages a replay (sorted node indices) allocates, ``a``'s own included.

        Values are freed after their last use inside the replay (FX codegen semantics), except ``a`` (one
        activation, or the list a shared chain produces), which stays; a multi-output node keeps all its outputs
        until its last ``getitem``. Vectorised: replays span hundreds of nodes once chains merge.
        """
        m = len(replay)
        if not m:
            return 0
        key = (a if isinstance(a, (int, np.integer)) else tuple(a), replay.dtype.str, replay.tobytes())
        known = self._transients.get(key)
        if known is None:
            if len(self._transients) >= TRANSIENT_MEMO_ENTRIES:
                self._transients.clear()
            known = self._transients[key] = self._transient_bytes(a, replay)
        return known

    def _transient_bytes(self, a: int | list[int], replay: np.ndarray) -> int:
        m = len(replay)
        # Position in the replay of every input that is itself replayed, and its last reader there.
        inputs = self._in_pad[replay]
        at = np.minimum(np.searchsorted(replay, inputs), m - 1)
        inside = (inputs >= 0) & (replay[at] == inputs)
        last_read = np.arange(m)
        np.maximum.at(last_read, at[inside], np.nonzero(inside)[0])
        # A storage lives until the last read of any replayed node holding it; ``a`` to the end.
        held = self._hold_pad[replay]
        valid = held >= 0
        storage_end = np.full(len(self._storage_bytes), -1, dtype=np.int64)
        np.maximum.at(storage_end, held[valid], last_read[np.nonzero(valid)[0]])
        storage_end[self._act_storage[a]] = m
        made = self._fresh_pad[replay]
        valid = made >= 0
        makers, made = np.nonzero(valid)[0], made[valid]
        nbytes = self._storage_bytes[made]
        delta = np.bincount(makers, weights=nbytes, minlength=m + 1)
        delta -= np.bincount(storage_end[made] + 1, weights=nbytes, minlength=m + 2)[:m + 1]
        return round(float(np.cumsum(delta[:m]).max()))


def _padded(rows: list[list[int]], keep: list[int], n: int) -> np.ndarray:
    """``rows[i]`` for ``i`` in ``keep`` as an (n, width) array padded with -1 (other rows all -1)."""
    width = max([len(rows[i]) for i in keep] + [1])
    out = np.full((n, width), -1, dtype=np.int64)
    for i in keep:
        out[i, :len(rows[i])] = rows[i]
    return out
