"""Whole-iteration memory simulation of activation-recompute sets."""

from acstudio.simulate.simulator import TIMELINE_CATEGORIES, SimResult, Simulator

__all__ = ["TIMELINE_CATEGORIES", "SimResult", "Simulator"]
