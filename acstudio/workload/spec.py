"""The workload spec: everything needed to rebuild a model, batch, loss and optimizer, and nothing else.

A spec is stored inside every profile so that the profile can be reproduced (and its step re-captured on
another device for verification) from the file alone.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from acstudio.errors import ACStudioError

OPTIMIZERS = ("sgd", "adam", "adamw")
# The optimizer classes a step can be captured with (a factory may return one of them itself).
OPTIMIZER_CLASSES = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
# Settings a practitioner would start from; --lr, --weight-decay, --momentum and --betas override them.
DEFAULT_HYPERPARAMETERS = {
    "sgd": {"lr": 0.01, "momentum": 0.9, "weight_decay": 0.0},
    "adam": {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0},
    "adamw": {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.01},
}
PRECISIONS = ("fp32", "bf16")

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


@dataclass(frozen=True)
class WorkloadSpec:
    """How to rebuild one training configuration. ``model`` is a zoo name or ``file.py:factory``."""

    model: str
    batch_size: int
    optimizer: str = "adam"
    precision: str = "fp32"
    image_size: int = 224
    seq_len: int = 512
    config: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    seed: int = 0
    # Optimizer hyperparameters; None keeps DEFAULT_HYPERPARAMETERS (or the factory's own optimizer's settings).
    lr: float | None = None
    weight_decay: float | None = None
    momentum: float | None = None
    betas: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        for name, value in (("batch size", self.batch_size), ("sequence length", self.seq_len),
                            ("image size", self.image_size)):
            if value < 1:
                raise ACStudioError(f"the {name} must be at least 1, got {value} — give a positive number")
        if self.config and ":" in self.model:
            raise ACStudioError(f"{self.model}: --config applies to zoo models only — a custom factory builds "
                                "its own model; change it in the factory")
        if self.optimizer not in OPTIMIZERS:
            raise ACStudioError(f"unknown optimizer {self.optimizer!r} — choose one of {', '.join(OPTIMIZERS)}")
        if self.precision not in PRECISIONS:
            raise ACStudioError(f"unknown precision {self.precision!r} — choose one of {', '.join(PRECISIONS)}")
        if self.betas is not None:
            object.__setattr__(self, "betas", tuple(self.betas))
        make_optimizer(self.optimizer, [torch.nn.Parameter(torch.zeros(1))], **self.hyperparameters())

    def hyperparameters(self) -> dict[str, Any]:
        """The optimizer settings given explicitly (``--lr`` ...), as torch.optim keyword arguments."""
        given = {"lr": self.lr, "weight_decay": self.weight_decay, "momentum": self.momentum, "betas": self.betas}
        return {k: v for k, v in given.items() if v is not None}

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["config"] = [list(kv) for kv in self.config]
        d["betas"] = list(self.betas) if self.betas is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WorkloadSpec:
        d = dict(d)
        d["config"] = tuple((str(k), str(v)) for k, v in d.get("config", ()))
        return cls(**d)

    def with_batch_size(self, batch_size: int) -> WorkloadSpec:
        return dataclasses.replace(self, batch_size=batch_size)

    def cli_args(self) -> str:
        """The ``acstudio profile`` arguments that rebuild this workload."""
        parts = [self.model, "--batch-size", str(self.batch_size), "--optimizer", self.optimizer,
                 "--precision", self.precision, "--image-size", str(self.image_size),
                 "--seq-len", str(self.seq_len)]
        for k, v in self.config:
            parts += ["--config", f"{k}={v}"]
        for k, v in self.hyperparameters().items():
            parts += [f"--{k.replace('_', '-')}", ",".join(map(repr, v)) if k == "betas" else repr(v)]
        return shlex.join(parts)

    @property
    def label(self) -> str:
        return f"{self.model} bs{self.batch_size} {self.optimizer} {self.precision}"


@dataclass
class Workload:
    """A built workload: a model in train mode, one batch, the loss function and an optimizer factory."""

    spec: WorkloadSpec
    model: torch.nn.Module
    batch: Any
    loss_fn: LossFn
    family: str  # "torchvision", "transformers" or "custom"
    optimizer: torch.optim.Optimizer | None = None  # a custom factory's own optimizer, the template for copies

    def make_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """A fresh optimizer (no state) for ``model``, by default this workload's own model, or a copy of it.

        It is the spec's optimizer with its hyperparameters or, for a factory that returns its own optimizer,
        one of the same type with the same param groups and settings, matched to ``model`` by parameter name.
        """
        model = self.model if model is None else model
        if self.optimizer is None:
            return make_optimizer(self.spec.optimizer, model.parameters(), **self.spec.hyperparameters())
        name_of = {id(p): n for n, p in self.model.named_parameters()}
        params = dict(model.named_parameters())
        groups = [{**g, "params": [params[name_of[id(p)]] for p in g["params"]]} for g in self.optimizer.param_groups]
        return type(self.optimizer)(groups)

    def to(self, device: torch.device | str) -> Workload:
        self.model.to(device)
        self.batch = move_batch(self.batch, device)
        return self


def make_optimizer(name: str, params, **hyperparameters) -> torch.optim.Optimizer:
    """torch.optim's own implementation ``name`` with DEFAULT_HYPERPARAMETERS, overridden by ``hyperparameters``
    (``lr``, ``weight_decay``, ``momentum`` for SGD, ``betas`` for Adam/AdamW)."""
    if name not in OPTIMIZER_CLASSES:
        raise ACStudioError(f"unknown optimizer {name!r} — choose one of {', '.join(OPTIMIZERS)}")
    defaults = DEFAULT_HYPERPARAMETERS[name]
    foreign = [k for k in hyperparameters if k not in defaults]
    if foreign:
        option = f"--{foreign[0].replace('_', '-')}"
        users = [o for o, d in DEFAULT_HYPERPARAMETERS.items() if foreign[0] in d]
        raise ACStudioError(f"{option} does not apply to {name} — use it with --optimizer {' or '.join(users)}")
    try:
        return OPTIMIZER_CLASSES[name](params, **{**defaults, **hyperparameters})
    except (ValueError, TypeError) as exc:  # torch.optim's own range checks, e.g. "Invalid learning rate: -1"
        raise ACStudioError(f"{name}: {exc} — give a value torch.optim.{OPTIMIZER_CLASSES[name].__name__} accepts")\
            from exc


def move_batch(batch: Any, device: torch.device | str) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: move_batch(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_batch(v, device) for v in batch)
    return batch
