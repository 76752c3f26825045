"""The user's own model: ``path/to/file.py:factory`` or ``package.module:factory``.

Contract: ``factory(batch_size: int) -> (model, batch, loss_fn)`` or ``(model, batch, loss_fn, optimizer)``
where ``loss_fn(model, batch)`` returns a scalar loss tensor and ``optimizer`` (optional) is a
``torch.optim.SGD``, ``Adam`` or ``AdamW`` over the model's parameters, with the user's own param groups and
settings. See ``resources/custom_model_example.py``.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
from pathlib import Path

import torch

from acstudio.errors import ACStudioError, UnknownModelError
from acstudio.workload.spec import OPTIMIZER_CLASSES, Workload, WorkloadSpec


def load_factory(reference: str):
    module_ref, _, attr = reference.rpartition(":")
    if not module_ref or not attr:
        raise UnknownModelError(f"{reference!r} is not a model reference — give a zoo name (`acstudio models`), "
                                "'path/to/file.py:factory' or 'package.module:factory'")
    if module_ref.endswith(".py") or "/" in module_ref:
        path = Path(module_ref)
        if not path.is_file():
            raise UnknownModelError(f"{reference!r}: no such file {path} — check the path")
        name = f"acstudio_user_{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise UnknownModelError(f"{reference!r}: cannot import {path} — give a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except SystemExit as exc:
            raise UnknownModelError(f"{reference!r}: importing {path} called sys.exit({exc.code!r}) — a model file "
                                    "must not exit when imported; put its script part under "
                                    "`if __name__ == '__main__':`") from exc
        except Exception as exc:
            raise UnknownModelError(f"{reference!r}: importing {path} failed: {exc} — fix the file") from exc
    else:
        try:
            module = importlib.import_module(module_ref)
        except ImportError as exc:
            raise UnknownModelError(f"{reference!r}: cannot import {module_ref}: {exc} — check the module name "
                                    "and that it is installed") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UnknownModelError(f"{reference!r}: {module_ref} has no callable {attr!r} — name its factory "
                                "function after the colon")
    return factory


def build(spec: WorkloadSpec) -> Workload:
    factory = load_factory(spec.model)
    try:
        result = factory(spec.batch_size)
    except SystemExit as exc:
        raise ACStudioError(f"{spec.model}({spec.batch_size}) called sys.exit({exc.code!r}) — the factory must "
                            "return (model, batch, loss_fn), not exit") from exc
    except Exception as exc:
        raise ACStudioError(f"{spec.model}({spec.batch_size}) raised {type(exc).__name__}: {exc} — fix the "
                            "factory (--debug shows where it failed)") from exc
    if not (isinstance(result, tuple) and len(result) in (3, 4)):
        raise ACStudioError(f"{spec.model}: the factory returned {type(result).__name__} — return (model, batch, "
                            "loss_fn) or (model, batch, loss_fn, optimizer) as resources/custom_model_example.py does")
    model, batch, loss_fn, optimizer = (*result, None)[:4]
    if not isinstance(model, torch.nn.Module) or not callable(loss_fn):
        raise ACStudioError(f"{spec.model}: the factory returned a {type(model).__name__} model and a "
                            f"{type(loss_fn).__name__} loss — return (nn.Module, batch, callable loss_fn)")
    if optimizer is not None:
        spec = dataclasses.replace(spec, optimizer=check_optimizer(spec, model, optimizer))
    return Workload(spec=spec, model=model, batch=batch, loss_fn=loss_fn, family="custom", optimizer=optimizer)


def check_optimizer(spec: WorkloadSpec, model: torch.nn.Module, optimizer) -> str:
    """The name of a factory's own optimizer, once it is known to be one a step can be captured with."""
    name = next((n for n, cls in OPTIMIZER_CLASSES.items() if type(optimizer) is cls), None)
    if name is None:
        supported = ", ".join(f"torch.optim.{cls.__name__}" for cls in OPTIMIZER_CLASSES.values())
        raise ACStudioError(f"{spec.model}: the factory's optimizer is {type(optimizer).__name__}; AC Studio "
                            f"captures {supported} — return one of those, or no optimizer to use --optimizer")
    if spec.hyperparameters():
        given = ", ".join(f"--{k.replace('_', '-')}" for k in spec.hyperparameters())
        raise ACStudioError(f"{spec.model}: the factory returns its own optimizer, so {given} would be ignored — "
                            "set the hyperparameters in the factory or return no optimizer")
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    names = {id(p) for p in model.parameters()}
    if held - names:
        raise ACStudioError(f"{spec.model}: the factory's optimizer holds tensors that are not parameters of the "
                            "model — build it from model.parameters()")
    return name
