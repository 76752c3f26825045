"""Export a verified plan as a drop-in training step (``step.py`` + manifest + schedule + report) and load it back."""

from acstudio.export.exporter import ExportError, export
from acstudio.export.loader import ExportMismatchError, LoadedStep, load_step

__all__ = ["ExportError", "ExportMismatchError", "LoadedStep", "export", "load_step"]
