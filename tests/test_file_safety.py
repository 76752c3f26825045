"""No command loses or changes a file it did not create: an output may be new or an earlier output of the same
kind, never an input, a user's file or a folder AC Studio did not write; a refused, failed or cancelled command
leaves nothing behind; bad option values are refused with the valid range before any work; user code that exits
and a display that cannot open end in one line of our own."""

import errno
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import TINY_CNN

from acstudio.cli import main
from acstudio.plan.solvers import plan as make_plan
from acstudio.profile.model import Profile

SAMPLE = Path(__file__).resolve().parent.parent / "sample_profiles" / "cpu_resnet18_bs16_sgd.json.gz"
TINY_MODEL = """import torch

def make(batch_size):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, torch.randn(batch_size, 8), lambda m, b: m(b).square().mean()
"""


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A plan of the CPU sample, an export of it and a profile of the tiny model, made once."""
    folder = tmp_path_factory.mktemp("made")
    profile = Profile.load(SAMPLE)
    make_plan(profile, int(0.85 * profile.peak_bytes)).save(folder / "plan.json")
    assert main(["export", str(SAMPLE), "--plan", str(folder / "plan.json"), "--out", str(folder / "export")]) == 0
    assert main(["plan", str(SAMPLE), "--budget", "85%", "--schedule", str(folder / "schedule")]) == 0
    (folder / "tiny.py").write_text(TINY_MODEL)
    assert main(["profile", f"{folder / 'tiny.py'}:make", "-b", "2", "--device", "cpu",
                 "--out", str(folder / "tiny.json")]) == 0
    assert main(["plan", str(folder / "tiny.json"), "--budget", "90%", "--solver", "mutwo",
                 "--out", str(folder / "tiny_plan.json")]) in (0, 1)  # 1: infeasible, written all the same
    return folder


@pytest.fixture
def work(tmp_path, monkeypatch, made):
    """The current folder, holding the inputs: profile.json.gz, plan.json, tiny.py and a user's notes.txt."""
    shutil.copy(SAMPLE, tmp_path / "profile.json.gz")
    shutil.copy(made / "plan.json", tmp_path / "plan.json")
    (tmp_path / "tiny.py").write_text(TINY_MODEL)
    (tmp_path / "notes.txt").write_text("the user's notes")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def snapshot(root: Path) -> dict[str, tuple[bytes, int] | None]:
    """Every path under ``root``: a file's bytes and modification time, ``None`` for a folder."""
    out = {}
    for path in root.rglob("*"):
        key = str(path.relative_to(root)) + (" -> " + os.readlink(path) if path.is_symlink() else "")
        if path.is_symlink() or not path.is_file():
            out[key] = None
        else:
            out[key] = (path.read_bytes(), path.stat().st_mtime_ns)
    return out


def run(argv) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse refuses from inside parse_args
        return exc.code


def refused(argv, root: Path, capsys, expect: str) -> None:
    """``argv`` fails with one line holding ``expect``, and nothing under ``root`` is created, changed or lost."""
    before = snapshot(root)
    assert run(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip() and not line.startswith("[")]
    assert len(lines) == 1 and lines[0].startswith("acstudio: error: ") and "Traceback" not in err, err
    assert expect in lines[0], lines[0]
    assert snapshot(root) == before


def earlier_export(root: Path, made: Path, name: str = "exp") -> Path:
    shutil.copytree(made / "export", root / name)
    return root / name


EXPORT = ["export", "profile.json.gz", "--plan", "plan.json", "--out"]
PLAN = ["plan", "profile.json.gz", "--budget", "85%"]
PROFILE = ["profile", "tiny.py:make", "-b", "2", "--device", "cpu"]


# -- export folders --------------------------------------------------------------------------------------------
def test_an_earlier_export_with_the_users_notes_is_refused(work, made, capsys):
    (earlier_export(work, made) / "notes.md").write_text("mine")
    refused([*EXPORT, "exp"], work, capsys, "also holds notes.md")


def test_force_replaces_an_earlier_export_with_added_files_and_nothing_else(work, made, capsys):
    (earlier_export(work, made) / "notes.md").write_text("mine")
    before = snapshot(work)
    assert run([*EXPORT, "exp", "--force"]) == 0
    after = snapshot(work)
    assert "exp/notes.md" not in after and "exp/contents.json" in after
    assert {k: v for k, v in before.items() if not k.startswith("exp")} == \
        {k: v for k, v in after.items() if not k.startswith("exp")}


