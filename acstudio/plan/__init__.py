"""Activation-checkpointing planners (μ-TWO and baselines) and the ``Plan`` they produce."""

from acstudio.plan.budget import format_bytes, parse_budget
from acstudio.plan.model import Plan, ScheduleEntry
from acstudio.plan.mutwo import SOLVERS, Trajectory, TrajectoryStep, candidates, mutwo_trajectory, plan, sweep

__all__ = ["SOLVERS", "Plan", "ScheduleEntry", "Trajectory", "TrajectoryStep", "candidates", "format_bytes",
           "mutwo_trajectory", "parse_budget", "plan", "sweep"]
