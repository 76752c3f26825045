"""Planning for ``torch.compile``: the compiled step's peak, calibrated on one measured compiled step.

The eager profile does not predict a compiled peak: Inductor fuses, so the forward and backward keep fewer
temporaries, and AOTAutograd's partitioner picks what the ops outside the blocks (embeddings, loss head) save.
Inside the blocks a SAC plan leaves it no choice: every op is ``MUST_SAVE`` or ``MUST_RECOMPUTE``, so the compiled
step saves exactly the op outputs that eager SAC saves. What compile changes therefore does not depend on the
plan, and one offset, measured once, carries the SAC mode's eager prediction of any plan over to the compiled step:

    compiled peak(plan) = compiled-memory peak(plan) - offset,
    offset = compiled-memory peak(per-module) - measured compiled peak of per-block checkpointing.

The compiled memory is the SAC mode's less what only eager SAC's cache holds: a saved op's outputs that neither
backward nor the recomputation reads (a dropout saved for its mask, whose output only a kept residual add read),
which the partitioner does not save ("sac-compiled" mode). Per-module saves no op, so the calibration cannot see
them; priced as eager SAC holds them, a plan that saves such dropouts is predicted a hidden state per dropout too
high and leaves that much of its budget unused.

With compile+per-op's measured peak too (torchtitan's set, a second point), the offset is interpolated between
the two points by where the budget lies between their measured peaks (:func:`compiled_offset`): on BERT seq 2048
per-block's compiled peak holds 368 MiB more than its saved activations explain, which an offset taken from it
alone carried into every plan near compile+per-op's peak.

The compiled model under per-block checkpointing (``compile+per-block``: every block under a plain non-reentrant
checkpoint) saves what the per-module plan's SAC form saves (every repeated block recomputed, the modules around
them as in eager), the blocks' inputs. The model holds while the peak stays where the saved activations all live
(the end of forward, the loss head): the plans it compares keep the same temporaries there and differ by the
activations they save.

Time changes too. A recomputed matmul, convolution or attention runs a library kernel compiled as in eager, but
Inductor fuses the pointwise ops and reductions around it into kernels that run anyway, so replaying them costs
a fraction of their eager time; and the partitioner recomputes only what backward reads depends on (the
"sac-compiled" mode), where eager's replay reruns the block up to the last of it. Planned on eager times, a plan
keeps cheap-to-store pointwise outputs (a decoder's bf16 weight casts) and recomputes matmuls, the opposite of
what pays compiled. Given the measured step times of compile and compile+per-block (:class:`CompiledTimes`),
replays are priced as their library kernels, scaled by one factor calibrated the same way as the peak:

    compile+per-block - compile = kernels * the library-kernel eager time of per-module's replays,

so the calibration point is exact. With compile+per-op's time too, the fused ops get a factor of their own, from
the second point (torchtitan's set as it runs compiled, :func:`torchtitan_held`), which replays few matmuls and
many fused ops:

    compile+per-op - compile = kernels * its library-kernel time + fused * its other ops' time.

Measured on GPT-2 (seq 1024), the fused ops cost a quarter of their eager time (0.25, kernels 0.98): priced at
nothing, torchtitan's compiled replays were predicted at half their measured 9.8 ms, and a plan that replays a
few more of them than it at its own peak looked free (:func:`compiled_context`).

torchtitan's op-level policy, the compiled peer, is one of the plans compared, but not as the per-op set: the
policy saves every odd matmul, also one whose output backward never reads (a decoder's query projection, before
the rotary embedding). Compiled, that save is real (the partitioner saves it and recomputes the rotary ops from
it), while the profile has no activation there, so the per-op set frees the rotary query and replays the
projection. Its set as it runs compiled (:func:`torchtitan_held`) keeps the rotary query back instead: it holds
what torchtitan's step holds and replays what it replays. Given the same op decisions, the SAC form that
:func:`acstudio.apply_plan` builds partitions exactly as torchtitan's policy does.

A model compiled whole cannot offload: under torch.compile SAC's cache is a tracing artifact, so the saved-tensors
hooks through which :func:`acstudio.apply_plan` offloads in eager never run, and the partitioner treats
``CheckpointPolicy.MUST_CPU_OFFLOAD`` as an untagged op (its min-cut saved such linear outputs on a decoder, as
``MUST_SAVE`` would). Torch's own activation offloading for compiled graphs (``torch._functorch.config
.enable_activation_offloading``, marked for testing) offloads only nodes that a joint-graph pass
(``joint_custom_pass``) marks ``should_offload``, copying each after its last forward use. In torch 2.11 only its
synchronous form compiles (its separate-stream form fails in Inductor's fake-tensor pass), and there the compute
stream waits for every copy: measured on a decoder, it took the offloaded outputs off the peak but made the step
slower than recomputing them. Torch 2.14's separate-stream form either waits right after each copy or sinks the
waits to the end of the forward graph, which for a model compiled whole keeps the memory until the peak has passed.

What a block compiled on its own saves does pass through plain saved-tensors hooks, when that block's forward ends,
on torch 2.11 too. So a compiled plan may run its first K blocks so, with everything they save offloaded
(:func:`with_region_offload`; simulated by the "sac-compiled" mode's offload, run by ``apply_plan``'s
``RegionOffload``): its recompute set is searched until, with those saves off the device, its peak meets the
budget, and it is kept where it is faster than the plan without offload. Measured with the probe
``benchmarks/probes/compiled_offload_plan.py`` on GPT-2 (seq 512, H100), five blocks so ran 310.3 ms against
compile+per-op's 316.1, at a lower peak.

Running blocks so has a cost of its own: Dynamo cannot resume inside a loop, so the model's loop over its blocks
runs eager and every block compiles alone. The copies and their stalls are simulated; that form is not. The bench
measures it on torchtitan's policy (``compile+per-op+regions``, :class:`CompiledTimes`) and the planner adds what
it costs over compile+per-op to every offloading plan, which must then be predicted faster by
``PRICED_OFFLOAD_MARGIN`` of the step (the prediction's measured error); without that measurement, by
``OFFLOAD_MARGIN``. Most of that cost was SDPA's bias of the attention mask, which each block compiled alone made
again: the form now hands every block the bias made once, where the model takes it
(:func:`acstudio.export.apply.hand_blocks_mask_bias`), and a plan priced on a calibration that ran so
(:attr:`CompiledTimes.regions_bias`) is simulated in the "sac-compiled-bias" mode, which holds that one bias.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from acstudio.errors import ACStudioError
from acstudio.jobs import CancelToken, ProgressFn, check, report
from acstudio.plan.baselines import MATMULS, is_attention, node_blocks, per_module, per_op, torchtitan_saved
from acstudio.plan.model import Plan
from acstudio.plan.schedule import PlanContext
from acstudio.plan.solvers import DEFAULT_SOLVER, best_of, faster_at_lowest_peak, plan_for_mode, tighten_to_budget
from acstudio.simulate.modes import get_mode, simulate_plan
from acstudio.simulate.replay import ReplayGraph
from acstudio.simulate.sac import sac_blocks
from acstudio.simulate.simulator import Simulator
from acstudio.units import format_bytes

# A plan that offloads (more blocks) is taken only where it is predicted faster by this share of the step, unless
# the form it runs in was measured (CompiledTimes.regions_ms): its blocks compiled one by one, the model's loop over
# them eager, which the simulator does not see. On the H200 GPT-2's offloading plans (torchtitan's set with every
# dropout saved, the first 2 blocks offloaded) ran in that form 2.8 and 7.4 ms slower (0.9% and 1.7% of the step)
# at seq 512 and 2048 than their recompute set compiled whole, which ran 6.0-7.7 ms faster than compile+per-op, as
# predicted (results/probes/compiled_regions_cost_gpt2_h200.txt). With this margin GPT-2's grid plans ran 0.990,
# 0.997 and 1.003 of compile+per-op's step (results/probes/compiled_offload_margin_1pct_headroom_gpt2_h200.txt);
# at 2.2% the planner took torchtitan's set there, 1.001, 1.0009 and 1.002.
OFFLOAD_MARGIN = 0.01
# With the form measured and priced, an offloading plan must still be predicted faster by this share of the step:
# the compiled prediction's error. On the H200 GPT-2's priced offloading plans ran 0.3, 0.3 and 1.8 ms (0.1%, 0.1%
# and 0.4% of the step) over their predicted time at seq 512, 1024 and 2048; at seq 2048 the plan, 5 blocks
# offloaded and predicted 0.03 ms faster than torchtitan's set, ran 0.4% slower than compile+per-op
# (results/superseded/grid-gpt2-s2048.compiled-5-blocks-before-priced-margin.json). With this margin the planner
# keeps torchtitan's set there, which ran 1.002x (results/grid/gpt2-s2048.compiled.json), the peer's own policy.
PRICED_OFFLOAD_MARGIN = 0.004
# Between two offloading plans whose predicted times differ by less than this share of the step, the one moving
# fewer bytes: on the H200 the compiled offloading plans ran within 0.2-1.2% of the step of their predicted time,
# moving 3.9-5.6 GiB each way (BERT's grid shapes, 2026-11-28); no run has measured how the error grows past that.
OFFLOAD_TIE = 0.01
COMPILED_MODE = "sac"  # a compiled plan runs as torch's selective checkpointing (acstudio.apply_plan)
TIMED_MODE = "sac-compiled"  # the compiled memory, replays pruned as the partitioner prunes them
# an offloading plan whose blocks are handed the mask's bias (CompiledTimes.regions_bias)
BIAS_MODE = "sac-compiled-bias"


def compiled_offset(ctx: PlanContext, measured_per_block_peak: int, measured_per_op_peak: int | None = None,
                    budget: int | None = None) -> int:
    """Bytes the compiled step holds less than the compiled-memory mode predicts for the same plan (see the
    module).

    With compile+per-op's measured peak too (torchtitan's set as it runs compiled, :func:`torchtitan_held`), the
    offset for a plan whose compiled peak is ``budget`` is interpolated between the two points' offsets by where
    the budget lies between their measured peaks, and is the nearer point's outside them: both points are then
    predicted exactly, and a plan at compile+per-op's peak is calibrated on the set that holds what it holds.
    Measured on BERT seq 2048 (bs16), the two compiled peaks lie 368 MiB closer together than the activations
    Inductor saves for them, which the model predicts exactly (``benchmarks/probes/compiled_saved_bytes.py``):
    per-block's peak holds something more, which torchtitan's does not, so per-block's offset alone predicted
    every plan near compile+per-op's peak 1.6% high."""
    if measured_per_block_peak <= 0:
        raise ACStudioError(f"the compiled per-block peak is {measured_per_block_peak} bytes — give the peak "
                            "measured for compile+per-block (e.g. 3870MiB)")
    mode = get_mode(TIMED_MODE)
    offset = mode.peak(ctx.sim, per_module(ctx))[0] - measured_per_block_peak
    if measured_per_op_peak is None or budget is None or measured_per_op_peak <= measured_per_block_peak:
        return offset
    titan = mode.peak(ctx.sim, torchtitan_held(ctx))[0]
    share = min(max((budget - measured_per_block_peak) / (measured_per_op_peak - measured_per_block_peak), 0.0), 1.0)
    return round(offset + share * (titan - measured_per_op_peak - offset))


