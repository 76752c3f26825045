"""What Inductor's partitioner makes of a recompute set: the ops of the forward and backward graphs it compiles, and
how many values the forward saves, for torchtitan's set as the planner models it (``titan``:
:func:`acstudio.plan.compiled.torchtitan_held`, applied by ``acstudio.apply_plan``), that set with every dropout
saved (``minus-dropouts``: the recompute set of GPT-2's offloading compiled plans at a 1% margin), torchtitan's
own policy (``peer``: the bench's ``compile+per-op``; ``peer-regions``: its ``compile+per-op+regions``;
``peer-regions-shared-mask``: that form with each block's attention mask read as one batch row broadcast;
``peer-regions-float-mask``: with each boolean mask handed over as SDPA's additive bias, made once), a plan
file's recompute set without its offload (``plan:PLAN.json``, as the health probe's ``whole``) and that plan as the
bench runs it (``offload:PLAN.json``), and torchtitan's set with what some ops make kept back
(``titan-keep:OP+OP``, by op name: ``titan-keep:_to_copy+rsqrt`` keeps every activation an ``aten._to_copy`` or an
``aten.rsqrt`` makes; ``titan-keep:_to_copy@PLAN.json`` only those of them that plan keeps back).

``PROBE_PRICE=BENCH.json`` (a grid part's compiled bench file, made on the profile given) first prints what the
compiled planner prices each recompute-set variant at, over ``compile``, calibrated on that run's rows as the bench
calibrated its plan, and what each ``plan:`` variant keeps back over torchtitan's set, by op: which kept-back group
a plan's price counts on. ``PROBE_STEPS=0`` stops there (a CPU needs no GPU for it).

Each variant also runs ``PROBE_STEPS`` training steps: the median times of the forward and backward and of the
optimizer step after it, from the third step on (the first two compile), and the device peak. Torchtitan's policy
saves the qkv projection where the planner's set saves q, k and v (views of it): does the planner's own titan set
run as fast as the peer it is calibrated on?

Why: those GPT-2 plans were priced 4.9 ms under compile+per-op's overhead at seq 2048 (no replay of the
projection before each block's first dropout) and ran 1.2 ms over it, while their regions and copies cost 0.2 ms
(``results/probes/compiled_offload_health_s2048_h200.txt``). Does the compiled backward drop the replays the
planner took out? (It does: ``results/probes/compiled_partitioned_ops_gpt2-s2048_h200.txt``.)

After the forms, what each one's first forward saves that the first form's does not, and the reverse, by op and
dtype: with the dropouts saved, each dropout's mask (bool) and output (float) (2-layer GPT-2 on a CPU, 2026-11-29:
4 masks and 3 outputs, where torchtitan's form saves the random seeds and the biases of the projections it replays).

``peer-regions-shared-mask`` asks whether the form's cost is the mask: with the loop eager, each block compiled
alone takes the causal mask as an input materialized for the whole batch (bool, batch x 1 x seq x seq, contiguous;
torch 2.11 and transformers 5.17 on a CPU, 2026-11-29), and the form costs more with the sequence at a fixed token
count, as that mask's size grows. Here every block reads row 0 of it expanded over the batch (stride 0), the same
values where nothing is padded, as the grid's batches are not. It is not (H200, 2026-11-29, GPT-2 seq 2048: +6.5 ms
against the form's +7.1; ``results/probes/compiled_regions_mask_gpt2-s2048_h200.txt``): the kernels say each block's
backward makes SDPA's additive bias of the mask again (+4.5 ms) and its attention backward reads it slower (+3.0 ms).
``peer-regions-float-mask`` hands every block that bias, made once per step, as the model compiled whole makes it
once. Since then the bench's form hands the blocks that bias itself (``per_op_as_regions``), so ``peer-regions`` is
that form and ``peer-regions-float-mask`` runs it again; the run before is in the results file.

``PROBE_KERNELS=N`` also profiles two more forwards and backwards of each form (torch.profiler) and lists the N
kernels whose time differs most from the first form's: where a form's cost is, by kernel.

Why the kept-back groups: the 953M decoder's compiled plans keep back, over torchtitan's set, every block's RMSNorm
``rsqrt``, the bf16 cast of its rotary-embedded query or key (``_to_copy``) and its mask bias (``where``), at seq 512
and 2048 a few matmuls too, priced 3.5-3.9 ms faster compiled; at seq 1024 the set ran at compile+per-op's time
(``results/probes/compiled_offload_decoder1b-s1024_h200.txt``). Which group saves what it is priced at?

Run (one CUDA GPU, about 100 s on an H200 at seq 2048 before the timing was added):
  cd <repo> && PYTHONPATH=. python3 benchmarks/probes/compiled_partitioned_ops.py \\
      results/grid/profiles/gpt2-s2048.compiled.json.gz titan,minus-dropouts,peer
The decoder's kept-back groups, priced on a CPU (``results/planner/decoder_kept_back_prices_cpu.txt``), then timed:
  cd <repo> && PYTHONPATH=. PROBE_STEPS=0 PROBE_PRICE=results/grid/decoder1b-s1024.compiled.json \\
      python3 benchmarks/probes/compiled_partitioned_ops.py results/grid/profiles/decoder1b-s1024.compiled.json.gz \\
      titan,titan-keep:_to_copy@PLAN,titan-keep:rsqrt@PLAN,titan-keep:where@PLAN,plan:PLAN
(PLAN: ``results/probes/decoder1b-s1024.compiled.plan.json``, the plan that part ran, made again on a CPU; seq 512's
and 2048's beside it.)
``tiny-cpu`` in place of the profile profiles a 2-layer GPT-2 on the CPU first (20 s), its dropouts run as
``native_dropout`` as CUDA's eager dropout does (the CPU's runs ``bernoulli_``, which compiled code does not), its
attention without dropout (SDPA's CPU kernel draws it otherwise than compiled code).
"""

