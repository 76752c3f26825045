"""The whole-iteration simulator against hand-computed answers and a brute-force run of the rewritten program.

Profiles here are built from plain tuples (no torch), with memory accounted per storage exactly as the
profiler's free-after-last-use rule does. ``test_planner.py`` and ``test_baselines.py`` reuse the builders.
"""

from __future__ import annotations

import functools
import random

import numpy as np
import pytest

from acstudio.errors import ACStudioError
from acstudio.profile.model import ActivationRecord, NodeRecord, Profile, TensorRecord
from acstudio.simulate import TIMELINE_CATEGORIES, Simulator
from acstudio.simulate.replay import FORWARD_REGIONS, ReplayGraph

REPLAY = {"forward": "ok", "loss": "ok", "backward": "backward op", "optimizer": "optimizer op",
          "input": "placeholder (always resident)", "output": "output"}
TARGETS = {"view": "aten.view.default", "inplace": "aten.relu_.default", "random": "aten.bernoulli.p",
           "output": "output"}


def build_profile(specs: list[tuple], workspace: dict[str, int] | None = None, name: str = "synthetic",
                  modules: dict[str, str] | None = None) -> Profile:
    """A Profile from ``(id, region, inputs, bytes, ms, kind)`` rows in execution order.

    ``kind``: ``new`` (allocates ``bytes``), ``param``/``batch`` (placeholders), ``view`` / ``inplace`` (alias
    of the first input's storage), ``random`` (allocates; not replayable), ``multi`` (``bytes`` is a tuple: one
    storage per output, ``id``, ``id.1``, ...), ``getitem:k`` (element k of a multi node), ``output``.
    Memory: ``mem_after[i]`` = storages alive during node i, ``mem_peak[i]`` that plus ``workspace[id]``.
    ``modules`` gives module paths (default ``""``).
    """
    workspace, modules = workspace or {}, modules or {}
    ids = [s[0] for s in specs]
    index = {nid: i for i, nid in enumerate(ids)}
    storage_of: dict[str, str] = {}
    sizes: dict[str, int] = {}
    creator: dict[str, int] = {}
    nodes = []
    for i, (nid, region, inputs, nbytes, ms, kind) in enumerate(specs):
        fresh = []
        if kind in ("new", "random", "param", "batch"):
            storage, fresh = nid, [(nid, nbytes)]
        elif kind == "multi":
            fresh = [(nid if j == 0 else f"{nid}.{j}", b) for j, b in enumerate(nbytes)]
            storage = nid
        elif kind.startswith("getitem:"):
            j = int(kind.split(":")[1])
            storage = inputs[0] if j == 0 else f"{inputs[0]}.{j}"
        elif kind in ("view", "inplace"):
            storage = storage_of[inputs[0]]
        else:
            storage = ""
        for sid, b in fresh:
            sizes[sid], creator[sid] = b, i
        storage_of[nid] = storage
        op = {"input": "placeholder", "output": "output"}.get(region, "call_function")
        replay = "random op (recomputing would draw new random numbers)" if kind == "random" else REPLAY[region]
        target = "operator.getitem" if kind.startswith("getitem") else TARGETS.get(kind, f"aten.op_{nid}.default")
        nodes.append(NodeRecord(
            id=nid, name=nid, op=op, target=target, region=region, module=modules.get(nid, ""),
            inputs=list(inputs), shape="", dtype="float32", storage=storage,
            new_bytes=sum(b for _, b in fresh), replay=replay, run_time_ms=float(ms)))

    users: dict[int, list[int]] = {i: [] for i in range(len(nodes))}
    for i, nd in enumerate(nodes):
        if nd.op != "output":
            for u in nd.inputs:
                users[index[u]].append(i)
    holders: dict[str, set[int]] = {sid: {c} for sid, c in creator.items()}
    for i, nd in enumerate(nodes):
        if nd.storage:
            holders[nd.storage].add(i)
    out = nodes[-1]
    pinned_by_output = {sid for u in out.inputs for sid, hs in holders.items() if index[u] in hs}
    loss_storages = {sid for sid, hs in holders.items() if index[out.inputs[0]] in hs}

    tensors, activations, live = [], [], []
    for sid in sizes:
        uses = sorted({j for h in holders[sid] for j in (h, *users[h])})
        c = creator[sid]
        kind = specs[c][5]
        if kind in ("param", "batch"):
            category, end = ("parameter" if kind == "param" else "input"), None
        elif sid in pinned_by_output:
            category, end = ("temporary" if sid in loss_storages else "gradient"), None
        else:
            bw = [j for j in uses if nodes[j].region == "backward"]
            category = "activation" if nodes[c].region in FORWARD_REGIONS and bw else "temporary"
            end = uses[-1]
        live.append((c, len(nodes) - 1 if end is None else end, sizes[sid]))
        tensors.append(TensorRecord(id=sid, bytes=sizes[sid], category=category, created_at=ids[c],
                                    freed_after="" if end is None else ids[end],
                                    aliases=[ids[h] for h in sorted(holders[sid]) if h != c]))
        if category == "activation":
            fw = [j for j in uses if nodes[j].region in FORWARD_REGIONS]
            blocked = [h for h in sorted(holders[sid]) if nodes[h].region in FORWARD_REGIONS
                       and nodes[h].replay != "ok"]
            activations.append(ActivationRecord(
                id=sid, bytes=sizes[sid], created_at=ids[c], last_fw_use=ids[fw[-1]], first_bw_use=ids[bw[0]],
                last_bw_use=ids[bw[-1]], inactive_time_ms=sum(nodes[j].run_time_ms for j in range(fw[-1] + 1, bw[0])),
                recomputable=not blocked, reason=f"{ids[blocked[0]]}: {nodes[blocked[0]].replay}" if blocked else ""))
    for i, nd in enumerate(nodes):
        nd.mem_after = sum(b for s, e, b in live if s <= i <= e)
        nd.mem_peak = nd.mem_after + workspace.get(nd.id, 0)
    peak = max(range(len(nodes)), key=lambda i: nodes[i].mem_peak)
    return Profile(
        workload={"model": name, "batch_size": 1, "optimizer": "sgd", "precision": "fp32"},
        environment={"device": "synthetic"}, graph={"specs": [list(s) for s in specs], "workspace": workspace},
        nodes=nodes, tensors=tensors, activations=activations, peak_bytes=nodes[peak].mem_peak,
        peak_node=ids[peak], peak_breakdown={}, iteration_ms=sum(nd.run_time_ms for nd in nodes))


