"""The SAC form under torch.compile against torchtitan's policy: what AOTAutograd's partitioner saves and replays
(tiny LLaMA on the CPU, Inductor's min-cut partitioner, the graphs recorded instead of compiled)."""

import copy
import dataclasses
import functools
from collections import Counter

import pytest
import torch
from conftest import tiny_spec
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters

from acstudio.bench.steps import enable_per_block, per_op_context
from acstudio.capture import capture_step
from acstudio.export.apply import apply_plan
from acstudio.export.sac import OpDecision, SacPolicy
from acstudio.plan.baselines import per_module, per_op, torchtitan_saved
from acstudio.plan.compiled import TIMED_MODE, fastest_in_compiled_memory, torchtitan_held
from acstudio.plan.schedule import PlanContext
from acstudio.plan.solvers import DEFAULT_SOLVER, plan_for_mode
from acstudio.simulate.modes import get_mode
from acstudio.simulate.sac import is_op, simulate_sac
from acstudio.workload import build_workload

LAYERS = 2  # tiny_spec's LLaMA


@functools.cache
def llama():
    """(workload, plan context) of a tiny LLaMA."""
    from test_rewrite import quick_profile

    spec = tiny_spec("llama", optimizer="adam")
    w = build_workload(spec)
    profile = quick_profile(spec, capture_step(w.model, w.make_optimizer(), w.batch, w.loss_fn))
    return w, PlanContext(profile)


@dataclasses.dataclass(frozen=True)
class Partition:
    """One compiled training step's backward: its ops, the shapes and dtypes it reads from forward, and how many
    graphs Dynamo made and broke."""

    ops: Counter
    saved: list
    graphs: int
    breaks: int


def compiled_partition(model: torch.nn.Module, w) -> Partition:
    graphs = {}

    def keep(name):
        def compiler(gm, example_inputs):
            graphs[name] = gm
            return make_boxed_func(gm.forward)
        return compiler

    torch._dynamo.reset()
    counters.clear()
    backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                           partition_fn=min_cut_rematerialization_partition)
    w.loss_fn(torch.compile(model, backend=backend), w.batch).backward()
    nodes = graphs["backward"].graph.nodes
    saved = sorted((tuple(n.meta["val"].shape), str(n.meta["val"].dtype)) for n in nodes
                   if n.op == "placeholder" and not n.name.startswith(("primals", "tangents")))
    return Partition(Counter(str(n.target) for n in nodes if n.op == "call_function"), saved,
                     counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))


def torchtitans(w) -> Partition:
    """compile+per-op: torchtitan's policy on every layer, as the benchmark runs it."""
    titan = build_workload(w.spec)
    titan.model.load_state_dict(w.model.state_dict())
    enable_per_block(titan, per_op_context)
    return compiled_partition(titan.model, w)


def applied(w, ctx, recomputed) -> Partition:
    plan = ctx.plan_for_set("per-op", ctx.profile.peak_bytes, list(recomputed), mode="sac")
    return compiled_partition(apply_plan(copy.deepcopy(w.model), (ctx.profile, plan)), w)


def test_given_torchtitans_decisions_the_compiled_sac_form_partitions_as_torchtitans_policy(tmp_path):
    """apply_plan's wrapper (its training check, fresh policy per call, MUST_RECOMPUTE where torchtitan says
    PREFER_RECOMPUTE, which the partitioner reads alike) costs nothing structural: one graph, no break, and with
    torchtitan's op decisions the backward saves and runs exactly what torchtitan's does."""
    w, ctx = llama()
    profile = ctx.profile
    plan = ctx.plan_for_set("per-op", profile.peak_bytes, per_op(ctx), mode="sac")
    saved = {profile.nodes[i].id for i in torchtitan_saved(ctx)}
    by_id = profile.node_by_id
    blocks = {b: [OpDecision(by_id[i].target, by_id[i].module, i in saved) for i, _ in ops if is_op(by_id[i])]
              for b, ops in simulate_sac(profile, plan.recomputed).decisions.items()}
    dataclasses.replace(SacPolicy.from_plan(profile, plan.recomputed), blocks=blocks).save(tmp_path)
    ours = compiled_partition(apply_plan(copy.deepcopy(w.model), tmp_path), w)
    titan = torchtitans(w)
    assert (ours.graphs, ours.breaks) == (titan.graphs, titan.breaks) == (1, 0)
    assert ours.saved == titan.saved and ours.ops == titan.ops


@pytest.mark.parametrize("held", [False, True])
def test_torchtitans_set_as_it_runs_compiled_replays_no_query_projection(held):
    """torchtitan's policy saves each layer's query projection, whose output backward never reads; the partitioner
    saves it and recomputes the rotary embedding from it. The per-op set frees the rotary query instead, so its
    SAC form replays the projection in every layer; kept back in its place (torchtitan_held), it replays the
    matmuls torchtitan's does, and the last layer's down projection, whose output passes through to the final
    norm: the SAC form recomputes that layer's output for the norm's backward where torchtitan's saves it."""
    w, ctx = llama()
    recomputed = torchtitan_held(ctx) if held else per_op(ctx)
    replayed = applied(w, ctx, recomputed).ops["aten.mm.default"] - torchtitans(w).ops["aten.mm.default"]
    assert replayed == 1 + (0 if held else LAYERS)


def test_where_no_plan_fits_the_compiled_plan_is_the_fastest_at_the_lowest_peak_reached():
    """Plans that free enough tie at a peak that what they free does not reach; a budget just below it (a peer's
    measured peak less the planning headroom) fits none. The plan is then the fastest at that peak, not the
    lowest-peak plan found first, and says it missed the budget."""
    from test_rewrite import quick_profile

    spec = tiny_spec("llama", optimizer="adam", batch_size=4)
    w = build_workload(spec)
    ctx = PlanContext(quick_profile(spec, capture_step(w.model, w.make_optimizer(), w.batch, w.loss_fn)))
    floor = get_mode(TIMED_MODE).peak(ctx.sim, per_module(ctx))[0]
    first = plan_for_mode(ctx, floor - 1, TIMED_MODE)
    chosen = fastest_in_compiled_memory(ctx, floor - 1, DEFAULT_SOLVER, None)
    assert not first.feasible and not chosen.feasible and chosen.budget_bytes == floor - 1
    assert chosen.predicted_peak_bytes == first.predicted_peak_bytes == floor
    assert chosen.predicted_extra_ms < first.predicted_extra_ms and "lowest peak reached" in chosen.stop_reason