@dataclass(frozen=True)
class CompiledTimes:
    """Measured median step times of the compiled model without checkpointing and under per-block checkpointing,
    and, where measured, under torchtitan's op-level policy (compile+per-op) and under that policy in the form a
    plan that offloads runs (``regions_ms``: compile+per-op+regions, its first block compiled on its own inside
    the offload hooks, so that the model's loop over its blocks runs eager and each block compiles alone).
    ``regions_bias``: that form was measured with the blocks handed SDPA's bias of their attention mask
    (:func:`acstudio.export.apply.hand_blocks_mask_bias`), as the plans it prices then run; the runs before it
    (before 2026-11-29's eighteenth session) measured every block making its own.

    ``compile_host_ms``: the host's time to issue compile's step (until the step returns, before the device is
    done), where the bench measured it (since 2026-11-29's twentieth session). An offloading plan's copies take
    host calls (:mod:`acstudio.simulate.offload`), which cost the step only where the host has no lead over the
    device. The profile measures that lead for the eager step; compiled, the host launches a few fused kernels
    where eager issued each node, so the calls are priced against the compiled step's host time instead, spread
    over the nodes (:func:`compiled_context`). On the 953M decoder the eager host issues 108 of a 160 ms step,
    and the copies of an offloading plan's first 4 blocks were priced 2.1 ms of host time on it, more than the
    replays they saved."""

    compile_ms: float
    per_block_ms: float
    per_op_ms: float | None = None
    regions_ms: float | None = None
    regions_bias: bool = False
    compile_host_ms: float | None = None

    def __post_init__(self) -> None:
        if self.compile_host_ms is not None and not self.compile_host_ms > 0:
            raise ACStudioError(f"the host's time to issue compile's step must be positive milliseconds, not "
                                f"{self.compile_host_ms:g}")
        if not all(t > 0 for t in self.given):
            raise ACStudioError(f"compiled step times must be positive milliseconds, not "
                                f"{', '.join(f'{t:g}' for t in self.given)} — give compile's and compile+per-block's "
                                "(and compile+per-op's, and compile+per-op+regions'), e.g. 23.0,27.2")
        if self.regions_ms is not None and self.per_op_ms is None:
            raise ACStudioError("compile+per-op+regions' step time is priced against compile+per-op's — give "
                                "compile's, compile+per-block's, compile+per-op's and compile+per-op+regions'")

    @property
    def given(self) -> list[float]:
        """The times measured, in the order they are written."""
        return [t for t in (self.compile_ms, self.per_block_ms, self.per_op_ms, self.regions_ms) if t is not None]

    @property
    def regions_cost_ms(self) -> float | None:
        """What running a plan's blocks in the offload form costs over compiling the model whole, measured on
        torchtitan's policy (nothing where that form ran faster); None where it was not measured."""
        return None if self.regions_ms is None else max(self.regions_ms - self.per_op_ms, 0.0)

    @property
    def regions_mode(self) -> str:
        """The replay mode of the offloading plans these times price: the form the regions were measured in."""
        return BIAS_MODE if self.regions_bias else TIMED_MODE

    @classmethod
    def parse(cls, text: str) -> CompiledTimes:
        """``"23.0,27.2"``, ``"23.0,27.2,24.1"`` or ``"23.0,27.2,24.1,24.6"``: compile's, compile+per-block's (and
        compile+per-op's, and compile+per-op+regions') step times in ms."""
        parts = text.split(",")
        try:
            values = [float(v) for v in parts]
        except ValueError:
            values = []
        if len(values) not in (2, 3, 4) or not all(np.isfinite(values)):
            raise ACStudioError(f"compiled step times {text!r} are not two to four numbers — give compile's and "
                                "compile+per-block's (and compile+per-op's, and compile+per-op+regions') median step "
                                "times in ms, e.g. 23.0,27.2")
        return cls(*values)

    def __str__(self) -> str:
        return ",".join(repr(t) for t in self.given)


