"""The ``schedule`` export format: every recomputation in the order it runs (``schedule.json``, ``schedule.csv``)."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
from pathlib import Path

from acstudio.export.formats import ExportFormat, ExportJob, register_format
from acstudio.plan.model import Plan
from acstudio.rewrite.rewriter import Recomputation, RewrittenStep


def write_schedule(directory: Path, step: RewrittenStep) -> list[str]:
    """``schedule.json`` and ``schedule.csv`` from the rewrite, for a plan given as a bare list of activation ids
    (a :class:`Plan` writes its own)."""
    rows = [dataclasses.asdict(r) for r in step.recomputations]
    (directory / "schedule.json").write_text(json.dumps(rows, indent=1), encoding="utf-8")
    with open(directory / "schedule.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=[fl.name for fl in dataclasses.fields(Recomputation)])
        writer.writeheader()
        writer.writerows({**row, "replay_nodes": " ".join(row["replay_nodes"])} for row in rows)
    return ["schedule.json", "schedule.csv"]


def write(job: ExportJob, directory: Path) -> list[str]:
    if isinstance(job.plan, Plan):
        return [os.path.basename(p) for p in job.plan.export_schedule(directory)]
    from acstudio.export.step_module import rewritten

    return write_schedule(directory, rewritten(job)[1])


register_format(ExportFormat("schedule", "schedule.json and schedule.csv: every recomputation, in the order it runs",
                             write))
