"""Planning for torch.compile: the SAC mode's eager prediction less one offset, calibrated on a measured compiled
step under per-block checkpointing, and replays priced at compiled times, calibrated on its step time."""

import dataclasses

import pytest

from acstudio.bench import runner
from acstudio.bench.configs import BenchConfig
from acstudio.bench.steps import COMPILED_HEADROOM, HEADROOM, with_headroom
from acstudio.bench.worker import run_config
from acstudio.errors import ACStudioError
from acstudio.plan.baselines import MATMULS, is_attention, per_module, per_op
from acstudio.plan.compiled import (
    TIMED_MODE,
    CompiledTimes,
    compiled_context,
    compiled_offset,
    is_library_kernel,
    plan_compiled,
    torchtitan_held,
    with_torchtitan_held,
)
from acstudio.plan.loading import load_plan
from acstudio.plan.schedule import PlanContext
from acstudio.plan.solvers import tighten_to_budget
from acstudio.profile.model import Profile
from acstudio.simulate.modes import get_mode
from acstudio.simulate.sac import SAVE, sac_blocks, simulate_sac

MiB = 2**20
LLAMA = "sample_profiles/h200_llama_bs8_bf16_adamw.json.gz"
MEASURED = 3870 * MiB  # compile+per-block on the H200 (results/superseded/llama_bs8_sac_in_process.json)
TIMES = CompiledTimes(23.5, 28.3)  # compile's and compile+per-block's step times, ms (..._llama_bs8_sac_compiled.json)
WITH_PER_OP = CompiledTimes(23.5, 28.3, 25.3)  # and compile+per-op's (25.3 in ..._llama_bs8_sac_compiled_in_process)
PER_OP_PEAK = 4612 * MiB  # compile+per-op's measured peak, there


@pytest.fixture(scope="module")
def ctx():
    return PlanContext(Profile.load(LLAMA))


def test_the_calibration_point_is_predicted_exactly(ctx):
    """Per-module (every repeated block recomputed) is what compile+per-block saves: planned at that measured peak
    it is predicted there."""
    offset = compiled_offset(ctx, MEASURED)
    plan = plan_compiled(ctx, MEASURED, MEASURED, solver="per-module")
    # compile keeps less than eager: the offset, and the last layer's output until the final norm's backward
    assert plan.compiled_offset_bytes > offset > 0
    assert plan.compiled_peak_bytes == MEASURED and plan.feasible
    assert plan.predicted_peak_bytes == MEASURED + plan.compiled_offset_bytes and plan.run_peak_bytes == MEASURED


def test_on_one_device_only_the_layers_are_wrapped(ctx):
    """One device may compile the whole model, and compile+per-block, the calibration, wraps the layers only: so does
    the SAC form, and recompute-all's compiled peak is the calibration point."""
    floor = plan_compiled(ctx, 0, MEASURED, solver="recompute-all")
    wrapped = simulate_sac(ctx.sim, floor.recomputed).decisions.keys()
    assert wrapped == {f"model.layers.{i}" for i in range(8)} and floor.compiled_peak_bytes == MEASURED


def test_one_rank_under_fsdp2_wraps_the_head_and_norm_and_fits_hf_gcs_peak():
    """Under FSDP2 each rank compiles its blocks alone and runs the head and norm eager, so SAC wraps them. On the
    2-H200 run, compile+per-block held 4758 MiB per rank, 3 MiB over FSDP2 + HF GC's 4755: that is recompute-all in
    the layers; freeing the head's and norm's activations brings the plan under it."""
    from acstudio.simulate.sharding import per_rank_profile

    rank = PlanContext(per_rank_profile(Profile.load(LLAMA), 2, "fsdp"))
    hf_gc, compile_per_block = 4985804288, 4988952576  # per-rank peaks (results/bench/llama/bs8x2_fsdp_ddp*.json)
    plan = plan_compiled(rank, hf_gc, compile_per_block, times=CompiledTimes(52.3, 69.6))
    assert {"model.norm", "lm_head"} <= simulate_sac(rank.sim, plan.recomputed).decisions.keys()
    assert plan.feasible and plan.compiled_peak_bytes <= hf_gc < compile_per_block
    assert plan.compiled_extra_ms < 69.6 - 52.3


