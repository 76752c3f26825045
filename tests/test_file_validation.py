"""Profiles and plans are validated on load: one line naming the file, the field and what is wrong."""

import gzip
import json
import time
from pathlib import Path

import pytest

from acstudio.cli import main
from acstudio.errors import CorruptFileError, PlanMismatchError, ProfileFileError, WrongSchemaError
from acstudio.fileio import read_document
from acstudio.plan.loading import load_plan
from acstudio.plan.model import Plan
from acstudio.plan.solvers import plan
from acstudio.profile.model import SCHEMA, SCHEMA_VERSION, Profile
from acstudio.profile.schema import field_path

SAMPLES = Path(__file__).resolve().parent.parent / "sample_profiles"
SAMPLE = SAMPLES / "cpu_resnet18_bs16_sgd.json.gz"


@pytest.fixture(scope="module")
def sample():
    doc = read_document(SAMPLE, SCHEMA, SCHEMA_VERSION)
    profile = Profile.from_dict(doc)
    return doc, profile, plan(profile, int(0.85 * profile.peak_bytes))


def _first_reader(doc) -> int:
    return next(i for i, row in enumerate(doc["nodes"]) if len(row[6]) == 2 and row[2] == "call_function")


def _set_row(section, i, col, value):
    def edit(d):
        d[section][i][col] = value
    return edit


def _reverse_inputs(d):
    k = _first_reader(d)
    d["nodes"][k][6].reverse()


def _edit_graph_arg(d):
    k = _first_reader(d)
    d["graph"]["nodes"][k]["kwargs"]["extra"] = 1


def _last_use_first(d):
    row = d["activations"][0]
    row[3] = d["nodes"][0][0]


PROFILE_CASES = {
    "unknown input": (lambda d: d["nodes"][_first_reader(d)][6].__setitem__(0, "n99999"),
                      "inputs[0] = 'n99999' names no node"),
    "negative size": (_set_row("nodes", 17, 10, -5), "nodes[17].new_bytes = -5: input should be greater than or"),
    "NaN time": (_set_row("nodes", 17, 12, float("nan")), "nodes[17].run_time_ms = nan: input should be a finite"),
    "infinite time": (_set_row("nodes", 17, 12, float("inf")), "nodes[17].run_time_ms = inf"),
    "huge size": (_set_row("nodes", 17, 14, 10**30), "nodes[17].mem_peak = 1000000000000000000000000000000"),
    "size as text": (_set_row("nodes", 17, 10, "512"), "nodes[17].new_bytes = '512': input should be a valid integer"),
    "null row": (lambda d: d["nodes"].__setitem__(3, None), "nodes[3] = None: input should be a valid tuple"),
    "shuffled nodes": (lambda d: d["nodes"].reverse(), "nodes are not in topological order"),
    "shuffled inputs": (_reverse_inputs, "but the graph node reads"),
    "lifetime backwards": (_last_use_first, "activations[0].last_fw_use = 'n00000' comes before created_at"),
    "unknown activation node": (_set_row("activations", 2, 4, "n99999"),
                                "activations[2].first_bw_use = 'n99999' names no node"),
    "activation not a tensor": (_set_row("activations", 2, 0, "n99999"), "activations[2].id = 'n99999' names no"),
    "shuffled activations": (lambda d: d["activations"].reverse(), "is out of creation order"),
    "unknown tensor creator": (lambda d: d["tensors"][5].__setitem__("created_at", "n99999"),
                               "tensors[5].created_at = 'n99999' names no node"),
    "duplicate tensor": (lambda d: d["tensors"].append(d["tensors"][0]), "repeats tensors[0]"),
    "unknown category": (lambda d: d["tensors"][5].__setitem__("category", "stuff"), "tensors[5].category = 'stuff'"),
    "unknown peak node": (lambda d: d.__setitem__("peak_node", "nope"), "peak_node = 'nope' names no node"),
    "missing key": (lambda d: d.pop("activations"), "corrupt profile: activations is missing"),
    "workload type": (lambda d: d["workload"].__setitem__("batch_size", "16"), "workload.batch_size = '16'"),
    "graph and table differ": (lambda d: d["graph"]["nodes"][40].__setitem__("target", "aten.add.Tensor"),
                               "graph.nodes[40].target = 'aten.add.Tensor' but nodes[40] says"),
    "edited graph": (_edit_graph_arg, "fingerprint = "),
}


