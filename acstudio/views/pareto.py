"""How a solver's rows of a sweep appear on the Pareto chart. No Qt in here."""

from __future__ import annotations

import numpy as np
import pandas as pd

CURVE_MIN_POINTS = 4  # a solver with at least this many distinct operating points traces a curve


def pareto_shape(extra_ms, peak_bytes) -> tuple[np.ndarray, np.ndarray, bool]:
    """A solver's distinct operating points, by extra time, and whether they form a curve.

    A sweep asks every solver at many budgets; a baseline answers with the same plan at most of them, so its
    rows collapse to the one or two points it really is (recompute-all: one per replay mode), while a solver
    that adapts to the budget (μ-TWO, auto) leaves a curve.
    """
    points = np.stack([np.asarray(extra_ms, float), np.asarray(peak_bytes, float)], axis=1)
    points = np.unique(np.round(points, 6), axis=0) if len(points) else points.reshape(0, 2)
    return points[:, 0], points[:, 1], len(points) >= CURVE_MIN_POINTS


def measured_points(results: pd.DataFrame, batch_size: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Benchmarked operating points for the Pareto chart, (extra ms, peak bytes): the captured step at no extra
    time, then each rewritten plan's time over it. ``None`` when the benchmark of ``batch_size`` lacks either."""
    ok = results[(results["status"] == "ok") & (results["batch_size"] == batch_size)]
    captured = ok[ok["config"] == "captured"]
    rewritten = ok[ok["kind"] == "rewritten"]
    if not (len(captured) and len(rewritten)):
        return None
    base = float(captured["time_ms_median"].iloc[0])
    extra = np.concatenate([[0.0], rewritten["time_ms_median"].to_numpy(float) - base])
    peaks = np.concatenate([captured["peak_bytes"].to_numpy(float), rewritten["peak_bytes"].to_numpy(float)])
    return extra, peaks
