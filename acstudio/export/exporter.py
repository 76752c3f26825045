"""Export a plan in one or more formats (see :mod:`acstudio.export.formats`) into one folder, atomically.

Formats: ``step`` (the rewritten graph as a drop-in step for :func:`acstudio.load_step`), ``schedule`` (every
recomputation in order) and ``sac`` (per-op decisions for :func:`acstudio.apply_plan`). The folder is written
as a whole or not at all.
"""

from __future__ import annotations

import os
from pathlib import Path

from acstudio.export import sac, schedule, step_module  # noqa: F401  (each registers its format)
from acstudio.export.formats import FORMATS, ExportError, ExportJob, chosen_formats
from acstudio.export.step_module import MANIFEST_SCHEMA, MANIFEST_VERSION
from acstudio.fileio import atomic_dir, prepare_output_dir, replaceable_dir
from acstudio.jobs import CancelToken, ProgressFn, check, report

__all__ = ["FORMATS", "MANIFEST_SCHEMA", "MANIFEST_VERSION", "ExportError", "export", "export_folder_in"]

# The files that mark a folder as an earlier export (which a new export may replace).
EXPORT_MARKERS = {"manifest.json": MANIFEST_SCHEMA, sac.POLICY_FILE: sac.POLICY_SCHEMA}


def export_folder_in(picked: str | os.PathLike, name: str) -> Path:
    """Where an export into a folder picked in a file dialog goes: the picked folder itself when it is empty or
    an earlier export, else a new folder ``name`` inside it (``name-2``, ``name-3``... when taken), so that
    picking a folder that holds other files never destroys them and never fails."""
    picked = Path(picked)
    if replaceable_dir(picked, EXPORT_MARKERS):
        return picked
    candidates = (picked / (name if k == 1 else f"{name}-{k}") for k in range(1, 10_000))
    return next(c for c in candidates if replaceable_dir(c, EXPORT_MARKERS))


def export(profile, plan, out_dir: str | os.PathLike, formats: list[str] | None = None,
           progress: ProgressFn | None = None, cancel: CancelToken | None = None, *, force: bool = False
           ) -> list[str]:
    """Write ``out_dir`` (replacing it as a whole) for ``plan`` (a ``Plan`` or a list of activation ids) on
    ``profile`` in ``formats`` (default: every format that applies); returns the paths written.

    A non-empty ``out_dir`` that is not an earlier export is refused unless ``force``."""
    prepare_output_dir(out_dir, force=force, markers=EXPORT_MARKERS)
    job = ExportJob(profile, plan)
    names = chosen_formats(job, formats)
    files: list[str] = []
    with atomic_dir(out_dir) as tmp:
        for k, name in enumerate(names):
            check(cancel)
            report(progress, k, len(names), f"writing the {name} format")
            files += FORMATS[name].write(job, tmp)
    report(progress, len(names), len(names), "exported")
    return [str(Path(out_dir) / n) for n in files]