def test_more_compiled_memory_buys_a_faster_plan_that_fits_it(ctx, tmp_path):
    plans = [plan_compiled(ctx, budget, MEASURED) for budget in (4200 * MiB, 5000 * MiB)]
    for plan in plans:
        assert plan.feasible and plan.compiled_peak_bytes <= plan.budget_bytes
        assert plan.replay_mode == "sac" and "calibrated" in plan.stop_reason
    # priced as they run compiled: replays pruned to what backward reads, no eager dispatch
    times = [get_mode("sac-compiled").peak(ctx.sim, ctx.sim.indices(p.recomputed))[2] for p in plans]
    assert times == sorted(times, reverse=True) and times[0] > times[-1]
    # the offset travels with the plan file and its feasibility is checked against the compiled peak
    plans[0].save(tmp_path / "plan.json")
    loaded = load_plan(tmp_path / "plan.json", profile=ctx.profile, context=ctx)
    assert loaded.compiled_peak_bytes == plans[0].compiled_peak_bytes and loaded.feasible


def test_per_op_saves_attention_and_every_second_matmul_of_each_block(ctx):
    """torchtitan's policy as a recompute set: in SAC's form, a block's matmul that writes an activation is saved
    exactly when it is the block's 1st, 3rd, ... matmul, and its attention is saved."""
    blocks = sac_blocks(ctx.sim)
    decision, _ = blocks.decide(per_op(ctx))
    nodes = ctx.profile.nodes
    for b in [b for b in blocks.blocks if b.startswith("model.layers.")]:  # the LM head is no layer
        matmuls = [i for i in blocks.fw_nodes[b] if nodes[i].target in MATMULS]
        assert len(matmuls) == 7  # q, k, v, o, gate, up, down
        for n, i in enumerate(matmuls):
            if blocks.writes[i]:
                assert (decision[i] == SAVE) == (n % 2 == 0), (b, n)
        assert all(decision[i] == SAVE for i in blocks.fw_nodes[b] if is_attention(nodes[i].target))


def test_torchtitans_set_as_it_runs_compiled_holds_what_compile_per_op_measured(ctx):
    """torchtitan's policy saves each layer's query projection, whose output backward never reads, so the per-op
    set frees the rotary query made from it and holds less than torchtitan's compiled step. Kept back in its place
    (exactly attention's query inputs), the set is predicted at compile+per-op's measured peak."""
    nodes, index = ctx.profile.nodes, ctx.profile.node_index
    queries = {ctx.rg.act_index[nodes[index[nd.inputs[0]]].storage] for nd in nodes
               if is_attention(nd.target) and nd.region == "forward"}
    held = torchtitan_held(ctx)
    assert set(per_op(ctx)) - set(held) == queries and len(queries) == 8
    mode, offset = get_mode("sac-compiled"), compiled_offset(ctx, MEASURED)
    assert abs(mode.peak(ctx.sim, held)[0] - offset - PER_OP_PEAK) < 0.001 * PER_OP_PEAK
    assert mode.peak(ctx.sim, per_op(ctx))[0] - offset < 0.98 * PER_OP_PEAK


def test_torchtitans_set_as_it_runs_compiled_replaces_a_slower_plan_of_the_auto_solver_only(ctx):
    """Among the plans a compiled plan is chosen from, torchtitan's set as it runs compiled replaces a slower one
    that fits as well (the per-op set, which replays the query projections), where every solver may be used."""
    timed = compiled_context(ctx, TIMES)
    budget = PER_OP_PEAK + compiled_offset(ctx, MEASURED)
    slower = timed.plan_for_set("per-op", budget, per_op(ctx), mode="sac-compiled")
    chosen = with_torchtitan_held(timed, slower, "auto")
    assert chosen.feasible and chosen.predicted_extra_ms < slower.predicted_extra_ms
    assert "torchtitan's policy as it runs compiled" in chosen.stop_reason
    assert sorted(timed.sim.indices(chosen.recomputed)) == sorted(torchtitan_held(ctx))
    assert with_torchtitan_held(timed, slower, "per-op") is slower


