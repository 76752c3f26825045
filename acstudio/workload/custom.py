"""The user's own model: ``path/to/file.py:factory`` or ``package.module:factory``.

Contract: ``factory(batch_size: int) -> (model, batch, loss_fn)`` where ``loss_fn(model, batch)`` returns
a scalar loss tensor. See ``resources/custom_model_example.py``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import torch

from acstudio.errors import ACStudioError, UnknownModelError
from acstudio.workload.spec import Workload, WorkloadSpec


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
    except Exception as exc:
        raise ACStudioError(f"{spec.model}({spec.batch_size}) raised {type(exc).__name__}: {exc} — fix the "
                            "factory (--debug shows where it failed)") from exc
    if not (isinstance(result, tuple) and len(result) == 3):
        raise ACStudioError(f"{spec.model}: the factory returned {type(result).__name__} — return (model, batch, "
                            "loss_fn) as resources/custom_model_example.py does")
    model, batch, loss_fn = result
    if not isinstance(model, torch.nn.Module) or not callable(loss_fn):
        raise ACStudioError(f"{spec.model}: the factory returned a {type(model).__name__} model and a "
                            f"{type(loss_fn).__name__} loss — return (nn.Module, batch, callable loss_fn)")
    return Workload(spec=spec, model=model, batch=batch, loss_fn=loss_fn, family="custom")
