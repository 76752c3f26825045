"""The benchmark harness: worker processes on tiny CPU models, recorded failures, comparisons, search, plots."""

import contextlib
import importlib.util
import json
import math
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import tiny_spec

from acstudio.bench import BenchConfig, BenchResults, compare, expand_configs, parse_size, run_bench, search_max_batch
from acstudio.bench.measure import StorageTracker
from acstudio.bench.runner import bench_args, run_worker
from acstudio.bench.steps import (
    Request,
    blocks_compiled_alone,
    enable_per_block,
    find_blocks,
    per_op_as_regions,
    per_op_context,
    prepare,
    with_headroom,
)
from acstudio.bench.worker import run_config
from acstudio.child_process import MARK
from acstudio.errors import ACStudioError, Cancelled, DeviceError
from acstudio.workload import WorkloadSpec, build_workload

FAULTY_MODELS = '''
import os, time, torch

class Faulty(torch.nn.Module):
    def __init__(self, fault):
        super().__init__()
        self.fault, self.lin = fault, torch.nn.Linear(4, 2)

    def forward(self, x):
        if self.fault == "oom":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if self.fault == "error":
            raise ValueError("shape mismatch in layer 3")
        if self.fault == "exit":
            os._exit(3)
        if self.fault == "second_process_hangs":  # the first process to run it trains; any later one hangs
            first = os.path.join(os.path.dirname(__file__), "first_process")
            if not os.path.exists(first):
                with open(first, "w") as f:
                    f.write(str(os.getpid()))
            with open(first) as f:
                if f.read() == str(os.getpid()):
                    return self.lin(x)
        time.sleep(60)

def make(fault):
    return lambda batch_size: (Faulty(fault), torch.randn(batch_size, 4), lambda m, b: m(b).sum())

oom, error, exit, hang = make("oom"), make("error"), make("exit"), make("hang")
second_process_hangs = make("second_process_hangs")
'''


def worker_cfg(spec, config, **kw):
    return {"spec": spec.to_dict(), "config": config, "device": "cpu", "warmup": 1, "iters": 3, **kw}


@pytest.fixture
def faulty(tmp_path):
    path = tmp_path / "faulty.py"
    path.write_text(FAULTY_MODELS)
    return lambda name: WorkloadSpec(f"{path}:{name}", batch_size=2)


def test_config_names_parse_expand_and_name_their_baseline():
    configs = expand_configs(["eager", "rewritten", "per-block", "compile", "compile@0.5", "rewritten@60%"],
                             ["60%", "8GiB"])
    assert [c.name for c in configs] == ["eager", "rewritten@60%", "rewritten@8GiB", "per-block", "compile",
                                         "compile@0.5"]
    assert [c.baseline for c in configs] == [None, "captured", "captured", "eager", "eager", "compile"]
    assert BenchConfig.parse("compile@0.2").memory_ratio == 0.2
    for bad in ("eagre", "compile@2", "compile@x", "eager@3", "rewritten@", "rewritten@per-blok"):
        with pytest.raises(ACStudioError):
            BenchConfig.parse(bad)
    with pytest.raises(ACStudioError, match="budget"):
        expand_configs(["rewritten"], [])


def test_parse_size_reads_absolute_sizes_only():
    assert parse_size("16GiB") == 16 * 2**30
    assert parse_size("8000 MiB") == 8000 * 2**20
    assert parse_size("12GB") == 12 * 10**9
    assert parse_size("1.5e9B") == 1_500_000_000
    for bad in ("60%", "lots", "-1GiB", "3 parsecs", "0", "1.5e9"):
        with pytest.raises(ACStudioError):
            parse_size(bad)


def row(config, batch_size, ms, peak, status="ok"):
    c = BenchConfig.parse(config)
    return {"config": c.name, "kind": c.kind, "arg": c.arg, "baseline": c.baseline, "batch_size": batch_size,
            "status": status, "message": "", "time_ms_median": ms, "time_ms_iqr": 1.0, "peak_bytes": peak}