def test_compiled_times_are_calibrated_on_compile_per_block(ctx, tmp_path):
    """Replays cost their library kernels only, scaled so that per-module's replays cost exactly what
    compile+per-block measured over compile; a replay runs only what its outputs depend on."""
    timed = compiled_context(ctx, TIMES)
    assert timed is compiled_context(ctx, TIMES) and timed.profile is ctx.profile
    kernel = [is_library_kernel(nd.target) for nd in ctx.profile.nodes]
    assert all(ms == 0 for ms, k in zip(timed.rg.run_ms, kernel) if not k)
    floor = plan_compiled(ctx, MEASURED, MEASURED, solver="per-module", times=TIMES)
    assert floor.compiled_extra_ms == pytest.approx(TIMES.per_block_ms - TIMES.compile_ms)
    sac, pruned = get_mode("sac"), get_mode("sac-compiled")
    eager_sac = sac.peak(ctx.sim, per_op(ctx))
    compiled_sac = pruned.peak(ctx.sim, per_op(ctx))
    assert compiled_sac[0] < eager_sac[0]  # less memory: the last layer's output comes back in backward
    assert 0 < compiled_sac[2] < eager_sac[2]  # ops after the last one backward reads are not replayed
    # the eager prediction stays what the profile gives; the compiled one travels with the file
    floor.save(tmp_path / "plan.json")
    loaded = load_plan(tmp_path / "plan.json", profile=ctx.profile, context=ctx)
    assert loaded.compiled_extra_ms == floor.compiled_extra_ms and loaded.predicted_extra_ms == floor.predicted_extra_ms


def test_at_compiled_times_the_plan_is_never_slower_than_the_policies_it_knows(ctx):
    """At compile+per-op's measured peak, the plan is at least as fast (compiled) as torchtitan's set and as the
    plan chosen at eager times, and fits; at eager times the weight casts looked worth saving, compiled they are
    not."""
    plan = plan_compiled(ctx, PER_OP_PEAK, MEASURED, times=TIMES)
    assert plan.feasible and plan.compiled_peak_bytes <= PER_OP_PEAK
    timed = compiled_context(ctx, TIMES)
    offset = plan.compiled_offset_bytes
    titan = get_mode("sac-compiled").peak(timed.sim, per_op(ctx))
    assert titan[0] - offset <= PER_OP_PEAK and plan.compiled_extra_ms <= titan[2] + 1e-9
    at_eager_times = plan_compiled(ctx, PER_OP_PEAK, MEASURED)
    repriced = get_mode("sac-compiled").peak(timed.sim, timed.sim.indices(at_eager_times.recomputed))
    assert plan.compiled_extra_ms <= repriced[2] + 1e-9
    casts = [i for i, d in sac_blocks(ctx.sim).decide(ctx.sim.indices(at_eager_times.recomputed))[0].items()
             if d == SAVE and ctx.profile.nodes[i].target == "aten._to_copy.default"]
    assert casts and "calibrated" in plan.stop_reason and "compiled +" in plan.stop_reason


