"""Facts about the captured graph that the rewrite passes share: positions, storages, aliases, in-place writers and
replay verdicts of the original nodes, all taken from the profile (never re-derived from a re-trace)."""

from __future__ import annotations

import torch.fx as fx

from acstudio.capture.analysis import written_args
from acstudio.profile.model import Profile
from acstudio.profile.replay_rules import replay_rules
from acstudio.rewrite.batchnorm import is_batch_norm, running_stats

RESIDENT_CATEGORIES = {"parameter", "buffer", "optimizer_state", "input"}
FORWARD_REGIONS = ("forward", "loss")


class GraphFacts:
    """The original nodes of a rewritten graph (before any pass adds to it) and what the profile says of them."""

    def __init__(self, gm: fx.GraphModule, profile: Profile, keep_random: bool) -> None:
        self.profile = profile
        self.nodes = list(gm.graph.nodes)
        self.pos = {n: i for i, n in enumerate(self.nodes)}
        self.rec = dict(zip(self.nodes, profile.nodes))
        self.rules = replay_rules(profile, keep_random)
        self.verdict = dict(zip(self.nodes, self.rules.node))
        self.draws = {n for n, d in zip(self.nodes, self.rules.draws) if d}
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

    def region(self, n: fx.Node) -> str:
        return n.meta["ac_region"]

    def written_storages(self, n: fx.Node) -> list[str]:
        """Storages ``n`` mutates, leaving out BatchNorm running statistics (a replay does not update them)."""
        args = written_args(n)
        if is_batch_norm(n):
            stats = running_stats(n)
            args = [a for a in args if a not in stats]
        return [s for a in args for s in self.storages[a]]

    def forward_holders(self, sid: str) -> list[fx.Node]:
        return [h for h in self.holders[sid] if self.region(h) in FORWARD_REGIONS]

    def backward_readers(self, sid: str) -> list[fx.Node]:
        """Original nodes outside forward that read one of the storage's forward alias nodes."""
        return sorted({u for h in self.forward_holders(sid) for u in h.users
                       if u in self.pos and self.region(u) not in FORWARD_REGIONS}, key=self.pos.__getitem__)

    def describe(self, n: fx.Node) -> str:
        rec = self.rec[n]
        where = f" in {rec.module}" if rec.module else ""
        return f"{rec.id} ({rec.target}{where})"