import copy
import dataclasses
import gc
import os
import sys
import time
from collections import Counter

import numpy as np
import torch
from torch._inductor.compile_fx import compile_fx, compile_fx_inner

from acstudio.bench.results import BenchResults
from acstudio.bench.steps import autocast, enable_per_block, find_blocks, per_op_as_regions, per_op_context
from acstudio.export.apply import apply_plan
from acstudio.plan.compiled import TIMED_MODE, compiled_context, torchtitan_held
from acstudio.plan.model import Plan
from acstudio.plan.schedule import PlanContext
from acstudio.profile.model import Profile
from acstudio.profiler import profile_workload
from acstudio.workload import WorkloadSpec, build_workload

STEPS = int(os.environ.get("PROBE_STEPS", "12"))  # forward and backward passes per variant, the first two compiling
BACKEND = os.environ.get("PROBE_BACKEND", "counting")  # "inductor": torch.compile's own, as the bench (no op counts)
SHOWN = ("mm", "drop", "rand", "attention", "layer_norm", "philox", "seed")  # the ops each graph's line counts
KERNELS = int(os.environ.get("PROBE_KERNELS", "0"))  # this many kernels whose time differs most from the first form's


def op_name(target: str) -> str:
    """``aten._to_copy.default`` -> ``_to_copy``."""
    parts = target.split(".")
    return parts[1] if len(parts) > 2 and parts[0] == "aten" else target


def recompute_set(variant: str, ctx: PlanContext) -> list[int] | None:
    """The activations ``variant`` recomputes where it is a recompute set of the profile (``titan``,
    ``minus-dropouts``, ``titan-keep:...``, ``plan:...``); None for the forms that are not."""
    titan = torchtitan_held(ctx)
    nodes, made = ctx.profile.nodes, ctx.rg.created
    if variant == "titan":
        return titan
    if variant == "minus-dropouts":
        return [k for k in titan if nodes[made[k]].target != "aten.native_dropout.default"]
    if variant.startswith("titan-keep:"):
        ops, _, plan_file = variant.removeprefix("titan-keep:").partition("@")
        kept = {k for k in titan if op_name(nodes[made[k]].target) in ops.split("+")}
        if plan_file:  # only what that plan keeps back
            kept -= set(ctx.sim.indices(Plan.load(plan_file).recomputed))
        return [k for k in titan if k not in kept]
    if variant.startswith("plan:"):
        return ctx.sim.indices(Plan.load(variant.removeprefix("plan:")).recomputed)
    return None