def is_library_kernel(target: str) -> bool:
    """An op that runs the same library kernel compiled as in eager: matmul, convolution, attention."""
    return target in MATMULS or is_attention(target) or target.startswith("aten.convolution")


def replay_scales(ctx: PlanContext, times: CompiledTimes, kernel: np.ndarray) -> tuple[float, float]:
    """What a replayed library kernel (``kernel``: per node) and a replayed fused op cost compiled per ms of their
    eager time, calibrated on per-module and, with compile+per-op's time, on torchtitan's set (see the module).

    Library kernels: 1 where per-module replays none or compile+per-block measured no slower. Fused ops: 0 without
    compile+per-op's time, or where the two points do not give both factors positive (then the kernels' factor is
    per-module's alone)."""
    mode = get_mode(TIMED_MODE)

    def eager_ms(recomputed: list[int]) -> tuple[float, float]:
        replayed = [i for r in mode.schedule(ctx.sim, recomputed).replays for i in mode.needed(ctx.sim, r)]
        ms, is_kernel = ctx.rg.run_ms[replayed], kernel[replayed]
        return float(ms[is_kernel].sum()), float(ms[~is_kernel].sum())

    kernels, fused = eager_ms(per_module(ctx))
    measured = times.per_block_ms - times.compile_ms
    alone = (measured / kernels if kernels > 0 and measured > 0 else 1.0), 0.0
    if times.per_op_ms is None:
        return alone
    system = np.array([[kernels, fused], eager_ms(torchtitan_held(ctx))])
    if abs(np.linalg.det(system)) < 1e-9:
        return alone
    both = np.linalg.solve(system, [measured, times.per_op_ms - times.compile_ms])
    return (float(both[0]), float(both[1])) if both[0] > 0 and both[1] >= 0 else alone


