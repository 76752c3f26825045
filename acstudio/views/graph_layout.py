"""Geometry of the node graph view: module-hierarchy grouping and its layout. No Qt in here.

A whole-iteration graph has thousands of nodes (ResNet-152 with Adam: ~13k), far too many to draw or to lay
out at once. Nodes are therefore grouped by a path ``region / module / sub-module / ...`` (forward and
backward nodes by their module, optimizer nodes and inputs by the module of the parameter they touch), and
only an *expansion state* (a set of expanded group keys) is shown: every node is drawn as its deepest
visible ancestor. Groups with many direct leaf nodes are cut into chunks of consecutive nodes so that no
expansion shows more than :data:`CHUNK` leaves at once.

Each expansion state is laid out once, by graphviz ``dot`` when it is installed and by a layered layout in
Python otherwise, and dot layouts are cached on disk by profile fingerprint. The view then only recolours.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from acstudio.fileio import write_text
from acstudio.profile.model import Profile

CHUNK = 60  # most leaf nodes a group shows directly when expanded
LOOSE_LEAVES = 6  # more ops than this next to sub-modules are bundled into "(ops)" boxes, one per run
OWN_OPS = "(ops)"  # parenthesised: no module attribute can have this name
OWN_OPS_RUNS = 3  # a module whose own ops fall into more runs than this between its sub-modules gets one box
LAYOUT_VERSION = 5  # bump when the geometry below changes, so stale disk caches are ignored
# What each direction of the graph shows: forward with the loss it ends in, backward with the update it feeds.
SHOWN_REGIONS = {"forward": ("forward", "loss"), "backward": ("loss", "backward", "optimizer"),
                 "whole iteration": ("forward", "loss", "backward", "optimizer")}
DEFAULT_PASS = "forward"  # what the graph opens on
REGION_TITLES = {"input": "inputs", "forward": "forward", "loss": "loss", "backward": "backward",
                 "optimizer": "optimizer", "output": "output"}
SLOT_TITLES = {"param": "parameters", "buffer": "buffers", "opt_state": "optimizer state", "batch": "batch"}
# Edges touching inputs or the output node are not drawn: every parameter feeds forward, backward and the
# optimizer, and every gradient feeds the output, so those edges would cover everything else.
NO_EDGE_REGIONS = ("input", "output")
SEP = "/"


@dataclass(frozen=True)
class Item:
    """One box on screen: a collapsed group or a single node. ``nodes`` are indices into ``profile.nodes``."""

    key: str
    label: str
    region: str
    nodes: tuple[int, ...]
    is_group: bool
    bytes: int


@dataclass(frozen=True)
class View:
    """What one expansion state shows: items, aggregated edges between them, and expanded groups as frames."""

    items: list[Item]
    edges: list[tuple[int, int]]
    clusters: list[tuple[str, str, tuple[int, ...]]]  # (group key, label, item indices inside it)
    node_item: np.ndarray  # profile node index -> item index


@dataclass
class Layout:
    """Scene geometry in points, y pointing down. ``boxes[i]`` is (x, y, w, h) of ``view.items[i]``."""

    boxes: list[tuple[float, float, float, float]]
    edges: list[list[tuple[float, float]]]  # per view edge: cubic Bézier points p0 c1 c2 p1 c1 c2 p2 ...
    clusters: list[tuple[str, str, tuple[float, float, float, float]]]  # (key, label, rect)
    engine: str  # "dot" or "layered"


def _module_parts(module: str) -> tuple[str, ...]:
    if not module or module.startswith("("):  # "(loss)", "(optimizer)": the region already says it
        return ()
    return tuple(module.split("."))


def _param_module(slot: tuple[str, str]) -> tuple[str, ...]:
    """Module path of a graph input: ``layer1.0.conv1.weight/exp_avg`` -> ``layer1.0.conv1``."""
    kind, key = slot
    if kind == "batch":
        return ()
    fqn = key.rpartition("/")[0] if kind == "opt_state" else key
    return _module_parts(fqn.rpartition(".")[0])


class ModuleTree:
    """Group paths of every node of a profile, and the visible :class:`View` of any expansion state."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        nodes = profile.nodes
        index = profile.node_index
        slots = [tuple(s) for s in profile.graph.get("inputs", [])]
        placeholder_no = {}
        paths: list[tuple[str, ...]] = []
        opt_module: dict[str, tuple[str, ...]] = {}
        for n in nodes:
            if n.region == "input":
                k = placeholder_no.setdefault(n.id, len(placeholder_no))
                slot = slots[k] if k < len(slots) else ("batch", "")
                module = _param_module(slot)
                opt_module[n.id] = module
                path = ("input", SLOT_TITLES.get(slot[0], slot[0]), *module)
            elif n.region == "optimizer":
                # The optimizer updates one parameter at a time: attribute each op to the module of the
                # first parameter/state it reads, directly or through earlier optimizer ops.
                module = next((opt_module[s] for s in n.inputs if opt_module.get(s)), ())
                opt_module[n.id] = module
                path = ("optimizer", *module)
            elif n.region in ("forward", "backward"):
                path = (n.region, *_module_parts(n.module))
            else:
                path = (n.region,)
            paths.append(path)
        self.paths = _chunked(paths)
        self.members: dict[tuple[str, ...], list[int]] = defaultdict(list)
        for i, path in enumerate(self.paths):
            for depth in range(1, len(path) + 1):
                self.members[path[:depth]].append(i)
        src, dst = [], []
        for j, n in enumerate(nodes):
            if n.region in NO_EDGE_REGIONS:
                continue
            for s in n.inputs:
                i = index.get(s)
                if i is not None and nodes[i].region not in NO_EDGE_REGIONS:
                    src.append(i)
                    dst.append(j)
        self._src = np.asarray(src, dtype=np.int64)
        self._dst = np.asarray(dst, dtype=np.int64)
        self._new_bytes = np.asarray([n.new_bytes for n in nodes], dtype=np.int64)

    # -- expansion -------------------------------------------------------------------------------------------
    def visible_path(self, i: int, expanded: frozenset[str]) -> tuple[str, ...]:
        """The deepest shown ancestor of node ``i``: ``()`` below a path means the node itself is shown."""
        path = self.paths[i]
        depth = 1
        while depth <= len(path):
            prefix = path[:depth]
            if key_of(prefix) not in expanded and len(self.members[prefix]) > 1:
                return prefix
            depth += 1
        return (*path, self.profile.nodes[i].id)

    def view(self, expanded: frozenset[str], regions: tuple[str, ...] = SHOWN_REGIONS["whole iteration"]) -> View:
        """The boxes of ``regions`` at this expansion; nodes of other regions belong to no item (-1)."""
        nodes = self.profile.nodes
        item_of_path: dict[tuple[str, ...], int] = {}
        items: list[Item] = []
        node_item = np.full(len(nodes), -1, dtype=np.int64)
        for i in range(len(nodes)):
            if nodes[i].region not in regions:
                continue
            vp = self.visible_path(i, expanded)
            k = item_of_path.get(vp)
            if k is None:
                k = item_of_path[vp] = len(items)
                items.append(self._item(vp))
            node_item[i] = k
        # Items are created in node order, which puts each group at its first node: stable and readable.
        a, b = node_item[self._src], node_item[self._dst]
        keep = (a != b) & (a >= 0) & (b >= 0)
        pairs = np.unique(np.stack([a[keep], b[keep]], axis=1), axis=0) if keep.any() else np.empty((0, 2))
        edges = [(int(x), int(y)) for x, y in pairs]
        clusters = []
        for path, members in self.members.items():
            # a region is never framed: the colours of its boxes already say which one it is
            shown = len(path) > 1 and path[0] in regions and all(
                key_of(path[:d]) in expanded for d in range(1, len(path) + 1))
            if shown and len(members) > 1:
                inside = tuple(sorted({int(node_item[m]) for m in members}))
                clusters.append((key_of(path), group_label(path), inside))
        clusters.sort(key=lambda c: c[0].count(SEP))
        return View(items=items, edges=edges, clusters=clusters, node_item=node_item)

    def _item(self, vp: tuple[str, ...]) -> Item:
        members = self.members.get(vp)
        if members is not None:  # a group
            idx = tuple(members)
            n_bytes = int(self._new_bytes[list(idx)].sum())
            unit = "tensors" if vp[0] == "input" else "ops"
            return Item(key=key_of(vp), label=f"{group_label(vp)}\n{len(idx)} {unit}", region=vp[0],
                        nodes=idx, is_group=True, bytes=n_bytes)
        i = self.profile.node_index[vp[-1]]
        n = self.profile.nodes[i]
        op = n.target.removeprefix("aten.").removesuffix(".default")
        # a module made of one op (ResNet's conv1) is named by the module, like its siblings
        sole = len(vp) > 2 and len(self.members.get(vp[:-1], ())) == 1 and not is_own_ops(vp[-2])
        return Item(key=n.id, label=f"{vp[-2]}\n{op}" if sole else f"{op}\n{n.shape or n.name}", region=n.region,
                    nodes=(i,), is_group=False, bytes=n.new_bytes)

    def ancestors(self, i: int) -> list[str]:
        """Keys of all groups containing node ``i`` (expand these to show the node itself)."""
        path = self.paths[i]
        return [key_of(path[:d]) for d in range(1, len(path) + 1)]

    def default_expansion(self, min_items: int = 8, limit: int = 40) -> frozenset[str]:
        """What the graph opens on: forward and backward show their top-level modules; then, as long as the
        pass stays within ``limit`` boxes, its biggest group opens while the pass shows fewer than
        ``min_items`` boxes (BERT: ``bert`` → ``encoder`` → its layers) or while that group holds most of the
        pass (a decoder's stack of blocks ``h``)."""
        expanded: set[str] = set()
        for region in ("forward", "backward"):
            if (region,) not in self.members:
                continue
            expanded.add(region)
            total = len(self.members[(region,)])
            shown = self._children((region,))
            while True:
                groups = [p for p in shown if len(self.members.get(p, ())) > 1 and not is_own_ops(p[-1])
                          and not p[-1].startswith("ops ")]
                fits = [p for p in groups if len(shown) - 1 + len(self._children(p)) <= limit]
                if not fits:
                    break
                biggest = max(fits, key=lambda p: len(self.members[p]))
                if len(shown) >= min_items and 2 * len(self.members[biggest]) <= total:
                    break
                expanded.add(key_of(biggest))
                shown = (shown - {biggest}) | self._children(biggest)
        return frozenset(expanded)

    def _children(self, path: tuple[str, ...]) -> set[tuple[str, ...]]:
        depth = len(path) + 1
        return {self.paths[m][:depth] if len(self.paths[m]) >= depth else (*path, str(m)) for m in self.members[path]}

    def find_modules(self, text: str) -> list[str]:
        """Keys of the modules ``text`` names, by their name or the tail of their dotted path (``layer3``,
        ``layer3.0``, ``encoder.layer.11``; case-insensitive): forward ones first, outer before inner."""
        t = text.strip().lower()
        if not t:
            return []

        def named(p: tuple[str, ...]) -> bool:
            dotted = module_name(p).lower()
            return t in (group_label(p).lower(), dotted) or dotted.endswith("." + t)

        found = [p for p, members in self.members.items() if len(p) > 1 and p[0] in ("forward", "backward")
                 and len(members) > 1 and named(p)]
        return [key_of(p) for p in sorted(found, key=lambda p: (p[0] != "forward", len(p), self.members[p][0]))]

    def search(self, text: str) -> list[int]:
        """Node indices whose id, name, op or module contains ``text`` (case-insensitive), in graph order."""
        t = text.strip().lower()
        if not t:
            return []
        return [i for i, n in enumerate(self.profile.nodes)
                if t in n.id.lower() or t in n.name.lower() or t in n.target.lower() or t in n.module.lower()]


