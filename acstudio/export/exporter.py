"""Export a plan as a drop-in training step: the rewritten graph as plain Python, a manifest, a schedule, a report.

The folder is written atomically (all files or none). ``step.py`` is the rewritten graph's generated code with the
imports it needs, so it runs with torch alone; :func:`acstudio.load_step` binds it to a live model and optimizer
after checking them against ``manifest.json``. Everything a graph bakes in is recorded there: the parameters,
buffers and batch it was traced for (shapes are static), the optimizer type and hyperparameters (the learning
rate is a constant in the graph), the precision and device.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import types
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from acstudio.capture.serialize import deserialize_step
from acstudio.errors import ACStudioError
from acstudio.fileio import atomic_dir, write_document
from acstudio.jobs import ProgressFn, report
from acstudio.plan.budget import format_bytes
from acstudio.plan.model import Plan
from acstudio.profile.model import Profile
from acstudio.rewrite.memory import live_bytes
from acstudio.rewrite.rewriter import Recomputation, RewrittenStep, plan_activations, rewrite_step
from acstudio.workload import WorkloadSpec, build_workload
from acstudio.workload.spec import make_optimizer

MANIFEST_SCHEMA = "acstudio.export"
MANIFEST_VERSION = 1
MODULE = "step.py"
CONSTANTS = "constants.pt"
# Optimizer settings that choose an implementation, not the update rule the graph computes.
IMPLEMENTATION_FLAGS = {"foreach", "fused", "capturable", "differentiable"}


class ExportError(ACStudioError):
    """The rewritten step cannot be written as a self-contained module."""


def export(profile: Profile, plan, out_dir: str | os.PathLike, progress: ProgressFn | None = None, *,
           replay_mode: str | None = None) -> list[str]:
    """Write ``out_dir`` (replacing it as a whole) for ``plan`` applied to ``profile``; returns the files written."""
    recomputed = plan_activations(plan, profile)
    report(progress, 0, 4, "rewriting the step")
    step = deserialize_step(profile.graph)
    rewritten = rewrite_step(step, profile, recomputed, replay_mode=replay_mode)
    report(progress, 1, 4, "describing the workload")
    spec = WorkloadSpec.from_dict(profile.workload)
    manifest = build_manifest(profile, rewritten, spec, recomputed)
    without_device_index(rewritten.gm)
    source = module_source(rewritten.gm, profile)
    # Saved on the CPU; Step(device) loads them onto the model's device.
    constants = {n.target: getattr(rewritten.gm, n.target).cpu() for n in rewritten.gm.graph.nodes
                 if n.op == "get_attr"}
    names = []
    report(progress, 2, 4, "writing files")
    with atomic_dir(out_dir) as tmp:
        if isinstance(plan, Plan):
            names += [os.path.basename(p) for p in plan.export_schedule(tmp)]
        else:
            names += write_schedule(tmp, rewritten)
        (tmp / MODULE).write_text(source, encoding="utf-8")
        names.append(MODULE)
        if constants:
            torch.save(constants, tmp / CONSTANTS)
            names.append(CONSTANTS)
        write_document(tmp / "manifest.json", MANIFEST_SCHEMA, MANIFEST_VERSION, manifest)
        names.append("manifest.json")
        (tmp / "report.md").write_text(report_text(profile, plan, step, rewritten), encoding="utf-8")
        names.append("report.md")
        report(progress, 3, 4, "checking the module")
        compile(source, str(tmp / MODULE), "exec")
    report(progress, 4, 4, "exported")
    return [str(Path(out_dir) / n) for n in names]


# -- manifest ------------------------------------------------------------------------------------------------
def _shape(text: str) -> list[int]:
    return [] if text in ("scalar", "") else [int(d) for d in text.split("x")]


def optimizer_description(name: str) -> dict[str, Any]:
    """Type and update-rule hyperparameters of the workload's optimizer, as torch.optim builds it."""
    opt = make_optimizer(name, [torch.nn.Parameter(torch.zeros(1))])
    hyper = {k: list(v) if isinstance(v, tuple) else v for k, v in opt.defaults.items()
             if k not in IMPLEMENTATION_FLAGS}
    return {"type": type(opt).__name__, "hyperparameters": hyper}


