"""``load_step``: bind an exported step to a live model and optimizer, refusing any that it was not made for.

The exported graph is specialised to what was captured: parameter and buffer shapes and dtypes, which parameters
are trained, training mode and the module settings it baked in as constants (dropout probabilities, eps), the
batch's structure and shapes, the optimizer's type, param groups and boolean switches, and the device. All of that is
checked against ``manifest.json`` before, so a mismatch is a clear error instead of a wrong update.

The optimizer's hyperparameters (lr, betas, eps, momentum, dampening, weight decay) are graph inputs: every call
reads them from ``optimizer.param_groups``, so an LR scheduler (or any other change) takes effect on the next
call. Only the branches torch.optim took on them while tracing (weight decay zero or not, momentum zero or
not) are checked at every call. Exports of older profiles have the values baked in as constants: any change
is refused, as before.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import os
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from acstudio.capture.step import CapturedStep, InputSlot, OptimizerRecord, module_settings, prepare_optimizer
from acstudio.capture.tracer import make_capturable
from acstudio.errors import ACStudioError
from acstudio.export.exporter import MANIFEST_SCHEMA, MANIFEST_VERSION
from acstudio.fileio import read_document
from acstudio.rewrite.offload import RUNTIME_ATTR

_module_ids = itertools.count()


class ExportMismatchError(ACStudioError):
    """The model, optimizer or batch differs from what the exported step was captured for."""


class LoadedStep:
    """``loss = step(batch)``: one training iteration that updates the model and optimizer in place, like
    ``optimizer.zero_grad(); loss_fn(model, batch).backward(); optimizer.step()``, and leaves the gradients in
    ``.grad``."""

    def __init__(self, directory: Path, manifest: dict[str, Any], model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer) -> None:
        self.directory = directory
        self.manifest = manifest
        self.model = model
        self.optimizer = optimizer
        self.device = next(model.parameters()).device
        module = _import(directory / manifest["module"])
        # The generated module has the captured graph's calling convention, so CapturedStep can feed it.
        self._step = CapturedStep(gm=module.Step(self.device),
                                  inputs=[InputSlot(i["kind"], i["key"]) for i in manifest["inputs"]],
                                  grad_params=list(manifest["grad_params"]), optimizer=optimizer_record(manifest))
        runtime = getattr(self._step.gm, RUNTIME_ATTR, None)
        if runtime is not None:  # the pinned pool of a step that offloads, or the host's lack of memory, now
            runtime.ensure_pool(self.device)

    def __call__(self, batch: Any) -> torch.Tensor:
        changed = training_problems(self.manifest, self.model)
        if changed:
            raise ExportMismatchError(f"the model changed since load_step: {changed[0]}")
        check_hyperparameters(self.manifest, self.optimizer, self._step.optimizer)
        # Tensors the graph creates go to the current device: make that the model's GPU.
        on_device = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        with on_device:
            loss = self._step.run(self.model, self.optimizer, ordered_batch(self.manifest, batch))
        return loss.detach()


def load_step(directory: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> LoadedStep:
    """Check ``model`` and ``optimizer`` against the export in ``directory`` and return its step bound to them.

    An optimizer without state gets it created first, as a fresh optimizer would on its first ``step()``.
    """
    directory = Path(directory)
    manifest = read_document(directory / "manifest.json", MANIFEST_SCHEMA, MANIFEST_VERSION)
    check_model(manifest, model)
    check_optimizer(manifest, model, optimizer)
    _refuse(first_step_problems(optimizer), "optimizer")
    prepare_optimizer(model, optimizer)
    if traced_capturable_on_cuda(manifest):
        make_capturable(optimizer)
    check_state(manifest, model, optimizer)
    return LoadedStep(directory, manifest, model, optimizer)


def _import(path: Path):
    if not path.is_file():
        raise ACStudioError(f"{path}: missing from the export folder")
    spec = importlib.util.spec_from_file_location(f"acstudio_exported_step_{next(_module_ids)}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _describe(t: torch.Tensor) -> dict[str, Any]:
    return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}


def _differences(what: str, expected: dict[str, dict], actual: dict[str, dict]) -> list[str]:
    out = [f"{what} {k} is missing" for k in expected if k not in actual]
    out += [f"unexpected {what} {k}" for k in actual if k not in expected]
    out += [f"{what} {k}: expected {expected[k]['dtype']}{expected[k]['shape']}, got {v['dtype']}{v['shape']}"
            for k, v in actual.items() if k in expected and v != expected[k]]
    return out


def _refuse(problems: list[str], what: str) -> None:
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise ExportMismatchError(f"this step was exported for another {what}: {'; '.join(problems[:5])}{more}")


def check_model(manifest: dict, model: torch.nn.Module) -> None:
    params = {n: _describe(p) for n, p in model.named_parameters()}
    buffers = {n: _describe(b) for n, b in model.named_buffers()}
    problems = _differences("parameter", manifest["parameters"], params)
    problems += _differences("buffer", manifest["buffers"], buffers)
    problems += training_problems(manifest, model) + setting_problems(manifest, model)
    elsewhere = [n for n, p in model.named_parameters() if p.device.type != manifest["device"]]
    if elsewhere:
        problems.append(f"parameter {elsewhere[0]} is not on {manifest['device']}, where the step was captured")
    devices = {p.device for p in model.parameters()} | {b.device for b in model.buffers()}
    if len(devices) > 1:
        problems.append(f"the model is spread over {', '.join(sorted(map(str, devices)))}; the step runs on one device")
    _refuse(problems, "model")


def training_problems(manifest: dict, model: torch.nn.Module) -> list[str]:
    """What the graph cannot follow that a training loop changes between steps: which parameters are trained (the
    graph computes a gradient for, and updates, exactly those it was captured with) and the training flag (it runs
    the ops of training mode). Checked at ``load_step`` and at every call."""
    trained = set(manifest["grad_params"])
    out = []
    for name, p in model.named_parameters():
        if name in trained and not p.requires_grad:
            out.append(f"parameter {name} is frozen (requires_grad=False), but the step trains it (it would "
                       "update it and give it a .grad) — export the step from a profile of the model with the same "
                       "parameters frozen")
        elif p.requires_grad and name not in trained and name in manifest["parameters"]:
            out.append(f"parameter {name} requires grad, but the step was exported with it frozen — set "
                       f"requires_grad=False on it, or export from a profile that trains it")
    out += [f"module {name or '(the root module)'} is in eval mode, but the step was exported in training mode "
            "(dropout, BatchNorm's batch statistics) — call model.train() before the step, and evaluate with the "
            "model itself" for name, m in model.named_modules() if not m.training][:1]
    return out


def setting_problems(manifest: dict, model: torch.nn.Module) -> list[str]:
    """Module settings the graph baked in as constants (dropout probabilities, eps, ...) that the model has
    changed; exports made before they were recorded are not checked."""
    recorded = manifest.get("modules")
    if not recorded:
        return []
    out = []
    for name, now in module_settings(model).items():
        then = recorded.get(name, {})
        out += [f"module {name or '(the root module)'} has {k}={v!r}, the step was exported with {k}={then[k]!r} "
                f"(baked into the graph) — build the model with {k}={then[k]!r}, or profile and export it with "
                f"{k}={v!r}" for k, v in now.items() if k != "training" and k in then and then[k] != v]
    return out


def optimizer_record(manifest: dict) -> OptimizerRecord | None:
    """What the step needs from its optimizer; None for an export whose hyperparameters are graph constants."""
    if any(i["kind"] == "hyper" for i in manifest["inputs"]):
        return OptimizerRecord.from_dict(manifest["optimizer"])
    return None


def _baked_in_problems(manifest: dict, optimizer: torch.optim.Optimizer) -> list[str]:
    """For an export with constant hyperparameters: every group must have exactly the captured values."""
    expected = manifest["optimizer"]["hyperparameters"]
    problems = []
    for g, group in enumerate(optimizer.param_groups):
        for k, v in expected.items():
            got = list(group[k]) if isinstance(group.get(k), tuple) else group.get(k)
            if got != v:
                problems.append(f"param group {g} has {k}={got!r}, the step was captured with {k}={v!r}")
    return problems


def traced_capturable_on_cuda(manifest: dict) -> bool:
    """Exports made on CUDA before the capturable flag was recorded traced Adam/AdamW's capturable update, which
    reads step counters on the GPU: the live optimizer is switched to it, as then."""
    groups = manifest["optimizer"].get("groups") or [{}]
    return (manifest["device"] == "cuda" and manifest["optimizer"]["type"] in ("Adam", "AdamW")
            and any("capturable" not in g for g in groups))


def check_optimizer(manifest: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse another optimizer type, parameter set, param-group layout or switch; accept any hyperparameters
    the traced update can follow."""
    kind = manifest["optimizer"]["type"]
    if type(optimizer).__name__ != kind:
        raise ExportMismatchError(f"this step was exported for torch.optim.{kind}, got {type(optimizer).__name__}")
    record = optimizer_record(manifest)
    if record is not None:
        _refuse(record.problems(model, optimizer), "optimizer")
        return
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    problems = [f"the optimizer does not update parameter {n}" for n, p in model.named_parameters()
                if id(p) not in held]
    _refuse(problems + _baked_in_problems(manifest, optimizer), "optimizer")


