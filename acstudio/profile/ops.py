"""Operators by their stored names: how a graph node's target is written in a profile, the torch op a name
stands for, and whether an op draws random numbers.

Capture writes these names, and the replay rules, the simulator and the rewriter read them back, so they live
with the data model rather than in capture.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch

from acstudio.errors import ProfileFileError

# Python-level nodes: getitem of multi-output ops, and the scalar arithmetic torch.optim does on hyperparameters
# and step counters (``lr / (1 - beta1 ** step)``).
_PY_TARGETS = {f"operator.{name}": getattr(operator, name)
               for name in ("getitem", "add", "sub", "mul", "truediv", "pow", "neg", "floordiv", "mod")}
_PY_NAMES = {fn: name for name, fn in _PY_TARGETS.items()}


def target_name(target: Any) -> str:
    """The stored name of a graph node's target: ``aten.mm.default``, ``operator.getitem`` or a ``get_attr`` path."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._schema.name.split('::')[1]}.{target._overloadname}"
    if target in _PY_NAMES:
        return _PY_NAMES[target]
    if isinstance(target, str):
        return target
    raise ProfileFileError(f"cannot serialize graph target {target!r}")


def resolve_target(name: str):
    """The callable a stored target name stands for (the inverse of :func:`target_name` for call targets)."""
    if name in _PY_TARGETS:
        return _PY_TARGETS[name]
    namespace, packet, overload = name.split(".")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), packet), overload)
    except AttributeError as exc:
        raise ProfileFileError(f"this torch has no operator {name} (profile made with another version?)") from exc


@functools.cache
def aten_op(name: str) -> torch._ops.OpOverload | None:
    """The aten op overload a stored target name (``aten.mm.default``) names, or ``None``."""
    if not name.startswith("aten."):
        return None
    try:
        return resolve_target(name)
    except ProfileFileError:
        return None


def draws_random(target, args, kwargs) -> bool:
    """Whether an op draws random numbers: it is tagged ``nondeterministic_seeded`` and its dropout probability
    is not 0 (SDPA with ``dropout_p == 0``, dropout with ``p == 0`` or ``train=False`` draw nothing).

    ``args``/``kwargs`` are an fx node's or their serialized form (scalars are stored as they are)."""
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    schema = {a.name: (i, a) for i, a in enumerate(target._schema.arguments)}

    def value(name: str):
        i, a = schema[name]
        return args[i] if i < len(args) else kwargs.get(name, a.default_value)

    if "dropout_p" in schema:
        return value("dropout_p") != 0
    if "train" in schema and "p" in schema:
        return value("train") is not False and value("p") != 0
    return True