def test_an_earlier_export_holding_nothing_else_is_replaced(work, made):
    earlier_export(work, made)
    assert run([*EXPORT, "exp"]) == 0
    listed = json.loads((work / "exp" / "contents.json").read_text())["files"]
    assert sorted(listed) == sorted(p.name for p in (work / "exp").iterdir())


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_the_folder_holding_the_inputs_is_never_replaced(work, capsys, force):
    refused([*EXPORT, ".", *force], work, capsys, "holds the current folder")
    refused(["export", "in/profile.json.gz", "--plan", "in/plan.json", "--out", "in", *force],
            _move_inputs_into(work, "in"), capsys, "an input of this command")


def _move_inputs_into(work: Path, name: str) -> Path:
    (work / name).mkdir()
    shutil.copy(work / "profile.json.gz", work / name)
    shutil.copy(work / "plan.json", work / name)
    return work


def test_an_earlier_export_that_holds_an_input_is_kept_even_with_force(work, made, capsys):
    shutil.copy(work / "plan.json", earlier_export(work, made) / "plan.json")
    refused(["export", "profile.json.gz", "--plan", "exp/plan.json", "--out", "exp", "--force"], work, capsys,
            "an input of this command")


def test_a_users_folder_is_refused_even_with_force(work, capsys):
    (work / "mine").mkdir()
    (work / "mine" / "data.csv").write_text("1,2")
    refused([*EXPORT, "mine", "--force"], work, capsys, "AC Studio did not write (it holds data.csv)")


def test_a_users_folder_named_like_the_backup_survives(work, made):
    earlier_export(work, made)
    (work / ".exp.old").mkdir()
    (work / ".exp.old" / "keep.txt").write_text("not a backup of ours")
    before = snapshot(work)
    assert run([*EXPORT, "exp"]) == 0
    after = snapshot(work)
    assert after[".exp.old/keep.txt"] == before[".exp.old/keep.txt"]
    assert {k for k in after if not k.startswith("exp/")} == {k for k in before if not k.startswith("exp/")}


def test_export_onto_a_file_is_refused(work, capsys):
    refused([*EXPORT, "notes.txt"], work, capsys, "is not a folder")


def test_export_through_a_symlink_to_a_users_folder_is_refused(work, capsys):
    (work / "mine").mkdir()
    (work / "mine" / "data.csv").write_text("1,2")
    (work / "link").symlink_to("mine")
    refused([*EXPORT, "link", "--force"], work, capsys, "did not write")


def test_export_through_a_symlink_to_an_earlier_export_keeps_the_link(work, made):
    earlier_export(work, made, "real")
    (work / "link").symlink_to("real")
    assert run([*EXPORT, "link"]) == 0
    assert (work / "link").is_symlink() and (work / "real" / "contents.json").is_file()


def test_a_read_only_earlier_export_is_kept(work, made, capsys):
    folder = earlier_export(work, made)
    folder.chmod(0o555)
    try:
        refused([*EXPORT, "exp"], work, capsys, "is read-only")
    finally:
        folder.chmod(0o755)


def test_a_full_disk_during_export_keeps_the_earlier_export(work, made, capsys, monkeypatch):
    earlier_export(work, made)
    from acstudio.export import step_module

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(step_module, "report_text", disk_full)
    refused([*EXPORT, "exp"], work, capsys, "No space left on device")


def test_format_lists_without_a_format_are_refused_before_any_work(work, capsys):
    refused([*EXPORT, "exp", "--format", ",,,"], work, capsys, "no format in ',,,' — choose from")
    refused([*EXPORT, "exp", "--format", "step,pdf"], work, capsys, "unknown format 'pdf'")