def first_step_problems(optimizer: torch.optim.Optimizer) -> list[str]:
    """What a fresh optimizer's first ``step()`` does that the graph, traced with the optimizer's state in place,
    cannot: torch.optim's SGD starts each momentum buffer at the first gradient and dampens from the second step on."""
    if not isinstance(optimizer, torch.optim.SGD) or any(optimizer.state.get(p) for g in optimizer.param_groups
                                                         for p in g["params"]):
        return []
    return [f"param group {g} has momentum with dampening={group['dampening']!r}, which torch.optim's SGD skips on "
            "its first step and the exported step cannot — take one eager optimizer step before load_step, or use "
            "dampening=0" for g, group in enumerate(optimizer.param_groups) if group["momentum"] and group["dampening"]]


def check_hyperparameters(manifest: dict, optimizer: torch.optim.Optimizer, record: OptimizerRecord | None) -> None:
    """At every call: hyperparameters still within what the exported graph computes (e.g. after an LR
    scheduler's step). ``record`` is :func:`optimizer_record` of the manifest."""
    if record is not None:
        problems = record.violated(optimizer)
        if problems:
            raise ExportMismatchError(f"the optimizer changed since load_step: {problems[0]}")
        return
    problems = _baked_in_problems(manifest, optimizer)
    if problems:
        raise ExportMismatchError(f"the optimizer changed since load_step: {problems[0]}; the exported step bakes "
                                  "its hyperparameters in, so export again for the new settings")