def compiled_context(ctx: PlanContext, times: CompiledTimes) -> PlanContext:
    """A plan context of the same profile whose replays cost what they cost compiled: library kernels and fused
    ops their :func:`replay_scales` times their eager time (built once per ``times``, cached on ``ctx``). Where
    compile's host time was measured (:attr:`CompiledTimes.compile_host_ms`), the profile's host time to issue the
    step is that one, against which offload's host calls are priced."""
    key = ("compiled", times, ctx.rg.keep_random)
    if key not in ctx.cache:
        kernel = np.array([is_library_kernel(nd.target) for nd in ctx.profile.nodes], dtype=bool)
        scales = replay_scales(ctx, times, kernel)
        profile = ctx.profile
        if times.compile_host_ms is not None:
            profile = dataclasses.replace(profile, host_issue_ms=times.compile_host_ms)
        replay = ReplayGraph(profile, ctx.rg.keep_random, node_ms=ctx.rg.run_ms * np.where(kernel, *scales))
        compiled = PlanContext(profile, Simulator(profile, replay))
        compiled.cache["replay_scales"] = scales
        ctx.cache[key] = compiled
    return ctx.cache[key]


def torchtitan_held(ctx: PlanContext) -> list[int]:
    """torchtitan's set (:func:`~acstudio.plan.baselines.per_op`) as its policy runs compiled, with the activations
    kept back that stand in for the saved matmul outputs that backward never reads.

    The policy saves every odd matmul, also one whose output no backward node reads: a decoder's query projection,
    which the rotary embedding after it only multiplies by constants. Banned from recomputing that output, the
    partitioner saves it and recomputes the fused rotary ops from it for attention's backward. It is no activation
    of the profile, so the per-op set frees the rotary query, whose replay reruns the projection: a matmul
    torchtitan's compiled step does not run. Kept back in its place, the activations made from that output by ops
    that are no library kernel replay nothing and hold no more than it (they are kept back only where their bytes
    are at most its own). Found once per context (cached on ``ctx``): a compiled plan asks for it at each target."""
    if "torchtitan_held" not in ctx.cache:
        ctx.cache["torchtitan_held"] = _torchtitan_held(ctx)
    return ctx.cache["torchtitan_held"]


def _torchtitan_held(ctx: PlanContext) -> list[int]:
    rg, profile = ctx.rg, ctx.profile
    nodes, index = profile.nodes, profile.node_index
    nbytes = profile.tensor_bytes
    block = node_blocks(ctx)
    freed = per_op(ctx)
    users: dict[int, list[int]] = {}
    for j, nd in enumerate(nodes):
        if block[j]:
            for u in nd.inputs:
                users.setdefault(index[u], []).append(j)
    kept: set[int] = set()
    for i in sorted(torchtitan_saved(ctx)):
        if nodes[i].storage in rg.act_index:
            continue  # backward reads it: the per-op set keeps it already
        made, todo, seen = set(), [i], {i}
        while todo:
            for j in users.get(todo.pop(), ()):
                if j in seen or block[j] != block[i] or is_library_kernel(nodes[j].target):
                    continue
                seen.add(j)
                todo.append(j)
                k = rg.act_index.get(nodes[j].storage)
                if k is not None and rg.is_candidate[k]:
                    made.add(k)
        if sum(int(rg.bytes[k]) for k in made) <= nbytes.get(nodes[i].storage, 0):
            kept |= made
    return [k for k in freed if k not in kept]