# 6-op chain a -> b -> c -> loss with its backward; hand-computed below.
CHAIN = [
    ("x", "input", [], 8, 0, "batch"), ("w", "input", [], 4, 0, "param"),
    ("a", "forward", ["x", "w"], 100, 1, "new"), ("b", "forward", ["a"], 200, 2, "new"),
    ("c", "forward", ["b"], 300, 3, "new"), ("loss", "loss", ["c"], 4, 1, "new"),
    ("gc", "backward", ["loss", "c"], 300, 3, "new"), ("gb", "backward", ["gc", "b"], 200, 2, "new"),
    ("ga", "backward", ["gb", "a"], 100, 1, "new"), ("gw", "backward", ["ga", "x", "w"], 4, 1, "new"),
    ("out", "output", ["loss", "gw"], 0, 0, "output"),
]


def chain_profile() -> Profile:
    return build_profile(CHAIN, name="chain")


def random_profile(seed: int, n_forward: int = 10) -> Profile:
    """A random forward DAG (skips, views, in-place ops, multi-output nodes, random ops) with a backward that
    reads random forward values, one parameter update, and random per-node workspaces."""
    rng = random.Random(seed)
    specs: list[tuple] = [("x", "input", [], 64, 0, "batch"), ("w", "input", [], 16, 0, "param")]
    values = ["x"]  # forward values later ops may read
    saved: list[list[str]] = []  # per forward op: what its backward reads
    fresh_storage = {"x": False}
    for j in range(n_forward):
        nid, prev = f"f{j}", values[-1]
        ins = list(dict.fromkeys([prev, *rng.sample(values, min(len(values), rng.randint(0, 2)))]))
        ins += ["w"] if rng.random() < 0.3 else []
        r, ms = rng.random(), rng.choice([0.5, 1.0, 2.0, 3.0])
        if r < 0.1:
            specs.append((nid, "forward", ins, rng.randint(8, 64), ms, "random"))
            values.append(nid)
        elif r < 0.25:
            specs.append((nid, "forward", ins, (rng.randint(8, 128), rng.randint(1, 16)), ms, "multi"))
            specs += [(f"{nid}g0", "forward", [nid], 0, 0.01, "getitem:0"),
                      (f"{nid}g1", "forward", [nid], 0, 0.01, "getitem:1")]
            values += [f"{nid}g0"]
            saved.append([f"{nid}g1", f"{nid}g0"])
            fresh_storage[f"{nid}g0"] = True
            continue
        elif r < 0.4 and fresh_storage.get(prev):
            specs.append((nid, "forward", [prev], 0, 0.2, "inplace"))
            values.append(nid)
        elif r < 0.5 and prev != "x":
            specs.append((nid, "forward", [prev], 0, 0.01, "view"))
            values.append(nid)
        else:
            specs.append((nid, "forward", ins, rng.randint(8, 128), ms, "new"))
            values.append(nid)
        fresh_storage[nid] = specs[-1][5] != "random"
        saved.append(rng.sample([*ins, nid], rng.randint(0, min(2, len(ins) + 1))))
    specs.append(("loss", "loss", [values[-1]], 4, 0.5, "new"))
    grad = "loss"
    for j, reads in enumerate(reversed(saved)):
        specs.append((f"g{j}", "backward", list(dict.fromkeys([grad, *reads])), rng.randint(8, 128), 1.0, "new"))
        grad = f"g{j}"
    specs += [("gw", "backward", [grad, "w"], 16, 0.5, "new"), ("opt", "optimizer", ["w", "gw"], 0, 0.5, "inplace"),
              ("out", "output", ["loss", "gw"], 0, 0, "output")]
    workspace = {s[0]: rng.choice([0, 0, 8, 32]) for s in specs if s[1] not in ("input", "output")}
    return build_profile(specs, workspace, name=f"random{seed}")


