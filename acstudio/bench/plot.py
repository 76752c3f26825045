"""PNG plots of a ``bench.json``: peak vs batch, step time vs batch, memory saving vs time overhead.

Separate from measuring on purpose: the GPU machine has no matplotlib, so results are plotted wherever the
JSON is copied to. matplotlib's object API is used without pyplot, so no GUI backend or global state is
touched.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from acstudio.bench.results import BenchResults, MiB
from acstudio.errors import ACStudioError
from acstudio.fileio import atomic_path


def _figure():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ACStudioError("plotting needs matplotlib, which is not installed here (pip install matplotlib); "
                            "the results JSON and CSV are complete without it") from None
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _save(fig, path: Path) -> Path:
    ax = fig.axes[0]
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    return path


def _batch_axis(ax, rows: list[dict[str, Any]], swept: list[int]) -> None:
    """A log2 batch axis, labelled at the swept sizes and powers of two (max-batch probes crowd it otherwise)."""
    sizes = [r["batch_size"] for r in rows if r["status"] == "ok"]
    if not sizes:
        return
    lo, hi = min(sizes), max(sizes)
    ticks = sorted({b for b in swept if lo <= b <= hi} | {2**k for k in range(hi.bit_length()) if lo <= 2**k <= hi})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(b) for b in ticks])
    ax.minorticks_off()


def _by_config(rows: list[dict[str, Any]], key: str) -> dict[str, list[dict[str, Any]]]:
    series: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r["status"] == "ok" and r.get(key) is not None:
            series.setdefault(r["config"], []).append(r)
    return {name: sorted(rs, key=lambda r: r["batch_size"]) for name, rs in series.items()}


def plot_results(results_json: str | os.PathLike, out_dir: str | os.PathLike) -> list[Path]:
    """Write ``peak_vs_batch.png``, ``time_vs_batch.png`` and ``memory_vs_overhead.png``; return their paths."""
    results = BenchResults.load(results_json)
    rows = results.compared()
    out = Path(out_dir)
    title = f"{results.meta['spec']['model']} on {results.meta['device']}"
    paths = []

    fig, ax = _figure()
    for name, rs in _by_config(rows, "peak_bytes").items():
        ax.plot([r["batch_size"] for r in rs], [r["peak_bytes"] / MiB for r in rs], marker="o", label=name)
    if results.meta.get("fit_budget_bytes"):
        ax.axhline(results.meta["fit_budget_bytes"] / MiB, color="grey", linestyle="--",
                   label=f"budget {results.meta['fit_budget']}")
    _batch_axis(ax, rows, results.meta.get("batch_sizes", []))
    ax.set(xlabel="batch size", ylabel="peak allocated (MiB)", title=f"Peak memory: {title}")
    paths.append(_save(fig, out / "peak_vs_batch.png"))

    fig, ax = _figure()
    for name, rs in _by_config(rows, "time_ms_median").items():
        median = [r["time_ms_median"] for r in rs]
        err = [[m - r["time_ms_q1"] for m, r in zip(median, rs)], [r["time_ms_q3"] - m for m, r in zip(median, rs)]]
        ax.errorbar([r["batch_size"] for r in rs], median, yerr=err, marker="o", capsize=3, label=name)
    _batch_axis(ax, rows, results.meta.get("batch_sizes", []))
    ax.set(xlabel="batch size", ylabel="step time (ms), median and IQR", title=f"Step time: {title}")
    paths.append(_save(fig, out / "time_vs_batch.png"))

    fig, ax = _figure()
    for name, rs in _by_config(rows, "memory_saving_pct").items():
        rs = [r for r in rs if r["time_vs_eager_pct"] is not None]
        ax.scatter([r["time_vs_eager_pct"] for r in rs], [r["memory_saving_pct"] for r in rs], label=name)
        for r in rs:
            ax.annotate(f"bs{r['batch_size']}", (r["time_vs_eager_pct"], r["memory_saving_pct"]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
    ax.axhline(0, color="grey", linewidth=0.5)
    ax.axvline(0, color="grey", linewidth=0.5)
    ax.set(xlabel="step time vs eager (%)", ylabel="peak memory saved vs eager (%)",
           title=f"Memory saved vs time overhead: {title}")
    paths.append(_save(fig, out / "memory_vs_overhead.png"))
    return paths