def with_torchtitan_held(ctx: PlanContext, found: Plan, solver: str, cancel: CancelToken | None = None) -> Plan:
    """``found`` or, where it is faster in the compiled memory (or, neither fitting, lower or as low and faster),
    torchtitan's set as its policy runs compiled (:func:`torchtitan_held`), tightened to the budget where it is
    over (:func:`~acstudio.plan.solvers.tighten_to_budget`: at compile+per-op's own measured peak, less the
    planning headroom, its prediction is a few MiB over); a plan asked of one solver stays that solver's."""
    if solver != DEFAULT_SOLVER:
        return found
    held = ctx.plan_for_set(found.solver, found.budget_bytes, torchtitan_held(ctx), mode=TIMED_MODE)
    freed = 0
    if not held.feasible:
        held, freed = tighten_to_budget(ctx, held, found.budget_bytes, TIMED_MODE, cancel)
    best = best_of([found, held])
    if best is found:
        return found
    fits = "met" if held.feasible else "not met"
    more = f", then {freed} more activations recomputed to fit" if freed else ""
    return dataclasses.replace(held, stop_reason=f"budget {fits} in {TIMED_MODE} mode (torchtitan's policy as it "
                               f"runs compiled{more})")


def fastest_in_compiled_memory(ctx: PlanContext, budget: int, solver: str, cancel: CancelToken | None) -> Plan:
    """The fastest plan whose compiled memory fits ``budget``, torchtitan's set as it runs compiled among those
    compared; where none fits, the fastest at the lowest peak that any reaches, marked infeasible.

    Plans that free enough all peak at a node where what they free is not live (a decoder's optimizer step), and
    the budget of a peer measured there, less the planning headroom, sits just below that peak. Of the plans at
    it, the lowest-peak one found first is usually not the fastest; planned at that peak, the solvers and the
    filling use the memory beneath it."""
    found = with_torchtitan_held(ctx, plan_for_mode(ctx, budget, TIMED_MODE, solver, cancel), solver, cancel)
    if found.feasible:
        return found
    lowest = with_torchtitan_held(ctx, plan_for_mode(ctx, found.predicted_peak_bytes, TIMED_MODE, solver, cancel),
                                  solver, cancel)
    return faster_at_lowest_peak(found, lowest, budget)


def with_compiled_frees(ctx: PlanContext, chosen: Plan, recomputed: list[str]) -> Plan:
    """``chosen`` (the set as eager SAC runs it, which frees only what it frees) with the activations of
    ``recomputed`` that only the compiled step frees added, and their replays as the compiled step runs them: the
    outputs of random ops that eager SAC saves beside another saved random op of their block
    (:mod:`acstudio.simulate.sac`). The exported policy marks those ops ``save-eager`` and torch.compile
    recomputes them, as the compiled plan priced them; dropped from the plan, they would be saved compiled too (a
    GPT-2 layer's two dropout masks). Loading a compiled plan derives the same from its profile
    (:func:`acstudio.plan.loading.check_plan_derivation`)."""
    have = set(chosen.recomputed)
    extra = [a for a in recomputed if a not in have]
    if not extra:
        return chosen
    compiled = ctx.plan_for_set(chosen.solver, chosen.budget_bytes, ctx.sim.indices([*chosen.recomputed, *extra]),
                                mode=TIMED_MODE)
    freed = {e.activation for e in compiled.schedule} - have
    return dataclasses.replace(chosen, recomputed=[*chosen.recomputed, *[a for a in extra if a in freed]],
                               schedule=[*chosen.schedule, *[e for e in compiled.schedule if e.activation in freed]])