def brute_force(profile: Profile, recomputed: list[str]) -> tuple[int, list[int]]:
    """Peak and per-node memory of the rewritten program, by explicit liveness of every value.

    Recomputations (from the replay graph) run before their first backward use in creation order; backward
    nodes read the recomputed copies. A value lives from the step that makes it to the last step that reads
    any node holding it; placeholders and outputs live to the end. Per node: the highest of the node's own
    step and the replay steps inserted before it.
    """
    rg = ReplayGraph(profile)
    nodes, index = profile.nodes, profile.node_index
    ks = [rg.act_index[a] for a in recomputed]
    mask = np.zeros(len(rg.act_ids), dtype=bool)
    mask[ks] = True
    exps = {k: rg.expand(k, mask) for k in ks}
    fresh: dict[int, list[str]] = {}
    for t in profile.tensors:
        fresh.setdefault(index[t.created_at], []).append(t.id)
    size = {t.id: t.bytes for t in profile.tensors}
    held = [set(fresh.get(i, [])) | ({nd.storage} if nd.storage else set()) for i, nd in enumerate(nodes)]
    rc_of = {rg.act_ids[k]: k for k in ks}

    steps: list[tuple[int, list, list, int]] = []  # (node index, values made, values read, workspace)
    for i, nd in enumerate(nodes):
        for k in sorted((k for k in ks if rg.first_bw[k] == i), key=lambda k: (rg.created[k], k)):
            in_replay = {int(v) for v in exps[k].nodes}
            for v in exps[k].nodes:
                reads = []
                for u in nodes[v].inputs:
                    u = index[u]
                    if u in in_replay:
                        reads += [("rc", k, s) for s in held[u]]
                    else:
                        reads += [("rc", rc_of[s], s) if s in rc_of else ("orig", s) for s in held[u]]
                made = [("rc", k, s) for s in fresh.get(int(v), [])]
                steps.append((i, made, reads + [m for m in made if m[2] == rg.act_ids[k]], 0))
        made = [("orig", s) for s in fresh.get(i, [])]
        reads = []
        for u in nd.inputs:
            for s in held[index[u]]:
                copy = nd.region not in FORWARD_REGIONS and s in rc_of
                reads.append(("rc", rc_of[s], s) if copy else ("orig", s))
        peak_extra = nd.mem_peak - nd.mem_after
        steps.append((i, made, reads, peak_extra))
    # Kept recomputed copies are read by every backward reader, recorded above; pinned values never die.
    pinned = {("orig", t.id) for t in profile.tensors if not t.freed_after}
    born, last = {}, {}
    for j, (_, made, reads, _) in enumerate(steps):
        for v in made:
            born[v] = j
            last[v] = max(last.get(v, j), j)
        for v in reads:
            last[v] = j
    for v in pinned:
        last[v] = len(steps)
    per_node = [0] * len(nodes)
    for j, (i, _, _, ws) in enumerate(steps):
        mem = ws + sum(size[v[-1]] for v, b in born.items() if b <= j <= last[v])
        per_node[i] = max(per_node[i], mem)
    return max(per_node), per_node


