"""An export is a drop-in step: it trains like the eager loop, runs with torch alone, and refuses what it wasn't made
for; exporting never leaves a half-written folder."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from test_capture import eager_step
from test_rewrite import captured, pick

import acstudio
from acstudio.capture.step import prepare_optimizer
from acstudio.export import ExportError, ExportMismatchError, export, step_module
from acstudio.plan import plan as make_plan
from acstudio.rewrite import rewrite_step
from acstudio.units import format_bytes
from acstudio.workload import build_workload


@pytest.mark.parametrize(("model", "optimizer"), [("resnet18", "sgd"), ("bert", "adam"), ("gpt2", "adamw")])
def test_loaded_step_trains_like_the_eager_loop(tmp_path, model, optimizer):
    spec, _, _, _, profile = captured(model, optimizer)
    plan = make_plan(profile, int(profile.peak_bytes * 0.9)) if model != "resnet18" else pick(profile, 0.5)
    export(profile, plan, tmp_path / "out")

    ours, ref = build_workload(spec), build_workload(spec)  # fresh, identically seeded copies
    ours_opt, ref_opt = ours.make_optimizer(), ref.make_optimizer()
    step = acstudio.load_step(tmp_path / "out", ours.model, ours_opt)
    # As in test_capture: the graph's optimizer formulas round like torch.optim's compiled path (~1e-7), which
    # tiny-batch BatchNorm amplifies in the second iteration.
    for it, tol in enumerate((1e-5, 1e-3)):
        torch.manual_seed(it)
        loss = step(ours.batch)
        torch.manual_seed(it)
        ref_loss = eager_step(ref.model, ref_opt, ref.batch, ref.loss_fn)
        torch.testing.assert_close(loss, ref_loss, atol=tol, rtol=tol)
        for (name, p), q in zip(ours.model.named_parameters(), ref.model.parameters()):
            torch.testing.assert_close(p, q, atol=tol, rtol=tol, msg=f"parameter {name}")
            torch.testing.assert_close(p.grad, q.grad, atol=tol, rtol=tol, msg=f"gradient {name}")
            for key, value in ref_opt.state[q].items():
                torch.testing.assert_close(ours_opt.state[p][key], value, atol=tol, rtol=tol, msg=f"{key} {name}")
        for (name, b), c in zip(ours.model.named_buffers(), ref.model.buffers()):
            torch.testing.assert_close(b, c, atol=tol, rtol=tol, msg=f"buffer {name}")


def test_files_manifest_and_report(tmp_path):
    _, _, _, step, profile = captured("gpt2")
    plan = make_plan(profile, int(profile.peak_bytes * 0.9))
    files = export(profile, plan, tmp_path / "out")
    names = sorted(os.path.basename(f) for f in files)
    assert names == sorted(os.listdir(tmp_path / "out"))
    assert {"schedule.json", "schedule.csv", "step.py", "manifest.json", "report.md"} <= set(names)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["profile_fingerprint"] == profile.fingerprint
    assert [(i["kind"], i["key"]) for i in manifest["inputs"]] == [(s.kind, s.key) for s in step.inputs]
    assert manifest["grad_params"] == step.grad_params and manifest["recomputed"] == plan.recomputed
    hyper = [i for i in manifest["inputs"] if i["kind"] == "hyper"]
    assert [i["key"] for i in hyper] == ["0/lr", "0/beta1", "0/beta2", "0/eps", "0/weight_decay"]
    (group,) = manifest["optimizer"]["groups"]
    assert manifest["optimizer"]["type"] == "Adam" and group["params"] == step.optimizer.groups[0]["params"]
    assert group["hyperparameters"] == {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0}
    assert group["switches"] == {"amsgrad": False, "maximize": False, "decoupled_weight_decay": False}
    # Adam without weight decay leaves the decay term out of the graph: a condition load_step checks
    assert ["0/weight_decay", "==", 0.0] in manifest["optimizer"]["conditions"]
    assert [b["path"] for b in manifest["batch"]] == ["['input_ids']", "['attention_mask']", "['labels']"]
    assert manifest["parameters"]["transformer.wte.weight"] == {"shape": [120, 32], "dtype": "float32"}
    report = (tmp_path / "out" / "report.md").read_text()
    assert f"{plan.predicted_peak_bytes:,}" in report
    assert all(f"`{a}`" in report for a in plan.recomputed)
    assert f"What sets it: peak {format_bytes(plan.predicted_peak_bytes)} at {plan.predicted_peak_node}" in report
    assert "the floor is " in report

    ids = pick(profile, 0.25)  # a bare list of ids gets the rewriter's own schedule
    export(profile, ids, tmp_path / "ids")
    rows = json.loads((tmp_path / "ids" / "schedule.json").read_text())
    assert sorted(r["activation"] for r in rows) == sorted(ids)
    assert (tmp_path / "ids" / "schedule.csv").read_text().count("\n") == len(ids) + 1


def test_step_module_runs_with_torch_only(tmp_path):
    spec, _, _, step, profile = captured("gpt2")
    ids = pick(profile, 0.5)
    export(profile, ids, tmp_path / "out")
    w = build_workload(spec)
    opt = w.make_optimizer()
    prepare_optimizer(w.model, opt)
    flat = step.flat_inputs(w.model, opt, w.batch)
    torch.save([t.clone() if isinstance(t, torch.Tensor) else t for t in flat], tmp_path / "inputs.pt")
    script = f"""
