"""Where the compiled memory model and Inductor disagree on a plan: the values the compiled backward reads from
forward (Inductor's own partition, its decompositions and joint-graph passes included), in bytes per module, for
per-block checkpointing (the calibration point), torchtitan's policy and our SAC plan, beside what the compiled
model (``sac-compiled``) holds for each; and the measured peak of each compiled step.

Usage: PYTHONPATH=. python3 benchmarks/probes/compiled_saved_bytes.py PROFILE PLAN [-v]
  PROFILE, PLAN: a grid profile and the plan bench ran on it (``acstudio plan PROFILE --budget ...
  --compiled-per-block-peak ... --compiled-step-ms ...`` rebuilds it on a CPU), e.g.
  results/probes/bert-s512.compiled.profile.json.gz results/probes/bert-s512.compiled.plan.json; -v lists every
  saved tensor.
Output: results/probes/compiled_saved_bytes_h100.txt (BERT seq 512 bs64, the grid's compiled OVER of 2026-11-27).
"""

import collections
import re
import sys

import numpy as np
import torch
import torch._functorch.config as functorch_config
import torch._inductor.compile_fx as compile_fx
import torch._inductor.config as inductor_config

from acstudio.bench.steps import enable_per_block, load, per_op_context
from acstudio.export.apply import apply_plan
from acstudio.plan.baselines import per_module
from acstudio.plan.compiled import torchtitan_held
from acstudio.plan.loading import load_plan
from acstudio.plan.schedule import PlanContext
from acstudio.profile.model import Profile
from acstudio.simulate.sac import sac_blocks
from acstudio.workload import WorkloadSpec

MiB = 2**20
VERBOSE = "-v" in sys.argv


def module_of(node) -> str:
    """The innermost module path of an FX node (dynamo's ``L['self'].bert.encoder.layer[0]`` made ``bert...0``)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "(outside)"
    path = list(stack.values())[-1][0]
    path = re.sub(r"^L\['self'\]\.?", "", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']+)'\]", r".\1", path)
    return layers(re.sub(r"forward\.__closure__\.\d+\.cell_contents\.__self__\.", "", path))


def layers(path: str) -> str:
    """Layers summed: ``bert.encoder.layer.3.output`` is ``bert.encoder.layer.*.output``."""
    return re.sub(r"\.(\d+)\.", ".*.", path)


def saved_by_inductor(model, w, optimizer):
    """Bytes per module of the values the compiled backward reads, and the compiled step's measured peak."""
    partitions = []
    partition = compile_fx.min_cut_rematerialization_partition

    def spy(gm, joint_inputs, **kwargs):
        fw, bw = partition(gm, joint_inputs, **kwargs)
        partitions.append((fw, bw))
        return fw, bw

    compile_fx.min_cut_rematerialization_partition = spy
    functorch_config.enable_autograd_cache = inductor_config.fx_graph_cache = False  # or the partitioner never runs
    torch._dynamo.reset()
    compiled = torch.compile(model)
    try:
        for step in range(3):
            if step == 2 and torch.cuda.is_available():
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            optimizer.zero_grad(set_to_none=True)
            w.loss_fn(compiled, w.batch).backward()
            optimizer.step()
    finally:
        compile_fx.min_cut_rematerialization_partition = partition
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    by_module = collections.Counter()
    for fw, bw in partitions:
        made = {n.name: n for n in fw.graph.nodes}
        for n in bw.graph.nodes:
            val = n.meta.get("val")
            if n.op != "placeholder" or n.name.startswith("tangents") or not isinstance(val, torch.Tensor):
                continue
            source = made.get(n.name)
            if source is not None and source.op == "placeholder":  # a parameter or the batch, not an activation
                continue
            key = module_of(source) if source is not None else "(unnamed)"
            if VERBOSE:
                print(f"  saved {n.name} {tuple(val.shape)} {val.dtype} from {key}"
                      f" {source.target if source is not None else ''}")
            by_module[key] += val.numel() * val.element_size()
    return by_module, peak


def held_by_model(ctx: PlanContext, recomputed) -> collections.Counter:
    """Bytes per module of the forward activations the compiled model holds from forward into backward for
    ``recomputed`` (indices): neither freed nor recomputed before their first backward use."""
    schedule = sac_blocks(ctx.sim).schedule(recomputed, compiled=True)
    rg, nodes = ctx.sim.replay, ctx.sim.profile.nodes
    held = collections.Counter()
    for k in np.flatnonzero(schedule.back < 0):
        node = nodes[rg.created[k]]
        if node.region != "backward":
            held[layers(node.module or "(outside)")] += int(rg.bytes[k])
    for first, _, size in schedule.cached.tolist():
        held[layers(nodes[first - 1].module or "(outside)") + " (scratch)"] += size
    return held


def main():
    profile = Profile.load(sys.argv[1])
    plan = load_plan(sys.argv[2], profile)
    ctx = PlanContext(profile)
    sets = {"per-block": per_module(ctx), "torchtitan": torchtitan_held(ctx), "ours": ctx.sim.indices(plan.recomputed)}
    model = {name: held_by_model(ctx, recomputed) for name, recomputed in sets.items()}
    spec = WorkloadSpec(**{k: tuple(tuple(c) for c in v) if k == "config" else v
                           for k, v in profile.workload.items()})
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    measured, peaks = {}, {}
    for name in sets:
        w, optimizer = load(spec, dev)
        if name == "per-block":
            enable_per_block(w)
        elif name == "torchtitan":
            enable_per_block(w, per_op_context)
        else:
            w.model = apply_plan(w.model, (profile, plan))
        measured[name], peaks[name] = saved_by_inductor(w.model, w, optimizer)
        del w, optimizer
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    for name in measured:
        print(f"{name}: Inductor saves {sum(measured[name].values()) / MiB:.1f} MiB, the model holds "
              f"{sum(model[name].values()) / MiB:.1f} MiB; measured peak {peaks[name] / MiB:.1f} MiB")
    for a, b in (("torchtitan", "per-block"), ("ours", "torchtitan")):
        inductor = (sum(measured[a].values()) - sum(measured[b].values())) / MiB
        simulated = (sum(model[a].values()) - sum(model[b].values())) / MiB
        print(f"\n{a} - {b}: Inductor {inductor:+.1f} MiB, model {simulated:+.1f} MiB, peak "
              f"{(peaks[a] - peaks[b]) / MiB:+.1f} MiB\nper module (layers summed), MiB: Inductor, model")
        keys = set(measured[a]) | set(measured[b]) | set(model[a]) | set(model[b])
        for key in sorted(keys):
            inductor = (measured[a][key] - measured[b][key]) / MiB
            simulated = (model[a][key] - model[b][key]) / MiB
            if abs(inductor) > 0.05 or abs(simulated) > 0.05:
                print(f"  {key:60s} {inductor:+9.1f} {simulated:+9.1f}")


if __name__ == "__main__":
    main()
