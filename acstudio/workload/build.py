"""Build a workload from its spec: a zoo model or the user's own factory, seeded, in train mode."""

from __future__ import annotations

import torch

from acstudio.errors import ACStudioError, ConfigError, one_line
from acstudio.workload import custom, zoo
from acstudio.workload.spec import Workload, WorkloadSpec


def check_model_reference(model: str) -> None:
    """Refuse a model reference that names no model (a zoo name, or a factory that cannot be imported), building
    nothing: for commands that build it later, in processes of their own (``bench``)."""
    if ":" in model:
        custom.load_factory(model)
    else:
        zoo.check_name(model)


def build_workload(spec: WorkloadSpec) -> Workload:
    """Build the model (random init, seeded), a batch and the loss function, on the CPU."""
    torch.manual_seed(spec.seed)
    if ":" in spec.model:
        workload = custom.build(spec)
    else:
        try:
            workload = zoo.build(spec)
        except ACStudioError:
            raise
        except Exception as exc:  # a --config value the model's own code rejects (a type, a zero, a range)
            if not spec.config:
                raise
            given = " ".join(f"{k}={v}" for k, v in spec.config)
            raise ConfigError(f"{spec.model}: cannot build it with --config {given}: {one_line(exc)} — change "
                              "those values (or leave them out for the model's defaults)") from exc
    if not any(p.requires_grad for p in workload.model.parameters()):
        raise ACStudioError(f"{spec.model}: the model has no trainable parameters, so there is no training step "
                            "to measure — give a model with parameters that require grad")
    workload.model.train()
    return workload


def list_models() -> dict[str, list[str]]:
    return zoo.list_models()
