"""Export formats: each writes its own files for one plan into the export folder; ``export`` picks and runs them.

A format registers an :class:`ExportFormat` with :func:`register_format` when its module is imported
(:mod:`acstudio.export.exporter` imports them all). It says why it does not apply to a plan, if it does not, so
``acstudio export`` without ``--format`` writes every format that applies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from acstudio.errors import ACStudioError
from acstudio.profile.model import Profile


class ExportError(ACStudioError):
    """The plan cannot be written in a requested format."""


@dataclass
class ExportJob:
    """One export: the profile, the plan (a ``Plan`` or a bare list of activation ids) and what formats share."""

    profile: Profile
    plan: Any
    memo: dict[str, Any] = field(default_factory=dict)

    @cached_property
    def recomputed(self) -> list[str]:
        from acstudio.rewrite.rewriter import plan_activations

        return plan_activations(self.plan, self.profile)

    def once(self, key: str, make: Callable[[], Any]) -> Any:
        """``make()`` computed once per export (a rewrite or a policy that two formats use)."""
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]


@dataclass(frozen=True)
class ExportFormat:
    name: str
    summary: str  # what it writes and what it is for, in user-facing words
    write: Callable[[ExportJob, Path], list[str]]  # writes into the folder, returns the file names
    unavailable: Callable[[ExportJob], str] = lambda job: ""  # why the format does not apply ("" if it does)


FORMATS: dict[str, ExportFormat] = {}


def register_format(fmt: ExportFormat) -> ExportFormat:
    FORMATS[fmt.name] = fmt
    return fmt


def chosen_formats(job: ExportJob, requested: list[str] | None) -> list[str]:
    """The requested format names (all that apply when ``None``), each checked to exist and apply."""
    if requested is None:
        return [name for name, fmt in FORMATS.items() if not fmt.unavailable(job)]
    if not requested:
        raise ExportError(f"no export format given — choose from {', '.join(FORMATS)}")
    for name in requested:
        if name not in FORMATS:
            raise ExportError(f"unknown export format {name!r} — choose from {', '.join(FORMATS)}")
        why = FORMATS[name].unavailable(job)
        if why:
            raise ExportError(f"cannot export the {name} format: {why}")
    return list(dict.fromkeys(requested))