def build_manifest(profile: Profile, step: RewrittenStep, spec: WorkloadSpec, recomputed: list[str]) -> dict:
    placeholders = [r for r in profile.nodes if r.op == "placeholder"]
    inputs = [{"kind": s.kind, "key": s.key, "shape": _shape(r.shape), "dtype": r.dtype}
              for s, r in zip(step.inputs, placeholders)]
    batch = build_workload(spec).batch
    leaves = pytree.tree_flatten_with_path(batch)[0]
    return {
        "profile_fingerprint": profile.fingerprint,
        "workload": profile.workload,
        "precision": spec.precision,
        "device": profile.environment.get("device_type", "cpu"),
        "torch": torch.__version__,
        "inputs": inputs,
        "grad_params": list(step.grad_params),
        "parameters": {i["key"]: {"shape": i["shape"], "dtype": i["dtype"]} for i in inputs if i["kind"] == "param"},
        "buffers": {i["key"]: {"shape": i["shape"], "dtype": i["dtype"]} for i in inputs if i["kind"] == "buffer"},
        "batch": [{"path": pytree.keystr(path), "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                  for path, t in leaves],
        "optimizer": optimizer_description(spec.optimizer),
        "recomputed": recomputed,
        "module": MODULE,
    }


# -- step.py ---------------------------------------------------------------------------------------------------
def without_device_index(gm: fx.GraphModule) -> None:
    """Make tensors the graph creates land on the *current* device (``cuda``, not ``cuda:0``), so a step captured
    on one GPU runs on whichever GPU ``load_step`` finds the model on."""

    def strip(value):
        return torch.device(value.type) if isinstance(value, torch.device) and value.index is not None else value

    for node in gm.graph.nodes:
        node.args = pytree.tree_map(strip, node.args)
        node.kwargs = pytree.tree_map(strip, node.kwargs)
    gm.recompile()


def module_source(gm: fx.GraphModule, profile: Profile) -> str:
    """The graph's generated Python as a module that needs only torch: ``Step()(*flat_inputs)``."""
    code = gm.graph.python_code(root_module="self")
    header = []
    for name, value in sorted(code.globals.items()):
        if isinstance(value, types.ModuleType):
            header.append(f"import {value.__name__}" if value.__name__ == name else
                          f"import {value.__name__} as {name}")
        elif value is torch.device:
            header.append(f"{name} = torch.device")
        elif value is type(None):
            header.append(f"{name} = type(None)")
        elif isinstance(value, float) and not math.isfinite(value):
            header.append(f"{name} = float({str(value)!r})")
        else:
            raise ExportError(f"cannot export the step: its code refers to {name} = {value!r}")
    header.sort(key=lambda line: (not line.startswith("import"), line))
    body = "\n".join(f"    {line}" if line else "" for line in code.src.strip("\n").splitlines())
    w = profile.workload
    return f'''"""Training step rewritten by AC Studio for {w["model"]} (batch {w["batch_size"]}, {w["optimizer"]}, \
{w["precision"]}); profile {profile.fingerprint}.

Step()(*flat_inputs) runs one whole iteration (forward, loss, backward, optimizer update) and returns
[loss, *gradients]; it updates the parameter, buffer and optimizer-state tensors it is given in place. The input
order is manifest.json's "inputs". Activations chosen for recomputation are freed after their last forward use
and replayed (nodes named *_rc*) right before their first backward use. Use acstudio.load_step to bind it to a
model and an optimizer, or call it yourself under torch.no_grad() (and, on a GPU other than the current one,
inside torch.cuda.device(...)).
"""

import os

{chr(10).join(header)}


class Step(torch.nn.Module):
    def __init__(self, device="{profile.environment.get("device_type", "cpu")}"):
        super().__init__()
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "{CONSTANTS}")
        if os.path.exists(path):  # tensors the traced code created from Python constants
            for name, value in torch.load(path, weights_only=True, map_location=device).items():
                setattr(self, name, value)

{body}
'''


# -- schedule and report ------------------------------------------------------------------------------------------
def write_schedule(directory: Path, step: RewrittenStep) -> list[str]:
    """``schedule.json`` and ``schedule.csv`` from the rewrite, for a plan given as a bare list of activation ids
    (a :class:`Plan` writes its own)."""
    rows = [dataclasses.asdict(r) for r in step.recomputations]
    (directory / "schedule.json").write_text(json.dumps(rows, indent=1), encoding="utf-8")
    with open(directory / "schedule.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=[fl.name for fl in dataclasses.fields(Recomputation)])
        writer.writeheader()
        writer.writerows({**row, "replay_nodes": " ".join(row["replay_nodes"])} for row in rows)
    return ["schedule.json", "schedule.csv"]


def report_text(profile: Profile, plan, step, rewritten: RewrittenStep) -> str:
    by_id = profile.node_by_id

    def where(node_id: str) -> str:
        r = by_id[node_id]
        return f"`{node_id}` {r.target.removeprefix('aten.')}"

    base_acct = max(live_bytes(step.gm, profile))
    new_acct = max(live_bytes(rewritten.gm, profile))
    it = profile.iteration_ms
    lines = [
        f"# AC Studio export: {profile.label}",
        "",
        f"- Profile `{profile.fingerprint}`, {profile.environment.get('device', '?')}, "
        f"torch {profile.environment.get('torch', '?')}",
    ]
    if isinstance(plan, Plan):
        lines.append(f"- Plan: {plan.solver}, budget {format_bytes(plan.budget_bytes)}, {plan.stop_reason}")
    lines += [
        f"- {len(rewritten.recomputations)} activations recomputed "
        f"({format_bytes(sum(r.bytes for r in rewritten.recomputations))}), "
        f"{sum(len(r.replay_nodes) for r in rewritten.recomputations)} nodes replayed",
        "",
        "## Peak memory",
        "",
        "| | bytes | |",
        "|---|---:|---|",
        f"| baseline, measured | {profile.peak_bytes:,} | {format_bytes(profile.peak_bytes)} |",
    ]
    if isinstance(plan, Plan):
        lines.append(f"| predicted by the plan | {plan.predicted_peak_bytes:,} | "
                     f"{format_bytes(plan.predicted_peak_bytes)} |")
    lines += [
        f"| storage-accounted, captured graph | {base_acct:,} | {format_bytes(base_acct)} |",
        f"| storage-accounted, rewritten graph | {new_acct:,} | {format_bytes(new_acct)} |",
        "",
        "Storage accounting counts the tensors FX's generated code keeps alive (no allocator overhead); "
        "`acstudio verify --device cuda` measures the real peak.",
        "",
        "## Extra time",
        "",
        f"- Baseline iteration: {it:.2f} ms",
        f"- Replayed nodes (their measured run time): {rewritten.replay_ms:.2f} ms"
        + (f" (+{100 * rewritten.replay_ms / it:.1f} %)" if it > 0 else ""),
    ]
    if isinstance(plan, Plan):
        lines.append(f"- Predicted by the plan: {plan.predicted_extra_ms:.2f} ms")
    lines += [
        "",
        "## Recomputed activations",
        "",
        "| activation | bytes | module | freed after | recomputed before | replayed with | nodes | ms |",
        "|---|---:|---|---|---|---|---:|---:|",
    ]
    for r in rewritten.recomputations:
        lines.append(f"| `{r.activation}` | {r.bytes:,} | {r.module or '-'} | {where(r.freed_after)} | "
                     f"{where(r.recompute_before)} | `{r.replayed_by}` | {len(r.replay_nodes)} | "
                     f"{r.replay_ms:.3f} |")
    lines += [
        "",
        "## Use",
        "",
        "```python",
        "import acstudio",
        "",
        "step = acstudio.load_step(EXPORT_DIR, model, optimizer)  # checks them against manifest.json",
        "for batch in loader:  # batches shaped like the profiled one",
        "    loss = step(batch)  # forward, backward and optimizer.step() in one call; sets .grad",
        "```",
        "",
    ]
    return "\n".join(lines)
