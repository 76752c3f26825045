"""Every failure the CLI meets is one line, ``acstudio: error: <what> — <what to do>``, exit status 2, no traceback
and no file left behind; outputs that cannot be written are refused before any work; export never deletes a
folder it did not write."""

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from acstudio.cli import main
from acstudio.errors import OutputPathError
from acstudio.export.exporter import EXPORT_FOLDER
from acstudio.fileio import check_output
from acstudio.plan.solvers import plan as make_plan
from acstudio.profile.model import Profile

SAMPLE = Path(__file__).resolve().parent.parent / "sample_profiles" / "cpu_resnet18_bs16_sgd.json.gz"
TINY_GPT2 = ["--config", "n_layer=1", "--config", "n_embd=16", "--config", "n_head=2", "--config", "vocab_size=50"]


@pytest.fixture(scope="module")
def plan_files(tmp_path_factory):
    """A feasible plan of the CPU sample and the same plan with ``recomputed: null``."""
    folder = tmp_path_factory.mktemp("plans")
    profile = Profile.load(SAMPLE)
    good = folder / "plan.json"
    make_plan(profile, int(0.85 * profile.peak_bytes)).save(good)
    doc = json.loads(good.read_text())
    doc["recomputed"] = None
    (folder / "null.json").write_text(json.dumps(doc))
    return folder


@pytest.fixture
def workdir(tmp_path, monkeypatch, plan_files):
    """An empty current folder with the inputs reachable as ../inputs/...; ``blocker`` is a file, so any path
    under it cannot be written, even by root."""
    (tmp_path / "inputs").mkdir()
    for name in ("plan.json", "null.json"):
        (tmp_path / "inputs" / name).write_bytes((plan_files / name).read_bytes())
    (tmp_path / "inputs" / "raises.py").write_text(
        "def make(batch_size):\n    raise ValueError('no data folder')\n")
    (tmp_path / "inputs" / "noparams.py").write_text(
        "import torch\n\ndef make(batch_size):\n"
        "    return torch.nn.ReLU(), torch.ones(batch_size, 2), lambda m, b: m(b).sum()\n")
    (tmp_path / "inputs" / "blocker").write_text("a file, not a folder")
    (tmp_path / "inputs" / "a_folder").mkdir()
    (tmp_path / "inputs" / "webapp").mkdir()
    (tmp_path / "inputs" / "webapp" / "manifest.json").write_text('{"name": "my app"}')  # not an export's
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return tmp_path


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def exit_status(argv) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's errors exit from inside parse_args
        return exc.code


def assert_one_line_failure(argv, capsys, root, expect: str):
    before = files_under(root)
    assert exit_status(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip() and not line.startswith("[")]
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("acstudio: error: ") and " — " in lines[0], err
    assert expect in lines[0], lines[0]
    assert files_under(root) == before  # nothing written, nothing deleted


S = str(SAMPLE)
PLAN, NULL_PLAN = "../inputs/plan.json", "../inputs/null.json"
BLOCKED = "../inputs/blocker/out"  # its parent is a file
PROFILE_CPU = ["profile", "resnet18", "-b", "2", "--image-size", "32", "--device", "cpu"]
GPT2_CPU = ["profile", "gpt2", "-b", "1", "--seq-len", "8", "--device", "cpu", *TINY_GPT2]