def test_torchtitans_set_filled_with_rotary_queries_and_keys_beats_it(ctx):
    """Compiled, the per-op set recomputes a layer's query and key projections to redo the rotary embedding after
    them. At compile+per-op's measured peak the memory left keeps most layers' rotary queries or keys back
    (attention's inputs), which no solver's set does alone: the plan is that set so filled, predicted clearly
    faster, and no slower than torchtitan's set as its policy runs compiled (which keeps the queries back)."""
    plan = plan_compiled(ctx, PER_OP_PEAK, MEASURED, times=TIMES)
    timed = compiled_context(ctx, TIMES)
    titan = get_mode("sac-compiled").peak(timed.sim, per_op(ctx))
    assert plan.feasible and "per-op's plan" in plan.stop_reason and "kept back" in plan.stop_reason
    assert plan.compiled_extra_ms < titan[2] - 0.3
    assert plan.compiled_extra_ms <= get_mode("sac-compiled").peak(timed.sim, torchtitan_held(ctx))[2] + 1e-9
    nodes, index = ctx.profile.nodes, ctx.profile.node_index
    attention_inputs = {ctx.rg.act_index.get(nodes[index[u]].storage) for nd in nodes
                        if is_attention(nd.target) and nd.region == "forward" for u in nd.inputs}
    kept = set(per_op(ctx)) - set(ctx.sim.indices(plan.recomputed))
    assert len(kept) >= 6 and kept <= attention_inputs