def module_name(path: tuple[str, ...]) -> str:
    """The dotted module path of a group (``forward/layer3/0`` -> ``layer3.0``)."""
    return ".".join(p for p in path[1:] if not is_own_ops(p))


def key_of(path: tuple[str, ...]) -> str:
    return SEP.join(path)


def group_label(path: tuple[str, ...]) -> str:
    """A group's name: the region, or the module attribute (list entries with their list: ``layer.11``)."""
    if len(path) == 1:
        return REGION_TITLES.get(path[0], path[0])
    if path[-1].isdigit() and len(path) > 2:
        return f"{path[-2]}.{path[-1]}"
    if is_own_ops(path[-1]):  # the ops a module runs itself, next to its sub-modules
        return f"{group_label(path[:-1])} {path[-1][1:-1]}"
    return path[-1]


def own_ops(run: int) -> str:
    """The group of a module's own ops in its ``run``-th run between sub-modules: ``(ops)``, ``(ops 2)``, ..."""
    return OWN_OPS if run == 0 else f"(ops {run + 1})"


def is_own_ops(name: str) -> bool:
    return name == OWN_OPS or name.startswith("(ops ")


def own_runs(paths: list[tuple[str, ...]], path: tuple[str, ...], idx: list[int]) -> list[list[int]]:
    """Nodes ``idx`` (a module's own ops, in graph order) cut into runs wherever more than :data:`LOOSE_LEAVES`
    ops of its sub-modules run in between: GPT-2's ``transformer`` makes its mask before the blocks and reshapes
    their output after the final norm, and one box for both would close a loop (mask, blocks, norm, reshape),
    which a top-down layout can only draw with the norm above the blocks. A one-op sub-module in between (an
    embedding lookup) does not cut: its small loop costs the layout nothing, and a box per run would scatter
    the ops that prepare the blocks' inputs."""
    depth = len(path)
    runs = [[idx[0]]]
    for a, b in itertools.pairwise(idx):
        if sum(len(p) > depth and p[:depth] == path for p in paths[a + 1:b]) > LOOSE_LEAVES:
            runs.append([])
        runs[-1].append(b)
    return runs


