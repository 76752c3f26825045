"""Errors the user can act on. The CLI prints their message without a traceback; the GUI shows it in a dialog."""


class ACStudioError(Exception):
    """Base class: a problem with the user's input or environment, explained in the message."""


class UnknownModelError(ACStudioError):
    """The model name is not in the zoo and is not a ``file.py:factory`` reference."""


class ConfigError(ACStudioError):
    """A workload setting (``--config`` key, sequence length, ...) is unknown or breaks a rule of the model."""


class CaptureError(ACStudioError):
    """The training step could not be traced into one graph (e.g. data-dependent control flow)."""


class ProfileFileError(ACStudioError):
    """A profile or plan file is unreadable, corrupt, or of another schema version."""


class OutputPathError(ACStudioError):
    """An output file or folder cannot be written, or writing it would destroy something the user owns."""


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


_MAX_CHARS = 300
_OUT_OF_MEMORY = ("OutOfMemoryError", "MemoryError")


def one_line(text: str) -> str:
    """``text`` on one line, shortened: messages from torch or transformers can span screens."""
    text = " ".join(str(text).split())
    return text if len(text) <= _MAX_CHARS else text[:_MAX_CHARS - 1] + "…"


def describe_failure(exc: BaseException) -> str:
    """``<what> — <what to do>`` for any failure, ours or not, so the CLI never shows a raw traceback."""
    if isinstance(exc, ACStudioError):
        return one_line(exc)
    message = one_line(exc) or type(exc).__name__
    if type(exc).__name__ in _OUT_OF_MEMORY or "can't allocate memory" in message or "not enough memory" in message:
        return f"out of memory ({message}) — try a smaller batch size, sequence length or model"
    if isinstance(exc, OSError):
        return f"{message} — check the path, its permissions and the free disk space"
    return (f"unexpected {type(exc).__name__}: {message} — if the input looks right, this is a bug in AC Studio or "
            "in the model's code: rerun with --debug and report the traceback")


class RewriteError(ACStudioError):
    """The plan cannot be applied: it would replay a node that must not run twice, or names no activation."""
