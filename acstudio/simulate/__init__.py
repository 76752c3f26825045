"""Whole-iteration memory and time simulation of plans: activations kept, recomputed or offloaded."""

# Replay modes defined in modules of their own register themselves when imported. Python runs this file before
# any module of the package, so the registry in acstudio.simulate.modes is complete wherever it is read.
from acstudio.simulate import sac  # noqa: F401
from acstudio.simulate.simulator import TIMELINE_CATEGORIES, SimResult, Simulator

__all__ = ["TIMELINE_CATEGORIES", "SimResult", "Simulator"]