def test_two_exports_into_one_folder_at_once_leave_one_whole_export(work, made):
    argv = [sys.executable, "-m", "acstudio", "export", str(made / "tiny.json"), "--plan", str(made / "tiny_plan.json"),
            "--out", "exp"]
    procs = [subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    codes = [p.wait(timeout=300) for p in procs]
    assert 0 in codes
    listed = json.loads((work / "exp" / "contents.json").read_text())["files"]
    assert sorted(listed) == sorted(p.name for p in (work / "exp").iterdir())
    assert sorted(p.name for p in work.iterdir()) == ["exp", "notes.txt", "plan.json", "profile.json.gz", "tiny.py"]


# -- plan, verify and profile files ----------------------------------------------------------------------------
def test_plan_out_naming_its_input_profile_is_refused(work, capsys):
    refused([*PLAN, "--out", "profile.json.gz"], work, capsys, "is the input profile.json.gz")


def test_plan_out_through_a_symlink_or_hard_link_to_the_input_is_refused(work, capsys):
    (work / "soft.json.gz").symlink_to("profile.json.gz")
    os.link(work / "profile.json.gz", work / "hard.json.gz")
    refused([*PLAN, "--out", "soft.json.gz"], work, capsys, "input profile.json.gz")
    refused([*PLAN, "--out", "hard.json.gz"], work, capsys, "input profile.json.gz")


@pytest.mark.parametrize("victim", ["notes.txt", "tiny.py"])
def test_plan_out_naming_a_users_file_is_refused(work, capsys, victim):
    refused([*PLAN, "--out", victim], work, capsys, "is not an earlier plan")


def test_plan_out_naming_another_kind_of_acstudio_file_is_refused(work, capsys):
    shutil.copy(work / "profile.json.gz", work / "other.json.gz")
    refused([*PLAN, "--out", "other.json.gz"], work, capsys, "is not an earlier plan")


def test_plan_out_replaces_an_earlier_plan_and_nothing_else(work):
    before = snapshot(work)
    assert run([*PLAN, "--out", "new.json"]) == 0
    shutil.copy(work / "new.json", work / "earlier.json")
    assert run([*PLAN, "--out", "earlier.json"]) == 0
    after = snapshot(work)
    assert {k: v for k, v in after.items() if k in before} == before


def test_plan_out_through_a_symlink_writes_its_target(work):
    shutil.copy(work / "plan.json", work / "real.json")
    (work / "link.json").symlink_to("real.json")
    (work / "dangling.json").symlink_to("absent.json")
    assert run([*PLAN, "--out", "link.json"]) == 0
    assert run([*PLAN, "--out", "dangling.json"]) == 0
    assert (work / "link.json").is_symlink() and (work / "dangling.json").is_symlink()
    assert json.loads((work / "absent.json").read_text())["schema"] == "acstudio.plan"


def test_plan_out_naming_a_pipe_is_refused_without_reading_it(work, capsys):
    os.mkfifo(work / "pipe")
    refused([*PLAN, "--out", "pipe"], work, capsys, "pipe is not a regular file")


def test_a_read_only_earlier_plan_is_kept(work, capsys):
    (work / "plan.json").chmod(0o444)
    refused(["plan", "profile.json.gz", "--budget", "80%", "--out", "plan.json"], work, capsys, "is read-only")


def test_plan_sweep_out_naming_a_users_csv_is_refused(work, capsys):
    (work / "table.csv").write_text("a,b\n1,2\n")
    refused(["plan", "profile.json.gz", "--sweep", "--out", "table.csv"], work, capsys, "not an earlier sweep table")


def test_plan_schedule_keeps_a_users_schedule_json(work, capsys):
    (work / "sched").mkdir()
    (work / "sched" / "schedule.json").write_text('{"my": "timetable"}')
    refused([*PLAN, "--schedule", "sched"], work, capsys, "sched/schedule.json exists and is not an earlier schedule")


def test_plan_schedule_replaces_an_earlier_schedule_beside_other_files(work, made):
    shutil.copytree(made / "schedule", work / "sched")
    (work / "sched" / "readme.txt").write_text("the user's")
    before = snapshot(work)
    assert run([*PLAN, "--schedule", "sched"]) == 0
    after = snapshot(work)
    assert after["sched/readme.txt"] == before["sched/readme.txt"] and after["notes.txt"] == before["notes.txt"]


def test_plan_out_inside_its_own_schedule_files_is_refused(work, capsys):
    refused([*PLAN, "--out", "sched/schedule.json", "--schedule", "sched"], work, capsys, "give each its own name")


def test_a_full_disk_while_planning_leaves_no_file(work, capsys, monkeypatch):
    from acstudio.plan.model import Plan

    def disk_full(self, directory):
        Path(directory).mkdir(parents=True, exist_ok=True)
        Path(directory, "schedule.json").write_text("half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Plan, "export_schedule", disk_full)
    refused([*PLAN, "--out", "new/p.json", "--schedule", "sched"], work, capsys, "No space left on device")


def test_ctrl_c_while_saving_a_plan_leaves_no_file(work, capsys, monkeypatch):
    from acstudio.plan.model import Plan

    def interrupted(self, path):
        Path(path).write_text("half")
        raise KeyboardInterrupt

    monkeypatch.setattr(Plan, "save", interrupted)
    before = snapshot(work)
    assert run([*PLAN, "--out", "p.json"]) == 130
    assert snapshot(work) == before


def test_two_plans_written_to_one_file_at_once_leave_one_whole_plan(work):
    from acstudio.plan.model import Plan

    profile = Profile.load(work / "profile.json.gz")
    plans = [make_plan(profile, int(f * profile.peak_bytes)) for f in (0.8, 0.9)]
    threads = [threading.Thread(target=p.save, args=(work / "same.json",)) for p in plans * 5]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert Plan.load(work / "same.json").budget_bytes in {p.budget_bytes for p in plans}
    assert sorted(p.name for p in work.iterdir()) == ["notes.txt", "plan.json", "profile.json.gz", "same.json",
                                                     "tiny.py"]


@pytest.mark.parametrize("victim", ["profile.json.gz", "plan.json"])
def test_verify_json_naming_an_input_is_refused(work, capsys, victim):
    refused(["verify", "profile.json.gz", "--plan", "plan.json", "--json", victim], work, capsys,
            f"is the input {victim}")


def test_profile_out_and_csv_on_one_path_are_refused_before_profiling(work, capsys):
    refused([*PROFILE, "--out", "X", "--csv", "X"], work, capsys, "give each its own name")


def test_profile_out_naming_the_model_file_is_refused(work, capsys):
    refused([*PROFILE, "--out", "tiny.py"], work, capsys, "is the input tiny.py")


def test_profile_csv_keeps_a_users_nodes_csv(work, capsys):
    (work / "tables").mkdir()
    (work / "tables" / "nodes.csv").write_text("name,colour\n")
    refused([*PROFILE, "--out", "p.json", "--csv", "tables"], work, capsys, "not an earlier node table")


def test_a_full_disk_while_saving_a_profile_leaves_no_file(work, capsys, monkeypatch):
    import acstudio.fileio

    real_replace = os.replace

    def disk_full(src, dst):
        if str(dst).endswith("activations.csv"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(acstudio.fileio.os, "replace", disk_full)
    refused([*PROFILE, "--out", "p.json", "--csv", "tables"], work, capsys, "No space left on device")


# -- bench folders ---------------------------------------------------------------------------------------------
BENCH = ["bench", "tiny.py:make", "-b", "2", "--device", "cpu", "--configs", "eager"]


def test_bench_into_a_users_folder_is_refused(work, capsys):
    (work / "results").mkdir()
    (work / "results" / "thesis.tex").write_text("chapter 1")
    refused([*BENCH, "--out", "results"], work, capsys, "did not write (it holds thesis.tex)")


@pytest.mark.parametrize("failure", [KeyboardInterrupt, OSError(errno.ENOSPC, "No space left on device")])
def test_a_cancelled_or_failed_bench_leaves_nothing(work, capsys, monkeypatch, failure):
    import acstudio.bench

    def partial(spec, batch_sizes, configs, budgets, *, out_dir, **kwargs):
        Path(out_dir, "workers").mkdir(parents=True)
        Path(out_dir, "workers", "000_eager_bs2.json").write_text("{}")
        raise failure

    monkeypatch.setattr(acstudio.bench, "run_bench", partial)
    before = snapshot(work)
    assert run([*BENCH, "--out", "results"]) in (2, 130)
    assert snapshot(work) == before
    (work / "earlier").mkdir()
    (work / "earlier" / "bench.csv").write_text("config\n")
    before = snapshot(work)
    assert run([*BENCH, "--out", "earlier"]) in (2, 130)
    assert snapshot(work) == before  # the earlier benchmark's files stay, this run's are gone


def test_bench_plot_keeps_a_users_png(work, capsys):
    (work / "plots").mkdir()
    (work / "plots" / "peak_vs_batch.png").write_bytes(b"\x89PNG\r\n\x1a\n holiday photo")
    refused(["bench-plot", "plots", "--out", "plots"], work, capsys, "not an earlier plot")


# -- option values ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("argv", "expect"), [
    ([*PLAN, "--budget", "1e20GiB", "--out", "p.json"], "from 1B to 8192TiB"),
    (["plan", "profile.json.gz", "--budget", "85%", "--compiled-per-block-peak", "5GiB", "--out", "p.json"],
     "is above this profile's peak without checkpointing"),
    ([*PLAN, "--fsdp", str(2**64)], "--fsdp: expected a whole number from 1 to 65536"),
    ([*BENCH, "--timeout", "0", "--out", "b"], "--timeout: expected a number above 0"),
    ([*BENCH, "--timeout", "nan", "--out", "b"], "--timeout: expected a number above 0"),
    ([*BENCH, "--lr", "nan", "--out", "b"], "--lr: expected a number from 0 (finite)"),
    ([*BENCH, "--lr", "inf", "--out", "b"], "--lr: expected a number from 0 (finite)"),
    ([*PROFILE, "--momentum", "-1", "--out", "p.json"], "--momentum: expected a number from 0"),
    ([*PROFILE, "--betas", "0.9,1.5", "--out", "p.json"], "each beta must be from 0 to below 1"),
    ([*BENCH, "--seed", "-1", "--out", "b"], "--seed: expected a whole number from 0"),
    ([*BENCH, "--warmup", "0", "--out", "b"], "--warmup: expected a whole number from 1"),
    ([*BENCH, "--nproc", str(2**64), "--out", "b"], "--nproc: expected a whole number from 1 to 1024"),
    ([*PROFILE[:2], "-b", "0", "--out", "p.json"], "--batch-size/-b: expected a whole number from 1"),
    (["bench", "tiny.py:make", "-b", "2", "--device", "cpu", "--budgets", "nan%", "--out", "b"],
     "cannot read the memory budget 'nan%'"),
    ([*BENCH[:-1], "rewritten@1e20GiB", "--out", "b"], "from 1B to 8192TiB"),
    ([*BENCH[:-1], "rewritten@per-block*inf", "--out", "b"], "the factor after '*' must be a positive number"),
    ([*EXPORT, "exp", "--fsdp", "0"], "--fsdp: expected a whole number from 1 to 65536"),
])
def test_absurd_option_values_are_refused_with_the_valid_range(work, capsys, argv, expect):
    refused(argv, work, capsys, expect)


# -- clean exits -----------------------------------------------------------------------------------------------
EXITING_LOSS = TINY_MODEL.replace("m(b).square().mean()", "__import__('sys').exit(0)")


@pytest.mark.parametrize(("source", "expect"), [
    ("import sys\nsys.exit(3)\n", "importing exits.py called sys.exit(3)"),
    ("def make(batch_size):\n    raise SystemExit('no GPU')\n", "exits.py:make(2) called sys.exit('no GPU')"),
    (EXITING_LOSS, "exits.py:make: the model's code called sys.exit(0)"),
])
def test_user_code_that_exits_ends_in_one_line_naming_the_model_file(work, capsys, source, expect):
    (work / "exits.py").write_text(source)
    refused(["profile", "exits.py:make", "-b", "2", "--device", "cpu", "--out", "p.json"], work, capsys, expect)


def test_a_process_whose_model_exits_with_0_still_reports_and_fails(work):
    (work / "exits.py").write_text(EXITING_LOSS)
    proc = subprocess.run([sys.executable, "-m", "acstudio", "profile", "exits.py:make", "-b", "2", "--device", "cpu",
                           "--out", "p.json"], capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stderr.replace("\r", "\n").splitlines() if line.strip() and line[0] != "["]
    assert proc.returncode == 2 and len(lines) == 1 and "called sys.exit(0)" in lines[0], proc.stderr
    assert not (work / "p.json").exists()


def _app(args, **env_changes):
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    env.update(env_changes)
    return subprocess.run([sys.executable, "-m", "acstudio", *args], capture_output=True, text=True, timeout=120,
                          env=env)


@pytest.mark.parametrize(("env", "expect"), [
    ({"QT_QPA_PLATFORM": "bogus"}, "QT_QPA_PLATFORM=bogus names no Qt platform plugin here"),
    ({}, "DISPLAY is not set"),
    ({"QT_QPA_PLATFORM": "xcb"}, "DISPLAY is not set"),
])
@pytest.mark.skipif(sys.platform != "linux", reason="X11 and Wayland are how Linux opens windows")
def test_a_missing_display_or_platform_gets_our_one_line(env, expect):
    proc = _app([], **env)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and expect in proc.stderr, proc.stderr


def test_a_screenshot_under_a_file_fails_at_once(work):
    proc = _app(["--screenshot", "notes.txt/shot.png"], QT_QPA_PLATFORM="offscreen")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--screenshot" in proc.stderr, proc.stderr
    proc = _app(["--screenshot", "notes.txt"], QT_QPA_PLATFORM="offscreen")
    assert proc.returncode == 2 and "not an earlier screenshot" in proc.stderr
    assert (work / "notes.txt").read_text() == "the user's notes"


# -- a rerun replaces its own outputs ------------------------------------------------------------------------------
def test_every_command_run_twice_replaces_its_own_outputs(work):
    """Each kind recognises what its writer writes, so running a command again is never refused."""
    from acstudio.bench.results import BenchResults

    BenchResults(meta={"spec": {"model": "tiny"}, "device": "cpu", "batch_sizes": []}).save(work / "bench")
    commands = [
        [*PROFILE, "--iterations", "3", "--out", "tiny.json", "--csv", "tables"],
        ["plan", "tiny.json", "--budget", "90%", "--solver", "mutwo", "--out", "tiny_plan.json", "--schedule", "sched"],
        ["plan", "tiny.json", "--sweep", "--out", "sweep.csv"],
        ["verify", "tiny.json", "--plan", "tiny_plan.json", "--json", "verify.json"],
        ["export", "tiny.json", "--plan", "tiny_plan.json", "--out", "exp"],
        ["bench-plot", "bench", "--out", "bench"],
    ]
    for argv in commands:
        assert run(argv) in (0, 1), argv  # 1: a verify that fails is still written
        first = snapshot(work)
        assert run(argv) in (0, 1), argv
        assert set(snapshot(work)) == set(first), argv  # the same files, replaced
    assert (work / "notes.txt").read_text() == "the user's notes"


def test_a_second_screenshot_replaces_the_first_and_only_that(work):
    from acstudio.fileio import check_output
    from acstudio.gui.app import SCREENSHOT

    proc = _app(["--screenshot", "shot.png", str(SAMPLE)], QT_QPA_PLATFORM="offscreen")
    assert proc.returncode == 0, proc.stderr
    check_output(work / "shot.png", SCREENSHOT)  # its own earlier screenshot: accepted
    (work / "photo.png").write_bytes(b"\x89PNG\r\n\x1a\n a user's picture")
    proc = _app(["--screenshot", "photo.png", str(SAMPLE)], QT_QPA_PLATFORM="offscreen")
    assert proc.returncode == 2 and "not an earlier screenshot" in proc.stderr
    assert (work / "photo.png").read_bytes() == b"\x89PNG\r\n\x1a\n a user's picture"


def test_a_file_added_to_the_export_folder_while_exporting_is_kept(work, made, capsys, monkeypatch):
    """The folder is checked again just before it is replaced: a file the user saved there meanwhile stays."""
    from acstudio.export import formats

    earlier_export(work, made)
    schedule = formats.FORMATS["schedule"]

    def write_while_the_user_saves(job, directory):
        (work / "exp" / "draft.md").write_text("saved during the export")
        return schedule.write(job, directory)

    monkeypatch.setitem(formats.FORMATS, "schedule", formats.ExportFormat("schedule", schedule.summary,
                                                                         write_while_the_user_saves))
    before = snapshot(work)
    assert run([*EXPORT, "exp", "--format", "schedule"]) == 2
    assert "also holds draft.md" in capsys.readouterr().err
    after = snapshot(work)
    assert after.pop("exp/draft.md")[0] == b"saved during the export" and after == before


def test_bench_run_again_into_its_earlier_folder_starts_afresh(tmp_path, monkeypatch):
    """A rerun into an earlier bench folder measures every row again (its workers' profiles and plans do not
    collide with the earlier run's: the sac row's planning worker writes both), and replaces the earlier results
    only once it succeeds."""
    import acstudio.bench

    out = tmp_path / "bench"
    model = tmp_path / "models" / "tiny_cnn.py"  # its workers import no transformers: seconds less each
    model.parent.mkdir()
    model.write_text(TINY_CNN)
    command = ["bench", f"{model}:make", "-b", "2", "--device", "cpu", "--configs",
               "eager,sac@90%", "--warmup", "1", "--iters", "3", "--out", str(out)]
    assert main(command) == 0
    first = json.loads((out / "bench.json").read_text())
    assert main(command) == 0
    again = json.loads((out / "bench.json").read_text())
    assert [r["status"] for r in again["rows"]] == ["ok", "ok"]
    assert again["meta"]["created"] != first["meta"]["created"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench", "models"]  # the earlier folder was dropped

    def fails_halfway(spec, batch_sizes, configs, budgets, *, out_dir, **kwargs):
        Path(out_dir, "workers").mkdir(parents=True)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(acstudio.bench, "run_bench", fails_halfway)
    assert main(command) == 2
    assert json.loads((out / "bench.json").read_text()) == again  # put back as it was
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench", "models"]
