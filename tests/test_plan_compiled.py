"""Planning for torch.compile: the SAC mode's eager prediction less one offset, calibrated on a measured compiled
step under per-block checkpointing."""

import pytest

from acstudio.bench import runner
from acstudio.bench.configs import BenchConfig
from acstudio.plan.compiled import compiled_offset, plan_compiled
from acstudio.plan.model import Plan
from acstudio.plan.schedule import PlanContext
from acstudio.profile.model import Profile

MiB = 2**20
LLAMA = "sample_profiles/h200_llama_bs8_bf16_adamw.json.gz"
MEASURED = 3870 * MiB  # compile+per-block on the H200 (results/bench_h200_llama_bs8_sac.json)


@pytest.fixture(scope="module")
def ctx():
    return PlanContext(Profile.load(LLAMA))


def test_the_calibration_point_is_predicted_exactly(ctx):
    """Recompute-all is what compile+per-block saves: planned at that measured peak it is predicted there."""
    offset = compiled_offset(ctx, MEASURED)
    plan = plan_compiled(ctx, MEASURED, MEASURED, solver="recompute-all")
    assert plan.compiled_offset_bytes == offset > 0  # compile keeps less than eager
    assert plan.compiled_peak_bytes == MEASURED and plan.feasible
    assert plan.predicted_peak_bytes == MEASURED + offset and plan.run_peak_bytes == MEASURED


def test_more_compiled_memory_buys_a_faster_plan_that_fits_it(ctx, tmp_path):
    plans = [plan_compiled(ctx, budget, MEASURED) for budget in (4200 * MiB, 5000 * MiB)]
    for plan in plans:
        assert plan.feasible and plan.compiled_peak_bytes <= plan.budget_bytes
        assert plan.replay_mode == "sac" and "calibrated" in plan.stop_reason
    times = [p.predicted_extra_ms for p in plans]
    assert times == sorted(times, reverse=True) and times[0] > times[-1]
    # the offset travels with the plan file and its feasibility is checked against the compiled peak
    plans[0].save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json", profile=ctx.profile, context=ctx)
    assert loaded.compiled_peak_bytes == plans[0].compiled_peak_bytes and loaded.feasible


def test_a_compiled_sac_row_is_calibrated_on_compile_per_block_of_the_same_run(tmp_path, monkeypatch):
    """bench measures compile+per-block first (once) and hands its peak to every sac+compile worker."""
    seen = []

    def fake_worker(cfg, stem, **kwargs):
        seen.append(cfg)
        return runner.base_row(cfg) | {"status": "ok", "peak_bytes": 1000 * MiB, "time_ms_median": 1.0,
                                       "time_ms_iqr": 0.0}

    monkeypatch.setattr(runner, "run_worker", fake_worker)
    from conftest import tiny_spec

    runner.run_bench(tiny_spec("gpt2"), [2], ["sac+compile@3GiB", "sac+compile@compile+per-op", "sac@3GiB"],
                     device="cpu", out_dir=tmp_path, warmup=1, iters=3)
    by_config = {cfg["config"]: cfg for cfg in seen}
    assert [cfg["config"] for cfg in seen].count("compile+per-block") == 1
    for name in ("sac+compile@3GiB", "sac+compile@compile+per-op"):
        assert by_config[name]["compiled_per_block_peak"] == f"{1000 * MiB}B"
    assert "compiled_per_block_peak" not in by_config["sac@3GiB"]
    assert BenchConfig.parse("fsdp+sac+compile@fsdp+per-block").spec.compiled