def test_overheads_use_each_configurations_own_baseline():
    rows = [row("eager", 32, 40.0, 6000), row("per-block", 32, 90.0, 3000), row("captured", 32, 44.0, 6000),
            row("rewritten@50%", 32, 55.0, 3300), row("compile", 32, 30.0, 6600), row("compile@0.5", 32, 33.0, 4800),
            row("eager", 64, None, None, status="oom"), row("per-block", 64, 160.0, 5000)]
    out = {(r["config"], r["batch_size"]): r for r in compare(rows)}
    assert out["per-block", 32]["overhead_pct"] == pytest.approx(125.0)
    assert out["rewritten@50%", 32]["overhead_pct"] == pytest.approx(25.0)  # against captured, not eager
    assert out["rewritten@50%", 32]["time_vs_eager_pct"] == pytest.approx(37.5)
    assert out["compile@0.5", 32]["overhead_pct"] == pytest.approx(10.0)  # against compile default
    assert out["compile", 32]["overhead_pct"] == pytest.approx(-25.0)
    assert out["per-block", 32]["memory_saving_pct"] == pytest.approx(50.0)
    assert out["compile", 32]["memory_saving_pct"] == pytest.approx(-10.0)  # compile used more memory
    assert out["eager", 32]["overhead_pct"] is None and out["eager", 32]["memory_saving_pct"] is None
    # no eager baseline at 64 (it ran out of memory): nothing to compare against, but the row is kept
    assert out["per-block", 64]["overhead_pct"] is None and out["per-block", 64]["memory_saving_pct"] is None
    assert out["eager", 64]["status"] == "oom"


def test_a_compiled_plans_predicted_time_is_checked_against_plain_compile_of_its_parallelism():
    """A compiled plan predicts its time over compile without checkpointing; under FSDP2 that is fsdp+compile, though
    its overhead column is against eager fsdp, the configuration a user would otherwise run."""
    rows = [row("fsdp", 8, 75.0, 8000), row("fsdp+compile", 8, 52.0, 7000),
            row("fsdp+sac+compile@fsdp+per-block", 8, 60.0, 4700)]
    rows[0]["parallel"] = rows[1]["parallel"] = rows[2]["parallel"] = "fsdp"
    rows[2]["details"] = {"plan": {"compiled_extra_ms": 14.6, "compiled_peak_bytes": 4750}, "budget_bytes": 4755}
    plan_row = {r["config"]: r for r in compare(rows)}["fsdp+sac+compile@fsdp+per-block"]
    assert plan_row["overhead_ms"] == pytest.approx(8.0) and plan_row["predicted_overhead_ms"] == 14.6
    assert plan_row["overhead_pct"] == pytest.approx(-20.0)  # against eager fsdp
    assert "+8.0 ms vs fsdp+compile, predicted +14.6" in BenchResults(meta={}, rows=rows).summary()


def test_a_rewritten_plans_predicted_time_is_checked_against_the_captured_step():
    """A rewritten step's plan predicts its extra time over the captured step it rewrites, not over eager."""
    rows = [row("eager", 8, 40.0, 6000), row("captured", 8, 41.0, 6000), row("rewritten@per-block", 8, 47.5, 3000),
            row("per-block", 8, 60.0, 3100)]
    rows[2]["details"] = {"plan": {"predicted_extra_ms": 6.1, "predicted_peak_bytes": 2990}, "budget_bytes": 3100}
    plan_row = {r["config"]: r for r in compare(rows)}["rewritten@per-block"]
    assert plan_row["overhead_ms"] == pytest.approx(6.5) and plan_row["predicted_overhead_ms"] == 6.1
    assert "+6.5 ms vs captured, predicted +6.1" in BenchResults(meta={}, rows=rows).summary()


@pytest.mark.parametrize(("start", "limit"), [(1, 64), (4, 100), (48, 1000)])
def test_max_batch_search_finds_the_largest_fitting_batch(start, limit):
    for threshold in [0, 1, 2, 3, 5, 47, 48, 63, 64, 65, 99, 100, 999, 5000]:
        probes = []

        def fits(b, threshold=threshold, probes=probes):
            assert 1 <= b <= limit
            probes.append(b)
            return b <= threshold

        assert search_max_batch(fits, start, limit) == min(threshold, limit)
        assert len(probes) == len(set(probes)), "a batch size was measured twice"
        assert len(probes) <= 2 * math.ceil(math.log2(limit)) + 2


def test_storage_tracker_counts_storages_once_until_freed():
    resident = torch.zeros(256)
    tracker = StorageTracker()
    tracker.track([resident, resident[:10]])
    assert tracker.live == 1024
    with tracker:
        a = torch.ones(1000)
        view = a.view(10, 100)
        a.add_(1)
        b = a * 2
        del a, b
        c = view.sum()
    assert tracker.peak == 1024 + 8000
    assert tracker.live == 1024 + 4000 + 4  # ``view`` keeps its base alive, plus the scalar ``c``
    del view, c
    assert tracker.live == 1024


@pytest.fixture(scope="module")
def bert_bench(tmp_path_factory):
    """One CPU run of tiny BERT in every configuration that needs no compiler (one process each)."""
    out = tmp_path_factory.mktemp("bench")
    configs = ["eager", "per-block", "captured", "rewritten", "rewritten@per-block"]
    seen = []
    results = run_bench(tiny_spec("bert", batch_size=2, seq_len=32), [4], configs, ["50%"], device="cpu",
                        out_dir=out, warmup=1, iters=3, progress=lambda done, total, msg: seen.append((done, total)))
    return out, results, seen


