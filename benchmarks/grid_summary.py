"""The transformer grid's headline ratios, recomputed from its committed result files, so that the table in
docs/results.md and the README's best and worst shapes can be checked against the measurements they quote.

Usage: python benchmarks/grid_summary.py [RESULTS_DIR]   (default results/grid)

Per shape, each ratio from one run (one bench file; a shape run in parts takes its eager rows from
``SHAPE.eager.json`` or ``SHAPE.json`` and its compiled rows from ``SHAPE.compiled.json`` where that exists):
our overhead over HF GC's at HF GC's peak and at 1.15x it, our step over per-op's at per-op's peak, our compiled
step over ``compile+per-op``'s at its peak. Each is marked ``OVER`` where our row peaked above its budget,
``slower`` where our step is slower than the peer's by more than the larger of the two IQRs, and followed by the
measured peak against the predicted one. The card each part ran on closes the line. Under the table, how close
every planned row's step came to its prediction (issue 27 asks 3%). ``tests/test_grid_claims.py`` holds the
README's claims to these files.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from acstudio.bench.results import BenchResults, compare

# (column, our row, the peer's row, how they compare)
RATIOS = [
    ("HF GC's peak", "rewritten@per-block", "per-block", "overhead"),
    ("1.15x it", "rewritten@per-block*1.15", "per-block", "overhead"),
    ("per-op's peak", "rewritten@per-op", "per-op", "step"),
    ("compile+per-op's peak", "sac+compile@compile+per-op", "compile+per-op", "step"),
]


def parts(folder: Path) -> dict[str, list[Path]]:
    """Shape name -> its result files, the combined or eager part first and the compiled part last."""
    shapes: dict[str, list[Path]] = {}
    for path in sorted(folder.glob("*.json")):
        shapes.setdefault(path.name.split(".")[0], []).append(path)
    return {s: sorted(p, key=lambda f: f.name.endswith(".compiled.json")) for s, p in shapes.items()}


def rows_by_config(paths: list[Path]) -> dict[str, dict]:
    """Every configuration's compared row (its run's baselines and loss check), a later part's replacing an
    earlier one's."""
    rows: dict[str, dict] = {}
    for path in paths:
        for row in compare(BenchResults.load(path).rows):
            rows[row["config"]] = row | {"file": path.name}
    return rows


@dataclass(frozen=True)
class Ratio:
    """One ratio of one shape: ours over the peer's (overheads or steps), whether our row fit its budget, whether
    it was slower than the peer beyond the larger IQR (steps only), and its measured peak against the predicted
    one, in percent."""

    value: float
    how: str
    fits: bool | None
    slower: bool
    peak_error_pct: float | None

    def __str__(self) -> str:
        text = f"{self.value:.2f}x" if self.how == "overhead" else f"{self.value:.4f}"
        text += " slower" if self.slower else ""
        text += " OVER" if self.fits is False else ""
        return text + ("" if self.peak_error_pct is None else f" (peak {self.peak_error_pct:+.2f}%)")


def ratio(rows: dict[str, dict], ours: str, peer: str, how: str) -> Ratio | None:
    mine, theirs = rows.get(ours), rows.get(peer)
    if not mine or not theirs or mine.get("status") != "ok" or theirs.get("status") != "ok":
        return None
    slower = False
    if how == "overhead":
        eager = rows.get("eager")
        if not eager or eager["file"] != mine["file"]:
            return None
        value = ((mine["time_ms_median"] - eager["time_ms_median"])
                 / (theirs["time_ms_median"] - eager["time_ms_median"]))
    else:
        value = mine["time_ms_median"] / theirs["time_ms_median"]
        slack = max(mine["time_ms_iqr"], theirs["time_ms_iqr"])
        slower = mine["time_ms_median"] - theirs["time_ms_median"] > slack
    return Ratio(value, how, mine.get("fits_budget"), slower, mine.get("peak_error_pct"))


def summary(folder: Path) -> dict[str, tuple[dict[str, Ratio | None], list[str]]]:
    """Shape -> (column -> its ratio, the cards its parts ran on)."""
    out = {}
    for shape, paths in parts(folder).items():
        rows = rows_by_config(paths)
        cards = sorted({(r.get("environment") or {}).get("gpu", "?").replace("NVIDIA ", "") for r in rows.values()})
        out[shape] = ({column: ratio(rows, ours, peer, how) for column, ours, peer, how in RATIOS}, cards)
    return out


def step_errors(folder: Path) -> dict[str, float]:
    """``"FILE STEM: CONFIG"`` -> predicted step over measured, less 1, for every planned row of every part. A
    rewritten row's predicted step is the captured step (the graph run as captured, in the same run) plus its plan's
    predicted extra time; a compiled row's, compile's step plus its compiled extra time. Rows of runs with no such
    reference row in the same file (the grid's first files) are left out."""
    errors = {}
    for path in sorted(folder.glob("*.json")):
        rows = {r["config"]: r for r in json.loads(path.read_text())["rows"] if r["status"] == "ok"}
        for name, row in rows.items():
            plan = (row.get("details") or {}).get("plan")
            if plan is None:
                continue
            if row["kind"] == "rewritten" and "captured" in rows:
                predicted = rows["captured"]["time_ms_median"] + plan["predicted_extra_ms"]
            elif plan.get("compiled_extra_ms") is not None and "compile" in rows:
                predicted = rows["compile"]["time_ms_median"] + plan["compiled_extra_ms"]
            else:
                continue
            errors[f"{path.stem}: {name}"] = predicted / row["time_ms_median"] - 1
    return errors


def main() -> None:
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "results/grid")
    shapes = summary(folder)
    if not shapes:
        sys.exit(f"no grid result files in {folder}")
    print("| shape | " + " | ".join(c for c, *_ in RATIOS) + " | cards |")
    print("|---" * (len(RATIOS) + 2) + "|")
    for shape, (ratios, cards) in shapes.items():
        cells = ["-" if r is None else str(r) for r in ratios.values()]
        print(f"| {shape} | " + " | ".join(cells) + f" | {', '.join(cards)} |")
    errors = step_errors(folder)
    if errors:
        worst = max(errors, key=lambda k: abs(errors[k]))
        print(f"\nsteps against their prediction, {len(errors)} planned rows: worst {worst}, predicted "
              f"{errors[worst]:+.2%} of the measured step")


if __name__ == "__main__":
    main()