CASES = {
    "device tpu": (["profile", "resnet18", "-b", "2", "--device", "tpu", "--out", "p.json"], "unknown device 'tpu'"),
    "bench --device tpu": (["bench", "resnet18", "-b", "2", "--device", "tpu", "--out", "b"], "unknown device"),
    "--iterations 1": ([*PROFILE_CPU, "--iterations", "1", "--out", "p.json"], "give --iterations 3 or more"),
    "batch too large for memory": (["profile", "resnet18", "-b", "2000000", "--image-size", "64", "--device", "cpu",
                                    "--out", "p.json"], "needs at least"),
    "seq-len 0": ([*GPT2_CPU, "--seq-len", "0", "--out", "p.json"], "sequence length must be at least 1"),
    "seq-len -5": ([*GPT2_CPU, "--seq-len", "-5", "--out", "p.json"], "got -5"),
    "seq-len past the positions": ([*GPT2_CPU, "--seq-len", "2000", "--out", "p.json"], "n_positions=2000"),
    "seq-len past RoBERTa's offset": (["profile", "roberta", "-b", "1", "--seq-len", "511", "--device", "cpu",
                                       "--config", "max_position_embeddings=512", "--out", "p.json"],
                                      "less 2: RoBERTa's padding offset"),
    "custom factory that raises": (["profile", "../inputs/raises.py:make", "-b", "2", "--device", "cpu",
                                    "--out", "p.json"], "raised ValueError: no data folder"),
    "model with no parameters": (["profile", "../inputs/noparams.py:make", "-b", "2", "--device", "cpu",
                                  "--out", "p.json"], "no trainable parameters"),
    "--config for a custom factory": (["profile", "../inputs/noparams.py:make", "-b", "2", "--config", "a=1",
                                       "--out", "p.json"], "--config applies to zoo models only"),
    "distilbert-clm is not a model": (["profile", "distilbert-clm", "-b", "1", "--device", "cpu", "--out", "p.json"],
                                      "unknown model 'distilbert-clm'"),
    "albert-clm is not a model": (["profile", "albert-clm", "-b", "1", "--device", "cpu", "--out", "p.json"],
                                  "unknown model 'albert-clm'"),
    "heads do not divide the hidden size": ([*GPT2_CPU, "--config", "n_head=3", "--out", "p.json"],
                                            "n_embd=16 is not divisible by n_head=3"),
    "key/value heads do not divide the heads": (["profile", "mistral", "-b", "1", "--seq-len", "8", "--device", "cpu",
                                                 "--config", "hidden_size=16", "--config", "num_attention_heads=2",
                                                 "--out", "p.json"], "num_key_value_heads=8 does not divide"),
    "unknown --config key": ([*GPT2_CPU, "--config", "n_layers=1", "--out", "p.json"], "did you mean n_layer"),
    "unknown torchvision --config key": ([*PROFILE_CPU, "--config", "num_clases=3", "--out", "p.json"],
                                         "did you mean num_classes"),
    # a --config value the model's own code rejects is the user's field, not a bug of ours
    "--config value of the wrong type": ([*GPT2_CPU, "--config", "n_layer=abc", "--out", "p.json"],
                                         "cannot build it with --config n_layer=1 n_embd=16 n_head=2 vocab_size=50 "
                                         "n_layer=abc"),
    "--config dropout past 1": ([*GPT2_CPU, "--config", "resid_pdrop=2", "--out", "p.json"], "resid_pdrop=2:"),
    "--config zero width": ([*GPT2_CPU, "--config", "n_embd=0", "--out", "p.json"], "n_embd=0:"),
    "--config zero classes": ([*PROFILE_CPU, "--config", "num_classes=0", "--out", "p.json"], "num_classes=0:"),
    "bench of an unknown model": (["bench", "resnet5o", "-b", "2", "--device", "cpu", "--out", "b"],
                                  "unknown model 'resnet5o' — did you mean resnet50"),
    "bench budget factor inf": (["bench", "resnet18", "-b", "2", "--device", "cpu", "--configs",
                                 "rewritten@per-block*inf", "--out", "b"], "the factor after '*' must be a positive"),
    "budget without a unit": (["plan", S, "--budget", "85"], "has no unit — write 85%"),
    "compiled plan in another mode": (["plan", S, "--budget", "85%", "--compiled-per-block-peak", "100MiB", "--mode",
                                       "again"], "runs the plan in the sac mode — leave out --mode again"),
    "compiled step times that are not numbers": (["plan", S, "--budget", "85%", "--compiled-per-block-peak", "100MiB",
                                                 "--compiled-step-ms", "fast,slow"], "are not two to four numbers"),
    "one compiled step time": (["plan", S, "--budget", "85%", "--compiled-per-block-peak", "100MiB",
                                "--compiled-step-ms", "23"], "are not two to four numbers"),
    "a zero compiled step time": (["plan", S, "--budget", "85%", "--compiled-per-block-peak", "100MiB",
                                   "--compiled-step-ms", "0,2"], "must be positive milliseconds"),
    "compiled step times without the compiled peak": (["plan", S, "--budget", "85%", "--compiled-step-ms", "1,2"],
                                                      "give --compiled-per-block-peak too"),
    "compile+per-op's peak without compile+per-block's": (["plan", S, "--budget", "85%", "--compiled-per-op-peak",
                                                           "100MiB"], "give --compiled-per-block-peak too"),
    "compile+per-op's peak below compile+per-block's": (["plan", S, "--budget", "85%", "--compiled-per-block-peak",
                                                         "100MiB", "--compiled-per-op-peak", "90MiB"],
                                                        "is below --compiled-per-block-peak"),
    "bad argument": (["profile", "resnet18", "-b", "two", "--out", "p.json"], "expected a whole number from 1"),
    "plan with recomputed null to verify": (["verify", S, "--plan", NULL_PLAN], ""),
    "plan with recomputed null to export": (["export", S, "--plan", NULL_PLAN, "--out", "exp"], ""),
    "export --out .": (["export", S, "--plan", PLAN, "--out", "."], "holds the current folder"),
    "export --out ..": (["export", S, "--plan", PLAN, "--out", ".."], "holds the current folder"),
    "export --out . --force": (["export", S, "--plan", PLAN, "--out", ".", "--force"], "holds the current folder"),
    "export into a user's folder": (["export", S, "--plan", PLAN, "--out", "../inputs"], "an input of this command"),
    "export into a user's folder --force": (["export", S, "--plan", PLAN, "--out", "../inputs/a_folder/..", "--force"],
                                            "an input of this command"),
    "export into another manifest's folder": (["export", S, "--plan", PLAN, "--out", "../inputs/webapp"],
                                              "did not write"),
    # every writer, before it measures: the output's parent is a file
    "profile --out unwritable": ([*PROFILE_CPU, "--out", BLOCKED], "is not a folder"),
    "profile --csv unwritable": ([*PROFILE_CPU, "--out", "p.json", "--csv", BLOCKED], "is not a folder"),
    "plan --out unwritable": (["plan", S, "--budget", "85%", "--out", BLOCKED], "is not a folder"),
    "plan --schedule unwritable": (["plan", S, "--budget", "85%", "--schedule", BLOCKED], "is not a folder"),
    "plan --sweep --out unwritable": (["plan", S, "--sweep", "--out", BLOCKED], "is not a folder"),
    "plan --fsdp 0": (["plan", S, "--budget", "85%", "--fsdp", "0"], "--fsdp: expected a whole number from 1 to 65536"),
    "plan --fsdp and --ddp": (["plan", S, "--budget", "85%", "--fsdp", "2", "--ddp", "2"], "were both given"),
    "export --out unwritable": (["export", S, "--plan", PLAN, "--out", BLOCKED], "is not a folder"),
    "verify --json unwritable": (["verify", S, "--plan", PLAN, "--json", BLOCKED], "is not a folder"),
    "bench --out unwritable": (["bench", "resnet18", "-b", "2", "--device", "cpu", "--out", BLOCKED],
                               "is not a folder"),
    "bench-plot --out unwritable": (["bench-plot", "../inputs", "--out", BLOCKED], "is not a folder"),
    # an output file that is an existing folder
    "profile --out is a folder": ([*PROFILE_CPU, "--out", "../inputs/a_folder"], "is a folder — give a file name"),
    "plan --out is a folder": (["plan", S, "--budget", "85%", "--out", "../inputs/a_folder"], "is a folder"),
    "verify --json is a folder": (["verify", S, "--plan", PLAN, "--json", "../inputs/a_folder"], "is a folder"),
    "profile --csv is a file": ([*PROFILE_CPU, "--out", "p.json", "--csv", "../inputs/plan.json"],
                                "is not a folder"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_failure_is_one_line_with_status_2(case, workdir, capsys):
    argv, expect = CASES[case]
    assert_one_line_failure(argv, capsys, workdir, expect)


@pytest.mark.skipif(sys.platform == "win32" or os.geteuid() == 0, reason="root writes into read-only folders")
@pytest.mark.parametrize("argv", [
    [*PROFILE_CPU, "--out", "../inputs/ro/p.json"], [*PROFILE_CPU, "--out", "p.json", "--csv", "../inputs/ro"],
    ["plan", S, "--budget", "85%", "--out", "../inputs/ro/plan.json"],
    ["plan", S, "--budget", "85%", "--schedule", "../inputs/ro/sched"],
    ["export", S, "--plan", PLAN, "--out", "../inputs/ro/exp"],
    ["verify", S, "--plan", PLAN, "--json", "../inputs/ro/v.json"],
])
def test_read_only_folders_are_refused_up_front(argv, workdir, capsys):
    read_only = workdir / "inputs" / "ro"
    read_only.mkdir()
    read_only.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        assert_one_line_failure(argv, capsys, workdir, "is not writable")
    finally:
        read_only.chmod(stat.S_IRWXU)


def test_debug_shows_the_traceback(workdir, capsys):
    assert main(["--debug", "profile", "resnet18", "-b", "1", "--device", "tpu", "--out", "p.json"]) == 2
    assert "Traceback" in capsys.readouterr().err
    assert main(["profile", "resnet18", "-b", "1", "--device", "tpu", "--out", "p.json", "--debug"]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_export_replaces_only_its_own_folders(workdir, capsys):
    out = workdir / "work" / "exp"
    assert main(["export", S, "--plan", PLAN, "--out", "exp"]) == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~current_umask()  # not mkdtemp's 0700
    assert main(["export", S, "--plan", PLAN, "--out", "exp"]) == 0  # its own folder: replaced
    user = workdir / "work" / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("keep me")
    assert main(["export", S, "--plan", PLAN, "--out", "mine"]) == 2
    assert main(["export", S, "--plan", PLAN, "--out", "mine", "--force"]) == 2  # never a folder we did not write
    assert sorted(p.name for p in user.iterdir()) == ["notes.txt"] and (user / "notes.txt").read_text() == "keep me"
    (out / "notes.txt").write_text("added to an export")
    assert main(["export", S, "--plan", PLAN, "--out", "exp"]) == 2
    assert (out / "notes.txt").read_text() == "added to an export"
    assert main(["export", S, "--plan", PLAN, "--out", "exp", "--force"]) == 0  # an earlier export: --force may
    assert not (out / "notes.txt").exists() and (out / "manifest.json").is_file()
    (workdir / "work" / "empty").mkdir()
    assert main(["export", S, "--plan", PLAN, "--out", "empty"]) == 0
    capsys.readouterr()


def test_a_picked_folder_of_other_files_gets_a_new_export_folder_inside(tmp_path):
    from acstudio.export.exporter import export_folder_in

    picked = tmp_path / "projects"
    assert export_folder_in(picked, "plan") == picked  # absent: written as it is
    picked.mkdir()
    assert export_folder_in(picked, "plan") == picked  # empty
    (picked / "notes.txt").write_text("mine")
    assert export_folder_in(picked, "plan") == picked / "plan"
    (picked / "plan").mkdir()
    (picked / "plan" / "data.csv").write_text("theirs")
    assert export_folder_in(picked, "plan") == picked / "plan-2"  # taken by someone else's files
    profile = Profile.load(SAMPLE)
    make_plan(profile, int(0.9 * profile.peak_bytes)).save(tmp_path / "p.json")
    assert main(["export", str(SAMPLE), "--plan", str(tmp_path / "p.json"), "--out", str(picked / "plan-2")]) == 0
    assert export_folder_in(picked, "plan") == picked / "plan-2"  # an earlier export: replaced
    assert export_folder_in(picked / "plan-2", "plan") == picked / "plan-2"


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_an_export_folder_is_known_by_any_of_its_markers(tmp_path, monkeypatch):
    """Exports written before contents.json listed their files are known by their manifest or SAC policy."""
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "sac_only"
    folder.mkdir()
    (folder / "sac_policy.json").write_text(json.dumps({"schema": "acstudio.sac_policy", "version": 1}))
    check_output(folder, EXPORT_FOLDER)  # ours: accepted
    (folder / "sac_policy.json").write_text(json.dumps({"schema": "someone.else", "version": 1}))
    with pytest.raises(OutputPathError, match="did not write"):
        check_output(folder, EXPORT_FOLDER)  # without that marker it is somebody else's
    assert (folder / "sac_policy.json").is_file()


def test_a_reader_that_stops_early_is_not_an_error(tmp_path):
    """`acstudio plan ... --out p.json | head -1`: the plan file is written, and no error line or status follows."""
    import subprocess

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before anything is printed
    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, "-m", "acstudio", "plan", str(SAMPLE), "--budget", "90%", "--out", str(out)],
                          stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    os.close(write_end)
    assert (proc.returncode, proc.stderr) == (0, "")
    assert Profile.load(SAMPLE).fingerprint == json.loads(out.read_text())["profile_fingerprint"]
