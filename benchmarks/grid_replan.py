"""Which of the grid's rows does today's planner still make? For each shape's compiled part, the plan is made again
from the run's profile and calibration rows as ``acstudio bench`` made it (``acstudio.bench.steps.compiled_plan`` at
compile+per-op's measured peak, on one device, so it may offload), and set against the plan the run measured: the
same compiled extra time and offloaded bytes, or not. Likewise each eager part whose profile is committed: its
rewritten rows planned again at their budgets less bench's headroom, as ``prepare_rewritten`` plans them. A part
whose plans differ is out of date: rerun it (``benchmarks/grid.sh SHAPE OUT compiled|eager``) before quoting it as
today's.

Usage: PYTHONPATH=. python3 benchmarks/grid_replan.py [SHAPE ...]   (default: every shape in results/grid)
Runs on a CPU, about a minute a part.
"""

import json
import sys
from pathlib import Path

from acstudio.bench.steps import compiled_plan, with_headroom
from acstudio.export.sac import SacPolicy
from acstudio.plan import plan as plan_budget
from acstudio.plan.compiled import CompiledTimes
from acstudio.profile.model import Profile

GRID = Path("results/grid")
GiB = 2**30


def compiled_times_of(rows: dict[str, dict]) -> CompiledTimes:
    """The step times a compiled part's calibration rows (by configuration) hand its plan, as the bench hands them."""
    plain, per_op = rows["compile"], rows["compile+per-op"]
    regions = rows.get("compile+per-op+regions")  # measured by the bench since 2026-11-29 (the fifteenth session)
    return CompiledTimes(plain["time_ms_median"], rows["compile+per-block"]["time_ms_median"], per_op["time_ms_median"],
                         regions["time_ms_median"] if regions else None,
                         bool(regions and regions.get("details", {}).get("mask_bias")),
                         plain.get("details", {}).get("host_issue_ms"))  # measured since the twentieth session


def compiled_plan_of(rows: dict[str, dict], profile: Profile):
    """The plan ``acstudio bench`` makes for a compiled part's ``sac+compile@compile+per-op`` row, from the part's
    calibration rows (by configuration) and its profile."""
    per_block, per_op = rows["compile+per-block"], rows["compile+per-op"]
    budget = int(per_op["peak_bytes"])
    second_peak = budget if per_op["peak_bytes"] > per_block["peak_bytes"] else None
    return compiled_plan(profile, budget, int(per_block["peak_bytes"]), second_peak, compiled_times_of(rows),
                         one_device=True)


def replan(shape: str) -> str:
    """The compiled part's plan made again against the one it ran: the same price and bytes, and each offloaded
    block's copies fetched at the same block (runs before 2026-11-29's twenty-first session record no fetches: their
    export placed them on the profile's eager times, as :meth:`SacPolicy.from_plan` does for a plan without)."""
    rows = {r["config"]: r for r in json.loads((GRID / f"{shape}.compiled.json").read_text())["rows"]}
    profile = Profile.load(GRID / "profiles" / f"{shape}.compiled.json.gz")
    plan = compiled_plan_of(rows, profile)
    ran = rows["sac+compile@compile+per-op"]["details"]["plan"]
    same = (abs(plan.compiled_extra_ms - ran["compiled_extra_ms"]) < 1e-6
            and plan.offload_bytes == ran.get("offload_bytes", 0))
    fetches = ""
    if same and plan.region_fetches:
        ran_fetches = ran.get("region_fetches") or SacPolicy.from_plan(profile, plan.recomputed, plan.offloaded,
                                                                       plan.replay_mode).regions
        if ran_fetches != plan.region_fetches:
            same, fetches = False, f"; copies fetched {fetch_places(plan.region_fetches, ran_fetches)}"
    return (f"{shape:16s} {'current' if same else 'OUT OF DATE':11s} today: {plan.offload_bytes / GiB:5.2f} GiB "
            f"offloaded, +{plan.compiled_extra_ms:.2f} ms over compile; measured plan: "
            f"{ran.get('offload_bytes', 0) / GiB:5.2f} GiB, +{ran['compiled_extra_ms']:.2f} ms predicted{fetches}")


def fetch_places(today: dict[str, str], ran: dict[str, str]) -> str:
    """Where each block's copies come back, today's against the run's."""
    return "; ".join(f"{b} at {today[b]} / {ran[b]}" for b in today if b in ran)


def replan_eager(shape: str) -> str:
    """The eager part's rewritten rows planned again, each ``predicted / measured plan's predicted`` extra time."""
    rows = json.loads((GRID / f"{shape}.eager.json").read_text())["rows"]
    profile = Profile.load(GRID / "profiles" / f"{shape}.eager.json.gz")
    same, cells = True, []
    for row in rows:
        if row["kind"] != "rewritten" or row["status"] != "ok":
            continue
        ran = row["details"]["plan"]
        plan = plan_budget(profile, with_headroom(row["details"]["budget_bytes"]))
        same &= abs(plan.predicted_extra_ms - ran["predicted_extra_ms"]) < 1e-6 and plan.offload_bytes == ran.get(
            "offload_bytes", 0)
        cells.append(f"{row['arg']} +{plan.predicted_extra_ms:.2f} / +{ran['predicted_extra_ms']:.2f} ms "
                     f"({plan.offload_bytes / GiB:.2f} / {ran.get('offload_bytes', 0) / GiB:.2f} GiB)")
    verdict = "current" if same else "OUT OF DATE"
    return f"{shape + ' eager':16s} {verdict:11s} today / measured plan: " + "; ".join(cells)


def main(shapes: list[str]) -> int:
    for shape in shapes or sorted({p.name.split(".")[0] for p in GRID.glob("*.json")}):
        if (GRID / f"{shape}.compiled.json").is_file():
            print(replan(shape), flush=True)
        if (GRID / "profiles" / f"{shape}.eager.json.gz").is_file():
            print(replan_eager(shape), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