def print_prices(bench_file: str, variants: list[str], ctx: PlanContext) -> None:
    """What the compiled planner prices each recompute set of ``variants`` at, calibrated on ``bench_file``'s rows
    as the bench calibrated that part's plan; and what each plan keeps back over torchtitan's set, by op."""
    from benchmarks.grid_replan import compiled_times_of

    times = compiled_times_of({r["config"]: r for r in BenchResults.load(bench_file).rows})
    timed = compiled_context(ctx, times)
    kernels, fused = timed.cache["replay_scales"]
    plain = times.compile_ms
    print(f"priced on {bench_file}: replayed library kernels at {kernels:.2f}x their eager time, fused ops at "
          f"{fused:.2f}x; measured over compile: compile+per-op {times.per_op_ms - plain:+.2f} ms, "
          f"compile+per-block {times.per_block_ms - plain:+.2f}", flush=True)
    titan = set(torchtitan_held(ctx))
    nodes, made, nbytes = ctx.profile.nodes, ctx.rg.created, ctx.rg.bytes
    for variant in variants:
        chosen = recompute_set(variant, ctx)
        if chosen is None:
            continue
        price = timed.plan_for_set("auto", 10**15, sorted(chosen), mode=TIMED_MODE).predicted_extra_ms
        kept = sorted(titan - set(chosen))
        by_op = Counter(op_name(nodes[made[k]].target) for k in kept)
        print(f"{variant:15s} priced {price:+.2f} ms over compile; keeps back over titan {len(kept)} activations "
              f"({int(nbytes[kept].sum()) / 2**20:.0f} MiB): {dict(by_op)}; recomputes beyond it "
              f"{len(set(chosen) - titan)}", flush=True)


def model_of(variant: str, workload, profile: Profile, ctx: PlanContext, backend) -> torch.nn.Module:
    """The workload's model under ``variant``'s checkpointing; ``backend`` compiles what runs as a region."""
    if variant == "peer":
        enable_per_block(workload, per_op_context)
        return workload.model
    if variant in ("peer-regions", *MASK_FORMS):  # the bench's compile+per-op+regions
        per_op_as_regions(workload, backend)
        if variant in MASK_FORMS:
            dtype = torch.bfloat16 if workload.spec.precision == "bf16" else torch.float32
            form = MASK_FORMS[variant](dtype)
            for block in find_blocks(workload):
                with_masks_as(block, form)
        return workload.model
    if variant.startswith("plan:"):  # a plan's recompute set compiled whole (its regions: the health probe)
        plan = dataclasses.replace(Plan.load(variant.removeprefix("plan:")), offloaded=[])
        return apply_plan(workload.model, (profile, plan))
    if variant.startswith("offload:"):  # the plan as the bench runs it: its regions compiled alone, with copies
        plan = Plan.load(variant.removeprefix("offload:"))
        return apply_plan(workload.model, (profile, plan), {"backend": backend})
    chosen = recompute_set(variant, ctx)
    if chosen is None:
        raise SystemExit(f"unknown variant {variant!r}: give titan, minus-dropouts, titan-keep:OP+OP, peer, "
                         f"peer-regions, {', '.join(MASK_FORMS)}, plan:PLAN.json or offload:PLAN.json")
    return apply_plan(workload.model, (profile, ctx.plan_for_set("auto", 10**15, chosen, "", mode=TIMED_MODE)))