import importlib.util, sys, torch
sys.modules["acstudio"] = None  # any import of AC Studio would fail
spec = importlib.util.spec_from_file_location("step", {str(tmp_path / "out" / "step.py")!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
torch.manual_seed(0)
with torch.no_grad():
    out = module.Step()(*torch.load({str(tmp_path / "inputs.pt")!r}))
torch.save(out, {str(tmp_path / "outputs.pt")!r})
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    torch.manual_seed(0)
    with torch.no_grad():
        expected = rewrite_step(step, profile, ids).gm(*flat)
    got = torch.load(tmp_path / "outputs.pt")
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def test_exported_graph_creates_tensors_on_the_current_device_not_a_fixed_gpu():
    graph = torch.fx.Graph()
    ones = graph.call_function(torch.ops.aten.ones.default, ([2],),
                               {"device": torch.device("cuda", 0), "dtype": torch.float32})
    graph.output([ones, graph.call_function(torch.ops.aten.add.Tensor, (ones, torch.device("cuda", 3)))])
    gm = torch.fx.GraphModule({}, graph)
    step_module.without_device_index(gm)
    assert ones.kwargs["device"] == torch.device("cuda") and ones.kwargs["dtype"] is torch.float32
    assert ones.next.args[1] == torch.device("cuda")
    assert "index" not in gm.code and "device(type='cuda')" in gm.code


def test_refuses_what_it_was_not_made_for(tmp_path):
    spec, _, _, _, profile = captured("bert")
    export(profile, pick(profile, 0.5), tmp_path / "out")
    out = tmp_path / "out"

    other = build_workload(dataclasses.replace(spec, config=(*spec.config, ("intermediate_size", "48"))))
    wrong_shape = r"another model.*intermediate\.dense\.weight: expected float32\[64, 32\], got float32\[48, 32\]"
    with pytest.raises(ExportMismatchError, match=wrong_shape):
        acstudio.load_step(out, other.model, other.make_optimizer())

    w = build_workload(spec)
    with pytest.raises(ExportMismatchError, match=r"torch\.optim\.Adam, got SGD"):
        acstudio.load_step(out, w.model, torch.optim.SGD(w.model.parameters(), lr=1e-3))
    with pytest.raises(ExportMismatchError, match=r"amsgrad=True, the step was captured with amsgrad=False"):
        acstudio.load_step(out, w.model, torch.optim.Adam(w.model.parameters(), amsgrad=True))
    with pytest.raises(ExportMismatchError, match="does not update parameter"):
        acstudio.load_step(out, w.model, torch.optim.Adam(list(w.model.parameters())[1:], lr=1e-3))

    split = build_workload(spec)
    split.model.cls.to("meta")
    with pytest.raises(ExportMismatchError, match="spread over cpu, meta"):
        acstudio.load_step(out, split.model, split.make_optimizer())

    opt = w.make_optimizer()
    step = acstudio.load_step(out, w.model, opt)
    shorter = {k: v[:, :8] for k, v in w.batch.items()}
    with pytest.raises(ExportMismatchError, match=r"\['input_ids'\]: expected int64\[2, 16\], got int64\[2, 8\]"):
        step(shorter)
    reordered = dict(reversed(w.batch.items()))  # matched by key, not by position
    before = [p.clone() for p in w.model.parameters()]
    step(reordered)
    assert any(not torch.equal(p, q) for p, q in zip(w.model.parameters(), before))
    opt.param_groups[0]["lr"] = 5e-4  # e.g. an LR scheduler: the graph reads it at every call
    step(w.batch)
    opt.param_groups[0]["weight_decay"] = 0.01  # the graph was traced without the decay term
    with pytest.raises(ExportMismatchError, match=r"changed since load_step: .*weight_decay=0\.01.*weight_decay == 0"):
        step(w.batch)


def test_failed_export_leaves_no_half_written_folder(tmp_path, monkeypatch):
    _, _, _, _, profile = captured("bert")
    ids = pick(profile, 0.5)
    out = tmp_path / "out"

    def broken(*args):
        raise RuntimeError("disk full")

    monkeypatch.setattr(step_module, "report_text", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        export(profile, ids, out)
    assert os.listdir(tmp_path) == []

    out.mkdir()
    (out / "sac_policy.json").write_text(json.dumps({"schema": "acstudio.sac_policy", "version": 1}))
    (out / "old.txt").write_text("added to an earlier export")
    with pytest.raises(RuntimeError, match="disk full"):
        export(profile, ids, out, force=True)  # force: the earlier export holds a file it did not write
    assert os.listdir(tmp_path) == ["out"] and sorted(os.listdir(out)) == ["old.txt", "sac_policy.json"]

    monkeypatch.undo()
    export(profile, ids, out, force=True)  # a successful export replaces the folder as a whole
    assert "old.txt" not in os.listdir(out) and "step.py" in os.listdir(out)
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_formats_are_chosen_and_the_sac_policy_round_trips(tmp_path):
    """``formats`` picks the files; the sac format's policy is the SAC form of the plan, and apply_plan reads it."""
    from acstudio.export.apply import load_policy
    from acstudio.export.sac import SacPolicy
    from acstudio.simulate.sac import simulate_sac

    *_, profile = captured("gpt2")
    plan = make_plan(profile, profile.peak_bytes, "recompute-all")
    files = export(profile, plan, tmp_path / "sac", formats=["sac"])
    assert [os.path.basename(f) for f in files] == ["sac_policy.json", "contents.json"]
    loaded = load_policy(tmp_path / "sac")
    assert loaded == SacPolicy.from_plan(profile, plan.recomputed)
    form = simulate_sac(profile, plan.recomputed)
    assert loaded.freed == form.freed and loaded.predicted_peak_bytes == form.result.peak_bytes
    assert sorted(loaded.blocks) == ["transformer.h.0", "transformer.h.1"]
    # recompute-all saves nothing in a GPT-2 layer: even its output only passes through (the caller holds it)
    assert loaded.blocks["transformer.h.0"] and not any(d.save for d in loaded.blocks["transformer.h.0"])

    everything = {os.path.basename(f) for f in export(profile, plan, tmp_path / "all")}
    assert {"step.py", "schedule.json", "sac_policy.json"} <= everything
    keep_all = make_plan(profile, profile.peak_bytes, "keep-all")
    assert "sac_policy.json" not in {os.path.basename(f) for f in export(profile, keep_all, tmp_path / "k")}
    with pytest.raises(ExportError, match="cannot export the sac format: the plan frees nothing"):
        export(profile, keep_all, tmp_path / "k", formats=["sac"])
    with pytest.raises(ExportError, match="unknown export format 'onnx'"):
        export(profile, plan, tmp_path / "x", formats=["onnx"])


def test_a_plan_priced_in_sac_mode_exports_its_policy_and_no_step(tmp_path):
    from acstudio.plan.baselines import per_module
    from acstudio.plan.schedule import PlanContext

    *_, profile = captured("bert")
    ctx = PlanContext(profile)
    plan = ctx.plan_for_set("per-module", 0, per_module(ctx), mode="sac")
    assert plan.replay_mode == "sac"
    names = {os.path.basename(f) for f in export(profile, plan, tmp_path / "out")}
    assert "sac_policy.json" in names and "step.py" not in names
    saved = json.loads((tmp_path / "out" / "sac_policy.json").read_text())
    assert saved["predicted_peak_bytes"] == plan.predicted_peak_bytes
    with pytest.raises(ExportError, match="priced for selective checkpointing"):
        export(profile, plan, tmp_path / "x", formats=["step"])
