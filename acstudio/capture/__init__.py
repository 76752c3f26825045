"""Capture ONE training iteration (forward, loss, backward, optimizer update) as one aten-level fx graph."""

from acstudio.capture.step import CapturedStep, InputSlot
from acstudio.capture.tracer import capture_step

__all__ = ["CapturedStep", "InputSlot", "capture_step"]
