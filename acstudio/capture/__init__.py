"""Capture ONE training iteration (forward, loss, backward, optimizer update) as one aten-level fx graph.

The names below are imported on first use (PEP 562), so that torch-free modules of this package
(:mod:`acstudio.capture.replay_rules`) load without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from acstudio.capture.step import CapturedStep, InputSlot
    from acstudio.capture.tracer import capture_step

__all__ = ["CapturedStep", "InputSlot", "capture_step"]
_HOMES = {"CapturedStep": "acstudio.capture.step", "InputSlot": "acstudio.capture.step",
          "capture_step": "acstudio.capture.tracer"}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