def check_state(manifest: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    params = dict(model.named_parameters())
    problems = []
    for i in manifest["inputs"]:
        if i["kind"] != "opt_state":
            continue
        fqn, _, key = i["key"].rpartition("/")
        value = optimizer.state[params[fqn]].get(key)
        if not isinstance(value, torch.Tensor):
            problems.append(f"no optimizer state {key} for {fqn}")
        elif _describe(value) != {"shape": i["shape"], "dtype": i["dtype"]}:
            problems.append(f"optimizer state {i['key']}: expected {i['dtype']}{i['shape']}, got "
                            f"{_describe(value)['dtype']}{_describe(value)['shape']}")
    _refuse(problems, "optimizer state")


def ordered_batch(manifest: dict, batch: Any) -> list[torch.Tensor]:
    """The batch's tensors in the order the graph takes them, matched by their path (``['input_ids']``, ``[0]``)."""
    leaves = {pytree.keystr(path): t for path, t in pytree.tree_flatten_with_path(batch)[0]}
    expected = {b["path"]: {"shape": b["shape"], "dtype": b["dtype"]} for b in manifest["batch"]}
    actual = {k: _describe(t) if isinstance(t, torch.Tensor) else {"shape": "?", "dtype": type(t).__name__}
              for k, t in leaves.items()}
    _refuse(_differences("batch entry", expected, actual), "batch (the graph has static shapes)")
    return [leaves[b["path"]] for b in manifest["batch"]]
