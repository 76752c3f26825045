"""Would a planned compiled offload beat ``compile+per-op`` at its own measured peak, as issue 26 asks? The step
of ``compiled_block_offload.py`` (every block compiled alone, its saved tensors through saved-tensors hooks, the
first K blocks' copied to the host), but with the plan made by AC Studio's compiled planner instead of by hand.

For each K, the planner (:func:`acstudio.plan.compiled.plan_compiled`, calibrated on this run's compile,
compile+per-block and compile+per-op rows, as ``acstudio bench`` does) plans at the budget plus what the first K
blocks' regions hold off the device at the peak: the activations their compiled form keeps and that backward reads,
1 MiB or more (the hooks' threshold). A plan is a candidate where its compiled peak less those bytes is within the
budget (on the decoders the peak is the AdamW step's, the budget itself, which no activation decision moves) and
its copies can cross the link in 3/4 of the forward (the share of the copy window that hid in the first
integration; the forward's time is compile's step times the forward's share of the profile's node times); its
predicted time is compile's plus the plan's compiled extra time plus what the blocks cost compiled one by one
(torchtitan's policy as regions against it whole, measured in this run). The two fastest candidates then run:
blocks wrapped by ``acstudio.apply_plan``, each compiled alone inside the hooks, the model compiled around them; the
hooks keep on the device the parameters (saved views of them included) and every block argument but the hidden
state (a mask, rotary tables), which the other blocks read too.

The peak model assumes the step's peak comes after every offloaded copy has landed and before any comes back (the
loss head; on the decoders the AdamW step, which no activation decision moves): it says nothing of stalls, which the
measured step shows.

Usage: PYTHONPATH=. python3 benchmarks/probes/compiled_offload_plan.py OUT_DIR [gpt2|decoder512|decoder1024]
Output: OUT_DIR/compiled_offload_plan.txt, one line per measured configuration and one per K planned.
On a CPU, the planning alone for committed grid shapes (their compiled parts' calibration rows and profiles):
PYTHONPATH=. python3 benchmarks/probes/compiled_offload_plan.py OUT_DIR --from-grid SHAPE...
(results/probes/compiled_offload_plan_cpu.txt: the GPT-2 and decoder shapes, 2026-11-27).
"""

import dataclasses
import functools
import sys
from pathlib import Path

import torch
from compiled_block_offload import SPECS as BLOCK_SPECS
from compiled_block_offload import BlockOffload, Offloaded, allow_a_graph_per_block, build, dev, measure
from compiled_block_offload import training_step as make_training_step

import acstudio
from acstudio.bench.steps import COMPILED_HEADROOM, cached_profile, find_blocks, load, per_op_context, with_headroom
from acstudio.plan.compiled import CompiledTimes, plan_compiled
from acstudio.plan.schedule import PlanContext
from acstudio.simulate.replay import FORWARD_REGIONS
from acstudio.simulate.sac import sac_blocks
from acstudio.workload import WorkloadSpec

MiB = 2**20
# the shapes of compiled_block_offload.py (GPT-2 seq 512 bs32, the decoder at seq 1024 bs8) and the decoder at the
# grid's seq 512 bs16
SPECS = {"gpt2": BLOCK_SPECS["gpt2"], "decoder1024": BLOCK_SPECS["decoder"],
         "decoder512": dataclasses.replace(BLOCK_SPECS["decoder"], batch_size=16, seq_len=512)}


def held_by_regions(ctx: PlanContext, recomputed: list[str], k: int) -> int:
    """Bytes the first ``k`` blocks' compiled regions save and the hooks copy to the host: activations those blocks
    create that the compiled form of ``recomputed`` keeps, that backward reads, of 1 MiB or more. (A block's input
    is the block before's output, counted there; the last offloaded block's output goes with the next block, not
    offloaded, and the first's input, the embeddings' output, with the first: one hidden state each way.)"""
    blocks = sac_blocks(ctx.sim)
    _, freed = blocks.decide(ctx.sim.indices(recomputed), compiled=True)
    offloaded = set(blocks.blocks[:k])
    rg = ctx.rg
    return int(sum(int(rg.bytes[a]) for a in range(len(rg.bytes))
                   if blocks.act_block[a] in offloaded and not freed[a] and rg.bytes[a] >= MiB
                   and rg.first_bw[a] < ctx.sim.n))


def plan_for(ctx: PlanContext, k: int, budget: int, per_block_peak: int, per_op_peak: int, times: CompiledTimes):
    """The compiled plan for ``budget`` with the first ``k`` blocks offloaded, and the bytes they take off the
    device at the peak (planned twice: the held bytes depend on the plan)."""
    target = with_headroom(budget, COMPILED_HEADROOM)
    if not k:  # as acstudio bench plans it, torchtitan's own set at its measured peak included
        return plan_compiled(ctx, target, per_block_peak, times=times, measured_per_op_peak=per_op_peak,
                             measured_budget=budget), 0
    held = 0
    for _ in range(2):
        plan = plan_compiled(ctx, target + held, per_block_peak, times=times, measured_per_op_peak=per_op_peak)
        held = held_by_regions(ctx, plan.recomputed, k)
    return plan, held


def planned_regions(spec: WorkloadSpec, profile, plan, k: int):
    """Blocks wrapped by ``apply_plan``, each compiled alone, the first ``k`` inside the offload's hooks."""
    w, opt = load(spec, dev)
    acstudio.apply_plan(w.model, (profile, plan))
    offload = BlockOffload() if k else None
    parents = {id(b): (p, n) for p in w.model.modules() for n, b in p.named_children()}
    for i, b in enumerate(find_blocks(w)):
        parent, name = parents[id(b)]
        setattr(parent, name, Offloaded(torch.compile(b), offload, i < k, keep_shared=True))
    return make_training_step(spec, w, opt, torch.compile(w.model), offload), offload


