"""Every benchmark row trains what eager trains: the bench compares each row's per-step losses with eager's at the same
batch size and marks a row that diverges (bitwise on the CPU, within a stated tolerance elsewhere)."""

import pytest
import torch
from conftest import TINY_GPT2, tiny_spec

from acstudio.bench import BenchConfig, BenchResults, compare
from acstudio.bench.results import PARITY_STEPS, PARITY_TOLERANCE, loss_parity
from acstudio.bench.worker import run_config
from acstudio.workload import WorkloadSpec

NO_DROPOUT = ("resid_pdrop=0", "embd_pdrop=0", "attn_pdrop=0")


class TinyViT(torch.nn.Module):
    """A vision transformer at its smallest: 8x8 patches of a 32x32 image, two pre-norm encoder layers (numbered
    blocks, as planners and checkpointing find them), no dropout."""

    def __init__(self, width: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.patches = torch.nn.Conv2d(3, width, kernel_size=8, stride=8)
        self.cls = torch.nn.Parameter(torch.zeros(1, 1, width))
        self.position = torch.nn.Parameter(0.02 * torch.randn(1, 17, width))
        layer = torch.nn.TransformerEncoderLayer(width, 2, 2 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        tokens = self.patches(images).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.cls.expand(len(tokens), -1, -1), tokens], dim=1) + self.position
        return self.head(self.norm(self.encoder(tokens))[:, 0])


def tiny_vit(batch_size):
    torch.manual_seed(0)
    batch = (torch.randn(batch_size, 3, 32, 32), torch.randint(0, 10, (batch_size,)))
    return TinyViT(), batch, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])


def bench_rows(spec: WorkloadSpec, configs: list[str], profile_path) -> list[dict]:
    """The rows ``acstudio bench`` records for ``configs`` (its worker's own functions, in this process): planned
    configurations profile and plan first, as the runner has their planning worker do."""
    rows = []
    for name in configs:
        cfg = {"spec": spec.to_dict(), "config": name, "device": "cpu", "warmup": 1, "iters": 3,
               "profile_path": str(profile_path)}
        if BenchConfig.parse(name).spec.planner:
            planned = run_config(cfg | {"task": "plan"})
            assert planned["status"] == "ok", planned["message"]
        rows.append(run_config(cfg))
    return compare(rows)


@pytest.mark.parametrize(("spec", "configs"), [
    # SGD: with Adam's state on top of the weights ResNet-18's peak is the update's at any image size this small;
    # per-op's policy runs Python for every op (seconds a step on a CPU): on GPT-2, whose blocks it was made for
    (tiny_spec("resnet18", image_size=64, batch_size=8, optimizer="sgd", config=(("num_classes", "10"),)),
     ["eager", "captured", "rewritten@90%", "sac@90%"]),
    (WorkloadSpec("test_bench_parity:tiny_vit", batch_size=8), ["eager", "captured", "rewritten@70%", "sac@70%"]),
    (tiny_spec("gpt2", config=tuple(tuple(c.split("=")) for c in TINY_GPT2 + NO_DROPOUT)),
     ["eager", "captured", "rewritten@50%", "sac@50%", "per-op"]),
], ids=["resnet18", "vit", "gpt2"])
def test_every_row_trains_bitwise_like_eager_on_the_cpu(tmp_path, spec, configs):
    rows = {r["config"]: r for r in bench_rows(spec, configs, tmp_path / "profile.json.gz")}
    eager = rows.pop("eager")
    assert eager["status"] == "ok", eager["message"]
    assert len(eager["losses"]) == 5 and len(set(eager["losses"])) > 1  # warm-up, peak step, 3 timed; it trains
    assert eager["loss_check"] is None
    for name, row in rows.items():
        assert row["status"] == "ok", f"{name}: {row['message']}"
        if "@" in name:  # a plan that changes the step: it recomputes something
            assert row["details"]["recomputed_activations"] > 0, name
        check = row["loss_check"]
        assert check["reference"] == "eager" and check["rule"] == "bitwise" and check["steps"] == 5
        assert check["passed"], f"{name}: {row['loss_parity']}"
        assert row["losses"] == eager["losses"] and row["loss_parity"] == "bitwise"


def row(config, losses, device="cpu", precision="fp32"):
    return {"config": config, "kind": BenchConfig.parse(config).kind, "arg": None, "baseline": "eager",
            "parallel": BenchConfig.parse(config).parallel, "batch_size": 4, "device": device, "status": "ok",
            "message": "", "spec": {"model": "m", "precision": precision}, "losses": losses, "loss": losses[-1],
            "peak_bytes": 100, "time_ms_median": 1.0, "time_ms_iqr": 0.1, "phase": "sweep"}


