"""Export a plan: a drop-in training step (``step``), its schedule (``schedule``) and a selective-checkpointing
policy (``sac``); load them back with :func:`load_step` and :func:`apply_plan`."""

from acstudio.export.apply import ModelMismatchError, apply_plan
from acstudio.export.exporter import FORMATS, ExportError, export
from acstudio.export.loader import ExportMismatchError, LoadedStep, load_step

__all__ = ["FORMATS", "ExportError", "ExportMismatchError", "LoadedStep", "ModelMismatchError", "apply_plan",
           "export", "load_step"]
