"""Rewiring backward readers to the replayed copies, and the check that the originals are then freed in forward.

Only readers at or after the replay's insertion point are rewired, so the original storage's last use moves into
forward and FX's generated code frees it there.
"""

from __future__ import annotations

import torch.fx as fx

from acstudio.rewrite.facts import FORWARD_REGIONS, GraphFacts
from acstudio.rewrite.passes import RewriteContext


def rewire_readers(facts: GraphFacts, sid: str, at: int, copies: dict[fx.Node, fx.Node], owner: str) -> None:
    """Make the original readers of ``sid`` at or after position ``at`` read its copies (made by ``owner``'s
    replay) instead of its forward alias nodes; its backward views then alias the replayed copy."""
    for h in facts.forward_holders(sid):
        for u in list(h.users):
            if facts.pos.get(u, -1) >= at:
                u.replace_input_with(h, copies[h])
    for h in facts.holders[sid]:
        if facts.region(h) not in FORWARD_REGIONS:
            h.meta["ac_storages"] = [f"{s}@{owner}" if s == sid else s for s in facts.storages[h]]


class CheckFreed:
    """After rewiring, the original alias nodes of a recomputed storage may only be read in forward: that is what
    frees them after forward. Changes nothing; its guarantee is the check."""

    name = "check_freed"

    def requires(self, gm: fx.GraphModule, ctx: RewriteContext) -> None:
        pass

    def call(self, gm: fx.GraphModule, ctx: RewriteContext) -> bool:
        return False

    def ensures(self, gm: fx.GraphModule, ctx: RewriteContext) -> None:
        facts = ctx.facts
        for sid in ctx.recomputed:
            for h in facts.forward_holders(sid):
                late = [u for u in h.users if facts.region(u) not in FORWARD_REGIONS]
                if late:
                    raise AssertionError(f"{sid}: {h.meta['ac_id']} is still read by {late[0].meta['ac_id']}")
