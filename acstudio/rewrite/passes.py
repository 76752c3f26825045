"""The rewrite as a sequence of torch.fx-style passes, run by :func:`run_passes`.

Each pass is one step of turning a plan into graph changes (replays, random-generator states, BatchNorm statistics,
the freeing check, offload copies). Like torch's ``PassBase`` a pass checks what it needs (``requires``), changes
the graph (``call``, which says whether it did) and checks what it promises (``ensures``); like ``PassManager``
the runner lints and recompiles the graph after every pass that changed it, so a broken graph is caught at the
pass that broke it. Passes share what they found and placed through a :class:`RewriteContext` rather than node
attributes, and a failure names the pass and the passes that ran before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch.fx as fx

from acstudio.errors import RewriteError
from acstudio.profile.model import Profile

if TYPE_CHECKING:
    from acstudio.rewrite.facts import GraphFacts


@dataclass
class RewriteContext:
    """What the passes of one rewrite read (the profile and the plan) and hand on to each other."""

    profile: Profile
    recomputed: list[str]
    offloaded: list[str]
    mode: object  # the replay mode (acstudio.simulate.modes)
    keep_random: bool
    recomputations: list = field(default_factory=list)  # Recomputation records, in the plan's order
    offloads: list = field(default_factory=list)  # Offload records
    copies: list[fx.Node] = field(default_factory=list)  # replayed copies, in the order they were made
    random_copies: list[tuple[fx.Node, fx.Node, fx.Node]] = field(default_factory=list)  # (original, copy, input)
    facts: GraphFacts | None = None  # the original graph's facts, collected before any pass changes it


class RewritePass(Protocol):
    """One step of the rewrite. ``requires`` and ``ensures`` raise when their condition does not hold."""

    name: str

    def requires(self, gm: fx.GraphModule, ctx: RewriteContext) -> None: ...

    def call(self, gm: fx.GraphModule, ctx: RewriteContext) -> bool: ...

    def ensures(self, gm: fx.GraphModule, ctx: RewriteContext) -> None: ...


def run_passes(gm: fx.GraphModule, ctx: RewriteContext, passes: Sequence[RewritePass]) -> list[str]:
    """Run ``passes`` in order on ``gm``; returns the names of those that changed it.

    A :class:`RewriteError` raised by ``requires`` or ``call`` is the plan's own refusal (it already names the
    activation and the reason) and goes out as it is; any other failure, and any broken ``ensures``, is a fault of
    the rewrite and is raised as a RewriteError naming the pass and the passes that ran before it.
    """
    ran: list[str] = []
    modified: list[str] = []

    def failure(p: RewritePass, what: str, exc: Exception) -> RewriteError:
        before = ", ".join(ran) if ran else "none"
        return RewriteError(f"rewrite pass {p.name} {what} (passes run before it: {before}): {exc}")

    for p in passes:
        try:
            p.requires(gm, ctx)
            if p.call(gm, ctx):
                modified.append(p.name)
                gm.graph.lint()
                gm.recompile()
        except RewriteError:
            raise
        except Exception as exc:
            raise failure(p, "failed", exc) from exc
        try:
            p.ensures(gm, ctx)
        except Exception as exc:
            raise failure(p, "broke its guarantee", exc) from exc
        ran.append(p.name)
    return modified