def extends_sources(sim: Simulator, ks: list[int]) -> bool:
    """Whether some retained activation is kept alive past its last use for a recomputation."""
    _, keep_until, _ = sim.schedule_facts(ks)
    return bool(np.any(keep_until > sim.replay.last_bw))


# -- hand-computed chain ---------------------------------------------------------------------------------
def test_chain_by_hand():
    p = chain_profile()
    sim = Simulator(p)
    assert (sim.baseline_peak, sim.baseline_peak_node) == (916, "gc") == (p.peak_bytes, p.peak_node)
    assert [sim.replay.act_ids[k] for k in sim.replay.candidates] == ["a", "b"]
    assert sim.replay.reason[sim.replay.act_index["c"]].startswith("no node runs between")
    assert sim.peak([]) == (916, "gc")
    assert sim.peak(["a"]) == (816, "gc")
    assert sim.peak(["b"]) == (816, "gb")
    r = sim.simulate(["a", "b"])
    assert (r.peak_bytes, r.peak_node) == (716, "gb")
    # b's replay runs a's chain too (a is not back in memory before gb): 1 + 2 ms, then a again: 1 ms.
    assert r.recompute_ms == {"a": 1.0, "b": 3.0} and r.extra_ms == 4.0
    assert sim.floor_bytes == 716
    # Before gb the replay of b holds a' and b' (300 B) on top of 12 + 4 + 300 (x, w, loss, gc): 616 < 716.
    assert r.timeline.sum(axis=1).tolist()[p.node_index["gb"]] == 716
    assert r.timeline[p.node_index["gb"], TIMELINE_CATEGORIES.index("recompute_transients")] == 0


def test_unmodified_simulation_reproduces_measured_memory():
    for p in [chain_profile(), *(random_profile(s) for s in range(5))]:
        sim = Simulator(p)
        r = sim.simulate([])
        assert (r.peak_bytes, r.peak_node) == (p.peak_bytes, p.peak_node)
        assert r.timeline.sum(axis=1).tolist() == [nd.mem_peak for nd in p.nodes]
        assert r.extra_ms == 0.0


def test_timeline_categories():
    p = chain_profile()
    r = Simulator(p).simulate(["a"])
    cols = {c: r.timeline[:, j] for j, c in enumerate(TIMELINE_CATEGORIES)}
    i = p.node_index
    assert cols["parameter"][i["a"]] == 4 and cols["gradient"][i["gw"]] == 4
    assert cols["retained_activations"][i["gc"]] == 200 + 300  # b and c; a is freed for recomputation
    assert cols["other"][i["gc"]] == 8 + 4 + 300  # batch, loss and gc itself
    # The replay of a before ga holds a' (100 B) but the node itself (416 B) is higher.
    assert r.timeline[i["ga"]].sum() == 416 and cols["recompute_transients"][i["ga"]] == 0