def test_a_diverging_row_is_marked_in_the_table_and_the_json():
    eager = [2.0, 1.5, 1.2, 1.1]
    results = BenchResults(meta={}, rows=[
        row("eager", eager), row("captured", eager), row("rewritten@50%", [2.0, 1.6, 1.3, 1.2]),
        row("compile", [2.0, 1.5, 1.2, 1.1, 1.05, 1.0]), row("compile+per-block", [2.0, 1.5, 1.2, 1.1, 1.05])])
    checks = {c["config"]: c for c in results.to_dict()["loss_checks"]}
    assert set(checks) == {"captured", "rewritten@50%", "compile+per-block"}  # plain compile is a reference
    assert checks["captured"]["passed"] and checks["captured"]["rule"] == "bitwise"
    assert checks["rewritten@50%"]["first_divergence"] == {"step": 1, "loss": 1.6, "reference_loss": 1.5}
    compiled = checks["compile+per-block"]
    assert compiled["reference"] == "compile" and compiled["steps"] == PARITY_STEPS and compiled["passed"]
    assert compiled["rule"] == "relative 0.001 on the first step, 0.01 on the next 3"
    summary = results.summary()
    assert "| rewritten@50% | ok |" in summary and "DIVERGES at step 2: 1.6 vs 1.5 |" in summary
    assert "| captured | ok |" in summary and "| bitwise |" in summary
    assert ("losses: every step's loss against compile's, relative 0.001 on the first step, 0.01 on the next 3; "
            "eager's, bitwise") in summary
    frame = results.to_frame().set_index("config")
    assert frame.loc["rewritten@50%", "loss_parity"].startswith("DIVERGES")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_on_a_gpu_losses_agree_within_the_stated_tolerance(precision):
    first, later = PARITY_TOLERANCE[precision]
    eager = row("eager", [4.0, 3.0, 2.0], "cuda", precision)

    def check(losses):
        return loss_parity(row("per-block", losses, "cuda", precision), eager)

    assert check([4.0 * (1 + 0.9 * first), 3.0 * (1 - 0.9 * later), 2.0])["passed"]
    assert not check([4.0 * (1 + 1.1 * first), 3.0, 2.0])["passed"]  # the first step is held tighter
    assert not check([4.0, 3.0, 2.0 * (1 + 1.1 * later)])["passed"]
    # a parallel row is compared with the same parallelism without checkpointing, never with one device's eager
    fsdp = row("fsdp", [4.0, 3.0], "cuda", precision) | {"parallel": "fsdp"}
    sharded = row("fsdp+per-block", [4.0, 3.0], "cuda", precision) | {"parallel": "fsdp"}
    compared = {r["config"]: r for r in compare([eager, fsdp, sharded])}
    assert compared["fsdp+per-block"]["loss_check"]["reference"] == "fsdp"
    assert compared["fsdp"]["loss_check"] is None
    # a compiled row reproduces plain compile (inductor draws its own dropout masks), not eager
    compiled = row("compile", [4.5, 3.5], "cuda", precision)
    planned = row("sac+compile@compile+per-op", [4.5, 3.5], "cuda", precision)
    compared = {r["config"]: r for r in compare([eager, compiled, planned])}
    assert compared["sac+compile@compile+per-op"]["loss_check"]["reference"] == "compile"
    assert compared["sac+compile@compile+per-op"]["loss_check"]["passed"]


def test_rounded_parity_covers_the_first_steps_only():
    """Past the first steps rounding differences grow chaotically, so a GPU row is held to the first
    PARITY_STEPS losses; on the CPU an uncompiled row is bitwise on every step."""
    drift = [4.0, 3.0, 2.0, 1.5, 1.0, 9.0]
    gpu = loss_parity(row("per-block", drift, "cuda", "fp32"), row("eager", [4.0, 3.0, 2.0, 1.5, 1.0, 1.0], "cuda",
                                                                   "fp32"))
    assert gpu["passed"] and gpu["steps"] == PARITY_STEPS
    cpu = loss_parity(row("per-block", drift, "cpu", "fp32"), row("eager", [4.0, 3.0, 2.0, 1.5, 1.0, 1.0], "cpu",
                                                                  "fp32"))
    assert not cpu["passed"] and cpu["first_divergence"]["step"] == 5
