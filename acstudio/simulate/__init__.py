"""Whole-iteration memory and time simulation of plans: activations kept, recomputed or offloaded."""

from acstudio.simulate.simulator import TIMELINE_CATEGORIES, SimResult, Simulator

__all__ = ["TIMELINE_CATEGORIES", "SimResult", "Simulator"]