def write(out_file: Path, line: str) -> None:
    print(line, flush=True)
    with open(out_file, "a") as f:
        f.write(line + "\n")


def main(out: Path, name: str) -> None:
    spec = SPECS[name]
    allow_a_graph_per_block()
    out.mkdir(parents=True, exist_ok=True)
    out_file = out / "compiled_offload_plan.txt"
    write(out_file, f"torch {torch.__version__} {torch.cuda.get_device_name(dev)} {name} {spec}")
    rows = {label: measure(out_file, label, functools.partial(build, spec, "whole", context, 0))
            for label, context in (("compile", None), ("compile+per-op", per_op_context))}
    rows["compile+per-block"] = measure(out_file, "compile+per-block", functools.partial(per_block_whole, spec))
    rows["regions per-op"] = measure(out_file, "regions per-op", functools.partial(build, spec, "regions",
                                                                                  per_op_context, 0))
    if any(r is None for r in rows.values()):
        write(out_file, "a calibration row failed: nothing planned")
        return
    region_ms = rows["regions per-op"]["ms"] - rows["compile+per-op"]["ms"]
    times = CompiledTimes(rows["compile"]["ms"], rows["compile+per-block"]["ms"], rows["compile+per-op"]["ms"])
    profile = cached_profile(spec, dev, str(out / f"{name}.profile.json.gz"))
    candidates = plan_table(out_file, profile, times, rows["compile+per-op"]["peak"], rows["compile+per-block"]["peak"],
                            region_ms)
    for _, k, plan in sorted(candidates, key=lambda c: c[0])[:2]:
        measure(out_file, f"planned, {k} blocks offloaded", functools.partial(planned_regions, spec, profile, plan, k))


def plan_table(out_file: Path, profile, times: CompiledTimes, budget: int, per_block_peak: int,
               region_ms: float | None) -> list:
    """One line per K (its plan, bytes offloaded, copy time against the forward's, predicted peak and step; the
    regions' cost added where measured); returns (predicted ms, K, plan) of those that fit with hidden copies."""
    ctx = PlanContext(profile)
    forward_ms = times.compile_ms * forward_share(profile)
    candidates = []
    for k in range(len(sac_blocks(ctx.sim).blocks)):
        plan, held = plan_for(ctx, k, budget, per_block_peak, budget, times)
        peak = plan.compiled_peak_bytes - held
        ms = times.compile_ms + plan.compiled_extra_ms + (region_ms if k and region_ms else 0.0)
        copy_ms = held / (profile.link.d2h_gb_s * 1e9) * 1e3
        fits, hides = peak <= budget, copy_ms <= 0.75 * forward_ms
        write(out_file, f"K={k:2d} planned: {len(plan.recomputed):4d} recomputed, {held / 2**30:5.2f} GiB offloaded"
                        f" ({copy_ms:5.1f} ms of copies in a {forward_ms:5.1f} ms forward: "
                        f"{'hidden' if hides else 'too long'}), peak {peak / MiB:9.0f} MiB predicted "
                        f"({'fits' if fits else 'OVER'} {budget / MiB:.0f}), step {ms:7.1f} ms predicted"
                        f" ({ms / times.per_op_ms:.3f} of compile+per-op's {times.per_op_ms:.1f})")
        if fits and hides:
            candidates.append((ms, k, plan))
    return candidates


def plan_from_grid(out: Path, shape: str) -> None:
    """On a CPU: the table of :func:`plan_table` for a committed grid shape, from its compiled part's calibration
    rows and profile (``results/grid/SHAPE.compiled.json``, ``results/grid/profiles/SHAPE.compiled.json.gz``),
    without the regions' own cost, which only a GPU run measures."""
    from acstudio.bench.results import BenchResults
    from acstudio.profile.model import Profile

    rows = {r["config"]: r for r in BenchResults.load(Path("results/grid") / f"{shape}.compiled.json").rows}
    measured = {name: (int(rows[name]["peak_bytes"]), rows[name]["time_ms_median"])
                for name in ("compile", "compile+per-block", "compile+per-op")}
    times = CompiledTimes(*(measured[name][1] for name in ("compile", "compile+per-block", "compile+per-op")))
    out.mkdir(parents=True, exist_ok=True)
    out_file = out / "compiled_offload_plan_cpu.txt"
    write(out_file, f"{shape} (results/grid/{shape}.compiled.json), planned on a CPU, before the regions' own cost")
    plan_table(out_file, Profile.load(Path("results/grid/profiles") / f"{shape}.compiled.json.gz"), times,
               measured["compile+per-op"][0], measured["compile+per-block"][0], None)


def forward_share(profile) -> float:
    """The forward's share of the profile's node-by-node time."""
    total = sum(n.run_time_ms for n in profile.nodes)
    return sum(n.run_time_ms for n in profile.nodes if n.region in FORWARD_REGIONS) / total if total else 0.0


def per_block_whole(spec: WorkloadSpec):
    """compile+per-block: every block under a plain non-reentrant checkpoint, the model compiled whole."""
    from acstudio.bench.steps import enable_per_block

    w, opt = load(spec, dev)
    enable_per_block(w)
    return make_training_step(spec, w, opt, torch.compile(w.model), None), None


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[2] == "--from-grid":
        for grid_shape in sys.argv[3:]:
            plan_from_grid(Path(sys.argv[1]), grid_shape)
    else:
        main(Path(sys.argv[1] if len(sys.argv) > 1 else "."), sys.argv[2] if len(sys.argv) > 2 else "gpt2")