def test_multi_output_in_place_and_random_ops(monkeypatch):
    """getitem reads force the producer to be replayed; a stale (later rewritten) value is not a source."""
    specs = [
        ("x", "input", [], 16, 0, "batch"), ("w", "input", [], 4, 0, "param"),
        ("conv", "forward", ["x", "w"], 64, 2, "new"),
        ("bn", "forward", ["conv", "w"], (64, 4), 1, "multi"),
        ("bn0", "forward", ["bn"], 0, 0, "getitem:0"), ("bn1", "forward", ["bn"], 0, 0, "getitem:1"),
        ("mul", "forward", ["bn0"], 64, 1, "new"),  # reads bn0 before relu_ rewrites it
        ("relu", "forward", ["bn0"], 0, 0.5, "inplace"),
        ("drop", "forward", ["relu"], 64, 0.5, "random"),
        ("fc", "forward", ["drop", "mul", "w"], 32, 1, "new"),
        ("loss", "loss", ["fc"], 4, 0.1, "new"),
        ("g1", "backward", ["loss", "fc", "drop", "mul"], 64, 1, "new"),
        ("g2", "backward", ["g1", "relu", "bn1", "conv"], 64, 1, "new"),
        ("gw", "backward", ["g2", "x"], 4, 1, "new"),
        ("out", "output", ["loss", "gw"], 0, 0, "output"),
    ]
    p = build_profile(specs)
    rg = ReplayGraph(p)
    k = rg.act_index
    assert not rg.is_candidate[k["drop"]] and "random" in rg.reason[k["drop"]]
    # bn.1 (save_mean) comes from its getitem: the multi-output node runs again, conv is read from memory.
    assert p.nodes[rg.own[k["bn.1"]][0]].id == "bn"
    assert [rg.act_ids[s] for s in rg.stops[k["bn.1"]]] == ["conv"]
    # mul read bn0 before relu_ rewrote that storage, so the resident bn tensor cannot feed its replay; bn's
    # storage is then rematerialised whole, as the rewriter does: bn and its in-place writer relu_.
    assert {p.nodes[v].id for v in rg.own[k["mul"]]} == {"mul", "bn0", "bn", "relu"}
    assert rg.params[k["mul"]] == ("w",)
    # Its own chain: conv, then bn and the in-place relu over it.
    assert {p.nodes[v].id for v in rg.own[k["bn"]]} == {"bn", "bn0", "relu"}
    # Two outputs of bn are alive during its replay (64 + 4), then the save_mean dies; bn's storage stays.
    assert rg.transient_bytes(k["bn"], rg.own[k["bn"]]) == 68
    # Planners ask for the same transients thousands of times: asked again, it is remembered, by activation and
    # replay (another replay of the same activation is worked out afresh).
    worked_out = []
    monkeypatch.setattr(rg, "_transient_bytes", lambda a, replay: worked_out.append(a) or -1)
    assert rg.transient_bytes(k["bn"], rg.own[k["bn"]].copy()) == 68 and not worked_out
    assert rg.transient_bytes(k["bn"], rg.own[k["mul"]]) == -1 and worked_out == [k["bn"]]
    monkeypatch.undo()
    sim = Simulator(p)
    with pytest.raises(ACStudioError, match=r"cannot be recomputed: .*random"):
        sim.peak(["drop"])
    with pytest.raises(ACStudioError, match="not an activation"):
        sim.peak(["x"])
    for subset in (["bn"], ["bn", "conv"], ["mul", "bn.1"], [rg.act_ids[c] for c in rg.candidates]):
        peak, per_node = brute_force(p, subset)
        r = sim.simulate(subset)
        assert r.peak_bytes == peak and r.timeline.sum(axis=1).tolist() == per_node


@pytest.mark.parametrize("seed", range(40))
def test_simulator_matches_brute_force_liveness(seed):
    p = random_profile(seed, n_forward=6 + seed % 9)
    sim = Simulator(p)
    rng = random.Random(seed)
    cands = [sim.replay.act_ids[k] for k in sim.replay.candidates]
    subsets = [cands, *(rng.sample(cands, rng.randint(1, len(cands))) for _ in range(6))] if cands else []
    for subset in subsets:
        peak, per_node = brute_force(p, subset)
        r = sim.simulate(subset)
        assert sim.peak(subset) == (r.peak_bytes, r.peak_node)
        timeline = r.timeline.sum(axis=1)
        assert r.peak_bytes == timeline.max()
        if extends_sources(sim, sim.indices(subset)):
            # A kept-alive source is charged until its replay ends (FX frees it at its last read): never less.
            assert r.peak_bytes >= peak and np.all(timeline >= per_node)
        else:
            assert r.peak_bytes == peak and timeline.tolist() == per_node


@functools.cache
def tiny_real_profile() -> Profile:
    """A real CPU profile of the tiny BERT (dropout, attention mask), made once per test session."""
    from conftest import tiny_spec

    from acstudio.profiler import profile_workload

    return profile_workload(tiny_spec("bert"), "cpu", warmup=0)


def test_real_profile_baseline_is_exact():
    p = tiny_real_profile()
    sim = Simulator(p)
    r = sim.simulate([])
    assert r.timeline.sum(axis=1).tolist() == [nd.mem_peak for nd in p.nodes]
    assert (sim.baseline_peak, sim.baseline_peak_node) == (p.peak_bytes, p.peak_node)
    rg = sim.replay
    # dropout masks are recomputed by replaying their draw, unless random ops are kept (--keep-random)
    dropout = [a for a in p.activations if rg.rng_owned[rg.act_index[a.id]].size]
    assert dropout and all(a.recomputable and rg.is_candidate[rg.act_index[a.id]] for a in dropout)
    kept = Simulator(p, keep_random=True).replay
    assert all(not kept.is_candidate[kept.act_index[a.id]] for a in dropout)
    assert all("random" in kept.reason[kept.act_index[a.id]] for a in dropout)
    assert sim.floor_bytes < sim.baseline_peak
    # Every replay only runs forward nodes that may run again.
    mask = rg.is_candidate.copy()
    for k in rg.candidates:
        assert all(p.nodes[v].replay == "ok" for v in rg.expand(k, mask).nodes)