def plan_compiled(ctx: PlanContext, budget: int, measured_per_block_peak: int, solver: str = DEFAULT_SOLVER,
                  cancel: CancelToken | None = None, times: CompiledTimes | None = None,
                  measured_per_op_peak: int | None = None, measured_budget: int | None = None,
                  progress: ProgressFn | None = None) -> Plan:
    """The fastest plan whose compiled peak fits ``budget``: planned in the compiled memory at ``budget`` plus
    the offset. Its ``predicted_peak_bytes`` stays the SAC mode's eager prediction, and ``compiled_offset_bytes``
    what the compiled step holds less than that (the calibrated offset plus what only eager SAC's cache holds at
    the plan's peak), so that ``compiled_peak_bytes`` is the compiled one.

    With ``times`` the plans are priced at compiled replay times (:func:`compiled_context`) and the plan records
    its compiled overhead (``compiled_extra_ms``); ``predicted_extra_ms`` stays the eager SAC prediction, which
    the profile alone re-derives. ``measured_per_op_peak`` (compile+per-op's) calibrates the peak at a second
    point (:func:`compiled_offset`).

    ``measured_budget`` is the budget the step must fit where ``budget`` lies a planning headroom below it (the
    bench's, for what a prediction cannot see). torchtitan's set as it runs compiled (:func:`torchtitan_held`) was
    measured at compile+per-op's peak, so where that peak is within ``measured_budget`` the set fits by
    measurement and is planned at ``measured_budget`` itself, where the calibration predicts it at exactly that
    peak; it is returned where it is predicted faster than the plan found under ``budget``. Without this, at
    compile+per-op's own peak the headroom ruled out the peer's own set, and the plans that fit beneath it replayed
    a little more (GPT-2: 1.005 of compile+per-op's step, 1.7 ms beyond the IQRs).

    ``progress`` hears of the recompute-only search, then of each K the offload search tries (on BERT-base, a
    minute or more on a CPU)."""
    report(progress, 0, 1, "planning for torch.compile: recompute only")
    offset = compiled_offset(ctx, measured_per_block_peak, measured_per_op_peak, budget)
    why = f"calibrated on compile+per-block's measured {format_bytes(measured_per_block_peak)}"
    if measured_per_op_peak is not None:
        why += f" and compile+per-op's {format_bytes(measured_per_op_peak)}"
    timed = compiled_context(ctx, times) if times is not None else ctx
    # without compiled times, at eager op times, but never with eager SAC's dispatch cost: compiled, it is not paid
    found = fastest_in_compiled_memory(ctx, budget + offset, solver, cancel)
    if times is not None:
        # the plans found at eager times and at library-kernel times only (fused ops free: the search walks
        # another way to other plans) are known too: priced at the calibrated times, the fastest of them
        known = [ctx.plan_for_set(found.solver, budget + offset, ctx.sim.indices(found.recomputed), found.stop_reason,
                                  mode=COMPILED_MODE)]
        if times.per_op_ms is not None:
            kernels_only = compiled_context(ctx, dataclasses.replace(times, per_op_ms=None, regions_ms=None))
            known.append(fastest_in_compiled_memory(kernels_only, budget + offset, solver, cancel))
        repriced = [timed.plan_for_set(p.solver, budget + offset, timed.sim.indices(p.recomputed), p.stop_reason,
                                       mode=TIMED_MODE) for p in known]
        found = best_of([fastest_in_compiled_memory(timed, budget + offset, solver, cancel), *repriced])
        kernels, fused = timed.cache["replay_scales"]
        per_op = f" and compile+per-op's {times.per_op_ms:g}" if times.per_op_ms is not None else ""
        why += (f" and its step time ({times.per_block_ms:g} ms against compile's {times.compile_ms:g}{per_op}: "
                f"replayed matmuls, convolutions and attention at {kernels:.2f}x their eager time, fused ops at "
                f"{fused:.2f}x)")
    fits_measured = None  # a plan that fits by measurement, and the budget and offset it was planned at
    if measured_budget is not None and solver == DEFAULT_SOLVER:
        if measured_per_op_peak is not None and budget < measured_per_op_peak <= measured_budget:
            at_measured = compiled_offset(ctx, measured_per_block_peak, measured_per_op_peak, measured_budget)
            held = timed.plan_for_set(found.solver, measured_budget + at_measured, torchtitan_held(ctx),
                                      mode=TIMED_MODE)
            if held.feasible and (not found.feasible or held.predicted_extra_ms < found.predicted_extra_ms):
                reason = (f"budget met by measurement: torchtitan's policy as it runs compiled, measured at "
                          f"compile+per-op's {format_bytes(measured_per_op_peak)}, within the budget without its "
                          "planning headroom")
                found = dataclasses.replace(held, stop_reason=reason)
                fits_measured = (found, at_measured)
        elif budget < measured_per_block_peak <= measured_budget:  # a decoder: both peers peak in the AdamW step
            at_measured = compiled_offset(ctx, measured_per_block_peak, measured_per_op_peak, measured_budget)
            per_block = timed.plan_for_set(found.solver, measured_budget + at_measured, per_module(ctx),
                                           mode=TIMED_MODE)
            if per_block.feasible:
                fits_measured = (per_block, at_measured)
    regions_cost = times.regions_cost_ms if times is not None else None
    offloads = with_region_offload(ctx, timed, found, budget + offset, solver, cancel,
                                   measured=fits_measured[0] if fits_measured else None, progress=progress,
                                   regions_cost_ms=regions_cost,
                                   mode=times.regions_mode if times is not None else TIMED_MODE)
    report(progress, 1, 1, "planned for torch.compile")
    if fits_measured is not None and (offloads is fits_measured[0] or not offloads.feasible):
        # it fits by measurement: planned at the budget without headroom, as the measured plan was
        at_measured = fits_measured[1]
        if offloads is not fits_measured[0]:
            offloads = in_regions(timed.plan_for_set(offloads.solver, measured_budget + at_measured,
                                                     timed.sim.indices(offloads.recomputed), offloads.stop_reason,
                                                     mode=offloads.replay_mode,
                                                     offloaded=[timed.rg.act_index[a] for a in offloads.offloaded]),
                                  regions_cost)
        return as_compiled(ctx, timed, offloads, measured_budget, at_measured, why)
    return as_compiled(ctx, timed, offloads, budget, offset, why)