def test_where_the_optimizer_step_sets_every_plans_peak_the_memory_beneath_it_is_kept_back(ctx):
    """A decoder's AdamW step over fp32 states can set the peak of every plan: the 953M decoder at seq 2048 peaked
    there under compile+per-op, compile+per-block and per-block alike, and the budget, that peer's peak less the
    bench's headroom, sat just under it. Planned at the lowest peak reached, the plan keeps activations back in the
    memory beneath that peak during forward and backward (here 200 MiB under it): faster than torchtitan's set as
    it runs compiled, which it used to stop at, where nothing seemed left to fill."""
    held = torchtitan_held(ctx)
    mode = get_mode("sac-compiled")
    lift = mode.peak(ctx.sim, held)[0] + 200 * MiB - ctx.sim._outside_peak
    after = ctx.sim._hi  # the last backward use of an activation: the optimizer step follows
    nodes = [dataclasses.replace(nd, mem_peak=nd.mem_peak + lift) if i > after else nd
             for i, nd in enumerate(ctx.profile.nodes)]
    lifted = PlanContext(dataclasses.replace(ctx.profile, nodes=nodes))
    optimizer_peak = lifted.sim._outside_peak  # compile+per-block's measured peak: the same step
    plan = plan_compiled(lifted, optimizer_peak - optimizer_peak // 2000, optimizer_peak, times=TIMES)
    assert plan.compiled_peak_bytes == optimizer_peak and not plan.feasible
    assert "lowest peak reached" in plan.stop_reason and "kept back" in plan.stop_reason
    timed = compiled_context(lifted, TIMES)
    assert plan.compiled_extra_ms < mode.peak(timed.sim, held)[2] - 0.3


def test_compiled_step_times_parse():
    assert CompiledTimes.parse("23.5,28.3") == TIMES
    assert CompiledTimes.parse(str(TIMES)) == TIMES  # what bench hands its workers
    assert CompiledTimes.parse(str(WITH_PER_OP)) == WITH_PER_OP == CompiledTimes.parse("23.5,28.3,25.3")
    with_regions = CompiledTimes.parse("23.5,28.3,25.3,27.5")
    assert with_regions == dataclasses.replace(WITH_PER_OP, regions_ms=27.5) == CompiledTimes.parse(str(with_regions))
    assert with_regions.regions_cost_ms == pytest.approx(2.2) and WITH_PER_OP.regions_cost_ms is None
    for bad, says in (("23.5,28.3,25.3,27.5,1", "two to four numbers"), ("23.5,x", "two to four numbers"),
                      ("23.5,28.3,25.3,-1", "positive")):
        with pytest.raises(ACStudioError, match=says):
            CompiledTimes.parse(bad)
    with pytest.raises(ACStudioError, match="priced against compile\\+per-op's"):
        CompiledTimes(23.5, 28.3, None, 27.5)


def test_with_compile_per_ops_time_both_calibration_points_are_predicted_exactly(ctx):
    """Given compile+per-op's step time too, fused replays get a factor of their own: per-module's compiled
    replays cost what compile+per-block measured over compile, and torchtitan's set as it runs compiled what
    compile+per-op measured. A third time the two points cannot both explain (no slower than compile, here)
    leaves the fused ops free, as without it."""
    timed = compiled_context(ctx, WITH_PER_OP)
    kernels, fused = timed.cache["replay_scales"]
    assert kernels > 0 and fused > 0 and kernels < compiled_context(ctx, TIMES).cache["replay_scales"][0]
    mode, t = get_mode("sac-compiled"), WITH_PER_OP
    assert mode.peak(timed.sim, per_module(ctx))[2] == pytest.approx(t.per_block_ms - t.compile_ms)
    assert mode.peak(timed.sim, torchtitan_held(ctx))[2] == pytest.approx(t.per_op_ms - t.compile_ms)
    unexplained = compiled_context(ctx, dataclasses.replace(t, per_op_ms=t.compile_ms + 0.01))
    assert unexplained.cache["replay_scales"] == compiled_context(ctx, TIMES).cache["replay_scales"]


def test_with_compile_per_ops_peak_both_measured_peaks_are_predicted_exactly(ctx):
    """compile+per-op's measured peak is a second calibration point: a budget at either measured peak is
    calibrated on that point alone, one between them on both in proportion, one outside on the nearer; and a plan
    at compile+per-op's peak fits it as predicted."""
    mode = get_mode(TIMED_MODE)
    at_per_block = mode.peak(ctx.sim, per_module(ctx))[0]
    at_per_op = mode.peak(ctx.sim, torchtitan_held(ctx))[0]
    offset = {budget: compiled_offset(ctx, MEASURED, PER_OP_PEAK, budget)
              for budget in (MEASURED // 2, MEASURED, (MEASURED + PER_OP_PEAK) // 2, PER_OP_PEAK, 2 * PER_OP_PEAK)}
    assert at_per_block - offset[MEASURED] == MEASURED and at_per_op - offset[PER_OP_PEAK] == PER_OP_PEAK
    assert offset[MEASURED // 2] == offset[MEASURED] == compiled_offset(ctx, MEASURED)
    assert offset[2 * PER_OP_PEAK] == offset[PER_OP_PEAK] != offset[MEASURED]
    middle = offset[(MEASURED + PER_OP_PEAK) // 2]
    assert abs(middle - (offset[MEASURED] + offset[PER_OP_PEAK]) / 2) <= 1
    plan = plan_compiled(ctx, PER_OP_PEAK, MEASURED, times=WITH_PER_OP, measured_per_op_peak=PER_OP_PEAK)
    assert plan.feasible and plan.compiled_peak_bytes <= PER_OP_PEAK
    assert mode.peak(ctx.sim, ctx.sim.indices(plan.recomputed))[0] - offset[PER_OP_PEAK] == plan.compiled_peak_bytes
    assert "compile+per-op's" in plan.stop_reason


def test_a_peers_set_a_little_over_the_budget_is_tightened_to_it(ctx):
    """torchtitan's set, predicted just over a budget (its own measured peak less the bench's headroom), frees
    the cheapest activation that makes it fit, and that is the only change."""
    timed = compiled_context(ctx, WITH_PER_OP)
    mode = get_mode("sac-compiled")
    held = torchtitan_held(ctx)
    peak, _, ms = mode.peak(timed.sim, held)
    budget = peak - 1
    over = timed.plan_for_set("auto", budget, held, mode="sac-compiled")
    tightened, freed = tighten_to_budget(timed, over, budget, "sac-compiled")
    assert not over.feasible and tightened.feasible and freed == 1
    added = set(timed.sim.indices(tightened.recomputed)) - set(held)
    assert len(added) == 1 and set(held) <= set(timed.sim.indices(tightened.recomputed))
    fitting = [mode.peak(timed.sim, [*held, k])[2] for k in timed.rg.candidates
               if k not in set(held) and mode.peak(timed.sim, [*held, k])[0] <= budget]
    assert tightened.predicted_extra_ms == pytest.approx(min(fitting)) and tightened.predicted_extra_ms > ms


def test_at_compile_per_ops_own_peak_its_measured_set_needs_no_planning_headroom(ctx, tmp_path):
    """The bench plans a headroom below the budget; torchtitan's set was measured at compile+per-op's peak, so
    with that peak as the budget it fits by measurement: planned at the budget itself it is predicted at exactly
    that peak, and is returned where it is faster than the plan that fits beneath the headroom (here one more
    activation recomputed); the plan loads as derived from its profile."""
    budget = with_headroom(PER_OP_PEAK)
    under = plan_compiled(ctx, budget, MEASURED, times=TIMES, measured_per_op_peak=PER_OP_PEAK)
    measured = plan_compiled(ctx, budget, MEASURED, times=TIMES, measured_per_op_peak=PER_OP_PEAK,
                             measured_budget=PER_OP_PEAK)
    assert under.feasible and under.compiled_peak_bytes <= budget
    assert measured.feasible and measured.compiled_peak_bytes == PER_OP_PEAK == measured.budget_bytes
    assert sorted(ctx.sim.indices(measured.recomputed)) == sorted(torchtitan_held(ctx))
    assert measured.compiled_extra_ms < under.compiled_extra_ms and "by measurement" in measured.stop_reason
    measured.save(tmp_path / "plan.json")
    assert load_plan(tmp_path / "plan.json", profile=ctx.profile, context=ctx).recomputed == measured.recomputed
    # a budget below compile+per-op's peak, even without headroom, has no measurement to go by
    below = plan_compiled(ctx, budget, MEASURED, times=TIMES, measured_per_op_peak=PER_OP_PEAK,
                          measured_budget=PER_OP_PEAK - 1)
    assert below.recomputed == under.recomputed


def test_a_compiled_sac_row_is_calibrated_on_compile_per_block_of_the_same_run(tmp_path, monkeypatch):
    """bench measures compile+per-block, compile, compile+per-op and compile+per-op+regions first (once each) and
    hands their peaks and step times, and compile's host time to issue its step, to every sac+compile worker."""
    seen = []

    def fake_worker(cfg, stem, **kwargs):
        seen.append(cfg)
        ms = {"compile+per-block": 1.5, "compile+per-op": 1.2, "compile+per-op+regions": 1.3}.get(cfg["config"], 1.0)
        peak = {"compile+per-op": 1500 * MiB}.get(cfg["config"], 1000 * MiB)
        details = {"host_issue_ms": 0.4} if cfg["config"] == "compile" else {}  # measured on a GPU only
        return runner.base_row(cfg) | {"status": "ok", "peak_bytes": peak, "time_ms_median": ms, "time_ms_iqr": 0.0,
                                       "details": details}

    monkeypatch.setattr(runner, "run_worker", fake_worker)
    from conftest import tiny_spec

    runner.run_bench(tiny_spec("gpt2"), [2], ["sac+compile@3GiB", "sac+compile@compile+per-op", "sac@3GiB"],
                     device="cpu", out_dir=tmp_path, warmup=1, iters=3)
    by_config = {cfg["config"]: cfg for cfg in seen}
    assert [cfg["config"] for cfg in seen].count("compile+per-block") == 1
    assert [cfg["config"] for cfg in seen].count("compile") == 1
    assert [cfg["config"] for cfg in seen].count("compile+per-op") == 1
    assert [cfg["config"] for cfg in seen].count("compile+per-op+regions") == 1
    for name in ("sac+compile@3GiB", "sac+compile@compile+per-op"):
        assert by_config[name]["compiled_per_block_peak"] == f"{1000 * MiB}B"
        assert by_config[name]["compiled_per_op_peak"] == f"{1500 * MiB}B"
        assert CompiledTimes.parse(by_config[name]["compiled_step_ms"]) == CompiledTimes(1.0, 1.5, 1.2, 1.3)
        assert by_config[name]["compile_host_ms"] == 0.4  # offload's host calls are priced against it
    assert "compiled_per_block_peak" not in by_config["sac@3GiB"]
    assert BenchConfig.parse("fsdp+sac+compile@fsdp+per-block").spec.compiled


def test_a_compiled_sac_row_plans_a_wider_headroom_below_its_budget(tmp_path):
    """The planning step of a sac+compile row aims COMPILED_HEADROOM below the budget it must fit (the compiled
    peak is calibrated, not simulated op by op), an eager sac row HEADROOM below it; at one budget the two export
    to folders of their own."""
    from conftest import tiny_spec

    spec = tiny_spec("gpt2")
    base = {"spec": spec.to_dict(), "device": "cpu", "warmup": 1, "iters": 3, "task": "plan",
            "profile_path": str(tmp_path / "profile.json.gz")}
    compiled = run_config(base | {"config": "sac+compile@60%", "compiled_per_block_peak": "1MiB",
                                  "compiled_step_ms": "1.0,1.5", "compile_host_ms": 0.5})
    eager = run_config(base | {"config": "sac@60%"})
    for row, share in ((compiled, COMPILED_HEADROOM), (eager, HEADROOM)):
        assert row["status"] == "ok", row["message"]
        assert row["details"]["plan"]["budget_bytes"] == with_headroom(row["details"]["budget_bytes"], share)
    assert COMPILED_HEADROOM > HEADROOM and compiled["details"]["plan"]["compiled_peak_bytes"] is not None


def test_compiled_the_last_layers_output_comes_back_at_its_first_backward_use_unless_its_op_is_saved():
    """The partitioner saves a checkpointed region's output only for a later region that recomputes from it: the
    output of BERT's last layer, which only the MLM head reads, is recomputed in backward when the head's backward
    first reads it (measured on BERT seq 512 bs64: 96 MiB less at the peak than the checkpoint's caller holds in
    eager, results/probes/compiled_saved_bytes_h100.txt), while every earlier layer's output stays for the next
    layer's replay; a plan that saves the last LayerNorm (its statistics kept) holds it."""
    ctx = PlanContext(Profile.load("sample_profiles/h200_bert_bs16_adam.json.gz"))
    blocks, rg = sac_blocks(ctx.sim), ctx.rg
    outputs = {blocks.act_block[k]: k for k in blocks.outside_readers if blocks.act_block[k]}
    last = outputs.pop(blocks.blocks[-1])
    assert len(outputs) == len(blocks.blocks) - 1
    recomputed = per_module(ctx)
    compiled, eager = blocks.schedule(recomputed, compiled=True), blocks.schedule(recomputed)
    assert compiled.back[last] == rg.first_bw[last] and eager.back[last] == -1
    assert all(compiled.back[k] == -1 for k in outputs.values())
    norm = rg.created[last]
    statistics = [k for k in blocks.writes[norm] if k != last]
    assert statistics
    keeps_statistics = [k for k in recomputed if k not in statistics]
    assert blocks.schedule(keeps_statistics, compiled=True).back[last] == -1
    mode = get_mode(TIMED_MODE)
    assert mode.peak(ctx.sim, recomputed)[0] < get_mode("sac").peak(ctx.sim, recomputed)[0]


def test_under_fsdp2_each_blocks_output_leaves_its_compiled_graph_and_stays(ctx):
    """One rank under FSDP2 compiles each block alone: a block's output is its graph's output, which the caller
    holds, so no output comes back late; compiled whole, the last layer's does."""
    from acstudio.simulate.sharding import per_rank_profile

    rank = PlanContext(per_rank_profile(Profile.load(LLAMA), 2, "fsdp"))
    blocks = sac_blocks(rank.sim)
    forms = {b: blocks._block(b, asked, True) for b, asked in blocks._asked(per_module(rank)).items()}
    assert blocks.regional and not blocks.recomputed_at_first_use(forms)
    whole = sac_blocks(ctx.sim)
    forms = {b: whole._block(b, asked, True) for b, asked in whole._asked(per_module(ctx)).items()}
    assert list(whole.recomputed_at_first_use(forms)) == [whole.blocks[-1]]