def test_run_bench_tiny_bert_on_cpu(bert_bench):
    out, results, seen = bert_bench
    rows = {r["config"]: r for r in results.rows}
    assert list(rows)[:3] == ["eager", "per-block", "captured"]
    for r in rows.values():
        assert r["status"] == "ok", r["message"]
        assert r["batch_size"] == 4 and len(r["times_ms"]) == 3
        assert r["time_ms_q1"] <= r["time_ms_median"] <= r["time_ms_q3"]
        assert 0 < r["resident_bytes"] < r["peak_bytes"]
        assert r["environment"]["torch"] == torch.__version__
        args = shlex.split(r["command"])
        assert args[:5] == ["acstudio", "bench", "bert", "--batch-size", "4"] and r["config"] in args
    # the same seed and random stream: per-block checkpointing computes the same loss as eager
    assert rows["per-block"]["loss"] == pytest.approx(rows["eager"]["loss"], rel=1e-5)
    assert rows["per-block"]["details"]["checkpointed_blocks"] == 2
    assert rows["per-block"]["peak_bytes"] < rows["eager"]["peak_bytes"]
    # the captured graph keeps the activations eager keeps
    assert rows["captured"]["peak_bytes"] == pytest.approx(rows["eager"]["peak_bytes"], rel=0.05)
    assert seen[-1][0] == seen[-1][1] == len(rows)
    # every row trains what eager trains: the same losses, bit for bit, dropout included
    checks = {c["config"]: c for c in json.loads((out / "bench.json").read_text())["loss_checks"]}
    assert set(checks) == set(rows) - {"eager"}
    assert all(c["passed"] and c["rule"] == "bitwise" and c["steps"] == 5 for c in checks.values()), checks

    loaded = BenchResults.load(out / "bench.json")
    assert loaded.rows == json.loads(json.dumps(results.rows))
    assert loaded.meta["command"].startswith("acstudio bench bert --batch-size 4 ")
    frame = loaded.to_frame()
    assert list(frame["config"])[:3] == ["eager", "per-block", "captured"]
    assert frame.loc[1, "memory_saving_pct"] > 0
    assert "| 4 | per-block | ok |" in (out / "summary.md").read_text()
    csv = (out / "bench.csv").read_text().splitlines()
    assert csv[0].startswith("model,batch_size,config,") and len(csv) == len(rows) + 1
    assert sorted(p.name for p in (out / "workers").glob("*.json"))[:3] == [
        "000_eager_bs4.json", "001_per_block_bs4.json", "002_captured_bs4.json"]


def test_rewritten_step_saves_memory_and_keeps_the_loss(bert_bench):
    out, results, _ = bert_bench
    rows = {r["config"]: r for r in results.rows}
    rewritten, captured = rows["rewritten@50%"], rows["captured"]
    assert rewritten["status"] == "ok", rewritten["message"]
    assert rewritten["baseline"] == "captured"
    assert rewritten["details"]["recomputed_activations"] > 0
    assert rewritten["peak_bytes"] < captured["peak_bytes"]
    assert rewritten["loss"] == pytest.approx(captured["loss"], rel=1e-4)
    assert len(list((out / "profiles").glob("bert_bs4_*.json.gz"))) == 1
    compared = {r["config"]: r for r in results.compared()}["rewritten@50%"]
    plan = rewritten["details"]["plan"]
    assert compared["predicted_peak_mib"] == plan["predicted_peak_bytes"] / 2**20
    assert compared["fits_budget"] == (rewritten["peak_bytes"] <= rewritten["details"]["budget_bytes"])
    # the plan aims a little below the budget it must fit: the measured peak may exceed a prediction slightly
    assert plan["budget_bytes"] == with_headroom(rewritten["details"]["budget_bytes"])
    assert plan["budget_bytes"] < rewritten["details"]["budget_bytes"]


def test_rewritten_at_another_configurations_peak_plans_for_that_measured_peak(bert_bench):
    _, results, _ = bert_bench
    rows = {r["config"]: r for r in results.rows}
    row = rows["rewritten@per-block"]
    assert row["status"] == "ok", row["message"]
    assert row["details"]["budget_bytes"] == rows["per-block"]["peak_bytes"]
    assert BenchConfig.parse("rewritten@compile@0.5").budget_reference.config == BenchConfig("compile", "0.5")
    assert BenchConfig.parse("rewritten@60%").budget_reference is None
    with pytest.raises(ACStudioError, match="another planned configuration"):
        BenchConfig.parse("rewritten@rewritten@50%")


