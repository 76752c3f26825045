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
from acstudio.fileio import atomic_dir, prepare_output_dir
from acstudio.jobs import CancelToken, ProgressFn, check, report

__all__ = ["FORMATS", "MANIFEST_SCHEMA", "MANIFEST_VERSION", "ExportError", "export"]


def export(profile, plan, out_dir: str | os.PathLike, formats: list[str] | None = None,
           progress: ProgressFn | None = None, cancel: CancelToken | None = None, *, force: bool = False
           ) -> list[str]:
    """Write ``out_dir`` (replacing it as a whole) for ``plan`` (a ``Plan`` or a list of activation ids) on
    ``profile`` in ``formats`` (default: every format that applies); returns the paths written.

    A non-empty ``out_dir`` that is not an earlier export is refused unless ``force``."""
    prepare_output_dir(out_dir, force=force, markers={"manifest.json": MANIFEST_SCHEMA,
                                                      sac.POLICY_FILE: sac.POLICY_SCHEMA})
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
