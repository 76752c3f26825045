"""compiled_gap: why sac+compile of torchtitan's per-op plan runs slower than compile+per-op (llama sample shape).

Variants (each torch.compile'd, inductor, bf16 autocast, AdamW, as acstudio bench runs them):
  titan     compile+per-op: torchtitan's policy (MUST_SAVE attention + odd matmuls, PREFER_RECOMPUTE rest)
  ours      apply_plan of the per-op set (baselines.per_op): our SAC form; q_proj's mm is MUST_RECOMPUTE
  ours_qmm  the same policy with q_proj's mm (+ its _unsafe_view) flipped to MUST_SAVE (= titan's decisions)
  ours_qrot per-op set with the rotary query (attention's q input) kept: same bytes as titan's saved q mm
Timing interleaved in rounds; peak = max_allocated - allocated before the step (all models resident).
Run: PYTHONPATH=. python3 benchmarks/probes/compiled_gap.py (one H200, about 2 minutes; it reads the bundled
h200_llama_bs8_bf16_adamw sample profile, which was measured again after this probe ran)
"""
import collections
import copy
import tempfile
import time

import torch

T0 = time.time()
from torch._dynamo.utils import counters  # noqa: E402

from acstudio.bench.steps import autocast, enable_per_block, per_op_context  # noqa: E402
from acstudio.export.apply import apply_plan  # noqa: E402
from acstudio.export.sac import OpDecision, SacPolicy  # noqa: E402
from acstudio.plan.baselines import is_attention, per_op  # noqa: E402
from acstudio.plan.schedule import PlanContext  # noqa: E402
from acstudio.profile.model import Profile  # noqa: E402
from acstudio.workload import WorkloadSpec, build_workload  # noqa: E402

dev = torch.device("cuda")
profile = Profile.load("sample_profiles/h200_llama_bs8_bf16_adamw.json.gz")
spec = WorkloadSpec.from_dict(profile.workload)
ctx = PlanContext(profile)
titan_set = per_op(ctx)
nodes, index = profile.nodes, profile.node_index
q_inputs = {ctx.rg.act_index.get(nodes[index[nd.inputs[0]]].storage) for nd in nodes
            if is_attention(nd.target) and nd.region == "forward"}
plan_ours = ctx.plan_for_set("per-op", profile.peak_bytes, titan_set, mode="sac")
plan_qrot = ctx.plan_for_set("per-op", profile.peak_bytes, [k for k in titan_set if k not in q_inputs], mode="sac")
print(f"per-op set {len(titan_set)} acts, q inputs kept back {len(q_inputs & set(titan_set))}; predicted sac peak "
      f"ours {plan_ours.predicted_peak_bytes/2**20:.0f} MiB qrot {plan_qrot.predicted_peak_bytes/2**20:.0f} MiB",
      flush=True)
pol = SacPolicy.from_plan(profile, plan_ours.recomputed)
flipped = 0
for ops in pol.blocks.values():
    for j, d in enumerate(ops):
        if d.module.endswith("self_attn.q_proj") and d.op in ("aten.mm.default", "aten._unsafe_view.default"):
            ops[j] = OpDecision(d.op, d.module, True, d.updates_state, d.offload)
            flipped += 1
qmm_dir = tempfile.mkdtemp()
pol.save(qmm_dir)
print(f"flipped {flipped} q_proj ops to MUST_SAVE", flush=True)

base = build_workload(spec)
state = copy.deepcopy(base.model.state_dict())


def make(name):
    w = build_workload(spec)
    w.model.load_state_dict(state)
    if name == "titan":
        enable_per_block(w, per_op_context)
    elif name == "ours":
        apply_plan(w.model, (profile, plan_ours))
    elif name == "ours_qmm":
        apply_plan(w.model, qmm_dir)
    elif name == "ours_qrot":
        apply_plan(w.model, (profile, plan_qrot))
    w.to(dev)
    model = torch.compile(w.model)
    opt = w.make_optimizer()

    def step():
        opt.zero_grad(set_to_none=True)
        with autocast(spec, dev):
            loss = w.loss_fn(model, w.batch)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


steps, info = {}, {}
for name in ("titan", "ours", "ours_qmm", "ours_qrot"):
    if time.time() - T0 > 120:
        print(f"skip {name}: out of time", flush=True)
        continue
    counters.clear()
    t = time.time()
    s = make(name)
    losses = [s().item() for _ in range(3)]
    torch.cuda.synchronize()
    info[name] = (time.time() - t, dict(counters["stats"]), sum(counters["graph_break"].values()), losses[-1])
    steps[name] = s
    print(f"{name}: setup+3 warm {info[name][0]:.1f}s stats {info[name][1]} graph breaks {info[name][2]} "
          f"loss {losses[-1]:.5f}", flush=True)

times = collections.defaultdict(list)
peaks = {}
for _r in range(4):
    for name, s in steps.items():
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(3):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            s()
            b.record()
            torch.cuda.synchronize()
            times[name].append(a.elapsed_time(b))
        peaks[name] = torch.cuda.max_memory_allocated() - before
    if time.time() - T0 > 165:
        break

import statistics  # noqa: E402

for name, ts in times.items():
    q = statistics.quantiles(ts, n=4)
    print(f"{name:10s} median {statistics.median(ts):7.2f} ms IQR {q[2]-q[0]:5.2f} n {len(ts)} "
          f"step peak over resident {peaks[name]/2**20:8.0f} MiB")
print(f"total {time.time()-T0:.0f}s torch {torch.__version__}")