@pytest.fixture(scope="module")
def bert_peers(bert_bench, tmp_path_factory):
    """per-op and sac on the same tiny BERT, in a second run that reuses the first one's cached profile."""
    first, results, _ = bert_bench
    out = tmp_path_factory.mktemp("peers")
    shutil.copytree(first / "profiles", out / "profiles")
    peers = run_bench(tiny_spec("bert", batch_size=2, seq_len=32), [4], ["per-op", "sac@60%"], device="cpu",
                      out_dir=out, warmup=1, iters=3)
    return first, out, {r["config"]: r for r in compare(results.rows + peers.rows)}


def test_per_op_and_sac_train_like_eager_with_less_memory(bert_peers):
    first, out, rows = bert_peers
    eager, per_block, per_op, sac = rows["eager"], rows["per-block"], rows["per-op"], rows["sac@60%"]
    for r in (per_op, sac):
        assert r["status"] == "ok", r["message"]
        # the same dropout masks: checkpointing replays random ops with the RNG state they consumed
        assert r["loss"] == pytest.approx(eager["loss"], rel=1e-5) and r["baseline"] == "eager"
    assert per_block["peak_bytes"] <= per_op["peak_bytes"] <= eager["peak_bytes"]
    assert sac["details"]["plan"]["replay_mode"] == "sac" and sac["details"]["recomputed_activations"] > 0
    assert sac["peak_bytes"] < eager["peak_bytes"]
    assert abs(sac["peak_error_pct"]) < 3.0  # the SAC form's predicted peak
    assert len(list((out / "profiles").glob("bert_bs4_*_sac_*/sac_policy.json"))) == 1
    # sac planned in a process of its own, before the one that measured it; the profile was reused, not measured again
    assert sorted(p.name for p in (out / "workers").glob("*.json")) == [
        "000_per_op_bs4.json", "001_sac_60_bs4.json", "001_sac_60_bs4_plan.json"]
    for copied in (out / "profiles").glob("*.json.gz"):
        assert copied.stat().st_mtime == (first / "profiles" / copied.name).stat().st_mtime


TINY_MLP = (
    "import torch\n"
    "def make(batch_size):\n"
    "    print('chatty model code')  # must not end up on the worker's stdout\n"
    "    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))\n"
    "    return model, torch.randn(batch_size, 64), lambda m, b: m(b).square().mean()\n")


@pytest.fixture
def tiny_mlp(tmp_path):
    (tmp_path / "tiny.py").write_text(TINY_MLP)
    return WorkloadSpec(f"{tmp_path / 'tiny.py'}:make", batch_size=32, optimizer="sgd")


def test_worker_reads_stdin_and_prints_one_json_line(tiny_mlp):
    cfg = json.dumps(worker_cfg(tiny_mlp, "eager"))
    proc = subprocess.run([sys.executable, "-m", "acstudio.bench.worker"], input=cfg,
                          capture_output=True, text=True, timeout=120, check=True)
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and "chatty model code" in proc.stderr
    r = json.loads(lines[0].removeprefix(MARK))["done"]
    assert r["status"] == "ok", r["message"]
    params = (64 * 256 + 256 + 256 + 1) * 4
    # resident when the step starts: parameters, last step's gradients, SGD momentum, the batch
    assert r["resident_bytes"] == 3 * params + 32 * 64 * 4
    # plus the ReLU output saved for backward (32 x 256 floats) and a few transients of that size at most
    hidden = 32 * 256 * 4
    assert r["resident_bytes"] + hidden <= r["peak_bytes"] <= r["resident_bytes"] + 3 * hidden
    assert math.isfinite(r["loss"]) and len(r["times_ms"]) == 3 and r["warmup"] == 1