@pytest.mark.parametrize("case", sorted(PROFILE_CASES))
def test_a_corrupt_profile_is_refused_with_one_line(sample, tmp_path, case):
    doc, profile, _ = sample
    edit, expected = PROFILE_CASES[case]
    bad = json.loads(json.dumps({**doc, "fingerprint": profile.fingerprint}))
    edit(bad)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(CorruptFileError) as info:
        Profile.load(path)
    message = str(info.value)
    assert message.startswith(f"{path}: corrupt profile: ") and "\n" not in message
    assert expected in message and message.endswith("— profile the model again")


def test_saved_profiles_carry_their_fingerprint_and_old_ones_still_load(sample, tmp_path):
    doc, profile, _ = sample
    assert doc["fingerprint"] == profile.fingerprint
    old = tmp_path / "old.json"
    old.write_text(json.dumps({k: v for k, v in doc.items() if k != "fingerprint"}))  # written before it was stored
    assert Profile.load(old).to_dict() == profile.to_dict()
    profile.save(tmp_path / "p.json.gz")
    saved = json.loads(gzip.decompress((tmp_path / "p.json.gz").read_bytes()))
    assert saved["fingerprint"] == profile.fingerprint
    again = Profile.load(tmp_path / "p.json.gz")
    assert again.to_dict() == profile.to_dict() and again.nodes == profile.nodes


@pytest.mark.parametrize("path", sorted(SAMPLES.glob("*.json.gz")), ids=lambda p: p.name.partition(".")[0])
def test_every_bundled_sample_stores_the_fingerprint_of_its_graph(path):
    doc = read_document(path, SCHEMA, SCHEMA_VERSION)
    assert doc["fingerprint"] == Profile.load(path).fingerprint


def test_field_paths_name_row_columns():
    assert field_path(("nodes", 17, 6, 0)) == "nodes[17].inputs[0]"
    assert field_path(("activations", 3, 8)) == "activations[3].reason"
    assert field_path(("schedule", 0, 4, 2)) == "schedule[0].sources[2]"
    assert field_path(("graph", "nodes", 5, "args")) == "graph.nodes[5].args"
    assert field_path(("tensors", 2, "bytes")) == "tensors[2].bytes"


def _plan_doc(p: Plan) -> dict:
    return json.loads(json.dumps({"schema": "acstudio.plan", "version": 1, **p.to_dict()}))


def _edit_schedule(col, value):
    def edit(d):
        d["schedule"][0][col] = value
    return edit


def _rename_first_choice(d):
    """Both the choice and its schedule entry, so that the plan agrees with itself but not with the profile."""
    first = d["recomputed"][0]
    d["recomputed"][0] = "n99999"
    next(row for row in d["schedule"] if row[0] == first)[0] = "n99999"


PLAN_CASES = {
    "null recomputed": (lambda d: d.__setitem__("recomputed", None),
                        "recomputed = None: input should be a valid list"),
    "unknown activation": (_rename_first_choice, "recomputed[0] = 'n99999' names no activation"),
    "not a candidate": (lambda d: d["excluded"].__setitem__(d["recomputed"][0], "random"),
                        "is not a recompute candidate"),
    "unknown replay node": (_edit_schedule(5, ["n99999"]), "schedule[0].replay[0] = 'n99999' names no node"),
    "negative time": (_edit_schedule(6, -1.0), "schedule[0].recompute_ms = -1.0"),
    "edited prediction": (lambda d: d.__setitem__("predicted_peak_bytes", d["predicted_peak_bytes"] - 1),
                          "predicted_peak_bytes = "),
    "edited schedule": (lambda d: d["schedule"][0][4].pop(), "schedule[0].sources = "),
    "claims to fit": (lambda d: d.update(feasible=not d["feasible"]), "feasible = "),
    "entry without a choice": (lambda d: d["recomputed"].pop(), "names no recomputed activation"),
    "repeated choice": (lambda d: d["recomputed"].append(d["recomputed"][0]), "repeats recomputed[0]"),
    "unknown replay mode": (lambda d: d.update(replay_mode="twice"), "replay_mode = 'twice' is not a replay mode ("),
    "legacy flag not a bool": (lambda d: (d.pop("replay_mode"), d.update(share_chains="yes")),
                               "share_chains = 'yes' is not true or false"),
}