def is_attention_mask(value) -> bool:
    """A batch x 1 x query x key tensor, as transformers hands each layer for SDPA."""
    return isinstance(value, torch.Tensor) and value.dim() == 4 and value.shape[1] == 1


def with_masks_as(block: torch.nn.Module, form) -> None:
    """Make ``block`` read every attention mask it is handed as ``form(mask)``."""
    forward = block.forward

    def formed(value):
        return form(value) if is_attention_mask(value) else value

    def forward_with_formed_mask(*args, **kwargs):
        return forward(*map(formed, args), **{k: formed(v) for k, v in kwargs.items()})

    block.forward = forward_with_formed_mask


def shared_mask(mask: torch.Tensor) -> torch.Tensor:
    """A square mask read as its first row broadcast over the batch: the same values where no sequence is padded."""
    return mask[:1].expand_as(mask) if mask.shape[-2] == mask.shape[-1] else mask


def float_masks(dtype: torch.dtype):
    """A boolean mask handed over as the additive bias SDPA makes of it (0 where True, -inf where False, in
    ``dtype``, the blocks' compute dtype), made once per mask and shared by every block: what SDPA computes, bit
    for bit."""
    last: list = [None, None]  # the last mask seen (one per forward: every block is handed the same) and its bias

    def bias(mask: torch.Tensor) -> torch.Tensor:
        if mask.dtype != torch.bool:
            return mask
        if last[0] is not mask:
            last[:] = mask, torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, -torch.inf)
        return last[1]

    return bias


MASK_FORMS = {"peer-regions-shared-mask": lambda dtype: shared_mask, "peer-regions-float-mask": float_masks}


def loss_of(model: torch.nn.Module, workload) -> torch.Tensor:
    """The workload's loss, its forward under the autocast the bench runs a bf16 workload in."""
    with autocast(workload.spec, next(model.parameters()).device):
        return workload.loss_fn(model, workload.batch)


def timed(model: torch.nn.Module, workload, steps: int) -> tuple[float, float, float, int]:
    """(median ms of a forward and backward, of the optimizer step after it, and of a whole step, the device peak
    over all), each from the third step on: the first two compile. The optimizer is the workload's, eager as the
    bench runs it. ``steps`` steps are synchronized between the backward and the update, so that each is timed
    alone; as many more are not, as the bench and users run them."""
    cuda = torch.cuda.is_available()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    optimizer = workload.make_optimizer(model)
    passes, updates, whole = [], [], []
    for i in range(2 * steps):
        optimizer.zero_grad(set_to_none=True)
        sync()
        start = time.perf_counter()
        loss_of(model, workload).backward()
        if i < steps:
            sync()
            passes.append((time.perf_counter() - start) * 1e3)
        middle = time.perf_counter()
        optimizer.step()
        sync()
        if i < steps:
            updates.append((time.perf_counter() - middle) * 1e3)
        else:
            whole.append((time.perf_counter() - start) * 1e3)
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    return float(np.median(passes[2:])), float(np.median(updates[2:])), float(np.median(whole[2:])), peak