def with_region_offload(ctx: PlanContext, timed: PlanContext, found: Plan, budget: int, solver: str,
                        cancel: CancelToken | None, measured: Plan | None = None,
                        progress: ProgressFn | None = None, regions_cost_ms: float | None = None,
                        mode: str = TIMED_MODE) -> Plan:
    """``found`` or, where one is faster within ``budget`` (compiled memory), a plan that runs the first K blocks
    compiled one by one with what they save offloaded (the sac-compiled mode's offload), over K = 1, 2, ...

    ``regions_cost_ms`` is what that form costs over the model compiled whole, measured on torchtitan's policy
    (:attr:`CompiledTimes.regions_cost_ms`); each offloading plan is priced with it (:func:`in_regions`) and taken
    where it is predicted faster by ``PRICED_OFFLOAD_MARGIN`` of the step, the prediction's error. Where it was not
    measured, an offloading plan is taken only where it is predicted faster by ``OFFLOAD_MARGIN``, which covers it.
    ``mode`` is the replay mode the offloading plans are simulated in: the form the regions run in
    (:attr:`CompiledTimes.regions_mode`).

    The margin weighs offloading against recomputing only, the choice whose error it covers. Of the offloading
    plans past it, the one that moves the fewest bytes of those within ``OFFLOAD_TIE`` of the step of the fastest
    (with the margin between them too, the search stopped at the first K past it: BERT seq 512 ran 5 blocks where
    6 were predicted 11 ms faster). Each K's plan is searched to fill the budget (:func:`filled_with_regions`). The
    search stops at the first K whose copies stall: the copies out run one after another, so more blocks only queue
    more of them.

    Only on one device: under FSDP2/DDP (a profile per rank) the blocks are compiled one by one already, inside
    the parallel wrapper's own hooks, and no run has tried offloading there.

    ``measured``: a plan that fits by measurement (torchtitan's set at compile+per-op's measured peak, or
    compile+per-block's set at its own). Where it peaks in the optimizer step, a plan that peaks at the same node
    with no more bytes fits too, though over ``budget`` (marked infeasible here): on a decoder every plan peaks in
    the AdamW step, which no activation decision moves, a planning headroom above the budget. Not where the peak
    holds activations: there the regions hold bytes the measurement never saw, which the headroom is for (GPT-2's
    offloading plans at compile+per-op's peak, its logits' gradient, fitted so ran 55-60 MiB over the prediction
    and over their budget; results/probes/compiled_offload_margin_1pct_gpt2_h200.txt)."""
    blocks = sac_blocks(ctx.sim)
    if not ctx.may_offload or solver != DEFAULT_SOLVER or blocks.regional:  # one rank of FSDP2/DDP: not tried yet
        return found
    peak_in_update = (measured is not None
                      and ctx.profile.node_by_id[measured.predicted_peak_node].region == "optimizer")

    def fits(plan: Plan) -> bool:
        return plan.feasible or (peak_in_update and plan.predicted_peak_node == measured.predicted_peak_node
                                 and plan.predicted_peak_bytes <= measured.predicted_peak_bytes)

    form = "" if regions_cost_ms is None else f" (+{regions_cost_ms:.2f} ms, the form's measured cost)"
    candidates = []
    for k in range(1, len(blocks.blocks)):
        check(cancel)
        report(progress, k - 1, len(blocks.blocks) - 1, f"planning for torch.compile: the first {k} blocks offloaded")
        offloaded = filled_with_regions(ctx, timed, found, blocks.blocks[:k], budget, solver, cancel, fits, mode)
        if offloaded is None:
            continue
        if fits(offloaded):
            candidates.append(in_regions(dataclasses.replace(
                offloaded, stop_reason=f"{offloaded.stop_reason}; the first {k} blocks compiled one by one, what "
                f"they save offloaded{form}"), regions_cost_ms))
        if offloaded.offload_stall_ms > 0:
            break
    if not candidates:
        return found
    fastest = min(p.predicted_extra_ms for p in candidates)
    tie_ms = OFFLOAD_TIE * ctx.profile.iteration_ms
    margin_ms = (OFFLOAD_MARGIN if regions_cost_ms is None else PRICED_OFFLOAD_MARGIN) * ctx.profile.iteration_ms
    taken = [p for p in candidates if p.predicted_extra_ms <= fastest + tie_ms
             and p.predicted_extra_ms < found.predicted_extra_ms - margin_ms]
    return min(taken, key=lambda p: p.offload_bytes) if taken else found


def in_regions(plan: Plan, cost_ms: float | None) -> Plan:
    """``plan`` priced, where it offloads, with what running its blocks in the offload form costs (``cost_ms``,
    measured; unpriced where None): the simulator sees the copies and their stalls, not the graph breaks."""
    if cost_ms is None or not plan.offloaded:
        return plan
    return dataclasses.replace(plan, predicted_extra_ms=plan.predicted_extra_ms + cost_ms)


FILL_ROUNDS = 8  # searches per K: with 4, BERT seq 1024's chosen K stopped 2.2% under the budget (97.5% measured)


