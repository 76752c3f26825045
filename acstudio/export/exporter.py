"""Export a plan in one or more formats (see :mod:`acstudio.export.formats`) into one folder, atomically.

Formats: ``step`` (the rewritten graph as a drop-in step for :func:`acstudio.load_step`), ``schedule`` (every
recomputation in order) and ``sac`` (per-op decisions for :func:`acstudio.apply_plan`). The folder is written
as a whole or not at all, and lists its files in ``contents.json``: that is how a later export knows the folder
as an earlier export holding nothing else, which it may replace.
"""

from __future__ import annotations

import os
from pathlib import Path

from acstudio.errors import ProfileFileError
from acstudio.export import sac, schedule, step_module  # noqa: F401  (each registers its format)
from acstudio.export.formats import FORMATS, ExportError, ExportJob, chosen_formats
from acstudio.export.step_module import MANIFEST_SCHEMA, MANIFEST_VERSION
from acstudio.fileio import (
    FolderKind,
    atomic_dir,
    check_output,
    document_kind,
    earlier_output_or_new,
    read_document,
    write_document,
)
from acstudio.jobs import CancelToken, ProgressFn, check, report

__all__ = ["EXPORT_FOLDER", "FORMATS", "MANIFEST_SCHEMA", "MANIFEST_VERSION", "ExportError", "export",
           "export_folder_in"]

CONTENTS_FILE = "contents.json"
CONTENTS_SCHEMA = "acstudio.export_contents"
CONTENTS_VERSION = 1
# What an export written before contents.json existed may hold, and the files that mark one.
EARLIER_EXPORT_FILES = frozenset({"step.py", "constants.pt", "manifest.json", "report.md", "schedule.json",
                                  "schedule.csv", sac.POLICY_FILE})
EARLIER_EXPORT_MARKERS = {"manifest.json": document_kind("export manifest", MANIFEST_SCHEMA),
                          sac.POLICY_FILE: document_kind("SAC policy", sac.POLICY_SCHEMA)}


def _earlier_export(folder: Path) -> frozenset[str] | None:
    """The files of the earlier export in ``folder``, or ``None`` when it is not one."""
    try:
        return frozenset(read_document(folder / CONTENTS_FILE, CONTENTS_SCHEMA, CONTENTS_VERSION)["files"])
    except (ProfileFileError, KeyError, TypeError):
        pass
    marked = any(kind.recognise(folder / name) for name, kind in EARLIER_EXPORT_MARKERS.items())
    return EARLIER_EXPORT_FILES if marked else None


EXPORT_FOLDER = FolderKind("export", contents=_earlier_export, replaced=True)


def export_folder_in(picked: str | os.PathLike, name: str) -> Path:
    """Where an export into a folder picked in a file dialog goes: the picked folder itself when it is empty or
    an earlier export, else a new folder ``name`` inside it (``name-2``, ``name-3``... when taken), so that
    picking a folder that holds other files never destroys them and never fails."""
    picked = Path(picked)
    if earlier_output_or_new(picked, EXPORT_FOLDER):
        return picked
    candidates = (picked / (name if k == 1 else f"{name}-{k}") for k in range(1, 10_000))
    return next(c for c in candidates if earlier_output_or_new(c, EXPORT_FOLDER))


def export(profile, plan, out_dir: str | os.PathLike, formats: list[str] | None = None,
           progress: ProgressFn | None = None, cancel: CancelToken | None = None, *, force: bool = False,
           inputs: tuple[str | os.PathLike, ...] = ()) -> list[str]:
    """Write ``out_dir`` (replacing it as a whole) for ``plan`` (a ``Plan`` or a list of activation ids) on
    ``profile`` in ``formats`` (default: every format that applies); returns the paths written.

    ``out_dir`` must be new, empty or an earlier export holding nothing else (``force``: or holding more), and
    must not hold any of ``inputs`` (the files the export was made from)."""
    check_output(out_dir, EXPORT_FOLDER, inputs=inputs, force=force)
    job = ExportJob(profile, plan)
    names = chosen_formats(job, formats)
    files: list[str] = []
    with atomic_dir(out_dir, before_replacing=lambda: check_output(out_dir, EXPORT_FOLDER, inputs=inputs,
                                                                   force=force)) as tmp:
        for k, name in enumerate(names):
            check(cancel)
            report(progress, k, len(names), f"writing the {name} format")
            files += FORMATS[name].write(job, tmp)
        files.append(CONTENTS_FILE)
        write_document(tmp / CONTENTS_FILE, CONTENTS_SCHEMA, CONTENTS_VERSION, {"files": files})
    report(progress, len(names), len(names), "exported")
    return [str(Path(out_dir) / n) for n in files]