def kernel_times(model: torch.nn.Module, workload, steps: int = 2) -> dict[str, float]:
    """Each kernel's (on a CPU, each op's) own time in a forward and backward, in ms, from torch.profiler over
    ``steps`` of them: where two forms of one model differ, by name."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            loss_of(model, workload).backward()
        if cuda:
            torch.cuda.synchronize()
    times: Counter = Counter()
    for event in prof.key_averages():
        times[event.key] += (event.self_device_time_total if cuda else event.self_cpu_time_total) / 1e3 / steps
    return {k: t for k, t in times.items() if t > 0}


def tiny_cpu_profile() -> Profile:
    """A 2-layer GPT-2 with dropout, profiled on the CPU with its dropouts run as ``native_dropout`` (and so run
    from then on in this process)."""

    def native_dropout(x, p=0.5, training=True, inplace=False):
        return torch.native_dropout(x, p, training)[0] if training and p > 0 else x

    torch.nn.functional.dropout = native_dropout
    config = (("n_layer", "2"), ("n_embd", "64"), ("n_head", "2"), ("vocab_size", "120"), ("n_positions", "64"),
              ("attn_pdrop", "0"))
    return profile_workload(WorkloadSpec("gpt2", batch_size=2, seq_len=64, optimizer="adam", config=config), "cpu")


def main(profile_path: str, variants: list[str]) -> int:
    t0 = time.time()
    # a graph served from Inductor's or AOTAutograd's cache is never handed to the counting compiler: compile all
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    profile = tiny_cpu_profile() if profile_path == "tiny-cpu" else Profile.load(profile_path)
    ctx = PlanContext(profile)
    if os.environ.get("PROBE_PRICE"):
        print_prices(os.environ["PROBE_PRICE"], variants, ctx)
    if STEPS == 0:
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    base = build_workload(WorkloadSpec.from_dict(profile.workload)).to(device)
    graphs: list[tuple[bool, Counter, int]] = []

    first_saves: dict[str, Counter] = {}  # per form, its first forward's values out by (op, dtype)
    kernels: dict[str, dict[str, float]] = {}  # per form, with PROBE_KERNELS: each kernel's ms per forward and backward

    def counting(gm, example_inputs, **kwargs):
        ops = Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        graphs.append((bool(kwargs.get("is_backward")), ops, len(outputs)))
        if not kwargs.get("is_backward") and variant not in first_saves:
            first_saves[variant] = Counter((str(getattr(o, "target", o)), str(getattr(o.meta.get("val"), "dtype", "")))
                                           for o in outputs if isinstance(o, torch.fx.Node))
        return compile_fx_inner(gm, example_inputs, **kwargs)

    for variant in variants:
        graphs.clear()
        torch._dynamo.reset()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        workload = dataclasses.replace(base, model=copy.deepcopy(base.model))
        backend = "inductor" if BACKEND == "inductor" else (
            lambda gm, inputs: compile_fx(gm, inputs, inner_compile=counting))
        model = torch.compile(model_of(variant, workload, profile, ctx, backend), backend=backend)
        ms, step_ms, whole_ms, peak = timed(model, workload, STEPS)
        print(f"{variant:15s} forward and backward {ms:.1f} ms, optimizer step {step_ms:.1f} ms, unsynchronized "
              f"step {whole_ms:.1f} ms (medians of {STEPS - 2}), peak {peak / 2**20:.0f} MiB", flush=True)
        for backward, ops, outputs in graphs:
            shown = {op: n for op, n in sorted(ops.items()) if any(s in op for s in SHOWN)}
            print(f"{variant:15s} {'bw' if backward else 'fw'} outputs {outputs:4d} ops {sum(ops.values()):5d} "
                  f"{shown}", flush=True)
        if KERNELS:
            kernels[variant] = kernel_times(model, workload)
        del model, workload  # freed once Dynamo's caches are reset, before the next form's peak
    first = variants[0]
    for variant in variants[1:] if KERNELS else ():
        ours, theirs = kernels[variant], kernels[first]
        diff = {k: ours.get(k, 0.0) - theirs.get(k, 0.0) for k in {*ours, *theirs}}
        top = sorted(diff, key=lambda k: -abs(diff[k]))[:KERNELS]
        print(f"{variant} against {first}, kernel time per forward and backward: {sum(ours.values()):.2f} / "
              f"{sum(theirs.values()):.2f} ms ({sum(diff.values()):+.2f}); most different:", flush=True)
        for k in top:
            print(f"  {diff[k]:+8.3f} ms  ({ours.get(k, 0.0):7.3f} / {theirs.get(k, 0.0):7.3f})  {k[:110]}", flush=True)
    for variant in variants[1:] if first in first_saves else ():
        print(f"{variant} saves, {first} does not: {dict(first_saves[variant] - first_saves[first])}; the reverse: "
              f"{dict(first_saves[first] - first_saves[variant])}", flush=True)
    print(f"total {time.time() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2].split(",")))
