"""The command line: thin wrappers over the engine, one-line errors with exit status 2."""

from pathlib import Path

import pytest

from acstudio import __version__
from acstudio.cli import main
from acstudio.plan.loading import load_plan
from acstudio.profile.model import Profile

SAMPLE = Path(__file__).resolve().parent.parent / "sample_profiles" / "cpu_resnet18_bs16_sgd.json.gz"


def test_version_and_models(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert __version__ in capsys.readouterr().out
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "resnet152" in out and "bert" in out and "gpt2-cls" in out


def test_plan_verify_export_round_trip(tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    assert main(["plan", str(SAMPLE), "--budget", "85%", "--out", str(plan_path),
                 "--schedule", str(tmp_path / "sched")]) == 0
    profile = Profile.load(SAMPLE)
    plan = load_plan(plan_path, profile=profile)
    assert plan.feasible and plan.recomputed and plan.predicted_peak_bytes <= 0.85 * profile.peak_bytes + 1
    assert (tmp_path / "sched" / "schedule.csv").is_file()
    assert main(["verify", str(SAMPLE), "--plan", str(plan_path), "--json", str(tmp_path / "v.json")]) == 0
    assert "PASSED" in capsys.readouterr().out
    assert main(["export", str(SAMPLE), "--plan", str(plan_path), "--out", str(tmp_path / "exp")]) == 0
    assert {p.name for p in (tmp_path / "exp").iterdir()} >= {"step.py", "manifest.json", "report.md"}


def test_errors_are_one_line_with_status_2(tmp_path, capsys):
    assert main(["plan", str(SAMPLE), "--budget", "lots"]) == 2
    assert "cannot read the memory budget 'lots'" in capsys.readouterr().err
    assert main(["profile", "resnet5o", "-b", "2", "--device", "cpu", "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'resnet5o'" in err and "resnet50" in err
    assert not (tmp_path / "p.json").exists()
    corrupt = tmp_path / "corrupt.json.gz"
    corrupt.write_bytes(b"garbage")
    assert main(["plan", str(corrupt), "--budget", "1GiB"]) == 2
    assert "not a readable acstudio.profile file" in capsys.readouterr().err
    # a budget below the floor is an answer (infeasible plan reporting the floor), not a crash
    assert main(["plan", str(SAMPLE), "--budget", "1MiB"]) == 1
    assert "INFEASIBLE" in capsys.readouterr().out


def test_plan_for_a_replay_mode(tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    assert main(["plan", str(SAMPLE), "--budget", "95%", "--mode", "sac", "--out", str(plan_path)]) == 0
    assert "selective checkpointing per block" in capsys.readouterr().out
    plan = load_plan(plan_path, profile=Profile.load(SAMPLE))
    assert plan.replay_mode == "sac" and plan.feasible and plan.recomputed


def test_a_plan_for_one_rank_is_exported_for_that_rank(tmp_path, capsys):
    """SAC wraps more for one FSDP2 rank (its head and norm run eager): export needs the plan's --fsdp."""
    llama, plan_path = "sample_profiles/h200_llama_bs8_bf16_adamw.json.gz", tmp_path / "plan.json"
    assert main(["plan", llama, "--fsdp", "2", "--budget", "4755MiB", "--mode", "sac", "--out", str(plan_path)]) == 0
    assert main(["export", llama, "--plan", str(plan_path), "--format", "sac", "--out", str(tmp_path / "x")]) == 2
    assert "made with --fsdp N or --ddp N, is read with the same option" in capsys.readouterr().err
    assert main(["export", llama, "--plan", str(plan_path), "--fsdp", "2", "--format", "sac",
                 "--out", str(tmp_path / "rank")]) == 0
    from acstudio.export.sac import SacPolicy

    assert "lm_head" in SacPolicy.load(tmp_path / "rank").blocks
