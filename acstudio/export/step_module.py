"""The ``step`` export format: the rewritten graph as a drop-in training step (``step.py``, ``manifest.json``,
``report.md``).

``step.py`` is the rewritten graph's generated code with the imports it needs, so it runs with torch alone (a
plan that offloads activations also imports AC Studio's copy runtime, :mod:`acstudio.rewrite.offload`);
:func:`acstudio.load_step` binds it to a live model and optimizer after checking them against ``manifest.json``.
Everything a graph bakes in is recorded there: the parameters, buffers and batch it was traced for (shapes are
static), which parameters it trains, every module's training flag and float settings (dropout probabilities,
eps), the optimizer type, param groups and the branches its update took (its hyperparameters are graph
inputs, read at every call), the precision and device.
"""

from __future__ import annotations

import math
import types
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from acstudio.capture.serialize import deserialize_step
from acstudio.capture.step import IMPLEMENTATION_FLAGS, CapturedStep, module_settings
from acstudio.export.formats import ExportError, ExportFormat, ExportJob, register_format
from acstudio.fileio import write_document
from acstudio.plan.model import Plan
from acstudio.plan.peak import explain_peak, floor_sentence
from acstudio.plan.schedule import PlanContext
from acstudio.profile.model import Profile
from acstudio.rewrite import offload as offload_runtime
from acstudio.rewrite.memory import live_bytes
from acstudio.rewrite.rewriter import RewrittenStep, rewrite_step
from acstudio.simulate.modes import get_mode
from acstudio.simulate.sac import ReplaySac
from acstudio.simulate.simulator import Simulator
from acstudio.units import format_bytes
from acstudio.workload import WorkloadSpec, build_workload
from acstudio.workload.spec import make_optimizer

MANIFEST_SCHEMA = "acstudio.export"
MANIFEST_VERSION = 1
MODULE = "step.py"
CONSTANTS = "constants.pt"


def rewritten(job: ExportJob) -> tuple[CapturedStep, RewrittenStep]:
    """The captured step and its rewrite for the job's plan, made once per export."""

    def make():
        step = deserialize_step(job.profile.graph)
        return step, rewrite_step(step, job.profile, job.recomputed)

    return job.once("rewritten", make)


def write(job: ExportJob, directory: Path) -> list[str]:
    profile, plan = job.profile, job.plan
    step, new = rewritten(job)
    manifest = build_manifest(profile, new, WorkloadSpec.from_dict(profile.workload), job.recomputed)
    without_device_index(new.gm)
    source = module_source(new.gm, profile)
    compile(source, str(directory / MODULE), "exec")
    # Saved on the CPU; Step(device) moves those the graph made on the device onto the model's device.
    constants = {name: value.cpu() for name, value in tensor_constants(new.gm).items()}
    (directory / MODULE).write_text(source, encoding="utf-8")
    names = [MODULE]
    if constants:
        torch.save(constants, directory / CONSTANTS)
        names.append(CONSTANTS)
    write_document(directory / "manifest.json", MANIFEST_SCHEMA, MANIFEST_VERSION, manifest)
    (directory / "report.md").write_text(report_text(profile, plan, step, new), encoding="utf-8")
    return [*names, "manifest.json", "report.md"]


# -- manifest ------------------------------------------------------------------------------------------------
def _shape(text: str) -> list[int]:
    return [] if text in ("scalar", "") else [int(d) for d in text.split("x")]


def optimizer_description(name: str) -> dict[str, Any]:
    """Type and update-rule hyperparameters of the workload's optimizer, as torch.optim builds it: for a profile
    captured with its hyperparameters as graph constants (newer steps record their optimizer themselves)."""
    opt = make_optimizer(name, [torch.nn.Parameter(torch.zeros(1))])
    hyper = {k: list(v) if isinstance(v, tuple) else v for k, v in opt.defaults.items()
             if k not in IMPLEMENTATION_FLAGS}
    return {"type": type(opt).__name__, "hyperparameters": hyper}


def build_manifest(profile: Profile, step: RewrittenStep, spec: WorkloadSpec, recomputed: list[str]) -> dict:
    placeholders = [r for r in profile.nodes if r.op == "placeholder"]
    inputs = [{"kind": s.kind, "key": s.key, "shape": _shape(r.shape), "dtype": r.dtype}
              for s, r in zip(step.inputs, placeholders)]
    workload = build_workload(spec)
    leaves = pytree.tree_flatten_with_path(workload.batch)[0]
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
        "optimizer": step.optimizer.to_dict() if step.optimizer else optimizer_description(spec.optimizer),
        "recomputed": recomputed,
        "offloaded": [o.activation for o in step.offloads],
        "modules": module_settings(workload.model),  # as the profiled model was built and captured (train mode)
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


