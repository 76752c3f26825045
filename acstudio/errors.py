"""Errors the user can act on. The CLI prints their message without a traceback; the GUI shows it in a dialog."""


class ACStudioError(Exception):
    """Base class: a problem with the user's input or environment, explained in the message."""


class UnknownModelError(ACStudioError):
    """The model name is not in the zoo and is not a ``file.py:factory`` reference."""


class CaptureError(ACStudioError):
    """The training step could not be traced into one graph (e.g. data-dependent control flow)."""


class ProfileFileError(ACStudioError):
    """A profile or plan file is unreadable, corrupt, or of another schema version."""


class DeviceError(ACStudioError):
    """The requested device is not available (e.g. ``--device cuda`` on a machine without a GPU)."""


class OutOfMemoryError(ACStudioError):
    """The device ran out of memory; the message says which configuration and how far it got."""


class PlanMismatchError(ACStudioError):
    """A plan was applied to a profile (graph) other than the one it was made for."""


class Cancelled(ACStudioError):
    """A long engine call was cancelled through its :class:`~acstudio.jobs.CancelToken`."""


class CorruptFileError(ProfileFileError):
    """A profile or plan file breaks its schema; the message names the file, the field and what is wrong."""


class WrongSchemaError(ProfileFileError):
    """The file is an AC Studio document of another kind (a plan given where a profile is expected, ...)."""

    def __init__(self, message: str, found: str | None) -> None:
        super().__init__(message)
        self.found = found
