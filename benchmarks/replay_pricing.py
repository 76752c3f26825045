"""How well does each way of pricing a replay predict the measured cost of the rewritten step? For bench runs whose
profile holds each node's device time (``Profile.node_device_ms``, measured since 2026-11-28), every rewritten row's
plan is made again from the profile and its budget (as the bench made it: the same code gives the same plan, which
the script checks against the row's predicted time), then simulated with per-node replay prices from each model
below, and its predicted time over the captured step set against the measured one.

Models (per node; ``t`` its node-by-node time, ``d`` its device time, ``T`` the whole step's measured time, ``h``
the host's time to issue one node of the whole step, ``Profile.node_issue_ms``):
  scaled      t * T / sum(t)                    the planner's today (``Profile.time_scale``)
  device      d                                 the device's work alone: the host hidden behind it
  device|host max(d, h) for a node that runs    whichever of device and host limits the node
  device+gap  d + (t - d) * s, s = (T - sum d) / sum(t - d): the step's time beyond the device's own work spread
              over the nodes as their launch gaps were
  device*T    d * T / sum(d)                    device times scaled to the step, as ``scaled`` scales node times:
              kernels that overlap or run faster inside the step (sum d > T) or a host that stretches it (sum d < T)

Usage: PYTHONPATH=. python3 benchmarks/replay_pricing.py BENCH_JSON PROFILE [BENCH_JSON PROFILE ...]
(a grid shape's eager part: results/grid/SHAPE.eager.json results/grid/profiles/SHAPE.eager.json.gz). Runs on a CPU.
"""

import json
import sys

import numpy as np

from acstudio.bench.steps import with_headroom
from acstudio.plan.solvers import plan as plan_budget
from acstudio.profile.model import Profile
from acstudio.simulate.modes import simulate_plan
from acstudio.simulate.replay import ReplayGraph
from acstudio.simulate.simulator import Simulator

UNISSUED = ("placeholder", "get_attr", "output")


def prices(profile: Profile) -> dict[str, np.ndarray]:
    """Per node, what a replay of it costs under each model."""
    t = np.array([n.run_time_ms for n in profile.nodes])
    d = np.minimum(np.array(profile.node_device_ms), t)
    runs = np.array([n.op not in UNISSUED for n in profile.nodes])
    gaps = (t - d).sum()
    spread = min(max((profile.iteration_ms - d.sum()) / gaps, 0.0), 1.0) if gaps > 0 else 0.0
    return {"scaled": t * profile.time_scale, "device": d,
            "device|host": np.where(runs, np.maximum(d, profile.node_issue_ms), 0.0),
            "device+gap": d + (t - d) * spread, "device*T": d * profile.iteration_ms / d.sum()}


def main(args: list[str]) -> int:
    if len(args) < 2 or len(args) % 2:
        print(__doc__.strip().splitlines()[-2], file=sys.stderr)
        return 2
    errors: dict[str, list[float]] = {}
    for bench_path, profile_path in zip(args[::2], args[1::2]):
        profile = Profile.load(profile_path)
        if profile.node_device_ms is None:
            print(f"{profile_path}: no device times (profiled before 2026-11-28) — profile it again", file=sys.stderr)
            return 1
        rows = {r["config"]: r for r in json.load(open(bench_path))["rows"] if r["status"] == "ok"}
        captured = rows["captured"]["time_ms_median"]
        models = prices(profile)
        sims = {name: Simulator(profile, ReplayGraph(profile, node_ms=p)) for name, p in models.items()}
        d, t = np.array(profile.node_device_ms), np.array([n.run_time_ms for n in profile.nodes])
        print(f"{bench_path}: captured {captured:.1f} ms, whole step {profile.iteration_ms:.1f}, host issue "
              f"{profile.host_issue_ms or 0:.1f}; node by node {t.sum():.1f}, device {d.sum():.1f}")
        print(f"  {'row':34s} {'measured':>9s} " + " ".join(f"{m:>12s}" for m in models) + "  (ms over captured)")
        for name, row in rows.items():
            if row["kind"] != "rewritten":
                continue
            plan = plan_budget(profile, with_headroom(row["details"]["budget_bytes"]))
            same = abs(plan.predicted_extra_ms - row["details"]["plan"]["predicted_extra_ms"]) < 1e-6
            measured = row["time_ms_median"] - captured
            predicted = {m: simulate_plan(sim, plan.recomputed, plan.replay_mode, plan.offloaded).extra_ms
                         for m, sim in sims.items()}
            for m, p in predicted.items():
                errors.setdefault(m, []).append((p - measured) / captured * 100)
            print(f"  {name:34s} {measured:9.2f} " + " ".join(f"{p:12.2f}" for p in predicted.values())
                  + ("" if same else "   (plan made again differs from the row's)"))
    print("error in % of the captured step, worst |error| and mean |error|:")
    for m, e in errors.items():
        e = np.abs(e)
        print(f"  {m:12s} worst {e.max():5.1f}%  mean {e.mean():5.1f}%  ({len(e)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