def test_per_block_checkpoints_every_resnet_block_without_changing_gradients():
    spec = tiny_spec("resnet18", batch_size=2)
    plain, checkpointed = build_workload(spec), build_workload(spec)
    assert enable_per_block(checkpointed) == 8  # two BasicBlocks in each of layer1..layer4
    assert [n for n, _ in plain.model.named_parameters()] == [n for n, _ in checkpointed.model.named_parameters()]
    for w in (plain, checkpointed):
        w.loss_fn(w.model, w.batch).backward()
    for (name, p), q in zip(plain.model.named_parameters(), checkpointed.model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_every_row_makes_its_optimizer_state_before_its_first_step_and_trains_as_a_fresh_one():
    """A peer's row has its AdamW state before the first step, as the rewritten rows do (so the allocator
    rounds it alike for every row), and its first steps are bitwise those of an optimizer that makes it itself."""
    spec = WorkloadSpec.from_dict(tiny_spec("gpt2", batch_size=2).to_dict() | {"optimizer": "adamw"})
    torch.manual_seed(1)
    prepared = prepare(Request(BenchConfig.parse("per-block"), spec, torch.device("cpu")))
    params = [p for p in prepared.model.parameters() if p.requires_grad]
    assert all(set(prepared.optimizer.state[p]) >= {"exp_avg", "exp_avg_sq"} for p in params)
    plain = build_workload(spec)
    enable_per_block(plain)
    optimizer = plain.make_optimizer()
    assert not optimizer.state
    for _ in range(2):
        torch.manual_seed(2)
        ours = prepared.step()
        torch.manual_seed(2)
        optimizer.zero_grad(set_to_none=True)
        theirs = plain.loss_fn(plain.model, plain.batch)
        theirs.backward()
        optimizer.step()
        assert torch.equal(ours, theirs.detach())
    for p, q in zip(prepared.model.parameters(), plain.model.parameters()):
        assert torch.equal(p, q)


def test_out_of_memory_and_errors_are_recorded_not_raised(faulty, tmp_path):
    oom = run_config(worker_cfg(faulty("oom"), "eager"))
    assert oom["status"] == "oom" and oom["message"] == "does not fit: CUDA out of memory. Tried to allocate 2.00 GiB"
    err = run_config(worker_cfg(faulty("error"), "per-block"))
    assert err["status"] == "error" and "need a torchvision or transformers model" in err["message"]
    err = run_config(worker_cfg(faulty("error"), "eager"))
    assert err["status"] == "error" and err["message"] == "ValueError: shape mismatch in layer 3"
    assert "forward" in err["traceback"] and err["config"] == "eager" and err["batch_size"] == 2
    # a worker that dies without printing its result still yields a row, with the exit status
    dead = run_worker(worker_cfg(faulty("exit"), "eager"), tmp_path / "dead", timeout_s=120)
    assert dead["status"] == "error" and "exited with status 3" in dead["message"]
    assert dead["config"] == "eager" and dead["batch_size"] == 2


def test_rewritten_without_its_reference_peak_is_skipped_not_guessed(faulty, tmp_path):
    results = run_bench(faulty("error"), [2], ["rewritten@per-block"], device="cpu", out_dir=tmp_path, warmup=1,
                        iters=3)
    ref, row = results.rows
    assert ref["config"] == "per-block" and ref["status"] == "error"
    assert row["status"] == "skipped" and "per-block has no measured peak at batch size 2" in row["message"]
    assert not (tmp_path / "workers" / "001_rewritten_per_block_bs2.json").exists()


def test_a_failed_plan_is_the_rows_error_and_a_sac_step_never_plans_itself(faulty, tmp_path):
    results = run_bench(faulty("error"), [2], ["sac@60%"], device="cpu", out_dir=tmp_path, warmup=1, iters=3)
    (row,) = results.rows
    assert row["config"] == "sac@60%" and row["status"] == "error"
    assert "shape mismatch in layer 3" in row["message"]
    assert not (tmp_path / "workers" / "000_sac_60_bs2.json").exists()  # nothing was measured without a plan
    alone = run_config(worker_cfg(faulty("error"), "sac@60%", profile_path=str(tmp_path / "p.json.gz")))
    assert alone["status"] == "error" and "holds no exported plan" in alone["message"]


def test_hanging_worker_times_out_and_cancel_kills_it(faulty, tmp_path):
    t0 = time.monotonic()
    hung = run_worker(worker_cfg(faulty("hang"), "eager"), tmp_path / "hang", timeout_s=1.5)
    assert hung["status"] == "error" and "timed out" in hung["message"]
    assert time.monotonic() - t0 < 20

    from acstudio.jobs import CancelToken

    cancel = CancelToken()
    threading.Timer(1.0, cancel.cancel).start()
    t0 = time.monotonic()
    with pytest.raises(Cancelled):
        run_bench(faulty("hang"), [2], ["eager"], device="cpu", out_dir=tmp_path / "c", warmup=1, iters=3,
                  cancel=cancel)
    assert time.monotonic() - t0 < 10


def test_ctrl_c_kills_the_worker_it_waits_for(faulty, tmp_path):
    import _thread

    cfg_path = str(tmp_path / "interrupted.json")

    def running() -> bool:  # a process whose command line names this worker's input
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            with contextlib.suppress(OSError):
                if cfg_path in cmdline.read_text(errors="replace"):
                    return True
        return False

    def interrupt_once_running():
        deadline = time.monotonic() + 20
        while not running() and time.monotonic() < deadline:
            time.sleep(0.1)
        # A moment later, as a user's Ctrl-C comes: an interrupt inside Popen's own start (the worker exists, its
        # handle not yet) cannot be answered by anyone, and on a loaded machine that start takes a while.
        time.sleep(2.0)
        _thread.interrupt_main()

    threading.Thread(target=interrupt_once_running, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        run_worker(worker_cfg(faulty("hang"), "eager"), tmp_path / "interrupted", timeout_s=30)
    assert not running()


def test_compile_memory_budget_reaches_the_partitioner(tiny_mlp):
    # aot_eager_decomp_partition runs the same min-cut partitioner as inductor, without compiling C++. The
    # worker sets the ratio process-wide (it owns its process); here it is restored afterwards.
    cfg = worker_cfg(tiny_mlp, "compile@0.5", compile_backend="aot_eager_decomp_partition")
    with torch._functorch.config.patch(activation_memory_budget=1.0):
        r = run_config(cfg)
    torch._dynamo.reset()
    assert r["status"] == "ok", r["message"]
    assert r["details"]["activation_memory_budget"] == 0.5 and r["warmup"] == 6
    assert r["peak_bytes"] is None  # compiled code allocates out of sight of storage accounting
    assert r["baseline"] == "compile" and math.isfinite(r["loss"])


def test_bench_args_reproduce_the_run():
    spec = tiny_spec("bert", seed=3)
    line = bench_args(spec, [8, 16], ["eager", "rewritten"], budgets=["60%"], device="cuda", out_dir="out dir",
                      warmup=10, iters=20, compile_backend="inductor", fit_budget="16GiB", max_batch=512)
    args = shlex.split(line)
    assert args[:5] == ["acstudio", "bench", "bert", "--batch-size", "8,16"]
    for flag, value in [("--seed", "3"), ("--configs", "eager,rewritten"), ("--budgets", "60%"), ("--out", "out dir"),
                        ("--fit-budget", "16GiB"), ("--max-batch", "512"), ("--config", "num_hidden_layers=2")]:
        assert args[args.index(flag) + 1] == value


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_bench_without_cuda_says_so(tmp_path):
    with pytest.raises(DeviceError, match="--device cpu"):
        run_bench(tiny_spec("bert"), [2], ["eager"], out_dir=tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")
def test_plots_from_a_hand_made_results_file(tmp_path):
    from acstudio.bench import plot_results

    rows = []
    for bs, scale in [(32, 1), (64, 2), (128, 4)]:
        for config, ms, peak in [("eager", 40, 6000), ("per-block", 90, 2800), ("rewritten@50%", 50, 3200)]:
            r = row(config, bs, ms * scale, peak * scale * 2**20)
            r.update(time_ms_q1=ms * scale * 0.95, time_ms_q3=ms * scale * 1.05)
            rows.append(r)
    rows.append(row("compile", 128, None, None, status="oom"))
    meta = {"spec": tiny_spec("resnet18").to_dict(), "device": "cuda", "fit_budget": "16GiB",
            "fit_budget_bytes": 16 * 2**30}
    BenchResults(meta=meta, rows=rows).save(tmp_path / "res")
    paths = plot_results(tmp_path / "res" / "bench.json", tmp_path / "plots")
    assert sorted(p.name for p in paths) == ["memory_vs_overhead.png", "peak_vs_batch.png", "time_vs_batch.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bench_measures_allocator_peaks(tmp_path):
    spec = tiny_spec("bert", batch_size=8, seq_len=64)
    results = run_bench(spec, [8], ["eager", "per-block", "captured"], device="cuda", out_dir=tmp_path, warmup=2,
                        iters=5)
    rows = {r["config"]: r for r in results.rows}
    for r in rows.values():
        assert r["status"] == "ok", r["message"]
        assert r["environment"]["gpu"] == torch.cuda.get_device_name() and not r["environment"]["cudnn_benchmark"]
        assert r["peak_bytes"] % 512 == 0 and r["peak_bytes"] > r["resident_bytes"] > 0
        counts = r["details"]["allocator_during_timing"]
        assert sorted(counts) == ["num_alloc_retries", "num_device_alloc", "num_device_free"]
        assert counts["num_alloc_retries"] == 0 and min(counts.values()) >= 0  # a tiny step never exhausts an H200
    assert rows["per-block"]["peak_bytes"] < rows["eager"]["peak_bytes"]
    assert rows["per-block"]["loss"] == pytest.approx(rows["eager"]["loss"], rel=1e-4)
    # a real allocation failure on the device is a result, not a crash
    (tmp_path / "huge.py").write_text(
        "import torch\n"
        "def loss(model, batch):\n"
        "    return model(batch).sum() + torch.empty(2**45, device='cuda').sum()  # 128 TiB\n"
        "def make(batch_size):\n"
        "    return torch.nn.Linear(4, 4), torch.randn(batch_size, 4), loss\n")
    oom = run_worker({**worker_cfg(WorkloadSpec(f"{tmp_path / 'huge.py'}:make", 2), "eager"), "device": "cuda"},
                     tmp_path / "oom", timeout_s=120)
    assert oom["status"] == "oom" and oom["message"].startswith("does not fit: CUDA out of memory")


def test_per_op_saves_attention_and_every_second_matmul_and_keeps_gradients():
    from torch.utils.checkpoint import CheckpointPolicy

    from acstudio.bench.steps import per_op_policy

    policy, aten = per_op_policy(), torch.ops.aten

    class Ctx:
        is_recompute = False

    decisions = [policy(Ctx, op) for op in (aten.addmm.default, aten.gelu.default, aten.mm.default,
                                            aten._scaled_dot_product_flash_attention_for_cpu.default,
                                            aten.bmm.default, aten.mm.default)]
    save, recompute = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert decisions == [save, recompute, recompute, save, save, recompute]
    Ctx.is_recompute = True  # the recomputation counts its own matmuls: the first one is saved again
    assert policy(Ctx, aten.mm.default) == save

    spec = tiny_spec("bert", batch_size=2)
    plain, selective = build_workload(spec), build_workload(spec)
    contexts = []

    def counted_context():
        contexts.append(1)
        return per_op_context()

    assert enable_per_block(selective, counted_context) == 2
    for w in (plain, selective):  # the same dropout masks: checkpointing replays them with the saved RNG state
        torch.manual_seed(7)
        w.loss_fn(w.model, w.batch).backward()
    for (name, p), q in zip(plain.model.named_parameters(), selective.model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert len(contexts) == 2  # Hugging Face's checkpointing took our policy: one context per layer call


def test_config_registry_names_the_peers_and_budget_references():
    configs = expand_configs(["per-op", "compile+per-block", "compile+per-op", "sac+compile@compile+per-block",
                              "rewritten@per-block*1.15", "fsdp", "fsdp+per-block", "fsdp+sac@fsdp+per-block",
                              "ddp+sac@ddp*0.5"], [])
    assert [c.baseline for c in configs] == ["eager", "compile", "compile", "compile", "captured", None, "fsdp",
                                             "fsdp", "ddp"]
    assert [c.name for c in configs][-3:] == ["fsdp+per-block", "fsdp+sac@fsdp+per-block", "ddp+sac@ddp*0.5"]
    scaled = configs[4].budget_reference
    assert scaled.config == BenchConfig("per-block") and scaled.factor == 1.15
    assert configs[7].budget_reference.config == BenchConfig("per-block", parallel="fsdp")
    assert configs[8].budget_reference.config == BenchConfig("eager", parallel="ddp")
    for bad, why in [("sac", "needs a budget"), ("fsdp+rewritten@50%", "single-device graph"),
                     ("fsdp+sac@per-block", "same parallelism"), ("sac@per-block*-2", "positive"),
                     ("sac@sac@60%", "another planned")]:
        with pytest.raises(ACStudioError, match=why):
            BenchConfig.parse(bad)


def test_sigterm_ends_bench_like_ctrl_c_and_kills_its_worker(faulty, tmp_path):
    """`timeout` and schedulers stop a command with SIGTERM: bench ends as on Ctrl-C, killing the worker it waits
    for and leaving no output folder behind."""
    out = tmp_path / "stopped"
    spec = faulty("hang")
    proc = subprocess.Popen([sys.executable, "-m", "acstudio", "bench", spec.model, "-b", "2", "--device", "cpu",
                             "--configs", "eager", "--out", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)

    def workers() -> list[str]:  # processes whose command line names this bench's output folder, bench excepted
        found = []
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            with contextlib.suppress(OSError):
                if str(out) in cmdline.read_text(errors="replace") and cmdline.parent.name != str(proc.pid):
                    found.append(cmdline.parent.name)
        return found

    deadline = time.monotonic() + 60
    while not workers() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert workers(), "the worker never started"
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "cancelled" in err
    assert not workers() and not out.exists()


def test_sigterm_keeps_the_rows_bench_measured(faulty, tmp_path):
    """A bench stopped by `timeout` after some rows keeps them (bench.json, csv, summary) and says so; only the
    row it was running is lost."""
    out = tmp_path / "stopped"
    spec = faulty("second_process_hangs")
    proc = subprocess.Popen([sys.executable, "-m", "acstudio", "bench", spec.model, "-b", "2", "--device", "cpu",
                             "--configs", "eager,per-block", "--warmup", "1", "--iters", "3", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out / "bench.json").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (out / "bench.json").exists(), "the first row never finished"
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    stdout, err = proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert "the 1 rows it measured are kept" in err and str(out) in err
    kept = BenchResults.load(out)
    assert [(r["config"], r["status"]) for r in kept.rows] == [("eager", "ok")]
    assert (out / "bench.csv").exists() and "eager" in stdout


def test_compile_per_op_regions_runs_the_first_block_alone_and_trains_as_compile_per_op():
    """The regions form (the calibration of an offloading compiled plan's price): the first block compiled on its own
    inside hooks that copy nothing, the model compiled around it, every block handed the mask's bias; it trains as
    compile+per-op, to rounding."""
    spec = tiny_spec("gpt2", config=(("n_layer", "2"), ("n_embd", "32"), ("n_head", "2"), ("vocab_size", "64"),
                                     ("n_positions", "16"), ("resid_pdrop", "0"), ("embd_pdrop", "0"),
                                     ("attn_pdrop", "0")))
    rows = {}
    for config in ("compile+per-op", "compile+per-op+regions"):
        rows[config] = run_config(worker_cfg(spec, config, compile_backend="aot_eager"))
        torch._dynamo.reset()
        assert rows[config]["status"] == "ok", rows[config]["message"]
        assert rows[config]["baseline"] == "compile"
    regions = rows["compile+per-op+regions"]
    assert regions["details"]["compiled"] == "transformer.h.0 alone, the loop eager, the mask's bias made once"
    assert regions["details"]["mask_bias"] is True  # GPT-2's SDPA attention: its blocks take the bias
    assert regions["details"]["checkpointed_blocks"] == rows["compile+per-op"]["details"]["checkpointed_blocks"] == 2
    assert regions["loss"] == pytest.approx(rows["compile+per-op"]["loss"], rel=1e-5)
    assert not BenchConfig.parse("compile+per-op+regions").spec.parallel_ok


def compiled_graphs_ops(workload, compile_blocks) -> list[set[str]]:
    """The ops of each graph Dynamo compiles in one training step of ``workload`` after ``compile_blocks(backend)``,
    which compiles (parts of) its model with the recording backend and returns the model to run."""
    graphs = []

    def recording(gm, example_inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return gm.forward

    torch._dynamo.reset()
    workload.loss_fn(compile_blocks(recording), workload.batch).backward()
    torch._dynamo.reset()
    return graphs


def assert_attention_only_in_checkpoints(graphs: list[set[str]]) -> None:
    """Some graph holds a checkpoint Dynamo traced, and none calls attention outside one."""
    assert any(any("tag_activation_checkpoint" in t for t in g) for g in graphs), graphs
    assert not any("scaled_dot_product_attention" in t for g in graphs for t in g), graphs


def test_the_regions_form_compiles_each_blocks_checkpoint_with_the_block():
    """Every block's attention runs inside a checkpoint that Dynamo traced (``tag_activation_checkpoint``), as a
    plan's regions do. With transformers 5.17 the form once left Hugging Face's checkpoint, which wraps a layer's
    ``__call__``, eager around each compiled block."""
    spec = tiny_spec("gpt2", config=(("n_layer", "3"), ("n_embd", "32"), ("n_head", "2"), ("vocab_size", "64"),
                                     ("n_positions", "16")))
    workload = build_workload(spec)

    def regions(backend):
        assert per_op_as_regions(workload, backend) == (
            3, "transformer.h.0 alone, the loop eager, the mask's bias made once", True)
        return torch.compile(workload.model, backend=backend)

    assert_attention_only_in_checkpoints(compiled_graphs_ops(workload, regions))


def test_blocks_compiled_alone_compile_their_checkpoint_with_them():
    """Under FSDP2/DDP the peers' blocks are compiled one by one (``block.compile()``, torchtitan's regional
    compilation); their checkpoint is in each block's forward, so it compiles with the block, as torchtitan's
    does, whatever the transformers release."""
    workload = build_workload(tiny_spec("gpt2"))
    config = BenchConfig.parse("ddp+compile+per-block")
    assert blocks_compiled_alone(Request(config, workload.spec, torch.device("cpu"), dist=object()))
    assert not blocks_compiled_alone(Request(BenchConfig.parse("compile+per-block"), workload.spec,
                                             torch.device("cpu")))

    def each_block(backend):
        assert enable_per_block(workload, in_forward=True) == 2
        for block in find_blocks(workload):
            block.compile(backend=backend)
        return workload.model

    assert_attention_only_in_checkpoints(compiled_graphs_ops(workload, each_block))