@pytest.mark.parametrize("case", sorted(PLAN_CASES))
def test_a_corrupt_plan_is_refused_with_one_line(sample, tmp_path, case):
    _, profile, good = sample
    assert good.recomputed
    edit, expected = PLAN_CASES[case]
    bad = _plan_doc(good)
    edit(bad)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(CorruptFileError) as info:
        load_plan(path, profile)
    message = str(info.value)
    assert message.startswith(f"{path}: corrupt plan: ") and "\n" not in message
    assert expected in message and message.endswith("— plan again")


def test_a_good_plan_loads_unchanged_and_a_foreign_one_is_refused(sample, tmp_path):
    _, profile, good = sample
    good.save(tmp_path / "plan.json")
    assert load_plan(tmp_path / "plan.json", profile).to_dict() == good.to_dict()
    other = Profile.load(SAMPLES / "cpu_resnet18_bs4.json.gz")
    with pytest.raises(PlanMismatchError):
        load_plan(tmp_path / "plan.json", other)


@pytest.mark.parametrize("gzipped", [False, True])
def test_a_truncated_plan_is_a_corrupt_plan_not_a_bad_profile(sample, tmp_path, gzipped):
    _, _, good = sample
    path = tmp_path / ("plan.json.gz" if gzipped else "plan.json")
    good.save(path)
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    with pytest.raises(ProfileFileError, match=r"plan\.json(\.gz)?: corrupt plan: the file is truncated or damaged"):
        Plan.load(path)
    with pytest.raises(WrongSchemaError, match=r"expected a acstudio\.profile file, found a damaged 'acstudio\.plan'"):
        Profile.load(path)


def test_the_gui_shows_the_plan_s_own_reason(sample, tmp_path):
    from acstudio.views.documents import open_document, prepare

    _, profile, good = sample
    loaded = prepare(profile, str(SAMPLE))
    bad = _plan_doc(good)
    bad["recomputed"] = None
    (tmp_path / "null.json").write_text(json.dumps(bad))
    good.save(tmp_path / "cut.json")
    (tmp_path / "cut.json").write_bytes((tmp_path / "cut.json").read_bytes()[:300])
    for current in (loaded, None):  # with or without a profile open
        with pytest.raises(CorruptFileError, match=r"null\.json: corrupt plan: recomputed = None"):
            open_document(str(tmp_path / "null.json"), current)
        with pytest.raises(ProfileFileError, match=r"cut\.json: corrupt plan: the file is truncated"):
            open_document(str(tmp_path / "cut.json"), current)


def test_verify_and_export_refuse_a_null_plan_and_warn_on_an_infeasible_one(sample, tmp_path, capsys):
    _, profile, good = sample
    bad = _plan_doc(good)
    bad["recomputed"] = None
    (tmp_path / "null.json").write_text(json.dumps(bad))
    for command in ("verify", "export"):
        extra = ["--out", str(tmp_path / "out")] if command == "export" else []
        assert main([command, str(SAMPLE), "--plan", str(tmp_path / "null.json"), *extra]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert lines == [f"acstudio: error: {tmp_path / 'null.json'}: corrupt plan: recomputed = None: input should "
                         "be a valid list — plan again"]
    infeasible = plan(profile, 1 << 20)
    assert not infeasible.feasible
    infeasible.save(tmp_path / "tight.json")
    assert main(["export", str(SAMPLE), "--plan", str(tmp_path / "tight.json"), "--out", str(tmp_path / "out")]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "tight.json is INFEASIBLE" in warnings[0]
    assert (tmp_path / "out" / "step.py").is_file()


def test_loading_and_validating_the_10083_node_sample_takes_under_a_second():
    path = SAMPLES / "h200_resnet152_bs64_adam.json.gz"
    Profile.load(path)  # imports and schema construction are not the file's cost
    best = float("inf")
    for _ in range(2):
        start = time.process_time()
        profile = Profile.load(path)
        best = min(best, time.process_time() - start)
    assert len(profile.nodes) == 10083 and best < 1.0


def test_an_old_profile_with_an_edited_graph_fails_to_rebuild_with_one_line(sample):
    from acstudio.capture.serialize import deserialize_step

    doc, _, _ = sample
    bad = json.loads(json.dumps(doc))
    del bad["fingerprint"]  # written before it was stored: the edit cannot be seen on load
    k = next(i for i, g in enumerate(bad["graph"]["nodes"]) if g["op"] == "call_function")
    bad["graph"]["nodes"][k]["kwargs"]["dtype"] = {"$dtype": "float99"}
    profile = Profile.from_dict(bad)
    with pytest.raises(ProfileFileError, match="corrupt graph in profile"):
        deserialize_step(profile.graph)