def tensor_constants(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    """The graph's tensor constants by name (the offload runtime, a submodule, is made by ``Step`` itself)."""
    return {n.target: getattr(gm, n.target) for n in gm.graph.nodes
            if n.op == "get_attr" and isinstance(getattr(gm, n.target), torch.Tensor)}


def cpu_constants(gm: fx.GraphModule) -> tuple[str, ...]:
    """Graph constants that were on the CPU at capture, whatever the step's device."""
    return tuple(sorted(name for name, value in tensor_constants(gm).items() if value.device.type == "cpu"))


def offload_runtime_source(gm: fx.GraphModule) -> str:
    """The line of ``Step.__init__`` that makes the offload runtime of a step that offloads (else empty)."""
    runtime = getattr(gm, offload_runtime.RUNTIME_ATTR, None)
    if not isinstance(runtime, offload_runtime.OffloadRuntime):
        return ""
    made = f"OffloadRuntime({runtime.activations!r}, {runtime.sizes!r})"
    return (f"\n        # copies of offloaded activations to a pinned host pool and back (made on the first step)"
            f"\n        self.{offload_runtime.RUNTIME_ATTR} = {made}")


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
        elif isinstance(value, types.FunctionType) and value.__module__ == offload_runtime.__name__:
            header.append(f"from {offload_runtime.__name__} import {value.__name__} as {name}")
        else:
            raise ExportError(f"cannot export the step: its code refers to {name} = {value!r}")
    runtime = offload_runtime_source(gm)
    if runtime:
        header.append(f"from {offload_runtime.__name__} import OffloadRuntime")
    header.sort(key=lambda line: (not line.startswith(("import", "from")), line))
    body = "\n".join(f"    {line}" if line else "" for line in code.src.strip("\n").splitlines())
    w = profile.workload
    return f'''"""Training step rewritten by AC Studio for {w["model"]} (batch {w["batch_size"]}, {w["optimizer"]}, \
{w["precision"]}); profile {profile.fingerprint}.

Step()(*flat_inputs) runs one whole iteration (forward, loss, backward, optimizer update) and returns
[loss, *gradients]; it updates the parameter, buffer and optimizer-state tensors it is given in place. The input
order is manifest.json's "inputs". Activations chosen for recomputation are freed after their last forward use
and replayed (nodes named *_rc*) right before their first backward use; those chosen for offload are copied
to host memory after forward and back before they are needed (nodes named offload_*). Use acstudio.load_step to
bind it to a model and an optimizer, or call it yourself under torch.no_grad() (and, on a GPU other than the
current one, inside torch.cuda.device(...)).
"""

import os

{chr(10).join(header)}


class Step(torch.nn.Module):
    def __init__(self, device="{profile.environment.get("device_type", "cpu")}"):
        super().__init__()
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "{CONSTANTS}")
        if os.path.exists(path):  # tensors the traced code created from Python constants
            for name, value in torch.load(path, weights_only=True).items():
                # CPU constants stay there (e.g. torch.optim's increment of its CPU step counters)
                setattr(self, name, value if name in {cpu_constants(gm)!r} else value.to(device)){runtime}

{body}
'''


# -- schedule and report ------------------------------------------------------------------------------------------
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
    ]
    if isinstance(plan, Plan):
        ctx = PlanContext(profile, Simulator(profile, keep_random=plan.keep_random))
        lines += ["", f"What sets it: {explain_peak(ctx, plan).summary()}. In a word: {floor_sentence(ctx)}."]
    lines += [
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


def unavailable(job: ExportJob) -> str:
    mode = getattr(job.plan, "replay_mode", "again")
    if isinstance(get_mode(mode), ReplaySac):  # every selective-checkpointing mode
        return ("the plan was priced for selective checkpointing, which the rewritten step does not run — export "
                "it with --format sac, or plan for the rewritten step")
    return ""


register_format(ExportFormat("step", "step.py, manifest.json and report.md: the rewritten graph as a drop-in "
                             "training step for acstudio.load_step", write, unavailable))