def filled_with_regions(ctx: PlanContext, timed: PlanContext, found: Plan, regions: list[str], budget: int,
                        solver: str, cancel: CancelToken | None, fits: Callable[[Plan], bool],
                        mode: str = TIMED_MODE) -> Plan | None:
    """The fastest plan found that offloads what ``regions`` save and fits ``budget`` (compiled memory) by ``fits``,
    priced with its copies: the peak with each activation off the device from its copy's end to its copy back, the
    stalls where a copy back lands late. None where the regions save nothing or more than the host holds.

    The recompute set is searched at the budget plus a shift, the memory the offload takes off the peak. The first
    shift is what the regions hold under ``found``, the plan without offload; then the shift is solved for the
    priced plan to leave less than 1% of the budget unused, by secant steps (what comes off the peak is not what the
    regions hold: their saves change with the set, and some leave the device before the peak, some after; on BERT
    each plain move by the unused bytes covered about half of what was left). Once one shift has fitted and another
    overshot, the search bisects the bracket between them: the priced peak is a step function of the shift, flat
    over stretches where secant steps crawl. A plan over the budget that fits by measurement (``fits``) peaks where
    no activation decision reaches (a decoder's AdamW step) and ends the search. With the held bytes alone, BERT's
    compiled grid plans measured 92.6-95.4% of their budgets; issue 27 asks for 98%.

    In a mode that hands the blocks the mask's bias, each trial keeps every block's own bias: no block makes one,
    so recomputing it would price a replay the step never runs (GPT-2's plans recomputed all 12, 0.8 ms of seq
    2048's price)."""
    blocks = sac_blocks(ctx.sim)
    bias = get_mode(mode).hands_mask_bias
    biases = {k for ks in blocks.mask_biases.values() for k in ks} if bias else set()  # each block's own (docstring)

    def without_biases(plan: Plan) -> list[int]:
        return [k for k in timed.sim.indices(plan.recomputed) if k not in biases]

    shift = int(ctx.rg.bytes[blocks.region_held(without_biases(found), regions, bias)].sum())
    fitted, overshot = None, None  # the largest shift whose priced plan fitted, the smallest that overshot
    previous: tuple[int, int] | None = None  # the round before's shift and unused bytes
    best: Plan | None = None
    for _ in range(FILL_ROUNDS):
        trial = fastest_in_compiled_memory(timed, budget + shift, solver, cancel)
        recomputed = without_biases(trial)
        held = blocks.region_held(recomputed, regions, bias)
        if not held or int(ctx.rg.bytes[held].sum()) > ctx.host_memory:
            return best
        priced = timed.plan_for_set(trial.solver, budget, recomputed, trial.stop_reason, mode=mode, offloaded=held)
        if best is None or (fits(priced), -priced.predicted_extra_ms) > (fits(best), -best.predicted_extra_ms):
            best = priced
        unused = budget - priced.predicted_peak_bytes
        if 0 <= unused < 0.01 * budget:
            break
        if unused >= 0:
            fitted = shift if fitted is None else max(fitted, shift)
        else:
            overshot = shift if overshot is None else min(overshot, shift)
        if unused < 0 and fits(priced):  # over the budget by measurement's leave: no smaller shift lowers that peak
            break
        if fitted is not None and overshot is not None:
            if overshot - fitted < 0.001 * budget:
                break
            shift = (fitted + overshot) // 2
            continue
        moved = previous is not None and previous[1] != unused
        step = unused * (shift - previous[0]) / (previous[1] - unused) if moved else unused
        previous = (shift, unused)
        shift += int(step)
    return best


def as_compiled(ctx: PlanContext, timed: PlanContext, compiled_memory: Plan, budget: int, offset: int,
                why: str) -> Plan:
    """``compiled_memory`` (a plan in the compiled memory, at ``budget`` plus ``offset``, priced in ``timed``: the
    compiled times' context, or ``ctx`` itself without them) as the plan the SAC form runs: its set in the SAC mode
    with what only the compiled step frees added, the compiled peak and, where timed, the compiled overhead
    recorded.

    Where it offloads by region, the fetches are placed as ``timed`` priced them (``Plan.region_fetches``): the
    compiled backward runs in about half the eager one's time, so on the profile's times the export had placed
    each block's copies back one block ahead, where the price had them two to four ahead. On the 953M decoder
    (H200, seq 512, 3 blocks) each of the 3 blocks' backwards then waited 1.35 ms for its copies, and the plan
    ran 4-10 ms over its price (results/probes/compiled_offload_fetches_decoder1b-s512_h200.txt)."""
    offloaded = [ctx.rg.act_index[a] for a in compiled_memory.offloaded]
    # a plan that offloads runs its blocks compiled one by one: the compiled memory's mode is the one it runs in
    mode = compiled_memory.replay_mode if offloaded else COMPILED_MODE
    chosen = ctx.plan_for_set(compiled_memory.solver, budget + offset, ctx.sim.indices(compiled_memory.recomputed),
                              compiled_memory.stop_reason, mode=mode, offloaded=offloaded)
    extra = {"compiled_extra_ms": compiled_memory.predicted_extra_ms} if timed is not ctx else {}
    if timed is not ctx:
        why += f"; compiled +{compiled_memory.predicted_extra_ms:.2f} ms"
    if offloaded:
        why += (f", {format_bytes(compiled_memory.offload_bytes)} offloaded each way"
                f"{' (hidden)' if compiled_memory.offload_stall_ms <= 0 else ''}")
        # simulated here, not read from a simulation kept on the plan, which another context may have made
        copies = simulate_plan(timed.sim, compiled_memory.recomputed, mode, compiled_memory.offloaded).offload
        if copies is not None and get_mode(mode).offloads_by_region:
            extra["region_fetches"] = sac_blocks(timed.sim).fetched_by(copies)
    cache_only = chosen.predicted_peak_bytes - compiled_memory.predicted_peak_bytes  # eager SAC's cache, at peak
    chosen = dataclasses.replace(with_compiled_frees(ctx, chosen, compiled_memory.recomputed), budget_bytes=budget,
                                 compiled_offset_bytes=offset + cache_only, feasible=compiled_memory.feasible, **extra)
    why = f"{chosen.stop_reason}; compiled peak {format_bytes(chosen.compiled_peak_bytes)}, {why}"
    return dataclasses.replace(chosen, stop_reason=why)
