"""Storage-accounted memory of a captured or rewritten graph: what FX's generated code keeps alive, node by node.

The same rule as :meth:`GraphAnalysis.live_bytes_after` (a storage lives from the node that creates it to the
last use of any node aliasing it; graph inputs and outputs live throughout), extended to replayed nodes: the
rewriter tags each copy with ``meta["ac_storages"]``, where a rematerialised storage gets a fresh name. It needs
no device and no tensors, so a plan's effect can be checked on any machine, for any profile.
"""

from __future__ import annotations

import torch.fx as fx

from acstudio.capture.analysis import bytes_alive
from acstudio.profile.model import Profile

RESIDENT_CATEGORIES = {"parameter", "buffer", "optimizer_state", "input"}


def live_bytes(gm: fx.GraphModule, profile: Profile) -> list[int]:
    """Bytes of storages alive at each node of ``gm`` (a graph of ``profile``, rewritten or not)."""
    storages = {}
    for t in profile.tensors:
        for h in (t.created_at, *t.aliases):
            storages.setdefault(h, []).append(t.id)
    size = profile.tensor_bytes
    forever = {t.id for t in profile.tensors if t.category in RESIDENT_CATEGORIES}
    nodes = list(gm.graph.nodes)
    output = nodes[-1]
    for a in output.all_input_nodes:
        forever.update(_keys(a, storages))
    start: dict[str, int] = {}
    end: dict[str, int] = {}
    pos = {n: i for i, n in enumerate(nodes)}
    for i, n in enumerate(nodes):
        size.update(n.meta.get("ac_sizes", {}))  # storages the rewriter adds (saved generator states)
        last = max((pos[u] for u in n.users if u is not output), default=i)
        for key in _keys(n, storages):
            start.setdefault(key, i)
            end[key] = max(end.get(key, i), last)
    return bytes_alive(((s, None if key in forever else end[key], size.get(key) or size[key.partition("@")[0]])
                        for key, s in start.items()), len(nodes))


def _keys(n: fx.Node, storages: dict[str, list[str]]) -> list[str]:
    if "ac_storages" in n.meta:
        return n.meta["ac_storages"]
    return storages.get(n.meta["ac_id"], [])
