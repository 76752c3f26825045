"""What the compiled step saves for a 2-layer GPT-2 (seq 1024, bs2) under torchtitan's policy and under our SAC
form of torchtitan's set as it runs compiled (random ops decided one by one, the dropouts marked save-eager): the
backward graph's saved tensors and replayed ops, from AOTAutograd's partitioner (no Inductor).

Usage: PYTHONPATH=. python3 benchmarks/probes/compiled_dropout_saves.py
Output: results/probes/compiled_dropout_saves_h100.txt
"""

import copy
from collections import Counter

import torch
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd

from acstudio.bench.steps import enable_per_block, load, per_op_context
from acstudio.export.apply import apply_plan
from acstudio.export.sac import SacPolicy
from acstudio.plan.compiled import TIMED_MODE, torchtitan_held
from acstudio.plan.schedule import PlanContext
from acstudio.profiler import profile_workload
from acstudio.workload import WorkloadSpec


def saved_by_backward(model, w):
    graphs = {}

    def keep(name):
        def compiler(gm, example_inputs):
            graphs[name] = gm
            return make_boxed_func(gm.forward)
        return compiler

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                           partition_fn=min_cut_rematerialization_partition)
    w.loss_fn(torch.compile(model, backend=backend), w.batch).backward()
    nodes = graphs["backward"].graph.nodes
    saved = Counter((tuple(n.meta["val"].shape), str(n.meta["val"].dtype)) for n in nodes
                    if n.op == "placeholder" and not n.name.startswith(("primals", "tangents"))
                    and isinstance(n.meta.get("val"), torch.Tensor))
    ops = Counter(str(n.target) for n in nodes if n.op == "call_function")
    return saved, ops


def main():
    spec = WorkloadSpec("gpt2", batch_size=2, seq_len=1024, optimizer="adam", config=(("n_layer", "2"),))
    profile = profile_workload(spec, "cuda", warmup=1, iterations=3)
    ctx = PlanContext(profile)
    held = ctx.plan_for_set("per-op", profile.peak_bytes, torchtitan_held(ctx), mode=TIMED_MODE)
    policy = SacPolicy.from_plan(profile, held.recomputed)
    print("eager_only ops:", sum(d.eager_only for ops in policy.blocks.values() for d in ops))
    w, _ = load(spec, torch.device("cuda"))
    titan = copy.deepcopy(w)
    enable_per_block(titan, per_op_context)
    for name, model in (("torchtitan", titan.model), ("ours", apply_plan(copy.deepcopy(w.model), (profile, held)))):
        saved, ops = saved_by_backward(model, w)
        print(name, "saved:", sorted(saved.items()))
        print(name, "backward ops:", sorted((k, v) for k, v in ops.items() if "mm" in k or "rng" in k or "rand" in k
                                              or "dropout" in k or "attention" in k))


if __name__ == "__main__":
    main()
