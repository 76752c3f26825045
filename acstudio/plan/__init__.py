"""Activation-checkpointing planners (μ-TWO, baselines, the default ``auto``) and the ``Plan`` they produce."""

from acstudio.plan.loading import load_plan
from acstudio.plan.model import Plan, ScheduleEntry
from acstudio.plan.solvers import SOLVERS, plan, sweep
from acstudio.plan.solvers.mutwo import Trajectory, TrajectoryStep, candidates, mutwo_trajectory
from acstudio.units import format_bytes, parse_budget

__all__ = ["SOLVERS", "Plan", "ScheduleEntry", "Trajectory", "TrajectoryStep", "candidates", "format_bytes",
           "load_plan", "mutwo_trajectory", "parse_budget", "plan", "sweep"]