def _chunked(paths: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """Regroup leaves so that every expansion stays readable.

    A group that has sub-modules and more than :data:`LOOSE_LEAVES` ops of its own gets those ops bundled
    as ``(ops)`` children, one per run between its sub-modules (:func:`own_runs`; one for all past
    :data:`OWN_OPS_RUNS` runs), e.g. BERT's ``bert`` module's ~30 embedding-preparation ops next to ``encoder``.
    Groups with more than :data:`CHUNK` ops of their own get ``ops a–b`` levels, nested if needed.
    """
    has_groups = {p[:d] for p in paths for d in range(1, len(p))}
    leaves: dict[tuple[str, ...], list[int]] = defaultdict(list)
    for i, p in enumerate(paths):
        leaves[p].append(i)
    out = list(paths)
    for path, idx in leaves.items():
        if path in has_groups and len(idx) > LOOSE_LEAVES:
            runs = own_runs(paths, path, idx)
            for run, members in enumerate(runs if len(runs) <= OWN_OPS_RUNS else [idx]):
                for i in members:
                    out[i] = (*path, own_ops(run))
    leaves = defaultdict(list)
    for i, p in enumerate(out):
        leaves[p].append(i)
    for path, idx in leaves.items():
        if len(idx) <= CHUNK:
            continue
        sizes = [CHUNK]
        while len(idx) > sizes[0] * CHUNK:
            sizes.insert(0, sizes[0] * CHUNK)
        for pos, i in enumerate(idx):
            levels = []
            for size in sizes:
                start = pos // size * size
                levels.append(f"ops {start + 1}–{min(start + size, len(idx))}")
            out[i] = (*path, *levels)
    return out


# -- sizes --------------------------------------------------------------------------------------------------
FONT_PT = 10.0  # label size in scene points: at the launch zoom (1:1 or larger) labels read at 10 pt
LINE_PT = 14.0
CHAR_PT = 6.6  # generous average glyph width of the label font, so labels fit their boxes
TITLE_PT = 24.0  # room above an expanded group's contents for its title


def box_size(item: Item) -> tuple[float, float]:
    """Box size in points: wide enough for the longest label line, two lines tall."""
    longest = max(len(line) for line in item.label.split("\n"))
    return (max(96.0, CHAR_PT * longest + 16.0), 2 * LINE_PT + (10.0 if item.is_group else 6.0))


# -- layout -------------------------------------------------------------------------------------------------
def dot_available() -> bool:
    return shutil.which("dot") is not None


def layout_view(view: View) -> Layout:
    """Lay ``view`` out with graphviz dot when installed, else with :func:`layered_layout`."""
    if dot_available():
        import graphviz

        try:
            return dot_layout(view)
        except graphviz.ExecutableNotFound:
            pass
    return layered_layout(view)


def _cluster_children(view: View) -> dict[str, list[str]]:
    """Expanded groups by their nearest expanded ancestor (``""``: the top level)."""
    keys = {c[0] for c in view.clusters}
    children: dict[str, list[str]] = defaultdict(list)
    for key in keys:
        parent = key.rpartition(SEP)[0]
        while parent and parent not in keys:
            parent = parent.rpartition(SEP)[0]
        children[parent].append(key)
    return children


def dot_source(view: View) -> tuple[str, dict[str, str]]:
    """The dot graph and its cluster names: item i is node ``i{i}``, expanded groups are nested clusters."""
    import graphviz

    g = graphviz.Digraph(graph_attr={"rankdir": "TB", "nodesep": "0.25", "ranksep": "0.3", "splines": "true",
                                     "fontsize": "12", "labeljust": "l", "margin": "0"},
                         node_attr={"shape": "box", "fixedsize": "true", "label": ""})
    placed: set[int] = set()
    by_key = {c[0]: c for c in view.clusters}
    names: dict[str, str] = {}
    children = _cluster_children(view)

    def add_cluster(parent_graph, key: str) -> None:
        name = names[key] = f"cluster_{len(names)}"
        with parent_graph.subgraph(name=name) as sub:
            sub.attr(label=by_key[key][1])
            for child in children[key]:  # deeper clusters first: an item lands in its innermost group
                add_cluster(sub, child)
            for i in by_key[key][2]:
                if i not in placed:
                    placed.add(i)
                    _dot_node(sub, i, view.items[i])

    for key in children[""]:
        add_cluster(g, key)
    for i, item in enumerate(view.items):
        if i not in placed:
            _dot_node(g, i, item)
    for a, b in view.edges:
        g.edge(f"i{a}", f"i{b}")
    return g.source, {name: key for key, name in names.items()}


def _dot_node(graph, i: int, item: Item) -> None:
    w, h = box_size(item)
    graph.node(f"i{i}", width=f"{w / 72:.3f}", height=f"{h / 72:.3f}")


def dot_layout(view: View) -> Layout:
    """Run ``dot -Tjson0`` on :func:`dot_source` and convert its coordinates (y up) to scene coordinates."""
    import graphviz

    source, cluster_key = dot_source(view)
    doc = json.loads(graphviz.pipe("dot", "json0", source.encode()))
    height = float(doc["bb"].split(",")[3])
    boxes: list[tuple[float, float, float, float]] = [(0.0, 0.0, 0.0, 0.0)] * len(view.items)
    gvid_item: dict[int, int] = {}
    clusters = []
    for obj in doc.get("objects", []):
        name = obj.get("name", "")
        if name in cluster_key:
            x0, y0, x1, y1 = (float(v) for v in obj["bb"].split(","))
            clusters.append((cluster_key[name], obj.get("label", ""), (x0, height - y1, x1 - x0, y1 - y0)))
        elif name.startswith("i") and "pos" in obj:
            i = int(name[1:])
            x, y = (float(v) for v in obj["pos"].split(","))
            w, h = float(obj["width"]) * 72, float(obj["height"]) * 72
            boxes[i] = (x - w / 2, height - y - h / 2, w, h)
            gvid_item[obj["_gvid"]] = i
    by_pair = {(gvid_item.get(e["tail"]), gvid_item.get(e["head"])): _spline_points(e.get("pos", ""), height)
               for e in doc.get("edges", [])}
    edges = [by_pair.get(pair, []) for pair in view.edges]
    clusters.sort(key=lambda c: c[0].count(SEP))  # outer frames first, so inner ones are drawn on top
    return Layout(boxes=boxes, edges=edges, clusters=clusters, engine="dot")


def _spline_points(pos: str, height: float) -> list[tuple[float, float]]:
    """Bézier control points of a dot edge; the arrow end point (``e,x,y``) is appended last."""
    pts, end = [], None
    for tok in pos.split():
        parts = tok.split(",")
        if parts[0] == "e":
            end = (float(parts[1]), height - float(parts[2]))
        elif parts[0] != "s":
            pts.append((float(parts[0]), height - float(parts[1])))
    if end is not None and pts:
        # dot stops the spline short of the head for the arrowhead: continue it straight to the tip.
        last = pts[-1]
        pts += [last, end, end]
    return pts


def layered_layout(view: View) -> Layout:
    """Fallback without graphviz: every expanded group is laid out on its own, top to bottom, as one box of
    its parent (Model Explorer's recursive scheme), so frames never overlap and edges join box edges."""
    gap_x, gap_y, pad = 24.0, 26.0, 10.0
    children = _cluster_children(view)
    inside = {key: members for key, _, members in view.clusters}
    owner = [""] * len(view.items)  # innermost expanded group of each item
    for key in sorted(inside, key=lambda k: k.count(SEP)):
        for i in inside[key]:
            owner[i] = key
    chain: dict[str, list[str]] = {"": [""]}  # owner -> its ancestors from the top, itself last

    def chain_of(key: str) -> list[str]:
        if key not in chain:
            parent = next(p for p, kids in children.items() if key in kids)
            chain[key] = [*chain_of(parent), key]
        return chain[key]

    # per owner: its children ("c:<key>" or "i:<index>"), their first graph node, and edges between them
    kids: dict[str, list[str]] = defaultdict(list)
    first: dict[str, int] = {}
    for key, members in inside.items():
        first[f"c:{key}"] = min(view.items[i].nodes[0] for i in members)
        kids[chain_of(key)[-2]].append(f"c:{key}")
    for i, item in enumerate(view.items):
        first[f"i:{i}"] = item.nodes[0]
        kids[owner[i]].append(f"i:{i}")
    item_path = [[*(f"c:{k}" for k in chain_of(owner[i])[1:]), f"i:{i}"] for i in range(len(view.items))]
    local_edges: dict[str, set[tuple[str, str]]] = defaultdict(set)
    for a, b in view.edges:
        pa, pb = item_path[a], item_path[b]
        d = 0
        while pa[d] == pb[d]:
            d += 1
        local_edges[pa[d - 1][2:] if d else ""].add((pa[d], pb[d]))

    size: dict[str, tuple[float, float]] = {f"i:{i}": box_size(it) for i, it in enumerate(view.items)}
    offset: dict[str, tuple[float, float]] = {}  # child -> position inside its owner's content box

    def arrange(key: str) -> tuple[float, float]:
        members = sorted(kids[key], key=first.__getitem__)
        for m in members:
            if m.startswith("c:"):
                w, h = arrange(m[2:])
                size[m] = (w + 2 * pad, h + TITLE_PT + pad)
        preds: dict[str, list[str]] = defaultdict(list)
        for a, b in local_edges.get(key, ()):
            if first[a] < first[b]:  # node order makes these a DAG
                preds[b].append(a)
        layer: dict[str, int] = {}
        for m in members:
            layer[m] = max((layer[p] + 1 for p in preds[m]), default=0)
        rows: dict[int, list[str]] = defaultdict(list)
        for m in members:
            rows[layer[m]].append(m)
        centre: dict[str, float] = {}
        y = 0.0
        width = max((sum(size[m][0] for m in row) + gap_x * (len(row) - 1) for row in rows.values()), default=0.0)
        for r in sorted(rows):
            row = rows[r]
            row.sort(key=lambda m: (np.mean([centre[p] for p in preds[m]]) if preds[m] else 0.0, first[m]))
            row_w = sum(size[m][0] for m in row) + gap_x * (len(row) - 1)
            x = (width - row_w) / 2
            for m in row:
                offset[m] = (x, y)
                centre[m] = x + size[m][0] / 2
                x += size[m][0] + gap_x
            y += max(size[m][1] for m in row) + gap_y
        return width, max(y - gap_y, 0.0)

    arrange("")
    boxes: list[tuple[float, float, float, float]] = [(0.0, 0.0, 0.0, 0.0)] * len(view.items)
    frames: dict[str, tuple[float, float, float, float]] = {}

    def place(key: str, x0: float, y0: float) -> None:
        for m in kids[key]:
            x, y = x0 + offset[m][0], y0 + offset[m][1]
            w, h = size[m]
            if m.startswith("c:"):
                frames[m[2:]] = (x, y, w, h)
                place(m[2:], x + pad, y + TITLE_PT)
            else:
                boxes[int(m[2:])] = (x, y, w, h)

    place("", 0.0, 0.0)
    edges = []
    for a, b in view.edges:
        ax, ay, aw, ah = boxes[a]
        bx, by, bw, _ = boxes[b]
        p0, p1 = (ax + aw / 2, ay + ah), (bx + bw / 2, by)
        dy = max(12.0, abs(p1[1] - p0[1]) / 2)
        edges.append([p0, (p0[0], p0[1] + dy), (p1[0], p1[1] - dy), p1])
    labels = {key: label for key, label, _ in view.clusters}
    clusters = sorted(((k, labels[k], r) for k, r in frames.items()), key=lambda c: c[0].count(SEP))
    return Layout(boxes=boxes, edges=edges, clusters=clusters, engine="layered")


# -- disk cache ---------------------------------------------------------------------------------------------
def cache_file(cache_dir: str | os.PathLike, fingerprint: str, expanded: frozenset[str],
               regions: tuple[str, ...] = SHOWN_REGIONS["whole iteration"]) -> Path:
    digest = hashlib.sha256("\n".join([*sorted(expanded), "|", *regions]).encode()).hexdigest()[:16]
    return Path(cache_dir) / f"layout-v{LAYOUT_VERSION}-{fingerprint}-{digest}.json"


def cached_layout(view: View, fingerprint: str, expanded: frozenset[str], cache_dir: str | os.PathLike | None,
                  regions: tuple[str, ...] = SHOWN_REGIONS["whole iteration"]) -> Layout:
    """:func:`layout_view` with dot layouts kept on disk; fallback layouts are cheap and never cached. An entry is
    used only for the same boxes and edges (grouping code that changed without :data:`LAYOUT_VERSION` would
    otherwise get another view's geometry)."""
    path = cache_file(cache_dir, fingerprint, expanded, regions) if cache_dir else None
    drawn = {"items": [it.key for it in view.items], "view_edges": [list(e) for e in view.edges]}
    if path is not None and path.is_file():
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
            if all(d.get(k) == v for k, v in drawn.items()):
                return Layout(boxes=[tuple(b) for b in d["boxes"]], edges=[[tuple(p) for p in e] for e in d["edges"]],
                              clusters=[(k, lab, tuple(r)) for k, lab, r in d["clusters"]], engine=d["engine"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # an unreadable cache entry is simply recomputed
    layout = layout_view(view)
    if path is not None and layout.engine == "dot":
        write_text(path, json.dumps(asdict(layout) | drawn, separators=(",", ":")))
    return layout


def laid_out(tree: ModuleTree, expanded: frozenset[str], regions: tuple[str, ...],
             cache_dir: str | os.PathLike | None = None) -> tuple[frozenset[str], tuple[str, ...], View, Layout]:
    """One expansion state of one pass, grouped and laid out: what the graph view draws."""
    view = tree.view(expanded, regions)
    return expanded, regions, view, cached_layout(view, tree.profile.fingerprint, expanded, cache_dir, regions)
